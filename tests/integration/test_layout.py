"""The package's architecture, checked (docs/ARCHITECTURE.md): every module imports on its own, imports go one way down
the layers (so there is no cycle), and no module takes a private name from another module or a private module of
another package.

The import graph is read from the source (every `import` / `from ... import`, also those inside functions: a lazy
import is still a dependency), so the check costs no import and sees code paths the tests do not run."""

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "dorafp8"

# The layers, bottom up (docs/ARCHITECTURE.md). A module may import modules of its own layer (the graph must still be
# acyclic) and of the layers below; never above. Subpackages are named by their prefix.
LAYERS = [
    ("recipe", ["dorafp8._deps", "dorafp8._env", "dorafp8.quant", "dorafp8._fp8_cast"]),
    ("backends", ["dorafp8.backends", "dorafp8.triton_kernels"]),
    ("ops", ["dorafp8.ops"]),
    ("modules", ["dorafp8.norm_cache", "dorafp8.nn", "dorafp8.merge"]),
    ("peft", ["dorafp8.peft", "dorafp8.lycoris", "dorafp8.onetrainer"]),
    ("files", ["dorafp8.checkpoint"]),
    ("integration", ["dorafp8.distributed", "dorafp8._install", "dorafp8.launcher", "dorafp8._memory", "dorafp8.demo",
                     "dorafp8.kernel_report",
                     "dorafp8.__main__", "dorafp8"]),
]


def _modules() -> dict[str, Path]:
    """module name -> file, for dorafp8/ and triton_kernels/ (installed as dorafp8.triton_kernels)."""
    out = {}
    for base, prefix in ((PKG, "dorafp8"), (ROOT / "triton_kernels", "dorafp8.triton_kernels")):
        for f in sorted(base.rglob("*.py")):
            parts = list(f.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([prefix] + parts)] = f
    return out


MODULES = _modules()
EXTENSIONS = {"dorafp8._C"}  # compiled (csrc/), imports nothing of dorafp8


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(importer: str, level: int, module: str | None) -> str:
    base = importer.split(".")
    if not _is_package(importer):
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _imports(name: str):
    """(target module, imported name or None, line) for every dorafp8 import in module `name`."""
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("dorafp8") and a.name not in EXTENSIONS:
                    yield a.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(name, node.level, node.module) if node.level else (node.module or "")
            if not target.startswith("dorafp8"):
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in EXTENSIONS:
                    continue
                if sub in MODULES:  # `from . import reference`: the submodule itself
                    yield sub, None, node.lineno
                else:
                    yield target, a.name, node.lineno


def _owner(target: str) -> str:
    """The module a dotted import target names (a module, or a name inside the nearest module)."""
    while target not in MODULES:
        target = target.rpartition(".")[0]
    return target


def _layer(name: str) -> int:
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    assert best is not None, (f"{name} is in no layer of tests/integration/test_layout.py (and docs/ARCHITECTURE.md): "
                              "add it")
    return best


def _graph() -> dict[str, set]:
    g = {m: set() for m in MODULES}
    for m in MODULES:
        for target, _, _ in _imports(m):
            dep = _owner(target)
            if dep != m:
                g[m].add(dep)
    return g


def test_imports_go_down_the_layers():
    up = []
    for m in MODULES:
        for target, _, line in _imports(m):
            dep = _owner(target)
            if dep != m and _layer(dep) > _layer(m):
                up.append(f"{m} (layer {LAYERS[_layer(m)][0]}) imports {dep} (layer {LAYERS[_layer(dep)][0]}), "
                          f"line {line}")
    assert not up, "imports that reach up a layer:\n" + "\n".join(up)


def test_no_import_cycle():
    g = _graph()
    # A package imports its own submodules (to re-export them), and they import siblings, never their package: an
    # edge from a module to a package that contains it would be the cycle this test exists to catch.
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(g[m]):
            if state.get(d) == "open":
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = "done"

    for m in sorted(g):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def _reach(start: str) -> set:
    g, seen, todo = _graph(), set(), [start]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(g[m])
    return seen


# Each Triton launcher module (triton_kernels/ installed as dorafp8.triton_kernels) and the CUDA backend's adapter
# over the compiled csrc/ kernels (dorafp8._C).
KERNEL_MODULES = ["dorafp8.triton_kernels." + m for m in ("forward", "dgrad", "backward", "lowrank", "weight_norm",
                                                          "gemm", "dequant", "dequant_micro")] + ["dorafp8.backends.cuda"]


@pytest.mark.parametrize("op", ["dorafp8.ops.linear", "dorafp8.ops.conv"])
def test_an_op_reaches_every_kernel_by_plain_imports(op):
    """An op's kernel is found by reading: a chain of plain `import` statements (no string table, no importlib) runs
    from the op's module to each kernel module, and the CUDA adapter imports the extension built from csrc/."""
    reached = _reach(op)
    backends = {"dorafp8.triton_kernels"} | {f"dorafp8.backends.{b}" for b in ("cublas", "cuda", "native", "reference")}
    assert "dorafp8.backends" in reached and not backends - _graph()["dorafp8.backends"], (
        "the registry (dorafp8/backends/__init__.py) imports each backend's module itself")
    assert not [k for k in KERNEL_MODULES if k not in reached], sorted(set(KERNEL_MODULES) - reached)
    cuda = ast.parse(MODULES["dorafp8.backends.cuda"].read_text())
    assert any(isinstance(n, ast.Import) and any(a.name == "dorafp8._C" for a in n.names) for n in ast.walk(cuda))


def test_no_private_names_across_modules():
    bad = []
    for m in MODULES:
        for target, imported, line in _imports(m):
            dep = _owner(target)
            if dep == m:
                continue
            if imported is not None and imported.startswith("_") and not imported.startswith("__"):
                bad.append(f"{m}:{line} imports the private name {imported} of {dep}")
            # A private module (_x) is internal to the package that holds it: usable from that package and below.
            leaf = dep.rpartition(".")[2]
            if leaf.startswith("_") and not leaf.startswith("__"):
                holder = dep.rpartition(".")[0]
                if not (m == holder or m.startswith(holder + ".")):
                    bad.append(f"{m}:{line} imports {dep}, private to {holder}")
    assert not bad, "\n".join(bad)


def test_every_module_imports_on_its_own():
    """Each module in a process of its own, first thing: an import that only works after another module was imported
    (an order dependence, or a cycle broken by luck) fails here. Modules whose optional dependency is missing are
    said so by name, not skipped silently. The processes are forked from one that imported torch and numpy and
    nothing else (tests/integration/_import_alone.py says why that keeps the check)."""
    optional = {"dorafp8.peft": "peft", "dorafp8.hf_quantizer": "transformers", "dorafp8.triton_kernels": "triton",
                "dorafp8.lycoris": "lycoris"}
    names = []
    for m in MODULES:
        need = next((dep for p, dep in optional.items() if m == p or m.startswith(p + ".")), None)
        if need is not None and __import__("importlib").util.find_spec(need) is None:
            continue
        if m.endswith(".__main__") and m != "dorafp8.__main__":
            continue  # a program: importing it runs it (python -m dorafp8.kernel_report compiles every kernel)
        names.append(m)
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("_import_alone.py")), *names, "--jobs",
                        str(max(1, min(4, os.cpu_count() or 1)))], capture_output=True, text=True, env=env,
                       timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = json.loads(r.stdout.strip().splitlines()[-1])
    assert sorted(results) == sorted(names), r.stdout[-3000:]
    failed = [f"{n}: {err}" for n, err in results.items() if err]
    assert not failed, "modules that do not import on their own:\n" + "\n".join(failed)
    assert len(names) >= 30


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_size(name):
    """No file over about 500 lines without a reason written at its top (a line starting `Long because`)."""
    text = MODULES[name].read_text()
    n = text.count("\n")
    if n > 520:
        head = text[:3000]
        assert "Long because" in head, f"{MODULES[name].relative_to(ROOT)} has {n} lines and no 'Long because' reason"


def test_module_docstrings_are_short():
    """A module (dorafp8/, triton_kernels/, csrc/) opens with what it is for, in at most ~8 lines (10 allowed); its
    rationale and history go to docs/ARCHITECTURE.md ("Design notes, by module") or docs/INSPECT.md."""
    long = []
    for path in sorted([*MODULES.values(), *(ROOT / "csrc").glob("*.py")]):
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        if doc and len(doc.splitlines()) > 10:
            long.append(f"{path.relative_to(ROOT)}: {len(doc.splitlines())} lines")
    assert not long, "module docstrings over 10 lines:\n" + "\n".join(long)


def _pyproject() -> dict:
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _setup_call() -> ast.Call:
    calls = [n for n in ast.walk(ast.parse((ROOT / "setup.py").read_text()))
             if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setup"]
    assert len(calls) == 1, "setup.py should call setup() once"
    return calls[0]


def test_pyproject_ships_every_package():
    """A subpackage missing from pyproject.toml's `packages` works in an editable install and is absent from a wheel;
    triton_kernels/ and csrc/ install under dorafp8, and the kernel report's CUDA sources ship with csrc/."""
    import fnmatch

    tool = _pyproject()["tool"]["setuptools"]
    listed = set(tool["packages"])
    assert tool["package-dir"] == {"dorafp8": "dorafp8", "dorafp8.triton_kernels": "triton_kernels",
                                   "dorafp8.csrc": "csrc"}
    packages = {m for m in MODULES if _is_package(m)}
    listed -= {"dorafp8.csrc"}  # csrc/ shipped as data for the kernel report (no Python package)
    assert packages == listed, f"missing: {sorted(packages - listed)}; extra: {sorted(listed - packages)}"
    # every kernel file and header the report compiles, and binding.cpp, which the build on first use of
    # backend="cuda" needs too (.py files ship as modules)
    patterns = tool["package-data"]["dorafp8.csrc"]
    csrc = ROOT / "csrc"
    data = [f.relative_to(csrc).as_posix() for f in csrc.rglob("*") if f.suffix in (".cu", ".cuh", ".h", ".cpp")]
    assert data and all(any(fnmatch.fnmatch(f, p) for p in patterns) for f in data), (data, patterns)
    # the metadata has one home: setup.py passes setup() the extension and its build commands only
    assert {k.arg for k in _setup_call().keywords} <= {"ext_modules", "cmdclass"}


def test_one_opt_out_for_what_import_changes_outside_dorafp8():
    """DORAFP8_NO_PATCHES=1: `import dorafp8` leaves DDP, PEFT and FSDP2 as they are (dorafp8/_install.py); without it
    all three are patched (FSDP2 when it is imported, which `import dorafp8` does not do)."""
    pytest.importorskip("peft")
    code = ("import sys, dorafp8\n"
            "fsdp_before = dorafp8.distributed.FSDP_PARAM_MODULE in sys.modules\n"
            "import peft, torch.nn.parallel.distributed as d\n"
            "from peft.tuners.lora.model import LoraModel\n"
            "import torch.distributed.fsdp\n"
            "fsdp = sys.modules[dorafp8.distributed.FSDP_PARAM_MODULE]\n"
            "print(fsdp_before, LoraModel._create_new_module.__module__.startswith('dorafp8'),"
            " hasattr(d._sync_module_states, '_dorafp8_orig'),"
            " hasattr(fsdp.FSDPParam.init_dtype_attrs, '_dorafp8_orig'))\n")
    for opt_out, want in (("1", "False False False False"), ("0", "False True True True")):
        env = dict(os.environ, DORAFP8_NO_PATCHES=opt_out, PYTHONWARNINGS="ignore")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip().splitlines()[-1] == want, (opt_out, r.stdout)


def test_the_version_has_one_home():
    """pyproject.toml takes the version from dorafp8.__version__, a literal that setuptools reads from the source
    without importing dorafp8 (which imports torch); the installed metadata says the same; there is no second copy."""
    import importlib.metadata

    import dorafp8

    project = _pyproject()["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert _pyproject()["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "dorafp8.__version__"}
    assigns = [n for n in ast.parse((PKG / "__init__.py").read_text()).body if isinstance(n, ast.Assign)
               and any(getattr(t, "id", None) == "__version__" for t in n.targets)]
    assert len(assigns) == 1 and ast.literal_eval(assigns[0].value) == dorafp8.__version__
    assert importlib.metadata.version("dorafp8") == dorafp8.__version__
    setup_py = ast.parse((ROOT / "setup.py").read_text())
    assert dorafp8.__version__ not in {n.value for n in ast.walk(setup_py) if isinstance(n, ast.Constant)}


def test_required_versions_are_the_tested_ones():
    """pyproject.toml requires, as the oldest torch and Triton, the ones CI's version matrix tests (.ci/version_matrix.sh
    pins them in its oldest leg), which are those dorafp8/_deps.py warns about or refuses below; README says so. The
    same for peft (its extras; _deps.py refuses fp8 layers on an older one)."""
    from dorafp8._deps import OLDEST_TESTED

    torch_min, triton_min, peft_min = (".".join(map(str, OLDEST_TESTED[d])) for d in ("torch", "triton", "peft"))
    project = _pyproject()["project"]
    assert f"torch>={torch_min}" in project["dependencies"]
    assert project["optional-dependencies"]["triton"] == [f"triton>={triton_min}"]
    assert all(f"peft>={peft_min}" in project["optional-dependencies"][x] for x in ("peft", "demo", "test"))
    matrix = (ROOT / ".ci" / "version_matrix.sh").read_text()
    assert f"torch=={torch_min}.0 triton=={triton_min}.0" in matrix
    assert f"torch {torch_min}" in (ROOT / "README.md").read_text() and f"Triton {triton_min}" in (
        ROOT / "README.md").read_text()


def _source_copy(tmp_path) -> Path:
    """What an sdist or a wheel is built from (the files pyproject.toml and setup.py read), copied to tmp_path/src
    without build products."""
    src = tmp_path / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.so", "_build_info.json", "*.egg-info", "build", "dist")
    src.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("dorafp8", "triton_kernels", "csrc"):
        shutil.copytree(ROOT / name, src / name, ignore=skip)
    return src


def test_sdist_and_wheel_ship_the_license_and_the_cuda_sources(tmp_path):
    """LICENSE (Apache-2.0) is in the sdist and in the wheel's .dist-info, and both say Apache-2.0 in their metadata;
    built as a maintainer publishes them (setup.py sdist; pip wheel, here without build isolation: no index). The
    wheel also ships every source the CUDA extension's build on first use reads, and the note of its own build."""
    import tarfile
    import zipfile

    pytest.importorskip("setuptools")
    assert (ROOT / "LICENSE").read_text().split()[:5] == ["Apache", "License", "Version", "2.0,", "January"]
    src = _source_copy(tmp_path)
    env = dict(os.environ, DORAFP8_SKIP_CUDA_BUILD="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    for cmd in ([sys.executable, "setup.py", "-q", "sdist", "-d", "dist"],
                [sys.executable, "-m", "pip", "wheel", ".", "-q", "--no-deps", "--no-build-isolation", "-w", "dist"]):
        r = subprocess.run(cmd, cwd=src, capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (sdist,), (wheel,) = (src / "dist").glob("*.tar.gz"), (src / "dist").glob("*.whl")
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
        pkg_info = t.extractfile(next(n for n in t.getnames() if n.endswith("/PKG-INFO"))).read().decode()
    assert "LICENSE" in names, sorted(names)
    with zipfile.ZipFile(wheel) as z:
        # everything the CUDA extension's build on first use reads (dorafp8/backends/cuda_build.py)
        shipped = {n.removeprefix("dorafp8/csrc/") for n in z.namelist() if n.startswith("dorafp8/csrc/")}
        csrc = ROOT / "csrc"
        assert {f.relative_to(csrc).as_posix() for f in csrc.rglob("*") if f.is_file() and f.suffix in (
            ".cpp", ".cu", ".cuh", ".h", ".py")} <= shipped, shipped
        assert '"cuda_extension": "DORAFP8_SKIP_CUDA_BUILD=1' in z.read("dorafp8/_build_info.json").decode()
        dist_info = next(n.split("/")[0] for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        assert f"{dist_info}/licenses/LICENSE" in z.namelist(), z.namelist()
        assert z.read(f"{dist_info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
        metadata = z.read(f"{dist_info}/METADATA").decode()
    for meta in (pkg_info, metadata):
        assert "License-Expression: Apache-2.0" in meta.splitlines() and "License-File: LICENSE" in meta.splitlines()


def test_an_isolated_build_notes_the_build_on_first_use():
    """An isolated build (a published wheel, `pip install dorafp8-*.tar.gz`) has no torch, so setup.py skips the
    extension; its note, baked into the build and repeated by `python -m dorafp8` and the CUDA backend, says that
    backend='cuda' builds it on first use, and names no command that needs a checkout (it said `pip install -e .
    --no-build-isolation`)."""
    code = ("import json, sys, runpy, setuptools\n"
            "sys.modules['torch'] = None\n"  # what an isolated build environment has
            "setuptools.setup = lambda **kw: None\n"
            "g = runpy.run_path('setup.py')\n"
            "ext, _, _, note = g['_cuda_extension']()\n"
            "start = g['start']  # the run's own (the call above finds $CUDA_HOME set to the toolkit it took)\n"
            "print(json.dumps([ext, start, note]))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    ext, start, note = json.loads(r.stdout.strip().splitlines()[-1])
    assert ext == [] and start is None
    assert "backend='cuda' builds it on first use" in note and "pip install" not in note, note


def test_every_variable_read_is_known_and_setup_py_notes_a_misspelt_one():
    """dorafp8/_env.py's KNOWN, the DORAFP8_* names `import dorafp8` and setup.py do not warn of, lists every variable
    the project reads (one missing would be called a typo), and nothing else (a name there is never called one). At
    install, a misspelt name (DORAFP8_CUDA_ARCH=90a built the default archs, unsaid behind pip) goes into the note
    `python -m dorafp8` repeats."""
    from dorafp8._env import KNOWN

    # names in the code that are not variables: binding.cpp's macros, bench/_cases.py's tables, the tests' typo
    not_variables = {"DORAFP8_STR", "DORAFP8_STR_", "DORAFP8_SOURCES", "DORAFP8_BACKENDS", "DORAFP8_PROVIDERS",
                     "DORAFP8_CUDA_ARCH"}
    named = set()
    for d in ("dorafp8", "triton_kernels", "csrc", "bench", "tests", ".ci"):
        for f in [*(ROOT / d).rglob("*"), ROOT / "setup.py"]:
            if f.is_file() and f.suffix in (".py", ".sh", ".cpp", ".cu", ".h", ""):
                named |= set(re.findall(r"DORAFP8_[A-Z0-9_]+", f.read_text(errors="replace")))
    assert named - not_variables == KNOWN

    code = ("import runpy, setuptools\n"
            "setuptools.setup = lambda **kw: None\n"
            "print(runpy.run_path('setup.py')['note'])\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DORAFP8_")}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(env, DORAFP8_SKIP_CUDA_BUILD="1", DORAFP8_CUDA_ARCH="90a"))
    assert r.returncode == 0, r.stderr
    assert "did you mean DORAFP8_CUDA_ARCHS?" in r.stdout and "did you mean DORAFP8_CUDA_ARCHS?" in r.stderr, r


@pytest.mark.parametrize("value", ["", ";"])
def test_cuda_archs_naming_no_arch_builds_what_unset_builds(tmp_path, value):
    """DORAFP8_CUDA_ARCHS set to "" or ";" (a script's "$ARCHS" with ARCHS unset) failed the install with an
    IndexError from gencode, which had no arch; it now builds the archs an unset variable does (csrc/build_spec.py's
    cuda_archs, which the first-use build reads it with too)."""
    toolkit = tmp_path / "cuda"
    (toolkit / "bin").mkdir(parents=True)
    (toolkit / "bin" / "nvcc").write_text("#!/bin/sh\n")
    code = ("import json, runpy, setuptools, torch\n"
            "torch.version.cuda = torch.version.cuda or '13.0'\n"  # a CUDA build of torch (this one may not be)
            "setuptools.setup = lambda **kw: None\n"
            "g = runpy.run_path('setup.py')\n"
            "ext, _, _, note = g['_cuda_extension']()\n"
            "start = g['start']  # the run's own (the call above finds $CUDA_HOME set to the toolkit it took)\n"
            "print(json.dumps([len(ext), note]))\n")
    env = dict(os.environ, CUDA_HOME=str(toolkit), DORAFP8_FORCE_CUDA_BUILD="1", MAX_JOBS="1")
    env.pop("DORAFP8_SKIP_CUDA_BUILD", None)
    env.pop("TORCH_CUDA_ARCH_LIST", None)  # read where DORAFP8_CUDA_ARCHS names none
    built = []
    for archs in (None, value):
        env.pop("DORAFP8_CUDA_ARCHS", None)
        env.update({} if archs is None else {"DORAFP8_CUDA_ARCHS": archs})
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env,
                           timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        built.append(json.loads(r.stdout.strip().splitlines()[-1]))
    assert built[0][0] == 1 and built[1] == built[0], built


def test_setup_py_compiles_the_sources_hash_into_the_extension(tmp_path):
    """setup.py's extension carries the hash of the csrc/ it builds (binding.cpp's dorafp8._C.SOURCES), which
    backends/cuda.py compares with the installation's csrc/: an in-place build left over from before a `git pull`
    is not used (tests/kernels/test_cuda.py, test_an_in_place_build_of_other_sources_is_not_used)."""
    toolkit = tmp_path / "cuda"
    (toolkit / "bin").mkdir(parents=True)
    (toolkit / "bin" / "nvcc").write_text("#!/bin/sh\n")
    code = ("import json, runpy, setuptools, torch\n"
            "torch.cuda.is_available = lambda: True\n"
            "torch.version.cuda = torch.version.cuda or '13.0'\n"
            "setuptools.setup = lambda **kw: None\n"
            "ext, _, _, _ = runpy.run_path('setup.py')['_cuda_extension']()\n"
            "print(json.dumps(ext[0].extra_compile_args['cxx']))\n")
    env = dict(os.environ, CUDA_HOME=str(toolkit))
    env.pop("DORAFP8_SKIP_CUDA_BUILD", None)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    import runpy

    spec = runpy.run_path(str(ROOT / "csrc" / "build_spec.py"))
    cxx = json.loads(r.stdout.strip().splitlines()[-1])
    assert f"-DDORAFP8_SOURCES={spec['sources_hash'](str(ROOT / 'csrc'))}" in cxx, cxx


@pytest.mark.parametrize("cuda_home", ["", "/nonexistent/cuda-11.8"])
def test_setup_py_builds_with_the_toolkit_the_first_use_build_finds(tmp_path, cuda_home):
    """CUDA_HOME set but empty (a Dockerfile's `ENV CUDA_HOME=$CUDA_HOME`) or naming a toolkit since removed: setup.py
    took torch's guess (CUDA_HOME as set; "" fell to nvcc on PATH, which may be a wrapper script outside any toolkit)
    and skipped the extension ("nvcc not found (set CUDA_HOME)"), or built with the wrong toolkit, while the build on
    first use, which looks further, found /usr/local/cuda or the nvcc on PATH. Both now take build_spec.cuda_home."""
    toolkit = tmp_path / "cuda"  # nvcc on PATH
    (toolkit / "bin").mkdir(parents=True)
    (toolkit / "bin" / "nvcc").write_text("#!/bin/sh\n")
    (toolkit / "bin" / "nvcc").chmod(0o755)
    (toolkit / "include").mkdir()
    (toolkit / "include" / "cuda_runtime.h").write_text("")
    code = ("import json, runpy, setuptools, torch\n"
            "torch.cuda.is_available = lambda: True\n"
            "torch.version.cuda = torch.version.cuda or '13.0'\n"
            "setuptools.setup = lambda **kw: None\n"
            "g = runpy.run_path('setup.py')\n"
            "ext, _, _, note = g['_cuda_extension']()\n"
            "start = g['start']  # the run's own (the call above finds $CUDA_HOME set to the toolkit it took)\n"
            "from torch.utils import cpp_extension\n"
            "from dorafp8.backends import cuda_build\n"
            "print(json.dumps([len(ext), note, cpp_extension.CUDA_HOME, str(cuda_build.cuda_home()), start]))\n")
    env = dict(os.environ, CUDA_HOME=cuda_home, PATH=f"{toolkit / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=str(ROOT))
    for name in ("DORAFP8_SKIP_CUDA_BUILD", "DORAFP8_CUDA_ARCHS", "TORCH_CUDA_ARCH_LIST", "CUDA_PATH"):
        env.pop(name, None)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    n_ext, note, setup_home, first_use_home, start = json.loads(r.stdout.strip().splitlines()[-1])
    assert n_ext == 1, note
    assert setup_home == first_use_home == str(toolkit), (setup_home, first_use_home)  # torch's order: PATH's next
    # what the build says (and a failed build's note): the toolkit it took, and the $CUDA_HOME it passed over
    assert f"with the CUDA toolkit in {toolkit}" in start, start
    assert (f"($CUDA_HOME={cuda_home} has no bin/nvcc)" in start) == bool(cuda_home), start


def test_cuda_home_takes_a_windows_toolkit(tmp_path, monkeypatch):
    """A Windows toolkit's compiler is bin/nvcc.exe (the CUDA installer sets CUDA_PATH to it): cuda_home looked for
    bin/nvcc only, so setup.py skipped the extension ('nvcc not found') and the first-use build was refused, although
    torch's own search takes that toolkit."""
    import runpy

    toolkit = tmp_path / "CUDA" / "v12.8"
    (toolkit / "bin").mkdir(parents=True)
    (toolkit / "bin" / "nvcc.exe").write_bytes(b"MZ")
    (toolkit / "include").mkdir()
    (toolkit / "include" / "cuda_runtime.h").write_text("")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setenv("CUDA_PATH", str(toolkit))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    spec = runpy.run_path(str(ROOT / "csrc" / "build_spec.py"))
    assert spec["cuda_home"]() == str(toolkit)


@pytest.mark.parametrize("env, gpu, archs", [
    ({"TORCH_CUDA_ARCH_LIST": "9.0"}, None, ["90"]),
    ({"TORCH_CUDA_ARCH_LIST": "8.9 9.0a;12.0+PTX"}, None, ["89", "90a", "120"]),
    # NGC's containers set it for every build: the archs before 8.9 cannot take the kernels; the GPU at hand is added
    ({"TORCH_CUDA_ARCH_LIST": "7.5 8.0 8.6 9.0+PTX"}, (8, 9), ["90", "89"]),
    # a B300 (sm_103) at hand runs the list's sm_100 cubin: no sm_103 target, which nvcc 12.8 does not know
    ({"TORCH_CUDA_ARCH_LIST": "10.0"}, (10, 3), ["100"]),
    ({"TORCH_CUDA_ARCH_LIST": "8.0;8.6"}, None, None),  # nothing from 8.9 on: not built
    # torch's own names for GPU generations (cpp_extension's named_arches), which it expands before reading the list
    ({"TORCH_CUDA_ARCH_LIST": "Hopper"}, None, ["90"]),
    ({"TORCH_CUDA_ARCH_LIST": "Ampere+Tegra;Ampere Ada"}, None, ["89"]),
    ({"TORCH_CUDA_ARCH_LIST": "Ampere"}, None, None),
    ({"TORCH_CUDA_ARCH_LIST": "9.0", "DORAFP8_CUDA_ARCHS": "100"}, None, ["100"]),  # dorafp8's own wins
    ({"TORCH_CUDA_ARCH_LIST": "native"}, None, "default"),
    ({"DORAFP8_CUDA_ARCHS": ""}, None, "default"),  # set but empty (`ENV DORAFP8_CUDA_ARCHS=$ARCHS`): an IndexError
])
def test_setup_py_builds_for_torch_cuda_arch_list(tmp_path, env, gpu, archs):
    """TORCH_CUDA_ARCH_LIST, torch's switch for every extension it builds (a Docker image's build with no GPU, a
    cluster's login node), was ignored: the extension built the four default archs (minutes more, and a failed build
    under an nvcc that lacks one of them). It is read as torch reads it, keeping the archs the kernels can run on (8.9
    and later), plus the GPU at hand; DORAFP8_CUDA_ARCHS comes first."""
    toolkit = tmp_path / "cuda"
    (toolkit / "bin").mkdir(parents=True)
    (toolkit / "bin" / "nvcc").write_text("#!/bin/sh\n")
    code = ("import json, runpy, setuptools, torch\n"
            f"torch.cuda.is_available = lambda: {gpu is not None}\n"
            f"torch.cuda.device_count = lambda: {int(gpu is not None)}\n"
            f"torch.cuda.get_device_capability = lambda i=None: {gpu}\n"
            "torch.version.cuda = torch.version.cuda or '13.0'\n"
            "setuptools.setup = lambda **kw: None\n"
            "ext, _, _, note = runpy.run_path('setup.py')['_cuda_extension']()\n"
            "print(json.dumps([ext and ext[0].extra_compile_args['nvcc'], note]))\n")
    run_env = dict(os.environ, CUDA_HOME=str(toolkit), DORAFP8_FORCE_CUDA_BUILD="1", **env)
    for name in ("DORAFP8_SKIP_CUDA_BUILD", "DORAFP8_CUDA_ARCHS", "TORCH_CUDA_ARCH_LIST"):
        if name not in env:
            run_env.pop(name, None)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=run_env)
    assert r.returncode == 0, r.stderr[-3000:]
    nvcc, note = json.loads(r.stdout.strip().splitlines()[-1])
    if archs is None:
        assert not nvcc and "TORCH_CUDA_ARCH_LIST" in note and "8.9" in note, note
        return
    import runpy

    spec = runpy.run_path(str(ROOT / "csrc" / "build_spec.py"))
    archs = spec["DEFAULT_CUDA_ARCHS"].split(";") if archs == "default" else archs
    assert nvcc[-2 * len(archs):] == spec["gencode"](archs), nvcc


@pytest.mark.parametrize("failure", ["nvcc of another CUDA major", "nvcc fails"])
def test_a_failed_cuda_build_still_installs(tmp_path, failure):
    """On a GPU machine a build of the optional extension that fails (nvcc of another CUDA major than torch's, which
    torch's BuildExtension refuses; nvcc too old for an arch of the defaults, or any compile error) leaves the install
    standing: the command succeeds without dorafp8._C and its note says why and what serves (it failed the whole
    `pip install`). DORAFP8_FORCE_CUDA_BUILD=1 (CI, first_contact's build step) still fails on it."""
    pytest.importorskip("setuptools")
    torch = pytest.importorskip("torch")
    src = _source_copy(tmp_path)
    toolkit, site = tmp_path / "cuda", tmp_path / "site"
    (toolkit / "bin").mkdir(parents=True)
    site.mkdir()
    major = int((torch.version.cuda or "13.0").split(".")[0])
    release = f"{major + 1}.0" if failure.startswith("nvcc of") else (torch.version.cuda or "13.0")
    nvcc = toolkit / "bin" / "nvcc"
    nvcc.write_text(f"#!/bin/sh\ncase \"$*\" in *--version*) echo 'Cuda compilation tools, release {release}, "
                    f"V{release}.1';; *) echo 'nvcc fatal : Unsupported gpu architecture' >&2; exit 1;; esac\n")
    nvcc.chmod(0o755)
    # a GPU at install time, and torch of a CUDA build (this machine may have neither)
    (site / "sitecustomize.py").write_text(f"import torch\ntorch.cuda.is_available = lambda: True\n"
                                           f"torch.version.cuda = torch.version.cuda or '{major}.0'\n")
    cxx = toolkit / "bin" / "cxx"  # the host compiler's version for torch's checks; a compile fails at once
    cxx.write_text("#!/bin/sh\ncase \"$*\" in *' -c '*|-c*) exit 1;; *) exec c++ \"$@\";; esac\n")
    cxx.chmod(0o755)
    env = dict(os.environ, CUDA_HOME=str(toolkit), PYTHONPATH=str(site), MAX_JOBS="1", CXX=str(cxx),
               PATH=f"{toolkit / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("DORAFP8_SKIP_CUDA_BUILD", None)
    env.pop("DORAFP8_FORCE_CUDA_BUILD", None)
    cmd = [sys.executable, "setup.py", "build_ext", "--inplace"]
    r = subprocess.run(cmd, cwd=src, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "building the CUDA extension" in r.stderr, r.stderr[-3000:]  # it was tried, and failed
    assert not list((src / "dorafp8").glob("_C*.so"))
    note = json.loads((src / "dorafp8" / "_build_info.json").read_text())["cuda_extension"]
    assert "failed to build" in note and "backend='cuda' builds it on first use" in note, note
    assert "failed to build" in r.stderr, r.stderr[-3000:]
    r = subprocess.run(cmd, cwd=src, capture_output=True, text=True, env=dict(env, DORAFP8_FORCE_CUDA_BUILD="1"),
                       timeout=600)
    assert r.returncode != 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_setup_py_writes_nothing_into_the_tree(tmp_path):
    """Running setup.py or asking it for metadata (`python setup.py --version`, pip's metadata steps, an sdist) writes
    no file into the source tree: the note about the CUDA extension (dorafp8/_build_info.json) is a build product,
    which build_ext writes where the extension goes."""
    pytest.importorskip("setuptools")
    import dorafp8

    src = _source_copy(tmp_path)

    def tree():
        return {p.relative_to(src).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
                for p in src.rglob("*") if p.is_file()}

    before = tree()
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    r = subprocess.run([sys.executable, "setup.py", "--version"], cwd=src, capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0 and r.stdout.split()[-1] == dorafp8.__version__, r.stdout + r.stderr
    # pip's steps, each in a process of its own as pip runs them: the metadata, then (for an sdist) the sdist itself
    hook = "import sys\nfrom setuptools import build_meta\ngetattr(build_meta, sys.argv[1])(sys.argv[2])\n"
    for name in ("prepare_metadata_for_build_wheel", "build_sdist"):
        out = tmp_path / name
        out.mkdir()
        r = subprocess.run([sys.executable, "-c", hook, name, str(out)], cwd=src, capture_output=True, text=True,
                           env=env, timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
    after = tree()
    # setuptools' own sdist leaves its dorafp8.egg-info/ (git-ignored) behind; nothing else may appear or change
    changed = sorted(f for f in set(before) | set(after) if before.get(f) != after.get(f)
                     and not f.startswith("dorafp8.egg-info/"))
    assert not changed, changed


def test_docs_name_every_test_file():
    """docs/TESTING.md says what each test file checks: a new test file must be named there, a removed one not."""
    text = (ROOT / "docs" / "TESTING.md").read_text()
    files = sorted(p.name for p in (ROOT / "tests").rglob("test_*.py"))
    assert [f for f in files if f not in text] == []
    named = set(re.findall(r"\btest_\w+\.py\b", text))
    assert sorted(named - set(files)) == []


def test_the_sources_hash_is_of_the_files_a_wheel_ships(tmp_path):
    """setup.py compiles sources_hash(csrc/) into the extension, and backends/cuda.py refuses an extension whose hash
    differs from its installation's csrc/: for a wheel, the files pyproject.toml's package data ships (setuptools'
    glob, which leaves out hidden files). An editor's files in the checkout (Emacs' lock `.#forward.cu`, a dangling
    link; a hidden copy) and stray copies in folders the package data does not ship (csrc/old/forward.cu, a scratch
    common/x.h: hashed by an os.walk before) must not enter the hash, else the wheel's own extension is refused on
    every import (and the lock failed setup.py with FileNotFoundError)."""
    import glob
    import runpy

    spec = runpy.run_path(str(ROOT / "csrc" / "build_spec.py"))
    src = tmp_path / "csrc"
    shutil.copytree(ROOT / "csrc", src, ignore=shutil.ignore_patterns("__pycache__"))
    (src / ".#forward.cu").symlink_to("user@host.1234:1700000000")  # Emacs' lock: a link to nowhere
    (src / ".forward.cu").write_text("// a hidden copy\n")
    (src / "forward.cu~").write_text("// a backup\n")
    (src / "common").rename(tmp_path / "common")  # csrc/common a link (a checkout sharing its headers): a wheel
    (src / "common").symlink_to(tmp_path / "common")  # ships the files, which os.walk did not follow into
    for stray in ("old/forward.cu", "common/scratch.h", "old/common/gemm.cuh"):
        (src / stray).parent.mkdir(parents=True, exist_ok=True)
        (src / stray).write_text("// a stray copy\n")
    shipped = tmp_path / "wheel" / "csrc"
    package_data = _pyproject()["tool"]["setuptools"]["package-data"]["dorafp8.csrc"]
    assert sorted(package_data) == sorted(spec["SOURCE_FILES"])  # the one list, written out twice
    for pattern in package_data:
        for f in glob.glob(pattern, root_dir=src):
            (shipped / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / f, shipped / f)
    assert spec["sources_hash"](str(src)) == spec["sources_hash"](str(shipped))


def test_cuda_archs_reads_the_spellings_users_copy():
    """DORAFP8_CUDA_ARCHS in TORCH_CUDA_ARCH_LIST's spelling ("9.0", "10.0+PTX"), nvcc's ("sm_90a") or space-separated
    went to nvcc as given ("arch=compute_9.0": the build failed mid-way with nvcc's 'Unsupported gpu architecture');
    they now name the archs they mean, and a word that names none is refused naming the variable."""
    import runpy

    spec = runpy.run_path(str(ROOT / "csrc" / "build_spec.py"))
    want = ["90", "90a", "100", "120", "100f"]
    assert spec["cuda_archs"]("9.0;sm_90a 10.0+PTX, 120 10.0f 90") == want
    assert spec["cuda_archs"](";".join(want)) == want
    assert all(re.fullmatch(r"arch=compute_\d+[af]?,code=(sm_\d+[af]?|\[sm_\d+[af]?,compute_\d+[af]?\])", f)
               for f in spec["gencode"](want)[1::2])
    with pytest.raises(ValueError, match=r"DORAFP8_CUDA_ARCHS='Hopper'.*'89;90a;100;120'"):
        spec["cuda_archs"]("Hopper")


def _missing_torch_triton_names(sources: dict[str, str]) -> dict[str, str]:
    """{dotted name: where} for each torch.X.Y / triton.X.Y the sources read that the installed torch and Triton lack.
    A name that exists but needs a GPU to be read (triton.runtime.driver.active) counts as present."""
    import importlib

    import torch
    import triton

    roots, missing = {"torch": torch, "triton": triton}, {}
    for where, text in sources.items():
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.Attribute) or isinstance(node.ctx, ast.Store):
                continue
            parts, inner = [], node
            while isinstance(inner, ast.Attribute):
                parts, inner = [inner.attr] + parts, inner.value
            if not isinstance(inner, ast.Name) or inner.id not in roots:
                continue
            obj, names = roots[inner.id], [inner.id] + parts
            for i, attr in enumerate(parts, 2):
                try:
                    obj = getattr(obj, attr)
                except AttributeError:
                    try:
                        obj = importlib.import_module(".".join(names[:i]))
                    except ImportError:
                        missing.setdefault(".".join(names[:i]), f"{where}:{node.lineno}")
                        break
                except Exception:  # present, but it needs a GPU (a lazy driver)
                    break
    return missing


def test_torch_and_triton_names_exist():
    """Every torch.* / triton.* attribute the package, the Triton kernels and bench/ read exists in the installed torch
    and Triton, also on lines only a GPU runs (the CPU tests never reach them): race.py read the driver version by
    torch._C._cuda_getDriverVersion, which no supported torch has, and a bare except hid it (driver None for every
    driver). The checker itself flags a planted name."""
    assert _missing_torch_triton_names({"planted": "torch.cuda.no_such_call()\ntriton.testing.do_bench\n"}) == {
        "torch.cuda.no_such_call": "planted:1"}
    files = sorted([*MODULES.values(), *(ROOT / "bench").glob("*.py")])
    assert _missing_torch_triton_names({str(f.relative_to(ROOT)): f.read_text() for f in files}) == {}
