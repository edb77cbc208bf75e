"""CUDA C++ backend: the backend contract of backends/base.py on the kernels of csrc/ (module dorafp8._C).

`CudaBackend` adapts the contract to a launcher with the binding's entry points: dorafp8._C on a GPU, the CPU emulator
in tests/kernels/test_cuda_emulated.py. Per-tensor and per-row scales, W8A16 only. Details: docs/ARCHITECTURE.md."""

from __future__ import annotations

import json
import os
import threading
from types import ModuleType
from typing import Optional

import torch
from torch import Tensor

from . import cuda_build
from .base import empty as _empty, magnitude_scale, not_supported


def stale(module) -> Optional[ImportError]:
    """Why an imported dorafp8._C must not run, or None. setup.py compiles the hash of the sources it built in (SOURCES);
    one that differs from this installation's csrc/ (an editable install's in-place build, then a `git pull`: kernels
    that may read their arguments another way, wrong values or a TypeError mid-run), or a build without it (older than
    the hash: its sources are unknown), is not used."""
    src = cuda_build.source_dir()
    try:
        if src is None or getattr(module, "SOURCES", None) == cuda_build.build_spec()["sources_hash"](str(src)):
            return None
    except OSError:  # sources it cannot read: trusted as before, rather than failing `import dorafp8`
        return None
    return ImportError(f"{getattr(module, '__file__', module)} was not built from the CUDA sources in {src} (a git "
                       f"pull since its build?), so it is not used; rebuild it: {BUILD_COMMAND}")


SUPPORTS = frozenset({"fp32", "fp16-row"})  # neither block scales nor W8A8: backend="auto" passes over it for those calls
# The install-time build, from a checkout (the tests' skip messages name it to developers); a wheel's user is never
# told to run it: the extension builds on first use instead (prepare).
BUILD_COMMAND = "DORAFP8_FORCE_CUDA_BUILD=1 pip install -e . --no-build-isolation"
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OLDEST = (8, 0)  # csrc/'s cp.async and bf16 mma.sync: ptxas refuses them below sm_80 (the e4m3 cvt has a fallback)
_OTHER_BACKENDS = ("triton", "reference")
_image_error: dict[int, str] = {}  # per device index: "" if the build has kernel code for it, else why not
_build_lock = threading.Lock()
_build_error: Optional[str] = None  # why the build on first use failed (it is not tried again in this process)

try:
    import dorafp8._C as _C
except ImportError as e:  # not built (CPU-only install, isolated build) or built against another torch
    _C = None
    _IMPORT_ERROR: Optional[BaseException] = e
else:
    _IMPORT_ERROR = stale(_C)
    if _IMPORT_ERROR is not None:  # backend="cuda" builds the current sources on first use instead
        _C = None
_INSTALLED = _C  # the install's build: prepare() builds for the GPU at hand where it has no kernel code for it


def build_note() -> str:
    """What setup.py decided about the extension when this installation was built: its build_ext writes that note as
    dorafp8/_build_info.json next to the extension (into the wheel, or in place for an editable install)."""
    try:
        with open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "_build_info.json")) as f:
            return json.load(f).get("cuda_extension", "")
    except (OSError, ValueError):
        return ""


def extension_status() -> str:
    """What `python -m dorafp8` says of the extension: importable, the install's note, buildable here."""
    if _C is not None:
        return "importable" + (f"; at install: {build_note()}" if build_note() else "")
    return _not_built()


def _too_old(device: torch.device) -> Optional[str]:
    """Why no build can run on this GPU (one older than OLDEST: a V100, a T4), else None."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) >= OLDEST:
        return None
    return (f"its kernels need an sm_{OLDEST[0]}{OLDEST[1]} or newer GPU (cp.async, bf16 mma.sync), found "
            f"sm_{major}{minor}; backend='auto' runs 'native' there (PyTorch's matmul in the compute dtype)")


def _not_built() -> str:
    note = build_note()
    why = _build_error or cuda_build.why_not() or _too_old(torch.device("cuda"))
    then = ("backend='cuda' builds it on first use on a GPU (nvcc: a few minutes, once per torch version and GPU)"
            if why is None else f"it cannot be built here: {why}")
    return (f"not built ({type(_IMPORT_ERROR).__name__}: {_IMPORT_ERROR}{'; at install: ' + note if note else ''}); "
            f"{then}")


def prepare(device: torch.device) -> bool:
    """Called by the registry when backend='cuda' is named: builds dorafp8._C on first use where the install did not,
    or built it for other GPUs only (cuda_build.py), and returns whether it did; a failed build raises here, and
    unavailable_reason names it from then on."""
    global _C, _IMPORT_ERROR, _build_error
    device = torch.device(device)
    if (_build_error is not None or device.type != "cuda" or not (torch.cuda.is_available() or cuda_build.forced())
            or _too_old(device) is not None):
        return False
    # An install-time build for other GPUs (TORCH_CUDA_ARCH_LIST="9.0" in a Docker build, run on an L40S) is
    # replaced like a missing one: its user may have no checkout to rebuild it in. Once only: never a second build.
    if _C is not None and (_C is not _INSTALLED or not torch.cuda.is_available() or not _no_image(device)):
        return False
    if cuda_build.why_not() is not None:
        return False
    with _build_lock:
        if _C is None or _C is _INSTALLED:
            try:
                module = cuda_build.build(device)
            except RuntimeError as e:
                _build_error = str(e)
                raise
            _C, _IMPORT_ERROR = module, None
            _backend.launcher = module
            _image_error.clear()
    return True


def unavailable_reason(device: torch.device) -> str | None:
    device = torch.device(device)
    # The device first: on CPU tensors no build could help, so do not send the user off to build one.
    if device.type != "cuda":
        return f"the CUDA backend runs on CUDA devices only, got a {device.type} device (use 'reference' or 'auto')"
    if not torch.cuda.is_available() and not (_C is None and cuda_build.forced()):
        return "torch sees no CUDA device"
    if (old := _too_old(device)) is not None:  # before the build's note: no build would help
        return f"the CUDA backend cannot run on this GPU: {old}"
    if _C is None:
        return f"the CUDA extension dorafp8._C is {_not_built()}"
    if _no_image(device):
        index = _index(device)
        major, minor = torch.cuda.get_device_capability(index)
        # What to do, never a checkout's command (a wheel's or sdist's user has none): the install's build is rebuilt
        # for this GPU on first use (prepare), once per process; else why it is not.
        why = (_build_error or (cuda_build.why_not() and f"it cannot be built here: {cuda_build.why_not()}")
               or (_C is not _INSTALLED and f"this process built it for another GPU; set DORAFP8_CUDA_ARCHS to both "
                                           f"GPUs' archs (e.g. \"{major}{minor};90a\") and start again")
               or "backend='cuda' builds it for this GPU on first use (nvcc: a few minutes, once per torch version "
                  "and GPU)")
        return f"dorafp8._C has no kernel code for this GPU (sm_{major}{minor}): {_image_error[index]}; {why}"
    return None


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _no_image(device: torch.device) -> str:
    """Why dorafp8._C cannot run on `device` (built for other archs), or "" (asked once per device)."""
    index = _index(device)
    if index not in _image_error:
        _image_error[index] = _C.kernel_image_error(index)
    return _image_error[index]


def rank_ops(device: torch.device) -> ModuleType:
    """The backend whose project, project_grad, backward_pass CUDA uses: Triton's, else reference."""
    # Chosen here, not through the registry (the package this module belongs to), so that imports only go down.
    from . import reference

    try:
        import dorafp8.triton_kernels as triton_kernels
    except Exception:  # triton missing, or failing to initialise: the registry treats both as unavailable
        return reference
    return triton_kernels if triton_kernels.unavailable_reason(device) is None else reference


def _rows(t: Tensor) -> Tensor:
    """t as a 2-D tensor with unit stride in its last dim (any row stride: the kernels take it)."""
    if t.dim() != 2:
        t = t.reshape(-1, t.shape[-1])
    return t if t.shape[1] <= 1 or t.stride(1) == 1 else t.contiguous()


def _small(t: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """A small operand (bias, c, u, B, v, A) in `dtype`, contiguous."""
    return None if t is None else t.to(dtype).contiguous()


def _rank_dtype(cdt: torch.dtype, *ts: Tensor) -> torch.dtype:
    """The dtype the kernels read the rank-r operands in: the compute dtype if they all have it, else fp32 (exact)."""
    return cdt if all(t.dtype == cdt for t in ts) else torch.float32


def _scalar(t: Tensor) -> Tensor:
    """A contract scalar (rl, rb: fp32 0-dim) as the one-element fp32 tensor the kernels read on the device."""
    return t.reshape(1).to(torch.float32).contiguous()


def _weight_scale(scale: Tensor) -> Tensor:
    """The scale as the kernels read it: fp32, 0-dim (per tensor) or [N] (per row). Block scales are refused."""
    if scale.dim() == 2:
        raise not_supported("cuda", "block", f" (scale of shape {list(scale.shape)})", _OTHER_BACKENDS)
    return scale.to(torch.float32).contiguous()


def _gemm_operands(a: Tensor, scale: Tensor, act_quant: str, out_cols: int) -> tuple[Tensor, Tensor, Tensor]:
    """The GEMM's dense operand as 2-D rows, the scale as kernels read it, and the output; refuses W8A8."""
    sc = _weight_scale(scale)
    if act_quant:
        raise not_supported("cuda", "rowwise", alternatives=_OTHER_BACKENDS)  # its kernels are W8A16
    a = _rows(a)
    return a, sc, _empty((a.shape[0], out_cols), a.dtype, a.device)


class CudaBackend:
    """The backend contract on `launcher`: dorafp8._C, or any object with its weight_norm, forward, dgrad."""

    def __init__(self, launcher):
        self.launcher = launcher

    def _launch(self):
        if self.launcher is None:
            raise RuntimeError(unavailable_reason(torch.device("cuda")) or "dorafp8._C is not available")
        return self.launcher

    # Not CUDA C++ kernels: see rank_ops.
    def project(self, a, b, out_dtype, mask, p):
        return rank_ops(a.device).project(a, b, out_dtype, mask, p)

    def project_grad(self, v, a, mask, p, s, out_dtype):
        return rank_ops(a.device).project_grad(v, a, mask, p, s, out_dtype)

    def backward_pass(self, g, z, m, n, srow, B, u, s, dropout, need_dm, need_dB, need_db=True):
        return rank_ops(g.device).backward_pass(g, z, m, n, srow, B, u, s, dropout, need_dm, need_dB, need_db)

    def weight_norm(self, w8: Tensor, scale: Tensor, block_size: int, A: Tensor, B: Tensor, s: float) -> Tensor:
        sc = _weight_scale(scale)
        N = w8.shape[0]
        adt = torch.promote_types(A.dtype, B.dtype)  # the kernel reads one adapter dtype; promotion is exact
        if adt not in _KERNEL_DTYPES:
            adt = torch.float32
        n = _empty(N, torch.float32, w8.device)
        self._launch().weight_norm(w8.contiguous(), sc, _small(A, adt), _small(B, adt), float(s), n)
        return n

    def forward(self, x: Tensor, w8: Tensor, scale: Tensor, block_size: int, bias: Optional[Tensor],
                m: Optional[Tensor], n: Optional[Tensor], u: Optional[Tensor], B: Optional[Tensor], s: float,
                xm: Optional[Tensor], p: float, need_z: bool, z_dtype: torch.dtype, act_quant: str
                ) -> tuple[Tensor, Optional[Tensor]]:
        x, sc, y = _gemm_operands(x, scale, act_quant, w8.shape[0])
        cdt = x.dtype
        if m is None:  # plain FP8 linear
            self._launch().forward(x, w8.contiguous(), sc, _small(bias, cdt), None, None, None, 0.0, None, 0.0, y,
                                   None)
            return y, None
        rdt = _rank_dtype(cdt, u, B)
        # z straight from the kernel in the compute dtype or fp32; another z_dtype is the fp32 z rounded once.
        zdt = cdt if z_dtype == cdt else torch.float32
        z = _empty(y.shape, zdt, x.device) if need_z else None
        c = magnitude_scale(m, n)  # the kernel reads c (the Triton kernels compute it themselves)
        self._launch().forward(x, w8.contiguous(), sc, _small(bias, cdt), _small(c, torch.float32), _small(u, rdt),
                               _small(B, rdt), float(s), None if xm is None else _rows(xm.to(cdt)),
                               float(p) if xm is not None else 0.0, y, z)
        if z is not None and z.dtype != z_dtype:
            z = z.to(z_dtype)
        return y, z

    def dgrad(self, gl: Tensor, rl: Tensor, w8: Tensor, scale: Tensor, block_size: int, v: Optional[Tensor],
              A: Optional[Tensor], s: float, mask: Optional[Tensor], p: float, gb: Optional[Tensor],
              rb: Optional[Tensor], act_quant: str) -> Tensor:
        gl, sc, dx = _gemm_operands(gl, scale, act_quant, w8.shape[1])
        cdt = gl.dtype
        if v is None:  # plain FP8 linear
            self._launch().dgrad(gl, _scalar(rl), w8.contiguous(), sc, None, None, 0.0, None, 0.0, None, None, dx)
            return dx
        rdt = _rank_dtype(cdt, v, A)
        if mask is None:
            gb = rb = None
        else:
            if gb is None or rb is None:
                raise ValueError("dropout (a mask) needs gb and rb, the plain base term's operand and its scalar")
            mask, gb, rb = _rows(mask.to(torch.bool)), _rows(gb.to(cdt)), _scalar(rb)
        self._launch().dgrad(gl, _scalar(rl), w8.contiguous(), sc, _small(v, rdt), _small(A, rdt), float(s), mask,
                             float(p), gb, rb, dx)
        return dx


_backend = CudaBackend(_C)
weight_norm = _backend.weight_norm
project = _backend.project
project_grad = _backend.project_grad
forward = _backend.forward
backward_pass = _backend.backward_pass
dgrad = _backend.dgrad
