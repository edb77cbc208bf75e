"""The fp8 layouts dorafp8 reads and writes, their names and aliases, and the dense formats it writes. In every layout
W0 = scale * W8, W8 float8_e4m3fn [out, in] under `<layer>.weight`; they differ in the scale's key and shape. NVFP4 /
MXFP8 layers are written back as "modelopt" only (not in FORMATS: it holds no fp8 layer) or dense. Where each layout
comes from and how it was checked: docs/CHECKPOINTS.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..quant import E4M3, E8M0

E5M2 = torch.float8_e5m2


class CheckpointFormatError(ValueError):
    """The checkpoint is not in a layout dorafp8 can load, or does not fit the model."""


@dataclass(frozen=True)
class Layout:
    name: str
    scale_key: Optional[str]          # "<layer>.<scale_key>" holds the weight scale
    act_scale_key: Optional[str]      # static activation scale, kept for writing back, unused by dorafp8
    write_granularities: tuple        # what a layer can be written as, first = the default for re-quantized layers
    description: str


LAYOUTS = {
    "comfyui": Layout("comfyui", "scale_weight", "scale_input", ("tensor",),
                      "ComfyUI scaled fp8 (`scaled_fp8` marker, per-tensor `scale_weight`)"),
    "comfyui-quant": Layout("comfyui-quant", "weight_scale", "input_scale", ("tensor",),
                            "ComfyUI mixed precision (`comfy_quant` per layer, per-tensor `weight_scale`)"),
    "compressed-tensors": Layout("compressed-tensors", "weight_scale", "input_scale", ("row", "tensor", "block"),
                                 "compressed-tensors float-quantized (`weight_scale` per tensor / channel / block)"),
    "fine-grained": Layout("fine-grained", "weight_scale_inv", "activation_scale", ("block",),
                           "transformers fine-grained FP8 (`weight_scale_inv` per 128 x 128 block; DeepSeek-V3, "
                           "Qwen3-FP8)"),
    "dorafp8": Layout("dorafp8", "scale", None, ("row", "tensor", "block"),
                      "dorafp8 FP8Linear state_dict (`scale` per tensor / row / block)"),
    # musubi-tuner / kohya `--fp8_scaled`: ComfyUI's key name, in the model's dtype, without the `scaled_fp8` marker;
    # 1 x g blocks are read only (re-quantized to per row: dorafp8/nn/group_scales.py)
    "musubi": Layout("musubi", "scale_weight", None, ("row", "tensor"),
                     "musubi-tuner / kohya `--fp8_scaled` (`scale_weight` per tensor, per row or per 1 x 64 block)"),
    "modelopt": Layout("modelopt", "weight_scale", "input_scale", (),
                       "NVIDIA ModelOpt NVFP4 (`weight` packed uint8, `weight_scale` e4m3 per 16, `weight_scale_2`) or "
                       "MXFP8 (`weight_scale` e8m0 per 32)"),
    "fp8-cast": Layout("fp8-cast", None, None, ("tensor",),
                       "weights cast to float8_e4m3fn without a scale (scale 1)"),
}
DENSE_FORMATS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ALIASES = {"comfy": "comfyui", "scaled_fp8": "comfyui", "comfy_quant": "comfyui-quant", "ct": "compressed-tensors",
           "compressed_tensors": "compressed-tensors", "finegrained": "fine-grained", "fine_grained": "fine-grained",
           "fp8": "fine-grained", "fp8_scaled": "musubi", "kohya": "musubi", "bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
# What the writers (save_fp8_checkpoint, export_merged) write: the layouts but the read-only ones, and the dense ones.
FORMATS = tuple(name for name, lay in LAYOUTS.items() if lay.write_granularities) + tuple(DENSE_FORMATS)

# The formats a directory with a transformers config.json may hold: those from_pretrained reads right on its own (in
# the others it loads the raw e4m3 values without their scales, listing the scale keys as UNEXPECTED).
TRANSFORMERS_FORMATS = ("compressed-tensors", "fine-grained", "fp8-cast") + tuple(DENSE_FORMATS)

# safetensors' dtype names (safe_open's get_slice().get_dtype()), for reading a file's header without its data
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "F8_E4M3": E4M3, "F8_E5M2": E5M2, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
                      "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool, "F8_E8M0": E8M0}
GRANULARITY_NAMES = {"tensor": "per-tensor", "row": "per-row", "block": "per-block"}


def canonical_format(fmt: str, allowed=FORMATS) -> str:
    name = ALIASES.get(str(fmt).lower(), str(fmt).lower())
    if name not in allowed:
        raise ValueError(f"format must be one of {', '.join(allowed)} (or 'auto'), got {fmt!r}")
    return name


def granularity_name(g: str, block_size: int) -> str:
    """How reports name a layer's scale: "per-tensor", "per-row", "per-128x128-block"."""
    return f"per-{block_size}x{block_size}-block" if g == "block" else GRANULARITY_NAMES[g]


def cpu_fine_grained_read(N: int, K: int, b: int) -> str:
    """How transformers' CPU fine-grained FP8 loader (5.23; block taken as N / ceil(N / b)) reads an [N, K] weight with
    b x b block scales: "ok", "raises" or "wrong" (N = 96, b = 64 gives 48-row blocks, silently)."""
    dims = [(n, -(-n // b)) for n in (N, K)]
    if any(n % g for n, g in dims):
        return "raises"
    return "ok" if all(g == 1 or n // g == b for n, g in dims) else "wrong"
