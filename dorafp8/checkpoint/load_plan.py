"""Planning a load from the checkpoint's keys, dtypes and shapes alone, before any data is read: which key goes to
which model tensor, which modules get fp8 layers with which scales; every mismatch is raised here, together."""

from __future__ import annotations

from collections import Counter
from typing import Optional

import torch
from torch import nn

from ..nn import FP8Linear, fp8_conv_class
from ..nn.convert import kept_in_precision
from ..quant import DEFAULT_BLOCK, E4M3, MXFP8_BLOCK, NVFP4_BLOCK, check_scale
from .files import some
from .layouts import LAYOUTS, CheckpointFormatError, canonical_format
from .modules import FP8_CONV_TYPES, FP8_LAYER_TYPES, is_conv1d
from .plan import KeyMap, LayerPlan, LoadPlan, ScalePlan
from .reports import LoadReport
from .source import (BLOCK_SIZE_KEY, MX_SCALE_DTYPES, CheckpointSource, detect, layer_key, nvfp4_weights,
                     refuse_comfy_microscaled)


def plan_load(model: nn.Module, source: CheckpointSource, fmt: str, model_t: dict, tied: dict, report: LoadReport, *,
              key_map, block_hint: Optional[int], strict: bool) -> LoadPlan:
    """Where every checkpoint tensor goes (fills report); raises CheckpointFormatError on what does not fit."""
    keys = _map_keys(source, model_t, key_map, report)
    plan = _plan_layers(model, source, fmt, keys)
    _plan_scales(plan, source, block_hint, report)
    _plan_other_tensors(plan, source, model_t, tied, report, strict)
    return plan


def resolve_format(source: CheckpointSource, format: str) -> tuple[str, str]:
    """(format, evidence): detected for "auto"; a given format is checked against what detection sees."""
    if format == "auto":
        return detect(source)
    fmt = canonical_format(format, tuple(LAYOUTS))
    refuse_comfy_microscaled(source)  # not a layout any format= reads: refused before detect's errors are set aside
    detected = None
    try:
        detected, evidence = detect(source)
    except CheckpointFormatError:
        evidence = "format given"
    # per-tensor scale_weight without the marker reads the same either way (musubi's per-tensor mode, or a ComfyUI
    # file that lost it)
    if detected not in (None, fmt) and not (fmt == "fp8-cast") and {detected, fmt} != {"comfyui", "musubi"} and \
            not ({detected, fmt} == {"compressed-tensors", "modelopt"} and _mxfp8_only(source.info)):
        raise CheckpointFormatError(f"format={fmt!r} but the checkpoint looks like {detected} ({evidence})")
    return fmt, "format given"


def _mxfp8_only(info: dict) -> bool:
    """Whether every weight scale is MXFP8's (e8m0 per 32 on an e4m3 weight), which ModelOpt's layout and
    compressed-tensors' read alike: a ModelOpt MXFP8 single file (dorafp8's too) has no hf_quant_config.json to tell
    it from compressed-tensors' mxfp8-quantized, so detection names the latter, and format='modelopt' reads it so."""
    scales = [k for k in info if k.endswith(".weight_scale")]
    return bool(scales) and not nvfp4_weights(info) and all(info[k][0] in MX_SCALE_DTYPES for k in scales)


def _map_keys(source: CheckpointSource, model_t: dict, key_map, report: LoadReport) -> KeyMap:
    """Checkpoint keys -> model names: by key_map, else by the common prefix that matches most model keys."""
    info = source.info
    marker_keys = {k for k in info if k == "scaled_fp8" or k.endswith(".scaled_fp8")}
    ckpt_keys = [k for k in info if k not in marker_keys]
    strip = add = ""
    if key_map is None:
        strip, add = _find_prefix([k for k in ckpt_keys if not k.endswith(".comfy_quant")], set(model_t))
        report.prefix = strip or add

        def key_map(k):  # noqa: F811
            return add + (k[len(strip):] if strip and k.startswith(strip) else k)
    return KeyMap({k: key_map(k) for k in ckpt_keys}, ckpt_keys, marker_keys, strip, add)


def _find_prefix(ckpt_keys: list[str], model_keys: set[str]) -> tuple[str, str]:
    """(strip, add): the key prefix to remove from checkpoint keys and the one to put in front of them, chosen to
    match the most model keys (ComfyUI files carry 'model.diffusion_model.', some exports 'model.' and so on)."""
    direct = sum(k in model_keys for k in ckpt_keys)
    if direct == len(ckpt_keys) or not ckpt_keys:
        return "", ""
    cands = Counter()
    sample = [k for k in ckpt_keys if k not in model_keys][:50]
    for k in sample:
        for m in model_keys:
            if k.endswith(m) and k != m and k[len(k) - len(m) - 1] == ".":
                cands[("strip", k[:len(k) - len(m)])] += 1
            elif m.endswith(k) and m[len(m) - len(k) - 1] == ".":
                cands[("add", m[:len(m) - len(k)])] += 1
    best, best_n = ("", ""), direct
    for (kind, p), _ in cands.most_common(8):
        if kind == "strip":
            n = sum((k[len(p):] if k.startswith(p) else k) in model_keys for k in ckpt_keys)
            pair = (p, "")
        else:
            n = sum((p + k) in model_keys for k in ckpt_keys)
            pair = ("", p)
        if n > best_n:
            best, best_n = pair, n
    return best


def _plan_layers(model: nn.Module, source: CheckpointSource, fmt: str, keys: KeyMap) -> LoadPlan:
    """The model modules that get an fp8 weight of the checkpoint."""
    info = source.info
    layer_of = {}  # fp8 weight key -> module name in the model
    layers: dict[str, LayerPlan] = {}
    packed = set(nvfp4_weights(info).values()) if fmt in MICRO_FORMATS else set()
    in_precision = kept_in_precision(model)  # the model casts their inputs to their weight dtype: dequantized
    for k in keys.ckpt_keys:
        m = keys.names[k]
        if m is None or not ((k.endswith(".weight") and info[k][0] == E4M3) or k in packed):
            continue
        mod_name = m.rpartition(".")[0]
        try:
            mod = model.get_submodule(mod_name)
        except AttributeError:
            continue
        layer_of[k] = mod_name
        linear = isinstance(mod, (nn.Linear, FP8Linear)) and not is_conv1d(mod)
        conv = isinstance(mod, FP8_CONV_TYPES) or fp8_conv_class(mod) is not None
        fp8 = (linear or conv) and (mod_name not in in_precision or isinstance(mod, FP8_LAYER_TYPES))
        layers[mod_name] = LayerPlan(k, mod, linear, conv, fp8=fp8)
    return LoadPlan(fmt, LAYOUTS[fmt], keys, layer_of, layers)


def _plan_scales(plan: LoadPlan, source: CheckpointSource, block_hint: Optional[int], report: LoadReport) -> None:
    """Each fp8 weight's scale (and its kind: per tensor, row or block) and extras; the shapes checked."""
    info, layout, fmt = source.info, plan.layout, plan.fmt
    errors = []
    for k, mod_name in plan.layer_of.items():
        lay = layer_key(k)
        shape_w = info[k][1]
        N, K = (shape_w[0], int(torch.Size(shape_w[1:]).numel())) if len(shape_w) >= 2 else (None, None)
        p = plan.layers[mod_name]
        mod = p.module
        if f"{lay}.pre_quant_scale" in info:  # with strict=False it would be dropped, the layer computing x W^T
            errors.append(f"{lay}.pre_quant_scale: an AWQ / SVDQuant pre-quantization scale (ModelOpt's NVFP4_AWQ, "
                          f"NVFP4_SVD, W4A8_AWQ): the layer computes (x * pre_quant_scale) W^T, which dorafp8's "
                          f"layers do not; loaded without it, it would compute wrong values. Load the model's plain "
                          f"NVFP4 / fp8 / bf16 checkpoint instead")
            continue
        kind = _micro_kind(info, k, lay, fmt)
        if kind == "nvfp4" and K is not None:
            K *= 2  # two e2m1 values a byte
        if p.linear and (N, K) != (mod.out_features, mod.in_features):
            errors.append(f"{k}: shape {list(info[k][1])} in the checkpoint, [{mod.out_features}, "
                          f"{mod.in_features}] in the model's {mod_name!r}")
            continue
        if p.conv and tuple(shape_w) != tuple(mod.weight.shape):
            errors.append(f"{k}: shape {list(shape_w)} in the checkpoint, {list(mod.weight.shape)} in the model's "
                          f"{mod_name!r}")
            continue
        if kind is not None:
            _plan_micro(plan, p, kind, k, mod_name, N, K, info, errors)
            continue
        scale_key = f"{lay}.{layout.scale_key}" if layout.scale_key else None
        if scale_key is None or scale_key not in info:
            if layout.scale_key is not None and not (fmt == "comfyui" and plan.keys.marker_keys):
                errors.append(f"{k} is float8_e4m3fn but {scale_key!r} (its scale) is missing"
                              + (" and the file has no 'scaled_fp8' marker, with which alone ComfyUI reads a "
                                 "missing scale_weight as 1 (without it ComfyUI reads no scale at all): if this "
                                 "weight is meant unscaled, add the marker or its scale_weight = 1.0; else the file "
                                 "is damaged" if fmt == "comfyui" else ""))
                continue
            p.scale_key = None  # fp8-cast, or ComfyUI's own reading of a missing scale_weight: scale 1
        else:
            p.scale_key = scale_key
            shape = info[scale_key][1]
            if fmt == "musubi" and len(shape) == 3:  # [N, K / g, 1]: 1 x g blocks (fp8_optimization_utils.py)
                why = _group_problem(p, N, K, shape, info[scale_key][0])
                if why:
                    errors.append(f"{scale_key}: shape {list(shape)}: {why}")
                    continue
                p.group = K // shape[1]
                plan.scales[scale_key] = ScalePlan(mod_name, N, K, DEFAULT_BLOCK, p.fp8, group=p.group)
                plan.consumed[scale_key] = "scale"
                continue
            block_size = None
            if len(shape) == 2 and N is not None and shape != (N, 1) and int(torch.Size(shape).numel()) != 1:
                block_size = _infer_block(N, K, shape, block_hint)
                if block_size is None:
                    errors.append(f"{scale_key}: shape {list(shape)} is neither per tensor, per row [{N}, 1] nor "
                                  f"per b x b block of the [{N}, {K}] weight "
                                  + (f"for b = {block_hint} (from block_size=, the file's {BLOCK_SIZE_KEY} metadata "
                                     f"or config.json, in that order)" if block_hint else
                                     "for any block size; pass block_size="))
                    continue
            p.block_size = block_size
            if block_size is not None and not p.fp8:
                errors.append(f"{scale_key}: block scales on {type(mod).__name__} {mod_name!r}, which is not a linear "
                              f"or conv layer (only per-tensor or per-row scales can be dequantized into it)")
                continue
            if info[scale_key][0] not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
                errors.append(f"{scale_key}: dtype {info[scale_key][0]} (only fp32/bf16/fp16 scales are read)")
                continue
            try:
                check_scale(torch.empty(shape, device="meta"), N, K, block_size or DEFAULT_BLOCK, name=scale_key)
            except (TypeError, ValueError) as e:
                errors.append(str(e))
                continue
            plan.scales[scale_key] = ScalePlan(mod_name, N, K, block_size or DEFAULT_BLOCK, p.fp8)
            plan.consumed[scale_key] = "scale"
        for extra in (layout.act_scale_key, "comfy_quant", "weight_zero_point", "input_zero_point"):
            ek = f"{lay}.{extra}" if extra else None
            if ek and ek in info:
                plan.consumed[ek] = "extra"
                p.extras.append(ek)
    for k in plan.keys.ckpt_keys:  # scales of weights that are not fp8 (transformers writes some): the weight is dense
        if k not in plan.consumed and layout.scale_key and k.endswith("." + layout.scale_key):
            w = f"{layer_key(k)}.weight"
            if w in info and info[w][0] == torch.float8_e5m2:  # not a dense weight: cast without its scale, wrong
                errors.append(f"{w}: float8_e5m2 with its scale {k!r}; dorafp8 holds float8_e4m3fn weights only "
                              f"(load_single_file converts a single file's e5m2 weights)")
            elif w in info and info[w][0] != E4M3:
                plan.consumed[k] = "ignored"
                report.kept[k] = "scales of weights that are not fp8 (ignored, as the writer's own loader does)"
    if errors:
        raise CheckpointFormatError(f"{source.name} ({fmt}): " + some(errors, first=8, sep="; ", names=False))


# The layouts that may hold NVFP4 / MXFP8 weights
MICRO_FORMATS = ("modelopt", "compressed-tensors")


def _micro_kind(info: dict, k: str, lay: str, fmt: str) -> Optional[str]:
    """"nvfp4" (packed uint8 weight), "mxfp8" (e4m3 weight, e8m0 / uint8 scale), None for fp8 kinds."""
    if fmt not in MICRO_FORMATS:
        return None
    if info[k][0] == torch.uint8:
        return "nvfp4"
    sk = f"{lay}.weight_scale"
    return "mxfp8" if sk in info and info[sk][0] in MX_SCALE_DTYPES else None


def _plan_micro(plan: LoadPlan, p: LayerPlan, kind: str, k: str, mod_name: str, N: int, K: int, info: dict,
                errors: list) -> None:
    """A microscaled layer's scale (and NVFP4's global scale) planned and checked; problems go to `errors`."""
    lay = layer_key(k)
    if not p.linear:
        errors.append(f"{k}: {kind} weights load into linear layers only, not {type(p.module).__name__} "
                      f"{mod_name!r}")
        return
    if not p.fp8:  # a layer the model keeps in precision (kept_in_precision): only fp8 weights are dequantized there
        errors.append(f"{k}: {kind} weight for {mod_name!r}, a layer the model keeps in full precision (it casts its "
                      f"inputs to that layer's weight dtype); dequantizing {kind} into it is not supported")
        return
    block = NVFP4_BLOCK if kind == "nvfp4" else MXFP8_BLOCK
    if kind == "nvfp4" and K % NVFP4_BLOCK:
        errors.append(f"{k}: packed NVFP4 of shape {list(info[k][1])} holds {K} values a row, not a multiple of "
                      f"{NVFP4_BLOCK} (one e4m3 scale per {NVFP4_BLOCK}): the packed size does not fit NVFP4")
        return
    sk = f"{lay}.weight_scale"
    if sk not in info:
        errors.append(f"{k} is {kind} but {sk!r} (its scale) is missing")
        return
    want_dtypes = (E4M3,) if kind == "nvfp4" else MX_SCALE_DTYPES
    want = (N, K // NVFP4_BLOCK) if kind == "nvfp4" else (N, -(-K // MXFP8_BLOCK))
    if info[sk][0] not in want_dtypes:
        errors.append(f"{sk}: dtype {info[sk][0]}; a {kind} scale is {' or '.join(map(str, want_dtypes))}")
        return
    if tuple(info[sk][1]) != want:
        errors.append(f"{sk}: shape {list(info[sk][1])}, but the [{N}, {K}] {kind} weight {k!r} needs {list(want)} "
                      f"(one scale per {block} weights of a row)")
        return
    if kind == "nvfp4":
        gk = f"{lay}.weight_scale_2" if k.endswith(".weight") else f"{lay}.weight_global_scale"
        if info[gk][0] != torch.float32 or int(torch.Size(info[gk][1]).numel()) != 1:
            errors.append(f"{gk}: {info[gk][0]} of shape {list(info[gk][1])}; NVFP4's global scale is one fp32 value")
            return
        p.global_key = gk
        plan.consumed[gk] = "global"
    p.kind, p.scale_key = kind, sk
    plan.scales[sk] = ScalePlan(mod_name, N, K, DEFAULT_BLOCK, True, kind=kind)
    plan.consumed[sk] = "scale"
    # k_scale / v_scale: ModelOpt's FP8 KV-cache calibration (kv_cache_quant_algo "FP8"), exported on k_proj / v_proj;
    # kept for the write-back like the activation scales (training does not quantize a KV cache)
    for extra in ("input_scale", "input_global_scale", "weight_zero_point", "input_zero_point", "k_scale", "v_scale"):
        if f"{lay}.{extra}" in info:
            plan.consumed[f"{lay}.{extra}"] = "extra"
            p.extras.append(f"{lay}.{extra}")


def _group_problem(p: LayerPlan, N: int, K: int, shape: tuple, dtype) -> Optional[str]:
    """Why a musubi scale [N, K / g, 1] (1 x g blocks) cannot be read for the layer of `p`, or None."""
    if not (p.linear and p.fp8):
        return "1 x g block scales are read for linear layers only"
    if shape[0] != N or shape[2] != 1 or shape[1] < 1 or K % shape[1]:
        return f"not [{N}, {K} / g, 1] (1 x g blocks of the [{N}, {K}] weight)"
    if dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        return f"dtype {dtype} (only fp32/bf16/fp16 scales are read)"
    return None


def _infer_block(n: int, k: int, shape: tuple, hint: Optional[int]) -> Optional[int]:
    """The block size b for scale [ceil(n/b), ceil(k/b)]: `hint`, else 128, else the power of 2 that fits, or None."""
    def fits(b):
        return b >= 1 and shape == (-(-n // b), -(-k // b))
    if len(shape) != 2:
        return None
    if hint is not None:
        return hint if fits(hint) else None
    if fits(DEFAULT_BLOCK):
        return DEFAULT_BLOCK
    ok = [b for b in (2 ** i for i in range(0, 14)) if fits(b)]
    return ok[0] if len(ok) == 1 else None


def _kind(dtype: torch.dtype) -> str:
    return "bool" if dtype == torch.bool else "floating-point" if dtype.is_floating_point else "integer"


def _dtype_problems(k: str, dtype: Optional[torch.dtype], m: str, target: Optional[torch.Tensor]) -> list[str]:
    """Why checkpoint tensor k (of `dtype`, None if torch has none) cannot be cast into the model's tensor m: a cast
    across kinds (an int8 weight into a float Linear, a bool buffer) would be silently wrong."""
    if target is None:
        return []
    if dtype is None:
        return [f"{k}: a dtype torch does not have, for the model's {m!r} ({target.dtype})"]
    if _kind(dtype) != _kind(target.dtype):
        return [f"{k}: {str(dtype).replace('torch.', '')} ({_kind(dtype)}) in the checkpoint, but the model's {m!r} "
                f"is {str(target.dtype).replace('torch.', '')} ({_kind(target.dtype)}): the file is not this "
                f"model's, or was quantized in a way dorafp8 does not read"]
    return []


def _plan_other_tensors(plan: LoadPlan, source: CheckpointSource, model_t: dict, tied: dict, report: LoadReport,
                        strict: bool) -> None:
    """The tensors loaded as they are (cast); what the model lacks or nothing fits, an error under strict."""
    info, fmt, names = source.info, plan.fmt, plan.keys.names
    errors = []
    unexpected = []
    for k in plan.keys.ckpt_keys:
        if k in plan.consumed or k in plan.layer_of:
            continue
        m = names[k]
        if m is None:
            report.kept[k] = "skipped by key_map"
            continue
        lay_name = m.rpartition(".")[0]
        if lay_name in plan.layers and plan.layers[lay_name].fp8 and m.endswith(".bias"):
            errors += _dtype_problems(k, info[k][0], m, model_t.get(m))
            plan.plain[k] = m
            continue
        if m in model_t:
            if tuple(model_t[m].shape) != info[k][1]:
                errors.append(f"{k}: shape {list(info[k][1])} in the checkpoint, {list(model_t[m].shape)} in the "
                              f"model's {m!r}")
            errors += _dtype_problems(k, info[k][0], m, model_t[m])
            plan.plain[k] = m
        elif k.endswith("rotary_emb.inv_freq"):
            report.kept[k] = "rotary inv_freq (computed by the model)"
        else:
            unexpected.append(k)
    if errors:
        raise CheckpointFormatError(f"{source.name} ({fmt}): " + some(errors, first=8, sep="; ", names=False))
    # the planned layers' own tensors (weight, scales) but their bias, which is loaded as a plain tensor
    covered = {n for n in model_t if n.rpartition(".")[0] in plan.layers and not n.endswith(".bias")}
    for m in plan.plain.values():
        covered |= set(tied.get(m, [m]))
    missing = sorted(n for n in model_t if n not in covered)
    report.missing, report.unexpected = missing, unexpected
    if strict and (missing or unexpected):
        msg = []
        if missing:
            msg.append(f"{len(missing)} model tensors are not in the checkpoint: {some(missing)}")
        if unexpected:
            msg.append(f"{len(unexpected)} checkpoint tensors fit nothing in the model: {some(unexpected)}")
        hint = f" (key prefix {report.prefix!r} was applied)" if report.prefix else ""
        raise CheckpointFormatError(f"{source.name} ({fmt}) does not fit the model{hint}: " + "; ".join(msg)
                                    + ". Pass key_map= to rename keys, or strict=False to load what fits")
