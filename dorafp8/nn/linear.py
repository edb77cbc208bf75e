"""FP8Linear: a frozen linear layer whose weight is held in FP8 e4m3 with an fp32 scale, and quantize_model."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..backends import check_backend_name
from ..ops import fp8_linear
from ..quant import check_act_quant
from ..quant import (DEFAULT_BLOCK, MICRO_KINDS, check_block_size, check_micro_scale_values, check_weight,
                     dequantize_weight, quantize_e4m3, scale_kind, weight_dims)
from ._base import FP8WeightModule, fp8_cast_parts, peft_unregistered_hint
from .torchao_fp8 import is_torchao_tensor, torchao_fp8_parts


def conv1d_class():
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return None
    return Conv1D


class FP8Linear(FP8WeightModule):
    """y = x (scale * weight)^T + bias, weight float8_e4m3fn [out_features, in_features], frozen.

    state_dict keys: `weight` (fp8 bytes), `scale` (fp32: [] per tensor, [out_features] per row, or
    [ceil(out/b), ceil(in/b)] per b x b block with b = `block_size`), `bias`.
    Casting the module (`.to(torch.bfloat16)`, `.half()`) moves it but keeps the fp8 weight and fp32 scale.
    It holds a microscaled weight the same way (from_fp8, or loaded from a checkpoint): MXFP8 (`weight` e4m3, `scale`
    e8m0 [out, ceil(in/32)]) or NVFP4 (`weight` uint8 [out, in/2] packed, `scale` e4m3 [out, in/16], `global_scale`
    fp32 []), dorafp8/quant.py's "Microscaled weights"; `global_scale` is None for every other kind.

    Args:
        in_features, out_features, bias: as nn.Linear's (the weight starts at zeros: from_float / from_fp8 fill it).
        device: where the tensors are made.
        dtype: the dtype the weight had before quantization: the bias keeps it, and PEFT creates adapters in it.
        per_row_scale: one scale per output row; block_size: one per b x b block; neither: one per tensor.
        backend: the kernels ("auto" by default).
        act_quant: None (the default, W8A16) or "rowwise": base GEMMs W8A8, activations quantized per row to e4m3
            (docs/DORA_MATH.md).

    Raises:
        ValueError: an unknown backend or act_quant, or a block size it cannot use.
    """

    block_size = DEFAULT_BLOCK  # class defaults: modules pickled before these attributes existed still load
    _act_quant = None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, device=None,
                 dtype: torch.dtype = torch.float32, per_row_scale: bool = False, block_size: Optional[int] = None,
                 backend: str = "auto", act_quant: Optional[str] = None):
        super().__init__()
        # The dtype the weight had before quantization: the bias keeps it, and PEFT creates adapters in it.
        self.orig_dtype = dtype
        self.in_features = in_features
        self.out_features = out_features
        self.backend = check_backend_name(backend)
        self.act_quant = act_quant
        self.block_size = check_block_size(block_size or DEFAULT_BLOCK)
        self._init_fp8_storage((out_features, in_features), in_features, bias, dtype, device, per_row_scale,
                               block_size)
        self.register_buffer("global_scale", None)  # NVFP4's; None (and not in the state_dict) for every other kind

    def __setstate__(self, state):
        super().__setstate__(state)
        self._buffers.setdefault("global_scale", None)  # a module pickled before NVFP4 layers existed

    @property
    def act_quant(self) -> Optional[str]:
        return self._act_quant

    @act_quant.setter
    def act_quant(self, mode: Optional[str]) -> None:
        self._act_quant = check_act_quant(mode) or None

    @classmethod
    def from_float(cls, module: nn.Module, *, per_row_scale: bool = False, block_size: Optional[int] = None,
                   backend: str = "auto", act_quant: Optional[str] = None, name: str | None = None) -> "FP8Linear":
        """Quantizes an nn.Linear (or transformers' Conv1D, weight [in, out]) into an FP8Linear with one scale per
        tensor (default), per row (per_row_scale=True) or per block_size x block_size block. A float8_e4m3fn weight is
        kept byte for byte with scale 1 (fp8_cast_parts); a torchao Float8Tensor keeps its bytes and scales
        (torchao_fp8.py), per_row_scale and block_size then not applying. `name` is used in messages."""
        conv1d = conv1d_class()
        if isinstance(module, nn.Linear):
            weight = module.weight
        elif conv1d is not None and isinstance(module, conv1d):
            weight = module.weight.T  # Conv1D stores [in_features, out_features]: transpose once, here
        else:
            raise TypeError(f"module must be an nn.Linear or transformers Conv1D, got {type(module).__name__}")
        bias = module.bias
        if is_torchao_tensor(weight):  # torchao's Float8Tensor: its own bytes and scales (torchao_fp8.py)
            w8, scale, tao_block = torchao_fp8_parts(weight, name)
            return cls.from_fp8(w8, scale, None if bias is None else bias.detach().clone(), backend=backend,
                                dtype=weight.dtype, block_size=tao_block, act_quant=act_quant)
        cast = fp8_cast_parts(module, weight, name)
        if cast is not None:
            w8, bias, dtype = cast
            return cls.from_fp8(w8, torch.ones((), device=w8.device), bias, backend=backend, dtype=dtype,
                                act_quant=act_quant)
        if weight.is_meta:
            # No values: a rank other than 0 under accelerate's cpu_ram_efficient_loading, whose model transformers
            # leaves on the meta device; FSDP2's loader then sends rank 0's weight and scale (same shapes) here.
            return cls(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta", dtype=weight.dtype,
                       per_row_scale=per_row_scale, block_size=block_size, backend=backend, act_quant=act_quant)
        w8, scale = quantize_e4m3(weight.detach(), per_row=per_row_scale, block_size=block_size, name=name)
        return cls.from_fp8(w8, scale, None if bias is None else bias.detach().clone(), backend=backend,
                            dtype=weight.dtype, block_size=block_size, act_quant=act_quant)

    @classmethod
    def from_fp8(cls, w8: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                 backend: str = "auto", dtype: Optional[torch.dtype] = None, block_size: Optional[int] = None,
                 act_quant: Optional[str] = None, global_scale: Optional[torch.Tensor] = None) -> "FP8Linear":
        """An FP8Linear holding `w8` (float8_e4m3fn [out, in], kept as is) and its fp32 `scale` ([], [out], [out, 1] or
        [ceil(out/b), ceil(in/b)], b = block_size, default 128); or a microscaled weight (MXFP8: scale e8m0 [out,
        ceil(in/32)]; NVFP4: w8 uint8 [out, in/2], scale e4m3 [out, in/16], global_scale fp32). `dtype`: the weight's
        original precision, for PEFT's adapters (default: the bias's dtype, else float32)."""
        block_size = block_size or DEFAULT_BLOCK
        out_features, in_features, scale = check_weight(w8, scale, block_size, global_scale)
        if global_scale is not None and not (bool(torch.isfinite(global_scale).all()) and float(global_scale) > 0):
            # checked once here, not on every call (a host sync): a NaN or inf one would make every output NaN
            raise ValueError(f"global_scale must be a finite positive fp32 value, got {float(global_scale)!r}")
        if scale_kind(scale) in MICRO_KINDS and not scale.is_meta:
            check_micro_scale_values(scale)  # the same once-only check, for the microscaled kinds' block scales
        dtype = dtype or (bias.dtype if bias is not None else torch.float32)
        new = cls(in_features, out_features, bias=bias is not None, device="meta", dtype=dtype,
                  block_size=block_size, backend=backend, act_quant=act_quant)
        new.weight = nn.Parameter(w8, requires_grad=False)
        new.scale = scale.to(w8.device)
        new.global_scale = None if global_scale is None else global_scale.reshape(()).to(w8.device)
        if bias is not None:
            new.bias = nn.Parameter(bias, requires_grad=False)  # its own dtype, as in nn.Linear
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.fp8_weight(), self.scale, self.bias, backend=self.backend,
                          block_size=self.block_size, act_quant=self.act_quant, global_scale=self.global_scale)

    _float_weight_hint = ("quantize it with dorafp8.quantize_e4m3 (or load it into nn.Linear and use "
                          "FP8Linear.from_float)")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight W0 [out, in] (for export and checking; materializes the whole weight)."""
        return dequantize_weight(self.weight, self.scale, dtype, block_size=self.block_size,
                                 global_scale=self.global_scale)

    def extra_repr(self) -> str:
        kind = {"tensor": "per-tensor", "row": "per-row", "block": f"per-{self.block_size}x{self.block_size}-block",
                "mxfp8": "e8m0-per-32 (MXFP8)", "nvfp4": "e4m3-per-16 x global (NVFP4)"}
        weight = "uint8 (packed e2m1)" if self.weight.dtype == torch.uint8 else "float8_e4m3fn"
        quant = f", act_quant={self.act_quant}" if self.act_quant else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weight={weight}, scale={kind[scale_kind(self.scale)]}{quant}, backend={self.backend}"
                f"{peft_unregistered_hint()}")
