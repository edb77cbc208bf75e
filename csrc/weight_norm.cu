// dorafp8 CUDA kernels, weight_norm family (contract: csrc/dora_fp8.h): weight_norm_kernel and its finalize kernel,
// their launcher, the entry points dorafp8::weight_norm_splits and weight_norm, and the build check
// kernel_image_error(). n[j] = || scale_j w8[j,:] + s (B A)[j,:] ||: blocks of 32 rows x one K split (tiles of 128),
// 256 threads of 4 x 4 micro-tiles; B A in fp32 FMA so fp32 adapters are not rounded to bf16 (why:
// docs/ARCHITECTURE.md, "csrc/"); K splits write fp32 partial sums of squares, added in a fixed order, then sqrt.

#include "dora_fp8.h"

#include "common/launch.cuh"
#include "common/tiles.cuh"

namespace dorafp8 {
namespace detail {

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

// ------------------------------------------------------------------------------------------------ launcher

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

// Any kernel of the build would do: every kernel file is compiled for the same architectures.
const char* kernel_image_error() {
  cudaFuncAttributes attr;
  const cudaError_t err =
      cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(detail::weight_norm_finalize_kernel));
  if (err == cudaSuccess) return "";
  cudaGetLastError();  // clear it
  return cudaGetErrorString(err);
}

}  // namespace dorafp8
