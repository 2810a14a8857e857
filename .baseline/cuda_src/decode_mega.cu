// The persistent decode megakernel (issue 10, "No Bubbles"): one cooperative launch runs a
// whole greedy decode step at T = 1 - embedding, every layer slot of the looped stack (fp16 or
// int8 KV), the injections, the final RMSNorm + LM head + argmax - with grid-wide barriers
// (mk_grid_sync) between the phases instead of kernel boundaries.
//
// Checked against: the captured decode step it replaces (tinyloop/graphs.py, Model.decode_step_ops:
// the same tokens and the same logits, bit for bit by construction) and through it the NumPy
// reference (tests/gpu/test_megakernel.py).
//
// Same arithmetic as the kernels it replaces, by calling their device code (pasted in by
// cuda_ops.load_source, entries compiled out with TL_DEVICE_ONLY):
//   embedding       dequant.cu load_dq (embed_q*'s per-element dequantization)
//   RMSNorm         gemv.cu norm_row_v256 (bit-identical to rmsnorm.cu for a 128-thread block)
//   GEMV rows       gemv.cu chunk_dot_sz with the row split over `lpr` lanes of a warp and the
//                   partial sums reduced by an xor butterfly: lpr = 32 is gemv.cu v1's
//                   one-warp-per-row order, lpr = 4..16 v2's; the host passes each weight's lpr
//                   from the GEMV the graph path would launch (CudaOps._WInfo)
//   RoPE + K/V      rope.cu rope_table / rope_rot / kv_int8_row_warp (kv_write_impl's math)
//   attention       attention_decode.cu attn_split_unit / attn_combine_head (split-K, the same
//                   split count as the graph path: the host passes it)
//   argmax          common.cuh argmax_before / block_argmax / logit_fault_code
//
// The step (one launch; every phase a grid-stride loop over its work units, then a barrier):
//   0  embed step[STEP_ID] into x (f32 [d]); every block also fills its RoPE cos/sin table for
//      the position step[STEP_POS] (the same for every slot of the step).
//   per program op (the host's list, one per layer slot / injection):
//   LAYER  A  every block RMSNorms x into shared memory; QKV rows over all warps -> qkv f16;
//             the warp that writes the last row of a head unit (one Q, K or V head; a
//             per-unit ticket after a fence) applies RoPE to it in place (Q) or writes it into
//             the slot's page through its block table (K rotated, V; fp16, or int8 codes +
//             scales) - rope.cu's arithmetic, without a barrier of its own.
//          B  attention units (query head, split) over all blocks -> partials (m, l, o); the
//             last split of a head to finish (atomic ticket after a fence) merges them into att.
//          C  every block stages att in shared memory; O rows: x[row] += dot.
//          D  every block RMSNorms x; gate/up rows with SwiGLU -> act f16 [ffn].
//          E  every block stages act; down rows: x[row] += dot.
//          (5 grid barriers per layer slot.) Before each barrier every warp prefetches into L2
//          the weight rows it will read in the next GEMV phase (prefetch.global.L2), so the
//          DRAM latency overlaps the barrier.
//   SAVE_E e = x (the prelude output the injections read).
//   INJECT every block builds [f16(x), f16(e)] in shared memory; barrier; adapter rows: x = dot.
//   HEAD   every block RMSNorms x with the output norm; LM head rows -> logits (f32, written as
//          the graph path does) with a per-block argmax partial; the last block to finish
//          reduces the partials, writes the id and fault code to step[] and the mapped host
//          int[2], and advances step[STEP_POS].
// Barriers: every block runs every phase's loop and reaches every barrier (no early return;
// the host launches at most the co-resident grid, cooperatively). Data written in the kernel is
// read through L2 (__ldcg) or plainly after a grid barrier, never through the read-only path.
//
// Descriptors (i64 words, tinyloop/megakernel.py builds them; offsets MK_* below):
//   weight record (MK_W_WORDS): qweight, scales, zeros pointers, N, K, bits, log2 g, lpr
//   model  [MK_MODEL_WORDS]: embed weight, head weight, output norm ptr, adapter weight
//   layers [n_layers, MK_LAYER_WORDS]: attn norm ptr, ffn norm ptr, qkv, o, gate_up, down
//   prog   [n_ops, MK_OP_WORDS]: kind, layer index, block table ptr, page size, KV mode,
//          K / V / K-scale / V-scale byte offsets, attention splits
#include "common.cuh"
#define TL_DEVICE_ONLY
#include "dequant.cu"
#include "gemv.cu"
#include "rope.cu"
#include "attention_decode.cu"

// Launch geometry shared with the host (tinyloop/backends/cuda_ops.py GEOMETRY; -D from the
// host, defaults here for a standalone nvcc build, kept equal by tests/test_kernel_geometry.py).
#ifndef MK_THREADS
#define MK_THREADS 128
#endif
static_assert(MK_THREADS == DS_THREADS, "an attention unit is one block of DS_THREADS threads");
static_assert(256 % MK_THREADS == 0, "norm_row_v256 needs a block size dividing 256");
#define MK_WARPS (MK_THREADS / 32)

#define MK_W_WORDS 8
#define MK_MODEL_WORDS 32
#define MK_LAYER_WORDS 40
#define MK_OP_WORDS 16
enum { MK_OP_LAYER = 1, MK_OP_SAVE_E = 2, MK_OP_INJECT = 3 };
// tickets u32: [0, H) each head's attention splits, [H] the LM head's argmax blocks,
// [H + 1, H + 1 + H + 2 Hkv) each head unit's QKV rows (megakernel.py allocates this many)
#define MK_TICKETS(H, HKV) (2 * (H) + 1 + 2 * (HKV))
enum { MK_STEP_ID = 0, MK_STEP_FAULT = 1, MK_STEP_POS = 2 };   // backends.base STEP_*

// Grid-wide barrier over a co-resident grid (the host launches with cuLaunchCooperativeKernel,
// which refuses a grid that cannot be co-resident). The algorithm of cooperative_groups'
// grid sync (sync_grids in CUDA's cg/details/sync.h), written out so the module needs no CUDA
// header and no relocatable-device-code link: thread 0 of each block publishes the block's
// writes (fence) and adds 1 to bar[0], block 0 adds 0x80000000 - (gridDim.x - 1) instead, so
// the word's top bit flips exactly when the last block arrives; every block spins (acquire
// loads) until the top bit differs from the value its own add returned. One atomic per block
// and nothing to re-arm: each round adds 2^31 in total, so launches chain without a reset
// (bar[0] starts zeroed once). Measured on the H200 (132-396 blocks): ~1.0 us per barrier,
// against ~1.65 us for the count + generation pair with a re-arming exchange.
__device__ __forceinline__ unsigned mk_ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void mk_grid_sync(unsigned* bar) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned nb = blockIdx.x == 0 ? 0x80000000u - (gridDim.x - 1) : 1u;
        __threadfence();
        const unsigned old = atomicAdd(bar, nb);
        while (((old ^ mk_ld_acquire(bar)) & 0x80000000u) == 0u) {
        }
        __threadfence();
    }
    __syncthreads();
}

// Phase timer (diagnostics: benchmarks/profile_mega.py): with tm non-null, block 0 stamps the
// GPU's global timer (ns) after the kernel starts and after every grid barrier, so tm[k+1] -
// tm[k] is phase k's time including its barrier. Null in normal steps: one uniform branch.
__device__ __forceinline__ void mk_stamp(unsigned long long* tm, int& k) {
    if (tm != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        tm[k] = t;
    }
    ++k;
}
#define MK_SYNC()                                                                              \
    do {                                                                                       \
        mk_grid_sync(bar);                                                                     \
        mk_stamp(tm, tk);                                                                      \
    } while (0)

struct MkW {
    const u8* qw;
    const half_t* sc;
    const half_t* zr;
    int n, k, bits, log2g, lpr;
};

__device__ __forceinline__ MkW mk_weight(const i64* r) {
    MkW w;
    w.qw = (const u8*)r[0];
    w.sc = (const half_t*)r[1];
    w.zr = (const half_t*)r[2];
    w.n = (int)r[3];
    w.k = (int)r[4];
    w.bits = (int)r[5];
    w.log2g = (int)r[6];
    w.lpr = (int)r[7];
    return w;
}

// Rows [0, N) of y = xs @ W.T (xs f16 [K] in shared memory), `lpr` lanes per row, over every
// warp of the grid (warp-uniform loop). Per row: lane `sub` sums its chunks sub, sub + lpr, ...
// in ascending order (chunk_dot_sz), then the xor butterfly over the lpr lanes - gemv.cu's
// order for that lpr. EPI_SWIGLU: rows r and r + F, out f16 [F]. ARGMAX: tracks the best
// (logit, row) of the rows this lane saw (argmax_before).
// The RoPE + K/V write of the slot being computed (A's epilogue): qkv f16 [qkv_dim], the
// position's cos/sin table, the slot's program op, and one counter per head unit.
struct MkRope {
    half_t* qkv;
    const float* cs;
    const i64* op;
    i64 pos;
    unsigned* cnt;        // [n_heads + 2 n_kv]: rows of each head unit written so far
    int n_heads, n_kv, hd;
};

// Head unit u of the QKV row, by one warp (rope.cu kv_write_impl's values): u < H: Q head u
// rotated in place; then the Hkv K heads (rotated) and the Hkv V heads, written at position
// pos of the slot's page through its block table (fp16 rows, or int8 codes + FP16 scale).
__device__ __forceinline__ void mk_rope_unit(const MkRope& r, int u, int lane) {
    const int half = r.hd / 2;
    const i64* op = r.op;
    const i64* table = (const i64*)op[2];
    const int mode = (int)op[4];
    i64 prow;
    char* base = kv_page_w(table, op[3], r.pos, &prow);
    half_t* src = r.qkv + (i64)u * r.hd;                  // head u of Q | K | V
    const bool is_q = u < r.n_heads, is_k = !is_q && u < r.n_heads + r.n_kv;
    const int hk = is_q ? 0 : (is_k ? u - r.n_heads : u - r.n_heads - r.n_kv);
    if (mode == KV_INT8 && !is_q) {
        i8* dst = (i8*)(base + (is_k ? op[5] : op[6])) + (prow * r.n_kv + hk) * r.hd;
        half_t* scale = (half_t*)(base + (is_k ? op[7] : op[8])) + prow * r.n_kv + hk;
        kv_int8_row_warp(src, is_k, r.cs, r.hd, dst, scale, lane);
        return;
    }
    half_t* dst = is_q ? src : (half_t*)(base + (is_k ? op[5] : op[6])) +
                                   (prow * r.n_kv + hk) * r.hd;
    for (int i = lane; i < half; i += 32) {
        const half_t a = __ldcg(src + 2 * i), b = __ldcg(src + 2 * i + 1);
        if (is_q || is_k) {
            float y0, y1;
            rope_rot(h2f(a), h2f(b), r.cs[i], r.cs[half + i], &y0, &y1);
            dst[2 * i] = is_q ? f2h(y0) : f2h_sat(y0);        // K: a page row (saturates)
            dst[2 * i + 1] = is_q ? f2h(y1) : f2h_sat(y1);
        } else {
            dst[2 * i] = a;
            dst[2 * i + 1] = b;
        }
    }
}

template <int BITS, int EPI, bool ARGMAX, bool ROPE>
__device__ __forceinline__ void mk_rows(const MkW& w, const half_t* xs, int N, int F, void* out,
                                        float& best_v, int& best_i, const MkRope* rp) {
    constexpr bool TWO = EPI == EPI_SWIGLU;
    const int lane = threadIdx.x & 31, lpr = w.lpr, sub = lane & (lpr - 1), rpw = 32 / lpr;
    const int gw = blockIdx.x * MK_WARPS + (threadIdx.x >> 5);
    const int tw = gridDim.x * MK_WARPS;
    const int cpr = (BITS == 4 ? w.k / 2 : w.k) >> 4;
    const int ngroups = w.k >> w.log2g;
    for (int r0 = gw * rpw; r0 < N; r0 += tw * rpw) {
        const int row = r0 + lane / lpr;
        const bool valid = row < N;
        float acc0 = 0.0f, acc1 = 0.0f;
        for (int cb = sub; cb < cpr; cb += GEMV2_U * lpr) {
            uint4 wa[GEMV2_U], wb[GEMV2_U];
            float sa[GEMV2_U], za[GEMV2_U], sb[GEMV2_U], zb[GEMV2_U];
            gemv2_load<BITS, TWO>(wa, sa, za, wb, sb, zb, w.qw, w.sc, w.zr, row, F, valid, cb,
                                  cpr, ngroups, w.log2g, lpr);   // the batch's loads in flight
            gemv2_accumulate<BITS, TWO>(wa, sa, za, wb, sb, zb, xs, cb, cpr, valid, lpr, acc0,
                                        acc1);
        }
        gemv2_finish_row<EPI, ARGMAX>(acc0, acc1, lpr, sub, row, valid, out, best_v, best_i);
        if (ROPE) {
            // the warp that writes the last row of a head unit rotates / stores that unit
            // (CUDA's threadFenceReduction pattern: row, fence, ticket; the last reads all)
            bool done = false;
            int unit = 0;
            if (valid && sub == 0) {
                unit = row / rp->hd;
                __threadfence();
                done = atomicAdd(rp->cnt + unit, 1u) == (unsigned)(rp->hd - 1);
            }
            unsigned m = __ballot_sync(0xffffffffu, done);
            while (m) {                                   // warp-uniform
                const int u = __shfl_sync(0xffffffffu, unit, __ffs(m) - 1);
                m &= m - 1;
                __threadfence();
                mk_rope_unit(*rp, u, lane);
                if (lane == 0) rp->cnt[u] = 0u;           // re-armed for the next slot
            }
        }
    }
}

// L2 prefetch of the weight rows (and their scales / zeros) this warp takes in a later
// mk_rows over the same rows: issued before a grid barrier, so the next phase's loads hit L2.
__device__ __forceinline__ void mk_prefetch(const MkW& w, int N, int F) {
    const int lane = threadIdx.x & 31, lpr = w.lpr, sub = lane & (lpr - 1), rpw = 32 / lpr;
    const int gw = blockIdx.x * MK_WARPS + (threadIdx.x >> 5);
    const int tw = gridDim.x * MK_WARPS;
    const int row_bytes = w.bits == 4 ? w.k / 2 : w.k;
    const int lines = (row_bytes + 127) >> 7;
    const int gbytes = (w.k >> w.log2g) * 2;
    for (int r0 = gw * rpw; r0 < N; r0 += tw * rpw) {
        const int row = r0 + lane / lpr;
        if (row >= N) continue;
        for (int t = 0; t < (F ? 2 : 1); ++t) {
            const i64 r = row + (t ? F : 0);
            const char* p = (const char*)w.qw + r * row_bytes;
            for (int l = sub; l < lines; l += lpr)
                asm volatile("prefetch.global.L2 [%0];" ::"l"(p + 128 * l));
            if (sub == 0) {
                asm volatile("prefetch.global.L2 [%0];" ::"l"((const char*)w.sc + r * gbytes));
                asm volatile("prefetch.global.L2 [%0];" ::"l"((const char*)w.zr + r * gbytes));
            }
        }
    }
}

template <int EPI, bool ARGMAX = false, bool ROPE = false>
__device__ __forceinline__ void mk_gemv(const MkW& w, const half_t* xs, int N, int F, void* out,
                                        float& best_v, int& best_i,
                                        const MkRope* rp = nullptr) {
    if (w.bits == 4)
        mk_rows<4, EPI, ARGMAX, ROPE>(w, xs, N, F, out, best_v, best_i, rp);
    else
        mk_rows<8, EPI, ARGMAX, ROPE>(w, xs, N, F, out, best_v, best_i, rp);
}

template <int EPI>
__device__ __forceinline__ void mk_gemv(const MkW& w, const half_t* xs, int N, int F,
                                        void* out) {
    float v = 0.0f;
    int i = 0;
    mk_gemv<EPI, false, false>(w, xs, N, F, out, v, i);
}

// xs f16 [n] (shared) = src f16 [n] (global, written earlier in the kernel); n % 8 == 0.
__device__ __forceinline__ void mk_stage(const half_t* src, int n, half_t* xs) {
    const uint4* s = (const uint4*)src;
    uint4* d = (uint4*)xs;
    for (int i = threadIdx.x; i < n / 8; i += MK_THREADS) d[i] = __ldcg(s + i);
    __syncthreads();
}

// The first weights of program op oi (a layer's QKV rows, the adapter; past the last op the
// LM head), prefetched into L2 (mk_prefetch).
__device__ __forceinline__ void mk_prefetch_op(const i64* prog, int oi, int n_ops,
                                               const i64* layers, const i64* model, int d) {
    for (; oi < n_ops; ++oi) {
        const i64* op = prog + (i64)oi * MK_OP_WORDS;
        if (op[0] == MK_OP_LAYER) {
            const MkW w = mk_weight(layers + op[1] * MK_LAYER_WORDS + 8);
            mk_prefetch(w, w.n, 0);
            return;
        }
        if (op[0] == MK_OP_INJECT) {
            mk_prefetch(mk_weight(model + 24), d, 0);
            return;
        }
    }
    const MkW hw = mk_weight(model + 8);
    mk_prefetch(hw, hw.n, 0);
}

// B for one slot: (head, split) units over the blocks; the last split of a head merges.
template <int HD>
__device__ __forceinline__ void mk_attention(const half_t* qkv, const i64* op, i64 ctx,
                                             int n_heads, int n_kv, float scale_log2,
                                             float* part, unsigned* tickets, half_t* att) {
    __shared__ bool last;
    const i64 nsplit = op[9];
    const i64* table = (const i64*)op[2];
    const int mode = (int)op[4];
    // the split kernel's page partition (attn_split_step: a split holds at least a chunk of
    // DS_THREADS keys), so both paths sum the same keys in the same order, bit for bit
    const i64 min_pps = (DS_THREADS + op[3] - 1) / op[3];
    for (int u = blockIdx.x; u < n_heads * nsplit; u += gridDim.x) {
        const int h = u % n_heads, s = u / n_heads;
        if (mode == KV_INT8)
            attn_split_unit<KV_INT8, HD>(qkv, ctx, table, op[3], op[5], op[6], op[7], op[8],
                                         n_heads, n_kv, scale_log2, part, h, s, nsplit, min_pps);
        else
            attn_split_unit<KV_FP16, HD>(qkv, ctx, table, op[3], op[5], op[6], op[7], op[8],
                                         n_heads, n_kv, scale_log2, part, h, s, nsplit, min_pps);
        __threadfence();                                  // this block's partial, then the ticket
        __syncthreads();
        if (threadIdx.x == 0) last = atomicAdd(tickets + h, 1u) == (unsigned)(nsplit - 1);
        __syncthreads();
        if (last) {
            __threadfence();
            attn_combine_head<HD>(part, nsplit, nsplit, att, h);
            if (threadIdx.x == 0) tickets[h] = 0u;        // re-armed for the next slot
        }
        __syncthreads();
    }
}

template <int HD>
__device__ __forceinline__ void mk_step(const i64* prog, int n_ops, const i64* layers,
                                        const i64* model, int d, int n_heads, int n_kv,
                                        double eps, double theta, float scale_log2, int* step,
                                        int* host, float* x, float* e, half_t* qkv, half_t* att,
                                        half_t* act, float* logits, float* part, float* amax_v,
                                        int* amax_i, unsigned* tickets, unsigned* bar,
                                        unsigned long long* tm) {
    extern __shared__ __align__(16) unsigned char mk_smem[];
    __shared__ float cs[HD];
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ bool last;
    half_t* xs = (half_t*)mk_smem;
    const i64 pos = step[MK_STEP_POS];
    const i64 id = step[MK_STEP_ID];
    const int q_dim = n_heads * HD;
    int tk = 0;
    mk_stamp(tm, tk);

    // 0: embedding, RoPE table, tickets (attention heads, argmax, head units)
    {
        const MkW ew = mk_weight(model);
        const int vocab = ew.n;
        for (int c = blockIdx.x * MK_THREADS + threadIdx.x; c < d; c += gridDim.x * MK_THREADS)
            x[c] = (id < 0 || id >= vocab) ? TL_NAN
                                           : (ew.bits == 4 ? load_dq<4>(ew.qw, ew.sc, ew.zr, id,
                                                                        c, d, ew.log2g)
                                                           : load_dq<8>(ew.qw, ew.sc, ew.zr, id,
                                                                        c, d, ew.log2g));
        rope_table(pos, theta, HD, cs);
        if (blockIdx.x == 0)
            for (int i = threadIdx.x; i < MK_TICKETS(n_heads, n_kv); i += MK_THREADS)
                tickets[i] = 0u;
        mk_prefetch_op(prog, 0, n_ops, layers, model, d);
    }
    MK_SYNC();

    MkRope rope;
    rope.qkv = qkv;
    rope.cs = cs;
    rope.pos = pos;
    rope.cnt = tickets + n_heads + 1;
    rope.n_heads = n_heads;
    rope.n_kv = n_kv;
    rope.hd = HD;
    for (int oi = 0; oi < n_ops; ++oi) {
        const i64* op = prog + (i64)oi * MK_OP_WORDS;
        const int kind = (int)op[0];
        if (kind == MK_OP_SAVE_E) {
            for (int c = blockIdx.x * MK_THREADS + threadIdx.x; c < d;
                 c += gridDim.x * MK_THREADS)
                e[c] = __ldcg(x + c);
            mk_prefetch_op(prog, oi + 1, n_ops, layers, model, d);
            MK_SYNC();
            continue;
        }
        if (kind == MK_OP_INJECT) {
            const MkW aw = mk_weight(model + 24);
            for (int i = threadIdx.x; i < d; i += MK_THREADS) {   // elementwise.cu concat_impl
                xs[i] = f2h(__ldcg(x + i));
                xs[d + i] = f2h(__ldcg(e + i));
            }
            __syncthreads();
            MK_SYNC();                                          // every block has read x
            mk_gemv<EPI_F32>(aw, xs, d, 0, x);
            mk_prefetch_op(prog, oi + 1, n_ops, layers, model, d);
            MK_SYNC();
            continue;
        }
        const i64* L = layers + op[1] * MK_LAYER_WORDS;
        const MkW wqkv = mk_weight(L + 8), wo = mk_weight(L + 16), wgu = mk_weight(L + 24),
                  wd = mk_weight(L + 32);
        // A: RMSNorm + QKV; the last warp to write a head's rows rotates it / stores its K, V
        rope.op = op;
        norm_row_v256(x, (const float*)L[0], eps, d, xs);
        {
            float v = 0.0f;
            int i = 0;
            mk_gemv<EPI_F16, false, true>(wqkv, xs, wqkv.n, 0, qkv, v, i, &rope);
        }
        mk_prefetch(wo, wo.n, 0);
        MK_SYNC();
        // B: split-K attention, merged by each head's last split
        mk_attention<HD>(qkv, op, pos + 1, n_heads, n_kv, scale_log2, part, tickets, att);
        mk_prefetch(wgu, wgu.n / 2, wgu.n / 2);
        MK_SYNC();
        // C: O projection + residual
        mk_stage(att, q_dim, xs);
        mk_gemv<EPI_RESID>(wo, xs, wo.n, 0, x);
        mk_prefetch(wd, wd.n, 0);
        MK_SYNC();
        // D: RMSNorm + gate/up + SwiGLU
        __syncthreads();                                  // xs reads of C done
        norm_row_v256(x, (const float*)L[1], eps, d, xs);
        mk_gemv<EPI_SWIGLU>(wgu, xs, wgu.n / 2, wgu.n / 2, act);
        mk_prefetch_op(prog, oi + 1, n_ops, layers, model, d);
        MK_SYNC();
        // E: down projection + residual
        mk_stage(act, wd.k, xs);
        mk_gemv<EPI_RESID>(wd, xs, wd.n, 0, x);
        MK_SYNC();
        __syncthreads();
    }

    // HEAD: final RMSNorm + LM head + argmax (gemv.cu gemv2_body's ARGMAX tail)
    const MkW hw = mk_weight(model + 8);
    norm_row_v256(x, (const float*)model[16], eps, d, xs);
    float best_v = TL_NEG_INF;
    int best_i = 0x7fffffff;
    mk_gemv<EPI_F32, true>(hw, xs, hw.n, 0, logits, best_v, best_i);
    block_argmax(best_v, best_i, sv, si);
    if (threadIdx.x == 0) {
        amax_v[blockIdx.x] = best_v;
        amax_i[blockIdx.x] = best_i;
        __threadfence();
        last = atomicAdd(tickets + n_heads, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (last) {                                           // block-uniform: no barrier follows
        __threadfence();
        best_v = TL_NEG_INF;
        best_i = 0x7fffffff;
        for (int b = threadIdx.x; b < (int)gridDim.x; b += MK_THREADS) {
            const float v = __ldcg(amax_v + b);
            const int i = __ldcg(amax_i + b);
            if (argmax_before(v, i, best_v, best_i)) { best_v = v; best_i = i; }
        }
        block_argmax(best_v, best_i, sv, si);
        if (threadIdx.x == 0) {
            const int code = logit_fault_code(best_v);
            step[MK_STEP_ID] = best_i;
            step[MK_STEP_FAULT] = code;
            step[MK_STEP_POS] = (int)(pos + 1);           // every block read pos at its start
            if (host) { host[0] = best_i; host[1] = code; }
            tickets[n_heads] = 0u;
        }
    }
}

// One entry per head dim (MEGA_HEAD_DIMS in cuda_ops.py). x f32 [d], e f32 [d] (or unused),
// qkv f16 [qkv_dim], att f16 [q_dim], act f16 [ffn], logits f32 [vocab]; part f32
// [n_heads * max splits * (HD + 2)]; amax_v / amax_i [gridDim.x]; tickets u32
// [MK_TICKETS(n_heads, n_kv)]; bar u32 [2] (mk_grid_sync uses bar[0]; zero before the first
// launch); tm: u64 [barriers + 2] phase stamps (mk_stamp) or null.
// step int32 [STEP_WORDS]; host: mapped pinned int32 [2] or null. Dynamic shared memory:
// 2 * max(2 d, q_dim, ffn) bytes.
#define MK_ENTRIES(HD)                                                                           \
    extern "C" __global__ void __launch_bounds__(MK_THREADS) decode_mega_hd##HD(              \
        const i64* prog, i64 n_ops, const i64* layers, const i64* model, i64 d, i64 n_heads,  \
        i64 n_kv, double eps, double theta, double scale_log2, int* step, int* host, float* x, \
        float* e, half_t* qkv, half_t* att, half_t* act, float* logits, float* part,          \
        float* amax_v, int* amax_i, unsigned* tickets, unsigned* bar,                         \
        unsigned long long* tm) {                                                             \
        mk_step<HD>(prog, (int)n_ops, layers, model, (int)d, (int)n_heads, (int)n_kv, eps,    \
                    theta, (float)scale_log2, step, host, x, e, qkv, att, act, logits, part,  \
                    amax_v, amax_i, tickets, bar, tm);                                        \
    }

// The head dims built (MEGA_HEAD_DIMS in cuda_ops.py GEOMETRY; -D from the host).
#ifndef MK_HEAD_DIM_ENTRIES
#define MK_HEAD_DIM_ENTRIES MK_ENTRIES(32) MK_ENTRIES(64) MK_ENTRIES(128)
#endif
MK_HEAD_DIM_ENTRIES
