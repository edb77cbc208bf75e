"""The config.json of a written directory, and the checks that it loads right: the quantization_config transformers
reads (a layout it would load wrong refused), or a guard that makes diffusers' from_pretrained refuse the folder."""

from __future__ import annotations

import json
import os
import re
from typing import Optional

from torch import nn

from ..quant import MXFP8_BLOCK, scale_kind
from .files import names_a_file
from .layouts import TRANSFORMERS_FORMATS, cpu_fine_grained_read
from .modules import FP8_CONV_TYPES, fp8_modules
from .plan import WriteTarget, Written
from .reports import ExportReport
from .source import BLOCK_SIZE_KEY, KV_CACHE_ALGO_KEY


def writes_block(t: WriteTarget, m: nn.Module) -> bool:
    """Whether the layer is written with block scales (conservative where a merged layer could differ)."""
    return t.fmt == "fine-grained" or t.granularity == "block" or (t.granularity is None and
                                                                   scale_kind(m.scale) == "block")


def transformers_problem(t: WriteTarget, why: str) -> Optional[str]:
    """Why transformers' from_pretrained would misread this fp8 checkpoint (None if it would not); `why`: the fix."""
    layers = fp8_modules(t.base)
    convs = [n for n, m in layers.items() if isinstance(m, FP8_CONV_TYPES)]
    if convs and t.fmt != "fp8-cast":  # fp8-cast has no scales: a plain cast reads it right
        return (f"{len(convs)} fp8 conv layers (e.g. {convs[0]!r}): transformers reads fp8 convolutions in no layout "
                f"(compressed-tensors' loader leaves their scales out and loads the raw e4m3 values). {why}, or a "
                f"dense format (bf16, fp16, fp32), or keep the convolutions unquantized (quantize_model without "
                f"include_conv)")
    b = t.block_size
    ragged = [(n, m.weight.shape[0], m.weight[0].numel()) for n, m in layers.items()
              if writes_block(t, m) and (m.weight.shape[0] % b or m.weight[0].numel() % b)]
    if ragged and t.fmt == "compressed-tensors":
        n, N, K = ragged[0]
        return (f"{len(ragged)} layers have a dimension that is not a multiple of the block size {b} (e.g. {n!r}, "
                f"[{N}, {K}]): compressed-tensors (and vLLM) read whole blocks only, and transformers fails to load "
                f"them. {why}, or write format='fine-grained' (partial blocks the DeepSeek-V3 way) or "
                f"granularity='row'")
    wrong = [(n, N, K) for n, N, K in ragged if cpu_fine_grained_read(N, K, b) == "wrong"]
    if wrong and t.fmt == "fine-grained":
        n, N, K = wrong[0]
        return (f"{len(wrong)} layers cover partial {b} x {b} blocks whose count divides the weight (e.g. {n!r}, "
                f"[{N}, {K}]): transformers' dequantizing loader (used without a GPU) takes the block size from "
                f"that count and misreads them. {why}, or granularity='row' with format='compressed-tensors'")
    return None


def check_destination(t: WriteTarget, path: str, defaulted: bool) -> None:
    """Refuses, before anything is written, a directory with a transformers config.json that it would load wrong, and
    a diffusers model's single file in ComfyUI's layouts, which ComfyUI would load wrong."""
    how = f"format=None writes the layout the model was loaded from, {t.fmt}" if defaulted else f"format={t.fmt!r}"
    if names_a_file(path) and t.config_kind == "diffusers" and t.fmt in ("comfyui", "comfyui-quant"):
        # ComfyUI reads a diffusion model's scaled fp8 keys only under its original (ldm, BFL, ...) names; a file in
        # diffusers' names it converts for the weights alone (comfy/model_detection.py convert_diffusers_mmdit,
        # comfy/utils.py unet_to_diffusers), dropping the scales: the raw e4m3 values would run unscaled, silently
        raise ValueError(f"{path}: {how}, for {type(t.base).__name__}, a diffusers model: the file would hold "
                         f"diffusers' key names, and ComfyUI's loader converts those for the weights alone: it drops "
                         f"every scale_weight / weight_scale and the scaled_fp8 marker and runs the raw e4m3 values "
                         f"unscaled, without an error. For ComfyUI write format='bf16' (diffusers names, which it "
                         f"converts), or the adapter alone onto the original file (save_single_file_dora for a model "
                         f"from load_single_file, save_kohya_dora); to reload with dorafp8 write format='dorafp8' or "
                         f"'compressed-tensors', or a folder")
    if t.fmt == "modelopt" and not names_a_file(path):
        # a folder gets hf_quant_config.json, which ModelOpt and vLLM read: ModelOpt's export asserts whole MXFP8
        # blocks (MXFP8QTensor: in_dim % 32) and vLLM's ModelOptMxFp8LinearMethod refuses any other input size, so
        # the partial last block (ceil) dorafp8 holds and writes would be a folder they refuse
        ragged = [(n, m.in_features) for n, m in fp8_modules(t.base).items()
                  if scale_kind(m.scale) == "mxfp8" and m.in_features % MXFP8_BLOCK]
        if ragged:
            raise ValueError(f"{path}: format='modelopt' into a folder (with hf_quant_config.json, quant_algo MXFP8): "
                             f"{len(ragged)} MXFP8 layers have an input size that is not a multiple of "
                             f"{MXFP8_BLOCK} (e.g. {ragged[0][0]!r}, {ragged[0][1]}), whose last block ModelOpt "
                             f"and vLLM's ModelOpt MXFP8 loader refuse. Write a single file (a path ending in "
                             f".safetensors, which load_fp8_checkpoint reads back) or a dense format (bf16)")
    if names_a_file(path) or t.config_kind != "transformers" or t.layout is None:
        return
    if t.fmt == "modelopt":  # ModelOpt's own export layout, hf_quant_config.json beside it (modelopt_config)
        return
    file_hint = ("Write it to a single file instead (a path ending in .safetensors, no config.json), or to "
                 "format='compressed-tensors' / 'fine-grained', which transformers and vLLM read (and "
                 "load_fp8_checkpoint too)")
    if t.fmt not in TRANSFORMERS_FORMATS:
        raise ValueError(f"{path}: {how}, into a directory with a transformers config.json: transformers' "
                         f"from_pretrained would load the raw e4m3 values without their scales ('<layer>."
                         f"{t.layout.scale_key}'), silently wrong. {file_hint}")
    problem = transformers_problem(t, "Write a single .safetensors file instead")
    if problem:
        raise ValueError(f"{path}: {t.fmt} into a directory with a transformers config.json: {problem}")


def quantization_config(t: WriteTarget, report: ExportReport, out: Written) -> Optional[dict]:
    """config.json's quantization_config for the fp8 layouts transformers reads (None for the others)."""
    old_q = (t.src.config or {}).get("quantization_config") if t.same else None
    if old_q and all(d["action"] == "kept" for d in report.layers.values()):
        return old_q
    block_size, ignore = t.block_size, sorted(set(out.dense_linears))
    if t.fmt == "fine-grained":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [block_size, block_size],
                "modules_to_not_convert": ignore or None, "scale_fmt": "float"}
    if t.fmt != "compressed-tensors":
        return None
    strategies = {"tensor": "tensor", "row": "channel", "block": "block"}
    fp8_args = {"num_bits": 8, "type": "float", "symmetric": True}
    cg = {}
    for i, ((g, act), names) in enumerate(sorted(out.groups.items())):
        weights = {**fp8_args, "dynamic": False, "strategy": strategies[g], "group_size": None,
                   "block_structure": [block_size, block_size] if g == "block" else None}
        # the activations as the model computes them: transformers + compressed-tensors then reproduce its outputs
        # (to 2e-7, measured), and vLLM runs weight-only layers as CompressedTensorsW8A16Fp8
        if act == "static":
            acts = {**fp8_args, "dynamic": False, "strategy": "tensor"}
        elif act == "dynamic":  # act_quant="rowwise": one scale per row (token), whatever the weight's scales
            acts = {**fp8_args, "dynamic": True, "strategy": "token"}
        else:  # W8A16: weight-only
            acts = None
        # "Linear" covers every layer of a single group, unless fp8 conv layers are in it: then by name
        targets = ["Linear"] if len(out.groups) == 1 and not out.conv_layers else \
            [f"re:^{re.escape(n)}$" for n in names]
        cg[f"group_{i}"] = {"targets": targets, "weights": weights, "input_activations": acts,
                            "output_activations": None, "format": "float-quantized"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": cg, "ignore": ignore, "kv_cache_scheme": None, "global_compression_ratio": None,
            "sparsity_config": {}, "transform_config": {}}


# diffusers reads no fp8 layout with scales: a diffusers directory's config.json carries diffusers_guard, so that its
# from_pretrained refuses it instead of loading the raw e4m3 values
DIFFUSERS_LOAD_HINT = ("build the model on the meta device (with accelerate.init_empty_weights(): model = "
                       "ModelClass.from_config(ModelClass.load_config(path))) and call dorafp8.load_fp8_checkpoint("
                       "model, path)")


def diffusers_guard(fmt: str) -> dict:
    return {"quant_method": "dorafp8", "layout": fmt,
            "note": f"fp8 weights in the {fmt} layout, written by dorafp8; diffusers' from_pretrained cannot read "
                    f"their scales: {DIFFUSERS_LOAD_HINT}"}


def file_metadata(src, fmt: str, same: bool) -> dict:
    """The safetensors metadata of a write: the source's where it keeps its format, less its block size (the writer
    says its own); in a modelopt file the source's kv_cache_quant_algo, which a single file (no hf_quant_config.json)
    would lose, and a folder export from it then said null (vLLM ran the KV cache in bf16): source.py reads it."""
    meta = dict(src.metadata or {}) if same else {"format": "pt"}
    meta.pop(BLOCK_SIZE_KEY, None)
    meta.pop(KV_CACHE_ALGO_KEY, None)
    if fmt == "modelopt" and same and src.kv_cache_quant_algo:
        meta[KV_CACHE_ALGO_KEY] = src.kv_cache_quant_algo
    return meta


def modelopt_config(out: Written, kv_cache_quant_algo: Optional[str] = None) -> dict:
    """hf_quant_config.json as ModelOpt's HF export writes it: quant_algo, group size, dense linears. NVFP4 layers are
    "NVFP4" (W4A4) where each has its input_scale, else "W4A16_NVFP4" (weight-only): vLLM's NVFP4 method computes
    with every layer's input_scale, left uninitialized where the file has none (a W4A16_NVFP4 or compressed-tensors
    source), while its W4A16_NVFP4 one reads the same weights and ignores input_scale. kv_cache_quant_algo: the
    source's, whose k_scale / v_scale the export keeps: vLLM runs its KV cache in fp8 by it (left out, in bf16)."""
    (kind,) = {k for k, _ in out.groups}  # write._check_modelopt: one kind a file
    algo = "W4A16_NVFP4" if kind == "nvfp4" and any(act != "static" for _, act in out.groups) else kind.upper()
    return {"producer": {"name": "dorafp8"},
            "quantization": {"quant_algo": algo, "kv_cache_quant_algo": kv_cache_quant_algo,
                             "group_size": 16 if kind == "nvfp4" else 32,
                             "exclude_modules": sorted(set(out.dense_linears))}}


def write_config(t: WriteTarget, path: str, report: ExportReport, out: Written) -> None:
    if t.fmt == "modelopt":
        with open(os.path.join(path, "hf_quant_config.json"), "w") as f:
            json.dump(modelopt_config(out, t.src.kv_cache_quant_algo if t.same else None), f, indent=2)
    if t.config_kind == "diffusers":
        t.base.save_config(path)
        if t.layout is not None:
            cfg_path = os.path.join(path, "config.json")
            with open(cfg_path) as f:
                cfg = json.load(f)
            cfg["quantization_config"] = diffusers_guard(t.fmt)
            with open(cfg_path, "w") as f:
                json.dump(cfg, f, indent=2, sort_keys=True)
        return
    if t.config_kind is None:
        return
    cfg_obj = getattr(t.base, "config", None)
    cfg = cfg_obj.to_dict() if hasattr(cfg_obj, "to_dict") else dict(t.src.config)
    cfg.pop("quantization_config", None)
    if t.dense_dtype is not None:
        cfg["torch_dtype"] = cfg["dtype"] = str(t.dense_dtype).replace("torch.", "")
    else:
        qc = quantization_config(t, report, out)
        if qc is not None:
            cfg["quantization_config"] = qc
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True, default=str)
