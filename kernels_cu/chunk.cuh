// What kda_chunk_intra (chunk.cu) and both walks (chunk.cu on sm_90a, chunk_portable.cu
// everywhere) share: the 3xBF16 split words, the MMA step on them, and the operand images the
// intra kernel writes for the walks.
#pragma once
#include "common.cuh"

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

// big + small += a b: the hi x hi products and the two correction terms accumulate apart
// (shorter chains of dependent MMAs); the caller adds small into big at the end.
__device__ __forceinline__ void mma3(float big[4], float small[4], const Frag& a, const Frag& b) {
    mma_bf16(small, a.lo, b.hi);
    mma_bf16(big, a.hi, b.hi);
    mma_bf16(small, a.hi, b.lo);
}

// ---- the walk's operand images -------------------------------------------------------------
// The operands the walk takes as B (qg, kd^T, Aqk; w below) are written as the image of the
// shared memory the Hopper walk's warpgroup MMAs read, so that one bulk copy stages a (chunk,
// head) block (the portable walk stages the same bytes with cp.async and reads them by
// ldmatrix): N
// rows of the product's n axis by K of its k axis in split words, a hi plane then a lo plane
// of N K / 2 words; in a plane, k-pair p of row n is word img_word(N, n, p). That is wgmma's
// K-major layout without swizzle: core matrices of 8 rows x 16 bytes (4 k-pairs), adjacent
// along n, the next 4 k-pairs 16 N bytes on. u is written in slices of the walk's WALK_ROWS
// columns, [C, WALK_ROWS] each, for the same reason.
__host__ __device__ constexpr int img_word(int N, int n, int p) {
    return 4 * N * (p >> 2) + 4 * n + (p & 3);
}
// Where u[t][v] sits in its slice: a walk thread reads tokens t, t + 2, t + 4, t + 6 in one load
// (lanes four apart), which share banks in [C][WALK_ROWS] rows; v's octet is XORed with t's pair
// index, so the four take distinct banks. The intra kernel's stores of a row stay 256 bytes.
__host__ __device__ constexpr int u_word(int t, int v) {
    return WALK_ROWS * t + (v ^ (8 * ((t >> 1) & 3)));
}
// w is the one operand whose image is MN-major: the solve produces it a column (dimension) at a
// time, and 8 tokens of one are a 16-byte row of a core matrix (8 dimensions x 8 tokens), so a
// thread stores 16 bytes a plane for 8 rows and a warp whole lines. Token octets are adjacent,
// dimension octets 4 C words apart; w_word is the word holding tokens t, t ^ 1 of dimension d
// in the hi plane, the lo plane C D / 2 words on.
__host__ __device__ constexpr int w_word(int d, int t) {
    return 4 * CHUNK * (d >> 3) + 32 * (t >> 3) + 4 * (d & 7) + ((t & 7) >> 1);
}

// ---- the walks' shared arithmetic -------------------------------------------------------------
// The A fragment (hi, lo words) of k-columns 16 i.. from the C fragments of columns 16 i..
// (x) and 16 i + 8.. (y).
__device__ __forceinline__ void frag_of(const float* x, const float* y, unsigned (&hi)[4],
                                        unsigned (&lo)[4]) {
    const uint2 p0 = split_pair(x[0], x[1]), p1 = split_pair(x[2], x[3]);
    const uint2 p2 = split_pair(y[0], y[1]), p3 = split_pair(y[2], y[3]);
    hi[0] = p0.x, hi[1] = p1.x, hi[2] = p2.x, hi[3] = p3.x;
    lo[0] = p0.y, lo[1] = p1.y, lo[2] = p2.y, lo[3] = p3.y;
}
