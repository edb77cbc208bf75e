"""Tiny stand-ins for what a reader of the docs has on their machine (a model, a checkpoint directory, a batch), for
the hidden setups of the docs' code blocks (`<!-- setup: ... -->`, docs/WRITING_DOCS.md). tests/integration/
test_docs.py puts this directory on the path of every block it runs, so a setup says `from doc_fixtures import ...`.

Every model here is built from a config (nothing is downloaded), small enough that a block runs in seconds on CPU.
"""

from __future__ import annotations

import os

import torch


def tiny_llama_config(**kw):
    import transformers

    base = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
    return transformers.LlamaConfig(**{**base, **kw})


def tiny_llama(seed: int = 0, **kw):
    """A LLaMA-style causal LM (q/k/v/o, gate/up/down projections), fp32, 2 layers of width 64."""
    import transformers

    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(tiny_llama_config(**kw))


def tiny_qwen3(seed: int = 0, dtype: torch.dtype = torch.float32):
    """A Qwen3-style causal LM, 2 layers, widths that are multiples of transformers' 128-wide fp8 blocks."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=64, dtype=dtype)
    return transformers.Qwen3ForCausalLM(cfg).to(dtype)


def write_fine_grained_checkpoint(path: str) -> str:
    """A directory like a downloaded Qwen3-8B-FP8: transformers' fine-grained fp8 layout (e4m3 weights,
    `weight_scale_inv` per 128 x 128 block, `quant_method: fp8` in config.json), the other tensors in bf16 and
    `dtype: bfloat16` in config.json, as Qwen3-8B-FP8 has them; of tiny_qwen3."""
    import dorafp8

    model = tiny_qwen3(dtype=torch.bfloat16)
    dorafp8.quantize_model(model, block_size=128)
    dorafp8.save_fp8_checkpoint(model, path, format="fine-grained", verbose=False)
    return path


def write_dense_checkpoint(path: str) -> str:
    """A dense (fp32) transformers checkpoint directory of tiny_llama."""
    tiny_llama().save_pretrained(path)
    return path


def tiny_unet(seed: int = 0):
    """A diffusers UNet2DConditionModel with SD's block types (cross-attention, ResNet convs), 0.1 M parameters."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=16)


def write_diffusers_pipeline(path: str) -> str:
    """A directory like a downloaded Stable Diffusion pipeline, with the UNet (fp32) in its `unet` subfolder."""
    tiny_unet().save_pretrained(os.path.join(path, "unet"))
    return path


def _latent_batch(batch: int, g: torch.Generator):
    """(noise, noisy_latents, timesteps, encoder_hidden_states) drawn from g, in that order (both UNets' batches)."""
    noise = torch.randn(batch, 4, 8, 8, generator=g)
    noisy_latents = torch.randn(batch, 4, 8, 8, generator=g)
    timesteps = torch.randint(0, 1000, (batch,), generator=g)
    encoder_hidden_states = torch.randn(batch, 7, 32, generator=g)
    return noise, noisy_latents, timesteps, encoder_hidden_states


def unet_batch(batch: int = 2, seed: int = 0):
    """(noisy_latents, timesteps, encoder_hidden_states, noise) for tiny_unet: what a diffusion training loop has."""
    noise, noisy_latents, timesteps, encoder_hidden_states = _latent_batch(batch, torch.Generator().manual_seed(seed))
    return noisy_latents, timesteps, encoder_hidden_states, noise


def init_single_process_group() -> None:
    """torch.distributed with one process (gloo on the loopback), for a block that needs a process group but is run
    without torchrun."""
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def checkout_here() -> None:
    """The block's directory as the root of a checkout, where a reader runs `python docs/figures/measured.py ...`:
    a link to this checkout's docs/ (the script finds the rest of the checkout from its own real path)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not os.path.exists("docs"):
        os.symlink(os.path.join(root, "docs"), "docs")


SDXL_STYLE = dict(  # SDXL's block layout ("text_time" added conditioning, 1-2-2 transformer depths), shrunk
    sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64, 64), layers_per_block=2,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), transformer_layers_per_block=(1, 2, 2),
    cross_attention_dim=32, attention_head_dim=8, norm_num_groups=16, addition_embed_type="text_time",
    addition_time_embed_dim=8, projection_class_embeddings_input_dim=80, use_linear_projection=True)


def sdxl_style_unet(seed: int = 0, dtype=torch.bfloat16):
    """An SDXL-style diffusers UNet2DConditionModel (SDXL_STYLE), 3.4 M parameters, built in `dtype`."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return UNet2DConditionModel(**SDXL_STYLE)
    finally:
        torch.set_default_dtype(default)


def write_sdxl_fp8_file(path: str) -> str:
    """An fp8 UNet file in ComfyUI's scaled_fp8 encoding (e4m3 weights, an fp32 `scale_weight` per tensor, the
    `scaled_fp8` marker) under diffusers' key names, from sdxl_style_unet() quantized per tensor. Written by hand:
    dorafp8's writers refuse ComfyUI's layouts for a diffusers model, whose scales ComfyUI would drop."""
    import dorafp8
    from safetensors.torch import save_file

    unet = sdxl_style_unet()
    dorafp8.quantize_model(unet, include_conv=True)
    sd = {(k[:-len("scale")] + "scale_weight" if k.endswith(".scale") else k): v.contiguous()
          for k, v in unet.state_dict().items()}
    sd["scaled_fp8"] = torch.tensor([], dtype=torch.float8_e4m3fn)
    save_file(sd, path, metadata={"format": "pt"})
    return path


def sdxl_batch(batch: int = 2, seed: int = 0):
    """(noisy_latents, timesteps, encoder_hidden_states, added_cond_kwargs, noise) for sdxl_style_unet."""
    g = torch.Generator().manual_seed(seed)
    noise, noisy_latents, timesteps, encoder_hidden_states = _latent_batch(batch, g)
    added = {"text_embeds": torch.randn(batch, 32, generator=g), "time_ids": torch.randn(batch, 6, generator=g)}
    return noisy_latents, timesteps, encoder_hidden_states, added, noise


_WORDS = "the a cat dog sat on mat ran to home big small red blue and is was".split()


def write_trainer_checkpoint(path, seed: int = 0, dequantized: bool = False):
    """A tiny LLaMA checkpoint at `path` as trainers load it (`from_pretrained`): weights, config and a word-level
    tokenizer (built here, nothing downloaded). dequantized=True: the weights its fp8 quantization gives, dequantized
    (plain PEFT's twin of the fp8 model); returns the number of nn.Linear layers quantize_model takes."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    import dorafp8

    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>"] + _WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>", unk_token="<unk>")
    model = tiny_llama(seed, vocab_size=len(vocab), bos_token_id=1, eos_token_id=2, pad_token_id=0)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    if dequantized:
        for name in linears:
            lin = model.get_submodule(name)
            lin.weight.data = dorafp8.FP8Linear.from_float(lin).dequantize()
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return len(linears)


def write_sft_data(path, n: int = 32, seed: int = 0, alpaca: bool = False):
    """`n` short texts in `path`/train.jsonl ({"text": ...}, what TRL's sft reads); alpaca=True: LLaMA-Factory's
    layout instead, `path`/tiny.json (instruction / input / output) and `path`/dataset_info.json naming it "tiny"."""
    import json
    import random

    rnd = random.Random(seed)
    os.makedirs(path, exist_ok=True)

    def words(k):
        return " ".join(rnd.choice(_WORDS) for _ in range(k))

    if alpaca:
        with open(os.path.join(path, "tiny.json"), "w") as f:
            json.dump([{"instruction": words(5), "input": "", "output": words(6)} for _ in range(n)], f)
        with open(os.path.join(path, "dataset_info.json"), "w") as f:
            json.dump({"tiny": {"file_name": "tiny.json"}}, f)
        return
    with open(os.path.join(path, "train.jsonl"), "w") as f:
        for _ in range(n):
            f.write(json.dumps({"text": words(rnd.randint(6, 14))}) + "\n")
