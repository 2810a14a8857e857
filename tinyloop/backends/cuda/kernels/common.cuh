// Shared helpers for every TinyLoop kernel family (no CUDA headers needed: NVRTC and nvcc alike).
//
// tinyloop/backends/cuda/compile.py pastes this file in place of the `#include "common.cuh"`
// line before handing a source to cupy.RawModule (so CuPy's on-disk cache key covers it);
// .ci/compile_cuda.sh passes -I tinyloop/backends/cuda/kernels to nvcc instead.
//
// Conventions: FP16 values travel as raw bits (`half_t`, unsigned short) and convert through
// PTX `cvt`; integer kernel parameters are `long long` and float parameters `double`, so the
// host passes plain Python ints and floats (CuPy packs them as int64 / float64).
#pragma once

typedef unsigned short half_t;
typedef unsigned char u8;
typedef signed char i8;
typedef long long i64;

#define TL_NEG_INF __int_as_float(0xff800000)
#define TL_NAN __int_as_float(0x7fc00000)

__device__ __forceinline__ float h2f(half_t h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ half_t f2h(float f) {
    half_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// --- what the KV cache stores in FP16 (quant.saturate_f16 / saturate_scales) -------------
// No finite value becomes infinite: finite values beyond FP16's largest finite value are
// clamped to +-TL_F16_MAX; NaN and infinities stay non-finite. A quantization unit (an int8
// row, an h group) holding a NaN or an infinity stores the scale TL_H16_NAN (NumPy's float16
// NaN bits, so both backends store the same bytes), and reads back as NaN.
#define TL_F16_MAX 65504.0f
#define TL_F32_MAX 3.40282347e38f
#define TL_H16_NAN ((half_t)0x7E00u)

__device__ __forceinline__ bool tl_finite(float x) { return fabsf(x) <= TL_F32_MAX; }

__device__ __forceinline__ half_t f2h_sat(float f) {
    if (fabsf(f) > TL_F16_MAX && tl_finite(f)) f = f > 0.0f ? TL_F16_MAX : -TL_F16_MAX;
    return f2h(f);
}

// A float32 scale or zero of a unit whose inputs are all finite (`ok`), as FP16: clamped to
// +-TL_F16_MAX; TL_H16_NAN when not ok.
__device__ __forceinline__ half_t f2h_scale(float s, bool ok) {
    return ok ? f2h(fminf(fmaxf(s, -TL_F16_MAX), TL_F16_MAX)) : TL_H16_NAN;
}

// Two floats -> one 32-bit word of two FP16 values, `lo` in the low half (memory order).
__device__ __forceinline__ unsigned pack_h2(float lo, float hi) {
    return (unsigned)f2h(lo) | ((unsigned)f2h(hi) << 16);
}

__device__ __forceinline__ float h2_lo(unsigned w) { return h2f((half_t)(w & 0xFFFFu)); }
__device__ __forceinline__ float h2_hi(unsigned w) { return h2f((half_t)(w >> 16)); }

// w = q * scale + zero, rounded as float32 product then float32 sum (quant.dequantize's order;
// the explicit _rn intrinsics stop the compiler from contracting it into one FMA).
__device__ __forceinline__ float dq(float q, float s, float z) {
    return __fadd_rn(__fmul_rn(q, s), z);
}

// --- programmatic dependent launch (PDL; sm_90+, PTX ISA "griddepcontrol") ------------------
// A captured decode step launches its kernels with cuLaunchKernelEx and the attribute
// CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (tinyloop/backends/cuda/launch.py
// PDL_KERNELS, PdlLauncher), so a kernel's blocks may start while the kernel before it still
// runs (CUDA Programming Guide, "Programmatic Dependent Launch and Synchronization"). The rule
// for every kernel so launched: before pdl_wait() it may only read what no kernel of the step
// writes - constant inputs (weights), the step state's position (advanced at the end of the
// step before) and K / V rows of earlier positions (attention_decode.cu) - and write nothing;
// pdl_wait() returns once the kernel before has completed with its memory visible.
// pdl_trigger() then lets the next kernel launch (so at most one kernel runs ahead, waiting).
// Loads issued before the wait of memory near what the kernel before writes go through L2
// only (common.cuh kv_raw8 / kv_scale L2), so no L1 line read ahead can be stale after it.
// For a kernel launched without the attribute pdl_wait() is a no-op (its launch already
// waited) and pdl_trigger() only lets a PDL-launched successor start early; compiled before
// sm_90 both are no-ops.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The first statement of a PDL-launched kernel that loads nothing ahead of its dependency.
#define TL_PDL_ENTER() (pdl_wait(), pdl_trigger())

// --- tensor cores (gemm.cu, attention_prefill.cu): plain sm_80+ PTX, so NVRTC needs no headers.
// c[0..3] += A (16 x 16, row-major FP16) * B (16 x 8, "col": stored as [n][k]), FP32 accumulate.
// Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16"), lane = 4 g + t4:
//   a[0] = A[g][2t4..+1], a[1] = A[g+8][2t4..+1], a[2] = A[g][2t4+8..+9], a[3] = A[g+8][2t4+8..+9]
//   b[0] = B[2t4..+1][g], b[1] = B[2t4+8..+9][g]
//   c[0..1] = C[g][2t4..+1], c[2..3] = C[g+8][2t4..+1]
__device__ __forceinline__ void mma16816(float* c, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide sum / max for blockDim.x a multiple of 32 and <= 1024; `red` holds >= 32 floats.
// Every thread gets the result. Starts and ends with a barrier, so `red` can be reused.
__device__ __forceinline__ float block_sum(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float r = lane < nw ? red[lane] : 0.0f;
    r = warp_sum(r);
    return r;
}

__device__ __forceinline__ float block_max(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float r = lane < nw ? red[lane] : TL_NEG_INF;
    r = warp_max(r);
    return r;
}

// Argmax order (numpy.argmax's rule): (v, i) ranks before (w, j) when v is NaN and w is not, or
// both NaN and i < j, or v > w, or v == w and i < j. So the first NaN wins, else the first maximum.
__device__ __forceinline__ bool argmax_before(float v, int i, float w, int j) {
    const bool vn = v != v, wn = w != w;
    if (vn || wn) return vn && (!wn || i < j);
    return v > w || (v == w && i < j);
}

// Warp-wide argmax: every lane ends with the warp's best (v, i) by argmax_before.
__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (argmax_before(ov, oi, v, i)) { v = ov; i = oi; }
    }
}

// Block-wide argmax for blockDim.x a multiple of 32; sv / si hold >= 32 entries. Thread 0
// gets the block's best (v, i) (the others a partial). Ends with a barrier.
__device__ __forceinline__ void block_argmax(float& v, int& i, float* sv, int* si) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    warp_argmax(v, i);
    __syncthreads();
    if (lane == 0) { sv[warp] = v; si[warp] = i; }
    __syncthreads();
    if (warp == 0) {
        v = lane < nw ? sv[lane] : TL_NEG_INF;
        i = lane < nw ? si[lane] : 0x7fffffff;
        warp_argmax(v, i);
    }
    __syncthreads();
}

// Why a logit row cannot be sampled, from its argmax winner (argmax_before's order puts NaN
// first, then +inf; the winner is -inf only when every logit is): 0 = it can, 1 = a NaN,
// 2 = a +inf, 3 = all -inf. The codes of base.LOGIT_FAULTS.
__device__ __forceinline__ int logit_fault_code(float top) {
    return top != top ? 1 : (top == -TL_NEG_INF ? 2 : (top == TL_NEG_INF ? 3 : 0));
}

// --- paged KV reads (attention.cu, attention_decode.cu; layout: tinyloop/kv/layouts.py PageLayout)
// MODE 0 = fp16 (K/V FP16), MODE 1 = int8 (K/V = float(q) * float(scale), the product rounded
// once in float32 as the NumPy reference does).
#define KV_FP16 0
#define KV_INT8 1

// Sliding-window attention: the first key the query at position `pos` reads. window > 0: keys
// pos-window+1..pos (the query's own included; docs/format.md `sliding_window`), so the first
// is max(0, pos - window + 1); window <= 0: full causal attention, key 0. The window is a
// kernel argument (a layer's own value), so one compiled kernel serves both kinds of layer.
__device__ __forceinline__ i64 win_lo(i64 pos, i64 window) {
    const i64 lo = pos - window + 1;
    return window > 0 && lo > 0 ? lo : 0;
}

// The page holding key j and j's row inside it.
__device__ __forceinline__ const char* kv_page(const i64* __restrict__ table, i64 P, i64 j,
                                              i64* row) {
    const i64 pg = j / P;
    *row = j - pg * P;
    return (const char*)table[pg];
}

// The raw bytes of 8 consecutive values (dims c..c+7, c % 8 == 0) of row r = row * n_kv + hk of
// a K or V part: one 16-byte load (fp16) or one 8-byte load (int8, in .x / .y). kv_unpack8
// turns them into floats; split so a caller can load ahead and convert later
// (attention_decode.cu loads its first chunk before the PDL wait).
// L2: load through L2 only (ld.global.cg), allocating nothing in L1 - for loads issued before
// a PDL wait, whose L1 lines could hold a sector the kernel before is still writing (int8
// scales of adjacent positions share one), and for what that kernel wrote, read after it.
template <int MODE, int HD, bool L2 = false>
__device__ __forceinline__ uint4 kv_raw8(const char* base, i64 off, i64 r, int c) {
    if (MODE == KV_FP16) {
        const uint4* p = (const uint4*)((const half_t*)(base + off) + r * HD + c);
        return L2 ? __ldcg(p) : *p;
    }
    const uint2* p = (const uint2*)((const i8*)(base + off) + r * HD + c);
    const uint2 w2 = L2 ? __ldcg(p) : *p;
    return make_uint4(w2.x, w2.y, 0u, 0u);
}

// Row r's int8 scale (1 for fp16 pages, which have none).
template <int MODE, bool L2 = false>
__device__ __forceinline__ float kv_scale(const char* base, i64 soff, i64 r) {
    if (MODE == KV_FP16) return 1.0f;
    const half_t* p = (const half_t*)(base + soff) + r;
    return h2f(L2 ? __ldcg(p) : *p);
}

template <int MODE>
__device__ __forceinline__ void kv_unpack8(uint4 w4, float s, float* x) {
    if (MODE == KV_FP16) {
        const unsigned w[4] = {w4.x, w4.y, w4.z, w4.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) { x[2 * j] = h2_lo(w[j]); x[2 * j + 1] = h2_hi(w[j]); }
    } else {
        const unsigned w[2] = {w4.x, w4.y};
#pragma unroll
        for (int j = 0; j < 8; ++j)
            x[j] = __fmul_rn((float)(i8)((w[j >> 2] >> (8 * (j & 3))) & 0xFFu), s);
    }
}

// 8 consecutive values (dims c..c+7, c % 8 == 0) of row r = row * n_kv + hk of a K or V part.
template <int MODE, int HD>
__device__ __forceinline__ void kv_load8(const char* base, i64 off, i64 soff, i64 r, int c,
                                         float* x) {
    kv_unpack8<MODE>(kv_raw8<MODE, HD>(base, off, r, c), kv_scale<MODE>(base, soff, r), x);
}

// 2 consecutive values (dims c, c+1; c even) of row r of a K or V part.
template <int MODE, int HD>
__device__ __forceinline__ void kv_load2(const char* base, i64 off, i64 soff, i64 r, int c,
                                         float* x) {
    if (MODE == KV_FP16) {
        const unsigned w = *(const unsigned*)((const half_t*)(base + off) + r * HD + c);
        x[0] = h2_lo(w);
        x[1] = h2_hi(w);
    } else {
        const unsigned short w = *(const unsigned short*)((const i8*)(base + off) + r * HD + c);
        const float s = h2f(((const half_t*)(base + soff))[r]);
        x[0] = __fmul_rn((float)(i8)(w & 0xFFu), s);
        x[1] = __fmul_rn((float)(i8)(w >> 8), s);
    }
}
