// Decode projections are pure weight streaming (bf16, read once per token). A warp owns a tile
// of GEMV_TILE output rows, or a 1/KS share of its K (KS is the launch's choice: more shares
// when the tiles alone are too few to keep every SM streaming; blocks hold GEMV_WARPS / KS
// tiles). Its weights arrive by cp.async in stages of GEMV_TILE rows x GEMV_STAGE_K, two rows'
// whole 256 bytes per instruction, into a ring of GEMV_STAGES stages in shared memory: loads
// straight into MMA fragments take 64 bytes from each of 8 rows per instruction, and that
// pattern streamed slower than whole 256-byte runs (docs/perf-log.md, v6). It multiplies on
// tensor cores (fragments by ldmatrix) with the up to MAX_DECODE_ROWS token rows of decode_k as
// the MMA's columns, so K rows cost the same instructions as one. The k order, the MMA chains and the sum over shares are
// fixed and an output column depends on no other column: decode_k is bit-identical to K
// decodes.
#include "gate.cuh"


// This warp's tile in a launch's run of blocks from block 0: GEMV_WARPS / ks tiles of ks warps
// each.
__device__ __forceinline__ int gemv_tile_index(int block, int ks) {
    return block * (GEMV_WARPS / ks) + (threadIdx.x >> 5) / ks;
}

struct NoWait {
    __device__ void operator()() const {}
};

// The warps' rings, the GEMV kernels' dynamic shared memory.
constexpr int GEMV_RING_BYTES = GEMV_WARPS * GEMV_STAGES * GEMV_TILE * GEMV_STAGE_K * 2;

// The shares' partial sums [G][GEMV_WARPS][32]: one array for every gemv_tile of a G in a
// kernel (front_end_gemv's two would otherwise take two, past the static limit at G = 8).
template <int G>
__device__ __forceinline__ float4 (*gemv_part())[GEMV_WARPS][32] {
    __shared__ float4 part[G][GEMV_WARPS][32];
    return part;
}

// W[n0 : n0+16, :K] x[:M, :K]^T for this warp's tile, M <= 8 G token rows in G column groups
// of 8 (the MMA's N); true in the warp that then holds the sums in out[gi]: rows n0+g and
// n0+g+8 at token columns 8 gi + 2t and + 1 (lane = 4g + t). Every warp of the block must call
// it (it synchronises the block). Share j of ks takes stages j, j+ks, ...; dimensions past K
// are zero-filled, rows past N read row N-1 and are never stored. A token row's sums take the
// same MMAs in the same order for any G and M, so a row's bits do not depend on the rows
// beside it. COHERENT reads x through L2 only: x that other blocks of the launch wrote;
// ready() runs in every thread after the first stages' weight copies are issued and before
// any x is read, so a block whose x is still being written waits with its weights in flight.
template <int G, bool COHERENT = false, typename Ready = NoWait>
__device__ __forceinline__ bool gemv_tile(const bf16* __restrict__ W, int N, int K,
                                          const bf16* __restrict__ x, int M, int ldx, int n0,
                                          int ks, float (&out)[G][4], Ready ready = Ready()) {
    extern __shared__ uint4 stages[];  // [GEMV_WARPS][GEMV_STAGES][GEMV_TILE][GEMV_STAGE_K / 8]
    float4 (*part)[GEMV_WARPS][32] = gemv_part<G>();
    constexpr int RUNS = GEMV_STAGE_K / 8, SV = GEMV_TILE * RUNS;  // 16-byte runs a row, a stage
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int share = warp % ks, steps = (K + GEMV_STAGE_K - 1) / GEMV_STAGE_K;
    const int n = n0 < N ? (steps - share + ks - 1) / ks : 0;  // this warp's stages
    const int last = max(N - 1, 0);
    uint4* ring = stages + warp * GEMV_STAGES * SV;
    // stage j into slot u; run c of row r lands at c ^ (r & 7), so that ldmatrix's eight
    // row reads of one run column fall in eight different banks
    auto fill = [&](int j, int u) {
        const int c = lane % RUNS, k = (share + ks * j) * GEMV_STAGE_K + 8 * c;
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
    ready();
    const int mi = lane >> 3, row = (mi & 1) * 8 + (lane & 7);  // ldmatrix: this lane's row
    float c[G][2][4] = {};  // even and odd k16 blocks: two shorter chains of dependent MMAs
    // token row m at k0 + 16q + 8h + 2t, +1: a column group's B fragments, from xr = row m's
    const bf16* x0 = x + (u64)min(g, M - 1) * ldx + 2 * t;  // column group 0's row
    auto load_b = [&](unsigned (&b)[GEMV_STAGE_K / 8], const bf16* xr, bool valid, int k0) {
#pragma unroll
        for (int i = 0; i < GEMV_STAGE_K / 8; ++i) {
            const int k = k0 + 8 * i + 2 * t;
            const unsigned* p = reinterpret_cast<const unsigned*>(xr + k0 + 8 * i);
            b[i] = valid && k < K ? (COHERENT ? __ldcg(p) : __ldg(p)) : 0u;
        }
    };
    for (int j = 0; j < n; ++j) {
        const int k0 = (share + ks * j) * GEMV_STAGE_K;
        unsigned b[GEMV_STAGE_K / 8];
        load_b(b, x0, g < M, k0);  // the first group's x loads overlap the wait for the weights
        cp_wait<GEMV_STAGES - 1>();
        __syncwarp();
        const uint4* st = ring + (j % GEMV_STAGES) * SV + row * RUNS;
        if constexpr (G == 1) {
#pragma unroll
            for (int q = 0; q < GEMV_STAGE_K / 16; ++q) {
                unsigned a[4];
                ldmatrix_x4(a, st + ((2 * q + (mi >> 1)) ^ (row & 7)));
                mma_bf16(c[0][q & 1], a, b + 2 * q);
            }
        } else {
            // the stage's weight fragments once, then group by group, the next group's x in
            // flight while this one's MMAs run (the same MMAs, in the same order, as G = 1)
            unsigned a[GEMV_STAGE_K / 16][4];
#pragma unroll
            for (int q = 0; q < GEMV_STAGE_K / 16; ++q)
                ldmatrix_x4(a[q], st + ((2 * q + (mi >> 1)) ^ (row & 7)));
#pragma unroll
            for (int gi = 0; gi < G; ++gi) {
                if (8 * gi >= M) break;
                unsigned nb[GEMV_STAGE_K / 8];
                const int m = 8 * (gi + 1) + g;
                if (gi + 1 < G && 8 * (gi + 1) < M)
                    load_b(nb, x + (u64)min(m, M - 1) * ldx + 2 * t, m < M, k0);
#pragma unroll
                for (int q = 0; q < GEMV_STAGE_K / 16; ++q) mma_bf16(c[gi][q & 1], a[q], b + 2 * q);
#pragma unroll
                for (int i = 0; i < GEMV_STAGE_K / 8; ++i) b[i] = nb[i];
            }
        }
        __syncwarp();  // the whole warp is done with this slot before it is refilled
        if (j + GEMV_STAGES < n) fill(j + GEMV_STAGES, j % GEMV_STAGES);
        cp_commit();
    }
#pragma unroll
    for (int gi = 0; gi < G; ++gi)
        part[gi][warp][lane] = make_float4(c[gi][0][0] + c[gi][1][0], c[gi][0][1] + c[gi][1][1],
                                           c[gi][0][2] + c[gi][1][2], c[gi][0][3] + c[gi][1][3]);
    __syncthreads();
    if (share != 0 || n0 >= N) return false;
#pragma unroll
    for (int gi = 0; gi < G; ++gi) {
        float4 s = part[gi][warp][lane];
        for (int w = 1; w < ks; ++w) {
            const float4 p = part[gi][warp + w][lane];
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

// y[m, n] = bf16(W[n] . x[m]): the o_proj of decode.
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
// might not have started. The launch is sized to fit the SMs at once (the caller picks ks so),
// so the gate blocks are resident from the start, wait with their first f_b / g_b weights in
// flight, and compute while the q|k|v tiles still stream: the gates cost no launch and no wave
// of their own. The last gate block to finish (sync[1] counts them) zeroes both counters for
// the next call.
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
            const bf16 r = f2bf(v);
            if (n < 3 * qkv) {
                qkv_proj[(u64)m * 3 * qkv + n] = r;
                qkv_parts[((u64)(n / qkv) * P + m) * qkv + n % qkv] = r;
            } else {
                gate_in[(u64)m * ldg + n - 3 * qkv] = r;  // what the gate blocks read
            }
        });
        if (is_early) {
            __threadfence();
            __syncwarp();
            if ((threadIdx.x & 31) == 0) atomicAdd(&sync[0], 1);
        }
        return;
    }
    auto early_done = [&]() {
        if (threadIdx.x == 0) {
            while (*reinterpret_cast<volatile int*>(&sync[0]) < early) __nanosleep(64);
            __threadfence();
        }
        __syncthreads();
    };
    const int gb = blockIdx.x - proj_blocks, gate_blocks = gridDim.x - proj_blocks;
    const bf16* f_a = gate_in;
    if (gb == gate_blocks - 1) {
        early_done();
        for (int i = threadIdx.x; i < M * H; i += blockDim.x)
            beta[i] = sigmoidf_(bf2f(__ldcg(f_a + (u64)(i / H) * ldg + 2 * R + i % H)));
    } else {
        // qkv % GEMV_TILE == 0: a tile is all f or all g
        const int n0 = gemv_tile_index(gb, ks_gate) * GEMV_TILE;
        const bool is_f = n0 < qkv;
        const int c0 = is_f ? n0 : n0 - qkv, rows = n0 < 2 * qkv ? qkv : 0;  // 0: a spare tile
        float out[G][4];
        if (gemv_tile<G, true>(is_f ? f_b : g_b, rows, R, is_f ? f_a : f_a + R, M, ldg, c0,
                               ks_gate, out, early_done))  // f_b / g_b load while tiles finish
            tile_outputs(out, c0, qkv, M, [&](int c, int m, float v) {
                const bf16 r = f2bf(v);
                if (is_f) {
                    g_raw[(u64)m * qkv + c] = r;
                    gate[(u64)m * qkv + c] = kda_gate_value(bf2f(r) + dt_bias[c],
                                                            expf(a_log[c / D]), lower_bound, bounded);
                } else {
                    out_gate[(u64)m * qkv + c] = r;
                }
            });
    }
    __syncthreads();
    if (threadIdx.x == 0 && atomicAdd(&sync[1], 1) == gate_blocks - 1) sync[0] = sync[1] = 0;
}

// Each GEMV twice: for decode and decode_k (up to 8 token rows, one column group: the most
// blocks an SM) and for batches (up to 8 GEMV_BATCH_GROUPS rows: every weight read once for
// them all; one block an SM, whose 8 warps' two stages in flight keep the SM streaming, for
// the accumulators' registers). Their dynamic shared memory (the rings) is exported for the
// CUDA backend.
#define GEMV_ENTRIES(SUFFIX, G, BLOCKS)                                                          \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, BLOCKS)                       \
    dense_gemv_bf16##SUFFIX(const bf16* W, const bf16* x, bf16* y, int N, int K, int M, int ldx, \
                            int ldy, int ks) {                                                  \
        dense_gemv<G>(W, x, y, N, K, M, ldx, ldy, ks);                                           \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, BLOCKS) front_end_gemv##SUFFIX( \
        const bf16* W, const bf16* x, bf16* gate_in, bf16* qkv_parts, bf16* qkv_proj,           \
        const bf16* f_b, const bf16* g_b, const float* a_log, const float* dt_bias, bf16* g_raw, \
        bf16* out_gate, float* gate, float* beta, int* sync, int N, int K, int M, int P, int ldg, \
        int H, int D, int R, float lower_bound, int bounded, int ks, int ks_early, int ks_gate,  \
        int early_blocks, int proj_blocks) {                                                    \
        front_end<G>(W, x, gate_in, qkv_parts, qkv_proj, f_b, g_b, a_log, dt_bias, g_raw,       \
                     out_gate, gate, beta, sync, N, K, M, P, ldg, H, D, R, lower_bound, bounded, \
                     ks, ks_early, ks_gate, early_blocks, proj_blocks);                         \
    }                                                                                           \
    extern "C" {                                                                                \
    __constant__ int dense_gemv_bf16##SUFFIX##_smem = GEMV_RING_BYTES;                           \
    __constant__ int front_end_gemv##SUFFIX##_smem = GEMV_RING_BYTES;                            \
    }
GEMV_ENTRIES(, 1, GEMV_BLOCKS_PER_SM)
GEMV_ENTRIES(_batch, GEMV_BATCH_GROUPS, GEMV_BATCH_BLOCKS_PER_SM)
