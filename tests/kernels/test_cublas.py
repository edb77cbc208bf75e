"""The cuBLAS strategy (dorafp8/cublas_backend.py): dequantize one layer to a transient, platform matmul, fused
Triton epilogues. Checked with the same fp64 / reference checks as every backend (tests/kernels/_kernel_ref.py); on CPU
the matmuls are CPU ones and the epilogues run in Triton's interpreter."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.kernels._kernel_ref import check_dgrad, check_forward, make_problem, shape_id  # noqa: E402

from dorafp8 import backends  # noqa: E402

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
    monkeypatch.setenv("DORAFP8_POISON", "1")


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
