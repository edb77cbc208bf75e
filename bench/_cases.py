"""What the benchmark measures: the case grid, the presets, and the FLOP / byte counts of each case.

Shapes are written `KxN` = in_features x out_features, as in nn.Linear(K, N): LLaMA-3-8B's MLP up/gate
projection is 4096x14336 and its down projection 14336x4096.

The counts are the *useful* work of the DoRA math (docs/DORA_MATH.md, "Where the time goes"), the same for
every provider of a case, so TFLOP/s compares providers on equal terms: a provider that does extra work (PEFT
materializing B A and W + s B A) simply shows a lower rate. Bytes are the minimum traffic of the kernel plan:
every operand read once and every result written once per pass, the base weight counted in the provider's storage
dtype; the forward makes two passes over the weight (the norm, then the GEMM whose epilogue needs it), the
*-cachednorm forward one.
"""

from __future__ import annotations

from dataclasses import dataclass

PROVIDERS = (
    "dorafp8-triton",
    "dorafp8-cuda",
    "dorafp8-cublas",  # one layer dequantized to a transient, torch.matmul (cuBLAS), fused Triton epilogues
    "dorafp8-triton-w8a8",  # act_quant="rowwise": x and the gradient quantized per token, fp8 x fp8 base GEMMs
    "dorafp8-reference",
    "peft-dora",  # PEFT's default configuration: fp32 adapters (autocast_adapter_dtype=True)
    "peft-dora-lowp",  # PEFT with adapters in the activation dtype (bf16/fp16)
    "peft-dora-fp8-dequant",  # fp8 storage, dequantized to the activation dtype per forward, then PEFT
    "linear-bf16",  # plain nn.Linear forward + input gradient: the floor
    "linear-fp8-rowwise",  # per-token e4m3 x, per-row e4m3 W, torch._scaled_mm forward + input gradient: W8A8 floor
    "linear-fp8-dequant",  # fp8 weight dequantized to the activation dtype every call, then F.linear (cuBLAS)
    # Plain LoRA (no DoRA), the pair of "DoRA costs at most 10% more than LoRA": PEFT's on an nn.Linear in the
    # activation dtype, and dorafp8's layers on an fp8 base (quantize_model + get_peft_model(use_dora=False))
    "peft-lora",
    "dorafp8-lora-triton",
    "dorafp8-lora-triton-w8a8",
    "dorafp8-lora-reference",
)
# dorafp8 provider -> (backend, act_quant) of dorafp8.dora_fp8_linear (the LoRA ones: of the FP8Linear base)
DORAFP8_BACKENDS = {
    "dorafp8-triton": ("triton", None),
    "dorafp8-cuda": ("cuda", None),
    "dorafp8-cublas": ("cublas", None),
    "dorafp8-triton-w8a8": ("triton", "rowwise"),
    "dorafp8-reference": ("reference", None),
    "dorafp8-lora-triton": ("triton", None),
    "dorafp8-lora-triton-w8a8": ("triton", "rowwise"),
    "dorafp8-lora-reference": ("reference", None),
}
DORAFP8_PROVIDERS = tuple(p for p in PROVIDERS if p.startswith("dorafp8-"))
PEFT_PROVIDERS = ("peft-dora", "peft-dora-lowp", "peft-dora-fp8-dequant", "peft-lora")
LORA_PROVIDERS = ("peft-lora", "dorafp8-lora-triton", "dorafp8-lora-triton-w8a8", "dorafp8-lora-reference")
# The yardsticks without DoRA: no weight norm, no rank, no dropout (one record per shape, M, dtype and mode).
FLOOR_PROVIDERS = ("linear-bf16", "linear-fp8-rowwise", "linear-fp8-dequant")
# Providers whose base GEMMs multiply e4m3 by e4m3 (fp8 tensor-core rate in the roofline).
W8A8_PROVIDERS = ("dorafp8-triton-w8a8", "linear-fp8-rowwise", "dorafp8-lora-triton-w8a8")


def has_norm(provider: str) -> bool:
    """Whether a provider computes DoRA's weight norm (the "norm" mode; dorafp8's also the *-cachednorm modes)."""
    return provider not in FLOOR_PROVIDERS and provider not in LORA_PROVIDERS


def floor_provider(provider: str) -> str:
    """The floor a provider is set against in results.md: the W8A8 ones the fp8 GEMM, the others the bf16 one."""
    return "linear-fp8-rowwise" if provider in W8A8_PROVIDERS else "linear-bf16"


# *-cachednorm: the forward is given the weight norm computed earlier (dora_fp8_linear(weight_norm=...)), which is
# what every gradient-accumulation micro-batch after the first costs; dorafp8 only (PEFT recomputes it every call).
CACHED_MODES = ("fwd-cachednorm", "fwd+bwd-cachednorm")
LAYER_MODES = ("norm", "fwd", "bwd", "fwd+bwd") + CACHED_MODES
MODES = LAYER_MODES + ("step",)  # step: one optimizer step of a small LLaMA-style model


def base_mode(mode: str) -> str:
    """The mode a *-cachednorm mode is compared with in the other providers."""
    return mode[: -len("-cachednorm")] if mode.endswith("-cachednorm") else mode

DTYPES = ("bf16", "fp16", "fp32")

# lora_alpha of every adapter; scaling = alpha / r.
LORA_ALPHA = 16
# LLaMA projections the model step adapts (all of them, as DoRA recipes do).
LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

FULL = dict(
    shapes="4096x4096,4096x14336,14336x4096,3072x12288,1280x5120",
    tokens="512,2048,8192,16384",
    ranks="8,16,64,128",
    dtypes="bf16,fp16",
    dropouts="0,0.05",
    providers=",".join(PROVIDERS),
    modes=",".join(MODES),
    # Model step at real LLaMA-3-8B width, a few layers: batch 1 x seq tokens.
    model="hidden=4096,intermediate=14336,layers=2,heads=32,kv_heads=8,vocab=32000,seq=2048,rank=16",
)
# A GPU run meant to fit one 10-minute device call (not yet timed on a GPU): LLaMA-3-8B shapes, two M, two ranks.
QUICK = dict(
    FULL,
    shapes="4096x4096,4096x14336,14336x4096",
    tokens="2048,8192",
    ranks="16,64",
    dtypes="bf16",
)
# The headline grid of the GPU issue (#14). Two LLaMA-3-8B shapes (attention
# projection and MLP up/gate), a short and a long batch, r = 16, bf16, PEFT's two dropout settings, every way of
# running DoRA on an fp8 base and both floors. 156 cases (bench/run.py --preset headline --dry-run lists them).
HEADLINE = dict(
    FULL,
    shapes="4096x4096,4096x14336",
    tokens="256,8192",
    ranks="16",
    dtypes="bf16",
    dropouts="0,0.05",
    providers="dorafp8-triton,dorafp8-cuda,dorafp8-cublas,dorafp8-triton-w8a8,peft-dora,peft-dora-fp8-dequant,"
              "linear-bf16,linear-fp8-rowwise",
    modes="norm,fwd,fwd+bwd,fwd+bwd-cachednorm",
)
SMOKE = dict(
    # Tiny enough for the Triton interpreter and the fp32-accumulating reference backend on 2 CPU cores.
    # K and N are multiples of 16: torch._scaled_mm (linear-fp8-rowwise) requires it on CUDA.
    shapes="64x96",
    tokens="16,32",
    ranks="8",
    dtypes="bf16",
    dropouts="0,0.05",
    providers=",".join(PROVIDERS),
    modes=",".join(MODES),
    model="hidden=64,intermediate=128,layers=2,heads=4,kv_heads=2,vocab=256,seq=32,rank=8",
)
PRESETS = {"full": FULL, "quick": QUICK, "headline": HEADLINE, "smoke": SMOKE}  # "first" joins below


@dataclass(frozen=True)
class ModelSpec:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    seq: int
    rank: int

    @property
    def label(self) -> str:
        return f"llama-h{self.hidden}-i{self.intermediate}-L{self.layers}"

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(K, N) of every adapted linear layer in the model."""
        h, i = self.hidden, self.intermediate
        kv = h // self.heads * self.kv_heads
        per_layer = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]
        return per_layer * self.layers


def parse_model(text: str) -> ModelSpec:
    fields = dict(kv.split("=") for kv in text.split(","))
    return ModelSpec(**{k: int(v) for k, v in fields.items()})


def parse_shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for s in text.split(","):
        k, n = s.lower().split("x")
        out.append((int(k), int(n)))
    return out


def parse_list(text: str, kind=str) -> list:
    return [kind(t) for t in text.split(",") if t.strip()]


@dataclass(frozen=True)
class Case:
    """One measurement: one provider, one mode, one shape."""

    provider: str
    mode: str
    in_features: int  # K (for "step": the model's hidden size)
    out_features: int  # N (for "step": the model's intermediate size)
    tokens: int | None  # M = rows of x (None for "norm": it does not depend on M)
    rank: int
    dtype: str
    dropout: float

    @property
    def shape(self) -> str:
        return f"{self.in_features}x{self.out_features}"

    @property
    def label(self) -> str:
        m = "" if self.tokens is None else f" M={self.tokens}"
        p = f" p={self.dropout:g}" if self.dropout else ""
        return f"{self.provider} {self.mode} {self.shape}{m} r={self.rank} {self.dtype}{p}"


def dtype_bytes(name: str) -> int:
    return {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}[name]


def weight_storage(provider: str, dtype: str) -> str:
    """Dtype the provider keeps the frozen base weight in."""
    if provider.startswith("dorafp8-") or provider in ("peft-dora-fp8-dequant", "linear-fp8-rowwise",
                                                       "linear-fp8-dequant"):
        return "fp8"
    return dtype


def adapter_dtype(provider: str, dtype: str) -> str:
    """Dtype of A, B and the magnitude: PEFT's default upcasts adapters to fp32 (autocast_adapter_dtype)."""
    if provider in FLOOR_PROVIDERS:
        return "none"
    return dtype if provider == "peft-dora-lowp" else "fp32"


def work(case: Case) -> tuple[int | None, int | None]:
    """(useful FLOPs, minimum bytes) of one call of `case`, or None where not defined (the model step)."""
    split = work_split(case)
    if split is None:
        return None, None
    base, other, nbytes = split
    return base + other, nbytes


def work_split(case: Case) -> tuple[int, int, int] | None:
    """(base-GEMM FLOPs, other FLOPs, minimum bytes) of one call of `case`; None where not defined (the model step,
    a floor's norm). Base = the products with the [N, K] weight (2 M N K per direction, twice with dropout); other =
    the weight norm's B A and squares, the rank-r products and the dm reduction, which run in the adapters' dtype."""
    if case.mode == "step":
        return None
    K, N, r = case.in_features, case.out_features, case.rank
    e = dtype_bytes(case.dtype)
    wb = dtype_bytes(weight_storage(case.provider, case.dtype))
    w_bytes = N * K * wb
    if case.provider in FLOOR_PROVIDERS:
        if case.mode == "norm":
            return None
        M = case.tokens
        # x, W in, y out; then g, W in, dx out (both floors read and write activations in the activation dtype:
        # the W8A8 floor's per-token quantization is counted as if fused into the GEMM's operand load)
        fwd = (2 * M * N * K, 0, w_bytes + M * K * e + M * N * e)
        bwd = (2 * M * N * K, 0, w_bytes + M * N * e + M * K * e)
        return _combine(case.mode, fwd, bwd)

    ab = dtype_bytes(adapter_dtype(case.provider, case.dtype))
    if case.provider in LORA_PROVIDERS:  # no norm, no magnitude, no z; the base GEMM once (dropout is the adapters')
        if case.mode == "norm":
            return None
        M, adapter_bytes = case.tokens, (r * K + N * r) * ab
        fwd = (2 * M * N * K, 2 * M * r * (K + N), w_bytes + adapter_bytes + M * K * e + M * N * e)
        bwd = (2 * M * N * K, 4 * M * r * (K + N), w_bytes + adapter_bytes + M * N * e + 2 * M * K * e)
        return _combine(case.mode, fwd, bwd)
    adapter_bytes = (r * K + N * r + N) * ab
    # The norm: B A on a tile (2 N K r), then add to the scaled weight and accumulate squares (2 N K).
    norm = (0, 2 * N * K * r + 2 * N * K, w_bytes + adapter_bytes + 4 * N)
    if case.mode == "norm":
        return norm
    M = case.tokens
    n_base = 2 if case.dropout > 0 else 1  # with dropout the base GEMM runs on x and on dropout(x)
    rank_fwd = 2 * M * r * (K + N)  # x A^T, u B^T
    # x, W, A, B, m, n in; y out (and z, saved for backward's dm)
    fwd = (n_base * 2 * M * N * K, rank_fwd, w_bytes + adapter_bytes + 4 * N + M * K * e + 2 * M * N * e)
    if not case.mode.endswith("-cachednorm"):
        fwd = tuple(a + b for a, b in zip(fwd, norm))
    # dgrad only (W frozen), once per base GEMM; rank part: g c B, v A, dA, dB; dm is an [M, N] reduction.
    rank_bwd = 4 * M * r * (K + N) + 2 * M * N
    bwd = (
        n_base * 2 * M * N * K,
        rank_bwd,
        w_bytes + adapter_bytes + 2 * M * N * e + 2 * M * K * e,  # g, saved z in; x in, dx out
    )
    return _combine(case.mode, fwd, bwd)


def _combine(mode, fwd, bwd):
    mode = base_mode(mode)
    if mode == "fwd":
        return fwd
    if mode == "bwd":
        return bwd
    return tuple(a + b for a, b in zip(fwd, bwd))


# ---------------------------------------------------------------------------------------------------------------
# Roofline: the floor time of a case on a device from its FLOP and byte counts and the device's datasheet peaks.
#
# Peaks (sources and caveats in bench/README.md): dense tensor-core TFLOP/s with fp32 accumulation (no 2:4
# sparsity), fp32 non-tensor TFLOP/s (an FMA counts 2), DRAM bandwidth in GB/s (1e9 bytes/s).
PEAKS = {
    "h100-sxm": dict(name="H100 SXM5", bf16=989.4, fp16=989.4, fp8=1978.9, fp32=66.9, gbps=3350.0),
    "h200": dict(name="H200 SXM", bf16=989.4, fp16=989.4, fp8=1978.9, fp32=66.9, gbps=4800.0),
    "rtx4090": dict(name="RTX 4090", bf16=165.2, fp16=165.2, fp8=330.3, fp32=82.6, gbps=1008.0),
}


def base_rate(provider: str, dtype: str) -> str:
    """Which peak the base GEMMs run at: fp8 tensor cores for the W8A8 providers, else the activation dtype's
    (fp32 activations: no tensor cores; dorafp8 and PEFT both multiply fp32 exactly, without tf32)."""
    return "fp8" if provider in W8A8_PROVIDERS else dtype


def other_rate(provider: str, dtype: str) -> str:
    """Which peak the norm and rank-r products run at: the adapters' dtype (fp32 adapters: fp32 non-tensor)."""
    ad = adapter_dtype(provider, dtype)
    return dtype if ad == "none" else ad


def roofline(case: Case, device: str) -> tuple[float, str] | None:
    """(floor ms, binding resource) of `case` on PEAKS[device], or None where the case has no counts.

    One time per hardware resource: the tensor cores (the FLOPs at fp8/bf16/fp16 rates, summed: one unit), the fp32
    pipes (the FLOPs at the fp32 rate) and DRAM (the minimum bytes); they can overlap, so the floor is the largest."""
    split = work_split(case)
    if split is None:
        return None
    base, other, nbytes = split
    pk = PEAKS[device]
    t = {"tensor": 0.0, "fp32": 0.0}
    for flops, rate in ((base, base_rate(case.provider, case.dtype)), (other, other_rate(case.provider, case.dtype))):
        t["fp32" if rate == "fp32" else "tensor"] += flops / (pk[rate] * 1e12)
    t["memory"] = nbytes / (pk["gbps"] * 1e9)
    bound = max(t, key=t.get)
    return t[bound] * 1e3, bound


def device_slug(name: str) -> str:
    """Folder name for a device: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3" (bench/results/<slug>/)."""
    return "".join(ch if ch.isalnum() else "-" for ch in name.split("(")[0].strip()).strip("-").lower() or "device"


def peak_key(device_name: str) -> str | None:
    """The PEAKS entry of a torch device name, or None (PCIe / NVL variants have other clocks and bandwidth)."""
    n = device_name.lower()
    if any(v in n for v in ("pcie", "nvl")):
        return None
    if "h100" in n:
        return "h100-sxm"  # "NVIDIA H100 80GB HBM3": the SXM5 board
    if "h200" in n:
        return "h200"
    if "rtx 4090" in n and "4090 d" not in n:
        return "rtx4090"
    return None


def weight_bytes(provider: str, K: int, N: int, r: int, dtype: str) -> int:
    """Persistent bytes of one layer's weights: frozen base (+ fp32 scale) and trainable adapters."""
    ws = weight_storage(provider, dtype)
    # fp8 scales: one fp32 per tensor (dorafp8, PEFT fp8-dequant), one per output row (linear-fp8-rowwise)
    base = N * K * dtype_bytes(ws) + ((4 * N if provider == "linear-fp8-rowwise" else 4) if ws == "fp8" else 0)
    if provider in FLOOR_PROVIDERS:
        return base
    return base + (r * K + N * r + N * has_norm(provider)) * dtype_bytes(adapter_dtype(provider, dtype))


def layer_cases(shapes, tokens, ranks, dtypes, dropouts, providers, modes) -> list[Case]:
    """Every layer-level case, grouped so that consecutive cases share one built layer (see run.py)."""
    cases = []
    for K, N in shapes:
        for r in ranks:
            for dt in dtypes:
                for p in dropouts:
                    for prov in providers:
                        if prov in FLOOR_PROVIDERS and (p > 0 or r != ranks[0]):
                            continue  # no dropout, no rank in a plain linear: its one row per M is the floor
                        if "norm" in modes and p == 0 and has_norm(prov):
                            cases.append(Case(prov, "norm", K, N, None, r, dt, 0.0))
                        for M in tokens:
                            for mode in modes:
                                if mode in CACHED_MODES and not (prov.startswith("dorafp8-") and has_norm(prov)):
                                    continue
                                if mode != "norm":
                                    cases.append(Case(prov, mode, K, N, M, r, dt, p))
    return cases


# ---------------------------------------------------------------------------------------------------------------
# The first-contact cases: what bench/first_contact.py times on a lent GPU, after checking the results against fp64.
# One shape, LLaMA-3-8B's attention projection (N = K = 4096), r 16, bf16 activations, fp32 adapters (PEFT's default,
# and what convert_peft_model makes of it), per-tensor fp8 scale, no dropout, forward + input gradient; dorafp8's DoRA
# with the norm cached (every micro-batch after the first), the others' full call. M 8192 first (training), then 1024
# and 256 (what is left of the time); in each, by value: dorafp8 W8A16 against the cuBLAS bf16 Linear and the
# dequantize + cuBLAS Linear a user of an fp8 checkpoint would write, dorafp8's own cuBLAS strategy (what
# backend="auto" races it against), W8A8, PEFT's DoRA, then the plain LoRA pairs (PEFT's, dorafp8's on fp8).
FIRST_SHAPE, FIRST_RANK, FIRST_DTYPE = (4096, 4096), 16, "bf16"
FIRST_TOKENS = (8192, 1024, 256)
FIRST_PROVIDERS = ("dorafp8-triton", "linear-bf16", "linear-fp8-dequant", "dorafp8-cublas", "dorafp8-triton-w8a8",
                   "peft-dora", "peft-lora", "dorafp8-lora-triton", "dorafp8-lora-triton-w8a8")


def first_mode(provider: str) -> str:
    """A first-contact case's mode: dorafp8's DoRA with the norm cached, everything else its full call."""
    return "fwd+bwd-cachednorm" if provider.startswith("dorafp8-") and has_norm(provider) else "fwd+bwd"


def first_cases(shape=FIRST_SHAPE, tokens=FIRST_TOKENS, providers=FIRST_PROVIDERS, rank=FIRST_RANK,
                dtype=FIRST_DTYPE, dropout=0.0) -> list[Case]:
    K, N = shape
    return [Case(p, first_mode(p), K, N, M, rank, dtype, dropout) for M in tokens for p in providers]


FIRST_CASES = tuple(first_cases())
FIRST = dict(
    FULL,
    shapes="x".join(map(str, FIRST_SHAPE)),
    tokens=",".join(map(str, FIRST_TOKENS)),
    ranks=str(FIRST_RANK),
    dtypes=FIRST_DTYPE,
    dropouts="0",
    providers=",".join(FIRST_PROVIDERS),
    modes="fwd+bwd,fwd+bwd-cachednorm",
)
PRESETS["first"] = FIRST
# Presets that are explicit lists of layer cases rather than grids.
PRESET_CASES = {"first": FIRST_CASES}


def preset_cases(preset, shapes, tokens, ranks, dtypes, dropouts, providers, modes) -> list[Case]:
    """The layer cases of a run: an explicit preset's list (PRESET_CASES) in its order, keeping the cases whose every
    field is among the given values (so options narrow the list and never add to it); any other preset's cross
    product (layer_cases)."""
    if preset not in PRESET_CASES:
        return layer_cases(shapes, tokens, ranks, dtypes, dropouts, providers, modes)
    return [c for c in PRESET_CASES[preset]
            if (c.in_features, c.out_features) in shapes and c.tokens in tokens and c.rank in ranks
            and c.dtype in dtypes and c.dropout in dropouts and c.provider in providers and c.mode in modes]


def default_cases(preset: str) -> list[Case]:
    """The layer cases `preset` selects with its own defaults (run.py --exclude-preset drops these)."""
    g = PRESETS[preset]
    modes = [m for m in parse_list(g["modes"]) if m in LAYER_MODES]
    return preset_cases(preset, parse_shapes(g["shapes"]), parse_list(g["tokens"], int), parse_list(g["ranks"], int),
                        parse_list(g["dtypes"]), parse_list(g["dropouts"], float), parse_list(g["providers"]), modes)


def step_cases(spec: ModelSpec, dtypes, dropouts, providers) -> list[Case]:
    cases = []
    for dt in dtypes:
        for p in dropouts:
            for prov in providers:
                if prov in FLOOR_PROVIDERS and p > 0:
                    continue
                cases.append(Case(prov, "step", spec.hidden, spec.intermediate, spec.seq, spec.rank, dt, p))
    return cases
