"""cuBLAS strategy: the backend contract (backends/base.py) with the base GEMMs done by the platform's matmul.

What a user who dequantizes would do, done well (W8 dequantized in one launch, then torch.matmul; the rest Triton):
the yardstick the fused kernels must beat; no W8A8. Details: docs/ARCHITECTURE.md."""

from __future__ import annotations

import torch

import dorafp8.triton_kernels as tk
from .base import matmul_rows, not_supported
from ..quant import E4M3, MICRO_KINDS, scale_kind
from ..triton_kernels.dequant import dequant_w8
from ..triton_kernels.dequant_micro import dequant_micro, weight_norm_micro
from ..triton_kernels.dgrad import dgrad_epilogue
from ..triton_kernels.forward import forward_epilogue


# No W8A8 (act_quant="rowwise"), and no fp16 with per-row scales: the one dequantized copy takes every row at the
# largest scale (triton_kernels/dequant.py, kappa), so a row of a scale far below it multiplies out too large and
# overflows fp16 (tests/ops/test_backend_contract.py, test_backend_fp16_row_scales_far_apart); bf16's range holds it.
SUPPORTS = frozenset({"block", "fp32", "mxfp8", "nvfp4"})
KEEPS_WEIGHT = True  # the forward's dequantized weight kept for the dgrad (base.py, KEEP_WEIGHT_PARAMS)


def unavailable_reason(device: torch.device) -> str | None:
    why = tk.unavailable_reason(device)
    return None if why is None else f"the cuBLAS strategy's epilogues are Triton kernels: {why}"


project = tk.project
project_grad = tk.project_grad
backward_pass = tk.backward_pass


def weight_norm(w8, scale, block_size, A, B, s, global_scale=None):
    """The Triton weight norm; a microscaled weight's is dequant_micro.weight_norm_micro's (no dense copy)."""
    if scale_kind(scale) not in MICRO_KINDS:
        return tk.weight_norm(w8, scale, block_size, A, B, s)
    return weight_norm_micro(w8, scale, A, B, s, global_scale)


def dequantize(w8: torch.Tensor, scale: torch.Tensor, block_size: int, dtype: torch.dtype, global_scale=None):
    """(W, fac): W = W8 * scale in the compute dtype, as a user who dequantizes makes it, and the epilogues' factors
    (fac[:-1] the forward's, fac[-1] the dgrad's; [1, 1] for a microscaled weight), in one launch."""
    if scale_kind(scale) in MICRO_KINDS:
        return (dequant_micro(w8, scale, dtype, global_scale),
                torch.ones(2, dtype=torch.float32, device=w8.device))
    return dequant_w8(w8, scale, block_size, dtype)


def _weight(w8, scale, block_size, dtype, global_scale, weight, weight_fac):
    """(W, fac): the kept ones if given in `dtype` (the forward's, same w8 and scale), else a transient dequantize."""
    if weight is not None and weight.dtype == dtype:
        return weight, weight_fac
    return dequantize(w8, scale, block_size, dtype, global_scale)


def _epilogue_w8(w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w8 as the epilogues take it: for a microscaled weight, an empty e4m3 stand-in [N, 0]."""
    if scale_kind(scale) in MICRO_KINDS:
        return torch.empty(w8.shape[0], 0, dtype=E4M3, device=w8.device)
    return w8


def _forward_rest(fac: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The scale left for the forward epilogue (views): 1 (fac[0]), per row scale / kappa (fac[:N]), or block."""
    kind = scale_kind(scale)
    return fac[0] if kind in ("tensor", *MICRO_KINDS) else fac[:-1] if kind == "row" else scale


def _not_w8a8(act_quant):
    if act_quant:
        raise not_supported("cublas", "rowwise", alternatives=("triton", "reference"))  # _scaled_mm, no fused epilogue


def forward(x, w8, scale, block_size, bias, m, n, u, B, s, xm, p, need_z, z_dtype, act_quant, global_scale=None,
            weight=None, weight_fac=None):
    _not_w8a8(act_quant)
    w, fac = _weight(w8, scale, block_size, x.dtype, global_scale, weight, weight_fac)
    x, xm = matmul_rows(x), matmul_rows(xm)
    base = x @ w.T
    base_d = xm @ w.T if (m is not None and xm is not None) else None
    del w
    rest = _forward_rest(fac, scale)
    w8 = _epilogue_w8(w8, scale)
    return forward_epilogue(base, base_d, p, w8, rest, block_size, bias, m, n, u, B, s, need_z, z_dtype, x.dtype)


def dgrad(gl, rl, w8, scale, block_size, v, A, s, mask, p, gb, rb, act_quant, global_scale=None, weight=None,
          weight_fac=None):
    _not_w8a8(act_quant)
    dropout = v is not None and mask is not None
    w, fac = _weight(w8, scale, block_size, gl.dtype, global_scale, weight, weight_fac)
    gl, gb = matmul_rows(gl), matmul_rows(gb)
    if gl.dtype == torch.float16:
        # gl = g f / rl with rl = max|f| (|gl| <= |g|): below 1 (c = m / n small in every row), gl @ W0 is dx / rl and
        # overflows fp16 where dx does not. gl * min(rl, 1) keeps the product no larger than dx (g f itself where
        # rl < 1, the operand PEFT multiplies); gb's rb is 1 here (no fp16 per-row scales). a is the power of two at
        # most min(rl, 1) (fp16 holds it from 2^-24 on), so gl * a is exact: any other a (fp32) is rounded to fp16
        # before the product, or the product rounded again, off from rl / a the same way in every element (a bias).
        a = rl.clamp(min=2.0 ** -24, max=1.0)
        a = a / (2 * torch.frexp(a).mantissa)  # a = m 2^e, m in [0.5, 1): 2^(e - 1) exactly (IEEE division)
        gl, rl = gl * a, rl / a
    t = gl @ w
    tb = gb @ w if dropout else None
    del w
    # The scales are in w now: the epilogue's st is fac[-1] (1 per tensor, 1 / kappa per row); a block scale tells it
    # they were applied.
    st = scale if scale_kind(scale) == "block" else fac[-1]
    w8 = _epilogue_w8(w8, scale)
    return dgrad_epilogue(t, tb, rl, w8, st, block_size, v, A, s, mask, p, rb, gl.dtype)
