// Greedy sampling on the device: argmax of one logit row, lowest id on ties.
//
// Checked against: numpy_ops.sample_from_logits with temperature 0 (np.argmax: the first NaN
// wins if any, else the first maximum) (tests/gpu/test_kernels.py::test_sample_greedy).
// The LM head's own fused argmax (gemv2_norm_q*_argmax in gemv.cu) uses the same order
// (common.cuh argmax_before). The temperature / top-k / top-p path is CuPy array code in
// cuda_ops.py.
#include "common.cuh"

// logits f32 [n]; writes the chosen id to *result (device or mapped pinned host memory).
// grid = 1, block = 1024.
extern "C" __global__ void __launch_bounds__(1024)
    argmax_f32(const float* __restrict__ logits, i64 n, int* __restrict__ result) {
    __shared__ float sv[32];
    __shared__ int si[32];
    float bv = TL_NEG_INF;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = logits[i];
        if (argmax_before(v, i, bv, bi)) { bv = v; bi = i; }
    }
    block_argmax(bv, bi, sv, si);
    if (threadIdx.x == 0) *result = bi;
}
