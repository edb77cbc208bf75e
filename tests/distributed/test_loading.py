"""Issue #50: the ways users load a model past one GPU that used to fail, with 2 CPU processes over gloo.

- DeepSpeed ZeRO-3 as LLaMA-Factory loads models: from_pretrained under a ZeRO-3 config (deepspeed.zero.Init
  partitions every weight as it loads), then `dorafp8 run --quantize` quantizes it. Before #50 quantize_model failed
  on the partitioned weights ("cannot reshape tensor of 0 elements"); it now gathers each layer to quantize it, and
  deepspeed.initialize partitions the fp8 weights. An FP8Linear built inside zero.Init is refused by name (zero.Init
  would cast its fp8 weight and fp32 scale).
- FSDP2 with accelerate's cpu_ram_efficient_loading (LLaMA-Factory's fsdp2_config.yaml): accelerate's loader read
  `.device_mesh` off every state_dict entry and FP8Linear's `scale` buffer is no DTensor; it is now listed as one,
  replicated. Ranks other than 0 may hold the model on the meta device when it is quantized (transformers 4.x).
- DeepSpeed ZeRO-2 (LLaMA-Factory's ds_z2_config.json) and ZeRO-3 without zero.Init, on a model quantized before
  deepspeed.initialize: run by hand in issue #50, in the suite now. And the HF Trainer given that ZeRO-3 config
  (--deepspeed): a checkpoint, resume, save_model.

gloo has no fp8 types; NCCL moves fp8 as bytes. Every job therefore sends every fp8 tensor of a collective as a uint8
view of its storage (tests/distributed/_dist_worker.py, emulate_nccl_fp8_transport): the bytes NCCL would move. The
losses, the adapter and the saved adapter (reloaded with plain PEFT) must equal the single-process fp32 run's
(tests/distributed/test_distributed.py's checks, relative 1e-5). Not run here: NCCL itself, bf16, the Trainer under
FSDP (tests/distributed/test_trainer_fsdp2.py: accelerate selects FSDP on GPUs only).
"""

import contextlib
import importlib.util
import os

import pytest
import torch

from tests.distributed import _dist_common as C
from tests.distributed.test_distributed import _check_saved_adapter, _check_training, _launch, reference  # noqa: F401

import dorafp8  # noqa: E402
from tests._tolerance import assert_close


def _needs(module: str, why: str):
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed: {why} (pip install -e '.[test]' installs it)")


def test_zero3_loaded_under_zero_init_through_the_launcher(tmp_path, reference):
    _needs("deepspeed", "the ZeRO-3 job runs DeepSpeed")
    res = _launch("zero3_init", tmp_path, quantize_on_load=True, env={"DS_ACCELERATOR": "cpu"})
    for r in res:
        assert r["partitioned_on_load"]  # from_pretrained ran under zero.Init: every weight partitioned as it loaded
        assert r["via_launcher"] and r["n_fp8_layers"] == 14
        # quantize_model partitioned each fp8 weight again at once, as fp8: half of a 64x64 weight on each rank, and
        # deepspeed.initialize kept it so
        assert r["fp8_partitioned_before_initialize"] == ("torch.float8_e4m3fn", 0, "torch.float8_e4m3fn", 2048)
        assert r["fp8_partition"] == ("torch.float8_e4m3fn", 2048, 4096)
        # built inside zero.Init (whose constructors would cast the fp8 weight and scale): refused, naming it
        for what in ("built_inside_zero_init", "quantized_inside_zero_init"):
            assert "deepspeed.zero.Init" in r[what] and "dorafp8.quantize_model(model) after zero.Init" in r[what]
    _check_training(res, reference)
    _check_saved_adapter(tmp_path / "adapter", reference)


def test_zero2_with_llamafactorys_config(tmp_path, reference):
    """DeepSpeed ZeRO-2 (LLaMA-Factory's ds_z2_config.json values) on a model quantized before deepspeed.initialize:
    the fp8 weights stay whole and fp8 on every rank, the scales fp32, and the optimizer's partitions hold the adapter
    tensors only (by hand in issue #50 before). Rank 1 builds another model: DeepSpeed broadcasts rank 0's parameters,
    the fp8 weights' bytes, and not their scales (buffers), so before dorafp8's wrap rank 1 trained rank 0's fp8 bytes
    times its own scales (the losses differed from one process's)."""
    _needs("deepspeed", "the job runs DeepSpeed")
    res = _launch("zero2", tmp_path, env={"DS_ACCELERATOR": "cpu"})
    for r in res:
        assert r["fp8_partition"] == ("torch.float8_e4m3fn", 4096, 4096) and r["scale_dtype"] == "torch.float32"
        assert r["optimizer_numel"] * C.WORLD == r["trainable_numel"] == 8768
        assert r["fp8_and_scales_equal_after_initialize"]  # rank 1 built its own: rank 0's bytes came with their scales
    _check_training(res, reference)
    _check_saved_adapter(tmp_path / "adapter", reference)


def test_zero3_on_a_model_quantized_before_initialize(tmp_path, reference):
    """DeepSpeed ZeRO-3 without zero.Init: the model is quantized whole, then deepspeed.initialize partitions the fp8
    weights as fp8 (half of a 64x64 weight on each rank); the scales stay fp32 (by hand in issue #50 before). Then
    export_merged of the partitioned model, refused, and inside GatheredParameters."""
    _needs("deepspeed", "the job runs DeepSpeed")
    res = _launch("zero3_after_quantizing", tmp_path, env={"DS_ACCELERATOR": "cpu"})
    for r in res:
        assert r["fp8_partition"] == ("torch.float8_e4m3fn", 2048, 4096) and r["scale_dtype"] == "torch.float32"
        assert r["fp8_and_scales_equal_after_initialize"]
    # export_merged on the partitions: refused, naming the gather that works; inside it, rank 0's export is the
    # single-process model's with the same adapter, byte for byte (before: 'cannot reshape tensor of 0 elements')
    assert "ZeRO-3 partitions" in res[0]["export_refusal"] and "GatheredParameters" in res[0]["export_refusal"]
    assert res[0]["merged_equal"]
    # save_kohya_dora: "lycoris" reads the adapter only, written inside GatheredParameters(trainable); "comfyui" reads
    # the base too, refused there (naming the gather) and written inside the whole model's; both equal one process's
    assert res[0]["kohya_written"] == ["comfyui", "lycoris"] and res[0]["kohya_equal"]
    assert len(res[0]["kohya_refusals"]) == 1 and "save_kohya_dora" in res[0]["kohya_refusals"][0] \
        and "GatheredParameters" in res[0]["kohya_refusals"][0]
    _check_training(res, reference)
    _check_saved_adapter(tmp_path / "adapter", reference)


def test_trainer_with_a_zero3_config_trains_saves_and_resumes(tmp_path, reference):
    """The HF Trainer given a ZeRO-3 config (TrainingArguments(deepspeed=...), as `--deepspeed ds_z3_config.json`
    passes it) on a model quantized before it: the fp8 weights partitioned as fp8, the losses and adapter of one
    process, a checkpoint (save_strategy="steps") a fresh Trainer resumes from, and save_model's adapter. save_model
    (transformers' exclude_frozen_parameters path) all-gathers each layer's parameters, the 14 fp8 base weights
    included, one layer at a time, and keeps the adapter: docs/MULTI_GPU.md said it gathered no fp8 weight."""
    _needs("deepspeed", "the job runs DeepSpeed")
    res = _launch("trainer_zero3", tmp_path, env={"DS_ACCELERATOR": "cpu"})
    for r in res:
        assert r["fp8_partition"] == ("torch.float8_e4m3fn", 2048, 4096)
        assert r["fp8_gathers"]["save_model"] == 14
    _check_training(res, reference)
    for r in res:
        for k, v in r["resumed_adapter"].items():
            assert_close(v, r["adapter"][k], 0.0, f"rank {r['rank']} resumed {k}")
    assert {"adapter_model.safetensors", "adapter_config.json", "global_step3"} <= set(res[0]["checkpoint_files"])
    _check_saved_adapter(tmp_path / "adapter", reference, extra_files=("training_args.bin",))


def test_fsdp2_cpu_ram_efficient_loading_through_the_launcher(tmp_path, reference):
    _needs("accelerate", "the job runs accelerate's FSDP2 preparation")
    res = _launch("fsdp2_ram", tmp_path, quantize_on_load=True)
    for r in res:
        assert r["via_launcher"] and r["n_fp8_layers"] == 14
        assert r["fp8_shard"] == ("torch.float8_e4m3fn", 2048, 4096)  # sharded as fp8, rank 0's bytes broadcast
    _check_training(res, reference, ranks_with_adapter=(0,))
    _check_saved_adapter(tmp_path / "adapter", reference)


def test_quantize_model_on_the_meta_device_gives_the_loaded_layout():
    """Under cpu_ram_efficient_loading transformers 4.x leaves the model of ranks other than 0 on the meta device, and
    `dorafp8 run --quantize` quantizes it there: the layers must be the ones rank 0 gets (the same state_dict keys,
    shapes and dtypes), which accelerate's loader then fills with rank 0's tensors."""
    for per_row in (False, True):
        real = dorafp8.quantize_model(C.transformers.LlamaForCausalLM(C.llama_config()), per_row_scale=per_row,
                                      verbose=False)
        with torch.device("meta"):
            meta = C.transformers.LlamaForCausalLM(C.llama_config())
        dorafp8.quantize_model(meta, per_row_scale=per_row, verbose=False)
        want = {k: (v.shape, v.dtype) for k, v in real.state_dict().items()}
        got = {k: (v.shape, v.dtype) for k, v in meta.state_dict().items()}
        assert got == want and sum(isinstance(m, dorafp8.FP8Linear) for m in meta.modules()) == 14
        assert all(v.is_meta for v in meta.state_dict().values())



def test_fsdp2_state_dicts_keep_the_scale_a_plain_buffer(tmp_path):
    """The other side of the replicated scale: FSDP2's own checkpointing (a sharded DCP save and load, and the full
    state_dict) still round-trips an FP8Linear exactly, per-tensor and per-row scales, and the scale stays a plain
    tensor in the module and in a full state_dict. One process (a group of one), no spawn."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from tests.distributed.test_distributed import _free_port

    if dist.is_initialized():
        pytest.skip("a process group exists already in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        for per_row in (False, True):
            models = []
            for seed in (0, 1):
                torch.manual_seed(seed)
                m = dorafp8.quantize_model(C.transformers.LlamaForCausalLM(C.llama_config()), per_row_scale=per_row,
                                           verbose=False)
                for layer in m.model.layers:
                    fully_shard(layer)
                models.append(fully_shard(m))
            a, b = models
            q = a.model.layers[0].self_attn.q_proj
            assert type(a.state_dict()["model.layers.0.self_attn.q_proj.scale"]).__name__ == "DTensor"
            dcp.save(get_model_state_dict(a), checkpoint_id=str(tmp_path / f"dcp{per_row}"))
            sd = get_model_state_dict(b)
            dcp.load(sd, checkpoint_id=str(tmp_path / f"dcp{per_row}"))
            set_model_state_dict(b, sd)
            full = get_model_state_dict(a, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            assert type(full["model.layers.0.self_attn.q_proj.scale"]) is torch.Tensor
            for name, qa in a.named_modules():
                if isinstance(qa, dorafp8.FP8Linear):
                    qb = b.get_submodule(name)
                    assert type(qb.scale) is torch.Tensor and torch.equal(qa.scale, qb.scale)
                    assert torch.equal(qa.weight.full_tensor().view(torch.uint8),
                                       qb.weight.full_tensor().view(torch.uint8))
            assert q.scale.shape == ((64,) if per_row else ())
            ids = C.probe_ids()
            with torch.no_grad():
                assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _sharded_in_a_group_of_one():
    """The test model with fully_shard on its decoder layers and itself, in a gloo group of one (no spawn)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from tests.distributed.test_distributed import _free_port

    if dist.is_initialized():
        pytest.skip("a process group exists already in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        pm = C.build_model(seed=0)
        for layer in pm.base_model.model.model.layers:
            fully_shard(layer)
        fully_shard(pm)
        yield pm
    finally:
        dist.destroy_process_group()


def test_writing_an_fsdp2_sharded_model_is_refused_naming_the_unshard_that_works(tmp_path):
    """export_merged / save_fp8_checkpoint on a model whose parameters are FSDP2 shards (DTensors; what a user has at
    the end of FSDP2 training) stopped inside torch ('got mixed torch.Tensor and DTensor', 'Attempted to access the
    data pointer on an invalid python storage'; the same on 2 ranks). They now refuse, naming unshard(); the steps
    the message gives write the single-process export, byte for byte. One process (a group of one), no spawn."""
    import glob

    from safetensors.torch import load_file
    from torch.distributed.fsdp import FSDPModule

    with _sharded_in_a_group_of_one() as pm:
        for write in (dorafp8.export_merged, dorafp8.save_fp8_checkpoint):
            with pytest.raises(RuntimeError, match=r"FSDP2 shards .*u\.unshard\(\)"):
                write(pm, str(tmp_path / f"refused_{write.__name__}"), verbose=False)
        units = [m for m in pm.modules() if isinstance(m, FSDPModule)]
        [u.unshard() for u in units]
        for write in (dorafp8.export_merged, dorafp8.save_fp8_checkpoint):
            write(pm, str(tmp_path / f"fsdp_{write.__name__}"), verbose=False)
            write(C.build_model(seed=0), str(tmp_path / f"one_{write.__name__}"), verbose=False)
            got, want = ({k: v for f in glob.glob(str(tmp_path / f"{kind}_{write.__name__}" / "*.safetensors"))
                          for k, v in load_file(f).items()} for kind in ("fsdp", "one"))
            assert got.keys() == want.keys() and got
            for k in want:
                assert got[k].dtype == want[k].dtype and torch.equal(got[k].reshape(-1).view(torch.uint8),
                                                                     want[k].reshape(-1).view(torch.uint8)), k
        [u.reshard() for u in units]
        assert not glob.glob(str(tmp_path / "refused_*"))


def test_an_fsdp2_lm_head_written_after_unshard_is_listed_dense_in_the_config(tmp_path):
    """fully_shard(model.lm_head) (torchtitan shards its output layer so) makes the head an FSDPLinear; the writers
    told a dense layer by `type(m) is nn.Linear`, so save_fp8_checkpoint after the unshard the refusal names left it
    out of config.json's quantization_config ("ignore": [], modules_to_not_convert None): the config said the bf16
    head was fp8. Both configs now equal the unsharded model's. One process (a group of one), no spawn."""
    import json

    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from tests.distributed.test_distributed import _free_port

    if dist.is_initialized():
        pytest.skip("a process group exists already in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        for sharded in (False, True):
            torch.manual_seed(0)
            m = dorafp8.quantize_model(C.transformers.LlamaForCausalLM(C.llama_config()), verbose=False)
            if sharded:
                for unit in (m.lm_head, *m.model.layers, m):
                    fully_shard(unit)
                [u.unshard() for u in m.modules() if isinstance(u, FSDPModule)]
                assert type(m.lm_head).__name__ == "FSDPLinear"
            for fmt in ("compressed-tensors", "fine-grained"):
                dorafp8.save_fp8_checkpoint(m, str(tmp_path / f"{fmt}_{sharded}"), fmt, verbose=False)
    finally:
        dist.destroy_process_group()
    for fmt, key in (("compressed-tensors", "ignore"), ("fine-grained", "modules_to_not_convert")):
        plain, fsdp = (json.loads((tmp_path / f"{fmt}_{s}" / "config.json").read_text())["quantization_config"]
                       for s in (False, True))
        assert plain[key] == ["lm_head"] and fsdp == plain, (fmt, fsdp)


def test_kohya_export_of_an_fsdp2_sharded_model_is_refused_naming_the_unshard_that_works(tmp_path):
    """save_kohya_dora (and save_single_file_dora, which shares its first step) on an FSDP2-sharded model stopped
    inside safetensors ('Attempted to access the data pointer on an invalid python storage'); refused now, naming
    unshard(), after which the file equals the single-process one. One process (a group of one), no spawn."""
    from safetensors.torch import load_file
    from torch.distributed.fsdp import FSDPModule

    with _sharded_in_a_group_of_one() as pm:
        with pytest.raises(RuntimeError, match=r"save_kohya_dora reads whole weights.*FSDP2 shards .*u\.unshard\(\)"):
            dorafp8.save_kohya_dora(pm, str(tmp_path / "refused.safetensors"))
        with pytest.raises(RuntimeError, match=r"save_single_file_dora reads whole weights.*FSDP2 shards"):
            dorafp8.save_single_file_dora(pm, str(tmp_path / "refused1.safetensors"), {})
        assert not list(tmp_path.iterdir())
        units = [m for m in pm.modules() if isinstance(m, FSDPModule)]
        [u.unshard() for u in units]
        dorafp8.save_kohya_dora(pm, str(tmp_path / "fsdp.safetensors"), dora_scale="comfyui")
        [u.reshard() for u in units]
        dorafp8.save_kohya_dora(C.build_model(seed=0), str(tmp_path / "one.safetensors"), dora_scale="comfyui")
        got, want = load_file(str(tmp_path / "fsdp.safetensors")), load_file(str(tmp_path / "one.safetensors"))
        assert got.keys() == want.keys() and got
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("fsdp", [False, True], ids=["tp", "fsdp2_on_tp"])
def test_writing_a_tensor_parallel_model_is_refused_naming_the_gather_that_works(tmp_path, fsdp):
    """A model with tensor-parallel DTensors (torch's parallelize_module on lm_head; its ColwiseParallel takes nn.Linear
    only, so dorafp8's layers stay whole) was refused with FSDP2's unshard() advice, which does not apply: with no
    FSDP2 there is no FSDPModule to unshard, and with FSDP2 on top (a 2-D mesh, dp x tp) unshard() leaves lm_head a
    DTensor, so the refusal after it gave the same unshard() advice again, and again. The refusal now names the gather
    that works, before and after unshard(), and following it (a full state dict, loaded into the model built without
    tensor parallelism or FSDP2) writes the single-process export. A group of one."""
    import glob

    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from tests.distributed.test_distributed import _free_port

    if dist.is_initialized():
        pytest.skip("a process group exists already in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        pm = C.build_model(seed=0)
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        parallelize_module(pm.base_model.model, mesh["tp"], {"lm_head": ColwiseParallel()})
        if fsdp:
            for layer in pm.base_model.model.model.layers:
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(pm, mesh=mesh["dp"])
        units = [m for m in pm.modules() if isinstance(m, FSDPModule)]
        assert len(units) == (3 if fsdp else 0)
        says = r"tensor-parallel DTensors \(e\.g\. 'base_model\.model\.lm_head\.weight'.*get_model_state_dict"
        for unsharded in (False, True) if fsdp else (False,):
            [u.unshard() for u in units if unsharded]
            with pytest.raises(RuntimeError, match=says) as e:
                dorafp8.export_merged(pm, str(tmp_path / "refused"), verbose=False)
            assert "unshard()" not in str(e.value).split("FSDP2's unshard() does not gather")[1]
        [u.reshard() for u in units]
        sd = get_model_state_dict(pm, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        plain = C.build_model(seed=1)
        plain.load_state_dict(sd)
        dorafp8.export_merged(plain, str(tmp_path / "tp"), verbose=False)
    finally:
        dist.destroy_process_group()
    dorafp8.export_merged(C.build_model(seed=0), str(tmp_path / "one"), verbose=False)
    got, want = ({k: v for f in glob.glob(str(tmp_path / kind / "*.safetensors")) for k, v in load_file(f).items()}
                 for kind in ("tp", "one"))
    assert got.keys() == want.keys() and got and not glob.glob(str(tmp_path / "refused*"))
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k].reshape(-1).view(torch.uint8),
                                                             want[k].reshape(-1).view(torch.uint8)), k


def test_quantizing_a_sharded_or_tensor_parallel_model_is_refused_naming_the_order_that_works():
    """quantize_model on a model whose linear weights are DTensors stopped inside torch ('aten.copy_.default got mixed
    torch.Tensor and DTensor'), naming neither the layer nor the fix: after fully_shard (quantize first), and on a
    tensor-parallel plan (parallelize_module's ColwiseParallel / RowwiseParallel; dorafp8's layers hold whole weights).
    Each is now refused naming its fix, and nothing is swapped. A group of one, no spawn."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from tests.distributed.test_distributed import _free_port

    if dist.is_initialized():
        pytest.skip("a process group exists already in this process")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        tp = C.transformers.LlamaForCausalLM(C.llama_config())
        for layer in tp.model.layers:
            parallelize_module(layer.self_attn, init_device_mesh("cpu", (1,)),
                               {"q_proj": ColwiseParallel(), "o_proj": RowwiseParallel()})
        fsdp = C.transformers.LlamaForCausalLM(C.llama_config())
        for layer in fsdp.model.layers:
            fully_shard(layer)
        fully_shard(fsdp)
        for model, says in ((tp, r"'model\.layers\.0\.self_attn\.q_proj'.*tensor-parallel DTensor.*out of the tensor-"),
                            (fsdp, r"'model\.layers\.0\.self_attn\.q_proj'.*FSDP2 shard.*before fully_shard")):
            with pytest.raises(RuntimeError, match=says):
                dorafp8.quantize_model(model, C.TARGETS, backend="reference", verbose=False)
            assert not any(isinstance(m, dorafp8.FP8Linear) for m in model.modules())
    finally:
        dist.destroy_process_group()


_MICROSCALED_LOADER_JOB = """
import os, sys, types, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
from tests.distributed._cpu_stand_ins import emulate_nccl_fp8_transport
emulate_nccl_fp8_transport()
dist.init_process_group("gloo", rank=0, world_size=1)
from accelerate.utils import fsdp_utils  # its fsdp2_prepare_model calls the loader by this module's name
from torch.distributed.fsdp import fully_shard
from tests.distributed import _dist_common as C
src = C.build_microscaled_model(0)
dst = C.build_microscaled_model(1)  # other weights, scales and adapters
for layer in dst.base_model.model.model.layers:
    fully_shard(layer)
fully_shard(dst)
try:
    LOAD
    ids = C.probe_ids()
    with torch.no_grad():
        print("loaded", torch.equal(src(input_ids=ids).logits, dst(input_ids=ids).logits),
              {type(m.global_scale).__name__ for m in dst.modules() if getattr(m, "global_scale", None) is not None},
              sorted({str(b.dtype) for n, b in dst.named_buffers() if n.endswith("q_proj.base_layer.scale")}))
except Exception as e:
    print(type(e).__name__, "::", e)
dist.destroy_process_group()
"""


_LOADERS = {
    "accelerate": "fsdp_utils.fsdp2_load_full_state_dict(types.SimpleNamespace(is_main_process=True), dst, "
                  "src.state_dict())",
    "torch": ("from torch.distributed.checkpoint.state_dict import set_model_state_dict, StateDictOptions\n    "
              "set_model_state_dict(dst, src.state_dict(), options=StateDictOptions(full_state_dict=True, "
              "broadcast_from_rank0=True))"),
}


@pytest.mark.parametrize("loader", sorted(_LOADERS))
def test_fsdp2_cpu_ram_efficient_loading_of_nvfp4_and_mxfp8_layers(loader):
    """accelerate's FSDP2 loader (cpu_ram_efficient_loading) reads `.device_mesh` off every state_dict entry of the
    sharded model: an NVFP4 layer's `global_scale` buffer was listed as a plain tensor ('Tensor' object has no attribute
    'device_mesh'). It is now listed replicated, as `scale` is, and taken back as a plain buffer: the loaded model
    computes what the source does. The loader broadcasts every entry, and NCCL has no e8m0 type: an MXFP8 layer's
    scales stopped it with NCCL's TypeError (hidden here while the stand-in sent e8m0 as bytes too); they now go as
    bytes and load as e8m0. One process (a group of one), accelerate's own loader; fp8 collectives as NCCL takes them.
    torch's own rank-0 loader, set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True), broadcast them
    too and stopped at the same TypeError; it sends them as bytes now."""
    _needs("accelerate", "the job runs accelerate's FSDP2 loader")
    import subprocess
    import sys

    from tests.distributed.test_distributed import JOB_TIMEOUT_S, REPO, _free_port

    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    job = _MICROSCALED_LOADER_JOB.replace("LOAD", _LOADERS[loader])
    r = subprocess.run([sys.executable, "-c", job, str(_free_port())], capture_output=True,
                       text=True, env=env, cwd=REPO, timeout=JOB_TIMEOUT_S)
    assert r.returncode == 0, r.stderr[-4000:]
    line = next(x for x in r.stdout.splitlines() if "::" in x or x.startswith("loaded"))
    assert line == "loaded True {'Tensor'} ['torch.float8_e8m0fnu']", line


def test_the_fsdp2_loader_wrap_is_installed_when_accelerate_is_imported_after_dorafp8():
    """The usual order (`import dorafp8` first): the import hook wraps accelerate's loader once, before
    accelerate.utils re-exports it; installing again changes nothing."""
    _needs("accelerate", "the hook wraps accelerate's FSDP2 loader")
    import subprocess
    import sys

    from tests.distributed.test_distributed import JOB_TIMEOUT_S, REPO

    job = ("import dorafp8\n"
           "from accelerate.utils import fsdp_utils\n"
           "import accelerate.utils\n"
           "from dorafp8.distributed import install_accelerate_loader_support\n"
           "f = fsdp_utils.fsdp2_load_full_state_dict\n"
           "print(hasattr(f, '_dorafp8_orig'), not hasattr(f._dorafp8_orig, '_dorafp8_orig'),\n"
           "      accelerate.utils.fsdp2_load_full_state_dict is f, install_accelerate_loader_support(),\n"
           "      fsdp_utils.fsdp2_load_full_state_dict is f)\n")
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", job], capture_output=True, text=True, env=env, cwd=REPO,
                       timeout=JOB_TIMEOUT_S)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.split() == ["True"] * 5, r.stdout


def test_deepspeed_multi_node_launch_is_refused_by_the_launcher(tmp_path):
    """`dorafp8 run --quantize -- deepspeed --hostfile <2 hosts> ...`: deepspeed starts a multi-node run's workers
    through pdsh (or mpirun, srun) with only the variables it exports (PYTHON*, ...), never DORAFP8_RUN, and a
    PYTHONPATH naming this node's temporary sitecustomize, so every worker ran without dorafp8's options, silently:
    --quantize ignored. Now `dorafp8 run` refuses when deepspeed makes its multi-node launcher, naming `--no_ssh
    --node_rank` on each node. A stand-in `pdsh` on PATH records what it would have run; no ssh is made
    (`--no_ssh_check`, `--master_addr`)."""
    import os
    import subprocess
    import sys

    _needs("deepspeed", "the deepspeed launcher is what is run")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ran = tmp_path / "pdsh_ran.txt"
    (bin_dir / "pdsh").write_text(f"#!/bin/sh\necho \"$@\" > {ran}\n")
    (bin_dir / "pdsh").chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node1 slots=1\nnode2 slots=1\n")
    (tmp_path / "train.py").write_text("print('worker ran')\n")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore",
               PATH=os.pathsep.join([str(bin_dir), os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
               PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "dorafp8", "run", "--quantize", "--", "deepspeed", "--hostfile",
                        str(hostfile), "--launcher", "pdsh", "--no_ssh_check", "--master_addr", "10.0.0.1", "train.py"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert not ran.exists(), f"deepspeed ran its multi-node launcher: pdsh {ran.read_text()}"
    assert r.returncode != 0
    assert "dorafp8 run: deepspeed is starting a multi-node run (launcher='pdsh'" in r.stderr, r.stderr[-3000:]
    assert "--no_ssh --node_rank" in r.stderr


def test_deepspeed_buffer_dtype_leaves_the_scales_as_they_are():
    """A DeepSpeed config's data_types.buffer_dtype casts every floating buffer (`b.data = b.data.to(...)`, past
    FP8WeightModule._apply): the fp32 scales were rounded to bf16 / fp16, silently moving every base weight. DeepSpeed's
    own cast (DeepSpeedEngine._cast_module_mixed_precision, called as deepspeed.initialize calls it) on per-tensor,
    per-row, MXFP8 and NVFP4 layers: the scales keep their dtypes and bytes; the other buffers and the parameters are
    cast as DeepSpeed says."""
    _needs("deepspeed", "the cast is DeepSpeed's")
    import subprocess
    import sys

    from tests.distributed.test_distributed import JOB_TIMEOUT_S, REPO

    job = """
import types, torch, dorafp8
from deepspeed.runtime.engine import DeepSpeedEngine
from dorafp8.quant import quantize_mxfp8, quantize_nvfp4
torch.manual_seed(0)
lin = torch.nn.Linear(64, 64)
with torch.no_grad():
    lin.weight.mul_(1e-3)  # a per-tensor scale of ~1e-7: an fp16 subnormal
w8, scale, g = quantize_nvfp4(lin.weight.detach())
net = torch.nn.Sequential(dorafp8.FP8Linear.from_float(lin), dorafp8.FP8Linear.from_float(lin, per_row_scale=True),
                          dorafp8.FP8Linear.from_fp8(*quantize_mxfp8(lin.weight.detach()), None),
                          dorafp8.FP8Linear.from_fp8(w8, scale, None, global_scale=g))
net.register_buffer("other", torch.ones(3))
for dtype in (torch.bfloat16, torch.float16):
    before = {n: (b.dtype, b.clone()) for n, b in net.named_buffers() if n != "other"}
    DeepSpeedEngine._cast_module_mixed_precision(types.SimpleNamespace(module=net), dtype, dtype, False, None)
    kept = all(b.dtype == before[n][0] and torch.equal(b.reshape(-1).view(torch.uint8),
                                                       before[n][1].reshape(-1).view(torch.uint8))
               for n, b in net.named_buffers() if n in before)
    print(kept, net.other.dtype == dtype, net[0].bias.dtype == dtype, len(before))
"""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", job], capture_output=True, text=True, env=env, cwd=REPO,
                       timeout=JOB_TIMEOUT_S)
    assert r.returncode == 0, r.stderr[-4000:]
    lines = [x for x in r.stdout.splitlines() if x.startswith(("True", "False"))]
    assert lines == ["True True True 5"] * 2, r.stdout  # 5 scales: per tensor, per row, MXFP8, NVFP4 and its global


def test_deepspeed_zero_checkpoint_loads_microscaled_scales_back(tmp_path):
    """DeepSpeed's own way back from a ZeRO checkpoint, load_state_dict_from_zero_checkpoint (zero_to_fp32), casts
    every floating buffer to fp32 (parse_model_states: `v.float() if v.is_floating_point()`): an MXFP8 layer's e8m0
    and an NVFP4 layer's e4m3 block scales came back as fp32, and load_state_dict refused them ('scale must have one
    element (per tensor), shape [64] (per row) or [1, 1] ...'), so the checkpoint could not be resumed. They now load
    back as their own dtypes where the cast back is exact. ZeRO-2 in a gloo group of one (DeepSpeed's CPU accelerator):
    save_checkpoint, then its loader into a model built from another seed, which then computes as the saved one.
    zero_to_fp32's file (convert_zero_checkpoint_to_state_dict, dtype=float32 by default) also widens the frozen e4m3
    weights: load_state_dict refused them ('quantize it with dorafp8.quantize_e4m3'); they load back where exact and
    the scales are fp32. dtype=torch.bfloat16 rounds the per-tensor fp32 scale: refused, naming dtype=torch.float32."""
    _needs("deepspeed", "the checkpoint and its loader are DeepSpeed's")
    import subprocess
    import sys

    from tests.distributed.test_distributed import JOB_TIMEOUT_S, REPO, _free_port

    job = """
import sys, torch, dorafp8, deepspeed
from deepspeed.utils.zero_to_fp32 import load_state_dict_from_zero_checkpoint
from dorafp8.quant import quantize_mxfp8, quantize_nvfp4
def model(seed):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    w8, sc = quantize_mxfp8(m[0].weight.detach())
    m[0] = dorafp8.FP8Linear.from_fp8(w8, sc, m[0].bias.detach().clone(), backend="reference")
    w8, sc, g = quantize_nvfp4(m[1].weight.detach())
    m[1] = dorafp8.FP8Linear.from_fp8(w8, sc, m[1].bias.detach().clone(), backend="reference", global_scale=g)
    m.append(dorafp8.FP8Linear.from_fp8(*dorafp8.quantize_e4m3(torch.randn(64, 64)), None, backend="reference"))
    m[0].bias.requires_grad_(False), m[1].bias.requires_grad_(False)
    return m
deepspeed.init_distributed("gloo")
m = model(0)
cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
       "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
engine, *_ = deepspeed.initialize(model=m, model_parameters=list(m[2].parameters()), config=cfg)
engine.save_checkpoint(sys.argv[1])
fresh = model(1)
load_state_dict_from_zero_checkpoint(fresh, sys.argv[1])
x = torch.randn(3, 64)
print("RESULT", fresh[0].scale.dtype, fresh[1].scale.dtype, torch.equal(fresh(x), model(0)(x)))
from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict
from safetensors.torch import load_file
for dtype in (torch.float32, torch.bfloat16):
    out = sys.argv[1] + "_" + str(dtype)
    convert_zero_checkpoint_to_state_dict(sys.argv[1], out, dtype=dtype, safe_serialization=True)
    sd = load_file(out + "/model.safetensors")
    fresh = model(2)
    try:
        fresh.load_state_dict(sd)
        print("RESULT", sd["3.weight"].dtype, fresh[3].weight.dtype, torch.equal(fresh(x), model(0)(x)))
    except RuntimeError as e:
        print("RESULT", sd["3.weight"].dtype, "3.scale: torch.bfloat16" in str(e), "dtype=torch.float32" in str(e))
"""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", job, str(tmp_path / "ckpt")], capture_output=True, text=True, env=env,
                       cwd=REPO, timeout=JOB_TIMEOUT_S)
    assert r.returncode == 0, r.stderr[-4000:]
    assert [x for x in r.stdout.splitlines() if x.startswith("RESULT")] == [
        "RESULT torch.float8_e8m0fnu torch.float8_e4m3fn True",
        "RESULT torch.float32 torch.float8_e4m3fn True", "RESULT torch.bfloat16 True True"], r.stdout


def test_zero_to_fp32_16_bit_refuses_rounded_microscaled_scales():
    """zero_to_fp32 with a 16-bit dtype (its to_torch_tensor, which convert_zero_checkpoint_to_state_dict runs on every
    shard) casts every floating tensor. NVFP4: the packed uint8 weight is left as it is, so the widened-weight
    refusal never fired, and the fp32 global_scale, rounded (bf16: up to 2**-9 off, every weight of the layer with
    it), loaded silently. MXFP8 in fp16: an e8m0 block scale under 2**-24 flushed to 0, which e8m0 (it has no 0)
    took as 2**-127, the same 0 back in fp16: the block loaded as zeros. Both refused now, naming dtype=torch.float32;
    what bf16 holds exactly (e8m0) and the fp32 conversion load bit for bit."""
    _needs("deepspeed", "the conversion is DeepSpeed's")
    import subprocess
    import sys

    from tests.distributed.test_distributed import JOB_TIMEOUT_S, REPO

    job = """
import torch, dorafp8
from deepspeed.utils.zero_to_fp32 import to_torch_tensor
from dorafp8.quant import quantize_mxfp8, quantize_nvfp4
def layer(kind, seed):
    torch.manual_seed(seed)
    w = torch.randn(64, 64)
    w[:8] *= 1e-7  # MXFP8 blocks whose e8m0 scale is under fp16's smallest subnormal (2**-24)
    if kind == "nvfp4":
        w8, sc, g = quantize_nvfp4(w)
        return dorafp8.FP8Linear.from_fp8(w8, sc, None, backend="reference", global_scale=g)
    return dorafp8.FP8Linear.from_fp8(*quantize_mxfp8(w), None, backend="reference")
def same(a, b):
    return all(torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
               for x, y in zip(a.state_dict().values(), b.state_dict().values()))
for kind in ("nvfp4", "mxfp8"):
    saved = layer(kind, 0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        sd, fresh = to_torch_tensor(saved.state_dict(), dtype=dtype), layer(kind, 1)
        try:
            fresh.load_state_dict(sd)
            print("RESULT", kind, dtype, "loaded", same(fresh, saved))
        except RuntimeError as e:
            print("RESULT", kind, dtype, "refused", str(dtype) in str(e) and "dtype=torch.float32" in str(e))
"""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", job], capture_output=True, text=True, env=env, cwd=REPO,
                       timeout=JOB_TIMEOUT_S)
    assert r.returncode == 0, r.stderr[-4000:]
    assert [x for x in r.stdout.splitlines() if x.startswith("RESULT")] == [
        "RESULT nvfp4 torch.float32 loaded True", "RESULT nvfp4 torch.bfloat16 refused True",
        "RESULT nvfp4 torch.float16 refused True", "RESULT mxfp8 torch.float32 loaded True",
        "RESULT mxfp8 torch.bfloat16 loaded True", "RESULT mxfp8 torch.float16 refused True"], r.stdout


def test_deepspeed_broadcast_sends_each_layers_scales_where_it_sends_the_weight():
    """DeepSpeedEngine._broadcast_model sends rank 0's parameters, not the buffers; dorafp8's wrap sends each layer's
    scales right after its weight, from the same source and in the same group. The wrap used to read that group itself
    (`self.seq_data_parallel_group`), which DeepSpeed before 0.10.2 does not have (it broadcast on
    `data_parallel_group`): deepspeed.initialize stopped with an AttributeError there. Run, in a gloo group of one, on
    DeepSpeed's own engine method and on one broadcasting as DeepSpeed before 0.10.2 did: per-tensor, MXFP8 and NVFP4
    layers and a plain one."""
    _needs("deepspeed", "the broadcast is DeepSpeed's")
    import subprocess
    import sys

    from tests.distributed.test_distributed import JOB_TIMEOUT_S, REPO, _free_port

    job = """
import sys, types, torch, torch.distributed as dist
sys.path.insert(0, "tests/distributed")
from _cpu_stand_ins import emulate_nccl_fp8_transport
emulate_nccl_fp8_transport()  # gloo has no fp8 types: fp8 goes as its bytes, as NCCL moves it
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:" + sys.argv[1])
import deepspeed, deepspeed.comm as ds_comm, dorafp8
from deepspeed.runtime.engine import DeepSpeedEngine
from dorafp8.distributed import _wrap_broadcast_model
from dorafp8.quant import quantize_mxfp8, quantize_nvfp4
deepspeed.init_distributed(dist_backend="gloo")
lin = torch.nn.Linear(64, 64)
w8, scale, g = quantize_nvfp4(lin.weight.detach())
net = torch.nn.Sequential(dorafp8.FP8Linear.from_float(lin), dorafp8.FP8Linear.from_fp8(*quantize_mxfp8(
    lin.weight.detach()), None), dorafp8.FP8Linear.from_fp8(w8, scale, None, global_scale=g), torch.nn.Linear(4, 4))
names = {t.data_ptr(): n for n, t in list(net.named_parameters()) + list(net.named_buffers())}
group = dist.new_group([0])
sent, real = [], ds_comm.broadcast
def record(tensor, src, *a, **k):
    sent.append((names.get(tensor.data_ptr()), k.get("group", a[0] if a else None) is group))
    return real(tensor, src, *a, **k)
ds_comm.broadcast = record

class Before0102:  # DeepSpeed 0.9 to 0.10.1: every parameter in data_parallel_group, no seq_data_parallel_group
    def __init__(self, module):
        self.module, self.data_parallel_group, self.dist_backend = module, group, "gloo"
    @_wrap_broadcast_model
    def _broadcast_model(self):
        for p in self.module.parameters():
            ds_comm.broadcast(p, 0, group=self.data_parallel_group)

now = types.SimpleNamespace(module=net, dist_backend="gloo", seq_data_parallel_group=group)
for engine, call in (("before 0.10.2", lambda: Before0102(net)._broadcast_model()),
                     ("0.19", lambda: DeepSpeedEngine._broadcast_model(now))):
    sent.clear()
    call()
    print(engine, sent)
"""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", job, str(_free_port())], capture_output=True, text=True, env=env,
                       cwd=REPO, timeout=JOB_TIMEOUT_S)
    assert r.returncode == 0, r.stderr[-4000:]
    import ast

    got = dict(line.split(" [", 1) for line in r.stdout.splitlines() if line.startswith(("before", "0.19")))
    assert set(got) == {"before 0.10.2", "0.19"}, r.stdout
    for engine, line in got.items():
        sent = ast.literal_eval("[" + line)
        names = [n for n, _ in sent]
        assert all(same_group for _, same_group in sent), (engine, sent)
        for layer, scales in (("0", ["scale"]), ("1", ["scale"]), ("2", ["scale", "global_scale"])):
            i = names.index(f"{layer}.weight")  # each scale right after its weight, once
            assert names[i + 1:i + 1 + len(scales)] == [f"{layer}.{s}" for s in scales], (engine, names)
            assert all(names.count(f"{layer}.{s}") == 1 for s in scales), (engine, names)
        assert "3.weight" in names and not any(n.startswith("3.") and n.endswith("scale") for n in names)


def test_deepspeed_broadcast_wrap_of_two_engines_in_two_threads_leaves_deepspeeds_broadcast():
    """The wrap used to swap the process-wide deepspeed.comm.broadcast while an engine's _broadcast_model ran and put
    back what it had found: two engines starting in two threads (a policy and a reference model), the first finishing
    first, left the first's swap in place for good (the second put back what it had found), holding that model's
    layers, and sending a stale layer's scales after any later broadcast whose tensor reused a freed weight's address
    (on one rank only: a hang or a wrong model). DeepSpeed's broadcast stands in for a recorder here; the engines'
    methods are DeepSpeed's, interleaved with events."""
    _needs("deepspeed", "the broadcast is DeepSpeed's")
    import threading

    import deepspeed.comm as ds_comm

    import dorafp8
    from dorafp8.distributed import _wrap_broadcast_model

    sent, lock = [], threading.Lock()

    def record(tensor, src, *a, **k):
        with lock:
            sent.append(tensor.data_ptr())

    entered_b, done_a = threading.Event(), threading.Event()

    class Engine:
        def __init__(self, module, before=None, after=None):
            self.module, self.before, self.after = module, before, after

        @_wrap_broadcast_model
        def _broadcast_model(self):
            if self.before:
                self.before()
            for p in self.module.parameters():
                ds_comm.broadcast(p.data.view(torch.uint8), 0, group=None)
            if self.after:
                self.after()

    nets = [dorafp8.FP8Linear.from_float(torch.nn.Linear(16, 16)) for _ in range(2)]
    a = Engine(nets[0], before=lambda: entered_b.wait(10))
    b = Engine(nets[1], before=entered_b.set, after=lambda: done_a.wait(10))
    real = ds_comm.broadcast
    ds_comm.broadcast = record
    try:
        ta = threading.Thread(target=lambda: (a._broadcast_model(), done_a.set()))
        tb = threading.Thread(target=b._broadcast_model)
        ta.start(), tb.start()
        ta.join(20), tb.join(20)
        for net in nets:  # each layer's scale right after its weight, once
            i = sent.index(net.weight.data_ptr())
            assert sent[i + 1] == net.scale.data_ptr() and sent.count(net.scale.data_ptr()) == 1, sent
        # a later broadcast (another engine, zero.Init) of a tensor at a layer's address sends that tensor only
        fresh = torch.nn.Linear(16, 16)
        fresh_net = dorafp8.FP8Linear.from_float(fresh)
        Engine(fresh_net)._broadcast_model()
        sent.clear()
        for net in nets + [fresh_net]:
            ds_comm.broadcast(net.weight.data.view(torch.uint8), 0, group=None)
        assert sent == [net.weight.data_ptr() for net in nets + [fresh_net]], sent
        current = ds_comm.broadcast
        while current is not record and hasattr(current, "_dorafp8_orig"):
            current = current._dorafp8_orig
        assert current is record, ds_comm.broadcast
    finally:
        ds_comm.broadcast = real
