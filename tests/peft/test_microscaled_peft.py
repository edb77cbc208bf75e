"""PEFT on NVFP4 and MXFP8 bases: get_peft_model(..., LoraConfig(use_dora=True)) on a tiny LLaMA loaded from such a
checkpoint builds dorafp8's DoRA layers, which train as plain PEFT's DoRA does on the dequantized base (logits and
every adapter gradient, dropout included); the adapter saves as PEFT's and reloads with plain PEFT on the dequantized
base to the same outputs; a merge into such a base re-quantizes by the format's own recipe."""

from collections import Counter

import pytest
import torch

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

from peft import PeftModel, get_peft_model  # noqa: E402
from peft.tuners.lora.layer import Linear as LoraLinear  # noqa: E402

from dorafp8 import DoRAFP8Linear, load_fp8_checkpoint  # noqa: E402
from tests._tolerance import assert_close  # noqa: E402
from tests.checkpoint._ckpt_fixtures import meta_model, original_model, read_all, write_modelopt  # noqa: E402
from tests.checkpoint.test_microscaled_load import _dense_twin  # noqa: E402
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


# the merged weight's relative error against PEFT's merge in fp64: the recipes lose 9.5% (NVFP4) and 2.9% (MXFP8) of
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


@pytest.mark.backends("reference", "triton")
def test_dora_on_a_tiny_dit_with_nvfp4_and_mxfp8_linears(backend, monkeypatch):
    """A small SD3-style MMDiT whose Linear layers hold NVFP4 and MXFP8 weights in turn: DoRA on
    every attention and feed-forward Linear computes what plain PEFT computes on the dequantized weights (fp32:
    output and every adapter gradient)."""
    pytest.importorskip("diffusers")
    import copy

    from peft import LoraConfig

    from dorafp8 import FP8Linear, quant
    from tests.integration.test_diffusion import _batches, small_dit

    original = small_dit()
    ours, twin = copy.deepcopy(original), copy.deepcopy(original)
    kinds = []
    for name, mod in list(ours.named_modules()):
        if type(mod) is not torch.nn.Linear:
            continue
        w = mod.weight.detach()
        if w.shape[1] % 16 == 0 and len(kinds) % 2 == 0:  # the two kinds taken in turn
            packed, scale, g = quant.quantize_nvfp4(w)
            layer = FP8Linear.from_fp8(packed, scale, mod.bias.detach().clone(), global_scale=g)
        else:
            w8, scale = quant.quantize_mxfp8(w)
            layer = FP8Linear.from_fp8(w8, scale, mod.bias.detach().clone())
        kinds.append(quant.scale_kind(layer.scale))
        parent, _, attr = name.rpartition(".")
        setattr(ours.get_submodule(parent), attr, layer)
        twin.get_submodule(name).weight.data = layer.dequantize()
    assert set(kinds) == {"nvfp4", "mxfp8"}
    targets = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
               "ff.net.0.proj", "ff.net.2"]
    cfg = LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=targets)
    pm_ours, pm_peft = get_peft_model(ours, cfg), get_peft_model(twin, copy.deepcopy(cfg))
    n_dora = sum(isinstance(m, DoRAFP8Linear) for m in pm_ours.modules())
    assert n_dora == sum(isinstance(m, LoraLinear) for m in pm_peft.modules()) >= 16
    for mdl in (pm_ours, pm_peft):
        _randomize_adapters(mdl)
    calls = _on_backend(pm_ours, backend, monkeypatch)
    (kw, target), = _batches("dit", 1)
    outs = []
    for mdl in (pm_peft, pm_ours):
        out = mdl(**kw).sample
        (out - target).square().mean().backward()
        outs.append(out)
    assert_close(outs[1], outs[0], 5e-6, "output")
    g_ref, g_got = _grads(pm_peft), _grads(pm_ours)
    assert g_ref.keys() == g_got.keys() and len(g_ref) == 3 * n_dora
    for name in g_ref:
        assert_close(g_got[name], g_ref[name], 5e-5, name)
    assert (calls["forward"] >= n_dora and calls["dgrad"] > 0) if backend == "triton" else not calls, calls
