"""How close each numerical check comes to its bound, under the CPU settings that change float rounding.

    python -m tests.margins                      (from the checkout's root; the default selection below)
    python -m tests.margins tests/peft -k conv   (any pytest arguments; figures: --figure NAME, repeatable)

A figure computed in float32 keeps its size from machine to machine but not its digits: the thread count splits sums
differently and ATEN_CPU_CAPABILITY picks other vector kernels. This runs the selection once per setting (1 and 2
threads, each with the machine's own kernels and with ATEN_CPU_CAPABILITY=default), collects what every
`tests._tolerance.within` and `assert_close` measured (they append to $DORAFP8_MARGINS), and prints each check's worst
figure against its bound. A check at half its bound or more is marked: a bound should hold with at least 2x room on
any machine. Exit status 1 if one is marked or a run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The checks with bounds set from a dtype's rounding that sit closest to them: end-to-end fp32 comparisons (two
# computations in another order), W8A8's normwise error, and the doc figure that quotes one.
DEFAULT_TESTS = ["tests/kernels/test_w8a8.py", "tests/peft/test_conv.py", "tests/checkpoint/test_musubi.py",
                 "tests/integration/test_diffusion.py", "tests/integration/test_kohya_dora.py",
                 "tests/integration/test_lycoris.py",
                 "tests/integration/test_newcomer.py::"
                 "test_adapter_trained_on_fp8_loads_onto_original_and_dequantized_base",
                 "tests/integration/test_newcomer.py::test_demo_prints_what_a_user_decides_on"]
DEFAULT_FIGURES = ["diffusion-reload"]
SETTINGS = [("1 thread", {"OMP_NUM_THREADS": "1"}), ("2 threads", {"OMP_NUM_THREADS": "2"}),
            ("1 thread, default ISA", {"OMP_NUM_THREADS": "1", "ATEN_CPU_CAPABILITY": "default"}),
            ("2 threads, default ISA", {"OMP_NUM_THREADS": "2", "ATEN_CPU_CAPABILITY": "default"})]
NEAR = 0.5  # a figure at half its bound or more


def run_setting(name: str, env_extra: dict, tests: list[str], figures: list[str], out: Path) -> list[str]:
    """Runs the selection under one setting, appending records to `out`; returns what failed."""
    env = dict(os.environ, DORAFP8_MARGINS=str(out), **env_extra)
    failed = []
    cmds = [[sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests]] if tests else []
    cmds += [[sys.executable, "docs/figures/measured.py", f] for f in figures]
    for cmd in cmds:
        print(f"[{name}] {' '.join(cmd[1:])}", flush=True)
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
        if proc.returncode:
            tail = (proc.stdout + proc.stderr)[-3000:]
            failed.append(f"[{name}] {' '.join(cmd[1:])}: exit {proc.returncode}\n{tail}")
    return failed


def table(records: list[dict], settings: list[str], top: int) -> tuple[str, int]:
    """One line per check (its line in the tests), its worst ratio over the settings; and how many are near."""
    worst: dict[str, dict] = {}
    for r in records:
        w = worst.setdefault(r["where"], {"what": r["what"], "bound": r["bound"], "rel": r["rel"], "by": {}})
        w["by"][r["setting"]] = max(w["by"].get(r["setting"], 0.0), r["ratio"])
    rows = sorted(worst.items(), key=lambda kv: -max(kv[1]["by"].values()))
    lines = [f"{'check (where: what)':58} {'bound':>8} " + " ".join(f"{s[:12]:>12}" for s in settings)]
    for where, w in rows[:top]:
        bound = f"{w['rel']:.0e}*" if w["rel"] is not None else f"{w['bound']:.3g}"
        ratios = " ".join(f"{w['by'].get(s, float('nan')):>12.3f}" for s in settings)
        mark = "  <- within 2x" if max(w["by"].values()) >= NEAR else ""
        label = f"{where}: {w['what']}"
        lines.append(f"{label[:58]:58} {bound:>8} {ratios}{mark}")
    near = sum(max(w["by"].values()) >= NEAR for w in worst.values())
    lines.append(f"{len(worst)} checks, {len(records)} measurements; {near} at {NEAR} of their bound or more "
                 "(ratio = figure / bound; * = assert_close's elementwise bound, the ratio its worst element's share)")
    return "\n".join(lines), near


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("pytest_args", nargs="*", help=f"what pytest runs (default: {' '.join(DEFAULT_TESTS)})")
    p.add_argument("--figure", action="append", help=f"a docs/figures/measured.py figure (default: {DEFAULT_FIGURES})")
    p.add_argument("--setting", type=int, action="append", choices=range(len(SETTINGS)),
                   help="run only these settings (0-3: " + "; ".join(s for s, _ in SETTINGS) + "); default: all")
    p.add_argument("--top", type=int, default=30, help="lines of the table")
    args = p.parse_args(argv)
    tests = args.pytest_args or DEFAULT_TESTS
    figures = args.figure if args.figure is not None else ([] if args.pytest_args else DEFAULT_FIGURES)
    settings = [SETTINGS[i] for i in args.setting] if args.setting else SETTINGS
    records, failed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in settings:
            out = Path(tmp) / "margins.jsonl"
            out.write_text("")
            failed += run_setting(name, extra, tests, figures, out)
            records += [dict(json.loads(line), setting=name) for line in out.read_text().splitlines() if line]
    text, near = table(records, [s for s, _ in settings], args.top)
    print(text)
    for f in failed:
        print("FAILED", f, sep="\n")
    return 1 if near or failed else 0


if __name__ == "__main__":
    sys.exit(main())
