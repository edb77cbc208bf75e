"""Pieces shared by the Triton kernels: the dot helper, launch-time choices, the argument checks and the autotune
configs per arch and Triton version (why each table holds what it does: docs/ARCHITECTURE.md). The Hopper main
loop's own choices are in hopper.py. Long because the launch glue every launcher shares (launch, OneConfig) sits
with the tables it launches."""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from ..backends import base as _base
from ..backends.base import NORM_EPS as _NORM_EPS
from ._pins import pin_of, pinned

# Rank chunk of the rank-r epilogues (u B^T, v A, B A): 16 under the interpreter, so that the tests cross a chunk with
# r = 20; 64 on a GPU keeps the rank tiles in registers (r = 256 loops 4 times).
_MAX_BLOCK_R_GPU = 64
_MAX_BLOCK_R_INTERP = 16
_MAX_BLOCK_R_IEEE = 16
# tl.dot needs every dimension >= 16 on tensor cores; smaller ranks are zero-padded with masks.
_DOT_MIN = 16
FP8_DOT_MIN_K = 32  # an fp8 tl.dot's K on a GPU (e4m3 MMA: k32): W8A8 block scales need b % 32 == 0


# Read once: Triton decides at each @triton.jit whether a kernel is interpreted, i.e. when this package is imported.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def interpreting() -> bool:
    """Under Triton's interpreter (the launchers then pick its small tiles), unless a dry run plans for a GPU."""
    return _INTERPRET and _DRY_RUN is None


# The launchers' integer helpers in plain Python: triton.cdiv and triton.next_power_of_2 are constexpr functions in
# Triton 3.9, whose calls from host code cost several microseconds each (bench/glue_cpu.py).
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


# Launch observers (dorafp8._launches registers one): observe(kernel, grid, args, kwargs) -> True when it handled the
# launch itself (or skipped it in a dry run, where the launchers plan for the GPU _DRY_RUN describes).
LAUNCH_OBSERVERS: list = []
_DRY_RUN = None


def dry_run() -> dict | None:
    """The plan of the dry run in progress ({"sms": ..., "blocks": ...}, planning_for_gpu), or None."""
    return _DRY_RUN


def launch_observers() -> list:
    """The list of launch observers (see above): observe(kernel, grid, args, kwargs) -> handled?"""
    return LAUNCH_OBSERVERS


@contextlib.contextmanager
def planning_for_gpu(sms: int, blocks: int):
    """Inside: the launchers plan for `sms` SMs holding `blocks` blocks of each kernel (a dry run; see above)."""
    global _DRY_RUN
    prev, _DRY_RUN = _DRY_RUN, {"sms": int(sms), "blocks": int(blocks)}
    try:
        yield
    finally:
        _DRY_RUN = prev


def launch(kernel, grid):
    """kernel[grid] on its first tensor's GPU, seen first by the LAUNCH_OBSERVERS.

    Triton launches on the *current* GPU (and its current stream), not on its tensors': a layer that
    device_map="auto" put on cuda:1, called while cuda:0 is current (the caller's thread), would run on GPU 0 with
    GPU 1's pointers, unordered with GPU 1's stream. The CUDA extension guards its device itself (csrc/binding.cpp)."""

    def run(*args, **kwargs):
        if LAUNCH_OBSERVERS:  # none outside the tests and the benches: no loop
            handled = False
            for observe in LAUNCH_OBSERVERS:
                handled = bool(observe(kernel, grid, args, kwargs)) or handled
            if handled:
                return None
        # Every launcher passes a tensor first: its device, without a generator over the arguments
        first = args[0] if args else None
        dev = first.device if isinstance(first, torch.Tensor) else next(
            (a.device for a in args if isinstance(a, torch.Tensor)), None)
        if dev is None or dev.type != "cuda" or dev.index is None or dev.index == torch.cuda.current_device():
            return kernel[grid](*args, **kwargs)
        with torch.cuda.device(dev.index):
            return kernel[grid](*args, **kwargs)

    return run


def alloc(shape, dtype, device) -> torch.Tensor:
    return _base.empty(shape, dtype, device)  # NaN-filled under the tests (base.POISON_OUTPUTS)


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def dot_dtype(*dtypes: torch.dtype):
    """(DOT_DT, IEEE): the dtype tl.dot operands are converted to, and whether it is fp32 (input_precision "ieee").
    Mixed or non-16-bit dtypes compute in fp32; so do bf16 tiles in the interpreter (its bf16 tl.dot: triton #11584)."""
    dt = dtypes[0]
    if dtypes.count(dt) != len(dtypes) or dt not in (torch.float16, torch.bfloat16):  # count: no generator
        return tl.float32, True
    if dt == torch.bfloat16 and interpreting():
        return tl.float32, True
    return _TL_DTYPES[dt], False


def split_dtype(act_dtype: torch.dtype, rank_dtype: torch.dtype):
    """(DOT_DT, IEEE, SPLIT) of a dot between 16-bit activations and a rank-path operand. bf16 activations with fp32
    adapters SPLIT the fp32 operand into three bf16 parts (dot3): every product is then exact, as in the fp32 FMA dot,
    but runs on tensor cores (the FMA dot took project_kernel and the backward pass 5-20x past their byte floors on an
    H200: issue 52). Under the interpreter the parts are multiplied as fp32 (its bf16 tl.dot: triton #11584)."""
    if act_dtype == torch.bfloat16 and rank_dtype == torch.float32:
        return (tl.float32, True, True) if interpreting() else (tl.bfloat16, False, True)
    return (*dot_dtype(act_dtype, rank_dtype), False)


def block_r(r: int, ieee: bool = False) -> int:
    """Rank chunk of the epilogues' rank-r dots: fp32 (ieee) dots take 16 (64 spilled up to 18 KB a thread, sm_90a)."""
    cap = _MAX_BLOCK_R_INTERP if interpreting() else _MAX_BLOCK_R_IEEE if ieee else _MAX_BLOCK_R_GPU
    return max(_DOT_MIN, min(cap, next_pow2(r)))


def m_bucket(m: int) -> int:
    """Autotune key for M: a power of two, so that every sequence length does not retune."""
    return min(max(next_pow2(m), 16), 8192)


@triton.jit
def grouped_tile(num_pid_m, num_pid_n, GROUP_M: tl.constexpr, TILE=None):
    """(pid_m, pid_n) of this program (or of tile number TILE, in a persistent kernel's tile loop) in grouped launch
    order: GROUP_M row-blocks sweep the same column-blocks together, so the W8 tiles they share are reused from L2
    instead of being re-read once per row-block."""
    if TILE is None:
        pid = tl.program_id(0)
    else:
        pid = TILE
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def dot(a, b, acc, IEEE: tl.constexpr):
    # fp32 operands: full-precision FMA path (tf32 would lose 13 mantissa bits); 16-bit operands: tensor cores.
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _top_bf16(x):
    """(x's bf16 truncation, as bf16 and as fp32): x's upper 16 bits, by bit operations, not a conversion."""
    bits = x.to(tl.uint32, bitcast=True)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True), (bits & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def split3(x):
    """x (fp32) = hi + mid + lo exactly, each bf16: each part is the residual's upper 16 bits (8 significant bits),
    so every residual is exact and lo, the last 8 bits at most, exact in bf16 as well. Bit masks and shifts run on the
    integer pipe; conversions (F2F, 16 a clock an SM on sm_90) set the issue floor of the kernels that split a tile
    every step (kernel report). Triton's interpreter converts fp32 to bf16 by truncation too: the same parts."""
    hi, hi32 = _top_bf16(x)
    rest = x - hi32
    mid, mid32 = _top_bf16(rest)
    lo, _ = _top_bf16(rest - mid32)
    return hi, mid, lo


@triton.jit
def dot3(a, b, acc, DOT_DT: tl.constexpr, IEEE: tl.constexpr, SPLIT_A: tl.constexpr, SPLIT: tl.constexpr):
    """acc + a @ b where one operand holds bf16 values (any float dtype) and the other (a if SPLIT_A, else b) is fp32,
    split by split3: three 16-bit dots of exact products accumulated in fp32 (split_dtype). Smallest parts first.
    Without SPLIT, one dot of both operands in DOT_DT."""
    if not SPLIT:
        acc = dot(a.to(DOT_DT), b.to(DOT_DT), acc, IEEE)
    elif SPLIT_A:
        hi, mid, lo = split3(a.to(tl.float32))
        o = b.to(DOT_DT)
        acc = dot(lo.to(DOT_DT), o, acc, IEEE)
        acc = dot(mid.to(DOT_DT), o, acc, IEEE)
        acc = dot(hi.to(DOT_DT), o, acc, IEEE)
    else:
        hi, mid, lo = split3(b.to(tl.float32))
        o = a.to(DOT_DT)
        acc = dot(o, lo.to(DOT_DT), acc, IEEE)
        acc = dot(o, mid.to(DOT_DT), acc, IEEE)
        acc = dot(o, hi.to(DOT_DT), acc, IEEE)
    return acc


NORM_EPS = tl.constexpr(_NORM_EPS)  # what a zero norm is divided as (backends.base), as a constexpr kernels read


@triton.jit
def norm_divisor(n):
    """backends.base.norm_divisor: n, with NORM_EPS where it is 0 (every other norm, however small, as it is)."""
    return tl.where(n == 0.0, NORM_EPS, n)


@triton.jit
def magnitude_scale(m_ptr, n_ptr, offs, mask):
    """c = m / norm_divisor(n) in fp32 for the columns `offs` (0 where masked): backends.base.magnitude_scale, rounded
    as torch rounds it (div_rn: plain '/' is approximate on GPUs), so that c == 1 exactly where m == n (DoRA's init)."""
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    n = tl.load(n_ptr + offs, mask=mask, other=1.0)
    return tl.math.div_rn(m, norm_divisor(n))


@triton.jit
def sum_parts(part_ptr, n_parts, stride_part, offs, mask):
    """sum_p part[p * stride_part + offs] in fp32, p in order: the fixed-order second stage of the reductions that
    programs write as partials (no atomics: the same result run to run)."""
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)  # n_parts >= 1
    for p in range(1, n_parts):
        acc += tl.load(part_ptr + p * stride_part + offs, mask=mask, other=0.0)
    return acc


# Autotune configs: rows are (BLOCK_M, B_OUT, B_RED, stages, warps), B_OUT the output-column block (forward BLOCK_N,
# dgrad BLOCK_K) and B_RED the reduction block. Each arch's list fits its shared memory (test_inspect.py checks).

_ARCHS: dict = {}  # (device index, the capability function asked) -> arch: a device's capability never changes


def arch_of(device: torch.device) -> str:
    """The config tables' key of `device` (arch_of_capability's), or "interp" under the interpreter and off CUDA. Read
    once per device index: torch.cuda.get_device_capability took microseconds, ten times a DoRA step. Keyed by that
    function too, which the tests replace to play other GPUs; an index-less device (the current one) is asked anew."""
    if interpreting() or device.type != "cuda":
        return "interp"
    capability = torch.cuda.get_device_capability
    if device.index is None:
        return arch_of_capability(*capability(device))
    key = (device.index, capability)
    arch = _ARCHS.get(key)
    if arch is None:
        arch = _ARCHS[key] = arch_of_capability(*capability(device))
    return arch


def arch_of_capability(major: int, minor: int) -> str:
    """The config tables' key for a compute capability: Ampere takes Ada's list, 10.x datacenter Blackwell's, and
    12.x and anything unknown consumer Blackwell's 99 KB list, which fits every GPU the Triton backend runs on."""
    if major == 9:
        return "sm90"
    if major == 10:
        return "sm100"
    if major == 8:
        return "sm89"
    return "sm120"  # 12.x; unknown: the smallest shared memory of the GPUs the Triton backend runs on (8.6's 99 KB)


def triton_version() -> tuple[int, int]:
    """(major, minor) of the installed Triton: the kernels' code generation choices that depend on it read this."""
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


def w8_via_f32(device) -> bool:
    return w8_via_f32_for(arch_of(device))


def w8_via_f32_for(arch: str) -> bool:
    """W8_VIA_F32 (gemm.w8_to) on `arch` under the installed Triton: e4m3 -> bf16 through fp32 where Triton's own goes
    through fp16 and the slow F2F.BF16.F16: Ada and Hopper, and Blackwell before Triton 3.9 (docs/INSPECT.md)."""
    if arch == "interp":  # exact either way (the interpreter computes bf16 tiles in fp32 anyway)
        return False
    return arch in ("sm90", "sm89") or triton_version() < (3, 9)


def fp32_dots_exact_for(arch: str) -> bool:
    """Whether the installed Triton keeps the GEMMs' fp32 main-loop dots exact on `arch`: 3.6 and 3.7 lower them to tf32
    tcgen05.mma on sm_100a, where the backend then refuses fp32 compute (unsupported_on in __init__.py)."""
    return not (arch == "sm100" and triton_version() < (3, 8))


def fp8_promote(device) -> bool:
    return fp8_promote_for(arch_of(device))


def fp8_promote_for(arch: str) -> bool:
    """FP8_PROMOTE (gemm.w8_gemm_loop, W8A8) on `arch`: on Hopper wgmma keeps e4m3 products in a ~14-bit accumulator, so
    each step's product is added to the fp32 accumulator in software (docs/DORA_MATH.md, "Accuracy contract")."""
    return arch == "sm90"  # arch_of_capability: 9.x only (interp: the interpreter's dots are exact fp32)


_GEMM_TABLE = {
    # arch: (large-M single accumulator, large-M two accumulators (dropout), small M <= 64, small M two accumulators),
    # pruned by what the kernel report showed (docs/ARCHITECTURE.md, "triton_kernels/_common.py").
    "sm90": (
        [(128, 128, 64, 4, 8), (128, 128, 64, 3, 8), (64, 128, 64, 4, 8), (128, 64, 64, 4, 4)],
        [(128, 128, 64, 3, 8), (64, 128, 64, 4, 8), (128, 64, 64, 4, 4), (64, 64, 64, 4, 4)],
        [(16, 64, 64, 6, 4), (32, 64, 64, 6, 4), (32, 128, 64, 4, 8), (64, 128, 64, 4, 8)],
        [(16, 64, 64, 5, 4), (32, 64, 64, 4, 4), (64, 64, 64, 4, 4)],
    ),
    "sm89": (
        [(128, 128, 64, 3, 8), (64, 128, 64, 4, 8), (128, 64, 64, 4, 8), (64, 64, 64, 4, 4)],
        [(64, 128, 64, 3, 8), (128, 64, 64, 3, 8), (64, 64, 64, 4, 4)],
        [(16, 64, 128, 4, 4), (16, 128, 128, 3, 4), (32, 64, 128, 4, 4), (64, 64, 64, 4, 4)],
        [(16, 64, 128, 4, 4), (16, 64, 64, 4, 4), (32, 64, 64, 4, 4)],
    ),
    "sm100": (
        [(128, 128, 64, 3, 8), (64, 128, 64, 4, 8), (128, 64, 64, 4, 4)],
        [(128, 128, 64, 3, 8), (64, 128, 64, 4, 8), (128, 64, 64, 4, 4), (64, 64, 64, 4, 4)],
        [(16, 64, 64, 6, 4), (32, 64, 64, 6, 4), (32, 128, 64, 4, 8), (64, 128, 64, 4, 8)],
        [(16, 64, 64, 5, 4), (32, 64, 64, 4, 4), (64, 64, 64, 4, 4)],
    ),
    "sm120": (
        [(128, 128, 64, 3, 8), (64, 128, 64, 4, 8), (128, 64, 64, 4, 8), (64, 64, 64, 4, 4)],
        [(64, 128, 64, 3, 8), (64, 128, 64, 4, 8), (64, 64, 64, 4, 4)],
        [(16, 64, 128, 4, 4), (16, 128, 128, 3, 4), (32, 64, 128, 4, 4), (64, 64, 64, 4, 4)],
        [(16, 64, 128, 4, 4), (16, 64, 64, 4, 4), (32, 64, 64, 4, 4)],
    ),
}
# Triton 3.8's two-accumulator (dropout) large-M lists on the mma.sync targets, where its staging of the W8 tile
# through shared memory spilled the usual ones.
_TWO_ACC_LARGE_BY_TRITON = {
    (3, 8): {
        "sm89": [(128, 64, 64, 3, 8), (64, 64, 64, 3, 8), (32, 64, 64, 4, 4)],
        "sm120": [(64, 128, 64, 3, 8), (64, 128, 64, 4, 8)],
    },
}
# fp32 compute (CUDA-core FMA) stages 4-byte activation tiles: its own small list on every GPU.
_FP32_GEMM = (
    [(64, 64, 32, 2, 4), (64, 128, 32, 2, 8), (32, 64, 64, 2, 4)],
    [(16, 64, 64, 2, 4), (32, 64, 32, 2, 4), (16, 128, 32, 2, 4)],
)
# Two fp32 accumulators (dropout) spilled 2 KB and more on every tile above (inspect): smaller ones.
_FP32_GEMM_TWO_ACC = (
    [(32, 32, 32, 2, 4), (16, 64, 32, 2, 4), (16, 32, 64, 2, 4)],
    [(16, 32, 32, 2, 4), (16, 64, 32, 2, 4), (16, 32, 64, 2, 4)],
)
# One small config under the interpreter (it would run every config otherwise); small enough that the tests'
# shapes (N = 70, K = 50, M = 37) cross several blocks in every dimension.
_INTERP_GEMM = (16, 32, 32, 1, 4)


# Two-accumulator main loops with FP8_PROMOTE (W8A8 on sm_90) add a partial tile per accumulator: tiles of 64
# accumulator elements per thread spilled there, so they keep those of at most 32.
_LEAN_TWO_ACC_MAX_ELEMS = 32


# W8A8 on sm_90: a reduction block of 128 halves FP8_PROMOTE's per-element cost (large M, one accumulator only).
_FP8_DOT_LARGE = {"sm90": [(128, 128, 128, 3, 8), (128, 128, 128, 4, 8), (64, 128, 128, 4, 8)]}


def gemm_configs(device, out_name: str, red_name: str, two_acc: bool, m: int, fp32: bool, lean: bool = False,
                 fp8_dot: bool = False):
    """triton.Configs for a GEMM kernel whose output-column block is `out_name` and reduction block `red_name`."""
    return gemm_configs_for(arch_of(device), out_name, red_name, two_acc, m, fp32, lean, fp8_dot)


def gemm_configs_for(arch: str, out_name: str, red_name: str, two_acc: bool, m: int, fp32: bool,
                     lean: bool = False, fp8_dot: bool = False):
    """gemm_configs for an arch named as arch_of names it, without a device (the kernel report's way in). lean:
    FP8_PROMOTE's main loop (two accumulators keep smaller tiles); fp8_dot: W8A8 (adds _FP8_DOT_LARGE's tiles)."""
    if arch == "interp":
        rows = [_INTERP_GEMM]
    elif fp32:
        table = _FP32_GEMM_TWO_ACC if two_acc else _FP32_GEMM
        rows = table[1] if m <= 64 else table[0]
    else:
        big, big2, small, small2 = _GEMM_TABLE[arch]
        big2 = _TWO_ACC_LARGE_BY_TRITON.get(triton_version(), {}).get(arch, big2)
        rows = (small2 if two_acc else small) if m <= 64 else (big2 if two_acc else big)
        if lean and two_acc:
            rows = [row for row in rows if row[0] * row[1] // (32 * row[4]) <= _LEAN_TWO_ACC_MAX_ELEMS]
        if fp8_dot and not two_acc and m > 64:
            rows = rows + _FP8_DOT_LARGE.get(arch, [])
    group_m = 2 if arch == "interp" else 8
    return [
        triton.Config({"BLOCK_M": bm, out_name: bo, red_name: br, "GROUP_M": group_m}, num_stages=st, num_warps=w)
        for bm, bo, br, st, w in rows
    ]


_WEIGHT_NORM_TABLE = {  # arch: [(BLOCK_N, BLOCK_K, stages, warps)]
    "interp": [(32, 32, 1, 4)],
    "sm90": [(64, 128, 3, 4), (128, 64, 3, 8), (32, 128, 3, 4), (64, 256, 3, 8), (128, 128, 3, 8)],
    "sm89": [(64, 128, 3, 8), (128, 64, 3, 8), (64, 64, 4, 4), (32, 128, 3, 4)],
    "sm100": [(64, 128, 3, 4), (128, 64, 3, 8), (32, 128, 3, 4), (64, 256, 3, 8), (128, 128, 3, 8)],
    "sm120": [(64, 128, 3, 8), (128, 64, 3, 8), (64, 64, 4, 4), (32, 128, 3, 4)],
}
# fp32 adapters: B A on CUDA cores spilled at BLOCK_K >= 128 with 4 warps: smaller tiles, more warps.
_WEIGHT_NORM_FP32 = [(32, 64, 3, 4), (64, 64, 3, 8), (32, 128, 2, 8)]


def weight_norm_configs(device, fp32: bool = False):
    return weight_norm_configs_for(arch_of(device), fp32)


def weight_norm_configs_for(arch: str, fp32: bool = False):
    """weight_norm_configs for an arch named as arch_of names it, without a device (see gemm_configs_for)."""
    rows = _WEIGHT_NORM_FP32 if fp32 and arch != "interp" else _WEIGHT_NORM_TABLE[arch]
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_stages=st, num_warps=w) for bn, bk, st, w in rows]


_TUNERS: dict = {}


def autotuned(kernel, tag, configs, key, outputs, device=None, pin=None):
    """One triton.autotune wrapper per (kernel, variant, config list), each with its own cache. Under the tests' NaN
    fill the outputs are restored after each benchmarked config, so a config that skips a tile cannot hide behind one
    that wrote it. `configs` may be a function, called once per (tag, device arch); pin: _pins.pinned's name."""
    poison = _base.POISON_OUTPUTS
    # the pin's names in the key: pin_configs after a first launch (or {} after a pin) gives the launcher a new tuner
    if callable(configs):
        k = (id(kernel), tag, arch_of(device), poison, pin_of(pin))
    else:
        k = (id(kernel), tag, tuple(str(c) for c in configs), poison, pin_of(pin))
    tuner = _TUNERS.get(k)
    if tuner is None:
        configs = pinned(pin, configs() if callable(configs) else configs)
        if len(configs) == 1 and configs[0].pre_hook is None:
            tuner = OneConfig(kernel, configs[0])
        else:
            tuner = triton.autotune(configs=configs, key=key, restore_value=list(outputs) if poison else None)(kernel)
        _TUNERS[k] = tuner
    return tuner


class OneConfig:
    """What triton.autotune does with a single config (the interpreter's, a pinned one), without its wrapper: its run
    built a dict of the arguments and merged the config's kwargs each launch. Nothing is benchmarked with one config,
    so its pre_hook / restore_value (the tests' NaN fill) never ran there either: kernel[grid](*args, **config)."""

    def __init__(self, fn, config):
        self.fn, self.configs, self.best_config = fn, [config], config  # as an Autotuner names them
        self._kwargs = config.all_kwargs()

    def __getitem__(self, grid):
        fn, kw = self.fn, self._kwargs
        return lambda *args, **kwargs: fn.run(*args, grid=grid, warmup=False, **kwargs, **kw)


def check_weight(w8: torch.Tensor, scale: torch.Tensor, block_size: int = 128,
                 any_block: bool = False, act_quant: str = "") -> tuple[torch.Tensor, str]:
    """Validates W8 [N, K] fp8 e4m3 (unit stride in K) and its fp32 scale ([], [N] or [ceil(N/b), ceil(K/b)], b =
    block_size); returns (the scale, contiguous, and its kind, the kernels' SCALE_KIND: "tensor", "row" or "block"). A
    GEMM step must fit in a scale block: b a multiple of 16 (unless any_block), of FP8_DOT_MIN_K under W8A8 on a GPU."""
    if w8.dtype != torch.float8_e4m3fn or w8.dim() != 2:
        raise ValueError(f"w8 must be a 2-D float8_e4m3fn tensor, got {w8.dtype} {tuple(w8.shape)}")
    if w8.stride(1) != 1:
        raise ValueError("w8 must have unit stride in its last dim")
    N, K = w8.shape
    if scale.dtype != torch.float32:
        raise ValueError(f"scale must be fp32, got {scale.dtype}")
    if scale.device != w8.device:
        raise ValueError("scale and w8 must be on the same device")
    if scale.dim() == 0 or (scale.dim() == 1 and scale.numel() == 1):
        return scale.reshape(1).contiguous(), "tensor"
    if scale.dim() == 1 and scale.numel() == N:
        return scale.contiguous(), "row"
    if scale.dim() == 2 and tuple(scale.shape) == (cdiv(N, block_size), cdiv(K, block_size)):
        if block_size % _DOT_MIN and not any_block:
            raise ValueError(f"the triton backend needs block scales whose block size is a multiple of {_DOT_MIN}, "
                             f"got {block_size} (use the reference backend)")
        if act_quant and block_size % FP8_DOT_MIN_K and arch_of(w8.device) != "interp":
            raise ValueError(f"the triton backend's W8A8 (act_quant={act_quant!r}) needs block scales whose "
                             f"block_size is a multiple of {FP8_DOT_MIN_K} on {arch_of(w8.device)}: the fp8 "
                             f"tensor-core dot reduces {FP8_DOT_MIN_K} at a time, got block_size {block_size} (use "
                             f"act_quant=None, or backend='cublas' or 'reference')")
        return scale.contiguous(), "block"
    raise ValueError(f"scale must be fp32 [], [{N}] or [{cdiv(N, block_size)}, "
                     f"{cdiv(K, block_size)}] (block_size {block_size}), got {tuple(scale.shape)}")


# fp32 registers a thread may give the accumulators and their partial-product twins (fit_reduction_block): plain
# warps spilled past about 96; a "tma-ws" consumer warpgroup runs at 232 (setmaxnreg, hopper.py).
_ACC_REGS = {"": 96, "tma-ws": 128}


def fit_reduction_block(configs, red_name: str, block_size: int, scale_kind: str, out_name: str = "",
                        n_acc: int = 1, main_loop: str = ""):
    """With block scales a reduction step stays inside one scale block: the reduction block shrinks until it divides
    `block_size`, then BLOCK_M until the accumulators and their partial-product twins fit _ACC_REGS a thread."""
    if scale_kind != "block":
        return configs
    ws = main_loop == "tma-ws"
    out, seen = [], set()
    for cfg in configs:
        kw = dict(cfg.kwargs)
        while block_size % kw[red_name]:
            kw[red_name] //= 2
        budget = _ACC_REGS["tma-ws" if ws else ""] * 32 * cfg.num_warps * (2 if ws else 1)
        while out_name and 2 * n_acc * kw["BLOCK_M"] * kw[out_name] > budget and kw["BLOCK_M"] > 16:
            kw["BLOCK_M"] //= 2
        key = tuple(sorted(kw.items())) + (cfg.num_stages, cfg.num_warps)
        if key not in seen:
            seen.add(key)
            out.append(triton.Config(kw, num_stages=cfg.num_stages, num_warps=cfg.num_warps))
    return out


def scale_block_size(scale_kind: str, block_size: int) -> int:
    """The kernels' SCALE_BLOCK_SIZE constexpr (b of b x b block scales): block_size for block scales, else 1, so that
    per-tensor and per-row launches do not compile, autotune and cache once per block size they never read."""
    return block_size if scale_kind == "block" else 1


def check_activation(t: torch.Tensor, name: str, width: int) -> torch.Tensor:
    """Validates a 2-D activation [M, width] in a compute dtype; returns it with unit stride in its last dim."""
    if t.dim() != 2 or t.shape[1] != width:
        raise ValueError(f"{name} must be [M, {width}], got {tuple(t.shape)}")
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"compute dtype must be fp32, fp16 or bf16, got {t.dtype}")
    return last_dim_unit(t)


def vector(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A per-column vector ([N], or any shape with N elements) as the kernels read it: flat and contiguous, in `dtype`
    if given (else its own: the kernels convert what they load). A view, no copy, in the usual case; t itself if 1-D."""
    t = t if t.dim() == 1 else t.reshape(-1)  # a reshape is an op even where it changes nothing
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    return t if t.is_contiguous() else t.contiguous()


def last_dim_unit(t: torch.Tensor | None) -> torch.Tensor | None:
    """Rows may have any stride, but the kernels read the last dim contiguously; copy only if it is not."""
    if t is None or t.stride(-1) == 1:
        return t
    return t.contiguous()
