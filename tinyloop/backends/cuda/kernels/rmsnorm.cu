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
