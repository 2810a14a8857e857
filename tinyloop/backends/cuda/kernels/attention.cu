// Causal attention with grouped-query heads over the paged KV cache: prefill and decode.
//
// Checked against: NumpyOps.kv_attention (tests/kernels/test_kernels_gpu.py::test_paged_attention_*),
// which reads the same page layout (tinyloop/kv/layouts.py PageLayout) through the same block table;
// the decode batch entry row by row (tests/kernels/test_batch_attention_gpu.py).
// Query head h reads KV head h / (n_heads / n_kv); query row i (absolute position p = pos0 + i)
// sees keys lo(p)..p, lo(p) = win_lo(p, window) (common.cuh: max(0, p - window + 1) for a
// sliding-window layer, window > 0; 0 for full attention, window = 0); scale 1/sqrt(head_dim).
// Online softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022): no [T, ctx]
// scratch. Scores are kept in log2 units (q pre-multiplied by scale*log2(e)) so exp2f does the
// exponentials.
//
// Paged KV (vLLM's PagedAttention, Kwon et al. 2023): key j of a slot lives in page
// table[j / P], row j % P. Page parts sit at byte offsets k_off / v_off (codes) and ks_off /
// vs_off (int8 mode: one FP16 scale per (position, KV head)); rows are [P, n_kv, HD].
// MODE 0 = fp16 (K/V FP16), MODE 1 = int8 (K/V = float(q) * float(scale), the product rounded
// once in float32 as the NumPy reference does).
#include "common.cuh"

// KV_FP16 / KV_INT8, kv_page, kv_load8, kv_load2: common.cuh (shared with attention_decode.cu).

// ---------------------------------------------------------------------------------------------
// Prefill: block = 64 query rows of one head, 4 threads per row (256 threads); thread part p of
// a row owns dims {16u + 4p .. 16u + 4p + 3 : u} so one float4 shared read per u is
// bank-conflict free across the 4 parts. K/V tiles of 32 keys are staged in shared memory as
// float. grid = (ceil(T / 64), n_heads); q tiles are taken in reverse so the longest (last)
// causal rows start first.
// Sliding window (index arithmetic): the block's rows q0..last_row have positions
// pos0+q0..pos0+last_row, so it needs keys win_lo(pos0 + q0)..pos0+last_row (win_lo is
// nondecreasing in the position); its tiles start at k_first = win_lo(pos0 + q0) rounded down
// to PF_KV, so tiles wholly before every row's window are never loaded. Staging zeroes keys
// below win_lo(pos0 + q0) as it zeroes keys past the context. A warp skips a tile when, for
// each of its rows, the tile is in the future (k0 > qpos) or wholly before the window
// (k0 + PF_KV - 1 < qlo). In a tile it runs, key k0 + j counts for a row when
// qlo <= k0 + j <= qpos, else its score is -inf; a row may meet a tile holding none of its
// keys before it has seen any (another row of the warp needs the tile), where the running max
// stays -inf: the exponentials are then taken against 0 (m_use), not -inf, so they give 0, not
// NaN. Every row meets its own key qpos in a tile its warp runs, so l > 0 at the end.
// Launch geometry shared with the host: the host passes these as -D options from
// tinyloop/backends/cuda/compile.py GEOMETRY (the one definition); the values below are defaults
// for a standalone nvcc build, kept equal to the table by tests/kernels/test_kernel_geometry.py.
#ifndef PF_Q
#define PF_Q 64
#endif
#define PF_KV 32

template <int MODE, int HD>
__device__ void attn_prefill_impl(const half_t* __restrict__ qkv, i64 ld, i64 T, i64 pos0,
                                  const i64* __restrict__ table, i64 P, i64 k_off, i64 v_off,
                                  i64 ks_off, i64 vs_off, i64 n_heads, i64 n_kv,
                                  float scale_log2, i64 window, half_t* __restrict__ out) {
    constexpr int U = HD / 16;                   // float4 slices per thread
    __shared__ __align__(16) float Ks[PF_KV * HD];
    __shared__ __align__(16) float Vs[PF_KV * HD];
    const int tid = threadIdx.x, part = tid & 3, qi = tid >> 2;
    const i64 q0 = (i64)(gridDim.x - 1 - blockIdx.x) * PF_Q;
    const i64 h = blockIdx.y, hk = h / (n_heads / n_kv);
    const i64 qrow = q0 + qi;
    const bool valid = qrow < T;
    // Rows past T compute with q = 0 as row T-1 (finite, never stored), so every lane of a
    // warp runs the same shuffles.
    const i64 qpos = pos0 + (valid ? qrow : T - 1);   // absolute position of this query row
    const i64 qlo = win_lo(qpos, window);              // its first visible key

    float q[U * 4], o[U * 4];
    const half_t* qp = qkv + qrow * ld + h * HD;
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
        for (int j = 0; j < 4; ++j)
            q[4 * u + j] = valid ? h2f(qp[16 * u + 4 * part + j]) * scale_log2 : 0.0f;
#pragma unroll
    for (int j = 0; j < U * 4; ++j) o[j] = 0.0f;
    float m = TL_NEG_INF, l = 0.0f;

    const i64 last_row = (q0 + PF_Q < T ? q0 + PF_Q : T) - 1;
    const i64 kv_end = pos0 + last_row + 1;       // keys this block needs: kv_lo..kv_end-1
    const i64 kv_lo = win_lo(pos0 + q0, window);
    for (i64 k0 = kv_lo / PF_KV * PF_KV; k0 < kv_end; k0 += PF_KV) {
        __syncthreads();                          // previous tile fully consumed
        for (int idx = tid; idx < PF_KV * HD / 8; idx += blockDim.x) {
            const int kr = idx / (HD / 8), c = (idx % (HD / 8)) * 8;
            const i64 key = k0 + kr;
            float* kd = Ks + kr * HD + c;
            float* vd = Vs + kr * HD + c;
            if (key >= kv_lo && key < kv_end) {
                i64 row;
                const char* base = kv_page(table, P, key, &row);
                float k8[8], v8[8];
                kv_load8<MODE, HD>(base, k_off, ks_off, row * n_kv + hk, c, k8);
                kv_load8<MODE, HD>(base, v_off, vs_off, row * n_kv + hk, c, v8);
#pragma unroll
                for (int j = 0; j < 8; ++j) { kd[j] = k8[j]; vd[j] = v8[j]; }
            } else {
#pragma unroll
                for (int j = 0; j < 8; ++j) { kd[j] = 0.0f; vd[j] = 0.0f; }
            }
        }
        __syncthreads();
        // Skip a tile only when it lies in the future of every row of the warp or wholly
        // before every row's window (warp-uniform: the score shuffles below need all 32
        // lanes). Masked keys get p = 0 exactly.
        if (__all_sync(0xffffffffu, k0 > qpos || k0 + PF_KV <= qlo)) continue;
        float s[PF_KV];
        float tmax = TL_NEG_INF;
#pragma unroll
        for (int j = 0; j < PF_KV; ++j) {
            float d = 0.0f;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const float4 k4 = *(const float4*)(Ks + j * HD + 16 * u + 4 * part);
                d = fmaf(q[4 * u], k4.x, d);
                d = fmaf(q[4 * u + 1], k4.y, d);
                d = fmaf(q[4 * u + 2], k4.z, d);
                d = fmaf(q[4 * u + 3], k4.w, d);
            }
            d += __shfl_xor_sync(0xffffffffu, d, 1);
            d += __shfl_xor_sync(0xffffffffu, d, 2);
            s[j] = (k0 + j <= qpos && k0 + j >= qlo) ? d : TL_NEG_INF;
            tmax = fmaxf(tmax, s[j]);
        }
        // -inf while the row has seen none of its keys (see the top): exponentials against 0
        const float m_new = fmaxf(m, tmax);
        const float m_use = m_new == TL_NEG_INF ? 0.0f : m_new;
        const float alpha = exp2f(m - m_use);     // m = -inf: 0
        float psum = 0.0f;
#pragma unroll
        for (int j = 0; j < U * 4; ++j) o[j] *= alpha;
#pragma unroll
        for (int j = 0; j < PF_KV; ++j) {
            const float p = exp2f(s[j] - m_use);
            psum += p;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const float4 v4 = *(const float4*)(Vs + j * HD + 16 * u + 4 * part);
                o[4 * u] = fmaf(p, v4.x, o[4 * u]);
                o[4 * u + 1] = fmaf(p, v4.y, o[4 * u + 1]);
                o[4 * u + 2] = fmaf(p, v4.z, o[4 * u + 2]);
                o[4 * u + 3] = fmaf(p, v4.w, o[4 * u + 3]);
            }
        }
        l = l * alpha + psum;
        m = m_new;
    }
    if (!valid) return;
    const float inv_l = 1.0f / l;
    half_t* op = out + qrow * n_heads * HD + h * HD;
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
        for (int j = 0; j < 4; ++j) op[16 * u + 4 * part + j] = f2h(o[4 * u + j] * inv_l);
}

// ---------------------------------------------------------------------------------------------
// Decode (one query row): block = one query head, 1024 threads. Keys go in chunks of 1024, one
// key per thread for the score (a full 16-byte-load dot product over the K row); then
// thread (slice, dim pair) accumulates p * V over the chunk's keys of its slice; the slices
// are summed at the end. NSL = DC_THREADS / (HD / 2) slices: where HD / 2 does not divide
// DC_THREADS (head dims 48, 80, 96) the leftover threads take part in the scores only.
// grid = n_heads. Sliding window: the query (position ctx - 1) reads keys
// lo..ctx-1, lo = win_lo(ctx - 1, window) = max(0, ctx - window) for window > 0, so the chunks
// run c0 = lo, lo + DC_THREADS, ... < ctx (key j = c0 + tid counts when j < ctx): nothing
// before the window is read, and every chunk holds key c0 < ctx, so the running max is finite.
#ifndef DC_THREADS
#define DC_THREADS 1024
#endif

template <int MODE, int HD>
__device__ void attn_decode_impl(const half_t* __restrict__ qkv, i64 ctx,
                                 const i64* __restrict__ table, i64 P, i64 k_off, i64 v_off,
                                 i64 ks_off, i64 vs_off, i64 n_heads, i64 n_kv,
                                 float scale_log2, i64 window, half_t* __restrict__ out) {
    constexpr int PAIRS = HD / 2, NSL = DC_THREADS / PAIRS;
    __shared__ __align__(16) float qs[HD];
    __shared__ float ps[DC_THREADS];
    __shared__ float red[32];
    __shared__ float osum[NSL * HD];
    const int tid = threadIdx.x;
    const i64 h = blockIdx.x, hk = h / (n_heads / n_kv);
    for (int i = tid; i < HD; i += DC_THREADS) qs[i] = h2f(qkv[h * HD + i]) * scale_log2;
    __syncthreads();
    const int dp = tid % PAIRS, sl = tid / PAIRS;
    float m = TL_NEG_INF, l = 0.0f, o0 = 0.0f, o1 = 0.0f;
    for (i64 c0 = win_lo(ctx - 1, window); c0 < ctx; c0 += DC_THREADS) {
        const i64 j = c0 + tid;
        float s = TL_NEG_INF;
        if (j < ctx) {
            i64 row;
            const char* base = kv_page(table, P, j, &row);
            float d = 0.0f;
#pragma unroll
            for (int u = 0; u < HD / 8; ++u) {
                float k8[8];
                kv_load8<MODE, HD>(base, k_off, ks_off, row * n_kv + hk, 8 * u, k8);
#pragma unroll
                for (int w = 0; w < 8; ++w) d = fmaf(qs[8 * u + w], k8[w], d);
            }
            s = d;
        }
        const float m_new = fmaxf(m, block_max(s, red));   // key c0 < ctx: finite
        const float alpha = exp2f(m - m_new);
        const float p = j < ctx ? exp2f(s - m_new) : 0.0f;
        ps[tid] = p;
        const float csum = block_sum(p, red);               // its barriers publish ps
        l = l * alpha + csum;
        o0 *= alpha;
        o1 *= alpha;
        m = m_new;
        const int nk = (int)(ctx - c0 < DC_THREADS ? ctx - c0 : DC_THREADS);
        for (int jj = sl; sl < NSL && jj < nk; jj += NSL) {   // leftover threads: no slice
            i64 row;
            const char* base = kv_page(table, P, c0 + jj, &row);
            float v2[2];
            kv_load2<MODE, HD>(base, v_off, vs_off, row * n_kv + hk, 2 * dp, v2);
            const float pj = ps[jj];
            o0 = fmaf(pj, v2[0], o0);
            o1 = fmaf(pj, v2[1], o1);
        }
        __syncthreads();                                    // ps is rewritten next chunk
    }
    if (sl < NSL) {
        osum[sl * HD + 2 * dp] = o0;
        osum[sl * HD + 2 * dp + 1] = o1;
    }
    __syncthreads();
    for (int i = tid; i < HD; i += DC_THREADS) {
        float acc = 0.0f;
#pragma unroll
        for (int k = 0; k < NSL; ++k) acc += osum[k * HD + i];
        out[h * HD + i] = f2h(acc / l);
    }
}

// Entry points: attn_{prefill,decode,decode_step,decode_batch}_{fp16,int8}_hd{HD}. The block
// table and page offsets are kernel arguments (the table sits at a fixed device address for a
// request's life; a decode batch reads each row's address from an array); window: the
// layer's sliding window in positions, 0 = full attention (a constant per layer, so a
// captured decode step holds it as an argument).
#define ATTN_ENTRIES_MODE(MODE, NAME, HD)                                                      \
    extern "C" __global__ void __launch_bounds__(PF_Q * 4)                                    \
        attn_prefill_##NAME##_hd##HD(const half_t* qkv, i64 ld, i64 T, i64 pos0,               \
                                     const i64* table, i64 P, i64 k_off, i64 v_off,            \
                                     i64 ks_off, i64 vs_off, i64 n_heads, i64 n_kv,            \
                                     double scale_log2, i64 window, half_t* out) {             \
        attn_prefill_impl<MODE, HD>(qkv, ld, T, pos0, table, P, k_off, v_off, ks_off, vs_off,  \
                                    n_heads, n_kv, (float)scale_log2, window, out);            \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(DC_THREADS)                                  \
        attn_decode_##NAME##_hd##HD(const half_t* qkv, i64 ctx, const i64* table, i64 P,       \
                                    i64 k_off, i64 v_off, i64 ks_off, i64 vs_off,              \
                                    i64 n_heads, i64 n_kv, double scale_log2, i64 window,      \
                                    half_t* out) {                                             \
        TL_PDL_ENTER();                                                                        \
        attn_decode_impl<MODE, HD>(qkv, ctx, table, P, k_off, v_off, ks_off, vs_off, n_heads,  \
                                   n_kv, (float)scale_log2, window, out);                      \
    }                                                                                          \
    /* the captured decode step: context length = the step state's position + 1 */             \
    extern "C" __global__ void __launch_bounds__(DC_THREADS)                                  \
        attn_decode_step_##NAME##_hd##HD(const half_t* qkv, const int* step, const i64* table, \
                                         i64 P, i64 k_off, i64 v_off, i64 ks_off, i64 vs_off,  \
                                         i64 n_heads, i64 n_kv, double scale_log2,             \
                                         i64 window, half_t* out) {                            \
        TL_PDL_ENTER();                                                                        \
        attn_decode_impl<MODE, HD>(qkv, (i64)step[2] + 1, table, P, k_off, v_off, ks_off,      \
                                   vs_off, n_heads, n_kv, (float)scale_log2, window, out);     \
    }                                                                                          \
    /* a decode batch: grid (n_heads, B), row b = blockIdx.y: query row qkv + b * ld over  */ \
    /* context pos[b] + 1 of the block table at address tables[b] (the step's device index, */\
    /* tinyloop/kv/cache.py batch_index), into out row b (f16 [B, n_heads * HD])           */ \
    extern "C" __global__ void __launch_bounds__(DC_THREADS)                                  \
        attn_decode_batch_##NAME##_hd##HD(const half_t* qkv, i64 ld, const i64* pos,           \
                                          const i64* tables, i64 P, i64 k_off, i64 v_off,      \
                                          i64 ks_off, i64 vs_off, i64 n_heads, i64 n_kv,       \
                                          double scale_log2, i64 window, half_t* out) {        \
        TL_PDL_ENTER();                                                                        \
        const i64 b = blockIdx.y;                                                              \
        attn_decode_impl<MODE, HD>(qkv + b * ld, pos[b] + 1, (const i64*)tables[b], P, k_off,  \
                                   v_off, ks_off, vs_off, n_heads, n_kv, (float)scale_log2,    \
                                   window, out + b * n_heads * HD);                            \
    }
#define ATTN_ENTRIES(HD) ATTN_ENTRIES_MODE(KV_FP16, fp16, HD) ATTN_ENTRIES_MODE(KV_INT8, int8, HD)

// The supported head dims (ATTN_HEAD_DIMS in compile.py GEOMETRY; -D from the host).
#ifndef ATTN_HEAD_DIM_ENTRIES
#define ATTN_HEAD_DIM_ENTRIES                                                                  \
    ATTN_ENTRIES(16) ATTN_ENTRIES(32) ATTN_ENTRIES(48) ATTN_ENTRIES(64) ATTN_ENTRIES(80)       \
    ATTN_ENTRIES(96) ATTN_ENTRIES(128)
#endif
ATTN_HEAD_DIM_ENTRIES
