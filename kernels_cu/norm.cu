// Output gate: RMSNorm over each head's D core values, times o_norm weight and
// sigmoid(out_gate); one warp per (token, head), each lane D/32 adjacent values (one 16- or
// 8-byte load of core, one 8- or 4-byte store).
#include "norm.cuh"

template <int DL>
__device__ void gated_rmsnorm_vec(const float* __restrict__ core, const bf16* __restrict__ out_gate,
                                  const float* __restrict__ w, bf16* __restrict__ out, u64 vec,
                                  int lane, int D, float eps) {
    const u64 o = vec * D + DL * lane;
    float x[DL], wv[DL], g[DL];
    unsigned y[DL / 2];
#pragma unroll
    for (int e = 0; e < DL; e += 2) {
        const float2 c = *reinterpret_cast<const float2*>(core + o + e);
        const float2 wp = *reinterpret_cast<const float2*>(w + DL * lane + e);
        const unsigned gp = *reinterpret_cast<const unsigned*>(out_gate + o + e);
        x[e] = c.x, x[e + 1] = c.y, wv[e] = wp.x, wv[e + 1] = wp.y;
        const float2 gg = unpack2(gp);
        g[e] = gg.x, g[e + 1] = gg.y;
    }
    gated_rms(x, wv, g, D, eps, y);
#pragma unroll
    for (int e = 0; e < DL; e += 2) *reinterpret_cast<unsigned*>(out + o + e) = y[e / 2];
}

// One wave of blocks, each warp taking (token, head) vectors grid-stride: faster than a block
// for every eight vectors (docs/perf-log.md, v9).
extern "C" __global__ void gated_rmsnorm(const float* __restrict__ core,
                                         const bf16* __restrict__ out_gate,
                                         const float* __restrict__ w, bf16* __restrict__ out,
                                         int T, int H, int D, float eps) {
    const int lane = threadIdx.x & 31;
    const u64 n = (u64)T * H, stride = (u64)gridDim.x * (blockDim.x >> 5);
    for (u64 vec = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); vec < n;
         vec += stride) {
        if (D == 128) gated_rmsnorm_vec<4>(core, out_gate, w, out, vec, lane, D, eps);
        else gated_rmsnorm_vec<2>(core, out_gate, w, out, vec, lane, D, eps);
    }
}
