"""CUDA C++ backend: the backend contract of dorafp8/backends.py on the kernels of csrc/ (module dorafp8._C).

This wrapper turns the contract's Optional arguments into what the binding takes, casts the small operands (c, u, B,
v, A, bias) to the dtypes the kernels read, allocates the outputs (NaN-filled when DORAFP8_POISON=1, as the tests
set) and makes an activation contiguous only when its last dim is strided (the kernels take any row stride). The
binding (csrc/binding.cpp) checks every tensor again and launches on the current CUDA stream; the kernels and their
design notes are in csrc/dora_fp8.cu.

The extension is optional: it is built by `DORAFP8_FORCE_CUDA_BUILD=1 pip install -e . --no-build-isolation`
(or by a plain install on a machine with a GPU and nvcc); without it this backend reports why in
`unavailable_reason` and the registry falls back to the others.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch
from torch import Tensor

try:
    from dorafp8 import _C
except ImportError as e:  # not built (CPU-only install, isolated build) or built against another torch
    _C = None
    _IMPORT_ERROR: Optional[BaseException] = e
else:
    _IMPORT_ERROR = None

BUILD_COMMAND = "DORAFP8_FORCE_CUDA_BUILD=1 pip install -e . --no-build-isolation"
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_image_error: dict[int, str] = {}  # per device index: "" if the build has kernel code for it, else why not


def build_note() -> str:
    """What setup.py decided about the extension at install time (written to dorafp8/_build_info.json)."""
    try:
        with open(os.path.join(os.path.dirname(__file__), "_build_info.json")) as f:
            return json.load(f).get("cuda_extension", "")
    except (OSError, ValueError):
        return ""


def unavailable_reason(device: torch.device) -> str | None:
    device = torch.device(device)
    # The device first: on CPU tensors no build could help, so do not send the user off to build one.
    if device.type != "cuda":
        return f"the CUDA backend runs on CUDA devices only, got a {device.type} device (use 'reference' or 'auto')"
    if _C is None:
        note = build_note()
        return (f"the CUDA extension dorafp8._C is not available ({type(_IMPORT_ERROR).__name__}: {_IMPORT_ERROR}"
                f"{'; at install: ' + note if note else ''}); build it from the source tree with: {BUILD_COMMAND}")
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _image_error:
        _image_error[index] = _C.kernel_image_error(index)
    if _image_error[index]:
        major, minor = torch.cuda.get_device_capability(index)
        return (f"dorafp8._C has no kernel code for this GPU (sm_{major}{minor}): {_image_error[index]}; rebuild "
                f"with DORAFP8_CUDA_ARCHS=\"{major}{minor}\" {BUILD_COMMAND}")
    return None


# ---------------------------------------------------------------------------------------------------------- helpers

def _empty(shape, dtype: torch.dtype, device: torch.device) -> Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    if os.environ.get("DORAFP8_POISON") == "1":  # tests: a tile the kernel never writes stays NaN and fails
        out.fill_(float("nan"))
    return out


def _rows(t: Tensor) -> Tensor:
    """t as a 2-D tensor with unit stride in its last dim (any row stride: the kernels take it)."""
    if t.dim() != 2:
        t = t.reshape(-1, t.shape[-1])
    return t if t.shape[1] <= 1 or t.stride(1) == 1 else t.contiguous()


def _small(t: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """A small operand (bias, c, u, B, v, A) in `dtype`, contiguous."""
    return None if t is None else t.to(dtype).contiguous()


def _scale(scale: Tensor) -> Tensor:
    return scale.reshape(-1).to(torch.float32).contiguous()


# ---------------------------------------------------------------------------------------------------------- contract

def weight_norm(w8: Tensor, scale: Tensor, A: Tensor, B: Tensor, s: float) -> Tensor:
    N = w8.shape[0]
    adt = torch.promote_types(A.dtype, B.dtype)  # the kernel reads one adapter dtype; promotion is exact
    if adt not in _KERNEL_DTYPES:
        adt = torch.float32
    n = _empty(N, torch.float32, w8.device)
    _C.weight_norm(w8.contiguous(), _scale(scale), _small(A, adt), _small(B, adt), float(s), n)
    return n


def forward(x: Tensor, w8: Tensor, scale: Tensor, bias: Optional[Tensor], c: Optional[Tensor], u: Optional[Tensor],
            B: Optional[Tensor], s: float, xd: Optional[Tensor], need_z: bool) -> tuple[Tensor, Optional[Tensor]]:
    x = _rows(x)
    cdt = x.dtype
    M, N = x.shape[0], w8.shape[0]
    y = _empty((M, N), cdt, x.device)
    if c is None:  # plain FP8 linear
        _C.forward(x, w8.contiguous(), _scale(scale), _small(bias, cdt), None, None, None, 0.0, None, y, None)
        return y, None
    z = _empty((M, N), cdt, x.device) if need_z else None
    _C.forward(x, w8.contiguous(), _scale(scale), _small(bias, cdt), _small(c, torch.float32), _small(u, cdt),
               _small(B, cdt), float(s), None if xd is None else _rows(xd), y, z)
    return y, z


def dgrad(g: Tensor, w8: Tensor, scale: Tensor, c: Optional[Tensor], v: Optional[Tensor], A: Optional[Tensor],
          s: float, mask: Optional[Tensor], p: float) -> Tensor:
    g = _rows(g)
    cdt = g.dtype
    M, K = g.shape[0], w8.shape[1]
    sc = _scale(scale)
    # With per-row scales the kernel keeps max |scale| out of the 16-bit g operand (fp16 g times a small scale would
    # underflow) and folds only scale_n / max into it.
    scale_ref = sc.abs().amax().reshape(1) if sc.numel() > 1 else sc
    dx = _empty((M, K), cdt, g.device)
    if c is None:
        _C.dgrad(g, w8.contiguous(), sc, scale_ref, None, None, None, 0.0, None, 0.0, dx)
        return dx
    _C.dgrad(g, w8.contiguous(), sc, scale_ref, _small(c, torch.float32), _small(v, cdt), _small(A, cdt), float(s),
             None if mask is None else _rows(mask.to(torch.bool)), float(p), dx)
    return dx
