"""Models torchao quantized to fp8 (its Float8Tensor weights) as dorafp8 bases, through quantize_model and
convert_peft_model: the same e4m3 bytes and scales, the outputs of torchao's own dequantized weight, DoRA equal to
PEFT's on that dequantized base; 1 x g groups re-quantized to per row with the error measured; the errors.

torchao's weight-only config (Float8WeightOnlyConfig) runs on CPU; its dynamic-activation config refuses without a
GPU of compute capability >= 8.9, so its weights are made the way its transform makes them
(torchao/quantization/quant_api.py, _float8_dynamic_activation_float8_weight_quantize_tensor: Float8Tensor.from_hp
with the weight granularity and the activation kwargs)."""

import copy
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

torchao = pytest.importorskip("torchao")
peft = pytest.importorskip("peft")

from peft import LoraConfig, get_peft_model  # noqa: E402
from torchao.quantization import (Float8Tensor, Float8WeightOnlyConfig, PerBlock, PerGroup, PerRow,  # noqa: E402
                                  PerTensor, quantize_)
from torchao.quantization.quantize_.workflows.float8.float8_tensor import QuantizeTensorToFloat8Kwargs  # noqa: E402

import dorafp8  # noqa: E402
from dorafp8 import FP8Linear  # noqa: E402
from dorafp8.quant import QuantizationWarning  # noqa: E402
from tests._layers import n_fp8  # noqa: E402
from tests._tolerance import assert_close  # noqa: E402

E4M3 = torch.float8_e4m3fn


class Net(nn.Module):
    """Two linear layers; the first 256 wide so that 128 x 128 blocks and 1 x 64 groups fit, with an all-zero row."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(256, 128)
        self.b = nn.Linear(128, 40)
        with torch.no_grad():
            self.a.weight[:, :64] *= 8  # groups (and rows) of different magnitudes, so 1 x 64 scales differ
            self.a.weight[7] = 0
        self.to(dtype)

    def forward(self, x):
        return self.b(F.gelu(self.a(x)))


def _dynamic(granularity):
    """What Float8DynamicActivationFloat8WeightConfig(granularity=...) does to a weight (see the module docstring)."""
    def apply(model):
        for mod in (model.a, model.b):
            w = Float8Tensor.from_hp(mod.weight.detach(), granularity=granularity,
                                     act_quant_kwargs=QuantizeTensorToFloat8Kwargs(granularity=granularity))
            mod.weight = nn.Parameter(w, requires_grad=False)
    return apply


CONFIGS = {
    "weight-only per row": lambda m: quantize_(m, Float8WeightOnlyConfig()),
    "weight-only per tensor": lambda m: quantize_(m, Float8WeightOnlyConfig(granularity=PerTensor())),
    "dynamic per row": _dynamic(PerRow()),
    "dynamic 128x128 blocks": _dynamic(PerBlock([128, 128])),
}
X = torch.randn(6, 256, generator=torch.Generator().manual_seed(1))


def _torchao(name, dtype=torch.float32):
    net = Net(dtype)
    if name == "dynamic 128x128 blocks":  # torchao's blocks must divide the weight: b is 128 x 128 already
        net.b = nn.Linear(128, 128).to(dtype)
    CONFIGS[name](net)
    return net


def _dequantized_twin(tao: nn.Module) -> nn.Module:
    """The same model with plain nn.Linear layers holding torchao's own dequantize() of each weight, in fp32."""
    twin = copy.deepcopy(tao)
    for n in ("a", "b"):
        mod = getattr(twin, n)
        w = mod.weight.dequantize(torch.float32)
        lin = nn.Linear(mod.in_features, mod.out_features)
        with torch.no_grad():
            lin.weight.copy_(torch.nan_to_num(w, nan=0.0))  # torchao's all-zero row is NaN (see below)
            lin.bias.copy_(mod.bias.float())
        setattr(twin, n, lin)
    return twin


@pytest.mark.parametrize("name", list(CONFIGS))
def test_quantize_model_keeps_torchao_bytes_and_scales(name):
    tao = _torchao(name)
    want = {n: (getattr(tao, n).weight.qdata.clone(), getattr(tao, n).weight.scale.clone()) for n in ("a", "b")}
    twin = _dequantized_twin(tao)
    with warnings.catch_warnings():
        warnings.simplefilter("error", QuantizationWarning)  # nothing is re-quantized
        assert n_fp8(dorafp8.quantize_model(tao, backend="reference")) == 2
    for n, (q, s) in want.items():
        layer = getattr(tao, n)
        assert isinstance(layer, FP8Linear)
        zero = (s == 0).reshape(-1)
        if s.numel() == layer.out_features and zero.any():  # torchao's all-zero row: scale 0, NaN bytes
            assert torch.isnan(q[7].float()).all() and (layer.weight[7].float() == 0).all()
            assert layer.scale[7].item() == 1.0
            q, s = q[~zero], s[~zero]
            got_q, got_s = layer.weight[~zero], layer.scale[~zero]
        else:
            got_q, got_s = layer.weight, layer.scale
        assert torch.equal(got_q.view(torch.uint8), q.view(torch.uint8)), n
        assert torch.equal(got_s.reshape(-1), s.float().reshape(-1)), n
        ref = getattr(twin, n)
        assert torch.equal(layer.dequantize(), ref.weight.detach())
    with torch.no_grad():
        assert_close(tao(X), twin(X), 1e-6, name)


def test_dora_on_torchao_base_matches_peft_on_its_dequantized_base():
    """get_peft_model(use_dora=True) after quantize_model, trained a few SGD steps, against PEFT's own DoRA on the
    fp32 model holding torchao's dequantized weights, with the same adapter initialization."""
    tao = _torchao("weight-only per row")
    twin = _dequantized_twin(tao)
    dorafp8.quantize_model(tao, backend="reference")
    cfg = LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["a", "b"])
    torch.manual_seed(5)
    ours = get_peft_model(tao, copy.deepcopy(cfg))
    torch.manual_seed(5)
    ref = get_peft_model(twin, copy.deepcopy(cfg))
    assert isinstance(ours.base_model.model.a, dorafp8.DoRAFP8Linear)
    ref_sd = ref.state_dict()
    for k, v in ours.state_dict().items():
        if "lora_" in k:
            assert_close(v, ref_sd[k], 1e-6, k)
    with torch.no_grad():  # non-zero B, so the adapters take part
        for m in (ours, ref):
            g = torch.Generator().manual_seed(9)
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.copy_(0.05 * torch.randn(p.shape, generator=g))
    losses = []
    for m in (ours, ref):
        opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
        g = torch.Generator().manual_seed(3)
        out = []
        for _ in range(3):
            x, y = torch.randn(8, 256, generator=g), torch.randn(8, 40, generator=g)
            loss = (m(x) - y).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        losses.append(out)
    assert losses[0] == pytest.approx(losses[1], rel=1e-5), losses
    with torch.no_grad():
        assert_close(ours(X), ref(X), 1e-5, "after training")


def test_convert_peft_model_takes_peft_dora_on_torchao():
    """PEFT builds its own DoRA layer on torchao weights (TorchaoLoraLinear, dequantizing every call);
    convert_peft_model swaps it for the dorafp8 layer on the same bytes, adapters kept."""
    tao = _torchao("weight-only per row")
    twin = _dequantized_twin(tao)
    cfg = LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["a", "b"])
    torch.manual_seed(5)
    ref = get_peft_model(twin, copy.deepcopy(cfg))
    peft_on_tao = get_peft_model(tao, copy.deepcopy(cfg))
    assert type(peft_on_tao.base_model.model.a).__name__ == "TorchaoLoraLinear"
    adapters = {k: v for k, v in ref.state_dict().items() if "lora_" in k}
    with torch.no_grad():  # the same adapters (and magnitudes) as ref, B non-zero so that they take part
        for k in adapters:
            if "lora_B" in k:
                adapters[k] = 0.05 * torch.randn(adapters[k].shape, generator=torch.Generator().manual_seed(9))
        ref.load_state_dict(adapters, strict=False)
        peft_on_tao.load_state_dict(adapters, strict=False)
    q = tao.a.base_layer.weight.qdata.clone()
    assert dorafp8.convert_peft_model(peft_on_tao, backend="reference") == 2
    layer = peft_on_tao.base_model.model.a
    assert isinstance(layer, dorafp8.DoRAFP8Linear)
    rows = torch.arange(128) != 7
    assert torch.equal(layer.get_base_layer().weight[rows].view(torch.uint8), q[rows].view(torch.uint8))
    with torch.no_grad():
        assert_close(peft_on_tao(X), ref(X), 1e-5, "converted")


def test_groups_are_requantized_per_row_with_the_error_reported():
    """PerGroup(64) (1 x 64 scales): re-quantized to one scale per row, each value within half an e4m3 step of
    torchao's own dequantized weight, the groups holding the row's largest scale byte for byte, and the warning's
    error the fp64 error of what was loaded."""
    tao = Net()
    quantize_(tao.a, Float8WeightOnlyConfig(granularity=PerGroup(64)))
    w0 = torch.nan_to_num(tao.a.weight.dequantize(torch.float32).double(), nan=0.0)
    q, s = tao.a.weight.qdata.clone(), tao.a.weight.scale.clone()
    with pytest.warns(QuantizationWarning, match=r"1 x 64 block scales .* worst (\d+\.\d+)%") as rec:
        dorafp8.quantize_model(tao, ["a"], backend="reference")
    got = tao.a.dequantize().double()
    rel = ((got - w0).norm() / w0.norm()).item()
    msg = str(rec[0].message)
    assert f"worst {100 * rel:.2f}% ('a')" in msg, msg
    assert 0 < rel < 2 ** -4  # not exact, and within e4m3's half step (the 8x larger groups keep their bytes)
    s_row = tao.a.scale.double()
    step = torch.where(w0.abs() >= 2 ** -6 * s_row[:, None], w0.abs() * 2 ** -4, s_row[:, None] * 2 ** -10)
    assert bool(((got - w0).abs() <= step * (1 + 1e-9)).all())  # round to nearest, normal or subnormal
    top = s.argmax(dim=1)  # each row's largest group scale: ratio 1, bytes kept (row 7 is all zero: skipped)
    for r in range(128):
        if r != 7:
            c = int(top[r])
            assert torch.equal(tao.a.weight[r, 64 * c:64 * c + 64].view(torch.uint8),
                               q[r, 64 * c:64 * c + 64].view(torch.uint8)), r


@pytest.mark.parametrize("case, exc, match", [
    ("e5m2", TypeError, r"float8_e5m2; dorafp8 holds float8_e4m3fn"),
    ("8x64 blocks", ValueError, r"8 x 64 scale blocks .* dorafp8 takes per tensor \(PerTensor\(\)\), per row"),
    ("nan scale", ValueError, r"NaN, infinite or negative"),
])
def test_unsupported_torchao_weights_are_refused_before_any_layer_changes(case, exc, match):
    net = Net()
    if case == "e5m2":
        quantize_(net.b, Float8WeightOnlyConfig(weight_dtype=torch.float8_e5m2))
    elif case == "8x64 blocks":
        net.b.weight = nn.Parameter(Float8Tensor.from_hp(net.b.weight.detach(), granularity=PerBlock([8, 64])),
                                    requires_grad=False)
    else:
        quantize_(net.b, Float8WeightOnlyConfig())
        net.b.weight.scale[3] = float("nan")
    with pytest.raises(exc, match=match):
        dorafp8.quantize_model(net)
    assert type(net.a) is nn.Linear  # all or nothing: the float layer before it was not swapped either


def test_torchao_is_not_imported_for_a_model_without_its_tensors():
    code = ("import sys, torch, dorafp8\n"
            "m = torch.nn.Sequential(torch.nn.Linear(8, 8))\n"
            "dorafp8.quantize_model(m)\n"
            "print('torchao' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"
