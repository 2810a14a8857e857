// Small elementwise kernels around the matrix products: SwiGLU, residual add, injection concat.
//
// Checked against: NumpyOps.linear_swiglu (silu(g) * u, numpy_ops.silu), NumpyOps.linear_residual
// (the cuBLAS FP16-cache path's `residual += x @ W.T`), NumpyOps.inject (`[state, e]`)
// (tests/kernels/test_kernels_gpu.py::test_linear_swiglu, ::test_linear_residual, ::test_inject).
#include "common.cuh"

// gu f16 [T, 2F] (gate columns 0..F, up columns F..2F) -> out f16 [T, F] = silu(g) * u.
// grid = (ceil(F / 256), T), block = 256.
extern "C" __global__ void swiglu_f16(const half_t* __restrict__ gu, i64 F,
                                      half_t* __restrict__ out) {
    TL_PDL_ENTER();
    const i64 t = blockIdx.y;
    const i64 f = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (f >= F) return;
    const float g = h2f(gu[t * 2 * F + f]);
    const float u = h2f(gu[t * 2 * F + F + f]);
    out[t * F + f] = f2h(g / (1.0f + __expf(-g)) * u);
}

// residual f32 [n] += y f16 [n]. grid = ceil(n / 256), block = 256.
extern "C" __global__ void add_f16_to_f32(const half_t* __restrict__ y, i64 n,
                                          float* __restrict__ residual) {
    TL_PDL_ENTER();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) residual[i] += h2f(y[i]);
}

// cat f16 [T, 2d] = [f16(state), f16(e)]; state f32 [T, d]; e f32 (E_F16 = 0) or f16 [T, d].
// grid = (ceil(d / 256), T), block = 256.
template <bool E_F16>
__device__ void concat_impl(const float* __restrict__ state, const void* __restrict__ e, i64 d,
                            half_t* __restrict__ cat) {
    const i64 t = blockIdx.y;
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= d) return;
    cat[t * 2 * d + i] = f2h(state[t * d + i]);
    cat[t * 2 * d + d + i] = E_F16 ? ((const half_t*)e)[t * d + i]
                                   : f2h(((const float*)e)[t * d + i]);
}

extern "C" __global__ void concat_inject_f32(const float* state, const void* e, i64 d,
                                             half_t* cat) {
    TL_PDL_ENTER();
    concat_impl<false>(state, e, d, cat);
}

extern "C" __global__ void concat_inject_f16(const float* state, const void* e, i64 d,
                                             half_t* cat) {
    TL_PDL_ENTER();
    concat_impl<true>(state, e, d, cat);
}

// out f32 [n] = f32(y f16 [n]) (the FP16-cache path writing an f32 destination).
extern "C" __global__ void copy_f16_to_f32(const half_t* __restrict__ y, i64 n,
                                           float* __restrict__ out) {
    TL_PDL_ENTER();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = h2f(y[i]);
}
