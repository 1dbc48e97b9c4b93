// Forget gate and beta for prefill, grid-parallel over tokens (decode computes the same
// values in the low-rank GEMV epilogue). Rows past a segment's tokens (segments.cuh: a
// segment's padded rows from its packed ones) are written as pad_fill, 0 unless a test primes
// them: the chunk kernels select them away.
#include "gate.cuh"
#include "segments.cuh"

// One thread per 8 gate channels (a 16-byte g_raw load, two float4 stores); the thread of
// channel group i < H also writes beta for head i.
extern "C" __global__ void kda_gate_beta(const bf16* __restrict__ g_raw,
                                         const bf16* __restrict__ b_raw, int ldb,
                                         const float* __restrict__ a_log,
                                         const float* __restrict__ dt_bias,
                                         float* __restrict__ gate, float* __restrict__ beta,
                                         const int* __restrict__ segs, int nseg, int T,
                                         int T_pad, int H, int D, float lower_bound,
                                         int bounded, float pad_fill) {
    const int groups = H * D / 8;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)T_pad * groups) return;
    const int pt = (int)(i / groups), cg = (int)(i % groups), c = 8 * cg;  // pt: padded row
    const Segment sg = segment_at(segs, segment_of_chunk(segs, nseg, pt / CHUNK), T);
    const int local = pt - sg.chunk0 * CHUNK, t = sg.row0 + local;  // t: packed row
    float4* out = reinterpret_cast<float4*>(gate + (u64)pt * H * D + c);
    if (local >= sg.rows) {
        out[0] = out[1] = make_float4(pad_fill, pad_fill, pad_fill, pad_fill);
        if (cg < H) beta[(u64)pt * H + cg] = pad_fill;
        return;
    }
    float x[8];
    unpack8(*reinterpret_cast<const uint4*>(g_raw + (u64)t * H * D + c), x);
    const float4 b0 = *reinterpret_cast<const float4*>(dt_bias + c);
    const float4 b1 = *reinterpret_cast<const float4*>(dt_bias + c + 4);
    const float bias[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
    const float a = expf(a_log[c / D]);  // D is a multiple of 8: one head per group
    float gv[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) gv[e] = kda_gate_value(x[e] + bias[e], a, lower_bound, bounded);
    out[0] = make_float4(gv[0], gv[1], gv[2], gv[3]);
    out[1] = make_float4(gv[4], gv[5], gv[6], gv[7]);
    if (cg < H) beta[(u64)pt * H + cg] = sigmoidf_(bf2f(b_raw[(u64)t * ldb + cg]));
}
