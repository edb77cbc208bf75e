"""The race behind backend="auto" on a GPU: the first call of a layer shape times the strategies that can compute it
and keeps the fastest, so that dorafp8 is never slower than its own dequantize + cuBLAS strategy on a GPU nobody here
has measured.

What is raced: a key of (op, device, compute dtype, W8A16 / W8A8, dropout or not, N, K, M's power-of-two bucket). On
the first call of a key, each candidate of RACERS that can run here and compute the call (fused Triton, the cuBLAS
strategy, the CUDA extension where built) runs one forward + backward of the same shape on random inputs (a warm-up,
which compiles and autotunes, then CUDA events over ~50 ms of calls); the fastest is kept in this process and in a
JSON file per device name and torch / Triton / dorafp8 versions under the user's cache directory
($DORAFP8_CACHE_DIR, else $XDG_CACHE_HOME/dorafp8 or ~/.cache/dorafp8), written atomically, read by later processes
without racing again. A candidate that raises is left out with a warning; if all do, the static order (triton, then
cuda) serves, as without the race. The race runs under its own RNG state (the user's random stream is unchanged),
with grad enabled, outside inference mode.

Invisible to programs: under a CUDA graph capture or a torch.compile trace it never races (a capture uses a pick
already made, a compiled graph the static order: one graph serves many M); a later call of a raced key costs a dict
lookup, no sync.

Several processes (torch.distributed): every rank runs rank 0's picks. Rank 0 races (or reads its file) and publishes
each pick in the process group's key-value store (the TCPStore rendezvous already made); another rank looks a key up
there without waiting (at most once a second per key) and runs the static order until rank 0 has published it. No
collective is ever entered, so ranks that meet different shapes (their own sequence lengths, an MoE expert that gets
no tokens on one rank) cannot deadlock; the price is that another rank may run the static order for a step or two.

Off: DORAFP8_RACE=0; a backend named by `backend=` or $DORAFP8_BACKEND is used as named, never raced. Logged at
DEBUG on the "dorafp8.race" logger; `python -m dorafp8` prints the cached picks (race_report).
"""

from __future__ import annotations

import datetime
import glob
import hashlib
import importlib.metadata
import json
import logging
import os
import sys
import tempfile
import time
import warnings

import torch

from .. import backends

log = logging.getLogger("dorafp8.race")

# Device type -> the candidates, in the static order. Only GPUs race: on a CPU "native" is the one fast backend.
RACERS: dict[str, tuple[str, ...]] = {"cuda": ("triton", "cuda", "cublas")}
TIME_BUDGET_S = 0.05  # timed calls per candidate: about this much, at most MAX_REPS calls
MAX_REPS = 10
RECHECK_S = 1.0  # a rank other than 0 asks the store for a key at most this often

_PICKS: dict[tuple, str] = {}  # in-process key -> pick
_NEXT_ASK: dict[tuple, float] = {}  # rank != 0: key -> when to ask the store again
_FILES: dict[str, dict] = {}  # cache file path -> its picks, as read once


def racing(backend: str | None, device: torch.device) -> bool:
    """Whether a call with this `backend` argument on `device` is decided by the race: "auto", nothing forced by
    $DORAFP8_BACKEND, DORAFP8_RACE not 0, a device type that races."""
    return (backend in (None, "auto") and device.type in RACERS and not os.environ.get("DORAFP8_BACKEND")
            and os.environ.get("DORAFP8_RACE", "1") != "0")


def cuda_timer(name: str, fn, device: torch.device) -> float:
    """Seconds per call of fn on `device`: one warm-up call (compiles, autotunes), then CUDA events over about
    TIME_BUDGET_S of calls."""
    fn()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    once = start.elapsed_time(end) / 1e3
    reps = max(1, min(MAX_REPS, int(TIME_BUDGET_S / max(once, 1e-6))))
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def cpu_timer(name: str, fn, device: torch.device) -> float:
    fn()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# timer(candidate name, fn, device) -> seconds per call. The tests put their own here.
TIMER = None


def _timer(device):
    return TIMER or (cuda_timer if device.type == "cuda" else cpu_timer)


def bucket(M: int) -> int:
    """M's bucket: the power of two at or above it (16 at least), as the Triton autotuner keys M."""
    return 1 << max(4, (M - 1).bit_length())


def describe(key: tuple) -> str:
    """A key as the cache file and the log write it: "dora bfloat16 w8a16 nodrop N=4096 K=4096 M<=8192"."""
    op, _, _, dtype, mode, dropout, N, K, mb = key
    return f"{op} {dtype} {mode} {'dropout' if dropout else 'nodrop'} N={N} K={K} M<={mb}"


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _versions() -> dict:
    def dist(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None
    # dorafp8's own version from the package (an uninstalled checkout has no metadata); sys.modules, not an import:
    # this layer is below dorafp8/__init__.py
    return {"torch": torch.__version__, "triton": dist("triton"),
            "dorafp8": getattr(sys.modules.get("dorafp8"), "__version__", None) or dist("dorafp8")}


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get("DORAFP8_CACHE_DIR") or os.path.join(base, "dorafp8")


def cache_file(device: torch.device) -> str:
    """The JSON file of `device`'s picks under this installation's versions."""
    name = _device_name(device)
    tag = hashlib.sha256(json.dumps([name, _versions()], sort_keys=True).encode()).hexdigest()[:12]
    slug = "".join(ch if ch.isalnum() else "-" for ch in name).strip("-").lower()
    return os.path.join(cache_dir(), f"race-{slug}-{tag}.json")


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data.get("picks"), dict) else {}
    except (OSError, ValueError, AttributeError):
        return {}  # none yet, or not ours: raced again, and rewritten


def _file_picks(path: str) -> dict:
    if path not in _FILES:
        _FILES[path] = dict(_read(path).get("picks", {}))
    return _FILES[path]


def _save(path: str, device: torch.device, what: str, entry: dict) -> None:
    """Adds one pick to the file (re-read first: other processes may have added theirs), written atomically."""
    _file_picks(path)[what] = entry
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        picks = dict(_read(path).get("picks", {}), **{what: entry})
        data = {"device": _device_name(device), "versions": _versions(), "picks": picks}
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".race-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:  # a read-only home: the pick still holds in this process
        log.debug("dorafp8 race: could not write %s (%s)", path, e)


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on the current stream (no timing, no sync may happen then)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _group():
    """(rank, the process group's store or None) under torch.distributed with several ranks, else None."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # no store on this torch: every rank keeps the static order
        store = None
    return dist.get_rank(), store


def _store_key(what: str) -> str:
    return "dorafp8/race/" + what


def choose(op: str, static: str, device: torch.device, needs: frozenset, shape: tuple, make_trial) -> str:
    """The backend for a call: the pick of its key, made now if new (see the module docstring). static: what
    backends.resolve chose; shape: (compute dtype, act_quant, dropout, N, K, M); make_trial(): run(candidate), one
    forward + backward of this shape on that candidate (called only when racing)."""
    if torch.compiler.is_compiling() or shape[-1] == 0:
        return static
    cdt, act_quant, dropout, N, K, M = shape
    key = (op, device.type, device.index, str(cdt).removeprefix("torch."), "w8a8" if act_quant else "w8a16",
           bool(dropout), N, K, bucket(M))
    pick = _PICKS.get(key)
    if pick is not None:
        return pick
    if _capturing(device):
        return static
    cands = [c for c in RACERS[device.type]
             if backends.unavailable_reason(c, device) is None and needs <= backends.supports(c, device)]
    if len(cands) < 2:
        _PICKS[key] = static
        return static
    what = describe(key)
    group = _group()
    if group is not None and group[0] != 0:
        return _rank0_pick(key, what, group[1], static, cands)
    path = cache_file(device)
    entry = _file_picks(path).get(what)
    why = "read from " + path
    if entry is None or entry.get("pick") not in cands:
        entry = _race(what, cands, static, device, make_trial, M)
        _save(path, device, what, entry)
        why = "raced"
    pick = _PICKS[key] = entry["pick"]
    if group is not None and group[1] is not None:
        try:
            group[1].set(_store_key(what), pick)
        except Exception as e:  # the other ranks keep the static order for this key
            log.debug("dorafp8 race: could not publish %s: %s", what, e)
    log.debug("dorafp8 race: %s -> %s (%s; ms per forward + backward: %s)", what, pick, why, entry.get("ms"))
    return pick


def _rank0_pick(key, what, store, static, cands) -> str:
    """A rank other than 0: rank 0's pick from the store once it is there; the static order until then."""
    now = time.monotonic()
    if store is None or now < _NEXT_ASK.get(key, 0.0):
        return static
    try:
        found = store.check([_store_key(what)])
        pick = store.get(_store_key(what)).decode() if found else None
    except Exception:
        pick = None
    if pick is None or pick not in cands:
        _NEXT_ASK[key] = now + RECHECK_S
        return static
    log.debug("dorafp8 race: %s -> %s (rank 0's pick)", what, pick)
    _PICKS[key] = pick
    return pick


def _race(what, cands, static, device, make_trial, M) -> dict:
    """{"pick", "ms": {candidate: ms}, "M", "when"}: each candidate timed on one trial; the failing ones warned about
    and left out; the static order if none ran."""
    ms = {}
    timer = _timer(device)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.inference_mode(False), torch.enable_grad():
        try:
            run = make_trial()
        except Exception as e:
            warnings.warn(f"dorafp8: could not prepare the race for {what} ({type(e).__name__}: {e}); backend "
                          f"{static!r} serves it", RuntimeWarning, stacklevel=4)
            run = None
        for c in cands if run is not None else ():
            try:
                ms[c] = timer(c, lambda c=c: run(c), device) * 1e3
            except Exception as e:
                warnings.warn(f"dorafp8: backend {c!r} failed while racing {what} and is left out of it: "
                              f"{type(e).__name__}: {e}", RuntimeWarning, stacklevel=4)
    pick = min(ms, key=ms.get) if ms else static
    return {"pick": pick, "ms": ms, "M": M,
            "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def forget() -> None:
    """Drops the picks this process holds and the cache files it read (the files stay): the next call of each key
    reads its file again, or races."""
    _PICKS.clear()
    _NEXT_ASK.clear()
    _FILES.clear()


def race_report() -> list[str]:
    """Lines for `python -m dorafp8`: every cache file's picks, each with the candidates' times as ratios to it."""
    d = cache_dir()
    files = sorted(glob.glob(os.path.join(d, "race-*.json")))
    lines = [f"race picks for backend='auto' on a GPU (DORAFP8_RACE=0 turns the race off): {len(files)} cache "
             f"file{'' if len(files) == 1 else 's'} in {d}"]
    mine = _versions()
    for path in files:
        data = _read(path)
        other = "" if data.get("versions") == mine else f" (made under {data.get('versions')}: not used by this one)"
        lines.append(f"  {data.get('device', '?')}{other}:")
        for what, e in sorted(data.get("picks", {}).items()):
            best = e.get("ms", {}).get(e.get("pick"))
            ratios = ", ".join(f"{c} {t / best:.2f}x" for c, t in sorted(e.get("ms", {}).items(), key=lambda i: i[1])
                               ) if best else "nothing ran"
            lines.append(f"    {what} -> {e.get('pick')}" + (f" ({best:.3f} ms; {ratios})" if best else
                                                              f" ({ratios})"))
    return lines
