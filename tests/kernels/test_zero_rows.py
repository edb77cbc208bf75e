"""Zero rows in the fp8 base (issue #12, point 5).

Real checkpoints have all-zero weight rows (Llama-3.1-8B's o_proj has 511) and fp8 underflow adds more: with one scale
per tensor set by an outlier, a row of tiny weights quantizes to all zeros. DoRA's c = m / ||W0 + s B A|| is then
0 / 0 at initialization (B = 0, m = the row norm = 0): PEFT 0.21 returns NaN at step 0. dorafp8 divides a zero norm
as ops.NORM_EPS, so such a row gives c = 0: a zero output row (bias aside) and zero gradients for its adapter entries,
on every backend, and it stays so under training and when merged. A norm that is tiny but not zero is divided as it
is: c = m / n, PEFT's value."""

import copy
import warnings

import pytest
import torch

import dorafp8
from dorafp8 import ops
from tests._ref import dora_fp64
from tests._tolerance import assert_close, tol

ZERO_ROWS = [3, 7, 20]        # exactly zero in the float weight
TINY_ROWS = [5, 30, 31]       # 1e-7: below e4m3's smallest subnormal under the per-tensor scale the outlier sets


def _weight(N=48, K=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(N, K, generator=g) / K ** 0.5
    W[ZERO_ROWS] = 0
    W[TINY_ROWS] = 1e-7 * torch.randn(len(TINY_ROWS), K, generator=g)
    W[0, 0] = 50.0  # the outlier: per-tensor scale 50 / 448, smallest subnormal ~2e-4
    return W


def _quantized(kind):
    W = _weight()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dorafp8.quant.QuantizationWarning)  # the per-tensor case warns, rightly
        if kind == "tensor":
            return dorafp8.quantize_e4m3(W)
        if kind == "row":
            return dorafp8.quantize_e4m3(W, per_row=True)
        return dorafp8.quantize_e4m3(W, block_size=16)


def _dead_rows(w8):
    return (w8.float() == 0).all(dim=1).nonzero().flatten().tolist()


@pytest.mark.parametrize("kind", ["tensor", "row", "block"])
@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_zero_rows_at_init_every_backend(device, backend, kind, dropout):
    """On every (device, backend) pair that can run here (tests/conftest.py)."""
    w8, scale = _quantized(kind)
    dead = _dead_rows(w8)
    assert set(ZERO_ROWS) <= set(dead)
    if kind == "tensor":  # the tiny rows underflowed to zero too
        assert set(TINY_ROWS) <= set(dead)
    N, K = w8.shape
    r, s = 4, 2.0
    g = torch.Generator().manual_seed(1)
    A = torch.randn(r, K, generator=g) / K ** 0.5
    B = torch.zeros(N, r)  # PEFT's init
    bias = torch.randn(N, generator=g)
    x = torch.randn(6, K, generator=g)
    block = 16
    w8, scale, A, B, bias, x = (t.to(device) for t in (w8, scale, A, B, bias, x))
    n = dorafp8.weight_norm(w8, scale, A, B, s, backend=backend, block_size=block)
    assert (n[dead] == 0).all() and (n[[j for j in range(N) if j not in dead]] > 0).all()
    m = n.clone()  # DoRA's init: the magnitude is the norm
    xl, Al, Bl, ml = (t.clone().requires_grad_() for t in (x, A, B, m))
    torch.manual_seed(0)
    y = dorafp8.dora_fp8_linear(xl, w8, scale, Al, Bl, ml, s, bias, dropout_p=dropout, training=dropout > 0,
                                backend=backend, block_size=block)
    assert torch.isfinite(y).all()
    assert torch.equal(y[:, dead], bias[dead].expand(y.shape[0], -1))  # zero rows: exactly the bias
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(2)).to(device))
    for t in (xl, Al, Bl, ml):
        assert torch.isfinite(t.grad).all()
    assert (ml.grad[dead] == 0).all() and (Bl.grad[dead] == 0).all()
    if dropout == 0:  # the live rows are untouched by the clamp: DoRA in fp64 on those columns
        live = [j for j in range(N) if j not in dead]
        W0 = dorafp8.dequantize_e4m3(w8, scale, torch.float64, block_size=block).cpu()
        y64, _ = dora_fp64(x.cpu(), W0[live], A.cpu(), B.cpu()[live], m.cpu()[live], s, bias.cpu()[live])
        assert_close(y[:, live].cpu(), y64, tol(torch.float32), "live rows")


transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def llama_with_zero_rows():
    """A tiny LLaMA (float32) whose first o_proj has the all-zero rows ZERO_ROWS, the 1e-7 rows TINY_ROWS and one
    outlier weight of 50 (docs/figures/measured.py runs PEFT's own DoRA on it)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        o = model.model.layers[0].self_attn.o_proj.weight
        o[ZERO_ROWS] = 0
        o[TINY_ROWS] = 1e-7 * torch.randn(len(TINY_ROWS), o.shape[1])
        o[0, 0] = 50.0
    return model


def _model_with_zero_rows(per_row: bool):
    model = llama_with_zero_rows()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dorafp8.quant.QuantizationWarning)
        dorafp8.quantize_model(model, per_row_scale=per_row)
    return model


@pytest.mark.parametrize("per_row", [False, True])
def test_peft_model_trains_without_nan_and_zero_rows_stay_zero(per_row):
    model = _model_with_zero_rows(per_row)
    dead = _dead_rows(model.model.layers[0].self_attn.o_proj.weight)
    assert set(ZERO_ROWS) <= set(dead) and (per_row or set(TINY_ROWS) <= set(dead))
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules="all-linear"))
    layer = pm.base_model.model.model.layers[0].self_attn.o_proj
    mag = layer.lora_magnitude_vector["default"].weight
    assert torch.isfinite(mag).all() and (mag[dead] == 0).all()  # DoRA's init: no NaN/inf from the zero norms
    outs = []
    layer.register_forward_hook(lambda mod, inp, out: outs.append(out.detach()))
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    for step in range(3):
        loss = pm(input_ids=ids, labels=ids).loss
        assert torch.isfinite(loss), step
        loss.backward()
        B = layer.lora_B["default"].weight
        if step == 0:
            assert (B.grad[dead] == 0).all() and (mag.grad[dead] == 0).all()
        assert all(torch.isfinite(p.grad).all() for p in pm.parameters() if p.grad is not None)
        opt.step()
        opt.zero_grad()
        assert (outs[-1][..., dead] == 0).all(), step  # o_proj has no bias: zero rows give zero outputs
    assert all(torch.isfinite(p.float()).all() for p in pm.parameters())  # fp8 weights too: isfinite has no fp8
    # kernel on some torch releases (2.14)
    assert (mag[dead] == 0).all() and (layer.lora_B["default"].weight[dead] == 0).all()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        merged = pm.merge_and_unload()
    w = merged.model.layers[0].self_attn.o_proj
    assert torch.isfinite(w.dequantize()).all() and (w.weight.float()[dead] == 0).all()


@pytest.mark.parametrize("kind", ["linear", "conv2d"])
def test_dora_init_refuses_a_magnitude_that_overflows_the_adapter_dtype(kind):
    """fp16 adapters (autocast_adapter_dtype=False) on rows whose norm exceeds fp16's max: an error that says so,
    not an inf magnitude."""
    if kind == "linear":
        layer, fp8 = torch.nn.Linear(64, 32).half(), dorafp8.FP8Linear
    else:
        layer, fp8 = torch.nn.Conv2d(16, 32, 3).half(), dorafp8.FP8Conv2d
    with torch.no_grad():
        layer.weight.normal_(0, 1e4)
    model = torch.nn.Sequential()
    model.add_module("proj", fp8.from_float(layer))
    with pytest.raises(ValueError, match="overflows torch.float16.*float32"):
        peft.get_peft_model(model, peft.LoraConfig(r=4, use_dora=True, target_modules=["proj"]),
                            autocast_adapter_dtype=False)


# ---- tiny but non-zero norms: c = m / n as PEFT computes it ------------------------------------------------------

TINY_NORMS = {4: 1e-13, 11: 1e-15, 17: 1e-17}  # row -> its norm: below the zero rows' stand-in NORM_EPS, far above 0


def _tiny_problem(N=24, K=40, r=4, trained=True, seed=0):
    """Per-row fp8 weight whose rows TINY_NORMS have those norms (a row under a tiny per-row scale), adapters whose
    rows there are as tiny (so that W0 + s B A keeps the tiny norm), and a magnitude at or near DoRA's init (m ~ n)."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(N, K, generator=g) / K ** 0.5
    for j, norm in TINY_NORMS.items():
        W[j] *= norm / W[j].norm()
    w8, scale = dorafp8.quantize_e4m3(W, per_row=True)
    A = torch.randn(r, K, generator=g) / K ** 0.5
    B = torch.randn(N, r, generator=g) * 0.1 if trained else torch.zeros(N, r)
    for j, norm in TINY_NORMS.items():
        B[j] *= norm
    s = 2.0
    n = dorafp8.weight_norm(w8, scale, A, B, s, backend="reference")
    m = n * (1 + 0.2 * torch.randn(N, generator=g)) if trained else n.clone()
    x = torch.randn(6, K, generator=g)
    return x, w8, scale, A, B, m, s


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_tiny_nonzero_norms_give_pefts_values_every_backend(device, backend, dropout):
    """0 < n < NORM_EPS: such a row is no zero row, and c = m / n exactly as PEFT computes it (a clamp at NORM_EPS
    scaled its outputs by n / NORM_EPS, and broke 'DoRA equals the base layer at init'). At init (B = 0, m = n) the
    layer gives the base layer's output; trained, outputs and every gradient match DoRA evaluated in fp64, on the tiny
    rows at their own scale."""
    tiny = sorted(TINY_NORMS)
    for trained in (False, True):
        x, w8, scale, A, B, m, s = _tiny_problem(trained=trained)
        n = dorafp8.weight_norm(w8, scale, A, B, s, backend=backend)
        assert ((n[tiny] > 0) & (n[tiny] < ops.NORM_EPS)).all()
        dev = [t.to(device) for t in (x, w8, scale, A, B, m)]
        xl, Al, Bl, ml = (t.clone().requires_grad_() for t in (dev[0], dev[3], dev[4], dev[5]))
        torch.manual_seed(7)
        y = dorafp8.dora_fp8_linear(xl, dev[1], dev[2], Al, Bl, ml, s, dropout_p=dropout, training=dropout > 0,
                                    backend=backend)
        torch.manual_seed(7)
        keep = ops.dropout_mask(x, dropout) if dropout else None
        W0 = dorafp8.dequantize_e4m3(w8, scale, torch.float64)
        if not trained:  # DoRA at init is the base layer, on every row
            for j in tiny:  # each row at its own scale
                assert_close(y[:, j].cpu(), x.double() @ W0[j], tol(torch.float32), f"init: row {j} = base layer")
        gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
        y.backward(gy.to(device))
        yr, leaves = dora_fp64(x, W0, A, B, m, s, xd=None if keep is None else (keep, dropout))
        yr.backward(gy.double())
        for j in tiny:
            assert_close(y[:, j].cpu(), yr[:, j], tol(torch.float32), f"row {j} (trained={trained})")
        for name, got, ref in (("dm", ml.grad, leaves[3].grad), ("dB", Bl.grad, leaves[2].grad)):
            assert_close(got[tiny].cpu(), ref[tiny], tol(torch.float32), f"{name} (trained={trained})")
        assert_close(Al.grad.cpu(), leaves[1].grad, tol(torch.float32), "dA")


def test_tiny_nonzero_norms_in_peft_layers_and_merges_match_peft():
    """The same rows in PEFT layers (linear and conv, the fused path and PEFT's general one with two active adapters)
    and in merges: dorafp8 on the fp8 base against PEFT's own DoRA on its dequantized weights, which computes
    m / ||W + s B A|| with no clamp and is right there. Merged rows are m / n * V as PEFT merges them."""
    x, w8, scale, A, B, m, s = _tiny_problem(trained=False)
    N, K = w8.shape
    W0 = dorafp8.dequantize_e4m3(w8, scale, torch.float32)
    lin = torch.nn.Linear(K, N, bias=False)
    conv = torch.nn.Conv2d(K // 4, N, 2, bias=False)  # [N, K // 4, 2, 2]: the same rows as the linear weight
    with torch.no_grad():
        lin.weight.copy_(W0)
        conv.weight.copy_(W0.reshape(conv.weight.shape))
    tiny = sorted(TINY_NORMS)
    xc = torch.randn(3, K // 4, 5, 5, generator=torch.Generator().manual_seed(4))
    for base, inp in ((lin, x), (conv, xc)):
        def model(fp8):
            net = torch.nn.Sequential()
            net.add_module("layer", copy.deepcopy(base))
            if fp8:
                dorafp8.quantize_model(net, per_row_scale=True, include_conv=True)
            return net

        theirs = peft.get_peft_model(model(False), peft.LoraConfig(r=4, use_dora=True, target_modules=["layer"]))
        ours = peft.get_peft_model(model(True), peft.LoraConfig(r=4, use_dora=True, target_modules=["layer"]))
        for pm in (theirs, ours):  # a second adapter, both active: PEFT's general path in dorafp8's layers
            pm.add_adapter("other", peft.LoraConfig(r=2, use_dora=True, target_modules=["layer"]))
        for mode in ("init", "two adapters", "trained"):
            if mode == "two adapters":
                for pm in (theirs, ours):
                    pm.base_model.set_adapter(["default", "other"])
            if mode == "trained":
                g = torch.Generator().manual_seed(5)
                for pm in (theirs, ours):
                    pm.base_model.set_adapter("default")
                for (name, p), (name_q, q) in zip(theirs.named_parameters(), ours.named_parameters()):
                    assert name == name_q
                    if "lora_" in name and p.requires_grad:
                        d = torch.randn(p.shape, generator=g)
                        with torch.no_grad():
                            if "magnitude" in name:
                                p.mul_(1 + 0.2 * d)
                            else:
                                p.add_(0.1 * d * (p.abs().amax() if "lora_B" in name else 1))
                            q.copy_(p)
            with torch.no_grad():
                want, got = theirs(inp), ours(inp)
            assert torch.isfinite(want).all()
            for j in tiny:
                assert_close(got[:, j], want[:, j], tol(torch.float32), f"{type(base).__name__} {mode}, row {j}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            merged = ours.merge_and_unload().layer
        layer = theirs.base_model.model.layer
        V = layer.weight.detach().double().reshape(N, -1) + layer.scaling["default"] * (
            layer.lora_B["default"].weight.double().reshape(N, -1) @ layer.lora_A["default"].weight.double()
            .reshape(layer.lora_A["default"].weight.shape[0], -1))
        mag = layer.lora_magnitude_vector["default"].weight.double().reshape(-1)
        want_w = (mag / V.norm(dim=1))[:, None] * V
        got_w = merged.dequantize(torch.float64).reshape(N, -1)
        for j in tiny:  # one e4m3 rounding per row (per-row scales)
            assert_close(got_w[j], want_w[j], 2 ** -4, f"merged row {j}")
