"""save_fp8_checkpoint and export_merged (a file or a folder), and the state dict for transformers' save_pretrained:
the target checked first, the tensors emitted (emit.py) into a ShardWriter or TensorSink, then config.json."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import stat
import time
import warnings
from collections import Counter
from typing import Optional

from torch import nn

from ..nn import FP8Linear, refuse_sharded_model
from ..quant import DEFAULT_BLOCK, MICRO_KINDS, check_scale_kind, scale_kind
from .configs import (check_destination, file_metadata, quantization_config, transformers_problem, write_config,
                      writes_block)
from .emit import emit
from .files import (CHECKED_JSON, LOCK_FILE, destination, export_metadata, fsync_dir, fsync_file, killed_stages,
                    loaded_from, locked, names_a_file, previous_export, refuse_shadowing, replace, sha256, sha256_key,
                    staging, weight_files, write_error)
from .layouts import ALIASES, DENSE_FORMATS, FORMATS, GRANULARITY_NAMES, LAYOUTS, canonical_format
from .modules import base_model, fp8_modules, tuner_layer_class
from .plan import WriteTarget, source_of
from .reports import ExportReport
from .sink import ShardWriter, TensorSink, parse_size, shard_names, shard_pattern
from .source import BLOCK_SIZE_KEY, INDEX_NAMES, SINGLE_NAMES

logger = logging.getLogger("dorafp8")


def save_fp8_checkpoint(model: nn.Module, path, format: Optional[str] = None, *, granularity: Optional[str] = None,
                        block_size: Optional[int] = None, max_shard_size="5GB", prefix: Optional[str] = None,
                        metadata: Optional[dict] = None, verbose: bool = True) -> ExportReport:
    """Writes the model's weights as they are, fp8 layers in `format`; adapters are neither merged (see export_merged)
    nor written. Each fp8 layer keeps its bytes and scale where the layout can hold them (a model loaded and saved in
    the same format gives back the same tensors); anything else is re-quantized from the fp32 weight and reported.

    Args:
        model: a model with dorafp8 fp8 layers (a PeftModel too: its base is written).
        path: a folder (model.safetensors or shards + index, and config.json for a transformers model) or a
            .safetensors file.
        format: one of FORMATS, or modelopt for a model whose fp8 layers are all NVFP4 or all MXFP8 (ModelOpt's
            layout: each layer kept as loaded, or re-quantized by its own recipe where export_merged merges it);
            default: the layout the model was loaded from, else compressed-tensors.
        granularity: "tensor", "row" or "block": the scale of re-quantized layers, where the layout allows it.
        block_size: b for block scales (default 128).
        max_shard_size: the largest shard, as transformers spells it ("5GB").
        prefix: put in front of every key (e.g. ComfyUI's "model.diffusion_model."); default: the prefix the
            checkpoint the model was loaded from had (none for any other model).
        metadata: extra safetensors metadata.
        verbose: print the report.

    Returns:
        An ExportReport.

    Raises:
        ValueError: a layout that cannot hold this model (NVFP4 / MXFP8 layers in an fp8 layout, fp8 ones or both
            kinds in modelopt, a granularity the layout does not store); CheckpointFormatError (a ValueError) for an
            unknown format.
        IsADirectoryError, NotADirectoryError, FileExistsError: a path that is not what its name says, or a folder
            holding a checkpoint of another kind; nothing is written then.
    """
    return _write(model, path, format, merge=False, adapter_names=None, granularity=granularity,
                  block_size=block_size, max_shard_size=max_shard_size, prefix=prefix, metadata=metadata,
                  verbose=verbose)


def export_merged(model: nn.Module, path, format: Optional[str] = None, *, adapter_names=None,
                  granularity: Optional[str] = None, block_size: Optional[int] = None, max_shard_size="5GB",
                  prefix: Optional[str] = None, metadata: Optional[dict] = None, verbose: bool = True) -> ExportReport:
    """Merges each layer's DoRA (or LoRA) adapters into its fp8 base and writes a checkpoint to deploy: merged row j is
    m_j / max(||V_j||, NORM_EPS) * V_j with V = W0 + s B A, in fp32 row blocks (merge.py), several adapters in
    sequence as PEFT merges them. Layers without adapters keep their bytes. The model itself is not changed.

    Args:
        model: a PeftModel (or a model with PEFT's LoRA layers) on dorafp8 fp8 layers.
        path: a folder or a .safetensors file, as for save_fp8_checkpoint.
        format: compressed-tensors (default unless the model was loaded from another layout; one scale per row,
            which loses least), comfyui / comfyui-quant (per tensor, what ComfyUI reads; a diffusers model's
            .safetensors file refused: ComfyUI converts its key names dropping the scales), fine-grained (per
            128 x 128 block, or block_size), dorafp8; or dense: bf16, fp16, fp32. A model on NVFP4 / MXFP8
            layers: modelopt (the default for one loaded from it; merged layers re-quantized by the NVFP4 / MXFP8
            recipe of dorafp8/quant.py, the layer's kind) or dense.
        adapter_names: the adapters to merge; default: the active ones.
        granularity: "row", "tensor" or "block": the scale of the merged layers, where the layout allows it.
        block_size, max_shard_size, prefix, metadata, verbose: as for save_fp8_checkpoint.

    Returns:
        An ExportReport with the merge error of every layer, ||written - merged||_F / ||merged||_F against the merged
        weight evaluated in fp32 from the unmerged adapters (the weight the trained model computes with), and its
        worst and mean (printed with verbose).

    Raises:
        ValueError, IsADirectoryError, NotADirectoryError, FileExistsError: as save_fp8_checkpoint.
    """
    return _write(model, path, format, merge=True, adapter_names=adapter_names, granularity=granularity,
                  block_size=block_size, max_shard_size=max_shard_size, prefix=prefix, metadata=metadata,
                  verbose=verbose)


def _write(model: nn.Module, path, fmt: Optional[str], *, merge: bool, adapter_names, granularity, block_size,
           max_shard_size, prefix, metadata, verbose) -> ExportReport:
    from .._deps import require

    require("safetensors", what="writing fp8 checkpoints")
    t0 = time.time()
    path = os.fspath(path)
    max_bytes = parse_size(max_shard_size)  # every argument is checked before anything is written
    t = resolve_target(model, fmt, granularity, block_size, prefix, metadata)
    check_destination(t, path, defaulted=fmt is None)
    real = destination(path)
    orig = originals(model)
    report, emit_args = ExportReport(t.fmt, path), dict(merge=merge, adapter_names=adapter_names)
    if names_a_file(path):  # one file, written whole or not at all (files.save_file_atomic)
        if os.path.isdir(real):
            raise IsADirectoryError(f"path={path!r} is a folder; a path ending in .safetensors is written as one file")
        refuse_original(path, orig)
        writer = ShardWriter(os.path.join(os.getcwd(), path), t.stem, max_bytes, t.metadata)  # not moved by chdir
        with _made(os.path.dirname(real)):
            out = emit(t, writer, report, **emit_args)
            writer.close()
        report.files = [path]
    else:
        writer = ShardWriter("", t.stem, max_bytes, t.metadata)  # its folder: the stage, below
        out = _write_folder(t, path, real, writer, report, emit_args, orig)
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


def _write_folder(t: WriteTarget, path: str, real: str, writer: ShardWriter, report: ExportReport, emit_args: dict,
                  orig: tuple):
    """A folder checkpoint: written into a stage in `real`, then published under its lock (_publish); `orig`: the
    files the model was loaded from (originals)."""
    if os.path.lexists(real) and not os.path.isdir(real):
        raise NotADirectoryError(f"path={path!r} is a file, not a folder (a path ending in .safetensors is written "
                                 f"as one file)")
    _check_folder(real, path, t, orig)
    with _made(real), staging(real, t.stem) as stage:
        writer.path = stage
        out = emit(t, writer, report, **emit_args)
        parts = writer.close()
        try:
            write_config(t, stage, report, out)
        except OSError as e:  # a full disk said so without the path (json.dump, diffusers' save_config)
            raise write_error(os.path.join(path, "config.json" + (" / hf_quant_config.json" if t.fmt == "modelopt"
                                                                   else "")), e) from e
        with locked(real, f"path={path!r}"):
            _check_folder(real, path, t, orig)
            names = _publish(stage, real, t.stem, parts, writer.total, path)
    report.files = [os.path.join(path, n) for n in names]
    return out


@contextlib.contextmanager
def _made(folder: str):
    """`folder` made if missing (with its parents), and removed again, if still empty, when the write fails."""
    made = not os.path.isdir(folder)
    os.makedirs(folder, exist_ok=True)
    try:
        yield
    except BaseException:
        if made:
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        raise


def _check_folder(real: str, path: str, t: WriteTarget, orig: tuple) -> None:
    """Refuses a folder where the export would not be what loads (a `model.safetensors` or
    `diffusion_pytorch_model.safetensors`, or the index of the other of the two), or would load as another layout
    (ModelOpt's hf_quant_config.json beside an export in any other format), or where it would replace an index no
    export wrote."""
    index = f"{t.stem}.safetensors.index.json"
    meta = export_metadata(real, index)  # what the export there recorded ({} where none did)
    records = [meta, *_killed_records(real, t.stem)]
    for rec in records:  # the export this one would replace, its shards removed: not the one the model came from
        for name in rec.get("dorafp8_files") or {}:
            if isinstance(name, str) and shard_pattern(t.stem).fullmatch(name):
                refuse_original(os.path.join(real, name), orig, path)
    # load_fp8_checkpoint reads the first of these a folder holds (source.py), whatever the model's stem (diffusers')
    for other in (*SINGLE_NAMES, *(n for n in INDEX_NAMES if n != index)):
        if os.path.lexists(os.path.join(real, other)):
            raise FileExistsError(f"path={path!r} holds {other!r}, which load_fp8_checkpoint (and transformers or "
                                  f"diffusers) would read instead of this export's {index!r}, so the new export "
                                  f"would not be what loads; it is not a file this writer can prove an export wrote, "
                                  f"so it is not removed: move it away (or delete it), or export to another folder")
    refuse_shadowing(real, index, path)  # pytorch_model.bin there: read no more once the index is beside it
    # the export being replaced wrote it (its index records it): removed with that export (_publish), as its shards are
    if t.fmt != "modelopt" and os.path.lexists(os.path.join(real, "hf_quant_config.json")) and \
            not _recorded(real, "hf_quant_config.json", records):
        raise FileExistsError(f"path={path!r} holds 'hf_quant_config.json' (NVIDIA ModelOpt's quantization config) "
                              f"that the index there does not record (ModelOpt's own, copied in, edited since?): read "
                              f"as the weights' layout, this {t.fmt} export would load as ModelOpt's, or not at all. "
                              f"It is not removed (an export removes only the files of the export it replaces): move "
                              f"it away (or delete it), or export to another folder")
    for name in (index, "config.json"):
        if os.path.isdir(os.path.join(real, name)):
            raise IsADirectoryError(f"path={path!r}: {name!r} there is a folder, where the export writes a file; "
                                    f"move it away, or export to another folder")
    # an index no export wrote (transformers' or diffusers' save_pretrained, another tool's) names that model's shards:
    # replacing it would leave them unindexed, the folder no longer holding that model
    if os.path.lexists(os.path.join(real, index)) and not isinstance(meta.get("dorafp8_files"), dict):
        raise FileExistsError(f"path={path!r} holds {index!r}, which no dorafp8 export wrote (a model saved there by "
                              f"save_pretrained or another tool?); the export would replace it and leave that model's "
                              f"shards unindexed, so it is not overwritten: export to another folder, or move it away")


def originals(model: nn.Module) -> tuple:
    """files.identity()s of the files `model` was loaded from, which no writer replaces (refuse_original): its loader's
    and the local folder's from_pretrained read (save_hooks; as they are now too: a touch must not unprotect a dense
    model's only copy); else (loaded before dorafp8 was imported) the weight files of the folder its config names."""
    files = tuple(source_of(model).files or ())
    # every module's record: a PeftModel's or torch.compile's model is one; so is each model loaded apart and joined
    loaded = [m.__dict__ for m in model.modules()
              if {"_dorafp8_loaded_folder", "_dorafp8_checkpoint_files"} & m.__dict__.keys()]
    for rec in loaded:
        files += (*(rec.get("_dorafp8_checkpoint_files") or ()), *weight_files(rec.get("_dorafp8_loaded_folder")))
    config = getattr(base_model(model), "config", None)
    return tuple(dict.fromkeys(files)) if files or loaded else weight_files(getattr(config, "_name_or_path", None))


def refuse_original(path: str, originals, folder: Optional[str] = None) -> None:
    """Refuses to write over (or remove) `path` where it is a file the model was loaded from (`originals`,
    files.identity()s): its original weights (export_merged's base, which the adapters need) would be gone. folder:
    the export's folder, `path` one of the files it would remove."""
    orig = loaded_from(path, originals)
    if orig is not None:
        what = f"path={folder!r} holds {os.path.basename(path)!r}, which the export would remove" if folder else \
            f"path={path!r}, which the export would replace,"
        raise FileExistsError(f"{what} is the file the model was loaded from ({orig!r}): its original weights would "
                              f"be gone; write to another path (and move the export over the original afterwards if "
                              f"you mean to replace it)")


def _publish(stage: str, folder: str, stem: str, parts: list, total: int, path: str) -> list[str]:
    """Moves the finished export in `stage` into `folder` (whose lock the caller holds); returns its shards' names.
    Shards go in under fresh names, then config.json (if changed), then the index by one rename (the commit), then the
    old shards files.previous_export proves were written are removed: a reader or a kill finds the old export or the
    new. The index records each shard's size and sha256 and those of config.json and hf_quant_config.json, so that
    load_fp8_checkpoint refuses a mixed pair (docs/ARCHITECTURE.md, files.py). A failure before the commit removes
    the shards it moved in; a config.json it may not replace (_check_replaced) is refused before anything moves."""
    index = f"{stem}.safetensors.index.json"
    before = export_metadata(folder, index)  # what the export being replaced recorded
    records = [before, *_killed_records(folder, stem)]
    # the replaced export's files are listed in the new index too, until removed: an export interrupted before it
    # removed them (a kill, an error) leaves them to the next one, which finds them in this index; so are those a
    # killed export moved in before its commit, which its stage's index records
    old = {}
    for rec in records:
        old.update(previous_export(rec, folder, shard_pattern(stem)))
    names = shard_names(stem, len(parts), set(os.listdir(folder)) | set(old))
    others = sorted(set(os.listdir(stage)) - {os.path.basename(tmp) for tmp, _ in parts} - {LOCK_FILE})  # config
    files, weight_map = {}, {}
    for (tmp, keys), name in zip(parts, names):
        staged = os.path.join(stage, name)
        os.replace(tmp, staged)
        fsync_file(staged, os.path.join(path, name))
        files[name] = {"size": os.path.getsize(staged), "sha256": sha256(staged)}
        weight_map.update(dict.fromkeys(keys, name))
    meta = {"total_size": total, "dorafp8_files": {**old, **files}}
    meta.update({sha256_key(n): sha256(os.path.join(stage, n)) for n in CHECKED_JSON if n in others})
    try:
        with open(os.path.join(stage, index), "w") as f:
            json.dump({"metadata": meta, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    except OSError as e:
        raise write_error(os.path.join(path, index), e) from e
    fsync_file(os.path.join(stage, index), os.path.join(path, index))
    for name in others:  # after the hashing (minutes for a large model), so that an edit made meanwhile is seen
        _check_replaced(stage, folder, name, records, path)
    moved, kept = [], []
    try:
        for name in names:
            os.replace(os.path.join(stage, name), os.path.join(folder, name))
            moved.append(name)
        for name in others:
            if not _same_bytes(os.path.join(stage, name), os.path.join(folder, name)):
                _keep(stage, folder, name, kept)
                replace(os.path.join(stage, name), os.path.join(folder, name))
        for name in CHECKED_JSON:  # the replaced export's own that this one does not write (a ModelOpt export's
            # hf_quant_config.json): before the commit, which would leave it beside weights it does not describe
            if name not in others and _recorded(folder, name, records):
                _keep(stage, folder, name, kept)
                os.remove(os.path.join(folder, name))
        fsync_dir(folder)
        replace(os.path.join(stage, index), os.path.join(folder, index))  # the commit
    except BaseException:
        if not os.path.lexists(os.path.join(stage, index)):  # renamed in: the index names them (an interrupt in the
            raise                                            # folder's fsync after the commit)
        for name in moved:
            with contextlib.suppress(OSError):
                os.remove(os.path.join(folder, name))
        # the replaced export's config.json / hf_quant_config.json put back: left replaced (an OSError, a Ctrl-C), the
        # old weights were refused beside the new config, and a next export in another format refused that config
        for name in reversed(kept):
            try:
                os.replace(os.path.join(stage, name + ".replaced"), os.path.join(folder, name))
            except OSError as e:
                warnings.warn(f"{folder}: the replaced export's {name!r} could not be put back ({e.strerror}); "
                              f"export again", stacklevel=4)
        raise
    for name in old:  # the export is published: what cannot be removed now only takes space
        try:
            os.remove(os.path.join(folder, name))
        except FileNotFoundError:
            pass
        except OSError as e:
            warnings.warn(f"{folder}: the replaced export's {name!r} could not be removed ({e.strerror})",
                          stacklevel=4)
    fsync_dir(folder)
    return names


def _keep(stage: str, folder: str, name: str, kept: list) -> None:
    """A copy of `folder/name` (a regular file: _check_replaced, _recorded) kept in the stage as `name.replaced`, so
    that a publish failing before its commit puts the old one back (_publish); a kill leaves it in the stage."""
    if not os.path.lexists(os.path.join(folder, name)):  # nothing to put back
        return
    tmp = os.path.join(stage, name + ".replaced")
    try:
        shutil.copyfile(os.path.join(folder, name), tmp)
    except OSError as e:  # a full disk: copyfile's error names no file
        raise write_error(tmp, e) from e
    kept.append(name)


def _check_replaced(stage: str, folder: str, name: str, records: list, path: str) -> None:
    """Refuses to replace `folder/name` (config.json, hf_quant_config.json) unless an export wrote it (the index of
    the export being replaced, or of one killed while publishing, `records`, has the file's sha256) or it holds the
    new bytes already. A user's own config.json (a project's, their home's), the model's own (an export into the
    folder it was loaded from, a link into the Hugging Face cache) or one edited since the export is not overwritten."""
    dst = os.path.join(folder, name)
    if not os.path.lexists(dst) or _same_bytes(os.path.join(stage, name), dst):
        return
    if not _recorded(folder, name, records):
        raise FileExistsError(f"path={path!r} holds {name!r}, which this export would replace, but no index there "
                              f"records it as an earlier export's (it is someone else's, the model's own, was "
                              f"edited since, or was left by an export that failed before its index), so it is not "
                              f"overwritten: move it away (or delete it), or export to "
                              f"another folder")


def _killed_records(folder: str, stem: str) -> list[dict]:
    """The index metadata in the stages of exports killed while publishing (files.killed_stages: no live writer holds
    them): each wrote the index it was about to commit before it moved its shards, config.json and
    hf_quant_config.json in, so it records what that export left in the folder."""
    index = f"{stem}.safetensors.index.json"
    return [m for m in (export_metadata(s, index) for s in killed_stages(folder, stem)) if m]


def _recorded(folder: str, name: str, records: list) -> bool:
    """Whether `folder/name` is a regular file (not a link) with the sha256 one of `records` (an export's index
    metadata) records for it: a file that export wrote, unchanged since."""
    dst = os.path.join(folder, name)
    want = {m.get(sha256_key(name)) for m in records} - {None}
    try:
        return bool(want) and stat.S_ISREG(os.lstat(dst).st_mode) and sha256(dst) in want
    except OSError:
        return False


def _same_bytes(a: str, b: str) -> bool:
    """Whether the regular file (not a link) `b` holds exactly the bytes of `a`."""
    try:
        if not stat.S_ISREG(os.lstat(b).st_mode) or os.path.getsize(a) != os.path.getsize(b):
            return False
        with open(a, "rb") as fa, open(b, "rb") as fb:
            return fa.read() == fb.read()
    except OSError:
        return False


def _layer_kinds(model: nn.Module) -> dict[str, list[str]]:
    """The model's fp8 layers by scale kind ("tensor", "row", "block", "nvfp4", "mxfp8"; "conv" for fp8 convs)."""
    kinds: dict[str, list[str]] = {}
    for n, m in fp8_modules(base_model(model)).items():
        kinds.setdefault(scale_kind(m.scale) if isinstance(m, FP8Linear) else "conv", []).append(n)
    return kinds


def _held(kinds: dict[str, list[str]]) -> str:
    return " and ".join(f"{len(v)} {k.upper()} layers (e.g. {sorted(v)[0]!r})" for k, v in sorted(kinds.items()))


def _refuse_microscaled(model: nn.Module, fmt: str) -> None:
    """Refuses NVFP4 / MXFP8 layers in an fp8 layout (e4m3, fp32 scales): they go to format='modelopt' or dense."""
    kinds = {k: v for k, v in _layer_kinds(model).items() if k in MICRO_KINDS}
    if kinds:
        raise ValueError(f"the model holds {_held(kinds)}, which format={fmt!r} cannot hold (its layout is e4m3 with "
                         f"fp32 scales): write them in their own format with format='modelopt' (ModelOpt's layout, "
                         f"which load_fp8_checkpoint reads), or dense with format='bf16', 'fp16' or 'fp32' "
                         f"(export_merged merges the adapters in either way)")


def _check_modelopt(model: nn.Module, granularity) -> None:
    """format='modelopt' holds NVFP4 or MXFP8 layers, one quant_algo a file: anything else is refused."""
    if granularity is not None:
        raise ValueError(f"granularity={granularity!r}: format='modelopt' writes each NVFP4 / MXFP8 layer in its own "
                         f"kind; granularity= applies to the fp8 formats")
    kinds = _layer_kinds(model)
    other = {k: v for k, v in kinds.items() if k not in MICRO_KINDS}
    micro = {k: v for k, v in kinds.items() if k in MICRO_KINDS}
    if other:
        raise ValueError(f"the model holds {_held(other)}, which format='modelopt' does not hold (dorafp8 writes "
                         f"ModelOpt's NVFP4 and MXFP8 layers only): write " + (
                             f"a dense format (bf16, fp16, fp32): its {_held(micro)} rule out the fp8 ones" if micro
                             else "an fp8 format (compressed-tensors) or a dense one"))
    if len(micro) != 1:
        raise ValueError(f"format='modelopt' writes a model whose fp8 layers are all NVFP4 or all MXFP8 (one "
                         f"quant_algo a file); this one holds {_held(micro) or 'none'}: write a dense format "
                         f"(bf16, fp16, fp32)" + ("" if micro else " or an fp8 one (compressed-tensors)"))


def resolve_target(model: nn.Module, fmt: Optional[str], granularity, block_size, prefix, metadata=None) -> WriteTarget:
    refuse_sharded_model(model, "writing a checkpoint (save_fp8_checkpoint, export_merged, save_pretrained)")
    src = source_of(model)
    if fmt is None:
        fmt = src.format or "compressed-tensors"
    name = ALIASES.get(str(fmt).lower(), str(fmt).lower())
    if name == "modelopt":  # not in FORMATS: it holds NVFP4 / MXFP8 layers only
        _check_modelopt(model, granularity)
    elif name not in DENSE_FORMATS:
        _refuse_microscaled(model, fmt)  # first: a model loaded from modelopt defaults to it, and is written there
    fmt = canonical_format(fmt, FORMATS + ("modelopt",))
    dense_dtype = DENSE_FORMATS.get(fmt)
    layout = LAYOUTS.get(fmt)
    if granularity is not None:  # (modelopt refused it above)
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
    meta_out = file_metadata(src, fmt, same)
    meta_out.update(metadata or {})
    t = WriteTarget(fmt, layout, dense_dtype, granularity, block_size or DEFAULT_BLOCK, strip, add, src, same, base,
                    "diffusion_pytorch_model" if is_diffusers else "model", config_kind, meta_out)
    if dense_dtype is None and fmt != "modelopt" and any(writes_block(t, m) for m in fp8_modules(base).values()):
        meta_out[BLOCK_SIZE_KEY] = str(t.block_size)  # what the loader reads, not the scale's shape (source.py)
    return t


def unmerged_adapter_layers(base: nn.Module) -> list[str]:
    tuner_type = tuner_layer_class()
    if tuner_type is None:
        return []
    return [n for n, m in base.named_modules()
            if isinstance(m, tuner_type) and not getattr(m, "disable_adapters", False)
            and any(a not in m.merged_adapters for a in m.active_adapters)]


def save_pretrained_state(model: nn.Module) -> tuple[dict, dict, ExportReport]:
    """(state dict, quantization_config, report) for transformers' save_pretrained of a model with dorafp8 fp8 layers
    (save_hooks.py), every layer's bytes and scales kept: fine-grained if the model was loaded from it and every layer
    still fits it, else compressed-tensors. Raises ValueError naming the fix where neither can hold the model
    (unmerged PEFT adapters, fp8 convs, blocks that do not divide a layer)."""
    base = base_model(model)
    unmerged = unmerged_adapter_layers(base)
    if unmerged:
        raise ValueError(f"{type(base).__name__}.save_pretrained: {len(unmerged)} layers carry PEFT adapters that are "
                         f"not merged (e.g. {unmerged[0]!r}); the checkpoint would hold the base without them. Merge "
                         f"them first (model = peft_model.merge_and_unload()), write a merged checkpoint with "
                         f"dorafp8.export_merged(peft_model, path), or save the adapter alone with the PeftModel's "
                         f"save_pretrained")
    micro = {k: v for k, v in _layer_kinds(model).items() if k in MICRO_KINDS}
    if micro:  # (resolve_target's own refusal would name format='fine-grained', which the caller never asked for)
        raise ValueError(f"{type(base).__name__}.save_pretrained: the model holds {_held(micro)}, which dorafp8 writes "
                         f"in ModelOpt's layout, not in one transformers' from_pretrained reads: write them with "
                         f"dorafp8.save_fp8_checkpoint(model, path, format='modelopt') (export_merged(peft_model, "
                         f"path, format='modelopt') merges adapters), which load_fp8_checkpoint reads, or dense with "
                         f"format='bf16', which from_pretrained reads")
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
