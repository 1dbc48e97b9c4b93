// Tensor parallel: the sum of the ranks' partial final_outs (o_proj is row-parallel, so each
// rank's bf16 output is its heads' share). The partials are widened and summed in fp32 and
// rounded to bf16 once, so the sum carries one rounding whatever the group size; the NCCL
// all-reduce between tp_accumulate and tp_round sums the fp32 buffer across processes.
#include "common.cuh"

// acc[i] = (first ? 0 : acc[i]) + x[i] for n elements (a multiple of 8: rows of hidden, which
// config.py keeps a multiple of 8); a thread per 8, one 16-byte load of x.
extern "C" __global__ void tp_accumulate(const bf16* __restrict__ x, float* __restrict__ acc,
                                         long long n, int first) {
    const long long i = 8 * ((long long)blockIdx.x * blockDim.x + threadIdx.x);
    if (i >= n) return;
    float v[8];
    unpack8(*reinterpret_cast<const uint4*>(x + i), v);
    float4* a = reinterpret_cast<float4*>(acc + i);
    if (!first) {  // the rank order of the adds is the caller's: 0, 1, ... in turn
        const float4 a0 = a[0], a1 = a[1];
        v[0] += a0.x, v[1] += a0.y, v[2] += a0.z, v[3] += a0.w;
        v[4] += a1.x, v[5] += a1.y, v[6] += a1.z, v[7] += a1.w;
    }
    a[0] = make_float4(v[0], v[1], v[2], v[3]);
    a[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// y[i] = bf16(acc[i]), nearest even, for n elements (a multiple of 8); a thread per 8.
extern "C" __global__ void tp_round(const float* __restrict__ acc, bf16* __restrict__ y,
                                    long long n) {
    const long long i = 8 * ((long long)blockIdx.x * blockDim.x + threadIdx.x);
    if (i >= n) return;
    const float4 a0 = reinterpret_cast<const float4*>(acc + i)[0];
    const float4 a1 = reinterpret_cast<const float4*>(acc + i)[1];
    *reinterpret_cast<uint4*>(y + i) = make_uint4(pack_bf16x2(a0.x, a0.y), pack_bf16x2(a0.z, a0.w),
                                                  pack_bf16x2(a1.x, a1.y), pack_bf16x2(a1.z, a1.w));
}
