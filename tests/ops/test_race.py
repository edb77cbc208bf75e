"""backend="auto" on a GPU runs only kernels checked there, in a child process (dorafp8/backends/race.py), tested on CPU:
the CPU made a device that races (`native`, or `native` and `reference`, as candidates), and the child either the
real one with a planted bad kernel (tests/ops/_race_child.py: wrong, hanging, crashing, slow) or a fake that only
prints verdicts (cheap: no torch import). What is checked: a wrong kernel is never picked; a hanging or crashing one
costs one warning and a fallback within the limit, and is not tried again by the next process; the key separates what
changes a kernel; a new build is checked again; a first call under checkpointing, saved-tensor hooks, autocast and
inference mode is the same as with DORAFP8_RACE=0 and dispatches no extra op in the user's process; under a CUDA graph
capture no child starts; the child's peak memory (measured) is within _race.budget. The same verdict on every rank of
a 2-process job, and a first step under DDP and FSDP2 the same as with DORAFP8_RACE=0:
tests/distributed/test_distributed.py, test_race_verdicts_are_shared and test_a_first_step_under_ddp_and_fsdp2_..."""

import hashlib
import json
import shlex
import signal
import subprocess
import os
import sys
import time
import warnings

import pytest
import torch
import torch.utils.checkpoint as ckpt
from torch.utils._python_dispatch import TorchDispatchMode

import dorafp8
from dorafp8 import backends
from dorafp8.backends import race as _race

HERE = os.path.dirname(os.path.abspath(__file__))
N, K, r, s = 24, 32, 4, 0.5
CPU = torch.device("cpu")


def fake_child(**ms):
    """A child command that answers every candidate ok at the given milliseconds, without importing torch; it
    appends one line to $RACE_CHILD_LOG per run."""
    code = ("import json, os, sys\n"
            "open(os.environ['RACE_CHILD_LOG'], 'a').write('run\\n')\n"
            f"ms = {ms!r}\n"
            "spec = json.loads(sys.argv[1])\n"
            "res = {c: {'ok': True, 'ms': ms.get(c, 1.0)} for c in spec['cands']}\n"
            "print('dorafp8-race result ' + json.dumps(res))")
    return [sys.executable, "-c", code]


def planted(mode, victim="native"):
    return [sys.executable, os.path.join(HERE, "_race_child.py"), mode, victim]


REAL_CHILD = list(_race.CHILD)  # the real child's command, before the fixture replaces it


@pytest.fixture
def race(monkeypatch, tmp_path):
    """The CPU races `native` alone; verdicts go to tmp_path; the fake child (native at 1 ms) by default."""
    monkeypatch.setitem(_race.RACERS, "cpu", ("native",))
    monkeypatch.setenv("DORAFP8_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("DORAFP8_RACE", "1")
    monkeypatch.setenv("RACE_CHILD_LOG", str(tmp_path / "children.log"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([os.path.dirname(os.path.dirname(HERE)),
                                                       os.environ.get("PYTHONPATH", "")]))
    for k in ("DORAFP8_BACKEND",) + _race.SWITCHES:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(_race, "CHILD", fake_child())
    _race.forget()
    yield tmp_path
    _race.forget()


def children(tmp_path) -> int:
    log = tmp_path / "children.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


@pytest.fixture
def used(monkeypatch):
    """The backends whose functions the ops call in this process (a spy on backends.module)."""
    names, real = [], backends.module
    monkeypatch.setattr(backends, "module", lambda name: names.append(name) or real(name))
    return names


def _layer(seed=0, n=N):
    g = torch.Generator().manual_seed(seed)
    w8, scale = dorafp8.quantize_e4m3(torch.randn(n, K, generator=g) / K ** 0.5)
    A = (torch.randn(r, K, generator=g) / K ** 0.5).requires_grad_()
    B = (torch.randn(n, r, generator=g) / 2).requires_grad_()
    m = (torch.rand(n, generator=g) + 0.5).requires_grad_()
    return w8, scale, A, B, m


def _step(M=40, p=0.0, **kw):
    """One forward + backward of a DoRA layer with `M` tokens; returns y and the gradients."""
    w8, scale, A, B, m = _layer()
    x = torch.randn(M, K, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(M)).requires_grad_()
    y = dorafp8.dora_fp8_linear(x, w8, scale, A, B, m, s, dropout_p=p, training=True, **kw)
    y.float().square().sum().backward()
    return [y.detach()] + [t.grad for t in (x, A, B, m)]


def _verdicts(tmp_path):
    (path,) = [p for p in os.listdir(tmp_path) if p.startswith("race-")]
    return json.loads((tmp_path / path).read_text())


def test_the_first_check_says_what_the_step_waits_for(race, capsys):
    """A first GPU step waits for a child per new key (a Python start and the kernels' compiles: tens of seconds for
    the first) and printed nothing: it read as a hang. The first check of the process says so, once, on stderr;
    keys read from the file start no child and say nothing."""
    _step()
    err = capsys.readouterr().err
    assert err.count("dorafp8: backend='auto' checks its kernels") == 1 and "DORAFP8_RACE=0" in err, err
    _step(300)  # another key, checked: nothing more said
    assert children(race) == 2 and capsys.readouterr().err == ""
    _race.forget()  # the next process: the file serves, nothing said
    _step()
    assert children(race) == 2 and capsys.readouterr().err == ""


def test_a_key_that_cannot_be_checked_within_the_bound_runs_on_the_reference(race, used, monkeypatch):
    """Where even 16 rows at M = 1 would hold more than budget(spec) (a narrow layer whose adapters are most of its
    step), no child starts (the bound has no exception) and the reference serves the key, with no warning."""
    monkeypatch.setattr(_race, "CAP", 1024)  # no check fits in 1 KiB
    monkeypatch.setattr(_race, "CHILD", ["false"])  # a child that fails if started
    spec = _race.spec_of("dora", CPU, N=N, K=K, M=40, r=r, cdt=torch.bfloat16, rdt=torch.float32)
    assert not _race.plan(spec)["fits"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _step()
    assert set(used) == {"reference"} and children(race) == 0
    monkeypatch.setenv("DORAFP8_RACE", "0")
    for a, b in zip(got, _step(backend="reference")):
        assert torch.equal(a, b)


def test_the_real_child_checks_and_times_then_the_file_serves(race, used, monkeypatch):
    monkeypatch.setitem(_race.RACERS, "cpu", ("native", "reference"))
    monkeypatch.setattr(_race, "CHILD", planted("slow", "native"))  # native correct, but 0.2 s slower per call
    _step()
    assert set(used) == {"reference"}
    data = _verdicts(race)
    (what,) = data["keys"]
    assert what == "dora N=24 K=32 M<=64 bfloat16/float32 w8a16 tensor r<=4"
    v = data["keys"][what]
    assert v["native"]["ok"] and v["reference"]["ok"] and v["native"]["ms"] > v["reference"]["ms"]
    assert data["broken"] == {} and data["versions"]["build"] == _race.build_id()
    # the next process: no child (one that fails if run), the file decides
    _race.forget()
    monkeypatch.setattr(_race, "CHILD", ["false"])
    used.clear()
    _step(50)  # same M bucket
    assert set(used) == {"reference"}


@pytest.mark.parametrize("kind", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("mode", ["real", "wrong"])
@pytest.mark.parametrize("racer", ["cublas", "triton"])
def test_a_microscaled_key_is_checked_on_its_own_kind(race, used, monkeypatch, kind, mode, racer):
    """An NVFP4 / MXFP8 layer's key: the real child builds its inputs by the kind's recipe and checks the racer (the
    cuBLAS strategy, or the fused Triton kernels) against the reference; right, it is picked; made wrong, never."""
    if backends.unavailable_reason(racer, torch.device("cpu")) is not None:
        pytest.skip(backends.unavailable_reason(racer, torch.device("cpu")))
    from dorafp8 import quant

    monkeypatch.setitem(_race.RACERS, "cpu", (racer,))
    monkeypatch.setattr(_race, "CHILD", REAL_CHILD if mode == "real" else planted("wrong", racer))
    W = torch.randn(N, K, generator=torch.Generator().manual_seed(1)) / K ** 0.5
    w, scale, g = quant.quantize_nvfp4(W) if kind == "nvfp4" else (*quant.quantize_mxfp8(W), None)
    _, _, A, B, m = _layer()
    x = torch.randn(40, K, dtype=torch.bfloat16).requires_grad_()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dorafp8.dora_fp8_linear(x, w, scale, A, B, m, s, global_scale=g).float().sum().backward()
    assert any(f"'{racer}' is not used" in str(c.message) for c in caught) == (mode == "wrong")
    verdicts = _verdicts(race)["keys"]
    assert verdicts and all(kind in what for what in verdicts), verdicts
    assert all(v[racer]["ok"] == (mode == "real") for v in verdicts.values()), verdicts
    assert (racer in used) == (mode == "real")
    if mode == "wrong":
        assert "reference" in used


@pytest.mark.parametrize("static", ["cublas", "triton"])
def test_ties_go_to_the_static_pick(race, monkeypatch, static):
    """Candidates within MARGIN of each other: the pick is backends.resolve's (cublas for an NVFP4 key on a GPU, whose
    fused Triton loop is not measured yet), then the racers' order; before, always the racers' first (triton)."""
    monkeypatch.setitem(_race.RACERS, "cpu", ("triton", "cublas"))
    monkeypatch.setattr(_race, "CHILD", fake_child(triton=1.0, cublas=1.01))
    monkeypatch.setattr(backends, "unavailable_reason", lambda name, device: None)
    call = dict(N=N, K=K, M=40, r=r, scale="nvfp4", cdt=torch.bfloat16)
    assert _race.choose("dora", static, CPU, frozenset({"nvfp4"}), **call) == static


def test_a_decided_key_is_found_from_the_calls_arguments(race, monkeypatch):
    """A decided key's call builds neither its key nor the static order (~45 us a call, each layer's every op, the
    static order asking for the GPU's capability each time): before, every call did both. What changes the pick
    still does: another M bucket, a switch, DORAFP8_RACE=0, $DORAFP8_BACKEND, a switch's typo (refused)."""
    call = dict(N=N, K=K, M=40, r=r, bias=False, scale="tensor", block=128, cdt=torch.bfloat16, rdt=torch.bfloat16,
                p=0.0, act_quant="")
    select = lambda **kw: _race.select("dora", None, CPU, frozenset(), **dict(call, **kw))  # noqa: E731
    assert select() == "native" and children(race) == 1
    made, real_resolve, real_spec = [], backends.resolve, _race.spec_of
    monkeypatch.setattr(backends, "resolve", lambda *a, **k: made.append("resolve") or real_resolve(*a, **k))
    monkeypatch.setattr(_race, "spec_of", lambda *a, **k: made.append("spec") or real_spec(*a, **k))
    assert [select(M=m) for m in (40, 33, 64)] == ["native"] * 3 and made == [] and children(race) == 1
    _race._PICKS[("cpu", _race.describe(real_spec("dora", CPU, **call)))] = "reference"  # the pick itself is read
    assert select() == "reference"
    assert select(M=65) == "native" and children(race) == 2 and made  # a new bucket: checked
    monkeypatch.setenv("DORAFP8_HOPPER_GEMM", "1")
    assert select() == "native" and children(race) == 3  # a switch: another key
    monkeypatch.setenv("DORAFP8_HOPPER_GEMM", "yes")
    with pytest.raises(ValueError, match="DORAFP8_HOPPER_GEMM must be 0"):
        select()
    monkeypatch.delenv("DORAFP8_HOPPER_GEMM")
    monkeypatch.setenv("DORAFP8_BACKEND", "reference")
    assert select() == "reference"
    monkeypatch.delenv("DORAFP8_BACKEND")
    monkeypatch.setenv("DORAFP8_RACE", "0")
    assert select() == "native"  # the static order (the CPU's), not the key's planted pick
    monkeypatch.setenv("DORAFP8_RACE", "1")
    _race.forget()  # the picks dropped: read from the file again, not from what select() found before
    assert select() == "native" and children(race) == 3


@pytest.mark.parametrize("kind", ["nvfp4", "mxfp8"])
def test_the_child_builds_inputs_of_the_keys_kind(kind):
    """The child's inputs for a microscaled key are of that kind (its recipe's bytes, scales and global scale): with a
    per-tensor fp8 weight instead, the check would pass without running the kind's unpack at all."""
    from dorafp8 import quant
    from dorafp8.ops import _race_child

    spec = _race.spec_of("dora", torch.device("cpu"), N=N, K=K, M=8, r=r, scale=kind, cdt=torch.bfloat16)
    t = _race_child._inputs(spec, 8, N, torch.device("cpu"))
    assert quant.scale_kind(t["scale"]) == kind and quant.weight_dims(t["w8"]) == (N, K)
    assert (t["w8"].dtype == torch.uint8) == (kind == "nvfp4") and (t["global_scale"] is None) == (kind == "mxfp8")


def test_the_child_checks_the_dorafp8_this_process_runs(race, used, monkeypatch):
    """The child imports the dorafp8 its parent runs, whatever its own path finds first: a `dorafp8/` folder in the
    working directory (another version's checkout) answering for the kernels is never asked. Before, `python -m
    dorafp8` put the working directory first: that folder's verdicts were taken for this installation's kernels, and
    where a script had put dorafp8 on sys.path itself, the child found none and every key ran the reference."""
    other = race / "cwd" / "dorafp8"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("")
    (other / "__main__.py").write_text(
        "import json, sys\n"
        f"open({str(race / 'other.log')!r}, 'w').write('asked')\n"
        "print('dorafp8-race result ' + json.dumps({c: {'ok': True, 'ms': 1.0} for c in json.loads(sys.argv[2])"
        "['cands']}))\n")
    monkeypatch.chdir(other.parent)
    monkeypatch.delenv("PYTHONPATH")
    monkeypatch.setattr(_race, "CHILD", REAL_CHILD)
    _step()
    assert not (race / "other.log").exists(), "the working directory's dorafp8 answered for this one's kernels"
    assert "native" in used
    assert all(v["native"]["ok"] and "rows" in v["native"] for v in _verdicts(race)["keys"].values())


def test_the_child_runs_on_the_keys_gpu(monkeypatch):
    """The child makes the key's GPU current before it runs anything: Triton launches on the current device, and the
    child starts on cuda:0, so rank r's key (cuda:r) ran its Triton candidate on GPU 0 with GPU r's pointers (an
    illegal address: the candidate, and the ones after it, failed, and the verdict was kept for every rank). Before,
    nothing set it. A device without an index (selftest's "cuda") is left as it is: set_device refuses it. (On CPU:
    the calls are recorded, and the child stopped at its plan.)"""
    from dorafp8.ops import _race_child

    class Planned(Exception):
        pass

    def stop(spec):
        raise Planned

    made = []
    monkeypatch.setattr(_race_child, "_watchdog", lambda limit, parent: None)
    monkeypatch.setattr(_race_child, "plan", stop)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: made.append(str(device)))
    for device in ("cuda:1", "cuda"):
        spec = _race.spec_of("dora", torch.device(device), N=N, K=K, M=40, r=r, cdt=torch.bfloat16,
                             rdt=torch.float32)
        with pytest.raises(Planned):
            _race_child.main([json.dumps(dict(spec, cands=["triton"]))])
    assert made == ["cuda:1"]


def test_a_wrong_kernel_is_never_picked(race, used, monkeypatch):
    monkeypatch.setattr(_race, "CHILD", planted("wrong"))
    with pytest.warns(RuntimeWarning, match=r"backend 'native' is not used by backend='auto' for dora N=24 K=32 "
                                            r"M<=64 .* on cpu .*torch .*triton .*build .*: y differs from the fp32 "
                                            r"reference .*Reproduce: python -m dorafp8 check") as w:
        got = _step()
    assert len(w) == 1
    assert "native" not in used and set(used) == {"reference"}  # the fallback: the fp32 twin
    monkeypatch.setenv("DORAFP8_RACE", "0")
    want = _step(backend="reference")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert _verdicts(race)["broken"] == {}  # wrong for this key only
    # another key, checked again and wrong again: logged, not warned a second time in this process
    monkeypatch.setenv("DORAFP8_RACE", "1")
    used.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(300)
    assert set(used) == {"reference"} and len(_verdicts(race)["keys"]) == 2


def test_ptxas_rejecting_a_kernel_is_a_verdict_kept(race, used, monkeypatch):
    """Triton's PTXASError ("Internal Triton PTX codegen error": ptxas refusing the PTX Triton made of the kernel) is
    the kernel's on this GPU and Triton; taken for the machine's (98ea6ce), it was not kept and every process checked
    the key again, seconds each, and warned again. A ptxas of the user's (TRITON_PTXAS_PATH) is another file."""
    monkeypatch.setattr(_race, "CHILD", planted("ptxas"))
    with pytest.warns(RuntimeWarning, match="(?s)'native' is not used .*PTXASError.*kept and not retried"):
        _step()
    assert set(used) == {"reference"}
    _race.forget()  # the next process: the verdict read, no child
    monkeypatch.setattr(_race, "CHILD", fake_child())
    used.clear()
    _step()
    assert children(race) == 0 and set(used) == {"reference"}
    before = _race.cache_file(CPU)
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/usr/local/cuda/bin/ptxas")
    assert _race.cache_file(CPU) != before


@pytest.mark.parametrize("mode,error", [("nospace", "No space left on device"), ("nocc", "Failed to find C compiler"),
                                        ("gcc", "CalledProcessError")])
def test_a_full_disk_is_no_verdict_on_the_kernel(race, used, monkeypatch, mode, error):
    """A candidate failing with an OSError (Triton's cache on a full disk or an unwritable TRITON_CACHE_DIR) or on the
    machine's compiler (no C compiler, gcc without Python.h) says nothing of its kernel: not used in
    this process (the reference serves), not kept, checked again by the next process. Before, it was a verdict kept in
    the file: the backend was never used for the key again, disk freed or gcc installed."""
    monkeypatch.setattr(_race, "CHILD", planted(mode))
    with pytest.warns(RuntimeWarning, match=f"'native' is not checked, so not used .*{error}"):
        _step()
    assert set(used) == {"reference"}
    assert all("native" not in v for v in _verdicts(race)["keys"].values()) and not _verdicts(race)["broken"]
    _race.forget()  # the next process, the disk freed: checked again, and used
    monkeypatch.setattr(_race, "CHILD", fake_child())
    used.clear()
    _step()
    assert children(race) == 1 and "native" in used


@pytest.mark.parametrize("typo", [False, True])
def test_the_users_warnings_as_errors_ban_no_kernel(race, used, monkeypatch, typo):
    """PYTHONWARNINGS=error (a strict CI job, a test suite's setting), inherited by the child, made a warning there an
    exception: one a kernel's compiler says (a deprecation) failed a correct candidate, a verdict kept for the key;
    `import dorafp8` warning of a misspelt DORAFP8_* variable killed the child before any candidate, and every key
    ran the reference. The child runs under the default filters: the kernel is checked, passes and is used."""
    monkeypatch.setenv("PYTHONWARNINGS", "error")
    if typo:
        monkeypatch.setenv("DORAFP8_CUDA_ARCH", "90a")
    monkeypatch.setattr(_race, "CHILD", planted("warn"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning of the race's in this process either
        _step()
    assert set(used) == {"native"}
    assert all(v["native"]["ok"] for v in _verdicts(race)["keys"].values()) and not _verdicts(race)["broken"]


def test_the_users_tf32_override_bans_no_kernel(race, used, monkeypatch):
    """NVIDIA_TF32_OVERRIDE=1 (a launcher's or the user's shell's: every fp32 cuBLAS product on tf32 tensor cores,
    whatever torch's flags say) was inherited by the child, whose fp32 reference it rounds to tf32: an exact fp32
    kernel then failed its check, a verdict kept in a file no variable names. The child runs with it at 0. The
    stand-in child fails the kernel where cuBLAS would round its reference."""
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "1")
    code = ("import json, os, sys\n"
            "spec = json.loads(sys.argv[1])\n"
            "exact = os.environ.get('NVIDIA_TF32_OVERRIDE', '0') == '0'\n"
            "v = {'ok': True, 'ms': 1.0} if exact else {'ok': False, 'error': 'dx differs'}\n"
            "res = {c: v for c in spec['cands']}\n"
            "print('dorafp8-race result ' + json.dumps(res))")
    monkeypatch.setattr(_race, "CHILD", [sys.executable, "-c", code])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "not used" warning
        _step()
    assert set(used) == {"native"} and all(v["native"]["ok"] for v in _verdicts(race)["keys"].values())
    assert os.environ["NVIDIA_TF32_OVERRIDE"] == "1"  # the user's own process keeps it


def test_a_child_dying_while_it_makes_inputs_blames_no_kernel(race, used, monkeypatch):
    """The child makes each M's inputs after the previous M's candidates ran: out of memory there (the user's job
    holds the GPU) ended the child with the last candidate of the previous M as the one started, which was blamed:
    kept as unusable on this GPU, for every key, in every later process. It says nothing of a kernel now: not used
    here, not kept, checked again by the next process."""
    assert len(_race.plan(_race.spec_of("dora", CPU, N=N, K=K, M=40, r=r, cdt=torch.bfloat16,
                                        rdt=torch.float32))["check"]) == 2  # the second inputs come after native ran
    monkeypatch.setattr(_race, "CHILD", planted("inputs-oom"))
    with pytest.warns(RuntimeWarning, match=r"'native' is not checked, so not used .*out of memory"):
        _step()
    assert set(used) == {"reference"} and not _verdicts(race)["broken"]
    assert all("native" not in v for v in _verdicts(race)["keys"].values())


def test_a_kernel_that_breaks_the_device_fails_only_itself(race, used, monkeypatch):
    """A candidate that leaves the CUDA context unusable (an illegal address is sticky: every later call in the
    process fails with it) made every candidate after it fail too: cuBLAS's verdict 'failed' was kept for the key
    beside the Triton kernel that broke the device, and the reference served. The child now ends after such a
    verdict, and a new child checks the rest (on CPU the device's state is planted: tests/ops/_race_child.py)."""
    monkeypatch.setitem(_race.RACERS, "cpu", ("native", "reference"))
    monkeypatch.setattr(_race, "CHILD", planted("sticky", "native"))
    with pytest.warns(RuntimeWarning, match=r"backend 'native' is not used .*illegal memory access") as w:
        _step()
    assert len(w) == 1, [str(x.message) for x in w]
    (v,) = _verdicts(race)["keys"].values()
    assert v["native"]["ok"] is False and v["reference"]["ok"] is True and not _verdicts(race)["broken"]
    assert set(used) == {"reference"}


def test_a_kernel_printing_without_a_newline_is_not_mistaken(race, used, monkeypatch):
    """A candidate's own output without a newline (a device printf, a compiler's note, written at the C level) was
    glued to the child's next protocol line: its result line lost, the child "gave no verdict" and the correct kernel
    that ran last was kept as unusable on this GPU for every key. The protocol's lines start lines of their own."""
    monkeypatch.setattr(_race, "CHILD", planted("chatty"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step()
    assert set(used) == {"native"}
    data = _verdicts(race)
    assert data["broken"] == {} and all(v["native"]["ok"] for v in data["keys"].values())


LIMIT_S = 45  # the child's start (import torch) takes 10-20 s on a loaded 2-core CI machine: it must reach the kernel


@pytest.mark.parametrize("mode,error", [("hang", f"did not finish within {LIMIT_S} s"), ("crash", "exited with 7")])
def test_a_hanging_or_crashing_kernel_warns_once_and_is_not_tried_again(race, used, monkeypatch, mode, error):
    """A crash is the kernel's: kept, not tried again on this GPU. A hang may be the machine's (a cold compile on a busy
    one past the limit banned the backend on that GPU for good): not tried again in this process, for any key, but
    not kept: the next process checks it again."""
    monkeypatch.setattr(_race, "CHILD", planted(mode))
    monkeypatch.setattr(_race, "TIMEOUT_S", LIMIT_S)
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning, match=error) as w:
        _step()
    assert len(w) == 1 and time.monotonic() - t0 < LIMIT_S + 15
    assert set(used) == {"reference"}
    monkeypatch.setattr(_race, "CHILD", ["false"])
    used.clear()
    with warnings.catch_warnings():  # this process, another key: not checked again, no warning, the fallback
        warnings.simplefilter("error")
        _step(300)
    assert set(used) == {"reference"}
    if mode == "hang":
        data = _verdicts(race)
        assert data["broken"] == {} and not any(data["keys"].values())  # nothing kept
        _race.forget()  # the next process checks again: the kernel is used
        monkeypatch.setattr(_race, "CHILD", fake_child())
        used.clear()
        _step()
        assert set(used) == {"native"}
        return
    assert error in _verdicts(race)["broken"]["native"]
    # the next process, at another key: not checked again (a child would fail), no warning, the fallback
    _race.forget()
    monkeypatch.setattr(_race, "CHILD", ["false"])
    used.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(300)
    assert set(used) == {"reference"}


def test_the_key_separates_what_changes_a_kernel(monkeypatch):
    for k in _race.SWITCHES:
        monkeypatch.delenv(k, raising=False)
    base = dict(N=64, K=32, M=100, r=4, bias=False, scale="tensor", block=128, cdt=torch.bfloat16,
                rdt=torch.bfloat16, p=0.0, act_quant="")
    key = lambda **kw: _race.describe(_race.spec_of("dora", CPU, **dict(base, **kw)))  # noqa: E731
    keys = [key(), key(r=16), key(bias=True), key(scale="row"), key(scale="block"), key(scale="block", block=64),
            key(rdt=torch.float32), key(p=0.1), key(act_quant="rowwise"), key(M=1000), key(N=96),
            key(cdt=torch.float16)]
    monkeypatch.setenv("DORAFP8_HOPPER_GEMM", "1")  # the Hopper loop, opt-in
    keys.append(key())
    assert len(set(keys)) == len(keys), keys
    # "0" runs what unset runs (the cp.async loop): one key, not a second race. Failed on the old code (the raw value
    # was keyed), as did the typo: handed to the child, where the Triton candidate raised on it and was recorded as a
    # failed kernel; now refused here, naming the variable
    monkeypatch.setenv("DORAFP8_HOPPER_GEMM", "0")
    zero = key()
    monkeypatch.setenv("DORAFP8_HOPPER_GEMM", "yes")
    with pytest.raises(ValueError, match="DORAFP8_HOPPER_GEMM must be 0"):
        key()
    monkeypatch.delenv("DORAFP8_HOPPER_GEMM")
    assert zero == key()
    assert key(M=128) == key() and key(r=3) == key()  # buckets: M 65..128, r 3..4
    assert key(block=64) == key()  # the block size matters only with block scales
    # weight_norm alone: the rank and the adapters' dtype (its operands), not M (it has none)
    norm = lambda **kw: _race.describe(_race.spec_of("norm", CPU, **dict(base, **kw)))  # noqa: E731
    assert len({norm(), norm(r=16), norm(cdt=torch.float32, rdt=torch.float32), norm(scale="block"), key()}) == 5
    assert norm(M=1) == norm(M=5000) and "M<=" not in norm()


def test_a_new_build_is_checked_again(race, monkeypatch):
    _step()
    assert children(race) == 1
    _race.forget()
    _step()
    assert children(race) == 1  # the file serves
    _race.forget()
    monkeypatch.setattr(_race, "_BUILD", ["another build"])
    _step()
    assert children(race) == 2 and len([p for p in os.listdir(race) if p.startswith("race-")]) == 2


def test_the_build_id_holds_the_cuda_sources_a_wheel_ships(monkeypatch, tmp_path):
    """A wheel ships csrc/ as dorafp8/csrc/ (cuda_build.source_dir's first place); build_id hashed the folder beside
    the package, a checkout's, so in an installed dorafp8 a release that changed only the CUDA kernels kept the old
    verdicts. The sources where a build reads them, here a planted dorafp8/csrc/, are in the id."""
    from dorafp8.backends import cuda_build

    (tmp_path / "forward.cu").write_text("// v1")
    monkeypatch.setattr(cuda_build, "source_dir", lambda: tmp_path)
    monkeypatch.setattr(_race, "_BUILD", [])
    before = _race.build_id()
    (tmp_path / "forward.cu").write_text("// v2")
    _race._BUILD.clear()
    assert _race.build_id() != before


@pytest.mark.parametrize("dist", ["pytorch-triton", "triton-windows"])
def test_the_verdict_file_is_the_tritons_whatever_installed_it(monkeypatch, dist):
    """Nightly torch installs Triton as pytorch-triton, Windows users as triton-windows: the version was read of the
    "triton" distribution alone, None there, so every Triton such an install upgraded to reused the verdicts of the
    one before (and `python -m dorafp8` said "triton not installed" beside a Triton backend that ran)."""
    import importlib.metadata as md

    from dorafp8.__main__ import report

    installed = {dist: "3.9.0+git1234abcd"}

    def version(name):
        if name not in installed:
            raise md.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(md, "version", version)
    assert _race._versions()["triton"] == "3.9.0+git1234abcd"
    before = _race.cache_file(CPU)
    installed[dist] = "3.9.0+git5678ef01"
    assert _race.cache_file(CPU) != before
    assert "triton 3.9.0+git5678ef01," in report().splitlines()[0]


def _reentrant(f, x):
    return ckpt.checkpoint(f, x, use_reentrant=True)


def _nonreentrant(f, x):
    return ckpt.checkpoint(f, x, use_reentrant=False)


def _hooks(f, x):
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
        return f(x)


def _autocast(f, x):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return f(x)


def _inference(f, x):
    with torch.inference_mode():
        return f(x.detach())


@pytest.mark.parametrize("context", [_nonreentrant, _reentrant, _hooks, _autocast, _inference])
def test_a_first_call_in_any_context_is_the_same_as_without_the_race(race, monkeypatch, context):
    """The old in-process race broke step 1 under non-reentrant checkpointing (CheckpointError: a different number
    of tensors was saved): the trial ran inside the user's forward. Now the user's process only reads a file and
    waits for a child; the ops it dispatches are those of DORAFP8_RACE=0."""
    w8, scale, A, B, m = _layer()
    x0 = torch.randn(40, K, generator=torch.Generator().manual_seed(1))

    def run():
        grads = [t.grad.clone() if t.grad is not None else None for t in (A, B, m)]
        for t in (A, B, m):
            t.grad = None
        x = x0.clone().requires_grad_()
        ops = []

        class Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                ops.append(str(func))
                return func(*args, **(kwargs or {}))

        with Record():
            y = context(lambda x: dorafp8.dora_fp8_linear(x, w8, scale, A, B, m, s, dropout_p=0.1, training=True), x)
            if y.requires_grad:
                y.float().square().sum().backward()
        del grads
        return [y.detach(), x.grad] + [t.grad for t in (A, B, m)], ops

    torch.manual_seed(3)
    raced, raced_ops = run()
    assert children(race) == 1  # the first call did check, in a child
    monkeypatch.setenv("DORAFP8_RACE", "0")
    torch.manual_seed(3)
    plain, plain_ops = run()
    assert raced_ops == plain_ops  # no tensor, no kernel of the race in the user's process: zero extra memory
    for a, b in zip(raced, plain):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("how", ["argument", "environment", "off"])
def test_a_forced_backend_is_never_checked(race, used, monkeypatch, how):
    kw = {}
    if how == "argument":
        kw = dict(backend="reference")
    elif how == "environment":
        monkeypatch.setenv("DORAFP8_BACKEND", "reference")
    else:
        monkeypatch.setenv("DORAFP8_RACE", "0")
    _step(**kw)
    assert children(race) == 0 and set(used) == {"native" if how == "off" else "reference"}


def test_on_by_default_on_a_gpu_only(monkeypatch):
    monkeypatch.delenv("DORAFP8_RACE", raising=False)
    monkeypatch.delenv("DORAFP8_BACKEND", raising=False)
    assert _race.racing("auto", torch.device("cuda")) and _race.racing(None, torch.device("cuda", 1))
    assert not _race.racing("auto", torch.device("cpu")) and not _race.racing("triton", torch.device("cuda"))


@pytest.mark.parametrize("flag", ["false", "off", "no", "O"])
def test_a_mistyped_race_switch_is_refused_by_name(monkeypatch, flag):
    """DORAFP8_RACE=false (or off) left the race on without a word: only "0" turned it off. Now any value but 0 or 1
    is refused naming the variable and the values it takes; set but empty is unset."""
    monkeypatch.delenv("DORAFP8_BACKEND", raising=False)
    monkeypatch.setenv("DORAFP8_RACE", flag)
    with pytest.raises(ValueError, match=f"DORAFP8_RACE must be 0 \\(off\\) or 1 .*got '{flag}'"):
        _race.racing("auto", torch.device("cuda"))
    monkeypatch.setenv("DORAFP8_RACE", "")
    assert _race.racing("auto", torch.device("cuda"))


def test_the_pick_is_stable_within_the_margin():
    res = {"triton": {"ok": True, "ms": 1.04}, "cuda": {"ok": True, "ms": 1.0}, "cublas": {"ok": False}}
    assert _race.pick_of(res, ("triton", "cuda", "cublas")) == "triton"  # 4% slower: within MARGIN, the order wins
    res["cuda"]["ms"] = 0.9
    assert _race.pick_of(res, ("triton", "cuda", "cublas")) == "cuda"
    assert _race.pick_of({"triton": {"ok": False}}, ("triton",)) == _race.FALLBACK


def test_python_m_dorafp8_prints_the_verdicts(race):
    from dorafp8.__main__ import report

    _step()
    text = report()
    assert f"1 cache file in {race}" in text
    assert "dora N=24 K=32 M<=64 bfloat16/float32 w8a16 tensor r<=4 -> native (native 1.000 ms)" in text


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()  # a zombie nobody reaps (init in a container) has ended
    except OSError:
        return False


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc to see the orphan end")
def test_the_child_never_outlives_its_limit_or_its_parent(tmp_path):
    """A parent killed by SIGKILL cannot kill its child: the child's watchdog ends it when the parent is gone (or at
    the limit), even while a hanging kernel blocks it."""
    spec = _race.spec_of("dora", CPU, N=N, K=K, M=40, r=r, cdt=torch.bfloat16, rdt=torch.float32)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(HERE)))
    cmd = " ".join(shlex.quote(a) for a in planted("hang") + [json.dumps(dict(spec, cands=["native"], limit_s=600))])
    # the shell starts the child and exits: the child's parent is gone before it runs anything
    out = subprocess.run(["sh", "-c", f"{cmd} $$ >/dev/null 2>&1 & echo $!"], env=env,
                         capture_output=True, text=True, timeout=30)
    pid = int(out.stdout.split()[-1])
    end = time.monotonic() + 90
    while _alive(pid) and time.monotonic() < end:
        time.sleep(0.5)
    assert not _alive(pid), "the orphaned child still runs"
    # its own limit, with its parent alive
    # (20 s: the limit counts from the child's start, and importing torch took over 3 s on a loaded 2-core machine,
    # so the hang was never reached)
    t0 = time.monotonic()
    done = subprocess.run(planted("hang") + [json.dumps(dict(spec, cands=["native"], limit_s=20))], env=env,
                          capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 70 and "dorafp8-race start native" in done.stdout and time.monotonic() - t0 < 120


def test_under_torch_compile_the_verdict_of_this_process_or_the_static_order(race, monkeypatch):
    """A torch.compile trace starts no child (fullgraph: no graph break): the verdict made in this process where
    there is one, else the static order."""
    monkeypatch.setitem(_race.RACERS, "cpu", ("native", "reference"))
    monkeypatch.setattr(_race, "CHILD", fake_child(native=2.0, reference=1.0))
    w8, scale, A, B, m = _layer()
    x = torch.randn(40, K)

    def compiled():
        torch._dynamo.reset()
        return torch.compile(lambda x: dorafp8.dora_fp8_linear(x, w8, scale, A, B, m, s), fullgraph=True,
                             backend="aot_eager")(x)

    with torch.no_grad():
        torch.testing.assert_close(compiled(), dorafp8.dora_fp8_linear(x, w8, scale, A, B, m, s, backend="native"),
                                   rtol=0, atol=0)
        assert children(race) == 0
        dorafp8.dora_fp8_linear(x, w8, scale, A, B, m, s)  # eager: checked, reference picked
        assert children(race) == 1
        torch.testing.assert_close(compiled(), dorafp8.dora_fp8_linear(x, w8, scale, A, B, m, s,
                                                                       backend="reference"), rtol=0, atol=0)


def test_under_cuda_graph_capture_the_stored_verdict_or_the_static_order(race, used, monkeypatch):
    """A first call inside a CUDA graph capture (torch.cuda.is_current_stream_capturing made True) starts no child:
    with no verdict on disk it runs the static order, as DORAFP8_RACE=0 does; with one (a previous process's), its
    pick."""
    monkeypatch.setitem(_race.RACERS, "cpu", ("native", "reference"))
    monkeypatch.setattr(_race, "CHILD", fake_child(native=2.0, reference=1.0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.warns(UserWarning, match="captured .* before an eager call checked its backends") as told:
        got = _step()
    assert children(race) == 0 and set(used) == {"native"} and len(told) == 1  # once a process, not once a key
    monkeypatch.setenv("DORAFP8_RACE", "0")
    for a, b in zip(got, _step()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    monkeypatch.setenv("DORAFP8_RACE", "1")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    _step()  # outside the capture: checked, the file written
    assert children(race) == 1
    _race.forget()  # the next process, capturing at once: the file's pick, no child
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    used.clear()
    _step()
    assert children(race) == 1 and set(used) == {"reference"}


def test_selftest_checks_headline_keys_now(race, monkeypatch):
    from dorafp8.__main__ import main

    assert _race.selftest(CPU)[1:]  # a line per key
    assert children(race) == 4
    _race.forget()
    monkeypatch.setitem(_race.RACERS, "cpu", ())
    monkeypatch.delitem(_race.RACERS, "cpu")
    assert main(["selftest"]) == 0  # no GPU here: nothing to check, says so


def test_selftest_says_each_key_as_it_is_checked(race, monkeypatch, capsys):
    """`dorafp8 selftest` on a GPU starts a child per key (Triton's compiles: tens of seconds each, up to TIMEOUT_S)
    and printed nothing until all were done: minutes of silence that read as a hang. Each line is printed as found:
    when a key is checked, the lines before it are out."""
    from dorafp8.__main__ import main

    seen = []

    def resolve(path, device, what, spec):
        seen.append(capsys.readouterr().out)
        return {c: {"ok": True, "ms": 1.0} for c in spec["cands"]}

    monkeypatch.setattr(_race, "_resolve", resolve)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # selftest's device: the racing CPU
    assert main(["selftest"]) == 0
    assert len(seen) == 4 and seen[0].startswith("selftest on cpu") and all(" -> native: native ok" in out
                                                                           for out in seen[1:]), seen


def test_selftest_checks_only_what_auto_would_race(race, monkeypatch):
    """`dorafp8 selftest` checks each key's candidates as backend="auto" races them: the CUDA extension (no block
    scales, no W8A8) and cuBLAS (no W8A8) are not run on keys they cannot compute. Before, they were, and the selftest
    printed "FAILED: ValueError ..." for them, with a warning that the verdict was kept, on every healthy GPU."""
    monkeypatch.setitem(_race.RACERS, "cpu", ("native", "cuda", "cublas"))
    monkeypatch.setattr(backends, "unavailable_reason", lambda name, device: None)
    asked = {}

    def check(spec):
        asked[spec["scale"] + (" w8a8" if spec["act_quant"] else "")] = spec["cands"]
        return {c: {"ok": True, "ms": 1.0} for c in spec["cands"]}, {}

    monkeypatch.setattr(_race, "check", check)
    lines = _race.selftest(CPU)
    assert asked == {"tensor": ["native", "cuda", "cublas"], "row": ["native", "cuda", "cublas"],
                     "block": ["native", "cublas"], "tensor w8a8": ["native"]}, asked
    assert not any("FAILED" in line for line in lines), lines


def test_the_child_bound_follows_the_tests_tolerances():
    """The child's bound (_race.TOL, ROOM times it) is the tests' tol(dtype): the two cannot drift apart."""
    from tests._tolerance import TOL

    assert _race.TOL == {str(k).removeprefix("torch."): v for k, v in TOL.items()}


def test_the_norm_alone_and_the_convs_run_only_checked_kernels(race, used, monkeypatch):
    """weight_norm called alone (PEFT's layer caches its norm that way: dorafp8/peft/linear.py) and the DoRA convs'
    norms (their one backend kernel: the convolutions are the platform's, on a dequantized weight) take a checked
    pick, as a layer's step does: a norm kernel that computes wrong values is never used. (They ran the static order,
    unchecked, before.)"""
    monkeypatch.setitem(_race.RACERS, "cpu", ("native", "reference"))
    monkeypatch.setattr(_race, "CHILD", planted("wrong-norm"))
    w8, scale, A, B, m = _layer()
    with pytest.warns(RuntimeWarning, match=r"'native' is not used by backend='auto' for norm N=24 K=32 "
                                            r"float32/float32 w8a16 tensor r<=4 on cpu .*: y differs"):
        n = dorafp8.weight_norm(w8, scale, A, B, s)
    assert set(used) == {"reference"} and children(race) == 0  # the planted child does not log; the file does
    assert list(_verdicts(race)["keys"]) == ["norm N=24 K=32 float32/float32 w8a16 tensor r<=4"]
    torch.testing.assert_close(n, dorafp8.weight_norm(w8, scale, A, B, s, backend="reference"), rtol=0, atol=0)
    # a DoRA conv: its norm is a new key ([8, 2 * 3 * 3] view), checked, and served by the pick
    used.clear()
    g = torch.Generator().manual_seed(5)
    wc8, sc = dorafp8.quantize_e4m3(torch.randn(8, 18, generator=g) / 4)
    wc8 = wc8.reshape(8, 2, 3, 3)
    Ac, Bc, mc = torch.randn(r, 2, 3, 3, generator=g) / 4, torch.randn(8, r, 1, 1, generator=g), torch.rand(8) + .5
    x = torch.randn(2, 2, 6, 6, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # native's second wrong verdict is logged, not warned
        y = dorafp8.dora_fp8_conv(x, wc8, sc, Ac, Bc, mc, s)
    assert "native" not in used and "norm N=8 K=18 float32/float32 w8a16 tensor r<=4" in _verdicts(race)["keys"]
    monkeypatch.setenv("DORAFP8_RACE", "0")
    torch.testing.assert_close(y, dorafp8.dora_fp8_conv(x, wc8, sc, Ac, Bc, mc, s, backend="reference"),
                               rtol=0, atol=0)


class LiveBytes(TorchDispatchMode):
    """Measures memory on CPU: the most bytes that tensors made by ops while it is on held at once (each storage
    counted once, weakly referenced, until it is freed)."""

    def __init__(self):
        super().__init__()
        self.live, self.peak = {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._pytree import tree_leaves

        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                ref = self.live.get(st.data_ptr())
                if st.data_ptr() and (ref is None or ref[0].expired()):
                    self.live[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


# (op, N, K, M, compute dtype, scale, dropout p, bias); the old child (fp32 references at M = 37 and at the key's M,
# both alive, each candidate's outputs compared in whole fp64 copies) held, measured the same way, 1.8, 3.4, 3.4,
# 56, 123 and 33 MiB, the last three far more than the layer's own step.
MEMORY_CASES = {"tiny": ("dora", 64, 32, 300, torch.bfloat16, "tensor", 0.0, False),
                "weight-bound": ("dora", 512, 256, 16, torch.bfloat16, "tensor", 0.0, False),
                "norm": ("norm", 512, 256, 1, torch.bfloat16, "tensor", 0.0, False),
                "few-tokens-wide-k": ("linear", 1024, 4096, 16, torch.bfloat16, "block", 0.0, False),
                "activation-bound": ("dora", 1024, 1024, 2048, torch.bfloat16, "block", 0.1, False),
                "fp32-bias": ("linear", 256, 512, 700, torch.float32, "row", 0.0, True)}


def _child_peak(monkeypatch, spec) -> int:
    """The child's peak, measured by running it in this process on CPU (native and reference as candidates)."""
    import contextlib
    import io

    from dorafp8.ops import _race_child

    monkeypatch.setattr(_race_child, "_watchdog", lambda limit, parent: None)  # it would end this process at the limit
    with LiveBytes() as child, contextlib.redirect_stdout(io.StringIO()) as out:
        assert _race_child.main([json.dumps(dict(spec, cands=["native", "reference"]))]) == 0
    assert '"native": {"ok": true' in out.getvalue() and '"reference": {"ok": true' in out.getvalue()
    return child.peak


@pytest.mark.parametrize("case", list(MEMORY_CASES))
def test_the_childs_extra_peak_memory_is_within_the_layers_own_step(monkeypatch, case):
    """The child runs on the user's GPU while the user's activations are live: its peak (measured) is at most
    _race.budget, which is at most the layer's own step at the call's M (x, y, dy, dx, the fp8 weight and its scales,
    the adapters and their grads; FLOOR for a layer smaller than that) and at most CAP."""
    op, n, k, m, cdt, scale, p, bias = MEMORY_CASES[case]
    spec = _race.spec_of(op, CPU, N=n, K=k, M=m, r=r, bias=bias, scale=scale, cdt=cdt, rdt=torch.float32, p=p)
    bound = _race.budget(spec)
    assert bound <= _race.CAP and bound <= max(_race.step_bytes(spec, m), _race.FLOOR)
    assert _race.plan(spec)["fits"]
    peak = _child_peak(monkeypatch, spec)
    assert 0 < peak <= bound, (peak, bound, _race.plan(spec))


def test_the_childs_extra_peak_memory_is_capped(monkeypatch):
    """A layer whose step holds more than CAP: the child holds at most CAP (made 2 MiB here, so that the CPU can run
    it), by timing at a smaller M and on fewer weight rows."""
    monkeypatch.setattr(_race, "CAP", 2 * 2 ** 20)
    spec = _race.spec_of("dora", CPU, N=512, K=512, M=1024, r=r, cdt=torch.bfloat16, rdt=torch.float32)
    assert _race.step_bytes(spec, 1024) > 2 * _race.CAP and _race.budget(spec) == _race.CAP
    plan = _race.plan(spec)
    assert plan["time"] < 1024
    assert 0 < _child_peak(monkeypatch, spec) <= _race.CAP


class FakeCudaMemory:
    """torch.cuda's allocator counters, kept by hand: alloc / free bytes."""

    def __init__(self):
        self.cur = self.peak = 0

    def alloc(self, n):
        self.cur += n
        self.peak = max(self.peak, self.cur)

    def free(self, n):
        self.cur -= n

    def memory_allocated(self):
        return self.cur

    def max_memory_allocated(self):
        return self.peak

    def reset_peak_memory_stats(self):
        self.peak = self.cur


def test_a_lone_candidates_time_is_not_its_first_call_at_the_timings_m(monkeypatch):
    """A candidate checked alone (the one that hung the last process's child, a backend new since the file was
    written) is weighed against the file's times of the others, medians of ROUNDS calls: its first call at the
    timing's M, where Triton autotunes that M's bucket (each config timed, seconds), must not be its time. Failed on
    the old code (a lone candidate timed once: that call). The clock is a stand-in: no timing here."""
    import contextlib
    import io
    import types

    from dorafp8.ops import _race_child

    monkeypatch.setattr(_race_child, "_watchdog", lambda limit, parent: None)  # it would end this process at the limit
    clock, seen, step = [0.0], set(), _race_child._step

    def first_call_slow(spec, t, backend):
        at = (backend, t["x"].shape[0])
        clock[0] += 0.001 if at in seen else 100.0  # a candidate's first call at an M: its autotuning
        seen.add(at)
        return step(spec, t, backend)

    monkeypatch.setattr(_race_child, "_step", first_call_slow)
    monkeypatch.setattr(_race_child, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    spec = _race.spec_of("dora", CPU, N=256, K=256, M=2048, r=4, cdt=torch.bfloat16, rdt=torch.float32)
    assert _race.plan(spec)["time"] not in _race.plan(spec)["check"]  # the timing's M is new to the candidate
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert _race_child.main([json.dumps(dict(spec, cands=["native"]))]) == 0
    line = [x for x in out.getvalue().splitlines() if x.startswith("dorafp8-race result ")][-1]
    assert json.loads(line[len("dorafp8-race result "):])["native"]["ms"] == pytest.approx(1.0)


@pytest.mark.parametrize("peak_first", [True, False])
def test_the_childs_gpu_peak_counts_its_tensors_not_cublas_or_triton_autotuning(monkeypatch, peak_first):
    """The first GPU run's race warned "held 290.6 MiB, more than its bound of 17.0 MiB (please report)": the CUDA
    allocator's peak counted cuBLAS's workspace (32 MiB on sm_90) and the 256 MiB that Triton's autotuner makes and
    zeroes before timing each config, neither the layer's. Now the workspace is in the baseline, one bench buffer
    serves every config and is taken out of the peak; the child's own tensors count, whether their peak comes before
    the first autotuning (the reference's) or during it. Failed on the old code (no Held: the child subtracted the
    allocator's first peak from its last, 256 MiB more here)."""
    import triton

    from dorafp8.ops import _race_child

    MiB, mem = 2 ** 20, FakeCudaMemory()
    made = []

    class Driver:  # Triton's driver: a fresh buffer for each config timed
        def get_empty_cache_for_benchmark(self):
            made.append(1)
            mem.alloc(256 * MiB)
            return torch.empty(256 * MiB // 4, dtype=torch.int32, device="meta")

    monkeypatch.setattr(triton.runtime.driver, "_active", Driver())
    mem.alloc(32 * MiB)  # cuBLAS's workspace, made before the baseline
    held = _race_child.Held(mem)
    _race_child._one_bench_buffer(held)
    held.start()
    mem.alloc(10 * MiB)  # the inputs
    mem.alloc(40 * MiB if peak_first else 5 * MiB)  # the reference's step, then freed
    mem.free(40 * MiB if peak_first else 5 * MiB)
    for _ in range(3):  # a candidate's first call autotunes three configs, its step holding 20 MiB
        triton.runtime.driver.active.get_empty_cache_for_benchmark()
    mem.alloc(20 * MiB)
    mem.free(20 * MiB)
    assert len(made) == 1 and mem.cur == (32 + 10 + 256) * MiB
    assert held.extra() == (50 if peak_first else 30) * MiB


def test_the_plan_the_guide_states():
    """docs/GUIDE.md, Backends, gives what the child runs for N = K = 4096 in bf16 (r = 16) at M = 4096 and 16."""
    gpu = torch.device("cuda")
    big = _race.spec_of("dora", gpu, N=4096, K=4096, M=4096, r=16, cdt=torch.bfloat16, rdt=torch.float32)
    assert _race.plan(big) == {"rows": 4096, "check": [37, 400], "time": 667, "budget": _race.budget(big),
                               "fits": True}
    assert round(_race.budget(big) / 2 ** 20) == 145 == round(_race.step_bytes(big, 4096) / 2 ** 20)
    small = _race.spec_of("dora", gpu, N=4096, K=4096, M=16, r=16, cdt=torch.bfloat16, rdt=torch.float32)
    assert _race.plan(small)["rows"] == 512 and round(_race.budget(small) / 2 ** 20, 1) == 17.5
    guide = " ".join(open(os.path.join(HERE, "..", "..", "docs", "GUIDE.md")).read().split())
    assert "at most 145 MiB, all 4096 rows, checked at M = 37 and 400, timed at M = 667" in guide
    assert "at M = 16: at most 17.5 MiB, 512 rows" in guide and "never more than 256 MiB" in guide
    assert _race.CAP == 256 * 2 ** 20 and _race.FLOOR == 4 * 2 ** 20 and "or 4 MiB for a layer" in guide
    # the exception the guide states: of that grid, a rank of 64 or more on N = 128, K = 4096 only
    unfit = set()
    for n, k in [(4096, 4096), (14336, 4096), (4096, 14336), (18432, 3072), (3072, 3072), (2048, 2048),
                 (1024, 1024), (640, 640), (320, 320), (128, 4096), (64, 64)]:
        for m in (1, 16, 100, 1024, 4096, 8192):
            for rank in (4, 8, 16, 32, 64, 128, 256):
                for cdt in (torch.bfloat16, torch.float32):
                    spec = _race.spec_of("dora", gpu, N=n, K=k, M=m, r=rank, cdt=cdt, rdt=torch.float32)
                    if not _race.plan(spec)["fits"]:
                        unfit.add((n, k, rank))
    assert {(n, k) for n, k, _ in unfit} == {(128, 4096)} and min(rank for *_, rank in unfit) == 64


def test_a_first_call_that_checks_holds_nothing_more_in_the_users_process(race, monkeypatch):
    """The user's process: a first call that checks (in a child) holds at most what a DORAFP8_RACE=0 call holds
    (measured: 0 bytes more)."""
    w8, scale, A, B, mag = _layer(n=64)
    x = torch.randn(300, K, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(2))
    peaks = []
    for flag in ("1", "0"):  # a first call that checks, then the same call unchecked
        monkeypatch.setenv("DORAFP8_RACE", flag)
        _race.forget()
        with LiveBytes() as user:
            dorafp8.dora_fp8_linear(x, w8, scale, A, B, mag, s).float().sum().backward()
        peaks.append(user.peak)
    assert children(race) == 1 and peaks[0] == peaks[1] > 0


@pytest.mark.parametrize("dynamic", [False, True], ids=["static-shapes", "dynamic-shapes"])
def test_a_key_first_met_inside_torch_compile_runs_the_static_order(race, used, monkeypatch, dynamic):
    """A key met first inside a torch.compile trace, for each op the race checks (a DoRA layer, fp8_linear,
    weight_norm alone): no child and no file read (fullgraph=True: a graph break would raise), the static order (here
    native, where a check would have picked reference), the result of DORAFP8_RACE=0, and no verdict made up for it:
    the next eager call checks it."""
    monkeypatch.setitem(_race.RACERS, "cpu", ("native", "reference"))
    monkeypatch.setattr(_race, "CHILD", fake_child(native=2.0, reference=1.0))
    w8, scale, A, B, m = _layer()
    x = torch.randn(40, K)
    calls = {"dora": lambda x, **kw: dorafp8.dora_fp8_linear(x, w8, scale, A, B, m, s, **kw),
             "linear": lambda x, **kw: dorafp8.fp8_linear(x, w8, scale, **kw),
             "norm": lambda x, **kw: dorafp8.weight_norm(w8, scale, A, B, s, **kw) * x.sum()}
    with torch.no_grad():
        for op, call in calls.items():
            torch._dynamo.reset()
            compiled = torch.compile(call, fullgraph=True, backend="aot_eager", dynamic=dynamic)
            torch.testing.assert_close(compiled(x), call(x, backend="native"), rtol=0, atol=0)
            assert children(race) == 0 and set(used) == {"native"}, (op, used)
        assert not os.listdir(race) or not _verdicts(race)["keys"]
        call(x)  # eager: checked now, and the compiled function is traced again with the pick
        assert children(race) == 1 and used[-1] == "reference"
        used.clear()
        compiled(x)
        assert set(used) == {"reference"}


def test_a_compiled_step_is_not_recompiled_for_every_token_count(race, used, monkeypatch):
    """Bucketed training (a new token count per batch) under torch.compile on a GPU, where backend="auto" races: the
    key's bucket of M guarded the graph on M itself (bucket() cannot take a symbol), so every new count recompiled it,
    and after torch.compile's limit of 8 fullgraph=True failed (without it: eager from then on). Inside a trace the
    race reads nothing of M: the layer's pick where the counts checked in this process agree (here reference, checked
    eagerly at two buckets), else the static order."""
    import torch._dynamo

    monkeypatch.setitem(_race.RACERS, "cpu", ("native", "reference"))
    monkeypatch.setattr(_race, "CHILD", fake_child(native=2.0, reference=1.0))
    w8, scale, A, B, m = _layer()
    A, B, m = (t.requires_grad_() for t in (A, B, m))
    for tokens in (5, 40):  # eager: checked, reference picked at both
        dorafp8.dora_fp8_linear(torch.randn(tokens, K), w8, scale, A, B, m, s).sum().backward()
    assert children(race) == 2
    frames = []

    def counting(gm, example_inputs):
        frames.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    torch._dynamo.reset()
    step = torch.compile(lambda x: dorafp8.dora_fp8_linear(x, w8, scale, A, B, m, s).square().mean(),
                         backend=counting, fullgraph=True)
    used.clear()
    for tokens in (7, 9, 13, 21, 33, 40, 57, 64, 100, 129):
        step(torch.randn(tokens, K)).backward()
    assert 1 <= len(frames) <= 2 and children(race) == 2, f"{len(frames)} compilations for 10 token counts"
    assert set(used) == {"reference"}


def test_a_key_another_writer_dropped_is_written_back(race):
    """The file has no lock: another process that read it before this one's write, and wrote after, dropped this
    one's key, and every later process checked it again. This process's next write puts it back. Failed on the old
    code (the first key stayed lost)."""
    _step(40)
    path = _race.cache_file(CPU)
    (first,) = _verdicts(race)["keys"]
    other = json.loads(open(path).read())
    other["keys"] = {"another process's key": {"native": {"ok": True, "ms": 2.0}}}
    with open(path, "w") as f:  # the other writer's file, read before this process wrote
        json.dump(other, f)
    _step(300)  # another key: written with what the file now holds
    keys = _verdicts(race)["keys"]
    assert first in keys and "another process's key" in keys and len(keys) == 3
    _race.forget()  # the next process: both keys read, no child
    _step(40)
    _step(300)
    assert children(race) == 2


def test_a_deleted_verdict_file_is_not_written_back(race):
    """A user deletes the verdict file while a job runs, so that the next processes check again: the job's next write
    put back every key it knew, those it had read from the file and those it had written before, and the deletion was
    undone. Only the key just checked is written now (the put-back is for a file another writer replaced)."""
    _step(40)
    path = _race.cache_file(CPU)
    other = json.loads(open(path).read())
    other["keys"]["another process's key"] = {"native": {"ok": True, "ms": 2.0}}
    with open(path, "w") as f:
        json.dump(other, f)
    _race.forget()  # this job: both keys read from the file
    _step(40)
    _step(300)  # one key of its own, written
    assert len(_verdicts(race)["keys"]) == 3 and children(race) == 2
    os.remove(path)
    _step(2000)
    assert len(_verdicts(race)["keys"]) == 1 and children(race) == 3


def test_a_damaged_or_planted_cache_file_costs_a_check_not_a_step(race, used):
    """Entries of another shape in the verdict file (a hand edit, a damaged write, another tool's JSON) are dropped on
    reading: their key is checked again, and the step runs (before, a verdict that was not a dict raised in it)."""
    spec = _race.spec_of("dora", CPU, N=N, K=K, M=40, r=r, cdt=torch.bfloat16, rdt=torch.float32)
    what = _race.describe(spec)
    path = _race.cache_file(CPU)
    with open(path, "w") as f:
        json.dump({"keys": {what: {"native": "yes", "reference": {"ok": True, "ms": "fast"}}, "x": 3},
                   "broken": {"native": 5}}, f)
    _step()
    assert children(race) == 1 and set(used) == {"native"}
    assert _verdicts(race)["keys"][what]["native"]["ok"] is True and _verdicts(race)["broken"] == {}


def test_a_full_disk_while_saving_verdicts_leaves_no_temporary_file(race, used, monkeypatch, caplog):
    """Writing the verdict file fails (a full disk, ENOSPC): the step runs, the temporary file it was written to is
    removed (before, every key checked left one more `.race-*.tmp` in the cache), and one warning says that the next
    process checks again and how to give it a writable folder."""
    import errno

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_race.json, "dump", full)
    with caplog.at_level("WARNING", logger="dorafp8.race"):
        _step()
        _step(300)  # a second key, unsaved too: said once
    assert children(race) == 2 and set(used) == {"native"}
    assert [p for p in os.listdir(race) if p.startswith(".race-")] == []
    # said: before, a debug line, and every process paid every check again without a word
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and "No space left on device" in said[0] and "DORAFP8_CACHE_DIR" in said[0], said


def _killed_child(partial: str, sig: str = "SIGKILL"):
    """A child that says it starts native, writes `partial` (a result line cut short) and gets signal `sig` (SIGKILL
    from outside, as the OOM killer would send it). Its handler reset first: under nohup (a CI job's launcher) SIGHUP
    is ignored, inherited, and the child would live on."""
    reset = "" if sig == "SIGKILL" else f"signal.signal(signal.{sig}, signal.SIG_DFL)\n"
    code = ("import os, signal, sys\n" + reset +
            "sys.stdout.write('dorafp8-race start native\\n' + " + repr(partial) + "); sys.stdout.flush()\n"
            f"os.kill(os.getpid(), signal.{sig})")
    return [sys.executable, "-c", code]


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM", "SIGUSR1", "SIGHUP"])
def test_a_child_killed_from_outside_blames_no_kernel(race, used, monkeypatch, sig):
    """A signal the parent did not send (the OOM killer's SIGKILL; a scheduler's SIGTERM at preemption or SIGUSR1
    ahead of the time limit, sent to every process of the job, whose parent, a trainer with its own handler, lives on;
    an operator's) says nothing of the kernel that ran: no verdict is written, nothing is marked unusable, the step
    runs on the fallback (the static order after a job's signal, test_a_job_being_stopped_starts_no_more_children),
    and the next process checks again. Before, only SIGKILL was told apart: a SIGTERM marked the kernel running then
    unusable on this GPU for good. A result line cut short by the kill is ignored."""
    monkeypatch.setattr(_race, "CHILD", _killed_child('dorafp8-race result {"native": {"ok": tr', sig))
    if sig == "SIGKILL":
        with pytest.warns(RuntimeWarning, match="not checked, so not used .*exited with -9"):
            _step()
    else:
        _step()
    assert set(used) == {"reference" if sig == "SIGKILL" else "native"}
    data = _verdicts(race)
    assert data["broken"] == {} and not any(data["keys"].values())  # no verdict written
    _race.forget()
    monkeypatch.setattr(_race, "CHILD", fake_child())
    used.clear()
    _step()
    assert children(race) == 1 and set(used) == {"native"}


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1", "SIGKILL"])
def test_a_job_being_stopped_starts_no_more_children(race, used, monkeypatch, capfd, sig):
    """A scheduler stopping the job signals its every process (SIGTERM at preemption, SIGUSR1 ahead of the time limit);
    the trainer's handler lets the parent finish its step and save. Each new key of that first step started a child
    again (seconds to tens each) while the grace period ran out. After a child stopped so, this process starts none:
    the keys left, and the one whose check was stopped, run the static order (what DORAFP8_RACE=0 runs), unchecked and
    unwritten, said once on stderr. Not the fp32 reference: a job that goes on after the signal (SLURM's
    --signal=USR1@90 with a handler that checkpoints and continues) ran every new key on it, several times slower, for
    the rest of the run. The OOM killer's SIGKILL stops nothing."""
    stopped = sig != "SIGKILL"
    monkeypatch.setattr(_race, "CHILD", _killed_child("", sig))
    if stopped:
        _step()
        assert f"stopped by signal {int(getattr(signal, sig))}" in capfd.readouterr().err
    else:
        with pytest.warns(RuntimeWarning, match="not checked, so not used"):
            _step()
    assert set(used) == {"reference" if not stopped else "native"}  # the stopped key too: its static pick
    monkeypatch.setattr(_race, "CHILD", fake_child())
    used.clear()
    _step(300)  # another key
    assert children(race) == (0 if stopped else 1) and set(used) == {"native"}
    assert any(_verdicts(race)["keys"].values()) is not stopped  # nothing written while stopping
    assert "stopped by signal" not in capfd.readouterr().err  # said once
    _race.forget()  # the next process checks
    used.clear()
    _step(300)
    assert set(used) == {"native"}


@pytest.mark.parametrize("sig", ["SIGSEGV", "SIGABRT"])
def test_a_child_crashed_by_its_kernel_blames_it(race, used, monkeypatch, sig):
    """What a kernel's own fault raises in its process (a segfault in a launcher, an abort from a failed check in C++)
    blames the kernel that was running, as an exit status does."""
    monkeypatch.setattr(_race, "CHILD", _killed_child("", sig))
    with pytest.warns(RuntimeWarning, match=f"'native' is not used .*exited with -{int(getattr(signal, sig))}"):
        _step()
    assert "native" in _verdicts(race)["broken"]


def test_a_crash_in_the_reference_blames_no_candidate(race, used, monkeypatch):
    """The child checks at two M, the reference run for each: a crash in the reference's second run, after native
    has started and passed at M = 37, is inconclusive (it writes "start reference" first), not native's fault."""
    spec = _race.spec_of("dora", CPU, N=N, K=K, M=40, r=r, cdt=torch.bfloat16, rdt=torch.float32)
    assert len(_race.plan(spec)["check"]) == 2
    monkeypatch.setattr(_race, "CHILD", planted("crash-second", "reference"))
    with pytest.warns(RuntimeWarning, match="not checked, so not used .*exited with 7"):
        _step()
    data = _verdicts(race)
    assert data["broken"] == {} and not any(data["keys"].values())  # no verdict written


def test_a_broken_verdict_of_a_kernel_that_cannot_run_here_leaves_native_in_place(race, used, monkeypatch):
    """On a GPU no kernel backend runs on (sm_80 / sm_86) backends.resolve picks native and no candidate races; a
    verdict file recording a racer broken there (a file shared by two builds' runs, or written before that racer
    needed sm_89) made the key run the fp32 reference, several times slower, where native is not the broken one."""
    monkeypatch.setitem(_race.RACERS, "cpu", ("triton",))  # a racer that cannot run on this device
    real = backends.unavailable_reason
    monkeypatch.setattr(backends, "unavailable_reason", lambda n, d: "needs sm_89" if n == "triton" else real(n, d))
    assert backends.resolve("auto", CPU) == "native"
    path = _race.cache_file(CPU)
    with open(path, "w") as f:
        json.dump({"keys": {}, "broken": {"triton": "crashed (an earlier run)"}}, f)
    _step()
    assert "reference" not in used and "native" in used, used
    assert children(race) == 0


def test_selftest_says_what_auto_runs_where_no_kernel_backend_runs(race, monkeypatch):
    """`python -m dorafp8 selftest` on an A100 (no racer runs on sm_80) listed every key as '-> reference', the race's
    fallback for candidates that failed, while backend='auto' runs native there: each line names resolve's pick."""
    monkeypatch.setitem(_race.RACERS, "cpu", ("triton",))
    real = backends.unavailable_reason
    monkeypatch.setattr(backends, "unavailable_reason", lambda n, d: "needs sm_89" if n == "triton" else real(n, d))
    lines = _race.selftest(CPU)
    keys = lines[1:]
    assert len(keys) == 4 and all(" -> native: " in line for line in keys), lines
    assert children(race) == 0


@pytest.mark.parametrize("claimer", [True, False])
def test_under_ddp_a_stopped_check_stops_every_rank(race, used, monkeypatch, claimer):
    """Under torch.distributed the first rank to meet a key checks it and shares the verdicts in the store. Its child
    stopped by the job's signal, the other ranks read verdicts of none and kept the fp32 reference for that key for
    the rest of the run, while the stopped rank ran the static order: ranks on different backends, one several times
    slower. The claimer says it was stopped in the store, and a rank reading that stops too (the scheduler signalled
    every process): every rank runs the static pick."""
    store = torch.distributed.HashStore()
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(torch.distributed.distributed_c10d, "_get_default_store", lambda: store)
    what = _race.describe(_race.spec_of("dora", CPU, N=N, K=K, M=40, r=r, cdt=torch.bfloat16, rdt=torch.float32))
    name = "dorafp8/race/" + hashlib.sha256((os.path.basename(_race.cache_file(CPU)) + what).encode()).hexdigest()[:24]
    if claimer:
        monkeypatch.setattr(_race, "CHILD", _killed_child("", "SIGTERM"))
        _step()
        assert "stopped" in json.loads(store.get(name))
    else:  # the other rank: the claimer's stopped verdicts already in the store
        store.add(name + "/claim", 1)
        store.set(name, json.dumps({"native": {"ok": None, "error": "the child process exited with -15: "},
                                    "stopped": "a child was stopped by signal 15: no more checks in this process"}))
        monkeypatch.setattr(_race, "CHILD", fake_child())
        _step()
    assert set(used) == {"native"}
    used.clear()
    _step(300)  # another key: no child, the static pick
    assert children(race) == 0 and set(used) == {"native"}


def test_the_verdict_file_is_the_drivers(monkeypatch):
    """The verdict file is named after the driver too (docs/ARCHITECTURE.md): a driver update checks every key again.
    It was read by torch._C._cuda_getDriverVersion, which no supported torch has: every driver got driver None and
    shared one file. Here cuDriverGetVersion answers through a planted libcuda, on a GPU that is not there."""
    import ctypes

    driver = {"v": 12080}

    class LibCuda:
        def cuDriverGetVersion(self, out):
            out._obj.value = driver["v"]
            return 0

    def cdll(name, *a, **k):
        if name in ("libcuda.so.1", "nvcuda.dll"):
            return LibCuda()
        raise OSError(name)

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA GeForce RTX 4090")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 9))
    gpu = torch.device("cuda", 0)
    _race.forget()
    assert _race._device_info(gpu)["driver"] == 12080
    before = _race.cache_file(gpu)
    driver["v"] = 13000
    _race.forget()  # the next process: the driver is read once a process
    assert _race._device_info(gpu)["driver"] == 13000 and _race.cache_file(gpu) != before
    _race.forget()


def test_the_driver_is_read_once_a_process(race, monkeypatch):
    """driver_version() dlopened libcuda at each new key (every layer shape and token bucket of a first step): it
    is read once a process now. A planted libcuda counts the opens."""
    import ctypes

    opened = []

    class LibCuda:
        def cuDriverGetVersion(self, out):
            out._obj.value = 12080
            return 0

    monkeypatch.setattr(ctypes, "CDLL", lambda name, *a, **k: opened.append(name) or LibCuda())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    gpu = torch.device("cuda", 0)
    paths = {_race.cache_file(gpu) for _ in range(5)}
    assert len(paths) == 1 and _race._device_info(gpu)["driver"] == 12080 and opened == ["libcuda.so.1"], opened


def test_python_m_dorafp8_reads_a_damaged_verdict_file(race):
    """A verdict file whose "device" is not an object (a hand edit, another tool's JSON) made `python -m dorafp8`, the
    first thing a user runs, die with an AttributeError in race_report; its keys are still listed."""
    what = "dora N=24 K=32 M<=64 bfloat16/float32 w8a16 tensor r<=4"
    for name, device in (("race-a.json", "H100"), ("race-b.json", ["x"]), ("race-c.json", None)):
        (race / name).write_text(json.dumps({"keys": {what: {"native": {"ok": True, "ms": 1.5}}}, "broken": {},
                                             "device": device}))
    lines = _race.race_report()
    assert lines[0].count("3 cache files") == 1 and sum(f"{what} -> native" in ln for ln in lines) == 3, lines
    out = subprocess.run([sys.executable, "-m", "dorafp8"], capture_output=True, text=True, env=os.environ)
    assert out.returncode == 0 and f"{what} -> native" in out.stdout, out.stderr[-2000:]
