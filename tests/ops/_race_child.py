"""A stand-in for `python -m dorafp8 check SPEC` (dorafp8/backends/race.py's child) that plants a bad kernel:
`_race_child.py MODE VICTIM SPEC` runs the real child with backend VICTIM's forward made wrong (y * 1.25), its
weight_norm made wrong ("wrong-norm": n * 1.25), either hanging (sleeps an hour), crashing the process (exit 7; at
its second forward with "crash-second"), slow (0.2 s more), failing on a full disk ("nospace") or on the machine's
compiler ("nocc", "gcc"), its PTX refused by ptxas ("ptxas"), correct but warning ("warn", a DeprecationWarning
as a compiler's) or printing without a newline ("chatty"); or, whatever VICTIM, the GPU out of memory for the child's second
inputs ("inputs-oom": the user's job beside it holds the memory), or raising a sticky CUDA error ("sticky": every call
of any backend fails after it, as after an illegal address)."""

import os
import subprocess
import sys
import time
import warnings

import torch
from dorafp8 import backends
from dorafp8.ops import race_check

MODE, VICTIM = sys.argv[1], sys.argv[2]


class PTXASError(Exception):  # triton.runtime.errors' name
    pass


TOOLCHAIN = {"nocc": RuntimeError("Failed to find C compiler. Please specify via CC environment variable."),
             "gcc": subprocess.CalledProcessError(1, ["gcc", "main.c"]),  # fatal error: Python.h: No such file
             "ptxas": PTXASError("Internal Triton PTX codegen error\n`ptxas` stderr:\nptxas fatal")}
CALLS = []
_real = backends.module


class Planted:
    def __init__(self, mod):
        self.mod = mod

    def __getattr__(self, name):
        fn = getattr(self.mod, name)
        return self._planted(fn, name) if name in ("forward", "weight_norm") else fn

    @staticmethod
    def _planted(fn, name):
        def planted(*args, **kw):
            if MODE == "sticky":
                CALLS.append("sticky")
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            if MODE == "hang":
                time.sleep(3600)
            CALLS.append(name)
            if MODE == "crash" or (MODE == "crash-second" and CALLS.count("forward") == 2):
                os._exit(7)
            if MODE == "nospace":  # the compiler's cache on a full disk
                raise OSError(28, "No space left on device", "/home/u/.triton/cache/x.tmp")
            if MODE in TOOLCHAIN:  # the machine's compiler, as Triton 3.x raises its failures
                raise TOOLCHAIN[MODE]
            if MODE == "chatty":  # output without a newline, at the C level (a device printf, a compiler's note)
                os.write(1, b"ptxas info    : Used 128 registers")
            if MODE == "warn":
                warnings.warn("a deprecated option of the compiler", DeprecationWarning)
            if MODE == "slow":
                time.sleep(0.2)
            out = fn(*args, **kw)
            if MODE == "wrong" and name == "forward":
                return out[0] * 1.25, out[1]
            return out * 1.25 if MODE == "wrong-norm" and name == "weight_norm" else out
        return planted


if MODE == "inputs-oom":
    from dorafp8.ops import _race_child

    _real_inputs = _race_child._inputs

    def _inputs(*args, **kw):
        CALLS.append("inputs")
        if CALLS.count("inputs") == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")
        return _real_inputs(*args, **kw)

    _race_child._inputs = _inputs
if MODE == "sticky":
    from dorafp8.ops import _race_child

    _race_child._device_ok = lambda device: "sticky" not in CALLS
    _healthy = _real
    _real = lambda name: (_ for _ in ()).throw(RuntimeError("CUDA error: an illegal memory access was encountered")) \
        if "sticky" in CALLS else _healthy(name)
backends.module = lambda name: Planted(_real(name)) if name == VICTIM else _real(name)
sys.exit(race_check(sys.argv[3:]))
