"""Where the files of the checkpoint a from_pretrained call loads are, a local folder or a hub id found as transformers
finds it (huggingface_hub's cache), and whether it is a ModelOpt export, which `dorafp8 run` hands to
load_fp8_checkpoint (dorafp8/launcher.py): transformers has no ModelOpt quantizer."""

from __future__ import annotations

import os

from .files import index_weight_map, read_json

CONFIG = "a model's config.json (a JSON object)"


class NotCached(OSError):
    """A file of a hub checkpoint that is neither in the Hugging Face cache nor fetchable (offline, no connection)."""


def checkpoint_files(path, kwargs):
    """fetch(name): the local path of file `name` of the checkpoint from_pretrained(path, **kwargs) loads, None where
    it has none; raises NotCached where that cannot be told. `path` is a local folder or a hub id, resolved as
    transformers resolves it (subfolder=, and for a hub id revision=, cache_dir=, token=, local_files_only= and
    HF_HUB_OFFLINE through huggingface_hub, into its cache). None if `path` is neither (transformers says why)."""
    if not isinstance(path, (str, os.PathLike)):
        return None
    path, sub = os.fspath(path), kwargs.get("subfolder") or ""
    if os.path.isdir(path):
        def local(name, latest=False):
            f = os.path.join(path, sub, name)
            return f if os.path.isfile(f) else None
        return local
    if os.path.exists(path) or not isinstance(path, str):  # a file (a single .safetensors, a GGUF): not a hub id
        return None
    import huggingface_hub as hf
    from huggingface_hub.utils import EntryNotFoundError, LocalEntryNotFoundError

    where = {"cache_dir": kwargs.get("cache_dir"), "revision": kwargs.get("revision")}
    how = {"subfolder": sub or None, "token": kwargs.get("token", kwargs.get("use_auth_token")),
           "local_files_only": bool(kwargs.get("local_files_only")), **where}

    def fetch(name, latest=False):
        # What the cache knows of the revision first (a file it holds, or one the hub said it has not: .no_exist)
        # costs no request; right once config.json, asked for with latest=True as transformers asks, updated refs/.
        known = None if latest else hf.try_to_load_from_cache(path, f"{sub}/{name}" if sub else name, **where)
        if isinstance(known, str):
            return known
        if known is hf._CACHED_NO_EXIST:
            return None
        try:
            return hf.hf_hub_download(path, name, **how)
        except LocalEntryNotFoundError as e:  # offline, local_files_only, no connection: and not in the cache
            raise NotCached(f"{name} of {path!r} (revision={where['revision'] or 'main'!r}"
                            + (f", subfolder={sub!r}" if sub else "") + ") is not in the Hugging Face cache and "
                            f"cannot be fetched (HF_HUB_OFFLINE=1, local_files_only=True, or no connection)") from e
        except EntryNotFoundError:  # the hub has no such file
            return None
    return fetch


def modelopt_export(path, kwargs=None) -> tuple[str, str] | None:
    """(quant_algo, folder) of a ModelOpt export from_pretrained(path, **kwargs) loads, a local folder or a hub id
    (checkpoint_files): quant_algo ("NVFP4", "MXFP8", "FP8", "MIXED_PRECISION", ...) as source.modelopt_algo reads
    it; folder: the local one holding its files. Else None. Every one goes to load_fp8_checkpoint: transformers has
    no ModelOpt quantizer ("Unknown quantization type ... we will skip the quantization"), and loads an FP8 export's
    e4m3 weights as values without their scales (x 1 / scale, silently; only 'UNEXPECTED weight_scale' notes);
    load_fp8_checkpoint refuses, naming it, what it cannot read. An hf_quant_config.json that is not a JSON object
    is refused (CheckpointFormatError), and so is a hub checkpoint whose files cannot be told (offline, not in the
    cache) that may be an export (_not_cached)."""
    kwargs = kwargs or {}
    fetch = checkpoint_files(path, kwargs)
    if fetch is None or kwargs.get("gguf_file"):  # transformers reads that GGUF file (its config too), nothing else
        return None
    try:
        config = fetch("config.json", latest=True)  # as transformers asks for it (a hub id's refs/ updated)
    except (NotCached, OSError, ValueError):  # transformers cannot load it either, and says why
        return None
    try:
        hq = fetch("hf_quant_config.json")
    except NotCached:
        hq = _not_cached(path, kwargs, fetch, config)
    from .source import modelopt_algo

    # an hf_quant_config.json that cannot be read is refused, naming it: transformers would load codes without scales
    hq_config = read_json(hq, "ModelOpt's quantization config (a JSON object)") if hq is not None else None
    try:  # config.json may be missing where config= is given: hf_quant_config.json alone says. read_json: a FIFO
        algo = modelopt_algo(hq_config, read_json(config, CONFIG) if config else None)  # planted there blocked open()
    except (OSError, TypeError, ValueError, AttributeError):  # transformers cannot load it either, and says why
        return None
    return (algo, os.path.dirname(hq or config)) if algo else None


def adapter_base(path, kwargs) -> str | None:
    """The base_model_name_or_path of a PEFT adapter from_pretrained(path, **kwargs) loads its base model from, as
    transformers reads it (with peft installed: an adapter_config.json, unless `path` is a local folder with a
    config.json of its own), else None."""
    import importlib.util

    fetch = checkpoint_files(path, kwargs)
    if fetch is None or importlib.util.find_spec("peft") is None:
        return None
    if os.path.isdir(os.fspath(path)) and os.path.exists(os.path.join(os.fspath(path), "config.json")):
        return None
    try:
        found = fetch("adapter_config.json")
        base = read_json(found, "a PEFT adapter_config.json (a JSON object)").get("base_model_name_or_path") \
            if found else None
    except (NotCached, OSError, ValueError, AttributeError):
        return None
    return base if isinstance(base, str) and base else None


def _not_cached(path, kwargs, fetch, config) -> None:
    """hf_quant_config.json of hub checkpoint `path` is not in the cache and cannot be fetched: None (not an export)
    where its config.json has a quantization_config (transformers' quantizer, or a ModelOpt one read from it) or its
    cached weights hold no codes with scales (_scaled_codes), as a dense model's; else refused: transformers would load
    the e4m3 codes of a ModelOpt FP8 export without their scales."""
    try:
        if read_json(config, CONFIG).get("quantization_config"):
            return None
        if not _scaled_codes(fetch):
            return None
    except (OSError, TypeError, ValueError, AttributeError):  # nor weights to read: transformers fails, saying why
        return None
    rev, sub = kwargs.get("revision") or "main", kwargs.get("subfolder") or ""
    raise OSError(
        f"from_pretrained({os.fspath(path)!r}, revision={rev!r}"
        + (f", subfolder={sub!r}" if sub else "")
        + f"): its cached weights are fp8 codes with scales (weight_scale) and config.json has no quantization_config, "
          f"as a ModelOpt export, but its hf_quant_config.json (what says how to read them) is not in the Hugging "
          f"Face cache ({kwargs.get('cache_dir') or 'HF_HUB_CACHE'}) and cannot be fetched (HF_HUB_OFFLINE=1, "
          f"local_files_only=True, or no connection). transformers would load the codes as weights without their "
          f"scales; fetch it (`hf download {os.fspath(path)} {sub.strip('/') + '/' if sub else ''}hf_quant_config.json "
          f"--revision {rev}`) or go online")


def _scaled_codes(fetch) -> bool:
    """Whether the cached weights (model.safetensors, else the index and the shard of its first scaled weight) hold a
    `weight` of codes (not F32 / BF16 / F16) beside its `weight_scale`, from the headers alone."""
    from .files import safetensors_keys

    for name in ("model.safetensors", "model.safetensors.index.json"):  # transformers' order
        try:
            found = fetch(name)
            if found is not None and name.endswith(".json"):
                weight_map = index_weight_map(found)
                scaled = next((k[:-len("_scale")] for k in weight_map
                               if str(k).endswith(".weight_scale") and k[:-len("_scale")] in weight_map), None)
                found = fetch(weight_map[scaled]) if scaled is not None else None
        except NotCached:
            continue
        if found is not None:
            keys = safetensors_keys(found, found)[1]
            return any(k.endswith(".weight_scale") and keys.get(k[:-len("_scale")], ("F32",))[0]
                       not in ("F32", "F16", "BF16") for k in keys)
    return False


def fetch_weights(path, kwargs) -> None:
    """The weight files of hub checkpoint `path` into the cache, as from_pretrained would fetch them: model.safetensors,
    else the shards its index names (load_fp8_checkpoint then reads the snapshot folder, refusing what is missing).
    Offline, a file the cache knows nothing of (a snapshot `hf download` made records no .no_exist) is no answer."""
    if os.path.isdir(os.fspath(path)):
        return
    fetch = checkpoint_files(path, kwargs)
    unknown = None
    for name in ("model.safetensors", "model.safetensors.index.json"):
        try:
            found = fetch(name)
        except NotCached as e:
            unknown = unknown or e
            continue
        if found is not None and name.endswith(".json"):
            for shard in sorted(set(index_weight_map(found).values())):
                fetch(shard)
        if found is not None:
            return
    if unknown is not None:
        raise unknown
