"""DoRAFP8Linear: a PEFT LoRA Linear on an FP8Linear base (conversion and registration: dorafp8/peft/register.py).

DoRAFP8Linear subclasses PEFT's own `lora.Linear`, so everything PEFT does around a layer keeps working:
adapter state_dict keys (`lora_A.<name>.weight`, `lora_B.<name>.weight`, `lora_magnitude_vector.<name>.weight`),
save_pretrained/load_adapter, set_adapter, disable_adapter, several adapters per layer. Only three things change:
the base layer is an FP8Linear, the DoRA magnitude is initialised from the fp8 weight, and the forward of the usual
case (one active DoRA adapter) is one fused dorafp8 call instead of PEFT's dense [N, K] temporaries.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from peft.tuners.lora import layer as lora_layer
from peft.tuners.lora.dora import DoraLinearLayer
from peft.tuners.lora.variants import DoraLinearVariant

from ..nn import FP8Linear
from ..ops import dora_fp8_linear, fp8_linear, weight_norm
from .layer import DoRAFP8Layer, FP8DoraVariantMixin

_MERGE_ERROR = (
    "DoraFP8Variant does not merge into a dense weight: the base weight is fp8. DoRAFP8Linear.merge (and PEFT's "
    "merge_and_unload / merge_adapter, which call it) merges in fp32 row blocks and re-quantizes to e4m3."
)
_MERGE_WARNING = (
    "merging DoRA adapters into an fp8 base re-quantizes the merged weight to e4m3 ({} scales; "
    "DoRAFP8Linear.merge_granularity chooses). dorafp8.export_merged writes merged checkpoints in the layout you "
    "deploy and reports the error of every layer"
)


class DoraFP8Variant(FP8DoraVariantMixin, DoraLinearVariant):
    """PEFT's DoRA variant on an FP8Linear base: magnitude from the fp8 weight, no dense [N, K] temporaries."""

    _merge_error = _MERGE_ERROR

    @staticmethod
    def _magnitude(module: "DoRAFP8Linear", m: torch.Tensor):
        return DoraLinearLayer, m


class DoRAFP8Linear(DoRAFP8Layer, lora_layer.Linear):
    """PEFT's DoRA Linear with the frozen base weight in FP8 e4m3 (an FP8Linear base layer).

    Build it with `DoRAFP8Linear.from_peft(peft_dora_linear)`, with `dorafp8.convert_peft_model(peft_model)`, or let
    PEFT build it: after `import dorafp8`, `get_peft_model` on a model with FP8Linear layers creates these.
    The weight norm is computed once per forward and reused by its backward. Across calls it is reused only where it
    provably equals the norm of the current adapters, whatever wrote them (fused or 8-bit optimizers, `.data`): on
    the CPU by comparing the adapters with copies, on a GPU inside `dorafp8.reuse_weight_norms()`
    (dorafp8/norm_cache.py).
    """

    _dora_variant = DoraFP8Variant

    def __init__(self, base_layer, adapter_name: str, config, r: int = 0, lora_alpha: int = 1, **kwargs):
        super().__init__(base_layer, adapter_name, config=config, r=r, lora_alpha=lora_alpha, **kwargs)
        self.fan_in_fan_out = False  # the FP8Linear weight is always [out, in]

    # ---- what PEFT asks of a layer type --------------------------------------------------------------------------

    def _get_in_out_features(self, module):
        if isinstance(module, FP8Linear):
            return module.in_features, module.out_features
        return super()._get_in_out_features(module)

    def _get_base_layer_device_and_dtype(self, base_layer):
        # PEFT casts new adapters to the base weight's dtype: that must be the original dtype, never fp8.
        if isinstance(base_layer, FP8Linear):
            return base_layer.weight.device, base_layer.orig_dtype
        return super()._get_base_layer_device_and_dtype(base_layer)

    # Scale of a merged base: "row" (one per output row, loses least), "tensor", "block", or "keep" (the base's own).
    merge_granularity = "row"

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        """Merges the active (or the named) adapters into the fp8 base: W' = m / max(||V||, NORM_EPS) * V with
        V = W0 + s B A per DoRA adapter (+ s B A per plain LoRA adapter), in fp32 row blocks, re-quantized to e4m3
        with `merge_granularity` scales (warns that it re-quantizes). The pre-merge fp8 weight is kept, so unmerge()
        restores it exactly. Non-finite merged values are an error whatever safe_merge says (they cannot be
        stored in e4m3). The relative error of the re-quantization is `last_merge_error`."""
        from peft.tuners.tuners_utils import check_adapters_to_merge

        from ..merge import adapter_terms, merged_rows, requantize
        from ..quant import scale_kind

        adapter_names = check_adapters_to_merge(self, adapter_names)
        if not adapter_names:
            return
        base = self.get_base_layer()
        w8, scale, block_size = base.fp8_weight(), base.scale, base.block_size
        gran = self.merge_granularity if self.merge_granularity != "keep" else scale_kind(scale)
        terms = adapter_terms(self, adapter_names)
        new_w8, new_scale, stats = requantize(lambda j0, j1: merged_rows(w8, scale, block_size, terms, j0, j1),
                                              w8.shape[0], w8.shape[1], gran, block_size=block_size, device=w8.device)
        if stats.nonfinite:
            raise ValueError(f"NaNs detected in the merged weights ({stats.nonfinite} non-finite values). The "
                             f"adapter {adapter_names} seems to be broken")
        bias = base.bias
        for a in adapter_names:
            if self.lora_bias.get(a):
                if bias is None:
                    raise RuntimeError("Impossible to merge LoRA with `lora_bias=True` because the base layer has "
                                       "no bias.")
                bias = nn.Parameter((bias.float() + self.lora_B[a].bias.float() * self.scaling[a]).to(bias.dtype),
                                    requires_grad=False)
        warnings.warn(_MERGE_WARNING.format(f"per-{gran}"), stacklevel=2)
        self.__dict__.setdefault("_dorafp8_premerge", []).append((base.weight, base.scale, base.bias))
        base.weight = nn.Parameter(new_w8, requires_grad=False)
        base.scale = new_scale.to(w8.device)
        if bias is not base.bias:
            base.bias = bias
        self.last_merge_error = stats.rel_error
        self.merged_adapters.extend(adapter_names)
        self.clear_weight_norm_cache()

    def unmerge(self) -> None:
        """Restores the fp8 base as it was before merge() (exactly: the pre-merge bytes were kept)."""
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.")
            return
        stash = self.__dict__.get("_dorafp8_premerge") or []
        if not stash:
            raise RuntimeError("this layer's fp8 base was merged without keeping the original (loaded merged?); "
                               "reload the base checkpoint to unmerge")
        base = self.get_base_layer()
        base.weight, base.scale, base.bias = stash[0]
        stash.clear()
        self.merged_adapters.clear()
        self.clear_weight_norm_cache()

    def get_delta_weight(self, adapter) -> torch.Tensor:
        """s * lora_B @ lora_A as a dense [out, in] tensor in the adapters' dtype (PEFT's definition; DoRA's merge
        also rescales rows, see merge)."""
        A, B = self.lora_A[adapter].weight, self.lora_B[adapter].weight
        return ((B.float() @ A.float()) * self.scaling[adapter]).to(B.dtype)

    # ---- dorafp8 -------------------------------------------------------------------------------------------------

    @staticmethod
    def _weight_norm(base, A, B, s):
        return weight_norm(base.fp8_weight(), base.scale, A, B, s, backend=base.backend, block_size=base.block_size)

    @staticmethod
    def _per_channel(v: torch.Tensor) -> torch.Tensor:
        return v.view(1, -1)

    @staticmethod
    def _base_product(base: FP8Linear, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, base.fp8_weight(), base.scale, None, backend=base.backend, block_size=base.block_size,
                          act_quant=base.act_quant)

    def _fused_call(self, x: torch.Tensor, a: str, p: float) -> torch.Tensor:
        base = self.get_base_layer()
        return dora_fp8_linear(
            x, base.fp8_weight(), base.scale, self.lora_A[a].weight, self.lora_B[a].weight,
            self.lora_magnitude_vector[a].weight, self.scaling[a], base.bias,
            dropout_p=p, training=self.training, backend=base.backend, weight_norm=self.dora_weight_norm(a),
            block_size=base.block_size, act_quant=base.act_quant)

    # ---- conversion ----------------------------------------------------------------------------------------------

    @classmethod
    def from_peft(cls, layer: lora_layer.Linear, *, backend: str = "auto",
                  per_row_scale: bool = False) -> "DoRAFP8Linear":
        """A DoRAFP8Linear equal to the PEFT DoRA `layer` (nn.Linear or Conv1D base), with the base quantized to fp8.

        The adapters (all of them, with their active/disabled state) are moved over as they are: the returned layer
        shares lora_A, lora_B, lora_dropout and lora_magnitude_vector with `layer`, which should be discarded.
        """
        if not isinstance(layer, lora_layer.Linear):
            raise TypeError(f"layer must be a peft LoRA Linear (peft.tuners.lora.layer.Linear), "
                            f"got {type(layer).__name__}")
        if layer.merged:
            raise ValueError("layer has merged adapters; unmerge them first (layer.unmerge())")
        for name, variant in layer.lora_variant.items():
            if type(variant) not in (DoraLinearVariant, DoraFP8Variant):
                raise ValueError(f"adapter {name!r} uses the LoRA variant {type(variant).__name__}, which dorafp8 "
                                 f"does not support (only plain LoRA and DoRA)")
        base = layer.get_base_layer()
        fp8 = base if isinstance(base, FP8Linear) else FP8Linear.from_float(
            base, per_row_scale=per_row_scale, backend=backend)
        new = cls._adopt(layer, fp8, backend, ("is_target_conv_1d_layer",))
        for dora in new.lora_magnitude_vector.values():
            dora.fan_in_fan_out = False
        new.fan_in_fan_out = False
        return new
