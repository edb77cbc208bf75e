"""A stand-in for `python -m dorafp8 check SPEC` (dorafp8/ops/_race.py's child) that plants a bad kernel:
`_race_child.py MODE VICTIM SPEC` runs the real child with backend VICTIM's forward made wrong (y * 1.25), hanging
(sleeps an hour), crashing the process (exit 7) or slow (0.2 s more)."""

import os
import sys
import time

from dorafp8 import backends
from dorafp8.ops import race_check

MODE, VICTIM = sys.argv[1], sys.argv[2]
_real = backends.module


class Planted:
    def __init__(self, mod):
        self.mod = mod

    def __getattr__(self, name):
        fn = getattr(self.mod, name)
        return self._forward(fn) if name == "forward" else fn

    @staticmethod
    def _forward(fn):
        def forward(*args, **kw):
            if MODE == "hang":
                time.sleep(3600)
            if MODE == "crash":
                os._exit(7)
            if MODE == "slow":
                time.sleep(0.2)
            y, z = fn(*args, **kw)
            return (y * 1.25, z) if MODE == "wrong" else (y, z)
        return forward


backends.module = lambda name: Planted(_real(name)) if name == VICTIM else _real(name)
sys.exit(race_check(sys.argv[3:]))
