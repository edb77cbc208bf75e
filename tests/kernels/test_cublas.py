"""The cuBLAS strategy (dorafp8/cublas_backend.py): dequantize one layer to a transient, platform matmul, fused
Triton epilogues. Checked with the same fp64 / reference checks as every backend (tests/kernels/_kernel_ref.py); on CPU
the matmuls are CPU ones and the epilogues run in Triton's interpreter."""

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.kernels._kernel_ref import (check_dgrad, check_folded_dgrad, check_forward, make_problem,  # noqa: E402
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


@pytest.mark.parametrize("shape", SHAPES[1:], ids=shape_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", ["nodrop", "dropout"])
@pytest.mark.parametrize("scale", ["tensor", "row", "block"])
def test_folded_dgrad(shape, dtype, mode, scale):
    """The fold the strategy runs by default (gl's factors on the dequantized weight's rows) against fp64 and the
    reference's unfolded dgrad; 16-bit activations with PEFT's fp32 adapters too."""
    M, K, N, r, strided = shape
    for rdt in {dtype, torch.float32}:
        p = make_problem(M, K, N, r, dtype, DEVICE, scale, strided, rank_dtype=rdt)
        check_folded_dgrad(cb.backward_pass, cb.dgrad, p, mode)


def test_folds_by_default(monkeypatch):
    monkeypatch.delenv("DORAFP8_FOLD_DGRAD", raising=False)
    assert backends.folds_dgrad("cublas") and not backends.folds_dgrad("triton")


def test_refuses_w8a8():
    p = make_problem(3, 32, 16, 2, torch.float32, DEVICE, "tensor", False)
    with pytest.raises(ValueError, match="not supported by the cublas backend"):
        check_forward(cb.forward, p, "nodrop", has_bias=False, act_quant="rowwise")


# The bytes the speed predictions rest on (dorafp8/kernel_report/predict.py, from dorafp8/_launches.py's recorder): a
# dry run of one forward + backward (nothing runs; the launchers plan for an H100), each launch's bytes checked
# against the sizes of the tensors it was handed, and the strategy's launches against the plan of the module
# docstring, so that neither can drift without this failing.
PLAN = ["triton:project_kernel", "triton:dequant_w8_kernel", "aten:mm.default", "triton:fwd_epilogue_kernel",
        "triton:dora_bwd_pass_kernel", "triton:dora_bwd_finish_kernel", "triton:dequant_w8_kernel", "aten:mm.default",
        "triton:dgrad_epilogue_kernel", "triton:project_grad_kernel", "triton:sum_splits_kernel"]


@pytest.mark.parametrize("kind", ["tensor", "row"])
def test_dry_run_bytes_are_the_tensors_sizes(kind, monkeypatch):
    import dorafp8
    from dorafp8._launches import LaunchRecorder, dry_run

    M, N, K, r = 1024, 512, 768, 16
    w8 = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    scale = torch.ones(()) if kind == "tensor" else torch.ones(N)
    leaves = [torch.empty(M, K, dtype=torch.bfloat16), torch.empty(r, K), torch.empty(N, r), torch.ones(N)]
    x, A, B, m = (t.requires_grad_() for t in leaves)
    n, gy = torch.ones(N), torch.empty(M, N, dtype=torch.bfloat16)
    monkeypatch.setattr(base, "POISON_OUTPUTS", False)  # a GPU run's launches: no NaN fills
    with LaunchRecorder() as rec, dry_run(rec, 132, 2):
        dorafp8.dora_fp8_linear(x, w8, scale, A, B, m, 2.0, backend="cublas", weight_norm=n).backward(gy)
    assert rec.names() == PLAN, rec.table()
    for launch in rec.launches:
        sizes = sum(math.prod(shape) * torch.tensor([], dtype=dt).element_size() for shape, dt in launch.shapes)
        assert launch.nbytes == sizes, f"{launch.name}: {launch.nbytes} bytes recorded, its tensors hold {sizes}"
    # by hand, from the shapes: the dequantize reads W8 (1 byte a weight) and the scale and writes W (2 bytes) and its
    # factors (2 floats, or N + 1 per row), the dgrad's also gl's factors (the fold: N floats); each matrix product
    # reads its operands and writes its result once
    dequant = N * K * 3 + (4 + 8 if kind == "tensor" else 4 * N + 4 * (N + 1))
    assert [lc.nbytes for lc in rec.launches if lc.name == "triton:dequant_w8_kernel"] == [dequant, dequant + 4 * N]
    assert [lc.nbytes for lc in rec.launches if lc.name == "aten:mm.default"] == [
        2 * (M * K + N * K + M * N), 2 * (M * N + N * K + M * K)]
