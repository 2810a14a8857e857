// Quantized GEMV on tensor cores: gemv_mma{CT}_* for a decode batch (out[t] = epilogue(x[t] @
// W.T) for the T <= 8 * CT input rows of x, W group-quantized INT4 / INT8, g = 32 / 64 / 128),
// and gemv_tc_* for one row (T = 1, INT4; its own section below).
//
// Checked against: NumpyOps.linear / linear_residual / linear_swiglu (the product from the
// dequantized weights) and gemv_rows{R}_* (tests/kernels/test_gemv_mma_gpu.py).
//
// gemv_rows (gemv.cu) turns each weight code into a float and runs one FMA per code and input
// row, so its instruction count grows with the rows: a batch of 16 or 32 is issue-bound. Here
// the codes enter mma.sync m16n8k16 as FP16 integers (exact: |code| <= 128) against the input
// rows as its 8 columns, so one dequantization serves every row of the batch:
// - a block owns 16 output rows (two tiles of 16 for SwiGLU: gate rows and the same up rows);
//   its warps split K by 32-column chunks (chunk c to warp c mod warps), so a 16-row tile's
//   chunks load in parallel, and add their partial sums in shared memory in warp order;
// - per chunk (one group's codes: g >= 32) two MMAs give sum_k q_k x_k for the tile's rows and
//   two more, with all-ones codes, sum_k x_k; the chunk adds s * dot + z * sum(x) as gemv.cu's
//   chunk_dot does (the product is sum (q s + z) x), in FP32;
// - K is permuted inside a chunk, the same way for the codes and x (a dot product does not
//   depend on the order of its terms): lane (g, t4) takes the chunk's 32-bit code word t4 of
//   rows g and g + 8 (INT4: columns 8 t4 .. 8 t4 + 7, one nibble each; INT8: the word pair t4,
//   one byte each), which a LOP3 (INT4) or PRMT (INT8) places into FP16 mantissas, and the
//   same 8 columns of x.
// The MMA's sums round differently from gemv_rows' FMA chain (FP32 either way), so a batch row
// is within FP32 rounding of the same row alone, not equal to it bit for bit.
// Fragments (PTX ISA "Matrix Fragments for mma.m16n8k16", common.cuh mma16816): lane = 4 g + t4.
// Needs K % 32 == 0 and 16-byte aligned weight and x rows (the host checks).
#include "common.cuh"
#define TL_DEVICE_ONLY
#include "gemv.cu"
#undef TL_DEVICE_ONLY

// Launch geometry shared with the host (compile.py GEOMETRY, the one definition); the default
// below is for a standalone nvcc build, kept equal to the table by test_kernel_geometry.py.
#ifndef MMA_MAX_WARPS
#define MMA_MAX_WARPS 16
#endif

#define MMA_ONES 0x3C003C00u        // FP16 (1, 1)

__device__ __forceinline__ unsigned hsub2(unsigned a, unsigned b) {
    unsigned d;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// The A fragments of one chunk's two MMAs from lane t4's code word(s) of one row: INT4 word w
// (nibble j = column 8 t4 + j) gives FP16 pairs (j, j + 4) = ((w >> 4 j) & 0x000F000F) | 1024
// minus 1024; INT8 words (w0, w1) (byte j = column 8 t4 + j) give pairs (j, j + 1) as
// (byte ^ 0x80) | 1024 minus 1152. a[m][0] is the first pair of MMA m, a[m][1] its second.
template <int BITS>
__device__ __forceinline__ void mma_codes(uint2 w, unsigned (&a)[2][2]) {
    if (BITS == 4) {
        const unsigned M = 0x000F000Fu, B = 0x64006400u;
#pragma unroll
        for (int i = 0; i < 4; ++i) a[i >> 1][i & 1] = hsub2(((w.x >> (4 * i)) & M) | B, B);
    } else {
        const unsigned B = 0x64806480u;                        // (1152, 1152)
        const unsigned v0 = w.x ^ 0x80808080u, v1 = w.y ^ 0x80808080u;
        a[0][0] = hsub2(__byte_perm(v0, 0x64646464u, 0x4140), B);   // bytes 0, 1
        a[0][1] = hsub2(__byte_perm(v0, 0x64646464u, 0x4342), B);   // bytes 2, 3
        a[1][0] = hsub2(__byte_perm(v1, 0x64646464u, 0x4140), B);   // bytes 4, 5
        a[1][1] = hsub2(__byte_perm(v1, 0x64646464u, 0x4342), B);   // bytes 6, 7
    }
}

// The B fragments (x's 8 columns 8 t4 .. 8 t4 + 7 of one input row, X) in mma_codes' pairs.
template <int BITS>
__device__ __forceinline__ void mma_x(uint4 X, unsigned (&b)[2][2]) {
    if (BITS == 4) {
        b[0][0] = __byte_perm(X.x, X.z, 0x5410);   // (x0, x4)
        b[0][1] = __byte_perm(X.x, X.z, 0x7632);   // (x1, x5)
        b[1][0] = __byte_perm(X.y, X.w, 0x5410);   // (x2, x6)
        b[1][1] = __byte_perm(X.y, X.w, 0x7632);   // (x3, x7)
    } else {
        b[0][0] = X.x; b[0][1] = X.y;             // (x0, x1), (x2, x3)
        b[1][0] = X.z; b[1][1] = X.w;             // (x4, x5), (x6, x7)
    }
}

// Lane t4's code words of chunk c of row r (INT4: one word, in .x; INT8: two).
template <int BITS>
__device__ __forceinline__ uint2 mma_load_codes(const u8* __restrict__ qw, i64 row_bytes, i64 r,
                                                int c, int t4) {
    const u8* p = qw + r * row_bytes + (BITS == 4 ? 16 : 32) * c;
    if (BITS == 4) return make_uint2(__ldg((const unsigned*)p + t4), 0u);
    return __ldg((const uint2*)p + t4);
}

// x f16 [T, ldx]; out rows ldo elements apart (f16 or f32 by EPI; SwiGLU: F columns, W rows
// [2F, K] gate then up). grid = ceil(N / 16) (N = F for SwiGLU), block = 32 * warps (any
// warps count up to MMA_MAX_WARPS); dynamic shared memory = warps * (TWO ? 2 : 1) * CT * 128
// floats. T <= 8 * CT.
template <int BITS, int EPI, int CT>
__device__ __forceinline__ void gemv_mma_impl(const u8* __restrict__ qw,
                                              const half_t* __restrict__ sc,
                                              const half_t* __restrict__ zr,
                                              const half_t* __restrict__ x, i64 ldx, i64 T,
                                              i64 N, i64 K, i64 F, i64 log2g,
                                              void* __restrict__ out, i64 ldo) {
    constexpr int NT = EPI == EPI_SWIGLU ? 2 : 1;     // weight tiles: gate and up
    extern __shared__ float mma_red[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const i64 r0 = (i64)blockIdx.x * 16;
    const i64 row_bytes = BITS == 4 ? K / 2 : K;
    const int chunks = (int)(K >> 5), ngroups = (int)(K >> log2g);
    // the lane's fragment rows (tile rows g and g + 8), clamped for loads past N; not stored
    i64 rows[NT][2];
#pragma unroll
    for (int w = 0; w < NT; ++w)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const i64 r = r0 + g + 8 * h;
            rows[w][h] = (r < N ? r : N - 1) + w * F;
        }
    // the weight rows' first chunk of this warp, into L1 before the wait (constant data: the
    // DRAM round trip overlaps the kernel before)
    if (warp < chunks)
#pragma unroll
        for (int w = 0; w < NT; ++w)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                prefetch_l1(qw + rows[w][h] * row_bytes + (BITS == 4 ? 16 : 32) * warp);
    TL_PDL_ENTER();                               // x and out: written / read by the kernel before
    float acc[NT][CT][4];
#pragma unroll
    for (int w = 0; w < NT; ++w)
#pragma unroll
        for (int ct = 0; ct < CT; ++ct)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[w][ct][i] = 0.0f;
    const unsigned ones[4] = {MMA_ONES, MMA_ONES, MMA_ONES, MMA_ONES};
    for (int c = warp; c < chunks; c += nw) {
        const int grp = (c << 5) >> log2g;
        uint2 wv[NT][2];
        float s[NT][2], z[NT][2];
#pragma unroll
        for (int w = 0; w < NT; ++w)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                wv[w][h] = mma_load_codes<BITS>(qw, row_bytes, rows[w][h], c, t4);
                s[w][h] = h2f(__ldg(sc + rows[w][h] * ngroups + grp));
                z[w][h] = h2f(__ldg(zr + rows[w][h] * ngroups + grp));
            }
        uint4 X[CT];
#pragma unroll
        for (int ct = 0; ct < CT; ++ct) {
            const i64 t = 8 * ct + g;
            X[ct] = t < T ? *(const uint4*)(x + t * ldx + 32 * c + 8 * t4)
                          : make_uint4(0u, 0u, 0u, 0u);
        }
        unsigned a[NT][2][2][2];                  // [tile][row half][mma][pair]
#pragma unroll
        for (int w = 0; w < NT; ++w)
#pragma unroll
            for (int h = 0; h < 2; ++h) mma_codes<BITS>(wv[w][h], a[w][h]);
#pragma unroll
        for (int ct = 0; ct < CT; ++ct) {
            unsigned b[2][2];
            mma_x<BITS>(X[ct], b);
            float sx[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
            for (int m = 0; m < 2; ++m) mma16816(sx, ones, b[m]);
#pragma unroll
            for (int w = 0; w < NT; ++w) {
                float dot[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int m = 0; m < 2; ++m) {
                    // a[0] = A[g][2t4..], a[1] = A[g+8][2t4..], a[2] = A[g][2t4+8..],
                    // a[3] = A[g+8][2t4+8..]: this lane's pairs of rows g and g + 8
                    const unsigned af[4] = {a[w][0][m][0], a[w][1][m][0], a[w][0][m][1],
                                            a[w][1][m][1]};
                    mma16816(dot, af, b[m]);
                }
                // c[0], c[1]: row g, columns 2 t4, 2 t4 + 1; c[2], c[3]: row g + 8
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    acc[w][ct][i] += fmaf(s[w][i >> 1], dot[i], z[w][i >> 1] * sx[i]);
            }
        }
    }
    // the warps' partial sums, added in warp order by one thread per (tile, column tile,
    // fragment value, lane)
    constexpr int PER_WARP = NT * CT * 128;
#pragma unroll
    for (int w = 0; w < NT; ++w)
#pragma unroll
        for (int ct = 0; ct < CT; ++ct)
#pragma unroll
            for (int i = 0; i < 4; ++i)
                mma_red[warp * PER_WARP + ((w * CT + ct) * 4 + i) * 32 + lane] = acc[w][ct][i];
    __syncthreads();
    for (int e = threadIdx.x; e < CT * 128; e += blockDim.x) {
        const int ct = e / 128, i = (e >> 5) & 3, ln = e & 31;
        const i64 row = r0 + (ln >> 2) + 8 * (i >> 1);
        const i64 t = 8 * ct + 2 * (ln & 3) + (i & 1);
        if (row >= N || t >= T) continue;
        float v[NT];
#pragma unroll
        for (int w = 0; w < NT; ++w) {
            float sum = 0.0f;
            for (int k = 0; k < nw; ++k)
                sum += mma_red[k * PER_WARP + ((w * CT + ct) * 4 + i) * 32 + ln];
            v[w] = sum;
        }
        const float v1 = NT == 2 ? v[NT - 1] : 0.0f;
        if (EPI == EPI_F16 || EPI == EPI_SWIGLU)
            gemv_store<EPI>((half_t*)out + t * ldo, row, v[0], v1);
        else
            gemv_store<EPI>((float*)out + t * ldo, row, v[0], v1);
    }
}

#define GEMV_MMA_ENTRY(NAME, CT, BITS, EPI)                                                   \
    extern "C" __global__ void __launch_bounds__(32 * MMA_MAX_WARPS)                         \
        NAME(const u8* qw, const half_t* sc, const half_t* zr, const half_t* x, i64 ldx,     \
             i64 T, i64 N, i64 K, i64 F, i64 log2g, void* out, i64 ldo) {                     \
        gemv_mma_impl<BITS, EPI, CT>(qw, sc, zr, x, ldx, T, N, K, F, log2g, out, ldo);        \
    }

// gemv_mma{CT}_q{bits}_{epilogue}: CT column tiles of 8 input rows (T <= 8, 16, 32)
#define GEMV_MMA_ALL(CT)                                                                      \
    GEMV_MMA_ENTRY(gemv_mma##CT##_q4_f16, CT, 4, EPI_F16)                                     \
    GEMV_MMA_ENTRY(gemv_mma##CT##_q4_resid, CT, 4, EPI_RESID)                                 \
    GEMV_MMA_ENTRY(gemv_mma##CT##_q4_swiglu, CT, 4, EPI_SWIGLU)                               \
    GEMV_MMA_ENTRY(gemv_mma##CT##_q4_f32, CT, 4, EPI_F32)                                     \
    GEMV_MMA_ENTRY(gemv_mma##CT##_q8_f16, CT, 8, EPI_F16)                                     \
    GEMV_MMA_ENTRY(gemv_mma##CT##_q8_resid, CT, 8, EPI_RESID)                                 \
    GEMV_MMA_ENTRY(gemv_mma##CT##_q8_swiglu, CT, 8, EPI_SWIGLU)                               \
    GEMV_MMA_ENTRY(gemv_mma##CT##_q8_f32, CT, 8, EPI_F32)

GEMV_MMA_ALL(1)
GEMV_MMA_ALL(2)
GEMV_MMA_ALL(4)

// ================================================================================================
// Tensor-core GEMV for decode (T = 1, INT4 g = 32 / 64 / 128): gemv_tc_q4_{f16,resid,swiglu,f32}
// (x f16 [K]) and gemv_tc_norm_q4_{f16,swiglu,f32} (x the f32 residual row, RMSNorm-fused).
//
// Checked against: NumpyOps.linear / linear_residual / linear_swiglu / lm_head at T = 1 and the
// v1 GEMV (tests/kernels/test_gemv_tc_gpu.py); gemv_tc_norm_* against rmsnorm + gemv_tc_*, bit
// for bit.
//
// v1 turns each code into a float and runs an FMA per code (about six instructions a weight,
// latency-bound at few warps per SM). Here one mma.sync m16n8k16 takes 16 rows x 16 columns of
// codes as FP16 integers (exact: a code is at most 15) against x, so the products and their
// sums run on the tensor cores in FP32 and a lane spends about one instruction a weight on
// turning nibbles into FP16 pairs (LOP3 into a mantissa, then one exact HSUB2 / HFMA2):
// - a warp owns a 16-row tile (two tiles, gate and up rows, for SwiGLU) and takes one step of
//   8 consecutive 32-column chunks (c0 .. c0 + 7): lane (g, t4) loads chunk c0 + t4 and chunk
//   c0 + 4 + t4 of rows g and g + 8 as four 16-byte loads (a row's 8 chunks are 128
//   contiguous bytes across the 4 lanes of a row);
// - the MMA's 8 columns keep the chunks apart, so each chunk's own scale and zero apply after:
//   x enters B only at column n for the k of chunk n (lane (g, t4) holds B's column g, and
//   chunk n's k are lane n & 3's; the other columns' B entries are zero), so 16 MMAs (one per
//   code pair of the chunk) leave D[row][n] = sum_k q_k x_k over chunk c0 + n, and the lane
//   adds s * D + z * sum(x) for its columns 2 t4, 2 t4 + 1 (the product is sum (q s + z) x);
// - block b owns ceil(tiles / blocks) consecutive tiles, whose (tile, gate / up, step) items
//   it deals to its warps round-robin; a warp issues the loads of TC_ITEMS items (a round)
//   before it uses any, the first round's before the PDL wait, so a launch's weight bytes
//   are in flight together rather than step by step; each item's 16 row sums go to shared
//   memory, and each output adds its steps in ascending order, so a row's value does not
//   depend on the grid.
// x is staged once per block in shared memory: each 16-byte unit of 8 values (x_0 .. x_7) is
// stored as the FP16 pairs (x_j, x_j+4), the order the code pairs come out in, with each
// chunk's FP32 sum beside; chunks past K are zeros. The MMA sums round differently from v1's
// FMA chain (FP32 either way), so a row is within FP32 rounding of v1's, not equal to it.
// Fragments: common.cuh mma16816. Needs K % 32 == 0, 16-byte aligned rows, N < 2^30 (host).
// ================================================================================================
#define TC_CHUNKS 8         // 32-column chunks per warp step (the MMA's 8 columns)
// items (tile, step) a warp loads in one round; resident 256-thread blocks per SM the
// registers are held to (compile.py GEOMETRY)
#ifndef TC_ITEMS
#define TC_ITEMS 3
#endif
#define TC_STAGE_UNITS 8    // 8-value units of x a thread stages: K <= 16384 at 256 threads
#ifndef TC_MINB
#define TC_MINB 2
#endif

__device__ __forceinline__ unsigned hfma2u(unsigned a, unsigned b, unsigned c) {
    unsigned d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// Code word w (nibble j = column 8 i + j of its chunk) as the FP16 pairs p[j] = (q_j, q_j+4):
// nibbles j and j + 4 are bits 4 j and 4 j + 16, so a mask and an OR with 1024 (0x6400) put
// them into two mantissas; an odd j sits 4 bits up (1024 + 16 q), undone by x / 16 - 64.
__device__ __forceinline__ void tc_word(unsigned w, unsigned (&p)[4]) {
    const unsigned M0 = 0x000F000Fu, M1 = 0x00F000F0u, B = 0x64006400u;
    const unsigned SIXTEENTH = 0x2C002C00u, MINUS64 = 0xD400D400u;
    const unsigned h = w >> 8;
    p[0] = hsub2((w & M0) | B, B);
    p[1] = hfma2u((w & M1) | B, SIXTEENTH, MINUS64);
    p[2] = hsub2((h & M0) | B, B);
    p[3] = hfma2u((h & M1) | B, SIXTEENTH, MINUS64);
}

// x staged for the block (the layout above): xp holds cpad chunks of 16 pairs (64 bytes), sx
// their sums. NORM: xin is the f32 residual row, normalized first by norm_row_to_shared
// (rmsnorm.cu's values bit for bit at 256 threads, written into xp in natural order, then
// permuted in place; w_held: the weight's first values, loaded before the PDL wait); else xin
// is the f16 row, read through L2 (the kernel before wrote it) with a thread's units in flight
// together. Needs cpad * 4 <= TC_STAGE_UNITS * blockDim.x. Ends with a barrier.
template <bool NORM>
__device__ __forceinline__ void tc_stage(const void* __restrict__ xin,
                                         const float* __restrict__ nw, double eps, int K,
                                         int cpad, uint4* xp, float* sx, const NormW* w_held) {
    if (NORM) norm_row_to_shared((const float*)xin, nw, eps, K, (half_t*)xp, w_held);
    const int units = cpad * 4, kunits = K / 8;
    uint4 Xg[TC_STAGE_UNITS];                           // x's units from global, all in flight
    if (!NORM)
#pragma unroll
        for (int a = 0; a < TC_STAGE_UNITS; ++a) {
            const int u = threadIdx.x + a * blockDim.x;
            Xg[a] = u < kunits ? __ldcg((const uint4*)xin + u) : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
    for (int a = 0; a < TC_STAGE_UNITS; ++a) {
        const int u = threadIdx.x + a * blockDim.x;     // a warp's 32 units: 8 whole chunks
        if (u - (threadIdx.x & 31) >= units) break;     // warp-uniform
        uint4 X = make_uint4(0u, 0u, 0u, 0u);
        if (u < kunits) X = NORM ? xp[u] : Xg[a];
        float s = ((h2_lo(X.x) + h2_hi(X.x)) + (h2_lo(X.y) + h2_hi(X.y))) +
                  ((h2_lo(X.z) + h2_hi(X.z)) + (h2_lo(X.w) + h2_hi(X.w)));
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        if ((u & 3) == 0) sx[u >> 2] = s;
        if (u < units)
            xp[u] = make_uint4(__byte_perm(X.x, X.z, 0x5410), __byte_perm(X.x, X.z, 0x7632),
                               __byte_perm(X.y, X.w, 0x5410), __byte_perm(X.y, X.w, 0x7632));
    }
    __syncthreads();
}

// The loads of one item (a 16-row tile t of the block, one step of 8 chunks from c0): wv[h][u]
// = chunk c0 + t4 + 4 u of row g + 8 h; sz[h] = the scales (.x) and zeros (.y) of chunks
// c0 + 2 t4 and c0 + 2 t4 + 1 of that row as FP16 pairs (0 past the row's chunks).
struct TcItem {
    uint4 wv[2][2];
    uint2 sz[2];
};

// The FP16 pair (group value of chunk c, of chunk c + 1) from a scale or zero array p whose
// row starts at group g0: at g = 32 (log2g 5) one group a chunk, one 4-byte load when the
// rows' group count is even (the pair is then aligned); at g >= 64 both chunks of an even c
// share a group. 0 past the row's chunks.
__device__ __forceinline__ unsigned tc_pair(const unsigned short* __restrict__ p, i64 g0, int c,
                                            int chunks, int log2g, bool even) {
    if (c >= chunks) return 0u;
    if (log2g > 5) {
        const unsigned v = __ldg(p + g0 + ((c << 5) >> log2g));
        return v | (v << 16);
    }
    if (even && c + 1 < chunks) return __ldg((const unsigned*)(p + g0 + c));
    return (unsigned)__ldg(p + g0 + c) |
           (c + 1 < chunks ? (unsigned)__ldg(p + g0 + c + 1) << 16 : 0u);
}

__device__ __forceinline__ void tc_load_item(TcItem& L, const u8* __restrict__ qw,
                                             const unsigned short* __restrict__ sc,
                                             const unsigned short* __restrict__ zr,
                                             const i64 (&rows)[2], i64 row_bytes, int c0,
                                             int chunks, int ngroups, int log2g, int t4) {
    const bool even = (ngroups & 1) == 0;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const uint4* w = (const uint4*)(qw + rows[h] * row_bytes);
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const int c = c0 + t4 + 4 * u;
            L.wv[h][u] = c < chunks ? __ldg(w + c) : make_uint4(0u, 0u, 0u, 0u);
        }
        const i64 g0 = rows[h] * ngroups;
        const int c = c0 + 2 * t4;
        L.sz[h] = make_uint2(tc_pair(sc, g0, c, chunks, log2g, even),
                             tc_pair(zr, g0, c, chunks, log2g, even));
    }
}

// One item's 16 row sums over its step: D[row][n] = chunk c0 + n's dot product (16 MMAs, see
// above), then s * D + z * sum(x) for the lane's columns 2 t4, 2 t4 + 1, then the row's 4
// lanes; v[h] (row g + 8 h) is valid in lane t4 == 0.
__device__ __forceinline__ void tc_item_sums(const TcItem& L, const uint4* xp, const float* sx,
                                             int c0, int g, int t4, bool diag,
                                             unsigned lo_mask, float (&v)[2]) {
    uint4 xv[4] = {make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u),
                   make_uint4(0u, 0u, 0u, 0u), make_uint4(0u, 0u, 0u, 0u)};
    if (diag)
#pragma unroll
        for (int i = 0; i < 4; ++i) xv[i] = xp[(c0 + g) * 4 + i];
    const float2 sxv = *(const float2*)(sx + c0 + 2 * t4);
    float dd[4][4];                                  // one accumulator chain per code word
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        dd[i][0] = dd[i][1] = dd[i][2] = dd[i][3] = 0.0f;
        unsigned p00[4], p10[4], p01[4], p11[4];    // p{h}{u}
        tc_word((&L.wv[0][0].x)[i], p00);
        tc_word((&L.wv[1][0].x)[i], p10);
        tc_word((&L.wv[0][1].x)[i], p01);
        tc_word((&L.wv[1][1].x)[i], p11);
        const unsigned xw[4] = {xv[i].x, xv[i].y, xv[i].z, xv[i].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const unsigned a[4] = {p00[j], p10[j], p01[j], p11[j]};
            const unsigned b[2] = {xw[j] & lo_mask, xw[j] & ~lo_mask};
            mma16816(dd[i], a, b);
        }
    }
    float d[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) d[e] = (dd[0][e] + dd[1][e]) + (dd[2][e] + dd[3][e]);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const unsigned s = L.sz[h].x, z = L.sz[h].y;
        float t = fmaf(h2_lo(s), d[2 * h], h2_lo(z) * sxv.x) +
                  fmaf(h2_hi(s), d[2 * h + 1], h2_hi(z) * sxv.y);
        t += __shfl_xor_sync(0xffffffffu, t, 1);
        t += __shfl_xor_sync(0xffffffffu, t, 2);
        v[h] = t;
    }
}

// out: as gemv_impl's (EPI_F16 / EPI_F32: [N]; EPI_RESID: f32 [N] +=; EPI_SWIGLU: f16 [F],
// W rows [2F, K] gate then up, N = F). grid: any; block b owns TB = ceil(tiles / gridDim.x)
// consecutive 16-row tiles from b TB; block = 256 threads (8 warps); dynamic shared memory =
// gemv.py tc_geometry: x's pairs (64 bytes a chunk) and sums (4 bytes a chunk) for K rounded
// up to 8 chunks, and one 16-float partial per (tile, gate / up, step) of the block.
template <int EPI, bool NORM>
__device__ __forceinline__ void gemv_tc_body(const void* __restrict__ xin,
                                             const float* __restrict__ nw, double eps,
                                             const u8* __restrict__ qw,
                                             const half_t* __restrict__ sc_h,
                                             const half_t* __restrict__ zr_h, int N, int K,
                                             int F, int log2g, void* __restrict__ out) {
    constexpr int NT = EPI == EPI_SWIGLU ? 2 : 1;
    const unsigned short* sc = (const unsigned short*)sc_h;
    const unsigned short* zr = (const unsigned short*)zr_h;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int g = lane >> 2, t4 = lane & 3;
    const int chunks = K >> 5, ngroups = K >> log2g;
    const int steps = (chunks + TC_CHUNKS - 1) / TC_CHUNKS, cpad = steps * TC_CHUNKS;
    const i64 row_bytes = K / 2;
    const int tiles = (N + 15) >> 4, tb = (tiles + gridDim.x - 1) / gridDim.x;
    const int tile0 = blockIdx.x * tb;
    if (tile0 >= tiles) return;                          // block-uniform: no tiles
    const int ntile = tiles - tile0 < tb ? tiles - tile0 : tb;
    const int per_tile = NT * steps, items = ntile * per_tile;
    uint4* xp = (uint4*)gemv_smem;
    float* sx = (float*)(xp + cpad * 4);
    float* red = sx + cpad;                              // [ntile][NT][steps][16]
    // B: lane (g, t4) holds column g, whose chunk g's k belong to lane t4 == g & 3
    const bool diag = (g & 3) == t4;
    const unsigned lo_mask = g < 4 ? 0xFFFFFFFFu : 0u;

    // item i of the block: tile tile0 + i / per_tile, gate / up (i / steps) % NT, step
    // i % steps; warp w takes items w, w + nwarps, ..., TC_ITEMS of them a round, all of a
    // round's loads in flight before any is used (the first round's before the PDL wait)
    TcItem L[TC_ITEMS];
    auto load_round = [&](int k0) {
#pragma unroll
        for (int k = 0; k < TC_ITEMS; ++k) {
            const int i = warp + (k0 + k) * nwarps;
            if (i < items) {                             // warp-uniform
                const int tl = i / per_tile, t = (i / steps) % NT, s = i % steps;
                i64 rows[2];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int r = (tile0 + tl) * 16 + g + 8 * h;
                    rows[h] = (i64)(r < N ? r : N - 1) + (i64)t * F;   // clamped: loads only
                }
                tc_load_item(L[k], qw, sc, zr, rows, row_bytes, s * TC_CHUNKS, chunks,
                             ngroups, log2g, t4);
            }
        }
    };
    load_round(0);
    NormW w_held;
    if (NORM) norm_weight_load(nw, K, w_held);
    TL_PDL_ENTER();                               // x and out: written / read by the kernel before
    tc_stage<NORM>(xin, nw, eps, K, cpad, xp, sx, &w_held);
    const int kmax = (items - warp + nwarps - 1) / nwarps;   // this warp's items
    for (int k0 = 0; k0 < kmax; k0 += TC_ITEMS) {
        if (k0 > 0) load_round(k0);
#pragma unroll
        for (int k = 0; k < TC_ITEMS; ++k) {
            const int i = warp + (k0 + k) * nwarps;
            if (i < items) {
                float v[2];
                tc_item_sums(L[k], xp, sx, (i % steps) * TC_CHUNKS, g, t4, diag, lo_mask, v);
                if (t4 == 0) {
                    red[i * 16 + g] = v[0];
                    red[i * 16 + g + 8] = v[1];
                }
            }
        }
    }
    __syncthreads();
    // the row sums: each output's steps in ascending order (gate, then up)
    for (int j = threadIdx.x; j < ntile * 16; j += blockDim.x) {
        const int tl = j >> 4, r = (tile0 + tl) * 16 + (j & 15);
        float v[NT];
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            const float* p = red + ((tl * NT + t) * steps) * 16 + (j & 15);
            float sum = 0.0f;
            for (int s = 0; s < steps; ++s) sum += p[s * 16];
            v[t] = sum;
        }
        if (r < N) gemv_store<EPI>(out, r, v[0], v[NT - 1]);
    }
}

// The register budget of every entry: TC_MINB blocks of 256 threads per SM (launch bounds), so a
// round of TC_ITEMS items' loads (about 20 registers an item) stays in registers.
#define GEMV_TC_ENTRY(NAME, EPI)                                                              \
    extern "C" __global__ void __launch_bounds__(256, TC_MINB)                                \
        NAME(const u8* qw, const half_t* sc, const half_t* zr, const half_t* x, i64 N, i64 K, \
             i64 F, i64 log2g, void* out) {                                                   \
        gemv_tc_body<EPI, false>(x, nullptr, 0.0, qw, sc, zr, (int)N, (int)K, (int)F,         \
                                    (int)log2g, out);                                         \
    }

#define GEMV_TC_NORM_ENTRY(NAME, EPI)                                                         \
    extern "C" __global__ void __launch_bounds__(256, TC_MINB)                                \
        NAME(const float* x, const float* weight, double eps, const u8* qw, const half_t* sc, \
             const half_t* zr, i64 N, i64 K, i64 F, i64 log2g, void* out) {                   \
        gemv_tc_body<EPI, true>(x, weight, eps, qw, sc, zr, (int)N, (int)K, (int)F,           \
                                   (int)log2g, out);                                          \
    }

GEMV_TC_ENTRY(gemv_tc_q4_f16, EPI_F16)
GEMV_TC_ENTRY(gemv_tc_q4_resid, EPI_RESID)
GEMV_TC_ENTRY(gemv_tc_q4_swiglu, EPI_SWIGLU)
GEMV_TC_ENTRY(gemv_tc_q4_f32, EPI_F32)
GEMV_TC_NORM_ENTRY(gemv_tc_norm_q4_f16, EPI_F16)
GEMV_TC_NORM_ENTRY(gemv_tc_norm_q4_swiglu, EPI_SWIGLU)
GEMV_TC_NORM_ENTRY(gemv_tc_norm_q4_f32, EPI_F32)
