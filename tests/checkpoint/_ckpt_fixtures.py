"""Small fp8 checkpoints in each layout, written by the layout's own library where it runs on CPU.

  compressed-tensors  the compressed-tensors package: apply_quantization_config + its calculate_qparams (the scale
                      math its observers use) + ModelCompressor.compress_model, saved with safetensors and
                      ModelCompressor.update_config (what llm-compressor does to write these checkpoints).
  fine-grained        transformers itself: from_pretrained(..., quantization_config=FineGrainedFP8Config) quantizes
                      with its own Fp8Quantize op and save_pretrained writes the checkpoint. transformers refuses to
                      do this without a GPU (validate_environment), so that one check is patched out; nothing else.
  comfyui             ComfyUI is not a pip package: written here by the recipe of ComfyUI's own code (comfy/ops.py
                      scaled_fp8_ops, comfy/utils.py convert_old_quants, comfy/model_base.py state_dict_for_saving):
                      a 0-dim fp32 `<layer>.scale_weight` = amax / 448, weight * (1 / scale) cast to e4m3, and the
                      `scaled_fp8` marker torch.tensor([], dtype=float8_e4m3fn).
  comfyui-quant       the same recipe with ComfyUI's newer keys: `<layer>.weight_scale` and `<layer>.comfy_quant`
                      (the JSON {"format": "float8_e4m3fn"} as uint8 bytes, comfy/ops.py MixedPrecisionOps).
  fp8-cast, dorafp8   a model cast to float8_e4m3fn; an FP8Linear model's state_dict.
  compressed-tensors NVFP4  the compressed-tensors package, preset NVFP4A16 (nvfp4-pack-quantized): its generate_gparam
                      and calculate_qparams for the global and block scales, its ModelCompressor for the packing.
  compressed-tensors MXFP8  the same, preset MXFP8A16 (mxfp8-quantized: e4m3 weights, e8m0 exponents as uint8 scales).
  modelopt            ModelOpt (nvidia-modelopt) needs CUDA to export; written here by the recipe of its own code
                      (NVFP4QTensor.quantize: dorafp8.quant.quantize_nvfp4 follows it, packing `(q[..., 1::2] << 4) |
                      q[..., 0::2]`) under the names its HF export writes (`weight` uint8, `weight_scale` e4m3,
                      `weight_scale_2` and `input_scale` fp32) and its hf_quant_config.json, one `weight_scale_2` for
                      the layers vLLM fuses (q/k/v, gate/up: its preprocess_linear_fusion); MXFP8 the same way
                      (MXFP8QTensor's 2^ceil(log2(amax / 448)) scales, e8m0 bytes as uint8 under `weight_scale`).
"""

from __future__ import annotations

import json
import os
from unittest import mock

import torch

transformers = __import__("pytest").importorskip("transformers")

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # the layers vLLM fuses (qkv_proj, gate_up_proj)
IDS = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))  # the token ids every check feeds


def llama_config(**kw):
    base = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, attention_bias=True, tie_word_embeddings=False)
    base.update(kw)
    return transformers.LlamaConfig(**base)


def original_model(dtype=torch.float32, seed=0, **kw):
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(llama_config(**kw)).to(dtype).eval()
    with torch.no_grad():  # non-trivial biases and norms, so that loading them wrongly shows
        for name, p in model.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                p.add_(0.05 * torch.randn_like(p))
    return model


def _is_linear_weight(key: str) -> bool:
    return key.endswith(".weight") and key.split(".")[-2] in LINEARS


def _save_dir(sd: dict, path: str, config, metadata=None) -> str:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, os.path.join(path, "model.safetensors"),
              metadata=metadata or {"format": "pt"})
    config.save_pretrained(path)
    return path


def write_modelopt_fp8(folder: str) -> dict:
    """A ModelOpt FP8 export of original_model(), as ModelOpt's HF export writes one: e4m3 `weight`, fp32
    `weight_scale`, quant_algo FP8 in hf_quant_config.json, no quantization_config in config.json. Its state dict."""
    import json

    from dorafp8 import quant

    model = original_model()
    sd = {}
    for k, v in model.state_dict().items():
        if k.endswith(".weight") and k.split(".")[-2] in LINEARS:
            w8, scale = quant.quantize_e4m3(v)
            sd.update({k: w8, k + "_scale": scale})
        else:
            sd[k] = v
    _save_dir(sd, folder, model.config)
    with open(os.path.join(folder, "hf_quant_config.json"), "w") as f:
        json.dump({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8"}}, f)
    return sd


def write_compressed_tensors(model, path: str, preset: str = "FP8_DYNAMIC", block=None) -> str:
    """preset: FP8 (per-tensor weights + static per-tensor input scales), FP8_DYNAMIC (per-channel), FP8_BLOCK
    (block, block_structure [block, block])."""
    import copy

    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    m = copy.deepcopy(model)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if block is not None:
        scheme.weights.block_structure = [block, block]
        scheme.input_activations.group_size = block
    apply_quantization_config(m, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    with torch.no_grad():
        for mod in m.modules():
            if getattr(mod, "quantization_scheme", None) is None or not hasattr(mod, "weight_scale"):
                continue
            args, w = mod.quantization_scheme.weights, mod.weight
            if args.strategy == "tensor":
                lo, hi = w.amin(), w.amax()
            elif args.strategy == "channel":
                lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
            else:
                b0, b1 = args.block_structure
                N, K = w.shape
                wp = torch.nn.functional.pad(w.float(), (0, -K % b1, 0, -N % b0))
                r = wp.reshape(wp.shape[0] // b0, b0, wp.shape[1] // b1, b1)
                lo, hi = r.amin((1, 3)), r.amax((1, 3))
            scale, zp = calculate_qparams(lo, hi, args)
            mod.weight_scale.copy_(scale.reshape(mod.weight_scale.shape))
            if hasattr(mod, "weight_zero_point"):
                mod.weight_zero_point.copy_(zp.reshape(mod.weight_zero_point.shape))
            if hasattr(mod, "input_scale"):  # static activation scale: a calibration value; any fixed one will do
                mod.input_scale.fill_(0.05)
        comp = ModelCompressor.from_pretrained_model(m)
        comp.compress_model(m)
    _save_dir(m.state_dict(), path, m.config)
    comp.update_config(path)
    return path


def write_compressed_tensors_nvfp4(model, path: str, preset: str = "NVFP4A16") -> str:
    """compressed-tensors' nvfp4-pack-quantized (preset NVFP4A16: weights only), or its mxfp8-quantized (preset
    MXFP8A16), by its own library."""
    import copy

    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    m = copy.deepcopy(model)
    apply_quantization_config(m, QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(
        preset, ["Linear"])}, ignore=["lm_head"]))
    with torch.no_grad():
        for mod in m.modules():
            if getattr(mod, "quantization_scheme", None) is None or not hasattr(mod, "weight_scale"):
                continue
            args, w = mod.quantization_scheme.weights, mod.weight
            g = None
            if hasattr(mod, "weight_global_scale"):
                g = generate_gparam(w.amin(), w.amax())  # what its observers compute for tensor_group
                mod.weight_global_scale.copy_(g.reshape(mod.weight_global_scale.shape))
            blocks = w.reshape(w.shape[0], -1, args.group_size)
            scale, zp = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args, global_scale=g)
            mod.weight_scale.copy_(scale.reshape(mod.weight_scale.shape))
            if hasattr(mod, "weight_zero_point"):
                mod.weight_zero_point.copy_(zp.reshape(mod.weight_zero_point.shape))
        comp = ModelCompressor.from_pretrained_model(m)
        comp.compress_model(m)
    _save_dir(m.state_dict(), path, m.config)
    comp.update_config(path)
    return path


def write_modelopt(model, path: str, algo: str = "NVFP4") -> str:
    """ModelOpt's HF export of NVFP4, W4A16_NVFP4 (NVFP4's tensors without input_scale: weight-only) or MXFP8 weights
    (see the module docstring), lm_head left dense as its export excludes it by default."""
    from dorafp8 import quant

    sd, state = {}, model.state_dict()
    for k, v in state.items():
        if not _is_linear_weight(k):
            sd[k] = v
            continue
        lay = k[:-len(".weight")]
        if algo in ("NVFP4", "W4A16_NVFP4"):
            # one global scale for the layers vLLM fuses (its ModelOpt loader multiplies every shard by the largest
            # weight_scale_2), as ModelOpt's export gives them (quant_utils.py preprocess_linear_fusion: one amax)
            parent, leaf = lay.rsplit(".", 1)
            group = next((grp for grp in FUSED if leaf in grp), (leaf,))
            amax = torch.stack([state[f"{parent}.{m}.weight"].abs().amax() for m in group]).amax()
            packed, scale, g = quant.quantize_nvfp4(v, quant.nvfp4_global_scale(amax))
            sd.update({k: packed, f"{lay}.weight_scale": scale, f"{lay}.weight_scale_2": g})
            if algo == "NVFP4":
                sd[f"{lay}.input_scale"] = torch.tensor(0.05)
        else:
            w8, scale = quant.quantize_mxfp8(v)
            sd.update({k: w8, f"{lay}.weight_scale": scale.view(torch.uint8)})
    _save_dir(sd, path, model.config)
    with open(os.path.join(path, "hf_quant_config.json"), "w") as f:
        json.dump({"producer": {"name": "modelopt", "version": "0.47.0"},
                   "quantization": {"quant_algo": algo, "kv_cache_quant_algo": None,
                                    "group_size": 32 if algo == "MXFP8" else 16, "exclude_modules": ["lm_head"]}}, f)
    return path


def write_fine_grained(model, path: str, block: int = 32) -> str:
    """transformers' own quantizer and writer (see the module docstring)."""
    from transformers import FineGrainedFP8Config
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    src = path + "-src"
    model.save_pretrained(src)
    with mock.patch.object(FineGrainedFP8HfQuantizer, "validate_environment", lambda self, *a, **k: None):
        q = transformers.AutoModelForCausalLM.from_pretrained(
            src, quantization_config=FineGrainedFP8Config(weight_block_size=(block, block)))
        q.save_pretrained(path)
    return path


def _comfy_quantize(w: torch.Tensor):
    """ComfyUI's per-tensor recipe (comfy quant_ops TensorCoreFP8Layout.quantize): scale = amax / 448 in fp32, then
    tensor * (1 / scale) cast to e4m3."""
    scale = (w.abs().amax().float() / torch.finfo(torch.float8_e4m3fn).max).to(torch.float32)
    q = (w * (1.0 / scale).to(w.dtype)).to(torch.float8_e4m3fn)
    return q, scale


def comfy_state_dict(model, *, quant_keys: bool = False, prefix: str = "model.diffusion_model.",
                     layer_filter=_is_linear_weight) -> dict:
    sd = {}
    for k, v in model.state_dict().items():
        if layer_filter(k):
            q, s = _comfy_quantize(v.detach())
            lay = k[:-len(".weight")]
            sd[prefix + k] = q
            if quant_keys:
                sd[prefix + lay + ".weight_scale"] = s
                sd[prefix + lay + ".comfy_quant"] = torch.tensor(
                    list(json.dumps({"format": "float8_e4m3fn"}).encode("utf-8")), dtype=torch.uint8)
            else:
                sd[prefix + lay + ".scale_weight"] = s
        else:
            sd[prefix + k] = v.detach().clone()
    if not quant_keys:
        sd[prefix + "scaled_fp8"] = torch.tensor([], dtype=torch.float8_e4m3fn)
    return sd


def write_comfy(model, path: str, *, quant_keys: bool = False, prefix: str = "model.diffusion_model.") -> str:
    from safetensors.torch import save_file

    save_file(comfy_state_dict(model, quant_keys=quant_keys, prefix=prefix), path,
              metadata={"format": "pt", "modelspec.title": "dorafp8 test"})
    return path


def write_fp8_cast(model, path: str) -> str:
    sd = {k: (v.to(torch.float8_e4m3fn) if _is_linear_weight(k) else v) for k, v in model.state_dict().items()}
    return _save_dir(sd, path, model.config)


def write_dorafp8(model, path: str, per_row: bool = True) -> str:
    import copy

    import dorafp8

    m = copy.deepcopy(model)
    dorafp8.quantize_model(m, per_row_scale=per_row)
    return _save_dir(m.state_dict(), path, m.config)


def meta_model(config=None, dtype=torch.float32, how: str = "accelerate"):
    """The model of `config` with no weights: accelerate's init_empty_weights (buffers real) or torch.device('meta')
    (everything on meta)."""
    config = config or llama_config()
    if how == "accelerate":
        from accelerate import init_empty_weights

        with init_empty_weights():
            return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


def read_all(path: str) -> dict:
    """Every tensor of a .safetensors file or directory."""
    from safetensors.torch import load_file

    if os.path.isfile(path):
        return load_file(path)
    out = {}
    for n in sorted(os.listdir(path)):
        if n.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, n)))
    return out


def trained_dora(path: str):
    """A DoRA model (r=8 on every linear layer, 14 of them) on the dorafp8 checkpoint at `path` (write_dorafp8 of
    original_model()), trained 4 AdamW steps on IDS so that B, A and m all moved; in eval mode. The model the export
    tests merge (tests/checkpoint/test_checkpoint.py) and docs/figures/measured.py measures."""
    import peft

    import dorafp8

    torch.manual_seed(0)
    model = meta_model()
    dorafp8.load_fp8_checkpoint(model, path, verbose=False)
    pm = peft.get_peft_model(model.eval(), peft.LoraConfig(r=8, lora_alpha=16, use_dora=True,
                                                           target_modules="all-linear"))
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=3e-2)
    for _ in range(4):
        pm(input_ids=IDS, labels=IDS).loss.backward()
        opt.step()
        opt.zero_grad()
    return pm.eval()


def export_and_reload(trained, out, fmt: str, **kw):
    """export_merged(trained, out, format=fmt) and the export reloaded: with transformers' from_pretrained for a dense
    format, else load_fp8_checkpoint onto a meta model. (report, reloaded model, load report or None)."""
    import dorafp8
    from dorafp8.checkpoint import DENSE_FORMATS

    rep = dorafp8.export_merged(trained, out, format=fmt, verbose=False, **kw)
    if fmt in DENSE_FORMATS:
        return rep, transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval(), None
    model = meta_model()
    lrep = dorafp8.load_fp8_checkpoint(model, str(out), verbose=False)
    return rep, model.eval(), lrep


def layer_output_errors(trained, reloaded, names, n: int = 512, seed: int = 1) -> dict:
    """name -> ||y_reloaded - y_dora|| / ||y_dora|| for n Gaussian inputs to each named layer: the reloaded export's
    layer against the unmerged DoRA layer of `trained`."""
    base = trained.base_model.model
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in names:
        dora_layer = base.get_submodule(name)
        x = torch.randn(n, dora_layer.in_features, generator=g)
        with torch.no_grad():
            y_dora = dora_layer(x).float()
            y_back = reloaded.get_submodule(name)(x).float()
        out[name] = ((y_back - y_dora).norm() / y_dora.norm()).item()
    return out


def logits_error(model, ref) -> float:
    """||logits(model) - logits(ref)|| / ||logits(ref)|| on IDS."""
    with torch.no_grad():
        a, b = model(input_ids=IDS).logits.float(), ref(input_ids=IDS).logits.float()
    return ((a - b).norm() / b.norm()).item()
