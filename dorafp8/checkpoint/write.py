"""save_fp8_checkpoint and export_merged (a file or a directory), and the state dict dorafp8 hands transformers'
save_pretrained: the target resolved from the model and the arguments and checked before anything is written, then
the tensors emitted (emit.py) into a ShardWriter or a TensorSink, then config.json (configs.py).

Writing re-quantizes only what changed (merged layers) or what the target layout cannot hold as is (a per-row layer
written per tensor), and says so in the ExportReport.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from collections import Counter
from typing import Optional

from torch import nn

from ..nn import FP8Linear
from ..quant import DEFAULT_BLOCK, check_scale_kind, scale_kind
from .configs import check_destination, quantization_config, transformers_problem, write_config
from .emit import emit
from .files import finish_or_undo, publish, read_json, remove_leftovers, temporary_name
from .layouts import DENSE_FORMATS, GRANULARITY_NAMES, LAYOUTS, CheckpointFormatError, canonical_format
from .modules import base_model, fp8_modules, tuner_layer_class
from .plan import WriteTarget, source_of
from .reports import ExportReport
from .sink import ShardWriter, TensorSink, parse_size, shard_pattern

logger = logging.getLogger("dorafp8")


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


def _write(model: nn.Module, path, fmt: Optional[str], *, merge: bool, adapter_names, granularity, block_size,
           max_shard_size, prefix, metadata, verbose) -> ExportReport:
    from .._deps import require

    require("safetensors", what="writing fp8 checkpoints")
    t0 = time.time()
    path = os.fspath(path)
    t = resolve_target(model, fmt, granularity, block_size, prefix, metadata)
    check_destination(t, path, defaulted=fmt is None)
    single = path.endswith(".safetensors")
    # Write aside, then move into place: a directory checkpoint (shards, index, config.json) is written into a hidden
    # staging directory next to `path` and published (files.publish) only once all of them are written, so a failure
    # (a broken adapter, a full disk, Ctrl-C) leaves `path` as it was, and a kill leaves it loading as the old
    # checkpoint or the new one, never a mix. A single file is a temporary file renamed. Either carries this
    # process's id: what a killed writer left is finished or removed here, by the next write to the same path.
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(parent):
        remove_leftovers(parent, os.path.basename(os.path.abspath(path)))
    stage = path if single else _staging_dir(path)
    writer = ShardWriter(stage, t.stem, parse_size(max_shard_size), t.metadata)
    report = ExportReport(t.fmt, path)
    try:
        out = emit(t, writer, report, merge=merge, adapter_names=adapter_names)
        files = writer.close(taken=set() if single or not os.path.isdir(path) else set(os.listdir(path)))
        if not single:
            write_config(t, stage, report, out)
    except BaseException:
        writer.discard()
        if not single:
            shutil.rmtree(stage, ignore_errors=True)
        raise
    report.files = files if single else _publish(stage, path, t.stem, files)
    report.tensors, report.bytes = writer.count, writer.total
    if out.ragged:
        report.notes.append(f"{len(out.ragged)} layers have a dimension that is not a multiple of the block size "
                            f"{t.block_size} (e.g. {out.ragged[0]}): their scales cover partial blocks (ceil), as "
                            f"DeepSeek-V3's do and as transformers' FP8Linear (GPU) reads them; transformers' "
                            f"dequantize-while-loading path (used without a GPU) takes the block size from the scale "
                            f"grid and refuses or misreads them (transformers 5.23)")
    if out.unmerged and not merge:
        report.notes.append(f"{len(out.unmerged)} layers have adapters that were not written (save them with "
                            f"save_pretrained, or use export_merged): e.g. {out.unmerged[0]}")
    report.seconds = time.time() - t0
    logger.info(str(report))
    if verbose:
        print(str(report), flush=True)
    return report


def _staging_dir(path: str) -> str:
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    stage = temporary_name(parent, os.path.basename(os.path.abspath(path)))
    os.mkdir(stage)
    return stage


def _publish(stage: str, path: str, stem: str, files: list[str]) -> list[str]:
    """Moves the finished checkpoint in `stage` into `path` (files.publish: readers see the old one or the new one,
    never a mix) and returns the files' final paths. Other files in `path` are kept, except those of an earlier
    export with the same stem that this one replaces (_replaced); nothing else is ever removed."""
    names = [os.path.basename(f) for f in files]
    index = f"{stem}.safetensors.index.json"
    commit = index if len(names) > 1 else names[0]
    written = set(os.listdir(stage))
    after = sorted(written - set(names) - {index})  # config.json: right after the weights it describes
    try:
        publish(stage, path, names if len(names) > 1 else [], commit, after, _replaced(path, stem, len(names) == 1))
    except BaseException:  # an error half-way (a kill runs nothing: the next write finishes or undoes it)
        with contextlib.suppress(Exception):
            finish_or_undo(stage)
        raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return [os.path.join(path, n) for n in names]


def _replaced(path: str, stem: str, single: bool) -> list[str]:
    """The files of an earlier export into `path` that a new one with the same stem replaces, and that only a writer
    would have written: the shards its index names under the names this writer gives (sink.shard_pattern; a user's
    `model-v1.safetensors` or `model-backup.safetensors` never matches, and a name the index makes up outside the
    folder cannot), then its index where the new export is one file (an old index would be read instead of it),
    and its one file where the new export is sharded (transformers would read that instead of the new index)."""
    if not os.path.isdir(path):
        return []
    out = []
    index = os.path.join(path, f"{stem}.safetensors.index.json")
    if os.path.isfile(index):
        try:
            weight_map = read_json(index, "an index").get("weight_map")
        except (CheckpointFormatError, OSError):
            weight_map = None
        names = set(weight_map.values()) if isinstance(weight_map, dict) else set()
        pattern = shard_pattern(stem)
        out += sorted(n for n in names if isinstance(n, str) and pattern.fullmatch(n)
                      and os.path.isfile(os.path.join(path, n)))
        if single:
            out.append(os.path.basename(index))
    if not single and os.path.isfile(os.path.join(path, f"{stem}.safetensors")):
        out.append(f"{stem}.safetensors")
    return out


def resolve_target(model: nn.Module, fmt: Optional[str], granularity, block_size, prefix, metadata=None) -> WriteTarget:
    src = source_of(model)
    if fmt is None:
        fmt = src.format or "compressed-tensors"
    fmt = canonical_format(fmt)
    dense_dtype = DENSE_FORMATS.get(fmt)
    layout = LAYOUTS.get(fmt)
    if granularity is not None:
        if dense_dtype is not None:
            raise ValueError(f"granularity= applies to fp8 formats, not {fmt}")
        check_scale_kind(granularity)
        if granularity not in layout.write_granularities:
            kinds = ", ".join(GRANULARITY_NAMES[g] for g in layout.write_granularities)
            raise ValueError(f"{fmt} stores {kinds} scales, "
                             f"not {GRANULARITY_NAMES[granularity]} ones")
    same = src.format == fmt
    base = base_model(model)
    if block_size is None:  # one block size for the file (configs have one): the model's, else the source's, else 128
        sizes = Counter(m.block_size for m in base.modules() if isinstance(m, FP8Linear) and m.scale.dim() == 2)
        block_size = sizes.most_common(1)[0][0] if sizes else (src.block_size if same else None)
    strip, add = (src.strip, src.add) if prefix is None else (prefix, "")
    is_diffusers = any(c.__name__ == "ModelMixin" and c.__module__.startswith("diffusers")
                       for c in type(base).__mro__)
    cfg_obj = getattr(base, "config", None)
    if callable(getattr(base, "save_config", None)) and not hasattr(cfg_obj, "to_dict"):
        config_kind = "diffusers"
    elif hasattr(cfg_obj, "to_dict") or src.config:
        config_kind = "transformers"
    else:
        config_kind = None
    meta_out = dict(src.metadata or {}) if same else {"format": "pt"}
    meta_out.update(metadata or {})
    return WriteTarget(fmt, layout, dense_dtype, granularity, block_size or DEFAULT_BLOCK, strip, add, src, same, base,
                   "diffusion_pytorch_model" if is_diffusers else "model", config_kind, meta_out)


def unmerged_adapter_layers(base: nn.Module) -> list[str]:
    tuner_type = tuner_layer_class()
    if tuner_type is None:
        return []
    return [n for n, m in base.named_modules()
            if isinstance(m, tuner_type) and not getattr(m, "disable_adapters", False)
            and any(a not in m.merged_adapters for a in m.active_adapters)]


def save_pretrained_state(model: nn.Module) -> tuple[dict, dict, ExportReport]:
    """(state dict, quantization_config, report) for transformers' save_pretrained of a model holding dorafp8 fp8
    layers (save_hooks.py hands them to it): the fp8 layers in a layout transformers and vLLM read on their
    own, keeping every layer's bytes and scales. fine-grained if the model was loaded from it and every layer still
    fits it as is (per-tensor, or blocks of its size), else compressed-tensors (per-tensor, per-row and block scales,
    any mix). Raises ValueError naming the fix where no such layout can hold the model: unmerged PEFT adapters (they
    would be dropped), fp8 conv layers, blocks that do not divide a layer."""
    base = base_model(model)
    unmerged = unmerged_adapter_layers(base)
    if unmerged:
        raise ValueError(f"{type(base).__name__}.save_pretrained: {len(unmerged)} layers carry PEFT adapters that are "
                         f"not merged (e.g. {unmerged[0]!r}); the checkpoint would hold the base without them. Merge "
                         f"them first (model = peft_model.merge_and_unload()), write a merged checkpoint with "
                         f"dorafp8.export_merged(peft_model, path), or save the adapter alone with the PeftModel's "
                         f"save_pretrained")
    t = resolve_target(model, "fine-grained", None, None, "")
    layers = fp8_modules(t.base).values()
    if not (t.same and all(isinstance(m, FP8Linear) and (scale_kind(m.scale) == "tensor" or (
            scale_kind(m.scale) == "block" and m.block_size == t.block_size)) for m in layers)
            and transformers_problem(t, "") is None):
        t = resolve_target(model, "compressed-tensors", None, None, "")
    problem = transformers_problem(t, "Write it with dorafp8.save_fp8_checkpoint(model, 'path.safetensors')")
    if problem:
        raise ValueError(f"{type(base).__name__}.save_pretrained cannot write this fp8 model in a layout transformers "
                         f"reads: {problem}")
    sink = TensorSink()
    report = ExportReport(t.fmt, "save_pretrained")
    out = emit(t, sink, report, merge=False, adapter_names=None)
    report.tensors, report.bytes = sink.count, sink.total
    return sink.cur, quantization_config(t, report, out), report
