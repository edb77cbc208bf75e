"""Zero rows in the fp8 base (issue #12, point 5).

Real checkpoints have all-zero weight rows (Llama-3.1-8B's o_proj has 511) and fp8 underflow adds more: with one scale
per tensor set by an outlier, a row of tiny weights quantizes to all zeros. DoRA's c = m / ||W0 + s B A|| is then
0 / 0 at initialization (B = 0, m = the row norm = 0): PEFT 0.21 returns NaN at step 0. dorafp8 clamps the norm to
ops.NORM_EPS, so such a row gives c = 0: a zero output row (bias aside) and zero gradients for its adapter entries,
on every backend, and it stays so under training and when merged."""

import warnings

import pytest
import torch

import dorafp8
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
