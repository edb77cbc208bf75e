"""Turn what bench/first_contact.py's commands returned into bench/results/<device>/ and README's performance table.

    python bench/save_results.py OUT1 [OUT2] --commit SHA   # each command's $OUT (first_contact.json, more.json,
                                                            #   log.txt), or the JSON files themselves
    python bench/save_results.py OUT1 --readme none         # bench/results/ only, README left alone
    git add bench/results/<device>/ README.md && git commit

Writes bench/results/<device-slug>/: results.json (the timed records of both commands, merged: meta, records, and
the autotuned re-timings apart) with results.md and the PNGs (plot.py); correctness.md (each fp64 check: how much of
its allowed error the worst element used); kernels.md (torch.profiler's per-kernel times beside the kernel report's
prediction of each, and the pinned configs); race.md (backend="auto"'s picks); host.md (host or GPU: each call's
enqueue, GPU and Triton launch-path times); tests.md (the GPU tests and
compute-sanitizer); the two JSON files as they came; logs/ (each log's last 200 KB); a README.md listing them; an
earlier run's files of these names that this run did not write again are removed (nothing else there). Then
README.md's performance table (between its perf-table markers) from every bench/results/*/results.json measured on a
GPU. A CPU run (--smoke) makes no speed claims: it is written with a warning, and never into README.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _cases import FIRST_DTYPE, FIRST_RANK, FIRST_SHAPE, FIRST_TOKENS, device_slug, first_mode  # noqa: E402

LOG_TAIL = 200 * 1024
NAMES = {"first_contact.json": "first", "more.json": "more"}
# README's markers (not `<!-- word: ... -->`, which tests/integration/doc_runner.py reads as a directive)
BEGIN = "<!-- BEGIN perf-table"
END = "<!-- END perf-table -->"
# The README table's columns: (heading, provider), each at its first-contact mode (dorafp8's DoRA: norm cached)
COLUMNS = (
    ("dorafp8 W8A16", "dorafp8-triton"),
    ("dorafp8 W8A8", "dorafp8-triton-w8a8"),
    ("dorafp8 cuBLAS strategy", "dorafp8-cublas"),
    ("LoRA on fp8, W8A16", "dorafp8-lora-triton"),
    ("LoRA on fp8, W8A8", "dorafp8-lora-triton-w8a8"),
    ("PEFT DoRA, bf16", "peft-dora"),
    ("PEFT LoRA, bf16", "peft-lora"),
    ("dequantize + cuBLAS Linear", "linear-fp8-dequant"),
    ("cuBLAS bf16 Linear", "linear-bf16"),
)
# The ratios after them: (heading, numerator provider, denominator provider)
RATIOS = (("W8A16 / Linear", "dorafp8-triton", "linear-bf16"),
          ("W8A16 / dequantize + Linear", "dorafp8-triton", "linear-fp8-dequant"),
          ("DoRA / LoRA, W8A16", "dorafp8-triton", "dorafp8-lora-triton"),
          ("PEFT DoRA / W8A16", "peft-dora", "dorafp8-triton"))


def load(src: str) -> list[tuple[str, dict, str | None]]:
    """[(command, its results, its log.txt or None)] of a $OUT folder or a results file."""
    paths = [os.path.join(src, n) for n in NAMES] if os.path.isdir(src) else [src]
    out = []
    for p in paths:
        if os.path.isfile(p):
            with open(p) as f:
                data = json.load(f)
            log = os.path.join(os.path.dirname(p), "log.txt")
            out.append((data.get("plan", {}).get("command") or NAMES.get(os.path.basename(p), "first"), data,
                        log if os.path.isfile(log) else None))
    if not out:
        raise SystemExit(f"{src}: neither a first_contact $OUT folder nor a first_contact.json / more.json")
    return out


def timed(command: str, data: dict) -> list[tuple[str, dict]]:
    """(run name, {meta, records}) of every timing a command holds: command 1's, command 2's grid."""
    runs = [("first", data["timing"])] if "timing" in data else []
    return runs + [(f"grid-{k}", v) for k, v in data.get("grid", {}).items()]


def _key(r: dict) -> tuple:
    return r["provider"], r["mode"], r["shape"], r["tokens"], r["rank"], r["dtype"], r["dropout"]


def merge(sources, commit: str | None) -> dict[str, dict]:
    """device -> {meta, records, autotuned, commands}: the records of every timing, each tagged with its run (a case
    timed twice keeps its first 'ok' record); the grid's autotuned re-timings apart, beside the pinned ones."""
    merged: dict[str, dict] = {}
    for command, data, _ in sources:
        for run, res in timed(command, data):
            meta = dict(res["meta"], commit=commit or res["meta"].get("commit"))
            m = merged.setdefault(meta["device"], dict(meta=dict(meta, runs=[]), records=[], autotuned=[],
                                                       commands={}))
            m["meta"]["runs"].append({"run": run, "records": len(res["records"]), "date": meta.get("date")})
            for r in res["records"]:
                r = dict(r, run=run, commit=meta["commit"])
                if run == "grid-autotuned":
                    m["autotuned"].append(r)
                    continue
                seen = {_key(x): i for i, x in enumerate(m["records"])}
                i = seen.get(_key(r))
                if i is None:
                    m["records"].append(r)
                elif m["records"][i]["status"] != "ok" and r["status"] == "ok":
                    m["records"][i] = r
        dev = data.get("env", {}).get("device")
        if dev:
            merged.setdefault(dev, dict(meta=dict(data["env"], runs=[]), records=[], autotuned=[], commands={}))
            merged[dev]["commands"][command] = data
            # a time is only worth its results: the fp64 checks that failed travel with the records (perf_table)
            merged[dev]["meta"]["failed_checks"] = [
                f"{k} ({v['backend']}{', act_quant=' + v['act_quant'] if v.get('act_quant') else ''}"
                f"{', ' + v['main_loop'] + ' loop' if v.get('main_loop') else ''})"
                for k, v in data.get("correct", {}).items() if not v.get("pass")] + \
                merged[dev]["meta"].get("failed_checks", [])
    return merged


def _ms(r: dict | None) -> str:
    if r is None:
        return "-"
    return f"{r['ms']:.3f}" if r["status"] == "ok" and r.get("ms") else r["status"]


def _by_case(records) -> dict:
    K, N = FIRST_SHAPE
    return {(r["provider"], r["tokens"]): r for r in records if r["shape"] == f"{K}x{N}" and r["rank"] == FIRST_RANK
            and r["dtype"] == FIRST_DTYPE and r["dropout"] == 0 and r["mode"] == first_mode(r["provider"])}


def perf_table(results: dict) -> str:
    """The first-contact cases of one device: one row per M, each provider's median ms, then the ratios."""
    recs, meta = _by_case(results["records"]), results["meta"]
    K, N = FIRST_SHAPE
    lines = [f"**{meta['device']}** (driver {meta.get('driver')}; torch {meta.get('torch')}, triton "
             f"{meta.get('triton')}, peft {meta.get('peft')}; commit {meta.get('commit')}; {meta.get('date')}): "
             f"forward + input gradient, median ms of `triton.testing.do_bench`, N = K = {K}, r {FIRST_RANK}, "
             f"{FIRST_DTYPE} activations, fp32 adapters, per-tensor fp8 scale, no dropout; dorafp8's DoRA with the "
             "weight norm cached (every micro-batch after the first), the others' full call; dorafp8 GEMMs in the "
             "configs the kernel report's model picks (bench/first_contact.py).", "",
             "| M | " + " | ".join(h for h, _ in COLUMNS) + " | " + " | ".join(h for h, _, _ in RATIOS) + " |",
             "|---|" + "---|" * (len(COLUMNS) + len(RATIOS))]
    for M in FIRST_TOKENS:
        if not any(t == M for _, t in recs):
            continue
        cells = [_ms(recs.get((p, M))) for _, p in COLUMNS]
        ratios = []
        for _, a, b in RATIOS:
            ra, rb = recs.get((a, M)), recs.get((b, M))
            ok = ra and rb and ra["status"] == rb["status"] == "ok" and ra.get("ms") and rb.get("ms")
            ratios.append(f"{ra['ms'] / rb['ms']:.2f}x" if ok else "-")
        lines.append(f"| {M} | " + " | ".join(cells + ratios) + " |")
    if len(lines) == 4:
        lines.append("| _no first-contact record_ |" + " |" * (len(COLUMNS) + len(RATIOS)))
    if meta.get("failed_checks"):
        lines += ["", "**These fp64 checks failed on this GPU before the timing, so the times of what they check are "
                  "times of wrong results:** " + "; ".join(meta["failed_checks"]) + ". (A Triton check names its main "
                  "loop: it says nothing of times another loop made; results.json's records name theirs.)"]
    return "\n".join(lines)


def update_readme(readme: str, results_root: str) -> bool:
    """Rewrites the block between README's perf-table markers from every GPU results.json under `results_root`.
    False (README untouched) when there is none: CPU results make no speed claims."""
    found = []
    for path in sorted(glob.glob(os.path.join(results_root, "*", "results.json"))):
        with open(path) as f:
            res = json.load(f)
        if res["meta"].get("speed_claims"):
            found.append((os.path.relpath(os.path.dirname(path), os.path.dirname(os.path.abspath(readme))), res))
    if not found:
        return False
    with open(readme) as f:
        text = f.read()
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        raise SystemExit(f"{readme}: no '{BEGIN} ... {END}' block to write the table into")
    i = text.index("-->", i) + 3
    body = "\n\n".join(f"{perf_table(res)}\n\nEverything measured, the fp64 checks and the per-kernel split against "
                       f"the model's predictions: `{rel}/README.md`." for rel, res in found)  # a path, not a link:
    # README is also the package index's page, where a relative link points nowhere (test_newcomer)
    with open(readme, "w") as f:
        f.write(text[:i] + "\n" + body + "\n" + text[j:])
    return True


# ---------------------------------------------------------------------------------------------------------------
# The device folder's pages


def _table(head, rows) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                     + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def correctness_md(first: dict) -> str:
    rows = []
    for what, v in first.get("correct", {}).items():
        used = ", ".join(f"{t} {x['used']:.2f}" if x["used"] is not None else f"{t} NaN"
                         for t, x in v["tensors"].items())
        rows.append((what, v["backend"], v["act_quant"] or "-", f"{v['M']} x {v['N']} x {v['K']}, r {v['r']}",
                     "pass" if v["pass"] else "**FAIL**", used))
    return ("# Correctness against fp64, on the GPU, before any timing\n\nEach tensor: the largest share of its "
            "allowed error any element used (at most 1 passes): tests/_tolerance.py's bf16 tolerance against "
            "tests/_ref.py's fp64 DoRA, plus for W8A8 docs/DORA_MATH.md's contract bound.\n\n"
            + _table(("check", "backend", "act_quant", "M x N x K", "verdict", "share of the allowed error"), rows)
            + "\n" + "".join(f"\n{k}: {e}\n" for k, e in first.get("errors", {}).items()))


def kernels_md(first: dict) -> str:
    """Each profiled layer's kernels, measured, beside the model's prediction of the same launch."""
    model, out = first.get("model", {}), ["# Per-kernel times against the kernel report's model", ""]
    if "pins" in model:
        out += [f"Pinned configs (the model's picks, _pins.pin_configs): `{json.dumps(model['pins'])}`; predicted "
                f"on {model['device']}, cuBLAS bf16 Linear forward + dgrad {model['linear_us']:.1f} us.", ""]
    else:
        out += [f"No model for this GPU: {model.get('skipped', 'the pins step did not run')}.", ""]
    if "layers_error" in model:
        out += [f"No predicted times per kernel: the headline's dry runs failed ({model['layers_error']}).", ""]
    if "layers_cut" in model:
        out += [f"Not predicted: {model['layers_cut']}.", ""]
    for prov, mode in (("dorafp8-triton", "W8A16"), ("dorafp8-triton-w8a8", "W8A8"),
                       ("dorafp8-cublas", "dequantize + cuBLAS")):
        prof = first.get("profile", {}).get(prov)
        if prof is None:
            continue
        if "skipped" in prof:
            out += [f"## {mode} ({prov}): not profiled: {prof['skipped']}", ""]
            continue
        # the fast and the slow end of each prediction (one number where a file holds one)
        strategy = mode
        if model.get("layers") and prov != "dorafp8-cublas":  # a Triton GEMM's: the main loop the profile ran
            from dorafp8.kernel_report.predict import measured_strategy

            strategy = measured_strategy(mode, prof.get("main_loop"))
        pred = {k["name"].split(":", 1)[-1]: (k["predicted_us"], k.get("predicted_us_hi", k["predicted_us"]))
                for k in model.get("layers", {}).get(strategy, {}).get("kernels", [])}

        def us(lo, hi):
            return f"{lo:.1f}" if hi == lo else f"{lo:.1f}-{hi:.1f}"

        def ratio(t, lo, hi):
            return f"{t / lo:.2f}x" if hi == lo else f"{t / hi:.2f}-{t / lo:.2f}x"

        rows = [(k["name"][:60], f"{k['calls']:g}", f"{k['us']:.1f}", us(*pred[k["name"]]) if k["name"] in pred
                 else "-", ratio(k["us"], *pred[k["name"]]) if k["name"] in pred else "-") for k in prof["kernels"]]
        rows += [(f"{n} (not seen)", "-", "-", us(*p), "-") for n, p in pred.items()
                 if not any(k["name"] == n for k in prof["kernels"])]
        out += [f"## {strategy} ({prov}), M {prof['M']}, N = K = {prof['K']}, r {prof['r']}: one forward + backward, "
                f"norm cached, mean of {prof['iters']}", "", _table(("kernel", "calls", "measured us", "predicted us",
                                                                     "measured / predicted"), rows),
                "", f"Total measured {prof['total_us']:.1f} us", ""]
    return "\n".join(out)


def host_md(first: dict) -> str | None:
    """The host step: where each call's time goes, host or GPU, and how much of the host's is Triton's launch path."""
    if "host" not in first:
        return None  # a run from before the host step (the H200's at a516cbd): no page of question marks
    host = first["host"]
    rows = [(r["provider"], r["M"], f"{r['wall_us']:.0f}", f"{r['enqueue_us']:.0f}", f"{r['gpu_us']:.0f}",
             f"{r['launches']:g}", "host" if r["enqueue_us"] > r["gpu_us"] else "GPU", f"{r['triton_launches']:g}",
             f"{r['triton_us']:.0f}", f"{r['triton_jit_us']:.0f}", f"{r['host_timed_us'] - r['triton_us']:.0f}")
            if "error" not in r else (r["provider"], r["M"], f"**failed**: {r['error']}") + ("",) * 8
            for r in host.get("rows", [])]
    warn = ("**A CPU smoke run: it exercises the code, and measures nothing about a GPU.**\n\n" if host.get("smoke")
            else "")
    return (f"# Host or GPU: where a forward + backward's time goes\n\nMeasured on **{host.get('device', '?')}**, "
            f"{host.get('calls', '?')} calls per column (bench/_first_steps.py, host): the wall time per call with a "
            "sync after each (median); the host's time to enqueue a call (the calls timed, then one sync); the GPU's "
            "time (torch.profiler: its kernels, copies and fills summed) and their number; host-bound where the "
            "enqueue time exceeds the GPU's. Then a loop of its own with Triton's `run` methods timed: Triton's "
            "launches, the host's time inside them (the Autotuner / Heuristics wrappers, JITFunction.run's argument "
            "binding, the driver's launch), of it JITFunction.run's, and the rest of that loop's host time "
            "(dorafp8's Python, torch's operators, autograd). Times in us per call.\n\n" + warn
            + _table(("provider", "M", "wall, synced", "host enqueue", "GPU", "GPU launches", "bound",
                      "Triton launches", "in Triton's run", "of it JITFunction.run", "host rest"), rows) + "\n"
            + graph_md(first.get("graph"), host.get("rows", [])))


def graph_md(graph: dict | None, host_rows: list) -> str:
    """The host step's CUDA-graph rows (bench/_graph.py): a replay per step against the eager call's wall time."""
    if not graph:
        return ""
    eager = {(r["provider"], r["M"]): r["wall_us"] for r in host_rows if "wall_us" in r}
    rows = [(r["provider"], r["M"], "ok", f"{r['replay_us']:.0f}", f"{r['replay_enqueue_us']:.0f}",
             f"{r['capture_ms']:.1f}", f"{eager[r['provider'], r['M']]:.0f}" if (r["provider"], r["M"]) in eager
             else "-") if "replay_us" in r else
            (r["provider"], r["M"], f"**{'skipped' if 'skipped' in r else 'failed'}**: "
             f"{r.get('skipped') or r.get('error')}") + ("",) * 4 for r in graph.get("rows", [])]
    return ("\n## The same step captured in a CUDA graph\n\nEach provider's forward + backward captured once after an "
            "eager warm-up, its replay checked against an eager call on new inputs (y, dx, every parameter's gradient "
            f"within the dtype's tolerance) before timing, then {graph.get('replays', '?')} replays back to back and "
            "one sync. Times in us per step; the eager wall time from the table above.\n\n"
            + _table(("provider", "M", "check", "replay", "replay enqueue", "capture ms", "eager wall, synced"), rows)
            + "\n")


def race_md(first: dict) -> str:
    rows = [(M, v["key"], v["pick"], v["static"], ", ".join(f"{c} {t:.3f}" if t is not None else f"{c} refused: {v['verdicts'][c].get('error', '?')}"
                        for c, t in sorted(v["ms"].items())),
             f"{v['race_cost_s']:.3f}") for M, v in first.get("race", {}).items()]
    return ("# backend=\"auto\": the race (dorafp8/backends/race.py)\n\n"
            + _table(("call", "key", "pick", "static order", "ms per forward + backward", "cost of racing, s"), rows)
            + "\n")


def tests_md(more: dict) -> str:
    rows = [(k, v.get("command", "-"), v.get("rc", "-"), json.dumps(v.get("counts", v.get("skipped"))),
             "<br>".join(v.get("failures", [])[:10]) or "-") for k, v in more.get("tests", {}).items()]
    return ("# The GPU tests and compute-sanitizer (command 2)\n\n" + _table(("run", "command", "rc", "counts",
                                                                             "failures"), rows)
            + f"\n\nBuild: `{json.dumps(more.get('build'))}`\n")


def _tail(src: str, dst: str) -> None:
    size = os.path.getsize(src)
    with open(src, "rb") as f:
        f.seek(max(0, size - LOG_TAIL))
        data = f.read()
    with open(dst, "wb") as f:
        if size > LOG_TAIL:
            f.write(f"[... first {size - LOG_TAIL} bytes cut by save_results.py ...]\n".encode())
        f.write(data)


PAGES = {"correctness.md": (correctness_md, "first"), "kernels.md": (kernels_md, "first"),
         "race.md": (race_md, "first"), "host.md": (host_md, "first"), "tests.md": (tests_md, "more")}
# what write_device writes into a device folder besides results.json, results.md and README.md: the only files it
# removes there, when this run did not write them again (plot.py's PNGs are named by mode and dropout)
OWNED = [*PAGES, *(f"{c}.json" for c in NAMES.values()), *(f"logs/log-{c}.txt" for c in NAMES.values()),
         "time_vs_tokens_*.png", "norm.png", "memory.png"]


def _remove_stale(dest: str, written: list[str]) -> None:
    """An earlier run's pages, plots and logs that this run did not write (a command not run now, a mode not timed
    now) are removed: left, they stood beside this run's README under no commit of their own."""
    for pattern in OWNED:
        for path in glob.glob(os.path.join(glob.escape(dest), pattern)):
            if os.path.relpath(path, dest) not in written and os.path.isfile(path) and not os.path.islink(path):
                os.remove(path)


def write_device(dest: str, results: dict, sources) -> list[str]:
    import plot

    os.makedirs(dest, exist_ok=True)
    cmds = results.pop("commands")
    with open(os.path.join(dest, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    written = ["results.json"] + [os.path.basename(p) for p in plot.render(results, dest)]
    for name, (page, command) in PAGES.items():
        text = page(cmds[command]) if command in cmds else None
        if text is not None:
            with open(os.path.join(dest, name), "w") as f:
                f.write(text)
            written.append(name)
    for command, data, log in sources:
        if cmds.get(command) is data:
            with open(os.path.join(dest, f"{command}.json"), "w") as f:
                json.dump(data, f, indent=1)
            written.append(f"{command}.json")
            if log:
                os.makedirs(os.path.join(dest, "logs"), exist_ok=True)
                _tail(log, os.path.join(dest, "logs", f"log-{command}.txt"))
                written.append(f"logs/log-{command}.txt")
    meta = results["meta"]
    with open(os.path.join(dest, "README.md"), "w") as f:
        f.write(f"# {meta['device']}\n\nbench/first_contact.py on {meta['device']} (driver {meta.get('driver')}), "
                f"torch {meta.get('torch')} (CUDA {meta.get('cuda')}), triton {meta.get('triton')}, peft "
                f"{meta.get('peft')}; commit {meta.get('commit')}.\n\n"
                + "".join(f"- [{w}]({w})\n" for w in written if not w.endswith(".png")))
    _remove_stale(dest, written)
    return written + ["README.md"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", nargs="+", help="each command's $OUT, or its first_contact.json / more.json")
    ap.add_argument("--dest", default=os.path.join(HERE, "results"), help="default bench/results")
    ap.add_argument("--commit", help="the commit the commands ran (a GPU machine's copy of the tree has no git)")
    ap.add_argument("--readme", default=os.path.join(ROOT, "README.md"),
                    help="the README whose performance table is rewritten; 'none' to leave it")
    args = ap.parse_args(argv)
    sources = [s for src in args.src for s in load(src)]
    merged = merge(sources, args.commit)
    if not merged:
        raise SystemExit("no device in " + ", ".join(args.src) + " (did the env step run? see log.txt)")
    for dev, results in merged.items():
        if not results["meta"].get("speed_claims"):
            print(f"warning: {dev}: a CPU run (no speed claims); committing it says nothing about speed",
                  file=sys.stderr)
        if str(results["meta"].get("commit", "unknown")).startswith("unknown"):
            print("warning: no commit recorded: pass --commit SHA, or run with DORAFP8_COMMIT=SHA", file=sys.stderr)
        dest = os.path.join(args.dest, device_slug(dev))
        print(f"wrote {dest}/: " + ", ".join(write_device(dest, results, sources)))
    if args.readme != "none" and update_readme(args.readme, args.dest):
        print(f"rewrote the performance table in {args.readme}")
    print("next: git add bench/results/ README.md && git commit -m 'bench results: <device>'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
