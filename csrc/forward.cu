// dorafp8 CUDA kernels, forward family (contract: csrc/dora_fp8.h): forward_mma_kernel for the 16-bit compute dtypes
// (the GEMM shared with dgrad: common/gemm.cuh) with its operand policy FwdOperands and its epilogue,
// forward_simt_kernel for fp32 (common/simt.cuh), and the entry point dorafp8::forward.
// The fp8 tile stays fp8 in shared memory and is converted per fragment (exact: every e4m3 is an fp16 and a bf16) in
// a permuted k order that the x fragments are read in too; the epilogue adds the rank-r term u B^T by more mma steps
// into the scaled accumulators (fp32 FMA with rank_f32). Details: docs/ARCHITECTURE.md ("csrc/").

#include "dora_fp8.h"

#include "common/gemm.cuh"

namespace dorafp8 {
namespace detail {

struct ForwardGemm;  // the family of the two kernels (at the end): common/gemm.cuh's kernel bodies run its pieces

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

// Two blocks per SM (at most 128 registers a thread): without the bound ptxas may take a few more and halve that.
template <typename T, int BM, int BN, bool DROP>
__global__ void __launch_bounds__(kThreads, 2) forward_mma_kernel(const ForwardParams p, bool vec_x, bool vec_w) {
  mma_kernel_body<ForwardGemm, T, BM, BN, DROP>(p, vec_x, vec_w);
}

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

template <bool DROP> __global__ void __launch_bounds__(kThreads) forward_simt_kernel(const ForwardParams p) {
  simt_kernel_body<ForwardGemm, DROP>(p);
}

// The family common/gemm.cuh runs: output columns N, reduction K, activations x (and xm with dropout), the epilogues.
struct ForwardGemm {
  using Params = ForwardParams;
  template <int BM, int BN, bool DROP> using Cfg = FwdCfg<BM, BN, DROP>;
  template <int BN> using Operands = FwdOperands<BN>;
  static constexpr bool kRedContig = true;
  static bool dropout(const Params& p) { return p.xm != nullptr; }
  static __host__ __device__ const void* act(const Params& p, int i) { return i == 0 ? p.x : p.xm; }
  static __host__ __device__ int64_t ld(const Params& p, int i) { return i == 0 ? p.ldx : p.ldxm; }
  template <bool DROP> static auto simt_kernel() { return forward_simt_kernel<DROP>; }

  // forward_mma_kernel after its main loop: fold scale; accumulate s u B^T into the same registers; store.
  template <typename T, class Cfg>
  static __device__ __forceinline__ void mma_epilogue(const ForwardParams& p, const FwdOperands<Cfg::BN>& op,
                                                      float (&acc)[Cfg::MT][Cfg::NT][4],
                                                      float (&acc2)[Cfg::MT][Cfg::NT][4], uint8_t* smem,
                                                      const MmaWarp& w, int64_t m0, int64_t n0) {
    constexpr int MT = Cfg::MT, NT = Cfg::NT;
    constexpr bool DROP = Cfg::DROP;
    const int64_t M = p.M, N = p.N;
    const bool dora = p.c != nullptr;
    const bool lora = dora && p.s != 0.f && p.r > 0;
    // Per output column, not per accumulator element: a lane has 2 columns per n8 tile, so one scale load and one
    // division serve the MT x 2 elements of a column. div_rn's slow path is a subroutine call; with one call per
    // element (MT x NT x 4, 64 at BM = 64, BN = 256) ptxas spilled the live accumulators around them on sm_100 and
    // sm_120 (up to 568 bytes per kernel). The column is a 32-bit offset into the block's columns: 64-bit column
    // indices here stayed live until the stores and spilled in the 32 x 256 dropout tile on sm_90a and sm_89 (python
    // -m dorafp8.kernel_report --backend cuda: no spills on any target with this form).
    const float* __restrict__ scale = p.scale + (p.scale_per_row ? n0 : 0);
    const int64_t cols_left = N - n0;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      float sig[2], pre[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int c = w.wn0 + nt * 8 + 2 * w.t + h;  // the column in the block tile
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
    if (lora) mma_rank_term<T, Cfg>(racc, op, p.u, p.rank_f32, p.r, M, m0, smem, w.tid, w.lane, w.wm0, w.g);

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
      const int64_t i = m0 + w.wm0 + mt * 16 + w.g + 8 * h;
      if (i >= M) continue;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int64_t j = n0 + w.wn0 + nt * 8 + 2 * w.t;
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

  // forward_simt_kernel after its main loop: as forward_mma_kernel's (u B^T by simt_rank_gemm).
  template <bool DROP>
  static __device__ __forceinline__ void simt_epilogue(const ForwardParams& p, float (&acc)[DROP ? 2 : 1][4][4],
                                                       float* sA, float* sB, int tid, int64_t m0, int64_t n0) {
    constexpr int NA = DROP ? 2 : 1;
    const int64_t M = p.M, N = p.N;
    const int tx = tid & 15;
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
      simt_rank_gemm<NA - 1, true>(acc, static_cast<const float*>(p.u), static_cast<const float*>(p.B), p.r, M, N,
                                   m0, n0, sA, sB, tid);
    }
    const FwdEpilogue epi{dora, DROP, lora ? p.s : 1.f};
    float* __restrict__ y = static_cast<float*>(p.y);
    float* __restrict__ z = static_cast<float*>(p.z);
    const float* __restrict__ bias = static_cast<const float*>(p.bias);
    simt_lane_outputs(m0, n0, M, N, tid, [&](int i, int j, int64_t ii, int64_t jj) {
      float yv, zv;
      epi(acc[0][i][j], acc[NA - 1][i][j], dora ? p.c[jj] : 1.f, bias != nullptr ? bias[jj] : 0.f, yv, zv);
      y[ii * N + jj] = yv;
      if (z != nullptr) z[ii * N + jj] = zv;
    });
  }

  template <typename T, int BM, int BN, bool D> static auto mma_kernel() { return forward_mma_kernel<T, BM, BN, D>; }
};

}  // namespace detail

// ------------------------------------------------------------------------------------------------ public interface

cudaError_t forward(const ForwardParams& p, DType dtype, cudaStream_t stream) {
  return detail::launch_gemm<detail::ForwardGemm>(p, dtype, stream);
}

}  // namespace dorafp8
