"""What dorafp8's PEFT layers (linear and conv) share: the DoRA variant mixin and the layer base (backend switch,
weight-norm cache, fused dispatch, conversion from a PEFT layer)."""

from __future__ import annotations

import types
import warnings
from typing import Any

import torch
from torch import nn

from peft.tuners.lora import layer as lora_layer

from ..backends import check_backend_name
from ..nn import FP8ConvNd, FP8Linear, params_are_sharded, refuse_sharded_base
from ..nn.convert import check_fp8_layer, zero3_gathered
from ..norm_cache import WeightNormCache
from ..ops import norm_divisor
from ..quant import all_finite
from . import _compat


_MERGE_WARNING = (
    "merging LoRA or DoRA adapters into an fp8 base re-quantizes the merged weight to e4m3 ({} scales; "
    "{}.merge_granularity chooses). dorafp8.export_merged writes merged checkpoints in the layout you "
    "deploy and reports the error of every layer"
)
# A microscaled base is re-quantized in its own format (merge.requantize_micro); the errors: measured on a Gaussian
# [1024, 1024] weight (tests/peft/test_microscaled_peft.py bounds the merged layers').
_MICRO_RECIPE = {"nvfp4": "ModelOpt's NVFP4 recipe (e2m1 values, an e4m3 scale per 16, a new global scale; about 9.5% "
                          "relative error on Gaussian weights)",
                 "mxfp8": "ModelOpt's MXFP8 recipe (e4m3 values, an e8m0 scale per 32; about 2.7% relative error)"}
_MICRO_MERGE_WARNING = ("merging LoRA or DoRA adapters into an {} base re-quantizes the merged weight by {} (each "
                        "layer's in last_merge_error). Merging on the dense model loses none of it")


# PEFT's inits computed from the base weight (peft/tuners/lora/layer.py, LoraLayer.update_layer): on e4m3 they fail
# or need a GPU, and all but MiCA rewrite the weight with a residual (LoRA-GA only when preprocess_loraga attached its
# gradient: without it, as when an adapter is loaded, PEFT initialises as for init_lora_weights=True).
_WEIGHT_INITS = ("pissa", "corda", "olora", "loftq", "mica")
_UNREAD = object()  # DoRAFP8Layer._norm_of's global_scale when its caller did not read the base's


def check_adapters_convertible(layer, variants: tuple, per_row_scale: bool, name: str | None) -> None:
    """Raises unless a dorafp8 layer can take over this PEFT layer: unmerged, LoRA / DoRA only, fp8-able base."""
    where = f"{name}: " if name else ""
    if layer.merged:
        raise ValueError(f"{where}layer has merged adapters; unmerge them first (layer.unmerge())")
    for adapter, variant in layer.lora_variant.items():
        if not isinstance(variant, variants):
            raise ValueError(f"{where}adapter {adapter!r} uses the LoRA variant {type(variant).__name__}, which "
                             f"dorafp8 does not support (only plain LoRA and DoRA)")
    base = layer.get_base_layer()
    if not isinstance(base, (FP8Linear, FP8ConvNd)):
        check_fp8_layer(base, per_row_scale=per_row_scale, name=name)


class FP8DoraVariantMixin:
    """What the DoRA variants on fp8 bases share: the magnitude's init from the fp8 weight, no dense merge, PEFT's
    general-path composition. A variant gives `_magnitude(module, m)`: PEFT's holder class and m [N] shaped for it."""

    _merge_error = ("the DoRA variant on an fp8 base does not merge into a dense weight: the layer's own merge() "
                    "(and PEFT's merge_and_unload / merge_adapter, which call it) merges in fp32 row blocks and "
                    "re-quantizes to e4m3")

    @classmethod
    def _refuse_merge(cls, module, active_adapter, orig_weight):
        raise NotImplementedError(cls._merge_error)

    merge_safe = merge_unsafe = unmerge = _refuse_merge

    @classmethod
    def init(cls, module: "DoRAFP8Layer", adapter_name: str, **kwargs: Any) -> None:
        # PEFT's DoRA init, with the magnitude (the row norms of W0 + s B A) computed from the fp8 weight.
        if not module.lora_magnitude_vector:
            module.adapter_layer_names = module.adapter_layer_names[:] + ("lora_magnitude_vector",)
        lora_A = module.lora_A[adapter_name].weight
        dtype = lora_A.dtype
        if lora_A.device.type == "meta":
            # low_cpu_mem_usage=True: meta adapters, the file's tensors assigned afterwards (PEFT's DoRA init too)
            m = torch.empty(module.out_features, dtype=dtype, device="meta")
        else:
            with zero3_gathered(module.get_base_layer()):  # a base ZeRO-3 partitioned: whole for the norm, as PEFT
                n = module.dora_weight_norm(adapter_name, use_cache=False)
            m = n.to(dtype)
            if not torch.isfinite(m).all():  # n is finite (fp8 weights, finite scale); a narrow dtype may not be
                raise ValueError(f"the DoRA magnitude of adapter {adapter_name!r} (the row norms of the weight, up to "
                                 f"{float(n.max()):.4g}) overflows {dtype}; create the adapters in float32 (PEFT's "
                                 f"autocast_adapter_dtype=True, the default, does)")
        holder, m = cls._magnitude(module, m)
        dora_layer = holder(fan_in_fan_out=False)
        dora_layer.weight = nn.Parameter(m, requires_grad=True)
        module.lora_magnitude_vector[adapter_name] = dora_layer

    @staticmethod
    def forward(module: "DoRAFP8Layer", active_adapter: str, x: torch.Tensor, result: torch.Tensor,
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
        n = norm_divisor(module.dora_weight_norm(active_adapter))
        c = module._per_channel(module.lora_magnitude_vector[active_adapter].weight.reshape(-1) / n)
        return result + (c - 1) * base_result + c * lora_B(lora_A(x)) * scaling


class DoRAFP8Layer:
    """What the dorafp8 PEFT layers share: backend switch, weight-norm cache, fused dispatch, merge, conversion. A layer
    class gives `_dora_variant`, `_fp8_base()`, `_weight_norm(base, A, B, s)`, `_per_channel(v)`, `_base_product(base,
    x)` (without bias) and `_fused_call(x, adapter, dropout_p, base)`."""

    _dora_variant: type
    _io_names = ("in_features", "out_features")  # how extra_repr names in_features / out_features

    def __init__(self, base_layer, adapter_name: str, config=None, r: int = 0, lora_alpha: int = 1, **kwargs):
        self._dorafp8_norm_cache = WeightNormCache()
        with _compat.quiet_layer_init():
            super().__init__(base_layer, adapter_name, r=r, lora_alpha=lora_alpha,
                             **_compat.layer_kwargs(config, kwargs))

    def _fp8_base(self):
        return self.get_base_layer()

    @property
    def lora_variants(self):  # peft >= 0.20 picks the variant here
        return {(): None, ("use_dora",): self._dora_variant}

    def resolve_lora_variant(self, **kwargs):
        # peft 0.18 and 0.19 ask the layer class, whose answer is PEFT's own DoRA variant: this layer's instead. Any
        # other variant (aLoRA, Arrow, ...) is refused, as peft >= 0.20 refuses it through lora_variants.
        variant = super().resolve_lora_variant(**kwargs)
        if variant is None or isinstance(variant, self._dora_variant):
            return variant
        if isinstance(variant, self._peft_dora_variant):
            return self._dora_variant()
        raise ValueError(f"{type(self).__name__} supports plain LoRA and DoRA only, not PEFT's "
                         f"{type(variant).__name__}")

    def update_layer(self, adapter_name, *args, **kwargs):
        config = kwargs.get("config", args[2] if len(args) > 2 else None)
        init = getattr(config, "init_lora_weights", kwargs.get("init_lora_weights"))
        init = init.lower() if isinstance(init, str) else ""
        if init.startswith(_WEIGHT_INITS) or (init == "lora_ga" and
                                              hasattr(self._fp8_base(), "_peft_loraga_grad")):
            raise ValueError(f"init_lora_weights={init!r} is not supported on an fp8 base: PEFT computes it from the "
                             f"base weight (and but for MiCA rewrites the weight with a residual, also when it loads "
                             f"such an adapter). Use init_lora_weights=True, 'gaussian', 'orthogonal', 'eva' or False "
                             f"here, or initialise on the dense model with PEFT and quantize it afterwards "
                             f"(dorafp8.quantize_model); a saved PiSSA / CorDA / OLoRA adapter loads once PEFT has "
                             f"converted it to plain LoRA (save_pretrained(path_initial_model_for_weight_conversion=))")
        if not _compat.LAYER_SAYS_DTYPE:  # peft 0.18 read them with a function that does not know fp8 layers
            self.in_features, self.out_features = self._get_in_out_features(self._fp8_base())
        super().update_layer(adapter_name, *args, **kwargs)

    def orthogonal_init(self, adapter_name):
        # PEFT casts the new adapter to get_base_layer().weight.dtype, e4m3 here, rounding it: the base's original
        # dtype instead (what PEFT gives on the dequantized base).
        dtype = self._fp8_base().orig_dtype
        self.get_base_layer = lambda: types.SimpleNamespace(weight=torch.empty(0, dtype=dtype))
        try:
            super().orthogonal_init(adapter_name)
        finally:
            del self.get_base_layer

    def _move_adapter_to_device_of_base_layer(self, adapter_name: str, device=None) -> None:
        if _compat.LAYER_SAYS_DTYPE:  # through _get_base_layer_device_and_dtype: the fp8 base's original dtype
            return super()._move_adapter_to_device_of_base_layer(adapter_name, device)
        # peft 0.18 would cast the adapters to the base weight's dtype, e4m3: its original dtype instead
        base_device, dtype = self._get_base_layer_device_and_dtype(self._fp8_base())
        for name in self.adapter_layer_names + self.other_param_names:
            holder = getattr(self, name, None)
            if isinstance(holder, nn.ModuleDict) and adapter_name in holder and not any(
                    p.device.type == "meta" for p in holder[adapter_name].parameters()):
                holder[adapter_name] = holder[adapter_name].to(device or base_device, dtype=dtype)

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
        """The detached fp32 row norm ||W0 + s B A|| of `adapter`, reused only where provably current."""
        return self._norm_of(self._fp8_base(), adapter, self.lora_A[adapter].weight, self.lora_B[adapter].weight,
                             use_cache)

    def _norm_of(self, base, adapter: str, A: torch.Tensor, B: torch.Tensor, use_cache: bool = True,
                 global_scale=_UNREAD) -> torch.Tensor:
        """dora_weight_norm with the base and adapter weights the caller has read (each read of a module's attribute
        goes through nn.Module.__getattr__, ~0.3 to 2 us); `global_scale`: the base's, where the caller read it."""
        s = self.scaling[adapter]

        def compute():
            return self._weight_norm(base, A, B, s)

        if not use_cache:
            return compute()
        if global_scale is _UNREAD:
            global_scale = getattr(base, "global_scale", None)
        return self._dorafp8_norm_cache.norm(adapter, compute, A, B, base.weight, base.scale, (s, base.backend),
                                             sharded=params_are_sharded(self, A, B), global_scale=global_scale)

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
        base = self._fp8_base()  # once a call: PEFT's get_base_layer costs three module attribute reads
        refuse_sharded_base(self, base)
        dropout = self.lora_dropout[a]
        return self._fused_call(x, a, dropout.p if isinstance(dropout, nn.Dropout) else 0.0, base)

    # Scale of a merged base: "row" (one per output row, loses least), "tensor", "block", or "keep" (the base's own).
    merge_granularity = "row"

    def _adapters_to_merge(self, adapter_names=None) -> list[str]:
        """The adapters merge(adapter_names) would merge: the named (or active) ones this layer has, not yet merged."""
        names = self.active_adapters if adapter_names is None else list(adapter_names)
        return [a for a in names if a in self.lora_A and a not in self.merged_adapters]

    def merge_problems(self, adapter_names=None) -> list[str]:
        """Why merge(adapter_names) would fail, found without changing anything."""
        names = self._adapters_to_merge(adapter_names)
        if not names:
            return []
        base = self._fp8_base()
        problems = []
        if getattr(base, "groups", 1) > 1:
            problems.append(f"merging into a conv with groups={base.groups} is not supported (nor in PEFT); "
                            f"export the adapter and merge on the dense model instead")
        for a in names:
            if self.lora_bias.get(a) and base.bias is None:
                problems.append(f"adapter {a!r} has a LoRA bias but the base layer has no bias to merge it into")
            parts = [self.lora_A[a].weight, self.lora_B[a].weight]
            if a in self.lora_magnitude_vector:
                parts.append(self.lora_magnitude_vector[a].weight)
            if not all(all_finite(t) for t in parts):
                problems.append(f"adapter {a!r} has non-finite (NaN/inf) weights: the merged weight cannot be stored "
                                f"in e4m3")
        return problems

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        """Merges the active (or named) adapters into the fp8 base (W' = m / ||V|| * V, V = W0 + s B A, in fp32 row
        blocks), re-quantized with `merge_granularity` scales (error in `last_merge_error`). All checks run first;
        unmerge() restores the kept pre-merge bytes."""
        from peft.tuners.tuners_utils import check_adapters_to_merge

        from ..merge import adapter_terms, merged_rows, requantize, requantize_micro
        from ..quant import MICRO_KINDS, scale_kind, weight_dims

        # Names this layer has not are skipped, as PEFT's layers skip them: merging none must leave the base as it is.
        adapter_names = [a for a in check_adapters_to_merge(self, adapter_names) if a in self.lora_A]
        if not adapter_names:
            return
        problems = self.merge_problems(adapter_names)
        if problems:
            raise ValueError("; ".join(problems))
        base = self._fp8_base()
        w8, scale, block_size = base.fp8_weight(), base.scale, base.block_size
        w2 = w8.reshape(w8.shape[0], -1)  # a conv's [C_out, C_in * kernel] view: B A is B2 @ A2 there (groups=1)
        gran = self.merge_granularity if self.merge_granularity != "keep" else scale_kind(scale)
        terms = adapter_terms(self, adapter_names)
        g = getattr(base, "global_scale", None)
        rows = lambda j0, j1: merged_rows(w2, scale, block_size, terms, j0, j1, g)  # noqa: E731
        if scale_kind(scale) in MICRO_KINDS:  # re-quantized in its own format, whatever merge_granularity says
            gran = scale_kind(scale)
            new_w8, new_scale, new_g, stats = requantize_micro(rows, *weight_dims(w2), gran, device=w8.device)
        else:
            new_w8, new_scale, stats = requantize(rows, w2.shape[0], w2.shape[1], gran, block_size=block_size,
                                                  device=w8.device)
            new_g = None
        if stats.nonfinite:
            raise ValueError(f"NaNs detected in the merged weights ({stats.nonfinite} non-finite values). The "
                             f"adapter {adapter_names} seems to be broken")
        bias = base.bias
        for a in adapter_names:
            if self.lora_bias.get(a):
                bias = nn.Parameter((bias.float() + self.lora_B[a].bias.float() * self.scaling[a]).to(bias.dtype),
                                    requires_grad=False)
        warnings.warn(_MICRO_MERGE_WARNING.format(gran.upper(), _MICRO_RECIPE[gran]) if new_scale.dtype != torch.float32
                      else _MERGE_WARNING.format(f"per-{gran}", type(self).__name__), stacklevel=2)
        self.__dict__.setdefault("_dorafp8_premerge", []).append((base.weight, base.scale, base.bias, g))
        base.weight = nn.Parameter(new_w8.reshape(w8.shape), requires_grad=False)
        base.scale = new_scale.to(w8.device)
        if new_g is not None:
            base.global_scale = new_g.to(w8.device)
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
        base = self._fp8_base()
        base.weight, base.scale, base.bias, g = stash[0]
        if g is not None:
            base.global_scale = g
        stash.clear()
        self.merged_adapters.clear()
        self.clear_weight_norm_cache()

    def extra_repr(self) -> str:
        ranks = ", ".join(f"{k}={v}" for k, v in self.r.items())
        i, o = self._io_names
        return f"{i}={self.in_features}, {o}={self.out_features}, r={{{ranks}}}, backend={self.backend}"

    def __repr__(self) -> str:
        return nn.Module.__repr__(self)

    @classmethod
    def _adopt(cls, layer: lora_layer.LoraLayer, fp8: nn.Module, backend: str, attrs: tuple[str, ...]):
        """A layer of this class on `fp8` taking over PEFT's `layer`: its adapters (shared), state and `attrs`."""
        fp8.backend = check_backend_name(backend)
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new._dorafp8_norm_cache = WeightNormCache()
        with _compat.quiet_layer_init():
            lora_layer.LoraLayer.__init__(new, fp8, ephemeral_gpu_offload=layer.ephemeral_gpu_offload, **layer.kwargs)
        new.in_features, new.out_features = new._get_in_out_features(fp8)  # peft 0.18 cannot tell them
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
