// The short causal depthwise conv over time, with the carried conv state [W-1, conv_dim]
// (oldest row first) standing in for the rows before the first token.
#include "common.cuh"

// Decode: one block per q/k/v head vector of D channels, one thread per channel, so the
// per-head L2 norm of q and k is a block reduction and fuses here (the recurrent step takes
// q/k pre-normalised). Each thread rolls its own channel column of the state, so no race.
extern "C" __global__ void conv_decode(const bf16* __restrict__ x, bf16* __restrict__ state,
                                       const float* __restrict__ w, bf16* __restrict__ out,
                                       int conv_dim, int qkv, int W, int D) {
    __shared__ float partial[32];
    const int c = blockIdx.x * D + threadIdx.x;
    float acc = 0.0f;
    for (int j = 0; j < W - 1; ++j)
        acc = __fmaf_rn(w[(u64)j * conv_dim + c], bf2f(state[(u64)j * conv_dim + c]), acc);
    const bf16 xc = x[c];
    acc = __fmaf_rn(w[(u64)(W - 1) * conv_dim + c], bf2f(xc), acc);
    for (int j = 0; j < W - 2; ++j) state[(u64)j * conv_dim + c] = state[(u64)(j + 1) * conv_dim + c];
    state[(u64)(W - 2) * conv_dim + c] = xc;
    float y = acc * sigmoidf_(acc);
    if (blockIdx.x * D < 2 * qkv) {  // q or k head: block-uniform branch
        const float s = warp_sum(y * y);
        if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = s;
        __syncthreads();
        float ss = 0.0f;
        for (int i = 0; i < D / 32; ++i) ss += partial[i];
        y = y * (1.0f / sqrtf(ss + 1e-6f));
    }
    out[c] = f2bf(y);
}

// Prefill: one thread per (token, channel); output is conv + SiLU rounded to bf16 (the L2
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
