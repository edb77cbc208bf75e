"""The trainers' own command lines under `dorafp8 run` (dorafp8/launcher.py; docs/TRAINERS.md), issue 41.

End to end, each trainer's CLI trains DoRA on a tiny LLaMA checkpoint written here (nothing downloaded): once as
`dorafp8 run --quantize -- <its command>` on the checkpoint (the base put in fp8 as it loads), once as its plain
command on the same checkpoint with the weights replaced by their fp8 quantization dequantized, with plain PEFT. The
two must log the same losses (fp32) and save adapters with the same keys that give the same logits. The launcher's
exit report counts the fp8 layers and the DoRA layers' calls, so a run that silently trained on dense weights fails.

- TRL's `trl sft` runs its training script in a child process (`accelerate launch`): this checks the launcher's
  environment hand-off too. trl is in the test extra.
- LLaMA-Factory's `llamafactory-cli train` cannot be installed beside the test extra (llamafactory 0.9.5 pins
  peft<=0.18.1, transformers<=5.6, datasets<=4.0, trl<=0.24): its test runs in a venv of its own with llamafactory as
  pip resolves it, the peft it pins included (.ci/llamafactory.sh, a CI leg), and skips in any venv without it.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from peft import PeftModel  # noqa: E402

import dorafp8  # noqa: E402
from tests._tolerance import assert_close, tol  # noqa: E402
from tests.integration.doc_fixtures import write_sft_data, write_trainer_checkpoint  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 300
BIN = os.path.dirname(sys.executable)
N_LINEAR = 14  # the tiny LLaMA's linear layers but lm_head: 2 x (q, k, v, o, gate, up, down)
STEPS = 4


def _env(**extra):
    return {**dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                   OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore",
                   PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])), **extra}


def _run(cmd, cwd, **env):
    r = subprocess.run(cmd, cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, f"{' '.join(cmd)} failed (rc={r.returncode}):\n{(r.stdout + r.stderr)[-6000:]}"
    return r.stdout + r.stderr


def _losses(out_dir):
    with open(os.path.join(out_dir, f"checkpoint-{STEPS}", "trainer_state.json")) as f:
        return torch.tensor([h["loss"] for h in json.load(f)["log_history"] if "loss" in h])


def _compare(tmp_path, fp8_dir, ref_dir, log):
    assert f"LlamaForCausalLM.from_pretrained -> {N_LINEAR} layers in fp8" in log, log[-3000:]
    m = re.search(r"dorafp8 run: (\d+) layers put in fp8 on load; (\d+) dorafp8 DoRA/LoRA layers ran (\d+) forward",
                  log)
    assert m and int(m[1]) == N_LINEAR and int(m[2]) == N_LINEAR and int(m[3]) >= N_LINEAR * STEPS, log[-3000:]
    got, want = _losses(fp8_dir), _losses(ref_dir)
    assert len(got) == STEPS
    assert_close(got, want, tol(torch.float32), "losses: dorafp8 on fp8 against PEFT on the dequantized weights")
    ids = torch.tensor([[1, 4, 5, 6, 7, 8, 9, 10, 2]])
    logits = []
    for d in (fp8_dir, ref_dir):
        base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "deq")
        pm = PeftModel.from_pretrained(base, d).eval()
        assert sum("lora_magnitude_vector" in k for k, _ in pm.named_parameters()) == N_LINEAR
        with torch.no_grad():
            logits.append(pm(input_ids=ids).logits)
    assert_close(logits[0], logits[1], 2 * tol(torch.float32), "logits of the two saved adapters")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    d = tmp_path_factory.mktemp("trainers")
    assert write_trainer_checkpoint(d / "model") == N_LINEAR
    write_trainer_checkpoint(d / "deq", dequantized=True)
    return d


def test_trl_sft_through_the_launcher_matches_peft_on_dequantized_weights(checkpoints, tmp_path):
    pytest.importorskip("trl")
    data = tmp_path / "data"
    write_sft_data(data)
    args = ["--dataset_name", str(data), "--use_peft", "--use_dora", "--lora_r", "8", "--lora_alpha", "16",
            "--lora_target_modules", "all-linear", "--max_steps", str(STEPS), "--per_device_train_batch_size", "4",
            "--learning_rate", "1e-3", "--logging_steps", "1", "--report_to", "none", "--use_cpu", "--seed", "0",
            "--dtype", "float32", "--bf16", "false", "--save_strategy", "steps", "--save_steps", str(STEPS)]
    shutil.copytree(checkpoints / "deq", tmp_path / "deq")
    log = _run([sys.executable, "-m", "dorafp8", "run", "--quantize", "--", os.path.join(BIN, "trl"), "sft",
                "--model_name_or_path", str(checkpoints / "model"), "--output_dir", "fp8"] + args, tmp_path)
    _run([os.path.join(BIN, "trl"), "sft", "--model_name_or_path", str(checkpoints / "deq"), "--output_dir", "ref"]
         + args, tmp_path)
    _compare(tmp_path, tmp_path / "fp8", tmp_path / "ref", log)


def _lf_config(model, out, data, batch: int = 4, more: str = "learning_rate: 1.0e-3\nuse_cpu: true\n") -> str:
    """A LLaMA-Factory training config: DoRA on every linear layer, `batch` sequences per process, fp32; `more`: the
    rest (test_llamafactory_multi.py puts an engine's config file and its optimizer there)."""
    return (f"model_name_or_path: {model}\nstage: sft\ndo_train: true\nfinetuning_type: lora\nuse_dora: true\n"
            f"lora_target: all\nlora_rank: 8\nlora_alpha: 16\ndataset: tiny\ndataset_dir: {data}\ntemplate: empty\n"
            f"cutoff_len: 32\noutput_dir: {out}\noverwrite_output_dir: true\nper_device_train_batch_size: {batch}\n"
            f"max_steps: {STEPS}\nlogging_steps: 1\nsave_steps: {STEPS}\nseed: 0\nreport_to: none\nbf16: false\n{more}")


def test_llamafactory_cli_through_the_launcher_matches_peft_on_dequantized_weights(checkpoints, tmp_path):
    """`dorafp8 run --quantize -- llamafactory-cli train` as a user runs it after `pip install llamafactory dorafp8`:
    with the peft LLaMA-Factory's release pins (0.18.1 for 0.9.5) and its own version check on."""
    pytest.importorskip("llamafactory", reason="llamafactory is not installed in this venv: its pins (peft<=0.18.1, "
                                               "transformers<=5.6, trl<=0.24, datasets<=4.0 for 0.9.5) clash with "
                                               "the test extra's; CI runs this test in a venv of its own "
                                               "(.ci/llamafactory.sh)")
    data = tmp_path / "data"
    write_sft_data(data, alpaca=True)
    shutil.copytree(checkpoints / "deq", tmp_path / "deq")
    for name, model in (("fp8", checkpoints / "model"), ("ref", tmp_path / "deq")):
        (tmp_path / f"{name}.yaml").write_text(_lf_config(model, tmp_path / name, data))
    cli = os.path.join(BIN, "llamafactory-cli")
    check = {"DISABLE_VERSION_CHECK": "0"}  # LLaMA-Factory's own check of its dependencies' versions runs
    log = _run([sys.executable, "-m", "dorafp8", "run", "--quantize", "--", cli, "train", "fp8.yaml"], tmp_path,
               **check)
    _run([cli, "train", "ref.yaml"], tmp_path, **check)
    _compare(tmp_path, tmp_path / "fp8", tmp_path / "ref", log)


# ---- the launcher's command forms, its hand-off to child processes, its errors ---------------------------------------


_PROBE = ("import os, sys, torch; from dorafp8 import launcher; "
          "print('probe', sys.argv[1:], 'launcher' if launcher._STATE['options'] is not None else 'none')")


def test_launcher_runs_scripts_modules_code_and_children(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(_PROBE + "\n")
    (tmp_path / "probe_mod.py").write_text(_PROBE + "\n")
    child = tmp_path / "parent.py"
    child.write_text("import subprocess, sys\nsubprocess.run([sys.executable, 'probe.py', 'child'], check=True)\n")
    py = [sys.executable, "-m", "dorafp8", "run", "--"]
    assert "probe ['a', 'b'] launcher" in _run(py + [str(script), "a", "b"], tmp_path)
    assert "probe ['x'] launcher" in _run(py + ["python", "-m", "probe_mod", "x"], tmp_path)
    assert "probe ['c'] launcher" in _run(py + ["-c", _PROBE, "c"], tmp_path)
    # a child Python process gets the launcher too (that is how `trl sft` and torchrun workers get it), once it
    # imports torch; without the launcher nothing of it runs
    assert "probe ['child'] launcher" in _run(py + ["parent.py"], tmp_path)
    assert "probe ['child'] none" in _run([sys.executable, "parent.py"], tmp_path)


def _venv(path, with_dorafp8: bool) -> str:
    """Another interpreter: a venv of its own (no pip), seeing this environment's packages only if asked."""
    import glob
    import venv

    venv.EnvBuilder(with_pip=False).create(str(path))
    if with_dorafp8:
        site = glob.glob(str(path / "lib" / "python3*" / "site-packages"))[0]
        here = [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(os.path.join(p, "torch"))][0]
        with open(os.path.join(site, "this_env.pth"), "w") as f:  # an `import` line runs: .pth files there count
            f.write(f"import site; site.addsitedir({here!r})\n")
    return str(path / "bin" / "python")


def test_launcher_runs_exactly_the_command_given(tmp_path):
    """The command forms of issue 49: interpreter flags, a `--` inside the command, another interpreter (handed
    over to its own `dorafp8 run` where dorafp8 is installed there, refused naming it where not), a missing module."""
    (tmp_path / "show.py").write_text(_PROBE + "; print('prefix', sys.prefix, 'unbuffered', "
                                               "os.environ.get('PYTHONUNBUFFERED') or not sys.stdout.line_buffering)\n")
    py = [sys.executable, "-m", "dorafp8", "run", "--"]
    env = {}
    out = _run(py + ["python", "-u", "show.py", "a"], tmp_path)
    assert "probe ['a'] launcher" in out, out
    out = _run(py + ["python", "-W", "error", "-X", "utf8", "show.py", "-E"], tmp_path)
    assert "probe ['-E'] launcher" in out, out  # -E after the script is the script's
    assert "probe ['--', '--lr', '1'] launcher" in _run(py + ["python", "show.py", "--", "--lr", "1"], tmp_path)
    other = _venv(tmp_path / "other", with_dorafp8=True)
    out = _run(py + [other, "show.py", "b"], tmp_path, **env)
    assert f"probe ['b'] launcher\nprefix {tmp_path / 'other'}" in out, out  # ran in that interpreter, hooked
    bare = _venv(tmp_path / "bare", with_dorafp8=False)
    for argv, message in [
        (["--quantize", "python", "show.py", "--", "--lr", "1"],
         "'python show.py' comes before `--`, and everything after `--` is the command ('--lr 1'); put the whole "
         "command after it: dorafp8 run --quantize -- python show.py --lr 1"),
        (["--", bare, "show.py"], f"{bare} is another Python than dorafp8's ({sys.executable}) and has no dorafp8"),
        (["--", "python", "-m", "nonexistent_mod"], f"dorafp8 run: no module named 'nonexistent_mod' in this Python "
                                                    f"({sys.executable})"),
        (["--", "python", "-I", "show.py"], "python -I ignores PYTHONPATH or site"),
    ]:
        r = subprocess.run([sys.executable, "-m", "dorafp8", "run"] + argv, cwd=tmp_path, env=_env(**env),
                           capture_output=True, text=True, timeout=TIMEOUT_S)
        assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert "probe" not in r.stdout, r.stdout  # nothing ran in dorafp8's own interpreter instead
        assert r.stderr.count("dorafp8 run:") == 1, r.stderr  # one message (argparse's has its usage line above)


@pytest.mark.parametrize("argv, message", [
    ([], "no command"),
    (["--per-row-scale", "--", "train.py"], "add --quantize"),
    (["--", "no-such-trainer-cli"], "neither a script"),
    (["--", "missing.py"], "no such script"),
    (["--", "sh", "-c", "true"], "not a Python program"),
    (["--", "python", "-c"], "-c needs the code to run"),  # it said "'-c' is not a command; options ... before `--`"
])
def test_launcher_errors_name_the_problem(argv, message, tmp_path):
    r = subprocess.run([sys.executable, "-m", "dorafp8", "run"] + argv, cwd=tmp_path, env=_env(), capture_output=True,
                       text=True, timeout=TIMEOUT_S)
    assert r.returncode != 0 and message in r.stderr, r.stderr[-2000:]


def test_a_script_named_by_path_runs_only_if_it_is_python(tmp_path):
    """`dorafp8 run -- ./start-ui.sh` (OneTrainer's launcher, a bash script) was run as Python and stopped on a
    SyntaxError traceback; as on PATH, a script whose #! line names another interpreter is refused, naming the fix.
    One with a Python #! line, or none, still runs in this process."""
    (tmp_path / "start-ui.sh").write_text('#!/usr/bin/env bash\nset -e\nsource "${BASH_SOURCE[0]%/*}/lib.sh"\n')
    (tmp_path / "train").write_text("#!/usr/bin/env python3\nimport sys\nprint('ran', sys.argv[1:])\n")
    (tmp_path / "bare").write_text("import sys\nprint('ran', sys.argv[1:])\n")
    # a .py file is Python whatever its #! line says (PEP 723's `uv run --script`)
    (tmp_path / "uv.py").write_text("#!/usr/bin/env -S uv run --script\nimport sys\nprint('ran', sys.argv[1:])\n")
    for f in ("start-ui.sh", "train", "bare", "uv.py"):
        (tmp_path / f).chmod(0o755)

    def run(*command):
        return subprocess.run([sys.executable, "-m", "dorafp8", "run", "--", *command], cwd=tmp_path, env=_env(),
                              capture_output=True, text=True, timeout=TIMEOUT_S)

    r = run("./start-ui.sh")
    assert r.returncode != 0 and "'./start-ui.sh' (" in r.stderr and "is not a Python program" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "Run the Python command it starts" in r.stderr, r.stderr[-3000:]
    for script in ("./train", os.path.join(str(tmp_path), "bare"), "uv.py"):
        r = run(script, "--lr", "1")
        assert r.returncode == 0 and "ran ['--lr', '1']" in r.stdout, r.stderr[-3000:]


def test_no_argument_still_prints_the_install_report():
    r = subprocess.run([sys.executable, "-m", "dorafp8"], env=_env(), capture_output=True, text=True,
                       timeout=TIMEOUT_S)
    assert r.returncode == 0 and r.stdout.startswith(f"dorafp8 {dorafp8.__version__}")


def test_peft_older_than_0_18_is_refused_naming_the_fix(monkeypatch):
    """On a peft older than dorafp8's layers support, get_peft_model on an fp8 layer fails deep in PEFT's DoRA init
    ("mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'). It is refused instead, naming the fix."""
    import importlib.metadata

    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora.model import LoraModel

    from dorafp8 import _install

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda d: "0.17.1" if d == "peft" else real(d))
    monkeypatch.setattr(LoraModel, "_create_new_module", LoraModel.__dict__["_create_new_module"])
    _install._peft()  # what `import peft` runs after `import dorafp8`
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))
    dorafp8.quantize_model(model)
    with pytest.raises(RuntimeError, match=r"peft 0\.17\.1 is older than 0\.18.*pip install 'peft>=0\.18'"):
        get_peft_model(model, LoraConfig(r=4, use_dora=True, target_modules=["q_proj"]))


@pytest.mark.parametrize("algo", ["W4A16_NVFP4", "nvfp4", "MIXED_PRECISION"])
def test_the_launcher_loads_every_modelopt_export_dorafp8_reads(tmp_path, monkeypatch, algo):
    """`dorafp8 run`'s from_pretrained hook handed only quant_algo "NVFP4" / "MXFP8" folders to load_fp8_checkpoint:
    a W4A16_NVFP4 export (what dorafp8's own writer gives NVFP4 layers without input_scale), a MIXED_PRECISION one
    and a lower-case "nvfp4" (vLLM upper-cases quant_algo; load_fp8_checkpoint refused it as an unknown algorithm)
    went to transformers, which has no ModelOpt quantizer and cannot load packed NVFP4 weights. Now they load through
    dorafp8, every linear layer NVFP4."""
    from dorafp8 import FP8Linear, launcher, quant
    from tests.checkpoint._ckpt_fixtures import LINEARS, original_model, write_modelopt

    path = write_modelopt(original_model(), str(tmp_path / "mo"), "W4A16_NVFP4")
    with open(os.path.join(path, "hf_quant_config.json")) as f:
        hq = json.load(f)
    hq["quantization"]["quant_algo"] = algo
    if algo == "MIXED_PRECISION":
        hq["quantization"]["quantized_layers"] = {n: {"quant_algo": "w4a16_nvfp4"} for n, m in
                                                  original_model().named_modules() if n.split(".")[-1] in LINEARS}
    with open(os.path.join(path, "hf_quant_config.json"), "w") as f:
        json.dump(hq, f)
    for key in ("models", "quantized"):
        monkeypatch.setitem(launcher._STATE, key, 0)
    model = launcher._modelopt_load(transformers.LlamaForCausalLM, (path,), {})
    layers = [m for n, m in model.named_modules() if n.split(".")[-1] in LINEARS]
    assert len(layers) == 14 and all(isinstance(m, FP8Linear) and quant.scale_kind(m.scale) == "nvfp4"
                                     for m in layers)


@pytest.mark.parametrize("where", ["hf_quant_config.json", "config.json"])
@pytest.mark.parametrize("algo", ["FP8", "fp8_per_channel_per_token"])
def test_the_launcher_loads_a_modelopt_fp8_export_with_its_scales(tmp_path, monkeypatch, algo, where):
    """A ModelOpt FP8 export (e4m3 `weight`, fp32 `weight_scale`, quant_algo FP8 in hf_quant_config.json, no
    quantization_config in config.json, as ModelOpt's HF export writes it) went from `dorafp8 run`'s from_pretrained
    hook to transformers, which has no ModelOpt quantizer: it loaded the e4m3 values as the weights without their
    scales (x 1 / scale: hundreds where the model has 0.1), with only 'UNEXPECTED weight_scale' notes; one that says
    so in config.json's quantization_config (quant_method "modelopt", no hf_quant_config.json) too, transformers
    skipping the "Unknown quantization type". Now both load through load_fp8_checkpoint, each layer the file's e4m3
    bytes and scale."""
    from dorafp8 import FP8Linear, launcher, quant
    from tests.checkpoint._ckpt_fixtures import LINEARS, _save_dir, original_model

    model = original_model()
    sd, per_row = {}, algo.upper() == "FP8_PER_CHANNEL_PER_TOKEN"
    for k, v in model.state_dict().items():
        if k.endswith(".weight") and k.split(".")[-2] in LINEARS:
            w8, scale = quant.quantize_e4m3(v, per_row=per_row)
            sd.update({k: w8, k + "_scale": scale})
        else:
            sd[k] = v
    path = _save_dir(sd, str(tmp_path / "fp8"), model.config)
    if where == "hf_quant_config.json":
        with open(os.path.join(path, "hf_quant_config.json"), "w") as f:
            json.dump({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": algo}}, f)
    else:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": algo, "ignore": ["lm_head"]}
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f)
    for key in ("models", "quantized"):
        monkeypatch.setitem(launcher._STATE, key, 0)
    loaded = launcher._modelopt_load(transformers.LlamaForCausalLM, (path,), {})
    assert loaded is not None
    layers = {n: m for n, m in loaded.named_modules() if n.split(".")[-1] in LINEARS}
    assert len(layers) == 14 and all(isinstance(m, FP8Linear) for m in layers.values())
    for n, m in layers.items():
        assert torch.equal(m.weight.view(torch.uint8), sd[n + ".weight"].view(torch.uint8)), n
        assert torch.equal(m.scale.float().reshape(-1), sd[n + ".weight_scale"].float().reshape(-1)), n


def test_quantize_leaves_a_classifier_head_dense_for_peft_to_train(monkeypatch):
    """--quantize on a sequence classifier (TRL's reward trainer loads one): its `score` head, which PEFT trains in full
    for task_type="SEQ_CLS", stays dense; in fp8 get_peft_model refuses it (before: it stayed at its random init)."""
    from peft import LoraConfig, get_peft_model

    from dorafp8 import launcher

    monkeypatch.setitem(launcher._STATE, "options", {"quantize": True})
    monkeypatch.setitem(launcher._STATE, "models", 0)
    monkeypatch.setitem(launcher._STATE, "quantized", 0)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, num_labels=3, pad_token_id=0)
    model = transformers.LlamaForSequenceClassification(cfg)
    launcher._quantize(model)
    assert launcher._STATE["quantized"] == 7 and type(model.score) is torch.nn.Linear
    pm = get_peft_model(model, LoraConfig(r=4, use_dora=True, target_modules="all-linear", task_type="SEQ_CLS"))
    pm(input_ids=torch.tensor([[1, 4, 5, 6]]), labels=torch.tensor([2])).loss.backward()
    assert pm.base_model.model.score.modules_to_save["default"].weight.grad is not None


def test_quantize_leaves_a_container_head_dense_for_peft_to_train(monkeypatch):
    """RoBERTa's `classifier` is a module of two linears (dense, out_proj) that PEFT trains whole for SEQ_CLS: --quantize
    put both in fp8 (the head's name is not theirs) and get_peft_model refused them. Now the head stays dense whole."""
    from peft import LoraConfig, get_peft_model

    from dorafp8 import launcher

    monkeypatch.setitem(launcher._STATE, "options", {"quantize": True})
    monkeypatch.setitem(launcher._STATE, "models", 0)
    monkeypatch.setitem(launcher._STATE, "quantized", 0)
    torch.manual_seed(0)
    cfg = transformers.RobertaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, num_labels=3, max_position_embeddings=40)
    model = transformers.RobertaForSequenceClassification(cfg)
    launcher._quantize(model)
    assert type(model.classifier.dense) is torch.nn.Linear and type(model.classifier.out_proj) is torch.nn.Linear
    assert launcher._STATE["quantized"] == 6  # the encoder layer's q, k, v, attention output, intermediate, output
    pm = get_peft_model(model, LoraConfig(r=4, use_dora=True, target_modules=["query", "value"], task_type="SEQ_CLS"))
    pm(input_ids=torch.tensor([[1, 4, 5, 6]]), labels=torch.tensor([2])).loss.backward()
    assert pm.base_model.model.classifier.modules_to_save["default"].out_proj.weight.grad is not None


_DEQUANTIZED_LOAD = """
import sys, transformers
as_llamafactory = transformers.FineGrainedFP8Config(dequantize=True)
m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], ignore_mismatched_sizes=True,
                                                      quantization_config=as_llamafactory)
print("q_proj:", type(m.model.layers[0].self_attn.q_proj).__name__)
"""


@pytest.mark.parametrize("quantize", [True, False])
def test_the_launcher_says_when_a_load_dequantizes_an_fp8_checkpoint(tmp_path, quantize):
    """LLaMA-Factory loads every fp8 checkpoint with FineGrainedFP8Config(dequantize=True) (0.9.5, model_utils/
    quantization.py): transformers dequantizes it, and `dorafp8 run --quantize` silently put the dense weights back in
    fp8 one scale per tensor (2.2% from the file's block-scaled weights here), or, without --quantize, the model
    trained dense without a word. Now the run says so on that load, naming load_fp8_checkpoint."""
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=97, hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2))
    dorafp8.quantize_model(model, block_size=128, verbose=False)
    dorafp8.save_fp8_checkpoint(model, str(tmp_path / "fg"), format="fine-grained", verbose=False)
    out = _run([sys.executable, "-m", "dorafp8", "run", *(["--quantize"] if quantize else []), "--", "python", "-c",
                _DEQUANTIZED_LOAD, str(tmp_path / "fg")], str(tmp_path))
    assert ("q_proj: FP8Linear" if quantize else "q_proj: Linear") in out, out
    said = [x for x in out.splitlines() if "dequantize=True" in x]
    assert len(said) == 1 and "LlamaForCausalLM.from_pretrained" in said[0] and "load_fp8_checkpoint" in said[0], out
    assert ("one scale per tensor" if quantize else "the model stays dense") in said[0], said
