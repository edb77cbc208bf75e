"""dorafp8's on/off switches: the environment's (README's table), one reading of them all, the per-thread ones
that a context turns on (ThreadSwitch), and torch's own: whether a CUDA graph is being captured (capturing())."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Optional

# Every DORAFP8_* variable something reads: README's table, and the tests' and bench/'s own. Any other DORAFP8_* name
# set is a typo that nothing would say (DORAFP8_CUDA_ARCH=90a built the default archs, DORAFP8_BACKENDS=native ran
# triton): `import dorafp8` and setup.py name it (unknown()). tests/integration/test_layout.py checks the list.
KNOWN = frozenset({
    "DORAFP8_BACKEND", "DORAFP8_RACE", "DORAFP8_CACHE_DIR", "DORAFP8_HOPPER_GEMM", "DORAFP8_NO_PATCHES", "DORAFP8_RUN",
    "DORAFP8_CUDA_ARCHS", "DORAFP8_FORCE_CUDA_BUILD", "DORAFP8_SKIP_CUDA_BUILD",
    "DORAFP8_REQUIRE_CUDA_EXT", "DORAFP8_TEST_CUDA_BUILD", "DORAFP8_MARGINS", "DORAFP8_INSPECT_ARCHS", "DORAFP8_COMMIT",
})

# The 0 / 1 switches (flag() reads them), which `python -m dorafp8` checks
SWITCHES = ("DORAFP8_RACE", "DORAFP8_NO_PATCHES", "DORAFP8_HOPPER_GEMM", "DORAFP8_FORCE_CUDA_BUILD",
            "DORAFP8_SKIP_CUDA_BUILD")


def flag(name: str, default: Optional[bool] = False) -> Optional[bool]:
    """$name as a switch: "1" on, "0" off, unset or empty `default`. Anything else is refused naming the variable:
    "true", "off" or "yes" counted as neither, and silently did the opposite of what it meant for some switches."""
    value = os.environ.get(name, "")
    if value == "":
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 (off) or 1 (on), got {value!r}")
    return value == "1"


def exit_if_command(error: ValueError) -> None:
    """Says `error` (a refused value) in one line and exits 2 when this import is the `dorafp8` command's own:
    `python -m dorafp8` (runpy imports the package with sys.argv[0] "-m") or pip's `dorafp8` script. A script's
    `import dorafp8` still raises it: this returns."""
    import sys

    argv = list(getattr(sys, "orig_argv", ()))
    module = sys.argv[:1] == ["-m"] and "-m" in argv[:-1] and argv[argv.index("-m") + 1] == "dorafp8"
    if module or os.path.basename(sys.argv[0] if sys.argv else "") == "dorafp8":
        print(f"dorafp8: {error}", file=sys.stderr)
        raise SystemExit(2)


def unknown() -> Optional[str]:
    """What to say of the DORAFP8_* variables set here that dorafp8 does not read (each with the name it likely
    misspells), or None."""
    import difflib

    names = sorted(n for n in os.environ if n.upper().startswith("DORAFP8_") and n not in KNOWN)
    if not names:
        return None
    said = []
    for n in names:
        close = difflib.get_close_matches(n.upper(), KNOWN, n=1, cutoff=0.75)
        said.append(f"{n} (did you mean {close[0]}?)" if close else n)
    return (f"dorafp8 reads no variable named {', '.join(said)}, so it does nothing; the variables dorafp8 reads: "
            f"{', '.join(sorted(KNOWN))} (README.md, \"Environment variables\")")


def first_process() -> bool:
    """Whether this process is the first of its machine's group: not a torchrun / accelerate / DeepSpeed rank past
    local rank 0, nor a multiprocessing child (a DataLoader worker under spawn or forkserver, which imports the
    training script again). A warning about the environment, which they all inherit, said by each of them was one
    line per GPU and per worker."""
    import multiprocessing

    return os.environ.get("LOCAL_RANK", "0") in ("", "0") and multiprocessing.parent_process() is None


class ThreadSwitch:
    """On while one of its `on()` contexts is open in this thread (they nest): `with switch.on(): ...`, `if switch:`."""

    def __init__(self):
        self._local = threading.local()

    @contextlib.contextmanager
    def on(self):
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield
        finally:
            self._local.depth -= 1

    def __bool__(self) -> bool:
        return getattr(self._local, "depth", 0) > 0


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA). torch is imported here, not above:
    setup.py runs this file before torch may be installed."""
    try:
        import torch
        return bool(torch.cuda.is_current_stream_capturing())
    except Exception:  # no CUDA here
        return False
