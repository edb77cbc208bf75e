"""dorafp8: DoRA (PEFT's weight-decomposed LoRA) on frozen FP8 e4m3 base weights, with fused kernels.

Public API:
    quantize_e4m3, dequantize_e4m3        the FP8 recipe (per-tensor fp32 scale; per-row optional)
    dora_fp8_linear, fp8_linear, weight_norm   functional ops (autograd-capable), dispatched to a backend
    FP8Linear, quantize_model             frozen fp8 linear layer, and swapping nn.Linear (and, with
                                          include_conv=True or named targets, nn.ConvNd) for it
    FP8Conv1d, FP8Conv2d, FP8Conv3d       frozen fp8 convolutions (dorafp8/nn/conv.py); dora_fp8_conv, fp8_conv
    DoRAFP8Conv2d (1d, 3d)                PEFT's DoRA conv layer on them (needs peft; loaded on first use)
    set_act_quant                         switch a model's fp8 layers between W8A16 (default) and W8A8 ("rowwise")
    DoRAFP8Linear, convert_peft_model     PEFT integration (needs peft; loaded on first use): the fp8 DoRA layer,
                                          and converting a PEFT DoRA model in place
    register_with_lycoris                 LyCORIS (lycoris-lora) LoCon / DoRA modules on the fp8 layers, through the
                                          fused ops (run by `import dorafp8` when lycoris is imported; lycoris.py)
    BACKENDS, available_backends          "reference", "native" (PyTorch), "triton", "cuda", "cublas"; backend="auto"
                                          picks (on a GPU: the fastest, raced at each new layer shape)
    load_fp8_checkpoint, save_fp8_checkpoint, export_merged, detect_format
                                          fp8 checkpoints (ComfyUI, compressed-tensors, fine-grained FP8, ...) into
                                          FP8Linear layers and back, merged DoRA exports (dorafp8/checkpoint/)
    save_kohya_dora, load_kohya_dora      DoRA adapters as kohya / LyCORIS files (lora_down, lora_up, alpha,
                                          dora_scale) for ComfyUI and LyCORIS, and back (needs peft and safetensors;
                                          loaded on first use; dorafp8/checkpoint/kohya.py)
    save_single_file_dora                 the same, keyed in a ComfyUI single file's own layout (lora_unet_ + its
                                          weights' names, fused pieces joined), for ComfyUI on that file
    load_single_file                      a ComfyUI fp8_scaled single file in its original layout (ldm, BFL, ...) into
                                          a diffusers model, through diffusers' own key conversion (needs diffusers)
    from_transformers_fp8                 a transformers model loaded with an fp8 quantization config -> FP8Linear
    reuse_weight_norms                    a context in which DoRA layers on a GPU may reuse their weight norms
                                          (on the CPU they do whenever the adapters are unchanged; norm_cache.py)
    DoRAFP8Config                         from_pretrained(path, quantization_config=DoRAFP8Config(...)) quantizes a
                                          dense checkpoint into FP8Linear layers (needs transformers; loaded on first
                                          use; dorafp8/checkpoint/hf_quantizer.py)

Dispatch: dora_fp8_linear (dorafp8/ops/linear.py) -> DoRAFP8Function -> torch.ops.dorafp8.* -> the backend module
(dorafp8/backends/__init__.py lists them; backends/base.py is their contract) -> the kernel. The math: docs/DORA_MATH.md.

Saving: transformers' save_pretrained of a model with fp8 layers (the base, or after PEFT's merge_and_unload) writes
compressed-tensors (fine-grained FP8 for a model loaded from it), which from_pretrained and vLLM read without dorafp8;
diffusers' save_pretrained of one refuses, naming save_fp8_checkpoint / export_merged. Which loader reads what each
save path writes: docs/CHECKPOINTS.md.

PEFT, transformers, diffusers and LyCORIS are not imported here (they take seconds to import): the PEFT integration and
DoRAFP8Config are loaded when one of their names is used, and each library learns about dorafp8's fp8 layers as soon as
it is imported (PEFT: FP8Linear layers; transformers and diffusers: save_pretrained, the quantizer registry;
dorafp8/_install.py).
"""

from . import _deps, _install
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

__all__ = [
    "BACKENDS", "available_backends", "quantize_e4m3", "dequantize_e4m3", "dora_fp8_linear", "fp8_linear",
    "weight_norm", "FP8Linear", "quantize_model", "set_act_quant", "DoRAFP8Linear", "convert_peft_model",
    "register_with_peft", "install_ddp_support", "install_fsdp_support", "load_fp8_checkpoint", "save_fp8_checkpoint",
    "export_merged", "detect_format", "load_single_file", "from_transformers_fp8", "reuse_weight_norms",
    "FP8Conv1d", "FP8Conv2d", "FP8Conv3d", "dora_fp8_conv", "fp8_conv", "DoRAFP8Conv1d", "DoRAFP8Conv2d",
    "DoRAFP8Conv3d", "DoRAFP8Config", "save_kohya_dora", "load_kohya_dora", "save_single_file_dora",
    "register_with_lycoris",
]

_PEFT_NAMES = ("DoRAFP8Linear", "convert_peft_model", "register_with_peft")
_PEFT_CONV_NAMES = ("DoRAFP8Conv1d", "DoRAFP8Conv2d", "DoRAFP8Conv3d")
_TRANSFORMERS_NAMES = ("DoRAFP8Config",)
_KOHYA_NAMES = ("save_kohya_dora", "load_kohya_dora", "save_single_file_dora")
_LYCORIS_NAMES = ("register_with_lycoris",)


def __getattr__(name):
    from ._deps import require

    if name in _PEFT_NAMES + _PEFT_CONV_NAMES:
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
    return sorted(set(globals()) | set(_PEFT_NAMES) | set(_PEFT_CONV_NAMES) | set(_TRANSFORMERS_NAMES)
                  | set(_KOHYA_NAMES) | set(_LYCORIS_NAMES))


_install.install()  # DDP's fp8 broadcast; PEFT, transformers, diffusers, FSDP2 learn of fp8 layers (opt-out inside)
