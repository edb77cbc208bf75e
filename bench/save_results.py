"""Turn what bench/gpu_session.sh's device calls returned into bench/results/<device>/ and README's performance table.

    python bench/save_results.py OUT1 OUT2 OUT3 --commit SHA   # each call's $OUT folder (holding session.tar.gz),
                                                               #   a session.tar.gz, or an unpacked session folder
    python bench/save_results.py OUT1 --readme none            # bench/results/ only, README left alone
    git add bench/results/<device>/ README.md && git commit

Each session holds the results of the benchmark its call ran (call 1: decisive/results.json, the 24 decisive cases;
call 3: bench/results.json, the rest of the headline grid); the loose <name>_results.json beside the tarball in
$OUT is used instead when it holds more records (it is copied every 2 s, the tarball every 20 s). The records of
every session are merged per device (a call that landed on another kind of GPU gets its own folder), each tagged
with the benchmark it came from ("run"); meta["runs"] lists the runs (commit, date, versions, wall time).

Writes bench/results/<device-slug>/: results.json, results.md and the PNGs (plot.py, from the merged records),
session-call<N>.md (each call's step table), device.txt, tests_summary.txt, sanitizer_*_summary.txt,
build_info.json, ncu_* where profiled, inspect.json where present, logs/call<N>/ (each log's last 200 KB), a
README.md listing them; then README.md's performance table (between its perf-table markers) from every
bench/results/*/results.json measured on a GPU.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import sys
import tarfile
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _cases import (  # noqa: E402
    DECISIVE_CASES,
    DECISIVE_DTYPE,
    DECISIVE_RANK,
    DECISIVE_SHAPE,
    base_mode,
    device_slug,
)

LOG_TAIL = 200 * 1024
RUNS = ("decisive", "bench")  # the benchmarks a session may hold, in the order their records are merged
# README's markers (not `<!-- word: ... -->`, which tests/integration/doc_runner.py reads as a directive)
BEGIN = "<!-- BEGIN perf-table"
END = "<!-- END perf-table -->"
# The README table's columns: (heading, provider); a dorafp8 column shows the row's mode, the others its base mode.
COLUMNS = (
    ("dorafp8 W8A16", "dorafp8-triton"),
    ("dorafp8 W8A8", "dorafp8-triton-w8a8"),
    ("dorafp8 cuBLAS strategy", "dorafp8-cublas"),
    ("PEFT DoRA, bf16 weight", "peft-dora"),
    ("PEFT DoRA, fp8 dequantized per call", "peft-dora-fp8-dequant"),
    ("cuBLAS bf16 Linear", "linear-bf16"),
    ("fp8 Linear (`torch._scaled_mm`)", "linear-fp8-rowwise"),
)


def _safe_extract(src: str, tmp: str) -> None:
    with tarfile.open(src) as tf:
        for m in tf.getmembers():  # a session's own tarball: plain files and folders under one folder
            if m.name.startswith(("/", "..")) or ".." in m.name.split("/") or not (m.isfile() or m.isdir()):
                raise SystemExit(f"{src}: unexpected member {m.name!r}")
        tf.extractall(tmp)


def session_dir(src: str, tmp: str) -> tuple[str, str | None]:
    """(the staging folder of a session, the $OUT folder it came from or None), unpacking a tarball into `tmp`."""
    out = None
    if os.path.isdir(src) and os.path.isfile(os.path.join(src, "session.tar.gz")):
        out, src = src, os.path.join(src, "session.tar.gz")
    if os.path.isfile(src) and src.endswith((".tar.gz", ".tgz")):
        out = out or os.path.dirname(src)
        _safe_extract(src, tmp)
        cands = sorted(os.path.dirname(p) for p in glob.glob(os.path.join(tmp, "*", "summary.md")))
        if not cands:
            raise SystemExit(f"{src}: no <session>/summary.md inside")
        return cands[0], out
    if os.path.isdir(src) and os.path.isfile(os.path.join(src, "summary.md")):
        return src, None
    raise SystemExit(f"{src}: neither a session's $OUT folder, a session.tar.gz, nor a session folder")


def call_name(sess: str) -> str:
    """"call1" for a staging folder named session-call1 (bench/gpu_session.sh); "session" for older ones."""
    m = re.search(r"call(\d+)$", os.path.basename(sess.rstrip("/")))
    return f"call{m.group(1)}" if m else "session"


def _load(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None  # absent, or a copy cut in the middle


def session_runs(sess: str, out: str | None) -> list[tuple[str, dict]]:
    """(run name, results) of each benchmark in a session: the copy with more records of the tarball's and $OUT's."""
    runs = []
    for name in RUNS:
        cands = [_load(os.path.join(sess, name, "results.json"))]
        if out:
            cands.append(_load(os.path.join(out, f"{name}_results.json")))
        cands = [c for c in cands if c and "records" in c and "meta" in c]
        if cands:
            runs.append((name, max(cands, key=lambda c: len(c["records"]))))
    return runs


def _case_key(r: dict) -> tuple:
    return (r["provider"], r["mode"], r["shape"], r["tokens"], r["rank"], r["dtype"], r["dropout"])


def merge(runs: list[tuple[str, str, dict]], commit: str | None) -> dict[str, dict]:
    """device name -> merged results, from (call, run name, results) in order. A case measured twice keeps its first
    'ok' record (the decisive run comes first); every record says which run it came from."""
    merged: dict[str, dict] = {}
    for call, name, res in runs:
        meta = dict(res["meta"])
        if commit and str(meta.get("commit", "unknown")).startswith("unknown"):
            meta["commit"] = commit
        dev = meta["device"]
        m = merged.setdefault(dev, dict(meta=dict(meta, runs=[]), args=res.get("args", {}), records=[], _seen={}))
        m["meta"]["runs"].append({k: meta.get(k) for k in ("commit", "date", "wall_s", "torch", "triton", "peft",
                                                             "driver")} | dict(call=call, run=name,
                                                                                records=len(res["records"])))
        for r in res["records"]:
            r = dict(r, run=name, call=call)
            if commit and str(r.get("commit", "unknown")).startswith("unknown"):
                r["commit"] = commit
            k = _case_key(r)
            if k in m["_seen"]:
                i = m["_seen"][k]
                if m["records"][i]["status"] != "ok" and r["status"] == "ok":
                    m["records"][i] = r
                continue
            m["_seen"][k] = len(m["records"])
            m["records"].append(r)
    for m in merged.values():
        del m["_seen"]
        commits = sorted({str(r["commit"]) for r in m["meta"]["runs"]})
        if len(commits) > 1:
            m["meta"]["commit"] = " + ".join(commits)
            print(f"warning: {m['meta']['device']}: the runs measured different commits ({', '.join(commits)})",
                  file=sys.stderr)
    return merged


def _tail(src: str, dst: str) -> None:
    size = os.path.getsize(src)
    with open(src, "rb") as f:
        if size > LOG_TAIL:
            f.seek(size - LOG_TAIL)
        data = f.read()
    with open(dst, "wb") as f:
        if size > LOG_TAIL:
            f.write(f"[... first {size - LOG_TAIL} bytes cut by save_results.py ...]\n".encode())
        f.write(data)


def copy_session_files(sess: str, call: str, dest: str) -> list[str]:
    """A session's step table, summaries and log tails into `dest`; the names written."""
    written = []
    copies = {
        "summary.md": f"session-{call}.md", "plan.txt": f"plan-{call}.txt", "device.txt": "device.txt",
        "tests_summary.txt": "tests_summary.txt", "build_info.json": "build_info.json",
        "ncu/summary.txt": "ncu_summary.txt", "ncu/details.txt": "ncu_details.txt",
        "ncu/kernels.json": "ncu_kernels.json", "ncu/find.log": "ncu_find.txt", "inspect.json": "inspect.json",
    }
    for p in glob.glob(os.path.join(sess, "sanitizer_*_summary.txt")):
        copies[os.path.basename(p)] = os.path.basename(p)
    for src, name in copies.items():
        p = os.path.join(sess, src)
        if os.path.isfile(p) and os.path.getsize(p) > 0:
            shutil.copy(p, os.path.join(dest, name))
            written.append(name)
    logs = sorted(glob.glob(os.path.join(sess, "*.log")) + glob.glob(os.path.join(sess, "*", "*.log")))
    if logs:
        os.makedirs(os.path.join(dest, "logs", call), exist_ok=True)
    for p in logs:
        rel = os.path.relpath(p, sess).replace(os.sep, "-")
        _tail(p, os.path.join(dest, "logs", call, rel))
        written.append(f"logs/{call}/{rel}")
    return written


# ---------------------------------------------------------------------------------------------------------------
# README's performance table


def _ms(r: dict | None) -> str:
    if r is None:
        return "-"
    return f"{r['ms']:.3f}" if r["status"] == "ok" and r.get("ms") else r["status"]


def perf_table(results: dict) -> str:
    """The decisive cases of one device as a markdown table: one row per dorafp8 mode, M and dropout measured; PEFT's
    and the floors' cells at the row's base mode (PEFT has no cached norm), the floors without dropout."""
    K, N = DECISIVE_SHAPE
    shape = f"{K}x{N}"
    recs = {(r["provider"], r["mode"], r["tokens"], r["dropout"]): r for r in results["records"]
            if r["shape"] == shape and r["rank"] == DECISIVE_RANK and r["dtype"] == DECISIVE_DTYPE}
    order = {(c.mode, c.tokens, c.dropout): i for i, c in enumerate(DECISIVE_CASES)}
    rows = sorted({(m, t, p) for (prov, m, t, p) in recs if prov.startswith("dorafp8-") and t is not None},
                  key=lambda k: (order.get(k, len(order)), k[1], k[2], k[0]))
    meta = results["meta"]
    lines = [f"**{meta['device']}** (driver {meta.get('driver')}; torch {meta.get('torch')}, triton "
             f"{meta.get('triton')}, peft {meta.get('peft')}; commit {meta.get('commit')}; {meta.get('date')}): "
             f"median ms of `triton.testing.do_bench`, {shape} (N = K = {K}), r {DECISIVE_RANK}, "
             f"{DECISIVE_DTYPE} activations, fp32 adapters, per-tensor fp8 scale. \"norm cached\": dorafp8 given the "
             "weight norm computed earlier (every micro-batch after the first); PEFT's and the floors' cells are "
             "their full call. vs PEFT = PEFT ms / dorafp8 W8A16 ms.", "",
             "| mode | M | dropout | " + " | ".join(h for h, _ in COLUMNS) + " | vs PEFT |",
             "|---|---|---|" + "---|" * (len(COLUMNS) + 1)]
    for mode, tokens, p in rows:
        cells = []
        for _, prov in COLUMNS:
            if prov.startswith("dorafp8-"):
                key = (prov, mode, tokens, p)
            elif prov.startswith("linear-"):
                key = (prov, base_mode(mode), tokens, 0.0)
            else:
                key = (prov, base_mode(mode), tokens, p)
            cells.append(recs.get(key))
        mine, peft = cells[0], cells[3]
        ratio = (f"{peft['ms'] / mine['ms']:.2f}x" if mine and peft and mine["status"] == peft["status"] == "ok"
                 and mine.get("ms") and peft.get("ms") else "-")
        label = base_mode(mode) + (", norm cached" if mode != base_mode(mode) else "")
        lines.append(f"| {label} | {tokens} | {p:g} | " + " | ".join(_ms(c) for c in cells) + f" | {ratio} |")
    if not rows:
        lines.append("| _no dorafp8 record at this shape_ |" + " |" * (len(COLUMNS) + 3))
    return "\n".join(lines)


def update_readme(readme: str, results_root: str) -> bool:
    """Rewrites the block between README's perf-table markers from every GPU results.json under `results_root`.
    False (README untouched) when there is none: CPU results make no speed claims."""
    found = []
    for path in sorted(glob.glob(os.path.join(results_root, "*", "results.json"))):
        res = _load(path)
        if res and res["meta"].get("speed_claims"):
            found.append((os.path.relpath(os.path.dirname(path), os.path.dirname(os.path.abspath(readme))), res))
    if not found:
        return False
    text = open(readme).read()
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        raise SystemExit(f"{readme}: no '{BEGIN} ... {END}' block to write the table into")
    i = text.index("-->", i) + 3
    body = "\n\n".join(f"{perf_table(res)}\n\nEverything measured: [{rel}/results.md]({rel}/results.md)."
                       for rel, res in found)
    with open(readme, "w") as f:
        f.write(text[:i] + "\n" + body + "\n" + text[j:])
    return True


# ---------------------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", nargs="+", help="each call's $OUT, its session.tar.gz, or an unpacked session folder")
    ap.add_argument("--dest", default=os.path.join(HERE, "results"), help="default bench/results")
    ap.add_argument("--commit", help="the commit the sessions ran (fills in results.json's commit where unknown)")
    ap.add_argument("--readme", default=os.path.join(ROOT, "README.md"),
                    help="the README whose performance table is rewritten; 'none' to leave it")
    args = ap.parse_args(argv)

    import plot

    with tempfile.TemporaryDirectory() as tmp:
        runs, sessions = [], []
        for k, src in enumerate(args.src):
            sess, out = session_dir(os.path.abspath(src), os.path.join(tmp, str(k)))
            call = call_name(sess)
            sessions.append((sess, call))
            runs += [(call, name, res) for name, res in session_runs(sess, out)]
        if not runs:
            raise SystemExit("no results.json in " + ", ".join(args.src) + " (did a benchmark step run? see "
                             "each summary.md)")
        merged = merge(runs, args.commit)
        for dev, results in merged.items():
            meta = results["meta"]
            if not meta.get("speed_claims"):
                print(f"warning: {dev}: a CPU run (no speed claims); committing it says nothing about speed",
                      file=sys.stderr)
            if str(meta.get("commit", "unknown")).startswith("unknown"):
                print("warning: results.json does not say which commit ran (no git on the GPU machine): pass --commit "
                      "SHA, or run the session with DORAFP8_COMMIT=SHA", file=sys.stderr)
            dest = os.path.join(args.dest, device_slug(dev))
            os.makedirs(dest, exist_ok=True)
            with open(os.path.join(dest, "results.json"), "w") as f:
                json.dump(results, f, indent=1)
            written = ["results.json"] + [os.path.basename(p) for p in plot.render(results, dest)]
            # a session's files go with the device its benchmark ran on; a session without one (call 2: tests)
            # with the first device
            for sess, call in sessions:
                its = {r["meta"]["device"] for c, _, r in runs if c == call}
                if dev in its or (not its and dev == next(iter(merged))):
                    written += copy_session_files(sess, call, dest)
            with open(os.path.join(dest, "README.md"), "w") as f:
                f.write(
                    f"# {dev}\n\nbench/gpu_session.sh on {dev} (driver {meta.get('driver')}), torch {meta['torch']} "
                    f"(CUDA {meta.get('cuda')}), triton {meta.get('triton')}, peft {meta.get('peft')}; commit "
                    f"{meta.get('commit')}.\n\n"
                    "- results.md: dorafp8 vs PEFT vs the floors, the roofline, memory; results.json: every record "
                    "(`run`: decisive = call 1's 24 cases, bench = call 3's rest of the headline grid); *.png\n"
                    "- session-call<N>.md: each call's steps (rc, seconds, outcome); plan-call<N>.txt: its plan; "
                    "logs/call<N>/: the logs (tails)\n"
                    "- tests_summary.txt, sanitizer_*_summary.txt: the GPU tests and compute-sanitizer\n"
                    "- ncu_*: Nsight Compute on the slowest dorafp8 kernel; inspect.json: python -m "
                    "dorafp8.kernel_report (where the session got that far)\n\n## Runs\n\n"
                    + "".join(f"- {r['call']} {r['run']}: {r['records']} records, commit {r['commit']}, {r['date']}, "
                              f"wall {r['wall_s']} s\n" for r in meta["runs"]))
            written.append("README.md")
            print(f"wrote {dest}/: " + ", ".join(written))
    if args.readme != "none" and update_readme(args.readme, args.dest):
        print(f"rewrote the performance table in {args.readme}")
    print("next: git add bench/results/ README.md && git commit -m 'bench results: <device>'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
