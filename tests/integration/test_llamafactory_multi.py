"""Issue #50: LLaMA-Factory's own ZeRO-3 and FSDP2 config files, as a user runs them through `dorafp8 run --quantize`,
with 2 CPU processes over gloo (tests/integration/llamafactory_configs/: the files of its v0.9.5 release, unchanged):

- ZeRO-3: `FORCE_TORCHRUN=1 dorafp8 run --quantize -- llamafactory-cli train cfg.yaml`, `deepspeed:` its
  `ds_z3_config.json` in cfg.yaml (NPROC_PER_NODE=2: LLaMA-Factory counts no GPU here);
- FSDP2: `dorafp8 run --quantize -- accelerate launch --config_file fsdp2_config.yaml --mixed_precision no -m
  llamafactory.launcher cfg.yaml` (its `fsdp2_config.yaml`, `cpu_ram_efficient_loading: true` included; `-m
  llamafactory.launcher` is what a pip install has for the repository's `src/train.py`; `--mixed_precision no` overrides
  the file's bf16 for an fp32 comparison).

Each trains the tiny checkpoint of test_trainers.py for STEPS steps, 2 sequences per process, and must log the losses
of the same config in one process (4 sequences, no engine, also under the launcher) within 1e-5 (fp32), and save an
adapter with the same tensors (1e-5) that plain PEFT loads onto the dequantized base (test_trainers._compare). Plain
SGD: Adam's first steps move an adapter element by about the learning rate whatever its gradient's size, so rounding
noise in a near-zero gradient would show in the adapter (4e-4 of its largest element after 3 steps), not in the loss.

What makes 2 CPU processes stand in for 2 GPUs, in a sitecustomize this test writes on PYTHONPATH, so that it runs in
every worker LLaMA-Factory's launch starts (tests/distributed/_cpu_stand_ins.py; nothing else of the trainers changes):
- gloo has no fp8 types: fp8 collectives go as uint8 views of their bytes, which is what NCCL moves
  (emulate_nccl_fp8_transport). Without it ZeRO-3 fails in PEFT's DoRA init ("Invalid scalar type").
- FSDP2 only: accelerate selects FSDP on GPUs only (allow_fsdp_on_cpu). accelerate takes DeepSpeed on CPU as it is,
  with DS_ACCELERATOR=cpu.
- record_engine only observes: what the engine made of the fp8 weights (a DDP run would log the same losses).
Runs in CI's LLaMA-Factory leg (.ci/llamafactory.sh); skips where llamafactory (or, for ZeRO-3, deepspeed) is not
installed.
"""

import json
import os
import shutil
import socket
import sys
from pathlib import Path

import pytest
import torch

from tests._tolerance import assert_close, tol
from tests.integration.doc_fixtures import write_sft_data
from tests.integration.test_trainers import BIN, N_LINEAR, REPO, _compare, _lf_config, _run, checkpoints  # noqa: F401

pytest.importorskip("llamafactory", reason="llamafactory is not installed in this venv: its pins clash with the test "
                                           "extra's; CI runs this file in a venv of its own (.ci/llamafactory.sh)")

CONFIGS = Path(__file__).parent / "llamafactory_configs"
SGD = "optim: sgd\nlearning_rate: 0.5\n"
_SITE = """# Written by tests/integration/test_llamafactory_multi.py: CPU stand-ins for GPUs in LLaMA-Factory's workers.
import os
if os.environ.get("LOCAL_RANK") is not None:
    from tests.distributed import _cpu_stand_ins as s
    s.emulate_nccl_fp8_transport()
    if {engine!r} == "fsdp2":
        s.allow_fsdp_on_cpu()
    s.record_engine({engine!r}, {out!r})
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def reference(checkpoints, tmp_path_factory):  # noqa: F811
    """The same training config in one process on the full batch, under the launcher."""
    d = tmp_path_factory.mktemp("lf_ref")
    write_sft_data(d / "data", alpaca=True)
    (d / "ref.yaml").write_text(_lf_config(checkpoints / "model", d / "ref", d / "data", 4, SGD))
    _run([sys.executable, "-m", "dorafp8", "run", "--quantize", "--", os.path.join(BIN, "llamafactory-cli"),
          "train", "ref.yaml"], d)
    return d / "ref"


def _two_processes(engine, command, more, checkpoints, reference, tmp_path, **launch_env):  # noqa: F811
    write_sft_data(tmp_path / "data", alpaca=True)
    (tmp_path / "cfg.yaml").write_text(_lf_config(checkpoints / "model", tmp_path / "out", tmp_path / "data", 2,
                                                  more + SGD))
    (tmp_path / "site").mkdir()
    (tmp_path / "seen").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(_SITE.format(engine=engine, out=str(tmp_path / "seen")))
    env = {"PATH": os.pathsep.join([BIN, os.environ["PATH"]]),  # as in an activated venv: LLaMA-Factory runs torchrun
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), REPO, os.environ.get("PYTHONPATH", "")]),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "DS_ACCELERATOR": "cpu",
           "TMPDIR": str(tmp_path),  # torchrun leaves a torchelastic_* folder in the temp folder
           **launch_env}
    if os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    log = _run([sys.executable, "-m", "dorafp8", "run", "--quantize", "--"] + command, tmp_path, **env)
    seen = [[json.loads(line) for line in (tmp_path / "seen" / f"rank{r}.json").read_text().splitlines()]
            for r in (0, 1)]
    shutil.copytree(checkpoints / "deq", tmp_path / "deq")  # the dequantized base, for plain PEFT
    _compare(tmp_path, tmp_path / "out", reference, log)  # losses, the launcher's report, plain PEFT's reload
    from safetensors.torch import load_file

    got, want = (load_file(d / "adapter_model.safetensors") for d in (tmp_path / "out", reference))
    assert got.keys() == want.keys() and len(got) == 3 * N_LINEAR
    for k in got:
        assert_close(got[k], want[k], tol(torch.float32), k)
    return seen, log


def test_llamafactorys_zero3_config_through_the_launcher(checkpoints, reference, tmp_path):  # noqa: F811
    pytest.importorskip("deepspeed", reason="deepspeed is not installed in this venv (.ci/llamafactory.sh installs it)")
    seen, log = _two_processes(
        "deepspeed", [os.path.join(BIN, "llamafactory-cli"), "train", "cfg.yaml"],
        f"deepspeed: {CONFIGS / 'ds_z3_config.json'}\n", checkpoints, reference, tmp_path, FORCE_TORCHRUN="1",
        NPROC_PER_NODE="2")
    assert "Detected DeepSpeed ZeRO-3: activating zero.init()" in log  # loaded partitioned, then quantized
    # each rank holds half of a 64x64 fp8 weight, as fp8
    assert seen == [[{"engine": "deepspeed zero3", "type": "Parameter", "dtype": "torch.float8_e4m3fn",
                      "local_numel": 2048, "numel": 4096}]] * 2


def test_llamafactorys_fsdp2_config_through_the_launcher(checkpoints, reference, tmp_path):  # noqa: F811
    seen, log = _two_processes(
        "fsdp2", [os.path.join(BIN, "accelerate"), "launch", "--config_file", str(CONFIGS / "fsdp2_config.yaml"),
                  "--mixed_precision", "no", "--main_process_port", str(_free_port()), "-m", "llamafactory.launcher",
                  "cfg.yaml"],
        "", checkpoints, reference, tmp_path)
    # sharded along dim 0 as fp8: half of a 64x64 weight on each rank
    assert seen == [[{"engine": "fsdp2", "type": "DTensor", "dtype": "torch.float8_e4m3fn", "local_numel": 2048,
                      "numel": 4096}]] * 2
