"""No host sync in a training step, on every kernel backend that runs here (the conftest's `backend`) (docs/ARCHITECTURE.md, "The kernel plan").

A read of a device tensor's value on the host (.item(), float(t), bool(t), nonzero, torch.equal, ...) waits for the
GPU to drain its queue: the CPU can no longer run ahead, and a layer whose kernels take microseconds costs the host's
whole Python path instead. On CPU every such read still reaches the dispatcher as aten._local_scalar_dense (or
nonzero, equal, ...), which dorafp8._launches.LaunchRecorder records, inside dorafp8's custom ops too; so these tests
see on CPU the reads a GPU step would make. (The CPU-only proof of the DoRA modules' weight-norm cache, a torch.equal
of the adapters, never runs on a GPU: norm_cache.py; the functional ops are tested here.)
"""

import pytest
import torch

import dorafp8
from dorafp8._launches import LaunchRecorder
from dorafp8.backends import base



@pytest.fixture(autouse=True)
def _no_poison(monkeypatch):
    monkeypatch.setattr(base, "POISON_OUTPUTS", False)  # the tests' NaN fill is not what a user's step runs


def _weights(kind, N=48, K=32, r=4):
    gen = torch.Generator().manual_seed(0)
    w8, scale = dorafp8.quantize_e4m3(torch.randn(N, K, generator=gen), per_row=kind == "row",
                                      block_size=16 if kind == "block" else None)
    A = (torch.randn(r, K, generator=gen) / K ** 0.5).requires_grad_()
    B = (torch.randn(N, r, generator=gen) * 0.02).requires_grad_()
    m = dorafp8.weight_norm(w8, scale, A, B, 2.0, backend="reference", block_size=16).requires_grad_()
    return w8, scale, A, B, m


@pytest.mark.backends("native", "cublas", "triton", "cuda")
@pytest.mark.parametrize("kind", ["tensor", "row"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("cached_norm", [False, True])
def test_dora_training_step_reads_no_device_value(backend, kind, dropout, cached_norm):
    """Forward (with the weight norm made in the call, or given), backward and an optimizer step: no host sync."""
    w8, scale, A, B, m = _weights(kind)
    bias = torch.zeros(w8.shape[0], dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(2, 5, w8.shape[1], dtype=torch.bfloat16, requires_grad=True)
    opt = torch.optim.SGD([A, B, m, bias], lr=1e-3)  # foreach: no per-parameter host reads either
    for _ in range(2):  # the second step runs with every once-per-process choice made
        with LaunchRecorder() as rec:
            n = dorafp8.weight_norm(w8, scale, A, B, 2.0, backend=backend, block_size=16) if cached_norm else None
            y = dorafp8.dora_fp8_linear(x, w8, scale, A, B, m, 2.0, bias, dropout_p=dropout, training=True,
                                        backend=backend, weight_norm=n, block_size=16)
            y.float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        assert rec.syncs == [], rec.syncs
    assert rec.launches  # it recorded the step


@pytest.mark.backends("native", "cublas", "triton", "cuda")
@pytest.mark.parametrize("kind", ["tensor", "row"])
def test_fp8_linear_step_reads_no_device_value(backend, kind):
    """FP8Linear's forward (the base layer of every adapter) and its input gradient: no host sync."""
    w8, scale, _, _, _ = _weights(kind)
    layer = dorafp8.FP8Linear.from_fp8(w8, scale, torch.zeros(w8.shape[0]), backend=backend)
    x = torch.randn(7, w8.shape[1], dtype=torch.bfloat16, requires_grad=True)
    for _ in range(2):
        with LaunchRecorder() as rec:
            layer(x).float().sum().backward()
        assert rec.syncs == [], rec.syncs


@pytest.mark.backends("native", "cublas", "triton", "cuda")
def test_peft_dora_module_step_reads_no_device_value(backend, monkeypatch):
    """PEFT's DoRA layer on an FP8Linear (DoRAFP8Linear, what get_peft_model builds on a quantized model) under
    autocast, backward and an optimizer step: no host sync. The norm cache runs as on a GPU outside
    reuse_weight_norms (the norm made every call): its CPU-only proof compares the adapters' values. (SGD: Adam's
    step counter lives on the CPU, also on a GPU, and its .item() is read on the CPU there, not a sync.)"""
    peft = pytest.importorskip("peft")
    from dorafp8.norm_cache import WeightNormCache

    monkeypatch.setattr(WeightNormCache, "norm", lambda self, adapter, compute, *a, **k: compute())
    model = torch.nn.Sequential(torch.nn.Linear(32, 48))
    dorafp8.quantize_model(model, backend=backend)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["0"], use_dora=True,
                                                       lora_dropout=0.1))
    assert type(model.base_model.model[0]).__name__ == "DoRAFP8Linear"
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3, momentum=0.9)
    x = torch.randn(6, 32)
    for _ in range(2):
        with LaunchRecorder() as rec:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = model(x)
            y.float().square().mean().backward()
            opt.step()
            opt.zero_grad()
        assert rec.syncs == [], rec.syncs


def test_custom_ops_fast_path_leaves_tensor_subclasses_to_the_dispatcher():
    """The eager fast path (ops/_custom_ops.py) calls an op's implementation directly only on plain arguments: a
    tensor subclass (DTensor, torchao's, FakeTensor) reaches torch.library's op, which it may need to see."""
    from dorafp8.ops import _custom_ops as O

    seen = []

    class Watched(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return super().__torch_function__(func, types, args, kwargs or {})

    a, b = torch.randn(8, 16), torch.randn(4, 16)
    O.project_op(a, b, out_dtype=torch.float32, mask=None, p=0.0, backend="native")
    assert not any("dorafp8" in f for f in seen)
    O.project_op(a.as_subclass(Watched), b, out_dtype=torch.float32, mask=None, p=0.0, backend="native")
    assert any("dorafp8.project" in f for f in seen), seen
