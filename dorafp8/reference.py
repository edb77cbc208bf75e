"""Reference backend: the backend contract (see dorafp8/backends.py) in plain PyTorch.

It is the twin every kernel is tested against and the backend that runs on CPU. It computes in fp32 and never
holds a dequantized copy of the whole weight: the fp8 weight is walked in blocks of rows, each block dequantized
into a temporary of at most `_BLOCK_BYTES`, so the peak extra memory is a few such blocks whatever N x K is.
"""

from __future__ import annotations

import torch

# Size of one dequantized fp32 block of weight rows. Three such temporaries are alive at once at most.
_BLOCK_BYTES = 16 * 1024 * 1024


def unavailable_reason(device: torch.device) -> str | None:
    return None  # runs wherever PyTorch runs


def _row_blocks(n_rows: int, k: int):
    rows = max(1, _BLOCK_BYTES // (4 * max(k, 1)))
    for j0 in range(0, n_rows, rows):
        yield j0, min(n_rows, j0 + rows)


def _scale_rows(scale: torch.Tensor, j0: int, j1: int) -> torch.Tensor:
    """The fp32 scale of rows j0:j1 as a column [j1 - j0, 1] (or a [1, 1] per-tensor scale)."""
    scale = scale.reshape(-1).float()
    return (scale if scale.numel() == 1 else scale[j0:j1]).reshape(-1, 1)


def weight_norm(w8, scale, A, B, s):
    N, K = w8.shape
    A32 = A.float()
    n = torch.empty(N, dtype=torch.float32, device=w8.device)
    for j0, j1 in _row_blocks(N, K):
        v = w8[j0:j1].float()
        v.mul_(_scale_rows(scale, j0, j1))
        v.addmm_(B[j0:j1].float(), A32, alpha=s)
        n[j0:j1] = torch.linalg.vector_norm(v, dim=1)
        del v
    return n


def _base_gemm(x32: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x32 @ (scale * w8)^T in fp32, dequantizing one block of rows at a time."""
    M = x32.shape[0]
    N, K = w8.shape
    out = torch.empty(M, N, dtype=torch.float32, device=x32.device)
    for j0, j1 in _row_blocks(N, K):
        out[:, j0:j1] = x32 @ w8[j0:j1].float().T
        out[:, j0:j1] *= _scale_rows(scale, j0, j1).reshape(1, -1)
    return out


def forward(x, w8, scale, bias, c, u, B, s, xd, need_z):
    cdt = x.dtype
    base = _base_gemm(x.float(), w8, scale)
    if c is None:
        if bias is not None:
            base += bias.float()
        return base.to(cdt), None
    lora = s * (u.float() @ B.float().T)
    if xd is None:
        z = base.add_(lora)
        y = z * c
    else:
        z = _base_gemm(xd.float(), w8, scale).add_(lora)
        # x W0^T + (c - 1) * (xd W0^T) + c * s u B^T  ==  x W0^T + c * z - (xd W0^T)  ==  base + c*z - (z - lora)
        y = base + (c - 1) * z + lora
    if bias is not None:
        y += bias.float()
    return y.to(cdt), (z.to(cdt) if need_z else None)


def _dgrad_gemm(g32: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """g32 @ (scale * w8) in fp32, one block of weight rows (= one slice of the reduction) at a time."""
    M = g32.shape[0]
    N, K = w8.shape
    out = torch.zeros(M, K, dtype=torch.float32, device=g32.device)
    for j0, j1 in _row_blocks(N, K):
        gs = g32[:, j0:j1] * _scale_rows(scale, j0, j1).reshape(1, -1)
        out.addmm_(gs, w8[j0:j1].float())
    return out


def dgrad(g, w8, scale, c, v, A, s, mask, p):
    cdt = g.dtype
    g32 = g.float()
    if c is None:
        return _dgrad_gemm(g32, w8, scale).to(cdt)
    lora = s * (v.float() @ A.float())
    if mask is None:
        dx = _dgrad_gemm(g32 * c, w8, scale).add_(lora)
    else:
        inner = _dgrad_gemm(g32 * (c - 1), w8, scale).add_(lora)
        dx = _dgrad_gemm(g32, w8, scale).add_(inner * mask * (1.0 / (1.0 - p)))
    return dx.to(cdt)
