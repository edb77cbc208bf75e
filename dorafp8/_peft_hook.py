"""Registers dorafp8 with PEFT without importing PEFT.

Importing peft (and the transformers it pulls in) takes several seconds, so `import dorafp8` must not do it. But
the fp8-first workflow -- `quantize_model(model)` then `get_peft_model(model, LoraConfig(use_dora=True, ...))` --
needs PEFT to know FP8Linear before `get_peft_model` runs, with nothing more imported by the user. So:

- if peft is already imported when dorafp8 is, register at once (no import cost: it is loaded);
- otherwise a post-import hook on `sys.meta_path` registers right after the top-level `peft` package has finished
  executing (by then its `__init__` has imported peft.tuners.lora and everything the registration patches).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

_WATCHED = "peft"


def _register() -> None:
    from .peft_integration import register_with_peft

    register_with_peft()


class _RunAfterExec(importlib.abc.Loader):
    """Wraps the real loader of `peft`: executes the module, then registers dorafp8."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        uninstall()  # peft is loaded: nothing left to watch
        try:
            _register()
        except Exception as e:  # never break the user's `import peft` because of dorafp8
            warnings.warn(f"dorafp8 could not register its FP8 layers with PEFT ({type(e).__name__}: {e}); "
                          f"get_peft_model will not build DoRAFP8Linear layers", RuntimeWarning, stacklevel=2)

    def __getattr__(self, name):  # get_resource_reader, is_package, get_source, ... of the real loader
        return getattr(self._loader, name)


class _PeftImportHook(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != _WATCHED:
            return None
        # Ask the other finders for the real spec (without this hook, so it cannot recurse), then wrap its loader.
        # The hook stays installed until that loader has run: a bare importlib.util.find_spec("peft") -- diffusers
        # and transformers probe optional packages that way before importing them -- only looks, and the import
        # that follows must find the hook again (it used to be gone by then, and PEFT never learnt of FP8Linear).
        uninstall()
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            install()
        if spec is None or spec.loader is None:
            return None
        spec.loader = _RunAfterExec(spec.loader)
        return spec


_HOOK = _PeftImportHook()


def uninstall() -> None:
    while _HOOK in sys.meta_path:
        sys.meta_path.remove(_HOOK)


def install() -> None:
    """Registers now if peft is loaded, else when it gets imported. Idempotent."""
    if sys.modules.get(_WATCHED) is not None:
        _register()
    elif _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)
