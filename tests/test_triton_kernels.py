"""Triton backend (dorafp8.triton_kernels) against fp64 evaluations of DORA_MATH.md and against dorafp8.reference.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (slow: shapes stay tiny, a few tens per dim,
yet cross every block edge of the interpreter's single 16 x 32 x 32 config). With a GPU the same tests run on cuda,
plus a few larger shapes, and bf16 (whose tl.dot the interpreter cannot execute) is checked too.
Every output starts as NaN (DORAFP8_POISON=1) so that a tile the kernel never writes fails.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of the kernels

import dorafp8.reference as reference  # noqa: E402

tk = pytest.importorskip("dorafp8.triton_kernels")

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# cpu under the interpreter, cuda when a GPU is present (both if someone interprets on a GPU machine).
DEVICES = [dev for dev, ok in (("cpu", INTERPRET), ("cuda", HAS_CUDA)) if ok] or [
    pytest.param("cpu", marks=pytest.mark.skip(reason="no CUDA GPU and TRITON_INTERPRET != 1"))]
DTYPES = [
    torch.float32,
    torch.float16,
    # In the interpreter bf16 tiles are upcast to fp32 before tl.dot (its bf16 dot is broken, triton #11584), so
    # there this checks the bf16 loads, stores and masks; the bf16 tensor-core dot itself is checked on a GPU.
    torch.bfloat16,
]

# (M, K, N, r, strided): M = 1; M, K, N crossing the 16/32/32 interpreter blocks with ragged edges; K, N exact
# multiples of the blocks; r = 1, 3, 16 (one padded rank chunk) and 20 (two chunks of 16 in the interpreter);
# `strided` puts the activations in wider buffers so their row stride differs from their width.
SHAPES = [
    (1, 50, 70, 1, False),
    (37, 50, 70, 3, True),
    (37, 64, 48, 16, False),
    (20, 33, 17, 20, True),
]
if HAS_CUDA:  # real GPU configs: larger tiles, several K steps, r over 64 (two rank chunks), r = 256
    SHAPES += [(300, 1000, 700, 72, True), (129, 257, 383, 256, False), (4, 4096, 1024, 8, False)]

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
            f"expected {r[first].item()!r} (allowed {allowed[first].item():.3g}); max err {err.nan_to_num(float('inf')).max().item():.3g}, "
            f"output scale {r.abs().max().item():.3g}")


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setenv("DORAFP8_POISON", "1")


def quantize(w: torch.Tensor, row_wise: bool):
    """The FP8 recipe of DORA_MATH.md: sigma = amax / 448 (per tensor or per row), W8 = round(W / sigma)."""
    amax = w.abs().amax(dim=1, keepdim=True) if row_wise else w.abs().amax().reshape(1, 1)
    sigma = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax)).float()
    w8 = (w / sigma).clamp(-448, 448).to(torch.float8_e4m3fn)
    return w8, (sigma.reshape(-1) if row_wise else sigma.reshape(()))


def act(t: torch.Tensor, dtype, device, strided: bool) -> torch.Tensor:
    """t in `dtype` on `device`; with strided=True a view into a wider buffer (row stride = width + 7)."""
    t = t.to(dtype)
    if not strided:
        return t.to(device)
    buf = torch.full((t.shape[0], t.shape[1] + 7), float("nan"), dtype=dtype, device=device)
    buf[:, : t.shape[1]] = t
    return buf[:, : t.shape[1]]


def make_problem(M, K, N, r, dtype, device, row_wise, strided, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    w8, sigma = quantize(rnd(N, K) * 0.05 * (1 + torch.rand(N, 1, generator=gen)), row_wise)
    x = rnd(M, K)
    mask = torch.rand(M, K, generator=gen) >= P
    xd = x * mask / (1 - P)
    A = rnd(r, K) / K ** 0.5
    B = rnd(N, r) * 0.1
    c = (0.5 + torch.rand(N, generator=gen)).float()
    c[::5] = 1.0  # DoRA's init: c == 1 exactly, where (c - 1) must be exactly 0
    bias = rnd(N) * 0.1
    g = rnd(M, N)
    p = dict(w8=w8.to(device), sigma=sigma.to(device), mask=mask.to(device), c=c.to(device), dtype=dtype)
    p["x"] = act(x, dtype, device, strided)
    p["xd"] = act(xd, dtype, device, strided)
    p["A"] = A.to(dtype).to(device)
    p["B"] = B.to(dtype).to(device)
    p["bias"] = bias.to(dtype).to(device)
    p["g"] = act(g, dtype, device, strided)
    # u and v as the autograd layer computes them (in the compute dtype); the formulas below use these same values.
    p["u"] = act(p["xd"].double().cpu() @ p["A"].double().cpu().T, dtype, device, strided)
    p["u_nodrop"] = act(p["x"].double().cpu() @ p["A"].double().cpu().T, dtype, device, strided)
    p["v"] = act((p["g"].double().cpu() * c.double()) @ p["B"].double().cpu(), dtype, device, strided)
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


# ------------------------------------------------------------------------------------------------------ tests

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("row_wise", [False, True], ids=["tensor-scale", "row-scale"])
@pytest.mark.parametrize("adapter_dtype", DTYPES, ids=str)
def test_weight_norm(device, shape, row_wise, adapter_dtype):
    M, K, N, r, strided = shape
    p = make_problem(M, K, N, r, adapter_dtype, device, row_wise, strided)
    A, B = p["A"], p["B"]
    if strided:  # A, B may come with any strides: a transposed B view
        B = B.T.contiguous().T
    n = tk.weight_norm(p["w8"], p["sigma"], A, B, S)
    assert n.dtype == torch.float32 and n.shape == (N,)
    # Output is fp32 whatever the adapter dtype (16-bit products are exact, accumulation is fp32).
    assert_close(n, weight_norm_64(p["w8"], p["sigma"], A, B, S), tol(torch.float32), "weight_norm vs fp64")
    assert_close(n, reference.weight_norm(p["w8"], p["sigma"], A, B, S), 2 * tol(torch.float32),
                 "weight_norm vs reference")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["nodrop", "dropout", "plain"])
@pytest.mark.parametrize("row_wise", [False, True], ids=["tensor-scale", "row-scale"])
@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "nobias"])
def test_forward(device, shape, dtype, mode, row_wise, has_bias):
    M, K, N, r, strided = shape
    p = make_problem(M, K, N, r, dtype, device, row_wise, strided)
    bias = p["bias"] if has_bias else None
    if mode == "plain":
        args = (p["x"], p["w8"], p["sigma"], bias, None, None, None, S, None, False)
    elif mode == "nodrop":
        args = (p["x"], p["w8"], p["sigma"], bias, p["c"], p["u_nodrop"], p["B"], S, None, True)
    else:
        args = (p["x"], p["w8"], p["sigma"], bias, p["c"], p["u"], p["B"], S, p["xd"], True)
    y, z = tk.forward(*args)
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["nodrop", "dropout"])
def test_forward_without_z(device, mode):
    p = make_problem(5, 40, 36, 3, torch.float32, device, False, False)
    xd = p["xd"] if mode == "dropout" else None
    u = p["u"] if mode == "dropout" else p["u_nodrop"]
    y, z = tk.forward(p["x"], p["w8"], p["sigma"], p["bias"], p["c"], u, p["B"], S, xd, False)
    assert z is None
    y64, _ = forward_64(p["x"], p["w8"], p["sigma"], p["bias"], p["c"], u, p["B"], S, xd)
    assert_close(y, y64, tol(torch.float32), f"forward[{mode}, need_z=False] y vs fp64")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["nodrop", "dropout", "plain"])
@pytest.mark.parametrize("row_wise", [False, True], ids=["tensor-scale", "row-scale"])
def test_dgrad(device, shape, dtype, mode, row_wise):
    M, K, N, r, strided = shape
    p = make_problem(M, K, N, r, dtype, device, row_wise, strided)
    if mode == "plain":
        args = (p["g"], p["w8"], p["sigma"], None, None, None, S, None, P)
    elif mode == "nodrop":
        args = (p["g"], p["w8"], p["sigma"], p["c"], p["v"], p["A"], S, None, P)
    else:
        args = (p["g"], p["w8"], p["sigma"], p["c"], p["v"], p["A"], S, p["mask"], P)
    dx = tk.dgrad(*args)
    assert dx.dtype == dtype and dx.shape == (M, K)
    assert_close(dx, dgrad_64(*args), tol(dtype), f"dgrad[{mode}] vs fp64")
    assert_close(dx, reference.dgrad(*args), 2 * tol(dtype), f"dgrad[{mode}] vs reference")


def test_unavailable_reason(monkeypatch):
    if INTERPRET:
        assert tk.unavailable_reason(torch.device("cpu")) is None
        from dorafp8 import backends

        assert backends.unavailable_reason("triton", torch.device("cpu")) is None
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reason = tk.unavailable_reason(torch.device("cpu"))
    assert isinstance(reason, str) and "TRITON_INTERPRET" in reason
    if not HAS_CUDA:
        assert isinstance(tk.unavailable_reason(torch.device("cuda")), str)


@pytest.mark.parametrize("device", DEVICES)
def test_rejects_bad_weight(device):
    p = make_problem(2, 32, 16, 1, torch.float32, device, False, False)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        tk.forward(p["x"], p["w8"].float(), p["sigma"], None, None, None, None, S, None, False)
    with pytest.raises(ValueError, match="scale"):
        tk.dgrad(p["g"], p["w8"], p["sigma"].double(), None, None, None, S, None, P)
    with pytest.raises(ValueError, match="scale"):
        tk.weight_norm(p["w8"], torch.ones(3, device=device), p["A"], p["B"], S)

