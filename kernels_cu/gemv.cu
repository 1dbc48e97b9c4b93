// Decode projections are pure weight streaming (bf16, read once per token). A warp owns a tile
// of GEMV_TILE output rows, or a 1/KS share of its K (KS is the launch's choice: more shares
// when the tiles alone are too few to keep every SM streaming; blocks hold GEMV_WARPS / KS
// tiles). Its weights arrive by cp.async in stages of GEMV_TILE rows x GEMV_STAGE_K, two rows'
// whole 256 bytes per instruction, into a ring of GEMV_STAGES stages in shared memory: loads
// straight into MMA fragments take 64 bytes from each of 8 rows per instruction, and that
// pattern streamed slower than whole 256-byte runs (docs/perf-log.md, v6). It multiplies on
// tensor cores (fragments by ldmatrix) with the up to MAX_DECODE_ROWS token rows of decode_k as
// the MMA's columns, so K rows cost the same instructions as one; the _x2 entries take two
// column groups of 8 (up to 16 token rows: a small batch streams each weight once on decode's
// rings, where the slab kernels walk a tile's whole K in one warp). The k order, the MMA chains
// and the sum over shares are fixed and an output column depends on no other column: decode_k
// is bit-identical to K decodes, a batch's rows to decode's.
#include "front_end.cuh"


// This warp's tile in a launch's run of blocks from block 0: GEMV_WARPS / ks tiles of ks warps
// each.
__device__ __forceinline__ int gemv_tile_index(int block, int ks) {
    return block * (GEMV_WARPS / ks) + (threadIdx.x >> 5) / ks;
}

// The warps' rings, the GEMV kernels' dynamic shared memory.
constexpr int GEMV_RING_BYTES = GEMV_WARPS * GEMV_STAGES * GEMV_TILE * GEMV_STAGE_K * 2;

// The shares' partial sums [GEMV_WARPS][G][32]: one array for every gemv_tile of a kernel
// (front_end_gemv's two would otherwise take two).
template <int G>
__device__ __forceinline__ float4 (*gemv_part())[G][32] {
    __shared__ float4 part[GEMV_WARPS][G][32];
    return part;
}

// W[n0 : n0+16, :K] x[:M, :K]^T for this warp's tile, M <= 8 G token rows (G column groups of
// the MMA's N = 8); true in the warp that then holds the sums in out: out[gi] rows n0+g and
// n0+g+8 at token columns 8 gi + 2t and + 1 (lane = 4g + t). Every warp of the block must call
// it (it synchronises the block). Share j of ks takes a run of consecutive stages (share_first;
// a run of a row's bytes streams 1-3% faster in the batch GEMVs, where a block reads its shares
// in turn, than every ks-th stage: docs/perf-log.md, v49); dimensions past K are zero-filled,
// rows past N read row N-1 and are never stored. A token row's sums take the same MMAs in the
// same order for any M, so a row's bits do not depend on the rows beside it. COHERENT reads x
// through L2 only: x that other blocks of the launch wrote; prior_grid_sync, then ready(), run
// in every thread after the first stages' weight copies are issued and before any x is read, so
// a block whose x is still being written (by the kernel before, or by blocks of this one) waits
// with its weights in flight.
template <int G, bool COHERENT = false, typename Ready = NoWait>
__device__ __forceinline__ bool gemv_tile(const bf16* __restrict__ W, int N, int K,
                                          const bf16* __restrict__ x, int M, int ldx, int n0,
                                          int ks, float (&out)[G][4], Ready ready = Ready()) {
    extern __shared__ uint4 stages[];  // [GEMV_WARPS][GEMV_STAGES][GEMV_TILE][GEMV_STAGE_K / 8]
    float4 (*part)[G][32] = gemv_part<G>();
    constexpr int RUNS = GEMV_STAGE_K / 8, SV = GEMV_TILE * RUNS;  // 16-byte runs a row, a stage
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int share = warp % ks, steps = (K + GEMV_STAGE_K - 1) / GEMV_STAGE_K;
    const int first = share_first(share, steps, ks);
    const int n = n0 < N ? share_first(share + 1, steps, ks) - first : 0;  // this warp's stages
    const int last = max(N - 1, 0);
    uint4* ring = stages + warp * GEMV_STAGES * SV;
    // stage j into slot u; run c of row r lands at c ^ (r & 7), so that ldmatrix's eight
    // row reads of one run column fall in eight different banks
    auto fill = [&](int j, int u) {
        const int c = lane % RUNS, k = (first + j) * GEMV_STAGE_K + 8 * c;
#pragma unroll
        for (int i = 0; i < GEMV_TILE * RUNS / 32; ++i) {
            const int r = (32 / RUNS) * i + lane / RUNS;
            cp_async16(ring + u * SV + r * RUNS + (c ^ (r & 7)),
                       W + (u64)min(n0 + r, last) * K + (k < K ? k : 0), k < K ? 16 : 0);
        }
    };
#pragma unroll
    for (int u = 0; u < GEMV_STAGES; ++u) {
        if (u < n) fill(u, u);
        cp_commit();
    }
    prior_grid_sync();  // x may be the previous kernel's output
    ready();
    const int mi = lane >> 3, row = (mi & 1) * 8 + (lane & 7);  // ldmatrix: this lane's row
    float c[G][2][4] = {};  // a group's even and odd k16 blocks: two shorter chains of MMAs
    // token row m at k0 + 16q + 8h + 2t, +1: the B fragments, from xr = row m's; group gi takes
    // rows 8 gi.. (one with no row takes no MMA)
    const bf16* xrow[G];  // this lane's row of each group
#pragma unroll
    for (int gi = 0; gi < G; ++gi) xrow[gi] = x + (u64)min(8 * gi + g, M - 1) * ldx + 2 * t;
    auto has_rows = [&](int gi) { return gi == 0 || 8 * gi < M; };
    auto load_b = [&](unsigned (&b)[GEMV_STAGE_K / 8], const bf16* xr, bool valid, int k0) {
#pragma unroll
        for (int i = 0; i < GEMV_STAGE_K / 8; ++i) {
            const int k = k0 + 8 * i + 2 * t;
            const unsigned* p = reinterpret_cast<const unsigned*>(xr + k0 + 8 * i);
            b[i] = valid && k < K ? (COHERENT ? __ldcg(p) : __ldg(p)) : 0u;
        }
    };
    for (int j = 0; j < n; ++j) {
        const int k0 = (first + j) * GEMV_STAGE_K;
        unsigned b[G][GEMV_STAGE_K / 8];
#pragma unroll
        for (int gi = 0; gi < G; ++gi)  // the x loads overlap the wait for the weights
            if (has_rows(gi)) load_b(b[gi], xrow[gi], 8 * gi + g < M, k0);
        cp_wait<GEMV_STAGES - 1>();
        __syncwarp();
        const uint4* st = ring + (j % GEMV_STAGES) * SV + row * RUNS;
#pragma unroll
        for (int q = 0; q < GEMV_STAGE_K / 16; ++q) {
            unsigned a[4];
            ldmatrix_x4(a, st + ((2 * q + (mi >> 1)) ^ (row & 7)));
#pragma unroll
            for (int gi = 0; gi < G; ++gi)
                if (has_rows(gi)) mma_bf16(c[gi][q & 1], a, b[gi] + 2 * q);
        }
        __syncwarp();  // the whole warp is done with this slot before it is refilled
        if (j + GEMV_STAGES < n) fill(j + GEMV_STAGES, j % GEMV_STAGES);
        cp_commit();
    }
#pragma unroll
    for (int gi = 0; gi < G; ++gi)
        part[warp][gi][lane] = make_float4(c[gi][0][0] + c[gi][1][0], c[gi][0][1] + c[gi][1][1],
                                           c[gi][0][2] + c[gi][1][2], c[gi][0][3] + c[gi][1][3]);
    __syncthreads();
    if (share != 0 || n0 >= N) return false;
#pragma unroll
    for (int gi = 0; gi < G; ++gi) {
        float4 s = part[warp][gi][lane];
        for (int w = 1; w < ks; ++w) {
            const float4 p = part[warp + w][gi][lane];
            s.x += p.x, s.y += p.y, s.z += p.z, s.w += p.w;
        }
        out[gi][0] = s.x, out[gi][1] = s.y, out[gi][2] = s.z, out[gi][3] = s.w;
    }
    return true;
}

// Calls put(n, m, value) for each of this lane's outputs that exists (n < N, m < M).
template <int G, typename F>
__device__ __forceinline__ void tile_outputs(const float (&out)[G][4], int n0, int N, int M,
                                             F put) {
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
    for (int gi = 0; gi < G; ++gi)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int n = n0 + g + 8 * (i >> 1), m = 8 * gi + 2 * t + (i & 1);
            if (n < N && m < M) put(n, m, out[gi][i]);
        }
}

// y[m, n] = bf16(W[n] . x[m]): the o_proj of decode. Nothing sends its weights into L2 ahead of
// its copies: every block sending all its rows as it started (67 MB at glm-5.3-flash, more than
// L2 holds) evicted lines before they were read, 4 us slower, and the walk ahead of it sending
// the first 16 MB delayed the walk more than it saved (docs/perf-log.md, v43).
template <int G>
__device__ __forceinline__ void dense_gemv(const bf16* __restrict__ W, const bf16* __restrict__ x,
                                           bf16* __restrict__ y, int N, int K, int M, int ldx,
                                           int ldy, int ks) {
    const int n0 = gemv_tile_index(blockIdx.x, ks) * GEMV_TILE;
    float out[G][4];
    if (!gemv_tile<G>(W, N, K, x, M, ldx, n0, ks, out)) return;
    tile_outputs(out, n0, N, M, [&](int n, int m, float v) { y[(u64)m * ldy + n] = f2bf(v); });
}

// Decode's whole front end in one launch: the packed projection q|k|v|f_a|g_a|b (q|k|v to
// qkv_proj [M, 3*qkv] and qkv_parts [3, P, qkv] rows 0..M-1 of each part, f_a|g_a|b to
// gate_in [M, ldg]), then from f_a and g_a the low-rank gates (g_raw with the forget gate
// computed from the rounded value; out_gate) and beta = sigmoid(b). The gates need rows that
// this launch produces, so the f_a|g_a|b tiles come first (the lowest blocks), with ks_early
// shares each so that they finish well before the q|k|v tiles, and count themselves done in
// sync[0]; the gate blocks come last and wait for that count, so none waits on a block that
// might not have started as long as blocks start in index order (docs/design.md: a launch of
// more blocks than the SMs hold relies on it). The gate blocks wait with their first f_b / g_b
// weights in flight and compute while the q|k|v tiles still stream: the gates cost no launch
// and no wave of their own.
template <int G>
__device__ __forceinline__ void front_end(
    const bf16* __restrict__ W, const bf16* __restrict__ x, bf16* __restrict__ gate_in,
    bf16* __restrict__ qkv_parts, bf16* __restrict__ qkv_proj, const bf16* __restrict__ f_b,
    const bf16* __restrict__ g_b, const float* __restrict__ a_log,
    const float* __restrict__ dt_bias, bf16* __restrict__ g_raw, bf16* __restrict__ out_gate,
    float* __restrict__ gate, float* __restrict__ beta, int* __restrict__ sync, int N, int K,
    int M, int P, int ldg, int H, int D, int R, float lower_bound, int bounded, int ks,
    int ks_early, int ks_gate, int early_blocks, int proj_blocks) {
    const int qkv = H * D, tiles = (N + GEMV_TILE - 1) / GEMV_TILE, first = 3 * qkv / GEMV_TILE;
    const int early = tiles - first;  // the f_a|g_a|b tiles, run first
    if (blockIdx.x < proj_blocks) {
        const bool is_early = blockIdx.x < early_blocks;
        const int s = is_early ? ks_early : ks;
        const int i = gemv_tile_index(is_early ? blockIdx.x : blockIdx.x - early_blocks, s);
        const int n0 = is_early ? (i < early ? (first + i) * GEMV_TILE : N)  // N: a spare warp
                                : (i < first ? i * GEMV_TILE : N);
        float out[G][4];
        if (!gemv_tile<G>(W, N, K, x, M, K, n0, s, out)) return;
        tile_outputs(out, n0, N, M, [&](int n, int m, float v) {
            proj_store(qkv_proj, qkv_parts, gate_in, qkv, P, ldg, n, m, v);
        });
        if (is_early) {
            __threadfence();
            __syncwarp();
            if ((threadIdx.x & 31) == 0) atomicAdd(&sync[0], 1);
        }
        return;
    }
    auto gate_wait = [&]() { wait_early(sync, early); };
    const int gb = blockIdx.x - proj_blocks, gate_blocks = gridDim.x - proj_blocks;
    const bf16* f_a = gate_in;
    if (gb == gate_blocks - 1) {
        beta_block(sync, early, f_a, beta, M, H, ldg, R);
    } else {
        // qkv % GEMV_TILE == 0: a tile is all f or all g
        const int n0 = gemv_tile_index(gb, ks_gate) * GEMV_TILE;
        const bool is_f = n0 < qkv;
        const int c0 = is_f ? n0 : n0 - qkv, rows = n0 < 2 * qkv ? qkv : 0;  // 0: a spare tile
        float out[G][4];
        if (gemv_tile<G, true>(is_f ? f_b : g_b, rows, R, is_f ? f_a : f_a + R, M, ldg, c0,
                               ks_gate, out, gate_wait))  // f_b / g_b load while tiles finish
            tile_outputs(out, c0, qkv, M, [&](int c, int m, float v) {
                gate_store(is_f, g_raw, gate, out_gate, a_log, dt_bias, qkv, D, lower_bound,
                           bounded, c, m, v);
            });
    }
    gates_done(sync, gate_blocks);
}

// The batch GEMVs: a block's GEMV_WARPS warps compute TB tiles (16 TB output rows from n0) for
// up to 8 GEMV_BATCH_GROUPS token rows, a warp a tile and TB column groups of 8. The block
// copies the tiles' weights and the x rows of each stage by cp.async into two rings (both
// swizzled as gemv_tile's), so x crosses from L2 once a block and reaches the MMAs by
// ldmatrix, where gemv_tile's warps each loaded every x word of every group from L2
// themselves (latency-bound: docs/perf-log.md, v18). The weights come from DRAM and need
// more bytes in flight than x from L2: the weights' ring is GEMV_SLAB_W_BYTES deep (less where
// a block's shared memory cannot hold that beside x's: SMEM_PER_BLOCK), x's
// GEMV_SLAB_X_STAGES; the first half of the warps copies weights and the second x, so each
// half waits on its own commit groups. A warp walks the whole K in order: share 0's run of
// stages, then share 1's, ..., each share's two MMA chains from zero and its sum c0 + c1
// added to the running total in share order: exactly the MMAs, chains and sums of
// gemv_tile's ks shares for every token row, so a row's bits are decode's.
constexpr int SLAB_ROWS = 8 * GEMV_BATCH_GROUPS;  // token rows a block (a slab)
constexpr int SLAB_RUNS = GEMV_STAGE_K / 8;        // 16-byte runs a row of a stage
static_assert(GEMV_WARPS == GEMV_BATCH_GROUPS, "a warp a tile takes TB of the column groups");
static_assert(GEMV_WARPS % GEMV_SLAB_TILES == 0 && GEMV_WARPS % GEMV_SLAB_TILES_DENSE == 0,
              "whole warps a tile");
constexpr int SLAB_X_BYTES = GEMV_SLAB_X_STAGES * SLAB_ROWS * SLAB_RUNS * 16;
constexpr int SLAB_W_BYTES = GEMV_SLAB_W_BYTES < SMEM_PER_BLOCK - SLAB_X_BYTES
                                 ? GEMV_SLAB_W_BYTES : SMEM_PER_BLOCK - SLAB_X_BYTES;
template <int TB>
__host__ __device__ constexpr int slab_w_stages() {
    return SLAB_W_BYTES / (TB * GEMV_TILE * SLAB_RUNS * 16);
}
template <int TB>
__host__ __device__ constexpr int slab_smem() {
    static_assert(slab_w_stages<TB>() >= 2, "weights in flight while a stage is read");
    return slab_w_stages<TB>() * TB * GEMV_TILE * SLAB_RUNS * 16 + SLAB_X_BYTES;
}

// W[n0 : n0 + 16 TB, :K] x[:M, :K]^T; true in the warps whose tile has rows (< N), which then
// hold out[gi] for token rows 8 (g0 + gi) + 2t, + 1 of rows n0 + 16 tile + g, + 8 (g0 as
// slab_outputs gives it). Every thread of the block must call it. prior_grid_sync, then
// ready(), run in every thread after the first stages' weight copies are issued and before any
// x is read.
template <int TB, typename Ready = NoWait>
__device__ __forceinline__ bool gemv_slab(const bf16* __restrict__ W, int N, int K,
                                          const bf16* __restrict__ x, int M, int ldx, int n0,
                                          int ks, float (&out)[TB][4], Ready ready = Ready()) {
    extern __shared__ uint4 ring[];  // [SW][16 TB][SLAB_RUNS] weights, then [SX][SLAB_ROWS][SLAB_RUNS] x
    constexpr int RUNS = SLAB_RUNS, WR = TB * GEMV_TILE, SW = slab_w_stages<TB>();
    constexpr int SX = GEMV_SLAB_X_STAGES, PER = 16 * GEMV_WARPS / RUNS;  // rows a pass of a half
    static_assert(SW >= 2 && SX >= 2 && WR % PER == 0, "rings of two stages at least");
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const bool copies_w = warp < GEMV_WARPS / 2;
    const int ct = tid % (16 * GEMV_WARPS), c = tid % RUNS;  // this thread in its half
    const int tile = warp / (GEMV_WARPS / TB), g0 = warp % (GEMV_WARPS / TB) * TB;
    const int steps = (K + GEMV_STAGE_K - 1) / GEMV_STAGE_K;
    uint4* xring = ring + SW * WR * RUNS;
    // The shares' runs of stages follow each other, so the block's u-th stage is k-block u
    // (share j's run ends before share_first(j + 1)). Each thread copies one row run (8 c..)
    // of rows PER apart from its first, so a copy's address is a base and a multiple of a
    // constant stride. Rows past N (M) are zero-filled: no MMA result of theirs is stored
    // (read).
    const int r0 = ct / RUNS;  // this thread's first row of a pass
    const bf16* wrow = W + (u64)(n0 + r0) * K + 8 * c;
    auto fill_w = [&](int u) {  // the block's u-th stage into slot u % SW
        const int k = u * GEMV_STAGE_K;
        const bool kin = k + 8 * c < K;
        uint4* st = ring + (u % SW) * WR * RUNS;
#pragma unroll
        for (int i = 0; i < WR / PER; ++i) {
            const int r = PER * i + r0;
            const bool ok = kin && n0 + r < N;
            cp_async16(st + r * RUNS + (c ^ (r & 7)), ok ? wrow + (u64)i * PER * K + k : W,
                       ok ? 16 : 0);
        }
    };
    const bf16* xrow = x + (u64)r0 * ldx + 8 * c;
    auto fill_x = [&](int u) {  // straight-line: a branch a copy cost ~20 instructions each
        const int k = u * GEMV_STAGE_K;
        const bool kin = k + 8 * c < K;
        uint4* st = xring + (u % SX) * SLAB_ROWS * RUNS;
#pragma unroll
        for (int i = 0; i < SLAB_ROWS / PER; ++i) {
            const int m = PER * i + r0;
            const bool in = kin && m < M;
            cp_async16(st + m * RUNS + (c ^ (m & 7)), in ? xrow + (u64)i * PER * ldx + k : x,
                       in ? 16 : 0);
        }
    };
    if (copies_w)
#pragma unroll
        for (int u = 0; u < SW - 1; ++u) {
            if (u < steps) fill_w(u);
            cp_commit();
        }
    prior_grid_sync();  // x may be the previous kernel's output
    ready();
    if (!copies_w)
#pragma unroll
        for (int u = 0; u < SX - 1; ++u) {
            if (u < steps) fill_x(u);
            cp_commit();
        }
    const bool mine = n0 + tile * GEMV_TILE < N;
    const int mi = lane >> 3, row = (mi & 1) * 8 + (lane & 7);  // ldmatrix: this lane's A row
    float acc[TB][2][4] = {};  // even and odd k16 blocks, as gemv_tile's chains
    int share = 0, end = share_first(1, steps, ks);  // the stage past this share's run
    for (int idx = 0; idx < steps; ++idx) {
        if (copies_w) cp_wait<SW - 2>();
        else cp_wait<SX - 2>();
        __syncthreads();  // stage idx is in; every warp is done with the slots refilled next
        if (copies_w) {
            if (idx + SW - 1 < steps) fill_w(idx + SW - 1);
        } else {
            if (idx + SX - 1 < steps) fill_x(idx + SX - 1);
        }
        cp_commit();
        if (mine) {
            const uint4* st = ring + (idx % SW) * WR * RUNS;
            unsigned a[GEMV_STAGE_K / 16][4];
#pragma unroll
            for (int k16 = 0; k16 < GEMV_STAGE_K / 16; ++k16)
                ldmatrix_x4(a[k16], st + (tile * GEMV_TILE + row) * RUNS + ((2 * k16 + (mi >> 1)) ^ (row & 7)));
            // k32 outermost: the column groups' chains take turns, 2 TB independent MMAs
            // between two of one chain (a chain's MMAs, and so its sums, in k order as before)
            const uint4* xs = xring + ((idx % SX) * SLAB_ROWS + 8 * g0 + (lane & 7)) * RUNS;
#pragma unroll
            for (int k32 = 0; k32 < GEMV_STAGE_K / 32; ++k32) {
                unsigned b[TB][4];  // each group's B fragments of k16 blocks 2 k32 and 2 k32 + 1
#pragma unroll
                for (int gi = 0; gi < TB; ++gi)
                    if (8 * (g0 + gi) < M)
                        ldmatrix_x4(b[gi], xs + 8 * gi * RUNS + ((4 * k32 + mi) ^ (lane & 7)));
#pragma unroll
                for (int gi = 0; gi < TB; ++gi)
                    if (8 * (g0 + gi) < M) mma_bf16(acc[gi][0], a[2 * k32], b[gi]);
#pragma unroll
                for (int gi = 0; gi < TB; ++gi)
                    if (8 * (g0 + gi) < M) mma_bf16(acc[gi][1], a[2 * k32 + 1], b[gi] + 2);
            }
        }
        if (idx + 1 == end) {  // the end of a share: its sum into the total, in share order
#pragma unroll
            for (int gi = 0; gi < TB; ++gi)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float p = acc[gi][0][i] + acc[gi][1][i];
                    out[gi][i] = share == 0 ? p : out[gi][i] + p;
                    acc[gi][0][i] = acc[gi][1][i] = 0.0f;
                }
            ++share;
            end = share_first(share + 1, steps, ks);
        }
    }
    return mine;
}

// Calls put(n, m, value) for each of this lane's gemv_slab outputs that exists (n < N, m < M).
template <int TB, typename F>
__device__ __forceinline__ void slab_outputs(const float (&out)[TB][4], int n0, int N, int M,
                                             F put) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int nt = n0 + warp / (GEMV_WARPS / TB) * GEMV_TILE, g0 = warp % (GEMV_WARPS / TB) * TB;
#pragma unroll
    for (int gi = 0; gi < TB; ++gi)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int n = nt + g + 8 * (i >> 1), m = 8 * (g0 + gi) + 2 * t + (i & 1);
            if (n < N && m < M) put(n, m, out[gi][i]);
        }
}

// dense_gemv over M token rows: TB tiles a block (blockIdx.y), rows SLAB_ROWS blockIdx.x.. of
// them. The slabs of one weight block are neighbours in launch order, so they run at the same
// time and all but the first read its weights from L2: with the slabs in turn, a weight was
// read from DRAM once a slab.
template <int TB>
__device__ __forceinline__ void dense_slab(const bf16* __restrict__ W, const bf16* __restrict__ x,
                                           bf16* __restrict__ y, int N, int K, int M, int ldx,
                                           int ldy, int ks) {
    const int n0 = blockIdx.y * TB * GEMV_TILE, m0 = blockIdx.x * SLAB_ROWS;
    const int rows = min(M - m0, SLAB_ROWS);
    x += (u64)m0 * ldx;
    y += (u64)m0 * ldy;
    float out[TB][4];
    if (gemv_slab<TB>(W, N, K, x, rows, ldx, n0, ks, out))
        slab_outputs(out, n0, N, rows,
                     [&](int n, int m, float v) { y[(u64)m * ldy + n] = f2bf(v); });
}

// front_end over M token rows, TB tiles a block, rows SLAB_ROWS blockIdx.x.. of them (the
// slabs of a weight block neighbours, as dense_slab's; each slab its own sync pair): a slab's
// blocks (blockIdx.y) are f_a|g_a|b's (early_blocks, run first; each counts itself done in
// sync[0]), then q|k|v's (up to proj_blocks), then f_b|g_b's, which wait for all early
// blocks, and beta's, last. The shares ks, ks_early and ks_gate are front_end's, so every
// output has its bits.
template <int TB>
__device__ __forceinline__ void front_end_slab(
    const bf16* __restrict__ W, const bf16* __restrict__ x, bf16* __restrict__ gate_in,
    bf16* __restrict__ qkv_parts, bf16* __restrict__ qkv_proj, const bf16* __restrict__ f_b,
    const bf16* __restrict__ g_b, const float* __restrict__ a_log,
    const float* __restrict__ dt_bias, bf16* __restrict__ g_raw, bf16* __restrict__ out_gate,
    float* __restrict__ gate, float* __restrict__ beta, int* __restrict__ sync, int N, int K,
    int M, int P, int ldg, int H, int D, int R, float lower_bound, int bounded, int ks,
    int ks_early, int ks_gate, int early_blocks, int proj_blocks) {
    const int qkv = H * D, rows = TB * GEMV_TILE, m0 = blockIdx.x * SLAB_ROWS;
    M = min(M - m0, SLAB_ROWS);
    x += (u64)m0 * K;
    gate_in += (u64)m0 * ldg;
    qkv_parts += (u64)m0 * qkv;  // row m0 + m of each [P, qkv] part
    qkv_proj += (u64)m0 * 3 * qkv;
    g_raw += (u64)m0 * qkv;
    out_gate += (u64)m0 * qkv;
    gate += (u64)m0 * qkv;
    beta += (u64)m0 * H;
    sync += 2 * blockIdx.x;
    const int blk = blockIdx.y;
    if (blk < proj_blocks) {
        const bool is_early = blk < early_blocks;
        const int n0 = is_early ? 3 * qkv + blk * rows : (blk - early_blocks) * rows;
        const int n_end = is_early ? N : 3 * qkv;  // rows past it: another region's
        float out[TB][4];
        if (gemv_slab<TB>(W, n_end, K, x, M, K, n0, is_early ? ks_early : ks, out))
            slab_outputs(out, n0, n_end, M, [&](int n, int m, float v) {
                proj_store(qkv_proj, qkv_parts, gate_in, qkv, P, ldg, n, m, v);
            });
        if (is_early) early_done(sync);
        return;
    }
    const int gb = blk - proj_blocks, gate_blocks = gridDim.y - proj_blocks;
    const bf16* f_a = gate_in;
    if (gb == gate_blocks - 1) {
        beta_block(sync, early_blocks, f_a, beta, M, H, ldg, R);
    } else {
        // qkv % rows == 0: a block is all f or all g
        const int n0 = gb * rows;
        const bool is_f = n0 < qkv;
        const int c0 = is_f ? n0 : n0 - qkv;
        float out[TB][4];
        auto gate_wait = [&]() { wait_early(sync, early_blocks); };  // f_b / g_b load meanwhile
        if (gemv_slab<TB>(is_f ? f_b : g_b, qkv, R, is_f ? f_a : f_a + R, M, ldg, c0, ks_gate,
                          out, gate_wait))
            slab_outputs(out, c0, qkv, M, [&](int c, int m, float v) {
                gate_store(is_f, g_raw, gate, out_gate, a_log, dt_bias, qkv, D, lower_bound,
                           bounded, c, m, v);
            });
    }
    gates_done(sync, gate_blocks);
}

// The entries: decode's and decode_k's (up to 8 token rows, one column group: the most blocks
// an SM), the _x2 forms of them (up to 16 rows, two groups), and the batches' (any rows,
// SLAB_ROWS a block, every weight read once a slab).
// Their dynamic shared memory (the rings) is exported for the CUDA backend.
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, GEMV_BLOCKS_PER_SM)
dense_gemv_bf16(const bf16* W, const bf16* x, bf16* y, int N, int K, int M, int ldx, int ldy,
                int ks) {
    dense_gemv<1>(W, x, y, N, K, M, ldx, ldy, ks);
}
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, GEMV_BLOCKS_PER_SM)
dense_gemv_bf16_x2(const bf16* W, const bf16* x, bf16* y, int N, int K, int M, int ldx,
                   int ldy, int ks) {
    dense_gemv<2>(W, x, y, N, K, M, ldx, ldy, ks);
}
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, GEMV_BATCH_BLOCKS_PER_SM)
dense_gemv_bf16_batch(const bf16* W, const bf16* x, bf16* y, int N, int K, int M, int ldx,
                      int ldy, int ks) {
    dense_slab<GEMV_SLAB_TILES_DENSE>(W, x, y, N, K, M, ldx, ldy, ks);
}
#define FRONT_END_ENTRY(NAME, BLOCKS, BODY)                                                     \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, BLOCKS) NAME(                 \
        const bf16* W, const bf16* x, bf16* gate_in, bf16* qkv_parts, bf16* qkv_proj,           \
        const bf16* f_b, const bf16* g_b, const float* a_log, const float* dt_bias, bf16* g_raw, \
        bf16* out_gate, float* gate, float* beta, int* sync, int N, int K, int M, int P, int ldg, \
        int H, int D, int R, float lower_bound, int bounded, int ks, int ks_early, int ks_gate,  \
        int early_blocks, int proj_blocks) {                                                    \
        BODY(W, x, gate_in, qkv_parts, qkv_proj, f_b, g_b, a_log, dt_bias, g_raw, out_gate,     \
             gate, beta, sync, N, K, M, P, ldg, H, D, R, lower_bound, bounded, ks, ks_early,    \
             ks_gate, early_blocks, proj_blocks);                                               \
    }
FRONT_END_ENTRY(front_end_gemv, GEMV_BLOCKS_PER_SM, front_end<1>)
FRONT_END_ENTRY(front_end_gemv_x2, GEMV_BLOCKS_PER_SM, front_end<2>)
FRONT_END_ENTRY(front_end_gemv_batch, GEMV_BATCH_BLOCKS_PER_SM, front_end_slab<GEMV_SLAB_TILES>)
extern "C" {
__constant__ int dense_gemv_bf16_smem = GEMV_RING_BYTES;
__constant__ int dense_gemv_bf16_x2_smem = GEMV_RING_BYTES;
__constant__ int front_end_gemv_smem = GEMV_RING_BYTES;
__constant__ int front_end_gemv_x2_smem = GEMV_RING_BYTES;
__constant__ int dense_gemv_bf16_batch_smem = slab_smem<GEMV_SLAB_TILES_DENSE>();
__constant__ int front_end_gemv_batch_smem = slab_smem<GEMV_SLAB_TILES>();
}
