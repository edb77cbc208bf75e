"""Teaching PEFT about dorafp8's layers (register_with_peft, run when peft is imported) and converting an existing PEFT
DoRA model in place (convert_peft_model)."""

from __future__ import annotations

import functools
import inspect
import warnings

from torch import nn

from peft.tuners import tuners_utils
from peft.tuners.lora import layer as lora_layer
from peft.tuners.lora.model import LoraModel
from peft.tuners.lora.variants import DoraLinearVariant
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils.constants import INCLUDE_LINEAR_LAYERS_SHORTHAND

from ..backends import check_backend_name
from ..nn import FP8ConvNd, FP8Linear, FP8WeightModule
from ..nn.convert import is_fp8_cast_layer, swap_module, to_fp8_layer
from ..nn.group_scales import collect_regrouped
from . import conv as peft_conv
from .layer import DoRAFP8Layer
from .linear import DoRAFP8Linear


def convert_peft_model(peft_model: nn.Module, *, backend: str = "auto", per_row_scale: bool = False) -> int:
    """Swaps, in place, every PEFT DoRA Linear in `peft_model` (on nn.Linear or transformers' Conv1D) for a
    DoRAFP8Linear, and every PEFT DoRA Conv1d/2d/3d for a DoRAFP8Conv1d/2d/3d (dorafp8/peft/conv.py), quantizing its
    base weight to fp8 (a base torchao quantized to fp8, PEFT's TorchaoLoraLinear, keeps its bytes and scales:
    dorafp8/nn/torchao_fp8.py). All or nothing: every layer is checked before the first swap.

    Args:
        peft_model: a PeftModel (or any module holding PEFT DoRA layers).
        backend: the backend name the new layers' ops use ("auto" by default).
        per_row_scale: one scale per output row (per output channel for convs) instead of one per tensor.

    Returns:
        How many layers were swapped (a warning if none).

    Raises:
        ValueError: an unknown backend, or a layer it cannot convert (merged adapters, another variant, a base it
            cannot quantize); the message names the layer.
    """
    check_backend_name(backend)
    todo = {name: DoRAFP8Linear for name, mod in peft_model.named_modules()
            if isinstance(mod, lora_layer.Linear) and not isinstance(mod, DoRAFP8Linear)
            and any(type(v) is DoraLinearVariant for v in mod.lora_variant.values())}
    todo.update(peft_conv.convertible_conv_layers(peft_model))
    # All or nothing: every layer is checked (merged adapters, variants, a base that quantizes) before the first swap.
    for name, cls in todo.items():
        cls.check_peft_layer(peft_model.get_submodule(name), per_row_scale=per_row_scale, name=name)
    with collect_regrouped("the torchao model"):  # one warning for every torchao layer re-quantized from groups
        for name, cls in todo.items():
            swap_module(peft_model, name, cls.from_peft(peft_model.get_submodule(name), backend=backend,
                                                        per_row_scale=per_row_scale))
    if not todo:
        warnings.warn("convert_peft_model found no PEFT DoRA Linear or conv layer to convert (use_dora=True?)")
    return len(todo)


def adapters_of(layer) -> list[str]:
    """The adapters a PEFT LoRA layer holds, an Embedding's (in lora_embedding_A) too."""
    return [*layer.lora_A, *getattr(layer, "lora_embedding_A", {})]


def check_model_merge(model: nn.Module, adapter_names=None) -> None:
    """Raises before anything is merged if any LoRA layer of `model` could not merge `adapter_names` (None: the active
    ones): dorafp8 layers' merge_problems, a name no layer has, or PEFT's NotImplementedError for its conv layers with
    groups > 1."""
    problems, peft_refuses, known, ours = [], [], set(), False
    for name, mod in model.named_modules():
        if isinstance(mod, lora_layer.LoraLayer):
            known |= set(adapters_of(mod))
        if isinstance(mod, DoRAFP8Layer):
            ours = True
            problems += [f"{name}: {p}" for p in mod.merge_problems(adapter_names)]
        elif isinstance(mod, lora_layer._ConvNd) and getattr(mod.get_base_layer(), "groups", 1) > 1:
            names = mod.active_adapters if adapter_names is None else adapter_names
            if any(a in mod.lora_A and a not in mod.merged_adapters for a in names):
                peft_refuses.append(f"{name}: PEFT does not merge into a conv with groups > 1")
    problems += peft_refuses
    # A name no layer has merges nothing in PEFT, silently; on a model with dorafp8 layers it is an error instead (a
    # list of str, not a str, which PEFT refuses itself).
    unknown = [] if isinstance(adapter_names, str) else [a for a in adapter_names or () if a not in known]
    if ours and unknown:
        problems.append(f"adapter_names: {unknown} are not adapters of this model; its adapters: {sorted(known)}")
    if problems:
        msg = f"nothing was merged: {len(problems)} problem(s) found before merging:\n  " + "\n  ".join(problems)
        if peft_refuses:  # PEFT's own words (peft/tuners/lora/layer.py, _ConvNd.merge) first
            raise NotImplementedError("Merging is not supported for _ConvNd layers with groups > 1! " + msg)
        raise ValueError(msg)


def _checked_merge(method):
    """`method` (LoraModel._unload_and_optionally_merge or merge_adapter) with check_model_merge run first."""
    sig = inspect.signature(method)

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        bound = sig.bind(self, *args, **kwargs)
        bound.apply_defaults()
        if bound.arguments.get("merge", True):
            check_model_merge(self.model, bound.arguments.get("adapter_names"))
        return method(self, *args, **kwargs)

    return wrapper


_ORIG_CREATE_NEW_MODULE = None
_ORIG_ALL_LINEAR = None


def _fp8_all_linear_names(model: nn.Module) -> set[str]:
    """The FP8Linear layers PEFT's "all-linear" means (not lm_head, nor inside a tuner layer)."""
    names = {name for name, mod in model.named_modules() if isinstance(mod, FP8Linear)}
    get_out = getattr(model, "get_output_embeddings", None)
    out = get_out() if callable(get_out) else None
    for name, mod in model.named_modules():
        if out is not None and mod is out:
            names.discard(name)
        if isinstance(mod, BaseTunerLayer):
            names -= {f"{name}.{sub}" for sub, _ in mod.named_modules() if sub}
    return names


def _check_modules_to_save(peft_config, model: nn.Module) -> None:
    """Refuses modules_to_save naming a module that holds an fp8 layer: PEFT trains a full copy of it, whose fp8
    weight gets no gradient (it was marked trainable and silently never changed)."""
    names = getattr(peft_config, "modules_to_save", None) or ()
    names = [names] if isinstance(names, str) else list(names)
    for key, mod in model.named_modules():
        t = next((t for t in names if key.endswith(t)), None)  # PEFT's own match (peft.utils.other._set_trainable)
        fp8 = next((f"{key}.{n}".rstrip(".") for n, m in mod.named_modules() if isinstance(m, FP8WeightModule)), None)
        if t is not None and fp8 is not None:
            raise ValueError(f"modules_to_save={names}: {key!r} holds the fp8 layer {fp8!r}, whose fp8 weight cannot "
                             f"be trained (PEFT's full copy of it would get no gradient); to train it in full, "
                             f"quantize without it (quantize_model(model, exclude_modules=[{t!r}])), or give it an "
                             f"adapter through target_modules instead")


def _fp8_cast_base(target: nn.Module, base: nn.Module, name: str | None) -> nn.Module:
    """The FP8Linear / FP8ConvNd DoRA is built on in place of `base`, a plain layer whose weight was cast to fp8
    (layerwise casting, kohya's and OneTrainer's casts; PEFT's DoRA init fails on it): its e4m3 bytes with scale 1."""
    if target is not base:  # the base of another adapter layer: swapping it would change that layer under it
        kind = f"{type(target).__module__}.{type(target).__qualname__}"
        raise ValueError(f"{name!r} is a {type(base).__name__} with a {base.weight.dtype} weight inside the adapter "
                         f"layer {kind}; PEFT's DoRA cannot initialise on an fp8 weight. Call "
                         f"dorafp8.quantize_model(model) (include_conv=True for convs) before adding the first "
                         f"adapter: it wraps fp8 weights losslessly")
    return to_fp8_layer(base, name=name)


def register_with_peft() -> None:
    """Makes PEFT build DoRAFP8Linear / DoRAFP8Conv1d/2d/3d for targeted fp8 layers (and for DoRA on a plain layer whose
    weight is float8_e4m3fn already), `target_modules="all-linear"` include FP8Linear, and merge_and_unload /
    merge_adapter check every layer first (check_model_merge). Idempotent; runs when peft is imported."""
    global _ORIG_CREATE_NEW_MODULE, _ORIG_ALL_LINEAR
    if _ORIG_CREATE_NEW_MODULE is not None:
        return
    _ORIG_CREATE_NEW_MODULE = LoraModel._create_new_module
    _ORIG_ALL_LINEAR = tuners_utils._maybe_include_all_linear_layers

    def _create_new_module(lora_config, adapter_name, target, **kwargs):
        base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
        if getattr(lora_config, "use_dora", False) and is_fp8_cast_layer(base):
            base = target = _fp8_cast_base(target, base, kwargs.get("target_name"))
        if isinstance(base, FP8Linear):
            kwargs.pop("fan_in_fan_out", None)
            return DoRAFP8Linear(target, adapter_name, config=lora_config, **kwargs)
        if isinstance(base, FP8ConvNd):  # FP8Conv1d/2d/3d -> DoRAFP8Conv1d/2d/3d (dorafp8/peft/conv.py)
            return peft_conv.create_conv_module(base, target, adapter_name, lora_config, **kwargs)
        return _ORIG_CREATE_NEW_MODULE(lora_config, adapter_name, target, **kwargs)

    def _maybe_include_all_linear_layers(peft_config, model):  # every inject_adapter calls it, before any swap
        _check_modules_to_save(peft_config, model)
        target = getattr(peft_config, "target_modules", None)
        all_linear = isinstance(target, str) and target.lower() == INCLUDE_LINEAR_LAYERS_SHORTHAND
        peft_config = _ORIG_ALL_LINEAR(peft_config, model)
        if all_linear:
            peft_config.target_modules = set(peft_config.target_modules) | _fp8_all_linear_names(model)
        return peft_config

    LoraModel._create_new_module = staticmethod(_create_new_module)
    tuners_utils._maybe_include_all_linear_layers = _maybe_include_all_linear_layers
    # All or nothing: merge_and_unload / merge_adapter check every layer before PEFT merges the first one.
    for attr in ("_unload_and_optionally_merge", "merge_adapter"):
        setattr(LoraModel, attr, _checked_merge(getattr(LoraModel, attr)))
