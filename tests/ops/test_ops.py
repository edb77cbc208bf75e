"""dora_fp8_linear / fp8_linear / weight_norm end to end (autograd included) against fp64, every backend here (a test
that takes `device` and `backend` runs on every pair that can run here: tests/conftest.py)."""

import contextlib
import itertools

import pytest
import torch

import dorafp8
from dorafp8 import ops
from tests._ref import dora_fp64
from tests._tolerance import assert_close, tol


def _problem(M, K, N, r, dtype=torch.float32, device="cpu", per_row=False, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(N, K, generator=g) / K ** 0.5
    w8, scale = dorafp8.quantize_e4m3(W, per_row=per_row)
    A = torch.randn(r, K, generator=g) / K ** 0.5
    B = torch.randn(N, r, generator=g) / r ** 0.5
    m = torch.rand(N, generator=g) + 0.5
    b = torch.randn(N, generator=g) if bias else None
    x = torch.randn(M, K, generator=g)
    mv = lambda t: None if t is None else t.to(device)
    return (mv(x).to(dtype), mv(w8), mv(scale), mv(A), mv(B), mv(m), mv(b))


@pytest.mark.parametrize("shape", [(1, 16, 16, 1), (37, 50, 70, 3), (8, 64, 32, 16)])
@pytest.mark.parametrize("per_row,bias", [(False, True), (True, False)])
def test_dora_forward_backward_fp32(device, backend, shape, per_row, bias):
    M, K, N, r = shape
    x, w8, scale, A, B, m, b = _problem(M, K, N, r, device=device, per_row=per_row, bias=bias)
    s = 0.75
    xl, Al, Bl, ml = (t.clone().requires_grad_() for t in (x, A, B, m))
    y = dorafp8.dora_fp8_linear(xl, w8, scale, Al, Bl, ml, s, b, backend=backend)
    gy = torch.randn_like(y)
    y.backward(gy)
    W0 = dorafp8.dequantize_e4m3(w8, scale, torch.float64)
    yr, leaves = dora_fp64(x, W0, A, B, m, s, b)
    yr.backward(gy.double())
    rel = tol(torch.float32)
    assert_close(y, yr, rel, "y")
    for name, got, ref in zip(("dx", "dA", "dB", "dm"), (xl.grad, Al.grad, Bl.grad, ml.grad), leaves):
        assert_close(got, ref.grad, rel, name)


def test_bias_gradient_only_when_wanted(device, backend, monkeypatch):
    """Issue 52: backward_pass sums g's columns for db only when the bias wants a gradient (need_db); a bias with
    requires_grad False (or none) gets no db and no .grad. Both layers (per-row scales: the plain one's backward runs
    the pass too); with a gradient, db matches fp64."""
    from dorafp8 import backends

    mod, seen = backends.module(backend), []
    orig = mod.backward_pass
    monkeypatch.setattr(mod, "backward_pass", lambda *a, **k: (seen.append(k["need_db"]), orig(*a, **k))[1])
    x, w8, scale, A, B, m, bias = _problem(37, 50, 70, 3, device=device, per_row=True)
    for want in (True, False):
        b = bias.clone().requires_grad_(want)
        for layer in (lambda xl: dorafp8.dora_fp8_linear(xl, w8, scale, A, B, m.clone().requires_grad_(), 0.75, b,
                                                         backend=backend),
                      lambda xl: dorafp8.fp8_linear(xl, w8, scale, b, backend=backend)):
            b.grad = None
            y = layer(x.clone().requires_grad_())
            gy = torch.randn_like(y)
            y.backward(gy)
            if want:
                assert_close(b.grad, gy.double().sum(0), tol(torch.float32), "db")
            else:
                assert b.grad is None
    assert seen == [True, True, False, False]


def test_dora_dropout_matches_peft_semantics(device, backend):
    M, K, N, r, p, s = 24, 40, 30, 4, 0.3, 2.0
    x, w8, scale, A, B, m, b = _problem(M, K, N, r, device=device)
    xl, Al, Bl, ml = (t.clone().requires_grad_() for t in (x, A, B, m))
    torch.manual_seed(123)
    y = dorafp8.dora_fp8_linear(xl, w8, scale, Al, Bl, ml, s, b, dropout_p=p, training=True, backend=backend)
    torch.manual_seed(123)
    keep = ops.dropout_mask(x, p)  # the mask the call above drew
    assert 0 < keep.sum() < keep.numel()
    gy = torch.randn_like(y)
    y.backward(gy)
    W0 = dorafp8.dequantize_e4m3(w8, scale, torch.float64)
    yr, leaves = dora_fp64(x, W0, A, B, m, s, b, xd=(keep, p))
    yr.backward(gy.double())
    assert_close(y, yr, tol(torch.float32), "y")
    for name, got, ref in zip(("dx", "dA", "dB", "dm"), (xl.grad, Al.grad, Bl.grad, ml.grad), leaves):
        assert_close(got, ref.grad, tol(torch.float32), name)
    # eval mode ignores dropout entirely
    y_eval = dorafp8.dora_fp8_linear(x, w8, scale, A, B, m, s, b, dropout_p=p, training=False, backend=backend)
    yr_eval, _ = dora_fp64(x, W0, A, B, m, s, b)
    assert_close(y_eval, yr_eval, tol(torch.float32), "y_eval")


def test_dropout_mask_is_torch_dropout():
    x = torch.randn(64, 33)
    torch.manual_seed(7)
    ref = torch.nn.functional.dropout(x, 0.25, True)
    torch.manual_seed(7)
    keep = ops.dropout_mask(x, 0.25)
    assert torch.equal(keep, ref != 0)
    torch.testing.assert_close(x * keep / 0.75, ref, rtol=0, atol=1e-6)


_DT = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("x_dtype,ad_dtype,autocast", [
    (xd, ad, ac) for xd, ad, ac in itertools.product(_DT, _DT, [None, torch.bfloat16, torch.float16])])
def test_dtype_matrix(x_dtype, ad_dtype, autocast):
    """Every activation x adapter x autocast combination runs forward and backward, the output has the compute
    dtype (x's, or autocast's), gradients have their parameter's dtype, and all match fp64 to the precision of the
    lowest dtype involved."""
    M, K, N, r, s = 9, 48, 24, 4, 0.5
    x, w8, scale, A, B, m, b = _problem(M, K, N, r)
    xl = x.to(x_dtype).requires_grad_()
    Al, Bl, ml = (t.to(ad_dtype).requires_grad_() for t in (A, B, m))
    bl = b.to(ad_dtype)
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        y = dorafp8.dora_fp8_linear(xl, w8, scale, Al, Bl, ml, s, bl)
    cdt = autocast or x_dtype
    assert y.dtype == cdt
    gy = torch.randn(y.shape)
    y.backward(gy.to(y.dtype))
    for t in (xl, Al, Bl, ml):
        assert t.grad is not None and t.grad.dtype == t.dtype
    W0 = dorafp8.dequantize_e4m3(w8, scale, torch.float64)
    # The reference sees the inputs as rounded to their dtypes (that rounding is the user's, not ours).
    yr, leaves = dora_fp64(xl.detach(), W0, Al.detach(), Bl.detach(), ml.detach(), s, bl.detach())
    yr.backward(gy.double())
    rel = tol(max((x_dtype, ad_dtype, cdt), key=tol))
    assert_close(y, yr, rel, "y")
    for name, got, ref in zip(("dx", "dA", "dB", "dm"), (xl.grad, Al.grad, Bl.grad, ml.grad), leaves):
        assert_close(got, ref.grad, 2 * rel, name)


def test_fp8_linear_matches_fp64():
    x, w8, scale, _, _, _, b = _problem(13, 40, 24, 2, per_row=True)
    xl = x.clone().requires_grad_()
    y = dorafp8.fp8_linear(xl, w8, scale, b)
    W0 = dorafp8.dequantize_e4m3(w8, scale, torch.float64)
    x64 = x.double().requires_grad_()
    yr = x64 @ W0.T + b.double()
    gy = torch.randn_like(y)
    y.backward(gy)
    yr.backward(gy.double())
    assert_close(y, yr, tol(torch.float32), "y")
    assert_close(xl.grad, x64.grad, tol(torch.float32), "dx")


def test_weight_norm_fp64():
    _, w8, scale, A, B, _, _ = _problem(1, 70, 50, 3, per_row=True)
    n = dorafp8.weight_norm(w8, scale, A, B, 1.5)
    W0 = dorafp8.dequantize_e4m3(w8, scale, torch.float64)
    ref = (W0 + 1.5 * B.double() @ A.double()).norm(dim=1)
    assert n.dtype == torch.float32 and not n.requires_grad
    assert_close(n, ref, 5e-7, "n")


def test_leading_dims_noncontiguous_and_empty():
    M, K, N, r = 6, 32, 16, 2
    x, w8, scale, A, B, m, b = _problem(M, K, N, r)
    x3 = torch.randn(K, 3, 5).permute(1, 2, 0)  # [3, 5, K], last dim strided
    assert not x3.is_contiguous()
    y3 = dorafp8.dora_fp8_linear(x3, w8, scale, A, B, m, 0.5, b)
    y3_ref = dorafp8.dora_fp8_linear(x3.contiguous(), w8, scale, A, B, m, 0.5, b)
    assert y3.shape == (3, 5, N) and torch.equal(y3, y3_ref)
    # empty batch: output [0, N], gradients are zeros of the right shapes
    Al, Bl, ml = (t.clone().requires_grad_() for t in (A, B, m))
    x0 = torch.empty(0, 4, K, requires_grad=True)
    y0 = dorafp8.dora_fp8_linear(x0, w8, scale, Al, Bl, ml, 0.5, b)
    assert y0.shape == (0, 4, N)
    y0.sum().backward()
    assert x0.grad.shape == x0.shape
    for t in (Al, Bl, ml):
        assert t.grad is not None and t.grad.shape == t.shape and not t.grad.any()


def test_nan_row_stays_in_its_row():
    x, w8, scale, A, B, m, b = _problem(5, 24, 12, 2)
    x[2, 3] = float("nan")
    y = dorafp8.dora_fp8_linear(x, w8, scale, A, B, m, 0.5, b)
    assert torch.isnan(y[2]).all()
    assert torch.isfinite(y[[0, 1, 3, 4]]).all()


def test_input_errors_name_the_argument():
    x, w8, scale, A, B, m, b = _problem(4, 24, 12, 2)
    f = dorafp8.dora_fp8_linear
    with pytest.raises(ValueError, match=r"in_features=24"):
        f(torch.randn(4, 23), w8, scale, A, B, m, 0.5)
    with pytest.raises(TypeError, match=r"x must be float32, bfloat16 or float16"):
        f(x.double(), w8, scale, A, B, m, 0.5)
    with pytest.raises(TypeError, match=r"w8 must be a torch.float8_e4m3fn"):
        f(x, w8.float(), scale, A, B, m, 0.5)
    with pytest.raises(ValueError, match=r"w8 must be 2-D"):
        f(x, w8[None], scale, A, B, m, 0.5)
    with pytest.raises(ValueError, match=r"magnitude must have shape \[12\]"):
        f(x, w8, scale, A, B, m[:-1], 0.5)
    with pytest.raises(ValueError, match=r"lora_B must have shape \[12, 2\]"):
        f(x, w8, scale, A, B.T, m, 0.5)
    with pytest.raises(ValueError, match=r"scale must have one element \(per tensor\), shape \[12\] \(per row\) or \[1, 1\]"):
        f(x, w8, torch.ones(3), A, B, m, 0.5)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        f(x, w8, scale, A, B, m, 0.5, dropout_p=1.0)
    with pytest.raises(ValueError, match=r"backend must be one of \['auto', 'reference', 'triton', 'cuda', 'cublas', 'native'\]"):
        f(x, w8, scale, A, B, m, 0.5, backend="tpu")


def test_backend_selection(monkeypatch):
    from dorafp8 import backends

    assert backends.resolve("auto", torch.device("cpu")) == "native"  # the exact twin is one name away:
    monkeypatch.setenv("DORAFP8_BACKEND", "reference")
    assert backends.resolve("auto", torch.device("cpu")) == "reference"
    monkeypatch.setenv("DORAFP8_BACKEND", "nope")
    with pytest.raises(ValueError, match="DORAFP8_BACKEND must be one of"):
        backends.resolve("auto", torch.device("cpu"))
    monkeypatch.delenv("DORAFP8_BACKEND")
    # cuda on CPU tensors: asked for by name, it is an error that says why
    with pytest.raises(RuntimeError, match="backend 'cuda' cannot run on cpu"):
        backends.resolve("cuda", torch.device("cpu"))


def test_quantize_recipe():
    W = torch.randn(33, 17) * 3
    w8, scale = dorafp8.quantize_e4m3(W)
    assert w8.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.dim() == 0
    assert scale.item() == pytest.approx(W.abs().max().item() / 448, rel=1e-7)
    ref = (W / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(w8.view(torch.uint8), ref.view(torch.uint8))
    # the quantization error is at most half an e4m3 step (3 mantissa bits: 2^-4 relative), plus subnormals
    err = (dorafp8.dequantize_e4m3(w8, scale) - W).abs()
    assert (err <= W.abs() * 2 ** -4 + scale * 2 ** -10).all()
    w8z, sz = dorafp8.quantize_e4m3(torch.zeros(4, 4))
    assert sz.item() == 1.0 and not w8z.float().any()
    w8r, sr = dorafp8.quantize_e4m3(W, per_row=True)
    assert sr.shape == (33,)
    assert torch.allclose(sr, W.abs().amax(1) / 448)
    bad = W.clone()
    bad[5, 2] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        dorafp8.quantize_e4m3(bad)


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_fp32_adapters_on_bf16_activations_get_fp32_gradients(device, backend, dropout):
    """PEFT computes the low-rank path in the adapters' dtype (it casts x to lora_A's): with bf16 activations and
    fp32 adapters, dA and dB must be fp32-accurate (here: against fp64 of the same bf16 inputs), not rounded
    through bf16 (2^-9). dm is a sum of g * z with z kept in the compute dtype (test_dm_with_z_in_the_compute_dtype):
    bf16-accurate, as PEFT's own, whose base product is bf16."""
    M, K, N, r, s = 24, 48, 40, 4, 0.75
    x, w8, scale, A, B, m, b = _problem(M, K, N, r, dtype=torch.bfloat16, device=device)
    xl, Al, Bl, ml = (t.clone().requires_grad_() for t in (x, A, B, m))
    torch.manual_seed(9)
    y = dorafp8.dora_fp8_linear(xl, w8, scale, Al, Bl, ml, s, b.to(torch.bfloat16), dropout_p=dropout,
                                training=True, backend=backend)
    assert y.dtype == torch.bfloat16
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(device)
    y.backward(gy)
    torch.manual_seed(9)
    keep = ops.dropout_mask(x, dropout) if dropout else None
    W0 = dorafp8.dequantize_e4m3(w8, scale, torch.float64)
    yr, leaves = dora_fp64(x, W0, A, B, m, s, b.to(torch.bfloat16), xd=None if keep is None else (keep, dropout))
    yr.backward(gy.double())
    assert_close(y, yr, tol(torch.bfloat16), "y")
    assert_close(xl.grad, leaves[0].grad, tol(torch.bfloat16), "dx")
    for name, got, ref in zip(("dA", "dB", "dm"), (Al.grad, Bl.grad, ml.grad), leaves[1:]):
        assert got.dtype == torch.float32
        # dm = sum g * z sees z's rounding to bf16 (and, on cublas and native, the platform GEMM's bf16 x W0^T, as
        # PEFT's bf16 base layer has it); dA and dB do not depend on it.
        assert_close(got, ref.grad, tol(torch.bfloat16) if name == "dm" else 5e-6, name)


@pytest.mark.backends("reference", "triton")  # native and cublas round the base product itself (above)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_dm_with_z_in_the_compute_dtype(device, backend, dtype, dropout):
    """The forward keeps z = xd W0^T + s u B^T (for dm = sum_i g z / n) in the compute dtype, not fp32, on 16-bit
    activations with fp32 adapters (docs/DORA_MATH.md, "Dtype policy", says why that is enough). Here dm must stay
    within the compute dtype's tolerance of fp64 at realistic magnitudes and a long reduction (M = 512 tokens, where
    an error that grew with M would show): Kaiming-scaled weights, unit activations, DoRA's magnitude near its init
    (m ~ n, c ~ 1), a trained-looking B, small gradients. fp8's rounding of z (2^-4) would put it past this bound; bf16's
    (2^-8) and fp16's (2^-11) pass with room."""
    M, K, N, r, s = 512, 32, 40, 8, 2.0
    gen = torch.Generator().manual_seed(3)
    W = torch.randn(N, K, generator=gen) / K ** 0.5
    w8, scale = dorafp8.quantize_e4m3(W)
    A = torch.randn(r, K, generator=gen) / K ** 0.5
    B = torch.randn(N, r, generator=gen) * 0.02
    n = dorafp8.weight_norm(w8, scale, A, B, s, backend="reference")
    m = n * (1 + 0.05 * torch.randn(N, generator=gen))
    x = torch.randn(M, K, generator=gen).to(dtype)
    gy = (torch.randn(M, N, generator=gen) * 1e-2).to(dtype)
    dev = lambda t: t.to(device)  # noqa: E731
    ml = dev(m).requires_grad_()
    torch.manual_seed(5)
    y = dorafp8.dora_fp8_linear(dev(x), dev(w8), dev(scale), dev(A), dev(B), ml, s, dropout_p=dropout,
                                training=True, backend=backend)
    y.backward(dev(gy))
    torch.manual_seed(5)
    keep = ops.dropout_mask(x, dropout) if dropout else None
    W0 = dorafp8.dequantize_e4m3(w8, scale, torch.float64)
    yr, leaves = dora_fp64(x, W0, A, B, m, s, xd=None if keep is None else (keep, dropout))
    yr.backward(gy.double())
    assert ml.grad.dtype == torch.float32
    assert_close(ml.grad, leaves[3].grad, tol(dtype), f"dm with z in {dtype}")


def test_fp16_large_magnitude_does_not_overflow(device, backend):
    """c = m / n of 500 in fp16: g * c or c * W8 (448 * 500) in an fp16 operand would overflow where the fp64
    result is far inside fp16's range; the dgrad operand is g * c / max|c| instead."""
    M, K, N, r, s = 9, 40, 24, 2, 0.5
    g = torch.Generator().manual_seed(4)
    W = torch.randn(N, K, generator=g) * 1e-4
    w8, scale = dorafp8.quantize_e4m3(W)
    A = torch.randn(r, K, generator=g) * 1e-4
    B = torch.randn(N, r, generator=g) * 1e-4
    n = dorafp8.weight_norm(w8, scale, A, B, s)
    m = (500 * n).half()
    x = torch.randn(M, K, generator=g).half()
    gy = (torch.randn(M, N, generator=g) * 1000).half()
    xl, ml = x.to(device).requires_grad_(), m.to(device).requires_grad_()
    y = dorafp8.dora_fp8_linear(xl, w8.to(device), scale.to(device), A.half().to(device), B.half().to(device), ml,
                                s, backend=backend)
    y.backward(gy.to(device))
    W0 = dorafp8.dequantize_e4m3(w8, scale, torch.float64)
    yr, leaves = dora_fp64(x, W0, A.half(), B.half(), m, s)
    yr.backward(gy.double())
    assert (gy.double() * (m.double() / n.double())).abs().max() > 65504  # g * c would overflow fp16
    assert leaves[0].grad.abs().max() < 65504 / 4  # ... while dx is well inside it
    assert torch.isfinite(xl.grad).all()
    assert_close(y, yr, tol(torch.float16), "y")
    assert_close(xl.grad, leaves[0].grad, tol(torch.float16), "dx")


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_zero_scaling(device, backend, dropout):
    """scaling = lora_alpha / r = 0 (lora_alpha=0): the rank-r term vanishes, the magnitude still applies. The fused
    epilogues fold the rank-r term into the accumulator as base / s + u B^T, so s = 0 takes their other path."""
    M, K, N, r = 11, 40, 30, 3
    x, w8, scale, A, B, m, b = _problem(M, K, N, r, device=device)
    xl, Al, Bl, ml = (t.clone().requires_grad_() for t in (x, A, B, m))
    torch.manual_seed(3)
    y = dorafp8.dora_fp8_linear(xl, w8, scale, Al, Bl, ml, 0.0, b, dropout_p=dropout, training=True, backend=backend)
    gy = torch.randn_like(y)
    y.backward(gy)
    torch.manual_seed(3)
    keep = ops.dropout_mask(x, dropout) if dropout else None
    W0 = dorafp8.dequantize_e4m3(w8, scale, torch.float64)
    yr, leaves = dora_fp64(x, W0, A, B, m, 0.0, b, xd=None if keep is None else (keep, dropout))
    yr.backward(gy.double())
    assert_close(y, yr, tol(torch.float32), "y")
    for name, got, ref in zip(("dx", "dm"), (xl.grad, ml.grad), (leaves[0], leaves[3])):
        assert_close(got, ref.grad, tol(torch.float32), name)


def test_auto_passes_over_backends_that_cannot_compute_the_call(monkeypatch):
    """Under "auto" a backend without block scales or W8A8 (cuda: SUPPORTS is fp32 compute only) is skipped for such
    calls, not picked and then refused."""
    from dorafp8 import backends
    from dorafp8.backends import base

    monkeypatch.setattr(backends, "unavailable_reason",
                        lambda name, dev: None if name in ("cuda", "reference") else "not here")
    gpu = torch.device("cuda")
    assert backends.resolve("auto", gpu) == "cuda"
    assert backends.resolve("auto", gpu, frozenset({"block"})) == "reference"
    assert backends.resolve("auto", gpu, frozenset({"rowwise"})) == "reference"
    assert backends.resolve("auto", gpu, frozenset({"fp32"})) == "cuda"
    assert backends.resolve("auto", gpu, frozenset({"fp16-row"})) == "cuda"
    assert backends.supports("cuda") == frozenset({"fp32", "fp16-row"})
    assert backends.supports("cublas") == frozenset({"block", "fp32", "nvfp4", "mxfp8"})
    assert backends.supports("triton") == base.FP8_FEATURES | {"nvfp4", "mxfp8"}  # fused since issue 54
    assert backends.supports("reference") == backends.FEATURES
    for kind in ("nvfp4", "mxfp8"):  # on a GPU too: never a kernel that does not know the kind (cublas: "not here")
        assert backends.resolve("auto", gpu, frozenset({kind})) == "reference"
        assert backends.resolve("auto", gpu, frozenset({kind, "fp32"})) == "reference"
    # the race's candidates too: not cublas for fp16 with per-row scales (its one dequantized copy overflows there)
    from dorafp8.backends import race

    monkeypatch.setattr(backends, "unavailable_reason", lambda name, dev: None)
    assert race._candidates(gpu, frozenset(), race.RACERS["cuda"]) == ["triton", "cuda", "cublas"]
    assert race._candidates(gpu, frozenset({"fp16-row"}), race.RACERS["cuda"]) == ["triton", "cuda"]


def test_auto_runs_native_on_a_gpu_no_kernel_backend_runs_on(monkeypatch):
    """An A100 or RTX 3090 (sm_80 / sm_86): Triton compiles e4m3 from sm_89 on (so the triton backend and cublas's
    dequantize cannot run) and setup.py builds the CUDA extension from sm_89 on. "auto" ran the fp32 reference there,
    several times slower than PyTorch's matmul in the compute dtype; it now runs native (PEFT's arithmetic under
    autocast), NVFP4 and MXFP8 included."""
    from dorafp8 import backends

    monkeypatch.setattr(backends, "unavailable_reason",
                        lambda name, dev: None if name in ("native", "reference") else "needs sm_89")
    gpu = torch.device("cuda")
    for needs in (frozenset(), frozenset({"block"}), frozenset({"rowwise"}), frozenset({"fp32"})):
        assert backends.resolve("auto", gpu, needs) == "native", needs
    for kind in ("nvfp4", "mxfp8"):
        assert backends.resolve("auto", gpu, frozenset({kind})) == "native"
    assert backends.resolve("auto", torch.device("meta")) == "reference"  # no fp8 matmul of PyTorch's known there


@pytest.mark.parametrize("cap", [(7, 0), (7, 5), (8, 0), (8, 6), (8, 9), (9, 0), (12, 0)])
def test_auto_by_gpu_capability(cap, monkeypatch):
    """backend="auto"'s static order (what DORAFP8_RACE=0, a compiled trace or a graph capture runs) on a GPU of each
    capability, faked as tests/kernels/test_arch_configs.py fakes it, with the backends' own availability checks: below
    sm_89 (V100, T4, A100, RTX 3090) native for fp8 weights of every scale kind in every compute dtype, fp16 included,
    and for NVFP4 / MXFP8 too (native computes them); from sm_89 on the Triton backend, and cublas for the
    microscaled kinds, as before."""
    from dorafp8 import backends
    from dorafp8.backends import cuda as cuda_backend
    from dorafp8.ops._policy import backend_needs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    monkeypatch.setattr(cuda_backend, "_C", None)  # not built (a GPU machine's own build would answer for its GPU)
    monkeypatch.setattr(backends, "_reasons", {})
    monkeypatch.delenv("DORAFP8_BACKEND", raising=False)
    gpu = torch.device("cuda")
    old = cap < (8, 9)
    scales = {"tensor": torch.tensor(0.01), "row": torch.full((8,), 0.01), "block": torch.full((1, 1), 0.01)}
    for cdt in (torch.float16, torch.bfloat16, torch.float32):
        for kind, scale in scales.items():
            for act_quant in ("", "rowwise"):
                needs = backend_needs(scale, act_quant, cdt)
                want = "native" if old else "triton"
                assert backends.resolve("auto", gpu, needs) == want, (cdt, kind, act_quant)
    for kind in ("nvfp4", "mxfp8"):
        assert backends.resolve("auto", gpu, frozenset({kind})) == ("native" if old else "cublas")
    if old:
        for name in ("triton", "cublas"):
            assert f"sm_{cap[0]}{cap[1]}" in backends.unavailable_reason(name, gpu)


def test_outputs_are_not_views():
    """The ops return their [..., N] result as a tensor of its own (aten._unsafe_view of the autograd Function's 2-D
    output, no copy), not as a view: FSDP2 warns when a module it wraps returns a view ("FSDP2-wrapped module
    (FSDPDoRAFP8Linear) returned a view tensor"), since an in-place op on one drops its pre-backward hook. Unbatched
    convs likewise. Values and gradients are those of the 2-D call."""
    x, w8, scale, A, B, m, b = _problem(6, 32, 16, 2)
    x3 = x.reshape(2, 3, 32).clone().requires_grad_()
    leaves = [t.clone().requires_grad_() for t in (A, B, m)]
    dora = dorafp8.dora_fp8_linear
    for y, y2 in ((dorafp8.fp8_linear(x3, w8, scale, b), dorafp8.fp8_linear(x, w8, scale, b)),
                  (dora(x3, w8, scale, *leaves, 0.5, b), dora(x, w8, scale, A, B, m, 0.5, b))):
        assert y._base is None and y.shape == (2, 3, 16) and torch.equal(y.reshape(6, 16), y2)
        y.sum().backward()
    assert x3.grad is not None and all(t.grad is not None for t in leaves)
    g = torch.Generator().manual_seed(1)
    w8c, sc = dorafp8.quantize_e4m3(torch.randn(4, 27, generator=g))  # the [C_out, C_in * kernel] view
    w8c = w8c.reshape(4, 3, 3, 3)
    Ac, Bc, mc = torch.randn(2, 3, 3, 3, generator=g), torch.randn(4, 2, 1, 1, generator=g), torch.rand(4) + 0.5
    xc = torch.randn(3, 8, 8, generator=g, requires_grad=True)  # unbatched [C_in, H, W]
    for y, y4 in ((dorafp8.fp8_conv(xc, w8c, sc, padding=1), dorafp8.fp8_conv(xc[None], w8c, sc, padding=1)),
                  (dorafp8.dora_fp8_conv(xc, w8c, sc, Ac, Bc, mc, 0.5, padding=1),
                   dorafp8.dora_fp8_conv(xc[None], w8c, sc, Ac, Bc, mc, 0.5, padding=1))):
        assert y._base is None and y.shape == (4, 8, 8) and torch.equal(y, y4[0])
        y.sum().backward()
    assert xc.grad is not None


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_in_place_ops_on_the_output_leave_the_gradients_alone(device, backend, dropout):
    """An in-place op on a DoRA layer's output (`out *= 2; out += residual; relu_(out)`, as nn.ReLU(inplace=True) and
    residual code do), which nn.Linear and PEFT accept, gives the same gradients as the same ops out of place, for the
    linear and the conv op. The ops return their output through aten._unsafe_view, which does not share a version
    counter with the tensor it views: if the layer ever kept its output for the backward (∂m from y instead of z,
    docs/ARCHITECTURE.md "The kernel plan"), such an op would change what ∂m is computed from without any error."""
    x, w8, scale, A, B, m, b = _problem(12, 40, 24, 4, device=device)
    g = torch.Generator().manual_seed(2)
    w8c, sc = dorafp8.quantize_e4m3(torch.randn(6, 27, generator=g))  # a 3 x 3 conv, 3 -> 6 channels, r = 2
    xc = torch.randn(2, 3, 5, 5, generator=g)
    Ac, Bc = torch.randn(2, 3, 3, 3, generator=g), torch.randn(6, 2, 1, 1, generator=g)
    mc, bc = torch.rand(6, generator=g) + 0.5, torch.randn(6, generator=g)
    w8c, sc, xc, Ac, Bc, mc, bc = (t.to(device) for t in (w8c.reshape(6, 3, 3, 3), sc, xc, Ac, Bc, mc, bc))
    calls = {
        "linear": ((x, A, B, m), lambda xl, Al, Bl, ml: dorafp8.dora_fp8_linear(
            xl, w8, scale, Al, Bl, ml, 0.75, b, dropout_p=dropout, training=True, backend=backend)),
        "conv": ((xc, Ac, Bc, mc), lambda xl, Al, Bl, ml: dorafp8.dora_fp8_conv(
            xl, w8c, sc, Al, Bl, ml, 0.75, bc, padding=1, dropout_p=dropout, training=True, backend=backend)),
    }
    for name, (leaves, call) in calls.items():
        grads = []
        for in_place in (False, True):
            ls = [t.clone().requires_grad_() for t in leaves]
            torch.manual_seed(5)  # the same dropout mask both times
            y = call(*ls)
            residual = torch.ones_like(y)
            if in_place:
                y *= 2.0
                y += residual
                out = torch.relu_(y)
            else:
                out = torch.relu(y * 2.0 + residual)
            out.square().sum().backward()
            grads.append([t.grad for t in ls])
        assert 0 < (out > 0).sum() < out.numel()  # relu_ keeps some entries and zeroes others
        for what, got, ref in zip(("dx", "dA", "dB", "dm"), grads[1], grads[0]):
            assert torch.equal(got, ref), (name, what, (got - ref).abs().max().item())



def test_a_weight_norm_made_under_inference_mode_trains(device, backend):
    """A norm precomputed under torch.inference_mode (an evaluation before training) and passed as weight_norm= failed
    the training step's backward ("Inference tensors cannot be saved for backward"): the gradients now equal those
    of weight_norm=None, for the linear and the conv op."""
    from dorafp8.ops.conv import conv_weight_norm

    x, w8, scale, A, B, m, b = _problem(6, 24, 16, 2, device=device)
    g = torch.Generator().manual_seed(3)
    w8c, sc = dorafp8.quantize_e4m3(torch.randn(6, 27, generator=g))
    xc, Ac, Bc = torch.randn(2, 3, 5, 5, generator=g), torch.randn(2, 3, 3, 3, generator=g), torch.randn(6, 2, 1, 1)
    w8c, sc, xc, Ac, Bc = (t.to(device) for t in (w8c.reshape(6, 3, 3, 3), sc, xc, Ac, Bc))
    mc = m[:6].clone()

    def linear(n, xl, Al, Bl, ml):
        return dorafp8.dora_fp8_linear(xl, w8, scale, Al, Bl, ml, 0.5, b, weight_norm=n, backend=backend)

    def conv(n, xl, Al, Bl, ml):
        return dorafp8.dora_fp8_conv(xl, w8c, sc, Al, Bl, ml, 0.5, weight_norm=n, padding=1, backend=backend)

    with torch.inference_mode():
        norms = (dorafp8.weight_norm(w8, scale, A, B, 0.5, backend=backend),
                 conv_weight_norm(w8c, sc, Ac, Bc, 0.5, backend=backend))
    for call, leaves, n in ((linear, (x, A, B, m), norms[0]), (conv, (xc, Ac, Bc, mc), norms[1])):
        grads = []
        for weight_norm in (n, None):
            ls = [t.clone().requires_grad_() for t in leaves]
            call(weight_norm, *ls).square().sum().backward()
            grads.append([t.grad for t in ls])
        for got, ref in zip(*grads):
            torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_a_second_derivative_is_refused_not_dropped(device, backend):
    """A gradient penalty (R1 / WGAN-GP: loss + |dL/dx|^2, with create_graph=True) differentiates the ops' backward.
    The kernels' backward has no derivative: under the Triton and cuBLAS backends fp8_linear's penalty term was dropped
    without a word (x.grad off by 98%), the native one failed inside torch ("out=... arguments don't support automatic
    differentiation"). Every op now raises autograd's once_differentiable error, and its first-order gradient under
    create_graph=True is still the plain one."""
    x, w8, scale, A, B, m, b = _problem(4, 24, 16, 2, device=device)
    g = torch.Generator().manual_seed(3)
    w8c, sc = dorafp8.quantize_e4m3(torch.randn(6, 27, generator=g))
    w8c, sc, xc = w8c.reshape(6, 3, 3, 3).to(device), sc.to(device), torch.randn(2, 3, 5, 5, generator=g).to(device)
    Ac, Bc, mc = torch.randn(2, 3, 3, 3, generator=g).to(device), torch.randn(6, 2, 1, 1).to(device), m[:6].clone()
    calls = ((x, lambda t: dorafp8.fp8_linear(t, w8, scale, b, backend=backend)),
             (x, lambda t: dorafp8.dora_fp8_linear(t, w8, scale, A, B, m, 0.5, b, backend=backend)),
             (xc, lambda t: dorafp8.fp8_conv(t, w8c, sc, padding=1)),
             (xc, lambda t: dorafp8.dora_fp8_conv(t, w8c, sc, Ac, Bc, mc, 0.5, padding=1, backend=backend)))
    for x0, call in calls:
        xl = x0.clone().requires_grad_()
        y = call(xl)
        gx, = torch.autograd.grad(y.square().sum(), xl, create_graph=True)
        ref, = torch.autograd.grad(call(xl).square().sum(), xl)
        torch.testing.assert_close(gx.detach(), ref, rtol=0, atol=0)
        with pytest.raises(RuntimeError, match="once_differentiable"):
            (gx.square().sum() + y.sum()).backward()


def test_a_transposed_weight_is_taken_by_every_backend(device, backend):
    """w8 = w8t.T (a weight stored [in, out], as transformers' Conv1D stores it): the reference and native backends
    took it (rounding their sums in another order), the Triton and cuBLAS ones refused it ("w8 must have unit stride
    in its last dim"), so that code run on the CPU failed on a GPU. Every op now gives, bit for bit, the results of
    the contiguous weight."""
    x, w8, scale, A, B, m, b = _problem(5, 40, 24, 4, device=device, per_row=True)
    w8t = w8.T.contiguous().T
    assert w8t.stride(-1) != 1
    results = []
    for w in (w8, w8t):
        xl, Al, Bl, ml = (t.clone().requires_grad_() for t in (x, A, B, m))
        y = dorafp8.dora_fp8_linear(xl, w, scale, Al, Bl, ml, 0.5, b, backend=backend)
        y2 = dorafp8.fp8_linear(xl, w, scale, b, backend=backend)
        (y.square().sum() + y2.square().sum()).backward()
        results.append([y, y2, dorafp8.weight_norm(w, scale, A, B, 0.5, backend=backend), xl.grad, Al.grad, Bl.grad,
                        ml.grad])
    for got, ref in zip(*results):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_conv_lora_input_rounds_dropout_once(dtype):
    """The conv op's low-rank input x * mask / (1 - p) in a 16-bit dtype is the fp64 value rounded once: with the
    factor 1 / (1 - p) rounded first (1.109 for 1 / 0.9 in bf16), every kept element was scaled the same wrong way."""
    from dorafp8.ops.conv import _lora_input

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 8, 8, generator=gen).to(dtype)
    mask = torch.rand(x.shape, generator=gen) >= 0.1
    want = (x.double() * mask / 0.9).to(dtype)
    assert torch.equal(_lora_input(x, mask, 0.1, dtype), want)


def test_fp16_conv_dgrad_of_a_large_weight_with_small_c_stays_finite():
    """The conv op's fp16 dx: with a weight whose largest value is near fp16's (6e4) and c = m / n of 0.002, dx =
    conv_input(g c, W0) + lora path lies inside fp16, but its product of g c / max|c| (|.| <= |g|) with W0 is
    dx / max|c| = 500 dx and came back inf, the overflow a29ff6c / fd91475 took from the linear op's backends
    (those backends now multiply g c itself there, as PEFT does). Against fp64 autograd of the conv formula."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    W = torch.randn(6, 27, generator=gen)
    w8, sc = dorafp8.quantize_e4m3(W * (6e4 / W.abs().max()))
    w8 = w8.reshape(6, 3, 3, 3)
    A = (torch.randn(2, 3, 3, 3, generator=gen) * 0.1).half()
    B = (torch.randn(6, 2, 1, 1, generator=gen) * 0.1).half()
    s = 0.5
    W0, A64, B64 = w8.double() * sc.double(), A.double(), B.double()
    n = torch.linalg.vector_norm((W0 + s * (B64.flatten(1) @ A64.flatten(1)).reshape(W0.shape)).flatten(1), dim=1)
    m = (n * (0.001 + 0.002 * torch.rand(6, generator=gen, dtype=torch.float64))).float()
    c = (m.double() / n)[:, None, None]
    x = torch.randn(2, 3, 8, 8, generator=gen).half()

    def dx_64(gy):
        x64 = x.double().requires_grad_()
        y = c * (F.conv2d(x64, W0, padding=1) + s * F.conv2d(F.conv2d(x64, A64, padding=1), B64))
        return torch.autograd.grad(y, x64, gy.double())[0]

    gy = torch.randn(2, 6, 8, 8, generator=gen, dtype=torch.float64)
    gy = (gy * (2e4 / dx_64(gy).abs().max())).half()
    ref = dx_64(gy)
    xl = x.clone().requires_grad_()
    dorafp8.dora_fp8_conv(xl, w8, sc, A, B, m, s, padding=1).backward(gy)
    assert_close(xl.grad, ref, tol(torch.float16), "fp16 conv dx vs fp64")


class _CountingAutocast(torch.autocast):
    entered = 0

    def __enter__(self):
        type(self).entered += 1
        return super().__enter__()


@pytest.mark.parametrize("outer", [False, True])
def test_dora_step_turns_autocast_off_only_where_on(monkeypatch, outer):
    """The ops compute in their own dtypes (docs/DORA_MATH.md): where autocast is on, the forward and the backward turn
    it off inside, with the same results as the backward run outside it; where it is off they enter no torch.autocast
    (4 to 12 us each on a CPU, twice a step: bench/glue_cpu.py)."""
    _CountingAutocast.entered = 0
    x, w8, scale, A, B, m, b = _problem(9, 48, 24, 4)
    xb = x.to(torch.bfloat16)
    grads = []
    for inside in (False, True):
        leaves = [t.clone().requires_grad_() for t in (xb, A, B, m)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=outer):
            y = dorafp8.dora_fp8_linear(leaves[0], w8, scale, *leaves[1:], 0.5, b, backend="reference")
            if inside:  # the backward's ops under the caller's autocast
                monkeypatch.setattr(torch, "autocast", _CountingAutocast)
                y.float().sum().backward()
                monkeypatch.undo()
        if not inside:
            y.float().sum().backward()
        grads.append([t.grad for t in leaves])
    assert _CountingAutocast.entered == (1 if outer else 0)  # the backward's own, under the caller's autocast only
    for got, want in zip(grads[1], grads[0]):
        assert torch.equal(got, want)
    _CountingAutocast.entered = 0
    monkeypatch.setattr(torch, "autocast", _CountingAutocast)
    with contextlib.nullcontext() if not outer else torch.amp.autocast("cpu", dtype=torch.bfloat16):
        dorafp8.dora_fp8_linear(xb.clone().requires_grad_(), w8, scale, A, B, m, 0.5, b, backend="reference")
    assert _CountingAutocast.entered == (1 if outer else 0)  # the forward's
