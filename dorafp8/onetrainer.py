"""OneTrainer's DoRA on its fp8 layers, computed by dorafp8's fused op with OneTrainer's own semantics: on a LinearFp8
or fp8 LinearW8A8 layer, DoRAModule.forward runs dora_fp8_linear; anything else, and parameters, keys and files, stay
OneTrainer's. Its formula mapped onto the fused op: docs/ARCHITECTURE.md, "dorafp8/onetrainer.py"."""

from __future__ import annotations

import functools
import sys

import torch
from torch import nn

from .merge import column_norms
from .ops import dora_fp8_linear, weight_norm
from .quant import DEFAULT_BLOCK, E4M3

LORA_MODULE = "modules.module.LoRAModule"  # OneTrainer imports it so, running from its checkout


# The exact classes whose whole dequantized weight (get_unquantized_weight) is w8 * scale: (module, class) -> the
# scale's attribute. A subclass may add to the weight (LinearSVD adds svd_up @ svd_down) and is left to OneTrainer.
KNOWN_LAYERS = {
    ("modules.module.quantized.LinearFp8", "LinearFp8"): "_scale",  # its unquantized_weight reads _scale
    ("modules.module.quantized.LinearW8A8", "LinearW8A8"): "scale",
}


def fp8_parts(layer: nn.Module):
    """(w8, scale) with w8 * scale (fp32) exactly what OneTrainer dequantizes `layer` to, for an e4m3 LinearFp8,
    LinearW8A8 or plain nn.Linear (read unscaled); None for anything else (OneTrainer's own forward then runs)."""
    cls = type(layer)
    w8 = getattr(layer, "weight", None)
    if not isinstance(w8, torch.Tensor) or w8.dtype != E4M3 or getattr(layer, "_compressed", False):
        return None
    if cls is nn.Linear:
        scale = torch.ones(())
    else:
        attr = KNOWN_LAYERS.get((cls.__module__, cls.__qualname__))
        if attr is None:
            return None
        scale = getattr(layer, attr, None)
        if scale is None:
            scale = torch.ones(())  # LinearFp8 with _scale None: its unquantized_weight leaves the weight unscaled
    if not isinstance(scale, torch.Tensor) or scale.numel() != 1:
        return None
    return w8.detach(), _scale_on(layer, scale, w8.device)


def _scale_on(layer: nn.Module, scale: torch.Tensor, device: torch.device) -> torch.Tensor:
    """scale as fp32 0-dim on `device`. LinearFp8's `_scale` is a plain attribute that `Module.to` leaves on the CPU,
    and a CPU -> GPU copy synchronizes the stream (one sync per layer per forward): that copy is kept on the layer,
    keyed on the scale's value. Reading a CPU value costs no sync and sees every write, those that version counters
    and data_ptr miss included (an in-place write through `.data`, an inference tensor, a freed address reused)."""
    scale = scale.detach().reshape(())
    if scale.device == device and scale.dtype == torch.float32:
        return scale
    # A copy within the CPU or from another device syncs nothing; no attribute is written inside a compiled region
    if scale.device.type != "cpu" or device.type == "cpu" or torch.compiler.is_compiling():
        return scale.to(device=device, dtype=torch.float32)
    # the fp32 bits (NaN equals itself); a copy made in inference mode cannot be saved for backward outside it
    key = (scale.float().view(torch.int32).item(), device, torch.is_inference_mode_enabled())
    kept = layer.__dict__.get("_dorafp8_scale")
    if kept is None or kept[0] != key:
        kept = layer.__dict__["_dorafp8_scale"] = (key, scale.to(device=device, dtype=torch.float32))
    return kept[1]


def fused_forward(module, x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """OneTrainer's DoRAModule.forward (docs/ARCHITECTURE.md) on the fp8 weight w8 * scale."""
    layer = module.orig_module
    # alpha / rank goes into lora_up as a tensor (as OneTrainer computes it), the fused op's scaling being 1: alpha is
    # a buffer, and float() of it under torch.compile (OneTrainer's `compile` option, fullgraph=True) is a
    # data-dependent value the op cannot take as its float scaling
    A, B = module.lora_down.weight, module.lora_up.weight * (module.alpha / module.rank)
    eps = torch.finfo(torch.float32).eps if module.norm_epsilon else 0.0
    x = module.dropout(x)
    d = module.dora_scale.reshape(-1)
    if module.decompose_output_axis:
        with torch.no_grad():
            n = weight_norm(w8, scale, A, B, 1.0) + eps
        return dora_fp8_linear(x, w8, scale, A, B, d, 1.0, layer.bias, weight_norm=n)
    c = d / (column_norms(w8, scale, DEFAULT_BLOCK, A, B, 1.0) + eps)
    ones = torch.ones(w8.shape[0], dtype=torch.float32, device=w8.device)
    return dora_fp8_linear((x * c).to(x.dtype), w8, scale, A, B, ones, 1.0, layer.bias, weight_norm=ones)


def own_forward(module, orig, x, *args, **kwargs):
    """OneTrainer's own DoRAModule.forward `orig`, on a layer dorafp8 leaves to it (a function, for the launcher to
    count: its exit report says how many adapters ran without dorafp8)."""
    return orig(module, x, *args, **kwargs)


def register_with_onetrainer() -> bool:
    """Makes OneTrainer's DoRAModule compute through dorafp8 on fp8 linear layers; run when its module is imported.
    Idempotent; returns whether it is installed (False without a DoRAModule with the attributes read here)."""
    mod = sys.modules.get(LORA_MODULE)
    cls = getattr(mod, "DoRAModule", None)
    if cls is None or not all(hasattr(cls, a) for a in ("forward", "check_initialized", "make_weight")):
        return False
    orig = cls.forward
    if hasattr(orig, "_dorafp8_orig"):
        return True

    @functools.wraps(orig)
    def forward(self, x, *args, **kwargs):
        parts = fp8_parts(self.orig_module) if self._initialized else None
        if parts is None:
            return own_forward(self, orig, x, *args, **kwargs)
        self.check_initialized()
        return fused_forward(self, x, *parts)

    forward._dorafp8_orig = orig
    cls.forward = forward
    return True
