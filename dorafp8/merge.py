"""Merging adapters into an fp8 base, one block of rows at a time, and re-quantizing the result. DoRA's merge
W'_j = m_j / ||V_j|| * V_j (V = W0 + s B A) is row-local, so a merged weight is computed in fp32 row blocks, never
whole; `requantize` measures ||Wq - W'||_F / ||W'||_F, the "merge error" export_merged and merge_and_unload report."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

from .ops import norm_divisor
from .quant import (DEFAULT_BLOCK, E4M3, E4M3_MAX, check_block_size, check_scale_kind, micro_rows, nvfp4_global_scale,
                    quantize_e4m3, quantize_mxfp8, quantize_nvfp4, row_blocks, row_step, scale_rows, to_e4m3,
                    w0_rows, weight_dims)

RowFn = Callable[[int, int], torch.Tensor]


def adapted_row_blocks(w8: torch.Tensor, scale: torch.Tensor, block_size: int, A: torch.Tensor, B: torch.Tensor,
                       s: float, global_scale=None):
    """(j0, j1, V[j0:j1]) with V = W0 + s B A in fp32, one row block (<= 16 MiB) at a time (global_scale: NVFP4's)."""
    N, K = weight_dims(w8)
    for j0, j1 in row_blocks(N, K, row_step(scale, block_size)):
        yield j0, j1, w0_rows(w8, scale, block_size, j0, j1, global_scale).addmm_(B[j0:j1], A, alpha=s)


def column_norms(w8: torch.Tensor, scale: torch.Tensor, block_size: int, A: torch.Tensor, B: torch.Tensor,
                 s: float, group: int = 1, global_scale=None) -> torch.Tensor:
    """||V[:, k]|| (fp32 [K / group], no grad) for V = W0 + s B A: what input-axis DoRA divides by."""
    with torch.no_grad(), torch.autocast(w8.device.type, enabled=False):
        sq = torch.zeros(weight_dims(w8)[1], dtype=torch.float32, device=w8.device)
        for _, _, V in adapted_row_blocks(w8, scale, block_size, A.detach().float(), B.detach().float(), s,
                                          global_scale):
            sq += V.square_().sum(0)
        return sq.view(-1, group).sum(1).sqrt_()


@dataclass
class RequantStats:
    """Accumulated over the row blocks of one layer: sum (Wq - W')^2, sum W'^2, non-finite values seen."""
    err2: float = 0.0
    ref2: float = 0.0
    nonfinite: int = 0

    @property
    def rel_error(self) -> float:
        if self.ref2 > 0:
            return (self.err2 / self.ref2) ** 0.5
        return 0.0 if self.err2 == 0 else float("inf")


def adapter_terms(layer, adapter_names: Iterable[str]) -> list[tuple]:
    """(A fp32 [r, K], B [N, r], s, magnitude [N] or None for plain LoRA, name) for each adapter of a PEFT LoRA layer,
    in merge order; a conv's as their [out, in * kernel] views (with groups=1 its B A is B2 @ A2 there)."""
    terms = []
    for a in adapter_names:
        if a not in layer.lora_A:
            continue
        mag = layer.lora_magnitude_vector[a].weight if a in getattr(layer, "lora_magnitude_vector", {}) else None
        A, B = layer.lora_A[a].weight.detach(), layer.lora_B[a].weight.detach()
        terms.append((A.reshape(A.shape[0], -1).float(), B.reshape(B.shape[0], -1), float(layer.scaling[a]),
                      None if mag is None else mag.detach().reshape(-1), a))
    return terms


def merged_rows(w8: torch.Tensor, scale: torch.Tensor, block_size: int, terms, j0: int, j1: int,
                global_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rows j0:j1 of the weight with the adapters `terms` merged in sequence, fp32 (global_scale: NVFP4's)."""
    w = w0_rows(w8, scale, block_size, j0, j1, global_scale)
    for A, B, s, mag, _ in terms:
        w.addmm_(B[j0:j1].float(), A, alpha=s)  # V = W + s B A
        if mag is not None:  # DoRA: W' = m / ||V|| * V, a zero norm divided as the forward does
            n = norm_divisor(torch.linalg.vector_norm(w, dim=1))
            w.mul_((mag[j0:j1].float() / n)[:, None])
    return w


def requantize(rows_fn: RowFn, n_rows: int, n_cols: int, granularity: str, *, block_size: int = DEFAULT_BLOCK,
               device=None, dense_dtype: Optional[torch.dtype] = None):
    """Quantizes the weight that rows_fn(j0, j1) -> fp32 [j1 - j0, n_cols] produces, one block of rows at a time.

    granularity "tensor" / "row" / "block" (b x b, b = block_size) gives (w8 [N, K] e4m3, scale fp32, stats);
    "tensor" takes two passes over the rows (the amax first), so rows_fn is called twice per block.
    With dense_dtype (e.g. torch.bfloat16) the rows are rounded to that dtype instead: (dense [N, K], None, stats).
    stats.rel_error is ||written - rows||_F / ||rows||_F, accumulated in fp64.
    """
    if dense_dtype is None:
        check_scale_kind(granularity)
    mult = check_block_size(block_size) if (granularity == "block" and dense_dtype is None) else 1
    stats = RequantStats()
    tensor_scale = None
    if dense_dtype is None and granularity == "tensor":
        tensor_scale = weight_amax(rows_fn, n_rows, n_cols, device) / E4M3_MAX
        tensor_scale = torch.where(tensor_scale > 0, tensor_scale, torch.ones_like(tensor_scale))
    out = None
    scales = []
    for j0, j1 in row_blocks(n_rows, n_cols, mult):
        r = _finite_rows(rows_fn, j0, j1, stats)
        if out is None:
            out = torch.empty(n_rows, n_cols, dtype=dense_dtype or E4M3, device=r.device)
        if dense_dtype is not None:
            q = r.to(dense_dtype)
            back = q.float()
        elif granularity == "tensor":
            q = to_e4m3(r, tensor_scale)
            back = q.float().mul_(tensor_scale)
        else:
            q, s = quantize_e4m3(r, per_row=(granularity == "row"),
                                 block_size=block_size if granularity == "block" else None)
            scales.append(s)
            back = q.float().mul_(scale_rows(s, block_size, 0, j1 - j0, n_cols))
        out[j0:j1] = q
        del q
        _add_error(stats, r, back)
        del r, back
    if dense_dtype is not None:
        return out, None, stats
    scale = tensor_scale if granularity == "tensor" else torch.cat(scales, dim=0)
    return out, scale, stats


def weight_amax(rows_fn: RowFn, n_rows: int, n_cols: int, device) -> torch.Tensor:
    """max |rows| over the finite values, fp32 [] (non-finite ones are left out here, counted by the pass after)."""
    amax = torch.zeros((), dtype=torch.float32, device=device)
    for j0, j1 in row_blocks(n_rows, n_cols):
        r = rows_fn(j0, j1)
        amax = torch.maximum(amax.to(r.device), torch.where(torch.isfinite(r), r.abs(), 0).amax())
        del r
    return amax


def _finite_rows(rows_fn: RowFn, j0: int, j1: int, stats: RequantStats) -> torch.Tensor:
    """rows_fn(j0, j1) with its non-finite values counted in stats and set to 0 (the caller decides)."""
    r = rows_fn(j0, j1)
    bad = ~torch.isfinite(r)
    if bad.any():
        stats.nonfinite += int(bad.sum())
        r = torch.where(bad, torch.zeros_like(r), r)
    return r


def _add_error(stats: RequantStats, r: torch.Tensor, back: torch.Tensor) -> None:
    """Row sums of squares of r and of back - r (back overwritten) in fp32, their totals in fp64: no fp64 copy."""
    stats.ref2 += float(torch.linalg.vector_norm(r, dim=1).double().square().sum())
    stats.err2 += float(torch.linalg.vector_norm(back.sub_(r), dim=1).double().square().sum())


def requantize_micro(rows_fn: RowFn, n_rows: int, n_cols: int, kind: str, *, device=None, global_scale=None):
    """requantize for the microscaled kinds by their recipes (quant.py): (w, scale, global_scale, stats). "nvfp4" takes
    the whole weight's global scale first (rows_fn called twice per block), or the one given (a fused group's);
    "mxfp8" is row-local (global_scale None)."""
    g = global_scale if global_scale is not None or kind != "nvfp4" else \
        nvfp4_global_scale(weight_amax(rows_fn, n_rows, n_cols, device))
    stats = RequantStats()
    w = scale = None
    for j0, j1 in row_blocks(n_rows, n_cols):
        r = _finite_rows(rows_fn, j0, j1, stats)
        q, s = quantize_nvfp4(r, g)[:2] if kind == "nvfp4" else quantize_mxfp8(r)
        if w is None:  # written in place, block by block: no second copy of the weight
            w = q.new_empty(n_rows, q.shape[1])
            scale = s.new_empty(n_rows, s.shape[1])
        w[j0:j1], scale[j0:j1] = q, s
        _add_error(stats, r, micro_rows(q, s, g, 0, j1 - j0))
        del r, q, s
    return w, scale, g, stats
