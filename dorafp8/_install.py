"""Everything `import dorafp8` changes outside dorafp8, in one place, with one opt-out: DORAFP8_NO_PATCHES=1.

1. DDP over gloo broadcasts fp8 weights as bytes (dorafp8/distributed.py explains why; idempotent).
2. PEFT, transformers, diffusers, LyCORIS and FSDP2 learn about dorafp8 without being imported (below).

With DORAFP8_NO_PATCHES=1 nothing is changed: call dorafp8.register_with_peft(), dorafp8.register_with_lycoris(),
dorafp8.install_ddp_support() and dorafp8.install_fsdp_support() yourself where you need them (save_pretrained of fp8
models is then transformers' own, which loses the scales: quantize_model, load_fp8_checkpoint and
from_transformers_fp8 warn so, naming save_fp8_checkpoint; dorafp8/nn/save_warning.py). PEFT's errors on layers it
does not know name nothing of dorafp8, so until register_with_peft() has run an fp8 layer's repr (which PEFT's "not
supported" error prints) names it, and the first fp8 layer made warns once (for target_modules="all-linear", whose
error cannot): nn/_base.py.

Importing peft, transformers, diffusers, lycoris or FSDP2 takes seconds, so `import dorafp8` must not do it. But each
needs to know about dorafp8's fp8 layers before the user's next line runs, with nothing more imported by the user:

- peft: `quantize_model(model)` then `get_peft_model(model, LoraConfig(use_dora=True, ...))` must build
  DoRAFP8Linear layers (dorafp8.peft.register_with_peft);
- transformers: `save_pretrained` of a model holding fp8 layers must write a checkpoint `from_pretrained` reads
  correctly (before, it wrote raw e4m3 values that loaded without their scales), and `DoRAFP8Config` must be in its
  quantizer registry (dorafp8/checkpoint/save_hooks.py, dorafp8/checkpoint/hf_quantizer.py);
- diffusers: its `save_pretrained` of such a model must refuse, naming dorafp8's writers
  (dorafp8/checkpoint/save_hooks.py), and its `from_single_file` of a ComfyUI fp8_scaled file must refuse instead of
  loading the fp8 weights without their scales (dorafp8/checkpoint/single_file.py);
- LyCORIS (lycoris-lora): `create_lycoris(model, ...)` must put its LoCon / DoRA modules on the fp8 layers (it saw
  none: "No LyCORIS modules were created") and compute them through the fused ops (dorafp8.lycoris);
- FSDP2: MixedPrecisionPolicy(param_dtype=...) must leave the fp8 weights of dorafp8 layers in fp8
  (dorafp8.distributed.install_fsdp_support).
- OneTrainer (its modules.module.LoRAModule, imported from its checkout): its DoRAModule on fp8 linear layers must
  compute through the fused op (dorafp8.onetrainer);
- FSDP1: wrapping a model with fp8 weights must be refused at once, naming FSDP2 (it fails later, deep in its
  flattening, otherwise: dorafp8.distributed.install_fsdp1_refusal).

So for each watched module: if it is already imported when dorafp8 is, its hook runs at once (no import cost: it is
loaded); otherwise a post-import hook on `sys.meta_path` runs it right after that module has finished executing.
transformers and diffusers load their model classes lazily, so the watched modules are the ones that define
PreTrainedModel and ModelMixin, not the packages; for FSDP2, the one that defines FSDPParam (its module differs
between torch releases: dorafp8.distributed.FSDP_PARAM_MODULES names both). Only modules that exist when dorafp8 is
imported are watched (looked up without importing them or their packages, `_exists`; namespace packages included):
the FSDP2 module of another torch release, or a library that is not installed, can never arrive, and waiting for it
kept the finder at sys.meta_path[0], consulted on every import, for the life of the process. The exception is
OneTrainer's module, whose checkout joins sys.path after its scripts start: a path hook (consulted once per folder
new to the import system, not per import) watches it once a folder holding it arrives. OneTrainer imported before
dorafp8 is hooked at once, but adapters it already hooked to their layers keep the forward they bound: a warning
says so, once, and what to do. The finder removes itself once every
watched module has been loaded. A library installed after `import dorafp8` in the same process is not watched: call
dorafp8.register_with_peft() or dorafp8.register_with_lycoris() for it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings

import torch

from ._deps import peft_too_old
from .distributed import (FSDP1_MODULE, FSDP_PARAM_MODULES, install_ddp_support, install_fsdp1_refusal,
                          install_fsdp_support)


def _peft() -> None:
    # Importing dorafp8.peft registers (its __init__ ends with register_with_peft()). When peft itself is being
    # imported by dorafp8.peft, that package is still half-initialised here: it registers when it finishes.
    if peft_too_old() is None:
        from . import peft  # noqa: F401
    else:
        _refuse_fp8_layers_in_old_peft()


def _refuse_fp8_layers_in_old_peft() -> None:
    """On a peft older than dorafp8's layers support, get_peft_model on an fp8 layer fails with PEFT's own error deep
    in its DoRA init ("mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'): refuse it instead, naming the
    peft needed. Everything else PEFT does is left alone."""
    from peft.tuners.lora.model import LoraModel

    from .nn import FP8WeightModule
    from .quant import is_fp8

    orig = LoraModel._create_new_module
    if hasattr(orig, "_dorafp8_orig"):
        return

    def _create_new_module(lora_config, adapter_name, target, **kwargs):
        base = target.get_base_layer() if hasattr(target, "get_base_layer") else target
        weight = getattr(base, "weight", None)
        if isinstance(base, FP8WeightModule) or (getattr(lora_config, "use_dora", False)
                                                 and isinstance(weight, torch.Tensor) and is_fp8(weight)):
            raise RuntimeError(f"{kwargs.get('current_key', type(base).__name__)}: {peft_too_old()}")
        return orig(lora_config, adapter_name, target, **kwargs)

    _create_new_module._dorafp8_orig = orig
    LoraModel._create_new_module = staticmethod(_create_new_module)


def _transformers() -> None:
    from .checkpoint import hf_quantizer, save_hooks

    save_hooks.patch_transformers()
    hf_quantizer.register()


def _diffusers() -> None:
    from .checkpoint import save_hooks

    save_hooks.patch_diffusers()


def _diffusers_single_file() -> None:
    from .checkpoint import single_file

    single_file.patch_from_single_file()


def _lycoris() -> None:
    # Importing dorafp8.lycoris registers (its last line). When lycoris is being imported by dorafp8.lycoris, that
    # module is half-initialised here: it registers when it finishes.
    from . import lycoris  # noqa: F401


def _onetrainer() -> None:
    from .onetrainer import register_with_onetrainer

    register_with_onetrainer()


def _fsdp() -> None:
    install_fsdp_support(import_fsdp=False)  # the watched module has just run: FSDPParam is there


# OneTrainer's module comes from a checkout (namespace packages), which its scripts put on sys.path after they start:
# `import dorafp8` watches it where it can already be found and otherwise looks for it in every folder added to the
# import path later (_LATE); `dorafp8 run`, the route for OneTrainer (docs/TRAINERS.md), waits for it regardless.
ONETRAINER_MODULE = "modules.module.LoRAModule"
# module -> (its hook, what breaks if the hook fails: said in the warning)
_WATCHED = {
    "peft": (_peft, "get_peft_model will not build DoRAFP8Linear layers"),
    "transformers.modeling_utils": (_transformers, "save_pretrained of fp8 models writes unscaled e4m3 weights, and "
                                                   "DoRAFP8Config is not registered"),
    "diffusers.models.modeling_utils": (_diffusers, "save_pretrained of fp8 models writes unscaled e4m3 weights"),
    "diffusers.loaders.single_file_model": (_diffusers_single_file, "diffusers' from_single_file loads ComfyUI "
                                                                    "fp8_scaled files without their scales"),
    "lycoris": (_lycoris, "create_lycoris makes no LyCORIS module for dorafp8's fp8 layers (call "
                          "dorafp8.register_with_lycoris() after fixing the cause)"),
    ONETRAINER_MODULE: (_onetrainer, "OneTrainer's DoRA on fp8 layers computes its own dense fp32 "
                                               "weight (dorafp8.onetrainer)"),
    FSDP1_MODULE: (install_fsdp1_refusal, "FSDP1 fails on fp8 layers with 'Must flatten tensors with uniform dtype' "
                                          "instead of naming FSDP2"),
    **{name: (_fsdp, ("FSDP2's MixedPrecisionPolicy(param_dtype=...) casts the fp8 weights for the all-gather (the "
                      "forward casts them back, with a warning)")) for name in FSDP_PARAM_MODULES},
}
_pending: set = set()


def _run(name: str) -> None:
    hook, consequence = _WATCHED[name]
    try:
        hook()
    except Exception as e:  # never break the user's import because of dorafp8
        warnings.warn(f"dorafp8 could not hook into {name} ({type(e).__name__}: {e}); {consequence}",
                      RuntimeWarning, stacklevel=3)


class _RunAfterExec(importlib.abc.Loader):
    """Wraps the real loader of a watched module: executes the module, then runs its hook."""

    def __init__(self, loader, name: str):
        self._loader = loader
        self._name = name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _pending.discard(self._name)
        if not _pending:
            uninstall()  # everything watched is loaded
        _run(self._name)

    def __getattr__(self, name):  # get_resource_reader, is_package, get_source, ... of the real loader
        return getattr(self._loader, name)


class _ImportHook(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _pending:
            return None
        # Ask the other finders for the real spec (without this hook, so it cannot recurse), then wrap its loader.
        # The hook stays installed until that loader has run: a bare importlib.util.find_spec("peft") -- diffusers
        # and transformers probe optional packages that way before importing them -- only looks, and the import
        # that follows must find the hook again (it used to be gone by then, and PEFT never learnt of FP8Linear).
        uninstall()
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            install_finder()
        if spec is None or spec.loader is None:
            return None
        spec.loader = _RunAfterExec(spec.loader, fullname)
        return spec


_HOOK = _ImportHook()


def uninstall() -> None:
    while _HOOK in sys.meta_path:
        sys.meta_path.remove(_HOOK)


def install_finder() -> None:
    if _pending and _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)


def install() -> None:
    """What `import dorafp8` does outside dorafp8 (the module docstring), unless DORAFP8_NO_PATCHES=1. Idempotent."""
    if os.environ.get("DORAFP8_NO_PATCHES") == "1":
        return
    install_ddp_support()
    watch_imports()


def _exists(name: str) -> bool:
    """Whether module `name` is there to import, found without importing it or the packages above it
    (importlib.util.find_spec("a.b.c") imports a.b: torch.distributed.fsdp's package, transformers). Below the
    top-level name the package folders are searched as files: importlib's own search of a namespace package's child
    (OneTrainer's `modules/`, which has no __init__.py) needs the parent imported (a KeyError otherwise)."""
    top, *rest = name.split(".")
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: nothing is imported
        locations = None if spec is None or spec.submodule_search_locations is None else list(
            spec.submodule_search_locations)
    except (ImportError, ValueError):  # ValueError: a module in sys.modules without __spec__
        return False
    if spec is None:
        return False
    return not rest or (locations is not None and any(_in_folder(d, rest) for d in locations))


def _in_folder(folder, parts: list) -> bool:
    """Whether module parts[0].parts[1]... is in `folder` (a sys.path entry or a package's folder): packages as
    folders (regular or namespace), the last part a folder or a module file of any suffix importlib loads."""
    if not isinstance(folder, str):
        return False
    path = os.path.join(folder, *parts)
    if os.path.isdir(path) and len(parts) > 0:
        return True
    return os.path.isdir(os.path.dirname(path)) and any(os.path.isfile(path + suffix)
                                                        for suffix in importlib.machinery.all_suffixes())


# Watched modules not found when dorafp8 was imported, that may arrive with a folder put on sys.path later: OneTrainer's
# scripts put their checkout there after they start. A path hook is consulted once per folder new to the import system
# (not per import); it looks in each for these modules and, finding one, watches it. It declines every folder.
_LATE = {ONETRAINER_MODULE}
_late: set = set()


def _path_hook(folder):
    for name in [n for n in _late if _in_folder(folder, n.split("."))]:
        _late.discard(name)
        if sys.modules.get(name) is None:
            _pending.add(name)
            install_finder()
    if not _late:
        _remove_path_hook()
    raise ImportError("dorafp8 only looks")  # not a finder for this folder: the next hook's


def _remove_path_hook() -> None:
    while _path_hook in sys.path_hooks:
        sys.path_hooks.remove(_path_hook)


def watch_imports() -> None:
    """Runs the hook of every watched module that is loaded, and watches for the others that exist here, or (_LATE)
    may arrive with a folder added to sys.path. Idempotent (each hook is)."""
    for name in _WATCHED:
        if sys.modules.get(name) is not None:
            _pending.discard(name)
            _late.discard(name)
            if name in _LATE:
                _warn_imported_first(name)
            _run(name)
        elif _exists(name):
            _pending.add(name)
        elif name in _LATE:
            _late.add(name)
    if _late and _path_hook not in sys.path_hooks:
        sys.path_hooks.insert(0, _path_hook)
    install_finder()


def _warn_imported_first(name: str) -> None:
    """A trainer imported before dorafp8 may have hooked its adapters to their layers already, each holding the
    forward its class had then: those keep it. Said once, and only where such adapters exist."""
    if name != ONETRAINER_MODULE or _WARNED:
        return
    import gc

    cls = getattr(sys.modules[name], "DoRAModule", None)
    hooked = cls is not None and any(isinstance(o, cls) and getattr(o, "is_applied", False) for o in gc.get_objects())
    if hooked:
        _WARNED.append(name)
        warnings.warn("OneTrainer's DoRA modules were hooked to their layers before dorafp8 was imported: those keep "
                      "OneTrainer's own dense forward. Import dorafp8 before OneTrainer builds its LoRA modules; "
                      "`dorafp8 run -- python scripts/train.py ...` does (docs/TRAINERS.md)", RuntimeWarning,
                      stacklevel=4)


_WARNED: list = []


def watch(name: str, hook, consequence: str) -> None:
    """Runs `hook()` once module `name` has been imported (at once if it is loaded), as for the modules above; a
    failure warns, saying `consequence`. Hooks for the same module run in the order they were added. For what asks
    for more than `import dorafp8` does (dorafp8.launcher's options); not subject to DORAFP8_NO_PATCHES, which the
    caller checks."""
    if sys.modules.get(name) is not None:
        _WATCHED.setdefault(name, (hook, consequence))
        try:
            hook()
        except Exception as e:
            warnings.warn(f"dorafp8 could not hook into {name} ({type(e).__name__}: {e}); {consequence}",
                          RuntimeWarning, stacklevel=2)
        return
    prev = _WATCHED.get(name)
    if prev is None:
        _WATCHED[name] = (hook, consequence)
    else:
        def both(first=prev[0]):
            try:
                first()
            finally:
                hook()
        _WATCHED[name] = (both, f"{prev[1]}; or {consequence}")
    _pending.add(name)  # asked for by name: waited for even if it cannot be found yet (a checkout joins sys.path later)
    install_finder()


def wait_for(name: str) -> None:
    """Waits for watched module `name` (a key of _WATCHED) even where it cannot be found yet, as `import dorafp8` does
    not: dorafp8 run, for OneTrainer's module, whose checkout its scripts put on sys.path after they start."""
    if sys.modules.get(name) is not None:
        _run(name)
    else:
        _pending.add(name)
        install_finder()
