#!/usr/bin/env python3
"""bench/first_contact.py: the first GPU run, one command of at most five minutes; and an optional second.

    python3 bench/first_contact.py            # command 1: the first thing run when a GPU is lent (timeout_s=300)
    python3 bench/first_contact.py --more     # command 2, optional (timeout_s=300): tests, sanitizer, the rest
    DRY_RUN=1 python3 bench/first_contact.py  # the plan of both and its sum against a session; runs nothing
    python3 bench/first_contact.py --smoke    # CPU: the same steps at tiny shapes on the reference / native backends
    python3 bench/save_results.py OUT1 [OUT2] --commit SHA   # here, afterwards: bench/results/<device>/, README

Each step runs as a child process with a cap (STEPS below; _first_steps.py holds their code); one that fails or runs
out of time is written down and the next one runs. Every result goes into $OUT/first_contact.json (command 2:
$OUT/more.json) the moment it exists, written atomically, so that a command killed at its limit still returns all it
finished (an earlier run's file there is renamed first_contact.<its time>.json first); the steps' output is
appended to $OUT/log.txt. Two files of the eight the device tool brings back.

dorafp8 runs from this checkout, not installed (an offline install needs setuptools >= 64, and a failed one would lose
the command): PYTHONPATH is the checkout, and where nothing installed maps dorafp8.triton_kernels to triton_kernels/,
the git-ignored link dorafp8/triton_kernels -> ../triton_kernels does. If dorafp8 still cannot be imported from here,
the command stops at once with one line that says why.

Knobs (environment): OUT (default bench_out/first_contact), DORAFP8_COMMIT (the commit, for a tree without git),
FIRST_CONTACT_STEPS (a comma list: run only these steps), FIRST_CONTACT_CAPS ("time=30,race=5": other caps),
FIRST_CONTACT_PROVIDERS (the timing's providers).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from _first_io import HERE, KILL_GRACE_S, ROOT, publish


# The device tool's session (bench/README.md, "On a lent GPU"): the issue allows each command five minutes of its ten.
COMMAND_S = 300
SESSION_S, START_S, IDLE_S = 900, 120, 30  # device time of a session; one machine start; the idle after each call
# --smoke runs the GPU plan's steps on a CPU (CI, under the interpreter): the caps are sized for a GPU machine and mean
# nothing there, and a busy 2-core machine would only run past them (the env step takes 17-18 s on a quiet
# one). So under --smoke a step is stopped only when it hangs, or at a cap named in FIRST_CONTACT_CAPS.
SMOKE_HANG_S = 900
SPARE_S = 15  # of each command's 300 s, kept from the steps: the parent's start, the last kill's grace, the writes


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    cap: int  # seconds
    what: str
    grows: bool = False  # also takes what the steps before it left
    background: bool = False  # runs beside the steps after it
    after: str | None = None  # waits for this background step first
    gpu: bool = False  # skipped without a GPU (--smoke)
    compiles: str = "none"  # Triton / nvcc compiles it makes, estimated (pinned configs where the pins step ran)


STEPS = {
    "first": (
        # 40 s: a cold H200 machine took 20 s (torch's first import from disk and CUDA's start), past the old cap of 20
        Step("env", 40, "import dorafp8 from this checkout, or stop with one line; GPU, driver, versions"),
        Step("pins", 45, "the kernel report's model picks one config per GEMM variant and predicts every kernel "
                         "(sm_90a compiles, 16 processes); the launchers run those configs alone",
             compiles="the headline forward and dgrad GEMMs' configs, W8A16 and W8A8, both main loops (sm_90a, ahead "
                      "of time, 16 processes: about 4-5 s each)"),
        # 45 s: the H200's took 26.1 s (five processes, pinned), the first GPU run's 19.4 s (its launchers autotuned)
        Step("correct", 45, "y, dx, dA, dB, dm against fp64 on the GPU: W8A16, W8A8, the cuBLAS strategy, "
                             "N = K = 4096, M 1024 and 1000, bf16 x, fp32 adapters; the Triton GEMMs in both main "
                             "loops (the default cp.async one, and on sm_90 the opt-in tma-ws one, "
                             "DORAFP8_HOPPER_GEMM=1); five processes",
             compiles="about 10 per Triton job (pinned: one config per launcher and variant), 4 for cuBLAS's"),
        Step("time", 45, "forward + backward, M 8192, 1024, then 256 while time is left (_cases.FIRST_CASES)",
             grows=True, compiles="none new (the correct step's kernels, Triton's disk cache)"),
        # 50 s: the H200's first call (two keys' checks in children) was past its 40 s cap; the rest of the first
        # call's cost is written per key as each ends
        Step("race", 50, "backend='auto' at M 8192: its first call checks and times the candidates in a child "
                         "process (dorafp8/backends/race.py); the verdicts, the pick and what that first call cost",
             compiles="the child's: the correct step's kernels again at M 8192 and 37 (Triton's disk cache)"),
        Step("profile", 25, "torch.profiler per kernel: W8A16, W8A8 and the cuBLAS strategy, forward + backward at "
                            "M 8192",
             compiles="none new"),
        # 35 s: the H200's had written its 8 rows within its 25 s cap and was killed there while exiting (now out at
        # once: first_contact.main); the rows took about 24 s of it
        Step("host", 35, "where a call's time goes, at M 256 and 8192: wall time synced each call, the host's "
                         "enqueue time, the GPU's (torch.profiler) and its launches, the host's time in Triton's "
                         "launch path; dorafp8-triton, dorafp8-cublas, PEFT DoRA, the bf16 Linear; then "
                         "dorafp8-triton and the bf16 Linear captured in a CUDA graph (bench/_graph.py: the replay "
                         "checked against an eager call first) and replayed",
             compiles="none new"),
    ),
    "more": (
        # 30 s: this command's took 23.2 s on the H200 (a whole record lets the steps go on past the cap)
        Step("env", 30, "as in command 1"),
        # 150 s: the H200's took 134.3 s beside the tests' 12 processes
        Step("build", 150, "the CUDA extension for this GPU (setup.py build_ext --inplace)", background=True, gpu=True,
             compiles="nvcc: the extension's translation units for this GPU's arch"),
        # 150 s: the whole of tests/kernels takes ~430 s (H200, 16 processes): the files in an order of value
        # (_first_steps.KERNEL_TESTS), each failure recorded as it comes
        Step("tests", 150, "pytest tests/kernels on the GPU (but test_cuda.py and the CPU emulator's), 12 processes",
             compiles="every kernel variant the tests meet, pinned configs"),
        # 45 s: the H200's (8 processes importing torch and the extension) was past its cap of 35
        Step("tests-cuda", 45, "pytest tests/kernels/test_cuda.py, DORAFP8_REQUIRE_CUDA_EXT=1", after="build",
             gpu=True),
        # 50 s: the H200's halves were past their 10 s shares of 40 (the CUDA one by its exit, the Triton one at
        # its second test): the CUDA one first with at most 15 s, the Triton one the rest
        Step("sanitizer", 50, "compute-sanitizer memcheck on a ragged fp16 shape of the Triton and CUDA kernels",
             gpu=True, compiles="the ragged fp16 variants under the sanitizer"),
        # 10 s: it takes what is left (48.7 s on the H200, cut in the autotuning all the same)
        Step("grid", 10, "the rest: dropout, the autotuned configs, the CUDA backend", grows=True,
             compiles="the autotuned lists (no pins): the most of any step; it stops at its cap"),
    ),
}
RESULTS = {"first": "first_contact.json", "more": "more.json"}


def plan(command: str) -> list[tuple[Step, int, int]]:
    """(step, worst-case start, worst-case end) in seconds from the command's start: every step takes its cap."""
    t, ends, out = 0, {}, []
    for s in STEPS[command]:
        start = max(t, ends.get(s.after, 0))
        ends[s.name] = start + s.cap
        if not s.background:
            t = ends[s.name]
        out.append((s, start, ends[s.name]))
    return out


def worst_case(command: str) -> int:
    return max(end for _, _, end in plan(command)) + SPARE_S


def plan_text() -> str:
    lines = ["bench/first_contact.py, the plan (DRY_RUN=1: nothing runs; worst case: every step takes its cap)"]
    for command, how in (("first", "python3 bench/first_contact.py"), ("more", "python3 bench/first_contact.py "
                                                                              "--more")):
        lines.append(f"command {command}: {how}   [device tool: timeout_s={COMMAND_S}]")
        for s, start, end in plan(command):
            tags = [t for t, on in (("background", s.background), (f"after {s.after}", s.after),
                                    ("takes what is left", s.grows)) if on]
            lines.append(f"  {s.name:<10} {start:4d}-{end:4d} s  cap {s.cap:3d} s  {s.what}"
                         + (f" ({', '.join(tags)})" if tags else "") + f"; compiles: {s.compiles}")
        lines.append(f"  worst case {worst_case(command)} s (steps + {SPARE_S} s spare) of the command's {COMMAND_S} s")
    total = START_S + COMMAND_S + IDLE_S + COMMAND_S + IDLE_S
    lines.append(f"session: one machine start {START_S} s + command first {COMMAND_S} s + idle {IDLE_S} s + command "
                 f"more {COMMAND_S} s + idle {IDLE_S} s = {total} s of the {SESSION_S} s of device time")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Results: one JSON file, updated in place by the parent and every child


# ---------------------------------------------------------------------------------------------------------------
# The parent: runs the steps


def commit() -> str:
    if os.environ.get("DORAFP8_COMMIT"):
        return os.environ["DORAFP8_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def shim() -> str | None:
    """Makes dorafp8.triton_kernels importable from this checkout without installing it; what it did, or None."""
    link = os.path.join(ROOT, "dorafp8", "triton_kernels")
    if os.path.exists(link):
        return None
    try:
        importlib.metadata.distribution("dorafp8")
        return None  # installed: its mapping serves (the env step checks it is this checkout)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:  # a failure is said in the plan, and the env step stops the command with one line (it raised before both)
        if os.path.lexists(link):  # a dangling link (exists() follows it): a copy of the tree elsewhere left it
            os.remove(link)
        os.symlink(os.path.join("..", "triton_kernels"), link)
    except OSError as e:  # a read-only tree
        return f"could not link {link} -> ../triton_kernels ({type(e).__name__}: {e})"
    return f"linked {link} -> ../triton_kernels (nothing installed maps it)"


def child_env(work: str, results: str, smoke: bool, step: Step) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
               PYTHONUNBUFFERED="1", MPLBACKEND="Agg", FIRST_CONTACT_WORK=work, FIRST_CONTACT_RESULTS=results,
               FIRST_CONTACT_SMOKE="1" if smoke else "0", DORAFP8_RACE="0", DORAFP8_COMMIT=commit())
    env.pop("DORAFP8_BACKEND", None)  # every provider names its backend
    if smoke and step.name == "host":  # its Triton providers under the interpreter: CI runs the Triton launch clock
        env["TRITON_INTERPRET"] = "1"
    return env


RUNNING: list = []  # the step processes this command started


def start(step: Step, job: str | None, env: dict, log) -> subprocess.Popen:
    """A step's child, in a process group of its own (stop() ends it with what it started: pytest's workers)."""
    argv = [sys.executable, os.path.abspath(__file__), "--step", step.name] + (["--job", job] if job else [])
    pins = os.path.join(env["FIRST_CONTACT_WORK"], "pins.json")
    if os.path.exists(pins) and step.name != "grid":  # the grid times the autotuned configs
        argv += ["--pins", pins]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    RUNNING.append(proc)
    return proc


def _terminated(signum, frame):
    """SIGTERM / SIGINT: the steps still running are stopped; what they and the others wrote stays."""
    stop(RUNNING)
    raise SystemExit(128 + signum)


def stop(procs) -> None:
    """SIGINT to each process group still running (pytest prints its summary), SIGKILL after KILL_GRACE_S."""
    for sig, wait in ((signal.SIGINT, KILL_GRACE_S), (signal.SIGKILL, 5)):
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + wait
        while any(p.poll() is None for p in alive) and time.monotonic() < end:
            time.sleep(0.1)


def wait(procs, until: float) -> bool:
    """Waits for every process until the monotonic time `until`; False (all of them stopped) if that came first."""
    while any(p.poll() is None for p in procs):
        if time.monotonic() >= until:
            stop(procs)
            return False
        time.sleep(0.2)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--more", action="store_true", help="command 2 (optional): tests, sanitizer, the rest")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, reference / native backends")
    ap.add_argument("--step", help=argparse.SUPPRESS)  # a child: run this step
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--pins", help=argparse.SUPPRESS)  # a child: the pins step's file (_pins.pin_configs)
    args = ap.parse_args(argv)
    if os.environ.get("DRY_RUN") == "1":
        print(plan_text())
        return 0
    if args.step:
        import _first_steps

        if args.pins:  # the launchers in this step's process run the model's picks alone
            from dorafp8.triton_kernels._pins import pin_configs

            with open(args.pins) as f:
                pin_configs(json.load(f))
        rc = _first_steps.run(args.step, args.job)
        # Out at once, its results written: the H200's host step had printed all its rows and was killed at its cap
        # while the interpreter exited (rc -2: SIGINT after Python's handler was gone, in CUDA's and the profiler's
        # teardown), and a cold H200's env step likewise
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return run_command("more" if args.more else "first", args.smoke)


def run_command(command: str, smoke: bool) -> int:
    t0 = time.monotonic()
    signal.signal(signal.SIGTERM, _terminated)
    signal.signal(signal.SIGINT, _terminated)
    try:
        only, caps = knobs(command)
    except ValueError as e:
        print(f"first_contact: {e}", file=sys.stderr)
        return 2
    out = os.path.abspath(os.environ.get("OUT") or os.path.join(ROOT, "bench_out", "first_contact"))
    os.makedirs(out, exist_ok=True)
    results = os.path.join(out, RESULTS[command])
    set_aside(results)
    work = tempfile.mkdtemp(prefix="first_contact-")  # the steps' race cache and pins: this run's alone, removed after
    try:
        return _run_steps(command, smoke, t0, out, results, work, only, caps)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def set_aside(results: str) -> str | None:
    """An earlier run's results file in $OUT is renamed <name>.<its time>.json (kept, and the path said): publish()
    merges into the file it finds, so a rerun's file held the earlier run's checks and steps under this run's commit,
    and save_results.py credited them to it."""
    if not os.path.exists(results):
        return None
    base, ext = os.path.splitext(results)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(os.path.getmtime(results)))
    aside, n = f"{base}.{stamp}{ext}", 1
    while os.path.exists(aside):
        aside, n = f"{base}.{stamp}-{n}{ext}", n + 1
    os.replace(results, aside)
    print(f"first_contact: an earlier run's {os.path.basename(results)} is kept as {aside}", file=sys.stderr)
    return aside


def knobs(command: str) -> tuple[list[str], dict[str, float]]:
    """FIRST_CONTACT_STEPS and FIRST_CONTACT_CAPS, checked before anything runs: a misspelt step name ran none of the
    steps and said done, and a cap not STEP=SECONDS died with a traceback after the plan was written."""
    names = [s.name for s in STEPS[command]]
    only = [s for s in os.environ.get("FIRST_CONTACT_STEPS", "").split(",") if s]
    caps = {}
    for kv in filter(None, os.environ.get("FIRST_CONTACT_CAPS", "").split(",")):
        name, _, seconds = kv.partition("=")
        try:
            caps[name] = float(seconds)
        except ValueError:
            raise ValueError(f"FIRST_CONTACT_CAPS: {kv!r} is not STEP=SECONDS (e.g. time=30)") from None
    bad = [n for n in only + list(caps) if n not in names]
    if bad:
        raise ValueError(f"FIRST_CONTACT_STEPS / FIRST_CONTACT_CAPS name {bad}, not steps of command {command}: "
                         f"{', '.join(names)}")
    return only, caps


def _run_steps(command: str, smoke: bool, t0: float, out: str, results: str, work: str, only: list[str],
               caps: dict[str, float]) -> int:
    steps = [s for s in STEPS[command] if not only or s.name in only]
    deadline = t0 + COMMAND_S - SPARE_S if not smoke else float("inf")
    publish(results, "plan", None, {"command": command, "smoke": smoke, "commit": commit(), "shim": shim(),
                                    "steps": [dataclasses.asdict(s) for s in steps], "command_s": COMMAND_S,
                                    "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    log = open(os.path.join(out, "log.txt"), "a")
    background, failed = {}, False
    for i, step in enumerate(steps):
        now = time.monotonic()
        later = sum(s.cap for s in steps[i + 1:] if not s.background)
        cap = min(deadline - now - later if step.grows else step.cap, deadline - now, float(caps.get(step.name, 1e9)))
        if smoke:
            cap = min(float(caps.get(step.name, SMOKE_HANG_S)), SMOKE_HANG_S)
        note = dict(cap_s=round(cap, 1))
        if step.gpu and smoke:
            publish(results, "steps", step.name, dict(note, status="skipped", why="no GPU (--smoke)"))
            continue
        if cap < 1:
            publish(results, "steps", step.name, dict(note, status="skipped", why="no time left"))
            continue
        if step.after in background:  # wait for it as long as this step still gets its cap
            proc, until = background[step.after]
            if not wait([proc], min(until, deadline - later - cap)):
                note["waited_for"] = f"{step.after}: stopped, past its cap or this step's start"
            cap = min(cap, deadline - time.monotonic() - later)
        print(f"== {step.name} (cap {cap:.0f} s)", file=log, flush=True)
        env = dict(child_env(work, results, smoke, step), FIRST_CONTACT_CAP_S=str(round(cap)),
                   FIRST_CONTACT_STARTED=f"{time.time():.3f}")
        jobs = ("w8a16", "w8a8") + (() if smoke else ("cublas", "w8a16-ws", "w8a8-ws")) if step.name == "correct" \
            else (None,)
        procs = [start(step, job, env, log) for job in jobs]
        if step.background:
            background[step.name] = (procs[0], time.monotonic() + cap)
            publish(results, "steps", step.name, dict(note, status="started"))
            continue
        ok = wait(procs, time.monotonic() + cap)
        rcs = [p.returncode for p in procs]
        status = "ok" if ok and not any(rcs) else "timeout" if not ok else "failed"
        failed |= status != "ok"
        publish(results, "steps", step.name, dict(note, status=status, rc=rcs, seconds=round(time.monotonic() - now,
                                                                                             1)))
        print(f"== {step.name}: {status} (rc {rcs})", file=log, flush=True)
        if step.name == "env" and status != "ok":
            # What the later steps need is the env record, not the child's exit: on a cold H200 the child wrote a
            # whole record and printed it, then ran past its 20 s cap while exiting, and that stopped the command.
            with open(results) as f:
                record = json.load(f).get("env", {})
            if "error" in record or "device" not in record:
                why = record.get("error", f"the env step ended {status} (rc {rcs}): see log.txt")
                print(f"first_contact: stopped: {why}", file=sys.stderr)
                return 3
            print("== env: its record is whole, so the steps go on", file=log, flush=True)
    for name, (proc, until) in background.items():  # a background step nothing waited for
        ok = wait([proc], min(until, deadline))
        publish(results, "steps", name, dict(status="ok" if ok and proc.returncode == 0 else
                                             "timeout" if not ok else "failed", rc=[proc.returncode]))
    print(f"first_contact: {command} done in {time.monotonic() - t0:.0f} s; results in {results}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    sys.exit(main())
