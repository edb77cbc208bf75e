"""DoRA weight norm n_j = || W0[j, :] + s * (B A)[j, :] ||_2 in one pass over the fp8 weight (W0 = scale * W8 with a
per-tensor, per-row or per-block scale)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (dot, alloc, autotuned, block_r, cdiv, check_weight, dot_dtype, launch, scale_block_size,
                      weight_norm_configs)
from .dequant_micro import E8M0, weight_norm_micro


@triton.jit
def dora_weight_norm_kernel(
    w_ptr, scale_ptr, a_ptr, b_ptr, n_ptr,
    N, K, R,
    stride_w_n, stride_scale_n, stride_a_r, stride_a_k, stride_b_n, stride_b_r,
    s,
    SCALE_KIND: tl.constexpr,   # "tensor" (one value), "row" ([N]), "block" ([ceil(N/b), ceil(K/b)])
    SCALE_BLOCK_SIZE: tl.constexpr,  # b for block scales (1 for the other kinds)
    DOT_DT: tl.constexpr,       # dtype of the B A tl.dot operands
    IEEE: tl.constexpr,         # DOT_DT is fp32: no tf32
    ONE_R_CHUNK: tl.constexpr,  # r <= BLOCK_R: the B tile is loaded once, outside the K loop
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Each program owns BLOCK_N rows and walks all of K, so the row norms need no cross-program reduction and W8 is
    # read exactly once overall.
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows_n = offs_n.to(tl.int64)  # N * K can exceed 2^31
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)

    if SCALE_KIND == "row":
        sc = tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)[:, None]
    elif SCALE_KIND == "tensor":
        sc = tl.load(scale_ptr)

    if ONE_R_CHUNK:
        b_tile = tl.load(
            b_ptr + rows_n[:, None] * stride_b_n + offs_r[None, :] * stride_b_r,
            mask=mask_n[:, None] & (offs_r[None, :] < R), other=0.0,
        ).to(DOT_DT)

    w_ptrs = w_ptr + rows_n[:, None] * stride_w_n + offs_k[None, :]
    # Squares are summed along K at every step into one fp32 value per row: a [BLOCK_N, BLOCK_K] accumulator next to
    # the W8 tile and the B A tile spilled at BLOCK_K = 256 (inspect), and the kernel is bound by reading W8 anyway.
    sq = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        w = tl.load(w_ptrs, mask=mask_n[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        if SCALE_KIND == "block":  # each element's block scale, gathered (the tile may span blocks)
            sc = tl.load(scale_ptr + (offs_n // SCALE_BLOCK_SIZE).to(tl.int64)[:, None] * stride_scale_n
                         + (k0 + offs_k[None, :]) // SCALE_BLOCK_SIZE, mask=mask_n[:, None] & k_ok[None, :], other=0.0)
        w = w * sc
        # Masked rows/columns load zeros in W8, A and B, so they add exactly 0 to the squares.
        ba = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        if ONE_R_CHUNK:
            a_tile = tl.load(
                a_ptr + offs_r[:, None] * stride_a_r + (k0 + offs_k[None, :]).to(tl.int64) * stride_a_k,
                mask=(offs_r[:, None] < R) & k_ok[None, :], other=0.0,
            ).to(DOT_DT)
            ba = dot(b_tile, a_tile, ba, IEEE)
        else:
            for r0 in range(0, R, BLOCK_R):
                r_ok = r0 + offs_r < R
                b_chunk = tl.load(
                    b_ptr + rows_n[:, None] * stride_b_n + (r0 + offs_r[None, :]) * stride_b_r,
                    mask=mask_n[:, None] & r_ok[None, :], other=0.0,
                ).to(DOT_DT)
                a_chunk = tl.load(
                    a_ptr + (r0 + offs_r[:, None]) * stride_a_r + (k0 + offs_k[None, :]).to(tl.int64) * stride_a_k,
                    mask=r_ok[:, None] & k_ok[None, :], other=0.0,
                ).to(DOT_DT)
                ba = dot(b_chunk, a_chunk, ba, IEEE)
        v = w + s * ba
        sq += tl.sum(v * v, axis=1)
        w_ptrs += BLOCK_K

    n = tl.sqrt(sq)
    tl.store(n_ptr + offs_n, n, mask=mask_n)


def weight_norm_block_r(r: int, ieee: bool) -> int:
    """Rank chunk of B A: fp32 adapters (CUDA-core dots) take 16 at a time, as 64 spilled on Ada (block_r's cap)."""
    return block_r(r, ieee)


def weight_norm(w8: torch.Tensor, scale: torch.Tensor, block_size: int, A: torch.Tensor, B: torch.Tensor,
                s: float, global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """n [N] fp32 (backends/base.py); A, B in any float dtype and strides; microscaled: weight_norm_micro."""
    if w8.dtype == torch.uint8 or scale.dtype == E8M0:
        return weight_norm_micro(w8, scale, A, B, s, global_scale)
    scale, kind = check_weight(w8, scale, block_size, any_block=True)  # scales are gathered per element: any b works
    N, K = w8.shape
    r = A.shape[0]
    if A.dim() != 2 or A.shape[1] != K or B.dim() != 2 or tuple(B.shape) != (N, r):
        raise ValueError(f"A must be [r, {K}] and B [{N}, r], got {tuple(A.shape)} and {tuple(B.shape)}")
    n = alloc((N,), torch.float32, w8.device)
    if N == 0:
        return n
    dot_dt, ieee = dot_dtype(A.dtype, B.dtype)
    br = weight_norm_block_r(r, ieee)
    # configs as a function: made once per (ieee, arch), not a list of triton.Configs built and keyed per call
    kernel = autotuned(dora_weight_norm_kernel, ("wn", ieee), lambda: weight_norm_configs(w8.device, fp32=ieee),
                       ["N", "K", "R"], ["n_ptr"], w8.device, pin="weight_norm")
    grid = lambda meta: (cdiv(N, meta["BLOCK_N"]),)
    launch(kernel, grid)(
        w8, scale, A, B, n,
        N, K, r,
        w8.stride(0), scale.stride(0) if kind == "block" else 0, A.stride(0), A.stride(1), B.stride(0),
        B.stride(1),
        float(s),
        SCALE_KIND=kind, SCALE_BLOCK_SIZE=scale_block_size(kind, block_size), DOT_DT=dot_dt, IEEE=ieee,
        ONE_R_CHUNK=r <= br, BLOCK_R=br,
    )
    return n
