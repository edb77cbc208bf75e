import os

import torch

# Without a GPU the Triton backend runs in Triton's interpreter on CPU tensors. It must be switched on before
# any @triton.jit kernel is defined, i.e. before dorafp8.triton_kernels is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Kernels fill their outputs with NaN before launch in tests, so an unwritten tile cannot pass.
os.environ.setdefault("DORAFP8_POISON", "1")
