"""The backend contract: what every implementation of the DoRA-FP8 kernels computes, as a typed Protocol.

A backend is a module with the six functions of `Backend` below, plus `unavailable_reason(device)` and optionally
`SUPPORTS`. Details: docs/DORA_MATH.md, "Backends and their contract", and docs/ARCHITECTURE.md."""

from __future__ import annotations

from typing import Optional, Protocol

import torch
from torch import Tensor

# What a backend may compute beyond W8A16 with per-tensor / per-row scales, and how a refusal names it. A backend
# narrows it with `SUPPORTS`, per device with an optional `unsupported_on(device) -> {feature: why}`.
FEATURES = {
    "block": "block weight scales",
    "rowwise": "act_quant='rowwise' (W8A8)",
    "fp32": "fp32 compute (fp32 activations, no autocast)",
    "fp16-row": "fp16 compute with per-row weight scales",
    "mxfp8": "MXFP8 weights (e8m0 scales per 32)",
    "nvfp4": "NVFP4 weights (packed e2m1, e4m3 scales per 16, a global scale)",
}
# What a backend without a SUPPORTS computes: the fp8 features. The microscaled weight kinds are opt-in, so that no
# backend="auto" ever picks a kernel that does not know them (the reference computes them everywhere).
FP8_FEATURES = frozenset({"block", "rowwise", "fp32", "fp16-row"})


# What a zero weight norm is divided as: an all-zero row of W0 + s B A gets c = m / NORM_EPS (0 at DoRA's init, where
# PEFT 0.21 gives NaN). Every other norm is divided as it is (a clamp would change c for tiny rows).
NORM_EPS = 1e-12

# The test suite sets this True (tests/conftest.py, a fixture): the kernels' outputs then start as NaN, so a tile a
# kernel never writes fails its test instead of passing on whatever the memory held. Never set in a user's process.
POISON_OUTPUTS = False


def empty(shape, dtype: torch.dtype, device) -> Tensor:
    """A kernel's output buffer: torch.empty, NaN-filled under the tests (POISON_OUTPUTS)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    return out.fill_(float("nan")) if POISON_OUTPUTS else out


def norm_divisor(n: Tensor) -> Tensor:
    """n with NORM_EPS where it is 0: what every DoRA formula divides by. NaN stays NaN."""
    return torch.where(n == 0, NORM_EPS, n)


def magnitude_scale(m: Tensor, n: Tensor) -> Tensor:
    """c = m / norm_divisor(n) in fp32 [N]: the one formula every backend computes (the Triton kernels in-kernel)."""
    return m.reshape(-1).float() / norm_divisor(n.reshape(-1).float())


def matmul_rows(t: Tensor | None) -> Tensor | None:
    """t as an operand of the platform's matmul: a CPU bf16 tensor with strided rows becomes contiguous, because torch
    2.14's CPU bf16 matmul reads past each such row and multiplies that by zero (NaN there made NaN outputs)."""
    if t is None or t.device.type != "cpu" or t.dtype != torch.bfloat16 or t.is_contiguous():
        return t
    return t.contiguous()


def not_supported(backend: str, feature: str, detail: str = "", alternatives: tuple[str, ...] = ()) -> ValueError:
    """The one refusal every backend and the registry raise for a feature the backend does not compute."""
    verb = "are" if feature in ("block", "mxfp8", "nvfp4") else "is"
    alt = f"backend='auto' or {' / '.join(repr(a) for a in alternatives)}" if alternatives else "backend='auto'"
    return ValueError(f"{FEATURES[feature]}{detail} {verb} not supported by the {backend} backend; use {alt}")


class Backend(Protocol):
    """The six functions of the contract. Every backend computes exactly this."""

    def weight_norm(self, w8: Tensor, scale: Tensor, block_size: int, A: Tensor, B: Tensor, s: float) -> Tensor:
        """n[j] = || W0[j, :] + s * (B @ A)[j, :] ||_2, fp32 [N]; A, B any float dtype; never [N, K]."""

    def project(self, a: Tensor, b: Tensor, out_dtype: torch.dtype, mask: Optional[Tensor], p: float) -> Tensor:
        """a' @ b^T (u = xd A^T in the forward). a [M, K] (cdt, unit last stride), b [r, K] (rdt): [M, r] in
        out_dtype, fp32 accumulation of the exact products. a' = a, or with a dropout mask (bool [M, K]) the
        dropped-out activation a * mask / (1 - p) as PEFT forms it, computed in fp32, never materialized."""

    def project_grad(self, v: Tensor, a: Tensor, mask: Optional[Tensor], p: float, s: float,
                     out_dtype: torch.dtype) -> Tensor:
        """s * v^T @ a' (dA in the backward): v [M, r], a [M, K], a' as in project: [r, K], fp32-accumulated."""

    def forward(self, x: Tensor, w8: Tensor, scale: Tensor, block_size: int, bias: Optional[Tensor],
                m: Optional[Tensor], n: Optional[Tensor], u: Optional[Tensor], B: Optional[Tensor], s: float,
                xm: Optional[Tensor], p: float, need_z: bool, z_dtype: torch.dtype, act_quant: str
                ) -> tuple[Tensor, Optional[Tensor]]:
        """(y, z).
        m is None: plain FP8 linear, y = x W0^T + bias, z is None (n, u, B, xm are None).
        m [N] (the magnitude, any float dtype), n [N] fp32 (the weight norm, unclamped), u [M, r] rdt (= xd A^T),
        B [N, r] rdt, with c = magnitude_scale(m, n) = m / n in fp32 (NORM_EPS for n = 0):
          no dropout (xm is None): y = c * (x W0^T + s u B^T) + bias
          dropout:                 y = x W0^T + bias + (c - 1) * (xd W0^T) + c * s u B^T
        with xd W0^T = (xm W0^T) / (1 - p) in fp32, where xm = x * mask is the kept part of x, unscaled (exact in
        cdt: the 1 / (1 - p) of dropout would round xd in cdt, so it is applied to the fp32 product instead).
        z = xd W0^T + s u B^T (xd = x without dropout) in z_dtype if need_z else None. y [M, N], bias [N]: cdt."""

    def backward_pass(self, g: Tensor, z: Optional[Tensor], m: Optional[Tensor], n: Optional[Tensor],
                      srow: Optional[Tensor], B: Optional[Tensor], u: Optional[Tensor], s: float, dropout: bool,
                      need_dm: bool, need_dB: bool, need_db: bool = True
                      ) -> tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor], Optional[Tensor],
                                 Optional[Tensor], Optional[Tensor]]:
        """(gl, rs, gb, v, dm, db, dB): one pass over g [M, N] (and z) that prepares everything the backward
        needs from them, computed in fp32, with c = magnitude_scale(m, n) (m, n as in forward):
          gl: the dgrad's left operand, gl = g * f / rl in cdt with f = c * srow (no dropout) or (c - 1) * srow
              (dropout), rl = max|f| (>= tiny), so that |gl| <= |g|: it cannot overflow fp16 where g does not; srow
              is the per-row weight scale [N], or None (ones) for tensor / block scales. A backend may take a larger
              rl for its own dgrad (native's fp16: at least 1, or its per-row factor, so that gl @ W' stays no larger
              than dx); dgrad must take any rl >= max|f|.
          gb: with dropout, the operand of the plain base term: g * srow / rb with rb = max|srow| (or g itself and
              rb = 1 when srow is None); None without dropout.
          rs: fp32 [2] = (rl, rb), rb = 1 without dropout (one tensor, so that a kernel can write both and the
              caller take 0-dim views of it, with no copy).
          v  = (g * c) B                          [M, r] rdt (fp32 products)
          dm = sum_i g[i, :] * z[i, :] / norm_divisor(n)   [N] in m's dtype (None unless need_dm)
          db = sum_i g[i, :]                      [N] in g's dtype (None unless need_db: a layer without a bias)
          dB = s * c * (g^T u)                    [N, r] in B's dtype (None unless need_dB)
        the sums in fp32, each result rounded once. m is None (a plain FP8Linear): only gl, rs (f = srow; gl = g
        and rl = 1 when srow is None) and db (if need_db)."""

    def dgrad(self, gl: Tensor, rl: Tensor, w8: Tensor, scale: Tensor, block_size: int, v: Optional[Tensor],
              A: Optional[Tensor], s: float, mask: Optional[Tensor], p: float, gb: Optional[Tensor],
              rb: Optional[Tensor], act_quant: str) -> Tensor:
        """dx. With base(t, r) = r * (t @ W0') where W0' = w8 with block scales applied in fp32 per block
        (per-tensor and per-row scales are already in rl / gl):
          v is None:                  dx = base(gl, rl) * scale_t
          no dropout (mask is None):  dx = base(gl, rl) * scale_t + s v A
          dropout (mask bool [M, K]): dx = base(gb, rb) * scale_t + mask / (1 - p) * (base(gl, rl) * scale_t + s v A)
        with scale_t the per-tensor scale (1 for per-row and block scales). dx [M, K] cdt; v [M, r], A [r, K] rdt."""


CONTRACT = ("weight_norm", "project", "project_grad", "forward", "backward_pass", "dgrad")

# W8A8's quantization of x in the projection (flag QUANTS_IN_PROJECT): project(..., quant=True) -> (u, a8, sa), `a`
# quantized per row (e4m3 [M, K], fp32 [M]) in the same read as u; forward(..., x8=x8, sx=sx) takes it.
QUANT_PARAMS = {"project": ("quant",), "forward": ("x8", "sx")}
# NVFP4's global scale g, taken by a backend whose SUPPORTS has "nvfp4" (passed only with an NVFP4 weight): W0 =
# e2m1(w8) * (scale * g).
GLOBAL_SCALE_PARAMS = {"weight_norm": ("global_scale",), "forward": ("global_scale",), "dgrad": ("global_scale",)}
# The weight dequantized once a step (flag KEEPS_WEIGHT: the cuBLAS strategy): dequantize(w8, scale, block_size, dtype,
# global_scale=None) -> (W, fac), which forward / dgrad(..., weight=W, weight_fac=fac) then use (ops/_policy.py).
KEEP_WEIGHT_PARAMS = {"forward": ("weight", "weight_fac"), "dgrad": ("weight", "weight_fac")}
