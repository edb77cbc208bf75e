"""Backend registry: which implementation of the DoRA-FP8 kernels runs.

A backend is a module implementing backends/base.py's contract. backend="auto": $DORAFP8_BACKEND if set, else on a
GPU the fastest checked backend (race.py), else resolve()'s static order. Details: docs/ARCHITECTURE.md."""

from __future__ import annotations

import os
from types import ModuleType

import torch

from . import base

BACKENDS = ("reference", "triton", "cuda", "cublas", "native")
_CHOICES = ("auto",) + BACKENDS
_loaded: dict[str, ModuleType | str] = {}
_reasons: dict[tuple[str, torch.device], str | None] = {}
_DEVICE = torch.device  # the class, as imported (_as_device's test of a device)


def check_backend_name(name: str | None) -> str:
    """Validates a backend name (None means "auto") and returns it."""
    name = "auto" if name is None else name
    if not isinstance(name, str) or name not in _CHOICES:
        raise ValueError(f"backend must be one of {list(_CHOICES)}, got {name!r}")
    return name


def _import(name: str) -> ModuleType:
    """The module of backend `name`, imported on first use (Triton and CUDA are slow to import)."""
    if name == "triton":
        import dorafp8.triton_kernels as mod  # triton_kernels/ in the repository
    elif name == "cublas":
        from . import cublas as mod
    elif name == "cuda":
        from . import cuda as mod
    elif name == "native":
        from . import native as mod
    else:
        from . import reference as mod
    return mod


def _load(name: str) -> ModuleType | str:
    """The backend's module, or a string saying why it could not be imported."""
    if name not in _loaded:
        try:
            _loaded[name] = _import(name)
        except Exception as e:  # ImportError, or triton failing to initialise
            _loaded[name] = f"backend {name!r} could not be imported: {type(e).__name__}: {e}"
    return _loaded[name]


def _as_device(device) -> torch.device:
    """`device` as a torch.device: itself if it is one (every call passes x.device; torch.device() of one makes a new
    object, ~0.4 us a time, a few times a call)."""
    return device if type(device) is _DEVICE else torch.device(device)


def unavailable_reason(name: str, device: torch.device) -> str | None:
    """None if backend `name` can run on tensors on `device`, else why not (probed once per backend and device)."""
    device = _as_device(device)
    key = (name, device)
    if key not in _reasons:
        mod = _load(name)
        _reasons[key] = mod if isinstance(mod, str) else mod.unavailable_reason(device)
    return _reasons[key]


def _prepare(name: str, device: torch.device) -> None:
    """Lets a named backend make itself ready (CUDA builds its extension), then probes it again."""
    mod = _load(name)
    prepare = None if isinstance(mod, str) else getattr(mod, "prepare", None)
    if prepare is not None:
        device = _as_device(device)
        if prepare(device):
            _reasons.pop((name, device), None)


FEATURES = frozenset(base.FEATURES)


def supports(name: str, device: torch.device | None = None) -> frozenset:
    """The FEATURES backend `name` computes (on `device`, where its module narrows them per device)."""
    mod = _load(name)
    if isinstance(mod, str):
        return base.FP8_FEATURES
    out = frozenset(getattr(mod, "SUPPORTS", base.FP8_FEATURES))
    if device is not None and hasattr(mod, "unsupported_on"):
        out -= frozenset(mod.unsupported_on(_as_device(device)))
    return out


def _why_not(name: str, feature: str, device: torch.device) -> str:
    """What the backend's unsupported_on says of `feature` on `device` (" on ...: why"), or ""."""
    mod = _load(name)
    why = mod.unsupported_on(device).get(feature) if hasattr(mod, "unsupported_on") else None
    return f" {why}" if why else ""


def resolve(name: str | None, device: torch.device, needs: frozenset = frozenset()) -> str:
    """Resolves a backend name ("auto", None or one of BACKENDS) to the backend that runs on `device`: under "auto" one
    that cannot compute what the call `needs` is passed over; a named one is used, or refused (base.not_supported)."""
    name = check_backend_name(name)
    if name == "auto":
        name = env_backend() or name
    return _resolved(name, device, needs)


def env_backend() -> str | None:
    """$DORAFP8_BACKEND, None if unset; a name not among the choices is a ValueError naming them."""
    env = os.environ.get("DORAFP8_BACKEND")
    if env and env not in _CHOICES:
        raise ValueError(f"DORAFP8_BACKEND must be one of {list(_CHOICES)}, got {env!r}")
    return env or None


def _resolved(name: str, device: torch.device, needs: frozenset) -> str:
    """resolve() once DORAFP8_BACKEND is read: the part torch.compile takes as a constant (below)."""
    if name != "auto":
        _prepare(name, device)
        reason = unavailable_reason(name, device)
        if reason is not None:
            raise RuntimeError(f"dorafp8 backend {name!r} cannot run on {device}: {reason}")
        missing = sorted(needs - supports(name, device)) if needs else []  # nothing asked: nothing to refuse
        if missing:
            raise base.not_supported(name, missing[0], _why_not(name, missing[0], device), alternatives=tuple(
                b for b in BACKENDS if unavailable_reason(b, device) is None and missing[0] in supports(b, device)))
        return name
    # The static order: triton first (autotuned); the microscaled weights go to the cuBLAS strategy first, as the
    # Triton backend's fused W4A16 / MXFP8 loop is not measured on a GPU yet (only the race picks it, after checking).
    order = ("cublas", "triton", "cuda") if needs & {"mxfp8", "nvfp4"} else ("triton", "cuda")
    for cand in order:
        if device.type == "cuda" and unavailable_reason(cand, device) is None and needs <= supports(cand, device):
            return cand
    # CPU, and a GPU no kernel backend runs on (sm_80 / sm_86: Triton compiles e4m3, and setup.py builds the
    # CUDA extension, from sm_89 on): "native", PyTorch's matmul in the compute dtype as PEFT under autocast, where
    # the fp32 reference is several times slower; the exact twin stays one name away (backend="reference").
    # Elsewhere, and for what native lacks, the reference.
    native = device.type in ("cpu", "cuda") and unavailable_reason("native", device) is None
    return "native" if native and needs <= supports("native") else "reference"


# Run as is, not traced, under torch.compile (its arguments are constants): it fills the module's caches, a side effect
# torch.compile refuses inside an activation-checkpointed region (fullgraph=True: OneTrainer's compiled blocks). The
# mark torch.compiler.assume_constant_result sets, set without it: it imports torch._dynamo, and with it FSDP, which
# `import dorafp8` leaves unimported (tests/integration/test_layout.py). Not on resolve itself: its read of
# DORAFP8_BACKEND stays traced, so that torch.compile guards on it (a changed variable recompiles, not ignored)
_resolved._dynamo_marked_constant = True


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
