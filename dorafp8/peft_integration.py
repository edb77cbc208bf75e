"""PEFT integration: DoRAFP8Linear (a PEFT LoRA Linear on an FP8Linear base), conversion, and registration.

DoRAFP8Linear subclasses PEFT's own `lora.Linear`, so everything PEFT does around a layer keeps working:
adapter state_dict keys (`lora_A.<name>.weight`, `lora_B.<name>.weight`, `lora_magnitude_vector.<name>.weight`),
save_pretrained/load_adapter, set_adapter, disable_adapter, several adapters per layer. Only three things change:
the base layer is an FP8Linear, the DoRA magnitude is initialised from the fp8 weight, and the forward of the usual
case (one active DoRA adapter) is one fused dorafp8 call instead of PEFT's dense [N, K] temporaries.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from peft.tuners.lora import layer as lora_layer
from peft.tuners.lora.dora import DoraLinearLayer
from peft.tuners.lora.model import LoraModel
from peft.tuners.lora.variants import DoraLinearVariant
from peft.tuners import tuners_utils
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils.constants import INCLUDE_LINEAR_LAYERS_SHORTHAND

from .backends import check_backend_name
from .distributed import params_are_sharded
from .fp8_conv import _FP8ConvNd
from .fp8_linear import FP8Linear, is_fp8_cast_layer, to_fp8_layer
from .norm_cache import WeightNormCache
from .ops import NORM_EPS, dora_fp8_linear, fp8_linear, weight_norm

_MERGE_ERROR = (
    "DoraFP8Variant does not merge into a dense weight: the base weight is fp8. DoRAFP8Linear.merge (and PEFT's "
    "merge_and_unload / merge_adapter, which call it) merges in fp32 row blocks and re-quantizes to e4m3."
)
_MERGE_WARNING = (
    "merging DoRA adapters into an fp8 base re-quantizes the merged weight to e4m3 ({} scales; "
    "DoRAFP8Linear.merge_granularity chooses). dorafp8.export_merged writes merged checkpoints in the layout you "
    "deploy and reports the error of every layer"
)


class _FP8DoraVariantMixin:
    """What the DoRA variants on fp8 bases share: the init with the magnitude from the fp8 weight, no merge into a
    dense weight (`_merge_error` says what to do instead), and PEFT's general-path composition with the base product
    taken from the fp8 layer. A variant gives `_magnitude(module, m)`: PEFT's magnitude holder class for the layer
    type and the magnitude m [N] in the shape it holds."""

    _merge_error: str

    @classmethod
    def merge_safe(cls, module, active_adapter, orig_weight):
        raise NotImplementedError(cls._merge_error)

    @classmethod
    def merge_unsafe(cls, module, active_adapter, orig_weight):
        raise NotImplementedError(cls._merge_error)

    @classmethod
    def unmerge(cls, module, active_adapter, orig_weight):
        raise NotImplementedError(cls._merge_error)

    @classmethod
    def init(cls, module: "_DoRAFP8Layer", adapter_name: str, **kwargs: Any) -> None:
        # PEFT's DoRA init, with the magnitude (the row norms of W0 + s B A) computed from the fp8 weight.
        if not module.lora_magnitude_vector:
            module.adapter_layer_names = module.adapter_layer_names[:] + ("lora_magnitude_vector",)
        dtype = module.lora_A[adapter_name].weight.dtype
        n = module.dora_weight_norm(adapter_name, use_cache=False)
        m = n.to(dtype)
        if not torch.isfinite(m).all():  # n is finite (fp8 weights, finite scale); a narrow adapter dtype may not be
            raise ValueError(f"the DoRA magnitude of adapter {adapter_name!r} (the row norms of the weight, up to "
                             f"{float(n.max()):.4g}) overflows {dtype}; create the adapters in float32 (PEFT's "
                             f"autocast_adapter_dtype=True, the default, does)")
        holder, m = cls._magnitude(module, m)
        dora_layer = holder(fan_in_fan_out=False)
        dora_layer.weight = nn.Parameter(m, requires_grad=True)
        module.lora_magnitude_vector[adapter_name] = dora_layer

    @staticmethod
    def forward(module: "_DoRAFP8Layer", active_adapter: str, x: torch.Tensor, result: torch.Tensor,
                **kwargs) -> torch.Tensor:
        # The general path (several active adapters, a LoRA bias, for convs a padding mode other than zeros): PEFT's
        # exact composition, where `result` already holds the base output plus the adapters before this one.
        lora_A = module.lora_A[active_adapter]
        lora_B = module.lora_B[active_adapter]
        dropout = module.lora_dropout[active_adapter]
        scaling = module.scaling[active_adapter]
        base = module._fp8_base()
        if isinstance(dropout, nn.Identity) or not module.training:
            base_result = result if base.bias is None else result - module._per_channel(base.bias)
        else:
            x = dropout(x)
            base_result = module._base_product(base, x)
        n = module.dora_weight_norm(active_adapter).clamp_min(NORM_EPS)
        c = module._per_channel(module.lora_magnitude_vector[active_adapter].weight.reshape(-1) / n)
        return result + (c - 1) * base_result + c * lora_B(lora_A(x)) * scaling


class DoraFP8Variant(_FP8DoraVariantMixin, DoraLinearVariant):
    """PEFT's DoRA variant on an FP8Linear base: magnitude from the fp8 weight, no dense [N, K] temporaries."""

    _merge_error = _MERGE_ERROR

    @staticmethod
    def _magnitude(module: "DoRAFP8Linear", m: torch.Tensor):
        return DoraLinearLayer, m


class _DoRAFP8Layer:
    """What the dorafp8 PEFT layers (DoRAFP8Linear, DoRAFP8Conv1d/2d/3d) share: the backend switch, the per-adapter
    weight-norm cache, the dispatch to the fused op, and the conversion from a PEFT layer. A layer class gives
    `_dora_variant`, `_fp8_base()` (its FP8Linear / FP8ConvNd), `_weight_norm(base, A, B, s)`, `_per_channel(v)`
    (a per-output-channel vector shaped to broadcast over outputs), `_base_product(base, x)` (the base without bias)
    and `_fused_call(x, adapter, dropout_p)`."""

    _dora_variant: type
    _io_names = ("in_features", "out_features")  # how extra_repr names in_features / out_features

    def __init__(self, base_layer, adapter_name: str, config, r: int = 0, lora_alpha: int = 1, **kwargs):
        self._dorafp8_norm_cache = WeightNormCache()
        super().__init__(base_layer, adapter_name, config=config, r=r, lora_alpha=lora_alpha, **kwargs)

    def _fp8_base(self):
        return self.get_base_layer()

    @property
    def lora_variants(self):
        return {(): None, ("use_dora",): self._dora_variant}

    @property
    def backend(self) -> str:
        return self._fp8_base().backend

    @backend.setter
    def backend(self, name: str) -> None:
        self._fp8_base().backend = check_backend_name(name)
        self.clear_weight_norm_cache()

    def clear_weight_norm_cache(self) -> None:
        self._dorafp8_norm_cache.clear()

    def dora_weight_norm(self, adapter: str, use_cache: bool = True) -> torch.Tensor:
        """The detached fp32 norm ||W0 + s B A|| of `adapter` per output row (channel), reused only where it provably
        equals the norm of the current tensors (dorafp8/norm_cache.py says where: always on the CPU, inside
        `dorafp8.reuse_weight_norms()` on a GPU)."""
        base = self._fp8_base()
        A, B = self.lora_A[adapter].weight, self.lora_B[adapter].weight
        s = self.scaling[adapter]

        def compute():
            return self._weight_norm(base, A, B, s)

        if not use_cache:
            return compute()
        return self._dorafp8_norm_cache.norm(adapter, compute, A, B, base.weight, base.scale, (s, base.backend),
                                             sharded=params_are_sharded(self, A, B))

    def _fused_adapter(self) -> str | None:
        """The adapter the fused path serves: exactly one active adapter, a DoRA one, without a LoRA bias."""
        active = [a for a in self.active_adapters if a in self.lora_A]
        if len(active) != 1:
            return None
        a = active[0]
        if not isinstance(self.lora_variant.get(a), self._dora_variant) or self.lora_B[a].bias is not None:
            return None
        return a

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        a = None
        if not (self.disable_adapters or self.merged or kwargs.get("adapter_names") is not None):
            a = self._fused_adapter()
        if a is None:
            return super().forward(x, *args, **kwargs)
        self._check_forward_args(x, *args, **kwargs)
        dropout = self.lora_dropout[a]
        return self._fused_call(x, a, dropout.p if isinstance(dropout, nn.Dropout) else 0.0)

    def extra_repr(self) -> str:
        ranks = ", ".join(f"{k}={v}" for k, v in self.r.items())
        i, o = self._io_names
        return f"{i}={self.in_features}, {o}={self.out_features}, r={{{ranks}}}, backend={self.backend}"

    def __repr__(self) -> str:
        return nn.Module.__repr__(self)

    @classmethod
    def _adopt(cls, layer: lora_layer.LoraLayer, fp8: nn.Module, backend: str, attrs: tuple[str, ...]):
        """A layer of this class on the fp8 base `fp8` that takes over the PEFT layer `layer`: its adapter modules
        (shared, not copied), its LoraLayer state and the extra attributes `attrs`."""
        fp8.backend = check_backend_name(backend)
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new._dorafp8_norm_cache = WeightNormCache()
        lora_layer.LoraLayer.__init__(new, fp8, ephemeral_gpu_offload=layer.ephemeral_gpu_offload, **layer.kwargs)
        for attr in ("r", "lora_alpha", "scaling", "use_dora", "use_rslora", "lora_bias", "merged_adapters",
                     "_disable_adapters", "_active_adapter", "cast_input_dtype_enabled") + attrs:
            if hasattr(layer, attr):
                setattr(new, attr, getattr(layer, attr))
        if "adapter_layer_names" in layer.__dict__:
            new.adapter_layer_names = layer.adapter_layer_names
        for attr in ("lora_A", "lora_B", "lora_dropout", "lora_embedding_A", "lora_embedding_B",
                     "lora_magnitude_vector"):
            setattr(new, attr, getattr(layer, attr))
        new.lora_variant = {name: cls._dora_variant() for name in layer.lora_variant}
        new.train(layer.training)
        return new


class DoRAFP8Linear(_DoRAFP8Layer, lora_layer.Linear):
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

        from .merge import adapter_terms, merged_rows, requantize
        from .quant import scale_kind

        adapter_names = check_adapters_to_merge(self, adapter_names)
        if not adapter_names:
            return
        base = self.get_base_layer()
        w8, scale, block = base.fp8_weight(), base.scale, base.block_size
        gran = self.merge_granularity if self.merge_granularity != "keep" else scale_kind(scale)
        terms = adapter_terms(self, adapter_names)
        new_w8, new_scale, stats = requantize(lambda j0, j1: merged_rows(w8, scale, block, terms, j0, j1),
                                              w8.shape[0], w8.shape[1], gran, block_size=block, device=w8.device)
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


def convert_peft_model(peft_model: nn.Module, *, backend: str = "auto", per_row_scale: bool = False) -> int:
    """Swaps every PEFT DoRA Linear in `peft_model` (on nn.Linear or transformers' Conv1D) for a DoRAFP8Linear, and
    every PEFT DoRA Conv1d/2d/3d for a DoRAFP8Conv1d/2d/3d (dorafp8/peft_conv.py), quantizing its base weight to fp8,
    in place. Returns how many layers were swapped."""
    from . import peft_conv

    check_backend_name(backend)
    names = [name for name, mod in peft_model.named_modules()
             if isinstance(mod, lora_layer.Linear) and not isinstance(mod, DoRAFP8Linear)
             and any(type(v) is DoraLinearVariant for v in mod.lora_variant.values())]
    conv_names = set(peft_conv.convertible_conv_layers(peft_model))
    for name in names + sorted(conv_names):
        parent_name, _, child = name.rpartition(".")
        parent = peft_model.get_submodule(parent_name) if parent_name else peft_model
        convert = peft_conv.convert_conv_layer if name in conv_names else DoRAFP8Linear.from_peft
        setattr(parent, child, convert(getattr(parent, child), backend=backend, per_row_scale=per_row_scale))
    if not names and not conv_names:
        warnings.warn("convert_peft_model found no PEFT DoRA Linear or conv layer to convert (use_dora=True?)")
    return len(names) + len(conv_names)


_ORIG_CREATE_NEW_MODULE = None
_ORIG_ALL_LINEAR = None


def _fp8_all_linear_names(model: nn.Module) -> set[str]:
    """The FP8Linear layers that PEFT's "all-linear" shorthand means, with PEFT's own exclusions: the output
    embedding (lm_head) and anything inside an existing tuner layer."""
    names = {name for name, mod in model.named_modules() if isinstance(mod, FP8Linear)}
    get_out = getattr(model, "get_output_embeddings", None)
    out = get_out() if callable(get_out) else None
    for name, mod in model.named_modules():
        if out is not None and mod is out:
            names.discard(name)
        if isinstance(mod, BaseTunerLayer):
            names -= {f"{name}.{sub}" for sub, _ in mod.named_modules() if sub}
    return names


def _fp8_cast_base(target: nn.Module, base: nn.Module, name: str | None) -> nn.Module:
    """The FP8Linear / FP8ConvNd that DoRA is built on in place of `base`, a plain layer whose weight was cast to fp8
    (diffusers' enable_layerwise_casting, kohya's and OneTrainer's fp8 casts; PEFT's DoRA init fails on it).

    Its e4m3 bytes with scale 1 are the values the model computes with (a layerwise-casting hook upcasts them
    exactly), so this is exact. The new layer has no hook: it reads the fp8 weight itself, while the model's other,
    non-targeted layers keep theirs and compute as before."""
    if target is not base:  # the base of another adapter layer: swapping it would change that layer under it
        kind = f"{type(target).__module__}.{type(target).__qualname__}"
        raise ValueError(f"{name!r} is a {type(base).__name__} with a {base.weight.dtype} weight inside the adapter "
                         f"layer {kind}; PEFT's DoRA cannot initialise on an fp8 weight. Call "
                         f"dorafp8.quantize_model(model) (include_conv=True for convs) before adding the first "
                         f"adapter: it wraps fp8 weights losslessly")
    return to_fp8_layer(base, name=name)


def register_with_peft() -> None:
    """Makes PEFT build a DoRAFP8Linear (or plain-LoRA equivalent) for every targeted FP8Linear layer (and a
    DoRAFP8Conv1d/2d/3d for every targeted FP8 conv layer), and makes
    `target_modules="all-linear"` include FP8Linear layers. A DoRA adapter on a plain nn.Linear / Conv1D / ConvNd
    whose weight is already float8_e4m3fn gets the dorafp8 layer too, on the same bytes with scale 1
    (_fp8_cast_base); plain LoRA on such a layer is left to PEFT.

    PEFT picks the LoRA layer class from a fixed list of dispatchers inside LoraModel._create_new_module, and expands
    "all-linear" to the nn.Linear/Conv1D layers only (tuners_utils._maybe_include_all_linear_layers); this wraps both
    so FP8Linear counts as the linear layer it is. Idempotent; runs when peft is imported (dorafp8/_import_hooks.py).
    """
    global _ORIG_CREATE_NEW_MODULE, _ORIG_ALL_LINEAR
    if _ORIG_CREATE_NEW_MODULE is not None:
        return
    _ORIG_CREATE_NEW_MODULE = LoraModel._create_new_module
    _ORIG_ALL_LINEAR = tuners_utils._maybe_include_all_linear_layers

    def _create_new_module(lora_config, adapter_name, target, **kwargs):
        base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
        if getattr(lora_config, "use_dora", False) and is_fp8_cast_layer(base):
            base = target = _fp8_cast_base(target, base, kwargs.get("target_name"))
        if isinstance(base, FP8Linear):
            kwargs.pop("fan_in_fan_out", None)
            return DoRAFP8Linear(target, adapter_name, config=lora_config, **kwargs)
        if isinstance(base, _FP8ConvNd):  # FP8Conv1d/2d/3d -> DoRAFP8Conv1d/2d/3d (dorafp8/peft_conv.py)
            from .peft_conv import create_conv_module

            return create_conv_module(base, target, adapter_name, lora_config, **kwargs)
        return _ORIG_CREATE_NEW_MODULE(lora_config, adapter_name, target, **kwargs)

    def _maybe_include_all_linear_layers(peft_config, model):
        target = getattr(peft_config, "target_modules", None)
        all_linear = isinstance(target, str) and target.lower() == INCLUDE_LINEAR_LAYERS_SHORTHAND
        peft_config = _ORIG_ALL_LINEAR(peft_config, model)
        if all_linear:
            peft_config.target_modules = set(peft_config.target_modules) | _fp8_all_linear_names(model)
        return peft_config

    LoraModel._create_new_module = staticmethod(_create_new_module)
    tuners_utils._maybe_include_all_linear_layers = _maybe_include_all_linear_layers
