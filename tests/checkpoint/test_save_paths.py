"""Issue 24: every way to save an fp8 model writes a checkpoint that plain transformers / diffusers load correctly, or
fails with an error that names the dorafp8 writer to use. No path loads garbage.

The save paths: transformers' and diffusers' save_pretrained (the fp8 base, and merged with PEFT's merge_and_unload),
dorafp8.save_fp8_checkpoint and dorafp8.export_merged in every format they offer, on a tiny LLaMA and a tiny diffusers
UNet built from configs (nothing is downloaded). Each checkpoint is reloaded with the library's own from_pretrained
(transformers 5.x on CPU: compressed-tensors stays fp8 until the first forward pass decompresses it, fine-grained FP8
is dequantized while loading) and compared with the model that was saved:

- a layer written as it is (its e4m3 bytes and scale) must come back as exactly its weight, and the outputs must equal
  the saved model's to float32 rounding (torch.testing.assert_close's float32 tolerances);
- a layer the save re-quantizes (merged adapters, a layout without the layer's kind of scale, a dense format) must be
  within the unit roundoff u of what it is stored in, ||W_loaded - W||_F <= u ||W||_F (every stored value is within
  u |w| of the exact one: e4m3 u = 2^-4, bf16 2^-8, fp16 2^-11; float32 is compared with assert_close, since the
  reference W is itself computed in float32), and the outputs within u of e4m3, the fp8 quantization error bound.

A subprocess reloads the transformers checkpoints with no dorafp8 imported at all.
"""

import ast
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
import weakref
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("accelerate")
peft = pytest.importorskip("peft")
diffusers = pytest.importorskip("diffusers")
if __import__("importlib").util.find_spec("compressed_tensors") is None:
    pytest.skip("transformers reads compressed-tensors checkpoints through the compressed-tensors package",
                allow_module_level=True)

import safetensors.torch  # noqa: E402

import dorafp8  # noqa: E402
from dorafp8 import FP8Conv1d, FP8Conv2d, FP8Conv3d, FP8Linear  # noqa: E402
from dorafp8.checkpoint import DENSE_FORMATS, FORMATS, TRANSFORMERS_FORMATS  # noqa: E402
from dorafp8.checkpoint.write import originals  # noqa: E402
from dorafp8.ops import NORM_EPS  # noqa: E402

from tests.checkpoint import _ckpt_fixtures as F  # noqa: E402
from tests.integration.test_diffusion import _batches, small_unet  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
E4M3 = torch.float8_e4m3fn
IDS = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
GRANULARITIES = {"tensor": {}, "row": dict(per_row_scale=True), "block": dict(block_size=32)}


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


U_FP8 = unit_roundoff(E4M3)  # 2^-4


# ---------------------------------------------------------------------------------------------------- helpers


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _dora_weight(layer, a="default") -> torch.Tensor:
    """PEFT's merged DoRA weight m / ||V||_row * V, V = W0 + s B A, in fp32 from the unmerged layer (what the trained
    model computes with)."""
    V = layer.get_base_layer().dequantize() + layer.scaling[a] * (
        layer.lora_B[a].weight.float() @ layer.lora_A[a].weight.float())
    m = layer.lora_magnitude_vector[a].weight.float()
    return (m / V.norm(dim=1).clamp_min(NORM_EPS))[:, None] * V


def _saved_weights(model) -> dict:
    """fp32 weight of every fp8 layer of the saved model, by state dict name: the dequantized fp8 weight, or the
    merged DoRA weight where a DoRA adapter sits on it."""
    out = {}
    for name, m in model.named_modules():
        key = name.replace("base_model.model.", "", 1)
        if isinstance(m, dorafp8.DoRAFP8Linear):
            out[key] = _dora_weight(m)
        elif isinstance(m, (FP8Linear, FP8Conv1d, FP8Conv2d, FP8Conv3d)) and not name.endswith(".base_layer"):
            out[key] = m.dequantize()
    assert out
    return out


def _llama_out(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits.float()


_UNET_KW = {k: v[:1] for k, v in _batches("unet", 1)[0][0].items()}  # one sample: the UNet's forward is the cost


def _unet_out(model):
    with torch.no_grad():
        return model(**_UNET_KW).sample.float()


_saved_outputs = weakref.WeakKeyDictionary()  # the module-scope models are saved many times: one forward each


def assert_reloads(saved, reloaded, run, stored=None):
    """`reloaded` is the model `saved` was: stored=None for checkpoints that hold every fp8 layer as it is, else the
    dtype the layers were re-quantized into (see the module docstring)."""
    if saved not in _saved_outputs:
        _saved_outputs[saved] = run(saved)
    ref = _saved_outputs[saved]
    out = run(reloaded)  # first: compressed-tensors decompresses the weights on the first forward pass
    for name, W in _saved_weights(saved).items():
        got = _weight(reloaded.get_submodule(name)).float().reshape(W.shape)
        if stored is None:
            assert torch.equal(got, W), (name, _rel(got, W))
        elif stored == torch.float32:
            torch.testing.assert_close(got, W, msg=name)
        else:
            assert _rel(got, W) <= unit_roundoff(stored), (name, _rel(got, W), unit_roundoff(stored))
    if stored is None:
        torch.testing.assert_close(out, ref)
    else:
        assert _rel(out, ref) <= U_FP8, (_rel(out, ref), U_FP8)


def _weight(module) -> torch.Tensor:
    """The weight a reloaded layer computes with: a dorafp8 layer's dequantized, a plain layer's own (never its raw
    e4m3 values: that is what loading without the scales looks like)."""
    if isinstance(module, (FP8Linear, FP8Conv1d, FP8Conv2d, FP8Conv3d)):
        return module.dequantize()
    assert module.weight.dtype != E4M3, module
    return module.weight.detach()


def _hf_load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def _llama(**quant):
    m = F.original_model()
    dorafp8.quantize_model(m, **quant)
    return m.eval()


def _perturb_dora(pm, seed=1):
    """Moves every DoRA adapter off its init (B = 0, m = ||W0||), so that merging changes every layer."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in pm.modules():
            if isinstance(m, dorafp8.DoRAFP8Linear):
                B, mag = m.lora_B["default"].weight, m.lora_magnitude_vector["default"].weight
                B.copy_(0.05 * torch.randn(B.shape, generator=g))
                mag.mul_(1 + 0.1 * torch.randn(mag.shape, generator=g))
    return pm.eval()


@pytest.fixture(scope="module")
def dora():
    """PEFT DoRA on every linear layer of a per-row fp8 LLaMA."""
    pm = peft.get_peft_model(_llama(per_row_scale=True),
                             peft.LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules="all-linear"))
    return _perturb_dora(pm)


# ---------------------------------------------------------------------------------------------------- transformers


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_save_pretrained_base_reloads_with_plain_transformers(granularity, tmp_path):
    """quantize_model(llama); llama.save_pretrained(d); from_pretrained(d): compressed-tensors with its
    quantization_config, the same weights, the same logits (before: raw e4m3 values without scales, logits off by a
    relative 1.41)."""
    model = _llama(**GRANULARITIES[granularity])
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"
    assert not hasattr(model.config, "quantization_config")  # the in-memory model is as it was
    assert_reloads(model, _hf_load(tmp_path), _llama_out)


def test_save_pretrained_after_merge_and_unload(dora, tmp_path):
    merged = copy.deepcopy(dora)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # merging re-quantizes: the warning is tested in test_checkpoint
        merged = merged.merge_and_unload()
    merged.save_pretrained(tmp_path)
    reloaded = _hf_load(tmp_path)
    assert_reloads(merged, reloaded, _llama_out)  # the merged bytes, as they are
    assert_reloads(dora, reloaded, _llama_out, stored=E4M3)  # and they are the DoRA model, within one e4m3 rounding


def test_save_pretrained_keeps_a_fine_grained_source(tmp_path):
    """A model loaded from a fine-grained FP8 checkpoint is saved as one (byte for byte), which transformers
    dequantizes on CPU to exactly the weights."""
    src = F.write_fine_grained(F.original_model(), str(tmp_path / "src"), block=32)
    model = F.meta_model()
    dorafp8.load_fp8_checkpoint(model, src, verbose=False)
    model.save_pretrained(tmp_path / "out")
    a, b = F.read_all(src), F.read_all(str(tmp_path / "out"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k].view(torch.uint8) if a[k].dtype == E4M3 else a[k],
                                                      b[k].view(torch.uint8) if b[k].dtype == E4M3 else b[k])
                                          for k in a)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    assert_reloads(model.eval(), _hf_load(tmp_path / "out"), _llama_out)


def test_save_pretrained_refuses_what_it_cannot_write(dora, tmp_path):
    # unmerged adapters would be dropped
    with pytest.raises(ValueError, match=r"not merged.*merge_and_unload.*dorafp8\.export_merged"):
        dora.base_model.model.save_pretrained(tmp_path / "a")
    model = _llama()
    # a state_dict= (the Trainer's under FSDP / ZeRO-3) is the model's whole state dict, else refused, naming the key
    sd = model.state_dict()
    sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"].float()
    key = r"'model\.layers\.0\.mlp\.up_proj\.weight' \(torch\.float32"
    with pytest.raises(ValueError, match=r"whole state dict.*" + key):
        model.save_pretrained(tmp_path / "b", state_dict=sd)
    with pytest.raises(ValueError, match=r"whole state dict.*'lm_head\.weight' \(missing"):
        model.save_pretrained(tmp_path / "b", state_dict={k: v for k, v in sd.items() if "lm_" not in k})
    # blocks that do not divide a layer: compressed-tensors reads whole blocks only
    with pytest.raises(ValueError, match=r"block size 48.*save_fp8_checkpoint\(model, 'path\.safetensors'\)"):
        _llama(block_size=48).save_pretrained(tmp_path / "c")
    # fp8 convolutions: transformers reads them in no layout
    model.model.conv = FP8Conv2d.from_float(torch.nn.Conv2d(4, 4, 1))
    with pytest.raises(ValueError, match=r"fp8 conv layers.*'model\.conv'.*save_fp8_checkpoint"):
        model.save_pretrained(tmp_path / "d")
    assert not any((tmp_path / d).exists() and any((tmp_path / d).iterdir()) for d in "abcd")


def test_save_pretrained_writes_the_state_dict_it_is_given(tmp_path):
    """The HF Trainer under FSDP FULL_STATE_DICT or ZeRO-3 saves with save_pretrained(state_dict=<gathered>), which
    dorafp8 refused ('Call save_pretrained without state_dict'): that state dict is written as the model would be (its
    tensors, not the model's: tests/distributed/test_trainer_fsdp2.py), and an empty one (the Trainer's ZeRO-3 save
    without gathered weights, which it deletes) writes the config alone."""
    model = _llama()
    model.save_pretrained(tmp_path / "own")
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.lm_head.weight.zero_()  # the model's own tensor: not what is written
    model.save_pretrained(tmp_path / "given", state_dict=sd)
    a, b = F.read_all(str(tmp_path / "own")), F.read_all(str(tmp_path / "given"))
    assert sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k].float(), b[k].float())
                                          for k in a)
    assert (tmp_path / "own" / "config.json").read_text() == (tmp_path / "given" / "config.json").read_text()
    model.save_pretrained(tmp_path / "empty", state_dict={})
    assert "config.json" in os.listdir(tmp_path / "empty")


# what each format does with a per-row fp8 LLaMA (save_fp8_checkpoint) or a DoRA model on one (export_merged):
# None: every layer written as it is; a dtype: re-quantized into it; a string: the error, naming the fix
_NOT_HF = r"from_pretrained would load the raw e4m3 values.*\.safetensors.*compressed-tensors"
_NO_SCALE = r"fp8-cast layout has no scale.*compressed-tensors"
SAVE_EXPECT = {"compressed-tensors": None, "fine-grained": E4M3, "fp8-cast": _NO_SCALE, "comfyui": _NOT_HF,
               "comfyui-quant": _NOT_HF, "dorafp8": _NOT_HF, "musubi": _NOT_HF, **DENSE_FORMATS}
EXPORT_EXPECT = {**SAVE_EXPECT, "compressed-tensors": E4M3}


def _save_or_refuse(write, model, fmt, expect, path, **kw):
    """Writes with `write`; if `expect` is an error pattern, checks that the directory write raises it, and that
    the single file it names instead is no checkpoint transformers loads (it raises, it does not load wrong)."""
    if not isinstance(expect, str):
        rep = write(model, path, format=fmt, verbose=False, **kw)
        assert rep.format == fmt
        return True
    with pytest.raises(ValueError, match=expect):
        write(model, path, format=fmt, verbose=False, **kw)
    assert not path.exists()
    if fmt not in TRANSFORMERS_FORMATS:
        write(model, path.with_suffix(".safetensors"), format=fmt, verbose=False, **kw)
        with pytest.raises(OSError):
            transformers.AutoModelForCausalLM.from_pretrained(path.with_suffix(".safetensors"))
    return False


@pytest.mark.parametrize("fmt", FORMATS)
def test_save_fp8_checkpoint_every_format(fmt, tmp_path):
    model = _llama(per_row_scale=True)
    expect = SAVE_EXPECT[fmt]
    if _save_or_refuse(dorafp8.save_fp8_checkpoint, model, fmt, expect, tmp_path / "ckpt"):
        assert_reloads(model, _hf_load(tmp_path / "ckpt"), _llama_out, stored=expect)


def test_save_fp8_checkpoint_fp8_cast_of_a_cast_model(tmp_path):
    """fp8-cast (scale 1) is a plain cast: transformers reads it right."""
    model = F.original_model()
    for name, m in model.named_modules():
        if name.split(".")[-1] in F.LINEARS:
            m.weight.data = m.weight.data.to(E4M3)
    dorafp8.quantize_model(model)
    dorafp8.save_fp8_checkpoint(model, tmp_path, format="fp8-cast", verbose=False)
    assert_reloads(model.eval(), _hf_load(tmp_path), _llama_out)


@pytest.mark.parametrize("fmt", FORMATS)
def test_export_merged_every_format(fmt, dora, tmp_path):
    expect = EXPORT_EXPECT[fmt]
    kw = dict(block_size=32) if fmt == "fine-grained" else {}
    if _save_or_refuse(dorafp8.export_merged, dora, fmt, expect, tmp_path / "ckpt", **kw):
        assert_reloads(dora, _hf_load(tmp_path / "ckpt"), _llama_out, stored=expect)


def test_fine_grained_blocks_transformers_would_misread_are_refused(tmp_path):
    """transformers' CPU loader takes the block size from the scale grid: a 64-row layer with 48-row blocks has a
    grid of 2, which it would read as blocks of 32 (silently)."""
    with pytest.raises(ValueError, match=r"partial 48 x 48 blocks.*misreads them.*\.safetensors"):
        dorafp8.save_fp8_checkpoint(_llama(block_size=48), tmp_path / "fg", format="fine-grained", verbose=False)


# ---------------------------------------------------------------------------------------------------- DoRAFP8Config


def test_export_merged_into_the_models_own_folder_leaves_it_whole(dora, tmp_path):
    """export_merged pointed at the folder the model was saved to (transformers' save_pretrained, sharded): its
    config.json and index were replaced by the export's, the model's own shards left unnamed, so the folder no longer
    held that model. Refused now, naming config.json, with the folder as it was."""
    src = tmp_path / "model"
    _llama(per_row_scale=True).save_pretrained(src, max_shard_size="20KB")
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    assert "model.safetensors.index.json" in before and "config.json" in before
    with pytest.raises(FileExistsError, match=r"holds '(config|model.safetensors.index).json'.*not overwritten"):
        dorafp8.export_merged(dora, src, verbose=False)
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dense")
    F.original_model().save_pretrained(path)
    return path


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_dorafp8config_quantizes_on_load_and_saves_a_plain_checkpoint(granularity, dense_dir, tmp_path):
    """from_pretrained(dense, quantization_config=DoRAFP8Config(...)) gives the FP8Linear layers quantize_model
    gives; DoRA trains on them; save_pretrained writes what from_pretrained(path) alone reloads."""
    qkw = dict(block_size=32) if granularity == "block" else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(
        dense_dir, quantization_config=dorafp8.DoRAFP8Config(granularity, modules_to_not_convert=["down_proj"],
                                                             **qkw)).eval()
    twin = F.original_model()
    dorafp8.quantize_model(twin, exclude_modules=["down_proj"], **GRANULARITIES[granularity])
    ours = {n: m for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    theirs = {n: m for n, m in twin.named_modules() if isinstance(m, FP8Linear)}
    assert ours.keys() == theirs.keys() and len(ours) == 12  # 14 linear layers but the two down_proj
    for n in ours:
        assert torch.equal(ours[n].weight.view(torch.uint8), theirs[n].weight.view(torch.uint8)), n
        assert torch.equal(ours[n].scale, theirs[n].scale), n
    model.save_pretrained(tmp_path)
    assert isinstance(model.config.quantization_config, dorafp8.DoRAFP8Config)  # in memory, as it was
    saved = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "compressed-tensors" and saved["ignore"] == [
        "lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert_reloads(model, _hf_load(tmp_path), _llama_out)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, use_dora=True, target_modules="all-linear"))
    assert sum(isinstance(m, dorafp8.DoRAFP8Linear) for m in pm.modules()) == 12
    pm.train()
    pm(input_ids=IDS, labels=IDS).loss.backward()


def test_dorafp8config_w8a8_is_written_as_w8a8(dense_dir, tmp_path):
    """act_quant='rowwise' is compressed-tensors' dynamic per-token activations: transformers reproduces the
    W8A8 outputs."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        dense_dir, quantization_config=dorafp8.DoRAFP8Config("row", act_quant="rowwise")).eval()
    assert all(m.act_quant == "rowwise" for m in model.modules() if isinstance(m, FP8Linear))
    model.save_pretrained(tmp_path)
    acts = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"][
        "input_activations"]
    assert acts["dynamic"] and acts["strategy"] == "token"
    assert_reloads(model, _hf_load(tmp_path), _llama_out)


def test_dorafp8config_model_is_not_exported_over_the_dense_files_it_was_quantized_from(dense_dir, tmp_path):
    """from_pretrained(dense, quantization_config=DoRAFP8Config()) recorded no source files: an export (export_merged
    of its adapters) or save_pretrained over the dense model.safetensors replaced the original-precision weights for
    good. Refused now, naming the file, as for the other loaders; another path works."""
    import shutil

    shutil.copytree(dense_dir, tmp_path / "dense")
    original = tmp_path / "dense" / "model.safetensors"
    before = original.read_bytes()
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dense",
                                                              quantization_config=dorafp8.DoRAFP8Config())
    # transformers' save_pretrained overwrote it too (and deletes the shards of a sharded one before it writes)
    with pytest.raises(FileExistsError, match=r"'model.safetensors'.* is the file the model was loaded from"):
        model.save_pretrained(tmp_path / "dense")
    assert original.read_bytes() == before
    model.save_pretrained(tmp_path / "saved")
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules="all-linear"))
    for write, m in ((dorafp8.save_fp8_checkpoint, model), (dorafp8.export_merged, pm)):
        with pytest.raises(FileExistsError, match=r"is the file the model was loaded from .*write to another path"):
            write(m, original, verbose=False)
    assert original.read_bytes() == before
    dorafp8.export_merged(pm, tmp_path / "merged.safetensors", verbose=False)


def test_save_pretrained_of_a_variant_is_not_written_over_the_variant_file_it_was_quantized_from(dense_dir, tmp_path):
    """from_pretrained(dense, variant='fp16', quantization_config=DoRAFP8Config()) then save_pretrained(same folder,
    variant='fp16'): transformers writes model.fp16.safetensors, the dense original; the hook checked
    model.safetensors and the shards only, so the original precision was replaced for good. Refused now."""
    import shutil

    shutil.copytree(dense_dir, tmp_path / "dense")
    original = tmp_path / "dense" / "model.fp16.safetensors"
    (tmp_path / "dense" / "model.safetensors").rename(original)
    before = original.read_bytes()
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dense", variant="fp16",
                                                              quantization_config=dorafp8.DoRAFP8Config())
    with pytest.raises(FileExistsError, match=r"'model.fp16.safetensors'.* is the file the model was loaded from"):
        model.save_pretrained(tmp_path / "dense", variant="fp16")
    assert original.read_bytes() == before
    model.save_pretrained(tmp_path / "saved", variant="fp16")


def test_a_variant_loaded_is_not_left_beside_a_config_json_that_says_fp8(dense_dir, tmp_path):
    """from_pretrained(dense, variant='fp16', quantization_config=DoRAFP8Config()) then save_pretrained(same folder)
    without variant=: the hook let it through (only the files transformers writes or deletes were checked), and
    transformers replaced the folder's config.json by one saying compressed-tensors, beside the dense
    model.fp16.safetensors, which then no longer loaded as the model it was. Refused now, the folder as it was."""
    import shutil

    shutil.copytree(dense_dir, tmp_path / "dense")
    (tmp_path / "dense" / "model.safetensors").rename(tmp_path / "dense" / "model.fp16.safetensors")
    before = {p.name: p.read_bytes() for p in (tmp_path / "dense").iterdir()}
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dense", variant="fp16",
                                                              quantization_config=dorafp8.DoRAFP8Config())
    with pytest.raises(FileExistsError, match=r"'model.fp16.safetensors', which is the file the model was loaded"):
        model.save_pretrained(tmp_path / "dense")
    assert {p.name: p.read_bytes() for p in (tmp_path / "dense").iterdir()} == before


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_a_dense_model_quantized_after_from_pretrained_is_not_written_over_its_files(sharded, tmp_path):
    """from_pretrained(dense) without a quantization_config, then dorafp8.quantize_model: nothing recorded the files it
    was read from, so save_pretrained into its folder, or save_fp8_checkpoint / export_merged / save_kohya_dora onto
    its model.safetensors or a shard, replaced the original-precision weights (the only copy) with fp8 ones. Refused
    now, naming the file, with every file as it was; another path works."""
    src = tmp_path / "dense"
    F.original_model(torch.bfloat16).save_pretrained(src, max_shard_size="50KB" if sharded else "5GB")
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    weights = sorted(n for n in before if n.endswith(".safetensors"))
    assert (len(weights) > 1) == sharded
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    dorafp8.quantize_model(model, verbose=False)
    with pytest.raises(FileExistsError, match=rf"holds '{weights[0]}', which is the file the model was loaded"):
        model.save_pretrained(src)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules="all-linear"))
    for write, m in ((dorafp8.save_fp8_checkpoint, model), (dorafp8.export_merged, pm)):
        with pytest.raises(FileExistsError, match=r"is the file the model was loaded from"):
            write(m, src / weights[-1], verbose=False)
    with pytest.raises(FileExistsError, match=r"is the file the model was loaded from"):
        dorafp8.save_kohya_dora(pm, src / weights[0])
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    dorafp8.export_merged(pm, tmp_path / "merged.safetensors", verbose=False)


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_a_dense_model_loaded_from_legacy_bin_files_is_not_written_over(sharded, tmp_path):
    """A dense model from pytorch_model.bin (or pytorch_model-0000x-of-00002.bin and pytorch_model.bin.index.json),
    quantized after from_pretrained: write.originals knew .safetensors files only, so save_pretrained into its folder
    replaced its config.json (generation_config.json too) with one saying compressed-tensors and put a
    model.safetensors beside the .bin files, which transformers then loads instead: the dense model no longer there;
    save_kohya_dora onto pytorch_model.bin overwrote the only copy. Refused now, every file as it was."""
    src = tmp_path / "dense"
    model = F.original_model(torch.bfloat16)
    model.save_pretrained(src)
    (src / "model.safetensors").unlink()  # transformers 5 writes no .bin: the legacy files made by hand
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    keys = sorted(sd)
    parts = {"pytorch_model-00001-of-00002.bin": keys[:10], "pytorch_model-00002-of-00002.bin": keys[10:]} \
        if sharded else {"pytorch_model.bin": keys}
    for name, part in parts.items():
        torch.save({k: sd[k] for k in part}, src / name)
    if sharded:
        (src / "pytorch_model.bin.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {k: n for n, part in parts.items() for k in part}}))
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    dorafp8.quantize_model(loaded, verbose=False)
    # each file once (the folder's record and the load's both listed them: harmless to a refusal, confusing to read)
    assert sorted(f[-1] for f in originals(loaded)) == sorted(str(src / n) for n in parts)
    first = sorted(parts)[0]
    with pytest.raises(FileExistsError, match=rf"holds '{first}', which is the file the model was loaded from"):
        loaded.save_pretrained(src)
    pm = peft.get_peft_model(loaded, peft.LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules="all-linear"))
    with pytest.raises(FileExistsError, match=r"is the file the model was loaded from"):
        dorafp8.save_kohya_dora(pm, src / first)
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    dorafp8.save_kohya_dora(pm, tmp_path / "adapter.safetensors")


@pytest.mark.parametrize("legacy", ["pytorch_model.bin", "pytorch_model.bin.index.json", "model.safetensors.index.json"])
def test_an_export_is_not_put_where_transformers_would_load_it_instead_of_the_folders_weights(legacy, tmp_path):
    """A folder of legacy weights (pytorch_model.bin, or shards with pytorch_model.bin.index.json; or safetensors
    shards with their index): a single-file export to folder/model.safetensors replaced nothing, but transformers'
    from_pretrained(folder) prefers model.safetensors, so the user silently loaded the export instead of the model
    (a folder export's index did the same to the .bin files). Refused now, before anything is computed, naming the
    file; every file as it was, and from_pretrained(folder) still loads the original; another name works."""
    src = tmp_path / "dense"
    model = F.original_model(torch.bfloat16)
    model.save_pretrained(src)
    (src / "model.safetensors").unlink()
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    keys = sorted(sd)
    parts = {"model-00001-of-00002.safetensors": keys[:10], "model-00002-of-00002.safetensors": keys[10:]}
    if legacy == "pytorch_model.bin":
        torch.save(sd, src / legacy)
    else:
        parts = {n.replace("model", "pytorch_model").replace(".safetensors", ".bin") if "bin" in legacy else n: part
                 for n, part in parts.items()}
        for name, part in parts.items():
            part = {k: sd[k] for k in part}
            torch.save(part, src / name) if name.endswith(".bin") else safetensors.torch.save_file(part, src / name)
        (src / legacy).write_text(json.dumps({"metadata": {}, "weight_map": {k: n for n, p in parts.items() for k in p}}))
    (src / "config.json").rename(tmp_path / "config.json")  # no config.json there to refuse the folder export for
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    dorafp8.quantize_model(model, verbose=False)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules="all-linear"))
    calls = []
    emit = dorafp8.checkpoint.write.emit
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dorafp8.checkpoint.write, "emit", lambda *a, **k: calls.append(1) or emit(*a, **k))
        for write, m, path in ((dorafp8.save_fp8_checkpoint, model, src / "model.safetensors"),
                               (dorafp8.export_merged, pm, str(src / "model.safetensors")),
                               (dorafp8.export_merged, pm, src)):
            with pytest.raises(FileExistsError, match=rf"holds '{re.escape(legacy)}', (and from_pretrained|which no)"):
                write(m, path, format="bf16", verbose=False)  # (an index of that name: not replaced either)
    assert calls == [], "refused after the merge was computed"
    with pytest.raises(FileExistsError, match=rf"holds '{re.escape(legacy)}', and from_pretrained"):
        dorafp8.save_kohya_dora(pm, src / "model.safetensors")
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    shutil.copy(tmp_path / "config.json", src / "config.json")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    assert all(torch.equal(v, sd[k]) for k, v in reloaded.state_dict().items())
    dorafp8.export_merged(pm, src / "model-merged.safetensors", format="bf16", verbose=False)


@pytest.mark.parametrize("sub", ["text_encoder", Path("text_encoder")], ids=["str", "Path"])
def test_a_dense_model_from_a_subfolder_quantized_after_from_pretrained_is_not_written_over_its_files(sub, tmp_path):
    """from_pretrained(root, subfolder="text_encoder") of a dense model without a quantization config, then
    quantize_model: the config's _name_or_path is `root`, which holds no weights, so nothing was recorded and
    save_pretrained into root/text_encoder (or save_fp8_checkpoint / export_merged onto its shard) replaced the only
    bf16 copy with fp8. from_pretrained records the subfolder's files at load time now: refused, naming the file and
    what to do, every file as it was; a fresh folder is written."""
    root = tmp_path / "pipeline"
    folder = root / "text_encoder"
    F.original_model(torch.bfloat16).save_pretrained(folder, max_shard_size="50KB")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    shard = sorted(n for n in before if n.endswith(".safetensors"))[-1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(root, subfolder=sub, dtype=torch.bfloat16)
    dorafp8.quantize_model(model, verbose=False)
    with pytest.raises(FileExistsError, match=r"holds 'model-00001-of-.*', which is the file the model was loaded "
                                              r"from .*text_encoder.*save to another folder"):
        model.save_pretrained(folder)
    model.save_pretrained(tmp_path / "fresh")
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules="all-linear"))
    # torch.compile's wrapper forwards the attributes the load recorded (write.originals reads them by getattr)
    for write, m in ((dorafp8.save_fp8_checkpoint, model), (dorafp8.export_merged, pm),
                     (dorafp8.save_fp8_checkpoint, torch.compile(model))):
        with pytest.raises(FileExistsError, match=rf"path=.*{shard}.* is the file the model was loaded from .*"
                                                  r"write to another path"):
            write(m, folder / shard, verbose=False)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    dorafp8.export_merged(pm, tmp_path / "merged", verbose=False)
    assert (tmp_path / "fresh" / "model.safetensors").exists() and (tmp_path / "merged" / "config.json").exists()


def test_a_dense_model_loaded_through_its_adapters_folder_is_not_written_over_its_base_files(tmp_path):
    """from_pretrained(adapter_folder): transformers reads adapter_config.json there and loads the base model it names
    (then the adapter). The load hook recorded the adapter's folder, which holds no base weights, and that record
    hid the base folder the config names: save_fp8_checkpoint onto the base's model.safetensors, after
    quantize_model, replaced its only bf16 copy with fp8. The folder transformers loaded is recorded now: refused."""
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    F.original_model(torch.bfloat16).save_pretrained(base)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(base),
                            peft.LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(adapter)
        model = transformers.LlamaForCausalLM.from_pretrained(adapter, dtype=torch.bfloat16)
    dorafp8.quantize_model(model, verbose=False)
    before = {p.name: p.read_bytes() for p in base.iterdir()}
    with pytest.raises(FileExistsError, match=rf"path='{base / 'model.safetensors'}', which the export would replace, "
                                              r"is the file the model was loaded from"):
        dorafp8.save_fp8_checkpoint(model, base / "model.safetensors", verbose=False)
    assert {p.name: p.read_bytes() for p in base.iterdir()} == before
    dorafp8.save_fp8_checkpoint(model, tmp_path / "fresh.safetensors", verbose=False)


def test_a_model_joined_from_models_loaded_apart_is_not_written_over_their_files(tmp_path):
    """EncoderDecoderModel.from_encoder_decoder_pretrained(enc, dec) loads each part with from_pretrained and joins
    them: the load hook recorded each part's folder on the part, and the composite, which write.originals looked at
    (with its PEFT base), recorded nothing; quantize_model, then save_pretrained into the encoder's folder replaced
    its only bf16 model.safetensors. Every module's record counts now: refused, naming it; a fresh folder works."""
    cfg = dict(vocab_size=97, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    transformers.BertModel(transformers.BertConfig(**cfg)).to(torch.bfloat16).save_pretrained(tmp_path / "enc")
    transformers.BertLMHeadModel(transformers.BertConfig(**cfg, is_decoder=True, add_cross_attention=True)).to(
        torch.bfloat16).save_pretrained(tmp_path / "dec")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.EncoderDecoderModel.from_encoder_decoder_pretrained(tmp_path / "enc", tmp_path / "dec",
                                                                                 dtype=torch.bfloat16)
    dorafp8.quantize_model(model, verbose=False)
    for part in ("enc", "dec"):
        before = {p.name: p.read_bytes() for p in (tmp_path / part).iterdir()}
        with pytest.raises(FileExistsError, match=r"holds 'model.safetensors', which is the file the model was loaded "
                                                  rf"from \('{tmp_path / part / 'model.safetensors'}'\)"):
            model.save_pretrained(tmp_path / part)
        assert {p.name: p.read_bytes() for p in (tmp_path / part).iterdir()} == before
    model.save_pretrained(tmp_path / "fresh")


def _loaded_relative_then_chdir(tmp_path, monkeypatch):
    """A dense model saved as a/dense and another as b/dense; from_pretrained("dense") in a, quantize_model, then
    os.chdir(b)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    F.original_model(torch.bfloat16).save_pretrained(tmp_path / "a" / "dense")
    F.original_model(torch.bfloat16, seed=1).save_pretrained(tmp_path / "b" / "dense")  # another model, same name
    monkeypatch.chdir(tmp_path / "a")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained("dense", dtype=torch.bfloat16)
    dorafp8.quantize_model(model, verbose=False)
    monkeypatch.chdir(tmp_path / "b")
    return model


def test_a_relative_model_path_is_resolved_where_it_was_loaded(tmp_path, monkeypatch):
    """from_pretrained("dense") (relative), quantize_model, then os.chdir elsewhere: the config's "dense" was looked up
    under the new working directory at save time, so save_pretrained into the real folder replaced the original
    bf16 weights (nothing was found there). The folder is resolved when from_pretrained reads it now: refused."""
    model = _loaded_relative_then_chdir(tmp_path, monkeypatch)
    before = {p.name: p.read_bytes() for p in (tmp_path / "a" / "dense").iterdir()}
    with pytest.raises(FileExistsError, match=r"holds 'model.safetensors', which is the file the model was loaded "
                                              rf"from \('{tmp_path / 'a' / 'dense' / 'model.safetensors'}'\)"):
        model.save_pretrained(tmp_path / "a" / "dense")
    with pytest.raises(FileExistsError, match="is the file the model was loaded from"):
        dorafp8.save_fp8_checkpoint(model, tmp_path / "a" / "dense" / "model.safetensors", verbose=False)
    assert {p.name: p.read_bytes() for p in (tmp_path / "a" / "dense").iterdir()} == before


def test_a_relative_model_path_does_not_protect_a_same_named_folder_elsewhere(tmp_path, monkeypatch):
    """The same, saved into the "dense" of the new working directory (another model's folder, no file of this one):
    refused as "the file the model was loaded from" before. Written now."""
    model = _loaded_relative_then_chdir(tmp_path, monkeypatch)
    model.save_pretrained("dense")
    dorafp8.save_fp8_checkpoint(model, Path("dense") / "other.safetensors", verbose=False)
    dorafp8.save_fp8_checkpoint(model, Path("dense") / "model.safetensors", verbose=False)


@pytest.mark.parametrize("change", ["touched", "moved"])
@pytest.mark.parametrize("how", ["quantize_model", "DoRAFP8Config"])
def test_the_originals_stay_protected_when_touched_or_moved_after_loading(how, change, tmp_path):
    """The files from_pretrained read are recorded when it loads (identity: inode, size, mtime): a touch (rsync, a
    backup tool) of model.safetensors after that left it unprotected, as the load-time record alone (DoRAFP8Config's
    too); the folder's files as they are at save time count now. A folder moved after loading: its files are still
    the ones read."""
    src = tmp_path / "dense"
    F.original_model(torch.bfloat16).save_pretrained(src)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if how == "quantize_model":
            model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
            dorafp8.quantize_model(model, verbose=False)
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(src, quantization_config=dorafp8.DoRAFP8Config())
    if change == "touched":
        os.utime(src / "model.safetensors", ns=(1, 1))
    else:
        src = src.rename(tmp_path / "moved")
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    with pytest.raises(FileExistsError, match="holds 'model.safetensors', which is the file the model was loaded"):
        model.save_pretrained(src)
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before


def test_a_fifo_beside_a_dense_model_does_not_block_its_writers(tmp_path):
    """A FIFO named model.safetensors.index.json beside a dense model.safetensors (planted, or in a folder of that
    name under another working directory): transformers loads model.safetensors and never opens it, but every
    dorafp8 writer, and save_pretrained, read each index there for the model's original files (write.originals) and
    blocked for ever in its open. Now it is passed over: the original is still refused, another path written. A
    helper frees every blocked reader after 3 s, and says so (a file), so that the old behaviour fails this test
    instead of hanging it."""
    src = tmp_path / "dense"
    F.original_model(torch.bfloat16).save_pretrained(src)
    fifo = src / "model.safetensors.index.json"
    os.mkfifo(fifo)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    dorafp8.quantize_model(model, verbose=False)
    opened = tmp_path / "opened"
    helper = subprocess.Popen(["sh", "-c", f"sleep 3; while :; do printf x > '{fifo}'; touch '{opened}'; done"])
    try:
        with pytest.raises(FileExistsError, match="is the file the model was loaded from"):
            dorafp8.save_fp8_checkpoint(model, src / "model.safetensors", verbose=False)
        with pytest.raises(FileExistsError, match="holds 'model.safetensors', which is the file the model was"):
            model.save_pretrained(src)
        dorafp8.save_fp8_checkpoint(model, tmp_path / "out.safetensors", verbose=False)
        assert not opened.exists()  # nothing opened the FIFO
    finally:
        helper.kill()
        helper.wait()


def test_dorafp8config_errors(dense_dir, tmp_path):
    with pytest.raises(ValueError, match="granularity must be one of"):
        dorafp8.DoRAFP8Config("channel")
    with pytest.raises(ValueError, match="block_size=64 needs granularity='block'"):
        dorafp8.DoRAFP8Config(block_size=64)
    with pytest.raises(ValueError, match="act_quant must be None or 'rowwise'"):
        dorafp8.DoRAFP8Config(act_quant="per-tensor")
    # a config.json that claims quant_method "dorafp8" (dorafp8 never writes one) is refused, not skipped
    import shutil

    shutil.copytree(dense_dir, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["quantization_config"] = dorafp8.DoRAFP8Config().to_dict()
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="never writes.*load_fp8_checkpoint"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    # an fp8 checkpoint keeps its own quantization config (transformers refuses the mix; docs/CHECKPOINTS.md)
    _llama().save_pretrained(tmp_path / "fp8")
    with pytest.raises(ValueError, match="quantized with CompressedTensorsConfig but you are passing a DoRAFP8Config"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", quantization_config=dorafp8.DoRAFP8Config())
    # weights that are not in memory (offloaded) cannot be quantized in place
    from dorafp8.checkpoint.hf_quantizer import DoRAFP8HfQuantizer

    with pytest.raises(ValueError, match="not in memory.*load without offloading"):
        DoRAFP8HfQuantizer(dorafp8.DoRAFP8Config(), pre_quantized=False)._process_model_after_weight_loading(
            F.meta_model(how="meta"))


# ---------------------------------------------------------------------------------------------------- diffusers


@pytest.fixture(scope="module")
def unet():
    unet = small_unet()
    dorafp8.quantize_model(unet, include_conv=True)
    return unet.eval()


@pytest.fixture(scope="module")
def dora_unet(unet):
    """DoRA on the attention projections of the fp8 UNet (dorafp8 merges into FP8Linear layers, not fp8 convs)."""
    pm = peft.get_peft_model(copy.deepcopy(unet), peft.LoraConfig(r=2, lora_alpha=4, use_dora=True,
                                                                  target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    return _perturb_dora(pm)


def test_a_dense_unet_quantized_after_from_pretrained_is_not_written_over_its_file(tmp_path):
    """diffusers' from_pretrained(dense), then quantize_model: an export onto its
    diffusion_pytorch_model.safetensors replaced the original-precision weights (nothing recorded them). Refused."""
    src = tmp_path / "unet"
    small_unet().save_pretrained(src)
    original = src / "diffusion_pytorch_model.safetensors"
    before = original.read_bytes()
    model = diffusers.UNet2DConditionModel.from_pretrained(src)
    dorafp8.quantize_model(model, verbose=False)
    with pytest.raises(FileExistsError, match=r"is the file the model was loaded from"):
        dorafp8.save_fp8_checkpoint(model, original, verbose=False)
    assert original.read_bytes() == before


def test_a_dense_unet_from_a_subfolder_quantized_after_from_pretrained_is_not_written_over_its_file(tmp_path):
    """diffusers' from_pretrained(root, subfolder="unet") of a dense UNet, then quantize_model: _name_or_path is
    `root`, so nothing was recorded and save_fp8_checkpoint onto root/unet/diffusion_pytorch_model.safetensors
    replaced the only original-precision copy. Refused now, naming the file; another path is written."""
    src = tmp_path / "pipeline" / "unet"
    small_unet().save_pretrained(src)
    original = src / "diffusion_pytorch_model.safetensors"
    before = original.read_bytes()
    model = diffusers.UNet2DConditionModel.from_pretrained(tmp_path / "pipeline", subfolder="unet")
    dorafp8.quantize_model(model, verbose=False)
    with pytest.raises(FileExistsError, match=r"diffusion_pytorch_model.safetensors.* is the file the model was "
                                              r"loaded from .*write to another path"):
        dorafp8.save_fp8_checkpoint(model, original, verbose=False)
    assert original.read_bytes() == before
    dorafp8.save_fp8_checkpoint(model, tmp_path / "out", verbose=False)


def test_unet_save_pretrained_refuses(unet, tmp_path):
    with pytest.raises(ValueError, match=r"UNet2DConditionModel\.save_pretrained.*fp8 layers.*"
                                         r"dorafp8\.save_fp8_checkpoint.*dorafp8\.export_merged"):
        unet.save_pretrained(tmp_path)
    assert not any(tmp_path.iterdir())


def _diffusers_load(path):
    return diffusers.UNet2DConditionModel.from_pretrained(path).eval()


def _load_as_the_error_says(path):
    from accelerate import init_empty_weights

    cls = diffusers.UNet2DConditionModel
    with init_empty_weights():
        model = cls.from_config(cls.load_config(path))
    dorafp8.load_fp8_checkpoint(model, path, verbose=False)
    return model.eval()


def _unet_case(write, model, fmt, path):
    """A dense format loads in plain diffusers; an fp8 one is refused by diffusers' from_pretrained with the way to
    load it, which works; fp8-cast needs scale 1 and says so."""
    if fmt == "fp8-cast":
        with pytest.raises(ValueError, match=_NO_SCALE):
            write(model, path, format=fmt, verbose=False)
        return
    write(model, path, format=fmt, verbose=False)
    if fmt in DENSE_FORMATS:
        assert_reloads(model, _diffusers_load(path), _unet_out, stored=DENSE_FORMATS[fmt])
        return
    with pytest.raises(ValueError, match=r"written by dorafp8.*dorafp8\.load_fp8_checkpoint\(model, path\)"):
        _diffusers_load(path)
    return _load_as_the_error_says(path)


@pytest.mark.parametrize("fmt", FORMATS)
def test_unet_save_fp8_checkpoint_every_format(fmt, unet, tmp_path):
    loaded = _unet_case(dorafp8.save_fp8_checkpoint, unet, fmt, tmp_path / "ckpt")
    if loaded is not None:
        assert_reloads(unet, loaded, _unet_out)  # the per-tensor layers fit every fp8 layout as they are


@pytest.mark.parametrize("fmt", FORMATS)
def test_unet_export_merged(fmt, dora_unet, tmp_path):
    loaded = _unet_case(dorafp8.export_merged, dora_unet, fmt, tmp_path / "ckpt")
    if loaded is not None:
        assert_reloads(dora_unet, loaded, _unet_out, stored=E4M3)


# ---------------------------------------------------------------------------------------------------- no dorafp8


def _run_python(code: str, *args, **env_vars) -> str:
    env = dict(os.environ, HF_HUB_OFFLINE="1", **env_vars)
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, env=env,
                         cwd=ROOT)
    assert out.returncode == 0, f"exit {out.returncode}\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    return out.stdout


def test_plain_libraries_without_dorafp8(dora, unet, tmp_path):
    """In an interpreter that has not imported dorafp8: transformers reloads what save_pretrained wrote (base and
    merged) with the saved model's logits, and diffusers refuses a dorafp8 directory by its quant_method. Then
    dorafp8, imported after them, still hooks their save_pretrained and registers DoRAFP8Config (imported before
    them, the hooks run when they load: the tests above)."""
    cases = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # merging re-quantizes (warns)
        merged = copy.deepcopy(dora).merge_and_unload()
    for name, model in (("base", _llama(block_size=32)), ("merged", merged)):
        model.save_pretrained(tmp_path / name)
        torch.save(_llama_out(model), tmp_path / f"{name}.pt")
        cases[name] = str(tmp_path / name)
    dorafp8.save_fp8_checkpoint(unet, tmp_path / "unet", verbose=False)
    out = _run_python("""
import json, sys, warnings
import torch, transformers, diffusers
warnings.simplefilter("ignore")
cases = json.loads(sys.argv[1])
ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
for name, path in cases.items():
    with torch.no_grad():
        out = transformers.AutoModelForCausalLM.from_pretrained(path)(input_ids=ids).logits.float()
    torch.testing.assert_close(out, torch.load(path + ".pt"))  # the same weights: float32 rounding
    print(name, "ok")
try:
    diffusers.UNet2DConditionModel.from_pretrained(sys.argv[2])
except ValueError as e:
    print("diffusers:", e)
print("dorafp8 imported:", any(m.startswith("dorafp8") for m in sys.modules))
import dorafp8
from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
print("hooks:", transformers.PreTrainedModel.save_pretrained._dorafp8, diffusers.ModelMixin.save_pretrained._dorafp8,
      AUTO_QUANTIZATION_CONFIG_MAPPING["dorafp8"].__name__, AUTO_QUANTIZER_MAPPING["dorafp8"].__name__)
""", json.dumps(cases), str(tmp_path / "unet"))
    lines = dict(line.split(" ", 1) for line in out.strip().splitlines())
    assert all(lines[name] == "ok" for name in cases), out
    assert "Unknown quantization type, got dorafp8" in lines["diffusers:"], out
    assert lines["dorafp8"] == "imported: False", out
    assert lines["hooks:"] == "True True DoRAFP8Config DoRAFP8HfQuantizer", out


def test_without_its_save_hooks_dorafp8_warns_that_save_pretrained_would_lose_the_scales(tmp_path):
    """With DORAFP8_NO_PATCHES=1 transformers' save_pretrained is its own, and of an fp8 model it wrote a checkpoint
    that reloads with its logits far off (the raw e4m3 values without their scales), without a word. quantize_model,
    load_fp8_checkpoint and from_transformers_fp8 now warn where the model's save_pretrained would do that, and the
    fix the warning names (save_fp8_checkpoint as compressed-tensors) reloads right in plain transformers; without
    the opt-out, nothing warns."""
    code = """
import sys, warnings
import torch, transformers
import dorafp8
from tests.checkpoint import _ckpt_fixtures as F

def said(fn):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fn()
    return [str(x.message) for x in w if "save_pretrained" in str(x.message)]

model = F.original_model()
print("quantize_model:", said(lambda: dorafp8.quantize_model(model, per_row_scale=True)))
dorafp8.save_fp8_checkpoint(model, sys.argv[1], format="compressed-tensors", verbose=False)
meta = F.meta_model()
print("load_fp8_checkpoint:", said(lambda: dorafp8.load_fp8_checkpoint(meta, sys.argv[1], verbose=False)))
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])
    with torch.no_grad():
        error = (loaded(input_ids=F.IDS).logits - model(input_ids=F.IDS).logits).abs().max().item()
    compressed = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])  # fp8 until its first forward
print("reloaded:", error)
print("from_transformers_fp8:", said(lambda: dorafp8.from_transformers_fp8(compressed)))
"""
    for opt_out in ("1", "0"):
        out = _run_python(code, str(tmp_path / f"ct{opt_out}"), DORAFP8_NO_PATCHES=opt_out)
        lines = dict(line.split(": ", 1) for line in out.strip().splitlines() if ": " in line)
        assert float(lines["reloaded"]) < 1e-4, out  # the fix the warning names: from_pretrained reads it right
        for entry in ("quantize_model", "load_fp8_checkpoint", "from_transformers_fp8"):
            said = ast.literal_eval(lines[entry])  # a list of str, printed by the child
            if opt_out == "0":
                assert said == [], (entry, out)
                continue
            assert len(said) == 1, (entry, out)
            assert all(s in said[0] for s in ("LlamaForCausalLM.save_pretrained", "DORAFP8_NO_PATCHES",
                                               "without their scales", "save_fp8_checkpoint(model, path, "
                                               "format='compressed-tensors')")), said[0]
