"""The writers' common core: walk a model (through PEFT's layers) and put every tensor of the checkpoint into a
sink, each fp8 layer in the target layout: its bytes and scale kept where the layout holds them, else re-quantized,
or merged with its adapters first (export_merged)."""

from __future__ import annotations

import copy
import json
from typing import Optional

import torch
from torch import nn

from ..merge import adapter_terms, merged_rows, requantize, requantize_micro, weight_amax
from ..quant import E4M3, nvfp4_global_scale, scale_kind, w0_rows, weight_dims
from .layouts import E5M2, Layout, cpu_fine_grained_read, granularity_name
from .modules import FP8_CONV_TYPES, FP8_LAYER_TYPES, base_layer, tuner_layer_class
from .plan import LayerSource, WriteTarget, Written, fp32_bits
from .reports import ExportReport
from .sink import TensorSink


def walk_model(mod: nn.Module, prefix: str, tuner_cls):
    """(kind, name, object) in state_dict order, kind "fp8" (an fp8 layer), "tuner" or "tensor"."""
    fp8_types = FP8_LAYER_TYPES
    if isinstance(mod, fp8_types) or (tuner_cls is not None and isinstance(mod, tuner_cls)
                                      and isinstance(base_layer(mod), fp8_types)):
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
        yield from walk_model(inner, prefix, tuner_cls)
        return
    if isinstance(mod, nn.Linear):  # by class, not type: fully_shard's FSDPLinear (an FSDP2 lm_head) is one too
        yield "linear", prefix[:-1], mod
    for n, p in mod._parameters.items():
        if p is not None:
            yield "tensor", prefix + n, p
    for n, b in mod._buffers.items():
        if b is not None and n not in mod._non_persistent_buffers_set:
            yield "tensor", prefix + n, b
    for n, child in mod._modules.items():
        if child is not None:
            yield from walk_model(child, f"{prefix}{n}.", tuner_cls)


def layout_scale(fmt: str, scale: torch.Tensor, N: int, meta: Optional[LayerSource]) -> torch.Tensor:
    """A normalized fp32 scale in the shape and dtype the layout stores (the loaded file's, on a round trip)."""
    g = scale_kind(scale)
    if fmt in ("compressed-tensors", "musubi"):  # musubi: [1] / [out, 1] broadcast against [out, in] in its forward
        shape = {"tensor": (1,), "row": (N, 1)}.get(g, tuple(scale.shape))
    elif fmt in ("comfyui", "comfyui-quant"):
        shape = ()
    else:
        shape = tuple(scale.shape)
    same = meta is not None and meta.format == fmt
    src_shape = meta.scale_shape if same else None
    if src_shape is not None and torch.Size(src_shape).numel() == scale.numel():
        shape = tuple(src_shape)
    out = scale.float().reshape(shape)
    dt = meta.scale_dtype if same else None
    if dt is not None and dt != torch.float32 and torch.equal(out.to(dt).float(), out):
        out = out.to(dt)
    return out


def act_mode(fp8: nn.Module, layout: Layout, extras: dict) -> str:
    """compressed-tensors' input_activations for the layer: "static" where its checkpoint had a static scale (kept),
    "dynamic" for W8A8 layers (act_quant="rowwise", per token), "none" for W8A16 (the default)."""
    if layout.act_scale_key and layout.act_scale_key in extras:
        return "static"
    return "dynamic" if getattr(fp8, "act_quant", None) else "none"


def emit(t: WriteTarget, sink: TensorSink, report: ExportReport, *, merge: bool, adapter_names) -> Written:
    """Puts every tensor of the model into `sink`, fp8 layers in t's layout; fills report.layers."""
    tuner_type = tuner_layer_class()
    out = Written()
    put_tensor = _TensorPutter(t, sink, report)
    shared = _fused_nvfp4_globals(t, tuner_type, merge, adapter_names) if t.fmt == "modelopt" else {}
    if t.fmt == "comfyui":
        markers = t.src.marker_tensors if t.same else None
        for k, v in (markers or {f"{t.strip}scaled_fp8": torch.tensor([], dtype=E4M3)}).items():
            sink.add(k, v)
    for kind, name, obj in walk_model(t.base, "", tuner_type):
        if kind == "linear":
            out.dense_linears.append(name)
        elif kind == "tensor":
            put_tensor(name, obj)
        elif kind == "tuner":  # a PEFT layer on a module that is not fp8: its base layer's tensors (merged if asked)
            if merge:
                layer = copy.deepcopy(obj)
                layer.merge(adapter_names=adapter_names)
                inner = layer.get_base_layer()
            else:
                inner = obj.get_base_layer()
                out.unmerged.append(name)
            for k2, n2, o2 in walk_model(inner, name + ".", tuner_type):
                if k2 == "linear":
                    out.dense_linears.append(name)
                elif k2 == "tensor":
                    put_tensor(n2, o2)
        else:
            _emit_fp8_layer(t, sink, report, out, name, obj, tuner_type, merge=merge, adapter_names=adapter_names,
                            shared=shared)
    return out


def _to_merge(name: str, tuner, merge: bool, adapter_names) -> list:
    """The adapters of a PEFT layer (None: none) that a merging write merges, checked mergeable."""
    if tuner is None or not merge:
        return []
    names_ = list(adapter_names) if adapter_names is not None else \
        [a for a in tuner.active_adapters if a not in tuner.merged_adapters]
    problems = tuner.merge_problems(names_) if hasattr(tuner, "merge_problems") else []
    if problems:
        raise ValueError(f"{name}: cannot merge: {'; '.join(problems)}")
    return names_


# The sibling layers vLLM fuses into one, by their names under one parent: the union of the multi-layer entries of
# its models' packed_modules_mapping / stacked_params_mapping (vLLM 0.33: qkv_proj, gate_up_proj, DeepSeek's MLA
# fused_qkv_a_proj, Mixtral's w13, Qwen3.5's in_proj_qkvz / in_proj_ba, BERT's and Molmo's qkv, ...). A set is wider
# than one model's where models differ (Whisper fuses only k/v of its cross-attention): a needless member costs a
# reported re-quantization where a sibling is merged; one left out would compute wrong in vLLM.
VLLM_FUSED = (("q_proj", "k_proj", "v_proj", "b_proj", "g_proj", "f_a_proj"), ("gate_proj", "up_proj", "dense_h_to_4h"),
              ("query", "key", "value"), ("query_net", "key_net", "value_net"), ("q", "k", "v"), ("wq", "wk", "wv"),
              ("w1", "w3"), ("fc1", "fc3"), ("c_fc_0", "c_fc_1"), ("q_a_proj", "kv_a_proj_with_mqa"),
              ("in_proj_qkv", "in_proj_z"), ("in_proj_b", "in_proj_a"))
_FUSED_SET = {leaf: i for i, names in enumerate(VLLM_FUSED) for leaf in names}


def _fused_nvfp4_globals(t: WriteTarget, tuner_type, merge: bool, adapter_names) -> dict:
    """name -> the global scale (weight_scale_2) an NVFP4 layer is written with, for the members of a group vLLM fuses
    (VLLM_FUSED: siblings under one parent) where one of them changed since it was loaded (merged now or by
    merge_and_unload before the write, or not loaded from a file). vLLM multiplies every shard of a fused layer by the
    largest of their weight_scale_2s (modelopt.py, only a warning where they differ; its MoE experts take gate's), so a
    layer merged with a global of its own would compute wrong there. The group's global is the largest of its
    members' (a merged one's from its merged weight, ModelOpt's amax / (6 * 448)); a member whose global is another is
    re-quantized with it. A group unchanged since it was loaded keeps its globals, as the file had them."""
    groups: dict = {}
    for kind, name, obj in walk_model(t.base, "", tuner_type):
        fp8 = base_layer(obj) if kind == "fp8" else None
        parent, _, leaf = name.rpartition(".")
        if getattr(fp8, "global_scale", None) is not None and leaf in _FUSED_SET:
            groups.setdefault((parent, _FUSED_SET[leaf]), []).append((name, obj, fp8))
    out = {}
    for members in groups.values():
        if len(members) < 2:
            continue  # a layer alone takes its own global (recomputed where merged), as before
        merged, changed = {}, False
        for name, obj, fp8 in members:
            tuner = obj if (tuner_type is not None and isinstance(obj, tuner_type)) else None
            names_ = _to_merge(name, tuner, merge, adapter_names)
            src = getattr(fp8, "_dorafp8_source", None)
            changed |= bool(names_) or src is None or src.global_bits != fp32_bits(fp8.global_scale)
            if names_:
                terms = adapter_terms(tuner, names_)
                merged[name] = nvfp4_global_scale(weight_amax(
                    lambda j0, j1, f=fp8, tm=terms: merged_rows(f.fp8_weight(), f.scale, f.block_size, tm, j0, j1,
                                                                f.global_scale), *weight_dims(fp8.weight),
                    fp8.weight.device))
        if not changed:
            continue
        own = [merged.get(n, f.global_scale.detach().float().reshape(())).to(f.weight.device) for n, _, f in members]
        g = torch.stack(own).amax()
        out.update({n: g.clone() for n, _, _ in members})  # one tensor each: safetensors refuses shared memory
    return out


class _TensorPutter:
    """Writes a non-fp8 tensor once per tied group, cast to the dense format or its file's dtype."""

    def __init__(self, t: WriteTarget, sink: TensorSink, report: ExportReport):
        self.t, self.sink, self.report = t, sink, report
        self.written_ids: dict[int, str] = {}
        self.src_dtypes = t.src.dtypes if t.same else {}

    def __call__(self, key: str, v) -> None:
        if id(v) in self.written_ids:
            self.report.notes.append(f"{key} is the same tensor as {self.written_ids[id(v)]} (tied): written once")
            return
        self.written_ids[id(v)] = key
        v = v.detach()
        dense_dtype = self.t.dense_dtype
        if dense_dtype is not None and v.is_floating_point():
            v = v.float().to(dense_dtype) if v.dtype in (E4M3, E5M2) else v.to(dense_dtype)
        else:
            sd = self.src_dtypes.get(key)
            if sd is not None and sd != v.dtype and v.is_floating_point() and torch.equal(v.to(sd).to(v.dtype), v):
                v = v.to(sd)
        self.sink.add(self.t.key_of(key), v)


def _emit_fp8_layer(t: WriteTarget, sink: TensorSink, report: ExportReport, out: Written, name: str, obj: nn.Module,
                    tuner_type, *, merge: bool, adapter_names, shared: dict) -> None:
    """One fp8 layer (or the PEFT layer on it): its weight, scale, bias and extras in t's layout."""
    fmt, layout, dense_dtype, granularity, block_size = t.fmt, t.layout, t.dense_dtype, t.granularity, t.block_size
    key_of = t.key_of
    comfy_meta_layers = "_quantization_metadata" in t.metadata
    tuner = obj if (tuner_type is not None and isinstance(obj, tuner_type)) else None
    fp8 = base_layer(obj)
    w8, scale, layer_block_size = fp8.fp8_weight(), fp8.scale, fp8.block_size
    w_shape = w8.shape  # a conv weight [C_out, C_in/groups, *kernel] is handled as its 2-D view, written as is
    w8 = w8.reshape(w_shape[0], -1)
    N, K = weight_dims(w8)  # a packed NVFP4 weight holds two columns a byte
    g_scale = getattr(fp8, "global_scale", None)  # NVFP4's
    if w8.dtype == torch.uint8:
        w_shape = (N, K)
    names_ = _to_merge(name, tuner, merge, adapter_names)
    if tuner is not None and not merge and any(a not in tuner.merged_adapters for a in tuner.active_adapters):
        out.unmerged.append(name)
    terms = adapter_terms(tuner, names_) if names_ else []
    bias = fp8.bias.detach() if fp8.bias is not None else None
    for a in (term[4] for term in terms):
        if tuner.lora_bias.get(a) and tuner.lora_B[a].bias is not None:
            if bias is None:
                raise RuntimeError(f"{name}: cannot merge lora_bias of adapter {a!r}: the base layer has no bias")
            bias = bias.float() + tuner.lora_B[a].bias.detach().float() * tuner.scaling[a]

    def rows(j0, j1, _w8=w8, _s=scale, _layer_block_size=layer_block_size, _t=terms, _g=g_scale):
        return merged_rows(_w8, _s, _layer_block_size, _t, j0, j1, _g)
    cur = scale_kind(scale)
    entry = {"adapters": [term[4] for term in terms]}
    fmeta = getattr(fp8, "_dorafp8_source", None)
    if dense_dtype is not None:
        W, _, st = requantize(rows, N, K, "row", dense_dtype=dense_dtype)
        entry.update(action="merged" if terms else "dequantized", granularity=str(dense_dtype).replace(
            "torch.", ""), rel_error=st.rel_error)
        report.layers[name] = entry
        sink.add(key_of(f"{name}.weight"), W.reshape(w_shape))
        if bias is not None:
            sink.add(key_of(f"{name}.bias"), bias.to(dense_dtype))
        del W
        return
    if fmt == "modelopt":
        _emit_micro_layer(t, sink, report, out, name, fp8, rows, terms, entry, bias, shared.get(name))
        return
    allowed = layout.write_granularities
    keep_ok = cur in allowed and granularity in (None, cur) and not (cur == "block" and layer_block_size != block_size)
    if terms:
        g = granularity or allowed[0]
        w8n, sn, st = requantize(rows, N, K, g, block_size=block_size)
        entry.update(action="merged", rel_error=st.rel_error)
    elif keep_ok:
        w8n, sn = w8, scale
        g = cur
        entry.update(action="kept", rel_error=0.0)
    elif cur == "tensor" and (granularity or allowed[0]) in ("row", "block"):
        g = granularity or allowed[0]
        sn = scale.reshape(1).expand(N) if g == "row" else scale.reshape(1, 1).expand(-(-N // block_size), -(-K // block_size))
        w8n = w8
        entry.update(action="kept", rel_error=0.0)
    else:
        g = granularity or (allowed[0] if cur not in allowed else cur)
        w8n, sn, st = requantize(lambda j0, j1: w0_rows(w8, scale, layer_block_size, j0, j1), N, K, g, block_size=block_size)
        entry.update(action="requantized", rel_error=st.rel_error)
    if terms:
        _refuse_nonfinite(name, entry, st)
    entry["granularity"] = granularity_name(g, block_size)
    if fmt == "fine-grained" and cpu_fine_grained_read(N, K, block_size) != "ok":
        out.ragged.append(name)
    report.layers[name] = entry
    if isinstance(fp8, FP8_CONV_TYPES):
        out.conv_layers.append(name)
    sink.add(key_of(f"{name}.weight"), w8n.reshape(w_shape))
    if fmt == "fp8-cast":
        if not bool((sn == 1).all()):
            raise ValueError(f"{name}: the fp8-cast layout has no scale, but this layer's is not 1; write "
                             f"another format (compressed-tensors keeps per-row scales)")
    else:
        sink.add(key_of(f"{name}.{layout.scale_key}"), layout_scale(fmt, sn, N, fmeta))
    extras = _emit_bias_and_extras(t, sink, name, fp8, bias)
    if fmt == "comfyui-quant" and not comfy_meta_layers and "comfy_quant" not in extras:
        comfy_quant = torch.tensor(list(json.dumps({"format": "float8_e4m3fn"}).encode()), dtype=torch.uint8)
        extras["comfy_quant"] = comfy_quant
        sink.add(key_of(f"{name}.comfy_quant"), comfy_quant)
    out.groups.setdefault((g, act_mode(fp8, layout, extras)), []).append(name)
    del w8n, sn


def _refuse_nonfinite(name: str, entry: dict, st) -> None:
    """A merge whose result has non-finite values (requantize's stats `st`) is refused: nothing usable to write."""
    if st.nonfinite:
        raise ValueError(f"{name}: merging adapters {entry['adapters']} gives {st.nonfinite} non-finite values "
                         f"(the adapter seems to be broken); nothing usable can be written")


def _emit_bias_and_extras(t: WriteTarget, sink: TensorSink, name: str, fp8: nn.Module, bias) -> dict:
    """Writes a layer's bias and the extras it was loaded with from a file of t's layout; returns those."""
    if bias is not None:
        bt = bias.to(fp8.bias.dtype) if fp8.bias is not None else bias
        sd = (t.src.dtypes if t.same else {}).get(f"{name}.bias")
        if sd is not None and sd != bt.dtype and torch.equal(bt.to(sd).to(bt.dtype), bt):
            bt = bt.to(sd)
        sink.add(t.key_of(f"{name}.bias"), bt)
    fmeta = getattr(fp8, "_dorafp8_source", None)
    extras = dict(fmeta.extras) if fmeta is not None and fmeta.format == t.fmt else {}
    for ek, ev in extras.items():
        sink.add(t.key_of(f"{name}.{ek}"), ev)
    return extras


def _emit_micro_layer(t: WriteTarget, sink: TensorSink, report: ExportReport, out: Written, name: str,
                      fp8: nn.Module, rows, terms: list, entry: dict, bias, shared_g=None) -> None:
    """An NVFP4 / MXFP8 layer in ModelOpt's layout (`weight`, `weight_scale` e4m3 or e8m0 bytes as uint8, NVFP4's
    `weight_scale_2`): kept bit for bit without adapters; merged, re-quantized by its own recipe (merge.py).
    shared_g: the global scale of its fused group (_fused_nvfp4_globals), which it is written with."""
    kind = scale_kind(fp8.scale)
    requant = shared_g is not None and not torch.equal(shared_g, fp8.global_scale.detach().float().reshape(()))
    if terms or requant:
        w, scale, g, st = requantize_micro(rows, *weight_dims(fp8.weight), kind, device=fp8.weight.device,
                                           global_scale=shared_g)
        _refuse_nonfinite(name, entry, st)
        entry.update(action="merged" if terms else "requantized", rel_error=st.rel_error)
    else:
        w, scale, g = fp8.weight.detach(), fp8.scale, fp8.global_scale
        entry.update(action="kept", rel_error=0.0)
    entry["granularity"] = kind
    report.layers[name] = entry
    if kind == "mxfp8":  # ModelOpt's uint8 bytes, whatever the source's dtype: vLLM's uint8 parameter is filled with
        scale = scale.view(torch.uint8)  # copy_, which would convert an e8m0 tensor by value (2^(e-127) -> 0, 1, 8)
    sink.add(t.key_of(f"{name}.weight"), w)
    sink.add(t.key_of(f"{name}.weight_scale"), scale)
    if g is not None:
        sink.add(t.key_of(f"{name}.weight_scale_2"), g.detach().float().reshape(()))
    extras = _emit_bias_and_extras(t, sink, name, fp8, bias)
    # "static": the NVFP4 layer has ModelOpt's input_scale, which vLLM's W4A4 path (quant_algo NVFP4) needs
    out.groups.setdefault((kind, "static" if "input_scale" in extras else "none"), []).append(name)
