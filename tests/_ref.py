"""fp64 ground truth for the tests: DORA_MATH.md written with autograd in float64, straight from the formulas."""

import torch


def dora_fp64(x, W0, A, B, m, s, bias=None, xd=None):
    """PEFT's DoRA forward in fp64 with autograd; n detached. xd: the dropped-out x (None: no dropout).

    Returns (y, leaves) where leaves = (x, A, B, m) fp64 leaves requiring grad."""
    x = x.detach().double().requires_grad_()
    A = A.detach().double().requires_grad_()
    B = B.detach().double().requires_grad_()
    m = m.detach().double().requires_grad_()
    W0 = W0.double()
    n = (W0 + s * B @ A).norm(dim=1).detach()
    c = m / n
    if xd is None:
        y = c * (x @ W0.T + s * (x @ A.T) @ B.T)
    else:
        # xd as a function of x: the same mask and 1/(1-p) scaling
        keep, p = xd
        xdd = x * keep.double() / (1 - p)
        y = x @ W0.T + (c - 1) * (xdd @ W0.T) + c * (s * (xdd @ A.T) @ B.T)
    if bias is not None:
        y = y + bias.double()
    return y, (x, A, B, m)


def rel_err(a, b):
    """max |a - b| / max |b| (b the fp64 reference), with the first mismatching index in the message."""
    a, b = a.double(), b.double()
    scale = b.abs().max().clamp_min(1e-30)
    return ((a - b).abs().max() / scale).item()


def assert_close(a, b, tol, name=""):
    assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    a64, b64 = a.double(), b.double()
    if torch.isnan(a64).any() and not torch.isnan(b64).any():
        idx = torch.isnan(a64).nonzero()[0].tolist()
        raise AssertionError(f"{name}: NaN at index {idx} (unwritten output?)")
    err = rel_err(a64, b64)
    if not err <= tol:
        diff = (a64 - b64).abs()
        idx = divmod(diff.argmax().item(), diff.shape[-1]) if diff.dim() == 2 else diff.argmax().item()
        raise AssertionError(f"{name}: rel err {err:.3e} > tol {tol:.1e}; worst at {idx}")


# Relative tolerance (to the output's max) for results computed in a given dtype: a few units of its epsilon times
# the growth of a sum of k terms. fp32 keeps fp32 accuracy; bf16/fp16 are dominated by the input rounding.
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}
