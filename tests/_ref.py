"""fp64 ground truth for the end-to-end tests: DORA_MATH.md written with autograd in float64, straight from the
formulas. Compare with tests._tolerance.assert_close."""


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
