"""What the CUDA extension dorafp8._C is built from and with, as plain literals (no imports).

setup.py reads this file by path (runpy) to build the extension, and the kernel report (python -m
dorafp8.kernel_report, docs/INSPECT.md) and the CPU emulator's build (tests/kernels/test_cuda_emulated.py) read the same
lists, so that what they compile is what the extension builds. A file of its own rather than literals in setup.py
because installed wheels do not ship setup.py: they ship this file with the sources, as dorafp8/csrc/ package data.
"""

# The CUDA kernel files, one translation unit per kernel family, so that ninja builds them (and binding.cpp) in
# parallel, MAX_JOBS at a time. tests/integration/test_inspect.py checks that it names every .cu file here.
CUDA_SOURCES = ["weight_norm.cu", "forward.cu", "dgrad.cu"]

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
