"""The CUDA extension built on first use of backend="cuda", where the install did not build it.

The first call that names backend="cuda" builds csrc/ with torch.utils.cpp_extension.load into a per-user cache
(cache_dir()), keyed by sources, flags, archs and versions; backend="auto" never builds.
DORAFP8_FORCE_CUDA_BUILD and DORAFP8_CUDA_ARCHS work as for setup.py. Details: docs/ARCHITECTURE.md."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import platform
import runpy
import sys
import sysconfig
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

from .._env import flag

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # dorafp8/
NAME = "dorafp8_C"  # the module torch's loader builds (binding.cpp's PYBIND11_MODULE takes its name from the build)
_TICK = 30.0  # seconds between the lines said while nvcc runs
_LOCK = "dorafp8_build.lock"  # in the build folder: the file _one_builder locks (never removed)


def source_dir_candidates() -> list[Path]:
    """Where the CUDA sources may be: the installed package's data (dorafp8/csrc/), then a source checkout's csrc/."""
    return [PACKAGE_DIR / "csrc", PACKAGE_DIR.parent / "csrc"]


def source_dir() -> Path | None:
    """The first candidate that holds what a build reads (binding.cpp, build_spec.py and the headers), or None."""
    for cand in source_dir_candidates():
        if all((cand / f).exists() for f in ("binding.cpp", "build_spec.py", "dora_fp8.h", "common")):
            return cand
    return None


def cuda_home() -> Path | None:
    """The CUDA toolkit: csrc/build_spec.py's cuda_home, as setup.py finds it ($CUDA_HOME, /usr/local/cuda, or the one
    nvcc on PATH is in)."""
    home = build_spec()["cuda_home"]()
    return Path(home) if home else None


def forced() -> bool:
    return bool(flag("DORAFP8_FORCE_CUDA_BUILD"))


def why_not() -> str | None:
    """None if a build can run here, else what is missing and what to do."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build (install a CUDA build of torch)"
    if source_dir() is None:
        first, second = source_dir_candidates()
        return (f"the CUDA sources are neither in {first} (installed package data) nor in {second} (a source "
                f"checkout); reinstall dorafp8")
    if cuda_home() is None:
        return ("nvcc was not found (no $CUDA_HOME/bin/nvcc, /usr/local/cuda/bin/nvcc or nvcc on PATH): install the "
                "CUDA toolkit (its major version matching torch's CUDA " + str(torch.version.cuda) + ") and set "
                "CUDA_HOME to it")
    return None


def archs(device: torch.device) -> list[str]:
    """What to build for: the default arch whose cubin runs on the GPU (build_spec.covering: sm_90 is "90a", as
    setup.py builds it; B300's sm_103 takes sm_100's), else the GPU's own arch; $DORAFP8_CUDA_ARCHS instead where set,
    plus that arch if none it names runs on the GPU (an image's ENV for other GPUs: a build for them alone was minutes
    of nvcc for a module with no code here); with no GPU (a forced build), that variable or build_spec.py's defaults."""
    spec = build_spec()
    named = spec["cuda_archs"](os.environ.get("DORAFP8_CUDA_ARCHS"))
    defaults = spec["DEFAULT_CUDA_ARCHS"].split(";")
    if not torch.cuda.is_available():
        return named or defaults
    major, minor = torch.cuda.get_device_capability(device)
    own = spec["covering"](defaults, major, minor) or f"{major}{minor}"
    if not named:
        return [own]
    return named if spec["covering"](named, major, minor) else named + [own]


def build_spec() -> dict:
    """csrc/build_spec.py's names: the sources, flags and helpers setup.py builds with."""
    return runpy.run_path(str(source_dir() / "build_spec.py"))


def cache_dir() -> str:
    """dorafp8's per-user cache: $DORAFP8_CACHE_DIR, else $XDG_CACHE_HOME/dorafp8, else ~/.cache/dorafp8. A `~` in
    either is the home (set where no shell expands it, a .env file or a Dockerfile's ENV, it was a folder named `~`)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return os.path.expanduser(os.environ.get("DORAFP8_CACHE_DIR") or os.path.join(base, "dorafp8"))


def plan(device: torch.device) -> dict:
    """What load() is called with: sources, flags, include folders, the keyed build folder."""
    src, spec = source_dir(), build_spec()
    target = archs(device)
    sources = [str(src / f) for f in ["binding.cpp", *spec["CUDA_SOURCES"]]]
    cuda_flags = spec["NVCC_FLAGS"] + spec["gencode"](target)
    key = hashlib.sha256(spec["sources_hash"](str(src)).encode())
    # what the .so is tied to: a home shared by x86 and aarch64 nodes (GH200 beside x86 H100s) with the same versions
    # on both found the other machine's build and failed to import it; EXT_SUFFIX holds the python ABI too
    key.update(repr((spec["CXX_FLAGS"], cuda_flags, sys.version_info[:2], sysconfig.get_config_var("EXT_SUFFIX"),
                     platform.machine(), torch.__version__, torch.version.cuda)).encode())
    return dict(sources=sources, extra_cflags=list(spec["CXX_FLAGS"]), extra_cuda_cflags=cuda_flags,
                extra_include_paths=[str(src)] + spec["wheel_include_dirs"](), archs=target,
                build_directory=Path(cache_dir()) / "cuda_ext" / f"sm_{'_'.join(target)}-{key.hexdigest()[:16]}",
                max_jobs=spec["default_max_jobs"]())


def _say(msg: str) -> None:
    print(f"dorafp8: {msg}", file=sys.stderr, flush=True)


def build(device: torch.device) -> ModuleType:
    """dorafp8._C built for `device` (or from the cache); else a RuntimeError: what failed, what runs instead."""
    why = why_not()
    if why is not None:
        raise RuntimeError(f"the CUDA extension dorafp8._C cannot be built here: {why}")
    p = plan(device)
    out = Path(p["build_directory"])
    try:  # an unwritable home (a container's, a cluster's): the backend's reason names the way out
        out.mkdir(parents=True, exist_ok=True)
        if not os.access(out, os.W_OK | os.X_OK):  # another user's (a first run under sudo): torch's lock file fails
            raise PermissionError(errno.EACCES, "not writable by this user", str(out))
    except OSError as e:
        raise RuntimeError(f"the CUDA extension dorafp8._C cannot be built: its build folder {out} cannot be made "
                           f"or written ({e}); set DORAFP8_CACHE_DIR to a writable folder") from e
    with _one_builder(out):
        return _build(p, out)


@contextlib.contextmanager
def _one_builder(out: Path):
    """One build into `out` at a time (two ranks' first use), under the OS's lock on a file there, which the kernel
    drops when its holder dies. Under it, torch's own `lock` file there (torch < 2.14's FileBaton: a build killed by
    SIGKILL, the OOM killer or a job's time limit leaves it, and every later load waits for it to go, forever) is a
    dead build's, and is removed. Without flock (Windows, a file system without locks) nothing is removed."""
    if fcntl is None:  # Windows
        yield
        return
    # a file opened for writing, not the folder: NFS (a cluster's home, where job time limits kill builds) takes flock
    # as a POSIX lock, and refuses an exclusive one on a descriptor not open for writing (EBADF; flock(2))
    try:
        fd = os.open(out / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # a folder in its place (build() refused an unwritable folder): torch's loader says why
        yield
        return
    try:
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # another rank's first use: minutes of nvcc, said rather than silent
                _say(f"waiting for another process's build of the CUDA extension in {out}")
                fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # ENOLCK, EOPNOTSUPP: torch's own lock file still keeps builders apart
            pass
        else:
            try:
                os.remove(out / "lock")
            except FileNotFoundError:
                pass
            except OSError as e:  # a folder there (EISDIR; EPERM on macOS): not torch's, and its loader would wait
                raise RuntimeError(f"the CUDA extension dorafp8._C cannot be built: {out / 'lock'} is a folder, or "
                                   f"cannot be removed ({e}), where torch's loader keeps its lock file (it would wait "
                                   "for it forever); remove it") from e
        yield
    finally:
        os.close(fd)  # releases the lock


def _build(p: dict, out: Path) -> ModuleType:
    from torch.utils import cpp_extension

    cached = any(out.glob(f"{NAME}*.so"))
    home = str(cuda_home())
    what = (f"the CUDA extension for sm_{', sm_'.join(p['archs'])} (torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}) with {build_spec()['toolkit'](home)}")
    done = threading.Event()
    t0 = time.monotonic()
    if not cached:
        _say(f"building {what} on first use of backend='cuda', once per torch version and GPU: nvcc takes a few "
             f"minutes (MAX_JOBS={os.environ.get('MAX_JOBS', p['max_jobs'])}), into {out}")

        def tick():
            while not done.wait(_TICK):
                _say(f"... still compiling the CUDA extension ({time.monotonic() - t0:.0f} s)")

        threading.Thread(target=tick, daemon=True).start()
    default_jobs = "MAX_JOBS" not in os.environ
    saved_home = cpp_extension.CUDA_HOME
    try:
        # What torch's loader reads, set for this build only: CUDA_HOME (its own guess may be a wrapper script's) and
        # MAX_JOBS; the archs are in our -gencode flags.
        cpp_extension.CUDA_HOME = home
        if default_jobs:
            os.environ["MAX_JOBS"] = p["max_jobs"]
        module = cpp_extension.load(name=NAME, sources=p["sources"], extra_cflags=p["extra_cflags"],
                                    extra_cuda_cflags=p["extra_cuda_cflags"],
                                    extra_include_paths=p["extra_include_paths"], build_directory=str(out),
                                    verbose=False, with_cuda=True)
    except Exception as e:
        raise RuntimeError(f"building {what} failed ({type(e).__name__}: {str(e)[-2000:]}); the build folder is "
                           f"{out}. backend='triton' or backend='reference' run without the extension") from e
    finally:
        done.set()
        cpp_extension.CUDA_HOME = saved_home
        if default_jobs:
            os.environ.pop("MAX_JOBS", None)
    if not cached:
        _say(f"built {what} in {time.monotonic() - t0:.0f} s")
    return module
