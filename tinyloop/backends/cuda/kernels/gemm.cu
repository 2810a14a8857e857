// Tiled quantized GEMM for prefill (T > 1): Y = X @ W.T, X f16 [M, K], W group-quantized [N, K].
//
// Checked against: NumpyOps.linear / linear_residual / linear_swiglu (GEMM into tmp, then
// elementwise.cu's swiglu) / lm_head / inject at T > 1 (tests/kernels/test_kernels_gpu.py::test_linear*).
//
// Block tile 64 (rows of X) x 64 (rows of W) x 32 (K), 4 warps in 2 x 2, each 32 x 32 through
// mma.sync m16n8k16 (FP16 inputs, FP32 accumulation; plain sm_80+ PTX, so NVRTC needs no
// headers). The W tile is dequantized (q*scale + zero in float32, rounded to FP16) on its way
// into shared memory; BK = 32 never straddles a group since g is a multiple of 32. The next
// tile's global loads are issued into registers before the current tile's MMAs (two shared
// buffers, one barrier per K step). Ragged M and N are zero-filled on load and masked on store.
#include "common.cuh"

// Launch geometry shared with the host: the host passes these as -D options from
// tinyloop/backends/cuda/compile.py GEOMETRY (the one definition); the values below are defaults
// for a standalone nvcc build, kept equal to the table by tests/kernels/test_kernel_geometry.py.
#ifndef BM
#define BM 64
#endif
#ifndef BN
#define BN 64
#endif
#ifndef GEMM_THREADS
#define GEMM_THREADS 128
#endif
static_assert(BM == 64 && BN == 64 && GEMM_THREADS == 128,
              "gemm_impl's load and MMA loops are written for a 64 x 64 tile and 4 warps");
#define BK 32
#define LDS 40   // shared row pitch in halves: 80 bytes keeps fragment reads conflict-free

enum { EPI_F16 = 0, EPI_RESID = 1, EPI_F32 = 3 };

// mma16816: common.cuh (shared with attention_prefill.cu).

// Each thread owns 16 consecutive codes of one W row per K step: row tid/2, cols (tid%2)*16.
struct WRegs {
    uint4 q;      // INT8: 16 codes; INT4: 16 codes in q.x, q.y
    float s, z;
};

template <int BITS>
__device__ __forceinline__ void load_w(WRegs& r, const u8* __restrict__ qw,
                                       const half_t* __restrict__ sc,
                                       const half_t* __restrict__ zr, i64 n, i64 N, i64 K,
                                       int k, int log2g) {
    if (n < N) {
        if (BITS == 4) {
            const uint2 v = *(const uint2*)(qw + n * (K / 2) + k / 2);
            r.q.x = v.x; r.q.y = v.y;
        } else {
            r.q = *(const uint4*)(qw + n * K + k);
        }
        const i64 gi = n * (K >> log2g) + (k >> log2g);
        r.s = h2f(sc[gi]);
        r.z = h2f(zr[gi]);
    } else {
        r.q = make_uint4(0, 0, 0, 0);
        r.s = 0.0f;
        r.z = 0.0f;
    }
}

template <int BITS>
__device__ __forceinline__ void store_w(const WRegs& r, half_t* dst) {   // 16 halves
    unsigned o[8];
    if (BITS == 4) {
        const unsigned w[2] = {r.q.x, r.q.y};
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const unsigned ww = w[i / 4];
            const int sh = 8 * (i & 3);
            o[i] = pack_h2(dq((float)((ww >> sh) & 15u), r.s, r.z),
                           dq((float)((ww >> (sh + 4)) & 15u), r.s, r.z));
        }
    } else {
        const unsigned w[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const unsigned ww = w[i / 2];
            const int sh = 16 * (i & 1);
            o[i] = pack_h2(dq((float)(signed char)((ww >> sh) & 0xFFu), r.s, r.z),
                           dq((float)(signed char)((ww >> (sh + 8)) & 0xFFu), r.s, r.z));
        }
    }
    uint4* d = (uint4*)dst;
    d[0] = make_uint4(o[0], o[1], o[2], o[3]);
    d[1] = make_uint4(o[4], o[5], o[6], o[7]);
}

// out: EPI_F16 f16 [M, ldo]; EPI_RESID f32 [M, ldo] +=; EPI_F32 f32 [M, ldo].
// grid = (ceil(N / BN), ceil(M / BM)), block = 128.
template <int BITS, int EPI>
__device__ void gemm_impl(const u8* __restrict__ qw, const half_t* __restrict__ sc,
                          const half_t* __restrict__ zr, const half_t* __restrict__ X, i64 M,
                          i64 N, i64 K, i64 log2g, void* __restrict__ out, i64 ldo) {
    __shared__ __align__(16) half_t As[2][BM * LDS];
    __shared__ __align__(16) half_t Bs[2][BN * LDS];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 1, wn = warp & 1;
    const int g = lane >> 2, t4 = lane & 3;
    const i64 m0 = (i64)blockIdx.y * BM, n0 = (i64)blockIdx.x * BN;

    // X tile: 64 rows x 32 halves = 256 uint4; thread takes idx = tid and tid + 128.
    uint4 xa[2];
    WRegs wr;
    const int wrow = tid >> 1, wcol = (tid & 1) * 16;

    auto load_x = [&](int k0) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int idx = tid + i * 128, r = idx >> 2, c = (idx & 3) * 8;
            xa[i] = (m0 + r < M) ? *(const uint4*)(X + (m0 + r) * K + k0 + c)
                                 : make_uint4(0, 0, 0, 0);
        }
        load_w<BITS>(wr, qw, sc, zr, n0 + wrow, N, K, k0 + wcol, (int)log2g);
    };
    auto store_tiles = [&](int buf) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int idx = tid + i * 128, r = idx >> 2, c = (idx & 3) * 8;
            *(uint4*)(&As[buf][r * LDS + c]) = xa[i];
        }
        store_w<BITS>(wr, &Bs[buf][wrow * LDS + wcol]);
    };

    float acc[2][4][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int r = 0; r < 4; ++r) acc[i][j][r] = 0.0f;

    const int ksteps = (int)(K / BK);
    load_x(0);
    store_tiles(0);
    __syncthreads();
    for (int ks = 0; ks < ksteps; ++ks) {
        const int buf = ks & 1;
        if (ks + 1 < ksteps) load_x((ks + 1) * BK);   // in flight during the MMAs below
        const half_t* A = As[buf];
        const half_t* B = Bs[buf];
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            unsigned af[2][4], bf[4][2];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                const half_t* a = A + (wm * 32 + mi * 16 + g) * LDS + kk + 2 * t4;
                af[mi][0] = *(const unsigned*)(a);
                af[mi][1] = *(const unsigned*)(a + 8 * LDS);
                af[mi][2] = *(const unsigned*)(a + 8);
                af[mi][3] = *(const unsigned*)(a + 8 * LDS + 8);
            }
#pragma unroll
            for (int ni = 0; ni < 4; ++ni) {
                const half_t* b = B + (wn * 32 + ni * 8 + g) * LDS + kk + 2 * t4;
                bf[ni][0] = *(const unsigned*)(b);
                bf[ni][1] = *(const unsigned*)(b + 8);
            }
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                for (int ni = 0; ni < 4; ++ni) mma16816(acc[mi][ni], af[mi], bf[ni]);
        }
        if (ks + 1 < ksteps) store_tiles(buf ^ 1);   // the other buffer: last read before the
        __syncthreads();                             // previous barrier
    }

#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const i64 row = m0 + wm * 32 + mi * 16 + g + (r >= 2 ? 8 : 0);
                const i64 col = n0 + wn * 32 + ni * 8 + 2 * t4 + (r & 1);
                if (row < M && col < N) {
                    const float v = acc[mi][ni][r];
                    if (EPI == EPI_F16) ((half_t*)out)[row * ldo + col] = f2h(v);
                    if (EPI == EPI_F32) ((float*)out)[row * ldo + col] = v;
                    if (EPI == EPI_RESID) ((float*)out)[row * ldo + col] += v;
                }
            }
}

#define GEMM_ENTRY(NAME, BITS, EPI)                                                           \
    extern "C" __global__ void __launch_bounds__(GEMM_THREADS)                               \
        NAME(const u8* qw, const half_t* sc, const half_t* zr, const half_t* X, i64 M, i64 N, \
             i64 K, i64 log2g, void* out, i64 ldo) {                                          \
        gemm_impl<BITS, EPI>(qw, sc, zr, X, M, N, K, log2g, out, ldo);                        \
    }

GEMM_ENTRY(gemm_q4_f16, 4, EPI_F16)
GEMM_ENTRY(gemm_q4_resid, 4, EPI_RESID)
GEMM_ENTRY(gemm_q4_f32, 4, EPI_F32)
GEMM_ENTRY(gemm_q8_f16, 8, EPI_F16)
GEMM_ENTRY(gemm_q8_resid, 8, EPI_RESID)
GEMM_ENTRY(gemm_q8_f32, 8, EPI_F32)
