"""Benchmark DoRA on an FP8 base: dorafp8's backends against PEFT's DoRA layer and a plain cuBLAS linear.

    python bench/run.py                          # the full grid on the GPU (hours: pick cases with the options)
    python bench/run.py --shapes 4096x14336 --tokens 2048,8192 --ranks 16 --modes norm,fwd+bwd
    python bench/run.py --smoke --out /tmp/b     # tiny CPU run (reference backend, Triton interpreter)
    python bench/run.py --preset first           # the 27 cases bench/first_contact.py times on a lent GPU (_cases.py)
    python bench/run.py --preset headline --exclude-preset first   # the headline grid less those
    python bench/plot.py OUT/results.json        # redraw results.md and the PNGs from saved results

Writes OUT/results.json (one record per provider x shape x dtype x mode), OUT/results.md and OUT/*.png.
On a GPU every time is the median of triton.testing.do_bench (CUDA events, warm-up, L2 flushed before every
repetition, and the norm's weights rotated through copies larger than L2). On a CPU the times are medians of
time.perf_counter and the outputs say "no speed claims".
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(1, ROOT)  # import the dorafp8 of this checkout when it is not installed

import torch  # noqa: E402

import _cases as C  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(C.PRESETS), default="full",
                    help="default grid: full (all of the issue's cases: hours on a GPU), quick (LLaMA-3-8B shapes, "
                         "M 2048/8192, r 16/64, bf16; not yet timed on a GPU), headline (the GPU issue's 156 cases), "
                         "first (an explicit list of 27 cases at 4096x4096, r 16, bf16, M 8192/1024/256: what "
                         "bench/first_contact.py times; the grid options narrow it), smoke (tiny, CPU)")
    ap.add_argument("--exclude-preset", choices=sorted(C.PRESETS),
                    help="leave out the layer cases this preset selects with its own defaults (e.g. --preset "
                         "headline --exclude-preset first: the headline cases a first contact did not measure)")
    ap.add_argument("--smoke", action="store_true", help="same as --preset smoke: the tiny CPU check (CI)")
    ap.add_argument("--shapes", help=f"KxN list (in x out features); default {C.FULL['shapes']}")
    ap.add_argument("--tokens", help=f"M list; default {C.FULL['tokens']}")
    ap.add_argument("--ranks", help=f"default {C.FULL['ranks']}")
    ap.add_argument("--dtypes", help=f"activation dtypes; default {C.FULL['dtypes']}")
    ap.add_argument("--dropouts", help=f"lora_dropout values; default {C.FULL['dropouts']}")
    ap.add_argument("--providers", help=f"default {C.FULL['providers']}")
    ap.add_argument("--modes", help=f"default {C.FULL['modes']}")
    ap.add_argument("--model", help=f"model step spec; default {C.FULL['model']}")
    ap.add_argument("--out", help="output directory (default bench_out/<device>)")
    ap.add_argument("--device", help="cuda or cpu (default: cuda if available; cpu with --smoke)")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms (GPU)")
    ap.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms (GPU)")
    ap.add_argument("--cpu-reps", type=int, default=None,
                    help="timed calls per case on CPU, at least (more, up to 50, until 50 ms are covered); default 1 "
                         "with --smoke (a Triton-interpreter call takes far longer than 50 ms), 5 else")
    ap.add_argument("--dry-run", action="store_true", help="list the cases and exit")
    ap.add_argument("--interpreter-steps", action="store_true",
                    help="on CPU, also run the model step of the providers that run under the Triton interpreter "
                         "(tens of seconds per step; skipped by default, with that reason)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.preset = "smoke"
    args.smoke = args.preset == "smoke"
    preset = C.PRESETS[args.preset]
    for k, v in preset.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.cpu_reps is None:
        args.cpu_reps = 1 if args.smoke else 5
    return args


# ---------------------------------------------------------------------------------------------------------------
# Environment


def _git_commit() -> str:
    """HEAD (+dirty) of this checkout; where there is no git (a copied tree, as on a lent GPU machine), whatever
    $DORAFP8_COMMIT says (bench/first_contact.py's caller puts the commit there), else "unknown"."""
    env = os.environ.get("DORAFP8_COMMIT")
    if env:
        return env
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        if not sha:
            return "unknown (no commit)"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True,
            timeout=10,
        ).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _version(mod):
    try:
        return __import__(mod).__version__
    except Exception:
        return None


def _driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
        return out.splitlines()[0].strip() if out else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device: torch.device) -> dict:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = props.name
        l2 = getattr(props, "L2_cache_size", None)
        timing = "triton.testing.do_bench median (CUDA events)"
        extra = dict(driver=_driver_version(), capability=".".join(map(str, torch.cuda.get_device_capability(device))),
                     sms=props.multi_processor_count, memory_bytes=props.total_memory)
    else:
        name = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores visible)"
        l2 = None
        timing = "time.perf_counter median on CPU: no speed claims"
        extra = dict(driver=None)
    # The datasheet peaks the measured times are set against (None: no known peaks for this device, or a CPU).
    peak = C.peak_key(name) if device.type == "cuda" else None
    return dict(
        device=name,
        device_type=device.type,
        **extra,
        roofline_device=peak,
        peaks=C.PEAKS,
        torch=torch.__version__,
        cuda=torch.version.cuda,
        triton=_version("triton"),
        peft=_version("peft"),
        transformers=_version("transformers"),
        dorafp8=_version("dorafp8"),
        commit=_git_commit(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        timing=timing,
        speed_claims=device.type == "cuda",
        triton_interpret=os.environ.get("TRITON_INTERPRET") == "1",
        main_loop=main_loop(device),
        l2_bytes=l2,
    )


device_slug = C.device_slug


def main_loop(device) -> str | None:
    """The Triton fp8 GEMMs' main loop on `device` (hopper.main_loop_for: DORAFP8_HOPPER_GEMM decides it on sm_90), or
    None off CUDA: a record names it, so that the kernel report sets a time beside the loop that made it."""
    if device.type != "cuda":
        return None
    try:
        from dorafp8.triton_kernels import _common, hopper
    except ImportError:  # no Triton: no Triton layer is timed
        return None

    return hopper.main_loop_for(_common.arch_of(device))


# ---------------------------------------------------------------------------------------------------------------
# Timing and memory


class Timer:
    def __init__(self, device, args):
        self.device, self.args = device, args
        if device.type == "cuda":
            from triton.testing import do_bench

            self._do_bench = do_bench

    def ms(self, fn, grad_to_none=(), rep_scale=1.0) -> float:
        if self.device.type == "cuda":
            return float(
                self._do_bench(
                    fn,
                    warmup=self.args.warmup,
                    rep=max(1, int(self.args.rep * rep_scale)),
                    grad_to_none=list(grad_to_none) or None,
                    return_mode="median",
                )
            )
        # CPU: at least cpu_reps calls, more (up to 50) until 50 ms are covered, so that a shared, throttled
        # CPU's stalls land in the tail rather than in the median.
        times = []
        while len(times) < self.args.cpu_reps or (sum(times) < 0.05 and len(times) < 50):
            for t in grad_to_none:
                t.grad = None
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    def memory(self, fn, grad_to_none=()):
        """(peak bytes allocated during one call, peak minus what was allocated before it); None on CPU."""
        if self.device.type != "cuda":
            return None, None
        for t in grad_to_none:
            t.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        return peak, peak - before


def copy_bandwidth(device, timer) -> float:
    """GB/s of a large device-to-device copy, counting read + write bytes."""
    nbytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    ms = timer.ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


# ---------------------------------------------------------------------------------------------------------------
# Running cases


def _free(device):
    # A GPU's memory figures read the allocator, which a previous case's cycles would still hold. On CPU they count
    # only what a case allocates (PeakTemporaries), and a collection of the interpreter's heap costs 0.3 s a case.
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def _one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:300] if msg else ''}"


class Runner:
    def __init__(self, args, device, env):
        self.args, self.device, self.env = args, device, env
        self.timer = Timer(device, args)
        self.records: list[dict] = []
        self.skipped: dict[str, str] = {}  # provider -> reason (whole provider cannot run here)
        self.step_skipped: dict[str, str] = {}  # provider -> reason its model step is not run
        self._t_case = time.perf_counter()
        self._say = print

    # -- records --------------------------------------------------------------------------------------------
    def record(self, case: C.Case, status, *, ms=None, peak=None, extra=None, wbytes=None, note="", **more):
        flops, nbytes = C.work(case)
        roof = {dev: C.roofline(case, dev) for dev in C.PEAKS}
        roof_ms = {dev: (None if v is None else v[0]) for dev, v in roof.items()}
        here = self.env.get("roofline_device")
        rec = dict(
            device=self.env["device"],
            torch=self.env["torch"],
            triton=self.env["triton"],
            commit=self.env["commit"],
            date=self.env["date"],
            provider=case.provider,
            mode=case.mode,
            shape=case.shape,
            in_features=case.in_features,
            out_features=case.out_features,
            tokens=case.tokens,
            rank=case.rank,
            dtype=case.dtype,
            dropout=case.dropout,
            weight_dtype=C.weight_storage(case.provider, case.dtype),
            adapter_dtype=C.adapter_dtype(case.provider, case.dtype),
            status=status,
            ms=ms,
            flops=flops,
            bytes=nbytes,
            tflops=(flops / (ms * 1e-3) / 1e12) if (ms and flops) else None,
            gbps=(nbytes / (ms * 1e-3) / 1e9) if (ms and nbytes) else None,
            # The floor of this case on each device's datasheet peaks, the resource that sets it, and measured /
            # floor on this device (a GPU with known peaks only; on CPU only the floors are written).
            roofline_ms=roof_ms,
            roofline_bound={dev: (None if v is None else v[1]) for dev, v in roof.items()},
            x_roofline=(ms / roof_ms[here]) if (ms and here and roof_ms.get(here)) else None,
            peak_mem_bytes=peak,
            peak_extra_bytes=extra,
            weight_bytes=wbytes,
            timing=self.env["timing"],
            note=note,
            wall_s=round(time.perf_counter() - self._t_case, 3),  # measuring this case, warm-up included
            main_loop=self.env.get("main_loop"),
        )
        rec.update(more)
        self.records.append(rec)
        return rec

    def _skip_all(self, cases, status, note, pbar):
        for c in cases:
            pbar.set_postfix_str(c.label)
            self.record(c, status, note=note)
            pbar.update(1)

    # -- layer cases ------------------------------------------------------------------------------------------
    def run_layer_group(self, cases, pbar):
        import _providers as P

        c0 = cases[0]
        self._t_case = time.perf_counter()
        if c0.provider in self.skipped:
            return self._skip_all(cases, "skipped", self.skipped[c0.provider], pbar)
        try:
            layer = P.build_layer(c0.provider, c0.in_features, c0.out_features, c0.rank, c0.dtype, c0.dropout,
                                  self.device)
        except P.Skip as e:
            return self._skip_all(cases, "skipped", str(e), pbar)
        except Exception as e:
            status = "oom" if _is_oom(e) else "error"
            self._say(f"  {c0.provider}: building {c0.shape} r={c0.rank} failed: {_one_line(e)}")
            _free(self.device)
            return self._skip_all(cases, status, f"build failed: {_one_line(e)}", pbar)

        for case in cases:
            pbar.set_postfix_str(case.label)
            self._t_case = time.perf_counter()
            try:
                self._measure_layer(layer, case)
            except Exception as e:
                status = "oom" if _is_oom(e) else "error"
                self.record(case, status, wbytes=layer.weight_bytes, note=f"{layer.note}; {_one_line(e)}")
                if status == "error":
                    self._say(f"  {case.label}: {_one_line(e)}")
            _free(self.device)
            pbar.update(1)
        del layer
        _free(self.device)

    def _norm_copies(self, wbytes):
        """How many weight sets the norm rotates through so that one pass reads more than twice the L2."""
        l2 = self.env.get("l2_bytes")
        if self.device.type != "cuda" or not l2:
            return 1
        return max(1, min(8, math.ceil(2 * l2 / max(wbytes, 1))))

    def _measure_layer(self, layer, case):
        import _providers as P

        dtype = P.TORCH_DTYPES[case.dtype]
        dev = self.device
        note = layer.note
        if case.mode == "norm":
            if layer.norm is None:
                return self.record(case, "skipped", note="no weight norm in this provider")
            layers = [layer]
            it = [0]

            def fn():
                lay = layers[it[0] % len(layers)]
                it[0] += 1
                with torch.no_grad():
                    return lay.norm()

            fn()  # compile / autotune outside the timed region
            peak, extra = self.timer.memory(fn)  # before the copies below exist
            n_copies = self._norm_copies(layer.weight_bytes)
            for _ in range(n_copies - 1):
                layers.append(P.build_layer(case.provider, case.in_features, case.out_features, case.rank,
                                            case.dtype, 0.0, dev))
            ms = self.timer.ms(fn)
            if n_copies > 1:
                note += f"; rotating {n_copies} weight sets (> 2x L2)"
            del layers
            return self.record(case, "ok", ms=ms, peak=peak, extra=extra, wbytes=layer.weight_bytes, note=note)

        M, K, N = case.tokens, case.in_features, case.out_features
        torch.manual_seed(0)
        x = torch.randn(M, K, dtype=dtype, device=dev).requires_grad_()
        dy = torch.randn(M, N, dtype=dtype, device=dev)
        grads = [x] + list(layer.params)

        if case.mode == "fwd":
            def fn():
                return layer.forward(x)
        elif case.mode == "fwd+bwd":
            def fn():
                layer.forward(x).backward(dy)
        elif case.mode == "fwd-cachednorm":
            def fn():
                return layer.forward_cached(x)
        elif case.mode == "fwd+bwd-cachednorm":
            def fn():
                layer.forward_cached(x).backward(dy)
        elif case.mode == "bwd":
            y = layer.forward(x)

            def fn():
                y.backward(dy, retain_graph=True)
        else:
            raise ValueError(case.mode)

        fn()  # compile / autotune
        peak, extra = self.timer.memory(fn, grads)
        ms = self.timer.ms(fn, grads)
        return self.record(case, "ok", ms=ms, peak=peak, extra=extra, wbytes=layer.weight_bytes, note=note)

    # -- model step -------------------------------------------------------------------------------------------
    def run_step(self, case, spec, pbar):
        import _providers as P

        pbar.set_postfix_str(case.label)
        self._t_case = time.perf_counter()
        why = self.skipped.get(case.provider) or self.step_skipped.get(case.provider)
        if why:
            self.record(case, "skipped", note=why, model=spec.label)
            return pbar.update(1)
        step = None
        try:
            step = P.build_step(case.provider, spec, case.dtype, case.dropout, self.device)
            step.run()  # compile / autotune, optimizer state
            if self.device.type == "cuda":
                step.run()
            resident = torch.cuda.memory_allocated() if self.device.type == "cuda" else None
            peak, extra = self.timer.memory(step.run)
            ms = self.timer.ms(step.run, rep_scale=5.0)
            self.record(case, "ok", ms=ms, peak=peak, extra=extra, wbytes=step.weight_bytes, note=step.note,
                        model=spec.label, tokens_per_s=spec.seq / (ms * 1e-3), resident_bytes=resident)
        except P.Skip as e:
            self.record(case, "skipped", note=str(e), model=spec.label)
        except Exception as e:
            status = "oom" if _is_oom(e) else "error"
            self.record(case, status, note=_one_line(e), model=spec.label)
            if status == "error":
                self._say(f"  {case.label}: {_one_line(e)}")
        del step
        _free(self.device)
        pbar.update(1)


class _Counter:
    """A stand-in for tqdm: prints `[i/n] case` lines."""

    def __init__(self, total):
        self.total, self.n, self.label = total, 0, ""

    def set_postfix_str(self, s):
        self.label = s

    def update(self, k=1):
        self.n += k
        print(f"[{self.n}/{self.total}] {self.label}", flush=True)

    def close(self):
        pass

    @staticmethod
    def write(s):
        print(s, flush=True)


def _progress(total):
    try:
        from tqdm import tqdm

        return tqdm(total=total, unit="case", dynamic_ncols=True, mininterval=1.0), tqdm.write
    except ImportError:
        return _Counter(total), _Counter.write


def main(argv=None):
    args = parse_args(argv)
    # --smoke is the CPU check (CI has no GPU); on a GPU machine pass --device cuda to run the tiny grid there.
    default = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    device = torch.device(args.device or default)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda but torch sees no GPU")
    providers = C.parse_list(args.providers)
    modes = C.parse_list(args.modes)
    for p in providers:
        if p not in C.PROVIDERS:
            sys.exit(f"unknown provider {p!r}; choose from {', '.join(C.PROVIDERS)}")
    for m in modes:
        if m not in C.MODES:
            sys.exit(f"unknown mode {m!r}; choose from {', '.join(C.MODES)}")
    dtypes = C.parse_list(args.dtypes)
    for d in dtypes:
        if d not in C.DTYPES:
            sys.exit(f"unknown dtype {d!r}; choose from {', '.join(C.DTYPES)}")
    if device.type == "cpu" and args.smoke:
        torch.set_num_threads(1)  # tiny shapes: threads only add overhead (and load on a shared machine)
    interpreted = [p for p in providers if C.DORAFP8_BACKENDS.get(p, ("",))[0] in ("triton", "cublas")]
    if device.type == "cpu" and interpreted:
        # Triton reads this when kernels are defined, i.e. when dorafp8 is first imported (lazily, below).
        os.environ.setdefault("TRITON_INTERPRET", "1")

    shapes = C.parse_shapes(args.shapes)
    tokens = C.parse_list(args.tokens, int)
    ranks = C.parse_list(args.ranks, int)
    dropouts = C.parse_list(args.dropouts, float)
    spec = C.parse_model(args.model)
    layer_modes = [m for m in modes if m in C.LAYER_MODES]
    cases = C.preset_cases(args.preset, shapes, tokens, ranks, dtypes, dropouts, providers, layer_modes) \
        if layer_modes else []
    if args.preset in C.PRESET_CASES and not cases:
        sys.exit(f"--preset {args.preset} with these options selects no case: it lists only shapes "
                 f"{C.PRESETS[args.preset]['shapes']}, M {C.PRESETS[args.preset]['tokens']}, providers "
                 f"{C.PRESETS[args.preset]['providers']}, modes {C.PRESETS[args.preset]['modes']}")
    steps = C.step_cases(spec, dtypes, dropouts, providers) if "step" in modes else []
    if args.exclude_preset:
        drop = set(C.default_cases(args.exclude_preset))
        cases = [c for c in cases if c not in drop]
    if args.dry_run:
        for c in cases + steps:
            print(c.label)
        print(f"{len(cases)} layer cases, {len(steps)} model steps")
        return 0

    import _providers as P

    env = environment(device)
    out = args.out or os.path.join(ROOT, "bench_out", device_slug(env["device"]))
    os.makedirs(out, exist_ok=True)
    if not env["speed_claims"]:
        print("NOTE: CPU run: times are perf_counter medians (NO SPEED CLAIMS)"
              + (f"; {', '.join(interpreted)} run under the Triton interpreter" if env["triton_interpret"] and
                 interpreted else "") + ".")
    runner = Runner(args, device, env)
    for prov in providers:
        try:
            P.check(prov, device)
        except P.Skip as e:
            runner.skipped[prov] = str(e)
            print(f"skip {prov}: {e}")
    if device.type == "cpu" and not args.interpreter_steps:
        for prov in interpreted:
            runner.step_skipped.setdefault(
                prov, "model step not run on CPU for providers under the Triton interpreter (tens of seconds per "
                      "step; the layer cases above and tests/peft/test_peft.py cover them; --interpreter-steps runs "
                      "it)")

    t0 = time.perf_counter()
    env["copy_gbps"] = copy_bandwidth(device, runner.timer)
    results = dict(meta=env, args=vars(args), records=runner.records)
    path = os.path.join(out, "results.json")

    def save():
        env["wall_s"] = round(time.perf_counter() - t0, 1)
        with open(path + ".tmp", "w") as f:
            json.dump(results, f, indent=1)
        os.replace(path + ".tmp", path)

    pbar, write = _progress(len(cases) + len(steps))
    runner._say = write
    group: list[C.Case] = []
    gkey = None  # the key of the cases in group
    for case in cases + [None]:
        key = None if case is None else (case.provider, case.in_features, case.out_features, case.rank, case.dtype,
                                         case.dropout if case.mode != "norm" else 0.0)
        if group and (case is None or key != gkey):
            runner.run_layer_group(group, pbar)
            save()
            group = []
        if case is not None:
            gkey = key
            group.append(case)
    for case in steps:
        runner.run_step(case, spec, pbar)
        save()
    pbar.close()
    save()

    import plot

    written = plot.render(results, out)
    n_ok = sum(r["status"] == "ok" for r in runner.records)
    bad = [r for r in runner.records if r["status"] in ("error", "oom")]
    print(f"{n_ok}/{len(runner.records)} cases measured in {env['wall_s']:.1f} s; "
          f"{len(bad)} errors/oom; wrote {path}" + "".join(f", {w}" for w in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
