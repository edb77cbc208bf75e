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
import time

import pytest
import torch

import dorafp8.reference as ref
from dorafp8 import quantize_e4m3

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
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def ptr(t):
    return None if t is None else t.data_ptr()


def act(t, dtype, strided):
    t = t.to(dtype)
    if not strided:
        return t.contiguous()
    buf = torch.full((t.shape[0], t.shape[1] + 7), float("nan"), dtype=dtype)
    buf[:, : t.shape[1]] = t
    return buf[:, : t.shape[1]]


def check(failures, out, exp, rel, what):
    o, r = out.double(), exp.double()
    err = (o - r).abs()
    scale = r.abs().max().item()
    allowed = rel * (r.abs() + scale)
    bad = ~(err <= allowed)
    worst = (err / (r.abs() + scale + 1e-30)).nan_to_num(float("inf")).max().item()
    status = "ok  " if not bad.any() else "FAIL"
    print(f"  {status} {what}: worst rel {worst:.2e} (tol {rel:.1e})")
    if bad.any():
        first = tuple(int(i) for i in torch.nonzero(bad)[0])
        failures.append(f"{what}: first bad {first}: got {o[first].item()} expected {r[first].item()}")


def run_case(lib, M, K, N, r, dtype, per_row, strided, bias_on, seed=0, sms=132, do=("wn", "fwd", "dgrad")):
    failures = []
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)
    w = rnd(N, K) * 0.05
    if per_row:
        w = w * torch.linspace(0.1, 3.0, N)[:, None]
    w8, scale = quantize_e4m3(w, per_row=per_row)
    W0 = w8.double() * (scale.double()[:, None] if per_row else scale.double())
    A = (rnd(r, K) * 0.1).to(dtype)
    B = (rnd(N, r) * 0.1).to(dtype)
    s = 1.75
    x = act(rnd(M, K), dtype, strided)
    bias = (rnd(N) * 0.1).to(dtype) if bias_on else None
    p = 0.25
    keep = torch.rand(M, K, generator=gen) >= p
    xd = act(x.float() * keep / (1 - p), dtype, strided)
    m = (rnd(N).abs() + 0.5)
    tag = f"M={M} K={K} N={N} r={r} {str(dtype)[6:]} per_row={per_row} strided={strided} bias={bias_on}"
    print(tag)
    scale_c = scale.reshape(-1).contiguous()
    errs = 0
    # weight_norm
    n_ref = ref.weight_norm(w8, scale, A, B, s)
    n = torch.empty(N, dtype=torch.float32)
    if "wn" in do:
        t0 = time.time()
        errs += lib.emu_weight_norm(ptr(w8), ptr(scale_c), int(per_row), ptr(A), ptr(B), DT[dtype], N, K, r, s, ptr(n), sms)
        n64 = (W0 + s * B.double() @ A.double()).norm(dim=1)
        check(failures, n, n64, 1e-5, f"weight_norm vs fp64 ({time.time()-t0:.1f}s)")
        check(failures, n, n_ref, 1e-5, "weight_norm vs reference")
    c = (m / n_ref).float().contiguous()
    u = (xd.float() @ A.float().T).to(dtype).contiguous()
    u_nd = (x.float() @ A.float().T).to(dtype).contiguous()
    if "fwd" in do:
        for mode in ("plain", "dora", "dropout"):
            y = torch.empty(M, N, dtype=dtype)
            z = torch.empty(M, N, dtype=dtype) if mode != "plain" else None
            t0 = time.time()
            if mode == "plain":
                e = lib.emu_forward(DT[dtype], ptr(x), x.stride(0), None, 0, ptr(w8), ptr(scale_c), int(per_row), ptr(bias),
                                    None, None, None, M, N, K, 0, 0.0, ptr(y), None)
                yr, zr = ref.forward(x, w8, scale, bias, None, None, None, 0.0, None, False)
            elif mode == "dora":
                e = lib.emu_forward(DT[dtype], ptr(x), x.stride(0), None, 0, ptr(w8), ptr(scale_c), int(per_row), ptr(bias),
                                    ptr(c), ptr(u_nd), ptr(B), M, N, K, r, s, ptr(y), ptr(z))
                yr, zr = ref.forward(x, w8, scale, bias, c, u_nd, B, s, None, True)
            else:
                e = lib.emu_forward(DT[dtype], ptr(x), x.stride(0), ptr(xd), xd.stride(0), ptr(w8), ptr(scale_c), int(per_row),
                                    ptr(bias), ptr(c), ptr(u), ptr(B), M, N, K, r, s, ptr(y), ptr(z))
                yr, zr = ref.forward(x, w8, scale, bias, c, u, B, s, xd, True)
            errs += e
            # fp64 formulas from the same (rounded) inputs
            x64, xd64, u64 = x.double(), xd.double(), (u_nd if mode == "dora" else u).double()
            b64 = bias.double() if bias is not None else 0.0
            c64 = c.double()
            if mode == "plain":
                y64 = x64 @ W0.T + b64
            elif mode == "dora":
                z64 = x64 @ W0.T + s * u64 @ B.double().T
                y64 = c64 * z64 + b64
            else:
                z64 = xd64 @ W0.T + s * u64 @ B.double().T
                y64 = x64 @ W0.T + b64 + (c64 - 1) * (xd64 @ W0.T) + c64 * (s * u64 @ B.double().T)
            check(failures, y, y64, TOL[dtype], f"forward {mode} y vs fp64 ({time.time()-t0:.1f}s)")
            check(failures, y, yr, TOL[dtype], f"forward {mode} y vs reference")
            if z is not None:
                check(failures, z, z64, TOL[dtype], f"forward {mode} z vs fp64")
    if "dgrad" in do:
        g = act(rnd(M, N), dtype, strided)
        sref = (scale.abs().amax() if per_row else scale).reshape(1).float().contiguous()
        v = (g.float() @ (c[:, None] * B.float())).to(dtype).contiguous()
        mask = keep.contiguous()
        for mode in ("plain", "dora", "dropout"):
            dx = torch.empty(M, K, dtype=dtype)
            t0 = time.time()
            if mode == "plain":
                e = lib.emu_dgrad(DT[dtype], ptr(g), g.stride(0), ptr(w8), ptr(scale_c), ptr(sref), int(per_row), None, None,
                                  None, None, 0, M, N, K, 0, 0.0, 1.0, ptr(dx))
                dr = ref.dgrad(g, w8, scale, None, None, None, 0.0, None, 0.0)
                d64 = g.double() @ W0
            elif mode == "dora":
                e = lib.emu_dgrad(DT[dtype], ptr(g), g.stride(0), ptr(w8), ptr(scale_c), ptr(sref), int(per_row), ptr(c), ptr(v),
                                  ptr(A), None, 0, M, N, K, r, s, 1.0, ptr(dx))
                dr = ref.dgrad(g, w8, scale, c, v, A, s, None, 0.0)
                d64 = (g.double() * c.double()) @ W0 + s * v.double() @ A.double()
            else:
                e = lib.emu_dgrad(DT[dtype], ptr(g), g.stride(0), ptr(w8), ptr(scale_c), ptr(sref), int(per_row), ptr(c), ptr(v),
                                  ptr(A), ptr(mask), mask.stride(0), M, N, K, r, s, 1.0 / (1.0 - p), ptr(dx))
                dr = ref.dgrad(g, w8, scale, c, v, A, s, mask, p)
                inner = (g.double() * (c.double() - 1)) @ W0 + s * v.double() @ A.double()
                d64 = g.double() @ W0 + mask.double() / (1 - p) * inner
            errs += e
            check(failures, dx, d64, TOL[dtype], f"dgrad {mode} vs fp64 ({time.time()-t0:.1f}s)")
            check(failures, dx, dr, TOL[dtype], f"dgrad {mode} vs reference")
    if errs:
        failures.append(f"{tag}: {errs} emulator errors (races / misuse)")
    return failures



_DTS = (torch.bfloat16, torch.float16, torch.float32)
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
    failures = run_case(lib, *case)
    assert not failures, "\n".join(failures)
