"""One pass from the fp8 weight to a 16-bit (or fp32) copy, for the cuBLAS strategy (dorafp8/backends/cublas.py):

    W[j, k] = cdt(f[j, k] * w8[j, k]),   f = the scale (per tensor), kappa = max_j |scale[j]| (per row), or
                                          scale[j // b, k // b] (per b x b block), applied in fp32 registers

1 byte read and 2 written per weight (the fp32 temporaries of a PyTorch dequantize moved about 15). Per row the
copy takes kappa, not each row's scale, so that the dgrad's operand (g with the row scales already in it) is not
scaled twice; the same launch writes the factors the epilogues then need, so that no PyTorch op runs between it and
them: fac = [rest..., st] with rest the forward epilogue's scale (per tensor 1, per row scale / kappa [N]) and st the
dgrad epilogue's (per tensor 1, per row 1 / kappa). Block scales are in W entirely (fac = [1, 1], unused).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import alloc, cdiv, check_weight, interpreting, launch
from .epilogue_dot import bf16_value, rank_dot, rank_dot_into

DEQUANT_BLOCKS = (64, 128)  # (BLOCK_N, BLOCK_K) on a GPU: 8 KiB of fp8 in, 16 KiB out a program
# the merged weight's: its fp32 rank-r tile beside W's spilled 16-32 bytes at 64 x 128 (sm_89, sm_100a, inspect)
MERGE_BLOCKS = (64, 64)
SCAN = 1024  # the chunk of the row scales that each program reads to find kappa


@triton.jit
def dequant_w8_kernel(
    w_ptr, scale_ptr, rowf_ptr, out_ptr, fac_ptr, a_ptr, b_ptr, gain_ptr,
    N, K, R,
    stride_w_n, stride_scale_n, stride_out_n, stride_a_r, stride_b_n, s,
    SCALE_KIND: tl.constexpr, SCALE_BLOCK_SIZE: tl.constexpr, HAS_ROWF: tl.constexpr,
    MERGE: tl.constexpr,  # W0 + s B A (the row scales themselves, no kappa, no fac), times *gain_ptr if HAS_GAIN
    HAS_GAIN: tl.constexpr, LORA_DT: tl.constexpr, LORA_IEEE: tl.constexpr, LORA_SPLIT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCAN_N: tl.constexpr,
):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    ok = mask_n[:, None] & (offs_k[None, :] < K)
    rows = offs_n.to(tl.int64)
    w = tl.load(w_ptr + rows[:, None] * stride_w_n + offs_k[None, :], mask=ok, other=0.0).to(tl.float32)
    # "only the first program" masks are tensor comparisons (t * 0 + pid == 0): Triton 3.9's interpreter refuses a
    # mask made from a scalar comparison (an int32 mask)
    two = tl.arange(0, 2)
    first = (two * 0 + pid_n + pid_k) == 0
    if SCALE_KIND == "tensor":
        w = w * tl.load(scale_ptr)
    elif SCALE_KIND == "row" and MERGE:  # the merged weight takes each row's own scale: no epilogue divides it
        w = w * tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)[:, None]
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
    if MERGE or SCALE_KIND != "row":  # fac = [1, 1]: nothing left for an epilogue to scale, written by one program
        tl.store(fac_ptr + two, tl.full((2,), 1.0, tl.float32), mask=first)
    if MERGE:  # W0 + s B A: the rank-r update of this tile in fp32 (exact products, rank_dot), then the gain
        offs_r = tl.arange(0, BLOCK_R)
        lora = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        for r0 in range(0, R, BLOCK_R):
            r_ok = r0 + offs_r < R
            b_t = tl.load(b_ptr + rows[:, None] * stride_b_n + (r0 + offs_r)[None, :],
                          mask=mask_n[:, None] & r_ok[None, :], other=0.0)
            a_t = tl.load(a_ptr + (r0 + offs_r)[:, None].to(tl.int64) * stride_a_r + offs_k[None, :],
                          mask=r_ok[:, None] & (offs_k[None, :] < K), other=0.0)
            lora = rank_dot_into(lora, b_t, a_t, LORA_DT, LORA_IEEE, LORA_SPLIT)
        w = w + s * lora
        if HAS_GAIN:
            w = w * tl.load(gain_ptr)
    if HAS_ROWF:  # the folded dgrad's column factors of gl, on the weight's rows (after the scale, in fp32)
        w = w * tl.load(rowf_ptr + offs_n, mask=mask_n, other=0.0)[:, None]
    if out_ptr.dtype.element_ty == tl.bfloat16:
        w = bf16_value(w)  # rounded to nearest even, then cast exactly: the interpreter's own cast truncates
    tl.store(out_ptr + rows[:, None] * stride_out_n + offs_k[None, :], w.to(out_ptr.dtype.element_ty), mask=ok)


def _checked(w8, scale, block_size, dtype):
    """(scale, its kind) after the checks both launchers make."""
    row = scale.dim() == 1 and scale.numel() == w8.shape[0]  # [1] for N = 1: a row scale, as quant.scale_kind and
    scale, kind = check_weight(w8, scale, block_size, any_block=True)  # the backward's srow take it, not a tensor's
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    return scale, "row" if row else kind


def dequant_w8(w8: torch.Tensor, scale: torch.Tensor, block_size: int, dtype: torch.dtype,
               rowf: torch.Tensor | None = None):
    """(W, fac): W [N, K] in `dtype` as the module docstring says, and fac fp32 ([N + 1] per row, [2] otherwise):
    fac[:-1] the forward epilogue's scale (per tensor a 0-dim view fac[0] fits), fac[-1] the dgrad epilogue's. Any
    block size (the kernel reads each weight's block scale, it does not step through blocks). rowf, fp32 [N]: a
    factor per row, applied after the scale (the folded dgrad's fl or fb: backends/base.py, FOLD_PARAMS)."""
    scale, kind = _checked(w8, scale, block_size, dtype)
    N, K = w8.shape
    if rowf is not None and (rowf.dtype != torch.float32 or rowf.numel() != N or rowf.device != w8.device):
        raise ValueError(f"rowf must be fp32 [{N}] on {w8.device}, got {rowf.dtype} {tuple(rowf.shape)} on "
                         f"{rowf.device}")
    out = alloc((N, K), dtype, w8.device)
    fac = alloc((N + 1 if kind == "row" else 2,), torch.float32, w8.device)
    if N == 0 or K == 0:
        fac.fill_(1.0)  # kappa over no rows: nothing to scale (fac's per-row part is empty)
        return out, fac
    _launch(w8, scale, kind, block_size, out, fac, rowf=None if rowf is None else rowf.reshape(-1).contiguous())
    return out, fac


def _launch(w8, scale, kind, block_size, out, fac, rowf=None, A=None, B=None, s=0.0, gain=None, merge=False):
    """One dequant_w8_kernel launch over out [N, K] (placeholders for what the call does not use: scale)."""
    N, K = w8.shape
    lora = A is not None
    # (without A the rank constexprs are unused: rank_dot's for r = 1, as inspect_spec compiles them)
    rk = rank_dot((torch.float32,), A.shape[0], A.dtype, B.dtype, split=False) if lora else rank_dot(
        (torch.float32,), 1, torch.float32)
    bn, bk = (16, 32) if interpreting() else MERGE_BLOCKS if merge else DEQUANT_BLOCKS
    ph = scale  # a placeholder pointer, never read
    launch(dequant_w8_kernel, (cdiv(N, bn), cdiv(K, bk)))(
        w8, scale, ph if rowf is None else rowf, out, fac,
        ph if A is None else A, ph if B is None else B, ph if gain is None else gain,
        N, K, A.shape[0] if lora else 0,
        w8.stride(0), scale.stride(0) if kind == "block" else 0, out.stride(0),
        A.stride(0) if lora else 0, B.stride(0) if lora else 0, float(s),
        SCALE_KIND=kind, SCALE_BLOCK_SIZE=block_size if kind == "block" else 1, HAS_ROWF=rowf is not None,
        MERGE=merge, HAS_GAIN=gain is not None, **rk,
        BLOCK_N=bn, BLOCK_K=bk,
        SCAN_N=64 if interpreting() else SCAN,
    )


def merged_weight(w8: torch.Tensor, scale: torch.Tensor, block_size: int, dtype: torch.dtype,
                  A: torch.Tensor | None = None, B: torch.Tensor | None = None, s: float = 0.0,
                  gain: torch.Tensor | None = None):
    """(W, one): W = gain * (W0 + s B A) [N, K] in `dtype`, in one launch: W0 = scale * w8 in fp32 (per tensor, row
    or block), the rank-r term's products exact in fp32, rounded once (1 byte read and 2 written per weight; A [r, K]
    and B [N, r] in any float dtype, unit last stride; both None: W0 alone), and one = fp32 1.0 (0-dim, written by the same launch: the
    scale an epilogue of W's product applies). gain: a 0-dim fp32 tensor on the device, or None (1). For the cuBLAS
    strategy's forward (z = x W^T, no epilogue for the rank-r term) and dgrad (dx = gl (rl W), none at all)."""
    scale, kind = _checked(w8, scale, block_size, dtype)
    N, K = w8.shape
    r = 0 if A is None else A.shape[0]
    if (A is None) != (B is None):
        raise ValueError("A and B come together (the merged weight's rank-r term), or neither")
    if A is not None and (tuple(A.shape) != (r, K) or tuple(B.shape) != (N, r) or A.stride(-1) != 1
                          or B.stride(-1) != 1):
        raise ValueError(f"A must be [r, {K}] and B [{N}, r] with unit last strides, got {tuple(A.shape)} "
                         f"{A.stride()} and {tuple(B.shape)} {B.stride()}")
    if gain is not None and (gain.dtype != torch.float32 or gain.numel() != 1 or gain.device != w8.device):
        raise ValueError(f"gain must be one fp32 value on {w8.device}, got {gain.dtype} {tuple(gain.shape)}")
    out = alloc((N, K), dtype, w8.device)
    fac = alloc((2,), torch.float32, w8.device)
    if N == 0 or K == 0:
        return out, fac.fill_(1.0)[0]
    _launch(w8, scale, kind, block_size, out, fac, A=A, B=B, s=s, gain=gain, merge=True)
    return out, fac[0]


def dequant_w8_ref(w8: torch.Tensor, scale: torch.Tensor, block_size: int, dtype: torch.dtype,
                   rowf: torch.Tensor | None = None):
    """The reference twin of dequant_w8, in PyTorch (fp32 products, rounded once to dtype)."""
    from ..quant import scale_kind, scale_rows

    N, K = w8.shape
    kind = scale_kind(scale)
    if kind == "row":
        kappa = scale.abs().amax() if N else scale.new_ones(())
        f = kappa
        fac = torch.cat([scale / kappa, (1.0 / kappa).reshape(1)])
    else:
        f = scale_rows(scale, block_size, 0, N, K) if kind == "block" else scale
        fac = torch.ones(2, dtype=torch.float32, device=w8.device)
    w = w8.float() * f
    return (w if rowf is None else w * rowf.reshape(-1, 1)).to(dtype), fac


def merged_weight_ref(w8, scale, block_size, dtype, A=None, B=None, s=0.0, gain=None):
    """The reference twin of merged_weight, in PyTorch (fp32, rounded once to dtype)."""
    from ..quant import scale_rows, scale_kind

    N, K = w8.shape
    kind = scale_kind(scale)
    f = scale.reshape(-1, 1) if kind == "row" else scale_rows(scale, block_size, 0, N, K) if kind == "block" else scale
    w = w8.float() * f + (0.0 if A is None else s * (B.float() @ A.float()))
    return (w if gain is None else w * gain).to(dtype), torch.ones((), device=w8.device)
