// Python binding of the dorafp8 CUDA kernels (module dorafp8._C): checks every tensor naming the argument, takes
// the current CUDA stream, launches, checks the launch. No math (kernels: dora_fp8.h; wrapper: backends/cuda.py).
// Only c10/cuda headers on purpose: ATen/cuda/CUDAContext.h pulls cusparse.h, which a bare CUDA toolkit may lack.

#include <optional>
#include <string>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "dora_fp8.h"

namespace {

#define CHECK_CUDA(x) TORCH_CHECK((x).is_cuda(), #x " must be a CUDA tensor, got one on ", (x).device())
#define CHECK_SAME_DEVICE(x, ref) \
  TORCH_CHECK((x).device() == (ref).device(), #x " is on ", (x).device(), " but " #ref " is on ", (ref).device())
#define CHECK_DTYPE(x, dt) TORCH_CHECK((x).scalar_type() == (dt), #x " must be ", (dt), ", got ", (x).scalar_type())
#define CHECK_SHAPE(x, ...)                                                                                     \
  TORCH_CHECK((x).sizes() == at::IntArrayRef({__VA_ARGS__}), #x " must have shape ", at::IntArrayRef({__VA_ARGS__}), \
              ", got ", (x).sizes())
#define CHECK_CONTIGUOUS(x) TORCH_CHECK((x).is_contiguous(), #x " must be contiguous")
#define CHECK_ROWS(x) \
  TORCH_CHECK((x).dim() == 2 && ((x).size(1) <= 1 || (x).stride(1) == 1), #x " must be 2-D with unit stride in its last dim")
// An operand or output: on ref's device, of dtype dt and the given shape, and either contiguous (CHECK_DENSE) or
// 2-D with unit stride in its last dim (CHECK_ROW_OPERAND: the kernels take its row stride).
#define CHECK_DENSE(x, ref, dt, ...) \
  do {                               \
    CHECK_SAME_DEVICE(x, ref);       \
    CHECK_DTYPE(x, dt);              \
    CHECK_SHAPE(x, __VA_ARGS__);     \
    CHECK_CONTIGUOUS(x);             \
  } while (0)
#define CHECK_ROW_OPERAND(x, ref, dt, ...) \
  do {                                     \
    CHECK_SAME_DEVICE(x, ref);             \
    CHECK_DTYPE(x, dt);                    \
    CHECK_ROWS(x);                         \
    CHECK_SHAPE(x, __VA_ARGS__);           \
  } while (0)
#define CHECK_LAUNCH(err, what) \
  TORCH_CHECK((err) == cudaSuccess, "dorafp8._C." what ": kernel launch failed: ", cudaGetErrorString(err))

dorafp8::DType compute_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return dorafp8::DType::kFloat32;
    case at::kBFloat16: return dorafp8::DType::kBFloat16;
    case at::kHalf: return dorafp8::DType::kFloat16;
    default: TORCH_CHECK(false, name, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
  return dorafp8::DType::kFloat32;  // unreachable
}

// The fp8 weight and its scale (0-dim: per tensor; [N]: per row, even when N == 1, since dgrad's operands carry a
// per-row scale already and must not see it twice); returns whether the scale is per row.
bool check_weight(const at::Tensor& w8, const at::Tensor& scale, const at::Tensor& ref) {
  CHECK_CUDA(w8);
  CHECK_SAME_DEVICE(w8, ref);
  CHECK_DTYPE(w8, at::kFloat8_e4m3fn);
  TORCH_CHECK(w8.dim() == 2, "w8 must be 2-D [N, K], got shape ", w8.sizes());
  CHECK_CONTIGUOUS(w8);
  CHECK_SAME_DEVICE(scale, w8);
  CHECK_DTYPE(scale, at::kFloat);
  CHECK_CONTIGUOUS(scale);
  const int64_t N = w8.size(0);
  TORCH_CHECK(scale.dim() == 0 || (scale.dim() == 1 && scale.size(0) == N),
              "scale must be 0-dim (per tensor) or have shape [", N, "] (per row), got shape ", scale.sizes());
  return scale.dim() == 1;
}

// A rank-r operand (u, B, v, A) or z: the compute dtype of `ref`, or fp32 (fp32 adapters on 16-bit activations).
// Returns whether it is fp32 while the compute dtype is not.
bool check_rank_dtype(const at::Tensor& t, const at::Tensor& ref, const char* name) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type() || t.scalar_type() == at::kFloat, name, " must be ",
              ref.scalar_type(), " (the compute dtype) or float32, got ", t.scalar_type());
  return t.scalar_type() != ref.scalar_type();
}

// A one-element fp32 scalar on the device (rl, rb).
void check_scalar(const at::Tensor& t, const at::Tensor& ref, const char* name) {
  TORCH_CHECK(t.device() == ref.device(), name, " is on ", t.device(), " but gl is on ", ref.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.numel() == 1, name, " must have one element, got shape ", t.sizes());
}

const void* opt_ptr(const std::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr() : nullptr; }

// ------------------------------------------------------------------------------------------------ weight_norm

// n[j] = || scale_j w8[j, :] + s (B A)[j, :] ||_2 into n (fp32 [N]).
void weight_norm(const at::Tensor& w8, const at::Tensor& scale, const at::Tensor& A, const at::Tensor& B, double s,
                 at::Tensor& n) {
  const bool per_row = check_weight(w8, scale, w8);
  const int64_t N = w8.size(0), K = w8.size(1);
  CHECK_SAME_DEVICE(A, w8);
  TORCH_CHECK(A.dim() == 2 && A.size(1) == K, "A must have shape [r, ", K, "], got ", A.sizes());
  const int64_t r = A.size(0);
  TORCH_CHECK(r <= INT32_MAX, "A: rank too large");
  const dorafp8::DType adt = compute_dtype(A, "A");
  CHECK_CONTIGUOUS(A);
  CHECK_DENSE(B, w8, A.scalar_type(), N, r);
  CHECK_DENSE(n, w8, at::kFloat, N);

  const c10::cuda::CUDAGuard guard(w8.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(w8.device().index()).stream();
  const int splits = dorafp8::weight_norm_splits(N, K);
  at::Tensor partial;  // [splits, N] sums of squares per K split, only when K is split
  if (splits > 1) partial = at::empty({splits, N}, w8.options().dtype(at::kFloat));

  dorafp8::WeightNormParams p{};
  p.w8 = static_cast<const uint8_t*>(w8.data_ptr());
  p.scale = scale.data_ptr<float>();
  p.A = A.data_ptr();
  p.B = B.data_ptr();
  p.partial = splits > 1 ? partial.data_ptr<float>() : nullptr;
  p.n = n.data_ptr<float>();
  p.N = N;
  p.K = K;
  p.r = static_cast<int>(r);
  p.splits = splits;
  p.s = static_cast<float>(s);
  p.scale_per_row = per_row;
  p.adapter_dtype = adt;
  CHECK_LAUNCH(dorafp8::weight_norm(p, stream), "weight_norm");
}

// ------------------------------------------------------------------------------------------------ forward

// y (and z) of the contract, written into the given outputs. c None: plain FP8 linear (u, B, xm, z must be None).
// xm: x * mask (dropout's kept part of x, unscaled) with p the dropout probability, or None (no dropout).
// u, B: the compute dtype or both fp32; z: the compute dtype or fp32.
void forward(const at::Tensor& x, const at::Tensor& w8, const at::Tensor& scale, const std::optional<at::Tensor>& bias_,
             const std::optional<at::Tensor>& c_, const std::optional<at::Tensor>& u_,
             const std::optional<at::Tensor>& B_, double s, const std::optional<at::Tensor>& xm_, double p_drop,
             at::Tensor& y, const std::optional<at::Tensor>& z_) {
  CHECK_CUDA(x);
  CHECK_ROWS(x);
  const dorafp8::DType dt = compute_dtype(x, "x");
  const bool per_row = check_weight(w8, scale, x);
  const int64_t M = x.size(0), N = w8.size(0), K = w8.size(1);
  TORCH_CHECK(x.size(1) == K, "x must have ", K, " columns (w8 is [", N, ", ", K, "]), got shape ", x.sizes());
  CHECK_DENSE(y, x, x.scalar_type(), M, N);
  if (bias_.has_value()) {
    const at::Tensor& bias = *bias_;
    CHECK_DENSE(bias, x, x.scalar_type(), N);
  }
  int64_t r = 0;
  bool rank_f32 = false, z_f32 = false;
  if (c_.has_value()) {
    const at::Tensor& c = *c_;
    CHECK_DENSE(c, x, at::kFloat, N);
    TORCH_CHECK(u_.has_value() && B_.has_value(), "u and B are required when c is given");
    const at::Tensor& u = *u_;
    const at::Tensor& B = *B_;
    TORCH_CHECK(u.dim() == 2 && u.size(0) == M, "u must have shape [", M, ", r], got ", u.sizes());
    r = u.size(1);
    TORCH_CHECK(r <= INT32_MAX, "u: rank too large");
    CHECK_SAME_DEVICE(u, x);
    rank_f32 = check_rank_dtype(u, x, "u");
    CHECK_CONTIGUOUS(u);
    CHECK_DENSE(B, x, u.scalar_type(), N, r);
    if (xm_.has_value()) {
      const at::Tensor& xm = *xm_;
      CHECK_ROW_OPERAND(xm, x, x.scalar_type(), M, K);
      TORCH_CHECK(p_drop >= 0.0 && p_drop < 1.0, "p must be in [0, 1) with xm, got ", p_drop);
    }
    if (z_.has_value()) {
      const at::Tensor& z = *z_;
      CHECK_SAME_DEVICE(z, x);
      z_f32 = check_rank_dtype(z, x, "z");
      CHECK_SHAPE(z, M, N);
      CHECK_CONTIGUOUS(z);
    }
  } else {
    TORCH_CHECK(!u_.has_value() && !B_.has_value() && !xm_.has_value() && !z_.has_value(),
                "u, B, xm and z must be None when c is None (plain FP8 linear)");
  }

  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  dorafp8::ForwardParams p{};
  p.x = x.data_ptr();
  p.xm = opt_ptr(xm_);
  p.w8 = static_cast<const uint8_t*>(w8.data_ptr());
  p.scale = scale.data_ptr<float>();
  p.bias = opt_ptr(bias_);
  p.c = c_.has_value() ? c_->data_ptr<float>() : nullptr;
  p.u = opt_ptr(u_);
  p.B = opt_ptr(B_);
  p.y = y.data_ptr();
  p.z = z_.has_value() ? z_->data_ptr() : nullptr;
  p.M = M;
  p.N = N;
  p.K = K;
  p.ldx = x.stride(0);
  p.ldxm = xm_.has_value() ? xm_->stride(0) : 0;
  p.r = static_cast<int>(r);
  p.s = static_cast<float>(s);
  p.inv_keep = static_cast<float>(xm_.has_value() ? 1.0 / (1.0 - p_drop) : 1.0);
  p.scale_per_row = per_row;
  p.rank_f32 = rank_f32;
  p.z_f32 = z_f32;
  CHECK_LAUNCH(dorafp8::forward(p, dt, stream), "forward");
}

// ------------------------------------------------------------------------------------------------ dgrad

// dx of the contract from the prepared operands (gl, gb carry per-row scales; rl, rb: fp32 one-element scalars).
// v None: plain FP8 linear (A, mask, gb, rb must be None); mask given: dropout (gb, rb required).
void dgrad(const at::Tensor& gl, const at::Tensor& rl, const at::Tensor& w8, const at::Tensor& scale,
           const std::optional<at::Tensor>& v_, const std::optional<at::Tensor>& A_, double s,
           const std::optional<at::Tensor>& mask_, double p_drop, const std::optional<at::Tensor>& gb_,
           const std::optional<at::Tensor>& rb_, at::Tensor& dx) {
  CHECK_CUDA(gl);
  CHECK_ROWS(gl);
  const dorafp8::DType dt = compute_dtype(gl, "gl");
  const bool per_row = check_weight(w8, scale, gl);
  const int64_t M = gl.size(0), N = w8.size(0), K = w8.size(1);
  TORCH_CHECK(gl.size(1) == N, "gl must have ", N, " columns (w8 is [", N, ", ", K, "]), got shape ", gl.sizes());
  check_scalar(rl, gl, "rl");
  CHECK_DENSE(dx, gl, gl.scalar_type(), M, K);
  int64_t r = 0;
  bool rank_f32 = false;
  if (v_.has_value()) {
    TORCH_CHECK(A_.has_value(), "A is required when v is given");
    const at::Tensor& v = *v_;
    const at::Tensor& A = *A_;
    TORCH_CHECK(v.dim() == 2 && v.size(0) == M, "v must have shape [", M, ", r], got ", v.sizes());
    r = v.size(1);
    TORCH_CHECK(r <= INT32_MAX, "v: rank too large");
    CHECK_SAME_DEVICE(v, gl);
    rank_f32 = check_rank_dtype(v, gl, "v");
    CHECK_CONTIGUOUS(v);
    CHECK_DENSE(A, gl, v.scalar_type(), r, K);
    if (mask_.has_value()) {
      const at::Tensor& mask = *mask_;
      CHECK_ROW_OPERAND(mask, gl, at::kBool, M, K);
      TORCH_CHECK(p_drop >= 0.0 && p_drop < 1.0, "p must be in [0, 1) with a mask, got ", p_drop);
      TORCH_CHECK(gb_.has_value() && rb_.has_value(), "gb and rb are required with a mask (dropout)");
      const at::Tensor& gb = *gb_;
      CHECK_ROW_OPERAND(gb, gl, gl.scalar_type(), M, N);
      check_scalar(*rb_, gl, "rb");
    } else {
      TORCH_CHECK(!gb_.has_value() && !rb_.has_value(), "gb and rb must be None without a mask (no dropout)");
    }
  } else {
    TORCH_CHECK(!A_.has_value() && !mask_.has_value() && !gb_.has_value() && !rb_.has_value(),
                "A, mask, gb and rb must be None when v is None (plain FP8 linear)");
  }

  const c10::cuda::CUDAGuard guard(gl.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(gl.device().index()).stream();
  dorafp8::DgradParams p{};
  p.gl = gl.data_ptr();
  p.gb = opt_ptr(gb_);
  p.rl = rl.data_ptr<float>();
  p.rb = rb_.has_value() ? rb_->data_ptr<float>() : nullptr;
  p.w8 = static_cast<const uint8_t*>(w8.data_ptr());
  p.scale = scale.data_ptr<float>();
  p.v = opt_ptr(v_);
  p.A = opt_ptr(A_);
  p.mask = mask_.has_value() ? static_cast<const uint8_t*>(mask_->data_ptr()) : nullptr;
  p.dx = dx.data_ptr();
  p.M = M;
  p.N = N;
  p.K = K;
  p.ldgl = gl.stride(0);
  p.ldgb = gb_.has_value() ? gb_->stride(0) : 0;
  p.ldmask = mask_.has_value() ? mask_->stride(0) : 0;
  p.r = static_cast<int>(r);
  p.s = static_cast<float>(s);
  p.inv_keep = static_cast<float>(mask_.has_value() ? 1.0 / (1.0 - p_drop) : 1.0);
  p.scale_per_row = per_row;
  p.rank_f32 = rank_f32;
  CHECK_LAUNCH(dorafp8::dgrad(p, dt, stream), "dgrad");
}

// "" when this build has kernel code for the device, else the CUDA error's text.
std::string kernel_image_error(int64_t device_index) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
  return dorafp8::kernel_image_error();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "dorafp8 CUDA kernels: DoRA on FP8 e4m3 base weights (see dorafp8/backends/__init__.py for the contract)";
  m.def("weight_norm", &weight_norm, "n = ||scale * w8 + s * B @ A|| per row, into n (fp32 [N])", py::arg("w8"),
        py::arg("scale"), py::arg("A"), py::arg("B"), py::arg("s"), py::arg("n"));
  m.def("forward", &forward, "DoRA / plain FP8 linear forward into y (and z)", py::arg("x"), py::arg("w8"),
        py::arg("scale"), py::arg("bias"), py::arg("c"), py::arg("u"), py::arg("B"), py::arg("s"), py::arg("xm"),
        py::arg("p"), py::arg("y"), py::arg("z"));
  m.def("dgrad", &dgrad, "DoRA / plain FP8 linear input gradient from the prepared operands, into dx",
        py::arg("gl"), py::arg("rl"), py::arg("w8"), py::arg("scale"), py::arg("v"), py::arg("A"), py::arg("s"),
        py::arg("mask"), py::arg("p"), py::arg("gb"), py::arg("rb"), py::arg("dx"));
  m.def("kernel_image_error", &kernel_image_error,
        "'' when this build has kernel code for the given CUDA device, else why not", py::arg("device_index"));
#ifdef DORAFP8_SOURCES  // setup.py's: build_spec.sources_hash of the csrc/ built (dorafp8/backends/cuda.py checks it)
#define DORAFP8_STR_(x) #x
#define DORAFP8_STR(x) DORAFP8_STR_(x)
  m.attr("SOURCES") = DORAFP8_STR(DORAFP8_SOURCES);
#endif
}
