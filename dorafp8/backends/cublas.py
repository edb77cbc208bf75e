"""cuBLAS strategy: the backend contract (dorafp8/backends/base.py) with the base GEMMs done by the platform's matmul.

What a user who dequantizes would do, done as well as that can be done: each call dequantizes the layer's W8 into a
transient buffer in the compute dtype (one layer at a time, freed when the call returns, never kept), runs the base
GEMMs through torch.matmul (cuBLAS on a GPU), and applies the DoRA epilogues with the fused Triton kernels
(triton_kernels/forward.py `fwd_epilogue_kernel`, dgrad.py `dgrad_epilogue_kernel`). The backward pass, the
rank-r GEMMs and the weight norm are the Triton backend's. It is the yardstick the fused kernels must beat:
`backend="auto"` checks and times it against them at each new layer key on a GPU and runs it where it is faster
(dorafp8/ops/_race.py).

The base products come back from the matmul in the compute dtype, so z (hence dm) carries that rounding, as PEFT's
16-bit base layer does; the fused kernels keep the base product in fp32 up to their epilogue.
The transient holds W8 times its scale, rounded once to the compute dtype (per row: times the largest row scale, the
rows' ratios applied in fp32 by the epilogue), as a user would dequantize it: W8 alone reaches 448, and products with
it could overflow fp16 where the result does not.
W8A8 is not offered here: the fused Triton kernels and bench's `linear-fp8-rowwise` (torch._scaled_mm) cover it.
It runs wherever the Triton backend runs (on CPU under TRITON_INTERPRET=1, with CPU matmuls, for the tests).
"""

from __future__ import annotations

import torch

from .. import triton_kernels as tk
from .base import matmul_rows, not_supported
from ..quant import row_blocks, scale_kind, scale_rows
from ..triton_kernels.dgrad import dgrad_epilogue
from ..triton_kernels.forward import forward_epilogue


SUPPORTS = frozenset({"block", "fp32"})  # no W8A8 (act_quant="rowwise") (see the module docstring)


def unavailable_reason(device: torch.device) -> str | None:
    why = tk.unavailable_reason(device)
    return None if why is None else f"the cuBLAS strategy's epilogues are Triton kernels: {why}"


weight_norm = tk.weight_norm
project = tk.project
project_grad = tk.project_grad
backward_pass = tk.backward_pass


def _transient_weight(w8: torch.Tensor, scale: torch.Tensor, block_size: int, dtype: torch.dtype):
    """(W, kappa): one layer's transient W = W8 * (its scale) in the compute dtype, as a user who dequantizes makes
    it (so a 16-bit product stays in range: W8 alone reaches 448), and the per-tensor factor kappa it folded in
    (per tensor: the scale; per row: the largest row scale, the rows' ratios are left to the epilogue; per block:
    the scales themselves, elementwise)."""
    N, K = w8.shape
    kind = scale_kind(scale)
    kappa = scale if kind == "tensor" else scale.abs().amax() if kind == "row" else None
    out = torch.empty(N, K, dtype=dtype, device=w8.device)
    for j0, j1 in row_blocks(N, K, block_size):  # fp32 temporaries of at most ~16 MiB
        f = scale_rows(scale, block_size, j0, j1, K) if kind == "block" else kappa
        out[j0:j1] = w8[j0:j1].float() * f
    return out, kappa


def _not_w8a8(act_quant):
    if act_quant:
        raise not_supported("cublas", "rowwise", alternatives=("triton", "reference"))  # _scaled_mm, no fused epilogue


def forward(x, w8, scale, block_size, bias, m, n, u, B, s, xm, p, need_z, z_dtype, act_quant):
    _not_w8a8(act_quant)
    w, kappa = _transient_weight(w8, scale, block_size, x.dtype)
    x, xm = matmul_rows(x), matmul_rows(xm)
    base = x @ w.T
    base_d = xm @ w.T if (m is not None and xm is not None) else None
    del w
    # What is left of the scale for the epilogue: per tensor nothing (1), per row the ratios to kappa; a block scale
    # tells the epilogue that the scales were applied already.
    kind = scale_kind(scale)
    rest = torch.ones((), device=x.device) if kind == "tensor" else scale / kappa if kind == "row" else scale
    return forward_epilogue(base, base_d, p, w8, rest, block_size, bias, m, n, u, B, s, need_z, z_dtype, x.dtype)


def dgrad(gl, rl, w8, scale, block_size, v, A, s, mask, p, gb, rb, act_quant):
    _not_w8a8(act_quant)
    w, kappa = _transient_weight(w8, scale, block_size, gl.dtype)
    gl, gb = matmul_rows(gl), matmul_rows(gb)
    t = gl @ w
    tb = gb @ w if (v is not None and mask is not None) else None
    del w
    # The contract's st (per-tensor scale, applied in the epilogue) is now in w: per tensor the epilogue multiplies by
    # 1; per row (scales in gl already) it divides the kappa out again; block scales are in w.
    kind = scale_kind(scale)
    st = torch.ones((), device=gl.device) if kind == "tensor" else 1.0 / kappa if kind == "row" else scale
    return dgrad_epilogue(t, tb, rl, w8, st, block_size, v, A, s, mask, p, rb, gl.dtype)
