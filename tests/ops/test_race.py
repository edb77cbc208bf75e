"""The race behind backend="auto" (dorafp8/ops/_race.py), on CPU: `native` and `reference` made the racing candidates
of the CPU (a GPU's are triton, cuda and cublas) and the timer injected, so that what is checked is the machinery: the
pick follows the timer, is kept in the process and on disk and reused, is made again for a new key, changes neither
the result nor the random stream, is never made under a CUDA graph capture or a torch.compile trace, leaves a failing
candidate out with a warning (the step goes on), and yields to a backend that is forced. The same pick on every rank
of a 2-process job: tests/distributed/test_distributed.py, test_race_picks_are_rank_0s."""

import json
import os
import subprocess
import sys

import pytest
import torch

import dorafp8
from dorafp8 import backends
from dorafp8.ops import _race

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")  # a candidate failing where none should fails
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N, K, r, s = 24, 32, 4, 0.5


class Timer:
    """Times each candidate as told (seconds), after running it once as the real timer does; counts the calls."""

    def __init__(self, **seconds):
        self.seconds, self.calls = seconds, []

    def __call__(self, name, fn, device):
        self.calls.append(name)
        fn()
        return self.seconds[name]


@pytest.fixture
def race(monkeypatch, tmp_path):
    """The CPU races native against reference; picks go to tmp_path; nothing forces a backend."""
    monkeypatch.setitem(_race.RACERS, "cpu", ("native", "reference"))
    monkeypatch.setenv("DORAFP8_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DORAFP8_RACE", "1")
    monkeypatch.delenv("DORAFP8_BACKEND", raising=False)
    _race.forget()
    yield tmp_path
    _race.forget()


@pytest.fixture
def used(monkeypatch):
    """The backends whose functions the ops call, in order (a spy on backends.module)."""
    names, real = [], backends.module

    def spy(name):
        names.append(name)
        return real(name)

    monkeypatch.setattr(backends, "module", spy)
    return names


def _layer(seed=0, n=N):
    g = torch.Generator().manual_seed(seed)
    w8, scale = dorafp8.quantize_e4m3(torch.randn(n, K, generator=g) / K ** 0.5)
    A = (torch.randn(r, K, generator=g) / K ** 0.5).requires_grad_()
    B = (torch.randn(n, r, generator=g) / 2).requires_grad_()
    m = (torch.rand(n, generator=g) + 0.5).requires_grad_()
    return w8, scale, A, B, m


def _step(M, p=0.0, n=N, **kw):
    """One forward + backward of a DoRA layer with `M` tokens (autograd on x, A, B, m); returns y."""
    w8, scale, A, B, m = _layer(n=n)
    x = torch.randn(M, K, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(M)).requires_grad_()
    y = dorafp8.dora_fp8_linear(x, w8, scale, A, B, m, s, dropout_p=p, training=True, **kw)
    y.float().square().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (x, A, B, m))
    return y


@pytest.mark.parametrize("fast,slow", [("native", "reference"), ("reference", "native")])
def test_the_pick_follows_the_timer_and_serves_later_calls(race, used, monkeypatch, fast, slow):
    timer = Timer(**{fast: 1e-3, slow: 2e-3})
    monkeypatch.setattr(_race, "TIMER", timer)
    _step(40)
    assert sorted(timer.calls) == ["native", "reference"]  # each candidate timed once
    used.clear()
    _step(50)  # another M in the same bucket (33..64): no race, the pick runs it
    assert len(timer.calls) == 2
    assert set(used) == {fast}


def test_a_new_key_is_raced_again(race, monkeypatch):
    timer = Timer(native=1e-3, reference=2e-3)
    monkeypatch.setattr(_race, "TIMER", timer)
    _step(40)
    for kw in (dict(M=100), dict(M=40, p=0.25), dict(M=40, n=16)):  # another M bucket, dropout, N
        _step(**kw)
    assert len(timer.calls) == 2 * 4
    # the plain fp8 linear is an op of its own
    dorafp8.fp8_linear(torch.randn(40, K).requires_grad_(), *_layer()[:2]).sum().backward()
    assert len(timer.calls) == 2 * 5


def test_the_pick_is_kept_on_disk_and_read_by_a_new_process(race, monkeypatch):
    monkeypatch.setattr(_race, "TIMER", Timer(native=3e-3, reference=1e-3))
    _step(40)
    files = os.listdir(race)
    assert len(files) == 1 and files[0].startswith("race-cpu-") and files[0].endswith(".json")  # no temporary left
    data = json.loads((race / files[0]).read_text())
    assert data["device"] == "cpu" and data["versions"]["torch"] == torch.__version__
    assert data["versions"]["dorafp8"] == dorafp8.__version__
    entry = data["picks"]["dora bfloat16 w8a16 nodrop N=24 K=32 M<=64"]
    assert entry["pick"] == "reference" and entry["ms"] == {"native": 3.0, "reference": 1.0} and entry["M"] == 40
    # another process, whose timer fails if called: the file decides
    code = ("import torch, dorafp8; from dorafp8.ops import _race; from dorafp8 import backends\n"
            "_race.RACERS['cpu'] = ('native', 'reference')\n"
            "def timer(*a): raise AssertionError('raced again')\n"
            "_race.TIMER = timer; used = []; real = backends.module\n"
            "backends.module = lambda n: used.append(n) or real(n)\n"
            "w8, sc = dorafp8.quantize_e4m3(torch.randn(24, 32))\n"
            "A, B, m = torch.randn(4, 32), torch.randn(24, 4), torch.rand(24) + 0.5\n"
            "dorafp8.dora_fp8_linear(torch.randn(60, 32, dtype=torch.bfloat16), w8, sc, A, B, m, 0.5)\n"
            "print(sorted(set(used)))")
    env = dict(os.environ, DORAFP8_CACHE_DIR=str(race), DORAFP8_RACE="1", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "['reference']"


def test_the_race_changes_neither_the_result_nor_the_random_stream(race, monkeypatch):
    """With dropout the call draws a mask: the raced call must draw the same one as an unraced call, and leave the
    generator where that call leaves it (the trials run under their own RNG state)."""
    monkeypatch.setattr(_race, "TIMER", Timer(native=1e-3, reference=2e-3))  # native: what "auto" runs unraced
    torch.manual_seed(5)
    y_raced, after_raced = _step(40, p=0.3), torch.rand(3)
    monkeypatch.setenv("DORAFP8_RACE", "0")
    torch.manual_seed(5)
    y_plain, after_plain = _step(40, p=0.3), torch.rand(3)
    assert torch.equal(y_raced, y_plain) and torch.equal(after_raced, after_plain)


def test_a_failing_candidate_is_left_out_with_a_warning(race, used, monkeypatch):
    timer = Timer(native=2e-3, reference=1e-3)  # reference would win, but it raises
    monkeypatch.setattr(_race, "TIMER", timer)
    real = backends.module

    class Broken:
        def __getattr__(self, name):
            raise RuntimeError("a kernel that does not run here")

    monkeypatch.setattr(backends, "module", lambda name: Broken() if name == "reference" else real(name))
    with pytest.warns(RuntimeWarning, match=r"backend 'reference' failed while racing dora bfloat16 w8a16 nodrop "
                                            r"N=24 K=32 M<=64 and is left out of it: RuntimeError: a kernel"):
        _step(40)  # the training step itself goes on, on the candidate that ran
    assert timer.calls == ["native", "reference"] and set(used) == {"native"}


def test_when_every_candidate_fails_the_static_order_serves(race, monkeypatch):
    def timer(name, fn, device):
        raise RuntimeError(f"{name} is broken")

    monkeypatch.setattr(_race, "TIMER", timer)
    with pytest.warns(RuntimeWarning, match="failed while racing") as w:
        _step(40)
    assert len(w) == 2
    with open(_race.cache_file(torch.device("cpu"))) as f:
        entry = json.load(f)["picks"]["dora bfloat16 w8a16 nodrop N=24 K=32 M<=64"]
    assert entry["pick"] == "native" and entry["ms"] == {}  # the static order, kept: not raced again


@pytest.mark.parametrize("how", ["argument", "environment", "off"])
def test_a_forced_backend_is_never_raced(race, used, monkeypatch, how):
    timer = Timer(native=1e-3, reference=2e-3)
    monkeypatch.setattr(_race, "TIMER", timer)
    kw = {}
    if how == "argument":
        kw = dict(backend="reference")
    elif how == "environment":
        monkeypatch.setenv("DORAFP8_BACKEND", "reference")
    else:
        monkeypatch.setenv("DORAFP8_RACE", "0")
    _step(40, **kw)
    assert timer.calls == [] and set(used) == {"native" if how == "off" else "reference"}


def test_on_by_default_on_a_gpu_only(monkeypatch):
    monkeypatch.delenv("DORAFP8_RACE", raising=False)
    monkeypatch.delenv("DORAFP8_BACKEND", raising=False)
    assert _race.racing("auto", torch.device("cuda")) and _race.racing(None, torch.device("cuda", 1))
    assert not _race.racing("auto", torch.device("cpu")) and not _race.racing("triton", torch.device("cuda"))


def test_never_raced_under_a_cuda_graph_capture(race, used, monkeypatch):
    """Under a capture (nothing may sync): the pick where one was made, else the static order, and no race; the key is
    raced at its first call outside a capture."""
    timer = Timer(native=2e-3, reference=1e-3)
    monkeypatch.setattr(_race, "TIMER", timer)
    monkeypatch.setattr(_race, "_capturing", lambda device: True)
    _step(40)
    assert timer.calls == [] and set(used) == {"native"}
    monkeypatch.setattr(_race, "_capturing", lambda device: False)
    _step(40)
    assert len(timer.calls) == 2
    monkeypatch.setattr(_race, "_capturing", lambda device: True)
    used.clear()
    _step(40)
    assert len(timer.calls) == 2 and set(used) == {"reference"}


def test_never_raced_under_torch_compile(race, monkeypatch):
    timer = Timer(native=2e-3, reference=1e-3)
    monkeypatch.setattr(_race, "TIMER", timer)
    torch._dynamo.reset()
    w8, scale, A, B, m = _layer()
    f = torch.compile(lambda x: dorafp8.dora_fp8_linear(x, w8, scale, A, B, m, s), fullgraph=True,
                      backend="aot_eager")
    x = torch.randn(40, K)
    torch.testing.assert_close(f(x), dorafp8.dora_fp8_linear(x, w8, scale, A, B, m, s, backend="native"))
    assert timer.calls == []


def test_python_m_dorafp8_prints_the_picks(race, monkeypatch):
    from dorafp8.__main__ import report

    monkeypatch.setattr(_race, "TIMER", Timer(native=3e-3, reference=1.5e-3))
    _step(40)
    text = report()
    assert f"1 cache file in {race}" in text
    assert "dora bfloat16 w8a16 nodrop N=24 K=32 M<=64 -> reference (1.500 ms; reference 1.00x, native 2.00x)" in text
