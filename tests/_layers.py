"""How many dorafp8 fp8 layers (FP8Linear, FP8Conv1d/2d/3d) a model holds: what tests compare with the number of
layers they expect quantize_model to have swapped (it returns the model, and prints that number)."""

from dorafp8.nn import FP8WeightModule


def n_fp8(model) -> int:
    return sum(isinstance(m, FP8WeightModule) for m in model.modules())
