"""Measuring the memory a piece of code allocates, on CPU as well as on GPU (for the demo, bench and tests). On CUDA:
the peak of `torch.cuda.max_memory_allocated` above the start. On CPU `PeakTemporaries` watches every aten op (a
TorchDispatchMode): an output whose storage no input had is a new allocation, counted until its storage dies; dorafp8's
custom ops are run open, so that the temporaries inside them count too."""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

MiB = 1024 * 1024


def open_custom_op(func, args, kwargs):
    """Runs a dorafp8 custom op's own implementation (the function torch.library wraps) on its arguments."""
    from .ops import custom_op_implementation

    bound = dict(zip((a.name for a in func._schema.arguments), args), **(kwargs or {}))
    return custom_op_implementation(func._schema.name.split("::")[1])(**bound)


class PeakTemporaries(TorchDispatchMode):
    """CPU: `with PeakTemporaries() as m: ...` then m.peak (bytes of the most tensors alive at once that were made
    inside the block) and m.largest (the largest single one). Counted by storage, not tensor: a view of a fresh result
    (linear on a 3-D input is mm then _unsafe_view) keeps the storage alive after the first tensor is gone."""

    def __init__(self):
        super().__init__()
        self.live, self.cur, self.peak, self.largest = {}, 0, 0, 0

    def _sweep(self) -> None:
        dead = [key for key, (ref, _) in self.live.items() if ref.expired()]
        for key in dead:
            self.cur -= self.live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "dorafp8":
            with self:
                out = open_custom_op(func, args, kwargs)
        else:
            out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                if isinstance(t, torch.Tensor)}
        swept = False
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            key = st.data_ptr()
            if key in seen or st.nbytes() == 0:
                continue
            if not swept:  # a dead storage's address may be handed out again: forget the dead ones first
                self._sweep()
                swept = True
            if key in self.live:
                continue
            self.live[key] = (StorageWeakRef(st), st.nbytes())
            self.cur += st.nbytes()
            self.peak = max(self.peak, self.cur)
            self.largest = max(self.largest, st.nbytes())
        return out


def peak_extra_bytes(fn, device: torch.device | str) -> int:
    """Runs fn() and returns the peak memory it allocated on top of what existed before (bytes, measured)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    with PeakTemporaries() as mode:
        fn()
    return mode.peak


def tensor_bytes(module: torch.nn.Module, predicate=lambda name, t: True) -> int:
    """Bytes held by a module's parameters and buffers (each storage counted once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for name, t in [*module.named_parameters(), *module.named_buffers()] if predicate(name, t)}
    return sum(storages.values())
