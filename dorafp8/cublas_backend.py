"""cuBLAS strategy: the backend contract (dorafp8/backends.py) with the base GEMMs done by the platform's matmul.

What a user who dequantizes would do, done as well as that can be done: each call dequantizes the layer's W8 into a
transient buffer in the compute dtype (one layer at a time, freed when the call returns, never kept), runs the base
GEMMs through torch.matmul (cuBLAS on a GPU), and applies the DoRA epilogues with the fused Triton kernels
(triton_kernels/forward.py `_fwd_epilogue_kernel`, dgrad.py `_dgrad_epilogue_kernel`). The backward pass, the
rank-r GEMMs and the weight norm are the Triton backend's. It is the yardstick the fused kernels must beat, and
`backend="auto"` never picks it until a GPU measurement says it wins (see bench/).

Per-tensor and per-row scales stay out of the transient (w8 -> compute dtype is exact; the scales are applied in
fp32 in the epilogues); block scales are applied while dequantizing, so W0 is rounded once to the compute dtype.
W8A8 is not offered here: the fused Triton kernels and bench's `linear-fp8-rowwise` (torch._scaled_mm) cover it.
It runs wherever the Triton backend runs (on CPU under TRITON_INTERPRET=1, with CPU matmuls, for the tests).
"""

from __future__ import annotations

import torch

from . import triton_kernels as _tk
from .quant import scale_kind, scale_rows
from .triton_kernels.dgrad import dgrad_epilogue
from .triton_kernels.forward import forward_epilogue


def unavailable_reason(device: torch.device) -> str | None:
    why = _tk.unavailable_reason(device)
    return None if why is None else f"the cuBLAS strategy's epilogues are Triton kernels: {why}"


weight_norm = _tk.weight_norm
project = _tk.project
project_grad = _tk.project_grad
backward_pass = _tk.backward_pass


def _transient_weight(w8: torch.Tensor, scale: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """W8 in the compute dtype, with block scales applied (others are the epilogue's): one layer's transient."""
    if scale_kind(scale) != "block":
        return w8.to(dtype)
    N, K = w8.shape
    out = torch.empty(N, K, dtype=dtype, device=w8.device)
    rows = max(block, (4 * 1024 * 1024 // K) // block * block)  # fp32 temporaries of at most ~16 MiB
    for j0 in range(0, N, rows):
        j1 = min(N, j0 + rows)
        out[j0:j1] = w8[j0:j1].float() * scale_rows(scale, block, j0, j1, K)
    return out


def _not_w8a8(act_quant):
    if act_quant:
        raise ValueError("act_quant='rowwise' is not supported by the cublas backend (it would be "
                         "torch._scaled_mm without the fused epilogue); use backend='triton' or 'reference'")


def forward(x, w8, scale, block, bias, c, u, B, s, xd, need_z, z_dtype, act_quant):
    _not_w8a8(act_quant)
    w = _transient_weight(w8, scale, block, x.dtype)
    base = x @ w.T
    base_d = xd @ w.T if (c is not None and xd is not None) else None
    del w
    return forward_epilogue(base, base_d, w8, scale, block, bias, c, u, B, s, need_z, z_dtype, x.dtype)


def dgrad(gl, rl, w8, scale, block, v, A, s, mask, p, gb, rb, act_quant):
    _not_w8a8(act_quant)
    w = _transient_weight(w8, scale, block, gl.dtype)
    t = gl @ w
    tb = gb @ w if (v is not None and mask is not None) else None
    del w
    return dgrad_epilogue(t, tb, rl, w8, scale, block, v, A, s, mask, p, rb, gl.dtype)
