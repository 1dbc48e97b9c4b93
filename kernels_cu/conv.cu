// The prefill side of the short causal depthwise conv over time, with the carried conv state
// [W-1, conv_dim] (oldest row first) standing in for the rows before the first token. Decode's
// conv is fused into kda_decode_row (recurrent.cu).
#include "common.cuh"

#define WARPS 8
#define MAX_W 8  // the config allows conv widths up to 8

// One warp per (token, q/k/v head vector of D channels), reading q|k|v straight from the
// packed projection proj [T, ldp]. It writes every buffer the stages expose in one pass:
// qkv_proj and qkv_parts (the inputs), conv_out (conv + SiLU rounded to bf16, then for q/k
// the L2 norm of those bf16 values rounded again) and its fp32 widening q/k/v_f32, whose rows
// in [T, T_pad) get pad_fill so the chunk kernels' guard past T is exercised.
extern "C" __global__ void __launch_bounds__(WARPS * 32)
prefill_conv_qkv(const bf16* __restrict__ proj, int ldp, const bf16* __restrict__ state,
                 const float* __restrict__ w, bf16* __restrict__ qkv_proj,
                 bf16* __restrict__ qkv_parts, bf16* __restrict__ conv_out, float* __restrict__ qf,
                 float* __restrict__ kf, float* __restrict__ vf, int T, int T_pad, int H, int D,
                 int W, float pad_fill) {
    const int lane = threadIdx.x & 31;
    const int item = blockIdx.x * WARPS + (threadIdx.x >> 5);
    const int nvec = 3 * H, qkv = H * D, conv_dim = 3 * qkv;
    if (item >= T_pad * nvec) return;
    const int t = item / nvec, vec = item % nvec, p = vec / H;
    float* dst = p == 0 ? qf : (p == 1 ? kf : vf);
    const u64 drow = (u64)t * qkv + (vec % H) * D;
    if (t >= T) {
        for (int d = lane; d < D; d += 32) dst[drow + d] = pad_fill;
        return;
    }
    float y[4];
    float ss = 0.0f;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        if (e >= D / 32) break;
        const int c = vec * D + lane + 32 * e;
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < MAX_W; ++j) {  // unrolled so every tap's load is in flight at once
            if (j >= W) break;
            const int r = t + j - (W - 1);
            const bf16 x = r < 0 ? state[(u64)(W - 1 + r) * conv_dim + c] : proj[(u64)r * ldp + c];
            acc = __fmaf_rn(w[(u64)j * conv_dim + c], bf2f(x), acc);
        }
        const bf16 xin = proj[(u64)t * ldp + c];
        qkv_proj[(u64)t * conv_dim + c] = xin;
        qkv_parts[((u64)p * T + t) * qkv + c - p * qkv] = xin;
        y[e] = bf2f(f2bf(acc * sigmoidf_(acc)));
        ss = __fmaf_rn(y[e], y[e], ss);
    }
    const float inv = p < 2 ? 1.0f / sqrtf(warp_sum(ss) + 1e-6f) : 1.0f;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        if (e >= D / 32) break;
        const int c = vec * D + lane + 32 * e;
        const bf16 o = p < 2 ? f2bf(y[e] * inv) : f2bf(y[e]);
        conv_out[(u64)t * conv_dim + c] = o;
        dst[drow + lane + 32 * e] = bf2f(o);
    }
}

// After prefill_conv_qkv: the state becomes the last W-1 rows of (state ++ x). New row j
// reads source row T+j > j, so one thread walking its channel upwards never reads a row it
// already wrote.
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
