// Hopper's asynchronous units: bulk copies (the TMA engine, sm_90 on: the chunk walk's operands,
// the batch decode's state rows; tensor copies by map: gemv_wg.cu's tiles) completing on
// mbarriers, and warpgroup MMAs (sm_90a: the walk, gemv_wg.cu). A warpgroup is four
// consecutive warps; warp w of it holds rows 16 w .. 16 w + 15 of the m64 product. In the walk A
// comes from registers in mma_bf16's A-fragment order per warp (so an accumulator's fragments
// feed the next product's A without moving through shared memory) and B from shared memory
// through a descriptor; gemv_wg.cu reads both from shared memory (wgmma_ss64).
// Built for sm_90 (CI's nvcc -arch=sm_90) the MMAs are absent: KDA_WGMMA is 0 and they trap;
// the backend builds the kernels for sm_90a on such a GPU.
#pragma once
#include "common.cuh"

constexpr int WARPGROUP = 128;  // threads: four consecutive warps

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KDA_WGMMA 1
#else
#define KDA_WGMMA 0
#endif

__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}

// B in shared memory, K-major, no swizzle: 8 x 8 core matrices (8 rows of N, 16 bytes of K
// each, 128 contiguous bytes); lbo is the byte step between core matrices along K, sbo along N.
__device__ __forceinline__ u64 wgmma_desc(const void* p, unsigned lbo, unsigned sbo) {
    const unsigned a = smem_addr(p);
    return (u64)((a & 0x3FFFFu) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32);
}

// An mbarrier that completes a phase when its `count` arrivals (mbar_expect or mbar_arrive) and
// the bytes announced (by the bulk copies that name it) are in; waiters spin on the phase's
// parity.
__device__ __forceinline__ void mbar_init(u64* bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count)
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive(u64* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_expect(u64* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(u64* bar, unsigned parity) {
    unsigned done = 0;
    while (!done)
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}"
                     : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
}
// bytes (a multiple of 16, both ends 16-byte aligned) from global to shared memory by the TMA
// engine, counted on bar
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, u64* bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

// A CUtensorMap (cuda.h), encoded by the host (kdarun/driver.py) and passed by value.
struct alignas(64) TensorMap {
    u64 words[16];
};

// One box of the map at coordinates (k, row), global to shared memory by the TMA engine,
// counted on bar (the whole box's bytes; past the matrix's ends zeros, as the map was encoded).
__device__ __forceinline__ void tma_2d(void* dst, const TensorMap& map, u64* bar, int k, int row) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4}], [%2];"
        ::"r"(smem_addr(dst)), "l"(&map), "r"(smem_addr(bar)), "r"(k), "r"(row) : "memory");
}

// A K-major operand in the 128-byte swizzle, as the TMA lands a box: 8-row atoms of 128 bytes,
// 1024 bytes apart. A k16 step is 32 bytes on within the atom (the hardware swizzles it).
__device__ __forceinline__ u64 sw128_desc(const void* p) {
    return (u64)((smem_addr(p) & 0x3FFFFu) >> 4) | (1ull << 16) | ((u64)(1024 >> 4) << 32) |
           (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() {
#if KDA_WGMMA
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if KDA_WGMMA
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if KDA_WGMMA
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
#endif
}
// Pins an accumulator's registers at this point of the program: the compiler may not move a use
// of them above the wgmma_wait before it, nor a definition below the wgmma_fence after it.
template <int N>
__device__ __forceinline__ void wgmma_pin(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// An m64n64 product's 32 accumulators as its asm statements name them (operands 0-31).
#define WGMMA_D32_LIST                                                                        \
    "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"                                   \
    "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"
#define WGMMA_D32(d)                                                                          \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),         \
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), \
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),           \
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),           \
        "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

// d[N/2] += A (4 registers) x B (desc + STEP 16-byte units), m64nNk16, bf16 in, fp32
// accumulators: tile i of the N columns is d[4 i ..], mma_bf16's C fragment. B is K-major
// (TB = 0: a core matrix's 16-byte rows run along K) or MN-major (TB = 1: along N). The step is
// added inside the instruction's block so that the compiler keeps one base descriptor in
// registers, not one for every k-step it can hoist out of the loop over chunks.
template <int N, int STEP, int TB = 0>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const unsigned (&a)[4], u64 desc) {
    static_assert(N == 64 || N == 128, "the walk's two widths");
#if KDA_WGMMA
    if constexpr (N == 64) {
        asm volatile("{\n.reg .pred p;\n.reg .b64 b;\nsetp.ne.b32 p, 1, 0;\n"
                     "add.s64 b, %36, %37;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WGMMA_D32_LIST ", "
                     "{%32,%33,%34,%35}, b, p, 1, 1, %38;\n}"
                     : WGMMA_D32(d)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(STEP), "n"(TB));
    } else {
        asm volatile("{\n.reg .pred p;\n.reg .b64 b;\nsetp.ne.b32 p, 1, 0;\n"
                     "add.s64 b, %68, %69;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
                     "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                     "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
                     "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
                     "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "
                     "{%64,%65,%66,%67}, b, p, 1, 1, %70;\n}"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                       "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                       "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                       "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                       "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
                       "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
                       "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
                       "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                       "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),
                       "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
                       "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "n"(STEP), "n"(TB));
    }
#else
    __trap();
#endif
}

// d = A B^T (+ d where acc), m64n64k16, both operands K-major in shared memory by descriptor
// (A's 64 rows the product's M, B's 64 rows its N); d is mma_bf16's C fragment for each 8
// columns, as wgmma_rs's.
__device__ __forceinline__ void wgmma_ss64(float (&d)[32], u64 da, u64 db, int acc) {
#if KDA_WGMMA
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WGMMA_D32_LIST ", "
                 "%32, %33, p, 1, 1, 0, 0;\n}"
                 : WGMMA_D32(d)
                 : "l"(da), "l"(db), "r"(acc));
#else
    __trap();
#endif
}
