// The chunked (WY) KDA core for prefill, C = 64 tokens a chunk, in two launches:
//   kda_chunk_intra: every (chunk, head) in parallel builds the in-chunk cumulative decay G,
//     A[t][s] = sum_d k_t k_s exp(G_t - G_s) (s < t) and Aqk (s <= t, q scaled), solves
//     (I + diag(b) A) [u | w] = diag(b) [v | k exp(G)] by forward substitution, and precomputes
//     everything elementwise the sequential walk needs: qg = q exp(G), kd = k exp(G_last - G),
//     gl = exp(G_last). The walk then does no transcendental math at all.
//   kda_chunk_inter_d{D}_v{VS}: per (head, VS-column slice of V) walks the chunks in order with
//     its state slice in registers: W = u - w S; O = qg S + Aqk W; S = gl S + kd^T W. The
//     products run on tensor cores in 3xBF16 from operands the intra kernel already wrote as
//     split bf16 words, one (chunk, head) block each, in the order the walk's fragments take
//     them (so its inner loops convert nothing); the next operands stream into shared memory
//     with cp.async while the current products run, since the walk is one block per SM and
//     nothing else hides its loads.
// Rows >= T are selected to zero on load (never multiplied), so NaN or 1e30 primed into the
// padded tail can reach neither the outputs nor the state. Decays are exponentiated as
// differences G_t - G_s with s <= t (<= 0), or, in the intra kernel's factorised diagonal
// blocks, as differences bounded by a checked span: nothing overflows.
#include "common.cuh"

// tools/intra_phases.py builds this file with -DKDA_INTRA_PHASES: thread 0 of each intra block
// then adds the clock64() cycles since its last mark into phase_cycles[i] at PHASE(i), one
// mark after each block-wide barrier. In every other build the marks are nothing.
#ifdef KDA_INTRA_PHASES
__device__ unsigned long long phase_cycles[16];
#define PHASES_BEGIN unsigned long long phase_t_ = clock64()
#define PHASE(i)                                                   \
    if (threadIdx.x == 0) {                                        \
        const unsigned long long n_ = clock64();                   \
        atomicAdd(&phase_cycles[i], n_ - phase_t_);                \
        phase_t_ = n_;                                             \
    }
#else
#define PHASES_BEGIN
#define PHASE(i)
#endif

#define CH 64
#define THREADS 256        // kda_chunk_intra's threads (kernels.py launches them so)
#define AP 68   // padded row stride of C x C tiles: 16-byte rows, rows 2 apart in distinct banks

__device__ __forceinline__ float pick(bool valid, float x) { return valid ? x : 0.0f; }
__device__ __forceinline__ float4 pick4(bool valid, float4 x) {
    return valid ? x : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

// ---- tensor-core products from split bf16 words (3xBF16) ------------------------------------
// The chunk kernels' products take their operands as pairs along the product's k axis: for
// (x0, x1) the words hi = bf16(x0) | bf16(x1) << 16 and lo = the same of the remainders
// x - hi, stored adjacent.
// hi hi + hi lo + lo hi on m16n8k16 BF16 MMAs then keeps ~16 bits of every operand (error
// ~1e-5, fp32-like for this core); the operands are split once, where they are produced, so
// no inner loop converts anything.
__device__ __forceinline__ uint2 split_pair(float x0, float x1) {
    const unsigned hi = pack_bf16x2(x0, x1);
    return make_uint2(hi, pack_bf16x2(x0 - __uint_as_float(hi << 16),
                                      x1 - __uint_as_float(hi & 0xffff0000u)));
}

// A and B fragments of one 16x8x16 step, as hi and lo words.
struct Frag {
    unsigned hi[4], lo[4];
};

// The intra kernel keeps its operands as hi and lo planes: rows of bf16 along the product's k
// axis, ld words a row, rows 16 bytes past a multiple of 128 so that the rows of each 8 x 8
// tile hit distinct banks. `frag_a` reads A[m][k] from rows m, `frag_bt` B[k][n] from rows n,
// by ldmatrix: the registers arrive in the order the MMA takes them (rows of (hi, lo) word
// pairs took register moves to get there, ~2.5 an MMA).
__host__ __device__ constexpr int plane_ld(int words) {  // words a row: a multiple of 32, + 16 bytes
    return words + 4;
}

__device__ __forceinline__ Frag frag_a(const unsigned* hi, const unsigned* lo, int ld, int m0,
                                       int kp0, int lane) {
    const int off = (m0 + (lane & 7) + 8 * ((lane >> 3) & 1)) * ld + kp0 + 4 * (lane >> 4);
    Frag f;
    ldmatrix_x4(f.hi, hi + off);
    ldmatrix_x4(f.lo, lo + off);
    return f;
}

__device__ __forceinline__ Frag frag_bt(const unsigned* hi, const unsigned* lo, int ld, int kp0,
                                        int n0, int lane) {
    const int j = lane >> 3;  // tiles: hi, hi 8 k on, lo, lo 8 k on
    unsigned x[4];
    ldmatrix_x4(x, (j >> 1 ? lo : hi) + (n0 + (lane & 7)) * ld + kp0 + 4 * (j & 1));
    return {{x[0], x[1], 0u, 0u}, {x[2], x[3], 0u, 0u}};
}

// big + small += a b: the hi x hi products and the two correction terms accumulate apart
// (shorter chains of dependent MMAs); the caller adds small into big at the end.
__device__ __forceinline__ void mma3(float big[4], float small[4], const Frag& a, const Frag& b) {
    mma_bf16(small, a.lo, b.hi);
    mma_bf16(big, a.hi, b.hi);
    mma_bf16(small, a.hi, b.lo);
}

// The operands the walk takes as B (w, qg, kd^T, Aqk) are written in its fragment order: rows
// n, the k axis along a row in blocks of 16 words (8 k-pairs), lane t's four words at 4t:
// (hi of pair t, hi of pair t + 4, lo of pair t, lo of pair t + 4). One 16-byte load then hands
// a lane its fragment in the register pairs the MMA takes; rows of (hi, lo) pairs cost
// register moves, which Nsight Compute counted as 40% of an earlier walk's instructions.
__host__ __device__ __forceinline__ int bfo_word(int p) {  // the hi word of k-pair p in its row; lo at +2
    return 16 * (p >> 3) + 4 * (p & 3) + ((p >> 2) & 1);
}

// ---- intra: every (chunk, head) in parallel -----------------------------------------------------
// A[t][s] and Aqk[t][s] need exp(G_t - G_s) per dimension. With r the first row of t's 16-row
// block it factors as exp(G_t - G_r) exp(G_r - G_s), so a block row of A and Aqk is a product
// of scaled rows on tensor cores (see the loop over r for when the diagonal block may use it).
// Dimensions are staged 64 at a time, which keeps a block at ~111 KB of shared memory so two
// blocks share an SM and one's loads overlap the other's arithmetic.
struct Intra {
    static constexpr int DH = 64;        // dimensions staged at a time
    static constexpr int P = DH + 2;     // G, k, q rows: the pairwise walk hits bank 2s + parity
    static constexpr int PE = plane_ld(DH / 2);  // scaled rows: the hi and lo planes' rows
    static constexpr int SB = 16;        // the factorisation's block of rows
    static constexpr int EROWS = CH + 2 * SB;  // scaled rows: k_s (s <= r + 15), then k_t, q_t
    static constexpr int G_OFF = 0, K_OFF = CH * P, Q_OFF = 2 * CH * P, E_OFF = 3 * CH * P;
    static constexpr int A_OFF = E_OFF + 2 * EROWS * PE, M_OFF = A_OFF + CH * AP;
    static constexpr int B_OFF = M_OFF + CH * AP, FLOATS = B_OFF + CH;
};

template <int D>
__device__ void chunk_intra(const float* __restrict__ q, const float* __restrict__ k,
                            const float* __restrict__ v, const float* __restrict__ gate,
                            const float* __restrict__ beta, unsigned* __restrict__ qg_out,
                            unsigned* __restrict__ kd_out, float* __restrict__ gl_out,
                            float* __restrict__ w_out, float* __restrict__ u_out,
                            unsigned* __restrict__ aqk, int T, int H, float scale) {
    using L = Intra;
    constexpr int DH = L::DH, P = L::P, PE = L::PE, SB = L::SB;
    extern __shared__ __align__(16) float sm[];
    float *Gs = sm + L::G_OFF, *Ks = sm + L::K_OFF, *Qs = sm + L::Q_OFF, *Es = sm + L::E_OFF;
    float *A = sm + L::A_OFF, *Ms = sm + L::M_OFF, *Bs = sm + L::B_OFF;
    const int ci = blockIdx.x, h = blockIdx.y, tid = threadIdx.x, c0 = ci * CH;
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const u64 row0 = ((u64)c0 * H + h) * D, rstride = (u64)H * D;  // [T_pad, H, D] inputs
    const u64 blk = ((u64)ci * H + h) * CH * D;  // the outputs: one block a (chunk, head)

    for (int i = tid; i < 2 * CH * AP; i += THREADS) A[i] = 0.0f;  // A and Aqk (Ms) accumulate
    PHASES_BEGIN;
    if (tid < CH) Bs[tid] = pick(c0 + tid < T, beta[(u64)(c0 + tid) * H + h]);

    for (int d0 = 0; d0 < D; d0 += DH) {
        // k, q and the gate's cumulative sum G over dimensions [d0, d0 + DH). Each thread sums
        // one dimension over a segment of rows in registers; segment totals then shift the
        // later segments.
        {
            constexpr int IT = CH * DH / 4 / THREADS, SEGS = THREADS / DH, SL = CH / SEGS;
            float4 kv[IT], qv[IT];
            float gv[SL];
            const int d = tid % DH, seg = tid / DH;
#pragma unroll
            for (int it = 0; it < IT; ++it) {
                const int i = tid + it * THREADS, r = i / (DH / 4), c4 = (i % (DH / 4)) * 4;
                const u64 o = row0 + r * rstride + d0 + c4;
                kv[it] = __ldg(reinterpret_cast<const float4*>(k + o));
                qv[it] = __ldg(reinterpret_cast<const float4*>(q + o));
            }
#pragma unroll
            for (int j = 0; j < SL; ++j) gv[j] = gate[row0 + (seg * SL + j) * rstride + d0 + d];
#pragma unroll
            for (int it = 0; it < IT; ++it) {
                const int i = tid + it * THREADS, r = i / (DH / 4), c4 = (i % (DH / 4)) * 4;
                const bool ok = c0 + r < T;
                const float4 kk = pick4(ok, kv[it]), qq = pick4(ok, qv[it]);
                *reinterpret_cast<float2*>(Ks + r * P + c4) = make_float2(kk.x, kk.y);
                *reinterpret_cast<float2*>(Ks + r * P + c4 + 2) = make_float2(kk.z, kk.w);
                *reinterpret_cast<float2*>(Qs + r * P + c4) = make_float2(qq.x * scale, qq.y * scale);
                *reinterpret_cast<float2*>(Qs + r * P + c4 + 2) = make_float2(qq.z * scale, qq.w * scale);
            }
            float run = 0.0f;
#pragma unroll
            for (int j = 0; j < SL; ++j) {
                run += pick(c0 + seg * SL + j < T, gv[j]);
                gv[j] = run;
            }
            float* tot = Es;  // segment totals, before the scaled rows are built
            tot[seg * DH + d] = run;
            __syncthreads();
            float off = 0.0f;
            for (int s = 0; s < seg; ++s) off += tot[s * DH + d];
#pragma unroll
            for (int j = 0; j < SL; ++j) Gs[(seg * SL + j) * P + d] = gv[j] + off;
            __syncthreads();
            PHASE(0);
        }
        // what the walk and the solve need elementwise: gl, qg and kd^T (as split words in the
        // walk's fragment order), and k exp(G), the solve's right-hand side, parked in w_out
        // until the solve overwrites it. These loops (and the scaled rows' below) give each warp
        // whole rows and each lane the same two dimensions c2, c2+1 of every row (DH / 2 == 32
        // pairs): no index is divided or taken modulo inside them.
        static_assert(DH == 64 && THREADS % DH == 0, "a lane's two dimensions of a 64-wide row");
        static_assert(CH == 64, "kd^T: a lane's t-pair of a 64-token row");
        const int c2 = 2 * lane;
        if (tid < DH) gl_out[((u64)ci * H + h) * D + d0 + tid] = expf(Gs[(CH - 1) * P + tid]);
        for (int r = warp; r < CH; r += THREADS / 32) {
            const float2 G = *reinterpret_cast<const float2*>(Gs + r * P + c2);
            const float2 qq = *reinterpret_cast<const float2*>(Qs + r * P + c2);
            const float2 kk = *reinterpret_cast<const float2*>(Ks + r * P + c2);
            const float e0 = __expf(G.x), e1 = __expf(G.y);
            const uint2 x = split_pair(qq.x * e0, qq.y * e1);
            unsigned* qrow = qg_out + blk + r * D + bfo_word(d0 / 2 + lane);
            qrow[0] = x.x, qrow[2] = x.y;
            *reinterpret_cast<float2*>(w_out + blk + r * D + d0 + c2) =
                make_float2(kk.x * e0, kk.y * e1);
        }
        // kd^T, a [D][C] block a (chunk, head): a warp writes whole rows d, a lane one t-pair
        {
            unsigned* kd_row = kd_out + blk + d0 * CH + bfo_word(lane);
            for (int d = warp; d < DH; d += THREADS / 32) {
                const float GL = Gs[(CH - 1) * P + d];
                const float k0 = Ks[c2 * P + d] * __expf(GL - Gs[c2 * P + d]);
                const float k1 = Ks[(c2 + 1) * P + d] * __expf(GL - Gs[(c2 + 1) * P + d]);
                const uint2 x = split_pair(k0, k1);
                kd_row[d * CH] = x.x, kd_row[d * CH + 2] = x.y;
            }
        }

        // A block row of 16 at a time: rows r.. of A and Aqk against every row up to r + 15,
        // as [k_t; q_t] exp(G_t - G_r) times (k_s exp(G_r - G_s))^T on tensor cores. Before
        // the diagonal block both factors are <= 1. On it exp(G_r - G_s) >= 1, safe while the
        // block's decay span max_d (G_r - G_{r+15}) stays under SPAN (every factor within
        // e^+-SPAN, far inside fp32), which the bounded gate always meets (15 x 5 < SPAN); a
        // block beyond it takes exp(G_t - G_s) pair by pair instead.
        constexpr float SPAN = 76.0f;
        for (int r = 0; r < CH; r += SB) {
            // also: Es is free (totals read, or the last block row's products done)
            const bool by_pairs = __syncthreads_or(
                tid < DH && Gs[r * P + tid] - Gs[(r + SB - 1) * P + tid] > SPAN);
            PHASE(r == 0 ? 1 : 3);  // the element-wise loops, or the last block row's products
            const int ncols = by_pairs ? r : r + SB;  // columns the products cover
            unsigned* Eh = reinterpret_cast<unsigned*>(Es);  // hi plane, pairs along d
            unsigned* El = Eh + L::EROWS * PE;                  // lo plane
            const float2 Gr = *reinterpret_cast<const float2*>(Gs + r * P + c2);
            // two loops, each with its sign and source fixed (no select, sign multiply or
            // modulo an element): these rows are rebuilt for every block row
            for (int s = warp; s < ncols; s += THREADS / 32) {  // k_s exp(G_r - G_s)
                const float2 x = *reinterpret_cast<const float2*>(Ks + s * P + c2);
                const float2 G = *reinterpret_cast<const float2*>(Gs + s * P + c2);
                const uint2 y = split_pair(x.x * __expf(Gr.x - G.x), x.y * __expf(Gr.y - G.y));
                Eh[s * PE + lane] = y.x, El[s * PE + lane] = y.y;
            }
            for (int i = warp; i < 2 * SB; i += THREADS / 32) {  // k_t, then q_t, exp(G_t - G_r)
                const int t = r + (i < SB ? i : i - SB);
                const float2 x = *reinterpret_cast<const float2*>((i < SB ? Ks : Qs) + t * P + c2);
                const float2 G = *reinterpret_cast<const float2*>(Gs + t * P + c2);
                const uint2 y = split_pair(x.x * __expf(G.x - Gr.x), x.y * __expf(G.y - Gr.y));
                Eh[(CH + i) * PE + lane] = y.x, El[(CH + i) * PE + lane] = y.y;
            }
            __syncthreads();  // the scaled rows are in place
            PHASE(2);
            // [2 SB, ncols] += [2 SB, DH] x [DH, ncols]: m-tile 0 adds to A, m-tile 1 to Aqk;
            // on the diagonal block only s < t (A) and s <= t (Aqk) are kept
            for (int tile = warp; tile < 2 * (ncols / 8); tile += THREADS / 32) {
                const int mt = tile % 2, n0 = 8 * (tile / 2);
                float c[4] = {0.0f, 0.0f, 0.0f, 0.0f}, e[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int kp = 0; kp < DH / 2; kp += 8)
                    mma3(c, e, frag_a(Eh, El, PE, CH + SB * mt, kp, lane),
                         frag_bt(Eh, El, PE, kp, n0, lane));
                float* dst = mt ? Ms : A;
                if (n0 + 8 <= r) {  // off the diagonal block every element is kept: pairs
#pragma unroll
                    for (int hh = 0; hh < 2; ++hh) {
                        float2* p =
                            reinterpret_cast<float2*>(dst + (r + g + 8 * hh) * AP + n0 + 2 * t4);
                        float2 y = *p;
                        y.x += c[2 * hh] + e[2 * hh], y.y += c[2 * hh + 1] + e[2 * hh + 1];
                        *p = y;
                    }
                } else {
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const int t = r + g + 8 * (i >> 1), sc = n0 + 2 * t4 + (i & 1);
                        if (sc < t || (mt && sc == t)) dst[t * AP + sc] += c[i] + e[i];
                    }
                }
            }
            if (by_pairs) {
                // a warp owns rows w and 15 - w of the block (17 pairs, so warps balance);
                // lane = column s + 16 x (parity of the dimensions it sums)
                const int sl = lane & 15, par = lane >> 4;
#pragma unroll
                for (int side = 0; side < 2; ++side) {
                    const int tl = side ? SB - 1 - warp : warp, t = r + tl, s = r + sl;
                    float a = 0.0f, m = 0.0f;
                    if (sl <= tl) {
#pragma unroll 8
                        for (int d = par; d < DH; d += 2) {
                            const float x = expf(Gs[t * P + d] - Gs[s * P + d]) * Ks[s * P + d];
                            a = __fmaf_rn(Ks[t * P + d], x, a);
                            m = __fmaf_rn(Qs[t * P + d], x, m);
                        }
                    }
                    a += __shfl_xor_sync(0xffffffffu, a, 16);
                    m += __shfl_xor_sync(0xffffffffu, m, 16);
                    if (par == 0 && sl <= tl) {
                        if (sl < tl) A[t * AP + s] += a;
                        Ms[t * AP + s] += m;
                    }
                }
            }
        }
        __syncthreads();  // before the next dimensions overwrite G, k, q
        PHASE(3);
    }
    {  // Aqk as split words, rows t with s-pairs in the walk's fragment order
        unsigned* Mg = aqk + ((u64)ci * H + h) * CH * CH;
        for (int i = tid; i < CH * CH / 2; i += THREADS) {
            const int t = i / (CH / 2), p = i % (CH / 2);
            const uint2 x = split_pair(Ms[t * AP + 2 * p], Ms[t * AP + 2 * p + 1]);
            Mg[t * CH + bfo_word(p)] = x.x, Mg[t * CH + bfo_word(p) + 2] = x.y;
        }
    }

    // (I + diag(b) A) [u | w] = diag(b) [v | k exp(G)], one column a thread, by 16-row
    // blocks: block i's rows are x_r = b_r (rhs_r - C_r - sum_{s in block, s < r} A_rs x_s)
    // with C = A[block i, rows before it] X[rows before it] formed on tensor cores, so a
    // thread runs 120 dependent FMAs instead of 2 k and every warp keeps its column. X goes to
    // shared memory as hi and lo planes (the product's B operand) as each block is solved; u is
    // written as fp32, w as split words in the walk's fragment order (lanes 2i and 2i+1 meet
    // in a shuffle) over the right-hand side k exp(G) parked there: a warp's 32 columns are
    // permuted among themselves only, so it reads a block's rows before it writes them.
    constexpr int LX = plane_ld(CH / 2);  // X's and A's plane rows: words of token pairs
    constexpr int XK = CH - SB;          // rows the products read: all but the last block's
    constexpr int LC = 2 * D + 4;        // C rows
    constexpr int DG = SB;  // diagonal blocks' rows (fp32): 16-byte aligned, so the solve's
                            // same-address reads of a row go four at a time
    constexpr int X_OFF = 0, DG_OFF = X_OFF + 2 * 2 * D * LX;
    static_assert(DG_OFF + (CH / SB) * SB * DG <= L::A_OFF,
                  "X and the diagonal blocks fit below A");
    static_assert(2 * XK * LX <= L::B_OFF - L::M_OFF && SB * LC <= L::M_OFF - L::A_OFF,
                  "A's rows in planes fit where Aqk was, C where A was");
    static_assert(2 * D <= THREADS, "one solve column a thread");
    unsigned* Xh = reinterpret_cast<unsigned*>(sm + X_OFF);  // [2][2D][LX]: X^T, pairs along t
    unsigned* Xl = Xh + 2 * D * LX;
    float* Dg = sm + DG_OFF;                                  // [C/SB][SB][DG]: A's diagonal blocks
    unsigned* Ah = reinterpret_cast<unsigned*>(Ms);  // [2][XK][LX]: A rows SB.., pairs along s
    unsigned* Al = Ah + XK * LX;
    float* Cs = A;                                            // [SB][LC]
    __syncthreads();  // k exp(G) in w_out is visible; G, k, q, Es are free; Aqk read
    PHASE(4);
    for (int i = tid; i < XK * XK / 2; i += THREADS) {  // rows SB.. of A, columns < XK
        const int r = i / (XK / 2), p = i % (XK / 2);
        const uint2 y = split_pair(A[(SB + r) * AP + 2 * p], A[(SB + r) * AP + 2 * p + 1]);
        Ah[r * LX + p] = y.x, Al[r * LX + p] = y.y;
    }
    for (int i = tid; i < CH * SB; i += THREADS) {  // the diagonal blocks, fp32
        const int r = i / SB, c = i % SB;
        Dg[(r / SB) * SB * DG + (r % SB) * DG + c] = A[r * AP + (r / SB) * SB + c];
    }
    __syncthreads();  // A is read: C goes there
    PHASE(5);
    const int col = tid, dc = col < D ? col : col - D;
    float* dst = col < D ? u_out + blk + dc : w_out + blk + bfo_word(dc / 2) + 2 * (dc & 1);
    for (int bi = 0; bi < CH / SB; ++bi) {
        const int r0 = bi * SB;
        // this block's right-hand sides, all in flight before the product below: loaded one
        // row at a time inside the substitution, each load's latency sat in its chain
        float rhs[SB];
        if (col < D) {
#pragma unroll
            for (int r = 0; r < SB; ++r)
                rhs[r] = pick(c0 + r0 + r < T, __ldg(v + row0 + (r0 + r) * rstride + dc));
        } else if (col < 2 * D) {
#pragma unroll
            for (int r = 0; r < SB; ++r) rhs[r] = w_out[blk + (r0 + r) * D + dc];
        }
        if (bi > 0) {
            // C [SB, 2D] = A[r0.., :r0] X[:r0, :]: a warp takes 2D / 8 / 8 column tiles
            constexpr int NT = 2 * D / 8 / (THREADS / 32);
            const int n0 = NT * 8 * warp;
            float acc[NT][4] = {}, err[NT][4] = {};
            for (int kp = 0; kp < r0 / 2; kp += 8) {
                const Frag fa = frag_a(Ah, Al, LX, r0 - SB, kp, lane);
#pragma unroll
                for (int j = 0; j < NT; ++j)
                    mma3(acc[j], err[j], fa, frag_bt(Xh, Xl, LX, kp, n0 + 8 * j, lane));
            }
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int hh = 0; hh < 2; ++hh)
                    *reinterpret_cast<float2*>(Cs + (g + 8 * hh) * LC + n0 + 8 * j + 2 * t4) =
                        make_float2(acc[j][2 * hh] + err[j][2 * hh],
                                    acc[j][2 * hh + 1] + err[j][2 * hh + 1]);
            __syncthreads();  // C complete
            PHASE(6);
        }
        if (col < 2 * D) {
            float x[SB];
            const float* dg = Dg + bi * SB * DG;
#pragma unroll
            for (int r = 0; r < SB; ++r) {
                float acc = bi > 0 ? Cs[r * LC + col] : 0.0f;
#pragma unroll
                for (int s2 = 0; s2 < r; ++s2) acc = __fmaf_rn(dg[r * DG + s2], x[s2], acc);
                x[r] = Bs[r0 + r] * (rhs[r] - acc);
            }
            __syncwarp();  // the warp's reads of these rows' right-hand sides are done
#pragma unroll
            for (int r = 0; r < SB; ++r) {
                const int t = r0 + r;
                if (col < D) {
                    dst[t * D] = x[r];
                } else {
                    const float y = __shfl_xor_sync(0xffffffffu, x[r], 1);
                    const uint2 w2 = dc & 1 ? split_pair(y, x[r]) : split_pair(x[r], y);
                    reinterpret_cast<unsigned*>(dst)[t * D] = dc & 1 ? w2.y : w2.x;
                }
            }
            if (r0 + SB < CH) {
#pragma unroll
                for (int q4 = 0; q4 < SB / 8; ++q4) {  // four token pairs a 16-byte store
                    uint2 y[4];
#pragma unroll
                    for (int i = 0; i < 4; ++i)
                        y[i] = split_pair(x[8 * q4 + 2 * i], x[8 * q4 + 2 * i + 1]);
                    const int o = col * LX + r0 / 2 + 4 * q4;
                    *reinterpret_cast<uint4*>(Xh + o) = make_uint4(y[0].x, y[1].x, y[2].x, y[3].x);
                    *reinterpret_cast<uint4*>(Xl + o) = make_uint4(y[0].y, y[1].y, y[2].y, y[3].y);
                }
            }
        }
        __syncthreads();  // X's rows of this block are in place; C is read
        PHASE(7);
    }
}

// ---- walk: the chunks in order, one (head, VS-column slice of V) a block ---------------------
// The state slice rides transposed, S^T [VS, D] (the state's own [Dv, Dk] layout), in the
// registers of the chain warps: warp (r, half) holds rows 16 r.. and the D/2 dimensions of its
// half as C fragments. A C fragment is also an A fragment, so every product takes its A from
// registers:
//   W^T = S^T w^T, v^T = u^T - W^T (the chunk's new values, v = u - w S),
//   O^T = S^T qg^T + v^T Aqk^T,   S^T = S^T diag(gl) + v^T kd.
// Each half forms its partial products over its own dimensions and the two meet once a chunk
// in shared memory (W^T, and O^T where the chain forms it, sum over all of D): two barriers a
// chunk, where S and W kept in shared memory took four and held the tensor pipe 30% busy.
// O is off the chain: the next chunk needs only S. With the wide slice the register file holds
// the chain warps alone, and they form O too. With the narrow slice (SPLIT) a block has one
// chain warp a scheduler, and as many output warps take O: the chain warps hand them the A
// fragments they form anyway (S^T before its update, v^T) through a double buffer, and the
// output warps form O a chunk behind, qg's fragments loaded from L2 into registers a chunk
// ahead and Aqk staged by themselves (the narrow walk 7-10% faster than the chain forming O).
// w (and qg) are double-buffered and copied a chunk ahead; kd, Aqk and gl land during the
// first products (the narrow chain's kd^T and gl a chunk ahead, in the shared memory the
// output warps leave, measured 8-9% slower: a larger burst of copies at each chunk's start).
// gl is read from shared memory after the hand-over (the decay applied just before S's update)
// and u from L2 after the first products: held in registers across those products they took 16
// and 32 a thread, and CuPy's build of the wide walk spilled 48 bytes. Staged rows keep
// bfo_word's order, their 16-byte units swizzled by row parity, so a quarter-warp's loads (rows
// n, n + 1) hit distinct banks.
// SPLIT's named barriers: 1 the chain's, 2 the output's, FULL(b) = 3 + b once the fragments of
// a chunk of parity b are in place, EMPTY(b) = 5 + b once they are read.
template <int D, int VS, bool SPLIT>
struct Walk {
    static constexpr int CW = VS / 8;   // chain warps: VS / 16 row groups x 2 halves of D
    static constexpr int NS = 32 * CW;  // chain threads; SPLIT adds as many output threads
    static constexpr int BLOCK = SPLIT ? 2 * NS : NS;
    static constexpr int DK = D / 2;                  // dimensions a chain warp owns
    static constexpr int NTD = DK / 8, NTC = CH / 8;  // its n-tiles of D; the n-tiles of C
    static constexpr int XW = (SPLIT ? NTC : NTC + NTC / 2) * 128;  // hand-over: W^T (, half O^T)
    static constexpr int FS = VS * D, FP = VS * CH;  // SPLIT: S^T's, v^T's A fragments (words)
    static constexpr int W_OFF = 0, Q_OFF = 2 * CH * D;  // w, (qg): 2 buffers
    static constexpr int K_OFF = (SPLIT ? 2 : 4) * CH * D, A_OFF = K_OFF + D * CH;  // kd^T, Aqk
    static constexpr int F_OFF = A_OFF + (SPLIT ? 2 : 1) * CH * CH;  // SPLIT: Aqk x2, fragments x2
    static constexpr int X_OFF = F_OFF + (SPLIT ? 2 * (FS + FP) : 0);
    static constexpr int GL_OFF = X_OFF + CW * XW, WORDS = GL_OFF + D;
};

// Queue a block of ROWS rows of UNITS 16-byte units, each row's units swizzled by its parity.
// tid: the thread's index among the NTHREADS that share the copy.
template <int ROWS, int UNITS, int NTHREADS>
__device__ __forceinline__ void stage_rows(unsigned* dst, const unsigned* src, int tid) {
    static_assert(ROWS * UNITS % NTHREADS == 0 && UNITS >= 8, "whole rounds; the swizzle fits");
#pragma unroll
    for (int it = 0; it < ROWS * UNITS / NTHREADS; ++it) {
        const int i = tid + it * NTHREADS, r = i / UNITS, q = i % UNITS;
        cp_async16(dst + r * 4 * UNITS + 4 * (q ^ ((r & 1) << 2)), src + 4 * i);
    }
}

// A lane's B fragment from its four words in bfo_word's order: (hi, hi, lo, lo).
__device__ __forceinline__ Frag frag_b(const uint4 x) {
    return {{x.x, x.y, 0u, 0u}, {x.z, x.w, 0u, 0u}};
}

// The B fragment of row n (B's column) and k-block kb of a staged operand, ld words a row.
__device__ __forceinline__ Frag frag_bo(const unsigned* buf, int ld, int n, int kb, int t4) {
    return frag_b(
        *reinterpret_cast<const uint4*>(buf + n * ld + 4 * ((4 * kb + t4) ^ ((n & 1) << 2))));
}

// The A fragment of k-columns 16 i.. from the C fragments of columns 16 i.. (x), 16 i + 8.. (y).
__device__ __forceinline__ Frag frag_of(const float x[4], const float y[4]) {
    const uint2 p0 = split_pair(x[0], x[1]), p1 = split_pair(x[2], x[3]);
    const uint2 p2 = split_pair(y[0], y[1]), p3 = split_pair(y[2], y[3]);
    return {{p0.x, p1.x, p2.x, p3.x}, {p0.y, p1.y, p2.y, p3.y}};
}

// c += a b in 3xBF16 into one accumulator (the walk's products have 8-24 independent ones).
__device__ __forceinline__ void mma3_acc(float c[4], const Frag& a, const Frag& b) {
    mma3(c, c, a, b);
}

__device__ __forceinline__ void bar_sync(int id, int n) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int n) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory");
}

// An A fragment slot of the SPLIT hand-over: 128 words of hi (lane l's four at 4 l), then 128
// of lo: a warp's 16-byte stores and loads each cover 512 contiguous bytes.
__device__ __forceinline__ void put_frag(unsigned* slot, const Frag& f, int lane) {
    *reinterpret_cast<uint4*>(slot + 4 * lane) = make_uint4(f.hi[0], f.hi[1], f.hi[2], f.hi[3]);
    *reinterpret_cast<uint4*>(slot + 128 + 4 * lane) = make_uint4(f.lo[0], f.lo[1], f.lo[2], f.lo[3]);
}
__device__ __forceinline__ Frag get_frag(const unsigned* slot, int lane) {
    const uint4 a = *reinterpret_cast<const uint4*>(slot + 4 * lane);
    const uint4 b = *reinterpret_cast<const uint4*>(slot + 128 + 4 * lane);
    return {{a.x, a.y, a.z, a.w}, {b.x, b.y, b.z, b.w}};
}

// O^T rows vr + g (+ 8) of t-tile tt, where t < T.
template <int D>
__device__ __forceinline__ void store_o(float* core, const float o[4], int c0, int tt, int vr,
                                        int g, int t4, int T, int H) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int t = c0 + 8 * tt + 2 * t4 + (i & 1);
        if (t < T) core[(u64)t * H * D + (u64)blockIdx.x * D + vr + g + 8 * (i >> 1)] = o[i];
    }
}

template <int D, int VS, bool SPLIT>
__device__ void walk_chain(const unsigned* __restrict__ qg, const unsigned* __restrict__ kd,
                           const float* __restrict__ gl, const unsigned* __restrict__ w_in,
                           const float* __restrict__ u_in, const unsigned* __restrict__ aqk,
                           float* __restrict__ state, float* __restrict__ core, int T,
                           int T_pad, int H) {
    using L = Walk<D, VS, SPLIT>;
    constexpr int DK = L::DK, NTD = L::NTD, NTC = L::NTC, HT = NTC / 2, NS = L::NS;
    extern __shared__ __align__(16) unsigned smw[];
    unsigned *Kb = smw + L::K_OFF, *Ab = smw + L::A_OFF;
    const float* Gl = reinterpret_cast<const float*>(smw + L::GL_OFF);
    const int h = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int half = warp & 1, dk0 = half * DK;         // this warp's dimensions
    const int vr = blockIdx.y * VS + 16 * (warp >> 1);  // and its first state row (a v index)
    float4* give = reinterpret_cast<float4*>(smw + L::X_OFF + warp * L::XW);
    const float4* take = reinterpret_cast<const float4*>(smw + L::X_OFF + (warp ^ 1) * L::XW);
    const int nchunks = T_pad / CH;
    const auto sync = [] {  // the chain's barrier
        if constexpr (SPLIT) bar_sync(1, NS); else __syncthreads();
    };
    auto issue_wq = [&](int ci) {  // w (and qg) of chunk ci into buffer ci % 2
        const u64 o = ((u64)ci * H + h) * CH * D;
        stage_rows<CH, D / 4, NS>(smw + L::W_OFF + (ci & 1) * CH * D, w_in + o, threadIdx.x);
        if constexpr (!SPLIT)
            stage_rows<CH, D / 4, NS>(smw + L::Q_OFF + (ci & 1) * CH * D, qg + o, threadIdx.x);
    };

    // S^T rows vr + g (+ 8), columns dk0 + 8 j + 2 t4 (+ 1)
    float S[NTD][4];
    float* st = state + ((u64)h * D + vr + g) * D + dk0 + 2 * t4;
#pragma unroll
    for (int j = 0; j < NTD; ++j) {
        const float2 a = *reinterpret_cast<const float2*>(st + 8 * j);
        const float2 b = *reinterpret_cast<const float2*>(st + 8 * D + 8 * j);
        S[j][0] = a.x, S[j][1] = a.y, S[j][2] = b.x, S[j][3] = b.y;
    }
    issue_wq(0);
    cp_commit();

    for (int ci = 0; ci < nchunks; ++ci) {
        const int c0 = ci * CH, b = ci & 1;
        // SPLIT: this chunk's slots for S^T's and v^T's fragments
        unsigned* Fs = smw + L::F_OFF + b * (L::FS + L::FP) + (warp >> 1) * (D / 16) * 256;
        unsigned* Fp = smw + L::F_OFF + b * (L::FS + L::FP) + L::FS + (warp >> 1) * (CH / 16) * 256;
        cp_wait<0>();
        sync();  // w, qg (ci) landed; the last chunk's reads of kd, Aqk, hand-overs done
        stage_rows<D, CH / 4, NS>(Kb, kd + ((u64)ci * H + h) * D * CH, threadIdx.x);
        if constexpr (!SPLIT)
            stage_rows<CH, CH / 4, NS>(Ab, aqk + ((u64)ci * H + h) * CH * CH, threadIdx.x);
        if (threadIdx.x < D / 4)
            cp_async16(smw + L::GL_OFF + 4 * threadIdx.x,
                       gl + ((u64)ci * H + h) * D + 4 * threadIdx.x);
        cp_commit();
        if (ci + 1 < nchunks) issue_wq(ci + 1);
        cp_commit();
        // u (half 0 subtracts it) is fetched into L2 now and read after the first products:
        // held in registers across them it took 32 a thread
        const u64 urow = ((u64)ci * H + h) * CH;
        constexpr int ULINES = VS / 32;  // 128-byte lines a row
        if (threadIdx.x < CH * ULINES) {
            const float* line = u_in + (urow + threadIdx.x / ULINES) * D + blockIdx.y * VS +
                                32 * (threadIdx.x % ULINES);
            asm volatile("prefetch.global.L2 [%0];" ::"l"(line));
        }
        if constexpr (SPLIT)
            if (ci >= 2) bar_sync(5 + b, L::BLOCK);  // chunk ci - 2's fragments are read

        // W^T (and O^T) over this half's dimensions. O's slot j is t-tile (j + HT half) % NTC:
        // slots below HT are the tiles this warp finishes, the rest its partner's.
        const unsigned* wb = smw + L::W_OFF + (ci & 1) * CH * D;
        const unsigned* qb = smw + L::Q_OFF + (ci & 1) * CH * D;
        float P[NTC][4] = {}, O[SPLIT ? 1 : NTC][4] = {};
#pragma unroll
        for (int ks = 0; ks < DK / 16; ++ks) {
            const Frag a = frag_of(S[2 * ks], S[2 * ks + 1]);
            const int kb = half * (DK / 16) + ks;
            if constexpr (SPLIT) put_frag(Fs + kb * 256, a, lane);
#pragma unroll
            for (int j = 0; j < NTC; ++j) {
                mma3_acc(P[j], a, frag_bo(wb, D, 8 * j + g, kb, t4));
                if constexpr (!SPLIT)
                    mma3_acc(O[j], a, frag_bo(qb, D, 8 * ((j + HT * half) % NTC) + g, kb, t4));
            }
        }
#pragma unroll
        for (int j = 0; j < NTC; ++j) {
            if (!half) {
                const float* ub = u_in + (urow + 8 * j + 2 * t4) * D + vr + g;  // u[c][v]
#pragma unroll
                for (int i = 0; i < 4; ++i) P[j][i] = ub[(i & 1) * D + 8 * (i >> 1)] - P[j][i];
            }
            give[j * 32 + lane] = make_float4(P[j][0], P[j][1], P[j][2], P[j][3]);
        }
        if constexpr (!SPLIT) {
#pragma unroll
            for (int j = HT; j < NTC; ++j)
                give[(NTC + j - HT) * 32 + lane] = make_float4(O[j][0], O[j][1], O[j][2], O[j][3]);
        }
        cp_wait<1>();
        sync();  // kd, Aqk, gl (ci) landed; both halves' hand-overs written
#pragma unroll
        for (int j = 0; j < NTD; ++j) {
            const float2 x = *reinterpret_cast<const float2*>(Gl + dk0 + 8 * j + 2 * t4);
            S[j][0] *= x.x, S[j][1] *= x.y, S[j][2] *= x.x, S[j][3] *= x.y;
        }

        // v^T = (u^T - W^T of half 0) - W^T of half 1: the same bits in both halves
#pragma unroll
        for (int j = 0; j < NTC; ++j) {
            const float4 x = take[j * 32 + lane];
            const float y[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) P[j][i] = half ? y[i] - P[j][i] : P[j][i] - y[i];
        }
        if constexpr (!SPLIT) {
#pragma unroll
            for (int j = 0; j < HT; ++j) {
                const float4 x = take[(NTC + j) * 32 + lane];
                O[j][0] += x.x, O[j][1] += x.y, O[j][2] += x.z, O[j][3] += x.w;
            }
        }
#pragma unroll
        for (int ks = 0; ks < CH / 16; ++ks) {
            const Frag a = frag_of(P[2 * ks], P[2 * ks + 1]);
            if constexpr (SPLIT)
                if ((ks & 1) == half) put_frag(Fp + ks * 256, a, lane);
#pragma unroll
            for (int j = 0; j < NTD; ++j)
                mma3_acc(S[j], a, frag_bo(Kb, CH, dk0 + 8 * j + g, ks, t4));
            if constexpr (!SPLIT) {
#pragma unroll
                for (int j = 0; j < HT; ++j) {
                    const int tt = j + HT * half;  // Aqk[t][s] is zero for s > t
                    if (2 * ks <= tt) mma3_acc(O[j], a, frag_bo(Ab, CH, 8 * tt + g, ks, t4));
                }
            }
        }
        if constexpr (SPLIT) {
            bar_arrive(3 + b, L::BLOCK);
        } else {
#pragma unroll
            for (int j = 0; j < HT; ++j) store_o<D>(core, O[j], c0, j + HT * half, vr, g, t4, T, H);
        }
    }
    cp_wait<0>();
#pragma unroll
    for (int j = 0; j < NTD; ++j) {
        *reinterpret_cast<float2*>(st + 8 * j) = make_float2(S[j][0], S[j][1]);
        *reinterpret_cast<float2*>(st + 8 * D + 8 * j) = make_float2(S[j][2], S[j][3]);
    }
}

// SPLIT's output warps: warp (row group, half of the chunk's t-tiles), O^T = S^T qg^T + v^T
// Aqk^T from the chain's fragments of a chunk.
template <int D, int VS>
__device__ void walk_output(const unsigned* __restrict__ qg, const unsigned* __restrict__ aqk,
                            float* __restrict__ core, int T, int T_pad, int H) {
    using L = Walk<D, VS, true>;
    constexpr int NTC = L::NTC, HT = NTC / 2, NS = L::NS, KB = D / 16;
    extern __shared__ __align__(16) unsigned smw[];
    const int h = blockIdx.x, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    const int ow = (threadIdx.x - NS) >> 5, rg = ow >> 1, th = ow & 1, tid = threadIdx.x - NS;
    const int vr = blockIdx.y * VS + 16 * rg;
    const int nchunks = T_pad / CH;
    uint4 qf[KB][HT];  // qg's B fragments, in its global fragment order (no swizzle)
    auto load_qg = [&](int ci) {
        const unsigned* base = qg + ((u64)ci * H + h) * CH * D;
#pragma unroll
        for (int kb = 0; kb < KB; ++kb)
#pragma unroll
            for (int j = 0; j < HT; ++j)
                qf[kb][j] = __ldg(reinterpret_cast<const uint4*>(
                    base + (8 * (j + HT * th) + g) * D + 16 * kb + 4 * t4));
    };
    auto stage_aqk = [&](int ci) {
        stage_rows<CH, CH / 4, NS>(smw + L::A_OFF + (ci & 1) * CH * CH,
                                   aqk + ((u64)ci * H + h) * CH * CH, tid);
    };
    load_qg(0);
    stage_aqk(0);
    cp_commit();
    for (int ci = 0; ci < nchunks; ++ci) {
        const int b = ci & 1;
        const unsigned* Fs = smw + L::F_OFF + b * (L::FS + L::FP) + rg * KB * 256;
        const unsigned* Fp = smw + L::F_OFF + b * (L::FS + L::FP) + L::FS + rg * (CH / 16) * 256;
        bar_sync(3 + b, L::BLOCK);  // chunk ci's fragments are in place
        float O[HT][4] = {};
#pragma unroll
        for (int kb = 0; kb < KB; ++kb) {
            const Frag a = get_frag(Fs + kb * 256, lane);
#pragma unroll
            for (int j = 0; j < HT; ++j)
                mma3_acc(O[j], a, frag_b(qf[kb][j]));
        }
        if (ci + 1 < nchunks) load_qg(ci + 1);
        cp_wait<0>();
        bar_sync(2, NS);  // Aqk (ci) landed; every output warp is past chunk ci - 1
        const unsigned* Ab = smw + L::A_OFF + b * CH * CH;
#pragma unroll
        for (int ks = 0; ks < CH / 16; ++ks) {
            const Frag a = get_frag(Fp + ks * 256, lane);
#pragma unroll
            for (int j = 0; j < HT; ++j) {
                const int tt = j + HT * th;  // Aqk[t][s] is zero for s > t
                if (2 * ks <= tt) mma3_acc(O[j], a, frag_bo(Ab, CH, 8 * tt + g, ks, t4));
            }
        }
        if (ci + 2 < nchunks) bar_arrive(5 + b, L::BLOCK);
#pragma unroll
        for (int j = 0; j < HT; ++j) store_o<D>(core, O[j], ci * CH, j + HT * th, vr, g, t4, T, H);
        if (ci + 1 < nchunks) stage_aqk(ci + 1);
        cp_commit();
    }
    cp_wait<0>();
}

// T_pad is not read here (the grid carries the chunk count); it keeps the launch's arguments
// those of the host twin, which loops over it.
#define KDA_CHUNK_INTRA(D)                                                                     \
    extern "C" __global__ void __launch_bounds__(THREADS, 2) kda_chunk_intra_d##D(                \
        const float* q, const float* k, const float* v, const float* gate, const float* beta,  \
        unsigned* qg, unsigned* kd, float* gl, float* w, float* u, unsigned* aqk, int T,       \
        int T_pad, int H, float scale) {                                                       \
        chunk_intra<D>(q, k, v, gate, beta, qg, kd, gl, w, u, aqk, T, H, scale);               \
    }
#define KDA_CHUNK_INTER(D, VS, SPLIT)                                                          \
    extern "C" __global__ void __launch_bounds__((Walk<D, VS, SPLIT>::BLOCK), 1)                \
        kda_chunk_inter_d##D##_v##VS(                                                          \
        const unsigned* qg, const unsigned* kd, const float* gl, const unsigned* w,            \
        const float* u, const unsigned* aqk, float* state, float* core, int T, int T_pad,      \
        int H) {                                                                               \
        if (!SPLIT || threadIdx.x < Walk<D, VS, SPLIT>::NS)                                    \
            walk_chain<D, VS, SPLIT>(qg, kd, gl, w, u, aqk, state, core, T, T_pad, H);         \
        else                                                                                   \
            walk_output<D, VS>(qg, aqk, core, T, T_pad, H);                                    \
    }
KDA_CHUNK_INTRA(64)
KDA_CHUNK_INTRA(128)
KDA_CHUNK_INTER(64, 32, true)
KDA_CHUNK_INTER(64, 64, false)
KDA_CHUNK_INTER(128, 32, true)
KDA_CHUNK_INTER(128, 64, false)
