"""dorafp8's layers: FP8Linear and FP8Conv1d/2d/3d (a frozen float8_e4m3fn weight with an fp32 scale, computing through
dorafp8.ops), and turning a model's layers into them (quantize_model, set_act_quant)."""

from ._base import FP8WeightModule, params_are_sharded, recover_fp8_weight, refuse_sharded_base, refuse_sharded_model, scales_e8m0_as_bytes
from .conv import FP8Conv1d, FP8Conv2d, FP8Conv3d, FP8ConvNd, fp8_conv_class
from .convert import is_fp8_cast_layer, quantize_model, set_act_quant, to_fp8_layer
from .linear import FP8Linear

__all__ = ["FP8WeightModule", "FP8Conv1d", "FP8Conv2d", "FP8Conv3d", "FP8ConvNd", "fp8_conv_class", "FP8Linear",
           "is_fp8_cast_layer", "quantize_model", "set_act_quant", "to_fp8_layer", "params_are_sharded",
           "recover_fp8_weight", "refuse_sharded_base", "refuse_sharded_model", "scales_e8m0_as_bytes"]
