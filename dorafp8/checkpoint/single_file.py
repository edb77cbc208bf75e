"""ComfyUI / kijai fp8_scaled single files in their original layouts (ldm, BFL, MMDiT, Wan's, ...) into diffusers
models, in place (load_single_file). diffusers' own `from_single_file` would load such a file's raw e4m3 values without
their scales (NaN outputs, no error): while dorafp8 is imported it refuses it, as a path or as a dict."""

from __future__ import annotations

import functools
import os
import warnings
from typing import Optional

import torch
from torch import nn

from .files import MAX_JSON_BYTES, identity, open_safetensors, parse_json, regular_file
from .layouts import CheckpointFormatError

# the keys a scaled fp8 checkpoint carries beside its weights: ComfyUI's "scaled_fp8" files, and its newer
# "comfy_quant" ones (layouts.py, comfyui and comfyui-quant)
_SCALE_SUFFIXES = (".scale_weight", ".scale_input", ".weight_scale", ".input_scale", ".comfy_quant")


def scaled_fp8_keys(checkpoint: dict) -> list[str]:
    """The keys of an fp8 `checkpoint` saying its weights are scaled (scales, `scaled_fp8`); else []."""
    has_fp8 = any(isinstance(t, torch.Tensor) and t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
                  for t in checkpoint.values())
    if not has_fp8:
        return []
    return [k for k in checkpoint if is_scale_key(k)]


def refuse_scaled_fp8(checkpoint, what: str) -> None:
    """Raises ValueError if `checkpoint` (a state dict) is a scaled fp8 file that `what` would load unscaled."""
    if not isinstance(checkpoint, dict):
        return
    keys = scaled_fp8_keys(checkpoint)
    if keys:
        raise ValueError(
            f"{what}: this checkpoint is a ComfyUI-style fp8_scaled file (fp8 weights with their scales under keys "
            f"such as {keys[0]!r}, {len(keys)} in all); diffusers' from_single_file does not read these scales and "
            f"would load the raw fp8 values unscaled (NaN outputs, no error). Load it in place with dorafp8 instead, "
            f"keeping its fp8 bytes and scales: model = <ModelClass>.from_config(config) on the meta device, under "
            f"`with accelerate.init_empty_weights():` (which keeps buffers such as Wan's rotary tables real), then "
            f"dorafp8.load_single_file(model, path) (docs/CHECKPOINTS.md, \"Diffusion models\")")


def patch_from_single_file() -> None:
    """Makes diffusers' from_single_file (dict or path) refuse scaled fp8 checkpoints. Idempotent."""
    from diffusers.loaders import single_file_model as sfm

    mixin = sfm.FromOriginalModelMixin
    orig = mixin.__dict__["from_single_file"].__func__
    if not hasattr(orig, "_dorafp8_orig"):
        @functools.wraps(orig)
        def from_single_file(cls, pretrained_model_link_or_path_or_dict=None, **kwargs):
            refuse_scaled_fp8(pretrained_model_link_or_path_or_dict, f"{cls.__name__}.from_single_file")
            return orig(cls, pretrained_model_link_or_path_or_dict, **kwargs)

        from_single_file._dorafp8_orig = orig
        mixin.from_single_file = classmethod(from_single_file)
    load = sfm.load_single_file_checkpoint
    if not hasattr(load, "_dorafp8_orig"):
        @functools.wraps(load)
        def load_single_file_checkpoint(*args, **kwargs):
            checkpoint = load(*args, **kwargs)
            refuse_scaled_fp8(checkpoint, "from_single_file")
            return checkpoint

        load_single_file_checkpoint._dorafp8_orig = load
        sfm.load_single_file_checkpoint = load_single_file_checkpoint


_ROW_BITS = 32  # a row tag: source index << 32 | row


def _row_tags(shapes: dict) -> tuple[list, dict]:
    """(keys, tags): every tensor of a state dict ({key: shape}) as an int64 vector naming the tensor and each row:
    what diffusers' converters do to rows they do to these, which then say where each converted row comes from."""
    keys = list(shapes)
    tags = {}
    for i, k in enumerate(keys):
        shape = tuple(shapes[k])
        tags[k] = (torch.arange(shape[0], dtype=torch.int64) | (i << _ROW_BITS)) if shape else \
            torch.tensor(i << _ROW_BITS)
    return keys, tags


_PREFIX = "model.diffusion_model."  # a full checkpoint's (and ComfyUI's saves') diffusion model keys


def diffusion_model_keys(keys, model: nn.Module) -> tuple[dict, list]:
    """({file key: the key diffusers' converter for `model` is given}, the file's other keys). A full checkpoint
    (keys under `model.diffusion_model.` beside a VAE's and text encoders') gives its diffusion model only; a file
    without that prefix is given it where the converter reads prefixed keys only (the ldm UNet's)."""
    keys = list(keys)
    if any(k.startswith(_PREFIX) for k in keys):
        return {k: k for k in keys if k.startswith(_PREFIX) or k == "scaled_fp8"}, \
            [k for k in keys if not (k.startswith(_PREFIX) or k == "scaled_fp8")]
    add = _PREFIX if converter_for(model).__name__ in _PREFIXED_ONLY else ""
    return {k: add + k for k in keys}, []


# diffusers' converters that read only keys under `model.diffusion_model.` (the others take them with or without it;
# ControlNet's reads its keys bare or under `control_model.`)
_PREFIXED_ONLY = ("convert_ldm_unet_checkpoint",)


def row_map(model: nn.Module, shapes: dict) -> tuple[list, dict]:
    """(keys, converted): diffusers' converter for `model` run on the row tags of a single file's tensors
    ({key: shape}, its weights without their scales; keys as diffusion_model_keys gives them): converted[diffusers
    key] >> 32 indexes `keys`, & (2**32 - 1) is the row of that file tensor. Keys some converters leave with a full
    checkpoint's `model.diffusion_model.` prefix (HunyuanVideo's) come without it."""
    keys, tags = _row_tags(shapes)
    given, _ = diffusion_model_keys(keys, model)
    try:
        converted = converter_for(model)({given[k]: tags[k] for k in given})
    except (KeyError, IndexError, RuntimeError, ValueError) as e:
        name = _model_name(model)
        raise CheckpointFormatError(f"diffusers' single-file conversion for {name} failed on this file "
                                    f"({type(e).__name__}: {e}): it is not in the layout diffusers converts for "
                                    f"{name}") from e
    return keys, {k[len(_PREFIX):] if k.startswith(_PREFIX) else k: v for k, v in converted.items()}


def is_scale_key(k: str) -> bool:
    """A scale or marker key of a scaled fp8 file, beside its weights."""
    return k.endswith(_SCALE_SUFFIXES) or k == "scaled_fp8" or k.endswith(".scaled_fp8")


def _model_name(model: nn.Module) -> str:
    return type(model).__name__


def converter_for(model: nn.Module):
    """diffusers' single-file converter for `model`'s class; a ValueError if it has none."""
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES

    entry = SINGLE_FILE_LOADABLE_CLASSES.get(_model_name(model))
    if entry is None:
        raise ValueError(f"diffusers has no single-file conversion for {_model_name(model)} (its "
                         f"SINGLE_FILE_LOADABLE_CLASSES): load a file with diffusers' key names with "
                         f"dorafp8.load_fp8_checkpoint instead")
    fn = entry["checkpoint_mapping_fn"]
    config = dict(getattr(model, "config", {}))

    def convert(checkpoint):
        return fn(checkpoint=checkpoint, config=config)

    convert.__name__ = fn.__name__
    return convert


def _layer_extras(state_dict: dict) -> dict:
    """weight key -> {"scale_weight": t, "scale_input": t} of the file's layers that have them."""
    extras = {}
    for k, v in state_dict.items():
        for suffix in ("scale_weight", "scale_input"):
            if k.endswith("." + suffix):
                extras.setdefault(k[:-len(suffix)] + "weight", {})[suffix] = v
    return extras


def _same(tensors: list) -> bool:
    return all(t.shape == tensors[0].shape and torch.equal(t, tensors[0]) for t in tensors[1:])


def to_diffusers_layout(model: nn.Module, state_dict: dict) -> dict:
    """A single file in its original layout (fp8 weights with ComfyUI's `scale_weight` and `scale_input`, or dense) ->
    the same tensors under `model`'s diffusers names, fp8 bytes as they are, each piece of a fused weight with the
    scales of the weight it was cut from. The mapping is diffusers' own converter run on row tags (row_map); a key it
    leaves unread, a mapping that is not a choice of rows, or a join of different per-tensor scales is refused."""
    name = _model_name(model)
    newer = [k for k in state_dict if k.endswith((".weight_scale", ".input_scale", ".comfy_quant"))]
    if newer:
        raise CheckpointFormatError(f"{newer[0]!r}: ComfyUI's comfy_quant encoding (weight_scale, comfy_quant): "
                                    f"to_diffusers_layout reads its scaled_fp8 one (scale_weight); load the file with "
                                    f"load_single_file, which converts it; nothing was loaded into {name}")
    _, others = diffusion_model_keys(state_dict, model)
    extras = _layer_extras(state_dict)
    tensors = {k: v for k, v in state_dict.items() if not is_scale_key(k) and k not in others}
    keys, converted = row_map(model, {k: v.shape for k, v in tensors.items()})
    known = set(model.state_dict())
    out, used, errors = {}, set(), []
    for k, tag in converted.items():
        ok = isinstance(tag, torch.Tensor) and tag.dtype == torch.int64
        src = torch.unique(tag >> _ROW_BITS).tolist() if ok else [-1]
        if any(not 0 <= i < len(keys) for i in src):
            errors.append(f"{k!r}: diffusers' conversion computes it from the file's values, not by choosing rows")
            continue
        srcs = [keys[i] for i in src]
        used |= set(srcs)
        if k not in known:  # a key the converter passes through unrenamed (Wan FLF2V's img_emb.emb_pos)
            errors.append(f"{srcs[0]!r}: diffusers' conversion for {name} names it {k!r}, which {name} does not have")
            continue
        if tag.dim() == 0:
            out[k] = tensors[srcs[0]]
            continue
        # each row of k as a row of the sources stacked in `src` order
        offsets = dict(zip(src, torch.tensor([0] + [tensors[s].shape[0] for s in srcs[:-1]]).cumsum(0).tolist()))
        rows = torch.tensor([offsets[i] for i in (tag >> _ROW_BITS).tolist()]) + (tag & ((1 << _ROW_BITS) - 1))
        whole = tensors[srcs[0]] if len(srcs) == 1 else torch.cat([tensors[s] for s in srcs])
        start = int(rows[0]) if rows.numel() else 0
        if torch.equal(rows, torch.arange(start, start + rows.numel())):  # a run of rows (q of a fused qkv): a view
            out[k] = whole.narrow(0, start, rows.numel())
        else:  # rows in another order (swapped adaLN halves): copied
            out[k] = whole[rows]
        errors += _cut_extras(k, srcs, rows, tensors, extras, out)
    unread = [k for k in keys if k not in used]
    if unread:
        errors.append(f"{len(unread)} tensors of the file are not mapped by diffusers' conversion for {name}: "
                      + ", ".join(repr(k) for k in unread[:8]) + (", ..." if len(unread) > 8 else ""))
    if errors:
        raise CheckpointFormatError(f"the single file does not map onto {name}: " + "; ".join(errors[:8]))
    if any(k == "scaled_fp8" or k.endswith(".scaled_fp8") for k in state_dict):
        out["scaled_fp8"] = torch.tensor([], dtype=torch.float8_e4m3fn)
    return out


def _cut_extras(k: str, srcs: list, rows: torch.Tensor, tensors: dict, extras: dict, out: dict) -> list:
    """Puts the scale_weight / scale_input of the sources of diffusers tensor `k` into `out` under k's layer: a
    per-tensor one as it is (shared by the pieces cut from it), per-row ones cut with the rows. Returns errors."""
    errors = []
    lay = k[:-len(".weight")] if k.endswith(".weight") else k
    for suffix in ("scale_weight", "scale_input"):
        parts = [extras.get(s, {}).get(suffix) for s in srcs]
        if all(p is None for p in parts):
            continue
        # per row ([N], [N, 1]) or musubi's 1 x g blocks ([N, K / g, 1]): one row of scales per weight row
        per_row = all(p is not None and p.dim() >= 1 and p.shape[0] == tensors[s].shape[0] > 1
                      for p, s in zip(parts, srcs))
        if not per_row and (any(p is None for p in parts) or not _same(parts)):
            errors.append(f"{k!r} joins {srcs}, whose {suffix}s differ: one per-tensor {suffix} cannot hold them")
        elif per_row:
            out[f"{lay}.{suffix}"] = torch.cat([p.reshape(p.shape[0], -1) for p in parts])[rows].reshape(
                (-1,) + tuple(parts[0].shape[1:]))
        else:
            out[f"{lay}.{suffix}"] = parts[0].clone()
    return errors


def dequantized_original(key: str, get, keys) -> torch.Tensor:
    """The weight `key` of a single file (get(key) -> tensor, `keys` the file's keys) as float32, times its scale as
    load_single_file reads it: `scale_weight` (ComfyUI's scaled_fp8, musubi-tuner's) or `weight_scale` (comfy_quant),
    per tensor, per row ([out], [out, 1]) or per 1 x g block ([out, in / g, 1], musubi's); an fp8 weight without one
    is taken unscaled (ComfyUI's reading)."""
    w = get(key)
    if w.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return w.float()
    lay = key[:-len(".weight")]
    scale_key = next((k for k in (f"{lay}.scale_weight", f"{lay}.weight_scale") if k in keys), None)
    w = w.float()
    if scale_key is None:
        return w
    scale = get(scale_key).float()
    if scale.numel() == 1:
        return w * scale.reshape(())
    if scale.dim() == 3:  # [out, in / g, 1]: 1 x g blocks of the [out, in] weight
        return (w.reshape(scale.shape[0], scale.shape[1], -1) * scale).reshape(w.shape)
    return w * scale.reshape((-1,) + (1,) * (w.dim() - 1))


def _comfy_quant_to_scaled_fp8(state_dict: dict, metadata: dict) -> dict:
    """ComfyUI's newer comfy_quant encoding (a `<layer>.comfy_quant` JSON per layer, or the `_quantization_metadata`
    safetensors metadata; `weight_scale`, `input_scale`) as its scaled_fp8 one (`scale_weight`, `scale_input`): what
    ComfyUI's convert_old_quants (comfy/utils.py) does the other way. Only its per-tensor fp8 layers ({"format":
    "float8_e4m3fn"} or "float8_e5m2"); any other format is refused, naming the layer."""
    confs = {}
    for k in [k for k in state_dict if k.endswith(".comfy_quant")]:
        t = state_dict[k]
        if t.dtype != torch.uint8 or t.dim() != 1 or t.numel() > MAX_JSON_BYTES:  # cast, its values would wrap
            raise CheckpointFormatError(f"{k!r}: {t.dtype} of shape {tuple(t.shape)}, where ComfyUI writes a layer's "
                                        f"config as uint8 JSON bytes (1-D); the file is damaged or not ComfyUI's; "
                                        f"nothing was loaded")
        confs[k[:-len(".comfy_quant")]] = parse_json(bytes(t.tolist()), k,
                                                     'ComfyUI\'s layer config, JSON like {"format": "float8_e4m3fn"}')
    raw = metadata.get("_quantization_metadata")
    if raw is not None:
        layers = parse_json(raw.encode() if isinstance(raw, str) else bytes(raw), "the safetensors metadata "
                            "'_quantization_metadata'", '{"layers": {layer: {"format": ...}}}').get("layers")
        if not isinstance(layers, dict):
            raise CheckpointFormatError("the safetensors metadata '_quantization_metadata' has no \"layers\" object; "
                                        "the file is damaged or not ComfyUI's")
        for lay, conf in layers.items():  # a full checkpoint's other components, left out already, not asked about
            if f"{lay}.weight" in state_dict:
                confs.setdefault(lay, conf)
    scales = [k for k in state_dict if k.endswith((".weight_scale", ".input_scale"))]
    if not confs and not scales:
        return state_dict
    # float8_e5m2 (TensorCoreFP8E5M2Layout) is the same per-tensor scaling of e5m2 weights: _e5m2_to_e4m3 converts them
    other = {lay: c.get("format") if isinstance(c, dict) else c for lay, c in confs.items()
             if not isinstance(c, dict) or c.get("format") not in ("float8_e4m3fn", "float8_e5m2")}
    if other:
        lay, fmt = next(iter(other.items()))
        raise CheckpointFormatError(f"{lay!r}: ComfyUI quantization format {fmt!r} ({len(other)} layers neither "
                                    f"float8_e4m3fn nor float8_e5m2); load_single_file reads ComfyUI's per-tensor fp8 "
                                    f"layers (weight_scale) only. Load the same model's fp8 (float8_e4m3fn / fp8_scaled) "
                                    f"or bf16 file instead; nothing was loaded")
    unmarked = [k for k in scales if k.rpartition(".")[0] not in confs]
    if unmarked:
        # a state dict (safetensors' load_file) carries no safetensors metadata, where ComfyUI files may keep the
        # layer configs: the likelier cause then
        hint = "" if raw is not None else (
            "; if the file keeps its layer configs in its safetensors metadata ('_quantization_metadata'), which a "
            "state dict does not carry, pass load_single_file the file's path instead")
        raise CheckpointFormatError(f"{unmarked[0]!r}: a weight_scale / input_scale of a layer without its comfy_quant "
                                    f"entry (ComfyUI would not read it, so its weight would be used unscaled){hint}; "
                                    f"else the file is damaged or not ComfyUI's; nothing was loaded")
    rename = {"weight_scale": "scale_weight", "input_scale": "scale_input"}
    both = [k for k in scales if f"{k.rpartition('.')[0]}.{rename[k.rpartition('.')[2]]}" in state_dict]
    if both:  # one would overwrite the other in `out`, whichever comes later in the file
        lay, _, suffix = both[0].rpartition(".")
        raise CheckpointFormatError(f"{both[0]!r} and {lay + '.' + rename[suffix]!r}: a layer with its scale in both "
                                    f"ComfyUI encodings (comfy_quant and scaled_fp8), which one is meant? the file is "
                                    f"damaged or not ComfyUI's; nothing was loaded")
    # the marker: an fp8 weight without a layer config is read unscaled, as ComfyUI reads it (load_plan)
    out = {"scaled_fp8": torch.tensor([], dtype=torch.float8_e4m3fn)}
    for k, t in state_dict.items():
        lay, _, suffix = k.rpartition(".")
        if suffix != "comfy_quant":
            out[f"{lay}.{rename[suffix]}" if suffix in rename else k] = t
    return out


def _e5m2_to_e4m3(state_dict: dict) -> dict:
    """`state_dict` with its float8_e5m2 weights as e4m3 bytes: each shifted by the power of two 2**k that brings its
    largest value to [256, 448], its scale_weight divided by 2**k (exact: e5m2's 2 mantissa bits fit e4m3's 3; values
    below 2**-7 after the shift round). One QuantizationWarning states the worst change."""
    e5m2 = [k for k, t in state_dict.items() if t.dtype == torch.float8_e5m2 and k.endswith(".weight")]
    if not e5m2:
        return state_dict
    out, worst, exact = dict(state_dict), (0.0, ""), 0
    for k in e5m2:
        w = state_dict[k].float()
        amax = float(w.abs().max())
        if amax != amax or amax == float("inf"):  # e5m2 has inf and NaN, e4m3 no inf
            raise CheckpointFormatError(f"{k}: a float8_e5m2 weight with inf or NaN values (the file is damaged); "
                                        f"nothing was loaded")
        shift = 8 - int(torch.tensor(amax).log2().floor()) if amax > 0 else 0
        w8 = (w * 2.0 ** shift).to(torch.float8_e4m3fn)
        err = float((w8.float() * 2.0 ** -shift - w).abs().max()) / amax if amax > 0 else 0.0
        exact += err == 0
        worst = max(worst, (err, k))
        sk = k[:-len("weight")] + "scale_weight"
        scale = state_dict.get(sk, torch.tensor(1.0))
        out[k], out[sk] = w8, scale.float() * 2.0 ** -shift  # fp32: a bf16 / fp16 scale could underflow
    from ..quant import QuantizationWarning

    warnings.warn(f"load_single_file: {len(e5m2)} float8_e5m2 weights converted to float8_e4m3fn (each shifted by a "
                  f"power of two, its scale_weight by the inverse): {exact} exactly; the worst, {worst[1]!r}, changes "
                  f"by {worst[0]:.3g} of its largest value (values below e4m3's range after the shift round)",
                  QuantizationWarning, stacklevel=3)
    return out


def load_single_file(model: nn.Module, path_or_state_dict, *, device="cpu", dtype: Optional[torch.dtype] = None,
                     backend: str = "auto", verbose: bool = True):
    """Loads a single file in its original layout into a diffusers model, in place.

    The fp8 weights keep their bytes and scales (FP8Linear layers), fused projections are cut by rows sharing their
    per-tensor scale (to_diffusers_layout), everything else is loaded as load_fp8_checkpoint loads it.

    Args:
        model: the diffusers model, built from its config (on the meta device or not).
        path_or_state_dict: a ComfyUI / kijai fp8_scaled file of Flux, SD 1.x / SDXL, SD3.5, Wan, HunyuanVideo or
            LTX (ComfyUI's scaled_fp8 encoding or its newer comfy_quant one, float8_e4m3fn or e5m2 layers), or a
            dense one; its path or its state dict. Its keys may carry ComfyUI's `model.diffusion_model.`
            prefix or not; a full checkpoint's other components (VAE, text encoders) are left out, listed in the
            report's `kept`.
        device, dtype, backend, verbose: as for load_fp8_checkpoint.

    Returns:
        load_fp8_checkpoint's LoadReport.
    """
    from .load import load_fp8_checkpoint

    state_dict, path = path_or_state_dict, None
    if not isinstance(state_dict, dict):  # a downloaded file: checked and measured before it is read (files.py)
        if os.path.isdir(path_or_state_dict):  # a diffusers folder (its shards are in diffusers' names already)
            raise CheckpointFormatError(f"path_or_state_dict: {os.fspath(path_or_state_dict)} is a folder; "
                                        f"load_single_file reads one file in its original layout. A diffusers folder "
                                        f"(diffusion_pytorch_model*.safetensors, diffusers' key names) loads with "
                                        f"dorafp8.load_fp8_checkpoint(model, folder)")
        path = regular_file(os.fspath(path_or_state_dict), "path_or_state_dict")
        with open_safetensors(path, path) as f:
            metadata = f.metadata() or {}
            _, others = diffusion_model_keys(f.keys(), model)
            state_dict = {k: f.get_tensor(k) for k in f.keys() if k not in others}
    else:
        metadata = {}
        _, others = diffusion_model_keys(state_dict, model)
        state_dict = {k: v for k, v in state_dict.items() if k not in others}
    state_dict = _comfy_quant_to_scaled_fp8(state_dict, metadata)
    converted = to_diffusers_layout(model, _e5m2_to_e4m3(state_dict))
    scales = [t for k, t in converted.items() if k.endswith(".scale_weight")]
    # musubi-tuner's --fp8_scaled 1 x 64 block scales [N, K / 64, 1] are read as load_fp8_checkpoint reads musubi's
    fmt = "musubi" if any(t.dim() == 3 for t in scales) else "comfyui" if scales else "auto"
    report = load_fp8_checkpoint(model, converted, format=fmt, device=device, dtype=dtype, backend=backend,
                                 verbose=verbose)
    src = getattr(model, "_dorafp8_source", None)
    if path is not None and src is not None:  # read from a state dict: the file is what no writer may replace
        src.files = tuple(filter(None, [identity(path)]))
    if others:  # a full checkpoint's VAE and text encoders: not this model's
        report.kept.update((k, f"not under {_PREFIX!r}: another component of a full checkpoint") for k in others)
        if verbose:
            print(f"dorafp8: {len(others)} tensors of the file's other components (e.g. {others[0]!r}) not loaded: "
                  f"load_single_file loads the diffusion model, the keys under {_PREFIX!r}")
    return report
