"""Everything `import dorafp8` changes in other libraries, each when that library is imported (one import finder:
_after_import.py); DORAFP8_NO_PATCHES=1 changes none of it. How and why: docs/ARCHITECTURE.md, "Import hooks".

- torch DDP: fp8 weights broadcast as bytes. FSDP2: fp8 weights stay fp8 under a MixedPrecisionPolicy; FSDP1 refused.
- accelerate's FSDP2 loader sends MXFP8's e8m0 scales as bytes; DeepSpeed's broadcast sends fp8 weights' scales.
- PEFT: get_peft_model(..., use_dora=True) builds DoRAFP8Linear on fp8 layers (too old a PEFT refused, naming why).
- transformers: save_pretrained of fp8 models writes their scales; DoRAFP8Config joins its quantizers. Its and
  diffusers' from_pretrained note the local weight files read, which no writer replaces (checkpoint/write.originals).
- diffusers: save_pretrained of fp8 models and from_single_file of fp8_scaled files refuse, naming dorafp8's calls.
- LyCORIS and OneTrainer: their DoRA modules on fp8 layers compute through the fused ops."""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import os
import sys
import warnings

import torch

from . import _after_import
from ._env import flag
from ._deps import peft_too_old
from .distributed import (ACCELERATE_FSDP_MODULE, DEEPSPEED_ENGINE_MODULE, FSDP1_MODULE, FSDP_PARAM_MODULE,
                          TORCH_DSD_MODULE, install_accelerate_loader_support, install_ddp_support,
                          install_deepspeed_support, install_fsdp1_refusal, install_fsdp_support,
                          install_torch_loader_support)


def _peft() -> None:
    # Importing dorafp8.peft registers (its __init__ ends with register_with_peft()). When peft itself is being
    # imported by dorafp8.peft, that package is still half-initialised here: it registers when it finishes.
    if peft_too_old() is None:
        from . import peft  # noqa: F401
    else:
        _refuse_fp8_layers_in_old_peft()


def _refuse_fp8_layers_in_old_peft() -> None:
    """On too old a peft, get_peft_model on an fp8 layer is refused naming the peft needed."""
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


# From a checkout its scripts put on sys.path after they start: watched late (_LATE).
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
    ACCELERATE_FSDP_MODULE: (install_accelerate_loader_support, "accelerate's FSDP2 loader (cpu_ram_efficient_loading) "
                                                                "sends MXFP8 layers' e8m0 scales, which NCCL refuses"),
    TORCH_DSD_MODULE: (install_torch_loader_support, "torch's set_model_state_dict(broadcast_from_rank0=True) sends "
                                                     "MXFP8 layers' e8m0 scales, which NCCL refuses"),
    DEEPSPEED_ENGINE_MODULE: (install_deepspeed_support, "DeepSpeed broadcasts rank 0's fp8 weights without their "
                                                         "scales (ranks whose scales differ train different models)"),
    FSDP_PARAM_MODULE: (install_fsdp_support, "FSDP2's MixedPrecisionPolicy(param_dtype=...) casts the fp8 weights for "
                                              "the all-gather (the forward casts them back, with a warning)"),
}


def _run(name: str, hook=None, consequence: str = "") -> None:
    """Runs `hook` (default: name's in _WATCHED); a failure warns, saying `consequence`."""
    if hook is None:
        hook, consequence = _WATCHED[name]
    try:
        hook()
    except Exception as e:  # never break the user's import because of dorafp8
        warnings.warn(f"dorafp8 could not hook into {name} ({type(e).__name__}: {e}); {consequence}",
                      RuntimeWarning, stacklevel=3)


def install() -> None:
    """What `import dorafp8` does outside dorafp8 (the module docstring), unless DORAFP8_NO_PATCHES=1. Idempotent."""
    if flag("DORAFP8_NO_PATCHES"):
        return
    install_ddp_support()
    watch_imports()


def _exists(name: str) -> bool:
    """Whether module `name` is there to import, found without importing it or its packages (_in_folder)."""
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
    return os.path.isdir(path) or os.path.isdir(os.path.dirname(path)) and any(
        os.path.isfile(path + suffix) for suffix in importlib.machinery.all_suffixes())


# Watched modules that may arrive with a folder put on sys.path later. A path hook is consulted once per new folder (not
# per import): it looks there for them, watches one it finds, and declines every folder.
_LATE = {ONETRAINER_MODULE}
_late: set = set()


def _path_hook(folder):
    for name in [n for n in _late if _in_folder(folder, n.split("."))]:
        _late.discard(name)
        if sys.modules.get(name) is None:
            _wait(name)
    if not _late:
        _remove_path_hook()
    raise ImportError("dorafp8 only looks")  # not a finder for this folder: the next hook's


def _remove_path_hook() -> None:
    while _path_hook in sys.path_hooks:
        sys.path_hooks.remove(_path_hook)


def watch_imports() -> None:
    """Runs the hook of every loaded watched module and watches for the others (_LATE too). Idempotent."""
    for name in _WATCHED:
        if sys.modules.get(name) is not None:
            _after_import.forget(name)
            _late.discard(name)
            if name in _LATE:
                _warn_imported_first(name)
            _run(name)
        elif _exists(name):
            _wait(name)
        elif name in _LATE:
            _late.add(name)
    if _late and _path_hook not in sys.path_hooks:
        sys.path_hooks.insert(0, _path_hook)


def _warn_imported_first(name: str) -> None:
    """Warns once where a trainer imported before dorafp8 has hooked adapters to their layers already."""
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
    """Runs `hook()` once module `name` has been imported (at once if it is loaded), after its other hooks; a failure
    warns, saying `consequence`. For dorafp8.launcher's options; the caller checks DORAFP8_NO_PATCHES."""
    if sys.modules.get(name) is not None:
        _WATCHED.setdefault(name, (hook, consequence))
        _run(name, hook, consequence)
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
    _wait(name)  # asked for by name: waited for even if it cannot be found yet (a checkout joins sys.path later)


def _wait(name: str) -> None:
    """_run(name) once module `name` has been imported (dorafp8/_after_import.py, the one finder)."""
    _after_import.when_imported(name, functools.partial(_run, name))
