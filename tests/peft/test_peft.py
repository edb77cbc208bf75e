"""Parity with PEFT's own DoRA on LLaMA-style (nn.Linear) and GPT-2-style (Conv1D, fan_in_fan_out) models built from
configs, and PEFT's machinery (state_dict keys, save/load, disable/set adapter, several adapters) around the layer."""

import copy
import io

import pytest
import torch
from torch import nn

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from peft.tuners.lora.layer import Linear as LoraLinear  # noqa: E402

import dorafp8  # noqa: E402
from dorafp8 import DoRAFP8Linear, FP8Linear  # noqa: E402
from tests._layers import n_fp8  # noqa: E402
from tests._tolerance import assert_close  # noqa: E402

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GPT2_TARGETS = ["c_attn", "c_proj", "c_fc"]


def _base_model(kind):
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                                       mlp_bias=True, max_position_embeddings=64)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.GPT2Config(vocab_size=97, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
    return model.float().eval()


def _lora_config(kind, **kw):
    kw.setdefault("r", 8)
    kw.setdefault("lora_alpha", 16)
    kw.setdefault("use_dora", True)
    return LoraConfig(target_modules=LLAMA_TARGETS if kind == "llama" else GPT2_TARGETS,
                      fan_in_fan_out=(kind == "gpt2"), **kw)


def _randomize_adapters(model, adapter="default", seed=1):
    """PEFT initialises B = 0 (DoRA = base): give every adapter tensor a non-trivial value, deterministically."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if f".{adapter}." in name + "." and ("lora_B" in name or "lora_A" in name):
            p.data = torch.randn(p.shape, generator=g).to(p.dtype) * 0.2
        elif f"lora_magnitude_vector.{adapter}" in name:
            p.data = p.data * (1 + 0.2 * torch.randn(p.shape, generator=g)).to(p.dtype)


def _dequantize_bases_in_place(model):
    """Replaces each DoRA layer's base weight by its fp8 round trip: the plain-PEFT twin of a converted model."""
    for mod in model.modules():
        if isinstance(mod, LoraLinear) and not isinstance(mod, DoRAFP8Linear):
            base = mod.get_base_layer()
            w = base.weight.data.T if mod.fan_in_fan_out else base.weight.data
            w8, scale = dorafp8.quantize_e4m3(w)
            wq = dorafp8.dequantize_e4m3(w8, scale, w.dtype)
            base.weight.data = (wq.T if mod.fan_in_fan_out else wq).contiguous()


def _pair(kind, **cfg_kw):
    """(plain PEFT model on the dequantized fp8 base, the same model converted to dorafp8)."""
    model = get_peft_model(_base_model(kind), _lora_config(kind, **cfg_kw))
    _randomize_adapters(model)
    ours = copy.deepcopy(model)
    n = dorafp8.convert_peft_model(ours)
    assert n == (14 if kind == "llama" else 8)
    _dequantize_bases_in_place(model)
    return model, ours


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _run(model, ids, seed=5):
    torch.manual_seed(seed)
    out = model(input_ids=ids).logits
    loss = out.float().pow(2).mean()
    loss.backward()
    return out


IDS = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("cfg_kw", [{}, {"use_rslora": True, "lora_dropout": 0.1}])
@pytest.mark.parametrize("train", [False, True])
def test_parity_with_peft(kind, cfg_kw, train):
    peft_model, ours = _pair(kind, **cfg_kw)
    for mdl in (peft_model, ours):
        mdl.train(train)
    ref = _run(peft_model, IDS)
    got = _run(ours, IDS)
    assert_close(got, ref, 5e-6, "logits")
    g_ref, g_got = _grads(peft_model), _grads(ours)
    assert g_ref.keys() == g_got.keys() and len(g_ref) == (42 if kind == "llama" else 24)
    for name in g_ref:
        assert_close(g_got[name], g_ref[name], 5e-5, name)


def test_converted_layers_and_repr():
    _, ours = _pair("gpt2")
    layer = ours.base_model.model.transformer.h[0].attn.c_attn
    assert isinstance(layer, DoRAFP8Linear) and isinstance(layer.base_layer, FP8Linear)
    assert layer.base_layer.weight.dtype == torch.float8_e4m3fn
    assert (layer.in_features, layer.out_features) == (64, 192)
    text = repr(layer)
    for piece in ("in_features=64", "out_features=192", "r={default=8}", "backend=auto", "float8_e4m3fn"):
        assert piece in text, text


def test_adapter_state_dict_keys_match_peft():
    peft_model, ours = _pair("llama")
    k_ref = set(peft.get_peft_model_state_dict(peft_model).keys())
    k_got = set(peft.get_peft_model_state_dict(ours).keys())
    assert k_ref == k_got
    assert any(k.endswith("lora_magnitude_vector") for k in k_got)


def test_save_pretrained_loads_in_plain_peft(tmp_path):
    """The adapter saved from a dorafp8 model loads onto the original-precision base with plain PEFT and gives the
    outputs of the original (pre-conversion) PEFT model with the same adapter."""
    model = get_peft_model(_base_model("llama"), _lora_config("llama"))
    _randomize_adapters(model)
    original = copy.deepcopy(model)
    dorafp8.convert_peft_model(model)
    model.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(_base_model("llama"), tmp_path).eval()
    with torch.no_grad():
        assert_close(loaded(input_ids=IDS).logits, original(input_ids=IDS).logits, 5e-7, "logits")


def test_disable_set_and_multiple_adapters():
    peft_model, ours = _pair("llama")
    with torch.no_grad():
        with peft_model.disable_adapter(), ours.disable_adapter():
            assert_close(ours(input_ids=IDS).logits, peft_model(input_ids=IDS).logits, 5e-6, "disabled")
        for mdl in (peft_model, ours):
            torch.manual_seed(11)
            mdl.add_adapter("other", _lora_config("llama", r=4, lora_alpha=8))
            _randomize_adapters(mdl, "other", seed=2)
            mdl.set_adapter("other")
        layer = ours.base_model.model.model.layers[0].self_attn.q_proj
        assert set(layer.lora_A) == {"default", "other"} and layer.active_adapters == ["other"]
        assert_close(ours(input_ids=IDS).logits, peft_model(input_ids=IDS).logits, 5e-6, "other")
        # two active adapters at once: PEFT's composition (the second sees the first's output as its base)
        for mdl in (peft_model, ours):
            mdl.base_model.set_adapter(["default", "other"])
        assert_close(ours(input_ids=IDS).logits, peft_model(input_ids=IDS).logits, 5e-6, "both")
        for mdl in (peft_model, ours):
            mdl.set_adapter("default")
        assert_close(ours(input_ids=IDS).logits, peft_model(input_ids=IDS).logits, 5e-6, "default")


def test_merge_and_unload_requantizes_with_a_warning():
    """Merging into the fp8 base re-quantizes (tests/checkpoint/test_checkpoint.py checks the values); it warns that it
    does."""
    _, ours = _pair("llama")
    with pytest.warns(UserWarning, match="re-quantizes the merged weight"):
        merged = ours.merge_and_unload()
    assert sum(isinstance(m, FP8Linear) for m in merged.modules()) == 14


@pytest.mark.parametrize("cfg_kw", [{}, {"lora_dropout": 0.1}, {"use_dora": False},
                                    {"use_dora": False, "lora_dropout": 0.1}],
                         ids=["dora", "dora-dropout", "lora", "lora-dropout"])
def test_fp8_first_workflow(cfg_kw):
    """quantize_model then get_peft_model builds DoRAFP8Linear layers (for plain LoRA too: LoRA users of fp8 bases,
    kohya's among them, are many) whose DoRA magnitude is the fp8 weight's norm, and which train as plain PEFT does on
    the dequantized base with the same adapters: logits and every adapter gradient, dropout's masks included."""
    dora = cfg_kw.get("use_dora", True)
    model = _base_model("llama")
    twin = copy.deepcopy(model)
    for name, mod in twin.named_modules():  # the plain twin: same fp8 round trip, in full precision
        if name.split(".")[-1] in LLAMA_TARGETS:
            mod.weight.data = dorafp8.dequantize_e4m3(*dorafp8.quantize_e4m3(mod.weight.data))
    assert n_fp8(dorafp8.quantize_model(model, LLAMA_TARGETS)) == 14
    torch.manual_seed(4)
    pm = get_peft_model(model, _lora_config("llama", **cfg_kw))
    layers = [m for m in pm.modules() if isinstance(m, LoraLinear)]
    assert len(layers) == 14 and all(isinstance(m, DoRAFP8Linear) for m in layers)
    q = pm.base_model.model.model.layers[0].self_attn.q_proj
    assert q.lora_A["default"].weight.dtype == torch.float32
    if dora:
        expected = dorafp8.dequantize_e4m3(q.base_layer.weight, q.base_layer.scale).norm(dim=1)
        assert_close(q.lora_magnitude_vector["default"].weight.detach(), expected, 5e-7, "magnitude")
    else:
        assert not q.lora_magnitude_vector
    # and it computes what plain PEFT computes on the dequantized base with the same adapter
    torch.manual_seed(4)
    plain = get_peft_model(twin, _lora_config("llama", **cfg_kw))
    for mdl in (pm, plain):
        _randomize_adapters(mdl)
        mdl.train()
    ref, got = _run(plain, IDS), _run(pm, IDS)
    assert_close(got, ref, 5e-6, "logits")
    g_ref, g_got = _grads(plain), _grads(pm)
    assert g_ref.keys() == g_got.keys() and len(g_ref) == (42 if dora else 28)
    for name in g_ref:
        assert_close(g_got[name], g_ref[name], 5e-5, name)


def test_weight_norm_cache_reuse_and_invalidation():
    _, ours = _pair("llama")
    ours.train()
    layer = ours.base_model.model.model.layers[0].mlp.up_proj
    calls = []
    orig = dorafp8.peft.linear.weight_norm

    def counting(*a, **k):
        calls.append(1)
        return orig(*a, **k)

    dorafp8.peft.linear.weight_norm = counting
    try:
        opt = torch.optim.SGD([p for p in ours.parameters() if p.requires_grad], lr=0.1)
        for _ in range(3):  # gradient accumulation: one norm for the three micro-batches, forward and backward
            ours(input_ids=IDS).logits.sum().backward()
        assert len(calls) == 14
        n_before = layer.dora_weight_norm("default").clone()
        opt.step()  # in-place update bumps the version counters: the next forward recomputes
        ours(input_ids=IDS)
        assert len(calls) == 28
        n_after = layer.dora_weight_norm("default")
        fresh = dorafp8.weight_norm(layer.base_layer.weight, layer.base_layer.scale, layer.lora_A["default"].weight,
                                    layer.lora_B["default"].weight, layer.scaling["default"])
        assert torch.equal(n_after, fresh) and not torch.equal(n_before, n_after)
        # load_state_dict copies in place: not stale either
        sd = {k: v.clone() for k, v in ours.state_dict().items()}
        with torch.no_grad():
            for p in ours.parameters():
                if p.requires_grad:
                    p.mul_(0.5)
        ours.load_state_dict(sd)
        assert torch.equal(layer.dora_weight_norm("default"), fresh)
    finally:
        dorafp8.peft.linear.weight_norm = orig


def test_state_dict_round_trip_bit_exact(tmp_path):
    _, ours = _pair("gpt2")
    buf = io.BytesIO()
    torch.save(ours.state_dict(), buf)
    buf.seek(0)
    loaded_sd = torch.load(buf)
    _, fresh = _pair("gpt2")
    with torch.no_grad():  # scramble, then load: every fp8 byte and scale must come back exactly
        for mod in fresh.modules():
            if isinstance(mod, FP8Linear):
                mod.weight.data = torch.zeros_like(mod.weight)
                mod.scale.fill_(3.0)
    fresh.load_state_dict(loaded_sd)
    for (k, a), (k2, b) in zip(ours.state_dict().items(), fresh.state_dict().items()):
        assert k == k2 and a.dtype == b.dtype
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), k


def test_fp8linear_survives_dtype_casts_and_rejects_float_weights():
    lin = nn.Linear(40, 24)
    f = FP8Linear.from_float(lin)
    w, s = f.weight.detach().clone(), f.scale.clone()
    f.to(torch.bfloat16)
    assert f.weight.dtype == torch.float8_e4m3fn and f.scale.dtype == torch.float32
    assert torch.equal(f.weight.view(torch.uint8), w.view(torch.uint8)) and torch.equal(f.scale, s)
    assert f.bias.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="FP8Linear expects a float8_e4m3fn weight"):
        f.load_state_dict(lin.state_dict())


def test_merge_touches_only_layers_holding_the_adapter():
    """merge_adapter(["other"]) with "other" on q_proj only: the other fp8 layers, as PEFT's layers, are left as they
    are (they were re-quantized and marked merged, which then dropped the active adapter from their forward); a name
    no layer has is an error naming it, before anything changes (it silently re-quantized every layer)."""
    _, ours = _pair("llama")
    ours.add_adapter("other", LoraConfig(r=4, use_dora=True, target_modules=["q_proj"]))
    ours.add_adapter("emb", LoraConfig(r=4, target_modules=["embed_tokens"]))  # in lora_embedding_A, not lora_A
    layers = {n: m for n, m in ours.named_modules() if isinstance(m, DoRAFP8Linear)}
    before = {n: m.base_layer.weight.view(torch.uint8).clone() for n, m in layers.items()}
    for op in ("merge_adapter", "merge_and_unload"):
        with pytest.raises(ValueError, match=r"adapter_names: \['nope'\] are not adapters.*'emb', 'other'\]"):
            getattr(ours, op)(adapter_names=["nope"])
        assert all(not m.merged and torch.equal(m.base_layer.weight.view(torch.uint8), before[n])
                   for n, m in layers.items())
    with pytest.warns(UserWarning, match="re-quantizes the merged weight"):
        ours.merge_adapter(["other"])
    for n, m in layers.items():
        q = n.endswith("q_proj")
        assert m.merged_adapters == (["other"] if q else []), n
        assert torch.equal(m.base_layer.weight.view(torch.uint8), before[n]) != q, n
    ours.merge_adapter(["emb"])  # a name only an Embedding holds is an adapter too
    assert ours.base_model.model.model.embed_tokens.merged_adapters == ["emb"]


def test_modules_to_save_holding_an_fp8_layer_is_refused():
    """PEFT trains a full copy of each module in modules_to_save: an fp8 one was marked trainable and got no gradient,
    silently never trained (a SEQ_CLS model's `score` head, which quantize_model quantizes and PEFT adds itself, stayed
    random). Refused before any layer changes, naming the module and the exclude_modules that keeps it dense."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, num_labels=3, pad_token_id=0)
    cases = [(transformers.LlamaForCausalLM(cfg), {"modules_to_save": ["k_proj"]}, "k_proj"),
             (transformers.LlamaForSequenceClassification(cfg), {"task_type": "SEQ_CLS"}, "score")]
    for model, kw, name in cases:
        dorafp8.quantize_model(model, verbose=False)
        with pytest.raises(ValueError, match=rf"holds the fp8 layer '(model.layers.0.self_attn.)?{name}'.*"
                                             rf"exclude_modules=\['{name}'\]"):
            get_peft_model(model, LoraConfig(r=4, use_dora=True, target_modules=["q_proj"], **kw))
        assert not any(isinstance(m, LoraLinear) for m in model.modules())
    model = dorafp8.quantize_model(transformers.LlamaForSequenceClassification(cfg), exclude_modules=["score"],
                                   verbose=False)
    pm = get_peft_model(model, LoraConfig(r=4, use_dora=True, target_modules=["q_proj"], task_type="SEQ_CLS"))
    pm(input_ids=IDS, labels=torch.tensor([0, 2])).loss.backward()
    assert pm.base_model.model.score.modules_to_save["default"].weight.grad is not None


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_2", "olora", "corda", "loftq", "mica"])
def test_init_from_the_base_weight_is_refused_by_name(init):
    """PEFT's inits computed from the base weight (all but MiCA rewrite it with a residual, on load too) met the e4m3
    weight: PiSSA / OLoRA / MiCA failed with PEFT's dtype errors, LoftQ asked for a GPU. Refused by name before any
    layer changes, saying what works; a layer added later by add_adapter too."""
    extra = {"loftq_config": peft.LoftQConfig(loftq_bits=4)} if init == "loftq" else {}
    model = dorafp8.quantize_model(_base_model("llama"), LLAMA_TARGETS, verbose=False)
    before = {n: t.view(torch.uint8).clone() for n, t in model.state_dict().items() if t.dtype == torch.float8_e4m3fn}
    with pytest.raises(ValueError, match=rf"init_lora_weights='{init}'.*fp8 base.*init_lora_weights=True"):
        get_peft_model(model, _lora_config("llama", init_lora_weights=init, **extra))
    assert not any(isinstance(m, LoraLinear) for m in model.modules())
    assert all(torch.equal(t.view(torch.uint8), before[n]) for n, t in model.state_dict().items() if n in before)
    pm = get_peft_model(model, _lora_config("llama"))
    with pytest.raises(ValueError, match=rf"init_lora_weights='{init}'"):
        pm.add_adapter("other", _lora_config("llama", init_lora_weights=init, **extra))
    assert all("other" not in m.lora_A for m in pm.modules() if isinstance(m, LoraLinear))


def test_orthogonal_and_lora_ga_inits_match_peft_on_the_dequantized_base():
    """"orthogonal" (random, not from the weight) cast the new adapter to the base weight's dtype, e4m3: its values
    were silently rounded. Now PEFT's values on the dequantized base, same seed. LoRA-GA without preprocess_loraga's
    gradient (an adapter being loaded) initialises as PEFT does; with it, it would rewrite the weight: refused."""
    model = _base_model("llama")
    twin = copy.deepcopy(model)
    for name, mod in twin.named_modules():
        if name.split(".")[-1] in LLAMA_TARGETS:
            mod.weight.data = dorafp8.dequantize_e4m3(*dorafp8.quantize_e4m3(mod.weight.data))
    dorafp8.quantize_model(model, LLAMA_TARGETS, verbose=False)
    from peft.tuners.lora.layer import LoraLayer

    adapters = ("default", "ga") if hasattr(LoraLayer, "lora_ga_init") else ("default",)  # LoRA-GA: peft >= 0.19
    pms = []
    for base in (model, twin):
        torch.manual_seed(4)
        pm = get_peft_model(base, _lora_config("llama", init_lora_weights="orthogonal"))
        torch.manual_seed(5)
        if "ga" in adapters:
            pm.add_adapter("ga", _lora_config("llama", init_lora_weights="lora_ga"))
        pms.append(pm)
    ours, ref = (m.base_model.model.model.layers[1].mlp.down_proj for m in pms)
    assert isinstance(ours, DoRAFP8Linear) and not isinstance(ref, DoRAFP8Linear)
    for a in adapters:
        for attr in ("lora_A", "lora_B", "lora_magnitude_vector"):
            assert_close(getattr(ours, attr)[a].weight, getattr(ref, attr)[a].weight, 5e-7, f"{a} {attr}")
    with torch.no_grad():
        assert_close(pms[0](input_ids=IDS).logits, pms[1](input_ids=IDS).logits, 5e-6, "logits")
    q = pms[0].base_model.model.model.layers[0].self_attn.q_proj
    q.base_layer._peft_loraga_grad = torch.zeros(q.out_features, q.in_features)
    with pytest.raises(ValueError, match="init_lora_weights='lora_ga'"):
        pms[0].add_adapter("ga2", _lora_config("llama", init_lora_weights="lora_ga"))


def test_eva_init_matches_peft_on_the_dequantized_base():
    """EVA, computed from the layer inputs (not the weight), on the fp8 base: the adapter and magnitude PEFT computes
    on the dequantized base."""
    model = _base_model("llama")
    twin = copy.deepcopy(model)
    for name, mod in twin.named_modules():
        if name.endswith("q_proj"):
            mod.weight.data = dorafp8.dequantize_e4m3(*dorafp8.quantize_e4m3(mod.weight.data))
    dorafp8.quantize_model(model, ["q_proj"], verbose=False)
    data = [{"input_ids": torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(i))} for i in range(4)]
    layers = []
    for base in (model, twin):
        pm = get_peft_model(base, LoraConfig(r=4, use_dora=True, target_modules=["q_proj"], init_lora_weights="eva",
                                             eva_config=peft.tuners.lora.EvaConfig(rho=1.0)))
        peft.initialize_lora_eva_weights(pm, data, show_progress_bar=False)
        layers.append(pm.base_model.model.model.layers[0].self_attn.q_proj)
    ours, ref = layers
    assert isinstance(ours, DoRAFP8Linear) and not isinstance(ref, DoRAFP8Linear)
    for attr in ("lora_A", "lora_B", "lora_magnitude_vector"):
        assert_close(getattr(ours, attr)["default"].weight, getattr(ref, attr)["default"].weight, 5e-6, attr)
