"""bench/run.py --smoke: the benchmark harness runs end to end on a CPU and writes sane results.

Times from this run mean nothing (tiny shapes, shared CPU, Triton interpreter); what is checked is that every
requested provider and mode produced a record, that measured records have positive finite times and consistent
FLOP counts, that providers which cannot run are skipped with a reason, and that plot.py redraws the outputs.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
sys.path.insert(0, BENCH)

import _cases as C  # noqa: E402

HAS_MPL = importlib.util.find_spec("matplotlib") is not None


def _run(args, timeout):
    env = dict(os.environ)
    env.pop("DORAFP8_BACKEND", None)  # each provider names its backend; an env override would relabel them
    env.pop("DORAFP8_POISON", None)  # conftest's NaN-filling of kernel outputs is for correctness tests only
    proc = subprocess.run([sys.executable] + args, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{args} failed:\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    _run([os.path.join("bench", "run.py"), "--smoke", "--out", str(out)], timeout=600)
    with open(out / "results.json") as f:
        return out, json.load(f)


def test_files_written(smoke):
    out, _ = smoke
    assert (out / "results.json").is_file()
    md = (out / "results.md").read_text()
    assert "NO SPEED CLAIMS" in md  # a CPU run must say so
    pngs = sorted(p.name for p in out.glob("*.png"))
    if HAS_MPL:
        assert "memory.png" in pngs and "norm.png" in pngs
        assert any(p.startswith("time_vs_tokens_") for p in pngs), pngs
    else:
        assert pngs == [] and "matplotlib is not installed" in md


def test_records_sane(smoke):
    _, res = smoke
    meta, records = res["meta"], res["records"]
    for k in ("device", "torch", "triton", "commit", "date", "timing", "copy_gbps"):
        assert meta.get(k), k
    assert meta["speed_claims"] is False
    bad = [f"{r['provider']} {r['mode']} {r['shape']} M={r['tokens']} p={r['dropout']}: {r['note']}"
           for r in records if r["status"] not in ("ok", "skipped")]
    assert not bad, "cases that errored:\n" + "\n".join(bad)

    for r in records:
        for k in ("device", "torch", "triton", "commit", "date"):
            assert r[k] == meta[k]
        if r["status"] == "skipped":
            assert r["note"].strip(), f"{r['provider']} skipped without a reason"
            continue
        assert r["ms"] > 0 and math.isfinite(r["ms"]), r
        if r["mode"] != "step":
            assert r["flops"] > 0 and r["bytes"] > 0 and r["tflops"] > 0 and r["gbps"] > 0, r
            assert r["weight_bytes"] > 0, r
        else:
            assert r["tokens_per_s"] > 0, r

    # Every requested provider appears, for every mode, at both dropout settings where they apply.
    providers = C.parse_list(C.SMOKE["providers"])
    for prov in providers:
        mine = [r for r in records if r["provider"] == prov]
        assert mine, f"{prov} missing from results"
        modes = {r["mode"] for r in mine}
        expected = set(C.MODES)
        if not prov.startswith("dorafp8-"):
            expected -= set(C.CACHED_MODES)  # only dorafp8 takes a precomputed weight norm
        if prov == "linear-bf16":
            expected -= {"norm"}
        assert modes == expected, (prov, modes)
        if prov != "linear-bf16":
            assert {r["dropout"] for r in mine if r["mode"] == "fwd"} == {0.0, 0.05}
    # What must run on any CPU: PEFT, the floor, the reference backend.
    for prov in ("peft-dora", "peft-dora-lowp", "peft-dora-fp8-dequant", "linear-bf16", "dorafp8-reference"):
        assert all(r["status"] == "ok" for r in records if r["provider"] == prov), prov
    assert all(r["status"] == "skipped" for r in records if r["provider"] == "dorafp8-cuda")


def test_plot_redraws(smoke, tmp_path):
    out, _ = smoke
    proc = _run([os.path.join("bench", "plot.py"), str(out / "results.json"), "--out", str(tmp_path)], timeout=300)
    assert (tmp_path / "results.md").read_text() == (out / "results.md").read_text()
    if HAS_MPL:
        assert (tmp_path / "memory.png").is_file()
    assert "results.md" in proc.stdout


def test_work_counts():
    """The FLOP/byte model of docs/DORA_MATH.md, 'Where the time goes'."""
    M, K, N, r = 64, 32, 48, 8
    norm = C.Case("dorafp8-triton", "norm", K, N, None, r, "bf16", 0.0)
    f, b = C.work(norm)
    assert f == 2 * N * K * r + 2 * N * K
    assert b == N * K + (r * K + N * r + N) * 4 + 4 * N  # fp8 weight, fp32 adapters, fp32 norm out
    fwd, fwd_b = C.work(C.Case("dorafp8-triton", "fwd", K, N, M, r, "bf16", 0.0))
    fwd_drop = C.work(C.Case("dorafp8-triton", "fwd", K, N, M, r, "bf16", 0.05))[0]
    assert fwd_drop - fwd == 2 * M * N * K  # dropout runs the base GEMM twice
    cached, cached_b = C.work(C.Case("dorafp8-triton", "fwd-cachednorm", K, N, M, r, "bf16", 0.0))
    assert (fwd - cached, fwd_b - cached_b) == (f, b)  # a cached norm saves exactly the norm's pass
    assert cached == 2 * M * N * K + 2 * M * r * (K + N)
    both = C.work(C.Case("peft-dora", "fwd+bwd", K, N, M, r, "bf16", 0.0))[0]
    bwd = C.work(C.Case("peft-dora", "bwd", K, N, M, r, "bf16", 0.0))[0]
    assert both == fwd + bwd
    lin = C.work(C.Case("linear-bf16", "fwd+bwd", K, N, M, r, "bf16", 0.0))
    assert lin == (4 * M * N * K, 2 * (N * K * 2 + M * K * 2 + M * N * 2))
    # The PEFT base weight is bf16: twice the fp8 bytes.
    assert C.work(C.Case("peft-dora", "norm", K, N, None, r, "bf16", 0.0))[1] - b == N * K
