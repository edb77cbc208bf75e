// Shared device code of the dorafp8 kernels, part 4: the fp32 compute dtype's GEMM loop. fp32 runs a plain SIMT
// path (64 x 64 tiles, 4 x 4 per thread, FMA), fp32-accurate, no tf32; forward_simt_kernel (forward.cu) and
// dgrad_simt_kernel (dgrad.cu) differ only in their operands and epilogues, which they pass to simt_gemm.
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

}  // namespace detail
}  // namespace dorafp8
