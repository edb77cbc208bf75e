"""musubi-tuner / kohya `--fp8_scaled` state dicts and ComfyUI's plain fp8 casts, loaded with load_fp8_checkpoint.

musubi-tuner is not on PyPI: its writer is re-implemented here line for line from its source
(kohya-ss/musubi-tuner, commit 30c658c, src/musubi_tuner/modules/fp8_optimization_utils.py: quantize_fp8,
quantize_weight, optimize_state_dict_with_fp8; kohya-ss/sd-scripts library/fp8_optimization_utils.py is the same
code). What it writes, per targeted `<layer>.weight`:
  - the weight as float8_e4m3fn under its own key;
  - `<layer>.scale_weight` in the weight's original dtype: [out, in / 64, 1] in "block" mode (the default,
    block_size 64), [out, 1] in "channel" mode and where 64 does not divide in_features (block mode falls back to it),
    a 0-dim tensor in "tensor" mode and for weights that are not 2-D ([1] in versions before its block mode);
  - scale = amax / 448 over what it covers, clamped to >= 1e-8, computed in fp32; weight = (w / scale), NaN -> 0,
    clamped to +-448, cast to e4m3.
No `scaled_fp8` marker (that is ComfyUI's). musubi's forward (fp8_linear_forward_patch) computes with
weight.to(scale.dtype) * scale, the scale broadcast over its block, in the scale's dtype: a bf16 file's product is
rounded to bf16 there (musubi_forward_weight). dorafp8 holds the exact product (file_values) in fp32.
"""

import os
import warnings

import pytest
import torch
from torch import nn

import dorafp8
from dorafp8.checkpoint.layouts import CheckpointFormatError
from dorafp8.quant import QuantizationWarning
from tests._tolerance import tol, within

safetensors = pytest.importorskip("safetensors.torch")

E4M3 = torch.float8_e4m3fn


# ---- musubi's writer (see the module docstring) ------------------------------------------------------------------


def _quantize_fp8(tensor, scale, fp8_dtype, max_value, min_value):
    tensor = tensor.to(torch.float32)
    tensor = torch.div(tensor, scale).nan_to_num_(0.0)
    tensor = tensor.clamp_(min=min_value, max=max_value)
    return tensor.to(fp8_dtype)


def _quantize_weight(tensor, fp8_dtype, max_value, min_value, quantization_mode="block", block_size=64):
    original_shape = tensor.shape
    if quantization_mode == "block":
        if tensor.ndim != 2:
            quantization_mode = "tensor"
        else:
            out_features, in_features = tensor.shape
            if in_features % block_size != 0:
                quantization_mode = "channel"
            else:
                tensor = tensor.contiguous().view(out_features, in_features // block_size, block_size)
    elif quantization_mode == "channel" and tensor.ndim != 2:
        quantization_mode = "tensor"
    if quantization_mode in ("channel", "block"):
        scale_dim = 1 if quantization_mode == "channel" else 2
        scale = torch.max(torch.abs(tensor), dim=scale_dim, keepdim=True).values / max_value
    else:
        scale = torch.max(torch.abs(tensor).view(-1)) / max_value
    scale = torch.clamp(scale, min=1e-8).to(torch.float32)
    quantized = _quantize_fp8(tensor, scale, fp8_dtype, max_value, min_value)
    if quantization_mode == "block":
        quantized = quantized.view(original_shape)
    return quantized, scale


def optimize_state_dict_with_fp8(state_dict, target_layer_keys=None, exclude_layer_keys=None, exp_bits=4,
                                 quantization_mode="block", block_size=64):
    fp8_dtype = torch.float8_e4m3fn if exp_bits == 4 else torch.float8_e5m2
    max_value = torch.finfo(fp8_dtype).max
    for key in [k for k in state_dict if (target_layer_keys is None or any(p in k for p in target_layer_keys))
                and k.endswith(".weight") and not (exclude_layer_keys and any(p in k for p in exclude_layer_keys))]:
        value = state_dict[key]
        q, scale = _quantize_weight(value, fp8_dtype, max_value, -max_value, quantization_mode, block_size)
        state_dict[key] = q
        state_dict[key.replace(".weight", ".scale_weight")] = scale.to(dtype=value.dtype)
    return state_dict


def musubi_dequantized(w8, scale):
    """The file's values: e4m3 times its bf16/fp32 scale, exact in fp64. Not musubi's forward weight, which rounds
    this product to the scale's dtype (musubi_forward_weight)."""
    w = w8.double()
    if scale.dim() < 3:
        return w * scale.double()
    n, blocks, _ = scale.shape
    return (w.view(n, blocks, -1) * scale.double()).view(w8.shape)


def musubi_forward_weight(w8, scale):
    """fp8_linear_forward_patch's dequantized weight (musubi 30c658c, use_scaled_mm False), line for line."""
    if scale.ndim < 3:
        return w8.to(scale.dtype) * scale
    out_features, num_blocks, _ = scale.shape
    return (w8.to(scale.dtype).contiguous().view(out_features, num_blocks, -1) * scale).view(w8.shape)


# ---- a small DiT-like model ----------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(128)
        self.qkv = nn.Linear(128, 192)     # 2 blocks of 64 per row
        self.proj = nn.Linear(64, 128)     # 1 block per row: per row, exactly
        self.ff = nn.Linear(128, 96)
        self.out = nn.Linear(96, 128)      # 96 % 64: musubi falls back to per channel


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, 128)
        self.blocks = nn.ModuleList([Block(), Block()])


def _original(dtype=torch.bfloat16):
    torch.manual_seed(0)
    m = Tiny()
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, nn.Linear):
                mod.weight[:, :32] *= 6  # input columns of different magnitudes: the 64-blocks of a row differ
        m.blocks[0].qkv.weight[3] = 0  # an all-zero row (musubi: scale 1e-8, bytes 0)
    return m.to(dtype)


def write_musubi(path, mode="block", dtype=torch.bfloat16):
    sd = {k: v.detach().clone() for k, v in _original(dtype).state_dict().items()}
    sd = optimize_state_dict_with_fp8(sd, ["blocks"], ["norm"], quantization_mode=mode)
    safetensors.save_file(sd, path)
    return sd


def _meta_model():
    with torch.device("meta"):
        return Tiny().to(torch.bfloat16)


def _load(path, **kw):
    model = _meta_model()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        report = dorafp8.load_fp8_checkpoint(model, path, verbose=False, **kw)
    return model, report, [w for w in rec if issubclass(w.category, QuantizationWarning)]


BLOCKED = ["blocks.0.qkv", "blocks.0.ff", "blocks.1.qkv", "blocks.1.ff"]  # 1 x 64 blocks with 2 blocks a row
EXACT = ["blocks.0.proj", "blocks.1.proj", "blocks.0.out", "blocks.1.out"]  # one block a row; per channel


def test_detect_format(tmp_path):
    for mode in ("block", "channel", "tensor"):
        p = str(tmp_path / f"{mode}.safetensors")
        write_musubi(p, mode)
        fmt, evidence = dorafp8.detect_format(p)
        assert fmt == "musubi" and "scale_weight" in evidence, (mode, fmt, evidence)
    # fp32 per-tensor scales without ComfyUI's marker: read as ComfyUI's layout (the same values either way)
    p = str(tmp_path / "fp32.safetensors")
    write_musubi(p, "tensor", torch.float32)
    assert dorafp8.detect_format(p)[0] == "comfyui"
    model, report, _ = _load(p, format="musubi")
    assert report.format == "musubi" and isinstance(model.blocks[0].qkv, dorafp8.FP8Linear)


def test_loads_musubi_bytes_and_scales(tmp_path):
    p = str(tmp_path / "m.safetensors")
    sd = write_musubi(p)
    model, report, warned = _load(p, backend="reference")
    for name in EXACT:  # the file's own bytes and scales
        layer = model.get_submodule(name)
        assert torch.equal(layer.weight.view(torch.uint8), sd[name + ".weight"].view(torch.uint8)), name
        assert torch.equal(layer.scale, sd[name + ".scale_weight"].float().reshape(-1)), name
        assert torch.equal(layer.dequantize().double(), musubi_dequantized(sd[name + ".weight"],
                                                                           sd[name + ".scale_weight"]))
    errors = {}
    for name in BLOCKED:  # re-quantized to one scale per row
        layer = model.get_submodule(name)
        assert layer.scale.shape == (layer.out_features,), name
        w0 = musubi_dequantized(sd[name + ".weight"], sd[name + ".scale_weight"])
        got = layer.dequantize().double()
        s_row = layer.scale.double()[:, None]
        step = torch.where(w0.abs() >= 2 ** -6 * s_row, w0.abs() * 2 ** -4, s_row * 2 ** -10)
        assert bool(((got - w0).abs() <= step * (1 + 1e-9)).all()), name  # one rounding to nearest
        errors[name] = ((got - w0).norm() / w0.norm()).item()
        assert report.fp8_layers[name] == f"per-row (re-quantized from 1x64 blocks: {100 * errors[name]:.2f}%)"
    assert all(0 < e < 2 ** -4 for e in errors.values()), errors
    assert len(warned) == 1, [str(w.message) for w in warned]
    msg = str(warned[0].message)
    worst = max(errors, key=errors.get)
    assert f"{len(BLOCKED) + 2} layers of {p} with 1 x 64 block scales" in msg, msg  # + proj: 1 block a row
    assert f"worst {100 * errors[worst]:.2f}% ({worst!r})" in msg, msg
    zero = model.blocks[0].qkv  # the all-zero row stays zero
    assert (zero.dequantize()[3] == 0).all()
    # the rest of the model: LayerNorms, biases and the untargeted embed, in bf16 as in the file
    assert torch.equal(model.blocks[1].norm.weight, sd["blocks.1.norm.weight"])
    assert type(model.embed) is nn.Linear and torch.equal(model.embed.weight, sd["embed.weight"])


def test_kept_layers_hold_the_exact_product_that_musubi_rounds_to_bf16(tmp_path):
    """musubi computes a bf16 file's layer with e4m3 * scale rounded to bf16 (its fp8_linear_forward_patch); dorafp8
    holds that product exactly (fp32), and in bf16 it is musubi's weight bit for bit. The two differ by at most half
    a bf16 step per element: what "load exactly" means for a musubi file is the file's values, not musubi's."""
    p = str(tmp_path / "m.safetensors")
    sd = write_musubi(p)
    model, _, _ = _load(p, backend="reference")
    for name in EXACT:
        w8, s = sd[name + ".weight"], sd[name + ".scale_weight"]
        theirs, exact = musubi_forward_weight(w8, s), musubi_dequantized(w8, s)
        assert theirs.dtype == torch.bfloat16 and not torch.equal(theirs.double(), exact), name  # musubi rounds
        layer = model.get_submodule(name)
        assert torch.equal(layer.dequantize(torch.float32).double(), exact), name
        assert torch.equal(layer.dequantize(torch.bfloat16), theirs), name
        assert bool(((theirs.double() - exact).abs() <= exact.abs() * 2 ** -8).all()), name  # bf16: 8 bits


def test_layer_outputs_are_musubis_dequantized_weights(tmp_path):
    """A layer kept as it is computes with the file's exact values (musubi_dequantized); one re-quantized computes
    its per-row weight's (fp32 reference backend, against fp64)."""
    p = str(tmp_path / "m.safetensors")
    sd = write_musubi(p)
    model, _, _ = _load(p, backend="reference", dtype=torch.float32)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    for name, w in (("blocks.1.out", musubi_dequantized(sd["blocks.1.out.weight"], sd["blocks.1.out.scale_weight"])),
                    ("blocks.1.qkv", model.blocks[1].qkv.dequantize().double())):
        layer = model.get_submodule(name)
        xin = x[:, :layer.in_features]
        ref = xin.double() @ w.T + sd[name + ".bias"].double()
        with torch.no_grad():
            got = layer(xin).double()
        within(((got - ref).norm() / ref.norm()).item(), tol(torch.float32), name)  # fp32 against fp64


def test_save_writes_musubi_back(tmp_path):
    """save_fp8_checkpoint in the layout it was loaded from: the layers kept as they were give back the file's
    tensors (dtypes, shapes, bytes); the re-quantized ones are written per row [out, 1] in the file's dtype, and load
    back as they were (no second rounding)."""
    p, out = str(tmp_path / "m.safetensors"), str(tmp_path / "out.safetensors")
    sd = write_musubi(p)
    model, _, _ = _load(p)
    dorafp8.save_fp8_checkpoint(model, out, verbose=False)
    back = safetensors.load_file(out)
    assert set(back) == set(sd)
    for k, v in sd.items():
        if any(k.startswith(b + ".") for b in BLOCKED) and k.endswith(("weight", "scale_weight")) and "norm" not in k:
            continue
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and torch.equal(
            back[k].view(torch.uint8), v.view(torch.uint8)), k
    for name in BLOCKED:
        s = back[name + ".scale_weight"]
        assert s.dtype == torch.bfloat16 and s.shape == (model.get_submodule(name).out_features, 1)
    again, _, warned = _load(out)
    assert not warned and dorafp8.detect_format(out)[0] == "musubi"
    for name in BLOCKED + EXACT:
        a, b = model.get_submodule(name), again.get_submodule(name)
        assert torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8)) and torch.equal(a.scale, b.scale)


def test_malformed_block_scales_are_refused(tmp_path):
    p = str(tmp_path / "bad.safetensors")
    sd = write_musubi(p)
    sd["blocks.0.out.scale_weight"] = torch.ones(128, 5, 1, dtype=torch.bfloat16)  # 5 does not divide 96
    safetensors.save_file(sd, p)
    model = _meta_model()
    with pytest.raises(CheckpointFormatError, match=r"blocks.0.out.scale_weight: shape \[128, 5, 1\]: not "
                                                    r"\[128, 96 / g, 1\]"):
        dorafp8.load_fp8_checkpoint(model, p, verbose=False)
    assert type(model.blocks[0].qkv) is nn.Linear  # nothing changed


# ---- ComfyUI's plain fp8 casts --------------------------------------------------------------------------------------


def test_comfyui_plain_fp8_cast_of_a_unet(tmp_path):
    """A diffusion model saved by ComfyUI with weight_dtype fp8_e4m3fn: every tensor of the layers built through
    comfy.ops (Linear, Conv2d, GroupNorm, LayerNorm: weights and biases) is float8_e4m3fn, no scale key, no
    `scaled_fp8` marker, keys under `model.diffusion_model.`. It loads as fp8-cast: linear and conv layers keep the
    bytes with scale 1, the other fp8 tensors are converted exactly; the model computes what the same UNet does with
    the e4m3 values in fp32."""
    diffusers = pytest.importorskip("diffusers")

    def unet():
        torch.manual_seed(0)
        return diffusers.UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D",
                                                                                      "CrossAttnUpBlock2D"),
            cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32)

    ref = unet()
    sd = {"model.diffusion_model." + k: (v.to(E4M3) if v.is_floating_point() else v) for k, v in
          ref.state_dict().items()}
    path = str(tmp_path / "unet_fp8_e4m3fn.safetensors")
    safetensors.save_file(sd, path)
    assert dorafp8.detect_format(path)[0] == "fp8-cast"
    with torch.device("meta"):
        model = unet()
    report = dorafp8.load_fp8_checkpoint(model, path, verbose=False, backend="reference")
    assert report.prefix == "model.diffusion_model."
    n_fp8 = 0
    for name, mod in model.named_modules():
        if isinstance(mod, (dorafp8.FP8Linear, dorafp8.FP8Conv2d)):
            n_fp8 += 1
            assert mod.scale.item() == 1.0
            assert torch.equal(mod.weight.view(torch.uint8), sd["model.diffusion_model." + name + ".weight"].view(
                torch.uint8)), name
    assert n_fp8 == sum(isinstance(m, (nn.Linear, nn.Conv2d)) for m in ref.modules())
    ref.load_state_dict({k: v.float() for k, v in ref.state_dict().items()} | {
        k[len("model.diffusion_model."):]: v.float() for k, v in sd.items()})
    g = torch.Generator().manual_seed(1)
    x, t, enc = torch.randn(1, 4, 8, 8, generator=g), torch.tensor([10]), torch.randn(1, 4, 32, generator=g)
    with torch.no_grad():
        want, got = ref(x, t, enc).sample, model(x, t, enc).sample
    within(((got - want).norm() / want.norm()).item(), tol(torch.float32), "musubi file's model output")
    assert not os.path.exists(path + ".tmp")
