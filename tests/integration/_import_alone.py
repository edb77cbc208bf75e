"""Imports each named module first thing in a process of its own; prints {name: "" or the error's last line} as JSON.

    python tests/integration/_import_alone.py dorafp8.ops dorafp8.nn ... [--jobs 2]

test_layout.py's test_every_module_imports_on_its_own runs this. One process per module as a fresh interpreter would
be, but forked from this one after it imported torch and numpy: those two take most of a fresh interpreter's start
(about 2 s each time, 74 times), and what the check looks for, an import of dorafp8 that works only after another
module of dorafp8 was imported, does not depend on them. Nothing else is imported here before the fork: not dorafp8,
not Triton, peft or transformers (dorafp8's import hooks behave differently when peft is already imported), so each
child imports those itself, as a user's first import would. `dorafp8.__main__` is run as `python -m dorafp8` runs it.
"""

import json
import os
import runpy
import sys
import traceback
import warnings

import numpy  # noqa: F401  (preloaded before the forks, see above)
import torch  # noqa: F401


def _child(name: str, fd: int) -> None:
    err = ""
    try:
        warnings.simplefilter("ignore")
        if name == "dorafp8.__main__":
            sys.argv = ["dorafp8"]  # `python -m dorafp8`, no arguments (this script's would be an unknown command)
            runpy.run_module("dorafp8", run_name="__main__", alter_sys=True)
        else:
            __import__(name)
    except SystemExit as e:
        err = "" if e.code in (None, 0) else f"SystemExit: {e.code}"
    except BaseException:
        err = traceback.format_exc().strip().splitlines()[-1]
    os.write(fd, err.encode())
    os.close(fd)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str]) -> dict[str, str]:
    jobs = 2
    if "--jobs" in argv:
        i = argv.index("--jobs")
        jobs = int(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    todo, running, results = list(argv), {}, {}

    def reap() -> None:
        pid, status = os.wait()
        name, fd = running.pop(pid)
        with os.fdopen(fd, "rb") as f:
            err = f.read().decode(errors="replace")
        if not err and status != 0:
            err = f"the child died (wait status {status})"
        results[name] = err

    while todo or running:
        if todo and len(running) < jobs:
            name = todo.pop(0)
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(r)
                _child(name, w)
            os.close(w)
            running[pid] = (name, r)
        else:
            reap()
    return results


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
