"""Multi-process training on fp8 bases: DDP (and so accelerate and the HF Trainer), FSDP2, and what DeepSpeed sees.
Nothing here has to be called: `import dorafp8` installs the DDP and FSDP2 support, and the layers detect sharding
themselves. docs/MULTI_GPU.md is the user's account; the why: docs/ARCHITECTURE.md, "dorafp8/distributed.py"."""

from __future__ import annotations

import functools
import importlib
import inspect
import sys
import threading
import warnings

import torch

# The FSDP / ZeRO-3 helpers live with the fp8 module base, which needs them; named here too.
from .nn import FP8WeightModule, params_are_sharded, recover_fp8_weight  # noqa: F401 (the last two: FSDP)
from .nn import scales_e8m0_as_bytes
from .quant import E8M0, FP8_DTYPES, is_fp8

def _wrap_once(owner, attr: str, make_wrapper) -> None:
    """owner.attr = make_wrapper(owner.attr), the original kept as `_dorafp8_orig`; wraps once."""
    cur = getattr(owner, attr)
    if not hasattr(cur, "_dorafp8_orig"):
        new = make_wrapper(cur)
        new._dorafp8_orig = cur
        setattr(owner, attr, new)


def _unwrap(owner, attr: str) -> None:
    """Puts back what _wrap_once wrapped (nothing where it did not)."""
    cur = getattr(owner, attr, None)
    if cur is not None and hasattr(cur, "_dorafp8_orig"):
        setattr(owner, attr, cur._dorafp8_orig)


# ---- DDP ---------------------------------------------------------------------------------------------------------


def _fp8_states_to_sync(module, ignore, broadcast_buffers: bool):
    """(names, tensors) DDP's sync would broadcast that gloo cannot: fp8 parameters (and fp8 buffers when buffers are
    synced), plus, when buffers are not synced, the scales (`scale`, NVFP4's `global_scale`) of each dorafp8 layer whose
    weight is synced (fp8, or NVFP4's packed uint8, which DDP sends itself): a weight's bytes mean nothing without
    them."""
    states = list(module.named_parameters()) + (list(module.named_buffers()) if broadcast_buffers else [])
    fp8 = [(name, t) for name, t in states if name not in ignore and is_fp8(t)]
    names, tensors = [name for name, _ in fp8], [t.detach() for _, t in fp8]
    extra = []
    if not broadcast_buffers:
        for mod_name, mod in module.named_modules():
            prefix = mod_name + "." if mod_name else ""
            if isinstance(mod, FP8WeightModule) and prefix + "weight" not in ignore:
                extra += [t.detach() for key, t in _scales(mod) if prefix + key not in ignore]
    return names, tensors, extra


def _scales(mod) -> list:
    """(name, buffer) of a dorafp8 layer's scales (`scale`, NVFP4's `global_scale`)."""
    return [(key, t) for key in FP8WeightModule._SCALES if (t := getattr(mod, key, None)) is not None]


def _wrap_sync_module_states(orig):
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def _sync_module_states(*args, **kwargs):
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError:  # a torch whose signature we do not know: leave it alone
            return orig(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        names, fp8, extra = _fp8_states_to_sync(a["module"], a["params_and_buffers_to_ignore"],
                                                a.get("broadcast_buffers", True))
        if fp8 or extra:
            import torch.distributed as dist

            with torch.no_grad():
                # In place: a uint8 view shares the fp8 tensor's storage, so the received bytes land in it.
                dist._broadcast_coalesced(a["process_group"],
                                          [t.view(torch.uint8) if is_fp8(t) else t for t in fp8 + extra],
                                          a["broadcast_bucket_size"], a["src"])
            a["params_and_buffers_to_ignore"] = set(a["params_and_buffers_to_ignore"]) | set(names)
        return orig(*bound.args, **bound.kwargs)

    return _sync_module_states


def _wrap_buffer_broadcast(orig):
    @functools.wraps(orig)
    def _distributed_broadcast_coalesced(self, tensors, *args, **kwargs):
        # The buffers DDP broadcasts again before every forward: MXFP8's and NVFP4's block scales are fp8 (e8m0, e4m3),
        # which gloo cannot send. As bytes, in place, as at the wrap.
        return orig(self, [t.view(torch.uint8) if is_fp8(t) else t for t in tensors], *args, **kwargs)

    return _distributed_broadcast_coalesced


def install_ddp_support() -> bool:
    """Makes DistributedDataParallel's broadcasts send fp8 parameters/buffers as raw bytes (uint8 views), so that they
    work on gloo too: the initial one (`torch.nn.parallel.distributed._sync_module_states`) and the buffers' before
    each forward (`DistributedDataParallel._distributed_broadcast_coalesced`). Idempotent; called on `import dorafp8`.
    Returns whether both are installed (False without torch.distributed or either function; the other is still wrapped)."""
    if not torch.distributed.is_available():
        return False
    import torch.nn.parallel.distributed as ddp_module

    # Each wrap on its own: the initial sync alone lets DDP start on fp8 weights over gloo.
    owners = ((ddp_module, "_sync_module_states", _wrap_sync_module_states),
              (ddp_module.DistributedDataParallel, "_distributed_broadcast_coalesced", _wrap_buffer_broadcast))
    missing = [attr for owner, attr, _ in owners if getattr(owner, attr, None) is None]
    for owner, attr, wrap in owners:
        if attr not in missing:
            _wrap_once(owner, attr, wrap)
    if missing:
        warnings.warn(f"dorafp8: this torch's DistributedDataParallel has no {' or '.join(missing)}; DDP over gloo "
                      "cannot broadcast fp8 weights or scales there (NCCL can broadcast e4m3). See docs/MULTI_GPU.md.")
    return not missing


def uninstall_ddp_support() -> None:
    """Puts back DDP's own `_sync_module_states` and `_distributed_broadcast_coalesced` (for tests and debugging)."""
    if not torch.distributed.is_available():
        return
    import torch.nn.parallel.distributed as ddp_module

    _unwrap(ddp_module, "_sync_module_states")
    _unwrap(ddp_module.DistributedDataParallel, "_distributed_broadcast_coalesced")


# ---- DeepSpeed: scales follow the weights its engine broadcasts ------------------------------------------------------

DEEPSPEED_ENGINE_MODULE = "deepspeed.runtime.engine"


# Per thread: weight storage -> the dorafp8 layers whose scales follow that weight's broadcast, while an engine's
# _broadcast_model runs. Not a swap of deepspeed.comm.broadcast per call: two engines starting in two threads (a policy
# and a reference model) put back each other's swaps, leaving one in place for good.
_DS_SENDING = threading.local()


def _wrap_ds_broadcast(send):
    @functools.wraps(send)
    def broadcast(tensor, src, *a, **k):
        out = send(tensor, src, *a, **k)
        layers = getattr(_DS_SENDING, "layers", None)
        if layers and isinstance(tensor, torch.Tensor):
            group = k.get("group", a[0] if a else None)
            for mod in layers.pop(tensor.data_ptr(), ()):
                with torch.no_grad():
                    for _, t in _scales(mod):  # fp8 block scales (e8m0: not an NCCL type) as bytes, in place
                        send(t.view(torch.uint8) if is_fp8(t) else t, src, group=group)
        return out

    return broadcast


def _wrap_broadcast_model(orig):
    @functools.wraps(orig)
    def _broadcast_model(self, *args, **kwargs):
        # DeepSpeedEngine broadcasts rank 0's parameters (every stage but a model partitioned by zero.Init), not the
        # buffers: a dorafp8 layer's fp8 bytes would arrive without their scales, each rank pairing rank 0's weight
        # with its own scale (a silently different model). Each layer's scales go right after its weight, from the
        # source and in the group DeepSpeed sent it with (the group changed across versions: data_parallel_group,
        # seq_data_parallel_group from 0.10.2, MoE experts' own), and not at all where DeepSpeed skips the weight
        # (partitioned by zero.Init, OptimizedLinear's per-rank shards).
        import deepspeed.comm as ds_dist

        layers = {}  # weight storage -> the dorafp8 layers holding it
        for mod in self.module.modules():
            w = getattr(mod, "weight", None)
            if isinstance(mod, FP8WeightModule) and isinstance(w, torch.Tensor) and w.numel() and not w.is_meta:
                layers.setdefault(w.data_ptr(), []).append(mod)
        # the engine calls deepspeed.comm.broadcast by that name; wrapped once, it passes through outside this call
        _wrap_once(ds_dist, "broadcast", _wrap_ds_broadcast)
        outer = getattr(_DS_SENDING, "layers", None)
        _DS_SENDING.layers = layers
        try:
            return orig(self, *args, **kwargs)
        finally:
            _DS_SENDING.layers = outer

    return _broadcast_model


def _wrap_cast_module_mixed_precision(orig):
    @functools.wraps(orig)
    def _cast_module_mixed_precision(self, *args, **kwargs):
        # A config's data_types.buffer_dtype (bf16/fp16) casts every floating buffer with `b.data = b.data.to(...)`
        # (past FP8WeightModule._apply): the fp32 scales would be rounded, silently moving every base weight (an fp16
        # per-tensor scale below 6e-5 even loses bits as a subnormal). They keep their dtype, as under module.to().
        kept = [(t, t.data) for mod in self.module.modules() if isinstance(mod, FP8WeightModule)
                for _, t in _scales(mod)]
        out = orig(self, *args, **kwargs)
        for t, data in kept:
            if t.dtype != data.dtype:
                t.data = data
        return out

    return _cast_module_mixed_precision


def install_deepspeed_support() -> bool:
    """Makes DeepSpeedEngine keep each dorafp8 layer's scales with its weight: its initial broadcast of rank 0's
    parameters sends them too, and a config's buffer_dtype leaves them as they are (fp32 or the microscaled kinds'
    fp8); idempotent; whether installed (False before deepspeed.runtime.engine is imported). Raises AttributeError
    where the engine lacks the method (a DeepSpeed that renamed it): the import hook warns, naming the consequence."""
    mod = sys.modules.get(DEEPSPEED_ENGINE_MODULE)
    if mod is None:
        return False
    cls = mod.DeepSpeedEngine
    if getattr(cls, "_broadcast_model", None) is None:
        raise AttributeError("DeepSpeedEngine has no _broadcast_model (the initial broadcast of rank 0's parameters)")
    _wrap_once(cls, "_broadcast_model", _wrap_broadcast_model)
    if getattr(cls, "_cast_module_mixed_precision", None) is not None:  # older DeepSpeed called module.half()
        _wrap_once(cls, "_cast_module_mixed_precision", _wrap_cast_module_mixed_precision)
    return True


# ---- FSDP2 mixed precision -----------------------------------------------------------------------------------------

# Where FSDP2 defines FSDPParam (every torch from 2.6 on; dorafp8 needs 2.11).
FSDP_PARAM_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_param"


def _keeps_fp8(fsdp_param) -> bool:
    """Whether FSDP2's parameter is the fp8 weight of a dorafp8 layer (which FSDP must not cast)."""
    info = getattr(fsdp_param, "_module_info", None)
    return (isinstance(getattr(info, "module", None), FP8WeightModule) and getattr(info, "param_name", None) == "weight"
            and getattr(fsdp_param, "orig_dtype", None) in FP8_DTYPES)


def _wrap_init_dtype_attrs(orig):
    @functools.wraps(orig)
    def init_dtype_attrs(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        if getattr(self, "param_dtype", None) is not None and _keeps_fp8(self):
            self.param_dtype = None  # all-gathered and used in its own dtype, as FSDP does for integer parameters
        return out

    return init_dtype_attrs


def _fsdp_param_class(import_it: bool):
    mod = sys.modules.get(FSDP_PARAM_MODULE)
    if mod is None and import_it:
        try:
            mod = importlib.import_module(FSDP_PARAM_MODULE)
        except ImportError:
            return None
    return getattr(mod, "FSDPParam", None)


def install_fsdp_support() -> bool:
    """Keeps the fp8 weights of dorafp8 layers out of FSDP2's MixedPrecisionPolicy(param_dtype=...): they are
    all-gathered and reach the forward as fp8. Wraps `FSDPParam.init_dtype_attrs` (importing FSDP2); idempotent.
    Returns whether it is installed (False without FSDP2)."""
    if not torch.distributed.is_available():
        return False
    cls = _fsdp_param_class(True)
    if getattr(cls, "init_dtype_attrs", None) is None:
        return False
    _wrap_once(cls, "init_dtype_attrs", _wrap_init_dtype_attrs)
    return True


def uninstall_fsdp_support() -> None:
    """Puts back FSDP2's own `FSDPParam.init_dtype_attrs` (for tests and for debugging), for FSDP2 groups initialized
    afterwards: their fp8 weights are cast again, and cast back by the forward (recover_fp8_weight, with a warning)."""
    if torch.distributed.is_available():
        _unwrap(_fsdp_param_class(False), "init_dtype_attrs")


# ---- accelerate's FSDP2 loader (cpu_ram_efficient_loading): MXFP8 scales as bytes -----------------------------------

ACCELERATE_FSDP_MODULE = "accelerate.utils.fsdp_utils"


def _wrap_in(module: str, attr: str, make_wrapper) -> bool:
    """_wrap_once on module.attr, a function of a module already imported; whether it is there (and wrapped)."""
    mod = sys.modules.get(module)
    if getattr(mod, attr, None) is None:
        return False
    _wrap_once(mod, attr, make_wrapper)
    return True


def _e8m0_as_bytes(full_sd: dict) -> dict:
    """full_sd with its e8m0 tensors as their bytes: rank-0 loaders broadcast every entry, and NCCL has no e8m0 type
    ("Input tensor data type is not supported for NCCL process group: Float8_e8m0fnu"); they are loaded, under
    scales_e8m0_as_bytes, as e8m0 again."""
    return {k: v.view(torch.uint8) if isinstance(v, torch.Tensor) and v.dtype == E8M0 else v
            for k, v in full_sd.items()}


def _wrap_fsdp2_load_full_state_dict(orig):
    @functools.wraps(orig)
    def fsdp2_load_full_state_dict(accelerator, model, full_sd, *args, **kwargs):
        # the other ranks allocate theirs from the sharded model's state_dict: bytes there too
        with scales_e8m0_as_bytes():
            return orig(accelerator, model, _e8m0_as_bytes(full_sd), *args, **kwargs)

    return fsdp2_load_full_state_dict


def install_accelerate_loader_support() -> bool:
    """Makes accelerate's `fsdp2_load_full_state_dict` send MXFP8 layers' e8m0 scales as bytes; idempotent; whether
    installed (False before accelerate.utils.fsdp_utils is imported, or without that function)."""
    return _wrap_in(ACCELERATE_FSDP_MODULE, "fsdp2_load_full_state_dict", _wrap_fsdp2_load_full_state_dict)


# ---- torch's set_model_state_dict / set_state_dict(broadcast_from_rank0=True): MXFP8 scales as bytes ---------------

TORCH_DSD_MODULE = "torch.distributed.checkpoint.state_dict"


def _wrap_load_model_state_dict(orig):
    @functools.wraps(orig)
    def _load_model_state_dict(model, state_dict, info, *args, **kwargs):
        # both public setters load through it; it broadcasts rank 0's entries, the others allocating each as rank 0
        # names its dtype: uint8 for e8m0
        if not getattr(info, "broadcast_from_rank0", False):
            return orig(model, state_dict, info, *args, **kwargs)
        with scales_e8m0_as_bytes():
            return orig(model, _e8m0_as_bytes(state_dict), info, *args, **kwargs)

    return _load_model_state_dict


def install_torch_loader_support() -> bool:
    """Makes torch's set_model_state_dict / set_state_dict with broadcast_from_rank0=True send MXFP8 layers' e8m0
    scales as bytes; idempotent; whether installed (False where torch has no such private loader)."""
    return _wrap_in(TORCH_DSD_MODULE, "_load_model_state_dict", _wrap_load_model_state_dict)


# ---- FSDP1: refused at wrap time -------------------------------------------------------------------------------------

FSDP1_MODULE = "torch.distributed.fsdp.fully_sharded_data_parallel"

FSDP1_REFUSAL = (
    "FullyShardedDataParallel (FSDP1) cannot wrap {what}: it flattens each unit's parameters into one FlatParameter "
    "of one dtype, and a dorafp8 layer keeps an e4m3 weight beside its 16/32-bit bias and adapters (FSDP1 would stop "
    "with 'Must flatten tensors with uniform dtype'). Use FSDP2, which shards each parameter in its own dtype "
    "(docs/MULTI_GPU.md): torch.distributed.fsdp.fully_shard; in accelerate `fsdp_version: 2` in the config file "
    "(or FSDP_VERSION=2, or FullyShardedDataParallelPlugin(fsdp_version=2)); in the HF Trainer "
    "fsdp_config={{\"version\": 2}} (the default from transformers 5 on)")


def _ignored_param_ids(kwargs) -> set:
    ids = set()
    for key in ("ignored_modules", "ignored_states"):
        for item in kwargs.get(key) or ():
            ids |= {id(p) for p in item.parameters()} if isinstance(item, torch.nn.Module) else {id(item)}
    return ids


def _wrap_fsdp1_init(orig):
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def __init__(self, *args, **kwargs):
        bound = sig.bind(self, *args, **kwargs)
        module = bound.arguments.get("module")
        if isinstance(module, torch.nn.Module):
            ignored = _ignored_param_ids(bound.arguments)
            # an NVFP4 layer's weight is packed uint8: a dorafp8 layer's, though not fp8 (FSDP1 cannot flatten it)
            ours = {id(m.weight) for m in module.modules() if isinstance(m, FP8WeightModule)}
            fp8 = [n for n, p in module.named_parameters() if (is_fp8(p) or id(p) in ours) and id(p) not in ignored]
            if fp8:
                raise TypeError(FSDP1_REFUSAL.format(what=f"a module with {len(fp8)} fp8 weights (e.g. {fp8[0]!r})"))
        return orig(self, *args, **kwargs)

    return __init__


def install_fsdp1_refusal() -> bool:
    """Makes FSDP1 refuse a module holding fp8 weights (naming FSDP2); idempotent; whether installed."""
    mod = sys.modules.get(FSDP1_MODULE)
    cls = getattr(mod, "FullyShardedDataParallel", None)
    if cls is None:
        return False
    _wrap_once(cls, "__init__", _wrap_fsdp1_init)
    return True


def uninstall_fsdp1_refusal() -> None:
    """Puts back FSDP1's own FullyShardedDataParallel.__init__ (for tests and for debugging)."""
    cls = getattr(sys.modules.get(FSDP1_MODULE), "FullyShardedDataParallel", None)
    if cls is not None:
        _unwrap(cls, "__init__")
