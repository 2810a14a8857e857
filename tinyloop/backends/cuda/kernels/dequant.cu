// Dequantization of group-quantized rows: the embedding gather and the FP16 weight cache.
//
// Checked against: tinyloop.backends.numpy_ops.NumpyOps.embed and tinyloop.quant.dequantize
// (tests/kernels/test_kernels_gpu.py::test_embed, ::test_fp16_cache).
// Layout (tinyloop/quant.py): INT4 uint8 [rows, K/2], element 2k in the low nibble of byte k;
// INT8 int8 [rows, K]; FP16 scale/zero [rows, K/g]; w = q*scale + zero in float32.
#include "common.cuh"

template <int BITS>
__device__ __forceinline__ float load_dq(const u8* __restrict__ qw, const half_t* __restrict__ sc,
                                         const half_t* __restrict__ zr, i64 row, int col, int K,
                                         int log2g) {
    float q;
    if (BITS == 4) {
        const u8 b = qw[row * (K / 2) + (col >> 1)];
        q = (float)((col & 1) ? (b >> 4) : (b & 15));
    } else {
        q = (float)((const i8*)qw)[row * K + col];
    }
    const i64 gi = row * (K >> log2g) + (col >> log2g);
    return dq(q, h2f(sc[gi]), h2f(zr[gi]));
}

// out f32 [T, K]: row t = dequantized row ids[t] (or id0 when ids is null: the T=1 decode path
// passes the token id by value, so nothing is uploaded). An id outside 0..vocab-1 gives a NaN
// row instead of an out-of-bounds read. grid = T, block = 256.
template <int BITS>
__device__ void embed_impl(const u8* __restrict__ qw, const half_t* __restrict__ sc,
                           const half_t* __restrict__ zr, const int* __restrict__ ids, i64 id0,
                           i64 K, i64 vocab, i64 log2g, float* __restrict__ out) {
    const i64 t = blockIdx.x;
    const i64 id = ids ? (i64)ids[t] : id0;
    float* o = out + t * K;
    if (id < 0 || id >= vocab) {
        for (int c = threadIdx.x; c < K; c += blockDim.x) o[c] = TL_NAN;
        return;
    }
    for (int c = threadIdx.x; c < K; c += blockDim.x)
        o[c] = load_dq<BITS>(qw, sc, zr, id, c, (int)K, (int)log2g);
}

#ifndef TL_DEVICE_ONLY
extern "C" __global__ void embed_q4(const u8* qw, const half_t* sc, const half_t* zr,
                                    const int* ids, i64 id0, i64 K, i64 vocab, i64 log2g,
                                    float* out) {
    TL_PDL_ENTER();
    embed_impl<4>(qw, sc, zr, ids, id0, K, vocab, log2g, out);
}

extern "C" __global__ void embed_q8(const u8* qw, const half_t* sc, const half_t* zr,
                                    const int* ids, i64 id0, i64 K, i64 vocab, i64 log2g,
                                    float* out) {
    TL_PDL_ENTER();
    embed_impl<8>(qw, sc, zr, ids, id0, K, vocab, log2g, out);
}

// out f16 [N, K] = dequantized W (the FP16 weight cache). grid = N, block = 256.
template <int BITS>
__device__ void dequant_f16_impl(const u8* __restrict__ qw, const half_t* __restrict__ sc,
                                 const half_t* __restrict__ zr, i64 K, i64 log2g,
                                 half_t* __restrict__ out) {
    const i64 row = blockIdx.x;
    for (int c = threadIdx.x; c < K; c += blockDim.x)
        out[row * K + c] = f2h(load_dq<BITS>(qw, sc, zr, row, c, (int)K, (int)log2g));
}

extern "C" __global__ void dequant_f16_q4(const u8* qw, const half_t* sc, const half_t* zr,
                                          i64 K, i64 log2g, half_t* out) {
    dequant_f16_impl<4>(qw, sc, zr, K, log2g, out);
}

extern "C" __global__ void dequant_f16_q8(const u8* qw, const half_t* sc, const half_t* zr,
                                          i64 K, i64 log2g, half_t* out) {
    dequant_f16_impl<8>(qw, sc, zr, K, log2g, out);
}
#endif  // TL_DEVICE_ONLY
