"""dorafp8's one import finder: runs a callback right after a module has been imported, without importing it. Used
by `import dorafp8` (_install.py) and by the sitecustomize of `dorafp8 run` (launcher.py), which loads this file by
its path before torch is imported: so it imports neither torch nor anything of dorafp8."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

waiting: dict = {}  # module name -> the callback to run once it has been executed


def when_imported(name: str, callback) -> None:
    """Runs `callback()` once module `name` has finished executing (its import, not a bare find_spec). Replaces a
    callback already waiting for `name`; the caller runs it itself where the module is loaded already."""
    waiting[name] = callback
    install_finder()


def forget(name: str) -> None:
    """No longer waits for `name`."""
    waiting.pop(name, None)
    if not waiting:
        uninstall()


class _RunAfterExec(importlib.abc.Loader):
    """Wraps the real loader of a waited-for module: executes the module, then runs its callback (the one waiting
    when the import began: it runs even if the name was forgotten meanwhile, as while the module executes)."""

    def __init__(self, loader, name: str, callback):
        self._loader = loader
        self._name = name
        self._callback = callback

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        waiting.pop(self._name, None)
        if not waiting:
            uninstall()  # everything waited for is loaded
        self._callback()

    def __getattr__(self, name):  # get_resource_reader, is_package, get_source, ... of the real loader
        return getattr(self.__dict__["_loader"], name)


class _ImportHook(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in waiting:
            return None
        # The real spec from the other finders (without this hook: no recursion), its loader wrapped. The hook stays
        # until that loader has run: a bare find_spec("peft") only looks, and the import that follows must find it.
        uninstall()
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            install_finder()
        if spec is None or spec.loader is None:
            return None
        callback = waiting.get(fullname)
        if callback is None:
            return None
        spec.loader = _RunAfterExec(spec.loader, fullname, callback)
        return spec


HOOK = _ImportHook()


def uninstall() -> None:
    while HOOK in sys.meta_path:
        sys.meta_path.remove(HOOK)


def install_finder() -> None:
    if waiting and HOOK not in sys.meta_path:
        sys.meta_path.insert(0, HOOK)
