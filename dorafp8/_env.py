"""dorafp8's on/off environment switches (README's table): one reading of them all."""

from __future__ import annotations

import os
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
