// The batch GEMVs on Hopper's asynchronous units (sm_90a; other builds trap, and the host
// launches them only there, from WG_FROM_ROWS token rows: kdarun/kernels.py). The slab GEMVs
// (gemv.cu) move every stage by cp.async from every thread and run a chain of dependent
// mma.sync a warp: at 256 token rows they read weights at 0.3-0.6 TB/s (docs/perf-log.md, v45).
// Here one thread copies a stage by TMA tensor copies (a 64 x 64 box an instruction, 128-byte
// swizzle, zero fill past the matrices' ends) into a ring of WG_SLOTS stages, counted on the
// slot's mbarrier, and a warpgroup multiplies 64 weight rows by 64 token rows by warpgroup MMAs
// with both operands read from shared memory. The k order is decode's (gemv_tile): stages of
// GEMV_STAGE_K, share j of ks taking a run of them (share_first); even and odd k16 blocks in two
// chains, each from zero at a share's start; a share's c0 + c1 added to the running total in
// share order. So a row's bits are decode's (tests/gpu/test_kernels_gpu.py checks them at
// shapes that end inside a box).
#include "front_end.cuh"
#include "sm90.cuh"

constexpr int WG_BOX = WG_TILE * WG_TILE * 2;    // bytes of one box: WG_TILE rows of WG_TILE k
constexpr int WG_HALVES = GEMV_STAGE_K / WG_TILE;  // boxes along k a stage and operand
constexpr int WG_STAGE = 2 * WG_HALVES * WG_BOX;   // a stage: weights, then x
constexpr int WG_REDUCE_LOADS = 4;                 // shares dense_gemv_wg's reducer loads at once
static_assert(GEMV_STAGE_K % WG_TILE == 0, "whole boxes a stage");
static_assert(WG_TILE * 2 == 128 && WG_THREADS == WARPGROUP,
              "a box row is the 128-byte swizzle's; a block is the m64 MMA's warpgroup");

// W[n0 : n0 + 64, :K] x[m0 : m0 + 64, :K]^T over K shares [s0, s1) of ks: fold(share, p) takes
// each share's 32 sums p of this thread in share order: rows n0 + 16 w + g, + 8 (warp w, lane
// 4 g + t), token rows m0 + 8 i + 2 t, + 1 for i < 8 (wg_outputs). The block is one warpgroup;
// every thread must call it. prior_grid_sync, then ready(), run in every thread after the
// first stages' weight copies are issued and before any x copy: x that blocks of this launch
// write (the gates' f_a, g_a) is read by the TMA once ready() saw it written.
template <typename Fold, typename Ready = NoWait>
__device__ __forceinline__ void wg_shares(const TensorMap& wmap, const TensorMap& xmap, int n0,
                                          int m0, int K, int ks, int s0, int s1, Fold fold,
                                          Ready ready = Ready()) {
#if __CUDA_ARCH__ >= 900
    extern __shared__ unsigned char raw[];
    unsigned char* ring = (unsigned char*)(((u64)raw + 1023) & ~(u64)1023);  // swizzle atoms
    __shared__ u64 full[WG_SLOTS];
    const int tid = threadIdx.x;
    const int steps = (K + GEMV_STAGE_K - 1) / GEMV_STAGE_K;
    // the shares' stages: share j's run is k-blocks share_first(j) .. share_first(j + 1) - 1
    const int u0 = share_first(s0, steps, ks), u1 = share_first(s1, steps, ks);
    auto copy = [&](int u, bool w, bool x) {
        const int slot = (u - u0) % WG_SLOTS;
        unsigned char* st = ring + slot * WG_STAGE;
        const int k = u * GEMV_STAGE_K;
        for (int h = 0; h < WG_HALVES; ++h) {
            const int kh = k + WG_TILE * h;
            if (w) tma_2d(st + h * WG_BOX, wmap, &full[slot], kh, n0);
            if (x) tma_2d(st + (WG_HALVES + h) * WG_BOX, xmap, &full[slot], kh, m0);
        }
    };
    const int first = u0 + min(WG_SLOTS, u1 - u0);
    if (tid == 0) {
        for (int s = 0; s < WG_SLOTS; ++s) mbar_init(&full[s], 1);
        mbar_init_fence();
        for (int u = u0; u < first; ++u) {
            mbar_expect(&full[u - u0], WG_STAGE);
            copy(u, true, false);
        }
    }
    prior_grid_sync();  // x may be the previous kernel's output
    ready();
    if (tid == 0) {
        asm volatile("fence.proxy.async.global;" ::: "memory");  // x written, then the TMA reads
        for (int u = u0; u < first; ++u) copy(u, false, true);
    }
    __syncthreads();  // the barriers are initialised
    float c[2][32] = {};
    int u = u0, next = first;  // u: the stage read next; next: the stage copied next
    for (int share = s0; share < s1; ++share) {
        const int n_st = share_first(share + 1, steps, ks) - share_first(share, steps, ks);
        for (int i = 0; i < n_st; ++i, ++u) {
            const int slot = (u - u0) % WG_SLOTS;
            mbar_wait(&full[slot], ((u - u0) / WG_SLOTS) & 1);
            const unsigned char* st = ring + slot * WG_STAGE;
            wgmma_fence();
#pragma unroll
            for (int k16 = 0; k16 < GEMV_STAGE_K / 16; ++k16) {
                const int off = (k16 / 4) * WG_BOX + (k16 % 4) * 32;
                wgmma_ss64(c[k16 & 1], sw128_desc(st + off),
                           sw128_desc(st + WG_HALVES * WG_BOX + off), i > 0 || k16 >= 2);
            }
            wgmma_commit();
            wgmma_wait<1>();
            // every warp is done with the stages before u: their slots refill
            asm volatile("bar.sync 1, %0;" ::"n"(WG_THREADS) : "memory");
            if (tid == 0)
                for (; next < u1 && next < u + WG_SLOTS; ++next) {
                    mbar_expect(&full[(next - u0) % WG_SLOTS], WG_STAGE);
                    copy(next, true, true);
                }
        }
        wgmma_wait<0>();
        float p[32];
#pragma unroll
        for (int i = 0; i < 32; ++i) p[i] = c[0][i] + c[1][i];
        fold(share, p);
    }
#else
    __trap();
#endif
}

// All ks shares of the tile, summed into tot in share order as decode sums them.
template <typename Ready = NoWait>
__device__ __forceinline__ void wg_tile(const TensorMap& wmap, const TensorMap& xmap, int n0,
                                        int m0, int K, int ks, float (&tot)[32],
                                        Ready ready = Ready()) {
    wg_shares(wmap, xmap, n0, m0, K, ks, 0, ks, [&](int share, const float (&p)[32]) {
#pragma unroll
        for (int i = 0; i < 32; ++i) tot[i] = share == 0 ? p[i] : tot[i] + p[i];
    }, ready);
}

// Calls put(n, m, value) for each of this thread's wg_tile sums that exists (n < N, m < M).
template <typename F>
__device__ __forceinline__ void wg_outputs(const float (&tot)[32], int n0, int m0, int N, int M,
                                           F put) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < 32; ++i) {
        const int n = n0 + 16 * w + g + 8 * ((i >> 1) & 1), m = m0 + 8 * (i >> 2) + 2 * t + (i & 1);
        if (n < N && m < M) put(n, m, tot[i]);
    }
}

// y[m, n] = bf16(W[n] . x[m]) over M token rows: a block a 64-row weight tile (blockIdx.y) and
// 64 token rows (blockIdx.x: a weight tile's slabs neighbours in launch order, so all but the
// first read its weights from L2). wmap / xmap: W [N, K] and x [M, K]. o_proj has few tiles and
// a long K (glm-5.3-flash: 64 tiles of K = 8192 against the SMs' 264 blocks), so gridDim.z > 1
// splits each tile's ks shares over as many blocks: each writes its shares' sums to part
// [tiles * slabs][ks][8][WG_THREADS] float4, and the last of a tile's blocks to finish (count
// [tiles * slabs], zero between calls) adds them in share order, decode's bits.
extern "C" __global__ void __launch_bounds__(WG_THREADS, WG_BLOCKS_PER_SM)
dense_gemv_wg(const __grid_constant__ TensorMap wmap, const __grid_constant__ TensorMap xmap,
              bf16* y, int N, int K, int M, int ldy, int ks, float4* part, int* count) {
    const int n0 = blockIdx.y * WG_TILE, m0 = blockIdx.x * WG_TILE, tid = threadIdx.x;
    float tot[32];
    auto store = [&]() {
        wg_outputs(tot, n0, m0, N, M, [&](int n, int m, float v) { y[(u64)m * ldy + n] = f2bf(v); });
    };
    if (gridDim.z == 1) {
        wg_tile(wmap, xmap, n0, m0, K, ks, tot);
        store();
        return;
    }
    const int tile = blockIdx.y * gridDim.x + blockIdx.x, per = ks / gridDim.z;
    float4* mine = part + (u64)tile * ks * 8 * WG_THREADS + tid;  // share s, j: [(8 s + j) * 128]
    wg_shares(wmap, xmap, n0, m0, K, ks, blockIdx.z * per, (blockIdx.z + 1) * per,
              [&](int share, const float (&p)[32]) {
#pragma unroll
        for (int j = 0; j < 8; ++j)
            mine[(8 * share + j) * WG_THREADS] = make_float4(p[4 * j], p[4 * j + 1], p[4 * j + 2],
                                                             p[4 * j + 3]);
    });
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (tid == 0) last = atomicAdd(&count[tile], 1) == (int)gridDim.z - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();  // the other blocks' sums, seen after their count
    // the sums last on the launch's path: WG_REDUCE_LOADS shares' loads in flight at once
    // (the accumulators are free by now), not one share's 8 at a time
    for (int s0 = 0; s0 < ks; s0 += WG_REDUCE_LOADS) {
        float4 v[WG_REDUCE_LOADS][8];
#pragma unroll
        for (int a = 0; a < WG_REDUCE_LOADS; ++a)
#pragma unroll
            for (int j = 0; j < 8; ++j)
                if (s0 + a < ks) v[a][j] = __ldcg(mine + (8 * (s0 + a) + j) * WG_THREADS);
#pragma unroll
        for (int a = 0; a < WG_REDUCE_LOADS; ++a)
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                if (s0 + a >= ks) continue;
                const float s[4] = {v[a][j].x, v[a][j].y, v[a][j].z, v[a][j].w};
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    tot[4 * j + i] = s0 + a == 0 ? s[i] : tot[4 * j + i] + s[i];
            }
    }
    store();
    if (tid == 0) count[tile] = 0;
}

// front_end_slab (gemv.cu) on wg_tile: over M token rows, a block a 64-row tile of the
// f_a|g_a|b rows (early_blocks, run first; each counts itself done in its slab's sync[0]), of
// q|k|v's (up to proj_blocks) or of f_b|g_b's, which wait for the slab's early blocks and read
// f_a and g_a from gate_in by their own maps, then beta's, last; 64 token rows blockIdx.x.. of
// them (each slab its own sync pair). The shares ks, ks_early and ks_gate are front_end's, so
// every output has its bits. Maps: W [N, K] (the packed projection), x [M, K], f_b and g_b
// [qkv, R], f_a and g_a [M, R] (gate_in's columns 0 and R, row stride ldg).
extern "C" __global__ void __launch_bounds__(WG_THREADS, WG_BLOCKS_PER_SM) front_end_wg(
    const __grid_constant__ TensorMap wmap, const __grid_constant__ TensorMap xmap,
    const __grid_constant__ TensorMap fbmap, const __grid_constant__ TensorMap gbmap,
    const __grid_constant__ TensorMap famap, const __grid_constant__ TensorMap gamap,
    bf16* gate_in, bf16* qkv_parts, bf16* qkv_proj, const float* a_log, const float* dt_bias,
    bf16* g_raw, bf16* out_gate, float* gate, float* beta, int* sync, int N, int K, int M, int P,
    int ldg, int H, int D, int R, float lower_bound, int bounded, int ks, int ks_early,
    int ks_gate, int early_blocks, int proj_blocks) {
    const int qkv = H * D, m0 = blockIdx.x * WG_TILE, blk = blockIdx.y;
    sync += 2 * blockIdx.x;
    float tot[32];
    if (blk < proj_blocks) {
        const bool is_early = blk < early_blocks;
        const int n0 = is_early ? 3 * qkv + blk * WG_TILE : (blk - early_blocks) * WG_TILE;
        const int n_end = is_early ? N : 3 * qkv;  // rows past it: another region's
        wg_tile(wmap, xmap, n0, m0, K, is_early ? ks_early : ks, tot);
        wg_outputs(tot, n0, m0, n_end, M, [&](int n, int m, float v) {
            proj_store(qkv_proj, qkv_parts, gate_in, qkv, P, ldg, n, m, v);
        });
        if (is_early) early_done(sync);
        return;
    }
    const int gb = blk - proj_blocks, gate_blocks = gridDim.y - proj_blocks;
    if (gb == gate_blocks - 1) {
        beta_block(sync, early_blocks, gate_in + (u64)m0 * ldg, beta + (u64)m0 * H,
                   min(M - m0, WG_TILE), H, ldg, R);
    } else {
        const int n0 = gb * WG_TILE;  // qkv % WG_TILE == 0: a tile is all f or all g
        const bool is_f = n0 < qkv;
        const int c0 = is_f ? n0 : n0 - qkv;
        wg_tile(is_f ? fbmap : gbmap, is_f ? famap : gamap, c0, m0, R, ks_gate, tot,
                [&]() { wait_early(sync, early_blocks); });  // f_b / g_b load meanwhile
        wg_outputs(tot, c0, m0, qkv, M, [&](int c, int m, float v) {
            gate_store(is_f, g_raw, gate, out_gate, a_log, dt_bias, qkv, D, lower_bound, bounded,
                       c, m, v);
        });
    }
    gates_done(sync, gate_blocks);
}

extern "C" {
__constant__ int dense_gemv_wg_smem = WG_SLOTS * WG_STAGE + 1024;  // + the atoms' alignment
__constant__ int front_end_wg_smem = WG_SLOTS * WG_STAGE + 1024;
}
