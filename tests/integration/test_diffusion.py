"""Diffusion models end to end (issue #11): fp8 bases for every Linear and Conv2d of a diffusers UNet and of a small
DiT, DoRA on attention + feed-forward + convolutions, bf16 autocast training, parity with PEFT, save and reload with
plain PEFT."""

import subprocess
import sys

import pytest


def test_peft_registration_survives_a_find_spec_probe():
    """diffusers (and transformers) probe optional packages with importlib.util.find_spec before importing them; the
    post-import hook that registers dorafp8 with PEFT must still fire on the import that follows."""
    code = ("import importlib.util, dorafp8\n"
            "assert importlib.util.find_spec('peft') is not None\n"
            "import peft\n"
            "from peft.tuners.lora.model import LoraModel\n"
            "print('registered' if LoraModel._create_new_module.__module__.startswith('dorafp8') else 'NOT registered')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "registered"


# ------------------------------------------------------------------------------------------ end to end, diffusers

import copy  # noqa: E402
import statistics  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

import dorafp8  # noqa: E402
from dorafp8 import FP8Conv2d, FP8Linear  # noqa: E402
from dorafp8._memory import MiB, peak_extra_bytes, tensor_bytes  # noqa: E402
from tests._layers import n_fp8  # noqa: E402
from tests._tolerance import tol, within  # noqa: E402

UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "conv1", "conv2"]
DIT_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
               "ff.net.0.proj", "ff.net.2", "pos_embed.proj"]
STEPS = 4


def small_unet():
    """A small SD-style UNet (1.1 M parameters): ResNet blocks with conv1/conv2, cross-attention transformer blocks."""
    torch.manual_seed(0)
    return diffusers.UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=2,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32).float()


def small_dit():
    """A small SD3-style MMDiT (joint attention, a Conv2d patch embedding)."""
    torch.manual_seed(0)
    return diffusers.SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=4,
        joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=16, out_channels=4,
        pos_embed_max_size=16).float()


def _batches(kind, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(2, 4, 16, 16, generator=g)
        t = torch.randint(0, 1000, (2,), generator=g)
        target = torch.randn(2, 4, 16, 16, generator=g)
        if kind == "unet":
            kw = dict(sample=x, timestep=t, encoder_hidden_states=torch.randn(2, 8, 32, generator=g))
        else:
            kw = dict(hidden_states=x, timestep=t, encoder_hidden_states=torch.randn(2, 8, 32, generator=g),
                      pooled_projections=torch.randn(2, 16, generator=g))
        out.append((kw, target))
    return out


def _loss(model, kw, target):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**kw).sample
    return (out.float() - target).square().mean()


def _dense_layers(model):
    return {n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))}


def _fp8_layers(model):
    return {n.replace("base_model.model.", "").replace(".base_layer", ""): m for n, m in model.named_modules()
            if isinstance(m, (FP8Linear, FP8Conv2d))}


def _dequantized_copy(original, fp8_model):
    """The original model with every quantized layer's weight replaced by its fp8 round trip (plain PEFT's twin)."""
    twin = copy.deepcopy(original)
    fp8 = _fp8_layers(fp8_model)
    for name, mod in twin.named_modules():
        if name in fp8:
            mod.weight.data = fp8[name].dequantize(mod.weight.dtype)
    return twin


def _train(model, batches):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    losses = []
    model.train()
    for kw, target in batches:
        loss = _loss(model, kw, target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("kind", ["unet", "dit"])
def test_end_to_end_fp8_base_dora_on_attention_ff_and_conv(kind, tmp_path):
    original = small_unet() if kind == "unet" else small_dit()
    targets = UNET_TARGETS if kind == "unet" else DIT_TARGETS
    dense = _dense_layers(original)
    ours = copy.deepcopy(original)
    # fp8 base for every Linear and Conv2d (diffusion models have no lm_head; include_conv takes the convs)
    assert n_fp8(dorafp8.quantize_model(ours, include_conv=True)) == len(dense)
    assert not _dense_layers(ours) and set(_fp8_layers(ours)) == dense
    twin = _dequantized_copy(original, ours)
    cfg = LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=targets)
    pm_ours = get_peft_model(ours, cfg)
    pm_peft = get_peft_model(twin, copy.deepcopy(cfg))
    kinds = {type(m).__name__ for m in pm_ours.modules()}
    assert {"DoRAFP8Linear", "DoRAFP8Conv2d"} <= kinds
    assert not {n for n in _dense_layers(pm_ours) if ".lora_" not in n}  # dense layers: only the adapters'
    n_conv = sum(type(m).__name__ == "DoRAFP8Conv2d" for m in pm_ours.modules())
    assert n_conv == (24 if kind == "unet" else 1)
    assert {k for k in pm_ours.state_dict() if "lora_" in k} == {k for k in pm_peft.state_dict() if "lora_" in k}

    # bf16 autocast training: the same losses as PEFT's DoRA on the dequantized base (bf16 rounding apart)
    batches = _batches(kind, STEPS)
    l_ours, l_peft = _train(pm_ours, batches), _train(pm_peft, batches)
    rel = [abs(a - b) / b for a, b in zip(l_ours, l_peft)]
    assert max(rel) < 1e-2, (l_ours, l_peft)
    assert l_ours[-1] < l_ours[0]

    # save, then load with plain PEFT onto the dequantized fp8 base (same outputs) and onto the original base
    rel = reload_errors(original, pm_ours, kind, tmp_path / "adapter")
    # the same fp32 computation in another order: fp32's tolerance
    within(rel["dequantized"], tol(torch.float32), f"{kind} reloaded onto the dequantized base")
    # measured (python docs/figures/measured.py diffusion-reload): each within a few % of its base's own fp8 error
    assert 0.5 * rel["base"] < rel["original"] < 1.25 * rel["base"], rel


def reload_errors(original, pm_ours, kind, path) -> dict:
    """pm_ours (DoRA on the fp8 quantization of `original`) saved to `path` and loaded with plain PEFT onto the
    dequantized fp8 base and onto `original`: their outputs' relative differences from pm_ours's on one batch, and
    "base": the original model's against its fp8 round trip's, without adapters."""
    pm_ours.save_pretrained(path)
    pm_ours.eval()
    kw, _ = _batches(kind, 1, seed=7)[0]
    with torch.no_grad():
        ref = pm_ours(**kw).sample
        outs = {}
        for base_kind, base in (("dequantized", _dequantized_copy(original, pm_ours)),
                                ("original", copy.deepcopy(original))):
            outs[base_kind] = PeftModel.from_pretrained(base, path).eval()(**kw).sample
        # the fp8 error of the base itself, without adapters: the original model against its fp8 round trip
        base_fp8 = _dequantized_copy(original, pm_ours).eval()(**kw).sample
        base_err = ((original.eval()(**kw).sample - base_fp8).norm() / base_fp8.norm()).item()
    rel = {k: ((v - ref).norm() / ref.norm()).item() for k, v in outs.items()}
    return dict(rel, base=base_err)


def test_unet_weight_and_training_step_memory():
    """Measured (CPU, dorafp8._memory): base weights 1 byte each instead of 4, and the training step's peak of
    temporaries no higher than PEFT's on the original fp32 UNet under bf16 autocast."""
    weights, peak = unet_memory()
    print(f"\nsmall UNet, DoRA r=4 on attention/ff/conv1/conv2, batch 2 x 4 x 16 x 16, bf16 autocast: "
          f"weights {weights['ours'] / MiB:.2f} MiB (dorafp8) vs {weights['peft'] / MiB:.2f} MiB (PEFT, fp32 base); "
          f"training-step peak of temporaries {peak['ours'] / MiB:.2f} MiB vs {peak['peft'] / MiB:.2f} MiB")
    assert weights["ours"] < 0.45 * weights["peft"]
    assert peak["ours"] <= peak["peft"]


def unet_memory() -> tuple[dict, dict]:
    """small_unet() with DoRA r=4 on UNET_TARGETS, PEFT on the fp32 base ("peft") and dorafp8 on the fp8 one
    ("ours"): bytes of parameters and buffers, and the peak of temporaries of one bf16-autocast forward + backward
    (after a warm-up step). docs/DIFFUSION.md's table (python docs/figures/measured.py diffusion-memory)."""
    original = small_unet()
    ours = copy.deepcopy(original)
    dorafp8.quantize_model(ours, include_conv=True)
    cfg = LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=UNET_TARGETS)
    pm_ours, pm_peft = get_peft_model(ours, cfg), get_peft_model(copy.deepcopy(original), copy.deepcopy(cfg))
    weights = {k: tensor_bytes(m) for k, m in (("ours", pm_ours), ("peft", pm_peft))}
    kw, target = _batches("unet", 1)[0]
    peak = {}
    for k, m in (("ours", pm_ours), ("peft", pm_peft)):
        _loss(m, kw, target).backward()  # warm-up (lazy state), then measure one forward + backward
        m.zero_grad(set_to_none=True)
        peak[k] = peak_extra_bytes(lambda m=m: _loss(m, kw, target).backward(), "cpu")
    return weights, peak


def test_diffusers_add_adapter_builds_fp8_layers():
    """diffusers' own PEFT entry point (ModelMixin.add_adapter, inject_adapter_in_model) builds the dorafp8 layers too,
    and get_peft_model_state_dict gives PEFT's keys."""
    from peft.utils import get_peft_model_state_dict

    unet = small_unet()
    dorafp8.quantize_model(unet, include_conv=True)
    unet.add_adapter(LoraConfig(r=2, lora_alpha=2, use_dora=True, target_modules=UNET_TARGETS))
    kinds = [type(m).__name__ for m in unet.modules()]
    assert kinds.count("DoRAFP8Conv2d") == 24 and kinds.count("DoRAFP8Linear") == 60
    sd = get_peft_model_state_dict(unet)
    assert "down_blocks.0.resnets.0.conv1.lora_magnitude_vector" in sd
    assert sd["down_blocks.0.resnets.0.conv1.lora_magnitude_vector"].shape == (1, 32, 1, 1)
    kw, target = _batches("unet", 1)[0]
    _loss(unet, kw, target).backward()
    assert all(p.grad is not None for n, p in unet.named_parameters() if p.requires_grad)


def _recipe_grads(pm, batches, checkpointing, amp=True):
    """One optimizer step the way diffusion trainers take it: fp16 autocast with a GradScaler (amp=False: fp32, no
    scaler; the fp32 truth), the gradients of len(batches) micro-batches accumulated, optionally with the UNet's
    gradient checkpointing. Returns the unscaled gradients of the trainable parameters, the losses, and whether the
    scaler let the optimizer step (no inf or NaN found)."""
    unet = pm.base_model.model
    if checkpointing:
        unet.enable_gradient_checkpointing()
    else:
        unet.disable_gradient_checkpointing()
    params = {n: p for n, p in pm.named_parameters() if p.requires_grad}
    opt = torch.optim.SGD(params.values(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, enabled=amp)
    pm.train()
    losses = []
    for kw, target in batches:
        with torch.autocast("cpu", dtype=torch.float16, enabled=amp):
            out = pm(**kw).sample
        loss = (out.float() - target).square().mean()
        scaler.scale(loss / len(batches)).backward()
        losses.append(loss.item())
    scaler.unscale_(opt)
    grads = {n: p.grad.detach().clone() for n, p in params.items()}
    scaler.step(opt)  # skipped by the scaler if it found an inf or NaN in the gradients
    scaler.update()  # ... and then it halves the scale
    stepped = not amp or scaler.get_scale() == 2.0 ** 10
    return grads, losses, stepped


def test_unet_grad_scaler_gradient_checkpointing_and_accumulation():
    """fp16 autocast + GradScaler, gradient checkpointing and gradient accumulation (OneTrainer / kohya recipes) on a
    UNet with fp8 Linear and Conv2d bases: checkpointing recomputes the forward (the conv layers' explicit backward
    and cached norm must give the same gradients as without it), and the accumulated gradients are as close to the
    fp32 truth (PEFT's DoRA on the dequantized base, no autocast) as PEFT's own fp16 run is."""
    original = small_unet()
    ours = copy.deepcopy(original)
    dorafp8.quantize_model(ours, include_conv=True)
    twin = _dequantized_copy(original, ours)
    cfg = LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=UNET_TARGETS)
    pm = get_peft_model(ours, cfg)
    with torch.no_grad():  # lora_B is zero at init: give it values so that every adapter gradient is exercised
        for i, (n, p) in enumerate(pm.named_parameters()):
            if "lora_B" in n:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(i))
    pm_ckpt = copy.deepcopy(pm)
    pm_peft = get_peft_model(twin, copy.deepcopy(cfg))
    pm_peft.load_state_dict({k: v for k, v in pm.state_dict().items() if "lora_" in k}, strict=False)
    pm_truth = copy.deepcopy(pm_peft)
    batches = _batches("unet", 2, seed=3)

    calls = {"plain": 0, "ckpt": 0}
    for key, model in (("plain", pm), ("ckpt", pm_ckpt)):
        for m in model.modules():
            if type(m).__name__ == "DoRAFP8Conv2d":
                m.register_forward_hook(lambda *a, key=key: calls.__setitem__(key, calls[key] + 1))
    g_plain, l_plain, stepped = _recipe_grads(pm, batches, checkpointing=False)
    g_ckpt, l_ckpt, _ = _recipe_grads(pm_ckpt, batches, checkpointing=True)
    assert calls["ckpt"] > calls["plain"] == 2 * 24, calls  # checkpointing recomputed conv layers in the backward
    g_peft, l_peft, _ = _recipe_grads(pm_peft, batches, checkpointing=False)
    g_true, _, _ = _recipe_grads(pm_truth, batches, checkpointing=False, amp=False)
    assert set(g_plain) == set(g_peft) == set(g_true) and len(g_plain) == 3 * (24 + 60)
    errs, errs_peft = [], []
    for name in g_plain:
        a, b = g_plain[name], g_ckpt[name]
        assert torch.isfinite(a).all(), name
        # recomputation is the same computation: equal up to the order of fp32 sums
        within(((a - b).norm() / a.norm().clamp_min(1e-30)).item(), 10 * tol(torch.float32), f"{name}: checkpointed")
        # fp16 rounding: some magnitude gradients are sums that cancel and are far off in fp16 for PEFT too
        # (measured: up to 4x their own size for PEFT, 5x here; median 0.4% for both), so each tensor's bound is
        # relative to PEFT's own error on it: 5x it (seen: at most 1.9x, on such a sum), plus what the fp16 roundings
        # along its path can add whatever PEFT's luck on that tensor (its error varies with the CPU's kernels: one
        # lora_A at 0.3% for PEFT, 1.1% here, with ATEN_CPU_CAPABILITY=default; the old bound, 2x + 1e-3, failed
        # there): fp16's tolerance once per layer of the UNet's deepest path (10). A wrong gradient is off by ~100%.
        t = g_true[name]
        err, err_peft = ((a - t).norm() / t.norm()).item(), ((g_peft[name] - t).norm() / t.norm()).item()
        within(err, 5 * err_peft + 10 * tol(torch.float16), f"{name}: fp16 gradient against fp32's")
        errs.append(err)
        errs_peft.append(err_peft)
    # and over all tensors, no further from the fp32 truth than PEFT's own fp16 run, with 2x room
    within(statistics.median(errs), 2 * statistics.median(errs_peft), "median fp16 gradient error against PEFT's")
    assert l_plain == pytest.approx(l_ckpt, rel=1e-5)
    assert l_plain == pytest.approx(l_peft, rel=1e-2)
    assert stepped  # the scaler found no inf or NaN in dorafp8's fp16 gradients


@pytest.mark.parametrize("fmt", ["comfyui", "compressed-tensors", "fine-grained", "dorafp8", "bf16"])
def test_unet_fp8_checkpoint_round_trip_keeps_conv_layers_fp8(fmt, tmp_path):
    """save_fp8_checkpoint / load_fp8_checkpoint on a UNet with fp8 Linear and Conv2d layers: every fp8 layout brings
    the conv layers back as FP8Conv2d with the same e4m3 bytes and scales (no dequantize-and-requantize), the bf16
    export holds scale * w8 in the conv layout and loads into the plain diffusers UNet, and export_merged merges DoRA
    conv adapters into the fp8 convs."""
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    ours = small_unet()
    dorafp8.quantize_model(ours, include_conv=True, per_row_scale=(fmt == "compressed-tensors"))
    convs = {n: m for n, m in ours.named_modules() if isinstance(m, FP8Conv2d)}
    assert len(convs) > 20
    kw, _ = _batches("unet", 1)[0]
    ours.eval()
    with torch.no_grad():
        ref = ours(**kw).sample
    path = tmp_path / fmt
    if fmt == "bf16":
        dorafp8.export_merged(ours, path, format="bf16", verbose=False)
        plain = small_unet()
        sd = {}
        for f in path.glob("*.safetensors"):
            sd.update(load_file(f))
        assert not any(k.endswith(".scale") for k in sd)
        plain.load_state_dict(sd)  # strict: PEFT-free diffusers keys and shapes
        for n, m in convs.items():
            want = m.dequantize(torch.float32).to(torch.bfloat16)
            assert torch.equal(plain.get_submodule(n).weight.detach().to(torch.bfloat16), want), n
        with torch.no_grad():
            out = plain.eval()(**kw).sample
        assert ((out - ref).norm() / ref.norm()).item() < 2e-2  # bf16 rounding of weights and biases
        return
    dorafp8.save_fp8_checkpoint(ours, path, format=fmt, verbose=False)
    fresh = small_unet()
    report = dorafp8.load_fp8_checkpoint(fresh, path, verbose=False)
    assert not report.dequantized
    for n, m in convs.items():
        got = fresh.get_submodule(n)
        assert type(got) is FP8Conv2d, n
        assert torch.equal(got.weight.view(torch.uint8), m.weight.view(torch.uint8)), n
        assert (got.stride, got.padding, got.groups) == (m.stride, m.padding, m.groups)
        assert torch.equal(got.dequantize(), m.dequantize()), n  # same scale values, whatever shape the layout keeps
    with torch.no_grad():
        out = fresh.eval()(**kw).sample
    within(((out - ref).norm() / ref.norm()).item(), tol(torch.float32), f"{fmt} reloaded")

    # DoRA on the loaded fp8 convs trains; export_merged merges it into the fp8 convs, and the file loads back
    pm = get_peft_model(fresh, LoraConfig(r=2, lora_alpha=2, use_dora=True, target_modules=["conv1", "to_q"]))
    _loss(pm, kw, torch.zeros_like(ref)).backward()
    with torch.no_grad():
        for name, prm in pm.named_parameters():
            if "lora_B" in name:
                prm.normal_(0, 0.05)  # B = 0 at init: give the adapters something to merge
        want = pm.eval()(**kw).sample
    dorafp8.export_merged(pm, tmp_path / "merged", format=fmt, verbose=False)
    back = small_unet()
    dorafp8.load_fp8_checkpoint(back, tmp_path / "merged", verbose=False)
    with torch.no_grad():
        got = back.eval()(**kw).sample
    assert ((got - want).norm() / want.norm()).item() < 0.05  # the merged layers' e4m3 rounding
