// C entry points running the CUDA launchers of csrc/ (and so their kernels) under the CPU emulator. Inputs are copied
// into exactly-sized heap buffers (so that ASan reports any out-of-bounds read), outputs start as NaN bytes.
//
// The kernel files (setup.py's CUDA_SOURCES) are not included here: tests/kernels/test_cuda_emulated.py compiles each
// of them as a translation unit of its own beside this one, all with -DDORA_EMULATE, as the extension build compiles
// them.
#ifndef DORA_EMULATE
#error "build with -DDORA_EMULATE (see tests/kernels/test_cuda_emulated.py)"
#endif
#include "dora_fp8.h"

#include "common/tiles.cuh"  // grouped_tile, for emu_grouped_tiles below

#include <new>

static int g_sms = 132;
extern "C" {
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
cudaError_t cudaGetDevice(int* d) { *d = 0; return cudaSuccess; }
cudaError_t cudaDeviceGetAttribute(int* v, enum cudaDeviceAttr, int) { *v = g_sms; return cudaSuccess; }
cudaError_t cudaFuncGetAttributes(struct cudaFuncAttributes*, const void*) { return cudaSuccess; }
const char* cudaGetErrorString(cudaError_t) { return "emulated cuda error"; }
}

namespace {
struct Owned {
  std::vector<std::pair<uint8_t*, size_t>> bufs;
  ~Owned() { for (auto& b : bufs) ::operator delete[](b.first, std::align_val_t(16)); }
  uint8_t* alloc(size_t n) {
    auto* p = static_cast<uint8_t*>(::operator new[](n ? n : 1, std::align_val_t(16)));
    bufs.push_back({p, n});
    return p;
  }
  template <class T> const T* in(const T* src, size_t bytes) {
    if (src == nullptr) return nullptr;
    uint8_t* d = alloc(bytes);
    std::memcpy(d, src, bytes);
    return reinterpret_cast<const T*>(d);
  }
  uint8_t* out(size_t bytes) { uint8_t* d = alloc(bytes); std::memset(d, 0xff, bytes); return d; }
};
size_t esize(int dt) { return dt == 0 ? 4 : 2; }
size_t extent(int64_t rows, int64_t cols, int64_t ld) { return rows == 0 ? 0 : (size_t)((rows - 1) * ld + cols); }
}  // namespace

extern "C" long emu_weight_norm(const uint8_t* w8, const float* scale, int per_row, const void* A, const void* B,
                                int adt, int64_t N, int64_t K, int r, float s, float* n_out, int sms) {
  g_sms = sms;
  const long e0 = emu::g_errors.load();
  Owned o;
  dorafp8::WeightNormParams p{};
  p.w8 = o.in(w8, N * K);
  p.scale = o.in(scale, (per_row ? N : 1) * 4);
  p.A = o.in(static_cast<const uint8_t*>(A), (size_t)r * K * esize(adt));
  p.B = o.in(static_cast<const uint8_t*>(B), (size_t)N * r * esize(adt));
  p.N = N; p.K = K; p.r = r; p.s = s; p.scale_per_row = per_row != 0;
  p.adapter_dtype = static_cast<dorafp8::DType>(adt);
  p.splits = dorafp8::weight_norm_splits(N, K);
  p.partial = p.splits > 1 ? reinterpret_cast<float*>(o.out((size_t)p.splits * N * 4)) : nullptr;
  p.n = reinterpret_cast<float*>(o.out(N * 4));
  if (dorafp8::weight_norm(p, nullptr) != cudaSuccess) return -1;
  std::memcpy(n_out, p.n, N * 4);
  std::fprintf(stderr, "[emu] weight_norm N=%ld K=%ld r=%d splits=%d\n", (long)N, (long)K, r, p.splits);
  return emu::g_errors.load() - e0;
}

extern "C" long emu_forward(int dt, const void* x, int64_t ldx, const void* xm, int64_t ldxm, const uint8_t* w8,
                            const float* scale, int per_row, const void* bias, const float* c, const void* u,
                            const void* B, int rank_f32, int64_t M, int64_t N, int64_t K, int r, float s,
                            float inv_keep, void* y, void* z, int z_f32, int group_m) {
  const long e0 = emu::g_errors.load();
  const size_t es = esize(dt), rs = rank_f32 ? 4 : es, zs = z_f32 ? 4 : es;
  Owned o;
  dorafp8::ForwardParams p{};
  p.x = o.in(static_cast<const uint8_t*>(x), extent(M, K, ldx) * es);
  p.xm = o.in(static_cast<const uint8_t*>(xm), extent(M, K, ldxm) * es);
  p.w8 = o.in(w8, N * K);
  p.scale = o.in(scale, (per_row ? N : 1) * 4);
  p.bias = o.in(static_cast<const uint8_t*>(bias), N * es);
  p.c = o.in(c, N * 4);
  p.u = o.in(static_cast<const uint8_t*>(u), (size_t)M * r * rs);
  p.B = o.in(static_cast<const uint8_t*>(B), (size_t)N * r * rs);
  p.y = o.out(M * N * es);
  p.z = z ? o.out(M * N * zs) : nullptr;
  p.M = M; p.N = N; p.K = K; p.ldx = ldx; p.ldxm = ldxm; p.r = r; p.s = s; p.inv_keep = inv_keep;
  p.scale_per_row = per_row != 0;
  p.rank_f32 = rank_f32 != 0; p.z_f32 = z_f32 != 0; p.group_m = group_m;
  if (dorafp8::forward(p, static_cast<dorafp8::DType>(dt), nullptr) != cudaSuccess) return -1;
  std::memcpy(y, p.y, M * N * es);
  if (z) std::memcpy(z, p.z, M * N * zs);
  return emu::g_errors.load() - e0;
}

extern "C" long emu_dgrad(int dt, const void* gl, int64_t ldgl, const void* gb, int64_t ldgb, const float* rl,
                          const float* rb, const uint8_t* w8, const float* scale, int per_row, const void* v,
                          const void* A, int rank_f32, const uint8_t* mask, int64_t ldmask, int64_t M, int64_t N,
                          int64_t K, int r, float s, float inv_keep, void* dx, int group_m) {
  const long e0 = emu::g_errors.load();
  const size_t es = esize(dt), rs = rank_f32 ? 4 : es;
  Owned o;
  dorafp8::DgradParams p{};
  p.gl = o.in(static_cast<const uint8_t*>(gl), extent(M, N, ldgl) * es);
  p.gb = o.in(static_cast<const uint8_t*>(gb), extent(M, N, ldgb) * es);
  p.rl = o.in(rl, 4);
  p.rb = o.in(rb, 4);
  p.w8 = o.in(w8, N * K);
  p.scale = o.in(scale, (per_row ? N : 1) * 4);
  p.v = o.in(static_cast<const uint8_t*>(v), (size_t)M * r * rs);
  p.A = o.in(static_cast<const uint8_t*>(A), (size_t)r * K * rs);
  p.mask = o.in(mask, extent(M, K, ldmask));
  p.dx = o.out(M * K * es);
  p.M = M; p.N = N; p.K = K; p.ldgl = ldgl; p.ldgb = ldgb; p.ldmask = ldmask; p.r = r; p.s = s;
  p.inv_keep = inv_keep; p.scale_per_row = per_row != 0; p.rank_f32 = rank_f32 != 0; p.group_m = group_m;
  if (dorafp8::dgrad(p, static_cast<dorafp8::DType>(dt), nullptr) != cudaSuccess) return -1;
  std::memcpy(dx, p.dx, M * K * es);
  return emu::g_errors.load() - e0;
}

// The grouped launch order's tile of linear blocks pid0 .. pid0 + count - 1, for a direct check that it is a bijection.
extern "C" void emu_grouped_tiles(int64_t tiles_m, int64_t tiles_n, int group, int64_t pid0, int64_t count,
                                  int64_t* bm, int64_t* bn) {
  for (int64_t i = 0; i < count; ++i)
    dorafp8::detail::grouped_tile(static_cast<uint32_t>(pid0 + i), static_cast<uint32_t>(tiles_m),
                                  static_cast<uint32_t>(tiles_n), group, bm[i], bn[i]);
}
