"""Backend registry: which implementation of the three DoRA-FP8 kernels runs.

Every backend is a module exposing the same three functions (the contract below) plus
`unavailable_reason(device) -> str | None`. The autograd Functions in `dorafp8.ops` do everything else
(dropout, the rank-r skinny GEMMs, dm/dA/dB) in PyTorch, identically for all backends, so a backend is
exactly the work that touches the [N, K] fp8 weight.

Backend contract (shapes: x [M, K], w8 [N, K], rank r; "cdt" = the compute dtype, one of fp32/bf16/fp16,
which x, u, v, g, A, B and bias already have; all accumulation in fp32):

  weight_norm(w8, scale, A, B, s) -> n
      n[j] = || scale_j * w8[j, :] + s * (B @ A)[j, :] ||_2, fp32 [N]. A [r, K] and B [N, r] in any float
      dtype (upcast in-kernel). Never materializes [N, K].

  forward(x, w8, scale, bias, c, u, B, s, xd, need_z) -> (y, z)
      c is None: plain FP8 linear, y = x W0^T + bias, z is None (u, B, xd are None).
      c [N] fp32, u [M, r] cdt (= xd A^T), B [N, r] cdt:
        no dropout (xd is None): y = c * (x W0^T + s u B^T) + bias
        dropout:                 y = x W0^T + bias + (c - 1) * (xd W0^T) + c * s u B^T
      z = xd W0^T + s u B^T (xd = x without dropout) if need_z else None. y, z are [M, N] cdt.

  dgrad(g, w8, scale, c, v, A, s, mask, p) -> dx
      c is None: dx = g W0 (v, A, mask are None).
      v [M, r] cdt (= (g * c) B), A [r, K] cdt:
        no dropout (mask is None): dx = (g * c) W0 + s v A
        dropout (mask bool [M, K], keep prob 1 - p): dx = g W0 + mask / (1 - p) * ((g * (c - 1)) W0 + s v A)
      dx is [M, K] cdt.

  where W0 = scale * w8 (scale fp32, shape [] / [1] per tensor or [N] per row), bias [N] cdt or None,
  and M >= 1 (the caller handles empty batches). x, xd, g have unit stride in their last dim (any row stride).

Selection: backend="auto" (or None) means $DORAFP8_BACKEND if set, else the fastest backend that can run on the
tensors' device: triton > cuda > reference on a GPU (triton first until GPU measurements say otherwise;
see bench/results/), reference on CPU. A backend asked for by name (argument or
environment) that cannot run raises with the reason; under "auto" an unavailable backend is skipped quietly.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

BACKENDS = ("reference", "triton", "cuda")
_CHOICES = ("auto",) + BACKENDS
# Which module implements each backend (imported lazily: triton and the CUDA extension are optional).
_MODULES = {
    "reference": "dorafp8.reference",
    "triton": "dorafp8.triton_kernels",
    "cuda": "dorafp8.cuda_backend",
}
_loaded: dict[str, ModuleType | str] = {}


def check_backend_name(name: str | None) -> str:
    """Validates a backend name (None means "auto") and returns it."""
    name = "auto" if name is None else name
    if not isinstance(name, str) or name not in _CHOICES:
        raise ValueError(f"backend must be one of {list(_CHOICES)}, got {name!r}")
    return name


def _load(name: str) -> ModuleType | str:
    """The backend's module, or a string saying why it could not be imported."""
    if name not in _loaded:
        try:
            _loaded[name] = importlib.import_module(_MODULES[name])
        except Exception as e:  # ImportError, or triton failing to initialise
            _loaded[name] = f"backend {name!r} could not be imported: {type(e).__name__}: {e}"
    return _loaded[name]


def unavailable_reason(name: str, device: torch.device) -> str | None:
    """None if backend `name` can run on tensors on `device`, else why not."""
    mod = _load(name)
    if isinstance(mod, str):
        return mod
    return mod.unavailable_reason(torch.device(device))


def resolve(name: str | None, device: torch.device) -> str:
    """Resolves a backend name ("auto", None or one of BACKENDS) to the concrete backend that runs on `device`."""
    name = check_backend_name(name)
    if name == "auto":
        env = os.environ.get("DORAFP8_BACKEND")
        if env:
            if env not in _CHOICES:
                raise ValueError(f"DORAFP8_BACKEND must be one of {list(_CHOICES)}, got {env!r}")
            name = env
    if name != "auto":
        reason = unavailable_reason(name, device)
        if reason is not None:
            raise RuntimeError(f"dorafp8 backend {name!r} cannot run on {device}: {reason}")
        return name
    # No GPU measurement has ranked triton against cuda yet; triton's kernels are autotuned, so it goes first.
    for cand in ("triton", "cuda"):
        if device.type == "cuda" and unavailable_reason(cand, device) is None:
            return cand
    return "reference"


def module(name: str) -> ModuleType:
    """The module implementing a concrete (already resolved) backend."""
    mod = _load(name)
    if isinstance(mod, str):
        raise RuntimeError(mod)
    return mod


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Names of the backends that can run on `device`."""
    device = torch.device(device)
    return [b for b in BACKENDS if unavailable_reason(b, device) is None]
