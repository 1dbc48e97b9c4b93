// The forget-gate formula, shared by the prefill gate kernel and the decode low-rank GEMV
// epilogue so both paths compute the same fp32 value from the same bf16 g_raw.
#pragma once
#include "common.cuh"

// What a kernel needs to form the decay and beta from the projections: g_raw [rows, H D] and
// b_raw (row stride ldb) bf16, A_log [H] and dt_bias [H D] fp32, the form and its bound.
struct GateArgs {
    const bf16* g_raw;
    const bf16* b_raw;
    int ldb;
    const float* a_log;
    const float* dt_bias;
    float lower_bound;
    int bounded;
};

// x = g_raw + dt_bias; a = exp(A_log[h]). Always <= 0.
__device__ __forceinline__ float kda_gate_value(float x, float a, float lower_bound, int bounded) {
    if (bounded) return lower_bound * sigmoidf_(a * x);
    const float sp = x > 20.0f ? x : log1pf(expf(x));
    return -a * sp;
}
