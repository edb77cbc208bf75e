"""The cuBLAS strategy (dorafp8/cublas_backend.py): dequantize one layer to a transient, platform matmul, fused
Triton epilogues. Checked with the same fp64 / reference checks as every backend (tests/kernels/_kernel_ref.py); on CPU
the matmuls are CPU ones and the epilogues run in Triton's interpreter."""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.kernels._kernel_ref import (check_dgrad, check_forward, make_problem,  # noqa: E402
                                      shape_id)

from dorafp8 import backends  # noqa: E402
from dorafp8.backends import base  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
if backends.unavailable_reason("cublas", torch.device(DEVICE)) is not None:
    pytest.skip(backends.unavailable_reason("cublas", torch.device(DEVICE)), allow_module_level=True)
cb = backends.module("cublas")

SHAPES = [(1, 50, 70, 1, False), (37, 50, 70, 3, True), (20, 33, 17, 20, True)]
if HAS_CUDA:
    SHAPES += [(300, 1000, 700, 72, True), (4, 4096, 1024, 8, False)]


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(base, "POISON_OUTPUTS", True)


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", ["nodrop", "dropout", "plain"])
@pytest.mark.parametrize("scale", ["tensor", "row", "block"])
def test_forward_and_dgrad(shape, dtype, mode, scale):
    M, K, N, r, strided = shape
    p = make_problem(M, K, N, r, dtype, DEVICE, scale, strided)
    check_forward(cb.forward, p, mode, has_bias=mode != "plain")
    check_dgrad(cb.dgrad, p, mode)


def test_refuses_w8a8():
    p = make_problem(3, 32, 16, 2, torch.float32, DEVICE, "tensor", False)
    with pytest.raises(ValueError, match="not supported by the cublas backend"):
        check_forward(cb.forward, p, "nodrop", has_bias=False, act_quant="rowwise")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mode", ["nodrop", "dropout"])
def test_fp32_adapters_on_16bit(dtype, mode):
    """PEFT's fp32 adapters on a 16-bit model: the epilogues' rank-r term is split_dot's three bf16 products (the
    outputs are 16-bit; an fp32 z would keep exact fp32 products, but cuBLAS's base product is already rounded to the
    compute dtype, so it cannot meet fp32's tolerance here); r = 20 crosses a rank chunk. Against fp64."""
    p = make_problem(37, 50, 70, 20, dtype, DEVICE, "row" if dtype == torch.bfloat16 else "tensor", True,
                     rank_dtype=torch.float32)
    p["z_dtype"] = dtype
    check_forward(cb.forward, p, mode, has_bias=True)
    check_dgrad(cb.dgrad, p, mode)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_epilogues_take_the_rank_term_on_tensor_cores(dropout, monkeypatch):
    """Issue 52: with bf16 activations and fp32 adapters (the H200 headline) the two epilogues multiplied u B^T and v A
    as fp32 FMAs on CUDA cores (128-165 FFMA a thread on 16 x 64 tiles); a dry run planning for a GPU now launches them
    with the three-piece bf16 split on tensor cores and the larger tiles that allows."""
    import dorafp8
    import dorafp8.triton_kernels as tk
    from dorafp8._launches import LaunchRecorder, dry_run

    seen = {}

    def observe(kernel, grid, args, kwargs):
        seen[getattr(kernel, "__name__", None) or kernel.fn.__name__] = dict(kwargs)
        return False

    M, N, K, r = 256, 128, 192, 16
    w8 = torch.empty(N, K, dtype=torch.float8_e4m3fn, device=DEVICE)
    leaves = [torch.empty(M, K, dtype=torch.bfloat16), torch.empty(r, K), torch.empty(N, r), torch.ones(N)]
    x, A, B, m = (t.to(DEVICE).requires_grad_() for t in leaves)
    gy = torch.empty(M, N, dtype=torch.bfloat16, device=DEVICE)
    monkeypatch.setattr(base, "POISON_OUTPUTS", False)
    tk.launch_observers().append(observe)
    try:
        with LaunchRecorder() as rec, dry_run(rec, 132, 2):
            dorafp8.dora_fp8_linear(x, w8, torch.ones((), device=DEVICE), A, B, m, 2.0, backend="cublas",
                                    weight_norm=torch.ones(N, device=DEVICE), dropout_p=dropout,
                                    training=True).backward(gy)
    finally:
        tk.launch_observers().remove(observe)
    for name, tile in (("fwd_epilogue_kernel", "BLOCK_N"), ("dgrad_epilogue_kernel", "BLOCK_K")):
        kw = seen[name]
        assert kw["LORA_SPLIT"] and not kw["LORA_IEEE"], f"{name}: {kw}"
        assert kw["BLOCK_M"] * kw[tile] > 16 * 64, f"{name}: {kw}"


# The bytes the speed predictions rest on (dorafp8/kernel_report/predict.py, from dorafp8/_launches.py's recorder): a
# dry run of one forward + backward (no Triton kernel runs, nor a matmul; the launchers plan for an H100; on DEVICE, a
# GPU's tensors where there is one), each launch's bytes checked
# against the sizes of the tensors it was handed, and the strategy's launches against the plan of the module
# docstring, so that neither can drift without this failing.
# At this shape (M >= 2 N K / (N + K)) the forward's W is kept for the dgrad (ops/_policy.py keeps_weight): one
# dequantize a step.
PLAN = ["triton:dequant_w8_kernel", "triton:project_kernel", "aten:mm.default", "triton:fwd_epilogue_kernel",
        "triton:dora_bwd_pass_kernel", "triton:dora_bwd_finish_kernel", "aten:mm.default",
        "triton:dgrad_epilogue_kernel", "triton:project_grad_kernel", "triton:sum_splits_kernel"]


@pytest.mark.parametrize("kind", ["tensor", "row"])
def test_dry_run_bytes_are_the_tensors_sizes(kind, monkeypatch):
    import dorafp8
    from dorafp8._launches import LaunchRecorder, dry_run

    M, N, K, r = 1024, 512, 768, 16
    w8 = torch.empty(N, K, dtype=torch.float8_e4m3fn, device=DEVICE)
    scale = torch.ones((), device=DEVICE) if kind == "tensor" else torch.ones(N, device=DEVICE)
    leaves = [torch.empty(M, K, dtype=torch.bfloat16), torch.empty(r, K), torch.empty(N, r), torch.ones(N)]
    x, A, B, m = (t.to(DEVICE).requires_grad_() for t in leaves)
    n, gy = torch.ones(N, device=DEVICE), torch.empty(M, N, dtype=torch.bfloat16, device=DEVICE)
    monkeypatch.setattr(base, "POISON_OUTPUTS", False)  # a GPU run's launches: no NaN fills
    with LaunchRecorder() as rec, dry_run(rec, 132, 2):
        dorafp8.dora_fp8_linear(x, w8, scale, A, B, m, 2.0, backend="cublas", weight_norm=n).backward(gy)
    assert rec.names() == PLAN, rec.table()
    for launch in rec.launches:
        sizes = sum(math.prod(shape) * torch.tensor([], dtype=dt).element_size() for shape, dt in launch.shapes)
        assert launch.nbytes == sizes, f"{launch.name}: {launch.nbytes} bytes recorded, its tensors hold {sizes}"
    # by hand, from the shapes: the dequantize reads W8 (1 byte a weight) and the scale and writes W (2 bytes) and its
    # factors (2 floats, or N + 1 per row); each matrix product reads its operands and writes its result once
    dequant = N * K * 3 + (4 + 8 if kind == "tensor" else 4 * N + 4 * (N + 1))
    assert [lc.nbytes for lc in rec.launches if lc.name == "triton:dequant_w8_kernel"] == [dequant]
    assert [lc.nbytes for lc in rec.launches if lc.name == "aten:mm.default"] == [
        2 * (M * K + N * K + M * N), 2 * (M * N + N * K + M * K)]


# The forward's dequantized weight kept for the dgrad (backends/base.py KEEP_WEIGHT_PARAMS, ops/_policy.py
# keeps_weight): the same W, so the same results; what could go wrong is the plumbing (the autograd Function saving
# and passing it, the factors that ride with it). End to end against fp64, on every weight kind, dtype and dropout
# setting, with the rule forced on at a small shape (on its own it keeps W from M >= 2 N K / (N + K) tokens).
KEEP_KINDS = ["tensor", "row", "block", "nvfp4", "mxfp8"]


@pytest.mark.parametrize("kind", KEEP_KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_kept_weight_matches_fp64(kind, dtype, dropout, monkeypatch):
    from dorafp8._launches import LaunchRecorder
    from dorafp8.ops import linear
    from tests.kernels.test_microscaled import check_dora_end_to_end, make_weight

    if kind == "row" and dtype == torch.float16:  # refused: tests/ops/test_backend_contract.py, far_apart
        pytest.skip("the cuBLAS strategy does not take fp16 with per-row scales")
    monkeypatch.setattr(linear, "keeps_weight", lambda M, N, K: True)
    with LaunchRecorder() as rec:  # (the norm by the reference: cuBLAS's dequantizes a microscaled weight's rows)
        check_dora_end_to_end(*make_weight(kind, 40, 64, seed=3), dtype, dropout, "cublas", M=9, r=3, weight_norm=True,
                              device=DEVICE, block_size=16)
    dequants = [n for n in rec.names() if n.startswith("triton:dequant")]
    assert len(dequants) == 1, rec.table()  # the forward's: the dgrad took its W


def test_weight_kept_only_where_the_rule_allows():
    """keeps_weight: W [N, K] is kept when it is at most half the size of x and z (which the layer keeps anyway)."""
    from dorafp8.ops._policy import keeps_weight

    assert keeps_weight(8192, 4096, 4096) and keeps_weight(4096, 4096, 4096)
    assert not keeps_weight(4095, 4096, 4096) and not keeps_weight(1024, 4096, 4096)
    assert keeps_weight(2 * 4096 * 11008 // (4096 + 11008) + 1, 11008, 4096)


@pytest.mark.parametrize("reentrant", [False, True])
def test_kept_weight_under_activation_checkpointing(reentrant, monkeypatch):
    """Under torch.utils.checkpoint the kept W is saved as x and z are: not held from the first forward (reentrant:
    it runs without grad; non-reentrant: its saved tensors are dropped), made again by the recomputation and used by
    that step's dgrad. The same gradients as without checkpointing, and the step's three dequantizes (forward,
    recomputation, none in the backward) instead of four."""
    import dorafp8
    from dorafp8._launches import LaunchRecorder
    from dorafp8.ops import linear
    from torch.utils.checkpoint import checkpoint

    monkeypatch.setattr(linear, "keeps_weight", lambda M, N, K: True)
    M, N, K, r = 9, 48, 48, 3  # two layers of the same weight: N = K
    gen = torch.Generator().manual_seed(0)
    w8, scale = dorafp8.quantize_e4m3(torch.randn(N, K, generator=gen) * 0.05, per_row=True)
    A, B = torch.randn(r, K, generator=gen) / 8, torch.randn(N, r, generator=gen) / 8
    m = torch.rand(N, generator=gen) + 0.5
    x = torch.randn(M, K, generator=gen)
    w8, scale, A, B, m, x = (t.to(DEVICE) for t in (w8, scale, A, B, m, x))
    n = dorafp8.weight_norm(w8, scale, A, B, 2.0, backend="reference")
    x.requires_grad_()

    def layer(t):
        return dorafp8.dora_fp8_linear(t, w8, scale, A, B, m, 2.0, backend="cublas", weight_norm=n)

    layer(layer(x)).square().sum().backward()
    want, x.grad = x.grad, None
    with LaunchRecorder() as rec:
        checkpoint(lambda t: layer(layer(t)), x, use_reentrant=reentrant).square().sum().backward()
    torch.testing.assert_close(x.grad, want, rtol=0, atol=0)
    assert sum(name.startswith("triton:dequant") for name in rec.names()) == 4, rec.table()  # 2 layers x 2 forwards


@pytest.mark.parametrize("scale", ["tensor", "block"])
def test_fp16_dgrad_of_a_large_weight_with_small_c_stays_finite(scale):
    """A weight whose largest value is near fp16's (6e4) and c = m / n of 0.002: dx = (g c) W0 + s v A lies inside
    fp16, but the product of the backward pass's gl = g c / max|c| with the dequantized W0 is dx / max|c| = 500 dx,
    which came back inf. The backend's backward_pass -> dgrad as the layer pairs them, against fp64."""
    from tests._tolerance import assert_close, tol
    from tests.kernels._kernel_ref import P, S, d, dx_64, large_weight_small_c

    p, m, c = large_weight_small_c(make_problem(37, 64, 70, 3, torch.float16, DEVICE, scale, True))
    for mode in ("nodrop", "dropout"):
        g = (d(p["g"]) * (2e4 / dx_64(p, mode, p["g"], c).abs().max().item())).half().to(DEVICE)
        ref = dx_64(p, mode, g, c)
        dropout = mode == "dropout"
        gl, rs, gb, v, *_ = cb.backward_pass(g, None, m, p["n"], None, p["B"], None, S, dropout, False, False)
        dx = cb.dgrad(gl, rs[0], p["w8"], p["sigma"], p["block"], v, p["A"], S, p["mask"] if dropout else None, P,
                      g if dropout else None, rs[1] if dropout else None, "")
        assert_close(dx, ref, tol(torch.float16), f"dgrad[{scale}, {mode}] vs fp64")


def test_fp16_dgrad_scales_gl_without_a_bias():
    """cublas's fp16 dgrad scales gl by a = min(rl, 1) and rl by 1 / a. gl * a (a fp32 0-dim, gl fp16) rounds a to
    fp16 first (read for a GPU) or the product a second time (CPU, measured) while rl / a used the exact a: the base
    term came back off by up to u, every element the same way, a bias within one element's tolerance that no sum
    averages out. Here max c = 0.5 + 2^-12 (less a little), u from a power of two, and a power-of-two weight scale,
    so that W0 in fp16 is exact (its rounding, PEFT's too, biases the sum by itself). The least-squares ratio
    of dx to fp64 over 64k outputs: 1 up to u / 16 (0.4 u off before)."""
    from tests._tolerance import assert_close, tol
    from tests.kernels._kernel_ref import S, d, dx_64

    p = make_problem(256, 256, 128, 4, torch.float16, DEVICE, "tensor", False)
    p["sigma"] = torch.full_like(p["sigma"], 2.0 ** -6)
    N = p["n"].shape[0]
    c = torch.linspace(0.1, 0.5 + 2.0 ** -12 * 0.98, N)
    m = (p["n"].cpu() * c).to(DEVICE)
    c = d(base.magnitude_scale(m, p["n"]))
    assert c.max().item() != torch.tensor(c.max().item()).half().item()  # rl is no fp16 value
    ref = dx_64(p, "nodrop", p["g"], c)
    gl, rs, *_, v = cb.backward_pass(p["g"], None, m, p["n"], None, p["B"], None, S, False, False, False)[:4]
    dx = d(cb.dgrad(gl, rs[0], p["w8"], p["sigma"], p["block"], v, p["A"], S, None, 0.0, None, None, ""))
    u = torch.finfo(torch.float16).eps / 2
    assert abs((dx * ref).sum() / (ref * ref).sum() - 1) <= u / 16
    assert_close(dx, ref, tol(torch.float16), "dgrad vs fp64")
