// dorafp8 CUDA kernels: DoRA straight from an FP8 e4m3 base weight (the contract of dorafp8/backends.py).
//
// Three kernels touch the [N, K] fp8 weight (per-tensor or per-row scales); the rank-r GEMMs outside them and the
// backward pass are the Triton backend's (dorafp8/cuda_backend.py).
//
// weight_norm  n[j] = || scale_j w8[j,:] + s (B A)[j,:] ||. Block = 32 rows x the K tiles of one K split (tiles of
//              128), 256 threads, each thread a 4-row x 4-column micro-tile. W8 comes in 16 bytes per thread into
//              shared memory; B A is computed with fp32 FMA, not tensor cores: A and B are often fp32 master weights,
//              and rounding them to bf16 would put a 2^-9 error into n (hence c = m / n) that the reference does not
//              have; at r = 16 the FMA work (N K r) takes about as long as reading W8, and weight_norm runs once per
//              optimizer step (its result is cached across micro-batches). Splits of K write fp32 partial sums of
//              squares that a second kernel adds in a fixed order (deterministic), then sqrt.
//
// tiles        forward and dgrad: 8 warps, each a warp tile of WM rows x 32 output columns (mma.sync m16n8k16, bf16
//              or fp16 operands, fp32 accumulators), a 4-stage cp.async pipeline over the reduction in steps of 32.
//              Up to 64 rows of activations: 64 x 128 block tiles, warps 2 (M) x 4 (columns), so that W8, whose read
//              dominates at small M, is spread over twice as many blocks. More rows: 64 x 256 (32 x 256 with
//              dropout's two accumulators), warps 1 x 8: the same warp tile, bytes per stage and mma count as
//              128 x 128 (64 x 128) with 2 x 4 warps, but each converted W8 fragment serves one warp instead of being
//              converted by both warps of its column (half the conversions per mma; for bf16 one conversion is
//              four instructions per register). Blocks run in grouped order (grouped_tile): 8 row-blocks sweep the
//              column-blocks together, so that their activation rows and W8 tiles are re-read from L2, not DRAM.
//              (Both choices follow from instruction and byte counts; no GPU timing has checked them yet.)
//
// forward      y = x W0^T with the DoRA epilogue. The fp8 tile stays fp8 in shared memory (BN x 32 bytes per stage);
//              ldmatrix reads it as if it were 16-bit, so lane (g, t) gets row g, bytes 4t..4t+3 of a 16-byte k
//              slice, which cvt.rn.f16x2.e4m3x2 turns into the two B registers (exact: every e4m3 value is an fp16
//              and a bf16). That puts k = 4t..4t+3 where the mma expects k = {2t, 2t+1, 2t+8, 2t+9}: a fixed
//              permutation of the 16 k of each step, harmless as long as A uses the same one, so the x fragments are
//              read with two 8-byte loads (x[g][4t..4t+3], x[g+8][4t..4t+3]) instead of ldmatrix. Dropout runs the x
//              and xm tiles (xm = x * mask, exact in the compute dtype) against the same converted W8 fragments into
//              two accumulators; the 1 / (1 - p) of dropout multiplies the fp32 xm product in the epilogue. The
//              epilogue folds scale (per column), then the rank-r term u B^T is accumulated by more mma steps into
//              the same accumulators after they are scaled by scale_j / s (acc * scale_j / s + u B^T, times s,
//              = x W0^T + s u B^T: no extra registers).
//
// dgrad        dx from the operands the backward pass prepared (gl = g * f / rl, gb = g * srow / rb; per-row scales and
//              c are already in them): the GEMMs gl W8 (and gb W8 with dropout) where the reduction runs over N, the
//              contiguous dim of nothing in W8's layout: ldmatrix.trans on the fp8 tile (viewed as 16-bit) gives lane
//              (g, t) rows 2t, 2t+1 x byte columns 2g, 2g+1; one byte permute splits them into the B fragments of two
//              n8 tiles, the even and the odd output columns. So the accumulators of a 16-column group hold columns
//              16c + 2j (+1), and a lane ends up with 4 consecutive output columns. Block tiles as above (output
//              columns of K; 32 reduction rows of N per step). The converted W8 fragments are the only thing
//              the main loop computes on besides the mma: gl and gb go from shared memory to the mma untouched, and
//              with dropout both accumulators (gl W8, gb W8) share each converted fragment. The epilogue applies the
//              scalars (rl st, rb st), accumulates s v A like forward's rank-r term (its A tile is stored with the
//              same even/odd column interleave) and combines dropout's two terms with the mask.
//
// Rank-r terms with fp32 adapters on 16-bit activations (rank_f32): u B^T and v A run as fp32 FMA on the lane's own
//              accumulator positions (u/B or v/A chunks of 32 in shared memory), so the fp32 adapters are never
//              rounded to 16 bits; forward then also writes z in fp32 (z_f32).
//
// fp32 compute dtype: a plain SIMT path (64 x 64 tiles, 4 x 4 per thread, FMA), fp32-accurate, no tf32.
//
// Edges: any M, N, K (K % 16 == 0 with a 16-byte aligned base selects the 16-byte fp8 copies, otherwise bytes are
// copied one by one; activations need a row stride % 8 == 0 and 16-byte alignment for cp.async, else scalar copies),
// any r (rank chunks of 32, zero padded). Nothing is read out of bounds: rows/columns past the edge are zero-filled
// (cp.async with a source size of 0 reads nothing). Global offsets are int64.
//
// Every shared-memory access goes through sld/sst/ldsm/cp_async below, so that the CPU emulator (built with
// DORA_EMULATE, outside the extension build) can check them for races.

#include "dora_fp8.h"

#include <cstring>
#include <type_traits>

#ifdef DORA_EMULATE
#include "emu_cuda.h"  // CPU stand-ins for the primitives below (not part of the extension build)
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#endif

namespace dorafp8 {
namespace detail {

#ifndef DORA_EMULATE
// ------------------------------------------------------------------------------------------------ primitives

#define DORA_SMEM(name) extern __shared__ __align__(16) uint8_t name[]
#define DORA_LAUNCH(kernel, grid, block, smem, stream, ...) kernel<<<grid, block, smem, stream>>>(__VA_ARGS__)

__device__ __forceinline__ void block_sync() { __syncthreads(); }

template <typename V>
__device__ __forceinline__ V sld(const void* p) { return *reinterpret_cast<const V*>(p); }
template <typename V>
__device__ __forceinline__ void sst(void* p, V v) { *reinterpret_cast<V*>(p) = v; }

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy global -> shared; only src_bytes (0..16) are read, the rest of the 16 is zero-filled.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldsm_x4(uint32_t (&d)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&d)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ uint32_t byte_perm(uint32_t x, uint32_t sel) { return __byte_perm(x, 0u, sel); }
// Correctly rounded even under --use_fast_math (which turns '/' and sqrtf into approximations).
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ float sqrt_rn(float a) { return __fsqrt_rn(a); }

template <typename K>
cudaError_t allow_smem(K kernel, int bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), cudaFuncAttributeMaxDynamicSharedMemorySize,
                              bytes);
}
#endif  // DORA_EMULATE

// ------------------------------------------------------------------------------------------------ dtype helpers

using bf16 = __nv_bfloat16;
using f16 = __half;

template <typename To, typename From>
__device__ __forceinline__ To bits_as(const From& f) {
  static_assert(sizeof(To) == sizeof(From), "bits_as: size mismatch");
  To t;
  memcpy(&t, &f, sizeof(To));
  return t;
}

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(f16 v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(bf16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ f16 from_f32<f16>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float v) { return __float2bfloat16_rn(v); }

// Zeroes a register accumulator (fully unrolled, so that it stays in registers).
template <int X, int Y>
__device__ __forceinline__ void zero(float (&a)[X][Y]) {
#pragma unroll
  for (int i = 0; i < X; ++i)
#pragma unroll
    for (int j = 0; j < Y; ++j) a[i][j] = 0.f;
}
template <int X, int Y, int Z>
__device__ __forceinline__ void zero(float (&a)[X][Y][Z]) {
#pragma unroll
  for (int i = 0; i < X; ++i) zero(a[i]);
}

// Two 16-bit values packed in a 32-bit register, the lower-indexed element in the low half (mma's convention).
template <typename T> struct Pair;
template <> struct Pair<bf16> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    return bits_as<uint32_t>(__floats2bfloat162_rn(lo, hi));
  }
  static __device__ __forceinline__ float2 unpack(uint32_t v) {
    return __bfloat1622float2(bits_as<__nv_bfloat162>(v));
  }
};
template <> struct Pair<f16> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    return bits_as<uint32_t>(__floats2half2_rn(lo, hi));
  }
  static __device__ __forceinline__ float2 unpack(uint32_t v) { return __half22float2(bits_as<__half2>(v)); }
};

// Two e4m3 bytes (low byte = lower index) -> two fp16 in a register: one cvt.rn.f16x2.e4m3x2 on sm_89+. Exact.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t v16) {
  __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v16 & 0xffffu), __NV_E4M3);
  return static_cast<uint32_t>(h.x) | (static_cast<uint32_t>(h.y) << 16);
}
template <typename T> __device__ __forceinline__ uint32_t e4m3x2_to(uint32_t v16);
template <> __device__ __forceinline__ uint32_t e4m3x2_to<f16>(uint32_t v16) { return e4m3x2_to_f16x2(v16); }
template <> __device__ __forceinline__ uint32_t e4m3x2_to<bf16>(uint32_t v16) {
  // No e4m3 -> bf16 instruction on sm_89/sm_90: through fp16 and fp32, both exact for e4m3 values.
  const float2 f = __half22float2(bits_as<__half2>(e4m3x2_to_f16x2(v16)));
  return Pair<bf16>::pack(f.x, f.y);
}
__device__ __forceinline__ float2 e4m3x2_to_f32x2(uint32_t v16) {
  return __half22float2(bits_as<__half2>(e4m3x2_to_f16x2(v16)));
}

template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);
template <> __device__ __forceinline__ void mma16816<bf16>(float (&d)[4], const uint32_t (&a)[4],
                                                           const uint32_t (&b)[2]) { mma_bf16(d, a, b); }
template <> __device__ __forceinline__ void mma16816<f16>(float (&d)[4], const uint32_t (&a)[4],
                                                          const uint32_t (&b)[2]) { mma_f16(d, a, b); }

// Two values as one 4-byte global store (dst 4-byte aligned).
template <typename T>
__device__ __forceinline__ void store_pair(T* dst, float lo, float hi) {
  *reinterpret_cast<uint32_t*>(dst) = Pair<T>::pack(lo, hi);
}

__device__ __forceinline__ int64_t clamp_valid(int64_t remaining, int64_t width) {
  return remaining <= 0 ? 0 : (remaining < width ? remaining : width);
}

// ------------------------------------------------------------------------------------------------ constants

constexpr int kThreads = 256;  // 8 warps in every kernel
constexpr int kStages = 4;     // cp.async pipeline depth of the tensor-core GEMMs
constexpr int kRankChunk = 32; // rank-r epilogues run over r in chunks of 32 (zero padded)
constexpr int kRankPitchF = kRankChunk + 1;  // fp32 rank tiles [rows][33]: column reads of 8 rows hit 8 banks
constexpr int cmax(int a, int b) { return a > b ? a : b; }
constexpr int kGroupM = 8;     // row-blocks per group of the grouped launch order (grouped_tile)

// The tile (bm, bn) that linear block `pid` of a tiles_m x tiles_n grid computes, in grouped order: `group`
// consecutive row-blocks (of x or g) sweep the column-blocks (of W8) together, row-blocks fastest. While a group
// runs, its activation rows and the W8 column-blocks it visits are shared by many resident blocks and stay in L2,
// instead of the activations being streamed from DRAM once per column-block (row-fastest order over all of M) or W8
// once per row-block (column-fastest order). The last group has tiles_m % group row-blocks. 32-bit arithmetic (the
// launch has at most 2^31 - 1 blocks): a 64-bit division would be a call, with a stack frame and spills around it.
// group: p.group_m (the tests' override) or kGroupM when 0; clamped to tiles_m, so group * tiles_n fits 32 bits too.
__device__ __forceinline__ void grouped_tile(uint32_t pid, uint32_t tiles_m, uint32_t tiles_n, int group_m,
                                             int64_t& bm, int64_t& bn) {
  uint32_t group = group_m > 0 ? static_cast<uint32_t>(group_m) : kGroupM;
  if (group > tiles_m) group = tiles_m;
  const uint32_t per_group = group * tiles_n;
  const uint32_t first = (pid / per_group) * group;
  const uint32_t rows = tiles_m - first < group ? tiles_m - first : group;
  const uint32_t in = pid % per_group;
  bm = in % rows + first;
  bn = in / rows;
}

// Shared-memory tiles of 16-bit matrices with 32 columns (64-byte rows, four 16-byte chunks). Two swizzles of the
// chunk index, each conflict-free for the way its tile is read:
//  kSwzPairs (chunk ^ (row & 2)): 8-byte loads of rows g, g+8 at k = 4t (forward's A fragments, forward's B^T rows);
//  kSwzLdsm (chunk ^ ((row >> 1) & 3)): ldmatrix of 8 consecutive rows (dgrad's g and v tiles).
enum Swz { kSwzPairs = 0, kSwzLdsm = 1 };
template <int SWZ>
__device__ __forceinline__ int tile32_offset(int row, int chunk) {
  const int sw = SWZ == kSwzPairs ? (row & 2) : ((row >> 1) & 3);
  return row * 64 + ((chunk ^ sw) << 4);
}

// Copies rows [r0, r0 + ROWS) x columns [k0, k0 + 32) of a row-major 16-bit matrix (rows x cols, row stride ld) into
// a [ROWS][32] tile; elements outside the matrix become 0. vec: 16-byte cp.async (needs ld % 8 == 0 and a 16-byte
// aligned base), else element by element.
template <int ROWS, int SWZ>
__device__ __forceinline__ void load_tile32(uint8_t* tile, const uint16_t* __restrict__ src, int64_t ld, int64_t rows,
                                            int64_t cols, int64_t r0, int64_t k0, bool vec, int tid) {
  constexpr int kPieces = ROWS * 4;  // 16-byte pieces
  static_assert(kPieces % kThreads == 0 || kThreads % kPieces == 0, "load_tile32: pieces and threads must tile");
#pragma unroll
  for (int it = 0; it < (kPieces + kThreads - 1) / kThreads; ++it) {
    const int e = tid + it * kThreads;
    if (kPieces < kThreads && e >= kPieces) break;  // fewer pieces than threads (32-row tiles)
    const int row = e >> 2, ch = e & 3;
    const int64_t gr = r0 + row, gk = k0 + ch * 8;
    uint8_t* dst = tile + tile32_offset<SWZ>(row, ch);
    const int valid = gr < rows ? static_cast<int>(clamp_valid(cols - gk, 8)) : 0;
    if (vec) {
      cp_async_16(dst, valid > 0 ? static_cast<const void*>(src + gr * ld + gk) : static_cast<const void*>(src),
                  valid * 2);
    } else {
      uint16_t v[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = j < valid ? src[gr * ld + gk + j] : uint16_t(0);
      sst<uint4>(dst, bits_as<uint4>(v));
    }
  }
}

// Rows [r0, r0 + ROWS) x columns [c0, c0 + COLS) of a row-major fp32 matrix (rows x cols, row stride ld) into a
// [ROWS][PITCH] fp32 tile, zeros outside the matrix (the fp32 rank-r operands: u, B, v, A with fp32 adapters).
template <int ROWS, int COLS, int PITCH>
__device__ __forceinline__ void load_tile_f32(float* tile, const float* __restrict__ src, int64_t ld, int64_t rows,
                                              int64_t cols, int64_t r0, int64_t c0, int tid) {
  static_assert((ROWS * COLS) % kThreads == 0, "load_tile_f32: whole elements per thread");
#pragma unroll 4
  for (int it = 0; it < ROWS * COLS / kThreads; ++it) {
    const int e = tid + it * kThreads, row = e / COLS, col = e % COLS;
    const int64_t gr = r0 + row, gc = c0 + col;
    sst<float>(tile + row * PITCH + col, (gr < rows && gc < cols) ? src[gr * ld + gc] : 0.f);
  }
}

// The same tile for the small rank-r operands (u, B, v), element by element (they are tiny and often unaligned).
template <int ROWS, int SWZ>
__device__ __forceinline__ void load_tile32_scalar(uint8_t* tile, const uint16_t* __restrict__ src, int64_t ld,
                                                   int64_t rows, int64_t cols, int64_t r0, int64_t k0, int tid) {
  static_assert((ROWS * 32) % kThreads == 0, "load_tile32_scalar: whole elements per thread");
#pragma unroll 4
  for (int it = 0; it < ROWS * 32 / kThreads; ++it) {
    const int e = tid + it * kThreads;
    const int row = e >> 5, col = e & 31;
    const int64_t gr = r0 + row, gk = k0 + col;
    const uint16_t v = (gr < rows && gk < cols) ? src[gr * ld + gk] : uint16_t(0);
    sst<uint16_t>(tile + tile32_offset<SWZ>(row, col >> 3) + (col & 7) * 2, v);
  }
}

// A fragment (m16 x k16) of a kSwzPairs tile in the permuted k order: lane (g, t) takes k = 4t..4t+3 of rows g and
// g + 8, i.e. registers {x[g][4t,4t+1], x[g+8][4t,4t+1], x[g][4t+2,4t+3], x[g+8][4t+2,4t+3]}.
__device__ __forceinline__ void frag_a_pairs(uint32_t (&a)[4], const uint8_t* tile, int row0, int kk, int lane) {
  const int g = lane >> 2, t = lane & 3;
  const int ra = row0 + g, rb = ra + 8, ch = 2 * kk + (t >> 1), off = (t & 1) * 8;
  const uint2 va = sld<uint2>(tile + tile32_offset<kSwzPairs>(ra, ch) + off);
  const uint2 vb = sld<uint2>(tile + tile32_offset<kSwzPairs>(rb, ch) + off);
  a[0] = va.x;
  a[1] = vb.x;
  a[2] = va.y;
  a[3] = vb.y;
}
// B fragment (k16 x n8) in the same permuted k order from a kSwzPairs tile whose rows are the n index.
__device__ __forceinline__ void frag_b_pairs(uint32_t (&b)[2], const uint8_t* tile, int row0, int kk, int lane) {
  const int g = lane >> 2, t = lane & 3;
  const int rr = row0 + g, ch = 2 * kk + (t >> 1), off = (t & 1) * 8;
  const uint2 v = sld<uint2>(tile + tile32_offset<kSwzPairs>(rr, ch) + off);
  b[0] = v.x;
  b[1] = v.y;
}
// A fragment (m16 x k16) of a kSwzLdsm tile in the natural k order, with one ldmatrix.x4.
__device__ __forceinline__ void frag_a_ldsm(uint32_t (&a)[4], const uint8_t* tile, int row0, int kk, int lane) {
  const int row = row0 + (lane & 15), ch = 2 * kk + (lane >> 4);
  ldsm_x4(a, tile + tile32_offset<kSwzLdsm>(row, ch));
}

// ================================================================================================ weight_norm

constexpr int kWnRows = 32;   // rows of W per block
constexpr int kWnBK = 128;    // K per tile
constexpr int kWnRQ = 16;     // ranks per chunk of the B A product
constexpr int kWnSmem = kWnRQ * kWnBK * 4 + kWnRQ * kWnRows * 4 + kWnRows * kWnBK;

template <typename TA>
__global__ void __launch_bounds__(kThreads) weight_norm_kernel(const WeightNormParams p, bool vec_w, int tiles_per_split) {
  DORA_SMEM(smem);
  float* sA = reinterpret_cast<float*>(smem);                           // [kWnRQ][kWnBK]  A chunk (fp32)
  float* sB = reinterpret_cast<float*>(smem + kWnRQ * kWnBK * 4);       // [kWnRQ][kWnRows] B chunk, transposed
  uint8_t* sW = smem + kWnRQ * kWnBK * 4 + kWnRQ * kWnRows * 4;        // [kWnRows][kWnBK] fp8 bytes

  const int tid = threadIdx.x, tx = tid & 31, ty = tid >> 5;  // thread: rows 4ty..4ty+3, columns 4tx..4tx+3
  const int64_t N = p.N, K = p.K, row0 = static_cast<int64_t>(blockIdx.x) * kWnRows;
  const int r = p.r;
  const TA* __restrict__ A = static_cast<const TA*>(p.A);
  const TA* __restrict__ B = static_cast<const TA*>(p.B);
  const int64_t k_tiles = (K + kWnBK - 1) / kWnBK;
  const int64_t kt_begin = static_cast<int64_t>(blockIdx.y) * tiles_per_split;
  const int64_t kt_end = kt_begin + tiles_per_split < k_tiles ? kt_begin + tiles_per_split : k_tiles;

  float sig[4], ss[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t j = row0 + ty * 4 + i;
    sig[i] = j < N ? p.scale[p.scale_per_row ? j : 0] : 0.f;
    ss[i] = 0.f;
  }

  for (int64_t kt = kt_begin; kt < kt_end; ++kt) {
    const int64_t k0 = kt * kWnBK;
    float ba[4][4];
    zero(ba);

    for (int q0 = 0; q0 < (r > 0 ? r : 1); q0 += kWnRQ) {
      block_sync();  // the previous chunk's (or tile's) readers are done with sA, sB, sW
      if (q0 == 0) {  // W8 tile: one 16-byte piece per thread
        const int row = tid >> 3, ch = tid & 7;
        const int64_t gj = row0 + row, gk = k0 + ch * 16;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (gj < N) {
          const uint8_t* src = p.w8 + gj * K + gk;
          if (vec_w) {
            if (gk < K) v = *reinterpret_cast<const uint4*>(src);
          } else {
            uint8_t b[16];
            const int valid = static_cast<int>(clamp_valid(K - gk, 16));
#pragma unroll
            for (int q = 0; q < 16; ++q) b[q] = q < valid ? src[q] : uint8_t(0);
            v = bits_as<uint4>(b);
          }
        }
        sst<uint4>(sW + row * kWnBK + ch * 16, v);
      }
#pragma unroll
      for (int it = 0; it < (kWnRQ * kWnBK) / kThreads; ++it) {  // A chunk [16][128], coalesced along K
        const int e = tid + it * kThreads, q = e >> 7, k = e & 127;
        const int64_t gq = q0 + q, gk = k0 + k;
        sst<float>(sA + q * kWnBK + k, (gq < r && gk < K) ? to_f32(A[gq * K + gk]) : 0.f);
      }
#pragma unroll
      for (int it = 0; it < (kWnRQ * kWnRows) / kThreads; ++it) {  // B chunk [32 rows][16 ranks] -> sB[q][row]
        const int e = tid + it * kThreads, row = e >> 4, q = e & 15;
        const int64_t gj = row0 + row, gq = q0 + q;
        sst<float>(sB + q * kWnRows + row, (gj < N && gq < r) ? to_f32(B[gj * r + gq]) : 0.f);
      }
      block_sync();
#pragma unroll
      for (int q = 0; q < kWnRQ; ++q) {
        const float4 b = sld<float4>(sB + q * kWnRows + ty * 4);
        const float4 a = sld<float4>(sA + q * kWnBK + tx * 4);
        const float bv[4] = {b.x, b.y, b.z, b.w}, av[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) ba[i][j] = fmaf(bv[i], av[j], ba[i][j]);
      }
    }
    // v = scale_j w8 + s (B A); columns past K hold w8 = 0 and A = 0, so v = 0 there.
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t w4 = sld<uint32_t>(sW + (ty * 4 + i) * kWnBK + tx * 4);
      const float2 w01 = e4m3x2_to_f32x2(w4 & 0xffffu), w23 = e4m3x2_to_f32x2(w4 >> 16);
      const float wv[4] = {w01.x, w01.y, w23.x, w23.y};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float v = fmaf(p.s, ba[i][j], sig[i] * wv[j]);
        ss[i] = fmaf(v, v, ss[i]);
      }
    }
  }
  // One warp = 4 rows x all 128 columns of the tile: reduce across the 32 lanes.
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float tot = warp_sum(ss[i]);
    const int64_t j = row0 + ty * 4 + i;
    if (tx == 0 && j < N) {
      if (p.splits == 1) p.n[j] = sqrt_rn(tot);
      else p.partial[static_cast<int64_t>(blockIdx.y) * N + j] = tot;
    }
  }
}

__global__ void __launch_bounds__(kThreads) weight_norm_finalize_kernel(const float* __restrict__ partial, float* n,
                                                                        int64_t N, int splits) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (j >= N) return;
  float tot = 0.f;
  for (int sp = 0; sp < splits; ++sp) tot += partial[static_cast<int64_t>(sp) * N + j];  // fixed order
  n[j] = sqrt_rn(tot);
}

// ================================================================================================ forward (mma)

template <int BM, int BN_, bool DROP>
struct FwdCfg {
  static constexpr int BN = BN_, BK = 32;
  // 8 warps as WARPS_M x WARPS_N; warp tile WM x 32 columns: MT m16 tiles x NT n8 tiles. With BN = 256 (1 x 8) each
  // W8 fragment is converted by one warp; with BN = 128 (2 x 4) the two warps of a column convert it both.
  static constexpr int WARPS_N = BN / 32, WARPS_M = (kThreads / 32) / WARPS_N;
  static constexpr int WM = BM / WARPS_M, MT = WM / 16, NT = 4;
  static_assert(WARPS_M * WARPS_N == kThreads / 32 && WM % 16 == 0, "forward: warp layout");
  static constexpr int kXBytes = BM * BK * 2;              // one activation tile (x or xm)
  static constexpr int kWBytes = BN * BK;                  // one fp8 tile
  static constexpr int kStageBytes = (DROP ? 2 : 1) * kXBytes + kWBytes;
  static constexpr int kLoraBytes = cmax(BM * kRankChunk * 2 + BN * kRankChunk * 2,   // 16-bit u, B chunks
                                         (BM + BN) * kRankPitchF * 4);                 // fp32 u, B chunks
  static constexpr int kSmem = cmax(kStages * kStageBytes, kLoraBytes);
};

// Per-column epilogue of forward (the contract's formulas). a1, a2: the final accumulators (see the kernel).
struct FwdEpilogue {
  bool dora, drop;
  float post;  // s if the rank-r term was accumulated (acc was scaled by scale / s), else 1
  __device__ __forceinline__ void operator()(float a1, float a2, float cj, float bj, float& y, float& z) const {
    if (!dora) {
      y = a1 + bj;
      z = 0.f;
    } else if (!drop) {
      z = post * a1;
      y = fmaf(cj, z, bj);
    } else {  // a1 = scale (x - xd) W8^T, z = xd W0^T + s u B^T:  y = x W0^T + (c - 1) xd W0^T + c s u B^T + b
      z = post * a2;
      y = fmaf(cj, z, a1) + bj;
    }
  }
};

// Two blocks per SM (at most 128 registers a thread): without the bound ptxas may take a few more and halve that.
template <typename T, int BM, int BN_, bool DROP>
__global__ void __launch_bounds__(kThreads, 2) forward_mma_kernel(const ForwardParams p, bool vec_x, bool vec_w) {
  using Cfg = FwdCfg<BM, BN_, DROP>;
  constexpr int BN = Cfg::BN, BK = Cfg::BK, WM = Cfg::WM, MT = Cfg::MT, NT = Cfg::NT;
  DORA_SMEM(smem);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // Unsigned: a power-of-two division stays a shift (signed / and % cost registers: 128 -> 171 in ptxas here).
  const int wm0 = static_cast<int>(static_cast<unsigned>(warp) / Cfg::WARPS_N) * WM;
  const int wn0 = static_cast<int>(static_cast<unsigned>(warp) % Cfg::WARPS_N) * 32;
  const int g = lane >> 2, t = lane & 3;
  const int64_t M = p.M, N = p.N, K = p.K;
  int64_t bm, bn;
  grouped_tile(blockIdx.x, static_cast<uint32_t>((M + BM - 1) / BM), static_cast<uint32_t>((N + BN - 1) / BN),
               p.group_m, bm, bn);
  const int64_t m0 = bm * BM, n0 = bn * BN;
  const uint16_t* __restrict__ x = static_cast<const uint16_t*>(p.x);
  const uint16_t* __restrict__ xm = static_cast<const uint16_t*>(p.xm);

  float acc[MT][NT][4], acc2[DROP ? MT : 1][NT][4];
  zero(acc);
  if (DROP) zero(acc2);

  auto stage_ptr = [&](int s) { return smem + s * Cfg::kStageBytes; };
  auto load_stage = [&](int s, int kt) {
    uint8_t* base = stage_ptr(s);
    const int64_t k0 = static_cast<int64_t>(kt) * BK;
    load_tile32<BM, kSwzPairs>(base, x, p.ldx, M, K, m0, k0, vec_x, tid);
    if (DROP) load_tile32<BM, kSwzPairs>(base + Cfg::kXBytes, xm, p.ldxm, M, K, m0, k0, vec_x, tid);
    uint8_t* sw = base + (DROP ? 2 : 1) * Cfg::kXBytes;
    // fp8 tile [BN][32 bytes]: 16-byte pieces, BN * 2 / 256 per thread; chunk ^ ((row >> 2) & 1) keeps ldmatrix
    // conflict-free.
    static_assert((BN * 2) % kThreads == 0, "forward: whole 16-byte fp8 pieces per thread");
#pragma unroll
    for (int it = 0; it < BN * 2 / kThreads; ++it) {
      const int e = tid + it * kThreads, row = e >> 1, ch = e & 1;
      const int64_t gn = n0 + row, gk = k0 + ch * 16;
      uint8_t* dst = sw + row * 32 + ((ch ^ ((row >> 2) & 1)) << 4);
      const int valid = gn < N ? static_cast<int>(clamp_valid(K - gk, 16)) : 0;
      if (vec_w) {
        cp_async_16(dst, valid > 0 ? static_cast<const void*>(p.w8 + gn * K + gk) : static_cast<const void*>(p.w8),
                    valid);
      } else {
        uint8_t b[16];
#pragma unroll
        for (int q = 0; q < 16; ++q) b[q] = q < valid ? p.w8[gn * K + gk + q] : uint8_t(0);
        sst<uint4>(dst, bits_as<uint4>(b));
      }
    }
  };
  auto compute_stage = [&](int s) {
    const uint8_t* sx = stage_ptr(s);
    const uint8_t* sxm = sx + Cfg::kXBytes;
    const uint8_t* sw = sx + (DROP ? 2 : 1) * Cfg::kXBytes;
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      // B: one ldmatrix.x4 = 4 n8 tiles x 16 k bytes; lane (g, t) gets w8[n][4t..4t+3] for n = wn0 + 8i + g.
      uint32_t bfr[NT][2];
      {
        uint32_t d[4];
        const int n = wn0 + 8 * (lane >> 3) + (lane & 7);
        ldsm_x4(d, sw + n * 32 + ((kk ^ ((n >> 2) & 1)) << 4));
#pragma unroll
        for (int i = 0; i < NT; ++i) {
          bfr[i][0] = e4m3x2_to<T>(d[i] & 0xffffu);
          bfr[i][1] = e4m3x2_to<T>(d[i] >> 16);
        }
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        uint32_t afr[4];
        frag_a_pairs(afr, sx, wm0 + mt * 16, kk, lane);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma16816<T>(acc[mt][nt], afr, bfr[nt]);
        if (DROP) {
          frag_a_pairs(afr, sxm, wm0 + mt * 16, kk, lane);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) mma16816<T>(acc2[DROP ? mt : 0][nt], afr, bfr[nt]);
        }
      }
    }
  };

  // ---- main loop: multistage cp.async pipeline over K
  const int KT = static_cast<int>((K + BK - 1) / BK);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < KT) load_stage(s, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < KT; ++kt) {
    cp_async_wait<kStages - 2>();
    block_sync();  // tile kt visible to all; everyone is done with the stage about to be refilled
    const int nk = kt + kStages - 1;
    if (nk < KT) load_stage(nk % kStages, nk);
    cp_async_commit();
    compute_stage(kt % kStages);
  }
  cp_async_wait<0>();

  // ---- epilogue: fold scale; accumulate s u B^T into the same registers
  const bool dora = p.c != nullptr;
  const bool lora = dora && p.s != 0.f && p.r > 0;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int64_t j = n0 + wn0 + nt * 8 + 2 * t + (e & 1);
        const float sig = j < N ? p.scale[p.scale_per_row ? j : 0] : 0.f;
        const float pre = lora ? div_rn(sig, p.s) : sig;
        if (!DROP) {
          acc[mt][nt][e] *= pre;
        } else {
          // acc2 = xm W8 and xd W8 = xm W8 / (1 - p), in fp32: acc = scale (x - xd) W8, acc2 = scale xd W8 / s
          acc[mt][nt][e] = sig * fmaf(-p.inv_keep, acc2[DROP ? mt : 0][nt][e], acc[mt][nt][e]);
          acc2[DROP ? mt : 0][nt][e] *= pre * p.inv_keep;
        }
      }
  if (lora && p.rank_f32) {
    // fp32 u, B: FMA on the lane's own accumulator positions (rows g, g + 8; columns 2t, 2t + 1 of each n8 tile).
    const float* __restrict__ u = static_cast<const float*>(p.u);
    const float* __restrict__ Bm = static_cast<const float*>(p.B);
    float* su = reinterpret_cast<float*>(smem);     // [BM][kRankPitchF] u chunk
    float* sb = su + BM * kRankPitchF;              // [BN][kRankPitchF] B chunk (rows = output columns)
    for (int q0 = 0; q0 < p.r; q0 += kRankChunk) {
      block_sync();  // everyone is done with the previous contents of shared memory
      load_tile_f32<BM, kRankChunk, kRankPitchF>(su, u, p.r, M, p.r, m0, q0, tid);
      load_tile_f32<BN, kRankChunk, kRankPitchF>(sb, Bm, p.r, N, p.r, n0, q0, tid);
      block_sync();
#pragma unroll 4
      for (int q = 0; q < kRankChunk; ++q) {
        float ua[MT][2], bv[NT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h) ua[mt][h] = sld<float>(su + (wm0 + mt * 16 + g + 8 * h) * kRankPitchF + q);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) bv[nt][e] = sld<float>(sb + (wn0 + nt * 8 + 2 * t + e) * kRankPitchF + q);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              float& a = DROP ? acc2[DROP ? mt : 0][nt][e] : acc[mt][nt][e];
              a = fmaf(ua[mt][e >> 1], bv[nt][e & 1], a);
            }
      }
    }
  } else if (lora) {
    const uint16_t* __restrict__ u = static_cast<const uint16_t*>(p.u);
    const uint16_t* __restrict__ Bm = static_cast<const uint16_t*>(p.B);
    uint8_t* su = smem;                                 // [BM][32] u chunk
    uint8_t* sb = smem + BM * kRankChunk * 2;           // [BN][32] B chunk (rows = output columns)
    for (int q0 = 0; q0 < p.r; q0 += kRankChunk) {
      block_sync();  // everyone is done with the previous contents of shared memory
      load_tile32_scalar<BM, kSwzPairs>(su, u, p.r, M, p.r, m0, q0, tid);
      load_tile32_scalar<BN, kSwzPairs>(sb, Bm, p.r, N, p.r, n0, q0, tid);
      block_sync();
#pragma unroll
      for (int kk = 0; kk < kRankChunk / 16; ++kk) {
        uint32_t bfr[NT][2];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) frag_b_pairs(bfr[nt], sb, wn0 + nt * 8, kk, lane);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          uint32_t afr[4];
          frag_a_pairs(afr, su, wm0 + mt * 16, kk, lane);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            if (DROP) mma16816<T>(acc2[DROP ? mt : 0][nt], afr, bfr[nt]);
            else mma16816<T>(acc[mt][nt], afr, bfr[nt]);
          }
        }
      }
    }
  }

  // ---- store: lane (g, t) holds rows g, g + 8 x columns 2t, 2t + 1 of each m16 x n8 tile
  const FwdEpilogue epi{dora, DROP, lora ? p.s : 1.f};
  T* __restrict__ y = static_cast<T*>(p.y);
  T* __restrict__ z = p.z_f32 ? nullptr : static_cast<T*>(p.z);
  float* __restrict__ z32 = p.z_f32 ? static_cast<float*>(p.z) : nullptr;  // fp32 z (fp32 adapters)
  const T* __restrict__ bias = static_cast<const T*>(p.bias);
  const bool pair_ok = (N & 1) == 0 && reinterpret_cast<uintptr_t>(y) % 4 == 0 &&
                       reinterpret_cast<uintptr_t>(z) % 4 == 0;  // 4-byte aligned pair stores
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t i = m0 + wm0 + mt * 16 + g + 8 * h;
      if (i >= M) continue;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int64_t j = n0 + wn0 + nt * 8 + 2 * t;
        if (j >= N) continue;
        float yv[2], zv[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int64_t jj = j + e < N ? j + e : j;
          const float cj = dora ? p.c[jj] : 1.f;
          const float bj = bias != nullptr ? to_f32(bias[jj]) : 0.f;
          epi(acc[mt][nt][2 * h + e], DROP ? acc2[DROP ? mt : 0][nt][2 * h + e] : 0.f, cj, bj, yv[e], zv[e]);
        }
        const int64_t o = i * N + j;
        if (pair_ok && j + 1 < N) {
          store_pair<T>(y + o, yv[0], yv[1]);
          if (z != nullptr) store_pair<T>(z + o, zv[0], zv[1]);
        } else {
          y[o] = from_f32<T>(yv[0]);
          if (z != nullptr) z[o] = from_f32<T>(zv[0]);
          if (j + 1 < N) {
            y[o + 1] = from_f32<T>(yv[1]);
            if (z != nullptr) z[o + 1] = from_f32<T>(zv[1]);
          }
        }
        if (z32 != nullptr) {
          z32[o] = zv[0];
          if (j + 1 < N) z32[o + 1] = zv[1];
        }
      }
    }
}

// ================================================================================================ dgrad (mma)

template <int BM, int BK_, bool DROP>
struct DgradCfg {
  static constexpr int BK = BK_, BR = 32;                  // output columns (of K) x reduction rows (of N) per tile
  // 8 warps as WARPS_M x WARPS_K; warp tile WM x 32 columns = 2 groups x (even, odd) n8. With BK = 256 (1 x 8) each
  // W8 fragment is converted by one warp; with BK = 128 (2 x 4) the two warps of a column convert it both.
  static constexpr int WARPS_K = BK / 32, WARPS_M = (kThreads / 32) / WARPS_K;
  static constexpr int WM = BM / WARPS_M, MT = WM / 16, NT = 4;
  static_assert(WARPS_M * WARPS_K == kThreads / 32 && WM % 16 == 0, "dgrad: warp layout");
  static constexpr int kGBytes = BM * BR * 2;              // one left-operand tile (gl, or gb) [BM][32] 16-bit
  static constexpr int kWBytes = BR * BK;                  // fp8 tile [32][128 bytes]
  static constexpr int kStageBytes = (DROP ? 2 : 1) * kGBytes + kWBytes;
  static constexpr int kLoraBytes = cmax(BM * kRankChunk * 2 + kRankChunk * BK * 2,          // 16-bit v, A chunks
                                         (BM * kRankPitchF + kRankChunk * BK) * 4);         // fp32 v, A chunks
  static constexpr int kSmem = cmax(kStages * kStageBytes, kLoraBytes);
  static_assert(kStageBytes % 16 == 0 && (BM * kRankPitchF * 4) % 16 == 0, "tiles must stay 16-byte aligned");
};

template <typename T, int BM, int BK_, bool DROP>  // two blocks per SM, as forward
__global__ void __launch_bounds__(kThreads, 2) dgrad_mma_kernel(const DgradParams p, bool vec_g, bool vec_w) {
  using Cfg = DgradCfg<BM, BK_, DROP>;
  constexpr int BK = Cfg::BK, BR = Cfg::BR, WM = Cfg::WM, MT = Cfg::MT, NT = Cfg::NT;
  DORA_SMEM(smem);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm0 = static_cast<int>(static_cast<unsigned>(warp) / Cfg::WARPS_K) * WM;  // unsigned: see forward
  const int wk0 = static_cast<int>(static_cast<unsigned>(warp) % Cfg::WARPS_K) * 32;
  const int g = lane >> 2, t = lane & 3;
  const int64_t M = p.M, N = p.N, K = p.K;
  int64_t bm, bk;
  grouped_tile(blockIdx.x, static_cast<uint32_t>((M + BM - 1) / BM), static_cast<uint32_t>((K + BK - 1) / BK),
               p.group_m, bm, bk);
  const int64_t m0 = bm * BM, k0 = bk * BK;
  const uint16_t* __restrict__ gl = static_cast<const uint16_t*>(p.gl);
  const uint16_t* __restrict__ gb = static_cast<const uint16_t*>(p.gb);

  // acc: gl W8 (the adapter term); acc2: gb W8 (dropout's plain base term). Both share every converted W8 fragment.
  float acc[MT][NT][4], acc2[DROP ? MT : 1][NT][4];
  zero(acc);
  if (DROP) zero(acc2);

  auto stage_ptr = [&](int s) { return smem + s * Cfg::kStageBytes; };
  auto load_stage = [&](int s, int rt) {
    uint8_t* base = stage_ptr(s);
    const int64_t r0 = static_cast<int64_t>(rt) * BR;
    load_tile32<BM, kSwzLdsm>(base, gl, p.ldgl, M, N, m0, r0, vec_g, tid);
    if (DROP) load_tile32<BM, kSwzLdsm>(base + Cfg::kGBytes, gb, p.ldgb, M, N, m0, r0, vec_g, tid);
    // fp8 tile [32 rows of N][BK bytes of K]: 16-byte pieces, BR * BK / 16 / 256 per thread, chunk ^ (row & 7)
    // for ldmatrix.trans (conflict-free: 8 consecutive rows hit 8 distinct chunks of one 128-byte window).
    static_assert((BR * BK / 16) % kThreads == 0, "dgrad: whole 16-byte fp8 pieces per thread");
    uint8_t* sw = base + (DROP ? 2 : 1) * Cfg::kGBytes;
#pragma unroll
    for (int it = 0; it < BR * BK / 16 / kThreads; ++it) {
      const int e = tid + it * kThreads, row = e / (BK / 16), ch = e % (BK / 16);
      const int64_t gn = r0 + row, gk = k0 + ch * 16;
      uint8_t* dst = sw + row * BK + ((ch ^ (row & 7)) << 4);
      const int valid = gn < N ? static_cast<int>(clamp_valid(K - gk, 16)) : 0;
      if (vec_w) {
        cp_async_16(dst, valid > 0 ? static_cast<const void*>(p.w8 + gn * K + gk) : static_cast<const void*>(p.w8),
                    valid);
      } else {
        uint8_t b[16];
#pragma unroll
        for (int q = 0; q < 16; ++q) b[q] = q < valid ? p.w8[gn * K + gk + q] : uint8_t(0);
        sst<uint4>(dst, bits_as<uint4>(b));
      }
    }
  };
  auto compute_stage = [&](int s) {
    const uint8_t* sg = stage_ptr(s);
    const uint8_t* sw = sg + (DROP ? 2 : 1) * Cfg::kGBytes;
#pragma unroll
    for (int kk = 0; kk < BR / 16; ++kk) {
      // B: ldmatrix.x4.trans of rows kk*16 + {0..7, 8..15} x the warp's two 16-byte column groups. Lane (g, t) gets
      // bytes {w[2t][2g], w[2t][2g+1], w[2t+1][2g], w[2t+1][2g+1]}; byte_perm 0x3120 makes (w[2t][2g], w[2t+1][2g])
      // the low half (output column 2g: the even n8 tile) and the odd column's pair the high half. The converted
      // fragments are used as they are: nothing per row of W8 (column of gl) is folded into any operand.
      uint32_t bfr[NT][2];
      {
        uint32_t d[4];
        const int i = lane >> 3, row = kk * 16 + 8 * (i & 1) + (lane & 7), ch = (wk0 >> 4) + (i >> 1);
        ldsm_x4_trans(d, sw + row * BK + ((ch ^ (row & 7)) << 4));
#pragma unroll
        for (int c2 = 0; c2 < 2; ++c2) {
          const uint32_t lo = byte_perm(d[2 * c2], 0x3120u), hi = byte_perm(d[2 * c2 + 1], 0x3120u);
          bfr[2 * c2][0] = e4m3x2_to<T>(lo & 0xffffu);
          bfr[2 * c2][1] = e4m3x2_to<T>(hi & 0xffffu);
          bfr[2 * c2 + 1][0] = e4m3x2_to<T>(lo >> 16);
          bfr[2 * c2 + 1][1] = e4m3x2_to<T>(hi >> 16);
        }
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        uint32_t afr[4];
        frag_a_ldsm(afr, sg, wm0 + mt * 16, kk, lane);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma16816<T>(acc[mt][nt], afr, bfr[nt]);
        if (DROP) {
          frag_a_ldsm(afr, sg + Cfg::kGBytes, wm0 + mt * 16, kk, lane);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) mma16816<T>(acc2[DROP ? mt : 0][nt], afr, bfr[nt]);
        }
      }
    }
  };

  // ---- main loop over the reduction (N)
  const int RT = static_cast<int>((N + BR - 1) / BR);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < RT) load_stage(s, s);
    cp_async_commit();
  }
  for (int rt = 0; rt < RT; ++rt) {
    cp_async_wait<kStages - 2>();
    block_sync();
    const int nr = rt + kStages - 1;
    if (nr < RT) load_stage(nr % kStages, nr);
    cp_async_commit();
    compute_stage(rt % kStages);
  }
  cp_async_wait<0>();

  // ---- epilogue: acc = rl st (gl W8) / s, then s v A accumulated into it (times s at the store)
  const float st = p.scale_per_row ? 1.f : p.scale[0];  // per-row scales are already in gl, gb
  const bool lora = p.v != nullptr && p.s != 0.f && p.r > 0;
  const float al = p.rl[0] * st;
  const float pre = lora ? div_rn(al, p.s) : al;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] *= pre;
  if (lora && p.rank_f32) {
    // fp32 v, A: FMA on the lane's own accumulator positions (rows g, g + 8; columns 16 c2 + 4t + e).
    const float* __restrict__ v = static_cast<const float*>(p.v);
    const float* __restrict__ Am = static_cast<const float*>(p.A);
    float* sv = reinterpret_cast<float*>(smem);       // [BM][kRankPitchF] v chunk
    float* sa = sv + BM * kRankPitchF;                // [32][BK] A chunk
    for (int q0 = 0; q0 < p.r; q0 += kRankChunk) {
      block_sync();
      load_tile_f32<BM, kRankChunk, kRankPitchF>(sv, v, p.r, M, p.r, m0, q0, tid);
      load_tile_f32<kRankChunk, BK, BK>(sa, Am, K, p.r, K, q0, k0, tid);
      block_sync();
#pragma unroll 4
      for (int q = 0; q < kRankChunk; ++q) {
        float va[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h) va[mt][h] = sld<float>(sv + (wm0 + mt * 16 + g + 8 * h) * kRankPitchF + q);
        float av[2][4];
#pragma unroll
        for (int c2 = 0; c2 < 2; ++c2) {
          const float4 a4 = sld<float4>(sa + q * BK + wk0 + 16 * c2 + 4 * t);
          av[c2][0] = a4.x;
          av[c2][1] = a4.y;
          av[c2][2] = a4.z;
          av[c2][3] = a4.w;
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int el = 0; el < 4; ++el)  // column 16 (nt >> 1) + 4t + e with e = (nt & 1) + 2 (el & 1)
              acc[mt][nt][el] = fmaf(va[mt][el >> 1], av[nt >> 1][(nt & 1) | ((el & 1) << 1)], acc[mt][nt][el]);
      }
    }
  } else if (lora) {
    const uint16_t* __restrict__ v = static_cast<const uint16_t*>(p.v);
    const uint16_t* __restrict__ Am = static_cast<const uint16_t*>(p.A);
    uint8_t* sv = smem;                         // [BM][32] v chunk
    uint8_t* sa = smem + BM * kRankChunk * 2;   // [32][BK] A chunk, 2 BK-byte rows, columns interleaved
    for (int q0 = 0; q0 < p.r; q0 += kRankChunk) {
      block_sync();
      load_tile32_scalar<BM, kSwzLdsm>(sv, v, p.r, M, p.r, m0, q0, tid);
      // Column 16c + 2j + h of the tile goes to position 16c + 8h + j, so that ldmatrix.trans of positions
      // 16c..16c+7 (16c+8..16c+15) gives the even (odd) n8 tile, matching the accumulators' column order.
#pragma unroll 4
      for (int it = 0; it < kRankChunk * BK / kThreads; ++it) {
        const int e = tid + it * kThreads, q = e / BK, col = e % BK;
        const int64_t gq = q0 + q, gk = k0 + col;
        const uint16_t val = (gq < p.r && gk < K) ? Am[gq * K + gk] : uint16_t(0);
        const int pos = (col & ~15) + ((col & 1) << 3) + ((col & 15) >> 1);
        sst<uint16_t>(sa + q * (BK * 2) + (((pos >> 3) ^ (q & 7)) << 4) + (pos & 7) * 2, val);
      }
      block_sync();
#pragma unroll
      for (int kk = 0; kk < kRankChunk / 16; ++kk) {
        uint32_t bfr[NT][2];
#pragma unroll
        for (int c2 = 0; c2 < 2; ++c2) {
          uint32_t d[4];
          const int i = lane >> 3, row = kk * 16 + 8 * (i & 1) + (lane & 7);
          const int chunk = 2 * ((wk0 >> 4) + c2) + (i >> 1);
          ldsm_x4_trans(d, sa + row * (BK * 2) + ((chunk ^ (row & 7)) << 4));
          bfr[2 * c2][0] = d[0];
          bfr[2 * c2][1] = d[1];
          bfr[2 * c2 + 1][0] = d[2];
          bfr[2 * c2 + 1][1] = d[3];
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          uint32_t afr[4];
          frag_a_ldsm(afr, sv, wm0 + mt * 16, kk, lane);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) mma16816<T>(acc[mt][nt], afr, bfr[nt]);
        }
      }
    }
  }

  // ---- store: lane (g, t) holds rows g, g + 8 x columns 16c + 4t .. 16c + 4t + 3 of each 16-column group c
  const float post = lora ? p.s : 1.f;
  const float ab = DROP ? p.rb[0] * st : 0.f;  // gb's factor
  T* __restrict__ dx = static_cast<T*>(p.dx);
  const bool quad_ok = (K & 3) == 0 && reinterpret_cast<uintptr_t>(dx) % 8 == 0;  // 8-byte aligned stores of 4
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t i = m0 + wm0 + mt * 16 + g + 8 * h;
      if (i >= M) continue;
#pragma unroll
      for (int c2 = 0; c2 < 2; ++c2) {
        const int64_t col = k0 + wk0 + 16 * c2 + 4 * t;
        if (col >= K) continue;
        float out[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {  // e: column col + e = (even, odd, even, odd) tile, element (2h, 2h, 2h+1, 2h+1)
          const int nt = 2 * c2 + (e & 1), el = 2 * h + (e >> 1);
          if (!DROP) {
            out[e] = post * acc[mt][nt][el];
          } else {  // rb st (gb W8) + mask / (1 - p) * (rl st (gl W8) + s v A)
            const float base = ab * acc2[DROP ? mt : 0][nt][el];
            const bool keep = col + e < K && p.mask[i * p.ldmask + col + e] != 0;
            out[e] = keep ? fmaf(p.inv_keep * post, acc[mt][nt][el], base) : base;
          }
        }
        T* o = dx + i * K + col;
        if (quad_ok && col + 3 < K) {
          store_pair<T>(o, out[0], out[1]);
          store_pair<T>(o + 2, out[2], out[3]);
        } else {
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (col + e < K) o[e] = from_f32<T>(out[e]);
        }
      }
    }
}

// ================================================================================================ fp32 (SIMT)

constexpr int kSimtTile = 64;   // outputs per block: 64 x 64, 4 x 4 per thread (rows ty + 16i, columns tx + 16j)
constexpr int kSimtR = 16;      // reduction per step
constexpr int kSimtPitch = 65;  // sA[k][row] pitch: the transposed stores hit distinct banks
constexpr int simt_smem(int na) { return (na * kSimtR * kSimtPitch + kSimtR * kSimtTile) * 4; }

// acc[A0 + a][i][j] += sum_k  load_a(row i, k)[a] * load_b(k, column j)  for k in [0, kred), a < NA.
// load_a(row, k, float* out) and load_b(k, col) return 0 outside the matrices. b_red_contig: B's global layout is
// contiguous along the reduction (choose the thread mapping that coalesces).
template <int A0, int NA, int NACC, class LoadA, class LoadB>
__device__ __forceinline__ void simt_gemm(float (&acc)[NACC][4][4], int64_t kred, bool b_red_contig, LoadA load_a,
                                          LoadB load_b, float* sA, float* sB, int tid) {
  const int tx = tid & 15, ty = tid >> 4;
  for (int64_t k0 = 0; k0 < kred; k0 += kSimtR) {
    block_sync();
#pragma unroll
    for (int it = 0; it < kSimtTile * kSimtR / kThreads; ++it) {
      const int e = tid + it * kThreads, row = e >> 4, kk = e & 15;
      float v[NA];
      load_a(row, k0 + kk, v);
#pragma unroll
      for (int a = 0; a < NA; ++a) sst<float>(sA + (a * kSimtR + kk) * kSimtPitch + row, v[a]);
    }
#pragma unroll
    for (int it = 0; it < kSimtTile * kSimtR / kThreads; ++it) {
      const int e = tid + it * kThreads;
      const int kk = b_red_contig ? (e & 15) : (e >> 6), col = b_red_contig ? (e >> 4) : (e & 63);
      sst<float>(sB + kk * kSimtTile + col, load_b(k0 + kk, col));
    }
    block_sync();
#pragma unroll 4
    for (int kk = 0; kk < kSimtR; ++kk) {
      float b[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) b[j] = sld<float>(sB + kk * kSimtTile + tx + 16 * j);
#pragma unroll
      for (int a = 0; a < NA; ++a)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float av = sld<float>(sA + (a * kSimtR + kk) * kSimtPitch + ty + 16 * i);
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[A0 + a][i][j] = fmaf(av, b[j], acc[A0 + a][i][j]);
        }
    }
  }
}

__device__ __forceinline__ float e4m3_to_f32(uint8_t b) { return e4m3x2_to_f32x2(b).x; }

template <bool DROP>
__global__ void __launch_bounds__(kThreads) forward_simt_kernel(const ForwardParams p) {
  constexpr int NA = DROP ? 2 : 1;
  DORA_SMEM(smem);
  float* sA = reinterpret_cast<float*>(smem);
  float* sB = sA + NA * kSimtR * kSimtPitch;
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
  const int64_t M = p.M, N = p.N, K = p.K;
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * kSimtTile, n0 = static_cast<int64_t>(blockIdx.y) * kSimtTile;
  const float* __restrict__ x = static_cast<const float*>(p.x);
  const float* __restrict__ xm = static_cast<const float*>(p.xm);

  float acc[NA][4][4];
  zero(acc);

  simt_gemm<0, NA>(
      acc, K, true,
      [&](int row, int64_t k, float* v) {
        const int64_t i = m0 + row;
        const bool ok = i < M && k < K;
        v[0] = ok ? x[i * p.ldx + k] : 0.f;
        if (DROP) v[NA - 1] = ok ? xm[i * p.ldxm + k] : 0.f;
      },
      [&](int64_t k, int col) {
        const int64_t j = n0 + col;
        return (j < N && k < K) ? e4m3_to_f32(p.w8[j * K + k]) : 0.f;
      },
      sA, sB, tid);

  const bool dora = p.c != nullptr;
  const bool lora = dora && p.s != 0.f && p.r > 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int64_t jj = n0 + tx + 16 * j;
    const float sig = jj < N ? p.scale[p.scale_per_row ? jj : 0] : 0.f;
    const float pre = lora ? div_rn(sig, p.s) : sig;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (!DROP) {
        acc[0][i][j] *= pre;
      } else {
        acc[0][i][j] = sig * fmaf(-p.inv_keep, acc[NA - 1][i][j], acc[0][i][j]);  // as forward_mma_kernel
        acc[NA - 1][i][j] *= pre * p.inv_keep;
      }
    }
  }
  if (lora) {
    const float* __restrict__ u = static_cast<const float*>(p.u);
    const float* __restrict__ Bm = static_cast<const float*>(p.B);
    const int r = p.r;
    simt_gemm<NA - 1, 1>(
        acc, r, true,
        [&](int row, int64_t q, float* v) {
          const int64_t i = m0 + row;
          v[0] = (i < M && q < r) ? u[i * r + q] : 0.f;
        },
        [&](int64_t q, int col) {
          const int64_t j = n0 + col;
          return (j < N && q < r) ? Bm[j * r + q] : 0.f;
        },
        sA, sB, tid);
  }

  const FwdEpilogue epi{dora, DROP, lora ? p.s : 1.f};
  float* __restrict__ y = static_cast<float*>(p.y);
  float* __restrict__ z = static_cast<float*>(p.z);
  const float* __restrict__ bias = static_cast<const float*>(p.bias);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t ii = m0 + ty + 16 * i;
    if (ii >= M) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t jj = n0 + tx + 16 * j;
      if (jj >= N) continue;
      float yv, zv;
      epi(acc[0][i][j], acc[NA - 1][i][j], dora ? p.c[jj] : 1.f, bias != nullptr ? bias[jj] : 0.f, yv, zv);
      y[ii * N + jj] = yv;
      if (z != nullptr) z[ii * N + jj] = zv;
    }
  }
}

template <bool DROP>
__global__ void __launch_bounds__(kThreads) dgrad_simt_kernel(const DgradParams p) {
  constexpr int NA = DROP ? 2 : 1;  // acc[0]: gl W8 (the adapter term); acc[1]: gb W8 (dropout's base term)
  DORA_SMEM(smem);
  float* sA = reinterpret_cast<float*>(smem);
  float* sB = sA + NA * kSimtR * kSimtPitch;
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
  const int64_t M = p.M, N = p.N, K = p.K;
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * kSimtTile, k0 = static_cast<int64_t>(blockIdx.y) * kSimtTile;
  const float* __restrict__ gl = static_cast<const float*>(p.gl);
  const float* __restrict__ gb = static_cast<const float*>(p.gb);

  float acc[NA][4][4];
  zero(acc);

  simt_gemm<0, NA>(
      acc, N, false,
      [&](int row, int64_t n, float* v) {
        const int64_t i = m0 + row;
        const bool ok = i < M && n < N;
        v[0] = ok ? gl[i * p.ldgl + n] : 0.f;
        if (DROP) v[NA - 1] = ok ? gb[i * p.ldgb + n] : 0.f;
      },
      [&](int64_t n, int col) {
        const int64_t k = k0 + col;
        return (n < N && k < K) ? e4m3_to_f32(p.w8[n * K + k]) : 0.f;
      },
      sA, sB, tid);

  const float st = p.scale_per_row ? 1.f : p.scale[0];
  const bool lora = p.v != nullptr && p.s != 0.f && p.r > 0;
  const float al = p.rl[0] * st;
  const float pre = lora ? div_rn(al, p.s) : al;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[0][i][j] *= pre;
  if (lora) {
    const float* __restrict__ v = static_cast<const float*>(p.v);
    const float* __restrict__ Am = static_cast<const float*>(p.A);
    const int r = p.r;
    simt_gemm<0, 1>(
        acc, r, false,
        [&](int row, int64_t q, float* out) {
          const int64_t i = m0 + row;
          out[0] = (i < M && q < r) ? v[i * r + q] : 0.f;
        },
        [&](int64_t q, int col) {
          const int64_t k = k0 + col;
          return (q < r && k < K) ? Am[q * K + k] : 0.f;
        },
        sA, sB, tid);
  }

  const float post = lora ? p.s : 1.f;
  const float ab = DROP ? p.rb[0] * st : 0.f;
  float* __restrict__ dx = static_cast<float*>(p.dx);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t ii = m0 + ty + 16 * i;
    if (ii >= M) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t kk = k0 + tx + 16 * j;
      if (kk >= K) continue;
      float out = post * acc[0][i][j];
      if (DROP) {
        const float base = ab * acc[NA - 1][i][j];
        out = p.mask[ii * p.ldmask + kk] != 0 ? fmaf(p.inv_keep * post, acc[0][i][j], base) : base;
      }
      dx[ii * K + kk] = out;
    }
  }
}

// ================================================================================================ launchers

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

template <typename Kern, typename... Args>
cudaError_t launch(Kern kernel, int64_t grid_x, int64_t grid_y, int smem, cudaStream_t stream, Args... args) {
  if (grid_x <= 0 || grid_y <= 0) return cudaSuccess;
  if (grid_x > 0x7fffffff || grid_y > 65535) return cudaErrorInvalidValue;  // shape too large for one launch
  const cudaError_t err = allow_smem(kernel, smem);
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y));
  DORA_LAUNCH(kernel, grid, dim3(kThreads), smem, stream, args...);
  return cudaGetLastError();
}

template <typename TA>
cudaError_t launch_weight_norm(const WeightNormParams& p, cudaStream_t stream) {
  const int64_t k_tiles = ceil_div(p.K, kWnBK) > 0 ? ceil_div(p.K, kWnBK) : 1;
  const int splits = p.splits > 0 ? p.splits : 1;
  const int tiles_per_split = static_cast<int>(ceil_div(k_tiles, splits));
  const bool vec_w = p.K % 16 == 0 && aligned16(p.w8);
  WeightNormParams q = p;
  q.splits = splits;  // the kernel writes n itself when there is one split
  cudaError_t err = launch(weight_norm_kernel<TA>, ceil_div(p.N, kWnRows), splits, kWnSmem, stream, q, vec_w,
                           tiles_per_split);
  if (err != cudaSuccess || splits == 1) return err;
  return launch(weight_norm_finalize_kernel, ceil_div(p.N, kThreads), 1, 0, stream,
                static_cast<const float*>(p.partial), p.n, p.N, splits);
}

template <typename T, int BM, int BN, bool DROP>
cudaError_t launch_forward_mma(const ForwardParams& p, cudaStream_t stream) {
  using Cfg = FwdCfg<BM, BN, DROP>;
  const bool vec_w = p.K % 16 == 0 && aligned16(p.w8);
  const bool vec_x = p.ldx % 8 == 0 && aligned16(p.x) && (!DROP || (p.ldxm % 8 == 0 && aligned16(p.xm)));
  return launch(forward_mma_kernel<T, BM, BN, DROP>, ceil_div(p.M, BM) * ceil_div(p.N, BN), 1, Cfg::kSmem, stream,
                p, vec_x, vec_w);
}

template <typename T>
cudaError_t launch_forward(const ForwardParams& p, cudaStream_t stream) {
  // Up to 64 rows: 64 x 128 tiles (2 x 4 warps), twice as many column-blocks to spread W8's read over the SMs.
  // More rows: 64 x 256 (no dropout) and 32 x 256 (dropout, two accumulators) with 1 x 8 warps: the same warp tile,
  // bytes per stage and mma count as 128 x 128 (64 x 128) with 2 x 4 warps, each W8 fragment converted once.
  if (p.M <= 64) {
    return p.xm != nullptr ? launch_forward_mma<T, 64, 128, true>(p, stream)
                           : launch_forward_mma<T, 64, 128, false>(p, stream);
  }
  return p.xm != nullptr ? launch_forward_mma<T, 32, 256, true>(p, stream)
                         : launch_forward_mma<T, 64, 256, false>(p, stream);
}

template <typename T, int BM, int BK, bool DROP>
cudaError_t launch_dgrad_mma(const DgradParams& p, cudaStream_t stream) {
  using Cfg = DgradCfg<BM, BK, DROP>;
  const bool vec_w = p.K % 16 == 0 && aligned16(p.w8);
  const bool vec_g = p.ldgl % 8 == 0 && aligned16(p.gl) && (!DROP || (p.ldgb % 8 == 0 && aligned16(p.gb)));
  return launch(dgrad_mma_kernel<T, BM, BK, DROP>, ceil_div(p.M, BM) * ceil_div(p.K, BK), 1, Cfg::kSmem, stream, p,
                vec_g, vec_w);
}

template <typename T>
cudaError_t launch_dgrad(const DgradParams& p, cudaStream_t stream) {
  // Tiles as in launch_forward: 64 x 128 (2 x 4 warps) up to 64 rows, else 64 x 256 / 32 x 256 (1 x 8 warps).
  if (p.M <= 64) {
    return p.mask != nullptr ? launch_dgrad_mma<T, 64, 128, true>(p, stream)
                             : launch_dgrad_mma<T, 64, 128, false>(p, stream);
  }
  return p.mask != nullptr ? launch_dgrad_mma<T, 32, 256, true>(p, stream)
                           : launch_dgrad_mma<T, 64, 256, false>(p, stream);
}

}  // namespace detail

// ------------------------------------------------------------------------------------------------ public interface

int weight_norm_splits(int64_t N, int64_t K) {
  int dev = 0, sms = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
      sms <= 0) {
    cudaGetLastError();
    sms = 108;
  }
  const int64_t row_blocks = detail::ceil_div(N > 0 ? N : 1, detail::kWnRows);
  const int64_t k_tiles = K > 0 ? detail::ceil_div(K, detail::kWnBK) : 1;
  int64_t splits = detail::ceil_div(4LL * sms, row_blocks);  // about 4 blocks per SM in flight
  if (splits > k_tiles) splits = k_tiles;
  if (splits > 65535) splits = 65535;
  if (splits < 1) splits = 1;
  const int64_t per = detail::ceil_div(k_tiles, splits);  // no split without K tiles
  return static_cast<int>(detail::ceil_div(k_tiles, per));
}

cudaError_t weight_norm(const WeightNormParams& p, cudaStream_t stream) {
  if (p.N <= 0) return cudaSuccess;
  switch (p.adapter_dtype) {
    case DType::kFloat32: return detail::launch_weight_norm<float>(p, stream);
    case DType::kBFloat16: return detail::launch_weight_norm<detail::bf16>(p, stream);
    case DType::kFloat16: return detail::launch_weight_norm<detail::f16>(p, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t forward(const ForwardParams& p, DType dtype, cudaStream_t stream) {
  if (p.M <= 0 || p.N <= 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32:
      return p.xm != nullptr
                 ? detail::launch(detail::forward_simt_kernel<true>, detail::ceil_div(p.M, detail::kSimtTile),
                                  detail::ceil_div(p.N, detail::kSimtTile), detail::simt_smem(2), stream, p)
                 : detail::launch(detail::forward_simt_kernel<false>, detail::ceil_div(p.M, detail::kSimtTile),
                                  detail::ceil_div(p.N, detail::kSimtTile), detail::simt_smem(1), stream, p);
    case DType::kBFloat16: return detail::launch_forward<detail::bf16>(p, stream);
    case DType::kFloat16: return detail::launch_forward<detail::f16>(p, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t dgrad(const DgradParams& p, DType dtype, cudaStream_t stream) {
  if (p.M <= 0 || p.K <= 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32:
      return p.mask != nullptr
                 ? detail::launch(detail::dgrad_simt_kernel<true>, detail::ceil_div(p.M, detail::kSimtTile),
                                  detail::ceil_div(p.K, detail::kSimtTile), detail::simt_smem(2), stream, p)
                 : detail::launch(detail::dgrad_simt_kernel<false>, detail::ceil_div(p.M, detail::kSimtTile),
                                  detail::ceil_div(p.K, detail::kSimtTile), detail::simt_smem(1), stream, p);
    case DType::kBFloat16: return detail::launch_dgrad<detail::bf16>(p, stream);
    case DType::kFloat16: return detail::launch_dgrad<detail::f16>(p, stream);
  }
  return cudaErrorInvalidValue;
}

const char* kernel_image_error() {
  cudaFuncAttributes attr;
  const cudaError_t err =
      cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(detail::weight_norm_finalize_kernel));
  if (err == cudaSuccess) return "";
  cudaGetLastError();  // clear it
  return cudaGetErrorString(err);
}

}  // namespace dorafp8
