// RMSNorm from the FP32 residual stream to FP16 activations, float accumulation.
//
// Checked against: tinyloop.backends.numpy_ops.NumpyOps.rmsnorm
// (tests/kernels/test_kernels_gpu.py::test_rmsnorm).
// out[t, i] = x[t, i] / sqrt(mean(x[t]^2) + eps) * weight[i]   (Zhang & Sennrich 2019)
#include "common.cuh"

// x f32 [T, d]; weight f32 [d]; out f16 [T, d]. grid = T, block = 256.
extern "C" __global__ void rmsnorm_f32_f16(const float* __restrict__ x,
                                           const float* __restrict__ weight, double eps, i64 d,
                                           half_t* __restrict__ out) {
    __shared__ float red[32];
    const float* xr = x + (i64)blockIdx.x * d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
    ss = block_sum(ss, red);
    const float inv = (float)(1.0 / sqrt((double)ss / (double)d + eps));
    half_t* o = out + (i64)blockIdx.x * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) o[i] = f2h(xr[i] * inv * weight[i]);
}

// The norms of the looped architectures, on the residual stream (float accumulation, as
// above). Checked against NumpyOps.norm_residual / linear_norm_residual
// (tests/model/test_looped_ops_gpu.py).

// x f32 [T, d] = rmsnorm(x) * weight, in place (loop_norm, exit_norm, a sandwich layer's norm
// after the add). Each thread rewrites only the elements it read, after the block's sum, so
// x may be normed in place. grid = T, block = any multiple of 32.
extern "C" __global__ void rmsnorm_f32_inplace(float* x, const float* __restrict__ weight,
                                               double eps, i64 d) {
    __shared__ float red[32];
    float* xr = x + (i64)blockIdx.x * d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
    ss = block_sum(ss, red);
    const float inv = (float)(1.0 / sqrt((double)ss / (double)d + eps));
    for (int i = threadIdx.x; i < d; i += blockDim.x) xr[i] = xr[i] * inv * weight[i];
}

// residual f32 [T, d] += rmsnorm(y f16 [T, d]) * weight (a "pre_post" layer: the branch
// output normed before the add). grid = T, block = any multiple of 32.
extern "C" __global__ void rmsnorm_f16_add_f32(const half_t* __restrict__ y,
                                               const float* __restrict__ weight, double eps,
                                               i64 d, float* __restrict__ residual) {
    __shared__ float red[32];
    const half_t* yr = y + (i64)blockIdx.x * d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        const float v = h2f(yr[i]);
        ss = fmaf(v, v, ss);
    }
    ss = block_sum(ss, red);
    const float inv = (float)(1.0 / sqrt((double)ss / (double)d + eps));
    float* r = residual + (i64)blockIdx.x * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) r[i] += h2f(yr[i]) * inv * weight[i];
}
