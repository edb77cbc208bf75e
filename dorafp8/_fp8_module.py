"""The nn.Module plumbing every dorafp8 fp8 layer (FP8Linear, FP8Conv1d/2d/3d) shares: a frozen float8_e4m3fn
`weight` parameter and an fp32 `scale` buffer that keep their storage dtypes."""

from __future__ import annotations

import math

import torch
from torch import nn

from .distributed import recover_fp8_weight
from .quant import E4M3, check_scale


class FP8WeightModule(nn.Module):
    def _init_fp8_storage(self, weight_shape: tuple, K: int, bias: bool, dtype: torch.dtype, device,
                          per_row_scale: bool, block_size) -> None:
        """Zero `weight` (e4m3, `weight_shape`, K columns in its 2-D view), a ones `scale` of the requested granularity
        (per tensor, per output row, or per block_size x block_size block of the view) and an optional bias."""
        N = weight_shape[0]
        self.weight = nn.Parameter(torch.zeros(weight_shape, dtype=E4M3, device=device), requires_grad=False)
        if per_row_scale:
            scale_shape = (N,)
        elif block_size is not None:
            scale_shape = (-(-N // block_size), -(-K // block_size))
        else:
            scale_shape = ()
        self.register_buffer("scale", torch.ones(scale_shape, dtype=torch.float32, device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(N, dtype=dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

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

    # ---- loading ---------------------------------------------------------------------------------------------------

    _float_weight_hint: str  # what to do with a float weight in a state_dict (the load error says it)

    def _check_loaded_scale(self, scale, name: str) -> torch.Tensor:
        """A state_dict's scale, checked against this weight's 2-D view and normalized ([N, 1] -> [N], [1] -> [])."""
        w = self.weight
        return check_scale(scale, w.shape[0], math.prod(w.shape[1:]), self.block_size, name=name)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        w = state_dict.get(prefix + "weight")
        if w is not None and w.dtype != E4M3:
            error_msgs.append(f"{prefix}weight: {type(self).__name__} expects a float8_e4m3fn weight with its "
                              f"'{prefix}scale', got {w.dtype}; {self._float_weight_hint}")
            return
        sc = state_dict.get(prefix + "scale")
        if sc is not None:
            try:
                sc = self._check_loaded_scale(sc, prefix + "scale")
            except (TypeError, ValueError) as e:
                error_msgs.append(str(e))
                return
            state_dict[prefix + "scale"] = sc
            if sc.shape != self.scale.shape:  # per-tensor / per-row / per-block: take the checkpoint's layout
                self.scale = torch.empty(sc.shape, dtype=torch.float32, device=self.scale.device)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
