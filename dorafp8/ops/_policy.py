"""The argument checks, dtype, dropout and norm-clamp rules every op follows (docs/DORA_MATH.md, "Dtype policy").

The compute dtype (cdt) of the base path is autocast's, else x's. The rank dtype (rdt) of the low-rank path is
autocast's, else the adapters' own, as in PEFT: fp32 adapters on bf16 activations get an fp32 low-rank path. The weight
norm, c = m / n and every accumulation are fp32; the output and z (kept for dm) have the compute dtype."""

from __future__ import annotations

import contextlib
import numbers
from typing import Optional

import torch
from torch import Tensor

from ..backends.base import NORM_EPS, norm_divisor  # noqa: F401 (the ops' names for them, as the backends use them)
from ..quant import MICRO_KINDS, is_fp8, scale_kind

ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_REALS = (float, int)  # the exact types check_scaling_dropout takes without asking the numbers.Real ABC


def as_result(y: Tensor, shape) -> Tensor:
    """An op's fresh result `y` in `shape` as a tensor of its own, not a view (FSDP2 warns on views), without a copy:
    aten._unsafe_view, as aten's own ops reshape results (y is neither returned nor saved); y itself if it has it."""
    if y.dim() == len(shape) and y.shape == shape:  # 2-D x: no op (nor its view in the backward)
        return y
    return torch.ops.aten._unsafe_view(y, shape)


def as_rows(x: Tensor, K: int) -> Tensor:
    """x [..., K] as [M, K] (x itself if 2-D: a reshape is an op, and another in the backward)."""
    return x if x.dim() == 2 else x.reshape(-1, K)


def check_float(t, name: str, *, wider_ok: bool = False) -> None:
    """The one check of a float argument of the ops (x, lora_A, lora_B, magnitude, bias): a float32, bfloat16 or float16
    tensor (with wider_ok, any non-fp8 float too). The TypeError names the argument, and for fp8 where fp8 belongs."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype in ACT_DTYPES or (wider_ok and t.is_floating_point() and not is_fp8(t)):
        return
    why = ""
    if is_fp8(t):
        why = (f": only the frozen base weight (w8) is fp8, as float8_e4m3fn; pass {name} in one of those dtypes"
               + (" (act_quant='rowwise' makes the linear ops quantize x to e4m3 themselves; a model that casts a layer's "
                  "input to that layer's weight dtype does this: leave that layer dense, quantize_model(..., "
                  "exclude_modules=[its name]))" if name == "x" else ""))
    raise TypeError(f"{name} must be float32, bfloat16 or float16, got {t.dtype}{why}")


def check_device(ref: Tensor, **tensors) -> None:
    device = ref.device  # once: each .device read makes a new torch.device
    for name, t in tensors.items():
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device} but x is on {device}; all inputs must be on one device")


def reused_norm(n: Tensor, x: Tensor) -> Tensor:
    """A caller's precomputed weight norm as the ops save it: on x's device (checked), detached, fp32; one made under
    torch.inference_mode (an evaluation before training) is cloned, as autograd cannot save an inference tensor (never
    under torch.compile, which cannot trace is_inference(): a compiled graph makes its norm itself, norm_cache.py)."""
    check_device(x, weight_norm=n)
    if not n.is_floating_point():  # an integer "norm" would be taken as it is, truncated
        raise TypeError(f"weight_norm must be a float tensor (fp32, as dorafp8.weight_norm returns it), got {n.dtype}")
    # Always a new tensor, even for an fp32 n without history: the caller may pass the same tensor as the magnitude
    # (OneTrainer's fused path), and torch.compile refuses an autograd.Function given one tensor twice.
    n = n.detach().float()
    if torch.compiler.is_compiling() or torch.is_inference_mode_enabled() or not n.is_inference():
        return n
    return n.clone()


def check_scaling_dropout(scaling, dropout_p) -> None:
    # float and int first: an isinstance of the numbers.Real ABC costs a microsecond or two, twice a call
    if type(scaling) not in _REALS and not isinstance(scaling, numbers.Real):
        raise TypeError(f"scaling must be a real number (lora_alpha / r), got {type(scaling).__name__}")
    if (type(dropout_p) not in _REALS and not isinstance(dropout_p, numbers.Real)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")


def dropout_mask(x: Tensor, p: float) -> Tensor:
    """The keep mask of torch.nn.functional.dropout(x, p, training=True), drawing exactly the random numbers it draws,
    so that a seeded run gives PEFT's mask bit for bit (on CUDA F.dropout is native_dropout; on CPU this recipe)."""
    if x.device.type != "cpu":
        return torch.native_dropout(x, p, True)[1]
    return torch.empty_like(x).bernoulli_(1 - p) != 0


def rows(t: Tensor) -> Tensor:
    """t with unit stride in its last dim (what the kernels need; any row stride is fine)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def autocast_off(device_type: str):
    """torch.autocast(device_type, enabled=False) where autocast is on for device_type, else a no-op context: entering
    and leaving torch.autocast took 4 to 12 us on a CPU, twice a DoRA step, to turn off what was already off."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def compute_dtype(x: Tensor) -> torch.dtype:
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


def rank_dtype(x: Tensor, A: Tensor, B: Tensor) -> torch.dtype:
    """The dtype of the low-rank path: autocast's under autocast, else the adapters' (as PEFT computes it)."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    rdt = A.dtype
    if B.dtype != rdt:  # torch.promote_types only for mixed adapters: it costs a few microseconds a call
        rdt = torch.promote_types(rdt, B.dtype)
    if rdt not in ACT_DTYPES:
        raise TypeError(f"lora_A / lora_B must be float32, bfloat16 or float16, got {A.dtype} / {B.dtype}")
    return rdt


def row_scale(scale: Tensor) -> Optional[Tensor]:
    return scale if scale_kind(scale) == "row" else None


def backend_needs(scale: Tensor, act_quant: str, cdt: torch.dtype | None = None) -> frozenset:
    """What a call asks of its backend beyond W8A16 in a 16-bit compute dtype with a per-tensor or per-row scale
    (backends.FEATURES); cdt: the compute dtype of its base GEMMs (None: a call without them, the weight norm). Made
    once per (kind, act_quant, cdt): building its four frozensets took ~3 us a call."""
    key = (scale_kind(scale), act_quant, cdt)
    needs = _NEEDS.get(key)
    if needs is None:
        needs = _needs(*key)
        if not torch.compiler.is_compiling():  # no side effect in a traced (maybe checkpointed) region
            _NEEDS[key] = needs
    return needs


_NEEDS: dict[tuple, frozenset] = {}  # backend_needs' answers (a few keys a process)


def _needs(kind: str, act_quant: str, cdt) -> frozenset:
    return (frozenset({kind} if kind in ("block", *MICRO_KINDS) else ()) | frozenset({act_quant} if act_quant else ())
            | frozenset({"fp32"} if cdt == torch.float32 else ())
            | frozenset({"fp16-row"} if cdt == torch.float16 and kind == "row" else ()))


def keeps_weight(M: int, N: int, K: int) -> bool:
    """Whether a backend with KEEPS_WEIGHT keeps the forward's dequantized W [N, K] for the backward: when W is at most
    half of x [M, K] and z [M, N], which the layer saves anyway (and with which checkpointing treats it)."""
    return 2 * N * K <= M * (N + K)
