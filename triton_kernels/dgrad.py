"""DoRA input gradient: one dgrad GEMM over the fp8 weight with the rank-r term s v A in its epilogue.

    no dropout: dx = (g * c) W0 + s v A
    dropout:    dx = g W0 + mask / (1 - p) * ((g * (c - 1)) W0 + s v A)
    plain:      dx = g W0                                                 (c is None)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import _dot, _grouped_tile, alloc, check_activation, autotuned, block_r, check_weight, dot_dtype, gemm_configs, last_dim_unit, m_bucket


@triton.jit
def _dora_dgrad_kernel(
    # Pointers
    g_ptr, w_ptr, scale_ptr, scale_out_ptr, c_ptr, v_ptr, a_ptr, mask_ptr, dx_ptr,
    # Sizes
    M, N, K, R,
    M_BUCKET,  # autotune key only
    # Strides (g, dx, mask, w8 have unit stride in their last dim)
    stride_g_m, stride_w_n, stride_v_m, stride_v_r, stride_a_r, stride_a_k, stride_mask_m, stride_dx_m,
    # Scalars
    s, inv_keep,
    # Meta-parameters
    HAS_ADAPTER: tl.constexpr,  # c, v, A given (else plain dx = g W0)
    HAS_DROPOUT: tl.constexpr,  # mask given: a second accumulator g ((c - 1) W0) shares every g tile
    ROW_SCALE: tl.constexpr,    # scale_ptr holds scale / max(scale) per row, scale_out_ptr max(scale)
    DOT_DT: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,      # output columns (the K of x)
    BLOCK_N: tl.constexpr,      # reduction chunk (the N of y)
    GROUP_M: tl.constexpr,
):
    # Grouped order over the [M, K] output, as in the forward: neighbouring programs share W8 column-blocks.
    pid_m, pid_k = _grouped_tile(tl.cdiv(M, BLOCK_M), tl.cdiv(K, BLOCK_K), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_k = offs_k < K
    rows_m = offs_m.to(tl.int64)  # M * K and M * N reach 2^31

    # Transposed tile, as in the forward ("swap AB"): dx^T [BLOCK_K, BLOCK_M] = W0'^T [BLOCK_K, BLOCK_N] @ g^T.
    # gc W0 == g (diag(c) W0): c (and the per-row scale) scale W8's rows, so they fold into the W8 tile that is
    # converted in registers anyway and feeds wgmma from registers, while g streams to shared memory untouched.
    # (Folding c into g instead would need a registers -> shared memory round trip of g every step.)
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_w_n + offs_k[:, None]
    gt_ptrs = g_ptr + rows_m[None, :] * stride_g_m + offs_n[:, None]

    acc = tl.zeros((BLOCK_K, BLOCK_M), dtype=tl.float32)
    acc_m = tl.zeros((BLOCK_K, BLOCK_M), dtype=tl.float32)  # dead code (removed) without dropout
    for n0 in range(0, N, BLOCK_N):
        n_ok = offs_n < N - n0
        wt = tl.load(w_ptrs, mask=mask_k[:, None] & n_ok[None, :], other=0.0)
        gt = tl.load(gt_ptrs, mask=n_ok[:, None] & mask_m[None, :], other=0.0).to(DOT_DT)
        if ROW_SCALE:
            # Relative scales (max 1); the max is applied in the fp32 epilogue, which keeps w8 * scale * (c - 1)
            # out of fp16's subnormal range (absolute scales ~1e-5..1e-3 times c - 1 ~ 1e-3 would fall into it).
            sc_n = tl.load(scale_ptr + n0 + offs_n, mask=n_ok, other=0.0)[None, :]
        else:
            sc_n = 1.0  # the per-tensor scale is applied in the fp32 epilogue
        if HAS_ADAPTER:
            c = tl.load(c_ptr + n0 + offs_n, mask=n_ok, other=0.0)[None, :]
            w32 = wt.to(tl.float32)
            if HAS_DROPOUT:
                acc = _dot((w32 * sc_n).to(DOT_DT), gt, acc, IEEE)
                # (c - 1) W0 directly, never (g * c) W0 - g W0: c == 1 at DoRA's init would cancel to noise.
                acc_m = _dot((w32 * ((c - 1.0) * sc_n)).to(DOT_DT), gt, acc_m, IEEE)
            else:
                acc = _dot((w32 * (c * sc_n)).to(DOT_DT), gt, acc, IEEE)
        else:
            if ROW_SCALE:
                acc = _dot((wt.to(tl.float32) * sc_n).to(DOT_DT), gt, acc, IEEE)
            else:
                acc = _dot(wt.to(DOT_DT), gt, acc, IEEE)  # exact conversion
        gt_ptrs += BLOCK_N
        w_ptrs += BLOCK_N * stride_w_n

    sc = tl.load(scale_out_ptr)
    dx = acc * sc
    if HAS_ADAPTER:
        # (s v A)^T = s A^T v^T for this tile, r in chunks of BLOCK_R.
        lora = tl.zeros((BLOCK_K, BLOCK_M), dtype=tl.float32)
        offs_r = tl.arange(0, BLOCK_R)
        for r0 in range(0, R, BLOCK_R):
            r_ok = r0 + offs_r < R
            at = tl.load(
                a_ptr + (r0 + offs_r[None, :]) * stride_a_r + offs_k[:, None].to(tl.int64) * stride_a_k,
                mask=mask_k[:, None] & r_ok[None, :], other=0.0,
            ).to(DOT_DT)
            vt = tl.load(
                v_ptr + rows_m[None, :] * stride_v_m + (r0 + offs_r[:, None]) * stride_v_r,
                mask=r_ok[:, None] & mask_m[None, :], other=0.0,
            ).to(DOT_DT)
            lora = _dot(at, vt, lora, IEEE)
        lora = lora * s
        if HAS_DROPOUT:
            keep = tl.load(mask_ptr + rows_m[None, :] * stride_mask_m + offs_k[:, None],
                           mask=mask_k[:, None] & mask_m[None, :], other=0)
            dx += tl.where(keep != 0, (acc_m * sc + lora) * inv_keep, 0.0)
        else:
            dx += lora
    dx_ptrs = dx_ptr + rows_m[None, :] * stride_dx_m + offs_k[:, None]
    tl.store(dx_ptrs, dx.to(dx_ptr.dtype.element_ty), mask=mask_k[:, None] & mask_m[None, :])


def dgrad(g, w8, scale, c, v, A, s, mask, p):
    """dx [M, K]; see dorafp8/backends.py. g [M, N], v [M, r] may have any row stride."""
    scale, row = check_weight(w8, scale)
    N, K = w8.shape
    g = check_activation(g, "g", N)
    M, cdt = g.shape[0], g.dtype
    has_adapter = c is not None
    has_dropout = has_adapter and mask is not None
    inv_keep = 1.0
    if has_adapter:
        r = v.shape[1]
        if tuple(v.shape) != (M, r) or tuple(A.shape) != (r, K) or c.numel() != N:
            raise ValueError(f"v must be [{M}, r], A [r, {K}], c [{N}]; got {tuple(v.shape)}, {tuple(A.shape)}, "
                             f"{tuple(c.shape)}")
        c = c.reshape(-1).float().contiguous()
        if has_dropout:
            if tuple(mask.shape) != (M, K) or mask.dtype != torch.bool:
                raise ValueError(f"mask must be bool [{M}, {K}], got {mask.dtype} {tuple(mask.shape)}")
            # bool and uint8 share the byte layout; the view avoids int1 pointer quirks across Triton versions.
            mask = last_dim_unit(mask).view(torch.uint8)
            inv_keep = 1.0 / (1.0 - p) if p < 1.0 else 0.0  # p = 1 keeps nothing: mask is all False
        else:
            mask = g
    else:
        r, v, A, c, mask = 1, g, g, scale, g  # placeholders, never read
    dx = alloc((M, K), cdt, g.device)
    if M == 0 or K == 0:
        return dx

    if row:
        # Per-row scales enter the kernel relative to their max (see the kernel); the max is applied in fp32.
        scale_out = scale.abs().amax().clamp_min(torch.finfo(torch.float32).tiny).reshape(1)
        scale = scale / scale_out
    else:
        scale_out = scale
    dot_dt, ieee = dot_dtype(cdt)
    configs = gemm_configs(g.device, "BLOCK_K", "BLOCK_N", has_dropout, M, cdt == torch.float32)
    tag = ("dgrad", has_adapter, has_dropout, M <= 64, cdt == torch.float32)
    kernel = autotuned(_dora_dgrad_kernel, tag, configs, ["M_BUCKET", "N", "K", "R"], ["dx_ptr"])
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(K, meta["BLOCK_K"]),)
    kernel[grid](
        g, w8, scale, scale_out, c, v, A, mask, dx,
        M, N, K, r, m_bucket(M),
        g.stride(0), w8.stride(0), v.stride(0), v.stride(1), A.stride(0), A.stride(1), mask.stride(0), dx.stride(0),
        float(s), float(inv_keep),
        HAS_ADAPTER=has_adapter, HAS_DROPOUT=has_dropout, ROW_SCALE=row,
        DOT_DT=dot_dt, IEEE=ieee, BLOCK_R=block_r(r),
    )
    return dx
