"""PEFT on NVFP4 and MXFP8 bases: get_peft_model(..., LoraConfig(use_dora=True)) on a tiny LLaMA loaded from such a
checkpoint builds dorafp8's DoRA layers, which train as plain PEFT's DoRA does on the dequantized base (logits and
every adapter gradient, dropout included); a tiny LLaMA and a small DiT on such layers, in every dtype a model is held
in and with dropout, compute what PEFT's DoRA computes in fp64 on the dequantized weights; the adapter saves as
PEFT's and reloads with plain PEFT on the dequantized base to the same outputs; a merge into such a base
re-quantizes by the format's own recipe."""

import copy
from collections import Counter

import pytest
import torch

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

from peft import PeftModel, get_peft_model  # noqa: E402
from peft.tuners.lora.layer import Linear as LoraLinear  # noqa: E402

from dorafp8 import DoRAFP8Linear, load_fp8_checkpoint  # noqa: E402
from tests._tolerance import assert_close, tol  # noqa: E402
from tests.checkpoint._ckpt_fixtures import meta_model, original_model, read_all, write_modelopt  # noqa: E402
from tests.checkpoint.test_microscaled_load import _dense_twin  # noqa: E402
from tests.kernels.test_microscaled import dequant_64  # noqa: E402
from tests.peft.test_peft import IDS, _grads, _lora_config, _randomize_adapters, _run  # noqa: E402


def _pair(tmp_path, algo, **cfg_kw):
    """(plain PEFT on the dense dequantized twin, PEFT on the model loaded from the ModelOpt `algo` file), the same
    adapters in both."""
    path = write_modelopt(original_model(), str(tmp_path / algo), algo)
    model = meta_model()
    load_fp8_checkpoint(model, path, verbose=False)
    twin = _dense_twin(read_all(path), "weight", reciprocal=False)
    ours, plain = get_peft_model(model, _lora_config("llama", **cfg_kw)), get_peft_model(
        twin, _lora_config("llama", **cfg_kw))
    for mdl in (ours, plain):
        _randomize_adapters(mdl)
    return plain, ours, twin


def _on_backend(model, backend: str, monkeypatch) -> Counter:
    """Every FP8Linear of `model` on `backend` (tests/conftest.py's parametrization: "triton" runs the fused kernels,
    in Triton's interpreter without a GPU). Returns the calls of the Triton backend's fused forward and dgrad
    launchers, counted from here on."""
    import dorafp8.triton_kernels as tk
    from dorafp8 import FP8Linear

    calls: Counter = Counter()
    for name in ("forward", "dgrad"):
        def counted(*a, _orig=getattr(tk, name), _name=name, **kw):
            calls[_name] += 1
            return _orig(*a, **kw)
        monkeypatch.setattr(tk, name, counted)
    for m in model.modules():
        if isinstance(m, FP8Linear):
            m.backend = backend
    return calls


@pytest.mark.backends("reference", "triton")
@pytest.mark.parametrize("algo", ["NVFP4", "MXFP8"])
@pytest.mark.parametrize("cfg_kw", [{}, {"lora_dropout": 0.1}])
def test_dora_on_microscaled_base_matches_plain_peft(tmp_path, algo, cfg_kw, backend, monkeypatch):
    plain, ours, _ = _pair(tmp_path, algo, **cfg_kw)
    layers = [m for m in ours.modules() if isinstance(m, LoraLinear)]
    assert len(layers) == 14 and all(isinstance(m, DoRAFP8Linear) for m in layers)
    calls = _on_backend(ours, backend, monkeypatch)
    for mdl in (plain, ours):
        mdl.train()
    ref, got = _run(plain, IDS), _run(ours, IDS)
    assert_close(got, ref, 5e-6, "logits")
    g_ref, g_got = _grads(plain), _grads(ours)
    assert g_ref.keys() == g_got.keys() and len(g_ref) == 42
    for name in g_ref:
        assert_close(g_got[name], g_ref[name], 5e-5, name)
    # on triton every layer's forward by the fused kernels, and every input gradient that is needed (not those of
    # layer 0's q, k and v, whose input is the frozen embedding's output); none on the reference
    assert calls == (Counter(forward=14, dgrad=11) if backend == "triton" else Counter()), calls


def test_adapter_reloads_with_plain_peft_on_the_dequantized_base(tmp_path):
    plain, ours, _ = _pair(tmp_path, "NVFP4")
    ours.eval()
    with torch.no_grad():
        want = ours(input_ids=IDS).logits
    ours.save_pretrained(tmp_path / "adapter")
    twin = _dense_twin(read_all(str(tmp_path / "NVFP4")), "weight", reciprocal=False)
    loaded = PeftModel.from_pretrained(twin, tmp_path / "adapter").eval()
    with torch.no_grad():
        assert_close(loaded(input_ids=IDS).logits, want, 5e-6, "logits")


# the merged weight's relative error against PEFT's merge in fp64: the recipes lose 9.5% (NVFP4) and 2.7% (MXFP8) of
# a Gaussian [1024, 1024] weight (measured); the bounds leave room for the tiny LLaMA's small layers, and a weight
# quantized to the wrong grid or scale is off by far more
MERGE_ERROR_BOUND = {"NVFP4": 0.13, "MXFP8": 0.04}


@pytest.mark.parametrize("algo", ["NVFP4", "MXFP8"])
def test_merge_requantizes_by_the_formats_recipe(tmp_path, algo, monkeypatch):
    """merge_adapter into an NVFP4 (MXFP8) base computes each merged weight in fp32 blocks of rows (forced small here,
    so that NVFP4's global scale spans several) and re-quantizes it by the format's own recipe: the bytes are those of
    quantize_nvfp4 (quantize_mxfp8) of the whole merged weight, the layer stays in its format, and its error against
    PEFT's merge in fp64 is last_merge_error and under the bound; unmerge puts the bytes back; merge_and_unload
    leaves FP8Linear layers of the format."""
    from dorafp8 import FP8Linear, merge, quant

    _, ours, _ = _pair(tmp_path, algo)
    monkeypatch.setattr(quant, "_BLOCK_BYTES", 4 * 64 * 5)  # 5 rows a block at K = 64, fewer at larger K
    layers = {n: m for n, m in ours.named_modules() if isinstance(m, DoRAFP8Linear)}
    before, want = {}, {}
    for n, lay in layers.items():
        base = lay.get_base_layer()
        before[n] = (base.weight.clone(), base.scale.clone(), base.global_scale)
        terms = merge.adapter_terms(lay, ["default"])
        # the fp32 rows the merge sees, in its blocks (a matmul's rounding may depend on how many rows it has)
        fp32 = torch.cat([merge.merged_rows(base.weight, base.scale, 128, terms, j0, j1, base.global_scale)
                          for j0, j1 in quant.row_blocks(*quant.weight_dims(base.weight))])
        A, B, s, mag, _ = terms[0]
        V = base.dequantize(torch.float64) + s * B.double() @ A.double()
        want[n] = (fp32, mag.double()[:, None] / V.norm(dim=1, keepdim=True) * V)
    with pytest.warns(UserWarning, match=f"{algo} base re-quantizes the merged weight by"):
        ours.merge_adapter()
    for n, lay in layers.items():
        base, (fp32, ref) = lay.get_base_layer(), want[n]
        if algo == "NVFP4":
            w, sc, g = quant.quantize_nvfp4(fp32)
            assert torch.equal(base.global_scale, g), n
        else:
            (w, sc), g = quant.quantize_mxfp8(fp32), None
        assert torch.equal(base.weight.view(torch.uint8), w.view(torch.uint8)), n
        assert torch.equal(base.scale.view(torch.uint8), sc.view(torch.uint8)), n
        err = float((base.dequantize(torch.float64) - ref).norm() / ref.norm())
        assert abs(err - lay.last_merge_error) <= 1e-3 * err and err < MERGE_ERROR_BOUND[algo], (n, err)
    ours.unmerge_adapter()
    for n, lay in layers.items():
        base = lay.get_base_layer()
        assert torch.equal(base.weight.view(torch.uint8), before[n][0].view(torch.uint8))
        assert torch.equal(base.scale.view(torch.uint8), before[n][1].view(torch.uint8))
        assert base.global_scale is before[n][2]
    merged = ours.merge_and_unload()
    kinds = {quant.scale_kind(m.scale) for m in merged.modules() if isinstance(m, FP8Linear)}
    assert kinds == {algo.lower()}


@pytest.mark.parametrize("use_dora", [False, True])
@pytest.mark.parametrize("kind", ["nvfp4", "mxfp8"])
def test_merging_an_adapter_that_changes_nothing_keeps_the_base(kind, use_dora):
    """PEFT's fresh adapter (B = 0: LoRA adds nothing, DoRA's magnitude is the weight's norm) merged into a base that
    ModelOpt quantized leaves its values as they were, with last_merge_error 0. On an MXFP8 base the OCP example
    recipe, which the merge used, clipped about 1 in 5 blocks' largest value (0.9% of the weight's norm lost)."""
    from peft import LoraConfig

    from dorafp8 import FP8Linear, quant
    from tests.kernels.test_microscaled import modelopt_mxfp8

    W = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    base = FP8Linear.from_fp8(*quant.quantize_nvfp4(W)[:2], None, global_scale=quant.quantize_nvfp4(W)[2]) \
        if kind == "nvfp4" else FP8Linear.from_fp8(*modelopt_mxfp8(W), None)
    before = base.dequantize(torch.float64)
    model = get_peft_model(torch.nn.Sequential(base), LoraConfig(r=4, target_modules=["0"], use_dora=use_dora))
    with pytest.warns(UserWarning, match="re-quantizes the merged weight"):
        model.merge_adapter()
    layer = model.base_model.model[0]
    assert isinstance(layer, DoRAFP8Linear) and layer.last_merge_error == 0.0
    assert torch.equal(layer.get_base_layer().dequantize(torch.float64), before)


def _micro_in_turn(model) -> dict:
    """Every nn.Linear of `model` but an output head (lm_head) replaced in place by an FP8Linear holding its NVFP4 and
    its MXFP8 quantization in turn (MXFP8 where K is no multiple of 16); returns the new layers by name."""
    from dorafp8 import FP8Linear, quant

    layers = {}
    for name, mod in list(model.named_modules()):
        if type(mod) is not torch.nn.Linear or name.endswith("lm_head"):
            continue
        w, bias = mod.weight.detach(), None if mod.bias is None else mod.bias.detach().clone()
        if w.shape[1] % 16 == 0 and len(layers) % 2 == 0:
            packed, scale, g = quant.quantize_nvfp4(w)
            layer = FP8Linear.from_fp8(packed, scale, bias, global_scale=g)
        else:
            layer = FP8Linear.from_fp8(*quant.quantize_mxfp8(w), bias)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, layer)
        layers[name] = layer
    assert {quant.scale_kind(m.scale) for m in layers.values()} == {"nvfp4", "mxfp8"}
    return layers


def _tiny(kind: str):
    """(model, LoraConfig target_modules, the inputs of one batch, the output of a forward): test_peft.py's tiny
    LLaMA (biases on every Linear; 2 x 11 tokens) or test_diffusion.py's small SD3-style MMDiT (joint attention)."""
    if kind == "llama":
        from tests.peft.test_peft import LLAMA_TARGETS, _base_model

        return _base_model("llama"), LLAMA_TARGETS, {"input_ids": IDS}, lambda out: out.logits
    pytest.importorskip("diffusers")
    from tests.integration.test_diffusion import _batches, small_dit

    targets = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
               "ff.net.0.proj", "ff.net.2"]
    (inputs, _), = _batches("dit", 1)
    # one 8 x 8 latent (16 patches; the model crops its position embedding to it): the interpreter's time
    inputs = {k: v[:1, :, :8, :8] if k == "hidden_states" else v[:1] for k, v in inputs.items()}
    return small_dit(), targets, inputs, lambda out: out.sample


# how PEFT users hold a model: (the dtype of the model and of its adapters, the autocast dtype or None)
HELD = {"fp32": (torch.float32, None), "bf16-autocast": (torch.float32, torch.bfloat16),
        "bf16": (torch.bfloat16, None), "fp16-autocast": (torch.float32, torch.float16),
        "fp16": (torch.float16, None)}


@pytest.mark.backends("reference", "triton")
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("held", HELD)
@pytest.mark.parametrize("kind", ["llama", "dit"])
def test_dora_on_nvfp4_and_mxfp8_linears_matches_fp64(kind, held, dropout, backend, monkeypatch):
    """A tiny LLaMA and a small SD3-style DiT whose Linear layers hold NVFP4 and MXFP8 weights in turn, DoRA on every
    attention and MLP / feed-forward Linear, held as PEFT users hold them (fp32; fp32 model and adapters under bf16
    or fp16 autocast; the model cast to bf16 or fp16, adapters with it), with and without dropout: the output and
    every adapter gradient against PEFT's DoRA in fp64 on the same values. Those are the weights dequantized from
    their bytes by tests/kernels/test_microscaled.py's dequant_64 (bit arithmetic, not dorafp8's dequantization),
    every other parameter as rounded to the model's dtype, the inputs as ours get them, and the same dropout masks
    (one seed: dorafp8 draws PEFT's mask, dorafp8/ops/_policy.py dropout_mask, whatever the dtype it draws it in).
    Tolerance: the output 2 tol(compute dtype) (tests/_tolerance.py: a check between two computations that each
    carry the dtype's error, as the model's own 16-bit ops add theirs to PEFT's run too; seen: at most 0.9 tol here,
    0.7 tol for plain PEFT held the same way), each gradient 5 tol (a backward through the whole model: the output's
    error, then two GEMMs a layer on the way back; seen: at most 2.9 tol, a bf16-autocast DiT's lora_A, where plain
    PEFT held the same way is at 2.5 tol). A weight off by a block's scale or by NVFP4's global scale, or a dropped
    input gradient not scaled by 1 / (1 - p), is off by more (all seen failing, in bf16 too)."""
    from peft import LoraConfig

    dtype, autocast = HELD[held]
    model, targets, inputs, out_of = _tiny(kind)
    ours, ref = copy.deepcopy(model), copy.deepcopy(model)
    layers = _micro_in_turn(ours)
    cfg = LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=targets, lora_dropout=dropout)
    ours, ref = get_peft_model(ours, cfg), get_peft_model(ref, copy.deepcopy(cfg))
    _randomize_adapters(ours)
    ours.to(dtype)
    ref.to(dtype).double()  # every parameter rounded as ours are, then exact in fp64
    adapters = {k: v for k, v in ours.state_dict().items() if "lora_" in k}
    assert not ref.load_state_dict(adapters, strict=False).unexpected_keys
    for name, lay in layers.items():
        ref.base_model.model.get_submodule(name).weight.data = dequant_64(lay.weight, lay.scale, lay.global_scale)
    n_dora = sum(isinstance(m, DoRAFP8Linear) for m in ours.modules())
    assert n_dora == sum(isinstance(m, LoraLinear) for m in ref.modules()) >= 14
    calls = _on_backend(ours, backend, monkeypatch)
    # the same inputs (rounded to the model's dtype) and cotangent (bf16 values: exact in fp16 and fp64) for both
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    outs = []
    for mdl, cast in ((ours, autocast), (ref, None)):
        mdl.train()
        torch.manual_seed(5)  # the dropout masks
        with torch.autocast("cpu", dtype=cast or torch.bfloat16, enabled=cast is not None):
            out = out_of(mdl(**{k: v.double() if mdl is ref and v.is_floating_point() else v
                                for k, v in inputs.items()}))
        cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16).double()
        (out.double() * cot).sum().backward()
        outs.append(out)
    rel = tol(autocast or dtype)
    assert outs[0].dtype == (autocast or dtype)
    assert_close(outs[0], outs[1], 2 * rel, "output")
    got, want = _grads(ours), _grads(ref)
    assert got.keys() == want.keys() and len(want) == 3 * n_dora
    for name in want:
        assert_close(got[name], want[name], 5 * rel, name)
    assert (calls["forward"] >= n_dora and calls["dgrad"] > 0) if backend == "triton" else not calls, calls


def test_the_cached_norm_follows_the_nvfp4_global_scale(tmp_path):
    """NVFP4's second scale is part of the weight: a write to it alone (a load of another file's value through
    copy_) must not leave the norm of the old weight in the CPU cache."""
    _, ours, _ = _pair(tmp_path, "NVFP4")
    layer = next(m for m in ours.modules() if isinstance(m, DoRAFP8Linear))
    with torch.no_grad():
        n1 = layer.dora_weight_norm("default")
        layer.get_base_layer().global_scale.mul_(2)
        n2 = layer.dora_weight_norm("default")
    assert torch.equal(n2, layer.dora_weight_norm("default", use_cache=False))
    assert not torch.equal(n1, n2)
