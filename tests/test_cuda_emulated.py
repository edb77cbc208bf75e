"""The CUDA kernels of csrc/dora_fp8.cu run on CPU under an emulator (tests/cuda_emu/), against dorafp8.reference
and fp64 evaluations of the formulas. This is how CI, which has no GPU, executes the real kernel source.

The emulator (tests/cuda_emu/emu_cuda.h) compiles dora_fp8.cu with g++ (-DDORA_EMULATE): one OS thread per CUDA
thread; warp collectives (ldmatrix, mma.m16n8k16, shuffles) computed from the PTX ISA fragment layouts, written
independently of the kernels; cp.async copies landing at wait_group time; a shared-memory race checker (same-barrier
conflicts, reads of in-flight cp.async data), whose findings count as failures. Inputs are copied into exactly
sized buffers and outputs start as NaN bytes. It shares its reading of the PTX ISA with the kernels' author, so it
does not replace a GPU run (tests/test_cuda.py); it does catch indexing, masking, pipelining and epilogue bugs.
"""

import ctypes
import os
import shutil
import subprocess

import pytest
import torch

from _kernel_ref import S, assert_close, check_dgrad, check_forward, make_problem, tol, weight_norm_64

import dorafp8.reference as reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_HOME = os.environ.get("CUDA_HOME", "/usr/local/cuda")
CUDA_INCLUDE = os.path.join(CUDA_HOME, "include")
if shutil.which("g++") is None or not os.path.exists(os.path.join(CUDA_INCLUDE, "cuda_fp8.h")):
    pytest.skip("the CUDA emulator needs g++ and the CUDA toolkit headers (cuda_fp8.h)", allow_module_level=True)


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    so = str(tmp_path_factory.mktemp("emu") / "libdoraemu.so")
    cmd = ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-Wl,-Bsymbolic", f"-I{CUDA_INCLUDE}",
           f"-I{os.path.join(ROOT, 'tests', 'cuda_emu')}", f"-I{os.path.join(ROOT, 'csrc')}",
           os.path.join(ROOT, "tests", "cuda_emu", "emu_api.cpp"), "-o", so, "-lpthread"]
    subprocess.run(cmd, check=True)
    L = ctypes.CDLL(so)
    L.emu_weight_norm.argtypes = [P, P, I32, P, P, I32, I64, I64, I32, F32, P, I32]
    L.emu_weight_norm.restype = ctypes.c_long
    L.emu_forward.argtypes = [I32, P, I64, P, I64, P, P, I32, P, P, P, P, I64, I64, I64, I32, F32, P, P]
    L.emu_forward.restype = ctypes.c_long
    L.emu_dgrad.argtypes = [I32, P, I64, P, P, P, I32, P, P, P, P, I64, I64, I64, I64, I32, F32, F32, P]
    L.emu_dgrad.restype = ctypes.c_long
    return L


P, I64, I32, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
DT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def ptr(t):
    return None if t is None else t.data_ptr()


class EmulatedBackend:
    """The backend contract on the emulated launchers, with the operand preparation of dorafp8/cuda_backend.py
    (small operands contiguous in their kernel dtype, max |scale| kept out of the 16-bit operand in dgrad).
    Every call asserts that the emulator saw no race or misuse."""

    def __init__(self, lib):
        self.lib = lib

    def _ok(self, errors, what):
        assert errors == 0, f"{what}: {errors} emulator errors (shared-memory races / misuse)"

    def weight_norm(self, w8, scale, A, B, s):
        N, K = w8.shape
        adt = torch.promote_types(A.dtype, B.dtype)
        A, B = A.to(adt).contiguous(), B.to(adt).contiguous()
        sc = scale.reshape(-1).float().contiguous()
        n = torch.full((N,), float("nan"))
        self._ok(self.lib.emu_weight_norm(ptr(w8), ptr(sc), int(sc.numel() > 1), ptr(A), ptr(B), DT[adt], N, K,
                                          A.shape[0], s, ptr(n), 132), "weight_norm")
        return n

    def forward(self, x, w8, scale, bias, c, u, B, s, xd, need_z):
        cdt, (M, K), N = x.dtype, x.shape, w8.shape[0]
        sc = scale.reshape(-1).float().contiguous()
        small = lambda t, dt=cdt: None if t is None else t.to(dt).contiguous()  # noqa: E731
        y = torch.full((M, N), float("nan"), dtype=cdt)
        z = torch.full((M, N), float("nan"), dtype=cdt) if c is not None and need_z else None
        r = 0 if u is None else u.shape[1]
        # named, so that the copies outlive the call (a temporary's memory is freed as soon as ptr() returns)
        bias, c, u, B = small(bias), small(c, torch.float32), small(u), small(B)
        self._ok(self.lib.emu_forward(
            DT[cdt], ptr(x), x.stride(0), ptr(xd), 0 if xd is None else xd.stride(0), ptr(w8), ptr(sc),
            int(sc.numel() > 1), ptr(bias), ptr(c), ptr(u), ptr(B), M, N, K, r, 0.0 if c is None else s, ptr(y),
            ptr(z)), "forward")
        return y, z

    def dgrad(self, g, w8, scale, c, v, A, s, mask, p):
        cdt, (M, N), K = g.dtype, g.shape, w8.shape[1]
        sc = scale.reshape(-1).float().contiguous()
        sref = (sc.abs().amax() if sc.numel() > 1 else sc).reshape(1).contiguous()
        small = lambda t, dt=cdt: None if t is None else t.to(dt).contiguous()  # noqa: E731
        mask = None if mask is None else mask.contiguous()
        dx = torch.full((M, K), float("nan"), dtype=cdt)
        r = 0 if v is None else v.shape[1]
        c, v, A = small(c, torch.float32), small(v), small(A)  # named: see forward
        self._ok(self.lib.emu_dgrad(
            DT[cdt], ptr(g), g.stride(0), ptr(w8), ptr(sc), ptr(sref), int(sc.numel() > 1), ptr(c), ptr(v), ptr(A),
            ptr(mask), 0 if mask is None else mask.stride(0), M, N, K, r, 0.0 if c is None else s, 1.0 / (1.0 - p),
            ptr(dx)), "dgrad")
        return dx


_DTS = (torch.bfloat16, torch.float16, torch.float32)
# (M, K, N, r, dtype, per_row, strided, bias)
CASES = (
    [(1, 50, 70, 1, dt, False, False, True) for dt in _DTS]          # M = 1, ragged everything, r = 1
    + [(37, 50, 70, 3, dt, True, True, False) for dt in _DTS]        # per-row scale, strided activations, no bias
    + [(37, 64, 48, 16, dt, False, False, True) for dt in _DTS]      # 16-byte fp8 copies, one rank chunk
    + [(130, 96, 200, 40, torch.bfloat16, False, False, True),       # 128-row tiles, two rank chunks
       (130, 96, 200, 40, torch.float32, True, True, True),
       (65, 128, 129, 1, torch.bfloat16, True, False, False),        # odd N: no paired stores
       (65, 128, 129, 1, torch.float16, False, True, True)]
)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "M{}-K{}-N{}-r{}-{}-row{}-strided{}-bias{}".format(
    *c[:4], str(c[4])[6:], *c[5:]))
def test_cuda_kernels_emulated(lib, case):
    M, K, N, r, dtype, per_row, strided, has_bias = case
    emu = EmulatedBackend(lib)
    p = make_problem(M, K, N, r, dtype, "cpu", per_row, strided)
    n = emu.weight_norm(p["w8"], p["sigma"], p["A"], p["B"], S)
    assert_close(n, weight_norm_64(p["w8"], p["sigma"], p["A"], p["B"], S), tol(torch.float32), "weight_norm vs fp64")
    assert_close(n, reference.weight_norm(p["w8"], p["sigma"], p["A"], p["B"], S), 2 * tol(torch.float32),
                 "weight_norm vs reference")
    for mode in ("plain", "nodrop", "dropout"):
        check_forward(emu.forward, p, mode, has_bias, dtype)
        check_dgrad(emu.dgrad, p, mode, dtype)
