"""One pass from the fp8 weight to a 16-bit (or fp32) copy, for the cuBLAS strategy (dorafp8/backends/cublas.py):

    W[j, k] = cdt(f[j, k] * w8[j, k]),   f = the scale (per tensor), kappa = max_j |scale[j]| (per row), or
                                          scale[j // b, k // b] (per b x b block), applied in fp32 registers

The same launch writes the epilogues' factors (per row: scale / kappa and 1 / kappa), so no PyTorch op runs between.
Why kappa: docs/ARCHITECTURE.md, "triton_kernels/dequant.py"."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import alloc, cdiv, check_weight, interpreting, launch, scale_block_size
from .epilogue_dot import bf16_value

DEQUANT_BLOCKS = (64, 128)  # (BLOCK_N, BLOCK_K) on a GPU: 8 KiB of fp8 in, 16 KiB out a program
SCAN = 1024  # the chunk of the row scales that each program reads to find kappa


@triton.jit
def weight_tile(N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's BLOCK_N x BLOCK_K tile of an [N, K] weight: its program ids, rows and columns, the rows' mask,
    the tile's mask, and the rows as int64 (row offsets of a large weight pass 2^31). Shared with dequant_micro.py."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    return pid_n, pid_k, offs_n, offs_k, mask_n, mask_n[:, None] & (offs_k[None, :] < K), offs_n.to(tl.int64)


@triton.jit
def dequant_w8_kernel(
    w_ptr, scale_ptr, out_ptr, fac_ptr,
    N, K,
    stride_w_n, stride_scale_n, stride_out_n,
    SCALE_KIND: tl.constexpr, SCALE_BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCAN_N: tl.constexpr,
):
    pid_n, pid_k, offs_n, offs_k, mask_n, ok, rows = weight_tile(N, K, BLOCK_N, BLOCK_K)
    w = tl.load(w_ptr + rows[:, None] * stride_w_n + offs_k[None, :], mask=ok, other=0.0).to(tl.float32)
    if SCALE_KIND == "tensor":
        f = tl.load(scale_ptr)
        w = w * f
        # "only the first program" masks are tensor comparisons (t * 0 + pid == 0): Triton 3.9's interpreter refuses a
        # mask made from a scalar comparison (an int32 mask)
        # fac = [1, 1]: the epilogues' factors, written by one program
        two = tl.arange(0, 2)
        tl.store(fac_ptr + two, tl.full((2,), 1.0, tl.float32), mask=(two * 0 + pid_n + pid_k) == 0)
    elif SCALE_KIND == "row":
        # kappa = max |scale|, every program the same (the scale vector is N floats, read from L2 after the first)
        offs_s = tl.arange(0, SCAN_N)
        kappa = tl.zeros((SCAN_N,), tl.float32)
        for j0 in range(0, N, SCAN_N):
            kappa = tl.maximum(kappa, tl.abs(tl.load(scale_ptr + j0 + offs_s, mask=j0 + offs_s < N, other=0.0)))
        kappa = tl.max(kappa, axis=0)
        w = w * kappa
        # the column of programs at pid_k = 0 writes rest = scale / kappa for its rows, the first also st = 1 / kappa
        srow = tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)
        # div_rn: the correctly rounded quotient, as torch's (plain '/' is approximate on GPUs)
        tl.store(fac_ptr + offs_n, tl.math.div_rn(srow, kappa), mask=mask_n & ((offs_n * 0 + pid_k) == 0))
        one = tl.arange(0, 1)
        tl.store(fac_ptr + N + one, tl.math.div_rn(tl.full((1,), 1.0, tl.float32), kappa),
                 mask=(one * 0 + pid_n + pid_k) == 0)
    else:  # block: f[j, k] = scale[j // b, k // b]
        sb = (offs_n // SCALE_BLOCK_SIZE)[:, None] * stride_scale_n + (offs_k // SCALE_BLOCK_SIZE)[None, :]
        w = w * tl.load(scale_ptr + sb, mask=ok, other=0.0)
        two = tl.arange(0, 2)
        tl.store(fac_ptr + two, tl.full((2,), 1.0, tl.float32), mask=(two * 0 + pid_n + pid_k) == 0)
    if out_ptr.dtype.element_ty == tl.bfloat16:
        w = bf16_value(w)  # rounded to nearest even, then cast exactly: the interpreter's own cast truncates
    tl.store(out_ptr + rows[:, None] * stride_out_n + offs_k[None, :], w.to(out_ptr.dtype.element_ty), mask=ok)


def dequant_w8(w8: torch.Tensor, scale: torch.Tensor, block_size: int, dtype: torch.dtype):
    """(W, fac): W [N, K] in `dtype` (the module docstring) and fac fp32 ([N + 1] per row, else [2]): fac[:-1] the
    forward epilogue's scale, fac[-1] the dgrad's. Any block size."""
    N = w8.shape[0]
    row = scale.dim() == 1 and scale.numel() == N  # [1] for N = 1: a row scale, as dorafp8.quant.scale_kind and
    scale, kind = check_weight(w8, scale, block_size, any_block=True)  # the backward's srow take it, not a tensor's
    kind = "row" if row else kind
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    N, K = w8.shape
    out = alloc((N, K), dtype, w8.device)
    fac = alloc((N + 1 if kind == "row" else 2,), torch.float32, w8.device)
    if N == 0 or K == 0:
        fac.fill_(1.0)  # kappa over no rows: nothing to scale (fac's per-row part is empty)
        return out, fac
    bn, bk = (16, 32) if interpreting() else DEQUANT_BLOCKS
    launch(dequant_w8_kernel, (cdiv(N, bn), cdiv(K, bk)))(
        w8, scale, out, fac,
        N, K, w8.stride(0), scale.stride(0) if kind == "block" else 0, out.stride(0),
        SCALE_KIND=kind, SCALE_BLOCK_SIZE=scale_block_size(kind, block_size),
        BLOCK_N=bn, BLOCK_K=bk,
        SCAN_N=64 if interpreting() else SCAN,
    )
    return out, fac

