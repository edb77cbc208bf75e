"""Reference backend: the backend contract (backends/base.py) in plain PyTorch, fp32; the twin every kernel is tested
against and the backend on CPU. Weights and activations are walked in fp32 row blocks of at most `_BLOCK_BYTES`, so
the extra peak is a few blocks, whatever the shape."""

from __future__ import annotations

import torch

from ..quant import E4M3_MAX, row_blocks, row_step, scale_kind, w0_rows, weight_dims
from .base import magnitude_scale, norm_divisor


# Every feature, the microscaled weights (MXFP8, NVFP4) included; NVFP4's global scale comes as `global_scale`.
SUPPORTS = frozenset({"block", "rowwise", "fp32", "fp16-row", "mxfp8", "nvfp4"})


def unavailable_reason(device: torch.device) -> str | None:
    return None  # runs wherever PyTorch runs


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W8A8's activation recipe in fp32: (t8 as fp32 values, sigma [M] fp32) with t ~= t8 * sigma[:, None], sigma =
    amax of the row / 448 (1 for an all-zero row), t8 = e4m3(t / sigma) rounded to nearest even."""
    t = t.float()
    amax = t.abs().amax(dim=1)
    sigma = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    t8 = (t / sigma[:, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return t8, sigma


def weight_norm(w8, scale, block_size, A, B, s, global_scale=None):
    N, K = weight_dims(w8)
    A32 = A.float()
    n = torch.empty(N, dtype=torch.float32, device=w8.device)
    for j0, j1 in row_blocks(N, K, row_step(scale, block_size)):
        v = w0_rows(w8, scale, block_size, j0, j1, global_scale)
        v.addmm_(B[j0:j1].float(), A32, alpha=s)
        n[j0:j1] = torch.linalg.vector_norm(v, dim=1)
        del v
    return n


def _dropped(a, mask, p, i0, i1):
    """Rows i0:i1 of a, times mask / (1 - p) when a dropout mask is given, in fp32 (exact up to that product)."""
    a32 = a[i0:i1].float()  # may be a itself (fp32): never modified in place
    return a32 if mask is None else a32 * mask[i0:i1] * (1.0 / (1.0 - p))


def project(a, b, out_dtype, mask, p):
    out = torch.empty(a.shape[0], b.shape[0], dtype=out_dtype, device=a.device)
    b32 = b.float()
    for i0, i1 in row_blocks(a.shape[0], a.shape[1]):
        out[i0:i1] = _dropped(a, mask, p, i0, i1) @ b32.T
    return out


def project_grad(v, a, mask, p, s, out_dtype):
    out = torch.zeros(v.shape[1], a.shape[1], dtype=torch.float32, device=a.device)
    for i0, i1 in row_blocks(a.shape[0], a.shape[1]):
        out.addmm_(v[i0:i1].float().T, _dropped(a, mask, p, i0, i1))
    return out.mul_(s).to(out_dtype)


def _base_gemm(x, w8, scale, block_size, act_quant, global_scale=None):
    """x @ W0^T in fp32 [M, N] (x quantized per row first under W8A8), one block of weight rows at a time."""
    M = x.shape[0]
    N, K = weight_dims(w8)
    x32, sx = quantize_rows(x) if act_quant else (x.float(), None)
    out = torch.empty(M, N, dtype=torch.float32, device=x.device)
    for j0, j1 in row_blocks(N, K, row_step(scale, block_size)):
        out[:, j0:j1] = x32 @ w0_rows(w8, scale, block_size, j0, j1, global_scale).T
    if sx is not None:
        out *= sx[:, None]
    return out


def forward(x, w8, scale, block_size, bias, m, n, u, B, s, xm, p, need_z, z_dtype, act_quant, global_scale=None):
    cdt = x.dtype
    c = None if m is None else magnitude_scale(m, n)
    M, N = x.shape[0], w8.shape[0]
    y = torch.empty(M, N, dtype=cdt, device=x.device)
    z = torch.empty(M, N, dtype=z_dtype, device=x.device) if (c is not None and need_z) else None
    b32 = None if bias is None else bias.float()
    B32 = None if B is None else B.float()
    # Blocks of activation rows: the fp32 [rows, N] temporaries stay bounded.
    for i0, i1 in row_blocks(M, max(N, x.shape[1])):
        base = _base_gemm(x[i0:i1], w8, scale, block_size, act_quant, global_scale)
        if c is None:
            yb = base
        else:
            lora = (u[i0:i1].float() @ B32.T).mul_(s)
            if xm is None:
                zb = base.add_(lora)
                yb = zb * c
            else:
                zb = _base_gemm(xm[i0:i1], w8, scale, block_size, act_quant, global_scale)
                zb.mul_(1.0 / (1.0 - p)).add_(lora)
                # x W0^T + (c - 1) * (xd W0^T) + c * s u B^T  ==  base + (c - 1) * z + lora
                yb = base.add_((c - 1) * zb).add_(lora)
            if z is not None:
                z[i0:i1] = zb
        if b32 is not None:
            yb += b32
        y[i0:i1] = yb
    return y, z


def _normalized(f, device):
    """(f / r, r), r = max|f| (fp32 0-dim, >= tiny): g * (f / r) cannot overflow; f None: (None, 1)."""
    if f is None:
        return None, torch.ones((), dtype=torch.float32, device=device)
    r = f.abs().amax().clamp_min(torch.finfo(torch.float32).tiny)
    return f / r, r


def grad_factors(c, srow, dropout, device):
    """The per-column factors of backward_pass's scaled copies of g, with their scalars (_normalized): (fl, rl) for gl =
    g * fl and, with an adapter and dropout, (fb, rb) for gb = g * fb (None: g itself); (None, None) without."""
    sr = None if srow is None else srow.float()
    if c is None:
        f = sr
    else:
        f = (c - 1) if dropout else c
        f = f if sr is None else f * sr
    fl, rl = _normalized(f, device)
    fb, rb = _normalized(sr, device) if (c is not None and dropout) else (None, None)
    return fl, rl, fb, rb


def backward_pass(g, z, m, n, srow, B, u, s, dropout, need_dm, need_dB, need_db=True):
    M, N = g.shape
    cdt = g.dtype
    adapter = m is not None
    c = magnitude_scale(m, n) if adapter else None
    fl, rl, fb, rb = grad_factors(c, srow, dropout, g.device)
    gl = g if fl is None else torch.empty_like(g)
    gb = None if rb is None else g if fb is None else torch.empty_like(g)
    v = torch.empty(M, B.shape[1], dtype=B.dtype, device=g.device) if adapter else None
    dm = torch.zeros(N, dtype=torch.float32, device=g.device) if (adapter and need_dm) else None
    dB = torch.zeros(N, B.shape[1], dtype=torch.float32, device=g.device) if (adapter and need_dB) else None
    db = torch.zeros(N, dtype=torch.float32, device=g.device) if need_db else None
    B32 = B.float() if adapter else None
    for i0, i1 in row_blocks(M, N):
        g32 = g[i0:i1].float()
        if db is not None:
            db += g32.sum(0)
        if fl is not None:
            gl[i0:i1] = (g32 * fl).to(cdt)
        if fb is not None:
            gb[i0:i1] = (g32 * fb).to(cdt)
        if not adapter:
            continue
        v[i0:i1] = (g32 * c) @ B32
        if dm is not None:
            dm += (g32 * z[i0:i1].float()).sum(0)
        if dB is not None:
            dB.addmm_(g32.T, u[i0:i1].float())
    return gl, scalars(rl, rb), gb, v, *finish_sums(dm, db, dB, m, n, c, s, cdt, B)


def scalars(rl, rb):
    """backward_pass's rs: fp32 [2] = (rl, rb), rb = 1 when there is none."""
    return torch.stack((rl, torch.ones_like(rl) if rb is None else rb.to(rl.dtype)))


def finish_sums(dm, db, dB, m, n, c, s, cdt, B):
    """backward_pass's fp32 column sums as the contract returns them: dm, db, dB, each rounded once."""
    if dm is not None:
        dm = (dm / norm_divisor(n.float())).to(m.dtype)
    if dB is not None:
        dB = (dB * (s * c)[:, None]).to(B.dtype)
    return dm, (None if db is None else db.to(cdt)), dB


def _dgrad_gemm(t, w8, scale, block_size, act_quant, global_scale=None):
    """t @ W0' in fp32 [M, K] (block / microscaled scales applied, W8A8 t quantized), a row block at a time."""
    N, K = weight_dims(w8)
    t32, st = quantize_rows(t) if act_quant else (t.float(), None)
    out = torch.zeros(t.shape[0], K, dtype=torch.float32, device=t.device)
    scaled = scale_kind(scale) not in ("tensor", "row")
    for j0, j1 in row_blocks(N, K, row_step(scale, block_size)):
        w = w0_rows(w8, scale, block_size, j0, j1, global_scale) if scaled else w8[j0:j1].float()
        out.addmm_(t32[:, j0:j1], w)
        del w  # before the next block is made
    if st is not None:
        out *= st[:, None]
    return out


def dgrad(gl, rl, w8, scale, block_size, v, A, s, mask, p, gb, rb, act_quant, global_scale=None):
    cdt = gl.dtype
    N, K = weight_dims(w8)
    M = gl.shape[0]
    st = scale.float() if scale_kind(scale) == "tensor" else 1.0
    dx = torch.empty(M, K, dtype=cdt, device=gl.device)
    A32 = None if A is None else A.float()
    for i0, i1 in row_blocks(M, max(K, N)):
        out = _dgrad_gemm(gl[i0:i1], w8, scale, block_size, act_quant, global_scale).mul_(rl * st)
        if v is not None:
            out.addmm_(v[i0:i1].float(), A32, alpha=s)
            if mask is not None:
                out.mul_(mask[i0:i1]).mul_(1.0 / (1.0 - p))
                out.add_(_dgrad_gemm(gb[i0:i1], w8, scale, block_size, act_quant, global_scale).mul_(rb * st))
        dx[i0:i1] = out
    return dx
