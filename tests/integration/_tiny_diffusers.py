"""Tiny diffusers models of each family dorafp8 is used on (UNet2DCondition, SD3, Flux, Wan, HunyuanVideo, LTX), built
from configs on CPU in fp32, each with one batch of inputs for its forward."""

import torch


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed=1):
    return torch.randn(*shape, generator=_gen(seed))


def unet():
    from diffusers import UNet2DConditionModel
    model = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=32)
    inputs = dict(sample=_randn(1, 4, 8, 8), timestep=torch.tensor([500]), encoder_hidden_states=_randn(1, 5, 32))
    return model, inputs


def sd3():
    from diffusers import SD3Transformer2DModel
    model = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8,
                                  num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                                  pooled_projection_dim=16, out_channels=4, pos_embed_max_size=8)
    inputs = dict(hidden_states=_randn(1, 4, 8, 8), encoder_hidden_states=_randn(1, 5, 16),
                  pooled_projections=_randn(1, 16), timestep=torch.tensor([500]))
    return model, inputs


def flux():
    from diffusers import FluxTransformer2DModel
    model = FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=8,
                                   num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=16,
                                   guidance_embeds=True, axes_dims_rope=(2, 2, 4))
    inputs = dict(hidden_states=_randn(1, 6, 8), encoder_hidden_states=_randn(1, 5, 16),
                  pooled_projections=_randn(1, 16), timestep=torch.tensor([0.5]), img_ids=torch.zeros(6, 3),
                  txt_ids=torch.zeros(5, 3), guidance=torch.tensor([3.5]))
    return model, inputs


def wan():
    from diffusers import WanTransformer3DModel
    model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                  out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=1,
                                  rope_max_seq_len=32)
    inputs = dict(hidden_states=_randn(1, 4, 2, 4, 4), timestep=torch.tensor([500]),
                  encoder_hidden_states=_randn(1, 5, 16))
    return model, inputs


def hunyuan_video():
    from diffusers import HunyuanVideoTransformer3DModel
    model = HunyuanVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
                                           num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=1,
                                           patch_size_t=1, text_embed_dim=16, pooled_projection_dim=8,
                                           rope_axes_dim=(2, 2, 4))
    inputs = dict(hidden_states=_randn(1, 4, 1, 4, 4), timestep=torch.tensor([500]),
                  encoder_hidden_states=_randn(1, 5, 16), encoder_attention_mask=torch.ones(1, 5),
                  pooled_projections=_randn(1, 8), guidance=torch.tensor([3500.0]))
    return model, inputs


def ltx():
    from diffusers import LTXVideoTransformer3DModel
    model = LTXVideoTransformer3DModel(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8,
                                       cross_attention_dim=16, num_layers=1, caption_channels=16)
    inputs = dict(hidden_states=_randn(1, 16, 8), encoder_hidden_states=_randn(1, 5, 16),
                  timestep=torch.tensor([500]), encoder_attention_mask=torch.ones(1, 5), num_frames=1, height=4,
                  width=4)
    return model, inputs


FAMILIES = {"unet": unet, "sd3": sd3, "flux": flux, "wan": wan, "hunyuan_video": hunyuan_video, "ltx": ltx}


def build(family):
    """(model, inputs): the family's tiny model, seeded, in fp32 eval mode, and a batch for its forward."""
    torch.manual_seed(0)
    model, inputs = FAMILIES[family]()
    return model.float().eval(), inputs


def output(model, inputs):
    """The model's output tensor for `inputs`."""
    out = model(**inputs, return_dict=False)
    return out[0] if isinstance(out, (tuple, list)) else out
