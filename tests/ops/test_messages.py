"""Errors a newcomer meets first name the argument and the expected value."""

import pytest
import torch

import dorafp8


def _problem(N=16, K=32, r=8):
    w8, scale = dorafp8.quantize_e4m3(torch.randn(N, K) * 0.05)
    return torch.randn(3, K), w8, scale, torch.randn(r, K) * 0.1, torch.randn(N, r) * 0.1, torch.ones(N)


def test_transposed_lora_A_names_the_real_rank():
    x, w8, scale, A, B, m = _problem()
    with pytest.raises(ValueError, match=r"lora_A must have shape \[8, 32\], got \[32, 8\]"):
        dorafp8.dora_fp8_linear(x, w8, scale, A.T, B, m, 0.5)
    with pytest.raises(ValueError, match=r"lora_A must have shape \[8, 32\], got \[32, 8\]"):
        dorafp8.weight_norm(w8, scale, A.T, B, 0.5)


def _conv_problem(C_in=4, C_out=8, r=2):
    w8, scale = dorafp8.quantize_e4m3(torch.randn(C_out, C_in * 9) * 0.05)
    return (torch.randn(2, C_in, 6, 6), w8.reshape(C_out, C_in, 3, 3), scale, torch.randn(r, C_in, 3, 3) * 0.1,
            torch.randn(C_out, r, 1, 1) * 0.1, torch.ones(C_out))


def _calls(x_dtype=None, w_dtype=None, lora_dtype=None):
    """Every op and layer, called with x, the weight or lora_A in the given dtype (the rest as it should be)."""
    x, w8, scale, A, B, m = _problem()
    xc, w8c, scale_c, Ac, Bc, mc = _conv_problem()
    if x_dtype is not None:
        x, xc = x.to(x_dtype), xc.to(x_dtype)
    if w_dtype is not None:
        w8, w8c = w8.float().to(w_dtype), w8c.float().to(w_dtype)
    if lora_dtype is not None:
        A, Ac = A.to(lora_dtype), Ac.to(lora_dtype)
    calls = {
        "fp8_linear": lambda: dorafp8.fp8_linear(x, w8, scale),
        "dora_fp8_linear": lambda: dorafp8.dora_fp8_linear(x, w8, scale, A, B, m, 0.5),
        "fp8_conv": lambda: dorafp8.fp8_conv(xc, w8c, scale_c),
        "dora_fp8_conv": lambda: dorafp8.dora_fp8_conv(xc, w8c, scale_c, Ac, Bc, mc, 0.5),
    }
    if w_dtype is None:
        lin = dorafp8.FP8Linear.from_fp8(w8, scale)
        conv = dorafp8.FP8Conv2d.from_fp8(w8c, scale_c)
        calls.update({"FP8Linear": lambda: lin(x), "FP8Conv2d": lambda: conv(xc)})
    else:
        calls.update({"weight_norm": lambda: dorafp8.weight_norm(w8, scale, A, B, 0.5),
                      "FP8Linear.from_fp8": lambda: dorafp8.FP8Linear.from_fp8(w8, scale)})
    return calls


@pytest.mark.parametrize("dtype", [torch.float8_e5m2, torch.float8_e4m3fn])
def test_fp8_activations_name_x_and_the_dtypes_expected(dtype):
    for call in _calls(x_dtype=dtype).values():
        with pytest.raises(TypeError, match=rf"^x must be float32, bfloat16 or float16, got {dtype}: only the frozen "
                                            rf"base weight \(w8\) is fp8.*act_quant='rowwise'"):
            call()


def test_fp8_adapters_name_the_adapter():
    """An e5m2 lora_A used to reach torch's type promotion ("Promotion for Float8 Types is not supported")."""
    for op, call in _calls(lora_dtype=torch.float8_e5m2).items():
        if op.startswith("dora") or op == "weight_norm":
            with pytest.raises(TypeError, match=r"^lora_A must be float32, bfloat16 or float16, got "
                                                r"torch.float8_e5m2: only the frozen base weight"):
                call()


def test_an_e5m2_weight_names_w8_and_how_to_get_e4m3():
    for call in _calls(w_dtype=torch.float8_e5m2).values():
        with pytest.raises(TypeError, match=r"^w8 must be a torch.float8_e4m3fn tensor, got torch.float8_e5m2; another "
                                            r"fp8 format does not convert to e4m3 exactly .*dorafp8.quantize_e4m3"):
            call()


@pytest.mark.parametrize("op", ["fp8_conv", "dora_fp8_conv"])
def test_a_conv_bias_is_checked_like_the_other_arguments(op):
    """fp8_conv took any bias (an fp8 one was cast silently); both conv ops now name a wrong dtype or size."""
    x, w8, scale, A, B, m = _conv_problem()
    call = {"fp8_conv": lambda bias: dorafp8.fp8_conv(x, w8, scale, bias),
            "dora_fp8_conv": lambda bias: dorafp8.dora_fp8_conv(x, w8, scale, A, B, m, 0.5, bias)}[op]
    with pytest.raises(TypeError, match=r"bias must be float32, bfloat16 or float16, got torch.float8_e4m3fn"):
        call(torch.zeros(w8.shape[0]).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match=rf"bias must have {w8.shape[0]} elements"):
        call(torch.zeros(w8.shape[0] + 1))
    assert call(torch.zeros(w8.shape[0])).shape[1] == w8.shape[0]


def test_a_precomputed_weight_norm_on_another_device_or_of_ints_is_named():
    """weight_norm= was the one tensor argument whose device was not checked: the backend failed deep inside with
    "Tensor on device meta is not on the expected device cpu!" (the meta device stands in for a GPU here); an integer
    one was taken, truncated."""
    x, w8, scale, A, B, m = _problem()
    xc, w8c, sc, Ac, Bc, mc = _conv_problem()
    calls = ((m.shape[0], lambda n: dorafp8.dora_fp8_linear(x, w8, scale, A, B, m, 0.5, weight_norm=n)),
             (mc.shape[0], lambda n: dorafp8.dora_fp8_conv(xc, w8c, sc, Ac, Bc, mc, 0.5, weight_norm=n)))
    for N, call in calls:
        with pytest.raises(ValueError, match=r"weight_norm is on meta but x is on cpu"):
            call(torch.ones(N, device="meta"))
        with pytest.raises(TypeError, match=r"weight_norm must be a float tensor .*, got torch.int64"):
            call(torch.ones(N, dtype=torch.int64))


@pytest.mark.parametrize("shape", [(0, 32), (16, 0)])
def test_an_empty_weight_is_named(shape):
    """quantize_e4m3 refuses an empty weight; the ops took one and failed inside (amax() of an empty tensor on the CPU,
    ZeroDivisionError in the Triton launchers, "cannot reshape tensor of 0 elements")."""
    w8 = torch.zeros(shape).to(torch.float8_e4m3fn)
    x, one, (N, K) = torch.randn(3, shape[1]), torch.ones(()), shape
    A, B, m = torch.ones(2, K), torch.ones(N, 2), torch.ones(N)
    calls = (lambda: dorafp8.fp8_linear(x, w8, one), lambda: dorafp8.dora_fp8_linear(x, w8, one, A, B, m, 1.0),
             lambda: dorafp8.weight_norm(w8, one, A, B, 1.0))
    for call in calls:
        with pytest.raises(ValueError, match=rf"w8 must not be empty, got shape \({shape[0]}, {shape[1]}\)"):
            call()


def _switch_readers():
    """Where each of README's 0 / 1 switches is read: (variable, a call that reads it)."""
    import subprocess
    import sys
    from pathlib import Path

    from dorafp8 import triton_kernels  # noqa: F401  (dorafp8.triton_kernels.hopper below)
    from dorafp8._install import install
    from dorafp8.backends import cuda_build, race
    from dorafp8.nn._base import peft_unregistered
    from dorafp8.triton_kernels.hopper import main_loop_for

    root = Path(__file__).resolve().parents[2]

    def setup_py():  # as pip runs it (its ValueError comes back as the child's stderr)
        out = subprocess.run([sys.executable, "setup.py", "--name"], cwd=root, capture_output=True, text=True)
        if out.returncode:
            raise ValueError(out.stderr)

    return [("DORAFP8_RACE", lambda: race.racing("auto", torch.device("cuda"))),
            ("DORAFP8_NO_PATCHES", peft_unregistered), ("DORAFP8_NO_PATCHES", install),
            ("DORAFP8_FORCE_CUDA_BUILD", cuda_build.forced), ("DORAFP8_HOPPER_GEMM", lambda: main_loop_for("sm90")),
            ("DORAFP8_SKIP_CUDA_BUILD", setup_py)]


@pytest.mark.parametrize("value", ["true", "false", "off", "yes"])
def test_a_switch_set_to_a_word_is_refused_naming_it(monkeypatch, value):
    """Only "1" turned a switch on and only "0" off: DORAFP8_NO_PATCHES=true patched PEFT all the same,
    DORAFP8_HOPPER_GEMM=false kept the Hopper loop, DORAFP8_SKIP_CUDA_BUILD=true built. Every one is read by
    dorafp8._env.flag now, which refuses anything but 0, 1 and unset, naming the variable."""
    pytest.importorskip("triton")
    for name, read in _switch_readers():
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=f"{name} must be 0 \\(off\\) or 1 \\(on\\), got '{value}'"):
            read()
        monkeypatch.delenv(name)
