// Shared device code of the dorafp8 kernels, part 2: fp32 <-> 16-bit conversions, packed pairs as mma operands hold
// them, and the e4m3 unpack (e4m3x2 -> f16x2 is one cvt on sm_89+; every e4m3 is exact in fp16, bf16 and fp32).
#pragma once

#include "primitives.cuh"

namespace dorafp8 {
namespace detail {

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(f16 v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(bf16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ f16 from_f32<f16>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float v) { return __float2bfloat16_rn(v); }

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
// One e4m3 byte -> fp32 (the fp32 SIMT kernels read W8 byte by byte).
__device__ __forceinline__ float e4m3_to_f32(uint8_t b) { return e4m3x2_to_f32x2(b).x; }

// Two values as one 4-byte global store (dst 4-byte aligned).
template <typename T>
__device__ __forceinline__ void store_pair(T* dst, float lo, float hi) {
  *reinterpret_cast<uint32_t*>(dst) = Pair<T>::pack(lo, hi);
}

}  // namespace detail
}  // namespace dorafp8
