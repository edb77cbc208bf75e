"""The FP8 e4m3 recipe (docs/DORA_MATH.md, "FP8 e4m3 recipe"), interoperable with the fp8 checkpoints of OneTrainer,
ComfyUI, compressed-tensors and the fine-grained (DeepSeek-V3 / Qwen3-FP8) format: W0 = scale * W8 with an fp32 scale
per tensor ([]), per output row ([N]) or per b x b block ([ceil(N/b), ceil(K/b)], b = 128 by default); scale =
amax|W| / 448 over what it covers, W8 = clamp(W / scale) rounded to nearest even (check_scale normalizes a scale)."""

from __future__ import annotations

import math
import warnings
from typing import Literal

import torch

E4M3 = torch.float8_e4m3fn
# A scale's granularity, spelled the same everywhere down to the kernels' SCALE_KIND: one fp32 value per "tensor", per
# output "row" or per b x b "block"; or a microscaled kind ("Microscaled weights" below), told by the scale's dtype.
ScaleKind = Literal["tensor", "row", "block", "mxfp8", "nvfp4"]
SCALE_KINDS: tuple[ScaleKind, ...] = ("tensor", "row", "block")  # fp8 granularities: what quantize_e4m3 writes
MICRO_KINDS: tuple[ScaleKind, ...] = ("mxfp8", "nvfp4")
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448.0

# Rows quantized per block, so that the fp32 temporaries stay small for large weights.
_QUANT_BLOCK_ELEMS = 4 * 1024 * 1024
DEFAULT_BLOCK = 128


class QuantizationWarning(UserWarning):
    """Per-tensor fp8 quantization lost much more than e4m3's usual ~2.6% (an outlier weight or a tiny row)."""


# When quantize_e4m3 warns: usual weights lose 2.4-2.7% (relative Frobenius) and well under 0.1% of them underflow; a
# per-tensor scale set by one outlier flushes most of the tensor to zero instead.
LOSSY_FLUSHED_FRACTION = 0.01   # more than 1% of the non-zero weights became 0
LOSSY_REL_ERROR = 0.05          # relative Frobenius error above 5% (twice e4m3's usual)


def _check_quant_args(weight, per_row: bool, block_size, name) -> tuple[str, int]:
    """quantize_e4m3's argument checks; returns how its messages name the weight and the rows it reads at a time."""
    what = f"weight of {name!r}" if name else "weight"
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dtype in FP8_DTYPES:
        raise TypeError(f"{what} must be a floating-point tensor (not fp8), got "
                        f"{weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"{what} must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    if weight.numel() == 0:
        raise ValueError(f"{what} must not be empty, got shape {tuple(weight.shape)}")
    if per_row and block_size is not None:
        raise ValueError("per_row and block_size are exclusive: a scale is per tensor, per row or per block")
    K = weight.shape[1]
    if block_size is not None:
        check_block_size(block_size)
        return what, block_size * max(1, _QUANT_BLOCK_ELEMS // (K * block_size))  # whole blocks of rows at a time
    return what, max(1, _QUANT_BLOCK_ELEMS // K)


def _nonfinite(what: str, where: str) -> ValueError:
    return ValueError(f"{what} has non-finite values (first in {where}); refusing to quantize them to fp8")


def check_quantizable(weight: torch.Tensor, *, per_row: bool = False, block_size: int | None = None,
                      name: str | None = None) -> None:
    """Raises what quantize_e4m3(weight, ...) would, without quantizing: one read in blocks of rows."""
    what, rows = _check_quant_args(weight, per_row, block_size, name)
    # One flag per row, read back once per weight (one host sync on a GPU, not one per block of rows).
    ok = torch.cat([torch.isfinite(weight[j0:j0 + rows].detach()).all(dim=1)
                    for j0 in range(0, weight.shape[0], rows)])
    if not ok.all():
        raise _nonfinite(what, f"row {int((~ok).nonzero()[0])}")


def quantize_e4m3(weight: torch.Tensor, *, per_row: bool = False, block_size: int | None = None,
                  name: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes a float weight [N, K] to (w8 float8_e4m3fn [N, K], scale fp32).

    An all-zero tensor (row, block) gets scale 1. A per-tensor quantization that loses much more than usual (see
    LOSSY_*) emits a QuantizationWarning naming per_row=True.

    Args:
        weight: a 2-D float tensor.
        per_row: one scale per row: scale [N].
        block_size: b for one scale per b x b block: scale [ceil(N/b), ceil(K/b)]. Neither: one 0-dim scale.
        name: the module's name, used in the messages.

    Returns:
        (w8, scale), with weight ~= scale * w8.

    Raises:
        TypeError: a weight that is not a floating-point tensor (or already fp8).
        ValueError: non-finite values (they would silently become NaN or saturate), a weight that is not 2-D or is
            empty, or per_row together with block_size.
    """
    what, rows = _check_quant_args(weight, per_row, block_size, name)
    N, K = weight.shape
    if block_size is not None:
        amax = torch.empty(-(-N // block_size), -(-K // block_size), dtype=torch.float32, device=weight.device)
    else:
        amax = torch.empty(N, dtype=torch.float32, device=weight.device)
    for j0 in range(0, N, rows):
        blk = weight[j0:j0 + rows].detach().abs()
        if block_size is not None:
            bam = _block_amax(blk, block_size)
            amax[j0 // block_size:j0 // block_size + bam.shape[0]] = bam
        else:
            amax[j0:j0 + rows] = blk.amax(dim=1).float()
    if not torch.isfinite(amax).all():
        bad = (~torch.isfinite(amax)).nonzero()[0].tolist()
        raise _nonfinite(what, f"row {bad[0]}" if block_size is None else
                         f"block {bad} (rows from {bad[0] * block_size})")
    per_tensor = not per_row and block_size is None
    if per_tensor:
        amax = amax.amax()
    scale = amax / E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    w8 = torch.empty(N, K, dtype=E4M3, device=weight.device)
    # Loss statistics, accumulated on the blocks as they are quantized: [non-zero, flushed to 0, non-zero rows that
    # became all-zero], and per row the sums of err^2 and of w^2 (two fp64 values per row)
    counts = torch.zeros(3, dtype=torch.int64, device=weight.device)
    row_sq = torch.zeros(2, N, dtype=torch.float64, device=weight.device) if per_tensor else None
    for j0 in range(0, N, rows):
        blk = weight[j0:j0 + rows].detach().float()
        s = scale_rows(scale, block_size or DEFAULT_BLOCK, j0, j0 + blk.shape[0], K)
        q = to_e4m3(blk, s)
        w8[j0:j0 + rows] = q
        if per_tensor:
            back = q.float() * s
            nz = blk != 0
            counts += torch.stack([nz.sum(), (nz & (back == 0)).sum(), (nz.any(1) & ~(back != 0).any(1)).sum()])
            row_sq[0, j0:j0 + blk.shape[0]] = (back - blk).double().square().sum(1)
            row_sq[1, j0:j0 + blk.shape[0]] = blk.double().square().sum(1)
    if per_tensor:
        _warn_if_lossy(counts, row_sq, what)
    return w8, scale


def to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale (broadcast) rounded to e4m3, saturating at +-448: every quantizer's rounding."""
    return (x / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)


def _block_amax(a: torch.Tensor, b: int) -> torch.Tensor:
    """amax over b x b blocks of a [n, K] tensor (n a multiple of b, or the last rows), as fp32 [ceil(n/b), ceil(K/b)]."""
    n, K = a.shape
    pad_n, pad_k = -n % b, -K % b
    a = torch.nn.functional.pad(a.float(), (0, pad_k, 0, pad_n))  # zeros never raise an amax
    return a.reshape((n + pad_n) // b, b, (K + pad_k) // b, b).amax(dim=(1, 3))


def _warn_if_lossy(counts: torch.Tensor, row_sq: torch.Tensor, what: str) -> None:
    """Warns when a per-tensor quantization lost much more than e4m3 usually does: with how many weights became 0 and
    the median row's error, as the largest values dominate the whole tensor's relative error."""
    err2, ref2 = row_sq
    rel_rows = torch.where(ref2 > 0, err2 / ref2, torch.nan).sqrt()  # NaN: a row without a non-zero weight
    rel = (err2.sum() / ref2.sum().clamp_min(torch.finfo(torch.float64).tiny)).sqrt()
    # one read back to the host (one sync on a GPU)
    stats = torch.cat([counts.double(), rel[None], rel_rows.nanmedian()[None]])
    nonzero, flushed, lost_rows, rel, median = stats.tolist()
    nonzero, flushed, lost_rows = int(nonzero), int(flushed), int(lost_rows)
    median = 0.0 if math.isnan(median) else median  # no row with a non-zero weight
    frac = flushed / max(nonzero, 1)
    if frac > LOSSY_FLUSHED_FRACTION or rel > LOSSY_REL_ERROR or lost_rows:
        whole = f"{100 * rel:.2g}% over the whole tensor" + (", whose norm its largest values dominate"
                                                              if rel < median / 2 else "")
        warnings.warn(
            f"per-tensor fp8 quantization of the {what} is lossy: {100 * frac:.1f}% of its non-zero values "
            f"({flushed} of {nonzero}) became 0, {lost_rows} of its non-zero rows became all-zero, and the median "
            f"row's relative error is {100 * median:.1f}% (e4m3 usually gives ~2.6%; {whole}): the single scale, set "
            f"by the largest values, leaves the small ones too few e4m3 steps. Quantize it per row instead: "
            f"per_row_scale=True (quantize_model / FP8Linear.from_float) or per_row=True (quantize_e4m3)",
            QuantizationWarning, stacklevel=3)


def dequantize_e4m3(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32, *,
                    block_size: int = DEFAULT_BLOCK) -> torch.Tensor:
    """scale * w8 as a dense tensor of `dtype` (computed in fp32). Materializes the whole weight: for checking and
    for exporting, not for the training path.

    Args:
        w8, scale: as quantize_e4m3 returns them.
        dtype: the dtype of the result.
        block_size: b, for block scales.

    Returns:
        The dense [N, K] weight.
    """
    check_fp8_weight(w8)
    N, K = w8.shape
    scale = check_scale(scale, N, K, block_size)
    return (w8.float() * scale_rows(scale, block_size, 0, N, K)).to(dtype)


def scale_rows(scale: torch.Tensor, block_size: int, j0: int, j1: int, K: int) -> torch.Tensor:
    """The fp32 factor dequantizing rows j0:j1 of [N, K]: [1, 1] per tensor, [rows, 1] per row, [rows, K] for blocks."""
    scale = scale.float()
    if scale.dim() == 0:
        return scale.reshape(1, 1)
    if scale.dim() == 1:
        return scale[j0:j1].reshape(-1, 1)
    rows = scale[j0 // block_size: -(-j1 // block_size)].repeat_interleave(block_size, dim=0)
    off = j0 - (j0 // block_size) * block_size
    return rows[off:off + (j1 - j0)].repeat_interleave(block_size, dim=1)[:, :K]


def scale_kind(scale: torch.Tensor) -> ScaleKind:
    """"tensor", "row" or "block" for a scale normalized by check_scale; "mxfp8" for an e8m0 scale, "nvfp4" for e4m3."""
    if scale.dtype == E4M3:
        return "nvfp4"
    if scale.dtype == E8M0:
        return "mxfp8"
    return SCALE_KINDS[scale.dim()]


def check_scale_kind(kind) -> ScaleKind:
    if kind not in SCALE_KINDS:
        raise ValueError(f"granularity must be one of {list(SCALE_KINDS)}, got {kind!r}")
    return kind


# act_quant, the activation recipe of the base GEMMs: "" (W8A16) or "rowwise" (W8A8: activations quantized per row to
# e4m3); check_act_quant normalizes the public spellings (None / "" / "none" -> "").
ACT_QUANT_MODES = ("", "rowwise")


def check_act_quant(act_quant) -> str:
    mode = "" if act_quant in (None, "", "none") else act_quant
    if not isinstance(mode, str) or mode not in ACT_QUANT_MODES:
        raise ValueError(f"act_quant must be None or 'rowwise', got {act_quant!r}")
    return mode


def check_block_size(block_size) -> int:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    return block_size


def check_e4m3(w8, name: str = "w8") -> None:
    """The one dtype check of an fp8 weight argument; the TypeError names the argument and says how to get e4m3."""
    if isinstance(w8, torch.Tensor) and w8.dtype == E4M3:
        return
    got = w8.dtype if isinstance(w8, torch.Tensor) else type(w8).__name__
    if isinstance(w8, torch.Tensor) and is_fp8(w8):
        how = ("; another fp8 format does not convert to e4m3 exactly (its range differs): dequantize it and quantize "
               "it with dorafp8.quantize_e4m3")
    else:
        how = " (see dorafp8.quantize_e4m3)"
    raise TypeError(f"{name} must be a torch.float8_e4m3fn tensor, got {got}{how}")


def check_fp8_weight(w8: torch.Tensor, name: str = "w8") -> None:
    check_e4m3(w8, name)
    if w8.dim() != 2:
        raise ValueError(f"{name} must be 2-D [out_features, in_features], got shape {tuple(w8.shape)}")


def check_scale(scale, n_rows: int, n_cols: int, block_size: int, name: str = "scale") -> torch.Tensor:
    """Returns scale as fp32: [] (per tensor), [n_rows] (per row; [n_rows, 1] accepted) or per b x b block."""
    if not isinstance(scale, torch.Tensor) or not scale.is_floating_point() or scale.dtype == E4M3:
        got = scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__
        # ModelOpt stores MXFP8's e8m0 scales as uint8 bytes: .float() of them would be the byte values, not the scale
        hint = (f"; an MXFP8 scale stored as uint8 e8m0 bytes (ModelOpt's) is {name}.view(torch.float8_e8m0fnu)"
                if got == torch.uint8 else "")
        raise TypeError(f"{name} must be a floating-point tensor (fp32 expected), got {got}{hint}")
    if scale.numel() == 1 and not (scale.dim() == 2 and n_rows > block_size):
        return (scale if scale.dim() == 0 else scale.reshape(())).float()  # a reshape is an op, every call
    if scale.dim() == 1 and scale.shape[0] == n_rows:
        return scale.float()
    if scale.dim() == 2 and tuple(scale.shape) == (n_rows, 1):
        return scale.reshape(n_rows).float()
    check_block_size(block_size)
    blocks = (-(-n_rows // block_size), -(-n_cols // block_size))
    if scale.dim() == 2 and tuple(scale.shape) == blocks:
        return scale.float()
    raise ValueError(f"{name} must have one element (per tensor), shape [{n_rows}] (per row) or [{blocks[0]}, "
                     f"{blocks[1]}] (per {block_size} x {block_size} block), got shape {tuple(scale.shape)}")


# Size of one fp32 block (of weight rows or activation rows). A few such temporaries are alive at once at most.
_BLOCK_BYTES = 16 * 1024 * 1024


def row_blocks(n_rows: int, width: int, block_size: int = 1):
    """(start, end) of row blocks of at most _BLOCK_BYTES in fp32, whole multiples of `block_size` rows."""
    rows = max(1, _BLOCK_BYTES // (4 * max(width, 1)))
    rows = max(block_size, rows - rows % block_size)
    for j0 in range(0, n_rows, rows):
        yield j0, min(n_rows, j0 + rows)


def w0_rows(w8, scale, block_size, j0, j1, global_scale=None):
    """W0[j0:j1] in fp32 (a temporary of the block's size), for every kind (global_scale: NVFP4's)."""
    kind = scale_kind(scale)
    if kind in MICRO_KINDS:
        return micro_rows(w8, scale, global_scale, j0, j1)
    return w8[j0:j1].float().mul_(scale_rows(scale, block_size, j0, j1, w8.shape[1]))


def row_step(scale: torch.Tensor, block_size: int) -> int:
    """The multiple of rows a walk over the weight's rows takes at a time (row_blocks' block_size): whole blocks of
    block scales, any number of rows otherwise (the microscaled kinds' blocks lie along a row)."""
    return block_size if scale_kind(scale) == "block" else 1


# Every float8 dtype (what a weight "already in fp8" may be), with the codes that are not finite in it as (bit mask,
# code): NaN or inf where b & mask == code (torch 2.14's isfinite has no float8 kernel, and upcasting a weight costs 4
# bytes an element).
_FP8_NONFINITE = {
    torch.float8_e4m3fn: (0x7F, 0x7F),     # S.1111.111 is NaN; no infinities
    torch.float8_e5m2: (0x7C, 0x7C),       # exponent 11111: inf (mantissa 0) or NaN
    torch.float8_e4m3fnuz: (0xFF, 0x80),   # the negative-zero code is the one NaN
    torch.float8_e5m2fnuz: (0xFF, 0x80),
    torch.float8_e8m0fnu: (0xFF, 0xFF),
}
FP8_DTYPES = frozenset(_FP8_NONFINITE)


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in FP8_DTYPES


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of t is finite, for every dtype torch has, float8 included (ints and bools are)."""
    if not (t.is_floating_point() or t.is_complex()):
        return True
    code = _FP8_NONFINITE.get(t.dtype)
    if code is not None:
        mask, bad = code
        return not bool(((t.detach().view(torch.uint8) & mask) == bad).any())
    return bool(torch.isfinite(t.detach()).all())


# ---- Microscaled weights: MXFP8 and NVFP4 ----------------------------------------------------------------------------
#
# Two more weight kinds, dequantized a block of rows at a time by w0_rows as the fp8 kinds are (never the whole weight):
#   "mxfp8": w8 float8_e4m3fn [N, K], scale float8_e8m0fnu [N, ceil(K/32)] (OCP MX: a power of two per 32 weights of
#            a row, the last block partial):                  W0[j, k] = 2^(e[j, k // 32] - 127) * w8[j, k]
#   "nvfp4": w8 uint8 [N, K/2] holding e2m1 codes two per byte, the even column in the low nibble (ModelOpt's
#            `(q[..., 1::2] << 4) | q[..., 0::2]`, compressed-tensors' pack_fp4_to_uint8), scale float8_e4m3fn
#            [N, K/16], global_scale fp32 [] (ModelOpt's `weight_scale_2`):
#                                                             W0[j, k] = e2m1(w8)[j, k] * (scale[j, k // 16] * global)
#            the block's factor formed in fp32 first, as ModelOpt's dequantize does; K a multiple of 16.
# MXFP8's W0 is exact in fp32 (a power of two times an e4m3 value). NVFP4's is the exact product rounded to fp32 twice
# at most (scale * global, then times the e2m1 value), as ModelOpt's own dequantize rounds it: within 2^-23 of it.

E8M0 = torch.float8_e8m0fnu
MXFP8_BLOCK = 32
NVFP4_BLOCK = 16
E2M1_MAX = 6.0
NVFP4_MIN_SCALE = 2.0 ** -9  # e4m3's smallest subnormal: the least block scale ModelOpt writes
# The 16 e2m1 codes: bit 3 the sign, bits 0-2 the magnitude's index (ModelOpt's e2m1_values, compressed-tensors' table).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def weight_dims(w8: torch.Tensor) -> tuple[int, int]:
    """(N, K) of a weight as the kernels take it: a packed NVFP4 weight (uint8) holds two columns a byte."""
    N, cols = w8.shape
    return (N, 2 * cols) if w8.dtype == torch.uint8 else (N, cols)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """The e2m1 values of a packed uint8 [n, c] as fp32 [n, 2c] (low nibble first)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)
    return table[codes.int()]


def e8m0_values(scale: torch.Tensor) -> torch.Tensor:
    """The fp32 values 2^(e - 127) of an e8m0 scale (exact: 2^-127 is an fp32 subnormal; code 255 is NaN)."""
    e = scale.view(torch.uint8).int()
    out = torch.ldexp(torch.ones(e.shape, dtype=torch.float32, device=e.device), e - 127)
    return torch.where(e == 255, torch.nan, out)


def micro_rows(w8, scale, global_scale, j0, j1, div=None) -> torch.Tensor:
    """W0[j0:j1] (divided by div, a 0-dim tensor, if given) in fp32 for the "mxfp8" and "nvfp4" kinds: one temporary
    of the rows' size plus their codes. The block factors (div folded into them) multiply each block of the rows in
    place, broadcast: no factor tensor of the rows' size (a second fp32 copy's traffic) and no pass for div."""
    if scale.dtype == E8M0:
        f, size, w = e8m0_values(scale[j0:j1]), MXFP8_BLOCK, w8[j0:j1].float()
    else:  # ModelOpt's per_block_scale = scale * weight_scale_2
        f, size, w = scale[j0:j1].float().mul_(global_scale.float()), NVFP4_BLOCK, unpack_e2m1(w8[j0:j1])
    if div is not None:
        f = f / div
    K = w.shape[1]
    full = K - K % size  # an MXFP8 row's last block may be partial
    w[:, :full].unflatten(1, (-1, size)).mul_(f[:, :full // size, None])
    if full < K:
        w[:, full:].mul_(f[:, full // size:])
    return w


def _micro_scale_shape(kind: str, N: int, K: int) -> tuple[int, int]:
    return (N, -(-K // MXFP8_BLOCK)) if kind == "mxfp8" else (N, K // NVFP4_BLOCK)


def check_weight(w8, scale, block_size: int = DEFAULT_BLOCK, global_scale=None, name: str = "w8"
                 ) -> tuple[int, int, torch.Tensor]:
    """The one check of a weight argument of the ops, for every kind: (N, K, scale normalized). e4m3 with an fp32 scale
    (check_scale) or an e8m0 one ("mxfp8"), or packed NVFP4 uint8 with e4m3 scales and global_scale ("nvfp4")."""
    if isinstance(w8, torch.Tensor) and w8.dtype == torch.uint8:
        if w8.dim() != 2:
            raise ValueError(f"{name} (packed NVFP4) must be 2-D [out_features, in_features / 2], got shape "
                             f"{tuple(w8.shape)}")
        N, K = weight_dims(w8)
        if K % NVFP4_BLOCK:
            raise ValueError(f"{name} (packed NVFP4) holds {K} columns, not a multiple of {NVFP4_BLOCK}: NVFP4 has one "
                             f"scale per {NVFP4_BLOCK} weights of a row")
        check_micro_scale(scale, "nvfp4", N, K, "scale")
        check_global_scale(global_scale, "global_scale")
        return N, K, scale
    check_fp8_weight(w8, name)
    N, K = w8.shape
    if isinstance(scale, torch.Tensor) and scale.dtype == E8M0:
        check_micro_scale(scale, "mxfp8", N, K, "scale")
    else:
        scale = check_scale(scale, N, K, block_size)
    if global_scale is not None:
        raise ValueError(f"global_scale is NVFP4's (a uint8 packed {name}); got one with a {scale_kind(scale)} scale")
    return N, K, scale


def check_micro_scale(scale, kind: str, N: int, K: int, name: str) -> None:
    want = E8M0 if kind == "mxfp8" else E4M3
    if not isinstance(scale, torch.Tensor) or scale.dtype != want:
        got = scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise TypeError(f"{name} of a {kind} weight must be {want}, got {got}")
    shape = _micro_scale_shape(kind, N, K)
    if tuple(scale.shape) != shape:
        raise ValueError(f"{name} of a {kind} weight [{N}, {K}] must have shape {list(shape)} (one per "
                         f"{MXFP8_BLOCK if kind == 'mxfp8' else NVFP4_BLOCK} weights of a row), got "
                         f"{list(scale.shape)}")


def e4m3_nan(bits: torch.Tensor) -> torch.Tensor:
    """Where e4m3 bytes (as uint8) are NaN (0x7f, 0xff)."""
    return (bits & 0x7F) == 0x7F


def check_micro_scale_values(scale: torch.Tensor, name: str = "scale") -> None:
    """Refuses a microscaled scale holding NaN (e8m0 0xFF; e4m3 0x7F / 0xFF) or negative e4m3 values (-0 allowed):
    no quantizer writes them, and each would turn its block's outputs NaN or flip their sign, silently. One read of
    the scale's bytes (a host sync on a GPU): for loading and constructing a layer, not for every call."""
    bits = scale.detach().view(torch.uint8)
    kind = "mxfp8" if scale.dtype == E8M0 else "nvfp4"
    bad = (bits == 255) if kind == "mxfp8" else e4m3_nan(bits) | ((bits & 0x80) != 0) & (bits != 0x80)
    n = int(bad.sum())
    if n:
        raise ValueError(f"{name}: {n} of {bits.numel()} {kind} scale values are NaN or negative (first at "
                         f"{bad.nonzero()[0].tolist()})")


def check_global_scale(g, name: str) -> None:
    if not isinstance(g, torch.Tensor) or g.dtype != torch.float32 or g.numel() != 1:
        got = f"{g.dtype} {list(g.shape)}" if isinstance(g, torch.Tensor) else type(g).__name__
        raise TypeError(f"{name} of an NVFP4 weight must be one fp32 value (ModelOpt's weight_scale_2), got {got}")


def dequantize_weight(w8, scale, dtype=torch.float32, *, block_size: int = DEFAULT_BLOCK,
                      global_scale=None) -> torch.Tensor:
    """W0 as a dense tensor of `dtype` for every kind (materializes the whole weight: for checking and export)."""
    N, K, scale = check_weight(w8, scale, block_size, global_scale)
    return w0_rows(w8, scale, block_size, 0, N, global_scale).to(dtype)


def quantize_mxfp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w8 e4m3 [N, K], scale e8m0 [N, ceil(K/32)]) by ModelOpt's MXFP8 recipe (MXFP8QTensor): the block's scale is
    2^ceil(log2(amax / 448)), the smallest power of two that saturates no value (all-zero block: 2^-127), values
    w / scale rounded to e4m3. Unlike the OCP spec's example 2^(floor(log2 amax) - 8), which clips the values above
    448 times it (up to 12.5% of a block's largest), it re-quantizes an MXFP8 weight of either recipe to the same
    values: a merge that changes nothing keeps the base exactly. Used by the merge, and by tests and fixtures."""
    N, K = weight.shape
    pad = -K % MXFP8_BLOCK
    w = torch.nn.functional.pad(weight.detach().float(), (0, pad)).reshape(N, -1, MXFP8_BLOCK)
    d = w.abs().amax(-1) / E4M3_MAX
    exp = torch.where(d > 0, torch.log2(d), torch.full_like(d, -127)).ceil_().clamp_(-127, 127)
    scale = (exp + 127).to(torch.uint8).view(E8M0)
    q = to_e4m3(w, e8m0_values(scale)[..., None])
    return q.reshape(N, -1)[:, :K].contiguous(), scale


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """ModelOpt's NVFP4 global scale (weight_scale_2) for amax: amax / (6 * 448); 1 for an all-zero tensor."""
    amax = amax.float()
    return torch.where(amax > 0, amax / (E2M1_MAX * E4M3_MAX), torch.ones_like(amax))


def quantize_nvfp4(weight: torch.Tensor, global_scale: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 [N, K/2], scale e4m3 [N, K/16], global_scale fp32 []) by ModelOpt's NVFP4 recipe: global = amax /
    (6 * 448), block scale = e4m3(block amax / (6 * global)) (1 for an all-zero block; clamped to [2^-9, 448] first,
    as ModelOpt's _cast_per_block_scale_to_fp8 does: a block whose scale falls under e4m3's range keeps its larger
    values instead of getting scale 0, which zeroes it), values w / (scale * global) rounded to the nearest e2m1
    (ties to even), packed low nibble first; K a multiple of 16. global_scale: the whole tensor's
    (nvfp4_global_scale), for rows quantized a block at a time (the merge)."""
    N, K = weight.shape
    if K % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 needs in_features a multiple of {NVFP4_BLOCK}, got {K}")
    w = weight.detach().float().reshape(N, -1, NVFP4_BLOCK)
    g = nvfp4_global_scale(w.abs().amax()) if global_scale is None else global_scale.float().reshape(())
    s = w.abs().amax(-1) / (E2M1_MAX * g)
    s = torch.where(s == 0, torch.ones_like(s), s).clamp_(NVFP4_MIN_SCALE, E4M3_MAX).to(E4M3)
    x = (w / (s.float() * g)[..., None]).reshape(N, K)
    mags = torch.tensor(E2M1_VALUES[:8], device=w.device)
    mag = x.abs().clamp_(max=E2M1_MAX)
    # nearest magnitude, ties to the even code (round-to-nearest-even on the e2m1 grid)
    d = (mag[..., None] - mags).abs()
    near = d == d.amin(-1, keepdim=True)
    idx = torch.where(near.sum(-1) > 1, (near.int().argmax(-1) + 1) // 2 * 2, near.int().argmax(-1))
    codes = (idx | (torch.signbit(x).int() << 3)).to(torch.uint8)
    return (codes[:, 1::2] << 4) | codes[:, 0::2], s, g.reshape(())
