"""The torch.library custom ops, one per backend function of the contract (dorafp8/backends/__init__.py).

Registering them makes the autograd Functions in ops/linear.py traceable by torch.compile (the kernels stay opaque, with
shapes given by the fake implementations). Custom ops cannot return None or an input, so an absent output is an empty
placeholder and the Python side knows which it is.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import backends


@torch.library.custom_op("dorafp8::weight_norm", mutates_args=())
def weight_norm_op(w8: Tensor, scale: Tensor, block: int, A: Tensor, B: Tensor, s: float, backend: str) -> Tensor:
    return backends.module(backend).weight_norm(w8, scale, block, A, B, s)


@weight_norm_op.register_fake
def _(w8, scale, block, A, B, s, backend):
    return w8.new_empty(w8.shape[0], dtype=torch.float32)


@torch.library.custom_op("dorafp8::project", mutates_args=())
def project_op(a: Tensor, b: Tensor, out_dtype: torch.dtype, mask: Optional[Tensor], p: float,
               backend: str) -> Tensor:
    return backends.module(backend).project(a, b, out_dtype, mask, p)


@project_op.register_fake
def _(a, b, out_dtype, mask, p, backend):
    return a.new_empty(a.shape[0], b.shape[0], dtype=out_dtype)


@torch.library.custom_op("dorafp8::project_grad", mutates_args=())
def project_grad_op(v: Tensor, a: Tensor, mask: Optional[Tensor], p: float, backend: str) -> Tensor:
    return backends.module(backend).project_grad(v, a, mask, p)


@project_grad_op.register_fake
def _(v, a, mask, p, backend):
    return a.new_empty(v.shape[1], a.shape[1], dtype=torch.float32)


@torch.library.custom_op("dorafp8::forward", mutates_args=())
def forward_op(x: Tensor, w8: Tensor, scale: Tensor, block: int, bias: Optional[Tensor], c: Optional[Tensor],
               u: Optional[Tensor], B: Optional[Tensor], s: float, xm: Optional[Tensor], p: float, need_z: bool,
               z_dtype: torch.dtype, act_quant: str, backend: str) -> tuple[Tensor, Tensor]:
    y, z = backends.module(backend).forward(x, w8, scale, block, bias, c, u, B, s, xm, p, need_z, z_dtype,
                                            act_quant)
    return y, (z if z is not None else x.new_empty(0))


@forward_op.register_fake
def _(x, w8, scale, block, bias, c, u, B, s, xm, p, need_z, z_dtype, act_quant, backend):
    y = x.new_empty(x.shape[0], w8.shape[0])
    want_z = need_z and c is not None
    return y, (x.new_empty(x.shape[0], w8.shape[0], dtype=z_dtype) if want_z else x.new_empty(0))


@torch.library.custom_op("dorafp8::backward_pass", mutates_args=())
def backward_pass_op(g: Tensor, z: Optional[Tensor], c: Optional[Tensor], srow: Optional[Tensor],
                     B: Optional[Tensor], u: Optional[Tensor], dropout: bool, need_dm: bool, need_dB: bool,
                     backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    out = backends.module(backend).backward_pass(g, z, c, srow, B, u, dropout, need_dm, need_dB)
    # gl / gb may be g itself (nothing to scale): returned as placeholders, the caller substitutes g.
    return tuple(g.new_empty(0) if (t is None or t is g) else t for t in out)


@backward_pass_op.register_fake
def _(g, z, c, srow, B, u, dropout, need_dm, need_dB, backend):
    M, N = g.shape
    f32 = dict(dtype=torch.float32)
    adapter = c is not None
    gl = g.new_empty(M, N) if (adapter or srow is not None) else g.new_empty(0)
    gb = g.new_empty(M, N) if (adapter and dropout and srow is not None) else g.new_empty(0)
    rb = g.new_empty((), **f32) if (adapter and dropout) else g.new_empty(0)
    v = g.new_empty(M, B.shape[1], dtype=B.dtype) if adapter else g.new_empty(0)
    dm = g.new_empty(N, **f32) if (adapter and need_dm) else g.new_empty(0)
    dB = g.new_empty(N, B.shape[1], **f32) if (adapter and need_dB) else g.new_empty(0)
    return gl, g.new_empty((), **f32), gb, rb, v, dm, g.new_empty(N, **f32), dB


@torch.library.custom_op("dorafp8::dgrad", mutates_args=())
def dgrad_op(gl: Tensor, rl: Tensor, w8: Tensor, scale: Tensor, block: int, v: Optional[Tensor],
             A: Optional[Tensor], s: float, mask: Optional[Tensor], p: float, gb: Optional[Tensor],
             rb: Optional[Tensor], act_quant: str, backend: str) -> Tensor:
    return backends.module(backend).dgrad(gl, rl, w8, scale, block, v, A, s, mask, p, gb, rb, act_quant)


@dgrad_op.register_fake
def _(gl, rl, w8, scale, block, v, A, s, mask, p, gb, rb, act_quant, backend):
    return gl.new_empty(gl.shape[0], w8.shape[1])


# Eager fast path. A call through a torch.library custom op costs tens of microseconds of Python dispatch (measured
# on CPU: ~390 calls, 24 ms of a 160 ms bf16 training step of a small diffusers UNet; bench/diffusion_cpu.py). Outside
# torch.compile, with no TorchDispatchMode active and plain tensors, the op's own implementation (the decorated
# function above: same code, same placeholders) is called directly. Under torch.compile, which needs the opaque op in
# its graph, under a dispatch mode (FakeTensorMode, dorafp8._memory.PeakTemporaries) or with tensor subclasses, the
# custom op is called as before.
_PLAIN_TENSORS = (Tensor, torch.nn.Parameter)


def eager_fast_path(op):
    impl = op._init_fn  # torch.library.custom_op keeps the decorated function here

    def call(*args):
        if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0
                or any(isinstance(a, Tensor) and type(a) not in _PLAIN_TENSORS for a in args)):
            return op(*args)
        return impl(*args)

    call.op = op
    return call


weight_norm_op, project_op, project_grad_op, forward_op, backward_pass_op, dgrad_op = map(
    eager_fast_path, (weight_norm_op, project_op, project_grad_op, forward_op, backward_pass_op, dgrad_op))
