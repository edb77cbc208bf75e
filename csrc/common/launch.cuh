// Host-side launch helpers shared by the launchers of csrc/weight_norm.cu and of forward.cu and dgrad.cu (whose one
// launcher is launch_gemm, common/gemm.cuh): grid sizes, the 16-byte alignment test that picks vectorized copies, and
// launch(), which checks the grid against CUDA's limits, opts into more than 48 KB of dynamic shared memory where a
// kernel needs it, and returns the launch's error.
#pragma once

#include "tiles.cuh"

namespace dorafp8 {
namespace detail {

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

}  // namespace detail
}  // namespace dorafp8
