"""Exact float8_e4m3fn -> fp16 / bf16 / fp32 conversion that is fast on CPU.

PyTorch converts float8 on CPU element by element (about 4 ns per element measured here, against 0.1 ns for a
bf16 -> fp32 copy), which made dequantizing a weight per call cost more than the convolution it feeds. e4m3's bits
map onto fp16's with integer ops that vectorize: moving sign, exponent and mantissa into fp16's positions gives an
fp16 whose value is exactly the e4m3 value times 2^-8 (the difference of the exponent biases, 15 - 7), for normal and
subnormal values alike (e4m3 subnormals m * 2^-9 land on fp16 subnormals m * 2^-17). Multiplying by 2^8 (folded into
the scale where there is one) is exact. e4m3fn's NaN (S.1111.111) is mapped to an fp16 NaN with integer ops too.

Weights up to _LUT_MAX elements (most layers of small models) take one table lookup instead: the 256 codes times the
scale, computed in fp32 and rounded into the target dtype (exactly what the elementwise product rounds to), gathered
by index_select: two ops whatever the layer's size, where the integer passes are ten.

On other devices the native conversion is used (it is a vectorized kernel there).
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
_BIAS_SHIFT = 256.0  # 2^(15 - 7)
_SMALL = 4096  # below this many elements PyTorch's own conversion is as fast as anything else here
_LUT_MAX = 1 << 18  # up to this many elements a table lookup beats the integer passes (measured on CPU)
_CODES = {}  # device -> the 256 e4m3fn codes as fp32


def _codes(device) -> torch.Tensor:
    t = _CODES.get(device)
    if t is None:
        t = _CODES[device] = torch.arange(256, dtype=torch.uint8, device=device).view(E4M3).float()
    return t


def _lookup(w8: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table.index_select(0, w8.reshape(-1).view(torch.uint8).int()).view(w8.shape)


def _half_bits(w8: torch.Tensor) -> torch.Tensor:
    """fp16 tensor equal to w8 * 2^-8 exactly; e4m3fn's NaN code becomes an fp16 NaN (integer ops only, no
    reduction: a few passes over int16)."""
    u = w8.view(torch.uint8).to(torch.int16)
    sign = u & 0x80
    u &= 0x7F  # exponent and mantissa
    nan = u + 1  # 0x80 exactly for the NaN code 0x7F
    nan >>= 7
    nan *= 0x7E00  # fp16 NaN bits where the code was NaN, else 0
    u <<= 7
    sign <<= 8
    u |= sign
    u |= nan
    return u.view(torch.float16)


def e4m3_to(w8: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """w8.to(dtype), exactly (dtype fp16, bf16 or fp32)."""
    n = w8.numel()
    if w8.device.type != "cpu" or n < _SMALL:
        return w8.to(dtype)
    if n <= _LUT_MAX:
        return _lookup(w8, _codes(w8.device).to(dtype))
    h = _half_bits(w8)
    return h.mul_(_BIAS_SHIFT) if dtype == torch.float16 else h.to(dtype).mul_(_BIAS_SHIFT)


def e4m3_scaled(w8: torch.Tensor, factor, dtype: torch.dtype) -> torch.Tensor:
    """(w8 * factor) in dtype, computed in fp32 and rounded once (factor a number, or an fp32 tensor broadcastable
    against w8: a 0-dim one goes into the lookup table)."""
    if w8.device.type == "cpu" and w8.numel() <= _LUT_MAX and not (isinstance(factor, torch.Tensor) and factor.dim()):
        return _lookup(w8, (_codes(w8.device) * factor).to(dtype))
    out = e4m3_scaled_fp32(w8, factor)
    return out if dtype == torch.float32 else out.to(dtype)


def e4m3_scaled_fp32(w8: torch.Tensor, factor) -> torch.Tensor:
    """w8 * factor in fp32 (factor a number or an fp32 tensor broadcastable against w8): one rounding, as
    w8.float() * factor."""
    n = w8.numel()
    if w8.device.type != "cpu" or n < _SMALL:
        return w8.float().mul_(factor)
    if n <= _LUT_MAX:
        if not (isinstance(factor, torch.Tensor) and factor.dim()):
            return _lookup(w8, _codes(w8.device) * factor)
        return _lookup(w8, _codes(w8.device)).mul_(factor)
    return _half_bits(w8).float().mul_(factor * _BIAS_SHIFT)
