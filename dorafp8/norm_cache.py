"""When a DoRA layer may reuse its weight norm: on CPU while the adapters equal the copies taken with it; on a GPU
only inside `reuse_weight_norms()`. Why: docs/ARCHITECTURE.md; docs/DORA_MATH.md, "The weight-norm cache"."""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Hashable, Optional

import torch

from ._env import ThreadSwitch, capturing

_optimizer_steps = 0
_step_hooks = None
_REUSE = ThreadSwitch()  # reuse_weight_norms() open in this thread
_CAPTURE_WARNED: list = []  # the capture warning, once a process
CAPTURE_WARNING = ("dorafp8: reuse_weight_norms() is open during a CUDA graph capture: the weight norm is computed "
                   "inside the graph (each replay recomputes it from the adapters' current values) and none is reused "
                   "or cached; a reused norm would be baked into the graph and stale after the next optimizer step")


def _count_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


def _watch_optimizer_steps() -> None:
    """Counts every torch.optim.Optimizer step, before and after it (a step that raises half-way counts too)."""
    global _step_hooks
    if _step_hooks is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        _step_hooks = (register_optimizer_step_pre_hook(_count_step), register_optimizer_step_post_hook(_count_step))


@contextlib.contextmanager
def reuse_weight_norms():
    """Lets DoRA layers on a GPU reuse their weight norms while the context is open (on the CPU they always may).

    Inside it a layer recomputes its norm only after an optimizer step or an in-place op on its tensors; a write neither
    sees (`p.data.copy_(...)`, an EMA swap through `.data`, a custom kernel) must not happen while it is open. Use it
    around the micro-batches of a gradient-accumulation step or around generation. Nests; per thread. During a CUDA
    graph capture nothing is reused or cached (the graph computes the norm on each replay; a warning says so once)."""
    with _REUSE.on():
        yield


def _identity(t: torch.Tensor) -> tuple:
    return t._version, t.data_ptr(), t.dtype, t.device, tuple(t.shape)


class WeightNormCache:
    """One layer's cached norms, one entry per adapter: (key, n, copies of the tensors the key cannot vouch for)."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple] = {}

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def norm(self, adapter: str, compute: Callable[[], torch.Tensor], A: torch.Tensor, B: torch.Tensor,
             weight: torch.Tensor, scale: torch.Tensor, extra: Hashable = (), sharded: bool = False,
             global_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`compute()` (the norm of the current tensors), or the cached norm where it provably equals it. `global_scale`:
        NVFP4's second scale (None for every other kind), keyed like the weight: a load that rewrites it alone counts."""
        on_cpu = A.device.type == "cpu"
        if torch.compiler.is_compiling():  # nothing cached or dropped: torch.compile refuses that side effect inside an
            return compute()  # activation-checkpointed region; an entry left here is proved by the next eager call
        if sharded or not (on_cpu or _REUSE):
            self._entries.pop(adapter, None)  # never keep a norm that no later call could prove current
            return compute()
        if not on_cpu and capturing():  # a graph replays without Python: no proof of a cached norm could run then
            if not _CAPTURE_WARNED:
                _CAPTURE_WARNED.append(True)
                warnings.warn(CAPTURE_WARNING, stacklevel=3)
            return compute()
        _watch_optimizer_steps()
        key = (_optimizer_steps, extra) + tuple(_identity(t) for t in (A, B, weight, scale))
        if global_scale is not None:
            key += (_identity(global_scale),)
        hit = self._entries.get(adapter)
        # A norm made under torch.inference_mode (an evaluation before training) cannot be saved by autograd outside
        # it: recomputed there, as PEFT's own DoRA would.
        usable = hit is not None and (torch.is_inference_mode_enabled() or not hit[1].is_inference())
        if usable and hit[0] == key and _same_values(hit[2], (A, B, scale)):
            return hit[1]
        n = compute()
        # On the CPU the values themselves are the proof (see the module docstring); the fp8 weight is frozen and
        # written only by dorafp8's own module methods (load, merge), which replace or copy_ it: the key sees those.
        copies = tuple(t.detach().clone() for t in (A, B, scale)) if on_cpu else None
        self._entries[adapter] = (key, n, copies)
        return n


def _same_values(copies: Optional[tuple], tensors: tuple) -> bool:
    # torch.equal is False for NaN, so a NaN adapter recomputes every call (and n is NaN there anyway).
    return copies is None or all(torch.equal(c, t) for c, t in zip(copies, tensors))
