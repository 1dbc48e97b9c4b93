// Decode projections are pure weight streaming (bf16, read once per token). A warp owns a tile
// of TILE output rows, or a 1/KS share of its K (KS is the launch's choice: more shares when
// the tiles alone keep too few loads in flight, or to put longer runs of each weight row in
// flight at once, which DRAM serves faster; blocks hold WARPS / KS tiles). It multiplies on
// tensor cores with the up to MAX_ROWS token rows of decode_k as the MMA's columns, so K rows
// cost the same instructions as one (scalar FMAs made K = 4 cost 1.7x one row), and streams
// its weights through a ring of U loads in flight that it refills as each MMA consumes one.
// The k order, the MMA chains and the sum over shares are fixed and an output column depends
// on no other column: decode_k is bit-identical to K decodes.
#include "gate.cuh"

#define MAX_ROWS 8  // token rows: the MMA's N
#define TILE 16     // output rows a tile: the MMA's M
#define WARPS 8     // warps a block
#define U 8         // 32-wide k steps a lane has in flight (2 x 16 bytes of weights each)

// This warp's tile in a launch's run of blocks from block 0: WARPS / ks tiles of ks warps each.
__device__ __forceinline__ int gemv_tile_index(int block, int ks) {
    return block * (WARPS / ks) + (threadIdx.x >> 5) / ks;
}

struct NoWait {
    __device__ void operator()() const {}
};

// W[n0 : n0+16, :K] x[:M, :K]^T for this warp's tile; true in the warp that then holds the sums
// in out: rows n0+g and n0+g+8 at token columns 2t and 2t+1 (lane = 4g + t). Every warp of the
// block must call it (it synchronises the block). A k step covers 32 dimensions: lane t loads
// 16 bytes at k0 + 8t of rows g and g+8 and of token row g, whose halves feed two MMAs. That
// permutes k identically in W and x, which a dot product allows, and keeps every weight load a
// whole 16-byte vector. Share j of ks takes steps j, j+ks, ... Rows past N read row N-1 and are
// never stored. COHERENT reads x through L2 only: x that other blocks of the launch wrote;
// ready() runs in every thread after the first U steps' weight loads are issued and before any
// x is read, so a block whose x is still being written waits with its weights in flight.
template <bool COHERENT = false, typename Ready = NoWait>
__device__ __forceinline__ bool gemv_tile(const bf16* __restrict__ W, int N, int K,
                                          const bf16* __restrict__ x, int M, int ldx, int n0,
                                          int ks, float out[4], Ready ready = Ready()) {
    __shared__ float4 part[WARPS][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int share = warp % ks, steps = (K + 31) / 32, K8 = K / 8;
    const int n = n0 < N ? (steps - share + ks - 1) / ks : 0;  // this warp's steps
    const int last = max(N - 1, 0);
    const uint4* wa = reinterpret_cast<const uint4*>(W + (u64)min(n0 + g, last) * K) + t;
    const uint4* wb = reinterpret_cast<const uint4*>(W + (u64)min(n0 + g + 8, last) * K) + t;
    const uint4* xr = reinterpret_cast<const uint4*>(x + (u64)min(g, M - 1) * ldx) + t;
    uint4 va[U], vb[U], vx[U];
    // step j of this warp into ring slot u (zeros past the end): its weights, its x, or both
    auto load = [&](int j, int u, bool weights, bool xs) {
        const int i = 4 * (share + ks * j);  // this lane's vector: i + t
        if (weights) va[u] = vb[u] = make_uint4(0u, 0u, 0u, 0u);
        if (xs) vx[u] = make_uint4(0u, 0u, 0u, 0u);
        if (j < n && i + t < K8) {
            if (weights) {
                va[u] = ld_stream(wa + i);
                vb[u] = ld_stream(wb + i);
            }
            if (xs && g < M) vx[u] = COHERENT ? __ldcg(xr + i) : __ldg(xr + i);
        }
    };
#pragma unroll
    for (int u = 0; u < U; ++u) load(u, u, true, false);
    ready();
#pragma unroll
    for (int u = 0; u < U; ++u) load(u, u, false, true);
    float c[2][4] = {};  // even and odd slots: two shorter chains of dependent MMAs
    for (int j0 = 0; j0 < n; j0 += U) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const unsigned a0[4] = {va[u].x, vb[u].x, va[u].y, vb[u].y}, b0[2] = {vx[u].x, vx[u].y};
            const unsigned a1[4] = {va[u].z, vb[u].z, va[u].w, vb[u].w}, b1[2] = {vx[u].z, vx[u].w};
            mma_bf16(c[u & 1], a0, b0);
            mma_bf16(c[u & 1], a1, b1);
            load(j0 + u + U, u, true, true);
        }
    }
    part[warp][lane] = make_float4(c[0][0] + c[1][0], c[0][1] + c[1][1], c[0][2] + c[1][2],
                                   c[0][3] + c[1][3]);
    __syncthreads();
    if (share != 0 || n0 >= N) return false;
    float4 s = part[warp][lane];
    for (int w = 1; w < ks; ++w) {
        const float4 p = part[warp + w][lane];
        s.x += p.x, s.y += p.y, s.z += p.z, s.w += p.w;
    }
    out[0] = s.x, out[1] = s.y, out[2] = s.z, out[3] = s.w;
    return true;
}

// Calls put(n, m, value) for each of this lane's outputs that exists (n < N, m < M).
template <typename F>
__device__ __forceinline__ void tile_outputs(const float out[4], int n0, int N, int M, F put) {
    const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int n = n0 + g + 8 * (i >> 1), m = 2 * t + (i & 1);
        if (n < N && m < M) put(n, m, out[i]);
    }
}

// y[m, n] = bf16(W[n] . x[m]): the o_proj of decode.
extern "C" __global__ void __launch_bounds__(WARPS * 32, 2)
dense_gemv_bf16(const bf16* __restrict__ W, const bf16* __restrict__ x, bf16* __restrict__ y,
                int N, int K, int M, int ldx, int ldy, int ks) {
    const int n0 = gemv_tile_index(blockIdx.x, ks) * TILE;
    float out[4];
    if (!gemv_tile(W, N, K, x, M, ldx, n0, ks, out)) return;
    tile_outputs(out, n0, N, M, [&](int n, int m, float v) { y[(u64)m * ldy + n] = f2bf(v); });
}

// Decode's whole front end in one launch: the packed projection q|k|v|f_a|g_a|b (rows to proj
// [M, ldp], q|k|v also to qkv_proj [M, 3*qkv] and qkv_parts [3, M, qkv]), then from f_a and g_a
// the low-rank gates (g_raw with the forget gate computed from the rounded value; out_gate) and
// beta = sigmoid(b). The gates need rows that this launch produces, so the f_a|g_a|b tiles come
// first (the lowest blocks) and count themselves done in sync[0]; the gate blocks come last
// and wait for that count, so none waits on a block that might not have started. The last gate
// block to finish (sync[1] counts them) zeroes both counters for the next call. A gate block
// waits with its first f_b / g_b weights in flight. The gates thus cost no launch of their
// own: they run in the projection's last wave. (Starting them right after the f_a|g_a|b tiles
// measured slower: their waiting blocks held the SMs.)
extern "C" __global__ void __launch_bounds__(WARPS * 32)
front_end_gemv(const bf16* __restrict__ W, const bf16* __restrict__ x, bf16* __restrict__ proj,
               bf16* __restrict__ qkv_parts, bf16* __restrict__ qkv_proj,
               const bf16* __restrict__ f_b, const bf16* __restrict__ g_b,
               const float* __restrict__ a_log, const float* __restrict__ dt_bias,
               bf16* __restrict__ g_raw, bf16* __restrict__ out_gate, float* __restrict__ gate,
               float* __restrict__ beta, int* __restrict__ sync, int N, int K, int M, int ldp,
               int H, int D, int R, float lower_bound, int bounded, int ks, int ks_gate,
               int proj_blocks) {
    const int qkv = H * D, tiles = (N + TILE - 1) / TILE, first = 3 * qkv / TILE;
    const int early = tiles - first;  // the f_a|g_a|b tiles, run first
    if (blockIdx.x < proj_blocks) {
        const int i = gemv_tile_index(blockIdx.x, ks);  // past the last tile: no rows (N)
        const int n0 = i >= tiles ? N : (i < early ? first + i : i - early) * TILE;
        float out[4];
        if (!gemv_tile(W, N, K, x, M, K, n0, ks, out)) return;
        tile_outputs(out, n0, N, M, [&](int n, int m, float v) {
            const bf16 r = f2bf(v);
            proj[(u64)m * ldp + n] = r;
            if (n < 3 * qkv) {
                qkv_proj[(u64)m * 3 * qkv + n] = r;
                qkv_parts[((u64)(n / qkv) * M + m) * qkv + n % qkv] = r;
            }
        });
        if (i < early) {
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
    const bf16* f_a = proj + 3 * qkv;
    if (gb == gate_blocks - 1) {
        early_done();
        for (int i = threadIdx.x; i < M * H; i += blockDim.x)
            beta[i] = sigmoidf_(bf2f(__ldcg(f_a + (u64)(i / H) * ldp + 2 * R + i % H)));
    } else {
        const int n0 = gemv_tile_index(gb, ks_gate) * TILE;  // qkv % TILE == 0: all f or all g
        const bool is_f = n0 < qkv;
        const int c0 = is_f ? n0 : n0 - qkv, rows = n0 < 2 * qkv ? qkv : 0;  // 0: a spare tile
        float out[4];
        if (gemv_tile<true>(is_f ? f_b : g_b, rows, R, is_f ? f_a : f_a + R, M, ldp, c0, ks_gate,
                            out, early_done))  // f_b / g_b load while the tiles finish
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
