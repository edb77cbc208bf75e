"""save_pretrained of a transformers or diffusers model that holds dorafp8 fp8 layers (left alone, its checkpoint
loads wrong): transformers' writes them as compressed-tensors or fine-grained FP8, which transformers and vLLM read;
diffusers', which has no layout for scaled fp8 weights, refuses, naming dorafp8's writers."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import warnings

import torch
from torch import nn

from .._env import ThreadSwitch
from .configs import DIFFUSERS_LOAD_HINT
from .files import identity, loaded_from, weight_files
from .modules import fp8_modules
from .write import save_pretrained_state


@contextlib.contextmanager
def _config_says(model: nn.Module, quantization_config: dict):
    """config.quantization_config = the written layout's, for the save only (hf_quantizer hidden too)."""
    cfg = model.config
    had = hasattr(cfg, "quantization_config")
    old = getattr(cfg, "quantization_config", None)
    quantizer = getattr(model, "hf_quantizer", None)
    cfg.quantization_config = quantization_config
    if quantizer is not None:
        model.hf_quantizer = None
    try:
        yield
    finally:
        if had:
            cfg.quantization_config = old
        else:
            del cfg.quantization_config
        if quantizer is not None:
            model.hf_quantizer = quantizer


def _refuse_originals(model: nn.Module, folder) -> None:
    """Refuses a save_pretrained into a folder holding a file the model was loaded from (write.originals), as
    dorafp8's writers refuse (write.refuse_original): transformers would overwrite it (model.safetensors,
    model.<variant>.safetensors with variant=), delete it (`model*-<5 digits>-of-<5 digits>.safetensors`, before it
    writes the new ones), or leave it beside a config.json that now says the weights are fp8 (a variant= the save
    does not write: model.fp16.safetensors then loads as compressed-tensors, its original config gone)."""
    from .write import originals

    if not isinstance(folder, (str, os.PathLike)) or not os.path.isdir(folder):
        return
    files = originals(model)
    for name in sorted(os.listdir(folder)) if files else ():
        orig = loaded_from(os.path.join(folder, name), files)
        if orig is not None:
            raise FileExistsError(f"save_directory={os.fspath(folder)!r} holds {name!r}, which is the file the "
                                  f"model was loaded from ({orig!r}): save_pretrained there would overwrite or delete "
                                  f"it, or replace the config.json it loads with, and the original weights would be "
                                  f"gone; save to another folder")


def _model_holding(model: nn.Module, state_dict: dict) -> nn.Module:
    """A copy of `model`'s module tree (modules shallow-copied, `model` unchanged) whose parameters and persistent
    buffers are `state_dict`'s tensors, each checked against the model's own dtype and whole shape (FSDP2 shards,
    ZeRO-3 partitions): what save_pretrained(state_dict=...) writes. Missing or unexpected keys: ValueError."""
    taken, memo, bad = {}, {}, []
    fsdp = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)

    def take(key, t):
        if id(t) not in taken:
            v = state_dict.get(key)
            shape = tuple(getattr(t, "ds_shape", t.shape))
            if not isinstance(v, torch.Tensor) or v.dtype != t.dtype or tuple(v.shape) != shape:
                got = "missing" if v is None else f"{getattr(v, 'dtype', type(v).__name__)} {tuple(v.shape)}"
                bad.append(f"{key!r} ({got}, expected {t.dtype} {shape})")
            taken[id(t)] = v
        taken.setdefault(key, True)
        return taken[id(t)]

    def clone(mod, prefix):
        if id(mod) in memo:
            return memo[id(mod)]
        cls = type(mod)
        if fsdp is not None and issubclass(cls, fsdp):  # fully_shard's FSDP<cls>: cls again, as the writers tell
            cls = cls.__mro__[cls._orig_cls_mro_index]  # a plain module (emit.walk_model tells nn.Linear by isinstance)
        new = memo[id(mod)] = object.__new__(cls)  # not copy.copy: FSDP2's class __new__ calls __init__
        new.__dict__.update(mod.__dict__)
        new._parameters = {n: None if p is None else take(prefix + n, p) for n, p in mod._parameters.items()}
        new._buffers = {n: b if b is None or n in mod._non_persistent_buffers_set else take(prefix + n, b)
                        for n, b in mod._buffers.items()}
        new._modules = {n: None if c is None else clone(c, f"{prefix}{n}.") for n, c in mod._modules.items()}
        new.__dict__.pop("_is_fsdp_managed_module", None)  # its tensors are whole now
        return new

    out = clone(model, "")
    bad += [f"{k!r} (unexpected)" for k in state_dict if k not in taken]
    if bad:
        raise ValueError(f"{type(model).__name__}.save_pretrained(state_dict=...): the model holds dorafp8 fp8 layers, "
                         f"written from state_dict, which must be the model's whole state dict (model.state_dict() "
                         f"keys, dtypes and unsharded shapes), or be left out; {len(bad)} keys are not: "
                         f"{', '.join(bad[:5])}")
    return out


def _transformers_save_pretrained(orig):
    signature = inspect.signature(orig)

    @functools.wraps(orig)
    def save_pretrained(self, *args, **kwargs):
        fp8 = list(fp8_modules(self))
        # transformers' own PEFT integration (add_adapter / load_adapter) saves the adapter alone: nothing fp8 in it
        if not fp8 or getattr(self, "_hf_peft_config_loaded", False):
            return orig(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        given = bound.arguments.get("state_dict")
        if given is not None and not given:  # the Trainer's ZeRO-3 save without gathered weights: config only
            return orig(*bound.args, **bound.kwargs)
        _refuse_originals(self, bound.arguments.get("save_directory"))
        # the Trainer's save under FSDP FULL_STATE_DICT or ZeRO-3 hands the state dict it gathered from the shards
        state_dict, quantization_config, report = save_pretrained_state(
            self if given is None else _model_holding(self, given))
        requantized = report.errors("requantized")
        if requantized:
            worst = max(requantized.items(), key=lambda kv: kv[1])
            warnings.warn(f"save_pretrained: {len(requantized)} fp8 layers do not fit {report.format} as they are "
                          f"and were re-quantized (worst relative error {worst[1]:.2e}, {worst[0]}); "
                          f"dorafp8.save_fp8_checkpoint(model, path, format=...) chooses the layout", stacklevel=2)
        bound.arguments["state_dict"] = state_dict
        with _config_says(self, quantization_config):
            return orig(*bound.args, **bound.kwargs)

    save_pretrained._dorafp8 = True
    return save_pretrained


def _diffusers_save_pretrained(orig):
    @functools.wraps(orig)
    def save_pretrained(self, *args, **kwargs):
        fp8 = list(fp8_modules(self))
        if fp8:
            raise ValueError(f"{type(self).__name__}.save_pretrained: the model holds {len(fp8)} dorafp8 fp8 layers "
                             f"(e.g. {fp8[0]!r}); diffusers would write their raw e4m3 values, which its "
                             f"from_pretrained loads without their scales, and diffusers reads no fp8 layout that "
                             f"holds them. Save with dorafp8.save_fp8_checkpoint(model, path) (to load it back, "
                             f"{DIFFUSERS_LOAD_HINT}), or write a dense checkpoint diffusers loads with "
                             f"dorafp8.export_merged(model, path, format='bf16')")
        return orig(self, *args, **kwargs)

    save_pretrained._dorafp8 = True
    return save_pretrained


def _wrap(cls, make) -> None:
    if not getattr(cls.save_pretrained, "_dorafp8", False):  # idempotent: install() may run again
        cls.save_pretrained = make(cls.save_pretrained)


def _record_checkpoint_files(orig):
    """HfQuantizer.preprocess_model, which from_pretrained hands the files it reads: their files.identity()s kept on
    the model, for from_transformers_fp8 (write.refuse_original: subfolder= and Hub downloads too, which the config's
    _name_or_path does not name)."""
    @functools.wraps(orig)
    def preprocess_model(self, model, *args, **kwargs):
        files = kwargs.get("checkpoint_files")
        if files:
            model.__dict__[LOADED_ATTR] = tuple(filter(None, (identity(f) for f in files if isinstance(f, str))))
        return orig(self, model, *args, **kwargs)

    preprocess_model._dorafp8 = True
    return preprocess_model


LOADED_ATTR = "_dorafp8_checkpoint_files"  # files.identity()s of the files from_pretrained read, kept on the model
LOADED_FOLDER_ATTR = "_dorafp8_loaded_folder"  # the absolute local folder it read them from (None: the Hub)


# dorafp8 run's (launcher.install), by the class whose from_pretrained it watches ("PreTrainedModel", "ModelMixin"):
# (load(cls, args, kwargs) -> the model, or None for the class's own load; loaded(model)), for the outermost load only
LOAD_HOOKS: dict = {}
_LOADING = ThreadSwitch()  # a from_pretrained open in this thread


def _record_loaded_folder(orig, owner: str):
    """transformers' and diffusers' from_pretrained (a classmethod's function): the local folder it reads, `subfolder=`
    joined, made absolute now, and its weight files' identities, kept on the model (write.originals), also without a
    quantization config (the quantizer hook above does not run then): the config's _name_or_path names the root
    without the subfolder, and a relative one, read at save time after an os.chdir, named another folder (or none).
    Then, for the outermost load (a model loading sub-models is one load), LOAD_HOOKS[owner]."""
    @functools.wraps(orig)
    def from_pretrained(cls, *args, **kwargs):
        load, loaded = (None, None) if _LOADING else LOAD_HOOKS.get(owner, (None, None))
        with _LOADING.on():
            out = load(cls, args, kwargs) if load else None
            if out is None:
                out = orig(cls, *args, **kwargs)
                _record(out[0] if isinstance(out, tuple) else out, args, kwargs)  # output_loading_info=True
        if loaded:
            loaded(out[0] if isinstance(out, tuple) else out)
        return out

    from_pretrained._dorafp8 = True
    return from_pretrained


def _record(model, args, kwargs) -> None:
    if isinstance(model, nn.Module) and LOADED_FOLDER_ATTR not in model.__dict__:
        # transformers' name_or_path: the base model it loaded, also where the path given is a PEFT adapter's
        # folder (whose adapter_config.json names the base), whose weights are not the model's
        where = getattr(model, "name_or_path", None) or (args[0] if args else
                                                         kwargs.get("pretrained_model_name_or_path"))
        sub = kwargs.get("subfolder") or ""
        folder = None
        if isinstance(where, (str, os.PathLike)) and isinstance(sub, (str, os.PathLike)) and \
                os.path.isdir(os.path.join(where, sub)):  # else a Hub id: nothing of the user's to keep
            folder = os.path.abspath(os.path.join(where, sub))
        model.__dict__[LOADED_FOLDER_ATTR] = folder
        # the quantizer hook's, the files it read, where it ran
        model.__dict__.setdefault(LOADED_ATTR, weight_files(folder))


def _wrap_from_pretrained(cls) -> None:
    method = cls.__dict__.get("from_pretrained")
    if isinstance(method, classmethod) and not getattr(method.__func__, "_dorafp8", False):
        cls.from_pretrained = classmethod(_record_loaded_folder(method.__func__, cls.__name__))


def patch_transformers() -> None:
    from transformers.modeling_utils import PreTrainedModel
    from transformers.quantizers.base import HfQuantizer  # from transformers 4.37 on; pyproject requires 4.50

    _wrap(PreTrainedModel, _transformers_save_pretrained)
    _wrap_from_pretrained(PreTrainedModel)
    if callable(getattr(HfQuantizer, "preprocess_model", None)) and \
            not getattr(HfQuantizer.preprocess_model, "_dorafp8", False):
        HfQuantizer.preprocess_model = _record_checkpoint_files(HfQuantizer.preprocess_model)


class _DiffusersDoRAFP8Checkpoint:
    """diffusers' quantizer for quant_method 'dorafp8' (configs.diffusers_guard): says how to load it."""

    @classmethod
    def from_dict(cls, config: dict, *args, **kwargs):
        raise ValueError(f"this diffusers checkpoint holds fp8 weights in the {config.get('layout')!r} layout, "
                         f"written by dorafp8; diffusers' from_pretrained cannot read their scales. Load it with "
                         f"dorafp8: {DIFFUSERS_LOAD_HINT}")


def patch_diffusers() -> None:
    from diffusers.models.modeling_utils import ModelMixin

    _wrap(ModelMixin, _diffusers_save_pretrained)
    _wrap_from_pretrained(ModelMixin)
    try:  # diffusers has no public registry: its own "Unknown quantization type" error stands where this is missing
        from diffusers.quantizers import auto
    except ImportError:
        return
    mapping = getattr(auto, "AUTO_QUANTIZATION_CONFIG_MAPPING", None)
    if isinstance(mapping, dict):
        mapping.setdefault("dorafp8", _DiffusersDoRAFP8Checkpoint)
