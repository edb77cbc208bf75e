"""DoRA input gradient: one dgrad GEMM over the fp8 weight with the rank-r term s v A in its epilogue.

    dx = rl * st * (gl W8') + s v A     (dropout: rb * st * (gb W8') + mask / (1 - p) * (...))

gl and gb come from backward.py; W8A8's W8^T and the cuBLAS strategy's use of `_dgrad_epilogue`: docs/ARCHITECTURE.md,
"Design notes, by module"."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (alloc, arch_of, autotuned, cdiv, check_activation, check_weight, dot_dtype,
                      fit_reduction_block, fp8_promote, gemm_configs, grouped_tile, last_dim_unit, launch, m_bucket,
                      scale_block_size, vector, w8_via_f32)
from ._pins import gemm_pin
from .epilogue_dot import rank_dot, rank_dot_into, rank_fma_for
from .forward import epilogue_blocks
from .gemm import MICRO, STRIDED, scale_tag, w8_gemm_loop, w8_gemm_loop_tma, weight_args
from .hopper import (gemm_grid, gemm_main_loop, launch_gemm, rank_pieces, tma_ready, transpose_w8, ws_configs_for,
                     ws_plan, ws_rank_dot)


@triton.jit
def _dgrad_epilogue(
    acc, acc_b,  # fp32 [BLOCK_K, BLOCK_M]: (gl W8')^T and (gb W8')^T
    offs_m, offs_k, mask_m, mask_k,
    sgl_ptr, sgb_ptr, rl_ptr, rb_ptr, scale_ptr, v_ptr, a_ptr, mask_ptr, dx_ptr,
    R, stride_v_m, stride_v_r, stride_a_r, stride_a_k, stride_mask_m, stride_dx_m, s, inv_keep,
    HAS_ADAPTER: tl.constexpr, HAS_DROPOUT: tl.constexpr, SCALE_KIND: tl.constexpr, ACT_QUANT: tl.constexpr,
    HAS_LORA: tl.constexpr, LORA_DT: tl.constexpr, LORA_IEEE: tl.constexpr, LORA_SPLIT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, v_desc=None, a_desc=None, off_m=0, off_k=0,
):
    """Everything after the dgrad GEMM, in fp32, on the TRANSPOSED tile [BLOCK_K, BLOCK_M]. The rank-r term goes into
    the accumulator's own registers (t = base / s + A^T v^T, then times s), as in the forward epilogue; with v_desc and
    a_desc (the warp-specialized Hopper loop: forward._lora_into says why) v and A [r, K] come by TMA for the tile
    at rows off_m of gl and columns off_k of A."""
    rows_m = offs_m.to(tl.int64)
    st = 1.0
    if SCALE_KIND == "tensor":
        st = tl.load(scale_ptr)
    f = tl.load(rl_ptr) * st
    if HAS_ADAPTER and HAS_LORA:
        f = f / s
    dx = acc * f
    if ACT_QUANT:
        dx = dx * tl.load(sgl_ptr + offs_m, mask=mask_m, other=0.0)[None, :]
    if HAS_ADAPTER:
        if HAS_LORA:
            offs_r = tl.arange(0, BLOCK_R)
            for r0 in range(0, R, BLOCK_R):
                if v_desc is None:
                    r_ok = r0 + offs_r < R
                    at = tl.load(a_ptr + (r0 + offs_r[None, :]) * stride_a_r
                                 + offs_k[:, None].to(tl.int64) * stride_a_k,
                                 mask=mask_k[:, None] & r_ok[None, :], other=0.0)
                    vt = tl.load(v_ptr + rows_m[None, :] * stride_v_m + (r0 + offs_r[:, None]) * stride_v_r,
                                 mask=r_ok[:, None] & mask_m[None, :], other=0.0)
                else:
                    at = a_desc.load([r0, off_k]).T
                    vt = v_desc.load([off_m, r0]).T
                dx = rank_dot_into(dx, at, vt, LORA_DT, LORA_IEEE, LORA_SPLIT)
            dx = dx * s
        if HAS_DROPOUT:
            keep = tl.load(mask_ptr + rows_m[None, :] * stride_mask_m + offs_k[:, None],
                           mask=mask_k[:, None] & mask_m[None, :], other=0)
            base = acc_b * (tl.load(rb_ptr) * st)
            if ACT_QUANT:
                base = base * tl.load(sgb_ptr + offs_m, mask=mask_m, other=0.0)[None, :]
            dx = base + tl.where(keep != 0, dx * inv_keep, 0.0)
    dx_ptrs = dx_ptr + rows_m[None, :] * stride_dx_m + offs_k[:, None]
    tl.store(dx_ptrs, dx.to(dx_ptr.dtype.element_ty), mask=mask_k[:, None] & mask_m[None, :])


@triton.jit
def dora_dgrad_kernel(
    gl_ptr, gb_ptr, sgl_ptr, sgb_ptr, rl_ptr, rb_ptr, w_ptr, scale_ptr, g_ptr, v_ptr, a_ptr, mask_ptr, dx_ptr,
    M, N, K, R,
    M_BUCKET,  # autotune key only
    # Strides (gl, gb, dx, mask have unit stride in their last dim; W8 [N, K] or W8^T [K, N] in its rows)
    stride_gl_m, stride_gb_m, stride_w, stride_scale_n, stride_v_m, stride_v_r, stride_a_r, stride_a_k,
    stride_mask_m, stride_dx_m,
    s, inv_keep,
    HAS_ADAPTER: tl.constexpr,  # v, A given (else plain dx = rl * st * (gl W8'))
    HAS_DROPOUT: tl.constexpr,  # gb and mask given: a second accumulator gb W8' shares every W8 tile
    SCALE_KIND: tl.constexpr,   # "tensor" / "row" (already in gl) / "block" (inside the N loop): see check_weight;
                                # "nvfp4" / "mxfp8" (microscaled: in the W tile, W8A16 only; g_ptr NVFP4's global)
    SCALE_BLOCK_SIZE: tl.constexpr,  # b of the b x b block scales (1 for the other kinds); BLOCK_N divides it
    ACT_QUANT: tl.constexpr,    # gl, gb are e4m3 with row scales sgl, sgb (W8A8)
    W8_T: tl.constexpr,         # w_ptr is W8^T [K, N] (reads_w8t), else W8 [N, K]
    HAS_LORA: tl.constexpr,     # s != 0
    DOT_DT: tl.constexpr,
    IEEE: tl.constexpr,
    W8_VIA_F32: tl.constexpr,   # how the W8 tile becomes DOT_DT: gemm.w8_to
    FP8_PROMOTE: tl.constexpr,  # W8A8: wgmma's fp8 partial sums join the fp32 accumulator every step (sm_90)
    LORA_DT: tl.constexpr,
    LORA_IEEE: tl.constexpr,
    LORA_SPLIT: tl.constexpr,   # fp32 rank operands, 16-bit output: epilogue_dot.split_dot on tensor cores
    BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,      # output columns (the K of x)
    BLOCK_N: tl.constexpr,      # reduction chunk (the N of y)
    GROUP_M: tl.constexpr,
    MAIN_LOOP: tl.constexpr,    # "async-copy" (one program per tile) or "tma-ws" (persistent, W8^T): hopper.py
):
    # Grouped order over the [M, K] output, as in the forward: neighbouring programs share W8 column-blocks.
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_k = tl.cdiv(K, BLOCK_K)
    gl_desc, gb_desc, w_desc, v_desc, a_desc = None, None, None, None, None  # "async-copy": pointers
    first, last, step = 0, 1, 1  # "async-copy": a program per tile, so the tile loop runs once (folded away)
    if MAIN_LOOP != "async-copy":
        # w_ptr is W8^T [K, N] (hopper.transpose_w8), so the W8 tile is rows of it, as in the forward; descriptors
        # made once per program, TMA zero-fills outside the tensors. The tile loop as in the forward.
        gl_desc = tl.make_tensor_descriptor(gl_ptr, [M, N], [stride_gl_m, 1], [BLOCK_M, BLOCK_N])
        gb_desc = gl_desc
        if HAS_DROPOUT:
            gb_desc = tl.make_tensor_descriptor(gb_ptr, [M, N], [stride_gb_m, 1], [BLOCK_M, BLOCK_N])
        w_desc = tl.make_tensor_descriptor(w_ptr, [K, N], [stride_w, 1], [BLOCK_K, BLOCK_N])
        if HAS_ADAPTER and HAS_LORA:  # the rank-r operands by TMA too (_dgrad_epilogue)
            v_desc = tl.make_tensor_descriptor(v_ptr, [M, R], [stride_v_m, 1], [BLOCK_M, BLOCK_R])
            a_desc = tl.make_tensor_descriptor(a_ptr, [R, K], [stride_a_r, 1], [BLOCK_R, BLOCK_K])
        first, last, step = tl.program_id(0), num_pid_m * num_pid_k, tl.num_programs(0)
    for tile in tl.range(first, last, step, warp_specialize=MAIN_LOOP == "tma-ws"):
        pid_m, pid_k = grouped_tile(num_pid_m, num_pid_k, GROUP_M, None if MAIN_LOOP == "async-copy" else tile)
        _dgrad_tile(pid_m, pid_k, gl_desc, gb_desc, w_desc, v_desc, a_desc,
                    gl_ptr, gb_ptr, sgl_ptr, sgb_ptr, rl_ptr, rb_ptr, w_ptr, scale_ptr, g_ptr, v_ptr, a_ptr,
                    mask_ptr, dx_ptr, M, N, K, R, stride_gl_m, stride_gb_m, stride_w, stride_scale_n, stride_v_m,
                    stride_v_r, stride_a_r, stride_a_k, stride_mask_m, stride_dx_m, s, inv_keep,
                    HAS_ADAPTER, HAS_DROPOUT, SCALE_KIND, SCALE_BLOCK_SIZE, ACT_QUANT, W8_T, HAS_LORA, DOT_DT, IEEE,
                    W8_VIA_F32, FP8_PROMOTE, LORA_DT, LORA_IEEE, LORA_SPLIT, BLOCK_R, BLOCK_M, BLOCK_K, BLOCK_N,
                    MAIN_LOOP)


@triton.jit
def _dgrad_tile(
    pid_m, pid_k, gl_desc, gb_desc, w_desc, v_desc, a_desc,  # the tile; descriptors (None for "async-copy")
    gl_ptr, gb_ptr, sgl_ptr, sgb_ptr, rl_ptr, rb_ptr, w_ptr, scale_ptr, g_ptr, v_ptr, a_ptr, mask_ptr, dx_ptr,
    M, N, K, R, stride_gl_m, stride_gb_m, stride_w, stride_scale_n, stride_v_m, stride_v_r, stride_a_r, stride_a_k,
    stride_mask_m, stride_dx_m, s, inv_keep,
    HAS_ADAPTER: tl.constexpr, HAS_DROPOUT: tl.constexpr, SCALE_KIND: tl.constexpr,
    SCALE_BLOCK_SIZE: tl.constexpr, ACT_QUANT: tl.constexpr, W8_T: tl.constexpr, HAS_LORA: tl.constexpr,
    DOT_DT: tl.constexpr,
    IEEE: tl.constexpr, W8_VIA_F32: tl.constexpr, FP8_PROMOTE: tl.constexpr, LORA_DT: tl.constexpr,
    LORA_IEEE: tl.constexpr, LORA_SPLIT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, MAIN_LOOP: tl.constexpr,
):
    """One output tile: the main loop (gemm.py) and the epilogue."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_k = offs_k < K
    rows_m = offs_m.to(tl.int64)  # M * K and M * N reach 2^31

    # dx^T [BLOCK_K, BLOCK_M] = W8'^T [BLOCK_K, BLOCK_N] @ gl^T [BLOCK_N, BLOCK_M], the transposed tile (gemm.py), as in
    # the forward but with W8 transposed: its tile is columns of W8, BLOCK_N rows further each step. The block-scale
    # grid [ceil(N/b), ceil(K/b)] has the reduction along its rows, the output columns along its columns.
    s_offs = offs_k // SCALE_BLOCK_SIZE
    if MAIN_LOOP == "async-copy":
        glt_ptrs = gl_ptr + rows_m[None, :] * stride_gl_m + offs_n[:, None]
        gbt_ptrs = gb_ptr + rows_m[None, :] * stride_gb_m + offs_n[:, None]
        if SCALE_KIND == "nvfp4" or SCALE_KIND == "mxfp8":
            # The microscaled W tile is unpacked as the forward's, [rows, K] (NVFP4 packs along K), from W's own
            # [N, K / 2] layout, and transposed in registers (gemm.py): no transposed copy of W.
            acc, acc_b = w8_gemm_loop(w_ptr, stride_w, glt_ptrs, gbt_ptrs, scale_ptr, s_offs, stride_scale_n, mask_k,
                                      mask_m, N, HAS_DROPOUT, SCALE_KIND, SCALE_BLOCK_SIZE, ACT_QUANT, DOT_DT, IEEE,
                                      W8_VIA_F32, FP8_PROMOTE, BLOCK_K, BLOCK_M, BLOCK_N,
                                      w_ptr, offs_n, pid_k * BLOCK_K, K, stride_w, g_ptr, True)
        else:
            if W8_T:  # W8^T [K, N]: the reduction dim N is contiguous (K-major, as mma.sync's fp8 wants it)
                w_ptrs = w_ptr + offs_k.to(tl.int64)[:, None] * stride_w + offs_n[None, :]
                stride_w_red = 1
            else:  # W8 [N, K] (under W8A8 the fp8 tile would be transposed in registers: reads_w8t)
                w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_w + offs_k[:, None]
                stride_w_red = stride_w
            acc, acc_b = w8_gemm_loop(w_ptrs, stride_w_red, glt_ptrs, gbt_ptrs, scale_ptr, s_offs, stride_scale_n,
                                      mask_k, mask_m, N, HAS_DROPOUT, SCALE_KIND, SCALE_BLOCK_SIZE, ACT_QUANT, DOT_DT,
                                      IEEE, W8_VIA_F32, FP8_PROMOTE, BLOCK_K, BLOCK_M, BLOCK_N)
    else:
        acc, acc_b = w8_gemm_loop_tma(w_desc, gl_desc, gb_desc, pid_k * BLOCK_K, pid_m * BLOCK_M, scale_ptr, s_offs,
                                      stride_scale_n, mask_k, N, HAS_DROPOUT, SCALE_KIND, SCALE_BLOCK_SIZE, ACT_QUANT,
                                      DOT_DT, IEEE, W8_VIA_F32, FP8_PROMOTE, BLOCK_K, BLOCK_M, BLOCK_N)

    _dgrad_epilogue(acc, acc_b, offs_m, offs_k, mask_m, mask_k,
                    sgl_ptr, sgb_ptr, rl_ptr, rb_ptr, scale_ptr, v_ptr, a_ptr, mask_ptr, dx_ptr,
                    R, stride_v_m, stride_v_r, stride_a_r, stride_a_k, stride_mask_m, stride_dx_m, s, inv_keep,
                    HAS_ADAPTER, HAS_DROPOUT, SCALE_KIND, ACT_QUANT, HAS_LORA, LORA_DT, LORA_IEEE, LORA_SPLIT,
                    BLOCK_R, BLOCK_M, BLOCK_K, v_desc, a_desc, pid_m * BLOCK_M, pid_k * BLOCK_K)


@triton.jit
def dgrad_epilogue_kernel(
    # Pointers: tl = gl W8' and tb = gb W8' computed elsewhere (cuBLAS), [M, K] in any float dtype
    tl_ptr, tb_ptr, rl_ptr, rb_ptr, scale_ptr, v_ptr, a_ptr, mask_ptr, dx_ptr,
    M, K, R,
    stride_tl_m, stride_tb_m, stride_v_m, stride_v_r, stride_a_r, stride_a_k, stride_mask_m, stride_dx_m,
    s, inv_keep,
    HAS_ADAPTER: tl.constexpr, HAS_DROPOUT: tl.constexpr, SCALE_KIND: tl.constexpr, HAS_LORA: tl.constexpr,
    LORA_DT: tl.constexpr, LORA_IEEE: tl.constexpr, LORA_SPLIT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_k = offs_k < K
    rows_m = offs_m.to(tl.int64)
    tile = mask_k[:, None] & mask_m[None, :]
    acc = tl.load(tl_ptr + rows_m[None, :] * stride_tl_m + offs_k[:, None], mask=tile, other=0.0).to(tl.float32)
    acc_b = acc
    if HAS_DROPOUT:
        acc_b = tl.load(tb_ptr + rows_m[None, :] * stride_tb_m + offs_k[:, None], mask=tile, other=0.0).to(tl.float32)
    _dgrad_epilogue(acc, acc_b, offs_m, offs_k, mask_m, mask_k,
                    rl_ptr, rl_ptr, rl_ptr, rb_ptr, scale_ptr, v_ptr, a_ptr, mask_ptr, dx_ptr,
                    R, stride_v_m, stride_v_r, stride_a_r, stride_a_k, stride_mask_m, stride_dx_m, s, inv_keep,
                    HAS_ADAPTER, HAS_DROPOUT, SCALE_KIND, False, HAS_LORA, LORA_DT, LORA_IEEE, LORA_SPLIT,
                    BLOCK_R, BLOCK_M, BLOCK_K)


def _epilogue_args(M, K, cdt, device, v, A, mask, p, gb, rb, rl):
    """Checks the epilogue's operands; returns (r, v, A, mask, inv_keep, rb, dx) with placeholders for absent ones."""
    has_adapter = v is not None
    has_dropout = has_adapter and mask is not None
    inv_keep = 1.0
    if has_adapter:
        r = v.shape[1]
        if tuple(v.shape) != (M, r) or tuple(A.shape) != (r, K):
            raise ValueError(f"v must be [{M}, r] and A [r, {K}]; got {tuple(v.shape)}, {tuple(A.shape)}")
        if has_dropout:
            if tuple(mask.shape) != (M, K) or mask.dtype != torch.bool:
                raise ValueError(f"mask must be bool [{M}, {K}], got {mask.dtype} {tuple(mask.shape)}")
            if gb is None or rb is None:
                raise ValueError("dropout needs gb and rb (the plain base term's operand and its scalar)")
            # bool and uint8 share the byte layout; the view avoids int1 pointer quirks across Triton versions.
            mask = last_dim_unit(mask).view(torch.uint8)
            inv_keep = 1.0 / (1.0 - p) if p < 1.0 else 0.0  # p = 1 keeps nothing: mask is all False
    else:
        r, v = 1, rl.reshape(1, 1)  # placeholders, never read (2-D: the launch passes their strides)
        A = v
    if not has_dropout:
        mask, rb = rl, rl  # placeholders (mask: the launch passes its row stride only)
    dx = alloc((M, K), cdt, device)
    return r, v, A, mask, inv_keep, (rl if rb is rl else vector(rb, torch.float32)), dx


def reads_w8t(quant: bool, main_loop: str) -> bool:
    """Whether the dgrad reads W8^T [K, N] (hopper.transpose_w8, for the call: 2 N K bytes, a launch) over W8 [N, K]:
    the Hopper loop (TMA) and W8A8 (fp8 MMA wants the reduction dim N contiguous). On wgmma and tcgen05 W8A8 could read
    W8 itself, its fp8 tile transposed in registers (64 PRMT a step, 172 -> 298 instructions: kernel report, sm_90a),
    and mma.sync would read it back a byte at a time (LDS.U8); no GPU has timed that trade, so every GPU keeps W8^T
    (the kernel keeps both addressings: tests/kernels/test_triton_kernels.py checks the direct one)."""
    return main_loop != "async-copy" or quant


def dgrad(gl, rl, w8, scale, block_size, v, A, s, mask, p, gb, rb, act_quant, global_scale=None):
    """dx [M, K]; see dorafp8/backends/base.py. gl, gb [M, N], v [M, r] may have any row stride. A microscaled weight
    (NVFP4 with its global_scale, MXFP8) is unpacked in the main loop's registers, read transposed (_dgrad_tile)."""
    N, K, scale, g, kind = weight_args(w8, scale, block_size, act_quant, global_scale)
    gl = check_activation(gl, "gl", N)
    M, cdt = gl.shape[0], gl.dtype
    has_adapter = v is not None
    has_dropout = has_adapter and mask is not None
    quant = bool(act_quant)
    rl = vector(rl, torch.float32)  # [1]: also the placeholder of what the launch does not read
    r, v, A, mask, inv_keep, rb, dx = _epilogue_args(M, K, cdt, gl.device, v, A, mask, p, gb, rb, rl)
    gb = check_activation(gb, "gb", N) if has_dropout else gl
    if M == 0 or K == 0:
        return dx

    if quant:
        from .quant import rowwise_quant

        gl, sgl = rowwise_quant(gl)
        gb, sgb = rowwise_quant(gb) if has_dropout else (gl, sgl)
    else:
        sgl = sgb = rl  # placeholders, never read
    dot_dt, ieee = dot_dtype(cdt)
    ieee = ieee and not quant
    fp32_tiles = cdt == torch.float32 and not quant
    # The Hopper loop reads W8^T [K, N] (hopper.py says why): TMA must address its rows too (N bytes, 16-aligned)
    main_loop = gemm_main_loop(gl.device, fp32_tiles, gl, gb, w8) if N % 16 == 0 and kind not in MICRO else "async-copy"
    rk = rank_dot((cdt,), r, v.dtype, A.dtype)
    main_loop, rank_mode = ws_plan(main_loop, has_dropout, rk if has_adapter and float(s) != 0.0 else None)
    if rank_mode == "direct" and not tma_ready(v, A):
        main_loop, rank_mode = "async-copy", ""
    if main_loop == "async-copy":  # Triton 3.8 serializes some cp.async loops' tensor-core epilogues (rank_fma_for)
        rk = rank_dot((cdt,), r, v.dtype, A.dtype, fma=rank_fma_for(arch_of(gl.device), True, has_dropout))
    v_k, A_k = rank_pieces(v, A, True) if rank_mode == "pieces" else (v, A)  # the rank operands as the kernel reads
    r_k, rk = ws_rank_dot(rank_mode, r, rk)
    w8t = reads_w8t(quant, main_loop)
    w = transpose_w8(w8) if w8t else w8  # W8^T [K, N]: transient, this call only (see the module docstring)

    def configs():  # made once per tag and arch: see autotuned
        if main_loop == "async-copy":
            lists = gemm_configs(gl.device, "BLOCK_K", "BLOCK_N", has_dropout, M, fp32_tiles,
                                 quant and fp8_promote(gl.device), quant)
        else:
            lists = ws_configs_for(arch_of(gl.device), "BLOCK_K", "BLOCK_N", M, quant)
        return fit_reduction_block(lists, "BLOCK_N", block_size, kind, "BLOCK_K", 2 if has_dropout else 1,
                                   main_loop)

    # W8A8's lists differ: quant in the tag
    tag = ("dgrad", has_adapter, has_dropout, M <= 64, fp32_tiles, scale_tag(kind, block_size), quant, main_loop)
    kernel = autotuned(dora_dgrad_kernel, tag, configs, ["M_BUCKET", "N", "K", "R"], ["dx_ptr"], gl.device,
                       pin=gemm_pin("dgrad", quant, main_loop))
    launch_gemm(
        kernel, gemm_grid(main_loop, M, K, "BLOCK_K", gl.device), main_loop, gl.device,
        gl, gb, sgl, sgb, rl, rb, w, scale, g, v_k, A_k, mask, dx,
        M, N, K, r_k, m_bucket(M),
        gl.stride(0), gb.stride(0), w.stride(0), scale.stride(0) if kind in STRIDED else 0, v_k.stride(0),
        v_k.stride(1), A_k.stride(0), A_k.stride(1), mask.stride(0), dx.stride(0),
        float(s), float(inv_keep),
        HAS_ADAPTER=has_adapter, HAS_DROPOUT=has_dropout, SCALE_KIND=kind,
        SCALE_BLOCK_SIZE=scale_block_size(kind, block_size), ACT_QUANT=quant, W8_T=w8t, HAS_LORA=float(s) != 0.0,
        DOT_DT=dot_dt,
        IEEE=ieee, W8_VIA_F32=w8_via_f32(gl.device), FP8_PROMOTE=fp8_promote(gl.device), MAIN_LOOP=main_loop, **rk,
    )
    return dx


def dgrad_epilogue(t, tb, rl, w8, scale, block_size, v, A, s, mask, p, rb, cdt):
    """The dgrad epilogue alone, on cuBLAS's t = gl W8', tb = gb W8' (or None): [M, K], any float dtype, unit stride."""
    scale, kind = check_weight(w8, scale, block_size)
    M, K = t.shape
    has_adapter = v is not None
    has_dropout = has_adapter and mask is not None
    rl = vector(rl, torch.float32)  # as in dgrad
    r, v, A, mask, inv_keep, rb, dx = _epilogue_args(M, K, cdt, t.device, v, A, mask, p, tb, rb, rl)
    if M == 0 or K == 0:
        return dx
    tb = tb if has_dropout else t
    rk = rank_dot((cdt,), r, v.dtype, A.dtype)
    bm, bk = epilogue_blocks(rk["LORA_IEEE"])
    grid = (cdiv(M, bm), cdiv(K, bk))
    launch(dgrad_epilogue_kernel, grid)(
        t, tb, rl, rb, scale, v, A, mask, dx,
        M, K, r,
        t.stride(0), tb.stride(0), v.stride(0), v.stride(1), A.stride(0), A.stride(1), mask.stride(0), dx.stride(0),
        float(s), float(inv_keep),
        HAS_ADAPTER=has_adapter, HAS_DROPOUT=has_dropout, SCALE_KIND=kind, HAS_LORA=float(s) != 0.0,
        **rk, BLOCK_M=bm, BLOCK_K=bk,
    )
    return dx
