"""dorafp8: DoRA (PEFT's weight-decomposed LoRA) on frozen FP8 e4m3 base weights, with fused kernels.

Public API:
    quantize_e4m3, dequantize_e4m3        the FP8 recipe (per-tensor fp32 scale; per-row optional)
    dora_fp8_linear, fp8_linear, weight_norm   functional ops (autograd-capable), dispatched to a backend
    FP8Linear, quantize_model             frozen fp8 linear layer, and swapping nn.Linear for it
    DoRAFP8Linear, convert_peft_model     PEFT integration (needs peft): the fp8 DoRA layer, and converting a
                                          PEFT DoRA model in place
    BACKENDS, available_backends          "reference" (PyTorch), "triton", "cuda"; backend="auto" picks

Dispatch: dora_fp8_linear (dorafp8/ops.py) -> DoRAFP8Function -> torch.ops.dorafp8.* -> the backend module
(dorafp8/backends.py lists them) -> the kernel.
"""

from .backends import BACKENDS, available_backends
from .distributed import install_ddp_support
from .fp8_linear import FP8Linear, quantize_model
from .ops import dora_fp8_linear, fp8_linear, weight_norm
from .quant import dequantize_e4m3, quantize_e4m3

__version__ = "0.1.0"

__all__ = [
    "BACKENDS", "available_backends", "quantize_e4m3", "dequantize_e4m3", "dora_fp8_linear", "fp8_linear",
    "weight_norm", "FP8Linear", "quantize_model", "DoRAFP8Linear", "convert_peft_model", "register_with_peft",
    "install_ddp_support",
]

install_ddp_support()  # DDP over gloo broadcasts fp8 weights as bytes (dorafp8/distributed.py); idempotent

try:  # PEFT is optional; with it installed, get_peft_model builds dorafp8 layers on FP8Linear bases.
    from .peft_integration import DoRAFP8Linear, convert_peft_model, register_with_peft
except ImportError as _e:
    _PEFT_ERROR = _e

    def __getattr__(name):
        if name in ("DoRAFP8Linear", "convert_peft_model", "register_with_peft"):
            raise ImportError(f"dorafp8.{name} needs peft (pip install 'dorafp8[peft]'): {_PEFT_ERROR}")
        raise AttributeError(f"module 'dorafp8' has no attribute {name!r}")
else:
    register_with_peft()
