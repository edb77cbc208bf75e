"""One rank of a 2-process CPU (gloo) job for tests/distributed/test_distributed.py, launched with
torch.distributed.run:

    python -m torch.distributed.run --nproc_per_node 2 --master_addr 127.0.0.1 --master_port P \
        tests/distributed/_dist_worker.py ENGINE OUT_DIR

ENGINE: ddp | ddp_microscaled | fsdp2 | fsdp2_mp | accelerate | trainer | race | race_ddp | race_fsdp2 | lycoris_fsdp2 | zero3_init |
fsdp2_ram (the last two: tests/distributed/test_loading.py). Each trains the model of _dist_common for STEPS steps on
its half of each global batch and writes OUT_DIR/rank{r}.pt (losses averaged over the ranks, the full adapter state, the
engine's own checks); rank 0 saves the adapter to OUT_DIR/adapter. The test compares it all with the single-process
run. fsdp2_mp runs docs/MULTI_GPU.md's mixed-precision recipe on the doc's model, recording every warning.
"""

import datetime
import os
import sys
import warnings

import torch
import torch.distributed as dist

import _dist_common as C
from _cpu_stand_ins import allow_fsdp_on_cpu, emulate_nccl_fp8_transport  # noqa: F401
import dorafp8
from dorafp8.distributed import FP8_DTYPES, install_ddp_support, params_are_sharded, uninstall_ddp_support

RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
TIMEOUT = datetime.timedelta(seconds=120)  # a hung collective fails the job instead of hanging the test


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def mean_over_ranks(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return (t / WORLD).item()


def all_equal_across_ranks(obj) -> bool:
    got = [None] * WORLD
    dist.all_gather_object(got, obj)
    return all(g == got[0] for g in got)


def sgd_steps(model, opt, backward=None, step=None):
    """STEPS steps on this rank's rows; returns the losses averaged over the ranks (= the full-batch loss). A DeepSpeed
    engine passes its own backward and step (which zeroes the gradients) and no optimizer."""
    ids = C.data()
    losses = []
    for s in range(C.STEPS):
        x = C.local_rows(ids[s], RANK, WORLD)
        loss = model(input_ids=x, labels=x).loss
        (backward or torch.Tensor.backward)(loss)
        if step is not None:
            step()
        else:
            opt.step()
            opt.zero_grad()
        losses.append(mean_over_ranks(loss.item()))
    return losses


# ---- engines -----------------------------------------------------------------------------------------------------


def run_ddp(out):
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", timeout=TIMEOUT)
    res = {}
    # Rank 1 loads different weights (base, scales and adapters): after wrapping, rank 0's must be everywhere.
    pm = C.build_model(seed=RANK)
    res["fingerprints_differ_before"] = not all_equal_across_ranks(C.fp8_fingerprint(pm))

    # Without dorafp8's support DDP cannot wrap the model on gloo (the failure of issue #13), so this test can fail.
    uninstall_ddp_support()
    try:
        DDP(pm)
        res["plain_ddp_error"] = None
    except RuntimeError as e:
        res["plain_ddp_error"] = str(e)
    install_ddp_support()

    calls = []  # every coalesced broadcast DDP makes: (phase, [(dtype, numel)])
    orig = dist._broadcast_coalesced
    phase = ["init"]

    def spy(pg, tensors, *a, **k):
        calls.append((phase[0], [(str(t.dtype), t.numel()) for t in tensors]))
        return orig(pg, tensors, *a, **k)

    dist._broadcast_coalesced = spy
    model = DDP(pm)  # broadcast_buffers=True, the default
    res["fingerprints_equal_after"] = all_equal_across_ranks(C.fp8_fingerprint(pm))
    res["rank0_fingerprint"] = C.fp8_fingerprint(pm) if RANK == 0 else None
    phase[0] = "train"
    opt = torch.optim.SGD(trainable(model), lr=C.LR)
    res["losses"] = sgd_steps(model, opt)
    dist._broadcast_coalesced = orig
    res["broadcasts"] = calls
    res["n_fp8_weights"] = sum(1 for p in pm.parameters() if p.dtype in FP8_DTYPES)
    res["fp8_weight_bytes"] = sum(p.numel() for p in pm.parameters() if p.dtype in FP8_DTYPES)
    res["adapter"] = C.adapter_state(pm)
    if RANK == 0:
        pm.save_pretrained(os.path.join(out, "adapter"))
    return res


def _frozen_fingerprint(model) -> str:
    """sha256 of every frozen parameter's and every buffer's bytes, in name order: base weights, scales, global scales."""
    import hashlib

    h = hashlib.sha256()
    for name, t in sorted([(n, p) for n, p in model.named_parameters() if not p.requires_grad]
                          + list(model.named_buffers())):
        h.update(name.encode() + t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run_ddp_microscaled(out):
    """DDP on MXFP8 and NVFP4 layers, whose block scales are fp8 buffers (e8m0, e4m3) and whose NVFP4 weight is packed
    uint8 with an fp32 global scale. With broadcast_buffers=True (DDP's default) DDP broadcasts the buffers again
    before every forward, not only when it wraps; with False, a layer's scales must still follow its weight."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", timeout=TIMEOUT)
    res = {}
    for broadcast_buffers in (True, False):
        # broadcast_buffers=False: rank 1 builds other weights, scales and adapters; rank 0's must be everywhere
        pm = C.build_microscaled_model(seed=0 if broadcast_buffers else RANK)
        model = DDP(pm, broadcast_buffers=broadcast_buffers)
        got = {"frozen_equal_after_wrap": all_equal_across_ranks(_frozen_fingerprint(pm))}
        scales = {n: b for n, b in pm.named_buffers() if b.dtype in FP8_DTYPES}
        before = {n: b.clone() for n, b in scales.items()}
        if RANK == 1 and broadcast_buffers:  # written after the wrap: the next forward's broadcast puts rank 0's back
            with torch.no_grad():
                for b in scales.values():
                    b.view(torch.uint8).zero_()
        got["n_fp8_scales"] = len(scales)
        got["scale_dtypes"] = sorted({str(b.dtype) for b in scales.values()})
        got["losses"] = sgd_steps(model, torch.optim.SGD(trainable(model), lr=C.LR))
        got["scales_back"] = all(torch.equal(b.view(torch.uint8), before[n].view(torch.uint8))
                                 for n, b in scales.items())
        got["adapter"] = C.adapter_state(pm)
        res[f"broadcast_buffers={broadcast_buffers}"] = got
    return res


def run_fsdp2(out):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", timeout=TIMEOUT)
    res = {}
    pm = C.build_model(seed=0)  # FSDP2 does not broadcast: every rank builds the same model
    full_bytes = sum(p.numel() * p.element_size() for p in pm.parameters() if p.dtype in FP8_DTYPES)
    for layer in pm.base_model.model.model.layers:
        fully_shard(layer)
    fully_shard(pm)
    fp8 = [p for p in pm.parameters() if p.dtype in FP8_DTYPES]
    res["fp8_all_dtensor"] = all(isinstance(p, DTensor) for p in fp8) and len(fp8) == 14
    res["fp8_full_bytes"] = full_bytes
    res["fp8_local_bytes"] = sum(p.to_local().numel() * p.element_size() for p in fp8)
    res["fp8_local_storage_bytes"] = sum(p.to_local().untyped_storage().nbytes() for p in fp8)
    layers = [m for m in pm.modules() if isinstance(m, dorafp8.DoRAFP8Linear)]
    res["layers_detected_sharded"] = len(layers) == 14 and all(
        params_are_sharded(m) and params_are_sharded(m.get_base_layer()) for m in layers)

    # The norm is computed from the full (all-gathered) weight on every forward: count the calls.
    norm_calls = []
    orig_norm = dorafp8.peft.linear.weight_norm

    def counting_norm(w8, *a, **k):
        norm_calls.append((type(w8).__name__, tuple(w8.shape)))
        return orig_norm(w8, *a, **k)

    dorafp8.peft.linear.weight_norm = counting_norm
    opt = torch.optim.SGD(trainable(pm), lr=C.LR)
    res["losses"] = sgd_steps(pm, opt)
    dorafp8.peft.linear.weight_norm = orig_norm
    res["norm_calls"] = norm_calls

    # The full adapter state dict, the FSDP2 way: only the trainable (adapter) parameters are gathered, never the
    # fp8 base (which gloo could not all-gather anyway), and rank 0 writes it with PEFT.
    sd = get_model_state_dict(pm, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                           ignore_frozen_params=True))
    if RANK == 0:
        pm.save_pretrained(os.path.join(out, "adapter"), state_dict=sd)
        from peft import get_peft_model_state_dict

        res["adapter"] = {k: v.clone() for k, v in get_peft_model_state_dict(pm, state_dict=sd).items()}

    return res


def _record_weight_dtypes(model):
    """Forward pre-hooks on every DoRAFP8Linear and every FP8Linear outside one: what the fp8 weight each forward
    reads is, as (layer kind, dtype, tensor type). Registered after fully_shard, so they run after FSDP's unshard."""
    seen = set()

    def hook(kind, base):
        def record(mod, args):
            seen.add((kind, str(base.weight.dtype), type(base.weight).__name__))
        return record

    bases = {id(m.get_base_layer()) for m in model.modules() if isinstance(m, dorafp8.DoRAFP8Linear)}
    for m in model.modules():
        if isinstance(m, dorafp8.DoRAFP8Linear):
            m.register_forward_pre_hook(hook("DoRAFP8Linear", m.get_base_layer()))
        elif isinstance(m, dorafp8.FP8Linear) and id(m) not in bases:
            m.register_forward_pre_hook(hook("FP8Linear", m))
    return seen


def _warning_records(w):
    return [(x.category.__name__, str(x.message), x.filename, x.lineno) for x in w]


def run_fsdp2_mp(out):
    """docs/MULTI_GPU.md's FSDP2 mixed-precision recipe on the doc's own model (MLP projections plain FP8Linear),
    with every warning recorded from the first fully_shard to the saved adapter; then every group with param_dtype,
    with dorafp8's FSDP support and without it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    from dorafp8.distributed import install_fsdp_support, uninstall_fsdp_support

    dist.init_process_group("gloo", timeout=TIMEOUT)
    device = torch.device("cpu")
    fsdp_param = sys.modules[dorafp8.distributed.FSDP_PARAM_MODULE]
    res = {"fsdp_support_installed_on_import": hasattr(fsdp_param.FSDPParam.init_dtype_attrs, "_dorafp8_orig")}
    ids = C.data()

    def fp8_still_sharded(model):
        fp8 = [p for p in model.parameters() if p.dtype in FP8_DTYPES]
        return len(fp8) == 14 and all(isinstance(p, DTensor) for p in fp8)

    # The recipe, as the doc writes it (`model`, `device`, `dorafp8`, `MixedPrecisionPolicy`, `fully_shard` as there).
    model = C.build_doc_model(seed=0)  # FSDP2 does not broadcast: every rank builds the same model
    model.to(device)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for m in model.modules():
            if isinstance(m, dorafp8.DoRAFP8Linear):
                fully_shard(m)                     # fp8 + fp32 adapters, gathered as bytes, not cast
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        dtypes = _record_weight_dtypes(model)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=C.LR)
        losses = []
        for s in range(C.STEPS):
            x = C.local_rows(ids[s], RANK, WORLD)
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            grads_finite = all(p.grad is not None and torch.isfinite(p.grad.full_tensor()).all().item()
                               for p in model.parameters() if p.requires_grad)
            opt.step()
            opt.zero_grad()
            losses.append(mean_over_ranks(loss.item()))
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                  ignore_frozen_params=True))
        if RANK == 0:
            model.save_pretrained(os.path.join(out, "adapter"), state_dict=sd)
    res["doc_recipe"] = {"warnings": _warning_records(w), "losses": losses, "weight_dtypes": sorted(dtypes),
                         "grads_finite": grads_finite, "still_fp8_sharded": fp8_still_sharded(model),
                         "state_keys": sorted(sd)}
    res["train_py_save"] = _doc_train_py_save(model, os.path.join(out, "train_py_adapter"))

    # Every group with param_dtype (the fp8 weights share their groups' policy): with dorafp8's FSDP support they
    # stay fp8; without it FSDP casts them to bf16 and the forward casts them back, warning once.
    for recipe, supported in (("bf16_all", True), ("bf16_all_unsupported", False)):
        m = C.build_doc_model(seed=0)
        for layer in m.base_model.model.model.layers:
            fully_shard(layer, mp_policy=mp)
        fully_shard(m, mp_policy=mp)
        dtypes = _record_weight_dtypes(m)
        dorafp8.nn._base._WARNED_RECAST = False
        if not supported:
            uninstall_fsdp_support()  # FSDP settles each parameter's dtype at its lazy init, in the first forward
        try:
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                x = C.local_rows(ids[0], RANK, WORLD)
                loss = m(input_ids=x, labels=x).loss
                loss.backward()
        finally:
            install_fsdp_support()
        res[recipe] = {
            "warnings": _warning_records(w), "losses": [mean_over_ranks(loss.item())], "weight_dtypes": sorted(dtypes),
            "grads_finite": all(p.grad is not None and torch.isfinite(p.grad.full_tensor()).all().item()
                                for p in m.parameters() if p.requires_grad),
            "still_fp8_sharded": fp8_still_sharded(m),
        }
    return res


def _doc_train_py_save(model, path) -> str:
    """The last lines of docs/MULTI_GPU.md's train.py (its adapter save), as written but for the folder, run on an
    FSDP2 model, as under accelerate's `fsdp_version: 2` (whose unwrap_model returns an FSDP2 model as it is). Returns
    "saved" or the error."""
    from accelerate import Accelerator
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    with open(os.path.join(os.path.dirname(C.__file__), "..", "..", "docs", "MULTI_GPU.md")) as f:
        doc = f.read()
    block = doc.split("<!-- file: train.py -->", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    code = block[block.index("acc.wait_for_everyone()"):].replace('"out/adapter"', repr(path))
    code = code.split("acc.end_training()", 1)[0]  # the script's last line destroys the group this job goes on with
    scope = {"model": model, "acc": Accelerator(cpu=True), "get_model_state_dict": get_model_state_dict,
             "StateDictOptions": StateDictOptions}
    try:
        exec(compile(code, "docs/MULTI_GPU.md train.py", "exec"), scope)
        result = "saved"
    except Exception as e:  # noqa: BLE001 (the test shows what the doc's lines raised)
        result = f"{type(e).__name__}: {e}"
    dist.barrier()  # every rank, whatever the doc's lines did on it
    return result


def run_accelerate(out):
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)  # under torch.distributed.run: MULTI_CPU, DDP over gloo
    res = {"distributed_type": str(acc.distributed_type), "num_processes": acc.num_processes}
    pm = C.build_model(seed=RANK)  # different weights on rank 1: rank 0's win
    opt = torch.optim.SGD(trainable(pm), lr=C.LR)
    model, opt = acc.prepare(pm, opt)
    res["wrapped_in"] = type(model).__name__
    res["fingerprints_equal_after"] = all_equal_across_ranks(C.fp8_fingerprint(pm))
    res["rank0_fingerprint"] = C.fp8_fingerprint(pm) if RANK == 0 else None
    res["losses"] = sgd_steps(model, opt, backward=acc.backward)
    res["adapter"] = C.adapter_state(acc.unwrap_model(model))
    acc.wait_for_everyone()
    acc.unwrap_model(model).save_pretrained(os.path.join(out, "adapter"), is_main_process=acc.is_main_process,
                                            save_function=acc.save)
    acc.wait_for_everyone()
    return res


def _trainer_rows():
    """The global batches of C.data() as the Trainer's dataset: with train_sampling_strategy="sequential" and
    GLOBAL_BATCH // WORLD rows per rank, step s trains on data()[s], each rank on its half."""
    ids = C.data().reshape(C.STEPS * C.GLOBAL_BATCH, C.SEQ)

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return ids.shape[0]

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i]}

    return Rows()


def _trainer_args(out, **kwargs):
    """TrainingArguments for STEPS plain SGD steps at C.LR on CPU over gloo: the reference run's optimizer."""
    from transformers import TrainingArguments

    kwargs = {"save_strategy": "no", **kwargs}
    return TrainingArguments(
        output_dir=os.path.join(out, "trainer"), per_device_train_batch_size=C.GLOBAL_BATCH // C.WORLD,
        max_steps=C.STEPS, learning_rate=C.LR, optim="sgd", lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=0.0, logging_steps=1, report_to=[], use_cpu=True,
        ddp_backend="gloo", seed=0, disable_tqdm=True, dataloader_num_workers=0, remove_unused_columns=False,
        train_sampling_strategy="sequential", **kwargs)


# Reentrant gradient checkpointing, what LLaMA-Factory turns on by default (its use_reentrant_gc: true).
REENTRANT_GC = {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}}


def _count_forwards(pm) -> list:
    """A list that grows by one at each forward of the first DoRA layer (q_proj of layer 0): under gradient
    checkpointing each step runs it twice (the forward and its recomputation in the backward)."""
    calls = []
    pm.base_model.model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda *a: calls.append(1))
    return calls


def run_trainer(out, **kwargs):
    from transformers import Trainer

    args = _trainer_args(out, **kwargs)
    pm = C.build_model(seed=0)
    forwards = _count_forwards(pm)
    trainer = Trainer(model=pm, args=args, train_dataset=_trainer_rows())
    trainer.train()
    res = {"wrapped_in": type(trainer.model_wrapped).__name__, "world_size": args.world_size,
           "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
           "adapter": C.adapter_state(pm), "forwards": len(forwards)}
    trainer.save_model(os.path.join(out, "adapter"))
    return res


def run_trainer_reentrant_gc(out):
    """Reentrant gradient checkpointing under DDP fails for any DoRA model (plain PEFT's too) with DDP's
    find_unused_parameters=True, the Trainer's default for a PeftModel: "Expected to mark a variable ready only
    once". ddp_find_unused_parameters=False, what docs/MULTI_GPU.md says, fixes it."""
    return run_trainer(out, ddp_find_unused_parameters=False, **REENTRANT_GC)


def run_race(out):
    """backend="auto" on a GPU checks kernels in a child process (dorafp8/backends/race.py), with the CPU made a device
    that races native against reference and a fake child that answers at once, each rank's child preferring another
    backend (rank 0's reference, rank 1's native). Both ranks meet a key at once: one child runs, every rank gets its
    verdict. Keys the other rank never meets: each rank resolves its own, nobody waits for the other."""
    from dorafp8 import backends
    from dorafp8.backends import race as _race

    dist.init_process_group("gloo", timeout=TIMEOUT)
    _race.RACERS["cpu"] = ("native", "reference")
    favourite = "reference" if RANK == 0 else "native"
    log = os.path.join(out, "children.log")
    _race.CHILD = [sys.executable, "-c", (
        "import json, sys\n"
        f"open({log!r}, 'a').write('{RANK}\\n')\n"
        "spec = json.loads(sys.argv[1])\n"
        f"ms = {{c: 1.0 if c == {favourite!r} else 2.0 for c in spec['cands']}}\n"
        "print('dorafp8-race result ' + json.dumps({c: {'ok': True, 'ms': t} for c, t in ms.items()}))")]
    os.environ.update(DORAFP8_CACHE_DIR=os.path.join(out, f"cache{RANK}"), DORAFP8_RACE="1")
    os.environ.pop("DORAFP8_BACKEND", None)
    used, real = [], backends.module
    backends.module = lambda name: used.append(name) or real(name)

    def step(M, N=24):
        """A training call of one layer shape; the backends it ran on."""
        used.clear()
        g = torch.Generator().manual_seed(0)
        w8, scale = dorafp8.quantize_e4m3(torch.randn(N, 32, generator=g))
        leaves = [torch.randn(4, 32, generator=g), torch.randn(N, 4, generator=g), torch.rand(N, generator=g) + 0.5]
        leaves = [t.requires_grad_() for t in leaves]
        x = torch.randn(M, 32, dtype=torch.bfloat16, generator=g)
        dorafp8.dora_fp8_linear(x, w8, scale, *leaves, 0.5).float().sum().backward()
        return sorted(set(used))

    res = {"shared": step(40)}  # both ranks at once
    dist.barrier()
    with open(log) as f:
        res["children_after_shared"] = f.read().split()
    res["own_key"] = step(300) if RANK == 1 else step(40, N=16)  # keys the other rank never meets
    return res


def _race_first_steps(out, wrap):
    """The model's first steps under a wrapper (DDP, FSDP2) with backend="auto" checking kernels in a child
    (dorafp8/backends/race.py; the CPU made a device that races native against reference, a fake child that prefers
    native, the static order's pick, on both ranks), then the same steps with DORAFP8_RACE=0: losses, this rank's
    adapter values (its shards under FSDP2) and the backends run, each time; and the keys each rank's children
    checked."""
    from dorafp8 import backends
    from dorafp8.backends import race as _race

    dist.init_process_group("gloo", timeout=TIMEOUT)
    _race.RACERS["cpu"] = ("native", "reference")
    log = os.path.join(out, "children.log")
    _race.CHILD = [sys.executable, "-c", (
        "import json, sys\n"
        "spec = json.loads(sys.argv[1])\n"
        "line = ' '.join(str(spec[k]) for k in ('op', 'N', 'K', 'mb', 'r'))\n"
        f"open({log!r}, 'a').write('{RANK} ' + line + '\\n')\n"
        "res = {c: {'ok': True, 'ms': 1.0 if c == 'native' else 2.0} for c in spec['cands']}\n"
        "print('dorafp8-race result ' + json.dumps(res))")]
    os.environ.pop("DORAFP8_BACKEND", None)
    used, real = [], backends.module
    backends.module = lambda name: used.append(name) or real(name)
    res = {}
    for flag in ("1", "0"):
        os.environ.update(DORAFP8_CACHE_DIR=os.path.join(out, f"cache{RANK}"), DORAFP8_RACE=flag)
        _race.forget()
        pm = C.build_model(seed=0)  # its magnitudes' first norms on "reference"
        for layer in pm.modules():
            if isinstance(layer, dorafp8.FP8Linear):
                layer.backend = "auto"  # build_model's is "reference": forced, never checked
        model = wrap(pm)
        used.clear()
        losses = sgd_steps(model, torch.optim.SGD(trainable(model), lr=C.LR))
        adapter = {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
                   for n, p in pm.named_parameters() if p.requires_grad}
        res[flag] = {"losses": losses, "adapter": adapter, "used": sorted(set(used))}
        dist.barrier()
    with open(log) as f:
        res["children"] = f.read().splitlines()
    return res


def run_race_ddp(out):
    from torch.nn.parallel import DistributedDataParallel as DDP

    return _race_first_steps(out, DDP)


def run_race_fsdp2(out):
    from torch.distributed.fsdp import fully_shard

    def wrap(pm):
        for layer in pm.base_model.model.model.layers:
            fully_shard(layer)
        return fully_shard(pm)
    return _race_first_steps(out, wrap)


# ---- loading paths: DeepSpeed ZeRO-3 through zero.Init, FSDP2 with cpu_ram_efficient_loading -----------------------


def save_base_model(out) -> str:
    """Rank 0 writes the seed-0 base model of C.build_model (fp32, before quantization) for from_pretrained."""
    path = os.path.join(out, "base")
    if RANK == 0:
        torch.manual_seed(0)
        C.transformers.LlamaForCausalLM(C.llama_config()).float().save_pretrained(path)
    dist.barrier()
    return path


def quantize_on_load_or_here(model, res):
    """Under `dorafp8 run --quantize` (DORAFP8_RUN set) from_pretrained has quantized `model` already, as it does for
    a trainer such as LLaMA-Factory; else quantize_model does it here. Records how many layers are fp8."""
    res["via_launcher"] = "DORAFP8_RUN" in os.environ
    if not res["via_launcher"]:
        dorafp8.quantize_model(model, C.TARGETS, backend="reference", verbose=False)
    res["n_fp8_layers"] = sum(isinstance(m, dorafp8.FP8Linear) for m in model.modules())


def peft_with_reference_adapters(model):
    """get_peft_model on the quantized `model`, its adapters set to the single-process reference's (C.build_model(0):
    the same base and the same adapters, drawn there from the seed)."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    cfg = LoraConfig(r=4, lora_alpha=8, use_dora=True, init_lora_weights=False, target_modules=C.TARGETS)
    model.__dict__.pop("name_or_path", None)  # what PEFT writes to adapter_config.json: None, as the reference's
    pm = get_peft_model(model, cfg)
    set_peft_model_state_dict(pm, C.adapter_state(C.build_model(0)))
    return pm


# LLaMA-Factory's examples/deepspeed/ds_z3_config.json, with its "auto" values resolved as the HF Trainer resolves
# them for this run (fp32, no gradient clipping, bucket sizes from hidden_size 64).
DS_Z3_CONFIG = {
    "train_batch_size": C.GLOBAL_BATCH, "train_micro_batch_size_per_gpu": C.GLOBAL_BATCH // C.WORLD,
    "gradient_accumulation_steps": 1, "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
    "fp16": {"enabled": False}, "bf16": {"enabled": False},
    "zero_optimization": {"stage": 3, "overlap_comm": False, "contiguous_gradients": True, "sub_group_size": 1e9,
                          "reduce_bucket_size": 64 * 64, "stage3_prefetch_bucket_size": int(0.9 * 64 * 64),
                          "stage3_param_persistence_threshold": 10 * 64, "stage3_max_live_parameters": 1e9,
                          "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
}


def _deepspeed_steps_and_save(engine, pm, out, res):
    """STEPS steps of a DeepSpeed engine; the adapter gathered into res and saved by rank 0."""
    import deepspeed

    res["losses"] = sgd_steps(engine, None, backward=engine.backward, step=engine.step)
    with deepspeed.zero.GatheredParameters(trainable(pm)):
        res["adapter"] = C.adapter_state(pm)
    if RANK == 0:
        pm.save_pretrained(os.path.join(out, "adapter"), state_dict=res["adapter"])
    return res


def run_zero3_init(out):
    """LLaMA-Factory's ZeRO-3 path: from_pretrained under a ZeRO-3 config (transformers builds the model inside
    deepspeed.zero.Init, which partitions every weight as it loads), quantize_model, PEFT DoRA, deepspeed.initialize,
    STEPS steps, the adapter gathered and saved. fp8 collectives go as bytes (emulate_nccl_fp8_transport)."""
    emulate_nccl_fp8_transport()
    dist.init_process_group("gloo", timeout=TIMEOUT)
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    deepspeed.init_distributed(dist_backend="gloo")
    path = save_base_model(out)
    keep = HfDeepSpeedConfig(DS_Z3_CONFIG)  # noqa: F841 (while it lives, from_pretrained loads under zero.Init)
    model = C.transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    emb = model.model.embed_tokens.weight  # never quantized: what zero.Init did to every weight
    res = {"partitioned_on_load": emb.numel() == 0 and hasattr(emb, "ds_id")}
    # the FP8Linear of a layer cannot be built inside zero.Init (its constructors would cast the fp8 weight)
    for what, build in (("built_inside_zero_init", lambda: dorafp8.FP8Linear(64, 64)),
                        ("quantized_inside_zero_init", lambda: dorafp8.quantize_model(torch.nn.Sequential(
                            torch.nn.Linear(64, 64)), verbose=False))):
        try:
            with deepspeed.zero.Init(config_dict_or_path=DS_Z3_CONFIG):
                build()
            res[what] = None
        except RuntimeError as e:
            res[what] = str(e)
    quantize_on_load_or_here(model, res)
    w = model.model.layers[0].self_attn.q_proj.weight
    res["fp8_partitioned_before_initialize"] = (str(w.dtype), w.numel(), str(w.ds_tensor.dtype), w.ds_tensor.numel())
    pm = peft_with_reference_adapters(model)
    opt = torch.optim.SGD(trainable(pm), lr=C.LR)
    engine, *_ = deepspeed.initialize(model=pm, optimizer=opt, config=DS_Z3_CONFIG)
    w = pm.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    res["fp8_partition"] = (str(w.ds_tensor.dtype), w.ds_tensor.numel(), w.ds_numel)
    return _deepspeed_steps_and_save(engine, pm, out, res)


# LLaMA-Factory's examples/deepspeed/ds_z2_config.json, "auto" resolved as for DS_Z3_CONFIG.
DS_Z2_CONFIG = {**DS_Z3_CONFIG, "zero_optimization": {
    "stage": 2, "allgather_partitions": True, "allgather_bucket_size": 64 * 64, "overlap_comm": False,
    "reduce_scatter": True, "reduce_bucket_size": 64 * 64, "contiguous_gradients": True, "round_robin_gradients": True}}


def _run_deepspeed_after_quantizing(out, config, after=None):
    """A model quantized and given its adapters before DeepSpeed sees it (no zero.Init), then deepspeed.initialize
    with `config`, STEPS steps, the adapter gathered and saved, then after(model, out, res). fp8 collectives go as
    bytes."""
    emulate_nccl_fp8_transport()
    dist.init_process_group("gloo", timeout=TIMEOUT)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    # Rank 1 builds other weights, scales and adapters: deepspeed.initialize broadcasts rank 0's parameters, and each
    # fp8 weight's scales must come with it (DeepSpeed alone sends no buffers: rank 0's fp8 bytes, rank 1's scales).
    pm = C.build_model(seed=RANK)
    opt = torch.optim.SGD(trainable(pm), lr=C.LR)
    engine, optimizer, *_ = deepspeed.initialize(model=pm, optimizer=opt, config=config)
    base = pm.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    w = base.weight
    local = getattr(w, "ds_tensor", w)  # ZeRO-3: this rank's partition; ZeRO-2: the whole weight
    res = {"fp8_partition": (str(local.dtype), local.numel(), getattr(w, "ds_numel", w.numel())),
           "scale_dtype": str(base.scale.dtype),
           "fp8_and_scales_equal_after_initialize": all_equal_across_ranks(C.fp8_fingerprint(pm)),
           # ZeRO-2: the frozen fp8 weights stay out of the optimizer, whose partition holds adapter tensors only
           "optimizer_numel": sum(p.numel() for g in optimizer.param_groups for p in g["params"]),
           "trainable_numel": sum(getattr(p, "ds_numel", p.numel()) for p in trainable(pm))}
    _deepspeed_steps_and_save(engine, pm, out, res)
    if after is not None:
        after(pm, out, res)
    return res


def run_zero2(out):
    return _run_deepspeed_after_quantizing(out, DS_Z2_CONFIG)


def run_zero3_after_quantizing(out):
    return _run_deepspeed_after_quantizing(out, DS_Z3_CONFIG, after=_merged_export_of_partitions)


def _merged_export_of_partitions(pm, out, res):
    """export_merged of a ZeRO-3 model: refused on its partitions, naming GatheredParameters; written inside it by rank
    0, it equals the export of a single-process model holding the same adapter (res["merged_equal"])."""
    import glob

    import deepspeed
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    if RANK == 0:
        try:
            dorafp8.export_merged(pm, os.path.join(out, "refused"), verbose=False)
            res["export_refusal"] = None
        except RuntimeError as e:
            res["export_refusal"] = str(e)
    # save_kohya_dora reads the adapter (what GatheredParameters(trainable) gathers) and, for "comfyui", the base
    kohya = {}
    for scale, gathered in (("lycoris", trainable(pm)), ("comfyui", trainable(pm)), ("comfyui", list(pm.parameters()))):
        with deepspeed.zero.GatheredParameters(gathered):
            if RANK == 0:
                path = os.path.join(out, f"kohya_{scale}_{len(gathered)}.safetensors")
                try:
                    dorafp8.save_kohya_dora(pm, path, dora_scale=scale)
                    kohya[path] = scale
                except RuntimeError as e:
                    res.setdefault("kohya_refusals", []).append(str(e))
    with deepspeed.zero.GatheredParameters(list(pm.parameters())):
        if RANK == 0:
            dorafp8.export_merged(pm, os.path.join(out, "merged"), verbose=False)
    if RANK == 0:
        one = C.build_model(seed=0)
        set_peft_model_state_dict(one, res["adapter"])
        dorafp8.export_merged(one, os.path.join(out, "merged_one"), verbose=False)
        res["kohya_written"] = sorted(kohya.values())
        res["kohya_equal"] = all(_same_file(load_file(path), one, scale, out) for path, scale in kohya.items())
        got, want = ({k: v for f in glob.glob(os.path.join(out, d, "*.safetensors")) for k, v in load_file(f).items()}
                     for d in ("merged", "merged_one"))
        res["merged_equal"] = bool(want) and got.keys() == want.keys() and all(
            got[k].dtype == want[k].dtype and torch.equal(got[k].reshape(-1).view(torch.uint8),
                                                          want[k].reshape(-1).view(torch.uint8)) for k in want)


def _same_file(got, one, scale, out):
    """Whether `got` equals save_kohya_dora(one, dora_scale=scale)'s tensors."""
    from safetensors.torch import load_file

    path = os.path.join(out, f"kohya_one_{scale}.safetensors")
    dorafp8.save_kohya_dora(one, path, dora_scale=scale)
    want = load_file(path)
    return bool(want) and got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def run_trainer_zero3(out):
    """The HF Trainer with a ZeRO-3 config (TrainingArguments(deepspeed=...), LLaMA-Factory's ds_z3_config.json values)
    on a model quantized before the Trainer: a checkpoint during training (save_strategy="steps"), save_model, then a
    fresh Trainer resuming from the checkpoint. fp8 collectives go as bytes; each fp8 all-gather is counted."""
    from peft import set_peft_model_state_dict
    from transformers import Trainer

    emulate_nccl_fp8_transport()
    gathered = []  # the fp8 tensors all-gathered, by phase
    phase = ["train"]
    orig = dist.all_gather_into_tensor

    def spy(*a, **k):
        if any(isinstance(t, torch.Tensor) and t.dtype in FP8_DTYPES for t in (*a, *k.values())):
            gathered.append(phase[0])
        return orig(*a, **k)

    dist.all_gather_into_tensor = spy
    args = _trainer_args(out, save_strategy="steps", save_steps=C.STEPS, deepspeed=DS_Z3_CONFIG)
    pm = C.build_model(seed=0)
    trainer = Trainer(model=pm, args=args, train_dataset=_trainer_rows())
    trainer.train()
    w = pm.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    res = {"fp8_partition": (str(w.ds_tensor.dtype), w.ds_tensor.numel(), w.ds_numel),
           "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}
    import deepspeed

    with deepspeed.zero.GatheredParameters(trainable(pm)):
        res["adapter"] = C.adapter_state(pm)
    phase[0] = "save_model"
    trainer.save_model(os.path.join(out, "adapter"))
    phase[0] = "resume"
    dist.barrier()
    ckpt = os.path.join(args.output_dir, f"checkpoint-{C.STEPS}")
    res["checkpoint_files"] = sorted(os.listdir(ckpt)) if RANK == 0 else None
    pm = C.build_model(seed=0)
    set_peft_model_state_dict(pm, C.adapter_state(C.build_model(seed=1)))
    resumed = Trainer(model=pm, args=_trainer_args(out, deepspeed=DS_Z3_CONFIG), train_dataset=_trainer_rows())
    resumed.train(resume_from_checkpoint=ckpt)
    with deepspeed.zero.GatheredParameters(trainable(pm)):
        res["resumed_adapter"] = C.adapter_state(pm)
    dist.all_gather_into_tensor = orig
    res["fp8_gathers"] = {p: gathered.count(p) for p in ("train", "save_model", "resume")}
    return res


def _lycoris_model():
    """Two residual MLP blocks and a head, quantized (5 FP8Linear), with LyCORIS's DoRA (algo "locon", dora_wd) on
    every layer and its trainable tensors moved off their init; the network is a submodule, so FSDP2 shards it."""
    from lycoris import create_lycoris

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(64, 128), torch.nn.Linear(128, 64)

        def forward(self, x):
            return x + self.fc2(torch.relu(self.fc1(x)))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks, self.head = torch.nn.ModuleList([Block(), Block()]), torch.nn.Linear(64, 8)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    torch.manual_seed(0)
    model = Model()
    dorafp8.quantize_model(model, verbose=False)
    torch.manual_seed(11)
    net = create_lycoris(model, 1.0, linear_dim=4, linear_alpha=2, algo="locon", dora_wd=True)
    net.apply_to()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    model.add_module("lycoris", net)
    return model


def _lycoris_steps(model, rows):
    x = torch.randn(C.GLOBAL_BATCH, 64, generator=torch.Generator().manual_seed(5))[rows]
    y = torch.randn(C.GLOBAL_BATCH, 8, generator=torch.Generator().manual_seed(6))[rows]
    opt = torch.optim.SGD(trainable(model), lr=0.5)
    losses = []
    for _ in range(C.STEPS):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def run_lycoris_fsdp2(out):
    """LyCORIS's DoRA on fp8 layers (dorafp8/lycoris.py) under FSDP2: the blocks and the root sharded, and the first
    block's fc1 a shard unit of its own (the LoCon forward replaces the layer's, so FSDP2's hooks still gather it).
    Every rank also trains an unsharded copy on the full batch: the single-process reference."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    emulate_nccl_fp8_transport()
    dist.init_process_group("gloo", timeout=TIMEOUT)
    ref = _lycoris_model()
    res = {"ref_losses": _lycoris_steps(ref, slice(None)),
           "ref_net": {k: v.detach().clone() for k, v in ref.lycoris.state_dict().items()}}
    model = _lycoris_model()
    fully_shard(model.blocks[0].fc1)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    w = model.blocks[0].fc1.weight
    res["fp8_shard"] = (str(w.dtype), w.to_local().numel(), w.numel())
    per = C.GLOBAL_BATCH // WORLD
    res["losses"] = [mean_over_ranks(x) for x in _lycoris_steps(model, slice(RANK * per, (RANK + 1) * per))]
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                              ignore_frozen_params=True))
    res["net"] = {k.removeprefix("lycoris."): v for k, v in sd.items() if k.startswith("lycoris.")}
    return res


def run_fsdp2_ram(out):
    """accelerate's FSDP2 with cpu_ram_efficient_loading (LLaMA-Factory's fsdp2_config.yaml): rank 0 loads the weights,
    the other ranks get a model on the meta device from from_pretrained, and accelerate's fsdp2_prepare_model (what
    Accelerator.prepare calls under FSDP2; accelerate itself selects FSDP on GPUs only) shards it and broadcasts rank
    0's state_dict into the shards (fsdp2_load_full_state_dict). fp8 broadcasts go as bytes."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    emulate_nccl_fp8_transport()
    acc = Accelerator(cpu=True)  # a gloo group (MULTI_CPU): its FSDP plugin is set below, as on a GPU
    acc.state.fsdp_plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, cpu_ram_efficient_loading=True, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"], reshard_after_forward=True,
        state_dict_type="FULL_STATE_DICT")
    os.environ["ACCELERATE_USE_FSDP"] = "true"  # with the plugin's FSDP_CPU_RAM_EFFICIENT_LOADING: transformers' cue
    path = save_base_model(out)
    model = C.transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    res = {"meta_on_load": [p.is_meta for p in model.parameters()][0]}
    quantize_on_load_or_here(model, res)
    pm = peft_with_reference_adapters(model)
    pm = fsdp2_prepare_model(acc, pm)
    w = pm.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    res["fp8_shard"] = (str(w.dtype), w.to_local().numel(), w.numel())
    opt = torch.optim.SGD(trainable(pm), lr=C.LR)
    res["losses"] = sgd_steps(pm, opt)
    sd = get_model_state_dict(pm, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                            ignore_frozen_params=True))
    if RANK == 0:
        from peft import get_peft_model_state_dict

        res["adapter"] = {k: v.clone() for k, v in get_peft_model_state_dict(pm, state_dict=sd).items()}
        pm.save_pretrained(os.path.join(out, "adapter"), state_dict=sd)
    return res


def _full_adapter(model):
    """The trained adapter of an FSDP2 model, gathered the FSDP2 way (trainable tensors only), on rank 0 (else None)."""
    from peft import get_peft_model_state_dict
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                              ignore_frozen_params=True))
    return {k: v.clone() for k, v in get_peft_model_state_dict(model, state_dict=sd).items()} if RANK == 0 else None


def _run_trainer_fsdp2(out, state_dict_type, fsdp_extra=None, **kwargs):
    """The HF Trainer under accelerate's FSDP2 plugin, configured as users do (TrainingArguments(fsdp=True,
    fsdp_config={"version": 2, ...})), with a checkpoint saved during training (save_strategy="steps"), then the
    Trainer's save_model, then a second Trainer resuming from the checkpoint. fp8 collectives go as bytes."""
    from peft import set_peft_model_state_dict
    from transformers import Trainer

    allow_fsdp_on_cpu()
    emulate_nccl_fp8_transport()
    fsdp_config = {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], **(fsdp_extra or {})}
    if state_dict_type is not None:  # else the Trainer's default, FULL_STATE_DICT
        fsdp_config["state_dict_type"] = state_dict_type
    args = _trainer_args(out, save_strategy="steps", save_steps=C.STEPS, fsdp=True, fsdp_config=fsdp_config, **kwargs)
    pm = C.build_model(seed=0)
    forwards = _count_forwards(pm)
    trainer = Trainer(model=pm, args=args, train_dataset=_trainer_rows())
    plugin = trainer.accelerator.state.fsdp_plugin
    res = {"is_fsdp2": trainer.accelerator.is_fsdp2, "state_dict_type": str(plugin.state_dict_type)}
    trainer.train()
    w = trainer.model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    res["fp8_shard"] = (str(w.dtype), w.to_local().numel(), w.numel())
    res["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    res["forwards"] = len(forwards)
    res["adapter"] = _full_adapter(trainer.model)
    ckpt = os.path.join(args.output_dir, f"checkpoint-{C.STEPS}")
    res["checkpoint_files"] = sorted(os.listdir(ckpt)) if RANK == 0 else None
    trainer.save_model(os.path.join(out, "adapter"))
    dist.barrier()
    res["save_model_wrote"] = os.path.isdir(os.path.join(out, "adapter"))
    if state_dict_type == "SHARDED_STATE_DICT":
        # transformers' save_model writes no model under SHARDED_STATE_DICT (any model); its documented recipe:
        plugin.set_state_dict_type("FULL_STATE_DICT")
        trainer.save_model(os.path.join(out, "adapter"))
        plugin.set_state_dict_type("SHARDED_STATE_DICT")  # the checkpoint to resume from is sharded
    if RANK == 0 and os.path.isfile(os.path.join(ckpt, "pytorch_model_fsdp.bin")):  # FULL_STATE_DICT's checkpoint
        fsdp_bin = torch.load(os.path.join(ckpt, "pytorch_model_fsdp.bin"), weights_only=True)
        res["fsdp_bin"] = {k: (str(v.dtype), tuple(v.shape)) for k, v in fsdp_bin.items()}
        # torch cannot load the full state dict of an optimizer without state (plain SGD; AdamW has state), whatever
        # the model: "AssertionError: Expected device to be set" (torch/distributed/checkpoint/state_dict.py,
        # _load_optim_state_dict). The resume below then loads the model only, as the Trainer does without the file.
        os.remove(os.path.join(ckpt, "optimizer.bin"))
    dist.barrier()
    # A fresh Trainer on a model whose adapters are other values resumes from the checkpoint: the trained adapter.
    pm = C.build_model(seed=0)
    set_peft_model_state_dict(pm, C.adapter_state(C.build_model(seed=1)))
    resumed = Trainer(model=pm, args=_trainer_args(out, fsdp=True, fsdp_config=fsdp_config),
                      train_dataset=_trainer_rows())
    resumed.train(resume_from_checkpoint=ckpt)
    res["resumed_adapter"] = _full_adapter(resumed.model)
    with torch.no_grad():  # the resumed model computes what the trained one did: fp8 bytes, scales and adapters
        res["resumed_logits"] = resumed.model.eval()(input_ids=C.probe_ids()).logits
    return res


def run_trainer_fsdp2_full(out):
    return _run_trainer_fsdp2(out, None)


def run_trainer_fsdp2_sharded(out):
    return _run_trainer_fsdp2(out, "SHARDED_STATE_DICT", **REENTRANT_GC)  # and LLaMA-Factory's checkpointing


def run_trainer_fsdp2_ac(out):
    return _run_trainer_fsdp2(out, None, fsdp_extra={"activation_checkpointing": True})


def _run_trainer_full_model(out, **kwargs):
    """The HF Trainer on a quantized model without PEFT (its non-fp8 tensors trained: embeddings, norms, lm_head),
    a checkpoint during training and save_model, each a save_pretrained(state_dict=<the full state dict it gathered>).
    Rank 0 writes that state dict (gathered again) to OUT/full.pt, for the test to compare the reloaded folder with."""
    from transformers import Trainer

    emulate_nccl_fp8_transport()
    args = _trainer_args(out, save_strategy="steps", save_steps=C.STEPS, **kwargs)
    trainer = Trainer(model=C.build_fp8_base(seed=0), args=args, train_dataset=_trainer_rows())
    trainer.train()
    trainer.save_model(os.path.join(out, "saved"))
    full = trainer.accelerator.get_state_dict(trainer.deepspeed or trainer.model)
    if RANK == 0:
        torch.save(full, os.path.join(out, "full.pt"))
    ckpt = os.path.join(args.output_dir, f"checkpoint-{C.STEPS}")
    return {"checkpoint_files": sorted(os.listdir(ckpt)) if RANK == 0 else None}


def run_trainer_fsdp2_full_model(out):
    allow_fsdp_on_cpu()
    return _run_trainer_full_model(out, fsdp=True, fsdp_config={"version": 2,
                                                                "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})


def run_trainer_zero3_full_model(out):
    return _run_trainer_full_model(out, deepspeed=DS_Z3_CONFIG)


def main():
    engine, out = sys.argv[1], sys.argv[2]
    res = {"engine": engine, "rank": RANK, "world": WORLD, "dorafp8_file": dorafp8.__file__}
    res.update(globals()["run_" + engine](out))
    torch.save(res, os.path.join(out, f"rank{RANK}.pt"))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    # Everything the test reads is on disk now. Skip the interpreter's finalization: under load, gloo's worker threads
    # can still be releasing tensors there and abort the process ("terminate called without an active exception",
    # a torch teardown race, pytorch/pytorch#179291), which would fail a job whose results are complete.
    print(f"rank {RANK}: done", flush=True)
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
