"""What the CUDA extension dorafp8._C is built from and with: plain literals and stdlib-only helpers (nvcc -gencode
flags, the default number of nvcc jobs, the CUDA headers of the nvidia pip wheels). setup.py, backends/cuda_build.py,
the kernel report and the CPU emulator all read it by path, so they compile what the extension builds; a file of its
own because wheels ship it (as dorafp8/csrc/ package data) but not setup.py."""

# The CUDA kernel files, one translation unit per kernel family, so that ninja builds them (and binding.cpp) in
# parallel, MAX_JOBS at a time. tests/integration/test_inspect.py checks that it names every .cu file here.
CUDA_SOURCES = ["weight_norm.cu", "forward.cu", "dgrad.cu"]
# The files a build reads, as globs in csrc/: what pyproject.toml's package data ships as dorafp8/csrc/ (the same list
# there; tests/integration/test_layout.py compares them), and what sources_hash hashes.
SOURCE_FILES = ["*.cu", "*.cpp", "*.h", "common/*.cuh"]

# The targets setup.py builds when DORAFP8_CUDA_ARCHS is not set: Ada (sm_89: RTX 4090, L40S), Hopper (sm_90a: H100,
# H200), datacenter Blackwell (sm_100: B200; a plain sm_100 cubin also runs on B300's sm_103) and consumer Blackwell
# (sm_120: RTX 5090, RTX PRO 6000; also runs on sm_121), plus PTX of sm_89 for any other GPU from 8.9 on. The kernels
# use mma.sync, so none needs an arch-specific target; Hopper's stays sm_90a, as it always was.
# The kernel report compiles the same targets (dorafp8/kernel_report/records.py, CUDA_CODE).
DEFAULT_CUDA_ARCHS = "89;90a;100;120"

# C++20: torch's own headers require it from 2.10 on (and older torch builds fine with it).
CXX_FLAGS = ["-O3", "-std=c++20"]
# setup.py adds one -gencode per target arch; the kernel report adds its own.
NVCC_FLAGS = ["-O3", "-std=c++20", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr"]


def cuda_archs(value) -> list:
    """The archs a DORAFP8_CUDA_ARCHS value names ("90a", "89;90a", "89, 90a", "89 90a"), also spelled as torch's
    TORCH_CUDA_ARCH_LIST ("9.0", "9.0a+PTX") or nvcc's ("sm_90a"), which nvcc refused as "compute_9.0" mid-build; [] for
    None or a value that names none ("", ";"), which leaves the choice to the caller's default as an unset variable
    does. Anything else is a ValueError naming the variable."""
    import re

    archs = []
    for entry in re.split(r"[;,\s]+", value or ""):
        if not entry:
            continue
        m = re.fullmatch(r"(?:sm_|compute_)?(\d+)\.?(\d)([af]?)(?:\+PTX)?", entry, re.IGNORECASE)
        if m is None:
            raise ValueError(f"DORAFP8_CUDA_ARCHS={value!r}: {entry!r} is not a GPU architecture; expected nvcc's "
                             "numbers, e.g. DORAFP8_CUDA_ARCHS='89;90a;100;120' (or '8.9;9.0a', 'sm_90a')")
        arch = m[1] + m[2] + m[3].lower()
        if arch not in archs:
            archs.append(arch)
    return archs


def gencode(archs: list) -> list:
    """nvcc's -gencode flags for `archs` ("89", "90a", ...): a cubin for each, and PTX of the oldest portable one, so
    that every GPU without a cubin here can JIT it. PTX runs on its own arch and every later one, so compute_120 PTX
    would leave out 11.0 (Thor), which compute_89 PTX covers; arch-specific targets ("90a", "100f") make PTX that runs
    on that arch only. The kernels' instructions (mma.sync, cp.async, ldmatrix, the e4m3 cvt) are sm_89's anyway. The
    PTX comes from the same compile pass as that arch's cubin."""
    portable = sorted((a for a in archs if a.isdigit()), key=int)
    ptx_arch = portable[0] if portable else archs[-1]
    flags = []
    for a in archs:
        code = f"[sm_{a},compute_{a}]" if a == ptx_arch else f"sm_{a}"
        flags += ["-gencode", f"arch=compute_{a},code={code}"]
    return flags


def covering(archs: list, major: int, minor: int):
    """The one of `archs` ("89", "90a", "100", ...) whose cubin runs on a GPU of compute capability major.minor, or
    None: its own arch, else the portable one of its major with the latest earlier minor (a cubin runs on the later
    minors of its major: sm_100's on B300's sm_103, sm_120's on sm_121, which an nvcc older than the GPU, 12.8's,
    cannot build for)."""
    best = None
    for a in archs:
        num = a.rstrip("af")
        m, n = int(num[:-1]), int(num[-1])
        if m == major and (n == minor or (n < minor and num == a)) and (best is None or n > best[1]):
            best = (a, n)
    return best and best[0]


def sources_hash(src: str) -> str:
    """sha256 of the SOURCE_FILES in `src`, names and bytes: what a build compiled. setup.py compiles it into the
    extension (dorafp8._C.SOURCES), so that an in-place build older than its sources (an editable install after a
    `git pull`: kernels that may read their arguments another way) is known and not used (dorafp8/backends/cuda.py);
    the build on first use keys its cache folder by it. Only the files a wheel ships count, as its package data's glob
    finds them (no hidden files): an editor's `.#forward.cu`, or a stray csrc/old/forward.cu, in the checkout a wheel
    is built from must not make that wheel's own extension stale."""
    import glob
    import hashlib
    import os

    h = hashlib.sha256()
    files = sorted({f.replace(os.sep, "/") for p in SOURCE_FILES for f in glob.glob(p, root_dir=src)})
    for rel in files:
        with open(os.path.join(src, rel), "rb") as f:
            h.update(rel.encode() + b"\0" + f.read())
    return h.hexdigest()


def cuda_home():
    """The CUDA toolkit a build uses, in torch's order: $CUDA_HOME, $CUDA_PATH, the toolkit nvcc on PATH is in (a
    cluster's `module load cuda/12.4` puts its own there, beside an older /usr/local/cuda), /usr/local/cuda; each
    taken only if it has bin/nvcc (bin/nvcc.exe on Windows), and PATH's only if it has include/cuda_runtime.h too (an
    nvcc on PATH may be a wrapper script outside any toolkit, /usr/local/bin/nvcc). None if none. setup.py and the
    build on first use both take it, not torch's guess (cpp_extension.CUDA_HOME), which takes $CUDA_HOME as set
    (empty, or a toolkit since removed) and PATH's nvcc unchecked."""
    import glob
    import os
    import shutil

    nvcc = shutil.which("nvcc")
    on_path = nvcc and os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    if on_path and not (os.path.isfile(os.path.join(on_path, "include", "cuda_runtime.h"))  # conda: targets/<arch>/
                        or glob.glob(os.path.join(glob.escape(on_path), "targets", "*", "include", "cuda_runtime.h"))):
        on_path = None
    for cand in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), on_path, "/usr/local/cuda"):
        # nvcc.exe: a Windows toolkit's (the CUDA installer sets CUDA_PATH to it)
        if cand and any(os.path.isfile(os.path.join(cand, "bin", n)) for n in ("nvcc", "nvcc.exe")):
            return cand
    return None


def toolkit(home: str) -> str:
    """The toolkit a build takes (cuda_home's `home`), as its messages name it: torch's "The detected CUDA version
    (12.1) mismatches the version that was used to compile PyTorch" names no folder, and a $CUDA_HOME without nvcc (a
    toolkit since removed or upgraded) is passed over for another, which the user did not choose."""
    import os

    env = os.environ.get("CUDA_HOME")
    passed = env and os.path.realpath(env) != os.path.realpath(home)
    return f"the CUDA toolkit in {home}" + (f" ($CUDA_HOME={env} has no bin/nvcc)" if passed else "")


def default_max_jobs() -> str:
    """Parallel nvcc jobs without MAX_JOBS: at most the cores and free memory / 3 GiB (nvcc on torch headers)."""
    import os

    try:
        with open("/proc/meminfo") as f:
            avail_kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable"))
        by_mem = max(1, avail_kb // (3 * 1024 * 1024))
    except (OSError, StopIteration, ValueError):
        by_mem = 1
    return str(max(1, min(os.cpu_count() or 1, by_mem)))


def wheel_include_dirs() -> list:
    """The nvidia pip wheels' include folders (nvidia/cu13/include): a bare CUDA toolkit may lack cusparse.h."""
    import os

    try:
        import nvidia
    except ImportError:
        return []
    return [d for d in (os.path.join(root, "cu13", "include") for root in nvidia.__path__) if os.path.isdir(d)]
