// Forget gate and beta, grid-parallel over tokens so one launch serves decode, decode_k's
// K rows and prefill alike. Rows >= T are written as zeros (the core never reads them).
#include "gate.cuh"

extern "C" __global__ void kda_gate_beta(const bf16* __restrict__ g_raw,
                                         const bf16* __restrict__ b_raw, int ldb,
                                         const float* __restrict__ a_log,
                                         const float* __restrict__ dt_bias,
                                         float* __restrict__ gate, float* __restrict__ beta,
                                         int T, int T_pad, int H, int D, float lower_bound,
                                         int bounded) {
    const int qkv = H * D;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)T_pad * qkv) return;
    const int t = (int)(i / qkv), c = (int)(i % qkv);
    if (t >= T) {
        gate[i] = 0.0f;
        if (c < H) beta[(u64)t * H + c] = 0.0f;
        return;
    }
    gate[i] = kda_gate_value(bf2f(g_raw[i]) + dt_bias[c], expf(a_log[c / D]), lower_bound, bounded);
    if (c < H) beta[(u64)t * H + c] = sigmoidf_(bf2f(b_raw[(u64)t * ldb + c]));
}
