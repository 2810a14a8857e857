// Greedy sampling on the device: argmax of one logit row, lowest id on ties; and the row's
// fault code, found by the same reduction at no extra cost: the winner is NaN if any logit is
// NaN, else +inf if any is +inf, and -inf only if every logit is -inf (common.cuh
// logit_fault_code; base.LOGIT_FAULTS).
//
// Checked against: numpy_ops.sample_from_logits with temperature 0 (np.argmax: the first NaN
// wins if any, else the first maximum) and base.logit_fault / LOGIT_FAULTS for the code
// (tests/kernels/test_kernels_gpu.py::test_sample_greedy, ::test_sample_non_finite_logits_raise).
// The LM head's own fused argmax (gemv2_norm_q*_argmax in gemv.cu) uses the same order
// (common.cuh argmax_before) and codes.
#include "common.cuh"

// Threads of the argmax's and the sampler's one block (compile.py GEOMETRY; at most 32 warps:
// the block reductions keep one value per warp).
#ifndef SMP_THREADS
#define SMP_THREADS 1024
#endif

// logits f32 [n]; writes the chosen id to result[0] and the fault code to result[1] (device or
// mapped pinned host memory). grid = 1, block = SMP_THREADS.
extern "C" __global__ void __launch_bounds__(SMP_THREADS)
    argmax_f32(const float* __restrict__ logits, i64 n, int* __restrict__ result) {
    TL_PDL_ENTER();
    __shared__ float sv[32];
    __shared__ int si[32];
    float bv = TL_NEG_INF;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = logits[i];
        if (argmax_before(v, i, bv, bi)) { bv = v; bi = i; }
    }
    block_argmax(bv, bi, sv, si);
    if (threadIdx.x == 0) {
        result[0] = bi;
        result[1] = logit_fault_code(bv);
    }
}

// ================================================================================================
// Temperature / top-k / top-p sampling on the device: one block, no sort, no host round trip.
//
// Checked against: numpy_ops.sample_from_logits (tests/kernels/test_kernels_gpu.py::
// test_sample_device_matches_rule, ::test_sample_nongreedy), whose rule is: z = logits / T in
// float64; rank tokens by (z desc, id asc); keep the first top_k (0 = all); p = exp(z - z_max)
// normalised; if top_p < 1 keep the shortest ranked prefix whose mass reaches top_p; pick the
// first ranked token whose cumulative mass exceeds u * (kept mass).
//
// Here: every weight w_i = exp(z_i - z_max) (float64) is held as a fixed-point integer
// wq_i = rn(w_i * 2^40) (<= 2^40 each, so sums of 2^20 of them fit in 64 bits), and every
// "first ranked token whose cumulative mass reaches t" is a weighted radix select over the
// 32-bit rank key of z (4 passes of 8 bits, integer histograms: exact and deterministic, no
// float atomics); tokens of equal z (equal weight) are then ordered by id. The top-k set is the
// count-based radix select of the k-th key. Integer sums are exact, so the pick equals the
// rule's whenever u * (kept mass) is not within ~n * 2^-40 of a cumulative boundary (a
// probability of about 1e-8 per draw), and tokens with w < 2^-41 (p below ~1e-12) are never
// picked (a -inf logit, a masked token, has w = 0). A row with a NaN or +inf logit, or only
// -inf, is not sampled: id 0 and its fault code (logit_fault_code) are written instead.
//
// Scratch: wq u64 [n] (device, preallocated by the host). grid = 1, block = SMP_THREADS.
// ================================================================================================
#define SMP_FIX 1099511627776.0          // 2^40

typedef unsigned long long u64;

// Rank key: ascending key == descending value (larger z first). Monotone map of float bits.
__device__ __forceinline__ unsigned rank_key(float v) {
    const unsigned b = v == 0.0f ? 0u : __float_as_uint(v);    // -0 ranks as +0 (equal z)
    const unsigned asc = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
    return ~asc;
}

// A candidate set in rank order: key < K, or key == K and id <= I (K = ~0u, I = INT_MAX: all).
struct RankCut {
    unsigned key;
    int id;
};

__device__ __forceinline__ bool in_cut(unsigned key, int id, RankCut c) {
    return key < c.key || (key == c.key && id <= c.id);
}

struct SmpShared {
    u64 mass[256];
    unsigned cnt[256];
    int warp_cnt[SMP_THREADS / 32];
    u64 total;
    unsigned pick_digit;
    int found_id;
    u64 base;
    bool none;
};

// Sum over the warp of a u64 (all lanes get it).
__device__ __forceinline__ u64 warp_sum_u64(u64 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Histogram (count and fixed-point mass) of the 8-bit digit at `shift` of the keys of the
// tokens in both cuts whose key matches `prefix` under `mask`. Warp-aggregated per digit.
// (wq is written earlier in the same launch: plain loads, never the read-only path.)
__device__ void smp_hist(const float* __restrict__ logits, const u64* wq, int n,
                         double temp, RankCut a, RankCut b, unsigned prefix, unsigned mask,
                         int shift, SmpShared& sh) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) { sh.mass[i] = 0; sh.cnt[i] = 0; }
    __syncthreads();
    const int lane = threadIdx.x & 31;
    for (int base = 0; base < n; base += blockDim.x) {
        const int i = base + threadIdx.x;
        unsigned key = 0, d = 0;
        bool act = false;
        if (i < n) {
            key = rank_key(logits[i]);
            act = in_cut(key, i, a) && in_cut(key, i, b) && (key & mask) == prefix;
            d = (key >> shift) & 255u;
        }
        unsigned todo = __ballot_sync(0xffffffffu, act);
        while (todo) {
            const int leader = __ffs(todo) - 1;
            const unsigned dl = __shfl_sync(0xffffffffu, d, leader);
            const bool mine = act && d == dl;
            const unsigned who = __ballot_sync(0xffffffffu, mine);
            const u64 m = warp_sum_u64(mine ? wq[i] : 0ull);
            if (lane == leader) {
                atomicAdd(&sh.mass[dl], m);
                atomicAdd(&sh.cnt[dl], (unsigned)__popc(who));
            }
            todo &= ~who;
        }
    }
    __syncthreads();
}

// The `nth` (1-based) smallest id among tokens in both cuts with key == `key`; -1 if fewer.
__device__ int smp_nth_id(const float* __restrict__ logits, int n, RankCut a, RankCut b,
                          unsigned key, int nth, SmpShared& sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int seen = 0;
    if (threadIdx.x == 0) sh.found_id = -1;
    __syncthreads();
    for (int base = 0; base < n; base += blockDim.x) {
        const int i = base + threadIdx.x;
        bool f = false;
        if (i < n) {
            const unsigned k = rank_key(logits[i]);
            f = k == key && in_cut(k, i, a) && in_cut(k, i, b);
        }
        const unsigned bal = __ballot_sync(0xffffffffu, f);
        if (lane == 0) sh.warp_cnt[warp] = __popc(bal);
        __syncthreads();
        int before = seen;
        for (int w = 0; w < warp; ++w) before += sh.warp_cnt[w];
        before += __popc(bal & ((1u << lane) - 1u));
        if (f && before + 1 == nth) sh.found_id = i;
        int tot = 0;
        for (int w = 0; w < nw; ++w) tot += sh.warp_cnt[w];
        seen += tot;
        __syncthreads();
        if (sh.found_id >= 0 || seen >= nth) break;       // uniform: shared and `seen` agree
    }
    const int r = sh.found_id;
    __syncthreads();
    return r;
}

// The first token in rank order, among tokens in both cuts, at which the cumulative mass
// reaches t (count mode: the cumulative count), as a cut ending at that token; `through` gets
// the cumulative mass (or count) through it. None reaches t: the cut ends at the last token
// of the set (and `through` is the set's total).
__device__ RankCut smp_select(const float* __restrict__ logits, const u64* wq,
                              int n, double temp, RankCut a, RankCut b, u64 t, bool by_count,
                              u64& through, SmpShared& sh) {
    unsigned prefix = 0, mask = 0;
    u64 base = 0;
    bool none = false;
    for (int shift = 24; shift >= 0; shift -= 8) {
        smp_hist(logits, wq, n, temp, a, b, prefix, mask, shift, sh);
        if (threadIdx.x == 0) {
            u64 acc = base;
            int pick = -1, last = -1;
            for (int d = 0; d < 256; ++d) {
                if (sh.cnt[d] == 0) continue;
                last = d;
                const u64 add = by_count ? (u64)sh.cnt[d] : sh.mass[d];
                if (acc + add >= t) { pick = d; break; }
                acc += add;
            }
            sh.none = pick < 0;
            if (pick < 0) pick = last < 0 ? 255 : last;   // none: follow the last bucket
            // mass before the chosen bucket (for "none", before the last bucket)
            if (sh.none) {
                acc = base;
                for (int d = 0; d < pick; ++d) acc += by_count ? (u64)sh.cnt[d] : sh.mass[d];
            }
            sh.pick_digit = (unsigned)pick;
            sh.base = acc;
        }
        __syncthreads();
        none = none || sh.none;
        prefix |= sh.pick_digit << shift;
        mask |= 255u << shift;
        base = sh.base;
        __syncthreads();
    }
    // prefix is the key K*; base the mass (count) of set tokens ranked before key K*.
    const unsigned ties = sh.cnt[sh.pick_digit];
    const u64 tie_mass = by_count ? (u64)ties : sh.mass[sh.pick_digit];
    const u64 w1 = ties ? tie_mass / ties : 0;                // equal z: equal weight each
    u64 j;                                                    // 1-based tie index
    if (none || w1 == 0) {
        j = ties;
    } else {
        j = (t - base + w1 - 1) / w1;                         // smallest j: base + j w1 >= t
        if (j < 1) j = 1;
        if (j > ties) j = ties;
    }
    through = base + j * w1;
    RankCut cut;
    cut.key = prefix;
    cut.id = (j == ties) ? 0x7fffffff : smp_nth_id(logits, n, a, b, prefix, (int)j, sh);
    __syncthreads();                     // every thread has read sh before the next select
    return cut;
}

// logits f32 [n]; temp > 0; top_k (0 = all); top_p (>= 1: off); u in [0, 1); wq: u64 [n]
// scratch. Writes the id and the fault code to id_dev[0..1] and, if non-null, id_host[0..1].
// One block of SMP_THREADS threads.
__device__ void sample_impl(const float* __restrict__ logits, i64 n64, double temp, i64 top_k,
                            double top_p, double u, u64* wq, int* __restrict__ id_dev,
                            int* __restrict__ id_host) {
    __shared__ SmpShared sh;
    __shared__ float red[32];
    const int n = (int)n64;
    // 1. the maximum logit and the row's fault code (a row with a NaN, a +inf, or only -inf
    //    cannot be sampled: id 0 and the code, which the host raises on), then the weights
    float m = TL_NEG_INF;
    int nan_seen = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = logits[i];
        if (v != v) nan_seen = 1;
        else m = fmaxf(m, v);
    }
    m = block_max(m, red);
    const int code = __syncthreads_or(nan_seen) ? 1 : logit_fault_code(m);
    if (code) {
        if (threadIdx.x == 0) {
            id_dev[0] = 0;
            id_dev[1] = code;
            if (id_host) { id_host[0] = 0; id_host[1] = code; }
        }
        return;
    }
    const double z0 = (double)m / temp;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const double w = exp((double)logits[i] / temp - z0);
        wq[i] = __double2ull_rn(w * SMP_FIX);
    }
    __syncthreads();
    __threadfence_block();
    const RankCut all = {0xffffffffu, 0x7fffffff};
    // 2. top-k: the cut through the k-th ranked token (count mode)
    RankCut a = all;
    u64 dummy;
    if (top_k > 0 && top_k < n) a = smp_select(logits, wq, n, temp, all, all, (u64)top_k, true,
                                               dummy, sh);
    // 3. the mass of the top-k set
    if (threadIdx.x == 0) sh.total = 0;
    __syncthreads();
    u64 part = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        if (in_cut(rank_key(logits[i]), i, a)) part += wq[i];
    part = warp_sum_u64(part);
    if ((threadIdx.x & 31) == 0) atomicAdd(&sh.total, part);
    __syncthreads();
    const u64 wa = sh.total;
    // 4. top-p: the shortest ranked prefix whose mass reaches top_p of the set's
    RankCut b = all;
    u64 wb = wa;
    if (top_p < 1.0) {
        const double tp = ceil(top_p * (double)wa);
        const u64 t = tp <= 0.0 ? 0ull : (u64)tp;
        b = smp_select(logits, wq, n, temp, a, all, t, false, wb, sh);
    }
    // 5. the pick: the first ranked token whose cumulative mass exceeds u * (kept mass)
    const u64 tau = (u64)floor(u * (double)wb) + 1ull;
    u64 thr;
    const RankCut pick = smp_select(logits, wq, n, temp, a, b, tau, false, thr, sh);
    // the pick's id: the last token of the cut `pick` (its id field, or the last tie)
    int id = pick.id;
    if (id == 0x7fffffff) {
        // the cut ends with every tie of key pick.key: the largest such id in a and b
        int best = -1;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const unsigned k = rank_key(logits[i]);
            if (k == pick.key && in_cut(k, i, a) && in_cut(k, i, b)) best = max(best, i);
        }
        __shared__ int bm[32];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) best = max(best, __shfl_xor_sync(0xffffffffu, best, o));
        if ((threadIdx.x & 31) == 0) bm[threadIdx.x >> 5] = best;
        __syncthreads();
        if (threadIdx.x < 32) {
            best = (int)threadIdx.x < (int)(blockDim.x >> 5) ? bm[threadIdx.x] : -1;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
                best = max(best, __shfl_xor_sync(0xffffffffu, best, o));
        }
        id = best;
    }
    if (threadIdx.x == 0) {
        id_dev[0] = id;
        id_dev[1] = 0;
        if (id_host) { id_host[0] = id; id_host[1] = 0; }
    }
}

// The one temperature sampler: its parameters read when the kernel runs from prm f64 [4] =
// (temperature, top_k, top_p, u) in mapped pinned host memory that the host fills first, so
// one captured decode step (tinyloop/graphs.py) serves every step and every setting
// (CudaOps.set_step_sampling); the id and the fault code go to step[0..1]: the device step
// state (STEP_ID, STEP_FAULT), or for an eager CudaOps.sample a mapped pinned int [2].
extern "C" __global__ void __launch_bounds__(SMP_THREADS)
    sample_step(const float* logits, i64 n64, const volatile double* prm, u64* wq, int* step) {
    TL_PDL_ENTER();
    __shared__ double p[4];                     // one read of host memory per value
    if (threadIdx.x < 4) p[threadIdx.x] = prm[threadIdx.x];
    __syncthreads();
    const double temp = p[0], top_p = p[2], u = p[3];
    const i64 top_k = (i64)p[1];
    sample_impl(logits, n64, temp, top_k, top_p, u, wq, step, nullptr);
}
