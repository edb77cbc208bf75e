"""Shared by the kernel tests of every backend (test_triton_kernels.py, test_cuda.py, test_cuda_emulated.py,
test_cublas.py, test_native_backend.py): problem setup and float64 evaluations of the backend contract
(dorafp8/backends/base.py, docs/DORA_MATH.md). Each check runs one backend function and compares it with the fp64
formula evaluated on the exact (already rounded) inputs the backend saw, within tol(dtype) of tests/_tolerance.py, and
with dorafp8.backends.reference, within 2 * tol(dtype) (both sides carry the error)."""

import torch

import dorafp8.backends.reference as reference
from dorafp8 import quantize_e4m3
from dorafp8.backends.base import magnitude_scale
from dorafp8.quant import scale_rows
from tests._tolerance import assert_close, tol

S = 1.75  # lora scaling
P = 0.25  # dropout probability
BLOCK = 16  # block size of block scales in the tests: small shapes still cross several blocks


def act(t: torch.Tensor, dtype, device, strided: bool) -> torch.Tensor:
    """t in `dtype` on `device`; with strided=True a view into a wider buffer (row stride = width + 7)."""
    t = t.to(dtype)
    if not strided:
        return t.to(device)
    buf = torch.full((t.shape[0], t.shape[1] + 7), float("nan"), dtype=dtype, device=device)
    buf[:, : t.shape[1]] = t
    return buf[:, : t.shape[1]]


def make_problem(M, K, N, r, dtype, device, scale_kind, strided, seed=0, rank_dtype=None, act_scale=1.0):
    """A problem in compute dtype `dtype` with the low-rank path in `rank_dtype` (default: the same), the weight
    scale per "tensor", "row" or "block" (BLOCK x BLOCK); x and g are unit Gaussians times `act_scale`."""
    rdt = rank_dtype or dtype
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    # Rows of different magnitudes, so that per-row and per-block scales differ by up to 30x.
    W = rnd(N, K) * 0.05 * torch.linspace(0.1, 3.0, N)[:, None]
    w8, sigma = quantize_e4m3(W, per_row=scale_kind == "row", block_size=BLOCK if scale_kind == "block" else None)
    x = rnd(M, K) * act_scale
    mask = torch.rand(M, K, generator=gen) >= P
    n = (0.5 + torch.rand(N, generator=gen)).float()  # the weight norm
    m = n * (0.5 + torch.rand(N, generator=gen))  # the magnitude: c = m / n in [0.5, 1.5)
    m[::5] = n[::5]  # DoRA's init: m == n, so c == 1 exactly, where (c - 1) must be exactly 0
    c = magnitude_scale(m, n)  # c as every backend computes it (fp32, correctly rounded)
    p = dict(w8=w8.to(device), sigma=sigma.to(device), block=BLOCK, mask=mask.to(device), m=m.to(device),
             n=n.to(device), c=c.to(device), dtype=dtype, rdt=rdt, scale_kind=scale_kind)
    p["x"] = act(x, dtype, device, strided)
    p["xm"] = act(x * mask, dtype, device, strided)  # the kept part of x, unscaled (what forward takes)
    p["A"] = (rnd(r, K) / K ** 0.5).to(rdt).to(device)
    p["B"] = (rnd(N, r) * 0.1).to(rdt).to(device)
    p["bias"] = (rnd(N) * 0.1).to(dtype).to(device)
    p["g"] = act(rnd(M, N) * act_scale, dtype, device, strided)
    # u as the autograd layer computes it (in the rank dtype); the formulas below use these same values.
    p["u"] = act(d(p["xm"]) / (1 - P) @ d(p["A"]).T, rdt, device, strided)
    p["u_nodrop"] = act(d(p["x"]) @ d(p["A"]).T, rdt, device, strided)
    p["z_dtype"] = torch.promote_types(dtype, rdt)
    return p


# fp64 evaluations of the contract, from the exact (already rounded) inputs the kernels see.
def d(t):
    return t.detach().double().cpu()


def w0_64(w8, sigma, block=BLOCK):
    return d(w8) * d(scale_rows(sigma.cpu(), block, 0, w8.shape[0], w8.shape[1]))


def dx_64(p, mode, g, c):
    """dx of the DoRA math (docs/DORA_MATH.md) in fp64 from the rounded inputs: g W0 plain; (g c) W0 + s v A; with
    dropout g W0 + mask / (1 - p) ((g (c - 1)) W0 + s v A), v = (g c) B."""
    W0, g = w0_64(p["w8"], p["sigma"]), d(g)
    if mode == "plain":
        return g @ W0
    lora = S * ((g * c) @ d(p["B"])) @ d(p["A"])
    if mode == "nodrop":
        return (g * c) @ W0 + lora
    return g @ W0 + d(p["mask"]) / (1 - P) * ((g * (c - 1)) @ W0 + lora)



def large_weight_small_c(p, seed=3):
    """p with its weight scaled to a largest value of 6e4 (near fp16's 65504) and a magnitude m with c = m / n in
    [0.001, 0.003) (rows of large norm for their magnitude): (p, m, c as fp64)."""
    w0max = w0_64(p["w8"], p["sigma"]).abs().max().item()
    p = dict(p, sigma=p["sigma"] * (6e4 / w0max))
    N = p["n"].shape[0]
    m = p["n"] * (0.001 + 0.002 * torch.rand(N, generator=torch.Generator().manual_seed(seed))).to(p["n"].device)
    return p, m, d(magnitude_scale(m, p["n"]))

def w8_blocks_64(w8, sigma, block=BLOCK):
    """W8' of the dgrad contract: w8 with block scales applied, per-tensor / per-row scales left out."""
    return w0_64(w8, sigma, block) if sigma.dim() == 2 else d(w8)


def quant_rows_64(t):
    """W8A8's activation recipe (reference.quantize_rows) as fp64 values t8 * sigma."""
    t8, sig = reference.quantize_rows(t.detach().cpu())
    return d(t8) * d(sig)[:, None]


def weight_norm_64(w8, sigma, A, B, s):
    return torch.linalg.vector_norm(w0_64(w8, sigma) + s * d(B) @ d(A), dim=1)


def forward_64(x, w8, sigma, bias, c, u, B, s, xm, p, act_quant=""):
    q = quant_rows_64 if act_quant else d
    W0 = w0_64(w8, sigma)
    b = d(bias) if bias is not None else 0.0
    if c is None:
        return q(x) @ W0.T + b, None
    lora = s * d(u) @ d(B).T
    if xm is None:
        z = q(x) @ W0.T + lora
        return d(c) * z + b, z
    base_d = q(xm) @ W0.T / (1 - p)  # xd W0^T
    return q(x) @ W0.T + b + (d(c) - 1) * base_d + d(c) * lora, base_d + lora


def dgrad_64(gl, rl, w8, sigma, v, A, s, mask, p, gb, rb, act_quant=""):
    q = quant_rows_64 if act_quant else d
    W = w8_blocks_64(w8, sigma)
    st = d(sigma).item() if sigma.dim() == 0 else 1.0
    out = d(rl).item() * st * (q(gl) @ W)
    if v is None:
        return out
    out = out + s * d(v) @ d(A)
    if mask is None:
        return out
    return d(rb).item() * st * (q(gb) @ W) + d(mask) / (1 - p) * out


def shape_id(sh):
    M, K, N, r, strided = sh
    return f"M{M}-K{K}-N{N}-r{r}" + ("-strided" if strided else "")


# ---- one backend function against fp64 and the reference backend (the body of each backend's kernel tests)

def check_weight_norm(weight_norm, p):
    A, B = p["A"], p["B"]
    n = weight_norm(p["w8"], p["sigma"], p["block"], A, B, S)
    assert n.dtype == torch.float32 and n.shape == (p["w8"].shape[0],)
    # fp32 whatever the adapter dtype (16-bit products are exact, accumulation is fp32).
    assert_close(n, weight_norm_64(p["w8"], p["sigma"], A, B, S), tol(torch.float32), "weight_norm vs fp64")
    assert_close(n, reference.weight_norm(p["w8"], p["sigma"], p["block"], A, B, S), 2 * tol(torch.float32),
                 "weight_norm vs reference")


def check_project(project, project_grad, p):
    """u = x' A^T and dA / s = v^T x', x' = x or (with the dropout mask) x * mask / (1 - P) formed in fp32."""
    for mask in (None, p["mask"]):
        x = d(p["x"]) if mask is None else d(p["xm"]) / (1 - P)
        what = "" if mask is None else " with the dropout mask"
        u = project(p["x"], p["A"], p["rdt"], mask, P)
        assert u.dtype == p["rdt"]
        assert_close(u, x @ d(p["A"]).T, tol(p["rdt"]), f"project{what} vs fp64")
        v = p["u"]  # any [M, r] operand in the rank dtype will do
        for out_dtype in dict.fromkeys((torch.float32, p["rdt"])):
            dA = project_grad(v, p["x"], mask, P, S, out_dtype)
            assert dA.dtype == out_dtype
            # x * mask / (1 - P) is formed in fp32, then rounded to the rank dtype like PEFT's dropout in that dtype
            rel = tol(torch.float32 if (mask is None and out_dtype == torch.float32) else p["rdt"])
            assert_close(dA, S * d(v).T @ x, rel, f"project_grad{what} -> {out_dtype} vs fp64")


def _forward_args(p, mode, has_bias):
    bias = p["bias"] if has_bias else None
    if mode == "plain":
        return (p["x"], p["w8"], p["sigma"], p["block"], bias, None, None, None, None, S, None, P, False,
                p["dtype"])
    if mode == "nodrop":
        return (p["x"], p["w8"], p["sigma"], p["block"], bias, p["m"], p["n"], p["u_nodrop"], p["B"], S, None, P,
                True, p["z_dtype"])
    return (p["x"], p["w8"], p["sigma"], p["block"], bias, p["m"], p["n"], p["u"], p["B"], S, p["xm"], P, True,
            p["z_dtype"])


def fp8_sums_64(t, W):
    """sum_k |t8_ik| |W_jk| in fp64: the scale of an accumulator's error in the product of t quantized per row (W8A8)
    with W^T. fp8_acc (check_forward, check_dgrad) times this is what a GPU's fp8 accumulator may add on top of
    fp32's: 2^-6 on Hopper (docs/DORA_MATH.md, "Accuracy contract"; tests/kernels/test_w8a8.py allows the same)."""
    return quant_rows_64(t).abs() @ W.abs().T


def check_forward(forward, p, mode, has_bias, act_quant="", fp8_acc=0.0):
    """forward(...) of a backend module in `mode` ("plain", "nodrop", "dropout") on problem p; fp8_acc: see
    fp8_sums_64 (W8A8 only)."""
    dtype = p["dtype"]
    M, N = p["x"].shape[0], p["w8"].shape[0]
    args = _forward_args(p, mode, has_bias)
    y, z = forward(*args, act_quant)
    x, w8, sigma, _, bias, m, _, u, B, s, xm, p_, _, z_dtype = args
    y64, z64 = forward_64(x, w8, sigma, bias, None if m is None else p["c"], u, B, s, xm, p_, act_quant)
    assert y.dtype == dtype and y.shape == (M, N)
    what = f"forward[{mode}{', ' + act_quant if act_quant else ''}]"
    ey = ez = None
    if act_quant and fp8_acc:  # y = x W0^T (+ (c - 1) xm W0^T / (1 - p)) or c x W0^T, z = x W0^T or xm W0^T / (1 - p)
        W0 = w0_64(w8, sigma)
        ey = ez = fp8_acc * fp8_sums_64(x, W0)
        if xm is not None:
            ez = fp8_acc * fp8_sums_64(xm, W0) / (1 - p_)
            ey = ey + (d(p["c"]) - 1).abs() * ez
        elif m is not None:
            ey = d(p["c"]).abs() * ey
    assert_close(y, y64, tol(dtype), f"{what} y vs fp64", ey)
    y_ref, z_ref = reference.forward(*args, act_quant)
    assert_close(y, y_ref, 2 * tol(dtype), f"{what} y vs reference", ey)
    if mode == "plain":
        assert z is None
    else:
        assert z.dtype == z_dtype and z.shape == (M, N)
        assert_close(z, z64, tol(z_dtype), f"{what} z vs fp64", ez)
        assert_close(z, z_ref, 2 * tol(z_dtype), f"{what} z vs reference", ez)


def _row_scale(p):
    return p["sigma"] if p["sigma"].dim() == 1 else None


def check_backward_pass(backward_pass, p, mode, need_db=True):
    """backward_pass(...) in `mode`: "plain" (a plain FP8Linear: m is None), "nodrop" or "dropout"; without need_db
    (a layer without a bias), db is None and every other output is the one with db, bit for bit."""
    dtype, g, c = p["dtype"], p["g"], p["c"]
    srow = _row_scale(p)
    if not need_db:
        z = act(torch.randn(g.shape, generator=torch.Generator().manual_seed(5)), p["z_dtype"], g.device, False)
        args = ((g, None, None, None, srow, None, None, S, False, False, False) if mode == "plain" else
                (g, z, p["m"], p["n"], srow, p["B"], p["u" if mode == "dropout" else "u_nodrop"], S, mode == "dropout",
                 True, True))
        out, ref = backward_pass(*args, need_db=False), backward_pass(*args, need_db=True)
        assert out[5] is None and ref[5] is not None
        for i, (a, b) in enumerate(zip(out, ref)):
            if i != 5:
                assert (a is None) == (b is None) and (a is g) == (b is g), i
                assert a is None or torch.equal(a, b), f"backward_pass[{mode}, need_db=False] output {i} differs"
        return
    if mode == "plain":
        gl, rs, gb, v, dm, db, dB = backward_pass(g, None, None, None, srow, None, None, S, False, False, False)
        f = d(srow) if srow is not None else torch.ones(g.shape[1], dtype=torch.float64)
        assert v is None and dm is None and dB is None and gb is None
    else:
        dropout = mode == "dropout"
        z = act(torch.randn(g.shape, generator=torch.Generator().manual_seed(5)), p["z_dtype"], g.device, False)
        u = p["u"] if dropout else p["u_nodrop"]
        gl, rs, gb, v, dm, db, dB = backward_pass(g, z, p["m"], p["n"], srow, p["B"], u, S, dropout, True, True)
        f = (d(c) - 1 if dropout else d(c)) * (d(srow) if srow is not None else 1.0)
        assert v.dtype == p["rdt"] and dm.dtype == p["m"].dtype and dB.dtype == p["B"].dtype
        assert_close(v, (d(g) * d(c)) @ d(p["B"]), tol(p["rdt"]), f"backward_pass[{mode}] v vs fp64")
        assert_close(dm, (d(g) * d(z)).sum(0) / d(p["n"]), tol(torch.float32), f"backward_pass[{mode}] dm vs fp64")
        assert_close(dB, S * d(c)[:, None] * (d(g).T @ d(u)), tol(p["rdt"]), f"backward_pass[{mode}] dB vs fp64")
        if dropout:
            sr = d(srow) if srow is not None else 1.0
            assert gb.dtype == dtype
            assert_close(gb.double() * d(rs[1]).item(), d(g) * sr, tol(dtype), f"backward_pass[{mode}] gb * rb vs fp64")
            assert d(gb).abs().max() <= d(g).abs().max()  # |gb| <= |g|: no fp16 overflow where g has none
        else:
            assert gb is None and rs[1].item() == 1.0
    assert gl.dtype == dtype and rs.dtype == torch.float32 and rs.shape == (2,)
    assert_close(gl.double() * d(rs[0]).item(), d(g) * f, tol(dtype), f"backward_pass[{mode}] gl * rl vs fp64")
    assert d(gl).abs().max() <= d(g).abs().max()  # |gl| <= |g|: no fp16 overflow where g has none
    assert db.dtype == dtype
    assert_close(db, d(g).sum(0), tol(dtype), f"backward_pass[{mode}] db vs fp64")


def check_dgrad(dgrad, p, mode, act_quant="", fp8_acc=0.0):
    """dgrad(...) of a backend module in `mode` ("plain", "nodrop", "dropout") on problem p, its left operands
    prepared by the reference backend's backward_pass; fp8_acc: see fp8_sums_64 (W8A8 only)."""
    dtype, g = p["dtype"], p["g"]
    M, K = g.shape[0], p["w8"].shape[1]
    srow = _row_scale(p)
    if mode == "plain":
        gl, rs, *_ = reference.backward_pass(g, None, None, None, srow, None, None, S, False, False, False)
        args = (gl, rs[0], p["w8"], p["sigma"], p["block"], None, None, S, None, P, None, None)
    else:
        dropout = mode == "dropout"
        gl, rs, gb, v, *_ = reference.backward_pass(g, None, p["m"], p["n"], srow, p["B"], None, S, dropout, False,
                                                    False)
        args = (gl, rs[0], p["w8"], p["sigma"], p["block"], v, p["A"], S, p["mask"] if dropout else None, P, gb,
                rs[1] if dropout else None)
    dx = dgrad(*args, act_quant)
    assert dx.dtype == dtype and dx.shape == (M, K)
    what = f"dgrad[{mode}{', ' + act_quant if act_quant else ''}]"
    gl_, rl_, w8, sigma, _, v_, A_, s_, mask_, p_, gb_, rb_ = args
    extra = None
    if act_quant and fp8_acc:  # dgrad_64's products: rl st gl W (times mask / (1 - p)), rb st gb W
        W, st = w8_blocks_64(w8, sigma).T, d(sigma).item() if sigma.dim() == 0 else 1.0
        extra = fp8_acc * st * abs(d(rl_).item()) * fp8_sums_64(gl_, W)
        if mask_ is not None:
            extra = fp8_acc * st * abs(d(rb_).item()) * fp8_sums_64(gb_, W) + d(mask_) / (1 - p_) * extra
    assert_close(dx, dgrad_64(gl_, rl_, w8, sigma, v_, A_, s_, mask_, p_, gb_, rb_, act_quant), tol(dtype),
                 f"{what} vs fp64", extra)
    assert_close(dx, reference.dgrad(*args, act_quant), 2 * tol(dtype), f"{what} vs reference", extra)
