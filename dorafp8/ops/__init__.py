"""The functional ops (autograd-capable): DoRA and plain fp8 linear and conv, and the weight norm. A call goes
dora_fp8_linear -> DoRAFP8Function -> torch.ops.dorafp8.* (_custom_ops.py) -> a backend (backends/) -> a kernel."""

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
