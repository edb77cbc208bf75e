// Shared code of the dorafp8 kernels, part 5: the tensor-core GEMM of forward.cu and dgrad.cu, and the launch of
// both (launch_gemm). Both are acc[rows of M, output columns] = act x W8, differing only in which dim of W8 [N, K] is
// the reduction (K in forward, N in dgrad); docs/ARCHITECTURE.md ("csrc/") has the design notes.
//
// The orientation is an operand policy each kernel file defines (FwdOperands, DgradOperands) and passes in:
//   kSwzA                         swizzle of the activation and left rank tiles; fixes the k order of their A
//                                 fragments (frag_a), which must match the policy's B fragments;
//   load_w8(sw, r0, tid)          copies the stage's fp8 tile (reduction rows r0 .. r0 + 31) into sw;
//   w8_frags<T>(b, sw, kk, lane)  the warp's 4 converted B fragments (k16 x n8) of reduction step kk;
//   load_rank(sb, q0, tid), rank_frags(b, sb, kk, lane)
//                                 the same for the 16-bit right rank operand (B [N, r] in forward, A [r, K] in
//                                 dgrad) in chunks of kRankChunk ranks;
//   load_rank_f32(sb, q0, tid), rank_cols_f32(b, sb, q, lane)
//                                 its fp32 chunk, and rank q's values at the lane's accumulator columns:
//                                 b[nt][h] multiplies accumulator elements h and 2 + h of n8 tile nt.
// Accumulator element [mt][nt][e] of lane (g, t) is block-tile row wm0 + 16 mt + g + 8 (e >> 1); its column is the
// policy's (forward: wn0 + 8 nt + 2t + (e & 1); dgrad: an even/odd interleave, see dgrad.cu).
// Check a change here with python -m dorafp8.kernel_report --backend cuda (registers, spills) on every target.
#pragma once

#include "dora_fp8.h"  // DType (csrc/ is on the include path)
#include "launch.cuh"
#include "simt.cuh"
#include "tiles.cuh"

namespace dorafp8 {
namespace detail {

// ------------------------------------------------------------------------------------------------ tiles, warps

template <int BM_, int BN_, bool DROP_>
struct MmaTiles {
  static constexpr int BM = BM_, BN = BN_, BR = 32;  // block tile: BM rows x BN output columns; reduction per stage
  static constexpr bool DROP = DROP_;                // two activation operands and accumulators (dropout)
  // 8 warps as WARPS_M x WARPS_N; warp tile WM x 32 columns: MT m16 tiles x NT n8 tiles. With BN = 256 (1 x 8) each
  // W8 fragment is converted by one warp; with BN = 128 (2 x 4) the two warps of a column convert it both.
  static constexpr int WARPS_N = BN / 32, WARPS_M = (kThreads / 32) / WARPS_N;
  static constexpr int WM = BM / WARPS_M, MT = WM / 16, NT = 4;
  static_assert(WARPS_M * WARPS_N == kThreads / 32 && WM % 16 == 0, "mma tiles: warp layout");
  static constexpr int kActBytes = BM * BR * 2;      // one activation tile [BM][32] 16-bit (x, xm, gl or gb)
  static constexpr int kWBytes = BN * BR;            // one fp8 tile
  static constexpr int kStageBytes = (DROP ? 2 : 1) * kActBytes + kWBytes;
  static constexpr int kPipeSmem = kStages * kStageBytes;
  static_assert(kStageBytes % 16 == 0 && (BM * kRankPitchF * 4) % 16 == 0, "tiles must stay 16-byte aligned");
};

// A lane's place in the block tile: its thread index, lane (g, t) = (lane / 4, lane % 4) of the mma fragment
// layouts, and its warp's first row (wm0) and output column (wn0).
struct MmaWarp {
  int tid, lane, g, t, wm0, wn0;
};
template <class Cfg>
__device__ __forceinline__ MmaWarp mma_warp() {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // Unsigned: a power-of-two division stays a shift (signed / and % cost registers: 128 -> 171 in ptxas here).
  return MmaWarp{tid, lane, lane >> 2, lane & 3,
                 static_cast<int>(static_cast<unsigned>(warp) / Cfg::WARPS_N) * Cfg::WM,
                 static_cast<int>(static_cast<unsigned>(warp) % Cfg::WARPS_N) * 32};
}

// The first row (m0) and output column (c0) of this block's tile, in grouped order over an M x cols output.
template <class Cfg>
__device__ __forceinline__ void mma_block_origin(int64_t M, int64_t cols, int group_m, int64_t& m0, int64_t& c0) {
  int64_t bm, bc;
  grouped_tile(blockIdx.x, static_cast<uint32_t>((M + Cfg::BM - 1) / Cfg::BM),
               static_cast<uint32_t>((cols + Cfg::BN - 1) / Cfg::BN), group_m, bm, bc);
  m0 = bm * Cfg::BM;
  c0 = bc * Cfg::BN;
}

// ------------------------------------------------------------------------------------------------ main loop

// Per m16 tile of the warp: tile's A fragment (k step kk) x the 4 B fragments into acc; with TWO also tile2's into
// acc2 (dropout), interleaved so one A fragment is live at a time. acc2 unused without dropout takes no registers.
template <typename T, int SWZ, bool TWO, int MT, int NT>
__device__ __forceinline__ void mma_rows(float (&acc)[MT][NT][4], float (&acc2)[MT][NT][4], const uint8_t* tile,
                                         const uint8_t* tile2, int wm0, int kk, int lane,
                                         const uint32_t (&bfr)[NT][2]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    uint32_t afr[4];
    frag_a<SWZ>(afr, tile, wm0 + mt * 16, kk, lane);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) mma16816<T>(acc[mt][nt], afr, bfr[nt]);
    if constexpr (TWO) {
      frag_a<SWZ>(afr, tile2, wm0 + mt * 16, kk, lane);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) mma16816<T>(acc2[mt][nt], afr, bfr[nt]);
    }
  }
}

// Stage rt of the pipeline into `stage`: the activation tile(s), rows m0 .. m0 + BM x reduction rt * 32 .. + 32 of
// row-major 16-bit [M, red] matrices with row strides ld, ld2 (vec_act: 16-byte cp.async copies), and the fp8 tile.
template <class Cfg, class Op>
__device__ __forceinline__ void mma_load_stage(uint8_t* stage, const Op& op, const uint16_t* act,
                                               int64_t ld, const uint16_t* act2, int64_t ld2, int64_t M,
                                               int64_t red, int64_t m0, int rt, bool vec_act, int tid) {
  const int64_t r0 = static_cast<int64_t>(rt) * Cfg::BR;
  load_tile32<Cfg::BM, Op::kSwzA>(stage, act, ld, M, red, m0, r0, vec_act, tid);
  if (Cfg::DROP) load_tile32<Cfg::BM, Op::kSwzA>(stage + Cfg::kActBytes, act2, ld2, M, red, m0, r0, vec_act, tid);
  op.load_w8(stage + (Cfg::DROP ? 2 : 1) * Cfg::kActBytes, r0, tid);
}

// The mma of one stage: per k16 step, the warp's converted W8 fragments, then every m16 tile's A fragment of the
// activation tile into acc (and of the second one into acc2).
template <typename T, class Cfg, class Op>
__device__ __forceinline__ void mma_compute_stage(float (&acc)[Cfg::MT][Cfg::NT][4],
                                                  float (&acc2)[Cfg::MT][Cfg::NT][4], const uint8_t* stage,
                                                  const Op& op, int lane, int wm0) {
  const uint8_t* sw = stage + (Cfg::DROP ? 2 : 1) * Cfg::kActBytes;
#pragma unroll
  for (int kk = 0; kk < Cfg::BR / 16; ++kk) {
    uint32_t bfr[Cfg::NT][2];
    op.template w8_frags<T>(bfr, sw, kk, lane);
    mma_rows<T, Op::kSwzA, Cfg::DROP>(acc, acc2, stage, stage + Cfg::kActBytes, wm0, kk, lane, bfr);
  }
}

// The kStages-deep cp.async pipeline over a reduction of `red`: load_stage(s, rt) fills stage s with step rt,
// compute_stage(s) runs the mma of stage s.
template <class Cfg, class LoadStage, class ComputeStage>
__device__ __forceinline__ void mma_pipeline(int64_t red, LoadStage&& load_stage, ComputeStage&& compute_stage) {
  const int RT = static_cast<int>((red + Cfg::BR - 1) / Cfg::BR);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < RT) load_stage(s, s);
    cp_async_commit();
  }
  for (int rt = 0; rt < RT; ++rt) {
    cp_async_wait<kStages - 2>();
    block_sync();  // tile rt visible to all; everyone is done with the stage about to be refilled
    const int nr = rt + kStages - 1;
    if (nr < RT) load_stage(nr % kStages, nr);
    cp_async_commit();
    compute_stage(rt % kStages);
  }
  cp_async_wait<0>();
}

// The rank-r term of both epilogues: acc += tok [rows m0 .. m0 + BM, r] (u or v, row-major) x the policy's right rank
// operand (B^T or A), in chunks of kRankChunk through the pipeline's shared memory. rank_f32: fp32 FMA on the lane's
// own accumulator positions (rank_cols_f32); else 16-bit tiles through the mma in the policy's swizzle (kSwzA).
template <typename T, class Cfg, class Op>
__device__ __forceinline__ void mma_rank_term(float (&acc)[Cfg::MT][Cfg::NT][4], const Op& op, const void* tok,
                                              bool rank_f32, int r, int64_t M, int64_t m0, uint8_t* smem, int tid,
                                              int lane, int wm0, int g) {
  constexpr int BM = Cfg::BM, MT = Cfg::MT, NT = Cfg::NT;
  if (rank_f32) {
    const float* __restrict__ t32 = static_cast<const float*>(tok);
    float* st = reinterpret_cast<float*>(smem);  // [BM][kRankPitchF] tok chunk
    float* so = st + BM * kRankPitchF;           // the operand's chunk (load_rank_f32's layout)
    for (int q0 = 0; q0 < r; q0 += kRankChunk) {
      block_sync();  // everyone is done with the previous contents of shared memory
      load_tile_f32<BM, kRankChunk, kRankPitchF>(st, t32, r, M, r, m0, q0, tid);
      op.load_rank_f32(so, q0, tid);
      block_sync();
#pragma unroll 4
      for (int q = 0; q < kRankChunk; ++q) {
        float ta[MT][2], ov[NT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h) ta[mt][h] = sld<float>(st + (wm0 + mt * 16 + g + 8 * h) * kRankPitchF + q);
        op.rank_cols_f32(ov, so, q, lane);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][nt][e] = fmaf(ta[mt][e >> 1], ov[nt][e & 1], acc[mt][nt][e]);
      }
    }
  } else {
    const uint16_t* __restrict__ t16 = static_cast<const uint16_t*>(tok);
    uint8_t* st = smem;                        // [BM][32] tok chunk
    uint8_t* so = smem + BM * kRankChunk * 2;  // the operand's chunk (load_rank's layout)
    for (int q0 = 0; q0 < r; q0 += kRankChunk) {
      block_sync();  // everyone is done with the previous contents of shared memory
      load_tile32_scalar<BM, Op::kSwzA>(st, t16, r, M, r, m0, q0, tid);
      op.load_rank(so, q0, tid);
      block_sync();
#pragma unroll
      for (int kk = 0; kk < kRankChunk / 16; ++kk) {
        uint32_t bfr[NT][2];
        op.rank_frags(bfr, so, kk, lane);
        mma_rows<T, Op::kSwzA, false>(acc, acc, st, st, wm0, kk, lane, bfr);
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------ kernel bodies

// A family's output columns and reduction: G::kRedContig (forward) says W8's contiguous dim K is the reduction.
template <class G>
__host__ __device__ __forceinline__ int64_t gemm_cols(const typename G::Params& p) { return G::kRedContig ? p.N : p.K; }
template <class G>
__host__ __device__ __forceinline__ int64_t gemm_red(const typename G::Params& p) { return G::kRedContig ? p.K : p.N; }

// The tensor-core kernel of family G (forward_mma_kernel, dgrad_mma_kernel are this with theirs) up to its epilogue:
// the lane's and the block's place, the policy G::Operands<BN>, then acc (and acc2 with dropout) = act (and act2)
// [rows m0 .. m0 + BM, reduction 0 .. red) x W8 through the pipeline, then G::mma_epilogue on the accumulators.
template <class G, typename T, int BM, int BN, bool DROP>
__device__ __forceinline__ void mma_kernel_body(const typename G::Params& p, bool vec_act, bool vec_w) {
  using Cfg = typename G::template Cfg<BM, BN, DROP>;
  DORA_SMEM(smem);
  const MmaWarp w = mma_warp<Cfg>();
  const int64_t M = p.M, red = gemm_red<G>(p);
  int64_t m0, c0;
  mma_block_origin<Cfg>(M, gemm_cols<G>(p), p.group_m, m0, c0);
  const typename G::template Operands<BN> op{p, p.N, p.K, c0, w.wn0, vec_w};
  const uint16_t* __restrict__ act = static_cast<const uint16_t*>(G::act(p, 0));
  const uint16_t* __restrict__ act2 = static_cast<const uint16_t*>(G::act(p, 1));
  // acc: act x W8; acc2 (dropout): act2 x W8. Both share every converted W8 fragment.
  float acc[Cfg::MT][Cfg::NT][4], acc2[Cfg::MT][Cfg::NT][4];
  zero(acc);
  if (DROP) zero(acc2);
  auto stage_ptr = [&](int s) { return smem + s * Cfg::kStageBytes; };
  auto load_stage = [&](int s, int rt) {
    mma_load_stage<Cfg>(stage_ptr(s), op, act, G::ld(p, 0), act2, G::ld(p, 1), M, red, m0, rt, vec_act, w.tid);
  };
  auto compute_stage = [&](int s) { mma_compute_stage<T, Cfg>(acc, acc2, stage_ptr(s), op, w.lane, w.wm0); };
  mma_pipeline<Cfg>(red, load_stage, compute_stage);
  G::template mma_epilogue<T, Cfg>(p, op, acc, acc2, smem, w, m0, c0);
}

// The fp32 SIMT kernel of family G (forward_simt_kernel, dgrad_simt_kernel) up to its epilogue: acc[0] (and acc[1]
// with dropout) = act (and act2) x W8 for the block's kSimtTile x kSimtTile output tile at (m0, c0), then
// G::simt_epilogue, which gets the shared memory (sA, sB) back for its rank-r GEMM.
template <class G, bool DROP>
__device__ __forceinline__ void simt_kernel_body(const typename G::Params& p) {
  constexpr int NA = DROP ? 2 : 1;
  DORA_SMEM(smem);
  float* sA = reinterpret_cast<float*>(smem);
  float* sB = sA + NA * kSimtR * kSimtPitch;
  const int tid = threadIdx.x;
  const int64_t m0 = static_cast<int64_t>(blockIdx.x) * kSimtTile, c0 = static_cast<int64_t>(blockIdx.y) * kSimtTile;
  float acc[NA][4][4];
  zero(acc);
  simt_w8_gemm<G::kRedContig>(acc, static_cast<const float*>(G::act(p, 0)), G::ld(p, 0),
                              static_cast<const float*>(G::act(p, 1)), G::ld(p, 1), p.w8, p.M, p.N, p.K, m0, c0, sA, sB,
                              tid);
  G::template simt_epilogue<DROP>(p, acc, sA, sB, tid, m0, c0);
}

// For the SIMT epilogues' stores: out(i, j, ii, jj) for each of the thread's 4 x 4 outputs acc[.][i][j], at row
// ii = m0 + ty + 16 i and column jj = c0 + tx + 16 j, inside the M x cols output.
template <class Out>
__device__ __forceinline__ void simt_lane_outputs(int64_t m0, int64_t c0, int64_t M, int64_t cols, int tid, Out&& out) {
  const int tx = tid & 15, ty = tid >> 4;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t ii = m0 + ty + 16 * i;
    if (ii >= M) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t jj = c0 + tx + 16 * j;
      if (jj < cols) out(i, j, ii, jj);
    }
  }
}

// ------------------------------------------------------------------------------------------------ host side

// The launch of forward or dgrad, from the kernel file's family G:
//   G::Params, G::Cfg<BM, BN, DROP>     the params struct and the tensor-core kernel's config (its kSmem);
//   G::mma_kernel<T, BM, BN, DROP>()    the tensor-core kernel (mma_kernel_body), called (params, vec_act, vec_w);
//   G::simt_kernel<DROP>()              the fp32 SIMT kernel (simt_kernel_body), called (params) on a 2-D grid of
//                                       kSimtTile tiles;
//   G::kRedContig, G::dropout(p)        whether K is the reduction (gemm_cols, gemm_red), whether dropout runs;
//   G::act(p, i), G::ld(p, i)           activation operand i (0, and 1 with dropout) and its row stride;
//   G::Operands<BN>, G::mma_epilogue, G::simt_epilogue   the kernel bodies' operand policy and epilogues.
template <class G, typename T, int BM, int BN, bool DROP>
cudaError_t launch_gemm_mma(const typename G::Params& p, cudaStream_t stream) {
  using Cfg = typename G::template Cfg<BM, BN, DROP>;
  const bool vec_w = p.K % 16 == 0 && aligned16(p.w8);
  const bool vec_act = G::ld(p, 0) % 8 == 0 && aligned16(G::act(p, 0)) &&
                       (!DROP || (G::ld(p, 1) % 8 == 0 && aligned16(G::act(p, 1))));
  return launch(G::template mma_kernel<T, BM, BN, DROP>(), ceil_div(p.M, BM) * ceil_div(gemm_cols<G>(p), BN), 1,
                Cfg::kSmem, stream, p, vec_act, vec_w);
}

// Up to 64 rows: 64 x 128 tiles (2 x 4 warps); more: 64 x 256 (32 x 256 with dropout), 1 x 8 warps, each W8
// fragment converted once (docs/ARCHITECTURE.md, "csrc/").
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
  if (p.M <= 0 || gemm_cols<G>(p) <= 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat32: {
      const int64_t gm = ceil_div(p.M, kSimtTile), gc = ceil_div(gemm_cols<G>(p), kSimtTile);
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
