"""Pinned autotune configs: one config per launcher instead of its list, set in-process with pin_configs (what a first
GPU run uses, so that a cold machine compiles each kernel once and autotunes nothing: bench/first_contact.py)."""

from __future__ import annotations

_PINS: dict = {}


def config_name(cfg) -> str:
    """A triton.Config as the kernel report names it: "BLOCK_M=128,BLOCK_N=128,BLOCK_K=64,GROUP_M=8,w8,s4"."""
    return ",".join([f"{k}={v}" for k, v in cfg.kwargs.items()] + [f"w{cfg.num_warps}", f"s{cfg.num_stages}"])


def pin_configs(pins: dict) -> None:
    """Pins configs for this process. Args: pins, {pin: config_name or [config_name, ...]} with the pins
    "forward/w8a16", "forward/w8a8", "dgrad/w8a16", "dgrad/w8a8", "weight_norm"; {} unpins. Raises: TypeError if
    pins is not such a dict."""
    if not isinstance(pins, dict) or not all(isinstance(v, (str, list)) for v in pins.values()):
        raise TypeError(f"pins must be a dict {{pin: config name or [names]}}, got {pins!r}")
    _PINS.clear()
    _PINS.update(pins)


def pinned(pin: str | None, configs: list) -> list:
    """The configs a launcher tunes over: `configs`, or the ones pin_configs pinned for `pin` that the list holds."""
    want = _PINS.get(pin) if pin is not None else None
    want = [want] if isinstance(want, str) else list(want or ())  # a name, or one per main loop
    return [c for c in configs if config_name(c) in want] or configs
