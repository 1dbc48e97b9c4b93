// Decode projections are pure weight streaming (bf16, read once per token), so one warp owns
// one output row and streams it with 16-byte loads, U vectors in flight per lane; up to
// MAX_ROWS token rows share each weight load (decode_k's verify). Every kernel here reduces a
// row with the same gemv_row_dot, whose fma order and reduction tree do not depend on M:
// that is what makes decode_k bit-identical to K decodes.
#include "gate.cuh"

#define MAX_ROWS 8
#define WARPS 8
#define U 4

// acc[m] = W[n, :K] . x[m, :K] for m < M, reduced across the warp (every lane gets it).
__device__ __forceinline__ void gemv_row_dot(const bf16* __restrict__ Wrow,
                                             const bf16* __restrict__ x, int K, int M, int ldx,
                                             float acc[MAX_ROWS]) {
    const int lane = threadIdx.x & 31;
    const uint4* w4 = reinterpret_cast<const uint4*>(Wrow);
    const int K8 = K >> 3;
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
    for (int m = 0; m < MAX_ROWS; ++m)
        if (m < M) acc[m] = warp_sum(acc[m]);
}

// y[m, n] = bf16(W[n] . x[m]): the o_proj of decode.
extern "C" __global__ void __launch_bounds__(WARPS * 32)
dense_gemv_bf16(const bf16* __restrict__ W, const bf16* __restrict__ x, bf16* __restrict__ y,
                int N, int K, int M, int ldx, int ldy) {
    const int n = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (n >= N) return;
    float acc[MAX_ROWS];
    gemv_row_dot(W + (u64)n * K, x, K, M, ldx, acc);
    if ((threadIdx.x & 31) != 0) return;
#pragma unroll
    for (int m = 0; m < MAX_ROWS; ++m)
        if (m < M) y[(u64)m * ldy + n] = f2bf(acc[m]);
}

// The packed input projection q|k|v|f_a|g_a|b of decode: rows go to proj [M, ldp], and the
// q|k|v rows also straight to qkv_proj [M, 3*qkv] and qkv_parts [3, M, qkv] (no pack launch).
extern "C" __global__ void __launch_bounds__(WARPS * 32)
proj_gemv_bf16(const bf16* __restrict__ W, const bf16* __restrict__ x, bf16* __restrict__ proj,
               bf16* __restrict__ qkv_parts, bf16* __restrict__ qkv_proj, int N, int K, int M,
               int ldp, int qkv) {
    const int n = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (n >= N) return;
    float acc[MAX_ROWS];
    gemv_row_dot(W + (u64)n * K, x, K, M, K, acc);
    if ((threadIdx.x & 31) != 0) return;
#pragma unroll
    for (int m = 0; m < MAX_ROWS; ++m) {
        if (m >= M) break;
        const bf16 v = f2bf(acc[m]);
        proj[(u64)m * ldp + n] = v;
        if (n < 3 * qkv) {
            qkv_proj[(u64)m * 3 * qkv + n] = v;
            qkv_parts[((u64)(n / qkv) * M + m) * qkv + n % qkv] = v;
        }
    }
}

// The low-rank gates of decode, one launch: output rows [0, qkv) are g_raw = f_b . f_a with
// the forget gate computed from the rounded value; [qkv, 2*qkv) are out_gate = g_b . g_a;
// the last H rows are beta = sigmoid(b). f_a, g_a, b are columns of proj [M, ldp].
extern "C" __global__ void __launch_bounds__(WARPS * 32)
lowrank_gate_gemv(const bf16* __restrict__ f_b, const bf16* __restrict__ g_b,
                  const bf16* __restrict__ proj, int ldp, const float* __restrict__ a_log,
                  const float* __restrict__ dt_bias, bf16* __restrict__ g_raw,
                  bf16* __restrict__ out_gate, float* __restrict__ gate, float* __restrict__ beta,
                  int M, int H, int D, int R, float lower_bound, int bounded) {
    const int qkv = H * D, lane = threadIdx.x & 31;
    const int n = blockIdx.x * WARPS + (threadIdx.x >> 5);
    const bf16* f_a = proj + 3 * qkv;
    if (n < 2 * qkv) {
        const bool is_f = n < qkv;
        const int c = is_f ? n : n - qkv;
        float acc[MAX_ROWS];
        gemv_row_dot((is_f ? f_b : g_b) + (u64)c * R, is_f ? f_a : f_a + R, R, M, ldp, acc);
        if (lane != 0) return;
#pragma unroll
        for (int m = 0; m < MAX_ROWS; ++m) {
            if (m >= M) break;
            const bf16 v = f2bf(acc[m]);
            if (is_f) {
                g_raw[(u64)m * qkv + c] = v;
                gate[(u64)m * qkv + c] =
                    kda_gate_value(bf2f(v) + dt_bias[c], expf(a_log[c / D]), lower_bound, bounded);
            } else {
                out_gate[(u64)m * qkv + c] = v;
            }
        }
    } else if (n < 2 * qkv + H && lane == 0) {
        const int h = n - 2 * qkv;
        for (int m = 0; m < M; ++m)
            beta[(u64)m * H + h] = sigmoidf_(bf2f(proj[(u64)m * ldp + 3 * qkv + 2 * R + h]));
    }
}
