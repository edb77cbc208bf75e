"""Backend registry: which implementation of the DoRA-FP8 kernels runs.

Every backend is a module exposing the functions of the contract below plus `unavailable_reason(device) -> str | None`.
The autograd Functions in `dorafp8.ops` do the rest (dropout masks, c = m / n, the final scalings of dm, dB, dA) in
PyTorch, identically for all backends.

Names: x [M, K]; w8 [N, K] float8_e4m3fn; rank r; "cdt" = the compute dtype of the activations (fp32/bf16/fp16);
"rdt" = the rank dtype of the low-rank path (u, v, A, B; fp32/bf16/fp16, see docs/DORA_MATH.md "Dtype policy").
All accumulation is fp32.

Weight scale (`scale`, fp32, with `block` an int): W0 = scale * w8 where scale is
    []                      per tensor                                  (block ignored)
    [N]                     per output row                              (block ignored)
    [ceil(N/b), ceil(K/b)]  per b x b block, b = block: W0[j, k] = scale[j // b, k // b] * w8[j, k]
Block scales are applied per block of the reduction in fp32 (acc += scale_blk * partial), never rounded into an
operand.

act_quant: "" (W8A16: activations in cdt, exact up to cdt) or "rowwise" (W8A8: the left operand of each base GEMM is
quantized per row to e4m3 with an fp32 scale amax / 448 (1 for an all-zero row), and the base GEMM multiplies e4m3 by
e4m3 with fp32 accumulation; see docs/DORA_MATH.md).

The contract (every backend computes exactly this; the reference backend is the twin the others are tested against):

  weight_norm(w8, scale, block, A, B, s) -> n
      n[j] = || W0[j, :] + s * (B @ A)[j, :] ||_2, fp32 [N]. A [r, K] and B [N, r] in any float dtype (upcast
      in-kernel). Never materializes [N, K] in full.

  project(a, b, out_dtype, mask, p) -> a' @ b^T            (u = xd A^T in the forward)
      a [M, K] (cdt, unit last stride), b [r, K] (rdt): [M, r] in out_dtype, fp32 accumulation of the exact products.
      a' = a, or a * mask / (1 - p) computed in fp32 when a dropout mask (bool [M, K]) is given: the dropped-out
      activation as PEFT forms it (in the adapters' dtype), without materializing it.

  project_grad(v, a, mask, p) -> v^T @ a'                  (dA / s in the backward)
      v [M, r] (rdt), a [M, K] (cdt), a' as in project: fp32 [r, K].

  forward(x, w8, scale, block, bias, c, u, B, s, xm, p, need_z, z_dtype, act_quant) -> (y, z)
      c is None: plain FP8 linear, y = x W0^T + bias, z is None (u, B, xm are None).
      c [N] fp32, u [M, r] rdt (= xd A^T), B [N, r] rdt:
        no dropout (xm is None): y = c * (x W0^T + s u B^T) + bias
        dropout:                 y = x W0^T + bias + (c - 1) * (xd W0^T) + c * s u B^T
      with xd W0^T = (xm W0^T) / (1 - p) in fp32, where xm = x * mask is the kept part of x, unscaled (exact in cdt:
      the 1 / (1 - p) of dropout would round xd in cdt, so it is applied to the fp32 product instead).
      z = xd W0^T + s u B^T (xd = x without dropout) in z_dtype if need_z else None. y is [M, N] cdt; bias [N] cdt.

  backward_pass(g, z, c, srow, B, u, dropout, need_dm, need_dB) -> (gl, rl, gb, rb, v, dm, db, dB)
      One pass over g [M, N] (and z) that prepares everything the backward needs from them, in fp32:
        gl, rl: the dgrad's left operand and its scalar: gl = g * f / rl in cdt with f = c * srow (no dropout) or
                (c - 1) * srow (dropout), rl = max|f| (fp32 0-dim, >= tiny), so that |gl| <= |g|: it cannot overflow
                fp16 where g does not; srow is the per-row weight scale [N], or None (ones) for tensor/block scales.
        gb, rb: with dropout, the operand of the plain base term: g * srow / rb (or g itself and rb = 1 when srow is
                None); (None, None) without dropout.
        v  = (g * c) B                          [M, r] rdt (fp32 products)
        dm = sum_i g[i, :] * z[i, :]            [N] fp32 (None unless need_dm; the caller divides by n)
        db = sum_i g[i, :]                      [N] fp32
        dB = g^T u                              [N, r] fp32 (None unless need_dB; the caller scales by s * c)
      c is None (a plain FP8Linear): only gl, rl (f = srow; gl = g and rl = 1 when srow is None) and db.

  dgrad(gl, rl, w8, scale, block, v, A, s, mask, p, gb, rb, act_quant) -> dx
      With base(t, r) = r * (t @ W0') where W0' = w8 with block scales applied in fp32 per block (per-tensor and
      per-row scales are already in rl / gl):
        v is None:                  dx = base(gl, rl) * scale_t
        no dropout (mask is None):  dx = base(gl, rl) * scale_t + s v A
        dropout (mask bool [M, K]): dx = base(gb, rb) * scale_t + mask / (1 - p) * (base(gl, rl) * scale_t + s v A)
      with scale_t the per-tensor scale (1 for per-row and block scales). dx is [M, K] cdt; v [M, r], A [r, K] rdt.

  M >= 1 (the caller handles empty batches). x, xm, g, gl, gb have unit stride in their last dim (any row stride).

Selection: backend="auto" (or None) means $DORAFP8_BACKEND if set, else the fastest backend that can run on the
tensors' device: triton > cuda > reference on a GPU (triton first until GPU measurements say otherwise;
see bench/results/), native on CPU (dorafp8/backends/native.py: the reference with its base GEMMs in the compute
dtype; the reference itself stays the exact fp32 twin every backend is tested against). A backend asked for by name (argument or environment) that cannot run raises
with the reason; under "auto" an unavailable backend is skipped quietly. `cublas` (dequantize one layer into a
transient buffer, cuBLAS for the base GEMMs, fused epilogues) is never picked by "auto" until measured.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

BACKENDS = ("reference", "triton", "cuda", "cublas", "native")
_CHOICES = ("auto",) + BACKENDS
# Which module implements each backend (imported lazily: triton and the CUDA extension are optional).
_MODULES = {
    "reference": "dorafp8.backends.reference",
    "triton": "dorafp8.triton_kernels",
    "cuda": "dorafp8.backends.cuda",
    "cublas": "dorafp8.backends.cublas",
    "native": "dorafp8.backends.native",
}
_loaded: dict[str, ModuleType | str] = {}


def check_backend_name(name: str | None) -> str:
    """Validates a backend name (None means "auto") and returns it."""
    name = "auto" if name is None else name
    if not isinstance(name, str) or name not in _CHOICES:
        raise ValueError(f"backend must be one of {list(_CHOICES)}, got {name!r}")
    return name


def _load(name: str) -> ModuleType | str:
    """The backend's module, or a string saying why it could not be imported."""
    if name not in _loaded:
        try:
            _loaded[name] = importlib.import_module(_MODULES[name])
        except Exception as e:  # ImportError, or triton failing to initialise
            _loaded[name] = f"backend {name!r} could not be imported: {type(e).__name__}: {e}"
    return _loaded[name]


def unavailable_reason(name: str, device: torch.device) -> str | None:
    """None if backend `name` can run on tensors on `device`, else why not."""
    mod = _load(name)
    if isinstance(mod, str):
        return mod
    return mod.unavailable_reason(torch.device(device))


# What a backend computes beyond per-tensor / per-row scales in W8A16 (a module may narrow it with `SUPPORTS`):
# "block" (block scales), "w8a8" (act_quant="rowwise").
FEATURES = frozenset({"block", "w8a8"})


def supports(name: str) -> frozenset:
    mod = _load(name)
    return FEATURES if isinstance(mod, str) else frozenset(getattr(mod, "SUPPORTS", FEATURES))


def resolve(name: str | None, device: torch.device, needs: frozenset = frozenset()) -> str:
    """Resolves a backend name ("auto", None or one of BACKENDS) to the concrete backend that runs on `device`.
    Under "auto" a backend that cannot compute what the call `needs` (see FEATURES) is passed over; a backend named
    explicitly is used as named (and raises its own clear error if it cannot)."""
    name = check_backend_name(name)
    if name == "auto":
        env = os.environ.get("DORAFP8_BACKEND")
        if env:
            if env not in _CHOICES:
                raise ValueError(f"DORAFP8_BACKEND must be one of {list(_CHOICES)}, got {env!r}")
            name = env
    if name != "auto":
        reason = unavailable_reason(name, device)
        if reason is not None:
            raise RuntimeError(f"dorafp8 backend {name!r} cannot run on {device}: {reason}")
        return name
    # No GPU measurement has ranked triton against cuda yet; triton's kernels are autotuned, so it goes first.
    for cand in ("triton", "cuda"):
        if device.type == "cuda" and unavailable_reason(cand, device) is None and needs <= supports(cand):
            return cand
    # CPU: "native" (the reference with its base GEMMs in the compute dtype on the platform's matmul: as fast as
    # PEFT under bf16 autocast, where the fp32 reference is several times slower; identical in fp32). The exact fp32
    # twin stays one name away: backend="reference" / DORAFP8_BACKEND=reference. Elsewhere the reference, as before.
    return "native" if device.type == "cpu" else "reference"


def module(name: str) -> ModuleType:
    """The module implementing a concrete (already resolved) backend."""
    mod = _load(name)
    if isinstance(mod, str):
        raise RuntimeError(mod)
    return mod


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """Names of the backends that can run on `device`."""
    device = torch.device(device)
    return [b for b in BACKENDS if unavailable_reason(b, device) is None]
