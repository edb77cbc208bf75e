"""Optional dependencies: one place that says which pip extra provides a missing module."""

from __future__ import annotations

import importlib.util

# module -> the dorafp8 extra that installs it
EXTRAS = {
    "peft": "peft",
    "transformers": "peft",
    "triton": "triton",
    "matplotlib": "bench",
    "safetensors": "checkpoint",
}


def missing(*modules: str) -> list[str]:
    """The modules among `modules` that cannot be imported (without importing them)."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def require(*modules: str, what: str) -> None:
    """Raises ImportError naming the extra to install if any of `modules` is missing. `what` says who needs them."""
    gone = missing(*modules)
    if gone:
        extras = sorted({EXTRAS.get(m, m) for m in gone})
        raise ImportError(f"{what} needs {', '.join(gone)}, which is not installed: pip install "
                          f"'dorafp8[{','.join(extras)}]' (or pip install {' '.join(gone)})")
