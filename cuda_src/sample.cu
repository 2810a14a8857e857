// Greedy sampling on the device: argmax of one logit row, lowest id on ties; and the row's
// fault code, found by the same reduction at no extra cost: the winner is NaN if any logit is
// NaN, else +inf if any is +inf, and -inf only if every logit is -inf.
//
// Checked against: numpy_ops.sample_from_logits with temperature 0 (np.argmax: the first NaN
// wins if any, else the first maximum) and base.logit_fault / LOGIT_FAULTS for the code
// (tests/gpu/test_kernels.py::test_sample_greedy, ::test_sample_non_finite_logits_raise).
// The temperature / top-k / top-p path is CuPy array code in cuda_ops.py; it launches this
// kernel too, for the fault code.
#include "common.cuh"

// True when (v, i) ranks before (w, j): NaN first, then larger value, then lower id.
__device__ __forceinline__ bool before(float v, int i, float w, int j) {
    const bool vn = v != v, wn = w != w;
    if (vn || wn) return vn && (!wn || i < j);
    return v > w || (v == w && i < j);
}

// logits f32 [n]; writes the chosen id to result[0] and the fault code to result[1] (0 = the
// row can be sampled, 1 = a NaN, 2 = a +inf, 3 = all -inf; base.LOGIT_FAULTS) (device or
// mapped pinned host memory). grid = 1, block = 1024.
extern "C" __global__ void __launch_bounds__(1024)
    argmax_f32(const float* __restrict__ logits, i64 n, int* __restrict__ result) {
    __shared__ float sv[32];
    __shared__ int si[32];
    float bv = TL_NEG_INF;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = logits[i];
        if (before(v, i, bv, bi)) { bv = v; bi = i; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (before(ov, oi, bv, bi)) { bv = ov; bi = oi; }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x >> 5;
        bv = lane < nw ? sv[lane] : TL_NEG_INF;
        bi = lane < nw ? si[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (before(ov, oi, bv, bi)) { bv = ov; bi = oi; }
        }
        if (lane == 0) {
            result[0] = bi;
            result[1] = bv != bv ? 1 : (bv == -TL_NEG_INF ? 2 : (bv == TL_NEG_INF ? 3 : 0));
        }
    }
}
