// The front end's pieces that each of its GEMV forms (decode's front_end_gemv, the slabs'
// front_end_gemv_batch in gemv.cu, front_end_wg in gemv_wg.cu) shares, so that every form
// writes the same values in the same order: the projection's stores, the gate blocks' wait
// on the f_a|g_a|b blocks, the gate outputs, beta, and the counters' reset.
#pragma once
#include "gate.cuh"

struct NoWait {
    __device__ void operator()() const {}
};

// Output n of the packed projection at token row m: q|k|v to qkv_proj [M, 3 qkv] and its part
// of qkv_parts [3, P, qkv]; f_a|g_a|b to gate_in [M, ldg] (what the gate blocks read).
__device__ __forceinline__ void proj_store(bf16* qkv_proj, bf16* qkv_parts, bf16* gate_in,
                                           int qkv, int P, int ldg, int n, int m, float v) {
    const bf16 r = f2bf(v);
    if (n < 3 * qkv) {
        qkv_proj[(u64)m * 3 * qkv + n] = r;
        qkv_parts[((u64)(n / qkv) * P + m) * qkv + n % qkv] = r;
    } else {
        gate_in[(u64)m * ldg + n - 3 * qkv] = r;
    }
}

// An f_a|g_a|b block counts itself done in sync[0] once its outputs are visible.
__device__ __forceinline__ void early_done(int* sync) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) atomicAdd(&sync[0], 1);
}

// The gate blocks' wait: until `early` f_a|g_a|b blocks (or warps) counted themselves done.
__device__ __forceinline__ void wait_early(int* sync, int early) {
    if (threadIdx.x == 0) {
        while (*reinterpret_cast<volatile int*>(&sync[0]) < early) __nanosleep(64);
        __threadfence();
    }
    __syncthreads();
}

// The front end's beta block: once the `early` f_a|g_a|b blocks (or warps) counted in sync[0]
// are done, beta = sigmoid(b) of M rows, b in gate_in (row stride ldg) after f_a and g_a.
__device__ __forceinline__ void beta_block(int* sync, int early, const bf16* gate_in,
                                           float* beta, int M, int H, int ldg, int R) {
    prior_grid_sync();
    wait_early(sync, early);
    for (int i = threadIdx.x; i < M * H; i += blockDim.x)
        beta[i] = sigmoidf_(bf2f(__ldcg(gate_in + (u64)(i / H) * ldg + 2 * R + i % H)));
}

// A gate output: f_b's to g_raw and, from the rounded value, the forget gate; g_b's to out_gate.
__device__ __forceinline__ void gate_store(bool is_f, bf16* g_raw, float* gate, bf16* out_gate,
                                           const float* a_log, const float* dt_bias, int qkv,
                                           int D, float lower_bound, int bounded, int c, int m,
                                           float v) {
    const bf16 r = f2bf(v);
    if (is_f) {
        g_raw[(u64)m * qkv + c] = r;
        gate[(u64)m * qkv + c] = kda_gate_value(bf2f(r) + dt_bias[c], expf(a_log[c / D]),
                                                lower_bound, bounded);
    } else {
        out_gate[(u64)m * qkv + c] = r;
    }
}

// The last gate block to finish (sync[1] counts them) zeroes both counters for the next call.
__device__ __forceinline__ void gates_done(int* sync, int gate_blocks) {
    __syncthreads();
    if (threadIdx.x == 0 && atomicAdd(&sync[1], 1) == gate_blocks - 1) sync[0] = sync[1] = 0;
}
