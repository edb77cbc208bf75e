"""Weights quantized with one scale per 1 x g group (musubi-tuner / kohya `--fp8_scaled`, torchao PerGroup), mapped onto
per-row scales: re-quantized once when loaded, s_row[n] = max of the row's group scales, the error warned about
(QuantizationWarning). Why: docs/ARCHITECTURE.md; docs/CHECKPOINTS.md, "1 x 64 block scales"."""

from __future__ import annotations

import math
import warnings
from contextlib import contextmanager

import torch

from ..quant import E4M3, QuantizationWarning, row_blocks


def groups_to_rows(w8: torch.Tensor, gscale: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(w8' e4m3 [N, K], per-row scale fp32 [N], relative Frobenius error ||W' - W0|| / ||W0||) for a weight w8 e4m3 [N,
    K] with 1 x `group` scales gscale [N, K / group] (any float dtype), computed in blocks of rows."""
    N, K = w8.shape
    G = K // group
    if group < 1 or G * group != K or tuple(gscale.shape) != (N, G):
        raise ValueError(f"gscale must be [{N}, {K} / group] for 1 x group scales of a [{N}, {K}] weight, got "
                         f"{tuple(gscale.shape)} with group {group}")
    gs = gscale.float()
    s_row = gs.amax(dim=1)
    s_row = torch.where(s_row > 0, s_row, torch.ones_like(s_row))  # an all-zero row: scale 1, as quantize_e4m3 does
    ratio = gs / s_row[:, None]  # <= 1
    out = torch.empty_like(w8)
    err2 = torch.zeros((), dtype=torch.float64, device=w8.device)
    ref2 = torch.zeros((), dtype=torch.float64, device=w8.device)
    for j0, j1 in row_blocks(N, K):
        q = w8[j0:j1].float().view(j1 - j0, G, group)
        new = (q * ratio[j0:j1, :, None]).to(E4M3)  # round to nearest even, once
        out[j0:j1] = new.view(j1 - j0, K)
        w0 = q * gs[j0:j1, :, None]
        err2 += (new.float() * s_row[j0:j1, None, None] - w0).double().square().sum()
        ref2 += w0.double().square().sum()
    rel = math.sqrt(err2.item() / ref2.item()) if ref2.item() > 0 else 0.0
    return out, s_row, rel


# ---- one warning per model, not per layer -------------------------------------------------------------------------

_COLLECTING: list[list] = []


def report_regrouped(name: str, group: int, rel_error: float, source: str) -> None:
    """Says layer `name` was re-quantized from 1 x `group` to per-row scales (collected, else warned)."""
    entry = (name or "layer", group, rel_error)
    if _COLLECTING:
        _COLLECTING[-1].append(entry)
    else:
        warn_regrouped([entry], source)


@contextmanager
def collect_regrouped(source: str):
    """Collects report_regrouped() calls and, if the block succeeds, warns once for all of them."""
    entries: list = []
    _COLLECTING.append(entries)
    try:
        yield entries
    finally:
        _COLLECTING.pop()
    if entries:
        warn_regrouped(entries, source)


def warn_regrouped(entries: list, source: str) -> None:
    """The QuantizationWarning for layers re-quantized from 1 x g to per-row scales: how many, the worst and mean
    relative error against the weights `source` held. Layers that came through exactly are only counted."""
    lossy = [e for e in entries if e[2] > 0]
    groups = sorted({e[1] for e in entries})
    what = f"{len(entries)} layer{'s' if len(entries) > 1 else ''} of {source} with 1 x {'/'.join(map(str, groups))}"
    if not lossy:
        return
    worst = max(lossy, key=lambda e: e[2])
    mean = sum(e[2] for e in entries) / len(entries)
    warnings.warn(
        f"{what} block scales (one scale per output row and {groups[0]} input columns) were re-quantized to one scale "
        f"per row, which dorafp8's kernels hold: relative error against the weights {source} held: worst "
        f"{100 * worst[2]:.2f}% ({worst[0]!r}), mean {100 * mean:.2f}% ({len(entries) - len(lossy)} exact). This is "
        f"one more e4m3 rounding on top of the file's own; where you have the original bf16/fp16 weights, "
        f"dorafp8.quantize_model(model, per_row_scale=True) on them loses less (docs/CHECKPOINTS.md, '1 x 64 block "
        f"scales')", QuantizationWarning, stacklevel=4)
