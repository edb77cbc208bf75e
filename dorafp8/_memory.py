"""The memory a piece of code allocates (demo, bench, tests): on CUDA the peak above the start; on CPU
`PeakTemporaries` counts each new storage an aten op makes until it dies, dorafp8's custom ops run open."""

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
    """CPU: `with PeakTemporaries() as m: ...` then m.peak (most bytes made inside and alive at once) and m.largest.
    Counted by storage, not tensor: a view of a fresh result keeps the storage alive after the first tensor is gone."""

    def __init__(self):
        super().__init__()
        self.live, self._count, self.peak, self.largest = {}, 0, 0, 0

    @property
    def cur(self) -> int:
        """Bytes of the storages made inside and alive now."""
        self._sweep()
        return self._count

    def _sweep(self) -> None:
        dead = [key for key, (ref, _) in self.live.items() if ref.expired()]
        for key in dead:
            self._count -= self.live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "dorafp8":
            with self:
                out = open_custom_op(func, args, kwargs)
        else:
            out = func(*args, **(kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            key = st.data_ptr()
            if key in seen or st.nbytes() == 0:
                continue
            if key in self.live:
                if not self.live[key][0].expired():
                    continue  # the same storage, already counted
                self._count -= self.live.pop(key)[1]  # a dead storage's address handed out again
            # Dead storages are swept only when the count (which still holds them, so is never below the true one)
            # would pass the peak: a sweep per op made a training step quadratic in its live storages (minutes for
            # a small UNet), and a peak is only ever set after one, so the figures are those of a sweep per op.
            if self._count + st.nbytes() > self.peak:
                self._sweep()
            self.live[key] = (StorageWeakRef(st), st.nbytes())
            self._count += st.nbytes()
            self.peak = max(self.peak, self._count)
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
