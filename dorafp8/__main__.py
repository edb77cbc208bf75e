"""`dorafp8` / `python -m dorafp8`: what this installation can run (versions, devices, backends and why one is
missing); `dorafp8 run [options] -- <command>` runs a trainer's command with dorafp8 installed (dorafp8/launcher.py)."""

from __future__ import annotations

import importlib.metadata
import platform
import sys

import torch


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def report() -> str:
    import dorafp8
    from dorafp8 import backends
    from dorafp8._deps import triton_version
    from dorafp8.backends import cuda as cuda_backend

    lines = [f"dorafp8 {dorafp8.__version__} (python {platform.python_version()}, torch {torch.__version__}, "
             f"triton {triton_version() or 'not installed'}, peft {_version('peft')}, "
             f"transformers {_version('transformers')})"]
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices.append("cuda")
        major, minor = torch.cuda.get_device_capability()
        lines.append(f"GPU: {torch.cuda.get_device_name()} (sm_{major}{minor})")
    else:
        lines.append("GPU: none visible to torch")
    lines.append(f"CUDA extension dorafp8._C: {cuda_backend.extension_status()}")
    lines += [f"refused setting: {why}" for why in refused_settings()]
    for dev in devices:
        try:
            auto = backends.resolve("auto", torch.device(dev))
        except ValueError:  # DORAFP8_BACKEND: said above
            auto = "refused (DORAFP8_BACKEND)"
        lines.append(f"backends on {dev}: auto -> {auto}")
        for name in backends.BACKENDS:
            why = backends.unavailable_reason(name, torch.device(dev))
            lines.append(f"  {name:<10} {'ok' if why is None else why}")
    from dorafp8.ops import race_report  # what backend="auto" picked on this machine's GPUs, and the others' times

    return "\n".join(lines + race_report())


def refused_settings() -> list[str]:
    """Why each DORAFP8_* value set here would be refused by the call that reads it (a switch set to "true", a backend
    or an arch misspelt): said here, where a new user looks first, rather than at the first GPU step of a training
    run, or never on a CPU, which reads few of them. (A misspelt name is `import dorafp8`'s warning.)"""
    import os

    from dorafp8 import _env, backends
    from dorafp8.backends import cuda_build

    checks = [lambda n=n: _env.flag(n) for n in _env.SWITCHES] + [backends.env_backend]
    if cuda_build.source_dir() is not None:
        checks.append(lambda: cuda_build.build_spec()["cuda_archs"](os.environ.get("DORAFP8_CUDA_ARCHS")))
    out = []
    for check in checks:
        try:
            check()
        except ValueError as e:
            out.append(str(e))
    return out


USAGE = ("usage: dorafp8             what this installation can run (dorafp8 --version: its version)\n"
         "       dorafp8 selftest      checks the kernels backend='auto' may run on this GPU now\n"
         "       dorafp8 check SPEC    checks one key's candidates as backend='auto' does (its warnings print the "
         "command)\n"
         "       dorafp8 run [--quantize] [--include-conv] [--per-row-scale] [--w8a8] -- <the trainer's "
         "command>\n                          runs it with dorafp8 installed (dorafp8 run --help)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command, rest = (argv[0], argv[1:]) if argv else (None, [])
    helped = rest[:1] in (["-h"], ["--help"])
    # DORAFP8_BACKEND=Triton: one line, not the traceback of its reader (for `run`, not the trainer's first GPU step)
    if command in ("run", "selftest", "check") and not helped and (refused := refused_settings()):
        print("\n".join(f"dorafp8: {why}" for why in refused), file=sys.stderr)
        return 2
    if command == "run":
        from .launcher import main as run

        return run(rest)
    if command in ("selftest", "check"):  # dorafp8/backends/race.py: check kernels on this GPU now
        # `check --help` died on json.loads('--help'); `selftest --help` (or `selftest cuda:1`) ran the selftest
        if helped:
            print(USAGE)
            return 0
        from .ops import race_check, race_selftest

        if command == "check":  # the child backend="auto" runs (and the command its warnings print)
            return race_check(rest)
        if rest:
            print(f"dorafp8 selftest takes no arguments, got {' '.join(rest)!r}\n{USAGE}", file=sys.stderr)
            return 2
        race_selftest(say=lambda line: print(line, flush=True))
        return 0
    if command in ("-h", "--help"):
        print(USAGE)
        return 0
    if command in ("-V", "--version"):  # printed the report (which starts with it) before unknown commands were
        from . import __version__  # refused; a script's `dorafp8 --version` then stopped with exit 2

        print(f"dorafp8 {__version__}")
        return 0
    if argv:  # `dorafp8 runn -- trl sft ...` printed the report, exit 0, and the trainer never ran
        print(f"dorafp8: unknown command {argv[0]!r}\n{USAGE}", file=sys.stderr)
        return 2
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
