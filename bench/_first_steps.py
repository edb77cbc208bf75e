"""The steps of bench/first_contact.py, each in a child process (`first_contact.py --step NAME [--job J]`). Each puts
what it finds into the command's results file as soon as it has it (_first_io.publish). Sizes: GPU below, and
tiny ones with --smoke (CPU, reference / native backends: the machinery, no speed claims)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import traceback

import _first_io as F

RESULTS = os.environ.get("FIRST_CONTACT_RESULTS", "")
WORK = os.environ.get("FIRST_CONTACT_WORK", "")
SMOKE = os.environ.get("FIRST_CONTACT_SMOKE") == "1"
CAP_S = float(os.environ.get("FIRST_CONTACT_CAP_S", "60"))  # this step's cap: a pytest it runs ends before it
STARTED = float(os.environ.get("FIRST_CONTACT_STARTED") or time.time())  # when the parent started this step (epoch)
# (K, N), r, M of the correctness checks, M of the timing; the timing's providers
SIZE = dict(shape=(64, 96), rank=4, check=(32, 30), time=(32, 16), race=(40,), profile=32) if SMOKE else \
    dict(shape=(4096, 4096), rank=16, check=(1024, 1000), time=(8192, 1024, 256), race=(8192,), profile=8192)
SIZE["host"] = (16,) if SMOKE else (256, 8192)  # M of the host step: where the first run was flat in M, and the top
# "-ws": the same Triton GEMMs in the Hopper "tma-ws" main loop, which only DORAFP8_HOPPER_GEMM=1 runs (it failed
# these checks on the first GPU run, H200 + Triton 3.6): both loops are checked on an H100 / H200; the default jobs,
# which the timing and the profile then time, run the cp.async loop (triton_kernels/hopper.py, main_loop_for)
CHECKS = {"w8a16": ("native", None), "w8a8": ("reference", "rowwise")} if SMOKE else \
    {"w8a16": ("triton", None), "w8a8": ("triton", "rowwise"), "cublas": ("cublas", None),
     "w8a16-ws": ("triton", None), "w8a8-ws": ("triton", "rowwise")}
SMOKE_PROVIDERS = ("dorafp8-reference", "linear-bf16", "linear-fp8-dequant", "peft-dora", "peft-lora",
                   "dorafp8-lora-reference")
# the cuBLAS strategy too: backend="auto" picked it on the first GPU run, and issue 52's headline is its time
PROFILED = ("dorafp8-reference",) if SMOKE else ("dorafp8-triton", "dorafp8-triton-w8a8", "dorafp8-cublas")
# the host step's providers, --smoke's too: its dorafp8 ones under Triton's interpreter (first_contact.child_env), so
# that CI runs the Triton launch clock
HOST_PROVIDERS = ("dorafp8-triton", "dorafp8-cublas", "peft-dora", "linear-bf16")
# the host step's CUDA-graph rows (bench/_graph.py): the same step captured, checked against an eager call, replayed;
# the bf16 Linear's too, for a fair comparison (--smoke: a stand-in graph that reruns the step eagerly)
GRAPH_PROVIDERS = ("dorafp8-triton", "linear-bf16")
GRAPH_MIN_S = 3  # a graph row starts only with this much of the step's cap left (each took well under it: PREDICTION)
# compute-sanitizer's selections: one ragged, strided fp16 shape; the Triton file's ids end in the device
SANITIZE = (("triton", "tests/kernels/test_triton_kernels.py",
             "cuda and M37-K50-N70-r3 and float16 and not bfloat16 and tensor and (not w8a8 or nodrop)"),
            ("cuda", "tests/kernels/test_cuda.py", "M37-K50-N70-r3 and float16 and not bfloat16"))
SANITIZE_CUDA_S = 15


def left() -> float:
    """Seconds left of this step's cap (the parent's clock: its start, then the imports, count)."""
    return STARTED + CAP_S - time.time()


def put(section, key, value):
    F.publish(RESULTS, section, key, value)


def device():
    import torch

    return torch.device("cpu" if SMOKE else "cuda")


def sync():
    import torch

    if not SMOKE:
        torch.cuda.synchronize()


def run(name: str, job: str | None) -> int:
    sys.path.insert(0, F.HERE)
    try:
        return STEPS[name](job) if job else STEPS[name]()
    except BaseException as e:  # recorded, then the parent goes on with the next step
        traceback.print_exc()
        put("errors", name + (f" {job}" if job else ""), f"{type(e).__name__}: {e}"[:2000])
        return 1


# ---------------------------------------------------------------------------------------------------------------
# command 1


def env() -> int:
    info = {"python": sys.version.split()[0], "executable": sys.executable, "root": F.ROOT}
    try:
        import torch

        import dorafp8
        import dorafp8.triton_kernels as tk
    except Exception as e:
        return _stop(info, f"cannot import dorafp8 from {F.ROOT}: {type(e).__name__}: {e}")
    inside = os.path.realpath(F.ROOT) + os.sep
    for mod in (dorafp8, tk):
        if not os.path.realpath(mod.__file__).startswith(inside):
            return _stop(info, f"{mod.__name__} imports from {mod.__file__}, not from this checkout ({F.ROOT}): "
                               "another installation comes first (pip uninstall dorafp8, or run that checkout's script)")
    if not SMOKE and not torch.cuda.is_available():
        return _stop(info, "torch sees no GPU (torch.cuda.is_available() is False); --smoke runs on a CPU")
    import run as R
    from dorafp8 import backends

    dev = device()
    info.update(R.environment(dev), dorafp8_file=dorafp8.__file__,
                backends={b: backends.unavailable_reason(b, dev) or "runs" for b in backends.BACKENDS})
    if not SMOKE:
        q = "clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu,persistence_mode"
        info["nvidia_smi"] = dict(zip(q.split(","), _out(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"])
                                      .split(", ")))
    put("env", None, info)
    print(f"env: {info['device']}, torch {info['torch']}, triton {info['triton']}, dorafp8 from {dorafp8.__file__}")
    return 0


def _stop(info, why) -> int:
    put("env", None, dict(info, error=why))
    print(f"first_contact: {why}", flush=True)
    return 3


def _out(argv) -> str:
    """What `argv` prints; where it fails printing nothing, its exit status and the end of its stderr (the build
    step's check of the extension recorded [] for a child that died on its import, and no reason)."""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{type(e).__name__}: {e}"
    if r.returncode and not r.stdout.strip():
        return f"exit {r.returncode}: " + " | ".join(r.stderr.strip().splitlines()[-3:])
    return r.stdout.strip()


def pins_from(rows: list[dict], norm_config: str) -> dict:
    """The pins file (first_contact.py --pins: _pins.pin_configs in each step's process) from the model's picks
    (kernel_report.predict.headline's rows): per GEMM, mode and main loop its config (a pin names its loop, so a
    config picked for one loop never narrows the other's list: triton_kernels/_pins.py), the weight norm (not
    modelled: its list's first config). Rows of other modes (the microscaled bases) pin nothing."""
    pins: dict = {"weight_norm": norm_config}
    for r in rows:
        if r["mode"] in ("W8A16", "W8A8"):
            pins[f"{r['kernel']}/{r['mode'].lower()}/{r['loop']}"] = r["config"]
    return pins


def pins() -> int:
    """The kernel report's model picks one config per GEMM (compiled ahead of time for sm_90a: no GPU needed) and
    predicts every launch of the headline layer. --smoke: one config per kernel and variant, the W8A16 GEMMs in the
    launchers' loop (two compiles), so that CI runs every line of this step."""
    import torch

    if not SMOKE:
        major, minor = torch.cuda.get_device_capability()
        if major != 9:  # predict.py describes an H100 SXM (sm_90a); elsewhere the launchers keep their lists
            put("model", None, {"skipped": f"the kernel report's model is for sm_90a; this GPU is sm_{major}{minor}: "
                                           "the launchers autotune"})
            return 0
    from dorafp8.kernel_report import run as report
    from dorafp8.kernel_report.predict import HEADLINE, HEADLINE_VARIANTS, STRATEGIES, dry_run_device, headline
    from dorafp8.kernel_report.predict import launches_subprocess, linear_seconds
    from dorafp8.triton_kernels._common import weight_norm_configs_for
    from dorafp8.triton_kernels._pins import config_name

    seen = set()

    def headline_gemm(job):
        if job["kernel"] not in ("forward", "dgrad") or job["variant"] not in (
                [HEADLINE_VARIANTS["W8A16"]] if SMOKE else [HEADLINE_VARIANTS[m] + s for m in ("W8A16", "W8A8")
                                                            for s in ("", ",tma-ws", ",async-copy")]):
            return False
        if SMOKE:  # the first config of each kernel and variant only
            if (job["kernel"], job["variant"]) in seen:
                return False
            seen.add((job["kernel"], job["variant"]))
        return True

    t0 = time.monotonic()
    records = report(archs=["sm_90a"], backends=["triton"], select=headline_gemm, jobs=os.cpu_count() or 2,
                     progress=print)
    rows = headline(records)
    picks = pins_from(rows, config_name(weight_norm_configs_for("sm90", fp32=True)[0]))
    with open(os.path.join(WORK, "pins.json.tmp"), "w") as f:
        json.dump(picks, f)
    os.replace(os.path.join(WORK, "pins.json.tmp"), os.path.join(WORK, "pins.json"))
    model = {"device": "H100 SXM (dorafp8/kernel_report/predict.py's model: predictions, not measurements)",
             "shape": HEADLINE, "pins": picks, "compiles": len(records),
             "compile_s": round(time.monotonic() - t0, 1),
             "linear_us": linear_seconds(HEADLINE["M"], HEADLINE["N"], HEADLINE["K"]) * 1e6,
             "gemms": [dict(r, us_lo=r["lo"]["seconds"] * 1e6, us_hi=r["hi"]["seconds"] * 1e6) for r in rows],
             # what a kill at the cap leaves said (kernels.md shows it); replaced below
             "layers_error": "cut: the dry runs were still running at the pins step's cap"}
    put("model", None, model)
    print(f"pins: {picks}; {len(records)} compiles in {model['compile_s']} s", flush=True)
    # every launch of each strategy at its modelled bytes (a dry run), the layer at both ends
    # the fp8 strategies only: the pins are theirs, and the microscaled bases' compiles and dry runs would lengthen
    # the GPU's first step (`python -m dorafp8.kernel_report --predict` models those); the smoke run: the default loop;
    # first the ones the profile step measures (the cp.async loop, the cuBLAS strategy). The dry runs get what is left
    # of the cap (the H200's 38 compiles took 23.8 s of its 45, and its dry runs were killed with every prediction)
    strategies = ["W8A16, cp.async loop"] if SMOKE else sorted(
        [n for n, v in STRATEGIES.items() if len(v) == 3] + ["PEFT DoRA"], key=lambda n: "cp.async" not in n
        and "cuBLAS" not in n)
    budget = left() - 3  # the predictions' arithmetic and the write after the kill
    try:  # the pins (what the later steps run) are kept and the step is not failed for want of the predictions
        model["dry_runs_on"] = dry_run_device()
        launches = launches_subprocess(strategies, timeout=budget) if budget >= 1 else {}
        model["layers"] = layer_predictions(records, launches)
        del model["layers_error"]
        cut = [n for n in strategies if n not in launches and (n != "PEFT DoRA" or _has("peft"))]
        if cut:
            model["layers_cut"] = f"{cut}: their dry runs had not finished in the {max(budget, 0):.0f} s left of " \
                                  f"the step's {CAP_S:.0f} s cap"
            print(f"pins: no layer predictions for {model['layers_cut']}", flush=True)
    except Exception as e:
        model["layers_error"] = f"{type(e).__name__}: {e}"[-2000:]
        print(f"pins: no layer predictions: {model['layers_error']}", flush=True)
    put("model", None, model)
    return 0


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def layer_predictions(records: list[dict], launches: dict[str, list]) -> dict:
    """{strategy: its layer_table row, with "kernels": [{name, calls, predicted_us, predicted_us_hi}]}: each kernel
    name's launches summed at the fast and the slow end (the fused GEMMs at their predictions), what kernels.md
    (save_results.py) sets beside the profile's."""
    from dorafp8.kernel_report.predict import GEMM_KERNELS, launch_seconds, layer_table

    out = {}
    for row in layer_table(records, launches):
        kernels: dict = {}
        for lc in launches[row["name"]]:
            k = kernels.setdefault(lc["name"], {"name": lc["name"], "calls": 0, "predicted_us": 0.0,
                                                "predicted_us_hi": 0.0})
            k["calls"] += 1
            for end, key in (("lo", "predicted_us"), ("hi", "predicted_us_hi")):
                gemm = row.get("gemms", {}).get(GEMM_KERNELS.get(lc["name"]))
                k[key] += 1e6 * (gemm[end]["seconds"] if gemm else launch_seconds(lc, end))
        out[row["name"]] = dict(row, kernels=list(kernels.values()))
    return out


def correct(job: str) -> int:
    """y, dx, dA, dB, dm of DoRA (and y, dx of the plain fp8 linear under LoRA) against fp64 at each M."""
    backend, act_quant = CHECKS[job]
    if job.endswith("-ws"):  # the opt-in loop, sm_90 only (hopper.main_loop_for); read at each launch
        import torch

        if torch.cuda.get_device_capability()[0] != 9:
            print(f"correct {job}: skipped, the tma-ws loop runs on sm_90 only")
            return 0
        os.environ["DORAFP8_HOPPER_GEMM"] = "1"
    # the default jobs keep the command's environment: the loop the time, race and profile steps then run
    M, ragged = SIZE["check"]
    # M first (its compiles are the timing's: M a multiple of 16), the plain linear's too, then the ragged M
    checks = ((f"{job} M={M}", check_dora, M), (f"{job} fp8_linear M={M}", check_linear, M),
              (f"{job} M={ragged}", check_dora, ragged))
    ok = True
    for what, check, m in checks:
        got = check(backend, act_quant, m)
        put("correct", what, got)
        ok &= got["pass"]
    return 0 if ok else 1


def _problem(M, seed):
    import torch

    import dorafp8

    (K, N), r = SIZE["shape"], SIZE["rank"]
    g = torch.Generator().manual_seed(seed)
    dev = device()
    w8, scale = dorafp8.quantize_e4m3((torch.randn(N, K, generator=g) / K ** 0.5).to(dev))
    A = (torch.randn(r, K, generator=g) / K ** 0.5).to(dev)
    B = (torch.randn(N, r, generator=g) / r ** 0.5).to(dev)  # B != 0: the rank-r term counts
    m = (torch.rand(N, generator=g) + 0.5).to(dev)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16).to(dev)
    gy = torch.randn(M, N, generator=g).to(torch.bfloat16).to(dev)
    return w8, scale, A, B, m, x, gy, dorafp8.dequantize_e4m3(w8, scale, torch.float64)


def _used(out, ref, allowed) -> dict:
    """How much of the allowed error the worst element uses (pass: at most 1); NaN counts as infinitely wrong."""
    import torch

    err = (out.detach().double() - ref.detach().double()).abs()
    frac = (err / allowed).nan_to_num(float("inf")).max().item()
    return {"used": F.finite(frac), "max_err": F.finite(err.max().item()), "scale": ref.abs().max().item(),
            "nan": int(torch.isnan(out).sum()), "pass": frac <= 1.0}


def _rel(ref, rel):
    return rel * (ref.abs() + ref.abs().max())


def _w8a8_bound(t, W):
    """docs/DORA_MATH.md's W8A8 contract: |t8 W^T - t W^T| per element, t's rows quantized to e4m3, plus fp32
    accumulation and, on Hopper, its fp8 accumulator (the 2^-6 term)."""
    import torch

    hopper = not SMOKE and torch.cuda.get_device_capability()[0] == 9
    acc = W.shape[1] * 2 ** -24 + (2 ** -6 if hopper else 0.0)
    sigma = t.abs().amax(1) / 448
    return (2 ** -4 + acc) * (t.abs() @ W.abs().T) + 2 ** -10 * sigma[:, None] * W.abs().sum(1)[None, :]


def check_dora(backend, act_quant, M) -> dict:
    import torch

    import dorafp8
    from tests._ref import dora_fp64
    from tests._tolerance import tol

    w8, scale, A, B, m, x, gy, W0 = _problem(M, M)
    s, rel = 2.0, tol(torch.bfloat16)
    n = dorafp8.weight_norm(w8, scale, A, B, s, backend=backend)
    leaves = [t.clone().requires_grad_() for t in (x, A, B, m)]
    y = dorafp8.dora_fp8_linear(leaves[0], w8, scale, *leaves[1:], s, backend=backend, weight_norm=n,
                                act_quant=act_quant)
    y.backward(gy)
    yr, ref = dora_fp64(x, W0, A, B, m, s)
    yr.backward(gy.double())
    n64 = (W0 + s * B.double() @ A.double()).norm(dim=1)
    got = {"n": _used(n, n64, _rel(n64, tol(torch.float32)))}
    allowed = {"y": _rel(yr, rel)} | {k: _rel(t.grad, 2 * rel) for k, t in zip(("dx", "dA", "dB", "dm"), ref)}
    if act_quant:  # the base product of quantized rows: within the contract's bound, scaled as the layer scales it
        c, x64, g64 = m.double() / n64, x.double(), gy.double()
        bx = _w8a8_bound(x64, W0)
        allowed["y"] = allowed["y"] + c.abs()[None, :] * bx
        allowed["dx"] = allowed["dx"] + _w8a8_bound(g64 * c[None, :], W0.T)
        allowed["dm"] = allowed["dm"] + (g64.abs() * bx).sum(0) / n64
    for name, out, r in zip(("y", "dx", "dA", "dB", "dm"), (y,) + tuple(t.grad for t in leaves),
                            (yr,) + tuple(t.grad for t in ref)):
        got[name] = _used(out, r, allowed[name])
    return _verdict(backend, act_quant, M, got)


def check_linear(backend, act_quant, M) -> dict:
    """The plain fp8 linear (plain LoRA's base layer) forward and input gradient against fp64."""
    import torch

    import dorafp8
    from tests._tolerance import tol

    w8, scale, _, _, _, x, gy, W0 = _problem(M, M + 1)
    xl = x.clone().requires_grad_()
    y = dorafp8.fp8_linear(xl, w8, scale, backend=backend, act_quant=act_quant)
    y.backward(gy)
    yr, dxr = x.double() @ W0.T, gy.double() @ W0
    rel = tol(torch.bfloat16)
    ay, adx = _rel(yr, rel), _rel(dxr, 2 * rel)
    if act_quant:
        ay, adx = ay + _w8a8_bound(x.double(), W0), adx + _w8a8_bound(gy.double(), W0.T)
    return _verdict(backend, act_quant, M, {"y": _used(y, yr, ay), "dx": _used(xl.grad, dxr, adx)})


def _verdict(backend, act_quant, M, got) -> dict:
    (K, N), r = SIZE["shape"], SIZE["rank"]
    line = ", ".join(f"{k} {v['used']:.2f}" if v["used"] is not None else f"{k} NaN" for k, v in got.items())
    ok = all(v["pass"] for v in got.values())
    print(f"correct {backend} act_quant={act_quant} M={M}: {'pass' if ok else 'FAIL'} (of the allowed error: {line})")
    import run as R

    # the Triton GEMMs' main loop checked: a "-ws" job's failure says nothing of the times, which the default loop
    # made (each time record names its own), and README's table says so
    loop = R.main_loop(device()) if backend == "triton" else None
    return {"backend": backend, "act_quant": act_quant, "M": M, "N": N, "K": K, "r": r, "tensors": got, "pass": ok,
            "main_loop": loop}


def timing() -> int:
    import _cases as C

    providers = [p for p in os.environ.get("FIRST_CONTACT_PROVIDERS", "").split(",") if p] or \
        list(SMOKE_PROVIDERS if SMOKE else C.FIRST_PROVIDERS)
    if unknown := [p for p in providers if p not in C.PROVIDERS]:
        raise SystemExit(f"first_contact: unknown providers {unknown}; bench/_cases.py has {list(C.PROVIDERS)}")
    cases = C.first_cases(SIZE["shape"], SIZE["time"], providers, SIZE["rank"])
    return _measure("timing", None, cases)


def _measure(section, key, cases) -> int:
    """Times `cases` with bench/run.py's Runner (do_bench on a GPU), publishing after each one."""
    import _providers as P
    import run as R

    dev = device()
    args = argparse.Namespace(warmup=25, rep=100, cpu_reps=1 if SMOKE else 5)
    meta = R.environment(dev)
    runner = R.Runner(args, dev, meta)
    meta["copy_gbps"] = R.copy_bandwidth(dev, runner.timer)
    for p in dict.fromkeys(c.provider for c in cases):
        try:
            P.check(p, dev)
        except P.Skip as e:
            runner.skipped[p] = str(e)
    bar = R._Counter(len(cases))
    for case in cases:
        runner.run_layer_group([case], bar)
        put(section, key, {"meta": meta, "records": runner.records})
    return 0


def race() -> int:
    """backend="auto" as a user meets it: the first call of a key checks the candidates in a child process
    (dorafp8/backends/race.py) and runs the pick; later calls read it. Records the verdicts and what the first call
    cost."""
    import dorafp8
    from dorafp8 import backends
    from dorafp8.backends import race as _race

    os.environ.update(DORAFP8_RACE="1", DORAFP8_CACHE_DIR=os.path.join(WORK, "race"))
    if SMOKE:
        _race.RACERS["cpu"] = ("native", "reference")
    dev = device()
    for M in SIZE["race"]:
        w8, scale, A, B, m, x, gy, _ = _problem(M, M)
        leaves = [t.requires_grad_() for t in (x, A, B, m)]

        def call():
            t0 = time.perf_counter()
            n = dorafp8.weight_norm(w8, scale, A, B, 2.0)  # as PEFT's layers: a key of its own, checked on first use
            dorafp8.dora_fp8_linear(leaves[0], w8, scale, *leaves[1:], 2.0, weight_norm=n).backward(gy)
            sync()
            return time.perf_counter() - t0

        # the first call in its two keys' parts, each written as it ends: the H200's step was cut at its 40 s cap
        # within the first call and said nothing of what it had cost
        rec: dict = {"first_call_parts": {}}
        t0 = time.perf_counter()
        n = _first_part(rec, f"M={M}", "norm", lambda: dorafp8.weight_norm(w8, scale, A, B, 2.0), _race, dev)
        _first_part(rec, f"M={M}", "layer", lambda: dorafp8.dora_fp8_linear(
            leaves[0], w8, scale, *leaves[1:], 2.0, weight_norm=n).backward(gy), _race, dev)
        first, later = time.perf_counter() - t0, min(call() for _ in range(3))
        keys = _race._read(_race.cache_file(dev))["keys"]
        static = backends.resolve("auto", dev)
        # no key where no child ran: no candidate runs on this GPU (an A100: native), or a check would not fit
        what = next((k for k in keys if k.startswith("dora ") and f" M<={_race.bucket(M)} " in k), None)
        verdicts = keys.get(what, {})
        # what this process ran, not the verdicts' pick again in the racers' order: choose() puts the static pick first,
        # and on a near tie (within MARGIN) that order decides
        pick = _race._PICKS.get((str(dev), what), static)
        put("race", f"M={M}", dict(rec, key=what, pick=pick, verdicts=verdicts, static=static,
                                   ms={c: v.get("ms") for c, v in verdicts.items()}, first_call_s=first,
                                   later_call_s=later, race_cost_s=first - later))
        print(f"race M={M}: {what or 'nothing checked'} -> {pick} {verdicts}; the first call cost {first - later:.3f} "
              "s more")
    return 0


def _first_part(rec: dict, name: str, part: str, fn, _race, dev):
    """fn() (a first call: its keys' checks run in a child) timed; its seconds and the keys it checked go into
    rec["first_call_parts"][part] and the results; cut (the step's cap), how long it had run."""
    path, t0 = _race.cache_file(dev), time.perf_counter()
    before = set(_race._read(path)["keys"])
    try:
        out = fn()
        sync()
    except BaseException:
        rec["cut"] = f"in the {part}'s first call, after {time.perf_counter() - t0:.1f} s"
        put("race", name, rec)
        raise
    keys = _race._read(path)["keys"]
    rec["first_call_parts"][part] = {"seconds": time.perf_counter() - t0,
                                     "keys": {k: v for k, v in keys.items() if k not in before}}
    put("race", name, rec)
    return out


def profile() -> int:
    """Per-kernel device time of one forward + backward (norm cached), the mean of ITERS under torch.profiler; on a
    CPU the operators' own CPU time."""
    import torch
    from torch.profiler import ProfilerActivity

    import _providers as P
    import run as R

    iters, dev = 5, device()
    (K, N), r, M = SIZE["shape"], SIZE["rank"], SIZE["profile"]
    acts = [ProfilerActivity.CPU] + ([] if SMOKE else [ProfilerActivity.CUDA])
    for prov in PROFILED:
        try:
            P.check(prov, dev)
        except P.Skip as e:  # an A100: no Triton, so none of them; the step went on to fail whole at the first
            put("profile", prov, {"skipped": str(e)})
            print(f"profile {prov}: skipped: {e}")
            continue
        layer = P.build_layer(prov, K, N, r, "bf16", 0.0, dev)
        x = torch.randn(M, K, dtype=torch.bfloat16, device=dev).requires_grad_()
        dy = torch.randn(M, N, dtype=torch.bfloat16, device=dev)

        def fn():
            # fresh gradients, as run.py's timing takes them: else autograd adds each call's dx into x.grad, an [M, K]
            # add (44 us of the H200's 1.98 ms at M 8192, issue 52) that the layer never runs
            for t in [x, *layer.params]:
                t.grad = None
            layer.forward_cached(x).backward(dy)

        for _ in range(2):  # compiles, allocator warm
            fn()
        sync()
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(iters):
                fn()
            sync()
        rows = _per_call(prof, iters, cpu=SMOKE)
        put("profile", prov, {"M": M, "N": N, "K": K, "r": r, "iters": iters, "what": "CPU operators" if SMOKE else
                              "GPU kernels", "kernels": rows, "total_us": sum(row["us"] for row in rows),
                              # kernels.md sets this main loop's predictions beside it (on CPU, where no Triton
                              # GEMM runs, the launchers' default: the smoke run's one)
                              "main_loop": R.main_loop(torch.device(dev)) or "async-copy"})
        print(f"profile {prov}: " + ", ".join(f"{row['name'][:40]} {row['us']:.1f} us" for row in rows[:8]))
    return 0


def _per_call(prof, iters, cpu=False) -> list[dict]:
    """[{name, calls, us}] per call, slowest first: each GPU activity (kernel, memcpy, memset: a GPU event has no
    children) from a torch.profiler run of `iters` calls; cpu=True: the operators' own CPU time instead."""
    rows = []
    for e in prof.key_averages():
        on_gpu = str(getattr(e, "device_type", "")).endswith("CUDA")
        us = (getattr(e, "device_time_total", 0) if on_gpu else e.self_cpu_time_total if cpu else 0) / iters
        if us > 0:
            rows.append({"name": e.key, "calls": e.count / iters, "us": us})
    return sorted(rows, key=lambda row: -row["us"])


class _TritonClock:
    """Host time inside Triton's launch path, for the host step only: Triton's `run` methods wrapped while it is
    entered. `us`: from the outermost run (the Autotuner / Heuristics wrappers, JITFunction.run's argument binding,
    the driver's launch); `jit_us`: JITFunction.run (InterpretedFunction.run under the interpreter) alone; `launches`:
    the outermost runs. The autograd engine's thread runs the backward while the caller waits: never two at once."""

    def __init__(self):
        from triton.runtime import autotuner, interpreter, jit

        self.inner = (jit.JITFunction, interpreter.InterpretedFunction)
        self.classes = self.inner + (autotuner.Autotuner, autotuner.Heuristics)
        self.us = self.jit_us = 0.0
        self.launches = self.depth = 0

    def _wrap(self, cls, run):
        def timed(kernel, *args, **kwargs):
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return run(kernel, *args, **kwargs)
            finally:
                dt, self.depth = (time.perf_counter() - t0) * 1e6, self.depth - 1
                self.jit_us += dt if cls in self.inner else 0.0
                if self.depth == 0:
                    self.us, self.launches = self.us + dt, self.launches + 1
        return timed

    def __enter__(self):
        self.saved = {cls: cls.__dict__["run"] for cls in self.classes if "run" in cls.__dict__}
        for cls, run in self.saved.items():
            cls.run = self._wrap(cls, run)
        return self

    def __exit__(self, *exc):
        for cls, run in self.saved.items():
            cls.run = run


def host() -> int:
    """Where a call's time goes: for each provider and M, (a) the wall time of a call with a sync after each, (b) the
    host's time to enqueue one (N calls timed, then one sync), (c) the GPU's time (torch.profiler: its activities'
    sum) and (d) its launches, (e) the host's time inside Triton's launch path (_TritonClock, a loop of its own) and the
    rest (dorafp8's Python, torch's operators, autograd). Host-bound where (b) exceeds (c). A provider that fails is
    written down with its error, and the next one runs."""
    import run as R

    n = 2 if SMOKE else 20  # the smoke's two calls under the interpreter: ~0.5 s each on a busy 2-core machine
    out = {"device": R.environment(device())["device"], "smoke": SMOKE, "calls": n, "rows": []}
    graphed = {"device": out["device"], "smoke": SMOKE, "replays": n, "rows": []}
    for M in SIZE["host"]:
        for prov in HOST_PROVIDERS:
            try:
                row = dict(provider=prov, M=M, **_host_row(prov, M, n))
            except Exception as e:
                traceback.print_exc()
                row = dict(provider=prov, M=M, error=f"{type(e).__name__}: {e}"[:500])
            out["rows"].append(row)
            put("host", None, out)
            print(f"host {prov} M={M}: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                                      for k, v in list(row.items())[2:]), flush=True)
        for prov in GRAPH_PROVIDERS:
            graphed["rows"].append(dict(provider=prov, M=M, **_graph_row(prov, M, n)))
            put("graph", None, graphed)
            print(f"graph {prov} M={M}: {graphed['rows'][-1]}", flush=True)
    return 1 if any("error" in r for r in graphed["rows"]) else 0  # a graph that failed its check fails the step


def _graph_row(prov: str, M: int, n: int) -> dict:
    """One provider's forward + backward captured in a CUDA graph (bench/_graph.py): checked against an eager call,
    then n replays timed; or why not (out of time, an error, a replay that differs: GraphMismatch's message)."""
    if left() < GRAPH_MIN_S:
        return {"skipped": f"{left():.1f} s of the step's cap left (< {GRAPH_MIN_S} s)"}
    try:
        import torch

        import _cases as C
        import _graph as G
        import _providers as P

        dev, (K, N), r = device(), SIZE["shape"], SIZE["rank"]
        layer = P.build_layer(prov, K, N, r, "bf16", 0.0, dev)
        forward = layer.forward_cached if C.first_mode(prov).endswith("cachednorm") else layer.forward
        x = torch.randn(M, K, dtype=torch.bfloat16, device=dev)
        dy = torch.randn(M, N, dtype=torch.bfloat16, device=dev)
        replay, capture_s = G.captured(forward, layer.params, x, dy, graph=G.EagerGraph() if SMOKE else None,
                                       warmup=1 if SMOKE else 3)
        return dict(check="ok", capture_ms=capture_s * 1e3, **G.time_replays(replay, n, dev))
    except Exception as e:
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"[:800]}


def _host_row(prov: str, M: int, n: int) -> dict:
    import statistics

    import torch
    from torch.profiler import ProfilerActivity

    import _cases as C
    import _providers as P

    dev, (K, N), r = device(), SIZE["shape"], SIZE["rank"]
    layer = P.build_layer(prov, K, N, r, "bf16", 0.0, dev)
    x = torch.randn(M, K, dtype=torch.bfloat16, device=dev).requires_grad_()
    dy = torch.randn(M, N, dtype=torch.bfloat16, device=dev)
    forward = layer.forward_cached if C.first_mode(prov).endswith("cachednorm") else layer.forward

    def fn():
        for t in [x, *layer.params]:  # fresh gradients, as the timing and the profile take them
            t.grad = None
        forward(x).backward(dy)

    for _ in range(1 if SMOKE else 3):  # compiles, allocator warm
        fn()
    sync()
    walls = []
    for _ in range(n):  # (a)
        t0 = time.perf_counter()
        fn()
        sync()
        walls.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(n):  # (b)
        fn()
    enqueue = time.perf_counter() - t0
    sync()
    acts = [ProfilerActivity.CPU] + ([] if SMOKE else [ProfilerActivity.CUDA])
    with torch.profiler.profile(activities=acts) as prof:  # (c), (d)
        for _ in range(n):
            fn()
        sync()
    gpu = _per_call(prof, n)
    with _TritonClock() as clock:  # (e)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        timed = time.perf_counter() - t0
    sync()
    return {"wall_us": statistics.median(walls) * 1e6, "enqueue_us": enqueue / n * 1e6,
            "gpu_us": sum(k["us"] for k in gpu), "launches": sum(k["calls"] for k in gpu),
            "host_timed_us": timed / n * 1e6, "triton_us": clock.us / n, "triton_jit_us": clock.jit_us / n,
            "triton_launches": clock.launches / n}


# ---------------------------------------------------------------------------------------------------------------
# command 2


def build() -> int:
    import torch

    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}" + ("a" if major in (9, 10) else "")  # wgmma / tcgen05 need the arch-specific target
    env = dict(os.environ, DORAFP8_FORCE_CUDA_BUILD="1", DORAFP8_CUDA_ARCHS=arch, MAX_JOBS="8")
    if os.path.isdir("/usr/local/cuda"):
        env.setdefault("CUDA_HOME", "/usr/local/cuda")
    t0 = time.monotonic()
    rc = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=F.ROOT, env=env).returncode
    why = _out([sys.executable, "-c", "import torch, dorafp8.backends.cuda as c; "
                "print(c.unavailable_reason(torch.device('cuda')) or 'runs')"]).splitlines()[-1:]
    put("build", None, {"rc": rc, "arch": arch, "seconds": round(time.monotonic() - t0, 1), "extension": why})
    return rc


# pytest -v's line of each test as it ends: "[gw3] [ 10%] FAILED tests/...::id" (xdist) or "tests/...::id PASSED [ 10%]"
_OUTCOME = re.compile(r"(?:^|\s)(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)(?:\s|$)")
_NODE = re.compile(r"(\S+::\S+)")
_COUNTED = {"PASSED": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped", "XFAIL": "xfailed",
            "XPASS": "xpassed"}
_TOTALS = re.compile(r"\d+ (passed|failed|skipped|errors?|xfailed|xpassed|deselected)\b.* in [\d.]+s")
_SUMMARY = re.compile(r"^=+ (FAILURES|ERRORS|short test summary info|warnings summary) =+$")


# The tests step's files, in this order (pytest and xdist's workers take them in it): the whole of tests/kernels took
# ~430 s on the H200 with 16 processes, and its 150 s cap stopped it at 35 %. So a cut run has run the first ones:
# the cuBLAS strategy's (backend="auto"'s pick there; the file of that run's early failures, 32 of its tests built CPU
# tensors: logs/tests-kernels-failed.txt), the fused Triton kernels',
# W8A8's contract, the zero rows, the microscaled bases; last the ones that mostly check on CPU what CI checks too.
KERNEL_TESTS = ("test_cublas.py", "test_triton_kernels.py", "test_w8a8.py", "test_zero_rows.py", "test_microscaled.py",
                "test_dequant.py", "test_dequant_micro.py", "test_native_backend.py", "test_arch_configs.py")


def _pytest(key, argv, env_extra=None, prefix=(), until=None) -> int:
    """pytest -v ARGV, until `until` (time.time(); default: before this step's cap), then SIGINT (pytest prints its
    summary), SIGKILL after KILL_GRACE_S. Its lines are read as they come: each failure and the counts go to the
    results at once, so that a run cut at the cap keeps them (-q named its failures only in its last lines, and the
    H200's kernels run, killed at 35 %, recorded none of its ~40); the passed and skipped tests' lines stay out of
    the log."""
    import signal
    import threading

    cmd = list(prefix) + [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-rfE"] + argv
    rec = {"command": " ".join(cmd[-len(argv):]), "rc": None, "counts": {}, "failures": [], "interrupted": False,
           "tail": []}
    lines, last = [], [0.0]

    def publish(force=False):
        if force or time.monotonic() - last[0] > 5:
            last[0] = time.monotonic()
            put("tests", key, dict(rec, failures=rec["failures"][:200], tail=lines[-15:]))

    def read(stream):
        summary = False
        for line in stream:
            line = line.rstrip("\n")
            lines.append(line)
            summary = summary or bool(_SUMMARY.match(line))
            outcome, node = _OUTCOME.search(line), _NODE.search(line)
            if summary or not (outcome and node):
                print(line, flush=True)
                if summary and line.startswith(("FAILED ", "ERROR ")) and line.split(" ")[1] not in rec["failures"]:
                    rec["failures"].append(line.split(" ")[1])
                continue
            word = outcome.group(1)
            rec["counts"][_COUNTED[word]] = rec["counts"].get(_COUNTED[word], 0) + 1
            if word in ("FAILED", "ERROR"):
                print(line, flush=True)
                if node.group(1) not in rec["failures"]:
                    rec["failures"].append(node.group(1))
            publish(force=word in ("FAILED", "ERROR"))

    proc = subprocess.Popen(cmd, cwd=F.ROOT, env=dict(os.environ, **(env_extra or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
    reader = threading.Thread(target=read, args=(proc.stdout,), daemon=True)
    reader.start()
    until = STARTED + CAP_S - F.KILL_GRACE_S - 3 if until is None else until
    try:
        try:
            proc.wait(timeout=max(5.0, until - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=F.KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    finally:  # this step itself stopped at its cap: pytest, a session of its own, is not left running
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        reader.join(timeout=5)
        text = "\n".join(lines)
        last_line = next((ln for ln in reversed(lines) if _TOTALS.search(ln)), "")  # compute-sanitizer's come after
        final = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)",
                                                  last_line)}
        rec.update(rc=proc.returncode, interrupted="KeyboardInterrupt" in text or "Interrupted" in text,
                   counts=final or rec["counts"], cut=not final)  # cut: the counts of the tests that ended
        publish(force=True)
    return proc.returncode


def _extension_runs() -> bool:
    return _out([sys.executable, "-c", "import torch, dorafp8.backends.cuda as c; "
                 "print(c.unavailable_reason(torch.device('cuda')) is None)"]).endswith("True")


def tests() -> int:
    if SMOKE:
        return _pytest("kernels", ["tests/kernels/test_arch_configs.py", "-k", "known_gpus"])
    import importlib.util

    xdist = ["-n", "12"] if importlib.util.find_spec("xdist") else []
    # test_cuda.py after the build; test_cuda_emulated.py runs the CUDA files on CPU (CI's, not this GPU's time)
    return _pytest("kernels", [f"tests/kernels/{f}" for f in KERNEL_TESTS] + xdist)


def tests_cuda() -> int:
    if not _extension_runs():
        put("tests", "cuda", {"skipped": "the CUDA extension was not built (see build)"})
        return 1
    return _pytest("cuda", ["tests/kernels/test_cuda.py", "-n", "8"], {"DORAFP8_REQUIRE_CUDA_EXT": "1"})


def sanitizer() -> int:
    """The CUDA file first, given at most SANITIZE_CUDA_S (on the H200: its 38 tests passed in 4.4 s, yet the run
    under compute-sanitizer was past its 10 s share); the Triton file then has the rest (its first test alone took
    7.3 s there, and its 10 s share stopped it)."""
    built, rcs = _extension_runs(), []
    for what, path, sel in sorted(SANITIZE, key=lambda t: t[0] != "cuda"):
        if what == "cuda" and not built:
            put("tests", "sanitizer-cuda", {"skipped": "the CUDA extension was not built"})
            continue
        end = STARTED + CAP_S - F.KILL_GRACE_S - 3
        rcs.append(_pytest(f"sanitizer-{what}", [path, "-k", sel],  # the tests' conftest NaN-fills outputs
                           {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"},  # one cudaMalloc per tensor: writes past its end
                           prefix=["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "9",
                                   "--print-limit", "20"],
                           until=min(end, time.time() + SANITIZE_CUDA_S) if what == "cuda" else end))
    return max(rcs, default=0)


def grid() -> int:
    """The rest of the grid: dropout, the autotuned configs (nothing pinned here), the CUDA backend."""
    import _cases as C

    M = SIZE["time"][:1]
    kw = dict(shape=SIZE["shape"], rank=SIZE["rank"], tokens=M)
    if SMOKE:
        _measure("grid", "dropout", C.first_cases(providers=("dorafp8-reference", "peft-dora"), dropout=0.05, **kw))
        return 0
    _measure("grid", "autotuned", C.first_cases(providers=("dorafp8-triton", "dorafp8-triton-w8a8"), **kw))
    _measure("grid", "dropout", C.first_cases(providers=("dorafp8-triton", "dorafp8-triton-w8a8", "peft-dora",
                                                         "dorafp8-lora-triton", "peft-lora"), dropout=0.05, **kw))
    if _extension_runs():
        _measure("grid", "cuda", C.first_cases(providers=("dorafp8-cuda",), **dict(kw, tokens=SIZE["time"][:2])))
    return 0


STEPS = {"env": env, "pins": pins, "correct": correct, "time": timing, "race": race, "profile": profile,
         "host": host, "build": build, "tests": tests, "tests-cuda": tests_cuda, "sanitizer": sanitizer, "grid": grid}
