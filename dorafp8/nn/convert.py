"""Turning a model's layers into dorafp8's: quantize_model (nn.Linear / transformers Conv1D -> FP8Linear, nn.ConvNd ->
FP8ConvNd), set_act_quant, and the one-layer conversion both of them and the PEFT integration use."""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from typing import Iterable, Optional

import torch
from torch import nn

from .. import backends
from ..backends import check_backend_name
from ..quant import check_act_quant, check_quantizable, is_fp8
from ._base import ZERO3_ORDER, FP8WeightModule, check_fp8_cast, refuse_dtensor_weight, zero3_init_active
from .conv import fp8_conv_class
from .group_scales import collect_regrouped
from .linear import FP8Linear, conv1d_class
from .save_warning import warn_if_save_pretrained_loses_scales
from .torchao_fp8 import check_torchao_weight, is_torchao_tensor

_CONV_KINDS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _linear_kinds() -> tuple:
    conv1d = conv1d_class()
    return (nn.Linear,) + ((conv1d,) if conv1d is not None else ())


def to_fp8_layer(module: nn.Module, *, per_row_scale: bool = False, block_size: Optional[int] = None,
                 backend: str = "auto", act_quant: Optional[str] = None, name: str | None = None) -> nn.Module:
    """The dorafp8 layer for an nn.Linear / Conv1D / ConvNd: weight quantized, or kept with scale 1 if fp8."""
    conv_cls = fp8_conv_class(module)
    if conv_cls is not None:
        return conv_cls.from_float(module, per_row_scale=per_row_scale, block_size=block_size, backend=backend,
                                   name=name)
    return FP8Linear.from_float(module, per_row_scale=per_row_scale, block_size=block_size, backend=backend,
                                act_quant=act_quant, name=name)


def check_fp8_layer(module: nn.Module, *, per_row_scale: bool = False, block_size: Optional[int] = None,
                    name: str | None = None) -> None:
    """Raises what to_fp8_layer(module, ...) would raise, changing nothing (reads the weight once)."""
    if is_torchao_tensor(module.weight):
        if fp8_conv_class(module) is not None:
            raise TypeError(f"the weight of {name!r} is torchao's {type(module.weight).__name__} in a "
                            f"{type(module).__name__}; dorafp8 takes torchao fp8 weights of linear layers only")
        check_torchao_weight(module.weight, name)
        return
    refuse_dtensor_weight(module, name)
    weight = module.weight.detach()
    if weight.is_meta:  # no values to check (a rank other than 0 under cpu_ram_efficient_loading): see FP8Linear
        return
    conv1d = conv1d_class()
    if conv1d is not None and isinstance(module, conv1d):
        weight = weight.T  # Conv1D stores [in_features, out_features]
    if is_fp8(weight):
        check_fp8_cast(weight, name)
    else:
        check_quantizable(weight.reshape(weight.shape[0], -1), per_row=per_row_scale, block_size=block_size,
                          name=name)


def zero3_gathered(module: nn.Module, name: str | None = None):
    """A context in which `module`'s own ZeRO-3 partitioned parameters are whole on every rank (read-only
    GatheredParameters; a no-op without any). A collective: every rank enters it for the same modules, in order."""
    params = [p for p in module.parameters(recurse=False) if hasattr(p, "ds_id")]
    if not params:
        return contextlib.nullcontext()
    if zero3_init_active():
        raise RuntimeError(f"dorafp8 cannot read the partitioned layer {name!r} inside DeepSpeed ZeRO-3's "
                           f"deepspeed.zero.Init (quantize_model and the DoRA init need its whole weight): "
                           f"{ZERO3_ORDER}")
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    return GatheredParameters(params, modifier_rank=None)


def zero3_repartition(new: nn.Module, old: nn.Module) -> bool:
    """Partitions `new`'s parameters at once as ZeRO-3 partitioned those of `old` (the layer it replaces), when under
    transformers' HfDeepSpeedConfig: deepspeed.zero.Init(module=new), `old`'s process group. Returns whether it did."""
    old_params = [p for p in old.parameters(recurse=False) if hasattr(p, "ds_id")]
    hf_ds = sys.modules.get("transformers.integrations.deepspeed")
    config = hf_ds.deepspeed_config() if hf_ds is not None and old_params else None
    if config is None:
        return False
    from deepspeed.runtime.zero.partition_parameters import Init

    Init(module=new, config_dict_or_path=config, data_parallel_group=old_params[0].ds_process_group)
    return True


def is_fp8_cast_layer(module: nn.Module) -> bool:
    """Whether `module` is a plain Linear / Conv1D / ConvNd whose weight was cast to fp8 without a scale."""
    weight = getattr(module, "weight", None)
    return isinstance(module, _linear_kinds() + _CONV_KINDS) and isinstance(weight, torch.Tensor) and is_fp8(weight)


def tuner_layer_class():
    """PEFT's BaseTunerLayer if peft is loaded (a model cannot contain PEFT layers otherwise), else None."""
    mod = sys.modules.get("peft.tuners.tuners_utils")
    return getattr(mod, "BaseTunerLayer", None)


def swap_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Puts `new` in place of the submodule `name` of `model`."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def name_list(arg) -> Optional[list]:
    return None if arg is None else ([arg] if isinstance(arg, str) else list(arg))


def kept_in_precision(model: nn.Module) -> set:
    """The names of the layers inside modules that `model` (or a submodule) lists in `_keep_in_fp32_modules`, matched by
    name component as diffusers does: their inputs are cast to their weight dtype, so they stay dense."""
    kept = set()
    for prefix, mod in model.named_modules():
        keep = set(getattr(mod, "_keep_in_fp32_modules", None) or ())
        if not keep:
            continue
        for name, _ in mod.named_modules():
            if name and keep & set(name.split(".")):
                kept.add(f"{prefix}.{name}" if prefix else name)
    return kept


def _matches(name: str, patterns: list) -> bool:
    """`name` is one of `patterns` or ends with '.' + one (PEFT's target_modules rule)."""
    return any(name == t or name.endswith("." + t) for t in patterns)


def quantize_model(model: nn.Module, target_modules: Optional[Iterable[str]] = None, *,
                   per_row_scale: bool = False, block_size: Optional[int] = None, backend: str = "auto",
                   act_quant: Optional[str] = None, include_conv: bool = False,
                   exclude_modules: Optional[Iterable[str]] = None, verbose: bool = True) -> nn.Module:
    """Replaces nn.Linear (and transformers' Conv1D) layers of `model` by FP8Linear, and nn.Conv1d/2d/3d layers by
    FP8Conv1d/2d/3d, in place; all or nothing (every layer is checked before the first is swapped).

    Args:
        model: any nn.Module. PEFT adapter layers and what they wrap are never touched (for a PEFT DoRA model, use
            dorafp8.convert_peft_model), nor the `out_proj` of an nn.MultiheadAttention (it reads its weight
            directly; a warning says so).
        target_modules: names or name suffixes (as PEFT's) of the layers to quantize. None: every nn.Linear/Conv1D but
            an output head (`lm_head`), and every nn.Conv1d/2d/3d if include_conv.
        per_row_scale: one scale per output row (per output channel for convs) instead of one per tensor.
        block_size: b for b x b block scales (linear layers), instead of the above.
        backend: the backend name the layers' ops use ("auto" by default).
        act_quant: "rowwise" runs the linear layers' base GEMMs W8A8 (set_act_quant changes it later); convs stay
            W8A16.
        include_conv: with target_modules=None, also the conv layers (diffusion models: docs/DIFFUSION.md).
        exclude_modules: names or name suffixes of layers left as they are, whatever target_modules says.
        verbose: print one line with how many layers were swapped and what their weights take now, against bf16 and
            fp32 (always logged on the "dorafp8" logger).

    Returns:
        `model`, so that `model = quantize_model(model)` chains into get_peft_model.

    Raises:
        ValueError: explicit target_modules that match no layer (or only PEFT adapter layers); an unknown backend
            or act_quant; a layer it cannot quantize (the error names the layer and why). An exclude_modules name
            that matches no module is a warning (UserWarning), as PEFT's.
        TypeError: a torchao weight layout it does not read.
        RuntimeError: called inside DeepSpeed's deepspeed.zero.Init.

    What it keeps as it is (docs/DORA_MATH.md, "Dtype policy"; docs/CHECKPOINTS.md): torchao fp8 weights keep their
    bytes and scales (1 x g groups are re-quantized per row, with a QuantizationWarning giving the error); weights
    already float8_e4m3fn (diffusers' layerwise casting, kohya's and OneTrainer's casts) are wrapped losslessly with
    scale 1. Layers inside the modules a model lists in `_keep_in_fp32_modules` (Wan's time embedder, T5's `wo`; see
    kept_in_precision) stay dense whatever target_modules says: the model casts their inputs to their weight's dtype
    (diffusers' and transformers' quantizers skip them too). ZeRO-3 partitioned layers are gathered one at a time on
    every rank and partitioned again; meta weights give meta fp8 layers.
    """
    check_backend_name(backend)
    check_act_quant(act_quant)
    kinds = _linear_kinds()
    targets, excluded = name_list(target_modules), name_list(exclude_modules) or []
    tuner = tuner_layer_class()
    inside_tuner = set()
    if tuner is not None:
        for name, mod in model.named_modules():
            if isinstance(mod, tuner):
                inside_tuner |= {f"{name}.{sub}" if name else sub for sub, _ in mod.named_modules() if sub}
    # nn.MultiheadAttention reads out_proj.weight itself (F.multi_head_attention_forward), never calling out_proj:
    # an fp8 weight there breaks its forward ("self and mat2 must have the same dtype"), so those stay dense.
    read_directly = {f"{n}.out_proj" if n else "out_proj" for n, m in model.named_modules()
                     if isinstance(m, nn.MultiheadAttention)}
    swaps, skipped, candidates, left_dense, kept = [], [], [], [], []
    in_precision = kept_in_precision(model)
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
        if name in read_directly:
            left_dense.append(name)
            continue
        if name in in_precision:
            kept.append(name)
            continue
        (skipped if name in inside_tuner else swaps).append(name)
    # An exclude that names no module is a typo that leaves the layer it meant in fp8: said, as PEFT says it of its
    # own exclude_modules (a warning, not an error: one exclude list shared by several models names heads some lack)
    names = [n for n, _ in model.named_modules()]
    stray = [e for e in excluded if not any(_matches(n, [e]) for n in names)]
    if stray:
        shown = ", ".join(repr(n) for n in candidates[:8]) + (", ..." if len(candidates) > 8 else "")
        warnings.warn(f"exclude_modules: {stray!r} matched no module of the model (a name or a name's last parts, "
                      f"as target_modules), so it keeps nothing dense; its linear and conv layers are: "
                      f"{shown or 'none'}", stacklevel=2)
    if left_dense:  # said with or without target_modules: a user who asked for the whole model expects it all in fp8
        warnings.warn(f"quantize_model left {len(left_dense)} layers dense (e.g. {left_dense[0]!r}): they are the "
                      f"out_proj of an nn.MultiheadAttention, whose forward reads out_proj.weight directly instead of "
                      f"calling the layer, so an fp8 weight there would break it", stacklevel=2)
    if skipped:
        warnings.warn(
            f"quantize_model left {len(skipped)} layers inside PEFT adapter layers as they are (e.g. {skipped[0]!r}): "
            f"quantizing them would turn the trainable lora_A/lora_B into frozen fp8. Quantize before get_peft_model, "
            f"or use dorafp8.convert_peft_model(model) to put the base weights of PEFT DoRA layers in fp8",
            stacklevel=2)
    if kept:  # logged, not warned: diffusers' own quantizers do the same, and the layers are small
        logging.getLogger("dorafp8").info(
            "quantize_model left %d layers in their precision (e.g. %r): the model lists them in "
            "_keep_in_fp32_modules and casts their inputs to their weight dtype", len(kept), kept[0])
    if targets is not None and not swaps and not skipped and not left_dense and not kept:
        peft_hits = [n for n, m in model.named_modules() if tuner is not None and isinstance(m, tuner)
                     and _matches(n, targets)]
        if peft_hits:
            raise ValueError(f"target_modules={targets!r} matched only PEFT adapter layers (e.g. {peft_hits[0]!r}); "
                             f"quantize before get_peft_model, or use dorafp8.convert_peft_model(model) to put the "
                             f"base weights of PEFT DoRA layers in fp8")
        shown = ", ".join(repr(n) for n in candidates[:8]) + (", ..." if len(candidates) > 8 else "")
        raise ValueError(f"target_modules={targets!r} matched no nn.Linear/Conv1D/Conv1d/Conv2d/Conv3d layer of the "
                         f"model; its linear and conv layers are: {shown or 'none'}")
    if not swaps and (per_row_scale or block_size is not None):
        done = [n for n, m in model.named_modules() if isinstance(m, FP8WeightModule)
                and (targets is None or _matches(n, targets)) and not _matches(n, excluded)]
        if done:
            warnings.warn(f"quantize_model changed nothing: the {len(done)} layers it would quantize are already fp8 "
                          f"(e.g. {done[0]!r}), and per_row_scale / block_size apply only when quantizing a float "
                          f"weight; their scales are left as they are", stacklevel=2)
    _warn_if_backend_cannot_run(backend, [model.get_submodule(n) for n in swaps])
    # All or nothing: every layer is checked before the first is swapped; ZeRO-3 partitioned layers are gathered one at
    # a time for the check and the swap, their replacements partitioned again (zero3_repartition).
    for name in swaps:
        mod = model.get_submodule(name)
        with zero3_gathered(mod, name):
            check_fp8_layer(mod, per_row_scale=per_row_scale, block_size=block_size, name=name)
    with collect_regrouped("the torchao model"):  # one warning for every layer re-quantized from 1 x g groups
        for name in swaps:
            mod = model.get_submodule(name)
            with zero3_gathered(mod, name):
                new = to_fp8_layer(mod, per_row_scale=per_row_scale, block_size=block_size, backend=backend,
                                   act_quant=act_quant, name=name)
            zero3_repartition(new, mod)
            swap_module(model, name, new)
    if swaps:
        warn_if_save_pretrained_loses_scales(model)
    summary = _summary([model.get_submodule(name) for name in swaps])
    logging.getLogger("dorafp8").info(summary)
    if verbose:
        print(summary, flush=True)
    return model


def _size(n_bytes: int) -> str:
    if n_bytes < 2**10:
        return f"{n_bytes} bytes"
    return f"{n_bytes / 2**20:.1f} MiB" if n_bytes >= 2**20 else f"{n_bytes / 2**10:.1f} KiB"


def _summary(layers: list) -> str:
    """quantize_model's line: layers swapped, their fp8 bytes, and the same weights in bf16 and fp32."""
    n = sum(m.weight.numel() for m in layers)
    fp8 = sum(m.weight.numel() * m.weight.element_size() + m.scale.numel() * m.scale.element_size() for m in layers)
    return (f"dorafp8.quantize_model: {len(layers)} layers to fp8 e4m3: their weights take {_size(fp8)} with the "
            f"scales, against {_size(2 * n)} in bf16 ({_size(4 * n)} in fp32)")


def _warn_if_backend_cannot_run(backend: str, layers: list) -> None:
    """A backend named for layers on a device where it cannot run is not an error here (the model may move to one
    where it can before its first forward), but the user should know now rather than at that forward."""
    if backend in (None, "auto") or not layers:
        return
    device = layers[0].weight.device
    why = backends.unavailable_reason(backend, device)
    if why is not None:
        warnings.warn(f"backend={backend!r} cannot run on {device}, where the layers are now ({why}); their forward "
                      f"will raise unless the model moves to a device where it can", stacklevel=3)


def set_act_quant(model: nn.Module, mode: Optional[str]) -> int:
    """Sets the activation quantization of every FP8Linear in `model` (PEFT layers on them included). Saved adapters
    are unaffected. All or nothing: the mode is checked before the first layer is set, and a failure while setting
    them puts the layers already set back to their modes.

    Args:
        model: any nn.Module.
        mode: "rowwise" (W8A8 base GEMMs) or None (W8A16).

    Returns:
        How many layers were set.

    Raises:
        ValueError: an unknown mode.
    """
    check_act_quant(mode)
    layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
    before = [m.act_quant for m in layers]
    done = 0
    try:
        for m in layers:
            m.act_quant = mode
            done += 1
    except BaseException:
        for m, old in zip(layers[:done], before):
            m.act_quant = old
        raise
    return len(layers)
