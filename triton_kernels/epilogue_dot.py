"""The rank-r term that the forward and dgrad epilogues add into their output tile (s u B^T, s v A): its tl.dot, and the
choice of how to multiply. With fp32 adapters (PEFT's default) and 16-bit outputs it runs on 16-bit tensor cores as
three bf16 products (split_dot, docs/DORA_MATH.md "Dtype policy"); the kernel report's model counts them
(dorafp8/kernel_report/predict.py, LORA_PIECES)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import block_r, dot, dot_dtype, triton_version

# With fp32 adapters (PEFT's default) and 16-bit outputs: three bf16 tensor-core products instead of an fp32 dot on CUDA
# cores (split_dot). predict.py counts them.
LORA_PIECES = 3


def rank_dot(outs: tuple, r: int, *rank_dtypes: torch.dtype, fma: bool = False) -> dict:
    """The constexprs of an epilogue's rank-r dot (LORA_DT, LORA_IEEE, LORA_SPLIT, BLOCK_R): rank-side operands (u, B or
    v, A) in rank_dtypes, the term landing in outputs of the dtypes `outs` (y and z, or dx). 16-bit rank operands of one
    dtype: tensor cores in that dtype. Otherwise fp32 operands: 16-bit outputs get split_dot (error within 2^-14 of the
    products' magnitudes), an fp32 output exact fp32 products on CUDA cores (ieee). fma=True (rank_fma_for) takes exact
    fp32 products whatever the outputs. The cuBLAS strategy's stand-alone epilogues split too (issue 52)."""
    split = not fma
    if fma:  # the rank operands taken in fp32 and never split: exact fp32 products
        rank_dtypes = (torch.float32,)
    lora_dt, ieee = dot_dtype(*rank_dtypes)
    # fp32 rank operands take chunks of 16 either way: split into four bf16 tiles, chunks of 64 spilled up to 744 bytes
    # on sm_90a at r = 64 (python -m dorafp8.kernel_report --variant fp32-rank)
    br = block_r(r, ieee)
    split = split and ieee and all(d in (torch.float16, torch.bfloat16) for d in outs)
    if split:  # the pieces are bf16 values; the interpreter multiplies them in fp32 (dot_dtype: its bf16 dot is wrong)
        lora_dt, ieee = dot_dtype(torch.bfloat16)
    return dict(LORA_DT=lora_dt, LORA_IEEE=ieee, LORA_SPLIT=split, BLOCK_R=br)


def rank_fma_for(arch: str, dgrad: bool, dropout: bool) -> bool:
    """Whether a GEMM's epilogue takes its rank-r term as exact fp32 FMAs (rank_dot(fma=True)) on `arch`: Hopper under
    Triton 3.8, in the dgrad and the dropout forward, where ptxas serializes the wgmma (C7515) otherwise."""
    return arch == "sm90" and triton_version() == (3, 8) and (dgrad or dropout)


@triton.jit
def bf16_value(v):
    """fp32 v rounded to the nearest bf16 value, ties to even, held in fp32 (an exact cast to bf16 follows): the same
    bits on a GPU and in Triton's interpreter, whose fp32 -> bf16 cast truncates (2^-7 instead of 2^-8)."""
    bits = v.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000).to(tl.float32, bitcast=True)


@triton.jit
def split_dot(a, b, acc, PIECE_DT: tl.constexpr, IEEE: tl.constexpr):
    """acc + a @ b for fp32 tiles on 16-bit tensor cores: a = ah + al with ah = bf16(a), al = bf16(a - ah) (exact
    difference, then rounded: 16 of fp32's 24 significand bits), b likewise, and acc + ah bl + al bh + ah bh. Each
    product is exact in the fp32 accumulator; what is left out (al bl, and the roundings of al and bl) is within
    3 * 2^-16 |a| |b| per term (bf16 rounds to within 2^-8), under 2^-14. bf16 pieces keep fp32's exponent range.
    PIECE_DT is bf16 on a GPU; the interpreter holds the same bf16 values in fp32 (IEEE), its bf16 tl.dot being wrong
    (dot_dtype)."""
    ah = bf16_value(a)
    al = bf16_value(a - ah)
    bh = bf16_value(b)
    bl = bf16_value(b - bh)
    acc = dot(ah.to(PIECE_DT), bl.to(PIECE_DT), acc, IEEE)
    acc = dot(al.to(PIECE_DT), bh.to(PIECE_DT), acc, IEEE)
    return dot(ah.to(PIECE_DT), bh.to(PIECE_DT), acc, IEEE)


@triton.jit
def rank_dot_into(acc, a, b, LORA_DT: tl.constexpr, LORA_IEEE: tl.constexpr, LORA_SPLIT: tl.constexpr):
    """acc + a @ b for the epilogues' rank-r term, as rank_dot chose (a, b loaded in their own dtypes)."""
    if LORA_SPLIT:
        acc = split_dot(a.to(tl.float32), b.to(tl.float32), acc, LORA_DT, LORA_IEEE)
    else:
        acc = dot(a.to(LORA_DT), b.to(LORA_DT), acc, LORA_IEEE)
    return acc
