// dorafp8 CUDA kernels, forward family (the contract: csrc/dora_fp8.h, dorafp8/backends/__init__.py): forward_mma_kernel for
// the 16-bit compute dtypes (the GEMM it shares with dgrad: common/gemm.cuh; block tiles, launch order and edge
// handling: common/tiles.cuh) with its operand policy FwdOperands and its epilogue, forward_simt_kernel for fp32
// (common/simt.cuh), and the entry point dorafp8::forward (launch_gemm, common/gemm.cuh).
//
// forward:     y = x W0^T with the DoRA epilogue. The fp8 tile stays fp8 in shared memory (BN x 32 bytes per stage);
//              ldmatrix reads it as if it were 16-bit, so lane (g, t) gets row g, bytes 4t..4t+3 of a 16-byte k
//              slice, which cvt.rn.f16x2.e4m3x2 turns into the two B registers (exact: every e4m3 value is an fp16
//              and a bf16). That puts k = 4t..4t+3 where the mma expects k = {2t, 2t+1, 2t+8, 2t+9}: a fixed
//              permutation of the 16 k of each step, harmless as long as A uses the same one, so the x fragments are
//              read with two 8-byte loads (x[g][4t..4t+3], x[g+8][4t..4t+3]) instead of ldmatrix. Dropout runs the x
//              and xm tiles (xm = x * mask, exact in the compute dtype) against the same converted W8 fragments into
//              two accumulators; the 1 / (1 - p) of dropout multiplies the fp32 xm product in the epilogue. The
//              epilogue folds scale (per column), then the rank-r term u B^T is accumulated by more mma steps into
//              the same accumulators after they are scaled by scale_j / s (acc * scale_j / s + u B^T, times s,
//              = x W0^T + s u B^T: no extra registers).
//
// Rank-r term with fp32 adapters on 16-bit activations (rank_f32): u B^T runs as fp32 FMA on the lane's own
//              accumulator positions (u/B chunks of 32 in shared memory), so the fp32 adapters are never rounded to
//              16 bits; forward then also writes z in fp32 (z_f32).

#include "dora_fp8.h"

#include "common/gemm.cuh"

namespace dorafp8 {
namespace detail {

// ================================================================================================ forward (mma)

template <int BM, int BN, bool DROP>
struct FwdCfg : MmaTiles<BM, BN, DROP> {
  static constexpr int kLoraBytes = cmax(BM * kRankChunk * 2 + BN * kRankChunk * 2,   // 16-bit u, B chunks
                                         (BM + BN) * kRankPitchF * 4);                 // fp32 u, B chunks
  static constexpr int kSmem = cmax(MmaTiles<BM, BN, DROP>::kPipeSmem, kLoraBytes);
};

// forward's operands for the shared GEMM (common/gemm.cuh): W8 [N, K] and the rank-r factor B [N, r] have the output
// columns as rows, the reduction contiguous. The B fragments come in the permuted k order (this file's header), so
// the x, xm and u tiles use kSwzPairs and frag_a_pairs.
template <int BN>
struct FwdOperands {
  static constexpr int kSwzA = kSwzPairs;
  const ForwardParams& p;
  int64_t N, K, n0;  // W8's shape; the block's first output column
  int wn0;           // the warp's first output column in the block tile
  bool vec_w;

  // fp8 tile [BN][32 bytes]: 16-byte pieces, BN * 2 / 256 per thread; chunk ^ ((row >> 2) & 1) keeps ldmatrix
  // conflict-free.
  __device__ __forceinline__ void load_w8(uint8_t* sw, int64_t k0, int tid) const {
    static_assert((BN * 2) % kThreads == 0, "forward: whole 16-byte fp8 pieces per thread");
#pragma unroll
    for (int it = 0; it < BN * 2 / kThreads; ++it) {
      const int e = tid + it * kThreads, row = e >> 1, ch = e & 1;
      load_w8_piece(sw + row * 32 + ((ch ^ ((row >> 2) & 1)) << 4), p.w8, N, K, n0 + row, k0 + ch * 16, vec_w);
    }
  }
  // One ldmatrix.x4 = 4 n8 tiles x 16 k bytes; lane (g, t) gets w8[n][4t..4t+3] for n = wn0 + 8i + g.
  template <typename T>
  __device__ __forceinline__ void w8_frags(uint32_t (&bfr)[4][2], const uint8_t* sw, int kk, int lane) const {
    uint32_t d[4];
    const int n = wn0 + 8 * (lane >> 3) + (lane & 7);
    ldsm_x4(d, sw + n * 32 + ((kk ^ ((n >> 2) & 1)) << 4));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      bfr[i][0] = e4m3x2_to<T>(d[i] & 0xffffu);
      bfr[i][1] = e4m3x2_to<T>(d[i] >> 16);
    }
  }
  // 16-bit B chunk [BN][32] (rows = output columns), read in the same permuted k order.
  __device__ __forceinline__ void load_rank(uint8_t* sb, int q0, int tid) const {
    load_tile32_scalar<BN, kSwzPairs>(sb, static_cast<const uint16_t*>(p.B), p.r, N, p.r, n0, q0, tid);
  }
  __device__ __forceinline__ void rank_frags(uint32_t (&bfr)[4][2], const uint8_t* sb, int kk, int lane) const {
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) frag_b_pairs(bfr[nt], sb, wn0 + nt * 8, kk, lane);
  }
  // fp32 B chunk [BN][kRankPitchF]; the lane's columns are 8 nt + 2t + h.
  __device__ __forceinline__ void load_rank_f32(float* sb, int q0, int tid) const {
    load_tile_f32<BN, kRankChunk, kRankPitchF>(sb, static_cast<const float*>(p.B), p.r, N, p.r, n0, q0, tid);
  }
  __device__ __forceinline__ void rank_cols_f32(float (&bv)[4][2], const float* sb, int q, int lane) const {
    const int t = lane & 3;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int h = 0; h < 2; ++h) bv[nt][h] = sld<float>(sb + (wn0 + nt * 8 + 2 * t + h) * kRankPitchF + q);
  }
};

// Per-column epilogue of forward (the contract's formulas). a1, a2: the final accumulators (see the kernel).
struct FwdEpilogue {
  bool dora, drop;
  float post;  // s if the rank-r term was accumulated (acc was scaled by scale / s), else 1
  __device__ __forceinline__ void operator()(float a1, float a2, float cj, float bj, float& y, float& z) const {
    if (!dora) {
      y = a1 + bj;
      z = 0.f;
    } else if (!drop) {
      z = post * a1;
      y = fmaf(cj, z, bj);
    } else {  // a1 = scale (x - xd) W8^T, z = xd W0^T + s u B^T:  y = x W0^T + (c - 1) xd W0^T + c s u B^T + b
      z = post * a2;
      y = fmaf(cj, z, a1) + bj;
    }
  }
};

// Two blocks per SM (at most 128 registers a thread): without the bound ptxas may take a few more and halve that.
template <typename T, int BM, int BN_, bool DROP>
__global__ void __launch_bounds__(kThreads, 2) forward_mma_kernel(const ForwardParams p, bool vec_x, bool vec_w) {
  using Cfg = FwdCfg<BM, BN_, DROP>;
  constexpr int BN = Cfg::BN, MT = Cfg::MT, NT = Cfg::NT;
  DORA_SMEM(smem);

  const MmaWarp w = mma_warp<Cfg>();
  const int tid = w.tid, lane = w.lane, wm0 = w.wm0, wn0 = w.wn0, g = w.g, t = w.t;
  const int64_t M = p.M, N = p.N, K = p.K;
  int64_t m0, n0;
  mma_block_origin<Cfg>(M, N, p.group_m, m0, n0);
  const uint16_t* __restrict__ x = static_cast<const uint16_t*>(p.x);
  const uint16_t* __restrict__ xm = static_cast<const uint16_t*>(p.xm);
  const FwdOperands<BN> op{p, N, K, n0, wn0, vec_w};

  // acc: x W8^T; acc2 (dropout): xm W8^T. Both share every converted W8 fragment.
  float acc[MT][NT][4], acc2[MT][NT][4];
  zero(acc);
  if (DROP) zero(acc2);
  auto stage_ptr = [&](int s) { return smem + s * Cfg::kStageBytes; };
  auto load_stage = [&](int s, int rt) {
    mma_load_stage<Cfg>(stage_ptr(s), op, x, p.ldx, xm, p.ldxm, M, K, m0, rt, vec_x, tid);
  };
  auto compute_stage = [&](int s) {
    mma_compute_stage<T, Cfg>(acc, acc2, stage_ptr(s), op, lane, wm0);
  };
  mma_pipeline<Cfg>(K, load_stage, compute_stage);

  // ---- epilogue: fold scale; accumulate s u B^T into the same registers
  const bool dora = p.c != nullptr;
  const bool lora = dora && p.s != 0.f && p.r > 0;
  // Per output column, not per accumulator element: a lane has 2 columns per n8 tile, so one scale load and one
  // division serve the MT x 2 elements of a column. div_rn's slow path is a subroutine call; with one call per element
  // (MT x NT x 4, 64 at BM = 64, BN = 256) ptxas spilled the live accumulators around them on sm_100 and sm_120 (up to
  // 568 bytes per kernel). The column is a 32-bit offset into the block's columns: 64-bit column indices here stayed
  // live until the stores and spilled in the 32 x 256 dropout tile on sm_90a and sm_89 (python -m
  // dorafp8.kernel_report --backend cuda: no spills on any target with this form).
  const float* __restrict__ scale = p.scale + (p.scale_per_row ? n0 : 0);
  const int64_t cols_left = N - n0;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    float sig[2], pre[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = wn0 + nt * 8 + 2 * t + h;  // the column in the block tile
      sig[h] = c < cols_left ? scale[p.scale_per_row ? c : 0] : 0.f;
      pre[h] = lora ? div_rn(sig[h], p.s) : sig[h];
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (!DROP) {
          acc[mt][nt][e] *= pre[e & 1];
        } else {
          // acc2 = xm W8 and xd W8 = xm W8 / (1 - p), in fp32: acc = scale (x - xd) W8, acc2 = scale xd W8 / s
          acc[mt][nt][e] = sig[e & 1] * fmaf(-p.inv_keep, acc2[mt][nt][e], acc[mt][nt][e]);
          acc2[mt][nt][e] *= pre[e & 1] * p.inv_keep;
        }
      }
  }
  float (&racc)[MT][NT][4] = DROP ? acc2 : acc;  // z's accumulator: + u B^T
  if (lora) mma_rank_term<T, Cfg>(racc, op, p.u, p.rank_f32, p.r, M, m0, smem, tid, lane, wm0, g);

  // ---- store: lane (g, t) holds rows g, g + 8 x columns 2t, 2t + 1 of each m16 x n8 tile
  const FwdEpilogue epi{dora, DROP, lora ? p.s : 1.f};
  T* __restrict__ y = static_cast<T*>(p.y);
  T* __restrict__ z = p.z_f32 ? nullptr : static_cast<T*>(p.z);
  float* __restrict__ z32 = p.z_f32 ? static_cast<float*>(p.z) : nullptr;  // fp32 z (fp32 adapters)
  const T* __restrict__ bias = static_cast<const T*>(p.bias);
  const bool pair_ok = (N & 1) == 0 && reinterpret_cast<uintptr_t>(y) % 4 == 0 &&
                       reinterpret_cast<uintptr_t>(z) % 4 == 0;  // 4-byte aligned pair stores
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t i = m0 + wm0 + mt * 16 + g + 8 * h;
      if (i >= M) continue;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int64_t j = n0 + wn0 + nt * 8 + 2 * t;
        if (j >= N) continue;
        float yv[2], zv[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int64_t jj = j + e < N ? j + e : j;
          const float cj = dora ? p.c[jj] : 1.f;
          const float bj = bias != nullptr ? to_f32(bias[jj]) : 0.f;
          epi(acc[mt][nt][2 * h + e], DROP ? acc2[mt][nt][2 * h + e] : 0.f, cj, bj, yv[e], zv[e]);
        }
        const int64_t o = i * N + j;
        if (pair_ok && j + 1 < N) {
          store_pair<T>(y + o, yv[0], yv[1]);
          if (z != nullptr) store_pair<T>(z + o, zv[0], zv[1]);
        } else {
          y[o] = from_f32<T>(yv[0]);
          if (z != nullptr) z[o] = from_f32<T>(zv[0]);
          if (j + 1 < N) {
            y[o + 1] = from_f32<T>(yv[1]);
            if (z != nullptr) z[o + 1] = from_f32<T>(zv[1]);
          }
        }
        if (z32 != nullptr) {
          z32[o] = zv[0];
          if (j + 1 < N) z32[o + 1] = zv[1];
        }
      }
    }
}

// ================================================================================================ fp32 (SIMT)

template <bool DROP>
__global__ void __launch_bounds__(kThreads) forward_simt_kernel(const ForwardParams p) {
  constexpr int NA = DROP ? 2 : 1;
  DORA_SMEM(smem);
  float* sA = reinterpret_cast<float*>(smem);
  float* sB = sA + NA * kSimtR * kSimtPitch;
  const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
  const int64_t M = p.M, N = p.N, K = p.K;
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * kSimtTile, n0 = static_cast<int64_t>(blockIdx.y) * kSimtTile;

  float acc[NA][4][4];
  zero(acc);
  simt_w8_gemm<true>(acc, static_cast<const float*>(p.x), p.ldx, static_cast<const float*>(p.xm), p.ldxm, p.w8, M, N,
                     K, m0, n0, sA, sB, tid);

  const bool dora = p.c != nullptr;
  const bool lora = dora && p.s != 0.f && p.r > 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int64_t jj = n0 + tx + 16 * j;
    const float sig = jj < N ? p.scale[p.scale_per_row ? jj : 0] : 0.f;
    const float pre = lora ? div_rn(sig, p.s) : sig;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (!DROP) {
        acc[0][i][j] *= pre;
      } else {
        acc[0][i][j] = sig * fmaf(-p.inv_keep, acc[NA - 1][i][j], acc[0][i][j]);  // as forward_mma_kernel
        acc[NA - 1][i][j] *= pre * p.inv_keep;
      }
    }
  }
  if (lora) {
    simt_rank_gemm<NA - 1, true>(acc, static_cast<const float*>(p.u), static_cast<const float*>(p.B), p.r, M, N, m0,
                                 n0, sA, sB, tid);
  }

  const FwdEpilogue epi{dora, DROP, lora ? p.s : 1.f};
  float* __restrict__ y = static_cast<float*>(p.y);
  float* __restrict__ z = static_cast<float*>(p.z);
  const float* __restrict__ bias = static_cast<const float*>(p.bias);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t ii = m0 + ty + 16 * i;
    if (ii >= M) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t jj = n0 + tx + 16 * j;
      if (jj >= N) continue;
      float yv, zv;
      epi(acc[0][i][j], acc[NA - 1][i][j], dora ? p.c[jj] : 1.f, bias != nullptr ? bias[jj] : 0.f, yv, zv);
      y[ii * N + jj] = yv;
      if (z != nullptr) z[ii * N + jj] = zv;
    }
  }
}

// ================================================================================================ launch

// The family launch_gemm (common/gemm.cuh) dispatches: output columns N, activations x (and xm with dropout).
struct ForwardGemm {
  using Params = ForwardParams;
  template <int BM, int BN, bool DROP> using Cfg = FwdCfg<BM, BN, DROP>;
  template <typename T, int BM, int BN, bool DROP>
  static auto mma_kernel() { return forward_mma_kernel<T, BM, BN, DROP>; }
  template <bool DROP> static auto simt_kernel() { return forward_simt_kernel<DROP>; }
  static int64_t cols(const Params& p) { return p.N; }
  static bool dropout(const Params& p) { return p.xm != nullptr; }
  static const void* act(const Params& p, int i) { return i == 0 ? p.x : p.xm; }
  static int64_t ld(const Params& p, int i) { return i == 0 ? p.ldx : p.ldxm; }
};

}  // namespace detail

// ------------------------------------------------------------------------------------------------ public interface

cudaError_t forward(const ForwardParams& p, DType dtype, cudaStream_t stream) {
  return detail::launch_gemm<detail::ForwardGemm>(p, dtype, stream);
}

}  // namespace dorafp8
