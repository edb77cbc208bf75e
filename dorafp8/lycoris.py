"""LyCORIS (lycoris-lora) LoCon / LoRA, with or without DoRA (`dora_wd`), on dorafp8's fp8 layers, computed by the
fused ops with LyCORIS's own parameters and keys. Why this hook, and the math: docs/ARCHITECTURE.md,
"dorafp8/lycoris.py"."""

from __future__ import annotations

import contextlib
import functools
import math
import warnings

import torch
from lycoris.modules.base import LycorisBaseModule
from lycoris.modules.locon import LoConModule
from torch import Tensor, nn

from .nn import FP8ConvNd, FP8Linear
from .nn.conv import NN_CONV
from .ops import dora_fp8_conv, dora_fp8_linear, weight_norm
from .merge import adapted_row_blocks, column_norms
from .quant import dequantize_weight

FP8_LAYERS = (FP8Linear, FP8ConvNd)


def _torch_class(fp8_cls: type) -> type:
    return nn.Linear if issubclass(fp8_cls, FP8Linear) else NN_CONV[fp8_cls._nd]


def _dense_weight(layer: nn.Module) -> Tensor:
    """scale * w8 in fp32, in the layer's own layout (from the parameter: `weight` is the view's)."""
    w8 = layer._parameters["weight"]
    w = dequantize_weight(w8.reshape(w8.shape[0], -1), layer.scale, torch.float32, block_size=layer.block_size,
                          global_scale=getattr(layer, "global_scale", None))  # every kind (NVFP4's packed [N, K/2])
    return w if isinstance(layer, FP8Linear) else w.view(w8.shape)


# ---- 1. the view class fp8 layers wear while LyCORIS looks at them ---------------------------------------------------


@functools.cache
def _view_class(fp8_cls: type) -> type:
    torch_cls = _torch_class(fp8_cls)

    def __new__(cls, *args, **kwargs):  # LoConModule's `self.module(in, r, k, stride, padding, bias=False)`
        return torch_cls(*args, **kwargs)

    return type(torch_cls.__name__, (fp8_cls, torch_cls), {
        "__new__": __new__,
        "weight": property(_dense_weight),
        "__module__": __name__,
        "__doc__": f"{fp8_cls.__name__} as LyCORIS reads an {torch_cls.__name__} (dorafp8/lycoris.py)",
        "_dorafp8_view_of": fp8_cls,
    })


@contextlib.contextmanager
def _fp8_layers_visible(*roots: nn.Module):
    """Within the block, every dorafp8 fp8 layer under `roots` is an instance of its view class (an nn.Linear /
    nn.ConvNd to isinstance and to class-name matching, with a dense fp32 `weight`). Nested use is a no-op."""
    worn = []
    try:
        for root in roots:
            for m in root.modules():
                cls = type(m)
                if isinstance(m, FP8_LAYERS) and "_dorafp8_view_of" not in cls.__dict__:
                    m.__class__ = _view_class(cls)
                    worn.append((m, cls))
        yield
    finally:
        for m, cls in reversed(worn):
            m.__class__ = cls


def _modules_among(args, kwargs):
    """The nn.Modules passed to a LyCORIS network constructor (kohya passes a list of text encoders)."""
    for v in (*args, *kwargs.values()):
        if isinstance(v, nn.Module):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from (t for t in v if isinstance(t, nn.Module))


# ---- the weight norm with LyCORIS's gradient -------------------------------------------------------------------------


class _AdapterNorm(torch.autograd.Function):
    """||V|| (fp32) for V = W0 + s B A [N, K] with W0 = scale * w8: per row (axis 0; the fused weight_norm op) or per
    input column, the squares of each `group` consecutive columns summed (axis 1: a conv's per-input-channel norm over
    its kernel). Unlike the DoRA ops' norm it has a gradient, LyCORIS's: dL/dV = (dL/dn / ||V||) * V along the axis
    (0 where ||V|| = 0, as torch's norm backward), pulled back to A and B in fp32 row blocks."""

    @staticmethod
    def forward(ctx, A, B, w8, scale, block_size, s, axis, group, backend, global_scale):
        if axis == 0:
            n = weight_norm(w8, scale, A, B, s, backend=backend, block_size=block_size, global_scale=global_scale)
        else:
            n = column_norms(w8, scale, block_size, A, B, s, group, global_scale)
        ctx.save_for_backward(A, B, w8, scale, n, global_scale)
        ctx.args = (block_size, s, axis, group)
        return n

    @staticmethod
    def backward(ctx, gn):
        A, B, w8, scale, n, global_scale = ctx.saved_tensors
        block_size, s, axis, group = ctx.args
        with torch.autocast(w8.device.type, enabled=False):
            kappa = torch.where(n > 0, gn.float() / n, torch.zeros_like(n))
            if axis == 1:
                kappa = kappa.repeat_interleave(group)
            A32, B32 = A.detach().float(), B.detach().float()
            dA, dB = torch.zeros_like(A32), torch.empty_like(B32)
            for j0, j1, V in adapted_row_blocks(w8, scale, block_size, A32, B32, s, global_scale):
                G = V.mul_(kappa[j0:j1, None] if axis == 0 else kappa)  # dL/dV for these rows
                torch.mm(G, A32.t(), out=dB[j0:j1])
                dA.addmm_(B32[j0:j1].t(), G, alpha=s)
            dB.mul_(s)
        return (dA.to(A.dtype) if ctx.needs_input_grad[0] else None,
                dB.to(B.dtype) if ctx.needs_input_grad[1] else None) + (None,) * 8


# ---- 2. the LoCon module on an fp8 layer -----------------------------------------------------------------------------


class FP8LoConModule(LoConModule):
    """LyCORIS's LoConModule (algo "locon" / "lora") on a dorafp8 FP8Linear / FP8ConvNd: LyCORIS's parameters and keys,
    the forward computed by dora_fp8_linear / dora_fp8_conv. Made by converting a LoConModule LyCORIS built."""

    # What the forward reads of LyCORIS's LoConModule: a release that renamed one is refused on conversion.
    _LOCON_ATTRS = ("lora_down", "lora_up", "scale", "scalar", "multiplier", "wd", "tucker", "rank_dropout",
                    "rank_dropout_scale", "module_dropout", "bypass_mode", "org_module", "org_forward", "alpha")

    @classmethod
    def convert(cls, lora: LoConModule, layer: nn.Module) -> None:
        name = getattr(lora, "lora_name", "?")
        missing = [a for a in cls._LOCON_ATTRS if not hasattr(lora, a)]
        if getattr(lora, "wd", False):
            missing += [a for a in ("dora_scale", "wd_on_out") if not hasattr(lora, a)]
        if missing:
            import importlib.metadata

            raise RuntimeError(f"dorafp8 cannot run lycoris-lora {importlib.metadata.version('lycoris-lora')} on the "
                               f"fp8 layer {name!r}: its LoConModule has no {', '.join(missing)}. dorafp8 is tested "
                               f"with lycoris-lora 3.4 and 4.1")
        if isinstance(layer, FP8ConvNd):
            if layer.groups != 1:
                raise NotImplementedError(
                    f"LyCORIS on the fp8 conv {name!r} with groups={layer.groups}: LyCORIS's grouped LoCon (one "
                    f"lora_down of in_channels/groups shared by all groups) has no fused dorafp8 op; exclude the layer "
                    f"(a preset's exclude_name) or keep it unquantized")
            if layer.conv_padding() is None:
                raise NotImplementedError(
                    f"LyCORIS on the fp8 conv {name!r} with padding_mode={layer.padding_mode!r} / padding="
                    f"{layer.padding!r}: LyCORIS pads its weight difference with zeros and the base with the layer's "
                    f"mode, which the fused conv (one padding) does not reproduce; exclude the layer or keep it "
                    f"unquantized")
        lora.module = _torch_class(getattr(type(layer), "_dorafp8_view_of", type(layer)))
        lora.__class__ = cls

    # ---- the forward ---------------------------------------------------------------------------------------------

    def _factors(self, device) -> tuple[Tensor, Tensor]:
        """(D, U): lora_down as lora_A (lora_mid composed in), lora_up [N, r] * `scalar`, rank dropout in training."""
        D = self.lora_down.weight
        if self.tucker:  # lycoris rebuild_tucker: dW[p, q, k] = sum_ij mid[i, j, k] up[p, i] down[j, q]
            D = torch.einsum("ij...,jq->iq...", self.lora_mid.weight, D.reshape(D.shape[0], -1))
        up = self.lora_up.weight
        U = up.reshape(up.shape[0], -1)
        if self.training and self.rank_dropout:
            drop = (torch.rand(U.shape[0], device=device) > self.rank_dropout).to(U.dtype)
            if self.rank_dropout_scale:
                drop /= drop.mean()
            U = U * drop[:, None]
        return D, U * self.scalar.to(U.device)

    def _fused(self, layer, x: Tensor, A: Tensor, U: Tensor, magnitude: Tensor, scaling: float,
               n: Tensor) -> Tensor:
        if isinstance(layer, FP8Linear):
            return dora_fp8_linear(x, layer.fp8_weight(), layer.scale, A, U, magnitude, scaling, layer.bias,
                                   backend=layer.backend, weight_norm=n, block_size=layer.block_size,
                                   act_quant=layer.act_quant, global_scale=layer.global_scale)
        return dora_fp8_conv(x, layer.fp8_weight(), layer.scale, A, U.reshape(U.shape + (1,) * layer._nd),
                             magnitude, scaling, layer.bias, layer.stride, layer.conv_padding(), layer.dilation,
                             layer.groups, backend=layer.backend, weight_norm=n, block_size=layer.block_size)

    def _norm(self, layer, A: Tensor, U: Tensor, axis: int) -> Tensor:
        """LyCORIS's ||V|| + eps, with its gradient, per output (axis 0) or input (axis 1) row / channel."""
        w8 = layer.fp8_weight()
        group = math.prod(w8.shape[2:])  # axis 1 of a conv: the kernel's columns of one input channel
        n = _AdapterNorm.apply(A.reshape(A.shape[0], -1), U, w8.reshape(w8.shape[0], -1), layer.scale,
                               layer.block_size, float(self.scale), axis, group, layer.backend,
                               getattr(layer, "global_scale", None))
        return n + torch.finfo(self.dora_scale.dtype).eps  # LyCORIS: ||W'|| + eps of dora_scale's dtype

    def forward(self, x, *args, **kwargs):
        # LoConModule.forward's order of random draws: module dropout, then (in _factors) the rank-dropout mask.
        if self.module_dropout and self.training:
            if torch.rand(1) < self.module_dropout:
                return self.org_forward(x, *args, **kwargs)
        if self.bypass_mode:  # LyCORIS's own: the layer's forward plus its low-rank path on x (no weight read)
            return self.bypass_forward(x, scale=self.multiplier)
        layer = self.org_module[0]
        A, U = self._factors(x.device)
        s, mult = float(self.scale), self.multiplier
        ones = torch.ones(U.shape[0], dtype=torch.float32, device=x.device)
        if not self.wd:
            return self._fused(layer, x, A, U, ones, s * mult, ones)
        if self.wd_on_out:
            nv = self._norm(layer, A, U, 0)
            n = nv.detach()
            m = self.dora_scale.reshape(-1)
            # m * (n / nv) is m itself (n / nv = 1), with the norm's gradient: d/dnv of c = m / nv
            magnitude = m * (n / nv) if mult == 1 else mult * m * (n / nv) + (1 - mult) * n
            return self._fused(layer, x, A, U, magnitude, s, n)
        c = self.dora_scale.reshape(-1) / self._norm(layer, A, U, 1)
        if mult != 1:
            c = mult * (c - 1) + 1
        nd = layer._nd if isinstance(layer, FP8ConvNd) else 0
        xc = (x * c.reshape((-1,) + (1,) * nd)).to(x.dtype)  # x W'^T with W' = V diag(c) is (x * c) V^T
        return self._fused(layer, xc, A, U, ones, s, ones)

    # ---- what LyCORIS reads of the base weight ---------------------------------------------------------------------

    def _current_weight(self):
        return _dense_weight(self.org_module[0])

    @property
    def org_weight(self):
        """The dequantized base weight (fp32, a transient) for LyCORIS's merged-weight helpers."""
        return _dense_weight(self.org_module[0])

    @org_weight.setter
    def org_weight(self, value):
        raise NotImplementedError(self._no_merge())

    def _no_merge(self) -> str:
        return (f"merging LyCORIS into the fp8 layer {self.lora_name!r} would re-quantize the merged weight: save "
                f"the network (save_weights) and merge the file onto the full-precision model (LyCORIS's merge_to "
                f"there, or ComfyUI / Forge at load time)")

    def merge_to(self, *args, **kwargs):
        raise NotImplementedError(self._no_merge())

    def onfly_merge(self, *args, **kwargs):
        raise NotImplementedError(self._no_merge())

    def apply_to(self, **kwargs):
        # LyCORIS stacks a second network on a layer by chaining forwards (org_forward = the first module's forward,
        # an instance attribute of the layer); this forward computes the base itself and would drop the first one.
        owner = getattr(vars(self.org_module[0]).get("forward"), "__self__", None)
        if isinstance(owner, LycorisBaseModule) and owner is not self:
            raise NotImplementedError(f"a second LyCORIS network on the fp8 layer {self.lora_name!r}: the fused "
                                      f"forward computes the layer's base itself, so it cannot stack on another "
                                      f"network's; restore() the first one, or merge several into one network")
        return super().apply_to(**kwargs)


# ---- 3. the wraps ----------------------------------------------------------------------------------------------------


def _network_init(orig):
    @functools.wraps(orig)
    def __init__(self, *args, **kwargs):
        roots = list(_modules_among(args, kwargs))
        with _fp8_layers_visible(*roots):
            orig(self, *args, **kwargs)
        n_fp8 = sum(isinstance(m, FP8_LAYERS) for r in roots for m in r.modules())
        made = [m for v in vars(self).values() if isinstance(v, list) for m in v if isinstance(m, LycorisBaseModule)]
        if n_fp8 and not made and not kwargs.get("init_only"):  # never train nothing silently
            warnings.warn(f"LyCORIS created no module, and the model holds {n_fp8} dorafp8 fp8 layers: nothing would "
                          f"train. Check the preset's targets; if they name these layers, this LyCORIS is a version "
                          f"dorafp8 does not support (tested: lycoris-lora 3.4 and 4.1)", RuntimeWarning, stacklevel=2)
    return __init__


def _locon_init(orig):
    @functools.wraps(orig)
    def __init__(self, lora_name, org_module, *args, **kwargs):
        if type(self) is not LoConModule or not isinstance(org_module, FP8_LAYERS):
            return orig(self, lora_name, org_module, *args, **kwargs)
        with _fp8_layers_visible(org_module):
            orig(self, lora_name, org_module, *args, **kwargs)
        FP8LoConModule.convert(self, org_module)
    return __init__


def _base_init(orig):
    @functools.wraps(orig)
    def __init__(self, lora_name, org_module, *args, **kwargs):
        if isinstance(org_module, FP8_LAYERS) and type(self) is not LoConModule:
            kind = getattr(type(org_module), "_dorafp8_view_of", type(org_module)).__name__
            raise NotImplementedError(
                f"LyCORIS's {type(self).__name__} on the dorafp8 fp8 layer {lora_name!r} ({kind}): only LoCon / LoRA "
                f"(algo='locon' or 'lora', with or without dora_wd) runs on fp8 layers. Use algo='locon', keep this "
                f"layer out of the network (a preset's exclude_name), or leave it unquantized (dorafp8.quantize_model "
                f"with the names to quantize)")
        return orig(self, lora_name, org_module, *args, **kwargs)
    return __init__


def _wrap(cls: type, make) -> None:
    orig = cls.__dict__["__init__"]
    if getattr(orig, "_dorafp8_orig", None) is None:  # idempotent
        new = make(orig)
        new._dorafp8_orig = orig
        cls.__init__ = new


def register_with_lycoris() -> None:
    """Teaches LyCORIS's constructors to put LoCon / LoRA modules (DoRA with dora_wd=True) on FP8Linear / FP8ConvNd
    layers, computed by the fused ops (other algorithms on an fp8 layer raise). Run by `import dorafp8`; idempotent."""
    from lycoris.wrapper import LycorisNetwork

    _wrap(LycorisNetwork, _network_init)
    try:
        from lycoris.kohya import LycorisNetworkKohya
    except Exception:  # lycoris/__init__.py imports kohya in a try too: it needs kohya's optional dependencies
        LycorisNetworkKohya = None
    if LycorisNetworkKohya is not None and "__init__" in LycorisNetworkKohya.__dict__:
        _wrap(LycorisNetworkKohya, _network_init)
    _wrap(LoConModule, _locon_init)
    _wrap(LycorisBaseModule, _base_init)


register_with_lycoris()  # idempotent; dorafp8/_install.py imports this module when lycoris gets imported
