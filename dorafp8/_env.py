"""dorafp8's on/off switches: the environment's (README's table), one reading of them all, and the per-thread ones
that a context turns on (ThreadSwitch)."""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Optional


def flag(name: str, default: Optional[bool] = False) -> Optional[bool]:
    """$name as a switch: "1" on, "0" off, unset or empty `default`. Anything else is refused naming the variable:
    "true", "off" or "yes" counted as neither, and silently did the opposite of what it meant for some switches."""
    value = os.environ.get(name, "")
    if value == "":
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 (off) or 1 (on), got {value!r}")
    return value == "1"


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
