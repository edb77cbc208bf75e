"""`dorafp8 run`'s from_pretrained hook on a HUB ID (not a local folder): a ModelOpt export there is handed to
load_fp8_checkpoint as a local one is, resolved through huggingface_hub's cache as transformers resolves it. Offline:
every checkpoint here lives in a fake cache in tmp_path, in huggingface_hub's layout (models--org--name/blobs/<etag>,
snapshots/<commit>/<file> linking to it, refs/<branch> holding the commit, .no_exist/<commit>/<file>)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
huggingface_hub = pytest.importorskip("huggingface_hub")

from dorafp8 import FP8Linear, launcher  # noqa: E402
from dorafp8.checkpoint import hub, save_hooks  # noqa: E402
from tests.checkpoint._ckpt_fixtures import LINEARS, _save_dir, original_model, write_modelopt_fp8  # noqa: E402
from tests.integration.test_trainers import TIMEOUT_S, _env  # noqa: E402

MAIN, FP8 = "a" * 40, "b" * 40  # the commits of branch main (a bf16 model) and of branch "fp8" (its ModelOpt export)


def _dense(folder: str) -> None:
    model = original_model()
    _save_dir(dict(model.state_dict()), folder, model.config)


def _cache(cache, repo: str, commit: str, folder: str, branch: str = "main", under: str = "",
           leave_out: tuple = ()) -> None:
    """The files of `folder` as huggingface_hub caches revision `branch` of `repo` (at `under`, a subfolder)."""
    root = os.path.join(cache, "models--" + repo.replace("/", "--"))
    for name in sorted(os.listdir(folder)):
        if name in leave_out:
            continue
        with open(os.path.join(folder, name), "rb") as f:
            data = f.read()
        blob = os.path.join(root, "blobs", hashlib.sha256(data).hexdigest())
        os.makedirs(os.path.dirname(blob), exist_ok=True)
        with open(blob, "wb") as f:
            f.write(data)
        link = os.path.join(root, "snapshots", commit, under, name)
        os.makedirs(os.path.dirname(link), exist_ok=True)
        os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)
    os.makedirs(os.path.join(root, "refs"), exist_ok=True)
    with open(os.path.join(root, "refs", branch), "w") as f:
        f.write(commit)


def _no_exist(cache, repo: str, commit: str, name: str) -> None:
    """What huggingface_hub records of a file the hub said revision `commit` does not have."""
    p = os.path.join(cache, "models--" + repo.replace("/", "--"), ".no_exist", commit, name)
    os.makedirs(os.path.dirname(p), exist_ok=True)
    open(p, "w").close()


def _shard(folder: str) -> None:
    """The folder's model.safetensors split in two shards and an index, as a sharded checkpoint is."""
    from safetensors.torch import load_file, save_file

    single = os.path.join(folder, "model.safetensors")
    tensors = load_file(single)
    os.remove(single)
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, os.path.join(folder, shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


@pytest.fixture
def state(monkeypatch):
    for key in ("models", "quantized"):
        monkeypatch.setitem(launcher._STATE, key, 0)


def _assert_fp8(model, sd: dict) -> None:
    layers = {n: m for n, m in model.named_modules() if n.split(".")[-1] in LINEARS}
    assert len(layers) == 14 and all(isinstance(m, FP8Linear) for m in layers.values())
    for n, m in layers.items():
        assert torch.equal(m.weight.view(torch.uint8), sd[n + ".weight"].view(torch.uint8)), n
        assert torch.equal(m.scale.float().reshape(-1), sd[n + ".weight_scale"].float().reshape(-1)), n


@pytest.mark.parametrize("under", ["", "llm"])
def test_a_modelopt_fp8_export_on_the_hub_is_loaded_with_its_scales(tmp_path, state, under):
    """from_pretrained("org/model-FP8") (a ModelOpt FP8 export, nvidia/Llama-3.1-8B-Instruct-FP8's layout) went from
    the hook to transformers, which loaded its e4m3 codes as the weights without their scales (|w| up to 448), with
    only 'UNEXPECTED weight_scale' notes: the hook handed over local folders only (it looked for <hub id>/config.json
    on disk). Now the hub id is resolved in huggingface_hub's cache, subfolder= too, and handed over."""
    sd = write_modelopt_fp8(str(tmp_path / "export"))
    cache = str(tmp_path / "hub")
    _cache(cache, "org/model-FP8", FP8, str(tmp_path / "export"), under=under)
    kw = {"cache_dir": cache, "local_files_only": True, **({"subfolder": under} if under else {})}
    model = launcher._modelopt_load(transformers.LlamaForCausalLM, ("org/model-FP8",), kw)
    assert model is not None, "the hub id went to transformers"
    _assert_fp8(model, sd)
    # config= a path to one, as transformers takes it (the hook gave the string to _from_config: AttributeError)
    config = os.path.join(hub.modelopt_export("org/model-FP8", kw)[1], "config.json")
    kw["config"] = config
    _assert_fp8(launcher._modelopt_load(transformers.LlamaForCausalLM, ("org/model-FP8",), kw), sd)
    # what from_pretrained's other kwargs set on the config (the hook dropped them: use_cache on, sdpa attention)
    del kw["config"]
    kw.update(use_cache=False, attn_implementation="eager")
    model = launcher._modelopt_load(transformers.LlamaForCausalLM, ("org/model-FP8",), kw)
    assert (model.config.use_cache, model.config._attn_implementation) == (False, "eager")
    assert launcher._STATE["models"] == 3


def test_a_local_export_in_a_subfolder_is_loaded_with_its_scales(tmp_path, state):
    """from_pretrained(folder, subfolder="llm") of a local export: the hook looked in the folder itself (no
    hf_quant_config.json there) and left it to transformers, codes without scales."""
    sd = write_modelopt_fp8(str(tmp_path / "repo" / "llm"))
    model = launcher._modelopt_load(transformers.LlamaForCausalLM, (str(tmp_path / "repo"),), {"subfolder": "llm"})
    assert model is not None, "the hub id went to transformers"
    _assert_fp8(model, sd)
    assert launcher._STATE["models"] == 1


def test_a_sharded_export_cached_without_no_exist_records_loads_offline(tmp_path, state):
    """A sharded export in a cache `hf download` filled (every file, no .no_exist record of the model.safetensors it
    lacks), offline: the hook asked for model.safetensors first and refused, as not cached, what it had whole."""
    sd = write_modelopt_fp8(str(tmp_path / "export"))
    _shard(str(tmp_path / "export"))
    cache = str(tmp_path / "hub")
    _cache(cache, "org/model-FP8", FP8, str(tmp_path / "export"))
    kw = {"cache_dir": cache, "local_files_only": True}
    _assert_fp8(launcher._modelopt_load(transformers.LlamaForCausalLM, ("org/model-FP8",), kw), sd)


def _hooked(monkeypatch):
    """transformers' from_pretrained hooked, as `dorafp8 run` hooks it (undone after the test)."""
    monkeypatch.setattr(save_hooks, "LOAD_HOOKS", {})
    monkeypatch.setitem(launcher._STATE, "options", {})
    launcher._hook_loads(False)


@pytest.mark.parametrize("cls", ["LlamaForCausalLM", "AutoModelForCausalLM"])
@pytest.mark.parametrize("where", ["local", "hub"])
def test_an_adapter_whose_base_is_an_export_is_refused(tmp_path, state, monkeypatch, where, cls):
    """from_pretrained(adapter) (a PEFT adapter: transformers loads its base_model_name_or_path, then the adapter)
    whose base is a ModelOpt export: the hook saw only the adapter's path, no config.json there, and transformers
    loaded the base's codes without their scales. Now refused, naming the two-step load. An Auto class finds the
    adapter itself and gives the hook the base's path (and the adapter in adapter_kwargs): the hook loaded the
    export and returned it without the adapter, silently."""
    write_modelopt_fp8(str(tmp_path / "export"))
    (tmp_path / "adapter").mkdir()
    cache = str(tmp_path / "hub")
    _cache(cache, "org/model-FP8", FP8, str(tmp_path / "export"))
    base = str(tmp_path / "export") if where == "local" else "org/model-FP8"
    with open(tmp_path / "adapter" / "adapter_config.json", "w") as f:
        json.dump({"peft_type": "LORA", "base_model_name_or_path": base, "r": 4, "use_dora": True}, f)
    _cache(cache, "org/adapter", MAIN, str(tmp_path / "adapter"))
    path = str(tmp_path / "adapter") if where == "local" else "org/adapter"
    _hooked(monkeypatch)
    with pytest.raises(ValueError, match=r"is a PEFT adapter whose base model .* is a ModelOpt export.*"
                                         r"PeftModel\.from_pretrained"):
        # (an Auto class looks for the adapter in adapter_kwargs' cache_dir only)
        getattr(transformers, cls).from_pretrained(path, cache_dir=cache, local_files_only=True,
                                                   adapter_kwargs={"cache_dir": cache})


def test_a_revision_is_resolved_as_transformers_resolves_it(tmp_path, state):
    """revision="fp8" (a branch holding the export; main holds the bf16 model) is that branch's snapshot: handed
    over; main's (a dense model) goes to transformers, untouched."""
    sd = write_modelopt_fp8(str(tmp_path / "export"))
    _dense(str(tmp_path / "dense"))
    cache = str(tmp_path / "hub")
    _cache(cache, "org/model", MAIN, str(tmp_path / "dense"), branch="main")
    _cache(cache, "org/model", FP8, str(tmp_path / "export"), branch="fp8")
    _no_exist(cache, "org/model", MAIN, "hf_quant_config.json")
    kw = {"cache_dir": cache, "local_files_only": True}
    assert launcher._modelopt_load(transformers.LlamaForCausalLM, ("org/model",), kw) is None
    assert hub.modelopt_export("org/model", {**kw, "revision": "fp8"})[1].endswith(os.path.join("snapshots", FP8))
    _assert_fp8(launcher._modelopt_load(transformers.LlamaForCausalLM, ("org/model",), {**kw, "revision": "fp8"}), sd)
    assert launcher._STATE["models"] == 1


def test_an_export_whose_quant_config_cannot_be_fetched_is_refused(tmp_path, state):
    """Offline (local_files_only / HF_HUB_OFFLINE) with an export's config.json and weights in the cache but not its
    hf_quant_config.json (transformers, which cached them, never asks for it): it went to transformers, codes without
    scales. Now refused, naming the file and how to fetch it. A dense model cached the same way (no hf_quant_config.json
    known either way) still goes to transformers."""
    write_modelopt_fp8(str(tmp_path / "export"))
    _dense(str(tmp_path / "dense"))
    cache = str(tmp_path / "hub")
    _cache(cache, "org/model-FP8", FP8, str(tmp_path / "export"), leave_out=("hf_quant_config.json",))
    _cache(cache, "org/dense", MAIN, str(tmp_path / "dense"))
    kw = {"cache_dir": cache, "local_files_only": True}
    write_modelopt_fp8(str(tmp_path / "sharded"))
    _shard(str(tmp_path / "sharded"))
    _cache(cache, "org/sharded-FP8", FP8, str(tmp_path / "sharded"), leave_out=("hf_quant_config.json",))
    for repo in ("org/model-FP8", "org/sharded-FP8"):
        with pytest.raises(OSError, match=r"hf_quant_config\.json.*not in the Hugging Face cache.*hf download "
                                          rf"{repo} hf_quant_config\.json --revision main"):
            launcher._modelopt_load(transformers.LlamaForCausalLM, (repo,), kw)
    # in a subfolder: the command names the file there (it named the repo's top-level one, which it lacks)
    _cache(cache, "org/sub-FP8", FP8, str(tmp_path / "export"), under="llm", leave_out=("hf_quant_config.json",))
    with pytest.raises(OSError, match=r"subfolder='llm'.*hf download org/sub-FP8 llm/hf_quant_config\.json "):
        launcher._modelopt_load(transformers.LlamaForCausalLM, ("org/sub-FP8",), {**kw, "subfolder": "llm"})
    assert launcher._modelopt_load(transformers.LlamaForCausalLM, ("org/dense",), kw) is None
    # a dense model whose float weights have a `weight_scale` of their own (no codes): transformers', as before
    model = original_model()
    sd = dict(model.state_dict())
    sd["model.layers.0.mlp.up_proj.weight_scale"] = torch.ones(())
    _save_dir(sd, str(tmp_path / "scaled"), model.config)
    _cache(cache, "org/scaled", MAIN, str(tmp_path / "scaled"))
    assert launcher._modelopt_load(transformers.LlamaForCausalLM, ("org/scaled",), kw) is None
    # not in the cache at all: transformers fails on it itself, saying so
    assert launcher._modelopt_load(transformers.LlamaForCausalLM, ("org/absent",), kw) is None
    assert launcher._STATE["models"] == 0


@pytest.mark.parametrize("text", ["", "{\"quantization\": {\"quant_algo\": \"FP8\"", "[]"])
def test_an_unreadable_quant_config_in_the_cache_is_refused(tmp_path, state, text):
    """An export whose cached hf_quant_config.json is empty, cut short or not an object: the hook read it as "not an
    export" and left the checkpoint to transformers, which loaded the codes without their scales. Now refused, naming
    the file."""
    write_modelopt_fp8(str(tmp_path / "export"))
    (tmp_path / "export" / "hf_quant_config.json").write_text(text)
    cache = str(tmp_path / "hub")
    _cache(cache, "org/model-FP8", FP8, str(tmp_path / "export"))
    with pytest.raises(ValueError, match=r"snapshots.*hf_quant_config\.json.*expected ModelOpt's quantization config"):
        launcher._modelopt_load(transformers.LlamaForCausalLM, ("org/model-FP8",),
                                {"cache_dir": cache, "local_files_only": True})


def test_a_gguf_load_is_left_to_transformers_and_a_variant_of_an_export_refused(tmp_path, state):
    """gguf_file= (transformers reads the model, config included, from that file) of a repo that also holds an export:
    the hook asked for its config.json and hf_quant_config.json and loaded the export instead. variant= (transformers
    reads model.<variant>.safetensors): the hook loaded model.safetensors. Now the first is transformers', the second
    refused."""
    write_modelopt_fp8(str(tmp_path / "export"))
    (tmp_path / "export" / "model.gguf").write_bytes(b"GGUF")
    cache = str(tmp_path / "hub")
    _cache(cache, "org/model-FP8", FP8, str(tmp_path / "export"))
    kw = {"cache_dir": cache, "local_files_only": True}
    gguf = {**kw, "gguf_file": "model.gguf"}
    assert launcher._modelopt_load(transformers.LlamaForCausalLM, ("org/model-FP8",), gguf) is None
    with pytest.raises(ValueError, match=r"variant='fp8'.* not a variant's; drop variant="):
        launcher._modelopt_load(transformers.LlamaForCausalLM, ("org/model-FP8",), {**kw, "variant": "fp8"})
    assert launcher._STATE["models"] == 0


def test_a_dense_hub_model_costs_no_request_transformers_would_not_make(tmp_path, state, monkeypatch):
    """Online, a dense hub model: the hook asks huggingface_hub for config.json (which transformers asks for too), and
    for hf_quant_config.json and adapter_config.json (transformers asks for this one too, peft installed) only while
    the cache does not know the revision lacks them (.no_exist, which the hub's 404 leaves); a local folder asks
    nothing."""
    _dense(str(tmp_path / "dense"))
    cache = str(tmp_path / "hub")
    _cache(cache, "org/dense", MAIN, str(tmp_path / "dense"))
    asked = []
    real = huggingface_hub.hf_hub_download

    def download(repo_id, filename, **kw):  # the hub, from the cache: a file it lacks is the hub's 404
        asked.append(filename)
        try:
            return real(repo_id, filename, **{**kw, "local_files_only": True})
        except huggingface_hub.utils.LocalEntryNotFoundError:
            _no_exist(cache, repo_id, MAIN, filename)
            raise huggingface_hub.utils.EntryNotFoundError(filename) from None

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    for expected in (["config.json", "hf_quant_config.json", "adapter_config.json"], ["config.json"]):
        asked.clear()
        assert launcher._modelopt_load(transformers.LlamaForCausalLM, ("org/dense",), {"cache_dir": cache}) is None
        assert asked == expected
    asked.clear()
    assert launcher._modelopt_load(transformers.LlamaForCausalLM, (str(tmp_path / "dense"),), {}) is None
    assert asked == []


SCRIPT = """
import sys, torch, transformers
for rev in sys.argv[1:]:
    m = transformers.AutoModelForCausalLM.from_pretrained("org/model", revision=rev, dtype=torch.float32)
    q = m.model.layers[0].self_attn.q_proj
    print(rev, type(q).__name__, float(q.weight.float().abs().max()))
f, ours = transformers.PreTrainedModel.from_pretrained.__func__, 0
while f is not None:  # the wrappers in the chain, by where their code is (functools.wraps copies names, not code)
    ours += "/dorafp8/" in f.__code__.co_filename.replace(chr(92), "/")
    f = getattr(f, "__wrapped__", None)
print("wrappers", ours)
"""


def test_dorafp8_run_loads_a_hub_export_offline(tmp_path):
    """The whole path, as a user runs it: `HF_HUB_OFFLINE=1 dorafp8 run -- python train.py` whose from_pretrained
    names a hub id. Branch "fp8" (a ModelOpt FP8 export) is held by dorafp8's layers (transformers loaded it as a
    Linear of e4m3 codes, |w| in the hundreds); main (dense) stays transformers' Linear. One dorafp8 wrapper of
    from_pretrained does both save_hooks' recording and the launcher's loading (there were two, one in the other)."""
    sd = write_modelopt_fp8(str(tmp_path / "export"))
    _dense(str(tmp_path / "dense"))
    home = tmp_path / "home"
    cache = str(home / "hub")
    _cache(cache, "org/model", MAIN, str(tmp_path / "dense"), branch="main")
    _cache(cache, "org/model", FP8, str(tmp_path / "export"), branch="fp8")
    (tmp_path / "train.py").write_text(SCRIPT)
    r = subprocess.run([sys.executable, "-m", "dorafp8", "run", "--", "python", "train.py", "fp8", "main"],
                       cwd=tmp_path, env=_env(HF_HOME=str(home), HF_HUB_CACHE=cache), capture_output=True, text=True,
                       timeout=TIMEOUT_S)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines() if line.startswith(("fp8 ", "main ")))
    assert lines["fp8"].split()[0] == "FP8Linear", r.stdout + r.stderr[-3000:]
    assert lines["main"].split()[0] == "Linear", r.stdout
    assert "ModelOpt FP8 export held by dorafp8" in r.stderr
    assert "wrappers 1" in r.stdout.splitlines(), r.stdout
    code_max = float(sd["model.layers.0.self_attn.q_proj.weight"].float().abs().max())
    assert float(lines["fp8"].split()[1]) == code_max  # the file's codes, held with their scale


def test_a_diffusers_load_is_not_handed_over(tmp_path, monkeypatch):
    """Under --quantize the hook wraps diffusers' from_pretrained too, and asked every load whether it was a ModelOpt
    export for transformers' loader (AutoConfig on a diffusers config): diffusers has its own ModelOpt quantizer, and
    for a hub id that would cost requests diffusers never makes. Now only transformers' loads are asked."""
    pytest.importorskip("diffusers")
    from tests.integration._tiny_diffusers import unet

    model, _ = unet()
    model.save_pretrained(str(tmp_path / "unet"))
    monkeypatch.setattr(save_hooks, "LOAD_HOOKS", {})
    monkeypatch.setitem(launcher._STATE, "options", {})
    asked = []
    monkeypatch.setattr(launcher, "_modelopt_load", lambda *a: asked.append(a))
    launcher._hook_loads(True)
    type(model).from_pretrained(str(tmp_path / "unet"))
    assert asked == []


@pytest.mark.parametrize("fifo, left_out, call", [
    ("config.json", (), "modelopt_export"),
    ("adapter_config.json", (), "adapter_base"),
    ("model.safetensors.index.json", ("model.safetensors",), "modelopt_export"),  # _scaled_codes, offline
    ("model.safetensors", (), "modelopt_export"),  # _scaled_codes reads its header (files.open_safetensors)
    ("model.safetensors.index.json", ("model.safetensors",), "fetch_weights"),
])
def test_a_fifo_in_the_cache_blocks_no_reader(tmp_path, fifo, left_out, call):
    """A FIFO planted in a cached snapshot (huggingface_hub's offline download returns any path that exists there):
    hub.py opened config.json, adapter_config.json and the weight index with a plain open(), and files.open_safetensors
    the weights' header, which blocked `dorafp8 run` for ever. Now read_json and open_safetensors refuse it unopened:
    fetch_weights names it, the others take the checkpoint for no ModelOpt export (or no adapter). A helper frees a blocked reader after 3 s and says so (a file), so that
    the old code fails here instead of hanging."""
    _dense(str(tmp_path / "dense"))
    cache = str(tmp_path / "hub")
    _cache(cache, "org/model", MAIN, str(tmp_path / "dense"), leave_out=(fifo, *left_out))
    planted = os.path.join(cache, "models--org--model", "snapshots", MAIN, fifo)
    os.mkfifo(planted)
    opened = tmp_path / "opened"
    helper = subprocess.Popen(["sh", "-c", f"sleep 3; while :; do printf x > '{planted}'; touch '{opened}'; done"])
    kw = {"cache_dir": cache, "local_files_only": True}
    try:
        if call == "fetch_weights":
            with pytest.raises(ValueError, match=rf"{fifo}: not a regular file \(a FIFO"):
                hub.fetch_weights("org/model", kw)
        else:
            assert getattr(hub, call)("org/model", kw) is None
        assert not opened.exists(), f"{call} opened the FIFO {fifo}"
    finally:
        helper.kill()
        helper.wait()
