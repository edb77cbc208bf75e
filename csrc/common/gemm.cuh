// Shared code of the dorafp8 kernels, part 5: the launch of forward.cu and dgrad.cu. forward (x W8^T) and dgrad
// (gl W8) are one GEMM, acc[rows of M, output columns] = act x W8, that differs only in which dim of W8 [N, K] is the
// reduction: K in forward, N in dgrad. Their entry points are the same too:
//
//   launch_gemm       the dtype switch (fp32: the SIMT kernel, common/simt.cuh), the tile shape for M and dropout
//                     (launch_gemm_tiles), the launch (launch_gemm_mma), from each file's family struct.
#pragma once

#include "dora_fp8.h"  // DType (csrc/ is on the include path)
#include "launch.cuh"
#include "simt.cuh"
#include "tiles.cuh"

namespace dorafp8 {
namespace detail {

// ------------------------------------------------------------------------------------------------ host side

// The launch of forward or dgrad, from the kernel file's family G:
//   G::Params, G::Cfg<BM, BN, DROP>     the params struct and the tensor-core kernel's config (its kSmem);
//   G::mma_kernel<T, BM, BN, DROP>()    the tensor-core kernel, called (params, vec_act, vec_w);
//   G::simt_kernel<DROP>()              the fp32 SIMT kernel, called (params) on a 2-D grid of kSimtTile tiles;
//   G::cols(p), G::dropout(p)           the output columns (forward: N, dgrad: K), whether dropout runs;
//   G::act(p, i), G::ld(p, i)           activation operand i (0, and 1 with dropout) and its row stride.
template <class G, typename T, int BM, int BN, bool DROP>
cudaError_t launch_gemm_mma(const typename G::Params& p, cudaStream_t stream) {
  using Cfg = typename G::template Cfg<BM, BN, DROP>;
  const bool vec_w = p.K % 16 == 0 && aligned16(p.w8);
  const bool vec_act = G::ld(p, 0) % 8 == 0 && aligned16(G::act(p, 0)) &&
                       (!DROP || (G::ld(p, 1) % 8 == 0 && aligned16(G::act(p, 1))));
  return launch(G::template mma_kernel<T, BM, BN, DROP>(), ceil_div(p.M, BM) * ceil_div(G::cols(p), BN), 1,
                Cfg::kSmem, stream, p, vec_act, vec_w);
}

// Up to 64 rows: 64 x 128 tiles (2 x 4 warps), twice as many column-blocks to spread W8's read over the SMs. More
// rows: 64 x 256 (no dropout) and 32 x 256 (dropout, two accumulators) with 1 x 8 warps: the same warp tile, bytes per
// stage and mma count as 128 x 128 (64 x 128) with 2 x 4 warps, each W8 fragment converted once.
template <class G, typename T>
cudaError_t launch_gemm_tiles(const typename G::Params& p, cudaStream_t stream) {
  const bool drop = G::dropout(p);
  if (p.M <= 64) {
    return drop ? launch_gemm_mma<G, T, 64, 128, true>(p, stream) : launch_gemm_mma<G, T, 64, 128, false>(p, stream);
  }
  return drop ? launch_gemm_mma<G, T, 32, 256, true>(p, stream) : launch_gemm_mma<G, T, 64, 256, false>(p, stream);
}

template <class G>
cudaError_t launch_gemm(const typename G::Params& p, DType dtype, cudaStream_t stream) {
  if (p.M <= 0 || G::cols(p) <= 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32: {
      const int64_t gm = ceil_div(p.M, kSimtTile), gc = ceil_div(G::cols(p), kSimtTile);
      return G::dropout(p) ? launch(G::template simt_kernel<true>(), gm, gc, simt_smem(2), stream, p)
                           : launch(G::template simt_kernel<false>(), gm, gc, simt_smem(1), stream, p);
    }
    case DType::kBFloat16: return launch_gemm_tiles<G, bf16>(p, stream);
    case DType::kFloat16: return launch_gemm_tiles<G, f16>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace detail
}  // namespace dorafp8
