"""The variants of every Triton kernel in this package, for `python -m dorafp8.kernel_report` (docs/INSPECT.md).

THE place to update when a kernel, a kernel parameter, a constexpr or a launcher's choice changes: the report compiles
every Variant below under each of its `configs`, and fails loudly when one no longer matches its kernel."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

import triton

from ._common import (dot_dtype, split_dtype, fit_reduction_block, gemm_configs_for, m_bucket, scale_block_size,
                      fp8_promote_for, w8_via_f32_for, weight_norm_configs_for)
from .backward import FINISH_BLOCKS, SCAN_N, bwd_pass_blocks, dora_bwd_finish_kernel, dora_bwd_pass_kernel
from .dequant import DEQUANT_BLOCKS, SCAN, dequant_w8_kernel
from .dequant_micro import dequant_micro_kernel, micro_blocks
from .dgrad import dgrad_epilogue_kernel, dora_dgrad_kernel, reads_w8t
from .epilogue_dot import rank_dot, rank_fma_for
from .forward import dora_fwd_kernel, fwd_epilogue_kernel, epilogue_blocks
from .gemm import MICRO
from .hopper import (MAIN_LOOPS, PIECES_BLOCKS, TRANSPOSE_BLOCK, main_loop_for, rank_pieces_kernel, transpose_w8_kernel,
                     ws_configs_for, ws_plan, ws_rank_dot)
from .lowrank import (project_grad_kernel, project_grad_launch, project_kernel, project_launch, quant_block_k,
                      sum_splits_kernel)
from .quant import QUANT_BLOCKS, rowwise_quant_kernel
from .weight_norm import dora_weight_norm_kernel, weight_norm_block_r

# Targets -> (the config tables' arch, _common.arch_of, and the capability for triton.compile, which compiles 90 and
# up for the arch-specific target: sm_90a, sm_100a, sm_120a).
ARCHS = {"sm_90a": ("sm90", 90), "sm_89": ("sm89", 89), "sm_100a": ("sm100", 100), "sm_120": ("sm120", 120)}

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

N, K, RANK = 4096, 4096, 64
SCALE_BLOCK_SIZE = 128  # the launchers' block_size of block scales (fine-grained fp8 checkpoints)
LARGE_M, SMALL_M = 4096, 32  # one M on each side of the launchers' small-M switch (m <= 64)
FP8, F32, U8 = torch.float8_e4m3fn, torch.float32, torch.uint8


@dataclass(frozen=True)
class Variant:
    name: str                 # "adapter+dropout,row-scale,M>64": the launcher choices it stands for
    dtype: str                # compute dtype ("bf16", "fp16", "fp32"); weight_norm: the dtype of A and B
    args: dict[str, Any]      # every runtime parameter -> the value the launcher passes (torch dtype for tensors)
    constexprs: dict[str, Any]  # every tl.constexpr parameter except the autotuned ones
    configs: list = field(default_factory=list)  # the triton.Configs the autotuner picks from for this call


@dataclass(frozen=True)
class KernelSpec:
    name: str                 # what --kernel selects ("forward")
    fn: Any                   # the @triton.jit kernel
    variants: Callable[[str], list[Variant]]  # launcher arch name ("sm90", "sm89") -> variants
    weight_arg: str = "w_ptr"  # the fp8 weight pointer parameter: the tool traces which dot operands come from it


def _adapter_modes():
    # (has_adapter, has_dropout, label): the launchers run dropout only with an adapter.
    return [(False, False, "plain"), (True, False, "adapter"), (True, True, "adapter+dropout")]


SCALE_KINDS = ("tensor", "row", "block")  # the kernels' SCALE_KIND, as check_weight returns it


def _gemm_modes():
    """(dtype name, scale kind, W8A8): every dtype with per-tensor and per-row scales in W8A16; block scales, W8A8
    (per-tensor and block) and the microscaled kinds in bf16 (they change the main loop, not the dtype handling)."""
    out = [(dt, kind, False) for dt in DTYPES for kind in ("tensor", "row")]
    out += [("bf16", "block", False), ("bf16", "tensor", True), ("bf16", "block", True)]
    out += [("bf16", kind, False) for kind in MICRO]  # the microscaled weights: W8A16 only, the cp.async loop
    return out


def _variant_name(mode, kind, quant, m, rank=""):
    return (f"{mode},{kind}-scale{',w8a8' if quant else ''},{'M<=64' if m <= 64 else 'M>64'}{rank}")


def _rank_modes(dt_name, kind, adapter):
    """(rank dtype, r, name suffix) of the adapter: 16-bit at r = 64 (the largest rank chunk) everywhere; fp32 (PEFT's,
    the headline's) on bf16 activations at r = 16 with every scale kind and at r = 64 per tensor: fp32 adapters make the
    rank-r epilogue fp32 CUDA-core dots and z fp32, the most registers the GEMM kernels have."""
    out = [("same", RANK if adapter else 1, "")]
    if adapter and dt_name == "bf16":
        out.append(("fp32", 16, ",fp32-rank,r=16"))
        if kind == "tensor":
            out.append(("fp32", RANK, ",fp32-rank,r=64"))
    return out


def _configs(configs, red_name, kind, out_name, dropout, loop):
    return fit_reduction_block(configs, red_name, SCALE_BLOCK_SIZE, kind, out_name, 2 if dropout else 1, loop)


def _weight_norm_variants(arch: str) -> list[Variant]:
    out = []
    for (dt_name, dt), kind, r in itertools.product(DTYPES.items(), SCALE_KINDS, (16, 128)):
        dot_dt, ieee = dot_dtype(dt, dt)
        br = weight_norm_block_r(r, ieee)
        args = dict(
            w_ptr=FP8, scale_ptr=F32, a_ptr=dt, b_ptr=dt, n_ptr=F32,
            N=N, K=K, R=r,
            stride_w_n=K, stride_scale_n=K // SCALE_BLOCK_SIZE if kind == "block" else 0, stride_a_r=K, stride_a_k=1,
            stride_b_n=r, stride_b_r=1,
            s=0.5,
        )
        constexprs = dict(SCALE_KIND=kind, SCALE_BLOCK_SIZE=scale_block_size(kind, SCALE_BLOCK_SIZE), DOT_DT=dot_dt,
                          IEEE=ieee, ONE_R_CHUNK=r <= br, BLOCK_R=br)
        out.append(Variant(f"{kind}-scale,r={r}", dt_name, args, constexprs,
                           weight_norm_configs_for(arch, fp32=ieee)))
    return out


# The headline variants also compiled with the main loop the launchers do not pick on sm_90a (hopper.main_loop_for:
# "tma-ws" unless DORAFP8_HOPPER_GEMM=1 makes it the launchers'), for the report to set side by side; the small-M one
# compiles the other loop's small-M lists there.
COMPARED = ("adapter,tensor-scale,M>64,fp32-rank,r=16", "adapter,tensor-scale,w8a8,M>64,fp32-rank,r=16",
            "adapter,tensor-scale,M<=64,fp32-rank,r=16")


def _gemm_variants(arch: str, out_name: str, red_name: str, kernel_args, dgrad: bool) -> list[Variant]:
    """The variants of a main GEMM kernel (forward: out BLOCK_N, reduction BLOCK_K; dgrad: the reverse). kernel_args(dt,
    act, m, r, adapter, dropout, kind, quant, rank dtype, main loop) -> (runtime args, extra constexprs); a variant
    whose main loop is not the launchers' (hopper.gemm_main_loop) is named with it (",tma-ws", or ",async-copy" under
    DORAFP8_HOPPER_GEMM=1)."""
    out = []
    for (dt_name, kind, quant), (adapter, dropout, mode), m in itertools.product(
            _gemm_modes(), _adapter_modes(), (LARGE_M, SMALL_M)):
        dt = DTYPES[dt_name]
        dot_dt, ieee = dot_dtype(dt)
        fp32_tiles = dt == torch.float32 and not quant
        picked = "async-copy" if fp32_tiles or kind in MICRO else main_loop_for(arch)  # as the launchers
        # without an adapter the launchers pass r = 1 and placeholders (never read)
        for rank_dt, r, rank_name in _rank_modes(dt_name, kind, adapter):
            name = _variant_name(mode, kind, quant, m, rank_name)
            loops = [picked] + ([lp for lp in MAIN_LOOPS if lp != picked] if arch == "sm90" and name in COMPARED
                                else [])
            for asked in loops:
                rdt = torch.float32 if rank_dt == "fp32" else dt
                rk = rank_dot((dt,), r, rdt)  # as the launchers
                loop, rank_mode = ws_plan(asked, dropout, rk if adapter else None)
                if loop == "async-copy":
                    rk = rank_dot((dt,), r, rdt, fma=rank_fma_for(arch, dgrad, dropout))
                if loop != asked and asked != picked:
                    continue  # a compared loop the launchers would not take here
                r_k, rk = ws_rank_dot(rank_mode, r, rk)
                if rank_mode == "pieces":  # rank_pieces' bf16 operands over 3 r (hopper.py; r % 8 == 0: no padding)
                    rdt = torch.bfloat16
                args, extra = kernel_args(dt, FP8 if quant else dt, m, r_k, adapter, dropout, kind, quant, rdt, loop)
                constexprs = dict(HAS_ADAPTER=adapter, HAS_DROPOUT=dropout, **extra, SCALE_KIND=kind,
                                  SCALE_BLOCK_SIZE=scale_block_size(kind, SCALE_BLOCK_SIZE), ACT_QUANT=quant,
                                  HAS_LORA=True, DOT_DT=dot_dt, IEEE=ieee and not quant,
                                  W8_VIA_F32=w8_via_f32_for(arch), FP8_PROMOTE=fp8_promote_for(arch),
                                  MAIN_LOOP=loop, **rk)
                if loop == "async-copy":
                    lean = quant and fp8_promote_for(arch)  # as the launchers
                    lists = gemm_configs_for(arch, out_name, red_name, dropout, m, fp32_tiles, lean, quant)
                else:
                    lists = ws_configs_for(arch, out_name, red_name, m, quant)
                configs = _configs(lists, red_name, kind, out_name, dropout, loop)
                suffix = "" if asked == picked else f",{loop}"
                out.append(Variant(name + suffix, dt_name, args, constexprs, configs))
    return out


def _weight_args(kind):
    """(w_ptr, scale_ptr, g_ptr) dtypes and W's and the scale's row strides for a weight kind, as gemm.weight_args."""
    if kind == "nvfp4":
        return (U8, FP8, F32), K // 2, K // 16
    if kind == "mxfp8":
        return (FP8, U8, U8), K, K // 32
    return (FP8, F32, F32), K, K // SCALE_BLOCK_SIZE if kind == "block" else 0


def _forward_args(dt, act, m, r, adapter, dropout, kind, quant, rdt, loop):
    # z in the compute dtype, as the custom op asks for it (z_dtype=x.dtype)
    (w, sc, g), stride_w, stride_s = _weight_args(kind)
    args = dict(
        x_ptr=act, xm_ptr=act, sx_ptr=F32, sxm_ptr=F32, w_ptr=w, scale_ptr=sc, g_ptr=g, bias_ptr=dt, m_ptr=F32,
        n_ptr=F32, u_ptr=rdt, b_ptr=rdt, y_ptr=dt, z_ptr=dt,
        M=m, N=N, K=K, R=r, M_BUCKET=m_bucket(m),
        stride_x_m=K, stride_xm_m=K, stride_w_n=stride_w, stride_scale_n=stride_s,
        stride_u_m=r if adapter else 1, stride_u_r=1, stride_b_n=r if adapter else 1, stride_b_r=1,
        stride_y_m=N, stride_z_m=N,
        s=0.5, inv_keep=1.0 / 0.9 if dropout else 1.0,
    )
    return args, dict(HAS_BIAS=True, NEED_Z=adapter)


def _dgrad_args(dt, act, m, r, adapter, dropout, kind, quant, rdt, loop):
    w8t = reads_w8t(quant, loop)  # W8^T [K, N] or W8 [N, K], as the launcher
    (w, sc, g), stride_w, stride_s = _weight_args(kind)
    args = dict(
        gl_ptr=act, gb_ptr=act, sgl_ptr=F32, sgb_ptr=F32, rl_ptr=F32, rb_ptr=F32, w_ptr=w,
        scale_ptr=sc, g_ptr=g, v_ptr=rdt, a_ptr=rdt, mask_ptr=U8 if dropout else F32, dx_ptr=dt,
        M=m, N=N, K=K, R=r, M_BUCKET=m_bucket(m),
        stride_gl_m=N, stride_gb_m=N, stride_w=N if w8t else stride_w,
        stride_scale_n=stride_s,
        stride_v_m=r if adapter else 1, stride_v_r=1, stride_a_r=K if adapter else 1, stride_a_k=1,
        stride_mask_m=K if dropout else 1, stride_dx_m=K,
        s=0.5, inv_keep=1.0 / 0.9 if dropout else 1.0,
    )
    return args, dict(W8_T=w8t)


def _forward_variants(arch: str) -> list[Variant]:
    return _gemm_variants(arch, "BLOCK_N", "BLOCK_K", _forward_args, False)


def _dgrad_variants(arch: str) -> list[Variant]:
    return _gemm_variants(arch, "BLOCK_K", "BLOCK_N", _dgrad_args, True)


def _fixed(num_warps=4, num_stages=3, **blocks):
    """The launch config of a kernel that is not autotuned (Triton's default stages: 3)."""
    return [triton.Config(blocks, num_warps=num_warps, num_stages=num_stages)]


def _epilogue_rank_modes(dt_name, dt, adapter):
    """(rank dtype, r, name suffix, rank_dot's constexprs) of the cuBLAS strategy's epilogue kernels for _rank_modes'
    adapters, as the launchers choose: fp32 adapters into 16-bit outputs take split_dot on tensor cores (as the GEMMs'
    epilogues do); into fp32 outputs exact fp32 dots (LORA_IEEE) on epilogue_blocks' smaller tiles."""
    out = []
    for rank_dt, r, rank_name in _rank_modes(dt_name, "tensor", adapter):
        rdt = F32 if rank_dt == "fp32" else dt
        rk = rank_dot((dt,), r, rdt)
        out.append((rdt, r, rank_name, rk))
    return out


def _fwd_epilogue_variants(arch: str) -> list[Variant]:
    out = []
    for (dt_name, dt), (adapter, dropout, mode) in itertools.product(DTYPES.items(), _adapter_modes()):
        for rdt, r, rank_name, rk in _epilogue_rank_modes(dt_name, dt, adapter):
            args = dict(
                base_ptr=dt, based_ptr=dt, scale_ptr=F32, bias_ptr=dt, m_ptr=F32, n_ptr=F32, u_ptr=rdt, b_ptr=rdt,
                y_ptr=dt, z_ptr=dt,
                M=LARGE_M, N=N, R=r,
                stride_base_m=N, stride_based_m=N, stride_u_m=r if adapter else 1, stride_u_r=1,
                stride_b_n=r if adapter else 1, stride_b_r=1, stride_y_m=N, stride_z_m=N,
                s=0.5, inv_keep=1.0 / 0.9 if dropout else 1.0,
            )
            constexprs = dict(HAS_ADAPTER=adapter, HAS_DROPOUT=dropout, HAS_BIAS=True, NEED_Z=adapter,
                              SCALE_KIND="row", HAS_LORA=True, **rk)
            bm, bn = epilogue_blocks(rk["LORA_IEEE"])
            out.append(Variant(mode + rank_name, dt_name, args, constexprs, _fixed(BLOCK_M=bm, BLOCK_N=bn)))
    return out


def _dgrad_epilogue_variants(arch: str) -> list[Variant]:
    out = []
    for (dt_name, dt), (adapter, dropout, mode) in itertools.product(DTYPES.items(), _adapter_modes()):
        for rdt, r, rank_name, rk in _epilogue_rank_modes(dt_name, dt, adapter):
            args = dict(
                tl_ptr=dt, tb_ptr=dt, rl_ptr=F32, rb_ptr=F32, scale_ptr=F32, v_ptr=rdt, a_ptr=rdt,
                mask_ptr=U8 if dropout else F32, dx_ptr=dt,
                M=LARGE_M, K=K, R=r,
                stride_tl_m=K, stride_tb_m=K, stride_v_m=r if adapter else 1, stride_v_r=1,
                stride_a_r=K if adapter else 1, stride_a_k=1, stride_mask_m=K if dropout else 1, stride_dx_m=K,
                s=0.5, inv_keep=1.0 / 0.9 if dropout else 1.0,
            )
            constexprs = dict(HAS_ADAPTER=adapter, HAS_DROPOUT=dropout, SCALE_KIND="tensor", HAS_LORA=True, **rk)
            bm, bk = epilogue_blocks(rk["LORA_IEEE"])
            out.append(Variant(mode + rank_name, dt_name, args, constexprs, _fixed(BLOCK_M=bm, BLOCK_K=bk)))
    return out


def _bwd_pass_variants(arch: str) -> list[Variant]:
    out = []
    # (adapter, dropout, srow, name)
    modes = [(False, False, True, "plain,row-scale"), (True, False, False, "adapter"),
             (True, True, False, "adapter+dropout"), (True, True, True, "adapter+dropout,row-scale")]
    for (dt_name, dt), rdt_name, (adapter, dropout, srow, mode), r in itertools.product(
            DTYPES.items(), ("same", "fp32"), modes, (16, 128)):
        rdt = dt if rdt_name == "same" else torch.float32
        if rdt_name == "fp32" and dt == torch.float32:
            continue
        v_dt, v_ieee, split = split_dtype(dt, rdt)
        bm, bn, br, warps, stages = bwd_pass_blocks(r, adapter and v_ieee, adapter and split)
        args = dict(
            g_ptr=dt, z_ptr=dt, m_ptr=F32, n_ptr=F32, srow_ptr=F32, b_ptr=rdt, u_ptr=rdt, gl_ptr=dt, gb_ptr=dt,
            rs_ptr=F32, vpart_ptr=F32, dmpart_ptr=F32, dbpart_ptr=F32, dBpart_ptr=F32,
            M=LARGE_M, N=N, R=r, STEPS=8, CSTEPS=2,
            stride_g_m=N, stride_z_m=N, stride_b_n=r, stride_b_r=1, stride_u_m=r, stride_u_r=1, stride_gl_m=N,
            stride_gb_m=N,
        )
        constexprs = dict(HAS_ADAPTER=adapter, HAS_DROPOUT=dropout, HAS_SROW=srow, NEED_DM=adapter,
                          NEED_DBB=adapter, NEED_DB=True, V_DT=v_dt, V_IEEE=v_ieee, V_SPLIT=split, DB_DT=v_dt,
                          DB_IEEE=v_ieee, DB_SPLIT=split,
                          BLOCK_R=br, BLOCK_M=bm, BLOCK_N=bn, SCAN=SCAN_N)
        name = f"{mode},r={r}{',fp32-rank' if rdt_name == 'fp32' else ''}"
        out.append(Variant(name, dt_name, args, constexprs, _fixed(num_warps=warps, num_stages=stages)))
        if adapter:  # a layer without a bias (most LLM Linears): no db
            out.append(Variant(name + ",no-bias", dt_name, args, {**constexprs, "NEED_DB": False},
                               _fixed(num_warps=warps, num_stages=stages)))
    return out


def _rank_gemm_variants(kernel_args, blocks=project_grad_launch, **extra_constexprs):
    """Variants of the rank-r GEMMs (project, project_grad): activations in each dtype, the rank path in the same dtype
    or fp32, with and without the dropout mask; `kernel_args(dt, rdt, mask)` gives the runtime arguments, `blocks`
    the launcher's (BLOCK_M, BLOCK_K, BLOCK_R, stages, warps)."""
    def variants(arch: str) -> list[Variant]:
        out = []
        for (dt_name, dt), rdt_name, mask in itertools.product(DTYPES.items(), ("same", "fp32"), (False, True)):
            rdt = dt if rdt_name == "same" else torch.float32
            if rdt_name == "fp32" and dt == torch.float32:
                continue
            dot_dt, ieee, split = split_dtype(dt, rdt)
            bm, bk, br, stages, warps = blocks(ieee, RANK, split)
            args = dict(kernel_args(dt, rdt, mask), M=LARGE_M, K=K, R=RANK, stride_mask_m=K if mask else 0,
                        inv_keep=1.0 / 0.9 if mask else 1.0)
            name = f"{'dropout' if mask else 'plain'}{',fp32-rank' if rdt_name == 'fp32' else ''}"
            out.append(Variant(name, dt_name, args, dict(HAS_MASK=mask, DOT_DT=dot_dt, IEEE=ieee, SPLIT=split, **extra_constexprs),
                               _fixed(BLOCK_M=bm, BLOCK_K=bk, BLOCK_R=br, num_warps=warps, num_stages=stages)))
        return out
    return variants


_project_plain = _rank_gemm_variants(lambda dt, rdt, mask: dict(
    a_ptr=dt, b_ptr=rdt, out_ptr=rdt, mask_ptr=U8 if mask else dt, q_ptr=dt, sq_ptr=dt, stride_a_m=K, stride_b_r=K,
    stride_b_k=1, stride_out_m=RANK, stride_q_m=K),
    lambda ieee, r, split: project_launch(ieee, r, split, False), QUANT=False, INTERPRET=False, QUANT_BLOCK_K=16)


def _project_variants(arch: str) -> list[Variant]:
    """project's variants, and for bf16 activations the same with W8A8's quantization of x (QUANT: ",w8a8")."""
    out = _project_plain(arch)
    for v in [v for v in out if v.dtype == "bf16"]:
        c = v.constexprs
        bm, bk, br, stages, warps = project_launch(c["IEEE"], RANK, c["SPLIT"], True)
        out.append(Variant(f"{v.name},w8a8", v.dtype, dict(v.args, q_ptr=FP8, sq_ptr=F32),
                           dict(c, QUANT=True, QUANT_BLOCK_K=quant_block_k(bm)),
                           _fixed(BLOCK_M=bm, BLOCK_K=bk, BLOCK_R=br, num_warps=warps, num_stages=stages)))
    return out


_project_grad_variants = _rank_gemm_variants(lambda dt, rdt, mask: dict(
    v_ptr=rdt, a_ptr=dt, part_ptr=F32, mask_ptr=U8 if mask else dt, ROWS_PER_SPLIT=512, stride_v_m=RANK,
    stride_v_r=1, stride_a_m=K, s=0.5), FINAL=False)


def _bwd_finish_variants(arch: str) -> list[Variant]:
    """The backward pass's second stage (v from the column groups' partials, db / dm / dB from the row groups')."""
    out = []
    for (dt_name, dt), rdt_name, r in itertools.product(DTYPES.items(), ("same", "fp32"), (16, 128)):
        rdt = dt if rdt_name == "same" else torch.float32
        if rdt_name == "fp32" and dt == torch.float32:
            continue
        args = dict(vpart_ptr=F32, dmpart_ptr=F32, dbpart_ptr=F32, dBpart_ptr=F32, m_ptr=rdt, n_ptr=F32, v_ptr=rdt,
                    dm_ptr=rdt, db_ptr=dt, dB_ptr=rdt, M=LARGE_M, N=N, R=r, PN=12, PM=22,
                    V_PROGRAMS=LARGE_M * r // FINISH_BLOCKS[0], s=0.5)
        be, bc, brc = FINISH_BLOCKS
        constexprs = dict(HAS_ADAPTER=True, NEED_DM=True, NEED_DBB=True, NEED_DB=True, BLOCK_E=be, BLOCK_C=bc,
                          BLOCK_R=min(brc, max(16, r)))
        out.append(Variant(f"adapter,r={r}{',fp32-rank' if rdt_name == 'fp32' else ''}", dt_name, args, constexprs,
                           _fixed(num_warps=4, num_stages=1)))
    return out


def _sum_splits_variants(arch: str) -> list[Variant]:
    return [Variant(f"-> {dt_name}", dt_name, dict(part_ptr=F32, out_ptr=dt, SPLITS=9, NUMEL=RANK * K, s=0.5),
                    dict(BLOCK=1024), _fixed(num_warps=4, num_stages=1)) for dt_name, dt in DTYPES.items()]


def _rank_pieces_variants(arch: str) -> list[Variant]:
    """The forward's (B [N, r] and u) and the dgrad's (A [r, K] and v) pieces, fp32 adapters at r = 16."""
    r, bm, bc = 16, *PIECES_BLOCKS
    out = []
    for name, rows, cols, stride_row, stride_col, off in (("B, u", N, r, r, 1, r), ("A, v", r, K, K, 1, 3 * r * K)):
        args = dict(t_ptr=F32, v_ptr=F32, t3_ptr=torch.bfloat16, v3_ptr=torch.bfloat16, T_ROWS=rows, T_COLS=cols,
                    V_ROWS=LARGE_M, R=r, stride_t_row=stride_row, stride_t_col=stride_col, stride_v_row=r,
                    stride_v_r=1, stride_t3=3 * r if off == r else K, stride_v3=3 * r, t_piece_off=off // 3)
        out.append(Variant(name, "bf16", args, {}, _fixed(BLOCK=bm, BLOCK_C=bc)))
    return out


def _transpose_w8_variants(arch: str) -> list[Variant]:
    return [Variant("W8 -> W8^T", "fp8", dict(w_ptr=FP8, wt_ptr=FP8, N=N, K=K, stride_w_n=K, stride_wt_k=N), {},
                    _fixed(BLOCK=TRANSPOSE_BLOCK))]


def _dequant_variants(arch: str) -> list[Variant]:
    """The cuBLAS strategy's one-pass dequantize (dequant.py): every compute dtype and scale kind."""
    bn, bk = DEQUANT_BLOCKS
    return [Variant(f"{kind}-scale", dt_name,
                    dict(w_ptr=FP8, scale_ptr=F32, out_ptr=dt, fac_ptr=F32, N=N, K=K, stride_w_n=K,
                         stride_scale_n=K // SCALE_BLOCK_SIZE if kind == "block" else 0, stride_out_n=K),
                    dict(SCALE_KIND=kind, SCALE_BLOCK_SIZE=scale_block_size(kind, SCALE_BLOCK_SIZE),
                         SCAN_N=SCAN),
                    _fixed(BLOCK_N=bn, BLOCK_K=bk))
            for (dt_name, dt), kind in itertools.product(DTYPES.items(), SCALE_KINDS)]


def _dequant_micro_variants(arch: str) -> list[Variant]:
    """The cuBLAS strategy's unpack of the microscaled kinds (dequant_micro.py): NVFP4 (uint8 codes, e4m3 scales, the
    global scale) and MXFP8 (e4m3, the e8m0 bytes as uint8), every compute dtype."""
    out = []
    for (dt_name, dt), nvfp4 in itertools.product(DTYPES.items(), (True, False)):
        bn, bk = micro_blocks(dt)
        w, sc, per = (U8, FP8, K // 16) if nvfp4 else (FP8, U8, K // 32)
        args = dict(w_ptr=w, scale_ptr=sc, g_ptr=F32 if nvfp4 else sc, out_ptr=dt,
                    N=N, K=K, stride_w_n=K // 2 if nvfp4 else K, stride_scale_n=per, stride_out_n=K)
        out.append(Variant("nvfp4" if nvfp4 else "mxfp8", dt_name, args, dict(NVFP4=nvfp4), _fixed(BLOCK_N=bn, BLOCK_K=bk)))
    return out


def _rowwise_quant_variants(arch: str) -> list[Variant]:
    bm, bk = QUANT_BLOCKS
    return [Variant("rowwise", dt_name, dict(t_ptr=dt, q_ptr=FP8, s_ptr=F32, M=LARGE_M, K=K, stride_t_m=K,
                                             stride_q_m=K),
                    dict(INTERPRET=False), _fixed(BLOCK_M=bm, BLOCK_K=bk))
            for dt_name, dt in DTYPES.items()]


SPECS = [
    KernelSpec("weight_norm", dora_weight_norm_kernel, _weight_norm_variants),
    KernelSpec("forward", dora_fwd_kernel, _forward_variants),
    KernelSpec("dgrad", dora_dgrad_kernel, _dgrad_variants),
    KernelSpec("backward_pass", dora_bwd_pass_kernel, _bwd_pass_variants, weight_arg=None),
    KernelSpec("backward_finish", dora_bwd_finish_kernel, _bwd_finish_variants, weight_arg=None),
    KernelSpec("project", project_kernel, _project_variants, weight_arg=None),
    KernelSpec("project_grad", project_grad_kernel, _project_grad_variants, weight_arg=None),
    KernelSpec("sum_splits", sum_splits_kernel, _sum_splits_variants, weight_arg=None),
    KernelSpec("rowwise_quant", rowwise_quant_kernel, _rowwise_quant_variants, weight_arg=None),
    KernelSpec("transpose_w8", transpose_w8_kernel, _transpose_w8_variants, weight_arg=None),
    KernelSpec("rank_pieces", rank_pieces_kernel, _rank_pieces_variants, weight_arg=None),
    KernelSpec("forward_epilogue", fwd_epilogue_kernel, _fwd_epilogue_variants, weight_arg=None),
    KernelSpec("dgrad_epilogue", dgrad_epilogue_kernel, _dgrad_epilogue_variants, weight_arg=None),
    KernelSpec("dequant_w8", dequant_w8_kernel, _dequant_variants, weight_arg=None),
    KernelSpec("dequant_micro", dequant_micro_kernel, _dequant_micro_variants, weight_arg=None),
]
