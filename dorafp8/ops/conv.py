"""FP8 convolutions as functional ops with their autograd: fp8_conv and dora_fp8_conv (PEFT's `DoraConv2dLayer`
semantics; docs/DORA_MATH.md, "Convolutions"). A call dequantizes the weight into a transient in the compute dtype
(fp32 row blocks of at most 16 MiB) for the platform's convolution; the backward dequantizes again."""

from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .._fp8_cast import e4m3_scaled
from ..quant import (DEFAULT_BLOCK, check_block_size, check_e4m3, check_scale, row_blocks, row_step, scale_kind,
                     scale_rows)
from ._policy import (as_result, check_device, check_float, check_scaling_dropout, compute_dtype, dropout_mask,
                      norm_divisor, rank_dtype, reused_norm)
from .linear import weight_norm as linear_weight_norm


def _tuple(v, nd: int, name: str) -> tuple:
    if type(v) is tuple and len(v) == nd and all(type(i) is int for i in v):
        return v
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):
        return (int(v),) * nd
    if isinstance(v, Sequence) and len(v) == nd and all(isinstance(i, numbers.Integral) for i in v):
        return tuple(int(i) for i in v)
    raise ValueError(f"{name} must be an int or a sequence of {nd} ints, got {v!r}")


def dequantize_transient(w8: Tensor, scale: Tensor, block_size: int, dtype: torch.dtype) -> Tensor:
    """scale * w8 in `dtype`, in w8's layout, computed in fp32 over row blocks and rounded once."""
    C = w8.shape[0]
    w2 = w8.reshape(C, -1)
    K = w2.shape[1]
    kind = scale_kind(scale)
    blocks = list(row_blocks(C, K, row_step(scale, block_size)))
    if kind == "tensor" and (dtype == torch.float32 or len(blocks) == 1):
        return e4m3_scaled(w8, scale, dtype)  # one rounding into dtype; fp32 temporaries at most a block's size
    out = torch.empty(w8.shape, dtype=dtype, device=w8.device)
    o2 = out.view(C, K)
    for j0, j1 in blocks:
        o2[j0:j1] = e4m3_scaled(w2[j0:j1], scale_rows(scale, block_size, j0, j1, K), torch.float32)
    return out


def _conv(x, w, b, stride, padding, dilation, groups):
    return torch.convolution(x, w, b, stride, padding, dilation, False, [0] * (x.dim() - 2), groups)


def _conv_backward(g, x, w, stride, padding, dilation, groups, need_input: bool, need_weight: bool):
    """(d input, d weight) of _conv for g; x may be a torch.Size when only the input gradient is wanted."""
    if not (need_input or need_weight):
        return None, None
    if isinstance(x, torch.Size):
        x = g.new_empty(1).expand(x)
    gi, gw, _ = torch.ops.aten.convolution_backward(g, x, w, None, stride, padding, dilation, False,
                                                    [0] * (g.dim() - 2), groups, [need_input, need_weight, False])
    return gi, gw


def _lora_input(x: Tensor, mask: Optional[Tensor], p: float, rdt: torch.dtype) -> Tensor:
    """The lora path's input as PEFT's dropout on a GPU forms it: x in the adapters' dtype, then x * mask / (1 - p)
    rounded once. Not x * (mask / (1 - p)) with the factor rounded first (1 / 0.9 is 1.109 in bf16): every kept
    element came out 0.15% small, the same way (a bias no sum averages out)."""
    xr = _as(x, rdt)
    if mask is None:
        return xr
    return (xr * (1.0 / (1.0 - p))).mul_(mask)


def _f32(t: Tensor) -> Tensor:
    return t if t.dtype == torch.float32 else t.float()


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _chan(t: Tensor, nd: int) -> Tensor:
    """A per-channel [C] tensor as [1, C, 1, ...] against [M, C, *spatial]."""
    return t.reshape((1, -1) + (1,) * nd)


def _sum_but_channels(t: Tensor) -> Tensor:
    return t.sum(dim=[0] + list(range(2, t.dim())))


def conv_weight_norm(w8: Tensor, scale: Tensor, lora_A: Tensor, lora_B: Tensor, scaling: float, groups: int = 1, *,
                     backend: str | None = "auto", block_size: int = DEFAULT_BLOCK) -> Tensor:
    """n_o = || W0[o] + scaling * L[o] ||_2 over all but the output-channel dim, fp32 [C_out], detached, never forming
    the dense weight; L is PEFT 0.21's lora weight, (lora_B.view(-1, r) @ lora_A.view(r, -1)) reshaped to W0's shape:
    with groups = g, row o is (B.view(C_out/g, r)[o // g]) @ (A.view(r, g, -1)[:, o % g]), g calls over o = t (mod g).
    Shapes: w8 [C_out, C_in/g, *k], lora_A [r, C_in, *k], lora_B [C_out, r/g, 1, ...]; block scales need groups = 1."""
    C = w8.shape[0]
    r = lora_A.shape[0]
    if lora_A.numel() % r or lora_B.numel() % r:
        raise ValueError(f"lora_A {list(lora_A.shape)} / lora_B {list(lora_B.shape)} do not share a rank")
    w2 = w8.reshape(C, -1)
    A2 = lora_A.detach().reshape(r, -1)
    B2 = lora_B.detach().reshape(-1, r)
    if groups == 1:
        return linear_weight_norm(w2, scale, A2, B2, scaling, backend=backend, block_size=block_size)
    if scale_kind(check_scale(scale, C, w2.shape[1], block_size)) == "block":
        raise ValueError("block scales are not supported on grouped convolutions (groups > 1); use a per-tensor or "
                         "per-output-channel scale")
    Kg = w2.shape[1]
    if C % groups or A2.shape[1] != groups * Kg or B2.shape[0] * groups != C:
        raise ValueError(f"lora_A {list(lora_A.shape)} / lora_B {list(lora_B.shape)} do not fit a grouped conv "
                         f"weight {list(w8.shape)} with groups={groups}")
    A3 = A2.reshape(r, groups, Kg)
    n = torch.empty(C, dtype=torch.float32, device=w8.device)
    for t in range(groups):
        sc = scale if scale.dim() == 0 else scale.reshape(-1)[t::groups]
        n[t::groups] = linear_weight_norm(w2[t::groups].contiguous(), sc, A3[:, t].contiguous(), B2, scaling,
                                          backend=backend, block_size=block_size)
    return n


class FP8ConvFunction(torch.autograd.Function):
    """y = conv(x, scale * w8) + bias on a frozen fp8 weight; the backward re-dequantizes the weight."""

    @staticmethod
    def forward(ctx, x, w8, scale, bias, block_size, stride, padding, dilation, groups):
        w = dequantize_transient(w8, scale, block_size, x.dtype)
        y = _conv(x, w, bias, stride, padding, dilation, groups)
        del w
        ctx.save_for_backward(w8, scale)
        ctx.geom = (block_size, stride, padding, dilation, groups)
        ctx.x_shape = x.shape
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, gy):
        w8, scale = ctx.saved_tensors
        block_size, stride, padding, dilation, groups = ctx.geom
        dx = db = None
        if ctx.needs_input_grad[0]:
            w = dequantize_transient(w8, scale, block_size, gy.dtype)
            dx, _ = _conv_backward(gy, ctx.x_shape, w, stride, padding, dilation, groups, True, False)
            del w
        if ctx.needs_input_grad[3]:
            db = _as(_sum_but_channels(_f32(gy)), gy.dtype)
        return dx, None, None, db, None, None, None, None, None


class DoRAFP8ConvFunction(torch.autograd.Function):
    """PEFT's DoRA on a conv layer with a frozen fp8 weight (docs/DORA_MATH.md, "Convolutions"):

        no dropout:  y = c * (conv(x, W0) + s * lora_B(lora_A(x))) + b
        dropout:     y = conv(x, W0) + b + (c - 1) * conv(xd, W0) + c * s * lora_B(lora_A(xd))

    with c = m / n (NORM_EPS where n = 0) per output channel (fp32) and xd = dropout(x). Dtypes as DoRAFP8Function's;
    saves x, the mask, u = lora_A(xd) and z = conv(xd, W0) + s * lora_B(u), never a dequantized weight."""

    @staticmethod
    def forward(ctx, x, w8, scale, bias, A, B, m, n, s, p, block_size, geom, lora_geom):
        stride, padding, dilation, groups = geom
        nd = x.dim() - 2
        n = norm_divisor(n)
        c = _f32(m.reshape(-1)) / n
        cv = _chan(c, nd)
        dropout = p > 0.0
        need_z = ctx.needs_input_grad[6]
        cdt, rdt = x.dtype, A.dtype
        mask = dropout_mask(x, p) if dropout else None
        u = _conv(_lora_input(x, mask, p, rdt), A, None, *lora_geom, 1)
        lora = _conv(u, B, None, [1] * nd, [0] * nd, [1] * nd, groups)
        w = dequantize_transient(w8, scale, block_size, cdt)
        if dropout:
            base_x = _conv(x, w, None, stride, padding, dilation, groups)
            # conv(xd, W0) = conv(x * mask, W0) / (1 - p): the kept part of x is exact in cdt, the factor is fp32
            base_d = _conv(x * mask, w, None, stride, padding, dilation, groups).float().mul_(1.0 / (1.0 - p))
        else:
            base_x, base_d = None, _conv(x, w, None, stride, padding, dilation, groups)
        del w
        # The epilogue in fp32, each result rounded once. z = conv(xd, W0) + s lora (a copy when base_d is fp32 and
        # still needed, by the dropout formula)
        z32 = (base_d.clone() if dropout else _f32(base_d)).add_(lora, alpha=s)
        del lora
        y = torch.empty(z32.shape, dtype=cdt, device=x.device)
        if dropout:  # conv(x, W0) + (c - 1) conv(xd, W0) + c s lora  ==  conv(x, W0) - conv(xd, W0) + c z
            t = base_x.float().sub_(base_d).addcmul_(z32, cv)
            if bias is not None:
                t.add_(_chan(bias, nd))
            y.copy_(t)
            del t
        elif bias is None:
            torch.mul(z32, cv, out=y)
        else:
            torch.addcmul(_chan(_f32(bias), nd), z32, cv, out=y)
        del base_d, base_x
        z = _as(z32, cdt) if need_z else None  # the compute dtype, as the linear op keeps it (DORA_MATH.md)
        del z32
        ctx.save_for_backward(x, mask, u, z, w8, scale, A, B, c, n)
        ctx.s, ctx.p, ctx.block_size, ctx.geom, ctx.lora_geom = s, p, block_size, geom, lora_geom
        ctx.m_shape, ctx.m_dtype = m.shape, m.dtype
        ctx.x_shape = x.shape
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, gy):
        x, mask, u, z, w8, scale, A, B, c, n = ctx.saved_tensors
        need_dx, _, _, need_db, need_dA, need_dB, need_dm = ctx.needs_input_grad[:7]
        stride, padding, dilation, groups = ctx.geom
        s, p = ctx.s, ctx.p
        nd = gy.dim() - 2
        cdt, rdt = gy.dtype, A.dtype
        cv = _chan(c, nd)
        g32 = _f32(gy)
        dx = dA = dB = dm = db = None
        if need_db:
            db = _as(_sum_but_channels(g32), cdt)
        if need_dm:
            dm = _as((_sum_but_channels(g32 * z) / n).reshape(ctx.m_shape), ctx.m_dtype)
        # g * c in the compute dtype, the output gradient of the lora path (times s) and, without dropout, of the base
        # conv; fp16: scaled by 1 / max(max|c|, 1) (scaled back in fp32), so that it cannot overflow where g does not
        # and its product with W0 cannot where dx does not (by 1 / max|c| alone, c below 1 everywhere made that
        # product dx / max|c|: inf with a weight near fp16's range). Below 1 it is g c itself, PEFT's operand.
        rc = c.abs().amax().clamp_min(1.0) if cdt == torch.float16 else None
        gc = torch.empty(gy.shape, dtype=cdt, device=gy.device)
        torch.mul(g32, cv if rc is None else cv / rc, out=gc)
        dx_lora = None
        if need_dx or need_dA or need_dB:
            # d y / d lora = s c: the transposed convs take g c, their (small, rank-r) results are scaled by s
            gl = gc if (rc is None and rdt == cdt) else (g32 * cv).to(rdt)
            du, dB_ = _conv_backward(gl, u, B, [1] * nd, [0] * nd, [1] * nd, groups, need_dx or need_dA,
                                     bool(need_dB))
            if need_dB:
                dB = _as(dB_ * s, B.dtype)
            if need_dx or need_dA:
                du = du * s
                xd = _lora_input(x, mask, p, rdt) if need_dA else x.shape
                dx_lora, dA_ = _conv_backward(du, xd, A, *ctx.lora_geom, 1, bool(need_dx), bool(need_dA))
                del xd
                if need_dA:
                    dA = _as(dA_, A.dtype)
        if need_dx:
            w = dequantize_transient(w8, scale, ctx.block_size, cdt)
            geom = (stride, padding, dilation, groups)
            if mask is None:  # dx = conv_input(g c) + lora path
                dx, _ = _conv_backward(gc, ctx.x_shape, w, *geom, True, False)
                if rc is not None:
                    dx = dx.float().mul_(rc)
                if dx_lora is not None:
                    dx = dx.add_(dx_lora)  # bf16 + bf16 rounded once, as in fp32
            else:  # dx = conv_input(g) + mask / (1 - p) * (conv_input(g (c - 1)) + lora path)
                del gc
                dplain, _ = _conv_backward(gy, ctx.x_shape, w, *geom, True, False)
                cm1 = cv - 1.0  # 0 at DoRA's init, small after; fp16: scaled as above
                r1 = cm1.abs().amax().clamp_min(torch.finfo(torch.float32).tiny) if cdt == torch.float16 else None
                gd = (g32 * (cm1 if r1 is None else cm1 / r1)).to(cdt)
                ddrop, _ = _conv_backward(gd, ctx.x_shape, w, *geom, True, False)
                ddrop = ddrop.float()
                if r1 is not None:
                    ddrop.mul_(r1)
                if dx_lora is not None:
                    ddrop.add_(dx_lora)
                dx = ddrop.mul_(mask).mul_(1.0 / (1.0 - p)).add_(dplain)
            del w
            dx = _as(dx, cdt)
        return dx, None, None, db, dA, dB, dm, None, None, None, None, None, None


def _check_conv_args(x, w8, scale, bias, block_size, groups):
    check_e4m3(w8, "w8")
    nd = w8.dim() - 2
    if nd not in (1, 2, 3):
        raise ValueError(f"w8 must be a conv weight [C_out, C_in/groups, *kernel] with 1 to 3 kernel dims, got shape "
                         f"{list(w8.shape)}")
    check_float(x, "x")
    if x.dim() not in (nd + 1, nd + 2):
        raise ValueError(f"x must be [batch, C_in, *spatial] ({nd + 2}-D) or unbatched ({nd + 1}-D), got shape "
                         f"{list(x.shape)}")
    if x.shape[-nd - 1] != w8.shape[1] * groups:
        raise ValueError(f"x has {x.shape[-nd - 1]} channels, the weight expects {w8.shape[1] * groups} "
                         f"(C_in/groups={w8.shape[1]}, groups={groups})")
    check_block_size(block_size)
    C = w8.shape[0]
    scale = check_scale(scale, C, math.prod(w8.shape[1:]), block_size)
    if bias is not None:
        check_float(bias, "bias")
        if bias.numel() != C:
            raise ValueError(f"bias must have {C} elements (one per output channel), got shape {list(bias.shape)}")
    check_device(x, w8=w8, scale=scale, bias=bias)
    return nd, scale


def fp8_conv(x: Tensor, w8: Tensor, scale: Tensor, bias: Optional[Tensor] = None, stride=1, padding=0, dilation=1,
             groups: int = 1, *, block_size: int = DEFAULT_BLOCK) -> Tensor:
    """conv(x, scale * w8) + bias (F.conv1d/2d/3d semantics), differentiable in x and bias.

    Args:
        x: [batch, C_in, *spatial].
        w8, scale: the base weight [C_out, C_in/groups, *kernel] float8_e4m3fn and its fp32 scale: per tensor, per
            output channel or per block of the 2-D view.
        bias: [C_out], or None.
        stride, padding, dilation, groups: as F.convNd's (zero padding, given as ints).
        block_size: b, for block scales.

    Returns:
        The output in the compute dtype (autocast's, else x's).
    """
    nd, scale = _check_conv_args(x, w8, scale, bias, block_size, groups)
    geom = (_tuple(stride, nd, "stride"), _tuple(padding, nd, "padding"), _tuple(dilation, nd, "dilation"))
    cdt = compute_dtype(x)
    unbatched = x.dim() == nd + 1
    xx = _as(x.unsqueeze(0) if unbatched else x, cdt)
    with torch.autocast(x.device.type, enabled=False):
        y = FP8ConvFunction.apply(xx, w8, scale, None if bias is None else _as(bias, cdt), block_size, *geom, groups)
    return as_result(y, y.shape[1:]) if unbatched else y  # not a view of y (FSDP2 warns on views)


def dora_fp8_conv(x: Tensor, w8: Tensor, scale: Tensor, lora_A: Tensor, lora_B: Tensor, magnitude: Tensor,
                  scaling: float, bias: Optional[Tensor] = None, stride=1, padding=0, dilation=1, groups: int = 1, *,
                  lora_stride=None, lora_padding=None, lora_dilation=None, dropout_p: float = 0.0,
                  training: bool = False, backend: str | None = "auto", weight_norm: Optional[Tensor] = None,
                  block_size: int = DEFAULT_BLOCK) -> Tensor:
    """PEFT's DoRA conv (DoraConv1d/2d/3dLayer) on an fp8 base:

        y = m / ||W0 + s L||_channel * (conv(x, W0) + s * conv1x1(conv(x, lora_A), lora_B)) + bias

    Args:
        x: [batch, C_in, *spatial].
        w8, scale: the base weight [C_out, C_in/groups, *kernel] float8_e4m3fn and its fp32 scale (as fp8_conv).
        lora_A, lora_B: [r, C_in, *kernel] and [C_out, r/groups, 1, ...] (1x1, with the base's groups).
        magnitude: C_out elements (PEFT stores [1, C_out, 1, 1]).
        scaling: lora_alpha / r.
        bias: [C_out], or None.
        stride, padding, dilation, groups: the base conv's (zero padding, ints).
        lora_stride, lora_padding, lora_dilation: lora_A's (default: the base's; PEFT 0.21's lora_A takes the base's
            stride and padding and dilation 1); its groups are 1.
        dropout_p, training: with training=True and dropout_p > 0, PEFT's dropout semantics (the base term sees x,
            the DoRA terms see dropout(x)).
        backend: a backend name, or "auto" (dorafp8.BACKENDS).
        weight_norm: a precomputed detached norm (fp32 [C_out]) to reuse.
        block_size: b, for block scales.

    Returns:
        The output in the compute dtype. Gradients flow to x, lora_A, lora_B, magnitude (and bias if it requires
        grad).
    """
    nd, scale = _check_conv_args(x, w8, scale, bias, block_size, groups)
    C = w8.shape[0]
    r = lora_A.shape[0] if isinstance(lora_A, torch.Tensor) and lora_A.dim() == nd + 2 else None
    if r is None or tuple(lora_A.shape[1:]) != (w8.shape[1] * groups,) + tuple(w8.shape[2:]):
        raise ValueError(f"lora_A must have shape [r, {w8.shape[1] * groups}, {', '.join(map(str, w8.shape[2:]))}], "
                         f"got {list(getattr(lora_A, 'shape', []))}")
    if r % groups or not isinstance(lora_B, torch.Tensor) or tuple(lora_B.shape) != (C, r // groups) + (1,) * nd:
        raise ValueError(f"lora_B must have shape [{C}, {r // groups if r % groups == 0 else 'r/groups'}"
                         f"{', 1' * nd}] (rank {r} divisible by groups={groups}), got "
                         f"{list(getattr(lora_B, 'shape', []))}")
    for name, t in (("lora_A", lora_A), ("lora_B", lora_B), ("magnitude", magnitude)):
        check_float(t, name)
    check_device(x, lora_A=lora_A, lora_B=lora_B, magnitude=magnitude)
    if magnitude.numel() != C:
        raise ValueError(f"magnitude must have {C} elements (one per output channel), got shape "
                         f"{list(magnitude.shape)}")
    check_scaling_dropout(scaling, dropout_p)
    geom = (_tuple(stride, nd, "stride"), _tuple(padding, nd, "padding"), _tuple(dilation, nd, "dilation"), groups)
    lora_geom = (_tuple(geom[0] if lora_stride is None else lora_stride, nd, "lora_stride"),
                 _tuple(geom[1] if lora_padding is None else lora_padding, nd, "lora_padding"),
                 _tuple(geom[2] if lora_dilation is None else lora_dilation, nd, "lora_dilation"))
    if weight_norm is None:
        n = conv_weight_norm(w8, scale, lora_A, lora_B, float(scaling), groups, backend=backend,
                             block_size=block_size)
    else:
        if not isinstance(weight_norm, torch.Tensor) or weight_norm.numel() != C:
            raise ValueError(f"weight_norm must be an fp32 tensor with {C} elements, got "
                             f"{list(getattr(weight_norm, 'shape', []))}")
        n = reused_norm(weight_norm, x).reshape(C)
    cdt = compute_dtype(x)
    rdt = rank_dtype(x, lora_A, lora_B)
    unbatched = x.dim() == nd + 1
    xx = _as(x.unsqueeze(0) if unbatched else x, cdt)
    p = float(dropout_p) if training else 0.0
    with torch.autocast(x.device.type, enabled=False):
        y = DoRAFP8ConvFunction.apply(xx, w8, scale, None if bias is None else _as(bias, cdt), _as(lora_A, rdt),
                                      _as(lora_B, rdt), magnitude, n, float(scaling), p, block_size, geom, lora_geom)
    return as_result(y, y.shape[1:]) if unbatched else y  # not a view of y (FSDP2 warns on views)
