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

    for emb, k_in in (("time_in", 256), ("vector_in", cfg["pooled_projection_dim"]), ("guidance_in", 256)):
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


def comfy_encode(tensors: dict, prefix: str = COMFY_PREFIX) -> dict:
    """ComfyUI's fp8_scaled encoding of a state dict: every 2-D weight e4m3 with its fp32 `scale_weight` (ComfyUI's
    per-tensor recipe), the rest as it is, the `scaled_fp8` marker, and ComfyUI's key prefix."""
    sd = {}
    for k, t in tensors.items():
        if k.endswith(".weight") and t.dim() == 2:
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
        if t.dtype == torch.float8_e4m3fn:
            t = t.float() * sd[k[:-len("weight")] + "scale_weight"]
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

# diffusers' name -> Wan's (Wan2.1's wan/modules/model.py: blocks.N.self_attn.q, ffn.0, head.head, modulation, ...),
# applied in this order to each key
_WAN_NAMES = (("condition_embedder.time_embedder.linear_", "time_embedding.L"),
              ("condition_embedder.text_embedder.linear_", "text_embedding.L"),
              ("condition_embedder.time_proj", "time_projection.1"), (".attn1.", ".self_attn."),
              (".attn2.", ".cross_attn."), (".to_q.", ".q."), (".to_k.", ".k."), (".to_v.", ".v."),
              (".to_out.0.", ".o."), (".norm2.", ".norm3."), ("ffn.net.0.proj", "ffn.0"), ("ffn.net.2", "ffn.2"),
              ("proj_out", "head.head"))


def wan_key(k: str) -> str:
    """Wan's own name of the diffusers WanTransformer3DModel key `k` (text-to-video; no image embedder)."""
    if k == "scale_shift_table":
        return "head.modulation"
    k = k.replace(".scale_shift_table", ".modulation")
    for ours, theirs in _WAN_NAMES:
        k = k.replace(ours, theirs)
    # linear_1 / linear_2 -> .0 / .2 (Wan's nn.Sequential indices)
    return k.replace("embedding.L1", "embedding.0").replace("embedding.L2", "embedding.2")


def ltx_key(k: str) -> str:
    """LTX-Video's own name of the diffusers LTXVideoTransformer3DModel key `k` (patchify_proj, adaln_single)."""
    for ours, theirs in (("proj_in", "patchify_proj"), ("time_embed", "adaln_single"), ("norm_q", "q_norm"),
                         ("norm_k", "k_norm")):
        k = k.replace(ours, theirs)
    return k
