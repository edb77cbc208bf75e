"""DoRAFP8Linear: a PEFT LoRA Linear on an FP8Linear base (conversion and registration: dorafp8/peft/register.py).

A subclass of PEFT's `lora.Linear` (adapter keys, save/load, set_adapter, several adapters keep working) whose usual
case (one active DoRA adapter) is one fused call instead of PEFT's dense [N, K] temporaries."""

from __future__ import annotations


import torch

from peft.tuners.lora import layer as lora_layer
from peft.tuners.lora.dora import DoraLinearLayer
from peft.tuners.lora.variants import DoraLinearVariant

from ..nn import FP8Linear
from ..ops import dora_fp8_linear, fp8_linear, weight_norm
from .layer import DoRAFP8Layer, FP8DoraVariantMixin, check_adapters_convertible



class DoraFP8Variant(FP8DoraVariantMixin, DoraLinearVariant):
    """PEFT's DoRA variant on an FP8Linear base: magnitude from the fp8 weight, no dense [N, K] temporaries."""

    @staticmethod
    def _magnitude(module: "DoRAFP8Linear", m: torch.Tensor):
        return DoraLinearLayer, m


class DoRAFP8Linear(DoRAFP8Layer, lora_layer.Linear):
    """PEFT's DoRA Linear with the frozen base weight in FP8 e4m3 (an FP8Linear base layer). Build it with
    `DoRAFP8Linear.from_peft(peft_dora_linear)` or `dorafp8.convert_peft_model(peft_model)`, or let PEFT build it: after
    `import dorafp8`, `get_peft_model` on a model with FP8Linear layers creates these. The weight norm is reused across
    calls only where it provably equals the current adapters' (dorafp8/norm_cache.py)."""

    _dora_variant = DoraFP8Variant
    _peft_dora_variant = DoraLinearVariant

    def __init__(self, base_layer, adapter_name: str, config=None, r: int = 0, lora_alpha: int = 1, **kwargs):
        super().__init__(base_layer, adapter_name, config=config, r=r, lora_alpha=lora_alpha, **kwargs)
        self.fan_in_fan_out = False  # the FP8Linear weight is always [out, in]

    def _get_in_out_features(self, module):
        if isinstance(module, FP8Linear):
            return module.in_features, module.out_features
        return super()._get_in_out_features(module)

    def _get_base_layer_device_and_dtype(self, base_layer):
        # PEFT casts new adapters to the base weight's dtype: that must be the original dtype, never fp8.
        if isinstance(base_layer, FP8Linear):
            return base_layer.weight.device, base_layer.orig_dtype
        return super()._get_base_layer_device_and_dtype(base_layer)

    def get_delta_weight(self, adapter) -> torch.Tensor:
        """s * lora_B @ lora_A as a dense [out, in] tensor in the adapters' dtype (PEFT's definition)."""
        A, B = self.lora_A[adapter].weight, self.lora_B[adapter].weight
        return ((B.float() @ A.float()) * self.scaling[adapter]).to(B.dtype)

    @staticmethod
    def _weight_norm(base, A, B, s):
        return weight_norm(base.fp8_weight(), base.scale, A, B, s, backend=base.backend, block_size=base.block_size,
                           global_scale=base.global_scale)

    @staticmethod
    def _per_channel(v: torch.Tensor) -> torch.Tensor:
        return v.view(1, -1)

    @staticmethod
    def _base_product(base: FP8Linear, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, base.fp8_weight(), base.scale, None, backend=base.backend, block_size=base.block_size,
                          act_quant=base.act_quant, global_scale=base.global_scale)

    def _fused_call(self, x: torch.Tensor, a: str, p: float, base: FP8Linear) -> torch.Tensor:
        A, B, g = self.lora_A[a].weight, self.lora_B[a].weight, base.global_scale  # each read once a call
        return dora_fp8_linear(
            x, base.fp8_weight(), base.scale, A, B, self.lora_magnitude_vector[a].weight, self.scaling[a], base.bias,
            dropout_p=p, training=self.training, backend=base.backend, weight_norm=self._norm_of(base, a, A, B,
                                                                                                global_scale=g),
            block_size=base.block_size, act_quant=base.act_quant, global_scale=g)

    @classmethod
    def check_peft_layer(cls, layer: lora_layer.Linear, *, per_row_scale: bool = False, name: str | None = None):
        """Raises what from_peft(layer) would raise, changing nothing."""
        if not isinstance(layer, lora_layer.Linear):
            raise TypeError(f"layer must be a peft LoRA Linear (peft.tuners.lora.layer.Linear), "
                            f"got {type(layer).__name__}")
        check_adapters_convertible(layer, (DoraLinearVariant, DoraFP8Variant), per_row_scale, name)

    @classmethod
    def from_peft(cls, layer: lora_layer.Linear, *, backend: str = "auto",
                  per_row_scale: bool = False) -> "DoRAFP8Linear":
        """A DoRAFP8Linear equal to the PEFT DoRA `layer` on an fp8 base, sharing its adapters (discard `layer`)."""
        cls.check_peft_layer(layer, per_row_scale=per_row_scale)
        base = layer.get_base_layer()
        fp8 = base if isinstance(base, FP8Linear) else FP8Linear.from_float(
            base, per_row_scale=per_row_scale, backend=backend)
        new = cls._adopt(layer, fp8, backend, ("is_target_conv_1d_layer",))
        for dora in new.lora_magnitude_vector.values():
            dora.fan_in_fan_out = False
        new.fan_in_fan_out = False
        return new
