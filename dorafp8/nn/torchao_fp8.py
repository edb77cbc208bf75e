"""Linear layers whose weight torchao quantized to fp8 (Float8WeightOnlyConfig,
Float8DynamicActivationFloat8WeightConfig): their e4m3 bytes and scales, as FP8Linear holds them. Per-tensor, per-row
and square-block weights are taken as they are; 1 x g groups are re-quantized per row (group_scales.py); anything
else raises. torchao is never imported here. The fields read: docs/ARCHITECTURE.md."""

from __future__ import annotations

from typing import Optional

import torch

from ..quant import E4M3
from .group_scales import groups_to_rows, report_regrouped

SUPPORTED = ("per tensor (PerTensor()), per row (PerRow(), the default), square b x b blocks (PerBlock([b, b])), and "
             "1 x g groups (PerGroup(g), PerBlock([1, g]): re-quantized to per-row scales with the error reported)")


def is_torchao_tensor(t) -> bool:
    """Whether `t` is one of torchao's tensor subclasses (without importing torchao)."""
    return isinstance(t, torch.Tensor) and type(t).__module__.split(".")[0] == "torchao"


def _layout(w, name: Optional[str]) -> tuple[str, int]:
    """("tensor" | "row" | "block" | "group", b) of a torchao Float8Tensor weight; raises on what dorafp8 cannot
    hold. b is the block size of "block" (square) and the group size of "group" (1 x g)."""
    what = f"weight of {name!r}" if name else "weight"
    kind = type(w).__name__
    if kind != "Float8Tensor" or not all(hasattr(w, a) for a in ("qdata", "scale")):
        raise TypeError(f"the {what} is torchao's {kind}; dorafp8 takes torchao's Float8Tensor weights (from "
                        f"Float8WeightOnlyConfig() or Float8DynamicActivationFloat8WeightConfig()). Give dorafp8 the "
                        f"unquantized model instead (dorafp8.quantize_model), or a Float8Tensor")
    q, s = w.qdata, w.scale
    if q.dtype != E4M3:
        raise TypeError(f"the {what} is a torchao Float8Tensor of {q.dtype}; dorafp8 holds float8_e4m3fn weights "
                        f"(converting {q.dtype} to e4m3 would move its values). Quantize with torchao's default "
                        f"weight dtype (torch.float8_e4m3fn), or give dorafp8 the unquantized model")
    if q.dim() != 2:
        raise ValueError(f"the {what} is a torchao Float8Tensor of shape {tuple(q.shape)}; dorafp8 takes 2-D "
                         f"[out_features, in_features] linear weights")
    N, K = q.shape
    bs = getattr(w, "block_size", None)
    if bs is None or len(bs) == 0:  # no block size recorded: the scale's shape says it
        bs = [N // s.shape[0], K // s.shape[-1]] if s.dim() == 2 else [N, K]
    bn, bk = (int(b) for b in bs)
    if s.numel() == 1 or (bn, bk) == (N, K):
        kind_, b = "tensor", 0
    elif (bn, bk) == (1, K):
        kind_, b = "row", 0
    elif bn == bk:
        kind_, b = "block", bn
    elif bn == 1:
        kind_, b = "group", bk
    else:
        raise ValueError(f"the {what} is a torchao Float8Tensor with {bn} x {bk} scale blocks (scale shape "
                         f"{tuple(s.shape)}); dorafp8 takes {SUPPORTED}")
    want = {"tensor": None, "row": (N, 1), "block": (-(-N // b) if b else 0, -(-K // b) if b else 0),
            "group": (N, K // b if b else 0)}[kind_]
    if want is not None and tuple(s.shape) != want:
        raise ValueError(f"the {what} is a torchao Float8Tensor with {bn} x {bk} blocks but a scale of shape "
                         f"{tuple(s.shape)} (expected {list(want)})")
    if kind_ == "group" and K % b:
        raise ValueError(f"the {what}: 1 x {b} groups do not divide its {K} input features")
    return kind_, b


def check_torchao_weight(w, name: Optional[str] = None) -> None:
    """Raises what torchao_fp8_parts would raise, without converting (reads the scale once)."""
    _layout(w, name)
    _finite_scale(w.scale.float(), name)


def _finite_scale(s: torch.Tensor, name: Optional[str]) -> None:
    bad = ~torch.isfinite(s) | (s < 0)
    if bool(bad.any()):
        raise ValueError(f"the weight of {name!r}: its torchao scale has {int(bad.sum())} NaN, infinite or negative "
                         f"values; refusing to take it")


def _zero_blocks_fixed(q: torch.Tensor, s: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's scale = amax / 448 has no floor: an all-zero row (block, group) gets scale 0 and NaN values. Those
    bytes become +0 with scale 1 (quantize_e4m3's convention), the zeros the weight was."""
    zero = s == 0
    if not bool(zero.any()):
        return q, s
    N, K = q.shape
    expand = zero.repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K] if s.dim() == 2 else zero
    q = torch.where(expand, torch.zeros((), dtype=E4M3, device=q.device), q)
    return q, torch.where(zero, torch.ones_like(s), s)


def torchao_fp8_parts(w, name: Optional[str] = None) -> tuple[torch.Tensor, torch.Tensor, Optional[int]]:
    """(w8 e4m3 [N, K], fp32 scale, block_size or None) of a torchao Float8Tensor, 1 x g groups made per-row."""
    kind, b = _layout(w, name)
    q, s = w.qdata.detach(), w.scale.detach().float()
    _finite_scale(s, name)
    N, K = q.shape
    if kind == "tensor":
        q, s = _zero_blocks_fixed(q, s.reshape(()), N, K)
        return q.contiguous(), s, None
    if kind == "row":
        q, s = _zero_blocks_fixed(q, s.reshape(N, 1), 1, K)
        return q.contiguous(), s.reshape(N), None
    q, s = _zero_blocks_fixed(q, s, b if kind == "block" else 1, b)
    if kind == "block":
        return q.contiguous(), s.contiguous(), b
    q8, s_row, rel = groups_to_rows(q.contiguous(), s, b)
    report_regrouped(name, b, rel, "the torchao model")
    return q8, s_row, None
