// Split-K decode attention ("flash-decoding", Dao et al. 2023) over the paged KV cache: one
// query row (T = 1) of every query head against keys lo..ctx-1, lo = win_lo(ctx - 1, window)
// (common.cuh: max(0, ctx - window) on a sliding-window layer, window > 0; 0 for full
// attention, window = 0).
//
// Checked against: NumpyOps.kv_attention (tests/kernels/test_kernels_gpu.py::test_decode_split_*), which
// reads the same page layout (tinyloop/kv/layouts.py PageLayout) through the same block table;
// the decode batch entry row by row (tests/kernels/test_batch_attention_gpu.py).
// Query head h reads KV head h / (n_heads / n_kv); scale 1/sqrt(head_dim); scores in log2 units
// (q pre-multiplied by scale*log2(e)) so exp2f does the exponentials. An int8 row's scale
// multiplies its dot product and its softmax weight once, not each code (ds_codes8), which
// differs from dequantize-then-dot (layouts.py) only by float32 rounding.
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
// Each thread holds 8 dims of K and V of a few keys (DsGeom: a group of lanes per key, so a
// warp's loads read whole rows, coalesced) and runs its own online softmax over them, with
// no barrier per chunk; the block's threads merge once at the end.
#include "common.cuh"

// Launch geometry shared with the host (tinyloop/backends/cuda/compile.py GEOMETRY; -D from the
// host, defaults here for a standalone nvcc build, kept equal by tests/kernels/test_kernel_geometry.py).
#ifndef DS_THREADS
#define DS_THREADS 128
#endif
// The most splits a head's keys are dealt to (attention.py DS_MAX_SPLITS: the partials scratch),
// and the most that attn_combine_head merges one thread per output (more: the whole block).
// Blocks per SM the register allocation leaves room for: a long context's split grid then
// runs in one wave.
#ifndef DS_MIN_BLOCKS
#define DS_MIN_BLOCKS 5
#endif
#ifndef DS_MAX_SPLITS
#define DS_MAX_SPLITS 64
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

// How a block's DS_THREADS threads share a chunk of keys: lane c < C8 = HD / 8 of a group of
// GS lanes (GS the power of two >= C8; lanes C8..GS-1 of HD 48 / 80 / 96 load nothing) holds
// dims 8c..8c+7 of one key, so one warp load reads KPW = 32 / GS whole K (or V) rows,
// coalesced. A block step covers KPS = NW * KPW keys (NW warps), a thread holds TU steps and
// a chunk is CH = KPS * TU keys: key c0 + t * KPS + w * KPW + g of chunk c0 belongs to group
// g of warp w at step t. TU is chosen so a chunk holds DS_THREADS keys where a thread's share
// fits in at most 8 steps (TU * 32 bytes of fp16 K and V per thread).
template <int HD>
struct DsGeom {
    static constexpr int C8 = HD / 8;
    static constexpr int GS = C8 <= 2 ? 2 : C8 <= 4 ? 4 : C8 <= 8 ? 8 : C8 <= 16 ? 16 : 32;
    static constexpr int KPW = 32 / GS, NW = DS_THREADS / 32, KPS = NW * KPW;
    static constexpr int TU = KPS >= DS_THREADS ? 1 : (DS_THREADS / KPS > 8 ? 8 : DS_THREADS / KPS);
    static constexpr int CH = KPS * TU;
    static_assert(HD % 8 == 0 && C8 <= 32, "head dims are multiples of 8, at most 256");
    static_assert(DS_THREADS % 32 == 0, "whole warps");
};

// One chunk's raw page bytes (kv_raw8) in registers: the thread's 8 dims of K and V of its
// TU keys, and their int8 scales.
template <int MODE, int HD>
struct DsChunk {
    static constexpr int TU = DsGeom<HD>::TU;
    uint4 k[TU], v[TU];
    float ks[TU], vs[TU];
};

// The thread's place in the chunk (DsGeom): warp w, group g, lane c of the group, and the
// offset in the chunk of the key it holds at step t.
template <int HD>
struct DsLane {
    int w, g, c;
    __device__ __forceinline__ DsLane() {
        const int lane = threadIdx.x & 31;
        w = threadIdx.x >> 5;
        g = lane / DsGeom<HD>::GS;
        c = lane % DsGeom<HD>::GS;
    }
    __device__ __forceinline__ int off(int t) const {
        using G = DsGeom<HD>;
        return t * G::KPS + w * G::KPW + g;
    }
};

// Keys of chunk c0 below k1 (at most CH).
template <int HD>
__device__ __forceinline__ int ds_keys(i64 c0, i64 k1) {
    return (int)(k1 - c0 < DsGeom<HD>::CH ? k1 - c0 : DsGeom<HD>::CH);
}

// Row r (row * n_kv + hk) of key j, and its page (kv_page in 32-bit arithmetic: positions
// and page sizes are below 2^31).
__device__ __forceinline__ const char* ds_page(const i64* __restrict__ table, i64 P, i64 j,
                                               i64 n_kv, i64 hk, i64* r) {
    const unsigned ju = (unsigned)j, pu = (unsigned)P, pg = ju / pu;
    *r = (i64)(ju - pg * pu) * n_kv + hk;
    return (const char*)table[pg];
}

// Load the thread's parts of chunk c0's keys below k1 into ch, all but key `skip` (-1: none):
// the split kernel loads its first chunk before its PDL wait, when key ctx-1 (this step's,
// written by the kernel before) is not yet there; ds_load_key then loads that one after the
// wait. Both load through L2 only (kv_raw8 / kv_scale L2): nothing this kernel reads ahead
// leaves an L1 line that key ctx-1's later reads could hit (an int8 scale shares its sector
// with its neighbours').
template <int MODE, int HD>
__device__ __forceinline__ void ds_load(DsChunk<MODE, HD>& ch, const i64* __restrict__ table,
                                        i64 P, i64 k_off, i64 v_off, i64 ks_off, i64 vs_off,
                                        i64 n_kv, i64 hk, i64 c0, i64 k1, i64 skip) {
    using G = DsGeom<HD>;
    const DsLane<HD> ln;
    if (ln.c >= G::C8) return;
    const int nk = ds_keys<HD>(c0, k1), sk = skip >= c0 ? (int)(skip - c0) : -1;
#pragma unroll
    for (int t = 0; t < G::TU; ++t) {
        const int o = ln.off(t);
        if (o < nk && o != sk) {
            i64 r;
            const char* base = ds_page(table, P, c0 + o, n_kv, hk, &r);
            ch.k[t] = kv_raw8<MODE, HD, true>(base, k_off, r, 8 * ln.c);
            ch.v[t] = kv_raw8<MODE, HD, true>(base, v_off, r, 8 * ln.c);
            ch.ks[t] = kv_scale<MODE, true>(base, ks_off, r);
            ch.vs[t] = kv_scale<MODE, true>(base, vs_off, r);
        }
    }
}

// Load key `key` into ch (by the group that holds it) when it falls in chunk c0, below k1.
template <int MODE, int HD>
__device__ __forceinline__ void ds_load_key(DsChunk<MODE, HD>& ch, const i64* __restrict__ table,
                                            i64 P, i64 k_off, i64 v_off, i64 ks_off,
                                            i64 vs_off, i64 n_kv, i64 hk, i64 c0, i64 k1,
                                            i64 key) {
    using G = DsGeom<HD>;
    if (key < c0 || key >= k1 || key >= c0 + G::CH) return;   // block-uniform
    const DsLane<HD> ln;
    const int off = (int)(key - c0), tk = off / G::KPS, rem = off % G::KPS;
    if (ln.c >= G::C8 || ln.w != rem / G::KPW || ln.g != rem % G::KPW) return;
    i64 r;
    const char* base = ds_page(table, P, key, n_kv, hk, &r);
#pragma unroll
    for (int t = 0; t < G::TU; ++t) {           // a constant index: ch stays in registers
        if (t == tk) {
            ch.k[t] = kv_raw8<MODE, HD, true>(base, k_off, r, 8 * ln.c);
            ch.v[t] = kv_raw8<MODE, HD, true>(base, v_off, r, 8 * ln.c);
            ch.ks[t] = kv_scale<MODE, true>(base, ks_off, r);
            ch.vs[t] = kv_scale<MODE, true>(base, vs_off, r);
        }
    }
}

// A K or V part's 8 raw values as floats, before the int8 scale: FP16 values, or the int8
// codes exactly (code + 128 placed in the low mantissa byte of 2^23 by a byte permute, then
// 2^23 + 128 subtracted: two full-rate instructions a value in place of a conversion). The
// caller applies the row's scale once, to the dot product (K) or to the weight p (V).
template <int MODE>
__device__ __forceinline__ void ds_codes8(uint4 w4, float* x) {
    if (MODE == KV_FP16) {
        kv_unpack8<MODE>(w4, 1.0f, x);
    } else {
        const unsigned w[2] = {w4.x ^ 0x80808080u, w4.y ^ 0x80808080u};
#pragma unroll
        for (int j = 0; j < 8; ++j)
            x[j] = __uint_as_float(__byte_perm(w[j >> 2], 0x4B000000u, 0x7440u | (j & 3))) -
                   8388736.0f;
    }
}

// The online-softmax update of the thread's running (m, l, o) by its keys of chunk c0 (in
// ch, below k1): m the running max of the scores (log2 units, q8 = the thread's 8 dims of
// q * scale * log2(e)), l the sum of 2^(s - m), o its 8 dims of the sum of 2^(s - m) v. A
// key's score is its group's 8-dim partial dots summed by shuffles (the same in every lane
// of the group, so a group's (m, l) agree). No barrier: the threads' states merge at the end.
template <int MODE, int HD>
__device__ __forceinline__ void ds_compute(const DsChunk<MODE, HD>& ch, const float* q8,
                                           i64 c0, i64 k1, float& m, float& l, float* o) {
    using G = DsGeom<HD>;
    const DsLane<HD> ln;
    const bool dims = ln.c < G::C8;
    const int nk = ds_keys<HD>(c0, k1);
    float sc[G::TU];
#pragma unroll
    for (int t = 0; t < G::TU; ++t) {
        const bool ok = ln.off(t) < nk;
        float d = 0.0f;
        if (ok && dims) {
            float k8[8];
            ds_codes8<MODE>(ch.k[t], k8);
#pragma unroll
            for (int i = 0; i < 8; ++i) d = fmaf(q8[i], k8[i], d);
            d *= ch.ks[t];                        // the row's scale (1 for FP16)
        }
#pragma unroll
        for (int x = G::GS / 2; x > 0; x >>= 1) d += __shfl_xor_sync(0xffffffffu, d, x);
        sc[t] = ok ? d : TL_NEG_INF;
    }
    float mx = m;
#pragma unroll
    for (int t = 0; t < G::TU; ++t) mx = fmaxf(mx, sc[t]);
    if (mx == TL_NEG_INF) return;                 // no key of this group yet
    const float alpha = exp2f(m - mx);            // m = -inf: 0
    l *= alpha;
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] *= alpha;
#pragma unroll
    for (int t = 0; t < G::TU; ++t) {
        if (ln.off(t) < nk) {
            const float p = exp2f(sc[t] - mx);
            l += p;
            if (dims) {
                float v8[8];
                ds_codes8<MODE>(ch.v[t], v8);
                const float pv = p * ch.vs[t];
#pragma unroll
                for (int i = 0; i < 8; ++i) o[i] = fmaf(pv, v8[i], o[i]);
            }
        }
    }
    m = mx;
}

// One (query head h, split s of nsplit) unit over the split's keys [k0, k1) (ds_split_range),
// run by a block of DS_THREADS threads (the split kernel below: h = blockIdx.x,
// s = blockIdx.y). qkv is read through L2 (__ldcg): the kernel before it in the step wrote it.
// ch: the chunk registers; held: they already hold the first chunk (ds_load + ds_load_key,
// the split kernel's preload), the other chunks are loaded as they come. Each thread runs the
// online softmax over its own keys (ds_compute); at the end the groups of a warp merge by
// shuffles, then the warps through shared memory, in warp order: M = max m,
// l = sum 2^(m - M) l, o = sum 2^(m - M) o. out: null, or where the head's output goes when
// this is its only split (o / l, f16 [n_heads * HD]) instead of the partial.
template <int MODE, int HD>
__device__ __forceinline__ void attn_split_unit(const half_t* qkv, i64 k0, i64 k1,
                                                const i64* __restrict__ table, i64 P, i64 k_off,
                                                i64 v_off, i64 ks_off, i64 vs_off, i64 n_heads,
                                                i64 n_kv, float scale_log2, float* part, i64 h,
                                                i64 s, i64 nsplit, DsChunk<MODE, HD>& ch,
                                                bool held, half_t* out) {
    using G = DsGeom<HD>;
    __shared__ float wm[G::NW], wl[G::NW];
    __shared__ float wo[G::NW * HD];
    const int tid = threadIdx.x;
    const DsLane<HD> ln;
    const i64 hk = h / (n_heads / n_kv);
    float* dst = part + (h * nsplit + s) * (HD + 2);
    if (k0 >= k1) {                               // block-uniform: no keys in this split
        for (int i = tid; i < HD; i += DS_THREADS) dst[i] = 0.0f;
        if (tid == 0) { dst[HD] = TL_NEG_INF; dst[HD + 1] = 0.0f; }
        return;
    }
    float q8[8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
        q8[i] = ln.c < G::C8 ? h2f(__ldcg(qkv + h * HD + 8 * ln.c + i)) * scale_log2 : 0.0f;
    float m = TL_NEG_INF, l = 0.0f, o[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = 0.0f;
    for (i64 c0 = k0; c0 < k1; c0 += G::CH) {
        if (!held || c0 != k0)
            ds_load<MODE, HD>(ch, table, P, k_off, v_off, ks_off, vs_off, n_kv, hk, c0, k1, -1);
        ds_compute<MODE, HD>(ch, q8, c0, k1, m, l, o);
    }
#pragma unroll
    for (int x = G::GS; x < 32; x <<= 1) {         // the warp's groups: lane c gets them all
        const float mo = __shfl_xor_sync(0xffffffffu, m, x);
        const float lo = __shfl_xor_sync(0xffffffffu, l, x);
        const float mx = fmaxf(m, mo);
        const float a = mx == TL_NEG_INF ? 0.0f : exp2f(m - mx);
        const float b = mx == TL_NEG_INF ? 0.0f : exp2f(mo - mx);
        l = l * a + lo * b;
#pragma unroll
        for (int i = 0; i < 8; ++i) o[i] = o[i] * a + __shfl_xor_sync(0xffffffffu, o[i], x) * b;
        m = mx;
    }
    if (ln.g == 0 && ln.c < G::C8) {
#pragma unroll
        for (int i = 0; i < 8; ++i) wo[ln.w * HD + 8 * ln.c + i] = o[i];
    }
    if ((tid & 31) == 0) { wm[ln.w] = m; wl[ln.w] = l; }
    __syncthreads();
    for (int i = tid; i < HD; i += DS_THREADS) {
        float mx = TL_NEG_INF;                    // finite: the split holds a key
#pragma unroll
        for (int w = 0; w < G::NW; ++w) mx = fmaxf(mx, wm[w]);
        float num = 0.0f, den = 0.0f;
#pragma unroll
        for (int w = 0; w < G::NW; ++w) {
            const float a = exp2f(wm[w] - mx);    // a warp without keys: 0
            num = fmaf(a, wo[w * HD + i], num);
            den = fmaf(a, wl[w], den);
        }
        if (out != nullptr) {
            out[h * HD + i] = f2h(num / den);
        } else {
            dst[i] = num;
            if (i == 0) { dst[HD] = mx; dst[HD + 1] = den; }
        }
    }
}

// Head h's merge of its partials 0..n_used-1 (of nsplit rows per head, n_used <= DS_MAX_SPLITS,
// each holding keys) into out[h * HD ..] (f16): M = max_s m_s, out = sum_s 2^(m_s - M) o_s /
// sum_s 2^(m_s - M) l_s. Partials are read through L2 (__ldcg): other blocks wrote them. One
// round of loads: thread s < n_used reads split s's (m, l) into shared memory while thread
// (slice sl, dim i) of SL = DS_THREADS / HD slices reads o_s[i] of its splits
// s = sl, sl + SL, ... (up to 32 at once); after one barrier every warp finds M (warp_max's
// fixed tree), warp 0 sums the denominator (warp_sum's) and each slice its numerator in
// ascending s; the slices' sums are added in slice order.
template <int HD>
__device__ __forceinline__ void attn_combine_head(const float* part, i64 nsplit, i64 n_used,
                                                  half_t* out, i64 h) {
    constexpr int SL = DS_THREADS / HD, NB = (DS_MAX_SPLITS + SL - 1) / SL;
    constexpr int B = NB < 32 ? NB : 32;
    static_assert(HD <= DS_THREADS, "a merge thread per output dimension");
    static_assert(DS_MAX_SPLITS <= DS_THREADS, "a merge thread per split");
    __shared__ float sm_m[DS_MAX_SPLITS], sm_l[DS_MAX_SPLITS], acc[SL * HD];
    __shared__ float den;
    const float* src = part + h * nsplit * (HD + 2);
    const int ns = (int)n_used, tid = threadIdx.x, lane = tid & 31, i = tid % HD, sl = tid / HD;
    const bool act = sl < SL;
    if (tid < ns) {
        sm_m[tid] = __ldcg(src + tid * (HD + 2) + HD);
        sm_l[tid] = __ldcg(src + tid * (HD + 2) + HD + 1);
    }
    float ov[B];
#pragma unroll
    for (int k = 0; k < B; ++k) {
        const int s = sl + k * SL;
        ov[k] = act && s < ns ? __ldcg(src + s * (HD + 2) + i) : 0.0f;
    }
    __syncthreads();
    float mx = TL_NEG_INF;
    for (int s = lane; s < ns; s += 32) mx = fmaxf(mx, sm_m[s]);
    mx = warp_max(mx);                            // split 0 holds key lo: finite
    float num = 0.0f;
#pragma unroll
    for (int k = 0; k < B; ++k) {
        const int s = sl + k * SL;
        if (s < ns) num = fmaf(exp2f(sm_m[s] - mx), ov[k], num);
    }
#pragma unroll
    for (int k0 = B; k0 < NB; k0 += B) {          // HD > DS_THREADS / 2: a second round
#pragma unroll
        for (int k = 0; k < B; ++k) {
            const int s = sl + (k0 + k) * SL;
            ov[k] = act && s < ns ? __ldcg(src + s * (HD + 2) + i) : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < B; ++k) {
            const int s = sl + (k0 + k) * SL;
            if (s < ns) num = fmaf(exp2f(sm_m[s] - mx), ov[k], num);
        }
    }
    if (act) acc[sl * HD + i] = num;
    if (tid < 32) {
        float d = 0.0f;
        for (int s = lane; s < ns; s += 32) d = fmaf(exp2f(sm_m[s] - mx), sm_l[s], d);
        d = warp_sum(d);
        if (lane == 0) den = d;
    }
    __syncthreads();
    if (tid < HD) {
        float t = 0.0f;
#pragma unroll
        for (int k = 0; k < SL; ++k) t += acc[k * HD + tid];
        out[h * HD + tid] = f2h(t / den);
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
    attn_split_unit<MODE, HD>(qkv, k0, k1, table, P, k_off, v_off, ks_off, vs_off, n_heads,
                              n_kv, scale_log2, part, h, s, nsplit, ch, true,
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
    DsChunk<MODE, HD> ch;
    attn_split_unit<MODE, HD>(qkv + b * ld, r.k0, r.k1, (const i64*)tables[b], P, k_off, v_off,
                              ks_off, vs_off, n_heads, n_kv, scale_log2, bpart, h, s, nsplit,
                              ch, false, r.n_used == 1 ? bout : nullptr);
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
    extern "C" __global__ void __launch_bounds__(DS_THREADS, DS_MIN_BLOCKS)                               \
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
    extern "C" __global__ void __launch_bounds__(DS_THREADS, DS_MIN_BLOCKS)                               \
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
