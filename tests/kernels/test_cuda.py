"""CUDA C++ backend (csrc/ -> dorafp8._C, wrapped by dorafp8.backends.cuda) against fp64 evaluations of the backend
contract and against dorafp8.backends.reference, with the shared checks of tests/kernels/_kernel_ref.py.

On a machine without a GPU only the build is checked: if the extension is built it must import and its binding's
argument checks must answer (without it these tests skip with the reason, unless DORAFP8_REQUIRE_CUDA_EXT=1, which
.ci/run sets after force-building it), and the backend must say why it cannot run on CPU. The kernel tests need a CUDA
GPU: every op in bf16, fp16 and fp32 (and fp32 adapters on 16-bit activations), odd shapes (M = 1, 37; N = 70, 129;
K = 50, 4096; r = 1 .. 256), bias, the three modes (plain, no dropout, dropout), per-tensor and per-row scales, strided
activations, and outputs that start as NaN (base.POISON_OUTPUTS) so that a tile the kernel never writes fails. Block
scales and W8A8 are refused with a ValueError (the Triton and reference backends have them). The same adapter runs
the same kernel source on CPU under an emulator in tests/kernels/test_cuda_emulated.py.
"""

import errno
import os
import shutil

import pytest
import torch

import dorafp8.backends.cuda as cb
from dorafp8 import backends, quantize_e4m3
from dorafp8.backends import base
from tests._tolerance import assert_close, tol
from tests.kernels._kernel_ref import (P, S, check_backward_pass, check_dgrad, check_forward, check_project,
                                       check_weight_norm, d, forward_64, make_problem, shape_id, w0_64)

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda"
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU: the CUDA kernels cannot run on CPU")
REQUIRE_EXT = os.environ.get("DORAFP8_REQUIRE_CUDA_EXT") == "1"

DTYPES = [torch.float32, torch.float16, torch.bfloat16]

# (M, K, N, r, strided). M = 1 and 37 (one ragged 64-row tile, 128-wide tiles), 65, 129, 130 and 300 (the 256-wide
# tiles: 64 rows, 32 with dropout; several row-blocks, ragged, more than one launch-order group at 300 with dropout);
# K = 50 and 257 (not a multiple of 16: byte-wise fp8 copies), 64/96/128/1000/4096 (16-byte copies, long pipelines);
# N = 70, 129 (odd: no paired stores), 383, 700, 1024 (several column-blocks); r = 1, 3, 8, 16, 40, 72, 128, 256
# (one to eight rank chunks of 32); `strided` puts the activations in wider buffers (row stride = width + 7, which
# also makes them unaligned for 16-byte copies).
SHAPES = [
    (1, 50, 70, 1, False),
    (37, 50, 70, 3, True),
    (37, 4096, 70, 16, False),
    (37, 64, 48, 128, True),
    (65, 128, 129, 1, False),
    (130, 96, 200, 40, True),
    (129, 257, 383, 256, False),
    (300, 1000, 700, 72, True),
    (4, 4096, 1024, 8, False),
]



# ------------------------------------------------------------------------------------------------------ helpers

@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(base, "POISON_OUTPUTS", True)


# ------------------------------------------------------------------------------------------------------ CPU tests

def _require_extension():
    """The built extension, or a skip saying why it is absent. DORAFP8_REQUIRE_CUDA_EXT=1 (set by .ci/run after its
    forced build) turns the skip into a failure, so that a broken build cannot pass as "not built"."""
    if cb._C is None:
        why = f"dorafp8._C does not import ({cb._IMPORT_ERROR}; at install: {cb.build_note() or 'unknown'})"
        if REQUIRE_EXT:
            pytest.fail(f"{why}; DORAFP8_REQUIRE_CUDA_EXT=1 requires it. Build it with: {cb.BUILD_COMMAND}")
        pytest.skip(f"{why}: the CUDA extension is optional (build it with: {cb.BUILD_COMMAND})")
    return cb._C


def test_extension_built():
    """CI force-builds the extension: it must import and export the kernels' entry points."""
    C = _require_extension()
    for name in ("weight_norm", "forward", "dgrad", "kernel_image_error"):
        assert callable(getattr(C, name, None)), f"dorafp8._C lacks {name}"
    assert C.SOURCES == cb.cuda_build.build_spec()["sources_hash"](str(cb.cuda_build.source_dir()))


def test_binding_checks_device():
    """The binding's checks run before any launch, so they answer on CPU too, naming the argument."""
    C = _require_extension()
    w8 = torch.zeros(4, 16).to(torch.float8_e4m3fn)
    x, scale, y = torch.zeros(2, 16), torch.ones(()), torch.empty(2, 4)
    rl = torch.ones(1)
    with pytest.raises(RuntimeError, match="x must be a CUDA tensor"):
        C.forward(x, w8, scale, None, None, None, None, 0.0, None, 0.0, y, None)
    with pytest.raises(RuntimeError, match="gl must be a CUDA tensor"):
        C.dgrad(torch.zeros(2, 4), rl, w8, scale, None, None, 0.0, None, 0.0, None, None, torch.empty(2, 16))
    with pytest.raises(RuntimeError, match="w8 must be a CUDA tensor"):
        C.weight_norm(w8, scale, torch.zeros(1, 16), torch.zeros(4, 1), 1.0, torch.empty(4))


def test_contract_refusals_need_no_gpu():
    """Block scales and W8A8 are refused by the adapter with the way out, before anything reaches the binding."""
    p = make_problem(4, 32, 20, 2, torch.bfloat16, "cpu", "block", False)
    with pytest.raises(ValueError, match="block weight scales .* not supported by the cuda backend; use "
                                         "backend='auto' or 'triton' / 'reference'"):
        cb.weight_norm(p["w8"], p["sigma"], p["block"], p["A"], p["B"], S)
    with pytest.raises(ValueError, match="block weight scales"):
        check_forward(cb.forward, p, "dropout", True)
    with pytest.raises(ValueError, match="block weight scales"):
        check_dgrad(cb.dgrad, p, "nodrop")
    p = make_problem(4, 32, 20, 2, torch.bfloat16, "cpu", "tensor", False)
    with pytest.raises(ValueError, match=r"act_quant='rowwise' \(W8A8\) is not supported by the cuda backend"):
        check_forward(cb.forward, p, "plain", True, act_quant="rowwise")
    with pytest.raises(ValueError, match=r"act_quant='rowwise' \(W8A8\) is not supported by the cuda backend"):
        check_dgrad(cb.dgrad, p, "dropout", act_quant="rowwise")


def test_unavailable_reason_cpu(monkeypatch):
    # On CPU tensors the reason is the device, whether or not the extension is built: building cannot help there.
    for built in (True, False):
        if not built:
            monkeypatch.setattr(cb, "_C", None)
            monkeypatch.setattr(cb, "_IMPORT_ERROR", ImportError("No module named 'dorafp8._C'"))
        reason = cb.unavailable_reason(torch.device("cpu"))
        assert "CUDA devices only" in reason and "pip install" not in reason
    # On a CUDA device without the extension, the reason says the first use of backend='cuda' builds it (a wheel's
    # user has no checkout to run an install command in), or what keeps it from being built here.
    monkeypatch.setenv("DORAFP8_FORCE_CUDA_BUILD", "1")  # as on a GPU: past "torch sees no CUDA device"
    monkeypatch.setattr(cb.cuda_build, "why_not", lambda: None)
    reason = cb.unavailable_reason(torch.device("cuda"))
    assert "dorafp8._C is not built" in reason and "backend='cuda' builds it on first use" in reason
    assert "pip install" not in reason, reason
    monkeypatch.setattr(cb.cuda_build, "why_not", lambda: "nvcc was not found (...)")
    assert "it cannot be built here: nvcc was not found" in cb.unavailable_reason(torch.device("cuda"))


# ------------------------------------------------------------------------------------------------------ first use

def _fake_toolkit(tmp_path, monkeypatch, archs="90a"):
    """A CUDA toolkit with an nvcc, a cache folder of the test's own, an unbuilt extension, a forced build (no GPU
    here) for `archs`; returns the list that records each call of torch's loader, which builds nothing."""
    from torch.utils import cpp_extension

    nvcc = tmp_path / "cuda" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\n")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    monkeypatch.setenv("DORAFP8_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("DORAFP8_FORCE_CUDA_BUILD", "1")
    monkeypatch.setenv("DORAFP8_CUDA_ARCHS", archs)
    monkeypatch.delenv("MAX_JOBS", raising=False)
    monkeypatch.setattr(cb, "_C", None)
    monkeypatch.setattr(cb, "_IMPORT_ERROR", ImportError("No module named 'dorafp8._C'"))
    monkeypatch.setattr(cb, "_build_error", None)
    monkeypatch.setattr(cb._backend, "launcher", None)
    monkeypatch.setattr(backends, "_reasons", {})  # the registry's probes, kept per process
    calls = []

    def load(**kw):
        calls.append(dict(kw, CUDA_HOME=cpp_extension.CUDA_HOME, MAX_JOBS=os.environ.get("MAX_JOBS")))
        return type("FakeExtension", (), {})()

    monkeypatch.setattr(cpp_extension, "load", load)
    return calls


@pytest.mark.parametrize("value", ["", ";", " , "])
def test_cuda_archs_naming_no_arch_is_read_as_unset(monkeypatch, value):
    """DORAFP8_CUDA_ARCHS=";" named no arch, and a first-use build had none to build for (an IndexError in gencode);
    like "" it is read as unset now (csrc/build_spec.py's cuda_archs, as setup.py reads it)."""
    from dorafp8.backends import cuda_build

    monkeypatch.delenv("DORAFP8_CUDA_ARCHS", raising=False)
    unset = cuda_build.archs(torch.device("cuda"))
    monkeypatch.setenv("DORAFP8_CUDA_ARCHS", value)
    assert cuda_build.archs(torch.device("cuda")) == unset != []


@pytest.mark.parametrize("cap, archs", [((9, 0), ["90a"]), ((8, 9), ["89"]), ((10, 3), ["100"]), ((12, 1), ["120"]),
                                         ((8, 6), ["86"])])
def test_first_use_build_targets_a_cubin_that_runs_on_the_gpu(monkeypatch, cap, archs):
    """The build on first use targets the GPU: a default arch whose cubin runs on it. B300 (sm_103) and GB10 (sm_121)
    were built for their own arch, which an nvcc of CUDA 12.8 (torch's cu128) refuses ('Unsupported gpu
    architecture'), while the default's sm_100 / sm_120 cubin runs on them (a cubin runs on later minors of its major),
    as the install-time build's does."""
    from dorafp8.backends import cuda_build

    monkeypatch.delenv("DORAFP8_CUDA_ARCHS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    assert cuda_build.archs(torch.device("cuda")) == archs


def test_first_use_of_backend_cuda_builds_the_extension(tmp_path, monkeypatch, capsys):
    """Without an install-time build, naming backend='cuda' builds dorafp8._C with torch's loader: binding.cpp and
    the kernel files build_spec.py lists, its flags with a cubin for the arch (and its PTX), into a per-user cache
    folder named by the archs and a hash, saying so on stderr; a second call builds nothing. (torch's loader is
    replaced: a real build takes minutes; DORAFP8_TEST_CUDA_BUILD=1 runs one, test_first_use_build_for_real.)"""
    import runpy

    from torch.utils import cpp_extension

    calls = _fake_toolkit(tmp_path, monkeypatch)
    home = cpp_extension.CUDA_HOME
    assert "backend='cuda' builds it on first use" in cb.unavailable_reason(torch.device("cuda"))
    assert backends.resolve("auto", torch.device("cuda")) != "cuda" and calls == []  # "auto" never builds
    assert cb.prepare(torch.device("cuda")) is True
    (kw,) = calls
    spec = runpy.run_path(str(cb.cuda_build.source_dir() / "build_spec.py"))
    assert [os.path.basename(f) for f in kw["sources"]] == ["binding.cpp", "weight_norm.cu", "forward.cu", "dgrad.cu"]
    assert all(os.path.isfile(f) for f in kw["sources"])
    assert kw["extra_cuda_cflags"] == spec["NVCC_FLAGS"] + ["-gencode", "arch=compute_90a,code=[sm_90a,compute_90a]"]
    assert kw["extra_cflags"] == spec["CXX_FLAGS"] and kw["with_cuda"] is True
    folder = os.path.relpath(kw["build_directory"], tmp_path / "cache")
    assert folder.startswith("cuda_ext/sm_90a-") and len(folder) == len("cuda_ext/sm_90a-") + 16, folder
    assert kw["CUDA_HOME"] == str(tmp_path / "cuda") and kw["MAX_JOBS"] is not None  # set for the build only
    assert cpp_extension.CUDA_HOME == home and "MAX_JOBS" not in os.environ
    err = capsys.readouterr().err
    assert "dorafp8: building the CUDA extension for sm_90a" in err and "on first use of backend='cuda'" in err
    assert f"into {kw['build_directory']}" in err and "dorafp8: built the CUDA extension" in err
    assert type(cb._C).__name__ == "FakeExtension" and cb._backend.launcher is cb._C
    assert cb.prepare(torch.device("cuda")) is False and len(calls) == 1


def test_an_install_build_for_other_gpus_is_rebuilt_on_first_use(tmp_path, monkeypatch):
    """An install-time dorafp8._C with no kernel code for the GPU at hand (TORCH_CUDA_ARCH_LIST="9.0" in a Docker
    build, run on an L40S) was refused with a command to rebuild it "in the checkout it was built in", which a user
    who installed from an sdist has not: backend='cuda' now builds it for this GPU on first use, as where the install
    built nothing; once (a build that lacks the GPU's code too is not built again)."""
    calls = _fake_toolkit(tmp_path, monkeypatch, archs="")
    installed = type("Installed", (), {"kernel_image_error": staticmethod(lambda i: "no kernel image is available")})()
    monkeypatch.setattr(cb, "_C", installed)
    monkeypatch.setattr(cb, "_INSTALLED", installed, raising=False)
    monkeypatch.setattr(cb._backend, "launcher", installed)
    monkeypatch.setattr(cb, "_image_error", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    monkeypatch.setattr("torch.utils.cpp_extension.load", lambda **kw: calls.append(kw) or type(
        "Built", (), {"kernel_image_error": staticmethod(lambda i: "")})())
    why = cb.unavailable_reason(torch.device("cuda"))  # `python -m dorafp8`'s line: the first use's build, no checkout
    assert "builds it for this GPU on first use" in why and "checkout" not in why and calls == [], why
    assert backends.resolve("cuda", torch.device("cuda")) == "cuda"
    (kw,) = calls
    assert "arch=compute_89,code=[sm_89,compute_89]" in kw["extra_cuda_cflags"]
    assert type(cb._C).__name__ == "Built" and cb._backend.launcher is cb._C
    assert cb.prepare(torch.device("cuda")) is False and len(calls) == 1


def test_a_first_use_build_for_another_gpu_names_the_archs_not_a_checkout(tmp_path, monkeypatch):
    """A process whose first-use build was for another GPU (an H100 beside an L40S) is not built again (once per
    process); the reason told the user to rebuild "in the checkout it was built in", which a wheel's user has not. It
    now names DORAFP8_CUDA_ARCHS with this GPU's arch."""
    _fake_toolkit(tmp_path, monkeypatch, archs="")
    built = type("Built", (), {"kernel_image_error": staticmethod(lambda i: "no kernel image is available")})()
    monkeypatch.setattr(cb, "_C", built)
    monkeypatch.setattr(cb, "_INSTALLED", None)
    monkeypatch.setattr(cb, "_image_error", {})
    monkeypatch.setattr(cb, "_build_error", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert cb.prepare(torch.device("cuda")) is False
    why = cb.unavailable_reason(torch.device("cuda"))
    assert "sm_89" in why and "DORAFP8_CUDA_ARCHS" in why and "checkout" not in why, why


def test_first_use_build_adds_the_gpu_to_archs_that_leave_it_out(tmp_path, monkeypatch):
    """DORAFP8_CUDA_ARCHS="90a" left set (a Docker image's ENV, built for H100s, run on an L40S): the install's build
    has no code for sm_89, and the first use's rebuild read the same variable and built sm_90a again (minutes of
    nvcc), then refused the backend for lack of kernel code, naming a checkout's command. The first-use build now adds
    the GPU's arch to a list that names none whose code runs on it, as setup.py does for TORCH_CUDA_ARCH_LIST."""
    calls = _fake_toolkit(tmp_path, monkeypatch, archs="90a")
    installed = type("Installed", (), {"kernel_image_error": staticmethod(lambda i: "no kernel image is available")})()
    monkeypatch.setattr(cb, "_C", installed)
    monkeypatch.setattr(cb, "_INSTALLED", installed)
    monkeypatch.setattr(cb._backend, "launcher", installed)
    monkeypatch.setattr(cb, "_image_error", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))

    def load(**kw):  # a module with code for the GPU only where the flags build it
        calls.append(kw)
        runs = "arch=compute_89,code=[sm_89,compute_89]" in kw["extra_cuda_cflags"]
        return type("Built", (), {"kernel_image_error": staticmethod(lambda i: "" if runs else "no kernel image")})()

    monkeypatch.setattr("torch.utils.cpp_extension.load", load)
    assert backends.resolve("cuda", torch.device("cuda")) == "cuda"
    (kw,) = calls
    assert "arch=compute_90a,code=sm_90a" in kw["extra_cuda_cflags"]  # what the variable names is built too
    assert cb.cuda_build.archs(torch.device("cuda")) == ["90a", "89"]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert cb.cuda_build.archs(torch.device("cuda")) == ["90a"]  # a list that covers the GPU stays as named


def test_a_failed_rebuild_of_an_install_build_for_other_gpus_is_named_from_then_on(tmp_path, monkeypatch):
    """The first-use rebuild of an install-time dorafp8._C built for other GPUs failed: the first call raised its
    error, every later one told the user to rebuild "in the checkout it was built in", which an sdist user has not,
    and not why the build failed. Later calls now name the failed build, as where the install built nothing."""
    calls = _fake_toolkit(tmp_path, monkeypatch, archs="")
    installed = type("Installed", (), {"kernel_image_error": staticmethod(lambda i: "no kernel image is available")})()
    monkeypatch.setattr(cb, "_C", installed)
    monkeypatch.setattr(cb, "_INSTALLED", installed)
    monkeypatch.setattr(cb._backend, "launcher", installed)
    monkeypatch.setattr(cb, "_image_error", {})
    monkeypatch.setattr(cb, "_build_error", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))

    def load(**kw):
        calls.append(kw)
        raise RuntimeError("nvcc fatal : Unsupported gpu architecture 'compute_89'")

    monkeypatch.setattr("torch.utils.cpp_extension.load", load)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="Unsupported gpu architecture") as e:
            backends.resolve("cuda", torch.device("cuda"))
        assert "checkout it was built in" not in str(e.value)
    assert len(calls) == 1 and cb._C is installed  # built once; the install's module stays for the GPUs it runs on


@pytest.mark.parametrize("cap", [(7, 0), (7, 5)])
def test_first_use_build_is_refused_below_sm_80(tmp_path, monkeypatch, cap):
    """A V100 or T4 naming backend='cuda' (or DORAFP8_BACKEND=cuda) started a build of minutes that ptxas ends in
    "Feature 'cp.async' requires .target sm_80 or higher" (csrc/ builds for sm_80 and newer), and `python -m dorafp8`
    said the first use would build it. Refused now before any build, naming the GPU's arch and what backend='auto'
    runs there; an sm_80 GPU still builds."""
    calls = _fake_toolkit(tmp_path, monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    cuda = torch.device("cuda")
    arch = f"sm_{cap[0]}{cap[1]}"
    with pytest.raises(RuntimeError, match=rf"cannot run on cuda: .*sm_80 or newer.*found {arch}.*'native'"):
        backends.resolve("cuda", cuda)
    assert calls == [] and cb.prepare(cuda) is False
    status = cb.extension_status()
    assert "cannot be built here: its kernels need an sm_80 or newer GPU" in status and arch in status
    assert "builds it on first use" not in status
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert cb.prepare(cuda) is True and len(calls) == 1


def test_first_use_build_cache_key_and_progress(tmp_path, monkeypatch, capsys):
    """The cache folder changes with the torch version, the archs and the sources, and only with them; a folder that
    holds a build loads quietly; a build that runs longer says so every _TICK seconds."""
    import time

    calls = _fake_toolkit(tmp_path, monkeypatch)
    cuda = torch.device("cuda")
    folder = cb.cuda_build.plan(cuda)["build_directory"]
    assert cb.cuda_build.plan(cuda)["build_directory"] == folder
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    assert cb.cuda_build.plan(cuda)["build_directory"] != folder
    monkeypatch.setattr(torch, "__version__", torch.__version__.removesuffix(".other"))
    monkeypatch.setenv("DORAFP8_CUDA_ARCHS", "89")
    assert cb.cuda_build.plan(cuda)["build_directory"] != folder
    src = tmp_path / "src"
    shutil.copytree(cb.cuda_build.source_dir(), src)
    monkeypatch.setattr(cb.cuda_build, "source_dir", lambda: src)
    same = cb.cuda_build.plan(cuda)["build_directory"]
    (src / "common" / "extra.cuh").write_text("// a changed header\n")
    assert cb.cuda_build.plan(cuda)["build_directory"] != same
    # a cached build: no line
    same.mkdir(parents=True)
    (src / "common" / "extra.cuh").unlink()
    (same / f"{cb.cuda_build.NAME}.so").write_bytes(b"")
    cb.cuda_build.build(cuda)
    assert calls and capsys.readouterr().err == ""
    # a slow build: the ticker
    monkeypatch.setattr(cb.cuda_build, "_TICK", 0.05)
    slow = lambda **kw: time.sleep(0.3)  # noqa: E731
    monkeypatch.setattr("torch.utils.cpp_extension.load", slow)
    (same / f"{cb.cuda_build.NAME}.so").unlink()
    cb.cuda_build.build(cuda)
    assert "dorafp8: ... still compiling the CUDA extension" in capsys.readouterr().err


def test_first_use_build_cache_is_per_machine_architecture(tmp_path, monkeypatch):
    """A home shared by x86 and aarch64 nodes (a cluster's GH200 beside its x86 H100s, the same python, torch and CUDA
    versions on both) gave both one cache folder: the second node found the first's dorafp8_C.so, took it as built
    and failed to import it (wrong ELF class), with no rebuild. The key holds the extension suffix (machine, python
    ABI) and the machine now."""
    import platform
    import sysconfig

    _fake_toolkit(tmp_path, monkeypatch)
    cuda = torch.device("cuda")
    folder = cb.cuda_build.plan(cuda)["build_directory"]
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    other = "aarch64" if platform.machine() != "aarch64" else "x86_64"
    monkeypatch.setattr(platform, "machine", lambda: other)
    monkeypatch.setattr(sysconfig, "get_config_var", lambda name: suffix.replace(
        "x86_64" if other == "aarch64" else "aarch64", other) if name == "EXT_SUFFIX" else None)
    assert cb.cuda_build.plan(cuda)["build_directory"] != folder


def test_first_use_build_after_a_killed_build(tmp_path, monkeypatch, capsys):
    """A build killed (SIGKILL, the OOM killer, a job's time limit) leaves torch's `lock` file in the build folder;
    torch's loader before 2.14 (FileBaton, in torch 2.11 on the GPU machine) waits for it to disappear, forever, while
    dorafp8 said "still compiling". dorafp8 builds under its own OS lock on a file there (dropped by the kernel when a
    builder dies); under it the `lock` file can only be a dead build's: it is removed, and the build runs."""
    from torch.utils import cpp_extension
    from torch.utils.file_baton import FileBaton

    calls = _fake_toolkit(tmp_path, monkeypatch)

    def load_as_torch_2_11(**kw):  # torch < 2.14's _jit_compile: try_acquire, else baton.wait() (forever)
        baton = FileBaton(os.path.join(kw["build_directory"], "lock"))
        assert baton.try_acquire(), "torch's loader would wait for the lock file forever"
        baton.release()
        calls.append(kw)
        return type("FakeExtension", (), {})()

    monkeypatch.setattr(cpp_extension, "load", load_as_torch_2_11)
    out = cb.cuda_build.plan(torch.device("cuda"))["build_directory"]
    out.mkdir(parents=True)
    (out / "lock").write_bytes(b"")  # what the killed build left
    cb.cuda_build.build(torch.device("cuda"))
    assert len(calls) == 1 and not (out / "lock").exists()
    # another process building there now (its lock held): this one says it waits, then builds
    import fcntl
    import threading

    held = os.open(out / cb.cuda_build._LOCK, os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)
    threading.Timer(0.5, os.close, [held]).start()
    capsys.readouterr()
    cb.cuda_build.build(torch.device("cuda"))
    assert len(calls) == 2 and "waiting for another process's build" in capsys.readouterr().err
    # a file system without locks (flock fails): the build runs as before, and removes nothing it cannot prove dead

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(cb.cuda_build.fcntl, "flock", no_locks)
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: calls.append(kw))
    (out / "lock").write_bytes(b"")
    cb.cuda_build.build(torch.device("cuda"))
    assert len(calls) == 3 and (out / "lock").exists()


def test_first_use_build_after_a_killed_build_on_nfs(tmp_path, monkeypatch):
    """On NFS (a cluster's home, where a job's time limit kills a build) flock is a POSIX lock, and an exclusive one
    on a descriptor not open for writing fails with EBADF (flock(2), "NFS details"): a lock on the folder itself (a
    directory cannot be opened for writing) was never taken there, so the killed build's `lock` file stayed, and every
    later load waited for it forever. The flock here behaves as NFS's does."""
    import fcntl

    real_flock = fcntl.flock

    def nfs_flock(fd, op):
        if op & fcntl.LOCK_EX and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            raise OSError(errno.EBADF, "Bad file descriptor")
        return real_flock(fd, op)

    calls = _fake_toolkit(tmp_path, monkeypatch)
    monkeypatch.setattr(cb.cuda_build.fcntl, "flock", nfs_flock)
    monkeypatch.setattr("torch.utils.cpp_extension.load", lambda **kw: calls.append(kw))
    out = cb.cuda_build.plan(torch.device("cuda"))["build_directory"]
    out.mkdir(parents=True)
    (out / "lock").write_bytes(b"")  # what the killed build left
    cb.cuda_build.build(torch.device("cuda"))
    assert len(calls) == 1 and not (out / "lock").exists()


def test_first_use_build_where_its_lock_file_cannot_be_opened(tmp_path, monkeypatch):
    """A build folder whose lock file cannot be opened for writing (another user's cache, shared through
    DORAFP8_CACHE_DIR; here a folder in its place, which root cannot open for writing either) builds as it did before
    the lock, unlocked: the open's raw OSError escaped build(), whose callers expect a RuntimeError."""
    calls = _fake_toolkit(tmp_path, monkeypatch)
    monkeypatch.setattr("torch.utils.cpp_extension.load", lambda **kw: calls.append(kw))
    out = cb.cuda_build.plan(torch.device("cuda"))["build_directory"]
    (out / cb.cuda_build._LOCK).mkdir(parents=True)
    cb.cuda_build.build(torch.device("cuda"))
    assert len(calls) == 1


def test_first_use_build_where_a_folder_is_named_lock(tmp_path, monkeypatch):
    """A folder named `lock` in the build folder (planted, or a tool's leftover) is where torch's loader keeps its lock
    file: torch < 2.14 would wait for it to go, forever. Removing torch's stale lock raised the raw IsADirectoryError
    out of build() and prepare(), whose callers expect a RuntimeError; now a RuntimeError names the folder and what to
    do, kept as the backend's reason, and the folder (and what is in it) is left alone."""
    calls = _fake_toolkit(tmp_path, monkeypatch)
    out = cb.cuda_build.plan(torch.device("cuda"))["build_directory"]
    (out / "lock").mkdir(parents=True)
    (out / "lock" / "keep.txt").write_text("someone's")
    with pytest.raises(RuntimeError, match=r"lock is a folder.*remove it"):
        cb.prepare(torch.device("cuda"))
    assert calls == [] and (out / "lock" / "keep.txt").read_text() == "someone's"
    assert f"{out / 'lock'} is a folder" in cb.unavailable_reason(torch.device("cuda"))


def test_cache_dir_expands_a_tilde(tmp_path, monkeypatch):
    """DORAFP8_CACHE_DIR or XDG_CACHE_HOME holding `~` (set where no shell expands it: a .env file, a Dockerfile's
    ENV, a job script's quotes) meant a folder named `~` in whatever the working directory was, a new one in each: the
    build ran again for minutes and the race's verdicts were checked again. `~` is the user's home, as for HF_HOME."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("DORAFP8_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "~/xdg")
    assert cb.cuda_build.cache_dir() == str(tmp_path / "xdg" / "dorafp8")
    monkeypatch.setenv("DORAFP8_CACHE_DIR", "~/dorafp8-cache")
    assert cb.cuda_build.cache_dir() == str(tmp_path / "dorafp8-cache")
    _fake_toolkit(tmp_path, monkeypatch)
    monkeypatch.setenv("DORAFP8_CACHE_DIR", "~/dorafp8-cache")
    assert cb.cuda_build.plan(torch.device("cuda"))["build_directory"].parent == tmp_path / "dorafp8-cache" / "cuda_ext"


@pytest.mark.parametrize("built_from", ["these sources", "other sources", "unknown sources"])
def test_an_in_place_build_of_other_sources_is_not_used(built_from):
    """An editable install's in-place dorafp8._C, then a `git pull` that changes csrc/: the old kernels ran with the
    new Python side (arguments read another way: wrong values, or a TypeError in the middle of training) and `python -m
    dorafp8` said "importable". setup.py compiles the sources' hash into the extension (SOURCES); a build of other
    sources, or one from before the hash, is not used: the reason says rebuild, and backend='cuda' builds the current
    sources on first use. (A fake dorafp8._C, put in place before dorafp8 is imported, in a fresh interpreter.)"""
    import subprocess
    import sys

    from dorafp8.backends import cuda_build

    sources = {"these sources": repr(cuda_build.build_spec()["sources_hash"](str(cuda_build.source_dir()))),
               "other sources": repr("0" * 64), "unknown sources": None}[built_from]
    code = ("import sys, types; C = types.ModuleType('dorafp8._C'); C.__file__ = '/x/dorafp8/_C.so'\n"
            + (f"C.SOURCES = {sources}\n" if sources else "") + "sys.modules['dorafp8._C'] = C\n"
            "from dorafp8.backends import cuda; print(cuda._C is C); print(cuda.extension_status())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    used, status = out.stdout.splitlines()[-2:]
    if built_from == "these sources":
        assert used == "True" and status.startswith("importable"), out.stdout + out.stderr
    else:
        assert used == "False", out.stdout + out.stderr
        assert (f"/x/dorafp8/_C.so was not built from the CUDA sources in {cuda_build.source_dir()}" in status
                and f"rebuild it: {cb.BUILD_COMMAND}" in status), status


def test_sources_it_cannot_read_do_not_fail_the_import(monkeypatch):
    """The check of an in-place build runs when dorafp8 is imported: csrc/ files it cannot read (an installation's
    permissions) must not make `import dorafp8` fail; such a build is used, as before the check."""
    def unreadable(src):
        raise PermissionError(13, "Permission denied", src)

    monkeypatch.setattr(cb.cuda_build, "build_spec", lambda: {"sources_hash": unreadable})
    assert cb.stale(type("C", (), {"SOURCES": "0" * 64})) is None


def test_first_use_build_refusals(tmp_path, monkeypatch):
    """No nvcc: backend='cuda' is refused naming nvcc and CUDA_HOME, and nothing is built. A build that fails says
    what runs without the extension, and is not tried again in the process."""
    from torch.utils import cpp_extension

    calls = _fake_toolkit(tmp_path, monkeypatch)
    monkeypatch.setattr(cb.cuda_build, "cuda_home", lambda: None)
    with pytest.raises(RuntimeError, match=r"cannot run on cuda.*cannot be built here: nvcc was not found.*CUDA_HOME"):
        backends.resolve("cuda", torch.device("cuda"))
    assert calls == [] and cb.prepare(torch.device("cuda")) is False
    with pytest.raises(RuntimeError, match="cannot be built here: nvcc was not found"):
        cb.cuda_build.build(torch.device("cuda"))
    monkeypatch.undo()
    _fake_toolkit(tmp_path / "again", monkeypatch)

    def broken(**kw):
        raise RuntimeError("Error building extension 'dorafp8_C': nvcc fatal")

    monkeypatch.setattr(cpp_extension, "load", broken)
    with pytest.raises(RuntimeError, match=r"building the CUDA extension for sm_90a .*failed .*nvcc fatal.*"
                                           r"backend='triton' or backend='reference' run without the extension"):
        cb.prepare(torch.device("cuda"))
    assert cb.prepare(torch.device("cuda")) is False  # not again
    assert "nvcc fatal" in cb.unavailable_reason(torch.device("cuda"))


def test_first_use_build_names_the_toolkit_it_took(tmp_path, monkeypatch, capsys):
    """CUDA_HOME naming a toolkit since removed is passed over for the next one found (here $CUDA_PATH's); a build
    that then failed on torch's "The detected CUDA version (12.1) mismatches ..." named no toolkit, and the user's
    CUDA_HOME looked used. The build's lines now name the toolkit it took and the $CUDA_HOME it passed over."""
    from torch.utils import cpp_extension

    _fake_toolkit(tmp_path, monkeypatch)
    monkeypatch.setenv("CUDA_PATH", str(tmp_path / "cuda"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda-13.0-removed"))

    def mismatch(**kw):
        raise RuntimeError("The detected CUDA version (12.1) mismatches the version that was used to compile PyTorch")

    monkeypatch.setattr(cpp_extension, "load", mismatch)
    with pytest.raises(RuntimeError, match=r"mismatches") as e:
        cb.prepare(torch.device("cuda"))
    said = f"with the CUDA toolkit in {tmp_path / 'cuda'} ($CUDA_HOME={tmp_path / 'cuda-13.0-removed'} has no bin/nvcc)"
    assert said in str(e.value) and said in capsys.readouterr().err, str(e.value)


def test_first_use_build_into_an_unwritable_cache(tmp_path, monkeypatch):
    """A cache folder that cannot be made (a read-only home; here a file in its place, as root passes permissions): a
    RuntimeError naming the folder and DORAFP8_CACHE_DIR, kept as the backend's reason and not tried again. Before, the
    OSError of mkdir escaped prepare() bare (it keeps RuntimeErrors only) and every call tried again."""
    calls = _fake_toolkit(tmp_path, monkeypatch)
    (tmp_path / "home").write_text("")
    monkeypatch.setenv("DORAFP8_CACHE_DIR", str(tmp_path / "home" / "dorafp8"))
    with pytest.raises(RuntimeError, match=r"cannot be built: its build folder .*home/dorafp8/cuda_ext.* cannot be "
                                           r"made .*set DORAFP8_CACHE_DIR to a writable folder"):
        cb.prepare(torch.device("cuda"))
    assert cb.prepare(torch.device("cuda")) is False and calls == []  # not again
    assert "DORAFP8_CACHE_DIR" in cb.unavailable_reason(torch.device("cuda"))


def test_first_use_build_into_another_users_folder(tmp_path, monkeypatch):
    """A build folder that exists but this user cannot write (a first run under sudo, or in a container as root, made
    it): torch's loader failed on its lock file with a bare PermissionError, reported as a failed build; now it is
    refused before the loader as an unmakable folder is, naming it and DORAFP8_CACHE_DIR. (Root writes anywhere, so
    os.access answers for the other user here; the loader raises as torch's does on such a folder.)"""
    calls = _fake_toolkit(tmp_path, monkeypatch)
    out = cb.cuda_build.plan(torch.device("cuda"))["build_directory"]
    out.mkdir(parents=True)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: os.fspath(p) != str(out) and real_access(p, mode, **kw))

    def load(**kw):
        calls.append(kw)
        raise PermissionError(errno.EACCES, "Permission denied", str(out / "lock"))

    monkeypatch.setattr("torch.utils.cpp_extension.load", load)
    with pytest.raises(RuntimeError, match=r"build folder .*cuda_ext/sm_90a-.* cannot be made or written .*set "
                                           r"DORAFP8_CACHE_DIR to a writable folder"):
        cb.prepare(torch.device("cuda"))
    assert calls == [] and "DORAFP8_CACHE_DIR" in cb.unavailable_reason(torch.device("cuda"))


@pytest.mark.skipif(os.environ.get("DORAFP8_TEST_CUDA_BUILD") != "1",
                    reason="builds the CUDA extension with nvcc (minutes): DORAFP8_TEST_CUDA_BUILD=1 runs it")
def test_first_use_build_for_real(tmp_path):
    """The build on first use with nvcc, for one arch, in a process whose dorafp8._C cannot import (as from a wheel):
    naming backend='cuda' builds the extension into the cache, which imports and has the kernels' entry points (on a
    machine without a GPU, forced: the backend then says that torch sees no CUDA device)."""
    import subprocess
    import sys

    code = """
import sys, torch
sys.modules['dorafp8._C'] = None
from dorafp8 import backends
from dorafp8.backends import cuda
try:
    backends.resolve('cuda', torch.device('cuda'))
except RuntimeError as e:
    print('refused:', e)
names = ('weight_norm', 'forward', 'dgrad', 'kernel_image_error')
print(sorted(n for n in names if callable(getattr(cuda._C, n, None))))
"""
    env = dict(os.environ, DORAFP8_FORCE_CUDA_BUILD="1", DORAFP8_CUDA_ARCHS="89", DORAFP8_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1800)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "dorafp8: building the CUDA extension for sm_89" in r.stderr and "dorafp8: built" in r.stderr, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "['dgrad', 'forward', 'kernel_image_error', 'weight_norm']", r.stdout
    assert list(tmp_path.glob("cuda_ext/sm_89-*/dorafp8_C*.so"))


def test_registry_on_cpu():
    assert isinstance(backends.unavailable_reason("cuda", torch.device("cpu")), str)
    assert "cuda" not in backends.available_backends("cpu")


# ------------------------------------------------------------------------------------------------------ GPU tests

SCALES = ["tensor", "row"]
# (compute dtype, rank dtype): the rank dtype is the compute dtype, or fp32 adapters on 16-bit activations.
DTYPE_PAIRS = [(dt, dt) for dt in DTYPES] + [(torch.bfloat16, torch.float32), (torch.float16, torch.float32)]


@gpu
def test_available_on_gpu():
    assert cb.unavailable_reason(torch.device("cuda")) is None, cb.unavailable_reason(torch.device("cuda"))
    assert "cuda" in backends.available_backends("cuda")


@gpu
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("adapter_dtype", DTYPES, ids=str)
def test_weight_norm(shape, scale, adapter_dtype):
    M, K, N, r, strided = shape
    p = make_problem(M, K, N, r, adapter_dtype, DEVICE, scale, strided)
    if strided:  # adapters may come with any strides (the wrapper makes them contiguous)
        p["B"] = p["B"].T.contiguous().T
    check_weight_norm(cb.weight_norm, p)


@gpu
def test_weight_norm_mixed_adapter_dtypes():
    p = make_problem(3, 96, 40, 5, torch.float32, DEVICE, "tensor", False)
    p["B"] = p["B"].to(torch.bfloat16)
    check_weight_norm(cb.weight_norm, p)


@gpu
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype,rank_dtype", DTYPE_PAIRS, ids=str)
@pytest.mark.parametrize("mode", ["nodrop", "dropout", "plain"])
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "nobias"])
def test_forward(shape, dtype, rank_dtype, mode, scale, has_bias):
    M, K, N, r, strided = shape
    p = make_problem(M, K, N, r, dtype, DEVICE, scale, strided, rank_dtype=rank_dtype)
    check_forward(cb.forward, p, mode, has_bias)


@gpu
@pytest.mark.parametrize("mode", ["nodrop", "dropout"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_without_z(mode, dtype):
    p = make_problem(5, 40, 36, 3, dtype, DEVICE, "tensor", False)
    xm = p["xm"] if mode == "dropout" else None
    u = p["u"] if mode == "dropout" else p["u_nodrop"]
    y, z = cb.forward(p["x"], p["w8"], p["sigma"], p["block"], p["bias"], p["m"], p["n"], u, p["B"], S, xm, P,
                      False, dtype, "")
    assert z is None
    y64, _ = forward_64(p["x"], p["w8"], p["sigma"], p["bias"], p["c"], u, p["B"], S, xm, P)
    assert_close(y, y64, tol(dtype), f"forward[{mode}, need_z=False] y vs fp64")


@gpu
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype,rank_dtype", DTYPE_PAIRS, ids=str)
@pytest.mark.parametrize("mode", ["nodrop", "dropout", "plain"])
@pytest.mark.parametrize("scale", SCALES)
def test_dgrad(shape, dtype, rank_dtype, mode, scale):
    M, K, N, r, strided = shape
    p = make_problem(M, K, N, r, dtype, DEVICE, scale, strided, rank_dtype=rank_dtype)
    check_dgrad(cb.dgrad, p, mode)


@gpu
@pytest.mark.parametrize("dtype,rank_dtype", DTYPE_PAIRS, ids=str)
@pytest.mark.parametrize("mode", ["nodrop", "dropout", "plain"])
def test_rank_ops(dtype, rank_dtype, mode):
    """project, project_grad, backward_pass: the Triton backend's on a GPU (reference where Triton cannot run)."""
    p = make_problem(37, 96, 70, 16, dtype, DEVICE, "row", True, rank_dtype=rank_dtype)
    check_project(cb.project, cb.project_grad, p)
    check_backward_pass(cb.backward_pass, p, mode)


@gpu
@pytest.mark.parametrize("op", ["forward", "dgrad"])
def test_int64_offsets(op):
    """M * K > 2^31 elements: row offsets must be computed in 64 bits. Checks the last rows only."""
    M, K, N = (1 << 16) + 3, (1 << 15) + 16, 24
    need = 2 * M * K * 2 + (1 << 30)
    if torch.cuda.mem_get_info()[0] < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free GPU memory")
    gen = torch.Generator().manual_seed(1)
    w8, sigma = quantize_e4m3(torch.randn(N, K, generator=gen) * 0.05)
    w8, sigma = w8.to(DEVICE), sigma.to(DEVICE)
    tail = slice(M - 40, M)
    if op == "forward":
        x = torch.zeros(M, K, dtype=torch.bfloat16, device=DEVICE)
        x[tail] = torch.randn(40, K, generator=gen).to(torch.bfloat16).to(DEVICE)
        y, _ = cb.forward(x, w8, sigma, 128, None, None, None, None, None, S, None, 0.0, False, torch.bfloat16, "")
        assert_close(y[tail], d(x[tail]) @ w0_64(w8, sigma).T, tol(torch.bfloat16), "forward, last rows")
        assert not torch.isnan(y[: M - 40]).any()
    else:
        g = torch.randn(M, N, generator=gen).to(torch.bfloat16).to(DEVICE)
        rl = torch.ones((), device=DEVICE)
        dx = cb.dgrad(g, rl, w8, sigma, 128, None, None, S, None, 0.0, None, None, "")
        assert_close(dx[tail], d(g[tail]) @ w0_64(w8, sigma), tol(torch.bfloat16), "dgrad, last rows")


@gpu
def test_rejects_bad_arguments():
    p = make_problem(2, 32, 16, 1, torch.float32, DEVICE, "tensor", False)
    y = torch.empty(2, 16, device=DEVICE)
    sc = p["sigma"]
    with pytest.raises(RuntimeError, match="w8 must be"):
        cb._C.forward(p["x"], p["w8"].float(), sc, None, None, None, None, S, None, 0.0, y, None)
    with pytest.raises(RuntimeError, match="scale must be 0-dim"):
        cb._C.forward(p["x"], p["w8"], torch.ones(3, device=DEVICE), None, None, None, None, S, None, 0.0, y,
                      None)
    with pytest.raises(RuntimeError, match="y must have shape"):
        cb._C.forward(p["x"], p["w8"], sc, None, None, None, None, S, None, 0.0, y[:1], None)
    with pytest.raises(RuntimeError, match="u and B are required"):
        cb._C.forward(p["x"], p["w8"], sc, None, p["c"], None, None, S, None, 0.0, y, None)
    u16 = torch.zeros(2, 1, dtype=torch.float16, device=DEVICE)
    with pytest.raises(RuntimeError, match="u must be .* or float32"):
        cb._C.forward(p["x"].half(), p["w8"], sc, None, p["c"], u16.bfloat16(), u16.bfloat16(), S, None, 0.0,
                      y.half(), None)
    g, dx, rl = torch.zeros(2, 16, device=DEVICE), torch.empty(2, 32, device=DEVICE), torch.ones(1, device=DEVICE)
    v, A = torch.zeros(2, 1, device=DEVICE), torch.zeros(1, 32, device=DEVICE)
    mask = torch.ones(2, 32, dtype=torch.bool, device=DEVICE)
    with pytest.raises(RuntimeError, match="gb and rb are required"):
        cb._C.dgrad(g, rl, p["w8"], sc, v, A, S, mask, 0.25, None, None, dx)
    with pytest.raises(RuntimeError, match="rl must have one element"):
        cb._C.dgrad(g, torch.ones(2, device=DEVICE), p["w8"], sc, None, None, S, None, 0.0, None, None, dx)
