"""cuBLAS strategy: the backend contract (dorafp8/backends/base.py) with the base GEMMs done by the platform's matmul.

What a user who dequantizes would do, done well: W8 dequantized per call in one launch (triton_kernels/dequant.py),
the base GEMMs through torch.matmul (cuBLAS on a GPU), the DoRA epilogues, backward pass, rank-r GEMMs and weight norm
from the Triton kernels. The yardstick the fused kernels must beat; no W8A8. Details: docs/ARCHITECTURE.md, "Design
notes, by module".
"""

from __future__ import annotations

import torch

from .. import triton_kernels as tk
from .base import matmul_rows, not_supported
from ..quant import scale_kind
from ..triton_kernels.dequant import dequant_w8
from ..triton_kernels.dgrad import dgrad_epilogue
from ..triton_kernels.forward import forward_epilogue


SUPPORTS = frozenset({"block", "fp32"})  # no W8A8 (act_quant="rowwise") (see the module docstring)
# The folded dgrad (base.py, FOLD_PARAMS), on by default here: gl's factors ride on the dequantize, which reads and
# writes the same bytes with or without them, and the backward pass no longer writes g * fl ([M, N], then read again
# by the matmul): 64 MiB fewer at the headline. (The fused GEMMs pay for it in their main loop: opt-in there.)
FOLDS_DGRAD = True
FOLDS_BY_DEFAULT = True


def unavailable_reason(device: torch.device) -> str | None:
    why = tk.unavailable_reason(device)
    return None if why is None else f"the cuBLAS strategy's epilogues are Triton kernels: {why}"


weight_norm = tk.weight_norm
project = tk.project
project_grad = tk.project_grad
backward_pass = tk.backward_pass


def _transient_weight(w8: torch.Tensor, scale: torch.Tensor, block_size: int, dtype: torch.dtype, rowf=None):
    """(W, fac): one layer's transient W = W8 * (its scale) in the compute dtype, as a user who dequantizes makes it
    (so a 16-bit product stays in range: W8 alone reaches 448), in one launch that reads 1 byte and writes 2 per
    weight (triton_kernels/dequant.py: per tensor the scale, per row the largest row scale kappa, whose ratios the
    epilogue applies, per block the scales themselves), and the factors the epilogues need, written by the same
    launch: fac[:-1] the forward's, fac[-1] the dgrad's. rowf: the folded dgrad's factors, on W's rows."""
    return dequant_w8(w8, scale, block_size, dtype, rowf)


def _forward_rest(fac: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The scale left for the forward epilogue (views, no launch): per tensor 1 (fac[0]), per row scale / kappa
    (fac[:N]); a block scale tells the epilogue that the scales were applied already."""
    kind = scale_kind(scale)
    return fac[0] if kind == "tensor" else fac[:-1] if kind == "row" else scale


def _not_w8a8(act_quant):
    if act_quant:
        raise not_supported("cublas", "rowwise", alternatives=("triton", "reference"))  # _scaled_mm, no fused epilogue


def forward(x, w8, scale, block_size, bias, m, n, u, B, s, xm, p, need_z, z_dtype, act_quant):
    _not_w8a8(act_quant)
    w, fac = _transient_weight(w8, scale, block_size, x.dtype)
    x, xm = matmul_rows(x), matmul_rows(xm)
    base = x @ w.T
    base_d = xm @ w.T if (m is not None and xm is not None) else None
    del w
    rest = _forward_rest(fac, scale)
    return forward_epilogue(base, base_d, p, w8, rest, block_size, bias, m, n, u, B, s, need_z, z_dtype, x.dtype)


def dgrad(gl, rl, w8, scale, block_size, v, A, s, mask, p, gb, rb, act_quant, fl=None, fb=None):
    """The contract's dgrad; with fl (and fb with dropout), the folded one (base.py, FOLD_PARAMS): gl, gb are g
    itself and the factors go onto the transient weight's rows as it is dequantized, (g * fl) W = g (fl * W), in
    fp32 before its one rounding, so the backward pass writes no [M, N] copy of g."""
    _not_w8a8(act_quant)
    dropout = v is not None and mask is not None
    w, fac = _transient_weight(w8, scale, block_size, gl.dtype, fl)
    gl, gb = matmul_rows(gl), matmul_rows(gb)
    t = gl @ w
    if dropout and fl is not None:  # the plain base term's weight carries fb, not fl
        del w
        w, _ = _transient_weight(w8, scale, block_size, gl.dtype, fb)
    tb = gb @ w if dropout else None
    del w
    # The contract's st (per-tensor scale, applied in the epilogue) is now in w: per tensor the epilogue multiplies by
    # 1 (fac[-1]); per row (scales in gl already) it divides the kappa out again (fac[-1] = 1 / kappa); block scales
    # are in w.
    st = scale if scale_kind(scale) == "block" else fac[-1]
    return dgrad_epilogue(t, tb, rl, w8, st, block_size, v, A, s, mask, p, rb, gl.dtype)
