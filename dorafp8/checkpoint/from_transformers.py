"""transformers models loaded with an fp8 quantization config, turned into dorafp8 FP8Linear layers holding the same
bytes and scales, so that get_peft_model builds DoRAFP8Linear layers on them (from_transformers_fp8). The layer
classes each format builds: docs/ARCHITECTURE.md, "dorafp8/checkpoint/from_transformers.py"."""

from __future__ import annotations

import os
import sys
import warnings
from typing import Optional

import torch
from torch import nn

from ..backends import check_backend_name
from ..nn import FP8Linear
from ..nn.save_warning import warn_if_save_pretrained_loses_scales
from ..quant import (DEFAULT_BLOCK, E4M3, E8M0, check_act_quant, check_fp8_weight, check_micro_scale_values,
                     check_scale, check_weight)
from .files import read_json
from .modules import ModelState, swap_module
from .plan import LayerSource, SourceInfo, fp32_bits
from .write import originals


def _make(mod: nn.Module, w8: torch.Tensor, scale: torch.Tensor, block_size: int, fmt: str, extras: dict, backend,
          act_quant, dtype, global_scale=None) -> FP8Linear:
    bias = mod.bias.detach() if getattr(mod, "bias", None) is not None else None
    # NVFP4's e4m3 and MXFP8's e8m0 block scales as stored
    kept = scale.detach() if scale.dtype in (E4M3, E8M0) else scale.detach().float()
    new = FP8Linear.from_fp8(w8.detach(), kept, bias, backend=backend, dtype=dtype, block_size=block_size,
                             act_quant=act_quant, global_scale=global_scale)
    new._dorafp8_source = LayerSource(fmt, extras, scale.dtype, tuple(scale.shape),
                                      None if global_scale is None else fp32_bits(new.global_scale))
    return new


def _saved_quantization_config(model) -> Optional[dict]:
    """The quantization_config of the local checkpoint the model came from (transformers may drop it)."""
    where = getattr(model, "name_or_path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    path = os.path.join(str(where), "config.json") if where else None
    if not path or not os.path.isfile(path):
        return None
    try:
        return read_json(path, "a model config (a JSON object)").get("quantization_config")
    except (OSError, ValueError):  # unreadable or damaged: only a warning's wording depends on it
        return None


def _fp8_layers(model: nn.Module) -> tuple[list, list, list]:
    """([(name, module, weight, scale, block_size, format, extras, global_scale)], dense layers, MoE expert blocks)
    of a transformers model, each checked, nothing changed; raises on the first layer dorafp8 cannot hold."""
    # transformers' fp8 classes, where the model's loading imported them
    fg = sys.modules.get("transformers.integrations.finegrained_fp8")
    fg_linear, fg_experts = getattr(fg, "FP8Linear", None), getattr(fg, "FP8Experts", None)
    ct_linear = getattr(sys.modules.get("transformers.integrations.compressed_tensors"), "CompressedTensorsFP8Linear",
                        None)
    layers, dense, experts = [], [], []
    for name, mod in model.named_modules():
        if fg_experts is not None and isinstance(mod, fg_experts):
            experts.append(name)
            continue
        if fg_linear is not None and isinstance(mod, fg_linear):
            if mod.weight.dtype != E4M3:
                dense.append(name)
                continue
            block_shape = mod.block_size
            if block_shape is not None and (len(set(block_shape)) != 1):
                raise ValueError(f"{name}: block size {list(block_shape)} is not square; FP8Linear holds b x b blocks")
            scale = mod.weight_scale_inv
            if not scale.is_floating_point() or scale.element_size() < 2:
                raise ValueError(f"{name}: weight_scale_inv of dtype {scale.dtype} (ue8m0?) is not supported")
            block_size = block_shape[0] if block_shape is not None else DEFAULT_BLOCK
            extras = {} if getattr(mod, "activation_scale", None) is None else {
                "activation_scale": mod.activation_scale.detach()}
            layers.append((name, mod, mod.weight, scale, block_size, "fine-grained", extras, None))
        elif ct_linear is not None and isinstance(mod, ct_linear):
            s = mod.weight_scale.detach().reshape(-1)
            if s.numel() == mod.out_features and bool((s == s[0]).all()):
                s = s[:1]  # the kernel layout broadcasts per-tensor scales to [1, out]
            scale = s.reshape(()) if s.numel() == 1 else s
            layers.append((name, mod, mod.weight, scale, DEFAULT_BLOCK, "compressed-tensors", {}, None))
        elif isinstance(mod, nn.Linear) and getattr(mod, "quantization_scheme", None) is not None \
                and getattr(mod, "weight_packed", None) is not None and hasattr(mod, "weight_global_scale"):
            g = mod.weight_global_scale.detach().float().reshape(())
            if not (bool(torch.isfinite(g)) and float(g) > 0):
                raise ValueError(f"{name}.weight_global_scale: {float(g)!r} is not a finite positive NVFP4 global "
                                 f"scale")
            check_weight(mod.weight_packed, mod.weight_scale, DEFAULT_BLOCK, 1.0 / g, name=f"{name}.weight_packed")
            check_micro_scale_values(mod.weight_scale, f"{name}.weight_scale")  # before any module is swapped
            extras = {} if getattr(mod, "input_global_scale", None) is None else {
                "input_global_scale": mod.input_global_scale.detach()}
            layers.append((name, mod, mod.weight_packed, mod.weight_scale, DEFAULT_BLOCK, "compressed-tensors", extras,
                           1.0 / g))
            continue
        elif isinstance(mod, nn.Linear) and getattr(mod, "quantization_scheme", None) is not None \
                and hasattr(mod, "weight_scale"):
            scheme = mod.quantization_scheme
            w = getattr(scheme, "weights", None)
            if w is None or str(getattr(w, "type", "")).split(".")[-1].lower() != "float" or w.num_bits != 8:
                continue
            if mod.weight.dtype != E4M3:
                dense.append(name)
                continue
            zp = getattr(mod, "weight_zero_point", None)
            if zp is not None and bool((zp.float() != 0).any()):
                raise ValueError(f"{name}: non-zero weight_zero_point (asymmetric fp8) is not supported")
            if mod.weight_scale.dtype == torch.uint8:  # mxfp8-quantized: e8m0 exponents as their bytes
                scale = mod.weight_scale.detach().view(E8M0)
                check_weight(mod.weight, scale, name=f"{name}.weight")
                check_micro_scale_values(scale, f"{name}.weight_scale")
                layers.append((name, mod, mod.weight, scale, DEFAULT_BLOCK, "compressed-tensors", {}, None))
                continue
            block_size = DEFAULT_BLOCK
            if getattr(w, "block_structure", None):
                block_shape = list(w.block_structure)
                if len(set(block_shape)) != 1:
                    raise ValueError(f"{name}: block structure {block_shape} is not square")
                block_size = block_shape[0]
            extras = {} if getattr(mod, "input_scale", None) is None else {"input_scale": mod.input_scale.detach()}
            layers.append((name, mod, mod.weight, mod.weight_scale, block_size, "compressed-tensors", extras, None))
        else:
            continue
        # a layer was just found: what FP8Linear.from_fp8 would refuse, refused now, before any layer is swapped
        _, mod, _, scale, block_size, fmt, _, _ = layers[-1]
        check_fp8_weight(mod.weight, f"{name}.weight")
        check_scale(scale.detach().float(), mod.weight.shape[0], mod.weight.shape[1], block_size,
                    name=f"{name}.{'weight_scale_inv' if fmt == 'fine-grained' else 'weight_scale'}")
    return layers, dense, experts


def from_transformers_fp8(model: nn.Module, *, backend: str = "auto", act_quant: Optional[str] = None,
                          dtype: Optional[torch.dtype] = None) -> int:
    """Swaps the fp8 linear layers of a transformers model loaded with a FineGrainedFP8Config or a compressed-tensors
    fp8 config for dorafp8 FP8Linear layers (same e4m3 bytes, same scale), in place. A compressed-tensors
    nvfp4-pack-quantized or mxfp8-quantized model (its modules still compressed, as from_pretrained leaves them without
    a GPU) becomes NVFP4 / MXFP8 FP8Linear layers holding its bytes and its e4m3 / e8m0 scales.

    Layers whose weight is not fp8 any more (dequantized at load: build the model on the meta device and use
    load_fp8_checkpoint instead) and MoE expert blocks are left as they are, with a warning. save_fp8_checkpoint writes
    the same layout back. All or nothing: an error leaves the model as it was.

    Args:
        model: the transformers model, as from_pretrained returned it.
        backend, act_quant: given to the FP8Linear layers (see FP8Linear).
        dtype: the dtype of the adapters PEFT will create on these layers (default: the model's dtype).

    Returns:
        How many layers were swapped.
    """
    check_backend_name(backend)
    check_act_quant(act_quant)
    cfg = getattr(model, "config", None)
    mdtype = dtype or getattr(model, "dtype", None) or torch.float32
    if mdtype in (E4M3, torch.float8_e5m2):
        mdtype = torch.bfloat16
    layers, dense, experts = _fp8_layers(model)
    # Built before the first swap: each holds its old layer's fp8 bytes (no copy), so all of them cost the scales only.
    swaps = [(name, _make(mod, w, scale, block_size, fmt, extras, backend, act_quant, mdtype, g))
             for name, mod, w, scale, block_size, fmt, extras, g in layers]
    if swaps:
        before = ModelState(model)
        try:
            for name, new in swaps:
                swap_module(model, name, new)
            src = getattr(model, "_dorafp8_source", None) or SourceInfo()
            src.format = swaps[0][1]._dorafp8_source.format
            src.config = cfg.to_dict() if hasattr(cfg, "to_dict") else None
            src.strip = src.add = ""
            # the weights from_pretrained read (write.originals: save_hooks recorded them at load time): the
            # writers refuse to replace them (write.refuse_original), as they do those load_fp8_checkpoint read
            src.files = originals(model)
            model._dorafp8_source = src
            # compressed-tensors decompresses every quantized module on the first forward pass: not wanted any more
            # (last: the record puts modules and tensors back, not hooks)
            quantizer = getattr(model, "hf_quantizer", None)
            compressor = getattr(quantizer, "compressor", None)
            if compressor is not None and hasattr(compressor, "remove_decompression_hook"):
                compressor.remove_decompression_hook(model)
        except BaseException:
            before.restore()
            raise
        warn_if_save_pretrained_loses_scales(model)
    if dense:
        warnings.warn(f"from_transformers_fp8: {len(dense)} fp8 layers of the config hold dense weights already "
                      f"(e.g. {dense[0]!r}: dequantized while loading, as transformers does without a GPU, or "
                      f"decompressed by a forward pass); they stay dense. To keep the fp8 bytes, build the model on "
                      f"the meta device and use dorafp8.load_fp8_checkpoint", stacklevel=2)
    qc = getattr(cfg, "quantization_config", None) or _saved_quantization_config(model)
    if not swaps and not dense and qc is not None:
        qd = qc if isinstance(qc, dict) else (qc.to_dict() if hasattr(qc, "to_dict") else {})
        warnings.warn(f"from_transformers_fp8 found no fp8 linear layer although the config has a quantization_config "
                      f"(quant_method={qd.get('quant_method')!r}, dequantize={qd.get('dequantize')!r}): transformers "
                      f"dequantized the weights while loading (it does so for FineGrainedFP8 without a GPU). Build the "
                      f"model on the meta device and use dorafp8.load_fp8_checkpoint to keep the fp8 bytes",
                      stacklevel=2)
    if experts:
        warnings.warn(f"from_transformers_fp8: {len(experts)} fp8 MoE expert blocks (e.g. {experts[0]!r}) are left "
                      f"as they are: dorafp8 has no fp8 expert module", stacklevel=2)
    return len(swaps)
