// Output gate: RMSNorm over each head's D core values, times o_norm weight and
// sigmoid(out_gate); one warp per (token, head).
#include "common.cuh"

extern "C" __global__ void gated_rmsnorm(const float* __restrict__ core,
                                         const bf16* __restrict__ out_gate,
                                         const float* __restrict__ w, bf16* __restrict__ out,
                                         int T, int H, int D, float eps) {
    const int vec = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (vec >= T * H) return;
    const float* c = core + (u64)vec * D;
    float v[4];
    float ss = 0.0f;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        if (e >= D / 32) break;
        v[e] = c[lane + 32 * e];
        ss = __fmaf_rn(v[e], v[e], ss);
    }
    const float inv = 1.0f / sqrtf(warp_sum(ss) / D + eps);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        if (e >= D / 32) break;
        const int d = lane + 32 * e;
        const u64 o = (u64)vec * D + d;
        out[o] = f2bf(v[e] * inv * w[d] * sigmoidf_(bf2f(out_gate[o])));
    }
}
