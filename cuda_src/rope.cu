// RoPE on the fused QKV rows, and the KV-cache write.
//
// Checked against: NumpyOps.rope_kv with numpy_ops.rope_tables / apply_rope
// (tests/gpu/test_kernels.py::test_rope_kv).
// Interleaved pairs (GGML "normal" / GPT-J): pair i of each head, (x[2i], x[2i+1]), rotates by
// angle pos * theta^(-2i/head_dim). The angle and its cos/sin are computed in double, as the
// reference does, so large positions stay accurate; the rotation itself is float.
#include "common.cuh"

// qkv f16 [T, ld] (Q at 0, K at n_heads*hd, V at (n_heads+n_kv)*hd): Q rotated in place;
// k_cache / v_cache f16 [L, n_kv, hd]: rows pos0..pos0+T-1 written (K rotated, V copied).
// grid = T, block = 128; dynamic shared memory = hd * sizeof(float).
extern "C" __global__ void rope_kv(half_t* __restrict__ qkv, i64 ld, i64 pos0, double theta,
                                   i64 n_heads, i64 n_kv, i64 hd, half_t* __restrict__ k_cache,
                                   half_t* __restrict__ v_cache) {
    extern __shared__ float cs[];               // cos at [0, hd/2), sin at [hd/2, hd)
    const i64 t = blockIdx.x;
    const int half = (int)(hd / 2);
    const i64 pos = pos0 + t;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const double inv_freq = pow(theta, -(double)(2 * i) / (double)hd);
        double s, c;
        sincos((double)pos * inv_freq, &s, &c);
        cs[i] = (float)c;
        cs[half + i] = (float)s;
    }
    __syncthreads();
    half_t* row = qkv + t * ld;
    const i64 n_rot = (n_heads + n_kv) * half;   // Q pairs, then K pairs
    for (i64 idx = threadIdx.x; idx < n_rot; idx += blockDim.x) {
        const int i = (int)(idx % half);
        const i64 e = 2 * idx;                    // element offset of the pair in Q|K
        const float x0 = h2f(row[e]), x1 = h2f(row[e + 1]);
        const float c = cs[i], s = cs[half + i];
        const half_t r0 = f2h(x0 * c - x1 * s), r1 = f2h(x0 * s + x1 * c);
        if (idx < n_heads * half) {
            row[e] = r0;
            row[e + 1] = r1;
        } else {
            half_t* k = k_cache + pos * n_kv * hd + (e - n_heads * hd);
            k[0] = r0;
            k[1] = r1;
        }
    }
    const half_t* v = row + (n_heads + n_kv) * hd;
    for (i64 j = threadIdx.x; j < n_kv * hd; j += blockDim.x) v_cache[pos * n_kv * hd + j] = v[j];
}
