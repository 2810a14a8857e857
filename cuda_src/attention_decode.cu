// Split-K decode attention ("flash-decoding", Dao et al. 2023) over the paged KV cache: one
// query row (T = 1) of every query head against keys 0..ctx-1.
//
// Checked against: NumpyOps.kv_attention (tests/gpu/test_kernels.py::test_decode_split_*), which
// reads the same page layout (tinyloop/kvcache.py PageLayout) through the same block table.
// Query head h reads KV head h / (n_heads / n_kv); scale 1/sqrt(head_dim); scores in log2 units
// (q pre-multiplied by scale*log2(e)) so exp2f does the exponentials.
//
// One launch, attn_split_{fp16,int8}_hd{HD}: grid (n_heads, nsplit), DS_THREADS threads. The ctx
// keys fill npages = ceil(ctx / P) pages; split s owns whole pages [s*pps, (s+1)*pps) with
// pps = ceil(npages / nsplit) (computed on the device, so a captured launch with a fixed nsplit
// serves every ctx); splits from n_used = ceil(npages / pps) on hold no keys and return at
// once. Each other block runs the online softmax (Milakov & Gimelshein 2018) over its keys and
// writes the partial (m, l, o[HD]) - running max, sum of 2^(s-m), unnormalised sum of 2^(s-m) v
// - to part[(h * nsplit + s) * (HD + 2)]: o[0..HD-1], m, l (attn_split_unit; in decode_mega.cu
// an empty split writes m = -inf, l = 0, o = 0). Then attn_split_merge: one used split writes
// out = o / l itself; otherwise the last of the head's blocks merges the partials
// (attn_combine_head): M = max_s m_s, out = sum_s 2^(m_s-M) o_s / sum_s 2^(m_s-M) l_s. Split 0
// always holds key 0, so M is finite.
// ctx comes from the host (ctx > 0) or, when step_pos is not null, from the device step state
// (tinyloop/graphs.py: ctx = *step_pos + 1), so one captured graph serves every step.
// Scores: one key per thread, the K row read with 16-byte loads. P*V: thread (slice, 8-dim
// chunk) reads 8 dims of V with one 16-byte (fp16) / 8-byte (int8) load per key of its slice.
#include "common.cuh"

// Launch geometry shared with the host (tinyloop/backends/cuda_ops.py GEOMETRY; -D from the
// host, defaults here for a standalone nvcc build, kept equal by tests/test_kernel_geometry.py).
#ifndef DS_THREADS
#define DS_THREADS 128
#endif

// One (query head h, split s of nsplit) unit over keys 0..ctx-1, run by a block of DS_THREADS
// threads (the split kernel below: h = blockIdx.x, s = blockIdx.y; decode_mega.cu: a grid-stride
// loop over units). qkv is read through L2 (__ldcg): the megakernel rewrites it every layer.
template <int MODE, int HD>
__device__ void attn_split_unit(const half_t* qkv, i64 ctx, const i64* __restrict__ table, i64 P,
                                i64 k_off, i64 v_off, i64 ks_off, i64 vs_off, i64 n_heads,
                                i64 n_kv, float scale_log2, float* part, i64 h, i64 s,
                                i64 nsplit) {
    constexpr int C8 = HD / 8, NSL = DS_THREADS / C8;
    __shared__ __align__(16) float qs[HD];
    __shared__ float ps[DS_THREADS];
    __shared__ float red[32];
    __shared__ float osum[NSL * HD];
    const int tid = threadIdx.x;
    const i64 hk = h / (n_heads / n_kv);
    const i64 npages = (ctx + P - 1) / P, pps = (npages + nsplit - 1) / nsplit;
    const i64 k0 = s * pps * P;
    const i64 k1 = (s + 1) * pps * P < ctx ? (s + 1) * pps * P : ctx;
    float* dst = part + (h * nsplit + s) * (HD + 2);
    if (k0 >= k1) {                               // block-uniform: no keys in this split
        for (int i = tid; i < HD; i += DS_THREADS) dst[i] = 0.0f;
        if (tid == 0) { dst[HD] = TL_NEG_INF; dst[HD + 1] = 0.0f; }
        return;
    }
    for (int i = tid; i < HD; i += DS_THREADS) qs[i] = h2f(__ldcg(qkv + h * HD + i)) * scale_log2;
    __syncthreads();
    const int ch = tid % C8, sl = tid / C8;        // P*V: 8-dim chunk and key slice
    const bool pv = sl < NSL;                      // DS_THREADS % C8 leftover threads idle
    float m = TL_NEG_INF, l = 0.0f, o[8];
#pragma unroll
    for (int w = 0; w < 8; ++w) o[w] = 0.0f;
    for (i64 c0 = k0; c0 < k1; c0 += DS_THREADS) {
        const i64 j = c0 + tid;
        float sc = TL_NEG_INF;
        if (j < k1) {
            i64 row;
            const char* base = kv_page(table, P, j, &row);
            float d = 0.0f;
#pragma unroll
            for (int u = 0; u < C8; ++u) {
                float k8[8];
                kv_load8<MODE, HD>(base, k_off, ks_off, row * n_kv + hk, 8 * u, k8);
#pragma unroll
                for (int w = 0; w < 8; ++w) d = fmaf(qs[8 * u + w], k8[w], d);
            }
            sc = d;
        }
        const float m_new = fmaxf(m, block_max(sc, red));   // key c0 < k1: finite
        const float alpha = exp2f(m - m_new);
        const float p = j < k1 ? exp2f(sc - m_new) : 0.0f;
        ps[tid] = p;
        const float csum = block_sum(p, red);                // its barriers publish ps
        l = l * alpha + csum;
        m = m_new;
#pragma unroll
        for (int w = 0; w < 8; ++w) o[w] *= alpha;
        const int nk = (int)(k1 - c0 < DS_THREADS ? k1 - c0 : DS_THREADS);
        if (pv) {
            for (int jj = sl; jj < nk; jj += NSL) {
                i64 row;
                const char* base = kv_page(table, P, c0 + jj, &row);
                float v8[8];
                kv_load8<MODE, HD>(base, v_off, vs_off, row * n_kv + hk, 8 * ch, v8);
                const float pj = ps[jj];
#pragma unroll
                for (int w = 0; w < 8; ++w) o[w] = fmaf(pj, v8[w], o[w]);
            }
        }
        __syncthreads();                                     // ps is rewritten next chunk
    }
    if (pv) {
#pragma unroll
        for (int w = 0; w < 8; ++w) osum[sl * HD + 8 * ch + w] = o[w];
    }
    __syncthreads();
    for (int i = tid; i < HD; i += DS_THREADS) {
        float acc = 0.0f;
#pragma unroll
        for (int k = 0; k < NSL; ++k) acc += osum[k * HD + i];
        dst[i] = acc;
    }
    if (tid == 0) { dst[HD] = m; dst[HD + 1] = l; }
}

// Head h's merge of its partials 0..n_used-1 (of nsplit rows per head) into out[h * HD ..]
// (f16): the block's threads stride over the HD outputs. Partials are read through L2
// (__ldcg): other blocks wrote them. Two passes over the splits, each unrolled so its loads
// are all in flight at once (one L2 round trip per 8 splits, not one per split); each output
// sums the splits in ascending order. An empty split (m = -inf) weighs 0.
template <int HD>
__device__ __forceinline__ void attn_combine_head(const float* part, i64 nsplit, i64 n_used,
                                                  half_t* out, i64 h) {
    const float* src = part + h * nsplit * (HD + 2);
    const int ns = (int)n_used;
    float mx = TL_NEG_INF;                        // max is exact in any order
#pragma unroll 8
    for (int s = 0; s < ns; ++s) mx = fmaxf(mx, __ldcg(src + s * (HD + 2) + HD));
    for (int i = threadIdx.x; i < HD; i += blockDim.x) {
        float num = 0.0f, den = 0.0f;
#pragma unroll 8
        for (int s = 0; s < ns; ++s) {
            const float* ps = src + s * (HD + 2);
            const float wgt = exp2f(__ldcg(ps + HD) - mx);
            num = fmaf(wgt, __ldcg(ps + i), num);
            den = fmaf(wgt, __ldcg(ps + HD + 1), den);
        }
        out[h * HD + i] = f2h(num / den);
    }
}

// The split kernel's tail, by every thread of the block after its unit: splits past the
// last one holding keys (n_used = ceil(npages / pps), from ctx on the device) have returned
// without a partial; with n_used == 1 the one block writes the head's output itself
// (o / l: what the merge of one partial gives, bit for bit: weight 2^0 = 1, and + 0.0f as
// fmaf(1, x, 0) turns -0 into +0); otherwise the last of the n_used blocks of head h to
// finish (a per-head atomic ticket after a __threadfence, CUDA's threadFenceReduction
// pattern; it re-arms the ticket) merges them.
template <int HD>
__device__ __forceinline__ void attn_split_merge(const float* part, i64 nsplit, i64 n_used,
                                                 unsigned* tickets, half_t* out, i64 h) {
    __shared__ bool last;
    const float* dst = part + (h * nsplit + blockIdx.y) * (HD + 2);
    if (n_used == 1) {
        __syncthreads();                          // the unit's partial (global) is complete
        const float den = __fadd_rn(dst[HD + 1], 0.0f);
        for (int i = threadIdx.x; i < HD; i += blockDim.x)
            out[h * HD + i] = f2h(__fadd_rn(dst[i], 0.0f) / den);
        return;
    }
    __threadfence();                              // this block's partial, then the ticket
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(tickets + h, 1u) == (unsigned)(n_used - 1);
    __syncthreads();
    if (!last) return;
    __threadfence();
    attn_combine_head<HD>(part, nsplit, n_used, out, h);
    if (threadIdx.x == 0) tickets[h] = 0u;        // re-armed for the next launch
}

#ifndef TL_DEVICE_ONLY

// Entry points. step_pos: null, or the device int32 position of the step state (ctx = pos + 1).
// part: f32 [n_heads, nsplit, HD + 2] scratch; tickets: u32 [>= n_heads], 0 before the first
// launch (the merging block re-arms its head's); out: f16 [n_heads * HD].
#define DS_ENTRIES_MODE(MODE, NAME, HD)                                                        \
    extern "C" __global__ void __launch_bounds__(DS_THREADS)                                  \
        attn_split_##NAME##_hd##HD(const half_t* qkv, i64 ctx, const int* step_pos,            \
                                   const i64* table, i64 P, i64 k_off, i64 v_off, i64 ks_off,  \
                                   i64 vs_off, i64 n_heads, i64 n_kv, double scale_log2,       \
                                   float* part, unsigned* tickets, half_t* out) {              \
        TL_PDL_ENTER();                                                                        \
        const i64 c = step_pos != nullptr ? (i64)(*step_pos) + 1 : ctx;                        \
        const i64 npages = (c + P - 1) / P, pps = (npages + gridDim.y - 1) / gridDim.y;        \
        const i64 n_used = (npages + pps - 1) / pps;                                           \
        if ((i64)blockIdx.y >= n_used) return;    /* no keys: no partial, no ticket */         \
        attn_split_unit<MODE, HD>(qkv, c, table, P, k_off, v_off, ks_off, vs_off, n_heads,     \
                                  n_kv, (float)scale_log2, part, blockIdx.x, blockIdx.y,       \
                                  gridDim.y);                                                  \
        attn_split_merge<HD>(part, gridDim.y, n_used, tickets, out, blockIdx.x);               \
    }
#define DS_ENTRIES(HD) DS_ENTRIES_MODE(KV_FP16, fp16, HD) DS_ENTRIES_MODE(KV_INT8, int8, HD)

// The supported head dims (ATTN_HEAD_DIMS in cuda_ops.py GEOMETRY; -D from the host).
#ifndef DS_HEAD_DIM_ENTRIES
#define DS_HEAD_DIM_ENTRIES                                                                    \
    DS_ENTRIES(16) DS_ENTRIES(32) DS_ENTRIES(48) DS_ENTRIES(64) DS_ENTRIES(80) DS_ENTRIES(96)  \
    DS_ENTRIES(128)
#endif
DS_HEAD_DIM_ENTRIES
#endif  // TL_DEVICE_ONLY
