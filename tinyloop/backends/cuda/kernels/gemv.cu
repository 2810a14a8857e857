// Quantized GEMV for decode (T = 1): y = x @ W.T with W group-quantized (INT4 / INT8, g = 32/64/128).
//
// Checked against: NumpyOps.linear / linear_residual / linear_swiglu / lm_head / inject at T = 1
// (tests/kernels/test_kernels_gpu.py::test_linear* with T=1, ::test_lm_head, ::test_inject), and the
// RMSNorm-fused entries gemv_norm_* against NumpyOps' rmsnorm + linear / linear_swiglu / lm_head
// composition and against CudaOps' own unfused composition (::test_rmsnorm_fused*).
//
// Memory-bound: every weight byte is read once with a 16-byte load and dequantized in registers.
// One warp per output row (two rows, gate and up, for SwiGLU); a lane takes 16-byte chunks
// of the row: 32 INT4 codes or 16 INT8 codes, which never straddle a group since g >= 32.
// Per group the dot product is factored: sum_k (q_k s + z) x_k = s * sum q_k x_k + z * sum x_k.
// Needs K % 32 == 0 and 16-byte aligned rows (the host wrapper checks).
//
// RMSNorm fusion (gemv_norm_*, decode only): the input is the FP32 residual row instead of an
// FP16 activation. Each block first normalizes the whole row into dynamic shared memory
// (K halves, 16-byte aligned) with exactly rmsnorm.cu's arithmetic, then its warps run the
// same per-row loop (gemv_row) reading x from shared memory, striding over rows by the grid
// (the host caps the grid at about one resident wave, so the row is normalized at most that
// many times). One launch replaces rmsnorm + GEMV; the FP16 normalized row never hits memory.
#include "common.cuh"

// Launch geometry shared with the host: the host passes these as -D options from
// tinyloop/backends/cuda/compile.py GEOMETRY (the one definition); the values below are defaults
// for a standalone nvcc build, kept equal to the table by tests/kernels/test_kernel_geometry.py.
#ifndef GEMV_WARPS
#define GEMV_WARPS 8
#endif
// the largest v2 block (GEMV2_THREADS in tinyloop/backends/cuda/choice.py): its launch bound
#ifndef GEMV2_MAX_THREADS
#define GEMV2_MAX_THREADS 256
#endif

enum { EPI_F16 = 0, EPI_RESID = 1, EPI_SWIGLU = 2, EPI_F32 = 3 };

// The epilogue of output row `row` (by the lane holding its total): EPI_F16 / EPI_F32 store,
// EPI_RESID read-add-store (the read through L2), EPI_SWIGLU silu(acc0) * acc1.
template <int EPI>
__device__ __forceinline__ void gemv_store(void* out, i64 row, float acc0, float acc1) {
    if (EPI == EPI_F16) ((half_t*)out)[row] = f2h(acc0);
    if (EPI == EPI_F32) ((float*)out)[row] = acc0;
    if (EPI == EPI_RESID) {
        float* o = (float*)out + row;
        *o = __ldcg(o) + acc0;
    }
    if (EPI == EPI_SWIGLU) ((half_t*)out)[row] = f2h(acc0 / (1.0f + __expf(-acc0)) * acc1);
}

// The codes of one 16-byte chunk as floats, in element order: 32 INT4 codes (word i holds
// elements 8i..8i+7, nibble j = element 8i+j) or 16 INT8 codes (two's complement bytes).
template <int BITS>
__device__ __forceinline__ void chunk_codes(const uint4 wv, float (&q)[BITS == 4 ? 32 : 16]) {
    const unsigned w[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
    for (int e = 0; e < (BITS == 4 ? 32 : 16); ++e)
        q[e] = BITS == 4 ? (float)((w[e >> 3] >> (4 * (e & 7))) & 15u)
                         : (float)(signed char)((w[e >> 2] >> (8 * (e & 3))) & 0xFFu);
}

// Dot of one chunk's codes q (chunk_codes of chunk index c of its row) with x, given the
// chunk's group scale s and zero z: returns s * sum q_k x_k + z * sum x_k, the products and sums
// in element order (every caller's rounding depends on this order).
template <int BITS>
__device__ __forceinline__ float chunk_dot_q(const float (&q)[BITS == 4 ? 32 : 16],
                                             const half_t* __restrict__ x, int c, float s,
                                             float z) {
    const int n_el = BITS == 4 ? 32 : 16;
    const uint4* xv = (const uint4*)(x + c * n_el);
    float dot = 0.0f, sx = 0.0f;
#pragma unroll
    for (int i = 0; i < n_el / 8; ++i) {
        const uint4 xx = xv[i];
        const unsigned xs[4] = {xx.x, xx.y, xx.z, xx.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float x0 = h2_lo(xs[j]), x1 = h2_hi(xs[j]);
            dot = fmaf(q[8 * i + 2 * j], x0, dot);
            dot = fmaf(q[8 * i + 2 * j + 1], x1, dot);
            sx += x0 + x1;
        }
    }
    return fmaf(s, dot, z * sx);
}

// Dot of one 16-byte chunk (chunk index c of its row) with x, given the chunk's group scale s
// and zero z: returns s * sum q_k x_k + z * sum x_k. The same arithmetic as chunk_codes +
// chunk_dot_q, written out once more so the T = 1 kernels keep their own register schedule
// (tests/kernels/test_gemv_rows_gpu.py holds gemv_rows{R}_* to gemv_* bit for bit).
template <int BITS>
__device__ __forceinline__ float chunk_dot_sz(const uint4 wv, const half_t* __restrict__ x, int c,
                                              float s, float z) {
    const int n_el = BITS == 4 ? 32 : 16;
    const int col0 = c * n_el;
    const uint4* xv = (const uint4*)(x + col0);
    float dot = 0.0f, sx = 0.0f;
    const unsigned w[4] = {wv.x, wv.y, wv.z, wv.w};
    if (BITS == 4) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {          // word i holds elements 8i..8i+7, nibble j = 8i+j
            const uint4 xx = xv[i];
            const unsigned xs[4] = {xx.x, xx.y, xx.z, xx.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float x0 = h2_lo(xs[j]), x1 = h2_hi(xs[j]);
                const float q0 = (float)((w[i] >> (8 * j)) & 15u);
                const float q1 = (float)((w[i] >> (8 * j + 4)) & 15u);
                dot = fmaf(q0, x0, dot);
                dot = fmaf(q1, x1, dot);
                sx += x0 + x1;
            }
        }
    } else {
#pragma unroll
        for (int i = 0; i < 2; ++i) {          // words 2i, 2i+1 hold elements 8i..8i+7
            const uint4 xx = xv[i];
            const unsigned xs[4] = {xx.x, xx.y, xx.z, xx.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const unsigned ww = w[2 * i + j / 2];
                const int sh = 16 * (j & 1);
                const float x0 = h2_lo(xs[j]), x1 = h2_hi(xs[j]);
                const float q0 = (float)(signed char)((ww >> sh) & 0xFFu);
                const float q1 = (float)(signed char)((ww >> (sh + 8)) & 0xFFu);
                dot = fmaf(q0, x0, dot);
                dot = fmaf(q1, x1, dot);
                sx += x0 + x1;
            }
        }
    }
    return fmaf(s, dot, z * sx);
}

// Partial dot of one 16-byte chunk of row `row` with x; returns s*dot + z*sum(x).
template <int BITS>
__device__ __forceinline__ float chunk_dot(const uint4 wv, const half_t* __restrict__ x, int c,
                                           const half_t* __restrict__ sc,
                                           const half_t* __restrict__ zr, i64 row, int ngroups,
                                           int log2g) {
    const int col0 = c * (BITS == 4 ? 32 : 16);
    const i64 gi = row * ngroups + (col0 >> log2g);
    return chunk_dot_sz<BITS>(wv, x, c, h2f(sc[gi]), h2f(zr[gi]));
}

// One warp computes output row `row` (and `row + F` for SwiGLU) of y = x @ W.T and writes its
// epilogue. x f16 [K] (global or shared); W rows [N_w, K]; EPI_F16: out f16 [N];
// EPI_RESID: out f32 [N] +=; EPI_F32: out f32 [N]; EPI_SWIGLU: out f16 [F] =
// silu(x.W[r]) * (x.W[r+F]), N = F.
// gemv_row_acc: the row's totals (every lane gets acc0 = x.W[row]; acc1 = x.W[row + F] for
// SwiGLU), no store: qkv_rope.cu applies its own epilogue to them.
template <int BITS, int EPI>
__device__ __forceinline__ float gemv_row_acc(const u8* __restrict__ qw,
                                              const half_t* __restrict__ sc,
                                              const half_t* __restrict__ zr,
                                              const half_t* __restrict__ x, i64 row, i64 K,
                                              i64 F, int log2g, int lane, float& acc1_out) {
    const i64 row_bytes = BITS == 4 ? K / 2 : K;
    const int chunks = (int)(row_bytes / 16);
    const int ngroups = (int)(K >> log2g);
    const uint4* w0 = (const uint4*)(qw + row * row_bytes);
    float acc0 = 0.0f, acc1 = 0.0f;
    if (EPI == EPI_SWIGLU) {
        // Batches of two chunks of each row (four 16-byte loads per lane) issued before any is
        // used, the same chunk order c, c + 32, ... per row as one at a time.
        const i64 row1 = row + F;
        const uint4* w1 = (const uint4*)(qw + row1 * row_bytes);
        for (int c = lane; c < chunks; c += 64) {
            uint4 a[2], b[2];
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const bool ok = c + 32 * j < chunks;
                a[j] = ok ? w0[c + 32 * j] : make_uint4(0u, 0u, 0u, 0u);
                b[j] = ok ? w1[c + 32 * j] : make_uint4(0u, 0u, 0u, 0u);
            }
#pragma unroll
            for (int j = 0; j < 2; ++j)
                if (c + 32 * j < chunks) {
                    acc0 += chunk_dot<BITS>(a[j], x, c + 32 * j, sc, zr, row, ngroups, log2g);
                    acc1 += chunk_dot<BITS>(b[j], x, c + 32 * j, sc, zr, row1, ngroups, log2g);
                }
        }
        acc1 = warp_sum(acc1);
    } else {
        // Batches of up to four 16-byte loads per lane, all issued before any is used, the
        // ragged last batch too: a row of C chunks costs ceil(C / 128) dependent DRAM round
        // trips (a 5632-wide INT4 row, 176 chunks: 2, where one load at a time past the last
        // full batch cost 3). The chunks are summed in the order c, c + 32, c + 64, ..., so
        // the total is the same float sum as one chunk at a time.
        for (int c = lane; c < chunks; c += 128) {
            uint4 a[4];
#pragma unroll
            for (int j = 0; j < 4; ++j)
                a[j] = c + 32 * j < chunks ? w0[c + 32 * j] : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
            for (int j = 0; j < 4; ++j)
                if (c + 32 * j < chunks)
                    acc0 += chunk_dot<BITS>(a[j], x, c + 32 * j, sc, zr, row, ngroups, log2g);
        }
    }
    acc1_out = acc1;
    return warp_sum(acc0);
}

template <int BITS, int EPI>
__device__ __forceinline__ void gemv_row(const u8* __restrict__ qw, const half_t* __restrict__ sc,
                                         const half_t* __restrict__ zr,
                                         const half_t* __restrict__ x, i64 row, i64 K, i64 F,
                                         int log2g, void* __restrict__ out, int lane) {
    float acc1 = 0.0f;
    const float acc0 = gemv_row_acc<BITS, EPI>(qw, sc, zr, x, row, K, F, log2g, lane, acc1);
    if (lane == 0) gemv_store<EPI>(out, row, acc0, acc1);
}

__device__ __forceinline__ void prefetch_l1(const void* p) {
    asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
}

// Prefetch into L1 what gemv_row's lane `lane` reads first for `row` (and row + F for SwiGLU):
// its first (up to 4) 16-byte weight chunks and their groups' scales and zeros. Constant data,
// so it may run before pdl_wait (common.cuh): the DRAM round trip of the weights then overlaps
// the kernel before (PDL) and the RMSNorm prologue; the loads gemv_row issues later hit L1.
template <int BITS, int EPI>
__device__ __forceinline__ void gemv_prefetch_row(const u8* __restrict__ qw,
                                                  const half_t* __restrict__ sc,
                                                  const half_t* __restrict__ zr, i64 row, i64 K,
                                                  i64 F, int log2g, int lane) {
    const i64 row_bytes = BITS == 4 ? K / 2 : K;
    const int chunks = (int)(row_bytes / 16);
    const int ngroups = (int)(K >> log2g);
    const int n_el = BITS == 4 ? 32 : 16;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int c = lane + 32 * j;
        if (c >= chunks) break;
        const i64 g = (i64)((c * n_el) >> log2g);
#pragma unroll
        for (int r = 0; r < (EPI == EPI_SWIGLU ? 2 : 1); ++r) {
            const i64 rr = row + r * F;
            prefetch_l1(qw + rr * row_bytes + 16 * c);
            prefetch_l1(sc + rr * ngroups + g);
            prefetch_l1(zr + rr * ngroups + g);
        }
    }
}

// x f16 [K] in global memory. grid = ceil(N / GEMV_WARPS), block = 32 * GEMV_WARPS.
template <int BITS, int EPI>
__device__ __forceinline__ void gemv_impl(const u8* __restrict__ qw,
                                          const half_t* __restrict__ sc,
                                          const half_t* __restrict__ zr,
                                          const half_t* __restrict__ x, i64 N, i64 K, i64 F,
                                          i64 log2g, void* __restrict__ out) {
    const i64 row = (i64)blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row < N) gemv_prefetch_row<BITS, EPI>(qw, sc, zr, row, K, F, (int)log2g, lane);
    TL_PDL_ENTER();                               // x and out: written / read by the kernel before
    if (row >= N) return;
    if (EPI == EPI_RESID) {
        // the residual's load issued with x's, not after the row's reduction: one L2 round
        // trip less on the critical path; the same read-add-store as gemv_store
        float r = 0.0f;
        if (lane == 0) r = __ldcg((const float*)out + row);
        float unused = 0.0f;
        const float acc = gemv_row_acc<BITS, EPI>(qw, sc, zr, x, row, K, F, (int)log2g, lane,
                                                  unused);
        if (lane == 0) ((float*)out)[row] = r + acc;
    } else {
        gemv_row<BITS, EPI>(qw, sc, zr, x, row, K, F, (int)log2g, out, lane);
    }
}

// GEMV over a few input rows (a decode batch, 2 <= T): out[t] = epilogue(x[t] @ W.T) for the
// R rows t of row tile blockIdx.y. One warp per output row (two for SwiGLU), as gemv_impl; each
// lane loads its 16-byte chunks in batches of up to four, turns each chunk into codes once
// (chunk_codes) and takes it against every row of the tile. Row t's arithmetic is
// gemv_row_acc's at T = 1 (the same chunk order and chunk_dot products, the same warp_sum, the
// same epilogue), so each row equals a T = 1 launch on it bit for bit. The tile's x rows
// (2 K bytes each) are read through L1 by every warp of the block. R (2, 4 or 8: the entry's
// number) trades the weight's re-reads from L2 (one per tile) against warps in flight: the
// host takes the largest R that still gives every SM enough warps (gemv.py rows_tile).
// x f16 [T, ldx]; out rows ldo elements apart (f16 or f32 by EPI). grid = (ceil(N / GEMV_WARPS),
// ceil(T / R)), block = 32 * GEMV_WARPS.
template <int BITS, int EPI, int R>
__device__ __forceinline__ void gemv_rows_impl(const u8* __restrict__ qw,
                                               const half_t* __restrict__ sc,
                                               const half_t* __restrict__ zr,
                                               const half_t* __restrict__ x, i64 ldx, i64 T,
                                               i64 N, i64 K, i64 F, i64 log2g,
                                               void* __restrict__ out, i64 ldo) {
    constexpr int NE = BITS == 4 ? 32 : 16;
    constexpr bool TWO = EPI == EPI_SWIGLU;
    const i64 row = (i64)blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    const i64 t0 = (i64)blockIdx.y * R;
    const int nr = (int)(T - t0 < R ? T - t0 : R);
    if (row < N) gemv_prefetch_row<BITS, EPI>(qw, sc, zr, row, K, F, (int)log2g, lane);
    TL_PDL_ENTER();                               // x and out: written / read by the kernel before
    if (row >= N) return;
    const i64 row_bytes = BITS == 4 ? K / 2 : K;
    const int chunks = (int)(row_bytes / 16), ngroups = (int)(K >> log2g);
    const i64 row1 = row + F;
    const uint4* w0 = (const uint4*)(qw + row * row_bytes);
    const uint4* w1 = (const uint4*)(qw + (TWO ? row1 : row) * row_bytes);
    const half_t* xt = x + t0 * ldx;
    float acc0[R], acc1[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = 0.0f;
    for (int c = lane; c < chunks; c += 128) {
        uint4 a[4], b[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const bool ok = c + 32 * j < chunks;
            a[j] = ok ? w0[c + 32 * j] : make_uint4(0u, 0u, 0u, 0u);
            if (TWO) b[j] = ok ? w1[c + 32 * j] : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int cj = c + 32 * j;
            if (cj >= chunks) break;
            const i64 g = (i64)((cj * NE) >> log2g);
            float q[NE];
            chunk_codes<BITS>(a[j], q);
            const float s0 = h2f(sc[row * ngroups + g]), z0 = h2f(zr[row * ngroups + g]);
#pragma unroll
            for (int r = 0; r < R; ++r)
                if (r < nr) acc0[r] += chunk_dot_q<BITS>(q, xt + r * ldx, cj, s0, z0);
            if (TWO) {
                chunk_codes<BITS>(b[j], q);
                const float s1 = h2f(sc[row1 * ngroups + g]), z1 = h2f(zr[row1 * ngroups + g]);
#pragma unroll
                for (int r = 0; r < R; ++r)
                    if (r < nr) acc1[r] += chunk_dot_q<BITS>(q, xt + r * ldx, cj, s1, z1);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        if (r >= nr) break;
        const float v0 = warp_sum(acc0[r]);
        const float v1 = TWO ? warp_sum(acc1[r]) : 0.0f;
        if (lane == 0) {
            const i64 o = (t0 + r) * ldo;
            if (EPI == EPI_F16 || EPI == EPI_SWIGLU) gemv_store<EPI>((half_t*)out + o, row, v0, v1);
            else gemv_store<EPI>((float*)out + o, row, v0, v1);
        }
    }
}

// The normalized row: xs[i] = f16(x[i] * inv_rms * weight[i]), computed exactly as
// rmsnorm.cu's rmsnorm_f32_f16 does (the same per-thread fmaf order over a 256-thread block,
// the same block_sum, the same double-precision rsqrt, the same two float products), so the
// FP16 values are bit-identical to the unfused rmsnorm output. Ends with a barrier.
static_assert(32 * GEMV_WARPS == 256, "bit-identity with rmsnorm.cu needs a 256-thread block");
extern __shared__ __align__(16) unsigned char gemv_smem[];

// The first NORM_HELD values per thread (indices tid + a * blockDim.x) of the RMSNorm weight,
// loaded ahead: the weight is constant, so a PDL kernel loads it before its wait
// (norm_weight_load) and the normalisation after the row's reduction reads registers instead
// of paying an L2 round trip. Rows longer than NORM_HELD * blockDim.x read the rest as they go.
#define NORM_HELD 4
struct NormW {
    float w[NORM_HELD];
};

__device__ __forceinline__ void norm_weight_load(const float* __restrict__ weight, i64 d,
                                                 NormW& nw) {
#pragma unroll
    for (int a = 0; a < NORM_HELD; ++a) {
        const i64 i = threadIdx.x + (i64)a * blockDim.x;
        nw.w[a] = i < d ? weight[i] : 0.0f;
    }
}

// nw: the weight's held values (norm_weight_load) or null (read here). The per-thread order of
// the sum of squares (i = tid, tid + blockDim.x, ...) and every product are as before the
// values were held, so the row is unchanged. Past the held values a thread reads its values in
// batches of NORM_BATCH, each batch's loads in flight together.
#define NORM_BATCH 8
__device__ __forceinline__ void norm_row_to_shared(const float* __restrict__ xr,
                                                   const float* __restrict__ weight, double eps,
                                                   i64 d, half_t* xs,
                                                   const NormW* nw = nullptr) {
    __shared__ float red[32];
    const i64 nt = blockDim.x, rest = threadIdx.x + NORM_HELD * nt;
    float xv[NORM_HELD], ss = 0.0f;
#pragma unroll
    for (int a = 0; a < NORM_HELD; ++a) {         // the row's loads all in flight at once
        const i64 i = threadIdx.x + a * nt;
        xv[a] = i < d ? xr[i] : 0.0f;
    }
#pragma unroll
    for (int a = 0; a < NORM_HELD; ++a)
        if (threadIdx.x + a * nt < d) ss = fmaf(xv[a], xv[a], ss);
    for (i64 i0 = rest; i0 < d; i0 += NORM_BATCH * nt) {
        float v[NORM_BATCH];
#pragma unroll
        for (int b = 0; b < NORM_BATCH; ++b) v[b] = i0 + b * nt < d ? xr[i0 + b * nt] : 0.0f;
#pragma unroll
        for (int b = 0; b < NORM_BATCH; ++b)
            if (i0 + b * nt < d) ss = fmaf(v[b], v[b], ss);
    }
    ss = block_sum(ss, red);
    const float inv = (float)(1.0 / sqrt((double)ss / (double)d + eps));
#pragma unroll
    for (int a = 0; a < NORM_HELD; ++a) {
        const i64 i = threadIdx.x + a * nt;
        if (i < d) xs[i] = f2h(xv[a] * inv * (nw != nullptr ? nw->w[a] : weight[i]));
    }
    for (i64 i0 = rest; i0 < d; i0 += NORM_BATCH * nt) {
        float v[NORM_BATCH], w[NORM_BATCH];
#pragma unroll
        for (int b = 0; b < NORM_BATCH; ++b) {
            const i64 i = i0 + b * nt;
            v[b] = i < d ? xr[i] : 0.0f;
            w[b] = i < d ? weight[i] : 0.0f;
        }
#pragma unroll
        for (int b = 0; b < NORM_BATCH; ++b)
            if (i0 + b * nt < d) xs[i0 + b * nt] = f2h(v[b] * inv * w[b]);
    }
    __syncthreads();
}

// x f32 [K] (the residual row), weight f32 [K]; dynamic shared memory = 2 K bytes.
// grid <= ceil(N / GEMV_WARPS) (grid-stride over rows), block = 32 * GEMV_WARPS.
template <int BITS, int EPI>
__device__ __forceinline__ void gemv_norm_impl(const float* __restrict__ x,
                                               const float* __restrict__ weight, double eps,
                                               const u8* __restrict__ qw,
                                               const half_t* __restrict__ sc,
                                               const half_t* __restrict__ zr, i64 N, i64 K,
                                               i64 F, i64 log2g, void* __restrict__ out) {
    half_t* xs = (half_t*)gemv_smem;
    const int lane = threadIdx.x & 31;
    const int row0 = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (row0 < N) gemv_prefetch_row<BITS, EPI>(qw, sc, zr, row0, K, F, (int)log2g, lane);
    NormW nw;
    norm_weight_load(weight, K, nw);
    TL_PDL_ENTER();                               // the residual row: the kernel before wrote it
    norm_row_to_shared(x, weight, eps, K, xs, &nw);
    // int row index (N < 2^30, the host checks): an i64 loop counter made ptxas spill here
    // Each pass prefetches the next pass's row into L1 first, so a grid smaller than the rows
    // pays the DRAM round trip of a row while the pass before computes.
    const int step = gridDim.x * GEMV_WARPS;
    for (int row = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5); row < N; row += step) {
        if (row + step < N)
            gemv_prefetch_row<BITS, EPI>(qw, sc, zr, row + step, K, F, (int)log2g, lane);
        gemv_row<BITS, EPI>(qw, sc, zr, xs, row, K, F, (int)log2g, out, lane);
    }
}

#ifndef TL_DEVICE_ONLY
#define GEMV_ENTRY(NAME, BITS, EPI)                                                           \
    extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)                            \
        NAME(const u8* qw, const half_t* sc, const half_t* zr, const half_t* x, i64 N, i64 K, \
             i64 F, i64 log2g, void* out) {                                                   \
        gemv_impl<BITS, EPI>(qw, sc, zr, x, N, K, F, log2g, out);                             \
    }

#define GEMV_NORM_ENTRY(NAME, BITS, EPI)                                                      \
    extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)                            \
        NAME(const float* x, const float* weight, double eps, const u8* qw, const half_t* sc, \
             const half_t* zr, i64 N, i64 K, i64 F, i64 log2g, void* out) {                   \
        gemv_norm_impl<BITS, EPI>(x, weight, eps, qw, sc, zr, N, K, F, log2g, out);           \
    }

GEMV_ENTRY(gemv_q4_f16, 4, EPI_F16)
GEMV_ENTRY(gemv_q4_resid, 4, EPI_RESID)
GEMV_ENTRY(gemv_q4_swiglu, 4, EPI_SWIGLU)
GEMV_ENTRY(gemv_q4_f32, 4, EPI_F32)
GEMV_ENTRY(gemv_q8_f16, 8, EPI_F16)
GEMV_ENTRY(gemv_q8_resid, 8, EPI_RESID)
GEMV_ENTRY(gemv_q8_swiglu, 8, EPI_SWIGLU)
GEMV_ENTRY(gemv_q8_f32, 8, EPI_F32)

#define GEMV_ROWS_ENTRY(NAME, R, BITS, EPI)                                                   \
    extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)                            \
        NAME(const u8* qw, const half_t* sc, const half_t* zr, const half_t* x, i64 ldx,     \
             i64 T, i64 N, i64 K, i64 F, i64 log2g, void* out, i64 ldo) {                     \
        gemv_rows_impl<BITS, EPI, R>(qw, sc, zr, x, ldx, T, N, K, F, log2g, out, ldo);        \
    }

// A decode batch's projections, 2 <= T rows in tiles of R (CudaOps._matmul, linear_swiglu).
GEMV_ROWS_ENTRY(gemv_rows2_q4_f16, 2, 4, EPI_F16)
GEMV_ROWS_ENTRY(gemv_rows2_q4_resid, 2, 4, EPI_RESID)
GEMV_ROWS_ENTRY(gemv_rows2_q4_swiglu, 2, 4, EPI_SWIGLU)
GEMV_ROWS_ENTRY(gemv_rows2_q4_f32, 2, 4, EPI_F32)
GEMV_ROWS_ENTRY(gemv_rows2_q8_f16, 2, 8, EPI_F16)
GEMV_ROWS_ENTRY(gemv_rows2_q8_resid, 2, 8, EPI_RESID)
GEMV_ROWS_ENTRY(gemv_rows2_q8_swiglu, 2, 8, EPI_SWIGLU)
GEMV_ROWS_ENTRY(gemv_rows2_q8_f32, 2, 8, EPI_F32)
GEMV_ROWS_ENTRY(gemv_rows4_q4_f16, 4, 4, EPI_F16)
GEMV_ROWS_ENTRY(gemv_rows4_q4_resid, 4, 4, EPI_RESID)
GEMV_ROWS_ENTRY(gemv_rows4_q4_swiglu, 4, 4, EPI_SWIGLU)
GEMV_ROWS_ENTRY(gemv_rows4_q4_f32, 4, 4, EPI_F32)
GEMV_ROWS_ENTRY(gemv_rows4_q8_f16, 4, 8, EPI_F16)
GEMV_ROWS_ENTRY(gemv_rows4_q8_resid, 4, 8, EPI_RESID)
GEMV_ROWS_ENTRY(gemv_rows4_q8_swiglu, 4, 8, EPI_SWIGLU)
GEMV_ROWS_ENTRY(gemv_rows4_q8_f32, 4, 8, EPI_F32)
GEMV_ROWS_ENTRY(gemv_rows8_q4_f16, 8, 4, EPI_F16)
GEMV_ROWS_ENTRY(gemv_rows8_q4_resid, 8, 4, EPI_RESID)
GEMV_ROWS_ENTRY(gemv_rows8_q4_swiglu, 8, 4, EPI_SWIGLU)
GEMV_ROWS_ENTRY(gemv_rows8_q4_f32, 8, 4, EPI_F32)
GEMV_ROWS_ENTRY(gemv_rows8_q8_f16, 8, 8, EPI_F16)
GEMV_ROWS_ENTRY(gemv_rows8_q8_resid, 8, 8, EPI_RESID)
GEMV_ROWS_ENTRY(gemv_rows8_q8_swiglu, 8, 8, EPI_SWIGLU)
GEMV_ROWS_ENTRY(gemv_rows8_q8_f32, 8, 8, EPI_F32)

// RMSNorm -> projection at T = 1 (CudaOps.rmsnorm_linear / _swiglu / rmsnorm_lm_head).
GEMV_NORM_ENTRY(gemv_norm_q4_f16, 4, EPI_F16)
GEMV_NORM_ENTRY(gemv_norm_q4_swiglu, 4, EPI_SWIGLU)
GEMV_NORM_ENTRY(gemv_norm_q4_f32, 4, EPI_F32)
GEMV_NORM_ENTRY(gemv_norm_q8_f16, 8, EPI_F16)
GEMV_NORM_ENTRY(gemv_norm_q8_swiglu, 8, EPI_SWIGLU)
GEMV_NORM_ENTRY(gemv_norm_q8_f32, 8, EPI_F32)
#endif  // TL_DEVICE_ONLY

// ================================================================================================
// GEMV v2 (the LM head's decode GEMV by default; every layer shape runs v1 above:
// tinyloop/backends/cuda/gemv.py GEMV_BY_SHAPE, KernelChoice.gemv forces either).
//
// Checked against: the same NumPy references as v1 (tests/kernels/test_kernels_gpu.py::test_linear*,
// ::test_lm_head, ::test_rmsnorm_*_fused with T=1, run for v1 and v2) and
// ::test_lm_head_argmax (the fused argmax against numpy.argmax of the kernel's own logits and of
// the reference logits).
//
// What changes against v1, all for latency (a decode GEMV reads 0.3-3 MB, a few microseconds
// at most at the copy bandwidth, so one DRAM round trip and the prologue dominate):
// - A group of LPR lanes (4, 8, 16 or 32; a template parameter the host picks from the row
//   length) owns a row; lane `sub` of the group takes 16-byte chunks sub, sub + LPR, ... A warp
//   covers 32 / LPR rows, so short rows (K = 576 INT4: 18 chunks) keep most lanes busy and the
//   grid can be spread over every SM.
// - Each lane issues the loads of its first batch (GEMV2_U chunks of the first row, with their
//   scales and zeros) BEFORE the prologue, so the weight round trip overlaps staging x into
//   shared memory (or the RMSNorm of the residual row): the DRAM latency is paid once, not twice.
// - x is always read from shared memory (staged by the block), never re-read from global per
//   chunk.
// - The row's partial sums are reduced across the LPR lanes with an xor butterfly (every lane of
//   the group ends with the same total: a + b == b + a exactly), so the per-row arithmetic
//   depends only on LPR: gemv2_norm_* and rmsnorm + gemv2_* give identical values.
// - gemv2_norm_q*_argmax adds the greedy pick: each block reduces its rows' logits to a
//   (value, id) pair by numpy.argmax's order, writes it to part_v / part_i[blockIdx.x], and the
//   last block to finish (an atomic ticket after a __threadfence, CUDA's threadFenceReduction
//   pattern) reduces the partials, writes the id and the row's fault code (logit_fault_code,
//   as argmax_f32) to id_dev[0..1] and, when non-null, id_host[0..1] (mapped pinned memory),
//   and re-arms the ticket to 0 for the next launch (graph replay safe).
//
// Block = blockDim.x threads, 64, 128 or 256 (runtime; the RMSNorm prologue emulates rmsnorm.cu's
// 256-thread order, so its FP16 row is bit-identical for each). Dynamic shared memory = 2 K bytes.
// Rows: warp-uniform grid-stride loop, so any grid >= 1 is correct (the host caps the
// RMSNorm variants at one resident wave: each block normalizes the row once).
// Needs K % 32 == 0, 16-byte aligned rows, N * LPR < 2^31 (the host checks).
// ================================================================================================
#define GEMV2_U 4           // 16-byte chunks per lane per batch (all loads of a batch in flight)

// rmsnorm.cu's arithmetic for any blockDim.x dividing 256: thread t plays virtual threads
// t + a * blockDim.x (a < 256 / blockDim.x) of a 256-thread block, with the same per-virtual-
// thread fmaf order, the same warp_sum tree per virtual warp and the same 8-entry final sum, so
// the FP16 row equals rmsnorm_f32_f16's bit for bit. Ends with a barrier.
__device__ __forceinline__ void norm_row_v256(const float* __restrict__ xr,
                                              const float* __restrict__ weight, double eps, int d,
                                              half_t* xs) {
    __shared__ float red[32];
    const int nt = blockDim.x, na = 256 / nt;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = nt >> 5;
    float ss[4];
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        ss[a] = 0.0f;
        if (a < na)
            for (int i = threadIdx.x + a * nt; i < d; i += 256) ss[a] = fmaf(xr[i], xr[i], ss[a]);
    }
#pragma unroll
    for (int a = 0; a < 4; ++a) {
        ss[a] = warp_sum(ss[a]);                         // virtual warp warp + a * nw
        if (a < na && lane == 0) red[warp + a * nw] = ss[a];
    }
    __syncthreads();
    float r = lane < 8 ? red[lane] : 0.0f;
    r = warp_sum(r);
    const float inv = (float)(1.0 / sqrt((double)r / (double)d + eps));
    for (int i = threadIdx.x; i < d; i += nt) xs[i] = f2h(xr[i] * inv * weight[i]);
    __syncthreads();
}

// Loads of one batch: chunks c = c0 + j * LPR (j < GEMV2_U) of `row` (and row + F for SwiGLU)
// with their scales and zeros; zeros where the chunk is past the row or the row is invalid.
// LPR: a compile-time constant at every call (inlined).
template <int BITS, bool TWO>
__device__ __forceinline__ void gemv2_load(uint4 (&wa)[GEMV2_U], float (&sa)[GEMV2_U],
                                           float (&za)[GEMV2_U], uint4 (&wb)[GEMV2_U],
                                           float (&sb)[GEMV2_U], float (&zb)[GEMV2_U],
                                           const u8* __restrict__ qw,
                                           const half_t* __restrict__ sc,
                                           const half_t* __restrict__ zr, int row, int F,
                                           bool valid, int c0, int cpr, int ngroups, int log2g,
                                           int LPR) {
    const int row_bytes = cpr * 16;
    const int n_el = BITS == 4 ? 32 : 16;
    const uint4* w0 = (const uint4*)(qw + (i64)row * row_bytes);
    const uint4* w1 = (const uint4*)(qw + (i64)(row + F) * row_bytes);
    const i64 g0 = (i64)row * ngroups, g1 = (i64)(row + F) * ngroups;
#pragma unroll
    for (int j = 0; j < GEMV2_U; ++j) {
        const int c = c0 + j * LPR;
        const bool ok = valid && c < cpr;
        const int g = (c * n_el) >> log2g;
        wa[j] = ok ? __ldg(w0 + c) : make_uint4(0u, 0u, 0u, 0u);
        sa[j] = ok ? h2f(__ldg(sc + g0 + g)) : 0.0f;
        za[j] = ok ? h2f(__ldg(zr + g0 + g)) : 0.0f;
        if (TWO) {
            wb[j] = ok ? __ldg(w1 + c) : make_uint4(0u, 0u, 0u, 0u);
            sb[j] = ok ? h2f(__ldg(sc + g1 + g)) : 0.0f;
            zb[j] = ok ? h2f(__ldg(zr + g1 + g)) : 0.0f;
        }
    }
}

// Accumulate one loaded batch (gemv2_load's chunks c0 + j * LPR) into the row's partial sums,
// chunk by chunk in ascending order (the order every caller's arithmetic depends on).
template <int BITS, bool TWO>
__device__ __forceinline__ void gemv2_accumulate(const uint4 (&wa)[GEMV2_U],
                                                 const float (&sa)[GEMV2_U],
                                                 const float (&za)[GEMV2_U],
                                                 const uint4 (&wb)[GEMV2_U],
                                                 const float (&sb)[GEMV2_U],
                                                 const float (&zb)[GEMV2_U], const half_t* xs,
                                                 int c0, int cpr, bool valid, int LPR,
                                                 float& acc0, float& acc1) {
#pragma unroll
    for (int j = 0; j < GEMV2_U; ++j) {
        const int c = c0 + j * LPR;
        if (valid && c < cpr) {
            acc0 += chunk_dot_sz<BITS>(wa[j], xs, c, sa[j], za[j]);
            if (TWO) acc1 += chunk_dot_sz<BITS>(wb[j], xs, c, sb[j], zb[j]);
        }
    }
}

// A row's totals from its LPR lanes' partials (xor butterfly: every lane of the group ends
// with the same sums), its epilogue (by the group's lane 0) and the argmax tracking (every
// lane: the best (logit, row) it has seen, by argmax_before). Warp-uniform: all lanes call it.
template <int EPI, bool ARGMAX>
__device__ __forceinline__ void gemv2_finish_row(float acc0, float acc1, int LPR, int sub,
                                                 int row, bool valid, void* out, float& best_v,
                                                 int& best_i) {
    constexpr bool TWO = EPI == EPI_SWIGLU;
#pragma unroll
    for (int o = LPR / 2; o > 0; o >>= 1) {
        acc0 += __shfl_xor_sync(0xffffffffu, acc0, o);
        if (TWO) acc1 += __shfl_xor_sync(0xffffffffu, acc1, o);
    }
    if (valid && sub == 0) gemv_store<EPI>(out, row, acc0, acc1);
    if (ARGMAX && valid && argmax_before(acc0, row, best_v, best_i)) {
        best_v = acc0;
        best_i = row;
    }
}

// NORM: xin is the f32 residual row and nw the RMSNorm weight; else xin is the f16 row.
// ARGMAX (EPI_F32 only): the fused greedy pick described above.
template <int BITS, int EPI, int LPR, bool NORM, bool ARGMAX>
__device__ __forceinline__ void gemv2_body(const void* __restrict__ xin,
                                           const float* __restrict__ nw, double eps,
                                           const u8* __restrict__ qw,
                                           const half_t* __restrict__ sc,
                                           const half_t* __restrict__ zr, int N, int K, int F,
                                           int log2g, void* __restrict__ out,
                                           float* __restrict__ part_v, int* __restrict__ part_i,
                                           unsigned* __restrict__ ticket,
                                           int* __restrict__ id_dev, int* __restrict__ id_host) {
    constexpr bool TWO = EPI == EPI_SWIGLU;
    constexpr int RPW = 32 / LPR;                         // rows per warp
    half_t* xs = (half_t*)gemv_smem;
    const int lane = threadIdx.x & 31, sub = lane & (LPR - 1);
    const int gpb = blockDim.x / LPR;                     // rows per block and pass
    const int cpr = (BITS == 4 ? K / 2 : K) >> 4;         // 16-byte chunks per row
    const int ngroups = K >> log2g;
    const int step = gridDim.x * gpb;
    int r0 = blockIdx.x * gpb + (threadIdx.x >> 5) * RPW; // the warp's first row (warp-uniform)

    uint4 wa[GEMV2_U], wb[GEMV2_U];
    float sa[GEMV2_U], za[GEMV2_U], sb[GEMV2_U], zb[GEMV2_U];
    {   // the first batch of the first row: in flight during the prologue
        const int row = r0 + lane / LPR;
        gemv2_load<BITS, TWO>(wa, sa, za, wb, sb, zb, qw, sc, zr, row, F, row < N, sub, cpr,
                              ngroups, log2g, LPR);
    }
    // PDL (common.cuh): the weight loads above overlap the kernel before; its output (x, the
    // residual row, `out`) is touched only after the wait
    TL_PDL_ENTER();
    if (NORM) {
        norm_row_v256((const float*)xin, nw, eps, K, xs);
    } else {
        const uint4* src = (const uint4*)xin;
        uint4* dst = (uint4*)xs;
        for (int i = threadIdx.x; i < K / 8; i += blockDim.x) dst[i] = src[i];
        __syncthreads();
    }

    float best_v = TL_NEG_INF;
    int best_i = 0x7fffffff;
    bool preloaded = true;
    for (; r0 < N; r0 += step) {
        const int row = r0 + lane / LPR;
        const bool valid = row < N;
        float acc0 = 0.0f, acc1 = 0.0f;
        for (int cb = 0; cb < cpr; cb += GEMV2_U * LPR) {
            if (!preloaded)
                gemv2_load<BITS, TWO>(wa, sa, za, wb, sb, zb, qw, sc, zr, row, F, valid,
                                      cb + sub, cpr, ngroups, log2g, LPR);
            preloaded = false;
            gemv2_accumulate<BITS, TWO>(wa, sa, za, wb, sb, zb, xs, cb + sub, cpr, valid, LPR,
                                        acc0, acc1);
        }
        gemv2_finish_row<EPI, ARGMAX>(acc0, acc1, LPR, sub, row, valid, out, best_v, best_i);
    }
    if (ARGMAX) {
        __shared__ float sv[32];
        __shared__ int si[32];
        __shared__ bool last;
        block_argmax(best_v, best_i, sv, si);
        if (threadIdx.x == 0) {
            part_v[blockIdx.x] = best_v;
            part_i[blockIdx.x] = best_i;
            __threadfence();                              // partial visible before the ticket
            last = atomicAdd(ticket, 1u) == gridDim.x - 1;
        }
        __syncthreads();
        if (!last) return;
        __threadfence();
        best_v = TL_NEG_INF;
        best_i = 0x7fffffff;
        for (int b = threadIdx.x; b < (int)gridDim.x; b += blockDim.x) {
            const float v = __ldcg(part_v + b);           // L2: other blocks' writes
            const int i = __ldcg(part_i + b);
            if (argmax_before(v, i, best_v, best_i)) { best_v = v; best_i = i; }
        }
        block_argmax(best_v, best_i, sv, si);
        if (threadIdx.x == 0) {
            const int code = logit_fault_code(best_v);    // as argmax_f32 writes it
            id_dev[0] = best_i;
            id_dev[1] = code;
            if (id_host) { id_host[0] = best_i; id_host[1] = code; }
            *ticket = 0u;                                 // re-armed for the next launch
        }
    }
}

#ifndef TL_DEVICE_ONLY
#define GEMV2_ENTRY(NAME, BITS, EPI, LPR)                                                     \
    extern "C" __global__ void __launch_bounds__(GEMV2_MAX_THREADS)                          \
        NAME(const u8* qw, const half_t* sc, const half_t* zr, const half_t* x, i64 N, i64 K, \
             i64 F, i64 log2g, void* out) {                                                   \
        gemv2_body<BITS, EPI, LPR, false, false>(x, nullptr, 0.0, qw, sc, zr, (int)N, (int)K, \
                                                 (int)F, (int)log2g, out, nullptr, nullptr,  \
                                                 nullptr, nullptr, nullptr);                 \
    }

#define GEMV2_NORM_ENTRY(NAME, BITS, EPI, LPR)                                                \
    extern "C" __global__ void __launch_bounds__(GEMV2_MAX_THREADS)                          \
        NAME(const float* x, const float* weight, double eps, const u8* qw, const half_t* sc, \
             const half_t* zr, i64 N, i64 K, i64 F, i64 log2g, void* out) {                   \
        gemv2_body<BITS, EPI, LPR, true, false>(x, weight, eps, qw, sc, zr, (int)N, (int)K,   \
                                                (int)F, (int)log2g, out, nullptr, nullptr,   \
                                                nullptr, nullptr, nullptr);                  \
    }

// out f32 [N] logits (written too: the API keeps the row); part_v / part_i [>= grid];
// ticket: one u32, 0 before the first launch; id_dev: int [2]; id_host: mapped int [2] or null.
#define GEMV2_ARGMAX_ENTRY(NAME, BITS, LPR)                                                   \
    extern "C" __global__ void __launch_bounds__(GEMV2_MAX_THREADS)                          \
        NAME(const float* x, const float* weight, double eps, const u8* qw, const half_t* sc, \
             const half_t* zr, i64 N, i64 K, i64 log2g, float* out, float* part_v,            \
             int* part_i, unsigned* ticket, int* id_dev, int* id_host) {                      \
        gemv2_body<BITS, EPI_F32, LPR, true, true>(x, weight, eps, qw, sc, zr, (int)N, (int)K, \
                                                   0, (int)log2g, out, part_v, part_i,        \
                                                   ticket, id_dev, id_host);                  \
    }

#define GEMV2_ALL(LPR)                                                                        \
    GEMV2_ENTRY(gemv2_q4_f16_l##LPR, 4, EPI_F16, LPR)                                         \
    GEMV2_ENTRY(gemv2_q4_resid_l##LPR, 4, EPI_RESID, LPR)                                     \
    GEMV2_ENTRY(gemv2_q4_swiglu_l##LPR, 4, EPI_SWIGLU, LPR)                                   \
    GEMV2_ENTRY(gemv2_q4_f32_l##LPR, 4, EPI_F32, LPR)                                         \
    GEMV2_ENTRY(gemv2_q8_f16_l##LPR, 8, EPI_F16, LPR)                                         \
    GEMV2_ENTRY(gemv2_q8_resid_l##LPR, 8, EPI_RESID, LPR)                                     \
    GEMV2_ENTRY(gemv2_q8_swiglu_l##LPR, 8, EPI_SWIGLU, LPR)                                   \
    GEMV2_ENTRY(gemv2_q8_f32_l##LPR, 8, EPI_F32, LPR)                                         \
    GEMV2_NORM_ENTRY(gemv2_norm_q4_f16_l##LPR, 4, EPI_F16, LPR)                               \
    GEMV2_NORM_ENTRY(gemv2_norm_q4_swiglu_l##LPR, 4, EPI_SWIGLU, LPR)                         \
    GEMV2_NORM_ENTRY(gemv2_norm_q4_f32_l##LPR, 4, EPI_F32, LPR)                               \
    GEMV2_NORM_ENTRY(gemv2_norm_q8_f16_l##LPR, 8, EPI_F16, LPR)                               \
    GEMV2_NORM_ENTRY(gemv2_norm_q8_swiglu_l##LPR, 8, EPI_SWIGLU, LPR)                         \
    GEMV2_NORM_ENTRY(gemv2_norm_q8_f32_l##LPR, 8, EPI_F32, LPR)                               \
    GEMV2_ARGMAX_ENTRY(gemv2_norm_q4_argmax_l##LPR, 4, LPR)                                   \
    GEMV2_ARGMAX_ENTRY(gemv2_norm_q8_argmax_l##LPR, 8, LPR)

GEMV2_ALL(4)
GEMV2_ALL(8)
GEMV2_ALL(16)
GEMV2_ALL(32)
#endif  // TL_DEVICE_ONLY
