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
    "dorafp8-reference",
    "peft-dora",  # PEFT's default configuration: fp32 adapters (autocast_adapter_dtype=True)
    "peft-dora-lowp",  # PEFT with adapters in the activation dtype (bf16/fp16)
    "peft-dora-fp8-dequant",  # fp8 storage, dequantized to the activation dtype per forward, then PEFT
    "linear-bf16",  # plain nn.Linear forward + input gradient: the floor
)
DORAFP8_PROVIDERS = tuple(p for p in PROVIDERS if p.startswith("dorafp8-"))
PEFT_PROVIDERS = ("peft-dora", "peft-dora-lowp", "peft-dora-fp8-dequant")
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
SMOKE = dict(
    # Tiny enough for the Triton interpreter and the fp32-accumulating reference backend on 2 CPU cores.
    shapes="64x96",
    tokens="16,32",
    ranks="8",
    dtypes="bf16",
    dropouts="0,0.05",
    providers=",".join(PROVIDERS),
    modes=",".join(MODES),
    model="hidden=64,intermediate=128,layers=2,heads=4,kv_heads=2,vocab=256,seq=32,rank=8",
)
PRESETS = {"full": FULL, "quick": QUICK, "smoke": SMOKE}


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
    if provider.startswith("dorafp8-") or provider == "peft-dora-fp8-dequant":
        return "fp8"
    return dtype


def adapter_dtype(provider: str, dtype: str) -> str:
    """Dtype of A, B and the magnitude: PEFT's default upcasts adapters to fp32 (autocast_adapter_dtype)."""
    if provider == "linear-bf16":
        return "none"
    return dtype if provider == "peft-dora-lowp" else "fp32"


def work(case: Case) -> tuple[int | None, int | None]:
    """(useful FLOPs, minimum bytes) of one call of `case`, or None where not defined (the model step)."""
    if case.mode == "step":
        return None, None
    K, N, r = case.in_features, case.out_features, case.rank
    e = dtype_bytes(case.dtype)
    wb = dtype_bytes(weight_storage(case.provider, case.dtype))
    w_bytes = N * K * wb
    if case.provider == "linear-bf16":
        if case.mode == "norm":
            return None, None
        M = case.tokens
        fwd = (2 * M * N * K, w_bytes + M * K * e + M * N * e)
        bwd = (2 * M * N * K, w_bytes + M * N * e + M * K * e)
        return _combine(case.mode, fwd, bwd)

    ab = dtype_bytes(adapter_dtype(case.provider, case.dtype))
    adapter_bytes = (r * K + N * r + N) * ab
    # The norm: B A on a tile (2 N K r), then add to the scaled weight and accumulate squares (2 N K).
    norm = (2 * N * K * r + 2 * N * K, w_bytes + adapter_bytes + 4 * N)
    if case.mode == "norm":
        return norm
    M = case.tokens
    n_base = 2 if case.dropout > 0 else 1  # with dropout the base GEMM runs on x and on dropout(x)
    rank_fwd = 2 * M * r * (K + N)  # x A^T, u B^T
    # x, W, A, B, m, n in; y out (and z, saved for backward's dm)
    fwd = (n_base * 2 * M * N * K + rank_fwd, w_bytes + adapter_bytes + 4 * N + M * K * e + 2 * M * N * e)
    if not case.mode.endswith("-cachednorm"):
        fwd = (fwd[0] + norm[0], fwd[1] + norm[1])
    # dgrad only (W frozen), once per base GEMM; rank part: g c B, v A, dA, dB; dm is an [M, N] reduction.
    rank_bwd = 4 * M * r * (K + N) + 2 * M * N
    bwd = (
        n_base * 2 * M * N * K + rank_bwd,
        w_bytes + adapter_bytes + 2 * M * N * e + 2 * M * K * e,  # g, saved z in; x in, dx out
    )
    return _combine(case.mode, fwd, bwd)


def _combine(mode, fwd, bwd):
    mode = base_mode(mode)
    if mode == "fwd":
        return fwd
    if mode == "bwd":
        return bwd
    return fwd[0] + bwd[0], fwd[1] + bwd[1]


def weight_bytes(provider: str, K: int, N: int, r: int, dtype: str) -> int:
    """Persistent bytes of one layer's weights: frozen base (+ fp32 scale) and trainable adapters."""
    ws = weight_storage(provider, dtype)
    base = N * K * dtype_bytes(ws) + (4 if ws == "fp8" else 0)
    if provider == "linear-bf16":
        return base
    return base + (r * K + N * r + N) * dtype_bytes(adapter_dtype(provider, dtype))


def layer_cases(shapes, tokens, ranks, dtypes, dropouts, providers, modes) -> list[Case]:
    """Every layer-level case, grouped so that consecutive cases share one built layer (see run.py)."""
    cases = []
    for K, N in shapes:
        for r in ranks:
            for dt in dtypes:
                for p in dropouts:
                    for prov in providers:
                        if prov == "linear-bf16" and (p > 0 or r != ranks[0]):
                            continue  # no dropout, no rank in a plain linear: its one row per M is the floor
                        if "norm" in modes and p == 0 and prov != "linear-bf16":
                            cases.append(Case(prov, "norm", K, N, None, r, dt, 0.0))
                        for M in tokens:
                            for mode in modes:
                                if mode in CACHED_MODES and not prov.startswith("dorafp8-"):
                                    continue
                                if mode != "norm":
                                    cases.append(Case(prov, mode, K, N, M, r, dt, p))
    return cases


def step_cases(spec: ModelSpec, dtypes, dropouts, providers) -> list[Case]:
    cases = []
    for dt in dtypes:
        for p in dropouts:
            for prov in providers:
                if prov == "linear-bf16" and p > 0:
                    continue
                cases.append(Case(prov, "step", spec.hidden, spec.intermediate, spec.seq, spec.rank, dt, p))
    return cases
