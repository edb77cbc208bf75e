"""The microscaled kinds (NVFP4, MXFP8) on the cuBLAS strategy: its dequantize (triton_kernels/dequant_micro.py)
against the reference's fp32 dequantize bit for bit and against fp64 from the bytes (tests/kernels/test_microscaled.py's
bit-level decoding, independent of both), every code and scale byte, strided rows;
the plain linear and the weight norm through the strategy against fp64, and what backend="auto" picks. (DoRA forward +
backward through it against fp64 for every dtype and dropout setting: test_microscaled.py, backend "cublas".) Under the interpreter with outputs poisoned with NaN (an
unwritten tile fails), on shapes that are not multiples of its tiles (16 x 32 there)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import dorafp8  # noqa: E402
from dorafp8 import backends, quant  # noqa: E402
from dorafp8.backends import base  # noqa: E402
from tests._tolerance import assert_close, tol  # noqa: E402
from tests.kernels.test_microscaled import DTYPES, KINDS, dequant_64, make_weight  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if backends.unavailable_reason("cublas", torch.device(DEVICE)) is not None:
    pytest.skip(backends.unavailable_reason("cublas", torch.device(DEVICE)), allow_module_level=True)

from dorafp8.triton_kernels.dequant_micro import dequant_micro  # noqa: E402

# (N, K) per kind: one tile, several tiles with partial ones on both axes; MXFP8's K need not be a multiple of 32
SHAPES = {"nvfp4": [(1, 16), (37, 80), (19, 48)], "mxfp8": [(1, 1), (37, 70), (19, 33)]}


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(base, "POISON_OUTPUTS", True)


def _on(w, scale, g):
    return w.to(DEVICE), scale.to(DEVICE), None if g is None else g.to(DEVICE)


def _twin(w, scale, g, dtype):
    """The reference's W0 (dorafp8.quant.micro_rows, fp32), rounded once to dtype."""
    return quant.micro_rows(w, scale, g, 0, w.shape[0]).to(dtype)


@pytest.mark.parametrize("kind,shape", [(k, s) for k in KINDS for s in SHAPES[k]], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dequant_matches_the_reference_and_fp64(kind, shape, dtype):
    w, scale, g = _on(*make_weight(kind, *shape, seed=shape[0]))
    out = dequant_micro(w, scale, dtype, g)
    assert out.dtype == dtype and tuple(out.shape) == shape
    assert torch.equal(out, _twin(w, scale, g, dtype)), "not the reference's fp32 product rounded once"
    # NVFP4: the factor scale * g rounds in fp32 (dequant_64 rounds it once too), its product with the value once more
    rel = 2 * torch.finfo(dtype).eps if dtype != torch.float32 else 2.0 ** -23
    ref = dequant_64(w, scale, g)
    assert ((out.double().cpu() - ref).abs() <= rel * ref.abs()).all(), f"W0 {kind} {dtype}"


def test_every_code_and_scale_byte():
    """The 16 e2m1 codes in both nibbles, and the e8m0 bytes 0 (2^-127, a subnormal), 1, 127, 254 and 255 (NaN)."""
    codes = torch.arange(16, dtype=torch.uint8)
    packed = torch.stack([(codes[1::2] << 4) | codes[0::2], (codes[0::2] << 4) | codes[1::2]]).repeat(1, 2)
    e4 = torch.tensor([[1.0, 0.015625], [448.0, 0.5]]).to(quant.E4M3)  # 2 rows x 32 columns: 2 blocks of 16
    g = torch.tensor(0.75)
    w, e4, g = _on(packed, e4, g)
    assert torch.equal(dequant_micro(w, e4, torch.float32, g), quant.micro_rows(w, e4, g, 0, 2))
    assert torch.equal(dequant_micro(w, e4, torch.float32, g).double().cpu(), dequant_64(w, e4, g))
    e = torch.tensor([[0, 1, 127], [254, 255, 126]], dtype=torch.uint8).view(quant.E8M0)
    w8 = torch.full((2, 70), 1.5).to(quant.E4M3)
    w8, e, _ = _on(w8, e, None)
    out = dequant_micro(w8, e, torch.float32)
    ref = quant.micro_rows(w8, e, None, 0, 2)
    assert torch.equal(out.isnan(), ref.isnan()) and out.isnan()[1, 32:64].all()
    assert torch.equal(out.nan_to_num(), ref.nan_to_num())
    assert out[0, 0].item() == 1.5 * 2.0 ** -127 and out[1, 0].item() == 1.5 * 2.0 ** 127


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_rows(kind, dtype):
    """A block of a weight's rows (the weight norm's walk)."""
    w, scale, g = _on(*make_weight(kind, 50, 64, seed=7))
    out = dequant_micro(w[9:30], scale[9:30], dtype, g)
    assert torch.equal(out, _twin(w[9:30], scale[9:30], g, dtype))


def test_refusals():
    w, scale, g = _on(*make_weight("nvfp4", 4, 32))
    with pytest.raises(ValueError, match="dtype must be"):
        dequant_micro(w, scale, torch.float64, g)
    with pytest.raises(ValueError, match="global_scale must be one fp32 value"):
        dequant_micro(w, scale, torch.float16)
    with pytest.raises(ValueError, match="neither NVFP4"):
        dequant_micro(w, scale.float(), torch.float16, g)


# ---- DoRA on the cuBLAS strategy ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_plain_linear_and_weight_norm_on_cublas(kind):
    N, K = 70, 48  # the norm's walk over rows in one block; its fp32 W0 + s B A, against fp64
    w, scale, g = make_weight(kind, N, K, seed=3)
    W0 = dequant_64(w, scale, g)
    wd, sd, gd = _on(w, scale, g)
    x = torch.randn(5, K, dtype=torch.float16)
    xl = x.to(DEVICE).requires_grad_()
    y = dorafp8.fp8_linear(xl, wd, sd, backend="cublas", global_scale=gd)
    y.backward(torch.ones_like(y))
    assert_close(y, x.double() @ W0.T, tol(torch.float16), "y")
    assert_close(xl.grad, torch.ones(5, N, dtype=torch.float64) @ W0, tol(torch.float16), "dx")
    A, B = torch.randn(2, K), torch.randn(N, 2)
    n = dorafp8.weight_norm(wd, sd, A.to(DEVICE), B.to(DEVICE), 0.5, backend="cublas", global_scale=gd)
    assert_close(n, (W0 + 0.5 * B.double() @ A.double()).norm(dim=1), tol(torch.float32), "n")


@pytest.mark.parametrize("kind", KINDS)
def test_auto_picks_cublas_on_cuda_and_native_on_cpu(kind, monkeypatch):
    """The static order on a GPU (what runs unraced, and the race's only candidate): triton and cuda lack the kind,
    so the cuBLAS strategy; fp8 keeps triton first. On CPU native (PyTorch's matmul in the compute dtype), which
    computes the microscaled kinds since 760bdf3."""
    cuda = torch.device("cuda")
    monkeypatch.delenv("DORAFP8_BACKEND", raising=False)
    monkeypatch.setattr(backends, "unavailable_reason", lambda name, device: None)
    assert backends.resolve("auto", cuda, frozenset({kind})) == "cublas"
    assert backends.resolve("auto", cuda, frozenset({kind, "fp32"})) == "cublas"
    assert backends.resolve("auto", cuda, frozenset()) == "triton"
    assert backends.resolve("auto", torch.device("cpu"), frozenset({kind})) == "native"
    with pytest.raises(ValueError, match="act_quant='rowwise'"):  # W8A8 on these kinds: only the reference
        backends.resolve("cublas", cuda, frozenset({kind, "rowwise"}))
