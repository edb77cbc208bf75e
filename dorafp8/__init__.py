"""dorafp8: DoRA (PEFT's weight-decomposed LoRA) on frozen FP8 base weights, with fused kernels.

The public names are `__all__` below; each has its own docstring, and docs/GUIDE.md says which to use when. A call
goes dora_fp8_linear (ops/linear.py) -> torch.ops.dorafp8.* -> a backend (backends/) -> a kernel (docs/ARCHITECTURE.md).
PEFT, transformers, diffusers and LyCORIS are not imported here (they take seconds): the names that need them load on
first use, and each library learns of dorafp8's fp8 layers when it is imported (dorafp8/_install.py)."""

from . import _deps, _env, _install
from .backends import BACKENDS, available_backends
from .checkpoint import detect_format, export_merged, load_fp8_checkpoint, load_single_file, save_fp8_checkpoint
from .distributed import install_ddp_support, install_fsdp_support
from .nn import FP8Conv1d, FP8Conv2d, FP8Conv3d, FP8Linear, quantize_model, set_act_quant
from .norm_cache import reuse_weight_norms
from .ops import dora_fp8_conv, dora_fp8_linear, fp8_conv, fp8_linear, weight_norm
from .quant import dequantize_e4m3, quantize_e4m3
from .checkpoint.from_transformers import from_transformers_fp8

__version__ = "0.1.0"

_deps.warn_if_untested_torch()
if (_typo := _env.unknown()) is not None and _env.first_process():  # a misspelt switch, said rather than ignored
    import warnings

    warnings.warn(_typo, stacklevel=2)

__all__ = [
    "BACKENDS", "available_backends", "quantize_e4m3", "dequantize_e4m3", "dora_fp8_linear", "fp8_linear",
    "weight_norm", "FP8Linear", "quantize_model", "set_act_quant", "DoRAFP8Linear", "convert_peft_model",
    "register_with_peft", "install_ddp_support", "install_fsdp_support", "load_fp8_checkpoint", "save_fp8_checkpoint",
    "export_merged", "detect_format", "load_single_file", "from_transformers_fp8", "reuse_weight_norms",
    "FP8Conv1d", "FP8Conv2d", "FP8Conv3d", "dora_fp8_conv", "fp8_conv", "DoRAFP8Conv1d", "DoRAFP8Conv2d",
    "DoRAFP8Conv3d", "DoRAFP8Config", "save_kohya_dora", "load_kohya_dora", "save_single_file_dora",
    "register_with_lycoris",
]

_PEFT_NAMES = ("DoRAFP8Linear", "convert_peft_model", "register_with_peft", "DoRAFP8Conv1d", "DoRAFP8Conv2d",
               "DoRAFP8Conv3d")
_TRANSFORMERS_NAMES = ("DoRAFP8Config",)
_KOHYA_NAMES = ("save_kohya_dora", "load_kohya_dora", "save_single_file_dora")
_LYCORIS_NAMES = ("register_with_lycoris",)


def __getattr__(name):
    from ._deps import require

    if name in _PEFT_NAMES:
        require("peft", "transformers", what=f"dorafp8.{name}")
        from . import peft

        return getattr(peft, name)
    if name in _TRANSFORMERS_NAMES:
        require("transformers", what=f"dorafp8.{name}")
        from .checkpoint import hf_quantizer

        hf_quantizer.register()
        return getattr(hf_quantizer, name)
    if name in _KOHYA_NAMES:
        require("peft", "transformers", "safetensors", what=f"dorafp8.{name}")
        from .checkpoint import kohya

        return getattr(kohya, name)
    if name in _LYCORIS_NAMES:
        require("lycoris", what=f"dorafp8.{name}")
        from . import lycoris

        return getattr(lycoris, name)
    raise AttributeError(f"module 'dorafp8' has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *_PEFT_NAMES, *_TRANSFORMERS_NAMES, *_KOHYA_NAMES, *_LYCORIS_NAMES})


try:  # DORAFP8_NO_PATCHES=2 is refused here: the `dorafp8` command says so in one line, a script's import raises
    _env.flag("DORAFP8_NO_PATCHES")
except ValueError as _refused:
    _env.exit_if_command(_refused)
    raise
_install.install()  # DDP's fp8 broadcast; PEFT, transformers, diffusers, FSDP2 learn of fp8 layers (opt-out inside)
