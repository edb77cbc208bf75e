"""NVFP4 and MXFP8 checkpoints through load_fp8_checkpoint: compressed-tensors' nvfp4-pack-quantized written by its own
library, ModelOpt's NVFP4 and MXFP8 under its export's names (tests/checkpoint/_ckpt_fixtures.py). Each loads in place
into FP8Linear layers holding the file's bytes (packed weights, e4m3 / e8m0 scales) bit for bit, and the model computes
what the dense model on the format's own dequantization computes. Malformed files are refused naming the tensor,
before the model changes."""

import json
import os
import re

import pytest
import torch
from torch import nn

from dorafp8 import FP8Linear, load_fp8_checkpoint
from dorafp8.checkpoint import CheckpointFormatError
from dorafp8 import quant
from tests._tolerance import assert_close, tol
from tests.checkpoint._ckpt_fixtures import (FUSED, IDS, LINEARS, meta_model, original_model, read_all,
                                             write_compressed_tensors_nvfp4, write_modelopt)
from tests.kernels.test_microscaled import dequant_64


def _linears(model):
    return {n: m for n, m in model.named_modules() if n.split(".")[-1] in LINEARS}


def _dense_twin(file: dict, packed_suffix: str, reciprocal: bool):
    """The original model with every linear weight replaced by the file's dequantization in fp64 (rounded to fp32):
    W0 = e2m1 * (scale * g) for ModelOpt, e2m1 * (scale / g) for compressed-tensors, e4m3 * 2^(e - 127) for MXFP8."""
    model = original_model()
    with torch.no_grad():
        for name, mod in _linears(model).items():
            w = file[f"{name}.{packed_suffix}"]
            scale = file[f"{name}.weight_scale"]
            if w.dtype == torch.uint8:
                g = file[f"{name}.weight_global_scale" if reciprocal else f"{name}.weight_scale_2"].float()
                g = (1.0 / g) if reciprocal else g
                W = dequant_64(w, scale, g.reshape(()))
            else:
                W = dequant_64(w, scale.view(quant.E8M0))
            mod.weight.copy_(W.float())
    return model


@pytest.mark.parametrize("writer", ["compressed-tensors", "compressed-tensors-mxfp8", "modelopt-nvfp4",
                                    "modelopt-mxfp8"])
def test_loads_in_place_bit_exactly(tmp_path, writer):
    """compressed-tensors-mxfp8: its own mxfp8-quantized export (config.json format 'mxfp8-quantized') was refused as
    "neither float-quantized fp8 nor nvfp4-pack-quantized" although its weights are the MXFP8 dorafp8 reads."""
    if writer == "compressed-tensors":
        pytest.importorskip("compressed_tensors")
        path = write_compressed_tensors_nvfp4(original_model(), str(tmp_path / "ct"))
        packed_suffix, fmt, kind = "weight_packed", "compressed-tensors", "nvfp4"
    elif writer == "compressed-tensors-mxfp8":
        pytest.importorskip("compressed_tensors")
        path = write_compressed_tensors_nvfp4(original_model(), str(tmp_path / "ct"), preset="MXFP8A16")
        packed_suffix, fmt, kind = "weight", "compressed-tensors", "mxfp8"
    else:
        algo = writer.split("-")[1].upper()
        path = write_modelopt(original_model(), str(tmp_path / "mo"), algo)
        packed_suffix, fmt, kind = "weight", "modelopt", algo.lower()
    file = read_all(path)
    model = meta_model()
    report = load_fp8_checkpoint(model, path, verbose=False)
    assert report.format == fmt
    layers = _linears(model)
    assert len(layers) == 14 and all(isinstance(m, FP8Linear) for m in layers.values())
    for name, mod in layers.items():
        w, scale = file[f"{name}.{packed_suffix}"], file[f"{name}.weight_scale"]
        assert torch.equal(mod.weight.view(torch.uint8), w.view(torch.uint8)), name  # the bytes as stored
        assert torch.equal(mod.scale.view(torch.uint8), scale.view(torch.uint8)), name
        assert quant.scale_kind(mod.scale) == kind
        if kind == "nvfp4":
            g = file[f"{name}.weight_global_scale"] if fmt == "compressed-tensors" else file[f"{name}.weight_scale_2"]
            want = 1.0 / g.float().reshape(()) if fmt == "compressed-tensors" else g.reshape(())
            assert torch.equal(mod.global_scale, want), name
        else:
            assert mod.global_scale is None
    twin = _dense_twin(file, packed_suffix, reciprocal=fmt == "compressed-tensors").eval()
    with torch.no_grad():
        assert_close(model(input_ids=IDS).logits, twin(input_ids=IDS).logits, tol(torch.float32), "logits")
    assert all(v.startswith({"nvfp4": "NVFP4", "mxfp8": "MXFP8"}[kind]) for v in report.fp8_layers.values())


@pytest.mark.parametrize("method,export", [("modelopt", True), ("ModelOpt", True), ("modelopt_fp4", False),
                                           ("compressed-tensors", False)])
def test_dorafp8_run_and_the_loader_read_quant_method_alike(tmp_path, method, export):
    """An MXFP8 export saying so in config.json's quantization_config only: ModelOpt's writer (convert_hf_config.py)
    writes quant_method "modelopt", which vLLM reads in any case, nothing else. `dorafp8 run` (hub.modelopt_export)
    read any case and any "modelopt..." prefix, the loader (CheckpointSource.modelopt_algo) "modelopt" exactly: a
    "ModelOpt" export went to load_fp8_checkpoint, which read it as compressed-tensors (its E8M0 scales too)."""
    from dorafp8.checkpoint import hub

    path = write_modelopt(original_model(), str(tmp_path / "mo"), "MXFP8")
    os.remove(os.path.join(path, "hf_quant_config.json"))
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": method, "quant_algo": "mxfp8"}  # lower case, as ModelOpt may write
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    assert hub.modelopt_export(path) == (("MXFP8", path) if export else None)
    if export:
        model = meta_model()
        assert load_fp8_checkpoint(model, path, verbose=False).format == "modelopt"
        assert all(quant.scale_kind(m.scale) == "mxfp8" for m in _linears(model).values())


@pytest.mark.parametrize("algo,per_weight,per_layer", [("NVFP4", 0.5625, 4), ("MXFP8", 1.03125, 0)])
def test_resident_bytes_a_weight(tmp_path, algo, per_weight, per_layer):
    """Resident bytes of a loaded layer, measured on its tensors: NVFP4 holds the packed weight (0.5 a weight), its
    e4m3 scales (1 per 16) and one fp32 global scale: 0.5625 bytes a weight plus 4 a layer; MXFP8 its e4m3 weight and
    an e8m0 scale per 32: 1.03125."""
    path = write_modelopt(original_model(), str(tmp_path / "mo"), algo)
    model = meta_model()
    load_fp8_checkpoint(model, path, verbose=False)
    for mod in _linears(model).values():
        held = sum(t.numel() * t.element_size() for t in (mod.weight, mod.scale, mod.global_scale) if t is not None)
        assert held == per_weight * mod.in_features * mod.out_features + per_layer


# ---- refusals ------------------------------------------------------------------------------------------------


def _tiny_nvfp4(in_features=32, out_features=8):
    """A one-layer model and its ModelOpt NVFP4 state dict."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(in_features, out_features, bias=False))
    packed, scale, g = quant.quantize_nvfp4(model[0].weight.detach()) if in_features % 16 == 0 else (
        torch.zeros(out_features, in_features // 2, dtype=torch.uint8),
        torch.ones(out_features, -(-in_features // 16)).to(quant.E4M3), torch.tensor(1.0))
    return model, {"0.weight": packed, "0.weight_scale": scale, "0.weight_scale_2": g}


@pytest.mark.parametrize("damage,match", [
    (lambda sd: sd.update({"0.weight_scale": sd["0.weight_scale"][:, :1].contiguous()}),
     r"0\.weight_scale: shape \[8, 1\], but the \[8, 32\] nvfp4 weight '0\.weight' needs \[8, 2\]"),
    (lambda sd: sd.update({"0.weight": sd["0.weight"][:, :15].contiguous()}),
     r"0\.weight: shape \[8, 15\] in the checkpoint, \[8, 32\] in the model"),
    (lambda sd: sd.update({"0.weight_scale_2": torch.tensor(float("inf"))}),
     r"0\.weight_scale_2: NVFP4 global scale inf is not a finite positive number"),
    (lambda sd: sd.update({"0.weight_scale_2": torch.tensor(float("nan"))}),
     r"0\.weight_scale_2: NVFP4 global scale nan"),
    (lambda sd: sd.update({"0.weight_scale_2": torch.tensor([1.0, 2.0])}),
     r"0\.weight_scale_2: torch\.float32 of shape \[2\]; NVFP4's global scale is one fp32 value"),
    (lambda sd: sd.update({"0.weight_scale": sd["0.weight_scale"].float()}),
     r"0\.weight_scale: dtype torch\.float32; a nvfp4 scale is torch\.float8_e4m3fn"),
])
def test_malformed_nvfp4_is_refused_naming_the_tensor(damage, match):
    model, sd = _tiny_nvfp4()
    damage(sd)
    before = model[0].weight.detach().clone()
    with pytest.raises(CheckpointFormatError, match=match):
        load_fp8_checkpoint(model, sd, verbose=False)
    assert type(model[0]) is nn.Linear and torch.equal(model[0].weight, before)  # nothing changed


@pytest.mark.parametrize("strict", [True, False])
def test_awq_pre_quant_scale_is_refused_naming_it(strict):
    """ModelOpt's NVFP4_AWQ / NVFP4_SVD exports keep `<layer>.pre_quant_scale` (the layer computes (x * s) W^T). Without
    the hf_quant_config.json naming that quant_algo (a weights file on its own), strict=True refused it as a key that
    "fits nothing", suggesting strict=False, which then loaded the layer without it: wrong outputs, no error. Refused
    now either way, naming the key, the model unchanged."""
    model, sd = _tiny_nvfp4()
    sd["0.pre_quant_scale"] = torch.rand(32) + 0.5
    before = model[0].weight.detach().clone()
    with pytest.raises(CheckpointFormatError, match=r"0\.pre_quant_scale: an AWQ / SVDQuant pre-quantization scale"):
        load_fp8_checkpoint(model, sd, strict=strict, verbose=False)
    assert type(model[0]) is nn.Linear and torch.equal(model[0].weight, before)


def test_packed_size_that_is_not_whole_nvfp4_blocks_is_refused():
    """in_features = 24: 12 bytes a row, 1.5 blocks of 16: not NVFP4 as ModelOpt or compressed-tensors write it."""
    model, sd = _tiny_nvfp4(in_features=24)
    with pytest.raises(CheckpointFormatError, match=r"0\.weight: packed NVFP4 of shape \[8, 12\] holds 24 values a "
                                                     r"row, not a multiple of 16"):
        load_fp8_checkpoint(model, sd, verbose=False)


def test_nan_block_scale_is_refused_and_the_model_put_back():
    model, sd = _tiny_nvfp4()
    sd["0.weight_scale"] = sd["0.weight_scale"].clone()
    sd["0.weight_scale"].view(torch.uint8)[3, 1] = 0x7F  # e4m3 NaN
    with pytest.raises(CheckpointFormatError, match=r"0\.weight_scale: 1 of 16 nvfp4 scale values are NaN"):
        load_fp8_checkpoint(model, sd, verbose=False)
    assert type(model[0]) is nn.Linear


def test_fp8linear_refuses_a_non_finite_global_scale():
    packed, scale, _ = quant.quantize_nvfp4(torch.randn(4, 32))
    for bad in (float("nan"), float("inf"), 0.0):
        with pytest.raises(ValueError, match="global_scale must be a finite positive fp32 value"):
            FP8Linear.from_fp8(packed, scale, global_scale=torch.tensor(bad))


@pytest.mark.parametrize("kind,byte", [("nvfp4", 0x7F), ("nvfp4", 0xFF), ("nvfp4", 0x91), ("mxfp8", 0xFF)])
def test_fp8linear_refuses_nan_or_negative_block_scales(kind, byte):
    """e4m3 NaN (0x7f / 0xff) or negative (0x91: -2^-6), e8m0 NaN (0xff, OCP MX's one NaN code): refused naming the
    scale and where, as load_fp8_checkpoint refuses them; they made every output of their rows NaN (or the wrong sign)
    silently. A scale of -0 or e8m0 0x00 (2^-127) is a value and is kept."""
    W = torch.randn(4, 64)
    w, scale, g = quant.quantize_nvfp4(W) if kind == "nvfp4" else (*quant.quantize_mxfp8(W), None)
    ok = scale.clone()
    ok.view(torch.uint8)[0, 0] = 0x80 if kind == "nvfp4" else 0x00
    FP8Linear.from_fp8(w, ok, global_scale=g)
    scale.view(torch.uint8)[2, 1] = byte
    with pytest.raises(ValueError, match=rf"scale: 1 of {scale.numel()} {kind} scale values are NaN or negative "
                                         r"\(first at \[2, 1\]\)"):
        FP8Linear.from_fp8(w, scale, global_scale=g)


def test_from_transformers_fp8_refuses_a_nan_nvfp4_block_scale(tmp_path):
    """A compressed-tensors NVFP4 model from from_pretrained whose block scale is NaN: from_transformers_fp8 names the
    tensor and leaves every module as it was (GUIDE: a NaN scale is refused naming the tensor, before the model
    changes), as load_fp8_checkpoint does; it converted the model, whose outputs were then NaN."""
    pytest.importorskip("compressed_tensors")
    import transformers

    from dorafp8 import from_transformers_fp8

    path = write_compressed_tensors_nvfp4(original_model(), str(tmp_path / "ct"))
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    target = model.model.layers[1].mlp.up_proj
    target.weight_scale.data.view(torch.uint8)[3, 0] = 0x7F
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight_scale: 1 of \d+ nvfp4 scale values "
                                         r"are NaN or negative \(first at \[3, 0\]\)"):
        from_transformers_fp8(model)
    assert {n: type(m) for n, m in model.named_modules()} == before


def test_mxfp8_with_a_wrong_scale_shape_is_refused():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(70, 8, bias=False))
    w8, e = quant.quantize_mxfp8(model[0].weight.detach())
    sd = {"0.weight": w8, "0.weight_scale": e.view(torch.uint8)[:, :2].contiguous()}
    with pytest.raises(CheckpointFormatError, match=r"0\.weight_scale: shape \[8, 2\], but the \[8, 70\] mxfp8 "
                                                     r"weight '0\.weight' needs \[8, 3\]"):
        load_fp8_checkpoint(model, sd, verbose=False)
    sd["0.weight_scale"] = e.view(torch.uint8)
    load_fp8_checkpoint(model, sd, verbose=False)
    assert torch.equal(model[0].scale.view(torch.uint8), e.view(torch.uint8))


def test_a_modelopt_mxfp8_folder_is_refused_for_partial_blocks_and_a_file_round_trips(tmp_path):
    """MXFP8 layers whose input size is not a multiple of 32 (dorafp8 reads and holds a partial last block: scales
    [N, ceil(K / 32)]) were written so into a ModelOpt folder with hf_quant_config.json: a
    folder ModelOpt's own export never makes (MXFP8QTensor asserts in_dim % 32 == 0) and vLLM's
    ModelOptMxFp8LinearMethod refuses to load. Refused now before anything is written, naming a layer and the two
    ways out; the single file still writes and reads back bit for bit."""
    from dorafp8 import save_fp8_checkpoint

    torch.manual_seed(0)
    sizes = [(48, 8), (8, 64), (64, 16)]  # K = 48 and 8 partial, 64 whole
    sd = {}
    for i, (k, n) in enumerate(sizes):
        w8, e = quant.quantize_mxfp8(torch.randn(n, k))
        sd.update({f"{i}.weight": w8, f"{i}.weight_scale": e.view(torch.uint8)})
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(k, n, bias=False) for k, n in sizes))
    load_fp8_checkpoint(model, sd, verbose=False)
    out = tmp_path / "mo"
    with pytest.raises(ValueError, match=r"format='modelopt' into a folder .* 2 MXFP8 layers have an input size that "
                                         r"is not a multiple of 32 \(e\.g\. '0', 48\).*a path ending in "
                                         r"\.safetensors.* \(bf16\)"):
        save_fp8_checkpoint(model, str(out), format="modelopt", verbose=False)
    assert not out.exists()
    file = tmp_path / "mo.safetensors"
    save_fp8_checkpoint(model, str(file), format="modelopt", verbose=False)
    with torch.device("meta"):
        back = nn.Sequential(*(nn.Linear(k, n, bias=False) for k, n in sizes))
    load_fp8_checkpoint(back, str(file), verbose=False)
    for i in range(len(sizes)):
        assert torch.equal(back[i].weight.view(torch.uint8), sd[f"{i}.weight"].view(torch.uint8)), i
        assert torch.equal(back[i].scale.view(torch.uint8), sd[f"{i}.weight_scale"]), i


def test_a_modelopt_mxfp8_single_file_loads_with_format_modelopt(tmp_path):
    """save_fp8_checkpoint(..., "x.safetensors", format="modelopt") of an MXFP8 model, loaded back with the format it
    was written in, was refused ("format='modelopt' but the checkpoint looks like compressed-tensors"): without
    hf_quant_config.json nothing tells ModelOpt's MXFP8 from compressed-tensors' mxfp8-quantized, which read alike.
    Now it loads, bit for bit, and writes back in ModelOpt's layout by default; an NVFP4 file, whose two layouts differ,
    is still refused under the other's name."""
    from dorafp8 import save_fp8_checkpoint

    torch.manual_seed(0)
    w8, e = quant.quantize_mxfp8(torch.randn(16, 64))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 16, bias=False))
    load_fp8_checkpoint(model, {"0.weight": w8, "0.weight_scale": e.view(torch.uint8)}, verbose=False)
    file = str(tmp_path / "mx.safetensors")
    save_fp8_checkpoint(model, file, format="modelopt", verbose=False)
    with torch.device("meta"):
        back = nn.Sequential(nn.Linear(64, 16, bias=False))
    assert load_fp8_checkpoint(back, file, format="modelopt", verbose=False).format == "modelopt"
    assert torch.equal(back[0].weight.view(torch.uint8), w8.view(torch.uint8))
    assert torch.equal(back[0].scale.view(torch.uint8), e.view(torch.uint8))
    assert save_fp8_checkpoint(back, str(tmp_path / "again.safetensors"), verbose=False).format == "modelopt"
    _, sd = _tiny_nvfp4(64, 16)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 16, bias=False))
    with pytest.raises(CheckpointFormatError, match=r"format='compressed-tensors' but the checkpoint looks like "
                                                    r"modelopt"):
        load_fp8_checkpoint(model, sd, format="compressed-tensors", verbose=False)


def test_a_modelopt_mxfp8_scale_is_written_as_the_bytes_vllm_copies(tmp_path):
    """A ModelOpt-layout MXFP8 file whose weight_scale is stored as F8_E8M0 (not ModelOpt's uint8) was written back
    so (its dtype kept): vLLM's ModelOpt MXFP8 loader registers weight_scale as uint8 and fills it with copy_, which
    converts an e8m0 tensor by value (2^(e - 127) cast to an integer: 0, 1, 8, ...), not by its bytes, so the exported
    folder ran with garbage scales, without an error. Now the scale is always written as its uint8 bytes, what
    ModelOpt's export writes, and reads back the same."""
    from safetensors.torch import save_file

    from dorafp8 import save_fp8_checkpoint

    torch.manual_seed(0)
    w8, e = quant.quantize_mxfp8(torch.randn(16, 64))
    src = tmp_path / "mo"
    src.mkdir()
    save_file({"0.weight": w8, "0.weight_scale": e}, str(src / "model.safetensors"))
    (src / "hf_quant_config.json").write_text(json.dumps({"quantization": {
        "quant_algo": "MXFP8", "kv_cache_quant_algo": None, "exclude_modules": []}}))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 16, bias=False))
    load_fp8_checkpoint(model, str(src), verbose=False)
    out = str(tmp_path / "out")
    save_fp8_checkpoint(model, out, format="modelopt", verbose=False)
    stored = read_all(out)["0.weight_scale"]
    vllm = torch.empty(stored.shape, dtype=torch.uint8).copy_(stored)  # vLLM's uint8 parameter, loaded
    assert torch.equal(vllm, e.view(torch.uint8))
    with torch.device("meta"):
        back = nn.Sequential(nn.Linear(64, 16, bias=False))
    load_fp8_checkpoint(back, out, verbose=False)
    assert torch.equal(back[0].scale.view(torch.uint8), e.view(torch.uint8))


def _mixed_precision_folder(path, algos: dict) -> dict:
    """A ModelOpt MIXED_PRECISION export of a Sequential, one quant_algo per layer (quant_utils.py's
    `quantized_layers`), each layer's tensors as its export writes them: NVFP4 / W4A16_NVFP4 packed uint8 with
    weight_scale e4m3 and weight_scale_2 (NVFP4QTensor), FP8 e4m3 with weight_scale fp32 () (amax / 448),
    FP8_PER_CHANNEL_PER_TOKEN with weight_scale fp32 [out]; the layers' dense fp64 W0 by ModelOpt's dequantization."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    sd, want = {}, {}
    for i, algo in algos.items():
        w = torch.randn(16, 64)
        if "NVFP4" in algo:
            p, s, g = quant.quantize_nvfp4(w)
            sd.update({f"{i}.weight": p, f"{i}.weight_scale": s, f"{i}.weight_scale_2": g})
            want[i] = dequant_64(p, s, g)
        else:
            s = w.abs().amax(1) / 448 if algo == "FP8_PER_CHANNEL_PER_TOKEN" else w.abs().amax() / 448
            w8 = (w / (s[:, None] if s.dim() else s)).to(torch.float8_e4m3fn)
            sd.update({f"{i}.weight": w8, f"{i}.weight_scale": s, f"{i}.input_scale": torch.tensor(0.02)})
            want[i] = w8.double() * (s[:, None] if s.dim() else s).double()
    os.makedirs(path)
    save_file(sd, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "hf_quant_config.json"), "w") as f:
        json.dump({"producer": {"name": "modelopt", "version": "0.44.0"},
                   "quantization": {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None,
                                    "quantized_layers": {str(i): {"quant_algo": a} for i, a in algos.items()}}}, f)
    return want


def test_a_modelopt_mixed_precision_export_loads_bit_exactly_or_is_refused_naming_the_layer(tmp_path):
    """ModelOpt writes quant_algo MIXED_PRECISION wherever its layers differ (FP8 attention with NVFP4 MLPs, say:
    quant_utils.py). Such a folder was refused ("NVFP4 global scales but ModelOpt's quant_algo is 'MIXED_PRECISION'")
    without saying what to do, although each of its layers is one dorafp8 reads. Now it loads with format='auto',
    every layer holding ModelOpt's dequantization bit for bit; a layer of an algorithm dorafp8 does not read (an
    int4 W4A16_AWQ) is refused, naming it and what to load instead, and so is a config without quantized_layers."""
    from dorafp8 import save_fp8_checkpoint
    from dorafp8.checkpoint import detect_format

    algos = {0: "NVFP4", 1: "FP8", 2: "FP8_PER_CHANNEL_PER_TOKEN", 3: "W4A16_NVFP4"}
    path = str(tmp_path / "mixed")
    want = _mixed_precision_folder(path, algos)
    assert detect_format(path)[0] == "modelopt"
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(64, 16, bias=False) for _ in algos))
    load_fp8_checkpoint(model, path, verbose=False)
    assert [quant.scale_kind(m.scale) for m in model] == ["nvfp4", "tensor", "row", "nvfp4"]
    for i, m in enumerate(model):
        got = quant.dequantize_weight(m.weight, m.scale, global_scale=m.global_scale)
        assert torch.equal(got, want[i].float()), algos[i]
    # written back: ModelOpt's layout holds one quant_algo a file and the fp8 layouts no NVFP4, so dense, exactly
    with pytest.raises(ValueError, match=r"format='modelopt' does not hold .*: write a dense format \(bf16, fp16, "
                                         r"fp32\): its 2 NVFP4 layers"):
        save_fp8_checkpoint(model, str(tmp_path / "out"), verbose=False)
    save_fp8_checkpoint(model, str(tmp_path / "dense.safetensors"), format="fp32", verbose=False)
    dense = read_all(str(tmp_path / "dense.safetensors"))
    assert all(torch.equal(dense[f"{i}.weight"], want[i].float()) for i in algos)
    # W4A16_NVFP4 alone (weight-only NVFP4: the same tensors) was refused the same way; W4A8_NVFP4_FP8 still is
    w4 = str(tmp_path / "w4a16")
    want = _mixed_precision_folder(w4, {0: "W4A16_NVFP4"})
    for algo in ("W4A16_NVFP4", "W4A8_NVFP4_FP8"):
        with open(os.path.join(w4, "hf_quant_config.json"), "w") as f:
            json.dump({"quantization": {"quant_algo": algo, "group_size": 16}}, f)
        with torch.device("meta"):
            one = nn.Sequential(nn.Linear(64, 16, bias=False))
        if algo == "W4A8_NVFP4_FP8":
            with pytest.raises(CheckpointFormatError, match=r"quant_algo is 'W4A8_NVFP4_FP8'; dorafp8 loads "):
                load_fp8_checkpoint(one, w4, verbose=False)
            continue
        load_fp8_checkpoint(one, w4, verbose=False)
        assert torch.equal(quant.dequantize_weight(one[0].weight, one[0].scale, global_scale=one[0].global_scale),
                           want[0].float())
    bad = str(tmp_path / "awq")
    _mixed_precision_folder(bad, {0: "NVFP4", 1: "W4A16_AWQ"})
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 16, bias=False), nn.Linear(64, 16, bias=False))
    with pytest.raises(CheckpointFormatError, match=r"MIXED_PRECISION export with 1 layers of quant_algo W4A16_AWQ "
                                                    r"\(e\.g\. '1'\), which dorafp8 does not read .* quantize_model"):
        load_fp8_checkpoint(model, bad, verbose=False)
    # without an NVFP4 layer (FP8 attention, AWQ MLPs) the keys read as compressed-tensors': refused by name too, not
    # by the AWQ layer's packed uint8 shape ("the file is not this model's")
    fp8_awq = str(tmp_path / "fp8_awq")
    _mixed_precision_folder(fp8_awq, {0: "FP8", 1: "W4A16_AWQ"})
    with pytest.raises(CheckpointFormatError, match=r"MIXED_PRECISION export with 1 layers of quant_algo W4A16_AWQ"):
        load_fp8_checkpoint(model, fp8_awq, verbose=False)
    with open(os.path.join(bad, "hf_quant_config.json"), "w") as f:
        json.dump({"quantization": {"quant_algo": "MIXED_PRECISION"}}, f)
    with pytest.raises(CheckpointFormatError, match=r"'MIXED_PRECISION' but its config has no \"quantized_layers\""):
        load_fp8_checkpoint(model, bad, verbose=False)


@pytest.mark.parametrize("kind", ["nvfp4", "mxfp8"])
def test_fp8linear_state_dict_round_trip_and_dtype_casts(kind):
    """An FP8Linear holding a microscaled weight: its state_dict loads into a fresh FP8Linear bit for bit (the layer
    takes the file's kind), and .to(bf16) / .half() move nothing (weight, scale and global scale keep their dtypes)."""
    torch.manual_seed(0)
    W = torch.randn(8, 48)
    if kind == "nvfp4":
        packed, scale, g = quant.quantize_nvfp4(W)
        layer = FP8Linear.from_fp8(packed, scale, torch.zeros(8), global_scale=g)
    else:
        layer = FP8Linear.from_fp8(*quant.quantize_mxfp8(W), torch.zeros(8))
    fresh = FP8Linear(48, 8)
    fresh.load_state_dict(layer.state_dict())
    for name in ("weight", "scale", "global_scale"):
        a, b = getattr(layer, name), getattr(fresh, name)
        assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(
            a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))), name
    x = torch.randn(3, 48)
    assert torch.equal(fresh(x), layer(x))
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half()):
        moved = cast(fresh)
        assert moved.weight.dtype == layer.weight.dtype and moved.scale.dtype == layer.scale.dtype
        assert torch.equal(moved(x), layer(x))


@pytest.mark.parametrize("algo", ["NVFP4", "MXFP8"])
def test_writers_refuse_microscaled_layers_in_fp8_layouts_and_write_them_dense(tmp_path, algo):
    """save_fp8_checkpoint and export_merged in an fp8 layout (e4m3 with fp32 scales) refuse a model holding NVFP4 /
    MXFP8 layers before writing anything, naming the kind, a layer and the dense alternative; in a dense format they
    write each layer's dequantization (save) or its merge (export, here with no adapter: the same), bit for bit the
    reference dequantize's fp32 (it refused every format before, dense ones too)."""
    from dorafp8 import export_merged, save_fp8_checkpoint

    path = write_modelopt(original_model(), str(tmp_path / "mo"), algo)
    model = meta_model()
    load_fp8_checkpoint(model, path, verbose=False)
    for write, fmt in ((save_fp8_checkpoint, "compressed-tensors"), (save_fp8_checkpoint, "dorafp8"),
                       (export_merged, "comfyui")):
        out = tmp_path / f"out_{fmt}.safetensors"
        with pytest.raises(ValueError, match=rf"14 {algo} layers \(e.g. '.*'\), which format=.* cannot hold .* "
                                             rf"format='modelopt' .* format='bf16', 'fp16' or 'fp32'"):
            write(model, str(out), format=fmt, verbose=False)
        assert not out.exists()
    for write in (save_fp8_checkpoint, export_merged):
        out = tmp_path / f"dense_{write.__name__}.safetensors"
        write(model, str(out), format="fp32", verbose=False)
        file = read_all(str(out))
        for name, mod in _linears(model).items():
            want = quant.dequantize_weight(mod.weight, mod.scale, global_scale=mod.global_scale)
            assert torch.equal(file[f"{name}.weight"], want), name
    with pytest.raises(ValueError, match=r"format='modelopt' writes a model whose fp8 layers are all NVFP4 or all "
                                         r"MXFP8 \(one quant_algo a file\); this one holds none"):
        save_fp8_checkpoint(original_model(), str(tmp_path / "x.safetensors"), format="modelopt", verbose=False)
    with pytest.raises(ValueError, match=r"granularity='row': format='modelopt' writes each NVFP4 / MXFP8 layer"):
        save_fp8_checkpoint(model, str(tmp_path / "x.safetensors"), format="modelopt", granularity="row",
                            verbose=False)
    assert not (tmp_path / "x.safetensors").exists()


def _dora_on(model, seed=1):
    """PEFT's DoRA (dorafp8's layers) on q_proj and down_proj of `model`, with B and the magnitude moved off their
    initial values so that merging changes every adapted weight."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, use_dora=True,
                                                  target_modules=["q_proj", "down_proj"]))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n or "lora_magnitude" in n:
                p.add_(0.05 * torch.randn(p.shape, generator=g) * (p.abs().mean() + 0.1))
    return peft_model


@pytest.mark.parametrize("algo", ["NVFP4", "MXFP8"])
def test_export_merged_writes_modelopt_and_loads_back(tmp_path, algo):
    """export_merged of a DoRA on a ModelOpt NVFP4 / MXFP8 model writes ModelOpt's layout (its default: the layout the
    model came from): load_fp8_checkpoint reads it into a fresh model whose merged layers hold bit for bit the layer's
    recipe (quant.quantize_nvfp4 / quantize_mxfp8) applied to the merged weight the trained model computes with
    (merge.merged_rows, fp32), and whose other layers keep the source's bytes; the reported merge error is the
    loaded weight's against the merged weight in fp64, and each merged layer's outputs are within it of the dense
    merged layer's (||dW X||_F <= err ||W'||_F ||X||_F). save_fp8_checkpoint writes the source file's tensors back."""
    import json

    from dorafp8 import export_merged, merge, save_fp8_checkpoint

    pytest.importorskip("peft")
    src = write_modelopt(original_model(), str(tmp_path / "mo"), algo)
    model = meta_model()
    load_fp8_checkpoint(model, src, verbose=False)
    peft_model = _dora_on(model)
    out = str(tmp_path / "merged")
    report = export_merged(peft_model, out, verbose=False)
    assert report.format == "modelopt"
    with open(os.path.join(out, "hf_quant_config.json")) as f:
        assert json.load(f)["quantization"]["quant_algo"] == algo
    fresh = meta_model()
    load_report = load_fp8_checkpoint(fresh, out, verbose=False)
    assert load_report.format == "modelopt"
    kind, source = algo.lower(), read_all(src)
    trained, loaded = _linears(peft_model.base_model.model), _linears(fresh)
    merged = {n for n in trained if n.endswith(("q_proj", "down_proj"))}
    assert len(merged) == 4 and {n for n, d in report.layers.items() if d["action"] == "merged"} == merged
    group_g = _fused_group_globals(trained, source) if kind == "nvfp4" else {}
    g = torch.Generator().manual_seed(2)
    for name, layer in trained.items():
        got = loaded[name]
        assert quant.scale_kind(got.scale) == kind, name
        if name not in merged:
            assert report.layers[name]["action"] == "kept", name  # the group's global is q_proj's source one here
            assert torch.equal(got.weight.view(torch.uint8), source[f"{name}.weight"].view(torch.uint8)), name
            assert torch.equal(got.scale.view(torch.uint8), source[f"{name}.weight_scale"].view(torch.uint8)), name
            continue
        base = layer.get_base_layer()
        rows = merge.merged_rows(base.weight, base.scale, base.block_size, merge.adapter_terms(layer, ["default"]),
                                 0, base.out_features, base.global_scale)
        want = quant.quantize_nvfp4(rows, group_g.get(name)) if kind == "nvfp4" else quant.quantize_mxfp8(rows)
        assert torch.equal(got.weight.view(torch.uint8), want[0].view(torch.uint8)), name
        assert torch.equal(got.scale.view(torch.uint8), want[1].view(torch.uint8)), name
        if kind == "nvfp4":
            assert torch.equal(got.global_scale, want[2]), name
        # the dense merged weight in fp64: DoRA's m / ||V|| * V, V = W0 + s B A (docs/DORA_MATH.md)
        A, B = (layer.lora_A["default"].weight.detach().double(), layer.lora_B["default"].weight.detach().double())
        V = dequant_64(base.weight, base.scale, base.global_scale) + layer.scaling["default"] * B @ A
        m = layer.lora_magnitude_vector["default"].weight.detach().double().reshape(-1, 1)
        W = m / V.norm(dim=1, keepdim=True) * V
        deq = dequant_64(got.weight, got.scale, got.global_scale)
        err = report.layers[name]["rel_error"]
        assert 0 < err < (0.2 if kind == "nvfp4" else 0.05), (name, err)
        assert abs(float((deq - W).norm() / W.norm()) - err) <= 1e-5, name
        X = torch.randn(5, base.in_features, generator=g, dtype=torch.float64)
        with torch.no_grad():
            y = got(X.float()).double() - (0 if got.bias is None else got.bias.double())
        bound = err * float(W.norm() * X.norm()) * 1.001 + tol(torch.float32) * float((X @ W.T).norm())
        assert float((y - X @ W.T).norm()) <= bound, name
    saved = str(tmp_path / "saved")
    save_fp8_checkpoint(model, saved, verbose=False)
    again = read_all(saved)
    assert set(again) == set(source), set(again) ^ set(source)
    for k, v in source.items():
        assert again[k].dtype == v.dtype and again[k].shape == v.shape, k
        assert torch.equal(again[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k


def _fused_group_globals(trained: dict, source: dict) -> dict:
    """name -> the global scale export_merged writes an NVFP4 layer of a fused group (q/k/v, gate/up) with: the largest
    of the members' (a merged one's ModelOpt recipe on its merged weight, amax / (6 * 448); the others' from the
    source file). Layers outside such groups: absent (a merged one takes its own)."""
    from dorafp8 import merge

    out = {}
    for name in trained:
        parent, leaf = name.rsplit(".", 1)
        group = next((grp for grp in FUSED if leaf in grp), None)
        if group is None:
            continue
        gs = []
        for m in group:
            layer = trained[f"{parent}.{m}"]
            if hasattr(layer, "lora_A"):
                base = layer.get_base_layer()
                rows = merge.merged_rows(base.weight, base.scale, base.block_size,
                                         merge.adapter_terms(layer, ["default"]), 0, base.out_features,
                                         base.global_scale)
                gs.append(quant.nvfp4_global_scale(rows.abs().amax()))
            else:
                gs.append(source[f"{parent}.{m}.weight_scale_2"].reshape(()))
        out[name] = torch.stack(gs).amax()
    return out


@pytest.mark.parametrize("grow", [False, True])
@pytest.mark.parametrize("how", ["export_merged", "merge_and_unload"])
def test_writers_give_the_layers_vllm_fuses_one_global_scale(tmp_path, how, grow):
    """ModelOpt's NVFP4 export gives q/k/v and gate/up one weight_scale_2 (preprocess_linear_fusion), and vLLM fuses
    them into one layer that multiplies every shard's block scales by the largest shard's weight_scale_2 (modelopt.py;
    only a warning where they differ). export_merged of a DoRA on q_proj re-quantized it with a global scale of its
    own (amax / (6 * 448) of the merged weight), and merge_and_unload then save_fp8_checkpoint wrote the one the merge
    gave it: the fused layer then computed q with k's and v's larger global, 1.5% to 4.7% off, without an error. Now
    the group is written with one global, the largest of its members' (grow: the merged q_proj's, its magnitude
    doubled: k_proj and v_proj are re-quantized with it), and vLLM's reading of every shard is what
    load_fp8_checkpoint reads, bit for bit."""
    from dorafp8 import export_merged, save_fp8_checkpoint

    pytest.importorskip("peft")
    src = write_modelopt(original_model(), str(tmp_path / "mo"), "NVFP4")
    source = read_all(src)
    for lay in ("model.layers.0.self_attn", "model.layers.1.mlp"):  # the fixture's (and ModelOpt's) shared globals
        gs = {float(v) for k, v in source.items() if k.startswith(lay) and k.endswith("weight_scale_2")
              and not k.endswith(("o_proj.weight_scale_2", "down_proj.weight_scale_2"))}
        assert len(gs) == 1, (lay, gs)
    model = meta_model()
    load_fp8_checkpoint(model, src, verbose=False)
    peft_model = _dora_on(model)
    trained = _linears(peft_model.base_model.model)
    if grow:
        with torch.no_grad():
            for name, layer in trained.items():
                if name.endswith("q_proj"):
                    layer.lora_magnitude_vector["default"].weight.mul_(2)
    want_g = _fused_group_globals(trained, source)
    w0 = {n: quant.dequantize_weight(m.weight, m.scale, global_scale=m.global_scale) for n, m in trained.items()
          if not hasattr(m, "lora_A")}
    out = str(tmp_path / "merged")
    if how == "export_merged":
        report = export_merged(peft_model, out, verbose=False)
    else:
        report = save_fp8_checkpoint(peft_model.merge_and_unload(), out, verbose=False)
    file = read_all(out)
    fresh = meta_model()
    load_fp8_checkpoint(fresh, out, verbose=False)
    for name, got in _linears(fresh).items():
        parent, leaf = name.rsplit(".", 1)
        group = next((grp for grp in FUSED if leaf in grp), (leaf,))
        shard_g = [file[f"{parent}.{m}.weight_scale_2"] for m in group]
        if len(group) > 1:
            assert torch.equal(file[f"{name}.weight_scale_2"], want_g[name]), name
        # vLLM's fused layer: this shard's codes and block scales times the largest shard's weight_scale_2
        vllm = quant.unpack_e2m1(file[f"{name}.weight"]) * (file[f"{name}.weight_scale"].float()
                                                             * torch.stack(shard_g).amax()).repeat_interleave(16, 1)
        assert torch.equal(vllm, quant.dequantize_weight(got.weight, got.scale, global_scale=got.global_scale)), name
        action = report.layers[name]["action"]
        if leaf in ("q_proj", "down_proj"):
            assert action == ("merged" if how == "export_merged" else
                              "kept" if leaf == "down_proj" or grow else "requantized"), (name, action)
        elif grow and leaf in ("k_proj", "v_proj"):
            assert action == "requantized", name
            packed, scale, g = quant.quantize_nvfp4(w0[name], want_g[name])
            assert torch.equal(got.weight, packed) and torch.equal(got.scale.view(torch.uint8),
                                                                   scale.view(torch.uint8)), name
            assert 0 < report.layers[name]["rel_error"] < 0.2, name
        else:
            assert action == "kept" and torch.equal(got.weight, source[f"{name}.weight"]), name


@pytest.mark.parametrize("planted", ["o_proj_shares_qkv_global", "qkv_own_globals"])
def test_the_fused_groups_are_the_sets_vllm_fuses_not_equal_globals(tmp_path, monkeypatch, planted):
    """The write grouped NVFP4 siblings by parent module and equal loaded global, not by the sets vLLM fuses
    (packed_modules_mapping: q/k/v -> qkv_proj, gate/up -> gate_up_proj). o_proj_shares_qkv_global: an o_proj whose
    weight_scale_2 equals q/k/v's joined their group, and merging q_proj (its global grown) re-quantized o_proj, which
    vLLM never fuses: error for nothing. qkv_own_globals: q/k/v loaded with globals of their own were each a group of
    one, so the merged q_proj got its own global while vLLM multiplies all three by the largest: q computed wrong.
    Now q/k/v are one group whatever their loaded globals (written with one where a member changed), o_proj is kept
    bit for bit, and vLLM's reading of every q/k/v shard is what load_fp8_checkpoint reads."""
    from dorafp8 import export_merged
    from tests.checkpoint import _ckpt_fixtures

    pytest.importorskip("peft")
    fused = (("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj")) if planted.startswith("o_proj") \
        else (("gate_proj", "up_proj"),)
    monkeypatch.setattr(_ckpt_fixtures, "FUSED", fused)  # how the planted source's globals are shared
    source = read_all(write_modelopt(original_model(), str(tmp_path / "mo"), "NVFP4"))
    qkv = ("q_proj", "k_proj", "v_proj")
    for i in (0, 1):
        gs = {float(source[f"model.layers.{i}.self_attn.{m}.weight_scale_2"]) for m in qkv + ("o_proj",)}
        assert len(gs) == (1 if planted.startswith("o_proj") else 4), gs  # the planted state
    model = meta_model()
    load_fp8_checkpoint(model, str(tmp_path / "mo"), verbose=False)
    peft_model = _dora_on(model)
    with torch.no_grad():  # the merged q_proj's global above the loaded ones
        for name, layer in _linears(peft_model.base_model.model).items():
            if name.endswith("q_proj"):
                layer.lora_magnitude_vector["default"].weight.mul_(2)
    out = str(tmp_path / "merged")
    report = export_merged(peft_model, out, verbose=False)
    file = read_all(out)
    fresh = meta_model()
    load_fp8_checkpoint(fresh, out, verbose=False)
    got = _linears(fresh)
    for i in (0, 1):
        lay = f"model.layers.{i}.self_attn"
        o = f"{lay}.o_proj"
        assert report.layers[o]["action"] == "kept", report.layers[o]
        for s in ("weight", "weight_scale", "weight_scale_2"):
            assert torch.equal(file[f"{o}.{s}"].reshape(-1).view(torch.uint8),
                               source[f"{o}.{s}"].reshape(-1).view(torch.uint8)), s
        shard_g = torch.stack([file[f"{lay}.{m}.weight_scale_2"] for m in qkv])
        assert bool((shard_g == shard_g[0]).all()), shard_g
        for m in qkv:  # vLLM's qkv_proj: each shard's codes and block scales times the largest weight_scale_2
            name = f"{lay}.{m}"
            vllm = quant.unpack_e2m1(file[f"{name}.weight"]) * (
                file[f"{name}.weight_scale"].float() * shard_g.amax()).repeat_interleave(16, 1)
            assert torch.equal(vllm, quant.dequantize_weight(got[name].weight, got[name].scale,
                                                             global_scale=got[name].global_scale)), name


@pytest.mark.parametrize("writer", ["modelopt-NVFP4", "modelopt-W4A16_NVFP4", "compressed-tensors-NVFP4A16",
                                    "compressed-tensors-NVFP4"])
def test_a_modelopt_folder_says_w4a16_nvfp4_where_layers_have_no_input_scale(tmp_path, writer):
    """vLLM's ModelOpt quant_algo NVFP4 (W4A4) computes every layer with its input_scale (alpha = input_scale *
    weight_scale_2), a parameter left uninitialized (torch.empty) where the file has none; its W4A16_NVFP4 method
    reads the same weights and ignores input_scale. dorafp8 wrote quant_algo NVFP4 for every NVFP4 model: a
    ModelOpt W4A16_NVFP4 export (no input_scale) written back, or a compressed-tensors NVFP4 one (whose
    input_global_scale is not ModelOpt's input_scale) written as ModelOpt's, ran in vLLM on garbage activation
    scales. Now the folder says W4A16_NVFP4 unless every NVFP4 layer has its input_scale, and reads back the same."""
    from dorafp8 import save_fp8_checkpoint

    lib, algo = writer.split("-", 1) if writer.startswith("modelopt") else writer.rsplit("-", 1)
    src = (write_modelopt(original_model(), str(tmp_path / "src"), algo) if lib == "modelopt" else
           write_compressed_tensors_nvfp4(original_model(), str(tmp_path / "src"), algo))
    model = meta_model()
    load_fp8_checkpoint(model, src, verbose=False)
    out = str(tmp_path / "out")
    save_fp8_checkpoint(model, out, format="modelopt", verbose=False)
    with open(os.path.join(out, "hf_quant_config.json")) as f:
        want = "NVFP4" if writer == "modelopt-NVFP4" else "W4A16_NVFP4"
        assert json.load(f)["quantization"]["quant_algo"] == want
    file = read_all(out)
    packed = [k[:-len(".weight_scale_2")] for k in file if k.endswith(".weight_scale_2")]
    assert len(packed) == 14 and all((f"{lay}.input_scale" in file) == (want == "NVFP4") for lay in packed)
    fresh = meta_model()
    assert load_fp8_checkpoint(fresh, out, verbose=False).format == "modelopt"
    for name, m in _linears(model).items():
        got = _linears(fresh)[name]
        assert torch.equal(got.weight, m.weight) and torch.equal(got.scale.view(torch.uint8), m.scale.view(
            torch.uint8)) and torch.equal(got.global_scale, m.global_scale), name


@pytest.mark.parametrize("name", ["config.json", "hf_quant_config.json"])
def test_a_modelopt_export_with_a_changed_json_beside_it_is_refused(tmp_path, name):
    """The index of a ModelOpt-layout export records the sha256 of config.json and of hf_quant_config.json (whose
    quant_algo says how the weights read): one changed after the export (another export's, half published; or
    edited) is refused naming it, as a reader must not pair it with these weights; the export as written loads, and
    so does one edited on purpose once the record the message names is deleted from the index."""
    import json

    from dorafp8 import export_merged

    pytest.importorskip("peft")
    model = meta_model()
    load_fp8_checkpoint(model, write_modelopt(original_model(), str(tmp_path / "mo"), "NVFP4"), verbose=False)
    out = tmp_path / "merged"
    export_merged(_dora_on(model), str(out), verbose=False)
    load_fp8_checkpoint(meta_model(), str(out), verbose=False)
    path = out / name
    obj = json.loads(path.read_text())
    path.write_text(json.dumps({**obj, "edited": True}))
    key = f"dorafp8_{name[:-5]}_sha256"
    with pytest.raises(CheckpointFormatError, match=rf"{re.escape(str(path))}: not the file exported with the "
                                                    rf"weights beside it.*or it was edited after the export \(to "
                                                    rf"accept it, delete '{key}' from the \"metadata\" of the index"):
        load_fp8_checkpoint(meta_model(), str(out), verbose=False)
    index = out / "model.safetensors.index.json"  # the user's edit accepted, as the message says
    obj = json.loads(index.read_text())
    del obj["metadata"][key]
    index.write_text(json.dumps(obj))
    assert load_fp8_checkpoint(meta_model(), str(out), verbose=False).format == "modelopt"


def test_a_damaged_modelopt_export_is_refused(tmp_path):
    """An export_merged NVFP4 file with its merged layer's global scale made inf, or a block scale cut, is refused by
    the loader naming the tensor, as a ModelOpt file damaged the same way is."""
    from safetensors.torch import save_file

    from dorafp8 import export_merged

    pytest.importorskip("peft")
    src = write_modelopt(original_model(), str(tmp_path / "mo"), "NVFP4")
    model = meta_model()
    load_fp8_checkpoint(model, src, verbose=False)
    out = str(tmp_path / "merged.safetensors")
    export_merged(_dora_on(model), out, verbose=False)
    layer = "model.layers.0.self_attn.q_proj"
    for key, bad, match in ((f"{layer}.weight_scale_2", lambda t: torch.tensor(float("inf")),
                             rf"{layer}\.weight_scale_2: NVFP4 global scale inf is not a finite positive number"),
                            (f"{layer}.weight_scale", lambda t: t[:, :1].contiguous(),
                             rf"{layer}\.weight_scale: shape \[\d+, 1\], but the .* nvfp4 weight")):
        sd = read_all(out)
        sd[key] = bad(sd[key])
        damaged = str(tmp_path / "damaged.safetensors")
        save_file(sd, damaged)
        with pytest.raises(CheckpointFormatError, match=match):
            load_fp8_checkpoint(meta_model(), damaged, verbose=False)


@pytest.mark.parametrize("algo", ["NVFP4", "MXFP8"])
def test_modelopt_fp8_kv_cache_scales_load_and_are_written_back(tmp_path, algo):
    """ModelOpt exports with kv_cache_quant_algo "FP8" (NVIDIA's published NVFP4 models among them) carry
    `<k_proj>.k_scale` and `<v_proj>.v_scale`: they load by default, kept as extras and named in the report, and
    save_fp8_checkpoint writes them back as they were. They made the whole load fail ("fit nothing in the model").
    The written hf_quant_config.json said kv_cache_quant_algo null, so vLLM ran the export's KV cache in bf16 (twice
    the memory) beside the kept scales; it now says the source's FP8."""
    import json

    from safetensors.torch import save_file

    from dorafp8 import save_fp8_checkpoint

    src = write_modelopt(original_model(), str(tmp_path / "mo"), algo)
    kv = {f"model.layers.{i}.self_attn.{p}_proj.{p}_scale": torch.tensor(0.01 * (i + 1)) for i in range(2)
          for p in "kv"}
    save_file({**read_all(src), **kv}, os.path.join(src, "model.safetensors"))  # the fixture writes one file
    with open(os.path.join(src, "hf_quant_config.json")) as f:
        hq = json.load(f)
    assert hq["quantization"]["quant_algo"] == algo
    hq["quantization"]["kv_cache_quant_algo"] = "FP8"
    with open(os.path.join(src, "hf_quant_config.json"), "w") as f:
        json.dump(hq, f)
    model = meta_model()
    report = load_fp8_checkpoint(model, src, verbose=False)
    assert {k for k in report.kept if k in kv} == set(kv)
    save_fp8_checkpoint(model, str(tmp_path / "out"), format="modelopt", verbose=False)
    back = read_all(str(tmp_path / "out"))
    assert all(torch.equal(back[k], v) for k, v in kv.items())
    with open(os.path.join(str(tmp_path / "out"), "hf_quant_config.json")) as f:
        assert json.load(f)["quantization"]["kv_cache_quant_algo"] == "FP8"


def test_modelopt_kv_cache_algo_survives_a_single_file(tmp_path):
    """A single-file modelopt export (no hf_quant_config.json) kept k_scale / v_scale but not the source's
    kv_cache_quant_algo: a folder export from it then said null, and vLLM ran the KV cache in bf16 beside the kept
    scales. The single file's metadata records it now, read back where no hf_quant_config.json says."""
    import json

    from safetensors.torch import save_file

    from dorafp8 import save_fp8_checkpoint

    src = write_modelopt(original_model(), str(tmp_path / "mo"), "NVFP4")
    kv = {f"model.layers.{i}.self_attn.{p}_proj.{p}_scale": torch.tensor(0.01 * (i + 1)) for i in range(2)
          for p in "kv"}
    save_file({**read_all(src), **kv}, os.path.join(src, "model.safetensors"))
    with open(os.path.join(src, "hf_quant_config.json")) as f:
        hq = json.load(f)
    hq["quantization"]["kv_cache_quant_algo"] = "FP8"
    with open(os.path.join(src, "hf_quant_config.json"), "w") as f:
        json.dump(hq, f)
    model = meta_model()
    load_fp8_checkpoint(model, src, verbose=False)
    single = str(tmp_path / "one.safetensors")
    save_fp8_checkpoint(model, single, format="modelopt", verbose=False)
    model = meta_model()
    load_fp8_checkpoint(model, single, verbose=False)
    save_fp8_checkpoint(model, str(tmp_path / "out"), format="modelopt", verbose=False)
    back = read_all(str(tmp_path / "out"))
    assert all(torch.equal(back[k], v) for k, v in kv.items())
    with open(os.path.join(str(tmp_path / "out"), "hf_quant_config.json")) as f:
        assert json.load(f)["quantization"]["kv_cache_quant_algo"] == "FP8"


@pytest.mark.parametrize("preset", ["NVFP4A16", "MXFP8A16"])
def test_from_pretrained_then_from_transformers_fp8(tmp_path, preset):
    """transformers' from_pretrained of a compressed-tensors NVFP4 or MXFP8 checkpoint leaves its modules compressed
    on CPU (weight_packed, weight_scale, weight_global_scale; weight and uint8 e8m0 weight_scale); from_transformers_fp8
    swaps them for NVFP4 / MXFP8 FP8Linear layers holding those bytes, and the model computes what the dense twin on
    the format's dequantization computes. (MXFP8 was refused by the per-tensor / row / block scale check, naming
    neither the format nor a way out.)"""
    pytest.importorskip("compressed_tensors")
    import transformers

    from dorafp8 import from_transformers_fp8

    path = write_compressed_tensors_nvfp4(original_model(), str(tmp_path / "ct"), preset=preset)
    packed_suffix, kind = ("weight_packed", "nvfp4") if preset == "NVFP4A16" else ("weight", "mxfp8")
    file = read_all(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    assert from_transformers_fp8(model) == 14
    for name, mod in _linears(model).items():
        assert isinstance(mod, FP8Linear) and quant.scale_kind(mod.scale) == kind
        assert torch.equal(mod.weight.view(torch.uint8), file[f"{name}.{packed_suffix}"].view(torch.uint8))
        assert torch.equal(mod.scale.view(torch.uint8), file[f"{name}.weight_scale"].view(torch.uint8))
    twin = _dense_twin(file, packed_suffix, reciprocal=True).eval()
    with torch.no_grad():
        assert_close(model(input_ids=IDS).logits, twin(input_ids=IDS).logits, tol(torch.float32), "logits")


def test_modelopt_fp8_export_still_loads_as_before(tmp_path):
    """A ModelOpt FP8 export (e4m3 `weight`, fp32 `weight_scale`, quant_algo FP8 in hf_quant_config.json) is not one
    of the microscaled layouts: it still reads as compressed-tensors' per-tensor fp8, as before."""
    from dorafp8.checkpoint import detect_format
    from tests.checkpoint._ckpt_fixtures import write_modelopt_fp8

    path = str(tmp_path / "fp8")
    write_modelopt_fp8(path)
    assert detect_format(path)[0] == "compressed-tensors"
    target = meta_model()
    load_fp8_checkpoint(target, path, verbose=False)
    assert all(quant.scale_kind(m.scale) == "tensor" for m in _linears(target).values())


_RUN_SCRIPT = """
import json, sys, torch, transformers
from peft import LoraConfig, get_peft_model
from dorafp8 import DoRAFP8Linear, FP8Linear, quant
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])
layers = [m for m in model.modules() if isinstance(m, FP8Linear)]
ids = torch.tensor(json.loads(sys.argv[3]))
with torch.no_grad():
    torch.save(model(input_ids=ids).logits, sys.argv[2] + ".pt")
peft_model = get_peft_model(model, LoraConfig(r=4, use_dora=True, target_modules=["q_proj", "down_proj"]))
peft_model(input_ids=ids).logits.sum().backward()
dora = [m for m in peft_model.modules() if isinstance(m, DoRAFP8Linear)]
json.dump({"layers": len(layers), "kinds": sorted({quant.scale_kind(m.scale) for m in layers}), "dora": len(dora),
           "grads": all(m.lora_A["default"].weight.grad is not None for m in dora)}, open(sys.argv[2], "w"))
"""


@pytest.mark.parametrize("writer", ["compressed-tensors", "compressed-tensors-mxfp8", "modelopt-nvfp4",
                                    "modelopt-mxfp8"])
def test_dorafp8_run_loads_them_through_from_pretrained(tmp_path, writer):
    """`dorafp8 run -- <script>` whose script calls transformers' AutoModelForCausalLM.from_pretrained(path) alone: a
    compressed-tensors NVFP4 checkpoint gets its layers held by dorafp8's (from_transformers_fp8), a ModelOpt NVFP4 or
    MXFP8 export (which transformers cannot load) is loaded by load_fp8_checkpoint; the model computes what the
    dense twin on the format's dequantization computes, and PEFT's DoRA on it is dorafp8's and trains."""
    import json
    import subprocess
    import sys

    pytest.importorskip("peft")
    if writer.startswith("compressed-tensors"):
        pytest.importorskip("compressed_tensors")
        mx = writer.endswith("mxfp8")
        path = write_compressed_tensors_nvfp4(original_model(), str(tmp_path / "ct"), "MXFP8A16" if mx else "NVFP4A16")
        packed_suffix, reciprocal = "weight" if mx else "weight_packed", True
    else:
        algo = writer.split("-")[1].upper()
        path, packed_suffix, reciprocal = write_modelopt(original_model(), str(tmp_path / "mo"), algo), "weight", False
    script, out = tmp_path / "train.py", tmp_path / "out.json"
    script.write_text(_RUN_SCRIPT)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "dorafp8", "run", "--", str(script), path, str(out),
                           json.dumps(IDS.tolist())], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "14 layers of its" in proc.stderr and "held by dorafp8" in proc.stderr, proc.stderr[-2000:]
    got = json.loads(out.read_text())
    kind = "mxfp8" if writer.endswith("mxfp8") else "nvfp4"
    assert got == {"layers": 14, "kinds": [kind], "dora": 4, "grads": True}
    twin = _dense_twin(read_all(path), packed_suffix, reciprocal=reciprocal).eval()
    with torch.no_grad():
        assert_close(torch.load(str(out) + ".pt"), twin(input_ids=IDS).logits, tol(torch.float32), "logits")


@pytest.mark.parametrize("algo", ["NVFP4", "W4A16_NVFP4", "MXFP8"])
def test_a_stale_hf_quant_config_json_is_named_by_the_writer_and_the_loader(tmp_path, algo):
    """A ModelOpt export re-exported into its folder in another format: its hf_quant_config.json (recorded in its
    index) goes with it, as its shards do; the re-export was refused naming it, though the writer had written it. One
    the index does not record (planted, copied in) is refused by the writer before anything is written, naming it
    (not removed), and by the loader instead of reading the folder as ModelOpt's: the writer used to publish beside
    it, and the loader then said that config.json's compressed-tensors contradicts ModelOpt's quant_algo (and for a
    W4A16_NVFP4 one, which dorafp8 writes for NVFP4 layers without input_scale, read the fp8 weights as ModelOpt's)."""
    import json
    import shutil

    from dorafp8 import quantize_model, save_fp8_checkpoint

    model = meta_model()
    load_fp8_checkpoint(model, write_modelopt(original_model(), str(tmp_path / "mo"), algo), verbose=False)
    out = tmp_path / "out"
    fp8 = quantize_model(original_model(), per_row_scale=True, verbose=False)
    for m, fmt in ((fp8, "compressed-tensors"), (fp8, "fine-grained"), (model, "bf16")):
        save_fp8_checkpoint(model, str(out), verbose=False)
        assert (out / "hf_quant_config.json").exists()
        save_fp8_checkpoint(m, str(out), format=fmt, verbose=False)
        assert not (out / "hf_quant_config.json").exists()
        if fmt != "bf16":  # dense: no fp8 checkpoint to load
            assert load_fp8_checkpoint(meta_model(), str(out), verbose=False).format == fmt
    save_fp8_checkpoint(model, str(out), verbose=False)
    assert load_fp8_checkpoint(meta_model(), str(out), verbose=False).format == "modelopt"
    ct = tmp_path / "ct"
    save_fp8_checkpoint(fp8, str(ct), format="compressed-tensors", verbose=False)
    load_fp8_checkpoint(meta_model(), str(ct), verbose=False)
    shutil.copy(out / "hf_quant_config.json", ct / "hf_quant_config.json")
    assert json.loads((ct / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == algo
    before = {p.name: p.read_bytes() for p in ct.iterdir()}
    for m, fmt in ((fp8, "compressed-tensors"), (model, "bf16")):
        with pytest.raises(FileExistsError, match=rf"holds 'hf_quant_config.json' .*this {fmt} export would load as "
                                                  rf"ModelOpt's.*move it away \(or delete it\)"):
            save_fp8_checkpoint(m, str(ct), format=fmt, verbose=False)
        assert {p.name: p.read_bytes() for p in ct.iterdir()} == before  # nothing written, nothing removed
    with pytest.raises(CheckpointFormatError, match=rf"{re.escape(str(ct / 'hf_quant_config.json'))}: says "
                                                    rf"quant_algo '{algo}', but no weight .* is {algo} .*config.json "
                                                    rf"says quant_method='compressed-tensors'.*move it away"):
        load_fp8_checkpoint(meta_model(), str(ct), verbose=False)


@pytest.mark.filterwarnings("ignore")  # the killed writers' stages, named
def test_a_modelopt_export_replaced_in_another_format_killed_at_every_step(tmp_path):
    """The bf16 re-export of a ModelOpt export, killed at each rename or removal in turn: hf_quant_config.json is
    never left beside an index that does not record it (which every later export refused, naming it), and the
    re-run completes."""
    import json

    from dorafp8 import save_fp8_checkpoint
    from tests.checkpoint.test_export_folders import _killed_at_every_step

    model = meta_model()
    load_fp8_checkpoint(model, write_modelopt(original_model(), str(tmp_path / "mo"), "NVFP4"), verbose=False)
    pristine = tmp_path / "pristine"
    save_fp8_checkpoint(model, str(pristine), verbose=False)
    bf16 = lambda work: save_fp8_checkpoint(model, str(work), format="bf16", verbose=False)  # noqa: E731
    for step, work, _ in _killed_at_every_step(pristine, bf16):
        meta = json.loads((work / "model.safetensors.index.json").read_text())["metadata"]
        assert not (work / "hf_quant_config.json").exists() or "dorafp8_hf_quant_config_sha256" in meta, step
        bf16(work)
        assert not (work / "hf_quant_config.json").exists()



@pytest.mark.parametrize("first,killed", [("modelopt", "bf16"), ("bf16", "modelopt")])
def test_an_export_killed_at_every_step_then_rerun_in_the_first_format(tmp_path, first, killed):
    """A folder exported in one format, re-exported in the other (ModelOpt's with its hf_quant_config.json, or
    bf16), killed at each rename or removal in turn, then exported in the first format again. Killed after it moved
    config.json or hf_quant_config.json in and before its commit, the killed export left a file the index there does
    not record, and every later export in the first format was refused naming it. Here the killed export's staging
    folder (the index it was about to commit) vouches for them: the re-run completes, hf_quant_config.json is there
    exactly when the folder is ModelOpt's, and no shard outside its index is left."""
    import json
    import shutil
    import warnings

    from dorafp8 import save_fp8_checkpoint
    from tests.checkpoint.test_export_folders import _in_child

    model = meta_model()
    load_fp8_checkpoint(model, write_modelopt(original_model(), str(tmp_path / "mo"), "NVFP4"), verbose=False)
    pristine = tmp_path / "pristine"
    save_fp8_checkpoint(model, str(pristine), format=first, verbose=False)
    step = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the killed writers' stages, named
        while True:
            step += 1
            work = tmp_path / f"k{step}"
            shutil.copytree(pristine, work)
            code, said = _in_child(lambda: save_fp8_checkpoint(model, str(work), format=killed, verbose=False),
                                   kill_at=step)
            assert code in (0, 9), said
            save_fp8_checkpoint(model, str(work), format=first, verbose=False)
            assert (work / "hf_quant_config.json").exists() == (first == "modelopt"), f"killed at step {step}"
            index = json.loads((work / "model.safetensors.index.json").read_text())
            visible = {n for n in os.listdir(work) if n[0] != "."}
            assert visible == {"model.safetensors.index.json", "config.json", *index["weight_map"].values()} | (
                {"hf_quant_config.json"} if first == "modelopt" else set()), f"killed at step {step}"
            if first == "modelopt":
                assert load_fp8_checkpoint(meta_model(), str(work), verbose=False).format == "modelopt"
            if code == 0:
                break
    assert step > 3


# ---- ComfyUI's own NVFP4 / MXFP8 (comfy_kitchen) ----------------------------------------------------------------------


def _cublas_blocked(scale: torch.Tensor) -> torch.Tensor:
    """A [rows, cols] block-scale matrix in cuBLAS's 1D block-scaling layout, as comfy_kitchen stores it (to_blocked,
    flatten=False): padded to [ceil(rows / 128) * 128, ceil(cols / 4) * 4] with zeros, each 128 x 4 tile laid out as
    4 groups of 32 rows interleaved (element (32 * i + r, c) of a tile at r * 16 + i * 4 + c), tiles row-major."""
    rows, cols = scale.shape
    R, C = -(-rows // 128) * 128, -(-cols // 4) * 4
    u8 = torch.zeros(R, C, dtype=torch.uint8)
    u8[:rows, :cols] = scale.view(torch.uint8)
    tiles = u8.reshape(R // 128, 128, C // 4, 4).permute(0, 2, 1, 3)  # [row tile, col tile, 128, 4]
    tiles = tiles.reshape(R // 128, C // 4, 4, 32, 4).permute(0, 1, 3, 2, 4)  # [.., r, i, c]
    return tiles.reshape(R, C).view(scale.dtype)


def _comfy_microscaled(kind: str, N: int = 128, K: int = 128) -> tuple[nn.Module, dict, dict]:
    """(a one-layer model, its state dict as ComfyUI's comfy_kitchen layouts write it, the ModelOpt twin). NVFP4: the
    e2m1 codes high nibble first (comfy_kitchen's hi_first packing), the e4m3 block scales in cuBLAS's blocked order,
    weight_scale_2 fp32; MXFP8: e4m3 weights, e8m0 block scales in the blocked order. N = 128, K = 128: the
    blocked scale has the row-major scale's shape, as for most layers of a real model (N, K multiples of 128)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(K, N, bias=False))
    with torch.no_grad():  # block ranges that differ by row and by block of columns, so that their order shows
        model[0].weight.mul_(2.0 ** (torch.arange(N)[:, None] % 5) * 2.0 ** (torch.arange(K)[None] // 32 % 3))
    W = model[0].weight.detach()
    if kind == "nvfp4":
        packed, scale, g = quant.quantize_nvfp4(W)
        hi_first = (packed << 4) | (packed >> 4)  # the same codes, the even column in the high nibble
        comfy = {"0.weight": hi_first, "0.weight_scale": _cublas_blocked(scale), "0.weight_scale_2": g}
        twin = {"0.weight": packed, "0.weight_scale": scale, "0.weight_scale_2": g}
    else:
        w8, e = quant.quantize_mxfp8(W)
        comfy = {"0.weight": w8, "0.weight_scale": _cublas_blocked(e.view(torch.uint8))}
        twin = {"0.weight": w8, "0.weight_scale": e.view(torch.uint8)}
    assert comfy["0.weight_scale"].shape == twin["0.weight_scale"].shape  # the shapes alone do not tell them apart
    assert not torch.equal(comfy["0.weight_scale"].view(torch.uint8), twin["0.weight_scale"].view(torch.uint8))
    return model, comfy, twin


@pytest.mark.parametrize("kind", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("marker", ["comfy_quant", "_quantization_metadata"])
@pytest.mark.parametrize("fmt", ["auto", "modelopt"])
def test_comfyui_nvfp4_and_mxfp8_files_are_refused_naming_the_layout(tmp_path, kind, marker, fmt):
    """ComfyUI's NVFP4 / MXFP8 files (comfy_kitchen's TensorCoreNVFP4Layout / TensorCoreMXFP8Layout, marked per layer
    by `<layer>.comfy_quant` or in the safetensors metadata's `_quantization_metadata`, as Comfy-Org's *_nvfp4 /
    *_mxfp8 files are) keep ModelOpt's names and shapes but not its byte order: swizzled block scales, NVFP4's codes
    high nibble first. format="modelopt" (what the "several layouts" refusal asked for) loaded an NVFP4 one without an
    error, as did strict=False with its comfy_quant entries, each layer computing wrong values; now any format= is
    refused naming the layout, before the model changes."""
    from safetensors.torch import save_file

    model, comfy, _ = _comfy_microscaled(kind)
    conf = {"format": kind}
    metadata = {"format": "pt"}
    if marker == "comfy_quant":
        comfy["0.comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
    else:
        metadata["_quantization_metadata"] = json.dumps({"format_version": "1.0", "layers": {"0": conf}})
    path = str(tmp_path / f"comfy_{kind}.safetensors")
    save_file(comfy, path, metadata=metadata)
    before = model[0].weight.detach().clone()
    layout = {"nvfp4": "TensorCoreNVFP4Layout", "mxfp8": "TensorCoreMXFP8Layout"}[kind]
    with pytest.raises(CheckpointFormatError, match=rf"ComfyUI {kind} layers \(comfy_kitchen's {layout}.*swizzled"):
        load_fp8_checkpoint(model, path, format=fmt, strict=False, verbose=False)
    assert type(model[0]) is nn.Linear and torch.equal(model[0].weight, before)


def test_the_modelopt_twin_of_a_comfyui_nvfp4_layer_still_loads():
    """The refusal above is ComfyUI's marker, not NVFP4: the same layer in ModelOpt's order loads, and its comfy_kitchen
    file differs from it only in byte order (so reading that file as ModelOpt's would be wrong)."""
    model, comfy, twin = _comfy_microscaled("nvfp4")
    load_fp8_checkpoint(model, twin, verbose=False)
    assert torch.equal(model[0].weight.view(torch.uint8), twin["0.weight"])
    assert not torch.equal(comfy["0.weight"], twin["0.weight"])


@pytest.mark.parametrize("algo", ["NVFP4", "MXFP8"])
def test_save_pretrained_of_a_microscaled_model_names_save_fp8_checkpoint(tmp_path, algo):
    """transformers' save_pretrained of a model on NVFP4 / MXFP8 layers (which dorafp8 writes in ModelOpt's layout, not
    in one from_pretrained reads) was refused by the fine-grained writer's check: "format='fine-grained' cannot hold"
    them, a format the caller never named, without naming the call that writes them. The refusal now names
    save_pretrained, the layers, and save_fp8_checkpoint / export_merged with format='modelopt' or a dense one;
    nothing is written."""
    model = meta_model()
    load_fp8_checkpoint(model, write_modelopt(original_model(), str(tmp_path / "mo"), algo), verbose=False)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=rf"LlamaForCausalLM\.save_pretrained: the model holds 14 {algo} layers .*"
                                         r"dorafp8\.save_fp8_checkpoint\(model, path, format='modelopt'\).*'bf16'"):
        model.save_pretrained(out)
    assert not (out.exists() and any(out.iterdir()))


def test_a_kv_cache_algo_whose_scales_were_dropped_is_not_written_back(tmp_path):
    """ModelOpt's NVFP4 MLP-only recipe with an FP8 KV cache (hf_ptq's default kv_cache_qformat) leaves k_proj / v_proj
    dense but exports their calibrated `k_proj.k_scale` / `v_proj.v_scale`; dorafp8 keeps KV-cache scales of fp8
    layers only, so these fit nothing, and strict=False drops them. The export still said kv_cache_quant_algo FP8
    (kept from the source) with no k_scale / v_scale in it: vLLM then runs an fp8 KV cache with scale 1.0 where the
    source had calibrated ones, silently. Now the algo is written back only where every KV-cache scale was kept."""
    import json

    from safetensors.torch import save_file

    from dorafp8 import save_fp8_checkpoint

    src = write_modelopt(original_model(), str(tmp_path / "mo"), "NVFP4")
    sd, dense = read_all(src), original_model().state_dict()
    for i in range(2):
        for p in "kv":
            lay = f"model.layers.{i}.self_attn.{p}_proj"
            for s in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
                del sd[f"{lay}.{s}"]
            sd.update({f"{lay}.weight": dense[f"{lay}.weight"], f"{lay}.{p}_scale": torch.tensor(0.02)})
    save_file(sd, os.path.join(src, "model.safetensors"))
    with open(os.path.join(src, "hf_quant_config.json")) as f:
        hq = json.load(f)
    hq["quantization"].update(kv_cache_quant_algo="FP8", exclude_modules=["lm_head", "*k_proj", "*v_proj"])
    with open(os.path.join(src, "hf_quant_config.json"), "w") as f:
        json.dump(hq, f)
    model = meta_model()
    report = load_fp8_checkpoint(model, src, verbose=False, strict=False)
    assert sorted(report.unexpected) == sorted(k for k in sd if k.endswith(("k_scale", "v_scale")))
    out = str(tmp_path / "out")
    save_fp8_checkpoint(model, out, format="modelopt", verbose=False)
    assert not [k for k in read_all(out) if k.endswith(("k_scale", "v_scale"))]
    with open(os.path.join(out, "hf_quant_config.json")) as f:
        assert json.load(f)["quantization"]["kv_cache_quant_algo"] is None
