// The output gate's formula, shared by prefill's gated_rmsnorm and decode's fused kernel so a
// core row gives the same bf16 bits on either path.
#pragma once
#include "common.cuh"

// RMSNorm over one (token, head) vector of D values held by a warp, DL adjacent values a lane
// (x[e] is value DL lane + e; w and g alike), times o_norm's weight and sigmoid(out_gate):
// y[e / 2] packs outputs e, e + 1 as bf16.
template <int DL>
__device__ __forceinline__ void gated_rms(const float (&x)[DL], const float (&w)[DL],
                                          const float (&g)[DL], int D, float eps,
                                          unsigned (&y)[DL / 2]) {
    float ss = 0.0f;
#pragma unroll
    for (int e = 0; e < DL; ++e) ss = __fmaf_rn(x[e], x[e], ss);
    const float inv = 1.0f / sqrtf(warp_sum(ss) / D + eps);
#pragma unroll
    for (int e = 0; e < DL; e += 2)
        y[e / 2] = pack_bf16x2(x[e] * inv * w[e] * sigmoidf_(g[e]),
                               x[e + 1] * inv * w[e + 1] * sigmoidf_(g[e + 1]));
}
