// Shared helpers for every kernel family. bf16 travels as raw 16-bit words, so the same
// source builds under NVRTC (CuPy) and nvcc with no dependency on cuda_bf16.h.
#pragma once

// The launch geometry (CHUNK, THREADS, GEMV_TILE, ...) is kdarun's, given to every build as
// -DNAME=value by kdarun.kernels.compile_defines(), so each value is written in one place.
#if !defined(CHUNK) || !defined(THREADS) || !defined(GEMV_TILE) || !defined(L2_NORM_EPS) || \
    !defined(SMEM_PER_BLOCK)
#error "build kernels_cu/ with the -D flags of kdarun.kernels.compile_defines() (see .ci/run)"
#endif

typedef unsigned short bf16;
typedef unsigned long long u64;  // 64-bit offsets; NVRTC has no <cstddef>

__device__ __forceinline__ float bf2f(bf16 h) { return __uint_as_float(((unsigned)h) << 16); }

// float to bf16, nearest even, by the hardware's conversion (as __float2bfloat16_rn): one
// instruction where integer rounding with a NaN test took seven. A NaN comes out as the
// canonical bf16 NaN.
__device__ __forceinline__ bf16 f2bf(float f) {
    bf16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}

// Two floats rounded as f2bf rounds them, in one instruction, x0 in the low half.
__device__ __forceinline__ unsigned pack_bf16x2(float x0, float x1) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(x1), "f"(x0));
    return r;
}

// The two bf16 of a 32-bit word (the low half first), widened exactly.
__device__ __forceinline__ float2 unpack2(unsigned w) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}

// Unpack 8 bf16 held in a 16-byte vector.
__device__ __forceinline__ void unpack8(const uint4 v, float f[8]) {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 p = unpack2(w[i]);
        f[2 * i] = p.x, f[2 * i + 1] = p.y;
    }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// By the fast exp and division: a few ulp in fp32, below what the bf16 outputs and the core's
// 1e-4 tolerance resolve. expf and an IEEE division (with its slow-path branch) an element
// were, with integer bf16 rounding, the prefill conv's largest instruction shares.
// 1 + exp(-x) overflowing gives 0.
__device__ __forceinline__ float sigmoidf_(float x) { return __fdividef(1.0f, 1.0f + __expf(-x)); }

// c += a b on tensor cores, one m16n8k16 step: bf16 operands as packed pairs (lower k index in
// the low half), fp32 accumulators. Fragment ownership: lane = 4 g + t holds A rows g and g+8,
// B column g and C rows g, g+8 at columns 2t, 2t+1.
__device__ __forceinline__ void mma_bf16(float c[4], const unsigned a[4], const unsigned b[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Four 8 x 8 b16 tiles from shared memory: lane 8 j + i names row i of tile j, and r[j] gets
// this lane's word of tile j (row lane / 4, columns 2 (lane % 4), + 1), the fragment order of
// mma_bf16's operands.
__device__ __forceinline__ void ldmatrix_x4(unsigned r[4], const void* p) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// Asynchronous 16-byte copies global -> shared through L2 only; `bytes` < 16 copies that many
// and zero-fills the rest (0: a pure zero fill, src is not read).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, unsigned bytes = 16) {
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// The GEMVs' K order: a tile's `steps` stages of GEMV_STAGE_K fall into ks shares, each a run
// of consecutive stages (the first steps % ks shares one more), summed apart and then added in
// share order. Share j's run starts at share_first(j) and ends before share_first(j + 1);
// every GEMV form (gemv.cu, gemv_wg.cu) takes it from here, so their rows' bits agree.
__device__ __forceinline__ int share_first(int j, int steps, int ks) {
    return j * (steps / ks) + min(j, steps % ks);
}

// Decode's launches overlap (programmatic dependent launch, sm_90 on; kdarun.kernels.DECODE_OVERLAP):
// a kernel launched so may start while the kernel before it on the stream still runs. Before
// prior_grid_sync it reads only what no kernel of the call writes (weights, the states, the
// caller's slot tables) and writes nothing global but the pool's fault words (no other kernel
// touches them). The call waits for the kernel before to end, then lets the next launch start
// once every block of this one is past it: so a launch starts only after every kernel before
// the one ahead of it has ended, and the states and tables it reads early were complete
// before it started, provided the kernel ahead is not a walk of the same state (the host
// never overlaps a walk with one: kda_decode_rows' `overlap`). Every block calls it, all its
// threads before any read of an earlier kernel's outputs; without the launch attribute the
// wait returns at once, and below sm_90 both are nothing. A kernel launched after one of
// these with programmatic serialisation of its own must wait before it reads their outputs,
// as CUDA requires of any such kernel.
__device__ __forceinline__ void prior_grid_sync() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
