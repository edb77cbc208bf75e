"""Single files in the original authors' layouts, encoded as ComfyUI's fp8_scaled files (issue 53).

The key names and shapes are each family's own (Flux: Black Forest Labs' `flux/model.py`, the keys diffusers'
convert_flux_transformer_checkpoint_to_diffusers reads); the tests check them by running diffusers' own converter on
the dequantized file and loading the result into the diffusers model with strict=True. diffusers' Flux conversion
hard-codes the 3072 width (the split of the single blocks' fused linear1), so the Flux file is full width with one
double and one single block.
"""

import torch

from tests.checkpoint._ckpt_fixtures import _comfy_quantize

COMFY_PREFIX = "model.diffusion_model."
FLUX_WIDTH = 3072


def flux_config():
    """A FluxTransformer2DModel config at Flux.1's width (24 heads of 128) with one double and one single block."""
    return dict(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=16, pooled_projection_dim=16, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))


def flux_bfl_shapes(cfg) -> dict:
    """key -> shape of a Flux.1 checkpoint in BFL's layout for the FluxTransformer2DModel config `cfg`."""
    d, head, mlp = FLUX_WIDTH, cfg["attention_head_dim"], 4 * FLUX_WIDTH
    shapes = {}

    def lin(name, n, k):
        shapes[f"{name}.weight"], shapes[f"{name}.bias"] = (n, k), (n,)

    def qk_norm(prefix):
        shapes[f"{prefix}.query_norm.scale"] = shapes[f"{prefix}.key_norm.scale"] = (head,)

    embedders = (("time_in", 256), ("vector_in", cfg["pooled_projection_dim"])) + \
        ((("guidance_in", 256),) if cfg.get("guidance_embeds") else ())  # schnell has none
    for emb, k_in in embedders:
        lin(f"{emb}.in_layer", d, k_in)
        lin(f"{emb}.out_layer", d, d)
    lin("txt_in", d, cfg["joint_attention_dim"])
    lin("img_in", d, cfg["in_channels"])
    for i in range(cfg["num_layers"]):
        for side in ("img", "txt"):
            b = f"double_blocks.{i}.{side}"
            lin(f"{b}_mod.lin", 6 * d, d)
            lin(f"{b}_attn.qkv", 3 * d, d)
            qk_norm(f"{b}_attn.norm")
            lin(f"{b}_attn.proj", d, d)
            lin(f"{b}_mlp.0", mlp, d)
            lin(f"{b}_mlp.2", d, mlp)
    for i in range(cfg["num_single_layers"]):
        b = f"single_blocks.{i}"
        lin(f"{b}.modulation.lin", 3 * d, d)
        lin(f"{b}.linear1", 3 * d + mlp, d)
        qk_norm(f"{b}.norm")
        lin(f"{b}.linear2", d, d + mlp)
    lin("final_layer.linear", cfg["in_channels"], d)
    lin("final_layer.adaLN_modulation.1", 2 * d, d)
    return shapes


def random_tensors(shapes: dict, seed: int = 0) -> dict:
    """fp32 values for `shapes`: weights ~ N(0, 1/fan_in) (each a little different in range, so that per-tensor
    scales differ), biases small, norm scales near 1."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, (k, shape) in enumerate(shapes.items()):
        t = torch.randn(shape, generator=g)
        if len(shape) >= 2:
            t = t * (1.0 + 0.1 * (i % 7)) / shape[1] ** 0.5
        elif k.endswith(".scale"):
            t = 1.0 + 0.1 * t
        else:
            t = 0.02 * t
        out[k] = t
    return out


def comfy_encode(tensors: dict, prefix: str = COMFY_PREFIX, scale_shape: str = "tensor") -> dict:
    """ComfyUI's fp8_scaled encoding of a state dict: every 2-D weight e4m3 with its fp32 `scale_weight` (ComfyUI's
    per-tensor recipe; or scale_shape "[out]" / "[out, 1]": one amax / 448 per row, as some converters write), the
    rest as it is, the `scaled_fp8` marker, and ComfyUI's key prefix."""
    sd = {}
    for k, t in tensors.items():
        if k.endswith(".weight") and t.dim() == 2 and scale_shape != "tensor":
            scale = t.abs().amax(1, keepdim=True).float() / torch.finfo(torch.float8_e4m3fn).max
            sd[prefix + k] = (t / scale).to(torch.float8_e4m3fn)
            sd[prefix + k[:-len("weight")] + "scale_weight"] = scale if scale_shape == "[out, 1]" else scale[:, 0]
        elif k.endswith(".weight") and t.dim() == 2:
            sd[prefix + k], sd[prefix + k[:-len("weight")] + "scale_weight"] = _comfy_quantize(t)
        else:
            sd[prefix + k] = t
    sd[prefix + "scaled_fp8"] = torch.tensor([], dtype=torch.float8_e4m3fn)
    return sd


def dequantize(sd: dict, prefix: str = COMFY_PREFIX) -> dict:
    """The dense state dict a ComfyUI fp8_scaled file stands for (scale * e4m3, in fp32), prefix removed."""
    out = {}
    for k, t in sd.items():
        if k.endswith(("scale_weight", "scaled_fp8")):
            continue
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            scale = sd[k[:-len("weight")] + "scale_weight"]
            t = t.float() * (scale.reshape(-1, 1) if scale.numel() > 1 else scale)
        out[k[len(prefix):] if k.startswith(prefix) else k] = t
    return out


# ------------------------------------------------------------------------------------- SD 1.x / SDXL, ldm layout

_LDM_RESNET = (("norm1", "in_layers.0"), ("conv1", "in_layers.2"), ("norm2", "out_layers.0"), ("conv2", "out_layers.3"),
               ("time_emb_proj", "emb_layers.1"), ("conv_shortcut", "skip_connection"))


def unet_config(sdxl: bool) -> dict:
    """A tiny UNet2DConditionModel config: SD 1.x's shape (1x1 conv proj_in / proj_out), or SDXL's (linear
    projections, the text_time added embedding)."""
    cfg = dict(sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
               down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
               up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32, attention_head_dim=8,
               norm_num_groups=32)
    if sdxl:
        cfg.update(use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=8,
                   projection_class_embeddings_input_dim=16 + 6 * 8)
    return cfg


def ldm_key(k: str, cfg: dict) -> str:
    """The ldm (CompVis / SGM) name of the diffusers UNet2DConditionModel key `k`: the layout diffusers'
    convert_ldm_unet_checkpoint reads (input_blocks / middle_block / output_blocks, in_layers / out_layers)."""
    import re

    from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING

    for table in DIFFUSERS_TO_LDM_MAPPING["unet"].values():
        if k in table:
            return table[k]
    per = cfg["layers_per_block"] + 1

    def res(rest):
        for ours, theirs in _LDM_RESNET:
            rest = rest.replace(ours, theirs)
        return rest

    m = re.fullmatch(r"(down|up|mid)_blocks?\.(?:(\d+)\.)?(resnets|attentions|downsamplers|upsamplers)\.(\d+)\.(.*)", k)
    assert m, k
    where, i, kind, j, rest = m.group(1), int(m.group(2) or 0), m.group(3), int(m.group(4)), m.group(5)
    if where == "mid":
        return f"middle_block.{2 * j if kind == 'resnets' else 1}.{res(rest) if kind == 'resnets' else rest}"
    if where == "down":
        n = 1 + i * per + j
        if kind == "downsamplers":
            return f"input_blocks.{(i + 1) * per}.0.op.{rest[len('conv.'):]}"
    else:
        n = i * per + j
        if kind == "upsamplers":
            has_attn = "CrossAttn" in cfg["up_block_types"][i]
            return f"output_blocks.{i * per + per - 1}.{2 if has_attn else 1}.{rest}"
    return f"{'input' if where == 'down' else 'output'}_blocks.{n}.{0 if kind == 'resnets' else 1}." + \
        (res(rest) if kind == "resnets" else rest)


# ---------------------------------------------------------------------------------------- Wan 2.1 / 2.2, its layout

# diffusers' name -> Wan's (Wan2.1's wan/modules/model.py: blocks.N.self_attn.q, ffn.0, head.head, modulation, ...;
# i2v: MLPProj img_emb.proj = LayerNorm, Linear, GELU, Linear, LayerNorm and WanI2VCrossAttention's k_img, v_img,
# norm_k_img), applied in this order to each key
_WAN_NAMES = (("condition_embedder.image_embedder.norm1", "img_emb.proj.0"),
              ("condition_embedder.image_embedder.ff.net.0.proj", "img_emb.proj.1"),
              ("condition_embedder.image_embedder.ff.net.2", "img_emb.proj.3"),
              ("condition_embedder.image_embedder.norm2", "img_emb.proj.4"),
              ("condition_embedder.image_embedder.pos_embed", "img_emb.emb_pos"), (".add_k_proj.", ".k_img."),
              (".add_v_proj.", ".v_img."), (".norm_added_k.", ".norm_k_img."),
              ("condition_embedder.time_embedder.linear_", "time_embedding.L"),
              ("condition_embedder.text_embedder.linear_", "text_embedding.L"),
              ("condition_embedder.time_proj", "time_projection.1"), (".attn1.", ".self_attn."),
              (".attn2.", ".cross_attn."), (".to_q.", ".q."), (".to_k.", ".k."), (".to_v.", ".v."),
              (".to_out.0.", ".o."), (".norm2.", ".norm3."), ("ffn.net.0.proj", "ffn.0"), ("ffn.net.2", "ffn.2"),
              ("proj_out", "head.head"))


def wan_key(k: str) -> str:
    """Wan's own name of the diffusers WanTransformer3DModel key `k` (Wan 2.1 / 2.2, t2v, i2v and ti2v)."""
    if k == "scale_shift_table":
        return "head.modulation"
    k = k.replace(".scale_shift_table", ".modulation")
    for ours, theirs in _WAN_NAMES:
        k = k.replace(ours, theirs)
    # linear_1 / linear_2 -> .0 / .2 (Wan's nn.Sequential indices)
    return k.replace("embedding.L1", "embedding.0").replace("embedding.L2", "embedding.2")


def wan_model(variant: str):
    """A tiny WanTransformer3DModel of a Wan variant and its inputs: "wan21_i2v" (Wan 2.1 i2v / FLF2V: the image
    embedder img_emb and the cross-attention's k_img / v_img, image latents and a mask as extra input channels;
    diffusers' attention takes the last 512 context tokens as text), "wan22_i2v" (Wan 2.2 i2v A14B: the extra input
    channels, no image embedder), "wan22_ti2v" (Wan 2.2 TI2V 5B: as many output channels as input ones, one
    timestep per token)."""
    from diffusers import WanTransformer3DModel

    from tests.integration._tiny_diffusers import _randn

    cfg = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=9, out_channels=4,
               text_dim=16, freq_dim=16, ffn_dim=32, num_layers=1, rope_max_seq_len=32)
    inputs = dict(hidden_states=_randn(1, 9, 2, 4, 4), timestep=torch.tensor([500]),
                  encoder_hidden_states=_randn(1, 5, 16))
    if variant == "wan21_i2v":
        cfg.update(image_dim=8, added_kv_proj_dim=16)
        inputs.update(encoder_hidden_states=_randn(1, 512, 16), encoder_hidden_states_image=_randn(1, 3, 8, seed=2))
    elif variant == "wan22_ti2v":
        cfg.update(in_channels=12, out_channels=12)
        inputs.update(hidden_states=_randn(1, 12, 2, 4, 4), timestep=torch.linspace(0, 900, 8).round()[None])
    else:
        assert variant == "wan22_i2v", variant
    torch.manual_seed(0)
    return WanTransformer3DModel(**cfg).eval(), inputs


def ltx_key(k: str) -> str:
    """LTX-Video's own name of the diffusers LTXVideoTransformer3DModel key `k` (patchify_proj, adaln_single)."""
    for ours, theirs in (("proj_in", "patchify_proj"), ("time_embed", "adaln_single"), ("norm_q", "q_norm"),
                         ("norm_k", "k_norm")):
        k = k.replace(ours, theirs)
    return k


# ------------------------------------------------------------------------ SD3.5 (MMDiT) and HunyuanVideo, fused qkv

def _fused_key(k: str, top: tuple, blocks: tuple) -> tuple[str, int]:
    """(original key, position among the pieces fused into it) of the diffusers key `k`: `top` and each block
    kind's table list (diffusers module, original module, position); a module not listed keeps its name."""
    import re

    for pattern, orig_prefix, table in ((r"", "", top),) + blocks:
        m = re.match(pattern, k)
        if not m or (not pattern and any(re.match(p, k) for p, _, _ in blocks)):
            continue
        rest, prefix = k[m.end():], orig_prefix.format(*m.groups())
        for ours, theirs, pos in table:
            if rest == ours or rest.startswith(ours + "."):
                return prefix + theirs + rest[len(ours):], pos
        return prefix + rest, 0
    raise AssertionError(k)


def fuse(state_dict: dict, key) -> dict:
    """`state_dict` (diffusers names) in an original layout: key(k) = the original key, or (original key, position);
    the pieces of one original key concatenated by rows in position order (q, k, v, then the MLP), the way the
    family fuses them."""
    groups: dict = {}
    for k, t in state_dict.items():
        name = key(k)
        name, pos = (name, 0) if isinstance(name, str) else name
        groups.setdefault(name, []).append((pos, t))
    return {name: torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])]) if len(parts) > 1 else parts[0][1]
            for name, parts in groups.items()}


def _qkv(ours: str, theirs: str, names=("to_q", "to_k", "to_v")) -> list:
    return [(f"{ours}{n}", theirs, i) for i, n in enumerate(names)]


# diffusers' SD3Transformer2DModel -> MMDiT's names (SD3 / SD3.5's sd3_impls mmditx.py, the keys diffusers'
# convert_sd3_transformer_checkpoint_to_diffusers reads)
_SD3_TOP = (("pos_embed.pos_embed", "pos_embed", 0), ("pos_embed.proj", "x_embedder.proj", 0),
            ("time_text_embed.timestep_embedder.linear_1", "t_embedder.mlp.0", 0),
            ("time_text_embed.timestep_embedder.linear_2", "t_embedder.mlp.2", 0),
            ("time_text_embed.text_embedder.linear_1", "y_embedder.mlp.0", 0),
            ("time_text_embed.text_embedder.linear_2", "y_embedder.mlp.2", 0), ("proj_out", "final_layer.linear", 0),
            ("norm_out.linear", "final_layer.adaLN_modulation.1", 0))
_SD3_BLOCK = tuple(
    _qkv("attn.", "x_block.attn.qkv") + _qkv("attn.", "context_block.attn.qkv", ("add_q_proj", "add_k_proj",
                                                                              "add_v_proj"))
    + _qkv("attn2.", "x_block.attn2.qkv")
    + [("attn.norm_q", "x_block.attn.ln_q", 0), ("attn.norm_k", "x_block.attn.ln_k", 0),
       ("attn.norm_added_q", "context_block.attn.ln_q", 0), ("attn.norm_added_k", "context_block.attn.ln_k", 0),
       ("attn2.norm_q", "x_block.attn2.ln_q", 0), ("attn2.norm_k", "x_block.attn2.ln_k", 0),
       ("attn.to_out.0", "x_block.attn.proj", 0), ("attn.to_add_out", "context_block.attn.proj", 0),
       ("attn2.to_out.0", "x_block.attn2.proj", 0), ("norm1.linear", "x_block.adaLN_modulation.1", 0),
       ("norm1_context.linear", "context_block.adaLN_modulation.1", 0), ("ff.net.0.proj", "x_block.mlp.fc1", 0),
       ("ff.net.2", "x_block.mlp.fc2", 0), ("ff_context.net.0.proj", "context_block.mlp.fc1", 0),
       ("ff_context.net.2", "context_block.mlp.fc2", 0)])


def sd3_key(k: str) -> tuple[str, int]:
    """MMDiT's (SD3 / SD3.5) name of the diffusers SD3Transformer2DModel key `k`, and its place in a fused qkv."""
    return _fused_key(k, _SD3_TOP, ((r"transformer_blocks\.(\d+)\.", "joint_blocks.{}.", _SD3_BLOCK),))


def sd35_model():
    """A tiny SD3.5 (medium's shape: RMS qk norms, a second attention in the first block) and its inputs."""
    from diffusers import SD3Transformer2DModel

    from tests.integration._tiny_diffusers import _randn

    torch.manual_seed(0)
    model = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                                  num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                                  pooled_projection_dim=16, out_channels=4, pos_embed_max_size=8,
                                  dual_attention_layers=(0,), qk_norm="rms_norm")
    inputs = dict(hidden_states=_randn(1, 4, 8, 8), encoder_hidden_states=_randn(1, 5, 16),
                  pooled_projections=_randn(1, 16), timestep=torch.tensor([500]))
    return model.eval(), inputs


# diffusers' HunyuanVideoTransformer3DModel -> HunyuanVideo's names (hyvideo/modules/models.py and token_refiner.py,
# the keys diffusers' convert_hunyuan_video_transformer_to_diffusers reads)
_HY_TOP = (("x_embedder", "img_in", 0), ("time_text_embed.timestep_embedder.linear_1", "time_in.mlp.0", 0),
           ("time_text_embed.timestep_embedder.linear_2", "time_in.mlp.2", 0),
           ("time_text_embed.guidance_embedder.linear_1", "guidance_in.mlp.0", 0),
           ("time_text_embed.guidance_embedder.linear_2", "guidance_in.mlp.2", 0),
           ("time_text_embed.text_embedder.linear_1", "vector_in.in_layer", 0),
           ("time_text_embed.text_embedder.linear_2", "vector_in.out_layer", 0),
           ("context_embedder.time_text_embed.timestep_embedder.linear_1", "txt_in.t_embedder.mlp.0", 0),
           ("context_embedder.time_text_embed.timestep_embedder.linear_2", "txt_in.t_embedder.mlp.2", 0),
           ("context_embedder.time_text_embed.text_embedder", "txt_in.c_embedder", 0),
           ("context_embedder.proj_in", "txt_in.input_embedder", 0),
           ("norm_out.linear", "final_layer.adaLN_modulation.1", 0), ("proj_out", "final_layer.linear", 0))
_HY_REFINER = tuple(_qkv("attn.", "self_attn_qkv") + [
    ("attn.to_out.0", "self_attn_proj", 0), ("ff.net.0.proj", "mlp.fc1", 0), ("ff.net.2", "mlp.fc2", 0),
    ("norm_out.linear", "adaLN_modulation.1", 0)])
_HY_DOUBLE = tuple(
    _qkv("attn.", "img_attn_qkv") + _qkv("attn.", "txt_attn_qkv", ("add_q_proj", "add_k_proj", "add_v_proj"))
    + [("norm1.linear", "img_mod.linear", 0), ("norm1_context.linear", "txt_mod.linear", 0),
       ("attn.norm_q", "img_attn_q_norm", 0), ("attn.norm_k", "img_attn_k_norm", 0),
       ("attn.norm_added_q", "txt_attn_q_norm", 0), ("attn.norm_added_k", "txt_attn_k_norm", 0),
       ("attn.to_out.0", "img_attn_proj", 0), ("attn.to_add_out", "txt_attn_proj", 0),
       ("ff.net.0.proj", "img_mlp.fc1", 0), ("ff.net.2", "img_mlp.fc2", 0),
       ("ff_context.net.0.proj", "txt_mlp.fc1", 0), ("ff_context.net.2", "txt_mlp.fc2", 0)])
_HY_SINGLE = tuple(_qkv("attn.", "linear1") + [
    ("proj_mlp", "linear1", 3), ("proj_out", "linear2", 0), ("attn.norm_q", "q_norm", 0),
    ("attn.norm_k", "k_norm", 0), ("norm.linear", "modulation.linear", 0)])


def hunyuan_key(k: str) -> tuple[str, int]:
    """HunyuanVideo's name of the diffusers HunyuanVideoTransformer3DModel key `k`, and its place in a fused
    weight (qkv; the single blocks' linear1 = q, k, v and the MLP)."""
    return _fused_key(k, _HY_TOP, (
        (r"context_embedder\.token_refiner\.refiner_blocks\.(\d+)\.", "txt_in.individual_token_refiner.blocks.{}.",
         _HY_REFINER),
        (r"transformer_blocks\.(\d+)\.", "double_blocks.{}.", _HY_DOUBLE),
        (r"single_transformer_blocks\.(\d+)\.", "single_blocks.{}.", _HY_SINGLE)))


def hunyuan_model(full_width: bool):
    """A tiny HunyuanVideo with a double block and a token refiner block and no single block (diffusers' conversion
    splits a single block's linear1 at a hard-coded 3072), or (full_width) the 3072 width (24 heads of 128) with
    one single block and nothing else; and its inputs."""
    from diffusers import HunyuanVideoTransformer3DModel

    from tests.integration._tiny_diffusers import _randn

    torch.manual_seed(0)
    width = dict(num_attention_heads=24, attention_head_dim=128, rope_axes_dim=(16, 56, 56)) if full_width else \
        dict(num_attention_heads=2, attention_head_dim=8, rope_axes_dim=(2, 2, 4))
    model = HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_layers=0 if full_width else 1, num_single_layers=1 if full_width else 0,
        num_refiner_layers=0 if full_width else 1, patch_size=1, patch_size_t=1, text_embed_dim=16,
        pooled_projection_dim=8, **width)
    inputs = dict(hidden_states=_randn(1, 4, 1, 2, 2), timestep=torch.tensor([500]),
                  encoder_hidden_states=_randn(1, 3, 16), encoder_attention_mask=torch.ones(1, 3),
                  pooled_projections=_randn(1, 8), guidance=torch.tensor([3500.0]))
    return model.eval(), inputs
