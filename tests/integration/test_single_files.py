"""ComfyUI fp8_scaled single files in their original layouts (issue 53): SD 1.x / SDXL in the ldm layout, Wan and
LTX-Video in theirs, and Flux in BFL's (fused img_attn.qkv, single blocks' linear1 = q, k, v and the MLP), load in
place into the diffusers models through diffusers' own conversion, bit-exactly against the dequantized file converted
by diffusers, and train DoRA like PEFT on the dequantized model; diffusers' own from_single_file of such a file, which
loads it unscaled, is refused with dorafp8 imported."""

import subprocess
import sys

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")

import dorafp8  # noqa: E402
from dorafp8 import FP8Linear  # noqa: E402
from dorafp8.checkpoint import CheckpointFormatError  # noqa: E402
from dorafp8.checkpoint.single_file import load_single_file  # noqa: E402
from tests._tolerance import assert_close, tol  # noqa: E402
from tests.integration import _original_layouts as layouts  # noqa: E402
from tests.integration import _tiny_diffusers as tiny  # noqa: E402

from diffusers.loaders.single_file_utils import (convert_flux_transformer_checkpoint_to_diffusers,  # noqa: E402
                                                 convert_ldm_unet_checkpoint)


def _flux_inputs():
    g = torch.Generator().manual_seed(1)
    cfg = layouts.flux_config()
    return dict(hidden_states=torch.randn(1, 4, cfg["in_channels"], generator=g),
                encoder_hidden_states=torch.randn(1, 3, cfg["joint_attention_dim"], generator=g),
                pooled_projections=torch.randn(1, cfg["pooled_projection_dim"], generator=g),
                timestep=torch.tensor([0.5]), img_ids=torch.zeros(4, 3), txt_ids=torch.zeros(3, 3),
                guidance=torch.tensor([3.5]))


def _flux_model():
    with torch.device("meta"):
        return diffusers.FluxTransformer2DModel(**layouts.flux_config())


@pytest.fixture(scope="module")
def flux_file():
    """(comfy state dict in BFL's layout, the diffusers model loaded by diffusers' converter from its dequantized
    values: the reference)."""
    cfg = layouts.flux_config()
    sd = layouts.comfy_encode(layouts.random_tensors(layouts.flux_bfl_shapes(cfg)))
    return sd, _flux_reference(cfg, sd)


def _flux_reference(cfg, sd):
    """diffusers' model for `cfg` holding diffusers' conversion of the dequantized file `sd`: built on the meta device
    (strict: every tensor comes from the file, so a random init of Flux's width would only cost time)."""
    with torch.device("meta"):
        ref = diffusers.FluxTransformer2DModel(**cfg).eval()
    dense = convert_flux_transformer_checkpoint_to_diffusers(layouts.dequantize(sd))
    ref.load_state_dict(dense, strict=True, assign=True)  # the key list is BFL's as diffusers reads it: every shape
    assert not [n for n, t in [*ref.named_parameters(), *ref.named_buffers()] if t.is_meta]
    return ref


def _out(model, inputs):
    return model(**inputs, return_dict=False)[0]


def _check_in_place(model, sd, ref, inputs, per_row=False):
    """`model`, loaded from the comfy file `sd`, holds the file's bytes and scales (per tensor, or per row), equals
    `ref` (diffusers' own conversion of the dequantized file) bit for bit once dequantized, and computes what it
    computes."""
    ref_sd = ref.state_dict()
    fp8 = [n for n, m in model.named_modules() if isinstance(m, FP8Linear)]
    assert fp8
    for name in fp8:
        mod = model.get_submodule(name)
        assert mod.weight.dtype == torch.float8_e4m3fn and mod.scale.dim() == int(per_row), name
        scale = mod.scale[:, None] if per_row else mod.scale
        assert torch.equal(mod.weight.float() * scale, ref_sd[f"{name}.weight"]), name
    for k, v in model.state_dict().items():
        if v.dtype != torch.float8_e4m3fn and not k.endswith(".scale"):
            assert torch.equal(v, ref_sd[k]), k
    with torch.no_grad():
        assert_close(_out(model, inputs), _out(ref, inputs), tol(torch.float32), "loaded in place vs dequantized")
    return fp8


def _train_like_peft(model, ref, targets, inputs, out_shape):
    """A few DoRA steps on the fp8 model and with plain PEFT on the dequantized one: the same losses."""
    losses = {}
    for kind, base in (("ours", model), ("peft", ref)):
        torch.manual_seed(0)
        pm = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=targets))
        assert (kind == "ours") == any(type(m).__name__ == "DoRAFP8Linear" for m in pm.modules())
        g = torch.Generator().manual_seed(3)
        for n, p in pm.named_parameters():  # lora_B starts at 0: give it values so the DoRA terms are exercised
            if "lora_B" in n:
                p.data.normal_(0, 0.02, generator=g)
        opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-3)
        losses[kind] = []
        for step in range(3):
            target = torch.randn(out_shape, generator=torch.Generator().manual_seed(10 + step))
            loss = (_out(pm, inputs) - target).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[kind].append(loss.item())
        pm.unload()
    for a, b in zip(losses["ours"], losses["peft"]):
        assert abs(a - b) <= 4 * tol(torch.float32) * abs(b), losses


def test_flux_bfl_file_loads_in_place_bit_exactly(flux_file):
    sd, ref = flux_file
    model = _flux_model()
    load_single_file(model, dict(sd), verbose=False)
    fp8 = _check_in_place(model, sd, ref, _flux_inputs())
    assert len(fp8) == sum(isinstance(m, torch.nn.Linear) for m in ref.modules())  # Flux keeps nothing in fp32
    # the pieces of the fused weights share their file's scale, bytes as stored
    q = model.single_transformer_blocks[0].attn.to_q
    mlp = model.single_transformer_blocks[0].proj_mlp
    linear1 = sd[layouts.COMFY_PREFIX + "single_blocks.0.linear1.weight"]
    assert torch.equal(q.weight.view(torch.uint8), linear1[:layouts.FLUX_WIDTH].view(torch.uint8))
    assert torch.equal(mlp.weight.view(torch.uint8), linear1[3 * layouts.FLUX_WIDTH:].view(torch.uint8))
    assert q.scale == mlp.scale == sd[layouts.COMFY_PREFIX + "single_blocks.0.linear1.scale_weight"]


def test_flux_kontext_file_loads_and_trains_with_reference_image_tokens(flux_file):
    """A Flux.1 Kontext [dev] file has Flux.1 [dev]'s keys and shapes (BFL's one Flux class; diffusers reads it as
    flux-dev, infer_diffusers_model_type): what differs is the input, the reference image's latent tokens appended
    to the noisy ones, their position ids offset by 1 in the first axis (FluxKontextPipeline). Loaded in place, the
    model computes on those inputs what diffusers' conversion of the dequantized file computes, and trains like PEFT
    (DoRA on q, k and v, a single block's MLP and a double block's feed-forward: Flux.1's training test too, one run
    of Flux's width, not two)."""
    from diffusers.loaders.single_file_utils import infer_diffusers_model_type

    sd, ref = flux_file
    assert infer_diffusers_model_type(sd) == "flux-dev"
    inputs = _flux_inputs()
    image = torch.randn(1, 4, layouts.flux_config()["in_channels"], generator=torch.Generator().manual_seed(7))
    inputs["hidden_states"] = torch.cat([inputs["hidden_states"], image], dim=1)
    ids = torch.zeros(8, 3)
    ids[4:, 0] = 1  # the reference image's tokens
    ids[:, 1], ids[:, 2] = torch.arange(8) % 4 // 2, torch.arange(8) % 2
    inputs["img_ids"] = ids
    model = _flux_model()
    load_single_file(model, dict(sd), verbose=False)
    _check_in_place(model, sd, ref, inputs)
    _train_like_peft(model, ref, ["to_q", "to_k", "to_v", "proj_mlp", "ff.net.2"], inputs, (1, 8, 8))


def test_flux_schnell_file_with_per_row_scales_loads_in_place_bit_exactly():
    """Flux.1 [schnell] (no guidance_in; diffusers reads it as flux-schnell) in BFL's layout with one scale_weight per
    row ([out, 1]): the fused img_attn.qkv and single blocks' linear1 (q, k, v and the MLP) are cut with their rows'
    scales, bit-exact against diffusers' conversion of the dequantized file."""
    from diffusers.loaders.single_file_utils import infer_diffusers_model_type

    cfg = dict(layouts.flux_config(), guidance_embeds=False)
    sd = layouts.comfy_encode(layouts.random_tensors(layouts.flux_bfl_shapes(cfg)), scale_shape="[out, 1]")
    assert infer_diffusers_model_type(sd) == "flux-schnell"
    ref = _flux_reference(cfg, sd)
    with torch.device("meta"):
        model = diffusers.FluxTransformer2DModel(**cfg)
    load_single_file(model, dict(sd), verbose=False)
    _check_in_place(model, sd, ref, dict(_flux_inputs(), guidance=None), per_row=True)
    p = layouts.COMFY_PREFIX
    block, single = model.transformer_blocks[0].attn, model.single_transformer_blocks[0]
    for key, pieces in ((p + "double_blocks.0.img_attn.qkv.scale_weight", (block.to_q, block.to_k, block.to_v)),
                        (p + "single_blocks.0.linear1.scale_weight",
                         (single.attn.to_q, single.attn.to_k, single.attn.to_v, single.proj_mlp))):
        assert torch.equal(torch.cat([m.scale for m in pieces]), sd[key].reshape(-1)), key


def _unet_inputs(sdxl):
    g = torch.Generator().manual_seed(1)
    x = dict(sample=torch.randn(1, 4, 8, 8, generator=g), timestep=torch.tensor([500]),
             encoder_hidden_states=torch.randn(1, 5, 32, generator=g))
    if sdxl:
        x["added_cond_kwargs"] = dict(text_embeds=torch.randn(1, 16, generator=g),
                                      time_ids=torch.tensor([[8.0, 8.0, 0.0, 0.0, 8.0, 8.0]]))
    return x


def _ldm_case(sdxl):
    """(the comfy file in the ldm layout, the reference loaded by diffusers' converter from its dequantized values,
    the model loaded in place from it)."""
    cfg = layouts.unet_config(sdxl)
    torch.manual_seed(0)
    src = diffusers.UNet2DConditionModel(**cfg)
    sd = layouts.comfy_encode({layouts.ldm_key(k, cfg): v for k, v in src.state_dict().items()})
    ref = diffusers.UNet2DConditionModel(**cfg).eval()
    ref.load_state_dict(convert_ldm_unet_checkpoint(layouts.dequantize(sd, prefix=""), config=cfg), strict=True)
    with torch.device("meta"):
        model = diffusers.UNet2DConditionModel(**cfg)
    load_single_file(model, dict(sd), verbose=False)
    return sd, ref, model


@pytest.mark.parametrize("sdxl", [False, True], ids=["sd15", "sdxl"])
def test_ldm_unet_file_loads_in_place_and_trains_like_peft(sdxl):
    """SD 1.x / SDXL in the ldm layout (input_blocks / middle_block / output_blocks), its linear weights fp8_scaled
    and its convolutions dense (a mixed file)."""
    sd, ref, model = _ldm_case(sdxl)
    fp8 = _check_in_place(model, sd, ref, _unet_inputs(sdxl))
    assert "time_embedding.linear_1" in fp8 and ("add_embedding.linear_1" in fp8) == sdxl
    assert ("down_blocks.0.attentions.0.proj_in" in fp8) == sdxl  # a 1x1 conv in SD 1.x, dense in this file
    _train_like_peft(model, ref, ["to_q", "to_v", "ff.net.2", "time_emb_proj"], _unet_inputs(sdxl), (1, 4, 8, 8))


@pytest.mark.parametrize("sdxl", [False, True], ids=["sd15", "sdxl"])
def test_ldm_unet_file_without_the_prefix_loads_as_with_it(sdxl):
    """A UNet-only file in the ldm layout without `model.diffusion_model.` (ComfyUI's UNETLoader reads either):
    diffusers' ldm converter reads only prefixed keys, so it was refused as "208 tensors ... not mapped" (SD 1.x) or
    "KeyError: 'label_emb.0.0.weight'" (SDXL); it loads as the prefixed file does."""
    cfg = layouts.unet_config(sdxl)
    torch.manual_seed(0)
    src = diffusers.UNet2DConditionModel(**cfg)
    sd = layouts.comfy_encode({layouts.ldm_key(k, cfg): v for k, v in src.state_dict().items()}, prefix="")
    assert not any(k.startswith(layouts.COMFY_PREFIX) for k in sd)
    ref = diffusers.UNet2DConditionModel(**cfg).eval()
    dense = {layouts.COMFY_PREFIX + k: v for k, v in layouts.dequantize(sd, prefix="").items()}
    ref.load_state_dict(convert_ldm_unet_checkpoint(dense, config=cfg), strict=True)
    with torch.device("meta"):
        model = diffusers.UNet2DConditionModel(**cfg)
    load_single_file(model, dict(sd), verbose=False)
    _check_in_place(model, sd, ref, _unet_inputs(sdxl))


def test_full_checkpoint_loads_its_diffusion_model_and_lists_the_rest(tmp_path, capsys):
    """An SDXL full checkpoint (its UNet under `model.diffusion_model.`, beside the VAE's `first_stage_model.` and
    the text encoders' `conditioner.embedders.N.`, some fp8_scaled too) was refused, every VAE and text-encoder key
    "not mapped"; the UNet loads as from its own file, the other keys are listed in the report, not read."""
    from safetensors.torch import save_file

    sd, ref, _ = _ldm_case(True)
    others = {"first_stage_model.encoder.conv_in.weight": torch.randn(8, 3, 3, 3),
              "conditioner.embedders.0.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight":
                  torch.randn(8, 8).to(torch.float8_e4m3fn),
              "conditioner.embedders.0.transformer.text_model.encoder.layers.0.self_attn.q_proj.scale_weight":
                  torch.tensor(0.5)}
    path = tmp_path / "sdxl_full_fp8_scaled.safetensors"
    save_file({**sd, **others}, str(path))
    with torch.device("meta"):
        model = diffusers.UNet2DConditionModel(**layouts.unet_config(True))
    report = load_single_file(model, path)
    _check_in_place(model, sd, ref, _unet_inputs(True))
    assert set(others) <= set(report.kept) and "3 tensors of the file's other components" in capsys.readouterr().out


def test_a_diffusers_folder_is_refused_naming_load_fp8_checkpoint(tmp_path):
    """A diffusers folder of fp8 shards given to load_single_file was refused as "a folder, not a file; a checkpoint
    is made of regular files", which does not say what reads it; the error names load_fp8_checkpoint."""
    (tmp_path / "diffusion_pytorch_model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointFormatError, match=r"is a folder; .*dorafp8\.load_fp8_checkpoint\(model, folder\)"):
        load_single_file(_flux_model(), tmp_path, verbose=False)


_OWN_LAYOUTS = {  # family -> (model and inputs, its key names, diffusers' converter, DoRA targets, output shape)
    "wan": (lambda: tiny.build("wan"), layouts.wan_key, "convert_wan_transformer_to_diffusers",
            ["to_q", "to_v", "ffn.net.2"], (1, 4, 2, 4, 4)),
    "wan21_i2v": (lambda: layouts.wan_model("wan21_i2v"), layouts.wan_key, "convert_wan_transformer_to_diffusers",
                  ["to_q", "add_k_proj", "add_v_proj", "image_embedder.ff.net.0.proj"], (1, 4, 2, 4, 4)),
    "wan22_i2v": (lambda: layouts.wan_model("wan22_i2v"), layouts.wan_key, "convert_wan_transformer_to_diffusers",
                  ["to_q", "to_v", "ffn.net.2"], (1, 4, 2, 4, 4)),
    "wan22_ti2v": (lambda: layouts.wan_model("wan22_ti2v"), layouts.wan_key, "convert_wan_transformer_to_diffusers",
                   ["to_q", "to_v", "ffn.net.2", "proj_out"], (1, 12, 2, 4, 4)),
    "ltx": (lambda: tiny.build("ltx"), layouts.ltx_key, "convert_ltx_transformer_checkpoint_to_diffusers",
            ["to_q", "to_v", "ff.net.2"], (1, 16, 8)),
    "sd35": (layouts.sd35_model, layouts.sd3_key, "convert_sd3_transformer_checkpoint_to_diffusers",
             ["to_q", "to_v", "add_k_proj", "ff.net.2", "norm1.linear"], (1, 4, 8, 8)),
    "hunyuan_video": (lambda: layouts.hunyuan_model(False), layouts.hunyuan_key,
                      "convert_hunyuan_video_transformer_to_diffusers",
                      ["to_q", "to_v", "add_q_proj", "ff.net.2", "ff_context.net.0.proj"], (1, 4, 1, 2, 2)),
    "hunyuan_video_3072": (lambda: layouts.hunyuan_model(True), layouts.hunyuan_key,
                           "convert_hunyuan_video_transformer_to_diffusers", ["to_q", "to_v", "proj_mlp", "proj_out"],
                           (1, 4, 1, 2, 2)),
}


def _own_case(family, scale_shape="tensor", encode=None):
    """(the comfy file in the family's own layout, the reference loaded by diffusers' converter from its dequantized
    values, the model loaded in place from it, inputs). scale_shape: comfy_encode's; encode(sd) -> sd: the file
    re-encoded before it is used."""
    from accelerate import init_empty_weights
    from diffusers.loaders import single_file_utils

    build, own_key, converter, _, _ = _OWN_LAYOUTS[family]
    src, inputs = build()
    sd = layouts.comfy_encode(layouts.fuse(src.state_dict(), own_key), scale_shape=scale_shape)
    sd = encode(sd) if encode else sd
    del src
    ref, _ = build()
    ref.load_state_dict(getattr(single_file_utils, converter)(layouts.dequantize(sd)), strict=True)
    with init_empty_weights():  # keeps buffers (Wan's rotary tables) real
        model = type(ref).from_config(ref.config)
    load_single_file(model, dict(sd), verbose=False)
    return sd, ref, model, inputs


@pytest.mark.parametrize("family", list(_OWN_LAYOUTS))
def test_own_layout_file_loads_in_place_and_trains_like_peft(family):
    """Wan 2.1 (blocks.N.self_attn.q, ffn.0, head.head), LTX-Video (patchify_proj, adaln_single), SD3.5 in MMDiT's
    layout (joint_blocks.N.x_block.attn.qkv and context_block's, a second attention attn2.qkv, RMS ln_q / ln_k) and
    HunyuanVideo in its own (double_blocks.N.img_attn_qkv / txt_attn_qkv, the token refiner's self_attn_qkv; and,
    at the 3072 width diffusers' conversion hard-codes, a single block's linear1 = q, k, v and the MLP). Wan's time
    embedder, which it keeps in fp32 and casts the timestep to, is dequantized into its dense layers; everything
    else keeps its bytes."""
    _, own_key, _, targets, out_shape = _OWN_LAYOUTS[family]
    sd, ref, model, inputs = _own_case(family)
    fp8 = _check_in_place(model, sd, ref, inputs)
    kept = dorafp8.nn.convert.kept_in_precision(model)
    assert len(fp8) == sum(isinstance(m, torch.nn.Linear) for n, m in ref.named_modules() if n not in kept)
    assert family != "wan" or "condition_embedder.time_embedder.linear_1" in kept
    if family.startswith("hunyuan_video") or family == "sd35":  # the fused weights' pieces: the file's bytes, its scale
        fused = [k for k in sd if k.endswith(("qkv.weight", "linear1.weight"))]
        assert fused
        for k in fused:
            pieces = [n for n in fp8 if own_key(n + ".weight")[0] == k[len(layouts.COMFY_PREFIX):]]
            assert len(pieces) in (3, 4), (k, pieces)
            rows = torch.cat([model.get_submodule(n).weight.view(torch.uint8) for n in
                              sorted(pieces, key=lambda n: own_key(n + ".weight")[1])])
            assert torch.equal(rows, sd[k].view(torch.uint8)), k
            assert all(model.get_submodule(n).scale == sd[k[:-len("weight")] + "scale_weight"] for n in pieces)
    _train_like_peft(model, ref, targets, inputs, out_shape)


def test_wan22_t2v_experts_load_as_two_models():
    """Wan 2.2 t2v A14B comes as two files in Wan 2.1's layout, the high-noise and the low-noise expert (ComfyUI's
    wan2.2_t2v_{high,low}_noise_14B_fp8_scaled): each loads into its own WanTransformer3DModel (diffusers'
    `transformer` and `transformer_2`), bit-exactly against diffusers' conversion of its own dequantized file."""
    from accelerate import init_empty_weights
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    models, refs = [], []
    for seed in (0, 1):
        torch.manual_seed(seed)
        src, inputs = tiny.wan()
        sd = layouts.comfy_encode(layouts.fuse(src.state_dict(), layouts.wan_key))
        ref = type(src).from_config(src.config).eval()
        ref.load_state_dict(convert_wan_transformer_to_diffusers(layouts.dequantize(sd)), strict=True)
        with init_empty_weights():
            model = type(ref).from_config(ref.config)
        load_single_file(model, sd, verbose=False)
        _check_in_place(model, sd, ref, inputs)
        models.append(model)
        refs.append(ref)
    with torch.no_grad():
        assert not torch.equal(_out(models[0], inputs), _out(models[1], inputs))  # two experts, not one file twice


def test_from_single_file_refusal_names_a_build_that_loads_wan():
    """The refusal's advice, followed: under torch.device('meta') (its old advice) Wan's rotary buffers are left on
    meta and load_single_file refuses them; under init_empty_weights, which it now names, the file loads."""
    src, _ = tiny.wan()
    sd = layouts.comfy_encode(layouts.fuse(src.state_dict(), layouts.wan_key))
    with pytest.raises(ValueError, match="fp8_scaled") as refused:
        type(src).from_single_file(dict(sd))
    assert "init_empty_weights()" in str(refused.value) and "torch.device('meta')" not in str(refused.value)
    with torch.device("meta"):
        on_meta = type(src).from_config(src.config)
    with pytest.raises(CheckpointFormatError, match="rope.freqs_cos"):
        load_single_file(on_meta, dict(sd), verbose=False)
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = type(src).from_config(src.config)
    load_single_file(model, dict(sd), verbose=False)
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def test_wan_flf2v_position_embedding_is_refused_naming_key_and_model():
    """Wan 2.1 FLF2V's img_emb.emb_pos: diffusers' converter (0.42) passes it through unrenamed, so it fits nothing
    in the model (its condition_embedder.image_embedder.pos_embed): refused naming the file's key and the model,
    before the model changes."""
    model, _ = layouts.wan_model("wan21_i2v")
    cfg = dict(model.config, pos_embed_seq_len=6)
    src = type(model)(**cfg)
    sd = layouts.comfy_encode(layouts.fuse(src.state_dict(), layouts.wan_key))
    assert layouts.COMFY_PREFIX + "img_emb.emb_pos" in sd
    with torch.device("meta"):
        target = type(model)(**cfg)
    with pytest.raises(CheckpointFormatError, match=r"'model\.diffusion_model\.img_emb\.emb_pos'.*"
                                                    r"WanTransformer3DModel does not have"):
        load_single_file(target, sd, verbose=False)
    assert target.condition_embedder.image_embedder.pos_embed.is_meta


def test_unmappable_keys_are_refused_naming_key_and_model(flux_file):
    sd, _ = flux_file
    extra = dict(sd)
    extra[layouts.COMFY_PREFIX + "double_blocks.0.img_attn.extra.weight"] = torch.zeros(4, 4)
    with pytest.raises(CheckpointFormatError, match=r"FluxTransformer2DModel.*double_blocks\.0\.img_attn\.extra\.weight"):
        load_single_file(_flux_model(), extra, verbose=False)


def test_diffusers_from_single_file_is_refused_with_dorafp8_imported(flux_file, tmp_path):
    """Without dorafp8, diffusers' from_single_file loads this file's e4m3 values without their scales (checked in a
    subprocess: the weights come out far larger than the file's dequantized ones); with it imported, it is refused."""
    from safetensors.torch import save_file

    sd, ref = flux_file
    path = tmp_path / "flux1-fp8_scaled.safetensors"
    save_file(sd, str(path))
    cfg_dir = tmp_path / "config"
    ref.save_config(str(cfg_dir))
    code = (f"import torch, diffusers\n"
            f"m = diffusers.FluxTransformer2DModel.from_single_file({str(path)!r}, config={str(cfg_dir)!r}, "
            f"torch_dtype=torch.float32)\n"
            f"print(float(m.transformer_blocks[0].attn.to_out[0].weight.abs().max()))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    unscaled = float(out.stdout.strip().splitlines()[-1])
    assert unscaled > 50 * float(ref.transformer_blocks[0].attn.to_out[0].weight.abs().max())
    with pytest.raises(ValueError, match="fp8_scaled.*load_single_file"):
        diffusers.FluxTransformer2DModel.from_single_file(str(path), config=str(cfg_dir))
    with pytest.raises(ValueError, match="fp8_scaled"):
        diffusers.FluxTransformer2DModel.from_single_file(dict(sd), config=str(cfg_dir))


# ------------------------------------------------------------------------------------------- export back, for ComfyUI

def _comfy_key_map(sd: dict) -> dict:
    """ComfyUI's LoRA key map for a model loaded from the single file `sd`, derived from the file's own key list:
    comfy/lora.py model_lora_keys_unet maps `lora_unet_` + each `diffusion_model.` weight key of the model (the
    file's keys with a full checkpoint's `model.` dropped) without `.weight`, '.' -> '_', onto that weight."""
    return {"lora_unet_" + k[len(layouts.COMFY_PREFIX):-len(".weight")].replace(".", "_"): k
            for k in sd if k.startswith(layouts.COMFY_PREFIX) and k.endswith(".weight")}


def _trained_dora(model, targets):
    """(PEFT DoRA on `model`, its config), the adapters perturbed as training would leave them."""
    config = peft.LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=targets)
    pm = peft.get_peft_model(model, config)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05, generator=g)
            elif "lora_magnitude_vector" in n:
                p.mul_(1 + 0.1 * torch.randn(p.shape, generator=g))
    return pm, config


def _export_matches_comfyui(model, ref, sd, targets, tmp_path, prefix=layouts.COMFY_PREFIX, as_path=False):
    """DoRA on `model` (loaded in place from the comfy file `sd`), its adapters perturbed as training would leave
    them, exported with save_single_file_dora. Through ComfyUI's key map (_comfy_key_map) every key is loaded, and
    ComfyUI's LoRA math (its weight_decompose: a twin in test_kohya_dora.py, re-implemented from comfy/weight_adapter)
    applied to the dequantized file gives a file that diffusers' converter turns into the weights PEFT merges on the
    dequantized model `ref` with the same adapters."""
    from safetensors.torch import load_file, save_file

    from dorafp8.checkpoint.single_file import converter_for
    from tests.integration.test_kohya_dora import comfy_calculate_weight, comfy_load_lora

    pm, config = _trained_dora(model, targets)
    pm_ref = peft.get_peft_model(ref, config)
    res = pm_ref.load_state_dict({n: p for n, p in pm.state_dict().items() if "lora_" in n}, strict=False)
    assert not res.unexpected_keys and not [k for k in res.missing_keys if "lora_" in k]
    merged = pm_ref.merge_and_unload().state_dict()

    out = tmp_path / "dora_for_comfyui.safetensors"
    source = dict(sd)
    if as_path:
        source = tmp_path / "single_file.safetensors"
        save_file(sd, str(source))
    written = dorafp8.save_single_file_dora(pm, str(out), source)
    lora = load_file(str(out))
    key_map = _comfy_key_map(sd)
    to_load = {x: key_map[x] for x in {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0]
                                       for k in lora}}  # raises KeyError on a key ComfyUI does not map
    patches, left = comfy_load_lora(lora, to_load)
    assert not left and set(patches) == set(written), (left, set(patches) ^ set(written))
    patched = layouts.dequantize(sd, prefix=prefix)
    for key, (up, down, alpha, dora_scale) in patches.items():
        patched[key[len(prefix):]] = comfy_calculate_weight(patched[key[len(prefix):]], up, down, alpha, dora_scale)
    converted = converter_for(ref)(patched)
    changed = [k for k, v in merged.items() if not torch.equal(converted[k], v)]  # the rest: bit for bit
    assert changed
    for k in changed:
        assert_close(converted[k], merged[k], tol(torch.float32), f"ComfyUI's merge of the export vs PEFT's: {k}")
    return written


def test_flux_export_maps_onto_the_bfl_file_as_comfyui_loads_it(flux_file, tmp_path):
    """Flux: to_q and proj_mlp become one layer on the fused linear1 (the unadapted k and v rows left as they are),
    to_q one on img_attn.qkv, norm_out.linear goes back to BFL's row order (diffusers swaps its halves)."""
    import copy

    sd, ref = flux_file
    model = _flux_model()
    load_single_file(model, dict(sd), verbose=False)
    written = _export_matches_comfyui(model, copy.deepcopy(ref), sd, ["to_q", "proj_mlp", "norm_out.linear"],
                                      tmp_path)
    p = layouts.COMFY_PREFIX
    assert sorted(written[p + "single_blocks.0.linear1.weight"]) == [
        "single_transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.proj_mlp"]
    assert written[p + "double_blocks.0.img_attn.qkv.weight"] == ["transformer_blocks.0.attn.to_q"]
    assert written[p + "final_layer.adaLN_modulation.1.weight"] == ["norm_out.linear"]


@pytest.mark.parametrize("sdxl", [False, True], ids=["sd15", "sdxl"])
def test_ldm_unet_export_maps_onto_the_ldm_file_as_comfyui_loads_it(sdxl, tmp_path):
    sd, ref, model = _ldm_case(sdxl)
    written = _export_matches_comfyui(model, ref, sd, ["to_q", "to_v", "ff.net.2", "time_emb_proj", "conv1"],
                                      tmp_path, prefix="")
    assert any(".input_blocks." in k and k.endswith("in_layers.2.weight") for k in written)  # a dense conv too


@pytest.mark.parametrize("family", ["wan", "wan21_i2v", "wan22_i2v", "wan22_ti2v", "ltx", "sd35", "hunyuan_video",
                                    "hunyuan_video_3072"])
def test_own_layout_export_maps_onto_the_file_as_comfyui_loads_it(family, tmp_path):
    sd, ref, model, _ = _own_case(family)
    targets = _OWN_LAYOUTS[family][3]
    _export_matches_comfyui(model, ref, sd, targets, tmp_path, as_path=family == "wan")


@pytest.mark.parametrize("family", ["sd35", "hunyuan_video_3072"])
def test_single_file_export_loads_back_with_load_kohya_dora(family, tmp_path):
    """save_single_file_dora's file (keyed by the single file's weights, fused pieces as one layer) read back by
    load_kohya_dora(single_file=) into a fresh model loaded from the same file: the same modules adapted, each at its
    own rank, and the same outputs. SD3.5: fused qkv and the final adaLN's swapped halves; HunyuanVideo at 3072:
    linear1's q, v and MLP pieces. Without single_file= the file is refused, naming the argument."""
    from accelerate import init_empty_weights

    targets = _OWN_LAYOUTS[family][3] + (["norm_out.linear"] if family == "sd35" else [])
    sd, ref, model, inputs = _own_case(family)
    pm, _ = _trained_dora(model, targets)
    out = tmp_path / "dora_for_comfyui.safetensors"
    dorafp8.save_single_file_dora(pm, str(out), dict(sd))
    with init_empty_weights():
        fresh = type(ref).from_config(ref.config)
    load_single_file(fresh, dict(sd), verbose=False)
    with pytest.raises(ValueError, match="save_single_file_dora.*pass single_file="):
        dorafp8.load_kohya_dora(fresh, str(out))
    back = dorafp8.load_kohya_dora(fresh, str(out), single_file=dict(sd))

    def ranks(m):
        return {n: mod.r["default"] for n, mod in m.named_modules() if isinstance(mod, peft.tuners.lora.LoraLayer)}

    assert ranks(back) == ranks(pm) and set(ranks(pm).values()) == {4}
    with torch.no_grad():
        assert_close(_out(back, inputs), _out(pm, inputs), tol(torch.float32), "reloaded export vs trained")


def test_single_file_dora_of_comfy_quant_and_musubi_block_files(tmp_path):
    """save_single_file_dora dequantized the single file's weights with `scale_weight` alone: a model loaded from
    ComfyUI's comfy_quant encoding (`weight_scale`) was refused ("its base weight is not rows of ... (was the model
    loaded from it?)"), and one loaded from musubi-tuner's 1 x g block scales ([out, in / g, 1]) failed with a
    RuntimeError (the block scales broadcast as per row). The comfy_quant file now gives the file its scaled_fp8 twin
    gives, tensor for tensor; the musubi file's loads back (load_kohya_dora, single_file=) to the same outputs."""
    from accelerate import init_empty_weights
    from safetensors.torch import load_file

    from tests.checkpoint.test_musubi import optimize_state_dict_with_fp8

    sd, ref, model, _ = _own_case("sd35")
    quant_sd, _ = _as_comfy_quant(sd, per_layer=True)
    with init_empty_weights():
        model = type(ref).from_config(ref.config)
    load_single_file(model, dict(quant_sd), verbose=False)
    pm, _ = _trained_dora(model, _OWN_LAYOUTS["sd35"][3])
    ours, twin = tmp_path / "from_comfy_quant.safetensors", tmp_path / "from_scaled_fp8.safetensors"
    dorafp8.save_single_file_dora(pm, str(ours), dict(quant_sd))
    dorafp8.save_single_file_dora(pm, str(twin), dict(sd))
    a, b = load_file(ours), load_file(twin)
    assert a.keys() == b.keys() and any(k.endswith("dora_scale") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)

    build, own_key, _, targets, _ = _OWN_LAYOUTS["hunyuan_video"]
    src, inputs = build()
    msd = optimize_state_dict_with_fp8(layouts.fuse(src.state_dict(), own_key), ["blocks"], ["norm"], block_size=8)
    assert any(t.dim() == 3 for k, t in msd.items() if k.endswith("scale_weight"))
    models = []
    for _ in range(2):
        with init_empty_weights():
            models.append(type(src).from_config(src.config))
        with pytest.warns(dorafp8.quant.QuantizationWarning):
            load_single_file(models[-1], dict(msd), verbose=False)
    pm, _ = _trained_dora(models[0], targets)
    out = tmp_path / "from_musubi.safetensors"
    dorafp8.save_single_file_dora(pm, str(out), dict(msd))
    back = dorafp8.load_kohya_dora(models[1], str(out), single_file=dict(msd))
    with torch.no_grad():
        assert_close(_out(back, inputs), _out(pm, inputs), tol(torch.float32), "musubi file's export reloaded")


def test_kohya_lora_on_a_fused_weight_loads_onto_its_pieces():
    """A plain LoRA keyed by a fused weight of the file (as kohya's scripts train on the original model: one
    lora_down, lora_up over all of SD3.5's qkv rows) goes onto q, k and v, each with the whole lora_down and its rows
    of lora_up: the model computes what diffusers' conversion of the dequantized file with W + alpha / r * up @ down
    computes."""
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    sd, ref, model, inputs = _own_case("sd35")
    qkv = "joint_blocks.0.x_block.attn.qkv.weight"
    w = sd[layouts.COMFY_PREFIX + qkv]
    g = torch.Generator().manual_seed(11)
    down, up = 0.1 * torch.randn(4, w.shape[1], generator=g), 0.1 * torch.randn(w.shape[0], 4, generator=g)
    name = "lora_unet_" + qkv[:-len(".weight")].replace(".", "_")
    lora = {f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up, f"{name}.alpha": torch.tensor(2.0)}
    back = dorafp8.load_kohya_dora(model, lora, single_file=dict(sd))
    assert {n: m.r["default"] for n, m in back.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)} == {
        f"base_model.model.transformer_blocks.0.attn.{p}": 4 for p in ("to_q", "to_k", "to_v")}
    patched = layouts.dequantize(sd)
    patched[qkv] = patched[qkv] + 0.5 * up @ down
    ref.load_state_dict(convert_sd3_transformer_checkpoint_to_diffusers(patched), strict=True)
    with torch.no_grad():
        assert_close(_out(back, inputs), _out(ref, inputs), tol(torch.float32), "kohya LoRA on qkv vs its merge")


def test_export_onto_another_file_is_refused(tmp_path):
    """The export takes the rows from the file it is given: a file whose weight differs from the base the model
    was loaded with (another checkpoint of the same model) is refused naming the layer, and nothing is written."""
    sd, _, model, _ = _own_case("sd35")
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["to_q"]))
    other = dict(sd)
    key = layouts.COMFY_PREFIX + "joint_blocks.1.x_block.attn.qkv.scale_weight"
    other[key] = other[key] * 1.5
    out = tmp_path / "dora.safetensors"
    with pytest.raises(ValueError, match=r"transformer_blocks\.1\.attn\.to_q: its base weight is not rows of "
                                         r"model\.diffusion_model\.joint_blocks\.1\.x_block\.attn\.qkv\.weight"):
        dorafp8.save_single_file_dora(pm, str(out), other)
    assert not out.exists()


@pytest.mark.parametrize("change", ["scale", "bytes"])
def test_export_onto_a_near_copy_of_the_file_is_refused(change, tmp_path):
    """The base check allowed one e4m3 rounding (rtol 2**-4) for every weight, so a file close to the one the model
    was loaded from (the same weights quantized with a 3% larger scale, or a fine-tune moving its small weights by one e4m3 step)
    was written onto without an error, its dora_scale belonging to other rows. A weight load_single_file keeps as it
    is must match exactly."""
    sd, _, model, _ = _own_case("sd35")
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["to_q"]))
    other = dict(sd)
    key = layouts.COMFY_PREFIX + "joint_blocks.1.x_block.attn.qkv."
    if change == "scale":
        other[key + "scale_weight"] = other[key + "scale_weight"] * 1.03
    else:
        w8 = other[key + "weight"]
        small = w8.float().abs() < 0.1 * w8.float().abs().max()  # within the check's atol: what a fine-tune moves
        other[key + "weight"] = torch.where(small, w8.view(torch.uint8) + 1, w8.view(torch.uint8)).view(w8.dtype)
    out = tmp_path / "dora.safetensors"
    with pytest.raises(ValueError, match=r"transformer_blocks\.1\.attn\.to_q: its base weight is not rows of"):
        dorafp8.save_single_file_dora(pm, str(out), other)
    assert not out.exists()
    dorafp8.save_single_file_dora(pm, str(out), dict(sd))  # the file it was loaded from: written


@pytest.mark.parametrize("loaded, cast", [(torch.bfloat16, None), (torch.bfloat16, torch.float16),
                                           (torch.bfloat16, torch.float32), (torch.float16, torch.float32)])
def test_export_of_a_layer_dequantized_into_a_bf16_model_checks_it_exactly(loaded, cast, tmp_path):
    """An e4m3 weight load_single_file dequantizes into a dense layer (Wan's time embedder, which the model keeps in
    precision) holds scale x e4m3 rounded to that layer's dtype: in a bf16 model the exact base check refused the
    file the model was loaded from ("its base weight is not rows of ..."). It compares with the file's values rounded
    the same way now, also where the model was cast after the load (bf16, then model.to(torch.float16): the layer
    holds the bf16 rounding in fp16, which the layer's own dtype rounding is not): the file is written, a near copy
    of it (another scale, or one element one e4m3 step away) is still refused."""
    from accelerate import init_empty_weights

    sd, ref, _, _ = _own_case("wan")
    with init_empty_weights():
        model = type(ref).from_config(ref.config).to(loaded)
    load_single_file(model, dict(sd), verbose=False)
    if cast is not None:
        model.to(cast)
    dense = model.condition_embedder.time_embedder.linear_1
    assert type(dense) is torch.nn.Linear and dense.weight.dtype == (cast or loaded)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, use_dora=True,
                                                    target_modules=["to_q", "time_embedder.linear_1"]))
    key = layouts.COMFY_PREFIX + "time_embedding.0."
    rescaled, stepped = dict(sd), dict(sd)
    rescaled[key + "scale_weight"] = sd[key + "scale_weight"] * 1.03
    w8 = sd[key + "weight"].clone()
    i = int(w8.float().abs().argmax())  # a normal value, whose next e4m3 code (toward zero) is one step away
    w8.view(torch.uint8).view(-1)[i] -= 1
    stepped[key + "weight"] = w8
    out = tmp_path / "dora.safetensors"
    for other in (rescaled, stepped):
        with pytest.raises(ValueError, match=r"time_embedder\.linear_1: its base weight is not rows of"):
            dorafp8.save_single_file_dora(pm, str(out), other)
    written = dorafp8.save_single_file_dora(pm, str(out), dict(sd))
    assert written[key + "weight"] == ["condition_embedder.time_embedder.linear_1"]


# ------------------------------------------------------------- what the community's files carry: per-row scales,
# scale_input, e5m2

def _pieces(model, fp8, own_key, key):
    """The FP8Linear layers cut from the file's fused `key`, in the file's row order."""
    pieces = [n for n in fp8 if own_key(n + ".weight")[0] == key[len(layouts.COMFY_PREFIX):]]
    return [model.get_submodule(n) for n in sorted(pieces, key=lambda n: own_key(n + ".weight")[1])]


@pytest.mark.parametrize("family, scale_shape", [("sd35", "[out]"), ("sd35", "[out, 1]"),
                                                 ("hunyuan_video_3072", "[out, 1]")])
def test_per_row_scales_are_cut_with_the_rows_of_fused_weights(family, scale_shape):
    """A file with one scale_weight per row ([out] or [out, 1]) of SD3.5 (fused qkv, the final adaLN's halves swapped
    by diffusers) and of HunyuanVideo's 3072-wide single block (linear1 = q, k, v and the MLP): each piece keeps its
    rows' bytes and scales, bit-exact against diffusers' conversion of the dequantized file; SD3.5 trains like PEFT
    (the 3072-wide block's steps take a minute on a CPU)."""
    own_key, targets, out_shape = _OWN_LAYOUTS[family][1], _OWN_LAYOUTS[family][3], _OWN_LAYOUTS[family][4]
    sd, ref, model, inputs = _own_case(family, scale_shape=scale_shape)
    fp8 = _check_in_place(model, sd, ref, inputs, per_row=True)
    fused = [k for k in sd if k.endswith(("qkv.weight", "linear1.weight"))]
    assert fused
    for k in fused:
        pieces = _pieces(model, fp8, own_key, k)
        assert len(pieces) in (3, 4), k
        assert torch.equal(torch.cat([p.scale for p in pieces]), sd[k[:-len("weight")] + "scale_weight"].reshape(-1))
    if family == "sd35":
        _train_like_peft(model, ref, targets, inputs, out_shape)


def test_musubi_block_scales_are_cut_with_the_rows_of_fused_weights():
    """A musubi-tuner --fp8_scaled file of HunyuanVideo in its own layout (its models' names; scale_weight
    [out, in / g, 1], 1 x g blocks, no marker) was refused ("must have one element (per tensor)..."), the fused qkv's
    whole block scale given to each piece; each piece now gets its rows' block scales, and the model loads as
    load_fp8_checkpoint loads musubi's blocks: re-quantized per row, with a QuantizationWarning, each weight within
    e4m3's rounding (2**-4 of its row's largest value) of diffusers' conversion of the dequantized file."""
    from accelerate import init_empty_weights
    from diffusers.loaders import single_file_utils

    from dorafp8.checkpoint.single_file import to_diffusers_layout
    from tests.checkpoint.test_musubi import musubi_dequantized, optimize_state_dict_with_fp8

    build, own_key, converter, _, _ = _OWN_LAYOUTS["hunyuan_video"]
    src, _ = build()
    sd = optimize_state_dict_with_fp8(layouts.fuse(src.state_dict(), own_key), ["blocks"], ["norm"], block_size=8)
    fused = [k for k in sd if k.endswith("qkv.weight")]
    assert fused and all(sd[k[:-len("weight")] + "scale_weight"].dim() == 3 for k in fused)
    dense = {k: musubi_dequantized(v, sd[k[:-len("weight")] + "scale_weight"]).float()
             if v.dtype == torch.float8_e4m3fn else v for k, v in sd.items() if not k.endswith("scale_weight")}
    ref, _ = build()
    ref.load_state_dict(getattr(single_file_utils, converter)(dense), strict=True)
    with init_empty_weights():
        model = type(ref).from_config(ref.config)
    converted = to_diffusers_layout(model, sd)
    for k in fused:
        pieces = {n: own_key(n)[1] for n in converted if n.endswith(".weight") and own_key(n)[0] == k}
        assert len(pieces) == 3, k
        for n, i in pieces.items():
            rows = converted[n].shape[0]
            assert torch.equal(converted[n[:-len("weight")] + "scale_weight"],
                               sd[k[:-len("weight")] + "scale_weight"][i * rows:(i + 1) * rows]), n
    with pytest.warns(dorafp8.quant.QuantizationWarning):
        load_single_file(model, dict(sd), verbose=False)
    fp8 = [n for n, m in model.named_modules() if isinstance(m, FP8Linear)]
    assert len(fp8) == sum(k.endswith(".scale_weight") for k in converted)
    ref_sd = ref.state_dict()
    for name in fp8:
        w, want = model.get_submodule(name).dequantize(torch.float32), ref_sd[name + ".weight"]
        assert bool(((w - want).abs() <= 2.0 ** -4 * want.abs().amax(1, keepdim=True)).all()), name


def test_scale_input_is_kept_on_its_layers_and_noted_once(capsys):
    """ComfyUI's `scale_input` (a static per-tensor activation scale) is not used: dorafp8's W8A8 (act_quant=
    'rowwise') scales activations per row as it runs. It is never dropped silently: each piece of a fused weight keeps
    its file's value (written back on save), and the printed report says once why it is not used."""
    def with_scale_input(sd):
        weights = [k for k in sd if k.endswith(".scale_weight")]
        return dict(sd, **{k[:-len("scale_weight")] + "scale_input": torch.tensor(0.01 * (i + 1))
                           for i, k in enumerate(weights)})

    from dorafp8.checkpoint.single_file import to_diffusers_layout

    sd, ref, _, inputs = _own_case("sd35", encode=with_scale_input)
    with torch.device("meta"):
        model = type(ref).from_config(ref.config)
    capsys.readouterr()
    report = load_single_file(model, dict(sd), verbose=True)
    printed = capsys.readouterr().out
    fp8 = _check_in_place(model, sd, ref, inputs)
    notes = [line for line in printed.splitlines() if "static activation scales (not used: act_quant='rowwise'" in line]
    assert len(notes) == 1 and f"{len(fp8)} static activation scales" in notes[0], printed
    assert len([k for k, why in report.kept.items() if k.endswith(".scale_input")]) == len(fp8)
    converted = to_diffusers_layout(model, sd)
    for name in fp8:
        assert torch.equal(model.get_submodule(name)._dorafp8_source.extras["scale_input"],
                           converted[name + ".scale_input"]), name
    q, k, v = _pieces(model, fp8, layouts.sd3_key, layouts.COMFY_PREFIX + "joint_blocks.0.x_block.attn.qkv.weight")
    file_value = sd[layouts.COMFY_PREFIX + "joint_blocks.0.x_block.attn.qkv.scale_input"]
    assert all(torch.equal(p._dorafp8_source.extras["scale_input"], file_value) for p in (q, k, v))


def _e5m2_file(tensors):
    """A comfy file in e5m2, as a tool writing e5m2 writes it, of the dense state dict `tensors` (an original layout):
    each 2-D weight with scale = amax / 57344 (e5m2's largest value), weight / scale cast to float8_e5m2; the marker
    in e5m2 (ComfyUI reads its dtype)."""
    out = {}
    for k, t in tensors.items():
        if k.endswith(".weight") and t.dim() == 2:
            scale = t.abs().max() / torch.finfo(torch.float8_e5m2).max
            out[layouts.COMFY_PREFIX + k] = (t / scale).to(torch.float8_e5m2)
            out[layouts.COMFY_PREFIX + k[:-len("weight")] + "scale_weight"] = scale
        else:
            out[layouts.COMFY_PREFIX + k] = t
    out[layouts.COMFY_PREFIX + "scaled_fp8"] = torch.tensor([], dtype=torch.float8_e5m2)
    return out


def _wan_e5m2_file():
    """(the e5m2 Wan file, its source model, inputs); one weight holds a value e5m2 keeps and e4m3 cannot after
    the shift (1.25 * 2**-10 of 448, its largest)."""
    src, inputs = tiny.build("wan")
    dense = layouts.fuse(src.state_dict(), layouts.wan_key)
    w = dense["blocks.0.self_attn.q.weight"]
    w[0, 0] = 0.15625 * w.abs().max() / torch.finfo(torch.float8_e5m2).max  # 1.25 * 2**-3 in e5m2's units
    return _e5m2_file(dense), src, inputs


def test_e5m2_file_loads_as_e4m3_with_the_error_stated():
    """An e5m2 fp8_scaled Wan file: each weight is shifted by a power of two into e4m3 (its scale by the inverse),
    exact for every value e4m3 can hold after the shift; the warning states how many weights were converted, how
    many exactly, and the worst change, and these are what the loaded model holds against diffusers' conversion of
    the dequantized e5m2 file."""
    import re

    from accelerate import init_empty_weights
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    sd, src, inputs = _wan_e5m2_file()
    ref = type(src).from_config(src.config).eval()
    ref.load_state_dict(convert_wan_transformer_to_diffusers(layouts.dequantize(sd)), strict=True)
    with init_empty_weights():
        model = type(ref).from_config(ref.config)
    with pytest.warns(dorafp8.quant.QuantizationWarning, match="float8_e5m2") as caught:
        load_single_file(model, dict(sd), verbose=False)
    n, exact, worst = re.search(r"(\d+) float8_e5m2 weights .*: (\d+) exactly; .* changes by (\S+) of",
                                str(caught[0].message)).groups()
    ref_sd, errors = ref.state_dict(), []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and not isinstance(mod, FP8Linear):  # kept in precision: dequantized
            w = mod.weight
        elif isinstance(mod, FP8Linear):
            assert mod.weight.dtype == torch.float8_e4m3fn
            w = mod.weight.float() * mod.scale
        else:
            continue
        want = ref_sd[name + ".weight"]
        errors.append(float((w.detach() - want).abs().max() / want.abs().max()))
    assert int(n) == len(errors) == sum(t.dtype == torch.float8_e5m2 and t.dim() == 2 for t in sd.values())
    assert int(exact) == errors.count(0.0) == int(n) - 1  # the one value below e4m3's range after the shift
    assert float(worst) == pytest.approx(max(errors), rel=1e-2) and max(errors) <= 2.0 ** -10 / 256
    with torch.no_grad():
        assert_close(_out(model, inputs), _out(ref, inputs), tol(torch.float32), "e5m2 loaded as e4m3 vs e5m2")


def test_e5m2_inf_is_refused_naming_the_weight():
    """e5m2 has inf (e4m3 has none): a weight holding one is refused, naming it, before the model changes."""
    sd, src, _ = _wan_e5m2_file()
    key = layouts.COMFY_PREFIX + "blocks.0.ffn.0.weight"
    sd[key] = sd[key].clone()
    sd[key][0, 0] = float("inf")
    with torch.device("meta"):
        model = type(src).from_config(src.config)
    with pytest.raises(CheckpointFormatError, match=r"blocks\.0\.ffn\.0\.weight: a float8_e5m2 weight with inf"):
        load_single_file(model, sd, verbose=False)
    assert model.blocks[0].ffn.net[0].proj.weight.is_meta


def test_e5m2_weights_with_scales_are_refused_by_load_fp8_checkpoint():
    """load_fp8_checkpoint holds e4m3 only: an e5m2 weight with its scale_weight, in diffusers' key names with the
    format given (so that detection, which refuses e5m2, is skipped), is refused naming the dtype, not loaded as a
    dense weight without its scale."""
    from dorafp8.checkpoint.single_file import to_diffusers_layout

    sd, src, _ = _wan_e5m2_file()
    with torch.device("meta"):
        model = type(src).from_config(src.config)
    converted = to_diffusers_layout(model, sd)
    with pytest.raises(CheckpointFormatError, match=r"blocks\.0\.attn1\.to_q\.weight: float8_e5m2 with its scale"):
        dorafp8.load_fp8_checkpoint(model, converted, format="comfyui", verbose=False)


def _as_comfy_quant(sd: dict, per_layer: bool) -> tuple[dict, dict]:
    """(state dict, safetensors metadata) of a scaled_fp8 file in ComfyUI's newer comfy_quant encoding, by the recipe of
    ComfyUI's own convert_old_quants (comfy/utils.py): `scale_weight` -> `weight_scale` with the layer's
    {"format": "float8_e4m3fn"}, `scale_input` -> `input_scale`, no `scaled_fp8` marker; the layer configs as
    `<layer>.comfy_quant` uint8 JSON (per_layer) or in the `_quantization_metadata` metadata."""
    import json

    out, layers = {}, {}
    for k, t in sd.items():
        lay, _, suffix = k.rpartition(".")
        if suffix == "scaled_fp8":
            continue
        if suffix == "scale_weight":
            layers[lay] = {"format": "float8_e4m3fn"}
        out[{"scale_weight": f"{lay}.weight_scale", "scale_input": f"{lay}.input_scale"}.get(suffix, k)] = t
    if per_layer:
        for lay, conf in layers.items():
            out[f"{lay}.comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
        return out, {}
    return out, {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})}


@pytest.mark.parametrize("per_layer", [True, False], ids=["comfy_quant", "_quantization_metadata"])
def test_comfy_quant_encoding_loads_as_its_scaled_fp8_twin(per_layer, tmp_path):
    """ComfyUI's newer comfy_quant encoding of an original-layout file (what ComfyUI saves since its mixed-precision
    ops; the layer configs per layer or in the safetensors metadata) loads as the scaled_fp8 file it was converted
    from: the same bytes and scales, bit-exact against diffusers' conversion of the dequantized file. It was refused
    ("not read in original layouts here") without saying what to do."""
    from safetensors.torch import save_file

    sd, ref, _, inputs = _own_case("sd35")
    quant_sd, metadata = _as_comfy_quant(sd, per_layer)
    path = str(tmp_path / "sd35_comfy_quant.safetensors")
    save_file(quant_sd, path, metadata={"format": "pt", **metadata})
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = type(ref).from_config(ref.config)
    load_single_file(model, path if not per_layer else dict(quant_sd), verbose=False)
    _check_in_place(model, sd, ref, inputs)


def test_comfy_quant_metadata_file_as_a_state_dict_is_refused_naming_the_path(tmp_path):
    """A comfy_quant file whose layer configs are in its safetensors metadata, passed as a state dict (safetensors'
    load_file, which drops the metadata), was refused as "damaged or not ComfyUI's"; the error now says to pass the
    file's path, which loads."""
    from accelerate import init_empty_weights
    from safetensors.torch import load_file, save_file

    sd, ref, _, _ = _own_case("sd35")
    quant_sd, metadata = _as_comfy_quant(sd, per_layer=False)
    path = str(tmp_path / "sd35_comfy_quant.safetensors")
    save_file(quant_sd, path, metadata={"format": "pt", **metadata})
    with init_empty_weights():
        model = type(ref).from_config(ref.config)
    with pytest.raises(CheckpointFormatError, match=r"_quantization_metadata.*pass load_single_file the file's path"):
        load_single_file(model, load_file(path), verbose=False)
    load_single_file(model, path, verbose=False)


def test_comfy_quant_mixed_with_scaled_fp8_or_not_uint8_is_refused_naming_the_key():
    """A layer with both encodings' scales (`scale_weight` and `weight_scale`, as a tool that half-converted a file
    leaves) took whichever came later in the file, silently; a comfy_quant entry that is not uint8 bytes (a float or
    int16 tensor) was cast to uint8, wrapping or truncating its values into other text. Both are refused, naming the
    key, before the model changes."""
    import json

    sd, ref, _, _ = _own_case("sd35")
    quant_sd, _ = _as_comfy_quant(sd, per_layer=True)
    lay = next(k for k in quant_sd if k.endswith(".comfy_quant"))[:-len(".comfy_quant")]
    with torch.device("meta"):
        model = type(ref).from_config(ref.config)
    mixed = {**quant_sd, f"{lay}.scale_weight": quant_sd[f"{lay}.weight_scale"] * 2}
    with pytest.raises(CheckpointFormatError, match=rf"'{lay}.weight_scale'.*'{lay}.scale_weight'"):
        load_single_file(model, mixed, verbose=False)
    # 0x17b as int16: cast to uint8 it is 0x7b, "{"
    wide = torch.tensor([0x100 + b for b in json.dumps({"format": "float8_e4m3fn"}).encode()], dtype=torch.int16)
    with pytest.raises(CheckpointFormatError, match=rf"'{lay}.comfy_quant': torch.int16"):
        load_single_file(model, {**quant_sd, f"{lay}.comfy_quant": wide}, verbose=False)
    assert not any(isinstance(m, FP8Linear) for m in model.modules())


@pytest.mark.parametrize("fmt", ["nvfp4", "int8_tensorwise"])
def test_comfy_quant_layers_of_other_formats_are_refused_naming_them(fmt):
    """A comfy_quant layer that is not float8_e4m3fn (ComfyUI's NVFP4 / MXFP8 / int8 layers) is refused, naming the
    layer and its format, before the model changes."""
    import json

    sd, ref, _, _ = _own_case("sd35")
    quant_sd, _ = _as_comfy_quant(sd, per_layer=True)
    key = next(k for k in quant_sd if k.endswith(".comfy_quant"))
    quant_sd[key] = torch.tensor(list(json.dumps({"format": fmt}).encode()), dtype=torch.uint8)
    with torch.device("meta"):
        model = type(ref).from_config(ref.config)
    with pytest.raises(CheckpointFormatError, match=rf"{key[:-len('.comfy_quant')]}': ComfyUI quantization format "
                                                     rf"'{fmt}' \(1 layers neither float8_e4m3fn nor float8_e5m2\)"):
        load_single_file(model, quant_sd, verbose=False)
    assert not any(isinstance(m, FP8Linear) for m in model.modules())


@pytest.mark.parametrize("fmt", [None, "comfyui", "comfyui-quant"])
def test_merged_export_of_a_diffusers_model_to_a_comfyui_file_is_refused(flux_file, tmp_path, fmt):
    """A Flux model loaded from a ComfyUI file and trained: export_merged to a .safetensors file in ComfyUI's layouts
    (the default, as the model was loaded from one) wrote its diffusers key names with scale_weight / weight_scale
    beside them. ComfyUI's loader converts a diffusers-named file for the weights alone (comfy/model_detection.py
    convert_diffusers_mmdit keeps the keys of flux_to_diffusers' map; unet_to_diffusers for a UNet), dropping every
    scale and the marker, and runs the raw e4m3 values unscaled without an error. Refused now, naming the format and
    what ComfyUI does read, before anything is written; bf16 (diffusers names, which ComfyUI converts) is still
    written, and so is a folder in ComfyUI's layout (read by load_fp8_checkpoint, not by ComfyUI)."""
    sd, _ = flux_file
    model = _flux_model()
    load_single_file(model, dict(sd), verbose=False)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["to_q"]))
    out = tmp_path / "merged.safetensors"
    said = "format=None writes the layout the model was loaded from, comfyui" if fmt is None else f"format='{fmt}'"
    with pytest.raises(ValueError, match=rf"merged\.safetensors: {said}, for FluxTransformer2DModel, a diffusers "
                                         r"model.*drops every scale.*format='bf16'.*save_single_file_dora"):
        dorafp8.export_merged(pm, str(out), format=fmt, verbose=False)
    assert list(tmp_path.iterdir()) == []
    dorafp8.export_merged(pm, str(out), format="bf16", verbose=False)
    assert out.exists()
    assert dorafp8.export_merged(pm, str(tmp_path / "folder"), format=fmt, verbose=False).format == (fmt or "comfyui")


def test_comfy_quant_float8_e5m2_layers_load_as_their_scaled_fp8_twin():
    """ComfyUI's comfy_quant format "float8_e5m2" (its QUANT_ALGOS' TensorCoreFP8E5M2Layout: e5m2 weights, per-tensor
    weight_scale) was refused as "not float8_e4m3fn", while the same weights in the scaled_fp8 encoding load (each
    shifted into e4m3, the error stated). It loads now as that twin: the same layers, bytes and scales."""
    import json

    from accelerate import init_empty_weights

    sd, src, _ = _wan_e5m2_file()
    quant_sd, _ = _as_comfy_quant(sd, per_layer=True)
    for k in [k for k in quant_sd if k.endswith(".comfy_quant")]:
        quant_sd[k] = torch.tensor(list(json.dumps({"format": "float8_e5m2"}).encode()), dtype=torch.uint8)
    models = []
    for state_dict in (sd, quant_sd):
        with init_empty_weights():
            model = type(src).from_config(src.config)
        with pytest.warns(dorafp8.quant.QuantizationWarning, match="float8_e5m2"):
            load_single_file(model, dict(state_dict), verbose=False)
        models.append(model)
    twin, ours = (dict(m.named_modules()) for m in models)
    fp8 = [n for n, m in twin.items() if isinstance(m, FP8Linear)]
    assert fp8 and fp8 == [n for n, m in ours.items() if isinstance(m, FP8Linear)]
    for n in fp8:
        assert torch.equal(ours[n].weight.view(torch.uint8), twin[n].weight.view(torch.uint8)), n
        assert torch.equal(ours[n].scale, twin[n].scale), n


@pytest.mark.parametrize("mistake", ["single_file as a dict", "single_file as a path", "save_kohya_dora onto it"])
def test_an_adapter_written_over_the_single_file_is_refused(tmp_path, mistake):
    """save_single_file_dora(pm, path, single_file) with `path` the base model's file (single_file the same path, or
    its state dict), or
    save_kohya_dora(pm, <the base file>): the adapter replaced the base model's file, gone for good. Refused now,
    naming the file, before anything is written."""
    from accelerate import init_empty_weights
    from safetensors.torch import save_file

    sd, ref, _, _ = _own_case("sd35")
    base = tmp_path / "sd35_fp8_scaled.safetensors"
    save_file(sd, str(base))
    with init_empty_weights():
        model = type(ref).from_config(ref.config)
    load_single_file(model, str(base), verbose=False)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["to_q"]))
    before = base.read_bytes()
    with pytest.raises(FileExistsError, match=r"is the file the model was loaded from .*write to another path"):
        if mistake == "save_kohya_dora onto it":
            dorafp8.save_kohya_dora(pm, str(base))
        else:
            dorafp8.save_single_file_dora(pm, str(base), str(base) if mistake == "single_file as a path" else sd)
    assert base.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == [base.name]
    dorafp8.save_single_file_dora(pm, str(tmp_path / "dora.safetensors"), str(base))
