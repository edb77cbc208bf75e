"""The main loop of the two fp8 GEMMs, forward (dora_fwd_kernel) and dgrad (dora_dgrad_kernel).

Both compute a transposed output tile, out^T = W-tile @ act^T: the W8 tile, converted in registers, is the A operand
wgmma reads from registers. The epilogues stay in the kernels' modules; why: docs/ARCHITECTURE.md, "Design notes"."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_weight, dot, scale_block_size
from .dequant_micro import E8M0, micro_args, micro_tile

MICRO = ("nvfp4", "mxfp8")  # the microscaled SCALE_KINDs (dorafp8/quant.py, "Microscaled weights")
STRIDED = ("block",) + MICRO  # the kinds whose scale grid the kernels address by its row stride


def weight_args(w8, scale, block_size, act_quant, global_scale):
    """(N, K, scale, g, kind): the GEMM launchers' weight check for every kind, with the scale (and NVFP4's global
    scale g; a placeholder otherwise, never read) as the kernels read them. The microscaled kinds run W8A16 only."""
    if w8.dtype != torch.uint8 and scale.dtype != E8M0:
        if global_scale is not None:
            raise ValueError("global_scale is NVFP4's (a uint8 packed w8); got one with an fp8 weight")
        scale, kind = check_weight(w8, scale, block_size, act_quant=act_quant)
        return *w8.shape, scale, scale, kind
    N, K, nvfp4, sc, g = micro_args(w8, scale, global_scale)
    kind = "nvfp4" if nvfp4 else "mxfp8"
    if act_quant:
        raise ValueError(f"act_quant={act_quant!r} (W8A8) with an {kind} weight is not supported by the triton "
                         f"backend (its microscaled loop is W8A16: the weight unpacked to the activations' dtype); use "
                         f"act_quant=None, or backend='reference'")
    return N, K, sc, g, kind


def scale_tag(kind: str, block_size: int):
    """The scale's part of an autotune tag: a microscaled kind's name, else the block size (scale_block_size)."""
    return kind if kind in MICRO else scale_block_size(kind, block_size)


@triton.jit
def w8_to(w, DOT_DT: tl.constexpr, VIA_F32: tl.constexpr):
    """The e4m3 tile w in DOT_DT, exactly (every e4m3 value, subnormals included, is a bf16, fp16 and fp32 value; a
    NaN stays a NaN). With VIA_F32 (_common.w8_via_f32_for: bf16 wherever Triton has no native e4m3 -> bf16 unpack)
    it goes e4m3 -> fp32 -> bf16, which ptxas makes F2FP.F16.E4M3.UNPACK_B + HADD2.F32 + F2FP.BF16.F32.PACK_AB, where
    Triton's e4m3 -> bf16 goes through fp16 and makes every element an F2F.BF16.F16 (the slow conversion pipe: 16 per
    clock per SM on Hopper) plus a PRMT per pair; Triton 3.9 unpacks e4m3 to bf16 natively on Blackwell, and fp16 is
    one unpack either way."""
    if w.dtype == DOT_DT:  # a microscaled tile, converted when it was read (w8_gemm_loop)
        out = w
    elif VIA_F32 and DOT_DT == tl.bfloat16:
        out = w.to(tl.float32).to(DOT_DT)
    else:
        out = w.to(DOT_DT)
    return out


@triton.jit
def _w8_step(w, at, act2_ptrs, acc, acc2, r0, red_ok, mask_m, scale_ptr, s_offs, stride_s_red, mask_out,
             TWO_ACC: tl.constexpr, SCALE_KIND: tl.constexpr, SCALE_BLOCK_SIZE: tl.constexpr,
             ACT_QUANT: tl.constexpr, DOT_DT: tl.constexpr, IEEE: tl.constexpr, W8_VIA_F32: tl.constexpr,
             FP8_PROMOTE: tl.constexpr, B_OUT: tl.constexpr, BLOCK_M: tl.constexpr, A2T=None):
    """One reduction step of both main loops: the W8 tile w [B_OUT, B_RED] and act^T at [B_RED, BLOCK_M] loaded (with
    TWO_ACC, act2^T from act2_ptrs, or given as A2T by the TMA loop), converted and multiplied into (acc, acc2)."""
    if not ACT_QUANT:
        # fp8 -> compute dtype is exact (e4m3 fits fp16 and bf16) and nothing else touches the W8 tile before the dot
        # (on Hopper it is wgmma's register operand): the scale waits for fp32.
        w = w8_to(w, DOT_DT, W8_VIA_F32)
        at = at.to(DOT_DT)
    a2t = at
    if TWO_ACC:
        if A2T is None:
            a2t = tl.load(act2_ptrs, mask=red_ok[:, None] & mask_m[None, :], other=0.0)
        else:
            a2t = A2T
        if not ACT_QUANT:
            a2t = a2t.to(DOT_DT)
    if SCALE_KIND == "block":
        # This step lies in one block along the reduction: scale its partial product per out^T row, in fp32.
        # (scale_ptr + scalar) + s_offs, not pointers + scalar: see the module docstring
        sblk = tl.load(scale_ptr + (r0 // SCALE_BLOCK_SIZE) * stride_s_red + s_offs, mask=mask_out,
                       other=0.0)[:, None]
        acc += dot(w, at, tl.zeros((B_OUT, BLOCK_M), dtype=tl.float32), IEEE) * sblk
        if TWO_ACC:
            acc2 += dot(w, a2t, tl.zeros((B_OUT, BLOCK_M), dtype=tl.float32), IEEE) * sblk
    elif ACT_QUANT and FP8_PROMOTE:
        # fp8 wgmma (Hopper) accumulates in reduced precision: each step's product starts from zero and joins acc
        # in fp32 (_common.fp8_promote_for), like the block-scale steps above.
        acc += dot(w, at, tl.zeros((B_OUT, BLOCK_M), dtype=tl.float32), IEEE)
        if TWO_ACC:
            acc2 += dot(w, a2t, tl.zeros((B_OUT, BLOCK_M), dtype=tl.float32), IEEE)
    else:
        acc = dot(w, at, acc, IEEE)
        if TWO_ACC:
            acc2 = dot(w, a2t, acc2, IEEE)
    return acc, acc2


@triton.jit
def w8_gemm_loop(
    w_ptrs, stride_w_red,    # [B_OUT, B_RED] pointers of the first W8 tile; the W8 stride along the reduction
    act_ptrs, act2_ptrs,     # [B_RED, BLOCK_M] pointers of the first act^T tiles (unit stride in the reduction)
    scale_ptr, s_offs, stride_s_red,  # block scales (read only with them): [B_OUT] offsets of each out^T row's
                             # scale at reduction 0 from scale_ptr; the scale grid's stride along the reduction
    mask_out, mask_m,        # [B_OUT], [BLOCK_M]
    RED,                     # length of the reduction
    TWO_ACC: tl.constexpr,   # act2 given (dropout): a second accumulator act2 W^T shares every W8 tile
    SCALE_KIND: tl.constexpr, SCALE_BLOCK_SIZE: tl.constexpr, ACT_QUANT: tl.constexpr, DOT_DT: tl.constexpr,
    IEEE: tl.constexpr, W8_VIA_F32: tl.constexpr, FP8_PROMOTE: tl.constexpr, B_OUT: tl.constexpr,
    BLOCK_M: tl.constexpr, B_RED: tl.constexpr,
    micro_w=None, micro_rows=None, micro_k0=0, micro_K=0, stride_w_n=0, g_ptr=None,
    MICRO_RED_N: tl.constexpr = False,
):
    """(acc, acc2): fp32 [B_OUT, BLOCK_M] = (act W'^T)^T and (act2 W'^T)^T, W' = W8 with block scales applied per
    reduction block (B_RED divides SCALE_BLOCK_SIZE, so one step lies in one block); per-tensor and per-row scales are
    left to the epilogue. acc2 is zeros (dead code, removed) without TWO_ACC. Masked rows and the ragged end of the
    reduction load zeros, so they add exactly 0. The loads are plain (Triton pipelines them as asynchronous copies,
    cp.async, guarded by CTA-wide barriers); w8_gemm_loop_tma is the same loop on tensor descriptors.

    A microscaled weight (SCALE_KIND "nvfp4" / "mxfp8", W8A16 only) is read through dequant_micro.micro_tile instead
    of w_ptrs: micro_w the weight, stride_w_n its row stride, scale_ptr its scales (row stride stride_s_red), g_ptr
    NVFP4's global scale. The forward's tile is W's rows micro_rows (int64 [B_OUT]) at columns r0.. (the reduction
    is K); the dgrad's (MICRO_RED_N: the reduction runs over W's rows) is W's rows r0.. at columns micro_k0..
    (< micro_K), read as [rows, K], where NVFP4's bytes lie packed along K, and transposed in registers. Every factor
    is applied in fp32 and the product rounded once to DOT_DT, in registers (the cuBLAS strategy's dequantize, without
    the copy): the epilogue sees a scale of 1."""
    offs_red = tl.arange(0, B_RED)
    acc = tl.zeros((B_OUT, BLOCK_M), dtype=tl.float32)
    acc2 = tl.zeros((B_OUT, BLOCK_M), dtype=tl.float32)
    for r0 in range(0, RED, B_RED):
        red_ok = offs_red < RED - r0
        if SCALE_KIND == "nvfp4" or SCALE_KIND == "mxfp8":
            if MICRO_RED_N:  # the dgrad: rows of W along the reduction, its tile [rows, K] transposed
                w = tl.trans(micro_tile(micro_w, scale_ptr, g_ptr, (r0 + offs_red).to(tl.int64), red_ok, micro_k0,
                                        micro_K, stride_w_n, stride_s_red, SCALE_KIND == "nvfp4", DOT_DT, B_RED,
                                        B_OUT))
            else:
                w = micro_tile(micro_w, scale_ptr, g_ptr, micro_rows, mask_out, r0, RED, stride_w_n, stride_s_red,
                               SCALE_KIND == "nvfp4", DOT_DT, B_OUT, B_RED)
        else:
            w = tl.load(w_ptrs, mask=mask_out[:, None] & red_ok[None, :], other=0.0)
            w_ptrs += B_RED * stride_w_red
        at = tl.load(act_ptrs, mask=red_ok[:, None] & mask_m[None, :], other=0.0)
        acc, acc2 = _w8_step(w, at, act2_ptrs, acc, acc2, r0, red_ok, mask_m, scale_ptr, s_offs, stride_s_red,
                             mask_out, TWO_ACC, SCALE_KIND, SCALE_BLOCK_SIZE, ACT_QUANT, DOT_DT, IEEE, W8_VIA_F32,
                             FP8_PROMOTE, B_OUT, BLOCK_M)
        act_ptrs += B_RED  # before act2_ptrs: see the module docstring
        if TWO_ACC:
            act2_ptrs += B_RED
    return acc, acc2


@triton.jit
def w8_gemm_loop_tma(
    w_desc, act_desc, act2_desc,  # tensor descriptors: W8 (or W8^T) [OUT, RED] in [B_OUT, B_RED] boxes, act and act2
                             # [M, RED] in [BLOCK_M, B_RED] boxes (hopper.py makes them)
    off_out, off_m,          # the tile's first out^T row and first activation row
    scale_ptr, s_offs, stride_s_red, mask_out, RED,  # as in w8_gemm_loop
    TWO_ACC: tl.constexpr, SCALE_KIND: tl.constexpr, SCALE_BLOCK_SIZE: tl.constexpr,
    ACT_QUANT: tl.constexpr, DOT_DT: tl.constexpr, IEEE: tl.constexpr, W8_VIA_F32: tl.constexpr,
    FP8_PROMOTE: tl.constexpr, B_OUT: tl.constexpr, BLOCK_M: tl.constexpr, B_RED: tl.constexpr,
):
    """w8_gemm_loop on tensor descriptors (the Hopper main loop, hopper.py): each step's tiles arrive by TMA, which
    zero-fills what lies outside the tensors (rows past N or M, the ragged end of the reduction), so no load is
    masked. Triton pipelines the descriptor loads into a ring of shared-memory stages guarded by mbarriers; under warp
    specialization (the kernels' tile loop) a producer warp issues them and two consumer warpgroups each convert and
    multiply half of the W8 tile, with no CTA-wide barrier in the loop (docs/INSPECT.md, "The Hopper main loop")."""
    acc = tl.zeros((B_OUT, BLOCK_M), dtype=tl.float32)
    acc2 = tl.zeros((B_OUT, BLOCK_M), dtype=tl.float32)
    for r0 in range(0, RED, B_RED):
        w = w_desc.load([off_out, r0])
        at = act_desc.load([off_m, r0]).T
        a2t = at
        if TWO_ACC:
            a2t = act2_desc.load([off_m, r0]).T
        acc, acc2 = _w8_step(w, at, None, acc, acc2, r0, None, None, scale_ptr, s_offs, stride_s_red, mask_out,
                             TWO_ACC, SCALE_KIND, SCALE_BLOCK_SIZE, ACT_QUANT, DOT_DT, IEEE, W8_VIA_F32, FP8_PROMOTE,
                             B_OUT, BLOCK_M, A2T=a2t)
    return acc, acc2
