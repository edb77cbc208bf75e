"""FP8Linear: a frozen linear layer whose weight is held in FP8 e4m3 with an fp32 scale, and quantize_model."""

from __future__ import annotations

import sys
import warnings
from typing import Iterable, Optional

import torch
from torch import nn

from .backends import check_backend_name
from ._fp8_module import FP8WeightModule, fp8_cast_parts
from .distributed import is_fp8
from .fp8_conv import fp8_conv_class
from .ops import check_act_quant, fp8_linear
from .quant import (DEFAULT_BLOCK, check_block_size, check_fp8_weight, check_scale, dequantize_e4m3,
                    quantize_e4m3, scale_kind)


def _conv1d_cls():
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
    `act_quant = "rowwise"` runs its base GEMMs W8A8 (activations quantized per row to e4m3; see docs/DORA_MATH.md),
    `None` (the default) W8A16. `backend` picks the kernels ("auto" by default).
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

    @property
    def act_quant(self) -> Optional[str]:
        return self._act_quant

    @act_quant.setter
    def act_quant(self, mode: Optional[str]) -> None:
        self._act_quant = check_act_quant(mode) or None

    @classmethod
    def from_float(cls, module: nn.Module, *, per_row_scale: bool = False, block_size: Optional[int] = None,
                   backend: str = "auto", act_quant: Optional[str] = None, name: str | None = None) -> "FP8Linear":
        """Quantizes an nn.Linear (or transformers' Conv1D, whose weight is [in, out]) into an FP8Linear, with one
        scale per tensor (default), per row (per_row_scale=True) or per block_size x block_size block.

        A weight that is already float8_e4m3fn (diffusers' layerwise casting, a model cast to fp8 as OneTrainer and
        others store it) is kept byte for byte with scale 1: re-quantizing it would move it. Its bias and the adapter
        dtype are then the layer's compute dtype (dorafp8._fp8_module.fp8_cast_parts). `name` is used in warnings and
        errors.
        """
        conv1d = _conv1d_cls()
        if isinstance(module, nn.Linear):
            weight = module.weight
        elif conv1d is not None and isinstance(module, conv1d):
            weight = module.weight.T  # Conv1D stores [in_features, out_features]: transpose once, here
        else:
            raise TypeError(f"module must be an nn.Linear or transformers Conv1D, got {type(module).__name__}")
        bias = module.bias
        cast = fp8_cast_parts(module, weight, name)
        if cast is not None:
            w8, bias, dtype = cast
            return cls.from_fp8(w8, torch.ones((), device=w8.device), bias, backend=backend, dtype=dtype,
                                act_quant=act_quant)
        w8, scale = quantize_e4m3(weight.detach(), per_row=per_row_scale, block_size=block_size, name=name)
        return cls.from_fp8(w8, scale, None if bias is None else bias.detach().clone(), backend=backend,
                            dtype=weight.dtype, block_size=block_size, act_quant=act_quant)

    @classmethod
    def from_fp8(cls, w8: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                 backend: str = "auto", dtype: Optional[torch.dtype] = None, block_size: Optional[int] = None,
                 act_quant: Optional[str] = None) -> "FP8Linear":
        """An FP8Linear holding `w8` (float8_e4m3fn [out, in], kept as is) and its fp32 `scale` ([], [out], [out, 1]
        or [ceil(out/b), ceil(in/b)] with b = block_size, default 128). `dtype`: the weight's original precision,
        used for the adapters PEFT creates on this layer (default: the bias's dtype, else float32)."""
        check_fp8_weight(w8, "w8")
        out_features, in_features = w8.shape
        block = block_size or DEFAULT_BLOCK
        scale = check_scale(scale, out_features, in_features, block)
        dtype = dtype or (bias.dtype if bias is not None else torch.float32)
        new = cls(in_features, out_features, bias=bias is not None, device="meta", dtype=dtype,
                  block_size=block, backend=backend, act_quant=act_quant)
        new.weight = nn.Parameter(w8, requires_grad=False)
        new.scale = scale.to(w8.device)
        if bias is not None:
            new.bias = nn.Parameter(bias, requires_grad=False)  # its own dtype, as in nn.Linear
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.fp8_weight(), self.scale, self.bias, backend=self.backend,
                          block_size=self.block_size, act_quant=self.act_quant)

    _float_weight_hint = ("quantize it with dorafp8.quantize_e4m3 (or load it into nn.Linear and use "
                          "FP8Linear.from_float)")

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight scale * w8 [out, in] (for export and checking; materializes the whole weight)."""
        return dequantize_e4m3(self.weight, self.scale, dtype, block_size=self.block_size)

    def extra_repr(self) -> str:
        kind = {"tensor": "per-tensor", "row": "per-row", "block": f"per-{self.block_size}x{self.block_size}-block"}
        quant = f", act_quant={self.act_quant}" if self.act_quant else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weight=float8_e4m3fn, scale={kind[scale_kind(self.scale)]}{quant}, backend={self.backend}")


_CONV_KINDS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _linear_kinds() -> tuple:
    conv1d = _conv1d_cls()
    return (nn.Linear,) + ((conv1d,) if conv1d is not None else ())


def to_fp8_layer(module: nn.Module, *, per_row_scale: bool = False, block_size: Optional[int] = None,
                 backend: str = "auto", act_quant: Optional[str] = None, name: str | None = None) -> nn.Module:
    """The dorafp8 layer for an nn.Linear / transformers Conv1D (an FP8Linear) or an nn.Conv1d/2d/3d (an
    FP8Conv1d/2d/3d; act_quant does not apply): its weight quantized, or kept as it is when it is already
    float8_e4m3fn (scale 1)."""
    conv_cls = fp8_conv_class(module)
    if conv_cls is not None:
        return conv_cls.from_float(module, per_row_scale=per_row_scale, block_size=block_size, backend=backend,
                                   name=name)
    return FP8Linear.from_float(module, per_row_scale=per_row_scale, block_size=block_size, backend=backend,
                                act_quant=act_quant, name=name)


def is_fp8_cast_layer(module: nn.Module) -> bool:
    """Whether `module` is a plain nn.Linear / Conv1D / ConvNd whose weight is an fp8 tensor without a scale
    (diffusers' layerwise casting, kohya's and OneTrainer's fp8 casts): to_fp8_layer takes it as it is."""
    weight = getattr(module, "weight", None)
    return isinstance(module, _linear_kinds() + _CONV_KINDS) and isinstance(weight, torch.Tensor) and is_fp8(weight)


def _tuner_layer_cls():
    """PEFT's BaseTunerLayer if peft is loaded (a model cannot contain PEFT layers otherwise), else None."""
    mod = sys.modules.get("peft.tuners.tuners_utils")
    return getattr(mod, "BaseTunerLayer", None)


def _name_list(arg) -> Optional[list]:
    return None if arg is None else ([arg] if isinstance(arg, str) else list(arg))


def _matches(name: str, patterns: list) -> bool:
    """`name` is one of `patterns` or ends with '.' + one (PEFT's target_modules rule)."""
    return any(name == t or name.endswith("." + t) for t in patterns)


def quantize_model(model: nn.Module, target_modules: Optional[Iterable[str]] = None, *,
                   per_row_scale: bool = False, block_size: Optional[int] = None, backend: str = "auto",
                   act_quant: Optional[str] = None, include_conv: bool = False,
                   exclude_modules: Optional[Iterable[str]] = None) -> int:
    """Replaces nn.Linear (and transformers' Conv1D) layers of `model` by FP8Linear, and nn.Conv1d/2d/3d layers by
    FP8Conv1d/2d/3d (dorafp8/fp8_conv.py), in place.

    target_modules: names (or name suffixes, like PEFT's target_modules) of the layers to quantize, linear or conv;
    None quantizes every nn.Linear/Conv1D except those named like an output head (`lm_head`), plus every
    nn.Conv1d/2d/3d if include_conv=True (default False: a None-target call quantizes what it always did; diffusion
    models want include_conv=True, see docs/DIFFUSION.md). Explicit targets that match no layer are an error.
    exclude_modules: names (or name suffixes) of layers left as they are, whatever target_modules says.
    per_row_scale / block_size choose the scale (default: one per tensor; for convs per_row_scale means one per
    output channel); act_quant="rowwise" makes the linear layers' base GEMMs W8A8 (set_act_quant changes it later;
    conv layers always run W8A16). Layers whose weight is already float8_e4m3fn (diffusers' enable_layerwise_casting,
    kohya's and OneTrainer's fp8 casts) are wrapped losslessly, scale 1, with the bias in the layer's compute dtype
    (docs/DORA_MATH.md, "Dtype policy"); on a layerwise-casting model the layers diffusers left in high precision (its
    skip patterns: norms, patch embeddings) are quantized like any other unless target_modules leaves them out.
    PEFT adapter layers and everything inside them (lora_A/lora_B, and the base layer a PEFT layer wraps) are never
    touched: to put the base weights of an existing PEFT DoRA model in fp8, use dorafp8.convert_peft_model.
    Returns how many layers were swapped.
    """
    check_backend_name(backend)
    check_act_quant(act_quant)
    kinds = _linear_kinds()
    targets, excluded = _name_list(target_modules), _name_list(exclude_modules) or []
    tuner = _tuner_layer_cls()
    inside_tuner = set()
    if tuner is not None:
        for name, mod in model.named_modules():
            if isinstance(mod, tuner):
                inside_tuner |= {f"{name}.{sub}" if name else sub for sub, _ in mod.named_modules() if sub}
    swaps, skipped, candidates = [], [], []
    for name, mod in model.named_modules():
        is_conv = isinstance(mod, _CONV_KINDS)
        if not (isinstance(mod, kinds) or is_conv):
            continue
        candidates.append(name)
        if targets is None:
            if name.split(".")[-1] == "lm_head" or (is_conv and not include_conv):
                continue
        elif not _matches(name, targets):
            continue
        if _matches(name, excluded):
            continue
        (skipped if name in inside_tuner else swaps).append(name)
    if skipped:
        warnings.warn(
            f"quantize_model left {len(skipped)} layers inside PEFT adapter layers as they are (e.g. {skipped[0]!r}): "
            f"quantizing them would turn the trainable lora_A/lora_B into frozen fp8. Quantize before get_peft_model, "
            f"or use dorafp8.convert_peft_model(model) to put the base weights of PEFT DoRA layers in fp8",
            stacklevel=2)
    if targets is not None and not swaps and not skipped:
        peft_hits = [n for n, m in model.named_modules() if tuner is not None and isinstance(m, tuner)
                     and _matches(n, targets)]
        if peft_hits:
            raise ValueError(f"target_modules={targets!r} matched only PEFT adapter layers (e.g. {peft_hits[0]!r}); "
                             f"quantize before get_peft_model, or use dorafp8.convert_peft_model(model) to put the "
                             f"base weights of PEFT DoRA layers in fp8")
        shown = ", ".join(repr(n) for n in candidates[:8]) + (", ..." if len(candidates) > 8 else "")
        raise ValueError(f"target_modules={targets!r} matched no nn.Linear/Conv1D/Conv1d/Conv2d/Conv3d layer of the "
                         f"model; its linear and conv layers are: {shown or 'none'}")
    for name in swaps:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, to_fp8_layer(getattr(parent, child), per_row_scale=per_row_scale,
                                            block_size=block_size, backend=backend, act_quant=act_quant, name=name))
    return len(swaps)


def set_act_quant(model: nn.Module, mode: Optional[str]) -> int:
    """Sets the activation quantization of every FP8Linear in `model` (PEFT layers on them included): "rowwise"
    (W8A8 base GEMMs) or None (W8A16). Saved adapters are unaffected. Returns how many layers were set."""
    check_act_quant(mode)
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    for m in layers:
        m.act_quant = mode
    return len(layers)
