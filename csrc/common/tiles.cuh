// Shared device code of the dorafp8 kernels, part 3: the constants every kernel shares, the grouped launch order,
// and the shared-memory tiles of the tensor-core GEMM of forward.cu and dgrad.cu (its main loop: common/gemm.cuh):
// loaders, swizzles, mma fragments. Why these tile shapes: docs/ARCHITECTURE.md ("csrc/").
// Edges: any M, N, K, r; nothing is read out of bounds (rows/columns past the edge are zero-filled, cp.async with a
// source size of 0 reads nothing); 16-byte copies only where K, strides and alignment allow. Offsets are int64.
#pragma once

#include "convert.cuh"

namespace dorafp8 {
namespace detail {

// ------------------------------------------------------------------------------------------------ constants

constexpr int kThreads = 256;  // 8 warps in every kernel
constexpr int kStages = 4;     // cp.async pipeline depth of the tensor-core GEMMs
constexpr int kRankChunk = 32; // rank-r epilogues run over r in chunks of 32 (zero padded)
constexpr int kRankPitchF = kRankChunk + 1;  // fp32 rank tiles [rows][33]: column reads of 8 rows hit 8 banks
constexpr int cmax(int a, int b) { return a > b ? a : b; }
constexpr int kGroupM = 8;     // row-blocks per group of the grouped launch order (grouped_tile)

// The tile (bm, bn) of linear block `pid` of a tiles_m x tiles_n grid in grouped order: `group` consecutive
// row-blocks sweep the column-blocks together (row-blocks fastest), so activation rows and W8 tiles are re-read from
// L2, not DRAM. 32-bit on purpose: a 64-bit division is a call with spills. group: p.group_m (tests) or kGroupM when
// 0, clamped to tiles_m so group * tiles_n fits 32 bits.
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

__device__ __forceinline__ int64_t clamp_valid(int64_t remaining, int64_t width) {
  return remaining <= 0 ? 0 : (remaining < width ? remaining : width);
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

// One 16-byte piece of the fp8 weight W8 [N, K] (row gn, bytes gk .. gk + 15) into dst, zeros past the edges. vec:
// cp.async (needs K % 16 == 0 and a 16-byte aligned base), else byte by byte. forward and dgrad tile W8 differently
// (which of its dims is the reduction) and pick dst by their own swizzle; the copy itself is this one.
__device__ __forceinline__ void load_w8_piece(uint8_t* dst, const uint8_t* w8, int64_t N, int64_t K, int64_t gn,
                                              int64_t gk, bool vec) {
  const int valid = gn < N ? static_cast<int>(clamp_valid(K - gk, 16)) : 0;
  if (vec) {
    cp_async_16(dst, valid > 0 ? static_cast<const void*>(w8 + gn * K + gk) : static_cast<const void*>(w8), valid);
  } else {
    uint8_t b[16];
#pragma unroll
    for (int q = 0; q < 16; ++q) b[q] = q < valid ? w8[gn * K + gk + q] : uint8_t(0);
    sst<uint4>(dst, bits_as<uint4>(b));
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

// The A fragment of a tile by its swizzle, which also fixes the k order (kSwzPairs: permuted, kSwzLdsm: natural).
template <int SWZ>
__device__ __forceinline__ void frag_a(uint32_t (&a)[4], const uint8_t* tile, int row0, int kk, int lane) {
  if constexpr (SWZ == kSwzPairs) frag_a_pairs(a, tile, row0, kk, lane);
  else frag_a_ldsm(a, tile, row0, kk, lane);
}

}  // namespace detail
}  // namespace dorafp8
