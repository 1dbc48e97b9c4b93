// The chunked (WY) KDA core for prefill, C = 64 tokens a chunk, in two launches:
//   kda_chunk_intra: every (chunk, head) in parallel builds the in-chunk cumulative decay G,
//     A[t][s] = sum_d k_t k_s exp(G_t - G_s) (s < t) and Aqk (s <= t, q scaled), solves
//     (I + diag(b) A) [u | w] = diag(b) [v | k exp(G)] by forward substitution, and precomputes
//     everything elementwise the sequential walk needs: qg = q exp(G), kd = k exp(G_last - G),
//     gl = exp(G_last). The walk then does no transcendental math at all.
//   kda_chunk_inter_d{D}_v{VS}: per (head, VS-column slice of V) walks the chunks in order with
//     its state slice in registers: W = u - w S; O = qg S + Aqk W; S = gl S + kd^T W. The
//     products run on tensor cores in 3xBF16 from operands the intra kernel already wrote as
//     split bf16 words (so the walk's inner loops convert nothing); the next operands stream
//     into shared memory with cp.async while the current product runs, since the walk is one
//     block per SM and nothing else hides its loads.
// Rows >= T are selected to zero on load (never multiplied), so NaN or 1e30 primed into the
// padded tail can reach neither the outputs nor the state. Decays are exponentiated as
// differences G_t - G_s with s <= t (<= 0), or, in the intra kernel's factorised diagonal
// blocks, as differences bounded by a checked span: nothing overflows.
#include "common.cuh"

#define CH 64
#define THREADS 256        // kda_chunk_intra's threads (kernels.py launches them so)
#define WALK_THREADS 256   // kda_chunk_inter's (16 warps measured slower at H = 32)
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
__device__ __forceinline__ unsigned pack_bf16x2(float x0, float x1) {  // x0 in the low half
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(x1), "f"(x0));
    return r;
}

__device__ __forceinline__ uint2 split_pair(float x0, float x1) {
    const unsigned hi = pack_bf16x2(x0, x1);
    return make_uint2(hi, pack_bf16x2(x0 - __uint_as_float(hi << 16),
                                      x1 - __uint_as_float(hi & 0xffff0000u)));
}

// A and B fragments of one 16x8x16 step, as hi and lo words. Buffers hold rows of word pairs
// (hi, lo): `frag_a` reads A[m][k] from rows m with k-pairs along the row, `frag_at` reads
// A[m][k] from rows of k-pairs with m along the row (a transposed operand), `frag_b` reads
// B[k][n] from rows of k-pairs with n along the row, `frag_bt` from rows n with k-pairs along it.
struct Frag {
    unsigned hi[4], lo[4];
};

__device__ __forceinline__ Frag frag_a(const unsigned* buf, int ld, int m0, int kp0, int g, int t) {
    const unsigned* p = buf + (m0 + g) * ld + 2 * (kp0 + t);
    const uint2 x0 = *reinterpret_cast<const uint2*>(p), x1 = *reinterpret_cast<const uint2*>(p + 8 * ld);
    const uint2 x2 = *reinterpret_cast<const uint2*>(p + 8), x3 = *reinterpret_cast<const uint2*>(p + 8 * ld + 8);
    return {{x0.x, x1.x, x2.x, x3.x}, {x0.y, x1.y, x2.y, x3.y}};
}

__device__ __forceinline__ Frag frag_at(const unsigned* buf, int ld, int m0, int kp0, int g, int t) {
    const unsigned* p = buf + (kp0 + t) * ld + 2 * (m0 + g);
    const uint2 x0 = *reinterpret_cast<const uint2*>(p), x1 = *reinterpret_cast<const uint2*>(p + 16);
    const uint2 x2 = *reinterpret_cast<const uint2*>(p + 4 * ld), x3 = *reinterpret_cast<const uint2*>(p + 4 * ld + 16);
    return {{x0.x, x1.x, x2.x, x3.x}, {x0.y, x1.y, x2.y, x3.y}};
}

__device__ __forceinline__ Frag frag_bt(const unsigned* buf, int ld, int kp0, int n0, int g, int t) {
    const unsigned* p = buf + (n0 + g) * ld + 2 * (kp0 + t);  // rows n, k-pairs along the row
    const uint2 x0 = *reinterpret_cast<const uint2*>(p), x1 = *reinterpret_cast<const uint2*>(p + 8);
    return {{x0.x, x1.x, 0u, 0u}, {x0.y, x1.y, 0u, 0u}};
}

// The B operands the walk produces itself (S and W) live in shared memory in fragment order:
// per 16 x 8 tile (16 k rows as 8 k-pairs, 8 columns n), lane l's four words (b0 hi, b1 hi,
// b0 lo, b1 lo) at tile * 128 + 4 l. One 16-byte load then hands a lane its fragment in the
// register pairs the MMA takes; rows of (hi, lo) pairs cost register moves, which Nsight
// Compute counted as 40% of the walk's instructions.
__device__ __forceinline__ Frag frag_b(const unsigned* buf, int ntiles, int kp0, int n0, int lane) {
    const uint4 v = *reinterpret_cast<const uint4*>(buf + ((kp0 / 8) * ntiles + n0 / 8) * 128 + 4 * lane);
    return {{v.x, v.y, 0u, 0u}, {v.z, v.w, 0u, 0u}};
}

// big + small += a b: the hi x hi products and the two correction terms accumulate apart
// (shorter chains of dependent MMAs); the caller adds small into big at the end.
__device__ __forceinline__ void mma3(float big[4], float small[4], const Frag& a, const Frag& b) {
    mma_bf16(small, a.lo, b.hi);
    mma_bf16(big, a.hi, b.hi);
    mma_bf16(small, a.hi, b.lo);
}

// Store a C fragment (rows r0+g and r0+g+8 with r0 % 16 == 0, columns n0+2t and n0+2t+1) as a
// later product's B operand, in frag_b's order: lanes g and g^1 swap one value so that each
// holds a k-pair of one column, then writes the words of the lane that will read them.
__device__ __forceinline__ void put_bfrag(unsigned* buf, int ntiles, int r0, int n0,
                                          const float c[4], int g, int t) {
    const bool odd = g & 1;
    uint2 w[2];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const float v0 = c[2 * half], v1 = c[2 * half + 1];
        const float x = __shfl_xor_sync(0xffffffffu, odd ? v0 : v1, 4);
        w[half] = odd ? split_pair(x, v1) : split_pair(v0, x);
    }
    const int reader = (2 * t + odd) * 4 + (g - odd) / 2;
    *reinterpret_cast<uint4*>(buf + ((r0 / 16) * ntiles + n0 / 8) * 128 + 4 * reader) =
        make_uint4(w[0].x, w[1].x, w[0].y, w[1].y);
}

// acc[j] + err[j] += A B over k-pairs [0, kp_end) for a warp's NT column tiles n0 + 8j of B
// (in frag_b's order, ntiles column tiles wide); a_at(kp) loads the A fragment of k-pairs kp..
template <int NT, typename LoadA>
__device__ __forceinline__ void tiles_product(float (&acc)[NT][4], float (&err)[NT][4], int kp_end,
                                              LoadA a_at, const unsigned* B, int ntiles, int n0,
                                              int lane) {
#pragma unroll
    for (int kp = 0; kp < kp_end; kp += 8) {
        const Frag a = a_at(kp);
#pragma unroll
        for (int j = 0; j < NT; ++j) mma3(acc[j], err[j], a, frag_b(B, ntiles, kp, n0 + 8 * j, lane));
    }
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
    static constexpr int PE = DH + 8;    // scaled rows, split words: fragment reads hit bank 8g + 2t
    static constexpr int SB = 16;        // the factorisation's block of rows
    static constexpr int EROWS = CH + 2 * SB;  // scaled rows: k_s (s <= r + 15), then k_t, q_t
    static constexpr int G_OFF = 0, K_OFF = CH * P, Q_OFF = 2 * CH * P, E_OFF = 3 * CH * P;
    static constexpr int A_OFF = E_OFF + EROWS * PE, M_OFF = A_OFF + CH * AP;
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
    const u64 row0 = ((u64)c0 * H + h) * D, rstride = (u64)H * D;  // [T_pad, H, D] addressing

    for (int i = tid; i < 2 * CH * AP; i += THREADS) A[i] = 0.0f;  // A and Aqk (Ms) accumulate
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
        }
        // what the walk and the solve need elementwise: gl, qg and kd (as split words: qg in
        // pairs along d, kd in pairs along t, as the walk reads them), and k exp(G), the
        // solve's right-hand side, parked in w_out until the solve overwrites it. These loops
        // (and the scaled rows' below) give each warp whole rows and each lane the same two
        // dimensions c2, c2+1 of every row (DH / 2 == 32 pairs): no index is divided or taken
        // modulo inside them.
        static_assert(DH == 64 && THREADS % DH == 0, "a lane's two dimensions of a 64-wide row");
        const int c2 = 2 * lane;
        if (tid < DH) gl_out[((u64)ci * H + h) * D + d0 + tid] = expf(Gs[(CH - 1) * P + tid]);
        for (int r = warp; r < CH; r += THREADS / 32) {
            const float2 G = *reinterpret_cast<const float2*>(Gs + r * P + c2);
            const float2 qq = *reinterpret_cast<const float2*>(Qs + r * P + c2);
            const float2 kk = *reinterpret_cast<const float2*>(Ks + r * P + c2);
            const u64 o = row0 + r * rstride + d0 + c2;
            const float e0 = __expf(G.x), e1 = __expf(G.y);
            *reinterpret_cast<uint2*>(qg_out + o) = split_pair(qq.x * e0, qq.y * e1);
            *reinterpret_cast<float2*>(w_out + o) = make_float2(kk.x * e0, kk.y * e1);
        }
        // kd rows 2p and 2p+1 hold, for every d, the pair (kd[2p][d], kd[2p+1][d]): the
        // first D/2 dimensions' words in row 2p, the rest in row 2p+1; a thread keeps one
        // dimension d and takes row pairs in turn
        const int d = tid % DH, dd = d0 + d;
        const float GL = Gs[(CH - 1) * P + d];
        unsigned* kd_col = kd_out + row0 + (dd / (D / 2)) * rstride + 2 * (dd % (D / 2));
        for (int r = 2 * (tid / DH); r < CH; r += 2 * (THREADS / DH)) {
            const float k0 = Ks[r * P + d] * __expf(GL - Gs[r * P + d]);
            const float k1 = Ks[(r + 1) * P + d] * __expf(GL - Gs[(r + 1) * P + d]);
            *reinterpret_cast<uint2*>(kd_col + r * rstride) = split_pair(k0, k1);
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
            const int ncols = by_pairs ? r : r + SB;  // columns the products cover
            unsigned* Ew = reinterpret_cast<unsigned*>(Es);  // split words, pairs along d
            const float2 Gr = *reinterpret_cast<const float2*>(Gs + r * P + c2);
            for (int row = warp; row < ncols + 2 * SB; row += THREADS / 32) {
                const bool col = row < ncols;  // k_s exp(G_r - G_s), else k_t or q_t exp(G_t - G_r)
                const int src = col ? row : r + (row - ncols) % SB;  // uniform in the warp
                const float2 x = *reinterpret_cast<const float2*>(
                    (col || row - ncols < SB ? Ks : Qs) + src * P + c2);
                const float2 G = *reinterpret_cast<const float2*>(Gs + src * P + c2);
                const float sgn = col ? -1.0f : 1.0f;
                *reinterpret_cast<uint2*>(Ew + (col ? row : CH + row - ncols) * PE + c2) =
                    split_pair(x.x * __expf(sgn * (G.x - Gr.x)), x.y * __expf(sgn * (G.y - Gr.y)));
            }
            __syncthreads();
            // [2 SB, ncols] += [2 SB, DH] x [DH, ncols]: m-tile 0 adds to A, m-tile 1 to Aqk;
            // on the diagonal block only s < t (A) and s <= t (Aqk) are kept
            for (int tile = warp; tile < 2 * (ncols / 8); tile += THREADS / 32) {
                const int mt = tile % 2, n0 = 8 * (tile / 2);
                float c[4] = {0.0f, 0.0f, 0.0f, 0.0f}, e[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int kp = 0; kp < DH / 2; kp += 8)
                    mma3(c, e, frag_a(Ew, PE, CH + SB * mt, kp, g, t4), frag_bt(Ew, PE, kp, n0, g, t4));
                float* dst = mt ? Ms : A;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int t = r + g + 8 * (i >> 1), sc = n0 + 2 * t4 + (i & 1);
                    if (sc < t || (mt && sc == t)) dst[t * AP + sc] += c[i] + e[i];
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
    }
    {  // Aqk as split words in pairs along s
        unsigned* Mg = aqk + ((u64)ci * H + h) * CH * CH;
        for (int i = tid; i < CH * CH / 2; i += THREADS) {
            const int t = i / (CH / 2), s2 = (i % (CH / 2)) * 2;
            reinterpret_cast<uint2*>(Mg)[i] = split_pair(Ms[t * AP + s2], Ms[t * AP + s2 + 1]);
        }
    }

    // (I + diag(b) A) [u | w] = diag(b) [v | k exp(G)]: one column a thread, forward
    // substitution over the rows; four partial sums keep the dot products' chains short. The
    // right-hand sides are staged in shared memory first (G, k, q and the scaled rows are
    // done with): read from global memory inside the row loop, each load would wait for the
    // previous row's store, which the compiler cannot prove distinct. u is written as fp32,
    // w as split words in pairs along d (lanes 2i and 2i+1 meet in a shuffle).
    static_assert(2 * D <= THREADS, "one solve column a thread");
    static_assert(CH * (2 * D + 4) <= L::A_OFF, "right-hand sides fit below A");
    constexpr int LR = 2 * D + 4;
    float* Rs = sm;  // [CH][2D + 4]: v | k exp(G)
    __syncthreads();  // k exp(G) in w_out is visible; G, k, q, Es are free
    for (int i = tid; i < CH * 2 * D / 4; i += THREADS) {
        const int r = i / (2 * D / 4), c4 = (i % (2 * D / 4)) * 4;
        const u64 o = row0 + r * rstride + (c4 % D);
        const float4 x = c4 < D ? pick4(c0 + r < T, __ldg(reinterpret_cast<const float4*>(v + o)))
                                : *reinterpret_cast<const float4*>(w_out + o);
        *reinterpret_cast<float4*>(Rs + r * LR + c4) = x;
    }
    __syncthreads();
    const int col = tid;
    if (col < 2 * D) {
        const int dc = col < D ? col : col - D;
        float* dst = (col < D ? u_out : w_out) + row0 + dc;
        float x[CH];
#pragma unroll
        for (int r = 0; r < CH; ++r) {
            float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int s = 0; s < (r & ~3); s += 4) {
                const float4 a4 = *reinterpret_cast<const float4*>(A + r * AP + s);
                acc[0] = __fmaf_rn(a4.x, x[s], acc[0]);
                acc[1] = __fmaf_rn(a4.y, x[s + 1], acc[1]);
                acc[2] = __fmaf_rn(a4.z, x[s + 2], acc[2]);
                acc[3] = __fmaf_rn(a4.w, x[s + 3], acc[3]);
            }
#pragma unroll
            for (int s = r & ~3; s < r; ++s) acc[s & 3] = __fmaf_rn(A[r * AP + s], x[s], acc[s & 3]);
            x[r] = Bs[r] * (Rs[r * LR + col] - ((acc[0] + acc[1]) + (acc[2] + acc[3])));
            if (col < D) {
                dst[r * rstride] = x[r];
            } else {
                const float y = __shfl_xor_sync(0xffffffffu, x[r], 1);
                const uint2 w2 = dc & 1 ? split_pair(y, x[r]) : split_pair(x[r], y);
                reinterpret_cast<unsigned*>(dst)[r * rstride] = dc & 1 ? w2.y : w2.x;
            }
        }
    }
}

// Queue rows [c0, c0+CH), words [col0, col0+N) of one head of a [T_pad, H, D] buffer of
// 4-byte words into shared rows of stride ld (16-byte pieces; the copy runs behind the
// arithmetic). PAIRED puts token rows 2p and 2p+1 side by side in shared row p (kd's layout).
template <int N, bool PAIRED = false>
__device__ __forceinline__ void stage_async(void* dst, int ld, const void* src, int c0, int h,
                                            int H, int D, int col0) {
    constexpr int PER_ROW = N / 4, ITER = (CH * PER_ROW + WALK_THREADS - 1) / WALK_THREADS;
#pragma unroll
    for (int it = 0; it < ITER; ++it) {
        const int i = threadIdx.x + it * WALK_THREADS;
        if (CH * PER_ROW % WALK_THREADS == 0 || i < CH * PER_ROW) {
            const int r = i / PER_ROW, q4 = (i % PER_ROW) * 4;
            const int at = PAIRED ? (r >> 1) * ld + (r & 1) * N : r * ld;
            cp_async16(static_cast<unsigned*>(dst) + at + q4,
                       static_cast<const unsigned*>(src) + ((u64)(c0 + r) * H + h) * D + col0 + q4);
        }
    }
}

// Shared memory of the walk, in 4-byte words. The staged split-word operands are read as
// 8-byte (hi, lo) pairs; a row stride = 8 mod 32 words puts a half-warp's fragment reads in
// distinct banks, whichever way the operand is read. S and W are in frag_b's order.
template <int D, int VS>
struct Walk {
    static constexpr int LDA = D + 8;       // w, qg: [C][D] rows of d-pairs
    static constexpr int LDK = 2 * D + 8;   // kd: [C/2][2D] rows of t-pairs
    static constexpr int LDQ = CH + 8;      // Aqk: [C][C] rows of s-pairs
    static constexpr int LDU = VS + 8;      // u: [C][VS] fp32
    static constexpr int NTB = VS / 8;      // column tiles of S [D, VS] and W [C, VS]
    static constexpr int W_OFF = 0, Q_OFF = W_OFF + CH * LDA, K_OFF = Q_OFF + CH * LDA;
    static constexpr int A_OFF = K_OFF + CH / 2 * LDK, U_OFF = A_OFF + CH * LDQ;
    static constexpr int S_OFF = U_OFF + CH * LDU, WM_OFF = S_OFF + D * VS;
    static constexpr int GL_OFF = WM_OFF + CH * VS, WORDS = GL_OFF + D;
    static constexpr int WARPS = WALK_THREADS / 32;
    // W and O are [C, VS]: warps tile 4 row blocks x WARPS / 4 column groups.
    static constexpr int CG1 = WARPS / 4, NT1 = VS / 8 / CG1;
    // S is [D, VS]: D / 16 row blocks x WARPS / (D / 16) column groups.
    static constexpr int RB3 = D / 16, CG3 = WARPS / RB3, NT3 = VS / 8 / CG3;
    static_assert(NT1 >= 1 && NT3 >= 1, "every warp owns at least one 16x8 tile");
};

template <int D, int VS>
__device__ void chunk_inter(const unsigned* __restrict__ qg, const unsigned* __restrict__ kd,
                            const float* __restrict__ gl, const unsigned* __restrict__ w_in,
                            const float* __restrict__ u_in, const unsigned* __restrict__ aqk,
                            float* __restrict__ state, float* __restrict__ core, int T, int T_pad,
                            int H) {
    using L = Walk<D, VS>;
    extern __shared__ __align__(16) unsigned smw[];
    unsigned *Wb = smw + L::W_OFF, *Qb = smw + L::Q_OFF, *Kb = smw + L::K_OFF, *Ab = smw + L::A_OFF;
    unsigned *Ss = smw + L::S_OFF, *Wm = smw + L::WM_OFF;
    float *Ub = reinterpret_cast<float*>(smw + L::U_OFF), *gls = reinterpret_cast<float*>(smw + L::GL_OFF);
    const int h = blockIdx.x, v0 = blockIdx.y * VS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    // W / O tile of this warp: rows m1.., columns n1..
    const int m1 = 16 * (warp % 4), n1 = (VS / L::CG1) * (warp / 4);
    // S tile of this warp: rows m3.. (state's k index), columns n3.. (v index)
    const int m3 = 16 * (warp % L::RB3), n3 = (VS / L::CG3) * (warp / L::RB3);
    const int nchunks = T_pad / CH;

    // Loads run a product ahead: w, u, gl of chunk c+1 while O and S of chunk c are formed,
    // qg and Aqk of chunk c+1 during S of chunk c, kd of chunk c during W and O. The groups
    // commit in the order WU(c), QA(c), K(c), WU(c+1), QA(c+1), ...
    auto issue_wu = [&](int ci) {
        stage_async<D>(Wb, L::LDA, w_in, ci * CH, h, H, D, 0);
        stage_async<VS>(Ub, L::LDU, u_in, ci * CH, h, H, D, v0);
        if (threadIdx.x < D / 4)
            cp_async16(gls + 4 * threadIdx.x, gl + ((u64)ci * H + h) * D + 4 * threadIdx.x);
    };
    auto issue_qa = [&](int ci) {
        stage_async<D>(Qb, L::LDA, qg, ci * CH, h, H, D, 0);
        const unsigned* Mg = aqk + ((u64)ci * H + h) * CH * CH;
#pragma unroll
        for (int it = 0; it < CH * CH / 4 / WALK_THREADS; ++it) {
            const int i = threadIdx.x + it * WALK_THREADS;
            cp_async16(Ab + (i / (CH / 4)) * L::LDQ + (i % (CH / 4)) * 4, Mg + 4 * i);
        }
    };
    issue_wu(0);
    cp_commit();
    issue_qa(0);
    cp_commit();

    float S[L::NT3][4];  // the carried state slice, S[k][v] = state[h][v0 + v][k]
#pragma unroll
    for (int j = 0; j < L::NT3; ++j) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = m3 + g + 8 * (i >> 1), c = n3 + 8 * j + 2 * t4 + (i & 1);
            S[j][i] = state[((u64)h * D + v0 + c) * D + r];
        }
        put_bfrag(Ss, L::NTB, m3, n3 + 8 * j, S[j], g, t4);
    }

    for (int ci = 0; ci < nchunks; ++ci) {
        const int c0 = ci * CH;
        const bool more = ci + 1 < nchunks;
        cp_wait<1>();
        __syncthreads();  // WU(c) landed; S written; the last chunk's reads of kd and W done
        stage_async<D, true>(Kb, L::LDK, kd, c0, h, H, D, 0);
        cp_commit();
        const float gl0 = gls[m3 + g], gl1 = gls[m3 + g + 8];

        // W = u - w S
        float acc[L::NT1][4] = {}, err[L::NT1][4] = {};
        tiles_product(acc, err, D / 2, [&](int kp) { return frag_a(Wb, L::LDA, m1, kp, g, t4); },
                      Ss, L::NTB, n1, lane);
#pragma unroll
        for (int j = 0; j < L::NT1; ++j) {
            float wv[4];
#pragma unroll
            for (int i = 0; i < 4; ++i)
                wv[i] = Ub[(m1 + g + 8 * (i >> 1)) * L::LDU + n1 + 8 * j + 2 * t4 + (i & 1)] -
                        (acc[j][i] + err[j][i]);
            put_bfrag(Wm, L::NTB, m1, n1 + 8 * j, wv, g, t4);
        }
        __syncthreads();  // W complete; w, u, gl free
        if (more) issue_wu(ci + 1);
        cp_commit();

        // O = qg S + Aqk W; Aqk is zero above the diagonal, so k stops at this row block's end
        cp_wait<2>();
        __syncthreads();  // QA(c) landed
#pragma unroll
        for (int j = 0; j < L::NT1; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[j][i] = err[j][i] = 0.0f;
        tiles_product(acc, err, D / 2, [&](int kp) { return frag_a(Qb, L::LDA, m1, kp, g, t4); },
                      Ss, L::NTB, n1, lane);
        tiles_product(acc, err, (m1 + 16) / 2,
                      [&](int kp) { return frag_a(Ab, L::LDQ, m1, kp, g, t4); }, Wm, L::NTB, n1,
                      lane);
#pragma unroll
        for (int j = 0; j < L::NT1; ++j)
#pragma unroll
            for (int i = 0; i < 4; i += 2) {
                const int t = c0 + m1 + g + 4 * i;
                if (t < T)
                    *reinterpret_cast<float2*>(core + ((u64)t * H + h) * D + v0 + n1 + 8 * j + 2 * t4) =
                        make_float2(acc[j][i] + err[j][i], acc[j][i + 1] + err[j][i + 1]);
            }

        // S = gl S + kd^T W
        cp_wait<1>();
        __syncthreads();  // K(c) landed; every read of qg, Aqk and the old S is done
        if (more) issue_qa(ci + 1);
        cp_commit();
        float se[L::NT3][4] = {};
#pragma unroll
        for (int j = 0; j < L::NT3; ++j)
            S[j][0] *= gl0, S[j][1] *= gl0, S[j][2] *= gl1, S[j][3] *= gl1;
        tiles_product(S, se, CH / 2, [&](int kp) { return frag_at(Kb, L::LDK, m3, kp, g, t4); },
                      Wm, L::NTB, n3, lane);
#pragma unroll
        for (int j = 0; j < L::NT3; ++j) {
#pragma unroll
            for (int i = 0; i < 4; ++i) S[j][i] += se[j][i];
            put_bfrag(Ss, L::NTB, m3, n3 + 8 * j, S[j], g, t4);
        }
    }
    cp_wait<0>();
#pragma unroll
    for (int j = 0; j < L::NT3; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = m3 + g + 8 * (i >> 1), c = n3 + 8 * j + 2 * t4 + (i & 1);
            state[((u64)h * D + v0 + c) * D + r] = S[j][i];
        }
}

#define KDA_CHUNK_INTRA(D)                                                                     \
    extern "C" __global__ void __launch_bounds__(THREADS, 2) kda_chunk_intra_d##D(                \
        const float* q, const float* k, const float* v, const float* gate, const float* beta,  \
        unsigned* qg, unsigned* kd, float* gl, float* w, float* u, unsigned* aqk, int T,       \
        int T_pad, int H, float scale) {                                                       \
        chunk_intra<D>(q, k, v, gate, beta, qg, kd, gl, w, u, aqk, T, H, scale);               \
    }
#define KDA_CHUNK_INTER(D, VS)                                                                 \
    extern "C" __global__ void __launch_bounds__(WALK_THREADS, 1) kda_chunk_inter_d##D##_v##VS(     \
        const unsigned* qg, const unsigned* kd, const float* gl, const unsigned* w,            \
        const float* u, const unsigned* aqk, float* state, float* core, int T, int T_pad,      \
        int H) {                                                                               \
        chunk_inter<D, VS>(qg, kd, gl, w, u, aqk, state, core, T, T_pad, H);                   \
    }
KDA_CHUNK_INTRA(64)
KDA_CHUNK_INTRA(128)
KDA_CHUNK_INTER(64, 32)
KDA_CHUNK_INTER(64, 64)
KDA_CHUNK_INTER(128, 32)
KDA_CHUNK_INTER(128, 64)
