"""The providers: how each one builds a layer (or a model) and what a call of it runs.

A provider that cannot run here raises `Skip` with a one-line reason; run.py records it as skipped.
dorafp8 is imported lazily, so the PEFT and cuBLAS providers run even where dorafp8 cannot be imported.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from _cases import LLAMA_TARGETS, LORA_ALPHA, ModelSpec, adapter_dtype, weight_bytes, weight_storage

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class Skip(Exception):
    """This provider cannot run here; the message says why, in one line."""


def _dorafp8():
    try:
        import dorafp8
    except Exception as e:  # ImportError, or anything the package raises while importing
        raise Skip(f"dorafp8 not importable: {type(e).__name__}: {e}") from None
    return dorafp8


def _check_backend(provider: str, device: torch.device):
    d8 = _dorafp8()
    backend = provider.split("-", 1)[1]
    backends = getattr(d8, "backends", None)
    if backends is None or not hasattr(backends, "available_backends"):
        raise Skip("dorafp8.backends.available_backends missing")
    if backend not in backends.available_backends(device):
        reason = None
        if hasattr(backends, "unavailable_reason"):
            reason = backends.unavailable_reason(backend, device)
        raise Skip(f"backend {backend!r} unavailable on {device.type}: {reason or 'not in available_backends'}")
    return d8, backend


def check(provider: str, device: torch.device) -> None:
    """Raises Skip if `provider` cannot run on `device` at all (cheap; called once per provider)."""
    if provider.startswith("dorafp8-"):
        _check_backend(provider, device)
    elif provider.startswith("peft-"):
        try:
            import peft  # noqa: F401
        except ImportError as e:
            raise Skip(f"peft not installed: {e}") from None


def quantize(w: torch.Tensor):
    """fp8 e4m3 + per-tensor fp32 scale: dorafp8's own recipe when importable, else the same recipe inline."""
    try:
        import dorafp8

        return dorafp8.quantize_e4m3(w)
    except (ImportError, AttributeError):
        amax = w.detach().abs().amax().float()
        scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
        return (w.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def dequantize(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    try:
        import dorafp8

        return dorafp8.dequantize_e4m3(w8, scale, dtype=dtype)
    except (ImportError, AttributeError):
        return (w8.float() * scale).to(dtype)


class Layer:
    """One built layer. forward(x) runs with autograd on; norm() computes the DoRA weight norm (no grad)."""

    def __init__(self, forward, norm, params, weight_bytes, note="", forward_cached=None):
        self.forward = forward
        self.forward_cached = forward_cached  # forward given a precomputed weight norm (dorafp8 only)
        self.norm = norm  # None: the provider has no weight norm (plain linear)
        self.params = params  # tensors whose .grad a call fills (reset to None between calls)
        self.weight_bytes = weight_bytes
        self.note = note


class _Wrap(nn.Module):
    def __init__(self, K, N, dtype, device):
        super().__init__()
        self.proj = nn.Linear(K, N, bias=False, dtype=dtype, device=device)


def _peft_layer(K, N, r, dtype, dropout, device, fp32_adapters):
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=r, lora_alpha=LORA_ALPHA, lora_dropout=dropout, target_modules=["proj"], use_dora=True)
    model = get_peft_model(_Wrap(K, N, dtype, device), cfg, autocast_adapter_dtype=fp32_adapters)
    layer = model.base_model.model.proj
    if not type(layer).__module__.startswith("peft."):  # importing dorafp8 must not change what PEFT builds here
        raise RuntimeError(f"expected PEFT's own lora.Linear, got {type(layer).__module__}.{type(layer).__name__}")
    with torch.no_grad():  # LoRA initializes B = 0; a nonzero B makes the norm's B A term real work
        layer.lora_B["default"].weight.normal_(0, 1e-3)
    layer.train()
    return model, layer


def _peft_norm(layer, dtype):
    """Exactly the norm part of PEFT's DoraLinearLayer.forward: B A through lora_B(lora_A(eye)), then ||W + s B A||."""
    from peft.utils.integrations import dequantize_module_weight

    dora = layer.lora_magnitude_vector["default"]
    A, B = layer.lora_A["default"], layer.lora_B["default"]
    s = layer.scaling["default"]

    def norm():
        lora_weight = dora.get_lora_weight(lora_A=A, lora_B=B).to(dtype)
        weight = dequantize_module_weight(layer.get_base_layer()).to(dtype)
        return dora.get_weight_norm(weight, lora_weight.detach(), s)

    return norm


def _trainable(module):
    return [p for p in module.parameters() if p.requires_grad]


class _Fp8Storage:
    """What a user does today with an fp8 checkpoint and PEFT: keep the base weight in fp8 and dequantize it to
    the activation dtype when the layer runs. The dequantized copy is a fresh tensor each forward (autograd saves
    it for the input gradient, so it lives until backward), and the module holds no full-precision weight in
    between calls."""

    def __init__(self, base: nn.Linear, dtype):
        self.base, self.dtype = base, dtype
        self.w8, self.scale = quantize(base.weight.detach())
        del base.weight  # drop the Parameter; from here on base.weight is a plain attribute
        self.placeholder = torch.empty(0, dtype=dtype, device=self.w8.device)
        base.weight = self.placeholder

    def load(self, *args):
        self.base.weight = dequantize(self.w8, self.scale, self.dtype)

    def unload(self, *args):
        self.base.weight = self.placeholder


def build_layer(provider, K, N, r, dtype_name, dropout, device) -> Layer:
    dtype = TORCH_DTYPES[dtype_name]
    wbytes = weight_bytes(provider, K, N, r, dtype_name)
    s = LORA_ALPHA / r

    if provider == "linear-bf16":
        w = torch.randn(N, K, dtype=dtype, device=device) / math.sqrt(K)
        return Layer(lambda x: F.linear(x, w), None, [], wbytes, note=f"nn.Linear weight in {dtype_name}")

    if provider.startswith("dorafp8-"):
        d8, backend = _check_backend(provider, device)
        w = torch.randn(N, K, dtype=dtype, device=device) / math.sqrt(K)
        w8, scale = d8.quantize_e4m3(w)
        del w
        A = (torch.randn(r, K, device=device) / math.sqrt(K)).requires_grad_()
        B = (torch.randn(N, r, device=device) * 1e-3).requires_grad_()
        with torch.no_grad():
            m = d8.weight_norm(w8, scale, A, B, s, backend=backend).clone().requires_grad_()

        def forward(x):
            return d8.dora_fp8_linear(x, w8, scale, A, B, m, s, dropout_p=dropout, training=True, backend=backend)

        def norm():
            return d8.weight_norm(w8, scale, A, B, s, backend=backend)

        n_cached = norm()  # stays valid: nothing here updates A or B

        def forward_cached(x):
            return d8.dora_fp8_linear(x, w8, scale, A, B, m, s, dropout_p=dropout, training=True, backend=backend,
                                      weight_norm=n_cached)

        note = "adapters fp32 (as converted from PEFT's default)"
        if backend == "triton" and device.type == "cpu":
            note += "; Triton interpreter (TRITON_INTERPRET=1)"
        return Layer(forward, norm, [A, B, m], wbytes, note=note, forward_cached=forward_cached)

    if provider in ("peft-dora", "peft-dora-lowp", "peft-dora-fp8-dequant"):
        fp32_adapters = provider != "peft-dora-lowp"
        model, layer = _peft_layer(K, N, r, dtype, dropout, device, fp32_adapters)
        note = f"adapters {adapter_dtype(provider, dtype_name)}, base {weight_storage(provider, dtype_name)}"
        if provider == "peft-dora-fp8-dequant":
            store = _Fp8Storage(layer.get_base_layer(), dtype)
            norm_peft = _peft_norm(layer, dtype)

            def forward(x):
                store.load()
                try:
                    return layer(x)
                finally:
                    store.unload()

            def norm():
                store.load()
                try:
                    return norm_peft()
                finally:
                    store.unload()

            note += f", dequantized to {dtype_name} each forward"
            layer._bench_keepalive = (model, store)
            return Layer(forward, norm, _trainable(layer), wbytes, note=note)
        layer._bench_keepalive = model
        return Layer(layer, _peft_norm(layer, dtype), _trainable(layer), wbytes, note=note)

    raise ValueError(f"unknown provider {provider!r}")


# ---------------------------------------------------------------------------------------------------------------
# Model step: one optimizer step of a small LLaMA-style model.


class Step:
    def __init__(self, run, params, weight_bytes, note=""):
        self.run = run  # one full step: forward, loss, backward, optimizer step, zero_grad
        self.params = params
        self.weight_bytes = weight_bytes
        self.note = note


def build_step(provider, spec: ModelSpec, dtype_name, dropout, device) -> Step:
    from transformers import LlamaConfig, LlamaForCausalLM

    if provider.startswith("dorafp8-"):
        d8, backend = _check_backend(provider, device)
        if not hasattr(d8, "convert_peft_model"):
            raise Skip("dorafp8.convert_peft_model missing")
    dtype = TORCH_DTYPES[dtype_name]
    cfg = LlamaConfig(
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        vocab_size=spec.vocab,
        max_position_embeddings=max(spec.seq, 128),
        tie_word_embeddings=False,
    )
    with torch.device(device):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to(dtype)
    model.train()
    ids = torch.randint(0, spec.vocab, (1, spec.seq), device=device)
    lin_bytes = sum(weight_bytes(provider, K, N, spec.rank, dtype_name) for K, N in spec.linear_shapes())

    if provider == "linear-bf16":
        # The floor: the same frozen model, forward + input gradients only (no adapters, no optimizer).
        for p in model.parameters():
            p.requires_grad_(False)
        emb = model.get_input_embeddings()

        def run():
            h = emb(ids).detach().requires_grad_()
            model(inputs_embeds=h, labels=ids).loss.backward()

        return Step(run, [], lin_bytes, note="frozen model, input gradients only (no adapters)")

    from peft import LoraConfig, get_peft_model

    cfg_lora = LoraConfig(
        r=spec.rank, lora_alpha=LORA_ALPHA, lora_dropout=dropout, target_modules=list(LLAMA_TARGETS), use_dora=True
    )
    peft_model = get_peft_model(model, cfg_lora, autocast_adapter_dtype=provider != "peft-dora-lowp")
    note = f"adapters {adapter_dtype(provider, dtype_name)} on {', '.join(LLAMA_TARGETS)}"
    if provider.startswith("dorafp8-"):
        n = d8.convert_peft_model(peft_model, backend=backend)
        note += f"; convert_peft_model replaced {n} layers"
    elif provider == "peft-dora-fp8-dequant":
        from peft.tuners.lora import Linear as LoraLinear

        stores = []
        for mod in peft_model.modules():
            if isinstance(mod, LoraLinear):
                st = _Fp8Storage(mod.get_base_layer(), dtype)
                mod.register_forward_pre_hook(st.load)
                mod.register_forward_hook(st.unload)
                stores.append(st)
        peft_model._bench_stores = stores
        note += "; base fp8, dequantized per forward"
    params = _trainable(peft_model)
    opt = torch.optim.AdamW(params, lr=1e-5)

    def run():
        peft_model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    run.keepalive = (peft_model, opt)
    return Step(run, [], lin_bytes, note=note)
