"""The CUDA kernels of csrc/ run on CPU under an emulator (tests/kernels/cuda_emu/), through the CUDA backend's own
contract adapter (dorafp8.backends.cuda.CudaBackend), against fp64 evaluations of the contract and
dorafp8.backends.reference (the shared checks of tests/kernels/_kernel_ref.py). This is how CI, which has no GPU,
executes the real kernel source.

The emulator (tests/kernels/cuda_emu/emu_cuda.h) compiles the kernel files (setup.py's CUDA_SOURCES, each a translation
unit of its own, as in the extension build) with g++ (-DDORA_EMULATE): one OS thread per CUDA thread; warp collectives
(ldmatrix, mma.m16n8k16, shuffles) computed from the PTX ISA fragment layouts, written independently of the kernels;
cp.async copies landing at wait_group time; a shared-memory race checker (same-barrier conflicts, reads of in-flight
cp.async data), whose findings count as failures. Inputs are copied into exactly sized buffers and outputs start as
NaN bytes. It shares its reading of the PTX ISA with the kernels' author, so it
does not replace a GPU run (tests/kernels/test_cuda.py); it does catch indexing, masking, pipelining and epilogue bugs.
"""

import ctypes
import os
import shutil
import subprocess
from types import SimpleNamespace

import pytest
import torch

from tests._tolerance import assert_close, tol
from tests.kernels._kernel_ref import (P, S, check_backward_pass, check_dgrad, check_forward, check_project,
                                       check_weight_norm, forward_64, make_problem)

import dorafp8
import dorafp8.backends.reference as reference
from dorafp8 import backends
from dorafp8.backends import cuda as cuda_backend
from dorafp8.backends.cuda import CudaBackend
from dorafp8.kernel_report import cuda_sources

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CUDA_HOME = os.environ.get("CUDA_HOME", "/usr/local/cuda")
CUDA_INCLUDE = os.path.join(CUDA_HOME, "include")
if shutil.which("g++") is None or not os.path.exists(os.path.join(CUDA_INCLUDE, "cuda_fp8.h")):
    pytest.skip("the CUDA emulator needs g++ and the CUDA toolkit headers (cuda_fp8.h)", allow_module_level=True)

PTR, I64, I32, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
DT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    so = str(tmp_path_factory.mktemp("emu") / "libdoraemu.so")
    cxx = ["g++", "-std=c++20", "-O1", "-fPIC", "-DDORA_EMULATE", f"-I{CUDA_INCLUDE}",
           f"-I{os.path.join(HERE, 'cuda_emu')}", f"-I{os.path.join(ROOT, 'csrc')}", "-x", "c++"]
    # Each kernel file a translation unit of its own, as in the extension build; compiled side by side.
    sources = [os.path.join(HERE, "cuda_emu", "emu_api.cpp"),
               *[os.path.join(ROOT, "csrc", f) for f in cuda_sources()]]
    objects = [f"{so}.{i}.o" for i in range(len(sources))]
    procs = [subprocess.Popen([*cxx, "-c", src, "-o", obj]) for src, obj in zip(sources, objects)]
    assert all(p.wait() == 0 for p in procs), "building the emulator failed (g++'s messages above)"
    subprocess.run(["g++", "-shared", "-Wl,-Bsymbolic", *objects, "-o", so, "-lpthread"], check=True)
    L = ctypes.CDLL(so)
    L.emu_weight_norm.argtypes = [PTR, PTR, I32, PTR, PTR, I32, I64, I64, I32, F32, PTR, I32]
    L.emu_weight_norm.restype = ctypes.c_long
    L.emu_forward.argtypes = [I32, PTR, I64, PTR, I64, PTR, PTR, I32, PTR, PTR, PTR, PTR, I32, I64, I64, I64, I32,
                              F32, F32, PTR, PTR, I32, I32]
    L.emu_forward.restype = ctypes.c_long
    L.emu_dgrad.argtypes = [I32, PTR, I64, PTR, I64, PTR, PTR, PTR, PTR, I32, PTR, PTR, I32, PTR, I64, I64, I64, I64,
                            I32, F32, F32, PTR, I32]
    L.emu_dgrad.restype = ctypes.c_long
    L.emu_grouped_tiles.argtypes = [I64, I64, I32, I64, I64, PTR, PTR]
    L.emu_grouped_tiles.restype = None
    return L


def ptr(t):
    return None if t is None else t.data_ptr()


def _rows_ok(t, name):
    assert t.dim() == 2 and (t.shape[1] <= 1 or t.stride(1) == 1), f"{name} must be 2-D with unit last stride"


def _contig(name, t, dtype=None, shape=None):
    assert t.is_contiguous(), f"{name} must be contiguous"
    assert dtype is None or t.dtype == dtype, f"{name} must be {dtype}, got {t.dtype}"
    assert shape is None or tuple(t.shape) == tuple(shape), f"{name} must have shape {shape}, got {tuple(t.shape)}"


class EmulatedLaunchers:
    """dorafp8._C's entry points on the emulated launchers: the binding's arguments, outputs written into the tensors
    passed. The preconditions the binding checks on a GPU are asserted here (an adapter bug the binding would refuse
    fails here too), and every call asserts that the emulator saw no race or misuse. group_m: row-blocks per group of
    the kernels' launch order (0: the kernels' default, as the binding passes); the tests use 2, so that their shapes
    (3 to 5 row-blocks) cross groups and end with a ragged one."""

    def __init__(self, lib, group_m=2):
        self.lib = lib
        self.group_m = group_m

    @staticmethod
    def _ok(errors, what):
        assert errors == 0, f"{what}: {errors} emulator errors (shared-memory races / misuse)"

    @staticmethod
    def _weight(w8, scale):
        N = w8.shape[0]
        _contig("w8", w8, torch.float8_e4m3fn)
        _contig("scale", scale, torch.float32)
        assert scale.dim() == 0 or tuple(scale.shape) == (N,), f"scale must be 0-dim or [{N}], got {scale.shape}"
        return int(scale.dim() == 1)

    @staticmethod
    def _rank(t, ref, name):
        assert t.dtype in (ref.dtype, torch.float32), f"{name} must be {ref.dtype} or float32, got {t.dtype}"
        return int(t.dtype != ref.dtype)

    def weight_norm(self, w8, scale, A, B, s, n):
        per_row = self._weight(w8, scale)
        N, K = w8.shape
        r = A.shape[0]
        _contig("A", A, shape=(r, K))
        _contig("B", B, A.dtype, (N, r))
        _contig("n", n, torch.float32, (N,))
        self._ok(self.lib.emu_weight_norm(ptr(w8), ptr(scale), per_row, ptr(A), ptr(B), DT[A.dtype], N, K, r, s,
                                          ptr(n), 132), "weight_norm")

    def forward(self, x, w8, scale, bias, c, u, B, s, xm, p, y, z):
        per_row = self._weight(w8, scale)
        _rows_ok(x, "x")
        (M, K), N = x.shape, w8.shape[0]
        _contig("y", y, x.dtype, (M, N))
        if bias is not None:
            _contig("bias", bias, x.dtype, (N,))
        r, rank_f32, z_f32 = 0, 0, 0
        if c is None:
            assert u is None and B is None and xm is None and z is None
        else:
            _contig("c", c, torch.float32, (N,))
            r = u.shape[1]
            rank_f32 = self._rank(u, x, "u")
            _contig("u", u, shape=(M, r))
            _contig("B", B, u.dtype, (N, r))
            if xm is not None:
                _rows_ok(xm, "xm")
                assert xm.dtype == x.dtype and xm.shape == x.shape and 0 <= p < 1
            if z is not None:
                z_f32 = self._rank(z, x, "z")
                _contig("z", z, shape=(M, N))
        self._ok(self.lib.emu_forward(
            DT[x.dtype], ptr(x), x.stride(0), ptr(xm), 0 if xm is None else xm.stride(0), ptr(w8), ptr(scale),
            per_row, ptr(bias), ptr(c), ptr(u), ptr(B), rank_f32, M, N, K, r, s, 1.0 / (1.0 - p) if xm is not None
            else 1.0, ptr(y), ptr(z), z_f32, self.group_m),
            "forward")

    def dgrad(self, gl, rl, w8, scale, v, A, s, mask, p, gb, rb, dx):
        per_row = self._weight(w8, scale)
        _rows_ok(gl, "gl")
        (M, N), K = gl.shape, w8.shape[1]
        _contig("rl", rl, torch.float32, (1,))
        _contig("dx", dx, gl.dtype, (M, K))
        r, rank_f32 = 0, 0
        if v is None:
            assert A is None and mask is None and gb is None and rb is None
        else:
            r = v.shape[1]
            rank_f32 = self._rank(v, gl, "v")
            _contig("v", v, shape=(M, r))
            _contig("A", A, v.dtype, (r, K))
            if mask is None:
                assert gb is None and rb is None
            else:
                _rows_ok(mask, "mask")
                _rows_ok(gb, "gb")
                assert mask.dtype == torch.bool and mask.shape == (M, K) and 0 <= p < 1
                assert gb.dtype == gl.dtype and gb.shape == gl.shape
                _contig("rb", rb, torch.float32, (1,))
        self._ok(self.lib.emu_dgrad(
            DT[gl.dtype], ptr(gl), gl.stride(0), ptr(gb), 0 if gb is None else gb.stride(0), ptr(rl), ptr(rb),
            ptr(w8), ptr(scale), per_row, ptr(v), ptr(A), rank_f32, ptr(mask), 0 if mask is None else mask.stride(0),
            M, N, K, r, s, 1.0 / (1.0 - p), ptr(dx), self.group_m), "dgrad")


@pytest.fixture(scope="module")
def emu(lib):
    """The CUDA backend's contract adapter on the emulated kernels."""
    return CudaBackend(EmulatedLaunchers(lib))


BF, F16, F32_ = torch.bfloat16, torch.float16, torch.float32
# (M, K, N, r, dtype, rank dtype, scale kind, strided, bias). Each case runs weight_norm, forward and dgrad in the three
# modes (plain, nodrop, dropout) on the emulated kernels. Tiles: up to 64 rows 64 x 128 (2 x 4 warps), beyond that
# 64 x 256 without dropout and 32 x 256 with it (1 x 8 warps), in groups of 2 row-blocks (EmulatedLaunchers).
CASES = (
    [(1, 50, 70, 1, dt, dt, "tensor", False, True) for dt in (BF, F16, F32_)]  # M = 1, ragged everything, r = 1
    + [(37, 50, 70, 3, dt, dt, "row", True, False) for dt in (BF, F16, F32_)]  # per-row, strided, no bias
    + [(37, 64, 48, 16, dt, dt, "tensor", False, True) for dt in (BF, F16)]  # 16-byte fp8 copies, one rank chunk
    + [(37, 160, 150, 1, F16, F16, "tensor", True, True),  # two column-blocks of the 128-wide tiles, strided
       # 256-wide tiles: 2 (3 with dropout: a ragged group) row-blocks, forward's two column-blocks (odd N: no paired
       # stores), dgrad's columns past 128, five K steps (forward) and nine N steps (dgrad), two rank chunks
       (65, 136, 263, 40, BF, BF, "row", False, True),
       (130, 96, 200, 40, F32_, F32_, "row", True, True),  # fp32: the SIMT kernels, several 64 x 64 tiles
       # fp32 adapters on 16-bit activations: the fp32 rank path, z in fp32
       (37, 64, 48, 3, BF, F32_, "row", True, True),
       # 256-wide tiles with dgrad's two column-blocks (K > 256, byte-wise fp8 copies), two fp32 rank chunks
       (65, 264, 40, 40, F16, F32_, "tensor", False, True),
       (20, 50, 33, 5, BF, F16, "tensor", False, False)]  # mixed 16-bit dtypes: fp32 rank path as well
)


def _case_id(c):
    M, K, N, r, dt, rdt, scale, strided, bias = c
    name = lambda t: str(t)[6:]  # noqa: E731
    return (f"M{M}-K{K}-N{N}-r{r}-{name(dt)}" + ("" if rdt == dt else f"-rank{name(rdt)}") + f"-{scale}"
            + ("-strided" if strided else "") + ("-bias" if bias else ""))


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_cuda_kernels_emulated(emu, case):
    M, K, N, r, dtype, rdt, scale, strided, has_bias = case
    p = make_problem(M, K, N, r, dtype, "cpu", scale, strided, rank_dtype=rdt)
    check_weight_norm(emu.weight_norm, p)
    for mode in ("plain", "nodrop", "dropout"):
        check_forward(emu.forward, p, mode, has_bias)
        check_dgrad(emu.dgrad, p, mode)


def test_grouped_launch_order(lib):
    """The kernels' grouped launch order maps the linear blocks onto every tile exactly once, for any group size and
    ragged last group, and runs row-blocks fastest within a group."""
    for tiles_m, tiles_n, group in [(1, 1, 8), (3, 5, 2), (5, 3, 2), (17, 4, 8), (8, 8, 8), (9, 1, 8), (2, 7, 3),
                                    (40, 11, 8), (1000, 3, 8)]:
        n = tiles_m * tiles_n
        bm, bn = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
        lib.emu_grouped_tiles(tiles_m, tiles_n, group, 0, n, ptr(bm), ptr(bn))
        assert bm.min() >= 0 and bm.max() < tiles_m and bn.min() >= 0 and bn.max() < tiles_n
        assert torch.unique(bm * tiles_n + bn).numel() == n, (tiles_m, tiles_n, group)
        assert bm[0] == 0 and bn[0] == 0 and (tiles_m == 1 or bm[1] == 1)
    # One row-block and 2^29 + 1 column-blocks: 8 * tiles_n wraps around 32 bits unless the group is clamped to 1.
    tiles_n = (1 << 29) + 1
    bm, bn = torch.empty(4, dtype=torch.int64), torch.empty(4, dtype=torch.int64)
    lib.emu_grouped_tiles(1, tiles_n, 8, tiles_n - 4, 4, ptr(bm), ptr(bn))
    assert bm.tolist() == [0] * 4 and bn.tolist() == list(range(tiles_n - 4, tiles_n))


@pytest.mark.parametrize("mode", ["nodrop", "dropout"])
def test_forward_without_z_and_other_z_dtype(emu, mode):
    """need_z=False writes no z; a z_dtype that is neither the compute dtype nor fp32 is the fp32 z rounded once."""
    p = make_problem(5, 40, 36, 3, torch.bfloat16, "cpu", "tensor", False)
    xm = p["xm"] if mode == "dropout" else None
    u = p["u"] if mode == "dropout" else p["u_nodrop"]
    args = (p["x"], p["w8"], p["sigma"], p["block"], p["bias"], p["m"], p["n"], u, p["B"], S, xm, P)
    y, z = emu.forward(*args, False, torch.bfloat16, "")
    assert z is None
    y64, z64 = forward_64(p["x"], p["w8"], p["sigma"], p["bias"], p["c"], u, p["B"], S, xm, P)
    assert_close(y, y64, tol(torch.bfloat16), "y without z vs fp64")
    assert torch.equal(y, emu.forward(*args, True, torch.bfloat16, "")[0])
    _, z16 = emu.forward(*args, True, torch.float16, "")
    _, z32 = emu.forward(*args, True, torch.float32, "")
    assert z16.dtype == torch.float16 and z32.dtype == torch.float32
    assert_close(z32, z64, tol(torch.float32), "fp32 z of bf16 activations vs fp64")
    assert torch.equal(z16, z32.to(torch.float16))


@pytest.mark.parametrize("op", ["weight_norm", "forward", "dgrad"])
def test_block_scales_refused(emu, op):
    p = make_problem(4, 32, 20, 2, torch.bfloat16, "cpu", "block", False)
    assert p["sigma"].dim() == 2
    with pytest.raises(ValueError, match=r"block weight scales .* not supported by the cuda backend; use "
                                         r"backend='auto' or 'triton' / 'reference'"):
        if op == "weight_norm":
            check_weight_norm(emu.weight_norm, p)
        elif op == "forward":
            check_forward(emu.forward, p, "nodrop", True)
        else:
            check_dgrad(emu.dgrad, p, "dropout")


@pytest.mark.parametrize("op", ["forward", "dgrad"])
@pytest.mark.parametrize("mode", ["plain", "dropout"])
def test_w8a8_refused(emu, op, mode):
    p = make_problem(4, 32, 20, 2, torch.bfloat16, "cpu", "row", False)
    with pytest.raises(ValueError, match=r"act_quant='rowwise' \(W8A8\) is not supported by the cuda backend.*"
                                         r"use backend='auto' or 'triton' / 'reference'"):
        (check_forward(emu.forward, p, mode, True, act_quant="rowwise") if op == "forward"
         else check_dgrad(emu.dgrad, p, mode, act_quant="rowwise"))


def test_per_row_scale_of_one_row(emu):
    """N = 1 with a per-row scale ([1]): dgrad's operands already carry it, so the kernel must not apply it again as
    a per-tensor scale (the binding decides per-row by the scale's dim, not its size)."""
    p = make_problem(6, 40, 1, 2, torch.float16, "cpu", "row", False)
    assert p["sigma"].shape == (1,)
    for mode in ("plain", "nodrop", "dropout"):
        check_forward(emu.forward, p, mode, True)
        check_dgrad(emu.dgrad, p, mode)


def test_rank_ops_dispatch(monkeypatch):
    """project / project_grad / backward_pass: Triton's where Triton runs, else the reference's."""
    cpu = torch.device("cpu")
    triton_ok = backends.unavailable_reason("triton", cpu) is None
    assert cuda_backend.rank_ops(cpu) is backends.module("triton" if triton_ok else "reference")
    if triton_ok:  # rank_ops asks the Triton module itself (not the registry, which sits above it)
        import dorafp8.triton_kernels as tk

        monkeypatch.setattr(tk, "unavailable_reason", lambda device: "no triton here")
    assert cuda_backend.rank_ops(cpu) is reference


@pytest.mark.parametrize("use_triton", [False, True], ids=["reference", "triton"])
def test_rank_ops_contract(emu, monkeypatch, use_triton):
    """The backend's project / project_grad / backward_pass pass the shared checks through either implementation."""
    if use_triton and backends.unavailable_reason("triton", torch.device("cpu")) is not None:
        pytest.skip(backends.unavailable_reason("triton", torch.device("cpu")))
    if not use_triton:
        monkeypatch.setattr(cuda_backend, "rank_ops", lambda device: reference)
    p = make_problem(9, 33, 17, 3, torch.float32, "cpu", "row", True)
    check_project(emu.project, emu.project_grad, p)
    for mode in ("plain", "nodrop", "dropout"):
        check_backward_pass(emu.backward_pass, p, mode)


@pytest.mark.parametrize("x_dtype,ad_dtype,dropout", [(torch.float32, torch.float32, True),
                                                      (torch.bfloat16, torch.float32, True),
                                                      (torch.float16, torch.float16, False)], ids=str)
def test_end_to_end_through_ops(emu, monkeypatch, x_dtype, ad_dtype, dropout):
    """dora_fp8_linear and fp8_linear with backend='cuda' (the emulated kernels, through dorafp8.ops' custom ops and
    autograd) give the reference backend's outputs and gradients."""
    module = backends.module

    def module_for(name):
        if name != "cuda":
            return module(name)
        return SimpleNamespace(unavailable_reason=lambda device: None, **{
            f: getattr(emu, f) for f in ("weight_norm", "project", "project_grad", "forward", "backward_pass",
                                         "dgrad")})

    gen = torch.Generator().manual_seed(3)
    M, K, N, r = 11, 48, 40, 4
    w8, scale = dorafp8.quantize_e4m3(torch.randn(N, K, generator=gen) / K ** 0.5, per_row=True)
    x = torch.randn(M, K, generator=gen).to(x_dtype)
    A = (torch.randn(r, K, generator=gen) / K ** 0.5).to(ad_dtype)
    B = (torch.randn(N, r, generator=gen) * 0.3).to(ad_dtype)
    m = (torch.rand(N, generator=gen) + 0.5).to(ad_dtype)
    bias = torch.randn(N, generator=gen).to(x_dtype)
    gy = torch.randn(M, N, generator=gen).to(x_dtype)

    def run(backend):
        leaves = [t.clone().requires_grad_() for t in (x, A, B, m)]
        torch.manual_seed(0)
        y = dorafp8.dora_fp8_linear(leaves[0], w8, scale, *leaves[1:], 1.5, bias, dropout_p=0.3 if dropout else 0.0,
                                    training=dropout, backend=backend)
        y.backward(gy)
        xl = x.clone().requires_grad_()
        y2 = dorafp8.fp8_linear(xl, w8, scale, bias, backend=backend)
        y2.backward(gy)
        return [y, y2, xl.grad] + [t.grad for t in leaves]

    want = run("reference")
    monkeypatch.setattr(backends, "module", module_for)
    monkeypatch.setattr(backends, "unavailable_reason",
                        lambda name, device: None if name == "cuda" else "only the emulated cuda backend here")
    got = run("cuda")
    for name, g_, w_ in zip(("y", "y_plain", "dx_plain", "dx", "dA", "dB", "dm"), got, want):
        assert g_.dtype == w_.dtype, name
        # two implementations, each within tol of fp64 (the kernel tests above), of the compute dtype's precision
        assert_close(g_, w_, 2 * tol(x_dtype), f"{name}: cuda (emulated) vs reference")
