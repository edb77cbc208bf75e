"""dorafp8 in transformers' quantizer registry: `from_pretrained(path, quantization_config=DoRAFP8Config(...))` loads
a dense checkpoint and runs quantize_model on it; save_pretrained then writes compressed-tensors or fine-grained FP8.
Imports transformers: _install.py registers it once transformers is imported."""

from __future__ import annotations

from typing import Iterable, Optional

from transformers.quantizers import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from ..backends import check_backend_name
from ..nn import quantize_model
from ..nn.convert import name_list
from ..quant import DEFAULT_BLOCK, check_act_quant, check_block_size, check_scale_kind

QUANT_METHOD = "dorafp8"


class DoRAFP8Config(QuantizationConfigMixin):
    """Quantize a dense checkpoint into dorafp8 FP8Linear layers while from_pretrained loads it.

    Args:
        granularity: the weight scale: "tensor" (one fp32 scale per layer, the default), "row" (one per output row,
            loses least), or "block" (one per block_size x block_size block).
        block_size: with granularity="block", the block size (default 128).
        act_quant: None (W8A16, the default) or "rowwise" (W8A8 base GEMMs, activations quantized per row; see
            dorafp8.set_act_quant).
        target_modules: names or name suffixes of the linear layers to quantize (PEFT's rule); None: every nn.Linear
            (and transformers' Conv1D) but the output head `lm_head`, as dorafp8.quantize_model.
        modules_to_not_convert: names or name suffixes left in the checkpoint's precision (the model's
            _keep_in_fp32_modules are always left).
        backend: the FP8Linear kernels ("auto").

    Raises:
        TypeError: an argument it does not take.
        ValueError: an unknown granularity, act_quant or backend, or block_size without granularity="block".
    """

    def __init__(self, granularity: str = "tensor", block_size: Optional[int] = None, act_quant: Optional[str] = None,
                 target_modules: Optional[Iterable[str]] = None,
                 modules_to_not_convert: Optional[Iterable[str]] = None, backend: str = "auto", **kwargs):
        kwargs.pop("quant_method", None)  # from_dict passes the stored dict back, quant_method included
        if kwargs:
            raise TypeError(f"DoRAFP8Config got unexpected arguments {sorted(kwargs)}; it takes granularity, "
                            f"block_size, act_quant, target_modules, modules_to_not_convert, backend")
        check_scale_kind(granularity)
        if block_size is not None and granularity != "block":
            raise ValueError(f"block_size={block_size} needs granularity='block' (got {granularity!r})")
        self.quant_method = QUANT_METHOD
        self.granularity = granularity
        self.block_size = check_block_size(block_size or DEFAULT_BLOCK) if granularity == "block" else None
        self.act_quant = check_act_quant(act_quant) or None
        self.target_modules = name_list(target_modules)
        self.modules_to_not_convert = name_list(modules_to_not_convert)
        self.backend = check_backend_name(backend)


class DoRAFP8HfQuantizer(HfQuantizer):
    """transformers' side of DoRAFP8Config: nothing before the weights load, quantize_model after."""

    requires_calibration = False

    def validate_environment(self, *args, **kwargs):
        if self.pre_quantized:
            raise ValueError("config.json says quant_method 'dorafp8', which dorafp8 never writes as a checkpoint's "
                             "layout (DoRAFP8Config quantizes a dense checkpoint while loading it; save_pretrained "
                             "writes compressed-tensors or fine-grained FP8). Delete quantization_config from "
                             "config.json if the weights are dense; if they are fp8, load them with "
                             "dorafp8.load_fp8_checkpoint")

    def _process_model_before_weight_loading(self, model, **kwargs):
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        q = self.quantization_config
        offloaded = [n for n, p in model.named_parameters() if p.is_meta]
        if offloaded:
            raise ValueError(f"DoRAFP8Config quantizes the loaded weights in place, but {len(offloaded)} are not in "
                             f"memory (e.g. {offloaded[0]!r}: offloaded by device_map?); load without offloading")
        # the model's _keep_in_fp32_modules stay dense by quantize_model's own rule (kept_in_precision)
        exclude = list(q.modules_to_not_convert or [])
        quantize_model(model, q.target_modules, per_row_scale=q.granularity == "row",
                       block_size=q.block_size if q.granularity == "block" else None, backend=q.backend,
                       act_quant=q.act_quant, exclude_modules=exclude)
        # the dense files it was quantized from (save_hooks recorded them): the writers refuse to replace them
        # (write.refuse_original), the original precision being gone for good
        files = getattr(model, "_dorafp8_checkpoint_files", None)
        if files:
            from .plan import SourceInfo

            model.__dict__.setdefault("_dorafp8_source", SourceInfo()).files = files
        return model

    def is_serializable(self, *args, **kwargs):
        return True  # save_pretrained writes a layout transformers reads (dorafp8/checkpoint/save_hooks.py)

    @property
    def is_trainable(self):
        return True  # DoRA adapters train on the frozen fp8 layers


def register() -> None:
    """Adds DoRAFP8Config to transformers' quantizer registry. Idempotent."""
    from transformers.quantizers import auto

    if QUANT_METHOD not in auto.AUTO_QUANTIZATION_CONFIG_MAPPING:
        auto.register_quantization_config(QUANT_METHOD)(DoRAFP8Config)
    if QUANT_METHOD not in auto.AUTO_QUANTIZER_MAPPING:
        auto.register_quantizer(QUANT_METHOD)(DoRAFP8HfQuantizer)
