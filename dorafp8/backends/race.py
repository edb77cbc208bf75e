"""What backend="auto" runs on a GPU: the fastest of the kernels checked right on this GPU, versions and build.

A key's verdicts come from a file per device and versions, else from a child process that checks every candidate
against the reference and times those that pass; DORAFP8_RACE=0 turns it off. The protocol, its memory bound and
its failure cases: docs/ARCHITECTURE.md, "dorafp8/backends/race.py".
Long because the protocol is one unit: keys, the child's memory bound, the shared file (no lock), the picks."""

from __future__ import annotations

import contextlib
import datetime
import functools
import glob
import hashlib
import importlib.util
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import warnings

import torch

from .. import backends
from .._deps import triton_version
from .._env import capturing, flag
from . import cuda_build
from .cuda_build import cache_dir

log = logging.getLogger("dorafp8.race")

# Device type -> the candidates, in the static order. Only GPUs race: on a CPU "native" is the one fast backend.
RACERS: dict[str, tuple[str, ...]] = {"cuda": ("triton", "cuda", "cublas")}
FALLBACK = "reference"  # what runs when no candidate passed: the fp32 twin every kernel is checked against
MARGIN = 0.05  # a candidate later in the static order is picked only if it is this much faster than the earlier ones
ROUNDS = 7  # timed calls per candidate, interleaved
MAX_M = 4096  # the largest M the child runs (its memory), and the small one
SMALL_M = 37
SWITCHES = ("DORAFP8_HOPPER_GEMM",)
# The child's command (ops/_race_child.py), SPEC appended. The tests put a wrapper here that plants wrong, hanging or
# crashing kernels. It imports the dorafp8 this process runs, from its __init__.py, not the one its own path finds:
# `-m dorafp8` found none where a script had put dorafp8 on sys.path (every key then ran the reference), and a
# `dorafp8/` folder in the working directory, or another installation, was checked in this one's place. (Not by
# putting its folder first on sys.path: that may be site-packages, whose backports would shadow the standard library.)
_INIT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "__init__.py")
CHILD: list[str] = [sys.executable, "-c", (
    "import importlib.util as u, sys; s = u.spec_from_file_location('dorafp8', sys.argv.pop(1)); "
    "m = sys.modules['dorafp8'] = u.module_from_spec(s); s.loader.exec_module(m); "
    "from dorafp8.__main__ import main; sys.exit(main())"), _INIT, "check"]
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.2e-2}  # tests/_tolerance.py's tol(dtype)
ROOM = 4  # times tol: the tests allow 2 between a backend and the reference (docs/ARCHITECTURE.md)
W8A8_REL = 2.0 ** -5

_PICKS: dict[tuple, str] = {}  # in-process key -> pick
_FAST: dict[tuple, tuple] = {}  # select()'s op, device, needs, M's bucket, switches, other arguments -> its _PICKS key
_LAYERS: dict[tuple, str] = {}  # in-process key without M -> the pick of every M checked, or "" where they differ
_FILES: dict[str, dict] = {}  # cache file path -> its contents, as read once and merged since
_BUILD: list[str] = []
_WARNED: set = set()  # (device, candidate, verdict) warned about in this process
_TOLD: list[str] = []  # the first key this process checked, once said
_UNSAVED: set = set()  # the verdict files this process could not write, once said
_STOPPED: list[str] = []  # why this process starts no more children


def racing(backend: str | None, device: torch.device) -> bool:
    """Whether this call is decided here: "auto", no $DORAFP8_BACKEND, DORAFP8_RACE not 0, a racing device. A named
    backend is answered first, reading no variable (a few microseconds a call, every call)."""
    return (backend in (None, "auto") and flag("DORAFP8_RACE", True) and device.type in RACERS
            and not os.environ.get("DORAFP8_BACKEND"))


def select(op: str, backend: str | None, device: torch.device, needs: frozenset, **call) -> str:
    """The backend one call of `op` runs: `backend` / $DORAFP8_BACKEND, else racing()'s pick, else the static order.
    A decided key's pick is found from the call's own arguments (_FAST): building its key and the static order took
    ~45 us a call, a step's every layer and op (the static order asked for the GPU's capability each time)."""
    if not racing(backend, device):
        return backends.resolve(backend, device, needs)
    if torch.compiler.is_compiling() or not call["M"]:  # as choose() takes them
        return choose(op, backends.resolve(backend, device, needs), device, needs, **call)
    fast = (op, device, needs, bucket(call["M"]), tuple(os.environ.get(k) for k in SWITCHES),
            *(kv for kv in call.items() if kv[0] != "M"))
    pick = _PICKS.get(_FAST.get(fast))
    if pick is None:
        pick = choose(op, backends.resolve(backend, device, needs), device, needs, **call)
        if (key := (str(device), describe(spec_of(op, device, **call)))) in _PICKS:
            _FAST[fast] = key
    return pick


TIMEOUT_S = 300.0  # what a child may take: a kernel that hangs is dropped on this GPU after it


def bucket(n: int) -> int:
    """n's bucket: the power of two at or above it (16 at least), as the Triton autotuner keys M."""
    return 1 << max(4, (n - 1).bit_length())


RANKED = ("dora", "norm")  # the ops whose key holds the rank and the adapters' dtype


def spec_of(op: str, device: torch.device, *, N, K, M, r=0, bias=False, scale="tensor", block=128, cdt, rdt=None,
            p=0.0, act_quant="") -> dict:
    """What the child runs for a call: everything that changes the kernel or its speed, M and r bucketed."""
    name = lambda d: str(d).removeprefix("torch.")  # noqa: E731
    return {"op": op, "device": str(device), "N": N, "K": K, "M": min(bucket(M), MAX_M), "mb": bucket(M),
            "r": 1 << max(0, (r - 1).bit_length()) if op in RANKED else 0, "bias": bool(bias), "scale": scale,
            "block": block if scale == "block" else 0, "cdt": name(cdt), "rdt": name(rdt or cdt) if op in RANKED
            else "", "p": float(p), "act_quant": act_quant,
            # each switch as flag() reads it: unset and "0" run the same kernels (one key, raced once), and a value
            # flag() refuses is refused here, naming it, not handed to the child (whose Triton candidate, raising on
            # it, was recorded as a failed kernel)
            "env": {k: "1" for k in SWITCHES if flag(k, False)}, "at": M}


CAP = 256 * 2 ** 20  # the fixed cap on the child's extra peak memory, whatever the layer
FLOOR = 4 * 2 ** 20  # what a layer whose whole step holds less may use: the child's own small tensors
# The child's cost model, a bound in bytes (tests/ops/test_race.py measures it): per weight element W_COST plus BLOCKS
# of fp32 row blocks; per element of M x (N + K), a + b * the compute dtype's size; per element of r x (N + K), R_COST.
W_COST = 3
BLOCKS = 2 * 16 * 2 ** 20
A_COST = {"check": (12, 4), "time": (8, 2)}
R_COST = 16
FIXED = 2 ** 19


def _size(dtype: str) -> int:
    return getattr(torch, dtype).itemsize if dtype else 0


def step_bytes(spec: dict, M: int) -> int:
    """The bytes of the layer's own step at M: x, y, dy, dx, the fp8 weight, its scales, the adapters and gradients."""
    N, K, r = spec["N"], spec["K"], spec["r"]
    act = 0 if spec["op"] == "norm" else 2 * M * (N + K) * _size(spec["cdt"])
    scales = 4 * (N if spec["scale"] == "row" else -(-N // spec["block"]) * -(-K // spec["block"])
                  if spec["block"] else 1)
    adapters = 2 * (r * (N + K) * _size(spec["rdt"]) + 4 * N * bool(spec["rdt"]) + N * _size(spec["cdt"])
                    * spec["bias"])
    return act + N * K + scales + adapters


def budget(spec: dict) -> int:
    """The most the child may hold on the device: the layer's step_bytes at the key's M, within [FLOOR, CAP]."""
    low = spec["mb"] // 2 + 1 if spec["mb"] > 16 else 1
    return min(max(step_bytes(spec, min(spec.get("at") or low, MAX_M)), FLOOR), CAP)


def trial_bytes(spec: dict, n: int, M: int, phase: str) -> int:
    """The cost model's bound of what the child holds with n weight rows at M, checking or timing."""
    a, b = A_COST[phase]
    act = 0 if spec["op"] == "norm" else (a + b * _size(spec["cdt"])) * M * (n + spec["K"])
    w = n * spec["K"]
    return W_COST * w + min(4 * w, BLOCKS) + R_COST * (n + spec["K"]) * max(spec["r"], 1) + act + FIXED


def plan(spec: dict) -> dict:
    """What the child runs within budget(spec): the first `rows` weight rows (N mod 256 kept, 16 at least), checked at
    SMALL_M and the largest M that fits, timed at the largest; `fits` False: the reference runs, unchecked."""
    N, M, cap = spec["N"], spec["M"], budget(spec)
    small, rows = min(SMALL_M, M), N
    while rows > 16 and trial_bytes(spec, rows, small, "check") > cap:
        rows = rows - 256 if rows > 256 + N % 256 else max(16, rows // 2)
    while small > 1 and trial_bytes(spec, rows, small, "check") > cap:  # a narrow layer with a wide K, few tokens
        small //= 2

    def most(phase):
        per = trial_bytes(spec, rows, 1, phase) - trial_bytes(spec, rows, 0, phase)
        return max(small, min(M, (cap - trial_bytes(spec, rows, 0, phase)) // max(per, 1)))
    todo = {"rows": rows, "check": sorted({small, most("check")}), "time": most("time"), "budget": cap}
    need = max([trial_bytes(spec, rows, m, "check") for m in todo["check"]] + [trial_bytes(spec, rows, todo["time"],
                                                                                         "time")])
    return dict(todo, fits=need <= cap)


def describe(spec: dict) -> str:
    """A key as the cache file and the messages write it."""
    s = spec
    parts = [s["op"], f"N={s['N']} K={s['K']}" + ("" if s["op"] == "norm" or s["mb"] is None else f" M<={s['mb']}"),
             s["cdt"] + (f"/{s['rdt']}" if s["rdt"] else ""),
             "w8a8" if s["act_quant"] else "w8a16", s["scale"] + (str(s["block"]) if s["block"] else "")]
    parts += [f"r<={s['r']}"] if s["op"] in RANKED else []
    parts += ["bias"] if s["bias"] else []
    parts += [f"p={s['p']:g}"] if s["p"] else []
    parts += [f"{k}={v}" for k, v in sorted(s["env"].items())]
    return " ".join(parts)


def _device_info(device: torch.device) -> dict:
    if device.type != "cuda":
        return {"name": device.type}
    return {"name": torch.cuda.get_device_name(device), "capability": list(torch.cuda.get_device_capability(device)),
            "driver": driver_version()}


@functools.cache
def driver_version() -> int | None:
    """The CUDA driver's version (cuDriverGetVersion, e.g. 12080), None where it cannot be read; read once a process
    (it was a dlopen of libcuda per new key). Not torch's: the torch._C._cuda_getDriverVersion this read is in no torch
    the project supports, so every driver shared a file."""
    import ctypes

    for name in ("libcuda.so.1", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        v = ctypes.c_int(0)
        try:
            return v.value if lib.cuDriverGetVersion(ctypes.byref(v)) == 0 else None
        except AttributeError:
            return None
    return None


def build_id() -> str:
    """A hash of the sources and binaries that make the kernels: a new build of them is checked again."""
    if not _BUILD:
        pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        # the CUDA sources where a build reads them: a wheel's dorafp8/csrc/ (the checkout's csrc/ beside the package
        # was a folder no wheel has: a release that changed only kernels kept the verdicts on the old ones)
        src = cuda_build.source_dir()
        roots = [os.path.join(pkg, "backends"), os.path.join(pkg, "ops")] + ([str(src)] if src else [])
        try:
            spec = importlib.util.find_spec("dorafp8.triton_kernels")
            roots += list(spec.submodule_search_locations or []) if spec else []
        except Exception:  # triton_kernels absent: nothing of it to hash
            pass
        h = hashlib.sha256()
        files = [os.path.join(d, f) for root in roots for d, _, fs in os.walk(root) for f in fs
                 if f.endswith((".py", ".cu", ".cuh", ".cpp", ".h"))]
        files += glob.glob(os.path.join(pkg, "_C*.so")) + glob.glob(os.path.join(pkg, "_C*.pyd"))
        for path in sorted(files):
            try:
                with open(path, "rb") as f:
                    h.update(os.path.basename(path).encode() + b"\0" + f.read())
            except OSError:
                pass
        _BUILD.append(h.hexdigest()[:16])
    return _BUILD[0]


def _versions() -> dict:
    # the ptxas Triton runs, where not its own: a kernel's PTXASError is a verdict kept (_race_child._toolchain)
    ptxas = {k: v for k, v in sorted(os.environ.items()) if k.startswith("TRITON_PTXAS")}
    return {"torch": torch.__version__, "triton": triton_version(), "build": build_id(), "ptxas": ptxas}


def cache_file(device: torch.device) -> str:
    """The JSON file of `device`'s verdicts under these versions and this build."""
    info = _device_info(device)
    tag = hashlib.sha256(json.dumps([info, _versions()], sort_keys=True).encode()).hexdigest()[:12]
    slug = "".join(ch if ch.isalnum() else "-" for ch in info["name"]).strip("-").lower()
    return os.path.join(cache_dir(), f"race-{slug}-{tag}.json")


def _verdict(v, inconclusive: bool = False) -> bool:
    """Whether v reads as a verdict: {"ok": False, ...}, {"ok": True, "ms": t}, or with `inconclusive` {"ok": None}."""
    if not isinstance(v, dict):
        return False
    ok, ms = v.get("ok"), v.get("ms")
    if ok is None:
        return inconclusive
    return ok is False or (ok is True and isinstance(ms, (int, float)) and not isinstance(ms, bool)
                           and 0 <= ms < float("inf"))


def _read(path: str) -> dict:
    """The file's verdicts; an entry of another shape (a damaged or hand-edited file) is dropped: checked again."""
    try:
        with open(path) as f:
            data = json.load(f)
        if isinstance(data.get("keys"), dict) and isinstance(data.get("broken"), dict):
            data["keys"] = {k: {c: v for c, v in res.items() if _verdict(v)} for k, res in data["keys"].items()
                            if isinstance(res, dict)}
            data["broken"] = {c: why for c, why in data["broken"].items() if isinstance(why, str)}
            if not isinstance(data.get("device"), dict):  # `python -m dorafp8` read its name: a string there raised
                data.pop("device", None)
            return data
    except (OSError, ValueError, AttributeError):
        pass
    return {"keys": {}, "broken": {}}  # none yet, or not ours: checked again, and rewritten


def _file(path: str) -> dict:
    if path not in _FILES:
        _FILES[path] = _read(path)
    return _FILES[path]


def _save(path: str, device: torch.device, what: str, results: dict, broken: dict) -> None:
    """Adds a key's verdicts and broken candidates to the file (re-read first), atomically."""
    keep = {c: v for c, v in results.items() if v.get("ok") is not None}
    mine = _file(path)
    mine["keys"].setdefault(what, {}).update(keep)
    mine["broken"].update(broken)  # a hang too: not run again in this process, for any key
    broken = {c: why for c, why in broken.items() if c in keep}  # not a hang: kept
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = _read(path)
        # no lock: a writer between this process's writes may have dropped a key of ours, written back here (else every
        # later process checked it again: two processes writing 200 keys each in a loop lost a third of them). Not
        # where the file is gone: deleted (a writer replaces it, never removes it), so that every key is checked again
        for k, res in mine["keys"].items() if os.path.exists(path) else ():
            data["keys"].setdefault(k, res)
        data["keys"].setdefault(what, {}).update(keep)
        data["broken"].update(broken)
        data.update(device=_device_info(device), versions=_versions())
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".race-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:  # a full disk: the half-written file would stay in the cache, one more per key checked
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
    except OSError as e:  # a read-only home: the verdicts still hold in this process, and every next one checks again
        said = path in _UNSAVED  # said once: a debug line, and each process paid the checks again unknowing
        _UNSAVED.add(path)
        (log.debug if said else log.warning)(
            "dorafp8 race: could not write %s (%s): the verdicts hold in this process only, and the next process "
            "checks every key again (seconds each); set DORAFP8_CACHE_DIR to a writable folder", path, e)


def pick_of(results: dict, cands) -> str:
    """The first candidate in `cands`' order that passed and is within MARGIN of the fastest that did; else FALLBACK."""
    ok = [c for c in cands if (results.get(c) or {}).get("ok")]
    if not ok:
        return FALLBACK
    best = min(results[c].get("ms") or 0.0 for c in ok)
    return next(c for c in ok if (results[c].get("ms") or 0.0) <= best * (1 + MARGIN))


def choose(op: str, static: str, device: torch.device, needs: frozenset, **call) -> str:
    """The backend for a call under racing(): its key's pick, checked now in a child if new."""
    if torch.compiler.is_compiling():
        # Nothing read of M (its bucket guards the token count: a recompile per new count, until torch.compile's
        # limit). The layer's pick where every M checked in this process agreed, else the static order
        return _LAYERS.get(_layer_key(spec_of(op, device, **dict(call, M=1)))) or static
    if call["M"] == 0:
        return static
    spec = spec_of(op, device, **call)
    key = (str(device), describe(spec))
    pick = _PICKS.get(key)
    if pick is not None:
        return pick
    path = cache_file(device)
    broken = _file(path)["broken"]
    # static first: ties go to backends.resolve's pick (cublas for the microscaled weights, triton for fp8)
    order = sorted(RACERS[device.type], key=lambda c: c != static)
    cands = [c for c in _candidates(device, needs, order) if c not in broken]
    if not cands:
        # the reference only where the static pick itself is broken; native (no kernel backend runs here) is not
        return _keep(key, spec, FALLBACK if static in broken else static)
    what = key[1]
    if not plan(spec)["fits"]:  # checking would hold more than the layer's own step: not checked, the reference serves
        log.info("dorafp8 race: %s: a check would exceed its memory bound; the reference backend serves it", what)
        return _keep(key, spec, FALLBACK)
    if capturing():  # a CUDA graph being captured: no child inside it
        return _unchecked(path, what, cands, static, captured=True)
    if not _STOPPED:
        results = _shared(path, what, lambda: _resolve(path, device, what, dict(spec, cands=cands)))
    if _STOPPED:  # the job's signal stopped a child (now or before): no more children, and not the fp32 reference
        # (several times slower) for the rest of a job that goes on (SLURM's --signal=USR1@90 to checkpoint), but
        # what DORAFP8_RACE=0 runs
        return _keep(key, spec, _unchecked(path, what, cands, static))
    pick = _keep(key, spec, pick_of(results, cands))
    log.debug("dorafp8 race: %s -> %s (%s)", what, pick, results)
    return pick


def _unchecked(path: str, what: str, cands: list, static: str, captured: bool = False) -> str:
    """A pick without a child: the file's verdicts where they cover every candidate, else the static order's (the
    reference where the file says that one is broken here). captured: inside a CUDA graph capture, where the static
    pick is kept by the graph for good (one warning a process)."""
    known = _file(path)["keys"].get(what, {})
    if all(c in known for c in cands):
        return pick_of(known, cands)
    pick = FALLBACK if static in _file(path)["broken"] else static
    if captured and ("capture",) not in _WARNED:  # the graph keeps this pick for every replay, unchecked
        _WARNED.add(("capture",))
        warnings.warn(f"dorafp8 race: a CUDA graph captured {what} before an eager call checked its backends on this "
                      f"GPU; the graph runs the static pick {pick!r} (what DORAFP8_RACE=0 runs). Run one eager step "
                      "before capturing (a warm-up) to have them checked.", stacklevel=2)
    return pick


def _keep(key: tuple, spec: dict, pick: str) -> str:
    """Records a key's pick, and its layer's (_LAYERS); returns it."""
    _PICKS[key] = pick
    layer = _layer_key(spec)
    _LAYERS[layer] = pick if _LAYERS.get(layer, pick) == pick else ""
    return pick


def _layer_key(spec: dict) -> tuple:
    return spec["device"], describe(dict(spec, mb=None))


def _candidates(device: torch.device, needs: frozenset, order) -> list[str]:
    """The backends of `order` that run on `device` and compute what the call `needs` (block scales, W8A8)."""
    return [c for c in order
            if backends.unavailable_reason(c, device) is None and needs <= backends.supports(c, device)]


def _resolve(path: str, device: torch.device, what: str, spec: dict) -> dict:
    """The key's verdicts: from the file, else from a child (written to the file, failures warned about)."""
    known = _file(path)["keys"].get(what, {})
    todo = [c for c in spec["cands"] if c not in known]
    if not todo:
        return known
    if not _TOLD:  # the first step waited tens of seconds (a Python start, the kernels' compiles) saying nothing
        _TOLD.append(what)
        print(f"dorafp8: backend='auto' checks its kernels on this GPU in a child process at the first call of each "
              f"new layer key, {what} first (seconds each, tens for the first; once per GPU and version: kept in "
              f"{path}; DORAFP8_RACE=0 turns it off)", file=sys.stderr, flush=True)
    results, broken = check(dict(spec, cands=todo))
    _save(path, device, what, results, broken)
    if _STOPPED:  # said once, in _child; no warning per candidate (the key runs the static order, choose())
        return dict(known, **results)
    info, vers = _device_info(device), _versions()
    for c, v in results.items():
        if (v.get("peak_mb") or 0) > (v.get("budget_mb") or float("inf")):  # the cost model fell short on this GPU
            log.warning("dorafp8 race: the check of %s held %s MiB, more than its bound of %s MiB (please report)",
                        what, v["peak_mb"], v["budget_mb"])
        if v.get("ok") is not True:
            if (device, c, v.get("ok")) in _WARNED:  # one warning per backend and kind in a process; the rest logged
                log.info("dorafp8 race: %s not used for %s: %s", c, what, v.get("error"))
                continue
            _WARNED.add((device, c, v.get("ok")))
            warnings.warn(
                f"dorafp8: backend {c!r} is {'not used' if v.get('ok') is False else 'not checked, so not used'} "
                f"by backend='auto' for {what} on {info['name']} (capability {info.get('capability')}, driver "
                f"{info.get('driver')}, torch {vers['torch']}, triton {vers['triton']}, build {vers['build']}): "
                f"{v.get('error')}. Reproduce: {reproduce(dict(spec, cands=[c]))}"
                + ("" if v.get("ok") is None else "; the verdict is kept and not retried "
                   f"(`python -m dorafp8` lists them, {path})"), RuntimeWarning, stacklevel=5)
    return dict(known, **results)


def reproduce(spec: dict) -> str:
    return shlex.join(["python", "-m", "dorafp8", "check", json.dumps(spec, sort_keys=True)])


def check(spec: dict) -> tuple[dict, dict]:
    """Runs the child on spec's candidates: (verdicts, {candidate: error} for those that hung or crashed it)."""
    results, broken, todo = {}, {}, list(spec["cands"])
    if _STOPPED:  # the job is being stopped: no more children (each new key's delayed the shutdown by seconds)
        return {c: {"ok": None, "error": _STOPPED[0]} for c in todo}, broken
    while todo:
        out, failure, blame = _child(dict(spec, cands=todo))
        started = None
        for line in out.splitlines():
            if line.startswith("dorafp8-race start "):
                started = line.split()[-1]
            elif line.startswith("dorafp8-race result "):
                results.update(_results(line[len("dorafp8-race result "):], todo))
        if failure is None and all(c in results for c in todo):
            break
        if started in todo and started not in results and blame:  # it hung or crashed the child
            # a hang is this process's only (a cold compile on a busy machine past the limit banned the backend on
            # this GPU for good): the next process checks it again
            why = failure or "the child gave no verdict"
            results[started], broken[started] = {"ok": None if blame == "hang" else False, "error": why}, why
        elif not (started in results and blame):  # outside any candidate, or killed from outside
            results.update({c: {"ok": None, "error": failure or "the child gave no verdict"} for c in todo
                            if c not in results})
            break
        # else its verdict given, it ended the child (a sticky CUDA error, _race_child.main): the rest in a new one
        todo = [c for c in todo if c not in results]
    return results, broken


def _results(text: str, cands) -> dict:
    """A result line's verdicts of `cands`; none from a line of another shape or cut short (a child killed mid-line)."""
    try:
        res = json.loads(text)
    except ValueError:
        return {}
    return {c: v for c, v in res.items() if c in cands and _verdict(v, True)} if isinstance(res, dict) else {}


# The signals a kernel's fault raises in its own process. Any other came from outside, and blames no kernel: SIGKILL
# from the OOM killer, a scheduler's SIGTERM (preemption) or SIGUSR1 (ahead of the time limit) sent to every process
# of the job, where the trainer's handler lets the parent live on
_CRASHES = {signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT}


def _child(spec: dict) -> tuple[str, str | None, bool | str]:
    """(stdout, None, _) if the child ended well, else (its output, why not, whether its kernel is to blame: "hang"
    where the child ran past the limit)."""
    # NVIDIA_TF32_OVERRIDE=1 rounds every fp32 cuBLAS product to tf32, whatever the child's torch flags say: the fp32
    # reference too, against which exact fp32 kernels failed, verdicts kept (no variable names the file)
    env = dict(os.environ, DORAFP8_RACE="0", NVIDIA_TF32_OVERRIDE="0")
    env.pop("DORAFP8_BACKEND", None)
    # PYTHONWARNINGS=error made any warning there an exception: a compiler's deprecation failed a correct kernel (a
    # verdict kept), `import dorafp8`'s word on a misspelt variable killed the child before any. Its stderr is read
    # only for a crash's last lines, so the warnings cost nothing under the default filters
    env.pop("PYTHONWARNINGS", None)
    limit = TIMEOUT_S
    try:  # the limit and this process's id go with the spec: the child's watchdog ends it at either
        proc = subprocess.Popen(CHILD + [json.dumps(dict(spec, limit_s=limit)), str(os.getpid())],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env, start_new_session=True)
    except OSError as e:
        return "", f"the child could not start: {e}", False
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        _kill(proc)
        out, err = proc.communicate()
        return out, f"it did not finish within {limit:g} s (backends/race.py, TIMEOUT_S) and was killed", "hang"
    except BaseException:  # Ctrl-C, SystemExit: the child (in a session of its own) must not outlive the wait
        _kill(proc)
        raise
    if proc.returncode != 0:
        tail = " | ".join(err.strip().splitlines()[-3:])[-600:]
        if proc.returncode < 0 and -proc.returncode not in _CRASHES | {signal.SIGKILL} and not _STOPPED:
            # SIGTERM, SIGINT, SIGHUP, SIGUSR1: the job's shutdown (a scheduler signals all its processes; the
            # trainer's handler lets this one finish its step and save), not the OOM killer's SIGKILL
            _STOPPED.append(f"a child was stopped by signal {-proc.returncode}: no more checks in this process")
            print(f"dorafp8: a race check's child was stopped by signal {-proc.returncode} (the job being stopped?): "
                  "backend='auto' starts no more checks in this process and runs the static order (what "
                  "DORAFP8_RACE=0 runs) for keys not checked yet; the next process checks them", file=sys.stderr,
                  flush=True)
        return (out, f"the child process exited with {proc.returncode}: {tail}",
                proc.returncode > 0 or -proc.returncode in _CRASHES)
    return out, None, True


def _kill(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # with what it started (ptxas, compile workers)
    except OSError:
        proc.kill()
    proc.wait()


def _shared(path: str, what: str, resolve):
    """resolve() once for all ranks: the first to claim the key runs it and shares the verdicts in the store."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return resolve()
    try:
        store = dist.distributed_c10d._get_default_store()
        name = "dorafp8/race/" + hashlib.sha256((os.path.basename(path) + what).encode()).hexdigest()[:24]
        first = store.add(name + "/claim", 1) == 1
    except Exception as e:  # no store on this torch: each rank resolves alone
        log.debug("dorafp8 race: no store (%s)", e)
        return resolve()
    if first:
        results = {}
        try:
            results = resolve()
        finally:  # even empty: the others must not wait for nothing. A child stopped by the job's signal stops
            # theirs too (the scheduler signalled them all): the ranks run the same static picks, not the reference
            store.set(name, json.dumps(dict(results, **({"stopped": _STOPPED[0]} if _STOPPED else {}))))
        return results
    try:
        store.wait([name], datetime.timedelta(seconds=TIMEOUT_S * (len(RACERS.get("cuda", ())) + 1) + 60))
        results = json.loads(store.get(name))
    except Exception as e:  # the claiming rank died: resolve alone
        log.debug("dorafp8 race: no verdict from the store for %s (%s)", what, e)
        return resolve()
    if "stopped" in results and not _STOPPED:
        _STOPPED.append(results.pop("stopped"))
    return results if results else resolve()


def forget() -> None:
    """Drops the picks this process holds and the cache files it read (the files stay)."""
    _PICKS.clear()
    _FAST.clear()
    _LAYERS.clear()
    _FILES.clear()
    _BUILD.clear()
    _WARNED.clear()
    _TOLD.clear()
    _UNSAVED.clear()
    _STOPPED.clear()
    driver_version.cache_clear()


def race_report() -> list[str]:
    """Lines for `python -m dorafp8`: every cache file's verdicts."""
    d = cache_dir()
    files = sorted(glob.glob(os.path.join(d, "race-*.json")))
    lines = [f"backend='auto' on a GPU runs only kernels checked there (DORAFP8_RACE=0 turns this off): {len(files)} "
             f"cache file{'' if len(files) == 1 else 's'} in {d}"]
    mine = _versions()
    for path in files:
        data = _read(path)
        other = "" if data.get("versions") == mine else f" (made under {data.get('versions')}: not used by this one)"
        lines.append(f"  {(data.get('device') or {}).get('name', '?')}{other}:")
        for c, why in sorted(data["broken"].items()):
            lines.append(f"    {c}: unusable on this GPU: {why}")
        for what, res in sorted(data["keys"].items()):
            verdicts = ", ".join(f"{c} {v['ms']:.3f} ms" if v.get("ok") else f"{c} failed ({v.get('error')})"
                                 for c, v in sorted(res.items()))
            lines.append(f"    {what} -> {pick_of(res, [c for c in RACERS.get('cuda', ()) if c in res] or res)}"
                         f" ({verdicts})")
    return lines


_SELFTEST = (("tensor", ""), ("row", ""), ("block", ""), ("tensor", "rowwise"))  # (scale, act_quant) of its keys


def selftest(device: torch.device | None = None, say=lambda line: None) -> list[str]:
    """`python -m dorafp8 selftest`: checks a few headline keys on `device` now; the lines found, each also handed to
    `say` as it is found (a child per key, up to TIMEOUT_S each: the command printed nothing for minutes)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    lines = []

    def add(line):
        lines.append(line)
        say(line)

    if device.type not in RACERS:
        add(f"selftest: {device.type} runs {backends.resolve('auto', device)} with backend='auto': nothing to check")
        return lines
    path = cache_file(device)
    add(f"selftest on {_device_info(device)['name']}, {_versions()}; verdicts in {path}; {len(_SELFTEST)} keys, a "
        "child process each")
    for scale, act_quant in _SELFTEST:
        spec = spec_of("dora", device, N=4096, K=4096, M=1024, r=16, scale=scale, cdt=torch.bfloat16,
                       rdt=torch.float32, act_quant=act_quant)
        what = describe(spec)
        _file(path)["keys"].pop(what, None)
        # the candidates backend="auto" races for this key: one without block scales or W8A8 is not "FAILED" there
        needs = frozenset(f for f in ("block" if scale == "block" else "", act_quant) if f)
        cands = _candidates(device, needs, RACERS[device.type])
        if not cands:  # no kernel backend runs here (sm_80): what auto runs then, not the race's fallback
            add(f"  {what} -> {backends.resolve('auto', device, needs)}: no kernel backend runs on this GPU")
            continue
        res = _resolve(path, device, what, dict(spec, cands=cands))
        add(f"  {what} -> {pick_of(res, cands)}: " + ", ".join(
            f"{c} ok {v['ms']:.3f} ms" if v.get("ok") else f"{c} FAILED: {v.get('error')}" for c, v in res.items()))
    return lines
