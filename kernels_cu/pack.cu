// Layout moves between the packed projection and the per-stage buffers the seed exposes.
#include "common.cuh"

// proj [T, ldp] (q|k|v first) -> qkv_parts [3, T, qkv] and qkv_proj [T, 3*qkv]; one thread
// per 16-byte vector (qkv is a multiple of 64, so a vector never straddles q/k/v).
extern "C" __global__ void pack_qkv(const bf16* __restrict__ proj, bf16* __restrict__ parts,
                                    bf16* __restrict__ qkvp, int T, int qkv, int ldp) {
    const int per_row = 3 * qkv / 8;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= T * per_row) return;
    const int t = i / per_row, c = (i % per_row) * 8;
    const uint4 v = *reinterpret_cast<const uint4*>(proj + (u64)t * ldp + c);
    *reinterpret_cast<uint4*>(qkvp + (u64)t * 3 * qkv + c) = v;
    const int p = c / qkv;
    *reinterpret_cast<uint4*>(parts + ((u64)p * T + t) * qkv + (c - p * qkv)) = v;
}

// conv_out [T, 3*qkv] bf16 -> q/k/v [T_pad, qkv] fp32; the padded tail gets pad_fill so the
// chunk kernels' guard past T is tested by whatever the caller primes there.
extern "C" __global__ void widen_f32(const bf16* __restrict__ conv_out, float* __restrict__ q,
                                     float* __restrict__ k, float* __restrict__ v, int T,
                                     int T_pad, int qkv, float pad_fill) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)T_pad * 3 * qkv) return;
    const int t = (int)(i / (3 * qkv)), c = (int)(i % (3 * qkv));
    const float val = t < T ? bf2f(conv_out[i]) : pad_fill;
    float* dst = c < qkv ? q : (c < 2 * qkv ? k : v);
    dst[(u64)t * qkv + (c % qkv)] = val;
}
