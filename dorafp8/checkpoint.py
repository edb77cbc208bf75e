"""fp8 checkpoints as people have them: load them into FP8Linear layers, write them back, export merged DoRA models.

Layouts (`format=`; docs/CHECKPOINTS.md has where each comes from and how it was checked). In every one of them the
dequantized weight is W0 = scale * W8, W8 float8_e4m3fn [out, in] under `<layer>.weight`:

    name                 weight scale                scale shape                        also in the file
    comfyui              <layer>.scale_weight        ()                                 `scaled_fp8` marker, scale_input
    comfyui-quant        <layer>.weight_scale        ()                                 <layer>.comfy_quant, input_scale
    compressed-tensors   <layer>.weight_scale        [1], [out, 1] or [ceil(out/b), ceil(in/b)]   input_scale (static)
    fine-grained         <layer>.weight_scale_inv    [ceil(out/b), ceil(in/b)], b = 128; or ()   activation_scale
    dorafp8              <layer>.scale               [], [out] or blocks (FP8Linear's own state_dict)
    fp8-cast             none (scale 1)              a model cast to float8_e4m3fn, as OneTrainer stores it

Public API:
    load_fp8_checkpoint(model, path_or_state_dict, format="auto")  -> LoadReport
    save_fp8_checkpoint(model, path, format=None)                  -> ExportReport   (no merging)
    export_merged(model, path, format=None)                        -> ExportReport   (DoRA/LoRA adapters merged in)
    detect_format(path_or_state_dict)                              -> (format, what it saw)

Loading never re-quantizes: the e4m3 bytes of every fp8 weight go into an FP8Linear as they are, with the scale
converted to fp32 exactly. Safetensors shards are read one at a time, one tensor at a time, so a model built on the
meta device only ever holds its own weights. Writing re-quantizes only what changed (merged layers) or what the
target layout cannot hold as is (a per-row layer written per tensor), and says so.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Optional

import torch
from torch import nn

from .nn import FP8ConvNd, FP8Linear, fp8_conv_class
from .merge import adapter_terms, merged_rows, requantize
from .quant import DEFAULT_BLOCK, E4M3, check_scale, scale_kind, w0_rows

logger = logging.getLogger("dorafp8")

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
    "fp8-cast": Layout("fp8-cast", None, None, ("tensor",),
                       "weights cast to float8_e4m3fn without a scale (scale 1)"),
}
DENSE_FORMATS = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_ALIASES = {"comfy": "comfyui", "scaled_fp8": "comfyui", "comfy_quant": "comfyui-quant", "ct": "compressed-tensors",
            "compressed_tensors": "compressed-tensors", "finegrained": "fine-grained", "fine_grained": "fine-grained",
            "fp8": "fine-grained", "bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
FORMATS = tuple(LAYOUTS) + tuple(DENSE_FORMATS)

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "F8_E4M3": E4M3, "F8_E5M2": E5M2, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
              "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_INDEX_NAMES = ("model.safetensors.index.json", "diffusion_pytorch_model.safetensors.index.json")
_GRAN_NAMES = {"tensor": "per-tensor", "row": "per-row", "block": "per-block"}
_PROGRESS_EVERY_S = 10.0  # a progress line at least this often while loading


def _canonical_format(fmt: str, allowed=FORMATS) -> str:
    name = _ALIASES.get(str(fmt).lower(), str(fmt).lower())
    if name not in allowed:
        raise ValueError(f"format must be one of {', '.join(allowed)} (or 'auto'), got {fmt!r}")
    return name


# ----------------------------------------------------------------------------------------------------------------
# Sources: a dict, a .safetensors file, or a directory (sharded with an index, or not)
# ----------------------------------------------------------------------------------------------------------------


class _Source:
    """Keys, dtypes and shapes of a checkpoint without reading its data; then the data, one shard at a time."""

    def __init__(self, src):
        if not isinstance(src, Mapping):
            from ._deps import require

            require("safetensors", what="reading fp8 checkpoint files")
        self.state_dict = None
        self.config = None
        self.metadata: dict = {}
        self.info: dict[str, tuple] = {}  # key -> (dtype or None, shape, shard index)
        if isinstance(src, Mapping):
            self.name = "state dict"
            self.state_dict = src
            self.shards = [None]
            for k, t in src.items():
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"state dict value {k!r} is a {type(t).__name__}, not a tensor")
                self.info[k] = (t.dtype, tuple(t.shape), 0)
            return
        path = os.fspath(src)
        self.name = path
        if os.path.isdir(path):
            index = next((os.path.join(path, n) for n in _INDEX_NAMES if os.path.exists(os.path.join(path, n))), None)
            if index is not None:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
                self.shards = [os.path.join(path, s) for s in sorted(set(weight_map.values()))]
            else:
                self.shards = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
            if not self.shards:
                others = sorted(n for n in os.listdir(path) if n.endswith((".bin", ".pt", ".pth", ".ckpt", ".gguf")))
                raise FileNotFoundError(f"no .safetensors file in {path}" + (
                    f" (found {', '.join(others[:3])}: only safetensors checkpoints are read; load other formats "
                    f"yourself and pass the state dict)" if others else ""))
            cfg = os.path.join(path, "config.json")
            if os.path.exists(cfg):
                with open(cfg) as f:
                    self.config = json.load(f)
        elif os.path.isfile(path):
            if not path.endswith(".safetensors"):
                raise CheckpointFormatError(f"{path} is not a .safetensors file; load it yourself (torch.load) and "
                                            f"pass the state dict")
            self.shards = [path]
        else:
            raise FileNotFoundError(f"no such file or directory: {path}")
        from safetensors import safe_open

        for i, shard in enumerate(self.shards):
            with safe_open(shard, framework="pt") as f:
                if i == 0:
                    self.metadata = dict(f.metadata() or {})
                for k in f.keys():
                    sl = f.get_slice(k)
                    if k in self.info:
                        raise CheckpointFormatError(f"{k!r} is in two shards ({self.shards[self.info[k][2]]} and "
                                                    f"{shard})")
                    self.info[k] = (_ST_DTYPES.get(sl.get_dtype()), tuple(sl.get_shape()), i)

    def quant_config(self) -> dict:
        return (self.config or {}).get("quantization_config") or {}

    def read(self, keys: Iterable[str], device) -> Iterable[tuple[str, torch.Tensor]]:
        """(key, tensor) for `keys`, shard by shard, one tensor at a time."""
        by_shard: dict[int, list[str]] = {}
        for k in keys:
            by_shard.setdefault(self.info[k][2], []).append(k)
        if self.state_dict is not None:
            for k in by_shard.get(0, []):
                yield k, self.state_dict[k].to(device)
            return
        from safetensors import safe_open

        dev = str(torch.device(device))
        for i in sorted(by_shard):
            with safe_open(self.shards[i], framework="pt", device=dev) as f:
                for k in by_shard[i]:
                    yield k, f.get_tensor(k)


# ----------------------------------------------------------------------------------------------------------------
# Detection
# ----------------------------------------------------------------------------------------------------------------


def _layer(key: str) -> str:
    return key.rpartition(".")[0]


def _detect(source: _Source) -> tuple[str, str]:
    info = source.info
    keys = list(info)
    fp8_w = [k for k in keys if info[k][0] == E4M3 and k.endswith("weight")]
    e5m2 = [k for k in keys if info[k][0] == E5M2]
    suffix = Counter(k.rpartition(".")[2] for k in keys)
    seen = ", ".join(f"{n} x .{s}" for s, n in suffix.most_common() if s not in ("weight", "bias"))[:300]
    dtypes = Counter(str(info[k][0]).replace("torch.", "") for k in keys)
    what = (f"{len(keys)} tensors ({', '.join(f'{n} {d}' for d, n in dtypes.most_common())}); keys other than "
            f".weight/.bias: {seen or 'none'}")
    if e5m2:
        raise CheckpointFormatError(f"{source.name}: float8_e5m2 tensors (e.g. {e5m2[0]!r}); dorafp8 holds "
                                    f"float8_e4m3fn weights only. Saw {what}")
    unsupported = {"weight_packed": "packed int4/fp4 weights (compressed-tensors pack-quantized / nvfp4-pack)",
                   "weight_scale_2": "NVFP4 (two-level scales)", "weight_global_scale": "NVFP4 / tensor-group scales",
                   "qweight": "GPTQ/AWQ int4", "SCB": "bitsandbytes int8", "absmax": "bitsandbytes 4-bit"}
    for s, why in unsupported.items():
        if suffix.get(s):
            raise CheckpointFormatError(f"{source.name}: {why} (keys like '<layer>.{s}'); dorafp8 loads fp8 e4m3 "
                                        f"checkpoints only. Saw {what}")
    int8_scaled = [k for k in keys if info[k][0] == torch.int8 and k.endswith(".weight")
                   and (_layer(k) + ".weight_scale") in info]
    if int8_scaled:
        raise CheckpointFormatError(f"{source.name}: int8 weights with scales (e.g. {int8_scaled[0]!r}: "
                                    f"compressed-tensors int-quantized / W8A8-INT8); dorafp8 loads fp8 e4m3 only")
    signals = {}
    if suffix.get("comfy_quant") or "_quantization_metadata" in source.metadata:
        signals["comfyui-quant"] = "'<layer>.comfy_quant' entries" if suffix.get("comfy_quant") else \
            "'_quantization_metadata' in the safetensors metadata"
    if suffix.get("scale_weight") or any(k == "scaled_fp8" or k.endswith(".scaled_fp8") for k in keys):
        signals["comfyui"] = "'scaled_fp8' / '<layer>.scale_weight'"
    if suffix.get("weight_scale_inv"):
        signals["fine-grained"] = "'<layer>.weight_scale_inv'"
    if suffix.get("weight_scale") and "comfyui-quant" not in signals:
        signals["compressed-tensors"] = "'<layer>.weight_scale'"
    if any((_layer(k) + ".scale") in info for k in fp8_w):
        signals["dorafp8"] = "fp8 '<layer>.weight' with '<layer>.scale'"
    qc = source.quant_config()
    method = qc.get("quant_method")
    if len(signals) > 1:
        raise CheckpointFormatError(f"{source.name}: the keys match several fp8 layouts at once "
                                    f"({'; '.join(f'{n}: {s}' for n, s in signals.items())}); pass format= to pick "
                                    f"one. Saw {what}")
    if signals:
        name, evidence = next(iter(signals.items()))
    elif fp8_w:
        name, evidence = "fp8-cast", f"float8_e4m3fn weights (e.g. {fp8_w[0]!r}) and no scale keys"
    else:
        raise CheckpointFormatError(
            f"{source.name}: no float8_e4m3fn weight, so this is not an fp8 checkpoint dorafp8 knows "
            f"(layouts: {', '.join(LAYOUTS)}). Saw {what}. An unquantized checkpoint loads the usual way "
            f"(from_pretrained / load_state_dict); then dorafp8.quantize_model(model) puts it in fp8")
    expected = {"fp8": "fine-grained", "compressed-tensors": "compressed-tensors"}.get(method)
    if expected and expected != name:
        raise CheckpointFormatError(f"{source.name}: config.json says quant_method={method!r} ({expected}) but the "
                                    f"keys look like {name} ({evidence}). Saw {what}")
    if not fp8_w and name != "comfyui-quant":
        raise CheckpointFormatError(f"{source.name}: looks like {LAYOUTS[name].description} ({evidence}) but holds "
                                    f"no float8_e4m3fn weight. Saw {what}")
    return name, evidence


def detect_format(path_or_state_dict) -> tuple[str, str]:
    """(format, the evidence) of a checkpoint, from its keys, dtypes and config.json, without reading tensor data.
    Raises CheckpointFormatError naming what it saw when the layout is not one of LAYOUTS."""
    return _detect(_Source(path_or_state_dict))


# ----------------------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class LoadReport:
    """What load_fp8_checkpoint did. `str(report)` is the summary it prints."""
    format: str
    evidence: str
    source: str
    prefix: str = ""
    fp8_layers: dict = field(default_factory=dict)      # module name -> "per-tensor" / "per-row" / "per-128x128-block"
    dequantized: list = field(default_factory=list)     # fp8 tensors dequantized into modules that are not linear
    loaded: list = field(default_factory=list)          # other tensors, cast to the model's dtype
    kept: dict = field(default_factory=dict)            # checkpoint key -> why it was not loaded into the model
    missing: list = field(default_factory=list)         # model tensors the checkpoint does not have
    initialized: list = field(default_factory=list)     # model buffers computed, not loaded (rotary inv_freq, ...)
    unexpected: list = field(default_factory=list)      # checkpoint keys that fit nothing in the model
    shards: int = 0
    bytes_read: int = 0
    seconds: float = 0.0

    def __str__(self) -> str:
        kinds = Counter(self.fp8_layers.values())
        lines = [f"dorafp8: loaded {self.source} as {self.format} ({self.evidence})"
                 + (f", key prefix {self.prefix!r} stripped" if self.prefix else ""),
                 f"  fp8 layers (FP8Linear, bytes as stored): {len(self.fp8_layers)}"
                 + (f" ({', '.join(f'{n} {k}' for k, n in kinds.most_common())})" if kinds else ""),
                 f"  other tensors loaded: {len(self.loaded)}; {self.shards} shard(s), "
                 f"{self.bytes_read / 2**20:.1f} MiB in {self.seconds:.1f} s"]
        if self.dequantized:
            lines.append(f"  fp8 tensors of non-linear modules, dequantized: {len(self.dequantized)} "
                         f"(e.g. {self.dequantized[0]})")
        if self.kept:
            why = Counter(self.kept.values())
            lines.append(f"  checkpoint entries not loaded into the model: {len(self.kept)} ("
                         + "; ".join(f"{n} {w}" for w, n in why.most_common()) + ")")
        if self.initialized:
            lines.append(f"  buffers computed by the model, not in the checkpoint: {', '.join(self.initialized[:4])}"
                         + (" ..." if len(self.initialized) > 4 else ""))
        for what, names in (("missing from the checkpoint (left as they were)", self.missing),
                            ("in the checkpoint but not in the model (not loaded)", self.unexpected)):
            if names:
                lines.append(f"  {what}: {len(names)}: {', '.join(names[:4])}" + (" ..." if len(names) > 4 else ""))
        return "\n".join(lines)


def _model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
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


def _model_dtype(model: nn.Module) -> torch.dtype:
    counts = Counter(p.dtype for p in model.parameters() if p.is_floating_point() and p.dtype not in (E4M3, E5M2))
    return counts.most_common(1)[0][0] if counts else torch.float32


def _infer_block(n: int, k: int, shape: tuple, hint: Optional[int]) -> Optional[int]:
    """The square block size b with scale shape [ceil(n/b), ceil(k/b)]: `hint` if it fits, else 128, else the only
    power of two that fits; None if none does."""
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


def _config_block(source: _Source, fmt: str) -> Optional[int]:
    qc = source.quant_config()
    if fmt == "fine-grained":
        if qc.get("scale_fmt", "float") not in (None, "float"):
            raise CheckpointFormatError(f"{source.name}: scale_fmt={qc.get('scale_fmt')!r} (ue8m0 scales) is not "
                                        f"supported; dorafp8 reads fp32/bf16/fp16 scales")
        bs = qc.get("weight_block_size")
    elif fmt == "compressed-tensors":
        if qc.get("format") not in (None, "float-quantized", "naive-quantized", "mixed-precision"):
            raise CheckpointFormatError(f"{source.name}: compressed-tensors format {qc.get('format')!r} is not "
                                        f"float-quantized fp8")
        bs = None
        for g in (qc.get("config_groups") or {}).values():
            w = (g or {}).get("weights") or {}
            if w and (w.get("type") != "float" or w.get("num_bits") != 8):
                raise CheckpointFormatError(f"{source.name}: compressed-tensors weights of type {w.get('type')!r} "
                                            f"with {w.get('num_bits')} bits: dorafp8 loads 8-bit float (fp8) only")
            if w.get("strategy") == "block":
                bs = w.get("block_structure")
    else:
        return None
    if bs is None:
        return None
    if isinstance(bs, (list, tuple)):
        if len(set(bs)) != 1:
            raise CheckpointFormatError(f"{source.name}: block size {list(bs)} is not square; FP8Linear holds square "
                                        f"b x b blocks")
        bs = bs[0]
    return int(bs)


def _tied_groups(model: nn.Module) -> dict[str, list[str]]:
    by_id: dict[int, list[str]] = {}
    for name, t in _model_tensors(model).items():
        by_id.setdefault(id(t), []).append(name)
    return {n: names for names in by_id.values() if len(names) > 1 for n in names}


def _set_tensor(model: nn.Module, name: str, value, *, param: Optional[bool] = None, requires_grad=False):
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    if attr in mod._parameters or param:
        if not isinstance(value, nn.Parameter):
            value = nn.Parameter(value, requires_grad=requires_grad and value.is_floating_point())
        mod._parameters[attr] = value
    else:
        mod._buffers[attr] = value


def _swap_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def load_fp8_checkpoint(model: nn.Module, path_or_state_dict, format: str = "auto", *, device="cpu",
                        dtype: Optional[torch.dtype] = None, block_size: Optional[int] = None,
                        key_map: Optional[Callable[[str], Optional[str]]] = None, strict: bool = True,
                        backend: str = "auto", act_quant: Optional[str] = None,
                        verbose: bool = True) -> LoadReport:
    """Loads an fp8 checkpoint into `model`, in place: every linear layer whose checkpoint weight is float8_e4m3fn
    becomes an FP8Linear holding those bytes and their scale (converted to fp32 exactly); everything else (norms,
    embeddings, lm_head, biases) is loaded into the model's own tensors, cast to their dtype.

    model: an nn.Module, typically built on the meta device (`with accelerate.init_empty_weights():
        AutoModelForCausalLM.from_config(cfg)`, `with torch.device("meta"): ...`, a diffusers model built the same
        way); its tensors are materialized on `device` as they are read. A model with real weights works too.
    path_or_state_dict: a .safetensors file, a directory (sharded with model.safetensors.index.json, or not), or a
        dict of tensors. Shards are read one at a time, one tensor at a time.
    format: "auto" (detected from the keys, dtypes and config.json; an error names what it saw if it cannot tell)
        or one of LAYOUTS: comfyui, comfyui-quant, compressed-tensors, fine-grained, dorafp8, fp8-cast.
    dtype: the dtype of the tensors that are not fp8 (and of the adapters PEFT will create); default: the model's.
    block_size: the square block size of block scales when neither config.json nor the shapes say (default 128).
    key_map: maps a checkpoint key to the model's name for it (or None to skip it); without it a common prefix
        (ComfyUI's 'model.diffusion_model.', ...) is found and stripped automatically.
    strict: model tensors that the checkpoint lacks, or checkpoint tensors that fit nothing, are an error (checked
        before any data is read). With strict=False they are reported; missing ones stay as they were (on the meta
        device: initialized by the model's own initializer, transformers' _init_weights, where it has one).
    backend, act_quant: given to the FP8Linear layers (see FP8Linear).
    verbose: print the report (and a line per shard for sharded checkpoints); it is always logged on the "dorafp8"
        logger.
    Returns a LoadReport; `model.dorafp8_checkpoint` keeps it (save_fp8_checkpoint uses it to write the same layout
    back).
    """
    t0 = time.time()
    source = _Source(path_or_state_dict)
    if format == "auto":
        fmt, evidence = _detect(source)
    else:
        fmt = _canonical_format(format, tuple(LAYOUTS))
        detected = None
        try:
            detected, evidence = _detect(source)
        except CheckpointFormatError:
            evidence = "format given"
        if detected not in (None, fmt) and not (fmt == "fp8-cast"):
            raise CheckpointFormatError(f"format={fmt!r} but the checkpoint looks like {detected} ({evidence})")
        evidence = "format given"
    layout = LAYOUTS[fmt]
    cfg_block = _config_block(source, fmt)
    model_dtype = dtype or _model_dtype(model)
    tie = getattr(model, "tie_weights", None)
    if callable(tie):  # accelerate's init_empty_weights re-creates parameters and so unties them (lm_head / embeddings)
        tie()
    model_t = _model_tensors(model)
    info = source.info
    report = LoadReport(fmt, evidence, source.name, shards=len(source.shards))

    # ---- map checkpoint keys to model names -----------------------------------------------------------------
    marker_keys = {k for k in info if k == "scaled_fp8" or k.endswith(".scaled_fp8")}
    ckpt_keys = [k for k in info if k not in marker_keys]
    strip = add = ""
    if key_map is None:
        strip, add = _find_prefix([k for k in ckpt_keys if not k.endswith(".comfy_quant")], set(model_t))
        report.prefix = strip or add

        def key_map(k):  # noqa: F811
            return add + (k[len(strip):] if strip and k.startswith(strip) else k)
    names = {k: key_map(k) for k in ckpt_keys}
    layer_of = {}  # fp8 weight key -> module name in the model
    fp8_layers: dict[str, dict] = {}  # module name -> plan
    for k in ckpt_keys:
        m = names[k]
        if m is None or not k.endswith(".weight") or info[k][0] != E4M3:
            continue
        mod_name = m[:-len(".weight")]
        try:
            mod = model.get_submodule(mod_name)
        except AttributeError:
            continue
        layer_of[k] = mod_name
        linear = isinstance(mod, (nn.Linear, FP8Linear)) and not _is_conv1d(mod)
        conv = isinstance(mod, FP8ConvNd) or fp8_conv_class(mod) is not None
        # "fp8": the layer keeps the checkpoint's e4m3 bytes and scale (FP8Linear, FP8Conv1d/2d/3d); any other
        # module holding an fp8 tensor (embedding, GPT-2's Conv1D) gets it dequantized
        fp8_layers[mod_name] = {"key": k, "module": mod, "linear": linear, "conv": conv, "fp8": linear or conv}

    consumed: dict[str, str] = {}  # ckpt key -> how it was used
    plan_scale: dict[str, tuple] = {}  # scale key -> (module name, N, K, block, linear)
    errors = []
    for k, mod_name in layer_of.items():
        lay = _layer(k)
        shape_w = info[k][1]
        N, K = (shape_w[0], int(torch.Size(shape_w[1:]).numel())) if len(shape_w) >= 2 else (None, None)
        p = fp8_layers[mod_name]
        mod = p["module"]
        if p["linear"] and (N, K) != (mod.out_features, mod.in_features):
            errors.append(f"{k}: shape {list(info[k][1])} in the checkpoint, [{mod.out_features}, "
                          f"{mod.in_features}] in the model's {mod_name!r}")
            continue
        if p["conv"] and tuple(shape_w) != tuple(mod.weight.shape):
            errors.append(f"{k}: shape {list(shape_w)} in the checkpoint, {list(mod.weight.shape)} in the model's "
                          f"{mod_name!r}")
            continue
        scale_key = f"{lay}.{layout.scale_key}" if layout.scale_key else None
        if scale_key is None or scale_key not in info:
            if layout.scale_key is not None and fmt != "comfyui":
                errors.append(f"{k} is float8_e4m3fn but {scale_key!r} (its scale) is missing")
                continue
            p["scale_key"] = None  # fp8-cast, or ComfyUI's own reading of a missing scale_weight: scale 1
        else:
            p["scale_key"] = scale_key
            shape = info[scale_key][1]
            block = None
            if len(shape) == 2 and N is not None and shape != (N, 1) and int(torch.Size(shape).numel()) != 1:
                block = _infer_block(N, K, shape, block_size or cfg_block)
                if block is None:
                    errors.append(f"{scale_key}: shape {list(shape)} is neither per tensor, per row [{N}, 1] nor "
                                  f"per b x b block of the [{N}, {K}] weight for any block size"
                                  + (f" (block size {block_size or cfg_block} given)" if block_size or cfg_block
                                     else "; pass block_size="))
                    continue
            p["block"] = block
            if block is not None and not p["fp8"]:
                errors.append(f"{scale_key}: block scales on {type(mod).__name__} {mod_name!r}, which is not a linear "
                              f"or conv layer (only per-tensor or per-row scales can be dequantized into it)")
                continue
            if info[scale_key][0] not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
                errors.append(f"{scale_key}: dtype {info[scale_key][0]} (only fp32/bf16/fp16 scales are read)")
                continue
            try:
                check_scale(torch.empty(shape, device="meta"), N, K, block or DEFAULT_BLOCK, name=scale_key)
            except (TypeError, ValueError) as e:
                errors.append(str(e))
                continue
            plan_scale[scale_key] = (mod_name, N, K, block or DEFAULT_BLOCK, p["fp8"])
            consumed[scale_key] = "scale"
        for extra in (layout.act_scale_key, "comfy_quant", "weight_zero_point", "input_zero_point"):
            ek = f"{lay}.{extra}" if extra else None
            if ek and ek in info:
                consumed[ek] = "extra"
                p.setdefault("extras", []).append(ek)
    for k in ckpt_keys:  # scales of weights that are not fp8 (transformers writes some): the weight is dense
        if k not in consumed and layout.scale_key and k.endswith("." + layout.scale_key):
            w = f"{_layer(k)}.weight"
            if w in info and info[w][0] != E4M3:
                consumed[k] = "ignored"
                report.kept[k] = "scales of weights that are not fp8 (ignored, as the writer's own loader does)"
    if errors:
        raise CheckpointFormatError(f"{source.name} ({fmt}): " + "; ".join(errors[:8])
                                    + (f"; and {len(errors) - 8} more" if len(errors) > 8 else ""))

    # ---- what goes where ------------------------------------------------------------------------------------
    tied = _tied_groups(model)
    covered = set()
    plain: dict[str, str] = {}  # ckpt key -> model name, for tensors loaded as they are (cast)
    unexpected = []
    for k in ckpt_keys:
        if k in consumed or k in layer_of:
            continue
        m = names[k]
        if m is None:
            report.kept[k] = "skipped by key_map"
            continue
        lay_name = m.rpartition(".")[0]
        if lay_name in fp8_layers and fp8_layers[lay_name]["fp8"] and m.endswith(".bias"):
            plain[k] = m
            continue
        if m in model_t:
            if tuple(model_t[m].shape) != info[k][1]:
                errors.append(f"{k}: shape {list(info[k][1])} in the checkpoint, {list(model_t[m].shape)} in the "
                              f"model's {m!r}")
            plain[k] = m
        elif k.endswith("rotary_emb.inv_freq"):
            report.kept[k] = "rotary inv_freq (computed by the model)"
        else:
            unexpected.append(k)
    if errors:
        raise CheckpointFormatError(f"{source.name} ({fmt}): " + "; ".join(errors[:8]))
    by_module: dict[str, list[str]] = {}
    for n in model_t:
        by_module.setdefault(n.rpartition(".")[0], []).append(n)
    for mod_name, p in fp8_layers.items():  # the layer's own tensors (weight, scales) but its bias: that one is loaded
        covered |= {n for n in by_module.get(mod_name, []) if not n.endswith(".bias")}
    for m in plain.values():
        covered |= set(tied.get(m, [m]))
    missing = sorted(n for n in model_t if n not in covered)
    report.missing, report.unexpected = missing, unexpected
    if strict and (missing or unexpected):
        msg = []
        if missing:
            msg.append(f"{len(missing)} model tensors are not in the checkpoint: {', '.join(missing[:6])}"
                       + (" ..." if len(missing) > 6 else ""))
        if unexpected:
            msg.append(f"{len(unexpected)} checkpoint tensors fit nothing in the model: {', '.join(unexpected[:6])}"
                       + (" ..." if len(unexpected) > 6 else ""))
        hint = f" (key prefix {report.prefix!r} was applied)" if report.prefix else ""
        raise CheckpointFormatError(f"{source.name} ({fmt}) does not fit the model{hint}: " + "; ".join(msg)
                                    + ". Pass key_map= to rename keys, or strict=False to load what fits")

    # ---- build the FP8Linear / FP8ConvNd layers (on meta; filled below) -------------------------------------
    for mod_name, p in fp8_layers.items():
        if not p["fp8"]:
            continue
        mod = p["module"]
        bias = getattr(mod, "bias", None)
        bias_dtype = bias.dtype if bias is not None and bias.dtype not in (E4M3, E5M2) else model_dtype
        orig = getattr(mod, "orig_dtype", None) if isinstance(mod, (FP8Linear, FP8ConvNd)) else mod.weight.dtype
        if orig is None or orig in (E4M3, E5M2) or dtype is not None:
            orig = model_dtype
        if p["conv"]:
            cls = type(mod) if isinstance(mod, FP8ConvNd) else fp8_conv_class(mod)
            new = cls(mod.in_channels, mod.out_channels, mod.kernel_size, mod.stride, mod.padding, mod.dilation,
                      mod.groups, bias is not None, mod.padding_mode, device="meta", dtype=orig,
                      block_size=p.get("block") or None, backend=backend)
            n_out = mod.out_channels
        else:
            new = FP8Linear(mod.in_features, mod.out_features, bias=bias is not None, device="meta", dtype=orig,
                            block_size=p.get("block") or None, backend=backend, act_quant=act_quant)
            n_out = mod.out_features
        if bias is not None:
            new.bias = nn.Parameter(torch.empty(n_out, dtype=bias_dtype, device="meta"), requires_grad=False)
        new._dorafp8_source = {"format": fmt, "extras": {}}
        _swap_module(model, mod_name, new)
        p["module"] = new

    # ---- read, one tensor at a time --------------------------------------------------------------------------
    dequant_scales = {}
    need_scale_first = [p["scale_key"] for p in fp8_layers.values() if not p["fp8"] and p.get("scale_key")]
    for k, t in source.read(need_scale_first, device):
        dequant_scales[k] = t.float()
        report.bytes_read += t.numel() * t.element_size()
    src_dtypes: dict[str, torch.dtype] = {}
    want = list(layer_of) + [k for k in plan_scale if k not in dequant_scales] + list(plain) + \
        [e for p in fp8_layers.values() for e in p.get("extras", [])]
    shard_of = {k: info[k][2] for k in want}
    n_shards = len(source.shards)
    current, t_shard, n_in_shard, b_in_shard = None, time.time(), 0, 0

    def shard_done(i):
        if n_shards > 1:
            msg = (f"dorafp8: shard {i + 1}/{n_shards} ({os.path.basename(source.shards[i])}): {n_in_shard} tensors, "
                   f"{b_in_shard / 2**20:.1f} MiB, {time.time() - t_shard:.1f} s")
            logger.info(msg)
            if verbose:
                print(msg, flush=True)

    last_note, n_done = time.time(), 0
    for k, t in source.read(want, device):
        if current is not None and shard_of[k] != current:
            shard_done(current)
            t_shard, n_in_shard, b_in_shard = time.time(), 0, 0
        current = shard_of[k]
        nbytes = t.numel() * t.element_size()
        report.bytes_read += nbytes
        n_in_shard += 1
        n_done += 1
        b_in_shard += nbytes
        if time.time() - last_note > _PROGRESS_EVERY_S:  # a long shard (single-file checkpoints): a line now and then
            last_note = time.time()
            msg = (f"dorafp8: ... {n_done}/{len(want)} tensors, {report.bytes_read / 2**30:.2f} GiB read, "
                   f"{last_note - t0:.0f} s")
            logger.info(msg)
            if verbose:
                print(msg, flush=True)
        if k in layer_of:
            mod_name = layer_of[k]
            p = fp8_layers[mod_name]
            if p["fp8"]:
                _set_tensor(model, f"{mod_name}.weight", t.contiguous(), param=True)
                if p["scale_key"] is None:
                    _set_tensor(model, f"{mod_name}.scale", torch.ones((), device=t.device), param=False)
                    report.fp8_layers[mod_name] = "scale 1"
            else:  # an fp8 tensor in a module that is not linear or conv (embedding, Conv1D): dequantized
                sk = p.get("scale_key")
                s = dequant_scales[sk] if sk else torch.ones((), device=t.device)
                w = t.float() * (s if s.numel() == 1 else s.reshape(-1, *([1] * (t.dim() - 1))))
                target = model_t[names[k]]
                tdt = model_dtype if (dtype is not None or target.dtype in (E4M3, E5M2)) else target.dtype
                _set_tensor(model, names[k], w.to(tdt), requires_grad=True)
                report.dequantized.append(names[k])
                if sk:
                    plan_scale.pop(sk, None)
        elif k in plan_scale:
            mod_name, N, K, block, keeps_fp8 = plan_scale[k]
            if not keeps_fp8:
                continue
            mod = model.get_submodule(mod_name)
            sc = check_scale(t.float(), N, K, block, name=k)
            _set_tensor(model, f"{mod_name}.scale", sc, param=False)
            mod._dorafp8_source.update(scale_dtype=t.dtype, scale_shape=tuple(t.shape))
            g = scale_kind(sc)
            report.fp8_layers[mod_name] = f"per-{block}x{block}-block" if g == "block" else _GRAN_NAMES[g]
        elif k in plain:
            m = plain[k]
            target = model_t.get(m)
            if target is None:  # the bias of a layer swapped for an FP8Linear
                target = model.get_submodule(m.rpartition(".")[0]).bias
            if not t.is_floating_point():
                tdt = t.dtype
            elif dtype is not None or target.dtype in (E4M3, E5M2) or not target.is_floating_point():
                tdt = model_dtype
            else:
                tdt = target.dtype
            if t.dtype in (E4M3, E5M2):
                t = t.float()
                report.dequantized.append(m)
            value = t.to(tdt)
            if isinstance(target, nn.Parameter) or m.rpartition(".")[0] in fp8_layers:
                lin = m.rpartition(".")[0] in fp8_layers and fp8_layers[m.rpartition(".")[0]]["fp8"]
                value = nn.Parameter(value, requires_grad=(not lin) and target.requires_grad
                                     and value.is_floating_point())
            for alias in tied.get(m, [m]):
                _set_tensor(model, alias, value, param=isinstance(value, nn.Parameter))
            src_dtypes[m] = t.dtype
            report.loaded.append(m)
        else:  # extras of an fp8 layer: static activation scales, comfy_quant, zero points
            lay = _layer(k)
            mod_name = layer_of.get(f"{lay}.weight")
            if k.endswith("_zero_point") and bool((t.float() != 0).any()):
                raise CheckpointFormatError(f"{k}: non-zero zero point (asymmetric quantization) is not supported")
            if k.endswith(".comfy_quant"):
                conf = json.loads(bytes(t.to(torch.uint8).tolist()).decode("utf-8"))
                if conf.get("format") != "float8_e4m3fn":
                    raise CheckpointFormatError(f"{k}: ComfyUI quantization format {conf.get('format')!r}; dorafp8 "
                                                f"loads float8_e4m3fn only")
            mod = model.get_submodule(mod_name) if mod_name else None
            if isinstance(mod, (FP8Linear, FP8ConvNd)):
                mod._dorafp8_source["extras"][k.rpartition(".")[2]] = t
            report.kept[k] = {"comfy_quant": "ComfyUI layer configs (written back on save)",
                              "weight_zero_point": "zero points (all zero)", "input_zero_point": "zero points (all "
                              "zero)"}.get(k.rpartition(".")[2], "static activation scales (unused by dorafp8; "
                                                                  "written back on save)")
    if current is not None:
        shard_done(current)
    for k in marker_keys:
        report.kept[k] = "the scaled_fp8 marker"
    _materialize_leftovers(model, device, report, strict)
    source_info = {"format": fmt, "strip": strip, "add": add, "block": cfg_block, "metadata": source.metadata,
                   "dtypes": src_dtypes,
                   "markers": {k: info[k] for k in marker_keys}, "config": source.config}
    if marker_keys:
        source_info["marker_tensors"] = dict(source.read(marker_keys, "cpu"))
    report.seconds = time.time() - t0
    try:
        model.dorafp8_checkpoint = report
        model._dorafp8_source = source_info
    except (AttributeError, TypeError):
        pass
    logger.info(str(report))
    if verbose:
        print(str(report), flush=True)
    return report


def _is_conv1d(mod) -> bool:
    return type(mod).__name__ == "Conv1D" and not isinstance(mod, nn.Linear)


def _materialize_leftovers(model: nn.Module, device, report: LoadReport, strict: bool) -> None:
    """Tensors still on the meta device after loading. A module all of whose own tensors are left (a rotary
    embedding's inv_freq, a layer missing from the checkpoint under strict=False) is materialized and initialized by
    the model's own initializer (transformers' _init_weights) when there is one; otherwise it is an error under
    strict (zeros and a report line without)."""
    left: dict[str, tuple] = {}
    for mname, mod in model.named_modules():
        own = [(n, t) for n, t in list(mod._parameters.items()) + list(mod._buffers.items()) if t is not None]
        meta = [n for n, t in own if t.is_meta]
        if meta:
            left[mname] = (mod, meta, len(meta) == len(own))
    if not left:
        return
    inits = {n: m for n, m in model.named_modules()
             if callable(getattr(m, "_init_weights", None)) and hasattr(m, "config")}
    stuck = []
    for mname, (mod, meta, whole) in left.items():
        for n in meta:
            t = mod._parameters.get(n)
            if t is not None:
                mod._parameters[n] = nn.Parameter(torch.zeros_like(t, device=device), requires_grad=t.requires_grad)
            else:
                mod._buffers[n] = torch.zeros_like(mod._buffers[n], device=device)
            full = f"{mname}.{n}" if mname else n
            if n in mod._non_persistent_buffers_set:
                report.initialized.append(full)
            elif full not in report.missing:
                report.missing.append(full)
        owner = max((o for o in inits if o == "" or mname == o or mname.startswith(o + ".")), key=len, default=None)
        if not whole or owner is None:
            stuck += [f"{mname}.{n}" if mname else n for n in meta]
            continue
        try:
            with torch.no_grad():
                inits[owner]._init_weights(mod)
        except Exception as e:  # noqa: BLE001 - a model's own initializer failed: say where
            raise RuntimeError(f"computing {mname!r} (not in the checkpoint) with {type(inits[owner]).__name__}."
                               f"_init_weights failed: {e}; build the model with accelerate.init_empty_weights() "
                               f"(which keeps buffers real) instead") from e
    if stuck and strict:
        raise CheckpointFormatError(f"tensors left on the meta device that the checkpoint does not have and nothing "
                                    f"can compute: {', '.join(stuck[:6])}; build the model with "
                                    f"accelerate.init_empty_weights() (which keeps buffers real), or pass strict=False "
                                    f"(they become zeros)")


# ----------------------------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class ExportReport:
    """What save_fp8_checkpoint / export_merged wrote. Per fp8 layer: what was done and the relative error of the
    written weight against the fp32 weight the model computes with (for a merged layer: m / ||W0 + s B A|| *
    (W0 + s B A), evaluated in fp32 from the unmerged adapters)."""
    format: str
    path: str
    files: list = field(default_factory=list)
    layers: dict = field(default_factory=dict)   # name -> {"action", "granularity", "rel_error", "adapters"}
    tensors: int = 0
    bytes: int = 0
    notes: list = field(default_factory=list)
    seconds: float = 0.0

    def errors(self, action: Optional[str] = None) -> dict:
        return {n: d["rel_error"] for n, d in self.layers.items() if action is None or d["action"] == action}

    @property
    def worst(self) -> tuple:
        e = self.errors()
        return max(e.items(), key=lambda kv: kv[1]) if e else (None, 0.0)

    @property
    def mean_error(self) -> float:
        e = list(self.errors().values())
        return sum(e) / len(e) if e else 0.0

    def __str__(self) -> str:
        acts = Counter(d["action"] for d in self.layers.values())
        grans = Counter(d["granularity"] for d in self.layers.values())
        lines = [f"dorafp8: wrote {self.path} as {self.format}: {len(self.files)} file(s), {self.tensors} tensors, "
                 f"{self.bytes / 2**20:.1f} MiB in {self.seconds:.1f} s",
                 f"  fp8 layers: {len(self.layers)} ({', '.join(f'{n} {a}' for a, n in acts.most_common())}; "
                 f"{', '.join(f'{n} {g}' for g, n in grans.most_common())})"]
        merged = self.errors("merged")
        if merged:
            w = max(merged.items(), key=lambda kv: kv[1])
            lines.append(f"  merge error (relative, vs the unmerged fp32 evaluation): worst {w[1]:.3e} ({w[0]}), "
                         f"mean {sum(merged.values()) / len(merged):.3e} over {len(merged)} merged layers")
        req = self.errors("requantized")
        if req:
            w = max(req.items(), key=lambda kv: kv[1])
            lines.append(f"  re-quantized without merging (layout needs another scale): {len(req)}, worst error "
                         f"{w[1]:.3e} ({w[0]})")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _parse_size(size) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?I?B)\s*", str(size).upper())
    if not m:
        raise ValueError(f"max_shard_size must be an int (bytes) or like '5GB', got {size!r}")
    unit = m.group(2)
    mult = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
            "TIB": 2**40}[unit]
    return int(float(m.group(1)) * mult)


class _TensorSink:
    """Where the writer puts its tensors: in a dict, in order (the state dict handed to transformers' save_pretrained,
    which shards and writes it itself). _ShardWriter writes them to safetensors files instead."""

    def __init__(self):
        self.cur: dict = {}
        self.keys: set = set()
        self.total = 0
        self.count = 0

    def add(self, key: str, t: torch.Tensor) -> None:
        if key in self.keys:
            raise ValueError(f"two tensors would be written under {key!r}")
        self.keys.add(key)
        self.cur[key] = t.detach()
        self.total += t.numel() * t.element_size()
        self.count += 1


class _ShardWriter(_TensorSink):
    def __init__(self, path: str, stem: str, max_bytes: int, metadata: dict):
        super().__init__()
        self.single = path.endswith(".safetensors")
        self.dir = os.path.dirname(path) if self.single else path
        self.made_dir = bool(self.dir) and not os.path.isdir(self.dir)
        if self.dir:
            os.makedirs(self.dir, exist_ok=True)
        self.path, self.stem, self.max, self.metadata = path, stem, max_bytes, metadata
        self.cur_bytes = 0
        self.parts: list[tuple[str, list[str]]] = []

    def add(self, key: str, t: torch.Tensor) -> None:
        t = t.detach().to("cpu").contiguous()
        n = t.numel() * t.element_size()
        if self.cur and not self.single and self.cur_bytes + n > self.max:
            self._flush()
        super().add(key, t)
        self.cur_bytes += n

    def _flush(self) -> None:
        from safetensors.torch import save_file

        tmp = os.path.join(self.dir, f".{self.stem}.part{len(self.parts)}.safetensors")
        save_file(self.cur, tmp, metadata=self.metadata)
        self.parts.append((tmp, list(self.cur)))
        self.cur, self.cur_bytes = {}, 0

    def discard(self) -> None:
        """A write that failed half-way leaves nothing behind: its temporary shards, and the directory it made."""
        for tmp, _ in self.parts:
            if os.path.exists(tmp):
                os.remove(tmp)
        if self.made_dir and not os.listdir(self.dir):
            os.rmdir(self.dir)

    def close(self) -> list[str]:
        if self.cur or not self.parts:
            self._flush()
        files = []
        if self.single:
            os.replace(self.parts[0][0], self.path)
            return [self.path]
        n = len(self.parts)
        weight_map = {}
        for i, (tmp, keys) in enumerate(self.parts):
            name = f"{self.stem}.safetensors" if n == 1 else f"{self.stem}-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(tmp, os.path.join(self.dir, name))
            files.append(os.path.join(self.dir, name))
            weight_map.update({k: name for k in keys})
        if n > 1:
            with open(os.path.join(self.dir, f"{self.stem}.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))},
                          f, indent=2)
        return files


def _tuner_cls():
    """PEFT's BaseTunerLayer if peft is loaded (a model cannot hold PEFT layers otherwise)."""
    return getattr(sys.modules.get("peft.tuners.tuners_utils"), "BaseTunerLayer", None)


def _base_model(model: nn.Module) -> nn.Module:
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def _source_of(model: nn.Module) -> dict:
    for m in (model, _base_model(model)):
        src = getattr(m, "_dorafp8_source", None)
        if src:
            return src
    return {}


def _walk(mod: nn.Module, prefix: str, tuner_cls):
    """(kind, name, object) in state_dict order: ("fp8", layer name, FP8Linear / FP8ConvNd or the PEFT layer on
    one), ("tuner", name, other PEFT layer), ("tensor", key, tensor)."""
    fp8_types = (FP8Linear, FP8ConvNd)
    if isinstance(mod, fp8_types) or (tuner_cls is not None and isinstance(mod, tuner_cls)
                                      and isinstance(_get_base(mod), fp8_types)):
        yield "fp8", prefix[:-1], mod
        return
    if tuner_cls is not None and isinstance(mod, tuner_cls):
        yield "tuner", prefix[:-1], mod
        return
    if hasattr(mod, "modules_to_save") and hasattr(mod, "original_module"):  # PEFT's ModulesToSaveWrapper
        active = getattr(mod, "active_adapter", None)
        active = active[0] if isinstance(active, (list, tuple)) and active else active
        inner = mod.modules_to_save[active] if (active in mod.modules_to_save and not getattr(
            mod, "disable_adapters", False)) else mod.original_module
        yield from _walk(inner, prefix, tuner_cls)
        return
    if type(mod) is nn.Linear:
        yield "linear", prefix[:-1], mod
    for n, p in mod._parameters.items():
        if p is not None:
            yield "tensor", prefix + n, p
    for n, b in mod._buffers.items():
        if b is not None and n not in mod._non_persistent_buffers_set:
            yield "tensor", prefix + n, b
    for n, child in mod._modules.items():
        if child is not None:
            yield from _walk(child, f"{prefix}{n}.", tuner_cls)


def _get_base(layer):
    get = getattr(layer, "get_base_layer", None)
    return get() if callable(get) else layer


def _layout_scale(fmt: str, scale: torch.Tensor, N: int, meta: dict) -> torch.Tensor:
    """A normalized fp32 scale in the shape and dtype the layout stores (the loaded file's, on a round trip)."""
    g = scale_kind(scale)
    if fmt == "compressed-tensors":
        shape = {"tensor": (1,), "row": (N, 1)}.get(g, tuple(scale.shape))
    elif fmt in ("comfyui", "comfyui-quant"):
        shape = ()
    else:
        shape = tuple(scale.shape)
    src_shape = meta.get("scale_shape")
    if src_shape is not None and meta.get("format") == fmt and torch.Size(src_shape).numel() == scale.numel():
        shape = tuple(src_shape)
    out = scale.float().reshape(shape)
    dt = meta.get("scale_dtype") if meta.get("format") == fmt else None
    if dt is not None and dt != torch.float32 and torch.equal(out.to(dt).float(), out):
        out = out.to(dt)
    return out


# The formats that a directory with a transformers config.json may hold: the ones transformers' from_pretrained reads
# correctly on its own (compressed-tensors also needs the compressed-tensors package, and says so). In the others the
# fp8 weights sit under `<layer>.weight` with their scale under a key transformers does not know, and from_pretrained
# loads the raw e4m3 values into the model without a word (the scale keys are only listed as UNEXPECTED).
TRANSFORMERS_FORMATS = ("compressed-tensors", "fine-grained", "fp8-cast") + tuple(DENSE_FORMATS)


@dataclass
class _Target:
    """What a write produces, resolved from the model and the arguments before anything is written."""
    fmt: str
    layout: Optional[Layout]               # None for the dense formats
    dense_dtype: Optional[torch.dtype]
    granularity: Optional[str]
    bsz: int                               # the one block size of the file
    strip: str
    add: str
    src: dict                              # what the model was loaded from (_source_of)
    same: bool                             # writing the layout the model was loaded from
    base: nn.Module
    stem: str                              # "model" or diffusers' "diffusion_pytorch_model"
    config_kind: Optional[str]             # the config.json a directory gets: "transformers", "diffusers" or None
    metadata: dict                         # safetensors metadata

    def key_of(self, name: str) -> str:
        return self.strip + (name[len(self.add):] if self.add and name.startswith(self.add) else name)


def _resolve(model: nn.Module, fmt: Optional[str], granularity, block_size, prefix, metadata=None) -> _Target:
    src = _source_of(model)
    if fmt is None:
        fmt = src.get("format") or "compressed-tensors"
    fmt = _canonical_format(fmt)
    dense_dtype = DENSE_FORMATS.get(fmt)
    layout = LAYOUTS.get(fmt)
    if granularity is not None:
        if dense_dtype is not None:
            raise ValueError(f"granularity= applies to fp8 formats, not {fmt}")
        if granularity not in ("tensor", "row", "block"):
            raise ValueError(f"granularity must be 'tensor', 'row' or 'block', got {granularity!r}")
        if granularity not in layout.write_granularities:
            raise ValueError(f"{fmt} stores {', '.join(_GRAN_NAMES[g] for g in layout.write_granularities)} scales, "
                             f"not {_GRAN_NAMES[granularity]} ones")
    same = src.get("format") == fmt
    base = _base_model(model)
    if block_size is None:  # one block size for the file (configs have one): the model's, else the source's, else 128
        sizes = Counter(m.block_size for m in base.modules() if isinstance(m, FP8Linear) and m.scale.dim() == 2)
        block_size = sizes.most_common(1)[0][0] if sizes else (src.get("block") if same else None)
    strip, add = (src.get("strip", ""), src.get("add", "")) if prefix is None else (prefix, "")
    is_diffusers = any(c.__name__ == "ModelMixin" and c.__module__.startswith("diffusers")
                       for c in type(base).__mro__)
    cfg_obj = getattr(base, "config", None)
    if callable(getattr(base, "save_config", None)) and not hasattr(cfg_obj, "to_dict"):
        config_kind = "diffusers"
    elif hasattr(cfg_obj, "to_dict") or src.get("config"):
        config_kind = "transformers"
    else:
        config_kind = None
    meta_out = dict(src.get("metadata") or {}) if same else {"format": "pt"}
    meta_out.update(metadata or {})
    return _Target(fmt, layout, dense_dtype, granularity, block_size or DEFAULT_BLOCK, strip, add, src, same, base,
                   "diffusion_pytorch_model" if is_diffusers else "model", config_kind, meta_out)


def fp8_modules(base: nn.Module) -> dict[str, nn.Module]:
    """name -> FP8Linear / FP8ConvNd, inside PEFT's layers too (named as in the state dict, base_layer dropped)."""
    return {n.replace(".base_layer", ""): m for n, m in base.named_modules() if isinstance(m, (FP8Linear, FP8ConvNd))}


def _writes_block(t: _Target, m: nn.Module) -> bool:
    """Whether the layer is written with block scales (the writer's choice below for a layer it does not merge;
    a merged one takes granularity, else the layout's first kind: conservative where the two differ)."""
    return t.fmt == "fine-grained" or t.granularity == "block" or (t.granularity is None and
                                                                   scale_kind(m.scale) == "block")


def _transformers_problem(t: _Target, why: str) -> Optional[str]:
    """Why transformers' from_pretrained would not read this fp8 checkpoint correctly on its own (None if it would).
    `why` says where the fix would go. Checked before anything is written."""
    layers = fp8_modules(t.base)
    convs = [n for n, m in layers.items() if isinstance(m, FP8ConvNd)]
    if convs and t.fmt != "fp8-cast":  # fp8-cast has no scales: a plain cast reads it right
        return (f"{len(convs)} fp8 conv layers (e.g. {convs[0]!r}): transformers reads fp8 convolutions in no layout "
                f"(compressed-tensors' loader leaves their scales out and loads the raw e4m3 values). {why}, or a "
                f"dense format (bf16, fp16, fp32), or keep the convolutions unquantized (quantize_model without "
                f"include_conv)")
    b = t.bsz
    ragged = [(n, m.weight.shape[0], m.weight[0].numel()) for n, m in layers.items()
              if _writes_block(t, m) and (m.weight.shape[0] % b or m.weight[0].numel() % b)]
    if ragged and t.fmt == "compressed-tensors":
        n, N, K = ragged[0]
        return (f"{len(ragged)} layers have a dimension that is not a multiple of the block size {b} (e.g. {n!r}, "
                f"[{N}, {K}]): compressed-tensors (and vLLM) read whole blocks only, and transformers fails to load "
                f"them. {why}, or write format='fine-grained' (partial blocks the DeepSeek-V3 way) or granularity='row'")
    wrong = [(n, N, K) for n, N, K in ragged if _cpu_fine_grained_read(N, K, b) == "wrong"]
    if wrong and t.fmt == "fine-grained":
        n, N, K = wrong[0]
        return (f"{len(wrong)} layers cover partial {b} x {b} blocks whose count divides the weight (e.g. {n!r}, "
                f"[{N}, {K}]): transformers' dequantizing loader (used without a GPU) takes the block size from "
                f"that count and misreads them. {why}, or granularity='row' with format='compressed-tensors'")
    return None


def _cpu_fine_grained_read(N: int, K: int, b: int) -> str:
    """How transformers' dequantize-while-loading path (fine-grained FP8 without a GPU, transformers 5.23) reads an
    [N, K] weight with b x b block scales, partial blocks counted (ceil): it takes the block from the scale grid,
    N / ceil(N / b). "ok" where that is b or the grid is one block; "raises" where the grid does not divide the
    weight; "wrong" where it divides it into other blocks (N = 96, b = 64: grid 2, blocks of 48 rows, silently)."""
    dims = [(n, -(-n // b)) for n in (N, K)]
    if any(n % g for n, g in dims):
        return "raises"
    return "ok" if all(g == 1 or n // g == b for n, g in dims) else "wrong"


def _check_destination(t: _Target, path: str, defaulted: bool) -> None:
    """A directory that gets a transformers config.json looks like a model transformers loads: refuse to write one
    transformers would load wrong (before anything is written)."""
    if path.endswith(".safetensors") or t.config_kind != "transformers" or t.layout is None:
        return
    file_hint = ("Write it to a single file instead (a path ending in .safetensors, no config.json), or to "
                 "format='compressed-tensors' / 'fine-grained', which transformers and vLLM read (and "
                 "load_fp8_checkpoint too)")
    if t.fmt not in TRANSFORMERS_FORMATS:
        how = f"format=None writes the layout the model was loaded from, {t.fmt}" if defaulted else f"format={t.fmt!r}"
        raise ValueError(f"{path}: {how}, into a directory with a transformers config.json: transformers' "
                         f"from_pretrained would load the raw e4m3 values without their scales ('<layer>."
                         f"{t.layout.scale_key}'), silently wrong. {file_hint}")
    problem = _transformers_problem(t, "Write a single .safetensors file instead")
    if problem:
        raise ValueError(f"{path}: {t.fmt} into a directory with a transformers config.json: {problem}")


@dataclass
class _Written:
    """What _emit wrote that the config needs."""
    dense_linears: list = field(default_factory=list)
    conv_layers: list = field(default_factory=list)
    unmerged: list = field(default_factory=list)
    groups: dict = field(default_factory=dict)     # (granularity, activations) -> layer names
    ragged: list = field(default_factory=list)


def _act_mode(fp8: nn.Module, layout: Layout, extras: dict) -> str:
    """How the layer's activations are quantized, for compressed-tensors' input_activations: "static" where the
    checkpoint it came from had a static scale (kept for the deployment it was made for), "dynamic" for W8A8 layers
    (act_quant="rowwise", per token), "none" for W8A16 (the default: weight-only)."""
    if layout.act_scale_key and layout.act_scale_key in extras:
        return "static"
    return "dynamic" if getattr(fp8, "act_quant", None) else "none"


def _emit(t: _Target, sink: _TensorSink, report: "ExportReport", *, merge: bool, adapter_names) -> _Written:
    """Walks the model and puts every tensor of the checkpoint into `sink`, fp8 layers in t's layout (merged with
    their adapters if `merge`); fills report.layers."""
    fmt, layout, dense_dtype, granularity, bsz = t.fmt, t.layout, t.dense_dtype, t.granularity, t.bsz
    key_of, src = t.key_of, t.src
    tuner_cls = _tuner_cls()
    written_ids: dict[int, str] = {}
    src_dtypes = src.get("dtypes", {}) if t.same else {}
    comfy_meta_layers = "_quantization_metadata" in t.metadata
    out = _Written()

    if fmt == "comfyui":
        markers = src.get("marker_tensors") if t.same else None
        for k, v in (markers or {f"{t.strip}scaled_fp8": torch.tensor([], dtype=E4M3)}).items():
            sink.add(k, v)

    def put_tensor(key, v):
        if id(v) in written_ids:
            report.notes.append(f"{key} is the same tensor as {written_ids[id(v)]} (tied): written once")
            return
        written_ids[id(v)] = key
        v = v.detach()
        if dense_dtype is not None and v.is_floating_point():
            v = v.float().to(dense_dtype) if v.dtype in (E4M3, E5M2) else v.to(dense_dtype)
        else:
            sd = src_dtypes.get(key)
            if sd is not None and sd != v.dtype and v.is_floating_point() and torch.equal(v.to(sd).to(v.dtype), v):
                v = v.to(sd)
        sink.add(key_of(key), v)

    for kind, name, obj in _walk(t.base, "", tuner_cls):
        if kind == "linear":
            out.dense_linears.append(name)
            continue
        if kind == "tensor":
            put_tensor(name, obj)
            continue
        if kind == "tuner":
            if merge:
                import copy

                layer = copy.deepcopy(obj)
                layer.merge(adapter_names=adapter_names)
                inner = layer.get_base_layer()
            else:
                inner = obj.get_base_layer()
                out.unmerged.append(name)
            for k2, n2, o2 in _walk(inner, name + ".", tuner_cls):
                if k2 == "linear":
                    out.dense_linears.append(name)
                elif k2 == "tensor":
                    put_tensor(n2, o2)
            continue
        # an fp8 layer
        tuner = obj if (tuner_cls is not None and isinstance(obj, tuner_cls)) else None
        fp8 = _get_base(obj)
        w8, scale, bs = fp8.fp8_weight(), fp8.scale, fp8.block_size
        w_shape = w8.shape  # a conv weight [C_out, C_in/groups, *kernel] is handled as its 2-D view, written as is
        w8 = w8.reshape(w_shape[0], -1)
        N, K = w8.shape
        names_ = []
        if tuner is not None:
            if merge:
                names_ = list(adapter_names) if adapter_names is not None else \
                    [a for a in tuner.active_adapters if a not in tuner.merged_adapters]
                if names_ and isinstance(fp8, FP8ConvNd):
                    raise NotImplementedError(
                        f"{name}: merging a DoRA adapter into an fp8 conv layer is not implemented (dorafp8 merges "
                        f"into FP8Linear layers only). Write the base with save_fp8_checkpoint and the adapter with "
                        f"save_pretrained, or merge with plain PEFT on the original-precision model")
            elif any(a not in tuner.merged_adapters for a in tuner.active_adapters):
                out.unmerged.append(name)
        terms = adapter_terms(tuner, names_) if names_ else []
        bias = fp8.bias.detach() if fp8.bias is not None else None
        for a in (term[4] for term in terms):
            if tuner.lora_bias.get(a) and tuner.lora_B[a].bias is not None:
                if bias is None:
                    raise RuntimeError(f"{name}: cannot merge lora_bias of adapter {a!r}: the base layer has no bias")
                bias = bias.float() + tuner.lora_B[a].bias.detach().float() * tuner.scaling[a]

        def rows(j0, j1, _w8=w8, _s=scale, _bs=bs, _t=terms):
            return merged_rows(_w8, _s, _bs, _t, j0, j1)
        cur = scale_kind(scale)
        entry = {"adapters": [term[4] for term in terms]}
        fmeta = getattr(fp8, "_dorafp8_source", {}) or {}
        if dense_dtype is not None:
            W, _, st = requantize(rows, N, K, "row", dense_dtype=dense_dtype)
            entry.update(action="merged" if terms else "dequantized", granularity=str(dense_dtype).replace(
                "torch.", ""), rel_error=st.rel_error)
            report.layers[name] = entry
            sink.add(key_of(f"{name}.weight"), W.reshape(w_shape))
            if bias is not None:
                sink.add(key_of(f"{name}.bias"), bias.to(dense_dtype))
            del W
            continue
        allowed = layout.write_granularities
        keep_ok = cur in allowed and granularity in (None, cur) and not (cur == "block" and bs != bsz)
        if terms:
            g = granularity or allowed[0]
            w8n, sn, st = requantize(rows, N, K, g, block_size=bsz)
            entry.update(action="merged", rel_error=st.rel_error)
        elif keep_ok:
            w8n, sn = w8, scale
            g = cur
            entry.update(action="kept", rel_error=0.0)
        elif cur == "tensor" and (granularity or allowed[0]) in ("row", "block"):
            g = granularity or allowed[0]
            sn = scale.reshape(1).expand(N) if g == "row" else scale.reshape(1, 1).expand(-(-N // bsz), -(-K // bsz))
            w8n = w8
            entry.update(action="kept", rel_error=0.0)
        else:
            g = granularity or (allowed[0] if cur not in allowed else cur)
            w8n, sn, st = requantize(lambda j0, j1: w0_rows(w8, scale, bs, j0, j1), N, K, g, block_size=bsz)
            entry.update(action="requantized", rel_error=st.rel_error)
        if terms and st.nonfinite:
            raise ValueError(f"{name}: merging adapters {entry['adapters']} gives {st.nonfinite} non-finite values "
                             f"(the adapter seems to be broken); nothing usable can be written")
        entry["granularity"] = (f"per-{bsz}x{bsz}-block" if g == "block" else _GRAN_NAMES[g])
        if fmt == "fine-grained" and _cpu_fine_grained_read(N, K, bsz) != "ok":
            out.ragged.append(name)
        report.layers[name] = entry
        if isinstance(fp8, FP8ConvNd):
            out.conv_layers.append(name)
        sink.add(key_of(f"{name}.weight"), w8n.reshape(w_shape))
        if fmt == "fp8-cast":
            if not bool((sn == 1).all()):
                raise ValueError(f"{name}: the fp8-cast layout has no scale, but this layer's is not 1; write "
                                 f"another format (compressed-tensors keeps per-row scales)")
        else:
            sink.add(key_of(f"{name}.{layout.scale_key}"), _layout_scale(fmt, sn, N, fmeta))
        if bias is not None:
            bt = bias.to(fp8.bias.dtype) if fp8.bias is not None else bias
            sd = src_dtypes.get(f"{name}.bias")
            if sd is not None and sd != bt.dtype and torch.equal(bt.to(sd).to(bt.dtype), bt):
                bt = bt.to(sd)
            sink.add(key_of(f"{name}.bias"), bt)
        extras = dict(fmeta.get("extras", {})) if fmeta.get("format") == fmt else {}
        if fmt == "comfyui-quant" and not comfy_meta_layers and "comfy_quant" not in extras:
            extras["comfy_quant"] = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()),
                                                 dtype=torch.uint8)
        out.groups.setdefault((g, _act_mode(fp8, layout, extras)), []).append(name)
        for ek, ev in extras.items():
            sink.add(key_of(f"{name}.{ek}"), ev)
        del w8n, sn
    return out


def _write(model: nn.Module, path, fmt: Optional[str], *, merge: bool, adapter_names, granularity, block_size,
           max_shard_size, prefix, metadata, verbose) -> ExportReport:
    from ._deps import require

    require("safetensors", what="writing fp8 checkpoints")
    t0 = time.time()
    path = os.fspath(path)
    t = _resolve(model, fmt, granularity, block_size, prefix, metadata)
    _check_destination(t, path, defaulted=fmt is None)
    writer = _ShardWriter(path, t.stem, _parse_size(max_shard_size), t.metadata)
    report = ExportReport(t.fmt, path)
    try:
        out = _emit(t, writer, report, merge=merge, adapter_names=adapter_names)
    except BaseException:
        writer.discard()
        raise
    report.files = writer.close()
    report.tensors, report.bytes = writer.count, writer.total
    if out.ragged:
        report.notes.append(f"{len(out.ragged)} layers have a dimension that is not a multiple of the block size "
                            f"{t.bsz} (e.g. {out.ragged[0]}): their scales cover partial blocks (ceil), as "
                            f"DeepSeek-V3's do and as transformers' FP8Linear (GPU) reads them; transformers' "
                            f"dequantize-while-loading path (used without a GPU) takes the block size from the scale "
                            f"grid and refuses or misreads them (transformers 5.23)")
    if out.unmerged and not merge:
        report.notes.append(f"{len(out.unmerged)} layers have adapters that were not written (save them with "
                            f"save_pretrained, or use export_merged): e.g. {out.unmerged[0]}")
    if not path.endswith(".safetensors"):
        _write_config(t, path, report, out)
    report.seconds = time.time() - t0
    logger.info(str(report))
    if verbose:
        print(str(report), flush=True)
    return report


def _quantization_config(t: _Target, report: "ExportReport", out: _Written) -> Optional[dict]:
    """config.json's quantization_config for the fp8 layouts transformers reads (None for the others)."""
    old_q = (t.src.get("config") or {}).get("quantization_config") if t.same else None
    if old_q and all(d["action"] == "kept" for d in report.layers.values()):
        return old_q
    bsz, ignore = t.bsz, sorted(set(out.dense_linears))
    if t.fmt == "fine-grained":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [bsz, bsz],
                "modules_to_not_convert": ignore or None, "scale_fmt": "float"}
    if t.fmt != "compressed-tensors":
        return None
    strategies = {"tensor": "tensor", "row": "channel", "block": "block"}
    fp8_args = {"num_bits": 8, "type": "float", "symmetric": True}
    cg = {}
    for i, ((g, act), names) in enumerate(sorted(out.groups.items())):
        weights = {**fp8_args, "dynamic": False, "strategy": strategies[g], "group_size": None,
                   "block_structure": [bsz, bsz] if g == "block" else None}
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


# diffusers reads no fp8 layout with scales: a directory written for a diffusers model carries this in config.json, so
# that diffusers' from_pretrained refuses it ("Unknown quantization type, got dorafp8"; with dorafp8 imported, the
# error below) instead of loading the raw e4m3 values without their scales
DIFFUSERS_LOAD_HINT = ("build the model on the meta device (with accelerate.init_empty_weights(): model = "
                       "ModelClass.from_config(ModelClass.load_config(path))) and call dorafp8.load_fp8_checkpoint("
                       "model, path)")


def diffusers_guard(fmt: str) -> dict:
    return {"quant_method": "dorafp8", "layout": fmt,
            "note": f"fp8 weights in the {fmt} layout, written by dorafp8; diffusers' from_pretrained cannot read "
                    f"their scales: {DIFFUSERS_LOAD_HINT}"}


def _write_config(t: _Target, path: str, report: "ExportReport", out: _Written) -> None:
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
    cfg = cfg_obj.to_dict() if hasattr(cfg_obj, "to_dict") else dict(t.src["config"])
    cfg.pop("quantization_config", None)
    if t.dense_dtype is not None:
        cfg["torch_dtype"] = cfg["dtype"] = str(t.dense_dtype).replace("torch.", "")
    else:
        qc = _quantization_config(t, report, out)
        if qc is not None:
            cfg["quantization_config"] = qc
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True, default=str)


def _unmerged_adapter_layers(base: nn.Module) -> list[str]:
    tuner_cls = _tuner_cls()
    if tuner_cls is None:
        return []
    return [n for n, m in base.named_modules() if isinstance(m, tuner_cls) and not getattr(m, "disable_adapters", False)
            and any(a not in m.merged_adapters for a in m.active_adapters)]


def save_pretrained_state(model: nn.Module) -> tuple[dict, dict, "ExportReport"]:
    """(state dict, quantization_config, report) for transformers' save_pretrained of a model holding dorafp8 fp8
    layers (dorafp8/_save_hooks.py hands them to it): the fp8 layers in a layout transformers and vLLM read on their
    own, keeping every layer's bytes and scales. fine-grained if the model was loaded from it and every layer still
    fits it as is (per-tensor, or blocks of its size), else compressed-tensors (per-tensor, per-row and block scales,
    any mix). Raises ValueError naming the fix where no such layout can hold the model: unmerged PEFT adapters (they
    would be dropped), fp8 conv layers, blocks that do not divide a layer."""
    base = _base_model(model)
    unmerged = _unmerged_adapter_layers(base)
    if unmerged:
        raise ValueError(f"{type(base).__name__}.save_pretrained: {len(unmerged)} layers carry PEFT adapters that are "
                         f"not merged (e.g. {unmerged[0]!r}); the checkpoint would hold the base without them. Merge "
                         f"them first (model = peft_model.merge_and_unload()), write a merged checkpoint with "
                         f"dorafp8.export_merged(peft_model, path), or save the adapter alone with the PeftModel's "
                         f"save_pretrained")
    t = _resolve(model, "fine-grained", None, None, "")
    layers = fp8_modules(t.base).values()
    if not (t.same and all(isinstance(m, FP8Linear) and (scale_kind(m.scale) == "tensor" or (
            scale_kind(m.scale) == "block" and m.block_size == t.bsz)) for m in layers)
            and _transformers_problem(t, "") is None):
        t = _resolve(model, "compressed-tensors", None, None, "")
    problem = _transformers_problem(t, "Write it with dorafp8.save_fp8_checkpoint(model, 'path.safetensors')")
    if problem:
        raise ValueError(f"{type(base).__name__}.save_pretrained cannot write this fp8 model in a layout transformers "
                         f"reads: {problem}")
    sink = _TensorSink()
    report = ExportReport(t.fmt, "save_pretrained")
    out = _emit(t, sink, report, merge=False, adapter_names=None)
    report.tensors, report.bytes = sink.count, sink.total
    return sink.cur, _quantization_config(t, report, out), report


def save_fp8_checkpoint(model: nn.Module, path, format: Optional[str] = None, *, granularity: Optional[str] = None,
                        block_size: Optional[int] = None, max_shard_size="5GB", prefix: Optional[str] = None,
                        metadata: Optional[dict] = None, verbose: bool = True) -> ExportReport:
    """Writes the model's weights as they are, fp8 layers in `format` (default: the layout it was loaded from, else
    compressed-tensors). Adapters are not merged (see export_merged) nor written (PEFT's save_pretrained does that).

    Each fp8 layer keeps its bytes and scale when the layout can hold them (a model loaded with load_fp8_checkpoint
    and saved in the same format gives back the same tensors, in the same dtypes and shapes); a per-tensor scale is
    broadcast losslessly where the layout wants rows or blocks; anything else is re-quantized from the fp32 weight and
    reported. path: a directory (model.safetensors or shards + index, and config.json for a transformers model) or a
    .safetensors file. Returns an ExportReport."""
    return _write(model, path, format, merge=False, adapter_names=None, granularity=granularity,
                  block_size=block_size, max_shard_size=max_shard_size, prefix=prefix, metadata=metadata,
                  verbose=verbose)


def export_merged(model: nn.Module, path, format: Optional[str] = None, *, adapter_names=None,
                  granularity: Optional[str] = None, block_size: Optional[int] = None, max_shard_size="5GB",
                  prefix: Optional[str] = None, metadata: Optional[dict] = None, verbose: bool = True) -> ExportReport:
    """Merges each layer's DoRA (or LoRA) adapters into its fp8 base and writes a checkpoint to deploy.

    For a DoRA adapter the merged row j is m_j / max(||V_j||, NORM_EPS) * V_j with V = W0 + s B A, computed in fp32
    one block of rows at a time (never a dense fp32 copy of a layer, let alone of the model); several active
    adapters merge in sequence, as PEFT merges them. The merged weight is re-quantized to e4m3 in `format`:
    compressed-tensors (default unless the model was loaded from another layout; one scale per row, which loses
    least), comfyui / comfyui-quant (per tensor, what ComfyUI reads), fine-grained (per 128 x 128 block, or
    block_size), dorafp8; or written dense: bf16, fp16, fp32. `granularity` ("row", "tensor", "block") overrides
    the scale of the merged layers where the layout allows it. Layers without adapters keep their bytes.

    Returns an ExportReport with the merge error of every layer: ||written - merged||_F / ||merged||_F against the
    merged weight evaluated in fp32 from the unmerged adapters (the weight the trained model computes with), and
    its worst and mean (printed with verbose). The model itself is not changed."""
    return _write(model, path, format, merge=True, adapter_names=adapter_names, granularity=granularity,
                  block_size=block_size, max_shard_size=max_shard_size, prefix=prefix, metadata=metadata,
                  verbose=verbose)
