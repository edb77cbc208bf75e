// Python binding of the dorafp8 CUDA kernels (module dorafp8._C). Checks every tensor (device, dtype, shape,
// layout) naming the argument in the error, takes the current CUDA stream, launches, checks the launch. No math:
// the kernels and their launchers are in dora_fp8.cu, the contract in dorafp8/backends.py, and the Python wrapper
// that allocates the outputs is dorafp8/cuda_backend.py.
//
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

// The fp8 weight and its scale; returns whether the scale is per row.
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
  TORCH_CHECK(scale.numel() == 1 || (scale.dim() == 1 && scale.size(0) == N),
              "scale must have one element or shape [", N, "], got shape ", scale.sizes());
  return scale.numel() != 1;
}

const void* opt_ptr(const std::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr() : nullptr; }

// ------------------------------------------------------------------------------------------------ weight_norm

// n[j] = || scale_j w8[j, :] + s (B A)[j, :] ||_2 into n (fp32 [N]).
void weight_norm(const at::Tensor& w8, const at::Tensor& scale, const at::Tensor& A, const at::Tensor& B, double s,
                 at::Tensor& n) {
  const bool per_row = check_weight(w8, scale, w8);
  const int64_t N = w8.size(0), K = w8.size(1);
  CHECK_SAME_DEVICE(A, w8);
  CHECK_SAME_DEVICE(B, w8);
  CHECK_SAME_DEVICE(n, w8);
  TORCH_CHECK(A.dim() == 2 && A.size(1) == K, "A must have shape [r, ", K, "], got ", A.sizes());
  const int64_t r = A.size(0);
  CHECK_SHAPE(B, N, r);
  const dorafp8::DType adt = compute_dtype(A, "A");
  CHECK_DTYPE(B, A.scalar_type());
  CHECK_CONTIGUOUS(A);
  CHECK_CONTIGUOUS(B);
  CHECK_DTYPE(n, at::kFloat);
  CHECK_SHAPE(n, N);
  CHECK_CONTIGUOUS(n);
  TORCH_CHECK(r <= INT32_MAX, "A: rank too large");

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

// y (and z) of the contract, written into the given outputs. c None: plain FP8 linear (u, B, xd, z must be None).
void forward(const at::Tensor& x, const at::Tensor& w8, const at::Tensor& scale, const std::optional<at::Tensor>& bias_,
             const std::optional<at::Tensor>& c_, const std::optional<at::Tensor>& u_,
             const std::optional<at::Tensor>& B_, double s, const std::optional<at::Tensor>& xd_, at::Tensor& y,
             const std::optional<at::Tensor>& z_) {
  CHECK_CUDA(x);
  CHECK_ROWS(x);
  const dorafp8::DType dt = compute_dtype(x, "x");
  const bool per_row = check_weight(w8, scale, x);
  const int64_t M = x.size(0), N = w8.size(0), K = w8.size(1);
  TORCH_CHECK(x.size(1) == K, "x must have ", K, " columns (w8 is [", N, ", ", K, "]), got shape ", x.sizes());
  CHECK_SAME_DEVICE(y, x);
  CHECK_DTYPE(y, x.scalar_type());
  CHECK_SHAPE(y, M, N);
  CHECK_CONTIGUOUS(y);
  if (bias_.has_value()) {
    const at::Tensor& bias = *bias_;
    CHECK_SAME_DEVICE(bias, x);
    CHECK_DTYPE(bias, x.scalar_type());
    CHECK_SHAPE(bias, N);
    CHECK_CONTIGUOUS(bias);
  }
  int64_t r = 0;
  if (c_.has_value()) {
    const at::Tensor& c = *c_;
    CHECK_SAME_DEVICE(c, x);
    CHECK_DTYPE(c, at::kFloat);
    CHECK_SHAPE(c, N);
    CHECK_CONTIGUOUS(c);
    TORCH_CHECK(u_.has_value() && B_.has_value(), "u and B are required when c is given");
    const at::Tensor& u = *u_;
    const at::Tensor& B = *B_;
    TORCH_CHECK(u.dim() == 2 && u.size(0) == M, "u must have shape [", M, ", r], got ", u.sizes());
    r = u.size(1);
    TORCH_CHECK(r <= INT32_MAX, "u: rank too large");
    CHECK_SAME_DEVICE(u, x);
    CHECK_DTYPE(u, x.scalar_type());
    CHECK_CONTIGUOUS(u);
    CHECK_SAME_DEVICE(B, x);
    CHECK_DTYPE(B, x.scalar_type());
    CHECK_SHAPE(B, N, r);
    CHECK_CONTIGUOUS(B);
    if (xd_.has_value()) {
      const at::Tensor& xd = *xd_;
      CHECK_SAME_DEVICE(xd, x);
      CHECK_DTYPE(xd, x.scalar_type());
      CHECK_ROWS(xd);
      CHECK_SHAPE(xd, M, K);
    }
    if (z_.has_value()) {
      const at::Tensor& z = *z_;
      CHECK_SAME_DEVICE(z, x);
      CHECK_DTYPE(z, x.scalar_type());
      CHECK_SHAPE(z, M, N);
      CHECK_CONTIGUOUS(z);
    }
  } else {
    TORCH_CHECK(!u_.has_value() && !B_.has_value() && !xd_.has_value() && !z_.has_value(),
                "u, B, xd and z must be None when c is None (plain FP8 linear)");
  }

  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  dorafp8::ForwardParams p{};
  p.x = x.data_ptr();
  p.xd = opt_ptr(xd_);
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
  p.ldxd = xd_.has_value() ? xd_->stride(0) : 0;
  p.r = static_cast<int>(r);
  p.s = static_cast<float>(s);
  p.scale_per_row = per_row;
  CHECK_LAUNCH(dorafp8::forward(p, dt, stream), "forward");
}

// ------------------------------------------------------------------------------------------------ dgrad

// dx of the contract, written into dx. scale_ref: fp32 [1], max |scale| when scale is per row (else ignored).
void dgrad(const at::Tensor& g, const at::Tensor& w8, const at::Tensor& scale, const at::Tensor& scale_ref,
           const std::optional<at::Tensor>& c_, const std::optional<at::Tensor>& v_,
           const std::optional<at::Tensor>& A_, double s, const std::optional<at::Tensor>& mask_, double p_drop,
           at::Tensor& dx) {
  CHECK_CUDA(g);
  CHECK_ROWS(g);
  const dorafp8::DType dt = compute_dtype(g, "g");
  const bool per_row = check_weight(w8, scale, g);
  const int64_t M = g.size(0), N = w8.size(0), K = w8.size(1);
  TORCH_CHECK(g.size(1) == N, "g must have ", N, " columns (w8 is [", N, ", ", K, "]), got shape ", g.sizes());
  CHECK_SAME_DEVICE(scale_ref, g);
  CHECK_DTYPE(scale_ref, at::kFloat);
  TORCH_CHECK(scale_ref.numel() == 1, "scale_ref must have one element, got shape ", scale_ref.sizes());
  CHECK_SAME_DEVICE(dx, g);
  CHECK_DTYPE(dx, g.scalar_type());
  CHECK_SHAPE(dx, M, K);
  CHECK_CONTIGUOUS(dx);
  int64_t r = 0;
  if (c_.has_value()) {
    const at::Tensor& c = *c_;
    CHECK_SAME_DEVICE(c, g);
    CHECK_DTYPE(c, at::kFloat);
    CHECK_SHAPE(c, N);
    CHECK_CONTIGUOUS(c);
    TORCH_CHECK(v_.has_value() && A_.has_value(), "v and A are required when c is given");
    const at::Tensor& v = *v_;
    const at::Tensor& A = *A_;
    TORCH_CHECK(v.dim() == 2 && v.size(0) == M, "v must have shape [", M, ", r], got ", v.sizes());
    r = v.size(1);
    TORCH_CHECK(r <= INT32_MAX, "v: rank too large");
    CHECK_SAME_DEVICE(v, g);
    CHECK_DTYPE(v, g.scalar_type());
    CHECK_CONTIGUOUS(v);
    CHECK_SAME_DEVICE(A, g);
    CHECK_DTYPE(A, g.scalar_type());
    CHECK_SHAPE(A, r, K);
    CHECK_CONTIGUOUS(A);
    if (mask_.has_value()) {
      const at::Tensor& mask = *mask_;
      CHECK_SAME_DEVICE(mask, g);
      CHECK_DTYPE(mask, at::kBool);
      CHECK_ROWS(mask);
      CHECK_SHAPE(mask, M, K);
      TORCH_CHECK(p_drop >= 0.0 && p_drop < 1.0, "p must be in [0, 1) with a mask, got ", p_drop);
    }
  } else {
    TORCH_CHECK(!v_.has_value() && !A_.has_value() && !mask_.has_value(),
                "v, A and mask must be None when c is None (plain FP8 linear)");
  }

  const c10::cuda::CUDAGuard guard(g.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(g.device().index()).stream();
  dorafp8::DgradParams p{};
  p.g = g.data_ptr();
  p.w8 = static_cast<const uint8_t*>(w8.data_ptr());
  p.scale = scale.data_ptr<float>();
  p.scale_ref = scale_ref.data_ptr<float>();
  p.c = c_.has_value() ? c_->data_ptr<float>() : nullptr;
  p.v = opt_ptr(v_);
  p.A = opt_ptr(A_);
  p.mask = mask_.has_value() ? static_cast<const uint8_t*>(mask_->data_ptr()) : nullptr;
  p.dx = dx.data_ptr();
  p.M = M;
  p.N = N;
  p.K = K;
  p.ldg = g.stride(0);
  p.ldmask = mask_.has_value() ? mask_->stride(0) : 0;
  p.r = static_cast<int>(r);
  p.s = static_cast<float>(s);
  p.inv_keep = static_cast<float>(mask_.has_value() ? 1.0 / (1.0 - p_drop) : 1.0);
  p.scale_per_row = per_row;
  CHECK_LAUNCH(dorafp8::dgrad(p, dt, stream), "dgrad");
}

// "" when this build has kernel code for the device, else the CUDA error's text.
std::string kernel_image_error(int64_t device_index) {
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
  return dorafp8::kernel_image_error();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "dorafp8 CUDA kernels: DoRA on FP8 e4m3 base weights (see dorafp8/backends.py for the contract)";
  m.def("weight_norm", &weight_norm, "n = ||scale * w8 + s * B @ A|| per row, into n (fp32 [N])", py::arg("w8"),
        py::arg("scale"), py::arg("A"), py::arg("B"), py::arg("s"), py::arg("n"));
  m.def("forward", &forward, "DoRA / plain FP8 linear forward into y (and z)", py::arg("x"), py::arg("w8"),
        py::arg("scale"), py::arg("bias"), py::arg("c"), py::arg("u"), py::arg("B"), py::arg("s"), py::arg("xd"),
        py::arg("y"), py::arg("z"));
  m.def("dgrad", &dgrad, "DoRA / plain FP8 linear input gradient into dx", py::arg("g"), py::arg("w8"),
        py::arg("scale"), py::arg("scale_ref"), py::arg("c"), py::arg("v"), py::arg("A"), py::arg("s"),
        py::arg("mask"), py::arg("p"), py::arg("dx"));
  m.def("kernel_image_error", &kernel_image_error,
        "'' when this build has kernel code for the given CUDA device, else why not", py::arg("device_index"));
}
