"""The PyTorch ops a DoRA training step issues outside its kernel launches (issue 52: on an H200 host each one costs
microseconds of enqueue, views and allocations included). dorafp8._launches.LaunchRecorder lists them by origin,
inside dorafp8's custom ops too; bench/glue_cpu.py --ops prints the list. These tests keep out the ones that do
nothing: a reshape to the shape a tensor has, a view of a 0-dim scale, placeholders made per call."""

import pytest
import torch

import dorafp8
from dorafp8._launches import LaunchRecorder
from dorafp8.backends import base
from dorafp8.triton_kernels._common import vector


@pytest.fixture(autouse=True)
def _no_poison(monkeypatch):
    monkeypatch.setattr(base, "POISON_OUTPUTS", False)  # the tests' NaN fill is not what a user's step runs


def _step_ops(backend, dropout, x_dims=2):
    """The ops of the headline layer's step (bf16 x, fp32 adapters, a cached fp32 norm, per-tensor scale), the second
    of two (every once-per-process choice made), as (op, origin)."""
    gen = torch.Generator().manual_seed(0)
    N = K = 64
    w8, scale = dorafp8.quantize_e4m3(torch.randn(N, K, generator=gen))
    A = (torch.randn(4, K, generator=gen) / K ** 0.5).requires_grad_()
    B = (torch.randn(N, 4, generator=gen) * 0.02).requires_grad_()
    n = dorafp8.weight_norm(w8, scale, A, B, 2.0, backend="reference")
    m = n.clone().requires_grad_()
    x = torch.randn(*([2] * (x_dims - 2)), 16, K, generator=gen).bfloat16().requires_grad_()
    for _ in range(2):
        with LaunchRecorder() as rec:
            y = dorafp8.dora_fp8_linear(x, w8, scale, A, B, m, 2.0, dropout_p=dropout, training=True, backend=backend,
                                        weight_norm=n)
            y.backward(torch.ones_like(y))
    assert rec.launches
    return rec.ops


# The ops the front end (ops/, quant.py) issues for a reason: dropout's mask and xm, the backward's 0-dim views of the
# pass's (rl, rb) that the dgrad takes (the backend contract), and the backward pass op's placeholder for the gb it
# does not make (a custom op returns no None).
_FRONT_NEEDS = {("aten.empty_like.default", "ops/_policy.py:dropout_mask"),
                ("aten.bernoulli_.float", "ops/_policy.py:dropout_mask"),
                ("aten.ne.Scalar", "ops/_policy.py:dropout_mask"),
                ("aten.mul.Tensor", "ops/linear.py:forward"), ("aten.select.int", "ops/linear.py:backward"),
                ("aten.new_empty.default", "ops/_custom_ops.py:<genexpr>"),
                # a norm is detached into a tensor of its own even without history: OneTrainer's fused path passes
                # one tensor as magnitude and norm, and torch.compile refuses it twice in an autograd.Function
                ("aten.detach.default", "ops/_policy.py:reused_norm")}


@pytest.mark.backends("triton", "cublas")
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_front_end_issues_no_op_that_does_nothing(backend, dropout):
    """A 2-D x, a per-tensor scale and a norm without history: no reshape of x or of the result (and of their
    gradients in the backward), no view of the 0-dim scale (each was an op every call)."""
    ops = _step_ops(backend, dropout)
    front = [(op, origin) for op, origin in ops if origin.startswith(("ops/", "quant.py"))]
    assert set(front) <= _FRONT_NEEDS, front
    assert ("aten.view.default", "torch") not in ops, ops  # autograd's backward of a reshape


def test_a_3d_x_is_still_reshaped_and_its_result_a_tensor_of_its_own():
    """What the 2-D shortcut leaves to the other shapes: [2, 16, K] in, [2, 16, N] out, not a view (FSDP2)."""
    ops = _step_ops("triton", 0.0, x_dims=3)
    assert ("aten._unsafe_view.default", "ops/_policy.py:as_result") in ops, ops
    assert any(op == "aten.view.default" and origin.startswith("ops/") for op, origin in ops), ops


@pytest.mark.backends("triton", "cublas")
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_dgrad_makes_no_placeholder_per_call(backend, dropout):
    """The dgrad (and the cuBLAS strategy's dgrad epilogue) reshape rl once, as the kernel reads it, and take it as the
    placeholder of what the launch does not read: it made three to five views of rl (and rb) a call."""
    ops = _step_ops(backend, dropout)
    dgrad = [o for o in ops if o[1].startswith("triton_kernels/dgrad.py")]
    assert dgrad == ([("aten.view.dtype", "triton_kernels/dgrad.py:_epilogue_args")] if dropout else []), dgrad
    assert sum(o[1] == "triton_kernels/_common.py:vector" for o in ops) <= 2, ops  # rl, and rb with dropout


def test_vector_takes_a_flat_vector_as_it_is():
    """The per-column vectors (m, n, srow: 1-D, contiguous) reached the kernels through a reshape(-1) each, an op."""
    t = torch.ones(5)
    assert vector(t) is t and vector(t, torch.float32) is t
    assert vector(torch.ones(5, 1)).shape == (5,) and vector(torch.ones(5), torch.bfloat16).dtype == torch.bfloat16
    strided = torch.ones(10)[::2]
    assert vector(strided).is_contiguous() and torch.equal(vector(strided), strided)


# The Python of a step (issue 52: ~2 ms of the H200 host's enqueue is outside Triton's launch path). Each check below
# was a few microseconds a call, every call; the answers and the errors stay as they were.


def test_backend_needs_is_made_once_per_kind_act_quant_and_dtype():
    """backend_needs built four frozensets a call: now one per (scale kind, act_quant, compute dtype), and a changed
    dtype or kind still gets its own answer."""
    from dorafp8.ops._policy import backend_needs

    t, row = torch.ones(()), torch.ones(8)
    assert backend_needs(t, "", torch.bfloat16) is backend_needs(torch.ones(()), "", torch.bfloat16)
    assert backend_needs(t, "", torch.bfloat16) == frozenset()
    assert backend_needs(t, "", torch.float32) == {"fp32"}
    assert backend_needs(row, "", torch.float16) == {"fp16-row"}
    assert backend_needs(t, "", torch.float16) == frozenset()
    assert backend_needs(torch.ones(2, 2), "rowwise", torch.bfloat16) == {"block", "rowwise"}
    assert backend_needs(t, "", None) == frozenset()


def test_rank_dtype_promotes_only_mixed_adapters(monkeypatch):
    """torch.promote_types (a few microseconds) only where lora_A and lora_B differ; the answers as before."""
    from dorafp8.ops._policy import rank_dtype

    calls = []
    real = torch.promote_types
    monkeypatch.setattr(torch, "promote_types", lambda a, b: calls.append((a, b)) or real(a, b))
    x = torch.zeros(2, 4, dtype=torch.bfloat16)
    f32, bf16 = torch.zeros(1, dtype=torch.float32), torch.zeros(1, dtype=torch.bfloat16)
    assert rank_dtype(x, f32, f32) == torch.float32 and rank_dtype(x, bf16, bf16) == torch.bfloat16
    assert calls == []
    assert rank_dtype(x, bf16, f32) == torch.float32 and len(calls) == 1
    with pytest.raises(TypeError, match="lora_A / lora_B must be"):
        rank_dtype(x, torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64))


def test_scaling_and_dropout_of_builtin_types_skip_the_abc_check(monkeypatch):
    """A float or int scaling / dropout_p is taken without numbers.Real's ABC check (a microsecond or two each);
    other real numbers still pass through it, and what is not one is still refused."""
    import fractions
    import numbers

    from dorafp8.ops import _policy

    asked = []

    class Counted(type):  # numbers.Real, counting the checks made against it
        def __instancecheck__(cls, obj):
            asked.append(obj)
            return isinstance(obj, numbers.Real)

    monkeypatch.setattr(_policy, "numbers", type("numbers", (), {"Real": Counted("Real", (), {})}))
    _policy.check_scaling_dropout(2.0, 0.1)
    _policy.check_scaling_dropout(2, 0)
    assert asked == []
    _policy.check_scaling_dropout(fractions.Fraction(1, 2), 0.1)
    assert len(asked) == 1
    with pytest.raises(TypeError, match="scaling must be a real number"):
        _policy.check_scaling_dropout("2", 0.0)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        _policy.check_scaling_dropout(2.0, 1.0)


def test_a_named_backend_reads_no_race_variable(monkeypatch):
    """race.racing answers a named backend before it reads DORAFP8_RACE (an environment read, every call); "auto" still
    reads it, and still refuses a mistyped value (tests/ops/test_race.py)."""
    from dorafp8 import _env
    from dorafp8.backends import race

    read = []
    monkeypatch.setattr(race, "flag", lambda name, default=False: read.append(name) or _env.flag(name, default))
    cuda = torch.device("cuda")
    assert not race.racing("triton", cuda) and not race.racing("cublas", torch.device("cpu"))
    assert read == []
    monkeypatch.delenv("DORAFP8_BACKEND", raising=False)
    monkeypatch.delenv("DORAFP8_RACE", raising=False)
    assert race.racing("auto", cuda) and read == ["DORAFP8_RACE"]


def test_a_one_config_launch_runs_no_autotuner(monkeypatch):
    """A launcher whose list is one config (the interpreter's; a pinned one on a GPU) calls its JITFunction with that
    config (triton_kernels/_common.OneConfig): Autotuner.run rebuilt an argument dict a launch, two GEMMs a step."""
    from triton.runtime import autotuner

    runs = []
    real = autotuner.Autotuner.run
    monkeypatch.setattr(autotuner.Autotuner, "run", lambda self, *a, **k: runs.append(self) or real(self, *a, **k))
    assert _step_ops("triton", 0.0) and runs == []


def test_one_config_passes_what_the_autotuner_passed(monkeypatch):
    """OneConfig hands the JITFunction the arguments, grid, warmup and the config's kwargs, as Autotuner.run does with
    one config; a list of several (a GPU's) still gets the Autotuner, restoring the outputs under the NaN fill."""
    import triton

    from dorafp8.triton_kernels import _common

    class Fn:  # what the wrappers need of a JITFunction: its argument names and run
        arg_names = ["a", "b", "out"]

        def __init__(self):
            self.calls, self.fn = [], lambda a, b, out: None

        def run(self, *args, **kwargs):
            self.calls.append((args, kwargs))

    cfg = triton.Config({"BLOCK_M": 16, "GROUP_M": 2}, num_warps=4, num_stages=1)
    ours, theirs = Fn(), Fn()
    grid = (3,)
    monkeypatch.setattr(_common, "_TUNERS", {})
    monkeypatch.setattr(base, "POISON_OUTPUTS", True)
    one = _common.autotuned(ours, "t", [cfg], ["b"], ["out"])
    assert isinstance(one, _common.OneConfig) and one.configs == [cfg]
    one[grid](1, 2, out=None, X=5)
    triton.autotune(configs=[cfg], key=["b"], restore_value=["out"])(theirs)[grid](1, 2, out=None, X=5)
    assert ours.calls == theirs.calls and ours.calls[0][1]["BLOCK_M"] == 16
    two = _common.autotuned(ours, "t", [cfg, triton.Config({"BLOCK_M": 32, "GROUP_M": 2})], ["b"], ["out"])
    assert isinstance(two, triton.runtime.autotuner.Autotuner) and two.restore_value == ["out"]
