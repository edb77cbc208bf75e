"""The child process of backends/race.py, `python -m dorafp8 check SPEC`: each candidate backend against the fp32
reference on random inputs of SPEC's key (y and every gradient), then the passing ones timed in interleaved rounds,
at race.plan's shapes. It prints "dorafp8-race start C" before each run of C (so that the parent can blame a hang or
crash; "start inputs" and "start reference" blame none) and "dorafp8-race result {C: verdict}" lines; a watchdog
ends it at the limit or when its parent is gone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import torch

from .. import backends
from ..backends import race as _race
from ..backends.race import ROOM, ROUNDS, TOL, W8A8_REL, plan
from ..quant import E4M3, quantize_mxfp8, quantize_nvfp4, row_blocks
from .linear import dora_fp8_linear, fp8_linear, weight_norm


def _inputs(spec: dict, M: int, rows: int, device: torch.device) -> dict:
    """Random inputs of the key with the weight's first `rows` rows, made a block of rows at a time (no fp32 copy)."""
    g = torch.Generator().manual_seed(M)
    K, r, bs = spec["K"], max(spec["r"], 1), spec["block"]
    cdt, rdt = getattr(torch, spec["cdt"]), getattr(torch, spec["rdt"] or spec["cdt"])
    if spec["scale"] in ("nvfp4", "mxfp8"):  # the microscaled kinds by their own recipes (dorafp8/quant.py), a
        w8, scale, gs = _micro_weight(spec["scale"], rows, K, g)  # block of rows at a time
    else:
        w8, gs = torch.empty(rows, K, dtype=E4M3), None
        for j0, j1 in row_blocks(rows, 64 * K):  # fp8 codes of N(0, 64^2), in blocks of 256 KiB of fp32
            w8[j0:j1] = (torch.randn(j1 - j0, K, generator=g) * 64).clamp_(-448, 448).to(E4M3)
        shape = (rows,) if spec["scale"] == "row" else (-(-rows // bs), -(-K // bs)) if bs else ()
        scale = (torch.rand(shape, generator=g) + 0.5) / (64 * K ** 0.5)
    t = {"x": torch.randn(M, K, generator=g, dtype=cdt), "scale": scale, "w8": w8, "global_scale": gs,
         "A": (torch.randn(r, K, generator=g) / K ** 0.5).to(rdt), "B": (torch.randn(rows, r, generator=g) / r).to(rdt),
         "m": torch.rand(rows, generator=g) + 0.5, "gy": torch.randn(M, rows, generator=g, dtype=cdt),
         "bias": torch.randn(rows, generator=g, dtype=cdt) if spec["bias"] else None}
    return {k: None if v is None else v.to(device) for k, v in t.items()}


def _micro_weight(kind: str, rows: int, K: int, g: torch.Generator):
    """An NVFP4 or MXFP8 weight of N(0, 1/K) values, quantized a block of rows at a time (NVFP4 with one global
    scale for all: ModelOpt's global for an amax of 8 standard deviations, which no sample of this size reaches)."""
    gs = torch.tensor(8.0 / K ** 0.5 / (6 * 448)) if kind == "nvfp4" else None
    parts = []
    for j0, j1 in row_blocks(rows, 64 * K):
        w = torch.randn(j1 - j0, K, generator=g) / K ** 0.5
        parts.append(quantize_nvfp4(w, gs)[:2] if gs is not None else quantize_mxfp8(w))
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), gs


def _step(spec: dict, t: dict, backend: str) -> dict:
    """One forward + backward on `backend`: {name: tensor} of y and every gradient."""
    if spec["op"] == "norm":  # weight_norm alone (PEFT's cached norm, the convs' norms): no gradient
        return {"y": weight_norm(t["w8"], t["scale"], t["A"], t["B"], 0.5, backend=backend,
                                 block_size=spec["block"] or 128, global_scale=t["global_scale"])}
    # the inputs themselves are the leaves (detach: no copy), so that the step holds what a layer's step holds
    leaves = {k: t[k].detach().requires_grad_() for k in ("x", "A", "B", "m", "bias") if t[k] is not None}
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
    """Which output is outside the bound and by how much, else None; a block of rows at a time."""
    rel = ROOM * max(TOL[spec["cdt"]], TOL.get(spec["rdt"], 0.0))
    rel = max(rel, W8A8_REL) if spec["act_quant"] else rel
    for k, r in ref.items():
        o = out.get(k)
        if o is None or o.shape != r.shape:
            return f"{k} missing or of shape {None if o is None else list(o.shape)}, expected {list(r.shape)}"
        o, r = o.reshape(r.shape[0], -1), r.reshape(r.shape[0], -1)
        blocks = list(row_blocks(r.shape[0], 256 * r.shape[1]))  # 64 KiB of fp32: 128 KiB per fp64 temporary
        top = max(r[i0:i1].abs().amax().double().item() for i0, i1 in blocks) if r.numel() else 0.0
        used = 0.0
        for i0, i1 in blocks:
            rb = r[i0:i1].double()
            bound = rb.abs().add_(top).mul_(rel).clamp_min_(1e-30)
            used = max(used, rb.sub_(o[i0:i1].double()).abs_().div_(bound).nan_to_num_(float("inf")).max().item())
        if used > 1:
            return f"{k} differs from the fp32 reference by {used:.3g}x the allowed error (rel {rel:g})"
    return None


def _watchdog(limit: float, parent: int) -> None:
    """Ends the child at the time limit or when its parent is gone, even while a kernel hangs its main thread."""
    end = time.monotonic() + limit

    def watch():
        while time.monotonic() < end and os.getppid() == parent:
            time.sleep(0.5)
        os._exit(70)

    threading.Thread(target=watch, daemon=True, name="dorafp8-race-watchdog").start()


def _toolchain(e: Exception) -> bool:
    """Whether e is the machine's, not the kernel's: an OSError (a full disk under the compiler's cache), a tool the
    compiler ran failing (subprocess's errors: gcc without Python.h), Triton's missing C compiler. Not Triton's
    PTXASError: ptxas rejecting the PTX Triton made of a kernel ("Internal Triton PTX codegen error", a ptxas
    SIGSEGV) is that kernel's on this GPU and Triton, and ptxas is Triton's own or TRITON_PTXAS_PATH's, both in
    the verdict file's name (race._versions); not kept, it was checked again by every process, seconds a key."""
    return isinstance(e, (OSError, subprocess.SubprocessError)) or str(e).startswith("Failed to find C")


STICKY = 71  # the exit status after a candidate left the device unusable


def _device_ok(device) -> bool:
    """Whether the device still runs work: after a CUDA error such as an illegal address every call fails with it."""
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        return torch.ones(1, device=device).add_(1).item() == 2
    except Exception:
        return False


class Held:
    """What the child holds on a GPU of what race.budget bounds: its tensors. The CUDA allocator's peak counts more, the
    same whatever the layer, in any process that multiplies and autotunes: cuBLAS's workspace (32 MiB on sm_90, held
    from the first product on), taken into the baseline by start(), and the buffer Triton's autotuner zeroes before
    timing each config (an L2 flush, 256 MiB), which bench_buffer() makes once and takes out of the peak. The first GPU
    run, counting both, said "held 290.6 MiB, more than its bound of 17.0 MiB (please report)" (256 + 32 + the check's
    2.6). Not a peak taken around the checked calls alone: Triton autotunes inside them (a candidate's first call at
    each M bucket), and the timing, at the largest M, is within the bound too. `mem`: torch.cuda's memory_allocated,
    max_memory_allocated and reset_peak_memory_stats, or a stand-in."""

    def __init__(self, mem=torch.cuda):
        self.mem = mem
        self.base = self.before = self.bench = 0

    def start(self) -> None:
        self.mem.reset_peak_memory_stats()
        self.base = self.mem.memory_allocated()

    def bench_buffer(self, make):
        """make()'s buffer (Triton's L2 flush), made here once: the peak up to it kept, then counted without it."""
        self.before = max(self.before, self.mem.max_memory_allocated())
        buf = make()
        self.bench += buf.numel() * buf.element_size()
        self.mem.reset_peak_memory_stats()
        return buf

    def extra(self) -> int:
        """The peak of the child's own tensors on top of the baseline, in bytes."""
        return max(self.before, self.mem.max_memory_allocated() - self.bench) - self.base


def _one_bench_buffer(held: Held) -> None:
    """Triton's autotuner asks its driver for a fresh 256 MiB buffer for each config it times: one, made by `held`,
    serves them all (zeroed before each timing as before). No Triton, or a driver without the hook: nothing to do."""
    try:
        import triton

        drv = triton.runtime.driver.active
        make = drv.get_empty_cache_for_benchmark
    except Exception:
        return
    made = []

    def one():
        if not made:
            made.append(held.bench_buffer(make))
        return made[0]

    drv.get_empty_cache_for_benchmark = one


def _start_held(device) -> Held | None:
    """On a GPU: cuBLAS's workspace made (tiny products in the dtypes the candidates multiply in, with and without a
    bias: cuBLASLt's), the bench buffer shared, then the baseline; None elsewhere (tests/ops/test_race.py measures the
    CPU's peak)."""
    if device.type != "cuda":
        return None
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        a = torch.ones(16, 16, device=device, dtype=dt)
        torch.addmm(a[0], a, a)
        torch.mm(a, a)
    _sync(device)
    held = Held()
    _one_bench_buffer(held)
    held.start()
    return held


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _parse(argv: list[str]) -> tuple[dict, str | None]:
    """(the spec, None), or ({}, what is wrong with argv)."""
    if len(argv) not in (1, 2) or (len(argv) == 2 and not argv[1].isdigit()):
        return {}, f"expected SPEC and an optional parent process id, got {argv!r}"
    try:
        spec = json.loads(argv[0])
    except ValueError as e:
        return {}, f"SPEC is not JSON ({e}): {argv[0][:200]!r}"
    # every key spec_of writes, and the candidates: what a Reproduce command holds
    need = set(_race.spec_of("dora", torch.device("cpu"), N=1, K=1, M=1, cdt=torch.float32)) | {"cands"}
    if not isinstance(spec, dict) or need - set(spec):
        return {}, (f"SPEC must be a JSON object with the keys {sorted(need)}; "
                    + (f"missing {sorted(need - set(spec))}" if isinstance(spec, dict) else f"got {argv[0][:200]!r}"))
    bad = [c for c in spec["cands"] if c not in backends.BACKENDS] if isinstance(spec["cands"], list) else [None]
    if bad or not spec["cands"]:
        return {}, f"SPEC's cands must be a non-empty list of {list(backends.BACKENDS)}, got {spec['cands']!r}"
    return spec, None


def main(argv: list[str]) -> int:
    """The child (the module docstring): checks, then times, spec's candidates; 2 for arguments of another shape."""
    spec, why = _parse(argv)
    if why is not None:  # `dorafp8 check` by hand: a traceback from json.loads or from deep in the check before
        print(f"dorafp8 check: {why}\nusage: dorafp8 check SPEC [PARENT_PID], SPEC the JSON object a race warning's "
              "Reproduce command gives", file=sys.stderr)
        return 2
    _watchdog(float(spec.get("limit_s", _race.TIMEOUT_S)), int(argv[1]) if len(argv) > 1 else os.getppid())
    device = torch.device(spec["device"])
    if device.type == "cuda" and device.index is not None:  # Triton launches on the current GPU, not its tensors':
        torch.cuda.set_device(device)  # rank r's key is on cuda:r (selftest's "cuda" is the current one already)
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32
    torch.backends.cudnn.allow_tf32 = False

    def say(kind, what):  # on a line of its own: a kernel's or compiler's output without a newline (device printf,
        # ptxas) glued the next line to it, and the parent, missing that start or result, blamed the kernel before
        print(f"\ndorafp8-race {kind} {what}", flush=True)

    todo = plan(spec)
    held = _start_held(device)
    failed = {}
    for M in todo["check"]:  # one M's inputs, the reference's outputs and one candidate's at a time
        # said before the inputs too: out of memory there (the user's job beside it) blamed the candidate run last
        say("start", "inputs")
        t = _inputs(spec, M, todo["rows"], device)
        say("start", "reference")  # a hang or crash in it blames no candidate
        ref = _step(spec, t, "reference")
        for c in [c for c in spec["cands"] if c not in failed]:
            say("start", c)
            try:
                why = _wrong(spec, _step(spec, t, c), ref)
                verdict = None if why is None else {"ok": False, "error": why}
            except torch.OutOfMemoryError as e:
                verdict = {"ok": None, "error": f"out of memory while checking ({e})"[:300]}
            except Exception as e:
                # the compiler's cache on a full disk, no C compiler, gcc without Python.h: nothing
                # said of the kernel, not kept (kept, it outlived the user's fix of the toolchain)
                verdict = {"ok": None if _toolchain(e) else False, "error": f"{type(e).__name__}: {e}"[:600]}
            if verdict is not None:
                failed[c] = verdict
                say("result", json.dumps({c: verdict}))
                if not _device_ok(device):  # an illegal address is sticky: every later call in this process fails,
                    os._exit(STICKY)  # and failed the candidates after c for the key; the parent runs them anew
        del t, ref
    passed = [c for c in spec["cands"] if c not in failed]
    if not passed:
        return 0
    times = {c: [] for c in passed}
    say("start", "inputs")
    t = _inputs(spec, todo["time"], todo["rows"], device)
    try:
        for i in range(ROUNDS):  # a lone one too: its time is weighed against the file's of the others
            for c in passed[i % len(passed):] + passed[:i % len(passed)]:  # interleaved, rotated each round
                say("start", c)
                _sync(device)
                t0 = time.perf_counter()
                _step(spec, t, c)  # its outputs freed at once: one candidate's at a time
                _sync(device)
                times[c].append(time.perf_counter() - t0)
    except (torch.OutOfMemoryError, OSError) as e:  # next to the user's job, or a full disk: says nothing of the
        say("result", json.dumps({c: {"ok": None, "error": f"{type(e).__name__} while timing ({e})"[:300]}  # kernels
                                  for c in passed}))
        return 0
    # what was timed, and the child's GPU peak of its tensors against its bound (_race.budget), kept with the verdicts
    info = {"rows": todo["rows"], "M": todo["time"], "budget_mb": round(todo["budget"] / 2 ** 20, 1)}
    info.update({"peak_mb": round(held.extra() / 2 ** 20, 1)} if held is not None else {})
    say("result", json.dumps({c: {"ok": True, "ms": 1e3 * sorted(ts)[len(ts) // 2], **info}
                              for c, ts in times.items()}))
    return 0
