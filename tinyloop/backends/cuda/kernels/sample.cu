// Greedy sampling on the device: argmax of each logit row, lowest id on ties; and the row's
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

// logits f32 [B, n] (B = gridDim.x rows, contiguous); block b writes row b's chosen id to
// result[2b] and its fault code to result[2b + 1] (device or mapped pinned host memory).
// grid = B, block = SMP_THREADS.
extern "C" __global__ void __launch_bounds__(SMP_THREADS)
    argmax_f32(const float* __restrict__ logits, i64 n, int* __restrict__ result) {
    TL_PDL_ENTER();
    __shared__ float sv[32];
    __shared__ int si[32];
    logits += (i64)blockIdx.x * n;
    result += 2 * (i64)blockIdx.x;
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
// Temperature / top-k / top-p / min-p sampling on the device, with the repetition penalty:
// no sort of the row, no host round trip. Two paths pick the same id: the reference, one
// block over the whole row (sample_step), and the fast path, a grid over the row that leaves
// one block a few candidates (sample_fast_*, further down).
//
// Checked against: numpy_ops.sample_from_logits (tests/kernels/test_kernels_gpu.py::
// test_sample_device_matches_rule, ::test_sample_nongreedy; tests/kernels/
// test_sample_fast_gpu.py), whose rule is: the repetition penalty (sample_penalize, below);
// temperature 0: the argmax; else z = logits / T in float64; rank tokens by (z desc, id asc);
// keep the first top_k (0 = all); p = exp(z - z_max) normalised; if top_p < 1 keep the
// shortest ranked prefix whose mass reaches top_p; then keep tokens with exp(z - z_max) >=
// min_p (min-p); pick the first kept token in rank order whose cumulative mass exceeds
// u * (kept mass).
//
// Here: every weight w_i = exp(z_i - z_max) (float64) is held as a fixed-point integer
// wq_i = rn(w_i * 2^40) (<= 2^40 each, so sums of 2^20 of them fit in 64 bits), and every
// "first ranked token whose cumulative mass reaches t" is a weighted radix select over the
// 32-bit rank key of z (4 passes of 8 bits, integer histograms: exact and deterministic, no
// float atomics); tokens of equal z (equal weight) are then ordered by id. The top-k set is the
// count-based radix select of the k-th key; min-p keeps wq_i >= ceil(min_p * 2^40). Integer
// sums are exact, so the pick equals the rule's whenever u * (kept mass) is not within
// ~n * 2^-40 of a cumulative boundary and no weight lies within 2^-41 of min_p (a probability
// of about 1e-8 per draw), and tokens with w < 2^-41 (p below ~1e-12) are never picked (a
// -inf logit, a masked token, has w = 0). A row with a NaN or +inf logit, or only -inf, is not
// sampled: id 0 and its fault code (logit_fault_code) are written instead.
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
// tokens in both cuts, of weight >= wmin (min-p; 0: every token), whose key matches `prefix`
// under `mask`. Warp-aggregated per digit.
// (wq is written earlier in the same launch: plain loads, never the read-only path.)
__device__ void smp_hist(const float* __restrict__ logits, const u64* wq, int n,
                         double temp, RankCut a, RankCut b, u64 wmin, unsigned prefix,
                         unsigned mask, int shift, SmpShared& sh) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) { sh.mass[i] = 0; sh.cnt[i] = 0; }
    __syncthreads();
    const int lane = threadIdx.x & 31;
    for (int base = 0; base < n; base += blockDim.x) {
        const int i = base + threadIdx.x;
        unsigned key = 0, d = 0;
        bool act = false;
        if (i < n) {
            key = rank_key(logits[i]);
            act = in_cut(key, i, a) && in_cut(key, i, b) && (key & mask) == prefix
                  && wq[i] >= wmin;
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

// The `nth` (1-based) smallest id among tokens in both cuts of weight >= wmin with key ==
// `key`; -1 if fewer.
__device__ int smp_nth_id(const float* __restrict__ logits, const u64* wq, int n, RankCut a,
                          RankCut b, u64 wmin, unsigned key, int nth, SmpShared& sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int seen = 0;
    if (threadIdx.x == 0) sh.found_id = -1;
    __syncthreads();
    for (int base = 0; base < n; base += blockDim.x) {
        const int i = base + threadIdx.x;
        bool f = false;
        if (i < n) {
            const unsigned k = rank_key(logits[i]);
            f = k == key && in_cut(k, i, a) && in_cut(k, i, b) && wq[i] >= wmin;
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

// The first token in rank order, among tokens in both cuts of weight >= wmin, at which the
// cumulative mass reaches t (count mode: the cumulative count), as a cut ending at that token;
// `through` gets the cumulative mass (or count) through it. None reaches t: the cut ends at
// the last token of the set (and `through` is the set's total).
__device__ RankCut smp_select(const float* __restrict__ logits, const u64* wq,
                              int n, double temp, RankCut a, RankCut b, u64 wmin, u64 t,
                              bool by_count, u64& through, SmpShared& sh) {
    unsigned prefix = 0, mask = 0;
    u64 base = 0;
    bool none = false;
    for (int shift = 24; shift >= 0; shift -= 8) {
        smp_hist(logits, wq, n, temp, a, b, wmin, prefix, mask, shift, sh);
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
    cut.id = (j == ties) ? 0x7fffffff
                         : smp_nth_id(logits, wq, n, a, b, wmin, prefix, (int)j, sh);
    __syncthreads();                     // every thread has read sh before the next select
    return cut;
}

// The weight of logit l under z0 = m / temp: the one formula of both paths (bit-identical).
__device__ __forceinline__ u64 smp_weight(float l, double temp, double z0) {
    return __double2ull_rn(exp((double)l / temp - z0) * SMP_FIX);
}

// min-p's threshold on wq: keep wq >= ceil(min_p * 2^40) (0: off).
__device__ __forceinline__ u64 smp_minp_thr(double min_p) {
    return min_p > 0.0 ? (u64)ceil(min_p * SMP_FIX) : 0ull;
}

// Write the id and the fault code.
__device__ __forceinline__ void smp_write(int id, int code, int* id_dev, int* id_host) {
    id_dev[0] = id;
    id_dev[1] = code;
    if (id_host) { id_host[0] = id; id_host[1] = code; }
}

// The argmax of the row (temperature 0 with the repetition penalty on: the penalised row),
// with its fault code, by thread 0.
__device__ void smp_argmax(const float* __restrict__ logits, int n, int* id_dev, int* id_host) {
    __shared__ float sv[32];
    __shared__ int si[32];
    float bv = TL_NEG_INF;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = logits[i];
        if (argmax_before(v, i, bv, bi)) { bv = v; bi = i; }
    }
    block_argmax(bv, bi, sv, si);
    if (threadIdx.x == 0) smp_write(bi, logit_fault_code(bv), id_dev, id_host);
}

// logits f32 [n]; temp (<= 0: the argmax); top_k (0 = all); top_p (>= 1: off); min_p (<= 0:
// off); u in [0, 1); wq: u64 [n] scratch. Writes the id and the fault code to id_dev[0..1] and,
// if non-null, id_host[0..1]. One block of SMP_THREADS threads: the reference path.
__device__ __noinline__ void sample_impl(const float* __restrict__ logits, i64 n64, double temp, i64 top_k,
                            double top_p, double min_p, double u, u64* wq,
                            int* __restrict__ id_dev, int* __restrict__ id_host) {
    __shared__ SmpShared sh;
    __shared__ float red[32];
    const int n = (int)n64;
    if (!(temp > 0.0)) {
        smp_argmax(logits, n, id_dev, id_host);
        return;
    }
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
        if (threadIdx.x == 0) smp_write(0, code, id_dev, id_host);
        return;
    }
    const double z0 = (double)m / temp;
    for (int i = threadIdx.x; i < n; i += blockDim.x) wq[i] = smp_weight(logits[i], temp, z0);
    __syncthreads();
    __threadfence_block();
    const RankCut all = {0xffffffffu, 0x7fffffff};
    // 2. top-k: the cut through the k-th ranked token (count mode)
    RankCut a = all;
    u64 dummy;
    if (top_k > 0 && top_k < n) a = smp_select(logits, wq, n, temp, all, all, 0ull,
                                               (u64)top_k, true, dummy, sh);
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
        b = smp_select(logits, wq, n, temp, a, all, 0ull, t, false, wb, sh);
    }
    // 5. min-p: the kept set's mass counts only weights >= the threshold
    const u64 wmin = smp_minp_thr(min_p);
    if (wmin) {
        __syncthreads();
        if (threadIdx.x == 0) sh.total = 0;
        __syncthreads();
        part = 0;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const unsigned k = rank_key(logits[i]);
            if (in_cut(k, i, a) && in_cut(k, i, b) && wq[i] >= wmin) part += wq[i];
        }
        part = warp_sum_u64(part);
        if ((threadIdx.x & 31) == 0) atomicAdd(&sh.total, part);
        __syncthreads();
        wb = sh.total;
    }
    // 6. the pick: the first kept token whose cumulative mass exceeds u * (kept mass)
    const u64 tau = (u64)floor(u * (double)wb) + 1ull;
    u64 thr;
    const RankCut pick = smp_select(logits, wq, n, temp, a, b, wmin, tau, false, thr, sh);
    // the pick's id: the last token of the cut `pick` (its id field, or the last tie)
    int id = pick.id;
    if (id == 0x7fffffff) {
        // the cut ends with every tie of key pick.key: the largest such id in a, b and min-p
        int best = -1;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const unsigned k = rank_key(logits[i]);
            if (k == pick.key && in_cut(k, i, a) && in_cut(k, i, b) && wq[i] >= wmin)
                best = max(best, i);
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
    if (threadIdx.x == 0) smp_write(id, 0, id_dev, id_host);
}

// Sampler parameters prm f64 [SMP_PRM]: read when the sampler runs, from mapped pinned host
// memory that the host fills first, so one captured decode step (tinyloop/graphs.py) serves
// every step and every setting (CudaOps.set_step_sampling). sample_params copies them to the
// device scratch (SmpFast::prm) once; the sampler's other kernels read that copy.
#define SMP_PRM 8
#define SMP_P_TEMP 0
#define SMP_P_TOPK 1
#define SMP_P_TOPP 2
#define SMP_P_U 3
#define SMP_P_MINP 4
#define SMP_P_PENALTY 5
#define SMP_P_LAST_N 6

struct SmpParams {            // the picks'; sample_params / sample_penalize read the penalty's
    double temp, top_p, min_p, u;
    i64 top_k;
};

// One read per value, into shared memory, then to every thread.
__device__ __forceinline__ SmpParams smp_params(const volatile double* prm) {
    __shared__ double p[SMP_PRM];
    if (threadIdx.x < SMP_PRM) p[threadIdx.x] = prm[threadIdx.x];
    __syncthreads();
    SmpParams r;
    r.temp = p[SMP_P_TEMP];
    r.top_k = (i64)p[SMP_P_TOPK];
    r.top_p = p[SMP_P_TOPP];
    r.u = p[SMP_P_U];
    r.min_p = p[SMP_P_MINP];
    return r;
}

// The reference sampler: parameters from prm (SmpFast::prm, which sample_params wrote); the id
// and the fault code go to step[0..1]: the device step state (STEP_ID, STEP_FAULT), or for an
// eager CudaOps.sample a mapped pinned int [2]. grid = 1, block = SMP_THREADS.
extern "C" __global__ void __launch_bounds__(SMP_THREADS)
    sample_step(const float* logits, i64 n64, const volatile double* prm, u64* wq, int* step) {
    TL_PDL_ENTER();
    const SmpParams q = smp_params(prm);
    sample_impl(logits, n64, q.temp, q.top_k, q.top_p, q.min_p, q.u, wq, step, nullptr);
}

// ================================================================================================
// The sampler's first launch, sample_params: its parameters and the repetition penalty's window
// into the device scratch SmpFast (below), so that no later kernel of the sampler reads host
// memory (a grid whose every block reads mapped pinned memory waits on thousands of PCIe
// reads).
//
// The repetition penalty (CTRL, Keskar et al. 2019; HF RepetitionPenaltyLogitsProcessor,
// llama.cpp penalty_repeat): out f32 [n] = logits, except every distinct id among the tokens
// of the last N positions (pos - N + 1 .. pos, from 0) has l / penalty if l > 0 else
// l * penalty, in float32 with IEEE rounding (numpy_ops.penalize_logits). A token listed
// several times writes the same value, so duplicates need no care.
//
// The window is a ring: ring int32 [N] holds the token at position p in slot p % N; the token
// at pos itself is state[STEP_ID] (the step's input token), which sample_params stores in slot
// pos % N for the next step (it reads that slot for no position: it takes state[STEP_ID]
// instead), so the ring follows a captured decode step on the device; the host fills it only
// when it writes the step state (CudaOps.set_step_window). pos = state[STEP_POS]; N = prm's
// last_n. sample_params lists the window's ids, token at pos first, in sc->win[0 .. win_n);
// sample_penalize (a grid over contiguous chunks of the row) copies its chunk and writes the
// penalised listed ids that fall in it.
// ================================================================================================
#define SMP_STEP_ID 0
#define SMP_STEP_POS 2
// The longest penalty window (base.REPEAT_LAST_N_MAX; compile.py GEOMETRY, -D from the host).
#ifndef SMP_WINDOW_MAX
#define SMP_WINDOW_MAX 4096
#endif

// ================================================================================================
// The fast path: the same pick as sample_impl, in three launches.
//   sample_fast_max  (grid): per-block maximum and NaN flag of contiguous chunks; block 0 clears
//                    the bin histogram. The parameters come from sc->prm (sample_params).
//   sample_fast_hist (grid): every token's weight wq (smp_weight, as the reference) and bin:
//                    bin = floor((m - l) * SMP_BIN_SCALE / T) in float32 (clamped to the last
//                    bin), non-decreasing in rank order; per bin the count, the fixed-point mass
//                    (exact integer sums) and the largest weight. Warp-aggregated shared bins,
//                    then one global atomic per non-empty bin and block.
//   sample_fast_pick (one block): from the bins alone, the ranked prefix of bins that must hold
//                    every kept token (top-k: the bin of the k-th token; top-p: the bin where
//                    the mass reaches top_p of an upper bound of the top-k mass; min-p: the last
//                    bin whose largest weight passes the threshold) or, with none of the three,
//                    the one bin where the mass reaches the draw; gathers those tokens
//                    (at most SMP_CAP), sorts them by (key, id) (bitonic, shared memory),
//                    and runs the reference's selects on their exact prefix sums. Where the
//                    candidates cannot settle the pick (more than SMP_CAP of them, a top-k
//                    mass that reaches past them, a draw past the kept mass) the block runs
//                    sample_impl over the whole row instead: the same id either way.
// Scratch sc: SMP_FAST_BYTES (layout below). grid of the first two: at most SMP_MAX_BLOCKS.
// ================================================================================================
#ifndef SMP_FAST_THREADS
#define SMP_FAST_THREADS 256
#endif
#define SMP_MAX_BLOCKS 512
#define SMP_BINS 256
#define SMP_BIN_SCALE 8.0          // bins per unit of z (nats): SMP_BINS / 8 nats covered
#define SMP_CAP 2048               // candidates the finishing block sorts
#define SMP_GATHER_ILP 4           // row loads in flight per thread of the finishing block
static_assert(SMP_CAP <= 2 * SMP_THREADS, "sample_fast_pick's min-p mask: two per thread");

struct SmpFast {
    double prm[SMP_PRM];            // the parameters, copied by sample_params (one host read)
    float part_max[SMP_MAX_BLOCKS];
    int part_nan[SMP_MAX_BLOCKS];
    unsigned cnt[SMP_BINS];
    u64 mass[SMP_BINS];
    u64 maxw[SMP_BINS];
    int win_n, win_pad;             // the penalty window's ids (sample_params), 0: no penalty
    int win[SMP_WINDOW_MAX];
};
// sampling.py's _FAST_BYTES: the scratch block the host allocates
static_assert(sizeof(SmpFast) == 9288 + 4 * SMP_WINDOW_MAX,
              "SmpFast's size is sampling.py's _FAST_BYTES");

// The parameters and the window into sc. prm f64 [SMP_PRM] (mapped pinned: written by the host
// before the launch); ring / state as above, or ring = null: no penalty (win_n = 0). The reads
// come before the PDL wait: no kernel of this step writes prm, the ring (only this kernel,
// in an earlier step) or state's id and position (the step before wrote them; this step's
// sampler writes the next id after this kernel). The writes come after it (the previous
// sampler call's kernels may still read sc). grid = 1, block = SMP_THREADS.
__device__ __forceinline__ void sample_params_impl(const volatile double* prm, SmpFast* sc,
                                                   int* ring, const int* state) {
    __shared__ double p[SMP_PRM];
    __shared__ int hdr[2];
    if (threadIdx.x < SMP_PRM) p[threadIdx.x] = prm[threadIdx.x];
    if (threadIdx.x == 0) {
        hdr[0] = ring != nullptr ? state[SMP_STEP_POS] : -1;
        hdr[1] = ring != nullptr ? state[SMP_STEP_ID] : 0;
    }
    __syncthreads();
    const int N = ring != nullptr ? min((int)p[SMP_P_LAST_N], SMP_WINDOW_MAX) : 0;
    const int pos = hdr[0], tok = hdr[1];
    const int cnt = N > 0 && pos >= 0 ? min(N, pos + 1) : 0;
    constexpr int PER = (SMP_WINDOW_MAX + SMP_THREADS - 1) / SMP_THREADS;
    int ids[PER];
#pragma unroll
    for (int u = 0; u < PER; ++u) {
        const int j = (int)threadIdx.x + u * SMP_THREADS;
        ids[u] = j < cnt ? (j == 0 ? tok : ring[(pos - j) % N]) : 0;
    }
    TL_PDL_ENTER();
    if (threadIdx.x < SMP_PRM) sc->prm[threadIdx.x] = p[threadIdx.x];
#pragma unroll
    for (int u = 0; u < PER; ++u) {
        const int j = (int)threadIdx.x + u * SMP_THREADS;
        if (j < cnt) sc->win[j] = ids[u];
    }
    if (threadIdx.x == 0) {
        sc->win_n = cnt;
        if (cnt > 0) ring[pos % N] = tok;
    }
}

extern "C" __global__ void __launch_bounds__(SMP_THREADS)
    sample_params(const volatile double* prm, SmpFast* sc, int* ring, const int* state) {
    sample_params_impl(prm, sc, ring, state);
}

// The penalised copy of the row (see above): grid over contiguous chunks, block any size.
extern "C" __global__ void sample_penalize(const float* __restrict__ logits, i64 n64,
                                           const SmpFast* sc, float* __restrict__ out) {
    TL_PDL_ENTER();
    const int n = (int)n64;
    const int chunk = (n + (int)gridDim.x - 1) / (int)gridDim.x;
    const int lo = (int)blockIdx.x * chunk, hi = min(n, lo + chunk);
    for (int i = lo + (int)threadIdx.x; i < hi; i += blockDim.x) out[i] = logits[i];
    __syncthreads();                              // the copy, then the penalised ids over it
    const int cnt = sc->win_n;
    if (cnt <= 0) return;
    const float pen = (float)sc->prm[SMP_P_PENALTY];
    for (int j = threadIdx.x; j < cnt; j += blockDim.x) {
        const int id = sc->win[j];
        if (id >= lo && id < hi) {
            const float v = logits[id];
            out[id] = v > 0.0f ? __fdiv_rn(v, pen) : __fmul_rn(v, pen);
        }
    }
}

// The bin of logit l (m: the row's maximum; s = SMP_BIN_SCALE / T as float32): monotone in l.
__device__ __forceinline__ int smp_bin(float l, float m, float s) {
    const float g = __fsub_rn(m, l);
    if (!(g > 0.0f)) return 0;
    const float d = __fmul_rn(g, s);
    return d < (float)(SMP_BINS - 1) ? (int)d : SMP_BINS - 1;
}

__device__ __forceinline__ float smp_bin_scale(double temp) {
    return (float)(SMP_BIN_SCALE / temp);
}

// The row's maximum and fault code from the per-block partials (every thread gets both).
__device__ void smp_fast_max_of(const SmpFast* sc, int blocks, float& m, int& code) {
    __shared__ float red[32];
    float v = TL_NEG_INF;
    int nan_seen = 0;
    for (int b = threadIdx.x; b < blocks; b += blockDim.x) {
        v = fmaxf(v, sc->part_max[b]);
        nan_seen |= sc->part_nan[b];
    }
    m = block_max(v, red);
    code = __syncthreads_or(nan_seen) ? 1 : logit_fault_code(m);
}

extern "C" __global__ void __launch_bounds__(SMP_FAST_THREADS)
    sample_fast_max(const float* __restrict__ logits, i64 n64, SmpFast* sc) {
    TL_PDL_ENTER();
    __shared__ float red[32];
    const int n = (int)n64;
    const int chunk = (n + (int)gridDim.x - 1) / (int)gridDim.x;
    const int lo = (int)blockIdx.x * chunk, hi = min(n, lo + chunk);
    float m = TL_NEG_INF;
    int nan_seen = 0;
    for (int i = lo + (int)threadIdx.x; i < hi; i += blockDim.x) {
        const float v = logits[i];
        if (v != v) nan_seen = 1;
        else m = fmaxf(m, v);
    }
    m = block_max(m, red);
    nan_seen = __syncthreads_or(nan_seen);
    if (threadIdx.x == 0) {
        sc->part_max[blockIdx.x] = m;
        sc->part_nan[blockIdx.x] = nan_seen;
    }
    if (blockIdx.x == 0) {
        for (int b = threadIdx.x; b < SMP_BINS; b += blockDim.x) {
            sc->cnt[b] = 0;
            sc->mass[b] = 0;
            sc->maxw[b] = 0;
        }
    }
}

extern "C" __global__ void __launch_bounds__(SMP_FAST_THREADS)
    sample_fast_hist(const float* __restrict__ logits, i64 n64, SmpFast* sc, u64* wq) {
    TL_PDL_ENTER();
    __shared__ unsigned scnt[SMP_BINS];
    __shared__ u64 smass[SMP_BINS];
    __shared__ u64 smaxw[SMP_BINS];
    const SmpParams q = smp_params(sc->prm);
    if (!(q.temp > 0.0)) return;                        // the argmax: no weights
    float m;
    int code;
    smp_fast_max_of(sc, (int)gridDim.x, m, code);
    if (code) return;
    for (int b = threadIdx.x; b < SMP_BINS; b += blockDim.x) {
        scnt[b] = 0;
        smass[b] = 0;
        smaxw[b] = 0;
    }
    __syncthreads();
    const int n = (int)n64;
    const int chunk = (n + (int)gridDim.x - 1) / (int)gridDim.x;
    const int lo = (int)blockIdx.x * chunk, hi = min(n, lo + chunk);
    const double z0 = (double)m / q.temp;
    const float s = smp_bin_scale(q.temp);
    for (int i = lo + (int)threadIdx.x; i < hi; i += blockDim.x) {
        const float l = logits[i];
        const u64 w = smp_weight(l, q.temp, z0);
        wq[i] = w;
        const int b = smp_bin(l, m, s);
        // the lanes of one bin: one count add; the mass and the maximum only from lanes of
        // non-zero weight (the far tail, all in the last bins, has none)
        const unsigned act = __activemask();
        const unsigned peers = __match_any_sync(act, b);
        if ((threadIdx.x & 31) == (unsigned)(__ffs(peers) - 1))
            atomicAdd(&scnt[b], (unsigned)__popc(peers));
        if (w) {
            atomicAdd(&smass[b], w);
            atomicMax(&smaxw[b], w);
        }
    }
    __syncthreads();
    for (int b = threadIdx.x; b < SMP_BINS; b += blockDim.x) {
        if (scnt[b]) {
            atomicAdd(&sc->cnt[b], scnt[b]);
            if (smass[b]) {
                atomicAdd(&sc->mass[b], smass[b]);
                atomicMax(&sc->maxw[b], smaxw[b]);
            }
        }
    }
}

// Block-wide exclusive prefix sum of one u64 per thread; `total` gets the block's sum. ws
// holds >= 32 u64. Starts and ends with a barrier.
__device__ u64 smp_block_scan(u64 v, u64* ws, u64& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    u64 x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u64 y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    __syncthreads();
    if (lane == 31) ws[warp] = x;
    __syncthreads();
    if (warp == 0) {
        u64 t = lane < nw ? ws[lane] : 0ull;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const u64 y = __shfl_up_sync(0xffffffffu, t, o);
            if (lane >= o) t += y;
        }
        ws[lane] = t;
    }
    __syncthreads();
    total = ws[nw - 1];
    const u64 r = (warp ? ws[warp - 1] : 0ull) + x - v;
    __syncthreads();
    return r;
}

// In place: a[j] = a[0] + ... + a[j] for j < len (len <= blockDim.x * seg).
__device__ void smp_inclusive_scan(u64* a, int len, u64* ws) {
    const int seg = (len + (int)blockDim.x - 1) / (int)blockDim.x;
    const int s0 = (int)threadIdx.x * seg, s1 = min(len, s0 + seg);
    u64 loc = 0;
    for (int e = s0; e < s1; ++e) loc += a[e];
    u64 total;
    u64 acc = smp_block_scan(loc, ws, total);
    for (int e = s0; e < s1; ++e) {
        acc += a[e];
        a[e] = acc;
    }
    __syncthreads();
}

// The first j < len with a[j] >= t (a non-decreasing), or len.
__device__ __forceinline__ int smp_lower_bound(const u64* a, int len, u64 t) {
    int lo = 0, hi = len;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (a[mid] < t) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

struct SmpPick {
    int lo, hi;             // candidate bins [lo, hi]
    int count;              // candidates
    u64 base;               // mass of the bins before lo
    int mode;               // 0: fall back to sample_impl; 1: kept-set filters; 2: draw only
    u64 tau;                // mode 2: the draw's threshold
    u64 wmin;               // min-p threshold (0: off)
    int minp_covered;       // every token of weight >= wmin is a candidate
    int id;
};

extern "C" __global__ void __launch_bounds__(SMP_THREADS)
    sample_fast_pick(const float* __restrict__ logits, i64 n64, const SmpFast* sc, i64 blocks,
                     u64* wq, int* step) {
    TL_PDL_ENTER();
    __shared__ u64 ck[SMP_CAP];             // (rank key << 32) | id, sorted ascending
    __shared__ u64 cw[SMP_CAP];             // weights, then their prefix sums
    __shared__ u64 ws[32];
    __shared__ SmpPick pk;
    __shared__ int nc;
    const SmpParams q = smp_params(sc->prm);
    const int n = (int)n64;
    if (!(q.temp > 0.0)) {
        smp_argmax(logits, n, step, nullptr);
        return;
    }
    float m;
    int code;
    smp_fast_max_of(sc, (int)blocks, m, code);
    if (code) {
        if (threadIdx.x == 0) smp_write(0, code, step, nullptr);
        return;
    }
    const bool topk_on = q.top_k > 0 && q.top_k < n, topp_on = q.top_p < 1.0;
    const u64 wmin = smp_minp_thr(q.min_p);
    // 1. the candidate bins, from the histogram: its inclusive prefix counts and masses, then
    //    each boundary as the one bin b with cum[b - 1] < t <= cum[b] (b = 0: t <= cum[0])
    __shared__ u64 icnt[SMP_BINS], imass[SMP_BINS];
    __shared__ int bk, bp, bm, bt;
    __shared__ u64 total_mass;
    {
        const int b = threadIdx.x;
        const u64 c = b < SMP_BINS ? (u64)sc->cnt[b] : 0ull;
        const u64 w = b < SMP_BINS ? sc->mass[b] : 0ull;
        u64 tc, tw;
        const u64 ec = smp_block_scan(c, ws, tc);
        const u64 ew = smp_block_scan(w, ws, tw);
        if (b < SMP_BINS) { icnt[b] = ec + c; imass[b] = ew + w; }
        if (b == 0) {
            total_mass = tw;
            bk = bp = bt = SMP_BINS - 1;
            bm = 0;
            nc = 0;
        }
        __syncthreads();
        const u64 tau = (u64)floor(q.u * (double)tw) + 1ull;       // the draw, no filter
        if (b < SMP_BINS) {
            const u64 pc = b ? icnt[b - 1] : 0ull, pw = b ? imass[b - 1] : 0ull;
            const bool first = b == 0;
            if (topk_on && (first || pc < (u64)q.top_k) && icnt[b] >= (u64)q.top_k) bk = b;
            if ((first || pw < tau) && imass[b] >= tau) bt = b;
            if (tau > tw) bt = -1;                                  // past the mass: fall back
            if (wmin && sc->maxw[b] >= wmin) atomicMax(&bm, b);
        }
        __syncthreads();
        if (topp_on && !topk_on && b < SMP_BINS) {
            // top-p alone: the set's mass is the row's (exact)
            const double tp = ceil(q.top_p * (double)tw);
            const u64 t = tp <= 0.0 ? 0ull : (u64)tp;
            const u64 pw = b ? imass[b - 1] : 0ull;
            if ((b == 0 || pw < t) && imass[b] >= t) bp = b;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        pk.mode = 0;
        pk.wmin = wmin;
        pk.minp_covered = 0;
        pk.base = 0;
        pk.lo = 0;
        if (!topk_on && !topp_on && !wmin) {
            if (bt >= 0) {
                pk.lo = pk.hi = bt;
                pk.count = (int)(icnt[bt] - (bt ? icnt[bt - 1] : 0ull));
                pk.base = bt ? imass[bt - 1] : 0ull;
                pk.tau = (u64)floor(q.u * (double)total_mass) + 1ull;
                pk.mode = pk.count <= SMP_CAP ? 2 : 0;
            }
        } else {
            // top-k with top-p: the whole top-k set, whose exact mass top-p's threshold needs;
            // otherwise the narrowest bound (min-p only where its bin is the binding one)
            int hi = topk_on ? bk : (topp_on ? bp : SMP_BINS - 1);
            if (wmin && !(topk_on && topp_on) && bm < hi) hi = bm;
            pk.minp_covered = wmin && bm <= hi;
            pk.hi = hi;
            pk.count = (int)icnt[hi];
            pk.mode = pk.count <= SMP_CAP ? 1 : 0;
        }
    }
    __syncthreads();
    if (pk.mode != 0) {
        // 2. gather the candidates (warp-aggregated slots), padded to a power of two
        //    (SMP_GATHER_ILP loads in flight per thread: one block reads the whole row)
        const int lo = pk.lo, hi = pk.hi, lane = threadIdx.x & 31;
        const float s = smp_bin_scale(q.temp);
        const int stride = (int)blockDim.x * SMP_GATHER_ILP;
        for (int base = 0; base < n; base += stride) {
            float lv[SMP_GATHER_ILP];
#pragma unroll
            for (int r = 0; r < SMP_GATHER_ILP; ++r) {
                const int i = base + r * (int)blockDim.x + (int)threadIdx.x;
                lv[r] = i < n ? logits[i] : 0.0f;
            }
#pragma unroll
            for (int r = 0; r < SMP_GATHER_ILP; ++r) {
                const int i = base + r * (int)blockDim.x + (int)threadIdx.x;
                const float l = lv[r];
                bool f = false;
                if (i < n) {
                    const int b = smp_bin(l, m, s);
                    f = b >= lo && b <= hi;
                }
                const unsigned bal = __ballot_sync(0xffffffffu, f);
                int off = 0;
                if (lane == 0 && bal) off = atomicAdd(&nc, __popc(bal));
                off = __shfl_sync(0xffffffffu, off, 0);
                if (f) {
                    const int slot = off + __popc(bal & ((1u << lane) - 1u));
                    if (slot < SMP_CAP) {
                        ck[slot] = ((u64)rank_key(l) << 32) | (unsigned)i;
                        cw[slot] = wq[i];
                    }
                }
            }
        }
        __syncthreads();
        const int C = min(nc, SMP_CAP);
        int P = 1;
        while (P < C) P <<= 1;
        for (int j = C + (int)threadIdx.x; j < P; j += blockDim.x) {
            ck[j] = ~0ull;
            cw[j] = 0;
        }
        __syncthreads();
        // 3. bitonic sort by (key, id) ascending: rank order
        for (int k = 2; k <= P; k <<= 1) {
            for (int j = k >> 1; j > 0; j >>= 1) {
                for (int i = threadIdx.x; i < P; i += blockDim.x) {
                    const int x = i ^ j;
                    if (x > i) {
                        const bool up = (i & k) == 0;
                        const u64 a = ck[i], b = ck[x];
                        if ((a > b) == up) {
                            ck[i] = b; ck[x] = a;
                            const u64 t = cw[i]; cw[i] = cw[x]; cw[x] = t;
                        }
                    }
                }
                __syncthreads();
            }
        }
        // 4. the selects on exact prefix sums
        if (pk.mode == 2) {
            smp_inclusive_scan(cw, C, ws);
            if (threadIdx.x == 0) {
                const int j = smp_lower_bound(cw, C, pk.tau - pk.base);
                pk.id = j < C ? (int)(ck[j] & 0xffffffffull) : -1;
                if (j >= C || nc != pk.count) pk.mode = 0;
            }
        } else {
            __shared__ int lim, fine;
            smp_inclusive_scan(cw, C, ws);
            if (threadIdx.x == 0) {
                fine = nc == pk.count;
                const i64 kA = topk_on ? q.top_k : (i64)n;
                int la = C;
                u64 wa = 0;
                bool covered = pk.minp_covered != 0, wa_known = true;
                if (topk_on && kA <= C) {
                    la = (int)kA;
                    wa = cw[la - 1];
                    covered = true;
                } else if (topk_on) {
                    wa_known = false;
                } else {
                    wa = total_mass;
                }
                int l2 = la;
                if (topp_on) {
                    if (!wa_known) {
                        fine = 0;
                    } else {
                        const double tp = ceil(q.top_p * (double)wa);
                        const u64 t = tp <= 0.0 ? 0ull : (u64)tp;
                        const int j = smp_lower_bound(cw, la, t);
                        if (j < la) { l2 = j + 1; covered = true; }
                    }
                }
                if (!covered) fine = 0;
                lim = l2;
            }
            __syncthreads();
            // the kept weights (rank < lim, weight >= wmin) and their prefix sums, in place
            //    (two per thread: SMP_CAP <= 2 * SMP_THREADS)
            const int L = lim, j0 = threadIdx.x, j1 = threadIdx.x + blockDim.x;
            u64 w0 = 0, w1 = 0;
            if (j0 < C) {
                const u64 w = cw[j0] - (j0 ? cw[j0 - 1] : 0ull);
                w0 = (j0 < L && w >= pk.wmin) ? w : 0ull;
            }
            if (j1 < C) {
                const u64 w = cw[j1] - cw[j1 - 1];
                w1 = (j1 < L && w >= pk.wmin) ? w : 0ull;
            }
            __syncthreads();
            if (j0 < C) cw[j0] = w0;
            if (j1 < C) cw[j1] = w1;
            __syncthreads();
            smp_inclusive_scan(cw, C, ws);
            if (threadIdx.x == 0) {
                const u64 wb = C ? cw[C - 1] : 0ull;
                const u64 tau = (u64)floor(q.u * (double)wb) + 1ull;
                const int j = smp_lower_bound(cw, C, tau);
                if (!fine || tau > wb || j >= C) pk.mode = 0;
                else pk.id = (int)(ck[j] & 0xffffffffull);
            }
        }
        __syncthreads();
    }
    if (pk.mode == 0) {
        sample_impl(logits, n64, q.temp, q.top_k, q.top_p, q.min_p, q.u, wq, step, nullptr);
        return;
    }
    if (threadIdx.x == 0) smp_write(pk.id, 0, step, nullptr);
}
