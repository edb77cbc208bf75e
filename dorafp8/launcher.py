"""`dorafp8 run [options] -- <command>`: any trainer (llamafactory-cli, trl, OneTrainer, a script), unchanged, run after
`import dorafp8` in its own process, with the options applied to every model it loads (docs/TRAINERS.md). Worker
processes get them through DORAFP8_RUN and a sitecustomize (docs/ARCHITECTURE.md, "dorafp8/launcher.py")."""

from __future__ import annotations

import argparse
import atexit
import functools
import importlib.metadata
import importlib.util
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
import tempfile

from ._env import flag

ENV = "DORAFP8_RUN"
# Heads PEFT trains in full (modules_to_save) for task_type="SEQ_CLS" (TRL's reward trainer, a classifier): in fp8 they
# could not train, and get_peft_model refuses them (dorafp8/peft/register.py), so --quantize leaves them dense.
TRAINED_HEADS = ("classifier", "score")

_SITE = '''"""Written by `dorafp8 run` (dorafp8/launcher.py): dorafp8 in every Python process the command starts, installed
right after that process imports torch, by dorafp8's own import finder (loaded by its path: it imports neither torch
nor dorafp8); then the sitecustomize this one shadows, if any."""
import importlib.util, os, sys


def _install():
    from dorafp8.launcher import install_from_env
    install_from_env()


if os.environ.get("DORAFP8_RUN") and "torch" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("dorafp8._after_import", {finder!r})
    _finder = sys.modules.setdefault(_spec.name, importlib.util.module_from_spec(_spec))
    if _finder.__spec__ is _spec:
        _spec.loader.exec_module(_finder)
    _finder.when_imported("torch", _install)
_here = os.path.dirname(os.path.abspath(__file__))
for _p in sys.path:
    _f = os.path.join(_p or ".", "sitecustomize.py")
    if os.path.abspath(_p or ".") != _here and os.path.isfile(_f):
        exec(compile(open(_f).read(), _f, "exec"), {{"__name__": "sitecustomize", "__file__": _f}})
        break
'''


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dorafp8 run", usage="dorafp8 run [options] -- <the trainer's command>",
        description="Runs a trainer's command unchanged, in this process, with dorafp8 installed (docs/TRAINERS.md).")
    p.add_argument("--quantize", action="store_true",
                   help="put every model from_pretrained loads (transformers, diffusers) in fp8 (quantize_model)")
    p.add_argument("--include-conv", action="store_true", help="with --quantize: the conv layers too")
    p.add_argument("--per-row-scale", action="store_true", help="with --quantize: one scale per output row")
    p.add_argument("--w8a8", action="store_true", help="fp8 activations in the fp8 linear layers' base GEMMs")
    return p


def parse(argv: list[str]) -> tuple[dict, list[str]]:
    """(options, command) from `[options] -- command...` (no `--` needed if the command starts with no dash)."""
    if "--" in argv:
        i = argv.index("--")
        mine, command = argv[:i], argv[i + 1:]
        stray = next((a for a in mine if not a.startswith("-")), None)
        if stray is not None:  # `run --quantize python show.py -- --lr 1`: which part is the command is a guess
            k = mine.index(stray)
            parser().error(f"{' '.join(mine[k:])!r} comes before `--`, and everything after `--` is the command "
                           f"({' '.join(command)!r}); put the whole command after it: dorafp8 run "
                           f"{' '.join(mine[:k] + ['--'] + mine[k:] + command)}")
    else:
        i = next((k for k, a in enumerate(argv) if not a.startswith("-")), len(argv))
        mine, command = argv[:i], argv[i:]
    ns = parser().parse_args(mine)
    if (ns.include_conv or ns.per_row_scale) and not ns.quantize:
        parser().error("--include-conv and --per-row-scale choose how --quantize quantizes; add --quantize")
    if not command:
        parser().error("no command: give the trainer's command after `--`, e.g. "
                       "`dorafp8 run --quantize -- llamafactory-cli train config.yaml`")
    return vars(ns), command


# ---- what runs in every process ------------------------------------------------------------------------------------

_STATE = {"options": None, "quantized": 0, "models": 0, "calls": {}, "own": {}}


def install(options: dict) -> None:
    """dorafp8's integrations in this process, with the launcher's options. Idempotent."""
    if _STATE["options"] is not None:
        return
    if flag("DORAFP8_NO_PATCHES"):
        raise RuntimeError("dorafp8 run installs dorafp8's integrations, and DORAFP8_NO_PATCHES=1 turns them off; "
                           "unset it")
    _STATE["options"] = options
    import dorafp8  # noqa: F401  (its import installs the integrations: dorafp8/_install.py)

    from . import _install

    # the exit report counts the fused calls of PEFT's, LyCORIS's and OneTrainer's layers
    _install.watch("dorafp8.peft", _count_dora_calls, "the exit report does not count the DoRA layers' calls")
    _install.watch("dorafp8.lycoris", _count_lycoris_calls, "the exit report does not count LyCORIS's calls")
    from . import onetrainer

    _count_calls(onetrainer, "fused_forward")  # OneTrainer's DoRAModule calls it per fused forward (module first)
    _count_calls(onetrainer, "own_forward", "own")  # and this on the layers it leaves to OneTrainer
    _hook_loads(options.get("quantize"))
    _install.watch(DEEPSPEED_MULTINODE, _refuse_deepspeed_multinode,
                   "dorafp8 run does not refuse DeepSpeed's multi-node launch, whose workers it cannot reach")
    atexit.register(_report)


DEEPSPEED_MULTINODE = "deepspeed.launcher.multinode_runner"


def _refuse_deepspeed_multinode() -> None:
    """The `deepspeed` launcher starts the workers of a multi-node run (a hostfile of several hosts) through pdsh,
    mpirun or srun, passing on only the variables it exports (PYTHON*, ...): never DORAFP8_RUN, and a PYTHONPATH
    naming this node's temporary sitecustomize. Those workers would run without dorafp8's options (--quantize
    ignored), silently. Every launcher it has for that is a MultiNodeRunner, made only for such a run: refused."""
    cls = sys.modules[DEEPSPEED_MULTINODE].MultiNodeRunner
    orig = cls.__init__
    if hasattr(orig, "_dorafp8_orig"):
        return

    @functools.wraps(orig)
    def __init__(self, args, *rest, **kwargs):
        raise SystemExit(
            f"dorafp8 run: deepspeed is starting a multi-node run (launcher={getattr(args, 'launcher', '?')!r}, "
            f"hostfile={getattr(args, 'hostfile', '?')!r}), whose workers it starts over ssh/MPI/SLURM with only "
            f"the variables it exports, so they would run without dorafp8 run's options (--quantize ignored). "
            f"Run `dorafp8 run [options] -- deepspeed --no_ssh --node_rank <n> ...` on each node instead (or "
            f"torchrun on each node; docs/MULTI_GPU.md)")

    __init__._dorafp8_orig = orig
    cls.__init__ = __init__


def install_from_env() -> None:
    """install() with the options `dorafp8 run` put in the environment (the sitecustomize it writes calls this)."""
    raw = os.environ.get(ENV)
    if raw:
        install(json.loads(raw))


def _hook_loads(quantize: bool) -> None:
    """transformers' loads always (a quantized checkpoint is held by dorafp8's layers: _on_load), ModelOpt exports by
    load_fp8_checkpoint (diffusers has a ModelOpt quantizer of its own, and a hub id would cost it requests for files
    it never asks for); diffusers' under --quantize. save_hooks' from_pretrained wrapper calls them."""
    from .checkpoint import save_hooks

    save_hooks.LOAD_HOOKS["PreTrainedModel"] = (_before_load, _on_load)
    if quantize:
        save_hooks.LOAD_HOOKS["ModelMixin"] = (None, _on_load)


def _before_load(klass, args, kwargs):
    """Says when the caller asks transformers to dequantize a quantized checkpoint (LLaMA-Factory does for every fp8
    one: FineGrainedFP8Config(dequantize=True)), which leaves dorafp8 nothing to hold; then _modelopt_load."""
    qc = kwargs.get("quantization_config")
    qd = qc if isinstance(qc, dict) else (qc.to_dict() if hasattr(qc, "to_dict") else {})
    if qd.get("dequantize"):
        then = ("--quantize puts the dense weights in fp8 again, one scale per tensor: not the file's bytes and "
                "scales" if _STATE["options"].get("quantize") else "the model stays dense")
        print(f"dorafp8 run: {klass.__name__}.from_pretrained(quantization_config=... quant_method="
              f"{qd.get('quant_method')!r}, dequantize=True): transformers dequantizes the checkpoint while it "
              f"loads, so dorafp8 cannot hold its fp8 weights; {then}. To keep them, build the model on the meta "
              f"device and call dorafp8.load_fp8_checkpoint (docs/TRAINERS.md)", file=sys.stderr)
    return _modelopt_load(klass, args, kwargs)


def _modelopt_load(klass, args, kwargs):
    """A transformers model from a ModelOpt export (a local folder or a hub id) via load_fp8_checkpoint; else None."""
    from .checkpoint import hub

    path = args[0] if args else kwargs.get("pretrained_model_name_or_path")
    found = hub.modelopt_export(path, kwargs)
    # A PEFT adapter whose base is an export: transformers loads the base, then the adapter, in this call: a concrete
    # class given the adapter's path; an Auto class, which found the adapter, gives the base's and the adapter in
    # adapter_kwargs. Neither the export (transformers, no scales) nor the adapter (here) would load right.
    adapter = (kwargs.get("adapter_kwargs") or {}).get("_adapter_model_path")
    if found is None:
        base = hub.adapter_base(path, kwargs)
        if base is None or hub.modelopt_export(base, kwargs) is None:
            return None
        adapter, path = path, base
    if adapter is not None:
        raise ValueError(f"from_pretrained({adapter!r}) is a PEFT adapter whose base model {path!r} is a ModelOpt "
                         f"export, which dorafp8 run loads without the adapter, and transformers without its scales; "
                         f"load the base first, held by dorafp8 (model = from_pretrained({path!r})), then the "
                         f"adapter: PeftModel.from_pretrained(model, {adapter!r})")
    algo, folder = found
    if kwargs.get("variant"):  # transformers would read model.<variant>.safetensors; load_fp8_checkpoint reads others
        raise ValueError(f"from_pretrained({path!r}, variant={kwargs['variant']!r}) of a ModelOpt {algo} export: "
                         f"dorafp8 run loads its model.safetensors (or the shards of its index), not a variant's; "
                         f"drop variant=")
    hub.fetch_weights(path, kwargs)
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, PretrainedConfig

    import dorafp8

    config = kwargs.get("config")  # a config, a path to one (as transformers takes it), else the export's
    if not isinstance(config, PretrainedConfig):
        config = AutoConfig.from_pretrained(config or folder)
        for k, v in kwargs.items():  # config values given to from_pretrained (use_cache=False, ...), as transformers
            if hasattr(config, k) and k not in ("dtype", "torch_dtype"):
                setattr(config, k, v)
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    if dtype == "auto":
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with init_empty_weights():
        model = klass._from_config(config, **({"dtype": dtype} if dtype is not None else {}),
                                   **{k: kwargs[k] for k in ("attn_implementation",) if k in kwargs})
    report = dorafp8.load_fp8_checkpoint(model, folder, dtype=dtype, verbose=False)
    _loaded(klass.__name__, len(report.fp8_layers),
            f"of its ModelOpt {algo} export held by dorafp8 (load_fp8_checkpoint)")
    return model.eval()


def _loaded(name: str, n: int, how: str) -> None:
    """Counts a model whose from_pretrained put n layers in fp8, and says so."""
    _STATE["quantized"] += n
    _STATE["models"] += 1
    print(f"dorafp8 run: {name}.from_pretrained -> {n} layers {how}", file=sys.stderr)


def _on_load(model) -> None:
    """After from_pretrained: quantized layers swapped for dorafp8's (same bytes); dense ones under --quantize."""
    if getattr(model, "dorafp8_checkpoint", None) is not None:  # loaded by _modelopt_load
        return
    if getattr(model, "hf_quantizer", None) is None:
        if _STATE["options"].get("quantize"):
            _quantize(model)
        return
    import dorafp8

    name = type(model).__name__
    try:
        n = dorafp8.from_transformers_fp8(model, act_quant="rowwise" if _STATE["options"].get("w8a8") else None)
    except ValueError as e:  # a layer dorafp8 cannot hold: the model stays as transformers loaded it
        print(f"dorafp8 run: {name} was loaded with a quantization config dorafp8 cannot hold ({e}); left as "
              f"loaded", file=sys.stderr)
        return
    if n:  # else nothing dorafp8 reads (its own DoRAFP8Config's layers are dorafp8's already; bitsandbytes, GPTQ...)
        _loaded(name, n, "of its quantized checkpoint held by dorafp8 (from_transformers_fp8)")


def _quantize(model) -> None:
    import dorafp8
    from .nn import FP8WeightModule

    opts = _STATE["options"]
    before = sum(isinstance(m, FP8WeightModule) for m in model.modules())
    # every module in a head, by its full name: PEFT trains a head module whole, and RoBERTa's `classifier` is a
    # container (dense, out_proj) whose layers' own names are not the head's
    heads = [n for n, _ in model.named_modules() if any(part in TRAINED_HEADS for part in n.split("."))]
    dorafp8.quantize_model(model, include_conv=opts.get("include_conv", False),
                           per_row_scale=opts.get("per_row_scale", False), exclude_modules=heads,
                           act_quant="rowwise" if opts.get("w8a8") else None)
    n = sum(isinstance(m, FP8WeightModule) for m in model.modules()) - before
    _loaded(type(model).__name__, n, "in fp8" + (" (W8A8)" if opts.get("w8a8") else ""))


def _count_calls(owner, attr: str, into: str = "calls") -> None:
    """Counts the calls of owner.attr per object of its first argument (the layer or adapter), for the report: in
    _STATE["calls"] those of dorafp8's fused ops, in _STATE["own"] adapters the trainer computed itself."""
    orig = getattr(owner, attr)
    if hasattr(orig, "_dorafp8_orig"):
        return

    @functools.wraps(orig)
    def counted(layer, *args, **kwargs):
        calls = _STATE[into]
        calls[id(layer)] = calls.get(id(layer), 0) + 1
        return orig(layer, *args, **kwargs)

    counted._dorafp8_orig = orig
    setattr(owner, attr, counted)


def _count_lycoris_calls() -> None:
    lycoris = sys.modules["dorafp8.lycoris"]
    _count_calls(lycoris.FP8LoConModule, "_fused")
    # LyCORIS's own forward runs on the layers that are not dorafp8's (FP8LoConModule has its own): a kohya script's
    # UNet, even with its --fp8_base, whose plain cast comes after LyCORIS built its modules (docs/TRAINERS.md)
    _count_calls(lycoris.LoConModule, "forward", "own")


def _count_dora_calls() -> None:
    from .peft import layer

    _count_calls(layer.DoRAFP8Layer, "forward")
    if _STATE["options"].get("w8a8"):
        _act_quant_new_layers()


def _act_quant_new_layers() -> None:
    """--w8a8 without --quantize: fp8 layers a trainer makes itself take W8A8 as PEFT wraps them."""
    from .nn import FP8Linear
    from .peft import layer

    init = layer.DoRAFP8Layer.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        base = self._fp8_base()
        if isinstance(base, FP8Linear):
            base.act_quant = "rowwise"

    layer.DoRAFP8Layer.__init__ = __init__


def _report() -> None:
    calls, own = _STATE["calls"], _STATE["own"]
    if _STATE["models"] or calls or own:
        print(f"dorafp8 run: {_STATE['quantized']} layers put in fp8 on load; {len(calls)} dorafp8 DoRA/LoRA layers "
              f"ran {sum(calls.values())} forward calls" + (f"; {len(own)} LyCORIS / OneTrainer adapter layers ran "
              f"their own forward, not dorafp8's (not on a dorafp8 fp8 layer)" if own else ""), file=sys.stderr)


# ---- running the command -------------------------------------------------------------------------------------------


def _shebang(path: str) -> bytes:
    """The file's #! line, or b"" (none, or unreadable)."""
    try:
        with open(path, "rb") as f:
            first = f.readline(200)
    except OSError:
        return b""
    return first if first.startswith(b"#!") else b""


def _not_python(name: str, path: str) -> SystemExit:
    return SystemExit(f"dorafp8 run: {name!r} ({path}) is not a Python program, so dorafp8 cannot be installed in its "
                      f"process. Run the Python command it starts under `dorafp8 run` instead")


def _is_python(name: str) -> bool:
    return bool(re.fullmatch(r"python(\d+(\.\d+)?)?(\.exe)?", os.path.basename(name)))


def _this_python(name: str) -> bool:
    """Whether interpreter `name` is this process's: a bare `python`, or this interpreter's own path (no realpath)."""
    if os.sep not in name and (os.altsep is None or os.altsep not in name):
        return True
    try:
        return os.path.abspath(name) == os.path.abspath(sys.executable) or os.path.samefile(
            os.path.dirname(os.path.abspath(name)), os.path.dirname(os.path.abspath(sys.executable)))
    except OSError:
        return False


def _interpreter_flags(args: list[str]) -> list[str]:
    """The interpreter's own flags at the head of `args` (up to the script, -m or -c)."""
    flags, it = [], iter(args)
    for a in it:
        if not a.startswith("-") or a in ("-", "-m", "-c"):
            break
        flags.append(a)
        if a in ("-W", "-X"):  # their value is the next argument
            next(it, None)
    return flags


def _child(argv: list[str], hand_over: bool = False):
    """Runs argv as a child process, reached through _export's sitecustomize (unless hand_over)."""
    def run_child():
        env = None
        if hand_over:
            env = {k: v for k, v in os.environ.items() if k != ENV}
            path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != _STATE.get("site")]
            env["PYTHONPATH"] = os.pathsep.join(path)
        rc = subprocess.call(argv, env=env)
        return 128 - rc if rc < 0 else rc  # killed by signal n: the shell's 128 + n
    return run_child


def _other_python(interp: str, args: list[str], options: dict):
    """`/other/venv/bin/python ...`: handed over to that interpreter's `dorafp8 run`, else refused."""
    path = shutil.which(interp) or interp
    if not os.path.isfile(path):
        raise SystemExit(f"dorafp8 run: no such interpreter {interp!r}")
    probe = subprocess.run([path, "-c", "import importlib.util as u, sys; "
                                        "sys.exit(not all(u.find_spec(m) for m in ('torch', 'dorafp8')))"],
                           capture_output=True)
    if probe.returncode != 0:
        raise SystemExit(f"dorafp8 run: {interp} is another Python than dorafp8's ({sys.executable}) and has no "
                         f"dorafp8 (or no torch) installed, so dorafp8 cannot run in its process; install dorafp8 "
                         f"there and run `{path} -m dorafp8 run -- {path} ...`, or name {sys.executable}")
    flags = [f"--{k.replace('_', '-')}" for k, v in options.items() if v]
    return _child([path, "-m", "dorafp8", "run", *flags, "--", path, *args], hand_over=True)


def _runner(command: list[str], options: dict):
    """A function that runs `command` (in this process unless it needs its own), or a SystemExit saying why not."""
    cmd = list(command)
    if _is_python(cmd[0]):
        if not _this_python(cmd[0]):
            return _other_python(cmd[0], cmd[1:], options)
        cmd = cmd[1:]
        if not cmd:
            raise SystemExit("dorafp8 run: `python` with no script or -m module to run")
        if cmd[0].startswith("-") and cmd[0] not in ("-m", "-c"):
            # interpreter flags (-u, -X dev ...) take a Python of their own, reached through the sitecustomize unless
            # a flag blinds it
            blind = [f for f in _interpreter_flags(cmd) if f in ("-I", "-E", "-S")]
            if blind:
                raise SystemExit(f"dorafp8 run: python {blind[0]} ignores PYTHONPATH or site, through which dorafp8 "
                                 f"reaches the process; leave the flag out")
            return _child([sys.executable, *cmd])
    if cmd[0] == "-m":
        if len(cmd) < 2:
            raise SystemExit("dorafp8 run: -m needs a module name")
        mod, args = cmd[1], cmd[2:]

        def run_module():
            sys.argv = [mod] + args
            sys.path.insert(0, os.getcwd())
            try:
                found = importlib.util.find_spec(mod) is not None
            except (ImportError, ValueError):  # a parent package missing
                found = False
            if not found:
                raise SystemExit(f"dorafp8 run: no module named {mod!r} in this Python ({sys.executable})")
            runpy.run_module(mod, run_name="__main__", alter_sys=True)
        return run_module
    if cmd[0] == "-c":
        if len(cmd) < 2:
            raise SystemExit("dorafp8 run: -c needs the code to run")
        code, args = cmd[1], cmd[2:]

        def run_code():
            sys.argv = ["-c"] + args
            exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
        return run_code
    if cmd[0].startswith("-"):
        raise SystemExit(f"dorafp8 run: {cmd[0]!r} is not a command; options for dorafp8 go before `--`")
    name, args = cmd[0], cmd[1:]
    if name.endswith(".py") or (os.sep in name and os.path.isfile(name)):
        if not os.path.isfile(name):
            raise SystemExit(f"dorafp8 run: no such script {name!r}")
        # a shell script (./start-ui.sh): Python would not parse it. A .py file is Python whatever its #! line
        # (a PEP 723 script's `#!/usr/bin/env -S uv run --script`)
        if not name.endswith(".py") and b"python" not in (first := _shebang(name)) and first:
            raise _not_python(name, os.path.abspath(name))
        return functools.partial(_run_path, name, args)
    eps = importlib.metadata.entry_points(group="console_scripts", name=name)
    if eps:
        ep = next(iter(eps))

        def run_entry_point():
            sys.argv = [name] + args
            return ep.load()()
        return run_entry_point
    path = shutil.which(name)
    if path and b"python" in _shebang(path):
        return functools.partial(_run_path, path, args)
    if path:
        raise _not_python(name, path)
    raise SystemExit(f"dorafp8 run: {name!r} is neither a script, a console_scripts entry point of this Python "
                     f"({sys.executable}) nor a command on PATH; is the trainer installed in this environment?")


def _run_path(path: str, args: list[str]) -> None:
    sys.argv = [path] + args
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    runpy.run_path(path, run_name="__main__")


def _export(options: dict) -> None:
    """The options, and a sitecustomize that applies them, for every Python process the command starts."""
    site = tempfile.mkdtemp(prefix="dorafp8-run-")
    _STATE["site"] = site
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(_SITE.format(finder=os.path.join(os.path.dirname(os.path.abspath(__file__)), "_after_import.py")))
    atexit.register(shutil.rmtree, site, ignore_errors=True)
    os.environ[ENV] = json.dumps(options)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p)


def main(argv: list[str]) -> int:
    """`dorafp8 run ...` (argv: what follows `run`). Returns the command's exit status."""
    options, command = parse(argv)
    run = _runner(command, options)
    install(options)
    _export(options)
    result = run()
    return result if isinstance(result, int) else 0
