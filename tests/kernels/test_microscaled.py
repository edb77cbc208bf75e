"""The microscaled weight kinds (dorafp8/quant.py, "Microscaled weights"): NVFP4 (e2m1 packed two per byte, e4m3
scale per 16 along K, fp32 global scale) and MXFP8 (e4m3, e8m0 scale per 32 along K) through the reference backend,
against fp64 of DoRA (tests/_ref.py) on a dequantization written here independently of dorafp8's (bit arithmetic, not
its tables), for every compute dtype, with and without dropout, on odd shapes; the backend functions on NaN-bordered
(strided) inputs; which backend "auto" picks for them; the refusals; and the reference's peak memory."""

from unittest import mock

import pytest
import torch

import dorafp8
from dorafp8 import backends, ops, quant
from dorafp8._memory import MiB, PeakTemporaries
from dorafp8.backends.base import magnitude_scale
from tests._ref import dora_fp64
from tests._tolerance import assert_close, tol
from tests.kernels._kernel_ref import act, d

# The backends run on the GPU where there is one (the Triton kernels and the cuBLAS strategy compiled), else on CPU
# (Triton's under its interpreter, tests/conftest.py); the fp64 references are on CPU either way.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KINDS = ("nvfp4", "mxfp8")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def e2m1_64(code: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (0..15) to fp64 by the bit layout: sign bit 3, exponent bits 1-2 (bias 1), mantissa bit 0."""
    c = code.long()
    e, mant = (c >> 1) & 3, (c & 1).double()
    mag = torch.where(e == 0, 0.5 * mant, torch.pow(2.0, (e - 1).double()) * (1 + 0.5 * mant))
    return torch.where((c & 8) != 0, -mag, mag)


def dequant_64(w, scale, g=None) -> torch.Tensor:
    """W0 in fp64, from the bytes: NVFP4 low nibble = even column, factor scale * g rounded to fp32 once (ModelOpt's
    dequantize forms it in fp32); MXFP8 factor 2^(e - 127)."""
    if w.dtype == torch.uint8:
        N, half = w.shape
        codes = torch.empty(N, 2 * half, dtype=torch.uint8)
        codes[:, 0::2], codes[:, 1::2] = w.cpu() & 15, w.cpu() >> 4
        f = (scale.cpu().float() * g.cpu().float()).double()
        return e2m1_64(codes) * f.repeat_interleave(16, dim=1)
    K = w.shape[1]
    f = torch.pow(2.0, scale.cpu().view(torch.uint8).double() - 127).repeat_interleave(32, dim=1)[:, :K]
    return w.cpu().double() * f


def make_weight(kind, N, K, seed=0):
    """(w, scale, global_scale or None): rows of different magnitudes, quantized by the format's recipe."""
    gen = torch.Generator().manual_seed(seed)
    W = torch.randn(N, K, generator=gen) * 0.05 * torch.linspace(0.1, 3.0, N)[:, None]
    if kind == "nvfp4":
        return quant.quantize_nvfp4(W)
    if kind != "mxfp8":  # the fp8 kinds too, for tests that cover every kind (test_cublas.py), blocks of 16
        return (*quant.quantize_e4m3(W, per_row=kind == "row", block_size=16 if kind == "block" else None), None)
    return (*quant.quantize_mxfp8(W), None)


# ---- the formats' bits ---------------------------------------------------------------------------------------------


def test_nvfp4_packs_the_even_column_in_the_low_nibble():
    """ModelOpt packs `(q[..., 1::2] << 4) | q[..., 0::2]` and compressed-tensors `x[:, 0] | x[:, 1] << 4`: a row
    [0.5, -1.0, 6.0, 0.0, ...] (scale 1, global 1) is bytes 0xA1, 0x07."""
    row = torch.tensor([[0.5, -1.0, 6.0, 0.0] + [0.0] * 12])
    packed, scale, g = quant.quantize_nvfp4(row)
    # amax 6 -> global 6 / (6 * 448), block scale e4m3(6 / (6 * g)) = 448: the values stay themselves
    assert packed[0, :2].tolist() == [0xA1, 0x07]
    assert quant.unpack_e2m1(packed)[0, :4].tolist() == [0.5, -1.0, 6.0, 0.0]
    assert torch.equal(quant.dequantize_weight(packed, scale, global_scale=g), row)


def test_e2m1_and_e8m0_tables_match_the_bit_layout():
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[1::2] << 4) | codes[0::2]
    assert torch.equal(quant.unpack_e2m1(packed[None])[0].double(), e2m1_64(codes))
    e = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8).view(quant.E8M0)
    got = quant.e8m0_values(e)
    assert got[:6].double().tolist() == [2.0 ** -127, 2.0 ** -126, 0.5, 1.0, 2.0, 2.0 ** 127]
    assert torch.isnan(got[6])


def modelopt_mxfp8(W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ModelOpt's MXFP8 recipe as its MXFP8QTensor writes it (K a multiple of 32): exponent ceil(log2(amax / 448))
    (-127 for an all-zero block) clamped to [-127, 127], stored biased as uint8; values W * 2^-e clamped to 448."""
    N, K = W.shape
    blocks = W.float().reshape(N, K // 32, 32)
    d = blocks.abs().amax(-1) / 448.0
    e = torch.where(d > 0, torch.log2(d), torch.tensor(-127.0)).ceil().clamp(-127, 127)
    w8 = (blocks * torch.exp2(-e)[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(N, K)
    return w8, (e + 127).to(torch.uint8).view(quant.E8M0)


def test_quantize_mxfp8_is_modelopts_recipe_and_requantizes_its_output_exactly():
    """quantize_mxfp8 writes ModelOpt's bytes (an all-zero block, a tiny one, rows of different magnitudes), and
    re-quantizing a dequantized MXFP8 weight, as a merge that changes nothing does, gives its values back. The OCP
    example recipe 2^(floor(log2 amax) - 8) did not: where a stored block's largest |value| lies in (224, 256) it
    halved the scale and clipped that value to 448 (up to 12.5% off; 0.8% of a Gaussian weight's norm)."""
    W = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * torch.linspace(1e-3, 10, 64)[:, None]
    W[0, :32] = 0.0
    W[1, 32:64] *= 1e-30
    w8, e = quant.quantize_mxfp8(W)
    want_w8, want_e = modelopt_mxfp8(W)
    assert torch.equal(e.view(torch.uint8), want_e.view(torch.uint8))
    assert torch.equal(w8.view(torch.uint8), want_w8.view(torch.uint8))
    W0 = quant.dequantize_weight(want_w8, want_e)
    assert torch.equal(quant.dequantize_weight(*quant.quantize_mxfp8(W0)), W0)


def test_quantize_nvfp4_keeps_a_block_far_below_the_tensors_amax():
    """A block whose e4m3 scale would underflow (amax 1e-3 beside 1000: scale 4.5e-4 < 2^-10) gets ModelOpt's least
    scale 2^-9 (its _cast_per_block_scale_to_fp8 clamps to [2^-9, 448]), keeping its values to e2m1's precision; it
    got scale 0, which zeroed the block (a merge re-quantizing such a weight lost those rows' values)."""
    W = torch.cat([torch.full((1, 16), 1000.0), torch.linspace(-1e-3, 1e-3, 16)[None]])
    packed, scale, g = quant.quantize_nvfp4(W)
    assert scale[1, 0].float().item() == 2.0 ** -9
    small = quant.dequantize_weight(packed, scale, global_scale=g)[1]
    # a unit of 2^-9 * g = 7.3e-4; e2m1 steps by half a unit below 2 units: a quarter unit of error at most
    assert ((small - W[1]).abs() <= 0.25 * 2.0 ** -9 * float(g) * 1.0001).all()


@pytest.mark.parametrize("kind,N,K", [("nvfp4", 33, 48), ("nvfp4", 5, 16), ("mxfp8", 33, 70), ("mxfp8", 3, 32)])
def test_dequantize_matches_the_bit_level_decoding(kind, N, K):
    """MXFP8 exactly; NVFP4 within two fp32 roundings (the factor scale * global has 24 bits, so its product with
    1.5, 3 or 6 rounds; ModelOpt's dequantize rounds it the same way)."""
    w, scale, g = make_weight(kind, N, K)
    got, ref = quant.dequantize_weight(w, scale, global_scale=g).double(), dequant_64(w, scale, g)
    if kind == "mxfp8":
        assert torch.equal(got, ref)
    else:
        assert ((got - ref).abs() <= 2.0 ** -23 * ref.abs()).all()
        assert not torch.equal(got, dequant_64(w ^ 1, scale, g))  # the check sees a moved code


# ---- DoRA on them, end to end (autograd), against fp64 ---------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dropout", [0.0, 0.3])
@pytest.mark.parametrize("chosen", ["reference", "auto", "native", "cublas", "triton"])
def test_dora_matches_fp64_on_the_dequantized_weight(kind, dtype, dropout, chosen, monkeypatch):
    """cublas: the GPU strategy (tests/kernels/test_dequant_micro.py); triton: the fused kernels, the weight unpacked
    in the main loop (triton_kernels/gemm.py); both on the GPU, or on CPU under Triton's interpreter. native: its fp16 code too (a
    GPU's; on CPU fp16 runs the reference's)."""
    monkeypatch.setattr(backends.module("native"), "FP16_REFERENCE_DEVICES", frozenset())
    if backends.unavailable_reason(chosen if chosen != "auto" else "reference", torch.device(DEVICE)):
        pytest.skip(backends.unavailable_reason(chosen, torch.device(DEVICE)))
    M, N, r = 7, 33, 3
    K = 48 if kind == "nvfp4" else 70  # MXFP8: a partial last block of 6
    w, scale, g = make_weight(kind, N, K)
    check_dora_end_to_end(w, scale, g, dtype, dropout, chosen, M, r, W0=dequant_64(w, scale, g))


def check_dora_end_to_end(w, scale, g, dtype, dropout, backend, M, r, s=1.75, W0=None, weight_norm=False,
                          device=DEVICE, **kw):
    """dora_fp8_linear's y and gradients on `backend` on `device` against fp64 on CPU on the dequantized weight W0
    (default: the package's dequantize_weight); weight_norm: the norm computed first by the reference backend and
    passed (so that the backend under test launches no norm); kw: to dora_fp8_linear."""
    if W0 is None:
        W0 = quant.dequantize_weight(w, scale, torch.float64, global_scale=g, **kw)
    N, K = W0.shape
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(M, K, generator=gen).to(dtype)
    A = torch.randn(r, K, generator=gen) / K ** 0.5
    B = torch.randn(N, r, generator=gen) * 0.1
    m = torch.rand(N, generator=gen) + 0.5
    b = (torch.randn(N, generator=gen) * 0.1).to(dtype)
    w, scale, g, bd = (None if t is None else t.to(device) for t in (w, scale, g, b))
    xl, Al, Bl, ml = (t.to(device, copy=True).requires_grad_() for t in (x, A, B, m))
    if weight_norm:
        kw["weight_norm"] = dorafp8.weight_norm(w, scale, Al.detach(), Bl.detach(), s, backend="reference",
                                                global_scale=g,
                                                block_size=kw.get("block_size", quant.DEFAULT_BLOCK))
    torch.manual_seed(5)
    y = dorafp8.dora_fp8_linear(xl, w, scale, Al, Bl, ml, s, bd, dropout_p=dropout, training=True, backend=backend,
                                global_scale=g, **kw)
    assert y.dtype == dtype and y.device == xl.device
    gy = torch.randn(y.shape, generator=gen).to(dtype)
    y.backward(gy.to(device))
    torch.manual_seed(5)  # the layer's mask, drawn again on its device (CUDA's dropout draws differently from CPU's)
    keep = ops.dropout_mask(xl.detach(), dropout).cpu() if dropout else None
    yr, leaves = dora_fp64(x, W0, A, B, m, s, b, xd=None if keep is None else (keep, dropout))
    yr.backward(gy.double())
    rel = tol(dtype)
    assert_close(y, yr, rel, "y")
    for name, got, ref in zip(("dx", "dA", "dB", "dm"), (xl.grad, Al.grad, Bl.grad, ml.grad), leaves):
        assert_close(got, ref.grad, rel, name)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chosen", ["auto", "triton"])
def test_plain_linear_and_weight_norm_match_fp64(kind, chosen):
    """The plain linear (no adapter: the kernels' other epilogue) and the weight norm; triton: its fused GEMMs."""
    if backends.unavailable_reason(chosen if chosen != "auto" else "reference", torch.device(DEVICE)):
        pytest.skip(backends.unavailable_reason(chosen, torch.device(DEVICE)))
    N, K = 17, 64
    w, scale, g = make_weight(kind, N, K, seed=3)
    W0 = dequant_64(w, scale, g)
    w, scale, g = w.to(DEVICE), scale.to(DEVICE), g.to(DEVICE) if g is not None else None
    x = torch.randn(5, K, dtype=torch.float32).to(DEVICE).requires_grad_()
    y = dorafp8.fp8_linear(x, w, scale, global_scale=g, backend=chosen)
    y.backward(torch.ones_like(y))
    assert_close(y, d(x) @ W0.T, tol(torch.float32), "y")
    assert_close(x.grad, torch.ones(5, N, dtype=torch.float64) @ W0, tol(torch.float32), "dx")
    A, B = torch.randn(2, K), torch.randn(N, 2)
    n = dorafp8.weight_norm(w, scale, A.to(DEVICE), B.to(DEVICE), 0.5, global_scale=g, backend=chosen)
    assert_close(n, (W0 + 0.5 * B.double() @ A.double()).norm(dim=1), tol(torch.float32), "n")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,K", [("reference", 64), ("native", 48), ("native", 80), ("triton", 48), ("triton", 80)])
def test_backend_functions_on_nan_bordered_inputs(kind, dtype, name, K, monkeypatch):
    """The forward and dgrad (with and without dropout) of the reference and of the Triton kernels (the weight
    unpacked in their main loop; on CPU in the interpreter) on strided activations whose rows sit in NaN-filled buffers,
    into NaN-filled outputs (the tests' poisoning): a read past a row or a tile left unwritten makes a NaN, which
    assert_close always fails. Odd M and N; K = 48 and 80 split the interpreter's reduction blocks unevenly (MXFP8: 80
    ends in a partial block of 16)."""
    if backends.unavailable_reason(name, torch.device(DEVICE)):
        pytest.skip(backends.unavailable_reason(name, torch.device(DEVICE)))
    be = backends.module(name)
    monkeypatch.setattr(backends.module("native"), "FP16_REFERENCE_DEVICES", frozenset())  # its GPU fp16 code
    M, N, r, s, p = 5, 19, 2, 0.5, 0.25
    w, scale, g = make_weight(kind, N, K, seed=4)
    W0 = dequant_64(w, scale, g)
    w, scale, g = w.to(DEVICE), scale.to(DEVICE), g.to(DEVICE) if g is not None else None
    gen = torch.Generator().manual_seed(2)
    x = act(torch.randn(M, K, generator=gen), dtype, DEVICE, True)
    mask = torch.rand(M, K, generator=gen) >= p
    xm = act(d(x).float() * mask, dtype, DEVICE, True)
    A, B = torch.randn(r, K, generator=gen) / 8, torch.randn(N, r, generator=gen) / 8
    m, n = torch.rand(N, generator=gen) + 0.5, torch.rand(N, generator=gen) + 0.5
    c = magnitude_scale(m, n).double()
    u = act(d(xm) / (1 - p) @ A.double().T, torch.float32, DEVICE, True)
    A, B, m, n, mask = (t.to(DEVICE) for t in (A, B, m, n, mask))
    y, z = be.forward(x=x, w8=w, scale=scale, block_size=128, bias=None, m=m, n=n, u=u, B=B, s=s, xm=xm, p=p,
                      need_z=True, z_dtype=dtype, act_quant="", global_scale=g)
    zr = d(xm) @ W0.T / (1 - p) + s * d(u) @ d(B).T
    assert_close(z, zr, tol(dtype), "z")
    lora = s * d(u) @ d(B).T
    assert_close(y, d(x) @ W0.T + (c - 1) * (zr - lora) + c * lora, tol(dtype), "y")
    gl = act(torch.randn(M, N, generator=gen), dtype, DEVICE, True)
    v = torch.randn(M, r, generator=gen).to(DEVICE)
    one = torch.ones((), dtype=torch.float32, device=DEVICE)
    dx = be.dgrad(gl=gl, rl=one, w8=w, scale=scale, block_size=128, v=v, A=A, s=s, mask=None, p=0.0, gb=None,
                  rb=None, act_quant="", global_scale=g)
    assert_close(dx, d(gl) @ W0 + s * d(v) @ d(A), tol(dtype), "dx")
    # dropout: dx = rb (gb W0) + mask / (1 - p) (rl (gl W0) + s v A), rl and rb not 1
    gb = act(torch.randn(M, N, generator=gen), dtype, DEVICE, True)
    rl, rb = torch.tensor(0.75, device=DEVICE), torch.tensor(1.25, device=DEVICE)
    dx = be.dgrad(gl=gl, rl=rl, w8=w, scale=scale, block_size=128, v=v, A=A, s=s, mask=mask, p=p, gb=gb, rb=rb,
                  act_quant="", global_scale=g)
    inner = 0.75 * d(gl) @ W0 + s * d(v) @ d(A)
    assert_close(dx, 1.25 * d(gb) @ W0 + d(mask) / (1 - p) * inner, tol(dtype), "dx (dropout)")


# ---- which backend computes them -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_auto_picks_a_backend_that_computes_the_kind(kind):
    """Every backend but the CUDA C++ one computes the microscaled kinds: "auto" resolves to native on CPU, as for
    fp8 (it ran the fp32 reference, several times slower; on a GPU: cublas, tests/kernels/test_dequant_micro.py, or
    native below sm_89); a backend named for them that lacks them is refused before any work."""
    assert backends.resolve("auto", torch.device("cpu"), frozenset({kind})) == "native"
    assert backends.resolve("auto", torch.device("cpu"), frozenset()) == "native"  # fp8 unchanged
    for name in backends.BACKENDS:
        assert (kind in backends.supports(name)) == (name != "cuda"), name
    with pytest.raises(ValueError, match="not supported by the cuda backend"):  # its refusal (on a GPU it runs on)
        with mock.patch.object(backends, "unavailable_reason", lambda name, device: None), \
                mock.patch.object(backends, "_prepare", lambda name, device: None):
            backends.resolve("cuda", torch.device("cpu"), frozenset({kind}))


# ---- refusals ----------------------------------------------------------------------------------------------------


def test_malformed_microscaled_arguments_are_refused_by_name():
    w, scale, g = make_weight("nvfp4", 4, 32)
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match=r"scale of a nvfp4 weight \[4, 32\] must have shape \[4, 2\]"):
        dorafp8.fp8_linear(x, w, scale[:, :1].contiguous(), global_scale=g)
    with pytest.raises(ValueError, match="holds 24 columns, not a multiple of 16"):
        dorafp8.fp8_linear(torch.randn(2, 24), w[:, :12].contiguous(), scale, global_scale=g)
    with pytest.raises(TypeError, match="global_scale of an NVFP4 weight must be one fp32 value"):
        dorafp8.fp8_linear(x, w, scale)
    w8, e = quant.quantize_mxfp8(torch.randn(4, 40))
    with pytest.raises(ValueError, match=r"scale of a mxfp8 weight \[4, 40\] must have shape \[4, 2\]"):
        dorafp8.fp8_linear(torch.randn(2, 40), w8, e[:, :1].contiguous())
    with pytest.raises(ValueError, match="global_scale is NVFP4's"):
        dorafp8.fp8_linear(torch.randn(2, 40), w8, e, global_scale=g)
    # ModelOpt's file holds the e8m0 bytes as uint8: the message says how to pass them (.float() gives the bytes'
    # values, which a [N, 1] per-row scale (K <= 32) would take silently)
    with pytest.raises(TypeError, match=r"an MXFP8 scale stored as uint8 e8m0 bytes .ModelOpt's. is "
                                        r"scale\.view\(torch\.float8_e8m0fnu\)"):
        dorafp8.fp8_linear(torch.randn(2, 40), w8, e.view(torch.uint8))
    if backends.unavailable_reason("triton", torch.device("cpu")) is None:  # its microscaled loop is W8A16 only
        with pytest.raises(ValueError, match="act_quant='rowwise' .W8A8. with an nvfp4 weight is not supported by "
                                             "the triton backend"):
            dorafp8.fp8_linear(x, w, scale, act_quant="rowwise", backend="triton", global_scale=g)


# ---- memory ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_reference_never_holds_the_dense_weight(kind):
    """The reference dequantizes one block of rows (16 MiB of fp32) at a time: a forward + backward of DoRA on a
    [4096, 2048] weight (32 MiB dense in fp32) never has that much alive beyond its inputs and outputs. Peak:
    about 3 blocks (the dequantized rows, NVFP4's int32 codes and its factor), 48 MiB at most."""
    N, K, r = 4096, 2048, 4
    w, scale, g = make_weight(kind, N, K)
    x = torch.randn(2, K, requires_grad=True)
    A, B = torch.randn(r, K, requires_grad=True), torch.zeros(N, r, requires_grad=True)
    m = torch.ones(N, requires_grad=True)
    with PeakTemporaries() as mode:
        y = dorafp8.dora_fp8_linear(x, w, scale, A, B, m, 1.0, global_scale=g)
        y.sum().backward()
    assert mode.largest < N * K * 4, mode.largest / MiB
    assert mode.peak <= 48 * MiB, mode.peak / MiB


@pytest.mark.parametrize("kind,K", [("mxfp8", 1000), ("nvfp4", 1024)])
def test_micro_rows_holds_no_second_copy_of_the_rows(kind, K):
    """micro_rows (native's and the reference's dequantize of a block of rows, per call) multiplied the rows by their
    block factors repeated to the rows' size: a second fp32 tensor as large as the result, written and read once more
    (and native divided by its fp16 cap in one more pass). Now they broadcast: what the call allocates besides its
    result stays under the result's size (NVFP4: plus unpack_e2m1's int32 codes, the same size again). The values:
    the bit-level decoding in fp64 (K = 1000: MXFP8's last block partial), and / div, within fp32's tolerance."""
    from torch.profiler import ProfilerActivity, profile

    w, scale, g = make_weight(kind, 256, K)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = quant.micro_rows(w, scale, g, 0, 256)
    total = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0 and e.cpu_parent is None)
    size = out.numel() * out.element_size()
    assert total - size < size * (2 if kind == "nvfp4" else 1)
    ref = dequant_64(w, scale, g)
    assert_close(out, ref, tol(torch.float32), "micro_rows")
    assert_close(quant.micro_rows(w, scale, g, 3, 200, div=torch.tensor(3.0)), ref[3:200] / 3, tol(torch.float32),
                 "micro_rows / div")
