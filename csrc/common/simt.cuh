// Shared device code of the dorafp8 kernels, part 4: the fp32 compute dtype's plain SIMT GEMM loop (64 x 64 tiles,
// 4 x 4 per thread, FMA, no tf32), shared by forward_simt_kernel and dgrad_simt_kernel, which differ only in which dim
// of W8 is the reduction and in their epilogues.
#pragma once

#include "tiles.cuh"

namespace dorafp8 {
namespace detail {

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

// acc[0] (and acc[1] with NA == 2) += act (and act2) [rows m0 .. m0 + 64, reduction] x W8 for the output columns
// c0 .. c0 + 64. W8 [N, K]: RED_CONTIG (forward), its rows are the output columns and the reduction is K; else
// (dgrad) its rows are the reduction, N, and the output columns are K. act, act2: row-major fp32, row strides ld, ld2.
template <bool RED_CONTIG, int NA>
__device__ __forceinline__ void simt_w8_gemm(float (&acc)[NA][4][4], const float* __restrict__ act, int64_t ld,
                                             const float* __restrict__ act2, int64_t ld2, const uint8_t* w8,
                                             int64_t M, int64_t N, int64_t K, int64_t m0, int64_t c0, float* sA,
                                             float* sB, int tid) {
  const int64_t red = RED_CONTIG ? K : N, cols = RED_CONTIG ? N : K;
  simt_gemm<0, NA>(
      acc, red, RED_CONTIG,
      [&](int row, int64_t k, float* v) {
        const int64_t i = m0 + row;
        const bool ok = i < M && k < red;
        v[0] = ok ? act[i * ld + k] : 0.f;
        if (NA == 2) v[NA - 1] = ok ? act2[i * ld2 + k] : 0.f;
      },
      [&](int64_t k, int col) {
        const int64_t j = c0 + col;
        return (j < cols && k < red) ? e4m3_to_f32(w8[RED_CONTIG ? j * K + k : k * K + j]) : 0.f;
      },
      sA, sB, tid);
}

// acc[A] += left [rows m0 .. m0 + 64, r] x right for the output columns c0 .. c0 + 64 (the rank-r term). left:
// [M, r] contiguous; right: RED_CONTIG (forward's B) [cols, r], else (dgrad's A) [r, cols], contiguous.
template <int A, bool RED_CONTIG, int NACC>
__device__ __forceinline__ void simt_rank_gemm(float (&acc)[NACC][4][4], const float* __restrict__ left,
                                               const float* __restrict__ right, int r, int64_t M, int64_t cols,
                                               int64_t m0, int64_t c0, float* sA, float* sB, int tid) {
  simt_gemm<A, 1>(
      acc, r, RED_CONTIG,
      [&](int row, int64_t q, float* v) {
        const int64_t i = m0 + row;
        v[0] = (i < M && q < r) ? left[i * r + q] : 0.f;
      },
      [&](int64_t q, int col) {
        const int64_t j = c0 + col;
        return (j < cols && q < r) ? right[RED_CONTIG ? j * r + q : q * cols + j] : 0.f;
      },
      sA, sB, tid);
}

}  // namespace detail
}  // namespace dorafp8
