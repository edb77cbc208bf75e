// dorafp8 CUDA kernels: the launch interface between csrc/binding.cpp (checks, stream) and the kernel files
// weight_norm.cu, forward.cu, dgrad.cu (shared code in common/). Plain C++ with raw pointers, so the binding never
// sees CUDA's fp types and the .cu files never see torch's headers (cheap translation units, built side by side).
// The rank-r GEMMs and the backward pass are the Triton backend's (dorafp8/backends/cuda.py).
//
// The math is the backend contract of dorafp8/backends/__init__.py (see docs/DORA_MATH.md), for per-tensor and per-row
// weight scales (W0 = scale * w8 with scale fp32, one value or one per row; block scales and W8A8 are not offered
// here, dorafp8/backends/cuda.py refuses them):
//   weight_norm: n[j] = || scale_j * w8[j, :] + s * (B A)[j, :] ||_2                        (fp32 [N])
//   forward:     c == nullptr: y = x W0^T + bias
//                no dropout:   y = c * (x W0^T + s u B^T) + bias,              z = x W0^T + s u B^T
//                dropout:      y = x W0^T + bias + (c - 1) * (xd W0^T) + c * s u B^T,   z = xd W0^T + s u B^T
//                              with xd W0^T = (xm W0^T) / (1 - p) in fp32, xm = x * mask (the kept part of x)
//   dgrad:       on the operands prepared by the backward pass (gl = g * f / rl, gb = g * srow / rb: per-row scales
//                are already in them), with st = scale[0] for a per-tensor scale and 1 for per-row scales:
//                v == nullptr: dx = rl * st * (gl W8)
//                no dropout:   dx = rl * st * (gl W8) + s v A
//                dropout:      dx = rb * st * (gb W8) + mask / (1 - p) * (rl * st * (gl W8) + s v A)
// The rank-r operands (u, B in forward; v, A in dgrad) are in the compute dtype or, with rank_f32, in fp32 (the
// adapters' fp32 on 16-bit activations: the rank-r products then run in fp32 FMA, never rounded to 16 bits).
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace dorafp8 {

// The compute dtype ("cdt"): x, xm, bias, y (and u, B, z unless rank_f32 / z_f32) in forward; gl, gb, dx (and v, A
// unless rank_f32) in dgrad.
enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

struct WeightNormParams {
  const uint8_t* w8;     // [N, K] e4m3 bytes, contiguous
  const float* scale;    // [1] or [N]
  const void* A;         // [r, K] contiguous, dtype adapter_dtype
  const void* B;         // [N, r] contiguous, dtype adapter_dtype
  float* partial;        // [splits, N] fp32 workspace (sum of squares per K split); unused when splits == 1
  float* n;              // [N] fp32 output
  int64_t N, K;
  int r;
  int splits;            // from weight_norm_splits(N, K)
  float s;
  bool scale_per_row;
  DType adapter_dtype;
};

struct ForwardParams {
  // Pointers (cdt unless noted)
  const void* x;         // [M, K], row stride ldx, unit stride in K
  const void* xm;        // [M, K] (= x * mask, unscaled), row stride ldxm, or nullptr (no dropout)
  const uint8_t* w8;     // [N, K] e4m3 bytes, contiguous
  const float* scale;    // [1] or [N] fp32
  const void* bias;      // [N] or nullptr
  const float* c;        // [N] fp32, or nullptr (plain FP8 linear)
  const void* u;         // [M, r] contiguous (= xd A^T), or nullptr when c == nullptr; fp32 if rank_f32
  const void* B;         // [N, r] contiguous, or nullptr when c == nullptr; fp32 if rank_f32
  void* y;               // [M, N] contiguous output
  void* z;               // [M, N] contiguous output (fp32 if z_f32), or nullptr (not needed)
  // Sizes and strides (elements)
  int64_t M, N, K;
  int64_t ldx, ldxm;
  int r;
  float s;
  float inv_keep;        // 1 / (1 - p), used with xm
  bool scale_per_row;
  bool rank_f32;         // u and B are fp32 (else cdt)
  bool z_f32;            // z is fp32 (else cdt)
  int group_m;           // row-blocks per group of the launch order; 0 (the binding's): the default
};

struct DgradParams {
  // Pointers (cdt unless noted)
  const void* gl;        // [M, N] (= g * f / rl), row stride ldgl, unit stride in N
  const void* gb;        // [M, N] (= g * srow / rb), row stride ldgb; only with mask (dropout), else nullptr
  const float* rl;       // [1] fp32: gl's scalar
  const float* rb;       // [1] fp32: gb's scalar; only with mask
  const uint8_t* w8;     // [N, K] e4m3 bytes, contiguous
  const float* scale;    // [1] (per tensor: st = scale[0]) or [N] (per row: already in gl, gb; st = 1) fp32
  const void* v;         // [M, r] contiguous (= (g * c) B), or nullptr (plain FP8 linear); fp32 if rank_f32
  const void* A;         // [r, K] contiguous, or nullptr when v == nullptr; fp32 if rank_f32
  const uint8_t* mask;   // [M, K] bool, row stride ldmask, unit stride in K; nullptr: no dropout (needs v)
  void* dx;              // [M, K] contiguous output
  // Sizes and strides (elements)
  int64_t M, N, K;
  int64_t ldgl, ldgb, ldmask;
  int r;
  float s;
  float inv_keep;        // 1 / (1 - p), used with mask
  bool scale_per_row;
  bool rank_f32;         // v and A are fp32 (else cdt)
  int group_m;           // row-blocks per group of the launch order; 0 (the binding's): the default
};

// Number of K splits weight_norm uses for this shape on the current device (the workspace is [splits, N] fp32).
int weight_norm_splits(int64_t N, int64_t K);

// Each launcher enqueues its kernels on `stream` and returns cudaGetLastError() (cudaSuccess when all launched).
cudaError_t weight_norm(const WeightNormParams& p, cudaStream_t stream);
cudaError_t forward(const ForwardParams& p, DType dtype, cudaStream_t stream);
cudaError_t dgrad(const DgradParams& p, DType dtype, cudaStream_t stream);

// Empty string when this build has kernel code that runs on the current device, else the CUDA error's text
// (e.g. "no kernel image is available for execution on the device" for an architecture that was not built).
const char* kernel_image_error();

}  // namespace dorafp8
