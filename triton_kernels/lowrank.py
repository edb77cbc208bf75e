"""The skinny GEMMs of the rank-r path, with mixed dtypes and fp32 accumulation:

    project(a, b)       a [M, K] @ b [r, K]^T -> [M, r]     u = xd A^T in the forward (W8A8: also x's quantization)
    project_grad(v, a)  s * v [M, r]^T @ a [M, K] -> [r, K] dA in the backward (in A's dtype)

A dropout mask is applied as a is loaded; fp32 adapters on 16-bit activations compute from the exact values, as PEFT
does: on bf16 tensor cores with the fp32 operand split in three (bf16 activations, _common.split_dtype; split by bit
masks, _common.split3), else in fp32. project_grad sums its fp32 M-partials in a fixed order. Details: docs/ARCHITECTURE.md."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (dot3, alloc, block_r, cdiv, check_activation, interpreting, last_dim_unit, launch,
                      split_dtype, sum_parts)
from .occupancy import sm_props
from .quant import QUANT_STEP, quant_rows


def launch_blocks(ieee: bool, R: int, split: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_K, BLOCK_R, num_stages) on a GPU, for both kernels: fp32 operands (ieee) take smaller tiles, a
    rank chunk of at most 32 and two stages (64 x 128 x 64 spilled and overflowed Ada's shared memory); so does a
    split fp32 operand (split_dtype), with three stages: its fp32 tile is split in three in registers, and 64 x 64 x 64
    or 64 x 64 x 32 spilled on sm_120 (kernel report)."""
    if ieee or split:
        return 32, 64, min(block_r(R), 32), 2 if ieee else 3
    return 64, 128, block_r(R), 3


def project_launch(ieee: bool, R: int, split: bool, quant: bool) -> tuple[int, int, int, int, int]:
    """project's (BLOCK_M, BLOCK_K, BLOCK_R, num_stages, num_warps) on a GPU. A split fp32 A (issue 52): 2 warps, one
    per 16 rows of the mma.sync tile (4 warps on 32 rows held two copies each: twice the MMAs and A's split, kernel
    report), and four stages; QUANT keeps 4 warps, for its 32 x 256 quantizing sweep's registers."""
    bm, bk, br, stages = launch_blocks(ieee, R, split)
    if split and not quant:
        return bm, bk, br, 4, bm // 16
    return bm, bk, br, stages, 4


def project_grad_launch(ieee: bool, R: int, split: bool) -> tuple[int, int, int, int, int]:
    """project_grad's (BLOCK_M, BLOCK_K, BLOCK_R, num_stages, num_warps) on a GPU. A split fp32 v: 2 warps, not 4.
    Each warp splits the 16-row mma.sync tiles of v^T it multiplies: 4 warps split each in 2 warps (r 64) or 4 (r 16),
    2 warps in 1 or 2; and with split3's bit masks the dropout variant spilled 24-28 bytes on sm_120 at 4 warps. 2
    warps: no spill, 15-26% fewer instructions a tile (kernel report)."""
    bm, bk, br, stages = launch_blocks(ieee, R, split)
    return bm, bk, br, stages, 2 if split else 4


def quant_block_k(bm: int) -> int:
    """QUANT's sweep width on a GPU: a step of QUANT_STEP elements. The main loop's 32 x 64 tile kept 4 KiB in flight
    per program, 256 programs at M 8192, and W8A8's project ran at 6.5x its floor on an H200; 4x that in flight is a
    PREDICTION of the mend (bench/results/nvidia-h200/NOTES.md); 64 x 512 spilled (kernel report)."""
    return max(QUANT_STEP // bm, 16)


@triton.jit
def _dropped(a, keep, inv_keep, SPLIT: tl.constexpr):
    """a with dropout's zeros; its kept values scaled by 1 / (1 - p) here, or with SPLIT (dot3) left bf16, exact, and
    the kernel scales the finished sum instead."""
    if SPLIT:
        a = tl.where(keep != 0, a, 0.0)
    else:
        a = tl.where(keep != 0, a.to(tl.float32) * inv_keep, 0.0)
    return a


@triton.jit
def project_kernel(
    a_ptr, b_ptr, out_ptr, mask_ptr, q_ptr, sq_ptr,
    M, K, R,
    stride_a_m, stride_b_r, stride_b_k, stride_out_m, stride_mask_m, stride_q_m,
    inv_keep,
    HAS_MASK: tl.constexpr, DOT_DT: tl.constexpr, IEEE: tl.constexpr,
    SPLIT: tl.constexpr,  # b fp32, a bf16: dot3 (the mask's 1 / (1 - p) then scales the sum, keeping a's values bf16)
    QUANT: tl.constexpr,  # also quantize a (unmasked) per row to e4m3 (W8A8): q, and its row scales sq
    INTERPRET: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    QUANT_BLOCK_K: tl.constexpr,  # QUANT: the quantizing sweep's width (quant_block_k)
):
    pid_m, pid_r = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_r = offs_r < R
    rows = offs_m.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + offs_k < K
        a = tl.load(a_ptr + rows[:, None] * stride_a_m + k0 + offs_k[None, :], mask=mask_m[:, None] & k_ok[None, :],
                    other=0.0)
        if QUANT:
            amax = tl.maximum(amax, tl.max(tl.abs(a.to(tl.float32)), axis=1))
        if HAS_MASK:
            keep = tl.load(mask_ptr + rows[:, None] * stride_mask_m + k0 + offs_k[None, :],
                           mask=mask_m[:, None] & k_ok[None, :], other=0)
            a = _dropped(a, keep, inv_keep, SPLIT)
        bt = tl.load(b_ptr + offs_r[None, :] * stride_b_r + (k0 + offs_k[:, None]).to(tl.int64) * stride_b_k,
                     mask=k_ok[:, None] & mask_r[None, :], other=0.0)
        acc = dot3(a, bt, acc, DOT_DT, IEEE, False, SPLIT)
    if SPLIT and HAS_MASK:
        acc = acc * inv_keep
    tl.store(out_ptr + rows[:, None] * stride_out_m + offs_r[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_r[None, :])
    if QUANT:
        if pid_r == 0:  # with several rank chunks, the first quantizes
            quant_rows(a_ptr, q_ptr, sq_ptr, rows, mask_m, amax, K, stride_a_m, stride_q_m, QUANT_BLOCK_K,
                       INTERPRET)


@triton.jit
def project_grad_kernel(
    v_ptr, a_ptr, part_ptr, mask_ptr,
    M, K, R, ROWS_PER_SPLIT,
    stride_v_m, stride_v_r, stride_a_m, stride_mask_m,
    inv_keep, s,
    HAS_MASK: tl.constexpr, DOT_DT: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr, FINAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """FINAL (one split): part_ptr is dA itself, written as s * acc in its dtype; else fp32 partials [splits, R, K]."""
    pid_k, pid_r, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_k = offs_k < K
    mask_r = offs_r < R
    acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    m_start = pid_s * ROWS_PER_SPLIT
    for m0 in range(m_start, m_start + ROWS_PER_SPLIT, BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        rows = offs_m.to(tl.int64)
        vt = tl.load(v_ptr + rows[None, :] * stride_v_m + offs_r[:, None] * stride_v_r,
                     mask=mask_r[:, None] & mask_m[None, :], other=0.0)
        a = tl.load(a_ptr + rows[:, None] * stride_a_m + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0)
        if HAS_MASK:
            keep = tl.load(mask_ptr + rows[:, None] * stride_mask_m + offs_k[None, :],
                           mask=mask_m[:, None] & mask_k[None, :], other=0)
            a = _dropped(a, keep, inv_keep, SPLIT)
        acc = dot3(vt, a, acc, DOT_DT, IEEE, True, SPLIT)
    if SPLIT and HAS_MASK:
        acc = acc * inv_keep
    part = part_ptr + (pid_s.to(tl.int64) * R + offs_r[:, None]) * K + offs_k[None, :]
    if FINAL:
        tl.store(part, (acc * s).to(part_ptr.dtype.element_ty), mask=mask_r[:, None] & mask_k[None, :])
    else:
        tl.store(part, acc, mask=mask_r[:, None] & mask_k[None, :])


@triton.jit
def sum_splits_kernel(part_ptr, out_ptr, SPLITS, NUMEL, s, BLOCK: tl.constexpr):
    """out = s * sum_p part[p] (fixed order), rounded once to out's dtype: project_grad's second stage."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < NUMEL
    tl.store(out_ptr + offs, (sum_parts(part_ptr, SPLITS, NUMEL, offs, ok) * s).to(out_ptr.dtype.element_ty), mask=ok)


def _mask_args(mask, p, a):
    """(mask as uint8 with unit last stride, its row stride, 1 / (1 - p)) or placeholders without a mask."""
    if mask is None:
        return a, 0, 1.0
    if mask.dtype != torch.bool or tuple(mask.shape) != tuple(a.shape):
        raise ValueError(f"mask must be bool {list(a.shape)}, got {mask.dtype} {list(mask.shape)}")
    mask = last_dim_unit(mask).view(torch.uint8)  # bool and uint8 share the byte layout
    return mask, mask.stride(0), (1.0 / (1.0 - p) if p < 1.0 else 0.0)


def project(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, mask=None, p: float = 0.0,
            quant: bool = False):
    """a' @ b^T, [M, r] in out_dtype (a' = a * mask / (1 - p) with a mask). quant=True (W8A8, base.py QUANT_PARAMS): (u,
    a8, sa), a quantized per row (quant.py's recipe) in the same kernel."""
    K = b.shape[1]
    a = check_activation(a, "a", K)
    M, R = a.shape[0], b.shape[0]
    out = alloc((M, R), out_dtype, a.device)
    q, sq = (alloc((M, K), torch.float8_e4m3fn, a.device), alloc((M,), torch.float32, a.device)) if quant else (a, a)
    if M == 0 or (R == 0 and not quant):
        return (out, q, sq) if quant else out
    mk, stride_mk, inv_keep = _mask_args(mask, p, a)
    dot_dt, ieee, split = split_dtype(a.dtype, b.dtype)
    if interpreting():
        bm, bk, br, stages, warps = 16, 32, block_r(R), 1, 4
    else:
        bm, bk, br, stages, warps = project_launch(ieee, R, split, quant)
    qbk = 2 * bk if interpreting() else quant_block_k(bm)  # a width of its own in the tests too
    launch(project_kernel, (cdiv(M, bm), max(cdiv(R, br), int(quant))))(  # quant: every row block, even at r = 0
        a, b, out, mk, q, sq, M, K, R, a.stride(0), b.stride(0), b.stride(1), out.stride(0), stride_mk, q.stride(0),
        inv_keep, HAS_MASK=mask is not None, DOT_DT=dot_dt, IEEE=ieee, SPLIT=split, QUANT=quant, INTERPRET=interpreting(),
        BLOCK_M=bm, BLOCK_K=bk, BLOCK_R=br, QUANT_BLOCK_K=qbk, num_warps=warps, num_stages=stages)
    return (out, q, sq) if quant else out


def project_grad(v: torch.Tensor, a: torch.Tensor, mask=None, p: float = 0.0, s: float = 1.0,
                 out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """s * v^T @ a' [r, K] in out_dtype (a' = a * mask / (1 - p) with a mask); see the module docstring."""
    M, K = a.shape
    a = check_activation(a, "a", K)
    R = v.shape[1]
    if M == 0:
        return torch.zeros(R, K, dtype=out_dtype, device=a.device)
    mk, stride_mk, inv_keep = _mask_args(mask, p, a)
    dot_dt, ieee, split = split_dtype(a.dtype, v.dtype)
    if interpreting():
        bm, bk, br, stages, warps, splits = 16, 32, block_r(R), 1, 4, 2
    else:
        bm, bk, br, stages, warps = project_grad_launch(ieee, R, split)
        programs = cdiv(K, bk) * cdiv(R, br)
        target = 4 * sm_props(a.device)[0]
        splits = max(1, min(cdiv(M, bm * 4), cdiv(target, programs)))
    rows = cdiv(cdiv(M, splits), bm) * bm
    splits = cdiv(M, rows)
    out = alloc((R, K), out_dtype, a.device)
    part = out if splits == 1 else torch.empty(splits, R, K, dtype=torch.float32, device=a.device)
    launch(project_grad_kernel, (cdiv(K, bk), cdiv(R, br), splits))(
        v, a, part, mk, M, K, R, rows, v.stride(0), v.stride(1), a.stride(0), stride_mk, inv_keep, float(s),
        HAS_MASK=mask is not None, DOT_DT=dot_dt, IEEE=ieee, SPLIT=split, FINAL=splits == 1, BLOCK_M=bm, BLOCK_K=bk, BLOCK_R=br,
        num_warps=warps, num_stages=stages)
    if splits > 1:
        block = 64 if interpreting() else 1024
        launch(sum_splits_kernel, (cdiv(R * K, block),))(part, out, splits, R * K, float(s), BLOCK=block,
                                                                num_warps=4, num_stages=1)
    return out
