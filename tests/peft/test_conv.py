"""FP8 convolutions and DoRA on them (dorafp8/fp8_conv.py, dorafp8/peft_conv.py): the functional op against a
float64 evaluation of PEFT 0.21's DoraConvNdLayer formulas, the PEFT layer against PEFT itself on the dequantized
base, quantize_model's guards for convs, memory (no dequantized weight kept for the backward), save/load."""

import copy
import itertools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dorafp8
from dorafp8 import FP8Conv1d, FP8Conv2d, FP8Conv3d
from dorafp8.ops.conv import conv_weight_norm, dequantize_transient
from dorafp8.quant import QuantizationWarning
from tests._layers import n_fp8
from tests._tolerance import assert_close, tol, within

peft = pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
NN_CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
FP8_CONV = {1: FP8Conv1d, 2: FP8Conv2d, 3: FP8Conv3d}


def _problem(nd=2, C_in=6, C_out=10, k=3, r=4, groups=1, scale="tensor", seed=0, batch=3, size=7):
    g = torch.Generator().manual_seed(seed)
    ks = (k,) * nd
    # output channels of different magnitudes, so that per-channel scales differ
    W = torch.randn(C_out, C_in // groups, *ks, generator=g) * 0.2 * torch.linspace(0.2, 2.0, C_out).reshape(
        -1, *([1] * (nd + 1)))
    w2, sc = dorafp8.quantize_e4m3(W.reshape(C_out, -1), per_row=scale == "row",
                                   block_size=4 if scale == "block" else None)
    w8 = w2.view(W.shape)
    A = torch.randn(r, C_in, *ks, generator=g) * 0.3
    B = torch.randn(C_out, r // groups, *([1] * nd), generator=g) * 0.3
    m = torch.rand(1, C_out, *([1] * nd), generator=g) + 0.5
    b = torch.randn(C_out, generator=g) * 0.1
    x = torch.randn(batch, C_in, *((size,) * nd), generator=g)
    return x, w8, sc, A, B, m, b


def _w0(w8, sc, block=4):
    C = w8.shape[0]
    return dorafp8.dequantize_e4m3(w8.reshape(C, -1), sc, torch.float64, block_size=block).view(w8.shape)


def _dora_conv_fp64(x, W0, A, B, m, s, bias, geom, lora_geom, groups, keep=None, p=0.0):
    """PEFT 0.21's DoRA conv (DoraConvNdLayer) in fp64 with autograd, n detached: the norm of W0 + s L with
    L = (B.view(-1, r) @ A.view(r, -1)).reshape(W0.shape), per output channel."""
    nd = W0.dim() - 2
    conv = CONV[nd]
    x64, A64, B64, m64 = (t.detach().double().requires_grad_() for t in (x, A, B, m))
    W = W0.double()
    r = A.shape[0]
    L = (B64.detach().reshape(-1, r) @ A64.detach().reshape(r, -1)).reshape(W.shape)
    n = (W + s * L).flatten(1).norm(dim=1)
    view = (1, -1) + (1,) * nd
    c = (m64.reshape(-1) / n).reshape(view)
    stride, padding, dilation = geom

    def base(t):
        return conv(t, W, None, stride, padding, dilation, groups)

    def lora(t):
        return conv(conv(t, A64, None, *lora_geom), B64, None, 1, 0, 1, groups)

    b = 0.0 if bias is None else bias.double().reshape(view)
    if keep is None:
        y = c * (base(x64) + s * lora(x64)) + b
    else:
        xd = x64 * keep.double() / (1 - p)
        y = base(x64) + b + (c - 1) * base(xd) + c * s * lora(xd)
    return y, (x64, A64, B64, m64)


# ------------------------------------------------------------------------------------------------- functional op

CASES = [  # nd, groups, stride, padding, dilation, kernel, scale
    (2, 1, 1, 1, 1, 3, "tensor"),
    (2, 1, 2, 1, 1, 3, "row"),
    (2, 1, 1, 0, 1, 1, "block"),
    (2, 2, 1, 2, 2, 3, "row"),
    (1, 1, 2, 2, 1, 5, "tensor"),
    (3, 1, 1, 1, 1, 3, "row"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("dropout", [False, True])
def test_dora_fp8_conv_matches_fp64(case, dropout):
    nd, groups, stride, padding, dilation, k, scale = case
    x, w8, sc, A, B, m, b = _problem(nd=nd, groups=groups, k=k, scale=scale, size=9 if nd < 3 else 5)
    s, p = 0.75, 0.3
    xl, Al, Bl, ml = (t.clone().requires_grad_() for t in (x, A, B, m))
    geom = ((stride,) * nd, (padding,) * nd, (dilation,) * nd)
    torch.manual_seed(11)
    y = dorafp8.dora_fp8_conv(xl, w8, sc, Al, Bl, ml, s, b, stride, padding, dilation, groups, block_size=4,
                              dropout_p=p if dropout else 0.0, training=dropout)
    keep = None
    if dropout:
        torch.manual_seed(11)
        keep = torch.empty_like(x).bernoulli_(1 - p) != 0  # the mask the call drew (PEFT's recipe)
        assert 0 < keep.sum() < keep.numel()
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
    y.backward(gy)
    yr, leaves = _dora_conv_fp64(x, _w0(w8, sc), A, B, m, s, b, geom, geom, groups, keep, p)
    yr.backward(gy.double())
    rel = tol(torch.float32)
    assert_close(y, yr, rel, "y")
    for name, got, ref in zip(("dx", "dA", "dB", "dm"), (xl.grad, Al.grad, Bl.grad, ml.grad), leaves):
        assert got.shape == ref.shape and got.dtype == torch.float32
        assert_close(got, ref.grad, rel, name)


_DT = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("x_dtype,ad_dtype,autocast", [
    (torch.float32, torch.float32, torch.bfloat16), (torch.float32, torch.float32, torch.float16),
    (torch.bfloat16, torch.float32, None), (torch.float16, torch.float16, None), (torch.float32, torch.bfloat16, None),
    (torch.bfloat16, torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("dropout", [False, True])
def test_dtypes(x_dtype, ad_dtype, autocast, dropout):
    """Output in the compute dtype, gradients in their parameters' dtypes, all within the lowest precision's tolerance
    of fp64 (evaluated on the inputs as rounded to their dtypes)."""
    x, w8, sc, A, B, m, b = _problem(scale="row")
    s, p = 0.5, 0.25
    xl = x.to(x_dtype).requires_grad_()
    Al, Bl, ml = (t.to(ad_dtype).requires_grad_() for t in (A, B, m))
    bl = b.to(ad_dtype)
    torch.manual_seed(3)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        y = dorafp8.dora_fp8_conv(xl, w8, sc, Al, Bl, ml, s, bl, 1, 1, dropout_p=p if dropout else 0.0,
                                  training=dropout)
    cdt = autocast or x_dtype
    assert y.dtype == cdt
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(4))
    y.backward(gy.to(cdt))
    for t in (xl, Al, Bl, ml):
        assert t.grad is not None and t.grad.dtype == t.dtype
    keep = None
    if dropout:
        torch.manual_seed(3)
        keep = torch.empty(x.shape, dtype=cdt).bernoulli_(1 - p) != 0
    geom = ((1, 1), (1, 1), (1, 1))
    yr, leaves = _dora_conv_fp64(xl, _w0(w8, sc), Al, Bl, ml, s, bl, geom, geom, 1, keep, p)
    yr.backward(gy.to(cdt).double())
    rel = tol(max((x_dtype, ad_dtype, cdt), key=tol))
    assert_close(y, yr, rel, "y")
    for name, got, ref in zip(("dx", "dA", "dB", "dm"), (xl.grad, Al.grad, Bl.grad, ml.grad), leaves):
        assert_close(got, ref.grad, 2 * rel, name)


@pytest.mark.parametrize("groups,scale", [(1, "tensor"), (1, "row"), (1, "block"), (2, "row"), (3, "tensor")])
def test_weight_norm_is_peft_formula(groups, scale):
    """PEFT's norm of W0 + s (B.view(-1, r) @ A.view(r, -1)).reshape(W0.shape), grouped convs included."""
    r = 6
    x, w8, sc, A, B, m, b = _problem(C_in=6, C_out=12, r=r, groups=groups, scale=scale)
    n = conv_weight_norm(w8, sc, A, B, 1.5, groups, block_size=4)
    W0 = _w0(w8, sc)
    ref = (W0 + 1.5 * (B.double().reshape(-1, r) @ A.double().reshape(r, -1)).reshape(W0.shape)).flatten(1).norm(dim=1)
    assert n.dtype == torch.float32 and n.shape == (12,)
    assert_close(n, ref, tol(torch.float32), "n")


def test_fp8_conv_plain_and_transient():
    x, w8, sc, *_ = _problem(scale="row")
    b = torch.randn(10)
    xl = x.clone().requires_grad_()
    y = dorafp8.fp8_conv(xl, w8, sc, b, 2, 1)
    x64 = x.double().requires_grad_()
    yr = F.conv2d(x64, _w0(w8, sc), b.double(), 2, 1)
    assert_close(y, yr, tol(torch.float32), "y")
    gy = torch.randn(y.shape)
    y.backward(gy)
    yr.backward(gy.double())
    assert_close(xl.grad, x64.grad, tol(torch.float32), "dx")
    for dtype in _DT:  # the transient: W0 rounded once into the compute dtype
        assert torch.equal(dequantize_transient(w8, sc, 128, dtype), _w0(w8, sc).float().to(dtype))


# --------------------------------------------------------------------------------------------- the PEFT layer


class Net(nn.Module):
    def __init__(self, padding_mode="zeros", groups=1):
        super().__init__()
        self.conv1 = nn.Conv2d(4, 8, 3, padding=1, padding_mode=padding_mode)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False, groups=groups)
        self.proj = nn.Conv2d(8, 6, 1)
        self.head = nn.Linear(6, 5)

    def forward(self, x):
        h = self.proj(F.silu(self.conv2(F.silu(self.conv1(x)))))
        return self.head(h.mean((2, 3)))


TARGETS = ["conv1", "conv2", "proj", "head"]


def _randomize(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if "lora_A" in name or "lora_B" in name:
            p.data = torch.randn(p.shape, generator=g).to(p.dtype) * 0.3
        elif "lora_magnitude_vector" in name:
            p.data = p.data * (1 + 0.2 * torch.randn(p.shape, generator=g)).to(p.dtype)


def _pair(net_kw=None, per_row=False, **cfg):
    """(plain PEFT on the dequantized fp8 base, dorafp8 on the fp8 base built by get_peft_model), same adapter
    values; DoRA unless cfg says use_dora=False."""
    torch.manual_seed(0)
    base = Net(**(net_kw or {}))
    ours = copy.deepcopy(base)
    assert n_fp8(dorafp8.quantize_model(ours, TARGETS, per_row_scale=per_row)) == 4
    twin = copy.deepcopy(base)
    for name in TARGETS:
        getattr(twin, name).weight.data = getattr(ours, name).dequantize()
    cfg = dict(dict(r=4, lora_alpha=8, use_dora=True, target_modules=TARGETS), **cfg)
    pm_peft = get_peft_model(twin, LoraConfig(**cfg))
    pm_ours = get_peft_model(ours, LoraConfig(**cfg))
    assert type(pm_ours.base_model.model.conv1).__name__ == "DoRAFP8Conv2d"
    # magnitude init from the fp8 weight = PEFT's init from the dequantized weight
    for name in ("conv1", "conv2", "proj") if cfg["use_dora"] else ():
        a = getattr(pm_peft.base_model.model, name).lora_magnitude_vector["default"].weight
        b = getattr(pm_ours.base_model.model, name).lora_magnitude_vector["default"].weight
        assert a.shape == b.shape == (1, a.shape[1], 1, 1)
        assert_close(b, a, 5e-7, f"{name} magnitude init")
    _randomize(pm_peft)
    pm_ours.load_state_dict({k: v for k, v in pm_peft.state_dict().items() if "lora_" in k}, strict=False)
    return pm_peft, pm_ours


def _run(model, x, seed=5):
    torch.manual_seed(seed)
    xl = x.clone().requires_grad_()
    y = model(xl)
    y.square().sum().backward()
    return y, xl.grad, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


X = torch.randn(3, 4, 10, 10, generator=torch.Generator().manual_seed(9))


@pytest.mark.parametrize("cfg,net_kw,per_row", [
    ({}, None, False),
    ({"lora_dropout": 0.2, "use_rslora": True}, None, True),
    ({}, {"padding_mode": "reflect"}, False),  # general (unfused) path for conv1
    ({"r": 4}, {"groups": 2}, False),  # grouped conv: PEFT's norm reshape
    ({"use_dora": False}, None, False),  # plain LoRA on the same fp8 layers
    ({"use_dora": False, "lora_dropout": 0.2}, {"groups": 2}, True),
])
@pytest.mark.parametrize("train", [False, True])
def test_parity_with_peft(cfg, net_kw, per_row, train):
    pm_peft, pm_ours = _pair(net_kw, per_row, **cfg)
    for mdl in (pm_peft, pm_ours):
        mdl.train(train)
    ya, dxa, ga = _run(pm_peft, X)
    yb, dxb, gb = _run(pm_ours, X)
    rel = tol(torch.float32)
    assert_close(yb, ya, rel, "y")
    assert_close(dxb, dxa, rel, "dx")
    assert ga.keys() == gb.keys() and len(ga) == (12 if cfg.get("use_dora", True) else 8)
    for k in ga:
        assert_close(gb[k], ga[k], 5 * rel, k)


def test_parity_with_peft_under_bf16_autocast():
    """Under bf16 autocast, against the same model in fp32 (the gradients autocast approximates; PEFT's own autocast
    gradients are further from them on the magnitude of a layer whose row sums cancel: 2.1x tol(bf16) where ours are at
    0.5x, so the two are not compared with each other)."""
    pm_peft, pm_ours = _pair()
    y32, _, g32 = _run(pm_peft, X)
    g32 = {k: g.clone() for k, g in g32.items()}
    pm_peft.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ya, _, ga = _run(pm_peft, X)
        yb, _, gb = _run(pm_ours, X)
    assert_close(yb.float(), ya.float(), tol(torch.bfloat16), "y")
    for k in ga:
        assert gb[k].dtype == ga[k].dtype == torch.float32
        # bf16 rounding in the forward and in the backward's products: 2 * tol (tests/_tolerance.py)
        assert_close(gb[k], g32[k], 2 * tol(torch.bfloat16), k)


def test_state_dict_keys_save_and_load_in_plain_peft(tmp_path):
    """The adapter files are PEFT's: they load with plain PEFT onto the dequantized base (same outputs) and onto the
    original-precision base (outputs within the fp8 error)."""
    pm_peft, pm_ours = _pair()
    keys = lambda m: {k: tuple(v.shape) for k, v in m.state_dict().items() if "lora_" in k}  # noqa: E731
    assert keys(pm_ours) == keys(pm_peft)
    pm_ours.save_pretrained(tmp_path / "a")
    pm_ours.eval()
    with torch.no_grad():
        ref = pm_ours(X)
    torch.manual_seed(0)
    original = Net()
    dequant = copy.deepcopy(original)
    fp8 = {n.replace("base_model.model.", "").replace(".base_layer", ""): mod for n, mod in pm_ours.named_modules()
           if isinstance(mod, (FP8Conv2d, dorafp8.FP8Linear))}
    for name, mod in dequant.named_modules():
        if name in fp8:
            mod.weight.data = fp8[name].dequantize()
    with torch.no_grad():
        out_dq = PeftModel.from_pretrained(dequant, tmp_path / "a").eval()(X)
        out_orig = PeftModel.from_pretrained(original, tmp_path / "a").eval()(X)
    within(((out_dq - ref).norm() / ref.norm()).item(), tol(torch.float32), "conv adapter onto the dequantized base")
    assert 1e-4 < ((out_orig - ref).norm() / ref.norm()).item() < 0.1


def test_disable_set_and_two_adapters():
    pm_peft, pm_ours = _pair()
    x = X[:1]
    with torch.no_grad():
        for mdl in (pm_peft, pm_ours):
            mdl.eval()
        with pm_peft.disable_adapter(), pm_ours.disable_adapter():
            assert_close(pm_ours(x), pm_peft(x), tol(torch.float32), "disabled")
        for mdl in (pm_peft, pm_ours):
            mdl.add_adapter("two", LoraConfig(r=2, lora_alpha=4, use_dora=True, target_modules=TARGETS))
            _randomize(mdl, seed=2) if mdl is pm_peft else None
        pm_ours.load_state_dict({k: v for k, v in pm_peft.state_dict().items() if "lora_" in k}, strict=False)
        for mdl in (pm_peft, pm_ours):
            mdl.base_model.set_adapter(["default", "two"])  # two active adapters: the general (unfused) path
        assert_close(pm_ours(x), pm_peft(x), tol(torch.float32), "two adapters")
        for mdl in (pm_peft, pm_ours):
            mdl.set_adapter("two")
        assert_close(pm_ours(x), pm_peft(x), tol(torch.float32), "adapter two")


def test_convert_peft_model_and_merge():
    torch.manual_seed(0)
    pm = get_peft_model(Net(), LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=TARGETS))
    _randomize(pm)
    ours = copy.deepcopy(pm)
    assert dorafp8.convert_peft_model(ours) == 4
    kinds = {n.split(".")[-1]: type(m).__name__ for n, m in ours.named_modules() if n.endswith(tuple(TARGETS))}
    assert kinds == {"conv1": "DoRAFP8Conv2d", "conv2": "DoRAFP8Conv2d", "proj": "DoRAFP8Conv2d",
                     "head": "DoRAFP8Linear"}
    pm.eval(), ours.eval()
    with torch.no_grad():
        rel = ((ours(X) - pm(X)).norm() / pm(X).norm()).item()
    assert 1e-4 < rel < 0.1  # the fp8 rounding of the bases, nothing more
    with torch.no_grad():
        before = ours(X)
    with pytest.warns(UserWarning, match="re-quantizes the merged weight"):
        merged = ours.merge_and_unload()  # convs too (tests/integration/test_all_or_nothing.py checks the merge against fp64)
    with torch.no_grad():
        assert ((merged(X) - before).norm() / before.norm()).item() < 0.05


def test_conv1d_and_conv3d_layers_match_peft():
    for nd in (1, 3):
        torch.manual_seed(0)
        base = nn.Sequential(NN_CONV[nd](3, 5, 3, padding=1))
        ours = copy.deepcopy(base)
        dorafp8.quantize_model(ours, ["0"])
        assert isinstance(ours[0], FP8_CONV[nd])
        base[0].weight.data = ours[0].dequantize()
        cfg = LoraConfig(r=2, lora_alpha=4, use_dora=True, target_modules=["0"])
        pa, pb = get_peft_model(base, cfg), get_peft_model(ours, copy.deepcopy(cfg))
        _randomize(pa)
        pb.load_state_dict({k: v for k, v in pa.state_dict().items() if "lora_" in k}, strict=False)
        x = torch.randn(2, 3, *((6,) * nd))
        ya, _, ga = _run(pa, x)
        yb, _, gb = _run(pb, x)
        assert_close(yb, ya, tol(torch.float32), f"y conv{nd}d")
        for k in ga:
            assert_close(gb[k], ga[k], 5 * tol(torch.float32), k)


def test_weight_norm_cache_follows_the_optimizer():
    _, pm = _pair()
    layer = pm.base_model.model.conv1
    n1 = layer.dora_weight_norm("default")
    assert layer.dora_weight_norm("default") is n1  # cached
    opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.1)
    _run(pm, X)
    opt.step()
    n2 = layer.dora_weight_norm("default")
    assert n2 is not n1 and not torch.equal(n1, n2)
    assert torch.equal(n2, layer.dora_weight_norm("default", use_cache=False))


# ----------------------------------------------------------------------------------------- memory and the module


def test_backward_keeps_no_dequantized_weight():
    """Between forward and backward autograd holds the fp8 weight, the activations and rank-r tensors, never a
    float copy of the weight (it is re-dequantized in the backward)."""
    x, w8, sc, A, B, m, b = _problem(C_in=32, C_out=64, k=3)
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    xl, Al, Bl, ml = (t.clone().requires_grad_() for t in (x, A, B, m))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for p in (0.0, 0.2):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = dorafp8.dora_fp8_conv(xl, w8, sc, Al, Bl, ml, 1.0, b, 1, 1, dropout_p=p, training=True)
                y2 = dorafp8.fp8_conv(xl, w8, sc, b, 1, 1)
    wshape = tuple(w8.shape)
    assert (wshape, torch.float8_e4m3fn) in saved
    assert not [s for s in saved if s[0] == wshape and s[1] != torch.float8_e4m3fn], saved
    (y.float().sum() + y2.float().sum()).backward()


def test_peak_memory_has_no_fp32_copy_of_the_weight(monkeypatch):
    """Under bf16 autocast the largest allocation is the bf16 transient; fp32 temporaries are row blocks (made
    small here, 256 KiB, so that a 2.4 MB weight spans several)."""
    import dorafp8.quant
    from dorafp8._memory import PeakTemporaries

    monkeypatch.setattr(dorafp8.quant, "_BLOCK_BYTES", 256 * 1024)
    C = 256
    w = nn.Conv2d(C, C, 3, padding=1, bias=False)
    fp8 = FP8Conv2d.from_float(w)
    w_fp32 = C * C * 9 * 4
    A = (torch.randn(4, C, 3, 3) * 0.05).requires_grad_()
    B = (torch.randn(C, 4, 1, 1) * 0.05).requires_grad_()
    m = torch.ones(1, C, 1, 1, requires_grad=True)
    x = torch.randn(1, C, 4, 4, requires_grad=True)
    with PeakTemporaries() as mode:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = dorafp8.dora_fp8_conv(x, fp8.weight, fp8.scale, A, B, m, 1.0, None, 1, 1)
        y.float().sum().backward()
    assert mode.largest <= w_fp32 // 2, mode.largest  # the bf16 transient
    assert mode.peak < w_fp32, mode.peak


def test_module_casts_state_dict_and_repr():
    conv = nn.Conv2d(4, 6, 3, stride=2, padding=1, dilation=1, groups=2, padding_mode="circular")
    f = FP8Conv2d.from_float(conv, per_row_scale=True)
    assert f.scale.shape == (6,) and f.weight.dtype == torch.float8_e4m3fn and f.weight.shape == conv.weight.shape
    assert (f.stride, f.padding, f.groups, f.padding_mode) == ((2, 2), (1, 1), 2, "circular")
    x = torch.randn(2, 4, 9, 9)
    ref = F.conv2d(F.pad(x.double(), (1, 1, 1, 1), mode="circular"), f.dequantize(torch.float64),
                   conv.bias.double(), 2, 0, 1, 2)
    assert_close(f(x), ref, tol(torch.float32), "circular")
    f.to(torch.bfloat16)
    assert f.weight.dtype == torch.float8_e4m3fn and f.scale.dtype == torch.float32
    sd = f.state_dict()
    sd["scale"] = sd["scale"].reshape(6, 1, 1, 1)  # a per-channel scale stored with the weight's rank
    g = FP8Conv2d(4, 6, 3, 2, 1, groups=2, padding_mode="circular")
    g.load_state_dict(sd)
    assert torch.equal(g.scale, f.scale) and torch.equal(g.weight.view(torch.uint8), f.weight.view(torch.uint8))
    with pytest.raises(RuntimeError, match="expects a float8_e4m3fn weight"):
        g.load_state_dict(conv.state_dict(), strict=False)
    assert "weight=float8_e4m3fn, scale=per-channel" in repr(f) and "groups=2" in repr(f)
    assert isinstance(f.to_float(), nn.Conv2d) and torch.equal(f.to_float().weight, f.dequantize())
    same = FP8Conv2d.from_float(nn.Conv2d(3, 3, 3, padding="same"))
    assert same(torch.randn(1, 3, 5, 5)).shape == (1, 3, 5, 5)


# ---------------------------------------------------------------------------------------- quantize_model guards


def test_quantize_model_convs():
    torch.manual_seed(0)
    net = Net()
    assert n_fp8(dorafp8.quantize_model(copy.deepcopy(net))) == 1  # default: linear layers only, as before
    assert n_fp8(dorafp8.quantize_model(copy.deepcopy(net), include_conv=True)) == 4
    m = copy.deepcopy(net)
    assert n_fp8(dorafp8.quantize_model(m, ["conv1", "conv2"])) == 2  # explicit targets name convs: no flag needed
    assert isinstance(m.conv1, FP8Conv2d) and isinstance(m.proj, nn.Conv2d) and isinstance(m.head, nn.Linear)
    with pytest.raises(ValueError, match=r"matched no nn.Linear.*'conv1', 'conv2'"):
        dorafp8.quantize_model(copy.deepcopy(net), ["conv9"])
    pm = get_peft_model(copy.deepcopy(net), LoraConfig(r=2, use_dora=True, target_modules=["conv1"]))
    with pytest.warns(UserWarning, match="convert_peft_model"):
        dorafp8.quantize_model(pm, include_conv=True)
    assert n_fp8(pm) == 4 - 1  # conv1's base and its lora_A/lora_B convs are left alone
    assert isinstance(pm.base_model.model.conv1.base_layer, nn.Conv2d)
    assert isinstance(pm.base_model.model.conv1.lora_A["default"], nn.Conv2d)
    with pytest.raises(ValueError, match="matched only PEFT adapter layers"):
        dorafp8.quantize_model(pm, ["conv1"])


def test_quantize_model_conv_warnings_errors_and_fp8_weights():
    net = Net()
    with torch.no_grad():
        net.conv2.weight.normal_(0, 0.02)
        net.conv2.weight[3, 1, 1, 1] = 1e4
    with pytest.warns(QuantizationWarning, match=r"weight of 'conv2'.*per_row_scale=True"):
        dorafp8.quantize_model(copy.deepcopy(net), ["conv2"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", QuantizationWarning)
        dorafp8.quantize_model(copy.deepcopy(net), ["conv2"], per_row_scale=True)
    bad = Net()
    bad.conv1.weight.data[2, 0, 1, 1] = float("inf")
    with pytest.raises(ValueError, match=r"weight of 'conv1' has non-finite values \(first in row 2\)"):
        dorafp8.quantize_model(bad, include_conv=True)
    # already fp8 (a OneTrainer-style model): kept byte for byte with scale 1
    fp8 = Net()
    w8 = (torch.randn(fp8.conv1.weight.shape) * 30).to(torch.float8_e4m3fn)
    fp8.conv1.weight.data = w8.clone()
    assert n_fp8(dorafp8.quantize_model(fp8, ["conv1"])) == 1
    assert fp8.conv1.scale.item() == 1.0 and fp8.conv1.bias.dtype == torch.float32
    assert torch.equal(fp8.conv1.weight.view(torch.uint8), w8.view(torch.uint8))
    blk = dorafp8.quantize_model(copy.deepcopy(Net()), ["conv2"], block_size=8)
    assert n_fp8(blk) == 1


def test_onetrainer_style_fp8_conv_with_dora():
    """The issue's failure: PEFT's DoRA init fails on conv weights that are already fp8. get_peft_model now builds
    dorafp8 layers on them directly (the same bytes, scale 1), the same layers quantize_model (lossless) then
    get_peft_model builds; both train. tests/nn/test_fp8_layers.py checks them against PEFT on the dequantized
    weights."""
    torch.manual_seed(0)
    net = Net()
    for name in ("conv1", "conv2"):
        getattr(net, name).weight.data = getattr(net, name).weight.data.to(torch.float8_e4m3fn)
    cfg = LoraConfig(r=2, use_dora=True, target_modules=["conv1", "conv2"])
    quantized = copy.deepcopy(net)
    dorafp8.quantize_model(quantized, ["conv1", "conv2"])
    outs = []
    for model in (net, quantized):
        torch.manual_seed(1)
        pm = get_peft_model(model, copy.deepcopy(cfg))
        assert {type(pm.base_model.model.get_submodule(n)).__name__ for n in ("conv1", "conv2")} == {"DoRAFP8Conv2d"}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = pm(X)
        out.float().square().mean().backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in pm.parameters() if p.requires_grad)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
