"""The backend contract (dorafp8/backends/base.py) and the registry around it: every backend offers the Protocol's
functions under its parameter names (the custom ops call them by keyword), a backend named for something it does not
compute is refused the same way whichever it is, and a backend's availability is probed once per device."""

import pytest
import torch

from dorafp8 import backends
from dorafp8.backends import base


@pytest.mark.parametrize("name", backends.BACKENDS)
def test_backend_offers_the_contract_by_name(name):
    try:
        impl = backends._import(name)
    except ImportError as e:
        pytest.skip(f"backend {name!r} cannot be imported here: {e}")
    assert base.signature_mismatches(impl) == []
    assert callable(impl.unavailable_reason)
    assert backends.supports(name) <= backends.FEATURES


def test_signature_mismatch_is_reported():
    class Positional:
        def weight_norm(self, w8, scale, block, A, B, s):  # the old spelling of block_size
            pass

    problems = base.signature_mismatches(Positional())
    assert any(p.startswith("weight_norm: parameters") and "block_size" in p for p in problems)
    assert "forward: missing" in problems


@pytest.mark.parametrize("name, feature, what", [
    ("cuda", "block", "block weight scales are"),
    ("cuda", "rowwise", "act_quant='rowwise' (W8A8) is"),
    ("cublas", "rowwise", "act_quant='rowwise' (W8A8) is"),
])
def test_named_backend_is_refused_uniformly(monkeypatch, name, feature, what):
    monkeypatch.setattr(backends, "unavailable_reason", lambda b, device: None)
    with pytest.raises(ValueError, match=rf"^{__import__('re').escape(what)} not supported by the {name} backend; "
                                         rf"use backend='auto' or "):
        backends.resolve(name, torch.device("cuda"), frozenset({feature}))
    # "auto" passes over it instead
    assert backends.resolve("auto", torch.device("cuda"), frozenset({feature})) != name


def test_availability_is_probed_once_per_device(monkeypatch):
    calls = []

    class Fake:
        @staticmethod
        def unavailable_reason(device):
            calls.append(device)
            return None

    monkeypatch.setitem(backends._loaded, "reference", Fake)
    monkeypatch.setattr(backends, "_reasons", {})
    for _ in range(3):
        assert backends.resolve("reference", torch.device("cpu")) == "reference"
        assert backends.resolve("reference", torch.device("meta")) == "reference"
    assert calls == [torch.device("cpu"), torch.device("meta")]
