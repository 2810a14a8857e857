// RoPE on the fused QKV rows, and the paged KV-cache write (fp16 / int8 modes; Q-only for the
// store-h modes, whose h rows kv_h.cu writes; the store-h reconstruction also runs the Q-only
// kernel on its rebuilt K rows: tinyloop/backends/cuda/attention.py _h_attention).
//
// Checked against: NumpyOps.kv_write with numpy_ops.rope_tables / apply_rope and
// quant.quantize_rows_int8 (tests/kernels/test_kernels_gpu.py::test_kv_write_*); the decode
// batch entry row by row (tests/kernels/test_batch_attention_gpu.py).
// Interleaved pairs (GGML "normal" / GPT-J): pair i of each head, (x[2i], x[2i+1]), rotates by
// angle pos * theta^(-2i/head_dim). The angle and its cos/sin are computed in double, as the
// reference does, so large positions stay accurate; the rotation itself is float.
//
// Pages (tinyloop/kv/layouts.py PageLayout): position p of the slot lives in page table[p / P],
// row p % P; K / V rows [P, n_kv, hd] at byte offsets k_off / v_off; int8 mode: FP16 scales
// [P, n_kv] at ks_off / vs_off.
// INT8 (symmetric, one scale per (position, KV head) row; quant.quantize_rows_int8 with
// saturate=True, bit for bit): s = fp16(min(amax / 127, F16_MAX)) with the division in float32
// (round to nearest), q = rint(x / s) with the division in float32 against the FP16-rounded s,
// clipped to +-127; s = 0 -> codes 0; a row holding a NaN or an infinity gets s = NaN and
// codes 0. The value quantized is the float32 rotated K (not rounded to FP16 first) and the
// FP16 V. fp16 pages store the rotated K through f2h_sat (finite values saturate at F16_MAX).
#include "common.cuh"

#define KV_FP16 0
#define KV_INT8 1
#define KV_QONLY 2
#define MAX_PAIRS_PER_LANE 4            // head_dim <= 256

__device__ __forceinline__ char* kv_page_w(const i64* __restrict__ table, i64 P, i64 pos,
                                           i64* row) {
    const i64 pg = pos / P;
    *row = pos - pg * P;
    return (char*)table[pg];
}

// cos at cs[0, hd/2), sin at cs[hd/2, hd) of position pos: pair i rotates by
// pos * theta^(-2i/hd), the angle and its cos/sin computed in double. Threads of the block
// stride over the pairs (the caller synchronises before reading cs).
__device__ __forceinline__ void rope_table(i64 pos, double theta, i64 hd, float* cs) {
    const int half = (int)(hd / 2);
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const double inv_freq = pow(theta, -(double)(2 * i) / (double)hd);
        double s, c;
        sincos((double)pos * inv_freq, &s, &c);
        cs[i] = (float)c;
        cs[half + i] = (float)s;
    }
}

// One pair (x0, x1) rotated by (c, s) in float: (x0 c - x1 s, x0 s + x1 c), each product
// and sum rounded once.
__device__ __forceinline__ void rope_rot(float x0, float x1, float c, float s, float* r0,
                                         float* r1) {
    *r0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));     // no FMA contraction: the same
    *r1 = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));     // bits in every kernel inlining it
}

// INT8 row of one (position, KV head): one warp. src f16 [hd] (K: rotated here with cs; V: as
// is) -> dst codes i8 [hd] and *scale (quant.quantize_rows_int8's rule, see the file head).
// src is read through L2 (__ldcg): the kernel before wrote it.
__device__ __forceinline__ void kv_int8_row_warp(const half_t* src, bool rotate,
                                                 const float* cs, int hd, i8* dst,
                                                 half_t* scale, int lane) {
    const int half = hd / 2;
    float x[MAX_PAIRS_PER_LANE][2];
    float amax = 0.0f;
    bool ok = true;
#pragma unroll
    for (int u = 0; u < MAX_PAIRS_PER_LANE; ++u) {
        const int i = lane + 32 * u;
        x[u][0] = x[u][1] = 0.0f;
        if (i < half) {
            const float x0 = h2f(__ldcg(src + 2 * i)), x1 = h2f(__ldcg(src + 2 * i + 1));
            if (rotate) {
                rope_rot(x0, x1, cs[i], cs[half + i], &x[u][0], &x[u][1]);
            } else {
                x[u][0] = x0;
                x[u][1] = x1;
            }
            ok = ok && tl_finite(x[u][0]) && tl_finite(x[u][1]);
            amax = fmaxf(amax, fmaxf(fabsf(x[u][0]), fabsf(x[u][1])));
        }
    }
    amax = warp_max(amax);
    ok = __all_sync(0xffffffffu, ok);
    const half_t s16 = f2h_scale(__fdiv_rn(amax, 127.0f), ok);   // NaN: codes 0 below
    const float sc = h2f(s16);
#pragma unroll
    for (int u = 0; u < MAX_PAIRS_PER_LANE; ++u) {
        const int i = lane + 32 * u;
        if (i < half) {
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                float q = sc > 0.0f ? rintf(__fdiv_rn(x[u][j], sc)) : 0.0f;
                q = fminf(fmaxf(q, -127.0f), 127.0f);
                dst[2 * i + j] = (i8)(int)q;
            }
        }
    }
    if (lane == 0) *scale = s16;
}

// qkv f16 [T, ld] (Q at 0, K at n_heads*hd, V at (n_heads+n_kv)*hd): Q rotated in place; the
// slot's pages get rows pos0..pos0+T-1 (MODE fp16: rotated K and V as FP16; int8: codes and
// scales; qonly: nothing). grid = T, block = 128 (4 warps); dynamic shared memory = hd floats.
// The decode step state's RoPE table (tinyloop/backends/base.py STEP_ROPE*): decode_step_advance
// writes position p's cos | sin from word STEP_ROPE and sets word STEP_ROPE_POS to p + 1;
// word STEP_POS holds the step's position.
#define STEP_POS 2
#define STEP_ROPE_POS 3
#define STEP_ROPE 4
#define STEP_ROPE_MAX 256

// Position pos's table into cs (cos at [0, hd/2), sin at [hd/2, hd)): copied from the step
// state when step is not null and its table is pos's, else computed (rope_table). The block's
// threads share the work; the caller synchronises before reading cs.
__device__ __forceinline__ void rope_table_for(const int* __restrict__ step, i64 pos,
                                               double theta, i64 hd, float* cs) {
    if (step != nullptr && hd <= STEP_ROPE_MAX && (i64)step[STEP_ROPE_POS] == pos + 1) {
        const float* tab = (const float*)(step + STEP_ROPE);
        for (int i = threadIdx.x; i < (int)hd; i += blockDim.x) cs[i] = tab[i];
    } else {
        rope_table(pos, theta, hd, cs);
    }
}

// The int8 page rows of one position from its qkv row (K unrotated, as the GEMV left it; V):
// one warp of the block per (K or V, KV head) row, kv_int8_row_warp each, into page `base`
// row `prow`. kv_write_impl and qkv_rope.cu (its last block) write int8 pages through it.
__device__ __forceinline__ void kv_int8_rows_block(const half_t* row, i64 n_heads, i64 n_kv,
                                                   i64 hd, const float* cs, char* base,
                                                   i64 prow, i64 k_off, i64 v_off, i64 ks_off,
                                                   i64 vs_off) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    for (i64 r = warp; r < 2 * n_kv; r += nwarps) {
        const bool is_k = r < n_kv;
        const i64 hk = is_k ? r : r - n_kv;
        const half_t* src = row + (n_heads + (is_k ? 0 : n_kv)) * hd + hk * hd;
        i8* dst = (i8*)(base + (is_k ? k_off : v_off)) + (prow * n_kv + hk) * hd;
        half_t* scale = (half_t*)(base + (is_k ? ks_off : vs_off)) + prow * n_kv + hk;
        kv_int8_row_warp(src, is_k, cs, (int)hd, dst, scale, lane);
    }
}

// Row t of qkv at position pos, into the pages of block table `table`. step: null, or the
// decode step state (T = 1), whose table rope_table_for copies when it is position pos's.
// AHEAD (the step entries, PDL-launched in a captured step): the RoPE table and the page
// lookup - step state and block table, which only the step before writes - run before the
// PDL wait, which the function then takes itself before touching qkv.
template <int MODE, bool AHEAD = false>
__device__ __forceinline__ void kv_write_impl(half_t* __restrict__ qkv, i64 ld, i64 t,
                                              i64 pos, double theta, i64 n_heads, i64 n_kv, i64 hd,
                                              const i64* __restrict__ table, i64 P, i64 k_off,
                                              i64 v_off, i64 ks_off, i64 vs_off,
                                              const int* __restrict__ step = nullptr) {
    extern __shared__ float cs[];               // cos at [0, hd/2), sin at [hd/2, hd)
    const int half = (int)(hd / 2);
    rope_table_for(step, pos, theta, hd, cs);
    i64 prow = 0;
    char* base = (MODE == KV_QONLY) ? nullptr : kv_page_w(table, P, pos, &prow);
    if (AHEAD) TL_PDL_ENTER();                  // qkv: the kernel before wrote it
    __syncthreads();
    half_t* row = qkv + t * ld;
    // Q (all modes) and, in fp16 mode, K: rotate pair by pair
    const i64 n_rot = (MODE == KV_FP16 ? n_heads + n_kv : n_heads) * half;
    for (i64 idx = threadIdx.x; idx < n_rot; idx += blockDim.x) {
        const int i = (int)(idx % half);
        const i64 e = 2 * idx;                    // element offset of the pair in Q|K
        float y0, y1;
        rope_rot(h2f(row[e]), h2f(row[e + 1]), cs[i], cs[half + i], &y0, &y1);
        if (idx < n_heads * half) {
            row[e] = f2h(y0);
            row[e + 1] = f2h(y1);
        } else {
            half_t* k = (half_t*)(base + k_off) + prow * n_kv * hd + (e - n_heads * hd);
            k[0] = f2h_sat(y0);
            k[1] = f2h_sat(y1);
        }
    }
    if (MODE == KV_FP16) {
        const half_t* v = row + (n_heads + n_kv) * hd;
        half_t* vdst = (half_t*)(base + v_off) + prow * n_kv * hd;
        for (i64 j = threadIdx.x; j < n_kv * hd; j += blockDim.x) vdst[j] = v[j];
    }
    if (MODE != KV_INT8) return;
    kv_int8_rows_block(row, n_heads, n_kv, hd, cs, base, prow, k_off, v_off, ks_off, vs_off);
}

#ifndef TL_DEVICE_ONLY
#define KV_WRITE_ENTRY(MODE, NAME)                                                             \
    extern "C" __global__ void kv_write_##NAME(half_t* qkv, i64 ld, i64 pos0, double theta,    \
                                               i64 n_heads, i64 n_kv, i64 hd,                  \
                                               const i64* table, i64 P, i64 k_off, i64 v_off,  \
                                               i64 ks_off, i64 vs_off) {                       \
        TL_PDL_ENTER();                                                                        \
        kv_write_impl<MODE>(qkv, ld, blockIdx.x, pos0 + blockIdx.x, theta, n_heads, n_kv, hd,  \
                            table, P, k_off, v_off, ks_off, vs_off);                           \
    }

KV_WRITE_ENTRY(KV_FP16, fp16)
KV_WRITE_ENTRY(KV_INT8, int8)
KV_WRITE_ENTRY(KV_QONLY, qonly)

// A decode batch (tinyloop/backends/cuda/kv.py kv_write_batch; checked against the per-row
// NumpyOps.kv_write): row b of qkv goes to its own request's slot at its own position,
// pos[b], through the block table at address tables[b] (pos, tables: i64 [B], the step's
// device index, tinyloop/kv/cache.py batch_index). grid = B, one block per row as above.
#define KV_WRITE_BATCH_ENTRY(MODE, NAME)                                                       \
    extern "C" __global__ void kv_write_batch_##NAME(half_t* qkv, i64 ld, const i64* pos,      \
                                                     double theta, i64 n_heads, i64 n_kv,      \
                                                     i64 hd, const i64* tables, i64 P,         \
                                                     i64 k_off, i64 v_off, i64 ks_off,         \
                                                     i64 vs_off) {                             \
        TL_PDL_ENTER();                                                                        \
        const i64 b = blockIdx.x;                                                              \
        kv_write_impl<MODE>(qkv, ld, b, pos[b], theta, n_heads, n_kv, hd,                     \
                            (const i64*)tables[b], P, k_off, v_off, ks_off, vs_off);           \
    }

KV_WRITE_BATCH_ENTRY(KV_FP16, fp16)
KV_WRITE_BATCH_ENTRY(KV_INT8, int8)

// The captured decode step (tinyloop/graphs.py): the same write of one row (T = 1), at the
// position the device step state holds (step[2], STEP_POS in tinyloop/backends/base.py), so a
// graph replayed for every step needs no new argument.
#define KV_WRITE_STEP_ENTRY(MODE, NAME)                                                        \
    extern "C" __global__ void kv_write_step_##NAME(half_t* qkv, i64 ld, const int* step,      \
                                                    double theta, i64 n_heads, i64 n_kv,       \
                                                    i64 hd, const i64* table, i64 P,           \
                                                    i64 k_off, i64 v_off, i64 ks_off,          \
                                                    i64 vs_off) {                              \
        kv_write_impl<MODE, true>(qkv, ld, 0, (i64)step[STEP_POS], theta, n_heads, n_kv, hd,  \
                                  table, P, k_off, v_off, ks_off, vs_off, step);               \
    }

KV_WRITE_STEP_ENTRY(KV_FP16, fp16)
KV_WRITE_STEP_ENTRY(KV_INT8, int8)
KV_WRITE_STEP_ENTRY(KV_QONLY, qonly)

// The last launch of a captured decode step (tinyloop/graphs.py): step int [STEP_WORDS] is the
// device step state (STEP_ID = 0, STEP_FAULT = 1, STEP_POS = 2, STEP_ROPE_POS = 3, the table
// from STEP_ROPE = 4; tinyloop/backends/base.py). Thread 0 copies the id and fault code the
// head wrote to host[0..1] (mapped pinned memory, read after the stream synchronises) and
// advances the position to p + 1; the block writes p + 1's RoPE table (rope_table: the values
// every kv_write_step of the next replay would compute) and marks it valid. One block of 32+
// threads.
extern "C" __global__ void decode_step_advance(int* step, int* host, double theta, i64 hd) {
    TL_PDL_ENTER();
    __shared__ int next;
    if (threadIdx.x == 0) {
        host[0] = step[0];
        host[1] = step[1];
        next = step[2] + 1;
        step[2] = next;
    }
    __syncthreads();
    if (hd <= 0 || hd > STEP_ROPE_MAX || hd % 2) return;
    rope_table((i64)next, theta, hd, (float*)(step + STEP_ROPE));
    if (threadIdx.x == 0) step[STEP_ROPE_POS] = next + 1;
}
#endif  // TL_DEVICE_ONLY
