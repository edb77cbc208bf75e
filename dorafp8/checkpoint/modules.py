"""What the loader and the writers need to know about a model: its tensors by name, its fp8 layers (inside PEFT's
layers too), and how to put a tensor or a module in place."""

from __future__ import annotations

from collections import Counter
from typing import Optional

import torch
from torch import nn

from ..nn import FP8ConvNd, FP8Linear
from ..nn.convert import swap_module, tuner_layer_class  # noqa: F401 (shared with the loader and the writers)
from ..quant import E4M3
from .layouts import E5M2

FP8_CONV_TYPES = FP8ConvNd  # the base of FP8Conv1d/2d/3d
FP8_LAYER_TYPES = (FP8Linear, FP8ConvNd)


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Persistent parameters and buffers by name, tied ones under each of their names."""
    out = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        pre = f"{mname}." if mname else ""
        for n, p in mod._parameters.items():
            if p is not None:
                out[pre + n] = p
        for n, b in mod._buffers.items():
            if b is not None and n not in mod._non_persistent_buffers_set:
                out[pre + n] = b
    return out


def tied_groups(model: nn.Module) -> dict[str, list[str]]:
    """name -> every name of the same tensor, for the tensors that have several."""
    by_id: dict[int, list[str]] = {}
    for name, t in model_tensors(model).items():
        by_id.setdefault(id(t), []).append(name)
    return {n: names for names in by_id.values() if len(names) > 1 for n in names}


def model_dtype(model: nn.Module) -> torch.dtype:
    """The most common floating dtype of the model's parameters that are not fp8 (fp32 if none)."""
    counts = Counter(p.dtype for p in model.parameters() if p.is_floating_point() and p.dtype not in (E4M3, E5M2))
    return counts.most_common(1)[0][0] if counts else torch.float32


def set_tensor(model: nn.Module, name: str, value, *, param: Optional[bool] = None, requires_grad=False):
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    if attr in mod._parameters or param:
        if not isinstance(value, nn.Parameter):
            value = nn.Parameter(value, requires_grad=requires_grad and value.is_floating_point())
        mod._parameters[attr] = value
    else:
        mod._buffers[attr] = value


def is_conv1d(mod) -> bool:
    """transformers' Conv1D (GPT-2): a linear layer with its weight transposed, which FP8Linear does not hold."""
    return type(mod).__name__ == "Conv1D" and not isinstance(mod, nn.Linear)


def base_model(model: nn.Module) -> nn.Module:
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def base_layer(layer):
    get = getattr(layer, "get_base_layer", None)
    return get() if callable(get) else layer


def fp8_modules(base: nn.Module) -> dict[str, nn.Module]:
    """name -> FP8Linear / FP8ConvNd, inside PEFT's layers too (named as in the state dict, base_layer dropped)."""
    return {n.replace(".base_layer", ""): m for n, m in base.named_modules() if isinstance(m, FP8_LAYER_TYPES)}


class ModelState:
    """Every module's attributes and parameter, buffer and submodule slots, by reference, to put back after a failed
    operation (a replaced module or tensor, not a write into one: docs/ARCHITECTURE.md, "All or nothing")."""

    def __init__(self, model: nn.Module):
        self._saved = [(mod, dict(mod.__dict__), dict(mod._parameters), dict(mod._buffers), dict(mod._modules),
                        set(mod._non_persistent_buffers_set)) for mod in model.modules()]

    def restore(self) -> None:
        for mod, attrs, params, buffers, modules, non_persistent in self._saved:
            mod.__dict__.clear()
            mod.__dict__.update(attrs)  # the slot dicts below are these same objects: their contents put back too
            for slots, saved in ((mod._parameters, params), (mod._buffers, buffers), (mod._modules, modules)):
                slots.clear()
                slots.update(saved)
            mod._non_persistent_buffers_set.clear()
            mod._non_persistent_buffers_set.update(non_persistent)
