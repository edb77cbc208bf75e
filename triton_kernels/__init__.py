"""Triton backend of dorafp8 (installed as `dorafp8.triton_kernels`): the backend contract of dorafp8/backends/base.py
through the launchers of weight_norm.py, lowrank.py, forward.py, backward.py, dgrad.py (all via _common.launch).
Runs on CUDA GPUs and under TRITON_INTERPRET=1; without Triton this module still imports and says why it cannot run."""

from __future__ import annotations

import os

import torch


def _from_triton(e: BaseException) -> bool:
    """Whether Triton raised `e`: a frame of its traceback in the triton package, or a name a triton module lacks."""
    if getattr(getattr(e, "obj", None), "__name__", "").split(".")[0] == "triton":
        return True
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_globals.get("__name__", "").split(".")[0] != "triton":
        tb = tb.tb_next
    return tb is not None


try:
    from ._common import arch_of, fp32_dots_exact_for, launch_observers, planning_for_gpu
    from .backward import backward_pass
    from .dgrad import dgrad
    from .forward import forward
    from .lowrank import project, project_grad
    from .weight_norm import weight_norm

    _IMPORT_ERROR = None
except Exception as e:  # triton missing or too old, or one whose import raises something else (a future Triton's
    # AttributeError): the backend is then unavailable, saying why, and `import dorafp8` and its other backends run.
    # An error of these modules' own code, that Triton played no part in, is raised as it is
    if not isinstance(e, ImportError) and not _from_triton(e):
        raise
    _IMPORT_ERROR = f"triton could not be imported ({type(e).__name__}: {e}); pip install 'triton>=3.6'"

    def _missing(*args, **kwargs):
        raise RuntimeError(f"dorafp8 triton backend unavailable: {_IMPORT_ERROR}")

    weight_norm = forward = dgrad = backward_pass = project = project_grad = planning_for_gpu = _missing

    def launch_observers() -> list:
        return []  # nothing launches

QUANTS_IN_PROJECT = True  # W8A8: project(quant=True) quantizes x in the same read as u; forward takes it (x8, sx)
# The fp8 features and the microscaled weights (unpacked in the GEMMs' main loop, gemm.py; W8A16 only).
SUPPORTS = frozenset({"block", "rowwise", "fp32", "fp16-row", "mxfp8", "nvfp4"})

__all__ = ["unavailable_reason", "unsupported_on", "weight_norm", "project", "project_grad", "forward",
           "backward_pass", "dgrad", "launch_observers", "planning_for_gpu"]


def _version_problem() -> str | None:
    """Why the installed Triton is not one the kernels are tested with (dorafp8/_deps.py), or None."""
    import triton

    from .._deps import untested_version

    return untested_version("triton", triton.__version__)


def interpreter_problem() -> str | None:
    """Triton 3.6's interpreter calls int() on 1-element arrays, which NumPy 2.4 refuses (every kernel failed with
    "only 0-dimensional arrays can be converted to Python scalars"); 3.7 fixed it. Compiled kernels are unaffected."""
    import numpy
    import triton

    if triton.__version__.startswith("3.6.") and tuple(map(int, numpy.__version__.split(".")[:2])) >= (2, 4):
        return (f"Triton {triton.__version__}'s interpreter does not run under NumPy {numpy.__version__} (2.4 or "
                f"newer): pip install 'numpy<2.4', or triton>=3.7")
    return None


def unavailable_reason(device: torch.device) -> str | None:
    """None if the kernels can run on tensors on `device`, else why not."""
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    if (too_old := _version_problem()) is not None:
        return too_old
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "no CUDA device is available"
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):  # Triton refuses fp8e4nv (every W8) below it: no kernel would compile
            return (f"needs an sm_89 or newer GPU (Triton compiles fp8 e4m3 for sm_89 and later only), found "
                    f"sm_{major}{minor}")
        return None
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") == "1":
            return interpreter_problem()
        return "Triton kernels need a CUDA GPU; on CPU they run only under the interpreter (TRITON_INTERPRET=1)"
    return f"Triton kernels do not run on {device.type} devices"


def unsupported_on(device: torch.device) -> dict[str, str]:
    """{feature: why} for the backend's FEATURES it cannot compute exactly on `device` under the installed Triton
    (backends.supports): fp32 compute on sm_100 under Triton 3.6 / 3.7 (_common.fp32_dots_exact_for)."""
    if _IMPORT_ERROR is not None or device.type != "cuda" or fp32_dots_exact_for(arch_of(device)):
        return {}
    import triton

    return {"fp32": f"on sm_100 under Triton {triton.__version__} (its fp32 dots run on tf32 tensor cores there; "
                    f"pip install 'triton>=3.8')"}
