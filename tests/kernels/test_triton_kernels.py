"""Triton backend (dorafp8.triton_kernels) against fp64 evaluations of the backend contract and against
dorafp8.backends.reference.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (slow: shapes stay tiny, a few tens per dim,
yet cross every block edge of the interpreter's single 16 x 32 x 32 config). With a GPU the same tests run on cuda,
plus a few larger shapes, and bf16 (whose tl.dot the interpreter cannot execute) is checked too.
Every output starts as NaN (base.POISON_OUTPUTS) so that a tile the kernel never writes fails.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of the kernels

from tests.kernels._kernel_ref import (P, S, check_backward_pass, check_dgrad,  # noqa: E402
                                       check_forward, check_project, check_weight_norm, make_problem, shape_id)

tk = pytest.importorskip("dorafp8.triton_kernels")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from dorafp8.backends import base  # noqa: E402
from dorafp8.triton_kernels._common import fp8_promote, sum_parts  # noqa: E402
from dorafp8.triton_kernels.epilogue_dot import split_dot  # noqa: E402
from dorafp8.triton_kernels.gemm import w8_to  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# cpu under the interpreter, cuda when a GPU is present (both if someone interprets on a GPU machine). The backend
# says why the interpreter cannot run here (Triton 3.6 under NumPy >= 2.4); that reason is the skip's.
CPU_PROBLEM = tk.unavailable_reason(torch.device("cpu")) if INTERPRET else "no CUDA GPU and TRITON_INTERPRET != 1"
DEVICES = [dev for dev, ok in (("cpu", CPU_PROBLEM is None), ("cuda", HAS_CUDA)) if ok] or [
    pytest.param("cpu", marks=pytest.mark.skip(reason=CPU_PROBLEM))]
DTYPES = [
    torch.float32,
    torch.float16,
    # In the interpreter bf16 tiles are upcast to fp32 before tl.dot (its bf16 dot is broken, triton #11584), so
    # there this checks the bf16 loads, stores and masks; the bf16 tensor-core dot itself is checked on a GPU.
    torch.bfloat16,
]
SCALES = ["tensor", "row", "block"]

# (M, K, N, r, strided): M = 1; M, K, N crossing the 16/32/32 interpreter blocks (and the 16 x 16 scale blocks) with
# ragged edges; K, N exact multiples of the blocks; r = 1, 3, 16 (one padded rank chunk) and 20 (two chunks of 16 in
# the interpreter); `strided` puts the activations in wider buffers so their row stride differs from their width.
SHAPES = [
    (1, 50, 70, 1, False),
    (37, 50, 70, 3, True),
    (37, 64, 48, 16, False),
    (20, 33, 17, 20, True),
]
if HAS_CUDA:  # real GPU configs: larger tiles, several K steps, r over 64 (two rank chunks), r = 256
    SHAPES += [(300, 1000, 700, 72, True), (129, 257, 383, 256, False), (4, 4096, 1024, 8, False)]


def fp8_acc(device, act_quant) -> float:
    """The fp8 accumulator's share of sum|t8||W0| that W8A8 may add on `device` (_kernel_ref.fp8_sums_64): Hopper's
    fp8 wgmma keeps ~14 bits per promoted step (FP8_PROMOTE), 2^-6 in the contract (docs/DORA_MATH.md); 0 elsewhere
    (the interpreter's dots are exact fp32). fp32 outputs at K = 4096 failed tol(float32) on an H200 without it."""
    return 2.0 ** -6 if act_quant and device == "cuda" and fp8_promote(torch.device(device)) else 0.0


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(base, "POISON_OUTPUTS", True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("adapter_dtype", DTYPES, ids=str)
def test_weight_norm(device, shape, scale, adapter_dtype):
    M, K, N, r, strided = shape
    p = make_problem(M, K, N, r, adapter_dtype, device, scale, strided)
    if strided:  # A, B may come with any strides: a transposed B view
        p["B"] = p["B"].T.contiguous().T
    check_weight_norm(tk.weight_norm, p)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype,rank_dtype", [(torch.float32, None), (torch.float16, None),
                                              (torch.bfloat16, None), (torch.bfloat16, torch.float32)], ids=str)
def test_project(device, shape, dtype, rank_dtype):
    M, K, N, r, strided = shape
    check_project(tk.project, tk.project_grad, make_problem(M, K, N, r, dtype, device, "tensor", strided,
                                                            rank_dtype=rank_dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("masked", [False, True], ids=["plain", "dropout"])
def test_fp32_adapters_on_bf16_keep_exact_products(device, masked):
    """bf16 activations with fp32 adapters multiply on bf16 tensor cores with the fp32 operand split in three parts
    (_common.split_dtype, issue 52): each product stays exact, as in the fp32 FMA dot, so u, dA, v and dB are within a
    few fp32 roundings of fp64 over these short sums (a lost part: 2^-16 of the terms, far outside this bound)."""
    gen = torch.Generator().manual_seed(52)
    rnd = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    M, K, r = 9, 3, 5  # short sums: K for u and v, M for dA and dB
    x, A = rnd(M, K).to(torch.bfloat16), rnd(r, K).float()  # A with all 24 significand bits

    def check(out, exact, bound, what):
        out = out.double().cpu()
        err = (out - exact).abs()
        assert not out.isnan().any() and (err <= 16 * 2.0 ** -24 * bound).all(), f"{what}: {err.max().item():.3g}"

    keep = (rnd(M, K) > -0.5) if masked else None
    pk = 0.25 if masked else 0.0
    xd = x.double() * (keep.double() / (1 - pk) if masked else 1.0)
    mask = keep.to(device) if masked else None
    u = tk.project(x.to(device), A.to(device), torch.float32, mask, pk)
    check(u, xd @ A.double().T, xd.abs() @ A.double().abs().T, "project")
    v = rnd(M, r).float()
    dA = tk.project_grad(v.to(device), x.to(device), mask, pk, 1.0, torch.float32)
    check(dA, v.double().T @ xd, v.double().abs().T @ xd.abs(), "project_grad")
    # the backward pass: v = (g c) B over N = K columns, dB = s c (g^T u) over M rows
    g, B, u = x, A.T.contiguous(), rnd(M, r).float()
    m, n = (rnd(K).abs() + 0.5).float(), (rnd(K).abs() + 0.5).float()
    c = m.double() / n.double()
    out = tk.backward_pass(*(t.to(device) for t in (g, g, m, n)), None, B.to(device), u.to(device), 1.0, masked,
                           True, True)
    gc = g.double() * c
    check(out[3], gc @ B.double(), gc.abs() @ B.double().abs(), "backward_pass v")
    check(out[6], (g.double().T @ u.double()) * c[:, None], (g.double().abs().T @ u.double().abs()) * c[:, None],
          "backward_pass dB")


@pytest.mark.parametrize("device", DEVICES)
def test_fp32_adapters_on_bf16_backward_pass_without_overflow(device):
    """bf16 g with fp32 B: c B past fp32's max (c = m / n with a tiny norm n) while v = g c B is finite (g tiny). The
    split fp32 operand must not be c B itself (the first split: inf, then inf - inf = NaN in all of v), but c / max|c|
    times B, v rescaled by max|c| after the dot, as the 16-bit path's (g c / max|c|) B max|c| does."""
    gen = torch.Generator().manual_seed(53)
    rnd = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    M, N, r = 9, 3, 5
    g, B = (rnd(M, N) * 2.0 ** -100).to(torch.bfloat16), (rnd(N, r) * 1e10).float()
    m, n = (rnd(N).abs() + 0.5).float(), ((rnd(N).abs() + 0.5) * 1e-30).float()  # c ~ 1e30
    c = m.double() / n.double()
    assert ((B.double() * c[:, None]).abs() > torch.finfo(torch.float32).max).any()
    out = tk.backward_pass(*(t.to(device) for t in (g, g, m, n)), None, B.to(device), rnd(M, r).float().to(device),
                           1.0, False, True, False)
    v, gc = out[3].double().cpu(), g.double() * c
    err = (v - gc @ B.double()).abs()
    assert v.isfinite().all() and (err <= 16 * 2.0 ** -24 * (gc.abs() @ B.double().abs())).all(), f"v: {v}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["nodrop", "dropout", "plain"])
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("act_quant", ["", "rowwise"], ids=["w8a16", "w8a8"])
def test_forward(device, shape, dtype, mode, scale, act_quant):
    M, K, N, r, strided = shape
    p = make_problem(M, K, N, r, dtype, device, scale, strided)
    check_forward(tk.forward, p, mode, has_bias=(M + r) % 2 == 0, act_quant=act_quant,
                  fp8_acc=fp8_acc(device, act_quant))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("z_dtype", ["fp32", "cdt"])
@pytest.mark.parametrize("mode", ["nodrop", "dropout"])
def test_forward_fp32_adapters_on_16bit(device, dtype, z_dtype, mode):
    """The rank dtype wider than the compute dtype (PEFT's fp32 adapters on a 16-bit model). z in fp32 (a backend
    caller may ask for it): the epilogue multiplies u and B exactly in fp32. z in the compute dtype (what the layer
    asks for): every output is 16-bit, and the rank-r term is split_dot's three bf16 products; r = 20 crosses a rank
    chunk. Both against fp64 at the outputs' own tolerances (fp32 for an fp32 z)."""
    p = make_problem(37, 50, 70, 20, dtype, device, "row", True, rank_dtype=torch.float32)
    p["z_dtype"] = torch.float32 if z_dtype == "fp32" else dtype
    check_forward(tk.forward, p, mode, has_bias=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("mode", ["nodrop", "dropout"])
def test_dgrad_fp32_adapters_on_16bit(device, dtype, mode):
    """dx's rank-r term s v A with fp32 v and A into a 16-bit dx: split_dot (r = 20: two rank chunks)."""
    p = make_problem(37, 50, 70, 20, dtype, device, "tensor", True, rank_dtype=torch.float32)
    check_dgrad(tk.dgrad, p, mode)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rank_dtype", [torch.bfloat16, torch.float32], ids=["rank16", "rank32"])
@pytest.mark.parametrize("mode", ["nodrop", "dropout"])
def test_rank_term_as_fp32_fmas(device, rank_dtype, mode, monkeypatch):
    """The epilogues' rank-r term as exact fp32 FMAs (epilogue_dot.rank_fma_for: what Hopper gets under Triton 3.8,
    where tensor-core products there serialize the GEMM), forced here for the forward and the dgrad, against fp64."""
    import importlib

    tk_forward, tk_dgrad = (importlib.import_module(f"dorafp8.triton_kernels.{m}") for m in ("forward", "dgrad"))

    asked = []

    def fma(arch, dgrad, dropout):
        asked.append((dgrad, dropout))
        return True

    monkeypatch.setattr(tk_forward, "rank_fma_for", fma)
    monkeypatch.setattr(tk_dgrad, "rank_fma_for", fma)
    p = make_problem(37, 50, 70, 20, torch.bfloat16, device, "row", True, rank_dtype=rank_dtype)
    p["z_dtype"] = torch.bfloat16
    check_forward(tk.forward, p, mode, has_bias=True)
    check_dgrad(tk.dgrad, p, mode)
    assert (False, mode == "dropout") in asked and (True, mode == "dropout") in asked  # both launchers asked


@triton.jit
def _split_dot_kernel(a_ptr, b_ptr, out_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
                      PIECE_DT: tl.constexpr, IEEE: tl.constexpr):
    om, ok, on = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(a_ptr + om[:, None] * K + ok[None, :])
    b = tl.load(b_ptr + ok[:, None] * N + on[None, :])
    acc = split_dot(a, b, tl.zeros((M, N), dtype=tl.float32), PIECE_DT, IEEE)
    tl.store(out_ptr + om[:, None] * N + on[None, :], acc)


@pytest.mark.parametrize("device", DEVICES)
def test_split_dot_is_within_2_pow_minus_14(device):
    """split_dot (the epilogues' rank-r products for fp32 adapters into 16-bit outputs) against fp64: within 2^-14 of
    |a| @ |b| everywhere, over operands spanning 2^-20 .. 2^20, where a single bf16 product is not (so the bound
    tells the three products from one)."""
    gen = torch.Generator().manual_seed(3)
    M, K, N = 16, 32, 16
    a, b = (torch.randn(*shape, generator=gen) * 2.0 ** torch.randint(-20, 21, shape, generator=gen)
            for shape in ((M, K), (K, N)))
    out = torch.full((M, N), float("nan"), device=device)
    piece_dt = tl.float32 if INTERPRET else tl.bfloat16  # as rank_dot chooses (dot_dtype)
    _split_dot_kernel[(1,)](a.to(device), b.to(device), out, M, K, N, piece_dt, INTERPRET)
    exact = a.double() @ b.double()
    bound = 2.0 ** -14 * (a.double().abs() @ b.double().abs())
    assert ((out.cpu().double() - exact).abs() <= bound).all()
    one_product = a.bfloat16().double() @ b.bfloat16().double()
    assert not ((one_product - exact).abs() <= bound).all()


@triton.jit
def _sum_parts_kernel(part_ptr, out_ptr, n_parts, numel, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    ok = offs < numel
    tl.store(out_ptr + offs, sum_parts(part_ptr, n_parts, numel, offs, ok), mask=ok)


@pytest.mark.parametrize("device", DEVICES)
def test_sum_parts_adds_in_order(device):
    """sum_parts (the partials' fixed-order sums: the backward pass's v, db, dm, dB and project_grad's splits) for 1 to
    10 parts, bit for bit the sum p = 0, 1, 2, ... one part at a time in fp32: every part counted once, in order (a
    part past the count added, or the order changed, alters low bits of these magnitudes), and -0.0 kept where every
    part is -0.0 (an unrolled version's masked load of 0.0 added would give +0.0). Elements past numel are not written
    (NaN stays)."""
    gen = torch.Generator().manual_seed(11)
    numel, block = 37, 64
    for n_parts in range(1, 11):
        parts = torch.randn(n_parts + 3, numel, generator=gen) * 2.0 ** torch.randint(-12, 13, (n_parts + 3, numel),
                                                                                      generator=gen)
        parts[:, 0] = -0.0  # every part -0.0: the sum is -0.0
        out = torch.full((block,), float("nan"), device=device)
        _sum_parts_kernel[(1,)](parts.to(device), out, n_parts, numel, BLOCK=block)
        want = parts[0].clone()
        for p in range(1, n_parts):
            want = want + parts[p]  # fp32, one part at a time
        got = out.cpu()
        assert torch.equal(got[:numel], want), f"{n_parts} parts"
        assert torch.signbit(got[0]), f"{n_parts} parts: -0.0 became +0.0"
        assert got[numel:].isnan().all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["nodrop", "dropout"])
def test_forward_without_z(device, mode):
    from tests._tolerance import assert_close, tol
    from tests.kernels._kernel_ref import forward_64

    p = make_problem(5, 40, 36, 3, torch.float32, device, "tensor", False)
    xm = p["xm"] if mode == "dropout" else None
    u = p["u"] if mode == "dropout" else p["u_nodrop"]
    y, z = tk.forward(p["x"], p["w8"], p["sigma"], p["block"], p["bias"], p["m"], p["n"], u, p["B"], S, xm, P,
                      False, torch.float32, "")
    assert z is None
    y64, _ = forward_64(p["x"], p["w8"], p["sigma"], p["bias"], p["c"], u, p["B"], S, xm, P)
    assert_close(y, y64, tol(torch.float32), f"forward[{mode}, need_z=False] y vs fp64")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype,rank_dtype", [(torch.float32, None), (torch.float16, None),
                                              (torch.bfloat16, None), (torch.bfloat16, torch.float32)], ids=str)
@pytest.mark.parametrize("mode", ["nodrop", "dropout", "plain"])
@pytest.mark.parametrize("scale", ["tensor", "row"])
def test_backward_pass(device, shape, dtype, rank_dtype, mode, scale):
    M, K, N, r, strided = shape
    p = make_problem(M, K, N, r, dtype, device, scale, strided, rank_dtype=rank_dtype)
    check_backward_pass(tk.backward_pass, p, mode)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,rank_dtype", [(torch.float16, None), (torch.bfloat16, torch.float32)], ids=str)
@pytest.mark.parametrize("mode", ["nodrop", "dropout", "plain"])
@pytest.mark.parametrize("scale", ["tensor", "row"])
def test_backward_pass_without_db(device, dtype, rank_dtype, mode, scale):
    """Issue 52: a layer without a bias asks for no db (NEED_DB off: no column sum of g, no partial, no finishing
    programs for it; a plain pass then launches no finishing kernel). db is None, the rest is the same bit for bit, and
    the run with db still matches fp64 (check_backward_pass; outputs NaN-poisoned)."""
    M, K, N, r, strided = SHAPES[1]  # ragged, strided
    p = make_problem(M, K, N, r, dtype, device, scale, strided, rank_dtype=rank_dtype)
    check_backward_pass(tk.backward_pass, p, mode, need_db=False)
    check_backward_pass(tk.backward_pass, p, mode)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["nodrop", "dropout", "plain"])
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("act_quant", ["", "rowwise"], ids=["w8a16", "w8a8"])
def test_dgrad(device, shape, dtype, mode, scale, act_quant):
    M, K, N, r, strided = shape
    p = make_problem(M, K, N, r, dtype, device, scale, strided)
    check_dgrad(tk.dgrad, p, mode, act_quant, fp8_acc(device, act_quant))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["nodrop", "dropout"])
@pytest.mark.parametrize("scale", ["tensor", "block"])
def test_w8a8_with_fp8_promotion(device, mode, scale, monkeypatch):
    # FP8_PROMOTE (Hopper's W8A8 path: each step's fp8 product added to the fp32 accumulator in software) is the same
    # sum; forced on here so that its code runs under the interpreter and on any GPU, against the same references.
    import sys

    for mod in ("forward", "dgrad"):  # the modules (the package re-exports functions of the same names)
        monkeypatch.setattr(sys.modules[f"dorafp8.triton_kernels.{mod}"], "fp8_promote", lambda device: True)
    p = make_problem(37, 64, 48, 16, torch.bfloat16, device, scale, False)
    check_forward(tk.forward, p, mode, has_bias=True, act_quant="rowwise")
    check_dgrad(tk.dgrad, p, mode, "rowwise")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["nodrop", "dropout", "plain"])
@pytest.mark.parametrize("scale", ["tensor", "row", "block"])
def test_w8a8_dgrad_reading_w8_directly(device, mode, scale, monkeypatch):
    # W8A8's cp.async dgrad reads W8^T [K, N] from transpose_w8 (dgrad.reads_w8t); its kernel can also read W8 [N, K]
    # itself, the fp8 tile transposed in registers (a candidate for wgmma GPUs, not yet timed on one): forced here,
    # that addressing against the same references.
    import sys

    monkeypatch.setattr(sys.modules["dorafp8.triton_kernels.dgrad"], "reads_w8t", lambda quant, loop: False)
    p = make_problem(37, 72, 48, 16, torch.bfloat16, device, scale, True)
    check_dgrad(tk.dgrad, p, mode, "rowwise")


@pytest.mark.parametrize("device", DEVICES)
def test_rowwise_quant(device):
    """The W8A8 activation recipe: equal to the reference's, an all-zero row gets scale 1, an outlier row keeps its
    small values only as far as e4m3 can."""
    import dorafp8.backends.reference as reference
    from dorafp8.triton_kernels.quant import rowwise_quant

    t = torch.randn(9, 70, generator=torch.Generator().manual_seed(3))
    t[2] = 0.0
    t[4, 7] = 1e4
    t8, sigma = rowwise_quant(t.to(device))
    r8, rs = reference.quantize_rows(t)
    assert t8.dtype == torch.float8_e4m3fn and sigma.dtype == torch.float32
    assert torch.equal(sigma.cpu(), rs) and sigma[2].item() == 1.0
    assert torch.equal(t8.float().cpu(), r8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("rank_dtype", [None, torch.float32], ids=["rank-cdt", "rank-fp32"])
@pytest.mark.parametrize("masked", [False, True], ids=["plain", "dropout"])
def test_project_quantizes_x_for_w8a8(device, dtype, rank_dtype, masked):
    """project(quant=True) (backends/base.py, QUANT_PARAMS): u as project() makes it, and x itself (never the masked
    x) quantized with the bits of the reference's row recipe, an all-zero row and an outlier row included; r = 20:
    two rank chunks in the interpreter, of which one quantizes."""
    import dorafp8.backends.reference as reference

    assert tk.QUANTS_IN_PROJECT
    p = make_problem(37, 70, 24, 20, dtype, device, "tensor", True, rank_dtype=rank_dtype)
    x = p["x"]
    x[2] = 0.0
    x[4, 7] = 1e4 if dtype == torch.float32 else 3e4  # x / (1 - p) stays finite in fp16
    mask = p["mask"] if masked else None
    u, x8, sx = tk.project(x, p["A"], p["rdt"], mask=mask, p=P if masked else 0.0, quant=True)
    assert torch.equal(u, tk.project(x, p["A"], p["rdt"], mask=mask, p=P if masked else 0.0))
    r8, rs = reference.quantize_rows(x.cpu())
    assert x8.dtype == torch.float8_e4m3fn and sx.dtype == torch.float32 and x8.shape == x.shape
    assert torch.equal(sx.cpu(), rs) and sx[2].item() == 1.0
    assert torch.equal(x8.float().cpu(), r8)


def test_unavailable_reason(monkeypatch):
    if INTERPRET and CPU_PROBLEM is None:
        assert tk.unavailable_reason(torch.device("cpu")) is None
        from dorafp8 import backends

        assert backends.unavailable_reason("triton", torch.device("cpu")) is None
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reason = tk.unavailable_reason(torch.device("cpu"))
    assert isinstance(reason, str) and "TRITON_INTERPRET" in reason
    if not HAS_CUDA:
        assert isinstance(tk.unavailable_reason(torch.device("cuda")), str)


@pytest.mark.parametrize("triton_version,numpy_version,refused", [
    ("3.6.0", "2.4.6", True), ("3.6.0", "2.3.5", False), ("3.7.1", "2.4.6", False), ("3.9.0", "2.10.0", False)])
def test_interpreter_refuses_triton_3_6_under_numpy_2_4(monkeypatch, triton_version, numpy_version, refused):
    """Triton 3.6's interpreter failed every kernel under NumPy >= 2.4 ("only 0-dimensional arrays can be converted to
    Python scalars"); the backend says which versions and what to install instead. Compiled kernels are unaffected."""
    import numpy
    import triton

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton, "__version__", triton_version)
    monkeypatch.setattr(numpy, "__version__", numpy_version)
    why = tk.unavailable_reason(torch.device("cpu"))
    if refused:
        assert f"Triton {triton_version}'s interpreter" in why and f"NumPy {numpy_version}" in why
        assert "pip install 'numpy<2.4', or triton>=3.7" in why
    else:
        assert why is None


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_triton_older_than_tested_is_refused(monkeypatch, device):
    """A Triton older than the oldest CI tests (3.6, dorafp8/_deps.py) is not used: the reason names it and the fix."""
    import triton

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton, "__version__", "3.5.1")
    assert tk.unavailable_reason(torch.device(device)) == (
        "triton 3.5.1 is older than 3.6, the oldest dorafp8 is tested with: pip install 'triton>=3.6'")


@pytest.mark.parametrize("device", DEVICES)
def test_rejects_bad_weight(device):
    p = make_problem(2, 32, 16, 1, torch.float32, device, "tensor", False)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        tk.forward(p["x"], p["w8"].float(), p["sigma"], 16, None, None, None, None, None, S, None, P, False,
                   torch.float32, "")
    with pytest.raises(ValueError, match="scale"):
        tk.dgrad(p["g"], torch.ones(()), p["w8"], p["sigma"].double(), 16, None, None, S, None, P, None, None, "")
    with pytest.raises(ValueError, match="scale"):
        tk.weight_norm(p["w8"], torch.ones(3, device=device), 16, p["A"], p["B"], S)
    with pytest.raises(ValueError, match="multiple of 16"):
        tk.forward(p["x"], p["w8"], torch.ones(2, 4, device=device), 10, None, None, None, None, None, S, None, P,
                   False, torch.float32, "")


# --- the fp8 weight tile's conversion (triton_kernels/gemm.py w8_to) --------------------------------------------------

_E4M3_CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8)
_E4M3_NAN = (_E4M3_CODES & 0x7F) == 0x7F  # 0x7f and 0xff: e4m3fn has NaN, no infinities


@triton.jit
def _convert_kernel(w_ptr, out_ptr, DOT_DT: tl.constexpr, VIA_F32: tl.constexpr):
    offs = tl.arange(0, 256)
    tl.store(out_ptr + offs, w8_to(tl.load(w_ptr + offs), DOT_DT, VIA_F32))


def _w8_to_all_codes(device, dtype, via_f32):
    """Every e4m3 code through gemm.w8_to (the main loops' conversion) into `dtype`."""
    codes = _E4M3_CODES.to(device).view(torch.float8_e4m3fn)
    out = torch.full((256,), 0.3, dtype=dtype, device=device)  # 0.3 is no e4m3 value: an unwritten slot fails
    tl_dt = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]
    _convert_kernel[(1,)](codes, out, tl_dt, via_f32)
    return codes, out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("via_f32", [False, True], ids=["direct", "via-f32"])
def test_w8_conversion_is_exact_for_every_e4m3_value(device, dtype, via_f32):
    # Both routes (direct, and through fp32 as on sm_89 / sm_90) give the same bits as torch's conversion for all 254
    # finite codes, subnormals and -0 included.
    codes, out = _w8_to_all_codes(device, dtype, via_f32)
    ref = codes.to(dtype)
    bits = {torch.float32: torch.int32}.get(dtype, torch.int16)
    finite = ~_E4M3_NAN.to(device)
    assert torch.equal(out[finite].view(bits), ref[finite].view(bits))


@pytest.mark.parametrize("device", ["cuda"] if HAS_CUDA else [pytest.param("cpu", marks=pytest.mark.skip(
    reason="needs a GPU: Triton's interpreter decodes the e4m3 NaN codes as +-480 (runtime/interpreter.py "
           "_convert_float ignores e4m3fn's NaN encoding), so it cannot check this"))])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("via_f32", [False, True], ids=["direct", "via-f32"])
def test_w8_conversion_keeps_e4m3_nan(device, dtype, via_f32):
    # An e4m3 NaN in the weight stays a NaN in the compute dtype (docs/DORA_MATH.md, "FP8 weights"): the outputs it
    # reaches are NaN, never a finite number.
    _, out = _w8_to_all_codes(device, dtype, via_f32)
    assert out[_E4M3_NAN.to(device)].isnan().all()
    assert not out[~_E4M3_NAN.to(device)].isnan().any()


# The Hopper main loop (triton_kernels/hopper.py): tensor descriptors (TMA), the persistent tile loop, warp
# specialization, W8^T for the dgrad, and rank_pieces' bf16 operands for fp32 adapters. Under the interpreter the same
# program runs (descriptors and the tile loop as plain code: 3 programs loop over the tiles, warp_specialize is a hint)
# where DORAFP8_HOPPER_GEMM=1 asks for it; on an H100 it is the compiled path under the same opt-in (the default runs
# the cp.async one there too: hopper.main_loop_for), and the cp.async one is run beside it.
# The shapes are ones TMA can address (K, N multiples of 16; the fp32 adapters' rows 16-byte aligned); r = 20 takes
# rank_pieces' 60 columns in four chunks of 16; M = 37 and 70 leave partial tiles. Dropout, fp32 outputs and 16-bit
# adapters whose rows TMA cannot address keep the cp.async loop (hopper.ws_plan), which the observed MAIN_LOOP shows.
HOPPER_CASES = [((37, 64, 48, 16, False), torch.float16, None),
                ((70, 96, 80, 20, False), torch.bfloat16, torch.float32),
                ((37, 64, 48, 16, False), torch.float16, torch.float32)]
HOPPER_LOOPS = ["tma-ws", "async-copy"] if HAS_CUDA else ["tma-ws"]


@pytest.fixture
def main_loops_seen():
    """The MAIN_LOOP of every GEMM launched inside the test, by kernel name."""
    from dorafp8.triton_kernels._common import launch_observers

    seen = []

    def observe(kernel, grid, args, kwargs):
        if "MAIN_LOOP" in kwargs:
            seen.append((getattr(kernel, "__name__", None) or kernel.fn.__name__, kwargs["MAIN_LOOP"]))
        return False

    launch_observers().append(observe)
    yield seen
    launch_observers().remove(observe)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loop", HOPPER_LOOPS)
@pytest.mark.parametrize("shape,dtype,rank_dtype", HOPPER_CASES,
                         ids=[f"{shape_id(sh)}-{dt}-{rdt}" for sh, dt, rdt in HOPPER_CASES])
@pytest.mark.parametrize("mode", ["nodrop", "plain"])
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("act_quant", ["", "rowwise"], ids=["w8a16", "w8a8"])
def test_hopper_main_loop(device, loop, shape, dtype, rank_dtype, mode, scale, act_quant, main_loops_seen,
                          monkeypatch):
    monkeypatch.setenv("DORAFP8_HOPPER_GEMM", "0" if loop == "async-copy" else "1")
    if device == "cuda" and loop != "async-copy" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the TMA loop runs on Hopper only (hopper.main_loop_for)")
    M, K, N, r, strided = shape
    p = make_problem(M, K, N, r, dtype, device, scale, strided, rank_dtype=rank_dtype)
    p["z_dtype"] = dtype  # z in the compute dtype, as the layer asks: fp32 adapters take split_dot's products
    check_forward(tk.forward, p, mode, has_bias=True, act_quant=act_quant, fp8_acc=fp8_acc(device, act_quant))
    check_dgrad(tk.dgrad, p, mode, act_quant, fp8_acc(device, act_quant))
    # 16-bit adapters are read by TMA as they are: r = 20 has 40-byte rows (fp32 ones go through rank_pieces' padded
    # rows)
    tma_rank = mode == "plain" or rank_dtype == torch.float32 or r % 8 == 0
    want = "async-copy" if loop == "async-copy" or not tma_rank else loop
    assert {kernel for kernel, _ in main_loops_seen} == {"dora_fwd_kernel", "dora_dgrad_kernel"}
    assert {main for _, main in main_loops_seen} == {want}, main_loops_seen


@pytest.mark.parametrize("device", DEVICES)
def test_hopper_main_loop_with_fp8_promotion(device, main_loops_seen, monkeypatch):
    """W8A8 on the Hopper loop with FP8_PROMOTE on (as on sm_90a: each step's e4m3 product joins the fp32 accumulator
    in software, one warpgroup's adds beside the other's QGMMA), against the same references."""
    import sys

    monkeypatch.setenv("DORAFP8_HOPPER_GEMM", "1")
    for mod in ("forward", "dgrad"):
        monkeypatch.setattr(sys.modules[f"dorafp8.triton_kernels.{mod}"], "fp8_promote", lambda device: True)
    p = make_problem(70, 96, 80, 20, torch.bfloat16, device, "block", False, rank_dtype=torch.float32)
    p["z_dtype"] = torch.bfloat16
    check_forward(tk.forward, p, "nodrop", has_bias=True, act_quant="rowwise")
    check_dgrad(tk.dgrad, p, "nodrop", "rowwise")
    assert {main for _, main in main_loops_seen} == {"tma-ws"}, main_loops_seen


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["K=50", "dropout", "fp32 z"])
def test_hopper_main_loop_falls_back(device, case, main_loops_seen, monkeypatch):
    """Where the Hopper loop cannot run, the cp.async loop does, with the same results: K = 50 (rows of 50 fp8 bytes,
    not 16-byte aligned, which TMA cannot address), dropout (two accumulators: two dots a step, which the
    partitioner cannot take) and an fp32 z from fp32 adapters (exact fp32 rank products, not split_dot's)."""
    monkeypatch.setenv("DORAFP8_HOPPER_GEMM", "1")
    K = 50 if case == "K=50" else 64
    p = make_problem(37, K, 48, 16, torch.float16, device, "row", False, rank_dtype=torch.float32)
    p["z_dtype"] = torch.float32 if case == "fp32 z" else torch.float16
    mode = "dropout" if case == "dropout" else "nodrop"
    check_forward(tk.forward, p, mode, has_bias=True)
    assert {main for _, main in main_loops_seen} == {"async-copy"}, main_loops_seen
    if case != "fp32 z":  # the dgrad's output is dx, in the compute dtype
        check_dgrad(tk.dgrad, p, mode)
        assert {main for k, main in main_loops_seen if k == "dora_dgrad_kernel"} == {"async-copy"}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("t_rank_rows", [False, True], ids=["B-side", "A-side"])
def test_rank_pieces_give_split_dots_products(device, t_rank_rows):
    """rank_pieces' operands are [Th | Tl | Th] and [Vl | Vh | Vh], with split_dot's pieces (hi = bf16(x) and
    lo = bf16(x - hi), both rounded to nearest even), so that their one product over 3 r is split_dot's three,
    Th Vl + Tl Vh + Th Vh. Against torch's own roundings, over values spanning 2^-20 .. 2^20."""
    from dorafp8.triton_kernels.hopper import rank_pieces

    gen = torch.Generator().manual_seed(5)
    r = 20
    v = torch.randn(33, r, generator=gen) * 2.0 ** torch.randint(-20, 21, (33, r), generator=gen)
    t = torch.randn(40, r, generator=gen) * 2.0 ** torch.randint(-20, 21, (40, r), generator=gen)
    v3, t3 = rank_pieces(v.to(device), (t.T if t_rank_rows else t).to(device), t_rank_rows)
    t3 = t3.T if t_rank_rows else t3  # [40, 3 r]: the tile side by rows

    def split(x):
        hi = x.to(torch.bfloat16)
        return hi, (x - hi.float()).to(torch.bfloat16)

    (th, tl_), (vh, vl) = split(t), split(v)
    assert torch.equal(v3.cpu(), torch.cat([vl, vh, vh], 1))
    assert torch.equal(t3.cpu(), torch.cat([th, tl_, th], 1))


def test_descriptor_scratch_allocator_is_set_for_the_call_only():
    """Tensor descriptors made in a kernel need 128 bytes of global scratch a program, which Triton asks its allocator
    for at launch (and fails without one): the Hopper launchers set one for their call only, in a copy of the context,
    so what a caller set (or that none is set) is what the rest of the program still sees."""
    from triton.runtime import _allocation

    from dorafp8.triton_kernels.hopper import with_descriptor_scratch

    before = _allocation._allocator.get()
    inside = with_descriptor_scratch(lambda: _allocation._allocator.get())
    assert inside is not before and callable(inside)
    assert _allocation._allocator.get() is before


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("M", [37, 70], ids=["small-M", "large-M"])
@pytest.mark.parametrize("act_quant", ["", "rowwise"], ids=["w8a16", "w8a8"])
def test_block_scales_on_the_hopper_loops_own_tiles(device, M, act_quant, main_loops_seen, monkeypatch):
    """The "tma-ws" loop with block scales on the tiles sm_90a runs (hopper.ws_configs_for("sm90"), the first of each
    list, fitted by fit_reduction_block: 128 x 128 with 16-deep steps for the tests' 16 x 16 blocks at large M), under
    the interpreter, against the fp64 contract and the reference: odd M, N and K (partial tiles, several scale blocks
    a step apart, one tile holding 5 blocks of rows)."""
    import sys

    from dorafp8.triton_kernels import _common, hopper

    if device == "cuda":
        pytest.skip("on a GPU test_hopper_main_loop runs the device's own lists")
    monkeypatch.setenv("DORAFP8_HOPPER_GEMM", "1")
    monkeypatch.setattr(_common, "_TUNERS", {})  # tuners made with the interpreter's lists must not serve
    for mod in ("forward", "dgrad"):
        monkeypatch.setattr(sys.modules[f"dorafp8.triton_kernels.{mod}"], "ws_configs_for",
                            lambda arch, *a, **k: hopper.ws_configs_for("sm90", *a, **k)[:1])
    p = make_problem(M, 96, 80, 16, torch.bfloat16, device, "block", False, rank_dtype=torch.float32)
    p["z_dtype"] = torch.bfloat16
    check_forward(tk.forward, p, "nodrop", has_bias=True, act_quant=act_quant)
    check_dgrad(tk.dgrad, p, "nodrop", act_quant)
    assert {main for _, main in main_loops_seen} == {"tma-ws"}, main_loops_seen
    tuned = [t for t in _common._TUNERS.values()]
    assert tuned and all(len(t.configs) == 1 for t in tuned)
    assert M <= 64 or {t.configs[0].kwargs["BLOCK_M"] for t in tuned} == {128}


def test_a_launch_runs_on_its_tensors_gpu(monkeypatch):
    """Triton launches on the current GPU: a layer device_map put on cuda:1, called while cuda:0 is current, must still
    launch on cuda:1 (triton_kernels/_common.launch switches to its first tensor's GPU for the launch, then back).
    Before, it launched on cuda:0 with cuda:1's pointers. No GPU here: a fake cuda:1 tensor and a recorded switch."""
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensorMode

    from dorafp8.triton_kernels import _common

    with FakeTensorMode():
        on1, on0 = torch.empty(4, device="cuda:1"), torch.empty(4, device="cuda:0")
    current = [0]

    @contextlib.contextmanager
    def device(index):
        prev, current[0] = current[0], index
        try:
            yield
        finally:
            current[0] = prev

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", device)
    seen = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append(current[0])

    for first in (on1, on0, torch.empty(4)):
        _common.launch(Kernel(), (1,))(first, 3, on0, BLOCK=16)
    assert seen == [1, 0, 0] and current[0] == 0


def test_a_triton_whose_import_raises_no_import_error_leaves_dorafp8_importable(tmp_path):
    """A Triton whose import raises something else (a future one's AttributeError): the backend is unavailable, saying
    it, and dorafp8 imports, with its kernels module and the launch counter; before, the AttributeError went through
    `import dorafp8.triton_kernels`: first_contact's env step stopped with "cannot import dorafp8"."""
    import subprocess
    import sys

    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "__init__.py").write_text(
        "__version__ = '9.0.0'\nraise AttributeError(\"module 'triton.backends' has no attribute 'compiler'\")\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import torch, dorafp8, dorafp8._launches, dorafp8.triton_kernels as tk; from dorafp8 import backends; "
            "print(tk.unavailable_reason(torch.device('cuda'))); print(backends.resolve('auto', torch.device('cpu')))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), root]), TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    why, auto = proc.stdout.strip().splitlines()[-2:]
    assert why.startswith("triton could not be imported (AttributeError: module 'triton.backends' has no attribute")
    assert auto == "native"


def test_an_error_of_the_kernels_own_code_is_not_taken_for_a_missing_triton():
    """Only what Triton raised makes the backend unavailable: a bug of these modules' own code is raised as it is."""
    def raised(fn):
        try:
            fn()
        except Exception as e:
            return e

    assert tk._from_triton(AttributeError("no", name="x", obj=tl))  # a name a triton module lacks
    assert tk._from_triton(raised(lambda: triton.cdiv("a", 1)))  # raised in Triton's own code
    assert not tk._from_triton(raised(lambda: sum_parts.no_such_name))
    assert not tk._from_triton(raised(lambda: 1 // 0))
