"""DoRA on an FP8 base as autograd Functions over three backend kernels.

Hops from the public API to a kernel:
    dora_fp8_linear (checks, dtype policy, weight norm)  ->  DoRAFP8Function (autograd: dropout, rank-r GEMMs,
    dm/dA/dB)  ->  torch.ops.dorafp8.{forward,dgrad,weight_norm} (custom ops, opaque to torch.compile)  ->
    backend module (dorafp8.reference / dorafp8.triton_kernels / dorafp8.cuda_backend)  ->  kernel.

The formulas are those of docs/DORA_MATH.md (PEFT 0.21 semantics); the backend contract is in
dorafp8/backends.py.

Dtype policy: the compute dtype is the autocast dtype when autocast is on for x's device, else x's dtype
(fp32, bf16 or fp16). x, lora_A, lora_B and bias are cast to it (autograd casts the gradients back to each
parameter's dtype); the weight norm, c = m / n and every accumulation are fp32; the output has the compute dtype.
"""

from __future__ import annotations

import numbers
from typing import Optional

import torch
from torch import Tensor

from . import backends
from .quant import check_fp8_weight, check_scale

_ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_EMPTY = torch.empty(0)  # placeholder a custom op returns for "no tensor" (custom ops cannot return None)

# ----------------------------------------------------------------------------------------------------------------
# Custom ops: one per backend kernel. Registering them makes the autograd Functions below traceable by
# torch.compile (the kernels stay opaque, with shapes given by the fake implementations).
# ----------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("dorafp8::weight_norm", mutates_args=())
def _weight_norm_op(w8: Tensor, scale: Tensor, A: Tensor, B: Tensor, s: float, backend: str) -> Tensor:
    return backends.module(backend).weight_norm(w8, scale, A, B, s)


@_weight_norm_op.register_fake
def _(w8, scale, A, B, s, backend):
    return w8.new_empty(w8.shape[0], dtype=torch.float32)


@torch.library.custom_op("dorafp8::forward", mutates_args=())
def _forward_op(x: Tensor, w8: Tensor, scale: Tensor, bias: Optional[Tensor], c: Optional[Tensor],
                u: Optional[Tensor], B: Optional[Tensor], s: float, xd: Optional[Tensor], need_z: bool,
                backend: str) -> tuple[Tensor, Tensor]:
    y, z = backends.module(backend).forward(x, w8, scale, bias, c, u, B, s, xd, need_z)
    return y, (z if z is not None else x.new_empty(0))


@_forward_op.register_fake
def _(x, w8, scale, bias, c, u, B, s, xd, need_z, backend):
    y = x.new_empty(x.shape[0], w8.shape[0])
    return y, (x.new_empty(x.shape[0], w8.shape[0]) if need_z else x.new_empty(0))


@torch.library.custom_op("dorafp8::dgrad", mutates_args=())
def _dgrad_op(g: Tensor, w8: Tensor, scale: Tensor, c: Optional[Tensor], v: Optional[Tensor], A: Optional[Tensor],
              s: float, mask: Optional[Tensor], p: float, backend: str) -> Tensor:
    return backends.module(backend).dgrad(g, w8, scale, c, v, A, s, mask, p)


@_dgrad_op.register_fake
def _(g, w8, scale, c, v, A, s, mask, p, backend):
    return g.new_empty(g.shape[0], w8.shape[1])


# ----------------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------------


def _dropout_with_mask(x: Tensor, p: float) -> tuple[Tensor, Tensor]:
    """(dropout(x), keep mask), drawing exactly the random numbers torch.nn.functional.dropout draws, so that a
    seeded run gives PEFT's mask bit for bit (on CUDA F.dropout is native_dropout; on CPU it is this recipe)."""
    if x.device.type != "cpu":
        return torch.native_dropout(x, p, True)
    noise = torch.empty_like(x).bernoulli_(1 - p)
    noise.div_(1 - p)
    return x * noise, noise != 0


def _rows(t: Tensor) -> Tensor:
    """t with unit stride in its last dim (what the kernels need; any row stride is fine)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _colsum_prod(g: Tensor, z: Tensor) -> Tensor:
    """sum_i g[i, j] * z[i, j] in fp32, in row chunks so that the fp32 temporaries stay bounded."""
    out = torch.zeros(g.shape[1], dtype=torch.float32, device=g.device)
    step = max(1, (1 << 22) // max(g.shape[1], 1))
    for i0 in range(0, g.shape[0], step):
        out += (g[i0:i0 + step].float() * z[i0:i0 + step].float()).sum(0)
    return out


def compute_dtype(x: Tensor) -> torch.dtype:
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


# ----------------------------------------------------------------------------------------------------------------
# Autograd Functions
# ----------------------------------------------------------------------------------------------------------------


class DoRAFP8Function(torch.autograd.Function):
    """y = DoRA(x) on a frozen fp8 base; x2d, A, B, bias already in the compute dtype, n a detached fp32 norm."""

    @staticmethod
    def forward(ctx, x, w8, scale, bias, A, B, m, n, s, p, backend):
        M, N = x.shape[0], w8.shape[0]
        c = m.float() / n
        dropout = p > 0.0
        with torch.autocast(x.device.type, enabled=False):
            if dropout:
                xd, mask = _dropout_with_mask(x, p)
            else:
                xd, mask = x, None
            need_z = ctx.needs_input_grad[6]
            if M == 0:
                y, z = x.new_empty(0, N), x.new_empty(0, N)
                u = x.new_empty(0, A.shape[0])
            else:
                u = xd @ A.T
                y, z = _forward_op(x, w8, scale, bias, c, u, B, s, xd if dropout else None, need_z, backend)
        ctx.save_for_backward(xd, mask, u, z if need_z else None, w8, scale, A, B, c, n)
        ctx.s, ctx.p, ctx.backend, ctx.m_dtype = s, p, backend, m.dtype
        return y

    @staticmethod
    def backward(ctx, gy):
        xd, mask, u, z, w8, scale, A, B, c, n = ctx.saved_tensors
        need_dx, _, _, need_db, need_dA, need_dB, need_dm = ctx.needs_input_grad[:7]
        s, p = ctx.s, ctx.p
        g = _rows(gy)
        cdt = g.dtype
        dx = dA = dB = dm = db = None
        with torch.autocast(g.device.type, enabled=False):
            if need_dx or need_dA:
                v = g @ (c[:, None] * B.float()).to(cdt)  # (g * c) B without forming g * c
            if need_dx:
                if g.shape[0] == 0:
                    dx = g.new_empty(0, w8.shape[1])
                else:
                    dx = _dgrad_op(g, w8, scale, c, v, A, s, mask, p, ctx.backend)
            if need_dA:
                dA = (s * (v.T @ xd)).to(cdt)
            if need_dB:
                dB = (s * c[:, None] * (g.T @ u).float()).to(cdt)
            if need_dm:
                dm = (_colsum_prod(g, z) / n).to(ctx.m_dtype)
            if need_db:
                db = g.sum(0, dtype=torch.float32).to(cdt)
        return dx, None, None, db, dA, dB, dm, None, None, None, None


class FP8LinearFunction(torch.autograd.Function):
    """y = x (scale * w8)^T + bias with a frozen fp8 weight: the backward is the input gradient (and bias')."""

    @staticmethod
    def forward(ctx, x, w8, scale, bias, backend):
        ctx.save_for_backward(w8, scale)
        ctx.backend = backend
        if x.shape[0] == 0:
            return x.new_empty(0, w8.shape[0])
        y, _ = _forward_op(x, w8, scale, bias, None, None, None, 0.0, None, False, backend)
        return y

    @staticmethod
    def backward(ctx, gy):
        w8, scale = ctx.saved_tensors
        g = _rows(gy)
        dx = db = None
        if ctx.needs_input_grad[0]:
            if g.shape[0] == 0:
                dx = g.new_empty(0, w8.shape[1])
            else:
                dx = _dgrad_op(g, w8, scale, None, None, None, 0.0, None, 0.0, ctx.backend)
        if ctx.needs_input_grad[3]:
            db = g.sum(0, dtype=torch.float32).to(g.dtype)
        return dx, None, None, db, None


# ----------------------------------------------------------------------------------------------------------------
# Public functional API
# ----------------------------------------------------------------------------------------------------------------


def _check_float(t, name: str, shape: tuple) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point() or t.dtype == torch.float8_e4m3fn:
        raise TypeError(f"{name} must be a floating-point tensor (fp32/bf16/fp16), got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")


def _check_x(x, K: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _ACT_DTYPES:
        raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"x must have in_features={K} as its last dimension, got shape {list(x.shape)}")


def _check_device(ref: Tensor, **tensors) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{name} is on {t.device} but x is on {ref.device}; all inputs must be on one device")


def weight_norm(w8: Tensor, scale: Tensor, lora_A: Tensor, lora_B: Tensor, scaling: float, *,
                backend: str | None = "auto") -> Tensor:
    """n_j = || scale * w8[j] + scaling * (lora_B @ lora_A)[j] ||_2 as fp32 [N], detached, never forming [N, K]."""
    check_fp8_weight(w8)
    N, K = w8.shape
    scale = check_scale(scale, N)
    if not isinstance(lora_A, torch.Tensor) or lora_A.dim() != 2 or lora_A.shape[1] != K:
        raise ValueError(f"lora_A must have shape [r, {K}], got {list(getattr(lora_A, 'shape', []))}")
    _check_float(lora_A, "lora_A", (lora_A.shape[0], K))
    _check_float(lora_B, "lora_B", (N, lora_A.shape[0]))
    _check_device(w8, scale=scale, lora_A=lora_A, lora_B=lora_B)
    name = backends.resolve(backend, w8.device)
    with torch.no_grad():
        return _weight_norm_op(w8, scale, lora_A.detach(), lora_B.detach(), float(scaling), name)


def fp8_linear(x: Tensor, w8: Tensor, scale: Tensor, bias: Optional[Tensor] = None, *,
               backend: str | None = "auto") -> Tensor:
    """x (scale * w8)^T + bias without dequantizing w8 to memory; differentiable in x (and bias)."""
    check_fp8_weight(w8)
    N, K = w8.shape
    _check_x(x, K)
    scale = check_scale(scale, N)
    if bias is not None:
        _check_float(bias, "bias", (N,))
    _check_device(x, w8=w8, scale=scale, bias=bias)
    cdt = compute_dtype(x)
    name = backends.resolve(backend, x.device)
    x2d = _rows(x.reshape(-1, K).to(cdt))
    y = FP8LinearFunction.apply(x2d, w8, scale, None if bias is None else bias.to(cdt), name)
    return y.reshape(*x.shape[:-1], N)


def dora_fp8_linear(x: Tensor, w8: Tensor, scale: Tensor, lora_A: Tensor, lora_B: Tensor, magnitude: Tensor,
                    scaling: float, bias: Optional[Tensor] = None, *, dropout_p: float = 0.0, training: bool = False,
                    backend: str | None = "auto", weight_norm: Optional[Tensor] = None) -> Tensor:
    """PEFT's DoRA Linear on an fp8 base:  y = m / ||W0 + s B A||_row * (x W0^T + s (x A^T) B^T) + bias.

    x [..., K] (fp32/bf16/fp16); w8 [N, K] float8_e4m3fn with scale (fp32, per tensor or [N]); lora_A [r, K];
    lora_B [N, r]; magnitude [N]; scaling = lora_alpha / r (or / sqrt(r)). With training=True and dropout_p > 0,
    PEFT's dropout semantics: the base term sees x, the DoRA terms see dropout(x).
    weight_norm: a precomputed detached norm (fp32 [N]) to reuse, e.g. across gradient-accumulation steps; it must
    equal dorafp8.weight_norm(w8, scale, lora_A, lora_B, scaling) for the current adapter weights.
    Returns [..., N] in the compute dtype (see the module docstring). Gradients flow to x, lora_A, lora_B,
    magnitude (and bias if it requires grad); w8 and scale are frozen.
    """
    check_fp8_weight(w8)
    N, K = w8.shape
    _check_x(x, K)
    scale = check_scale(scale, N)
    if not isinstance(lora_A, torch.Tensor) or lora_A.dim() != 2:
        raise ValueError(f"lora_A must be 2-D [r, {K}], got {list(getattr(lora_A, 'shape', []))}")
    r = lora_A.shape[0]
    _check_float(lora_A, "lora_A", (r, K))
    _check_float(lora_B, "lora_B", (N, r))
    _check_float(magnitude, "magnitude", (N,))
    if bias is not None:
        _check_float(bias, "bias", (N,))
    if not isinstance(scaling, numbers.Real):
        raise TypeError(f"scaling must be a real number (lora_alpha / r), got {type(scaling).__name__}")
    if not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    _check_device(x, w8=w8, scale=scale, lora_A=lora_A, lora_B=lora_B, magnitude=magnitude, bias=bias)
    name = backends.resolve(backend, x.device)
    if weight_norm is None:
        n = _weight_norm_op(w8, scale, lora_A.detach(), lora_B.detach(), float(scaling), name)
    else:
        if not isinstance(weight_norm, torch.Tensor) or tuple(weight_norm.shape) != (N,):
            raise ValueError(f"weight_norm must be an fp32 tensor of shape [{N}], got "
                             f"{list(getattr(weight_norm, 'shape', []))}")
        n = weight_norm.detach().float()
    cdt = compute_dtype(x)
    x2d = _rows(x.reshape(-1, K).to(cdt))
    p = float(dropout_p) if training else 0.0
    y = DoRAFP8Function.apply(x2d, w8, scale, None if bias is None else bias.to(cdt), lora_A.to(cdt),
                              lora_B.to(cdt), magnitude, n, float(scaling), p, name)
    return y.reshape(*x.shape[:-1], N)
