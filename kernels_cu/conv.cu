// The prefill side of the short causal depthwise conv over time, with the carried conv state
// [W-1, conv_dim] (oldest row first) standing in for the rows before the first token. Decode's
// conv is fused into kda_decode_rows_d{D} (recurrent.cu).
#include "common.cuh"
#include "segments.cuh"


// One thread per 8 channels (16 bytes) of a q/k/v head vector and a run of CONV_TOKENS tokens,
// reading q|k|v from qkv_proj [T, conv_dim], where the projection GEMM wrote them. It keeps
// the last W-1 input rows in registers, so each input row is read once (plus W-1 rows of
// warm-up a run) instead of once per tap (the taps of other tokens came from L2). A head
// vector's D/8 threads are adjacent lanes, so the L2 norm reduces with shuffles inside the
// group. It writes conv_out (conv + SiLU rounded to bf16, then for q/k the L2 norm of those
// bf16 values rounded again), which the chunk kernels read. The copies the stages expose
// besides (qkv_parts: the inputs by part; q/k/v_f32: conv_out widened) are
// prefill_stage_copies', run only when something reads them: no kernel does, and they were
// two thirds of this kernel's bytes.
// Packed, each segment (segments.cuh) is its own sequence: runs of CONV_TOKENS padded rows
// never straddle one (its rows start at a chunk), and its rows before the first read its
// slot's conv state (zeros without initial state).
static_assert(CHUNK % CONV_TOKENS == 0, "a conv run lies inside one chunk");

// Input row r of a segment whose rows start at x (r < 0: its conv state, or zero).
__device__ __forceinline__ uint4 conv_input(const bf16* x, const bf16* state, bool init,
                                            int conv_dim, int W, int r, int c) {
    if (r >= 0) return *reinterpret_cast<const uint4*>(x + (u64)r * conv_dim + c);
    return init ? *reinterpret_cast<const uint4*>(state + (u64)(W - 1 + r) * conv_dim + c)
                : make_uint4(0u, 0u, 0u, 0u);
}

// One thread's run, with the taps right-aligned in NW slots (NW >= W).
template <int NW>
__device__ __forceinline__ void conv_thread(
    const bf16* __restrict__ x, const bf16* __restrict__ state, const float* __restrict__ w,
    bf16* __restrict__ conv_out, const int* __restrict__ segs, int nseg, int T, int T_pad, int H,
    int D, int W) {
    const int group = D / 8;  // threads a head vector (8 or 16: groups never straddle a warp)
    const long long gid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long item = gid / group;
    const int part = (int)(gid % group);
    const int nvec = 3 * H, qkv = H * D, conv_dim = 3 * qkv;
    const int runs = (T_pad + CONV_TOKENS - 1) / CONV_TOKENS;
    if (item >= (long long)runs * nvec) return;  // whole groups leave together
    const int r0 = (int)(item / nvec) * CONV_TOKENS, vec = (int)(item % nvec), p = vec / H;
    const int c = vec * D + 8 * part;
    // the segment's own rows: t counts from its first token, the padded row is pr0 + t
    const Segment sg = segment_at(segs, segment_of_chunk(segs, nseg, r0 / CHUNK), T);
    const int pr0 = sg.chunk0 * CHUNK, t0 = r0 - pr0, t1 = t0 + min(CONV_TOKENS, T_pad - r0);
    x += (u64)sg.row0 * conv_dim;
    state += (u64)sg.slot * (W - 1) * conv_dim;
    // The norm's shuffles name this group's lanes only: a warp may hold two groups of different
    // runs, which leave the loop over tokens at different rows (the segment's end).
    const unsigned gmask = (0xffffffffu >> (32 - group)) << ((threadIdx.x & 31) & ~(group - 1));
    // Taps sit right-aligned in NW slots (tap j of W in slot NW - W + j), so every array
    // index is a compile-time constant and the window stays in registers; slots before the
    // first tap are skipped, never multiplied.
    const int s0 = NW - W;
    uint4 win[NW - 1];  // slot k: input row t - (NW - 1) + k
#pragma unroll
    for (int k = 0; k < NW - 1; ++k)
        if (k >= s0 && t0 < sg.rows)
            win[k] = conv_input(x, state, sg.init, conv_dim, W, t0 - (NW - 1) + k, c);
    // a narrow window's weights stay in registers for the run (32 at W = 4); the wide generic
    // one's would take 138 registers a thread, so it re-reads them from L1 each token
    constexpr bool HOLD = NW <= 4;
    float wr[HOLD ? NW : 1][8];
    if (HOLD) {
#pragma unroll
        for (int k = 0; k < (HOLD ? NW : 1); ++k) {
            if (k < s0) continue;
            const float* wk = w + (u64)(k - s0) * conv_dim + c;
            const float4 w0 = __ldg(reinterpret_cast<const float4*>(wk));
            const float4 w1 = __ldg(reinterpret_cast<const float4*>(wk + 4));
            wr[k][0] = w0.x, wr[k][1] = w0.y, wr[k][2] = w0.z, wr[k][3] = w0.w;
            wr[k][4] = w1.x, wr[k][5] = w1.y, wr[k][6] = w1.z, wr[k][7] = w1.w;
        }
    }
    // The next token's row is loaded before this token's arithmetic: with one 16-byte load in
    // flight a thread (three blocks an SM) DRAM was half busy (perf-log v58: -23 to -26%; two
    // or four rows ahead were no faster).
    const int t_end = min(t1, sg.rows);
    uint4 next = t0 < t_end ? conv_input(x, state, sg.init, conv_dim, W, t0, c) : uint4{};
    for (int t = t0; t < t_end; ++t) {  // the whole group: t is shared
        const uint4 xin = next;
        if (t + 1 < t_end) next = conv_input(x, state, sg.init, conv_dim, W, t + 1, c);
        float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int k = 0; k < NW; ++k) {  // taps oldest first, as the one-token form sums them
            if (k < s0) continue;
            float xk[8];
            unpack8(k == NW - 1 ? xin : win[k < NW - 1 ? k : 0], xk);
            float wj[8];
            if (HOLD) {
#pragma unroll
                for (int e = 0; e < 8; ++e) wj[e] = wr[HOLD ? k : 0][e];
            } else {
                const float* wk = w + (u64)(k - s0) * conv_dim + c;  // L1-resident across the run
                const float4 w0 = __ldg(reinterpret_cast<const float4*>(wk));
                const float4 w1 = __ldg(reinterpret_cast<const float4*>(wk + 4));
                wj[0] = w0.x, wj[1] = w0.y, wj[2] = w0.z, wj[3] = w0.w;
                wj[4] = w1.x, wj[5] = w1.y, wj[6] = w1.z, wj[7] = w1.w;
            }
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[e] = __fmaf_rn(wj[e], xk[e], acc[e]);
        }
#pragma unroll
        for (int k = 0; k < NW - 2; ++k) win[k] = win[k + 1];
        win[NW - 2] = xin;
        // bf16 roundings a pair at a time (pack_bf16x2): Nsight Compute counted this kernel
        // 65% issue-bound, its largest instruction shares a bf16 rounding done in integer
        // arithmetic and the SiLU's exp and division
        float y[8], ss = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; e += 2) {
            const unsigned r = pack_bf16x2(acc[e] * sigmoidf_(acc[e]),
                                           acc[e + 1] * sigmoidf_(acc[e + 1]));
            const float2 u = unpack2(r);
            y[e] = u.x, y[e + 1] = u.y;
            ss = __fmaf_rn(y[e], y[e], ss);
            ss = __fmaf_rn(y[e + 1], y[e + 1], ss);
        }
        for (int o = group / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(gmask, ss, o);
        const float inv = p < 2 ? 1.0f / sqrtf(ss + L2_NORM_EPS) : 1.0f;  // v: y * 1 is y, exactly
        unsigned o[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) o[i] = pack_bf16x2(y[2 * i] * inv, y[2 * i + 1] * inv);
        *reinterpret_cast<uint4*>(conv_out + ((u64)sg.row0 + t) * conv_dim + c) =
            make_uint4(o[0], o[1], o[2], o[3]);
    }
}

#define PREFILL_CONV_ARGS                                                                     \
    const bf16* __restrict__ qkv_proj, const bf16* __restrict__ state,                         \
        const float* __restrict__ w, bf16* __restrict__ conv_out, const int* __restrict__ segs,  \
        int nseg, int T, int T_pad, int H, int D, int W

// Any width up to MAX_CONV_KERNEL, taps chosen at run time. Three blocks an SM, as the W = 4
// kernel: left free, ptxas takes ~100 registers (two blocks an SM); at four it spills.
extern "C" __global__ void __launch_bounds__(THREADS, 3) prefill_conv_qkv(PREFILL_CONV_ARGS) {
    conv_thread<MAX_CONV_KERNEL>(qkv_proj, state, w, conv_out, segs, nseg, T, T_pad, H, D, W);
}

// The width of every Kimi Linear checkpoint, as a literal: no tap is tested at run time, the
// window holds three rows, not seven, and the 32 weights stay in registers (80 registers,
// three blocks an SM, faster than the generic kernel: docs/perf-log.md, v10).
// kernels.py launches it when W == 4, so its W argument is always 4.
extern "C" __global__ void __launch_bounds__(THREADS) prefill_conv_qkv_w4(PREFILL_CONV_ARGS) {
    conv_thread<4>(qkv_proj, state, w, conv_out, segs, nseg, T, T_pad, H, D, 4);
}

// The stages' copies of the conv's input and output, for a stage hook: qkv_proj's q|k|v by
// part into qkv_parts [3, T, qkv] (packed rows), and conv_out's widened to fp32 into q/k/v
// [T_pad, qkv] (a segment's padded rows from its first chunk, pad_fill past its tokens). A
// thread per 8 channels of a padded row.
extern "C" __global__ void prefill_stage_copies(const bf16* __restrict__ qkv_proj,
                                                const bf16* __restrict__ conv_out,
                                                bf16* __restrict__ qkv_parts,
                                                float* __restrict__ q, float* __restrict__ k,
                                                float* __restrict__ v,
                                                const int* __restrict__ segs, int nseg, int T,
                                                int T_pad, int qkv, float pad_fill) {
    const long long gid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int per_row = 3 * qkv / 8;
    if (gid >= (long long)T_pad * per_row) return;
    const int pr = (int)(gid / per_row), c = (int)(gid % per_row) * 8, p = c / qkv;
    const Segment sg = segment_at(segs, segment_of_chunk(segs, nseg, pr / CHUNK), T);
    const int t = pr - sg.chunk0 * CHUNK;
    float f[8];
    if (t < sg.rows) {
        const u64 row = (u64)sg.row0 + t;
        *reinterpret_cast<uint4*>(qkv_parts + ((u64)p * T + row) * qkv + c - p * qkv) =
            *reinterpret_cast<const uint4*>(qkv_proj + row * 3 * qkv + c);
        unpack8(*reinterpret_cast<const uint4*>(conv_out + row * 3 * qkv + c), f);
    } else {
#pragma unroll
        for (int e = 0; e < 8; ++e) f[e] = pad_fill;
    }
    float* dst = (p == 0 ? q : (p == 1 ? k : v)) + (u64)pr * qkv + c - p * qkv;
    reinterpret_cast<float4*>(dst)[0] = make_float4(f[0], f[1], f[2], f[3]);
    reinterpret_cast<float4*>(dst)[1] = make_float4(f[4], f[5], f[6], f[7]);
}

// After prefill_conv_qkv, a block row a segment (blockIdx.y): its checkpoint slots get the W-1
// input rows before each checkpoint (all in x: a checkpoint follows at least a chunk), then its
// state becomes the last W-1 rows of (state ++ x) (state zero without initial state). New row
// j reads source row rows+j > j, so one thread walking its channel upwards never reads a row it
// already wrote.
extern "C" __global__ void conv_roll_state(const bf16* __restrict__ x, bf16* __restrict__ state,
                                           const int* __restrict__ segs, int nseg, int T,
                                           int conv_dim, int W) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= conv_dim || (int)blockIdx.y >= nseg) return;
    const Segment sg = segment_at(segs, blockIdx.y, T);
    const u64 slot_elems = (u64)(W - 1) * conv_dim;
    x += (u64)sg.row0 * conv_dim;
    for (int ci = sg.every - 1; sg.every && ci < sg.chunks; ci += sg.every) {
        const int slot = checkpoint_slot(segs, sg, ci);
        if (slot < 0) continue;
        const int end = (ci + 1) * CHUNK;
        for (int j = 0; j < W - 1; ++j)
            state[slot * slot_elems + (u64)j * conv_dim + c] =
                x[(u64)(end - (W - 1) + j) * conv_dim + c];
    }
    state += sg.slot * slot_elems;
    for (int j = 0; j < W - 1; ++j) {
        const int src = sg.rows + j;
        state[(u64)j * conv_dim + c] =
            src >= W - 1 ? x[(u64)(src - (W - 1)) * conv_dim + c]
                         : (sg.init ? state[(u64)src * conv_dim + c] : (bf16)0);
    }
}
