// The chunked (WY) KDA core for prefill, C = 64 tokens a chunk, in two launches:
//   kda_chunk_intra: every (chunk, head) in parallel builds the in-chunk cumulative decay G,
//     A[t][s] = sum_d k_t k_s exp(G_t - G_s) (s < t) and Aqk (s <= t, q scaled), solves
//     (I + diag(b) A) [u | w] = diag(b) [v | k exp(G)] by forward substitution, and precomputes
//     everything elementwise the sequential walk needs: qg = q exp(G), kd = k exp(G_last - G),
//     gl = exp(G_last). The walk then does no transcendental math at all.
//   kda_chunk_inter_d{D}, the Hopper walk, built for sm_90a alone (kernels_cu/chunk_portable.cu
//     has the walk every other GPU runs): per (head, 64-column slice of V) walks the chunks in
//     order with its state slice in registers: W = u - w S; O = qg S + Aqk W; S = gl S + kd^T W. The
//     products run on warpgroup MMAs in 3xBF16 from operands the intra kernel already wrote as
//     split bf16 words, one (chunk, head) block each, as the walk's shared-memory image (so
//     one bulk copy stages each and its inner loops convert nothing); the next operands land
//     while the current products run.
// q, k and v come from conv_out (bf16, each segment's tokens), the decay and beta from g_raw
// and gate_in's b columns (bf16, the same rows), through gate.cuh's formula: kda_gate_beta's
// fp32 values, which the intra kernel forms where it needs them rather than reading them back
// from a [T_pad, H, D] fp32 buffer (kda_gate_beta then runs only for a stage hook). Rows past a
// segment's tokens are zero on load: no row past them is read (their loads read the segment's
// last token, then are selected away, never multiplied), so whatever the workspace holds there
// can reach neither the outputs nor the state. Decays are exponentiated as
// differences G_t - G_s with s <= t (<= 0), or, in the intra kernel's factorised diagonal
// blocks, as differences bounded by a checked span: nothing overflows.
#include "chunk.cuh"
#include "gate.cuh"
#include "sm90.cuh"
#include "segments.cuh"

// tools/chunk_phases.py builds this file with -DKDA_CHUNK_PHASES: thread 0 of each block then
// adds the clock64() cycles since its last mark into phase_cycles[i] at PHASE(i): the intra
// kernel's 0-7, one after each block-wide barrier, the walk's 8-13 at each chunk's waits and
// product groups. In every other build the marks are nothing.
#ifdef KDA_CHUNK_PHASES
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

#define AP 68   // padded row stride of C x C tiles: 16-byte rows, rows 2 apart in distinct banks

__device__ __forceinline__ float pick(bool valid, float x) { return valid ? x : 0.0f; }

// 4 bf16 at p (8-byte aligned), widened exactly, or zeros where !ok. The caller points p at a
// row that exists either way (the chunk's last token for rows past it), so every load of a
// phase is issued unconditionally and all are in flight at once; the select drops its value.
__device__ __forceinline__ float4 load4_bf16(bool ok, const bf16* p) {
    const uint2 w = __ldg(reinterpret_cast<const uint2*>(p));
    const float2 a = unpack2(w.x), b = unpack2(w.y);
    return ok ? make_float4(a.x, a.y, b.x, b.y) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

// The intra kernel keeps its operands as hi and lo planes: rows of bf16 along the product's k
// axis, ld words a row, rows an odd multiple of 16 bytes apart so that the rows of each 8 x 8
// tile hit distinct banks. `frag_a` reads A[m][k] from rows m, `frag_bt` B[k][n] from rows n,
// by ldmatrix: the registers arrive in the order the MMA takes them (rows of (hi, lo) word
// pairs took register moves to get there, ~2.5 an MMA).
__host__ __device__ constexpr int plane_ld(int words) {  // words: a multiple of 8; + 16 bytes
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

// Where the intra kernel parks k exp(G)[t][d] in a w block until the solve overwrites it: the
// words w's rows of t's 16-row solve block take in its image (64-word runs: two token octets
// in each dimension octet of a plane), row t's dimensions 64 to a run, so that the parking and
// the solve's reads of it are whole 256-byte runs.
template <int D>
__host__ __device__ constexpr int park_word(int t, int d) {
    const int r = (D / 64) * (t % 16) + d / 64;  // the run: a plane's D / 8 k-octets each
    return (r / (D / 8)) * (CHUNK * D / 2) + (r % (D / 8)) * 4 * CHUNK + 64 * (t / 16) + d % 64;
}

// ---- intra: every (chunk, head) in parallel -----------------------------------------------------
// A[t][s] and Aqk[t][s] need exp(G_t - G_s) per dimension. With r the first row of t's 16-row
// block it factors as exp(G_t - G_r) exp(G_r - G_s), so a block row of A and Aqk is a product
// of scaled rows on tensor cores (see the loop over r for when the diagonal block may use it).
// Dimensions are staged 64 at a time, which keeps a block at ~111 KB of shared memory so two
// blocks share an SM (227 KB) and one's loads overlap the other's arithmetic; where a block may
// take less (99 KB: sm_86, sm_89, sm_120), 32 at a time (94 KB at D = 128).
template <int D, int DH_>
struct IntraLayout {
    static constexpr int DH = DH_;       // dimensions staged at a time
    static constexpr int P = DH + 2;     // G, k, q rows: the pairwise walk hits bank 2s + parity
    static constexpr int PE = plane_ld(DH / 2);  // scaled rows: the hi and lo planes' rows
    static constexpr int SB = 16;        // the factorisation's block of rows
    static constexpr int EROWS = CHUNK + 2 * SB;  // scaled rows: k_s (s <= r + 15), then k_t, q_t
    static constexpr int G_OFF = 0, K_OFF = CHUNK * P, Q_OFF = 2 * CHUNK * P, E_OFF = 3 * CHUNK * P;
    // the solve's X planes (rows of the 2 D columns, the XK tokens its products read) and A's
    // diagonal blocks take the place of G, k, q and the scaled rows
    static constexpr int XK = CHUNK - SB, LX = plane_ld(XK / 2), DG = SB;
    static constexpr int X_OFF = 0, DG_OFF = X_OFF + 2 * 2 * D * LX;
    static constexpr int SOLVE_END = DG_OFF + (CHUNK / SB) * SB * DG;
    static constexpr int ROWS_END = E_OFF + 2 * EROWS * PE;
    static constexpr int A_OFF = ROWS_END > SOLVE_END ? ROWS_END : SOLVE_END;
    static constexpr int M_OFF = A_OFF + CHUNK * AP, B_OFF = M_OFF + CHUNK * AP;
    static constexpr int FLOATS = B_OFF + CHUNK;
};
template <int D>
using Intra = IntraLayout<D, IntraLayout<D, 64>::FLOATS * 4 <= SMEM_PER_BLOCK ? 64 : 32>;

// q, k and v are read from conv_out [T, 3 H D] bf16, g_raw from g_raw [T, H D] bf16 and b from
// b_raw (row stride ldb) bf16, all packed rows: chunk ci's rows are its segment's tokens
// (segments.cuh), rows past the segment's end zero.
template <int D>
__device__ void chunk_intra(const bf16* __restrict__ x, const GateArgs ga,
                            unsigned* __restrict__ qg_out,
                            unsigned* __restrict__ kd_out, float* __restrict__ gl_out,
                            float* __restrict__ w_out, float* __restrict__ u_out,
                            unsigned* __restrict__ aqk, const int* __restrict__ segs, int nseg,
                            int T, int H, float scale, int ci, int h, int* __restrict__ ready,
                            int readers) {
    using L = Intra<D>;
    constexpr int DH = L::DH, P = L::P, PE = L::PE, SB = L::SB;
    extern __shared__ __align__(16) float sm[];
    float *Gs = sm + L::G_OFF, *Ks = sm + L::K_OFF, *Qs = sm + L::Q_OFF, *Es = sm + L::E_OFF;
    float *A = sm + L::A_OFF, *Ms = sm + L::M_OFF, *Bs = sm + L::B_OFF;
    const int tid = threadIdx.x, c0 = ci * CHUNK;
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const Segment sg = segment_at(segs, segment_of_chunk(segs, nseg, ci), T);
    const int lt0 = c0 - sg.chunk0 * CHUNK;         // the chunk's first token of its segment
    const int valid = min(CHUNK, sg.rows - lt0);    // its rows that are tokens
    const int qkv = H * D;
    const bf16* xq = x + (u64)(sg.row0 + lt0) * 3 * qkv + h * D;  // row r: q, then k, v qkv on
    const bf16* xg = ga.g_raw + (u64)(sg.row0 + lt0) * qkv + h * D;  // row r: this head's g_raw
    const u64 blk = ((u64)ci * H + h) * CHUNK * D;  // the outputs: one block a (chunk, head)

    for (int i = tid; i < 2 * CHUNK * AP; i += THREADS) A[i] = 0.0f;  // A and Aqk (Ms) accumulate
    PHASES_BEGIN;
    if (tid < CHUNK) {  // beta, kda_gate_beta's value
        const u64 row = (u64)sg.row0 + lt0 + min(tid, valid - 1);
        Bs[tid] = pick(tid < valid, sigmoidf_(bf2f(ga.b_raw[row * ga.ldb + h])));
    }

    for (int d0 = 0; d0 < D; d0 += DH) {
        // k, q and the gate's cumulative sum G over dimensions [d0, d0 + DH). Each thread sums
        // one dimension over a segment of rows in registers; segment totals then shift the
        // later segments.
        {
            constexpr int IT = CHUNK * DH / 4 / THREADS, SEGS = THREADS / DH, SL = CHUNK / SEGS;
            float4 kv[IT], qv[IT];
            float gv[SL];
            const int d = tid % DH, seg = tid / DH;
#pragma unroll
            for (int it = 0; it < IT; ++it) {
                const int i = tid + it * THREADS, r = i / (DH / 4), c4 = (i % (DH / 4)) * 4;
                const bf16* xr = xq + (u64)min(r, valid - 1) * 3 * qkv + d0 + c4;
                kv[it] = load4_bf16(r < valid, xr + qkv);
                qv[it] = load4_bf16(r < valid, xr);
            }
#pragma unroll
            for (int j = 0; j < SL; ++j)
                gv[j] = bf2f(xg[(u64)min(seg * SL + j, valid - 1) * qkv + d0 + d]);  // g_raw
#pragma unroll
            for (int it = 0; it < IT; ++it) {
                const int i = tid + it * THREADS, r = i / (DH / 4), c4 = (i % (DH / 4)) * 4;
                const float4 kk = kv[it], qq = qv[it];
                *reinterpret_cast<float2*>(Ks + r * P + c4) = make_float2(kk.x, kk.y);
                *reinterpret_cast<float2*>(Ks + r * P + c4 + 2) = make_float2(kk.z, kk.w);
                *reinterpret_cast<float2*>(Qs + r * P + c4) = make_float2(qq.x * scale, qq.y * scale);
                *reinterpret_cast<float2*>(Qs + r * P + c4 + 2) = make_float2(qq.z * scale, qq.w * scale);
            }
            // the decay once k and q are stored (their registers free): kda_gate_beta's value
            const float a = expf(ga.a_log[h]), bias = ga.dt_bias[h * D + d0 + d];
            float run = 0.0f;
#pragma unroll
            for (int j = 0; j < SL; ++j) {
                run += pick(seg * SL + j < valid, kda_gate_value(gv[j] + bias, a, ga.lower_bound,
                                                                 ga.bounded));
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
        // walk's image), and k exp(G), the solve's right-hand side, parked in w_out (park_word).
        // The qg and kd^T loops give a warp 8 rows x 4 pairs at a time, one core matrix of the
        // image: each of its stores is 128 contiguous bytes of a plane.
        static_assert(64 % DH == 0 && THREADS % DH == 0, "whole rows a warp, two dimensions a lane");
        constexpr int RPW = 64 / DH;  // the scaled rows' rows a warp builds at a time
        const int c2 = 2 * (lane % (DH / 2)), rw = lane / (DH / 2);  // a lane's dimensions, row
        if (tid < DH) gl_out[((u64)ci * H + h) * D + d0 + tid] = expf(Gs[(CHUNK - 1) * P + tid]);
        for (int it = warp; it < (CHUNK / 8) * (DH / 8); it += THREADS / 32) {
            const int r = 8 * (it / (DH / 8)) + (lane >> 2), pl = 4 * (it % (DH / 8)) + (lane & 3);
            const float2 G = *reinterpret_cast<const float2*>(Gs + r * P + 2 * pl);
            const float2 qq = *reinterpret_cast<const float2*>(Qs + r * P + 2 * pl);
            const float2 kk = *reinterpret_cast<const float2*>(Ks + r * P + 2 * pl);
            const float e0 = __expf(G.x), e1 = __expf(G.y);
            const uint2 x = split_pair(qq.x * e0, qq.y * e1);
            unsigned* qw = qg_out + blk + img_word(CHUNK, r, d0 / 2 + pl);
            qw[0] = x.x, qw[CHUNK * D / 2] = x.y;
            *reinterpret_cast<float2*>(w_out + blk + park_word<D>(r, d0 + 2 * pl)) =
                make_float2(kk.x * e0, kk.y * e1);
        }
        // kd^T, a [D][C] block a (chunk, head): rows d, pairs of tokens
        for (int it = warp; it < (DH / 8) * (CHUNK / 8); it += THREADS / 32) {
            const int d = 8 * (it / (CHUNK / 8)) + (lane >> 2), tp = 4 * (it % (CHUNK / 8)) + (lane & 3);
            const float GL = Gs[(CHUNK - 1) * P + d];
            const float k0 = Ks[2 * tp * P + d] * __expf(GL - Gs[2 * tp * P + d]);
            const float k1 = Ks[(2 * tp + 1) * P + d] * __expf(GL - Gs[(2 * tp + 1) * P + d]);
            const uint2 x = split_pair(k0, k1);
            unsigned* kw = kd_out + blk + img_word(D, d0 + d, tp);
            kw[0] = x.x, kw[D * CHUNK / 2] = x.y;
        }

        // A block row of 16 at a time: rows r.. of A and Aqk against every row up to r + 15,
        // as [k_t; q_t] exp(G_t - G_r) times (k_s exp(G_r - G_s))^T on tensor cores. Before
        // the diagonal block both factors are <= 1. On it exp(G_r - G_s) >= 1, safe while the
        // block's decay span max_d (G_r - G_{r+15}) stays under SPAN (every factor within
        // e^+-SPAN, far inside fp32), which the bounded gate always meets (15 x 5 < SPAN); a
        // block beyond it takes exp(G_t - G_s) pair by pair instead.
        constexpr float SPAN = 76.0f;
        for (int r = 0; r < CHUNK; r += SB) {
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
            // k_s exp(G_r - G_s)
            for (int s = RPW * warp + rw; s < ncols; s += RPW * THREADS / 32) {
                const float2 x = *reinterpret_cast<const float2*>(Ks + s * P + c2);
                const float2 G = *reinterpret_cast<const float2*>(Gs + s * P + c2);
                const uint2 y = split_pair(x.x * __expf(Gr.x - G.x), x.y * __expf(Gr.y - G.y));
                Eh[s * PE + c2 / 2] = y.x, El[s * PE + c2 / 2] = y.y;
            }
            // k_t, then q_t, exp(G_t - G_r)
            for (int i = RPW * warp + rw; i < 2 * SB; i += RPW * THREADS / 32) {
                const int t = r + (i < SB ? i : i - SB);
                const float2 x = *reinterpret_cast<const float2*>((i < SB ? Ks : Qs) + t * P + c2);
                const float2 G = *reinterpret_cast<const float2*>(Gs + t * P + c2);
                const uint2 y = split_pair(x.x * __expf(G.x - Gr.x), x.y * __expf(G.y - Gr.y));
                Eh[(CHUNK + i) * PE + c2 / 2] = y.x, El[(CHUNK + i) * PE + c2 / 2] = y.y;
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
                    mma3(c, e, frag_a(Eh, El, PE, CHUNK + SB * mt, kp, lane),
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
    {  // Aqk as split words, rows t with s-pairs in the walk's planes
        unsigned* Mg = aqk + ((u64)ci * H + h) * CHUNK * CHUNK;
        for (int i = tid; i < CHUNK * CHUNK / 2; i += THREADS) {  // a warp: 8 rows x 4 pairs
            const int q = i & 31, t = 8 * ((i >> 5) / 8) + (q >> 2);
            const int p = 4 * ((i >> 5) % 8) + (q & 3);
            const uint2 x = split_pair(Ms[t * AP + 2 * p], Ms[t * AP + 2 * p + 1]);
            Mg[img_word(CHUNK, t, p)] = x.x, Mg[img_word(CHUNK, t, p) + CHUNK * CHUNK / 2] = x.y;
        }
    }

    // (I + diag(b) A) [u | w] = diag(b) [v | k exp(G)], one column a thread, by 16-row
    // blocks: block i's rows are x_r = b_r (rhs_r - C_r - sum_{s in block, s < r} A_rs x_s)
    // with C = A[block i, rows before it] X[rows before it] formed on tensor cores, so a
    // thread runs 120 dependent FMAs instead of 2 k and every warp keeps its column. X goes to
    // shared memory as hi and lo planes (the product's B operand) as each block is solved; u is
    // written as fp32 and w as split words in the walk's image (w_word), over the right-hand
    // side k exp(G) parked in the words of the same 16-row block (park_word), read before any
    // of them is written.
    constexpr int LX = L::LX;  // X's and A's plane rows: words of token pairs
    constexpr int XK = L::XK;  // rows the products read: all but the last block's
    constexpr int LC = 2 * D + 4;        // C rows
    constexpr int DG = L::DG;  // diagonal blocks' rows (fp32): 16-byte aligned, so the solve's
                               // same-address reads of a row go four at a time
    static_assert(2 * XK * LX <= L::B_OFF - L::M_OFF && SB * LC <= L::M_OFF - L::A_OFF,
                  "A's rows in planes fit where Aqk was, C where A was");
    static_assert(2 * D <= THREADS, "one solve column a thread");
    unsigned* Xh = reinterpret_cast<unsigned*>(sm + L::X_OFF);  // [2][2D][LX]: X^T, pairs along t
    unsigned* Xl = Xh + 2 * D * LX;
    float* Dg = sm + L::DG_OFF;                               // [C/SB][SB][DG]: A's diagonal blocks
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
    for (int i = tid; i < CHUNK * SB; i += THREADS) {  // the diagonal blocks, fp32
        const int r = i / SB, c = i % SB;
        Dg[(r / SB) * SB * DG + (r % SB) * DG + c] = A[r * AP + (r / SB) * SB + c];
    }
    __syncthreads();  // A is read: C goes there
    PHASE(5);
    const int col = tid, dc = col < D ? col : col - D;
    float* u_slice = u_out + blk + (dc / WALK_ROWS) * CHUNK * WALK_ROWS;  // u's slices
    unsigned* w_img = reinterpret_cast<unsigned*>(w_out) + blk;
    for (int bi = 0; bi < CHUNK / SB; ++bi) {
        const int r0 = bi * SB;
        // this block's right-hand sides, all in flight before the product below: loaded one
        // row at a time inside the substitution, each load's latency sat in its chain
        float rhs[SB];
        if (col < D) {
#pragma unroll
            for (int r = 0; r < SB; ++r)
                rhs[r] = pick(r0 + r < valid,  // a row that exists: every load in flight
                              bf2f(xq[(u64)min(r0 + r, valid - 1) * 3 * qkv + 2 * qkv + dc]));
        } else if (col < 2 * D) {
#pragma unroll
            for (int r = 0; r < SB; ++r) rhs[r] = w_out[blk + park_word<D>(r0 + r, dc)];
        }
        if (bi == 0) __syncthreads();  // every thread has read block 0's parked rows
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
            if (col < D) {
#pragma unroll
                for (int r = 0; r < SB; ++r) u_slice[u_word(r0 + r, dc % WALK_ROWS)] = x[r];
            }
#pragma unroll
            for (int q4 = 0; q4 < SB / 8; ++q4) {  // 8 tokens: a 16-byte store of each plane
                uint2 y[4];
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    y[i] = split_pair(x[8 * q4 + 2 * i], x[8 * q4 + 2 * i + 1]);
                const uint4 hi = make_uint4(y[0].x, y[1].x, y[2].x, y[3].x);
                const uint4 lo = make_uint4(y[0].y, y[1].y, y[2].y, y[3].y);
                if (r0 + SB < CHUNK) {
                    const int o = col * LX + r0 / 2 + 4 * q4;
                    *reinterpret_cast<uint4*>(Xh + o) = hi;
                    *reinterpret_cast<uint4*>(Xl + o) = lo;
                }
                if (col >= D) {
                    unsigned* wq = w_img + w_word(dc, r0 + 8 * q4);
                    *reinterpret_cast<uint4*>(wq) = hi;
                    *reinterpret_cast<uint4*>(wq + CHUNK * D / 2) = lo;
                }
            }
        }
        __syncthreads();  // X's rows of this block are in place; C is read
        PHASE(7);
    }
    if (ready != nullptr) {  // a walk beside this block waits for its outputs (kda_chunk_core)
        __threadfence();
        __syncthreads();
        if (tid == 0) atomicExch(ready + (u64)ci * H + h, readers);
    }
}

// The Hopper walk's device code exists only where its warpgroup MMAs do (sm_90a builds); nvcc's
// host pass (no __CUDA_ARCH__) keeps its entries, whose launch stubs it writes for every build.
#if !defined(__CUDA_ARCH__) || KDA_WGMMA
// ---- walk: the chunks in order, one (head, 64-column slice of V) and share of segments a block --
// Each segment (segments.cuh) walks its own chunks from its pool slot's state (or zero), writes
// its core rows at its packed rows, its final state back to its slot and, where asked, the
// state after every `every` chunks to checkpoint slots. A plain prefill is one segment. Block z
// of gridDim.z walks segments z, z + gridDim.z, ... one after another as one stream of chunks,
// so the copies run ahead across a segment's end and many short segments cost a chunk each,
// not a block's start-up each (kernels.py sizes gridDim.z to one wave).
// One warpgroup a block carries its slice of the state transposed, S^T [64, D] (the state's own
// [Dv, Dk] layout), as the fp32 accumulator of an m64nD warpgroup MMA: warp w holds rows 16 w..
// with all D dimensions, so no product is split over warps and nothing is reduced across them.
// A chunk is four products, every one with its A operand in registers (an accumulator's
// fragments are an A operand's) and its B operand in shared memory:
//   W^T = S^T w^T and O^T = S^T qg^T;  v^T = u^T - W^T;
//   S^T = S^T diag(gl) + v^T kd and O^T += v^T Aqk^T.
// Warpgroup MMAs run at 1.5x the rate mma.sync reaches (4096 against ~2700 bf16 FLOP a cycle
// an SM, measured) and issue asynchronously; each product is 3xBF16 from split words, as the
// intra kernel's. The operands arrive by bulk copies, one a (chunk, head) block, since the
// intra kernel writes them as this kernel's shared-memory image: 128 KB a chunk through
// cp.async from four warps ran at ~15 bytes a cycle an SM, the chain's products waiting on
// their issue. A fifth warp issues the copies, so the warpgroup never waits on an issue: w, qg,
// u and gl of chunk ci + 1 land in a second buffer, and kd and Aqk of chunk ci (which only the
// second pair reads) in their one buffer, from the moment chunk ci - 1 is done with them. O^T's
// terms are committed as groups of their own behind W^T and S^T, which are waited for alone.
template <int D>
struct Walk {
    static_assert(WALK_ROWS == 64 && WALK_THREADS == WARPGROUP + 32,
                  "a warpgroup MMA's m64 state rows, then the copies' warp");
    static constexpr int WQ_BYTES = CHUNK * D * 4, K_BYTES = D * CHUNK * 4, A_BYTES = CHUNK * CHUNK * 4;
    static constexpr int U_BYTES = CHUNK * WALK_ROWS * 4, GL_BYTES = D * 4;
    static constexpr int W_OFF = 0, Q_OFF = 2 * WQ_BYTES, K_OFF = 4 * WQ_BYTES;  // w, qg: 2 buffers
    static constexpr int A_OFF = K_OFF + K_BYTES, U_OFF = A_OFF + A_BYTES;      // kd^T, Aqk
    static constexpr int GL_OFF = U_OFF + 2 * U_BYTES, BAR_OFF = GL_OFF + 2 * GL_BYTES;  // u, gl: 2
    // mbarriers: w, qg, u, gl landed in buffer 0 or 1; kd, Aqk landed; the warpgroup done with
    // a chunk's shared memory
    static constexpr int KD_BAR = 2, DONE_BAR = 3, BYTES = BAR_OFF + (DONE_BAR + 1) * 8;
};

// The hi plane's descriptor of a staged operand of N rows (img_word's layout).
template <int N>
__device__ __forceinline__ u64 operand_desc(const unsigned char* p) {
    return wgmma_desc(p, N * 16, 128);
}
#define W_LBO (CHUNK * 16)  // bytes between dimension (k) octets
#define W_SBO 128        // bytes between token (n) octets
// w's (w_word's layout, MN-major): core matrices of 8 dimensions x 8 tokens
__device__ __forceinline__ u64 w_desc(const unsigned char* p) {
    return wgmma_desc(p, W_LBO, W_SBO);
}

// d += A B over K in 3xBF16: A's fragments in registers, B a staged operand of N rows (hi plane
// descriptor bh; a k-step is two core matrices along K, the lo plane N K bf16 on).
template <int N, int K, int TB = 0, int S = 0>
__device__ __forceinline__ void wg3(float (&d)[N / 2], const unsigned (&ah)[K / 16][4],
                                    const unsigned (&al)[K / 16][4], u64 bh) {
    if constexpr (S < K / 16) {
        wgmma_rs<N, 2 * N * S, TB>(d, al[S], bh);
        wgmma_rs<N, 2 * N * S + N * K / 8, TB>(d, ah[S], bh);
        wgmma_rs<N, 2 * N * S, TB>(d, ah[S], bh);
        wg3<N, K, TB, S + 1>(d, ah, al, bh);
    }
}

// A chunk that intra blocks of the same launch may still be writing (kda_chunk_core): wait for
// its (chunk, head) flag, take this block's count off it (the last of the head's walk blocks
// leaves it zero for the next call), and order the bulk copies (the async proxy) after the
// intra block's stores.
__device__ __forceinline__ void wait_ready(int* flag) {
    int v;
    while (true) {
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
        if (v != 0) break;
        __nanosleep(64);
    }
    atomicSub(flag, 1);
    asm volatile("fence.proxy.async.global;" ::: "memory");
}

// Block (h, slice, z) of zs blocks a (head, slice): the walk kernel's blockIdx and gridDim.z,
// or kda_chunk_core's walk blocks. Chunks from ready_from on wait on `ready` (wait_ready).
template <int D>
__device__ void walk(const unsigned* __restrict__ qg, const unsigned* __restrict__ kd,
                     const float* __restrict__ gl, const unsigned* __restrict__ w_in,
                     const float* __restrict__ u_in, const unsigned* __restrict__ aqk,
                     float* __restrict__ state, float* __restrict__ core,
                     const int* __restrict__ segs, int nseg, int T, int H, int h, int slice,
                     int z, int zs, int* ready, int ready_from) {
    using L = Walk<D>;
    constexpr int KD = D / 16, KC = CHUNK / 16;  // k-steps over D and over C
    extern __shared__ __align__(128) unsigned char smb[];
    u64* bars = reinterpret_cast<u64*>(smb + L::BAR_OFF);
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t4 = lane & 3;
    const int v0 = slice * WALK_ROWS;
    const int vr = 16 * warp + g;       // this thread's rows: vr, vr + 8
    if (tid == 0) {
        for (int i = 0; i < L::DONE_BAR; ++i) mbar_init(bars + i, 1);
        mbar_init(bars + L::DONE_BAR, WARPGROUP);
        mbar_init_fence();
    }
    __syncthreads();
    if (tid >= WALK_THREADS) return;  // kda_chunk_core's blocks are wider than a walk's
    if (warp == WARPGROUP / 32) {
        // The copies' warp (one lane): kd, Aqk of chunk ci and w, qg, u, gl of chunk ci + 1
        // go out as soon as the warpgroup is done with chunk ci - 1, so the MMAs never wait
        // on a copy's issue, and chunk ci's second operands land while its first products run.
        if (lane == 0) {
            // the block's chunks in walk order: wc counts them, a cursor (segment, its chunk)
            // names each; one cursor for w, qg, u, gl (a chunk ahead), one for kd, Aqk
            struct Cursor {
                int si, ci;
                Segment sg;
            };
            auto next_chunk = [&](Cursor& c) {  // the cursor's chunk, then the cursor moves on
                const int chunk = c.sg.chunk0 + c.ci;
                if (++c.ci == c.sg.chunks) {
                    c.ci = 0, c.si += zs;
                    if (c.si < nseg) c.sg = segment_at(segs, c.si, T);
                }
                return chunk;
            };
            int nchunks = 0;
            for (int si = z; si < nseg; si += zs) nchunks += segment_at(segs, si, T).chunks;
            Cursor ahead{z, 0, segment_at(segs, z, T)}, behind = ahead;
            auto load_next = [&](int wc) {  // w, qg, u, gl of the block's chunk wc: buffer wc % 2
                const int b = wc & 1;
                const bool fresh = ahead.ci == 0 && !ahead.sg.init;  // w, qg unread (below)
                const int chunk = next_chunk(ahead);  // the first copy of any of its operands
                if (chunk >= ready_from) wait_ready(ready + (u64)chunk * H + h);
                const u64 blk = (u64)chunk * H + h;
                mbar_expect(bars + b, (fresh ? 0 : 2 * L::WQ_BYTES) + L::U_BYTES + L::GL_BYTES);
                if (!fresh) {
                    bulk_copy(smb + L::W_OFF + b * L::WQ_BYTES, w_in + blk * CHUNK * D,
                              L::WQ_BYTES, bars + b);
                    bulk_copy(smb + L::Q_OFF + b * L::WQ_BYTES, qg + blk * CHUNK * D,
                              L::WQ_BYTES, bars + b);
                }
                const float* u_slice = u_in + (blk * (D / WALK_ROWS) + slice) * CHUNK * WALK_ROWS;
                bulk_copy(smb + L::U_OFF + b * L::U_BYTES, u_slice, L::U_BYTES, bars + b);
                bulk_copy(smb + L::GL_OFF + b * L::GL_BYTES, gl + blk * D, L::GL_BYTES, bars + b);
            };
            auto load_kd = [&]() {  // kd, Aqk of the block's next chunk
                const u64 blk = (u64)next_chunk(behind) * H + h;
                mbar_expect(bars + L::KD_BAR, L::K_BYTES + L::A_BYTES);
                bulk_copy(smb + L::K_OFF, kd + blk * D * CHUNK, L::K_BYTES, bars + L::KD_BAR);
                bulk_copy(smb + L::A_OFF, aqk + blk * CHUNK * CHUNK, L::A_BYTES, bars + L::KD_BAR);
            };
            load_next(0);
            load_kd();
            if (nchunks > 1) load_next(1);
            for (int wc = 1; wc < nchunks; ++wc) {
                mbar_wait(bars + L::DONE_BAR, (wc - 1) & 1);  // chunk wc - 1's buffers are read
                load_kd();
                if (wc + 1 < nchunks) load_next(wc + 1);
            }
        }
        return;
    }

    // S^T rows vr (+ 8), columns 8 j + 2 t4 (+ 1): tile j of the m64nD accumulator, at this
    // thread's offset in a slot's state
    const u64 slot_floats = (u64)H * D * D, at = ((u64)h * D + v0 + vr) * D + 2 * t4;
    auto store_state = [&](float* st, const float (&x)[D / 2]) {
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
            *reinterpret_cast<float2*>(st + 8 * j) = make_float2(x[4 * j], x[4 * j + 1]);
            *reinterpret_cast<float2*>(st + 8 * D + 8 * j) =
                make_float2(x[4 * j + 2], x[4 * j + 3]);
        }
    };
    const u64 kdesc = operand_desc<D>(smb + L::K_OFF), adesc = operand_desc<CHUNK>(smb + L::A_OFF);
    PHASES_BEGIN;
    int wc = 0;  // the block's chunks walked so far: the buffers' and barriers' phase
    for (int si = z; si < nseg; si += zs) {
        const Segment sg = segment_at(segs, si, T);
        float S[D / 2];
        float* st = state + sg.slot * slot_floats + at;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {  // a sequence without initial state starts from zero
            const float2 a = sg.init ? *reinterpret_cast<const float2*>(st + 8 * j) : float2{};
            const float2 b =
                sg.init ? *reinterpret_cast<const float2*>(st + 8 * D + 8 * j) : float2{};
            S[4 * j] = a.x, S[4 * j + 1] = a.y, S[4 * j + 2] = b.x, S[4 * j + 3] = b.y;
        }
        unsigned Sh[KD][4], Sl[KD][4];
#pragma unroll
        for (int s = 0; s < KD; ++s) frag_of(S + 8 * s, S + 8 * s + 4, Sh[s], Sl[s]);

        for (int ci = 0; ci < sg.chunks; ++ci, ++wc) {
            const int b = wc & 1, c0 = ci * CHUNK;  // c0: the segment's own token
            mbar_wait(bars + b, (wc >> 1) & 1);  // chunk wc's w, qg, u, gl
            PHASE(8);

            float P[CHUNK / 2], O[CHUNK / 2];
#pragma unroll
            for (int i = 0; i < CHUNK / 2; ++i) P[i] = 0.0f, O[i] = 0.0f;
            // A zero-state segment's first chunk has S = 0: W^T and O^T's first term are sums
            // of zero products, +0 exactly, which P and O already hold; neither they nor their
            // operands w and qg (never copied) are needed.
            if (ci > 0 || sg.init) {
                wgmma_pin(P), wgmma_pin(O), wgmma_pin(S);
                wgmma_fence();
                wg3<CHUNK, D, 1>(P, Sh, Sl, w_desc(smb + L::W_OFF + b * L::WQ_BYTES));
                wgmma_commit();
                wg3<CHUNK, D>(O, Sh, Sl, operand_desc<CHUNK>(smb + L::Q_OFF + b * L::WQ_BYTES));
                wgmma_commit();
                wgmma_wait<1>();  // W^T is in; O^T's first term may still run
                wgmma_pin(P);
            }
            PHASE(9);

            // v^T = u^T - W^T, its fragments; the decay on S
            const float* us = reinterpret_cast<const float*>(smb + L::U_OFF + b * L::U_BYTES);
#pragma unroll
            for (int j = 0; j < CHUNK / 8; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    P[4 * j + i] =
                        us[u_word(8 * j + 2 * t4 + (i & 1), vr + 8 * (i >> 1))] - P[4 * j + i];
            unsigned Vh[KC][4], Vl[KC][4];
#pragma unroll
            for (int s = 0; s < KC; ++s) frag_of(P + 8 * s, P + 8 * s + 4, Vh[s], Vl[s]);
            const float* gls = reinterpret_cast<const float*>(smb + L::GL_OFF + b * L::GL_BYTES);
#pragma unroll
            for (int j = 0; j < D / 8; ++j) {
                const float2 x = *reinterpret_cast<const float2*>(gls + 8 * j + 2 * t4);
                S[4 * j] *= x.x, S[4 * j + 1] *= x.y, S[4 * j + 2] *= x.x, S[4 * j + 3] *= x.y;
            }
            PHASE(10);
            mbar_wait(bars + L::KD_BAR, wc & 1);  // kd, Aqk (wc)
            PHASE(11);
            wgmma_pin(S), wgmma_pin(O);
            wgmma_fence();
            wg3<D, CHUNK>(S, Vh, Vl, kdesc);
            wgmma_commit();
            wg3<CHUNK, CHUNK>(O, Vh, Vl, adesc);
            wgmma_commit();
            wgmma_wait<1>();  // S^T is in; O^T's second term may still run
            wgmma_pin(S);
            PHASE(12);
#pragma unroll
            for (int s = 0; s < KD; ++s) frag_of(S + 8 * s, S + 8 * s + 4, Sh[s], Sl[s]);
            wgmma_wait<0>();
            wgmma_pin(O);
            mbar_arrive(bars + L::DONE_BAR);  // this thread is done with chunk wc's shared memory
            // O^T rows vr (+ 8) = core[row0 + t][h][v0 + vr (+ 8)], t < rows: the packed rows
#pragma unroll
            for (int j = 0; j < CHUNK / 8; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int t = c0 + 8 * j + 2 * t4 + (i & 1);
                    if (t < sg.rows)
                        core[((u64)(sg.row0 + t) * H + h) * D + v0 + vr + 8 * (i >> 1)] =
                            O[4 * j + i];
                }
            // a checkpoint: the state of that prefix alone
            if (const int slot = checkpoint_slot(segs, sg, ci); slot >= 0)
                store_state(state + slot * slot_floats + at, S);
            PHASE(13);
        }
        store_state(st, S);
    }
}

#endif  // the Hopper walk

// The intra kernel's T_pad and c_end are not read (the grid carries the chunks: [0, c_end));
// they keep the launch's arguments those of the host twin, which loops over them. Each kernel's
// dynamic shared memory is exported as <kernel>_smem, which the CUDA backend reads when it
// loads the kernel: the layout structs above are its only definition.
#define KDA_CHUNK_INTRA(D)                                                                     \
    extern "C" __global__ void __launch_bounds__(THREADS, 2) kda_chunk_intra_d##D(                \
        const bf16* conv_out, const bf16* g_raw, const bf16* b_raw, int ldb,                   \
        const float* a_log, const float* dt_bias, float lower_bound, int bounded, unsigned* qg,\
        unsigned* kd, float* gl, float* w, float* u, unsigned* aqk, const int* segs, int nseg, \
        int T, int T_pad, int H, float scale, int c_end) {                                     \
        const GateArgs ga{g_raw, b_raw, ldb, a_log, dt_bias, lower_bound, bounded};            \
        chunk_intra<D>(conv_out, ga, qg, kd, gl, w, u, aqk, segs, nseg, T, H, scale,           \
                       blockIdx.x, blockIdx.y, nullptr, 0);                                     \
    }                                                                                          \
    extern "C" {                                                                               \
    __constant__ int kda_chunk_intra_d##D##_smem = Intra<D>::FLOATS * 4;                       \
    }
#define KDA_CHUNK_INTER(D)                                                                     \
    extern "C" __global__ void __launch_bounds__(WALK_THREADS, 1)   kda_chunk_inter_d##D(     \
        const unsigned* qg, const unsigned* kd, const float* gl, const unsigned* w,            \
        const float* u, const unsigned* aqk, float* state, float* core, const int* segs,       \
        int nseg, int T, int H) {                                                              \
        walk<D>(qg, kd, gl, w, u, aqk, state, core, segs, nseg, T, H, blockIdx.x, blockIdx.y,  \
                blockIdx.z, gridDim.z, nullptr, 0x7fffffff);                                  \
    }                                                                                          \
    extern "C" {                                                                               \
    __constant__ int kda_chunk_inter_d##D##_smem = Walk<D>::BYTES;                             \
    }
// The core's second half where the walk leaves SMs idle (kimi-linear-48b's 64 walk blocks on
// an H200's 132 SMs): the walk's H D / WALK_ROWS blocks first, a block an SM from the first
// wave (the GPU starts a launch's blocks in index order), then intra blocks for chunks c_first..
// (every head of a chunk before the next chunk), on the SMs the walk leaves; the walk waits on
// their `ready` flags (zero on entry, left zero), only for chunks from c_first, which a
// kda_chunk_intra launch before this one did not cover. One segment (or a plain prefill): the
// walk blocks take chunks in order. Every value is the two kernels' own.
#define KDA_CHUNK_CORE(D)                                                                      \
    extern "C" __global__ void __launch_bounds__(THREADS, 1) kda_chunk_core_d##D(              \
        const bf16* conv_out, const bf16* g_raw, const bf16* b_raw, int ldb,                   \
        const float* a_log, const float* dt_bias, float lower_bound, int bounded, unsigned* qg,\
        unsigned* kd, float* gl, float* w, float* u, unsigned* aqk, float* state, float* core, \
        int* ready, int c_first, const int* segs, int nseg, int T, int T_pad, int H,           \
        float scale) {                                                                         \
        const int walkers = H * (D / WALK_ROWS), b = blockIdx.x;                               \
        if (b < walkers) {                                                                     \
            walk<D>(qg, kd, gl, reinterpret_cast<const unsigned*>(w), u, aqk, state, core,     \
                    segs, nseg, T, H, b % H, b / H, 0, 1, ready, c_first);                     \
        } else {                                                                               \
            const GateArgs ga{g_raw, b_raw, ldb, a_log, dt_bias, lower_bound, bounded};        \
            chunk_intra<D>(conv_out, ga, qg, kd, gl, w, u, aqk, segs, nseg, T, H, scale,       \
                           c_first + (b - walkers) / H, (b - walkers) % H, ready,              \
                           D / WALK_ROWS);                                                     \
        }                                                                                      \
    }                                                                                          \
    extern "C" {                                                                               \
    __constant__ int kda_chunk_core_d##D##_smem =                                              \
        Walk<D>::BYTES > Intra<D>::FLOATS * 4 ? Walk<D>::BYTES : Intra<D>::FLOATS * 4;         \
    }
KDA_CHUNK_INTRA(64)
KDA_CHUNK_INTRA(128)
#if !defined(__CUDA_ARCH__) || KDA_WGMMA
KDA_CHUNK_INTER(64)
KDA_CHUNK_INTER(128)
KDA_CHUNK_CORE(64)
KDA_CHUNK_CORE(128)
#endif
