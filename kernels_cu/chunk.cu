// The chunked (WY) KDA core for prefill, C = 64 tokens a chunk, in two launches:
//   kda_chunk_intra: every (chunk, head) in parallel builds the in-chunk cumulative decay G,
//     A[t][s] = sum_d k_t k_s exp(G_t - G_s) (s < t) and Aqk (s <= t, q scaled), and solves
//     (I + diag(b) A) [u | w] = diag(b) [v | k exp(G)] by forward substitution.
//   kda_chunk_inter: per (head, 32-column slice of V) walks the chunks in order, carrying the
//     state slice in shared memory: W = u - w S; O = (q exp(G)) S + Aqk W;
//     S = exp(G_last) S + (k exp(G_last - G))^T W.
// Rows >= T are selected to zero on load (never multiplied), so NaN or 1e30 primed into the
// padded tail can reach neither the outputs nor the state. Decays are only ever exponentiated
// as differences G_t - G_s with s <= t, which are <= 0: nothing overflows.
#include "common.cuh"

#define CH 64
#define VS 32  // state columns one inter block carries

__device__ __forceinline__ float pick(bool valid, float x) { return valid ? x : 0.0f; }

template <int D>
__device__ void chunk_intra(const float* __restrict__ q, const float* __restrict__ k,
                            const float* __restrict__ v, const float* __restrict__ gate,
                            const float* __restrict__ beta, float* __restrict__ g_cum,
                            float* __restrict__ w_out, float* __restrict__ u_out,
                            float* __restrict__ aqk, int T, int H, float scale) {
    constexpr int P = D + 1;  // padded rows: column walks over s hit distinct banks
    extern __shared__ float sm[];
    float* Ks = sm;
    float* Qs = Ks + CH * P;
    float* Gs = Qs + CH * P;
    float* A = Gs + CH * P;  // [CH][CH + 1]
    float* Bs = A + CH * (CH + 1);
    const int ci = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    const int c0 = ci * CH;
    for (int i = tid; i < CH * D; i += blockDim.x) {
        const int r = i / D, d = i % D, t = c0 + r;
        const bool ok = t < T;
        const u64 g = ((u64)t * H + h) * D + d;
        Ks[r * P + d] = pick(ok, k[g]);
        Qs[r * P + d] = pick(ok, q[g]) * scale;
        Gs[r * P + d] = pick(ok, gate[g]);
    }
    if (tid < CH) Bs[tid] = pick(c0 + tid < T, beta[(u64)(c0 + tid) * H + h]);
    __syncthreads();
    if (tid < D) {
        float acc = 0.0f;
        for (int r = 0; r < CH; ++r) {
            acc += Gs[r * P + tid];
            Gs[r * P + tid] = acc;
            g_cum[((u64)(c0 + r) * H + h) * D + tid] = acc;
        }
    }
    __syncthreads();
    float* M = aqk + ((u64)ci * H + h) * CH * CH;
    for (int i = tid; i < CH * CH; i += blockDim.x) {
        const int t = i / CH, s = i % CH;
        float a = 0.0f, m = 0.0f;
        if (s <= t) {
            for (int d = 0; d < D; ++d) {
                const float e = expf(Gs[t * P + d] - Gs[s * P + d]) * Ks[s * P + d];
                a = __fmaf_rn(Ks[t * P + d], e, a);
                m = __fmaf_rn(Qs[t * P + d], e, m);
            }
        }
        A[t * (CH + 1) + s] = s < t ? a : 0.0f;
        M[i] = m;
    }
    __syncthreads();
    // One column of [v | k exp(G)] per thread; the substitution is serial in rows only.
    const int col = tid;
    if (col < 2 * D) {
        float x[CH];
#pragma unroll
        for (int r = 0; r < CH; ++r) {
            const int t = c0 + r;
            float b;
            if (col < D) b = pick(t < T, v[((u64)t * H + h) * D + col]);
            else b = Ks[r * P + col - D] * expf(Gs[r * P + col - D]);
            float acc = 0.0f;
#pragma unroll
            for (int s = 0; s < r; ++s) acc = __fmaf_rn(A[r * (CH + 1) + s], x[s], acc);
            x[r] = Bs[r] * (b - acc);
        }
        float* dst = col < D ? u_out : w_out;
        const int dc = col < D ? col : col - D;
#pragma unroll
        for (int r = 0; r < CH; ++r) dst[((u64)(c0 + r) * H + h) * D + dc] = x[r];
    }
}

template <int D>
__device__ void chunk_inter(const float* __restrict__ q, const float* __restrict__ k,
                            const float* __restrict__ g_cum, const float* __restrict__ w_in,
                            const float* __restrict__ u_in, const float* __restrict__ aqk,
                            float* __restrict__ state, float* __restrict__ core, int T, int T_pad,
                            int H, float scale) {
    extern __shared__ float sm[];
    float* Wk = sm;             // [CH][D]
    float* Qg = Wk + CH * D;    // [CH][D]  q * scale * exp(G)
    float* Kd = Qg + CH * D;    // [CH][D]  k * exp(G_last - G)
    float* M = Kd + CH * D;     // [CH][CH]
    float* Wm = M + CH * CH;    // [CH][VS]
    float* S = Wm + CH * VS;    // [D][VS]
    float* gl = S + D * VS;     // [D]
    const int h = blockIdx.x, v0 = blockIdx.y * VS, tid = threadIdx.x;
    const int lane = tid % VS, grp = tid / VS, ngrp = blockDim.x / VS;
    for (int i = tid; i < D * VS; i += blockDim.x) {
        const int d = i / VS, vv = i % VS;
        S[i] = state[((u64)h * D + v0 + vv) * D + d];
    }
    for (int c0 = 0; c0 < T_pad; c0 += CH) {
        __syncthreads();
        if (tid < D) gl[tid] = g_cum[((u64)(c0 + CH - 1) * H + h) * D + tid];
        __syncthreads();
        for (int i = tid; i < CH * D; i += blockDim.x) {
            const int r = i / D, d = i % D, t = c0 + r;
            const bool ok = t < T;
            const u64 g = ((u64)t * H + h) * D + d;
            const float G = g_cum[g];
            Wk[i] = w_in[g];
            Qg[i] = pick(ok, q[g]) * scale * expf(G);
            Kd[i] = pick(ok, k[g]) * expf(gl[d] - G);
        }
        const float* Mg = aqk + ((u64)(c0 / CH) * H + h) * CH * CH;
        for (int i = tid; i < CH * CH; i += blockDim.x) M[i] = Mg[i];
        __syncthreads();
        for (int r = grp; r < CH; r += ngrp) {
            float acc = u_in[((u64)(c0 + r) * H + h) * D + v0 + lane];
            for (int d = 0; d < D; ++d) acc = __fmaf_rn(-Wk[r * D + d], S[d * VS + lane], acc);
            Wm[r * VS + lane] = acc;
        }
        __syncthreads();
        for (int r = grp; r < CH; r += ngrp) {
            float o = 0.0f;
            for (int d = 0; d < D; ++d) o = __fmaf_rn(Qg[r * D + d], S[d * VS + lane], o);
            for (int s = 0; s <= r; ++s) o = __fmaf_rn(M[r * CH + s], Wm[s * VS + lane], o);
            const int t = c0 + r;
            core[((u64)t * H + h) * D + v0 + lane] = t < T ? o : 0.0f;
        }
        __syncthreads();
        for (int d = grp; d < D; d += ngrp) {
            float acc = S[d * VS + lane] * expf(gl[d]);
            for (int r = 0; r < CH; ++r) acc = __fmaf_rn(Kd[r * D + d], Wm[r * VS + lane], acc);
            S[d * VS + lane] = acc;
        }
    }
    __syncthreads();
    for (int i = tid; i < D * VS; i += blockDim.x) {
        const int d = i / VS, vv = i % VS;
        state[((u64)h * D + v0 + vv) * D + d] = S[i];
    }
}

#define KDA_CHUNK(D)                                                                          \
    extern "C" __global__ void __launch_bounds__(256) kda_chunk_intra_d##D(                   \
        const float* q, const float* k, const float* v, const float* gate, const float* beta, \
        float* g_cum, float* w, float* u, float* aqk, int T, int T_pad, int H, float scale) { \
        chunk_intra<D>(q, k, v, gate, beta, g_cum, w, u, aqk, T, H, scale);                   \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(256) kda_chunk_inter_d##D(                   \
        const float* q, const float* k, const float* g_cum, const float* w, const float* u,   \
        const float* aqk, float* state, float* core, int T, int T_pad, int H, float scale) {  \
        chunk_inter<D>(q, k, g_cum, w, u, aqk, state, core, T, T_pad, H, scale);              \
    }
KDA_CHUNK(64)
KDA_CHUNK(128)
