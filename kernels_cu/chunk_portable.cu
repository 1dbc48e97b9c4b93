// The portable walk: the chunked core's sequential pass (kda_chunk_inter's job) on m16n8k16
// mma.sync and cp.async, for every GPU from sm_80 on (Blackwell has no warpgroup MMAs; Ampere
// and Ada have no bulk copies). It reads the operand images kda_chunk_intra writes for the
// Hopper walk (chunk.cuh) and, as that walk does, walks a block's share of the segments
// (segments.cuh: each from its pool slot's state or zero, its core rows at its packed rows,
// checkpoints every `every` chunks, its final state to its slot) for one (head, run of PR rows of
// the state):
//   W^T = S^T w^T;  O^T = S^T qg^T;  v^T = u^T - W^T;  O^T += v^T Aqk^T;
//   S^T = S^T diag(gl) + v^T kd,
// every product 3xBF16 from split words (mma3), so it computes what the Hopper walk computes
// to fp32 rounding, in another summation order.
//
// KS warps (PORTABLE_WALK_SPLIT) carry 16 rows of S^T (the MMA's m), each D / KS of its columns
// as fp32 accumulator fragments: the walk is a chain of dependent products, latency-bound with
// one warp a scheduler, and KS warps a row group take 1 / KS of its products each. W^T and
// O^T sum over D, so each warp forms its partial products over its columns for the whole chunk
// and the pair swaps them through shared memory (each gets the other's W^T and its own half of
// O^T's columns); both then hold the same v^T, and each finishes O^T for C / KS tokens and
// updates its own columns of S. An accumulator's fragments are the next product's A operand
// (frag_of); the B operands come from shared memory by ldmatrix (.trans for w, whose image is
// MN-major).
// A chunk's operands arrive as four pieces, in the order the products take them: w; qg; u's
// slice with Aqk; kd with gl. Each piece is one slot of a ring of PWalk::STAGES slots filled
// by cp.async, STAGES - 1 pieces ahead of the products, so the ring's size (and the pair's
// swap), not the chunk's 129 KB of operands (D = 128), sets the shared memory: it fits every
// GPU's per-block limit.
#include "chunk.cuh"
#include "segments.cuh"

// PR state rows a block: WALK_ROWS, or half of them where the heads' blocks of half fit the SMs
// in one wave (the walk is bound by each SM's issue, so its warps go to more SMs); a block of
// PR rows reads the intra kernel's u slice of WALK_ROWS rows that holds them.
template <int D, int PR>
struct PWalk {
    static constexpr int KS = PORTABLE_WALK_SPLIT;  // warps a row group of 16, D / KS columns each
    static_assert(KS == 1 || KS == 2, "one warp a row group, or a pair splitting D");
    static_assert(PORTABLE_WALK_THREADS == 32 * KS * (WALK_ROWS / 16), "KS warps per 16 rows");
    static_assert(PR == WALK_ROWS || 2 * PR == WALK_ROWS, "a u slice or half of one");
    static constexpr int BLOCK = PORTABLE_WALK_THREADS / (WALK_ROWS / PR);
    static constexpr int IMG = CHUNK * D * 4;  // w, qg, kd: hi then lo plane, bytes
    static constexpr int U_BYTES = CHUNK * WALK_ROWS * 4, A_BYTES = CHUNK * CHUNK * 4;
    static constexpr int GL_BYTES = D * 4;
    static constexpr int SLOT = IMG + GL_BYTES > U_BYTES + A_BYTES ? IMG + GL_BYTES
                                                                   : U_BYTES + A_BYTES;
    // the pair's swap, [warp][word / 4][lane] float4 (a 16-byte store a lane, conflict-free): a
    // thread's partial W^T (C / 2 words), then its partner's C / 4 of partial O^T
    static constexpr int XW = KS == 1 ? 0 : CHUNK / 2 + CHUNK / 4;
    static constexpr int XCH = XW * BLOCK * 4;
    // as many slots as the block's shared memory holds beside the swap, up to
    // PORTABLE_WALK_STAGES
    static constexpr int FIT = (SMEM_PER_BLOCK - XCH) / SLOT;
    static constexpr int STAGES = FIT < PORTABLE_WALK_STAGES ? FIT : PORTABLE_WALK_STAGES;
    static_assert(STAGES >= 3, "two pieces in flight behind the one the products read");
    static constexpr int BYTES = STAGES * SLOT + XCH;
};

// Eight b16 rows of four 8 x 8 tiles, transposed: lane 8 j + i names row i of tile j, and r[j]
// gets this lane's word of tile j's transpose (rows 2 (lane % 4), + 1 of column lane / 4): an
// MMA's B fragment from a tile whose 16-byte rows run along n.
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned r[4], const void* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// B's fragment (hi, lo) of k-step s and n-tile n0.. from a staged K-major image of N rows by K
// (img_word): tiles hi k-octet 2 s, hi 2 s + 1, lo 2 s, lo 2 s + 1, 128 contiguous bytes each,
// so every ldmatrix phase is conflict-free.
template <int N, int K>
__device__ __forceinline__ Frag frag_img(const unsigned* img, int s, int n0, int lane) {
    const int j = lane >> 3;
    unsigned x[4];
    ldmatrix_x4(x, img + (j >> 1) * (N * K / 2) + 4 * N * (2 * s + (j & 1)) +
                       4 * (n0 + (lane & 7)));
    return {{x[0], x[1], 0u, 0u}, {x[2], x[3], 0u, 0u}};
}

// The same from w's MN-major image (w_word): a tile is 8 dimensions (k) x 8 tokens (n), its
// 16-byte rows along n, so ldmatrix transposes it into the fragment.
template <int D>
__device__ __forceinline__ Frag frag_w(const unsigned* img, int s, int n0, int lane) {
    const int j = lane >> 3;
    unsigned x[4];
    ldmatrix_x4_trans(x, img + (j >> 1) * (CHUNK * D / 2) + 4 * CHUNK * (2 * s + (j & 1)) +
                             32 * (n0 >> 3) + 4 * (lane & 7));
    return {{x[0], x[1], 0u, 0u}, {x[2], x[3], 0u, 0u}};
}

// BYTES (a multiple of 16, known at compile time) from global memory into a slot, 16 a thread of
// NT at fixed offsets: straight-line copies, no loop bound or address arithmetic a copy.
template <int BYTES, int NT>
__device__ __forceinline__ void stage(unsigned char* dst, const void* src) {
    constexpr int ROUND = 16 * NT, FULL = BYTES / ROUND, REST = BYTES % ROUND;
    static_assert(BYTES % 16 == 0, "whole 16-byte copies");
    const unsigned char* s = static_cast<const unsigned char*>(src) + 16 * threadIdx.x;
    dst += 16 * threadIdx.x;
#pragma unroll
    for (int i = 0; i < FULL; ++i) cp_async16(dst + i * ROUND, s + i * ROUND);
    if (REST && 16 * (int)threadIdx.x < REST) cp_async16(dst + FULL * ROUND, s + FULL * ROUND);
}

// A chunk's piece by its place (0: w; 1: qg; 2: u's slice and Aqk; 3: kd and gl), as a type: the
// walk takes its pieces in that order, so each call site knows which piece it issues.
template <int K>
struct Piece {
    static constexpr int value = K;
};

template <int D, int PR>
__device__ void walk_portable(const unsigned* __restrict__ qg, const unsigned* __restrict__ kd,
                              const float* __restrict__ gl, const unsigned* __restrict__ w_in,
                              const float* __restrict__ u_in, const unsigned* __restrict__ aqk,
                              float* __restrict__ state, float* __restrict__ core,
                              const int* __restrict__ segs, int nseg, int T, int H) {
    using L = PWalk<D, PR>;
    constexpr int KS = L::KS, RW = PR / 16;  // warps a row group; row groups
    constexpr int KD = D / 16, KC = CHUNK / 16;     // k-steps over D and over C
    constexpr int NC = CHUNK / 8, ND = D / 8;       // n-tiles over C and over D
    constexpr int KDW = KD / KS, NDW = ND / KS, NCW = NC / KS;  // a warp's share of each
    extern __shared__ __align__(16) unsigned char smb[];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
    // What this block walks: head h, state rows v0 .. v0 + PR - 1, and segments blockIdx.z,
    // + gridDim.z, ... (segments.cuh) one after another as one stream of chunks, so the ring
    // runs ahead across a segment's end. Its rows are rows ur .. of u slice v0 / WALK_ROWS.
    const int h = blockIdx.x, v0 = blockIdx.y * PR, zs = gridDim.z;
    const int slice = v0 / WALK_ROWS, ur = v0 % WALK_ROWS;
    const int vr = 16 * (warp % RW) + g;  // this thread's rows of the block's: vr, vr + 8
    // this warp's share: S^T columns d0 .. d0 + D / KS - 1 (D's k-steps from half KDW), O^T's
    // n-tiles j0 .. j0 + NCW - 1
    const int half = KS == 1 ? 0 : warp / RW, d0 = half * (D / KS), j0 = half * NCW;
    int nchunks = 0;
    for (int si = blockIdx.z; si < nseg; si += zs) nchunks += segment_at(segs, si, T).chunks;

    // piece p = 4 wc + k of the block's chunk wc into slot p % STAGES; past the last piece an
    // empty group, so that every wait below counts the same groups. Pieces go out in order, so
    // one cursor (segment, its chunk) names the chunk of each new wc.
    int cur_si = blockIdx.z, cur_ci = 0;
    Segment cur = segment_at(segs, cur_si, T);
    u64 blk = 0;  // (chunk, head) block of the pieces going out
    auto issue = [&](auto place, int p) {
        constexpr int K = decltype(place)::value;
        if (p < 4 * nchunks) {
            if constexpr (K == 0) {
                blk = (u64)(cur.chunk0 + cur_ci) * H + h;
                if (++cur_ci == cur.chunks) {
                    cur_ci = 0, cur_si += zs;
                    if (cur_si < nseg) cur = segment_at(segs, cur_si, T);
                }
            }
            unsigned char* dst = smb + (p % L::STAGES) * L::SLOT;
            if constexpr (K == 0) {
                stage<L::IMG, L::BLOCK>(dst, w_in + blk * CHUNK * D);
            } else if constexpr (K == 1) {
                stage<L::IMG, L::BLOCK>(dst, qg + blk * CHUNK * D);
            } else if constexpr (K == 2) {
                stage<L::U_BYTES, L::BLOCK>(
                    dst, u_in + (blk * (D / WALK_ROWS) + slice) * CHUNK * WALK_ROWS);
                stage<L::A_BYTES, L::BLOCK>(dst + L::U_BYTES, aqk + blk * CHUNK * CHUNK);
            } else {
                stage<L::IMG, L::BLOCK>(dst, kd + blk * D * CHUNK);
                stage<L::GL_BYTES, L::BLOCK>(dst + L::IMG, gl + blk * D);
            }
        }
        cp_commit();
    };
    int piece = 0;
    // The next piece (of place K), landed for every thread; its predecessor's slot, which every
    // warp is done with past the barrier, then takes the piece STAGES - 1 ahead (of place
    // K + STAGES - 1, mod 4).
    auto next = [&](auto place) -> const unsigned char* {
        constexpr int K = decltype(place)::value;
        cp_wait<L::STAGES - 2>();
        __syncthreads();
        issue(Piece<(K + L::STAGES - 1) % 4>{}, piece + L::STAGES - 1);
        return smb + (piece++ % L::STAGES) * L::SLOT;
    };
    static_assert(L::STAGES <= 5, "the first STAGES - 1 pieces are one chunk's");
    issue(Piece<0>{}, 0);
    issue(Piece<1>{}, 1);
    if constexpr (L::STAGES > 3) issue(Piece<2>{}, 2);
    if constexpr (L::STAGES > 4) issue(Piece<3>{}, 3);
    // the pair's swap: this thread's words and its partner's (the same rows, the other half);
    // written before a piece's barrier and read after it, and not written again before the
    // chunk's last piece's barrier
    float4* const mine =
        reinterpret_cast<float4*>(smb + L::STAGES * L::SLOT) + warp * (L::XW / 4) * 32 + lane;
    const float4* const theirs = reinterpret_cast<const float4*>(smb + L::STAGES * L::SLOT) +
                                 (warp + RW) % (KS * RW) * (L::XW / 4) * 32 + lane;

    // S^T rows vr (+ 8), columns d0 + 8 j + 2 t4 (+ 1): n-tile j of the warp's m16n(D / KS)
    // accumulator, at this thread's offset in a slot's state
    const u64 slot_floats = (u64)H * D * D, at = ((u64)h * D + v0 + vr) * D + d0 + 2 * t4;
    auto store_state = [&](float* st, const float (&x)[D / 2 / KS]) {
#pragma unroll
        for (int j = 0; j < NDW; ++j) {
            *reinterpret_cast<float2*>(st + 8 * j) = make_float2(x[4 * j], x[4 * j + 1]);
            *reinterpret_cast<float2*>(st + 8 * D + 8 * j) =
                make_float2(x[4 * j + 2], x[4 * j + 3]);
        }
    };
    for (int si = blockIdx.z; si < nseg; si += zs) {
        const Segment sg = segment_at(segs, si, T);
        float* st = state + sg.slot * slot_floats + at;
        float S[D / 2 / KS];
#pragma unroll
        for (int j = 0; j < NDW; ++j) {  // a sequence without initial state starts from zero
            const float2 a = sg.init ? *reinterpret_cast<const float2*>(st + 8 * j) : float2{};
            const float2 b =
                sg.init ? *reinterpret_cast<const float2*>(st + 8 * D + 8 * j) : float2{};
            S[4 * j] = a.x, S[4 * j + 1] = a.y, S[4 * j + 2] = b.x, S[4 * j + 3] = b.y;
        }

        // acc, acc_e += this warp's columns of S^T's rows times theirs of an operand image's
        // [D][C] (b(s, n0): its fragment of k-step s, n-tile n0), S^T's fragments split as
        // each k-step needs them
        auto times_s = [&](float (&acc)[CHUNK / 2], float (&acc_e)[CHUNK / 2], auto b) {
#pragma unroll
            for (int s = 0; s < KDW; ++s) {
                Frag a;
                frag_of(S + 8 * s, S + 8 * s + 4, a.hi, a.lo);
#pragma unroll
                for (int j = 0; j < NC; ++j)
                    mma3(acc + 4 * j, acc_e + 4 * j, a, b(half * KDW + s, 8 * j));
            }
        };
        for (int ci = 0; ci < sg.chunks; ++ci) {
            // W^T and O^T's first term (over this warp's columns of S)
            float P[CHUNK / 2] = {}, Pe[CHUNK / 2] = {};
            const unsigned* wimg = reinterpret_cast<const unsigned*>(next(Piece<0>{}));
            times_s(P, Pe, [&](int s, int n0) { return frag_w<D>(wimg, s, n0, lane); });
#pragma unroll
            for (int i = 0; i < CHUNK / 2; ++i) P[i] += Pe[i];
            float O[CHUNK / 2] = {}, Oe[CHUNK / 2] = {};
            const unsigned* qimg = reinterpret_cast<const unsigned*>(next(Piece<1>{}));
            times_s(O, Oe, [&](int s, int n0) { return frag_img<CHUNK, D>(qimg, s, n0, lane); });
            // Of, Ofe: O^T's n-tiles j0 .. that this warp finishes; with a pair, the partner's
            // n-tiles and the whole partial W^T go to the swap
            float Of[4 * NCW], Ofe[4 * NCW];
#pragma unroll
            for (int j = 0; j < NCW; ++j) {
                float x[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int k = 4 * j + i;
                    if constexpr (KS == 1) {
                        Of[k] = O[k], Ofe[k] = Oe[k];
                    } else {
                        const float lo = O[k] + Oe[k], hi = O[4 * NCW + k] + Oe[4 * NCW + k];
                        Of[k] = half ? hi : lo, Ofe[k] = 0.0f, x[i] = half ? lo : hi;
                    }
                }
                if constexpr (KS == 2)
                    mine[(CHUNK / 8 + j) * 32] = make_float4(x[0], x[1], x[2], x[3]);
            }
            if constexpr (KS == 2)
#pragma unroll
                for (int i = 0; i < CHUNK / 8; ++i)
                    mine[i * 32] = make_float4(P[4 * i], P[4 * i + 1], P[4 * i + 2], P[4 * i + 3]);

            // v^T = u^T - W^T, its fragments (the same in both warps of a pair); O^T += v^T Aqk^T
            const unsigned char* ua = next(Piece<2>{});
            if constexpr (KS == 2) {
#pragma unroll
                for (int i = 0; i < CHUNK / 8; ++i) {
                    const float4 y = theirs[i * 32];
                    P[4 * i] += y.x, P[4 * i + 1] += y.y, P[4 * i + 2] += y.z, P[4 * i + 3] += y.w;
                }
#pragma unroll
                for (int j = 0; j < NCW; ++j) {
                    const float4 y = theirs[(CHUNK / 8 + j) * 32];
                    Of[4 * j] += y.x, Of[4 * j + 1] += y.y;
                    Of[4 * j + 2] += y.z, Of[4 * j + 3] += y.w;
                }
            }
            const float* us = reinterpret_cast<const float*>(ua);
            const unsigned* aimg = reinterpret_cast<const unsigned*>(ua + L::U_BYTES);
#pragma unroll
            for (int j = 0; j < NC; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    P[4 * j + i] =
                        us[u_word(8 * j + 2 * t4 + (i & 1), ur + vr + 8 * (i >> 1))] -
                        P[4 * j + i];
            Frag V[KC];
#pragma unroll
            for (int s = 0; s < KC; ++s) frag_of(P + 8 * s, P + 8 * s + 4, V[s].hi, V[s].lo);
#pragma unroll
            for (int s = 0; s < KC; ++s)
#pragma unroll
                for (int j = 0; j < NCW; ++j)
                    mma3(Of + 4 * j, Ofe + 4 * j, V[s],
                         frag_img<CHUNK, CHUNK>(aimg, s, 8 * (j0 + j), lane));
            // O^T rows vr (+ 8) = core[row0 + t][h][v0 + vr (+ 8)], t < rows: the packed rows
            const int c0 = ci * CHUNK;  // the segment's own token
#pragma unroll
            for (int j = 0; j < NCW; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int t = c0 + 8 * (j0 + j) + 2 * t4 + (i & 1);
                    if (t < sg.rows)
                        core[((u64)(sg.row0 + t) * H + h) * D + v0 + vr + 8 * (i >> 1)] =
                            Of[4 * j + i] + Ofe[4 * j + i];
                }

            // S^T = S^T diag(gl) + v^T kd over this warp's columns: D / 8 / KS tiles are chains
            // enough, so the three terms go into S alone (a second accumulator would cost
            // D / 2 / KS registers)
            const unsigned char* kg = next(Piece<3>{});
            const unsigned* kimg = reinterpret_cast<const unsigned*>(kg);
            const float* gls = reinterpret_cast<const float*>(kg + L::IMG) + d0;
#pragma unroll
            for (int j = 0; j < NDW; ++j) {
                const float2 x = *reinterpret_cast<const float2*>(gls + 8 * j + 2 * t4);
                S[4 * j] *= x.x, S[4 * j + 1] *= x.y, S[4 * j + 2] *= x.x, S[4 * j + 3] *= x.y;
            }
#pragma unroll
            for (int s = 0; s < KC; ++s)
#pragma unroll
                for (int j = 0; j < NDW; ++j)
                    mma3(S + 4 * j, S + 4 * j, V[s], frag_img<D, CHUNK>(kimg, s, d0 + 8 * j, lane));
            // a checkpoint: the state of that prefix alone
            if (const int slot = checkpoint_slot(segs, sg, ci); slot >= 0)
                store_state(state + slot * slot_floats + at, S);
        }
        store_state(st, S);
    }
    cp_wait<0>();  // the trailing groups are empty; nothing is left in flight at exit
}

// The same arguments as kda_chunk_inter (and one host twin for all); blocks of WALK_ROWS rows
// (kda_chunk_inter_portable_d{D}) or of half (_r32_d{D}: kernels.walk_rows picks). The
// dynamic shared memory, the slot ring and the pair's swap, is exported as <kernel>_smem.
#define KDA_CHUNK_INTER_PORTABLE(NAME, D, PR)                                                  \
    extern "C" __global__ void __launch_bounds__(PWalk<D, PR>::BLOCK, 1)                     \
        NAME(const unsigned* qg, const unsigned* kd, const float* gl, const unsigned* w,       \
             const float* u, const unsigned* aqk, float* state, float* core, const int* segs,  \
             int nseg, int T, int H) {                                                         \
        walk_portable<D, PR>(qg, kd, gl, w, u, aqk, state, core, segs, nseg, T, H);            \
    }                                                                                          \
    extern "C" {                                                                               \
    __constant__ int NAME##_smem = PWalk<D, PR>::BYTES;                                        \
    }
KDA_CHUNK_INTER_PORTABLE(kda_chunk_inter_portable_d64, 64, WALK_ROWS)
KDA_CHUNK_INTER_PORTABLE(kda_chunk_inter_portable_d128, 128, WALK_ROWS)
KDA_CHUNK_INTER_PORTABLE(kda_chunk_inter_portable_r32_d64, 64, WALK_ROWS / 2)
KDA_CHUNK_INTER_PORTABLE(kda_chunk_inter_portable_r32_d128, 128, WALK_ROWS / 2)
