"""What tests/distributed/test_distributed.py and its worker (tests/distributed/_dist_worker.py) share: the tiny
LLaMA-style DoRA model on an fp8 base, the data, and the single-process reference run on the full batch that every
engine must reproduce."""

import hashlib
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict  # noqa: E402

import dorafp8  # noqa: E402
from dorafp8.distributed import FP8_DTYPES  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STEPS, GLOBAL_BATCH, SEQ, VOCAB = 3, 4, 12, 97
WORLD = 2
LR = 0.2  # plain SGD: every adapter tensor moves by >= 7e-4 (relative) over 3 steps, 70x the 1e-5 tolerance


def llama_config():
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                                    max_position_embeddings=64, tie_word_embeddings=False)


def build_fp8_base(seed: int = 0):
    """The base model drawn from `seed` with its TARGETS quantized (quantize_model, the reference backend)."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(llama_config()).float()
    dorafp8.quantize_model(model, TARGETS, backend="reference", verbose=False)
    assert sum(isinstance(m, dorafp8.FP8Linear) for m in model.modules()) == 14
    return model


def build_model(seed: int = 0):
    """build_fp8_base + get_peft_model(use_dora=True), every tensor drawn from `seed` (init_lora_weights=False gives
    B != 0, so that every adapter tensor gets a gradient from the first step)."""
    model = build_fp8_base(seed)
    cfg = LoraConfig(r=4, lora_alpha=8, use_dora=True, init_lora_weights=False, target_modules=TARGETS)
    return get_peft_model(model, cfg)


def build_microscaled_model(seed: int = 0):
    """build_model's model with every q_proj an MXFP8 layer and every v_proj an NVFP4 one (the kinds whose block scales
    are fp8 buffers: e8m0, e4m3), the other targets per-tensor fp8; DoRA on every target."""
    from dorafp8.quant import quantize_mxfp8, quantize_nvfp4

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(llama_config()).float()
    for layer in model.model.layers:
        attn = layer.self_attn
        for name, quantize in (("q_proj", lambda w: (*quantize_mxfp8(w), None)), ("v_proj", quantize_nvfp4)):
            lin = getattr(attn, name)
            w8, scale, g = quantize(lin.weight.detach())
            setattr(attn, name, dorafp8.FP8Linear.from_fp8(w8, scale, lin.bias.detach().clone(), backend="reference",
                                                           global_scale=g))
    dorafp8.quantize_model(model, ["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], backend="reference",
                           verbose=False)
    cfg = LoraConfig(r=4, lora_alpha=8, use_dora=True, init_lora_weights=False, target_modules=TARGETS)
    return get_peft_model(model, cfg)


def build_doc_model(seed: int = 0):
    """The model of docs/MULTI_GPU.md's train.py: every nn.Linear but lm_head quantized (quantize_model's default),
    DoRA on the attention projections only, so that the MLP projections stay plain FP8Linear layers."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(cfg)
    dorafp8.quantize_model(model, verbose=False)
    assert sum(isinstance(m, dorafp8.FP8Linear) for m in model.modules()) == 14
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, use_dora=True,
                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))


def train_doc_model_single_process():
    """The reference for the doc's mixed-precision recipe: build_doc_model, fp32, one process, the full batch, STEPS
    plain SGD steps. Returns the losses."""
    return _sgd_full_batch(build_doc_model(0))


def train_microscaled_single_process():
    """The reference for the microscaled layers under DDP: build_microscaled_model, one process, the full batch, STEPS
    plain SGD steps. Returns (losses, adapter state)."""
    pm = build_microscaled_model(0)
    return _sgd_full_batch(pm), adapter_state(pm)


def _sgd_full_batch(pm) -> list:
    """STEPS plain SGD steps of pm on the full batch of data(), in one process. Returns the losses."""
    pm.train()
    opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=LR)
    losses = []
    ids = data()
    for s in range(STEPS):
        loss = pm(input_ids=ids[s], labels=ids[s]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def build_plain_base(seed: int = 0):
    """The same base model in plain PyTorch (nn.Linear), with each target weight replaced by its fp8 round trip: what
    plain PEFT loads the saved adapter onto."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(llama_config()).float()
    for name, mod in model.named_modules():
        if name.split(".")[-1] in TARGETS:
            mod.weight.data = dorafp8.dequantize_e4m3(*dorafp8.quantize_e4m3(mod.weight.data))
    return model.eval()


def data():
    """[STEPS, GLOBAL_BATCH, SEQ] token ids; step s trains on data()[s], rank r of WORLD on rows r*2, r*2+1."""
    return torch.randint(0, VOCAB, (STEPS, GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(123))


def local_rows(batch, rank: int, world: int = WORLD):
    per = batch.shape[0] // world
    return batch[rank * per:(rank + 1) * per]


def probe_ids():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))


def adapter_state(peft_model) -> dict:
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(peft_model).items()}


def train_single_process(out_dir=None):
    """The reference: one process, the full batch, STEPS plain SGD steps. Returns (losses, adapter state, logits of
    the trained model on probe_ids()) and saves the adapter to out_dir."""
    pm = build_model(0)
    losses = _sgd_full_batch(pm)
    if out_dir is not None:
        pm.save_pretrained(out_dir)
    pm.eval()
    with torch.no_grad():
        logits = pm(input_ids=probe_ids()).logits
    return losses, adapter_state(pm), logits


def fp8_fingerprint(model) -> str:
    """sha256 of every fp8 tensor's bytes and every FP8Linear scale, in name order."""
    h = hashlib.sha256()
    for name, t in sorted(list(model.named_parameters()) + list(model.named_buffers())):
        if t.dtype in FP8_DTYPES or name.endswith("base_layer.scale"):
            h.update(name.encode())
            h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
