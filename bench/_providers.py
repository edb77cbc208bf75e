"""The providers: how each one builds a layer (or a model) and what a call of it runs.

A provider that cannot run here raises `Skip` with a one-line reason; run.py records it as skipped.
dorafp8 is imported lazily, so the PEFT and cuBLAS providers run even where dorafp8 cannot be imported.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from _cases import (DORAFP8_BACKENDS, LLAMA_TARGETS, LORA_ALPHA, LORA_PROVIDERS, ModelSpec, adapter_dtype,
                    weight_bytes, weight_storage)

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
    """(dorafp8, backend, act_quant) for a dorafp8 provider, or Skip with the reason it cannot run here."""
    d8 = _dorafp8()
    backend, act_quant = DORAFP8_BACKENDS[provider]
    reason = d8.backends.unavailable_reason(backend, device)
    if reason is not None:
        raise Skip(f"backend {backend!r} unavailable on {device.type}: {reason}")
    if act_quant:
        _need_fp8_mma(device, "W8A8")
    return d8, backend, act_quant


def _need_fp8_mma(device: torch.device, what: str) -> None:
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise Skip(f"{what} needs fp8 tensor cores (sm_89 or newer), this GPU is sm_{major}{minor}")


def check(provider: str, device: torch.device) -> None:
    """Raises Skip if `provider` cannot run on `device` at all (cheap; called once per provider)."""
    if provider.startswith("dorafp8-"):
        _check_backend(provider, device)
    elif provider == "linear-fp8-rowwise":
        _check_scaled_mm(device, torch.bfloat16)
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


# ---------------------------------------------------------------------------------------------------------------
# linear-fp8-rowwise: the unfused W8A8 yardstick, torch._scaled_mm with row-wise scales.
#
# torch._scaled_mm(a, b, scale_a, scale_b, out_dtype) computes (a * scale_a) @ (b * scale_b) for e4m3 a [M, K] and
# b [K, N] with fp32 accumulation. Row-wise scaling (torch 2.5+; torch/_meta_registrations.py
# _check_scaled_mm_sizes, aten/src/ATen/native/cuda/ScaledBlas.cpp): scale_a fp32 [M, 1] and scale_b fp32 [1, N],
# both contiguous; on CUDA a must be row-major and b column-major (stride (1, K)), K and N multiples of 16. On sm_90
# with cuBLAS >= 12.9 (torch 2.9+ cu129/cu130 wheels) cuBLAS runs it with bf16, fp16 or fp32 output; with older cuBLAS
# or on sm_89 torch falls back to a CUTLASS kernel that writes bf16 only (fp16 too from torch 2.9). On CPU (torch
# 2.15) it runs too, any layout and output dtype. A combination the installed torch refuses is skipped with its error.
#
# Forward:  y  = _scaled_mm(x8, W8^T, sx [M,1], sw [1,N])          W8^T is a free view of W8 [N, K]: column-major
# Backward: dx = _scaled_mm(h8, W8,   sh [M,1], 1  [1,K])          h = g * sw (the weight's row scale runs along the
#           reduction here, so it is folded into g before g is quantized per token). The right operand W8 [N, K] must
#           be column-major, i.e. W8^T made contiguous: a transient N*K-byte copy per backward (one read + one write of
#           the weight), the same copy dorafp8's W8A8 dgrad makes. Keeping it instead would double the weight memory.
# Quantization is eager PyTorch, as in an unfused implementation: amax (one read of t), t / scale in fp32 (read t,
# write fp32), cast to e4m3 (read fp32, write fp8): ~13 bytes per element against the 3 a fused kernel moves.
#
# sm_12x (RTX 5090, RTX PRO 6000, DGX Spark): cuBLAS refuses row-wise scales there (CUBLAS_STATUS_NOT_SUPPORTED from
# cublasLtMatmulAlgoGetHeuristic, pytorch issue 192707; per-tensor scales work), so each product runs with unit
# per-tensor scales into fp32 and the row scales multiply that fp32 product eagerly before the cast to the output dtype
# (_rowwise_mm): the same math, plus one fp32 [M, N] write and read. fp32 because the unscaled e4m3 products reach
# 448^2 * K, far past fp16's range.

E4M3_MAX = 448.0


def _quant_rows(t: torch.Tensor):
    """(e4m3 [M, K], fp32 scale [M, 1]) with t ~= q * scale; scale = amax / 448 per row (1 for a zero row), the
    recipe of dorafp8's W8A8 (so both quantize x to the same bits). |t / scale| <= 448 up to fp32 rounding, far from
    464 where the e4m3fn cast would overflow to NaN, so no clamp is needed."""
    # the inf-norm in t's own dtype: one read of t, no upcast copy (a max of bf16 values is exact in bf16)
    amax = torch.linalg.vector_norm(t, float("inf"), dim=1, keepdim=True).float()
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return (t / scale).to(torch.float8_e4m3fn), scale


def rowwise_scales_supported(device: torch.device) -> bool:
    """Whether torch._scaled_mm takes row-wise scales on `device`: everywhere but sm_12x GPUs (see above)."""
    device = torch.device(device)
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 12


def _rowwise_mm(a8, b8, sa, sb, out_dtype, rowwise: bool):
    """(a8 * sa) @ (b8 * sb) in out_dtype, sa [M, 1] and sb [1, N] fp32: torch._scaled_mm with row-wise scales, or
    (rowwise False: sm_12x) with unit per-tensor scales into fp32 and the row scales applied to that product."""
    if rowwise:
        return torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=out_dtype)
    one = torch.ones(1, 1, dtype=torch.float32, device=a8.device)
    return (torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.float32) * sa * sb).to(out_dtype)


class _Fp8RowwiseLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w8, sw_row, ones_k, rowwise):
        x8, sx = _quant_rows(x)
        y = _rowwise_mm(x8, w8.t(), sx, sw_row, x.dtype, rowwise)
        ctx.save_for_backward(w8, sw_row, ones_k)
        ctx.rowwise = rowwise
        return y

    @staticmethod
    def backward(ctx, g):
        w8, sw_row, ones_k = ctx.saved_tensors
        g8, sg = _quant_rows(g * sw_row)  # fp32 [M, N]: g scaled by each output row's weight scale
        w_cm = w8.t().contiguous().t()  # [N, K] column-major: the transient transposed copy
        dx = _rowwise_mm(g8, w_cm, sg, ones_k, g.dtype, ctx.rowwise)
        return dx, None, None, None, None


class Fp8RowwiseLinear(nn.Module):
    """A frozen nn.Linear as e4m3 with one fp32 scale per output row, run by torch._scaled_mm (W8A8). rowwise: row-wise
    scales in torch._scaled_mm (default: where the device takes them, rowwise_scales_supported) or, False, applied to
    its fp32 product."""

    def __init__(self, weight: torch.Tensor, rowwise: bool | None = None):
        super().__init__()
        self.rowwise = rowwise_scales_supported(weight.device) if rowwise is None else rowwise
        w = weight.detach().float()
        amax = w.abs().amax(dim=1, keepdim=True)
        scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
        self.register_buffer("w8", (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn))
        self.register_buffer("sw_row", scale.reshape(1, -1).contiguous())  # [1, N]
        self.register_buffer("ones_k", torch.ones(1, w.shape[1], device=w.device))  # [1, K]

    def forward(self, x):
        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1 or x2.stride(0) != x2.shape[1]:
            x2 = x2.contiguous()
        y = _Fp8RowwiseLinearFn.apply(x2, self.w8, self.sw_row, self.ones_k, self.rowwise)
        return y.reshape(*x.shape[:-1], y.shape[-1])


def _check_scaled_mm(device: torch.device, dtype: torch.dtype, K: int = 32, N: int = 32) -> None:
    """Skip unless torch._scaled_mm with row-wise scales runs here with `dtype` output (and K, N fit its rules)."""
    if not hasattr(torch, "_scaled_mm"):
        raise Skip(f"torch {torch.__version__} has no torch._scaled_mm")
    _need_fp8_mma(device, "torch._scaled_mm")
    if device.type == "cuda" and (K % 16 or N % 16):
        raise Skip(f"torch._scaled_mm needs K and N divisible by 16 on CUDA, got K={K}, N={N}")
    try:
        lin = Fp8RowwiseLinear(torch.randn(32, 32, device=device))
        x = torch.randn(16, 32, dtype=dtype, device=device, requires_grad=True)
        lin(x).backward(torch.randn(16, 32, dtype=dtype, device=device))
    except Exception as e:  # RuntimeError / ValueError from torch's checks
        msg = str(e).strip().splitlines()
        how = "row-wise" if rowwise_scales_supported(device) else "per-tensor (this GPU refuses row-wise scales)"
        raise Skip(f"torch._scaled_mm {how}, {dtype} output, refused on {_device_name(device)}: "
                   f"{type(e).__name__}: {msg[0][:200] if msg else ''}") from None


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (sm_{major}{minor})"


def _rowwise_note(device: torch.device) -> str:
    return "" if rowwise_scales_supported(device) else " (sm_12x: per-tensor _scaled_mm into fp32, row scales after)"


class _Fp8DequantLinear(nn.Module):
    """A frozen Linear kept in fp8 (per-tensor scale) and dequantized to `dtype` for each call: a user's own fp8
    layer in front of cuBLAS."""

    def __init__(self, weight: torch.Tensor, dtype):
        super().__init__()
        w8, scale = quantize(weight.detach())
        self.register_buffer("w8", w8)
        self.register_buffer("scale", scale)
        self.dtype = dtype

    def forward(self, x):
        return F.linear(x, dequantize(self.w8, self.scale, self.dtype))


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


def _peft_layer(K, N, r, dtype, dropout, device, fp32_adapters, use_dora=True, fp8=None):
    """PEFT's LoRA layer (DoRA with use_dora) on a Linear(K, N) in `dtype`; fp8=(backend, act_quant): on the layer
    dorafp8.quantize_model makes of that Linear instead (dorafp8's layer, built by PEFT)."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=r, lora_alpha=LORA_ALPHA, lora_dropout=dropout, target_modules=["proj"], use_dora=use_dora)
    base = _Wrap(K, N, dtype, device)
    if fp8 is not None:
        _dorafp8().quantize_model(base, ["proj"], backend=fp8[0], act_quant=fp8[1])
    model = get_peft_model(base, cfg, autocast_adapter_dtype=fp32_adapters)
    layer = model.base_model.model.proj
    want = "dorafp8." if fp8 is not None else "peft."  # importing dorafp8 must not change what PEFT builds on nn.Linear
    if not type(layer).__module__.startswith(want):
        raise RuntimeError(f"expected a {want}* layer, got {type(layer).__module__}.{type(layer).__name__}")
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

    if provider == "linear-fp8-dequant":
        lin = _Fp8DequantLinear(torch.randn(N, K, dtype=dtype, device=device) / math.sqrt(K), dtype)
        return Layer(lin, None, [], wbytes,
                     note=f"fp8 weight dequantized to {dtype_name} every call, F.linear (cuBLAS); autograd keeps "
                          "the dequantized copy for the input gradient")

    if provider in LORA_PROVIDERS:
        fp8 = None
        if provider != "peft-lora":
            _, backend, act_quant = _check_backend(provider, device)
            fp8 = (backend, act_quant)
        model, layer = _peft_layer(K, N, r, dtype, dropout, device, True, use_dora=False, fp8=fp8)
        layer._bench_keepalive = model
        note = "plain LoRA, adapters fp32, base " + (f"{dtype_name} (PEFT)" if fp8 is None else
                                                      f"fp8 (dorafp8, backend {fp8[0]!r}"
                                                      + (f", act_quant={fp8[1]!r})" if fp8[1] else ")"))
        if fp8 is not None and fp8[0] in ("triton", "cublas") and device.type == "cpu":
            note += "; Triton interpreter (TRITON_INTERPRET=1)"
        return Layer(layer, None, _trainable(layer), wbytes, note=note)

    if provider == "linear-fp8-rowwise":
        _check_scaled_mm(device, dtype, K, N)
        lin = Fp8RowwiseLinear(torch.randn(N, K, dtype=dtype, device=device) / math.sqrt(K))
        return Layer(lin, None, [], wbytes,
                     note="torch._scaled_mm, x and g e4m3 per token (eager), W e4m3 per row; dgrad copies W8^T"
                     + _rowwise_note(device))

    if provider.startswith("dorafp8-"):
        d8, backend, act_quant = _check_backend(provider, device)
        aq = {"act_quant": act_quant} if act_quant else {}
        w = torch.randn(N, K, dtype=dtype, device=device) / math.sqrt(K)
        w8, scale = d8.quantize_e4m3(w)
        del w
        A = (torch.randn(r, K, device=device) / math.sqrt(K)).requires_grad_()
        B = (torch.randn(N, r, device=device) * 1e-3).requires_grad_()
        with torch.no_grad():
            m = d8.weight_norm(w8, scale, A, B, s, backend=backend).clone().requires_grad_()

        def forward(x):
            return d8.dora_fp8_linear(x, w8, scale, A, B, m, s, dropout_p=dropout, training=True, backend=backend,
                                      **aq)

        def norm():
            return d8.weight_norm(w8, scale, A, B, s, backend=backend)

        n_cached = norm()  # stays valid: nothing here updates A or B

        def forward_cached(x):
            return d8.dora_fp8_linear(x, w8, scale, A, B, m, s, dropout_p=dropout, training=True, backend=backend,
                                      weight_norm=n_cached, **aq)

        note = "adapters fp32 (as converted from PEFT's default)"
        if act_quant:
            note += f"; act_quant={act_quant!r} (W8A8 base GEMMs)"
        if backend in ("triton", "cublas") and device.type == "cpu":
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
        d8, backend, act_quant = _check_backend(provider, device)
        if not hasattr(d8, "convert_peft_model"):
            raise Skip("dorafp8.convert_peft_model missing")
        if act_quant and not hasattr(d8, "set_act_quant"):
            raise Skip("dorafp8.set_act_quant missing")
    if provider == "linear-fp8-rowwise":
        _check_scaled_mm(device, TORCH_DTYPES[dtype_name])
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

    if provider in ("linear-bf16", "linear-fp8-rowwise", "linear-fp8-dequant"):
        # The floor: the same frozen model, forward + input gradients only (no adapters, no optimizer).
        note = "frozen model, input gradients only (no adapters)"
        if provider != "linear-bf16":
            make = Fp8RowwiseLinear if provider == "linear-fp8-rowwise" else lambda w: _Fp8DequantLinear(w, dtype)
            n = 0
            for name, mod in list(model.named_modules()):
                for child, sub in list(mod.named_children()):
                    if child in LLAMA_TARGETS and isinstance(sub, nn.Linear):
                        setattr(mod, child, make(sub.weight))
                        n += 1
            note += (f"; {n} adapted linears as torch._scaled_mm row-wise fp8" + _rowwise_note(device)
                     if provider == "linear-fp8-rowwise" else f"; {n} adapted linears fp8, dequantized every call")
        for p in model.parameters():
            p.requires_grad_(False)
        emb = model.get_input_embeddings()

        def run():
            h = emb(ids).detach().requires_grad_()
            model(inputs_embeds=h, labels=ids).loss.backward()

        return Step(run, [], lin_bytes, note=note)

    from peft import LoraConfig, get_peft_model

    lora = provider in LORA_PROVIDERS
    if lora and provider != "peft-lora":  # plain LoRA on dorafp8's fp8 layers, built by PEFT
        d8.quantize_model(model, list(LLAMA_TARGETS), backend=backend, act_quant=act_quant)
    cfg_lora = LoraConfig(
        r=spec.rank, lora_alpha=LORA_ALPHA, lora_dropout=dropout, target_modules=list(LLAMA_TARGETS),
        use_dora=not lora
    )
    peft_model = get_peft_model(model, cfg_lora, autocast_adapter_dtype=provider != "peft-dora-lowp")
    note = f"adapters {adapter_dtype(provider, dtype_name)} on {', '.join(LLAMA_TARGETS)}" + (
        "; plain LoRA" + ("" if provider == "peft-lora" else f" on quantize_model's fp8 layers ({backend})")
        if lora else "")
    if provider.startswith("dorafp8-") and not lora:
        n = d8.convert_peft_model(peft_model, backend=backend)
        note += f"; convert_peft_model replaced {n} layers"
        if act_quant:
            d8.set_act_quant(peft_model, act_quant)
            note += f"; act_quant={act_quant!r}"
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
