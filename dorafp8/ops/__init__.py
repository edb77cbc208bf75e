"""The functional ops (autograd-capable, dispatched to a backend): the DoRA and plain fp8 linear and conv, the weight
norm, and the policy every op follows.

Hops from the public API to a kernel:
    dora_fp8_linear (ops/linear.py: checks, dtype policy, weight norm)  ->  DoRAFP8Function (autograd: dropout mask,
    c = m / n, the final scalings of dm/dA/dB)  ->  torch.ops.dorafp8.* (ops/_custom_ops.py, opaque to torch.compile)
    ->  backend module (dorafp8/backends/: reference, native, cuda, cublas; or dorafp8.triton_kernels)  ->  kernel.
"""

from ._custom_ops import custom_op_implementation
from ._policy import NORM_EPS, compute_dtype, dropout_mask, norm_divisor, rank_dtype
from .conv import conv_weight_norm, dequantize_transient, dora_fp8_conv, fp8_conv
from .linear import DoRAFP8Function, FP8LinearFunction, dora_fp8_linear, fp8_linear, weight_norm
from ..backends.race import race_report, selftest as race_selftest
from ._race_child import main as race_check

__all__ = ["NORM_EPS", "compute_dtype", "dropout_mask", "norm_divisor", "rank_dtype",
           "custom_op_implementation", "conv_weight_norm", "dequantize_transient", "dora_fp8_conv", "fp8_conv", "DoRAFP8Function",
           "FP8LinearFunction", "dora_fp8_linear", "fp8_linear", "weight_norm", "race_report",
           "race_selftest", "race_check"]
