"""Counting the GPU kernels a piece of code launches and the bytes they move, on CPU as well as on GPU (for the tests
and bench/glue_cpu.py): `LaunchRecorder` and `dry_run`. The bytes are a model (docs/ARCHITECTURE.md)."""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from . import triton_kernels
from ._memory import open_custom_op

MiB = 1024 * 1024

# aten ops that allocate without writing, or that only reinterpret a tensor: no kernel on a GPU.
# (_unsafe_view is a view that its schema does not declare as one: aten's own reshape of a fresh result.)
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh",
              "_local_scalar_dense", "_unsafe_view"}
# aten ops whose result the host waits for: a sync that drains the launch queue and breaks CUDA graph capture.
_SYNCS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "allclose", "masked_select",
          "_assert_async", "unique", "_unique2"}


def _is_view(func) -> bool:
    """The op's results alias its inputs without writing them (view, select, t, detach, ...)."""
    rets = func._schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)


@dataclass
class Launch:
    name: str   # "triton:dora_fwd_kernel" or "aten:mul.Tensor"
    nbytes: int  # the model: each distinct tensor it reads or writes, once
    shapes: list = field(default_factory=list)  # (shape, dtype) of each tensor counted
    flops: int = 0  # a matrix product's 2 m n k (aten mm, addmm, bmm); 0 for every other op and the Triton kernels


# Matrix products among the aten ops: their FLOPs are recorded (kernel_report.predict times them), and in a dry run
# their result is allocated rather than computed (at the shapes a dry run plans for, a CPU matmul takes minutes).
_MATMULS = {"mm", "addmm", "bmm"}


def _matmul_flops(name, args) -> int:
    a, b = (args[1], args[2]) if name == "addmm" else (args[0], args[1])
    return 2 * a.numel() * b.shape[-1]


def _origin() -> str:
    """The innermost dorafp8 frame of the caller as file:function, the file named from its module (triton_kernels/
    installs as dorafp8.triton_kernels: its path on disk need not hold "dorafp8/"), or "torch"."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if (module == "dorafp8" or module.startswith("dorafp8.")) and module != __name__:
            path = module.partition(".")[2].replace(".", "/")
            if os.path.basename(frame.f_code.co_filename) == "__init__.py":
                path = f"{path}/__init__" if path else "__init__"
            return f"{path}.py:{frame.f_code.co_name}"
        frame = frame.f_back
    return "torch"


class LaunchRecorder(TorchDispatchMode):
    """`with LaunchRecorder() as rec: ...`, then rec.launches, rec.syncs (host syncs), rec.nbytes, rec.names(), and
    rec.ops: every aten op outside the Triton launches, views and allocations too (each costs a GPU's host some
    microseconds of enqueue), as (op, origin): the innermost dorafp8 frame (file:function), or "torch" (autograd's)."""

    def __init__(self):
        super().__init__()
        self.launches: list[Launch] = []
        self.syncs: list[str] = []
        self.ops: list[tuple[str, str]] = []
        self._skip = False
        self._depth = 0  # the mode is re-entered to open dorafp8's custom ops: observe launches once

    # Triton launches (observer of triton_kernels._common.launch)
    def _observe(self, kernel, grid, args, kwargs):
        fn = kernel
        while not hasattr(fn, "__name__") and hasattr(fn, "fn"):  # Autotuner -> JITFunction -> function
            fn = fn.fn
        name = getattr(getattr(fn, "fn", fn), "__name__", type(kernel).__name__)
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        self._record(f"triton:{name}", tensors)
        if not self._skip:
            # Launched here, outside the mode: the interpreter's own tensor copies are not the kernel's launches.
            with _disable_current_modes():
                kernel[grid](*args, **kwargs)
        return True  # launched (or, in a dry run, skipped) here

    def _record(self, name, tensors, flops=0):
        counted = {}  # the distinct tensors (by address, element count and dtype), each once
        for t in tensors:
            counted.setdefault((t.data_ptr() if t.device.type != "meta" else id(t), t.numel(), t.dtype), t)
        self.launches.append(Launch(name, sum(t.numel() * t.element_size() for t in counted.values()),
                                    [(tuple(t.shape), t.dtype) for t in counted.values()], flops))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "dorafp8":
            with self:
                return open_custom_op(func, args, kwargs)
        # Inside the custom ops the mode also sees composite ops (contiguous, to, reshape) before they decompose:
        # decompose them here, so that what they do (a copy, or nothing) reaches the mode as the ops that do it.
        with self:  # (the mode is off inside its own handler: back on for the decomposition's ops)
            out = func.decompose(*args, **(kwargs or {}))
        if out is not NotImplemented:
            return out
        name = func._schema.name.split("::")[1]
        if self._skip and name in _MATMULS:  # a dry run: the product's shape, not its values (see _MATMULS)
            meta = func(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args], **(kwargs or {}))
            out = torch.empty(meta.shape, dtype=meta.dtype, device=args[0].device)
        else:
            out = func(*args, **(kwargs or {}))
        self.ops.append((str(func), _origin()))
        if name in _SYNCS:
            self.syncs.append(str(func))
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        if name not in _NO_KERNEL and not _is_view(func) and tensors:
            self._record(f"aten:{name}.{func._overloadname}", tensors,
                         _matmul_flops(name, args) if name in _MATMULS else 0)
        return out

    def __enter__(self):
        if self._depth == 0:
            triton_kernels.launch_observers().append(self._observe)
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._depth -= 1
            if self._depth == 0:
                triton_kernels.launch_observers().remove(self._observe)

    @property
    def nbytes(self) -> int:
        return sum(launch.nbytes for launch in self.launches)

    def names(self) -> list[str]:
        return [launch.name for launch in self.launches]

    def table(self) -> str:
        """One line per launch: its name, its modelled bytes and the tensors counted."""
        rows = [f"{i:3d}  {launch.name:40s} {launch.nbytes / MiB:10.2f} MiB  "
                + ", ".join(f"{list(s)} {str(d).replace('torch.', '')}" for s, d in launch.shapes)
                for i, launch in enumerate(self.launches)]
        return "\n".join(rows + [f"     total {len(self.launches)} launches, {self.nbytes / MiB:.2f} MiB"])


@contextlib.contextmanager
def dry_run(rec: LaunchRecorder, sms: int = 132, blocks: int = 2):
    """Inside `with rec:`: the Triton launches are recorded, not run, with the launchers' GPU choices for `sms` SMs
    holding `blocks` blocks each (see the module docstring). What the kernels would have written is left unwritten."""
    prev = rec._skip
    rec._skip = True
    with triton_kernels.planning_for_gpu(sms, blocks):
        try:
            yield rec
        finally:
            rec._skip = prev
