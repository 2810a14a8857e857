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

// --- the looped architectures' elementwise ops ------------------------------------------------
// Checked against NumpyOps.scale, NumpyOps.add_bias and base.seeded_state
// (tests/model/test_looped_ops_gpu.py).

// x f32 [n] *= s (embed_scale). grid = ceil(n / 256), block = 256.
extern "C" __global__ void scale_f32(float* __restrict__ x, i64 n, double s) {
    TL_PDL_ENTER();
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= (float)s;
}

// x f16 [T, n] += bias f32 [n] (qkv_bias: the QKV rows before RoPE and the K/V write).
// grid = (ceil(n / 256), T), block = 256.
extern "C" __global__ void add_bias_f16(half_t* __restrict__ x, const float* __restrict__ bias,
                                        i64 n) {
    TL_PDL_ENTER();
    const i64 t = blockIdx.y;
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[t * n + i] = f2h(h2f(x[t * n + i]) + bias[i]);
}

// SplitMix64's output function (Steele, Lea & Flood 2014); base.splitmix64.
__device__ __forceinline__ unsigned long long splitmix64(unsigned long long z) {
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

#ifndef STATE_ATTEMPTS
#define STATE_ATTEMPTS 64
#endif

// out f32 [T, d] = base.seeded_state(p0, T, d, std, seed): element (p, i) is std * z, z the
// first Box-Muller draw of attempts 0, 1, ... (two uniforms from splitmix64 of the counter
// (seed, p, i, attempt)) within +-trunc (base.STATE_TRUNCATE), 0 when none of STATE_ATTEMPTS is. p0 is
// step[2] (the device step state's position, STEP_POS) when step is not null, else pos0, so a
// captured decode step draws its own position's state. grid = (ceil(d / 256), T), block = 256.
__device__ __forceinline__ void init_state_elem(float* __restrict__ out, i64 t, i64 pos, i64 d,
                                                double std, double trunc, i64 seed) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= d) return;
    const unsigned long long p = (unsigned long long)pos;
    const unsigned long long base =
        splitmix64(splitmix64(splitmix64((unsigned long long)seed) ^ p) ^
                   ((unsigned long long)i << 8));
    double z = 0.0;
    for (unsigned long long a = 0; a < 2 * STATE_ATTEMPTS; a += 2) {
        const double u1 = (double)(splitmix64(base ^ a) >> 11) * 0x1.0p-53;
        const double u2 = (double)(splitmix64(base ^ (a + 1)) >> 11) * 0x1.0p-53;
        const double cand = sqrt(-2.0 * log1p(-u1)) * cos(2.0 * 3.141592653589793 * u2);
        if (fabs(cand) <= trunc) {
            z = cand;
            break;
        }
    }
    out[t * d + i] = (float)(z * std);
}

extern "C" __global__ void init_state_f32(float* __restrict__ out, i64 pos0,
                                          const int* __restrict__ step, i64 d, double std,
                                          double trunc, i64 seed) {
    TL_PDL_ENTER();
    const i64 t = blockIdx.y;
    init_state_elem(out, t, (step != nullptr ? (i64)step[2] : pos0) + t, d, std, trunc, seed);
}

// A decode batch (tinyloop/backends/cuda/norms.py init_state_rows): row t of out at its own
// position pos[t] (i64 [T], the step's device index, tinyloop/kv/cache.py batch_index), the
// same draws. grid = (ceil(d / 256), T), block = 256.
extern "C" __global__ void init_state_rows_f32(float* __restrict__ out,
                                               const i64* __restrict__ pos, i64 d, double std,
                                               double trunc, i64 seed) {
    TL_PDL_ENTER();
    const i64 t = blockIdx.y;
    init_state_elem(out, t, pos[t], d, std, trunc, seed);
}
