"""Triton backend (dorafp8.triton_kernels) against fp64 evaluations of DORA_MATH.md and against dorafp8.reference.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (slow: shapes stay tiny, a few tens per dim,
yet cross every block edge of the interpreter's single 16 x 32 x 32 config). With a GPU the same tests run on cuda,
plus a few larger shapes, and bf16 (whose tl.dot the interpreter cannot execute) is checked too.
Every output starts as NaN (DORAFP8_POISON=1) so that a tile the kernel never writes fails.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of the kernels

import dorafp8.reference as reference  # noqa: E402
from _kernel_ref import P, S, assert_close, check_dgrad, check_forward, forward_64, make_problem, shape_id, tol, weight_norm_64  # noqa: E402

tk = pytest.importorskip("dorafp8.triton_kernels")

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# cpu under the interpreter, cuda when a GPU is present (both if someone interprets on a GPU machine).
DEVICES = [dev for dev, ok in (("cpu", INTERPRET), ("cuda", HAS_CUDA)) if ok] or [
    pytest.param("cpu", marks=pytest.mark.skip(reason="no CUDA GPU and TRITON_INTERPRET != 1"))]
DTYPES = [
    torch.float32,
    torch.float16,
    # In the interpreter bf16 tiles are upcast to fp32 before tl.dot (its bf16 dot is broken, triton #11584), so
    # there this checks the bf16 loads, stores and masks; the bf16 tensor-core dot itself is checked on a GPU.
    torch.bfloat16,
]

# (M, K, N, r, strided): M = 1; M, K, N crossing the 16/32/32 interpreter blocks with ragged edges; K, N exact
# multiples of the blocks; r = 1, 3, 16 (one padded rank chunk) and 20 (two chunks of 16 in the interpreter);
# `strided` puts the activations in wider buffers so their row stride differs from their width.
SHAPES = [
    (1, 50, 70, 1, False),
    (37, 50, 70, 3, True),
    (37, 64, 48, 16, False),
    (20, 33, 17, 20, True),
]
if HAS_CUDA:  # real GPU configs: larger tiles, several K steps, r over 64 (two rank chunks), r = 256
    SHAPES += [(300, 1000, 700, 72, True), (129, 257, 383, 256, False), (4, 4096, 1024, 8, False)]



# ------------------------------------------------------------------------------------------------------ helpers

@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setenv("DORAFP8_POISON", "1")


# ------------------------------------------------------------------------------------------------------ tests

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("row_wise", [False, True], ids=["tensor-scale", "row-scale"])
@pytest.mark.parametrize("adapter_dtype", DTYPES, ids=str)
def test_weight_norm(device, shape, row_wise, adapter_dtype):
    M, K, N, r, strided = shape
    p = make_problem(M, K, N, r, adapter_dtype, device, row_wise, strided)
    A, B = p["A"], p["B"]
    if strided:  # A, B may come with any strides: a transposed B view
        B = B.T.contiguous().T
    n = tk.weight_norm(p["w8"], p["sigma"], A, B, S)
    assert n.dtype == torch.float32 and n.shape == (N,)
    # Output is fp32 whatever the adapter dtype (16-bit products are exact, accumulation is fp32).
    assert_close(n, weight_norm_64(p["w8"], p["sigma"], A, B, S), tol(torch.float32), "weight_norm vs fp64")
    assert_close(n, reference.weight_norm(p["w8"], p["sigma"], A, B, S), 2 * tol(torch.float32),
                 "weight_norm vs reference")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["nodrop", "dropout", "plain"])
@pytest.mark.parametrize("row_wise", [False, True], ids=["tensor-scale", "row-scale"])
@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "nobias"])
def test_forward(device, shape, dtype, mode, row_wise, has_bias):
    M, K, N, r, strided = shape
    p = make_problem(M, K, N, r, dtype, device, row_wise, strided)
    check_forward(tk.forward, p, mode, has_bias, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["nodrop", "dropout"])
def test_forward_without_z(device, mode):
    p = make_problem(5, 40, 36, 3, torch.float32, device, False, False)
    xd = p["xd"] if mode == "dropout" else None
    u = p["u"] if mode == "dropout" else p["u_nodrop"]
    y, z = tk.forward(p["x"], p["w8"], p["sigma"], p["bias"], p["c"], u, p["B"], S, xd, False)
    assert z is None
    y64, _ = forward_64(p["x"], p["w8"], p["sigma"], p["bias"], p["c"], u, p["B"], S, xd)
    assert_close(y, y64, tol(torch.float32), f"forward[{mode}, need_z=False] y vs fp64")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["nodrop", "dropout", "plain"])
@pytest.mark.parametrize("row_wise", [False, True], ids=["tensor-scale", "row-scale"])
def test_dgrad(device, shape, dtype, mode, row_wise):
    M, K, N, r, strided = shape
    p = make_problem(M, K, N, r, dtype, device, row_wise, strided)
    check_dgrad(tk.dgrad, p, mode, dtype)


def test_unavailable_reason(monkeypatch):
    if INTERPRET:
        assert tk.unavailable_reason(torch.device("cpu")) is None
        from dorafp8 import backends

        assert backends.unavailable_reason("triton", torch.device("cpu")) is None
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    reason = tk.unavailable_reason(torch.device("cpu"))
    assert isinstance(reason, str) and "TRITON_INTERPRET" in reason
    if not HAS_CUDA:
        assert isinstance(tk.unavailable_reason(torch.device("cuda")), str)


@pytest.mark.parametrize("device", DEVICES)
def test_rejects_bad_weight(device):
    p = make_problem(2, 32, 16, 1, torch.float32, device, False, False)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        tk.forward(p["x"], p["w8"].float(), p["sigma"], None, None, None, None, S, None, False)
    with pytest.raises(ValueError, match="scale"):
        tk.dgrad(p["g"], p["w8"], p["sigma"].double(), None, None, None, S, None, P)
    with pytest.raises(ValueError, match="scale"):
        tk.weight_norm(p["w8"], torch.ones(3, device=device), p["A"], p["B"], S)

