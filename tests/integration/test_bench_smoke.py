"""bench/run.py --smoke: the benchmark harness runs end to end on a CPU and writes sane results.

Times from this run mean nothing (tiny shapes, shared CPU, Triton interpreter); what is checked is that every
requested provider and mode produced a record, that measured records have positive finite times and consistent
FLOP counts, that providers which cannot run are skipped with a reason, that plot.py redraws the outputs, that the
roofline floors equal max(FLOP / peak, bytes / bandwidth) recomputed here from the peaks bench/README.md states, and
that the W8A8 yardstick (linear-fp8-rowwise, torch._scaled_mm) computes what it claims.
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

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench")
sys.path.insert(0, BENCH)

import _cases as C  # noqa: E402

HAS_MPL = importlib.util.find_spec("matplotlib") is not None
# Providers whose kernels run under the Triton interpreter on CPU: their model step is skipped there (with a reason).
INTERPRETED = ("dorafp8-triton", "dorafp8-cublas", "dorafp8-triton-w8a8", "dorafp8-lora-triton",
               "dorafp8-lora-triton-w8a8")
# The datasheet peaks as bench/README.md states them (TFLOP/s dense; GB/s): typed in here independently of
# bench/_cases.py, so that a change of one without the other fails.
README_PEAKS = {
    "h100-sxm": dict(bf16=989.4, fp16=989.4, fp8=1978.9, fp32=66.9, gbps=3350.0),
    "h200": dict(bf16=989.4, fp16=989.4, fp8=1978.9, fp32=66.9, gbps=4800.0),
    "rtx4090": dict(bf16=165.2, fp16=165.2, fp8=330.3, fp32=82.6, gbps=1008.0),
}


def _scaled_mm_runs_on_cpu() -> bool:
    """Whether this torch runs torch._scaled_mm with row-wise scales on CPU (torch 2.15 does)."""
    import torch

    if not hasattr(torch, "_scaled_mm"):
        return False
    a = torch.ones(16, 32).to(torch.float8_e4m3fn)
    b = torch.ones(16, 32).to(torch.float8_e4m3fn).t()
    try:
        torch._scaled_mm(a, b, scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except Exception:
        return False
    return True


def _run(args, timeout):
    env = dict(os.environ)
    env.pop("DORAFP8_BACKEND", None)  # each provider names its backend; an env override would relabel them
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
    assert "## Roofline" in md and "x roofline" in md
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

    assert meta["roofline_device"] is None  # a CPU: floors only, no measured / floor ratio
    for r in records:
        for k in ("device", "torch", "triton", "commit", "date"):
            assert r[k] == meta[k]
        # The roofline floors are written for every layer case, measured or not; never a ratio on a CPU.
        assert r["x_roofline"] is None, r
        assert set(r["roofline_ms"]) == set(C.PEAKS), r
        if r["mode"] != "step":
            for dev in C.PEAKS:
                assert r["roofline_ms"][dev] > 0 and r["roofline_bound"][dev] in ("tensor", "fp32", "memory"), r
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
        if not (prov.startswith("dorafp8-") and C.has_norm(prov)):
            expected -= set(C.CACHED_MODES)  # only dorafp8's DoRA takes a precomputed weight norm
        if not C.has_norm(prov):
            expected -= {"norm"}  # the floors and plain LoRA have none
        assert modes == expected, (prov, modes)
        if prov not in C.FLOOR_PROVIDERS:
            assert {r["dropout"] for r in mine if r["mode"] == "fwd"} == {0.0, 0.05}
        else:
            assert {r["dropout"] for r in mine} == {0.0}  # no dropout in a plain linear
    # What must run on any CPU: PEFT, the bf16 floor, the reference backend; the W8A8 floor wherever this torch
    # runs torch._scaled_mm on CPU (torch 2.15 does), else skipped with the reason.
    must = ["peft-dora", "peft-dora-lowp", "peft-dora-fp8-dequant", "linear-bf16", "dorafp8-reference", "peft-lora",
            "linear-fp8-dequant", "dorafp8-lora-reference"]
    if _scaled_mm_runs_on_cpu():
        must.append("linear-fp8-rowwise")
    else:
        assert all(r["status"] == "skipped" and "_scaled_mm" in r["note"]
                   for r in records if r["provider"] == "linear-fp8-rowwise")
    for prov in must:
        assert all(r["status"] == "ok" for r in records if r["provider"] == prov), prov
    assert all(r["status"] == "skipped" for r in records if r["provider"] == "dorafp8-cuda")
    # Triton, the cuBLAS strategy and W8A8 run their layer cases under the interpreter; only their model step is
    # skipped (tens of seconds per step there), and says so.
    for prov in INTERPRETED:
        for r in records:
            if r["provider"] != prov:
                continue
            if r["mode"] == "step":
                assert r["status"] == "skipped" and "interpreter" in r["note"], r
            else:
                assert r["status"] == "ok" and "TRITON_INTERPRET" in r["note"], r
    # The W8A8 records say so: fp8 weights, and the fp8 rate in the floor of their large cases.
    w8a8 = [r for r in records if r["provider"] == "dorafp8-triton-w8a8" and r["mode"] == "fwd"]
    assert w8a8 and all("rowwise" in r["note"] and r["weight_dtype"] == "fp8" for r in w8a8)


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


def test_roofline_from_the_stated_peaks():
    """Each floor is max(FLOP / peak, bytes / bandwidth), recomputed here from the numbers bench/README.md states,
    with the rate the provider's arithmetic runs at: bf16 tensor cores (W8A16 and PEFT), fp8 tensor cores (W8A8),
    the fp32 non-tensor rate for fp32 adapters' norm and rank-r work."""
    readme = open(os.path.join(BENCH, "README.md")).read()
    for dev, peaks in README_PEAKS.items():
        assert C.PEAKS[dev] == {"name": C.PEAKS[dev]["name"], **peaks}, dev
        for v in peaks.values():
            assert f"{v:g}" in readme, f"bench/README.md does not state {v:g} ({dev})"

    M, K, N, r = 8192, 4096, 4096, 16
    h100, h200, ada = README_PEAKS["h100-sxm"], README_PEAKS["h200"], README_PEAKS["rtx4090"]

    def floor(case, dev):
        ms, bound = C.roofline(case, dev)
        return ms * 1e-3, bound

    # The bf16 floor, forward + input gradient at M = 8192: 4 M N K FLOP against 2 x (W + x + y) bf16 bytes.
    lin = C.Case("linear-bf16", "fwd+bwd", K, N, M, r, "bf16", 0.0)
    flop, nbytes = 4 * M * N * K, 2 * (N * K * 2 + M * K * 2 + M * N * 2)
    want = max(flop / (h100["bf16"] * 1e12), nbytes / (h100["gbps"] * 1e9))
    assert floor(lin, "h100-sxm") == (pytest.approx(want, rel=1e-12), "tensor")
    assert want == pytest.approx(0.5557e-3, rel=1e-3)  # 549.8 GFLOP at 989.4 TFLOP/s
    # The W8A8 floor, forward only, a short batch: the fp8 weight read dominates (memory-bound everywhere).
    lin8 = C.Case("linear-fp8-rowwise", "fwd", K, N, 16, r, "bf16", 0.0)
    flop, nbytes = 2 * 16 * N * K, N * K + 16 * K * 2 + 16 * N * 2
    for dev, pk in README_PEAKS.items():
        want = max(flop / (pk["fp8"] * 1e12), nbytes / (pk["gbps"] * 1e9))
        assert floor(lin8, dev) == (pytest.approx(want, rel=1e-12), "memory"), dev
    # dorafp8's W8A8 forward at M = 8192 runs its base GEMM at the fp8 rate: half the bf16 floor on an H100.
    d8 = C.Case("dorafp8-triton", "fwd", K, N, M, r, "bf16", 0.0)
    d8q = C.Case("dorafp8-triton-w8a8", "fwd", K, N, M, r, "bf16", 0.0)
    assert floor(d8, "h100-sxm") == (pytest.approx(2 * M * N * K / (h100["bf16"] * 1e12)), "tensor")
    assert floor(d8q, "h100-sxm") == (pytest.approx(2 * M * N * K / (h100["fp8"] * 1e12)), "tensor")
    # The weight norm with PEFT's fp32 adapters: B A at the fp32 non-tensor rate outlasts reading the fp8 weight
    # (2 N K r + 2 N K FLOP), on an H200 too; with bf16 adapters (peft-dora-lowp) the bf16 weight read sets it.
    norm = C.Case("dorafp8-triton", "norm", K, N, None, r, "bf16", 0.0)
    flop = 2 * N * K * r + 2 * N * K
    nbytes = N * K + (r * K + N * r + N) * 4 + 4 * N
    for dev, pk in (("h100-sxm", h100), ("h200", h200)):
        want = max(flop / (pk["fp32"] * 1e12), nbytes / (pk["gbps"] * 1e9))
        assert floor(norm, dev) == (pytest.approx(want, rel=1e-12), "fp32"), dev
    lowp = C.Case("peft-dora-lowp", "norm", K, N, None, r, "bf16", 0.0)
    nbytes = N * K * 2 + (r * K + N * r + N) * 2 + 4 * N
    assert floor(lowp, "rtx4090") == (pytest.approx(max(flop / (ada["bf16"] * 1e12),
                                                         nbytes / (ada["gbps"] * 1e9)), rel=1e-12), "memory")
    # Tensor-core work at two rates on one unit adds up: W8A8 base at fp8 + bf16 adapters' rank work at bf16.
    # (No provider pairs those today; the fp32 adapters' work runs on the fp32 pipes, a separate unit.)
    full = C.Case("dorafp8-triton", "fwd+bwd", K, N, M, r, "bf16", 0.05)
    base, other, nbytes = C.work_split(full)
    assert base == 2 * 2 * (2 * M * N * K)  # forward and dgrad, each twice with dropout
    assert (base + other, nbytes) == C.work(full)
    want = max(base / (h100["bf16"] * 1e12), other / (h100["fp32"] * 1e12), nbytes / (h100["gbps"] * 1e9))
    assert floor(full, "h100-sxm")[0] == pytest.approx(want, rel=1e-12)


def test_roofline_device_names():
    assert C.peak_key("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert C.peak_key("NVIDIA H200") == "h200"
    assert C.peak_key("NVIDIA GeForce RTX 4090") == "rtx4090"
    for other in ("NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA A100-SXM4-80GB", "NVIDIA GeForce RTX 4090 D"):
        assert C.peak_key(other) is None, other


def test_headline_preset():
    """The GPU issue's grid: 2 shapes x M {256, 8192} x r 16 x bf16 x p {0, 0.05}, four modes, eight providers."""
    h = C.PRESETS["headline"]
    cases = C.layer_cases(C.parse_shapes(h["shapes"]), C.parse_list(h["tokens"], int), C.parse_list(h["ranks"], int),
                          C.parse_list(h["dtypes"]), C.parse_list(h["dropouts"], float), C.parse_list(h["providers"]),
                          C.parse_list(h["modes"]))
    assert {c.shape for c in cases} == {"4096x4096", "4096x14336"}
    assert {c.tokens for c in cases} == {None, 256, 8192}
    assert {c.mode for c in cases} == {"norm", "fwd", "fwd+bwd", "fwd+bwd-cachednorm"}
    assert {c.provider for c in cases} == {"dorafp8-triton", "dorafp8-cuda", "dorafp8-cublas", "dorafp8-triton-w8a8",
                                           "peft-dora", "peft-dora-fp8-dequant", "linear-bf16", "linear-fp8-rowwise"}
    # per shape: 4 dorafp8 x (norm + 2 dropouts x 2 M x 3 modes) + 2 PEFT x (norm + 2 x 2 x 2) + 2 floors x 2 M x 2
    assert len(cases) == 2 * (4 * 13 + 2 * 9 + 2 * 4) == 156


def test_linear_fp8_rowwise_matches_its_definition():
    """linear-fp8-rowwise: y = e4m3(x) W0^T and dx = e4m3(g * sigma) W8 per token, via torch._scaled_mm. Its forward
    is dorafp8's W8A8 recipe bit for bit; its dgrad quantizes g * sigma from fp32 where dorafp8 rounds g * sigma / max
    sigma to the compute dtype first, so they differ in the odd e4m3 rounding (~1% of the norm)."""
    if not _scaled_mm_runs_on_cpu():
        pytest.skip("this torch does not run torch._scaled_mm row-wise on CPU")
    import torch

    import _providers as P

    dorafp8 = pytest.importorskip("dorafp8")
    torch.manual_seed(0)
    M, K, N = 48, 64, 96
    lin = P.build_layer("linear-fp8-rowwise", K, N, 8, "bf16", 0.0, torch.device("cpu")).forward
    w8, sigma = lin.w8, lin.sw_row.reshape(-1)
    assert w8.dtype == torch.float8_e4m3fn and sigma.shape == (N,)
    x = torch.randn(M, K, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(M, N, dtype=torch.bfloat16)
    y = lin(x)
    y.backward(g)
    assert y.dtype == x.grad.dtype == torch.bfloat16

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    W0 = w8.double() * sigma.double()[:, None]
    assert rel(y, x.detach().double() @ W0.T) < 5e-2  # e4m3 activations: ~2.5% per operand
    assert rel(x.grad, g.double() @ W0) < 5e-2
    x2 = x.detach().clone().requires_grad_()
    y2 = dorafp8.fp8_linear(x2, w8, sigma, act_quant="rowwise", backend="reference")
    y2.backward(g)
    assert torch.equal(y, y2)
    assert rel(x.grad, x2.grad) < 3e-2


def test_linear_fp8_rowwise_on_sm120_needs_no_rowwise_scaled_mm(monkeypatch):
    """sm_12x GPUs' cuBLAS refuses torch._scaled_mm with row-wise scales (pytorch issue 192707): there the provider runs
    _scaled_mm with unit per-tensor scales and applies the row scales to its fp32 product. The choice is made from the
    device's capability (faked here), and that path never hands _scaled_mm a row-wise scale (a stand-in that refuses
    them, as cuBLAS does there, checks it) while computing what the row-wise path computes."""
    if not _scaled_mm_runs_on_cpu():
        pytest.skip("this torch does not run torch._scaled_mm row-wise on CPU")
    import torch

    import _providers as P

    cuda = torch.device("cuda", 0)
    for cap, rowwise in (((12, 0), False), ((12, 1), False), ((9, 0), True), ((8, 9), True), ((10, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cap=cap: cap)
        assert P.rowwise_scales_supported(cuda) is rowwise, cap
    assert P.rowwise_scales_supported(torch.device("cpu"))

    torch.manual_seed(0)
    M, K, N = 48, 64, 96
    w = torch.randn(N, K) / 8
    x = torch.randn(M, K, dtype=torch.bfloat16)
    g = torch.randn(M, N, dtype=torch.bfloat16)
    results = {}
    real = torch._scaled_mm
    for rowwise in (True, False):
        if not rowwise:
            def per_tensor_only(a, b, scale_a, scale_b, **kw):
                if scale_a.numel() != 1 or scale_b.numel() != 1:
                    raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED (row-wise scales refused, as on sm_120)")
                return real(a, b, scale_a=scale_a, scale_b=scale_b, **kw)
            monkeypatch.setattr(torch, "_scaled_mm", per_tensor_only)
        lin = P.Fp8RowwiseLinear(w, rowwise=rowwise)
        xr = x.clone().requires_grad_()
        y = lin(xr)
        y.backward(g)
        results[rowwise] = (y, xr.grad)
    for a, b in zip(results[True], results[False]):
        assert a.dtype == b.dtype == torch.bfloat16
        # one rounding to bf16 of the same fp32 sums (only the order of the scale multiplications differs)
        assert torch.allclose(a.float(), b.float(), rtol=2 ** -7, atol=1e-6), (a - b).abs().max()


def test_cpu_step_bench_runs():
    """bench/cpu_step.py (dorafp8's CPU training step against PEFT's DoRA) on a small layer: both steps are timed and
    the ratio printed for each dtype (the times are not checked: a shared CPU)."""
    out = _run([os.path.join("bench", "cpu_step.py"), "--size", "256", "--tokens", "8", "--steps", "1"],
               timeout=300).stdout
    lines = [line for line in out.splitlines() if "dorafp8 / PEFT" in line]
    assert [line.split()[0] for line in lines] == ["fp32", "bf16"], out
    assert "backend on cpu: native" in out, out


def _graph_case(provider):
    import torch

    import _graph as G
    import _providers as P

    layer = P.build_layer(provider, 32, 48, 4, "bf16", 0.0, torch.device("cpu"))
    forward = layer.forward_cached if C.first_mode(provider).endswith("cachednorm") else layer.forward
    x, dy = torch.randn(8, 32, dtype=torch.bfloat16), torch.randn(8, 48, dtype=torch.bfloat16)
    return G, layer, forward, x, dy


@pytest.mark.parametrize("provider", ["dorafp8-reference", "linear-bf16"])
def test_graphed_step_checks_then_times(provider):
    """bench/_graph.py with its CPU stand-in graph: the step is captured, the replay checked against an eager call on
    new inputs, then timed; the replay's outputs are the eager step's on those inputs."""
    G, layer, forward, x, dy = _graph_case(provider)
    replay, capture_s = G.captured(forward, layer.params, x, dy, graph=G.EagerGraph(), warmup=1)
    times = G.time_replays(replay, 2, x.device)
    assert capture_s > 0 and times["replay_us"] >= times["replay_enqueue_us"] > 0


@pytest.mark.parametrize("provider", ["dorafp8-reference", "linear-bf16"])
def test_a_stale_graph_is_refused_naming_what_differs(provider):
    """A graph whose replay changes nothing (its inputs baked in at capture) fails the check before any timing, the
    message naming y, dx and each parameter's gradient."""
    G, layer, forward, x, dy = _graph_case(provider)
    with pytest.raises(G.GraphMismatch) as e:
        G.captured(forward, layer.params, x, dy, graph=G.EagerGraph(stale=True), warmup=1)
    names = ["y", "dx"] + [f"grad of parameter {i}" for i in range(len(layer.params))]
    assert all(f"{n}" in str(e.value) for n in names) and "not timed" in str(e.value), e.value
    assert len(layer.params) == (3 if provider.startswith("dorafp8") else 0)


def test_the_cuda_graph_lines_run_against_torch_cuda_names(monkeypatch):
    """The CUDA-only class (CudaGraph) on a CPU with torch.cuda's graph and stream calls replaced by recorders: every
    line runs (a misspelt name fails here, not on the GPU's first command); its replay, a no-op here, fails the check."""
    import contextlib

    import torch

    G, layer, forward, x, dy = _graph_case("linear-bf16")
    calls = []

    class Stream:
        def wait_stream(self, other):
            calls.append("wait")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: type("Graph", (), {"replay": lambda s: calls.append("replay")})())
    monkeypatch.setattr(torch.cuda, "graph", lambda g: calls.append("capture") or contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    with pytest.raises(G.GraphMismatch, match="y: max"):
        G.captured(forward, layer.params, x, dy, warmup=1)
    assert calls == ["wait", "wait", "capture", "replay"], calls
