"""The nn.Module plumbing every dorafp8 fp8 layer (FP8Linear, FP8Conv1d/2d/3d) shares: a frozen float8_e4m3fn
`weight` parameter and an fp32 `scale` buffer that keep their storage dtypes."""

from __future__ import annotations

import torch
from torch import nn

from .distributed import recover_fp8_weight
from .quant import E4M3


class FP8WeightModule(nn.Module):
    def fp8_weight(self) -> torch.Tensor:
        """The weight for the kernels: `weight`, or, where FSDP's MixedPrecisionPolicy(param_dtype=...) handed the
        forward an unsharded weight cast to that dtype, that weight cast back to fp8 (exact; dorafp8/distributed.py)."""
        w = self.weight
        return w if w.dtype == E4M3 else recover_fp8_weight(self, w)

    def _apply(self, fn, recurse=True):
        # nn.Module.to(dtype)/.half() treat fp8 as floating point and would cast the weight and the scale. The fp8
        # round trip through a wider float is exact, but a scale cast to bf16/fp16 is not: put back the storage
        # dtypes, taking the scale from the original.
        scale = self.scale
        super()._apply(fn, recurse)
        if self.weight.dtype != E4M3:
            self.weight = nn.Parameter(self.weight.data.to(E4M3), requires_grad=False)
        if self.scale.dtype != torch.float32:
            self.scale = scale.to(self.scale.device)
        return self
