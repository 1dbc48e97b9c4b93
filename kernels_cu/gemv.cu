// Decode projections are pure weight streaming (bf16, read once per token), so one warp owns
// one output row and streams it with 16-byte loads, U vectors in flight per lane; up to
// MAX_ROWS token rows share each weight load (decode_k's verify). A row's fma order and
// reduction tree do not depend on M, which is what makes decode_k bit-identical to decodes.
#include "common.cuh"

#define MAX_ROWS 8
#define WARPS 8
#define U 4

extern "C" __global__ void __launch_bounds__(WARPS * 32)
dense_gemv_bf16(const bf16* __restrict__ W, const bf16* __restrict__ x, bf16* __restrict__ y,
                int N, int K, int M, int ldx, int ldy) {
    const int lane = threadIdx.x & 31;
    const int n = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (n >= N) return;
    const uint4* w4 = reinterpret_cast<const uint4*>(W + (u64)n * K);
    const int K8 = K >> 3;
    float acc[MAX_ROWS];
#pragma unroll
    for (int m = 0; m < MAX_ROWS; ++m) acc[m] = 0.0f;
    for (int base = lane; base < K8; base += 32 * U) {
        uint4 wv[U];
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (base + 32 * u < K8) wv[u] = ld_stream(w4 + base + 32 * u);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = base + 32 * u;
            if (i >= K8) break;
            float wf[8];
            unpack8(wv[u], wf);
#pragma unroll
            for (int m = 0; m < MAX_ROWS; ++m) {
                if (m >= M) break;
                float xf[8];
                unpack8(__ldg(reinterpret_cast<const uint4*>(x + (u64)m * ldx) + i), xf);
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[m] = __fmaf_rn(wf[j], xf[j], acc[m]);
            }
        }
    }
#pragma unroll
    for (int m = 0; m < MAX_ROWS; ++m) {
        if (m >= M) break;
        const float s = warp_sum(acc[m]);
        if (lane == 0) y[(u64)m * ldy + n] = f2bf(s);
    }
}
