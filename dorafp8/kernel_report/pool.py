"""The worker processes that compile, and run(): the one entry point that compiles and reads the kernels, in
workers (never in the calling process), a few at a time (--jobs)."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Callable, Iterable, Optional

from . import cuda_driver, triton_driver
from .records import ARCHS, BACKENDS, SpecError, new_record


def worker_main() -> None:
    """Serves one JSON request per stdin line with one JSON reply per line; what the compilers print goes to stderr (fd
    1 points at fd 2; the replies use a private copy of stdout)."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "list":
                reply = dict(ok=True, jobs=triton_driver.list_jobs(req))
            elif req["op"] == "triton":
                reply = dict(ok=True, records=[triton_driver.compile_job(req)])
            elif req["op"] == "cuda":
                reply = dict(ok=True, records=cuda_driver.compile_job(req))
            else:
                raise ValueError(f"unknown request {req['op']!r}")
        except SpecError as e:
            reply = dict(ok=False, spec_error=True, error=str(e))
        except Exception:
            reply = dict(ok=False, spec_error=False, error=traceback.format_exc())
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


# A worker imports the kernel modules without running dorafp8/__init__.py (5-10 s of peft and transformers): the
# package module is created from its spec but not executed, and its submodules import as usual.
_WORKER_BOOT = """
import importlib.util, sys
pkg = importlib.util.module_from_spec(importlib.util.find_spec("dorafp8"))
sys.modules["dorafp8"] = pkg
from dorafp8.kernel_report.pool import worker_main
worker_main()
"""


class Worker:
    """One worker process (worker_main). Compiling happens in workers, never in the calling process: TRITON_INTERPRET=1
    (the tests set it) makes @triton.jit return interpreter objects when the kernel modules are imported."""

    def __init__(self):
        self._start()

    def _start(self):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER_BOOT], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        self.arch = None  # the arch this process has compiled Triton kernels for

    def call(self, req: dict) -> dict:
        # One process compiles for one arch only: Triton 3.6 builds its fp8 conversion table once per process, on its
        # first compile, for that arch (docs/INSPECT.md, "Triton versions"). Jobs come arch by arch.
        if req["op"] == "triton":
            if self.arch not in (None, req["arch"]):
                self.close()
                self._start()
            self.arch = req["arch"]
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            raise RuntimeError(f"kernel report worker died (exit {self.proc.wait()}); its stderr ends with:\n"
                               f"{self.log.read()[-4000:]}")
        reply = json.loads(line)
        if not reply["ok"]:
            raise (SpecError if reply["spec_error"] else RuntimeError)(reply["error"])
        return reply

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait()
        self.log.close()


Select = Callable[[dict], bool]


def run(archs: Iterable[str] = ARCHS, backends: Iterable[str] = BACKENDS, select: Optional[Select] = None,
        jobs: int = 2, all_configs: bool = False, spec_module: str = triton_driver.SPEC_MODULE,
        progress: Optional[Callable[[str], None]] = None) -> list[dict]:
    """Compiles and reads the kernels; returns one record per kernel x variant x config x arch (FIELDS). select(job)
    filters Triton jobs before compiling and CUDA records after. Raises SpecError if a spec and its kernels disagree,
    RuntimeError if a backend cannot run here (cuda_unavailable_reason / triton_unavailable_reason)."""
    archs, backends = list(archs), list(backends)
    select = select or (lambda job: True)
    if unknown := set(archs) - set(ARCHS):
        raise ValueError(f"unknown arch {sorted(unknown)}; known: {ARCHS}")
    for b, why in (("cuda", cuda_driver.cuda_unavailable_reason()),
                   ("triton", triton_driver.triton_unavailable_reason())):
        if b in backends and why:
            raise RuntimeError(f"cannot inspect the {b} kernels here: {why}")
    workers = [Worker() for _ in range(max(1, jobs))]
    try:
        # the long ones first; one job per kernel file and arch, as the extension build compiles them
        todo = cuda_jobs(archs, select) if "cuda" in backends else []
        if "triton" in backends:
            listed = workers[0].call(dict(op="list", archs=archs, all_configs=all_configs,
                                          spec_module=spec_module))["jobs"]
            todo += [j for j in listed if select(dict(j, backend="triton"))]
        per_job = _run_jobs(workers, todo, progress)
    finally:
        for w in workers:
            w.close()
    # The CUDA records in the spec's order within each arch (as one job per arch gave them), whatever file they are in.
    by_source = cuda_driver.cuda_spec_by_source(cuda_driver.load_cuda_spec()) if "cuda" in backends else {}
    cuda = {(archs.index(job["arch"]), i): rec for job, recs in zip(todo, per_job) if job["op"] == "cuda"
            for i, rec in zip(by_source[job["source"]], recs)}
    records = [cuda[k] for k in sorted(cuda)] + [r for job, recs in zip(todo, per_job) if job["op"] != "cuda"
                                                  for r in recs]
    return [r for r in records if r["backend"] == "triton" or select(r)]


def _cuda_record(row: dict, arch: str) -> dict:
    """A CUDA spec row as a record with only its naming fields (what select sees before compiling)."""
    return new_record(backend="cuda", kernel=row["kernel"], variant=row["variant"], dtype=row["dtype"], arch=arch,
                      config=row["config"], autotune_pick=True)


def cuda_jobs(archs: Iterable[str], select: Select) -> list[dict]:
    """One nvcc job per CUDA file and arch with a kernel `select` keeps (its other kernels' records are dropped)."""
    rows = cuda_driver.load_cuda_spec()
    by_source = cuda_driver.cuda_spec_by_source(rows)  # SpecError for a row of a file the build does not compile
    return [{"op": "cuda", "arch": a, "source": f} for a in archs for f in cuda_driver.cuda_sources()
            if any(select(_cuda_record(rows[i], a)) for i in by_source[f])]


def plan(archs: Iterable[str] = ARCHS, backends: Iterable[str] = BACKENDS, select: Select | None = None,
         all_configs: bool = False, spec_module: str = triton_driver.SPEC_MODULE) -> list[dict]:
    """What run() with the same arguments would compile, without compiling: one record per kernel x variant x config x
    arch with its naming fields, in run()'s order (needs Triton and the CUDA sources; SpecError as run())."""
    archs, backends = list(archs), list(backends)
    select = select or (lambda job: True)
    if unknown := set(archs) - set(ARCHS):
        raise ValueError(f"unknown arch {sorted(unknown)}; known: {ARCHS}")
    records = []
    if "cuda" in backends:
        rows = cuda_driver.load_cuda_spec()
        cuda_driver.cuda_spec_by_source(rows)  # SpecError for a row of a file the build does not compile
        records += [rec for a in archs for r in rows if select(rec := _cuda_record(r, a))]
    if "triton" in backends:
        worker = Worker()
        try:
            listed = worker.call({"op": "list", "archs": archs, "all_configs": all_configs,
                                  "spec_module": spec_module})["jobs"]
        finally:
            worker.close()
        records += [new_record(backend="triton", **{k: j[k] for k in ("kernel", "variant", "dtype", "arch", "config",
                                                                       "autotune_pick")})
                    for j in listed if select(dict(j, backend="triton"))]
    return records


def _run_jobs(workers, todo, progress) -> list[list[dict]]:
    """Each job's records, in the order of todo."""
    q: queue.Queue = queue.Queue()
    for i, job in enumerate(todo):
        q.put((i, job))
    results: dict[int, list[dict]] = {}
    failures: list[BaseException] = []
    lock = threading.Lock()
    t0 = time.time()

    def serve(worker):
        while not failures:
            try:
                i, job = q.get_nowait()
            except queue.Empty:
                return
            try:
                recs = worker.call(job)["records"]
            except BaseException as e:
                failures.append(e)
                return
            with lock:
                results[i] = recs
                if progress:
                    what = (f"cuda {job['source']} {job['arch']} ({len(recs)} kernels)" if job["op"] == "cuda" else
                            f"{job['kernel']} {job['arch']} {job['dtype']} {job['variant']} {job['config']}")
                    bad = " ERROR" if any(r["error"] for r in recs) else ""
                    progress(f"[{len(results)}/{len(todo)} {time.time() - t0:.0f}s] {what}{bad}")

    threads = [threading.Thread(target=serve, args=(w,), daemon=True) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    return [results[i] for i in range(len(todo))]

