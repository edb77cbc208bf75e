"""Native backend: the backend contract (dorafp8/backends.py) in PyTorch, with the base GEMMs done by the platform's
matmul in the compute dtype (oneDNN/MKL on CPU: bf16 and fp16 products accumulate in fp32 there too).

It is the reference backend (dorafp8/reference.py) with one change: where the reference upcasts x and the weight
rows to fp32 and multiplies in fp32, this backend dequantizes a block of weight rows into the compute dtype (w8 ->
bf16/fp16/fp32 is exact; per-tensor and per-row scales stay out of it and are applied in the fp32 epilogue, block
scales are applied while dequantizing, so such a W0 is rounded once into the compute dtype) and multiplies x by it in
the compute dtype. The product comes back rounded to the compute dtype once, before the fp32 epilogue (the reference
keeps it in fp32 until the output is rounded). That is what PEFT does under autocast, and what the cublas strategy
does on a GPU; on a CPU with bf16 units it is several times faster than the fp32 GEMMs. In fp32 it is the reference
up to the order of the fp32 accumulation. The weight norm is the reference's with a faster exact fp8 -> fp32 conversion on CPU
(dorafp8/_fp8_cast.py: PyTorch converts float8 element by element there); the rank-r products and W8A8 are the
reference's own code;
the epilogues and the backward pass over g compute the reference's fp32 formulas with fewer passes over memory
(fused multiply-adds written straight into their output dtype).

Memory: as the reference, bounded blocks: a transient of at most one block of weight rows (16 MiB of fp32 worth of
elements) in the compute dtype, and fp32 epilogue temporaries over blocks of activation rows; plus, when the weight
spans several blocks, the [M, N] base product in the compute dtype (an output-sized tensor).

W8A8 and fp16 compute run the reference's code (see _reference_cases below).

`backend="auto"` uses this backend on CPU (exact twin on request: backend="reference" or DORAFP8_BACKEND=reference;
the kernel tests compare every backend with the reference, this one included: tests/test_native_backend.py).
"""

from __future__ import annotations

import itertools

import torch

from . import reference as _ref
from ._fp8_cast import e4m3_scaled_fp32, e4m3_to
from .quant import scale_kind, scale_rows

project_grad = _ref.project_grad  # fp32 [r, K] by contract: the reference's fp32 product


def weight_norm(w8, scale, block, A, B, s):
    """The reference's weight_norm (fp32, blocks of rows), with the fast exact fp8 -> fp32 conversion."""
    N, K = w8.shape
    A32 = A.float()
    n = torch.empty(N, dtype=torch.float32, device=w8.device)
    for j0, j1 in _ref._blocks(N, K, block if scale_kind(scale) == "block" else 1):
        v = e4m3_scaled_fp32(w8[j0:j1], scale_rows(scale, block, j0, j1, K))
        v.addmm_(B[j0:j1].float(), A32, alpha=s)
        n[j0:j1] = torch.linalg.vector_norm(v, dim=1)
        del v
    return n


def project(a, b, out_dtype, mask, p):
    """a' b^T in out_dtype. When a, b and out_dtype are one dtype (bf16 under autocast): the platform's matmul in that
    dtype, which accumulates in fp32 and rounds once, as the reference does, on a' = a * (mask / (1 - p)) formed in
    that dtype as PEFT's dropout forms it; otherwise the reference's (a' in fp32)."""
    if a.dtype == b.dtype == out_dtype:
        if mask is not None:
            a = a * mask.to(a.dtype).div_(1.0 - p)
        return a @ b.T
    return _ref.project(a, b, out_dtype, mask, p)


def unavailable_reason(device: torch.device) -> str | None:
    return None  # runs wherever PyTorch runs


def _weight_blocks(w8, scale, block, dtype):
    """(j0, j1, W'[j0:j1]) over blocks of weight rows, W' = w8 in `dtype` with block scales applied (per-tensor and
    per-row scales are left to the caller: w8 -> dtype is then exact)."""
    N, K = w8.shape
    blocked = scale_kind(scale) == "block"
    for j0, j1 in _ref._blocks(N, K, block if blocked else 1):
        if blocked:
            w = e4m3_scaled_fp32(w8[j0:j1], scale_rows(scale, block, j0, j1, K)).to(dtype)
        else:
            w = e4m3_to(w8[j0:j1], dtype)
        yield j0, j1, w


# _reference_cases: two cases go to the reference: W8A8 (act_quant="rowwise"; on CPU an emulation either way) and
# fp16 compute (rare on CPU): an fp16 product of x or g with the unscaled W8 (|W8| <= 448) can overflow where the
# fp32 result is far inside fp16's range.


def _out_scale(scale):
    """The fp32 factor of the base product's columns (per tensor: a scalar, per row: [N]; block: already applied)."""
    kind = scale_kind(scale)
    return None if kind == "block" else scale.float()


def forward(x, w8, scale, block, bias, c, u, B, s, xm, p, need_z, z_dtype, act_quant):
    if act_quant or x.dtype == torch.float16:  # see _reference_cases
        return _ref.forward(x, w8, scale, block, bias, c, u, B, s, xm, p, need_z, z_dtype, act_quant)
    cdt = x.dtype
    M, N = x.shape[0], w8.shape[0]
    two = c is not None and xm is not None  # with dropout: xd W0^T = (xm W0^T) / (1 - p), the factor in fp32
    # The base products in the compute dtype, one block of weight rows (one transient) at a time.
    blocks = _weight_blocks(w8, scale, block, cdt)
    first = next(blocks)
    if first[1] == N:  # the whole weight is one block (small layers): no copies
        w = first[2]
        base = x @ w.T
        base_d = xm @ w.T if two else None
    else:
        base = torch.empty(M, N, dtype=cdt, device=x.device)
        base_d = torch.empty(M, N, dtype=cdt, device=x.device) if two else None
        for j0, j1, w in itertools.chain([first], blocks):
            base[:, j0:j1] = x @ w.T
            if two:
                base_d[:, j0:j1] = xm @ w.T
    del w, first
    sc = _out_scale(scale)
    scd = None  # the factor of the dropout term's product: the scale and 1 / (1 - p)
    if two:
        scd = (sc if sc is not None else torch.ones((), dtype=torch.float32, device=x.device)) * (1.0 / (1.0 - p))
    y = torch.empty(M, N, dtype=cdt, device=x.device)
    z = torch.empty(M, N, dtype=z_dtype, device=x.device) if (c is not None and need_z) else None
    b32 = None if bias is None else bias.float()
    Bs = None if B is None else (B.float() * s).T  # s B^T [r, N]: lora = u (s B^T)
    # The fp32 epilogue over blocks of activation rows, each result written once into its dtype (out=: computed in
    # fp32, rounded once).
    for i0, i1 in _ref._blocks(M, N):
        bx = base[i0:i1]
        if c is None:
            if sc is None and b32 is None:
                y[i0:i1] = bx
            elif b32 is None:
                torch.mul(bx, sc, out=y[i0:i1])
            elif sc is None:
                torch.add(bx, b32, out=y[i0:i1])
            else:
                torch.addcmul(b32, bx, sc, out=y[i0:i1])
            continue
        zb = u[i0:i1].float() @ Bs  # s u B^T, fp32
        _add_scaled(zb, base_d[i0:i1] if two else bx, scd if two else sc)  # z = xd W0^T + s u B^T
        if z is not None:
            z[i0:i1] = zb
        if not two:  # y = c z + b
            if b32 is None:
                torch.mul(zb, c, out=y[i0:i1])
            else:
                torch.addcmul(b32, zb, c, out=y[i0:i1])
        else:  # y = x W0^T + b + (c - 1) xd W0^T + c s u B^T  ==  (x - xd) W0^T + c z + b
            t = bx.float() if bx.dtype != torch.float32 else bx.clone()
            if sc is not None:
                t.mul_(sc)
            t.addcmul_(base_d[i0:i1], scd, value=-1.0)
            t.addcmul_(zb, c)
            if b32 is not None:
                t.add_(b32)
            y[i0:i1] = t
    return y, z


def _add_scaled(acc, t, sc):
    """acc += t * sc in fp32 (t in any dtype; sc a 0-dim or [N] fp32 tensor, or None for 1)."""
    if sc is None:
        acc.add_(t)
    else:
        acc.addcmul_(t, sc)


def backward_pass(g, z, c, srow, B, u, dropout, need_dm, need_dB):
    """The reference's backward_pass (same outputs, fp32 throughout), with fewer passes over g: (g c) B as g (c B),
    the scaled copies of g written straight into their dtype."""
    M, N = g.shape
    adapter = c is not None
    f32 = dict(dtype=torch.float32, device=g.device)
    sr = None if srow is None else srow.float()
    if adapter:
        f = (c - 1) if dropout else c
        f = f if sr is None else f * sr
    else:
        f = sr
    if f is None:
        gl, rl = g, torch.ones((), **f32)
    else:
        rl = f.abs().amax().clamp_min(torch.finfo(torch.float32).tiny)
        gl = torch.empty_like(g)
        fr = f / rl
    gb = rb = None
    if adapter and dropout:
        if sr is None:
            gb, rb = g, torch.ones((), **f32)
        else:
            rb = sr.abs().amax().clamp_min(torch.finfo(torch.float32).tiny)
            gb = torch.empty_like(g)
            sb = sr / rb
    Bc = (B.float() * c[:, None]) if adapter else None  # (g c) B == g (c B)
    blocks = list(_ref._blocks(M, N))
    if len(blocks) == 1:  # small problems: each result in one op, no accumulators
        g32 = g.float()
        db = g32.sum(0)
        if gl is not g:
            torch.mul(g32, fr, out=gl)
        if gb is not None and gb is not g:
            torch.mul(g32, sb, out=gb)
        if not adapter:
            return gl, rl, gb, rb, None, None, db, None
        v = (g32 @ Bc).to(B.dtype)
        dm = (g32 * z).sum(0) if need_dm else None
        dB = g32.T @ u.float() if need_dB else None
        return gl, rl, gb, rb, v, dm, db, dB
    v = torch.empty(M, B.shape[1], dtype=B.dtype, device=g.device) if adapter else None
    dm = torch.zeros(N, **f32) if (adapter and need_dm) else None
    dB = torch.zeros(N, B.shape[1], **f32) if (adapter and need_dB) else None
    db = torch.zeros(N, **f32)
    for i0, i1 in blocks:
        g32 = g[i0:i1].float()
        db += g32.sum(0)
        if gl is not g:
            torch.mul(g32, fr, out=gl[i0:i1])
        if gb is not None and gb is not g:
            torch.mul(g32, sb, out=gb[i0:i1])
        if not adapter:
            continue
        v[i0:i1] = g32 @ Bc
        if dm is not None:
            dm += (g32 * z[i0:i1]).sum(0)
        if dB is not None:
            dB.addmm_(g32.T, u[i0:i1].float())
    return gl, rl, gb, rb, v, dm, db, dB


def dgrad(gl, rl, w8, scale, block, v, A, s, mask, p, gb, rb, act_quant):
    if act_quant or gl.dtype == torch.float16:  # see _reference_cases
        return _ref.dgrad(gl, rl, w8, scale, block, v, A, s, mask, p, gb, rb, act_quant)
    cdt = gl.dtype
    M, K = gl.shape[0], w8.shape[1]
    st = scale.float() if scale_kind(scale) == "tensor" else 1.0
    two = v is not None and mask is not None
    # t = gl W' (and gb W'), a sum over blocks of weight rows: each block's product in the compute dtype, the sum
    # in fp32 (one block, the usual case for small layers: one rounding, as the forward's product).
    t = tb = None
    for j0, j1, w in _weight_blocks(w8, scale, block, cdt):
        pt = gl[:, j0:j1] @ w
        t = pt if t is None else (t.float() if t.dtype != torch.float32 else t).add_(pt)
        if two:
            pb = gb[:, j0:j1] @ w
            tb = pb if tb is None else (tb.float() if tb.dtype != torch.float32 else tb).add_(pb)
        del w
    dx = torch.empty(M, K, dtype=cdt, device=gl.device)
    k = rl * st  # the base term's fp32 factor
    if v is None:
        for i0, i1 in _ref._blocks(M, K):
            torch.mul(t[i0:i1], k, out=dx[i0:i1])
        return dx
    inv = 1.0 / (1.0 - p) if mask is not None else 1.0
    As = A.float() * (s * inv)  # s A (/ (1 - p) with dropout)
    if mask is not None:
        k = k * inv
        kb = rb * st
    for i0, i1 in _ref._blocks(M, max(K, w8.shape[0])):
        out = v[i0:i1].float() @ As
        out.addcmul_(t[i0:i1], k)
        if mask is None:
            dx[i0:i1] = out
        else:  # dx = tb rb st + mask / (1 - p) (t rl st + s v A)
            out.mul_(mask[i0:i1])
            out.addcmul_(tb[i0:i1], kb)
            dx[i0:i1] = out
    return dx
