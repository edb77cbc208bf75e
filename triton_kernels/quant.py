"""Per-row (per-token) e4m3 quantization of an activation, for the W8A8 mode:

    sigma_i = max_k |t_ik| / 448   (1 for an all-zero row)        t8_ik = e4m3(t_ik / sigma_i), round to nearest even

A program reads its BLOCK_M rows twice (amax, then quantize); the second read mostly hits L2."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import alloc, cdiv, interpreting, launch

E4M3_MAX = tl.constexpr(448.0)  # a constexpr: the only kind of global a compiled kernel may read
QUANT_BLOCKS = (8, 512)  # (BLOCK_M, BLOCK_K) on a GPU
QUANT_STEP = 8192  # elements lowrank.project_kernel's QUANT sweep takes a step (16 KiB of bf16; quant_block_k)


@triton.jit
def _round_to_e4m3(v):
    """v rounded to the nearest e4m3 value (ties to even), as fp32. Only for Triton's interpreter, whose fp32 -> e4m3
    cast gets it wrong when rounding carries into the exponent (124.6 becomes 64 instead of 128): the cast of a value
    that is already on the e4m3 grid is exact there."""
    bits = v.to(tl.int32, bitcast=True)
    # normal range: round the 23-bit mantissa to 3 bits, ties to even; a carry moves into the exponent as it should
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    # subnormal range (|v| < 2^-6): multiples of 2^-9; 24576 = 1.5 * 2^14 has an fp32 ulp of 2^-9
    sub = (v + 24576.0) - 24576.0
    return tl.where(tl.abs(v) >= 0.015625, normal, sub)


@triton.jit
def quant_rows(t_ptr, q_ptr, s_ptr, rows, mask_m, amax, K, stride_t_m, stride_q_m, BLOCK_K: tl.constexpr,
               INTERPRET: tl.constexpr):
    """The second sweep: rows `rows` of t, whose maxima |t| are amax, quantized with sigma = amax / 448 (1 for an
    all-zero row) into q, sigma into s. Shared by rowwise_quant_kernel and lowrank.project_kernel (QUANT)."""
    offs_k = tl.arange(0, BLOCK_K)
    sigma = tl.where(amax > 0, amax / E4M3_MAX, 1.0)
    tl.store(s_ptr + rows, sigma, mask=mask_m)
    for k0 in range(0, K, BLOCK_K):
        ok = mask_m[:, None] & (k0 + offs_k[None, :] < K)
        t = tl.load(t_ptr + rows[:, None] * stride_t_m + k0 + offs_k[None, :], mask=ok, other=0.0).to(tl.float32)
        # div_rn: the correctly rounded quotient (plain '/' is approximate on GPUs), so that ties round as in torch.
        q = tl.clamp(tl.math.div_rn(t, sigma[:, None]), -E4M3_MAX, E4M3_MAX)
        if INTERPRET:
            q = _round_to_e4m3(q)
        tl.store(q_ptr + rows[:, None] * stride_q_m + k0 + offs_k[None, :], q.to(tl.float8e4nv), mask=ok)


@triton.jit
def rowwise_quant_kernel(
    t_ptr, q_ptr, s_ptr,
    M, K,
    stride_t_m, stride_q_m,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    rows = offs_m.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ok = mask_m[:, None] & (k0 + offs_k[None, :] < K)
        t = tl.load(t_ptr + rows[:, None] * stride_t_m + k0 + offs_k[None, :], mask=ok, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(t), axis=1))
    quant_rows(t_ptr, q_ptr, s_ptr, rows, mask_m, amax, K, stride_t_m, stride_q_m, BLOCK_K, INTERPRET)


def rowwise_quant(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(t8 float8_e4m3fn [M, K], sigma fp32 [M]) with t ~= t8 * sigma[:, None]; t [M, K] with unit last stride."""
    M, K = t.shape
    q = alloc((M, K), torch.float8_e4m3fn, t.device)
    sigma = alloc((M,), torch.float32, t.device)
    if M == 0:
        return q, sigma
    bm, bk = (4, 32) if interpreting() else QUANT_BLOCKS
    launch(rowwise_quant_kernel, (cdiv(M, bm),))(t, q, sigma, M, K, t.stride(0), q.stride(0), BLOCK_M=bm,
                                                        BLOCK_K=bk, INTERPRET=interpreting(), num_warps=4)
    return q, sigma
