// Decode tokens of one sequence, fused: conv (+SiLU, +L2 of q and k), the delta-rule step and
// the gated RMSNorm, for nrows tokens in order (1 for decode, K for decode_k's verify). split
// blocks share a head, each owning D/split rows of its state [Dv, Dk] fp32 (the only large
// traffic), so the state streams through H x split blocks instead of H; every block computes
// the head's q, k and decay itself (they are small). K tokens cost one launch and one read and
// write of the state instead of K; each token runs the same code, so K rows are bit-identical
// to K single-row calls. q, k, v enter the step as the bf16 values written to conv_out, so
// decode and the stage dumps see the same operands.
#include "norm.cuh"
#include "sm90.cuh"

// An entry of a device slot table as the kernels use it: itself where it is -1 (skip) or a slot
// of the pool, [0, nslots); -1 for anything else, recorded in the pool's fault words {seen,
// table (0 slots, 1 snapshot slots), entry, value} (the first seen wins) for
// KdaStatePool.check_faults. So a wrong entry touches nothing outside the pool: a row with one
// reads and writes no state, as a padding row; a snapshot with one is not stored.
// The recording is a call of its own: inlined, its cold path cost the batch kernel registers.
__device__ __noinline__ void record_fault(int* fault, int table, int entry, int s) {
    if (atomicCAS(fault, 0, 1) == 0) fault[1] = table, fault[2] = entry, fault[3] = s;
}
__device__ __forceinline__ int checked_slot(int s, int nslots, int* fault, int table, int entry) {
    if (s >= -1 && s < nslots) return s;
    record_fault(fault, table, entry, s);
    return -1;
}

#define ROWS_PER_WARP 8

// A lane's E = D/32 adjacent state values as one 16- or 8-byte access: a quarter (or half) of
// the load instructions, which otherwise queue up behind each other (the state is the kernel's
// only large traffic).
__device__ __forceinline__ void ldv(float (&v)[4], const float* p) {
    const float4 x = *reinterpret_cast<const float4*>(p);
    v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
}
__device__ __forceinline__ void ldv(float (&v)[2], const float* p) {
    const float2 x = *reinterpret_cast<const float2*>(p);
    v[0] = x.x, v[1] = x.y;
}
__device__ __forceinline__ void stv(float* p, const float (&v)[4]) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void stv(float* p, const float (&v)[2]) {
    *reinterpret_cast<float2*>(p) = make_float2(v[0], v[1]);
}

// One token of a channel's causal conv + SiLU, rounded to bf16 as prefill's conv rounds it
// before q's and k's L2 norm (so both paths norm the same kind of value): the input enters tap
// W-1, the W taps are weighted in order, and the taps roll by one for the next token
// (compile-time indices keep tap[] in registers).
__device__ __forceinline__ float conv_row(bf16 (&tap)[MAX_CONV_KERNEL],
                                          const float (&wt)[MAX_CONV_KERNEL], bf16 xin, int W) {
#pragma unroll
    for (int j = 0; j < MAX_CONV_KERNEL; ++j)
        if (j == W - 1) tap[j] = xin;
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < MAX_CONV_KERNEL; ++j)
        if (j < W) acc = __fmaf_rn(wt[j], bf2f(tap[j]), acc);
#pragma unroll
    for (int j = 0; j < MAX_CONV_KERNEL - 1; ++j)
        if (j < W - 1) tap[j] = tap[j + 1];
    return bf2f(f2bf(acc * sigmoidf_(acc)));
}

// A channel's carried taps and weights [W-1] / [W] from conv_state / conv_w (column c).
__device__ __forceinline__ void conv_load(bf16 (&tap)[MAX_CONV_KERNEL], float (&wt)[MAX_CONV_KERNEL],
                                          const bf16* conv_state, const float* __restrict__ conv_w, int c,
                                          int conv_dim, int W) {
#pragma unroll
    for (int j = 0; j < MAX_CONV_KERNEL - 1; ++j) {
        if (j >= W - 1) break;
        tap[j] = __ldcg(conv_state + (u64)j * conv_dim + c);  // read before prior_grid_sync
    }
#pragma unroll
    for (int j = 0; j < MAX_CONV_KERNEL; ++j) {
        if (j >= W) break;
        wt[j] = conv_w[(u64)j * conv_dim + c];
    }
}

// Its taps [W-1] back to a conv state (the carried one, or a snapshot's).
__device__ __forceinline__ void conv_store(bf16* conv_state, const bf16 (&tap)[MAX_CONV_KERNEL],
                                           int c, int conv_dim, int W) {
#pragma unroll
    for (int j = 0; j < MAX_CONV_KERNEL - 1; ++j)
        if (j < W - 1) conv_state[(u64)j * conv_dim + c] = tap[j];
}

// A state row lives in a group of L = D / ROW_E adjacent lanes, ROW_E of its columns a lane in
// runs of 4: lane li of the group holds columns 4 L c + 4 li .. + 3 of run c, so that the
// group's run c is 4 L contiguous words (conflict-free in shared memory, whole sectors in
// global memory). A warp steps 32 / L rows at once, and a row's sums take log2(L) shuffles
// where a warp a row took five: a sixth of the shuffles, a third of the instructions a row.
constexpr int ROW_E = 8;
template <int D>
struct RowLanes {
    static constexpr int L = D / ROW_E, P = 32 / L;  // lanes a row, rows a warp at once
};
// L2: through L2 only (__ldcg), for the state read before prior_grid_sync.
template <int D, bool L2 = false>
__device__ __forceinline__ void ldrow(float (&v)[ROW_E], const float* row, int li) {
#pragma unroll
    for (int c = 0; c < ROW_E / 4; ++c) {
        const float4* at = reinterpret_cast<const float4*>(row + 4 * RowLanes<D>::L * c + 4 * li);
        const float4 x = L2 ? __ldcg(at) : *at;
        v[4 * c] = x.x, v[4 * c + 1] = x.y, v[4 * c + 2] = x.z, v[4 * c + 3] = x.w;
    }
}
template <int D>
__device__ __forceinline__ void strow(float* row, const float (&v)[ROW_E], int li) {
#pragma unroll
    for (int c = 0; c < ROW_E / 4; ++c)
        *reinterpret_cast<float4*>(row + 4 * RowLanes<D>::L * c + 4 * li) =
            make_float4(v[4 * c], v[4 * c + 1], v[4 * c + 2], v[4 * c + 3]);
}
template <int L>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int o = L / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// One state row's delta-rule step by its lane group (every lane of the warp must call it):
// decay, the row's k.S, its update, then its output q.S. Decode and the batch run this one code
// with the same lanes, so a row's bits do not depend on which kernel ran it.
template <int L>
__device__ __forceinline__ float delta_row(float (&s)[ROW_E], const float (&gv)[ROW_E],
                                           const float (&kv)[ROW_E], const float (&qv)[ROW_E],
                                           float b, float v) {
    float kS = 0.0f;
#pragma unroll
    for (int e = 0; e < ROW_E; ++e) {
        s[e] *= gv[e];
        kS = __fmaf_rn(s[e], kv[e], kS);
    }
    const float bres = b * (v - group_sum<L>(kS));
    float o = 0.0f;
#pragma unroll
    for (int e = 0; e < ROW_E; ++e) {
        s[e] = __fmaf_rn(bres, kv[e], s[e]);
        o = __fmaf_rn(s[e], qv[e], o);
    }
    return group_sum<L>(o);
}

// decode's one sequence, snapshot r at index r. SPLIT blocks share a head.

template <int D, int SPLIT>
__device__ __forceinline__ void decode_rows(
    const bf16* __restrict__ x, bf16* __restrict__ conv_state, const float* __restrict__ conv_w,
    bf16* __restrict__ conv_out, const float* __restrict__ gate, const float* __restrict__ beta,
    float* __restrict__ state, float* __restrict__ core, const bf16* __restrict__ out_gate,
    const float* __restrict__ o_norm_w, bf16* __restrict__ o_norm_out,
    float* __restrict__ snap_rec, bf16* __restrict__ snap_conv, int* __restrict__ sync,
    int nrows, int nsnap, int H, int W, float scale, float eps) {
    constexpr int E = D / 32, NW = 4 * D / 32;  // blockDim.x == 4 * D: q, k, v, gate roles
    constexpr int ROWS = D / SPLIT, RW = ROWS / ROWS_PER_WARP;  // this block's state rows, warps
    constexpr int L = RowLanes<D>::L, P = RowLanes<D>::P, PW = ROWS_PER_WARP / P;  // PW: steps
    static_assert(ROWS_PER_WARP % P == 0, "a warp's rows in whole steps");
    __shared__ __align__(16) float qs[D], ks[D], vs[D], gx[D], part[NW];
    __shared__ int last;
    const int h = blockIdx.x, slice = blockIdx.y, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int qkv = H * D, conv_dim = 3 * qkv;
    const int p = tid / D, d = tid % D;  // p: 0 q, 1 k, 2 v, 3 gate
    const int c = p * qkv + h * D + d;   // this thread's conv channel (p < 3)
    const bool mine_v = p == 2 && d / ROWS == slice;  // v channels: only this block's rows
    const bool owner = p < 2 ? slice == 0 : mine_v;   // writes this channel's conv outputs
    const int row0 = slice * ROWS + warp * ROWS_PER_WARP;  // this warp's first state row
    const int li = lane % L, rl = lane / L;                  // this lane in its row's group
    // The loads that depend on no earlier kernel of the call are issued first, before
    // prior_grid_sync, so the state rows' latency overlaps the front end's end and the conv:
    // this warp's rows of the state, then the taps of this thread's channel. Both stay in
    // registers for all nrows tokens and are written back once.
    float* S = state + (u64)h * D * D;
    float s[PW][ROW_E];  // rows row0 + P p + rl
    if (warp < RW)
#pragma unroll
        for (int p = 0; p < PW; ++p) ldrow<D, true>(s[p], S + (u64)(row0 + P * p + rl) * D, li);
    bf16 tap[MAX_CONV_KERNEL];
    float wt[MAX_CONV_KERNEL];
    if (p < 2 || mine_v) conv_load(tap, wt, conv_state, conv_w, c, conv_dim, W);
    prior_grid_sync();
    // What the gated RMSNorm reads besides the core: loaded now by every block (the last to
    // finish needs them), warp `row` for token row `row`, lane dims E lane.. (gated_rms's order).
    float og[E], nw[E];
    if (warp < nrows) {
        ldv(nw, o_norm_w + lane * E);
#pragma unroll
        for (int e = 0; e < E; ++e) og[e] = bf2f(out_gate[(u64)warp * qkv + h * D + lane * E + e]);
    }
    for (int row = 0; row < nrows; ++row) {
        // beta is needed only after the conv and its two barriers: its load goes first
        const float b = warp < RW ? beta[(u64)row * H + h] : 0.0f;
        float y = 0.0f;
        if (p < 2 || mine_v) {
            y = conv_row(tap, wt, x[(u64)row * conv_dim + c], W);
        } else if (p == 3) {
            gx[d] = expf(gate[(u64)row * qkv + h * D + d]);
        }
        if (p < 2) {  // a warp never straddles q/k/v: D % 32 == 0
            const float sq = warp_sum(y * y);
            if (lane == 0) part[warp] = sq;
        }
        __syncthreads();
        if (p < 2) {
            float ss = 0.0f;
            for (int i = 0; i < D / 32; ++i) ss += part[p * (D / 32) + i];
            y = y * (1.0f / sqrtf(ss + L2_NORM_EPS));
        }
        if (p < 2 || mine_v) {
            const bf16 r = f2bf(y);
            if (owner) conv_out[(u64)row * conv_dim + c] = r;
            (p == 0 ? qs : p == 1 ? ks : vs)[d] = bf2f(r);
        }
        __syncthreads();
        if (warp < RW) {
            float gv[ROW_E], kv[ROW_E], qv[ROW_E];  // this lane's columns, for all its rows
            ldrow<D>(gv, gx, li);
            ldrow<D>(kv, ks, li);
            ldrow<D>(qv, qs, li);
#pragma unroll
            for (int e = 0; e < ROW_E; ++e) qv[e] *= scale;
#pragma unroll
            for (int p = 0; p < PW; ++p) {
                const int j = row0 + P * p + rl;
                const float o = delta_row<L>(s[p], gv, kv, qv, b, vs[j]);
                if (li == 0) core[(u64)row * qkv + h * D + j] = o;
            }
            if (row < nsnap)  // the state after this row, for a partial accept
#pragma unroll
                for (int p = 0; p < PW; ++p)
                    strow<D>(snap_rec + ((u64)row * H + h) * D * D + (u64)(row0 + P * p + rl) * D,
                             s[p], li);
        }
        if (row < nsnap && owner) conv_store(snap_conv + (u64)row * (W - 1) * conv_dim, tap, c, conv_dim, W);
        __syncthreads();  // the next row overwrites q, k, v and the decay in shared memory
    }
    // The gated RMSNorm needs the head's D outputs from all SPLIT blocks: the last block to
    // finish (a counter per head, left at zero again) normalises every row, one warp a row, so
    // K rows pay one fence and one atomic, not K. It also stores the q/k conv state, which
    // every block read at its start.
    __threadfence();
    __syncthreads();
    if (tid == 0) last = atomicAdd(&sync[h], 1) == SPLIT - 1;
    __syncthreads();
    if (last) {
        __threadfence();
        if (warp < nrows) {
            const u64 o = (u64)warp * qkv + h * D + lane * E;  // row `warp`
            float v[E];
            unsigned y[E / 2];
#pragma unroll
            for (int e = 0; e < E; ++e) v[e] = __ldcg(core + o + e);
            gated_rms(v, nw, og, D, eps, y);
#pragma unroll
            for (int e = 0; e < E; e += 2) *reinterpret_cast<unsigned*>(o_norm_out + o + e) = y[e / 2];
        }
        if (p < 2) conv_store(conv_state, tap, c, conv_dim, W);
        if (tid == 0) sync[h] = 0;
    }
    if (warp < RW)
#pragma unroll
        for (int p = 0; p < PW; ++p) strow<D>(S + (u64)(row0 + P * p + rl) * D, s[p], li);
    if (mine_v) conv_store(conv_state, tap, c, conv_dim, W);
}

// split = gridDim.y: DECODE_SPLIT blocks a head, or half as many where H x DECODE_SPLIT blocks
// would not run in one wave (a block of 4 D threads takes most of an SM's registers, so one
// block an SM): a second wave costs more than each block walking twice the rows
// (`Glm5NextKdaKernels.decode_split`). A row's arithmetic does not depend on its block.
template <int D, typename... Args>
__device__ __forceinline__ void decode_rows_split(Args... args) {
    static_assert(DECODE_SPLIT % 2 == 0, "DECODE_SPLIT and its half both split a head");
    if (gridDim.y == DECODE_SPLIT) decode_rows<D, DECODE_SPLIT>(args...);
    else decode_rows<D, DECODE_SPLIT / 2>(args...);
}

#define KDA_DECODE_ROWS(D)                                                                      \
    extern "C" __global__ void __launch_bounds__(4 * D) kda_decode_rows_d##D(                   \
        const bf16* x, bf16* conv_state, const float* conv_w, bf16* conv_out, const float* gate, \
        const float* beta, float* state, float* core, const bf16* out_gate,                     \
        const float* o_norm_w, bf16* o_norm_out, float* snap_rec, bf16* snap_conv, int* sync,   \
        int nrows, int nsnap, int H, int W, float scale, float eps) {                           \
        decode_rows_split<D>(x, conv_state, conv_w, conv_out, gate, beta, state, core,        \
                             out_gate, o_norm_w, o_norm_out, snap_rec, snap_conv, sync, nrows,  \
                             nsnap, H, W, scale, eps);                                          \
    }
// Many sequences a launch: block (h, slice, b) runs head h of a sequence, state rows
// slice D / split.. of it (split = gridDim.y, a power of two up to DECODE_BATCH_MAX_SPLIT: small
// batches split a head over more blocks, so the state still streams through the whole GPU). 2 D
// threads: each first convolves q (threads < D) or k, then v or the decay, for all nrows tokens
// before any state row moves, so the K tokens of a verify cost two barriers, not two a token;
// then each of the D / 16 warps walks its 16 / split state rows through all tokens. Every value
// is formed by decode_rows' arithmetic in its order (the conv's taps, the L2 partial sums a warp
// of 32 channels at a time, a state row's lane split and warp sums, the norm), so a sequence's
// bits equal decode's and decode_k's whatever its batch and split.
// The state rows are the launch's traffic. From sm_90 on (DECODE_BATCH_BULK) the TMA engine
// moves a block's rows, one contiguous run, into shared memory: one instruction, holding none
// of the SM's load slots, lands them while the block convolves, and three blocks an SM keep the
// stream going while one computes; each row goes back to global memory from registers after its
// last token. Below sm_90 each thread loads its warp's rows into registers (two blocks an SM).
// Every token's inputs (this head's q, k, v projections, its decay and norm gate) arrive
// together by cp.async, beside the taps, so a block waits on one round trip before its conv, not
// one per dependent load. The dynamic shared memory (decode_batch_smem): the rows (bulk
// builds); qs, ks, vs, gx, cs [nrows][D] fp32; the staged norm gate [nrows][D] and projections
// [nrows][3 D] bf16.
__host__ __device__ constexpr int decode_batch_smem(int D, int rows, int nrows) {
    return ((DECODE_BATCH_BULK ? rows * D : 0) + 7 * nrows * D) * 4;
}

// The phases of kda_decode_batch, as functions: so built, sm_90a's build holds the kernel in
// 80 registers with no spill, where the one body spilled 64 bytes and ran 13-14% longer
// (docs/perf-log.md, v46).
// The conv of every token: thread (pair, d) convolves q (pair
// 0) or k channel d (taps ta, weights wa) and, where mine_v, v's (tv, wv), else the decay (pair
// 1); q and k stay unnormalised in registers until the L2 partial sums of all tokens are in, v
// and the decay go straight to vs and gx; each token's conv state goes to its snapshot slot
// (snap[t] >= 0). Then q and k, normalised and rounded to bf16, to conv_out (where `owner`: the
// head's first block) and qs / ks. xs holds the tokens' projections [nrows][3 D] bf16. Every
// thread calls it (two block barriers).
template <int D>
__device__ __forceinline__ void batch_conv(
    bf16 (&ta)[MAX_CONV_KERNEL], const float (&wa)[MAX_CONV_KERNEL], bf16 (&tv)[MAX_CONV_KERNEL],
    const float (&wv)[MAX_CONV_KERNEL], const bf16* xs, float* qs, float* ks, float* vs,
    float* gx, float (*part)[D / 16], const int* snap, bf16* __restrict__ conv_out,
    bf16* __restrict__ conv_pool, bool owner, bool mine_v, int ca, int cv, int nrows, int nsnap,
    int conv_dim, int W) {
    constexpr int R = MAX_DECODE_ROWS;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, pair = tid / D, d = tid % D;
    float ya[R];
#pragma unroll
    for (int t = 0; t < R; ++t) {
        if (t >= nrows) break;
        ya[t] = conv_row(ta, wa, xs[t * 3 * D + pair * D + d], W);
        const float sq = warp_sum(ya[t] * ya[t]);
        if (lane == 0) part[t][warp] = sq;
        if (mine_v) {
            const bf16 r = f2bf(conv_row(tv, wv, xs[t * 3 * D + 2 * D + d], W));
            conv_out[(u64)t * conv_dim + cv] = r;
            vs[t * D + d] = bf2f(r);
        } else if (pair == 1) {
            gx[t * D + d] = expf(gx[t * D + d]);
        }
        const int si = t < nsnap ? snap[t] : -1;  // the conv state after this token
        if (si >= 0) {
            bf16* to = conv_pool + (u64)si * (W - 1) * conv_dim;
            if (owner) conv_store(to, ta, ca, conv_dim, W);
            if (mine_v) conv_store(to, tv, cv, conv_dim, W);
        }
    }
    __syncthreads();
#pragma unroll
    for (int t = 0; t < R; ++t) {
        if (t >= nrows) break;
        float ss = 0.0f;
        for (int i = 0; i < D / 32; ++i) ss += part[t][pair * (D / 32) + i];
        const bf16 r = f2bf(ya[t] * (1.0f / sqrtf(ss + L2_NORM_EPS)));
        if (owner) conv_out[(u64)t * conv_dim + ca] = r;
        (pair == 0 ? qs : ks)[t * D + d] = bf2f(r);
    }
    __syncthreads();
}

// The delta-rule step, token by token, on this warp's rpw state rows (the
// head's rows row0.., the block's rows warp rpw.. of Ss), G steps at a time: their loads, then
// their steps (independent chains), then their stores. A step with any of the warp's rows runs
// in every lane (its sums shuffle across the warp); lanes past them hold zeros. Bulk builds read
// and write the rows in Ss, the last token's to S (their place in the pool); the others keep
// them in s. The outputs go to core [nrows, H D] and cs [nrows][D];
// the state after token t < nsnap to pool slot snap[t] >= 0 (rec_pool's head h).
template <int D, int PR, int G>
__device__ __forceinline__ void batch_delta(
    float (&s)[PR][ROW_E], float* Ss, float* S, const float* gx, const float* ks,
    const float* qs, const float* vs, const float* bs, float* cs, const int* snap,
    float* __restrict__ core, float* __restrict__ rec_pool, int row0, int rpw, int nrows,
    int nsnap, int H, int h, float scale) {
    constexpr int L = RowLanes<D>::L, P = RowLanes<D>::P;
    const int lane = threadIdx.x & 31, li = lane % L, rl = lane / L, qkv = H * D;
    [[maybe_unused]] const int warp = threadIdx.x >> 5;  // the bulk builds' rows in Ss
#pragma unroll 1
    for (int t = 0; t < nrows; ++t) {
        float gv[ROW_E], kv[ROW_E], qv[ROW_E];
        ldrow<D>(gv, gx + t * D, li);
        ldrow<D>(kv, ks + t * D, li);
        ldrow<D>(qv, qs + t * D, li);
#pragma unroll
        for (int e = 0; e < ROW_E; ++e) qv[e] *= scale;
        const int si = t < nsnap ? snap[t] : -1;
        float* to = rec_pool + ((u64)si * H + h) * D * D;
#pragma unroll
        for (int p0 = 0; p0 < PR; p0 += G) {
            if (P * p0 >= rpw) break;
#if DECODE_BATCH_BULK
            float sg[G][ROW_E] = {};
#pragma unroll
            for (int p = 0; p < G; ++p)
                if (P * (p0 + p) + rl < rpw)
                    ldrow<D>(sg[p], Ss + (warp * rpw + P * (p0 + p) + rl) * D, li);
#else
            float(&sg)[G][ROW_E] = *reinterpret_cast<float(*)[G][ROW_E]>(s[p0]);
#endif
            float vr[G], o[G];
#pragma unroll
            for (int p = 0; p < G; ++p) {
                const int r = P * (p0 + p) + rl;
                vr[p] = r < rpw ? vs[t * D + row0 + r] : 0.0f;
            }
#pragma unroll
            for (int p = 0; p < G; ++p)
                if (P * (p0 + p) < rpw) o[p] = delta_row<L>(sg[p], gv, kv, qv, bs[t], vr[p]);
#pragma unroll
            for (int p = 0; p < G; ++p) {
                const int r = P * (p0 + p) + rl, j = row0 + r;
                if (r >= rpw) continue;
#if DECODE_BATCH_BULK  // the next token's row, or the final state
                strow<D>((t + 1 < nrows ? Ss : S) + (u64)(warp * rpw + r) * D, sg[p], li);
#endif
                if (li == 0) {
                    core[(u64)t * qkv + h * D + j] = o[p];
                    cs[t * D + j] = o[p];
                }
                if (si >= 0) strow<D>(to + (u64)j * D, sg[p], li);  // for a partial accept
            }
        }
    }
}

// The gated RMSNorm of the head's nrows outputs, a warp a token: from cs, or (from_core) from
// core, where the head's other blocks wrote theirs. ogs: the staged norm gate [nrows][D].
template <int D>
__device__ __forceinline__ void batch_norm(const float* cs, const float* __restrict__ core,
                                           const bf16* ogs, const float* nws,
                                           bf16* __restrict__ o_norm_out, bool from_core,
                                           int nrows, int qkv, int h, float eps) {
    constexpr int E = D / 32, NW = D / 16;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int t = warp; t < nrows; t += NW) {
        const u64 o = (u64)t * qkv + h * D + lane * E;
        float v[E], og[E], nw[E];
        unsigned y[E / 2];
#pragma unroll
        for (int e = 0; e < E; ++e) og[e] = bf2f(ogs[t * D + lane * E + e]);
        ldv(nw, nws + lane * E);
#pragma unroll
        for (int e = 0; e < E; ++e) v[e] = from_core ? __ldcg(core + o + e) : cs[t * D + lane * E + e];
        gated_rms(v, nw, og, D, eps, y);
#pragma unroll
        for (int e = 0; e < E; e += 2) *reinterpret_cast<unsigned*>(o_norm_out + o + e) = y[e / 2];
    }
}

template <int D>
__device__ __forceinline__ void decode_batch(
    const bf16* __restrict__ x, bf16* __restrict__ conv_state, const float* __restrict__ conv_w,
    bf16* __restrict__ conv_out, const float* __restrict__ gate, const float* __restrict__ beta,
    float* __restrict__ state, float* __restrict__ core, const bf16* __restrict__ out_gate,
    const float* __restrict__ o_norm_w, bf16* __restrict__ o_norm_out,
    float* __restrict__ rec_pool, bf16* __restrict__ conv_pool, const int* __restrict__ snap_slots,
    int nslots, int* __restrict__ fault, int* __restrict__ sync, int nrows, int nsnap, int H,
    int W, float scale, float eps) {
    constexpr int NW = D / 16, RPW = 16, R = MAX_DECODE_ROWS;  // RPW: rows at split 1
    constexpr int L = RowLanes<D>::L, P = RowLanes<D>::P, PR = RPW / P;  // PR: steps at split 1
    constexpr int G = 2;  // steps a warp takes at once: independent chains of sums
    static_assert(PR % G == 0, "the register variant views s[p0..] as G whole steps");
    extern __shared__ __align__(16) float dyn[];
    __shared__ __align__(16) float nws[D];
    __shared__ float part[R][NW], bs[R];
    __shared__ bf16 tap_s[MAX_CONV_KERNEL - 1][2 * D];
    __shared__ int last, snap[R];
    const int h = blockIdx.x, slice = blockIdx.y, split = gridDim.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int qkv = H * D, conv_dim = 3 * qkv, rows = D / split, rpw = RPW / split;
    const int pair = tid / D, d = tid % D;
    const int ca = pair * qkv + h * D + d, cv = 2 * qkv + h * D + d;  // q or k; v
    const bool mine_v = pair == 0 && d / rows == slice;  // v channels: only this block's rows
    const int row0 = slice * rows + warp * rpw;            // this warp's first state row
    [[maybe_unused]] const int li = lane % L, rl = lane / L;  // this lane in its row's group
    float* S = state + (u64)h * D * D + (u64)slice * rows * D;  // this block's rows
    float* qs = dyn + (DECODE_BATCH_BULK ? rows * D : 0);
    float *ks = qs + nrows * D, *vs = ks + nrows * D, *gx = vs + nrows * D, *cs = gx + nrows * D;
    bf16* ogs = reinterpret_cast<bf16*>(cs + nrows * D);  // [nrows][D]
    bf16* xs = ogs + nrows * D;                           // [nrows][3 D]: q, k, v
    // The loads that depend on no earlier kernel of the call first, before prior_grid_sync,
    // so the state rows' latency overlaps the front end's end and the conv.
    float s[PR][ROW_E] = {};  // rows warp rpw + P p + rl of the block's, where below rpw
#if DECODE_BATCH_BULK
    __shared__ u64 bar;
    float* Ss = dyn;  // [rows][D]
    if (tid == 0) {  // the other threads wait on bar after the conv's barriers
        const unsigned bytes = rows * D * 4;
        mbar_init(&bar, 1);
        mbar_init_fence();
        mbar_expect(&bar, bytes);
        bulk_copy(Ss, S, bytes, &bar);
    }
#else
    float* Ss = nullptr;
#pragma unroll
    for (int p = 0; p < PR; ++p)
        if (P * p + rl < rpw) ldrow<D, true>(s[p], S + (u64)(warp * rpw + P * p + rl) * D, li);
#endif
    if (tid < D) nws[tid] = o_norm_w[tid];
    bf16 ta[MAX_CONV_KERNEL], tv[MAX_CONV_KERNEL];
    float wa[MAX_CONV_KERNEL], wv[MAX_CONV_KERNEL];
    conv_load(ta, wa, conv_state, conv_w, ca, conv_dim, W);
    if (mine_v) conv_load(tv, wv, conv_state, conv_w, cv, conv_dim, W);
    prior_grid_sync();  // what follows reads the front end's outputs
    {  // a token's 16-byte runs: 3 D / 8 of q, k, v; D / 4 of the decay; D / 8 of the norm gate
        constexpr int XR = 3 * D / 8, GR = D / 4, OR = D / 8, RUNS = XR + GR + OR;
        for (int i = tid; i < nrows * RUNS; i += 2 * D) {
            const int t = i / RUNS, c = i % RUNS;
            if (c < XR)
                cp_async16(xs + t * 3 * D + 8 * c, x + (u64)t * conv_dim + (c / (D / 8)) * qkv +
                                                       h * D + 8 * (c % (D / 8)));
            else if (c < XR + GR)
                cp_async16(gx + t * D + 4 * (c - XR), gate + (u64)t * qkv + h * D + 4 * (c - XR));
            else
                cp_async16(ogs + t * D + 8 * (c - XR - GR),
                           out_gate + (u64)t * qkv + h * D + 8 * (c - XR - GR));
        }
        cp_commit();
    }
    if (tid < nsnap)  // entry blockIdx.z (nrows - 1) + tid of the launch's snapshot table
        snap[tid] = checked_slot(snap_slots[tid], nslots, fault, 1,
                                 blockIdx.z * (nrows - 1) + tid);
    if (tid < nrows) bs[tid] = beta[(u64)tid * H + h];
    cp_wait<0>();
    __syncthreads();
    batch_conv<D>(ta, wa, tv, wv, xs, qs, ks, vs, gx, part, snap, conv_out, conv_pool,
                  slice == 0, mine_v, ca, cv, nrows, nsnap, conv_dim, W);
    if (mine_v) conv_store(conv_state, tv, cv, conv_dim, W);  // no other block reads them
#pragma unroll
    for (int j = 0; j < MAX_CONV_KERNEL - 1; ++j)  // q / k's, stored once every block read them
        if (j < W - 1) tap_s[j][tid] = ta[j];
#if DECODE_BATCH_BULK
    mbar_wait(&bar, 0);
#endif
    batch_delta<D, PR, G>(s, Ss, S, gx, ks, qs, vs, bs, cs, snap, core, rec_pool, row0, rpw,
                          nrows, nsnap, H, h, scale);
#if !DECODE_BATCH_BULK
#pragma unroll
    for (int p = 0; p < PR; ++p)
        if (P * p + rl < rpw) strow<D>(S + (u64)(warp * rpw + P * p + rl) * D, s[p], li);
#endif
    // The gated RMSNorm needs the head's D outputs: in this block's shared memory at split 1,
    // else the last of the head's blocks to finish (a counter, left at zero again) reads them
    // back. That block also stores the q / k conv state, which every block read at its start.
    if (split > 1) {
        __threadfence();
        __syncthreads();
        if (tid == 0) last = atomicAdd(&sync[h], 1) == split - 1;
        __syncthreads();
        if (!last) return;
        __threadfence();
        if (tid == 0) sync[h] = 0;
    } else {
        __syncthreads();
    }
    batch_norm<D>(cs, core, ogs, nws, o_norm_out, split > 1, nrows, qkv, h, eps);
    for (int j = 0; j < W - 1; ++j) conv_state[(u64)j * conv_dim + ca] = tap_s[j][tid];
}

// A batch: sequence b = blockIdx.z < nseq takes rows b nrows.. of the row buffers and the
// states of slot slots[b] in pools [nslots, H, Dv, Dk] and [nslots, W-1, conv_dim] (-1 is a
// padding row: its blocks read and write nothing); the state after its row r < nsnap goes to
// pool slot snap_slots[b (nrows-1) + r] (-1: skipped). An entry outside [-1, nslots) acts as
// -1 and is recorded in fault (checked_slot). sync has a counter per (sequence, head).
#define KDA_DECODE_BATCH(D)                                                                     \
    extern "C" __global__ void __launch_bounds__(2 * D, DECODE_BATCH_BLOCKS_PER_SM)             \
    kda_decode_batch_d##D(const bf16* x, bf16* conv_pool, const float* conv_w, bf16* conv_out,  \
                          const float* gate, const float* beta, float* rec_pool, float* core,   \
                          const bf16* out_gate, const float* o_norm_w, bf16* o_norm_out,        \
                          const int* slots, const int* snap_slots, int nslots, int* fault,      \
                          int* sync, int nseq, int nrows, int nsnap, int H, int W, float scale, \
                          float eps) {                                                          \
        const int b = blockIdx.z;                                                               \
        const int s = b < nseq ? __ldcg(slots + b) : -1; /* before the wait: the caller's */  \
        const int slot = checked_slot(s, nslots, fault, 0, b);                                  \
        if (slot < 0) return prior_grid_sync();                                                 \
        const int qkv = H * D, conv_dim = 3 * qkv;                                              \
        const u64 r0 = (u64)b * nrows;                                                          \
        decode_batch<D>(x + r0 * conv_dim, conv_pool + (u64)slot * (W - 1) * conv_dim, conv_w,  \
                        conv_out + r0 * conv_dim, gate + r0 * qkv, beta + r0 * H,               \
                        rec_pool + (u64)slot * H * D * D, core + r0 * qkv, out_gate + r0 * qkv, \
                        o_norm_w, o_norm_out + r0 * qkv, rec_pool, conv_pool,                   \
                        snap_slots + (u64)b * (nrows > 1 ? nrows - 1 : 0), nslots, fault,       \
                        sync + (u64)b * H, nrows, nsnap, H, W, scale, eps);                     \
    }
// Batched decode of one sequence and one token: decode's own launch at the pool slot the device
// table names (-1: a padding row, nothing read or written; outside [-1, nslots): the same, and
// recorded in fault), so the batch of one costs what decode costs, its bits are decode's, and a
// captured graph replays with a new table.
#define KDA_DECODE_ROWS_SLOT(D)                                                                  \
    extern "C" __global__ void __launch_bounds__(4 * D) kda_decode_rows_slot_d##D(              \
        const bf16* x, bf16* conv_pool, const float* conv_w, bf16* conv_out, const float* gate,  \
        const float* beta, float* rec_pool, float* core, const bf16* out_gate,                  \
        const float* o_norm_w, bf16* o_norm_out, const int* slots, int nslots, int* fault,      \
        int* sync, int H, int W, float scale, float eps) {                                      \
        const int slot = checked_slot(__ldcg(slots), nslots, fault, 0, 0); /* the caller's */   \
        if (slot < 0) return prior_grid_sync();                                                 \
        decode_rows_split<D>(x, conv_pool + (u64)slot * (W - 1) * 3 * H * D, conv_w, conv_out, \
                             gate, beta, rec_pool + (u64)slot * H * D * D, core, out_gate,      \
                             o_norm_w, o_norm_out, nullptr, nullptr, sync, 1, 0, H, W, scale,   \
                             eps);                                                              \
    }
KDA_DECODE_ROWS(64)
KDA_DECODE_ROWS(128)
KDA_DECODE_ROWS_SLOT(64)
KDA_DECODE_ROWS_SLOT(128)
KDA_DECODE_BATCH(64)
KDA_DECODE_BATCH(128)
extern "C" {  // the most a launch takes (split 1, MAX_DECODE_ROWS rows); a launch passes its own
__constant__ int kda_decode_batch_d64_smem = decode_batch_smem(64, 64, MAX_DECODE_ROWS);
__constant__ int kda_decode_batch_d128_smem = decode_batch_smem(128, 128, MAX_DECODE_ROWS);
}
