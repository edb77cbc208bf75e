"""One pass from a microscaled weight (dorafp8/quant.py, "Microscaled weights") to a 16-bit (or fp32) copy, for the
cuBLAS strategy (dorafp8/backends/cublas.py), in tiles, with the factors applied in fp32 registers:

    NVFP4: W[j, k] = cdt(e2m1(w8)[j, k] * (fp32(scale[j, k // 16]) * global))   w8 uint8 [N, K/2], two codes a byte
    MXFP8: W[j, k] = cdt(fp32(w8[j, k]) * 2^(e[j, k // 32] - 127))               w8 e4m3 [N, K], e the e8m0 bytes

each product rounded once, as dorafp8.quant.micro_rows forms it (the tests compare bit for bit). How the e2m1 and
e8m0 values are built from their bits: docs/ARCHITECTURE.md, "triton_kernels/dequant_micro.py"."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import alloc, cdiv, interpreting, launch
from .dequant import weight_tile
from .epilogue_dot import bf16_value

MICRO_BLOCKS = (64, 128)  # (BLOCK_N, BLOCK_K) on a GPU, as dequant.py's DEQUANT_BLOCKS


def micro_blocks(dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) on a GPU: fp32 outputs take half the rows (64 spilled 16 bytes on sm_90a, sm_100a and
    sm_120 for MXFP8: python -m dorafp8.kernel_report --kernel dequant_micro)."""
    return (MICRO_BLOCKS[0] // 2, MICRO_BLOCKS[1]) if dtype == torch.float32 else MICRO_BLOCKS
_E8M0 = getattr(torch, "float8_e8m0fnu", None)


@triton.jit
def e2m1_to_f32(code):
    """fp32 value of e2m1 codes (int32 0..15), from their bits."""
    e = (code >> 1) & 3
    m = code & 1
    mag = tl.where(e == 0, m * (126 << 23), ((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def e8m0_to_f32(e):
    """fp32 value 2^(e - 127) of e8m0 bytes (int32 0..255), from their bits; 255 is NaN."""
    bits = tl.where(e == 0, 1 << 22, e << 23)
    return tl.where(e == 255, float("nan"), bits.to(tl.float32, bitcast=True))


@triton.jit
def dequant_micro_kernel(
    w_ptr, scale_ptr, g_ptr, out_ptr,
    N, K,
    stride_w_n, stride_scale_n, stride_out_n,
    NVFP4: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    _, _, offs_n, offs_k, _, ok, rows = weight_tile(N, K, BLOCK_N, BLOCK_K)
    if NVFP4:
        # each byte is read by the two columns it holds (the second read hits L1): codes low nibble first
        byte = tl.load(w_ptr + rows[:, None] * stride_w_n + (offs_k // 2)[None, :], mask=ok, other=0).to(tl.int32)
        w = e2m1_to_f32((byte >> ((offs_k % 2) * 4)[None, :]) & 15)
        sc = tl.load(scale_ptr + rows[:, None] * stride_scale_n + (offs_k // 16)[None, :], mask=ok, other=0.0)
        f = sc.to(tl.float32) * tl.load(g_ptr)  # the block's factor in fp32 first, as ModelOpt's dequantize forms it
    else:
        w = tl.load(w_ptr + rows[:, None] * stride_w_n + offs_k[None, :], mask=ok, other=0.0).to(tl.float32)
        e = tl.load(scale_ptr + rows[:, None] * stride_scale_n + (offs_k // 32)[None, :], mask=ok, other=127)
        f = e8m0_to_f32(e.to(tl.int32))
    w = w * f
    if out_ptr.dtype.element_ty == tl.bfloat16:
        w = bf16_value(w)  # rounded to nearest even, then cast exactly: the interpreter's own cast truncates
    tl.store(out_ptr + rows[:, None] * stride_out_n + offs_k[None, :], w.to(out_ptr.dtype.element_ty), mask=ok)


def dequant_micro(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, global_scale: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """W0 [N, K] in `dtype` (the module docstring) of an NVFP4 weight (w8 uint8 [N, K/2], scale e4m3 [N, K/16],
    global_scale fp32 []) or an MXFP8 one (w8 e4m3 [N, K], scale e8m0 [N, ceil(K/32)]); rows may be strided (a block
    of a weight's rows). The shapes are checked by the ops
    (dorafp8.quant.check_weight); this checks what the kernel's addressing needs."""
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    nvfp4 = w8.dtype == torch.uint8
    if nvfp4 != (scale.dtype == torch.float8_e4m3fn) or (not nvfp4 and scale.dtype != _E8M0):
        raise ValueError(f"w8 {w8.dtype} with scale {scale.dtype} is neither NVFP4 (uint8, float8_e4m3fn) nor MXFP8 "
                         f"(float8_e4m3fn, float8_e8m0fnu)")
    if nvfp4 and (global_scale is None or global_scale.dtype != torch.float32 or global_scale.numel() != 1):
        raise ValueError("global_scale must be one fp32 value for an NVFP4 weight")
    if w8.stride(1) != 1 or scale.stride(1) != 1:
        raise ValueError("w8 and scale must have unit stride in their last dim")
    N, K = w8.shape[0], w8.shape[1] * (2 if nvfp4 else 1)
    out = alloc((N, K), dtype, w8.device)
    if N == 0 or K == 0:
        return out
    bn, bk = (16, 32) if interpreting() else micro_blocks(dtype)
    sc = scale if nvfp4 else scale.view(torch.uint8)  # e8m0 has no Triton dtype: its bytes
    launch(dequant_micro_kernel, (cdiv(N, bn), cdiv(K, bk)))(
        w8, sc, global_scale if nvfp4 else sc, out,  # (MXFP8: sc stands in for the global scale, unread)
        N, K, w8.stride(0), sc.stride(0), out.stride(0),
        NVFP4=nvfp4, BLOCK_N=bn, BLOCK_K=bk,
    )
    return out
