// One decode token of the delta rule. The state [H, Dv, Dk] fp32 is the only large traffic
// (read and written once), so one warp owns one state row (h, v): the row's Dk floats are
// contiguous, each lane holding D/32 of them in registers through decay, the k.S dot, the
// rank-one update and the q.S dot. q and k arrive L2-normalised from conv_decode.
#include "common.cuh"

template <int D>
__device__ __forceinline__ void kda_recurrent_body(const bf16* __restrict__ row,
                                                   const float* __restrict__ gate,
                                                   const float* __restrict__ beta,
                                                   float* __restrict__ state,
                                                   float* __restrict__ core, int H, float scale) {
    constexpr int E = D / 32;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (r >= H * D) return;
    const int h = r / D, j = r % D, qkv = H * D;
    float* S = state + (u64)r * D;
    const bf16* q = row + h * D;
    const bf16* k = row + qkv + h * D;
    float s[E], kf[E];
    float ks = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const int d = lane * E + e;
        kf[e] = bf2f(k[d]);
        s[e] = S[d] * expf(gate[h * D + d]);
        ks = __fmaf_rn(s[e], kf[e], ks);
    }
    ks = warp_sum(ks);
    const float bres = beta[h] * (bf2f(row[2 * qkv + h * D + j]) - ks);
    float o = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        const int d = lane * E + e;
        s[e] = __fmaf_rn(bres, kf[e], s[e]);
        o = __fmaf_rn(s[e], bf2f(q[d]) * scale, o);
        S[d] = s[e];
    }
    o = warp_sum(o);
    if (lane == 0) core[h * D + j] = o;
}

#define KDA_RECURRENT(D)                                                                     \
    extern "C" __global__ void kda_recurrent_d##D(const bf16* row, const float* gate,        \
                                                  const float* beta, float* state,           \
                                                  float* core, int H, float scale) {         \
        kda_recurrent_body<D>(row, gate, beta, state, core, H, scale);                      \
    }
KDA_RECURRENT(64)
KDA_RECURRENT(128)
