"""Pinned autotune configs: one config per launcher instead of its list, set in-process with pin_configs (what a first
GPU run uses, so that a cold machine compiles each kernel once and autotunes nothing: bench/first_contact.py)."""

from __future__ import annotations

_PINS: dict = {}
# A GEMM's pin names its main loop (hopper.MAIN_LOOPS): the two loops' lists are tuned apart, so a config picked for
# one loop must never narrow the other's list, even where a config of the same name is in both.
GEMM_PINS = tuple(f"{kernel}/{mode}/{loop}" for kernel in ("forward", "dgrad") for mode in ("w8a16", "w8a8")
                  for loop in ("async-copy", "tma-ws"))
PINS = GEMM_PINS + ("weight_norm",)


def gemm_pin(kernel: str, quant: bool, main_loop: str) -> str:
    """The pin of a GEMM launch: "forward/w8a16/async-copy", ... (one of GEMM_PINS)."""
    return f"{kernel}/{'w8a8' if quant else 'w8a16'}/{main_loop}"


def config_name(cfg) -> str:
    """A triton.Config as the kernel report names it: "BLOCK_M=128,BLOCK_N=128,BLOCK_K=64,GROUP_M=8,w8,s4"."""
    return ",".join([f"{k}={v}" for k, v in cfg.kwargs.items()] + [f"w{cfg.num_warps}", f"s{cfg.num_stages}"])


def pin_configs(pins: dict) -> None:
    """Pins configs for this process. Args: pins, {pin: config_name or [config_name, ...]}, each pin one of PINS
    ("forward/w8a16/async-copy", ..., "dgrad/w8a8/tma-ws", "weight_norm"); {} unpins. Raises: TypeError if pins is
    not such a dict, ValueError naming a pin not in PINS (one without its main loop would pin nothing)."""
    if not isinstance(pins, dict) or not all(isinstance(v, (str, list)) for v in pins.values()):
        raise TypeError(f"pins must be a dict {{pin: config name or [names]}}, got {pins!r}")
    if unknown := sorted(set(pins) - set(PINS)):
        raise ValueError(f"pins names {unknown}, which no launcher has; the pins: {list(PINS)}")
    _PINS.clear()
    _PINS.update(pins)


def pin_of(pin: str | None):
    """What pin_configs pinned for `pin` (a name or a tuple of names), or None: part of a tuner's cache key
    (_common.autotuned), so that a pin set or dropped after a launcher's first launch reaches its next one."""
    want = _PINS.get(pin) if pin is not None else None
    return tuple(want) if isinstance(want, list) else want


def pinned(pin: str | None, configs: list) -> list:
    """The configs a launcher tunes over: `configs`, or the ones pin_configs pinned for `pin` that the list holds."""
    want = pin_of(pin)
    want = [want] if isinstance(want, str) else list(want or ())
    return [c for c in configs if config_name(c) in want] or configs
