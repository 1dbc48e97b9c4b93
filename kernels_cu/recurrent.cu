// One decode token of one head, fused: conv (+SiLU, +L2 of q and k), the delta-rule step
// and the gated RMSNorm. One block per head, so the L2 and RMS reductions stay in the block
// and the whole token costs one launch. The state [H, Dv, Dk] fp32 is the only large traffic:
// each warp owns 8 rows, loads them before anything else (memory-level parallelism) and
// writes them back once. q, k, v enter the step as the bf16 values written
// to conv_out, so decode and the stage dumps see the same operands.
#include "common.cuh"

#define ROWS_PER_WARP 8
#define MAX_W 8  // the config allows conv widths up to 8

template <int D>
__device__ __forceinline__ void decode_row(
    const bf16* __restrict__ x, bf16* __restrict__ conv_state, const float* __restrict__ conv_w,
    bf16* __restrict__ conv_out, const float* __restrict__ gate, const float* __restrict__ beta,
    float* __restrict__ state, float* __restrict__ core, const bf16* __restrict__ out_gate,
    const float* __restrict__ o_norm_w, bf16* __restrict__ o_norm_out, int H, int W, float scale,
    float eps) {
    constexpr int E = D / 32, NW = D / ROWS_PER_WARP;  // blockDim.x == 32 * NW == 4 * D
    __shared__ float qs[D], ks[D], vs[D], gx[D], cs[D], part[NW];
    const int h = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int qkv = H * D, conv_dim = 3 * qkv;
    const int p = tid / D, d = tid % D;  // p: 0 q, 1 k, 2 v, 3 gate
    // Every load that depends on nothing is issued first, so the state rows' latency overlaps
    // the conv's: this warp's rows of the state, then the taps of this thread's channel.
    float* S = state + (u64)h * D * D;
    float s[ROWS_PER_WARP][E];
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r)
#pragma unroll
        for (int e = 0; e < E; ++e) s[r][e] = S[(u64)(warp * ROWS_PER_WARP + r) * D + lane * E + e];
    float y = 0.0f;
    if (p < 3) {
        const int c = p * qkv + h * D + d;
        bf16 tap[MAX_W];
        float wt[MAX_W];
#pragma unroll
        for (int j = 0; j < MAX_W; ++j) {
            if (j >= W) break;
            wt[j] = conv_w[(u64)j * conv_dim + c];
            tap[j] = j < W - 1 ? conv_state[(u64)j * conv_dim + c] : x[c];
        }
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < MAX_W; ++j)
            if (j < W) acc = __fmaf_rn(wt[j], bf2f(tap[j]), acc);
#pragma unroll
        for (int j = 0; j < MAX_W - 1; ++j)  // roll from registers: no reload
            if (j < W - 1) conv_state[(u64)j * conv_dim + c] = tap[j + 1];
        y = acc * sigmoidf_(acc);
        const float sq = warp_sum(y * y);  // a warp never straddles q/k/v: D % 32 == 0
        if (lane == 0) part[warp] = sq;
    } else {
        gx[d] = expf(gate[h * D + d]);
    }
    __syncthreads();
    if (p < 2) {
        float ss = 0.0f;
        for (int i = 0; i < D / 32; ++i) ss += part[p * (D / 32) + i];
        y = y * (1.0f / sqrtf(ss + 1e-6f));
    }
    if (p < 3) {
        const bf16 r = f2bf(y);
        conv_out[p * qkv + h * D + d] = r;
        (p == 0 ? qs : p == 1 ? ks : vs)[d] = bf2f(r);
    }
    __syncthreads();
    const float b = beta[h];
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r) {
        const int j = warp * ROWS_PER_WARP + r;
        float kS = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const int dd = lane * E + e;
            s[r][e] *= gx[dd];
            kS = __fmaf_rn(s[r][e], ks[dd], kS);
        }
        const float bres = b * (vs[j] - warp_sum(kS));
        float o = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const int dd = lane * E + e;
            s[r][e] = __fmaf_rn(bres, ks[dd], s[r][e]);
            o = __fmaf_rn(s[r][e], qs[dd] * scale, o);
            S[(u64)j * D + dd] = s[r][e];
        }
        o = warp_sum(o);
        if (lane == 0) {
            cs[j] = o;
            core[h * D + j] = o;
        }
    }
    __syncthreads();
    if (warp == 0) {
        float v[E], ss = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) {
            v[e] = cs[lane + 32 * e];
            ss = __fmaf_rn(v[e], v[e], ss);
        }
        const float inv = 1.0f / sqrtf(warp_sum(ss) / D + eps);
#pragma unroll
        for (int e = 0; e < E; ++e) {
            const int dd = lane + 32 * e;
            o_norm_out[h * D + dd] =
                f2bf(v[e] * inv * o_norm_w[dd] * sigmoidf_(bf2f(out_gate[h * D + dd])));
        }
    }
}

#define KDA_DECODE_ROW(D)                                                                       \
    extern "C" __global__ void __launch_bounds__(4 * D) kda_decode_row_d##D(                    \
        const bf16* x, bf16* conv_state, const float* conv_w, bf16* conv_out, const float* gate, \
        const float* beta, float* state, float* core, const bf16* out_gate,                     \
        const float* o_norm_w, bf16* o_norm_out, int H, int W, float scale, float eps) {        \
        decode_row<D>(x, conv_state, conv_w, conv_out, gate, beta, state, core, out_gate,       \
                      o_norm_w, o_norm_out, H, W, scale, eps);                                  \
    }
KDA_DECODE_ROW(64)
KDA_DECODE_ROW(128)
