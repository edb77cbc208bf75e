"""What a new user meets first: the README's promises, the import, PEFT's shorthands, quantize_model's guards and
warnings, the demo, and the messages for missing extras. Things that depend on a fresh interpreter (import cost,
import order) run in subprocesses."""

import copy
import json
import os
import re
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import dorafp8
from dorafp8 import FP8Linear
from dorafp8.quant import QuantizationWarning
from tests._layers import n_fp8
from tests._tolerance import tol, within

ROOT = Path(__file__).resolve().parents[2]
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _run_python(code: str, timeout=240) -> str:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env,
                         cwd=ROOT)
    assert out.returncode == 0, f"exit {out.returncode}\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}"
    return out.stdout


def _llama(hidden=64, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).float().eval()


# ---------------------------------------------------------------------------------------------------- import

def test_import_does_not_load_peft_transformers_or_triton():
    """`import dorafp8` costs about `import torch`: the heavy optional modules load only when used."""
    out = _run_python("import sys, dorafp8; print(sorted(m for m in ('peft', 'transformers', 'triton') "
                      "if m in sys.modules))")
    assert out.strip() == "[]", out


def test_import_hook_waits_only_for_modules_that_exist():
    """`import dorafp8` watches (dorafp8/_install.py) only the modules this environment has: of FSDP2's two homes the
    one in the running torch, and a library that is not installed not at all; finding them imports nothing."""
    out = _run_python("""
import sys
sys.modules['lycoris'] = None  # an environment without lycoris (it is in the test extras)
import torch
homes = {'torch.distributed.fsdp._fully_shard._fsdp_param': 'torch/distributed/fsdp/_fully_shard/_fsdp_param.py',
         'torch.distributed._composable.fsdp._fsdp_param': 'torch/distributed/_composable/fsdp/_fsdp_param.py'}
import os
here = sorted(m for m, f in homes.items() if os.path.exists(os.path.join(os.path.dirname(torch.__path__[0]), f)))
import dorafp8
from dorafp8 import _after_import
print(sorted(m for m in _after_import.waiting if m in homes) == here, len(here))
print('lycoris' in _after_import.waiting, [m for m in ('transformers', 'torch.distributed.fsdp') if m in sys.modules])
print('modules.module.LoRAModule' in _after_import.waiting)  # no OneTrainer checkout on sys.path: not waited for
""")
    assert out.split("\n")[:3] == ["True 1", "False []", "False"], out


def test_import_hook_leaves_once_everything_it_watches_is_loaded():
    """The finder `import dorafp8` puts first on sys.meta_path runs each watched module's hook after that module
    loads, and removes itself once all have: it is not consulted on every later import of the process."""
    out = _run_python("""
import sys, dorafp8
from dorafp8 import _after_import
watched = sorted(_after_import.waiting)
print("=", _after_import.HOOK in sys.meta_path, len(watched) >= 4)
import importlib
for name in watched:
    importlib.import_module(name)
print("=", _after_import.HOOK in sys.meta_path, sorted(_after_import.waiting))
""")
    # only this script's lines: a watched module may log to stdout as it loads (deepspeed names its accelerator)
    assert [line for line in out.split("\n") if line.startswith("= ")] == ["= True True", "= False []"], out


@pytest.mark.parametrize("order", ["dorafp8-first", "peft-first"])
def test_fp8_first_get_peft_model_needs_no_other_import(order):
    """quantize_model then get_peft_model builds DoRAFP8Linear layers whichever of peft and dorafp8 is imported
    first, without the user importing dorafp8's PEFT integration; and transformers' save_pretrained (which peft
    imports) is hooked either way (tests/checkpoint/test_save_paths.py)."""
    imports = "import dorafp8\nimport peft" if order == "dorafp8-first" else "import peft\nimport dorafp8"
    out = _run_python(f"""{imports}
import torch
net = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
dorafp8.quantize_model(net, verbose=False)
pm = peft.get_peft_model(net, peft.LoraConfig(r=2, use_dora=True, target_modules=["0", "2"]))
print(sorted(type(m).__name__ for m in pm.modules() if type(m).__name__ == "DoRAFP8Linear"))
pm(torch.randn(3, 16)).sum().backward()
import transformers
print(getattr(transformers.PreTrainedModel.save_pretrained, "_dorafp8", False))
""")
    assert out.split("\n")[:2] == ["['DoRAFP8Linear', 'DoRAFP8Linear']", "True"], out


def test_missing_extra_names_it():
    """Without peft/transformers, the PEFT names, DoRAFP8Config and the demo say which extra to install."""
    out = _run_python("""
import sys
sys.modules['peft'] = sys.modules['transformers'] = None  # what an interpreter without them sees
import dorafp8, dorafp8.demo
for f in (lambda: dorafp8.DoRAFP8Linear, lambda: dorafp8.DoRAFP8Config, lambda: dorafp8.demo.main([])):
    try:
        f()
    except ImportError as e:
        print(e)
""")
    lines = out.strip().splitlines()
    assert len(lines) == 3, out
    assert "dorafp8.DoRAFP8Linear needs peft" in lines[0] and "pip install 'dorafp8[peft]'" in lines[0]
    assert "dorafp8.DoRAFP8Config needs transformers" in lines[1] and "pip install 'dorafp8[peft]'" in lines[1]
    assert "the demo" in lines[2] and "pip install 'dorafp8[peft]'" in lines[2]


def test_every_public_name_is_in_dir_and_loads():
    """Each name of __all__, the ones loaded on first use (PEFT's, transformers', kohya's, LyCORIS's) too, is in
    dir(dorafp8) and resolves."""
    out = _run_python("import dorafp8; print([n for n in dorafp8.__all__ if n not in dir(dorafp8) "
                      "or getattr(dorafp8, n, None) is None])")
    assert out.strip() == "[]", out


def test_untested_torch_warns_at_import():
    """A torch older than the oldest CI tests (dorafp8/_deps.py OLDEST_TESTED) gets one warning naming it and the fix;
    a tested one none."""
    code = """
import warnings, torch
{setup}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import dorafp8
print([str(w.message) for w in caught if str(w.message).startswith("dorafp8:")])
"""
    old = _run_python(code.format(setup="torch.__version__ = '2.10.0+cpu'")).strip()
    assert old == ("[\"dorafp8: torch 2.10.0+cpu is older than 2.11, the oldest dorafp8 is tested with: "
                   "pip install 'torch>=2.11'; some features may fail\"]"), old
    assert _run_python(code.format(setup="")).strip() == "[]"


def test_a_misspelt_variable_is_named_at_import():
    """A DORAFP8_* variable nothing reads (DORAFP8_CUDA_ARCH for DORAFP8_CUDA_ARCHS, DORAFP8_BACKENDS for
    DORAFP8_BACKEND) was silently ignored: the switch the user meant stayed off. `import dorafp8` now warns, naming it
    and the variable it likely misspells; the variables it reads warn of nothing."""
    code = """
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import dorafp8
print([str(w.message) for w in caught if "DORAFP8_" in str(w.message)])
"""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("DORAFP8_")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, cwd=ROOT,
                         env=dict(env, DORAFP8_CUDA_ARCH="90a", DORAFP8_backends="native", DORAFP8_RACE="0"))
    said = out.stdout.strip().splitlines()[-1]
    assert "DORAFP8_CUDA_ARCH (did you mean DORAFP8_CUDA_ARCHS?)" in said, out.stdout + out.stderr
    assert "DORAFP8_backends (did you mean DORAFP8_BACKEND?)" in said and "DORAFP8_RACE " not in said, said
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, cwd=ROOT,
                         env=dict(env, DORAFP8_RACE="0"))
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr


def test_a_misspelt_variable_is_named_once_not_by_every_rank_and_worker():
    """Every torchrun / accelerate rank and every DataLoader worker started by spawn or forkserver (which import the
    training script again) inherits the environment, and each warned of the same misspelt variable: a long line per
    GPU and per worker. Local rank 0's main process says it; the others do not."""
    code = """
import multiprocessing, warnings

def child(q):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import dorafp8
    q.put(sum("DORAFP8_CUDA_ARCH " in str(w.message) for w in caught))

if __name__ == "__main__":
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import dorafp8
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    print([sum("DORAFP8_CUDA_ARCH " in str(w.message) for w in caught), q.get(timeout=200)])
    p.join()
"""
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("DORAFP8_") and k != "LOCAL_RANK"}
    env = dict(env, DORAFP8_CUDA_ARCH="90a", PYTHONPATH=str(ROOT))
    said = {}
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "train.py")
        with open(script, "w") as f:
            f.write(code)
        for rank in ("0", "1"):
            out = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=400, cwd=ROOT,
                                 env=dict(env, LOCAL_RANK=rank))
            assert out.returncode == 0, out.stdout + out.stderr
            said[rank] = out.stdout.strip().splitlines()[-1]
    assert said == {"0": "[1, 0]", "1": "[0, 0]"}, said


def test_untested_version_compares_numbers():
    from dorafp8._deps import untested_version

    assert untested_version("triton", "3.10.0") is None  # a string comparison would call 3.10 older than 3.6
    assert untested_version("torch", "2.11.0+cu130") is None and untested_version("torch", "10.0") is None
    assert "triton 3.5.1 is older than 3.6" in untested_version("triton", "3.5.1")
    assert "torch 1.13.1 is older than 2.11" in untested_version("torch", "1.13.1")


def test_environment_report():
    out = _run_python("import runpy; runpy.run_module('dorafp8', run_name='__main__')")
    assert "backends on cpu: auto -> native" in out and "CUDA extension dorafp8._C:" in out


def test_the_report_names_refused_settings():
    """`python -m dorafp8`, the first thing a new user runs, died on DORAFP8_BACKEND=Triton with a traceback and said
    nothing of DORAFP8_RACE=true or DORAFP8_CUDA_ARCHS=Hopper, which only the first GPU step of a training run (or a
    build minutes into it) refused. It now says each refused value, with the error its reader would raise."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DORAFP8_")}
    env.update(DORAFP8_RACE="true", DORAFP8_BACKEND="Triton", DORAFP8_CUDA_ARCHS="Hopper", DORAFP8_HOPPER_GEMM="off")
    r = subprocess.run([sys.executable, "-m", "dorafp8"], capture_output=True, text=True, timeout=240, cwd=ROOT,
                       env=env)
    assert r.returncode == 0, r.stderr
    refused = [ln for ln in r.stdout.splitlines() if ln.startswith("refused setting: ")]
    for name, expected in (("DORAFP8_RACE", "0 (off) or 1 (on)"), ("DORAFP8_HOPPER_GEMM", "0 (off) or 1 (on)"),
                           ("DORAFP8_BACKEND", "'triton'"), ("DORAFP8_CUDA_ARCHS", "89;90a")):
        assert [ln for ln in refused if name in ln and expected in ln], (name, r.stdout)
    assert "backends on cpu: auto -> refused (DORAFP8_BACKEND)" in r.stdout
    r = subprocess.run([sys.executable, "-m", "dorafp8"], capture_output=True, text=True, timeout=240, cwd=ROOT,
                       env=dict(env, DORAFP8_RACE="0", DORAFP8_BACKEND="native", DORAFP8_CUDA_ARCHS="90a",
                                DORAFP8_HOPPER_GEMM="1"))
    assert r.returncode == 0 and "refused setting" not in r.stdout, r.stdout + r.stderr


def test_a_refused_setting_stops_the_command_in_one_line(tmp_path):
    """DORAFP8_NO_PATCHES=2 made `python -m dorafp8` (and the `dorafp8` script) die with the traceback of the import,
    and DORAFP8_BACKEND=Triton `dorafp8 selftest` with that of the call reading it; DORAFP8_RACE=yes `dorafp8 run --
    cmd` started the trainer, which failed at its first GPU step. One line naming the variable now, exit 2 (the
    trainer not started); `import dorafp8` in a script still raises."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DORAFP8_")}
    script = tmp_path / "dorafp8"  # as pip writes the console script
    script.write_text("import sys\nfrom dorafp8.__main__ import main\nsys.exit(main())\n")
    for argv, bad in (([sys.executable, "-m", "dorafp8"], {"DORAFP8_NO_PATCHES": "2"}),
                      ([sys.executable, str(script), "selftest"], {"DORAFP8_NO_PATCHES": "yes"}),
                      ([sys.executable, "-m", "dorafp8", "selftest"], {"DORAFP8_BACKEND": "Triton"}),
                      ([sys.executable, "-m", "dorafp8", "check", "{}"], {"DORAFP8_RACE": "true"}),
                      ([sys.executable, str(script), "run", "--", sys.executable, "-c", "print('trainer ran')"],
                       {"DORAFP8_RACE": "yes"})):
        r = subprocess.run(argv, capture_output=True, text=True, timeout=240, cwd=ROOT,
                           env=dict(env, PYTHONPATH=str(ROOT), **bad))
        name, value = next(iter(bad.items()))
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and "trainer ran" not in r.stdout, (argv, bad, r)
        assert r.stderr.startswith(f"dorafp8: {name} must be") and f"got {value!r}" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-c", "import dorafp8"], capture_output=True, text=True, timeout=240,
                       cwd=ROOT, env=dict(env, DORAFP8_NO_PATCHES="2"))
    assert r.returncode == 1 and "ValueError: DORAFP8_NO_PATCHES must be" in r.stderr, r.stderr


@pytest.mark.parametrize("argv", [["runn", "--", "trl", "sft"], ["--quantize", "--", "trl", "sft"], ["doctor"]])
def test_an_unknown_command_is_refused(argv):
    """`dorafp8 runn -- trl sft` (a typo, or `run` left out) printed the installation report and exited 0: the
    trainer never ran and a script went on as if it had. Refused now with the usage, exit 2."""
    r = subprocess.run([sys.executable, "-m", "dorafp8", *argv], capture_output=True, text=True, timeout=240,
                       cwd=ROOT)
    assert r.returncode == 2 and f"unknown command {argv[0]!r}" in r.stderr and "dorafp8 run" in r.stderr, r
    assert "backends on cpu" not in r.stdout, r.stdout


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_is_answered_not_refused(flag, capsys):
    """`dorafp8 --version` printed the report (its first line the version) until unknown commands were refused, then
    stopped a script with 'unknown command' and exit 2. It prints the version, exit 0."""
    import dorafp8
    from dorafp8.__main__ import main

    assert main([flag]) == 0
    assert capsys.readouterr().out.strip() == f"dorafp8 {dorafp8.__version__}"


@pytest.mark.parametrize("command", ["selftest", "check"])
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_every_subcommand_answers_help(command, flag, capsys):
    """`dorafp8 check --help` died with a JSONDecodeError traceback; `dorafp8 selftest --help` ran the selftest (on a
    GPU: minutes of checks) instead of saying what it does. Both print the usage, exit 0, and run nothing."""
    from dorafp8.__main__ import main

    assert main([command, flag]) == 0
    out = capsys.readouterr().out
    assert "dorafp8 selftest" in out and "dorafp8 check SPEC" in out and "selftest:" not in out, out


@pytest.mark.parametrize("argv,said", [
    (["selftest", "cuda:1"], "selftest takes no arguments, got 'cuda:1'"),
    (["check"], "expected SPEC and an optional parent process id, got []"),
    (["check", "{'op': 'dora'}"], "SPEC is not JSON"),
    (["check", "[]"], "SPEC must be a JSON object with the keys"),
    (["check", '{"op": "dora"}'], "missing ['K', 'M', 'N'"),
    (["check", "{}", "my-pid"], "an optional parent process id, got"),
])
def test_bad_arguments_are_refused_by_name(argv, said, capsys):
    """`dorafp8 check` without a SPEC, or a SPEC hand-edited out of a warning's Reproduce command, died with an
    IndexError, JSONDecodeError or KeyError traceback; `dorafp8 selftest cuda:1` ignored the argument and checked the
    current GPU. Each is refused with what was expected, exit 2."""
    from dorafp8.__main__ import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert said in err and "usage:" in err, err


def test_a_hand_run_check_of_a_wrong_candidate_name_is_refused(capsys):
    """A Reproduce command's candidate misspelt ("Triton") was a failed verdict printed as the kernel's own."""
    from dorafp8.__main__ import main
    from dorafp8.backends import race

    spec = race.spec_of("dora", torch.device("cpu"), N=24, K=32, M=40, r=4, cdt=torch.bfloat16, rdt=torch.float32)
    assert main(["check", json.dumps(dict(spec, cands=["Triton"]))]) == 2
    assert "cands must be a non-empty list of ['reference', 'triton'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------- all-linear

@pytest.mark.parametrize("quantize", ["all", "some"])
def test_all_linear_covers_fp8_layers(quantize):
    model = _llama()
    targets = None if quantize == "all" else ["q_proj", "down_proj"]
    n = n_fp8(dorafp8.quantize_model(model, targets))
    assert n == (14 if quantize == "all" else 4)
    pm = get_peft_model(model, LoraConfig(r=4, use_dora=True, target_modules="all-linear"))
    dora_fp8 = {name for name, m in pm.named_modules() if isinstance(m, dorafp8.DoRAFP8Linear)}
    lora = {name for name, m in pm.named_modules() if type(m).__name__ == "Linear" and hasattr(m, "lora_A")}
    assert len(dora_fp8) == n
    assert len(lora) == 14 - n  # the rest: plain PEFT DoRA on the nn.Linear layers that were not quantized
    assert not any("lm_head" in name for name in dora_fp8 | lora)


# ---------------------------------------------------------------------------------------------------- quantize_model

def test_quantize_model_leaves_peft_layers_alone():
    pm = get_peft_model(_llama(), LoraConfig(r=4, use_dora=True, target_modules=LLAMA_TARGETS))
    trainable = sum(p.numel() for p in pm.parameters() if p.requires_grad)
    with pytest.warns(UserWarning, match="convert_peft_model"):
        dorafp8.quantize_model(pm)
    assert n_fp8(pm) == 0  # every linear layer but lm_head is inside a PEFT layer here
    assert sum(p.numel() for p in pm.parameters() if p.requires_grad) == trainable
    assert not any(isinstance(m, FP8Linear) for m in pm.modules())
    pm(input_ids=torch.randint(0, 97, (1, 5)))  # and the model still runs
    with pytest.raises(ValueError, match="matched only PEFT adapter layers.*convert_peft_model"):
        dorafp8.quantize_model(pm, ["q_proj"])


def test_quantize_model_returns_the_model_and_says_what_it_did(capsys):
    """`model = dorafp8.quantize_model(model)` then get_peft_model (it returned the number of layers, and PEFT failed
    with "'int' object has no attribute '__dict__'"); the count and the bytes are in the line it prints, the bytes
    computed here from the original layers: one byte per weight plus a 4-byte scale each, against two in bf16."""
    model = _llama()
    linears = [m for name, m in model.named_modules() if isinstance(m, nn.Linear) and "lm_head" not in name]
    n = sum(m.weight.numel() for m in linears)
    same = model
    model = dorafp8.quantize_model(model)
    assert model is same and n_fp8(model) == len(linears) == 14
    line = capsys.readouterr().out.strip()
    kib = lambda b: f"{b / 1024:.1f} KiB"  # noqa: E731
    assert line == (f"dorafp8.quantize_model: 14 layers to fp8 e4m3: their weights take {kib(n + 4 * 14)} with the "
                    f"scales, against {kib(2 * n)} in bf16 ({kib(4 * n)} in fp32)"), line
    model = get_peft_model(model, LoraConfig(r=4, use_dora=True, target_modules="all-linear"))
    assert sum(isinstance(m, dorafp8.DoRAFP8Linear) for m in model.modules()) == 14
    dorafp8.quantize_model(_llama(), verbose=False)
    assert capsys.readouterr().out == ""


def test_without_patches_peft_errors_lead_to_register_with_peft():
    """DORAFP8_NO_PATCHES=1: PEFT does not know FP8Linear until dorafp8.register_with_peft(). Its error for named
    targets prints the layer, whose repr then names the fix; its all-linear error cannot, so the first fp8 layer made
    while PEFT is installed warns, naming it. After register_with_peft() both build dorafp8 layers, and the repr is
    plain again."""
    out = subprocess.run([sys.executable, "-c", """
import warnings, torch, peft, dorafp8
from peft import LoraConfig, get_peft_model
def net():
    return dorafp8.quantize_model(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)), verbose=False)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    models = [net(), net()]
print([str(w.message) for w in caught if "dorafp8" in str(w.message)])
for m, targets in zip(models, ("all-linear", ["0", "1"])):
    try:
        get_peft_model(m, LoraConfig(r=2, use_dora=True, target_modules=targets))
    except Exception as e:
        print(type(e).__name__, "|", e)
dorafp8.register_with_peft()
for targets in ("all-linear", ["0", "1"]):
    m = get_peft_model(net(), LoraConfig(r=2, use_dora=True, target_modules=targets))
    print(sum(type(x).__name__ == "DoRAFP8Linear" for x in m.modules()), "register_with_peft" in repr(m))
"""], capture_output=True, text=True, timeout=240, cwd=ROOT,
        env=dict(os.environ, DORAFP8_NO_PATCHES="1", HF_HUB_OFFLINE="1"))
    assert out.returncode == 0, out.stderr
    fix = "call dorafp8.register_with_peft() before get_peft_model"
    warned, all_linear, named, *after = out.stdout.strip().splitlines()
    assert warned.count(fix) == 1 and "'all-linear'" in warned, warned  # once per process
    assert all_linear.startswith("NoMatchingPeftModuleError |"), all_linear  # PEFT's own message
    assert named.startswith("ValueError | Target module FP8Linear(") and fix in named, named
    assert after == ["2 False", "2 False"], after


def test_quantize_model_explicit_targets_must_match():
    model = _llama()
    with pytest.raises(ValueError, match=r"target_modules=\['qproj'\] matched no nn.Linear.*'model.layers.0"):
        dorafp8.quantize_model(model, ["qproj"])
    assert not any(isinstance(m, FP8Linear) for m in model.modules())


def test_lossy_per_tensor_quantization_warns_and_per_row_fixes_it():
    """One outlier (1e4 among weights of 0.02) sets the per-tensor scale: most other weights flush to zero, and
    quantize_model says so and names per_row_scale=True, which confines the loss to the outlier's own row."""
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    w[3, 5] = 1e4
    others = w != 1e4

    def rel_err_others(w8, scale):  # the error of everything but the outlier (which dominates the whole norm)
        return ((dorafp8.dequantize_e4m3(w8, scale) - w)[others].norm() / w[others].norm()).item()

    model = nn.Sequential(nn.Linear(256, 256))
    model[0].weight.data = w.clone()
    with pytest.warns(QuantizationWarning, match=r"weight of '0'.*became 0.*per_row_scale=True") as rec:
        dorafp8.quantize_model(model)
    flushed = float(re.search(r"([\d.]+)% of its non-zero values \(\d+ of \d+\) became 0",
                              str(rec[0].message)).group(1))
    assert flushed > 50
    assert rel_err_others(model[0].weight, model[0].scale) > 0.3
    with warnings.catch_warnings():
        warnings.simplefilter("error", QuantizationWarning)
        w8, scale = dorafp8.quantize_e4m3(w, per_row=True)
        assert rel_err_others(w8, scale) < 0.06  # only the outlier's own row still loses its small weights
        rest = torch.arange(256) != 3
        assert ((dorafp8.dequantize_e4m3(w8, scale) - w)[rest].norm() / w[rest].norm()).item() < 0.03
        dorafp8.quantize_e4m3(torch.randn(512, 512))  # ordinary weights do not warn


@pytest.mark.parametrize("n", [256, 1000])  # 1000: one weight of 1e4 among a million weights of 0.02
def test_the_lossy_warning_states_how_many_weights_became_zero_and_the_rows_error(n):
    """The whole tensor's relative error (0.1%) hides the loss, since the outlier keeps its precision and dominates
    the norm: the warning gives the fraction of non-zero weights flushed to zero and the median row's relative error,
    here checked against numbers computed independently."""
    w = torch.randn(n, n, generator=torch.Generator().manual_seed(0)) * 0.02
    w[3, 7] = 1e4
    with pytest.warns(QuantizationWarning) as rec:
        w8, scale = dorafp8.quantize_e4m3(w, name="proj")
    msg = str(rec[0].message)
    # a weight becomes 0 where |w| / scale is at most half e4m3's smallest subnormal (2^-9); ties go to 0 (even)
    ratio = w.double().abs() / (torch.tensor(1e4) / 448).double()
    nonzero, flushed = int((w != 0).sum()), int((ratio <= 2.0 ** -10).sum())
    m = re.search(r"([\d.]+)% of its non-zero values \((\d+) of (\d+)\) became 0", msg)
    assert int(m.group(3)) == nonzero == n * n
    assert abs(int(m.group(2)) - flushed) <= 2  # the code divides in fp32
    assert abs(float(m.group(1)) - 100 * flushed / nonzero) <= 0.06 and flushed / nonzero > 0.7
    err = dorafp8.dequantize_e4m3(w8, scale, torch.float64) - w.double()
    row = (err.norm(dim=1) / w.double().norm(dim=1)).median().item()
    whole = (err.norm() / w.double().norm()).item()
    m = re.search(r"median row's relative error is ([\d.]+)% .*; ([\d.e-]+)% over the whole tensor", msg)
    assert abs(float(m.group(1)) - 100 * row) <= 0.06 and row > 0.5
    assert float(m.group(2)) == pytest.approx(100 * whole, rel=0.05) and whole < 0.002
    assert "weight of 'proj'" in msg and "per_row_scale=True" in msg


def test_non_finite_weight_error_names_the_module():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model[1].weight.data[2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"weight of '1' has non-finite values \(first in row 2\)"):
        dorafp8.quantize_model(model)


def test_fp8_weights_are_taken_losslessly():
    lin = nn.Linear(32, 16)
    w8 = (torch.randn(16, 32) * 40).to(torch.float8_e4m3fn)
    lin.weight.data = w8.clone()
    model = nn.Sequential(lin)
    assert n_fp8(dorafp8.quantize_model(model)) == 1
    f = model[0]
    assert isinstance(f, FP8Linear) and f.scale.item() == 1.0
    assert torch.equal(f.weight.view(torch.uint8), w8.view(torch.uint8))
    assert f.bias.dtype == torch.float32
    scale = torch.rand(16) + 0.5
    g = FP8Linear.from_fp8(w8, scale, dtype=torch.bfloat16)
    assert torch.equal(g.weight.view(torch.uint8), w8.view(torch.uint8)) and torch.equal(g.scale, scale)
    assert g.orig_dtype == torch.bfloat16 and g.bias is None
    x = torch.randn(3, 32)
    ref = x.double() @ (w8.double() * scale.double()[:, None]).T
    within(((g(x).double() - ref).abs().max() / ref.abs().max()).item(), tol(torch.float32), "from_fp8 layer")


# ---------------------------------------------------------------------------------------------------- README claims

def test_adapter_trained_on_fp8_loads_onto_original_and_dequantized_base():
    """docs/GUIDE.md, "Accuracy": onto the dequantized fp8 base the saved adapter is exact; onto the original-precision
    model the outputs move by about the fp8 error of the base."""
    base = _llama(hidden=64)
    original = copy.deepcopy(base.state_dict())
    dorafp8.quantize_model(base, LLAMA_TARGETS)
    pm = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, use_dora=True, target_modules=LLAMA_TARGETS))
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 97, (4, 32), generator=g) for _ in range(2)]
    pm.train()
    for i in range(10):
        pm(input_ids=data[i % 2], labels=data[i % 2]).loss.backward()
        opt.step()
        opt.zero_grad()
    pm.eval()
    test = torch.randint(0, 97, (8, 32), generator=g)
    with torch.no_grad():
        ref = pm(input_ids=test).logits
    fp8 = {n.replace("base_model.model.", "").replace(".base_layer", ""): m
           for n, m in pm.named_modules() if isinstance(m, FP8Linear)}
    with tempfile.TemporaryDirectory() as d:
        pm.save_pretrained(d)
        outs = {}
        for kind in ("original", "dequantized"):
            model = _llama(hidden=64)
            model.load_state_dict(original)
            if kind == "dequantized":
                for name, mod in model.named_modules():
                    if name in fp8:
                        mod.weight.data = fp8[name].dequantize()
            with torch.no_grad():
                outs[kind] = PeftModel.from_pretrained(model, d).eval()(input_ids=test).logits
    rel = {k: ((v - ref).norm() / ref.norm()).item() for k, v in outs.items()}
    agree = {k: (v.argmax(-1) == ref.argmax(-1)).float().mean().item() for k, v in outs.items()}
    within(rel["dequantized"], tol(torch.float32), "logits onto the dequantized base")
    assert agree["dequantized"] == 1.0, (rel, agree)
    assert 1e-3 < rel["original"] < 1e-1 and agree["original"] > 0.8, (rel, agree)


def test_quantize_model_warns_of_an_exclude_that_names_no_module():
    """exclude_modules=['down_projs'] (a typo) left down_proj in fp8 without a word: a warning names the stray name
    (as PEFT warns of its own exclude_modules; an error would break one exclude list shared by several models); a
    name that is there keeps its layers dense, and no warning is given for it."""
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))
    with pytest.warns(UserWarning, match=r"exclude_modules: \['down_projs'\] matched no module of the model"):
        dorafp8.quantize_model(model, exclude_modules=["down_proj", "down_projs"], verbose=False)
    assert type(model.model.layers[0].mlp.down_proj) is nn.Linear and n_fp8(model) == 6
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dorafp8.quantize_model(model, exclude_modules=["down_proj"], verbose=False)
    assert type(model.model.layers[0].mlp.down_proj) is nn.Linear and n_fp8(model) == 6


def test_demo_prints_what_a_user_decides_on():
    out = _run_python("import dorafp8.demo as d; d.main(['--steps', '3', '--no-plot'])")
    assert "backends on cpu: auto -> native" in out
    assert "dorafp8 backend: native" in out
    assert re.search(r"^\s+2\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+$", out, re.M), out  # the loss table: 4 curves
    # the figure the README quotes, with what size to expect: PEFT's own curve under one-ulp changes of its weights
    same = re.search(r"same \(dequantized fp8\) weights: max relative loss difference (\S+) over the 3 steps "
                     r"\((\S+) at step 0", out)
    yardstick = re.search(r"PEFT against itself with its base weights moved by one fp32 ulp differs by (\S+)\.", out)
    assert same and yardstick, out
    over_steps, step0, ulp = float(same.group(1)), float(same.group(2)), float(yardstick.group(1))
    f32 = tol(torch.float32)
    within(step0, f32, "demo: loss at step 0 against PEFT's")  # the same fp32 computation in another order
    # training amplifies a rounding difference as it amplifies the yardstick's one-ulp change of the weights (README
    # quotes both); 10x room over the larger of the yardstick and fp32's tolerance
    within(over_steps, 10 * max(ulp, f32), "demo: loss over the steps against PEFT's")
    within(ulp, 10 * f32, "demo: the yardstick")  # one ulp, amplified by 3 steps: fp32 rounding, not an fp8 error
    assert "W8A8 vs W8A16" in out
    assert "pictures:" not in out
    assert "NOT speed claims" in out
    mem = re.search(r"one 4096 x 4096 layer: peak of a step, 8 tokens\s+([\d.]+) MiB\s+([\d.]+) MiB", out)
    assert mem, out
    peft_mib, ours_mib = map(float, mem.groups())
    assert ours_mib < peft_mib / 4, out  # measured: PEFT forms dense [4096, 4096] temporaries, dorafp8 does not


def _assert_png(path: Path, min_size=(300, 400)):
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    import matplotlib.image

    h, w = matplotlib.image.imread(path).shape[:2]
    assert h >= min_size[0] and w >= min_size[1], (path, h, w)


@pytest.mark.parametrize("steps", ["0", "2"])
def test_demo_refuses_too_few_steps_naming_the_option(steps, capsys):
    """--steps below 3 is refused naming the option and its minimum (it was raised to 3 without a word)."""
    from dorafp8 import demo

    with pytest.raises(SystemExit) as exc:
        demo.main(["--steps", steps, "--no-plot", "--no-layer"])
    assert exc.value.code == 2
    assert f"--steps must be at least 3 (step 1 measures the memory, the others the time per step), got {steps}" \
        in capsys.readouterr().err


def test_demo_writes_its_pictures(tmp_path):
    """By default the demo draws the loss curves and the measured memory next to each other in the current
    directory, and says where."""
    pytest.importorskip("matplotlib")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-m", "dorafp8.demo", "--steps", "3", "--hidden", "64", "--no-layer"],
                         capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path, check=False)
    assert out.returncode == 0, out.stderr
    assert "pictures: dorafp8_demo.png (loss curves and their differences), dorafp8_demo_memory.png" in out.stdout
    _assert_png(tmp_path / "dorafp8_demo.png")
    _assert_png(tmp_path / "dorafp8_demo_memory.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dorafp8_demo.png", "dorafp8_demo_memory.png"]


def test_demo_pictures_without_matplotlib(tmp_path):
    """Without matplotlib the demo says so in one line and goes on."""
    out = _run_python(f"""
import sys
sys.modules['matplotlib'] = None  # what an interpreter without it sees
from dorafp8 import demo
demo._pictures({str(tmp_path / 'x.png')!r}, {{}}, [], [], '', '')
print('went on')
""")
    assert out.strip().splitlines() == ["no pictures: matplotlib is not installed (pip install matplotlib)",
                                        "went on"], out
    assert not any(tmp_path.iterdir())
    from dorafp8.demo import plot_paths

    assert plot_paths("a/b") == (Path("a/b.png"), Path("a/b_memory.png"))
    assert plot_paths("docs/img/demo.png") == (Path("docs/img/demo.png"), Path("docs/img/demo_memory.png"))


def test_doc_figures_script_writes_its_pictures(tmp_path):
    """docs/figures/make_figures.py draws docs/img/dataflow.png and save_load.png (here into tmp_path); it checks the
    kernel names it shows against the sources and takes the checkpoint formats from dorafp8.checkpoint."""
    pytest.importorskip("matplotlib")
    out = subprocess.run([sys.executable, str(ROOT / "docs" / "figures" / "make_figures.py"), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=240, cwd=tmp_path, check=False)
    assert out.returncode == 0, out.stderr
    for name in ("dataflow.png", "save_load.png"):
        _assert_png(tmp_path / name, min_size=(600, 1000))
        assert (tmp_path / name).stat().st_size < 200_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dataflow.png", "save_load.png"]


def test_project_refers_to_nothing_outside_its_tree():
    tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    offenders = []
    for name in tracked:
        path = ROOT / name
        if path.suffix in {".py", ".md", ".sh", ".cu", ".cpp", ".h", ".toml", ".txt"} or name == ".ci/run":
            text = path.read_text(errors="ignore")
            if any(ref in text for ref in ("../" + "shared", "shared" + "/docs")):  # split: not to match this file
                offenders.append(name)
    assert offenders == [], offenders


def test_readme_opens_with_two_commands_that_ci_runs():
    """Command 1 installs what the demo needs (the `demo` extra: PEFT, transformers, matplotlib; it installed the test
    suite's world, 6 GB and 8 minutes) and runs it; command 2 installs the test extras and runs the tests."""
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        tomllib = pytest.importorskip("tomli")
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1).strip().splitlines()
    assert len(block) == 2 and "dorafp8.demo" in block[0] and "pytest tests" in block[1]
    assert '-e ".[demo]"' in block[0] and "[test]" not in block[0] and '-e ".[test]"' in block[1]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert sorted(extras["demo"]) == ["matplotlib", "peft>=0.18", "transformers>=4.50"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "README.md" in ci and "-W ignore" not in ci and "DORAFP8_REQUIRE_CUDA_EXT=1" in ci


def test_readme_has_no_link_a_package_index_breaks():
    """README.md is also the package's page on a package index, shown without the repository: a relative link or
    image there points nowhere, so the README names pages by their path (docs/WRITING_DOCS.md)."""
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]*)\)", readme)
    assert [t for t in targets if not t.startswith(("https://", "http://"))] == []
    assert "<img" not in readme and "src=" not in readme
