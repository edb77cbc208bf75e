"""FP8Linear: a frozen linear layer whose weight is held in FP8 e4m3 with an fp32 scale, and quantize_model."""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from .backends import check_backend_name
from .distributed import recover_fp8_weight
from .ops import fp8_linear
from .quant import E4M3, check_scale, dequantize_e4m3, quantize_e4m3


def _conv1d_cls():
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return None
    return Conv1D


class FP8Linear(nn.Module):
    """y = x (scale * weight)^T + bias, weight float8_e4m3fn [out_features, in_features], frozen.

    state_dict keys: `weight` (fp8 bytes), `scale` (fp32, [] per tensor or [out_features] per row), `bias`.
    Casting the module (`.to(torch.bfloat16)`, `.half()`) moves it but keeps the fp8 weight and fp32 scale.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, device=None,
                 dtype: torch.dtype = torch.float32, per_row_scale: bool = False, backend: str = "auto"):
        super().__init__()
        # The dtype the weight had before quantization: the bias keeps it, and PEFT creates adapters in it.
        self.orig_dtype = dtype
        self.in_features = in_features
        self.out_features = out_features
        self.backend = check_backend_name(backend)
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=E4M3, device=device),
                                   requires_grad=False)
        scale_shape = (out_features,) if per_row_scale else ()
        self.register_buffer("scale", torch.ones(scale_shape, dtype=torch.float32, device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_float(cls, module: nn.Module, *, per_row_scale: bool = False, backend: str = "auto") -> "FP8Linear":
        """Quantizes an nn.Linear (or transformers' Conv1D, whose weight is [in, out]) into an FP8Linear."""
        conv1d = _conv1d_cls()
        if isinstance(module, nn.Linear):
            weight = module.weight
        elif conv1d is not None and isinstance(module, conv1d):
            weight = module.weight.T  # Conv1D stores [in_features, out_features]: transpose once, here
        else:
            raise TypeError(f"module must be an nn.Linear or transformers Conv1D, got {type(module).__name__}")
        out_features, in_features = weight.shape
        bias = module.bias
        new = cls(in_features, out_features, bias=bias is not None, device="meta", dtype=weight.dtype,
                  per_row_scale=per_row_scale, backend=backend)
        w8, scale = quantize_e4m3(weight.detach(), per_row=per_row_scale)
        new.weight = nn.Parameter(w8, requires_grad=False)
        new.scale = scale
        if bias is not None:
            new.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)  # its own dtype, as in nn.Linear
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.fp8_weight(), self.scale, self.bias, backend=self.backend)

    def fp8_weight(self) -> torch.Tensor:
        """The weight for the kernels: `weight`, or, where FSDP's MixedPrecisionPolicy(param_dtype=...) handed the
        forward an unsharded weight cast to that dtype, that weight cast back to fp8 (exact; dorafp8/distributed.py)."""
        w = self.weight
        return w if w.dtype == E4M3 else recover_fp8_weight(self, w)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight scale * w8 [out, in] (for export and checking; materializes the whole weight)."""
        return dequantize_e4m3(self.weight, self.scale, dtype)

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

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        w = state_dict.get(prefix + "weight")
        if w is not None and w.dtype != E4M3:
            error_msgs.append(f"{prefix}weight: FP8Linear expects a float8_e4m3fn weight with its '{prefix}scale', "
                              f"got {w.dtype}; quantize it with dorafp8.quantize_e4m3 (or load it into nn.Linear "
                              f"and use FP8Linear.from_float)")
            return
        sc = state_dict.get(prefix + "scale")
        if sc is not None:
            try:
                check_scale(sc, self.out_features, name=prefix + "scale")
            except (TypeError, ValueError) as e:
                error_msgs.append(str(e))
                return
            if sc.shape != self.scale.shape:  # per-row vs per-tensor: take the checkpoint's layout
                self.scale = torch.empty(sc.shape, dtype=torch.float32, device=self.scale.device)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        kind = "per-row" if self.scale.dim() == 1 else "per-tensor"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weight=float8_e4m3fn, scale={kind}, backend={self.backend}")


def quantize_model(model: nn.Module, target_modules: Optional[Iterable[str]] = None, *,
                   per_row_scale: bool = False, backend: str = "auto") -> int:
    """Replaces nn.Linear (and transformers' Conv1D) layers of `model` by FP8Linear, in place.

    target_modules: names (or name suffixes, like PEFT's target_modules) of the layers to quantize; None quantizes
    every nn.Linear/Conv1D except those named like an output head (`lm_head`). Returns how many were swapped.
    """
    conv1d = _conv1d_cls()
    kinds = (nn.Linear,) + ((conv1d,) if conv1d is not None else ())
    targets = None if target_modules is None else (
        [target_modules] if isinstance(target_modules, str) else list(target_modules))
    swaps = []
    for name, mod in model.named_modules():
        if not isinstance(mod, kinds):
            continue
        if targets is None:
            if name.split(".")[-1] == "lm_head":
                continue
        elif not any(name == t or name.endswith("." + t) for t in targets):
            continue
        swaps.append(name)
    for name in swaps:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, FP8Linear.from_float(getattr(parent, child), per_row_scale=per_row_scale,
                                                    backend=backend))
    return len(swaps)
