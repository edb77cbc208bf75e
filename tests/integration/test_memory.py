"""The reference backend never materializes the whole dequantized weight: its temporaries are bounded row blocks.

Memory on CPU is measured with dorafp8._memory.PeakTemporaries, a TorchDispatchMode that sees every aten op (and
opens dorafp8's custom ops): each output with a storage none of the op's inputs had is a new allocation, counted until
its storage dies. That gives the peak of live temporaries made inside the measured call (inputs that existed before
it are not counted).
"""

import pytest
import torch

import dorafp8
from dorafp8._memory import MiB, PeakTemporaries


def _big(N=8192, K=8192, r=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    w8 = (torch.randn(N, K, generator=g) * 100).clamp_(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.tensor(0.01)
    A = torch.randn(r, K, generator=g) * 0.01
    B = torch.randn(N, r, generator=g) * 0.01
    return w8, scale, A, B


def test_tracker_sees_a_dense_temporary():
    """The measuring tool itself must catch the thing it guards against, also inside dorafp8's custom ops."""
    w8, scale, A, B = _big(1024, 1024)
    with PeakTemporaries() as mode:
        dense = w8.float() * scale + B @ A
        dense.norm(dim=1)
    assert mode.largest >= 1024 * 1024 * 4 and mode.peak >= 2 * 1024 * 1024 * 4
    with PeakTemporaries() as mode:  # 1024 x 1024 fits one 16 MiB row block: one dense fp32 block inside the op
        dorafp8.weight_norm(w8, scale, A, B, 2.0, backend="reference")
    assert mode.largest >= 1024 * 1024 * 4


def test_tracker_counts_a_storage_until_its_last_view_dies():
    """linear on a 3-D input is mm then _unsafe_view: the mm result's tensor dies at once, its storage lives on in the
    view (and in what autograd saves). The tracker must count the storage, not the first tensor it was seen in."""
    w = torch.randn(512, 512, requires_grad=True)
    x = torch.randn(4, 256, 512)
    with PeakTemporaries() as mode:
        y = torch.nn.functional.linear(x, w)  # [1024, 512] fp32: 2 MiB
        (y * 2).sum()  # allocates again (the tracker sweeps dead storages only when something new is allocated)
        live_with_y = mode.cur
        del y
        torch.ones(1)
        live_without_y = mode.cur
    assert live_with_y >= 2 * MiB, f"{live_with_y / MiB:.2f} MiB live while y is"
    assert live_without_y < 2 * MiB, f"{live_without_y / MiB:.2f} MiB live after y died"


class _SweepEveryOp(PeakTemporaries):
    """The tracker as it was: every dead storage forgotten before each op (exact, and quadratic in live storages)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._sweep()
        return super().__torch_dispatch__(func, types, args, kwargs)


def test_tracker_peak_equals_a_sweep_before_every_op():
    """The tracker sweeps only when its count would pass the peak; the peak must be the one a sweep per op gives, on a
    hand-made sequence (a freed buffer must not count towards the next one's peak) and on a DoRA training step."""
    def freed_then_larger():
        a = torch.empty(256 * 1024)  # 1 MiB
        del a
        b = torch.empty(512 * 1024)  # 2 MiB, with a dead
        c = b + 1  # 2 MiB more, b alive
        del b, c
        torch.empty(1024 * 1024)  # 4 MiB alone: the peak is 4 MiB, not 1 + 2 + 2 + 4
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = peft.get_peft_model(dorafp8.quantize_model(torch.nn.Sequential(
        torch.nn.Linear(96, 80), torch.nn.GELU(), torch.nn.Linear(80, 64)), verbose=False),
        peft.LoraConfig(r=4, use_dora=True, target_modules=["0", "2"], lora_dropout=0.1))
    x = torch.randn(33, 96)

    def step():
        model(x).square().mean().backward()
    step()  # gradients allocated once
    for fn, expect in ((freed_then_larger, 4 * MiB), (step, None)):
        with PeakTemporaries() as lazy:
            fn()
        with _SweepEveryOp() as every:
            fn()
        assert lazy.peak == every.peak and lazy.largest == every.largest
        assert expect is None or lazy.peak == expect, lazy.peak / MiB
        assert lazy.peak > 0


def test_weight_norm_peak_memory_8192():
    w8, scale, A, B = _big()
    dense_fp32 = w8.numel() * 4  # 256 MiB: what one dense [N, K] fp32 temporary would cost
    with PeakTemporaries() as mode:
        n = dorafp8.weight_norm(w8, scale, A, B, 2.0, backend="reference")
    assert n.shape == (8192,)
    # bound: two 16 MiB row blocks (the block and the small B-block upcast beside it), far below one dense copy
    assert mode.peak <= 40 * MiB, f"peak {mode.peak / MiB:.1f} MiB"
    assert mode.largest < dense_fp32 / 8
    # and the blocked result is the dense one
    ref = torch.cat([(w8[i:i + 1024].double() * 0.01 + 2.0 * B[i:i + 1024].double() @ A.double()).norm(dim=1)
                     for i in range(0, 8192, 1024)])
    assert torch.allclose(n.double(), ref, rtol=1e-5)


def _training_step(n, tokens, backend):
    """The temporaries of one forward and backward through an n x n layer (fp32 activations and adapters)."""
    w8, scale, A, B = _big(n, n)
    m = torch.rand(n) + 0.5
    x = torch.randn(tokens, n, requires_grad=True)
    Al, Bl, ml = (t.clone().requires_grad_() for t in (A, B, m))
    with PeakTemporaries() as mode:
        y = dorafp8.dora_fp8_linear(x, w8, scale, Al, Bl, ml, 2.0, backend=backend)
        y.sum().backward()
    return mode


def test_forward_backward_temporaries_bounded_8192():
    mode = _training_step(8192, 4, "reference")
    assert mode.largest <= 16 * MiB, f"largest temporary {mode.largest / MiB:.1f} MiB"
    assert mode.peak <= 64 * MiB, f"peak {mode.peak / MiB:.1f} MiB"


def test_backward_temporaries_bounded_many_tokens():
    """The backward (the pass over g and z, dgrad, dA) in bounded row blocks too: with 8192 tokens no fp32 [M, N]
    or [M, K] temporary (32 MiB here) appears; the largest allocations are the bf16 outputs (dx) themselves."""
    M, N, K = 8192, 1024, 1024
    w8, scale, A, B = _big(N, K)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16).requires_grad_()
    Al, Bl = A.clone().requires_grad_(), B.clone().requires_grad_()  # fp32 adapters: the fp32 rank path
    ml = (torch.rand(N, generator=g) + 0.5).requires_grad_()
    y = dorafp8.dora_fp8_linear(x, w8, scale, Al, Bl, ml, 2.0, dropout_p=0.1, training=True, backend="reference")
    gy = torch.randn(M, N, generator=g).to(torch.bfloat16)
    with PeakTemporaries() as mode:
        y.backward(gy)
    fp32_activation = M * N * 4
    assert mode.largest < fp32_activation, f"largest temporary {mode.largest / MiB:.1f} MiB"
    assert mode.largest <= M * K * 2, f"largest temporary {mode.largest / MiB:.1f} MiB"
    assert mode.peak <= 128 * MiB, f"peak {mode.peak / MiB:.1f} MiB"
    assert x.grad.dtype == torch.bfloat16 and Al.grad.dtype == torch.float32


def test_native_backend_keeps_one_weight_block_alive_at_a_time():
    """The native backend dequantizes the weight one 16 MiB block of rows at a time in forward and dgrad: each block
    must be dropped before the next is made (the fast fp8 conversion itself takes 6 bytes an element of int16
    scratch, 24 MiB for a 16 MiB fp32 block). Two blocks alive at once would reach 40 MiB."""
    mode = _training_step(4096, 8, "native")
    assert mode.peak <= 30 * MiB, f"peak {mode.peak / MiB:.1f} MiB"


def _kept_for_backward(layer, x) -> dict:
    """{storage: (bytes, dtype, shape)} of what autograd keeps for the backward of one call of `layer` on x, beyond x
    and the layer's parameters and buffers: the activation memory the layer adds to a training step."""
    known = {t.untyped_storage().data_ptr() for t in (x, *layer.parameters(), *layer.buffers())}
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), t.dtype, tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    y.float().sum().backward()  # the saved tensors are the ones a backward uses
    return {k: v for k, v in kept.items() if k not in known}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_dora_layer_keeps_z_u_n_and_the_mask_for_its_backward(dropout):
    """A DoRAFP8Linear in training (bf16 activations, PEFT's fp32 adapters) keeps for its backward z [M, N] in bf16,
    u [M, r] in fp32, the norm n [N] in fp32 and, with dropout, the bool mask [M, K]: nothing else beyond its input
    and parameters (docs/DORA_MATH.md, "Dtype policy"). PEFT 0.21's DoRA keeps on the same layer an fp32 copy of x,
    the base output, its fp32 low-rank output and the identity matrix it pushes through the adapters to form B A;
    PEFT's plain LoRA an fp32 copy of x (docs/GUIDE.md, "What the demo shows", quotes these figures)."""
    from peft import LoraConfig, get_peft_model

    M, K, N, r = 512, 256, 384, 16
    kept = {}
    for kind in ("dorafp8", "peft-dora", "peft-lora"):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(K, N)).to(torch.bfloat16)
        if kind == "dorafp8":
            dorafp8.quantize_model(net)
        pm = get_peft_model(net, LoraConfig(r=r, lora_alpha=2 * r, target_modules=["0"], use_dora=kind != "peft-lora",
                                            lora_dropout=dropout)).train()
        layer = pm.base_model.model[0]
        assert (type(layer).__name__ == "DoRAFP8Linear") == (kind == "dorafp8")
        kept[kind] = _kept_for_backward(layer, torch.randn(M, K, dtype=torch.bfloat16, requires_grad=True))
    ours = sorted((str(d), s) for _, d, s in kept["dorafp8"].values())
    expected = [("torch.bfloat16", (M, N)), ("torch.float32", (M, r)), ("torch.float32", (N,))]
    assert ours == sorted(expected + ([("torch.bool", (M, K))] if dropout else [])), ours
    nbytes = {k: sum(b for b, _, _ in v.values()) for k, v in kept.items()}
    assert nbytes["dorafp8"] == M * N * 2 + M * r * 4 + N * 4 + (M * K if dropout else 0)
    # what PEFT keeps (measured with PEFT 0.21.2: 1972 and 3252 KiB, LoRA 544 and 1056, against our 418 and 546)
    assert nbytes["peft-dora"] > 4 * nbytes["dorafp8"], {k: v // 1024 for k, v in nbytes.items()}
    assert nbytes["peft-lora"] > nbytes["dorafp8"], {k: v // 1024 for k, v in nbytes.items()}
