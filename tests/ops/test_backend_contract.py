"""The backend contract (dorafp8/backends/base.py) and the registry around it: every backend offers the Protocol's
functions under its parameter names (the custom ops call them by keyword), a backend named for something it does not
compute is refused the same way whichever it is, and a backend's availability is probed once per device."""

import inspect

import pytest
import torch

from dorafp8 import backends
from dorafp8.backends import base

# The flag that switches each option of base.py on (nvfp4: SUPPORTS has it), and its parameters
OPTIONS = {"QUANTS_IN_PROJECT": base.QUANT_PARAMS, "KEEPS_WEIGHT": base.KEEP_WEIGHT_PARAMS,
           "nvfp4": base.GLOBAL_SCALE_PARAMS}


def signature_mismatches(impl) -> list[str]:
    """Where `impl` (a backend module or object) does not offer the contract with Backend's parameter names."""
    out = []
    for name in base.CONTRACT:
        fn = getattr(impl, name, None)
        if fn is None:
            out.append(f"{name}: missing")
            continue
        want = [p for p in inspect.signature(getattr(base.Backend, name)).parameters if p != "self"]
        got = list(inspect.signature(fn).parameters)
        extra = set()
        for flag, params in OPTIONS.items():
            option = params.get(name, ())
            on = "nvfp4" in getattr(impl, "SUPPORTS", ()) if flag == "nvfp4" else getattr(impl, flag, False)
            if on and not set(option) <= set(got):
                out.append(f"{name}: {flag} is set but it lacks {[p for p in option if p not in got]}")
            extra |= set(option)
        got = [p for p in got if p not in extra]  # the options' parameters come on top of the contract's
        if sorted(got) != sorted(want):
            out.append(f"{name}: parameters {got}, the contract's are {want}")
    if getattr(impl, "KEEPS_WEIGHT", False) and not callable(getattr(impl, "dequantize", None)):
        out.append("dequantize: KEEPS_WEIGHT is set but it is missing")
    return out


@pytest.mark.parametrize("name", backends.BACKENDS)
def test_backend_offers_the_contract_by_name(name):
    try:
        impl = backends._import(name)
    except ImportError as e:
        pytest.skip(f"backend {name!r} cannot be imported here: {e}")
    assert signature_mismatches(impl) == []
    assert callable(impl.unavailable_reason)
    assert backends.supports(name) <= backends.FEATURES


def test_signature_mismatch_is_reported():
    class Positional:
        def weight_norm(self, w8, scale, block, A, B, s):  # the old spelling of block_size
            pass

    problems = signature_mismatches(Positional())
    assert any(p.startswith("weight_norm: parameters") and "block_size" in p for p in problems)
    assert "forward: missing" in problems


def test_nvfp4_backend_must_take_the_global_scale():
    """A backend whose SUPPORTS has "nvfp4" is handed NVFP4's global_scale (ops/_custom_ops.py): the contract check
    asks for it from SUPPORTS itself (there is no separate flag to forget)."""
    import dorafp8.backends.reference as ref

    class NoGlobal:  # the reference's functions, less global_scale
        SUPPORTS = frozenset({"nvfp4"})
        project, project_grad, backward_pass = ref.project, ref.project_grad, ref.backward_pass

        def weight_norm(w8, scale, block_size, A, B, s):
            pass

        def forward(x, w8, scale, block_size, bias, m, n, u, B, s, xm, p, need_z, z_dtype, act_quant):
            pass

        def dgrad(gl, rl, w8, scale, block_size, v, A, s, mask, p, gb, rb, act_quant):
            pass

    problems = signature_mismatches(NoGlobal)
    assert sorted(p.split(":")[0] for p in problems) == ["dgrad", "forward", "weight_norm"], problems
    assert all("['global_scale']" in p for p in problems), problems
    NoGlobal.SUPPORTS = frozenset({"mxfp8"})  # MXFP8 has no global scale
    assert signature_mismatches(NoGlobal) == []


@pytest.mark.parametrize("name, feature, what", [
    ("cuda", "block", "block weight scales are"),
    ("cuda", "rowwise", "act_quant='rowwise' (W8A8) is"),
    ("cublas", "rowwise", "act_quant='rowwise' (W8A8) is"),
])
def test_named_backend_is_refused_uniformly(monkeypatch, name, feature, what):
    monkeypatch.setattr(backends, "unavailable_reason", lambda b, device: None)
    with pytest.raises(ValueError, match=rf"^{__import__('re').escape(what)} not supported by the {name} backend; "
                                         rf"use backend='auto' or "):
        backends.resolve(name, torch.device("cuda"), frozenset({feature}))
    # "auto" passes over it instead
    assert backends.resolve("auto", torch.device("cuda"), frozenset({feature})) != name


def test_availability_is_probed_once_per_device(monkeypatch):
    calls = []

    class Fake:
        @staticmethod
        def unavailable_reason(device):
            calls.append(device)
            return None

    monkeypatch.setitem(backends._loaded, "reference", Fake)
    monkeypatch.setattr(backends, "_reasons", {})
    for _ in range(3):
        assert backends.resolve("reference", torch.device("cpu")) == "reference"
        assert backends.resolve("reference", torch.device("meta")) == "reference"
    assert calls == [torch.device("cpu"), torch.device("meta")]


def _coherent_problem(dtype, kind, M=2, N=256, K=256, r=8, rel=1e-3):
    """A small adapter update s B A, about `rel` of |W0| per element, aligned with x (its rows have x's signs) and
    with g (its column has g's signs), on a base that maps x and g to zero: W0's columns come in pairs (w, -w) where
    x's come in pairs (a, a), and its rows in equal pairs where g's signs alternate. Every product with W0 cancels
    exactly (the scales are powers of 2, so W0 is exact in every compute dtype), so y and dx are the adapter's effect
    alone and a backend that loses it (by rounding W0 + s B A to a 16-bit dtype: |s B A| is below half an ulp of
    most of W0, and summed over K the loss is coherent) fails by far. The pairs also give rows 2i and
    2i + 1 of W0 + s B A the same norm, so that g c still cancels on W0."""
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    sgn = torch.sign(rand(K // 2))
    x = (rand(M, K // 2).abs() * sgn).repeat_interleave(2, dim=1).to(dtype)
    A = (rand(r, K // 2).abs() * sgn).repeat_interleave(2, dim=1) / K ** 0.5
    q = (rand(N // 2, K // 2) * 64).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    w8 = torch.stack([q, -q], dim=2).reshape(N // 2, K).repeat_interleave(2, dim=0).to(torch.float8_e4m3fn)
    v = torch.tensor([1.0, -1.0]).repeat(N // 2)
    b = rand(N // 2, r).abs().repeat_interleave(2, dim=0)
    B = v[:, None] * b
    scale = {"tensor": torch.tensor(2.0 ** -9),
             "row": (2.0 ** -torch.randint(8, 11, (N // 2,), generator=g)).repeat_interleave(2),
             "block": 2.0 ** -torch.randint(8, 11, (N // 16, K // 16), generator=g).float()}[kind]
    W0 = w8.double() * (scale[:, None].double() if kind == "row" else scale.repeat_interleave(16, 0)
                        .repeat_interleave(16, 1).double() if kind == "block" else scale.double())
    s = 0.5
    B = B * (rel * W0.abs().mean() / (s * B.double() @ A.double()).abs().mean()).float()
    m = (rand(N // 2).abs() + 0.5).repeat_interleave(2)
    gy = (rand(M, 1).abs() + 0.5) * v
    return x, w8, scale.float(), A, B, m, s, W0, gy.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("kind", ["tensor", "row", "block"])
def test_backend_keeps_a_small_coherent_adapter(backend, dtype, kind):
    """Every backend keeps the effect of an adapter update much smaller than W0's rounding step: y and dx against
    fp64 at the dtype's tolerance (_coherent_problem: on it the base terms cancel, so the adapter is all of y and dx).
    PEFT keeps it by computing x W0^T and s (x A^T) B^T apart; the cuBLAS strategy's merged weight (W0 + s B A
    rounded once to the compute dtype) lost it: y off by 27 to 58% of its scale in bf16, 2 to 5% in fp16 (10
    times the tolerance), just over the tolerance in fp32; dx (per tensor and block scales) by 35 to 42% in bf16."""
    from tests._ref import dora_fp64
    from tests._tolerance import assert_close, tol
    from dorafp8 import dora_fp8_linear

    if kind == "row" and dtype == torch.float16 and "fp16-row" not in backends.supports(backend):
        pytest.skip(f"{backend} does not take fp16 with per-row scales (test_backend_fp16_row_scales_far_apart)")
    x, w8, scale, A, B, m, s, W0, gy = _coherent_problem(dtype, kind)
    y64, (x64, *_) = dora_fp64(x, W0, A, B, m, s)
    (dx64,) = torch.autograd.grad(y64, x64, gy.double())
    xl = x.clone().requires_grad_()
    y = dora_fp8_linear(xl, w8, scale, A, B, m, s, backend=backend, block_size=16)
    (dx,) = torch.autograd.grad(y, xl, gy)
    # the adapter's effect is all of y64 and dx64: the base terms cancel
    c = m.double() / (W0 + s * B.double() @ A.double()).norm(dim=1)
    assert (x.double() @ W0.T).abs().max() < 1e-9 * y64.abs().max()
    assert ((gy.double() * c) @ W0).abs().max() < 1e-9 * dx64.abs().max()
    assert_close(y, y64, tol(dtype), f"{backend} y")
    assert_close(dx, dx64, tol(dtype), f"{backend} dx")


def test_backend_fp16_row_scales_far_apart(backend):
    """fp16 with per-row scales far apart (here 2^-10 and 2^-3: channel-wise fp8 files, compressed-tensors' and
    ModelOpt's per-channel formats): y and dx stay finite and at fp16's tolerance of fp64 wherever PEFT's fp16
    product (x times W0 rounded to fp16) is. The cuBLAS strategy's one dequantized copy took every row at the largest
    scale (kappa), so a small-scale row's product came out kappa / scale = 128 times too large before its epilogue
    scaled it back: inf in fp16, where the true output is about 2000."""
    from tests._ref import dora_fp64
    from tests._tolerance import assert_close, tol
    from dorafp8 import dora_fp8_linear

    g = torch.Generator().manual_seed(0)
    M, N, K, r = 4, 8, 256, 4
    x = (torch.rand(M, K, generator=g) * 4 + 16).to(torch.float16)  # positive: row 0's terms add up
    w8 = (torch.rand(N, K, generator=g) * 64 - 32).to(torch.float8_e4m3fn)
    w8[0] = 448.0
    scale = torch.full((N,), 2.0 ** -3)
    scale[0] = 2.0 ** -10
    W0 = w8.double() * scale.double()[:, None]
    A = torch.randn(r, K, generator=g) * 1e-2
    B = torch.randn(N, r, generator=g) * 1e-2
    m = W0.norm(dim=1).float()
    gy = (torch.randn(M, N, generator=g) * 1e-2).to(torch.float16)
    y64, (x64, *_) = dora_fp64(x, W0, A, B, m, 1.0)
    (dx64,) = torch.autograd.grad(y64, x64, gy.double())
    assert y64[:, 0].abs().max() < 2 ** 13 and (x.double() @ W0.T * 128)[:, 0].abs().min() > 65504  # the premise
    if "fp16-row" not in backends.supports(backend):  # refused by name (and passed over by backend="auto")
        with pytest.raises(ValueError, match=f"fp16 compute with per-row weight scales is not supported by the {backend}"):
            dora_fp8_linear(x, w8, scale, A, B, m, 1.0, backend=backend)
        return
    xl = x.clone().requires_grad_()
    y = dora_fp8_linear(xl, w8, scale, A, B, m, 1.0, backend=backend)
    (dx,) = torch.autograd.grad(y, xl, gy)
    assert_close(y, y64, tol(torch.float16), f"{backend} y")
    assert_close(dx, dx64, tol(torch.float16), f"{backend} dx")
