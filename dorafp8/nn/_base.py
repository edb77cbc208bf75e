"""The nn.Module plumbing every dorafp8 fp8 layer (FP8Linear, FP8Conv1d/2d/3d) shares: a frozen float8_e4m3fn
`weight` parameter and an fp32 `scale` buffer that keep their storage dtypes, and how a plain layer whose weight was
already cast to fp8 becomes one (`fp8_cast_parts`)."""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import warnings

import torch
from torch import nn

from .._env import ThreadSwitch, flag
from ..quant import E4M3, E8M0, check_micro_scale, check_scale, is_fp8

MICRO_SCALE_DTYPES = (E4M3, E8M0)  # the scales of the microscaled kinds (MXFP8: e8m0, NVFP4: e4m3), kept as stored


# diffusers.hooks.layerwise_casting._LAYERWISE_CASTING_HOOK: the name ModelMixin.enable_layerwise_casting registers
# its per-layer hook under (read by duck typing, so that diffusers is never imported here)
_LAYERWISE_CASTING_HOOK = "layerwise_casting"


def layerwise_compute_dtype(module: nn.Module):
    """The dtype diffusers' layerwise casting upcasts `module`'s weight to (its hook's), else None."""
    registry = getattr(module, "_diffusers_hook", None)
    get_hook = getattr(registry, "get_hook", None)
    hook = get_hook(_LAYERWISE_CASTING_HOOK) if callable(get_hook) else None
    return getattr(hook, "compute_dtype", None)


def check_fp8_cast(weight: torch.Tensor, name: str | None = None) -> None:
    """An fp8 weight without a scale must be e4m3 (taken as it is); another fp8 format is a TypeError."""
    what = f"weight of {name!r}" if name else "weight"
    if weight.dtype != E4M3:
        raise TypeError(f"the {what} is {weight.dtype}; dorafp8 takes float8_e4m3fn weights as they are (scale 1) and "
                        f"quantizes wider ones, but converting {weight.dtype} to e4m3 would move its values. Load the "
                        f"layer in bf16/fp32 (or enable_layerwise_casting with storage_dtype=torch.float8_e4m3fn) and "
                        f"quantize it with dorafp8.quantize_model")


def fp8_cast_parts(module: nn.Module, weight: torch.Tensor, name: str | None = None):
    """(w8, bias, dtype) for a layer whose weight was cast to float8_e4m3fn without a scale (layerwise casting, kohya's
    and OneTrainer's casts), kept byte for byte; None if not fp8. `dtype`: the cast hook's, else the bias's, or fp32."""
    if not is_fp8(weight):
        return None
    check_fp8_cast(weight, name)
    bias = module.bias
    dtype = layerwise_compute_dtype(module)
    if dtype is None:
        dtype = bias.dtype if bias is not None and bias.is_floating_point() and not is_fp8(bias) else torch.float32
    return weight.detach().contiguous(), None if bias is None else bias.detach().to(dtype), dtype


# ---- PEFT without its registration (DORAFP8_NO_PATCHES=1) ------------------------------------------------------------

_PEFT_UNREGISTERED = ("PEFT does not know dorafp8's fp8 layers (DORAFP8_NO_PATCHES=1): call "
                      "dorafp8.register_with_peft() before get_peft_model")
_warned_peft_unregistered = False


def peft_unregistered() -> bool:
    """Whether DORAFP8_NO_PATCHES=1 kept PEFT from learning dorafp8's layers (then its errors miss the fix)."""
    return bool(flag("DORAFP8_NO_PATCHES")) and "dorafp8.peft" not in sys.modules


def peft_unregistered_hint() -> str:
    """For an fp8 layer's repr (printed by PEFT's "not supported" error): the fix while PEFT lacks them, else ""."""
    return f"; {_PEFT_UNREGISTERED}" if "peft" in sys.modules and peft_unregistered() else ""


def warn_if_peft_unregistered() -> None:
    """Once per process, where PEFT does not know fp8 layers: says the fix before get_peft_model fails."""
    global _warned_peft_unregistered
    if _warned_peft_unregistered or not peft_unregistered() or importlib.util.find_spec("peft") is None:
        return
    _warned_peft_unregistered = True
    package, frame, level = os.path.dirname(os.path.dirname(__file__)), sys._getframe(0), 1
    while frame is not None and frame.f_code.co_filename.startswith(package):  # point at the user's line
        frame, level = frame.f_back, level + 1
    warnings.warn(f"dorafp8: {_PEFT_UNREGISTERED} (without it PEFT finds none of them for target_modules="
                  f"'all-linear' and calls the named ones 'not supported')", stacklevel=level)


def zero3_init_active() -> bool:
    """Whether DeepSpeed's `deepspeed.zero.Init` is open now, read without importing deepspeed."""
    pp = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    return getattr(pp, "zero_init_context", 0) > 0


ZERO3_ORDER = ("load the model first (from_pretrained may partition it under ZeRO-3), then call "
               "dorafp8.quantize_model(model) after zero.Init has closed: it gathers each partitioned layer, quantizes "
               "it, and the fp8 layer is partitioned again (see docs/MULTI_GPU.md)")


class FP8WeightModule(nn.Module):
    def _init_fp8_storage(self, weight_shape: tuple, K: int, bias: bool, dtype: torch.dtype, device,
                          per_row_scale: bool, block_size) -> None:
        """Zero `weight` (e4m3, `weight_shape`, K columns in its 2-D view), a ones `scale` of the requested granularity
        (per tensor, per output row, or per block_size x block_size block of the view) and an optional bias."""
        if zero3_init_active():
            # zero.Init wraps torch.zeros/ones/empty/...: every floating tensor made inside, fp8 included, is cast to
            # its dtype (fp32/bf16), so the weight would silently stop being fp8 and a bf16 scale would be rounded.
            raise RuntimeError(f"{type(self).__name__} cannot be built inside DeepSpeed ZeRO-3's deepspeed.zero.Init: "
                               f"it casts every floating tensor made there (the fp8 weight, the fp32 scale) to its "
                               f"own dtype. Build dorafp8 layers outside it: {ZERO3_ORDER}")
        warn_if_peft_unregistered()
        N = weight_shape[0]
        self.weight = nn.Parameter(torch.zeros(weight_shape, dtype=E4M3, device=device), requires_grad=False)
        if per_row_scale:
            scale_shape = (N,)
        elif block_size is not None:
            scale_shape = (-(-N // block_size), -(-K // block_size))
        else:
            scale_shape = ()
        self.register_buffer("scale", torch.ones(scale_shape, dtype=torch.float32, device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(N, dtype=dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def fp8_weight(self) -> torch.Tensor:
        """The weight for the kernels: `weight`, or, where FSDP's MixedPrecisionPolicy(param_dtype=...) handed the
        forward an unsharded weight cast to that dtype, that weight cast back to fp8 (exact; dorafp8/distributed.py)."""
        w = self.weight
        return w if w.dtype in (E4M3, torch.uint8) else recover_fp8_weight(self, w)

    def _apply(self, fn, recurse=True):
        # nn.Module.to(dtype)/.half() cast fp8 as a float: the weight's round trip is exact, the scale's is not, so
        # the storage dtypes are put back, the scale taken from the original.
        scale, g = self.scale, getattr(self, "global_scale", None)
        super()._apply(fn, recurse)
        if self.weight.dtype not in (E4M3, torch.uint8):  # a packed NVFP4 weight (uint8) is never cast
            self.weight = nn.Parameter(self.weight.data.to(E4M3), requires_grad=False)
        if self.scale.dtype != scale.dtype:  # fp32, or a microscaled kind's e8m0 / e4m3
            self.scale = scale.to(self.scale.device)
        if g is not None and self.global_scale.dtype != g.dtype:
            self.global_scale = g.to(self.global_scale.device)
        return self

    _SCALES = ("scale", "global_scale")  # the buffers (NVFP4 has both) FSDP2 leaves whole on every rank

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # Under FSDP2 the scale buffers are listed as replicated on the weight's mesh: code that reads `.device_mesh`
        # off every state_dict entry (accelerate's fsdp2_load_full_state_dict) fails on a plain tensor.
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if _E8M0_AS_BYTES and destination.get(prefix + "scale") is not None \
                and destination[prefix + "scale"].dtype == E8M0:
            destination[prefix + "scale"] = destination[prefix + "scale"].view(torch.uint8)
        dtensor = _dtensor_class()
        w = self.weight
        if dtensor is not None and isinstance(w, dtensor):
            from torch.distributed.tensor import Replicate

            for key in (prefix + name for name in self._SCALES if prefix + name in destination):
                destination[key] = dtensor.from_local(destination[key], w.device_mesh,
                                                      [Replicate()] * w.device_mesh.ndim, run_check=False)

    _float_weight_hint: str  # what to do with a float weight in a state_dict (the load error says it)

    def _check_loaded_scale(self, scale, name: str, weight=None) -> torch.Tensor:
        """A state_dict's scale, checked against its weight (the state_dict's, else this one's 2-D view) and normalized
        ([N, 1] -> [N], [1] -> []); a microscaled kind's scale (e8m0, e4m3) is checked and kept as it is."""
        w = self.weight if weight is None else weight
        N, K = w.shape[0], math.prod(w.shape[1:]) * (2 if w.dtype == torch.uint8 else 1)
        own = self.scale
        if isinstance(scale, torch.Tensor) and own.dtype in MICRO_SCALE_DTYPES and scale.is_floating_point() \
                and scale.dtype not in MICRO_SCALE_DTYPES and scale.shape == own.shape:
            # this layer's e8m0 / e4m3 block scales widened on the way (DeepSpeed's zero_to_fp32 and
            # load_state_dict_from_zero_checkpoint turn every floating buffer to fp32): back, where that is exact
            back = scale.to(own.dtype)
            # compared in fp32, which holds every e8m0 / e4m3 value: fp16 flushes an e8m0 scale under 2**-24 to 0,
            # which e8m0 (it has no 0) took as 2**-127, back in fp16 the same 0: that block's weights loaded as zeros
            if not torch.equal(back.float(), scale.float()):
                raise ValueError(_rounded(name, scale.dtype, f"where this layer's {own.dtype} scales were widened"))
            scale = back
        if isinstance(scale, torch.Tensor) and scale.dtype in MICRO_SCALE_DTYPES:
            check_micro_scale(scale, "nvfp4" if scale.dtype == E4M3 else "mxfp8", N, K, name)
            return scale
        return check_scale(scale, N, K, self.block_size, name=name)

    def _widened_weight_back(self, w, scale, prefix: str):
        """A state_dict's e4m3 weight widened to fp32/bf16/fp16 (DeepSpeed's zero_to_fp32 casts every floating tensor
        to its dtype=, float32 by default), cast back where exact and its fp32 scale came with it; else the error."""
        exact = w.dtype in (torch.float32, torch.bfloat16, torch.float16) and torch.equal(w.to(E4M3).to(w.dtype), w)
        if not exact or scale is None:
            return (f"{prefix}weight: {type(self).__name__} expects a float8_e4m3fn weight with its '{prefix}scale', "
                    f"got {w.dtype}; {self._float_weight_hint}")
        own = self.scale.dtype  # compared in fp32, as in _check_loaded_scale
        if scale.dtype == torch.float32 or scale.dtype in MICRO_SCALE_DTYPES or (
                own in MICRO_SCALE_DTYPES and torch.equal(scale.to(own).float(), scale.float())):
            return w.to(E4M3)
        return _rounded(f"{prefix}scale", scale.dtype, f"beside a float8_e4m3fn weight widened to {w.dtype}")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        dtensor = _dtensor_class()
        for key in (prefix + name for name in self._SCALES):
            if dtensor is not None and isinstance(state_dict.get(key), dtensor):
                # FSDP2's replicated scales (_save_to_state_dict): the buffers stay plain tensors
                state_dict[key] = state_dict[key].full_tensor()
        if _E8M0_AS_BYTES and getattr(state_dict.get(prefix + "scale"), "dtype", None) == torch.uint8:
            state_dict[prefix + "scale"] = state_dict[prefix + "scale"].view(E8M0)  # the bytes _save_to_state_dict sent
        w = state_dict.get(prefix + "weight")
        if w is not None and w.dtype == torch.uint8 and hasattr(self, "global_scale"):  # a packed NVFP4 weight
            self.weight = nn.Parameter(torch.empty_like(w, device=self.weight.device), requires_grad=False)
            g = state_dict.get(prefix + "global_scale")
            if g is not None and g.dtype != torch.float32:  # the uint8 weight is never widened: only this tells
                error_msgs.append(_rounded(f"{prefix}global_scale", g.dtype,
                                           "beside a packed NVFP4 (uint8) weight, expected torch.float32"))
                return
            self.global_scale = None if g is None else torch.empty((), dtype=torch.float32, device=self.weight.device)
        elif w is not None and w.dtype != E4M3:
            w = self._widened_weight_back(w, state_dict.get(prefix + "scale"), prefix)
            if isinstance(w, str):
                error_msgs.append(w)
                return
            state_dict[prefix + "weight"] = w
        sc = state_dict.get(prefix + "scale")
        if sc is not None:
            try:
                sc = self._check_loaded_scale(sc, prefix + "scale", w)
            except (TypeError, ValueError) as e:
                error_msgs.append(str(e))
                return
            state_dict[prefix + "scale"] = sc
            if sc.shape != self.scale.shape or sc.dtype != self.scale.dtype:  # take the checkpoint's kind
                self.scale = torch.empty(sc.shape, dtype=sc.dtype if sc.dtype in MICRO_SCALE_DTYPES else
                                         torch.float32, device=self.scale.device)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


def _rounded(key: str, dtype: torch.dtype, where: str) -> str:
    """The load error for a scale `key` that came as `dtype`, rounded by a 16-bit conversion."""
    return (f"{key}: {dtype}, {where}: the checkpoint was converted with a 16-bit dtype (DeepSpeed's zero_to_fp32 "
            f"/ convert_zero_checkpoint_to_state_dict dtype=...), which rounded the scale; convert it again with "
            f"dtype=torch.float32 (the default)")


# While on (in this thread: `with scales_e8m0_as_bytes(): ...`), state_dict() lists an MXFP8 layer's e8m0 `scale` as
# its bytes (a uint8 view) and load_state_dict takes a uint8 `scale` as those bytes: for collectives that move
# state_dict entries, as NCCL has no e8m0 type (dorafp8/distributed.py, accelerate's FSDP2 loader).
_E8M0_AS_BYTES = ThreadSwitch()
scales_e8m0_as_bytes = _E8M0_AS_BYTES.on


def _dtensor_class():
    """torch's DTensor class if torch.distributed.tensor is loaded (a DTensor cannot exist otherwise), else None."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


# ---- FSDP / ZeRO-3 (why: docs/ARCHITECTURE.md, dorafp8/distributed.py) -----------------------------------------------


def params_are_sharded(module: torch.nn.Module, *tensors: torch.Tensor) -> bool:
    """Whether FSDP or ZeRO-3 manage `module`'s parameters (refilled in place without version bumps)."""
    # FSDP sets the flag on the instance: read from its __dict__ first, as a failed getattr through
    # nn.Module.__getattr__ raises and catches an AttributeError (~2 to 4 us a call); the class, as getattr would
    managed = module.__dict__.get("_is_fsdp_managed_module", False) or getattr(type(module),
                                                                               "_is_fsdp_managed_module", False)
    return bool(managed) or any(hasattr(t, "ds_id") for t in tensors)


SHARDED_BASE_REFUSAL = (
    "dorafp8: the fp8 weight of the {base} under this {layer} is still an FSDP2 shard (a DTensor) in the forward: "
    "the base layer is a shard unit of its own (fully_shard on it, or an auto wrap policy that picked it, such as "
    "accelerate's `fsdp_auto_wrap_policy: SIZE_BASED_WRAP` with `fsdp_min_num_params` below its {numel} weights), "
    "and the fused DoRA forward reads that weight without calling the base layer, so FSDP2 never gathers it. Shard "
    "units must hold whole {layer} layers: `fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP` (the decoder layers), "
    "`fsdp_min_num_params` above the largest layer's weights, or fully_shard on the decoder layers "
    "(docs/MULTI_GPU.md)")


def refuse_sharded_base(layer: torch.nn.Module, base: torch.nn.Module) -> None:
    """Raises SHARDED_BASE_REFUSAL where `base`'s weight is a DTensor when `layer`'s fused forward is about to read it
    (otherwise torch stops with 'got mixed torch.Tensor and DTensor', naming neither the layer nor the fix)."""
    dtensor = _dtensor_class()
    if dtensor is None:  # no DTensor can exist: no read of the weight (a module attribute read costs microseconds)
        return
    w = getattr(base, "weight", None)
    if isinstance(w, dtensor):
        # fully_shard renames a module's class to FSDP<its class>
        raise RuntimeError(SHARDED_BASE_REFUSAL.format(base=type(base).__name__.removeprefix("FSDP"),
                                                       layer=type(layer).__name__.removeprefix("FSDP"),
                                                       numel=w.numel()))


def fsdp_managed(model: torch.nn.Module) -> bool:
    """Whether FSDP2 manages any of `model`'s modules (fully_shard marks every module it manages)."""
    return any(getattr(m, "_is_fsdp_managed_module", False) for m in model.modules())


def _tensor_parallel(model: torch.nn.Module) -> set[int]:
    """ids of `model`'s parameters that are DTensors of their own (tensor or expert parallelism) under its FSDP2 units,
    sharded or unsharded: FSDP2's unshard() leaves them DTensors (FSDPParam.is_dtensor, read where torch has it)."""
    ids = set()
    for m in model.modules():
        group = getattr(getattr(m, "_get_fsdp_state", lambda: None)(), "_fsdp_param_group", None)
        for fp in getattr(group, "fsdp_params", ()):
            info = getattr(fp, "_module_info", None)
            if getattr(fp, "is_dtensor", False) and info is not None:
                ids.add(id(getattr(info.module, info.param_name, None)))
    return ids


def refuse_sharded_model(model: torch.nn.Module, what: str, named=None) -> None:
    """Raises a RuntimeError naming the way to gather them where `model`'s parameters (or `named`, the (name,
    parameter) pairs `what` reads) are FSDP2 shards (DTensors), tensor-parallel DTensors (with FSDP2 or without) or
    DeepSpeed ZeRO-3 partitions, which `what` (a writer reading whole weights on one rank) cannot read: torch stopped
    with 'got mixed torch.Tensor and DTensor' or 'Attempted to access the data pointer on an invalid python storage',
    and a ZeRO-3 model with 'cannot reshape tensor of 0 elements'."""
    dtensor = _dtensor_class()
    named = list(model.named_parameters() if named is None else named)
    sharded = [(n, p) for n, p in named if dtensor is not None and isinstance(p, dtensor)]
    tp = _tensor_parallel(model) if fsdp_managed(model) else {id(p) for _, p in sharded}
    name, p = next(((n, p) for n, p in sharded if id(p) in tp), (None, None))
    if name is not None:  # tensor parallelism (parallelize_module, tp_plan), FSDP2 on top or not: unshard() leaves it
        raise RuntimeError(
            f"{what} reads whole weights, and this model's parameters include tensor-parallel DTensors (e.g. "
            f"{name!r}, placements {tuple(p.placements)}), which it cannot read and FSDP2's unshard() does not "
            f"gather. Write an unsharded copy: gather the state dict on every rank "
            f"(torch.distributed.checkpoint.state_dict's `sd = get_model_state_dict(model, "
            f"options=StateDictOptions(full_state_dict=True, cpu_offload=True))`), then on rank 0 load it into the "
            f"same model built without tensor parallelism or FSDP2 (no parallelize_module / tp_plan, no fully_shard; "
            f"`plain.load_state_dict(sd)`) and write that one")
    if sharded:
        raise RuntimeError(
            f"{what} reads whole weights, and this model's parameters are FSDP2 shards (DTensors, e.g. "
            f"{sharded[0][0]!r}). "
            f"Gather them on every rank first, write on one, then shard again (docs/MULTI_GPU.md): "
            f"`units = [m for m in model.modules() if isinstance(m, torch.distributed.fsdp.FSDPModule)]; "
            f"[u.unshard() for u in units]`, then the write on rank 0 only (`if dist.get_rank() == 0: ...`), "
            f"then `[u.reshard() for u in units]`")
    for name, p in named:
        if getattr(getattr(p, "ds_status", None), "name", None) == "NOT_AVAILABLE":  # ZeroParamStatus, not imported
            raise RuntimeError(
                f"{what} reads whole weights, and this model's parameters are DeepSpeed ZeRO-3 partitions (e.g. "
                f"{name!r}, {p.numel()} of its {getattr(p, 'ds_numel', '?')} elements here). Gather them on every rank "
                f"and write on one (docs/MULTI_GPU.md): "
                f"`with deepspeed.zero.GatheredParameters(list(model.parameters())): if dist.get_rank() == 0: ...`")


def refuse_dtensor_weight(module: torch.nn.Module, name: str | None = None) -> None:
    """Raises a RuntimeError naming the order that works where `module`'s weight is a DTensor (an FSDP2 shard, or
    tensor parallelism), which quantizing cannot read whole (torch stopped with 'got mixed torch.Tensor and
    DTensor')."""
    dtensor = _dtensor_class()
    w = module.weight
    if dtensor is None or not isinstance(w, dtensor):
        return
    if getattr(module, "_is_fsdp_managed_module", False):
        raise RuntimeError(f"dorafp8 cannot quantize {name!r}: its weight is an FSDP2 shard (a DTensor). Quantize "
                           f"the model (quantize_model, convert_peft_model) before fully_shard, or before accelerate "
                           f"or the Trainer prepare it (`dorafp8 run --quantize` quantizes it as it loads); see "
                           f"docs/MULTI_GPU.md")
    raise RuntimeError(f"dorafp8 cannot quantize {name!r}: its weight is a tensor-parallel DTensor (placements "
                       f"{tuple(w.placements)}), and dorafp8's fp8 layers hold whole weights (torch's ColwiseParallel "
                       f"and RowwiseParallel take nn.Linear only). Leave the layers to quantize out of the tensor-"
                       f"parallel plan (parallelize_module / tp_plan), or shard them with FSDP2 (fully_shard) or "
                       f"train with DDP instead (docs/MULTI_GPU.md)")


_WARNED_RECAST = False


def recover_fp8_weight(module: torch.nn.Module, w: torch.Tensor) -> torch.Tensor:
    """The fp8 weight of an FP8Linear whose unsharded weight FSDP's MixedPrecisionPolicy cast to a wider float: cast
    back, exactly (not reached with dorafp8/distributed.py installed); anything else that is not fp8, as it is."""
    global _WARNED_RECAST
    if not (params_are_sharded(module) and w.dtype in (torch.bfloat16, torch.float16, torch.float32)):
        return w
    if not _WARNED_RECAST:
        _WARNED_RECAST = True
        warnings.warn(
            f"dorafp8: FSDP's MixedPrecisionPolicy(param_dtype={w.dtype}) cast the frozen fp8 weights to {w.dtype} "
            f"for the all-gather (2x the traffic and the unsharded memory of fp8); dorafp8 casts them back exactly. "
            f"dorafp8.install_fsdp_support() (which `import dorafp8` runs unless DORAFP8_NO_PATCHES=1) keeps them "
            f"fp8 in FSDP2 groups initialized after it, whatever their param_dtype (see docs/MULTI_GPU.md).",
            stacklevel=3)
    return w.to(torch.float8_e4m3fn)
