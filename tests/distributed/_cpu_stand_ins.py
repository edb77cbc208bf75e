"""What lets 2 CPU processes over gloo stand in for 2 GPUs over NCCL in the multi-process tests, and nothing else:
each function changes one thing, named in its docstring (record_engine changes nothing: it observes). Used by
tests/distributed/_dist_worker.py, and by tests/integration/test_llamafactory_multi.py in LLaMA-Factory's own worker
processes (through a sitecustomize that test writes). Imports no dorafp8 and nothing at import but torch, so that it
can run at interpreter start-up."""

import torch
import torch.distributed as dist

# every float8 dtype (dorafp8.quant.FP8_DTYPES), without importing dorafp8 at interpreter start-up
FP8_DTYPES = frozenset(d for d in vars(torch).values()
                       if isinstance(d, torch.dtype) and str(d).startswith("torch.float8"))
# the float8 dtypes ProcessGroupNCCL maps (ncclFloat8e4m3 / ncclFloat8e5m2, or ncclUint8): not e8m0 (MXFP8's scales),
# for which it raises the TypeError below (vllm-project/vllm#51567, sgl-project/sglang#34853)
NCCL_FP8_DTYPES = frozenset(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                        "float8_e5m2fnuz"))


def nccl_bytes(t):
    """What NCCL moves for an fp8 tensor `t`: its bytes (a uint8 view), or NCCL's TypeError for a dtype it lacks."""
    if t.dtype not in NCCL_FP8_DTYPES:
        name = {torch.float8_e8m0fnu: "Float8_e8m0fnu"}.get(t.dtype, str(t.dtype))
        raise TypeError(f"Input tensor data type is not supported for NCCL process group: {name}")
    return t.view(torch.uint8)


def emulate_nccl_fp8_transport():
    """gloo has no fp8 types ("Invalid scalar type"); NCCL moves e4m3/e5m2 as their bytes (ncclFloat8e4m3, or ncclUint8
    before NCCL 2.24) and refuses e8m0. So that gloo can stand in for NCCL, every fp8 tensor given to these collectives
    (and DTensor's scatter and broadcast, which distribute_tensor uses for Shard and Replicate) goes as a uint8 view of
    the same storage, the bytes NCCL would move, and an e8m0 one raises NCCL's TypeError (nccl_bytes).
    Installed before DeepSpeed's comm backend reads the functions."""
    import torch.distributed.tensor._collective_utils as dtensor_comm

    def as_bytes(a):
        if isinstance(a, (list, tuple)):
            return type(a)(as_bytes(t) for t in a)
        return nccl_bytes(a) if isinstance(a, torch.Tensor) and a.dtype in FP8_DTYPES else a

    def via_bytes(fn):
        def wrapper(*args, **kwargs):
            return fn(*as_bytes(args), **{k: as_bytes(v) for k, v in kwargs.items()})
        return wrapper

    for owner, name in ((dist, "broadcast"), (dist, "all_gather_into_tensor"), (dist, "_all_gather_base"),
                        (dtensor_comm, "scatter"), (dtensor_comm, "broadcast")):
        setattr(owner, name, via_bytes(getattr(owner, name)))

    # DTensor's Shard -> Replicate (full_tensor(), a full state_dict) all-gathers through the functional collectives,
    # which return a new tensor: gathered as bytes, viewed back as fp8.
    import torch.distributed._functional_collectives as funcol

    gather = funcol.all_gather_single

    def all_gather_single(t, *args, **kwargs):
        if t.dtype not in FP8_DTYPES:
            return gather(t, *args, **kwargs)
        out = gather(nccl_bytes(t), *args, **kwargs)
        return (out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out).view(t.dtype)

    funcol.all_gather_single = all_gather_single


def allow_fsdp_on_cpu():
    """accelerate selects FSDP on GPUs only: on a CPU (gloo) group AcceleratorState stays MULTI_CPU and drops the FSDP
    plugin the Trainer gives it. Make it take the plugin, as a GPU group does; nothing else of accelerate changes."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    orig = AcceleratorState.__init__

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        orig(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # what AcceleratorState re-reads

    AcceleratorState.__init__ = __init__


def record_engine(engine: str, out_dir: str):
    """Observes, changing nothing: after accelerate's FSDP2 preparation (engine "fsdp2") or deepspeed.initialize
    (engine "deepspeed"), writes to
    out_dir/rank{RANK}.json what the engine made of the first fp8 weight (its type, dtype, the elements this rank holds,
    the whole), so that a test can tell a sharded run from one that silently fell back to DDP (same losses)."""
    import json
    import os

    def record(engine, model):
        w = next(p for p in model.parameters() if p.dtype in FP8_DTYPES)
        local = w.to_local() if hasattr(w, "to_local") else getattr(w, "ds_tensor", w)
        seen = {"engine": engine, "type": type(w).__name__, "dtype": str(local.dtype), "local_numel": local.numel(),
                "numel": getattr(w, "ds_numel", w.numel())}
        with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "a") as f:
            f.write(json.dumps(seen) + "\n")

    if engine == "deepspeed":
        import deepspeed

        initialize = deepspeed.initialize  # accelerate reads deepspeed.initialize when it prepares

        def ds_initialize(*args, **kwargs):
            out = initialize(*args, **kwargs)
            record(f"deepspeed zero{out[0].zero_optimization_stage()}", out[0].module)
            return out

        deepspeed.initialize = ds_initialize
        return
    import accelerate.accelerator as acc

    prepare = acc.fsdp2_prepare_model  # accelerator.py calls it by this name

    def fsdp2_prepare_model(accelerator, model):
        model = prepare(accelerator, model)
        record("fsdp2", model)
        return model

    acc.fsdp2_prepare_model = fsdp2_prepare_model
