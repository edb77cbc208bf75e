"""Reading a checkpoint: a dict of tensors, a .safetensors file, or a directory (sharded with an index, or not);
what layout it is in (detect_format), from its keys, dtypes and config.json, without reading tensor data."""

from __future__ import annotations

import os
import re
from collections import Counter
from typing import Iterable, Mapping, Optional

import torch

from ..quant import E4M3, E8M0
from .files import (CHECKED_JSON, DAMAGED, allowed_roots, file_in, names_a_file, open_safetensors,
                    read_json, regular_file, safetensors_keys, sha256_key, some)
from .layouts import E5M2, LAYOUTS, SAFETENSORS_DTYPES, CheckpointFormatError

SINGLE_NAMES = ("model.safetensors", "diffusion_pytorch_model.safetensors")
INDEX_NAMES = tuple(f"{n}.index.json" for n in SINGLE_NAMES)


def modelopt_algo(hf_quant_config, config) -> Optional[str]:
    """ModelOpt's quant_algo ("NVFP4", "MXFP8", "FP8", ...) from hf_quant_config.json's object, else from config.json's
    quantization_config whose quant_method is "modelopt" in any case; upper-cased (ModelOpt's writer may write
    "mxfp4"), as vLLM reads them. Else None."""
    hq = (hf_quant_config or {}).get("quantization")
    if isinstance(hq, dict) and hq.get("quant_algo"):
        return str(hq["quant_algo"]).upper()
    qc = (config.get("quantization_config") if isinstance(config, dict) else None) or {}
    ok = isinstance(qc, dict) and str(qc.get("quant_method")).lower() == "modelopt" and qc.get("quant_algo")
    return str(qc["quant_algo"]).upper() if ok else None


class CheckpointSource:
    """Keys, dtypes and shapes of a checkpoint without reading its data; then the data, one shard at a time."""

    def __init__(self, src):
        if not isinstance(src, Mapping):
            from .._deps import require

            require("safetensors", what="reading fp8 checkpoint files")
        self.state_dict = None
        self.config = None
        self.hf_quant_config = None  # ModelOpt's hf_quant_config.json, beside config.json
        self.hf_quant_config_path = None
        self.index = None  # the index file of a sharded folder
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
            self._read_folder(path)
        else:
            regular_file(path, "path_or_state_dict")
            if not names_a_file(path):
                raise CheckpointFormatError(f"{path} is not a .safetensors file; load it yourself (torch.load) and "
                                            f"pass the state dict")
            self.shards = [path]
        for i, shard in enumerate(self.shards):
            metadata, keys = safetensors_keys(shard, self.where(i))
            if i == 0:
                self.metadata = dict(metadata)
            for k, (dtype, shape) in keys.items():
                if k in self.info:
                    raise CheckpointFormatError(f"{k!r} is in two shards ({self.shards[self.info[k][2]]} and "
                                                f"{shard})")
                self.info[k] = (SAFETENSORS_DTYPES.get(dtype), shape, i)

    def _read_folder(self, path: str) -> None:
        """A folder's shards (its model.safetensors, else those its index names, else every *.safetensors) and
        config.json, each a regular file inside it; the JSON files must match the sha256 the index records."""
        roots = allowed_roots(path)

        def inside(name: str, what: Optional[str] = None) -> str:
            return file_in(path, name, what or f"{path}: {name}", roots)

        recorded = {}  # what the index of a dorafp8 export records of its config.json and hf_quant_config.json
        single = next((n for n in SINGLE_NAMES if os.path.lexists(os.path.join(path, n))), None)
        index = next((n for n in INDEX_NAMES if os.path.lexists(os.path.join(path, n))), None)
        if single is not None:
            self.shards = [inside(single)]
        elif index is not None:
            self.index = inside(index)
            index_obj = read_json(self.index, 'a safetensors index, {"weight_map": {tensor name: shard file}}')
            weight_map = index_obj.get("weight_map")
            meta = index_obj.get("metadata")
            recorded = {n: meta.get(sha256_key(n)) for n in CHECKED_JSON} if isinstance(meta, dict) else {}
            recorded = {n: v for n, v in recorded.items() if isinstance(v, str)}
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointFormatError(f"{self.index}: its \"weight_map\" is not an object of tensor names to "
                                            f"shard file names; {DAMAGED}")
            self.shards = [inside(s, f"{self.index}: shard {s!r}") for s in sorted(set(weight_map.values()))]
        else:
            names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
            _refuse_incomplete_shards(path, names)
            self.shards = [inside(n) for n in names]
        if not self.shards:
            others = sorted(n for n in os.listdir(path) if n.endswith((".bin", ".pt", ".pth", ".ckpt", ".gguf")))
            raise FileNotFoundError(f"no .safetensors file in {path}" + (
                f" (found {', '.join(others[:3])}: only safetensors checkpoints are read; load other formats "
                f"yourself and pass the state dict)" if others else ""))
        if os.path.lexists(os.path.join(path, "config.json")):
            cfg = inside("config.json")
            self.config = read_json(cfg, "a model config (a JSON object)", recorded.get("config.json"))
            if not isinstance(self.config.get("quantization_config") or {}, dict):
                raise CheckpointFormatError(f"{cfg}: its \"quantization_config\" is a "
                                            f"{type(self.config['quantization_config']).__name__}, expected an object; "
                                            f"{DAMAGED}")
        if os.path.lexists(os.path.join(path, "hf_quant_config.json")):
            self.hf_quant_config_path = inside("hf_quant_config.json")
            self.hf_quant_config = read_json(self.hf_quant_config_path,
                                             "ModelOpt's quantization config (a JSON object)",
                                             recorded.get("hf_quant_config.json"))

    def where(self, i: int) -> str:
        """Shard i as errors name it: its path, and for a sharded checkpoint which shard of how many."""
        if self.state_dict is not None:
            return "the state dict"
        n = len(self.shards)
        return self.shards[i] + (f" (shard {i + 1} of {n} of {self.index or self.name})" if n > 1 else "")

    def quant_config(self) -> dict:
        return (self.config or {}).get("quantization_config") or {}

    def modelopt_kv_cache_algo(self) -> Optional[str]:
        """ModelOpt's kv_cache_quant_algo ("FP8", ...) from hf_quant_config.json or config.json, else None."""
        hq = (self.hf_quant_config or {}).get("quantization")
        qc = hq if isinstance(hq, dict) and hq.get("quant_algo") else self.quant_config()
        algo, scheme = qc.get("kv_cache_quant_algo"), qc.get("kv_cache_scheme")  # the latter: config.json's form
        if not algo and isinstance(scheme, dict) and scheme.get("type") == "float" and scheme.get("num_bits") == 8:
            algo = "FP8"  # as vLLM's ModelOptQuantConfigBase.from_config reads it
        if not algo and self.hf_quant_config is None:  # a single file dorafp8 wrote
            algo = self.metadata.get(KV_CACHE_ALGO_KEY)
        return str(algo) if algo else None

    def read(self, keys: Iterable[str], device) -> Iterable[tuple[str, torch.Tensor]]:
        """(key, tensor) for `keys`, shard by shard, one tensor at a time."""
        by_shard: dict[int, list[str]] = {}
        for k in keys:
            by_shard.setdefault(self.info[k][2], []).append(k)
        if self.state_dict is not None:
            for k in by_shard.get(0, []):
                yield k, self.state_dict[k].to(device)
            return
        dev = str(torch.device(device))
        for i in sorted(by_shard):
            with open_safetensors(self.shards[i], self.where(i), dev) as f:
                for k in by_shard[i]:
                    yield k, f.get_tensor(k)


def _refuse_incomplete_shards(folder: str, names: list[str]) -> None:
    """Refuses a folder without an index holding some, not all, of the shards `<name>-0000i-of-0000n.safetensors` of
    a sharded checkpoint: a first export killed or failed while it moved its shards in (the index comes last), or a
    download cut short, would otherwise load as if complete (a strict=False load, with the rest missing)."""
    groups: dict[tuple, set] = {}
    for n in names:
        m = re.fullmatch(r"(.*)-([0-9]{5})-of-([0-9]{5})\.safetensors", n)
        if m:
            groups.setdefault((m.group(1), int(m.group(3))), set()).add(int(m.group(2)))
    for (stem, total), have in sorted(groups.items()):
        lacking = [f"{stem}-{i:05d}-of-{total:05d}.safetensors" for i in range(1, total + 1) if i not in have]
        if lacking:
            raise CheckpointFormatError(f"{folder}: holds {len(have & set(range(1, total + 1)))} of the {total} "
                                        f"shards of {stem!r} and no index naming them; {some(lacking)} missing: an "
                                        f"export killed or failed before it was published (dorafp8 writes the "
                                        f"index last), or a download cut short. Export or download it again")


# ---- detection ---------------------------------------------------------------------------------------------------


def layer_key(key: str) -> str:
    """'<layer>.weight' -> '<layer>'."""
    return key.rpartition(".")[0]


def refuse_comfy_microscaled(source: CheckpointSource) -> None:
    """Refuses ComfyUI's NVFP4 / MXFP8 layers (a `comfy_quant` file, per-layer tensors or `_quantization_metadata`,
    holding packed uint8 weights with `weight_scale_2`, or e8m0 `weight_scale`), whatever format= says. comfy_kitchen's
    TensorCoreNVFP4Layout / TensorCoreMXFP8Layout store their block scales in cuBLAS's swizzled (to_blocked) tile order,
    padded to 128 rows x 4 columns, NVFP4 with the even column in the high nibble and the weights padded to 16 (32):
    under ModelOpt's names and, for most layer sizes, its shapes. Read as ModelOpt's row-major scales and low-nibble
    codes they load without an error and compute wrong values."""
    info = source.info
    if not (any(k.endswith(".comfy_quant") for k in info) or "_quantization_metadata" in source.metadata):
        return
    nvfp4 = nvfp4_weights(info)
    mx = [k for k in info if k.endswith(".weight_scale") and info[k][0] in MX_SCALE_DTYPES
          and info.get(layer_key(k) + ".weight", (None,))[0] == E4M3]
    if nvfp4 or mx:
        kind, key = ("nvfp4", next(iter(nvfp4.values()))) if nvfp4 else ("mxfp8", mx[0])
        raise CheckpointFormatError(
            f"{source.name}: ComfyUI {kind} layers (comfy_kitchen's "
            f"{'TensorCoreNVFP4Layout' if nvfp4 else 'TensorCoreMXFP8Layout'}, e.g. {key!r}, marked by "
            f"'comfy_quant' / '_quantization_metadata'): their block scales are stored in cuBLAS's swizzled (to_blocked) "
            f"tile order" + (" and the e2m1 codes high nibble first" if nvfp4 else "") + ", which dorafp8 does not "
            f"read; read as ModelOpt's layout (format='modelopt') they would load without an error and compute wrong "
            f"values. Load the same model's float8_e4m3fn or bf16 file instead (ComfyUI's fp8 'comfy_quant' and "
            f"'scaled_fp8' files load), or a ModelOpt / compressed-tensors {kind.upper()} export. Nothing was loaded")


def detect(source: CheckpointSource) -> tuple[str, str]:
    """(format, evidence); raises CheckpointFormatError naming what it saw."""
    refuse_comfy_microscaled(source)
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
    nvfp4 = nvfp4_weights(info)
    unsupported = {"weight_packed": "packed int4 weights (compressed-tensors pack-quantized)",
                   "weight_scale_2": "two-level scales on weights that are not packed NVFP4 (uint8)",
                   "weight_global_scale": "tensor-group scales on weights that are not packed NVFP4 (uint8)",
                   "qweight": "GPTQ/AWQ int4", "SCB": "bitsandbytes int8", "absmax": "bitsandbytes 4-bit"}
    for s, why in unsupported.items():
        if any(k.endswith("." + s) and f"{layer_key(k)}" not in nvfp4 for k in keys) if s in (
                "weight_packed", "weight_scale_2", "weight_global_scale") else suffix.get(s):
            raise CheckpointFormatError(f"{source.name}: {why} (keys like '<layer>.{s}'); dorafp8 loads fp8 e4m3 "
                                        f"checkpoints only. Saw {what}")
    int8_scaled = [k for k in keys if info[k][0] == torch.int8 and k.endswith(".weight")
                   and (layer_key(k) + ".weight_scale") in info]
    if int8_scaled:
        raise CheckpointFormatError(f"{source.name}: int8 weights with scales (e.g. {int8_scaled[0]!r}: "
                                    f"compressed-tensors int-quantized / W8A8-INT8); dorafp8 loads fp8 e4m3 only")
    signals = {}
    if suffix.get("comfy_quant") or "_quantization_metadata" in source.metadata:
        signals["comfyui-quant"] = "'<layer>.comfy_quant' entries" if suffix.get("comfy_quant") else \
            "'_quantization_metadata' in the safetensors metadata"
    marker = any(k == "scaled_fp8" or k.endswith(".scaled_fp8") for k in keys)
    musubi = [k for k in keys if k.endswith(".scale_weight") and (len(info[k][1]) >= 2 or info[k][0] in (
        torch.bfloat16, torch.float16))] if not marker else []
    if musubi:
        # ComfyUI reads scale_weight only with the marker (comfy/utils.py convert_old_quants), always 0-dim fp32;
        # musubi-tuner writes it without one, in the weight's dtype, [out, 1] per row or [out, in / 64, 1] per block
        signals["musubi"] = (f"'<layer>.scale_weight' of shape {list(info[musubi[0]][1])} {info[musubi[0]][0]} "
                             f"without the 'scaled_fp8' marker (musubi-tuner / kohya --fp8_scaled)")
    elif suffix.get("scale_weight") or marker:
        signals["comfyui"] = "'scaled_fp8' / '<layer>.scale_weight'"
    if suffix.get("weight_scale_inv"):
        signals["fine-grained"] = "'<layer>.weight_scale_inv'"
    algo = modelopt_algo(source.hf_quant_config, source.config)
    _refuse_stale_hf_quant_config(source, algo, nvfp4)
    # ModelOpt's own layout for its NVFP4 / MXFP8 exports; its FP8 export reads as compressed-tensors', as before
    if suffix.get("weight_scale_2") or algo in ("NVFP4", "MXFP8"):
        signals["modelopt"] = ("'<layer>.weight_scale_2' (NVFP4's global scales)" if suffix.get("weight_scale_2")
                               else f"ModelOpt's quant_algo {algo!r}")
    elif suffix.get("weight_scale") and "comfyui-quant" not in signals:
        signals["compressed-tensors"] = "'<layer>.weight_scale'"
    if any((layer_key(k) + ".scale") in info for k in fp8_w):
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
        others = [k for k in keys if info[k][0] == E4M3 and not (k == "scaled_fp8" or k.endswith(".scaled_fp8"))]
        if others:  # fp8 under other names: not an unquantized checkpoint, whatever the next error would say
            raise CheckpointFormatError(
                f"{source.name}: float8_e4m3fn tensors under keys that are no layer's '.weight' (e.g. {others[0]!r}; "
                f"optimum-quanto's '<layer>.weight._data' with '._scale' are such), a layout dorafp8 does not read "
                f"(layouts: {', '.join(LAYOUTS)}). Saw {what}. Load the model's bf16 checkpoint and "
                f"dorafp8.quantize_model it")
        ints = [k for k in keys if k.endswith(".weight") and isinstance(info[k][0], torch.dtype)
                and not info[k][0].is_floating_point]
        if ints:  # integer weights are packed codes (a GGUF file converted to safetensors, ...), not unquantized ones
            raise CheckpointFormatError(
                f"{source.name}: {info[ints[0]][0]} weights (e.g. {ints[0]!r}; a GGUF file converted to safetensors "
                f"keeps its quantized blocks so), a quantized layout dorafp8 does not read (layouts: "
                f"{', '.join(LAYOUTS)}). Saw {what}. Load the model's bf16 checkpoint and dorafp8.quantize_model it")
        raise CheckpointFormatError(
            f"{source.name}: no float8_e4m3fn weight, so this is not an fp8 checkpoint dorafp8 knows "
            f"(layouts: {', '.join(LAYOUTS)}). Saw {what}. An unquantized checkpoint loads the usual way "
            f"(from_pretrained / load_state_dict); then dorafp8.quantize_model(model) puts it in fp8")
    expected = {"fp8": "fine-grained", "compressed-tensors": "compressed-tensors"}.get(method)
    if expected and expected != name:
        raise CheckpointFormatError(f"{source.name}: config.json says quant_method={method!r} ({expected}) but the "
                                    f"keys look like {name} ({evidence}). Saw {what}")
    if algo == "MIXED_PRECISION":  # without NVFP4 layers its keys read as compressed-tensors': checked there too
        _check_mixed_precision(source)
    elif name == "modelopt" and algo not in (None, "NVFP4", "W4A16_NVFP4", "MXFP8"):
        raise CheckpointFormatError(f"{source.name}: NVFP4 global scales ('<layer>.weight_scale_2') but ModelOpt's "
                                    f"quant_algo is {algo!r}; dorafp8 loads ModelOpt's NVFP4 (and W4A16_NVFP4), "
                                    f"MXFP8 and MIXED_PRECISION exports (of {', '.join(MIXED_PRECISION_ALGOS)} "
                                    f"layers)")
    if not fp8_w and not nvfp4 and name != "comfyui-quant":
        raise CheckpointFormatError(f"{source.name}: looks like {LAYOUTS[name].description} ({evidence}) but holds "
                                    f"no float8_e4m3fn weight. Saw {what}")
    return name, evidence


# The per-layer quant_algos of a ModelOpt MIXED_PRECISION export that dorafp8 reads, each by its keys and dtypes:
# packed uint8 + weight_scale_2 (NVFP4; W4A16_NVFP4 is the same tensors without input_scale), e8m0 weight_scale
# (MXFP8), e4m3 with an fp32 weight_scale per tensor (FP8) or per row (FP8_PER_CHANNEL_PER_TOKEN)
MIXED_PRECISION_ALGOS = ("NVFP4", "W4A16_NVFP4", "MXFP8", "FP8", "FP8_PER_CHANNEL_PER_TOKEN")


def _check_mixed_precision(source: CheckpointSource) -> None:
    """A ModelOpt MIXED_PRECISION export (quant_utils.py: one quant_algo per layer in `quantized_layers`, e.g. FP8
    attention and NVFP4 MLPs) loads where every layer's algorithm is one dorafp8 reads; else refused, naming them."""
    hq = (source.hf_quant_config or {}).get("quantization")
    layers = (hq if isinstance(hq, dict) and hq.get("quant_algo") else source.quant_config()).get("quantized_layers")
    if not isinstance(layers, dict):
        raise CheckpointFormatError(f"{source.name}: ModelOpt's quant_algo is 'MIXED_PRECISION' but its config has no "
                                    f"\"quantized_layers\" object saying which layer holds which algorithm; the "
                                    f"config is damaged or not ModelOpt's: nothing was loaded")
    other = {lay: c.get("quant_algo") if isinstance(c, dict) else c for lay, c in layers.items()
             if not isinstance(c, dict) or str(c.get("quant_algo")).upper() not in MIXED_PRECISION_ALGOS}
    if other:
        algos = sorted({str(a) for a in other.values()})
        lay = next(iter(other))
        raise CheckpointFormatError(f"{source.name}: a ModelOpt MIXED_PRECISION export with {len(other)} layers of "
                                    f"quant_algo {', '.join(algos)} (e.g. {lay!r}), which dorafp8 does not read (it "
                                    f"reads {', '.join(MIXED_PRECISION_ALGOS)} layers): load the model's bf16 "
                                    f"checkpoint and quantize_model it, or a ModelOpt export of these; nothing was "
                                    f"loaded")


def _refuse_stale_hf_quant_config(source: CheckpointSource, algo: Optional[str], nvfp4: dict) -> None:
    """Refuses an hf_quant_config.json whose NVFP4 / MXFP8 quant_algo no weight beside it has (one left from an
    earlier ModelOpt export to the folder, say), naming it, rather than reading the folder as ModelOpt's."""
    path, hq = source.hf_quant_config_path, (source.hf_quant_config or {}).get("quantization")
    if path is None or not isinstance(hq, dict) or algo != str(hq.get("quant_algo")).upper():
        return
    info = source.info
    if algo in ("NVFP4", "W4A16_NVFP4"):
        found = bool(nvfp4)
    elif algo == "MXFP8":
        found = any(k.endswith(".weight_scale") and info[k][0] in MX_SCALE_DTYPES for k in info)
    else:
        return
    if not found:
        method = source.quant_config().get("quant_method")
        said = f" (and config.json says quant_method={method!r})" if method else ""
        raise CheckpointFormatError(f"{path}: says quant_algo {algo!r}, but no weight in {source.name} is {algo} "
                                    f"(no " + ("packed uint8 '<layer>.weight' with '<layer>.weight_scale_2'" if
                                               algo != "MXFP8" else "e8m0 '<layer>.weight_scale'") + f"){said}: "
                                    f"it does not belong to these weights (left from an earlier ModelOpt export to "
                                    f"this folder?); move it away (or delete it), or load the folder it came with")


# MXFP8's scale dtypes in a file: e8m0, or its bytes as uint8 (ModelOpt's)
MX_SCALE_DTYPES = (torch.uint8, E8M0)


def nvfp4_weights(info: dict) -> dict[str, str]:
    """'<layer>' -> the key of its packed NVFP4 weight (ModelOpt's or compressed-tensors' names)."""
    out = {}
    for k, (dtype, _, _) in info.items():
        lay, _, suffix = k.rpartition(".")
        global_key = {"weight": "weight_scale_2", "weight_packed": "weight_global_scale"}.get(suffix)
        if global_key and dtype == torch.uint8 and f"{lay}.{global_key}" in info:
            out[lay] = k
    return out


def detect_format(path_or_state_dict) -> tuple[str, str]:
    """(format, evidence) of a checkpoint from its keys, dtypes and config.json; else CheckpointFormatError."""
    return detect(CheckpointSource(path_or_state_dict))


# the safetensors metadata entry in which dorafp8's writers record the block size of the block scales they write: the
# scale's shape alone does not say it (a [2, 2] grid over [192, 192] is 96 x 96 blocks as well as 128 x 128 ones)
BLOCK_SIZE_KEY = "dorafp8_block_size"
# and ModelOpt's kv_cache_quant_algo, in a modelopt file: a single file has no hf_quant_config.json to say it
KV_CACHE_ALGO_KEY = "dorafp8_kv_cache_quant_algo"


def config_block_size(source: CheckpointSource, fmt: str) -> Optional[int]:
    """The block size of the checkpoint's block scales, as its files say it (or None): the safetensors metadata
    dorafp8 writes, config.json's; refuses a record it cannot read, two that disagree, quantizations it does not
    read."""
    cfg = _config_block(source, fmt)
    raw = source.metadata.get(BLOCK_SIZE_KEY)
    if raw is None:
        return cfg
    if not (isinstance(raw, str) and re.fullmatch(r"[1-9][0-9]{0,5}", raw)):
        raise CheckpointFormatError(f"{source.where(0)}: its safetensors metadata {BLOCK_SIZE_KEY}={raw!r} is not a "
                                    f"block size (a positive integer); {DAMAGED}")
    if cfg is not None and cfg != int(raw):
        raise CheckpointFormatError(f"{source.name}: its safetensors metadata says {BLOCK_SIZE_KEY}={raw} but "
                                    f"config.json's quantization_config says block size {cfg}: one of them does not "
                                    f"belong to these weights (a config.json left from another export?); move the "
                                    f"wrong one away")
    return int(raw)


def _config_block(source: CheckpointSource, fmt: str) -> Optional[int]:
    """config.json's block size (or None); refuses quantizations dorafp8 does not read."""
    qc = source.quant_config()
    if fmt == "fine-grained":
        if qc.get("scale_fmt", "float") not in (None, "float"):
            raise CheckpointFormatError(f"{source.name}: scale_fmt={qc.get('scale_fmt')!r} (ue8m0 scales) is not "
                                        f"supported; dorafp8 reads fp32/bf16/fp16 scales")
        block_shape = qc.get("weight_block_size")
    elif fmt == "compressed-tensors":
        if qc.get("format") not in (None, "float-quantized", "naive-quantized", "mixed-precision",
                                    "nvfp4-pack-quantized", "mxfp8-quantized"):
            raise CheckpointFormatError(f"{source.name}: compressed-tensors format {qc.get('format')!r} is none of "
                                        f"float-quantized (fp8), nvfp4-pack-quantized and mxfp8-quantized")
        block_shape = None
        for g in (qc.get("config_groups") or {}).values():
            w = (g or {}).get("weights") or {}
            if w and (w.get("type") != "float" or w.get("num_bits") not in (4, 8)):
                raise CheckpointFormatError(f"{source.name}: compressed-tensors weights of type {w.get('type')!r} "
                                            f"with {w.get('num_bits')} bits: dorafp8 loads float weights of 8 bits "
                                            f"(fp8, MXFP8) and 4 bits (NVFP4) only")
            if w.get("strategy") == "block":
                block_shape = w.get("block_structure")
    else:
        return None
    if block_shape is None:
        return None
    if isinstance(block_shape, (list, tuple)):
        if len(set(block_shape)) != 1:
            raise CheckpointFormatError(f"{source.name}: block size {list(block_shape)} is not square; FP8Linear holds square "
                                        f"b x b blocks")
        block_shape = block_shape[0]
    return int(block_shape)
