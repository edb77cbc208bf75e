"""The backward pass over g: one read of g (and z) that prepares gl, gb, v, dm, db and dB for the DoRA backward, and
a small kernel (dora_bwd_finish_kernel) that sums the partials in a fixed order: two launches, no atomics. Formulas,
grid and partials: docs/ARCHITECTURE.md, "Design notes, by module"."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import (alloc, cdiv, check_activation, dot, dot3, dot_dtype, interpreting, launch, magnitude_scale,
                      next_pow2, norm_divisor, split3, split_dtype, sum_parts, vector)
from .occupancy import programs_that_fit

TINY = tl.constexpr(1.1754943508222875e-38)  # torch.finfo(torch.float32).tiny: the floor of rl, rb and max|c|
SCAN_N = 512  # columns per step of the maxima's scan over N
# (BLOCK_E, BLOCK_C, BLOCK_R) of the finishing kernel on a GPU: 40-44 registers, no spills on the four archs (Triton
# 3.8; kernel report).
FINISH_BLOCKS = (1024, 128, 16)


@triton.jit(do_not_specialize=["STEPS", "CSTEPS"])
def dora_bwd_pass_kernel(
    g_ptr, z_ptr, m_ptr, n_ptr, srow_ptr, b_ptr, u_ptr,
    gl_ptr, gb_ptr, rs_ptr, vpart_ptr, dmpart_ptr, dbpart_ptr, dBpart_ptr,
    M, N, R, STEPS, CSTEPS,
    # Strides (g, z, gl, gb have unit stride in their last dim)
    stride_g_m, stride_z_m, stride_b_n, stride_b_r, stride_u_m, stride_u_r, stride_gl_m, stride_gb_m,
    HAS_ADAPTER: tl.constexpr,  # m, n, B given: c, v (and dm, dB if asked)
    HAS_DROPOUT: tl.constexpr,  # f = (c - 1) * srow, and gb with per-row scales
    HAS_SROW: tl.constexpr,     # per-row weight scales srow [N]
    NEED_DM: tl.constexpr,
    NEED_DBB: tl.constexpr,
    NEED_DB: tl.constexpr,  # the bias gradient db (else no column sum of g, no db partial)
    V_DT: tl.constexpr, V_IEEE: tl.constexpr,  # tl.dot operand dtype of (g * c) B
    V_SPLIT: tl.constexpr,  # bf16 g, fp32 B: v = g ((c / max|c|) B) max|c|, that operand split in three (split_dtype)
    DB_DT: tl.constexpr, DB_IEEE: tl.constexpr,  # tl.dot operand dtype of g^T u
    DB_SPLIT: tl.constexpr,  # bf16 g, fp32 u: g^T u with u split (dot3)
    BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SCAN: tl.constexpr,
):
    NORM_L: tl.constexpr = HAS_ADAPTER or HAS_SROW  # gl = g * f / rl (else gl is g)
    NORM_B: tl.constexpr = HAS_ADAPTER and HAS_DROPOUT and HAS_SROW  # gb = g * srow / rb (else g, or none)
    # Loads hoisted above the step's stores (which Triton may not move them past: the pointers could alias) on the
    # 16-bit-operand variants; the fp32 (ieee) ones spilled with them (ARCHITECTURE.md "Bytes in flight").
    EARLY: tl.constexpr = not (V_IEEE or DB_IEEE)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)

    # The maxima over all N (see the module docstring), elementwise first, reduced once at the end.
    offs_s = tl.arange(0, SCAN)
    c_max = tl.full((SCAN,), TINY, tl.float32)
    f_max = tl.full((SCAN,), TINY, tl.float32)
    s_max = tl.full((SCAN,), TINY, tl.float32)
    for n0 in range(0, N, SCAN):
        offs = n0 + offs_s
        ok = offs < N
        f = tl.full((SCAN,), 1.0, tl.float32)
        if HAS_ADAPTER:
            c = magnitude_scale(m_ptr, n_ptr, offs, ok)
            c_max = tl.maximum(c_max, tl.abs(c))
            if HAS_DROPOUT:
                f = c - 1.0
            else:
                f = c
        if HAS_SROW:
            sr = tl.load(srow_ptr + offs, mask=ok, other=0.0)
            s_max = tl.maximum(s_max, tl.abs(sr))
            f = f * sr
        f_max = tl.maximum(f_max, tl.where(ok, tl.abs(f), 0.0))
    rho_c = tl.max(c_max, axis=0)
    rl = 1.0
    if NORM_L:
        rl = tl.max(f_max, axis=0)
    rb = 1.0
    if NORM_B:
        rb = tl.max(s_max, axis=0)
    if pid_m + pid_n == 0:
        two = tl.arange(0, 2)
        tl.store(rs_ptr + two, tl.where(two == 0, rl, rb))

    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    for cs in range(0, CSTEPS):
        offs_n = (pid_n * CSTEPS + cs) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        f = tl.full((BLOCK_N,), 1.0, tl.float32)
        if HAS_ADAPTER:
            c = magnitude_scale(m_ptr, n_ptr, offs_n, mask_n)
            cn = c / rho_c  # |g * c / max|c|| <= |g|: the 16-bit dot operand cannot overflow
            if HAS_DROPOUT:
                f = c - 1.0
            else:
                f = c
            b_tile = tl.load(b_ptr + offs_n.to(tl.int64)[:, None] * stride_b_n + offs_r[None, :] * stride_b_r,
                             mask=mask_n[:, None] & mask_r[None, :], other=0.0)
            if V_SPLIT:  # split once per column block; g's bf16 values times each part are exact products.
                # c / max|c| as below: c B itself can overflow fp32 where g c B does not (c = m / n, n tiny).
                cb_hi, cb_mid, cb_lo = split3(b_tile.to(tl.float32) * cn[:, None])
                cb_hi, cb_mid, cb_lo = cb_hi.to(V_DT), cb_mid.to(V_DT), cb_lo.to(V_DT)
            else:
                b_tile = b_tile.to(V_DT)
        fb = tl.full((BLOCK_N,), 1.0, tl.float32)
        if HAS_SROW:
            sr = tl.load(srow_ptr + offs_n, mask=mask_n, other=0.0)
            f = f * sr
            if NORM_B:
                fb = tl.math.div_rn(sr, rb)
        fl = tl.math.div_rn(f, rl)
        db_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        dm_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        dB_acc = tl.zeros((BLOCK_N, BLOCK_R), dtype=tl.float32)
        for i in range(0, STEPS):
            offs_m = (pid_m * STEPS + i) * BLOCK_M + tl.arange(0, BLOCK_M)
            mask_m = offs_m < M
            rows = offs_m.to(tl.int64)
            tile = mask_m[:, None] & mask_n[None, :]
            g_in = tl.load(g_ptr + rows[:, None] * stride_g_m + offs_n[None, :], mask=tile, other=0.0)
            if EARLY:  # every load of the step before its first store: one round trip a step, not three or four
                if HAS_ADAPTER:
                    vp = vpart_ptr + (pid_n.to(tl.int64) * M + rows[:, None]) * R + offs_r[None, :]
                    vmask = mask_m[:, None] & mask_r[None, :]
                    if NEED_DM:
                        z = tl.load(z_ptr + rows[:, None] * stride_z_m + offs_n[None, :], mask=tile, other=0.0)
                    if NEED_DBB:
                        u = tl.load(u_ptr + rows[:, None] * stride_u_m + offs_r[None, :] * stride_u_r,
                                    mask=vmask, other=0.0)
                    v_old = tl.load(vp, mask=vmask & (cs > 0), other=0.0)  # added only where cs > 0
            g = g_in.to(tl.float32)
            if NEED_DB:
                db_acc += tl.sum(g, axis=0)
            if NORM_L:
                tl.store(gl_ptr + rows[:, None] * stride_gl_m + offs_n[None, :],
                         (g * fl[None, :]).to(gl_ptr.dtype.element_ty), mask=tile)
            if NORM_B:
                tl.store(gb_ptr + rows[:, None] * stride_gb_m + offs_n[None, :],
                         (g * fb[None, :]).to(gb_ptr.dtype.element_ty), mask=tile)
            if HAS_ADAPTER:
                v = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
                if V_SPLIT:
                    gq = g_in.to(V_DT)
                    v = dot(gq, cb_lo, v, V_IEEE)
                    v = dot(gq, cb_mid, v, V_IEEE)
                    v = dot(gq, cb_hi, v, V_IEEE)
                else:
                    v = dot((g * cn[None, :]).to(V_DT), b_tile, v, V_IEEE)
                v = v * rho_c
                # This program's slice of the column group's v partial; rows past M are masked.
                if not EARLY:  # (computed here: at the top of the step they cost the fp32 variants 40 registers)
                    vp = vpart_ptr + (pid_n.to(tl.int64) * M + rows[:, None]) * R + offs_r[None, :]
                    vmask = mask_m[:, None] & mask_r[None, :]
                if cs > 0:
                    if EARLY:
                        v += v_old
                    else:
                        v += tl.load(vp, mask=vmask, other=0.0)
                tl.store(vp, v, mask=vmask)
                if NEED_DM:
                    if not EARLY:
                        z = tl.load(z_ptr + rows[:, None] * stride_z_m + offs_n[None, :], mask=tile, other=0.0)
                    dm_acc += tl.sum(g * z.to(tl.float32), axis=0)
                if NEED_DBB:
                    if not EARLY:
                        u = tl.load(u_ptr + rows[:, None] * stride_u_m + offs_r[None, :] * stride_u_r,
                                    mask=mask_m[:, None] & mask_r[None, :], other=0.0)
                    if DB_SPLIT:
                        dB_acc = dot3(tl.trans(g_in), u, dB_acc, DB_DT, DB_IEEE, False, True)
                    else:
                        dB_acc = dot(tl.trans(g.to(DB_DT)), u.to(DB_DT), dB_acc, DB_IEEE)
        part = pid_m.to(tl.int64) * N + offs_n
        if NEED_DB:
            tl.store(dbpart_ptr + part, db_acc, mask=mask_n)
        if HAS_ADAPTER:
            if NEED_DM:
                tl.store(dmpart_ptr + part, dm_acc, mask=mask_n)
            if NEED_DBB:
                tl.store(dBpart_ptr + part[:, None] * R + offs_r[None, :], dB_acc,
                         mask=mask_n[:, None] & mask_r[None, :])
        # The next column block re-reads this block's v stores, maybe from other threads of the program: a block
        # barrier orders them (global writes are visible to the block after it).
        tl.debug_barrier()


@triton.jit
def dora_bwd_finish_kernel(
    # Pointers: the pass's partials, the magnitude and norm, the outputs
    vpart_ptr, dmpart_ptr, dbpart_ptr, dBpart_ptr, m_ptr, n_ptr, v_ptr, dm_ptr, db_ptr, dB_ptr,
    # Sizes: PN column groups (partial copies of v), PM row groups (of dm, db, dB); the first V_PROGRAMS programs
    # finish v, the others one sum each for a block of BLOCK_C columns (finish_grid)
    M, N, R, PN, PM, V_PROGRAMS,
    s,
    HAS_ADAPTER: tl.constexpr, NEED_DM: tl.constexpr, NEED_DBB: tl.constexpr, NEED_DB: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
):
    pid = tl.program_id(0)
    # (The branches name their values apart: a compiled if/else must give a shared name one type.)
    if pid < V_PROGRAMS:  # v = sum of the column groups' partials, in B's dtype
        offs_e = pid.to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
        ok_e = offs_e < M * R
        v = sum_parts(vpart_ptr, PN, M * R, offs_e, ok_e)
        tl.store(v_ptr + offs_e, v.to(v_ptr.dtype.element_ty), mask=ok_e)
    else:
        # One sum a program (db, dm, or one BLOCK_R chunk of dB), not all of a column block's in one program: each
        # sum waits a DRAM latency per few of its PM parts, and in one program those waits added up (the H200 run's
        # finishing kernel: 30 us for 13 MB, kernels.md).
        blocks = (N + BLOCK_C - 1) // BLOCK_C
        job = (pid - V_PROGRAMS) // blocks + (0 if NEED_DB else 1)  # without db, no programs for it
        cols = ((pid - V_PROGRAMS) % blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
        ok = cols < N
        if NEED_DB and job == 0:
            db = sum_parts(dbpart_ptr, PM, N, cols, ok)
            tl.store(db_ptr + cols, db.to(db_ptr.dtype.element_ty), mask=ok)
        elif job == 1:
            if HAS_ADAPTER and NEED_DM:
                n = tl.load(n_ptr + cols, mask=ok, other=1.0)
                dm = tl.math.div_rn(sum_parts(dmpart_ptr, PM, N, cols, ok), norm_divisor(n))
                tl.store(dm_ptr + cols, dm.to(dm_ptr.dtype.element_ty), mask=ok)
        elif HAS_ADAPTER and NEED_DBB:  # job 2, 3, ...: dB's columns r0 .. r0 + BLOCK_R
            sc = (s * magnitude_scale(m_ptr, n_ptr, cols, ok))[:, None]
            r0 = (job - 2) * BLOCK_R
            offs_r = r0 + tl.arange(0, BLOCK_R)
            e = cols.to(tl.int64)[:, None] * R + offs_r[None, :]
            e_ok = ok[:, None] & (offs_r[None, :] < R)
            dB = sum_parts(dBpart_ptr, PM, N * R, e, e_ok) * sc
            tl.store(dB_ptr + e, dB.to(dB_ptr.dtype.element_ty), mask=e_ok)


def finish_grid(M: int, N: int, r: int, adapter: bool, need_dm: bool, need_dB: bool, blocks: tuple,
                need_db: bool = True) -> tuple:
    """(V_PROGRAMS, programs) of dora_bwd_finish_kernel for its (BLOCK_E, BLOCK_C, BLOCK_R): v's programs, then for
    each column block db's (none without need_db), dm's (idle without it) and one for each BLOCK_R columns of dB."""
    block_e, block_c, block_r = blocks
    v_programs = cdiv(M * r, block_e) if adapter else 0
    sums = int(need_db) + (1 + (cdiv(r, block_r) if need_dB else 0) if adapter else 0)
    return v_programs, v_programs + cdiv(N, block_c) * sums


def bwd_pass_blocks(r: int, ieee: bool, split: bool = False) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_R, num_warps, num_stages) on a GPU: all of r at once, the fp32 dB accumulator at most 8K
    values (2K with fp32 operands, or with c B split in three: split_dtype; 8K spilled on sm_120 at r = 128), 8 warps
    from 2K for 16-bit ones, two stages (larger spilled; kernel report). Split at r <= 16 (fp32 adapters on bf16):
    4 warps and one stage, 216 registers on sm_90a (202 without db), two programs an SM for twice the loads in flight
    (8 warps: 210, one; ARCHITECTURE.md "Bytes in flight"; the speed-up is a PREDICTION). 16-bit operands take one
    stage too: at two, g's cp.async for the next step went out after the step's stores and was waited on first."""
    br = max(16, next_pow2(r))
    if ieee:
        return 16, max(16, min(128, 2048 // br)), br, 4, 2
    if split and br == 16:
        return 32, 128, 16, 4, 1
    bn = max(16, min(128, (2048 if split else 8192) // br))
    return 32, bn, br, 4 if bn * br < 2048 else 8, 1


# Under the interpreter: two programs in all, so that the tests' small shapes still cross both loops (several row
# blocks and several column blocks per program, the read-modify-write of v included).
_INTERP_PROGRAMS = 2


def _grid_shape(M: int, N: int, bm: int, bn: int, programs: int) -> tuple[int, int, int, int]:
    """(STEPS, CSTEPS, row groups pm, column groups pn) for `programs` programs: the split pm x pn = programs with the
    fewest partial bytes, 4 r (pn M + pm N): pn ~ sqrt(programs N / M), each at most the tiles along its dimension."""
    tiles_m, tiles_n = cdiv(M, bm), cdiv(N, bn)
    pn = max(1, min(tiles_n, round(math.sqrt(programs * N / M))))
    pm = max(1, min(tiles_m, cdiv(programs, pn)))
    csteps = cdiv(tiles_n, pn)
    steps = cdiv(tiles_m, pm)
    return steps, csteps, cdiv(tiles_m, steps), cdiv(tiles_n, csteps)


def backward_pass(g, z, m, n, srow, B, u, s, dropout, need_dm, need_dB, need_db=True):
    """See backends/base.py. g [M, N] (any row stride), z [M, N] and m [N] (any float dtype), n, srow [N] fp32."""
    N = g.shape[1]
    g = check_activation(g, "g", N)
    M, cdt, dev = g.shape[0], g.dtype, g.device
    adapter = m is not None
    f32 = dict(dtype=torch.float32, device=dev)
    has_srow = srow is not None
    write_gl = adapter or has_srow
    write_gb = adapter and dropout and has_srow
    need_dm = adapter and need_dm
    need_dB = adapter and need_dB
    need_db = bool(need_db)
    r = B.shape[1] if adapter else 1
    gl = alloc((M, N), cdt, dev) if write_gl else g
    gb = alloc((M, N), cdt, dev) if write_gb else (g if (adapter and dropout) else None)
    rs = alloc((2,), torch.float32, dev)  # (rl, rb), written by the pass (1 where they are 1)
    no_dot = (*dot_dtype(torch.float32), False)
    v_dt, v_ieee, v_split = split_dtype(cdt, B.dtype) if adapter else no_dot
    db_dt, db_ieee, db_split = split_dtype(cdt, u.dtype) if need_dB else no_dot
    # fp32 (ieee) dots pick smaller tiles; a plain pass (no adapter, no dot) streams g only
    ieee = (adapter and v_ieee) or (need_dB and db_ieee)
    if interpreting():
        bm, bn, br, warps, stages = 16, 32, max(16, next_pow2(r)), 4, 1
    else:
        bm, bn, br, warps, stages = bwd_pass_blocks(r, ieee, adapter and v_split)
    if adapter:
        m, n = vector(m), vector(n, torch.float32)
        if need_dm:
            z = check_activation(z, "z", N)
    ph = rs  # placeholder for pointers a variant never reads
    srow = vector(srow, torch.float32) if has_srow else ph
    consts = dict(HAS_ADAPTER=adapter, HAS_DROPOUT=bool(dropout), HAS_SROW=has_srow, NEED_DM=need_dm,
                  NEED_DBB=need_dB, NEED_DB=need_db, V_DT=v_dt, V_IEEE=v_ieee, V_SPLIT=v_split, DB_DT=db_dt,
                  DB_IEEE=db_ieee, DB_SPLIT=db_split, BLOCK_R=br, BLOCK_M=bm,
                  BLOCK_N=bn, SCAN=SCAN_N, num_warps=warps, num_stages=stages)

    def args(steps, csteps, vpart, dmpart, dbpart, dBpart):
        return (g, z if need_dm else ph, m if adapter else ph, n if adapter else ph, srow, B if adapter else ph,
                u if need_dB else ph, gl if write_gl else ph, gb if write_gb else ph,
                rs, vpart, dmpart, dbpart,
                dBpart, M, N, r, steps, csteps,
                g.stride(0), z.stride(0) if need_dm else 0, B.stride(0) if adapter else 0,
                B.stride(1) if adapter else 0, u.stride(0) if need_dB else 0, u.stride(1) if need_dB else 0,
                gl.stride(0) if write_gl else 0, gb.stride(0) if write_gb else 0)

    if interpreting():
        programs = _INTERP_PROGRAMS
    else:  # the programs that fit in one wave, from the compiled kernel's registers and shared memory
        key = ("bwd_pass", tuple(consts.items()), cdt, B.dtype if adapter else None, M % 16 == 0, N % 16 == 0)
        programs = programs_that_fit(dora_bwd_pass_kernel, key, args(1, 1, ph, ph, ph, ph), consts, dev)
    steps, csteps, pm, pn = _grid_shape(M, N, bm, bn, programs)
    vpart = torch.empty(pn, M, r, **f32) if adapter else ph
    dbpart = torch.empty(pm, N, **f32) if need_db else ph
    dmpart = torch.empty(pm, N, **f32) if need_dm else ph
    dBpart = torch.empty(pm, N, r, **f32) if need_dB else ph
    launch(dora_bwd_pass_kernel, (pm, pn))(*args(steps, csteps, vpart, dmpart, dbpart, dBpart), **consts)

    v = alloc((M, r), B.dtype, dev) if adapter else None
    dm = alloc((N,), m.dtype, dev) if need_dm else None
    dB = alloc((N, r), B.dtype, dev) if need_dB else None
    db = alloc((N,), cdt, dev) if need_db else None
    block_e, block_c, block_rc = (64, 32, 16) if interpreting() else FINISH_BLOCKS
    block_r = min(br, block_rc)
    v_programs, programs = finish_grid(M, N, r, adapter, need_dm, need_dB, (block_e, block_c, block_r), need_db)
    if programs == 0:  # a plain pass (no adapter) without db: nothing to finish
        return gl, rs, gb, v, dm, db, dB
    launch(dora_bwd_finish_kernel, (programs,))(
        vpart, dmpart, dbpart, dBpart, m if adapter else ph, n if adapter else ph, v if adapter else ph,
        dm if need_dm else ph, db if need_db else ph, dB if need_dB else ph,
        M, N, r, pn, pm, v_programs, float(s),
        HAS_ADAPTER=adapter, NEED_DM=need_dm, NEED_DBB=need_dB, NEED_DB=need_db, BLOCK_E=block_e, BLOCK_C=block_c,
        BLOCK_R=block_r, num_warps=4, num_stages=1,
    )
    return gl, rs, gb, v, dm, db, dB
