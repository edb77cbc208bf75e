"""The typed records loading and writing pass around. SourceInfo (model) and LayerSource (fp8 layer) stay as
`_dorafp8_source` from a load to a save, so that a model written back in its layout gives back the same tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from .layouts import Layout
from .modules import base_model


@dataclass
class SourceInfo:
    """What a model was loaded from."""
    format: Optional[str] = None
    strip: str = ""                                   # key prefix stripped from the checkpoint's keys
    add: str = ""                                     # key prefix put in front of them
    block_size: Optional[int] = None                       # the block size config.json gave
    metadata: dict = field(default_factory=dict)      # the safetensors metadata
    dtypes: dict = field(default_factory=dict)        # model name -> dtype in the file, of the tensors loaded as is
    markers: dict = field(default_factory=dict)       # the scaled_fp8 marker keys -> (dtype, shape, shard)
    marker_tensors: Optional[dict] = None             # and their tensors
    config: Optional[dict] = None                     # config.json
    kv_cache_quant_algo: Optional[str] = None         # ModelOpt's (hf_quant_config.json), written back with k/v_scale
    files: tuple = ()                                 # files.identity() of the weight files it was read from


@dataclass
class LayerSource:
    """What one fp8 layer was loaded from."""
    format: str
    extras: dict = field(default_factory=dict)        # suffix -> tensor ("input_scale", "comfy_quant", ...)
    scale_dtype: Optional[torch.dtype] = None
    scale_shape: Optional[tuple] = None
    global_bits: Optional[int] = None  # NVFP4: the loaded global scale's fp32 bits (whether it changed since: emit.py)


def source_of(model: nn.Module) -> SourceInfo:
    """The SourceInfo of the model (or of the base model of a PEFT model); an empty one if it has none."""
    for m in (model, base_model(model)):
        src = getattr(m, "_dorafp8_source", None)
        if src:
            return src
    return SourceInfo()


def fp32_bits(g: torch.Tensor) -> int:
    """The bits of a one-value fp32 tensor (an NVFP4 global scale), for telling equal ones apart exactly."""
    return g.detach().float().reshape(()).cpu().view(torch.int32).item()


# ---- loading ----------------------------------------------------------------------------------------------------


@dataclass
class LayerPlan:
    """A model module whose checkpoint weight is fp8."""
    key: str                          # the checkpoint key of its weight
    module: nn.Module                 # the model's module (the FP8Linear / FP8ConvNd once built)
    linear: bool
    conv: bool
    fp8: bool  # keeps the e4m3 bytes and scale (FP8Linear / FP8ConvNd); else (embedding, Conv1D) dequantized
    scale_key: Optional[str] = None
    block_size: Optional[int] = None       # the block size of block scales, None for per-tensor / per-row ones
    group: Optional[int] = None            # g of 1 x g block scales (musubi), re-quantized to per row when read
    extras: list = field(default_factory=list)  # checkpoint keys kept with the layer (activation scales, ...)
    kind: Optional[str] = None             # "nvfp4" / "mxfp8" for a microscaled weight (dorafp8/quant.py), else None
    global_key: Optional[str] = None       # NVFP4: the key of its global scale (weight_scale_2 / weight_global_scale)


@dataclass
class ScalePlan:
    """A checkpoint scale and the layer it belongs to."""
    module: str
    N: int
    K: int
    block_size: int
    keeps_fp8: bool
    group: Optional[int] = None  # 1 x g block scales [N, K / g, 1]: read before the weight, which is re-quantized
    kind: Optional[str] = None   # "nvfp4" / "mxfp8": kept as stored (e4m3 / e8m0), not converted to fp32


@dataclass
class KeyMap:
    """Checkpoint keys -> model names."""
    names: dict                       # checkpoint key -> model name (None: skipped by key_map)
    ckpt_keys: list                   # every key but the scaled_fp8 markers
    marker_keys: set
    strip: str = ""
    add: str = ""


@dataclass
class LoadPlan:
    """Where every checkpoint tensor goes, decided (and checked) before any data is read."""
    fmt: str
    layout: Layout
    keys: KeyMap
    layer_of: dict                    # fp8 weight key -> module name
    layers: dict                      # module name -> LayerPlan
    scales: dict = field(default_factory=dict)    # scale key -> ScalePlan
    consumed: dict = field(default_factory=dict)  # checkpoint key -> how it is used ("scale", "extra", "ignored")
    plain: dict = field(default_factory=dict)     # checkpoint key -> model name, for tensors loaded as they are (cast)


# ---- writing ----------------------------------------------------------------------------------------------------


@dataclass
class WriteTarget:
    """What a write produces, resolved from the model and the arguments before anything is written."""
    fmt: str
    layout: Optional[Layout]               # None for the dense formats
    dense_dtype: Optional[torch.dtype]
    granularity: Optional[str]
    block_size: int                               # the one block size of the file
    strip: str
    add: str
    src: SourceInfo                        # what the model was loaded from
    same: bool                             # writing the layout the model was loaded from
    base: nn.Module
    stem: str                              # "model" or diffusers' "diffusion_pytorch_model"
    config_kind: Optional[str]             # the config.json a directory gets: "transformers", "diffusers" or None
    metadata: dict                         # safetensors metadata

    def key_of(self, name: str) -> str:
        return self.strip + (name[len(self.add):] if self.add and name.startswith(self.add) else name)


@dataclass
class Written:
    """What emit wrote that the config needs."""
    dense_linears: list = field(default_factory=list)
    conv_layers: list = field(default_factory=list)
    unmerged: list = field(default_factory=list)
    groups: dict = field(default_factory=dict)     # (granularity, activations) -> layer names
    ragged: list = field(default_factory=list)
