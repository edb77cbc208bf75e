"""Dependencies: which pip extra provides a missing module, and the oldest torch and Triton dorafp8 is tested with."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import warnings

# module -> the dorafp8 extra that installs it, for the modules require() is asked for
EXTRAS = {"peft": "peft", "transformers": "peft", "safetensors": "checkpoint", "lycoris": "lycoris"}
# module -> its pip name, where the two differ
PIP_NAMES = {"lycoris": "lycoris-lora"}


def missing(*modules: str) -> list[str]:
    """The modules among `modules` that cannot be imported (without importing them)."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def require(*modules: str, what: str) -> None:
    """Raises ImportError naming the extra to install if any of `modules` is missing. `what` says who needs them."""
    gone = missing(*modules)
    if gone:
        extras = sorted({EXTRAS.get(m, m) for m in gone})
        pip = " ".join(PIP_NAMES.get(m, m) for m in gone)
        raise ImportError(f"{what} needs {', '.join(gone)}, which is not installed: pip install "
                          f"'dorafp8[{','.join(extras)}]' (or pip install {pip})")


# The oldest versions CI tests (.ci/version_matrix.sh, docs/TESTING.md "Version matrix"); pyproject.toml requires the
# same (tests/integration/test_layout.py checks that it does). dorafp8's PEFT layers subclass PEFT's LoRA layers and
# variants as peft 0.18 to 0.21 have them (dorafp8/peft/_compat.py says where those differ; 0.18 is what
# LLaMA-Factory 0.9.5 installs).
OLDEST_TESTED = {"torch": (2, 11), "triton": (3, 6), "peft": (0, 18)}


def untested_version(dist: str, version: str) -> str | None:
    """None if `version` of `dist` is at least the oldest tested, else a sentence with the fix."""
    m = re.match(r"(\d+)\.(\d+)", str(version))
    if m is None or (int(m[1]), int(m[2])) >= OLDEST_TESTED[dist]:
        return None
    oldest = ".".join(map(str, OLDEST_TESTED[dist]))
    return (f"{dist} {version} is older than {oldest}, the oldest dorafp8 is tested with: "
            f"pip install '{dist}>={oldest}'")


# The distributions that install the `triton` module: PyPI's; the one nightly torch pins; the Windows build
TRITON_DISTS = ("triton", "pytorch-triton", "triton-windows")


def triton_version() -> str | None:
    """The installed Triton's version, whichever distribution installed it (without importing it); None if none."""
    for name in TRITON_DISTS:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def peft_too_old() -> str | None:
    """None if peft is missing or not older than the oldest tested, else untested_version's sentence."""
    try:
        return untested_version("peft", importlib.metadata.version("peft"))
    except importlib.metadata.PackageNotFoundError:
        return None


def warn_if_untested_torch() -> None:
    """At `import dorafp8`: a warning (not an error: much may still work) if torch is older than the tested range."""
    import torch

    why = untested_version("torch", torch.__version__)
    if why:
        warnings.warn(f"dorafp8: {why}; some features may fail", stacklevel=2)
