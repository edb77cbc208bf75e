"""Exact float8_e4m3fn -> fp16 / bf16 / fp32 conversion that is fast on CPU.

On CPU PyTorch's own conversion and a table lookup (same bits) race on the first large block of each kind; the faster
serves the rest of the process (`_choice`). Other devices use PyTorch's. Why: docs/ARCHITECTURE.md."""

from __future__ import annotations

import sys
import time

import torch

E4M3 = torch.float8_e4m3fn
_SMALL = 4096  # below this many elements PyTorch's own conversion is as fast as anything else here
_LUT_MAX = 1 << 18  # up to this many elements the lookup, untimed; above, whichever _choice measured faster
_TRIALS = 3  # timed runs of each candidate (the fastest run counts), on the first large block of each dtype
_CODES = {}  # (device, pairs, dtype) -> the e4m3fn codes: [256], or [65536, 2] for two bytes read as one uint16
_CHOICE: dict = {}  # (target dtype, kind of factor) -> "lookup" or "native", measured on the first large block


def _codes(device, pairs: bool = False, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    t = _CODES.get((device, pairs, dtype))
    if t is None:
        one = torch.arange(256, dtype=torch.uint8, device=device).view(E4M3).float()
        if pairs:  # entry i: the two codes whose bytes, in this machine's byte order, read as the uint16 i
            i = torch.arange(1 << 16, device=device)
            first, second = (i & 0xFF, i >> 8) if sys.byteorder == "little" else (i >> 8, i & 0xFF)
            one = torch.stack([one[first], one[second]], dim=1)
        t = _CODES[(device, pairs, dtype)] = one.to(dtype)  # exact: every e4m3 value is a bf16 and fp16 value
    return t


def _lookup(w8: torch.Tensor, factor, dtype: torch.dtype) -> torch.Tensor:
    """The codes times the factor (a number, a one-element tensor, or None), rounded into dtype, gathered; two bytes at
    a time where w8 is contiguous, even-sized and larger than that table (65536 pairs)."""
    pairs = w8.is_contiguous() and w8.numel() % 2 == 0 and w8.numel() > (1 << 17)
    if factor is None:
        table = _codes(w8.device, pairs, dtype)
    else:  # the products in fp32, rounded once into dtype
        table = (_codes(w8.device, pairs) * (factor.reshape(()) if isinstance(factor, torch.Tensor) else factor)
                 ).to(dtype)
    if not pairs:
        return table.index_select(0, w8.reshape(-1).view(torch.uint8).int()).view(w8.shape)
    # Each pair read as one 4- or 8-byte word: a gather of words, several times faster than one of 2-element rows.
    words = table.view(torch.int32 if table.element_size() == 2 else torch.int64).reshape(-1)
    return words.index_select(0, w8.reshape(-1).view(torch.uint16).int()).view(dtype).view(w8.shape)


def _per_element(factor) -> bool:
    return isinstance(factor, torch.Tensor) and factor.numel() > 1


def _convert(method: str, w8: torch.Tensor, factor, dtype: torch.dtype) -> torch.Tensor:
    """w8 * factor (factor None: w8) computed in fp32 and rounded once into dtype, by `method`."""
    if method == "lookup" and not _per_element(factor):
        return _lookup(w8, factor, dtype)
    if factor is None:
        return w8.to(dtype)
    out = _lookup(w8, None, torch.float32) if method == "lookup" else w8.float()
    out.mul_(factor)
    return out if dtype == torch.float32 else out.to(dtype)


def _choice(w8: torch.Tensor, factor, dtype: torch.dtype) -> tuple[str, torch.Tensor | None]:
    """The method for large blocks into `dtype` with such a factor, and the block converted if this call measured it:
    once per (dtype, kind of factor), each method _TRIALS times in turn, the fastest run of each."""
    key = (dtype, "none" if factor is None else "tensor" if _per_element(factor) else "scalar")
    method = _CHOICE.get(key)
    if method is not None:
        return method, None
    best, out = {}, None
    for _ in range(_TRIALS):
        for m in ("native", "lookup"):
            out = None  # the previous trial's block is freed first: one block alive at a time (tests/integration/
            t0 = time.perf_counter()  # test_memory.py holds the native backend to that)
            out = _convert(m, w8, factor, dtype)
            best[m] = min(best.get(m, float("inf")), time.perf_counter() - t0)
    method = _CHOICE[key] = min(best, key=best.get)
    return method, out


def e4m3_scaled(w8: torch.Tensor, factor, dtype: torch.dtype) -> torch.Tensor:
    """(w8 * factor) in dtype (fp16, bf16 or fp32), computed in fp32 and rounded once, as (w8.float() *
    factor).to(dtype) rounds it; factor a number, a broadcastable fp32 tensor, or None: w8.to(dtype), exactly."""
    n = w8.numel()
    if w8.device.type != "cpu" or n < _SMALL:
        return _convert("native", w8, factor, dtype)
    if n <= _LUT_MAX:
        return _convert("lookup", w8, factor, dtype)
    method, out = _choice(w8, factor, dtype)
    return out if out is not None else _convert(method, w8, factor, dtype)
