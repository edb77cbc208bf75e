"""A predicted time for the fp8 GEMM kernels and for a whole layer, from what the report reads (registers, shared
memory, the main loop's instruction mix) plus FLOPs and bytes: a PREDICTION, never a measurement (docs/INSPECT.md,
"Predicted time"; README's performance section quotes it as one).

The model, per kernel, on H100 SXM (sm_90a):
- the grid's tiles run in ceil(tiles / (SMs x CTAs per SM)) waves; CTAs per SM from registers, shared memory and warps;
- a reduction step of one CTA costs the slowest of the SM's pipes it uses, each at its rate per SM per clock:
  tensor cores (the step's FLOPs), instruction issue (4 warp-instructions per clock), the conversion pipes (F2F at 16
  lanes per clock; F2FP and the other conversions at 64), shared-memory loads (128 bytes per clock, one wavefront per
  warp-instruction at least); the resident CTAs of an SM share those pipes, so the SM's time is its CTAs' steps
  times that cost, back to back;
- the kernel takes the longer of that and its HBM bytes at the HBM rate.
Rates are peak figures times one efficiency, TC_EFFICIENCY, which maps the peak to what cuBLAS reaches (the
yardstick: a bf16 8192 x 4096 x 4096 GEMM at ~700 TF/s, ~0.39 ms); the same factor applies to every pipe, so the
prediction is a ratio to cuBLAS under one assumption, not an absolute time.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    name: str
    sms: int
    clock_hz: float           # the clock the peak figures are quoted at
    tc_flop_per_clk: int      # dense 16-bit tensor-core FLOP per clock per SM (fp8: twice)
    hbm_bytes_s: float        # achievable HBM bandwidth
    regs_per_sm: int = 65536
    max_warps_per_sm: int = 64
    launch_gap_s: float = 2e-6  # GPU-side gap between two dependent launches (an assumption, not a measurement)


# H100 SXM5: 132 SMs; 989.4 dense bf16 TFLOP/s at 1.83 GHz = 4096 FLOP per clock per SM; HBM3 3.35 TB/s peak, of
# which ~90% is reachable by a streaming kernel.
H100_SXM = Device("H100 SXM (sm_90a)", 132, 1.83e9, 4096, 3.0e12)
TC_EFFICIENCY = 700 / 989.4  # cuBLAS's bf16 GEMM at the headline shape, ~700 TF/s (the yardstick of README)

# Lanes per clock per SM of the pipes the main loop's conversions use (CUDA C++ Programming Guide, arithmetic
# instruction throughput, compute capability 9.0: conversions "to/from 64-bit types" and "all other" 16; the model
# takes 64 for F2FP, the packed 16/32-bit conversions, and for the F2F-free HADD2.F32 (the half-precision FMA pipe)).
F2F_LANES, CVT_LANES = 16, 64
FP32_FLOP_PER_CLK = 256     # 128 FP32 FMA lanes per SM
ISSUE_PER_CLK = 4           # one warp-instruction per scheduler per clock, four schedulers per SM
SMEM_BYTES_PER_CLK = 128
_LDS_BYTES = {"lds8": 1, "lds16": 2, "lds32": 4, "lds64": 8, "lds128": 16, "ldsm": 16}


def config_dict(config: str) -> dict:
    """"BLOCK_M=128,BLOCK_N=128,BLOCK_K=64,GROUP_M=8,w8,s3" -> {BLOCK_M: 128, ..., warps: 8, stages: 3}."""
    out = {}
    for part in config.split(","):
        if "=" in part:
            k, v = part.split("=")
            out[k] = int(v)
        elif m := re.fullmatch(r"([ws])(\d+)", part):
            out["warps" if m.group(1) == "w" else "stages"] = int(m.group(2))
    return out


def ctas_per_sm(rec: dict, warps: int, dev: Device) -> int:
    by_regs = dev.regs_per_sm // (rec["regs"] * 32 * warps)
    by_smem = rec["smem_limit"] // max(rec["smem_bytes"], 1)
    return max(0, min(by_regs, by_smem, dev.max_warps_per_sm // warps))


def step_cycles(rec: dict, flops_per_step: float, fp8: bool, warps: int, dev: Device) -> dict:
    """SM cycles one CTA's reduction step needs on each pipe (before TC_EFFICIENCY)."""
    mix = rec["main_loop"]
    lds = sum(mix[k] * max(1, _LDS_BYTES[k] * 32 / SMEM_BYTES_PER_CLK) for k in _LDS_BYTES)
    cvt = mix["f2fp_unpack"] + mix["f2fp_pack"] + mix["i2f"]
    return dict(
        tensor=flops_per_step / (dev.tc_flop_per_clk * (2 if fp8 else 1)),
        issue=warps * mix["instrs"] / ISSUE_PER_CLK,
        f2f=warps * mix["f2f"] * 32 / F2F_LANES,
        cvt=warps * cvt * 32 / CVT_LANES,
        lds=warps * lds,
    )


def predict_gemm(rec: dict, M: int, out: int, red: int, r: int, hbm_bytes: float, dev: Device = H100_SXM) -> dict:
    """Predicted seconds of one fp8 GEMM kernel (forward: out N, reduction K; dgrad: out K, reduction N) from its
    kernel-report record, and what bounds it. The epilogue's rank-r term (a [B_OUT, r] x [r, BLOCK_M] dot per tile,
    per accumulator) is added after the main loop: on tensor cores for 16-bit adapters, and for fp32 ones ("fp32-rank"
    variants) as LORA_PIECES bf16 products on tensor cores with a 16-bit output, on CUDA cores (FP32_FLOP_PER_CLK)
    with an fp32 one."""
    cfg = config_dict(rec["config"])
    bm = cfg["BLOCK_M"]
    names = ("BLOCK_N", "BLOCK_K") if rec["kernel"] == "forward" else ("BLOCK_K", "BLOCK_N")
    b_out, b_red = cfg[names[0]], cfg[names[1]]
    warps = cfg["warps"]
    fp8 = "w8a8" in rec["variant"]
    two = "dropout" in rec["variant"]
    flops_step = 2.0 * bm * b_out * b_red * (2 if two else 1)
    pipes = step_cycles(rec, flops_step, fp8, warps, dev)
    bound = max(pipes, key=pipes.get)
    tiles = math.ceil(M / bm) * math.ceil(out / b_out)
    per_sm = ctas_per_sm(rec, warps, dev)
    if per_sm == 0:
        raise ValueError(f"{rec['kernel']} {rec['config']}: no CTA fits an SM")
    ctas_each = math.ceil(tiles / dev.sms)  # the busiest SM's CTAs over the whole grid
    rank_flops = 2.0 * bm * b_out * r * (2 if two else 1) if "adapter" in rec["variant"] else 0.0
    if "fp32-rank" not in rec["variant"]:
        rank_cycles = rank_flops / dev.tc_flop_per_clk
    elif rec["dtype"] == "fp32":  # fp32 output: exact fp32 products on CUDA cores
        rank_cycles = rank_flops / FP32_FLOP_PER_CLK
    else:  # 16-bit output: bf16 products on tensor cores (split_dot); imported here, this module needs no torch
        from ..triton_kernels.epilogue_dot import LORA_PIECES

        rank_cycles = LORA_PIECES * rank_flops / dev.tc_flop_per_clk
    cycles = ctas_each * (math.ceil(red / b_red) * pipes[bound] + rank_cycles) / TC_EFFICIENCY
    t_compute = cycles / dev.clock_hz
    t_hbm = hbm_bytes / dev.hbm_bytes_s
    return dict(seconds=max(t_compute, t_hbm), compute_s=t_compute, hbm_s=t_hbm,
                bound=bound if t_compute >= t_hbm else "hbm", pipes=pipes, ctas_per_sm=per_sm,
                waves=tiles / (dev.sms * per_sm))


def linear_seconds(M: int, N: int, K: int, dev: Device = H100_SXM) -> float:
    """The yardstick under the same model: cuBLAS bf16 forward + input gradient, two GEMMs of 2 M N K FLOPs at the
    efficiency TC_EFFICIENCY assumes."""
    return 2 * (2.0 * M * N * K) / (dev.sms * dev.tc_flop_per_clk * dev.clock_hz * TC_EFFICIENCY)


# --- the headline prediction (python -m dorafp8.kernel_report --predict) ----------------------------------------------

HEADLINE = dict(M=8192, N=4096, K=4096, r=16)  # bf16 activations, fp32 adapters (PEFT's default), norm cached
HEADLINE_VARIANTS = {"W8A16": "adapter,tensor-scale,M>64,fp32-rank,r=16",
                     "W8A8": "adapter,tensor-scale,w8a8,M>64,fp32-rank,r=16"}


def gemm_hbm_bytes(kernel: str, M: int, N: int, K: int, fp8_act: bool, z_bytes: int) -> float:
    """Bytes a GEMM kernel must move at least: W8 once, its activation in, its output out (the forward also writes z
    for the backward; 2-byte activations, 1-byte under W8A8, whose quantized copies the quantizer wrote)."""
    act = 1 if fp8_act else 2
    if kernel == "forward":
        return M * K * act + N * K + M * N * 2 + M * N * z_bytes
    return M * N * act + N * K + M * K * 2


def headline(records: list[dict], z_bytes: int = 4, dev: Device = H100_SXM) -> list[dict]:
    """For each mode of HEADLINE_VARIANTS and GEMM kernel: the config the autotuner would pick if the model were right
    (the fastest predicted), with its prediction; records of sm_90a from the kernel report."""
    M, N, K, r = (HEADLINE[k] for k in ("M", "N", "K", "r"))
    out = []
    for mode, variant in HEADLINE_VARIANTS.items():
        for kernel, (o, red) in (("forward", (N, K)), ("dgrad", (K, N))):
            recs = [x for x in records if x["kernel"] == kernel and x["variant"] == variant and x["arch"] == "sm_90a"
                    and x["backend"] == "triton" and not x["error"] and x["main_loop"]]
            preds = [(predict_gemm(x, M, o, red, r, gemm_hbm_bytes(kernel, M, N, K, mode == "W8A8", z_bytes), dev),
                      x) for x in recs]
            if preds:
                p, x = min(preds, key=lambda t: t[0]["seconds"])
                out.append(dict(mode=mode, kernel=kernel, config=x["config"], **p))
    return out


# --- the whole layer: the GEMMs above plus every other launch of a forward + backward --------------------------------

def headline_launches(act_quant: str | None) -> list[tuple[str, int]]:
    """[(launch name, modelled bytes)] of one headline forward + backward on the Triton backend, from a dry run
    (dorafp8._launches: the launchers plan for an H100, nothing runs). Needs the Triton backend importable on this
    machine, i.e. TRITON_INTERPRET=1 without a GPU: call it through launches_subprocess()."""
    import torch

    import dorafp8
    from dorafp8._launches import LaunchRecorder, dry_run

    M, N, K, r = (HEADLINE[k] for k in ("M", "N", "K", "r"))
    w8 = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    leaves = [torch.empty(M, K, dtype=torch.bfloat16), torch.empty(r, K), torch.empty(N, r), torch.ones(N)]
    leaves = [t.requires_grad_() for t in leaves]
    x, A, B, m = leaves
    scale, n = torch.ones(()), torch.ones(N)
    with LaunchRecorder() as rec, dry_run(rec, H100_SXM.sms, 2):
        y = dorafp8.dora_fp8_linear(x, w8, scale, A, B, m, 2.0, backend="triton", weight_norm=n, act_quant=act_quant)
        y.backward(torch.empty(M, N, dtype=torch.bfloat16))
    return [(launch.name, launch.nbytes) for launch in rec.launches]


def launches_subprocess() -> dict[str, list]:
    """{"W8A16": headline_launches(None), "W8A8": headline_launches("rowwise")} from a fresh interpreter with
    TRITON_INTERPRET=1 (the kernel report's own processes must not set it: it changes what @triton.jit returns)."""
    import json
    import os
    import subprocess
    import sys

    code = ("import json; from dorafp8.kernel_report.predict import headline_launches as h; "
            "print(json.dumps({'W8A16': h(None), 'W8A8': h('rowwise')}))")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"the headline dry run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


GEMM_KERNELS = {"triton:dora_fwd_kernel": "forward", "triton:dora_dgrad_kernel": "dgrad"}


def layer_seconds(gemms: dict[str, float], launches: list[tuple[str, int]], dev: Device = H100_SXM) -> dict:
    """A forward + backward: each GEMM launch at its prediction (gemms: {"forward": s, "dgrad": s}), every other
    launch at its modelled bytes over HBM, and a gap between launches (Device.launch_gap_s)."""
    other = [(name, nbytes) for name, nbytes in launches if name not in GEMM_KERNELS]
    t_other = sum(nbytes for _, nbytes in other) / dev.hbm_bytes_s
    t_gaps = len(launches) * dev.launch_gap_s
    return dict(seconds=sum(gemms.values()) + t_other + t_gaps, other_s=t_other, gaps_s=t_gaps,
                launches=len(launches), other_launches=len(other),
                bytes=sum(nbytes for _, nbytes in launches))
