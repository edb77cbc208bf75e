"""DoRA on an FP8 base as autograd Functions over the backend kernels: dora_fp8_linear (checks, dtype policy, weight
norm) -> DoRAFP8Function (autograd, dropout mask) -> torch.ops.dorafp8.* -> the backend -> the kernel. Formulas and
dtype policy: docs/DORA_MATH.md; the backend contract: backends/base.py."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .. import backends
from ..backends import race
from ..quant import DEFAULT_BLOCK, check_act_quant, check_block_size, check_weight, scale_kind, weight_dims
from . import _custom_ops as _ops
from ._policy import (as_result, as_rows, autocast_off, backend_needs, check_device, check_float,
                      check_scaling_dropout, compute_dtype, dropout_mask, keeps_weight, rank_dtype, reused_norm,
                      row_scale, rows)


class DoRAFP8Function(torch.autograd.Function):
    """y = DoRA(x) on a frozen fp8 base; x2d and bias in the compute dtype, A and B in the rank dtype, m the magnitude
    (any float dtype), n a detached unclamped fp32 norm. No host reads and no PyTorch kernels between the backend calls
    (but dropout's mask and xm): CUDA-graph friendly (docs/ARCHITECTURE.md, "The kernel plan")."""

    @staticmethod
    def forward(ctx, x, w8, scale, bias, A, B, m, n, s, p, block_size, act_quant, backend, global_scale=None):
        M, N = x.shape[0], w8.shape[0]
        dropout = p > 0.0
        need_z = ctx.needs_input_grad[6]
        with autocast_off(x.device.type):
            # The kept part of x, unscaled: exact in the compute dtype; the kernels apply 1 / (1 - p) in fp32.
            mask = dropout_mask(x, p) if dropout else None
            xm = x * mask if dropout else None
            kept = {}  # the forward's dequantized weight, kept for the dgrad (_policy.keeps_weight says when)
            if M == 0:
                y, z = x.new_empty(0, N), x.new_empty(0, N)
                u = x.new_empty(0, A.shape[0], dtype=A.dtype)
            else:
                # The low-rank path forms x * mask / (1 - p) in the rank dtype, as PEFT does; under W8A8 the same
                # read of x may quantize it for the base GEMM (backends/base.py, QUANT_PARAMS).
                x8 = sx = None
                # backends.module only where its flag matters: a compiled forward then traces no call of it
                if (ctx.needs_input_grad[0] and getattr(backends.module(backend), "KEEPS_WEIGHT", False)
                        and keeps_weight(M, N, x.shape[1])):
                    W, fac = _ops.dequant_op(w8, scale, block_size, x.dtype, backend, global_scale)
                    kept = dict(weight=W, weight_fac=fac)
                if act_quant and getattr(backends.module(backend), "QUANTS_IN_PROJECT", False):
                    u, x8, sx = _ops.project_quant_op(x, A, out_dtype=A.dtype, mask=mask, p=p, backend=backend)
                else:
                    u = _ops.project_op(x, A, out_dtype=A.dtype, mask=mask, p=p, backend=backend)
                # z (for dm) in the compute dtype: docs/DORA_MATH.md, "Dtype policy", says why.
                y, z = _ops.forward_op(x, w8, scale, bias, block_size=block_size, act_quant=act_quant,
                                       backend=backend, m=m, n=n, u=u, B=B, s=s, xm=xm, p=p, need_z=need_z,
                                       x8=x8, sx=sx, global_scale=global_scale, **kept)
        ctx.save_for_backward(x, mask, u, z if need_z else None, w8, scale, A, B, m, n, global_scale,
                              kept.get("weight"), kept.get("weight_fac"))
        ctx.s, ctx.p, ctx.block_size, ctx.act_quant, ctx.backend = s, p, block_size, act_quant, backend
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, gy):
        x, mask, u, z, w8, scale, A, B, m, n, global_scale, W, fac = ctx.saved_tensors
        need_dx, _, _, need_db, need_dA, need_dB, need_dm = ctx.needs_input_grad[:7]
        s, p = ctx.s, ctx.p
        g = rows(gy)
        (M, (N, K)) = g.shape[0], weight_dims(w8)
        dx = dA = dB = dm = db = None
        if M == 0:  # an empty batch: zero gradients of the right shapes
            zeros = lambda t: torch.zeros_like(t)  # noqa: E731
            return (g.new_empty(0, K) if need_dx else None, None, None, g.new_zeros(N) if need_db else None,
                    zeros(A) if need_dA else None, zeros(B) if need_dB else None,
                    zeros(m) if need_dm else None, None, None, None, None, None, None, None)
        srow = row_scale(scale)
        with autocast_off(g.device.type):
            # dm, dB, db come back final (scaled, in their parameters' dtypes); rs = (rl, rb) stays on the device.
            gl, rs, gb, v, dm, db, dB = _ops.backward_pass_op(
                g, srow, backend=ctx.backend, z=z if need_dm else None, m=m, n=n, B=B, u=u if need_dB else None,
                s=s, dropout=mask is not None, need_dm=bool(need_dm), need_dB=bool(need_dB), need_db=bool(need_db))
            if need_dx:
                rl, rb = rs[0], rs[1]  # 0-dim views: no copy
                if mask is None:
                    gb = rb = None
                elif srow is None:
                    gb = g  # the plain base term's operand is g itself (the op returned a placeholder)
                dx = _ops.dgrad_op(gl, rl, w8, scale, block_size=ctx.block_size, act_quant=ctx.act_quant,
                                   backend=ctx.backend, v=v, A=A, s=s, mask=mask, p=p, gb=gb, rb=rb,
                                   global_scale=global_scale, weight=W, weight_fac=fac)
            if need_dA:
                dA = _ops.project_grad_op(v, x, mask=mask, p=p, s=s, out_dtype=A.dtype, backend=ctx.backend)
        return (dx, None, None, db if need_db else None, dA, dB if need_dB else None, dm if need_dm else None,
                None, None, None, None, None, None, None)


class FP8LinearFunction(torch.autograd.Function):
    """y = x W0^T + bias with a frozen fp8 weight: the backward is the input gradient (and bias')."""

    @staticmethod
    def forward(ctx, x, w8, scale, bias, block_size, act_quant, backend, global_scale=None):
        ctx.save_for_backward(w8, scale, global_scale)
        ctx.block_size, ctx.act_quant, ctx.backend = block_size, act_quant, backend
        if x.shape[0] == 0:
            return x.new_empty(0, w8.shape[0])
        y, _ = _ops.forward_op(x, w8, scale, bias, block_size=block_size, act_quant=act_quant, backend=backend,
                               global_scale=global_scale)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, gy):
        w8, scale, global_scale = ctx.saved_tensors
        g = rows(gy)
        dx = db = None
        if g.shape[0] == 0:
            return (g.new_empty(0, weight_dims(w8)[1]) if ctx.needs_input_grad[0] else None, None, None,
                    g.new_zeros(w8.shape[0]) if ctx.needs_input_grad[3] else None, None, None, None, None)
        srow = row_scale(scale)
        if srow is None:  # nothing to scale in g: no pass over it unless the bias wants its gradient
            gl, rl = g, torch.ones((), dtype=torch.float32, device=g.device)
            if ctx.needs_input_grad[3]:
                db = g.sum(0, dtype=torch.float32).to(g.dtype)
        else:
            need_db = bool(ctx.needs_input_grad[3])
            gl, rs, _, _, _, db, _ = _ops.backward_pass_op(g, srow, backend=ctx.backend, need_db=need_db)
            rl = rs[0]
            if not need_db:
                db = None
        if ctx.needs_input_grad[0]:
            dx = _ops.dgrad_op(gl, rl, w8, scale, block_size=ctx.block_size, act_quant=ctx.act_quant,
                               backend=ctx.backend, global_scale=global_scale)
        return dx, None, None, db, None, None, None, None


def _check_float(t, name: str, shape: tuple) -> None:
    check_float(t, name, wider_ok=True)
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")


def _check_x(x, K: int) -> None:
    check_float(x, "x")
    if x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"x must have in_features={K} as its last dimension, got shape {list(x.shape)}")


def _rank(lora_A, lora_B, K: int) -> int:
    """The rank r the shape checks expect: lora_A's, else lora_B's if lora_A is wrong (then its error says [r, K])."""
    if not isinstance(lora_A, torch.Tensor) or lora_A.dim() != 2:
        raise ValueError(f"lora_A must be 2-D [r, {K}], got {list(getattr(lora_A, 'shape', []))}")
    if lora_A.shape[1] == K or not (isinstance(lora_B, torch.Tensor) and lora_B.dim() == 2):
        return lora_A.shape[0]  # lora_A is right (or nothing better is known): a wrong lora_B is named
    return lora_B.shape[1]


def _check_weight(w8, scale, block_size, global_scale=None) -> tuple[Tensor, int, int, Tensor]:
    """(w8, N, K, scale): w8 with unit stride in its last dim (a transposed one, which the reference and native
    backends take, is copied once for the kernels, which need it), its dims and the normalized scale."""
    check_block_size(block_size)
    N, K, scale = check_weight(w8, scale, block_size, global_scale)
    if N == 0 or K == 0:  # as quantize_e4m3 refuses it (the kernels failed on it with ZeroDivisionError and worse)
        raise ValueError(f"w8 must not be empty, got shape {tuple(w8.shape)}")
    return rows(w8), N, K, scale


def weight_norm(w8: Tensor, scale: Tensor, lora_A: Tensor, lora_B: Tensor, scaling: float, *,
                backend: str | None = "auto", block_size: int = DEFAULT_BLOCK,
                global_scale: Optional[Tensor] = None) -> Tensor:
    """n_j = || W0[j] + scaling * (lora_B @ lora_A)[j] ||_2 as fp32 [N], detached, never forming [N, K].

    Args:
        w8, scale: the fp8 base weight [N, K] and its fp32 scale, W0 = scale * w8: scale [] (per tensor), [N] (per
            row) or [ceil(N/b), ceil(K/b)] (per b x b block); or a microscaled weight (MXFP8, NVFP4: dorafp8/quant.py).
        lora_A, lora_B: the adapter, [r, K] and [N, r].
        scaling: lora_alpha / r (or / sqrt(r)).
        backend: a backend name, or "auto" (dorafp8.BACKENDS).
        block_size: b, for block scales.
        global_scale: an NVFP4 weight's fp32 global scale; None otherwise.

    Returns:
        The norms, fp32 [N], with no autograd history.
    """
    w8, N, K, scale = _check_weight(w8, scale, block_size, global_scale)
    r = _rank(lora_A, lora_B, K)
    _check_float(lora_A, "lora_A", (r, K))
    _check_float(lora_B, "lora_B", (N, r))
    check_device(w8, scale=scale, lora_A=lora_A, lora_B=lora_B, global_scale=global_scale)
    rdt = torch.promote_types(lora_A.dtype, lora_B.dtype)
    name = race.select("norm", backend, w8.device, backend_needs(scale, ""), N=N, K=K, M=1, r=r,
                       scale=scale_kind(scale), block=block_size, cdt=rdt, rdt=rdt)
    with torch.no_grad():
        return _ops.weight_norm_op(w8, scale, lora_A.detach(), lora_B.detach(), float(scaling),
                                   block_size=block_size, backend=name, global_scale=global_scale)


def fp8_linear(x: Tensor, w8: Tensor, scale: Tensor, bias: Optional[Tensor] = None, *,
               backend: str | None = "auto", block_size: int = DEFAULT_BLOCK, act_quant: str | None = None,
               global_scale: Optional[Tensor] = None) -> Tensor:
    """x W0^T + bias without dequantizing w8 to memory; differentiable in x (and bias).

    Args:
        x: [..., K], fp32 / bf16 / fp16.
        w8, scale: the fp8 base weight [N, K] and its scale, as for dora_fp8_linear.
        bias: [N], or None.
        backend: a backend name, or "auto" (dorafp8.BACKENDS).
        block_size: b, for block scales.
        act_quant: None (activations in the compute dtype) or "rowwise": x (and, in the backward, the gradient)
            quantized per row to e4m3 for the base GEMM (W8A8, fp8 tensor cores; accuracy: docs/DORA_MATH.md).
        global_scale: an NVFP4 weight's fp32 global scale (w8 packed uint8, scale e4m3; dorafp8/quant.py,
            "Microscaled weights"); None otherwise.

    Returns:
        [..., N] in the compute dtype (autocast's, else x's).

    Raises:
        TypeError, ValueError: as dora_fp8_linear, naming the argument and what it expected.
        RuntimeError: a backend named here or by DORAFP8_BACKEND that cannot run on x's device.
    """
    w8, N, K, scale = _check_weight(w8, scale, block_size, global_scale)
    _check_x(x, K)
    if bias is not None:
        _check_float(bias, "bias", (N,))
    check_device(x, w8=w8, scale=scale, bias=bias, global_scale=global_scale)
    mode = check_act_quant(act_quant)
    cdt = compute_dtype(x)
    name = race.select("linear", backend, x.device, backend_needs(scale, mode, cdt), N=N, K=K,
                       M=math.prod(x.shape[:-1]), bias=bias is not None, scale=scale_kind(scale), block=block_size,
                       cdt=cdt, act_quant=mode)
    x2d = rows(as_rows(x, K).to(cdt))
    b = None if bias is None else bias.to(cdt)
    y = FP8LinearFunction.apply(x2d, w8, scale, b, block_size, mode, name, global_scale)
    return as_result(y, (*x.shape[:-1], N))  # not a view of y (FSDP2 warns on views)


def dora_fp8_linear(x: Tensor, w8: Tensor, scale: Tensor, lora_A: Tensor, lora_B: Tensor, magnitude: Tensor,
                    scaling: float, bias: Optional[Tensor] = None, *, dropout_p: float = 0.0, training: bool = False,
                    backend: str | None = "auto", weight_norm: Optional[Tensor] = None,
                    block_size: int = DEFAULT_BLOCK, act_quant: str | None = None,
                    global_scale: Optional[Tensor] = None) -> Tensor:
    """PEFT's DoRA Linear on an fp8 base:  y = m / ||W0 + s B A||_row * (x W0^T + s (x A^T) B^T) + bias.

    Args:
        x: [..., K], fp32 / bf16 / fp16.
        w8: the frozen base weight, [N, K] float8_e4m3fn; or a microscaled one (see global_scale).
        scale: w8's fp32 scale, W0 = scale * w8: [] per tensor, [N] per row, or [ceil(N/b), ceil(K/b)] per b x b block.
        lora_A, lora_B, magnitude: the adapter, [r, K], [N, r] and [N].
        scaling: lora_alpha / r (or / sqrt(r)).
        bias: [N], or None.
        dropout_p, training: with training=True and dropout_p > 0, PEFT's dropout semantics: the base term sees x,
            the DoRA terms see dropout(x).
        backend: a backend name, or "auto" (dorafp8.BACKENDS).
        weight_norm: a precomputed detached norm (fp32 [N]) to reuse, e.g. across gradient-accumulation steps; it
            must equal dorafp8.weight_norm(w8, scale, lora_A, lora_B, scaling) for the current adapter weights.
        block_size: b, for block scales.
        act_quant: None (W8A16, the default) or "rowwise" (W8A8 base GEMMs on fp8 tensor cores; the low-rank path,
            the norm and every gradient of A, B, m stay in their dtypes).
        global_scale: an NVFP4 weight's fp32 global scale (w8 packed uint8 [N, K/2], scale e4m3 [N, K/16]); an MXFP8
            weight is w8 e4m3 with an e8m0 scale [N, ceil(K/32)] (dorafp8/quant.py, "Microscaled weights").

    Returns:
        [..., N] in the compute dtype (autocast's, else x's; docs/DORA_MATH.md, "Dtype policy"). Gradients flow to x,
        lora_A, lora_B, magnitude (and bias if it requires grad); w8 and scale are frozen.

    Raises:
        TypeError: a tensor of another dtype than expected, or a scaling that is not a real number.
        ValueError: a shape that does not fit (the message names the argument and the shape expected), inputs on
            different devices, dropout_p outside [0, 1), an unknown backend or act_quant, or a named backend that
            cannot compute this call (block scales, W8A8).
        RuntimeError: a backend named here or by DORAFP8_BACKEND that cannot run on x's device.
    """
    w8, N, K, scale = _check_weight(w8, scale, block_size, global_scale)
    _check_x(x, K)
    r = _rank(lora_A, lora_B, K)
    _check_float(lora_A, "lora_A", (r, K))
    _check_float(lora_B, "lora_B", (N, r))
    _check_float(magnitude, "magnitude", (N,))
    if bias is not None:
        _check_float(bias, "bias", (N,))
    check_scaling_dropout(scaling, dropout_p)
    mode = check_act_quant(act_quant)
    check_device(x, w8=w8, scale=scale, lora_A=lora_A, lora_B=lora_B, magnitude=magnitude, bias=bias,
                  global_scale=global_scale)
    if weight_norm is not None and (not isinstance(weight_norm, torch.Tensor) or tuple(weight_norm.shape) != (N,)):
        raise ValueError(f"weight_norm must be an fp32 tensor of shape [{N}], got "
                         f"{list(getattr(weight_norm, 'shape', []))}")
    cdt = compute_dtype(x)
    rdt = rank_dtype(x, lora_A, lora_B)
    p = float(dropout_p) if training else 0.0
    name = race.select("dora", backend, x.device, backend_needs(scale, mode, cdt), N=N, K=K,
                       M=math.prod(x.shape[:-1]), r=r, bias=bias is not None, scale=scale_kind(scale),
                       block=block_size, cdt=cdt, rdt=rdt, p=p, act_quant=mode)
    x2d = rows(as_rows(x, K).to(cdt))
    b, A, B, s = None if bias is None else bias.to(cdt), lora_A.to(rdt), lora_B.to(rdt), float(scaling)
    if weight_norm is None:
        n = _ops.weight_norm_op(w8, scale, lora_A.detach(), lora_B.detach(), s, block_size=block_size, backend=name,
                                global_scale=global_scale)
    else:
        n = reused_norm(weight_norm, x)
    y = DoRAFP8Function.apply(x2d, w8, scale, b, A, B, magnitude, n, s, p, block_size, mode, name, global_scale)
    return as_result(y, (*x.shape[:-1], N))  # not a view of y (FSDP2 warns on views)
