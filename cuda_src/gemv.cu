// Quantized GEMV for decode (T = 1): y = x @ W.T with W group-quantized (INT4 / INT8, g = 32/64/128).
//
// Checked against: NumpyOps.linear / linear_residual / linear_swiglu / lm_head / inject at T = 1
// (tests/gpu/test_kernels.py::test_linear* with T=1, ::test_lm_head, ::test_inject), and the
// RMSNorm-fused entries gemv_norm_* against NumpyOps' rmsnorm + linear / linear_swiglu / lm_head
// composition and against CudaOps' own unfused composition (::test_rmsnorm_fused*).
//
// Memory-bound: every weight byte is read once with a 16-byte load and dequantized in registers.
// One warp per output row (two rows, gate and up, for SwiGLU); a lane takes 16-byte chunks
// of the row: 32 INT4 codes or 16 INT8 codes, which never straddle a group since g >= 32.
// Per group the dot product is factored: sum_k (q_k s + z) x_k = s * sum q_k x_k + z * sum x_k.
// Needs K % 32 == 0 and 16-byte aligned rows (the host wrapper checks).
//
// RMSNorm fusion (gemv_norm_*, decode only): the input is the FP32 residual row instead of an
// FP16 activation. Each block first normalizes the whole row into dynamic shared memory
// (K halves, 16-byte aligned) with exactly rmsnorm.cu's arithmetic, then its warps run the
// same per-row loop (gemv_row) reading x from shared memory, striding over rows by the grid
// (the host caps the grid at about one resident wave, so the row is normalized at most that
// many times). One launch replaces rmsnorm + GEMV; the FP16 normalized row never hits memory.
#include "common.cuh"

// Launch geometry shared with the host: the host passes these as -D options from
// tinyloop/backends/cuda_ops.py GEOMETRY (the one definition); the values below are defaults
// for a standalone nvcc build, kept equal to the table by tests/test_kernel_geometry.py.
#ifndef GEMV_WARPS
#define GEMV_WARPS 8
#endif

enum { EPI_F16 = 0, EPI_RESID = 1, EPI_SWIGLU = 2, EPI_F32 = 3 };

// Partial dot of one 16-byte chunk of row `row` with x; returns s*dot + z*sum(x).
template <int BITS>
__device__ __forceinline__ float chunk_dot(const uint4 wv, const half_t* __restrict__ x, int c,
                                           const half_t* __restrict__ sc,
                                           const half_t* __restrict__ zr, i64 row, int ngroups,
                                           int log2g) {
    const int n_el = BITS == 4 ? 32 : 16;
    const int col0 = c * n_el;
    const i64 gi = row * ngroups + (col0 >> log2g);
    const float s = h2f(sc[gi]), z = h2f(zr[gi]);
    const uint4* xv = (const uint4*)(x + col0);
    float dot = 0.0f, sx = 0.0f;
    const unsigned w[4] = {wv.x, wv.y, wv.z, wv.w};
    if (BITS == 4) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {          // word i holds elements 8i..8i+7, nibble j = 8i+j
            const uint4 xx = xv[i];
            const unsigned xs[4] = {xx.x, xx.y, xx.z, xx.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float x0 = h2_lo(xs[j]), x1 = h2_hi(xs[j]);
                const float q0 = (float)((w[i] >> (8 * j)) & 15u);
                const float q1 = (float)((w[i] >> (8 * j + 4)) & 15u);
                dot = fmaf(q0, x0, dot);
                dot = fmaf(q1, x1, dot);
                sx += x0 + x1;
            }
        }
    } else {
#pragma unroll
        for (int i = 0; i < 2; ++i) {          // words 2i, 2i+1 hold elements 8i..8i+7
            const uint4 xx = xv[i];
            const unsigned xs[4] = {xx.x, xx.y, xx.z, xx.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const unsigned ww = w[2 * i + j / 2];
                const int sh = 16 * (j & 1);
                const float x0 = h2_lo(xs[j]), x1 = h2_hi(xs[j]);
                const float q0 = (float)(signed char)((ww >> sh) & 0xFFu);
                const float q1 = (float)(signed char)((ww >> (sh + 8)) & 0xFFu);
                dot = fmaf(q0, x0, dot);
                dot = fmaf(q1, x1, dot);
                sx += x0 + x1;
            }
        }
    }
    return fmaf(s, dot, z * sx);
}

// One warp computes output row `row` (and `row + F` for SwiGLU) of y = x @ W.T and writes its
// epilogue. x f16 [K] (global or shared); W rows [N_w, K]; EPI_F16: out f16 [N];
// EPI_RESID: out f32 [N] +=; EPI_F32: out f32 [N]; EPI_SWIGLU: out f16 [F] =
// silu(x.W[r]) * (x.W[r+F]), N = F.
template <int BITS, int EPI>
__device__ __forceinline__ void gemv_row(const u8* __restrict__ qw, const half_t* __restrict__ sc,
                                         const half_t* __restrict__ zr,
                                         const half_t* __restrict__ x, i64 row, i64 K, i64 F,
                                         int log2g, void* __restrict__ out, int lane) {
    const i64 row_bytes = BITS == 4 ? K / 2 : K;
    const int chunks = (int)(row_bytes / 16);
    const int ngroups = (int)(K >> log2g);
    const uint4* w0 = (const uint4*)(qw + row * row_bytes);
    float acc0 = 0.0f, acc1 = 0.0f;
    if (EPI == EPI_SWIGLU) {
        const i64 row1 = row + F;
        const uint4* w1 = (const uint4*)(qw + row1 * row_bytes);
        for (int c = lane; c < chunks; c += 32) {
            const uint4 a = w0[c], b = w1[c];
            acc0 += chunk_dot<BITS>(a, x, c, sc, zr, row, ngroups, log2g);
            acc1 += chunk_dot<BITS>(b, x, c, sc, zr, row1, ngroups, log2g);
        }
        acc1 = warp_sum(acc1);
    } else {
        int c = lane;
        for (; c + 96 < chunks; c += 128) {       // four 16-byte loads in flight per lane
            const uint4 a0 = w0[c], a1 = w0[c + 32], a2 = w0[c + 64], a3 = w0[c + 96];
            acc0 += chunk_dot<BITS>(a0, x, c, sc, zr, row, ngroups, log2g);
            acc0 += chunk_dot<BITS>(a1, x, c + 32, sc, zr, row, ngroups, log2g);
            acc0 += chunk_dot<BITS>(a2, x, c + 64, sc, zr, row, ngroups, log2g);
            acc0 += chunk_dot<BITS>(a3, x, c + 96, sc, zr, row, ngroups, log2g);
        }
        for (; c < chunks; c += 32)
            acc0 += chunk_dot<BITS>(w0[c], x, c, sc, zr, row, ngroups, log2g);
    }
    acc0 = warp_sum(acc0);
    if (lane != 0) return;
    if (EPI == EPI_F16) ((half_t*)out)[row] = f2h(acc0);
    if (EPI == EPI_F32) ((float*)out)[row] = acc0;
    if (EPI == EPI_RESID) ((float*)out)[row] += acc0;
    if (EPI == EPI_SWIGLU) ((half_t*)out)[row] = f2h(acc0 / (1.0f + __expf(-acc0)) * acc1);
}

// x f16 [K] in global memory. grid = ceil(N / GEMV_WARPS), block = 32 * GEMV_WARPS.
template <int BITS, int EPI>
__device__ __forceinline__ void gemv_impl(const u8* __restrict__ qw,
                                          const half_t* __restrict__ sc,
                                          const half_t* __restrict__ zr,
                                          const half_t* __restrict__ x, i64 N, i64 K, i64 F,
                                          i64 log2g, void* __restrict__ out) {
    const i64 row = (i64)blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (row < N) gemv_row<BITS, EPI>(qw, sc, zr, x, row, K, F, (int)log2g, out, threadIdx.x & 31);
}

// The normalized row: xs[i] = f16(x[i] * inv_rms * weight[i]), computed exactly as
// rmsnorm.cu's rmsnorm_f32_f16 does (the same per-thread fmaf order over a 256-thread block,
// the same block_sum, the same double-precision rsqrt, the same two float products), so the
// FP16 values are bit-identical to the unfused rmsnorm output. Ends with a barrier.
static_assert(32 * GEMV_WARPS == 256, "bit-identity with rmsnorm.cu needs a 256-thread block");
extern __shared__ __align__(16) unsigned char gemv_smem[];

__device__ __forceinline__ void norm_row_to_shared(const float* __restrict__ xr,
                                                   const float* __restrict__ weight, double eps,
                                                   i64 d, half_t* xs) {
    __shared__ float red[32];
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
    ss = block_sum(ss, red);
    const float inv = (float)(1.0 / sqrt((double)ss / (double)d + eps));
    for (int i = threadIdx.x; i < d; i += blockDim.x) xs[i] = f2h(xr[i] * inv * weight[i]);
    __syncthreads();
}

// x f32 [K] (the residual row), weight f32 [K]; dynamic shared memory = 2 K bytes.
// grid <= ceil(N / GEMV_WARPS) (grid-stride over rows), block = 32 * GEMV_WARPS.
template <int BITS, int EPI>
__device__ __forceinline__ void gemv_norm_impl(const float* __restrict__ x,
                                               const float* __restrict__ weight, double eps,
                                               const u8* __restrict__ qw,
                                               const half_t* __restrict__ sc,
                                               const half_t* __restrict__ zr, i64 N, i64 K,
                                               i64 F, i64 log2g, void* __restrict__ out) {
    half_t* xs = (half_t*)gemv_smem;
    norm_row_to_shared(x, weight, eps, K, xs);
    const int lane = threadIdx.x & 31;
    // int row index (N < 2^30, the host checks): an i64 loop counter made ptxas spill here
    const int step = gridDim.x * GEMV_WARPS;
    for (int row = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5); row < N; row += step)
        gemv_row<BITS, EPI>(qw, sc, zr, xs, row, K, F, (int)log2g, out, lane);
}

#define GEMV_ENTRY(NAME, BITS, EPI)                                                           \
    extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)                            \
        NAME(const u8* qw, const half_t* sc, const half_t* zr, const half_t* x, i64 N, i64 K, \
             i64 F, i64 log2g, void* out) {                                                   \
        gemv_impl<BITS, EPI>(qw, sc, zr, x, N, K, F, log2g, out);                             \
    }

#define GEMV_NORM_ENTRY(NAME, BITS, EPI)                                                      \
    extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)                            \
        NAME(const float* x, const float* weight, double eps, const u8* qw, const half_t* sc, \
             const half_t* zr, i64 N, i64 K, i64 F, i64 log2g, void* out) {                   \
        gemv_norm_impl<BITS, EPI>(x, weight, eps, qw, sc, zr, N, K, F, log2g, out);           \
    }

GEMV_ENTRY(gemv_q4_f16, 4, EPI_F16)
GEMV_ENTRY(gemv_q4_resid, 4, EPI_RESID)
GEMV_ENTRY(gemv_q4_swiglu, 4, EPI_SWIGLU)
GEMV_ENTRY(gemv_q4_f32, 4, EPI_F32)
GEMV_ENTRY(gemv_q8_f16, 8, EPI_F16)
GEMV_ENTRY(gemv_q8_resid, 8, EPI_RESID)
GEMV_ENTRY(gemv_q8_swiglu, 8, EPI_SWIGLU)
GEMV_ENTRY(gemv_q8_f32, 8, EPI_F32)

// RMSNorm -> projection at T = 1 (CudaOps.rmsnorm_linear / _swiglu / rmsnorm_lm_head).
GEMV_NORM_ENTRY(gemv_norm_q4_f16, 4, EPI_F16)
GEMV_NORM_ENTRY(gemv_norm_q4_swiglu, 4, EPI_SWIGLU)
GEMV_NORM_ENTRY(gemv_norm_q4_f32, 4, EPI_F32)
GEMV_NORM_ENTRY(gemv_norm_q8_f16, 8, EPI_F16)
GEMV_NORM_ENTRY(gemv_norm_q8_swiglu, 8, EPI_SWIGLU)
GEMV_NORM_ENTRY(gemv_norm_q8_f32, 8, EPI_F32)
