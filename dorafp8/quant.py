"""The FP8 e4m3 recipe (docs/DORA_MATH.md, "FP8 recipe"), interoperable with fp8 checkpoints of OneTrainer, ComfyUI and
compressed-tensors: one fp32 scale per tensor, sigma = amax|W| / 448, W8 = clamp(W / sigma) rounded to nearest even."""

from __future__ import annotations

import warnings

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448.0

# Rows quantized per block, so that the fp32 temporaries stay small for large weights.
_QUANT_BLOCK_ELEMS = 4 * 1024 * 1024


class QuantizationWarning(UserWarning):
    """Per-tensor fp8 quantization lost much more than e4m3's usual ~2.6% (an outlier weight or a tiny row)."""


# When quantize_e4m3 warns. e4m3 keeps 3 mantissa bits: on Gaussian, uniform, Laplace or Student-t weights the
# relative Frobenius error is 2.4-2.7% and well under 0.1% of the non-zero weights underflow to zero. A per-tensor
# scale set by one outlier (1e4 among weights of 0.02) flushes most of the tensor to zero instead.
LOSSY_FLUSHED_FRACTION = 0.01   # more than 1% of the non-zero weights became 0
LOSSY_REL_ERROR = 0.05          # relative Frobenius error above 5% (twice e4m3's usual)


def quantize_e4m3(weight: torch.Tensor, *, per_row: bool = False,
                  name: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes a float weight [N, K] to (w8 float8_e4m3fn [N, K], scale fp32).

    scale is a 0-dim tensor (per-tensor, the default) or [N] with per_row=True. An all-zero tensor (or row) gets
    scale 1. Non-finite values are a ValueError: they would silently become NaN or saturate. A per-tensor
    quantization that loses much more than usual (see LOSSY_*) emits a QuantizationWarning naming per_row=True.
    `name` (e.g. the module's name) is used in those messages.
    """
    what = f"weight of {name!r}" if name else "weight"
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dtype == E4M3:
        raise TypeError(f"{what} must be a floating-point tensor (not fp8), got "
                        f"{weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"{what} must be 2-D [out_features, in_features], got shape {tuple(weight.shape)}")
    if weight.numel() == 0:
        raise ValueError(f"{what} must not be empty, got shape {tuple(weight.shape)}")
    N, K = weight.shape
    rows = max(1, _QUANT_BLOCK_ELEMS // K)
    amax = torch.empty(N, dtype=torch.float32, device=weight.device)
    for j0 in range(0, N, rows):
        amax[j0:j0 + rows] = weight[j0:j0 + rows].detach().abs().amax(dim=1).float()
    if not torch.isfinite(amax).all():
        bad = (~torch.isfinite(amax)).nonzero()[0].item()
        raise ValueError(f"{what} has non-finite values (first in row {bad}); refusing to quantize them to fp8")
    if not per_row:
        amax = amax.amax()
    scale = amax / E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    w8 = torch.empty(N, K, dtype=E4M3, device=weight.device)
    # Loss statistics, accumulated on the blocks as they are quantized: [non-zero, flushed to 0, sum err^2, sum w^2]
    stats = torch.zeros(4, dtype=torch.float64, device=weight.device)
    lost_rows = torch.zeros((), dtype=torch.int64, device=weight.device)
    for j0 in range(0, N, rows):
        s = scale if not per_row else scale[j0:j0 + rows, None]
        blk = weight[j0:j0 + rows].detach().float()
        q = (blk / s).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
        w8[j0:j0 + rows] = q
        if not per_row:
            back = q.float() * s
            nz = blk != 0
            flushed = nz & (back == 0)
            stats += torch.stack([nz.sum(), flushed.sum(), (back - blk).double().square().sum(),
                                  blk.double().square().sum()]).to(stats.dtype)
            lost_rows += (nz.any(1) & ~(back != 0).any(1)).sum()
    if not per_row:
        _warn_if_lossy(stats.tolist(), int(lost_rows), what)
    return w8, scale


def _warn_if_lossy(stats, lost_rows: int, what: str) -> None:
    nonzero, flushed, err2, ref2 = stats
    frac = flushed / max(nonzero, 1.0)
    rel = (err2 / ref2) ** 0.5 if ref2 > 0 else 0.0
    if frac > LOSSY_FLUSHED_FRACTION or rel > LOSSY_REL_ERROR or lost_rows:
        warnings.warn(
            f"per-tensor fp8 quantization of the {what} is lossy: {100 * frac:.1f}% of its non-zero values became 0, "
            f"relative error {100 * rel:.1f}% (e4m3 usually gives ~2.6%), {lost_rows} non-zero rows became all-zero; "
            f"a few large values set the single scale. Quantize it per row instead: per_row_scale=True "
            f"(quantize_model / FP8Linear.from_float) or per_row=True (quantize_e4m3)",
            QuantizationWarning, stacklevel=3)


def dequantize_e4m3(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """scale * w8 as a dense tensor of `dtype` (computed in fp32). Materializes the whole weight: for checking and
    for exporting, not for the training path."""
    check_fp8_weight(w8)
    scale = check_scale(scale, w8.shape[0])
    s = scale if scale.dim() == 0 else scale[:, None]
    return (w8.float() * s).to(dtype)


def check_fp8_weight(w8: torch.Tensor, name: str = "w8") -> None:
    if not isinstance(w8, torch.Tensor) or w8.dtype != E4M3:
        got = w8.dtype if isinstance(w8, torch.Tensor) else type(w8).__name__
        raise TypeError(f"{name} must be a torch.float8_e4m3fn tensor (see dorafp8.quantize_e4m3), got {got}")
    if w8.dim() != 2:
        raise ValueError(f"{name} must be 2-D [out_features, in_features], got shape {tuple(w8.shape)}")


def check_scale(scale, n_rows: int, name: str = "scale") -> torch.Tensor:
    """Returns scale as fp32, 0-dim (per tensor) or [n_rows] (per row)."""
    if not isinstance(scale, torch.Tensor) or not scale.is_floating_point() or scale.dtype == E4M3:
        got = scale.dtype if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise TypeError(f"{name} must be a floating-point tensor (fp32 expected), got {got}")
    if scale.numel() == 1:
        return scale.reshape(()).float()
    if scale.dim() == 1 and scale.shape[0] == n_rows:
        return scale.float()
    raise ValueError(f"{name} must have one element (per tensor) or shape [{n_rows}] (per row), "
                     f"got shape {tuple(scale.shape)}")
