"""Build script for dorafp8's optional CUDA C++ extension `dorafp8._C` (csrc/).

The package's metadata (name, version, dependencies, extras, packages, package data) is in pyproject.toml; the
pure-Python package (dorafp8/, plus triton_kernels/ installed as `dorafp8.triton_kernels`) always installs. This
script only decides whether to build the extension and builds it:

  DORAFP8_SKIP_CUDA_BUILD=1   never build it
  DORAFP8_FORCE_CUDA_BUILD=1  build it even when no GPU is visible (CI: nvcc present, no GPU)
  DORAFP8_CUDA_ARCHS="89;90a;100;120"
                              target architectures (the default: Ada, Hopper, datacenter and consumer Blackwell, plus
                              PTX of the oldest portable one)
  TORCH_CUDA_ARCH_LIST="9.0"  torch's, read where DORAFP8_CUDA_ARCHS is not set: its archs from 8.9 on, and the GPU at
                              hand
  MAX_JOBS                    parallel nvcc jobs (default: sized from free memory and cores)

Without torch in the build environment (an isolated `pip install`, a published wheel), without nvcc, or without a GPU
(unless forced) the extension is skipped with a one-line message; the first call that names backend="cuda" then
builds it for the GPU at hand (dorafp8/backends/cuda_build.py, from the same csrc/build_spec.py), and backend="auto"
uses the Triton/reference backends meanwhile. A build that fails (nvcc of another CUDA major than torch's, an arch the
nvcc does not know, a compile error) is said and noted, and the install goes on without the extension; under
DORAFP8_FORCE_CUDA_BUILD=1 it fails the install.

Running or importing this file writes nothing (`python setup.py --version`, sdist, pip's metadata step): the note of
what was decided is a build product, written by build_ext (below).
"""

import json
import os
import re
import runpy
import sys

import setuptools
from setuptools import setup
from setuptools.command.build import build as _build
from setuptools.command.build_ext import build_ext as _build_ext

# pyproject.toml's `license` / `license-files` (PEP 639) need setuptools 77, which an isolated build gets from
# [build-system]; a build without isolation (README's install) uses the environment's, and an older one fails with a
# schema error that does not say which setuptools is needed.
if int(setuptools.__version__.split(".")[0]) < 77:
    sys.exit(f"dorafp8 setup: setuptools {setuptools.__version__} cannot read pyproject.toml's license fields "
             f"(PEP 639); install setuptools>=77 (pip install -U 'setuptools>=77'), then install dorafp8 again")

HERE = os.path.dirname(os.path.abspath(__file__))
NOTE_FILE = "_build_info.json"  # read by dorafp8/backends/cuda.py's build_note()

# The CUDA kernel files in csrc/ and the flags they are built with: csrc/build_spec.py, read by path (it imports
# nothing), the one copy of them; the kernel report (python -m dorafp8.kernel_report) and the CPU emulator's build
# (tests/kernels/test_cuda_emulated.py) read the same file, which ships with the sources in the wheel (pyproject.toml's
# package data).
BUILD_SPEC = runpy.run_path(os.path.join(HERE, "csrc", "build_spec.py"))
# the package's one reading of its 0 / 1 switches (a "true" refused by name, not read as off), and of the DORAFP8_*
# names it does not know (a misspelt DORAFP8_CUDA_ARCH built the default archs, unsaid)
_ENV = runpy.run_path(os.path.join(HERE, "dorafp8", "_env.py"))
_flag = _ENV["flag"]
CUDA_SOURCES = BUILD_SPEC["CUDA_SOURCES"]
DEFAULT_CUDA_ARCHS = BUILD_SPEC["DEFAULT_CUDA_ARCHS"]


def _say(msg):
    print(f"dorafp8 setup: {msg}", file=sys.stderr)


def _skip(why):
    """_cuda_extension's answer when the extension is not built: no extension, setuptools' own build_ext (which only
    writes the note, see _noting), nothing to say at the start."""
    return [], _build_ext, None, why


def _archs(torch):
    """(the archs to build, how they were chosen, or why none): DORAFP8_CUDA_ARCHS, else TORCH_CUDA_ARCH_LIST (torch's
    switch for every extension it builds, "8.9 9.0a;12.0+PTX"; unset or "native": the default) as far as the kernels
    run there (8.9 on: their e4m3 conversions; NGC's containers set it for everything, older archs first) plus the
    GPUs at hand (a list for other machines must not leave out this one), else DEFAULT_CUDA_ARCHS."""
    own = BUILD_SPEC["cuda_archs"](os.environ.get("DORAFP8_CUDA_ARCHS"))  # "" or ";" names none: as unset
    listed = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    if own or listed in ("", "native"):
        return own or DEFAULT_CUDA_ARCHS.split(";"), ""
    # torch's names for GPU generations (cpp_extension's named_arches, "Hopper" -> 9.0), from sm_89 on; the older
    # ones ("Ampere") name nothing the kernels run on, like "8.0"
    named = {"Ada": "8.9", "Hopper": "9.0", "Blackwell": "10.0;10.3;12.0;12.1", "Blackwell+Tegra": "11.0",
             "Rubin": "10.7"}
    archs = []
    for entry in re.split(r"[;,\s]+", listed):
        try:  # an entry build_spec cannot read is left out, as torch's own build would fail on it
            archs += [a for a in BUILD_SPEC["cuda_archs"](named.get(entry, entry))
                      if int(a.rstrip("af")) >= 89 and a not in archs]
        except ValueError:
            pass
    if not archs:
        return [], (f"TORCH_CUDA_ARCH_LIST={listed!r} names no GPU from sm_89 (8.9) on, which the CUDA kernels need: "
                    "skipping the CUDA extension (DORAFP8_CUDA_ARCHS sets dorafp8's own)")
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        major, minor = torch.cuda.get_device_capability(i)
        if (major, minor) >= (8, 9) and BUILD_SPEC["covering"](archs, major, minor) is None:
            archs.append(f"{major}{minor}")
    return archs, f" (from TORCH_CUDA_ARCH_LIST={listed!r})"


def _cuda_extension():
    """Returns (ext_modules, the build_ext class to build them with, what to say when the build starts, the note) for
    dorafp8._C, or ([], setuptools' build_ext, None, why it is skipped). Decides only: builds and writes nothing."""
    if _flag("DORAFP8_SKIP_CUDA_BUILD"):
        return _skip("DORAFP8_SKIP_CUDA_BUILD=1: skipping the CUDA extension")
    try:
        import torch
        from torch.utils import cpp_extension
        from torch.utils.cpp_extension import BuildExtension, CUDAExtension
    except ImportError:
        return _skip("torch not importable at build time (an isolated build): no CUDA extension in this build; "
                     "backend='cuda' builds it on first use where nvcc and a GPU are")
    home = BUILD_SPEC["cuda_home"]()  # the toolkit the build on first use takes too (torch's guess may be wrong)
    if home is None:
        return _skip("nvcc not found (no $CUDA_HOME/bin/nvcc, /usr/local/cuda/bin/nvcc or nvcc on PATH; set "
                     "CUDA_HOME to the CUDA toolkit): skipping the CUDA extension")
    toolkit = BUILD_SPEC["toolkit"](home)  # before $CUDA_HOME is set to it: a $CUDA_HOME passed over is named
    os.environ["CUDA_HOME"] = cpp_extension.CUDA_HOME = home  # what torch's BuildExtension builds with
    if torch.version.cuda is None:
        return _skip(f"torch {torch.__version__} is a CPU build: skipping the CUDA extension")
    forced = _flag("DORAFP8_FORCE_CUDA_BUILD")
    if not forced and not torch.cuda.is_available():
        return _skip("no GPU visible: skipping the CUDA extension (DORAFP8_FORCE_CUDA_BUILD=1 builds it anyway)")
    sources = [os.path.join("csrc", f) for f in ["binding.cpp", *CUDA_SOURCES]]
    if not all(os.path.exists(os.path.join(HERE, s)) for s in sources):
        return _skip("csrc/ sources missing: skipping the CUDA extension")

    archs, whence = _archs(torch)
    if not archs:
        return _skip(whence)
    gencode = BUILD_SPEC["gencode"](archs)  # a cubin per arch, PTX of the oldest portable one
    os.environ.setdefault("MAX_JOBS", BUILD_SPEC["default_max_jobs"]())
    ext = CUDAExtension(
        name="dorafp8._C",
        sources=sources,
        include_dirs=[os.path.join(HERE, "csrc")] + BUILD_SPEC["wheel_include_dirs"](),
        # binding.cpp's dorafp8._C.SOURCES: what it was built from (an in-place build older than csrc/ is not used)
        extra_compile_args={"cxx": BUILD_SPEC["CXX_FLAGS"] + [
            "-DDORAFP8_SOURCES=" + BUILD_SPEC["sources_hash"](os.path.join(HERE, "csrc"))],
            "nvcc": BUILD_SPEC["NVCC_FLAGS"] + gencode},
    )
    note = f"built for sm_{', sm_'.join(archs)}{whence} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    start = (f"building the CUDA extension for sm_{', sm_'.join(archs)} with {toolkit}, "
             f"MAX_JOBS={os.environ['MAX_JOBS']}")
    return [ext], BuildExtension.with_options(use_ninja=True), start, note


def _noting(base, start, note):
    """`base` (setuptools' build_ext, or torch's BuildExtension when the extension is built) which also writes `note`,
    why the extension was or was not built, as dorafp8/_build_info.json next to where the extension goes: into the
    build directory for a wheel, in place (dorafp8/, git-ignored like dorafp8/_C*.so) for an editable install or
    `build_ext --inplace`. Written after a successful build only, so that it never claims an extension that failed.

    Why a file: pip hides this script's output (unless run with -v), and what decided the build (the DORAFP8_*
    switches, an isolated build without torch, nvcc or a GPU missing at install time) cannot be found out at run time,
    so `python -m dorafp8` and the CUDA backend's error repeat this note (dorafp8/backends/cuda.py's build_note()).
    Why from build_ext: it is the command that puts the extension where the package imports it from, and the `build`
    below runs it even when there is no extension to build, so that every wheel and editable install carries the note
    of its own build, while running this file or asking it for metadata writes nothing."""

    class build_ext(base):
        def _note_paths(self):
            """(in the build directory, in place): the pair setuptools maps an in-place extension with."""
            regular = os.path.join(self.build_lib, "dorafp8", NOTE_FILE)
            package_dir = self.get_finalized_command("build_py").get_package_dir("dorafp8")
            return regular, os.path.join(package_dir, NOTE_FILE)

        def run(self):
            _say(start or note)
            text, inplace_build = note, self.inplace  # setuptools' run() sets inplace to 0 until it returns
            try:
                super().run()
            except Exception as e:
                # The extension is optional: a build that fails (nvcc of another CUDA major than torch's, an nvcc
                # too old for an arch, a compiler error) must not fail the whole install, which left a GPU user
                # with no dorafp8 at all. Forced (CI, bench/first_contact.py's build step), it fails as before.
                if not self.extensions or _flag("DORAFP8_FORCE_CUDA_BUILD"):
                    raise
                msg = e.args[0] % e.args[1:] if len(e.args) > 1 and "%s" in str(e.args[0]) else str(e)  # torch's
                why = " ".join(f"{type(e).__name__}: {msg}".split())[:600]
                text = (f"the CUDA extension failed to build ({why}; while {start}); dorafp8 installs without it: "
                        "backend='auto' uses the Triton/reference backends, and backend='cuda' builds it on first use "
                        "for the GPU at hand (it needs an nvcc of torch's CUDA major; DORAFP8_CUDA_ARCHS=<your GPU's, "
                        "e.g. 90a> builds for it alone where this nvcc lacks an arch of the default; "
                        "DORAFP8_FORCE_CUDA_BUILD=1 makes a failed build fail the install)")
                _say(text)
                self.extensions, self.inplace = [], inplace_build  # nothing built: no install lists it
            regular, inplace = self._note_paths()
            path = inplace if self.inplace else regular
            if self.inplace and not self.extensions:
                # An in-place extension from an earlier build stays importable: say so rather than contradict it.
                stale = sorted(f for f in os.listdir(os.path.dirname(inplace) or ".") if f.startswith("_C."))
                if stale:
                    text += f"; an earlier build's dorafp8/{stale[0]} stays in place"
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w") as f:
                json.dump({"cuda_extension": text}, f)
                f.write("\n")
            if start and text == note:
                _say(note)

        def get_outputs(self):
            outputs = super().get_outputs()  # in place: the keys of get_output_mapping, the note's among them
            return outputs if self.inplace else outputs + [self._note_paths()[0]]

        def get_output_mapping(self):
            mapping = super().get_output_mapping()
            if self.inplace:
                regular, inplace = self._note_paths()
                mapping[regular] = inplace
            return mapping

    return build_ext


class build(_build):
    """setuptools' build, which runs build_ext even with no extension to build, for the note."""

    sub_commands = [(name, (lambda self: True) if name == "build_ext" else test) for name, test in _build.sub_commands]


ext_modules, base_build_ext, start, note = _cuda_extension()
if (_typo := _ENV["unknown"]()) is not None:  # pip shows this only under -v: the note (`python -m dorafp8`) keeps it
    _say(_typo)
    note += f"; {_typo}"

setup(
    ext_modules=ext_modules,
    cmdclass={"build": build, "build_ext": _noting(base_build_ext, start, note)},
)
