"""The one-pass dequantize of the cuBLAS strategy (triton_kernels/dequant.py dequant_w8): against fp64 on every scale
kind and dtype, against its PyTorch twin bit for bit, under the interpreter with its outputs poisoned with NaN (an
unwritten tile or factor fails), on shapes that are not multiples of its tiles."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests._tolerance import assert_close  # noqa: E402
from tests.kernels._kernel_ref import quantize_e4m3  # noqa: E402

from dorafp8 import backends  # noqa: E402
from dorafp8.backends import base  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if backends.unavailable_reason("triton", torch.device(DEVICE)) is not None:
    pytest.skip(backends.unavailable_reason("triton", torch.device(DEVICE)), allow_module_level=True)

from dorafp8.quant import scale_kind, scale_rows  # noqa: E402
from dorafp8.triton_kernels.dequant import dequant_w8  # noqa: E402

# (N, K, block size): odd sizes across several tiles (16 x 32 in the interpreter), a block size that is no multiple of
# 16, more rows than the kappa scan's chunk (64 in the interpreter)
SHAPES = [(1, 1, 128), (37, 70, 16), (130, 45, 20)]


def dequant_w8_ref(w8: torch.Tensor, scale: torch.Tensor, block_size: int, dtype: torch.dtype):
    """The PyTorch twin of dequant_w8 (fp32 products, rounded once to dtype; fac as the epilogues take it)."""
    N, K = w8.shape
    kind = scale_kind(scale)
    if kind == "row":
        kappa = scale.abs().amax() if N else scale.new_ones(())
        f = kappa
        fac = torch.cat([scale / kappa, (1.0 / kappa).reshape(1)])
    else:
        f = scale_rows(scale, block_size, 0, N, K) if kind == "block" else scale
        fac = torch.ones(2, dtype=torch.float32, device=w8.device)
    w = w8.float() * f
    return w.to(dtype), fac


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(base, "POISON_OUTPUTS", True)


def _weight(N, K, kind, block):
    gen = torch.Generator().manual_seed(N * 1000 + K)
    W = torch.randn(N, K, generator=gen) * torch.linspace(0.1, 3.0, N)[:, None]
    w8, sigma = quantize_e4m3(W, per_row=kind == "row", block_size=block if kind == "block" else None)
    if kind == "row":
        sigma = sigma * torch.linspace(-1.0, 2.0, N)  # a negative scale: kappa is the largest |scale|
    return w8.to(DEVICE), sigma.to(DEVICE)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["tensor", "row", "block"])
def test_dequant_against_fp64(shape, dtype, kind):
    N, K, block = shape
    w8, scale = _weight(N, K, kind, block)
    w, fac = dequant_w8(w8, scale, block, dtype)
    assert w.dtype == dtype and tuple(w.shape) == (N, K) and fac.dtype == torch.float32
    ref, ref_fac = dequant_w8_ref(w8, scale, block, dtype)
    assert torch.equal(w, ref), "not the twin's fp32 product rounded once"
    assert torch.equal(fac, ref_fac), f"factors {fac} != {ref_fac}"
    # fp64: W times what the epilogue still applies (per row fac[j]) is W0 = scale * w8, to the dtype's rounding
    s64 = scale.double().cpu()
    if kind == "block":
        f = s64.repeat_interleave(block, 0).repeat_interleave(block, 1)[:N, :K]
    else:
        f = s64.reshape(-1, 1) if kind == "row" else s64
    w0 = w8.double().cpu() * f
    applied = fac[:-1].double().cpu().reshape(-1, 1) if kind == "row" else 1.0
    assert_close(w.double().cpu() * applied, w0, 2 * torch.finfo(dtype).eps, f"W0 {kind} {dtype}")
    if kind == "row":  # fac[-1] = 1 / kappa: what the dgrad epilogue divides out of gl W
        assert abs(fac[-1].item() * s64.abs().max().item() - 1) < 1e-6


def test_empty_and_bad_dtype():
    w8, scale = _weight(4, 8, "row", 16)
    w, fac = dequant_w8(w8[:0], scale[:0], 16, torch.bfloat16)
    assert w.shape == (0, 8) and torch.equal(fac, torch.ones(1, device=DEVICE))
    with pytest.raises(ValueError, match="dtype must be"):
        dequant_w8(w8, scale, 16, torch.float64)
