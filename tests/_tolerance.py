"""What "close" means in every numerical test: one tolerance per dtype and one check.

    assert_close(out, ref, rel, what)  passes when, for every element,  |out - ref| <= rel * (|ref| + max|ref|)

where `ref` is a float64 evaluation of the same formula on the same (already rounded) inputs (tests/_ref.py,
tests/kernels/_kernel_ref.py), another backend's output, or PEFT's. The bound has two parts:

- rel * |ref|, relative to the element: the final rounding of an output to its dtype is of this kind;
- rel * max|ref|, relative to the output's scale: a dot product whose operands were rounded (to a 16-bit compute
  dtype, or summed in fp32 in another order) is off by an amount set by its terms, not by its sum, so an element
  that cancels to near 0 keeps the absolute error of its neighbours.

A check relative to the element alone would fail on cancellation; one relative to the scale alone
(max|out - ref| <= rel * max|ref|) would not see a small element that is wrong. The bound is at most
2 * rel * max|ref| anywhere. NaN in `out` always fails (a tile a kernel never wrote, with DORAFP8_POISON=1).

tol(dtype) is `rel` for results computed in `dtype` (the compute dtype of the activations, or the rank dtype of the
low-rank path; where several dtypes meet, the least precise). u below is the dtype's unit roundoff.

    float32   1e-5   accumulation-order noise: fp32's u = 2^-24 (6e-8) times the growth of a sum of up to a few
                     thousand terms, with room. A kernel that loses precision somewhere (a tf32 dot, an operand
                     rounded to 16 bits) is off by 1e-4 or more and fails.
    float16   2e-3   4 u (u = 2^-11): the rounding of the output (1 u of the element) and of an operand before a
                     product (about 1 u of the output's scale), with 2x room.
    bfloat16  1e-2   2.5 u (u = 2^-8): the same roundings as fp16's, with about 2x room.

A check between two computations that each carry this error (a backend against the reference backend, gradients
through two GEMMs) allows 2 * tol. Worst seen on CPU (the whole suite, every backend that runs there), as a fraction
of the `rel` each check allows: fp32 0.22 (the 2-process jobs' logits against the 1-process run), fp16 0.46 (Triton's
project with a dropout mask), bf16 0.45 (the cuBLAS strategy's dgrad) and 0.83 (the gradients of a conv DoRA model
under bf16 autocast against PEFT's, at 2 * tol).

Where these numbers come from: before this module the kernel tests (tests/kernels/_kernel_ref.py) had this check with
bf16 at 1.6e-2, and the end-to-end tests (tests/_ref.py) max|out - ref| <= T * max|ref| with T = 2e-5, 4e-3, 2e-2 and
a few explicit T. This bound being at most 2 * rel * max|ref|, rel = T / 2 is never looser than T: 1e-5, 2e-3, 1e-2,
this table (explicit T became T / 2), which also tightens the kernel tests' bf16 from 1.6e-2 (their worst bf16 error
seen on CPU is 0.28 of that). GPU-only runs (tests/kernels/test_cuda.py, the larger Triton shapes) were not measured
at 1e-2.
"""

import torch

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def tol(dtype: torch.dtype) -> float:
    """The allowed error of a result computed in `dtype`, relative to |ref| + max|ref| (see the module docstring)."""
    return TOL[dtype]


def assert_close(out: torch.Tensor, ref: torch.Tensor, rel: float, what: str = ""):
    """|out - ref| <= rel * (|ref| + max|ref|) elementwise; NaN (an unwritten, poisoned element) always fails.
    Reports the first mismatching index and the worst error."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    o = out.detach().double().cpu()
    r = ref.detach().double().cpu()
    err = (o - r).abs()
    allowed = rel * (r.abs() + r.abs().max())
    bad = ~(err <= allowed)
    if bad.any():
        first = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{bad.numel()} mismatches; first at {first}: got {o[first].item()!r}, "
            f"expected {r[first].item()!r} (allowed {allowed[first].item():.3g}); max err "
            f"{err.nan_to_num(float('inf')).max().item():.3g}, output scale {r.abs().max().item():.3g}")
