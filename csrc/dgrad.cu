// dorafp8 CUDA kernels, dgrad family (contract: csrc/dora_fp8.h): dgrad_mma_kernel for the 16-bit compute dtypes
// (the GEMM shared with forward: common/gemm.cuh) with its operand policy DgradOperands and its epilogue,
// dgrad_simt_kernel for fp32 (common/simt.cuh), and the entry point dorafp8::dgrad.
// dx = gl W8 (and gb W8 with dropout) reduces over N, W8's non-contiguous dim: ldmatrix.trans plus one byte permute
// give the B fragments of the even and odd output columns, so a lane holds 4 consecutive columns. The epilogue applies
// the scalars, adds s v A (fp32 FMA with rank_f32) and combines dropout's two terms. Details: docs/ARCHITECTURE.md.

#include "dora_fp8.h"

#include "common/gemm.cuh"

namespace dorafp8 {
namespace detail {

struct DgradGemm;  // the family of the two kernels (at the end): common/gemm.cuh's kernel bodies run its pieces

// ================================================================================================ dgrad (mma)

template <int BM, int BK, bool DROP>  // BK: output columns (of K) per block; the reduction (N) runs in steps of BR = 32
struct DgradCfg : MmaTiles<BM, BK, DROP> {
  static constexpr int kLoraBytes = cmax(BM * kRankChunk * 2 + kRankChunk * BK * 2,          // 16-bit v, A chunks
                                         (BM * kRankPitchF + kRankChunk * BK) * 4);         // fp32 v, A chunks
  static constexpr int kSmem = cmax(MmaTiles<BM, BK, DROP>::kPipeSmem, kLoraBytes);
};

// dgrad's operands for the shared GEMM (common/gemm.cuh): W8 [N, K] and the rank-r factor A [r, K] have the
// reduction as rows and the output columns contiguous, so their B fragments come from ldmatrix.trans, in the natural
// k order: the gl, gb and v tiles use kSwzLdsm and frag_a_ldsm. The fragments of a warp's 16-column group c2 are its
// even and odd columns (n8 tiles 2 c2 and 2 c2 + 1), so lane (g, t) accumulates columns 16 c2 + 4t .. 16 c2 + 4t + 3.
template <int BK>
struct DgradOperands {
  static constexpr int kSwzA = kSwzLdsm;
  static constexpr int BR = 32;  // reduction rows per stage (MmaTiles::BR)
  const DgradParams& p;
  int64_t N, K, k0;  // W8's shape; the block's first output column
  int wk0;           // the warp's first output column in the block tile
  bool vec_w;

  // fp8 tile [32 rows of N][BK bytes of K]: 16-byte pieces, BR * BK / 16 / 256 per thread, chunk ^ (row & 7) for
  // ldmatrix.trans (conflict-free: 8 consecutive rows hit 8 distinct chunks of one 128-byte window).
  __device__ __forceinline__ void load_w8(uint8_t* sw, int64_t r0, int tid) const {
    static_assert((BR * BK / 16) % kThreads == 0, "dgrad: whole 16-byte fp8 pieces per thread");
#pragma unroll
    for (int it = 0; it < BR * BK / 16 / kThreads; ++it) {
      const int e = tid + it * kThreads, row = e / (BK / 16), ch = e % (BK / 16);
      load_w8_piece(sw + row * BK + ((ch ^ (row & 7)) << 4), p.w8, N, K, r0 + row, k0 + ch * 16, vec_w);
    }
  }
  // ldmatrix.x4.trans of rows kk*16 + {0..7, 8..15} x the warp's two 16-byte column groups. Lane (g, t) gets bytes
  // {w[2t][2g], w[2t][2g+1], w[2t+1][2g], w[2t+1][2g+1]}; byte_perm 0x3120 makes (w[2t][2g], w[2t+1][2g]) the low
  // half (output column 2g: the even n8 tile) and the odd column's pair the high half. The converted fragments are
  // used as they are: nothing per row of W8 (column of gl) is folded into any operand.
  template <typename T>
  __device__ __forceinline__ void w8_frags(uint32_t (&bfr)[4][2], const uint8_t* sw, int kk, int lane) const {
    uint32_t d[4];
    const int i = lane >> 3, row = kk * 16 + 8 * (i & 1) + (lane & 7), ch = (wk0 >> 4) + (i >> 1);
    ldsm_x4_trans(d, sw + row * BK + ((ch ^ (row & 7)) << 4));
#pragma unroll
    for (int c2 = 0; c2 < 2; ++c2) {
      const uint32_t lo = byte_perm(d[2 * c2], 0x3120u), hi = byte_perm(d[2 * c2 + 1], 0x3120u);
      bfr[2 * c2][0] = e4m3x2_to<T>(lo & 0xffffu);
      bfr[2 * c2][1] = e4m3x2_to<T>(hi & 0xffffu);
      bfr[2 * c2 + 1][0] = e4m3x2_to<T>(lo >> 16);
      bfr[2 * c2 + 1][1] = e4m3x2_to<T>(hi >> 16);
    }
  }
  // 16-bit A chunk [32][BK], 2 BK-byte rows: column 16c + 2j + h of the tile goes to position 16c + 8h + j, so that
  // ldmatrix.trans of positions 16c..16c+7 (16c+8..16c+15) gives the even (odd) n8 tile, matching the
  // accumulators' column order.
  __device__ __forceinline__ void load_rank(uint8_t* sa, int q0, int tid) const {
    const uint16_t* __restrict__ Am = static_cast<const uint16_t*>(p.A);
#pragma unroll 4
    for (int it = 0; it < kRankChunk * BK / kThreads; ++it) {
      const int e = tid + it * kThreads, q = e / BK, col = e % BK;
      const int64_t gq = q0 + q, gk = k0 + col;
      const uint16_t val = (gq < p.r && gk < K) ? Am[gq * K + gk] : uint16_t(0);
      const int pos = (col & ~15) + ((col & 1) << 3) + ((col & 15) >> 1);
      sst<uint16_t>(sa + q * (BK * 2) + (((pos >> 3) ^ (q & 7)) << 4) + (pos & 7) * 2, val);
    }
  }
  __device__ __forceinline__ void rank_frags(uint32_t (&bfr)[4][2], const uint8_t* sa, int kk, int lane) const {
#pragma unroll
    for (int c2 = 0; c2 < 2; ++c2) {
      uint32_t d[4];
      const int i = lane >> 3, row = kk * 16 + 8 * (i & 1) + (lane & 7);
      const int chunk = 2 * ((wk0 >> 4) + c2) + (i >> 1);
      ldsm_x4_trans(d, sa + row * (BK * 2) + ((chunk ^ (row & 7)) << 4));
      bfr[2 * c2][0] = d[0];
      bfr[2 * c2][1] = d[1];
      bfr[2 * c2 + 1][0] = d[2];
      bfr[2 * c2 + 1][1] = d[3];
    }
  }
  // fp32 A chunk [32][BK]; the lane's columns of n8 tile nt, element h: 16 (nt >> 1) + 4t + (nt & 1) + 2h.
  __device__ __forceinline__ void load_rank_f32(float* sa, int q0, int tid) const {
    load_tile_f32<kRankChunk, BK, BK>(sa, static_cast<const float*>(p.A), K, p.r, K, q0, k0, tid);
  }
  __device__ __forceinline__ void rank_cols_f32(float (&av)[4][2], const float* sa, int q, int lane) const {
    const int t = lane & 3;
#pragma unroll
    for (int c2 = 0; c2 < 2; ++c2) {
      const float4 a4 = sld<float4>(sa + q * BK + wk0 + 16 * c2 + 4 * t);
      av[2 * c2][0] = a4.x;
      av[2 * c2 + 1][0] = a4.y;
      av[2 * c2][1] = a4.z;
      av[2 * c2 + 1][1] = a4.w;
    }
  }
};

template <typename T, int BM, int BK, bool DROP>  // two blocks per SM, as forward (forward.cu)
__global__ void __launch_bounds__(kThreads, 2) dgrad_mma_kernel(const DgradParams p, bool vec_g, bool vec_w) {
  mma_kernel_body<DgradGemm, T, BM, BK, DROP>(p, vec_g, vec_w);
}

template <bool DROP> __global__ void __launch_bounds__(kThreads) dgrad_simt_kernel(const DgradParams p) {
  simt_kernel_body<DgradGemm, DROP>(p);
}

// The family common/gemm.cuh runs: output columns K, reduction N, activations gl (and gb with dropout), the kernels'
// epilogues. acc: gl W8 (the adapter term); acc2 (acc[1] in the SIMT kernel): gb W8 (dropout's plain base term).
struct DgradGemm {
  using Params = DgradParams;
  template <int BM, int BK, bool DROP> using Cfg = DgradCfg<BM, BK, DROP>;
  static bool dropout(const Params& p) { return p.mask != nullptr; }
  static __host__ __device__ const void* act(const Params& p, int i) { return i == 0 ? p.gl : p.gb; }
  static __host__ __device__ int64_t ld(const Params& p, int i) { return i == 0 ? p.ldgl : p.ldgb; }
  template <bool DROP> static auto simt_kernel() { return dgrad_simt_kernel<DROP>; }
  template <int BK> using Operands = DgradOperands<BK>;
  static constexpr bool kRedContig = false;

  // dgrad_mma_kernel after its main loop: acc = rl st (gl W8) / s, then s v A accumulated into it (times s at the
  // store); dropout's two terms combined with the mask.
  template <typename T, class Cfg>
  static __device__ __forceinline__ void mma_epilogue(const DgradParams& p, const DgradOperands<Cfg::BN>& op,
                                                      float (&acc)[Cfg::MT][Cfg::NT][4],
                                                      float (&acc2)[Cfg::MT][Cfg::NT][4], uint8_t* smem,
                                                      const MmaWarp& w, int64_t m0, int64_t k0) {
    constexpr bool DROP = Cfg::DROP;
    const int64_t M = p.M, K = p.K;
    const float st = p.scale_per_row ? 1.f : p.scale[0];  // per-row scales are already in gl, gb
    const bool lora = p.v != nullptr && p.s != 0.f && p.r > 0;
    const float al = p.rl[0] * st;
    const float pre = lora ? div_rn(al, p.s) : al;
#pragma unroll
    for (int mt = 0; mt < Cfg::MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < Cfg::NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[mt][nt][e] *= pre;
    if (lora) mma_rank_term<T, Cfg>(acc, op, p.v, p.rank_f32, p.r, M, m0, smem, w.tid, w.lane, w.wm0, w.g);

    // ---- store: lane (g, t) holds rows g, g + 8 x columns 16c + 4t .. 16c + 4t + 3 of each 16-column group c
    const float post = lora ? p.s : 1.f;
    const float ab = DROP ? p.rb[0] * st : 0.f;  // gb's factor
    T* __restrict__ dx = static_cast<T*>(p.dx);
    const bool quad_ok = (K & 3) == 0 && reinterpret_cast<uintptr_t>(dx) % 8 == 0;  // 8-byte aligned stores of 4
#pragma unroll
    for (int mt = 0; mt < Cfg::MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t i = m0 + w.wm0 + mt * 16 + w.g + 8 * h;
        if (i >= M) continue;
#pragma unroll
        for (int c2 = 0; c2 < 2; ++c2) {
          const int64_t col = k0 + w.wn0 + 16 * c2 + 4 * w.t;
          if (col >= K) continue;
          float out[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {  // column col + e: (even, odd, even, odd) tile, element (2h, 2h, 2h+1, 2h+1)
            const int nt = 2 * c2 + (e & 1), el = 2 * h + (e >> 1);
            if (!DROP) {
              out[e] = post * acc[mt][nt][el];
            } else {  // rb st (gb W8) + mask / (1 - p) * (rl st (gl W8) + s v A)
              const float base = ab * acc2[mt][nt][el];
              const bool keep = col + e < K && p.mask[i * p.ldmask + col + e] != 0;
              out[e] = keep ? fmaf(p.inv_keep * post, acc[mt][nt][el], base) : base;
            }
          }
          T* o = dx + i * K + col;
          if (quad_ok && col + 3 < K) {
            store_pair<T>(o, out[0], out[1]);
            store_pair<T>(o + 2, out[2], out[3]);
          } else {
#pragma unroll
            for (int e = 0; e < 4; ++e)
              if (col + e < K) o[e] = from_f32<T>(out[e]);
          }
        }
      }
  }

  // dgrad_simt_kernel after its main loop: as dgrad_mma_kernel's (v A by simt_rank_gemm).
  template <bool DROP>
  static __device__ __forceinline__ void simt_epilogue(const DgradParams& p, float (&acc)[DROP ? 2 : 1][4][4],
                                                       float* sA, float* sB, int tid, int64_t m0, int64_t k0) {
    constexpr int NA = DROP ? 2 : 1;
    const int64_t M = p.M, K = p.K;
    const float st = p.scale_per_row ? 1.f : p.scale[0];
    const bool lora = p.v != nullptr && p.s != 0.f && p.r > 0;
    const float al = p.rl[0] * st;
    const float pre = lora ? div_rn(al, p.s) : al;
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[0][i][j] *= pre;
    if (lora) {
      simt_rank_gemm<0, false>(acc, static_cast<const float*>(p.v), static_cast<const float*>(p.A), p.r, M, K, m0,
                               k0, sA, sB, tid);
    }
    const float post = lora ? p.s : 1.f;
    const float ab = DROP ? p.rb[0] * st : 0.f;
    float* __restrict__ dx = static_cast<float*>(p.dx);
    simt_lane_outputs(m0, k0, M, K, tid, [&](int i, int j, int64_t ii, int64_t kk) {
      float out = post * acc[0][i][j];
      if (DROP) {
        const float base = ab * acc[NA - 1][i][j];
        out = p.mask[ii * p.ldmask + kk] != 0 ? fmaf(p.inv_keep * post, acc[0][i][j], base) : base;
      }
      dx[ii * K + kk] = out;
    });
  }

  template <typename T, int BM, int BK, bool D> static auto mma_kernel() { return dgrad_mma_kernel<T, BM, BK, D>; }
};

}  // namespace detail

// ------------------------------------------------------------------------------------------------ public interface

cudaError_t dgrad(const DgradParams& p, DType dtype, cudaStream_t stream) {
  return detail::launch_gemm<detail::DgradGemm>(p, dtype, stream);
}

}  // namespace dorafp8
