"""DoRA forward: one GEMM over the fp8 weight with the rank-r correction, magnitude and bias in its epilogue.

    no dropout: y = c * (x W0^T + s u B^T) + bias                      z = x W0^T + s u B^T
    dropout:    y = x W0^T + bias + (c - 1) * (xd W0^T) + c * s u B^T  z = xd W0^T + s u B^T
    plain:      y = x W0^T + bias                                      (c is None)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import _dot, _grouped_tile, alloc, check_activation, autotuned, block_r, check_weight, dot_dtype, gemm_configs, last_dim_unit, m_bucket


@triton.jit
def _dora_fwd_kernel(
    # Pointers
    x_ptr, xd_ptr, w_ptr, scale_ptr, bias_ptr, c_ptr, u_ptr, b_ptr, y_ptr, z_ptr,
    # Sizes
    M, N, K, R,
    M_BUCKET,  # autotune key only
    # Strides (x, xd, y, z, w8 have unit stride in their last dim)
    stride_x_m, stride_xd_m, stride_w_n, stride_u_m, stride_u_r, stride_b_n, stride_b_r, stride_y_m, stride_z_m,
    # Scalars
    s,
    # Meta-parameters
    HAS_ADAPTER: tl.constexpr,  # c, u, B given (else plain FP8 linear)
    HAS_DROPOUT: tl.constexpr,  # xd given: a second accumulator xd W8^T shares every W8 tile
    HAS_BIAS: tl.constexpr,
    NEED_Z: tl.constexpr,
    ROW_SCALE: tl.constexpr,
    DOT_DT: tl.constexpr,       # dtype both tl.dot operands are converted to in registers
    IEEE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _grouped_tile(tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # int64 row offsets: M * K reaches 2^31 at M = 64k, K = 32k.
    rows_m = offs_m.to(tl.int64)
    rows_n = offs_n.to(tl.int64)

    # The program computes the TRANSPOSED tile y^T [BLOCK_N, BLOCK_M] = W8 [BLOCK_N, BLOCK_K] @ x^T [BLOCK_K, BLOCK_M]
    # ("swap AB"): the W8 tile, which must be converted in registers anyway, is then the A operand, which Hopper's
    # wgmma reads straight from registers, while x^T streams to shared memory untouched (async copies, overlapped
    # wgmma). With W8 as the B operand it would take a registers -> shared memory round trip every K step. It also
    # lets BLOCK_M be 16 for small batches (wgmma's N may be small, its M must be 64).
    w_ptrs = w_ptr + rows_n[:, None] * stride_w_n + offs_k[None, :]
    xt_ptrs = x_ptr + rows_m[None, :] * stride_x_m + offs_k[:, None]
    xdt_ptrs = xd_ptr + rows_m[None, :] * stride_xd_m + offs_k[:, None]

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_d = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # dead code (removed) without dropout
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        # fp8 -> compute dtype is exact (e4m3 fits fp16 and bf16); the scale waits for the fp32 epilogue.
        w = tl.load(w_ptrs, mask=mask_n[:, None] & k_ok[None, :], other=0.0).to(DOT_DT)
        xt = tl.load(xt_ptrs, mask=k_ok[:, None] & mask_m[None, :], other=0.0).to(DOT_DT)
        acc = _dot(w, xt, acc, IEEE)
        if HAS_DROPOUT:
            xdt = tl.load(xdt_ptrs, mask=k_ok[:, None] & mask_m[None, :], other=0.0).to(DOT_DT)
            acc_d = _dot(w, xdt, acc_d, IEEE)
            xdt_ptrs += BLOCK_K
        xt_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    # Epilogue, all in fp32, on the transposed tile: per-output-column vectors (scale, c, bias) index its rows.
    if ROW_SCALE:
        sc = tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)[:, None]
    else:
        sc = tl.load(scale_ptr)
    y = acc * sc
    if HAS_ADAPTER:
        # (s u B^T)^T = s B u^T for this tile, r in chunks of BLOCK_R (padded to the tl.dot minimum with masks).
        lora = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        offs_r = tl.arange(0, BLOCK_R)
        for r0 in range(0, R, BLOCK_R):
            r_ok = r0 + offs_r < R
            b_t = tl.load(
                b_ptr + rows_n[:, None] * stride_b_n + (r0 + offs_r[None, :]) * stride_b_r,
                mask=mask_n[:, None] & r_ok[None, :], other=0.0,
            ).to(DOT_DT)
            ut = tl.load(
                u_ptr + rows_m[None, :] * stride_u_m + (r0 + offs_r[:, None]) * stride_u_r,
                mask=r_ok[:, None] & mask_m[None, :], other=0.0,
            ).to(DOT_DT)
            lora = _dot(b_t, ut, lora, IEEE)
        lora = lora * s
        c = tl.load(c_ptr + offs_n, mask=mask_n, other=0.0)[:, None]
        if HAS_DROPOUT:
            base_d = acc_d * sc
            z = base_d + lora
            # (c - 1) * (xd W0^T) rather than c * z - xd W0^T: no cancellation when c is close to 1.
            y = y + (c - 1.0) * base_d + c * lora
        else:
            z = y + lora
            y = c * z
        if NEED_Z:
            z_ptrs = z_ptr + rows_m[None, :] * stride_z_m + offs_n[:, None]
            tl.store(z_ptrs, z.to(z_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_m[None, :])
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    y_ptrs = y_ptr + rows_m[None, :] * stride_y_m + offs_n[:, None]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_m[None, :])


def forward(x, w8, scale, bias, c, u, B, s, xd, need_z):
    """(y, z); see dorafp8/backends.py. x, xd [M, K], u [M, r] may have any row stride."""
    scale, row = check_weight(w8, scale)
    N, K = w8.shape
    x = check_activation(x, "x", K)
    M, cdt = x.shape[0], x.dtype
    has_adapter = c is not None
    has_dropout = has_adapter and xd is not None
    if has_adapter:
        r = u.shape[1]
        if tuple(u.shape) != (M, r) or tuple(B.shape) != (N, r) or c.numel() != N:
            raise ValueError(f"u must be [{M}, r], B [{N}, r], c [{N}]; got {tuple(u.shape)}, {tuple(B.shape)}, "
                             f"{tuple(c.shape)}")
        if has_dropout and tuple(xd.shape) != (M, K):
            raise ValueError(f"xd must be [{M}, {K}], got {tuple(xd.shape)}")
        c = c.reshape(-1).float().contiguous()
        xd = last_dim_unit(xd) if has_dropout else x
    else:
        r, u, B, c, xd = 1, x, x, scale, x  # placeholders, never read
    if bias is not None and bias.numel() != N:
        raise ValueError(f"bias must have {N} elements, got {tuple(bias.shape)}")
    bias_t = bias.reshape(-1).contiguous() if bias is not None else scale
    y = alloc((M, N), cdt, x.device)
    want_z = has_adapter and bool(need_z)
    z = alloc((M, N), cdt, x.device) if want_z else y
    if M == 0 or N == 0:
        return y, (z if want_z else None)

    dot_dt, ieee = dot_dtype(cdt)
    configs = gemm_configs(x.device, "BLOCK_N", "BLOCK_K", has_dropout, M, cdt == torch.float32)
    tag = ("fwd", has_adapter, has_dropout, M <= 64, cdt == torch.float32)
    kernel = autotuned(_dora_fwd_kernel, tag, configs, ["M_BUCKET", "N", "K", "R"], ["y_ptr", "z_ptr"])
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)
    kernel[grid](
        x, xd, w8, scale, bias_t, c, u, B, y, z,
        M, N, K, r, m_bucket(M),
        x.stride(0), xd.stride(0), w8.stride(0), u.stride(0), u.stride(1), B.stride(0), B.stride(1),
        y.stride(0), z.stride(0),
        float(s),
        HAS_ADAPTER=has_adapter, HAS_DROPOUT=has_dropout, HAS_BIAS=bias is not None, NEED_Z=want_z,
        ROW_SCALE=row, DOT_DT=dot_dt, IEEE=ieee, BLOCK_R=block_r(r),
    )
    return y, (z if want_z else None)
