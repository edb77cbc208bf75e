"""The Hopper main loop of the fp8 GEMMs (forward and dgrad): when it is used, its tiles, its grid, and what it needs at
launch. MAIN_LOOP: "async-copy" (cp.async, every GPU, the default) or "tma-ws" (TMA, persistent, warp-specialized;
sm_90a), only where DORAFP8_HOPPER_GEMM=1 opts in: it failed the fp64 checks on the first GPU run (H200, Triton 3.6:
NaN in y, dx, dm), and is kept for measuring. Why: docs/ARCHITECTURE.md; docs/INSPECT.md."""

from __future__ import annotations

import contextvars
import os

import torch
import triton
import triton.language as tl

from .._env import flag
from ._common import cdiv, dot_dtype, interpreting, launch
from .occupancy import sm_props
from .epilogue_dot import bf16_value

ENV = "DORAFP8_HOPPER_GEMM"
MAIN_LOOPS = ("async-copy", "tma-ws")


def main_loop_for(arch: str) -> str:
    """The MAIN_LOOP of the fp8 GEMMs on `arch` (a config tables' key, _common.arch_of), before the tensors' say:
    "tma-ws" on sm_90 (and under the interpreter) only with DORAFP8_HOPPER_GEMM=1. Not the default: on the first GPU
    run (H200, Triton 3.6; bench/results/nvidia-h200/correctness.md) it gave NaN in y, dx and dm, W8A16 and W8A8,
    where the cp.async loop passed every fp64 check."""
    if flag(ENV, False) and arch in ("sm90", "interp"):
        return "tma-ws"
    return "async-copy"


def tma_ready(*tensors: torch.Tensor) -> bool:
    """Whether TMA can address each 2-D tensor: unit last stride, base and row stride 16-byte aligned."""
    for t in tensors:
        if t.dim() != 2 or t.stride(1) != 1 or t.data_ptr() % 16 or (t.stride(0) * t.element_size()) % 16:
            return False
    return True


# Tiles of the "tma-ws" loop as in _common's tables, warps per consumer warpgroup; 128 x 128 at most (256-wide tiles
# spilled, docs/ARCHITECTURE.md).
_WS_TABLE = {
    # (large M, small M)
    "sm90": (
        [(128, 128, 64, 4, 4), (128, 128, 64, 5, 4), (64, 128, 64, 6, 4)],
        [(16, 128, 64, 6, 4), (32, 128, 64, 6, 4), (64, 128, 64, 5, 4)],
    ),
}
# W8A8 (e4m3 operands, promoted every step): 128-deep steps, the promotion interval FBGEMM and DeepGEMM use, first.
_WS_FP8_LARGE = {"sm90": [(128, 128, 128, 4, 4), (128, 128, 128, 3, 4)]}
_INTERP_WS = (16, 32, 32, 1, 4)  # as _common's _INTERP_GEMM: the tests' shapes cross several tiles


def ws_configs_for(arch: str, out_name: str, red_name: str, m: int, fp8_dot: bool = False):
    """triton.Configs of the "tma-ws" loop (gemm_configs_for's counterpart; one accumulator: ws_plan)."""
    if arch == "interp":
        rows = [_INTERP_WS]
    else:
        big, small = _WS_TABLE[arch]
        rows = small if m <= 64 else big
        if fp8_dot and m > 64:
            rows = _WS_FP8_LARGE.get(arch, []) + rows
    group_m = 2 if arch == "interp" else 8
    return [triton.Config({"BLOCK_M": bm, out_name: bo, red_name: br, "GROUP_M": group_m}, num_stages=st,
                          num_warps=w) for bm, bo, br, st, w in rows]


def persistent_programs(device: torch.device, tiles: int) -> int:
    """The tile loop's grid: a program per SM (a ws CTA fills one), at most the tiles; 3 interpreted, so they loop."""
    if interpreting():
        return max(1, min(tiles, 3))
    return max(1, min(tiles, sm_props(device)[0]))


def _scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def with_descriptor_scratch(fn, *args, **kwargs):
    """fn(*args, **kwargs) with an allocator for in-kernel descriptors' scratch (128 B a program), for this call."""
    def run():
        triton.set_allocator(_scratch)
        return fn(*args, **kwargs)
    return contextvars.copy_context().run(run)


@triton.jit
def transpose_w8_kernel(w_ptr, wt_ptr, N, K, stride_w_n, stride_wt_k, BLOCK: tl.constexpr):
    """wt [K, N] = w [N, K]^T, one BLOCK x BLOCK tile a program (bytes: Triton transposes the tile in registers)."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK + tl.arange(0, BLOCK)
    offs_k = pid_k * BLOCK + tl.arange(0, BLOCK)
    ok = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    tile = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_w_n + offs_k[None, :], mask=ok)
    tl.store(wt_ptr + offs_k[None, :].to(tl.int64) * stride_wt_k + offs_n[:, None], tile, mask=ok)


TRANSPOSE_BLOCK = 64


def transpose_w8(w8: torch.Tensor) -> torch.Tensor:
    """W8^T [K, N], contiguous: the dgrad's weight operand under TMA and under W8A8 (made for the call, N K bytes)."""
    N, K = w8.shape
    wt = torch.empty((K, N), dtype=w8.dtype, device=w8.device)
    if N and K:
        b = 16 if interpreting() else TRANSPOSE_BLOCK
        launch(transpose_w8_kernel, (cdiv(N, b), cdiv(K, b)))(w8, wt, N, K, w8.stride(0), wt.stride(0), BLOCK=b)
    return wt


def gemm_main_loop(device: torch.device, fp32_tiles: bool, *tensors: torch.Tensor) -> str:
    """A GEMM launch's MAIN_LOOP: main_loop_for its arch on 16-bit/fp8 operands TMA can address, else "async-copy"."""
    from ._common import arch_of

    loop = main_loop_for(arch_of(device))
    if loop != "async-copy" and (fp32_tiles or not tma_ready(*tensors)):
        return "async-copy"
    return loop


def gemm_grid(main_loop: str, rows: int, cols: int, col_block: str, device: torch.device):
    """The launch grid of a GEMM over [rows, cols] outputs: a program per tile, or the persistent tile loop's."""
    if main_loop == "async-copy":
        return lambda meta: (cdiv(rows, meta["BLOCK_M"]) * cdiv(cols, meta[col_block]),)
    return lambda meta: (persistent_programs(device, cdiv(rows, meta["BLOCK_M"]) * cdiv(cols, meta[col_block])),)


def launch_gemm(kernel, grid, main_loop: str, device: torch.device, *args, **kwargs):
    """kernel[grid](*args, **kwargs) through _common.launch, with the descriptors' scratch where a GPU needs it."""
    run = launch(kernel, grid)
    if main_loop != "async-copy" and device.type == "cuda":
        return with_descriptor_scratch(run, *args, **kwargs)
    return run(*args, **kwargs)


def ws_plan(loop: str, dropout: bool, rank: dict | None) -> tuple[str, str]:
    """(main loop, rank mode) of a GEMM launch whose tensors allow `loop`: "tma-ws" falls back to "async-copy" where the
    partitioner cannot take it. rank: rank_dot's constexprs (None without). Rank mode: "" (none, or pointer loads),
    "direct" (descriptors on 16-bit rank operands) or "pieces" (rank_pieces' bf16 operands)."""
    if loop == "tma-ws" and (dropout or (rank and rank["LORA_IEEE"] and not rank["LORA_SPLIT"])):
        return "async-copy", ""
    if loop == "async-copy" or rank is None:
        return loop, ""
    return loop, "pieces" if rank["LORA_SPLIT"] else "direct"


def ws_rank_dot(rank_mode: str, r: int, rank: dict) -> tuple[int, dict]:
    """(R, constexprs) of the epilogue's rank-r dot in `rank_mode` (ws_plan): "pieces" is one bf16 dot over 3 r; both
    TMA modes take 16 of r at a time (64 took 128 KB of the 128 x 128 x 64 tile's shared memory, Triton 3.8)."""
    if rank_mode == "pieces":
        lora_dt, ieee = dot_dtype(torch.bfloat16)
        return 3 * r, dict(LORA_DT=lora_dt, LORA_IEEE=ieee, LORA_SPLIT=False, BLOCK_R=16)
    if rank_mode == "direct":
        return r, dict(rank, BLOCK_R=16)
    return r, rank


@triton.jit
def _pieces(src_ptr, dst_ptr, row0, ROWS, COLS, stride_row, stride_col, stride_dst, piece_off,
            LOW_FIRST: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr):
    """Rows row0 .. row0 + BLOCK of src [ROWS, COLS] split into bf16 pieces written piece_off elements apart in dst
    (unit column stride): (lo, hi, hi) with LOW_FIRST, else (hi, lo, hi)."""
    rows = row0 + tl.arange(0, BLOCK)
    ok_rows = rows < ROWS
    offs_c = tl.arange(0, BLOCK_C)
    for c0 in range(0, COLS, BLOCK_C):
        ok = ok_rows[:, None] & (c0 + offs_c[None, :] < COLS)
        v = tl.load(src_ptr + rows[:, None].to(tl.int64) * stride_row + (c0 + offs_c[None, :]) * stride_col, mask=ok,
                    other=0.0).to(tl.float32)
        hi = bf16_value(v)
        lo = bf16_value(v - hi)
        first = lo if LOW_FIRST else hi
        second = hi if LOW_FIRST else lo
        dst = dst_ptr + rows[:, None].to(tl.int64) * stride_dst + c0 + offs_c[None, :]
        tl.store(dst, first.to(tl.bfloat16), mask=ok)
        tl.store(dst + piece_off, second.to(tl.bfloat16), mask=ok)
        tl.store(dst + 2 * piece_off, hi.to(tl.bfloat16), mask=ok)


@triton.jit
def rank_pieces_kernel(t_ptr, v_ptr, t3_ptr, v3_ptr, T_ROWS, T_COLS, V_ROWS, R, stride_t_row, stride_t_col,
                       stride_v_row, stride_v_r, stride_t3, stride_v3, t_piece_off,
                       BLOCK: tl.constexpr, BLOCK_C: tl.constexpr):
    """t3 = [Th | Tl | Th] and v3 = [Vl | Vh | Vh] in bf16 (hi = bf16(x), lo = bf16(x - hi), as split_dot splits;
    v's pieces side by side along its rank dim, t's t_piece_off elements apart: along its columns, or its rows when
    t is A [r, K]), from t [T_ROWS, T_COLS] and v [V_ROWS, R]: the first programs take t's rows, the rest v's."""
    pid = tl.program_id(0)
    t_programs = tl.cdiv(T_ROWS, BLOCK)
    if pid < t_programs:
        _pieces(t_ptr, t3_ptr, pid * BLOCK, T_ROWS, T_COLS, stride_t_row, stride_t_col, stride_t3, t_piece_off, False,
                BLOCK, BLOCK_C)
    else:
        _pieces(v_ptr, v3_ptr, (pid - t_programs) * BLOCK, V_ROWS, R, stride_v_row, stride_v_r, stride_v3, R, True,
                BLOCK, BLOCK_C)


PIECES_BLOCKS = (32, 64)  # (BLOCK rows, BLOCK_C) on a GPU


def _padded(n: int) -> int:
    return -(-n // 8) * 8  # 16 bytes of bf16: a row stride TMA can take


def rank_pieces(v: torch.Tensor, t: torch.Tensor, t_rank_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(v3, t3) bf16 for the "pieces" rank mode (ws_plan): v [V, r] (u, or v) -> [V, 3 r]; B [N, r] -> [N, 3 r], or with
    t_rank_rows A [r, K] -> [3 r, K]. Rows padded to a multiple of 8 elements (TMA), the padding never read."""
    r = v.shape[1]
    if t_rank_rows:
        t3 = torch.empty((3 * r, _padded(t.shape[1])), dtype=torch.bfloat16, device=t.device)
        t3 = t3[:, :t.shape[1]]
        piece_off = r * t3.stride(0)
    else:
        t3 = torch.empty((t.shape[0], _padded(3 * r)), dtype=torch.bfloat16, device=t.device)[:, :3 * r]
        piece_off = r
    v3 = torch.empty((v.shape[0], _padded(3 * r)), dtype=torch.bfloat16, device=v.device)[:, :3 * r]
    bm, bc = (16, 16) if interpreting() else PIECES_BLOCKS
    grid = (cdiv(t.shape[0], bm) + cdiv(v.shape[0], bm),)
    launch(rank_pieces_kernel, grid)(t, v, t3, v3, t.shape[0], t.shape[1], v.shape[0], r, t.stride(0), t.stride(1),
                                     v.stride(0), v.stride(1), t3.stride(0), v3.stride(0), piece_off, BLOCK=bm,
                                     BLOCK_C=bc)
    return v3, t3
