"""DoRA adapters as kohya / LyCORIS files (`lora_down.weight`, `lora_up.weight`, `alpha`, `dora_scale` per layer),
as ComfyUI, Forge and LyCORIS read them: save_kohya_dora, load_kohya_dora, save_single_file_dora. What `dora_scale`
holds for each consumer: docs/ARCHITECTURE.md, "dorafp8/checkpoint/kohya.py"; key names: kohya_names.py.
Long because it holds both directions of one layout and the single-file export, each with its checks."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import warnings
from collections import Counter
from typing import Optional

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from peft.tuners.lora.variants import (
    DoraConv1dVariant,
    DoraConv2dVariant,
    DoraConv3dVariant,
    DoraLinearVariant,
)
from torch import nn

from ..nn import FP8ConvNd, FP8Linear, refuse_sharded_model
from ..ops import norm_divisor
from ..quant import all_finite
from ..peft import DoraFP8Variant
from ..peft.register import adapters_of  # an Embedding's too: the export refuses it, naming it
from ..peft.conv import DoraFP8ConvVariant
from .files import identity, open_safetensors, regular_file, save_file_atomic, some
from .kohya_names import KeyResolver, export_key_names, resolve_prefix

SUFFIXES = ("lora_down.weight", "lora_up.weight", "alpha", "dora_scale")
DORA_SCALE_KINDS = ("lycoris", "comfyui")
META_DORA_SCALE = "dorafp8_dora_scale"  # the file's dora_scale kind, so that load_kohya_dora can undo "comfyui"
_EPS32 = torch.finfo(torch.float32).eps  # what LyCORIS and ComfyUI add to the norm (their fp32 working copies)
_DORA_VARIANTS = (DoraLinearVariant, DoraConv1dVariant, DoraConv2dVariant, DoraConv3dVariant, DoraFP8Variant,
                  DoraFP8ConvVariant)
# keys of other LyCORIS algorithms and options, named in the error that refuses them
_OTHER_ALGOS = {"lora_mid.weight": "LoCon's Tucker-decomposed conv (use_tucker)", "hada_": "LoHa", "lokr_": "LoKr",
                "oft_": "OFT", "diff": "a full weight difference", "w_norm": "a norm layer", "b_norm": "a norm layer",
                "a1.weight": "GLoRA", "scalar": "a LoCon scalar", "lora_A.weight": "PEFT's own layout",
                "lora_magnitude_vector": "PEFT's own layout"}


# ---------------------------------------------------------------------------------------------------------- export

def save_kohya_dora(model: nn.Module, path: str, *, adapter_name: Optional[str] = None, prefix: Optional[str] = "auto",
                    names: str = "auto", dora_scale: str = "lycoris",
                    dtype: Optional[torch.dtype] = None) -> dict[str, str]:
    """Writes a DoRA (or LoRA) adapter of `model` to the safetensors file `path` in the kohya / LyCORIS layout, whole
    or not at all (every check runs first).

    Args:
        model: a PeftModel, or a model with PEFT's LoRA layers (e.g. after diffusers' `add_adapter`).
        path: the .safetensors file to write.
        adapter_name: the adapter to write; default: the model's only one.
        prefix: "auto" (`lora_unet_` for a UNet2DConditionModel, `lora_transformer_` for SD3 and Flux transformers,
            else the module names), a prefix (e.g. "lycoris" for LyCORIS's own loader), or None (module names).
        names: "diffusers" (the model's module names), "sgm" (a UNet2DConditionModel's original names, as kohya's
            SDXL scripts write them) or "auto" ("sgm" for an SDXL UNet under `lora_unet`, else "diffusers").
        dora_scale: "lycoris" (PEFT's magnitude, which LyCORIS divides by ||W + s B A||) or "comfyui" (pre-multiplied
            by ||W|| / ||W + s B A||, for ComfyUI's loader, which divides by ||W||).
        dtype: the dtype of lora_down / lora_up (default: the adapters'); dora_scale and alpha are float32.

    Returns:
        {module name: key prefix} of the layers written.

    Raises:
        TypeError: a model that is not an nn.Module, or a dtype that is not a floating torch.dtype.
        ValueError: an unknown dora_scale, no adapter (or several and no adapter_name), or a layer this layout cannot
            hold (the message lists them).
        FileNotFoundError: path's folder does not exist.
    """
    if dora_scale not in DORA_SCALE_KINDS:
        raise ValueError(f"dora_scale must be one of {DORA_SCALE_KINDS}, got {dora_scale!r}")
    root, prefix, adapter, layers = _export_layers("save_kohya_dora", model, adapter_name, dora_scale, prefix, dtype)
    keys = export_key_names(root, list(layers), prefix, names)
    tensors = {f"{keys[n]}.{suffix}": t for n, layer in layers.items()
               for suffix, t in layer_tensors(layer, adapter, dora_scale, dtype).items()}
    dora = any(layer.use_dora.get(adapter) for layer in layers.values())
    ranks = {int(layer.r[adapter]) for layer in layers.values()}
    meta = {"ss_network_module": "lycoris.kohya",
            "ss_network_args": json.dumps({"algo": "locon", "dora_wd": str(dora), "wd_on_output": "True"}),
            META_DORA_SCALE: dora_scale if dora else "none", "dorafp8_source": "dorafp8.save_kohya_dora"}
    if len(ranks) == 1:
        meta["ss_network_dim"] = str(ranks.pop())
    _write_atomic(tensors, path, meta, model)
    return keys


def layer_tensors(layer, adapter: str, dora_scale: str = "lycoris", dtype=None) -> dict[str, torch.Tensor]:
    """One PEFT LoRA layer as kohya tensors: lora_down = A, lora_up = B (conv: [out, r, 1, ...], LoCon's 1 x 1 up),
    alpha = s * r (alpha / r is PEFT's scaling, rsLoRA's too), and for DoRA dora_scale [out, 1, ...]."""
    A = layer.lora_A[adapter].weight.detach()
    B = layer.lora_B[adapter].weight.detach()
    r, s = A.shape[0], float(layer.scaling[adapter])
    lora_alpha = float(layer.lora_alpha[adapter])
    alpha = lora_alpha if lora_alpha / r == s else s * r
    out = {"lora_down.weight": A.to(dtype or A.dtype).contiguous().cpu(),
           "lora_up.weight": B.to(dtype or B.dtype).contiguous().cpu(),
           "alpha": torch.tensor(alpha, dtype=torch.float32)}
    if layer.use_dora.get(adapter):
        m = layer.lora_magnitude_vector[adapter].weight.detach().reshape(-1).cpu()
        if dora_scale == "comfyui":
            w = base_weight_rows(layer)
            n_base, n_new = _row_norms(w, A, B, s)
            m = (m.double() * (n_base + _EPS32) / norm_divisor(n_new)).float()
        nd = len(layer.lora_A[adapter].weight.shape)  # 2 for Linear, 2 + kernel dims for a conv
        out["dora_scale"] = m.float().reshape((-1,) + (1,) * (nd - 1)).contiguous()
    return out


def base_weight_rows(layer) -> torch.Tensor:
    """The layer's base weight as dense float32 rows [out, in * kernel] (an fp8 base dequantized)."""
    base = layer.get_base_layer()
    if isinstance(base, (FP8Linear, FP8ConvNd)):
        w = base.dequantize(torch.float32)
    else:
        w = base.weight.detach().float()
    return w.reshape(w.shape[0], -1)


def _row_norms(w: torch.Tensor, A: torch.Tensor, B: torch.Tensor, s: float):
    """(||W||, ||W + s B A||) per output row in float64 (conv: B A is B2 @ A2 on the [out, in * kernel] view)."""
    w = w.double()
    delta = (B.reshape(B.shape[0], -1).double().to(w.device) @ A.reshape(A.shape[0], -1).double().to(w.device)) * s
    return w.norm(dim=1).cpu(), (w + delta).norm(dim=1).cpu()


def _root(model: nn.Module) -> nn.Module:
    """The module tree the adapters live in: a PeftModel's base model, else the model itself."""
    if isinstance(model, PeftModel):
        return model.base_model.model
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module (a PeftModel or a model with PEFT LoRA layers), got "
                        f"{type(model).__name__}")
    return model


def _export_layers(who: str, model, adapter_name, dora_scale: str, prefix, dtype):
    """(root, resolved prefix, adapter, {module name: LoRA layer}) to export, every layer checked first."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating torch.dtype (e.g. torch.bfloat16) or None, got {dtype!r}")
    root = _root(model)
    prefix = resolve_prefix(prefix, root)
    layers = _lora_layers(root)
    adapter = _pick_adapter(layers, adapter_name)
    layers = {n: m for n, m in layers.items() if adapter in adapters_of(m)}
    problems = [p for n, m in layers.items() for p in _export_problems(n, m, adapter, dora_scale, prefix)]
    if problems:
        raise ValueError(f"{who} cannot write this adapter: " + "; ".join(problems))
    # FSDP2 shards stopped in safetensors ('invalid python storage'), ZeRO-3's empty partitions in the rank's division.
    # Only what is read: the adapter (gathered alone under ZeRO-3, docs/MULTI_GPU.md), and the base for "comfyui".
    refuse_sharded_model(model, who, [(f"{n}.{k}", p) for n, layer in layers.items()
                                      for k, p in layer.named_parameters() if k.split(".")[1:2] == [adapter]
                                      or (dora_scale == "comfyui" and k.startswith("base_layer."))])
    return root, prefix, adapter, layers


def _lora_layers(root: nn.Module) -> dict[str, LoraLayer]:
    return {n: m for n, m in root.named_modules() if isinstance(m, LoraLayer)}


def _pick_adapter(layers: dict, adapter_name: Optional[str]) -> str:
    names = sorted({a for m in layers.values() for a in adapters_of(m)})
    if not names:
        raise ValueError("model has no PEFT LoRA/DoRA layers with adapters: nothing to save")
    if adapter_name is not None:
        if adapter_name not in names:
            raise ValueError(f"adapter_name {adapter_name!r} is not an adapter of this model; it has {names}")
        return adapter_name
    if len(names) == 1:
        return names[0]
    active = {a for m in layers.values() for a in m.active_adapters if a in adapters_of(m)}
    if len(active) == 1:
        return active.pop()
    raise ValueError(f"model has several adapters {names}: pass adapter_name= one of them")


def _export_problems(name, layer, adapter, dora_scale, prefix) -> list[str]:
    base = layer.get_base_layer()
    conv = isinstance(base, (nn.Conv1d, nn.Conv2d, nn.Conv3d, FP8ConvNd))
    if not (conv or isinstance(base, (nn.Linear, FP8Linear))) or adapter in getattr(layer, "lora_embedding_A", {}):
        return [f"{name}: a LoRA layer on {type(base).__name__}; the kohya layout holds Linear and Conv1d/2d/3d "
                f"layers"]
    out = []
    if conv and getattr(base, "groups", 1) != 1:
        out.append(f"{name}: conv with groups={base.groups}; kohya's lora_up @ lora_down is a groups=1 update")
    if getattr(layer, "fan_in_fan_out", False):
        out.append(f"{name}: fan_in_fan_out=True (a transposed weight) is not the kohya layout")
    if layer.lora_bias.get(adapter):
        out.append(f"{name}: adapter {adapter!r} has a LoRA bias, which the kohya layout has no key for")
    if layer.merged:
        out.append(f"{name}: the adapter is merged into the base; unmerge it first (model.unmerge_adapter())")
    variant = getattr(layer, "lora_variant", {}).get(adapter)
    if variant is not None and not isinstance(variant, _DORA_VARIANTS):
        out.append(f"{name}: adapter {adapter!r} uses the LoRA variant {type(variant).__name__} (only plain LoRA "
                   f"and DoRA have a kohya layout)")
    if dora_scale == "comfyui" and layer.use_dora.get(adapter) and prefix == "lora_transformer" \
            and name == "norm_out.linear":
        # ComfyUI maps this layer with swap_scale_shift on the update but not on dora_scale (comfy/utils.py
        # flux_to_diffusers, mmdit_to_diffusers): its rows would get the other half's magnitudes.
        out.append(f"{name}: ComfyUI reorders this layer's rows (swap_scale_shift) but not its dora_scale; leave "
                   f"norm_out.linear out of DoRA targets for a ComfyUI file")
    return out


# ------------------------------------------------------------------------------ export onto an original single file

_ORIGINAL_PREFIXES = ("model.diffusion_model.", "diffusion_model.")  # a full checkpoint's, ComfyUI's model's


def save_single_file_dora(model: nn.Module, path: str, single_file, *, adapter_name: Optional[str] = None,
                          dtype: Optional[torch.dtype] = None) -> dict[str, list[str]]:
    """Writes the adapter of `model` as a kohya file keyed by a ComfyUI single file's own weights (one layer per
    original weight (a fused one's pieces merged: docs/ARCHITECTURE.md), keyed `lora_unet_` + it, dora_scale "comfyui".

    Args:
        model: a diffusers model loaded from `single_file` by load_single_file, with a PEFT adapter.
        path: the .safetensors file to write.
        single_file: the single file's path or state dict.
        adapter_name: the adapter to write; default: the model's only one.
        dtype: the dtype of lora_down / lora_up (default: the adapters').

    Returns:
        {original weight key: the modules written into it}.

    Raises:
        TypeError: a dtype that is not a floating torch.dtype.
        ValueError: before anything is written, a layer diffusers' conversion does not take from the file, or whose
            base weight is not the file's (another file, or trained on something else).
    """
    from .single_file import is_scale_key, row_map

    root, _, adapter, layers = _export_layers("save_single_file_dora", model, adapter_name, "comfyui", None, dtype)
    problems = []
    with _original_file(single_file) as (shapes, get):
        keys, converted = row_map(root, {k: v for k, v in shapes.items() if not is_scale_key(k)})
        pieces: dict[str, list] = {}  # original key -> [(module name, its rows, the original's rows)]
        for n in layers:
            tag = converted.get(f"{n}.weight")
            if not isinstance(tag, torch.Tensor) or tag.dim() != 1:
                problems.append(f"{n}: diffusers' conversion for {type(root).__name__} takes no rows of this file "
                                f"for {n}.weight")
                continue
            src = tag >> 32
            for i in torch.unique(src).tolist():
                ours = (src == i).nonzero().reshape(-1)
                pieces.setdefault(keys[i], []).append((n, ours, tag[ours] & ((1 << 32) - 1)))
        tensors, written = {}, {}
        get = functools.lru_cache(maxsize=2)(get)  # the weight read once for its values and its dtype
        for key, parts in pieces.items():
            w = _dequantized(key, get, shapes)
            problems += _not_the_base(key, w, parts, layers, _kept_as_is(key, get, shapes))
            layer_key = _comfy_key(key)
            if layer_key is None:
                problems.append(f"{key}: not a weight of the diffusion model (expected a name ending in .weight)")
                continue
            for suffix, t in _fused_layer(w, parts, layers, adapter, dtype).items():
                tensors[f"{layer_key}.{suffix}"] = t
            written[key] = [n for n, _, _ in parts]
    if problems:
        raise ValueError("save_single_file_dora cannot write this adapter: " + "; ".join(problems[:8]))
    dora = any(layer.use_dora.get(adapter) for layer in layers.values())
    meta = {"ss_network_module": "networks.lora", META_DORA_SCALE: "comfyui" if dora else "none",
            "dorafp8_source": "dorafp8.save_single_file_dora"}
    _write_atomic(tensors, path, meta, model, single_file)
    return written


@contextlib.contextmanager
def _original_file(single_file):
    """({key: shape}, get(key) -> tensor) of a single file given as a path (read lazily) or a state dict."""
    if isinstance(single_file, dict):
        yield {k: tuple(v.shape) for k, v in single_file.items()}, single_file.__getitem__
        return
    where = f"single_file {os.fspath(single_file)!r}"
    with open_safetensors(regular_file(os.fspath(single_file), "single_file"), where) as f:
        yield {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}, f.get_tensor


def _dequantized(key: str, get, shapes: dict) -> torch.Tensor:
    """The original weight `key` dequantized (single_file.dequantized_original), as float32 [out, in * kernel] rows."""
    from .single_file import dequantized_original

    w = dequantized_original(key, get, shapes)
    return w.reshape(w.shape[0], -1)


def _kept_as_is(key: str, get, shapes: dict) -> bool:
    """Whether load_single_file keeps the file's weight `key` as it is (e4m3 bytes and a per-tensor / per-row scale):
    the model's base is then exactly the file's dequantized weight. An e5m2 weight (shifted into e4m3), musubi's 1 x g
    block scales (re-quantized per row) and a dense weight (quantized) went through one e4m3 rounding."""
    lay = key[:-len(".weight")]
    return get(key).dtype == torch.float8_e4m3fn and all(
        len(shapes.get(f"{lay}.{s}", ())) < 3 for s in ("scale_weight", "weight_scale"))


def _not_the_base(key: str, w: torch.Tensor, parts: list, layers: dict, exact: bool) -> list[str]:
    out = []
    for n, ours, theirs in parts:
        base = base_weight_rows(layers[n])[ours].to(w.device)
        want = [w[theirs]]
        dense = layers[n].get_base_layer()
        if exact and not isinstance(dense, (FP8Linear, FP8ConvNd)):
            # an e4m3 weight the load dequantized into a dense layer (one the model keeps in precision, Wan's time
            # embedder): scale x e4m3 in fp32, rounded once to the dtype the model was loaded in, then cast to the
            # layer's dtype now (a bf16 load, then model.to(torch.float16)). Each rounding is far finer than one
            # e4m3 step, so a file one step away matches none of them.
            now = dense.weight.dtype
            want = [want[0].to(then).to(now).float() for then in (torch.float32, torch.bfloat16, torch.float16)]
        # exact where the weight was loaded as it is: any tolerance lets another checkpoint of the same base through
        # (a re-quantization, a fine-tune), whose rows the written dora_scale does not belong to; else one e4m3
        # rounding (rtol 2**-4, atol for the values it flushes)
        same = base.shape == want[0].shape and (any(torch.equal(base, v) for v in want) if exact else torch.allclose(
            base, want[0], rtol=2.0 ** -4, atol=1e-2 * float(want[0].abs().max())))
        if not same:
            out.append(f"{n}: its base weight is not rows of {key} in this file (was the model loaded from it?)")
    return out


def _comfy_key(key: str) -> Optional[str]:
    if not key.endswith(".weight"):
        return None
    for p in _ORIGINAL_PREFIXES:
        if key.startswith(p):
            key = key[len(p):]
            break
    return "lora_unet_" + key[:-len(".weight")].replace(".", "_")


def _fused_layer(w: torch.Tensor, parts: list, layers: dict, adapter: str, dtype) -> dict[str, torch.Tensor]:
    """One original weight's kohya tensors from the adapted pieces `parts` of it (see save_single_file_dora)."""
    per = [(layer_tensors(layers[n], adapter, "comfyui"), ours, theirs) for n, ours, theirs in parts]
    rank = sum(t["lora_down.weight"].shape[0] for t, _, _ in per)
    down = torch.cat([t["lora_down.weight"].float() for t, _, _ in per])
    up = torch.zeros(w.shape[0], rank)
    col = 0
    for t, ours, theirs in per:
        r = t["lora_down.weight"].shape[0]
        scaling = float(t["alpha"]) / r
        up[theirs, col:col + r] = t["lora_up.weight"].float().reshape(-1, r)[ours] * scaling
        col += r
    out = {"lora_down.weight": down.to(dtype or per[0][0]["lora_down.weight"].dtype).contiguous(),
           "lora_up.weight": up.reshape((w.shape[0], rank) + (1,) * (down.dim() - 2)).to(
               dtype or per[0][0]["lora_up.weight"].dtype).contiguous(),
           "alpha": torch.tensor(float(rank), dtype=torch.float32)}
    if "dora_scale" in per[0][0]:
        ds = (w.double().norm(dim=1) + _EPS32).float()  # rows no piece adapts: ComfyUI's identity
        for t, ours, theirs in per:
            ds[theirs] = t["dora_scale"].reshape(-1)[ours]
        out["dora_scale"] = ds.reshape((-1,) + (1,) * (down.dim() - 1)).contiguous()
    return out


def _to_module_layout(root: nn.Module, sd: dict, single_file) -> dict:
    """A kohya file keyed by a single file's weights -> the same adapters keyed by `root`'s modules (each gets its
    rows of lora_up and dora_scale; unchanged rows get no adapter: docs/ARCHITECTURE.md, ".../kohya.py")."""
    from .single_file import is_scale_key, row_map

    groups, _ = _group(sd)
    with _original_file(single_file) as (shapes, get):
        by_comfy_key = {_comfy_key(k): k for k in shapes if not is_scale_key(k) and _comfy_key(k)}
        keys, converted = row_map(root, {k: v for k, v in shapes.items() if not is_scale_key(k)})
        out, errors, owner = {}, [], {}
        for name, parts in groups.items():
            key = by_comfy_key.get(name)
            if key is None or "lora_down.weight" not in parts or "lora_up.weight" not in parts:
                errors.append(f"{name}: names no weight of the single file" if key is None else
                              f"{name}: has {sorted(parts)} but needs both lora_down.weight and lora_up.weight")
                continue
            down, up = parts["lora_down.weight"], parts["lora_up.weight"]
            up2 = up.reshape(up.shape[0], -1)
            ds = parts.get("dora_scale")
            identity = None if ds is None else (_dequantized(key, get, shapes).double().norm(dim=1) + _EPS32).float()
            src_index = keys.index(key)
            for mod_key, tag in converted.items():
                if not (mod_key.endswith(".weight") and isinstance(tag, torch.Tensor) and tag.dim() == 1):
                    continue
                mine = (tag >> 32) == src_index
                if not bool(mine.any()):
                    continue
                n = mod_key[:-len(".weight")]
                if n in owner or not bool(mine.all()):
                    errors.append(f"{n}: takes rows of two of the single file's weights ({key} and "
                                  f"{owner.get(n, 'another')}); one adapter per module cannot hold two layers")
                    continue
                owner[n] = key
                theirs = tag & ((1 << 32) - 1)
                rows = up2[theirs].float()
                cols = (rows != 0).any(dim=0).nonzero().reshape(-1)
                changed = ds is not None and not torch.equal(ds.reshape(-1)[theirs].float(), identity[theirs])
                if cols.numel() == 0 and not changed:
                    continue
                cols = cols if cols.numel() else torch.arange(down.shape[0])
                out[f"{n}.lora_down.weight"] = down[cols].contiguous()
                out[f"{n}.lora_up.weight"] = up[theirs][:, cols].contiguous()
                out[f"{n}.alpha"] = torch.tensor(float(parts.get("alpha", torch.tensor(float(down.shape[0]))))
                                                 * cols.numel() / down.shape[0])
                if ds is not None:
                    out[f"{n}.dora_scale"] = ds[theirs].contiguous()
    if errors:
        raise ValueError("load_kohya_dora (single_file=): " + some(errors, first=8, sep="; ", names=False))
    return out


def _write_atomic(tensors: dict, path, metadata: dict, model: nn.Module, single_file=None) -> None:
    """`path` written whole or not at all (files.save_file_atomic: staged, fsynced, renamed); never over the file the
    model's base was loaded from or `single_file` (the two paths of save_single_file_dora swapped)."""
    from .write import originals, refuse_original

    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"path {path!r}: the folder {folder!r} does not exist")
    given = identity(os.fspath(single_file)) if isinstance(single_file, (str, os.PathLike)) else None
    refuse_original(path, (*originals(model), *filter(None, [given])))
    save_file_atomic(tensors, path, metadata)


# ---------------------------------------------------------------------------------------------------------- import

def load_kohya_dora(model: nn.Module, file, *, adapter_name: str = "default", prefix: Optional[str] = "auto",
                    dora_scale: str = "auto", strict: bool = True, single_file=None) -> PeftModel:
    """Turns a kohya / LyCORIS LoRA or DoRA file into a PEFT adapter on `model`.

    Each layer gets the file's rank, alpha / rank as PEFT's scaling (alpha missing: 1) and DoRA's magnitude from
    dora_scale. All or nothing: every key is checked first, and a later failure puts the model back as it was.

    Args:
        model: the base (dense or with dorafp8's fp8 layers), wrapped with get_peft_model, its layers replaced in
            place; or a PeftModel, to which the adapter is added (not activated: `set_adapter` does).
        file: a .safetensors path or a state dict.
        adapter_name: the new adapter's name.
        prefix: "auto" (module names, or `lora_unet_` / `lora_transformer_` / `lycoris_` + the names with '.' -> '_',
            on a UNet2DConditionModel also kohya's SGM UNet names), a prefix, or None (module names only).
        dora_scale: "auto" (the kind save_kohya_dora recorded in the file, else "lycoris"), "lycoris" or "comfyui"
            (see save_kohya_dora).
        strict: keys of modules the model does not have are an error naming them; False: skipped with a warning
            naming them (a kohya SDXL file's text-encoder keys, when loading its UNet part).
        single_file: for a file keyed by a ComfyUI single file's own weights (save_single_file_dora's), that single
            file (path or state dict), from which `model` was loaded (load_single_file).

    Returns:
        The PeftModel.

    Raises:
        ValueError: an unknown dora_scale, an empty or existing adapter_name, a model with PEFT layers that is not a
            PeftModel, keys of other LyCORIS algorithms (LoHa, LoKr, Tucker's lora_mid, ...), an input-axis
            dora_scale (LyCORIS's wd_on_out=False: no PEFT equivalent), or (strict) keys that fit no module.
        TypeError: a state dict that does not map str keys to tensors.
    """
    if dora_scale not in ("auto",) + DORA_SCALE_KINDS:
        raise ValueError(f"dora_scale must be 'auto' or one of {DORA_SCALE_KINDS}, got {dora_scale!r}")
    if not isinstance(adapter_name, str) or not adapter_name:
        raise ValueError(f"adapter_name must be a non-empty string, got {adapter_name!r}")
    sd, meta = _read(file)
    if single_file is not None:
        sd, prefix = _to_module_layout(_root(model), sd, single_file), None
    elif meta.get("dorafp8_source") == "dorafp8.save_single_file_dora":
        raise ValueError("load_kohya_dora: this file was written by save_single_file_dora, keyed by a single file's "
                         "own weights, not by the model's modules: pass single_file= (the file the model was loaded "
                         "from)")
    if dora_scale == "auto":
        dora_scale = "comfyui" if meta.get(META_DORA_SCALE) == "comfyui" else "lycoris"
    peft_model = model if isinstance(model, PeftModel) else None
    root = _root(model)
    if peft_model is None and _lora_layers(root):
        raise ValueError("model has PEFT LoRA layers but is not a PeftModel (diffusers' add_adapter?): pass the base "
                         "model without adapters, or a PeftModel")
    if peft_model is not None and adapter_name in peft_model.peft_config:
        raise ValueError(f"adapter_name {adapter_name!r} already exists in this PeftModel; pass another name")
    plan = _plan(root, sd, prefix, strict)
    config = _config(plan)
    undo = _Undo(root, list(plan))
    try:
        if peft_model is None:
            peft_model = get_peft_model(root, config, adapter_name=adapter_name)
        else:
            peft_model.add_adapter(adapter_name, config)
        _fill(peft_model.base_model.model, plan, adapter_name, config.use_dora, dora_scale)
    except BaseException:
        undo.restore(adapter_name, peft_model if isinstance(model, PeftModel) else None)
        raise
    return peft_model


def _read(file) -> tuple[dict, dict]:
    if isinstance(file, dict):
        bad = [k for k, v in file.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
        if bad:
            raise TypeError(f"file: a state dict must map str keys to tensors; not so for {some(bad)}")
        return dict(file), {}
    path = regular_file(os.fspath(file), "file (a .safetensors file or a state dict is expected)")
    with open_safetensors(path, path) as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}


def _targets(root: nn.Module) -> dict[str, nn.Module]:
    """name -> the Linear / ConvNd (fp8 or not) a kohya key can name, the base layer inside PEFT's LoRA layers."""
    out = {}
    kinds = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, FP8Linear, FP8ConvNd)
    for n, m in root.named_modules():
        if isinstance(m, LoraLayer):
            out[n] = m.get_base_layer()
        elif isinstance(m, kinds) and ".lora_" not in f".{n}" and not n.endswith(".base_layer") \
                and ".base_layer." not in n:
            out[n] = m
    return out


def _group(sd: dict) -> tuple[dict, list]:
    """{key prefix: {suffix: tensor}} and the keys with no kohya LoRA/DoRA suffix."""
    groups, unknown = {}, []
    for k, v in sd.items():
        for suffix in SUFFIXES:
            if k.endswith("." + suffix):
                groups.setdefault(k[: -len(suffix) - 1], {})[suffix] = v
                break
        else:
            unknown.append(k)
    return groups, unknown


def _plan(root, sd, prefix, strict) -> dict:
    """module name -> (lora_down, lora_up, alpha, dora_scale or None, the base module), every key checked."""
    targets = _targets(root)
    resolver = KeyResolver(root, targets, prefix)
    groups, unknown = _group(sd)
    errors, unmatched, plan = [], [], {}
    if unknown:
        errors.append(_unknown_message(unknown))
    for name, parts in groups.items():
        mod_name, why = resolver.resolve(name)
        if why:
            errors.append(why)
            continue
        if mod_name is None:
            unmatched.extend(f"{name}.{s}" for s in parts)
            continue
        if mod_name in plan:
            errors.append(f"module {mod_name} is named by two key prefixes in the file")
            continue
        entry, problems = _check_layer(name, mod_name, parts, targets[mod_name])
        errors.extend(problems)
        plan[mod_name] = entry
    if unmatched and strict:
        errors.append(f"{len(unmatched)} keys name no Linear/Conv module of {type(root).__name__} (prefixes tried: "
                      f"{list(resolver.prefixes) or 'none'}; pass strict=False to skip them): "
                      f"{some(sorted(unmatched))}")
    dora = {n for n, e in plan.items() if e is not None and e[3] is not None}
    if dora and len(dora) != len(plan):
        errors.append(f"the file mixes DoRA layers (with dora_scale) and plain LoRA layers "
                      f"({some(sorted(set(plan) - dora))}); one PEFT adapter is either")
    if not plan and not errors:
        errors.append("the file has no lora_down / lora_up keys")
    if errors:
        raise ValueError("load_kohya_dora: " + some(errors, first=8, sep="; ", names=False))
    if unmatched:
        warnings.warn(f"load_kohya_dora skipped {len(unmatched)} keys that name no module of "
                      f"{type(root).__name__} (strict=False): {some(sorted(unmatched))}", stacklevel=3)
    return plan


def _unknown_message(keys: list) -> str:
    def algo(k):
        tail = k.split(".", 1)[-1]  # after a kohya key prefix (which has no '.')
        return [what for tag, what in _OTHER_ALGOS.items() if tail.startswith(tag) or f".{tag}" in k]

    algos = sorted({w for k in keys for w in algo(k)})
    why = f" ({', '.join(algos)}: no PEFT DoRA equivalent)" if algos else ""
    return (f"keys that are not a kohya LoRA/DoRA layer's (lora_down.weight, lora_up.weight, alpha, dora_scale){why}: "
            f"{some(sorted(keys))}")


def _check_layer(name, mod_name, parts, base):
    """((down, up, alpha, dora_scale, base), problems) for one layer of the file against its module."""
    problems = []
    down, up = parts.get("lora_down.weight"), parts.get("lora_up.weight")
    if down is None or up is None:
        return None, [f"{name}: has {sorted(parts)} but needs both lora_down.weight and lora_up.weight"]
    conv = isinstance(base, (nn.Conv1d, nn.Conv2d, nn.Conv3d, FP8ConvNd))
    if conv:
        out_f, in_f, kernel = base.out_channels, base.in_channels, tuple(base.kernel_size)
        if base.groups != 1:
            problems.append(f"{name}: {mod_name} is a conv with groups={base.groups}; PEFT's and kohya's conv "
                            f"update is groups=1")
        if any(d != 1 for d in base.dilation):
            problems.append(f"{name}: {mod_name} is a dilated conv (dilation={tuple(base.dilation)}), which PEFT's "
                            f"DoRA conv does not build")
    else:
        out_f, in_f, kernel = base.out_features, base.in_features, ()
    r = down.shape[0] if down.dim() else 0
    want_down, want_up = (r, in_f) + kernel, (out_f, r) + (1,) * len(kernel)
    if r < 1 or tuple(down.shape) != want_down or tuple(up.shape) != want_up:
        problems.append(f"{name}: lora_down {tuple(down.shape)} / lora_up {tuple(up.shape)} do not fit {mod_name} "
                        f"({type(base).__name__}, out={out_f}, in={in_f}{', kernel=' + str(kernel) if kernel else ''}):"
                        f" expected lora_down (r, {', '.join(map(str, want_down[1:]))}) and lora_up "
                        f"({', '.join(map(str, want_up[:1]))}, r{', 1' * len(kernel)})")
    for key, t in (("lora_down.weight", down), ("lora_up.weight", up)):
        if not t.is_floating_point() or not all_finite(t):
            problems.append(f"{name}.{key}: must be finite floating-point values")
    a = parts.get("alpha")
    if a is None:
        alpha = float(max(r, 1))  # kohya's and LyCORIS's default: alpha = rank, scale 1
    elif a.numel() != 1 or not bool(torch.isfinite(a.float()).all()) or float(a.float()) <= 0:
        problems.append(f"{name}.alpha: expected one positive finite number, got {a.tolist()}")
        alpha = 1.0
    else:
        alpha = float(a.float())
    ds = parts.get("dora_scale")
    if ds is not None:
        if ds.dim() >= 1 and ds.shape[0] == out_f and ds.numel() == out_f:  # ComfyUI's test: the output axis
            if not bool(torch.isfinite(ds.float()).all()):
                problems.append(f"{name}.dora_scale: has non-finite values")
        elif ds.dim() >= 2 and ds.shape[0] == 1 and ds.shape[1] == in_f and ds.numel() == in_f:
            problems.append(f"{name}.dora_scale {tuple(ds.shape)}: an input-axis magnitude, one per input column "
                            f"(OneTrainer's DoRA unless 'decompose on output axis' is set, LyCORIS wd_on_out=False); "
                            f"PEFT's DoRA keeps one per output row, with no exact conversion: train with the output "
                            f"axis to load the file here")
        else:
            problems.append(f"{name}.dora_scale {tuple(ds.shape)}: expected ({out_f}, 1{', 1' * len(kernel)}), one "
                            f"magnitude per output row of {mod_name}")
    return (down, up, alpha, ds, base), problems


def _config(plan: dict) -> LoraConfig:
    """One LoraConfig with every layer's rank and alpha, the target names matched exactly (PEFT's fullmatch of a
    regex target, and `^name$` patterns, which get_pattern_key's `(.*\\.)?(pattern)$` cannot match elsewhere)."""
    ranks = {n: int(e[0].shape[0]) for n, e in plan.items()}
    alphas = {n: e[2] for n, e in plan.items()}
    r0 = Counter(ranks.values()).most_common(1)[0][0]
    a0 = Counter(alphas.values()).most_common(1)[0][0]
    exact = {n: f"^{re.escape(n)}$" for n in plan}
    return LoraConfig(
        r=r0, lora_alpha=a0, lora_dropout=0.0, use_dora=any(e[3] is not None for e in plan.values()),
        target_modules="|".join(f"(?:{re.escape(n)})" for n in sorted(plan)),
        rank_pattern={exact[n]: r for n, r in ranks.items() if r != r0},
        alpha_pattern={exact[n]: a for n, a in alphas.items() if a != a0})


@torch.no_grad()
def _fill(root, plan, adapter, use_dora, dora_scale) -> None:
    layers = {n: m for n, m in _lora_layers(root).items() if adapter in m.lora_A}
    if set(layers) != set(plan):
        raise RuntimeError(f"PEFT built adapter {adapter!r} on {sorted(set(layers) ^ set(plan))} differently from the "
                           f"file's layers")
    for n, (down, up, alpha, ds, _) in plan.items():
        layer = layers[n]
        r = down.shape[0]
        if layer.r[adapter] != r or layer.scaling[adapter] != alpha / r:
            raise RuntimeError(f"{n}: PEFT built r={layer.r[adapter]}, scaling={layer.scaling[adapter]} instead of "
                               f"r={r}, scaling={alpha / r}")
        A, B = layer.lora_A[adapter].weight, layer.lora_B[adapter].weight
        A.copy_(down.reshape(A.shape))
        B.copy_(up.reshape(B.shape))
        if use_dora:
            m = ds.reshape(-1).double()
            if dora_scale == "comfyui":
                n_base, n_new = _row_norms(base_weight_rows(layer), down, up, alpha / r)
                m = m * n_new / (n_base + _EPS32)
            mag = layer.lora_magnitude_vector[adapter].weight
            mag.copy_(m.reshape(mag.shape).to(mag.dtype))
        clear = getattr(layer, "clear_weight_norm_cache", None)
        if callable(clear):
            clear()


class _Undo:
    """What load_kohya_dora changes in `root`, kept to put back: the target modules (PEFT swaps them for LoRA layers
    in place), every parameter's requires_grad (PEFT freezes the base), and the attributes PEFT adds to the root."""

    def __init__(self, root: nn.Module, names: list):
        self.root = root
        self.children = []
        for n in names:
            parent_name, _, attr = n.rpartition(".")
            parent = root.get_submodule(parent_name) if parent_name else root
            self.children.append((parent, attr, parent._modules[attr]))
        self.grads = [(p, p.requires_grad) for p in root.parameters()]
        self.attrs = set(root.__dict__)

    def restore(self, adapter: str, peft_model: Optional[PeftModel]) -> None:
        """Puts back what __init__ kept; `peft_model`: the PeftModel added to (None: get_peft_model wrapped root)."""
        for parent, attr, mod in self.children:
            cur = parent._modules[attr]
            if cur is not mod:
                parent._modules[attr] = mod
            elif isinstance(cur, LoraLayer) and adapter in cur.lora_A:
                cur.delete_adapter(adapter)  # a layer of the PeftModel that had other adapters already
        for p, g in self.grads:
            p.requires_grad_(g)
        if peft_model is None:
            for a in set(self.root.__dict__) - self.attrs:
                delattr(self.root, a)
        else:
            peft_model.peft_config.pop(adapter, None)
