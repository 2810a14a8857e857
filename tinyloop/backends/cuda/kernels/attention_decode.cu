// Split-K decode attention ("flash-decoding", Dao et al. 2023) over the paged KV cache: one
// query row (T = 1) of every query head against keys lo..ctx-1, lo = win_lo(ctx - 1, window)
// (common.cuh: max(0, ctx - window) on a sliding-window layer, window > 0; 0 for full
// attention, window = 0).
//
// Checked against: NumpyOps.kv_attention (tests/kernels/test_kernels_gpu.py::test_decode_split_*), which
// reads the same page layout (tinyloop/kv/layouts.py PageLayout) through the same block table;
// the decode batch entry row by row (tests/kernels/test_batch_attention_gpu.py).
// Query head h reads KV head h / (n_heads / n_kv); scale 1/sqrt(head_dim); scores in log2 units
// (q pre-multiplied by scale*log2(e)) so exp2f does the exponentials.
//
// One launch, attn_split_{fp16,int8}_hd{HD}: grid (n_heads, nsplit), DS_THREADS threads. The
// keys lo..ctx-1 lie in pages pg0 = lo / P .. ceil(ctx / P) - 1, npages = ceil(ctx / P) - pg0 of
// them; split s owns whole pages [pg0 + s*pps, pg0 + (s+1)*pps) with
// pps = max(ceil(npages / nsplit), ceil(DS_THREADS / P)), i.e. keys
// [max(lo, (pg0 + s*pps) P), min(ctx, (pg0 + (s+1)*pps) P)) (ds_split_range; computed on the
// device, so a captured launch with a fixed nsplit serves every ctx; the floor gives each
// split at least one chunk of DS_THREADS keys, so contexts up to DS_THREADS keys run in one
// split per head); splits from n_used = ceil(npages / pps) on hold no keys and return at once,
// so with a window the splits start at the window's first page and no split is spent on pages
// before it. Each other block runs
// the online softmax (Milakov & Gimelshein 2018) over its keys, its first chunk loaded before
// the PDL wait (attn_split_step). With n_used == 1 the block writes out = o / l itself;
// otherwise it writes the partial (m, l, o[HD]) - running max, sum of 2^(s-m), unnormalised
// sum of 2^(s-m) v - to part[(h * nsplit + s) * (HD + 2)]: o[0..HD-1], m, l (attn_split_unit;
// an empty split writes m = -inf, l = 0, o = 0), and the last of the head's
// blocks merges the partials (attn_split_merge, attn_combine_head): M = max_s m_s,
// out = sum_s 2^(m_s-M) o_s / sum_s 2^(m_s-M) l_s. Split 0 always holds key lo, so M is finite.
// ctx comes from the host (ctx > 0) or, when step_pos is not null, from the device step state
// (tinyloop/graphs.py: ctx = *step_pos + 1), so one captured graph serves every step.
// Scores: one key per thread, the K row read with 16-byte loads. P*V: thread (slice, 8-dim
// chunk) reads 8 dims of V with one 16-byte (fp16) / 8-byte (int8) load per key of its slice.
#include "common.cuh"

// Launch geometry shared with the host (tinyloop/backends/cuda/compile.py GEOMETRY; -D from the
// host, defaults here for a standalone nvcc build, kept equal by tests/kernels/test_kernel_geometry.py).
#ifndef DS_THREADS
#define DS_THREADS 128
#endif
// The most splits a head's keys are dealt to (attention.py DS_MAX_SPLITS: the partials scratch),
// and the most that attn_combine_head merges one thread per output (more: the whole block).
#ifndef DS_MAX_SPLITS
#define DS_MAX_SPLITS 64
#endif
#ifndef DS_MERGE_SERIAL
#define DS_MERGE_SERIAL 8
#endif

// Keys [k0, k1) of split s of nsplit over keys lo..ctx-1 (lo = win_lo(ctx - 1, window)) in
// pages of P, and n_used, the splits that hold keys: the npages = ceil(ctx / P) - lo / P pages
// from the window's first page lo / P on are dealt pps = max(ceil(npages / nsplit), min_pps)
// whole pages a split (min_pps: the split kernel asks for a full chunk of DS_THREADS keys, so
// a short context runs in one split per head and skips the merge); the first split starts at
// key lo itself, not at its page's start. s < n_used: its first page pg0 + s*pps is below
// ceil(ctx / P), so k0 < k1; s >= n_used: k0 >= k1 (empty).
struct DsRange {
    i64 k0, k1, n_used;
};

__device__ __forceinline__ DsRange ds_split_range(i64 ctx, i64 window, i64 P, i64 nsplit,
                                                  i64 min_pps, i64 s) {
    const i64 lo = win_lo(ctx - 1, window), pg0 = lo / P;
    const i64 npages = (ctx + P - 1) / P - pg0;
    i64 pps = (npages + nsplit - 1) / nsplit;
    pps = pps > min_pps ? pps : min_pps;
    const i64 a = (pg0 + s * pps) * P, b = (pg0 + (s + 1) * pps) * P;
    DsRange r;
    r.k0 = a > lo ? a : lo;
    r.k1 = b < ctx ? b : ctx;
    r.n_used = (npages + pps - 1) / pps;
    return r;
}

// One chunk of up to DS_THREADS keys c0.. (< k1), as raw page bytes (kv_raw8) in registers:
// the thread's own key c0 + tid (its K row, for the scores) and, for the P*V pass, keys
// c0 + sl + t * NSL (t < NVK) of its key slice sl, 8 dims at chunk ch (the V parts).
template <int MODE, int HD>
struct DsChunk {
    static constexpr int C8 = HD / 8, NSL = DS_THREADS / C8, NVK = (DS_THREADS + NSL - 1) / NSL;
    uint4 k[C8];
    float ks;
    uint4 v[NVK];
    float vs[NVK];
};

// Load chunk c0's keys below k1 into ch, all but key `skip` (-1: none): the split kernel loads
// its first chunk before its PDL wait, when key ctx-1 (this step's, written by the kernel
// before) is not yet there; ds_load_key then loads that one after the wait. Both load through
// L2 only (kv_raw8 / kv_scale L2): nothing this kernel reads ahead leaves an L1 line that key
// ctx-1's later reads could hit (an int8 scale shares its sector with its neighbours').
template <int MODE, int HD>
__device__ __forceinline__ void ds_load(DsChunk<MODE, HD>& ch, const i64* __restrict__ table,
                                        i64 P, i64 k_off, i64 v_off, i64 ks_off, i64 vs_off,
                                        i64 n_kv, i64 hk, i64 c0, i64 k1, i64 skip) {
    using C = DsChunk<MODE, HD>;
    const int tid = threadIdx.x, cc = tid % C::C8, sl = tid / C::C8;
    const i64 j = c0 + tid;
    if (j < k1 && j != skip) {
        i64 row;
        const char* base = kv_page(table, P, j, &row);
#pragma unroll
        for (int u = 0; u < C::C8; ++u)
            ch.k[u] = kv_raw8<MODE, HD, true>(base, k_off, row * n_kv + hk, 8 * u);
        ch.ks = kv_scale<MODE, true>(base, ks_off, row * n_kv + hk);
    }
    if (sl < C::NSL) {
#pragma unroll
        for (int t = 0; t < C::NVK; ++t) {
            const i64 jj = c0 + sl + t * C::NSL;
            if (jj < k1 && jj != skip && sl + t * C::NSL < DS_THREADS) {
                i64 row;
                const char* base = kv_page(table, P, jj, &row);
                ch.v[t] = kv_raw8<MODE, HD, true>(base, v_off, row * n_kv + hk, 8 * cc);
                ch.vs[t] = kv_scale<MODE, true>(base, vs_off, row * n_kv + hk);
            }
        }
    }
}

// Load key `key` into ch (its K row and V parts, by the threads that hold them) when it falls
// in chunk c0 (and below k1).
template <int MODE, int HD>
__device__ __forceinline__ void ds_load_key(DsChunk<MODE, HD>& ch, const i64* __restrict__ table,
                                            i64 P, i64 k_off, i64 v_off, i64 ks_off,
                                            i64 vs_off, i64 n_kv, i64 hk, i64 c0, i64 k1,
                                            i64 key) {
    if (key < c0 || key >= k1 || key >= c0 + DS_THREADS) return;   // block-uniform
    using C = DsChunk<MODE, HD>;
    const int tid = threadIdx.x, cc = tid % C::C8, sl = tid / C::C8;
    i64 row;
    const char* base = kv_page(table, P, key, &row);
    const i64 r = row * n_kv + hk;
    if (c0 + tid == key) {
#pragma unroll
        for (int u = 0; u < C::C8; ++u)
            ch.k[u] = kv_raw8<MODE, HD, true>(base, k_off, r, 8 * u);
        ch.ks = kv_scale<MODE, true>(base, ks_off, r);
    }
    if (sl < C::NSL) {
#pragma unroll
        for (int t = 0; t < C::NVK; ++t) {
            if (c0 + sl + t * C::NSL == key) {
                ch.v[t] = kv_raw8<MODE, HD, true>(base, v_off, r, 8 * cc);
                ch.vs[t] = kv_scale<MODE, true>(base, vs_off, r);
            }
        }
    }
}

// The online-softmax update of one chunk c0.. (< k1) of up to DS_THREADS keys: scores (one
// key per thread, q * scale * log2(e) in qs), the running max m and sum l, the thread's 8 dims
// o of sum p v over its key slice. HELD: the chunk's K / V bytes are in *pre (loaded ahead);
// otherwise they are read here. Ends with a barrier (ps is rewritten by the next chunk).
template <int MODE, int HD, bool HELD>
__device__ __forceinline__ void ds_chunk(const float* qs, float* ps, float* red,
                                         const i64* __restrict__ table, i64 P, i64 k_off,
                                         i64 v_off, i64 ks_off, i64 vs_off, i64 n_kv, i64 hk,
                                         i64 c0, i64 k1, const DsChunk<MODE, HD>* pre,
                                         float& m, float& l, float* o) {
    using C = DsChunk<MODE, HD>;
    constexpr int C8 = C::C8, NSL = C::NSL;
    const int tid = threadIdx.x, cc = tid % C8, sl = tid / C8;
    const i64 j = c0 + tid;
    float sc = TL_NEG_INF;
    if (j < k1) {
        i64 row = 0;
        const char* base = HELD ? nullptr : kv_page(table, P, j, &row);
        float d = 0.0f;
#pragma unroll
        for (int u = 0; u < C8; ++u) {
            float k8[8];
            if (HELD) kv_unpack8<MODE>(pre->k[u], pre->ks, k8);
            else kv_load8<MODE, HD>(base, k_off, ks_off, row * n_kv + hk, 8 * u, k8);
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
    if (sl < NSL) {                                      // DS_THREADS % C8 leftover threads idle
        if (HELD) {
#pragma unroll
            for (int t = 0; t < C::NVK; ++t) {
                const int jj = sl + t * NSL;
                if (jj < nk) {
                    float v8[8];
                    kv_unpack8<MODE>(pre->v[t], pre->vs[t], v8);
                    const float pj = ps[jj];
#pragma unroll
                    for (int w = 0; w < 8; ++w) o[w] = fmaf(pj, v8[w], o[w]);
                }
            }
        } else {
            for (int jj = sl; jj < nk; jj += NSL) {
                i64 row;
                const char* base = kv_page(table, P, c0 + jj, &row);
                float v8[8];
                kv_load8<MODE, HD>(base, v_off, vs_off, row * n_kv + hk, 8 * cc, v8);
                const float pj = ps[jj];
#pragma unroll
                for (int w = 0; w < 8; ++w) o[w] = fmaf(pj, v8[w], o[w]);
            }
        }
    }
    __syncthreads();
}

// One (query head h, split s of nsplit) unit over the split's keys [k0, k1) (ds_split_range),
// run by a block of DS_THREADS threads (the split kernel below: h = blockIdx.x,
// s = blockIdx.y). qkv is read through L2 (__ldcg): the kernel before it in the step wrote it.
// PRE: *pre holds the unit's first chunk, already loaded (ds_load + ds_load_key); the other
// chunks (all of them without PRE) are read as they are used, which keeps registers low.
// out: null, or where the head's output goes when this is its only split (o / l, f16
// [n_heads * HD]) instead of the partial.
template <int MODE, int HD, bool PRE = false>
__device__ __forceinline__ void attn_split_unit(const half_t* qkv, i64 k0, i64 k1,
                                                const i64* __restrict__ table, i64 P, i64 k_off,
                                                i64 v_off, i64 ks_off, i64 vs_off, i64 n_heads,
                                                i64 n_kv, float scale_log2, float* part, i64 h,
                                                i64 s, i64 nsplit,
                                                const DsChunk<MODE, HD>* pre = nullptr,
                                                half_t* out = nullptr) {
    using C = DsChunk<MODE, HD>;
    constexpr int C8 = C::C8, NSL = C::NSL;
    __shared__ __align__(16) float qs[HD];
    __shared__ float ps[DS_THREADS];
    __shared__ float red[32];
    __shared__ float osum[NSL * HD];
    const int tid = threadIdx.x;
    const i64 hk = h / (n_heads / n_kv);
    float* dst = part + (h * nsplit + s) * (HD + 2);
    if (k0 >= k1) {                               // block-uniform: no keys in this split
        for (int i = tid; i < HD; i += DS_THREADS) dst[i] = 0.0f;
        if (tid == 0) { dst[HD] = TL_NEG_INF; dst[HD + 1] = 0.0f; }
        return;
    }
    for (int i = tid; i < HD; i += DS_THREADS) qs[i] = h2f(__ldcg(qkv + h * HD + i)) * scale_log2;
    __syncthreads();
    const int cc = tid % C8, sl = tid / C8;        // P*V: 8-dim chunk and key slice
    const bool pv = sl < NSL;
    float m = TL_NEG_INF, l = 0.0f, o[8];
#pragma unroll
    for (int w = 0; w < 8; ++w) o[w] = 0.0f;
    if (PRE) {                                     // the first chunk from registers
        ds_chunk<MODE, HD, true>(qs, ps, red, table, P, k_off, v_off, ks_off, vs_off, n_kv, hk,
                                 k0, k1, pre, m, l, o);
        for (i64 c0 = k0 + DS_THREADS; c0 < k1; c0 += DS_THREADS)
            ds_chunk<MODE, HD, false>(qs, ps, red, table, P, k_off, v_off, ks_off, vs_off, n_kv,
                                      hk, c0, k1, pre, m, l, o);
    } else {
        for (i64 c0 = k0; c0 < k1; c0 += DS_THREADS)
            ds_chunk<MODE, HD, false>(qs, ps, red, table, P, k_off, v_off, ks_off, vs_off, n_kv,
                                      hk, c0, k1, pre, m, l, o);
    }
    if (pv) {
#pragma unroll
        for (int w = 0; w < 8; ++w) osum[sl * HD + 8 * cc + w] = o[w];
    }
    __syncthreads();
    for (int i = tid; i < HD; i += DS_THREADS) {
        float acc = 0.0f;
#pragma unroll
        for (int k = 0; k < NSL; ++k) acc += osum[k * HD + i];
        // the one split: what attn_split_merge's read-back of the partial gives, bit for bit
        if (out != nullptr) out[h * HD + i] = f2h(__fadd_rn(acc, 0.0f) / __fadd_rn(l, 0.0f));
        else dst[i] = acc;
    }
    if (tid == 0 && out == nullptr) { dst[HD] = m; dst[HD + 1] = l; }
}

// Head h's merge of its partials 0..n_used-1 (of nsplit rows per head, n_used <= DS_MAX_SPLITS)
// into out[h * HD ..] (f16). Partials are read through L2 (__ldcg): other blocks wrote them. An
// empty split (m = -inf) weighs 0. Up to DS_MERGE_SERIAL splits, each output's thread reads
// them all itself (two passes, each unrolled so its loads are in flight at once; the splits
// summed in ascending order): two L2 round trips, no barrier. More splits would cost a round
// trip per DS_MERGE_SERIAL of them that way, so the whole block merges them, every split's
// loads in flight at once: thread s reads split s's (m, l), the block reduces M = max m_s, the
// weights w_s = 2^(m_s - M) (shared memory) and den = sum_s w_s l_s (block_sum's fixed tree);
// thread (slice sl, dim i) of DS_THREADS / HD slices sums w_s o_s[i] over s = sl, sl + slices,
// ..., and the slices' sums are added in slice order.
template <int HD>
__device__ __forceinline__ void attn_combine_head(const float* part, i64 nsplit, i64 n_used,
                                                  half_t* out, i64 h) {
    static_assert(HD <= DS_THREADS, "a merge thread per output dimension");
    static_assert(DS_MAX_SPLITS <= DS_THREADS, "a merge thread per split");
    const float* src = part + h * nsplit * (HD + 2);
    const int ns = (int)n_used, tid = threadIdx.x;
    if (ns <= DS_MERGE_SERIAL) {                  // block-uniform
        float mx = TL_NEG_INF;                    // max is exact in any order
#pragma unroll 8
        for (int s = 0; s < ns; ++s) mx = fmaxf(mx, __ldcg(src + s * (HD + 2) + HD));
        for (int i = tid; i < HD; i += blockDim.x) {
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
        return;
    }
    constexpr int SL = DS_THREADS / HD;
    __shared__ float wgt[DS_MAX_SPLITS];
    __shared__ float red[32];
    __shared__ float acc[SL * HD];
    float m = TL_NEG_INF, l = 0.0f;
    if (tid < ns) {
        m = __ldcg(src + tid * (HD + 2) + HD);
        l = __ldcg(src + tid * (HD + 2) + HD + 1);
    }
    const float mx = block_max(m, red);           // split 0 holds key lo: finite
    const float w = tid < ns ? exp2f(m - mx) : 0.0f;
    if (tid < ns) wgt[tid] = w;
    const float den = block_sum(w * l, red);      // its barriers publish wgt
    const int i = tid % HD, sl = tid / HD;
    if (sl < SL) {
        float num = 0.0f;
#pragma unroll 16
        for (int s = sl; s < ns; s += SL) num = fmaf(wgt[s], __ldcg(src + s * (HD + 2) + i), num);
        acc[sl * HD + i] = num;
    }
    __syncthreads();
    if (tid < HD) {
        float num = 0.0f;
#pragma unroll
        for (int k = 0; k < SL; ++k) num += acc[k * HD + tid];
        out[h * HD + tid] = f2h(num / den);
    }
}

// The split kernel's tail after its unit when the head has n_used > 1 splits holding keys:
// the last of the head's n_used blocks to finish (a per-head atomic ticket after a
// __threadfence, CUDA's threadFenceReduction pattern; it re-arms the ticket) merges them.
// (Splits past n_used have returned without a partial; with n_used == 1 the unit wrote the
// output itself.)
template <int HD>
__device__ __forceinline__ void attn_split_merge(const float* part, i64 nsplit, i64 n_used,
                                                 unsigned* tickets, half_t* out, i64 h) {
    __shared__ bool last;
    __threadfence();                              // this block's partial, then the ticket
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(tickets + h, 1u) == (unsigned)(n_used - 1);
    __syncthreads();
    if (!last) return;
    __threadfence();
    attn_combine_head<HD>(part, nsplit, n_used, out, h);
    if (threadIdx.x == 0) tickets[h] = 0u;        // re-armed for the next launch
}

// The split kernel (grid (n_heads, nsplit), h = blockIdx.x, s = blockIdx.y). Splits own at
// least one chunk of DS_THREADS keys (min_pps). Before its PDL wait (common.cuh) it reads only
// what no kernel of this step writes: the step state's position (advanced by the step before,
// tinyloop/model.py decode_step_ops ends with step_advance) and its split's K / V rows below
// ctx - 1 (written by earlier steps or the prefill), so its first chunk's DRAM round trip
// overlaps the kernel before (the QKV projection writing key ctx - 1 and q); after the wait it
// loads q and key ctx - 1.
template <int MODE, int HD>
__device__ __forceinline__ void attn_split_step(const half_t* qkv, i64 ctx, const int* step_pos,
                                                const i64* table, i64 P, i64 k_off, i64 v_off,
                                                i64 ks_off, i64 vs_off, i64 n_heads, i64 n_kv,
                                                float scale_log2, i64 window, float* part,
                                                unsigned* tickets, half_t* out) {
    const i64 c = step_pos != nullptr ? (i64)(*step_pos) + 1 : ctx;
    const i64 h = blockIdx.x, s = blockIdx.y, nsplit = gridDim.y;
    const i64 min_pps = (DS_THREADS + P - 1) / P;
    const DsRange r = ds_split_range(c, window, P, nsplit, min_pps, s);
    const i64 n_used = r.n_used, k0 = r.k0, k1 = r.k1;
    if (s >= n_used) return;                      // no keys: no partial, no ticket (an exit
                                                  // also releases the next kernel, as a trigger)
    const i64 hk = h / (n_heads / n_kv);
    DsChunk<MODE, HD> ch;
    ds_load<MODE, HD>(ch, table, P, k_off, v_off, ks_off, vs_off, n_kv, hk, k0, k1, c - 1);
    TL_PDL_ENTER();                               // q and key c - 1: the kernel before wrote them
    ds_load_key<MODE, HD>(ch, table, P, k_off, v_off, ks_off, vs_off, n_kv, hk, k0, k1, c - 1);
    attn_split_unit<MODE, HD, true>(qkv, k0, k1, table, P, k_off, v_off, ks_off, vs_off,
                                    n_heads, n_kv, scale_log2, part, h, s, nsplit, &ch,
                                    n_used == 1 ? out : nullptr);
    if (n_used > 1) attn_split_merge<HD>(part, nsplit, n_used, tickets, out, h);
}

// A decode batch (tinyloop/backends/cuda/attention.py kv_attention_batch): grid (n_heads,
// nsplit, B), row b = blockIdx.z is one query row (qkv + b * ld) at its own position pos[b]
// (ctx = pos[b] + 1) over the block table at address tables[b] (pos, tables: i64 [B], the
// step's device index, tinyloop/kv/cache.py batch_index). Each row deals its own keys to the
// nsplit splits (ds_split_range of its own ctx: a short row uses fewer splits, n_used), and
// has its own partials part + b * n_heads * nsplit * (HD + 2), tickets + b * n_heads and
// output row out + b * n_heads * HD; otherwise attn_split_step's unit and merge, all chunks
// read after the PDL wait (no preload).
template <int MODE, int HD>
__device__ __forceinline__ void attn_split_batch(const half_t* qkv, i64 ld,
                                                 const i64* __restrict__ pos,
                                                 const i64* __restrict__ tables, i64 P,
                                                 i64 k_off, i64 v_off, i64 ks_off, i64 vs_off,
                                                 i64 n_heads, i64 n_kv, float scale_log2,
                                                 i64 window, float* part, unsigned* tickets,
                                                 half_t* out) {
    const i64 h = blockIdx.x, s = blockIdx.y, b = blockIdx.z, nsplit = gridDim.y;
    const i64 c = pos[b] + 1;
    const i64 min_pps = (DS_THREADS + P - 1) / P;
    const DsRange r = ds_split_range(c, window, P, nsplit, min_pps, s);
    if (s >= r.n_used) return;                    // no keys: no partial, no ticket
    float* bpart = part + b * n_heads * nsplit * (HD + 2);
    half_t* bout = out + b * n_heads * HD;
    attn_split_unit<MODE, HD>(qkv + b * ld, r.k0, r.k1, (const i64*)tables[b], P, k_off, v_off,
                              ks_off, vs_off, n_heads, n_kv, scale_log2, bpart, h, s, nsplit,
                              nullptr, r.n_used == 1 ? bout : nullptr);
    if (r.n_used > 1)
        attn_split_merge<HD>(bpart, nsplit, r.n_used, tickets + b * n_heads, bout, h);
}

#ifndef TL_DEVICE_ONLY

// Entry points. step_pos: null, or the device int32 position of the step state (ctx = pos + 1).
// window: the layer's sliding window in positions, 0 = full attention (a constant per layer:
// a captured step holds it as an argument). part: f32 [n_heads, nsplit, HD + 2] scratch;
// tickets: u32 [>= n_heads], 0 before the first launch (the merging block re-arms its head's);
// out: f16 [n_heads * HD].
#define DS_ENTRIES_MODE(MODE, NAME, HD)                                                        \
    extern "C" __global__ void __launch_bounds__(DS_THREADS)                                  \
        attn_split_##NAME##_hd##HD(const half_t* qkv, i64 ctx, const int* step_pos,            \
                                   const i64* table, i64 P, i64 k_off, i64 v_off, i64 ks_off,  \
                                   i64 vs_off, i64 n_heads, i64 n_kv, double scale_log2,       \
                                   i64 window, float* part, unsigned* tickets, half_t* out) {  \
        attn_split_step<MODE, HD>(qkv, ctx, step_pos, table, P, k_off, v_off, ks_off, vs_off,  \
                                  n_heads, n_kv, (float)scale_log2, window, part, tickets,     \
                                  out);                                                        \
    }                                                                                          \
    /* a decode batch (attn_split_batch): part f32 [B, n_heads, nsplit, HD + 2], tickets   */ \
    /* u32 [>= B * n_heads], out f16 [B, n_heads * HD]                                      */ \
    extern "C" __global__ void __launch_bounds__(DS_THREADS)                                  \
        attn_split_batch_##NAME##_hd##HD(const half_t* qkv, i64 ld, const i64* pos,            \
                                         const i64* tables, i64 P, i64 k_off, i64 v_off,       \
                                         i64 ks_off, i64 vs_off, i64 n_heads, i64 n_kv,        \
                                         double scale_log2, i64 window, float* part,           \
                                         unsigned* tickets, half_t* out) {                     \
        TL_PDL_ENTER();                                                                        \
        attn_split_batch<MODE, HD>(qkv, ld, pos, tables, P, k_off, v_off, ks_off, vs_off,      \
                                   n_heads, n_kv, (float)scale_log2, window, part, tickets,    \
                                   out);                                                       \
    }
#define DS_ENTRIES(HD) DS_ENTRIES_MODE(KV_FP16, fp16, HD) DS_ENTRIES_MODE(KV_INT8, int8, HD)

// The supported head dims (ATTN_HEAD_DIMS in compile.py GEOMETRY; -D from the host).
#ifndef DS_HEAD_DIM_ENTRIES
#define DS_HEAD_DIM_ENTRIES                                                                    \
    DS_ENTRIES(16) DS_ENTRIES(32) DS_ENTRIES(48) DS_ENTRIES(64) DS_ENTRIES(80) DS_ENTRIES(96)  \
    DS_ENTRIES(128)
#endif
DS_HEAD_DIM_ENTRIES
#endif  // TL_DEVICE_ONLY
