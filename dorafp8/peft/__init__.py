"""dorafp8 inside PEFT: DoRAFP8Linear and DoRAFP8Conv1d/2d/3d (PEFT's LoRA layers on fp8 bases), register_with_peft
and convert_peft_model.

Inside this package `peft` (absolute) is PEFT itself; dorafp8's modules are imported relatively."""

from .conv import DoRAFP8Conv1d, DoRAFP8Conv2d, DoRAFP8Conv3d
from .linear import DoRAFP8Linear, DoraFP8Variant
from .register import convert_peft_model, register_with_peft

__all__ = ["DoRAFP8Conv1d", "DoRAFP8Conv2d", "DoRAFP8Conv3d", "DoRAFP8Linear", "DoraFP8Variant", "convert_peft_model",
           "register_with_peft"]

register_with_peft()  # idempotent; dorafp8/_install.py imports this package when peft gets imported
