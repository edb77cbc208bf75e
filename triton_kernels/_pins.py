"""DORAFP8_PIN_CONFIGS: one autotune config per launcher, named in a JSON file, instead of its list (what a first GPU
run uses, so that a cold machine compiles each kernel once and autotunes nothing: bench/first_contact.py)."""

from __future__ import annotations

import json
import os

_PINS: dict = {}


def config_name(cfg) -> str:
    """A triton.Config as the kernel report names it: "BLOCK_M=128,BLOCK_N=128,BLOCK_K=64,GROUP_M=8,w8,s4"."""
    return ",".join([f"{k}={v}" for k, v in cfg.kwargs.items()] + [f"w{cfg.num_warps}", f"s{cfg.num_stages}"])


def pinned(pin: str | None, configs: list) -> list:
    """The configs a launcher tunes over: `configs`, or the one DORAFP8_PIN_CONFIGS pins for `pin` when the list holds
    it. That variable names a JSON file {pin: config_name or [config_name, ...]}, pins "forward/w8a16", "forward/w8a8", "dgrad/w8a16",
    "dgrad/w8a8", "weight_norm" (bench/first_contact.py pins the kernel report's model picks). Read once per
    process."""
    path = os.environ.get("DORAFP8_PIN_CONFIGS")
    if not path or pin is None:
        return configs
    if path not in _PINS:
        try:
            with open(path) as f:
                _PINS[path] = dict(json.load(f))
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"DORAFP8_PIN_CONFIGS must name a JSON file of {{pin: config}}, got {path!r}: "
                             f"{type(e).__name__}: {e}") from None
    want = _PINS[path].get(pin)
    want = [want] if isinstance(want, str) else list(want or ())  # a name, or one per main loop
    return [c for c in configs if config_name(c) in want] or configs
