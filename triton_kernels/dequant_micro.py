"""One pass from a microscaled weight (dorafp8/quant.py, "Microscaled weights") to a 16-bit (or fp32) copy, for the
cuBLAS strategy (dorafp8/backends/cublas.py), in tiles, with the factors applied in fp32 registers:

    NVFP4: W[j, k] = cdt(e2m1(w8)[j, k] * (fp32(scale[j, k // 16]) * global))   w8 uint8 [N, K/2], two codes a byte
    MXFP8: W[j, k] = cdt(fp32(w8[j, k]) * 2^(e[j, k // 32] - 127))               w8 e4m3 [N, K], e the e8m0 bytes

each product rounded once, as dorafp8.quant.micro_rows forms it (tested bit for bit); docs/ARCHITECTURE.md."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import alloc, cdiv, interpreting, launch
from .dequant import weight_tile
from .epilogue_dot import bf16_value

MICRO_BLOCKS = (64, 128)  # (BLOCK_N, BLOCK_K) on a GPU, as dequant.py's DEQUANT_BLOCKS


def micro_blocks(dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) on a GPU: fp32 outputs take half the rows (64 spilled 16 bytes for MXFP8; inspect)."""
    return (MICRO_BLOCKS[0] // 2, MICRO_BLOCKS[1]) if dtype == torch.float32 else MICRO_BLOCKS
E8M0 = torch.float8_e8m0fnu


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
def micro_tile(w_ptr, scale_ptr, g_ptr, rows, row_ok, k0, K, stride_w_n, stride_scale_n, NVFP4: tl.constexpr,
               DT: tl.constexpr, R: tl.constexpr, BK: tl.constexpr):
    """W0[rows, k0:k0 + BK] in DT, [R, BK] (rows int64 [R]; masked rows and columns past K are 0): the module
    docstring's products in fp32, rounded once to DT, the same bits on a GPU and in the interpreter (whose fp32 ->
    bf16 cast truncates: bf16_value rounds to nearest even first, then the cast is exact). The GEMMs' main loop reads
    its weight tiles through it (gemm.py; the dgrad transposes the tile), this module's kernel its copy.

    NVFP4 (BK a multiple of 16, k0 too): the tile's BK / 2 packed bytes and BK / 16 scales a row are loaded as they lie
    and widened in registers (the codes interleaved low nibble first, each scale repeated 16 times), so that no
    per-element address is formed: one formed per element (byte k // 2, scale k // 16) spilled up to 1.3 KB on sm_90a.
    MXFP8: the e4m3 tile loaded as it lies, its e8m0 byte gathered per element (L1 hits)."""
    if NVFP4:
        offs_b = k0 // 2 + tl.arange(0, BK // 2)
        byte = tl.load(w_ptr + rows[:, None] * stride_w_n + offs_b[None, :],
                       mask=row_ok[:, None] & (offs_b < K // 2)[None, :], other=0).to(tl.int32)
        w = tl.interleave(e2m1_to_f32(byte & 15), e2m1_to_f32(byte >> 4))
        offs_s = k0 // 16 + tl.arange(0, BK // 16)
        sc = tl.load(scale_ptr + rows[:, None] * stride_scale_n + offs_s[None, :],
                     mask=row_ok[:, None] & (offs_s < K // 16)[None, :], other=0.0)
        f = sc.to(tl.float32) * tl.load(g_ptr)  # the block's factor in fp32 first, as ModelOpt's dequantize forms it
        f = tl.reshape(tl.broadcast_to(f[:, :, None], (R, BK // 16, 16)), (R, BK))
    else:
        offs_k = k0 + tl.arange(0, BK)
        ok = row_ok[:, None] & (offs_k < K)[None, :]
        w = tl.load(w_ptr + rows[:, None] * stride_w_n + offs_k[None, :], mask=ok, other=0.0).to(tl.float32)
        e = tl.load(scale_ptr + rows[:, None] * stride_scale_n + (offs_k // 32)[None, :], mask=ok, other=127)
        f = e8m0_to_f32(e.to(tl.int32))
    w = w * f
    if DT == tl.bfloat16:
        w = bf16_value(w)
    return w.to(DT)


@triton.jit
def dequant_micro_kernel(
    w_ptr, scale_ptr, g_ptr, out_ptr,
    N, K,
    stride_w_n, stride_scale_n, stride_out_n,
    NVFP4: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    _, pid_k, offs_n, offs_k, mask_n, ok, rows = weight_tile(N, K, BLOCK_N, BLOCK_K)
    w = micro_tile(w_ptr, scale_ptr, g_ptr, rows, mask_n, pid_k * BLOCK_K, K, stride_w_n, stride_scale_n, NVFP4,
                   out_ptr.dtype.element_ty, BLOCK_N, BLOCK_K)
    tl.store(out_ptr + rows[:, None] * stride_out_n + offs_k[None, :], w, mask=ok)


def micro_args(w8: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor | None):
    """(N, K, nvfp4, sc, g): a microscaled weight's sizes, its scale (e8m0 bytes as uint8) and global scale (MXFP8's a
    placeholder) as the kernels read them; checks what their addressing needs."""
    nvfp4 = w8.dtype == torch.uint8
    if nvfp4 != (scale.dtype == torch.float8_e4m3fn) or (not nvfp4 and scale.dtype != E8M0):
        raise ValueError(f"w8 {w8.dtype} with scale {scale.dtype} is neither NVFP4 (uint8, float8_e4m3fn) nor MXFP8 "
                         f"(float8_e4m3fn, float8_e8m0fnu)")
    if nvfp4 and (global_scale is None or global_scale.dtype != torch.float32 or global_scale.numel() != 1):
        raise ValueError("global_scale must be one fp32 value for an NVFP4 weight")
    if w8.stride(1) != 1 or scale.stride(1) != 1:
        raise ValueError("w8 and scale must have unit stride in their last dim")
    sc = scale if nvfp4 else scale.view(torch.uint8)
    return w8.shape[0], w8.shape[1] * (2 if nvfp4 else 1), nvfp4, sc, global_scale if nvfp4 else sc


def dequant_micro(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, global_scale: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """W0 [N, K] in `dtype` of an NVFP4 weight (w8 uint8 [N, K/2], scale e4m3 [N, K/16], global_scale fp32 []) or an
    MXFP8 one (w8 e4m3 [N, K], scale e8m0 [N, ceil(K/32)]); rows may be strided (a block of a weight's rows)."""
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    N, K, nvfp4, sc, g = micro_args(w8, scale, global_scale)
    out = alloc((N, K), dtype, w8.device)
    if N == 0 or K == 0:
        return out
    bn, bk = (16, 32) if interpreting() else micro_blocks(dtype)
    launch(dequant_micro_kernel, (cdiv(N, bn), cdiv(K, bk)))(
        w8, sc, g, out,
        N, K, w8.stride(0), sc.stride(0), out.stride(0),
        NVFP4=nvfp4, BLOCK_N=bn, BLOCK_K=bk,
    )
    return out


def weight_norm_micro(w8, scale, A, B, s, global_scale=None):
    """Row norms of W0 + s B A (torch) for a microscaled W0 dequantized to fp32 in blocks of at most 16 MiB."""
    from ..quant import row_blocks, weight_dims

    N, K = weight_dims(w8)
    A32 = A.float()
    n = torch.empty(N, dtype=torch.float32, device=w8.device)
    for j0, j1 in row_blocks(N, K):
        v = dequant_micro(w8[j0:j1], scale[j0:j1], torch.float32, global_scale)
        v.addmm_(B[j0:j1].float(), A32, alpha=s)
        n[j0:j1] = torch.linalg.vector_norm(v, dim=1)
    return n
