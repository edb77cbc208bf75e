"""The child process of dorafp8/ops/_race.py, `python -m dorafp8 check SPEC`: each candidate backend of SPEC against
the fp32 reference backend on random inputs of SPEC's key (y and every gradient), then the passing ones timed in
interleaved rounds. It writes "dorafp8-race start C" before each run of C (so that the parent can blame the one that
hangs or crashes it) and "dorafp8-race result {C: verdict}" lines; a watchdog ends it at the time limit or when its
parent is gone."""

from __future__ import annotations

import json
import os
import threading
import time

import torch

from ..quant import quantize_e4m3, quantize_mxfp8, quantize_nvfp4
from ._race import ROOM, ROUNDS, SMALL_M, TOL, W8A8_REL, timeout_s
from .linear import dora_fp8_linear, fp8_linear, weight_norm

def _inputs(spec: dict, M: int, device: torch.device) -> dict:
    g = torch.Generator().manual_seed(M)
    N, K, r = spec["N"], spec["K"], max(spec["r"], 1)
    cdt, rdt = getattr(torch, spec["cdt"]), getattr(torch, spec["rdt"] or spec["cdt"])
    w = torch.randn(N, K, generator=g) / K ** 0.5
    gs = None
    if spec["scale"] == "nvfp4":  # the microscaled kinds by their own recipes (dorafp8/quant.py)
        w8, scale, gs = quantize_nvfp4(w)
    elif spec["scale"] == "mxfp8":
        w8, scale = quantize_mxfp8(w)
    else:
        w8, scale = quantize_e4m3(w, per_row=spec["scale"] == "row", block_size=spec["block"] or None)
    t = {"x": torch.randn(M, K, generator=g).to(cdt), "w8": w8, "scale": scale, "global_scale": gs,
         "A": (torch.randn(r, K, generator=g) / K ** 0.5).to(rdt), "B": (torch.randn(N, r, generator=g) / r).to(rdt),
         "m": torch.rand(N, generator=g) + 0.5, "gy": torch.randn(M, N, generator=g).to(cdt),
         "bias": torch.randn(N, generator=g).to(cdt) if spec["bias"] else None}
    return {k: None if v is None else v.to(device) for k, v in t.items()}


def _step(spec: dict, t: dict, backend: str) -> dict:
    """One forward + backward on `backend`: {name: tensor} of y and every gradient."""
    if spec["op"] == "norm":  # weight_norm alone (PEFT's cached norm, the convs' norms): no gradient
        return {"y": weight_norm(t["w8"], t["scale"], t["A"], t["B"], 0.5, backend=backend,
                                 block_size=spec["block"] or 128, global_scale=t["global_scale"])}
    leaves = {k: t[k].clone().requires_grad_() for k in ("x", "A", "B", "m", "bias") if t[k] is not None}
    torch.manual_seed(0)  # the same dropout mask for every backend
    kw = dict(backend=backend, block_size=spec["block"] or 128, act_quant=spec["act_quant"] or None,
              global_scale=t["global_scale"])
    if spec["op"] == "dora":
        y = dora_fp8_linear(leaves["x"], t["w8"], t["scale"], leaves["A"], leaves["B"], leaves["m"], 0.5,
                                    leaves.get("bias"), dropout_p=spec["p"], training=True, **kw)
    else:
        leaves = {k: v for k, v in leaves.items() if k in ("x", "bias")}
        y = fp8_linear(leaves["x"], t["w8"], t["scale"], leaves.get("bias"), **kw)
    y.backward(t["gy"])
    return {"y": y.detach(), **{"d" + k: v.grad for k, v in leaves.items()}}


def _wrong(spec: dict, out: dict, ref: dict) -> str | None:
    """Which output is outside the bound, and by how much; None if all are within."""
    rel = ROOM * max(TOL[spec["cdt"]], TOL.get(spec["rdt"], 0.0))
    rel = max(rel, W8A8_REL) if spec["act_quant"] else rel
    for k, r in ref.items():
        o = out.get(k)
        if o is None or o.shape != r.shape:
            return f"{k} missing or of shape {None if o is None else list(o.shape)}, expected {list(r.shape)}"
        o, r = o.double(), r.double()
        bound = rel * (r.abs() + r.abs().max())
        used = ((o - r).abs() / bound.clamp_min(1e-30)).nan_to_num(float("inf")).max().item()
        if used > 1:
            return f"{k} differs from the fp32 reference by {used:.3g}x the allowed error (rel {rel:g})"
    return None


def _watchdog(limit: float) -> None:
    """The child ends itself at the time limit, or when its parent is gone (a parent killed by SIGKILL cannot kill
    it), even while a hanging kernel blocks its main thread."""
    parent, end = int(os.environ.get("DORAFP8_RACE_PARENT") or os.getppid()), time.monotonic() + limit

    def watch():
        while time.monotonic() < end and os.getppid() == parent:
            time.sleep(0.5)
        os._exit(70)

    threading.Thread(target=watch, daemon=True, name="dorafp8-race-watchdog").start()


def _peak(device) -> int:
    """The CUDA allocator's peak so far on a GPU, in bytes; 0 elsewhere (tests/ops/test_race.py measures the CPU's)."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str]) -> int:
    """The child: checks then times spec's candidates; a line "dorafp8-race start C" before each run of C (so that
    the parent can blame the one that hangs or crashes), a line "dorafp8-race result {C: verdict}" after."""
    spec = json.loads(argv[0])
    _watchdog(timeout_s())
    device = torch.device(spec["device"])
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32
    torch.backends.cudnn.allow_tf32 = False

    def say(kind, what):
        print(f"dorafp8-race {kind} {what}", flush=True)

    shapes = [m for m in (SMALL_M, spec["M"]) if m <= spec["M"]]
    base = _peak(device)
    inputs = {M: _inputs(spec, M, device) for M in shapes}
    refs = {M: _step(spec, inputs[M], "reference") for M in shapes}
    passed = []
    for c in spec["cands"]:
        say("start", c)
        try:
            why = next((w for M in shapes for w in [_wrong(spec, _step(spec, inputs[M], c), refs[M])] if w), None)
            verdict = {"ok": why is None, "error": why}
        except torch.OutOfMemoryError as e:
            verdict = {"ok": None, "error": f"out of memory while checking ({e})"[:300]}
        except Exception as e:
            verdict = {"ok": False, "error": f"{type(e).__name__}: {e}"[:600]}
        if verdict["ok"]:
            passed.append(c)
        else:
            say("result", json.dumps({c: verdict}))
    times = {c: [] for c in passed}
    big = inputs[spec["M"]]
    for i in range(ROUNDS if len(passed) > 1 else 1):
        for c in passed[i % len(passed):] + passed[:i % len(passed)]:  # interleaved, the order rotated each round
            say("start", c)
            _sync(device)
            t0 = time.perf_counter()
            _step(spec, big, c)
            _sync(device)
            times[c].append(time.perf_counter() - t0)
    # what the check held on the GPU at most (its bound: _race.child_bytes), kept with the verdicts
    peak = {"peak_mb": round((_peak(device) - base) / 2 ** 20, 1)} if device.type == "cuda" else {}
    say("result", json.dumps({c: {"ok": True, "ms": 1e3 * sorted(ts)[len(ts) // 2], **peak}
                              for c, ts in times.items()}))
    return 0
