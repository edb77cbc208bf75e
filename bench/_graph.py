"""A layer's forward + backward captured in a CUDA graph, checked against an eager call before it is timed (issue 52:
every dorafp8 call was host-bound at small M; a graph replays the step without the host's Python and launches).

`captured(forward, params, x, dy)` warms the step up eagerly (compiles, autotuning, backend="auto"'s check), captures
one forward + backward on static inputs, puts new values into them, and compares the graph's replay with an eager call
on those values: y, x's gradient and each parameter's. A difference beyond the dtype's tolerance raises GraphMismatch
naming the tensor, before anything is timed. `graph=` takes a stand-in (EagerGraph: the CPU smoke and tests)."""

from __future__ import annotations

import contextlib
import time

import torch

# |replay - eager| / max |eager| allowed: the same kernels run in both, so only a reduction's order may differ
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}


class GraphMismatch(AssertionError):
    """The replay of a captured step differs from an eager call: a graph that must not be timed."""


class CudaGraph:
    """torch.cuda.CUDAGraph: the only CUDA-only lines."""

    def __init__(self):
        self.graph = torch.cuda.CUDAGraph()

    def warm(self, fn):  # on a side stream, as torch's docs capture: nothing of the warm-up left on the capture's
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)

    def capture(self):
        return torch.cuda.graph(self.graph)

    def replay(self):
        self.graph.replay()


class EagerGraph:
    """A stand-in without CUDA: capture runs the step eagerly and keeps it; replay runs it again, writing the static
    outputs in place as a graph's replay does. `stale=True` replays nothing (a graph that baked its inputs in)."""

    def __init__(self, stale: bool = False):
        self.step, self.stale = None, stale

    def warm(self, fn):
        fn()

    def capture(self):
        return contextlib.nullcontext()

    def replay(self):
        if not self.stale:
            new = self.step()
            with torch.no_grad():
                for out, t in zip(self.outputs, new):
                    out.copy_(t)


def _step(forward, x, params, dy) -> list:
    """One forward + backward into fresh gradients: [y, x.grad, *p.grad]."""
    for t in (x, *params):
        t.grad = None
    y = forward(x)
    y.backward(dy)
    return [y.detach(), x.grad, *(p.grad for p in params)]


def captured(forward, params: list, x: torch.Tensor, dy: torch.Tensor, graph=None, warmup: int = 3):
    """(replay, capture seconds): `replay()` runs the captured step; checked first (module docstring)."""
    graph = graph or CudaGraph()
    sx, sdy = x.detach().clone().requires_grad_(), dy.detach().clone()
    for _ in range(warmup):  # everything that compiles, tunes or checks, outside the capture
        graph.warm(lambda: _step(forward, sx, params, sdy))
    sync(x.device)
    t0 = time.perf_counter()
    for t in (sx, *params):  # the capture allocates the gradients in the graph's pool: replays write them
        t.grad = None
    with graph.capture():
        y = forward(sx)
        y.backward(sdy)
    outputs = [y.detach(), sx.grad, *(p.grad for p in params)]
    sync(x.device)
    capture_s = time.perf_counter() - t0
    graph.step, graph.outputs = (lambda: _step(forward, sx, params, sdy)), outputs
    check(forward, params, sx, sdy, graph, outputs, x, dy)
    return graph.replay, capture_s


def check(forward, params, sx, sdy, graph, outputs, x, dy) -> None:
    """New values into the static inputs (x's rows reversed, dy's rolled, both scaled), the eager step on them (autograd.grad:
    no .grad written), then one replay; raises GraphMismatch naming every tensor beyond TOL."""
    with torch.no_grad():
        sx.copy_(x.flip(0) * 0.5)
        sdy.copy_(dy.roll(1, 0) * 3.0)  # not x's permutation nor its inverse scale: every gradient changes
    y = forward(sx)
    want = [y.detach(), *torch.autograd.grad(y, [sx, *params], sdy)]
    graph.replay()
    sync(x.device)
    names = ["y", "dx"] + [f"grad of parameter {i} {list(p.shape)}" for i, p in enumerate(params)]
    bad = []
    for name, got, ref in zip(names, outputs, want):
        err = (got.float() - ref.float()).abs().max().item() / max(ref.float().abs().max().item(), 1e-30)
        if not err <= TOL.get(ref.dtype, 1e-2):  # NaN fails too
            bad.append(f"{name}: max |replay - eager| / max |eager| = {err:.3g} > {TOL.get(ref.dtype, 1e-2):g}")
    if bad:
        raise GraphMismatch("the CUDA graph's replay differs from an eager call (not timed): " + "; ".join(bad))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_replays(replay, n: int, device: torch.device) -> dict:
    """The replays' time per step: n back to back then one sync (wall), and the host's time to enqueue one."""
    replay()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        replay()
    enqueue = time.perf_counter() - t0
    sync(device)
    wall = time.perf_counter() - t0
    return {"replay_us": wall / n * 1e6, "replay_enqueue_us": enqueue / n * 1e6}
