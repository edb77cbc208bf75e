"""Predicted times for the fp8 GEMM kernels, a whole layer, and the strategies it is weighed against: a PREDICTION,
never a measurement. Every rate is in RATES with its source; an unknown rate is a range, and so is every prediction
(lo/hi: every range at its fast/slow end). The model: docs/INSPECT.md, "Predicted time"."""

from __future__ import annotations

import glob
import json
import math
import os
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Rate:
    lo: float   # the fast end (or the only value)
    hi: float   # the slow end
    source: str

    def pick(self, end: str) -> float:
        return self.lo if end == "lo" else self.hi


# H100 SXM5 (sm_90a). Per SM and clock unless stated; "lo"/"hi" are the fast and the slow end of the prediction.
SMS = 132
CLOCK_HZ = 1.83e9  # the clock NVIDIA's peak figures are quoted at
RATES = {
    "tensor": Rate(4096, 4096, "documented: 989.4 dense bf16 TFLOP/s (H100 SXM datasheet) = 132 SMs x 1.83 GHz x "
                               "4096 FLOP a clock; e4m3 twice that"),
    "efficiency": Rate(798 / 989.4 / (15.52 / 16), 769 / 989.4,
                       "measured: cuBLAS's bf16 8192^3 GEMM reached 769-798 TFLOP/s on the project's H100, a fraction "
                       "of the peak that the model applies to every pipe (the clock under load, power); the fast end "
                       "takes cuBLAS's own wave loss out of it (2048 tiles of 128 x 256 on 132 SMs: 15.52 waves in "
                       "16), which the model charges the package's kernels on their own, the slow end keeps it"),
    "yardstick": Rate(798e12, 798e12, "measured: cuBLAS bf16, 8192^3, the project's H100 (FLOP/s): the Linear, the "
                                      "cuBLAS strategy's and PEFT's 16-bit matrix products"),
    "issue": Rate(4, 4, "documented: four schedulers, one warp-instruction a clock each"),
    "f2f": Rate(16, 16, "documented: CUDA C++ Programming Guide, arithmetic instructions, cc 9.0: 16 conversions a "
                        "clock ('all other')"),
    "f2fp": Rate(64, 16, "assumed 64 (the packed F2FP's rate is in no document) to 16, the guide's 'all other "
                         "conversions'"),
    "alu": Rate(128, 128, "documented: 128 fp32 lanes (FADD, FFMA)"),
    "fp32_flops": Rate(256 * 0.8, 256 * 0.5, "documented 256 fp32 FLOP a clock (128 FMA); an fp32 matrix product "
                                             "reaches 80 to 50% of it: assumed (the rank-r kernels' fp32 FMA dots, "
                                             "which it used to time, reached 5 to 23% on the H200: project_kernel "
                                             "1.07 GFLOP in 331 us; at the headline they are bf16 products now)"),
    "smem": Rate(128, 128, "documented: 32 banks x 4 bytes a clock"),
    "mma_smem": Rate(0.0, 1.0, "assumed: whether wgmma's shared-memory operand reads take the same 128 bytes a clock "
                               "(not at all, to fully)"),
    "barrier": Rate(20, 40, "assumed: cycles a CTA-wide barrier costs a step when its warps arrive together"),
    "chain": Rate(0, 60, "assumed: latency a warp-specialized consumer's step leaves exposed (mbarrier, LDS)"),
    "f2fp_latency": Rate(6, 12, "assumed: cycles from a packed conversion (F2FP) to its result, which the wgmma it "
                                "feeds waits on: exposed once per wgmma in a consumer's chain"),
    "epilogue": Rate(1.0, 2.0, "assumed: the epilogue's instructions at issue rate (1) to twice that (its loads and "
                               "stores' latency)"),
    "first_load_s": Rate(0.6e-6, 1.2e-6, "assumed: the latency of a CTA's first tile loads (HBM)"),
    "hbm": Rate(3.0e12, 3.0e12, "measured: 3.0 TB/s device copy, the project's H100 (3.35 TB/s datasheet)"),
    "launch_gap_s": Rate(1e-6, 3e-6, "assumed: between two dependent launches on the GPU"),
}
# Measured: the Python around the kernels per forward + backward at M = 256 on this project's (shared, loaded) CPU,
# bench/glue_cpu.py (docs/ARCHITECTURE.md): --predict states it as the floor of a step at small M without CUDA graphs.
CPU_GLUE_S = (0.35e-3, 0.44e-3)
_LDS_BYTES = {"lds8": 1, "lds16": 2, "lds32": 4, "lds64": 8, "lds128": 16, "ldsm": 16}
ENDS = ("lo", "hi")


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


def _tile(rec: dict) -> tuple[int, int, int, int]:
    """(BLOCK_M, B_OUT, B_RED, warps of the main loop's warpgroups)."""
    cfg = config_dict(rec["config"])
    names = ("BLOCK_N", "BLOCK_K") if rec["kernel"] == "forward" else ("BLOCK_K", "BLOCK_N")
    ws = rec.get("ws_consumers") or 0
    return cfg["BLOCK_M"], cfg[names[0]], cfg[names[1]], 4 * ws if ws else cfg["warps"]


def step_cycles(rec: dict, end: str) -> dict:
    """SM cycles of a CTA's reduction step per pipe (before efficiency), and a ws consumer's "chain"."""
    mix, R = rec["main_loop"], RATES
    bm, b_out, b_red, warps = _tile(rec)
    fp8 = "w8a8" in rec["variant"]
    two = "dropout" in rec["variant"]
    flops = 2.0 * bm * b_out * b_red * (2 if two else 1)
    tensor = flops / (R["tensor"].pick(end) * (2 if fp8 else 1))
    issue = warps * mix["instrs"]
    if prod := rec.get("producer_loop"):
        issue += 4 * prod["instrs"]
    lds = sum(mix[k] * max(1.0, _LDS_BYTES[k] * 32 / R["smem"].pick(end)) for k in _LDS_BYTES) * warps
    act = 1 if fp8 else 2
    # the weight tile (its bytes a weight: W_BYTES) and the activation tiles, every step
    fills = b_out * b_red * weight_bytes(rec["variant"]) + bm * b_red * act * (2 if two else 1)
    operands = (b_out // 64) * bm * b_red * act * (2 if two else 1)  # B: read by each m64 wgmma
    if rec["w_operand"] == "shared":
        operands += b_out * b_red  # A from shared memory too (W8A8)
    pipes = dict(
        tensor=tensor,
        issue=issue / R["issue"].pick(end),
        f2f=warps * mix["f2f"] * 32 / R["f2f"].pick(end),
        f2fp=warps * (mix["f2fp_unpack"] + mix["f2fp_pack"]) * 32 / R["f2fp"].pick(end),
        alu=warps * mix["fp32_alu"] * 32 / R["alu"].pick(end),
        smem=lds + (fills + R["mma_smem"].pick(end) * operands) / R["smem"].pick(end),
    )
    ws = rec.get("ws_consumers") or 0
    if ws:  # one warpgroup: its share of the tensor work, then its own instructions (one warp per scheduler), each
        # F2FP holding its scheduler's quarter of the conversion rate for a warp's 32 lanes, and the last conversion's
        # latency before each of its wgmma (the W8 operand is converted for each)
        f2fp = mix["f2fp_unpack"] + mix["f2fp_pack"]
        wgmmas = mix.get("mma", 0)
        pipes["chain"] = (tensor / ws + mix["instrs"] + f2fp * (32 * 4 / R["f2fp"].pick(end) - 1)
                          + (wgmmas * R["f2fp_latency"].pick(end) if f2fp else 0) + R["chain"].pick(end))
    return pipes


def step_time(rec: dict, end: str) -> tuple[float, str, dict]:
    """(cycles of one step, what bounds it, the pipes) under the loop's overlap rules (docs/INSPECT.md)."""
    pipes = step_cycles(rec, end)
    mix = rec["main_loop"]
    bound = max(pipes, key=pipes.get)
    cycles = pipes[bound]
    if not rec.get("ws_consumers"):
        if "w8a8" in rec["variant"] and mix["fp32_alu"]:  # the promotion: drain, then the adds, every step
            drained = pipes["tensor"] + pipes["alu"]  # the adds wait for the drained wgmma, the next wgmma for them
            if drained > cycles:
                cycles, bound = drained, "tensor+promotion"
        cycles += mix.get("bar_cta", 0) * RATES["barrier"].pick(end)
    return cycles, bound, pipes


def predict_gemm(rec: dict, M: int, out: int, red: int, hbm_bytes: float, end: str = "lo", r: int = 0) -> dict:
    """Predicted seconds of one fp8 GEMM kernel (forward: out N, reduction K; dgrad: out K, reduction N) from its record
    at one end of the ranges, and what bounds it. r: the adapters' rank (its epilogue product on tensor cores)."""
    from ..triton_kernels.epilogue_dot import LORA_PIECES  # here: this module's top needs no torch

    R = RATES
    bm, b_out, b_red, warps = _tile(rec)
    cycles, bound, pipes = step_time(rec, end)
    rank = 2.0 * bm * b_out * r * (2 if "dropout" in rec["variant"] else 1) if "adapter" in rec["variant"] else 0.0
    rank *= LORA_PIECES if "fp32-rank" in rec["variant"] else 1
    tiles = math.ceil(M / bm) * math.ceil(out / b_out)
    tiles_sm = math.ceil(tiles / SMS)  # one CTA per SM at these tiles (registers, or the persistent grid)
    ws = rec.get("ws_consumers") or 0
    loop_instrs = rec["main_loop"]["instrs"] * max(1, ws) + ((rec.get("producer_loop") or {}).get("instrs", 0))
    # the epilogue and prologue, once per tile, on every warp (warp specialization: each partition on its 4 warps); a
    # persistent kernel runs what lies outside its tile loops once per CTA
    every = rec.get("kernel_instrs") or 0
    in_tiles = rec.get("tile_instrs") if rec.get("tile_loop") and rec.get("tile_instrs") else every
    issue = (4 if ws else warps) / R["issue"].pick(end) * R["epilogue"].pick(end)  # cycles per instruction
    per_tile = max(0, in_tiles - loop_instrs) * issue + rank / R["tensor"].pick(end)
    setup = (every - in_tiles) * issue
    first_loads = R["first_load_s"].pick(end) * CLOCK_HZ
    starts = 1 if rec.get("tile_loop") else tiles_sm  # a persistent CTA starts once, a plain one per tile
    total = tiles_sm * (math.ceil(red / b_red) * cycles + per_tile) + starts * first_loads + setup
    t_compute = total / (CLOCK_HZ * R["efficiency"].pick(end))
    t_hbm = hbm_bytes / R["hbm"].pick(end)
    return dict(seconds=max(t_compute, t_hbm), compute_s=t_compute, hbm_s=t_hbm,
                bound=bound if t_compute >= t_hbm else "hbm", pipes=pipes, step_cycles=cycles, tiles_per_sm=tiles_sm,
                per_tile_cycles=per_tile)


def linear_seconds(M: int, N: int, K: int) -> float:
    """The yardstick: cuBLAS bf16 forward + input gradient, two GEMMs of 2 M N K FLOPs at the measured rate."""
    return 2 * (2.0 * M * N * K) / RATES["yardstick"].lo


def linear_bytes(M: int, N: int, K: int) -> int:
    """The yardstick's bytes: each of its two GEMMs reads its two bf16 operands and writes its result once."""
    return 2 * (M * K + N * K + M * N) * 2


def dora_floor_bytes(M: int, N: int, K: int) -> int:
    """DoRA's own floor for the design that keeps z: the Linear's bytes, x read again for dA, g again by the backward
    pass, z written and read back for dm. What a strategy moves beyond it is its overhead."""
    return linear_bytes(M, N, K) + M * K * 2 + M * N * 2 + 2 * M * N * 2


# The fewest bytes and launches of a dequantize + cuBLAS design that we know of (docs/INSPECT.md, "The dequantize
# strategy's floor"): DoRA's floor, the dequantize (W8 read, W written once a step), x read once more for u, the
# product read back by the pass that forms the forward's second output (y or z), and the dgrad's left operand with c
# in it written (gl, or g copied beside v); the dequantize, u, two products, two passes and dA.
DEQUANT_FLOOR_LAUNCHES = 7


def dequant_floor_bytes(M: int, N: int, K: int) -> int:
    return dora_floor_bytes(M, N, K) + 3 * N * K + M * K * 2 + M * N * 2 + M * N * 2


def dequant_floor_seconds(M: int, N: int, K: int, end: str) -> float:
    """That floor's time: both products at the Linear's rate, every other byte at HBM's, a gap per launch."""
    rest = dequant_floor_bytes(M, N, K) - linear_bytes(M, N, K)
    return (linear_seconds(M, N, K) + rest / RATES["hbm"].pick(end)
            + DEQUANT_FLOOR_LAUNCHES * RATES["launch_gap_s"].pick(end))


# --- the headline (python -m dorafp8.kernel_report --predict) ------------------------------------------------------

HEADLINE = dict(M=8192, N=4096, K=4096, r=16)  # bf16 activations, fp32 adapters (PEFT's default), norm cached
HEADLINE_VARIANTS = {"W8A16": "adapter,tensor-scale,M>64,fp32-rank,r=16",
                     "W8A8": "adapter,tensor-scale,w8a8,M>64,fp32-rank,r=16",
                     # the microscaled bases (W4A16 / W8A16 on NVFP4 / MXFP8 weights): the cp.async loop only
                     "NVFP4 W4A16": "adapter,nvfp4-scale,M>64,fp32-rank,r=16",
                     "MXFP8 W8A16": "adapter,mxfp8-scale,M>64,fp32-rank,r=16"}
# The main loops compared (inspect_spec.COMPARED compiles the fp8 headline variants in both on sm_90a)
LOOPS = ("tma-ws", "async-copy")
MICRO_MODES = {"NVFP4 W4A16": "nvfp4", "MXFP8 W8A16": "mxfp8"}  # mode -> the weight's kind (dorafp8/quant.py)
# A weight's bytes in HBM and in the kernel's shared-memory tile: e4m3 1; NVFP4 half a byte and an e4m3 scale per 16;
# MXFP8 one byte and an e8m0 scale per 32
W_BYTES = {"nvfp4": 0.5 + 1 / 16, "mxfp8": 1 + 1 / 32}


def weight_bytes(variant: str) -> float:
    """Bytes a weight of a record's variant ("adapter,nvfp4-scale,..."): W_BYTES, else 1 (e4m3)."""
    return next((b for kind, b in W_BYTES.items() if f"{kind}-scale" in variant), 1.0)


def _suffix(loop: str, mode: str = "W8A16") -> str:
    """`loop`'s variant-name suffix on sm_90a: "" if the launchers pick it, else ",<loop>"; None if `mode` lacks it."""
    if mode in MICRO_MODES:
        return "" if loop == "async-copy" else None
    from ..triton_kernels.hopper import main_loop_for  # the launchers' own rule (this module's top needs no torch)

    return "" if loop == main_loop_for("sm90") else f",{loop}"


def gemm_hbm_bytes(kernel: str, M: int, N: int, K: int, fp8_act: bool, z_bytes: int, w_bytes: float = 1.0) -> float:
    """Least bytes a GEMM kernel moves: the weight once (w_bytes each), activation in (1 or 2 bytes), output (and z)."""
    act = 1 if fp8_act else 2
    if kernel == "forward":
        return M * K * act + N * K * w_bytes + M * N * 2 + M * N * z_bytes
    return M * N * act + N * K * w_bytes + M * K * 2


def headline(records: list[dict]) -> list[dict]:
    """For each mode, main loop and GEMM kernel: the config the autotuner would pick if the model were right (the
    fastest at the fast end), with its prediction at both ends; records of sm_90a from the kernel report."""
    M, N, K = (HEADLINE[k] for k in ("M", "N", "K"))
    out = []
    for mode, variant in HEADLINE_VARIANTS.items():
        for loop in LOOPS:
            if _suffix(loop, mode) is None:
                continue
            for kernel, (o, red) in (("forward", (N, K)), ("dgrad", (K, N))):
                recs = [x for x in records if x["kernel"] == kernel and x["variant"] == variant + _suffix(loop, mode)
                        and x["arch"] == "sm_90a" and x["backend"] == "triton" and not x["error"] and x["main_loop"]]
                hbm = gemm_hbm_bytes(kernel, M, N, K, mode == "W8A8", 2, weight_bytes(variant))  # z in bf16
                preds = [({end: predict_gemm(x, M, o, red, hbm, end, HEADLINE["r"]) for end in ENDS}, x)
                         for x in recs]
                if preds:
                    p, x = min(preds, key=lambda t: t[0]["lo"]["seconds"])
                    out.append(dict(mode=mode, loop=loop, kernel=kernel, config=x["config"], lo=p["lo"], hi=p["hi"]))
    return out


# --- the whole layer, and the strategies it is weighed against ------------------------------------------------------

GEMM_KERNELS = {"triton:dora_fwd_kernel": "forward", "triton:dora_dgrad_kernel": "dgrad"}
# The rank-r kernels' FLOPs at the headline: u = x A^T; v = (g c) B and dB = (g c)^T u; dA = v^T x. Under the
# headline's bf16 activations and fp32 adapters each product is three exact bf16 products on tensor cores, the fp32
# operand split in three (triton_kernels/_common.py split_dtype): 3x the FLOPs, at the yardstick's rate, far below their
# bytes' time (the FMA dots they replaced were charged on CUDA cores). The GEMMs' epilogues are in their own predictions.
RANK_FLOPS = {"triton:project_kernel": lambda M, N, K, r: 3 * 2 * M * K * r,
              "triton:dora_bwd_pass_kernel": lambda M, N, K, r: 3 * 4 * M * N * r,
              "triton:project_grad_kernel": lambda M, N, K, r: 3 * 2 * M * K * r}


def launch_seconds(launch: dict, end: str, shape: dict | None = None) -> float:
    """One launch other than the fused GEMMs: the longer of its bytes over HBM and its FLOPs (the rank-r kernels' split
    products, or a 16-bit matrix product, at the yardstick's rate; an fp32 matrix product on CUDA cores). shape: M, N,
    K, r (default the headline's; bf16 activations and fp32 adapters always)."""
    R = RATES
    t = launch["nbytes"] / R["hbm"].pick(end)
    flops = launch.get("flops") or 0
    dims = [(shape or HEADLINE)[k] for k in ("M", "N", "K", "r")]
    if launch["name"] in RANK_FLOPS:
        return max(t, RANK_FLOPS[launch["name"]](*dims) / R["yardstick"].pick(end))
    if flops:
        fp32 = any("float32" in str(d) for _, d in launch.get("shapes", [])[:2])
        return max(t, flops / (SMS * CLOCK_HZ * R["fp32_flops"].pick(end) if fp32 else R["yardstick"].pick(end)))
    return t


def layer_seconds(gemms: dict[str, float], launches: list[dict], end: str = "lo", shape: dict | None = None) -> dict:
    """A forward + backward: the fused GEMM launches at their predictions (gemms: {"forward": s, "dgrad": s}; none
    for the other strategies), every other launch at launch_seconds, and a gap per launch."""
    other = [lc for lc in launches if lc["name"] not in GEMM_KERNELS]
    t_other = sum(launch_seconds(lc, end, shape) for lc in other)
    t_gaps = len(launches) * RATES["launch_gap_s"].pick(end)
    return dict(seconds=sum(gemms.values()) + t_other + t_gaps, other_s=t_other, gaps_s=t_gaps,
                launches=len(launches), other_launches=len(other), bytes=sum(lc["nbytes"] for lc in launches))


def _headline_weight(kind: str | None, N: int, K: int, device: str = "cpu"):
    """(weight, scale, global scale) of the headline's base, e4m3 or NVFP4 / MXFP8 (zeros: dry runs read none)."""
    import torch

    from dorafp8 import quant

    if kind == "nvfp4":
        w = (torch.zeros(N, K // 2, dtype=torch.uint8), torch.ones(N, K // 16).to(quant.E4M3), torch.ones(()))
    elif kind == "mxfp8":
        w = (torch.zeros(N, K, dtype=quant.E4M3), torch.full((N, K // 32), 127, dtype=torch.uint8).view(quant.E8M0),
             None)
    else:
        w = torch.empty(N, K, dtype=torch.float8_e4m3fn), torch.ones(()), None
    return tuple(t if t is None else t.to(device) for t in w)


def _headline_leaves(act_quant, hopper: bool, backend: str, M: int | None = None, kind: str | None = None,
                     device: str = "cpu"):
    """[(name, nbytes, flops, shapes)] of a dry-run headline step on `backend` (at M tokens, on a `kind` base), its
    tensors on `device` (dry_run_device)."""
    import torch

    import dorafp8
    from dorafp8._launches import LaunchRecorder, dry_run

    N, K, r = (HEADLINE[k] for k in ("N", "K", "r"))
    M = M or HEADLINE["M"]
    w8, scale, g = _headline_weight(kind, N, K, device)
    leaves = [torch.empty(M, K, dtype=torch.bfloat16), torch.empty(r, K), torch.empty(N, r), torch.ones(N)]
    x, A, B, m = (t.to(device).requires_grad_() for t in leaves)
    n = torch.ones(N, device=device)
    with LaunchRecorder() as rec, dry_run(rec, SMS, 2):
        y = dorafp8.dora_fp8_linear(x, w8, scale, A, B, m, 2.0, backend=backend, weight_norm=n, act_quant=act_quant,
                                    global_scale=g)
        y.backward(torch.empty(M, N, dtype=torch.bfloat16, device=device))
    return rec


def _peft_dora():
    """PEFT's DoRA on a bf16 nn.Linear at the headline shape (its fp32 adapters, the norm recomputed every call, as
    PEFT does), forward + backward on meta tensors: PEFT's own code, each aten op recorded with its bytes."""
    import warnings

    import torch
    from peft import LoraConfig, get_peft_model

    from dorafp8._launches import LaunchRecorder

    M, N, K, r = (HEADLINE[k] for k in ("M", "N", "K", "r"))
    with torch.device("meta"):
        net = torch.nn.Sequential(torch.nn.Linear(K, N, bias=False, dtype=torch.bfloat16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(net, LoraConfig(r=r, lora_alpha=2 * r, use_dora=True, target_modules=["0"]))
    x = torch.empty(M, K, dtype=torch.bfloat16, device="meta", requires_grad=True)
    with LaunchRecorder() as rec:
        model(x).backward(torch.empty(M, N, dtype=torch.bfloat16, device="meta"))
    return rec


STRATEGIES = {  # name -> (backend, act_quant, Hopper loop[, the base's microscaled kind])
    "W8A16": ("triton", None, True), "W8A16, cp.async loop": ("triton", None, False),
    "W8A8": ("triton", "rowwise", True), "W8A8, cp.async loop": ("triton", "rowwise", False),
    "dequantize + cuBLAS": ("cublas", None, False),
    "NVFP4 W4A16, cp.async loop": ("triton", None, False, "nvfp4"),
    "NVFP4 dequantize + cuBLAS": ("cublas", None, False, "nvfp4"),
    "MXFP8 W8A16, cp.async loop": ("triton", None, False, "mxfp8"),
    "MXFP8 dequantize + cuBLAS": ("cublas", None, False, "mxfp8"),
}


# The other token counts the cuBLAS strategy's targets are set at (issue 52): --predict prints it there too.
SMALL_MS = (1024, 256)


def strategy_launches(name: str, M: int | None = None, device: str = "cpu") -> list[dict]:
    """The launches of a strategy's headline step (at M tokens, recorded on `device`: "cpu" under TRITON_INTERPRET=1,
    or "cuda"); needs Triton importable, "PEFT DoRA" peft (on meta tensors wherever)."""
    if name == "PEFT DoRA":
        rec = _peft_dora()
    else:
        backend, act_quant, hopper, *kind = STRATEGIES[name]
        os.environ["DORAFP8_HOPPER_GEMM"] = "1" if hopper else "0"
        rec = _headline_leaves(act_quant, hopper, backend, M, *(kind or [None]), device=device)
    return [dict(name=lc.name, nbytes=lc.nbytes, flops=lc.flops, shapes=[(list(s), str(d)) for s, d in lc.shapes])
            for lc in rec.launches]


def dry_run_device() -> str:
    """Where the headline's dry runs record their launches (no kernel runs in either): "cpu" under Triton's
    interpreter; where that interpreter cannot run (Triton 3.6 under NumPy 2.4 or newer: the first GPU run's machine,
    whose pins step lost every layer prediction to it) an sm_90 GPU, whose launchers plan as the model's H100 does;
    else a RuntimeError saying why neither."""
    from ..triton_kernels import interpreter_problem

    why = interpreter_problem()
    if why is None:
        return "cpu"
    import torch

    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        return "cuda"
    raise RuntimeError(f"the headline dry runs need Triton's interpreter or an sm_90 GPU, and there is no such GPU "
                       f"here: {why}")


def launches_subprocess(names=None, small=(), timeout=None) -> dict[str, list]:
    """{strategy: strategy_launches(strategy)} from a fresh interpreter, on dry_run_device(): with TRITON_INTERPRET=1
    (which the report's own processes must not set) on CPU, without it on a GPU; PEFT's DoRA where peft is installed.
    small: (strategy, M) pairs, keyed "strategy @ M". The child prints each strategy's line as it finishes: past
    `timeout` seconds it is killed and the strategies it finished are returned (the caller sees which are missing)."""
    import importlib.util
    import subprocess
    import sys

    names = list(names or [*STRATEGIES, "PEFT DoRA"])
    if "PEFT DoRA" in names and importlib.util.find_spec("peft") is None:
        names.remove("PEFT DoRA")
    dev = dry_run_device()
    code = ("import json, sys; from dorafp8.kernel_report.predict import strategy_launches as s\n"
            f"for n in {names!r}: print(json.dumps({{n: s(n, None, {dev!r})}}), flush=True)\n"
            f"for n, m in {list(small)!r}: print(json.dumps({{f'{{n}} @ {{m}}': s(n, m, {dev!r})}}), flush=True)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    if dev != "cpu":
        env.pop("TRITON_INTERPRET")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # POSIX: what it printed before the kill, as bytes
        out = e.stdout or b""
        return _launch_lines(out.decode(errors="replace") if isinstance(out, bytes) else out)
    if done.returncode:
        raise RuntimeError(f"the headline dry runs failed:\n{done.stderr[-3000:]}")
    return _launch_lines(done.stdout)


def _launch_lines(stdout: str) -> dict[str, list]:
    """launches_subprocess's child's lines, one JSON object each, merged (other lines, a library's prints, skipped)."""
    out = {}
    for line in stdout.splitlines():
        if line.startswith("{"):
            try:
                out.update(json.loads(line))
            except ValueError:  # a line cut by the kill
                pass
    return out


def layer_table(records: list[dict], launches: dict[str, list]) -> list[dict]:
    """Every strategy's forward + backward at the headline, both ends: [{name, lo, hi, launches, bytes}]."""
    gemms = headline(records)
    out = []
    for name, lcs in launches.items():
        row = dict(name=name, launches=len(lcs), bytes=sum(lc["nbytes"] for lc in lcs))
        if name in STRATEGIES and STRATEGIES[name][0] == "triton":
            mode, loop = name.split(",")[0], "async-copy" if "cp.async" in name else "tma-ws"
            picked = {p["kernel"]: p for p in gemms if p["mode"] == mode and p["loop"] == loop}
            if set(picked) != {"forward", "dgrad"}:
                continue  # its GEMMs were not compiled here
            for end in ENDS:
                row[end] = layer_seconds({k: p[end]["seconds"] for k, p in picked.items()}, lcs, end)["seconds"]
            row["gemms"] = picked
        else:
            for end in ENDS:
                row[end] = layer_seconds({}, lcs, end)["seconds"]
        out.append(row)
    return out


# --- measurements, where a GPU run left them (bench/results/<device>/) ----------------------------------------------

# The benchmark's providers and modes of the headline (bench/_cases.py DECISIVE_CASES) -> the strategies above (the
# Triton fp8 ones then named with the main loop they ran: measured_strategy)
MEASURED_AS = {("dorafp8-triton", "fwd+bwd-cachednorm"): "W8A16", ("dorafp8-triton-w8a8", "fwd+bwd-cachednorm"): "W8A8",
               ("dorafp8-cublas", "fwd+bwd-cachednorm"): "dequantize + cuBLAS", ("peft-dora", "fwd+bwd"): "PEFT DoRA",
               ("linear-bf16", "fwd+bwd"): "cuBLAS bf16 Linear"}
# The main loop of a measurement that does not name one (bench/run.py and ncu_profile.py record `main_loop` since the
# cp.async loop became the default): the only GPU run before that (a516cbd, H200) ran the Hopper loop, sm_90's
# default until then.
UNNAMED_LOOP = "tma-ws"


def measured_strategy(mode: str, main_loop: str | None) -> str:
    """The strategy a measured Triton fp8 layer of `mode` ("W8A16", "W8A8") ran: its launchers' main loop, which the
    measurement names (bench/run.py's records, the profile's and ncu_kernels.json's "main_loop": the default is the
    cp.async loop since the first GPU run, DORAFP8_HOPPER_GEMM=1 the Hopper one); one that names none predates the
    name: the first GPU run's (H200), whose launchers took the Hopper loop."""
    return mode if (main_loop or UNNAMED_LOOP) == "tma-ws" else f"{mode}, cp.async loop"


def measured(results_dir: str) -> dict:
    """What GPU runs measured at the headline: {"layers": {strategy: [(ms, device, commit)]}, "kernels": {kernel name:
    [(us, device, main loop)]}} from bench/results/*/results.json and ncu_kernels.json; empty where none has run.
    The Triton layers are named with the main loop they ran (measured_strategy)."""
    M, N, K, r = (HEADLINE[k] for k in ("M", "N", "K", "r"))
    layers, kernels = {}, {}
    for path in sorted(glob.glob(os.path.join(results_dir, "*", "results.json"))):
        with open(path) as f:
            data = json.load(f)
        for rec in data.get("records", data) if isinstance(data, dict) else data:
            name = MEASURED_AS.get((rec.get("provider"), rec.get("mode")))
            if name in ("W8A16", "W8A8"):
                name = measured_strategy(name, rec.get("main_loop"))
            if (name and rec.get("status") == "ok" and rec.get("ms") and rec.get("tokens") == M
                    and rec.get("in_features") == K and rec.get("out_features") == N and rec.get("rank") == r
                    and rec.get("dtype") == "bf16" and not rec.get("dropout")):
                layers.setdefault(name, []).append((rec["ms"], rec.get("device", "?"), rec.get("commit", "?")))
    for path in sorted(glob.glob(os.path.join(results_dir, "*", "ncu_kernels.json"))):
        with open(path) as f:
            data = json.load(f)
        for k in data.get("kernels", []):
            kernels.setdefault(re.sub(r"\W.*$", "", k["name"]), []).append((
                k["us"] / max(1, k.get("count", 1)), os.path.basename(os.path.dirname(path)),
                k.get("main_loop", data.get("main_loop")) or UNNAMED_LOOP))
    return dict(layers=layers, kernels=kernels)
