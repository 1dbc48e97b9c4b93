// The chunked (WY) KDA core for prefill, C = 64 tokens a chunk, in two launches:
//   kda_chunk_intra: every (chunk, head) in parallel builds the in-chunk cumulative decay G,
//     A[t][s] = sum_d k_t k_s exp(G_t - G_s) (s < t) and Aqk (s <= t, q scaled), solves
//     (I + diag(b) A) [u | w] = diag(b) [v | k exp(G)] by forward substitution, and precomputes
//     everything elementwise the sequential walk needs: qg = q exp(G), kd = k exp(G_last - G),
//     gl = exp(G_last). The walk then does no transcendental math at all.
//   kda_chunk_inter: per (head, 32-column slice of V) walks the chunks in order, carrying the
//     state slice in shared memory: W = u - w S; O = qg S + Aqk W; S = gl S + kd^T W.
//     It stages one [C, D] operand at a time (~72 KB of shared memory at D = 128), so three
//     blocks share an SM and one block's loads overlap another's arithmetic.
// Rows >= T are selected to zero on load (never multiplied), so NaN or 1e30 primed into the
// padded tail can reach neither the outputs nor the state. Decays are only exponentiated as
// differences G_t - G_s with s <= t, which are <= 0: nothing overflows.
#include "common.cuh"

#define CH 64
#define THREADS 256  // every chunk kernel runs 256 threads (kernels.py launches them so)
#define VS 32   // state columns one inter block carries
#define AP 68   // padded row stride of C x C tiles: 16-byte rows, rows 2 apart in distinct banks

__device__ __forceinline__ float pick(bool valid, float x) { return valid ? x : 0.0f; }

template <int D>
__device__ void chunk_intra(const float* __restrict__ q, const float* __restrict__ k,
                            const float* __restrict__ v, const float* __restrict__ gate,
                            const float* __restrict__ beta, float* __restrict__ qg_out,
                            float* __restrict__ kd_out, float* __restrict__ gl_out,
                            float* __restrict__ w_out, float* __restrict__ u_out,
                            float* __restrict__ aqk, int T, int H, float scale) {
    constexpr int P = D + 1;  // padded rows: walks over s for fixed d hit distinct banks
    extern __shared__ float sm[];
    float* Ks = sm;
    float* Qs = Ks + CH * P;
    float* Gs = Qs + CH * P;
    float* A = Gs + CH * P;  // [CH][AP], strictly lower
    float* Bs = A + CH * AP;
    const int ci = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    const int c0 = ci * CH;
    constexpr int LOADS = CH * D / THREADS, BATCH = 8;  // BATCH x 3 loads in flight a thread
#pragma unroll
    for (int b0 = 0; b0 < LOADS; b0 += BATCH) {
        float kv[BATCH], qv[BATCH], gv[BATCH];
#pragma unroll
        for (int j = 0; j < BATCH; ++j) {
            const int i = tid + (b0 + j) * THREADS, t = c0 + i / D;
            const u64 g = ((u64)t * H + h) * D + i % D;
            kv[j] = k[g];
            qv[j] = q[g];
            gv[j] = gate[g];
        }
#pragma unroll
        for (int j = 0; j < BATCH; ++j) {
            const int i = tid + (b0 + j) * THREADS, r = i / D, d = i % D;
            const bool ok = c0 + r < T;
            Ks[r * P + d] = pick(ok, kv[j]);
            Qs[r * P + d] = pick(ok, qv[j]) * scale;
            Gs[r * P + d] = pick(ok, gv[j]);
        }
    }
    if (tid < CH) Bs[tid] = pick(c0 + tid < T, beta[(u64)(c0 + tid) * H + h]);
    __syncthreads();
    if (tid < D) {
        float acc = 0.0f;
        for (int r = 0; r < CH; ++r) {
            acc += Gs[r * P + tid];
            Gs[r * P + tid] = acc;
        }
        gl_out[((u64)ci * H + h) * D + tid] = expf(acc);
    }
    __syncthreads();
    for (int i = tid; i < CH * D; i += blockDim.x) {
        const int r = i / D, d = i % D;
        const u64 g = ((u64)(c0 + r) * H + h) * D + d;
        const float G = Gs[r * P + d];
        qg_out[g] = Qs[r * P + d] * expf(G);
        kd_out[g] = Ks[r * P + d] * expf(Gs[(CH - 1) * P + d] - G);
    }
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
        A[t * AP + s] = s < t ? a : 0.0f;
        M[i] = m;
    }
    __syncthreads();
    // One column of [v | k exp(G)] per thread; the substitution is serial in rows only, and
    // each row of A is read four entries at a time.
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
            for (int s = 0; s < (r & ~3); s += 4) {
                const float4 a4 = *reinterpret_cast<const float4*>(A + r * AP + s);
                acc = __fmaf_rn(a4.x, x[s], acc);
                acc = __fmaf_rn(a4.y, x[s + 1], acc);
                acc = __fmaf_rn(a4.z, x[s + 2], acc);
                acc = __fmaf_rn(a4.w, x[s + 3], acc);
            }
#pragma unroll
            for (int s = r & ~3; s < r; ++s) acc = __fmaf_rn(A[r * AP + s], x[s], acc);
            x[r] = Bs[r] * (b - acc);
        }
        float* dst = col < D ? u_out : w_out;
        const int dc = col < D ? col : col - D;
#pragma unroll
        for (int r = 0; r < CH; ++r) dst[((u64)(c0 + r) * H + h) * D + dc] = x[r];
    }
}

// Copy rows [c0, c0+CH) of one head of a [T_pad, H, D] fp32 buffer (columns [col0, col0+N))
// into shared memory rows of stride ld. The trip count is a compile-time constant, so every
// thread issues all its 16-byte loads before its first store: one memory latency a stage,
// not one per iteration.
template <int N>
__device__ __forceinline__ void stage_rows(float* dst, int ld, const float* __restrict__ src,
                                           int c0, int h, int H, int D, int col0) {
    constexpr int PER_ROW = N / 4, ITER = CH * PER_ROW / THREADS;
    float4 v[ITER];
#pragma unroll
    for (int it = 0; it < ITER; ++it) {
        const int i = threadIdx.x + it * THREADS, r = i / PER_ROW, q4 = (i % PER_ROW) * 4;
        v[it] = __ldg(reinterpret_cast<const float4*>(src + ((u64)(c0 + r) * H + h) * D + col0 + q4));
    }
#pragma unroll
    for (int it = 0; it < ITER; ++it) {
        const int i = threadIdx.x + it * THREADS, r = i / PER_ROW, q4 = (i % PER_ROW) * 4;
        *reinterpret_cast<float4*>(dst + r * ld + q4) = v[it];
    }
}

template <int D>
__device__ void chunk_inter(const float* __restrict__ qg, const float* __restrict__ kd,
                            const float* __restrict__ gl, const float* __restrict__ w_in,
                            const float* __restrict__ u_in, const float* __restrict__ aqk,
                            float* __restrict__ state, float* __restrict__ core, int T, int T_pad,
                            int H) {
    constexpr int BP = D + 4;        // staged [CH][D] operand, padded so 4 rows hit 4 banks
    constexpr int RPT = D / 32;      // state rows per thread in the update
    extern __shared__ float sm[];
    float* buf = sm;                 // [CH][BP]: w, then qg, then kd
    float* Ms = buf + CH * BP;       // [CH][AP]
    float* Wm = Ms + CH * AP;        // [CH][VS]
    float* S = Wm + CH * VS;         // [D][VS]
    float* gls = S + D * VS;         // [D]
    const int h = blockIdx.x, v0 = blockIdx.y * VS, tid = threadIdx.x;
    const int cg = tid % 8, rg = tid / 8;  // 8 column groups of 4, 32 row groups
    const int r0 = 2 * rg, c4 = 4 * cg;
    for (int i = tid; i < D * VS; i += blockDim.x) {
        const int d = i / VS, vv = i % VS;
        S[i] = state[((u64)h * D + v0 + vv) * D + d];
    }
    for (int c0 = 0; c0 < T_pad; c0 += CH) {
        const int ci = c0 / CH;
        __syncthreads();
        stage_rows<D>(buf, BP, w_in, c0, h, H, D, 0);
        stage_rows<VS>(Wm, VS, u_in, c0, h, H, D, v0);
        if (tid < D) gls[tid] = gl[((u64)ci * H + h) * D + tid];
        __syncthreads();
        // W = u - w S: rows r0, r0+1, columns c4..c4+3 of this thread
        float acc[2][4];
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[i][j] = Wm[(r0 + i) * VS + c4 + j];
#pragma unroll 8
        for (int d = 0; d < D; ++d) {
            const float4 s4 = *reinterpret_cast<const float4*>(S + d * VS + c4);
            const float a0 = buf[r0 * BP + d], a1 = buf[(r0 + 1) * BP + d];
            acc[0][0] = __fmaf_rn(-a0, s4.x, acc[0][0]); acc[0][1] = __fmaf_rn(-a0, s4.y, acc[0][1]);
            acc[0][2] = __fmaf_rn(-a0, s4.z, acc[0][2]); acc[0][3] = __fmaf_rn(-a0, s4.w, acc[0][3]);
            acc[1][0] = __fmaf_rn(-a1, s4.x, acc[1][0]); acc[1][1] = __fmaf_rn(-a1, s4.y, acc[1][1]);
            acc[1][2] = __fmaf_rn(-a1, s4.z, acc[1][2]); acc[1][3] = __fmaf_rn(-a1, s4.w, acc[1][3]);
        }
#pragma unroll
        for (int i = 0; i < 2; ++i)
            *reinterpret_cast<float4*>(Wm + (r0 + i) * VS + c4) =
                make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
        __syncthreads();
        // O = qg S + Aqk W (Aqk is zero above the diagonal)
        stage_rows<D>(buf, BP, qg, c0, h, H, D, 0);
        {
            constexpr int ITER = CH * CH / 4 / THREADS;
            float4 m4[ITER];
            const float* Mg = aqk + ((u64)ci * H + h) * CH * CH;
#pragma unroll
            for (int it = 0; it < ITER; ++it)
                m4[it] = __ldg(reinterpret_cast<const float4*>(Mg) + tid + it * THREADS);
#pragma unroll
            for (int it = 0; it < ITER; ++it) {
                const int i = tid + it * THREADS;
                *reinterpret_cast<float4*>(Ms + (i / (CH / 4)) * AP + (i % (CH / 4)) * 4) = m4[it];
            }
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
#pragma unroll 8
        for (int d = 0; d < D; ++d) {
            const float4 s4 = *reinterpret_cast<const float4*>(S + d * VS + c4);
            const float a0 = buf[r0 * BP + d], a1 = buf[(r0 + 1) * BP + d];
            acc[0][0] = __fmaf_rn(a0, s4.x, acc[0][0]); acc[0][1] = __fmaf_rn(a0, s4.y, acc[0][1]);
            acc[0][2] = __fmaf_rn(a0, s4.z, acc[0][2]); acc[0][3] = __fmaf_rn(a0, s4.w, acc[0][3]);
            acc[1][0] = __fmaf_rn(a1, s4.x, acc[1][0]); acc[1][1] = __fmaf_rn(a1, s4.y, acc[1][1]);
            acc[1][2] = __fmaf_rn(a1, s4.z, acc[1][2]); acc[1][3] = __fmaf_rn(a1, s4.w, acc[1][3]);
        }
        for (int s = 0; s <= r0 + 1; ++s) {
            const float4 w4 = *reinterpret_cast<const float4*>(Wm + s * VS + c4);
            const float m0 = Ms[r0 * AP + s], m1 = Ms[(r0 + 1) * AP + s];
            acc[0][0] = __fmaf_rn(m0, w4.x, acc[0][0]); acc[0][1] = __fmaf_rn(m0, w4.y, acc[0][1]);
            acc[0][2] = __fmaf_rn(m0, w4.z, acc[0][2]); acc[0][3] = __fmaf_rn(m0, w4.w, acc[0][3]);
            acc[1][0] = __fmaf_rn(m1, w4.x, acc[1][0]); acc[1][1] = __fmaf_rn(m1, w4.y, acc[1][1]);
            acc[1][2] = __fmaf_rn(m1, w4.z, acc[1][2]); acc[1][3] = __fmaf_rn(m1, w4.w, acc[1][3]);
        }
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int t = c0 + r0 + i;
            const float4 o = t < T ? make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3])
                                   : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            *reinterpret_cast<float4*>(core + ((u64)t * H + h) * D + v0 + c4) = o;
        }
        __syncthreads();
        // S = gl S + kd^T W: rows RPT*rg.., columns c4..c4+3 of this thread
        stage_rows<D>(buf, BP, kd, c0, h, H, D, 0);
        __syncthreads();
        const int d0 = RPT * rg;
        float sacc[RPT][4];
#pragma unroll
        for (int i = 0; i < RPT; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) sacc[i][j] = gls[d0 + i] * S[(d0 + i) * VS + c4 + j];
#pragma unroll 4
        for (int r = 0; r < CH; ++r) {
            const float4 w4 = *reinterpret_cast<const float4*>(Wm + r * VS + c4);
#pragma unroll
            for (int i = 0; i < RPT; ++i) {
                const float kv = buf[r * BP + d0 + i];
                sacc[i][0] = __fmaf_rn(kv, w4.x, sacc[i][0]); sacc[i][1] = __fmaf_rn(kv, w4.y, sacc[i][1]);
                sacc[i][2] = __fmaf_rn(kv, w4.z, sacc[i][2]); sacc[i][3] = __fmaf_rn(kv, w4.w, sacc[i][3]);
            }
        }
#pragma unroll
        for (int i = 0; i < RPT; ++i)
            *reinterpret_cast<float4*>(S + (d0 + i) * VS + c4) =
                make_float4(sacc[i][0], sacc[i][1], sacc[i][2], sacc[i][3]);
    }
    __syncthreads();
    for (int i = tid; i < D * VS; i += blockDim.x) {
        const int d = i / VS, vv = i % VS;
        state[((u64)h * D + v0 + vv) * D + d] = S[i];
    }
}

#define KDA_CHUNK(D)                                                                           \
    extern "C" __global__ void __launch_bounds__(THREADS) kda_chunk_intra_d##D(                    \
        const float* q, const float* k, const float* v, const float* gate, const float* beta,  \
        float* qg, float* kd, float* gl, float* w, float* u, float* aqk, int T, int T_pad,     \
        int H, float scale) {                                                                  \
        chunk_intra<D>(q, k, v, gate, beta, qg, kd, gl, w, u, aqk, T, H, scale);               \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS) kda_chunk_inter_d##D(                    \
        const float* qg, const float* kd, const float* gl, const float* w, const float* u,     \
        const float* aqk, float* state, float* core, int T, int T_pad, int H) {                \
        chunk_inter<D>(qg, kd, gl, w, u, aqk, state, core, T, T_pad, H);                       \
    }
KDA_CHUNK(64)
KDA_CHUNK(128)
