"""PEFT integration for convolutions: DoRAFP8Conv1d/2d/3d, PEFT's own `lora.Conv1d/2d/3d` on an FP8 conv base.

PEFT 0.21's adapter layout is kept, so adapter files are PEFT's; the usual case (one active DoRA adapter, no LoRA
bias, zero padding) is one dora_fp8_conv call, with no dense B A or dequantized weight kept."""

from __future__ import annotations

import torch
from torch import nn

from peft.tuners.lora import layer as lora_layer
from peft.tuners.lora.dora import DoraConv1dLayer, DoraConv2dLayer, DoraConv3dLayer
from peft.tuners.lora.variants import DoraConv1dVariant, DoraConv2dVariant, DoraConv3dVariant, _DoraConvNdVariant

from ..nn import FP8Conv1d, FP8Conv2d, FP8Conv3d, FP8ConvNd
from ..nn.conv import fp8_conv_class
from ..ops.conv import conv_weight_norm, dora_fp8_conv
from .layer import DoRAFP8Layer, FP8DoraVariantMixin, check_adapters_convertible

_PEFT_DORA_CONV_VARIANTS = (DoraConv1dVariant, DoraConv2dVariant, DoraConv3dVariant)
_DORA_LAYER = {1: DoraConv1dLayer, 2: DoraConv2dLayer, 3: DoraConv3dLayer}


class DoraFP8ConvVariant(FP8DoraVariantMixin, _DoraConvNdVariant):
    """PEFT's DoRA conv variant on an FP8 conv base: magnitude from the fp8 weight, no dense temporaries."""

    @staticmethod
    def _magnitude(module: "_DoRAFP8ConvMixin", m: torch.Tensor):
        return _DORA_LAYER[module._kernel_dim - 2], module._per_channel(m)


class _DoRAFP8ConvMixin(DoRAFP8Layer):
    """What DoRAFP8Conv1d/2d/3d add to PEFT's lora.Conv1d/2d/3d (see the module docstring)."""

    _dora_variant = DoraFP8ConvVariant
    _peft_dora_variant = _DoraConvNdVariant
    _io_names = ("in_channels", "out_channels")

    def _fp8_base(self) -> FP8ConvNd:
        """The FP8 conv base (also while update_layer shows PEFT a geometry shell, see there)."""
        layer = self
        while hasattr(layer, "base_layer"):
            layer = layer.base_layer
        return layer

    def get_base_layer(self):
        shell = self.__dict__.get("_dorafp8_geometry_shell")
        return shell if shell is not None else super().get_base_layer()

    def update_layer(self, adapter_name, *args, **kwargs):
        # PEFT's update_layer builds lora_A / lora_B as `type(base_layer)(...)`: while it runs, get_base_layer() is a
        # meta nn.ConvNd of the same geometry (device, dtype and the DoRA variant still read the real base).
        shell = _geometry_shell(self._fp8_base())
        self.__dict__["_dorafp8_geometry_shell"] = shell
        try:
            super().update_layer(adapter_name, *args, **kwargs)
        finally:
            self.__dict__.pop("_dorafp8_geometry_shell", None)
        self.clear_weight_norm_cache()

    def _get_in_out_features(self, module):
        if isinstance(module, FP8ConvNd):
            return module.in_channels, module.out_channels
        return super()._get_in_out_features(module)

    def _get_base_layer_device_and_dtype(self, base_layer):
        # New adapters get the base weight's original dtype, never fp8 (nor the meta device of the shell).
        real = self._fp8_base()
        if base_layer is real or base_layer is self.__dict__.get("_dorafp8_geometry_shell"):
            return real.weight.device, real.orig_dtype
        return super()._get_base_layer_device_and_dtype(base_layer)

    @staticmethod
    def _weight_norm(base, A, B, s):
        """The per-output-channel norm ||W0 + s L|| ([C_out]) in the conv layout (dora_weight_norm caches it)."""
        return conv_weight_norm(base.fp8_weight(), base.scale, A, B, s, base.groups, backend=base.backend,
                                block_size=base.block_size)

    def _per_channel(self, v: torch.Tensor) -> torch.Tensor:
        return v.reshape((1, -1) + (1,) * (self._kernel_dim - 2))

    @staticmethod
    def _base_product(base: FP8ConvNd, x: torch.Tensor) -> torch.Tensor:
        return base.conv(x, None)

    def _fused_adapter(self) -> str | None:
        """The adapter the fused path serves: one active DoRA adapter, no LoRA bias, zero padding everywhere."""
        a = super()._fused_adapter()
        if a is None or self._fp8_base().conv_padding() is None or _lora_padding(self.lora_A[a]) is None:
            return None
        return a

    def _fused_call(self, x: torch.Tensor, a: str, p: float, base: FP8ConvNd) -> torch.Tensor:
        lora_A = self.lora_A[a]
        A, B = lora_A.weight, self.lora_B[a].weight  # each read once a call
        return dora_fp8_conv(
            x, base.fp8_weight(), base.scale, A, B,
            self.lora_magnitude_vector[a].weight, self.scaling[a], base.bias, base.stride, base.conv_padding(),
            base.dilation, base.groups, lora_stride=lora_A.stride, lora_padding=_lora_padding(lora_A),
            lora_dilation=lora_A.dilation, dropout_p=p, training=self.training, backend=base.backend,
            weight_norm=self._norm_of(base, a, A, B), block_size=base.block_size)

    @classmethod
    def check_peft_layer(cls, layer: lora_layer._ConvNd, *, per_row_scale: bool = False, name: str | None = None):
        """Raises what from_peft(layer) would raise, changing nothing."""
        peft_cls = next(c for c in cls.__mro__ if issubclass(c, lora_layer._ConvNd) and not issubclass(
            c, _DoRAFP8ConvMixin))  # lora.Conv1d / Conv2d / Conv3d
        if not isinstance(layer, peft_cls):
            raise TypeError(f"layer must be a peft LoRA {peft_cls.__name__}, got {type(layer).__name__}")
        check_adapters_convertible(layer, _PEFT_DORA_CONV_VARIANTS + (DoraFP8ConvVariant,), per_row_scale, name)

    @classmethod
    def from_peft(cls, layer: lora_layer._ConvNd, *, backend: str = "auto", per_row_scale: bool = False):
        """A dorafp8 conv equal to the PEFT DoRA conv `layer` on an fp8 base, sharing its adapters (discard `layer`)."""
        cls.check_peft_layer(layer, per_row_scale=per_row_scale)
        base = layer.get_base_layer()
        if isinstance(base, FP8ConvNd):
            fp8 = base
        else:
            fp8 = fp8_conv_class(base).from_float(base, per_row_scale=per_row_scale, backend=backend)
        return cls._adopt(layer, fp8, backend, ("_kernel_dim", "conv_fn"))


def _lora_padding(conv: nn.Module):
    """lora_A's padding as ints, or None if it is not plain symmetric zero padding."""
    if conv.padding_mode != "zeros":
        return None
    if isinstance(conv.padding, str):
        if conv.padding == "valid":
            return (0,) * len(conv.kernel_size)
        rp = conv._reversed_padding_repeated_twice
        lefts, rights = rp[0::2], rp[1::2]
        return tuple(reversed(lefts)) if list(lefts) == list(rights) else None
    return tuple(conv.padding)


def _geometry_shell(base: FP8ConvNd) -> nn.Module:
    """An nn.ConvNd with `base`'s geometry on the meta device (no memory): what PEFT's update_layer looks at."""
    conv_cls = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[base._nd]
    return conv_cls(base.in_channels, base.out_channels, base.kernel_size, base.stride, base.padding, base.dilation,
                    base.groups, base.bias is not None, base.padding_mode, device="meta")


class DoRAFP8Conv1d(_DoRAFP8ConvMixin, lora_layer.Conv1d):
    """PEFT's LoRA/DoRA Conv1d on an FP8Conv1d base (see dorafp8/peft/conv.py)."""


class DoRAFP8Conv2d(_DoRAFP8ConvMixin, lora_layer.Conv2d):
    """PEFT's LoRA/DoRA Conv2d on an FP8Conv2d base (built by get_peft_model or convert_peft_model)."""


class DoRAFP8Conv3d(_DoRAFP8ConvMixin, lora_layer.Conv3d):
    """PEFT's LoRA/DoRA Conv3d on an FP8Conv3d base (see dorafp8/peft/conv.py)."""


DORA_FP8_CONV_CLASSES = {FP8Conv1d: DoRAFP8Conv1d, FP8Conv2d: DoRAFP8Conv2d, FP8Conv3d: DoRAFP8Conv3d}
_PEFT_TO_FP8 = {lora_layer.Conv1d: DoRAFP8Conv1d, lora_layer.Conv2d: DoRAFP8Conv2d, lora_layer.Conv3d: DoRAFP8Conv3d}


def create_conv_module(base: nn.Module, target, adapter_name: str, lora_config, **kwargs):
    """The dorafp8 LoRA layer for an FP8 conv base (register_with_peft's dispatch), or None for any other base."""
    cls = DORA_FP8_CONV_CLASSES.get(type(base))
    if cls is None:
        return None
    kwargs.pop("fan_in_fan_out", None)
    return cls(target, adapter_name, config=lora_config, **kwargs)


def convertible_conv_layers(model: nn.Module) -> dict[str, type]:
    """The PEFT DoRA conv layers (lora.Conv1d/2d/3d with a DoRA adapter) convert_peft_model swaps: name -> the class
    it swaps each for."""
    return {name: _PEFT_TO_FP8[type(mod)] for name, mod in model.named_modules()
            if type(mod) in _PEFT_TO_FP8
            and any(isinstance(v, _PEFT_DORA_CONV_VARIANTS) for v in mod.lora_variant.values())}
