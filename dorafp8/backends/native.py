"""Native backend: the reference backend with weight row blocks dequantized into the compute dtype and multiplied
there by the platform's matmul (oneDNN/MKL on CPU), as PEFT under autocast does. Details: docs/ARCHITECTURE.md."""

from __future__ import annotations

import torch

from . import reference
from .._fp8_cast import e4m3_scaled
from ..quant import (E2M1_MAX, E4M3_MAX, MICRO_KINDS, e8m0_values, micro_rows, row_blocks, row_step, scale_kind,
                     scale_rows, weight_dims)
from .base import FP8_FEATURES, magnitude_scale, matmul_rows
from .base import empty as _out  # NaN-filled under the tests: an element never written fails them

# The microscaled weights too: without them backend="auto" ran the fp32 reference for an MXFP8 / NVFP4 weight on the
# CPU and on the GPUs no kernel backend runs on (sm_70 to sm_86), several times slower than the compute dtype's matmul.
SUPPORTS = FP8_FEATURES | {"mxfp8", "nvfp4"}

F16_MAX = torch.finfo(torch.float16).max
# Devices where fp16 calls run the reference's fp32 GEMMs instead: a CPU without fp16 units (most x86 ones) multiplies
# fp16 several times slower than fp32 (3.7x on an AVX-512 machine under torch 2.14), while bf16 runs on its bf16 units.
FP16_REFERENCE_DEVICES = frozenset({"cpu"})
project_grad = reference.project_grad  # the reference's fp32 product, scaled and rounded once


def weight_norm(w8, scale, block_size, A, B, s, global_scale=None):
    """The reference's weight_norm (fp32, blocks of rows), with _fp8_cast's exact fp8 -> fp32 conversion."""
    if scale_kind(scale) in MICRO_KINDS:
        return reference.weight_norm(w8, scale, block_size, A, B, s, global_scale)
    N, K = w8.shape
    A32 = A.float()
    n = _out(N, torch.float32, w8.device)
    for j0, j1 in row_blocks(N, K, row_step(scale, block_size)):
        v = e4m3_scaled(w8[j0:j1], scale_rows(scale, block_size, j0, j1, K), torch.float32)
        v.addmm_(B[j0:j1].float(), A32, alpha=s)
        n[j0:j1] = torch.linalg.vector_norm(v, dim=1)
        del v
    return n


def project(a, b, out_dtype, mask, p):
    """a' b^T in out_dtype: where a, b and out_dtype are one dtype, the platform's matmul in it (fp32 accumulation, one
    rounding) on a' = a * mask / (1 - p) rounded once into that dtype (as a GPU's fused dropout forms it); else the
    reference's. Not a * (mask / (1 - p)) with the factor in the 16-bit dtype: 1 / 0.9 is 1.109 in bf16, so every
    kept element, hence u, came out 0.15% small, the same way in every term (a bias no sum averages out)."""
    if a.dtype == b.dtype == out_dtype:
        if mask is not None:
            a = (a * (1.0 / (1.0 - p))).mul_(mask)
        return a @ b.T
    return reference.project(a, b, out_dtype, mask, p)


def unavailable_reason(device: torch.device) -> str | None:
    return None  # runs wherever PyTorch runs


def _f32(t):
    return t if t.dtype == torch.float32 else t.float()


def _as(t, dtype):
    return t if t.dtype == dtype else t.to(dtype)


def _row_parts(M, width):
    """One function per block of activation rows taking that block (the tensor itself if one covers all)."""
    blocks = list(row_blocks(M, width))
    if len(blocks) == 1:
        return [lambda t: t]
    return [lambda t, a=i0, b=i1: t[a:b] for i0, i1 in blocks]


def _weight_spans(w8, scale, block_size) -> list[tuple[int, int]]:
    """The blocks of weight rows [j0, j1) the base products take one at a time (reference.row_blocks; whole scale blocks)."""
    N, K = weight_dims(w8)
    return list(row_blocks(N, K, row_step(scale, block_size)))


def _weight_block(w8, f, block_size, dtype, j0, j1):
    """W8[j0:j1] * f (f per tensor, row or block, as scale_rows takes a scale; None: 1) rounded once into `dtype`."""
    N, K = w8.shape
    rows = w8 if (j0 == 0 and j1 == N) else w8[j0:j1]
    return e4m3_scaled(rows, None if f is None else scale_rows(f, block_size, j0, j1, K), dtype)


def _block_maker(w8, scale, f, block_size, dtype, global_scale):
    """(j0, j1) -> _weight_block's rows of w8 * f in `dtype`; for a microscaled weight W0[j0:j1] / f (f None: 1)."""
    if scale_kind(scale) not in MICRO_KINDS:
        return lambda j0, j1: _weight_block(w8, f, block_size, dtype, j0, j1)

    def block(j0, j1):
        return micro_rows(w8, scale, global_scale, j0, j1, div=f).to(dtype)
    return block


def _micro_cap(scale, global_scale):
    """_fp16_cap of a microscaled weight: d >= 1 with max|W0| / d <= fp16's largest value, from its scales."""
    top = (e8m0_values(scale) * E4M3_MAX if global_scale is None
           else scale.float().abs() * (_f32(global_scale).abs() * E2M1_MAX))
    return (top.amax() / F16_MAX).clamp_min(1.0)


def _fp16_cap(scale):
    """d >= 1 (fp32, 0-dim) with |W8| * max|scale| / d <= fp16's largest value (|W8| <= 448): 1 unless a scale passes
    65504 / 448 = 146 (a weight no fp16 model holds). A tensor op, not a read of the value: no sync on a GPU, nothing
    data-dependent under torch.compile or a CUDA graph capture."""
    return (_f32(scale).abs().amax() * (E4M3_MAX / F16_MAX)).clamp_min(1.0)


def _forward_fold(scale, dtype, global_scale=None):
    """(f, sc): the base product is (x @ (W8 * f)^T) * sc, the block in `dtype`, sc applied in fp32 (None: 1).
    bf16 / fp32: W8 exactly (block scales folded in), per-tensor / per-row scales in sc. fp16: W0 / d folded in (PEFT's
    dequantized weight, fp16's range: d = 1 but for absurd scales) and sc = d, so that the fp16 product has the
    magnitude of x W0^T itself; x W8^T (|W8| up to 448) could overflow where that does not."""
    if scale_kind(scale) in MICRO_KINDS:  # W0 itself (/ d in fp16): _block_maker
        d = _micro_cap(scale, global_scale) if dtype == torch.float16 else None
        return d, d
    block = scale_kind(scale) == "block"
    if dtype != torch.float16:
        return (scale if block else None), (None if block else _f32(scale))
    d = _fp16_cap(scale)
    return _f32(scale) / d, d


def _row_kappa(srow):
    """The fp16 dgrad's factor of a per-row scale: max|srow|, capped as _fp16_cap caps (0-dim fp32, >= tiny)."""
    return _f32(srow).abs().amax().clamp(min=torch.finfo(torch.float32).tiny, max=F16_MAX / E4M3_MAX)


def _dgrad_fold(scale, dtype, global_scale=None):
    """(f, st): the dgrad's product is (g @ (W8 * f)) * st, st in fp32, equal to the reference's g @ W8' times its st
    (per tensor: the scale; per row: 1, the row scales being in g already). fp16 folds the scale in as _forward_fold
    does; per row, kappa = max|scale| (capped as _fp16_cap caps; g's rows carry scale / max|scale| <= 1 of it)."""
    kind = scale_kind(scale)
    if kind in MICRO_KINDS:
        d = _micro_cap(scale, global_scale) if dtype == torch.float16 else None
        return d, (1.0 if d is None else d)
    if dtype != torch.float16:
        return (scale if kind == "block" else None), (_f32(scale) if kind == "tensor" else 1.0)
    if kind == "row":  # a 0-dim factor: one for every row
        kappa = _row_kappa(scale)
        return kappa, 1.0 / kappa
    d = _fp16_cap(scale)
    return _f32(scale) / d, d


def _reference_runs(t, act_quant) -> bool:
    """W8A8 (an emulation on CPU either way) and fp16 on FP16_REFERENCE_DEVICES run the reference's code."""
    return bool(act_quant) or (t.dtype == torch.float16 and t.device.type in FP16_REFERENCE_DEVICES)


def forward(x, w8, scale, block_size, bias, m, n, u, B, s, xm, p, need_z, z_dtype, act_quant, global_scale=None):
    if _reference_runs(x, act_quant):
        return reference.forward(x, w8, scale, block_size, bias, m, n, u, B, s, xm, p, need_z, z_dtype, act_quant,
                                 global_scale)
    x, xm = matmul_rows(x), matmul_rows(xm)
    cdt = x.dtype
    c = None if m is None else magnitude_scale(m, n)
    M, N = x.shape[0], w8.shape[0]
    two = c is not None and xm is not None  # with dropout: xd W0^T = (xm W0^T) / (1 - p), the factor in fp32
    # The base products in the compute dtype, one block of weight rows (one transient) at a time.
    spans = _weight_spans(w8, scale, block_size)
    f, sc = _forward_fold(scale, cdt, global_scale)
    block = _block_maker(w8, scale, f, block_size, cdt, global_scale)
    if len(spans) == 1:  # the whole weight is one block (small layers): no copies
        w = block(0, N)
        base = x @ w.T
        base_d = xm @ w.T if two else None
        del w
    else:
        base = _out((M, N), cdt, x.device)
        base_d = _out((M, N), cdt, x.device) if two else None
        for j0, j1 in spans:
            w = block(j0, j1)
            base[:, j0:j1] = x @ w.T
            if two:
                base_d[:, j0:j1] = xm @ w.T
            del w  # before the next block is made
    scd = None  # the factor of the dropout term's product: the scale and 1 / (1 - p)
    if two:
        scd = (sc if sc is not None else torch.ones((), dtype=torch.float32, device=x.device)) * (1.0 / (1.0 - p))
    parts = _row_parts(M, N)
    y = _out((M, N), cdt, x.device)
    z = None
    if c is not None and need_z and len(parts) > 1:
        z = _out((M, N), z_dtype, x.device)
    Bs = None if B is None else (_f32(B) * s).T  # s B^T [r, N]: lora = u (s B^T)
    # The fp32 epilogue over blocks of activation rows, each result written once into its dtype (out=: computed in
    # fp32, rounded once; the bias is added in fp32 as it is).
    for sl in parts:
        bx, yb = sl(base), sl(y)
        if c is None:
            if sc is None and bias is None:
                yb.copy_(bx)
            elif bias is None:  # sc as a 1-dim view: a 0-dim tensor on a GPU is cast to bx's dtype before the
                torch.mul(bx, sc.reshape(-1), out=yb)  # product (Loops.cuh), every output off by its rounding alike
            elif sc is None:
                torch.add(_f32(bx), bias, out=yb)
            else:
                torch.addcmul(_f32(bias), bx, sc, out=yb)
            continue
        zb = _f32(sl(u)) @ Bs  # s u B^T, fp32
        _add_scaled(zb, sl(base_d) if two else bx, scd if two else sc)  # z = xd W0^T + s u B^T
        if need_z:
            if z is None:  # one block: z is this block's result, in its dtype
                z = _as(zb, z_dtype)
            else:
                sl(z).copy_(zb)
        if not two:  # y = c z + b
            if bias is None:
                torch.mul(zb, c, out=yb)
            else:
                torch.addcmul(_f32(bias), zb, c, out=yb)
        else:  # y = x W0^T + b + (c - 1) xd W0^T + c s u B^T  ==  (x - xd) W0^T + c z + b
            t = bx.float() if bx.dtype != torch.float32 else bx.clone()
            if sc is not None:
                t.mul_(sc)
            t.addcmul_(sl(base_d), scd, value=-1.0)
            t.addcmul_(zb, c)
            if bias is not None:
                t.add_(bias)
            yb.copy_(t)
    return y, z


def _add_scaled(acc, t, sc):
    """acc += t * sc in fp32 (t in any dtype; sc a 0-dim or [N] fp32 tensor, or None for 1)."""
    if sc is None:
        acc.add_(t)
    else:
        acc.addcmul_(t, sc)


def backward_pass(g, z, m, n, srow, B, u, s, dropout, need_dm, need_dB, need_db=True):
    """The reference's backward_pass (same outputs, fp32 throughout), with fewer passes over g: (g c) B as g (c B),
    the scaled copies of g written straight into their dtype, no accumulators when one block covers g."""
    M, N = g.shape
    adapter = m is not None
    c = magnitude_scale(m, n) if adapter else None
    f32 = dict(dtype=torch.float32, device=g.device)
    fl, rl, fb, rb = reference.grad_factors(c, srow, dropout, g.device)
    if fl is not None and g.dtype == torch.float16 and not _reference_runs(g, ""):
        fl, rl = _fp16_gl_factors(fl, rl, srow)
    gl = g if fl is None else _out(g.shape, g.dtype, g.device)
    gb = None if rb is None else g if fb is None else _out(g.shape, g.dtype, g.device)
    Bc = (_f32(B) * c[:, None]) if adapter else None  # (g c) B == g (c B)
    parts = _row_parts(M, N)
    one = len(parts) == 1
    v = dm = dB = db = None
    if not one:
        v = _out((M, B.shape[1]), B.dtype, g.device) if adapter else None
        dm = torch.zeros(N, **f32) if (adapter and need_dm) else None
        dB = torch.zeros(N, B.shape[1], **f32) if (adapter and need_dB) else None
        db = torch.zeros(N, **f32) if need_db else None
    for sl in parts:
        g32 = _f32(sl(g))
        if need_db:
            db = g32.sum(0) if one else db.add_(g32.sum(0))
        if fl is not None:
            torch.mul(g32, fl, out=sl(gl))
        if fb is not None:
            torch.mul(g32, fb, out=sl(gb))
        if not adapter:
            continue
        if one:
            v = _as(g32 @ Bc, B.dtype)
            dm = (g32 * z).sum(0) if need_dm else None
            dB = g32.T @ _f32(u) if need_dB else None
        else:
            sl(v).copy_(g32 @ Bc)
            if dm is not None:
                dm += (g32 * sl(z)).sum(0)
            if dB is not None:
                dB.addmm_(g32.T, _f32(sl(u)))
    return gl, reference.scalars(rl, rb), gb, v, *reference.finish_sums(dm, db, dB, m, n, c, s, g.dtype, B)


def _fp16_gl_factors(fl, rl, srow):
    """(fl, rl) of gl = g * fl for native's fp16 dgrad: rl at least the factor its product gl @ W' leaves out (1, or
    the per-row kappa of _dgrad_fold), so that the product, dx / (rl * st) there, is no larger than dx: with the
    reference's rl = max|f| alone, an f below 1 everywhere (c = m / n small: rows of large norm) made gl @ W0 overflow
    fp16 where dx did not. An [N] multiply, no read of a value on the host."""
    floor = 1.0 if srow is None else _row_kappa(srow)
    r = torch.clamp_min(rl, floor)
    return fl * (rl / r), r


def dgrad(gl, rl, w8, scale, block_size, v, A, s, mask, p, gb, rb, act_quant, global_scale=None):
    if _reference_runs(gl, act_quant):
        return reference.dgrad(gl, rl, w8, scale, block_size, v, A, s, mask, p, gb, rb, act_quant, global_scale)
    gl, gb = matmul_rows(gl), matmul_rows(gb)
    cdt = gl.dtype
    M, (N, K) = gl.shape[0], weight_dims(w8)
    f, st = _dgrad_fold(scale, cdt, global_scale)
    block = _block_maker(w8, scale, f, block_size, cdt, global_scale)
    two = v is not None and mask is not None
    # t = gl W' (and gb W'), a sum over blocks of weight rows: each block's product in the compute dtype, the sum
    # in fp32 (one block, the usual case for small layers: one rounding, as the forward's product).
    t = tb = None
    for j0, j1 in _weight_spans(w8, scale, block_size):
        w = block(j0, j1)
        whole = j0 == 0 and j1 == N
        pt = (gl if whole else gl[:, j0:j1]) @ w
        t = pt if t is None else _f32(t).add_(pt)
        if two:
            pb = (gb if whole else gb[:, j0:j1]) @ w
            tb = pb if tb is None else _f32(tb).add_(pb)
        del w
    dx = _out((M, K), cdt, gl.device)
    k = rl * st  # the base term's fp32 factor
    if v is None:
        for sl in _row_parts(M, K):
            torch.mul(sl(t), k.reshape(-1), out=sl(dx))  # k in fp32 on a GPU too: see forward's torch.mul
        return dx
    inv = 1.0 / (1.0 - p) if mask is not None else 1.0
    As = _f32(A) * (s * inv)  # s A (/ (1 - p) with dropout)
    if mask is not None:
        k = k * inv
        kb = rb * st
    for sl in _row_parts(M, max(K, N)):
        out = _f32(sl(v)) @ As
        out.addcmul_(sl(t), k)
        if mask is not None:  # dx = tb rb st + mask / (1 - p) (t rl st + s v A)
            out.mul_(sl(mask))
            out.addcmul_(sl(tb), kb)
        sl(dx).copy_(out)
    return dx
