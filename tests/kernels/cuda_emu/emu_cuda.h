// CPU emulation of the handful of CUDA primitives the kernels use (csrc/common/primitives.cuh includes this file in
// their place under DORA_EMULATE), so the real kernel source can run (slowly) on a machine without a GPU. Every
// definition is inline: each kernel file includes it in a translation unit of its own. One OS thread per CUDA
// thread, blocks one after another. Warp collectives (ldmatrix, mma, shuffles) exchange operands through per-warp
// scratch + a warp barrier, and compute their results from the PTX ISA's fragment layouts, written here
// independently of the kernels. Shared memory accesses are checked for races:
// a byte written by one thread and accessed by another between the same two __syncthreads, a cp.async destination
// read before its wait_group (by anyone) or touched by another thread in the epoch it was issued, are errors.
// cp.async copies land at wait_group time (the latest legal moment).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime_api.h>
#include <vector_functions.h>

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#undef __global__
#undef __device__
#undef __host__
#define __global__
#define __device__
#define __host__
#undef __forceinline__
#define __forceinline__ inline
#undef __launch_bounds__
#define __launch_bounds__(...)

namespace emu {

inline std::atomic<long> g_errors{0};
inline std::atomic<long> g_error_prints{0};
#define EMU_ERR(...)                                                     \
  do {                                                                   \
    ::emu::g_errors++;                                                   \
    if (::emu::g_error_prints++ < 20) {                                  \
      std::fprintf(stderr, "[emu] " __VA_ARGS__);                        \
      std::fprintf(stderr, "\n");                                        \
    }                                                                    \
  } while (0)

struct Shadow {
  int w_tid = -1;
  long w_epoch = -1;
  int r_tid = -1;  // -2: several readers
  long r_epoch = -1;
  int pend_tid = -1;
};

struct PendingCopy {
  uint8_t* dst;
  const uint8_t* src;
  int bytes;
};

struct Block;
struct Thread {
  Block* blk;
  int tid;
  std::vector<std::vector<PendingCopy>> groups;  // committed groups, oldest first
  std::vector<PendingCopy> open;                 // not yet committed
};

struct EpochBump {
  std::atomic<long>* epoch;
  void operator()() noexcept { (*epoch)++; }
};

struct Block {
  int nthreads;
  size_t smem_bytes;
  uint8_t* smem;
  std::vector<Shadow> shadow;
  std::mutex mu;
  std::atomic<long> epoch{0};
  std::unique_ptr<std::barrier<EpochBump>> bar;
  std::vector<std::unique_ptr<std::barrier<>>> warp_bar;
  // Per warp: 2 alternating scratch buffers x 32 lanes x 64 bytes.
  std::vector<uint8_t> scratch;
  std::vector<int> coll_count;  // per (warp, lane): collectives done (selects the scratch buffer)
};

inline thread_local uint3 t_threadIdx, t_blockIdx;
inline thread_local Thread* t_thr = nullptr;
inline uint3 g_gridDim, g_blockDim;

inline uint8_t* block_smem() { return t_thr->blk->smem; }

inline bool in_smem(const void* p, size_t n) {
  const Block* b = t_thr->blk;
  const uint8_t* q = static_cast<const uint8_t*>(p);
  return q >= b->smem && q + n <= b->smem + b->smem_bytes;
}

inline void check_access(const void* p, size_t n, bool write, const char* what) {
  Block* b = t_thr->blk;
  if (!in_smem(p, n)) {
    EMU_ERR("%s of %zu bytes outside shared memory (block %u,%u thread %d, offset %ld of %zu)", what, n,
            t_blockIdx.x, t_blockIdx.y, t_thr->tid, (long)(static_cast<const uint8_t*>(p) - b->smem), b->smem_bytes);
    std::abort();
  }
  const long ep = b->epoch.load();
  const int me = t_thr->tid;
  std::lock_guard<std::mutex> lk(b->mu);
  const size_t off = static_cast<const uint8_t*>(p) - b->smem;
  for (size_t i = off; i < off + n; ++i) {
    Shadow& s = b->shadow[i];
    if (s.pend_tid >= 0) {
      EMU_ERR("%s at smem offset %zu by thread %d while a cp.async of thread %d to it is in flight (block %u,%u)",
              what, i, me, s.pend_tid, t_blockIdx.x, t_blockIdx.y);
    }
    if (s.w_epoch == ep && s.w_tid != me) {
      EMU_ERR("%s at smem offset %zu by thread %d races with a write by thread %d in the same barrier interval "
              "(block %u,%u, epoch %ld)", what, i, me, s.w_tid, t_blockIdx.x, t_blockIdx.y, ep);
    }
    if (write) {
      if (s.r_epoch == ep && s.r_tid != me) {
        EMU_ERR("write at smem offset %zu by thread %d races with a read by thread %d in the same barrier interval "
                "(block %u,%u)", i, me, s.r_tid, t_blockIdx.x, t_blockIdx.y);
      }
      s.w_tid = me;
      s.w_epoch = ep;
    } else {
      if (s.r_epoch == ep && s.r_tid != me) s.r_tid = -2;
      else s.r_tid = me;
      s.r_epoch = ep;
    }
  }
}

// ---- warp collectives
inline int lane_id() { return t_thr->tid & 31; }
inline int warp_id() { return t_thr->tid >> 5; }
inline uint8_t* warp_scratch(int lane) {
  Block* b = t_thr->blk;
  const int w = warp_id();
  const int buf = b->coll_count[t_thr->tid] & 1;
  return b->scratch.data() + ((size_t)(w * 2 + buf) * 32 + lane) * 64;
}
// Each lane deposits `n` bytes, waits for the warp, then may read any lane's deposit via warp_scratch(lane).
inline void warp_exchange(const void* mine, size_t n) {
  std::memcpy(warp_scratch(lane_id()), mine, n);
  t_thr->blk->warp_bar[warp_id()]->arrive_and_wait();
}
inline void warp_done() { t_thr->blk->coll_count[t_thr->tid]++; }

}  // namespace emu

#define threadIdx (::emu::t_threadIdx)
#define blockIdx (::emu::t_blockIdx)
#define gridDim (::emu::g_gridDim)
#define blockDim (::emu::g_blockDim)

namespace emu {

// Runs fn as every thread of every block of the grid.
inline void launch(dim3 grid, dim3 block, int smem_bytes, std::function<void()> fn) {
  const int nthreads = (int)(block.x * block.y * block.z);
  if (nthreads % 32 != 0) { EMU_ERR("block of %d threads is not whole warps", nthreads); return; }
  g_gridDim = make_uint3(grid.x, grid.y, grid.z);
  g_blockDim = make_uint3(block.x, block.y, block.z);
  for (unsigned by = 0; by < grid.y; ++by)
    for (unsigned bx = 0; bx < grid.x; ++bx) {
      Block b;
      b.nthreads = nthreads;
      b.smem_bytes = (size_t)smem_bytes;
      b.smem = new uint8_t[smem_bytes > 0 ? smem_bytes : 1];  // exact size: ASan sees overruns
      std::memset(b.smem, 0xA5, smem_bytes);                  // garbage, not zeros
      b.shadow.assign(smem_bytes, Shadow{});
      b.bar = std::make_unique<std::barrier<EpochBump>>(nthreads, EpochBump{&b.epoch});
      for (int w = 0; w < nthreads / 32; ++w) b.warp_bar.push_back(std::make_unique<std::barrier<>>(32));
      b.scratch.assign((size_t)(nthreads / 32) * 2 * 32 * 64, 0);
      b.coll_count.assign(nthreads, 0);
      std::vector<std::thread> ts;
      std::vector<Thread> thr(nthreads);
      for (int t = 0; t < nthreads; ++t) {
        thr[t].blk = &b;
        thr[t].tid = t;
        ts.emplace_back([&, t, bx, by]() {
          t_thr = &thr[t];
          t_threadIdx = make_uint3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
          t_blockIdx = make_uint3(bx, by, 0);
          fn();
          if (!thr[t].open.empty() || !thr[t].groups.empty())
            EMU_ERR("thread %d of block %u,%u exits with cp.async copies never waited for", t, bx, by);
          t_thr = nullptr;
        });
      }
      for (auto& th : ts) th.join();
      delete[] b.smem;
    }
}

}  // namespace emu

namespace dorafp8 {
namespace detail {

#define DORA_SMEM(name) uint8_t* name = ::emu::block_smem()
#define DORA_LAUNCH(kernel, grid, block, smem, stream, ...) \
  ::emu::launch(grid, block, smem, [=]() { kernel(__VA_ARGS__); })

inline void block_sync() {
  // Everything before the barrier is ordered before everything after: bump the epoch (barrier completion).
  ::emu::t_thr->blk->bar->arrive_and_wait();
}

template <typename V>
inline V sld(const void* p) {
  ::emu::check_access(p, sizeof(V), false, "read");
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}
template <typename V>
inline void sst(void* p, V v) {
  ::emu::check_access(p, sizeof(V), true, "write");
  std::memcpy(p, &v, sizeof(V));
}

inline void cp_async_16(void* dst, const void* src, int src_bytes) {
  using namespace ::emu;
  if (src_bytes < 0 || src_bytes > 16) EMU_ERR("cp.async src-size %d", src_bytes);
  if ((reinterpret_cast<uintptr_t>(dst) & 15) || (reinterpret_cast<uintptr_t>(src) & 15))
    EMU_ERR("cp.async 16 with a misaligned address (dst %p, src %p)", dst, src);
  if (!in_smem(dst, 16)) { EMU_ERR("cp.async destination outside shared memory"); std::abort(); }
  // Issue: like a write by this thread now (WAR against readers in this interval), then in flight.
  check_access(dst, 16, true, "cp.async issue");
  Block* b = t_thr->blk;
  {
    std::lock_guard<std::mutex> lk(b->mu);
    const size_t off = static_cast<uint8_t*>(dst) - b->smem;
    for (size_t i = off; i < off + 16; ++i) {
      if (b->shadow[i].pend_tid >= 0) EMU_ERR("two cp.async in flight to smem offset %zu", i);
      b->shadow[i].pend_tid = t_thr->tid;
    }
  }
  // Read the source now (global memory does not change during a kernel); an out-of-bounds read shows under ASan.
  PendingCopy pc{static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), src_bytes};
  t_thr->open.push_back(pc);
}
inline void cp_async_commit() {
  ::emu::t_thr->groups.push_back(std::move(::emu::t_thr->open));
  ::emu::t_thr->open.clear();
}
template <int N>
inline void cp_async_wait() {
  using namespace ::emu;
  Thread* th = t_thr;
  Block* b = th->blk;
  while ((int)th->groups.size() > N) {
    for (const PendingCopy& pc : th->groups.front()) {
      uint8_t tmp[16];
      std::memset(tmp, 0, 16);
      if (pc.bytes > 0) std::memcpy(tmp, pc.src, pc.bytes);
      {
        std::lock_guard<std::mutex> lk(b->mu);
        const size_t off = pc.dst - b->smem;
        for (size_t i = off; i < off + 16; ++i) b->shadow[i].pend_tid = -1;
      }
      check_access(pc.dst, 16, true, "cp.async landing");
      std::memcpy(pc.dst, tmp, 16);
    }
    th->groups.erase(th->groups.begin());
  }
}

// ldmatrix .x4: lanes 8i..8i+7 give the row addresses of matrix i (16 bytes each). Without .trans lane l receives,
// in d[i], row l/4 of matrix i, 16-bit elements 2(l%4) (low half) and 2(l%4)+1. With .trans it receives the
// transposed matrix's: elements [2(l%4)][l/4] (low) and [2(l%4)+1][l/4] (high).
inline void ldsm_impl(uint32_t (&d)[4], const void* p, bool trans) {
  using namespace ::emu;
  if (reinterpret_cast<uintptr_t>(p) & 15) EMU_ERR("ldmatrix row address not 16-byte aligned");
  check_access(p, 16, false, "ldmatrix");
  const uintptr_t mine = reinterpret_cast<uintptr_t>(p);
  warp_exchange(&mine, sizeof(mine));
  const int l = lane_id();
  for (int i = 0; i < 4; ++i) {
    uint16_t lo, hi;
    if (!trans) {
      uintptr_t row;
      std::memcpy(&row, warp_scratch(8 * i + l / 4), sizeof(row));
      std::memcpy(&lo, reinterpret_cast<const uint8_t*>(row) + 2 * (2 * (l % 4)), 2);
      std::memcpy(&hi, reinterpret_cast<const uint8_t*>(row) + 2 * (2 * (l % 4) + 1), 2);
    } else {
      uintptr_t r0, r1;
      std::memcpy(&r0, warp_scratch(8 * i + 2 * (l % 4)), sizeof(r0));
      std::memcpy(&r1, warp_scratch(8 * i + 2 * (l % 4) + 1), sizeof(r1));
      std::memcpy(&lo, reinterpret_cast<const uint8_t*>(r0) + 2 * (l / 4), 2);
      std::memcpy(&hi, reinterpret_cast<const uint8_t*>(r1) + 2 * (l / 4), 2);
    }
    d[i] = (uint32_t)lo | ((uint32_t)hi << 16);
  }
  warp_done();
}
inline void ldsm_x4(uint32_t (&d)[4], const void* p) { ldsm_impl(d, p, false); }
inline void ldsm_x4_trans(uint32_t (&d)[4], const void* p) { ldsm_impl(d, p, true); }

// mma.m16n8k16 row.col, fp32 accumulate. PTX ISA fragment layouts (groupID = lane>>2, tig = lane%4):
//  A (16x16): reg0 = (row g, k 2tig, 2tig+1), reg1 = (row g+8, same k), reg2 = (row g, k 2tig+8, +9), reg3 = (g+8, ..)
//  B (16x8):  reg0 = (k 2tig, 2tig+1; col g), reg1 = (k 2tig+8, 2tig+9; col g)
//  C/D:       c0, c1 = (row g, col 2tig, 2tig+1), c2, c3 = (row g+8, same cols)
inline float emu_h2f(uint16_t h, bool bf) {
  if (bf) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  __half_raw r;
  r.x = h;
  return __half2float(__half(r));
}
inline void mma_impl(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], bool bf) {
  using namespace ::emu;
  uint32_t mine[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
  warp_exchange(mine, sizeof(mine));
  auto reg_of = [&](int lane, int r) {
    uint32_t v[6];
    std::memcpy(v, warp_scratch(lane), sizeof(v));
    return v[r];
  };
  auto A = [&](int row, int k) {
    const int lane = (row & 7) * 4 + (k & 7) / 2;
    const int r = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
    const uint32_t v = reg_of(lane, r);
    return emu_h2f((uint16_t)((k & 1) ? v >> 16 : v & 0xffff), bf);
  };
  auto B = [&](int k, int n) {
    const int lane = n * 4 + (k & 7) / 2;
    const uint32_t v = reg_of(lane, 4 + (k >= 8 ? 1 : 0));
    return emu_h2f((uint16_t)((k & 1) ? v >> 16 : v & 0xffff), bf);
  };
  const int l = lane_id(), g = l >> 2, tig = l & 3;
  float out[4];
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e >> 1), col = 2 * tig + (e & 1);
    double acc = d[e];
    for (int k = 0; k < 16; ++k) acc += (double)A(row, k) * (double)B(k, col);
    out[e] = (float)acc;
  }
  for (int e = 0; e < 4; ++e) d[e] = out[e];
  warp_done();
}
inline void mma_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) { mma_impl(d, a, b, true); }
inline void mma_f16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) { mma_impl(d, a, b, false); }

// __shfl_xor_sync butterfly, round by round like the hardware.
inline float warp_sum(float v) {
  using namespace ::emu;
  for (int o = 16; o > 0; o >>= 1) {
    warp_exchange(&v, sizeof(v));
    float other;
    std::memcpy(&other, warp_scratch(lane_id() ^ o), sizeof(other));
    warp_done();
    v += other;
  }
  return v;
}
// __byte_perm(x, 0, sel): result byte i = byte (sel >> 4i) & 7 of the 8-byte value {0 : x}.
inline uint32_t byte_perm(uint32_t x, uint32_t sel) {
  const uint64_t src = (uint64_t)x;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) {
    const int b = (sel >> (4 * i)) & 7;
    r |= (uint32_t)((src >> (8 * b)) & 0xff) << (8 * i);
  }
  return r;
}
inline float div_rn(float a, float b) { return a / b; }
inline float sqrt_rn(float a) { return std::sqrt(a); }

template <typename K>
cudaError_t allow_smem(K, int bytes) {
  return bytes <= 227 * 1024 ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace detail
}  // namespace dorafp8
