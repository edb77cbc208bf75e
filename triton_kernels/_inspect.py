"""The variants of every Triton kernel in this package, for `python -m dorafp8.inspect` (docs/INSPECT.md).

THIS is the one place to update when a kernel is added, or a kernel parameter, a constexpr or a launcher's choice
changes. The tool compiles every Variant below under every config in its `configs`, ahead of time for GPUs it does
not have, and fails loudly when a variant's arguments no longer match the kernel's parameters (names, and which are
tl.constexpr) and when a module here has a @triton.jit function named `*_kernel` that SPECS does not list.

A Variant mirrors one way a launcher calls its kernel: `args` are the runtime arguments the launcher passes for a
representative problem (torch dtypes stand for 16-byte-aligned tensors, as in JITFunction.warmup; integers are given
as the launcher would pass them, since Triton specializes on them: 1 becomes a constexpr, multiples of 16 get a
divisibility hint), `constexprs` the tl.constexpr arguments other than the autotuned ones, and `configs` the
autotuner's candidates for that call on that arch, from the same functions the launchers use. Constexprs and sizes
are computed with the launchers' own helpers (dot_dtype, block_r, m_bucket) so that the two cannot drift apart.

Pinned, to keep the variant count sane (each is one compile per config per arch): a representative problem
N = K = 4096, rank 64 (BLOCK_R = 64, the largest rank chunk, the most registers in the epilogues), bias present and
z wanted whenever the launcher can produce it (the fuller epilogues). Everything that changes the main loop or picks
a different config list varies.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ._common import block_r, dot_dtype, gemm_configs_for, m_bucket, weight_norm_configs_for
from .dgrad import _dora_dgrad_kernel
from .forward import _dora_fwd_kernel
from .weight_norm import _dora_weight_norm_kernel

# Targets, as the inspection tool names them -> (the launchers' name for the arch's config tables, compute capability
# for triton.compile; Triton compiles capability 90 for sm_90a, the arch-specific target wgmma needs).
ARCHS = {"sm_90a": ("sm90", 90), "sm_89": ("sm89", 89)}

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

N, K, RANK = 4096, 4096, 64
LARGE_M, SMALL_M = 4096, 32  # one M on each side of the launchers' small-M switch (m <= 64)
FP8, F32 = torch.float8_e4m3fn, torch.float32


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


def _weight_norm_variants(arch: str) -> list[Variant]:
    out = []
    for (dt_name, dt), row, r in itertools.product(DTYPES.items(), (False, True), (16, 128)):
        dot_dt, ieee = dot_dtype(dt, dt)
        br = block_r(r)
        args = dict(
            w_ptr=FP8, scale_ptr=F32, a_ptr=dt, b_ptr=dt, n_ptr=F32,
            N=N, K=K, R=r,
            stride_w_n=K, stride_a_r=K, stride_a_k=1, stride_b_n=r, stride_b_r=1,
            s=0.5,
        )
        constexprs = dict(ROW_SCALE=row, DOT_DT=dot_dt, IEEE=ieee, ONE_R_CHUNK=r <= br, BLOCK_R=br)
        name = f"{'row-scale' if row else 'tensor-scale'},r={r}"
        out.append(Variant(name, dt_name, args, constexprs, weight_norm_configs_for(arch)))
    return out


def _forward_variants(arch: str) -> list[Variant]:
    out = []
    for (dt_name, dt), (adapter, dropout, mode), row, m in itertools.product(
            DTYPES.items(), _adapter_modes(), (False, True), (LARGE_M, SMALL_M)):
        dot_dt, ieee = dot_dtype(dt)
        r = RANK if adapter else 1  # without an adapter the launcher passes r = 1 and x for u, B (never read)
        args = dict(
            x_ptr=dt, xd_ptr=dt, w_ptr=FP8, scale_ptr=F32, bias_ptr=dt, c_ptr=F32, u_ptr=dt, b_ptr=dt, y_ptr=dt, z_ptr=dt,
            M=m, N=N, K=K, R=r, M_BUCKET=m_bucket(m),
            stride_x_m=K, stride_xd_m=K, stride_w_n=K,
            stride_u_m=r if adapter else K, stride_u_r=1, stride_b_n=r if adapter else K, stride_b_r=1,
            stride_y_m=N, stride_z_m=N,
            s=0.5,
        )
        constexprs = dict(HAS_ADAPTER=adapter, HAS_DROPOUT=dropout, HAS_BIAS=True, NEED_Z=adapter, ROW_SCALE=row,
                          DOT_DT=dot_dt, IEEE=ieee, BLOCK_R=block_r(r))
        configs = gemm_configs_for(arch, "BLOCK_N", "BLOCK_K", dropout, m, dt == torch.float32)
        name = f"{mode},{'row-scale' if row else 'tensor-scale'},{'M<=64' if m <= 64 else 'M>64'}"
        out.append(Variant(name, dt_name, args, constexprs, configs))
    return out


def _dgrad_variants(arch: str) -> list[Variant]:
    out = []
    for (dt_name, dt), (adapter, dropout, mode), row, m in itertools.product(
            DTYPES.items(), _adapter_modes(), (False, True), (LARGE_M, SMALL_M)):
        dot_dt, ieee = dot_dtype(dt)
        r = RANK if adapter else 1  # without an adapter: r = 1 and g for v, A, mask (never read)
        args = dict(
            g_ptr=dt, w_ptr=FP8, scale_ptr=F32, scale_out_ptr=F32, c_ptr=F32, v_ptr=dt, a_ptr=dt,
            mask_ptr=torch.uint8 if dropout else dt, dx_ptr=dt,
            M=m, N=N, K=K, R=r, M_BUCKET=m_bucket(m),
            stride_g_m=N, stride_w_n=K, stride_v_m=r if adapter else N, stride_v_r=1,
            stride_a_r=K if adapter else N, stride_a_k=1, stride_mask_m=K if dropout else N, stride_dx_m=K,
            s=0.5, inv_keep=1.0 / 0.9 if dropout else 1.0,
        )
        constexprs = dict(HAS_ADAPTER=adapter, HAS_DROPOUT=dropout, ROW_SCALE=row, DOT_DT=dot_dt, IEEE=ieee,
                          BLOCK_R=block_r(r))
        configs = gemm_configs_for(arch, "BLOCK_K", "BLOCK_N", dropout, m, dt == torch.float32)
        name = f"{mode},{'row-scale' if row else 'tensor-scale'},{'M<=64' if m <= 64 else 'M>64'}"
        out.append(Variant(name, dt_name, args, constexprs, configs))
    return out


SPECS = [
    KernelSpec("weight_norm", _dora_weight_norm_kernel, _weight_norm_variants),
    KernelSpec("forward", _dora_fwd_kernel, _forward_variants),
    KernelSpec("dgrad", _dora_dgrad_kernel, _dgrad_variants),
]
