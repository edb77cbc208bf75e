"""The torch.library custom ops, one per backend function of the contract (backends/base.py), so that torch.compile
traces the autograd Functions (the kernels stay opaque, shaped by the fake implementations). Custom ops cannot
return None or an input: an absent output is an empty placeholder. Arguments only a DoRA call uses have defaults."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import backends
from ..quant import scale_kind, weight_dims


@torch.library.custom_op("dorafp8::weight_norm", mutates_args=())
def weight_norm_op(w8: Tensor, scale: Tensor, A: Tensor, B: Tensor, s: float, block_size: int, backend: str,
                   global_scale: Optional[Tensor] = None) -> Tensor:
    return backends.module(backend).weight_norm(w8=w8, scale=scale, block_size=block_size, A=A, B=B, s=s,
                                                **_global(global_scale))


def _global(global_scale) -> dict:
    """NVFP4's global scale as the backends take it (base.py, GLOBAL_SCALE_PARAMS): only when there is one."""
    return {} if global_scale is None else {"global_scale": global_scale}


@weight_norm_op.register_fake
def _(w8, scale, A, B, s, block_size, backend, global_scale=None):
    return w8.new_empty(w8.shape[0], dtype=torch.float32)


@torch.library.custom_op("dorafp8::project", mutates_args=())
def project_op(a: Tensor, b: Tensor, out_dtype: torch.dtype, mask: Optional[Tensor], p: float,
               backend: str) -> Tensor:
    return backends.module(backend).project(a=a, b=b, out_dtype=out_dtype, mask=mask, p=p)


@project_op.register_fake
def _(a, b, out_dtype, mask, p, backend):
    return a.new_empty(a.shape[0], b.shape[0], dtype=out_dtype)


@torch.library.custom_op("dorafp8::project_quant", mutates_args=())
def project_quant_op(a: Tensor, b: Tensor, out_dtype: torch.dtype, mask: Optional[Tensor], p: float,
                     backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """(u, a8, sa): project plus a's W8A8 row quantization from the same read (QUANTS_IN_PROJECT)."""
    return backends.module(backend).project(a=a, b=b, out_dtype=out_dtype, mask=mask, p=p, quant=True)


@project_quant_op.register_fake
def _(a, b, out_dtype, mask, p, backend):
    M = a.shape[0]
    return (a.new_empty(M, b.shape[0], dtype=out_dtype), a.new_empty(M, a.shape[1], dtype=torch.float8_e4m3fn),
            a.new_empty(M, dtype=torch.float32))


@torch.library.custom_op("dorafp8::project_grad", mutates_args=())
def project_grad_op(v: Tensor, a: Tensor, mask: Optional[Tensor], p: float, s: float, out_dtype: torch.dtype,
                    backend: str) -> Tensor:
    return backends.module(backend).project_grad(v=v, a=a, mask=mask, p=p, s=s, out_dtype=out_dtype)


@project_grad_op.register_fake
def _(v, a, mask, p, s, out_dtype, backend):
    return a.new_empty(v.shape[1], a.shape[1], dtype=out_dtype)


def _kept(weight, weight_fac) -> dict:
    """The kept dequantized weight as the backends take it (base.py, KEEP_WEIGHT_PARAMS): only when there is one."""
    return {} if weight is None else {"weight": weight, "weight_fac": weight_fac}


@torch.library.custom_op("dorafp8::dequant", mutates_args=())
def dequant_op(w8: Tensor, scale: Tensor, block_size: int, dtype: torch.dtype, backend: str,
               global_scale: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(W, fac): the weight in `dtype` and its epilogues' factors, once a step (KEEPS_WEIGHT)."""
    return backends.module(backend).dequantize(w8=w8, scale=scale, block_size=block_size, dtype=dtype,
                                               **_global(global_scale))


@dequant_op.register_fake
def _(w8, scale, block_size, dtype, backend, global_scale=None):
    N, K = weight_dims(w8)
    rows = scale_kind(scale) == "row"  # a row scale's fac: N + 1
    return w8.new_empty(N, K, dtype=dtype), w8.new_empty(N + 1 if rows else 2, dtype=torch.float32)


@torch.library.custom_op("dorafp8::forward", mutates_args=())
def forward_op(x: Tensor, w8: Tensor, scale: Tensor, bias: Optional[Tensor], block_size: int, act_quant: str,
               backend: str, m: Optional[Tensor] = None, n: Optional[Tensor] = None, u: Optional[Tensor] = None,
               B: Optional[Tensor] = None, s: float = 0.0, xm: Optional[Tensor] = None, p: float = 0.0,
               need_z: bool = False, x8: Optional[Tensor] = None, sx: Optional[Tensor] = None,
               global_scale: Optional[Tensor] = None, weight: Optional[Tensor] = None,
               weight_fac: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """The plain FP8 linear leaves the DoRA arguments at their defaults. z, when wanted, has the compute dtype. x8, sx:
    project_quant_op's (QUANTS_IN_PROJECT); weight, weight_fac: dequant_op's (KEEPS_WEIGHT)."""
    extra = {"x8": x8, "sx": sx} if x8 is not None else {}
    extra.update(_global(global_scale))
    extra.update(_kept(weight, weight_fac))
    y, z = backends.module(backend).forward(
        x=x, w8=w8, scale=scale, block_size=block_size, bias=bias, m=m, n=n, u=u, B=B, s=s, xm=xm, p=p,
        need_z=need_z, z_dtype=x.dtype, act_quant=act_quant, **extra)
    return y, (z if z is not None else x.new_empty(0))


@forward_op.register_fake
def _(x, w8, scale, bias, block_size, act_quant, backend, m=None, n=None, u=None, B=None, s=0.0, xm=None, p=0.0,
      need_z=False, x8=None, sx=None, global_scale=None, weight=None, weight_fac=None):
    y = x.new_empty(x.shape[0], w8.shape[0])
    want_z = need_z and m is not None
    return y, (x.new_empty(x.shape[0], w8.shape[0]) if want_z else x.new_empty(0))


@torch.library.custom_op("dorafp8::backward_pass", mutates_args=())
def backward_pass_op(g: Tensor, srow: Optional[Tensor], backend: str, z: Optional[Tensor] = None,
                     m: Optional[Tensor] = None, n: Optional[Tensor] = None, B: Optional[Tensor] = None,
                     u: Optional[Tensor] = None, s: float = 0.0, dropout: bool = False, need_dm: bool = False,
                     need_dB: bool = False, need_db: bool = True
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The plain FP8 linear leaves the DoRA arguments (z, m, n, B, u, s, dropout, need_dm, need_dB) at their
    defaults. Returns (gl, rs, gb, v, dm, db, dB), absent ones (db without need_db) as empty placeholders."""
    out = backends.module(backend).backward_pass(g=g, z=z, m=m, n=n, srow=srow, B=B, u=u, s=s, dropout=dropout,
                                                 need_dm=need_dm, need_dB=need_dB, need_db=need_db)
    # gl / gb may be g itself (nothing to scale): returned as placeholders, the caller substitutes g.
    return tuple(g.new_empty(0) if (t is None or t is g) else t for t in out)


@backward_pass_op.register_fake
def _(g, srow, backend, z=None, m=None, n=None, B=None, u=None, s=0.0, dropout=False, need_dm=False, need_dB=False,
      need_db=True):
    M, N = g.shape
    adapter = m is not None
    gl = g.new_empty(M, N) if (adapter or srow is not None) else g.new_empty(0)
    gb = g.new_empty(M, N) if (adapter and dropout and srow is not None) else g.new_empty(0)
    v = g.new_empty(M, B.shape[1], dtype=B.dtype) if adapter else g.new_empty(0)
    dm = g.new_empty(N, dtype=m.dtype) if (adapter and need_dm) else g.new_empty(0)
    dB = g.new_empty(N, B.shape[1], dtype=B.dtype) if (adapter and need_dB) else g.new_empty(0)
    return gl, g.new_empty(2, dtype=torch.float32), gb, v, dm, g.new_empty(N if need_db else 0), dB


@torch.library.custom_op("dorafp8::dgrad", mutates_args=())
def dgrad_op(gl: Tensor, rl: Tensor, w8: Tensor, scale: Tensor, block_size: int, act_quant: str, backend: str,
             v: Optional[Tensor] = None, A: Optional[Tensor] = None, s: float = 0.0, mask: Optional[Tensor] = None,
             p: float = 0.0, gb: Optional[Tensor] = None, rb: Optional[Tensor] = None,
             global_scale: Optional[Tensor] = None, weight: Optional[Tensor] = None,
             weight_fac: Optional[Tensor] = None) -> Tensor:
    """The plain FP8 linear leaves the DoRA arguments (v, A, s, mask, p, gb, rb) at their defaults. weight,
    weight_fac: the forward's dequant_op results, kept (a backend with KEEPS_WEIGHT)."""
    return backends.module(backend).dgrad(gl=gl, rl=rl, w8=w8, scale=scale, block_size=block_size, v=v, A=A, s=s,
                                          mask=mask, p=p, gb=gb, rb=rb, act_quant=act_quant, **_global(global_scale),
                                          **_kept(weight, weight_fac))


@dgrad_op.register_fake
def _(gl, rl, w8, scale, block_size, act_quant, backend, v=None, A=None, s=0.0, mask=None, p=0.0, gb=None, rb=None,
      global_scale=None, weight=None, weight_fac=None):
    return gl.new_empty(gl.shape[0], weight_dims(w8)[1])


# Eager fast path: a custom-op call costs tens of microseconds (bench/diffusion_cpu.py), so outside torch.compile,
# dispatch modes and tensor subclasses the op's own implementation is called directly. The arguments' exact types
# are checked against this set (a C-level check, a quarter of a Python loop's time): a tensor subclass, or anything
# else not listed, takes the op.
_PLAIN_TYPES = frozenset({Tensor, torch.nn.Parameter, type(None), bool, int, float, str, torch.dtype})


def eager_fast_path(op):
    impl = op._init_fn  # torch.library.custom_op keeps the decorated function here

    def call(*args, **kwargs):
        if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0
                or not (_PLAIN_TYPES.issuperset(map(type, args))
                        and _PLAIN_TYPES.issuperset(map(type, kwargs.values())))):
            return op(*args, **kwargs)
        return impl(*args, **kwargs)

    return call


_OPS = (weight_norm_op, project_op, project_quant_op, project_grad_op, forward_op, backward_pass_op, dgrad_op,
        dequant_op)
_IMPLEMENTATIONS = {op._name: op._init_fn for op in _OPS}


def custom_op_implementation(name: str):
    """The Python implementation of custom op dorafp8::<name> (what a dispatch mode that opens the ops runs)."""
    return _IMPLEMENTATIONS[name]


(weight_norm_op, project_op, project_quant_op, project_grad_op, forward_op, backward_pass_op, dgrad_op,
 dequant_op) = map(eager_fast_path, _OPS)
