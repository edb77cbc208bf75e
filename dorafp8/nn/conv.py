"""FP8Conv1d / FP8Conv2d / FP8Conv3d: a frozen float8_e4m3fn conv weight with an fp32 scale (ops: dorafp8/ops/conv.py).

The weight is quantized on its [C_out, C_in/groups * prod(kernel)] view, so every scale of dorafp8.quant applies: per
tensor (default), per output channel (`per_row_scale=True`) or per b x b block of the view."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..backends import check_backend_name
from ..ops.conv import fp8_conv
from ..quant import DEFAULT_BLOCK, E4M3, check_block_size, check_scale, dequantize_e4m3, quantize_e4m3, scale_kind
from ._base import FP8WeightModule, fp8_cast_parts, peft_unregistered_hint

NN_CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}


class FP8ConvNd(FP8WeightModule):
    """A frozen ConvNd with a float8_e4m3fn weight [C_out, C_in/groups, *kernel] and an fp32 `scale`, with nn.ConvNd's
    attributes; keys `weight`, `scale`, `bias`. `backend`: the DoRA weight norm's; convolutions are the platform's."""

    _nd = 2
    block_size = DEFAULT_BLOCK

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0, dilation=1,
                 groups: int = 1, bias: bool = True, padding_mode: str = "zeros", *, device=None,
                 dtype: torch.dtype = torch.float32, per_row_scale: bool = False, block_size: Optional[int] = None,
                 backend: str = "auto"):
        super().__init__()
        nd = self._nd
        # nn.ConvNd on the meta device validates the geometry and works out what torch derives from it
        # (the tuples, 'same'/'valid' padding, the padding for non-zero padding modes), at no cost.
        proto = NN_CONV[nd](in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                            padding_mode, device="meta")
        for attr in ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups",
                     "padding_mode", "_reversed_padding_repeated_twice", "transposed", "output_padding"):
            setattr(self, attr, getattr(proto, attr))
        self.orig_dtype = dtype  # the weight's dtype before quantization: PEFT creates adapters in it
        self.backend = check_backend_name(backend)
        self.block_size = check_block_size(block_size or DEFAULT_BLOCK)
        shape = tuple(proto.weight.shape)
        self._init_fp8_storage(shape, math.prod(shape[1:]), bias, dtype, device, per_row_scale, block_size)

    @classmethod
    def from_float(cls, module: nn.Module, *, per_row_scale: bool = False, block_size: Optional[int] = None,
                   backend: str = "auto", name: str | None = None):
        """Quantizes an nn.ConvNd into an FP8 conv (scale per tensor, channel or block). `name`: for messages."""
        want = NN_CONV[cls._nd]
        if not isinstance(module, want):
            raise TypeError(f"module must be an {want.__name__}, got {type(module).__name__}")
        w = module.weight.detach()
        bias = module.bias
        cast = fp8_cast_parts(module, w, name)
        if cast is not None:
            w8, bias, dtype = cast
            scale, block_size = torch.ones((), device=w8.device), None
        else:
            w2, scale = quantize_e4m3(w.reshape(w.shape[0], -1), per_row=per_row_scale, block_size=block_size,
                                      name=name)
            w8, dtype = w2.view(w.shape), w.dtype
            bias = None if bias is None else bias.detach().clone()
        return cls.from_fp8(w8, scale, bias, stride=module.stride, padding=module.padding, dilation=module.dilation,
                            groups=module.groups, padding_mode=module.padding_mode, backend=backend, dtype=dtype,
                            block_size=block_size)

    @classmethod
    def from_fp8(cls, w8: Tensor, scale: Tensor, bias: Optional[Tensor] = None, *, stride=1, padding=0, dilation=1,
                 groups: int = 1, padding_mode: str = "zeros", backend: str = "auto",
                 dtype: Optional[torch.dtype] = None, block_size: Optional[int] = None):
        """An FP8 conv holding `w8` (float8_e4m3fn [C_out, C_in/groups, *kernel], kept as is) and its fp32 `scale` ([],
        [C_out] or per block, b = block_size); `dtype`: for PEFT's adapters (default: the bias's, else float32)."""
        nd = cls._nd
        if not isinstance(w8, torch.Tensor) or w8.dtype != E4M3 or w8.dim() != nd + 2:
            raise TypeError(f"w8 must be a float8_e4m3fn tensor [C_out, C_in/groups, *kernel] with {nd} kernel dims, "
                            f"got {w8.dtype if isinstance(w8, torch.Tensor) else type(w8).__name__} "
                            f"{list(getattr(w8, 'shape', []))}")
        C_out = w8.shape[0]
        block_size = block_size or DEFAULT_BLOCK
        scale = check_scale(_squeeze_channel_scale(scale, C_out), C_out, math.prod(w8.shape[1:]), block_size)
        dtype = dtype or (bias.dtype if bias is not None else torch.float32)
        new = cls(w8.shape[1] * groups, C_out, tuple(w8.shape[2:]), stride, padding, dilation, groups,
                  bias is not None, padding_mode, device="meta", dtype=dtype, block_size=block_size, backend=backend)
        new.weight = nn.Parameter(w8, requires_grad=False)
        new.scale = scale.to(w8.device)
        if bias is not None:
            new.bias = nn.Parameter(bias, requires_grad=False)
        return new

    def conv_padding(self) -> Optional[tuple]:
        """The padding as ints for symmetric zero padding (what the fused ops take), else None."""
        if self.padding_mode != "zeros":
            return None
        if isinstance(self.padding, str):
            if self.padding == "valid":
                return (0,) * self._nd
            rp = self._reversed_padding_repeated_twice  # ('same') [left, right] pairs, last dim first
            lefts, rights = rp[0::2], rp[1::2]
            return tuple(reversed(lefts)) if list(lefts) == list(rights) else None
        return tuple(self.padding)

    def pad_input(self, x: Tensor) -> Tensor:
        """x padded as nn.ConvNd pads it for a padding_mode other than zeros (or an asymmetric 'same')."""
        mode = "constant" if self.padding_mode == "zeros" else self.padding_mode
        return F.pad(x, self._reversed_padding_repeated_twice, mode=mode)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x, self.bias)

    def conv(self, x: Tensor, bias: Optional[Tensor]) -> Tensor:
        """This layer's convolution of x with `bias` (the layer's own, or None)."""
        pad = self.conv_padding()
        if pad is None:
            x, pad = self.pad_input(x), 0
        return fp8_conv(x, self.fp8_weight(), self.scale, bias, self.stride, pad, self.dilation, self.groups,
                        block_size=self.block_size)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The dense weight scale * w8 in the conv layout (for export and checking; materializes the whole weight)."""
        C = self.weight.shape[0]
        return dequantize_e4m3(self.weight.reshape(C, -1), self.scale, dtype,
                               block_size=self.block_size).view(self.weight.shape)

    def to_float(self, dtype: Optional[torch.dtype] = None) -> nn.Module:
        """An nn.ConvNd with the dequantized weight (in `dtype`, default the original dtype) and the same geometry."""
        dtype = dtype or self.orig_dtype
        conv = NN_CONV[self._nd](self.in_channels, self.out_channels, self.kernel_size, self.stride, self.padding,
                                 self.dilation, self.groups, self.bias is not None, self.padding_mode,
                                 device="meta")
        conv.weight = nn.Parameter(self.dequantize(dtype), requires_grad=False)
        if self.bias is not None:
            conv.bias = nn.Parameter(self.bias.detach().clone(), requires_grad=False)
        return conv

    @property
    def _float_weight_hint(self) -> str:
        return f"load it into nn.{NN_CONV[self._nd].__name__} and use {type(self).__name__}.from_float"

    def _check_loaded_scale(self, scale, name: str, weight=None) -> torch.Tensor:
        return super()._check_loaded_scale(_squeeze_channel_scale(scale, self.out_channels), name, weight)

    def extra_repr(self) -> str:
        kind = {"tensor": "per-tensor", "row": "per-channel", "block": f"per-{self.block_size}x{self.block_size}-block"}
        s = (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
             f"padding={self.padding}")
        if self.dilation != (1,) * self._nd:
            s += f", dilation={self.dilation}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        if self.padding_mode != "zeros":
            s += f", padding_mode={self.padding_mode}"
        return s + (f", bias={self.bias is not None}, weight=float8_e4m3fn, scale={kind[scale_kind(self.scale)]}, "
                    f"backend={self.backend}{peft_unregistered_hint()}")


def _squeeze_channel_scale(scale, C: int):
    """A per-channel scale stored as [C, 1, 1, 1] (the weight's rank) -> [C]."""
    if isinstance(scale, torch.Tensor) and scale.dim() > 2 and scale.shape[0] == C and scale.numel() == C:
        return scale.reshape(C)
    return scale


class FP8Conv1d(FP8ConvNd):
    __doc__ = FP8ConvNd.__doc__
    _nd = 1


class FP8Conv2d(FP8ConvNd):
    __doc__ = FP8ConvNd.__doc__
    _nd = 2


class FP8Conv3d(FP8ConvNd):
    __doc__ = FP8ConvNd.__doc__
    _nd = 3


FP8_CONV_CLASSES = {nn.Conv1d: FP8Conv1d, nn.Conv2d: FP8Conv2d, nn.Conv3d: FP8Conv3d}


def fp8_conv_class(module: nn.Module):
    """The FP8 conv class for an nn.Conv1d/2d/3d (exact type or subclass), else None."""
    for base, cls in FP8_CONV_CLASSES.items():
        if isinstance(module, base):
            return cls
    return None
