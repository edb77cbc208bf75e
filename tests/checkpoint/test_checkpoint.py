"""Issue #12: the fp8 checkpoints people have (ComfyUI, compressed-tensors, transformers fine-grained FP8, fp8 casts)
into FP8Linear layers on a meta-device model, DoRA on them, and back out: same layout bit-exact, merged exports
within the merge error they report. Checkpoints are written by each layout's own library where it runs on CPU
(tests/checkpoint/_ckpt_fixtures.py says how), on a LLaMA-style model of hidden size 64; nothing is downloaded."""

import copy
import json
import os
import tempfile
import warnings
from unittest import mock

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("accelerate")
peft = pytest.importorskip("peft")

import dorafp8  # noqa: E402
from dorafp8 import FP8Linear  # noqa: E402
from dorafp8.checkpoint import TRANSFORMERS_FORMATS, CheckpointFormatError  # noqa: E402
from tests.checkpoint import _ckpt_fixtures as F  # noqa: E402
from tests._tolerance import tol, within  # noqa: E402

E4M3 = torch.float8_e4m3fn
IDS = F.IDS
HAVE_CT = __import__("importlib").util.find_spec("compressed_tensors") is not None

# layout case -> (writer, format it must be detected as, quantize_model kwargs giving the same scale layout)
CASES = {
    "ct-channel": (lambda m, d: F.write_compressed_tensors(m, d / "ct_channel", "FP8_DYNAMIC"),
                   "compressed-tensors", dict(per_row_scale=True)),
    "ct-tensor-static": (lambda m, d: F.write_compressed_tensors(m, d / "ct_tensor", "FP8"), "compressed-tensors", {}),
    "ct-block": (lambda m, d: F.write_compressed_tensors(m, d / "ct_block", "FP8_BLOCK", block=32),
                 "compressed-tensors", dict(block_size=32)),
    "fine-grained": (lambda m, d: F.write_fine_grained(m, str(d / "fine_grained"), block=32), "fine-grained",
                     dict(block_size=32)),
    "comfyui": (lambda m, d: F.write_comfy(m, str(d / "comfy.safetensors")), "comfyui", {}),
    "comfyui-quant": (lambda m, d: F.write_comfy(m, str(d / "comfyq.safetensors"), quant_keys=True),
                      "comfyui-quant", {}),
    "fp8-cast": (lambda m, d: F.write_fp8_cast(m, str(d / "cast")), "fp8-cast", {}),
    "dorafp8": (lambda m, d: F.write_dorafp8(m, str(d / "dorafp8")), "dorafp8", dict(per_row_scale=True)),
}
NEEDS_CT = {"ct-channel", "ct-tensor-static", "ct-block"}


def _params():
    return [pytest.param(c, marks=pytest.mark.skipif(c in NEEDS_CT and not HAVE_CT, reason="compressed-tensors "
                                                    "not installed")) for c in CASES]


@pytest.fixture(scope="module")
def original():
    return F.original_model()


@pytest.fixture(scope="module")
def ckpt(original, tmp_path_factory):
    """case -> path, each written once per module."""
    d = tmp_path_factory.mktemp("ckpts")
    cache = {}

    def get(case):
        if case not in cache:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cache[case] = str(CASES[case][0](original, d))
        return cache[case]
    return get


def _load(path, how="accelerate", **kw):
    model = F.meta_model(how=how)
    report = dorafp8.load_fp8_checkpoint(model, path, verbose=False, **kw)
    return model.eval(), report


def _u8(t):
    return t.view(torch.uint8) if t.dtype == E4M3 else t


def _fp8_layers(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, FP8Linear)}


@pytest.mark.parametrize("case", _params())
def test_detected_and_loaded_as_fp8_linear(case, ckpt):
    path = ckpt(case)
    fmt, evidence = dorafp8.detect_format(path)
    assert fmt == CASES[case][1], evidence
    model, report = _load(path)
    assert report.format == fmt
    layers = _fp8_layers(model)
    assert len(layers) == 14 and set(report.fp8_layers) == set(layers)
    assert not report.missing and not report.unexpected
    assert isinstance(model.lm_head, torch.nn.Linear) and not isinstance(model.lm_head, FP8Linear)
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    assert "fp8 layers" in str(report) and fmt in str(report)


@pytest.mark.parametrize("case", _params())
def test_round_trip_is_bit_exact(case, ckpt, tmp_path):
    """load -> save in the same layout -> every tensor back: same keys, dtypes, shapes and bytes (scales included),
    and for single files the same safetensors metadata."""
    path = ckpt(case)
    model, _ = _load(path)
    # a layout transformers cannot read goes to a single file (a directory would get a transformers config.json)
    single = path.endswith(".safetensors") or CASES[case][1] not in TRANSFORMERS_FORMATS
    out = str(tmp_path / ("rt.safetensors" if single else "rt"))
    rep = dorafp8.save_fp8_checkpoint(model, out, verbose=False)
    assert rep.format == CASES[case][1] and all(d["action"] == "kept" for d in rep.layers.values())
    a, b = F.read_all(path), F.read_all(out)
    assert sorted(a) == sorted(b)
    for k in a:
        assert (a[k].dtype, a[k].shape) == (b[k].dtype, b[k].shape), k
        assert torch.equal(_u8(a[k]), _u8(b[k])), k
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(path, "pt") as f1, safe_open(out, "pt") as f2:
            assert f1.metadata() == f2.metadata()


@pytest.mark.parametrize("case", _params())
def test_same_as_quantize_model(case, ckpt, original):
    """A model loaded from the layout computes what quantize_model makes of the same weights with the same scale
    layout. The writers' recipes give the same e4m3 bytes here; transformers stores 1 / (448 / amax) where
    quantize_e4m3 computes amax / 448, which may differ in the last bit of the fp32 scale."""
    model, _ = _load(ckpt(case))
    twin = copy.deepcopy(original)
    if case == "fp8-cast":  # cast weights are wrapped with scale 1 by quantize_model too
        for n, m in twin.named_modules():
            if n.split(".")[-1] in F.LINEARS:
                m.weight.data = m.weight.data.to(E4M3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dorafp8.quantize_model(twin, **CASES[case][2])
    ours, theirs = _fp8_layers(model), _fp8_layers(twin)
    assert ours.keys() == theirs.keys()
    for n in ours:
        assert torch.equal(_u8(ours[n].weight), _u8(theirs[n].weight)), n
        if case == "fine-grained":
            ulp = torch.nextafter(theirs[n].scale, torch.tensor(float("inf"))) - theirs[n].scale
            assert ((ours[n].scale - theirs[n].scale).abs() <= ulp).all(), n
        else:
            assert torch.equal(ours[n].scale, theirs[n].scale), n
    with torch.no_grad():
        a, b = model(input_ids=IDS).logits, twin(input_ids=IDS).logits
    if case == "fine-grained":
        within(((a - b).norm() / b.norm()).item(), tol(torch.float32), "fine-grained logits")
    else:
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", _params())
def test_dora_fine_tune_runs(case, ckpt):
    model, _ = _load(ckpt(case))
    before = {n: (_u8(m.weight).clone(), m.scale.clone()) for n, m in _fp8_layers(model).items()}
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules="all-linear"))
    assert sum(isinstance(m, dorafp8.DoRAFP8Linear) for m in pm.modules()) == 14
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(3):
        loss = pm(input_ids=IDS, labels=IDS).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    for n, m in _fp8_layers(pm).items():  # the fp8 bases are frozen
        key = n.replace("base_model.model.", "", 1).replace(".base_layer", "")
        assert torch.equal(_u8(m.weight), before[key][0]) and torch.equal(m.scale, before[key][1])


@pytest.fixture(scope="module")
def trained(ckpt):
    """A DoRA model on the dorafp8 per-row checkpoint, trained a few steps so that B, A, m all moved."""
    return F.trained_dora(ckpt("dorafp8"))


EXPORTS = ["compressed-tensors", "comfyui", "comfyui-quant", "fine-grained", "dorafp8", "bf16"]


@pytest.mark.parametrize("fmt", EXPORTS)
def test_export_then_reload_within_reported_merge_error(fmt, trained, tmp_path):
    """export_merged -> load_fp8_checkpoint (from_pretrained for bf16): each layer's output on random inputs is off
    the unmerged DoRA layer's by the relative error the export reported for that layer (for isotropic inputs
    E||x E^T||^2 / E||x W^T||^2 = ||E||_F^2 / ||W||_F^2; 25% either way for the sampling), so the report is neither
    optimistic nor pessimistic."""
    kw = dict(block_size=32) if fmt == "fine-grained" else {}
    out = tmp_path / ("exp" if fmt in TRANSFORMERS_FORMATS else "exp.safetensors")  # see test_round_trip_is_bit_exact
    rep, reloaded, lrep = F.export_and_reload(trained, out, fmt, **kw)
    assert len(rep.layers) == 14 and all(d["action"] == "merged" for d in rep.layers.values())
    errs = rep.errors("merged")
    assert rep.worst == max(errs.items(), key=lambda kv: kv[1])
    assert abs(rep.mean_error - sum(errs.values()) / len(errs)) < 1e-12
    assert all(0 < e < 0.1 for e in errs.values())
    if fmt == "bf16":
        assert not _fp8_layers(reloaded)
    else:
        assert lrep.format == fmt and len(lrep.fp8_layers) == 14
    rels = F.layer_output_errors(trained, reloaded, errs)
    for name, e in errs.items():
        assert 0.75 * e - 1e-6 <= rels[name] <= 1.25 * e + 1e-6, (name, rels[name], e)
    with torch.no_grad():
        assert torch.isfinite(reloaded(input_ids=IDS).logits).all()
    assert F.logits_error(reloaded, trained) < 10 * rep.worst[1]
    assert "merge error" in str(rep)


def test_export_default_scales_and_unmerged_layers_keep_their_bytes(trained, tmp_path):
    """Merged layers get the layout's default scale (compressed-tensors: per row); save_fp8_checkpoint (no merge)
    writes the frozen bases byte for byte and says that the adapters were not written."""
    rep = dorafp8.export_merged(trained, tmp_path / "a", format="compressed-tensors", verbose=False)
    assert {d["granularity"] for d in rep.layers.values()} == {"per-row"}
    rep = dorafp8.export_merged(trained, tmp_path / "b", format="compressed-tensors", granularity="tensor",
                                verbose=False)
    assert {d["granularity"] for d in rep.layers.values()} == {"per-tensor"}
    rep = dorafp8.save_fp8_checkpoint(trained, tmp_path / "c.safetensors", format="dorafp8", verbose=False)
    assert all(d["action"] == "kept" for d in rep.layers.values())
    assert any("not written" in n for n in rep.notes)
    sd = F.read_all(str(tmp_path / "c.safetensors"))
    for name, m in _fp8_layers(trained).items():
        key = name.replace("base_model.model.", "", 1).replace(".base_layer", "")
        assert torch.equal(sd[key + ".weight"].view(torch.uint8), m.weight.view(torch.uint8))
    assert not any("lora" in k for k in sd)
    with pytest.raises(ValueError, match="per-tensor"):
        dorafp8.export_merged(trained, tmp_path / "d", format="comfyui", granularity="row", verbose=False)


def test_export_is_read_by_transformers_and_compressed_tensors(trained, tmp_path):
    """The written files are read by the libraries that own the layouts: transformers dequantizes our fine-grained
    file (without a GPU it does) to exactly our weights rounded to bf16, and compressed-tensors decompresses our
    compressed-tensors file to exactly our dequantized weights."""
    fg = tmp_path / "fg"
    dorafp8.export_merged(trained, fg, format="fine-grained", block_size=32, verbose=False)
    ours, _ = _load(str(fg))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.AutoModelForCausalLM.from_pretrained(fg, dtype=torch.bfloat16)
    for name, m in _fp8_layers(ours).items():
        assert torch.equal(hf.get_submodule(name).weight, m.dequantize(torch.bfloat16)), name
    if not HAVE_CT:
        pytest.skip("compressed-tensors not installed")
    ct = tmp_path / "ct"
    dorafp8.export_merged(trained, ct, format="compressed-tensors", verbose=False)
    ours, _ = _load(str(ct))
    hf = transformers.AutoModelForCausalLM.from_pretrained(ct, dtype=torch.float32)
    assert hf.model.layers[0].self_attn.q_proj.weight.dtype == E4M3  # loaded compressed
    hf.hf_quantizer.compressor.decompress_model(hf)
    for name, m in _fp8_layers(ours).items():
        assert torch.equal(hf.get_submodule(name).weight.float(), m.dequantize()), name


@pytest.mark.parametrize("how", ["accelerate", "meta"])
def test_meta_device_construction(how, ckpt, original):
    """init_empty_weights keeps buffers real; under torch.device('meta') the rotary inv_freq is computed by the
    model's own initializer. Either way the loaded model equals one built normally and quantized."""
    model, report = _load(ckpt("dorafp8"), how=how)
    assert torch.equal(model.model.rotary_emb.inv_freq, original.model.rotary_emb.inv_freq)
    if how == "meta":
        assert "model.rotary_emb.inv_freq" in report.initialized
    twin = copy.deepcopy(original)
    dorafp8.quantize_model(twin, per_row_scale=True)
    with torch.no_grad():
        assert torch.equal(model(input_ids=IDS).logits, twin(input_ids=IDS).logits)


def test_diffusers_model_from_a_comfyui_file(tmp_path):
    """A diffusers transformer built on the meta device takes a ComfyUI scaled-fp8 file of its own weights (keys
    under ComfyUI's 'model.diffusion_model.' prefix) and computes what quantize_model makes of them."""
    diffusers = pytest.importorskip("diffusers")
    from accelerate import init_empty_weights

    cfg = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
               num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])
    torch.manual_seed(0)
    orig = diffusers.FluxTransformer2DModel(**cfg).eval()
    linears = {n for n, m in orig.named_modules() if isinstance(m, torch.nn.Linear)}
    path = str(tmp_path / "flux_fp8_scaled.safetensors")
    from safetensors.torch import save_file

    save_file(F.comfy_state_dict(orig, layer_filter=lambda k: k.endswith(".weight") and k[:-7] in linears), path)
    with init_empty_weights():
        model = diffusers.FluxTransformer2DModel(**cfg)
    report = dorafp8.load_fp8_checkpoint(model, path, verbose=False)
    assert report.format == "comfyui" and report.prefix == "model.diffusion_model."
    assert set(report.fp8_layers) == linears
    twin = copy.deepcopy(orig)
    dorafp8.quantize_model(twin, target_modules=sorted(linears))
    g = torch.Generator().manual_seed(0)
    inp = dict(hidden_states=torch.randn(1, 16, 4, generator=g),
               encoder_hidden_states=torch.randn(1, 8, 32, generator=g),
               pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.5]),
               img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(8, 3), return_dict=False)
    with torch.no_grad():
        assert torch.equal(model.eval()(**inp)[0], twin(**inp)[0])
    out = tmp_path / "rt"
    rep = dorafp8.save_fp8_checkpoint(model, out, verbose=False)  # a folder export always has an index
    assert len(rep.files) == 1 and sorted(os.listdir(out)) == sorted(
        ["config.json", "diffusion_pytorch_model.safetensors.index.json", os.path.basename(rep.files[0])])
    a, b = F.read_all(path), F.read_all(str(out))
    assert sorted(a) == sorted(b) and all(torch.equal(_u8(a[k]), _u8(b[k])) for k in a)


def test_sharded_directory_streams_one_shard_and_tensor_at_a_time(ckpt, tmp_path, capsys, monkeypatch):
    model, _ = _load(ckpt("dorafp8"))
    rep = dorafp8.save_fp8_checkpoint(model, tmp_path / "sh", "compressed-tensors", max_shard_size="40KB",
                                      verbose=False)
    assert len(rep.files) > 2 and (tmp_path / "sh" / "model.safetensors.index.json").exists()
    import safetensors

    real_open = safetensors.safe_open
    state = {"open": 0, "max_open": 0, "reads": []}

    class Tracked:
        def __init__(self, *a, **k):
            self.f = real_open(*a, **k)

        def __enter__(self):
            state["open"] += 1
            state["max_open"] = max(state["max_open"], state["open"])
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            state["open"] -= 1
            return self.f.__exit__(*exc)

        def get_tensor(self, k):
            state["reads"].append(k)
            return self.inner.get_tensor(k)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    monkeypatch.setattr(safetensors, "safe_open", Tracked)
    model2 = F.meta_model()
    report = dorafp8.load_fp8_checkpoint(model2, tmp_path / "sh")
    printed = capsys.readouterr().out
    assert state["max_open"] == 1
    assert len(state["reads"]) == len(set(state["reads"])) == len(F.read_all(str(tmp_path / "sh")))
    assert report.shards == len(rep.files) and f"shard {len(rep.files)}/{len(rep.files)}" in printed
    assert "fp8 layers (FP8Linear, bytes as stored): 14" in printed
    with torch.no_grad():
        assert torch.equal(model2(input_ids=IDS).logits, model(input_ids=IDS).logits)


def test_load_from_a_state_dict_and_with_a_key_map(ckpt):
    sd = F.read_all(ckpt("comfyui"))
    model = F.meta_model()
    rep = dorafp8.load_fp8_checkpoint(model, sd, verbose=False,
                                      key_map=lambda k: k.replace("model.diffusion_model.", "", 1))
    assert rep.format == "comfyui" and len(rep.fp8_layers) == 14 and rep.prefix == ""


def test_tied_embeddings(tmp_path):
    """tie_word_embeddings: transformers writes no lm_head.weight; accelerate's init_empty_weights unties the meta
    model's parameters; the loader ties them again, and saving writes the shared tensor once, as the file had it."""
    orig = F.original_model(tie_word_embeddings=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = F.write_fine_grained(orig, str(tmp_path / "tied"))
    assert not any(k.startswith("lm_head") for k in F.read_all(path))
    model = F.meta_model(F.llama_config(tie_word_embeddings=True))
    dorafp8.load_fp8_checkpoint(model, path, verbose=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, orig.lm_head.weight)
    dorafp8.save_fp8_checkpoint(model, tmp_path / "rt", verbose=False)
    a, b = F.read_all(path), F.read_all(str(tmp_path / "rt"))
    assert sorted(a) == sorted(b) and all(torch.equal(_u8(a[k]), _u8(b[k])) for k in a)


def test_fp8_conv_weights_stay_fp8_and_other_modules_are_dequantized():
    """A ComfyUI-style file may hold fp8 convolution or embedding weights (with a scale): a conv becomes an FP8Conv2d
    with the file's bytes and scale, like a linear layer becomes an FP8Linear; an embedding gets its weight
    dequantized (no fp8 embedding module)."""
    from dorafp8 import FP8Conv2d

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.emb, self.lin = torch.nn.Conv2d(3, 8, 3), torch.nn.Embedding(10, 8), torch.nn.Linear(8, 4)

    torch.manual_seed(0)
    net = Net()
    sd = {"scaled_fp8": torch.tensor([], dtype=E4M3)}
    for k, v in net.state_dict().items():
        if k.endswith("weight"):
            s = (v.abs().amax() / 448).float()
            sd[k], sd[k[:-len("weight")] + "scale_weight"] = (v / s).to(E4M3), s
        else:
            sd[k] = v
    with torch.device("meta"):
        model = Net()
    report = dorafp8.load_fp8_checkpoint(model, sd, verbose=False)
    assert report.format == "comfyui" and report.dequantized == ["emb.weight"]
    assert isinstance(model.lin, FP8Linear) and type(model.conv) is FP8Conv2d
    assert torch.equal(model.conv.weight.view(torch.uint8), sd["conv.weight"].view(torch.uint8))
    assert torch.equal(model.conv.scale, sd["conv.scale_weight"]) and torch.equal(model.conv.bias, sd["conv.bias"])
    assert torch.equal(model.emb.weight, sd["emb.weight"].float() * sd["emb.scale_weight"])
    x = torch.randn(2, 3, 6, 6)
    want = torch.nn.functional.conv2d(x, sd["conv.weight"].float() * sd["conv.scale_weight"], sd["conv.bias"])
    torch.testing.assert_close(model.conv(x), want, rtol=1e-5, atol=1e-6)


def test_progress_lines_on_a_long_single_file(ckpt, capsys, monkeypatch):
    import dorafp8.checkpoint.load as L

    monkeypatch.setattr(L, "_PROGRESS_EVERY_S", 0.0)
    dorafp8.load_fp8_checkpoint(F.meta_model(), ckpt("comfyui"))
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("dorafp8: ...")]
    n = len(F.read_all(ckpt("comfyui"))) - 1  # all but the marker
    assert lines and lines[-1].startswith(f"dorafp8: ... {n}/{n} tensors")


# ---- clear errors ------------------------------------------------------------------------------------------------


def _sd(ckpt, case):
    return dict(F.read_all(ckpt(case)))


def test_error_not_an_fp8_checkpoint(original):
    with pytest.raises(CheckpointFormatError, match="no float8_e4m3fn weight.*quantize_model"):
        dorafp8.detect_format(original.state_dict())


def test_a_safetensors_file_named_sft_loads(ckpt, tmp_path):
    """Black Forest Labs publish Flux as flux1-dev.sft, a safetensors file: load_fp8_checkpoint refused it as "not a
    .safetensors file; load it yourself (torch.load)", which cannot read it either."""
    sft = tmp_path / "flux1-dev-fp8.sft"
    sft.write_bytes(open(ckpt("comfyui"), "rb").read())
    a, _ = _load(ckpt("comfyui"))
    b, report = _load(str(sft))
    assert report.format == "comfyui"
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb) and all(torch.equal(_u8(sa[k]), _u8(sb[k])) for k in sa)


def test_an_export_to_a_path_named_sft_is_one_file(ckpt, tmp_path):
    """An export to flux1-dev-dora.sft was written as a folder of that name (shards, config.json), which nothing
    reads as the single file the name promises; it is one safetensors file now, which loads back, and the .sft the
    model was loaded from is refused as a destination like a .safetensors one (nothing written over it)."""
    sft = tmp_path / "flux1-dev-fp8.sft"
    sft.write_bytes(open(ckpt("comfyui"), "rb").read())
    model, _ = _load(str(sft))
    out = tmp_path / "export.sft"
    dorafp8.save_fp8_checkpoint(model, str(out), verbose=False)
    assert out.is_file()
    back, report = _load(str(out))
    assert report.format == "comfyui"
    sa, sb = model.state_dict(), back.state_dict()
    assert sorted(sa) == sorted(sb) and all(torch.equal(_u8(sa[k]), _u8(sb[k])) for k in sa)
    before = sft.read_bytes()
    with pytest.raises(FileExistsError, match="is the file the model was loaded from"):
        dorafp8.save_fp8_checkpoint(model, str(sft), verbose=False)
    assert sft.read_bytes() == before


def test_error_fp8_tensors_that_are_no_weight_are_not_called_unquantized():
    """optimum-quanto's qfloat8 files keep a layer's e4m3 values under '<layer>.weight._data' (its scale under
    '._scale'): detect_format called that "not an fp8 checkpoint ... an unquantized checkpoint loads the usual way";
    it names the fp8 tensors it saw instead."""
    sd = {"lin.weight._data": torch.ones(4, 4).to(torch.float8_e4m3fn), "lin.weight._scale": torch.ones(4, 1),
          "lin.bias": torch.zeros(4)}
    with pytest.raises(CheckpointFormatError, match=r"float8_e4m3fn tensors under keys .*'lin\.weight\._data'") as e:
        dorafp8.detect_format(sd)
    assert "unquantized" not in str(e.value)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
def test_error_integer_weights_are_not_called_unquantized(dtype):
    """A GGUF file converted to safetensors keeps its quantized blocks as integer '<layer>.weight's: detect_format
    called it "not an fp8 checkpoint ... an unquantized checkpoint loads the usual way", a wrong lead."""
    sd = {"lin.weight": torch.zeros(4, 34, dtype=dtype), "norm.weight": torch.ones(4)}
    with pytest.raises(CheckpointFormatError, match=rf"{dtype} weights \(e\.g\. 'lin\.weight'") as e:
        dorafp8.detect_format(sd)
    assert "unquantized" not in str(e.value)


@pytest.mark.parametrize("extra,match", [("weight_scale_2", "NVFP4"), ("weight_packed", "packed int4")])
def test_error_unknown_layout_names_what_it_saw(ckpt, extra, match):
    sd = _sd(ckpt, "fp8-cast")
    sd["model.layers.0.self_attn.q_proj." + extra] = torch.ones(1)
    with pytest.raises(CheckpointFormatError, match=match) as e:
        dorafp8.load_fp8_checkpoint(F.meta_model(), sd, verbose=False)
    assert "Saw" in str(e.value) and extra in str(e.value)


def test_error_e5m2_and_int8(ckpt):
    sd = _sd(ckpt, "fp8-cast")
    sd["model.layers.0.self_attn.q_proj.weight"] = sd["model.layers.0.self_attn.q_proj.weight"].float().to(
        torch.float8_e5m2)
    with pytest.raises(CheckpointFormatError, match="float8_e5m2"):
        dorafp8.detect_format(sd)
    sd = _sd(ckpt, "dorafp8")
    sd = {k.replace(".scale", ".weight_scale"): (v.to(torch.int8) if v.dtype == E4M3 else v) for k, v in sd.items()}
    with pytest.raises(CheckpointFormatError, match="int8"):
        dorafp8.detect_format(sd)


def test_error_missing_scale_names_the_key(ckpt):
    sd = _sd(ckpt, "dorafp8")
    del sd["model.layers.1.mlp.up_proj.scale"]
    sd = {k.replace(".scale", ".weight_scale"): v for k, v in sd.items()}  # compressed-tensors keys
    with pytest.raises(CheckpointFormatError, match=r"model\.layers\.1\.mlp\.up_proj\.weight_scale.*missing"):
        dorafp8.load_fp8_checkpoint(F.meta_model(), sd, verbose=False)


def test_error_shape_mismatch(ckpt):
    model = F.meta_model(F.llama_config(intermediate_size=96))
    with pytest.raises(CheckpointFormatError, match=r"gate_proj\.weight: shape \[128, 64\].*\[96, 64\]"):
        dorafp8.load_fp8_checkpoint(model, ckpt("dorafp8"), verbose=False)
    sd = _sd(ckpt, "dorafp8")
    sd["model.layers.0.self_attn.q_proj.scale"] = torch.ones(7)
    with pytest.raises(CheckpointFormatError, match=r"q_proj\.scale.*got shape \(7,\)"):
        dorafp8.load_fp8_checkpoint(F.meta_model(), sd, verbose=False)


def test_error_wrong_format_ambiguous_and_strict(ckpt):
    with pytest.raises(CheckpointFormatError, match="looks like comfyui"):
        dorafp8.load_fp8_checkpoint(F.meta_model(), ckpt("comfyui"), format="fine-grained", verbose=False)
    sd = _sd(ckpt, "comfyui")
    sd["model.diffusion_model.model.layers.0.self_attn.q_proj.weight_scale_inv"] = torch.ones(2, 2)
    with pytest.raises(CheckpointFormatError, match="several fp8 layouts"):
        dorafp8.detect_format(sd)
    sd = _sd(ckpt, "dorafp8")
    del sd["model.norm.weight"]
    sd["model.extra.weight"] = torch.ones(3)
    with pytest.raises(CheckpointFormatError, match=r"model\.norm\.weight.*model\.extra\.weight"):
        dorafp8.load_fp8_checkpoint(F.meta_model(), sd, verbose=False)
    rep = dorafp8.load_fp8_checkpoint(F.meta_model(), sd, strict=False, verbose=False)
    assert rep.missing == ["model.norm.weight"] and rep.unexpected == ["model.extra.weight"]
    with pytest.raises(ValueError, match="format must be one of"):
        dorafp8.load_fp8_checkpoint(F.meta_model(), sd, format="gguf", verbose=False)


# ---- transformers' own fp8 loading ------------------------------------------------------------------------------


def _trainer_steps(pm, steps=2):
    from transformers import Trainer, TrainingArguments

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"input_ids": IDS[i % 2], "labels": IDS[i % 2]}

    with tempfile.TemporaryDirectory() as out:  # this run's own, removed after (not a fixed name in a shared /tmp)
        args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=2, report_to=[],
                                 use_cpu=True, save_strategy="no", learning_rate=1e-2, disable_tqdm=True)
        return Trainer(model=pm, args=args, train_dataset=Rows()).train()


@pytest.mark.parametrize("case", [pytest.param("ct-channel", marks=pytest.mark.skipif(not HAVE_CT, reason="needs "
                                                                                          "compressed-tensors")),
                                  "fine-grained"])
def test_from_transformers_fp8_then_dora_and_trainer(case, ckpt, tmp_path):
    """from_pretrained with the checkpoint's own quantization config keeps fp8 weights (compressed-tensors does on
    CPU; transformers' fine-grained FP8 needs a GPU, so its environment check is patched out); from_transformers_fp8
    swaps them for FP8Linear with the same bytes as load_fp8_checkpoint, PEFT DoRA and the Trainer train it, and
    save_fp8_checkpoint writes the original layout back bit for bit."""
    path = ckpt(case)
    if case == "fine-grained":
        from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

        with mock.patch.object(FineGrainedFP8HfQuantizer, "validate_environment", lambda self, *a, **k: None):
            model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        assert type(model.model.layers[0].self_attn.q_proj).__name__ == "FP8Linear"
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert dorafp8.from_transformers_fp8(model) == 14
    ref, _ = _load(path)
    for name, m in _fp8_layers(ref).items():
        mine = model.get_submodule(name)
        assert isinstance(mine, FP8Linear) and torch.equal(_u8(mine.weight), _u8(m.weight))
        assert torch.equal(mine.scale, m.scale)
    with torch.no_grad():
        assert torch.equal(model(input_ids=IDS).logits, ref(input_ids=IDS).logits)
    out = tmp_path / "rt"
    dorafp8.save_fp8_checkpoint(model, out, verbose=False)
    a, b = F.read_all(path), F.read_all(str(out))
    assert sorted(a) == sorted(b) and all(torch.equal(_u8(a[k]), _u8(b[k])) and a[k].dtype == b[k].dtype for k in a)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules="all-linear"))
    result = _trainer_steps(pm)
    assert torch.isfinite(torch.tensor(result.training_loss))


def test_from_transformers_fp8_model_is_not_exported_over_the_folder_it_was_loaded_from(ckpt, tmp_path):
    """A dorafp8 export loaded through transformers' from_pretrained and from_transformers_fp8, then exported back
    into its folder: the export replaced the shards from_pretrained read (export_merged: the base the adapters merge
    into, gone), which load_fp8_checkpoint's models are refused. Refused now, naming the file; another folder works."""
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    src, _ = _load(ckpt("fine-grained"))
    folder = tmp_path / "export"
    dorafp8.save_fp8_checkpoint(src, folder, max_shard_size="20KB", verbose=False)
    with mock.patch.object(FineGrainedFP8HfQuantizer, "validate_environment", lambda self, *a, **k: None):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    assert dorafp8.from_transformers_fp8(model) == 14
    before = {n: (folder / n).read_bytes() for n in os.listdir(folder)}
    for write in (dorafp8.save_fp8_checkpoint, dorafp8.export_merged):
        with pytest.raises(FileExistsError, match=r"is the file the model was loaded from .*write to another path"):
            write(model, folder, max_shard_size="30KB", verbose=False)
    assert {n: (folder / n).read_bytes() for n in os.listdir(folder)} == before
    dorafp8.save_fp8_checkpoint(model, tmp_path / "other", verbose=False)
    a, b = F.read_all(str(folder)), F.read_all(str(tmp_path / "other"))
    assert sorted(a) == sorted(b) and all(torch.equal(_u8(a[k]), _u8(b[k])) for k in a)


def test_from_transformers_fp8_records_only_the_weights_from_pretrained_read(ckpt, tmp_path):
    """The source files from_transformers_fp8 records (the writers refuse to replace them) are the shards the index
    names: every .safetensors file in the folder was, so exporting over a stray one there (an earlier export of
    another model) was refused as 'the file the model was loaded from'. A shard stays refused."""
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    src, _ = _load(ckpt("fine-grained"))
    folder = tmp_path / "export"
    dorafp8.save_fp8_checkpoint(src, folder, max_shard_size="20KB", verbose=False)
    shard = next(n for n in sorted(os.listdir(folder)) if n.endswith(".safetensors"))
    dorafp8.save_fp8_checkpoint(src, folder / "stray.safetensors", verbose=False)
    with mock.patch.object(FineGrainedFP8HfQuantizer, "validate_environment", lambda self, *a, **k: None):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    assert dorafp8.from_transformers_fp8(model) == 14
    dorafp8.save_fp8_checkpoint(model, folder / "stray.safetensors", verbose=False)
    with pytest.raises(FileExistsError, match=r"is the file the model was loaded from"):
        dorafp8.save_fp8_checkpoint(model, folder / shard, verbose=False)


def test_from_transformers_fp8_records_variant_weights(tmp_path):
    """from_pretrained(variant="fp16") reads model.fp16.safetensors, or the shards of
    model.safetensors.index.fp16.json: they are this model's originals too (only model.safetensors and the plain
    index were recorded, so exporting over a variant file was not refused); a stray file still is no original."""
    from dorafp8.checkpoint.files import identity, weight_files

    names = ["model.fp16.safetensors", "model.fp16-00001-of-00002.safetensors", "stray.safetensors"]
    for n in names:
        (tmp_path / n).write_bytes(b"x" * (len(n) + 1))
    (tmp_path / "model.safetensors.index.fp16.json").write_text(
        json.dumps({"weight_map": {"a.weight": "model.fp16-00001-of-00002.safetensors"}}))
    assert set(weight_files(str(tmp_path))) == {identity(str(tmp_path / n)) for n in names[:2]}


def test_from_transformers_fp8_model_from_a_subfolder_is_not_exported_over_its_files(ckpt, tmp_path):
    """from_pretrained(root, subfolder="text_encoder"): the config's _name_or_path is `root`, which holds no weights,
    so from_transformers_fp8 recorded none, and an export into the subfolder (or over its shard) replaced the files
    the model was loaded from. The files from_pretrained read are recorded now: refused, naming the file."""
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    src, _ = _load(ckpt("fine-grained"))
    root = tmp_path / "pipeline"
    folder = root / "text_encoder"
    dorafp8.save_fp8_checkpoint(src, folder, verbose=False)
    with mock.patch.object(FineGrainedFP8HfQuantizer, "validate_environment", lambda self, *a, **k: None):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(root), subfolder="text_encoder",
                                                                  dtype=torch.float32)
    assert dorafp8.from_transformers_fp8(model) == 14
    before = {n: (folder / n).read_bytes() for n in os.listdir(folder)}
    shard, = (n for n in before if n.endswith(".safetensors"))
    for write in (dorafp8.save_fp8_checkpoint, dorafp8.export_merged):
        for where in (folder, folder / shard):
            with pytest.raises(FileExistsError, match=r"is the file the model was loaded from"):
                write(model, where, verbose=False)
    assert {n: (folder / n).read_bytes() for n in os.listdir(folder)} == before


def test_from_transformers_fp8_warns_when_transformers_dequantized(ckpt):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(ckpt("fine-grained"))  # CPU: dequantized to bf16
    with pytest.warns(UserWarning, match="dequantized the weights while loading.*load_fp8_checkpoint"):
        assert dorafp8.from_transformers_fp8(model) == 0


# ---- merge_and_unload in memory ----------------------------------------------------------------------------------


def test_merge_and_unload_requantizes_in_memory(trained):
    pm = copy.deepcopy(trained)
    with torch.no_grad():
        ref = pm(input_ids=IDS).logits
    layer = pm.base_model.model.model.layers[0].self_attn.q_proj
    before = _u8(layer.get_base_layer().weight).clone()
    with pytest.warns(UserWarning, match="re-quantizes the merged weight"):
        pm.merge_adapter()
    assert 0 < layer.last_merge_error < 0.1
    with torch.no_grad():
        merged = pm(input_ids=IDS).logits
    pm.unmerge_adapter()  # exact: the pre-merge bytes were kept
    assert torch.equal(_u8(layer.get_base_layer().weight), before)
    with torch.no_grad():
        assert torch.equal(pm(input_ids=IDS).logits, ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = pm.merge_and_unload()
    fp8 = _fp8_layers(out)
    assert len(fp8) == 14 and not any("lora" in n for n, _ in out.named_parameters())
    assert all(m.scale.dim() == 1 for m in fp8.values())  # per-row scales by default
    with torch.no_grad():
        unloaded = out(input_ids=IDS).logits
    assert torch.equal(unloaded, merged)
    assert ((unloaded - ref).norm() / ref.norm()) < 0.1


def test_merge_granularity_keep(trained):
    pm = copy.deepcopy(trained)
    cls = dorafp8.DoRAFP8Linear
    with mock.patch.object(cls, "merge_granularity", "keep"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm.merge_adapter()
    layer = pm.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.get_base_layer().scale.dim() == 1  # the dorafp8 checkpoint was per row


def test_export_memory_is_row_blocks_not_a_dense_layer():
    """Merging and re-quantizing one 4096 x 8192 DoRA layer: no temporary of the layer's fp32 size (128 MiB); the
    largest is the 32 MiB e4m3 output itself, the rest a few 16 MiB row blocks."""
    from dorafp8._memory import MiB, PeakTemporaries
    from dorafp8.merge import merged_rows, requantize

    N, K = 4096, 8192
    g = torch.Generator().manual_seed(0)
    w8, scale = dorafp8.quantize_e4m3(torch.randn(N, K, generator=g) * 0.02, per_row=True)
    A, B = torch.randn(8, K, generator=g) * 0.01, torch.randn(N, 8, generator=g) * 0.01
    terms = [(A, B, 2.0, torch.rand(N, generator=g) + 0.5, "default")]
    for gran in ("row", "tensor", "block"):
        with PeakTemporaries() as mode:
            out, s, st = requantize(lambda j0, j1: merged_rows(w8, scale, 128, terms, j0, j1), N, K, gran)
        assert out.dtype == E4M3 and 0 < st.rel_error < 0.1
        assert mode.largest <= N * K, (gran, mode.largest / MiB)
        assert mode.peak <= N * K + 4 * 16 * MiB < 4 * N * K, (gran, mode.peak / MiB)


def _blocks_of_96():
    """Two linear layers quantized in 96 x 96 blocks whose scales differ 100-fold: [2, 2] and [1, 2] scale grids,
    which 128 x 128 blocks would give as well."""
    from torch import nn

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(192, 192), nn.Linear(192, 64)).eval()
    with torch.no_grad():
        for m in net:
            m.weight[:96, :96] *= 100.0
    return dorafp8.quantize_model(net, block_size=96, verbose=False)


@pytest.mark.parametrize("fmt", ["dorafp8", "compressed-tensors", "fine-grained"])
@pytest.mark.parametrize("where", ["file", "folder"])
def test_block_scales_of_any_size_load_back_as_written(tmp_path, fmt, where):
    """A scale grid does not say its block size ([2, 2] over [192, 192] is 96 x 96 blocks or 128 x 128 ones) and the
    loader took 128 wherever it fit: a model quantized in 96 x 96 blocks (quantize_model(block_size=96)), saved to a
    .safetensors file or a folder without config.json, loaded back in 128 x 128 blocks, silently wrong. The writers
    record the block size in the safetensors metadata and the loader reads it: the same bytes, scales and outputs."""
    from torch import nn

    net = _blocks_of_96()
    path = str(tmp_path / ("x.safetensors" if where == "file" else "x"))
    dorafp8.save_fp8_checkpoint(net, path, format=fmt, verbose=False)
    with torch.device("meta"):
        fresh = nn.Sequential(nn.Linear(192, 192), nn.Linear(192, 64))
    dorafp8.load_fp8_checkpoint(fresh, path, verbose=False)
    for a, b in zip(net, fresh):
        assert b.block_size == 96 and torch.equal(a.scale, b.scale)
        assert torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8))
    x = torch.randn(3, 192)
    with torch.no_grad():
        assert torch.equal(fresh.eval()(x), net(x))


def test_a_block_size_record_is_checked_and_not_carried_over(tmp_path):
    """The block size record (safetensors metadata dorafp8_block_size) is refused, naming it, where it is not a
    positive integer or contradicts config.json; a model loaded from a file with one and saved without block scales
    does not carry it over (a stale record would make the loader misread, or refuse, the new file)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from torch import nn

    src = str(tmp_path / "x.safetensors")
    dorafp8.save_fp8_checkpoint(_blocks_of_96(), src, format="dorafp8", verbose=False)
    with safe_open(src, "pt") as f:
        assert f.metadata()["dorafp8_block_size"] == "96"

    def fresh():
        with torch.device("meta"):
            return nn.Sequential(nn.Linear(192, 192), nn.Linear(192, 64))

    bad = str(tmp_path / "bad.safetensors")
    save_file(load_file(src), bad, metadata={"format": "pt", "dorafp8_block_size": "1e2"})
    with pytest.raises(CheckpointFormatError, match=r"bad\.safetensors: its safetensors metadata "
                                                    r"dorafp8_block_size='1e2' is not a block size"):
        dorafp8.load_fp8_checkpoint(fresh(), bad, verbose=False)
    save_file(load_file(src), bad, metadata={"format": "pt", "dorafp8_block_size": "64"})  # [3, 3] blocks, not [2, 2]
    with pytest.raises(CheckpointFormatError, match=r"0\.scale: shape \[2, 2\] is neither .* nor per b x b block "
                                                    r"of the \[192, 192\] weight for b = 64 \(from block_size=, the "
                                                    r"file's dorafp8_block_size metadata or config\.json"):
        dorafp8.load_fp8_checkpoint(fresh(), bad, verbose=False)
    folder = tmp_path / "fg"
    dorafp8.save_fp8_checkpoint(_blocks_of_96(), str(folder), format="fine-grained", verbose=False)
    (folder / "config.json").write_text('{"quantization_config": {"quant_method": "fp8", "weight_block_size": '
                                        '[128, 128]}}')
    with pytest.raises(CheckpointFormatError, match=r"dorafp8_block_size=96 but config\.json's quantization_config "
                                                    r"says block size 128.*move the wrong one away"):
        dorafp8.load_fp8_checkpoint(fresh(), str(folder), verbose=False)
    model = fresh()
    dorafp8.load_fp8_checkpoint(model, src, verbose=False)
    rows = str(tmp_path / "rows.safetensors")
    dorafp8.save_fp8_checkpoint(model, rows, granularity="row", verbose=False)
    with safe_open(rows, "pt") as f:
        assert "dorafp8_block_size" not in f.metadata()
    dorafp8.load_fp8_checkpoint(fresh(), rows, verbose=False)
