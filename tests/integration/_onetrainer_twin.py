"""A twin of the parts of OneTrainer (github.com/Nerogar/OneTrainer) that dorafp8.onetrainer meets, written anew.

OneTrainer is not on PyPI and is AGPL: none of its code is copied. What each file below computes was read from its
source at commit 23df3832e8f213d64c337e39f9365ba46e99fed0 (2026-08-19) and is re-stated in this project's own words,
in OneTrainer's own layout, so that dorafp8's import hooks meet it as they meet a checkout:

- `modules/` and every folder under it are namespace packages (OneTrainer has no __init__.py there);
- modules/module/quantized/: LinearFp8 (an nn.Linear, e4m3 weight, one fp32 scale kept as `_scale` and registered as
  the `scale` buffer: the same tensor), LinearW8A8 (fp8 case: its `scale` buffer), LinearSVD.make_svd_linear (SVDQuant:
  a subclass of the quantized class whose weight holds W - U D, U D = svd_up @ svd_down in svd_dtype, added back by
  unquantized_weight, forward and forward_with_lora);
- modules/util/quantization_util.py: the fp8 quantizer, get_unquantized_weight (a QuantizedLinearMixin's own
  unquantized_weight, else the bare weight), replace_linear_with_quantized_layers, is_quantized_parameter,
  quantize_layers;
- modules/modelLoader/mixin/HFModelLoaderMixin.py: the dtype conversion a loader runs before quantizing, which assigns
  `.data` of every non-quantized float buffer, so `scale` (and with it `_scale`) becomes the train dtype (bf16/fp16)
  before quantize() writes the scale into it;
- modules/module/LoRAModule.py: PeftBase (linear and conv2d branches), LoRAModule (which hands a LinearSVD layer to
  its forward_with_lora), DoRAModule (dense fp32 recomposition on either branch) and LoRAModuleWrapper (with its
  q/k/v fusion: `fusion_spec`, `fuse`; partial groups are not refused here);
- modules/module/FusedModule.py: _FusedLinear (an nn.Linear over the split leaves with a 0-size weight, its outputs,
  bias and unquantized weight theirs side by side) and FusedModuleGroup (one adapter on it; each leaf returns its
  slice of the adapter's whole output, DoRA having no delta term), as the fused LoRA output formats build them.

tests/integration/test_onetrainer.py writes these files to a folder and puts it on sys.path; with ONETRAINER_DIR set
it uses that checkout instead, through the same names.
"""

FILES = {}

FILES["modules/util/enum/DataType.py"] = '''
from enum import Enum

import torch


class DataType(Enum):  # the members the twin uses; torch_dtype() is None for the quantized ones
    NONE = "NONE"
    FLOAT_8 = "FLOAT_8"
    FLOAT_16 = "FLOAT_16"
    FLOAT_32 = "FLOAT_32"
    BFLOAT_16 = "BFLOAT_16"
    FLOAT_W8A8 = "FLOAT_W8A8"

    def torch_dtype(self):
        return {"FLOAT_16": torch.float16, "FLOAT_32": torch.float32, "BFLOAT_16": torch.bfloat16}.get(self.value)

    def is_quantized(self):
        return self in (DataType.FLOAT_8, DataType.FLOAT_W8A8)

    def quantize_fp8(self):
        return self is DataType.FLOAT_8

    def quantize_fpW8A8(self):
        return self is DataType.FLOAT_W8A8
'''

FILES["modules/module/quantized/mixin/QuantizedModuleMixin.py"] = '''
from abc import ABCMeta, abstractmethod


class QuantizedModuleMixin(metaclass=ABCMeta):
    @abstractmethod
    def quantize(self, device=None):
        ...
'''

FILES["modules/module/quantized/mixin/QuantizedLinearMixin.py"] = '''
from abc import ABCMeta, abstractmethod


class QuantizedLinearMixin(metaclass=ABCMeta):
    @abstractmethod
    def unquantized_weight(self, dtype, device):
        ...
'''

FILES["modules/module/quantized/LinearFp8.py"] = '''
import torch
from torch import nn

from modules.module.quantized.mixin.QuantizedLinearMixin import QuantizedLinearMixin
from modules.module.quantized.mixin.QuantizedModuleMixin import QuantizedModuleMixin


class LinearFp8(nn.Linear, QuantizedModuleMixin, QuantizedLinearMixin):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.is_quantized = False
        self._scale = torch.tensor(1.0)
        self.register_buffer("scale", self._scale)  # one tensor under two names
        self.compute_dtype = None

    def unquantized_weight(self, dtype, device):
        w = self.weight.detach().to(dtype)
        return w if self._scale is None else w * self._scale.to(dtype=dtype, device=w.device)

    def quantize(self, device=None):
        if self.is_quantized:
            return
        self.is_quantized = True
        w = self.weight.data
        if w.dtype != torch.float8_e4m3fn:
            self._scale.copy_(w.abs().max().clamp(min=1e-12) / 448.0)  # in the scale's dtype (bf16 after loading)
            w = w.div_(self._scale).to(torch.float8_e4m3fn)
        self.weight.data = w

    def forward(self, x):
        w = self.weight.detach().to(self.compute_dtype or x.dtype)
        if self._scale is not None:
            w = w.mul_(self._scale)
        return nn.functional.linear(x, w, self.bias)
'''

FILES["modules/module/quantized/LinearW8A8.py"] = '''
import torch
from torch import nn

from modules.module.quantized.mixin.QuantizedLinearMixin import QuantizedLinearMixin
from modules.module.quantized.mixin.QuantizedModuleMixin import QuantizedModuleMixin
from modules.util.quantization_util import quantize_fp8_tensorwise


class LinearW8A8(nn.Linear, QuantizedModuleMixin, QuantizedLinearMixin):  # the twin has its fp8 case only
    def __init__(self, dtype, *args, **kwargs):
        super().__init__(*args, **kwargs)
        assert dtype == torch.float8_e4m3fn
        self._dtype = dtype
        self._compressed = False
        self.compute_dtype = None
        self.register_buffer("scale", torch.tensor(1.0))

    def unquantized_weight(self, dtype, device):
        return (self.weight.detach().float() * self.scale.to(self.weight.device)).to(dtype)

    @torch.no_grad()
    def quantize(self, device=None):
        w8, s = quantize_fp8_tensorwise(self.weight.detach())
        self.requires_grad_(False)
        self.weight.data = w8
        self.scale.copy_(s)

    def forward(self, x):  # OneTrainer's runs fp8 GEMMs on fp8 activations; DoRAModule never calls it
        return nn.functional.linear(x, self.unquantized_weight(x.dtype, x.device), self.bias)
'''

FILES["modules/module/quantized/LinearSVD.py"] = '''
from abc import abstractmethod

import torch

from modules.module.quantized.mixin.QuantizedLinearMixin import QuantizedLinearMixin
from modules.module.quantized.mixin.QuantizedModuleMixin import QuantizedModuleMixin


class BaseLinearSVD(QuantizedModuleMixin, QuantizedLinearMixin):
    @abstractmethod
    def forward_with_lora(self, x, lora_down, lora_up, dropout, alpha):
        ...


def make_svd_linear(linear_class):
    class LinearSVD(linear_class, BaseLinearSVD):
        def __init__(self, rank, svd_dtype, cache_dir, max_cache_rank=128, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.svd_done = False
            self.rank, self.svd_dtype = rank, svd_dtype
            self.svd_up = torch.nn.Parameter(torch.empty(()), requires_grad=False)
            self.svd_down = torch.nn.Parameter(torch.empty(()), requires_grad=False)

        def unquantized_weight(self, dtype, device):
            base = super().unquantized_weight(dtype, device)
            return (self.svd_up @ self.svd_down).to(dtype) + base if self.svd_done else base

        @torch.no_grad()
        def quantize(self, device=None):
            if self.svd_done:
                return
            self.svd_done = True
            W = super().unquantized_weight(torch.float32, device)
            U, S, Vh = torch.linalg.svd(W, full_matrices=False)
            down = Vh[:self.rank].contiguous().to(self.svd_dtype)
            up = (U[:, :self.rank] * S[:self.rank]).contiguous().to(self.svd_dtype)
            self.requires_grad_(False)
            self.svd_up = torch.nn.Parameter(up, requires_grad=False)
            self.svd_down = torch.nn.Parameter(down, requires_grad=False)
            self.weight.data = (W - up @ down).to(self.weight.dtype)  # the residual, quantized next
            super().quantize(device=device)

        def forward(self, x):
            return torch.nn.functional.linear(torch.nn.functional.linear(x, self.svd_down), self.svd_up) \\
                + super().forward(x)

        def forward_with_lora(self, x, lora_down, lora_up, dropout, alpha):
            r = lora_down.weight.shape[0]
            h = torch.nn.functional.linear(x, torch.cat([lora_down.weight, self.svd_down]))
            if dropout.p > 0 and self.training:
                h[..., :r] = dropout(h[..., :r])
            up = torch.cat([lora_up.weight * (alpha / r), self.svd_up], dim=1)
            return torch.nn.functional.linear(h, up) + super().forward(x)

    return LinearSVD
'''

FILES["modules/util/quantization_util.py"] = '''
from functools import partial

import torch
from torch import nn

from modules.module.quantized.mixin.QuantizedLinearMixin import QuantizedLinearMixin
from modules.module.quantized.mixin.QuantizedModuleMixin import QuantizedModuleMixin


def quantize_fp8_tensorwise(x):
    scale = (x.abs().max().float() / 448.0).clamp(min=1e-30)
    return x.float().mul(1.0 / scale).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def replace_linear_with_quantized_layers(parent_module, dtype, keep_in_fp32_modules=None, quantization=None,
                                         copy_parameters=False):
    from modules.module.quantized.LinearFp8 import LinearFp8
    from modules.module.quantized.LinearSVD import make_svd_linear
    from modules.module.quantized.LinearW8A8 import LinearW8A8

    if dtype.quantize_fp8():
        cls, kwargs = LinearFp8, {}
    elif dtype.quantize_fpW8A8():
        cls, kwargs = LinearW8A8, {"dtype": torch.float8_e4m3fn}
    else:
        return
    if quantization is not None and quantization.svd_dtype.value != "NONE":
        cls = make_svd_linear(cls)
        kwargs.update(rank=quantization.svd_rank, svd_dtype=quantization.svd_dtype.torch_dtype(),
                      cache_dir=quantization.cache_dir)
    make = partial(cls, **kwargs)
    for name, child in list(parent_module.named_modules()):
        for attr, sub in list(child.named_children()):
            if type(sub) is nn.Linear and attr not in (keep_in_fp32_modules or []):
                q = make(in_features=sub.in_features, out_features=sub.out_features, bias=sub.bias is not None,
                         device="meta")
                if copy_parameters:
                    q.weight = nn.Parameter(sub.weight, requires_grad=False)
                    if sub.bias is not None:
                        q.bias = nn.Parameter(sub.bias, requires_grad=False)
                setattr(child, attr, q)


def is_quantized_parameter(module, name):
    from modules.module.quantized.LinearFp8 import LinearFp8
    from modules.module.quantized.LinearSVD import BaseLinearSVD
    from modules.module.quantized.LinearW8A8 import LinearW8A8

    if isinstance(module, BaseLinearSVD) and name in ("svd_up", "svd_down"):
        return True
    return isinstance(module, (LinearFp8, LinearW8A8)) and name == "weight"


def quantize_layers(module, device, train_dtype, config, compress=False):
    for child in list(module.modules()):
        if isinstance(child, QuantizedModuleMixin):
            child.compute_dtype = train_dtype.torch_dtype()
            child.quantize(device=device)


def get_unquantized_weight(module, dtype, device):
    assert isinstance(module, nn.Linear)
    if isinstance(module, QuantizedLinearMixin):
        return module.unquantized_weight(dtype, device)
    return module.weight.detach().to(dtype=dtype)


def get_weight_shape(module):
    return torch.Size((module.out_features, module.in_features))
'''

FILES["modules/modelLoader/mixin/HFModelLoaderMixin.py"] = '''
import torch

from modules.util.quantization_util import is_quantized_parameter, replace_linear_with_quantized_layers


class HFModelLoaderMixin:
    def _convert_diffusers_sub_module_to_dtype(self, sub_module, dtype, train_dtype, quantization=None):
        replace_linear_with_quantized_layers(sub_module, dtype, [], quantization, copy_parameters=True)
        target = train_dtype.torch_dtype() if dtype.is_quantized() else dtype.torch_dtype()
        for _, module in sub_module.named_modules():
            for is_buffer, store in ((False, module._parameters), (True, module._buffers)):
                for name, value in list(store.items()):
                    if value is None or not torch.is_floating_point(value) or is_quantized_parameter(module, name):
                        continue
                    if is_buffer:  # in place: a LinearFp8's _scale is this same tensor, and follows
                        store[name].data = value.to(dtype=target)
                    else:
                        store[name] = type(value)(value.to(dtype=target))
        return sub_module
'''

FILES["modules/module/LoRAModule.py"] = '''
import math

import torch
import torch.nn.functional as F
from torch import nn

from modules.module.FusedModule import FusedModuleGroup
from modules.module.quantized.LinearSVD import BaseLinearSVD
from modules.util.quantization_util import get_unquantized_weight, get_weight_shape


class PeftBase(nn.Module):
    def __init__(self, prefix, orig_module):
        super().__init__()
        self.prefix = prefix + "."
        self._orig_module = [orig_module] if orig_module is not None else None
        self.is_applied = False
        self.layer_kwargs = {}
        self._initialized = False
        if isinstance(orig_module, nn.Linear):
            self.op, self.shape = F.linear, get_weight_shape(orig_module)
        elif isinstance(orig_module, nn.Conv2d):
            self.op, self.shape = F.conv2d, orig_module.weight.shape
            self.layer_kwargs.update(stride=orig_module.stride, padding=orig_module.padding,
                                     dilation=orig_module.dilation, groups=orig_module.groups)
        elif orig_module is not None:
            raise NotImplementedError("Linear and Conv2d only")

    @property
    def orig_module(self):
        return self._orig_module[0]

    def hook_to_module(self):
        if not self.is_applied:
            self.orig_forward = self.orig_module.forward
            self.orig_module.forward = self.forward  # a bound method: the class's forward as of now
            self.is_applied = True

    def make_weight(self, A, B):
        return (B.view(B.size(0), -1) @ A.view(A.size(0), -1)).view(self.shape)

    def check_initialized(self):
        if not self._initialized:
            raise RuntimeError(f"Module {self.prefix} is not initialized.")

    def create_layer(self):
        m = self.orig_module
        dev = m.weight.device
        if isinstance(m, nn.Linear):
            return (nn.Linear(m.in_features, self.rank, bias=False, device=dev),
                    nn.Linear(self.rank, m.out_features, bias=False, device=dev))
        return (nn.Conv2d(m.in_channels, self.rank, m.kernel_size, m.stride, m.padding, dilation=m.dilation,
                          bias=False, device=dev),
                nn.Conv2d(self.rank, m.out_channels // m.groups, (1, 1), 1, bias=False, device=dev))


class LoRAModule(PeftBase):
    def __init__(self, prefix, orig_module, rank, alpha):
        super().__init__(prefix, orig_module)
        self.rank = rank
        self.dropout = nn.Dropout(0)
        self.register_buffer("alpha", torch.tensor(alpha))
        if orig_module is not None:
            self.initialize_weights()
        self.alpha.requires_grad_(False)

    def initialize_weights(self):
        self._initialized = True
        self.lora_down, self.lora_up = self.create_layer()
        nn.init.kaiming_uniform_(self.lora_down.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_up.weight)

    def forward(self, x, *args, **kwargs):
        self.check_initialized()
        if isinstance(self.orig_module, BaseLinearSVD):
            return self.orig_module.forward_with_lora(x, self.lora_down, self.lora_up, self.dropout, self.alpha)
        return self.orig_forward(x) + self.lora_up(self.dropout(self.lora_down(x))) * (self.alpha / self.rank)


class DoRAModule(LoRAModule):
    def __init__(self, *args, **kwargs):
        self.dora_scale = None
        self.norm_epsilon = kwargs.pop("norm_epsilon", False)
        self.decompose_output_axis = kwargs.pop("decompose_output_axis", False)
        self.train_device = kwargs.pop("train_device")
        super().__init__(*args, **kwargs)

    def _base_weight(self):
        if isinstance(self.orig_module, nn.Linear):
            return get_unquantized_weight(self.orig_module, torch.float, self.train_device)
        return self.orig_module.weight.detach().float()

    def _norm(self, W):  # over every axis but the decomposed one, as a shape that broadcasts against W
        if self.decompose_output_axis:
            return W.reshape(W.shape[0], -1).norm(dim=1).reshape(W.shape[0], *[1] * (W.dim() - 1))
        return W.transpose(0, 1).reshape(W.shape[1], -1).norm(dim=1).reshape(W.shape[1], *[1] * (W.dim() - 1)) \\
            .transpose(0, 1)

    def initialize_weights(self):
        super().initialize_weights()
        self.dora_scale = nn.Parameter(self._norm(self._base_weight()).to(self.orig_module.weight.device))

    def forward(self, x, *args, **kwargs):
        self.check_initialized()
        WP = self._base_weight() + self.make_weight(self.lora_down.weight, self.lora_up.weight) * (
            self.alpha / self.rank)
        norm = self._norm(WP.detach()) + (torch.finfo(WP.dtype).eps if self.norm_epsilon else 0.0)
        return self.op(self.dropout(x), self.dora_scale * (WP / norm), self.orig_module.bias, **self.layer_kwargs)


def _matches(pattern, key):  # a "{...}" segment of the pattern stands for any one segment of the name
    p, k = pattern.split("."), key.split(".")
    return len(p) == len(k) and all(a == b or a.startswith("{") for a, b in zip(p, k))


def fused_groups(fusion_spec, selected):
    """(fused name, leaf names) of every group whose leaves are all selected and read the same input."""
    groups, taken = [], set()
    for pattern, leaves, fused_suffix, _ in fusion_spec or []:
        keys = [{n[: -len(leaf) - 1] for n in selected if n.endswith("." + leaf)
                 and _matches(pattern, n[: -len(leaf) - 1])} for leaf in leaves]
        for key in sorted(set.intersection(*keys)):
            names = [f"{key}.{leaf}" for leaf in leaves]
            if taken.isdisjoint(names) and len({selected[n].in_features for n in names}) == 1:
                groups.append((f"{key}.{fused_suffix}", names))
                taken.update(names)
    return groups


class LoRAModuleWrapper:  # a module per selected Linear / Conv2d named by its path, or per fused q/k/v group
    def __init__(self, orig_module, prefix, config, module_filter=None, fusion_spec=None, fuse=None):
        self.prefix = prefix
        if config.lora_decompose:
            klass, kwargs = DoRAModule, {"norm_epsilon": config.lora_decompose_norm_epsilon,
                                         "decompose_output_axis": config.lora_decompose_output_axis,
                                         "train_device": torch.device(config.train_device)}
        else:
            klass, kwargs = LoRAModule, {}
        name_of = (lambda name: f"{prefix}.{name}" if prefix else name)
        selected = {name: m for name, m in orig_module.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))
                    and (not module_filter or any(f in name for f in module_filter))}
        self.lora_modules = {}
        if (fusion_spec is not None) if fuse is None else fuse:
            for fused, names in fused_groups(fusion_spec, selected):
                self.lora_modules[fused] = FusedModuleGroup(name_of(fused), [selected.pop(n) for n in names], klass,
                                                            [config.lora_rank, config.lora_alpha], kwargs)
        self.lora_modules |= {name: klass(name_of(name), m, config.lora_rank, config.lora_alpha, **kwargs)
                              for name, m in selected.items()}

    def parameters(self):
        return [p for m in self.lora_modules.values() for p in m.parameters()]

    def to(self, device=None, dtype=None):
        for m in self.lora_modules.values():
            m.to(device, dtype)
        return self

    def state_dict(self):
        out = {}
        for m in self.lora_modules.values():
            out |= m.state_dict(prefix=m.prefix)
        return out

    def hook_to_module(self):
        for m in self.lora_modules.values():
            m.hook_to_module()
'''

FILES["modules/module/FusedModule.py"] = '''
import itertools

import torch
from torch import nn

from modules.module.quantized.mixin.QuantizedLinearMixin import QuantizedLinearMixin
from modules.util.quantization_util import get_unquantized_weight


class _FusedLinear(nn.Linear, QuantizedLinearMixin):
    def __init__(self, leaves):
        super().__init__(leaves[0].in_features, sum(leaf.out_features for leaf in leaves), bias=False, device="meta")
        self._leaves = leaves
        self._leaf_forwards = [leaf.forward for leaf in leaves]  # taken before the leaves are hooked
        self.weight = nn.Parameter(torch.empty(0, device=leaves[0].weight.device), requires_grad=False)

    def reset_parameters(self):
        pass

    def forward(self, x, *args, **kwargs):
        return torch.cat([f(x) for f in self._leaf_forwards], dim=-1)

    @property
    def bias(self):  # the leaves' biases side by side (zeros for a leaf without one), None if none has one
        biases = [leaf.bias for leaf in self._leaves]
        ref = next((b for b in biases if b is not None), None)
        if ref is None:
            return None
        return torch.cat([b if b is not None else ref.new_zeros(leaf.out_features)
                          for leaf, b in zip(self._leaves, biases)])

    def original_weight_shape(self):
        return (self.out_features, self.in_features)

    def unquantized_weight(self, dtype, device):
        return torch.cat([get_unquantized_weight(leaf, dtype, device) for leaf in self._leaves], dim=0)


class FusedModuleGroup:
    def __init__(self, prefix, leaves, klass, additional_args, additional_kwargs):
        self.leaves = leaves
        self.synthetic = _FusedLinear(leaves)
        self.module = klass(prefix, self.synthetic, *additional_args, **additional_kwargs)
        self.module.orig_forward = self.synthetic.forward
        self.module.is_applied = True
        self.prefix = self.module.prefix
        ends = list(itertools.accumulate(leaf.out_features for leaf in leaves))
        self.slices = list(zip([0] + ends[:-1], ends))

    def _leaf_forward(self, start, end):
        def forward(x, *args, **kwargs):
            return self.module.forward(x)[..., start:end]  # DoRA: the whole fused forward, for every leaf
        return forward

    def hook_to_module(self):
        for leaf, (start, end) in zip(self.leaves, self.slices):
            leaf.forward = self._leaf_forward(start, end)

    def parameters(self):
        return self.module.parameters()

    def state_dict(self, prefix=""):
        return self.module.state_dict(prefix=prefix)

    def to(self, device=None, dtype=None):
        self.module.to(device, dtype)
        return self

    @property
    def dropout(self):
        return self.module.dropout
'''

FILES["modules/util/enum/ModelType.py"] = '''
from enum import Enum


class PeftType(Enum):
    LORA = "LORA"
'''
