// Host-side launch helpers of the launchers (weight_norm.cu's and launch_gemm): grid sizes, the 16-byte alignment
// test for vectorized copies, and launch() (grid limits, the > 48 KB dynamic shared memory opt-in, the error).
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
