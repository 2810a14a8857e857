// Quantized GEMV for a decode batch on tensor cores: out[t] = epilogue(x[t] @ W.T) for the
// T <= 8 * CT input rows of x, W group-quantized (INT4 / INT8, g = 32 / 64 / 128).
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
