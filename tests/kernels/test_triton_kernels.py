"""Triton backend (dorafp8.triton_kernels) against fp64 evaluations of the backend contract and against
dorafp8.backends.reference.

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

from tests.kernels._kernel_ref import (P, S, check_backward_pass, check_dgrad, check_forward,  # noqa: E402
                                       check_project, check_weight_norm, make_problem, shape_id)

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


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setenv("DORAFP8_POISON", "1")


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
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["nodrop", "dropout", "plain"])
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("act_quant", ["", "rowwise"], ids=["w8a16", "w8a8"])
def test_forward(device, shape, dtype, mode, scale, act_quant):
    M, K, N, r, strided = shape
    p = make_problem(M, K, N, r, dtype, device, scale, strided)
    check_forward(tk.forward, p, mode, has_bias=(M + r) % 2 == 0, act_quant=act_quant)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["nodrop", "dropout"])
def test_forward_fp32_adapters_on_bf16(device, mode):
    """The rank dtype wider than the compute dtype: the epilogue multiplies fp32 u and B, z comes back fp32."""
    p = make_problem(37, 50, 70, 3, torch.bfloat16, device, "row", True, rank_dtype=torch.float32)
    check_forward(tk.forward, p, mode, has_bias=True)


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
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["nodrop", "dropout", "plain"])
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("act_quant", ["", "rowwise"], ids=["w8a16", "w8a8"])
def test_dgrad(device, shape, dtype, mode, scale, act_quant):
    M, K, N, r, strided = shape
    p = make_problem(M, K, N, r, dtype, device, scale, strided)
    check_dgrad(tk.dgrad, p, mode, act_quant)


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
