"""The weight-norm cache under the optimizers and trainers people run (issue: fused AdamW, the HF Trainer's default,
writes parameters without bumping `_version`, and a version-keyed cache reused the step-0 norm for a whole run).

Each run trains a tiny LLaMA twice on the same batches: PEFT's DoRA on the fp8 base dequantized to fp32, and dorafp8
on the fp8 base with the same adapters. The losses must agree at every step to fp32 rounding, whatever updates the
adapters, with and without gradient accumulation; and the norm must still be computed once per optimizer step (not
per micro-batch) on the CPU."""

import copy
import importlib.util
import os

import pytest
import torch

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import dorafp8  # noqa: E402
from dorafp8 import DoRAFP8Linear  # noqa: E402
from dorafp8.norm_cache import WeightNormCache, reuse_weight_norms  # noqa: E402
from tests.peft.test_peft import _pair  # noqa: E402

STEPS = 4
N_LAYERS = 14  # DoRA layers of the tiny LLaMA (7 targets x 2 blocks)
REL_TOL = 1e-5  # fp32: the two models differ only by summation order


def _batches(n):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 97, (2, 9), generator=g) for _ in range(n)]


def _torch(name, **kw):
    return lambda params: getattr(torch.optim, name)(params, **kw)


def _optional(module, build):
    def make(params):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")
        return build(importlib.import_module(module), params)
    return make


def _deepspeed_cpu_adam(ds, params):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(params, lr=1e-2)


def _schedule_free(sf, params):
    opt = sf.AdamWScheduleFree(params, lr=1e-2)
    opt.train()  # its train()/eval() swap the parameters in place: the cache must follow those too
    return opt


OPTIMIZERS = {
    "adamw-forloop": _torch("AdamW", lr=1e-2, foreach=False),
    "adamw-foreach": _torch("AdamW", lr=1e-2, foreach=True),
    "adamw-fused": _torch("AdamW", lr=1e-2, fused=True),  # the HF Trainer's default (adamw_torch_fused)
    "sgd-momentum-fused": _torch("SGD", lr=0.2, momentum=0.9, fused=True),
    "sgd-momentum-foreach": _torch("SGD", lr=0.2, momentum=0.9, foreach=True),
    # min_8bit_size=1: bitsandbytes keeps fp32 states for tensors under 4096 elements (its default), which is every
    # adapter of the tiny LLaMA (896 at most), so without it the 8-bit states were never what updated them
    "bnb-adamw8bit": _optional("bitsandbytes", lambda bnb, p: bnb.optim.AdamW8bit(p, lr=1e-2, min_8bit_size=1)),
    "bnb-paged-adamw8bit": _optional("bitsandbytes",
                                     lambda bnb, p: bnb.optim.PagedAdamW8bit(p, lr=1e-2, min_8bit_size=1)),
    "prodigy": _optional("prodigyopt", lambda m, p: m.Prodigy(p, lr=1.0)),
    "schedule-free": _optional("schedulefree", _schedule_free),
    "lion": _optional("lion_pytorch", lambda m, p: m.Lion(p, lr=1e-3)),
    "adafactor": lambda p: transformers.optimization.Adafactor(p, lr=1e-2, relative_step=False,
                                                              scale_parameter=False, warmup_init=False),
    "deepspeed-cpu-adam": _optional("deepspeed", _deepspeed_cpu_adam),
}


class _Manual:
    """A hand-written SGD step, as old tutorials and research code write it."""

    def __init__(self, params, how):
        self.params, self.how = list(params), how

    @torch.no_grad()
    def step(self):
        for p in self.params:
            if self.how == "data":  # through .data: no version counter sees it
                p.data.add_(p.grad, alpha=-0.2)
            elif self.how == "data-copy":  # an EMA-style swap: param.data.copy_(other)
                p.data.copy_(p - 0.2 * p.grad)
            else:  # copy_ on the parameter itself under no_grad
                p.copy_(p - 0.2 * p.grad)

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


for _how in ("data", "data-copy", "copy"):
    OPTIMIZERS[f"manual-{_how}"] = (lambda how: lambda params: _Manual(params, how))(_how)


def _train(model, make_opt, batches, accum):
    """Losses of STEPS optimizer steps of `accum` micro-batches each (the mean loss of each step)."""
    model.train()
    opt = make_opt([p for p in model.parameters() if p.requires_grad])
    losses = []
    it = iter(batches)
    for _ in range(STEPS):
        total = 0.0
        for _ in range(accum):
            ids = next(it)
            loss = model(input_ids=ids, labels=ids).loss / accum
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses


@pytest.fixture
def norm_calls(monkeypatch):
    calls = []
    orig = DoRAFP8Linear._weight_norm

    def counting(base, A, B, s):
        calls.append(1)
        return orig(base, A, B, s)

    monkeypatch.setattr(DoRAFP8Linear, "_weight_norm", staticmethod(counting))
    return calls


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_losses_equal_peft_under_every_optimizer(opt_name, accum, norm_calls):
    peft_model, ours = _pair("llama")
    batches = _batches(STEPS * accum)
    ref = _train(peft_model, OPTIMIZERS[opt_name], batches, accum)
    norm_calls.clear()
    got = _train(ours, OPTIMIZERS[opt_name], batches, accum)
    assert ref[0] != ref[-1], "the optimizer did not move the loss: nothing was tested"
    for step, (a, b) in enumerate(zip(got, ref)):
        assert abs(a - b) <= REL_TOL * abs(b), f"step {step}: dorafp8 {a:.7f} vs PEFT {b:.7f} ({opt_name})"
    # One norm per layer per optimizer step, shared by the micro-batches (the CPU cache compares the values).
    assert len(norm_calls) == N_LAYERS * STEPS, (len(norm_calls), opt_name)


@pytest.mark.parametrize("lr", [None, 1e-2])
def test_hf_trainer_with_default_arguments_equals_peft(tmp_path, lr):
    """transformers' Trainer with its default arguments (adamw_torch_fused, lr 5e-5, linear schedule), and with only
    the learning rate raised so that a stale norm moves the loss visibly: both models log the same loss at every
    step, and after training every layer's norm is the norm of its trained adapters."""

    class Data(torch.utils.data.Dataset):
        def __init__(self):
            self.items = _batches(12)

        def __len__(self):
            return len(self.items)

        def __getitem__(self, i):
            ids = self.items[i][0]
            return {"input_ids": ids, "labels": ids}

    peft_model, ours = _pair("llama")
    logs = {}
    for name, model in (("peft", peft_model), ("dorafp8", ours)):
        kw = {} if lr is None else {"learning_rate": lr}
        args = transformers.TrainingArguments(output_dir=str(tmp_path / name), max_steps=6, logging_steps=1,
                                              per_device_train_batch_size=2, report_to="none", save_strategy="no",
                                              use_cpu=True, disable_tqdm=True, **kw)
        assert args.optim == transformers.training_args.OptimizerNames.ADAMW_TORCH_FUSED  # the default under test
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Data())
        trainer.train()
        logs[name] = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(logs["peft"]) == 6 and logs["peft"][0] != logs["peft"][-1]
    for step, (a, b) in enumerate(zip(logs["dorafp8"], logs["peft"])):
        assert abs(a - b) <= REL_TOL * abs(b), f"step {step}: {a} vs {b}"
    ours.train()
    ours(input_ids=_batches(1)[0])
    for name, layer in ours.named_modules():
        if isinstance(layer, DoRAFP8Linear):
            assert torch.equal(layer.dora_weight_norm("default"), layer.dora_weight_norm("default", use_cache=False)), \
                f"{name}: the norm in use is not the norm of the trained adapters"


def test_norm_reused_in_eval_until_a_write_it_cannot_see():
    _, ours = _pair("llama")
    ours.eval()
    layer = ours.base_model.model.model.layers[0].self_attn.q_proj
    ids = _batches(1)[0]
    with torch.no_grad():
        ours(input_ids=ids)
        n1 = layer.dora_weight_norm("default")
        ours(input_ids=ids)
        assert layer.dora_weight_norm("default") is n1  # eval batches share it
        layer.lora_B["default"].weight.data.mul_(1.5)  # bumps nothing: only the values tell
        n2 = layer.dora_weight_norm("default")
    assert n2 is not n1 and torch.equal(n2, layer.dora_weight_norm("default", use_cache=False))


def _meta_norm(calls):
    def compute():
        calls.append(1)
        return torch.empty(4, device="meta")
    return compute


def test_off_cpu_the_norm_is_recomputed_unless_reuse_is_promised():
    """On a device other than the CPU no cached norm is trusted outside reuse_weight_norms(); inside it an optimizer
    step of any torch.optim.Optimizer (fused included) still invalidates it. Meta tensors stand in for a GPU."""
    cache, calls = WeightNormCache(), []
    A, B = torch.empty(2, 3, device="meta"), torch.empty(4, 2, device="meta")
    w, scale = torch.empty(4, 3, device="meta"), torch.empty((), device="meta")
    args = (A, B, w, scale)
    cache.norm("a", _meta_norm(calls), *args)
    cache.norm("a", _meta_norm(calls), *args)
    assert len(calls) == 2 and len(cache) == 0
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    with reuse_weight_norms():
        cache.norm("a", _meta_norm(calls), *args)
        cache.norm("a", _meta_norm(calls), *args)
        assert len(calls) == 3
        v = p._version
        opt.step()
        assert p._version == v  # fused: no version bump, yet the step is seen
        cache.norm("a", _meta_norm(calls), *args)
        assert len(calls) == 4
        with torch.no_grad():
            A.add_(1)  # an in-place op: the version counter sees it
        cache.norm("a", _meta_norm(calls), *args)
        assert len(calls) == 5
    cache.norm("a", _meta_norm(calls), *args)
    assert len(calls) == 6


def test_sharded_parameters_never_use_the_cache():
    cache, calls = WeightNormCache(), []
    A, B, w, scale = torch.zeros(2, 3), torch.zeros(4, 2), torch.zeros(4, 3), torch.ones(())
    for _ in range(2):
        cache.norm("a", _meta_norm(calls), A, B, w, scale, sharded=True)
    assert len(calls) == 2 and len(cache) == 0


@pytest.mark.parametrize("opt_name", ["adamw-fused", "prodigy", "manual-data"])
def test_conv_losses_equal_peft(opt_name):
    """The conv DoRA layers (a diffusion UNet's) share the cache: the same check on a small conv net."""
    from tests.peft.test_conv import X, _pair as conv_pair

    peft_model, ours = conv_pair()
    losses = {}
    for name, model in (("peft", peft_model), ("dorafp8", ours)):
        model.train()
        opt = OPTIMIZERS[opt_name]([p for p in model.parameters() if p.requires_grad])
        losses[name] = []
        for step in range(STEPS):
            loss = model(X * (1 + 0.1 * step)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[name].append(loss.item())
    assert losses["peft"][0] != losses["peft"][-1]
    for step, (a, b) in enumerate(zip(losses["dorafp8"], losses["peft"])):
        assert abs(a - b) <= REL_TOL * abs(b), f"step {step}: dorafp8 {a:.7f} vs PEFT {b:.7f} ({opt_name})"


def test_a_norm_cached_under_inference_mode_is_not_handed_to_training():
    """An evaluation under torch.inference_mode before training (Lightning's validation sanity check, a generate call)
    cached an inference tensor; the next training step got it back and failed in autograd ("Inference tensors cannot
    be saved for backward") on the fused path and on PEFT's own DoRA path (m / n) alike. Outside inference mode the
    norm is recomputed once; inside it a normal cached norm is still reused."""
    cache, calls = WeightNormCache(), []
    A, B, w, scale = torch.ones(2, 3), torch.ones(4, 2), torch.ones(4, 3), torch.ones(())

    def compute():
        calls.append(1)
        return torch.ones(4)

    with torch.inference_mode():
        assert cache.norm("a", compute, A, B, w, scale).is_inference()
    n = cache.norm("a", compute, A, B, w, scale)
    assert not n.is_inference() and len(calls) == 2
    with torch.inference_mode():
        assert cache.norm("a", compute, A, B, w, scale) is n
    assert cache.norm("a", compute, A, B, w, scale) is n and len(calls) == 2


def test_training_after_an_inference_mode_evaluation_equals_peft():
    peft_model, ours = _pair("llama")
    ids = _batches(1)[0]
    grads = {}
    for name, model in (("peft", peft_model), ("dorafp8", ours)):
        with torch.inference_mode():
            model(input_ids=ids)
        model(input_ids=ids, labels=ids).loss.backward()
        grads[name] = [p.grad for p in model.parameters() if p.requires_grad]
    assert len(grads["peft"]) == len(grads["dorafp8"]) > 0
    for got, ref in zip(grads["dorafp8"], grads["peft"]):
        torch.testing.assert_close(got, ref, rtol=REL_TOL, atol=REL_TOL * ref.abs().max().item())


def test_a_cuda_graph_capture_neither_reuses_nor_caches_a_norm(monkeypatch):
    """Inside reuse_weight_norms() a capture must not bake the cached norm into the graph (its replays, run without
    Python, would use it after every optimizer step) nor cache the graph's own norm: it computes the norm inside the
    graph each time and warns once. torch.cuda.is_current_stream_capturing made True; meta tensors stand in for a GPU."""
    import dorafp8.norm_cache as nc

    monkeypatch.setattr(nc, "_CAPTURE_WARNED", [], raising=False)
    cache, calls = WeightNormCache(), []
    A, B = torch.empty(2, 3, device="meta"), torch.empty(4, 2, device="meta")
    args = (A, B, torch.empty(4, 3, device="meta"), torch.empty((), device="meta"))
    with reuse_weight_norms():
        cache.norm("a", _meta_norm(calls), *args)  # eager, before the capture: cached
        assert len(calls) == 1 and len(cache) == 1
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        with pytest.warns(UserWarning, match="CUDA graph capture"):
            n = cache.norm("a", _meta_norm(calls), *args)
        assert len(calls) == 2 and n is not cache._entries["a"][1]  # computed in the graph, not the cached one
        cache.clear()
        cache.norm("a", _meta_norm(calls), *args)
        assert len(calls) == 3 and len(cache) == 0  # nothing cached from inside the capture
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        cache.norm("a", _meta_norm(calls), *args)
        cache.norm("a", _meta_norm(calls), *args)
        assert len(calls) == 4 and len(cache) == 1  # eager again: reused as before
