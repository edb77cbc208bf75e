"""The host work of a PEFT DoRA layer's step around the fused call (issue 52: on an H200 host every layer's step was
host-bound). Each read of a module's parameter, buffer or submodule goes through torch's nn.Module.__getattr__ (and a
failed one raises and catches an AttributeError); the layer reads each once a call. A named backend's resolution
builds no torch.device from the one it is given. Neither cut may change what a call computes or which norm it
reuses: the cache of the weight norm still sees every change (tests/nn/test_norm_cache.py covers the optimizers)."""

import contextlib

import pytest
import torch

pytest.importorskip("peft")

from peft import LoraConfig, get_peft_model  # noqa: E402

import dorafp8  # noqa: E402
from dorafp8 import backends  # noqa: E402

N = K = 32
R = 4
# Module.__getattr__ calls of one forward + backward of the fused DoRAFP8Linear (PeftModel's own left out): lora_A,
# lora_B, lora_dropout, lora_magnitude_vector and their weights / bias, the base's weight, scale, bias, global_scale
# and PEFT's get_base_layer (once, three reads). Before: 32 (the base found three times, the adapters read twice).
MAX_GETATTR = 20


def _layer(backend="reference", dropout=0.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w8, scale = dorafp8.quantize_e4m3(torch.randn(N, K, generator=gen))
    base = torch.nn.Sequential(dorafp8.FP8Linear.from_fp8(w8, scale, torch.randn(N, generator=gen), backend=backend))
    model = get_peft_model(base, LoraConfig(r=R, lora_alpha=2 * R, target_modules=["0"], use_dora=True,
                                            lora_dropout=dropout))
    layer = model.base_model.model[0]
    assert isinstance(layer, dorafp8.DoRAFP8Linear)
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(0, 0.1, generator=gen)
    return layer


@contextlib.contextmanager
def _count_getattr(counts):
    orig = torch.nn.Module.__getattr__

    def counting(self, name):
        counts.append(name)
        return orig(self, name)

    torch.nn.Module.__getattr__ = counting
    try:
        yield
    finally:
        torch.nn.Module.__getattr__ = orig


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_fused_step_reads_each_module_attribute_once(dropout):
    layer = _layer(dropout=dropout)
    x = torch.randn(5, K, requires_grad=True)
    for _ in range(2):  # the second: every once-per-process choice made
        counts = []
        with _count_getattr(counts):
            layer(x).sum().backward()
    assert len(counts) <= MAX_GETATTR, sorted(counts)


def _step(layer, x):
    torch.manual_seed(7)
    y = layer(x)
    y.square().sum().backward()
    grads = [p.grad.clone() for p in layer.parameters() if p.requires_grad]
    layer.zero_grad(set_to_none=True)
    return y.detach(), grads


def _fresh_step(layer, x):
    """The step with no cached norm (what a first call computes)."""
    layer.clear_weight_norm_cache()
    return _step(layer, x)


def _assert_same(got, want):
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))


# Each change between two calls that must reach the second call's result (the norm, the dropout, the backend).
def _bump_A(layer):
    with torch.no_grad():
        layer.lora_A["default"].weight.add_(0.25)


def _swap_A(layer):  # a new tensor of the same shape (a load, an EMA swap)
    w = layer.lora_A["default"].weight
    layer.lora_A["default"].weight = torch.nn.Parameter(w.detach() * 0.5)


def _data_write_B(layer):  # a write no version counter sees: the CPU cache's value proof must catch it
    layer.lora_B["default"].weight.data.mul_(2.0)


def _scale(layer):
    base = layer.get_base_layer()
    base.scale = base.scale * 1.5


def _scaling(layer):
    layer.scaling["default"] = layer.scaling["default"] * 3


def _weight(layer):
    base = layer.get_base_layer()
    base.weight = torch.nn.Parameter(torch.flip(base.weight, (0,)), requires_grad=False)


def _dtype(layer):
    layer.lora_A["default"].to(torch.bfloat16)


def _backend(layer):
    layer.backend = "native"


def _eval(layer):
    layer.eval()


def _dropout(layer):
    layer.lora_dropout["default"] = torch.nn.Dropout(0.5)


def _frozen_A(layer):
    layer.lora_A["default"].weight.requires_grad_(False)


CHANGES = [_bump_A, _swap_A, _data_write_B, _scale, _scaling, _weight, _dtype, _backend, _eval, _dropout, _frozen_A]


@pytest.mark.parametrize("change", CHANGES, ids=lambda f: f.__name__.strip("_"))
def test_a_change_between_calls_reaches_the_next_call(change):
    """The second call after `change` equals a call on the changed layer with nothing cached: no decision the first
    call took (its norm, the base it found, the adapter tensors it read) survives the change."""
    layer = _layer(dropout=0.1)
    x = torch.randn(6, K)
    before = _step(layer, x)
    _step(layer, x)  # a cached norm, if the cache keeps one
    change(layer)
    got = _step(layer, x)
    _assert_same(got, _fresh_step(layer, x))
    if change is not _frozen_A:  # freezing A changes no value
        assert not torch.equal(got[0], before[0]), "the change did not reach the result"
    else:
        assert len(got[1]) == len(before[1]) - 1  # but drops A's gradient


def test_a_named_backend_builds_no_device_per_call(monkeypatch):
    """resolve() of a named backend on a torch.device (every op passes x.device) makes no new torch.device: each cost
    ~0.4 us, a few a call (_prepare built two, unavailable_reason one)."""
    device = torch.zeros(1).device
    backends.resolve("reference", device)  # probed once
    real, made = torch.device, []

    def counting(*args, **kwargs):
        made.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "device", counting)
    for name in ("reference", "native"):
        assert backends.resolve(name, device, frozenset({"fp32"})) == name
    monkeypatch.setattr(torch, "device", real)
    assert made == []
    assert backends.unavailable_reason("reference", "cpu") is None  # a string still works
