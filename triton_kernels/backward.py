"""The backward pass over g: one read of g (and z) that prepares everything the DoRA backward needs from them.

    gl = g * fl           the dgrad's left operand (fl = f / rl, f = c * srow, or (c - 1) * srow with dropout)
    gb = g * fb           with dropout and per-row scales: the plain base term's operand (fb = srow / rb)
    v  = (g * c) B        [M, r], fp32 products (the 16-bit dot takes g * c / max|c|, rescaled in fp32: no overflow)
    dm = sum_i g * z      [N]      (the caller divides by n)
    db = sum_i g          [N]
    dB = g^T u            [N, r]   (the caller scales by s * c)

Each program owns BLOCK_N columns and STEPS blocks of BLOCK_M rows. Column sums (dm, db, dB) accumulate in registers
over the program's rows and are written as one partial per row group; v accumulates over the program's columns and
is written as one partial per column group. A second, small reduction (torch .sum(0) over the partials, a fixed order)
finishes them: no atomics, so the result is the same run to run. The partials cost 8 r (1/BLOCK_N + 1/rows per
program) bytes per element of g, which the launcher keeps well under the 4-6 bytes per element the pass must move.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import alloc, check_activation, dot_dtype, interpreting


@triton.jit
def dora_bwd_pass_kernel(
    # Pointers
    g_ptr, z_ptr, c_ptr, rhoc_ptr, fl_ptr, fb_ptr, b_ptr, u_ptr,
    gl_ptr, gb_ptr, vpart_ptr, dmpart_ptr, dbpart_ptr, dBpart_ptr,
    # Sizes
    M, N, R, STEPS,
    # Strides (g, z, gl, gb have unit stride in their last dim)
    stride_g_m, stride_z_m, stride_b_n, stride_b_r, stride_u_m, stride_u_r, stride_gl_m, stride_gb_m,
    # Meta-parameters
    HAS_ADAPTER: tl.constexpr,  # c, B given: v (and dm, dB if asked)
    WRITE_GL: tl.constexpr,
    WRITE_GB: tl.constexpr,
    NEED_DM: tl.constexpr,
    NEED_DBB: tl.constexpr,
    V_DT: tl.constexpr, V_IEEE: tl.constexpr,  # tl.dot operand dtype of (g * c) B
    DB_DT: tl.constexpr, DB_IEEE: tl.constexpr,  # tl.dot operand dtype of g^T u
    BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    if WRITE_GL:
        fl = tl.load(fl_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    if WRITE_GB:
        fb = tl.load(fb_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    if HAS_ADAPTER:
        c = tl.load(c_ptr + offs_n, mask=mask_n, other=0.0)[None, :]  # c / rho_c: |g * c| <= |g|
        b_tile = tl.load(b_ptr + offs_n.to(tl.int64)[:, None] * stride_b_n + offs_r[None, :] * stride_b_r,
                         mask=mask_n[:, None] & mask_r[None, :], other=0.0).to(V_DT)
    db_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    dm_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    dB_acc = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
    for i in range(0, STEPS):
        offs_m = (pid_m * STEPS + i) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        rows = offs_m.to(tl.int64)
        tile = mask_m[:, None] & mask_n[None, :]
        g = tl.load(g_ptr + rows[:, None] * stride_g_m + offs_n[None, :], mask=tile, other=0.0).to(tl.float32)
        db_acc += tl.sum(g, axis=0)
        if WRITE_GL:
            tl.store(gl_ptr + rows[:, None] * stride_gl_m + offs_n[None, :], (g * fl).to(gl_ptr.dtype.element_ty),
                     mask=tile)
        if WRITE_GB:
            tl.store(gb_ptr + rows[:, None] * stride_gb_m + offs_n[None, :], (g * fb).to(gb_ptr.dtype.element_ty),
                     mask=tile)
        if HAS_ADAPTER:
            # v's partial over this program's columns; rows past M are masked at the store.
            v = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            if V_IEEE:
                v = tl.dot((g * c).to(V_DT), b_tile, v, input_precision="ieee")
            else:
                v = tl.dot((g * c).to(V_DT), b_tile, v)
            vp = vpart_ptr + (pid_n * M + rows[:, None]) * R + offs_r[None, :]
            tl.store(vp, v * tl.load(rhoc_ptr), mask=mask_m[:, None] & mask_r[None, :])
            if NEED_DM:
                z = tl.load(z_ptr + rows[:, None] * stride_z_m + offs_n[None, :], mask=tile, other=0.0)
                dm_acc += tl.sum(g * z.to(tl.float32), axis=0)
            if NEED_DBB:
                u = tl.load(u_ptr + rows[:, None] * stride_u_m + offs_r[None, :] * stride_u_r,
                            mask=mask_m[:, None] & mask_r[None, :], other=0.0).to(DB_DT)
                if DB_IEEE:
                    dB_acc = tl.dot(tl.trans(g.to(DB_DT)), u, dB_acc, input_precision="ieee")
                else:
                    dB_acc = tl.dot(tl.trans(g.to(DB_DT)), u, dB_acc)
    part = pid_m.to(tl.int64) * N + offs_n
    tl.store(dbpart_ptr + part, db_acc, mask=mask_n)
    if HAS_ADAPTER:
        if NEED_DM:
            tl.store(dmpart_ptr + part, dm_acc, mask=mask_n)
        if NEED_DBB:
            tl.store(dBpart_ptr + part[:, None] * R + offs_r[None, :], dB_acc, mask=mask_n[:, None] & mask_r[None, :])


def bwd_pass_blocks(r: int, ieee: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_R, num_warps, num_stages) on a GPU: all of r at once (dB accumulates in registers over
    the rows), the BLOCK_N x BLOCK_R fp32 dB accumulator at most 8K values (32 per thread at 8 warps; the g and z
    tiles need the rest: 256 columns spilled, inspect), or 2K with fp32 operands, whose CUDA-core dots hold both tiles in registers (at r = 128 the larger tiles spilled, inspect).
    Two stages: the pass streams g and z once, and three overflowed Ada's shared memory."""
    br = max(16, triton.next_power_of_2(r))
    if ieee:
        return 16, max(16, min(128, 2048 // br)), br, 4, 2
    bn = max(16, min(128, 8192 // br))
    return 32, bn, br, 4 if bn * br <= 2048 else 8, 2


def _grid_shape(M: int, N: int, r: int, ieee: bool, device: torch.device):
    """(BLOCK_M, BLOCK_N, BLOCK_R, num_warps, num_stages, STEPS, programs along M, programs along N)."""
    if interpreting():
        bm, bn, br, warps, stages = 16, 32, max(16, triton.next_power_of_2(r)), 4, 1
        target = 8
    else:
        bm, bn, br, warps, stages = bwd_pass_blocks(r, ieee)
        target = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    pn = triton.cdiv(N, bn)
    pm = max(1, min(triton.cdiv(M, bm), triton.cdiv(target, pn)))
    steps = triton.cdiv(triton.cdiv(M, pm), bm)
    pm = triton.cdiv(M, steps * bm)
    return bm, bn, br, warps, stages, steps, pm, pn


def backward_pass(g, z, c, srow, B, u, dropout, need_dm, need_dB):
    """See dorafp8/backends/__init__.py. g [M, N] (any row stride), z [M, N] (any float dtype), c / srow [N] fp32."""
    N = g.shape[1]
    g = check_activation(g, "g", N)
    M, cdt, dev = g.shape[0], g.dtype, g.device
    adapter = c is not None
    tiny = torch.finfo(torch.float32).tiny
    f32 = dict(dtype=torch.float32, device=dev)
    rho_c = None
    if adapter:
        c = c.reshape(-1).float().contiguous()
        f = (c - 1.0) if dropout else c
        rho_c = c.abs().amax().clamp_min(tiny)
        if srow is not None:
            f = f * srow
    else:
        f = srow
    write_gl = f is not None
    if write_gl:
        rl = f.abs().amax().clamp_min(tiny)
        fl = (f / rl).float().contiguous()
        gl = alloc((M, N), cdt, dev)
    else:
        rl, fl, gl = torch.ones((), **f32), g, g
    write_gb = adapter and dropout and srow is not None
    gb = rb = None
    if adapter and dropout:
        if write_gb:
            rb = srow.abs().amax().clamp_min(tiny)
            fb = (srow / rb).float().contiguous()
            gb = alloc((M, N), cdt, dev)
        else:
            gb, rb = g, torch.ones((), **f32)
    need_dm = adapter and need_dm
    need_dB = adapter and need_dB
    r = B.shape[1] if adapter else 1
    v_dt, v_ieee = dot_dtype(cdt, B.dtype) if adapter else dot_dtype(torch.float32)
    db_dt, db_ieee = dot_dtype(cdt, u.dtype) if need_dB else dot_dtype(torch.float32)
    # fp32 (ieee) dots pick smaller tiles; a plain pass (no adapter, no dot) streams g only
    ieee = (adapter and v_ieee) or (need_dB and db_ieee)
    bm, bn, br, warps, stages, steps, pm, pn = _grid_shape(M, N, r, ieee, dev)
    vpart = torch.empty(pn, M, r, **f32) if adapter else None
    dbpart = torch.empty(pm, N, **f32)
    dmpart = torch.empty(pm, N, **f32) if need_dm else None
    dBpart = torch.empty(pm, N, r, **f32) if need_dB else None
    if need_dm:
        z = check_activation(z, "z", N)
    ph = dbpart  # placeholder for pointers a variant never reads
    dora_bwd_pass_kernel[(pm, pn)](
        g, z if need_dm else ph, (c / rho_c).contiguous() if adapter else ph, rho_c.reshape(1) if adapter else ph, fl if write_gl else ph, fb if write_gb else ph,
        B if adapter else ph, u if need_dB else ph,
        gl if write_gl else ph, gb if write_gb else ph, vpart if adapter else ph, dmpart if need_dm else ph, dbpart,
        dBpart if need_dB else ph,
        M, N, r, steps,
        g.stride(0), z.stride(0) if need_dm else 0, B.stride(0) if adapter else 0, B.stride(1) if adapter else 0,
        u.stride(0) if need_dB else 0, u.stride(1) if need_dB else 0, gl.stride(0) if write_gl else 0,
        gb.stride(0) if write_gb else 0,
        HAS_ADAPTER=adapter, WRITE_GL=write_gl, WRITE_GB=write_gb, NEED_DM=need_dm, NEED_DBB=need_dB,
        V_DT=v_dt, V_IEEE=v_ieee, DB_DT=db_dt, DB_IEEE=db_ieee, BLOCK_R=br, BLOCK_M=bm, BLOCK_N=bn,
        num_warps=warps, num_stages=stages,
    )
    v = vpart.sum(0).to(B.dtype) if adapter else None
    return (gl, rl, gb, rb, v, dmpart.sum(0) if need_dm else None, dbpart.sum(0),
            dBpart.sum(0) if need_dB else None)
