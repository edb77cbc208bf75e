// Shared device code of the dorafp8 kernels, part 1: PTX primitives and thin wrappers of CUDA intrinsics (shared
// memory, cp.async, ldmatrix, mma.sync m16n8k16, warp reductions, division and sqrt correctly rounded under
// --use_fast_math), the 16-bit type aliases and register helpers. Header-only: each kernel file inlines what it uses.
// Every shared-memory access goes through sld/sst/ldsm/cp_async here, so that the CPU emulator (tests/cuda_emu/
// emu_cuda.h, under DORA_EMULATE) can stand in for the #ifndef DORA_EMULATE parts and check accesses for races.
#pragma once

#include <cstdint>
#include <cstring>

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

// ------------------------------------------------------------------------------------------------ types, registers

using bf16 = __nv_bfloat16;
using f16 = __half;

template <typename To, typename From>
__device__ __forceinline__ To bits_as(const From& f) {
  static_assert(sizeof(To) == sizeof(From), "bits_as: size mismatch");
  To t;
  memcpy(&t, &f, sizeof(To));
  return t;
}

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

// One m16n8k16 mma on the compute dtype's operands (fp32 accumulators).
template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);
template <> __device__ __forceinline__ void mma16816<bf16>(float (&d)[4], const uint32_t (&a)[4],
                                                           const uint32_t (&b)[2]) { mma_bf16(d, a, b); }
template <> __device__ __forceinline__ void mma16816<f16>(float (&d)[4], const uint32_t (&a)[4],
                                                          const uint32_t (&b)[2]) { mma_f16(d, a, b); }

}  // namespace detail
}  // namespace dorafp8
