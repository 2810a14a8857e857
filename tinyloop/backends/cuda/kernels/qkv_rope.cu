// The captured decode step's attention prologue in one launch (fp16 or int8 KV pages, T = 1):
// RMSNorm of the residual row + the QKV GEMV (gemv.cu v1: one warp per output row, the
// normalized row in shared memory) + RoPE on Q and K + the K / V write into the slot's page at
// the step state's position. It replaces gemv_norm_q*_f16 followed by kv_write_step_{fp16,int8}
// and leaves memory exactly as that pair does (with a Q/K/V bias, bias f32 [N] not null: as
// gemv_norm_q*_f16, add_bias_f16 and kv_write_step do):
//   qkv f16 [(H + 2 Hkv) hd] holds the GEMV output (plus the bias) with Q rotated in place (K and V as
//   computed); the page row at pos holds the rotated K and the V, as FP16 (fp16 pages), or
//   as INT8 codes with one FP16 scale per (K or V, KV head) (int8 pages).
// The arithmetic is that pair's: each output is rounded to FP16 (gemv_store), then a pair
// (2i, 2i+1) of a Q or K head is rotated in float by rope.cu's rope_rot with the angle table
// of rope_table (or the step state's copy of it, STEP_ROPE) and rounded to FP16 again (a K
// page row through f2h_sat, as rope.cu writes it).
// Interleaved pairs are adjacent rows, so both rows of a pair are in one block (GEMV_WARPS is
// even and blocks start at multiples of it): the block exchanges its row totals through
// shared memory. An int8 row's scale needs the amax of the whole KV head (hd rows, spread over
// several blocks), so with int8 pages the last block to finish its rows (an atomic ticket
// after a __threadfence, CUDA's threadFenceReduction pattern; it re-arms the ticket) quantizes
// the 2 Hkv K / V head rows from qkv with rope.cu's kv_int8_rows_block, as
// kv_write_step_int8 does.
//
// Checked against: gemv_norm_q*_f16 + kv_write_step_* on the same inputs, bit for bit
// (tests/kernels/test_kernels_gpu.py::test_qkv_rope_step_equals_the_pair), and through them NumpyOps.
#include "common.cuh"
#define TL_DEVICE_ONLY
#include "gemv.cu"
#include "rope.cu"
#undef TL_DEVICE_ONLY

static_assert(GEMV_WARPS % 2 == 0, "a RoPE pair must fall in one block");

// x f32 [K] residual row, weight f32 [K]; W [N, K] with N = (H + 2 Hkv) hd, hd even and
// <= STEP_ROPE_MAX; dynamic shared memory = 2 K bytes; grid <= ceil(N / GEMV_WARPS),
// block = 32 * GEMV_WARPS. step: the device step state (position at step[STEP_POS]).
// MODE: KV_FP16 or KV_INT8 (ks_off / vs_off: the scale parts; ticket: u32, 0 between
// launches; both unused for fp16).
template <int BITS, int MODE>
__device__ __forceinline__ void qkv_rope_impl(const float* __restrict__ x,
                                              const float* __restrict__ weight, double eps,
                                              const u8* __restrict__ qw,
                                              const half_t* __restrict__ sc,
                                              const half_t* __restrict__ zr, i64 N, i64 K,
                                              i64 log2g, half_t* __restrict__ qkv,
                                              const int* __restrict__ step, double theta,
                                              i64 n_heads, i64 n_kv, i64 hd,
                                              const i64* __restrict__ table, i64 P, i64 k_off,
                                              i64 v_off, i64 ks_off, i64 vs_off,
                                              unsigned* __restrict__ ticket,
                                              const float* __restrict__ bias) {
    half_t* xs = (half_t*)gemv_smem;
    __shared__ float cs[STEP_ROPE_MAX];
    __shared__ float tot[GEMV_WARPS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row0 = blockIdx.x * GEMV_WARPS + warp;
    if (row0 < N) gemv_prefetch_row<BITS, EPI_F16>(qw, sc, zr, row0, K, 0, (int)log2g, lane);
    NormW nw;
    norm_weight_load(weight, K, nw);
    // the step state's position and RoPE table and the block table: the step before wrote
    // them (step_advance ends it), no kernel of this step does, so they too load ahead
    const i64 pos = (i64)step[STEP_POS];
    rope_table_for(step, pos, theta, hd, cs);     // hd <= STEP_ROPE_MAX: the host checks
    i64 prow = 0;
    char* base = kv_page_w(table, P, pos, &prow);
    TL_PDL_ENTER();                               // the residual row: the kernel before wrote it
    norm_row_to_shared(x, weight, eps, K, xs, &nw);   // ends with a barrier: cs is visible too
    const int half = (int)(hd / 2);
    const i64 q_rows = n_heads * hd, k_rows = n_kv * hd;
    half_t* kdst = (half_t*)(base + k_off) + prow * n_kv * hd;
    half_t* vdst = (half_t*)(base + v_off) + prow * n_kv * hd;
    const int step_rows = gridDim.x * GEMV_WARPS;
    for (int r0 = blockIdx.x * GEMV_WARPS; r0 < N; r0 += step_rows) {   // block-uniform
        const int row = r0 + warp;
        float unused = 0.0f;
        if (row + step_rows < N)                  // the next pass's row: into L1 meanwhile
            gemv_prefetch_row<BITS, EPI_F16>(qw, sc, zr, row + step_rows, K, 0, (int)log2g,
                                             lane);
        if (row < N) {
            const float acc = gemv_row_acc<BITS, EPI_F16>(qw, sc, zr, xs, row, K, 0,
                                                          (int)log2g, lane, unused);
            if (lane == 0) {
                half_t y = f2h(acc);              // gemv_store's FP16 output
                if (bias != nullptr) y = f2h(h2f(y) + bias[row]);   // add_bias_f16's rounding
                qkv[row] = y;
                tot[warp] = h2f(y);
            }
        }
        __syncthreads();
        if (lane == 0 && row < N) {
            if (row < q_rows + k_rows) {          // Q or K: rotate the pair (row & ~1, row | 1)
                const int i = (int)((row % hd) >> 1);
                float y0, y1;
                rope_rot(tot[warp & ~1], tot[warp | 1], cs[i], cs[half + i], &y0, &y1);
                const float y = (row & 1) ? y1 : y0;
                if (row < q_rows) qkv[row] = f2h(y);
                else if (MODE == KV_FP16) kdst[row - q_rows] = f2h_sat(y);
            } else if (MODE == KV_FP16) {
                vdst[row - q_rows - k_rows] = f2h(tot[warp]);
            }
        }
        __syncthreads();                          // tot is rewritten next pass
    }
    if (MODE != KV_INT8) return;
    __shared__ bool last;
    __threadfence();                              // this block's qkv rows, then the ticket
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    kv_int8_rows_block(qkv, n_heads, n_kv, hd, cs, base, prow, k_off, v_off, ks_off, vs_off);
    if (threadIdx.x == 0) *ticket = 0u;           // re-armed for the next launch
}

#define QKV_ROPE_ENTRY(NAME, BITS, MODE)                                                       \
    extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)                             \
        NAME(const float* x, const float* weight, double eps, const u8* qw, const half_t* sc,  \
             const half_t* zr, i64 N, i64 K, i64 log2g, half_t* qkv, const int* step,          \
             double theta, i64 n_heads, i64 n_kv, i64 hd, const i64* table, i64 P, i64 k_off,  \
             i64 v_off, i64 ks_off, i64 vs_off, unsigned* ticket, const float* bias) {         \
        qkv_rope_impl<BITS, MODE>(x, weight, eps, qw, sc, zr, N, K, log2g, qkv, step, theta,   \
                                  n_heads, n_kv, hd, table, P, k_off, v_off, ks_off, vs_off,   \
                                  ticket, bias);                                               \
    }

QKV_ROPE_ENTRY(qkv_rope_step_q4_fp16, 4, KV_FP16)
QKV_ROPE_ENTRY(qkv_rope_step_q8_fp16, 8, KV_FP16)
QKV_ROPE_ENTRY(qkv_rope_step_q4_int8, 4, KV_INT8)
QKV_ROPE_ENTRY(qkv_rope_step_q8_int8, 8, KV_INT8)
