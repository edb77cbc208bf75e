"""Issue #50: the HF Trainer's own saving under accelerate's FSDP2 plugin, configured as users configure it
(TrainingArguments(fsdp=True, fsdp_config={"version": 2, ...})), with 2 CPU processes over gloo.

Each job trains STEPS steps, saves a checkpoint during training (save_strategy="steps"), calls trainer.save_model,
and resumes a fresh Trainer (its adapters set to other values) from the checkpoint. The losses, the adapter, the
adapter save_model wrote (reloaded with plain PEFT) and the resumed adapter must equal the single-process fp32 run
(tests/distributed/test_distributed.py's checks, relative 1e-5). The checkpoint holds the adapters and the fp8 scales,
never the fp8 base (the base comes from the pretrained model at resume, as for any PEFT model).

Two things stand in for a GPU: accelerate selects FSDP on GPUs only, so the worker lets a CPU group take the FSDP plugin
(_dist_worker.allow_fsdp_on_cpu, the one change to accelerate); and gloo has no fp8 types, so fp8 collectives go as
uint8 views of their bytes, which is what NCCL moves (_dist_worker.emulate_nccl_fp8_transport). Under FULL_STATE_DICT
save_model gathers the whole model to rank 0, fp8 base included (accelerate's get_state_dict, as for any model): plain
gloo cannot all-gather fp8 ("Invalid scalar type", the failure issue #50 saw), NCCL moves its bytes. Not run here:
NCCL itself, bf16.
"""

import importlib.util

import pytest
import torch

from tests.distributed.test_distributed import (REL, _check_saved_adapter, _check_training, _launch,  # noqa: F401
                                               reference)
from tests._tolerance import assert_close

if importlib.util.find_spec("accelerate") is None:
    pytest.skip("accelerate is not installed: the jobs run the Trainer under accelerate's FSDP2 plugin "
                "(pip install -e '.[test]' installs it)", allow_module_level=True)

TRAINER_FILES = ("training_args.bin",)  # what the Trainer's _save writes beside the adapter


def _check_trainer_job(res, reference, tmp_path):
    for r in res:
        assert r["is_fsdp2"]
        assert r["fp8_shard"] == ("torch.float8_e4m3fn", 2048, 4096)  # trained sharded, as fp8
    _check_training(res, reference, ranks_with_adapter=(0,))
    _check_saved_adapter(tmp_path / "adapter", reference, extra_files=TRAINER_FILES)
    resumed = res[0]["resumed_adapter"]
    assert resumed.keys() == reference["adapter"].keys()
    for k in resumed:
        assert_close(resumed[k], res[0]["adapter"][k], 0.0, f"resumed {k}")
    for r in res:
        assert_close(r["resumed_logits"], reference["logits"], REL, f"rank {r['rank']} logits after resuming")


def test_trainer_fsdp2_full_state_dict_saves_and_resumes(tmp_path, reference):
    """FULL_STATE_DICT (the Trainer's default): the checkpoint holds the adapter files and accelerate's
    pytorch_model_fsdp.bin; save_model writes the adapter."""
    res = _launch("trainer_fsdp2_full", tmp_path)
    assert "FULL_STATE_DICT" in res[0]["state_dict_type"]
    _check_trainer_job(res, reference, tmp_path)
    assert all(r["forwards"] == 3 for r in res)  # no gradient checkpointing: one forward of a layer per step
    ckpt = set(res[0]["checkpoint_files"])
    assert {"adapter_model.safetensors", "adapter_config.json", "pytorch_model_fsdp.bin", "optimizer.bin"} <= ckpt
    _check_saved_adapter(tmp_path / "trainer" / "checkpoint-3", reference,  # the worker removed optimizer.bin
                         extra_files=ckpt - {"optimizer.bin", "adapter_model.safetensors", "adapter_config.json"})
    # accelerate's checkpoint of the model: the 42 adapter tensors and the 14 fp32 scales (buffers), no fp8 weight
    saved = res[0]["fsdp_bin"]
    assert len(saved) == 56 and {d for d, _ in saved.values()} == {"torch.float32"}
    assert sum(k.endswith("base_layer.scale") for k in saved) == 14


def test_trainer_fsdp2_sharded_state_dict_saves_and_resumes(tmp_path, reference):
    """SHARDED_STATE_DICT: the checkpoint is accelerate's DCP folder of the adapter; transformers' save_model writes
    no model under it (for any model), and its documented recipe (set_state_dict_type("FULL_STATE_DICT"), then
    save_model) writes the adapter. With reentrant gradient checkpointing (LLaMA-Factory's default)."""
    res = _launch("trainer_fsdp2_sharded", tmp_path)
    assert "SHARDED_STATE_DICT" in res[0]["state_dict_type"]
    assert not res[0]["save_model_wrote"]  # transformers' behaviour, the reason for the recipe in MULTI_GPU.md
    assert {"pytorch_model_fsdp_0", "optimizer_0"} <= set(res[0]["checkpoint_files"])
    assert all(r["forwards"] == 6 for r in res)  # checkpointed: each step recomputes the layer's forward
    _check_trainer_job(res, reference, tmp_path)


def test_trainer_fsdp2_activation_checkpointing_trains_and_resumes_but_peft_saves_no_tensors(tmp_path, reference):
    """fsdp_config={"activation_checkpointing": True} (accelerate's fsdp_activation_checkpointing): the losses and the
    model resumed from the checkpoint equal one process's, but save_model's adapter (and the checkpoint's
    adapter_model.safetensors) hold no tensors, for any PEFT model: the checkpoint wrapper renames each decoder layer's
    modules (`layers.0._checkpoint_wrapped_module.self_attn...`), torch strips that part from the state dict, and
    PEFT (0.21) matches its layers' names against the keys and finds none. docs/MULTI_GPU.md says so and names
    gradient_checkpointing=True (run in test_trainer_fsdp2_sharded_state_dict_saves_and_resumes) instead."""
    from safetensors.torch import load_file

    res = _launch("trainer_fsdp2_ac", tmp_path)
    _check_training(res, reference, ranks_with_adapter=())
    for r in res:
        assert r["forwards"] == 6  # checkpointed: each step recomputes the layer's forward
        assert_close(r["resumed_logits"], reference["logits"], REL, f"rank {r['rank']} logits after resuming")
    # PEFT 0.21 saves nothing here (above); a PEFT that saves tensors must save the trained adapter
    if res[0]["adapter"] == {}:
        for path in (tmp_path / "adapter", tmp_path / "trainer" / "checkpoint-3"):
            assert load_file(path / "adapter_model.safetensors") == {}
    else:
        _check_saved_adapter(tmp_path / "adapter", reference, extra_files=TRAINER_FILES)
    # the same with plain PEFT DoRA on a plain model (no dorafp8 layer): PEFT's, not dorafp8's
    import copy

    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from tests.distributed import _dist_common as C

    pm = get_peft_model(C.transformers.LlamaForCausalLM(C.llama_config()),
                        LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=C.TARGETS))
    sd = {k: v for k, v in pm.state_dict().items() if "lora_" in k}
    assert len(get_peft_model_state_dict(copy.deepcopy(pm), state_dict=sd)) == 42
    layers = pm.base_model.model.model.layers
    for i in range(len(layers)):
        layers[i] = checkpoint_wrapper(layers[i], preserve_rng_state=False)
    assert (get_peft_model_state_dict(pm, state_dict=sd) == {}) == (res[0]["adapter"] == {})  # PEFT's, either way


def _check_full_model_save(tmp_path, res):
    """save_model's folder, reloaded with from_pretrained (compressed-tensors), holds the trained model: every tensor
    of the state dict the Trainer gathered (fp8 bytes, scales, trained embeddings, norms, lm_head) and its logits."""
    from tests.distributed import _dist_common as C

    assert {"model.safetensors", "config.json"} <= set(res[0]["checkpoint_files"])  # the checkpoint was written too
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    assert not torch.equal(full["lm_head.weight"], C.build_fp8_base(0).lm_head.weight)  # trained
    loaded = C.transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    w = loaded.model.layers[0].self_attn.q_proj.weight
    assert w.dtype == torch.float8_e4m3fn  # loaded as fp8, not dequantized
    # compressed-tensors' names: '<layer>.weight_scale' [1] for dorafp8's '<layer>.scale' []
    got = {k.replace(".weight_scale", ".scale"): v.reshape(full[k.replace(".weight_scale", ".scale")].shape)
           if k.endswith(".weight_scale") else v for k, v in loaded.state_dict().items()}
    assert got.keys() >= full.keys()
    for k, v in full.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k].float(), v.float()), k
    trained = C.build_fp8_base(0)
    trained.load_state_dict(full)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=C.probe_ids()).logits, trained(input_ids=C.probe_ids()).logits)


def test_trainer_fsdp2_full_state_dict_saves_a_quantized_model_without_peft(tmp_path):
    """A quantized model trained without PEFT: under FULL_STATE_DICT the Trainer's checkpoint and save_model call
    save_pretrained(state_dict=<the full state dict gathered from the shards>), which dorafp8's save_pretrained
    refused ('Call save_pretrained without state_dict', which the Trainer does not offer) at the first checkpoint,
    killing the run. It now writes that state dict's fp8 layers as compressed-tensors."""
    _check_full_model_save(tmp_path, _launch("trainer_fsdp2_full_model", tmp_path))


def test_trainer_zero3_saves_a_quantized_model_without_peft(tmp_path):
    """The same under ZeRO-3 (TrainingArguments(deepspeed=...), stage3_gather_16bit_weights_on_model_save): the
    Trainer's save hands save_pretrained the consolidated state dict, which dorafp8 refused the same way."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed: the job trains under ZeRO-3")
    _check_full_model_save(tmp_path, _launch("trainer_zero3_full_model", tmp_path, env={"DS_ACCELERATOR": "cpu"}))
