"""Shared by every test: the environment the kernels run in, and the one backend parametrization."""

import os
import random
import zlib

import pytest
import torch

# Without a GPU the Triton backend runs in Triton's interpreter on CPU tensors. It must be switched on before
# any @triton.jit kernel is defined, i.e. before dorafp8.triton_kernels is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# On a GPU backend="auto" checks the backends in a child process at each new key (dorafp8/backends/race.py): the tests run
# the static order, the same on every run; tests/ops/test_race.py turns the checks on where it tests them.
os.environ.setdefault("DORAFP8_RACE", "0")

# Every device here. A test that takes `backend` without `device` runs on the last one: the GPU where there is one.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
_LOOKED_AT = set()  # the devices whose backends were listed, for the summary


@pytest.fixture(scope="session", autouse=True)
def _poison_outputs():
    """Kernels fill their outputs with NaN before launch in tests, so an unwritten tile cannot pass (a test may turn
    it off with monkeypatch.setattr(base, "POISON_OUTPUTS", False)). Not an environment variable: a user's process
    never fills them."""
    from dorafp8.backends import base

    base.POISON_OUTPUTS = True
    yield
    base.POISON_OUTPUTS = False


@pytest.fixture(autouse=True)
def _seeded(request):
    """Each test starts from a seed of its own (its node id's CRC-32): a draw the test does not seed itself (an upstream
    gradient from randn_like, say) is the same in every run and under any test order or worker, so no test passes or
    fails by the luck of the draw, and a failure reproduces."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    random.seed(seed)


def pytest_configure(config):
    config.addinivalue_line("markers", "backends(*names): run a test that takes `backend` on these backends only "
                                       "(those of them that can run here)")


def pytest_generate_tests(metafunc):
    """A test that takes `backend` runs once per backend that can run here (dorafp8.backends.available_backends):
    with `device` too, once per (device, backend) pair over DEVICES; without, on DEVICES[-1].
    @pytest.mark.backends("reference", "triton") narrows the list. A backend that cannot run is left out, not
    skipped; the summary at the end names those left out and why."""
    if "backend" not in metafunc.fixturenames:
        return
    # Imported here, not at the top: the test modules decide whether peft or dorafp8 is imported first.
    from dorafp8 import backends

    mark = metafunc.definition.get_closest_marker("backends")
    wanted = mark.args if mark else backends.BACKENDS
    if "device" in metafunc.fixturenames:
        cases = [(d, b) for d in DEVICES for b in backends.available_backends(d) if b in wanted]
        metafunc.parametrize("device,backend", cases, ids=[f"{d}-{b}" for d, b in cases])
        _LOOKED_AT.update(DEVICES)
    else:
        metafunc.parametrize("backend", [b for b in backends.available_backends(DEVICES[-1]) if b in wanted])
        _LOOKED_AT.add(DEVICES[-1])


def pytest_terminal_summary(terminalreporter):
    # Under pytest-xdist (README's -n 2) the workers collect and this process, which writes the summary, does not:
    # it names what every device here leaves out.
    if terminalreporter.config.pluginmanager.hasplugin("dsession"):
        _LOOKED_AT.update(DEVICES)
    if not _LOOKED_AT:
        return
    from dorafp8 import backends

    for device in DEVICES:
        if device in _LOOKED_AT:
            left_out = [f"{b} ({backends.unavailable_reason(b, torch.device(device))})"
                        for b in backends.BACKENDS if backends.unavailable_reason(b, torch.device(device)) is not None]
            terminalreporter.write_line(f"backend tests on {device} left out: {'; '.join(left_out) or 'none'}")
