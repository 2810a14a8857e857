// Causal GQA prefill attention (T > 1) over the paged KV cache on tensor cores: FlashAttention-2
// (Dao 2023) with mma.sync m16n8k16 (FP16 inputs, FP32 accumulation).
//
// Checked against: NumpyOps.kv_attention and the scalar kernel attn_prefill_* of attention.cu
// (tests/kernels/test_attn_prefill_gpu.py). Same contract as the scalar kernel: query head h reads KV
// head h / (n_heads / n_kv); query row i (absolute position p = pos0 + i) sees keys
// win_lo(p, window)..p (common.cuh: max(0, p - window + 1) on a sliding-window layer,
// window > 0; 0 for full attention, window = 0); scale 1/sqrt(head_dim); key j of the slot
// lives in page table[j / P], row j % P (vLLM's PagedAttention, Kwon et al. 2023; rows
// [P, n_kv, HD], parts at byte offsets k_off / v_off, int8 scales at ks_off / vs_off). Any
// P >= 1: the page is looked up per key while staging.
//
// Block = FA_WARPS warps, 16 query rows of one head each (16 FA_WARPS rows); grid = one
// block per (q tile, head), ceil(T / (16 FA_WARPS)) * n_heads in all. Block order (causal
// load balance): ranked by work, longest first (the last q tile of every head, then the one
// before...), and every odd "wave" of ``wave`` blocks (the host passes the SM count) taken in
// reverse, so when the block scheduler deals the blocks round-robin over the SMs and several
// stay resident per SM, each SM gets a long block with a short one rather than three long
// ones (SmolLM2 at 2,048 tokens: 288 blocks, 132 SMs, three resident per SM).
// Per tile of KT keys (64 for HD <= 64, else 32, so two buffers stay under 48 KiB):
//   1. the tile's K and V rows are read through the block table into registers (the next
//      tile's while this one computes) and stored to shared memory as FP16: fp16 pages as they
//      are, int8 pages dequantized on the way, K = float(q) * float(scale) rounded in float32
//      (NumPy's product) and then to FP16 for the MMA;
//   2. S = Q K^T (Q fragments held in registers for the whole loop), in FP32, times
//      scale*log2(e) so exp2f gives the exponentials (log2 units, as the scalar kernel);
//      the causal mask is applied only on tiles that reach past the warp's first row, the
//      window's only on tiles that reach before the window of its last row (below);
//   3. online softmax per row (Milakov & Gimelshein 2018) in registers: the running max m and
//      the rescale alpha = 2^(m_old - m_new) of O and l;
//   4. P = 2^(S - m) rounded to FP16 (as FlashAttention does) is fed from the S accumulator
//      registers straight into the A fragments of O += P V; V's B fragments come from shared
//      memory through ldmatrix.trans. l sums the *rounded* P, so the output is an exact convex
//      combination of V rows with weights p~_j / sum p~: the rounding perturbs each weight by a
//      relative 2^-11 at most (the bound the GPU tests use).
// Sliding window (index arithmetic, positions in int): the block's rows q0..last have
// positions p0+q0..p0+last and need keys klo = win_lo(p0 + q0)..p0+last (win_lo is
// nondecreasing in the position), so the tiles run from it0 = klo / KT (tiles wholly before
// every row's window are never loaded; staging zeroes keys below klo as it zeroes keys past
// the context). A warp (rows at positions wmin..wmax) runs tile k0..k0+KT-1 when
// k0 <= wmax (not wholly in the future) and k0 + KT - 1 >= win_lo(wmin) (not wholly before the
// window of every row). For a row at position p, tile column c (key k0 + c) counts when
// win_lo(p) - k0 <= c <= p - k0. A row may meet a tile holding none of its keys before it
// has seen any (another row of the warp needs it): its running max stays -inf and the
// exponentials are taken against 0 (ua / ub) instead, giving p = 0 and alpha = 0, not NaN.
// Each row's own key p lies in a tile its warp runs, so l > 0 at the end.
// GQA: the n_heads / n_kv query heads of a KV head run in separate blocks and each stages the
// shared K/V tile itself (the repeats hit L2: a layer's K/V at 2,048 tokens is 1.5 MiB for
// SmolLM2); one block per (q tile, KV head) would give SmolLM2's 2,048-token prefill
// 32 x 3 = 96 blocks for 132 SMs, against 288 blocks here.
#include "common.cuh"

// Launch geometry shared with the host: the host passes these as -D options from
// tinyloop/backends/cuda/compile.py GEOMETRY (the one definition); the values below are defaults
// for a standalone nvcc build, kept equal to the table by tests/kernels/test_kernel_geometry.py.
#ifndef FA_WARPS
#define FA_WARPS 4
#endif
#define FA_THREADS (32 * FA_WARPS)

// The 32-bit shared-state-space address of a generic pointer into shared memory.
__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// Four transposed 8 x 8 FP16 matrices: lanes 8i..8i+7 give the row addresses of matrix i;
// r[i] is the fragment of matrix i (lane 4 g + t4 gets its elements (2 t4, g), (2 t4 + 1, g)).
__device__ __forceinline__ void ldsm_x4_trans(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

// 8 consecutive values of one K or V row in flight: fp16: 8 halves in w; int8: 8 codes in
// w.x, w.y and the row's scale in s.
struct KvChunk {
    uint4 w;
    float s;
};

template <int MODE, int HD>
__device__ __forceinline__ void chunk_load(KvChunk& ch, const char* base, i64 off, i64 soff,
                                           i64 r, int c) {
    if (MODE == KV_FP16) {
        ch.w = *(const uint4*)((const half_t*)(base + off) + r * HD + c);
    } else {
        const uint2 w2 = *(const uint2*)((const i8*)(base + off) + r * HD + c);
        ch.w = make_uint4(w2.x, w2.y, 0u, 0u);
        ch.s = h2f(((const half_t*)(base + soff))[r]);
    }
}

template <int MODE>
__device__ __forceinline__ void chunk_store(const KvChunk& ch, half_t* dst) {   // 16 bytes
    if (MODE == KV_FP16) {
        *(uint4*)dst = ch.w;
    } else {
        const unsigned w[2] = {ch.w.x, ch.w.y};
        unsigned o[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const unsigned ww = w[j >> 1];
            const int sh = 16 * (j & 1);
            o[j] = pack_h2(__fmul_rn((float)(i8)((ww >> sh) & 0xFFu), ch.s),
                           __fmul_rn((float)(i8)((ww >> (sh + 8)) & 0xFFu), ch.s));
        }
        *(uint4*)dst = make_uint4(o[0], o[1], o[2], o[3]);
    }
}

template <int MODE, int HD>
__device__ void attn_fa_impl(const half_t* __restrict__ qkv, i64 ld, i64 T, i64 pos0,
                             const i64* __restrict__ table, i64 P, i64 k_off, i64 v_off,
                             i64 ks_off, i64 vs_off, i64 n_heads, i64 n_kv, float scale_log2,
                             i64 window, i64 wave, half_t* __restrict__ out) {
    static_assert(HD % 16 == 0 && HD >= 16 && HD <= 256, "head_dim: a multiple of 16");
    constexpr int KT = HD > 64 ? 32 : 64;      // keys per tile
    constexpr int LD = HD + 8;                 // shared row pitch in halves (16-byte rows;
                                               // fragment and ldmatrix reads conflict-free)
    constexpr int KS = HD / 16;                // k-steps of S = Q K^T
    constexpr int ST = KT / 8;                 // n-tiles of S (8 keys each)
    constexpr int NT = HD / 8;                 // n-tiles of O (8 dims each)
    constexpr int CH = HD / 8;                 // 8-value chunks per K or V row
    constexpr int NCH = (KT * CH + FA_THREADS - 1) / FA_THREADS;   // chunks per thread
    __shared__ __align__(16) half_t Ks[2][KT * LD];
    __shared__ __align__(16) half_t Vs[2][KT * LD];

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    // Positions and rows in int: the host launches only when pos0 + T < 2^30.
    const int nT = (int)T, p0 = (int)pos0, nh = (int)n_heads, wv = (int)wave;
    int b = blockIdx.x;                        // -> its rank by work (see the top)
    if (wv > 0 && (b / wv) % 2 == 1) {
        const int w0 = b / wv * wv, left = (int)gridDim.x - w0;
        const int wn = left < wv ? left : wv;  // the last wave may be partial
        b = w0 + wn - 1 - (b - w0);
    }
    const int nq = (nT + 16 * FA_WARPS - 1) / (16 * FA_WARPS);
    const int q0 = (nq - 1 - b / nh) * (16 * FA_WARPS);
    const int h = b % nh, hk = h / (nh / (int)n_kv);
    const int r0 = q0 + 16 * warp;             // this warp's first query row
    const int ra = r0 + g, rb = r0 + g + 8;    // this lane's two rows (C fragment rows g, g+8)
    // Rows past T run as row T-1's position with q = 0 (finite, never stored).
    const int pa = p0 + (ra < nT ? ra : nT - 1), pb = p0 + (rb < nT ? rb : nT - 1);
    const bool warp_live = r0 < nT;
    const int wmin = p0 + r0;                                      // first row's position
    const int wmax = p0 + (r0 + 15 < nT ? r0 + 15 : nT - 1);       // last row's position
    // first visible keys (win_lo <= the position < 2^30: an int)
    const int la0 = (int)win_lo(pa, window), lb0 = (int)win_lo(pb, window);
    const int wlo_min = (int)win_lo(wmin, window), wlo_max = (int)win_lo(wmax, window);

    unsigned qf[KS][4];
    {
        const half_t* qa = qkv + (i64)ra * ld + h * HD + 2 * t4;
        const half_t* qb = qkv + (i64)rb * ld + h * HD + 2 * t4;
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            qf[ks][0] = ra < nT ? *(const unsigned*)(qa + 16 * ks) : 0u;
            qf[ks][1] = rb < nT ? *(const unsigned*)(qb + 16 * ks) : 0u;
            qf[ks][2] = ra < nT ? *(const unsigned*)(qa + 16 * ks + 8) : 0u;
            qf[ks][3] = rb < nT ? *(const unsigned*)(qb + 16 * ks + 8) : 0u;
        }
    }
    float o[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float ma = TL_NEG_INF, mb = TL_NEG_INF, la = 0.0f, lb = 0.0f;   // l: this lane's part

    const int last = (q0 + 16 * FA_WARPS < nT ? q0 + 16 * FA_WARPS : nT) - 1;
    const int kv_end = p0 + last + 1;          // keys this block needs: klo..kv_end-1
    const int klo = (int)win_lo(p0 + q0, window);
    const int it0 = klo / KT, ntiles = (kv_end + KT - 1) / KT;

    KvChunk kc[NCH], vc[NCH];
    auto load_tile = [&](int k0) {
#pragma unroll
        for (int i = 0; i < NCH; ++i) {
            const int idx = tid + i * FA_THREADS;
            const int key = k0 + idx / CH;
            if (idx < KT * CH && key >= klo && key < kv_end) {
                const unsigned pg = (unsigned)key / (unsigned)P;
                const i64 r = (i64)((unsigned)key - pg * (unsigned)P) * n_kv + hk;
                const char* base = (const char*)table[pg];
                const int c = (idx % CH) * 8;
                chunk_load<MODE, HD>(kc[i], base, k_off, ks_off, r, c);
                chunk_load<MODE, HD>(vc[i], base, v_off, vs_off, r, c);
            } else {                           // outside klo..kv_end-1: zeros (p = 0 must not
                kc[i].w = vc[i].w = make_uint4(0u, 0u, 0u, 0u);   // meet a NaN in V)
                kc[i].s = vc[i].s = 0.0f;
            }
        }
    };
    auto store_tile = [&](int buf) {
#pragma unroll
        for (int i = 0; i < NCH; ++i) {
            const int idx = tid + i * FA_THREADS;
            if (idx < KT * CH) {
                const int off = (idx / CH) * LD + (idx % CH) * 8;
                chunk_store<MODE>(kc[i], &Ks[buf][off]);
                chunk_store<MODE>(vc[i], &Vs[buf][off]);
            }
        }
    };

    load_tile(it0 * KT);
    store_tile(it0 & 1);
    __syncthreads();
    for (int it = it0; it < ntiles; ++it) {
        const int buf = it & 1;
        const int k0 = it * KT;
        if (it + 1 < ntiles) load_tile(k0 + KT);   // in flight during this tile's MMAs
        // Warp-uniform: skip a tile in the future of every row of the warp, or wholly before
        // every row's window.
        if (warp_live && k0 <= wmax && k0 + KT - 1 >= wlo_min) {
            const half_t* K = Ks[buf];
            float s[ST][4];
#pragma unroll
            for (int j = 0; j < ST; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < KS; ++ks)
#pragma unroll
                for (int j = 0; j < ST; ++j) {
                    const half_t* kp = K + (8 * j + g) * LD + 16 * ks + 2 * t4;
                    const unsigned b[2] = {*(const unsigned*)kp, *(const unsigned*)(kp + 8)};
                    mma16816(s[j], qf[ks], b);
                }
            // the causal mask, only where some key of the tile is past some row of the warp:
            // key k0 + c is masked for a row at position p when c > p - k0 (clamped to int);
            // the window's, only where some key of the tile is before the window of some row
            // (k0 < win_lo(wmax)): masked when c < win_lo(p) - k0
            const bool diag = k0 + KT - 1 > wmin;
            const bool edge = k0 < wlo_max;
            const int da = pa - k0, db = pb - k0, ea = la0 - k0, eb = lb0 - k0;
            float xa = ma, xb = mb;
#pragma unroll
            for (int j = 0; j < ST; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int c = 8 * j + 2 * t4 + (e & 1);
                    float v = s[j][e] * scale_log2;
                    if (diag && c > (e < 2 ? da : db)) v = TL_NEG_INF;
                    if (edge && c < (e < 2 ? ea : eb)) v = TL_NEG_INF;
                    s[j][e] = v;
                    if (e < 2) xa = fmaxf(xa, v); else xb = fmaxf(xb, v);
                }
            // the row's max over its 4 lanes: -inf while the row has seen none of its keys
            // (see the top), then the exponentials are taken against 0 (ua, ub)
            xa = fmaxf(xa, __shfl_xor_sync(0xffffffffu, xa, 1));
            xa = fmaxf(xa, __shfl_xor_sync(0xffffffffu, xa, 2));
            xb = fmaxf(xb, __shfl_xor_sync(0xffffffffu, xb, 1));
            xb = fmaxf(xb, __shfl_xor_sync(0xffffffffu, xb, 2));
            const float ua = xa == TL_NEG_INF ? 0.0f : xa, ub = xb == TL_NEG_INF ? 0.0f : xb;
            const float alpha_a = exp2f(ma - ua), alpha_b = exp2f(mb - ub);   // m = -inf: 0
            ma = xa;
            mb = xb;
            // P rounded to FP16 in the A fragments of P V (k-step kk = keys 16 kk .. 16 kk + 15)
            unsigned pf[ST / 2][4];
            float sa = 0.0f, sb = 0.0f;
#pragma unroll
            for (int j = 0; j < ST; ++j) {
                const unsigned wa = pack_h2(exp2f(s[j][0] - ua), exp2f(s[j][1] - ua));
                const unsigned wb = pack_h2(exp2f(s[j][2] - ub), exp2f(s[j][3] - ub));
                sa += h2_lo(wa) + h2_hi(wa);
                sb += h2_lo(wb) + h2_hi(wb);
                pf[j >> 1][(j & 1) * 2] = wa;
                pf[j >> 1][(j & 1) * 2 + 1] = wb;
            }
            la = la * alpha_a + sa;
            lb = lb * alpha_b + sb;
#pragma unroll
            for (int n = 0; n < NT; ++n) {
                o[n][0] *= alpha_a;
                o[n][1] *= alpha_a;
                o[n][2] *= alpha_b;
                o[n][3] *= alpha_b;
            }
            // ldmatrix.trans of V [key][dim]: matrices (keys +0 / +8) x (dims +0 / +8)
            const unsigned vbase = smem_u32(Vs[buf] + ((lane & 7) + ((lane >> 3) & 1) * 8) * LD
                                            + (lane >> 4) * 8);
#pragma unroll
            for (int kk = 0; kk < ST / 2; ++kk)
#pragma unroll
                for (int n = 0; n < NT; n += 2) {
                    unsigned b[4];
                    ldsm_x4_trans(b, vbase + (unsigned)((16 * kk * LD + 8 * n) * 2));
                    mma16816(o[n], pf[kk], b);
                    mma16816(o[n + 1], pf[kk], b + 2);
                }
        }
        if (it + 1 < ntiles) store_tile(buf ^ 1);   // the other buffer: last read before the
        __syncthreads();                            // previous barrier
    }

    la += __shfl_xor_sync(0xffffffffu, la, 1);
    la += __shfl_xor_sync(0xffffffffu, la, 2);
    lb += __shfl_xor_sync(0xffffffffu, lb, 1);
    lb += __shfl_xor_sync(0xffffffffu, lb, 2);
    const i64 ldo = (i64)nh * HD;
    if (ra < nT) {
        const float inv = 1.0f / la;
        unsigned* op = (unsigned*)(out + (i64)ra * ldo + h * HD + 2 * t4);
#pragma unroll
        for (int n = 0; n < NT; ++n) op[4 * n] = pack_h2(o[n][0] * inv, o[n][1] * inv);
    }
    if (rb < nT) {
        const float inv = 1.0f / lb;
        unsigned* op = (unsigned*)(out + (i64)rb * ldo + h * HD + 2 * t4);
#pragma unroll
        for (int n = 0; n < NT; ++n) op[4 * n] = pack_h2(o[n][2] * inv, o[n][3] * inv);
    }
}

// Entry points attn_fa_{fp16,int8}_hd{HD}: the scalar prefill kernels' arguments (attention.cu,
// window included), then wave.
// qkv rows and out must allow 4-byte loads (ld even, both pointers 4-byte aligned: the host
// checks). Block = FA_THREADS, grid = ceil(T / (16 FA_WARPS)) * n_heads; wave: the SM count
// (<= 0: plain longest-first order).
// Three resident blocks per SM up to head dim 64 (<= 168 registers a thread), else two.
#define FA_MIN_BLOCKS(HD) ((HD) <= 64 ? 3 : 2)
#define FA_ENTRIES_MODE(MODE, NAME, HD)                                                        \
    extern "C" __global__ void __launch_bounds__(FA_THREADS, FA_MIN_BLOCKS(HD))               \
        attn_fa_##NAME##_hd##HD(const half_t* qkv, i64 ld, i64 T, i64 pos0, const i64* table,  \
                                i64 P, i64 k_off, i64 v_off, i64 ks_off, i64 vs_off,           \
                                i64 n_heads, i64 n_kv, double scale_log2, i64 window,          \
                                i64 wave, half_t* out) {                                       \
        attn_fa_impl<MODE, HD>(qkv, ld, T, pos0, table, P, k_off, v_off, ks_off, vs_off,       \
                               n_heads, n_kv, (float)scale_log2, window, wave, out);           \
    }
#define FA_ENTRIES(HD) FA_ENTRIES_MODE(KV_FP16, fp16, HD) FA_ENTRIES_MODE(KV_INT8, int8, HD)

// The head dims built (FA_HEAD_DIMS in compile.py GEOMETRY; -D from the host).
#ifndef FA_HEAD_DIM_ENTRIES
#define FA_HEAD_DIM_ENTRIES                                                                    \
    FA_ENTRIES(16) FA_ENTRIES(32) FA_ENTRIES(48) FA_ENTRIES(64) FA_ENTRIES(80) FA_ENTRIES(96)  \
    FA_ENTRIES(128)
#endif
FA_HEAD_DIM_ENTRIES
