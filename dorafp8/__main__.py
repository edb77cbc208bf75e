"""python -m dorafp8: what this installation can run (versions, devices, backends and why one is missing)."""

from __future__ import annotations

import importlib.metadata
import platform

import torch


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def report() -> str:
    import dorafp8
    from dorafp8 import backends
    from dorafp8.backends import cuda as cuda_backend

    lines = [f"dorafp8 {dorafp8.__version__} (python {platform.python_version()}, torch {torch.__version__}, "
             f"triton {_version('triton')}, peft {_version('peft')}, transformers {_version('transformers')})"]
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices.append("cuda")
        major, minor = torch.cuda.get_device_capability()
        lines.append(f"GPU: {torch.cuda.get_device_name()} (sm_{major}{minor})")
    else:
        lines.append("GPU: none visible to torch")
    lines.append(f"CUDA extension dorafp8._C: {cuda_backend.extension_status()}")
    for dev in devices:
        lines.append(f"backends on {dev}: auto -> {backends.resolve('auto', torch.device(dev))}")
        for name in backends.BACKENDS:
            why = backends.unavailable_reason(name, torch.device(dev))
            lines.append(f"  {name:<10} {'ok' if why is None else why}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
