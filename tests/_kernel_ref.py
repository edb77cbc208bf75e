"""Shared by the kernel tests of every backend (tests/test_triton_kernels.py, tests/test_cuda.py): problem setup,
fp64 evaluations of the backend contract's formulas (DORA_MATH.md) and the dtype-following tolerance check."""

import torch

import dorafp8.reference as reference
from dorafp8 import quantize_e4m3

S = 1.75  # lora scaling
P = 0.25  # dropout probability


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
    # Rows of different magnitudes, so that per-row scales differ by up to 30x.
    w8, sigma = quantize_e4m3(rnd(N, K) * 0.05 * torch.linspace(0.1, 3.0, N)[:, None], per_row=row_wise)
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


# ---- one backend's op against fp64 and the reference backend (the body of each backend's kernel tests)

def check_forward(forward, p, mode, has_bias, dtype):
    """forward(...) of a backend module in `mode` ("plain", "nodrop", "dropout") on problem p."""
    M, N = p["x"].shape[0], p["w8"].shape[0]
    bias = p["bias"] if has_bias else None
    if mode == "plain":
        args = (p["x"], p["w8"], p["sigma"], bias, None, None, None, S, None, False)
    elif mode == "nodrop":
        args = (p["x"], p["w8"], p["sigma"], bias, p["c"], p["u_nodrop"], p["B"], S, None, True)
    else:
        args = (p["x"], p["w8"], p["sigma"], bias, p["c"], p["u"], p["B"], S, p["xd"], True)
    y, z = forward(*args)
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


def check_dgrad(dgrad, p, mode, dtype):
    """dgrad(...) of a backend module in `mode` ("plain", "nodrop", "dropout") on problem p."""
    M, K = p["g"].shape[0], p["w8"].shape[1]
    if mode == "plain":
        args = (p["g"], p["w8"], p["sigma"], None, None, None, S, None, P)
    elif mode == "nodrop":
        args = (p["g"], p["w8"], p["sigma"], p["c"], p["v"], p["A"], S, None, P)
    else:
        args = (p["g"], p["w8"], p["sigma"], p["c"], p["v"], p["A"], S, p["mask"], P)
    dx = dgrad(*args)
    assert dx.dtype == dtype and dx.shape == (M, K)
    assert_close(dx, dgrad_64(*args), tol(dtype), f"dgrad[{mode}] vs fp64")
    assert_close(dx, reference.dgrad(*args), 2 * tol(dtype), f"dgrad[{mode}] vs reference")
