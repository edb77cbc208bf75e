"""Issue #13: DDP, FSDP2, accelerate and the HF Trainer on an fp8 base, with 2 CPU processes over gloo.

Each engine runs one 2-process job (tests/distributed/_dist_worker.py under torch.distributed.run, 127.0.0.1, a free
port, a time limit): 3 SGD steps of the tiny LLaMA-style DoRA model of tests/distributed/_dist_common.py, each rank on
half of each global batch. The losses, the adapter weights and the saved adapter must equal the single-process run on
the full batch (fp32, relative 1e-5), and the saved adapter must load with plain PEFT onto the plain (dequantized) base.
The first tests are single-process checks of the pieces (no spawn).
"""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from peft import PeftModel  # noqa: E402

from tests.distributed import _dist_common as C  # noqa: E402
import dorafp8  # noqa: E402
from tests._tolerance import assert_close, tol  # noqa: E402
from dorafp8.distributed import install_ddp_support, params_are_sharded, recover_fp8_weight  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
JOB_TIMEOUT_S = 300  # one 2-process job takes 15-30 s on 2 cores
REL = 5e-6  # fp32, for tests._tolerance.assert_close: at most 1e-5 of the output's scale
PEFT_FILES = {"adapter_config.json", "adapter_model.safetensors", "README.md"}


# ---- single-process checks ---------------------------------------------------------------------------------------


def test_ddp_support_is_installed_on_import_and_idempotent():
    import torch.nn.parallel.distributed as ddp_module

    from dorafp8.distributed import uninstall_ddp_support

    ddp = ddp_module.DistributedDataParallel
    wrapped, per_forward = ddp_module._sync_module_states, ddp._distributed_broadcast_coalesced
    assert hasattr(wrapped, "_dorafp8_orig"), "import dorafp8 must install the DDP support"
    assert hasattr(per_forward, "_dorafp8_orig")  # the buffers' broadcast before each forward
    assert install_ddp_support() and ddp_module._sync_module_states is wrapped  # idempotent
    assert ddp._distributed_broadcast_coalesced is per_forward
    uninstall_ddp_support()
    try:
        assert ddp_module._sync_module_states is wrapped._dorafp8_orig
        assert ddp._distributed_broadcast_coalesced is per_forward._dorafp8_orig
        import torch.distributed.utils as dist_utils

        assert dist_utils._sync_module_states is wrapped._dorafp8_orig  # torch's own function is never replaced
    finally:
        install_ddp_support()
    assert hasattr(ddp_module._sync_module_states, "_dorafp8_orig")


def test_a_torch_without_the_per_forward_broadcast_keeps_the_initial_sync_wrapped(monkeypatch):
    """A torch whose DDP lacks _distributed_broadcast_coalesced (a private method) still gets the wrap of
    _sync_module_states, which DDP runs first and which alone makes DDP over gloo start on fp8 weights; the
    warning names what is missing."""
    import torch.nn.parallel.distributed as ddp_module

    from dorafp8.distributed import uninstall_ddp_support

    uninstall_ddp_support()
    try:
        monkeypatch.delattr(ddp_module.DistributedDataParallel, "_distributed_broadcast_coalesced")
        with pytest.warns(UserWarning, match="_distributed_broadcast_coalesced") as record:
            assert install_ddp_support() is False
        assert "_sync_module_states" not in str(record[0].message)
        assert hasattr(ddp_module._sync_module_states, "_dorafp8_orig")
    finally:
        uninstall_ddp_support()
        monkeypatch.undo()
        install_ddp_support()
    assert hasattr(ddp_module.DistributedDataParallel._distributed_broadcast_coalesced, "_dorafp8_orig")


def test_a_deepspeed_without_the_broadcast_it_wraps_warns_on_import(monkeypatch):
    """A DeepSpeed whose engine lacks _broadcast_model (renamed upstream) left install_deepspeed_support returning
    False, silently: ranks would again pair rank 0's fp8 weights with their own scales. The import hook now warns,
    naming the method and the consequence; the import itself goes on."""
    import types

    from dorafp8 import _install
    from dorafp8.distributed import DEEPSPEED_ENGINE_MODULE

    engine = types.ModuleType(DEEPSPEED_ENGINE_MODULE)
    engine.DeepSpeedEngine = type("DeepSpeedEngine", (), {})
    monkeypatch.setitem(sys.modules, DEEPSPEED_ENGINE_MODULE, engine)
    with pytest.warns(RuntimeWarning, match=r"_broadcast_model.*without their scales"):
        _install._run(DEEPSPEED_ENGINE_MODULE)


def test_fsdp_support_is_installed_when_fsdp2_is_imported_and_idempotent():
    """`import dorafp8` does not import FSDP2 (a second or more); it wraps FSDPParam.init_dtype_attrs when FSDP2 is
    imported (dorafp8/_install.py). The wrapper leaves the fp8 weight of a dorafp8 layer without a param_dtype, and
    every other parameter as FSDP2 sets it."""
    import torch.distributed.fsdp
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from dorafp8 import install_fsdp_support
    from dorafp8.distributed import FSDP_PARAM_MODULE, uninstall_fsdp_support

    cls = sys.modules[FSDP_PARAM_MODULE].FSDPParam
    wrapped = cls.init_dtype_attrs
    assert hasattr(wrapped, "_dorafp8_orig"), "importing FSDP2 after dorafp8 must install the FSDP support"
    assert install_fsdp_support() and cls.init_dtype_attrs is wrapped  # idempotent
    uninstall_fsdp_support()
    try:
        assert cls.init_dtype_attrs is wrapped._dorafp8_orig
    finally:
        install_fsdp_support()
    assert cls.init_dtype_attrs._dorafp8_orig is wrapped._dorafp8_orig

    _, layer = _one_layer_model()
    base = layer.get_base_layer()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    class Info:  # FSDP2's ParamModuleInfo: the module that holds the parameter, and its name there
        def __init__(self, module, name):
            self.module, self.param_name = module, name

    for module, name, want in ((base, "weight", None), (layer.lora_A["default"], "weight", torch.bfloat16)):
        p = cls.__new__(cls)  # only what init_dtype_attrs reads
        p.sharded_param, p._module_info = getattr(module, name), Info(module, name)
        p._has_sharded_grad_dtype_override = False
        cls.init_dtype_attrs(p, mp)
        assert p.param_dtype == want and p.orig_dtype == getattr(module, name).dtype


def _one_layer_model():
    pm = C.build_model(0)
    pm.train()
    return pm, pm.base_model.model.model.layers[0].self_attn.q_proj


def test_norm_cache_not_stale_when_fsdp_refills_params_in_place():
    """FSDP2 refills the same unsharded parameter in place on each all-gather, under
    torch.autograd._unsafe_preserve_version_counter, and its storage may come back at the same address: the cache key
    (version, data_ptr) then cannot see the new values. Emulated here exactly so (same tensor, same version, same
    address, new values): a layer that fully_shard manages (`_is_fsdp_managed_module`) must not serve the old norm,
    and keeps none. An unmanaged layer on the CPU is not fooled either: it compares the values
    (tests/nn/test_norm_cache.py covers the key-only GPU path, where FSDP's refill would fool the key)."""
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    for managed in (False, True):
        _, layer = _one_layer_model()
        if managed:
            layer._is_fsdp_managed_module = True  # what fully_shard sets on every module it manages
        assert params_are_sharded(layer) == managed
        B = layer.lora_B["default"].weight
        base = layer.get_base_layer()
        layer(x)
        n_old = layer.dora_weight_norm("default")
        ptr, ver = B.data_ptr(), B._version
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(B):
            B.mul_(3.0)  # an optimizer step seen through FSDP's refill
        assert (B.data_ptr(), B._version) == (ptr, ver)
        fresh = dorafp8.weight_norm(base.weight, base.scale, layer.lora_A["default"].weight, B,
                                    layer.scaling["default"], backend=base.backend)
        got = layer.dora_weight_norm("default")
        assert_close(got, fresh, 0.0, "norm after an in-place refill")
        assert not torch.allclose(fresh, n_old)
        assert (len(layer._dorafp8_norm_cache) == 0) == managed  # nothing kept for a sharded layer


def test_recover_fp8_weight_is_exact_and_only_under_fsdp():
    every = torch.arange(256, dtype=torch.int64).to(torch.uint8).view(torch.float8_e4m3fn)
    finite = ~torch.isnan(every.float())
    _, layer = _one_layer_model()
    base = layer.get_base_layer()
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        wide = every.to(dt)
        assert recover_fp8_weight(base, wide) is wide  # not FSDP-managed: left alone (the ops then reject it)
    base._is_fsdp_managed_module = True
    dorafp8.distributed._WARNED_RECAST = False
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        with pytest.warns(UserWarning, match="MixedPrecisionPolicy") if dt == torch.bfloat16 else _no_warning():
            back = recover_fp8_weight(base, every.to(dt))
        assert back.dtype == torch.float8_e4m3fn
        assert torch.equal(back.view(torch.uint8)[finite], every.view(torch.uint8)[finite]), dt


class _no_warning:
    def __enter__(self):
        import warnings

        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


_FSDP1_JOB = """
import os, sys, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
import dorafp8
from dorafp8.distributed import uninstall_fsdp1_refusal
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from dorafp8.quant import quantize_nvfp4
from tests.distributed import _dist_common as C


def nvfp4_only():  # a packed uint8 weight: no fp8 parameter at all
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64)
    w8, scale, g = quantize_nvfp4(lin.weight.detach())
    return torch.nn.Sequential(dorafp8.FP8Linear.from_fp8(w8, scale, lin.bias.detach(), backend="reference",
                                                          global_scale=g), torch.nn.Linear(64, 8))


for refusal in (True, False):
    if not refusal:
        uninstall_fsdp1_refusal()
    for build in (lambda: C.build_model(0), nvfp4_only):
        try:
            FSDP(build(), device_id=torch.device("cpu"))
            print("wrapped")
        except Exception as e:
            print(type(e).__name__, "::", e)
dist.destroy_process_group()
"""


def test_fsdp1_is_refused_at_wrap_time_naming_fsdp2():
    """FSDP1 (FullyShardedDataParallel; accelerate's FSDP plugin at version 1, older HF Trainers' fsdp="full_shard")
    failed inside its flattening with 'Must flatten tensors with uniform dtype'. It is now refused when it wraps,
    with an error naming FSDP2 and how accelerate and the Trainer select it (issue 41, item 5). One process, gloo."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _FSDP1_JOB, str(_free_port())], capture_output=True, text=True,
                       env=env, cwd=REPO, timeout=JOB_TIMEOUT_S)
    assert r.returncode == 0, r.stderr[-4000:]
    refused, refused_nvfp4, without, without_nvfp4 = [line for line in r.stdout.splitlines()
                                                      if "::" in line or line == "wrapped"]
    assert refused.startswith("TypeError :: FullyShardedDataParallel (FSDP1) cannot wrap a module with 14 fp8")
    # an NVFP4 layer's packed uint8 weight is no fp8 tensor, and was let through to FSDP1's own error
    assert refused_nvfp4.startswith("TypeError :: FullyShardedDataParallel (FSDP1) cannot wrap a module with 1 ")
    for fix in ("fully_shard", "`fsdp_version: 2`", "FSDP_VERSION=2", 'fsdp_config={"version": 2}'):
        assert fix in refused and fix in refused_nvfp4
    assert "Must flatten tensors with uniform dtype" in without  # what FSDP1 itself says, later
    assert "Cannot flatten integer dtype tensors" in without_nvfp4


_SIZE_WRAP_JOB = """
import os, sys, types, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
import dorafp8
from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy, get_module_children_bottom_up
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy
from tests.distributed import _dist_common as C
model = C.build_model(0)
# accelerate's FSDP2 preparation with `fsdp_auto_wrap_policy: SIZE_BASED_WRAP`, `fsdp_min_num_params: 1000`, but
# for containers (this torch's fully_shard refuses a ModuleList, which accelerate 1.15 would pick too)
plugin = types.SimpleNamespace(auto_wrap_policy=size_based_auto_wrap_policy, min_num_params=1000)
policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
for module in get_module_children_bottom_up(model)[:-1]:
    if policy(module) and not isinstance(module, (FSDPModule, torch.nn.ModuleList)):
        fully_shard(module)
fully_shard(model)
ids = C.local_rows(C.data()[0], 0)
try:
    model(input_ids=ids, labels=ids).loss.backward()
    print("trained")
except Exception as e:
    print(type(e).__name__, "::", e)
dist.destroy_process_group()
"""


def test_fsdp2_base_layer_sharded_on_its_own_is_refused_naming_the_fix():
    """accelerate's FSDP2 `SIZE_BASED_WRAP` wraps modules bottom-up, so with `fsdp_min_num_params` below a layer's
    weight count it makes the FP8Linear *base* of a DoRAFP8Linear a shard unit of its own. The fused forward reads that
    weight without calling the base layer, so FSDP2 never gathers it: torch stopped with 'dorafp8.weight_norm.default
    got mixed torch.Tensor and DTensor'. Now the forward refuses, naming the layer and the wrap policies that work.
    One process, gloo (a group of one shards too)."""
    pytest.importorskip("accelerate")
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _SIZE_WRAP_JOB, str(_free_port())], capture_output=True, text=True,
                       env=env, cwd=REPO, timeout=JOB_TIMEOUT_S)
    assert r.returncode == 0, r.stderr[-4000:]
    line = next(x for x in r.stdout.splitlines() if "::" in x or x == "trained")
    assert line.startswith("RuntimeError :: dorafp8: the fp8 weight of the FP8Linear under this "), line
    for fix in ("SIZE_BASED_WRAP", "fsdp_min_num_params", "TRANSFORMER_BASED_WRAP", "fully_shard"):
        assert fix in line


# ---- 2-process jobs ----------------------------------------------------------------------------------------------


_RANK_JOB = """
import os, sys
rank, port, off = int(sys.argv[1]), sys.argv[2], sys.argv[3].split(",")
install, nccl = (a == "1" for a in sys.argv[4:])
if str(rank) in off:
    os.environ["DORAFP8_NO_PATCHES"] = "1"
import torch, torch.distributed as dist
import dorafp8
if nccl:  # DDP's sync as NCCL runs it: fp8 goes as its bytes (ncclFloat8e4m3), where gloo refuses the dtype
    send = dist._broadcast_coalesced
    dist._broadcast_coalesced = lambda pg, ts, *a: send(pg, [t.view(torch.uint8) if t.dtype in (
        torch.float8_e4m3fn, torch.float8_e5m2) else t for t in ts], *a)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=2)
if install:
    dorafp8.install_ddp_support()
torch.manual_seed(rank)  # the ranks' weights differ until DDP sends rank 0's
m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
dorafp8.quantize_model(m, ["1"], backend="reference", verbose=False)  # fp32 first, as a model's embedding
w = m[1].weight
try:
    torch.nn.parallel.DistributedDataParallel(m)
    w8 = w.view(torch.uint8).clone()
    dist.broadcast(w8, 0)
    print("rank", rank, "synced" if torch.equal(w8, w.view(torch.uint8)) else "differs", flush=True)
except Exception as e:
    print("rank", rank, "::", e, flush=True)
    os._exit(1)
dist.barrier()
os._exit(0)
"""


def _two_ranks(off: str, install: bool, nccl: bool = False) -> list:
    """Runs _RANK_JOB on 2 gloo ranks, DORAFP8_NO_PATCHES=1 on the ranks in `off`; returns each rank's last line
    ("rank R synced" or "rank R :: error"), or the end of its output where it printed none (a gloo abort)."""
    env = {k: v for k, v in os.environ.items() if k != "DORAFP8_NO_PATCHES"}
    env.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [REPO, os.environ.get("PYTHONPATH", "")]), **({"GLOO_SOCKET_IFNAME": "lo"} if os.path.exists(
            "/sys/class/net/lo") else {}))
    port = str(_free_port())
    args = [port, off, str(int(install)), str(int(nccl))]
    procs = [subprocess.Popen([sys.executable, "-c", _RANK_JOB, str(r), *args], env=env, cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
             for r in range(2)]
    lines = []
    for p in procs:
        try:
            out = p.communicate(timeout=JOB_TIMEOUT_S)[0]
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # this rank's own group, which this test started
            out = p.communicate()[0] + "\nrank ? :: timeout"
        lines.append([x for x in out.splitlines() if x.startswith("rank ")][-1:] or [out[-2000:]])
    return [x[0] for x in lines]


def test_ddp_with_no_patches_on_one_rank_fails_there_and_works_with_the_support_installed_on_every_rank():
    """DORAFP8_NO_PATCHES=1 on one rank only: that rank's DDP is torch's own, whose broadcast of the fp8 weight stops
    over gloo ("Invalid scalar type") while its peer, which sends those bytes first, waits or loses the connection.
    With fp8 sent as NCCL sends it, the two ranks' broadcasts differ in size (NCCL would not say so). A rank that runs
    no dorafp8 code in DDP cannot join a check of the settings, so docs/MULTI_GPU.md and README say to set the
    variable on every rank or none; with it set everywhere, install_ddp_support() on every rank works."""
    one = _two_ranks("1", install=False)
    assert one[1] == "rank 1 :: Invalid scalar type", one
    assert not one[0].endswith("synced"), one
    nccl = _two_ranks("1", install=False, nccl=True)
    assert "Received data size doesn't match expected size" in "".join(nccl), nccl
    assert _two_ranks("", install=False, nccl=True) == ["rank 0 synced", "rank 1 synced"]  # the same, on both ranks
    assert _two_ranks("0,1", install=True) == ["rank 0 synced", "rank 1 synced"]




def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(engine: str, out, *, quantize_on_load: bool = False, env: dict | None = None) -> list:
    """Runs the 2-process job for `engine`; returns the two ranks' results. quantize_on_load: under `dorafp8 run
    --quantize --`, as a user runs a trainer (the workers' from_pretrained quantizes); env: more variables."""
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([REPO, HERE, os.environ.get("PYTHONPATH", "")]),
               TMPDIR=str(out), **(env or {}))  # torchrun leaves a torchelastic_* folder in the temp folder
    if os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    launcher = ["-m", "dorafp8", "run", "--quantize", "--"] if quantize_on_load else []
    if quantize_on_load:
        env["DORAFP8_BACKEND"] = "reference"  # what the single-process reference (C.build_model) runs
    cmd = [sys.executable, *launcher, "-m", "torch.distributed.run", "--nproc_per_node", str(C.WORLD), "--nnodes",
           "1", "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
           os.path.join(HERE, "_dist_worker.py"), engine, str(out)]
    log_path = os.path.join(out, "log.txt")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its two workers: the group this test started
            proc.wait()
            rc = "timeout"
    if rc != 0:
        with open(log_path) as f:
            tail = f.read()[-6000:]
        pytest.fail(f"{engine} job failed (rc={rc}):\n{tail}")
    with open(log_path) as f:
        log_text = f.read()
    for r in range(C.WORLD):  # each rank got through its final barrier and destroy_process_group
        assert f"rank {r}: done" in log_text, f"{engine}: rank {r} did not finish cleanly:\n{log_text[-6000:]}"
    res = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(C.WORLD)]
    for r in res:  # the children ran this checkout's dorafp8
        assert os.path.dirname(os.path.abspath(r["dorafp8_file"])) == os.path.join(REPO, "dorafp8")
    return res


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("single_process") / "adapter"
    losses, state, logits = C.train_single_process(d)
    return {"losses": losses, "adapter": state, "logits": logits, "dir": str(d)}


def _check_training(res, ref, ranks_with_adapter=(0, 1)):
    for r in res:
        assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), REL, f"rank {r['rank']} losses")
    for rank in ranks_with_adapter:
        got = res[rank]["adapter"]
        assert got.keys() == ref["adapter"].keys() and len(got) == 42
        for k in got:
            assert got[k].dtype == ref["adapter"][k].dtype
            assert_close(got[k], ref["adapter"][k], REL, f"rank {rank} {k}")


def _check_saved_adapter(path, ref, extra_files=()):
    from safetensors.torch import load_file

    assert set(os.listdir(path)) == PEFT_FILES | set(extra_files)
    with open(os.path.join(path, "adapter_config.json")) as f, \
            open(os.path.join(ref["dir"], "adapter_config.json")) as g:
        got_cfg, want_cfg = json.load(f), json.load(g)
    for cfg in (got_cfg, want_cfg):  # PEFT writes this set in the process's (hash-seeded) set order
        cfg["target_modules"] = sorted(cfg["target_modules"])
    assert got_cfg == want_cfg
    got = load_file(os.path.join(path, "adapter_model.safetensors"))
    want = load_file(os.path.join(ref["dir"], "adapter_model.safetensors"))
    assert got.keys() == want.keys() and len(got) == 42
    for k in got:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert_close(got[k], want[k], REL, k)
    # plain PEFT (nn.Linear base holding the dequantized fp8 weights) computes what dorafp8 does with the saved adapter.
    # Against dorafp8 on this same adapter, not the reference's logits: the adapter is the reference's to REL a tensor
    # (above), and the logits sum those differences (ZeRO-3's reduction order put them 1.13x past REL on one CPU).
    loaded = PeftModel.from_pretrained(C.build_plain_base(0), path).eval()
    assert not any(isinstance(m, dorafp8.DoRAFP8Linear) for m in loaded.modules())
    fp8 = PeftModel.from_pretrained(C.build_fp8_base(0), path).eval()
    assert sum(isinstance(m, dorafp8.DoRAFP8Linear) for m in fp8.modules()) == 14
    with torch.no_grad():
        assert_close(loaded(input_ids=C.probe_ids()).logits, fp8(input_ids=C.probe_ids()).logits, REL,
                     "logits of plain PEFT against dorafp8's")


def test_ddp(tmp_path, reference):
    res = _launch("ddp", tmp_path)
    r0, r1 = res
    # the failure of issue #13 without dorafp8's support, so that this job exercises it
    assert all(r["plain_ddp_error"] and "Invalid scalar type" in r["plain_ddp_error"] for r in res)
    # rank 1 loaded other weights; after wrapping, rank 0's fp8 bytes and scales are on both ranks
    assert r0["fingerprints_differ_before"] and r0["fingerprints_equal_after"] and r1["fingerprints_equal_after"]
    assert r0["rank0_fingerprint"] == C_fingerprint_of_seed0()
    for r in res:
        init = [c for phase, c in r["broadcasts"] if phase == "init"]
        train = [c for phase, c in r["broadcasts"] if phase == "train"]
        # at wrap time the 14 fp8 weights went once, as their bytes
        fp8_sent = [t for c in init for t in c if t[0] == "torch.uint8"]
        assert len(fp8_sent) == r["n_fp8_weights"] == 14 and sum(n for _, n in fp8_sent) == r["fp8_weight_bytes"]
        # every forward (broadcast_buffers=True) re-sends buffers only: 14 scalar fp32 scales + 2 rotary tables
        assert len(train) == C.STEPS
        for c in train:
            assert all(dt == "torch.float32" for dt, _ in c) and sum(n for _, n in c) == 14 + 2 * 8
    _check_training(res, reference)
    _check_saved_adapter(tmp_path / "adapter", reference)


def C_fingerprint_of_seed0():
    return C.fp8_fingerprint(C.build_model(0))


def test_ddp_on_mxfp8_and_nvfp4_layers(tmp_path):
    """MXFP8 and NVFP4 layers keep their block scales as fp8 buffers (e8m0, e4m3), NVFP4 its weight as packed uint8
    with an fp32 global scale. DDP broadcasts buffers again before every forward (broadcast_buffers=True, its default),
    and the first forward stopped with 'Invalid scalar type' (gloo has no fp8 types) once the wrap had got through.
    With broadcast_buffers=False the wrap sent an MXFP8 layer's e8m0 scales as they were ('Invalid scalar type'), and
    an NVFP4 layer's packed weight without its scales: rank 1 computed with rank 0's weight and its own scales. Now
    every broadcast sends fp8 as bytes and a layer's scales go with its weight: the losses and adapters equal one
    process's, the frozen tensors are rank 0's after the wrap (rank 1 built others), and with broadcast_buffers rank
    1's scales, zeroed after the wrap, are rank 0's again after a forward."""
    res = _launch("ddp_microscaled", tmp_path)
    losses, adapter = C.train_microscaled_single_process()
    for r in res:
        for run in ("broadcast_buffers=True", "broadcast_buffers=False"):
            got, what = r[run], f"rank {r['rank']} {run}"
            assert got["n_fp8_scales"] == 4 and got["scale_dtypes"] == ["torch.float8_e4m3fn", "torch.float8_e8m0fnu"]
            assert got["frozen_equal_after_wrap"], what
            assert got["scales_back"], f"{what}: the scales are not rank 0's after a forward"
            assert_close(torch.tensor(got["losses"]), torch.tensor(losses), REL, f"{what} losses")
            assert got["adapter"].keys() == adapter.keys() and len(adapter) == 42
            for k in adapter:
                assert_close(got["adapter"][k], adapter[k], REL, f"{what} {k}")


def test_fsdp2(tmp_path, reference):
    res = _launch("fsdp2", tmp_path)
    for r in res:
        # the fp8 weights are sharded DTensors and each rank holds half of their bytes (all row counts are even)
        assert r["fp8_all_dtensor"]
        assert r["fp8_local_bytes"] * C.WORLD == r["fp8_full_bytes"] == 67584
        assert r["fp8_local_storage_bytes"] == r["fp8_local_bytes"]  # the local shard is its own, not a view
        assert r["layers_detected_sharded"]
        # one norm per layer and forward, from the full (all-gathered) fp8 weight: [out, in], not a shard
        assert len(r["norm_calls"]) == 14 * C.STEPS
        full_rows = {64, 32, 112}
        assert all(kind == "Parameter" and shape[0] in full_rows for kind, shape in r["norm_calls"])
    _check_training(res, reference, ranks_with_adapter=(0,))
    _check_saved_adapter(tmp_path / "adapter", reference)


def _source(w) -> str:
    """Where a recorded warning (category, message, file, line) comes from: "dorafp8", "fsdp" (FSDP2) or "other"."""
    _, msg, filename, _ = w
    path = os.path.abspath(filename).replace(os.sep, "/")
    if path.startswith(os.path.join(REPO, "dorafp8").replace(os.sep, "/") + "/") or msg.startswith("dorafp8"):
        return "dorafp8"
    if "/torch/distributed/fsdp/" in path or "/torch/distributed/_composable/" in path or "FSDP" in msg:
        return "fsdp"
    return "other"


def test_fsdp2_mixed_precision_recipe_warns_nothing(tmp_path):
    """docs/MULTI_GPU.md's FSDP2 recipe with MixedPrecisionPolicy(param_dtype=bf16), on the doc's model (DoRA on the
    attention projections, the MLP projections plain FP8Linear layers), 2 processes, gloo: no warning from dorafp8
    (it used to say that the fp8 weights were cast to bf16, raised by the MLP's FP8Linear layers) nor from FSDP2 (it
    used to say that FSDPDoRAFP8Linear 'returned a view tensor', on every forward), from the first fully_shard to the
    saved adapter; every forward reads the fp8 weights as fp8; the losses are the fp32 single-process run's within
    bf16 accuracy. Every group with param_dtype: the same. Without dorafp8's FSDP support, FSDP2 casts the fp8
    weights and the forward casts them back, with the warning, to the same loss."""
    res = _launch("fsdp2_mp", tmp_path)
    ref = C.train_doc_model_single_process()
    fp8_read = {(kind, "torch.float8_e4m3fn", "Parameter") for kind in ("DoRAFP8Linear", "FP8Linear")}
    for r in res:
        assert r["fsdp_support_installed_on_import"]
        for recipe in ("doc_recipe", "bf16_all", "bf16_all_unsupported"):
            rr = r[recipe]
            assert rr["grads_finite"] and rr["still_fp8_sharded"], recipe
            n = len(rr["losses"])
            assert_close(torch.tensor(rr["losses"]), torch.tensor(ref[:n]), tol(torch.bfloat16),
                         f"rank {r['rank']} {recipe} losses")
            flagged = [w for w in rr["warnings"] if _source(w) != "other"]
            if recipe != "bf16_all_unsupported":
                assert flagged == [], f"{recipe}: warnings from dorafp8 or FSDP2: {sorted({w[:2] for w in flagged})}"
                assert set(rr["weight_dtypes"]) == fp8_read, rr["weight_dtypes"]
        # the doc's recipe raises no other warning either (PEFT's FutureWarning comes earlier, from get_peft_model)
        assert r["doc_recipe"]["warnings"] == []
        # the state gathered on rank 0 (cpu_offload: the other ranks get none): the trainable tensors and the 14 fp32
        # scales (buffers), never an fp8 weight
        keys = r["doc_recipe"]["state_keys"]
        assert len(keys) == (8 * 3 + 14 if r["rank"] == 0 else 0)
        assert all("lora_" in k or k.endswith(".scale") for k in keys)
        # without the support: FSDP2 casts the fp8 weights (the forward reads bf16), dorafp8 casts them back exactly
        # (the same loss as with fp8 all-gathers) and says so once
        un = r["bf16_all_unsupported"]
        assert {dt for _, dt, _ in un["weight_dtypes"]} == {"torch.bfloat16"}
        flagged = [w for w in un["warnings"] if _source(w) != "other"]
        assert len(flagged) == 1 and _source(flagged[0]) == "dorafp8" and "MixedPrecisionPolicy" in flagged[0][1]
        assert un["losses"] == r["bf16_all"]["losses"]
    assert set(os.listdir(tmp_path / "adapter")) == PEFT_FILES
    # train.py's own save (the doc launches it under accelerate's FSDP2 too) writes the same adapter from the shards;
    # its old `save_pretrained(...)` without a gathered state dict raised 'Attempted to access the data pointer on an
    # invalid python storage' (PEFT reading DTensor shards, for any model)
    assert [r["train_py_save"] for r in res] == ["saved", "saved"]
    assert set(os.listdir(tmp_path / "train_py_adapter")) == PEFT_FILES
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert len(saved) == 8 * 3 and all(t.dtype == torch.float32 for t in saved.values())  # q, k, v, o: A, B, m
    again = load_file(tmp_path / "train_py_adapter" / "adapter_model.safetensors")
    assert again.keys() == saved.keys() and all(torch.equal(again[k], saved[k]) for k in saved)


def test_accelerate(tmp_path, reference):
    pytest.importorskip("accelerate")
    res = _launch("accelerate", tmp_path)
    for r in res:
        assert r["distributed_type"].endswith("MULTI_CPU") and r["num_processes"] == 2
        assert r["wrapped_in"] == "DistributedDataParallel" and r["fingerprints_equal_after"]
    assert res[0]["rank0_fingerprint"] == C_fingerprint_of_seed0()  # rank 1 had built other weights
    _check_training(res, reference)
    _check_saved_adapter(tmp_path / "adapter", reference)


def test_hf_trainer(tmp_path, reference):
    pytest.importorskip("accelerate")
    res = _launch("trainer", tmp_path)
    for r in res:
        assert r["wrapped_in"] == "DistributedDataParallel" and r["world_size"] == 2
        assert r["forwards"] == C.STEPS  # no gradient checkpointing: one forward of a layer per step
    _check_training(res, reference)
    _check_saved_adapter(tmp_path / "adapter", reference, extra_files=("training_args.bin",))


def test_hf_trainer_reentrant_gradient_checkpointing_with_ddp_find_unused_parameters_false(tmp_path, reference):
    """Issue #50, item 4: reentrant gradient checkpointing (LLaMA-Factory's default) under DDP failed with "Expected
    to mark a variable ready only once", as plain PEFT DoRA does, with the Trainer's find_unused_parameters=True (its
    default for a PeftModel); docs/MULTI_GPU.md gives ddp_find_unused_parameters=False, which this job sets."""
    pytest.importorskip("accelerate")
    res = _launch("trainer_reentrant_gc", tmp_path)
    for r in res:
        assert r["wrapped_in"] == "DistributedDataParallel"
        assert r["forwards"] == 2 * C.STEPS  # checkpointed: each step recomputes the layer's forward
    _check_training(res, reference)
    _check_saved_adapter(tmp_path / "adapter", reference, extra_files=("training_args.bin",))


def test_race_verdicts_are_shared(tmp_path):
    """backend="auto"'s kernel checks under torch.distributed (dorafp8/backends/race.py): two ranks meeting a key at once
    run one child between them and both run its pick, though each rank's own child would pick another; a key only
    one rank meets is resolved by that rank without waiting for the other (no deadlock: the job ends)."""
    r0, r1 = _launch("race", tmp_path)
    assert len(r0["children_after_shared"]) == 1 and r0["children_after_shared"] == r1["children_after_shared"]
    claimer = int(r0["children_after_shared"][0])
    want = ["reference"] if claimer == 0 else ["native"]
    assert r0["shared"] == r1["shared"] == want
    assert r1["own_key"] == ["native"] and r0["own_key"] == ["reference"]


@pytest.mark.parametrize("engine", ["race_ddp", "race_fsdp2"])
def test_a_first_step_under_ddp_and_fsdp2_that_checks_is_the_same_as_without_the_race(tmp_path, engine):
    """backend="auto"'s first-use check under DDP and FSDP2 (issue 47): the first steps with the race on (a child per
    key, in one rank or the other, never both) give the losses and adapter values of DORAFP8_RACE=0 exactly, on
    both ranks, running the same backends."""
    r0, r1 = _launch(engine, tmp_path)
    children = r0["children"]
    assert children == r1["children"] and children  # every key checked, by a child of one rank only
    keys = [line.split(" ", 1)[1] for line in children]
    assert len(keys) == len(set(keys)) and {line.split()[0] for line in children} <= {"0", "1"}
    for r in (r0, r1):
        assert r["1"]["losses"] == r["0"]["losses"] and r["1"]["used"] == r["0"]["used"] == ["native"]
        assert r["1"]["adapter"].keys() == r["0"]["adapter"].keys()
        for name, t in r["1"]["adapter"].items():
            assert torch.equal(t, r["0"]["adapter"][name]), name
    assert r0["1"]["losses"] == r1["1"]["losses"]



def test_lycoris_dora_on_fp8_layers_under_fsdp2(tmp_path):
    """LyCORIS's DoRA on fp8 layers (its fused path, dorafp8/lycoris.py) under FSDP2, with a base layer that is a shard
    unit of its own (refused for PEFT's layers, whose forward reads the base weight without calling the base layer;
    LyCORIS's module replaces the layer's forward, so FSDP2 gathers the weight): the losses and the trained network
    equal an unsharded run on the full batch, and the fp8 weight is sharded as fp8."""
    pytest.importorskip("lycoris", reason="lycoris-lora is not installed (the test extra installs it)")
    res = _launch("lycoris_fsdp2", tmp_path)
    for r in res:
        assert r["fp8_shard"] == ("torch.float8_e4m3fn", 64 * 128 // C.WORLD, 64 * 128)
        assert_close(torch.tensor(r["losses"]), torch.tensor(r["ref_losses"]), REL, f"rank {r['rank']} losses")
    net, ref = res[0]["net"], res[0]["ref_net"]  # gathered to rank 0's CPU
    assert net.keys() == ref.keys() and len(net) == 20  # 5 layers: down, up, dora_scale, alpha
    for k, v in ref.items():
        assert_close(net[k], v, REL, k)
