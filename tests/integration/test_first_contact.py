"""bench/first_contact.py (a first GPU session: one command of at most five minutes, an optional second) and
bench/save_results.py, checked on CPU. No GPU runs here, so what is checked is the plan and the machinery, never a
speed:

- the plan against the device tool's limits (the numbers typed in here from its documentation, not read from the
  script): each command within five minutes, both with a machine start and the idle after each within a session's
  15 minutes; correctness before any timing; DRY_RUN=1 runs nothing;
- the whole first command at tiny shapes (--smoke: the reference and native backends), its results in $OUT while it
  runs, two files; the second command's CPU part;
- the fp64 check failing on a wrong result (so a pass means something), a failing step and a killed command keeping
  what came before them, a checkout dorafp8 cannot be imported from stopping the command with one line, the link that
  lets an uninstalled checkout import dorafp8.triton_kernels;
- save_results.py turning what came back into bench/results/<device>/ and README's performance table.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench")
SCRIPT = os.path.join(BENCH, "first_contact.py")
sys.path.insert(0, BENCH)

import _cases as C  # noqa: E402
import first_contact as FC  # noqa: E402

COMMAND_S = 300  # the issue: each command at most five minutes (the device tool allows ten)
SESSION_S = 900  # a session's device time: machine starts, commands and idle time together
MIN_START_S = 60  # "a call that finds no warm machine spends a minute or more starting one"
IDLE_S = 30  # a machine stays warm (and counts) this long after a call
SMOKE_JOBS = ("w8a16", "w8a8")  # --smoke's checks: native (W8A16) and reference (W8A8)


def _env(out, **extra):
    env = dict(os.environ, OUT=str(out), **extra)
    for k in ("DORAFP8_BACKEND", "DRY_RUN", "FIRST_CONTACT_STEPS", "FIRST_CONTACT_CAPS",
              "FIRST_CONTACT_PROVIDERS"):
        if k not in extra:
            env.pop(k, None)
    return env


def _results(out, name="first_contact.json"):
    with open(os.path.join(out, name)) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------------------------
# The plan


def test_plan_fits_the_session():
    for command in ("first", "more"):
        assert FC.worst_case(command) <= COMMAND_S, command
        assert FC.plan(command)[0][0].name == "env"  # the import is checked before anything else
    assert FC.START_S >= MIN_START_S and FC.IDLE_S >= IDLE_S
    assert FC.START_S + FC.worst_case("first") + IDLE_S + FC.worst_case("more") + IDLE_S <= SESSION_S
    order = [s.name for s, _, _ in FC.plan("first")]
    assert order.index("correct") < order.index("time") < order.index("profile")  # fp64 first, then the clock
    assert order.index("pins") < order.index("correct")  # the checks compile the configs the timing runs
    assert order.index("correct") < order.index("host")  # and the host step's
    # each background step has something to run beside, and what waits for it comes after it
    more = FC.plan("more")
    for s, start, end in more:
        if s.after:
            assert start >= dict((x.name, e) for x, _, e in more)[s.after], s


def test_dry_run_prints_the_plan_and_touches_nothing(tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT], env=_env(tmp_path / "out", DRY_RUN="1"), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    cases = [int(s) for s in re.findall(r"worst case (\d+) s", proc.stdout)]
    assert len(cases) == 2 and all(c <= COMMAND_S for c in cases)
    total, budget = map(int, re.search(r"= (\d+) s of the (\d+) s of device time", proc.stdout).groups())
    assert total <= budget == SESSION_S
    for s, _, _ in FC.plan("first") + FC.plan("more"):
        assert re.search(rf"^  {re.escape(s.name)} ", proc.stdout, re.M), s.name
    assert not (tmp_path / "out").exists()


def test_sanitizer_selections_select_tests():
    """compute-sanitizer's -k selections name tests that exist (collected on CPU; the Triton file's ids end in the
    device, cpu here and cuda on a GPU)."""
    import _first_steps as S

    for what, path, sel in S.SANITIZE:
        sel = sel.replace("cuda", "cpu") if what == "triton" else sel
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", path,
                               "-k", sel], cwd=ROOT, capture_output=True, text=True, timeout=300)
        n = re.search(r"(\d+)(?:/\d+)? tests? collected", proc.stdout)
        assert n and int(n.group(1)) > 0, proc.stdout[-2000:]


def test_a_check_child_that_dies_leaves_its_reason():
    """The GPU-only steps ask children (the build step: does the extension run?) and record what they print; one that
    died on an import or a CUDA error printed nothing, and the results said `"extension": []`, no reason. Its exit
    status and the end of its stderr are recorded now; what a child prints is as before."""
    import _first_steps as S

    died = S._out([sys.executable, "-c", "import sys; print('noise', file=sys.stderr); sys.exit('boom: no module')"])
    assert died.startswith("exit 1: ") and "boom: no module" in died, died
    assert S._out([sys.executable, "-c", "print('runs')"]) == "runs"


def test_pins_from_the_model_picks():
    import _first_steps as S

    rows = [dict(mode="W8A16", loop="tma-ws", kernel="forward", config="BLOCK_M=128,w8,s4"),
            dict(mode="W8A16", loop="async-copy", kernel="forward", config="BLOCK_M=64,w4,s4"),
            dict(mode="W8A8", loop="tma-ws", kernel="dgrad", config="BLOCK_M=64,w4,s3"),
            dict(mode="NVFP4 W4A16", loop="async-copy", kernel="forward", config="BLOCK_M=32,w4,s3")]
    # one config per GEMM, mode and main loop (triton_kernels/_pins.py); the microscaled bases have no pin
    assert S.pins_from(rows, "BLOCK_N=32,w4,s3") == {"forward/w8a16/tma-ws": "BLOCK_M=128,w8,s4",
                                                     "forward/w8a16/async-copy": "BLOCK_M=64,w4,s4",
                                                     "dgrad/w8a8/tma-ws": "BLOCK_M=64,w4,s3",
                                                     "weight_norm": "BLOCK_N=32,w4,s3"}


def _pins_step(monkeypatch, tmp_path, launches):
    """The pins step with the kernel report's compiles stood in (no record: no GEMM is predicted) and the dry runs'
    child replaced by `launches` (a dict, or an exception it raises); the results file it wrote."""
    import _first_steps as S

    import dorafp8.kernel_report as kr
    from dorafp8.kernel_report import predict as pr

    def dry_runs(names=None, small=(), timeout=None):
        if isinstance(launches, Exception):
            raise launches
        return launches

    monkeypatch.setattr(kr, "run", lambda **kw: [])
    monkeypatch.setattr(pr, "launches_subprocess", dry_runs)
    monkeypatch.setattr(pr, "dry_run_device", lambda: "cpu")
    monkeypatch.setattr(S, "SMOKE", True)
    monkeypatch.setattr(S, "WORK", str(tmp_path))
    monkeypatch.setattr(S, "RESULTS", str(tmp_path / "first_contact.json"))
    assert S.pins() == 0
    assert (tmp_path / "pins.json").is_file()
    return json.loads((tmp_path / "first_contact.json").read_text())


def test_pins_step_keeps_its_pins_when_the_dry_runs_fail(monkeypatch, tmp_path):
    """The first GPU run: the headline's dry runs failed (the interpreter refused) and the step failed with them. Now
    the pins and the GEMMs' predictions stay, the step ends well, and the results say why the layers are missing
    (kernels.md too). Failed on the old code: the RuntimeError left pins()."""
    import save_results as SR

    first = _pins_step(monkeypatch, tmp_path, RuntimeError("the headline dry runs failed: the interpreter refused"))
    assert "weight_norm" in first["model"]["pins"] and "layers" not in first["model"]
    assert "the interpreter refused" in first["model"]["layers_error"]
    assert "the interpreter refused" in SR.kernels_md(first)


def test_pins_step_predictions_reach_kernels_md(monkeypatch, tmp_path):
    """What the pins step writes is what save_results' kernels.md reads: per strategy, each kernel name's launches
    summed at the fast and the slow end (the fused GEMMs at their model picks). Failed on the old code: the step
    wrote layer_table's list, and kernels_md's .get() on it raised AttributeError."""
    import save_results as SR

    from dorafp8.kernel_report import predict as pr

    lc = lambda name, nbytes: dict(name=name, nbytes=nbytes, flops=0, shapes=[])  # noqa: E731
    launches = {"W8A16": [lc("triton:dora_fwd_kernel", 10**8), lc("triton:rank_pieces_kernel", 3 * 10**6),
                          lc("triton:rank_pieces_kernel", 6 * 10**6)]}
    gemm = {"lo": {"seconds": 4e-4}, "hi": {"seconds": 5e-4}}
    monkeypatch.setattr(pr, "layer_table", lambda records, lcs: [dict(name=n, gemms={"forward": gemm}) for n in lcs])
    first = _pins_step(monkeypatch, tmp_path, launches)
    first["profile"] = {"dorafp8-triton": {"M": 8192, "K": 4096, "r": 16, "iters": 5, "total_us": 600.0, "kernels": [
        {"name": "dora_fwd_kernel", "calls": 1, "us": 500.0}, {"name": "rank_pieces_kernel", "calls": 2, "us": 9.0}]}}
    pieces = [1e6 * sum(pr.launch_seconds(x, end) for x in launches["W8A16"][1:]) for end in ("lo", "hi")]
    text = SR.kernels_md(first)
    assert "| dora_fwd_kernel | 1 | 500.0 | 400.0-500.0 | 1.00-1.25x |" in text, text
    assert pieces[0] == pieces[1]  # bytes at HBM's one rate: one number, the two launches summed
    assert f"| rank_pieces_kernel | 2 | 9.0 | {pieces[0]:.1f} | {9.0 / pieces[0]:.2f}x |" in text, text


def test_pins_step_keeps_the_dry_runs_that_finished(monkeypatch, tmp_path):
    """The H200's pins step: its compiles took 23.8 s of its 45 s cap, its dry runs' child ran past the cap and every
    layer prediction was lost with them. Now the child has the cap's rest, and what it finished is kept, the rest
    named. Failed on the old code (no timeout given, nothing said of what was cut)."""
    import save_results as SR

    import _first_steps as S
    from dorafp8.kernel_report import predict as pr

    monkeypatch.setattr(S, "CAP_S", 45.0)
    monkeypatch.setattr(S, "STARTED", time.time() - 30)  # 15 s of the cap left
    asked = {}
    monkeypatch.setattr(pr, "layer_table", lambda records, lcs: [dict(name=n) for n in lcs])
    first = _pins_step(monkeypatch, tmp_path, {})  # the child killed before its first strategy's line
    assert "layers_error" not in first["model"] and first["model"]["layers"] == {}
    assert "W8A16, cp.async loop" in first["model"]["layers_cut"] and "of the step's 45 s cap" in \
        first["model"]["layers_cut"]
    assert "Not predicted: ['W8A16, cp.async loop']" in SR.kernels_md(first)

    def dry_runs(names=None, small=(), timeout=None):
        asked["timeout"] = timeout
        return {}

    monkeypatch.setattr(pr, "launches_subprocess", dry_runs)
    S.pins()
    assert 0 < asked["timeout"] <= 15


def test_dry_runs_past_their_timeout_give_the_strategies_they_finished(monkeypatch):
    """launches_subprocess(timeout=): the child prints a line per strategy as it ends; killed at the timeout, the
    ones before the kill are returned. Failed on the old code (no timeout; one line printed at the end)."""
    from dorafp8.kernel_report import predict as pr

    calls = []

    def child(argv, **kwargs):
        calls.append(kwargs.get("timeout"))
        raise subprocess.TimeoutExpired(argv, kwargs["timeout"], output=b'{"W8A16": []}\n{"W8A8": [{"na')

    monkeypatch.setattr(pr, "dry_run_device", lambda: "cpu")
    monkeypatch.setattr(subprocess, "run", child)
    assert pr.launches_subprocess(["W8A16", "W8A8"], timeout=7.5) == {"W8A16": []} and calls == [7.5]


def test_kernels_md_predictions_are_the_profiled_main_loops():
    """The profile runs the launchers' main loop (the cp.async one unless DORAFP8_HOPPER_GEMM=1): kernels.md sets its
    kernels beside that loop's predictions. Failed on the old code: the "W8A16" (tma-ws) strategy's, whichever loop
    ran; a profile from before "main_loop" was written is the first GPU run's, the Hopper loop's."""
    import save_results as SR

    kernel = lambda us: {"kernels": [dict(name="triton:dora_fwd_kernel", calls=1, predicted_us=us)]}  # noqa: E731
    model = {"pins": {}, "device": "H100", "linear_us": 1.0,
             "layers": {"W8A16": kernel(100.0), "W8A16, cp.async loop": kernel(200.0)}}
    prof = {"M": 8192, "K": 4096, "r": 16, "iters": 5, "total_us": 400.0,
            "kernels": [{"name": "dora_fwd_kernel", "calls": 1, "us": 400.0}]}
    for loop, predicted in (("async-copy", "200.0"), ("tma-ws", "100.0"), (None, "100.0")):
        text = SR.kernels_md({"model": model, "profile": {"dorafp8-triton": dict(prof, main_loop=loop) if loop
                                                          else prof}})
        assert f"| dora_fwd_kernel | 1 | 400.0 | {predicted} |" in text, (loop, text)


def test_kernels_md_sets_a_profile_beside_the_loop_it_ran(monkeypatch, tmp_path):
    """The profile runs the default cp.async loop (main_loop "async-copy", recorded since that default): kernels.md
    sets it beside that loop's predicted kernels, not the Hopper loop's (W8^T's copy, rank_pieces); a profile that
    names no loop is the Hopper loop's (the a516cbd H200 run). Failed on the old code: every dorafp8-triton profile
    was set beside the "W8A16" row, the Hopper loop's, whose transpose_w8_kernel it listed as "not seen"."""
    import save_results as SR

    from dorafp8.kernel_report import predict as pr

    lc = lambda name, nbytes: dict(name=name, nbytes=nbytes, flops=0, shapes=[])  # noqa: E731
    launches = {"W8A16": [lc("triton:transpose_w8_kernel", 32 * 2**20)],
                "W8A16, cp.async loop": [lc("triton:project_kernel", 64 * 2**20)]}
    monkeypatch.setattr(pr, "layer_table", lambda records, lcs: [dict(name=n, gemms={}) for n in lcs])
    first = _pins_step(monkeypatch, tmp_path, launches)
    prof = {"M": 8192, "K": 4096, "r": 16, "iters": 5, "total_us": 400.0,
            "kernels": [{"name": "project_kernel", "calls": 1, "us": 40.0}]}
    first["profile"] = {"dorafp8-triton": dict(prof, main_loop="async-copy")}
    text = SR.kernels_md(first)
    assert "## W8A16, cp.async loop (dorafp8-triton)" in text and "transpose_w8_kernel" not in text, text
    assert "| project_kernel | 1 | 40.0 | - |" not in text, text  # its prediction is there
    first["profile"] = {"dorafp8-triton": prof}  # no main_loop: the Hopper loop's row
    text = SR.kernels_md(first)
    assert "## W8A16 (dorafp8-triton)" in text and "transpose_w8_kernel (not seen)" in text, text


def test_a_pin_for_one_main_loop_never_narrows_the_others_list(monkeypatch):
    """The pins file held a config per GEMM and mode for both main loops ({"forward/w8a16": [tma-ws pick, cp.async
    pick]}), each launcher keeping the names its list held: where a config of the tma-ws pick's name was also in the
    cp.async list, the cp.async launch tuned over the Hopper loop's pick too (or ran it alone where the cp.async pick
    was not in its list). Each launch now takes its own loop's pin only (_pins.gemm_pin)."""
    from dorafp8.triton_kernels import _common, _pins as Pins
    from dorafp8.triton_kernels.hopper import ws_configs_for

    import _first_steps as S

    cp = _common.gemm_configs_for("sm90", "BLOCK_N", "BLOCK_K", False, 8192, False)
    ws = ws_configs_for("sm90", "BLOCK_N", "BLOCK_K", 8192)
    cp_list = cp + ws[:1]  # a cp.async list that also holds the tma-ws pick's name (none does today)
    rows = [dict(mode="W8A16", loop="tma-ws", kernel="forward", config=Pins.config_name(ws[0])),
            dict(mode="W8A16", loop="async-copy", kernel="forward", config=Pins.config_name(cp[1]))]
    monkeypatch.setattr(Pins, "_PINS", {})
    Pins.pin_configs(S.pins_from(rows, "BLOCK_N=32,w4,s3"))
    assert Pins.pinned(Pins.gemm_pin("forward", False, "async-copy"), cp_list) == [cp[1]]
    assert Pins.pinned(Pins.gemm_pin("forward", False, "tma-ws"), ws) == ws[:1]
    assert Pins.pinned(Pins.gemm_pin("forward", True, "async-copy"), cp_list) == cp_list  # W8A8: none pinned


# ---------------------------------------------------------------------------------------------------------------
# The first command at tiny shapes


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """`first_contact.py --smoke` with the sections of its results file looked at every 0.2 s while it runs."""
    out, tmp = tmp_path_factory.mktemp("first"), tmp_path_factory.mktemp("first_tmp")
    proc = subprocess.Popen([sys.executable, SCRIPT, "--smoke"], env=_env(out, TMPDIR=str(tmp)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen = []
    while proc.poll() is None:
        try:
            seen.append(set(_results(out)))
        except (OSError, ValueError):  # not written yet (a half-written file is never there: it is renamed in)
            assert not (out / "first_contact.json").exists()
        time.sleep(0.2)
    log = proc.stdout.read()
    assert proc.returncode == 0, log[-4000:]
    # its scratch folder (race cache, pins) removed, and no lock or scratch file left in the temporary folder
    assert [p.name for p in tmp.iterdir() if p.name.startswith("first_contact")] == []
    return out, _results(out), seen


def test_smoke_steps_and_files(smoke):
    out, res, _ = smoke
    assert sorted(p.name for p in out.iterdir()) == ["first_contact.json", "log.txt"]  # within the tool's 8
    steps = res["steps"]
    assert all(steps[s]["status"] == "ok" for s in ("env", "pins", "correct", "time", "race", "profile", "host")), \
        steps
    assert res["env"]["dorafp8_file"].startswith(os.path.join(ROOT, "dorafp8"))
    assert res["plan"]["smoke"] is True and not res.get("errors")
    # the pins step's layer predictions (a failure there no longer fails the step: looked at here)
    from dorafp8.triton_kernels import interpreter_problem

    if interpreter_problem() is None:
        model = res["model"]
        assert "layers_error" not in model and model["dry_runs_on"] == "cpu", model.get("layers_error")
        names = [k["name"] for k in model["layers"]["W8A16, cp.async loop"]["kernels"]]
        assert "triton:dora_fwd_kernel" in names and "triton:dora_dgrad_kernel" in names, names


def test_smoke_results_stream_to_out(smoke):
    _, _, seen = smoke
    # the checks were in $OUT while the command was still timing, and each timed case before the last
    assert any("correct" in s and "profile" not in s for s in seen), seen


def test_smoke_correctness(smoke):
    _, res, _ = smoke
    (K, N), r = (64, 96), 4
    want = {f"{j} M={M}" for j in SMOKE_JOBS for M in (32, 30)} | {f"{j} fp8_linear M=32" for j in SMOKE_JOBS}
    assert set(res["correct"]) == want
    for what, v in res["correct"].items():
        assert v["pass"] and (v["N"], v["K"], v["r"]) == (N, K, r), what
        names = ("y", "dx") if "fp8_linear" in what else ("n", "y", "dx", "dA", "dB", "dm")
        assert tuple(v["tensors"]) == names, what
        assert all(0 <= t["used"] <= 1 and t["nan"] == 0 for t in v["tensors"].values()), what
    assert res["correct"]["w8a8 M=32"]["act_quant"] == "rowwise"


def test_smoke_timing_race_profile(smoke):
    _, res, _ = smoke
    import _first_steps as S

    recs = res["timing"]["records"]
    assert res["timing"]["meta"]["speed_claims"] is False
    assert [(r["provider"], r["tokens"], r["mode"]) for r in recs] == [
        (p, M, C.first_mode(p)) for M in (32, 16) for p in S.SMOKE_PROVIDERS]
    assert all(r["status"] == "ok" and r["ms"] > 0 for r in recs)
    assert C.first_mode("dorafp8-reference") == "fwd+bwd-cachednorm" and C.first_mode("peft-lora") == "fwd+bwd"
    race = res["race"]["M=40"]
    assert race["pick"] in ("native", "reference") and set(race["ms"]) == {"native", "reference"}
    assert all(v["ok"] for v in race["verdicts"].values()) and race["race_cost_s"] > 0
    assert race["ms"][race["pick"]] <= min(race["ms"].values()) * 1.05 or race["pick"] == "native"
    prof = res["profile"]["dorafp8-reference"]
    assert prof["kernels"] and prof["total_us"] > 0 and prof["what"] == "CPU operators"


def test_smoke_host(smoke):
    """The host step on a CPU: every provider at each M, labelled as the CPU smoke it is; dorafp8-triton (the
    interpreter) and dorafp8-cublas (its Triton parts) the ones whose launches went through Triton's `run`."""
    _, res, _ = smoke
    import _first_steps as S

    host = res["host"]
    assert host["smoke"] is True and host["device"].startswith("CPU")
    assert [(r["provider"], r["M"]) for r in host["rows"]] == [(p, 16) for p in S.HOST_PROVIDERS]
    for r in host["rows"]:
        assert r["wall_us"] > 0 and r["enqueue_us"] > 0 and r["host_timed_us"] > 0, r
        assert r["gpu_us"] == r["launches"] == 0, r  # a CPU has no GPU activities
        through_triton = r["provider"].startswith("dorafp8-")
        assert (r["triton_launches"] > 0) == through_triton and (r["triton_us"] > 0) == through_triton, r
        assert 0 <= r["triton_jit_us"] <= r["triton_us"] <= r["host_timed_us"], r
    # the CUDA-graph rows (a stand-in graph on the CPU): captured, checked against an eager call, replays timed
    graph = res["graph"]
    assert graph["smoke"] is True and [(r["provider"], r["M"]) for r in graph["rows"]] == \
        [(p, 16) for p in S.GRAPH_PROVIDERS]
    for r in graph["rows"]:
        assert r["check"] == "ok" and r["replay_us"] > 0 and r["replay_enqueue_us"] > 0 and r["capture_ms"] > 0, r


def test_the_triton_clock_counts_the_outermost_run_and_lets_go(monkeypatch):
    """An Autotuner's run that runs its JITFunction's: one launch (not two), the JITFunction's time within it; the
    classes' own run methods back after the clock."""
    import _first_steps as S
    from triton.runtime import autotuner, jit

    monkeypatch.setattr(jit.JITFunction, "run", lambda self, *a, **k: "launched")  # stand-ins: no kernel, no GPU
    monkeypatch.setattr(autotuner.Autotuner, "run", lambda self, *a, **k: self.fn.run(*a, **k))
    before = {c: c.__dict__["run"] for c in (jit.JITFunction, autotuner.Autotuner)}
    tuner = autotuner.Autotuner.__new__(autotuner.Autotuner)
    tuner.fn = jit.JITFunction.__new__(jit.JITFunction)
    with S._TritonClock() as clock:
        assert [tuner.run(grid=(1,)), tuner.fn.run(grid=(1,))] == ["launched"] * 2
    assert clock.launches == 2 and clock.depth == 0 and 0 <= clock.jit_us <= clock.us
    assert all(c.__dict__["run"] is r for c, r in before.items())


def test_more_smoke(tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, "--smoke", "--more"], env=_env(tmp_path), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = _results(tmp_path, "more.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.txt", "more.json"]
    assert {s: v["status"] for s, v in res["steps"].items()} == {
        "env": "ok", "build": "skipped", "tests": "ok", "tests-cuda": "skipped", "sanitizer": "skipped", "grid": "ok"}
    assert res["tests"]["kernels"]["rc"] == 0 and res["tests"]["kernels"]["counts"]["passed"] > 0
    assert {(r["provider"], r["dropout"], r["status"]) for r in res["grid"]["dropout"]["records"]} == {
        ("dorafp8-reference", 0.05, "ok"), ("peft-dora", 0.05, "ok")}


def test_the_check_fails_a_wrong_result(monkeypatch):
    """The fp64 check is not a formality: a forward 3% off (W8A16), or one element far off (W8A8, whose bound is
    loose), fails it, and so does a NaN."""
    monkeypatch.setenv("FIRST_CONTACT_SMOKE", "1")
    import importlib

    import _first_steps as S
    import dorafp8.backends.native as native
    import dorafp8.backends.reference as reference

    S = importlib.reload(S)
    for mod, act_quant, harm in ((native, None, lambda y: y * 1.03), (reference, "rowwise", _one_far_off),
                                 (native, None, _one_nan)):
        real = mod.forward
        monkeypatch.setattr(mod, "forward", _harmed(real, harm))
        got = S.check_dora(mod.__name__.rsplit(".", 1)[1], act_quant, 32)
        assert not got["pass"] and not got["tensors"]["y"]["pass"], got["tensors"]["y"]
        monkeypatch.setattr(mod, "forward", real)
        assert S.check_dora(mod.__name__.rsplit(".", 1)[1], act_quant, 32)["pass"]


def _harmed(forward, harm):
    def wrong(*args, **kwargs):
        y, z = forward(*args, **kwargs)
        return harm(y), z
    return wrong


def _one_far_off(y):
    y = y.clone()
    y[3, 5] += 10 * y.abs().max()
    return y


def _one_nan(y):
    y = y.clone()
    y[0, 0] = float("nan")
    return y


@pytest.mark.parametrize("knobs,said", [
    (dict(FIRST_CONTACT_STEPS="env,corect"), "name ['corect'], not steps of command first: env, pins, correct"),
    (dict(FIRST_CONTACT_STEPS="build"), "name ['build'], not steps of command first"),
    (dict(FIRST_CONTACT_CAPS="time:30"), "FIRST_CONTACT_CAPS: 'time:30' is not STEP=SECONDS"),
    (dict(FIRST_CONTACT_CAPS="time=half"), "FIRST_CONTACT_CAPS: 'time=half' is not STEP=SECONDS"),
])
def test_a_misspelt_knob_is_refused_before_anything_runs(tmp_path, knobs, said):
    """FIRST_CONTACT_STEPS=env,corect ran env alone and said done (exit 0); FIRST_CONTACT_CAPS=time:30 died with a
    ValueError traceback after the plan was written. Refused by name, exit 2, nothing run or written."""
    r = subprocess.run([sys.executable, SCRIPT, "--smoke"], env=_env(tmp_path, **knobs), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and said in r.stderr, r.stdout + r.stderr
    assert not os.listdir(tmp_path)


def test_a_failing_step_keeps_earlier_results_and_the_next_step_runs(tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, "--smoke"], env=_env(
        tmp_path, FIRST_CONTACT_STEPS="env,correct,time,race", FIRST_CONTACT_PROVIDERS="linear-bf16,bogus"),
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-3000:]
    res = _results(tmp_path)
    assert {s: v["status"] for s, v in res["steps"].items()} == {
        "env": "ok", "correct": "ok", "time": "failed", "race": "ok"}
    assert "unknown providers ['bogus']" in res["errors"]["time"]
    assert len(res["correct"]) == 6 and all(v["pass"] for v in res["correct"].values())


def test_a_killed_command_keeps_what_it_finished(tmp_path):
    """Killed in the middle of the timing (SIGTERM: the command stops the step it runs), the results file still holds
    the checks, whole."""
    proc = subprocess.Popen([sys.executable, SCRIPT, "--smoke"], env=_env(tmp_path, FIRST_CONTACT_STEPS="env,correct,"
                                                                                                        "time"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        end = time.monotonic() + 300
        while time.monotonic() < end and proc.poll() is None:
            try:
                if _results(tmp_path).get("steps", {}).get("correct"):
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    res = _results(tmp_path)
    assert res["steps"]["correct"]["status"] == "ok" and len(res["correct"]) == 6
    assert "time" not in res["steps"]  # cut in the middle: no verdict, and nothing else lost


def test_a_rerun_into_the_same_out_holds_its_own_results_alone(tmp_path):
    """$OUT holding an earlier run's results (the default bench_out/first_contact, run twice): the new file holds this
    run's steps alone, and the earlier file is kept beside it. Before, publish() merged into it: the earlier run's
    passed checks stood in the new run's file under the new commit, for save_results.py to credit to it."""
    earlier = {"plan": {"commit": "earlier"}, "steps": {"correct": {"status": "ok"}},
               "correct": {"w8a16 M=1024": {"pass": True}}}
    (tmp_path / "first_contact.json").write_text(json.dumps(earlier))
    proc = subprocess.run([sys.executable, SCRIPT, "--smoke"], env=_env(tmp_path, FIRST_CONTACT_STEPS="env"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = _results(tmp_path)
    assert list(res["steps"]) == ["env"] and "correct" not in res
    kept = [p for p in tmp_path.glob("first_contact.*.json")]
    assert len(kept) == 1 and json.loads(kept[0].read_text()) == earlier
    assert str(kept[0]) in proc.stderr


def test_a_checkout_that_does_not_import_stops_at_once(tmp_path):
    shutil.copytree(BENCH, tmp_path / "bench", ignore=shutil.ignore_patterns("results", "__pycache__"))
    (tmp_path / "dorafp8").mkdir()
    (tmp_path / "dorafp8" / "__init__.py").write_text("raise ImportError('broken on purpose')\n")
    (tmp_path / "triton_kernels").mkdir()
    proc = subprocess.run([sys.executable, str(tmp_path / "bench" / "first_contact.py"), "--smoke"],
                          env=_env(tmp_path / "out"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 3
    assert proc.stderr.strip().splitlines()[-1] == (
        f"first_contact: stopped: cannot import dorafp8 from {tmp_path}: ImportError: broken on purpose")
    res = _results(tmp_path / "out")
    assert list(res["steps"]) == ["env"] and res["steps"]["env"]["status"] == "failed"


def test_an_uninstalled_checkout_gets_the_triton_kernels_link(tmp_path, monkeypatch):
    import importlib.metadata

    # not the link itself: an earlier run of the command on this checkout, before it was installed, left it there
    shutil.copytree(os.path.join(ROOT, "dorafp8"), tmp_path / "dorafp8",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "triton_kernels"))
    shutil.copytree(os.path.join(ROOT, "triton_kernels"), tmp_path / "triton_kernels",
                    ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(FC, "ROOT", str(tmp_path))

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    assert "linked" in FC.shim() and FC.shim() is None  # once
    code = "import dorafp8.triton_kernels as t, os; print(os.path.realpath(t.__file__))"
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(tmp_path)),
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.stdout.strip() == str(tmp_path / "triton_kernels" / "__init__.py"), proc.stderr[-2000:]


def test_the_link_over_a_dangling_one_and_in_a_read_only_tree(tmp_path, monkeypatch):
    """A dangling link left where the link goes (a copy of the tree moved elsewhere) is replaced, and a tree the link
    cannot be written into says so in the plan: both raised in the parent before any result was written."""
    import importlib.metadata

    (tmp_path / "dorafp8").mkdir()
    (tmp_path / "triton_kernels").mkdir()
    os.symlink("/nonexistent/triton_kernels", tmp_path / "dorafp8" / "triton_kernels")
    monkeypatch.setattr(FC, "ROOT", str(tmp_path))

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    assert "linked" in FC.shim()
    assert os.path.realpath(tmp_path / "dorafp8" / "triton_kernels") == str(tmp_path / "triton_kernels")
    os.remove(tmp_path / "dorafp8" / "triton_kernels")

    def read_only(src, dst):
        raise PermissionError(30, "Read-only file system", dst)

    monkeypatch.setattr(os, "symlink", read_only)
    assert "could not link" in FC.shim() and "Read-only" in FC.shim()


# ---------------------------------------------------------------------------------------------------------------
# save_results.py


def _record(case, ms):
    """A timing record as bench/run.py writes one, with a stand-in time (the test's input, not a measurement)."""
    flops, nbytes = C.work(case)
    return dict(tflops=flops / (ms * 1e-3) / 1e12, gbps=nbytes / (ms * 1e-3) / 1e9, device="Stand-in GPU", torch="0",
                triton="0", commit="unknown", date="2000-01-01",
                provider=case.provider, mode=case.mode, shape=case.shape, in_features=case.in_features,
                out_features=case.out_features, tokens=case.tokens, rank=case.rank, dtype=case.dtype,
                dropout=case.dropout, weight_dtype=C.weight_storage(case.provider, case.dtype),
                adapter_dtype=C.adapter_dtype(case.provider, case.dtype), status="ok", ms=ms, flops=flops,
                bytes=nbytes, roofline_ms={d: None for d in C.PEAKS},
                roofline_bound={d: None for d in C.PEAKS}, x_roofline=None, peak_mem_bytes=1, peak_extra_bytes=1,
                weight_bytes=1, timing="stand-in", note="stand-in", wall_s=0.0)


def test_save_results_leaves_no_earlier_runs_pages_beside_this_ones(tmp_path):
    """A device folder written from a run of both commands (tests.md, more.json, its log), then from a run of command 1
    alone: the earlier run's tests.md, more.json and log stood beside the new README, which names the new commit, as
    if this run's. Only this run's files are there now; a file of the user's in the folder is kept."""
    import save_results as S

    meta = dict(device="Stand-in GPU", device_type="cuda", driver="0", roofline_device=None, peaks=C.PEAKS, torch="0",
                cuda="0", triton="0", peft="0", commit="earlier", date="2000-01-01", timing="stand-in",
                speed_claims=False)
    log = tmp_path / "log.txt"
    log.write_text("a log\n")
    first, more = {"correct": {}}, {"tests": {}}
    dest = tmp_path / "stand-in-gpu"
    S.write_device(str(dest), dict(meta=meta, records=[], autotuned=[], commands={"first": first, "more": more}),
                   [("first", first, str(log)), ("more", more, str(log))])
    assert all((dest / n).is_file() for n in ("tests.md", "more.json", "logs/log-more.txt"))
    (dest / "notes.md").write_text("mine")
    written = S.write_device(str(dest), dict(meta=dict(meta, commit="now"), records=[], autotuned=[],
                                             commands={"first": first}), [("first", first, str(log))])
    assert "tests.md" not in written
    assert "host.md" not in written  # no host step in this run (nor in the H200's at a516cbd): no empty page
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()) == sorted(
        written + ["notes.md"])


def test_save_results_writes_the_device_folder_and_readme(tmp_path, smoke):
    meta = dict(device="Stand-in GPU", device_type="cuda", driver="0", roofline_device=None, peaks=C.PEAKS, torch="0",
                cuda="0", triton="0", peft="0", transformers="0", dorafp8="0", commit="unknown", date="2000-01-01",
                timing="stand-in", speed_claims=True, triton_interpret=False, l2_bytes=None, copy_gbps=None,
                wall_s=1.0)
    ms = {(c.provider, c.tokens): 1.0 + i / 8 for i, c in enumerate(C.FIRST_CASES)}
    first = {"plan": {"command": "first"}, "env": meta, "steps": {},
             "timing": {"meta": meta, "records": [_record(c, ms[c.provider, c.tokens]) for c in C.FIRST_CASES]},
             "correct": {"w8a16 M=1024": {"backend": "triton", "act_quant": None, "M": 1024, "N": 4096, "K": 4096,
                                          "r": 16, "pass": True, "tensors": {"y": {"used": 0.25}}},
                         "w8a8 M=1000": {"backend": "triton", "act_quant": "rowwise", "M": 1000, "N": 4096,
                                         "K": 4096, "r": 16, "pass": False, "tensors": {"y": {"used": None}}},
                         # the opt-in Hopper loop's check names its loop: the times (the default loop's) are not it
                         "w8a16-ws M=1024": {"backend": "triton", "act_quant": None, "M": 1024, "N": 4096,
                                             "K": 4096, "r": 16, "pass": False, "tensors": {"y": {"used": None}},
                                             "main_loop": "tma-ws"}},
             # a candidate the race refused has no time (the first H200 run: save_results died on it)
             "race": {"M=8192": {"key": "dora ...", "pick": "cublas", "static": "triton",
                                 "ms": {"cublas": 2.5, "triton": None},
                                 "verdicts": {"triton": {"ok": False, "error": "y differs"}}, "race_cost_s": 1.0}},
             "model": {"device": "model GPU", "linear_us": 785.0, "pins": {"forward/w8a16": "BLOCK_M=128,w8,s4"},
                       "layers": {"W8A16": {"kernels": [{"name": "triton:dora_fwd_kernel", "predicted_us": 400.0},
                                                        {"name": "triton:project_kernel", "predicted_us": 20.0}]}}},
             "profile": {"dorafp8-triton": {"M": 8192, "K": 4096, "r": 16, "iters": 5, "total_us": 500.0,
                                            "kernels": [{"name": "dora_fwd_kernel", "calls": 1, "us": 500.0}]},
                         # the strategy backend="auto" picked on the first GPU run: profiled since
                         "dorafp8-cublas": {"M": 8192, "K": 4096, "r": 16, "iters": 5, "total_us": 30.0,
                                            "kernels": [{"name": "fwd_epilogue_kernel", "calls": 1, "us": 30.0}]}},
             "host": {"device": "Stand-in GPU", "smoke": False, "calls": 20, "rows": [
                 dict(provider="dorafp8-triton", M=256, wall_us=1600.0, enqueue_us=1500.0, gpu_us=120.0, launches=25,
                      host_timed_us=1550.0, triton_us=900.0, triton_jit_us=700.0, triton_launches=14),
                 dict(provider="linear-bf16", M=8192, wall_us=900.0, enqueue_us=60.0, gpu_us=850.0, launches=2,
                      host_timed_us=62.0, triton_us=0.0, triton_jit_us=0.0, triton_launches=0),
                 dict(provider="peft-dora", M=8192, error="OutOfMemoryError: CUDA out of memory")]},
             "graph": {"device": "Stand-in GPU", "smoke": False, "replays": 20, "rows": [
                 dict(provider="dorafp8-triton", M=256, check="ok", capture_ms=12.5, replay_us=170.0,
                      replay_enqueue_us=9.0),
                 dict(provider="linear-bf16", M=256, error="GraphMismatch: ... y: max |replay - eager| ..."),
                 dict(provider="dorafp8-triton", M=8192, skipped="2.0 s of the step's cap left (< 3 s)")]}}
    src = tmp_path / "out"
    src.mkdir()
    (src / "first_contact.json").write_text(json.dumps(first))
    (src / "log.txt").write_text("a log\n")
    readme = tmp_path / "README.md"
    shutil.copy(os.path.join(ROOT, "README.md"), readme)
    before = readme.read_text()
    proc = subprocess.run([sys.executable, os.path.join(BENCH, "save_results.py"), str(src), str(smoke[0]),
                           "--commit", "abc123", "--dest", str(tmp_path / "results"), "--readme", str(readme)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    dest = tmp_path / "results" / "stand-in-gpu"
    res = json.loads((dest / "results.json").read_text())
    assert len(res["records"]) == len(C.FIRST_CASES) and {r["commit"] for r in res["records"]} == {"abc123"}
    for name in ("results.md", "correctness.md", "kernels.md", "race.md", "host.md", "first.json", "logs/log-first.txt",
                 "README.md"):
        assert (dest / name).is_file(), name
    assert "| dora_fwd_kernel | 1 | 500.0 | 400.0 | 1.25x |" in (dest / "kernels.md").read_text()
    assert "| project_kernel (not seen) | - | - | 20.0 | - |" in (dest / "kernels.md").read_text()
    assert "## dequantize + cuBLAS (dorafp8-cublas), M 8192" in (dest / "kernels.md").read_text()
    assert "| fwd_epilogue_kernel | 1 | 30.0 | - | - |" in (dest / "kernels.md").read_text()
    assert (tmp_path / "results" / "cpu" / "correctness.md").is_file()  # the smoke run: a device folder of its own
    # README: only the block between the markers changed; one row per M, its cells the stand-in times
    text = readme.read_text()
    b, e = "<!-- BEGIN perf-table", "<!-- END perf-table -->"
    assert text[:text.index(b)] == before[:before.index(b)] and text[text.index(e):] == before[before.index(e):]
    block = text[text.index(b):text.index(e)]
    assert "Stand-in GPU" in block and "CPU" not in block  # the smoke run makes no speed claims
    # a time is only worth its results: the failed fp64 check is named under the table, the passed one is not
    assert "times of wrong results:** w8a8 M=1000 (triton, act_quant=rowwise); w8a16-ws M=1024 (triton, tma-ws loop)." \
        in block and "times another loop made" in block
    assert "w8a16 M=1024" not in block
    assert "triton refused: y differs" in (dest / "race.md").read_text()
    host = (dest / "host.md").read_text()
    assert "**Stand-in GPU**, 20 calls" in host and "smoke" not in host
    assert "| dorafp8-triton | 256 | 1600 | 1500 | 120 | 25 | host | 14 | 900 | 700 | 650 |" in host
    assert "| linear-bf16 | 8192 | 900 | 60 | 850 | 2 | GPU | 0 | 0 | 0 | 62 |" in host
    assert "| peft-dora | 8192 | **failed**: OutOfMemoryError: CUDA out of memory |" in host
    assert "A CPU smoke run" in (tmp_path / "results" / "cpu" / "host.md").read_text()
    assert "## The same step captured in a CUDA graph" in host and "20 replays" in host
    assert "| dorafp8-triton | 256 | ok | 170 | 9 | 12.5 | 1600 |" in host  # beside the eager call's wall time
    assert "| linear-bf16 | 256 | **failed**: GraphMismatch: ... y: max |replay - eager| ... |" in host
    assert "| dorafp8-triton | 8192 | **skipped**: 2.0 s of the step's cap left (< 3 s) |" in host
    assert "| dorafp8-triton | 16 | ok |" in (tmp_path / "results" / "cpu" / "host.md").read_text()  # the smoke's
    assert "`results/stand-in-gpu/README.md`" in block and re.findall(r"\]\(([^)\s]*)\)", block) == []  # no link
    for M in C.FIRST_TOKENS:
        row = next(line for line in block.splitlines() if line.startswith(f"| {M} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == f"{ms['dorafp8-triton', M]:.3f}" and cells[6] == f"{ms['peft-dora', M]:.3f}"
        assert cells[9] == f"{ms['linear-bf16', M]:.3f}" and cells[8] == f"{ms['linear-fp8-dequant', M]:.3f}"
        assert cells[10] == f"{ms['dorafp8-triton', M] / ms['linear-bf16', M]:.2f}x"
        assert cells[12] == f"{ms['dorafp8-triton', M] / ms['dorafp8-lora-triton', M]:.2f}x"


def test_race_step_where_no_candidate_runs(monkeypatch, tmp_path):
    """On a GPU no kernel backend runs on (an A100: backend="auto" runs native, no child checks anything) the race step
    records the static pick and no verdicts. It died with StopIteration looking for the key no child had written."""
    from dorafp8.backends import race as _race

    S = _step_module(monkeypatch, tmp_path)
    monkeypatch.setattr(_race, "_candidates", lambda *a: [])
    got = _race_step(S, tmp_path)
    assert got["pick"] == got["static"] == "native" and got["verdicts"] == {} and got["key"] is None


def _step_module(monkeypatch, tmp_path):
    import importlib

    monkeypatch.setenv("FIRST_CONTACT_SMOKE", "1")
    monkeypatch.setenv("FIRST_CONTACT_WORK", str(tmp_path))
    from dorafp8.backends import race as _race

    # what the race step sets, restored after the test
    monkeypatch.setitem(_race.RACERS, "cpu", ())
    for k in ("DORAFP8_RACE", "DORAFP8_CACHE_DIR"):
        monkeypatch.setenv(k, os.environ.get(k, ""))
    import _first_steps as S

    S = importlib.reload(S)
    monkeypatch.setattr(S, "RESULTS", str(tmp_path / "first_contact.json"))
    return S


def _race_step(S, tmp_path) -> dict:
    """The race step's record of M=40, run in this process."""
    from dorafp8.backends import race as _race

    _race.forget()
    try:
        assert S.race() == 0
    finally:
        _race.forget()
    return _results(tmp_path)["race"]["M=40"]


def test_race_step_names_the_backend_the_call_ran_on_a_near_tie(monkeypatch, tmp_path):
    """Candidates within MARGIN: choose() takes the static pick first (cublas for a microscaled key on a GPU); the race
    step worked the pick out again from the verdicts in the racers' order, and named the other backend than the one
    the call ran. Now it reads the process's own pick. Failed on the old code (it said native)."""
    from dorafp8 import backends
    from dorafp8.backends import race as _race

    S = _step_module(monkeypatch, tmp_path)
    code = ("import json, sys; spec = json.loads(sys.argv[1]); ms = {'native': 1.0, 'reference': 1.02}; "
            "print('dorafp8-race result ' + json.dumps({c: {'ok': True, 'ms': ms[c]} for c in spec['cands']}))")
    monkeypatch.setattr(_race, "CHILD", [sys.executable, "-c", code])
    real = backends.resolve
    monkeypatch.setattr(backends, "resolve", lambda name, device, needs=frozenset(): "reference"
                        if name in (None, "auto") and device.type == "cpu" else real(name, device, needs))
    ran, module = [], backends.module
    monkeypatch.setattr(backends, "module", lambda name: ran.append(name) or module(name))
    got = _race_step(S, tmp_path)
    assert set(got["verdicts"]) == {"native", "reference"} and set(ran) == {"reference"}
    assert got["pick"] == "reference"


def test_race_step_cut_in_the_layers_first_call_keeps_what_the_norms_cost(monkeypatch, tmp_path):
    """The H200's race step was stopped at its cap (SIGINT: KeyboardInterrupt in the step) within the first call and
    recorded nothing. Now the norm's first call (its key's check) is written as it ends, and the cut says where and
    after how long. Failed on the old code (no race record)."""
    import dorafp8

    S = _step_module(monkeypatch, tmp_path)

    def cut(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(dorafp8, "dora_fp8_linear", cut)
    from dorafp8.backends import race as _race

    _race.forget()
    try:
        with pytest.raises(KeyboardInterrupt):
            S.race()
    finally:
        _race.forget()
    got = _results(tmp_path)["race"]["M=40"]
    norm = got["first_call_parts"]["norm"]
    assert norm["seconds"] > 0 and [k.split()[0] for k in norm["keys"]] == ["norm"], norm
    assert "layer" not in got["first_call_parts"] and got["cut"].startswith("in the layer's first call, after ")


def test_a_pytest_killed_at_its_cap_keeps_the_failures_it_had_shown(monkeypatch, tmp_path):
    """The H200's tests step: pytest -q -n 12 killed at its cap (SIGINT, then SIGKILL: no summary) showed ~40
    failures as 'F' alone and the step recorded none. Now each failure is named as its line comes. Failed on the
    old code (failures [], counts {})."""
    S = _step_module(monkeypatch, tmp_path)
    (tmp_path / "test_cut.py").write_text(
        "import signal, time\n"
        "def test_a(): assert False\n"
        "def test_b(): pass\n"
        "def test_c(): assert 1 == 2\n"
        "def test_d():\n"
        "    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as xdist's workers: no summary before the SIGKILL\n"
        "    time.sleep(120)\n")
    t0 = time.monotonic()
    monkeypatch.setattr(S, "CAP_S", 28.0)  # about 20 s for pytest, then SIGINT and, 5 s later, SIGKILL
    monkeypatch.setattr(S, "STARTED", time.time(), raising=False)  # the old code timed from its call
    rc = S._pytest("cut", [str(tmp_path / "test_cut.py")])
    assert rc == -signal.SIGKILL and time.monotonic() - t0 < 60
    got = _results(tmp_path)["tests"]["cut"]
    assert got["failures"] == [f"{tmp_path / 'test_cut.py'}::test_a", f"{tmp_path / 'test_cut.py'}::test_c"] or \
        [f.split("::")[1] for f in got["failures"]] == ["test_a", "test_c"], got
    assert got["counts"] == {"failed": 2, "passed": 1} and got["cut"] is True, got


def test_the_tests_step_runs_every_kernel_file_but_the_cuda_ones():
    import _first_steps as S

    files = {f for f in os.listdir(os.path.join(ROOT, "tests", "kernels")) if re.fullmatch(r"test_.*\.py", f)}
    assert sorted(S.KERNEL_TESTS) == sorted(files - {"test_cuda.py", "test_cuda_emulated.py"})
    assert len(set(S.KERNEL_TESTS)) == len(S.KERNEL_TESTS)


def test_a_step_child_leaves_without_the_interpreters_teardown(tmp_path):
    """The H200's host step had written all its rows and was killed at its cap while exiting (rc -2: CUDA's and the
    profiler's teardown). A step's child now leaves at once once its results are written: here an exit handler that
    would take a minute is not run. Failed on the old code (the child returned into the interpreter's exit)."""
    code = ("import atexit, sys, time; sys.path.insert(0, sys.argv[1]); atexit.register(time.sleep, 60); "
            "import _first_steps as S, first_contact as FC; S.STEPS['quick'] = lambda: 3; "
            "sys.exit(FC.main(['--step', 'quick']))")
    r = subprocess.run([sys.executable, "-c", code, BENCH], env=_env(tmp_path, FIRST_CONTACT_RESULTS=str(
        tmp_path / "r.json")), capture_output=True, text=True, timeout=45)
    assert r.returncode == 3, r.stderr


def test_profile_step_skips_a_backend_this_gpu_lacks_and_profiles_the_rest(monkeypatch, tmp_path):
    """An A100 runs no Triton kernel: the profile step failed whole at its first layer (a Skip out of build_layer), the
    ones after it not profiled. Now each such layer is recorded as skipped, with why, kernels.md says so, and the next
    runs. Failed on the old code (the step raised)."""
    import save_results as SR

    S = _step_module(monkeypatch, tmp_path)
    monkeypatch.setattr(S, "PROFILED", ("dorafp8-cuda", "dorafp8-reference"))  # the CPU lacks the CUDA backend
    assert S.profile() == 0
    got = _results(tmp_path)
    assert "CUDA devices only" in got["profile"]["dorafp8-cuda"]["skipped"]
    assert got["profile"]["dorafp8-reference"]["kernels"]
    first = dict(got, profile={"dorafp8-cublas": got["profile"]["dorafp8-cuda"]})
    assert "dorafp8-cublas): not profiled: " in SR.kernels_md(first)
