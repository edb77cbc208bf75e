"""CUDA C++ backend (csrc/ -> dorafp8._C, wrapped by dorafp8.cuda_backend) against fp64 evaluations of DORA_MATH.md
and against dorafp8.reference.

On a machine without a GPU (CI) only the build is checked: the extension must import (CI force-builds it; a missing
module fails unless DORAFP8_SKIP_CUDA_BUILD=1 says the build was skipped on purpose), the binding's argument checks
must answer, and the backend must say why it cannot run on CPU. The kernel tests need a CUDA GPU: every op in bf16,
fp16 and fp32, odd shapes (M = 1, 37; N = 70, 129; K = 50, 4096; r = 1 .. 256), bias, dropout, per-row scales, strided
activations, and outputs that start as NaN (DORAFP8_POISON=1) so that a tile the kernel never writes fails.
"""

import os

import pytest
import torch

import dorafp8.cuda_backend as cb
import dorafp8.reference as reference
from dorafp8 import backends

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda"
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU: the CUDA kernels cannot run on CPU")
SKIPPED_BUILD = os.environ.get("DORAFP8_SKIP_CUDA_BUILD") == "1"

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (M, K, N, r, strided). M = 1 and 37 (one ragged 64-row tile), 65 and 130 (the 128-row tiles, ragged), 300 (several);
# K = 50 and 257 (not a multiple of 16: byte-wise fp8 copies), 64/96/128/1000/4096 (16-byte copies, long pipelines);
# N = 70, 129 (odd: no paired stores), 383, 700, 1024 (several 128-column tiles); r = 1, 3, 8, 16, 40, 72, 128, 256
# (one to eight rank chunks of 32); `strided` puts the activations in wider buffers (row stride = width + 7, which
# also makes them unaligned for 16-byte copies).
SHAPES = [
    (1, 50, 70, 1, False),
    (37, 50, 70, 3, True),
    (37, 4096, 70, 16, False),
    (37, 64, 48, 128, True),
    (65, 128, 129, 1, False),
    (130, 96, 200, 40, True),
    (129, 257, 383, 256, False),
    (300, 1000, 700, 72, True),
    (4, 4096, 1024, 8, False),
]

S = 1.75  # lora scaling
P = 0.25  # dropout probability


# ------------------------------------------------------------------------------------------------------ helpers

def tol(dtype: torch.dtype) -> float:
    """Allowed error, relative to |ref| + max|ref| (the output scale): fp32 is accumulation-order noise; fp16 and
    bf16 are a few roundings of the output (2^-11, 2^-8) plus the rounding of g * c to the compute dtype in dgrad."""
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]


def assert_close(out: torch.Tensor, ref: torch.Tensor, rel: float, what: str):
    """|out - ref| <= rel * (|ref| + max|ref|) elementwise; NaN (an unwritten, poisoned element) always fails.
    Reports the first mismatching index."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    o = out.detach().double().cpu()
    r = ref.detach().double().cpu()
    err = (o - r).abs()
    allowed = rel * (r.abs() + r.abs().max())
    bad = ~(err <= allowed)
    if bad.any():
        first = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{bad.numel()} mismatches; first at {first}: got {o[first].item()!r}, "
            f"expected {r[first].item()!r} (allowed {allowed[first].item():.3g}); max err "
            f"{err.nan_to_num(float('inf')).max().item():.3g}, output scale {r.abs().max().item():.3g}")


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setenv("DORAFP8_POISON", "1")


def quantize(w: torch.Tensor, row_wise: bool):
    """The FP8 recipe of DORA_MATH.md: sigma = amax / 448 (per tensor or per row), W8 = round(W / sigma)."""
    amax = w.abs().amax(dim=1, keepdim=True) if row_wise else w.abs().amax().reshape(1, 1)
    sigma = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax)).float()
    w8 = (w / sigma).clamp(-448, 448).to(torch.float8_e4m3fn)
    return w8, (sigma.reshape(-1) if row_wise else sigma.reshape(()))


def act(t: torch.Tensor, dtype, strided: bool) -> torch.Tensor:
    """t in `dtype` on DEVICE; with strided=True a view into a wider buffer (row stride = width + 7)."""
    t = t.to(dtype)
    if not strided:
        return t.to(DEVICE)
    buf = torch.full((t.shape[0], t.shape[1] + 7), float("nan"), dtype=dtype, device=DEVICE)
    buf[:, : t.shape[1]] = t
    return buf[:, : t.shape[1]]


def make_problem(M, K, N, r, dtype, row_wise, strided, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    # Rows of different magnitudes, so that per-row scales differ by up to 30x.
    w8, sigma = quantize(rnd(N, K) * 0.05 * torch.linspace(0.1, 3.0, N)[:, None], row_wise)
    x = rnd(M, K)
    mask = torch.rand(M, K, generator=gen) >= P
    xd = x * mask / (1 - P)
    A = rnd(r, K) / K ** 0.5
    B = rnd(N, r) * 0.1
    c = (0.5 + torch.rand(N, generator=gen)).float()
    c[::5] = 1.0  # DoRA's init: c == 1 exactly, where (c - 1) must be exactly 0
    p = dict(w8=w8.to(DEVICE), sigma=sigma.to(DEVICE), mask=mask.to(DEVICE), c=c.to(DEVICE))
    p["x"] = act(x, dtype, strided)
    p["xd"] = act(xd, dtype, strided)
    p["A"] = A.to(dtype).to(DEVICE)
    p["B"] = B.to(dtype).to(DEVICE)
    p["bias"] = (rnd(N) * 0.1).to(dtype).to(DEVICE)
    p["g"] = act(rnd(M, N), dtype, strided)
    # u and v as the autograd layer computes them (in the compute dtype); the formulas below use these same values.
    p["u"] = act(d(p["xd"]) @ d(p["A"]).T, dtype, strided)
    p["u_nodrop"] = act(d(p["x"]) @ d(p["A"]).T, dtype, strided)
    p["v"] = act((d(p["g"]) * c.double()) @ d(p["B"]), dtype, strided)
    return p


# fp64 evaluations of the formulas of DORA_MATH.md, from the exact (already rounded) inputs the kernels see.
def d(t):
    return t.detach().double().cpu()


def w0_64(w8, sigma):
    return d(w8) * d(sigma).reshape(-1, 1)


def weight_norm_64(w8, sigma, A, B, s):
    return torch.linalg.vector_norm(w0_64(w8, sigma) + s * d(B) @ d(A), dim=1)


def forward_64(x, w8, sigma, bias, c, u, B, s, xd):
    W0 = w0_64(w8, sigma)
    b = d(bias) if bias is not None else 0.0
    if c is None:
        return d(x) @ W0.T + b, None
    lora = s * d(u) @ d(B).T
    if xd is None:
        z = d(x) @ W0.T + lora
        return d(c) * z + b, z
    z = d(xd) @ W0.T + lora
    return d(x) @ W0.T + b + (d(c) - 1) * (d(xd) @ W0.T) + d(c) * lora, z


def dgrad_64(g, w8, sigma, c, v, A, s, mask, p):
    W0 = w0_64(w8, sigma)
    if c is None:
        return d(g) @ W0
    lora = s * d(v) @ d(A)
    if mask is None:
        return (d(g) * d(c)) @ W0 + lora
    return d(g) @ W0 + d(mask) / (1 - p) * ((d(g) * (d(c) - 1)) @ W0 + lora)


def shape_id(sh):
    M, K, N, r, strided = sh
    return f"M{M}-K{K}-N{N}-r{r}" + ("-strided" if strided else "")


# ------------------------------------------------------------------------------------------------------ CPU tests

def _require_extension():
    if SKIPPED_BUILD:
        pytest.skip("DORAFP8_SKIP_CUDA_BUILD=1: the CUDA extension was not built on purpose")
    if cb._C is None:
        pytest.fail(f"dorafp8._C does not import ({cb._IMPORT_ERROR}); build it with: {cb.BUILD_COMMAND}")
    return cb._C


def test_extension_built():
    """CI force-builds the extension: it must import and export the kernels' entry points."""
    C = _require_extension()
    for name in ("weight_norm", "forward", "dgrad", "kernel_image_error"):
        assert callable(getattr(C, name, None)), f"dorafp8._C lacks {name}"


def test_binding_checks_device():
    """The binding's checks run before any launch, so they answer on CPU too, naming the argument."""
    C = _require_extension()
    w8 = torch.zeros(4, 16).to(torch.float8_e4m3fn)
    x, scale, y = torch.zeros(2, 16), torch.ones(()), torch.empty(2, 4)
    with pytest.raises(RuntimeError, match="x must be a CUDA tensor"):
        C.forward(x, w8, scale, None, None, None, None, 0.0, None, y, None)
    with pytest.raises(RuntimeError, match="g must be a CUDA tensor"):
        C.dgrad(torch.zeros(2, 4), w8, scale, scale, None, None, None, 0.0, None, 0.0, torch.empty(2, 16))
    with pytest.raises(RuntimeError, match="w8 must be a CUDA tensor"):
        C.weight_norm(w8, scale, torch.zeros(1, 16), torch.zeros(4, 1), 1.0, torch.empty(4))


def test_unavailable_reason_cpu(monkeypatch):
    reason = cb.unavailable_reason(torch.device("cpu"))
    assert isinstance(reason, str) and reason
    if cb._C is not None:
        assert "CUDA devices only" in reason
    # Without the extension the reason names the command that builds it.
    monkeypatch.setattr(cb, "_C", None)
    monkeypatch.setattr(cb, "_IMPORT_ERROR", ImportError("No module named 'dorafp8._C'"))
    for dev in ("cpu", "cuda"):
        reason = cb.unavailable_reason(torch.device(dev))
        assert cb.BUILD_COMMAND in reason and "dorafp8._C" in reason
    assert "DORAFP8_FORCE_CUDA_BUILD=1 pip install -e . --no-build-isolation" == cb.BUILD_COMMAND


def test_registry_on_cpu():
    assert isinstance(backends.unavailable_reason("cuda", torch.device("cpu")), str)
    assert "cuda" not in backends.available_backends("cpu")


# ------------------------------------------------------------------------------------------------------ GPU tests

@gpu
def test_available_on_gpu():
    assert cb.unavailable_reason(torch.device("cuda")) is None, cb.unavailable_reason(torch.device("cuda"))
    assert "cuda" in backends.available_backends("cuda")


@gpu
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("row_wise", [False, True], ids=["tensor-scale", "row-scale"])
@pytest.mark.parametrize("adapter_dtype", DTYPES, ids=str)
def test_weight_norm(shape, row_wise, adapter_dtype):
    M, K, N, r, strided = shape
    p = make_problem(M, K, N, r, adapter_dtype, row_wise, strided)
    A, B = p["A"], p["B"]
    if strided:  # adapters may come with any strides (the wrapper makes them contiguous)
        B = B.T.contiguous().T
    n = cb.weight_norm(p["w8"], p["sigma"], A, B, S)
    assert n.dtype == torch.float32 and n.shape == (N,)
    assert_close(n, weight_norm_64(p["w8"], p["sigma"], A, B, S), tol(torch.float32), "weight_norm vs fp64")
    assert_close(n, reference.weight_norm(p["w8"], p["sigma"], A, B, S), 2 * tol(torch.float32),
                 "weight_norm vs reference")


@gpu
def test_weight_norm_mixed_adapter_dtypes():
    p = make_problem(3, 96, 40, 5, torch.float32, False, False)
    A, B = p["A"], p["B"].to(torch.bfloat16)
    n = cb.weight_norm(p["w8"], p["sigma"], A, B, S)
    assert_close(n, weight_norm_64(p["w8"], p["sigma"], A, B, S), tol(torch.float32), "weight_norm fp32 A, bf16 B")


@gpu
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["nodrop", "dropout", "plain"])
@pytest.mark.parametrize("row_wise", [False, True], ids=["tensor-scale", "row-scale"])
@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "nobias"])
def test_forward(shape, dtype, mode, row_wise, has_bias):
    M, K, N, r, strided = shape
    p = make_problem(M, K, N, r, dtype, row_wise, strided)
    bias = p["bias"] if has_bias else None
    if mode == "plain":
        args = (p["x"], p["w8"], p["sigma"], bias, None, None, None, S, None, False)
    elif mode == "nodrop":
        args = (p["x"], p["w8"], p["sigma"], bias, p["c"], p["u_nodrop"], p["B"], S, None, True)
    else:
        args = (p["x"], p["w8"], p["sigma"], bias, p["c"], p["u"], p["B"], S, p["xd"], True)
    y, z = cb.forward(*args)
    y64, z64 = forward_64(*args[:-1])
    assert y.dtype == dtype and y.shape == (M, N)
    assert_close(y, y64, tol(dtype), f"forward[{mode}] y vs fp64")
    y_ref, z_ref = reference.forward(*args)
    assert_close(y, y_ref, 2 * tol(dtype), f"forward[{mode}] y vs reference")
    if mode == "plain":
        assert z is None
    else:
        assert z.dtype == dtype and z.shape == (M, N)
        assert_close(z, z64, tol(dtype), f"forward[{mode}] z vs fp64")
        assert_close(z, z_ref, 2 * tol(dtype), f"forward[{mode}] z vs reference")


@gpu
@pytest.mark.parametrize("mode", ["nodrop", "dropout"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_without_z(mode, dtype):
    p = make_problem(5, 40, 36, 3, dtype, False, False)
    xd = p["xd"] if mode == "dropout" else None
    u = p["u"] if mode == "dropout" else p["u_nodrop"]
    y, z = cb.forward(p["x"], p["w8"], p["sigma"], p["bias"], p["c"], u, p["B"], S, xd, False)
    assert z is None
    y64, _ = forward_64(p["x"], p["w8"], p["sigma"], p["bias"], p["c"], u, p["B"], S, xd)
    assert_close(y, y64, tol(dtype), f"forward[{mode}, need_z=False] y vs fp64")


@gpu
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["nodrop", "dropout", "plain"])
@pytest.mark.parametrize("row_wise", [False, True], ids=["tensor-scale", "row-scale"])
def test_dgrad(shape, dtype, mode, row_wise):
    M, K, N, r, strided = shape
    p = make_problem(M, K, N, r, dtype, row_wise, strided)
    if mode == "plain":
        args = (p["g"], p["w8"], p["sigma"], None, None, None, S, None, P)
    elif mode == "nodrop":
        args = (p["g"], p["w8"], p["sigma"], p["c"], p["v"], p["A"], S, None, P)
    else:
        args = (p["g"], p["w8"], p["sigma"], p["c"], p["v"], p["A"], S, p["mask"], P)
    dx = cb.dgrad(*args)
    assert dx.dtype == dtype and dx.shape == (M, K)
    assert_close(dx, dgrad_64(*args), tol(dtype), f"dgrad[{mode}] vs fp64")
    assert_close(dx, reference.dgrad(*args), 2 * tol(dtype), f"dgrad[{mode}] vs reference")


@gpu
@pytest.mark.parametrize("op", ["forward", "dgrad"])
def test_int64_offsets(op):
    """M * K > 2^31 elements: row offsets must be computed in 64 bits. Checks the last rows only."""
    M, K, N = (1 << 16) + 3, (1 << 15) + 16, 24
    need = 2 * M * K * 2 + (1 << 30)
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free GPU memory")
    gen = torch.Generator().manual_seed(1)
    w8, sigma = quantize(torch.randn(N, K, generator=gen) * 0.05, False)
    w8, sigma = w8.to(DEVICE), sigma.to(DEVICE)
    tail = slice(M - 40, M)
    if op == "forward":
        x = torch.zeros(M, K, dtype=torch.bfloat16, device=DEVICE)
        x[tail] = torch.randn(40, K, generator=gen).to(torch.bfloat16).to(DEVICE)
        y, _ = cb.forward(x, w8, sigma, None, None, None, None, S, None, False)
        assert_close(y[tail], d(x[tail]) @ w0_64(w8, sigma).T, tol(torch.bfloat16), "forward, last rows")
        assert not torch.isnan(y[: M - 40]).any()
    else:
        g = torch.randn(M, N, generator=gen).to(torch.bfloat16).to(DEVICE)
        dx = cb.dgrad(g, w8, sigma, None, None, None, S, None, 0.0)
        assert_close(dx[tail], d(g[tail]) @ w0_64(w8, sigma), tol(torch.bfloat16), "dgrad, last rows")


@gpu
def test_rejects_bad_arguments():
    p = make_problem(2, 32, 16, 1, torch.float32, False, False)
    y = torch.empty(2, 16, device=DEVICE)
    with pytest.raises(RuntimeError, match="w8 must be"):
        cb._C.forward(p["x"], p["w8"].float(), p["sigma"].reshape(1), None, None, None, None, S, None, y, None)
    with pytest.raises(RuntimeError, match="scale must have one element"):
        cb._C.forward(p["x"], p["w8"], torch.ones(3, device=DEVICE), None, None, None, None, S, None, y, None)
    with pytest.raises(RuntimeError, match="y must have shape"):
        cb._C.forward(p["x"], p["w8"], p["sigma"].reshape(1), None, None, None, None, S, None, y[:1], None)
    with pytest.raises(RuntimeError, match="u and B are required"):
        cb._C.forward(p["x"], p["w8"], p["sigma"].reshape(1), None, p["c"], None, None, S, None, y, None)
