"""bench/gpu_session.sh (a first GPU session as three device calls), the decisive preset and bench/save_results.py,
checked on CPU: no GPU runs here, so what is checked is the plan and the machinery, never a speed.

- The plan (`DRY_RUN=1 bash bench/gpu_session.sh all`): each call's steps in the order issue 26 asks (call 1: the
  build and the warm-up beside each other, then the decisive benchmark, then compute-sanitizer; call 2: the GPU
  tests; call 3: the rest of the headline grid), the warm-up compiling exactly the preset the benchmark after it
  runs, each call within the device tool's 600 s a command, the three with a machine start and the idle time each
  within a session's 1800 s, every step within its call's budget, the decisive benchmark keeping its whole cap even
  when every step before it takes its whole cap, every step running when they take their predicted times, and a dry
  run touching nothing.
- The machinery: real calls 1 and 3 in a scratch copy of the checkout, with stand-ins for python3, nvidia-smi, nvcc,
  compute-sanitizer and ncu on PATH that log when they start and end: the steps start in the planned order, the
  benchmark's results reach $OUT within seconds of being saved, at most 8 files come back, and save_results.py turns
  what came back into bench/results/<device>/ and README's performance table.
- The decisive preset through bench/run.py's case listing, --exclude-preset, --shard and --compile-only.

The device tool's limits are typed in here from its documentation, not read from the script.
"""

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench")
SCRIPT = os.path.join(BENCH, "gpu_session.sh")
sys.path.insert(0, BENCH)

import _cases as C  # noqa: E402

CALL_LIMIT_S = 600      # one command on the device machine
SESSION_LIMIT_S = 1800  # a session's device time, machine starts and idle time included
WARM_IDLE_S = 30        # a machine stays warm (and counts) this long after a call
MIN_START_S = 60        # "a call that finds no warm machine spends a minute or more starting one"
MAX_FILES = 8           # files that come back from $OUT

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")


def _plan(*args, env=None):
    e = dict(os.environ, DRY_RUN="1", **(env or {}))
    for k in ("STEPS", "BUDGET_S", "OUT", "STAGE", "PREDICT", "NCU"):
        if k not in (env or {}):
            e.pop(k, None)
    proc = subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, env=e, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _fields(line):
    head, _, cmd = line.partition(" :: ")
    d = dict(re.findall(r'(\w+)=("[^"]*"|\S+)', head))
    d = {k: v.strip('"') for k, v in d.items()}
    for k, v in d.items():
        if re.fullmatch(r"-?\d+", v):
            d[k] = int(v)
    d["cmd"] = cmd
    return d


def _parse(text):
    calls, session = {}, None
    for line in text.splitlines():
        if line.startswith("plan "):
            f = _fields(line)
            calls[f["call"]] = dict(f, steps=[], end=None)
        elif line.startswith("step "):
            f = _fields(line)
            f["base"] = f["name"].split("[")[0]
            calls[f["call"]]["steps"].append(f)
        elif line.startswith("end "):
            f = _fields(line)
            calls[f["call"]]["end"] = f
        elif line.startswith("session "):
            session = _fields(line)
    return calls, session


@pytest.fixture(scope="module")
def plan():
    return _parse(_plan("all"))


def _order(call):
    return list(dict.fromkeys(s["base"] for s in call["steps"]))


def _one(call, base):
    steps = [s for s in call["steps"] if s["base"] == base]
    assert steps, f"call {call['call']} has no step {base}"
    return steps


def test_plan_order(plan):
    calls, _ = plan
    assert sorted(calls) == [1, 2, 3]
    assert _order(calls[1]) == ["env", "install", "build", "warm", "decisive", "sanitizer"]
    assert _order(calls[2]) == ["env", "install", "build", "tests-triton", "tests-backends"]
    assert _order(calls[3])[:5] == ["env", "install", "build", "warm", "bench"]
    assert set(_order(calls[3])[5:]) == {"ncu", "inspect"}
    for c in calls.values():
        # the build and the warm-up run beside the steps after them; everything else in the foreground
        for s in c["steps"]:
            want = "background" if s["base"] in ("build", "warm") else "part" if s["name"] == "ncu[profile]" else "fg"
            assert s["mode"] == want, s
    c1 = calls[1]
    build, warm, dec = _one(c1, "build")[0], _one(c1, "warm"), _one(c1, "decisive")[0]
    assert all(w["start"] == build["start"] for w in warm)  # the warm-up starts with the build, beside it
    assert all(w["start"] + w["gets"] <= dec["start"] for w in warm)  # and has ended (or been stopped) before timing
    san = _one(c1, "sanitizer")
    assert [s["name"] for s in san] == ["sanitizer[memcheck-cuda]", "sanitizer[racecheck-cuda]",
                                        "sanitizer[memcheck-triton]", "sanitizer[racecheck-triton]"]
    assert all(s["start"] >= dec["start"] + dec["gets"] for s in san)
    assert "tests/kernels/test_cuda.py" in san[0]["cmd"] and "--tool memcheck" in san[0]["cmd"]
    tb = _one(calls[2], "tests-backends")[0]
    assert "DORAFP8_REQUIRE_CUDA_EXT=1" in tb["cmd"] and "tests/kernels/test_cuda.py" in tb["cmd"]
    assert tb["start"] >= _one(calls[2], "tests-triton")[0]["start"] + _one(calls[2], "tests-triton")[0]["gets"]


def _run_py_args(cmd):
    """The run.py options of a command, without the timing / output / warm-up ones."""
    words = cmd.split()
    words = words[words.index("bench/run.py") + 1:]
    out, skip = [], {"--warmup", "--rep", "--out", "--shard", "--device"}
    it = iter(words)
    for w in it:
        if w in skip:
            next(it)
        elif w != "--compile-only":
            out.append(w)
    return out


def test_warm_up_compiles_what_the_benchmark_runs(plan):
    calls, _ = plan
    for call, bench in ((1, "decisive"), (3, "bench")):
        timed = _one(calls[call], bench)[0]
        warm = [s for s in _one(calls[call], "warm") if "bench/run.py" in s["cmd"]]
        assert warm, call
        n = len(warm)
        assert sorted(re.search(r"--shard (\d+)/(\d+)", s["cmd"]).groups() for s in warm) == \
            sorted((str(i), str(n)) for i in range(n))
        for s in warm:
            assert "--compile-only" in s["cmd"] and "TRITON_CACHE_AUTOTUNING=0" in s["cmd"]
            assert _run_py_args(s["cmd"]) == _run_py_args(timed["cmd"]), (s["cmd"], timed["cmd"])
        assert "TRITON_CACHE_AUTOTUNING=1" in timed["cmd"] and "--compile-only" not in timed["cmd"]
    assert _run_py_args(_one(calls[1], "decisive")[0]["cmd"]) == ["--preset", "decisive"]
    assert _run_py_args(_one(calls[3], "bench")[0]["cmd"]) == ["--preset", "headline", "--exclude-preset", "decisive"]
    # call 1 also compiles the sanitizer's Triton tests: the same file and selection as the sanitizer runs
    pre = [s for s in _one(calls[1], "warm") if "pytest" in s["cmd"]]
    run = [s for s in _one(calls[1], "sanitizer") if "test_triton_kernels.py" in s["cmd"]]
    assert len(pre) == 1 and run
    sel = re.search(r"-k ('[^']*')", pre[0]["cmd"]).group(1)
    assert all(f"-k {sel}" in s["cmd"] for s in run)


def test_budgets(plan):
    calls, session = plan
    total = 0
    for c in calls.values():
        assert c["timeout_s"] <= CALL_LIMIT_S, c
        # the last step's kill grace and the final pack fit between the budget and the call's timeout
        assert c["timeout_s"] >= c["budget"] + c["kill_grace_s"] + 10, c
        total += c["timeout_s"]
        for s in c["steps"]:
            assert s["gets"] <= s["cap"] and s["start"] + s["gets"] <= c["budget"], s
        assert c["end"]["worst_case_s"] <= c["budget"], c["end"]
    assert session["sum_timeout_s"] == total
    assert session["start_allowance_s"] >= MIN_START_S and session["idle_allowance_s"] >= WARM_IDLE_S
    assert total + 3 * (session["start_allowance_s"] + session["idle_allowance_s"]) <= SESSION_LIMIT_S
    assert session["worst_case_s"] <= SESSION_LIMIT_S
    # the decisive benchmark keeps its whole cap when every step before it takes its whole cap, and the sanitizer
    # its minimum after it
    dec = _one(calls[1], "decisive")[0]
    assert dec["gets"] == dec["cap"]
    assert _one(calls[1], "sanitizer")[0]["gets"] >= _one(calls[1], "sanitizer")[0]["need"]
    assert _one(calls[3], "bench")[0]["gets"] == _one(calls[3], "bench")[0]["cap"]


def test_predicted_plan_runs_every_step():
    """With each step taking its predicted time (PREDICTIONS, no GPU figure) calls 1 and 2 run all their steps and
    call 3 its benchmark, each call ending within its budget."""
    calls, _ = _parse(_plan("all", env={"PREDICT": "1"}))
    for n, c in calls.items():
        assert c["clock"] == "predicted" and c["end"]["predicted_s"] <= c["budget"], c
        musts = c["steps"] if n in (1, 2) else [s for s in c["steps"] if s["base"] != "inspect" and s["mode"] != "part"]
        for s in musts:
            assert s["gets"] >= s["need"], s


def test_dry_run_touches_nothing(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    for tool in ("nvidia-smi", "compute-sanitizer", "ncu", "nvcc", "python3"):
        (fake / tool).write_text(f"#!/bin/sh\ntouch {tmp_path}/ran-{tool}\n")
        (fake / tool).chmod(0o755)
    env = {"PATH": f"{fake}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"), "GPU_CACHE": str(tmp_path / "cache"),
           "STAGE": str(tmp_path / "stage")}
    for call in ("1", "2", "3"):
        text = _plan(call, env=env)
        assert f"plan call={call}" in text and str(tmp_path / "stage") in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin"]


def test_refuses_bad_calls():
    for args, env in ((["4"], {}), (["all"], {"DRY_RUN": "0"})):
        e = {k: v for k, v in os.environ.items() if k != "DRY_RUN"} | env
        proc = subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, env=e, timeout=30)
        assert proc.returncode == 2 and "gpu_session.sh" in proc.stderr, (args, proc.stderr)


def test_sanitizer_selections_select_tests():
    """The sanitizer's -k selections name tests that exist (collected on CPU; the Triton file's ids end in the device,
    cpu here and cuda on a GPU)."""
    text = _plan("1")
    cmds = {s["name"]: s["cmd"] for s in _parse(text)[0][1]["steps"]}
    for name, dev_swap in (("sanitizer[memcheck-cuda]", False), ("sanitizer[memcheck-triton]", True)):
        m = re.search(r"-rfE (\S+) -k '([^']*)'", cmds[name])
        path, sel = m.groups()
        if dev_swap:
            sel = sel.replace("cuda", "cpu")
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", path,
                               "-k", sel], cwd=ROOT, capture_output=True, text=True, timeout=300)
        n = re.search(r"(\d+)(?:/\d+)? tests? collected", proc.stdout)
        assert n and int(n.group(1)) > 0, proc.stdout[-2000:]


# ---------------------------------------------------------------------------------------------------------------
# The decisive preset, through bench/run.py


def _listing(*args):
    """The case labels `bench/run.py ARGS --dry-run` lists (its main, in this process: one torch import)."""
    import run

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert run.main([*args, "--dry-run"]) == 0
    lines = buf.getvalue().strip().splitlines()
    assert re.fullmatch(r"\d+ layer cases, \d+ model steps", lines[-1]), lines[-1]
    return lines[:-1]


def test_decisive_preset():
    cases = C.DECISIVE_CASES
    assert 20 <= len(cases) <= 28 and len(set(cases)) == len(cases)
    assert {(c.shape, c.rank, c.dtype) for c in cases} == {("4096x4096", 16, "bf16")}
    assert cases[0] == C.Case("dorafp8-triton", "fwd+bwd-cachednorm", 4096, 4096, 8192, 16, "bf16", 0.0)
    provs = {c.provider for c in cases}
    assert {"dorafp8-triton", "dorafp8-triton-w8a8", "peft-dora", "peft-dora-fp8-dequant", "linear-bf16"} <= provs
    assert {c.tokens for c in cases} >= {256, 8192} and {c.dropout for c in cases} == {0.0, 0.05}
    for prov in ("dorafp8-triton", "dorafp8-triton-w8a8"):  # W8A16 and W8A8: forward and forward + backward,
        modes = {(c.mode, c.tokens, c.dropout) for c in cases if c.provider == prov}  # cached, at 8192 and 256
        assert {("fwd-cachednorm", 8192, 0.0), ("fwd+bwd-cachednorm", 8192, 0.0), ("fwd+bwd", 8192, 0.0),
                ("fwd+bwd-cachednorm", 8192, 0.05), ("fwd+bwd-cachednorm", 256, 0.0)} <= modes, prov
    for prov in ("peft-dora", "peft-dora-fp8-dequant", "linear-bf16"):  # every baseline forward and fwd + bwd
        assert {(c.mode, c.tokens) for c in cases if c.provider == prov} >= {("fwd", 8192), ("fwd+bwd", 8192)}, prov
    for c in cases:
        assert c.provider in C.PROVIDERS and c.mode in C.LAYER_MODES
        assert c.mode not in C.CACHED_MODES or c.provider.startswith("dorafp8-"), c  # PEFT has no cached norm
        assert c.dropout == 0 or c.provider not in C.FLOOR_PROVIDERS, c
    # bench/run.py lists them in this order, and its options narrow the list
    assert _listing("--preset", "decisive") == [c.label for c in cases]
    assert _listing("--preset", "decisive", "--tokens", "256") == [c.label for c in cases if c.tokens == 256]


def test_exclude_and_shard():
    headline = _listing("--preset", "headline")
    decisive = set(_listing("--preset", "decisive"))
    rest = _listing("--preset", "headline", "--exclude-preset", "decisive")
    assert rest == [c for c in headline if c not in decisive] and len(rest) < len(headline)
    warm = _listing("--preset", "decisive", "--compile-only")
    assert warm == [c.label for c in C.DECISIVE_CASES if c.provider in C.DORAFP8_PROVIDERS]
    shards = [_listing("--preset", "decisive", "--compile-only", "--shard", f"{i}/5") for i in range(5)]
    assert sorted(sum(shards, [])) == sorted(warm) and all(shards)
    for s in shards:  # a (provider, dropout) pair lies in one shard
        others = set(sum((t for t in shards if t is not s), []))
        pairs = {(lab.split()[0], "p=" in lab) for lab in s}
        assert not any((lab.split()[0], "p=" in lab) in pairs for lab in others)
    with pytest.raises(SystemExit, match="--shard must be I/N"):
        _listing("--preset", "decisive", "--shard", "5/5")


def test_compile_only_calls_once_untimed(tmp_path):
    """--compile-only on CPU (reference backend and the Triton interpreter, one tiny case each): a record per
    dorafp8 case, status 'compiled', no time; PEFT and the floors left out."""
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "run.py"), "--smoke", "--compile-only", "--providers",
                           "dorafp8-reference,dorafp8-triton,peft-dora,linear-bf16", "--modes", "fwd+bwd",
                           "--tokens", "16", "--dropouts", "0", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={k: v for k, v in os.environ.items() if k not in ("DORAFP8_BACKEND", "DORAFP8_POISON")})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads((tmp_path / "results.json").read_text())
    assert [(r["provider"], r["status"], r["ms"]) for r in res["records"]] == [
        ("dorafp8-reference", "compiled", None), ("dorafp8-triton", "compiled", None)]
    assert not (tmp_path / "results.md").exists()


# ---------------------------------------------------------------------------------------------------------------
# The machinery, with stand-ins for the GPU tools

STUB_PY = r"""#!/usr/bin/env bash
# python3 stand-in: logs when it starts and ends, and does what gpu_session.sh needs of each command, fast.
ARGS="$*"
# $EPOCHREALTIME, not $(date ...): a date forked inside the EXIT trap can be killed with the stand-in's process group,
# which left "END  bench/run.py ..." lines without a time (seen under load); LC_ALL=C: a decimal point, not a comma
LC_ALL=C
echo "START $EPOCHREALTIME $ARGS" >> "$STUB_LOG"
trap 'echo "END $EPOCHREALTIME $ARGS" >> "$STUB_LOG"' EXIT
trap 'exit 130' INT TERM
nap() { sleep "$1" & wait $!; }  # interruptible: a signal from timeout ends it at once
arg() { local want=$1; shift; while [ $# -gt 0 ]; do [ "$1" = "$want" ] && { echo "$2"; return; }; shift; done; }
case "$1" in
  -c) case "$2" in
        *"import xdist"*|*pytest_timeout*) exit 1 ;;
        *triton_kernels*) echo /not/here ;;
        *unavailable_reason*) echo "dorafp8._C imports and runs here (stand-in)" ;;
        *"measured of"*) "$REAL_PY" "$@" ;;  # the script's count of a cut run's records: real Python
        *) echo "stand-in" ;;
      esac ;;
  -m) case "$2" in
        pip) echo "Successfully installed dorafp8 (stand-in)" ;;
        pytest) sleep 0.2; echo "3 passed in 0.20s" ;;
        dorafp8.kernel_report) echo "[]" ;;
      esac ;;
  setup.py) lib=$(arg --build-lib "$@"); nap "${STUB_BUILD_SLEEP:-3}"; mkdir -p "$lib/dorafp8"; echo so > "$lib/dorafp8/_C.stub.so"
            echo '{"cuda_extension": "stand-in"}' > "$lib/dorafp8/_build_info.json"; echo "built (stand-in)" ;;
  bench/run.py)
    out=$(arg --out "$@"); mkdir -p "$out"
    if [[ " $* " == *" --compile-only "* ]]; then nap "${STUB_WARM_SLEEP:-1}"; echo "1/1 cases compiled or skipped in 1.0 s; 0 errors/oom"
    else
      name=decisive; [[ " $* " == *" --exclude-preset "* ]] && name=bench
      cp "$STUB_DIR/$name.partial.json" "$out/results.json.tmp" && mv "$out/results.json.tmp" "$out/results.json"
      for i in $(seq 1 40); do  # how long until the packer has put it into $OUT
        if [ -f "$STUB_OUT/${name}_results.json" ]; then echo "SEEN $name $i" >> "$STUB_LOG"; break; fi; sleep 0.25
      done
      [ -n "${STUB_BENCH_RC:-}" ] && exit "$STUB_BENCH_RC"  # cut after its first case
      cp "$STUB_DIR/$name.full.json" "$out/results.json.tmp" && mv "$out/results.json.tmp" "$out/results.json"
      echo "# results (stand-in)" > "$out/results.md"; echo "N/N cases measured in 1.0 s; 0 errors/oom; wrote"
    fi ;;
  bench/ncu_profile.py) [ "$2" = find ] && echo '{"slowest": "stub_kernel"}' > "$(arg --json "$@")"
                        [ "$2" = summarize ] && echo "gpu__time_duration 1 us" ;;
esac
exit 0
"""
STUB_TOOLS = {
    "nvidia-smi": 'case "$*" in *compute_cap*--format=csv,noheader*) echo 9.0 ;; *) echo "name, driver"; '
                  'echo "Stand-in GPU, 0" ;; esac',
    "nvcc": 'echo "Cuda compilation tools, release 0.0 (stand-in)"',
    "compute-sanitizer": 'LC_ALL=C; echo "START $EPOCHREALTIME compute-sanitizer $*" >> "$STUB_LOG"; '
                         '[ "$1" = --version ] || echo "========= ERROR SUMMARY: 0 errors"',
    "ncu": 'case "$*" in *--version*) echo stand-in ;; *" -o "*) o=$(echo "$*" | sed "s/.* -o \\([^ ]*\\) .*/\\1/"); '
           'touch "$o.ncu-rep" ;; *) echo "gpu__time_duration 1 us" ;; esac',
}
DEVICE = "Stand-in GPU (not a measurement)"


def _record(case, ms):
    """A results.json record as run.py writes one, with a stand-in time (the test's input, not a measurement)."""
    flops, nbytes = C.work(case)
    return dict(device=DEVICE, torch="0", triton="0", commit="unknown", date="2000-01-01", provider=case.provider,
                mode=case.mode, shape=case.shape, in_features=case.in_features, out_features=case.out_features,
                tokens=case.tokens, rank=case.rank, dtype=case.dtype, dropout=case.dropout,
                weight_dtype=C.weight_storage(case.provider, case.dtype),
                adapter_dtype=C.adapter_dtype(case.provider, case.dtype), status="ok", ms=ms, flops=flops,
                bytes=nbytes, tflops=flops / (ms * 1e-3) / 1e12, gbps=nbytes / (ms * 1e-3) / 1e9,
                roofline_ms={d: None for d in C.PEAKS}, roofline_bound={d: None for d in C.PEAKS}, x_roofline=None,
                peak_mem_bytes=1 << 20, peak_extra_bytes=1 << 19, weight_bytes=1 << 20, timing="stand-in",
                note="stand-in", wall_s=0.0)


def _results(cases, first_ms):
    meta = dict(device=DEVICE, device_type="cuda", driver="0", roofline_device=None, peaks=C.PEAKS, torch="0",
                cuda="0", triton="0", peft="0", transformers="0", dorafp8="0", commit="unknown", date="2000-01-01",
                timing="stand-in", speed_claims=True, triton_interpret=False, l2_bytes=None, copy_gbps=None,
                wall_s=1.0)
    return dict(meta=meta, args={}, records=[_record(c, first_ms + i / 8) for i, c in enumerate(cases)])


def _scratch(base):
    """A scratch copy of what gpu_session.sh reads of the checkout, the stand-ins, and their canned results."""
    repo, stub, bin_ = base / "repo", base / "stub", base / "bin"
    for d in (repo / "bench", repo / "dorafp8", stub, bin_):
        d.mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "bench")
    shutil.copy(os.path.join(ROOT, "setup.py"), repo)
    shutil.copytree(os.path.join(ROOT, "csrc"), repo / "csrc")
    rest = [c for c in C.default_cases("headline") if c not in set(C.DECISIVE_CASES)][:6]
    for name, cases, first in (("decisive", list(C.DECISIVE_CASES), 1.0), ("bench", rest, 10.0)):
        (stub / f"{name}.partial.json").write_text(json.dumps(_results(cases[:1], first)))
        (stub / f"{name}.full.json").write_text(json.dumps(_results(cases, first)))
    (bin_ / "python3").write_text(STUB_PY)
    for tool, body in STUB_TOOLS.items():
        (bin_ / tool).write_text(f"#!/usr/bin/env bash\n{body}\n")
    for f in bin_.iterdir():
        f.chmod(0o755)
    return repo


def _call(base, repo, call, tag, **env_extra):
    """One real call of the scratch checkout's gpu_session.sh with the stand-ins first on PATH."""
    out, log, bin_ = base / f"out{tag}", base / f"log{tag}", base / "bin"
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", PYTHON=str(bin_ / "python3"), OUT=str(out),
               STUB_LOG=str(log), STUB_DIR=str(base / "stub"), STUB_OUT=str(out), GPU_CACHE=str(base / "cache"),
               WARM_JOBS="3", REAL_PY=sys.executable, STAGE=str(base / f"stage{tag}" / f"session-call{call}"), **env_extra)
    for k in ("DRY_RUN", "STEPS", "BUDGET_S", "PREDICT", "TRITON_CACHE_DIR"):
        if k not in env_extra:
            env.pop(k, None)
    proc = subprocess.run(["bash", str(repo / "bench" / "gpu_session.sh"), call], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return dict(out=out, log=log.read_text(), stdout=proc.stdout)


@pytest.fixture(scope="module")
def stub_session(tmp_path_factory):
    """Calls 1 and 3 of gpu_session.sh, one after the other on the same "machine" (its cache kept)."""
    base = tmp_path_factory.mktemp("session")
    repo = _scratch(base)
    return dict(base=base, repo=repo, runs={call: _call(base, repo, call, call) for call in ("1", "3")})


def _events(log):
    """[(START|END, time, command words)] of the stand-ins' log."""
    out = []
    for line in log.splitlines():
        kind, t, *words = line.split()
        if kind in ("START", "END"):
            out.append((kind, float(t), words))
    return out


def _first(events, kind, pred):
    ts = [t for k, t, w in events if k == kind and pred(w)]
    assert ts, (kind, pred)
    return min(ts)


def _last(events, kind, pred):
    return max(t for k, t, w in events if k == kind and pred(w))


def test_call1_machinery(stub_session):
    run = stub_session["runs"]["1"]
    ev = _events(run["log"])

    def timed(w):
        return "bench/run.py" in w and "--compile-only" not in w

    def warm(w):
        return "--compile-only" in w

    def build(w):
        return "setup.py" in w

    install = _first(ev, "START", lambda w: w[:2] == ["-m", "pip"])
    assert install < _first(ev, "START", build) and install < _first(ev, "START", warm)
    # the build and the warm-up overlap; the timed run starts after both have ended; the sanitizer after it
    assert _first(ev, "START", warm) < _last(ev, "END", build)
    assert _first(ev, "START", timed) >= max(_last(ev, "END", warm), _last(ev, "END", build))
    assert len([1 for k, _, w in ev if k == "START" and warm(w)]) == 3  # WARM_JOBS shards
    # and the sanitizer's Triton tests, compiled beside them
    assert _first(ev, "START", lambda w: "pytest" in w and "tests/kernels/test_triton_kernels.py" in w) \
        < _first(ev, "START", timed)
    san = [t for k, t, w in ev if k == "START" and w[0] == "compute-sanitizer" and "--tool" in w]
    assert len(san) == 4 and min(san) >= _last(ev, "END", timed)
    # the first saved record reached $OUT within ~2 s (the packer's period), before the run went on
    seen = re.search(r"SEEN decisive (\d+)", run["log"])
    assert seen and int(seen.group(1)) <= 14, run["log"]
    files = sorted(p.name for p in run["out"].iterdir())
    assert len(files) <= MAX_FILES, files
    assert {"session.tar.gz", "summary.md", "session.log", "decisive_results.json", "decisive_results.md"} <= set(files)
    assert len(json.loads((run["out"] / "decisive_results.json").read_text())["records"]) == len(C.DECISIVE_CASES)
    summary = (run["out"] / "summary.md").read_text()
    for row in ("| env | 0 |", "| install | 0 |", "| build | 0 |", "| warm | 0 |", "| decisive | 0 |",
                "| sanitizer memcheck cuda | 0 |", "| sanitizer racecheck triton | 0 |"):
        assert row in summary, summary
    # the extension was renamed into the package, and kept in the cache with the key of its sources
    assert (stub_session["repo"] / "dorafp8" / "_C.stub.so").is_file()
    assert (stub_session["base"] / "cache" / "lib" / "build.key").read_text().strip()


def test_call3_reuses_build_and_runs_the_rest(stub_session):
    run = stub_session["runs"]["3"]
    ev = _events(run["log"])
    assert not [w for k, _, w in ev if k == "START" and "setup.py" in w]  # built by call 1 on this "machine"
    assert "reused" in (run["out"] / "session.log").read_text()
    timed = _first(ev, "START", lambda w: "--exclude-preset" in w and "--compile-only" not in w)
    assert timed >= _last(ev, "END", lambda w: "--compile-only" in w)
    assert _first(ev, "START", lambda w: "bench/ncu_profile.py" in w) > timed
    assert {"bench_results.json", "session.tar.gz"} <= {p.name for p in run["out"].iterdir()}


def test_save_results_merges_calls_and_writes_readme(stub_session, tmp_path):
    readme = tmp_path / "README.md"
    shutil.copy(os.path.join(ROOT, "README.md"), readme)
    before = readme.read_text()
    runs = stub_session["runs"]
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "save_results.py"), str(runs["1"]["out"]),
                           str(runs["3"]["out"] / "session.tar.gz"), "--commit", "abc123", "--dest",
                           str(tmp_path / "results"), "--readme", str(readme)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    dest = tmp_path / "results" / C.device_slug(DEVICE)
    res = json.loads((dest / "results.json").read_text())
    decisive = json.loads((runs["1"]["out"] / "decisive_results.json").read_text())["records"]
    rest = json.loads((runs["3"]["out"] / "bench_results.json").read_text())["records"]
    assert len(res["records"]) == len(decisive) + len(rest)
    assert {r["run"] for r in res["records"]} == {"decisive", "bench"}
    assert {r["commit"] for r in res["records"]} == {"abc123"}
    assert [r["call"] for r in res["meta"]["runs"]] == ["call1", "call3"]
    for name in ("results.md", "session-call1.md", "session-call3.md", "plan-call1.txt", "README.md"):
        assert (dest / name).is_file(), name
    assert (dest / "logs" / "call1").is_dir()
    # README: only the block between the markers changed, and it holds the headline row's numbers
    text = readme.read_text()
    b, e = "<!-- BEGIN perf-table", "<!-- END perf-table -->"
    assert text[:text.index(b)] == before[:before.index(b)] and text[text.index(e):] == before[before.index(e):]
    block = text[text.index(b):text.index(e)]
    assert "No GPU figures" not in block and DEVICE in block
    ms = {(r["provider"], r["mode"], r["tokens"], r["dropout"]): r["ms"] for r in decisive}
    mine, peft = ms[("dorafp8-triton", "fwd+bwd-cachednorm", 8192, 0.0)], ms[("peft-dora", "fwd+bwd", 8192, 0.0)]
    row = next(line for line in block.splitlines() if line.startswith("| fwd+bwd, norm cached | 8192 | 0 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3] == f"{mine:.3f}" and cells[6] == f"{peft:.3f}" and cells[-1] == f"{peft / mine:.2f}x"
    assert cells[8] == f"{ms[('linear-bf16', 'fwd+bwd', 8192, 0.0)]:.3f}"


def test_overruns_are_cut_and_said(tmp_path):
    """A warm-up past its time is stopped (by its own timeout, or failing that by the script) before the timing starts; a build still running when the benchmark must
    start is not waited for, and the benchmark's row says so; a benchmark cut after its first case keeps it in
    $OUT and says how many it measured. (Budget 212 s: the decisive step's 150 s cap and the sanitizer's 30 s
    leave the warm-up ~31 s; the stand-in build takes 40 s.)"""
    repo = _scratch(tmp_path)
    run = _call(tmp_path, repo, "1", "cut", BUDGET_S="212", STEPS="env build warm decisive", STUB_WARM_SLEEP="100",
                STUB_BUILD_SLEEP="40", STUB_BENCH_RC="3")
    ev = _events(run["log"])
    timed = _first(ev, "START", lambda w: "bench/run.py" in w and "--compile-only" not in w)
    assert _last(ev, "END", lambda w: "--compile-only" in w) <= timed  # stopped, not left beside the timing
    assert _last(ev, "END", lambda w: "setup.py" in w) > timed  # the build was not waited for past its limit
    summary = (run["out"] / "summary.md").read_text()
    dec = next(line for line in summary.splitlines() if line.startswith("| decisive |"))
    assert "| 3 |" in dec and "1 measured of 1 recorded" in dec and "build was still running" in dec, dec
    warm = next(line for line in summary.splitlines() if line.startswith("| warm |"))
    # 124: its own timeout fired; 130 / 143: the script stopped it (SIGINT / SIGTERM passed on by timeout)
    assert warm.split("|")[2].strip() in ("124", "130", "143", "killed"), warm
    assert any(line.startswith("| build | 0 |") for line in summary.splitlines())  # still noted, at the end
    assert len(json.loads((run["out"] / "decisive_results.json").read_text())["records"]) == 1
