// The store-h KV modes (h_fp16, h_int8, h_int4): writing the normed QKV input h into the
// slot's pages, reading it back for reconstruction, and attention over one reconstructed chunk
// with the online-softmax state carried across chunks (tinyloop/kvcache.py PageLayout; issue 8).
//
// Checked against: numpy_ops.encode_h / decode_h (quant.quantize / quant.dequantize,
// kvcache.hadamard_rotate) and NumpyOps.kv_attention (tests/gpu/test_kv_h.py).
//
// Page parts (byte offsets from the page start, given by the host): h_fp16: h f16 [P, d];
// h_int8: codes i8 [P, d], scales f16 [P, d/32]; h_int4: codes u8 [P, d/2] (two a byte, low
// nibble first), scales f16 [P, d/32], zeros f16 [P, d/32]. Groups of 32 channels (H_GROUP):
// one warp per group, lane = channel.
//
// Codes are quant.quantize's, bit for bit, for the same FP16 input rows:
//   INT8 (symmetric): s = fp16(amax / 127) (float32 division), q = clip(rint(x / s), +-127)
//        against the rounded s; s = 0 -> codes 0 (quant.quantize_rows_int8).
//   INT4 (asymmetric min/max): s = fp16((hi - lo) / 15), z = fp16(lo) (float32 arithmetic),
//        q = clip(rint((x - z) / s), 0, 15) against the rounded s and z; s = 0 -> codes 0.
// The optional Hadamard rotation (rot = 32: the Sylvester matrix of order 32 over each group,
// orthonormal, so the same call undoes it) is computed as the reference does (hadamard32).
#include "common.cuh"

#define H_FP16 0
#define H_INT8 1
#define H_INT4 2
#define H_MAX_PAIRS 4            // h_attn_chunk: head_dim <= 256 (<= 4 pairs per lane)

// y_lane = (sum_i +-x_i) / sqrt(32), the sign of x_i being (-1)^popcount(i & lane): the
// orthonormal Sylvester Hadamard of order 32 (kvcache.hadamard_rotate, in the same arithmetic:
// float64 sums of float32 values, exact while a group's magnitudes span < ~2^24, one float64
// division, one rounding to float32). Every lane of the warp calls it with its own x.
__device__ __forceinline__ float hadamard32(float x, int lane) {
    double acc = 0.0;
#pragma unroll 8
    for (int i = 0; i < 32; ++i) {
        const double xi = (double)__shfl_sync(0xffffffffu, x, i);
        acc = __dadd_rn(acc, (__popc(i & lane) & 1) ? -xi : xi);
    }
    return __double2float_rn(__ddiv_rn(acc, sqrt(32.0)));
}

// The page of position `pos` and its row inside it.
__device__ __forceinline__ char* h_page(const i64* __restrict__ table, i64 P, i64 pos,
                                        i64* row) {
    const i64 pg = pos / P;
    *row = pos - pg * P;
    return (char*)table[pg];
}

// h f16 [T, ldh] (first d columns): rows stored at positions pos0.. (pos0 = step[2] when `step`
// is non-null: the device step state's STEP_POS). grid = T, block = 256 (8 warps).
template <int MODE>
__device__ void h_write_impl(const half_t* __restrict__ h, i64 ldh, i64 pos0,
                             const int* __restrict__ step, const i64* __restrict__ table, i64 P,
                             i64 d, i64 h_off, i64 s_off, i64 z_off, i64 rot) {
    const i64 t = blockIdx.x;
    const i64 pos = (step ? (i64)step[2] : pos0) + t;
    i64 prow = 0;
    char* base = h_page(table, P, pos, &prow);
    const half_t* src = h + t * ldh;
    if (MODE == H_FP16) {
        half_t* dst = (half_t*)(base + h_off) + prow * d;
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) dst[j] = src[j];
        return;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const i64 ng = d / 32;
    for (i64 g = warp; g < ng; g += nw) {
        float x = h2f(src[g * 32 + lane]);
        if (rot) x = hadamard32(x, lane);
        half_t s16, z16 = 0;
        if (MODE == H_INT8) {
            const float amax = warp_max(fabsf(x));
            s16 = f2h(__fdiv_rn(amax, 127.0f));
            const float s = h2f(s16);
            float q = s > 0.0f ? rintf(__fdiv_rn(x, s)) : 0.0f;
            q = fminf(fmaxf(q, -127.0f), 127.0f);
            ((i8*)(base + h_off))[prow * d + g * 32 + lane] = (i8)(int)q;
        } else {
            const float hi = warp_max(x), lo = -warp_max(-x);
            s16 = f2h(__fdiv_rn(__fsub_rn(hi, lo), 15.0f));
            z16 = f2h(lo);
            const float s = h2f(s16), z = h2f(z16);
            float q = s > 0.0f ? rintf(__fdiv_rn(__fsub_rn(x, z), s)) : 0.0f;
            q = fminf(fmaxf(q, 0.0f), 15.0f);
            const int qi = (int)q;
            const int up = __shfl_down_sync(0xffffffffu, qi, 1);   // the odd neighbour's code
            if (!(lane & 1))
                ((u8*)(base + h_off))[prow * (d / 2) + g * 16 + lane / 2] = (u8)(qi | (up << 4));
        }
        if (lane == 0) {
            ((half_t*)(base + s_off))[prow * ng + g] = s16;
            if (MODE == H_INT4) ((half_t*)(base + z_off))[prow * ng + g] = z16;
        }
    }
}

#define H_WRITE_ENTRY(MODE, NAME)                                                              \
    extern "C" __global__ void h_write_##NAME(const half_t* h, i64 ldh, i64 pos0,             \
                                              const int* step, const i64* table, i64 P, i64 d, \
                                              i64 h_off, i64 s_off, i64 z_off, i64 rot) {      \
        h_write_impl<MODE>(h, ldh, pos0, step, table, P, d, h_off, s_off, z_off, rot);         \
    }

H_WRITE_ENTRY(H_FP16, h_fp16)
H_WRITE_ENTRY(H_INT8, h_int8)
H_WRITE_ENTRY(H_INT4, h_int4)

// Positions c0..c0+n-1 of the slot, dequantized (x = q * s + z in float32, quant.dequantize's
// order; z = 0 for INT8), rotated back when rot = 32, rounded to FP16 into out f16 [n, d].
// grid = n, block = 256 (8 warps).
template <int MODE>
__device__ void h_read_impl(const i64* __restrict__ table, i64 P, i64 c0, i64 d, i64 h_off,
                            i64 s_off, i64 z_off, i64 rot, half_t* __restrict__ out) {
    const i64 r = blockIdx.x;
    i64 prow = 0;
    const char* base = h_page(table, P, c0 + r, &prow);
    half_t* dst = out + r * d;
    if (MODE == H_FP16) {
        const half_t* src = (const half_t*)(base + h_off) + prow * d;
        for (i64 j = threadIdx.x; j < d; j += blockDim.x) dst[j] = src[j];
        return;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const i64 ng = d / 32;
    for (i64 g = warp; g < ng; g += nw) {
        const float s = h2f(((const half_t*)(base + s_off))[prow * ng + g]);
        float q, z = 0.0f;
        if (MODE == H_INT8) {
            q = (float)((const i8*)(base + h_off))[prow * d + g * 32 + lane];
        } else {
            const u8 b = ((const u8*)(base + h_off))[prow * (d / 2) + g * 16 + lane / 2];
            q = (float)((lane & 1) ? (b >> 4) : (b & 0x0F));
            z = h2f(((const half_t*)(base + z_off))[prow * ng + g]);
        }
        float x = dq(q, s, z);
        if (rot) x = hadamard32(x, lane);
        dst[g * 32 + lane] = f2h(x);
    }
}

#define H_READ_ENTRY(MODE, NAME)                                                               \
    extern "C" __global__ void h_read_##NAME(const i64* table, i64 P, i64 c0, i64 d,           \
                                             i64 h_off, i64 s_off, i64 z_off, i64 rot,         \
                                             half_t* out) {                                    \
        h_read_impl<MODE>(table, P, c0, d, h_off, s_off, z_off, rot, out);                     \
    }

H_READ_ENTRY(H_FP16, h_fp16)
H_READ_ENTRY(H_INT8, h_int8)
H_READ_ENTRY(H_INT4, h_int4)

// Causal GQA attention of the T query rows (qkv f16 [T, ld], rotated Q of head h at columns
// h*hd..) over ONE chunk of keys: positions c0..c0+n-1, rebuilt in kv f16 [n, 2 n_kv hd]
// (rotated K of KV head hk at columns hk*hd, V at n_kv*hd + hk*hd). Query row t (position
// pos0 + t) sees keys at positions <= pos0 + t. The online-softmax state of (row, head) is
// carried in state f32 [T, n_heads, hd + 2] (acc[hd], running max m in log2 units, sum l):
// `first` starts it (m = -inf, l = 0, acc = 0), `last` normalises it into out f16
// [T, n_heads hd] instead of storing it (Milakov & Gimelshein 2018). Scores are
// (q . k) * scale_log2 with scale_log2 = log2(e) / sqrt(hd), so exp2 gives the softmax.
// grid = (T, n_heads); block = 32 * nw threads, 8 <= nw <= 32 warps (blockDim.x >= hd): warp w
// takes the keys w, w + nw, ... with its own (m, l, acc), lane l holding the dimension pairs
// l, l + 32, ...; the block then merges the nw partial states and the carried one, thread i
// owning dimension i. Dynamic shared memory: nw * (hd + 2) floats.
extern "C" __global__ void h_attn_chunk(const half_t* __restrict__ qkv, i64 ld, i64 pos0,
                                        const half_t* __restrict__ kv, i64 c0, i64 n,
                                        i64 n_heads, i64 n_kv, i64 hd, double scale_log2,
                                        float* __restrict__ state, i64 first, i64 last,
                                        half_t* __restrict__ out) {
    extern __shared__ float part[];               // [nw][hd + 2]: acc, then m, l
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const i64 t = blockIdx.x, head = blockIdx.y;
    const i64 hk = head / (n_heads / n_kv);
    const int half = (int)(hd / 2);
    const float sl2 = (float)scale_log2;
    float q[H_MAX_PAIRS][2], acc[H_MAX_PAIRS][2];
#pragma unroll
    for (int u = 0; u < H_MAX_PAIRS; ++u) {
        const int i = lane + 32 * u;
        q[u][0] = q[u][1] = acc[u][0] = acc[u][1] = 0.0f;
        if (i < half) {
            const unsigned w = *(const unsigned*)(qkv + t * ld + head * hd + 2 * i);
            q[u][0] = h2_lo(w) * sl2;
            q[u][1] = h2_hi(w) * sl2;
        }
    }
    float m = TL_NEG_INF, l = 0.0f;
    const i64 kvld = 2 * n_kv * hd;
    i64 kend = pos0 + t - c0 + 1;                 // keys 0..kend-1 of the chunk are visible
    if (kend > n) kend = n;
    for (i64 j = warp; j < kend; j += nw) {
        const half_t* krow = kv + j * kvld + hk * hd;
        const half_t* vrow = krow + n_kv * hd;
        float s = 0.0f;
#pragma unroll
        for (int u = 0; u < H_MAX_PAIRS; ++u) {
            const int i = lane + 32 * u;
            if (i < half) {
                const unsigned w = *(const unsigned*)(krow + 2 * i);
                s = fmaf(q[u][0], h2_lo(w), s);
                s = fmaf(q[u][1], h2_hi(w), s);
            }
        }
        s = warp_sum(s);
        const float m_new = fmaxf(m, s);
        const float alpha = exp2f(m - m_new);     // m = -inf: 0 (m_new is finite)
        const float p = exp2f(s - m_new);
        l = l * alpha + p;
#pragma unroll
        for (int u = 0; u < H_MAX_PAIRS; ++u) {
            const int i = lane + 32 * u;
            if (i < half) {
                const unsigned w = *(const unsigned*)(vrow + 2 * i);
                acc[u][0] = acc[u][0] * alpha + p * h2_lo(w);
                acc[u][1] = acc[u][1] * alpha + p * h2_hi(w);
            }
        }
        m = m_new;
    }
    float* mine = part + warp * (hd + 2);
#pragma unroll
    for (int u = 0; u < H_MAX_PAIRS; ++u) {
        const int i = lane + 32 * u;
        if (i < half) {
            mine[2 * i] = acc[u][0];
            mine[2 * i + 1] = acc[u][1];
        }
    }
    if (lane == 0) {
        mine[hd] = m;
        mine[hd + 1] = l;
    }
    __syncthreads();
    // merge: the carried state (unless first) and the nw partials, rescaled to the joint max
    float* st = state + (t * n_heads + head) * (hd + 2);
    float m_all = first ? TL_NEG_INF : st[hd];
    for (int w = 0; w < nw; ++w) m_all = fmaxf(m_all, part[w * (hd + 2) + hd]);
    // a row's first chunk holds key 0, which it sees, so m_all is finite; a part that saw no
    // key (m = -inf) weighs 0
    const int i = threadIdx.x;
    float a_sum = 0.0f, l_sum = 0.0f;
    if (!first) {
        const float f = exp2f(st[hd] - m_all);
        l_sum = st[hd + 1] * f;
        if (i < hd) a_sum = st[i] * f;
    }
    for (int w = 0; w < nw; ++w) {
        const float* pw = part + w * (hd + 2);
        const float f = pw[hd] == TL_NEG_INF ? 0.0f : exp2f(pw[hd] - m_all);
        l_sum += pw[hd + 1] * f;
        if (i < hd) a_sum += pw[i] * f;
    }
    if (last) {
        if (i < hd) out[(t * n_heads + head) * hd + i] = f2h(l_sum > 0.0f ? a_sum / l_sum : 0.0f);
        return;
    }
    __syncthreads();                               // every thread has read st before it moves
    if (i < hd) st[i] = a_sum;
    if (i == 0) {
        st[hd] = m_all;
        st[hd + 1] = l_sum;
    }
}
