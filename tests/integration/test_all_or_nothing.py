"""Model operations are all or nothing: an operation that fails leaves the model exactly as it was (same module types,
same bytes, same output), because every check runs before the first change. A failure is injected in the last
layer the operation would reach, where a layer-by-layer implementation would already have changed the others.

Also the merge of DoRA into fp8 convs (groups=1), which used to be the failure: it merges in the conv's
[C_out, C_in * kernel] view, where PEFT's conv B A is B2 @ A2, and is checked against fp64."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dorafp8
from dorafp8.nn import FP8Conv2d, FP8Linear

peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402


class Net(nn.Module):
    """Linear and conv layers, as a UNet block has them; `groups` for the last conv."""

    def __init__(self, groups=1):
        super().__init__()
        self.conv1 = nn.Conv2d(4, 8, 3, padding=1)
        self.lin1 = nn.Linear(8, 8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, groups=groups)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        h = F.silu(self.conv1(x))
        h = self.lin1(h.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        h = F.silu(self.conv2(h))
        return self.head(h.mean((2, 3)))


X = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(3))


def _dora_model(groups=1, seed=0):
    torch.manual_seed(seed)
    net = Net(groups)
    dorafp8.quantize_model(net, include_conv=True)
    pm = get_peft_model(net, LoraConfig(r=4, lora_alpha=8, use_dora=True,
                                        target_modules=["conv1", "lin1", "conv2", "head"]))
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in sorted(pm.named_parameters()):
        if "lora_A" in name or "lora_B" in name:
            p.data = torch.randn(p.shape, generator=g) * 0.3
        elif "lora_magnitude_vector" in name:
            p.data = p.data * (1 + 0.2 * torch.randn(p.shape, generator=g))
    return pm.eval()


def _snapshot(model):
    """Every module's type and every tensor's bytes, by name."""
    types = {n: type(m) for n, m in model.named_modules()}
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return types, tensors


def _assert_unchanged(model, snap, out_before):
    types, tensors = snap
    assert {n: type(m) for n, m in model.named_modules()} == types
    now = model.state_dict()
    assert now.keys() == tensors.keys()
    for k, v in tensors.items():
        assert now[k].dtype == v.dtype and torch.equal(now[k].reshape(-1).view(torch.uint8),
                                                       v.reshape(-1).view(torch.uint8)), k
    with torch.no_grad():  # bit for bit, NaNs where they were (a NaN adapter gives NaN outputs before and after)
        torch.testing.assert_close(model(X), out_before, rtol=0, atol=0, equal_nan=True)


def test_conv_merge_matches_fp64_and_unmerges_exactly():
    pm = _dora_model()
    layer = pm.base_model.model.conv1
    base = layer.get_base_layer()
    w8_before, scale_before = base.weight.detach().clone(), base.scale.clone()
    A = layer.lora_A["default"].weight.double().reshape(4, -1)
    B = layer.lora_B["default"].weight.double().reshape(8, -1)
    m = layer.lora_magnitude_vector["default"].weight.double().reshape(-1)
    W0 = base.dequantize(torch.float64).reshape(8, -1)
    V = W0 + layer.scaling["default"] * B @ A
    want = (m / V.norm(dim=1))[:, None] * V
    with pytest.warns(UserWarning, match="re-quantizes the merged weight"):
        layer.merge()
    got = base.dequantize(torch.float64).reshape(8, -1)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel == pytest.approx(layer.last_merge_error, rel=1e-3, abs=1e-9)
    assert 0 < rel < 0.04  # e4m3 with one scale per row: about 2.6% on such weights, under 2^-4 always
    layer.unmerge()
    assert torch.equal(base.weight.view(torch.uint8), w8_before.view(torch.uint8))
    assert torch.equal(base.scale, scale_before)


def test_merge_and_unload_of_fp8_linear_and_conv_layers():
    pm = _dora_model()
    with torch.no_grad():
        before = pm(X)
    with pytest.warns(UserWarning, match="re-quantizes the merged weight"):
        merged = pm.merge_and_unload()
    assert not any(isinstance(m, peft.tuners.tuners_utils.BaseTunerLayer) for m in merged.modules())
    assert sum(isinstance(m, (FP8Linear, FP8Conv2d)) for m in merged.modules()) == 4
    with torch.no_grad():
        after = merged(X)
    assert ((after - before).norm() / before.norm()).item() < 0.05  # the merged weights' e4m3 rounding


@pytest.mark.parametrize("fault", ["nan_adapter", "grouped_conv", "lora_bias_without_bias"])
@pytest.mark.parametrize("op", ["merge_and_unload", "merge_adapter"])
def test_failed_merge_leaves_the_model_as_it_was(fault, op):
    pm = _dora_model(groups=2 if fault == "grouped_conv" else 1)
    last = pm.base_model.model.head  # the last layer PEFT reaches
    if fault == "nan_adapter":
        with torch.no_grad():
            last.lora_B["default"].weight[1, 2] = float("nan")
    elif fault == "lora_bias_without_bias":
        last.get_base_layer().bias = None
        last.lora_bias["default"] = True
        last.lora_B["default"].bias = nn.Parameter(torch.zeros(5))
    with torch.no_grad():
        out = pm(X)
    snap = _snapshot(pm)
    with pytest.raises(ValueError, match="nothing was merged") as e:
        getattr(pm, op)()
    assert {"nan_adapter": "non-finite", "grouped_conv": "groups", "lora_bias_without_bias": "LoRA bias"}[fault] \
        in str(e.value)
    _assert_unchanged(pm, snap, out)


@pytest.mark.parametrize("fault", ["nan_weight", "e5m2_weight"])
def test_failed_quantize_model_leaves_the_model_as_it_was(fault):
    torch.manual_seed(0)
    net = Net().eval()
    with torch.no_grad():
        if fault == "nan_weight":
            net.head.weight[3, 1] = float("nan")  # the last layer quantize_model reaches
        else:
            net.head.weight = nn.Parameter(net.head.weight.to(torch.float8_e5m2), requires_grad=False)
    with torch.no_grad():
        out = net(X) if fault == "nan_weight" else None
    snap = _snapshot(net)
    err = (ValueError, "non-finite values .* row 3") if fault == "nan_weight" else (TypeError, "float8_e5m2")
    with pytest.raises(err[0], match=err[1]):
        dorafp8.quantize_model(net, include_conv=True)
    if out is not None:
        _assert_unchanged(net, snap, out)
    else:
        assert {n: type(m) for n, m in net.named_modules()} == snap[0]


def test_quantize_model_says_when_it_changes_nothing_or_names_a_backend_that_cannot_run():
    net = Net()
    dorafp8.quantize_model(net)
    layers = list(net.modules())
    with pytest.warns(UserWarning, match="changed nothing: the 2 layers it would quantize are already fp8"):
        dorafp8.quantize_model(net, per_row_scale=True)
    assert list(net.modules()) == layers
    with pytest.warns(UserWarning, match="backend='cuda' cannot run on cpu"):
        dorafp8.quantize_model(Net(), backend="cuda")


def test_failed_convert_peft_model_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    pm = get_peft_model(Net(), LoraConfig(r=4, lora_alpha=8, use_dora=True,
                                          target_modules=["conv1", "lin1", "conv2", "head"])).eval()
    with torch.no_grad():
        pm.base_model.model.head.base_layer.weight[2, 0] = float("inf")  # converted after lin1
        out = pm(X)
    snap = _snapshot(pm)
    with pytest.raises(ValueError, match="head.*non-finite values"):
        dorafp8.convert_peft_model(pm)
    _assert_unchanged(pm, snap, out)


def test_failed_set_act_quant_leaves_the_model_as_it_was(monkeypatch):
    """A mode it does not know is refused before any layer is set; a failure injected in the third of four layers
    puts the two set before it back."""
    net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    dorafp8.quantize_model(net)
    modes = [None, "rowwise", None, "rowwise"]
    for lay, mode in zip(net, modes):
        lay.act_quant = mode
    with pytest.raises(ValueError, match="act_quant must be None or 'rowwise', got 'fp4'"):
        dorafp8.set_act_quant(net, "fp4")
    assert [lay.act_quant for lay in net] == modes
    real = FP8Linear.act_quant
    calls = []

    def set_mode(self, mode):
        calls.append(mode)
        if len(calls) == 3:
            raise RuntimeError("injected")
        real.fset(self, mode)

    monkeypatch.setattr(FP8Linear, "act_quant", property(real.fget, set_mode))
    snap = _snapshot(net)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = net(x)
    with pytest.raises(RuntimeError, match="injected"):
        dorafp8.set_act_quant(net, "rowwise")
    assert calls[:3] == ["rowwise"] * 3  # the third layer failed
    monkeypatch.undo()
    assert [lay.act_quant for lay in net] == modes
    types, tensors = snap
    assert {n: type(m) for n, m in net.named_modules()} == types
    assert all(torch.equal(net.state_dict()[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
               for k, v in tensors.items())
    with torch.no_grad():
        torch.testing.assert_close(net(x), out, rtol=0, atol=0)
    assert dorafp8.set_act_quant(net, "rowwise") == 4 and all(lay.act_quant == "rowwise" for lay in net)


def _tree(path):
    """{relative file name: bytes} under path."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("writer", ["save_fp8_checkpoint", "export_merged"])
def test_failed_write_leaves_the_destination_as_it_was(tmp_path, monkeypatch, writer):
    """export_merged fails on a broken adapter in the last layer; save_fp8_checkpoint fails after every shard is
    written, in its config step (injected). Either way the earlier checkpoint in the destination is untouched, a new
    destination is not created, and no staging directory is left."""
    pytest.importorskip("safetensors")
    from dorafp8.checkpoint import write

    pm = _dora_model()
    dest = tmp_path / "ckpt"
    dorafp8.save_fp8_checkpoint(pm.base_model.model, dest, format="dorafp8", max_shard_size=200, verbose=False)
    before = _tree(dest)
    assert len([n for n in before if n.endswith(".safetensors")]) > 1  # several shards: the write is many files
    if writer == "export_merged":
        with torch.no_grad():
            pm.base_model.model.head.lora_B["default"].weight[0, 0] = float("nan")  # the last layer written
        boom = "non-finite"
    else:
        def fail(*args, **kwargs):
            raise OSError("disk full (injected)")

        monkeypatch.setattr(write, "write_config", fail)
        boom = "injected"
    model = pm if writer == "export_merged" else pm.base_model.model
    for where in (dest, tmp_path / "fresh"):
        with pytest.raises((ValueError, OSError), match=boom):
            getattr(dorafp8, writer)(model, where, format="dorafp8", max_shard_size=300, verbose=False)
    assert _tree(dest) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no fresh/, no staging directory left


def test_a_new_checkpoint_replaces_the_old_shards_and_index(tmp_path):
    pytest.importorskip("safetensors")
    net = Net()
    dorafp8.quantize_model(net, include_conv=True)
    dest = tmp_path / "ckpt"
    (dest).mkdir()
    (dest / "README.md").write_text("mine")
    dorafp8.save_fp8_checkpoint(net, dest, format="dorafp8", max_shard_size=200, verbose=False)
    assert any(n.endswith("index.json") for n in _tree(dest))
    dorafp8.save_fp8_checkpoint(net, dest, format="dorafp8", verbose=False)  # one shard now (and its index)
    names = sorted(_tree(dest))
    assert len(names) == 3 and "README.md" in names and "model.safetensors.index.json" in names, names
    assert sum("-of-00001." in n for n in names) == 1, names
    fresh = Net()
    dorafp8.load_fp8_checkpoint(fresh, dest, verbose=False)
    with torch.no_grad():
        assert torch.equal(fresh(X), net(X))
