"""The functional ops (autograd-capable, dispatched to a backend): the DoRA and plain fp8 linear and conv, the weight
norm, and the policy every op follows. A call goes dora_fp8_linear (ops/linear.py) -> DoRAFP8Function ->
torch.ops.dorafp8.* (ops/_custom_ops.py) -> a backend module (dorafp8/backends/) -> a kernel."""

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
