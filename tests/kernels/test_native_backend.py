"""The native backend (dorafp8/native_backend.py: the reference with its base GEMMs in the compute dtype on the
platform's matmul; what backend="auto" runs on CPU). Checked with the same fp64 / reference checks and the same
tolerances as every other backend (tests/kernels/_kernel_ref.py, tests/_tolerance.py)."""

import collections
import itertools

import pytest
import torch

from tests._tolerance import assert_close, tol
from tests.kernels._kernel_ref import (P, S, _forward_args, act, check_backward_pass, check_dgrad, check_forward,
                                       check_project, check_weight_norm, d, dx_64, large_weight_small_c, make_problem,
                                       shape_id, w0_64)

from dorafp8 import backends
from dorafp8.backends import reference

nb = backends.module("native")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SHAPES = [(1, 50, 70, 1, False), (37, 50, 70, 3, True), (20, 33, 17, 20, True)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", ["nodrop", "dropout", "plain"])
@pytest.mark.parametrize("scale", ["tensor", "row", "block"])
def test_forward_backward_pass_dgrad(device, shape, dtype, mode, scale, monkeypatch):
    monkeypatch.setattr(nb, "FP16_REFERENCE_DEVICES", frozenset())  # fp16: native's own code on CPU too
    M, K, N, r, strided = shape
    p = make_problem(M, K, N, r, dtype, device, scale, strided)
    check_forward(nb.forward, p, mode, has_bias=mode != "plain")
    check_forward(nb.forward, p, mode, has_bias=mode == "plain")
    check_backward_pass(nb.backward_pass, p, mode)
    check_backward_pass(nb.backward_pass, p, mode, need_db=False)  # a layer without a bias: db None, the rest same
    check_backward_pass(reference.backward_pass, p, mode, need_db=False)
    check_dgrad(nb.dgrad, p, mode)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_weight_norm_project_w8a8(dtype):
    p = make_problem(19, 40, 24, 4, dtype, "cpu", "row", False)
    check_weight_norm(nb.weight_norm, p)
    check_project(nb.project, nb.project_grad, p)
    check_forward(nb.forward, p, "nodrop", has_bias=True, act_quant="rowwise")
    check_dgrad(nb.dgrad, p, "dropout", act_quant="rowwise")


def test_weights_spanning_several_blocks(monkeypatch):
    """Weights larger than one row block (the transient is made block by block, dgrad sums the blocks in fp32)."""
    import dorafp8.quant as quant

    monkeypatch.setattr(quant, "_BLOCK_BYTES", 4 * 40 * 7)  # 7 rows of K = 40 per block
    _fp16_native_on_cpu(monkeypatch)
    for scale, dtype in itertools.product(("tensor", "row", "block"), (torch.bfloat16, torch.float16)):
        p = make_problem(23, 40, 50, 3, dtype, "cpu", scale, True)
        for mode in ("nodrop", "dropout", "plain"):
            check_forward(nb.forward, p, mode, has_bias=True)
            check_dgrad(nb.dgrad, p, mode)
            check_backward_pass(nb.backward_pass, p, mode)
            check_backward_pass(nb.backward_pass, p, mode, need_db=False)


class _ReferenceProductsRefused:
    """native.py's `reference` with its base-product functions refused: native computes the call itself."""

    def __getattr__(self, name):
        if name in ("forward", "dgrad"):
            raise AssertionError(f"native ran the reference's {name}")
        return getattr(reference, name)


F16_MAX = torch.finfo(torch.float16).max


def _fp16_native_on_cpu(monkeypatch):
    """native's own fp16 code on CPU (what a GPU runs; on CPU fp16 runs the reference's fp32 GEMMs, faster there)."""
    monkeypatch.setattr(nb, "FP16_REFERENCE_DEVICES", frozenset())
    monkeypatch.setattr(nb, "reference", _ReferenceProductsRefused())


def test_fp16_runs_native_on_a_gpu_and_the_reference_on_cpu():
    """Which code an fp16 call runs, by its tensors' device (read from them alone: a stand-in with a dtype and a
    device): a GPU's fp16 matmul (a T4's, a V100's), but on CPU the reference's fp32 GEMMs; bf16 runs native on both,
    W8A8 the reference."""
    from types import SimpleNamespace

    for device, reference_runs in (("cpu", True), ("cuda", False)):
        t = SimpleNamespace(dtype=torch.float16, device=torch.device(device))
        assert nb._reference_runs(t, "") is reference_runs and nb._reference_runs(t, "rowwise") is True
        assert nb._reference_runs(SimpleNamespace(dtype=torch.bfloat16, device=torch.device(device)), "") is False


@pytest.mark.parametrize("scale", ["tensor", "row", "block"])
def test_fp16_runs_native_where_the_unscaled_product_overflows(scale, monkeypatch):
    """fp16 (what a T4 or V100 trains in: no bf16 tensor cores there) ran the fp32 reference, because an fp16 product
    with the unscaled W8 (|W8| up to 448) overflows where x W0^T does not. Native now folds the scale into its fp16
    weight as PEFT's dequantized weight holds it: activations and gradients here make x W8^T and gl W8 overflow fp16
    (checked), and every output must still be within fp16's tolerance of fp64, finite."""
    _fp16_native_on_cpu(monkeypatch)
    p = make_problem(37, 64, 70, 3, torch.float16, "cpu", scale, True, act_scale=200.0)
    if scale != "block":  # the old fp16 product (block scales were always folded in)
        assert (d(p["x"]) @ d(p["w8"]).T).abs().max() > F16_MAX
        assert (d(p["g"]) @ d(p["w8"])).abs().max() > F16_MAX
    for mode in ("plain", "nodrop", "dropout"):
        for has_bias in (False, True):
            check_forward(nb.forward, p, mode, has_bias)
        check_dgrad(nb.dgrad, p, mode)
        if mode != "plain":  # need_z=False: the same y, no z
            args = list(_forward_args(p, mode, True))
            y, _ = nb.forward(*args, "")
            args[12] = False
            y2, z2 = nb.forward(*args, "")
            assert z2 is None and torch.equal(y, y2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scale", ["tensor", "row", "block"])
def test_gpu_path_reads_no_value_on_the_host(scale, dtype):
    """What a GPU runs (fp16's fold and its range cap included) reads no tensor's value on the host: no GPU sync per
    layer, nothing a CUDA graph capture refuses. Run on meta tensors, which refuse any such read (.item(), bool(),
    float()), through forward, backward_pass and dgrad in every mode."""
    p = make_problem(37, 50, 70, 3, dtype, "cpu", scale, False)
    p = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in p.items()}
    srow = p["sigma"] if p["sigma"].dim() == 1 else None
    for mode in ("plain", "nodrop", "dropout"):
        adapter, dropout = mode != "plain", mode == "dropout"
        y, z = nb.forward(*_forward_args(p, mode, True), "")
        m, n, B, u, A = (p[k] if adapter else None for k in ("m", "n", "B", "u", "A"))
        gl, rs, gb, v, *_ = nb.backward_pass(p["g"], z, m, n, srow, B, u, 1.75, dropout, adapter, adapter)
        dx = nb.dgrad(gl, rs[0], p["w8"], p["sigma"], p["block"], v, A, 1.75, p["mask"] if dropout else None, 0.25,
                      gb, rs[1] if dropout else None, "")
        assert y.shape == p["g"].shape and dx.shape == p["x"].shape and dx.dtype == dtype


@pytest.mark.parametrize("scale", ["tensor", "row", "block"])
def test_fp16_weight_beyond_fp16s_range_stays_finite(scale, monkeypatch):
    """A scale over 65504 / 448 makes W0 itself pass fp16's largest value (PEFT's fp16 copy of it holds inf): the
    folded weight is divided by a factor that keeps it finite, applied back in fp32, so a result inside fp16's range
    comes out finite and right, on native's own code."""
    _fp16_native_on_cpu(monkeypatch)
    p = make_problem(37, 64, 70, 3, torch.float16, "cpu", scale, False, act_scale=1e-4)
    p["sigma"] = p["sigma"] * 2.0 ** 20
    assert (d(p["w8"]).abs().max(1).values * d(p["sigma"]).reshape(-1, 1).amax(1)).max() > F16_MAX \
        if scale != "block" else (d(p["sigma"]).max() * 448 > F16_MAX)
    for mode in ("plain", "nodrop", "dropout"):
        check_forward(nb.forward, p, mode, has_bias=True)
        check_dgrad(nb.dgrad, p, mode)


def test_auto_is_native_on_cpu_and_reference_stays_exact(monkeypatch):
    monkeypatch.delenv("DORAFP8_BACKEND", raising=False)
    assert backends.resolve("auto", torch.device("cpu")) == "native"
    monkeypatch.setenv("DORAFP8_BACKEND", "reference")
    assert backends.resolve("auto", torch.device("cpu")) == "reference"


def test_fast_fp8_conversion_is_exact():
    from dorafp8._fp8_cast import e4m3_scaled

    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)  # all 256 codes: subnormals, +-0, NaN
    w8 = torch.cat([every, (torch.randn(64 * 1024) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)]).reshape(-1, 16)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got, ref = e4m3_scaled(w8, None, dtype), w8.to(dtype)
        assert got.dtype == dtype and torch.equal(got.isnan(), ref.isnan())
        assert torch.equal(got.nan_to_num(), ref.nan_to_num())
    for factor in (torch.tensor(0.0123), torch.rand(w8.shape[0], 1) + 0.5, 3.0):
        got, ref = e4m3_scaled(w8, factor, torch.float32), w8.float() * factor
        assert torch.equal(got.isnan(), ref.isnan()) and torch.equal(got.nan_to_num(), ref.nan_to_num())


# PyTorch's conversion (n < 4096), the lookup table (n <= 2^18), then the measured choice, forced to each method: one
# code per index (odd sizes, a transposed view), two codes per index (contiguous, even sizes above 2^17)
@pytest.mark.parametrize("n,cols", [(1000, 8), (20000, 8), (300000, 8), (300013, 7), (300000, "t")])
@pytest.mark.parametrize("method", ["native", "lookup"])
def test_fp8_conversion_paths_are_exact(n, cols, method, monkeypatch):
    from dorafp8 import _fp8_cast
    from dorafp8._fp8_cast import e4m3_scaled

    monkeypatch.setattr(_fp8_cast, "_CHOICE", collections.defaultdict(lambda: method))
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    w8 = torch.cat([every, (torch.randn(n - 256) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)])
    w8 = w8.reshape(-1, 8).T if cols == "t" else w8.reshape(-1, cols)
    same = lambda a, b: torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())  # noqa
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert same(e4m3_scaled(w8, None, dtype), w8.to(dtype))
        for factor in (torch.tensor(0.0123), torch.tensor([[0.0123]]), torch.rand(w8.shape[0], 1) + 0.5, 0.7):
            assert same(e4m3_scaled(w8, factor, dtype), (w8.float() * factor).to(dtype))


def test_fp8_conversion_of_large_blocks_is_chosen_by_timing_once(monkeypatch):
    """The first large block into a dtype (with a kind of factor) times both exact methods and keeps the faster; the
    block it measured on comes back converted, and later blocks are not timed again."""
    from dorafp8 import _fp8_cast

    monkeypatch.setattr(_fp8_cast, "_CHOICE", {})
    calls = []
    convert = _fp8_cast._convert
    monkeypatch.setattr(_fp8_cast, "_convert", lambda m, *a: calls.append(m) or convert(m, *a))
    w8 = (torch.randn(512, 1024) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(_fp8_cast.e4m3_scaled(w8, None, torch.bfloat16), w8.to(torch.bfloat16))
    assert sorted(calls) == ["lookup"] * _fp8_cast._TRIALS + ["native"] * _fp8_cast._TRIALS
    chosen = _fp8_cast._CHOICE[(torch.bfloat16, "none")]
    calls.clear()
    half = torch.tensor(0.5)
    assert torch.equal(_fp8_cast.e4m3_scaled(w8, half, torch.float32), w8.float() * 0.5)  # another kind: timed
    assert len(calls) == 2 * _fp8_cast._TRIALS and set(_fp8_cast._CHOICE) == {
        (torch.bfloat16, "none"), (torch.float32, "scalar")}
    calls.clear()
    _fp8_cast.e4m3_scaled(w8[:300], None, torch.bfloat16)
    assert calls == [chosen]


@pytest.mark.parametrize("shape", [(37, 64, 70, 3, True), (5, 33, 17, 20, False)], ids=shape_id)
@pytest.mark.parametrize("scale", ["tensor", "row", "block"])
def test_fp16_dgrad_of_a_large_weight_with_small_c_stays_finite(scale, shape, monkeypatch):
    """A weight whose largest value is near fp16's (6e4) and c = m / n of 0.002 (rows of large norm for their
    magnitude): dx = (g c) W0 + s v A lies inside fp16, but the dgrad's product of gl = g c / max|c| (|gl| <= |g|)
    with W0 is dx / max|c| = 500 dx, which overflowed fp16 (inf in dx) on native's fp16 code, what a T4 or V100
    runs. Native's backward_pass -> dgrad as the layer pairs them, each mode against fp64, outputs NaN-poisoned."""
    _fp16_native_on_cpu(monkeypatch)
    M, K, N, r, strided = shape
    p, m, c = large_weight_small_c(make_problem(M, K, N, r, torch.float16, "cpu", scale, strided))
    srow = p["sigma"] if scale == "row" else None
    g1 = p["g"]
    for mode in ("plain", "nodrop", "dropout"):
        # g scaled so that dx reaches a third of fp16's largest value (dx is linear in g)
        g = act(d(g1) * (2e4 / dx_64(p, mode, g1, c).abs().max().item()), torch.float16, "cpu", strided)
        ref = dx_64(p, mode, g, c)
        assert ref.abs().max() < F16_MAX
        if mode == "nodrop":  # the product of the reference's gl (max-normalized) with W0 passes fp16's range
            assert ((d(g) * c / c.abs().max()) @ w0_64(p["w8"], p["sigma"])).abs().max() > F16_MAX
        adapter, dropout = mode != "plain", mode == "dropout"
        mm, B, A = (m, p["B"], p["A"]) if adapter else (None, None, None)
        gl, rs, gb, v, *_ = nb.backward_pass(g, None, mm, p["n"] if adapter else None, srow, B, None, S, dropout,
                                             False, False)
        assert d(gl).abs().max() <= d(g).abs().max()
        dx = nb.dgrad(gl, rs[0], p["w8"], p["sigma"], p["block"], v, A, S, p["mask"] if dropout else None, P,
                      gb, rs[1] if dropout else None, "")
        assert_close(dx, ref, tol(torch.float16), f"dgrad[{scale}, {mode}] vs fp64")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("p", [0.1, 0.05, 0.3])
def test_dropout_in_project_has_no_bias(dtype, p):
    """project's a * mask / (1 - p) in a 16-bit dtype: with the factor 1 / (1 - p) rounded to that dtype first (1 / 0.9
    is 1.109 in bf16) every kept element was scaled the same wrong way, and u with it: a bias, within one element's
    tolerance but not averaging out over a sum. The least-squares ratio of the output to fp64 over 4096 outputs of
    random operands: 1 up to u / 16 (u = the dtype's unit roundoff) when each element is rounded once (seen: u / 45),
    0.2 u to 0.5 u off before."""
    gen = torch.Generator().manual_seed(0)
    M, K, r = 512, 256, 8
    a, b = (torch.randn(n, K, generator=gen).to(dtype) for n in (M, r))
    mask = torch.rand(M, K, generator=gen) >= p
    ref = (d(a) * mask / (1 - p)) @ d(b).T
    out = d(nb.project(a, b, dtype, mask, p))
    u = torch.finfo(dtype).eps / 2
    assert abs((out * ref).sum() / (ref * ref).sum() - 1) <= u / 16
    assert_close(out, ref, tol(dtype), "project vs fp64")


class _NarrowedFactors(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the elementwise ops that multiply a 16-bit tensor by a 0-dim fp32 tensor in the 16-bit dtype: on a GPU
    such a factor is cast to the other operand's dtype before the product (ATen's Loops.cuh: a 0-dim tensor is a
    scalar only on the CPU), so every element comes back off by the factor's rounding, the same way."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ts = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if func.overloadpacket in (torch.ops.aten.mul, torch.ops.aten.mul_, torch.ops.aten.div, torch.ops.aten.div_):
            ins = ts[:2]
            if (len(ins) == 2 and any(t.dim() == 0 and t.dtype == torch.float32 for t in ins)
                    and torch.result_type(*ins) in (torch.float16, torch.bfloat16)):
                self.seen.append(str(func))
        return func(*args, **kwargs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_factors_multiply_in_fp32(dtype, monkeypatch):
    """The plain forward's y = (x W8^T) * scale (no bias) and the plain dgrad's dx = t * rl * st multiplied the
    16-bit product by a 0-dim fp32 tensor: on a GPU (what runs native: an A100, a 3090, a T4) the factor was rounded
    to bf16 / fp16 first, every output of the layer off the same way (up to 2^-9 in bf16), a bias no tolerance on
    one element catches. Every call, each scale kind and mode, now multiplies by such a factor in fp32 (tensors on
    the CPU here, where a 0-dim tensor is a scalar: the dtype each multiply computes in is what is checked)."""
    _fp16_native_on_cpu(monkeypatch)
    for scale in ("tensor", "row", "block"):
        p = make_problem(23, 40, 50, 3, dtype, "cpu", scale, True)
        for mode, has_bias in itertools.product(("plain", "nodrop", "dropout"), (False, True)):
            narrowed = _NarrowedFactors()
            with narrowed:
                check_forward(nb.forward, p, mode, has_bias=has_bias)
                check_dgrad(nb.dgrad, p, mode)
                check_backward_pass(nb.backward_pass, p, mode)
            assert narrowed.seen == [], (scale, mode, has_bias)
