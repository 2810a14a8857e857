// The store-h KV modes (h_fp16, h_int8, h_int4): writing the normed QKV input h into the
// slot's pages, reading it back for reconstruction, and attention over one reconstructed chunk
// with the online-softmax state carried across chunks (tinyloop/kv/layouts.py PageLayout).
//
// Checked against: numpy_ops.encode_h / decode_h (quant.quantize_rows_int8,
// numpy_ops.encode_h_int4 / decode_h_int4, kv.layouts.hadamard_rotate) and
// NumpyOps.kv_attention (tests/kv/test_kv_h_gpu.py).
//
// Page parts (byte offsets from the page start, given by the host): h_fp16: h f16 [P, d];
// h_int8: codes i8 [P, d], scales f16 [P, d/32]; h_int4: codes u8 [P, d/2] (two a byte, low
// nibble first), scales f16 [P, d/32] (sign bit H_ROT_FLAG: the group is stored in the
// Hadamard basis), zeros f16 [P, d/32], and k outlier channels: indices u16 [P, k], values
// f16 [P, k]. Groups of 32 channels (H_GROUP): one warp per group, lane = channel.
//
// The bytes are the NumPy reference's, bit for bit, for the same FP16 input rows; FP16 scales
// and zeros saturate (common.cuh f2h_scale: clamped to +-F16_MAX, NaN for a group holding a
// NaN or an infinity, whose codes are 0):
//   INT8 (symmetric): s = fp16(amax / 127) (float32 division), q = clip(rint(x / s), +-127)
//        against the rounded s; s = 0 -> codes 0 (quant.quantize_rows_int8).
//   INT4 (numpy_ops.encode_h_int4): the k channels of largest |h| of the row (NaN below every
//        number, ties to the lower channel) are kept as FP16; then each group is quantized
//        asymmetric min/max, s = fp16((hi - lo) / 15), z = fp16(lo) (float32 arithmetic),
//        q = clip(rint((x - z) / s), 0, 15) against the rounded s and z (s = 0 -> codes 0),
//        in up to four ways - its values, or its outlier channels set to 0; in the plain or
//        (rot = 32) the Hadamard basis - keeping the first way of least float32 squared error
//        (warp_sum's order) over its non-outlier channels.
// The Hadamard rotation (the Sylvester matrix of order 32 over one group, orthonormal, so the
// same call undoes it) is computed as the reference does (hadamard32).
#include "common.cuh"

#define H_FP16 0
#define H_INT8 1
#define H_INT4 2
#define H_MAX_PAIRS 4            // h_attn_chunk: head_dim <= 256 (<= 4 pairs per lane)
// h_int4: outlier channels per row, at most (compile.py GEOMETRY)
#ifndef H_MAX_OUTLIERS
#define H_MAX_OUTLIERS 4
#endif
#define H_ROT_FLAG 0x8000u       // h_int4 scale's sign bit: the group is in the Hadamard basis

// y_lane = (sum_i +-x_i) / sqrt(32), the sign of x_i being (-1)^popcount(i & lane): the
// orthonormal Sylvester Hadamard of order 32 (kv.layouts.hadamard_rotate, in the same arithmetic:
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

// Whether (key k, channel j) ranks above (bk, bj): the larger key, then the lower channel.
__device__ __forceinline__ bool h_ranks_above(float k, int j, float bk, int bj) {
    return k > bk || (k == bk && j < bj);
}

// The k (<= H_MAX_OUTLIERS) channels of largest |x| of the row src f16 [d], largest first, into
// idx (shared), as numpy_ops.select_outliers ranks them (key |x|, -1 for NaN; ties to the lower
// channel). The whole block calls it; red_k / red_j: shared scratch of 32 entries.
__device__ void h_select_outliers(const half_t* __restrict__ src, i64 d, int k, int* idx,
                                  float* red_k, int* red_j) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int r = 0; r < k; ++r) {
        float bk = -2.0f;                         // below every key
        int bj = (int)d;
        for (int j = threadIdx.x; j < (int)d; j += blockDim.x) {
            bool taken = false;
            for (int u = 0; u < r; ++u) taken = taken || idx[u] == j;
            const float x = h2f(src[j]);
            const float key = x != x ? -1.0f : fabsf(x);
            if (!taken && h_ranks_above(key, j, bk, bj)) {
                bk = key;
                bj = j;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ok = __shfl_xor_sync(0xffffffffu, bk, o);
            const int oj = __shfl_xor_sync(0xffffffffu, bj, o);
            if (h_ranks_above(ok, oj, bk, bj)) {
                bk = ok;
                bj = oj;
            }
        }
        if (lane == 0) {
            red_k[warp] = bk;
            red_j[warp] = bj;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 1; w < nw; ++w)
                if (h_ranks_above(red_k[w], red_j[w], bk, bj)) {
                    bk = red_k[w];
                    bj = red_j[w];
                }
            idx[r] = bj;
        }
        __syncthreads();
    }
}

// One way of quantizing an INT4 group (numpy_ops.quantize_int4_groups): lane's value v (x, or
// 0 at an outlier channel), in the Hadamard basis when rot; x is the lane's own input and
// `skip` marks an outlier channel (its error does not count). Every lane gets the group's
// sum of squared errors of the reconstruction against x (+inf when not finite).
struct H4Way {
    int q;
    half_t s16, z16;
    float sse;
};

__device__ __forceinline__ H4Way h4_way(float v, float x, bool skip, bool rot, int lane) {
    H4Way w;
    const float y = rot ? hadamard32(v, lane) : v;
    const bool ok = __all_sync(0xffffffffu, tl_finite(y));   // else NaN scale, codes 0
    const float hi = warp_max(y), lo = -warp_max(-y);
    w.s16 = f2h_scale(__fdiv_rn(__fsub_rn(hi, lo), 15.0f), ok);
    w.z16 = f2h_scale(lo, ok);
    const float s = h2f(w.s16), z = h2f(w.z16);
    float q = s > 0.0f ? rintf(__fdiv_rn(__fsub_rn(y, z), s)) : 0.0f;
    q = fminf(fmaxf(q, 0.0f), 15.0f);
    w.q = (int)q;
    float back = dq(q, s, z);
    if (rot) back = hadamard32(back, lane);
    const float e = skip ? 0.0f : __fsub_rn(back, x);
    const float sse = warp_sum(__fmul_rn(e, e));
    w.sse = sse != sse ? -TL_NEG_INF : sse;
    if (rot) w.s16 = (half_t)(w.s16 | H_ROT_FLAG);
    return w;
}

// h f16 [T, ldh] (first d columns): rows stored at positions pos0.. (pos0 = step[2] when `step`
// is non-null: the device step state's STEP_POS). grid = T, block = 256 (8 warps). h_int4:
// rot = 0 or 32 (the Hadamard basis allowed), k outlier channels (<= H_MAX_OUTLIERS) at
// oi_off / ov_off.
template <int MODE>
__device__ void h_write_impl(const half_t* __restrict__ h, i64 ldh, i64 pos0,
                             const int* __restrict__ step, const i64* __restrict__ table, i64 P,
                             i64 d, i64 h_off, i64 s_off, i64 z_off, i64 rot, i64 k,
                             i64 oi_off, i64 ov_off) {
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
    __shared__ int oidx[H_MAX_OUTLIERS];
    __shared__ float red_k[32];
    __shared__ int red_j[32];
    const int nk = MODE == H_INT4 ? (int)k : 0;
    if (nk > 0) {
        h_select_outliers(src, d, nk, oidx, red_k, red_j);
        if ((int)threadIdx.x < nk) {
            ((unsigned short*)(base + oi_off))[prow * nk + threadIdx.x] =
                (unsigned short)oidx[threadIdx.x];
            ((half_t*)(base + ov_off))[prow * nk + threadIdx.x] = src[oidx[threadIdx.x]];
        }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const i64 ng = d / 32;
    for (i64 g = warp; g < ng; g += nw) {
        const float x = h2f(src[g * 32 + lane]);
        half_t s16, z16 = 0;
        if (MODE == H_INT8) {
            const bool ok = __all_sync(0xffffffffu, tl_finite(x));   // else NaN scale, codes 0
            const float amax = warp_max(fabsf(x));
            s16 = f2h_scale(__fdiv_rn(amax, 127.0f), ok);
            const float s = h2f(s16);
            float q = s > 0.0f ? rintf(__fdiv_rn(x, s)) : 0.0f;
            q = fminf(fmaxf(q, -127.0f), 127.0f);
            ((i8*)(base + h_off))[prow * d + g * 32 + lane] = (i8)(int)q;
        } else {
            bool skip = false;                    // lane's channel is an outlier
            for (int u = 0; u < nk; ++u) skip = skip || oidx[u] == (int)(g * 32 + lane);
            const bool any = __any_sync(0xffffffffu, skip);
            const float v = skip ? 0.0f : x;
            // the ways in numpy_ops.encode_h_int4's order; a way equal to an earlier one
            // (no outlier in the group) cannot win a strict comparison and is not tried
            H4Way best = h4_way(x, x, skip, false, lane);
            if (any) {
                const H4Way w = h4_way(v, x, skip, false, lane);
                if (w.sse < best.sse) best = w;
            }
            if (rot) {
                H4Way w = h4_way(x, x, skip, true, lane);
                if (w.sse < best.sse) best = w;
                if (any) {
                    w = h4_way(v, x, skip, true, lane);
                    if (w.sse < best.sse) best = w;
                }
            }
            s16 = best.s16;
            z16 = best.z16;
            const int up = __shfl_down_sync(0xffffffffu, best.q, 1);   // the odd neighbour's
            if (!(lane & 1))
                ((u8*)(base + h_off))[prow * (d / 2) + g * 16 + lane / 2] =
                    (u8)(best.q | (up << 4));
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
                                              i64 h_off, i64 s_off, i64 z_off, i64 rot, i64 k, \
                                              i64 oi_off, i64 ov_off) {                        \
        h_write_impl<MODE>(h, ldh, pos0, step, table, P, d, h_off, s_off, z_off, rot, k,       \
                           oi_off, ov_off);                                                    \
    }

H_WRITE_ENTRY(H_FP16, h_fp16)
H_WRITE_ENTRY(H_INT8, h_int8)
H_WRITE_ENTRY(H_INT4, h_int4)

// Positions c0..c0+n-1 of the slot, dequantized (x = q * s + z in float32, quant.dequantize's
// order; z = 0 for INT8), rotated back where an INT4 scale carries H_ROT_FLAG, rounded to FP16
// (f2h_sat: finite values stay finite) into out f16 [n, d]; then the k outlier channels of an
// INT4 row overwritten with their stored FP16 values (numpy_ops.decode_h_int4). grid = n,
// block = 256 (8 warps).
template <int MODE>
__device__ void h_read_impl(const i64* __restrict__ table, i64 P, i64 c0, i64 d, i64 h_off,
                            i64 s_off, i64 z_off, i64 k, i64 oi_off, i64 ov_off,
                            half_t* __restrict__ out) {
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
        const half_t raw = ((const half_t*)(base + s_off))[prow * ng + g];
        const bool rot = MODE == H_INT4 && (raw & H_ROT_FLAG);     // warp-uniform
        const float s = h2f(MODE == H_INT4 ? (half_t)(raw & ~H_ROT_FLAG) : raw);
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
        dst[g * 32 + lane] = f2h_sat(x);
    }
    if (MODE != H_INT4 || k <= 0) return;
    __syncthreads();                              // the groups are written: outliers go over
    if ((i64)threadIdx.x < k) {
        const int j = ((const unsigned short*)(base + oi_off))[prow * k + threadIdx.x];
        if (j < d) dst[j] = ((const half_t*)(base + ov_off))[prow * k + threadIdx.x];
    }
}

#define H_READ_ENTRY(MODE, NAME)                                                               \
    extern "C" __global__ void h_read_##NAME(const i64* table, i64 P, i64 c0, i64 d,           \
                                             i64 h_off, i64 s_off, i64 z_off, i64 k,           \
                                             i64 oi_off, i64 ov_off, half_t* out) {            \
        h_read_impl<MODE>(table, P, c0, d, h_off, s_off, z_off, k, oi_off, ov_off, out);       \
    }

H_READ_ENTRY(H_FP16, h_fp16)
H_READ_ENTRY(H_INT8, h_int8)
H_READ_ENTRY(H_INT4, h_int4)

// Causal GQA attention of the T query rows (qkv f16 [T, ld], rotated Q of head h at columns
// h*hd..) over ONE chunk of keys: positions c0..c0+n-1, rebuilt in kv f16 [n, 2 n_kv hd]
// (rotated K of KV head hk at columns hk*hd, V at n_kv*hd + hk*hd). Query row t (position
// p = pos0 + t) sees keys at positions win_lo(p, window)..p (common.cuh: max(0, p - window + 1)
// on a sliding-window layer, window > 0; 0 for full attention, window = 0): chunk keys
// j = kbeg..kend-1 with kbeg = max(0, win_lo(p) - c0), kend = min(n, p - c0 + 1) (none when
// kend <= kbeg: the chunk is in the row's future or wholly before its window). The state
// carried into a chunk may hold no key yet (m = -inf, l = 0: the host starts at the chunk
// holding win_lo(pos0), which can be before a later row's window); such a state, like a
// warp's part that saw no key, weighs 0 in the merge, and a merge with no key at all keeps
// m = -inf. The online-softmax state of (row, head) is carried in state f32
// [T, n_heads, hd + 2] (acc[hd], running max m in log2 units, sum l):
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
                                        i64 window, float* __restrict__ state, i64 first,
                                        i64 last, half_t* __restrict__ out) {
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
    i64 kend = pos0 + t - c0 + 1;                 // keys kbeg..kend-1 of the chunk are visible
    if (kend > n) kend = n;
    i64 kbeg = win_lo(pos0 + t, window) - c0;
    if (kbeg < 0) kbeg = 0;
    for (i64 j = kbeg + warp; j < kend; j += nw) {
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
    // a carried state or a part that saw no key (m = -inf) weighs 0; m_all is -inf only
    // when neither saw one (then l_sum = 0 and nothing is added)
    const int i = threadIdx.x;
    float a_sum = 0.0f, l_sum = 0.0f;
    if (!first) {
        const float f = st[hd] == TL_NEG_INF ? 0.0f : exp2f(st[hd] - m_all);
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
