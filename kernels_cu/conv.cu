// The prefill side of the short causal depthwise conv over time, with the carried conv state
// [W-1, conv_dim] (oldest row first) standing in for the rows before the first token. Decode's
// conv is fused into kda_decode_row (recurrent.cu).
#include "common.cuh"

// One thread per (token, channel); output is conv + SiLU rounded to bf16 (the L2
// norm runs after, in place, on the bf16 values).
extern "C" __global__ void conv_prefill(const bf16* __restrict__ x, const bf16* __restrict__ state,
                                        const float* __restrict__ w, bf16* __restrict__ out,
                                        int T, int conv_dim, int W) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)T * conv_dim) return;
    const int t = (int)(i / conv_dim), c = (int)(i % conv_dim);
    float acc = 0.0f;
    for (int j = 0; j < W; ++j) {
        const int r = t + j - (W - 1);
        const bf16 v = r < 0 ? state[(u64)(W - 1 + r) * conv_dim + c] : x[(u64)r * conv_dim + c];
        acc = __fmaf_rn(w[(u64)j * conv_dim + c], bf2f(v), acc);
    }
    out[i] = f2bf(acc * sigmoidf_(acc));
}

// After conv_prefill: the state becomes the last W-1 rows of (state ++ x). New row j reads
// source row T+j > j, so one thread walking its channel upwards never reads a row it wrote.
extern "C" __global__ void conv_roll_state(const bf16* __restrict__ x, bf16* __restrict__ state,
                                           int T, int conv_dim, int W) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= conv_dim) return;
    for (int j = 0; j < W - 1; ++j) {
        const int src = T + j;
        state[(u64)j * conv_dim + c] =
            src < W - 1 ? state[(u64)src * conv_dim + c] : x[(u64)(src - (W - 1)) * conv_dim + c];
    }
}

// In place on the q|k heads of x [T, ld]: one warp per head vector of D channels.
extern "C" __global__ void l2_norm_bf16(bf16* __restrict__ x, int T, int ld, int nvec, int D) {
    const int vec = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (vec >= T * nvec) return;
    bf16* p = x + (u64)(vec / nvec) * ld + (u64)(vec % nvec) * D;
    float v[4];
    float ss = 0.0f;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        if (e >= D / 32) break;
        v[e] = bf2f(p[lane + 32 * e]);
        ss = __fmaf_rn(v[e], v[e], ss);
    }
    const float inv = 1.0f / sqrtf(warp_sum(ss) + 1e-6f);
#pragma unroll
    for (int e = 0; e < 4; ++e)
        if (e < D / 32) p[lane + 32 * e] = f2bf(v[e] * inv);
}
