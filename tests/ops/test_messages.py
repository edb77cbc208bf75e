"""Errors a newcomer meets first name the argument and the expected value."""

import pytest
import torch

import dorafp8


def _problem(N=16, K=32, r=8):
    w8, scale = dorafp8.quantize_e4m3(torch.randn(N, K) * 0.05)
    return torch.randn(3, K), w8, scale, torch.randn(r, K) * 0.1, torch.randn(N, r) * 0.1, torch.ones(N)


def test_transposed_lora_A_names_the_real_rank():
    x, w8, scale, A, B, m = _problem()
    with pytest.raises(ValueError, match=r"lora_A must have shape \[8, 32\], got \[32, 8\]"):
        dorafp8.dora_fp8_linear(x, w8, scale, A.T, B, m, 0.5)
    with pytest.raises(ValueError, match=r"lora_A must have shape \[8, 32\], got \[32, 8\]"):
        dorafp8.weight_norm(w8, scale, A.T, B, 0.5)
