"""DoRA forward: one GEMM over the fp8 weight with the rank-r correction, magnitude and bias in its epilogue.

    y = c * (x W0^T + s u B^T) + bias,  z = x W0^T + s u B^T,  c = m / n     (dropout and plain forms: see below)

W8A16 converts W8 tiles in registers; W8A8 multiplies e4m3 by e4m3. `_fwd_epilogue` also serves the cuBLAS strategy.
Dropout form and details: docs/ARCHITECTURE.md, "Design notes, by module"."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (alloc, arch_of, autotuned, cdiv, check_activation, check_weight, dot_dtype,
                      fit_reduction_block, fp8_promote, gemm_configs, grouped_tile, launch, m_bucket, magnitude_scale,
                      scale_block_size, vector, w8_via_f32)
from ._pins import gemm_pin
from .epilogue_dot import rank_dot, rank_dot_into, rank_fma_for
from .gemm import MICRO, STRIDED, scale_tag, w8_gemm_loop, w8_gemm_loop_tma, weight_args
from .hopper import (gemm_grid, gemm_main_loop, launch_gemm, rank_pieces, tma_ready, ws_configs_for, ws_plan,
                     ws_rank_dot)


@triton.jit
def _lora_into(t, offs_m, offs_n, mask_m, mask_n, u_ptr, b_ptr, R, stride_u_m, stride_u_r, stride_b_n, stride_b_r,
               LORA_DT: tl.constexpr, LORA_IEEE: tl.constexpr, LORA_SPLIT: tl.constexpr, BLOCK_R: tl.constexpr,
               u_desc=None, b_desc=None, off_m=0, off_n=0):
    """t + (u B^T)^T = t + B u^T on the transposed tile, r in chunks of BLOCK_R (padded to the tl.dot minimum with
    masks), accumulated into t's own registers: no second [BLOCK_N, BLOCK_M] fp32 tile. With descriptors (the
    warp-specialized Hopper loop, whose partitioner takes only TMA loads as a dot's operands: hopper.py) u and B come
    by TMA from the tile's first rows off_m, off_n, zero-filled past R, M and N as the masks would."""
    rows_m = offs_m.to(tl.int64)
    rows_n = offs_n.to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    for r0 in range(0, R, BLOCK_R):
        if u_desc is None:
            r_ok = r0 + offs_r < R
            b_t = tl.load(b_ptr + rows_n[:, None] * stride_b_n + (r0 + offs_r[None, :]) * stride_b_r,
                          mask=mask_n[:, None] & r_ok[None, :], other=0.0)
            ut = tl.load(u_ptr + rows_m[None, :] * stride_u_m + (r0 + offs_r[:, None]) * stride_u_r,
                         mask=r_ok[:, None] & mask_m[None, :], other=0.0)
        else:
            b_t = b_desc.load([off_n, r0])
            ut = u_desc.load([off_m, r0]).T
        t = rank_dot_into(t, b_t, ut, LORA_DT, LORA_IEEE, LORA_SPLIT)
    return t


@triton.jit
def _fwd_epilogue(
    acc, acc_d,  # fp32 [BLOCK_N, BLOCK_M]: (x W8'^T)^T and (xm W8'^T)^T, W8' = w8 with block scales applied
    offs_m, offs_n, mask_m, mask_n,
    sx_ptr, sxm_ptr, scale_ptr, bias_ptr, m_ptr, n_ptr, u_ptr, b_ptr, y_ptr, z_ptr,
    R, stride_u_m, stride_u_r, stride_b_n, stride_b_r, stride_y_m, stride_z_m, s, inv_keep,
    HAS_ADAPTER: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_BIAS: tl.constexpr, NEED_Z: tl.constexpr,
    SCALE_KIND: tl.constexpr, ACT_QUANT: tl.constexpr, HAS_LORA: tl.constexpr, LORA_DT: tl.constexpr,
    LORA_IEEE: tl.constexpr, LORA_SPLIT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, u_desc=None, b_desc=None, off_m=0, off_n=0, bias=None, c=None,
):
    """Everything after the base GEMM, in fp32, on the TRANSPOSED tile [BLOCK_N, BLOCK_M]: per-output-column vectors
    (scale, c, bias) index its rows, per-token vectors (W8A8's row scales) its columns. u_desc, b_desc: the rank-r
    operands by TMA (_lora_into), for the tile at rows off_m of x and off_n of W8. bias, c: the bias and c = m / n
    as [BLOCK_N, 1] fp32, loaded already by the caller (else loaded here, late: after z's store for the bias).

    The rank-r term is accumulated into the base accumulator itself, as t = base / s + u B^T, then times s (HAS_LORA:
    s != 0; with s == 0 the term vanishes): one fp32 tile of registers, not two. With dropout both accumulators get it
    (y = s * (base / s + u B^T) + (c - 1) * z, z = s * (base_d / s + u B^T)), which is the DoRA formula
    y = base + (c - 1) base_d + c s u B^T rearranged, without a third tile."""
    rows_m = offs_m.to(tl.int64)
    if SCALE_KIND == "tensor":
        sc = tl.load(scale_ptr)
    elif SCALE_KIND == "row":  # a column vector of the transposed tile
        sc = tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)[:, None]
    else:  # "block": applied inside the K loop already
        sc = 1.0
    if HAS_ADAPTER:
        if HAS_LORA:
            s_mul = s
        else:
            s_mul = 1.0
        t = acc * (sc / s_mul)
        if ACT_QUANT:
            t = t * tl.load(sx_ptr + offs_m, mask=mask_m, other=0.0)[None, :]
        if HAS_LORA:
            t = _lora_into(t, offs_m, offs_n, mask_m, mask_n, u_ptr, b_ptr, R, stride_u_m, stride_u_r, stride_b_n,
                           stride_b_r, LORA_DT, LORA_IEEE, LORA_SPLIT, BLOCK_R, u_desc, b_desc, off_m, off_n)
        if c is None:
            c = magnitude_scale(m_ptr, n_ptr, offs_n, mask_n)[:, None]
        if HAS_DROPOUT:
            t_d = acc_d * (sc * inv_keep / s_mul)  # xd W0^T = (xm W0^T) / (1 - p)
            if ACT_QUANT:
                t_d = t_d * tl.load(sxm_ptr + offs_m, mask=mask_m, other=0.0)[None, :]
            if HAS_LORA:
                t_d = _lora_into(t_d, offs_m, offs_n, mask_m, mask_n, u_ptr, b_ptr, R, stride_u_m, stride_u_r,
                                 stride_b_n, stride_b_r, LORA_DT, LORA_IEEE, LORA_SPLIT, BLOCK_R, u_desc, b_desc,
                                 off_m, off_n)
            z = t_d * s_mul
            y = t * s_mul + (c - 1.0) * z
        else:
            z = t * s_mul
            y = c * z
        if NEED_Z:
            z_ptrs = z_ptr + rows_m[None, :] * stride_z_m + offs_n[:, None]
            tl.store(z_ptrs, z.to(z_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_m[None, :])
    else:
        y = acc * sc
        if ACT_QUANT:
            y = y * tl.load(sx_ptr + offs_m, mask=mask_m, other=0.0)[None, :]
    if HAS_BIAS:
        if bias is None:
            bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        y += bias
    y_ptrs = y_ptr + rows_m[None, :] * stride_y_m + offs_n[:, None]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_m[None, :])


@triton.jit
def dora_fwd_kernel(
    x_ptr, xm_ptr, sx_ptr, sxm_ptr, w_ptr, scale_ptr, g_ptr, bias_ptr, m_ptr, n_ptr, u_ptr, b_ptr, y_ptr, z_ptr,
    M, N, K, R,
    M_BUCKET,  # autotune key only
    # Strides (x, xm, y, z, w8 have unit stride in their last dim)
    stride_x_m, stride_xm_m, stride_w_n, stride_scale_n, stride_u_m, stride_u_r, stride_b_n, stride_b_r,
    stride_y_m, stride_z_m,
    s, inv_keep,
    HAS_ADAPTER: tl.constexpr,  # m, n, u, B given (else plain FP8 linear); c = m / n in the epilogue
    HAS_DROPOUT: tl.constexpr,  # xm given: a second accumulator xm W8^T shares every W8 tile
    HAS_BIAS: tl.constexpr,
    NEED_Z: tl.constexpr,
    SCALE_KIND: tl.constexpr,   # "tensor" / "row" (epilogue) / "block" (inside the K loop): see check_weight;
                                # "nvfp4" / "mxfp8" (microscaled: in the W tile, W8A16 only; g_ptr NVFP4's global)
    SCALE_BLOCK_SIZE: tl.constexpr,  # b of the b x b block scales (1 for the other kinds); BLOCK_K divides it
    ACT_QUANT: tl.constexpr,    # x, xm are e4m3 with row scales sx, sxm (W8A8); else in the compute dtype
    HAS_LORA: tl.constexpr,     # s != 0: the rank-r term is there
    DOT_DT: tl.constexpr,       # W8A16: dtype both tl.dot operands are converted to in registers
    IEEE: tl.constexpr,
    W8_VIA_F32: tl.constexpr,   # how the W8 tile becomes DOT_DT: gemm.w8_to
    FP8_PROMOTE: tl.constexpr,  # W8A8: wgmma's fp8 partial sums join the fp32 accumulator every step (sm_90)
    LORA_DT: tl.constexpr,      # dtype of the rank-r epilogue's tl.dot operands (the rank dtype, or fp32)
    LORA_IEEE: tl.constexpr,
    LORA_SPLIT: tl.constexpr,   # fp32 rank operands, 16-bit output: epilogue_dot.split_dot on tensor cores
    BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    MAIN_LOOP: tl.constexpr,    # "async-copy" (one program per tile) or "tma-ws" (persistent): hopper.py
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    x_desc, xm_desc, w_desc, u_desc, b_desc = None, None, None, None, None  # "async-copy": pointers
    first, last, step = 0, 1, 1  # "async-copy": a program per tile, so the tile loop runs once (folded away)
    if MAIN_LOOP != "async-copy":
        # Descriptors made once per program; TMA zero-fills outside [M, K] and [N, K] (hopper.tma_ready checked
        # the alignment it needs). The tile loop: this program's tiles in grouped order, every num_programs-th.
        x_desc = tl.make_tensor_descriptor(x_ptr, [M, K], [stride_x_m, 1], [BLOCK_M, BLOCK_K])
        xm_desc = x_desc
        if HAS_DROPOUT:
            xm_desc = tl.make_tensor_descriptor(xm_ptr, [M, K], [stride_xm_m, 1], [BLOCK_M, BLOCK_K])
        w_desc = tl.make_tensor_descriptor(w_ptr, [N, K], [stride_w_n, 1], [BLOCK_N, BLOCK_K])
        if HAS_ADAPTER and HAS_LORA:  # the rank-r operands by TMA too (_lora_into says why)
            u_desc = tl.make_tensor_descriptor(u_ptr, [M, R], [stride_u_m, 1], [BLOCK_M, BLOCK_R])
            b_desc = tl.make_tensor_descriptor(b_ptr, [N, R], [stride_b_n, 1], [BLOCK_N, BLOCK_R])
        first, last, step = tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0)
    for tile in tl.range(first, last, step, warp_specialize=MAIN_LOOP == "tma-ws"):
        pid_m, pid_n = grouped_tile(num_pid_m, num_pid_n, GROUP_M, None if MAIN_LOOP == "async-copy" else tile)
        _fwd_tile(pid_m, pid_n, x_desc, xm_desc, w_desc, u_desc, b_desc,
                  x_ptr, xm_ptr, sx_ptr, sxm_ptr, w_ptr, scale_ptr, g_ptr, bias_ptr, m_ptr, n_ptr, u_ptr, b_ptr,
                  y_ptr, z_ptr, M, N, K, R, stride_x_m, stride_xm_m, stride_w_n, stride_scale_n, stride_u_m,
                  stride_u_r, stride_b_n, stride_b_r, stride_y_m, stride_z_m, s, inv_keep,
                  HAS_ADAPTER, HAS_DROPOUT, HAS_BIAS, NEED_Z, SCALE_KIND, SCALE_BLOCK_SIZE, ACT_QUANT, HAS_LORA,
                  DOT_DT, IEEE, W8_VIA_F32, FP8_PROMOTE, LORA_DT, LORA_IEEE, LORA_SPLIT, BLOCK_R, BLOCK_M, BLOCK_N,
                  BLOCK_K, MAIN_LOOP)


@triton.jit
def _fwd_tile(
    pid_m, pid_n, x_desc, xm_desc, w_desc, u_desc, b_desc,  # the tile; descriptors (None for "async-copy")
    x_ptr, xm_ptr, sx_ptr, sxm_ptr, w_ptr, scale_ptr, g_ptr, bias_ptr, m_ptr, n_ptr, u_ptr, b_ptr, y_ptr, z_ptr,
    M, N, K, R, stride_x_m, stride_xm_m, stride_w_n, stride_scale_n, stride_u_m, stride_u_r, stride_b_n, stride_b_r,
    stride_y_m, stride_z_m, s, inv_keep,
    HAS_ADAPTER: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_BIAS: tl.constexpr, NEED_Z: tl.constexpr,
    SCALE_KIND: tl.constexpr, SCALE_BLOCK_SIZE: tl.constexpr, ACT_QUANT: tl.constexpr, HAS_LORA: tl.constexpr,
    DOT_DT: tl.constexpr, IEEE: tl.constexpr, W8_VIA_F32: tl.constexpr, FP8_PROMOTE: tl.constexpr,
    LORA_DT: tl.constexpr, LORA_IEEE: tl.constexpr, LORA_SPLIT: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MAIN_LOOP: tl.constexpr,
):
    """One output tile: the main loop (gemm.py) and the epilogue."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # int64 row offsets: M * K reaches 2^31 at M = 64k, K = 32k.
    rows_m = offs_m.to(tl.int64)
    rows_n = offs_n.to(tl.int64)

    # y^T [BLOCK_N, BLOCK_M] = W8 [BLOCK_N, BLOCK_K] @ x^T [BLOCK_K, BLOCK_M], the transposed tile (gemm.py): the W8
    # tile is rows of W8, contiguous in K (K-major, as fp8 MMA wants under W8A8), stepping BLOCK_K along them. The
    # block-scale grid [ceil(N/b), ceil(K/b)] has the output rows as its rows, the reduction along its columns.
    s_offs = (offs_n // SCALE_BLOCK_SIZE).to(tl.int64) * stride_scale_n
    if MAIN_LOOP == "async-copy":
        xt_ptrs = x_ptr + rows_m[None, :] * stride_x_m + offs_k[:, None]
        xmt_ptrs = xm_ptr + rows_m[None, :] * stride_xm_m + offs_k[:, None]
        if SCALE_KIND == "nvfp4" or SCALE_KIND == "mxfp8":  # the W tile [rows, K] unpacked in registers (gemm.py)
            acc, acc_d = w8_gemm_loop(w_ptr, 1, xt_ptrs, xmt_ptrs, scale_ptr, s_offs, stride_scale_n, mask_n, mask_m,
                                      K, HAS_DROPOUT, SCALE_KIND, SCALE_BLOCK_SIZE, ACT_QUANT, DOT_DT, IEEE,
                                      W8_VIA_F32, FP8_PROMOTE, BLOCK_N, BLOCK_M, BLOCK_K,
                                      w_ptr, rows_n, 0, K, stride_w_n, g_ptr, False)
        else:
            w_ptrs = w_ptr + rows_n[:, None] * stride_w_n + offs_k[None, :]
            acc, acc_d = w8_gemm_loop(w_ptrs, 1, xt_ptrs, xmt_ptrs, scale_ptr, s_offs, 1, mask_n, mask_m, K,
                                      HAS_DROPOUT, SCALE_KIND, SCALE_BLOCK_SIZE, ACT_QUANT, DOT_DT, IEEE, W8_VIA_F32,
                                      FP8_PROMOTE, BLOCK_N, BLOCK_M, BLOCK_K)
    else:
        acc, acc_d = w8_gemm_loop_tma(w_desc, x_desc, xm_desc, pid_n * BLOCK_N, pid_m * BLOCK_M, scale_ptr, s_offs,
                                      1, mask_n, K, HAS_DROPOUT, SCALE_KIND, SCALE_BLOCK_SIZE, ACT_QUANT, DOT_DT,
                                      IEEE, W8_VIA_F32, FP8_PROMOTE, BLOCK_N, BLOCK_M, BLOCK_K)

    _fwd_epilogue(acc, acc_d, offs_m, offs_n, mask_m, mask_n,
                  sx_ptr, sxm_ptr, scale_ptr, bias_ptr, m_ptr, n_ptr, u_ptr, b_ptr, y_ptr, z_ptr,
                  R, stride_u_m, stride_u_r, stride_b_n, stride_b_r, stride_y_m, stride_z_m, s, inv_keep,
                  HAS_ADAPTER, HAS_DROPOUT, HAS_BIAS, NEED_Z, SCALE_KIND, ACT_QUANT, HAS_LORA, LORA_DT, LORA_IEEE,
                  LORA_SPLIT, BLOCK_R, BLOCK_M, BLOCK_N, u_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N)


@triton.jit
def fwd_epilogue_kernel(
    # Pointers: base = x W8'^T and base_d = xm W8'^T computed elsewhere (cuBLAS), [M, N] in any float dtype
    base_ptr, based_ptr, scale_ptr, bias_ptr, m_ptr, n_ptr, u_ptr, b_ptr, y_ptr, z_ptr,
    M, N, R,
    stride_base_m, stride_based_m, stride_u_m, stride_u_r, stride_b_n, stride_b_r, stride_y_m, stride_z_m,
    s, inv_keep,
    HAS_ADAPTER: tl.constexpr, HAS_DROPOUT: tl.constexpr, HAS_BIAS: tl.constexpr, NEED_Z: tl.constexpr,
    SCALE_KIND: tl.constexpr, HAS_LORA: tl.constexpr, LORA_DT: tl.constexpr, LORA_IEEE: tl.constexpr,
    LORA_SPLIT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows_m = offs_m.to(tl.int64)
    tile = mask_n[:, None] & mask_m[None, :]
    acc = tl.load(base_ptr + rows_m[None, :] * stride_base_m + offs_n[:, None], mask=tile, other=0.0).to(tl.float32)
    acc_d = acc
    if HAS_DROPOUT:
        acc_d = tl.load(based_ptr + rows_m[None, :] * stride_based_m + offs_n[:, None], mask=tile,
                        other=0.0).to(tl.float32)
    # The per-column vectors now, with the tiles: loaded in _fwd_epilogue they waited a round trip of their own
    # after the rank-r dot (c) and after z's store (the bias; a load is not moved past a store).
    bias = None
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    c = None
    if HAS_ADAPTER:
        c = magnitude_scale(m_ptr, n_ptr, offs_n, mask_n)[:, None]
    _fwd_epilogue(acc, acc_d, offs_m, offs_n, mask_m, mask_n,
                  scale_ptr, scale_ptr, scale_ptr, bias_ptr, m_ptr, n_ptr, u_ptr, b_ptr, y_ptr, z_ptr,
                  R, stride_u_m, stride_u_r, stride_b_n, stride_b_r, stride_y_m, stride_z_m, s, inv_keep,
                  HAS_ADAPTER, HAS_DROPOUT, HAS_BIAS, NEED_Z, SCALE_KIND, False, HAS_LORA, LORA_DT, LORA_IEEE,
                  LORA_SPLIT, BLOCK_R, BLOCK_M, BLOCK_N, bias=bias, c=c)


def epilogue_blocks(ieee: bool) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of the stand-alone epilogues (the cuBLAS strategy's): fp32 rank-r dots (ieee: fp32 outputs
    only, since issue 52; fp32 adapters into 16-bit outputs take split_dot) spilled at 32 x 64 with dropout. On sm_90a,
    bf16 with fp32 adapters at r = 16: 59-98 registers at 32 x 64 against 48-94 at 16 x 64 (kernel report), with the
    rank-r FFMAs (128-165 a thread) now 3 HGMMA a term."""
    return (16, 64) if ieee else (32, 64)


def _epilogue_args(M, N, cdt, device, bias, m, n, u, B, need_z, z_dtype, scale):
    """Checks the epilogue's operands; returns (r, u, B, m, n, bias_t, y, z, want_z), placeholders if absent."""
    has_adapter = m is not None
    if has_adapter:
        r = u.shape[1]
        if tuple(u.shape) != (M, r) or tuple(B.shape) != (N, r) or m.numel() != N or n.numel() != N:
            raise ValueError(f"u must be [{M}, r], B [{N}, r], m and n [{N}]; got {tuple(u.shape)}, "
                             f"{tuple(B.shape)}, {tuple(m.shape)}, {tuple(n.shape)}")
        m, n = vector(m), vector(n, torch.float32)
    else:
        ph = scale.reshape(-1)[:1].reshape(1, 1)
        r, u, B, m, n = 1, ph, ph, scale, scale  # placeholders, never read
    if bias is not None and bias.numel() != N:
        raise ValueError(f"bias must have {N} elements, got {tuple(bias.shape)}")
    bias_t = bias.reshape(-1).contiguous() if bias is not None else scale
    y = alloc((M, N), cdt, device)
    want_z = has_adapter and bool(need_z)
    z = alloc((M, N), z_dtype, device) if want_z else y
    return r, u, B, m, n, bias_t, y, z, want_z


def _inv_keep(p: float) -> float:
    return 1.0 / (1.0 - p) if p < 1.0 else 0.0


def forward(x, w8, scale, block_size, bias, m, n, u, B, s, xm, p, need_z, z_dtype, act_quant, x8=None, sx=None,
            global_scale=None):
    """(y, z); see dorafp8/backends/base.py. x, xm [M, K], u [M, r] may have any row stride. x8, sx: x already
    quantized per row (W8A8, by project(quant=True): base.py, QUANT_PARAMS). A microscaled weight (NVFP4 with its
    global_scale, MXFP8) is unpacked in the main loop's registers (gemm.py): W8A16 on the cp.async loop only."""
    N, K, scale, g, kind = weight_args(w8, scale, block_size, act_quant, global_scale)
    x = check_activation(x, "x", K)
    M, cdt = x.shape[0], x.dtype
    has_adapter = m is not None
    has_dropout = has_adapter and xm is not None
    if has_dropout:
        xm = check_activation(xm, "xm", K)
        if xm.shape[0] != M:
            raise ValueError(f"xm must be [{M}, {K}], got {list(xm.shape)}")
    else:
        xm = x
    r, u, B, m, n, bias_t, y, z, want_z = _epilogue_args(M, N, cdt, x.device, bias, m, n, u, B, need_z, z_dtype,
                                                         scale)
    if M == 0 or N == 0:
        return y, (z if want_z else None)

    quant = bool(act_quant)
    if x8 is not None and (not quant or tuple(x8.shape) != (M, K) or x8.dtype != torch.float8_e4m3fn
                           or sx is None or sx.numel() != M):
        got_sx = None if sx is None else list(sx.shape)
        raise ValueError(f"x8, sx are x quantized for act_quant='rowwise': e4m3 [{M}, {K}] and fp32 [{M}]; got "
                         f"act_quant={act_quant!r}, x8 {x8.dtype} {list(x8.shape)}, sx {got_sx}")
    if quant:
        from .quant import rowwise_quant

        x, sx = (x8, vector(sx, torch.float32)) if x8 is not None else rowwise_quant(x)
        xm, sxm = rowwise_quant(xm) if has_dropout else (x, sx)
    else:
        sx = sxm = scale  # placeholders, never read
    dot_dt, ieee = dot_dtype(cdt)
    ieee = ieee and not quant  # e4m3 x e4m3 always runs on tensor cores
    fp32_tiles = cdt == torch.float32 and not quant
    rk = rank_dot((cdt, z.dtype), r, u.dtype, B.dtype)
    main_loop = "async-copy" if kind in MICRO else gemm_main_loop(x.device, fp32_tiles, x, xm, w8)
    main_loop, rank_mode = ws_plan(main_loop, has_dropout, rk if has_adapter and float(s) != 0.0 else None)
    if rank_mode == "direct" and not tma_ready(u, B):
        main_loop, rank_mode = "async-copy", ""
    if main_loop == "async-copy":  # Triton 3.8 serializes some cp.async loops' tensor-core epilogues (rank_fma_for)
        rk = rank_dot((cdt, z.dtype), r, u.dtype, B.dtype, fma=rank_fma_for(arch_of(x.device), False, has_dropout))
    u_k, B_k = rank_pieces(u, B) if rank_mode == "pieces" else (u, B)  # the rank operands as the kernel reads them
    r_k, rk = ws_rank_dot(rank_mode, r, rk)

    def configs():  # made once per tag and arch: see autotuned
        if main_loop == "async-copy":
            lists = gemm_configs(x.device, "BLOCK_N", "BLOCK_K", has_dropout, M, fp32_tiles,
                                 quant and fp8_promote(x.device), quant)
        else:
            lists = ws_configs_for(arch_of(x.device), "BLOCK_N", "BLOCK_K", M, quant)
        return fit_reduction_block(lists, "BLOCK_K", block_size, kind, "BLOCK_N", 2 if has_dropout else 1,
                                   main_loop)

    # W8A8's lists differ: quant in the tag
    tag = ("fwd", has_adapter, has_dropout, M <= 64, fp32_tiles, scale_tag(kind, block_size), quant, main_loop)
    kernel = autotuned(dora_fwd_kernel, tag, configs, ["M_BUCKET", "N", "K", "R"], ["y_ptr", "z_ptr"], x.device,
                       pin=gemm_pin("forward", quant, main_loop))
    launch_gemm(
        kernel, gemm_grid(main_loop, M, N, "BLOCK_N", x.device), main_loop, x.device,
        x, xm, sx, sxm, w8, scale, g, bias_t, m, n, u_k, B_k, y, z,
        M, N, K, r_k, m_bucket(M),
        x.stride(0), xm.stride(0), w8.stride(0), scale.stride(0) if kind in STRIDED else 0, u_k.stride(0),
        u_k.stride(1), B_k.stride(0), B_k.stride(1), y.stride(0), z.stride(0),
        float(s), _inv_keep(p),
        HAS_ADAPTER=has_adapter, HAS_DROPOUT=has_dropout, HAS_BIAS=bias is not None, NEED_Z=want_z,
        SCALE_KIND=kind, SCALE_BLOCK_SIZE=scale_block_size(kind, block_size), ACT_QUANT=quant,
        HAS_LORA=float(s) != 0.0, DOT_DT=dot_dt, IEEE=ieee, W8_VIA_F32=w8_via_f32(x.device),
        FP8_PROMOTE=fp8_promote(x.device), MAIN_LOOP=main_loop, **rk,
    )
    return y, (z if want_z else None)


def forward_epilogue(base, base_d, p, w8, scale, block_size, bias, m, n, u, B, s, need_z, z_dtype, cdt):
    """The forward epilogue alone, on base products computed elsewhere (the cuBLAS strategy): base = x W8'^T and
    base_d = xm W8'^T (None without dropout; p the dropout probability), [M, N] in any float dtype with unit last
    stride, W8' = w8 with block scales already applied (per-tensor and per-row scales are applied here)."""
    scale, kind = check_weight(w8, scale, block_size)
    M, N = base.shape
    has_adapter = m is not None
    has_dropout = has_adapter and base_d is not None
    r, u, B, m, n, bias_t, y, z, want_z = _epilogue_args(M, N, cdt, base.device, bias, m, n, u, B, need_z, z_dtype,
                                                         scale)
    if M == 0 or N == 0:
        return y, (z if want_z else None)
    base_d = base_d if has_dropout else base
    rk = rank_dot((cdt, z.dtype), r, u.dtype, B.dtype)
    bm, bn = epilogue_blocks(rk["LORA_IEEE"])
    grid = (cdiv(M, bm), cdiv(N, bn))
    launch(fwd_epilogue_kernel, grid)(
        base, base_d, scale, bias_t, m, n, u, B, y, z,
        M, N, r,
        base.stride(0), base_d.stride(0), u.stride(0), u.stride(1), B.stride(0), B.stride(1), y.stride(0),
        z.stride(0), float(s), _inv_keep(p),
        HAS_ADAPTER=has_adapter, HAS_DROPOUT=has_dropout, HAS_BIAS=bias is not None, NEED_Z=want_z,
        SCALE_KIND=kind, HAS_LORA=float(s) != 0.0, **rk, BLOCK_M=bm, BLOCK_N=bn,
    )
    return y, (z if want_z else None)
