"""CUDA C++ backend (csrc/ -> dorafp8._C, wrapped by dorafp8.cuda_backend) against fp64 evaluations of DORA_MATH.md
and against dorafp8.reference.

On a machine without a GPU only the build is checked: if the extension is built it must import and its binding's
argument checks must answer (without it these tests skip with the reason, unless DORAFP8_REQUIRE_CUDA_EXT=1, which
.ci/run sets after force-building it), and the backend must say why it cannot run on CPU. The kernel tests need a CUDA GPU: every op in bf16,
fp16 and fp32, odd shapes (M = 1, 37; N = 70, 129; K = 50, 4096; r = 1 .. 256), bias, dropout, per-row scales, strided
activations, and outputs that start as NaN (DORAFP8_POISON=1) so that a tile the kernel never writes fails.
"""

import os

import pytest
import torch

import dorafp8.cuda_backend as cb
import dorafp8.reference as reference
from dorafp8 import backends, quantize_e4m3
from _kernel_ref import S, assert_close, check_dgrad, check_forward, d, forward_64, make_problem, shape_id, tol, weight_norm_64, w0_64

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda"
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU: the CUDA kernels cannot run on CPU")
REQUIRE_EXT = os.environ.get("DORAFP8_REQUIRE_CUDA_EXT") == "1"

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (M, K, N, r, strided). M = 1 and 37 (one ragged 64-row tile), 65 and 130 (the 128-row tiles, ragged), 300 (several);
# K = 50 and 257 (not a multiple of 16: byte-wise fp8 copies), 64/96/128/1000/4096 (16-byte copies, long pipelines);
# N = 70, 129 (odd: no paired stores), 383, 700, 1024 (several 128-column tiles); r = 1, 3, 8, 16, 40, 72, 128, 256
# (one to eight rank chunks of 32); `strided` puts the activations in wider buffers (row stride = width + 7, which
# also makes them unaligned for 16-byte copies).
SHAPES = [
    (1, 50, 70, 1, False),
    (37, 50, 70, 3, True),
    (37, 4096, 70, 16, False),
    (37, 64, 48, 128, True),
    (65, 128, 129, 1, False),
    (130, 96, 200, 40, True),
    (129, 257, 383, 256, False),
    (300, 1000, 700, 72, True),
    (4, 4096, 1024, 8, False),
]



# ------------------------------------------------------------------------------------------------------ helpers

@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setenv("DORAFP8_POISON", "1")


# ------------------------------------------------------------------------------------------------------ CPU tests

def _require_extension():
    """The built extension, or a skip saying why it is absent. DORAFP8_REQUIRE_CUDA_EXT=1 (set by .ci/run after its
    forced build) turns the skip into a failure, so that a broken build cannot pass as "not built"."""
    if cb._C is None:
        why = f"dorafp8._C does not import ({cb._IMPORT_ERROR}; at install: {cb.build_note() or 'unknown'})"
        if REQUIRE_EXT:
            pytest.fail(f"{why}; DORAFP8_REQUIRE_CUDA_EXT=1 requires it. Build it with: {cb.BUILD_COMMAND}")
        pytest.skip(f"{why}: the CUDA extension is optional (build it with: {cb.BUILD_COMMAND})")
    return cb._C


def test_extension_built():
    """CI force-builds the extension: it must import and export the kernels' entry points."""
    C = _require_extension()
    for name in ("weight_norm", "forward", "dgrad", "kernel_image_error"):
        assert callable(getattr(C, name, None)), f"dorafp8._C lacks {name}"


def test_binding_checks_device():
    """The binding's checks run before any launch, so they answer on CPU too, naming the argument."""
    C = _require_extension()
    w8 = torch.zeros(4, 16).to(torch.float8_e4m3fn)
    x, scale, y = torch.zeros(2, 16), torch.ones(()), torch.empty(2, 4)
    with pytest.raises(RuntimeError, match="x must be a CUDA tensor"):
        C.forward(x, w8, scale, None, None, None, None, 0.0, None, y, None)
    with pytest.raises(RuntimeError, match="g must be a CUDA tensor"):
        C.dgrad(torch.zeros(2, 4), w8, scale, scale, None, None, None, 0.0, None, 0.0, torch.empty(2, 16))
    with pytest.raises(RuntimeError, match="w8 must be a CUDA tensor"):
        C.weight_norm(w8, scale, torch.zeros(1, 16), torch.zeros(4, 1), 1.0, torch.empty(4))


def test_unavailable_reason_cpu(monkeypatch):
    # On CPU tensors the reason is the device, whether or not the extension is built: building cannot help there.
    for built in (True, False):
        if not built:
            monkeypatch.setattr(cb, "_C", None)
            monkeypatch.setattr(cb, "_IMPORT_ERROR", ImportError("No module named 'dorafp8._C'"))
        reason = cb.unavailable_reason(torch.device("cpu"))
        assert "CUDA devices only" in reason and "pip install" not in reason
    # On a CUDA device without the extension, the reason names the command that builds it.
    reason = cb.unavailable_reason(torch.device("cuda"))
    assert cb.BUILD_COMMAND in reason and "dorafp8._C" in reason
    assert "DORAFP8_FORCE_CUDA_BUILD=1 pip install -e . --no-build-isolation" == cb.BUILD_COMMAND


def test_registry_on_cpu():
    assert isinstance(backends.unavailable_reason("cuda", torch.device("cpu")), str)
    assert "cuda" not in backends.available_backends("cpu")


# ------------------------------------------------------------------------------------------------------ GPU tests

@gpu
def test_available_on_gpu():
    assert cb.unavailable_reason(torch.device("cuda")) is None, cb.unavailable_reason(torch.device("cuda"))
    assert "cuda" in backends.available_backends("cuda")


@gpu
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("row_wise", [False, True], ids=["tensor-scale", "row-scale"])
@pytest.mark.parametrize("adapter_dtype", DTYPES, ids=str)
def test_weight_norm(shape, row_wise, adapter_dtype):
    M, K, N, r, strided = shape
    p = make_problem(M, K, N, r, adapter_dtype, DEVICE, row_wise, strided)
    A, B = p["A"], p["B"]
    if strided:  # adapters may come with any strides (the wrapper makes them contiguous)
        B = B.T.contiguous().T
    n = cb.weight_norm(p["w8"], p["sigma"], A, B, S)
    assert n.dtype == torch.float32 and n.shape == (N,)
    assert_close(n, weight_norm_64(p["w8"], p["sigma"], A, B, S), tol(torch.float32), "weight_norm vs fp64")
    assert_close(n, reference.weight_norm(p["w8"], p["sigma"], A, B, S), 2 * tol(torch.float32),
                 "weight_norm vs reference")


@gpu
def test_weight_norm_mixed_adapter_dtypes():
    p = make_problem(3, 96, 40, 5, torch.float32, DEVICE, False, False)
    A, B = p["A"], p["B"].to(torch.bfloat16)
    n = cb.weight_norm(p["w8"], p["sigma"], A, B, S)
    assert_close(n, weight_norm_64(p["w8"], p["sigma"], A, B, S), tol(torch.float32), "weight_norm fp32 A, bf16 B")


@gpu
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["nodrop", "dropout", "plain"])
@pytest.mark.parametrize("row_wise", [False, True], ids=["tensor-scale", "row-scale"])
@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "nobias"])
def test_forward(shape, dtype, mode, row_wise, has_bias):
    M, K, N, r, strided = shape
    p = make_problem(M, K, N, r, dtype, DEVICE, row_wise, strided)
    check_forward(cb.forward, p, mode, has_bias, dtype)


@gpu
@pytest.mark.parametrize("mode", ["nodrop", "dropout"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_without_z(mode, dtype):
    p = make_problem(5, 40, 36, 3, dtype, DEVICE, False, False)
    xd = p["xd"] if mode == "dropout" else None
    u = p["u"] if mode == "dropout" else p["u_nodrop"]
    y, z = cb.forward(p["x"], p["w8"], p["sigma"], p["bias"], p["c"], u, p["B"], S, xd, False)
    assert z is None
    y64, _ = forward_64(p["x"], p["w8"], p["sigma"], p["bias"], p["c"], u, p["B"], S, xd)
    assert_close(y, y64, tol(dtype), f"forward[{mode}, need_z=False] y vs fp64")


@gpu
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["nodrop", "dropout", "plain"])
@pytest.mark.parametrize("row_wise", [False, True], ids=["tensor-scale", "row-scale"])
def test_dgrad(shape, dtype, mode, row_wise):
    M, K, N, r, strided = shape
    p = make_problem(M, K, N, r, dtype, DEVICE, row_wise, strided)
    check_dgrad(cb.dgrad, p, mode, dtype)


@gpu
@pytest.mark.parametrize("op", ["forward", "dgrad"])
def test_int64_offsets(op):
    """M * K > 2^31 elements: row offsets must be computed in 64 bits. Checks the last rows only."""
    M, K, N = (1 << 16) + 3, (1 << 15) + 16, 24
    need = 2 * M * K * 2 + (1 << 30)
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free GPU memory")
    gen = torch.Generator().manual_seed(1)
    w8, sigma = quantize_e4m3(torch.randn(N, K, generator=gen) * 0.05)
    w8, sigma = w8.to(DEVICE), sigma.to(DEVICE)
    tail = slice(M - 40, M)
    if op == "forward":
        x = torch.zeros(M, K, dtype=torch.bfloat16, device=DEVICE)
        x[tail] = torch.randn(40, K, generator=gen).to(torch.bfloat16).to(DEVICE)
        y, _ = cb.forward(x, w8, sigma, None, None, None, None, S, None, False)
        assert_close(y[tail], d(x[tail]) @ w0_64(w8, sigma).T, tol(torch.bfloat16), "forward, last rows")
        assert not torch.isnan(y[: M - 40]).any()
    else:
        g = torch.randn(M, N, generator=gen).to(torch.bfloat16).to(DEVICE)
        dx = cb.dgrad(g, w8, sigma, None, None, None, S, None, 0.0)
        assert_close(dx[tail], d(g[tail]) @ w0_64(w8, sigma), tol(torch.bfloat16), "dgrad, last rows")


@gpu
def test_rejects_bad_arguments():
    p = make_problem(2, 32, 16, 1, torch.float32, DEVICE, False, False)
    y = torch.empty(2, 16, device=DEVICE)
    with pytest.raises(RuntimeError, match="w8 must be"):
        cb._C.forward(p["x"], p["w8"].float(), p["sigma"].reshape(1), None, None, None, None, S, None, y, None)
    with pytest.raises(RuntimeError, match="scale must have one element"):
        cb._C.forward(p["x"], p["w8"], torch.ones(3, device=DEVICE), None, None, None, None, S, None, y, None)
    with pytest.raises(RuntimeError, match="y must have shape"):
        cb._C.forward(p["x"], p["w8"], p["sigma"].reshape(1), None, None, None, None, S, None, y[:1], None)
    with pytest.raises(RuntimeError, match="u and B are required"):
        cb._C.forward(p["x"], p["w8"], p["sigma"].reshape(1), None, p["c"], None, None, S, None, y, None)
