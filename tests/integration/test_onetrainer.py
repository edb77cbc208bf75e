"""OneTrainer's DoRA on its fp8 layers through dorafp8 (dorafp8/onetrainer.py), issues 41 and 49.

OneTrainer is not on PyPI and its code is not copied here: tests/integration/_onetrainer_twin.py re-states, in its
own layout (namespace packages, no modules/__init__.py), what its source at commit
23df3832e8f213d64c337e39f9365ba46e99fed0 computes: its fp8 layers (LinearFp8, LinearW8A8 in fp8, SVDQuant's
LinearSVD), the loader's dtype conversion that turns their `scale` buffers into the train dtype, quantize_layers,
get_unquantized_weight, and LoRAModule.py (PeftBase's linear and conv branches, LoRAModule's LinearSVD branch,
DoRAModule, LoRAModuleWrapper). With ONETRAINER_DIR pointing at a OneTrainer checkout the same tests run against it
(its requirements installed), through the same names, in OneTrainer's order: convert to dtype, quantize_layers,
LoRAModuleWrapper, hook_to_module.

The reference is OneTrainer's own DoRAModule forward on an nn.Linear holding the dequantized fp8 weight, which is what
OneTrainer computes on its fp8 layer. dorafp8's forward must give the same outputs and gradients, train to the same
losses and leave the same state_dict, without ever forming the dense weight (get_unquantized_weight is not called in
the forward); on a layer whose whole weight it does not know (LinearSVD, a conv) OneTrainer's own forward runs.
"""

import copy
import importlib
import os
import subprocess
import sys
import types

import pytest
import torch
from torch import nn

import dorafp8  # noqa: F401  (installs the hooks before OneTrainer's checkout is on sys.path, as a script does)
from tests._tolerance import assert_close, tol
from tests.integration._onetrainer_twin import FILES

ONETRAINER_DIR = os.environ.get("ONETRAINER_DIR")
TRAIN_DEVICE = torch.device("cpu")


def write_twin(root) -> str:
    """The twin's files under `root` (no __init__.py anywhere, as in OneTrainer); returns the folder for sys.path."""
    for rel, text in FILES.items():
        path = os.path.join(str(root), rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text.lstrip())
    return str(root)


@pytest.fixture(scope="module")
def ot(tmp_path_factory):
    """OneTrainer (the twin, or ONETRAINER_DIR), imported after dorafp8 from a folder put on sys.path after it."""
    root = ONETRAINER_DIR or write_twin(tmp_path_factory.mktemp("onetrainer"))
    sys.path.insert(0, root)
    try:
        lora = importlib.import_module("modules.module.LoRAModule")
        quant = importlib.import_module("modules.util.quantization_util")
        yield types.SimpleNamespace(
            lora=lora, quant=quant, DoRAModule=lora.DoRAModule, LoRAModuleWrapper=lora.LoRAModuleWrapper,
            DataType=importlib.import_module("modules.util.enum.DataType").DataType,
            PeftType=importlib.import_module("modules.util.enum.ModelType").PeftType,
            LinearFp8=importlib.import_module("modules.module.quantized.LinearFp8").LinearFp8,
            make_svd_linear=importlib.import_module("modules.module.quantized.LinearSVD").make_svd_linear,
            Loader=importlib.import_module("modules.modelLoader.mixin.HFModelLoaderMixin").HFModelLoaderMixin)
    finally:
        sys.path.remove(root)
        for name in [n for n in sys.modules if n == "modules" or n.startswith("modules.")]:
            del sys.modules[name]


@pytest.fixture
def calls(ot, monkeypatch):
    """How often OneTrainer's DoRA dequantized a weight (its LoRAModule's get_unquantized_weight)."""
    count = {"n": 0}
    orig = ot.lora.get_unquantized_weight

    def counted(*args, **kwargs):
        count["n"] += 1
        return orig(*args, **kwargs)

    monkeypatch.setattr(ot.lora, "get_unquantized_weight", counted)
    return count


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(24, 40), nn.Linear(40, 16, bias=False)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _model(ot, kind, train="FLOAT_32", make=Net):
    """make() (Net) as OneTrainer's loader and setup make it: its dtype conversion, then quantize_layers."""
    torch.manual_seed(0)
    net = make()
    DT = ot.DataType
    svd = types.SimpleNamespace(svd_dtype=DT.BFLOAT_16, svd_rank=4, cache_dir=None, layer_filter="",
                                layer_filter_regex=False)
    dtype, quantization = {"LinearFp8": (DT.FLOAT_8, None), "LinearW8A8": (DT.FLOAT_W8A8, None),
                           "LinearSVD": (DT.FLOAT_8, svd), "dense": (DT[train], None)}[kind]
    ot.Loader()._convert_diffusers_sub_module_to_dtype(net, dtype, DT[train], quantization)
    ot.quant.quantize_layers(net, TRAIN_DEVICE, DT[train], None)
    if kind != "dense":
        first = next(m for m in net.modules() if isinstance(m, nn.Linear))
        assert type(first).__name__ == kind and first.weight.dtype == torch.float8_e4m3fn
    return net


def _config(ot, output_axis, norm_epsilon, rank=4, alpha=8.0):
    return types.SimpleNamespace(peft_type=ot.PeftType.LORA, lora_rank=rank, lora_alpha=alpha, lokr_dim=rank,
                                 lora_decompose=True, lora_decompose_norm_epsilon=norm_epsilon,
                                 lora_decompose_output_axis=output_axis, train_device="cpu", layer_filter_regex=False,
                                 debug_mode=False)


def _adapt(ot, net, output_axis=False, norm_epsilon=False, p=0.0, **fusion):
    """OneTrainer's DoRA on every layer of `net` (LoRAModuleWrapper, then hook_to_module), with adapters set to
    values of their own (one seed: the same for every model of the same shapes)."""
    torch.manual_seed(1)
    wrapper = ot.LoRAModuleWrapper(net, "lora_unet", _config(ot, output_axis, norm_epsilon), **fusion)
    g = torch.Generator().manual_seed(2)
    for m in wrapper.lora_modules.values():
        m = getattr(m, "module", m)  # a fused q/k/v group's one adapter
        m.dropout.p = p
        with torch.no_grad():  # OneTrainer's lora_up starts at 0: give it (and dora_scale) other values
            m.lora_up.weight.copy_(torch.randn(m.lora_up.weight.shape, generator=g) * 0.3)
            m.dora_scale.mul_(1 + 0.2 * torch.randn(m.dora_scale.shape, generator=g))
    wrapper.hook_to_module()
    return wrapper


def _dense_twin(ot, net):
    """An nn.Linear model holding what OneTrainer dequantizes each layer of `net` to (in fp32)."""
    dense = _model(ot, "dense")
    with torch.no_grad():
        for name in ("fc1", "fc2"):
            q, d = getattr(net, name), getattr(dense, name)
            d.weight.copy_(ot.quant.get_unquantized_weight(q, torch.float32, TRAIN_DEVICE))
            if q.bias is not None:
                d.bias.copy_(q.bias)
    return dense


def _pair(ot, kind, output_axis=False, norm_epsilon=False, p=0.0):
    fp8 = _model(ot, kind)
    dense = _dense_twin(ot, fp8)
    return [(net, _adapt(ot, net, output_axis, norm_epsilon, p)) for net in (fp8, dense)]


def _run(net, wrapper, x, calls):
    """Output, gradients (x, then each adapter's parameters) and OneTrainer's dequantizations of one step."""
    xi = x.clone().requires_grad_()
    torch.manual_seed(3)  # the same dropout masks
    calls["n"] = 0
    y = net(xi)
    (y.square().mean() + y.mean()).backward()
    return y, [xi.grad] + [q.grad for q in wrapper.parameters()], calls["n"]


@pytest.mark.parametrize("kind", ["LinearFp8", "LinearW8A8"])
@pytest.mark.parametrize("output_axis", [False, True])
@pytest.mark.parametrize("norm_epsilon", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_dora_module_on_fp8_matches_onetrainer_on_dequantized_weights(ot, calls, kind, output_axis, norm_epsilon, p):
    (fp8, fw), (dense, dw) = _pair(ot, kind, output_axis, norm_epsilon, p)
    x = torch.randn(3, 5, 24)
    y8, g8, n8 = _run(fp8, fw, x, calls)
    yd, gd, _ = _run(dense, dw, x, calls)
    assert n8 == 0  # the dense fp32 weight is never formed: OneTrainer's dequantization is not called
    assert_close(y8, yd, tol(torch.float32), "outputs")
    for i, (a, b) in enumerate(zip(g8, gd)):
        assert_close(a, b, 2 * tol(torch.float32), f"gradient {i} (x, then each adapter's parameters)")


@pytest.mark.parametrize("output_axis", [False, True])
def test_training_and_saved_state_match_onetrainer(ot, output_axis):
    pairs = _pair(ot, "LinearFp8", output_axis, True, 0.1)
    losses = []
    for net, wrapper in pairs:
        opt = torch.optim.AdamW(wrapper.parameters(), lr=1e-2)
        torch.manual_seed(4)
        run = []
        for _ in range(3):
            loss = net(torch.randn(4, 24)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.detach())
        losses.append(torch.stack(run))
    assert_close(losses[0], losses[1], tol(torch.float32), "losses")
    saved = [wrapper.state_dict() for _, wrapper in pairs]  # what OneTrainer saves
    assert saved[0].keys() == saved[1].keys() == {
        f"lora_unet.{n}.{k}" for n in ("fc1", "fc2") for k in ("alpha", "dora_scale", "lora_down.weight",
                                                              "lora_up.weight")}
    for k in saved[0]:
        assert saved[0][k].dtype == saved[1][k].dtype and saved[0][k].shape == saved[1][k].shape
        assert_close(saved[0][k], saved[1][k], 2 * tol(torch.float32), k)


@pytest.mark.parametrize("train", ["BFLOAT_16", "FLOAT_16"])
@pytest.mark.parametrize("kind", ["LinearFp8", "LinearW8A8"])
@pytest.mark.parametrize("output_axis", [False, True])
@pytest.mark.parametrize("adapters", ["FLOAT_32", "train"])
def test_under_onetrainer_autocast_the_error_is_onetrainer_own(ot, monkeypatch, kind, train, output_axis, adapters):
    """OneTrainer trains in bf16 / fp16: its loader puts the scales and biases in that train dtype, its adapters are
    fp32 (lora_weight_dtype's default) or in the train dtype (LoRAModuleWrapper.to), and the step runs under
    torch.autocast of the train dtype (dtype_util's create_autocast_context). Against an fp64 evaluation of
    OneTrainer's own formula on the dequantized weights (and the same adapter values), dorafp8's outputs and gradients
    must carry the train dtype's rounding and no more than OneTrainer's own forward on the same fp8 layers under the
    same autocast (seen: at most 1.5x it)."""
    dtype = {"BFLOAT_16": torch.bfloat16, "FLOAT_16": torch.float16}[train]
    adapter_dtype = torch.float32 if adapters == "FLOAT_32" else dtype

    def adapt(net):
        wrapper = _adapt(ot, net, output_axis, True)
        wrapper.to(dtype=adapter_dtype)
        return wrapper
    x = torch.randn(3, 5, 24, generator=torch.Generator().manual_seed(7))

    def run(net, wrapper, x, autocast):
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype, enabled=autocast):
            y = net(xi)
        (y.double().square().mean() + y.double().mean()).backward()
        return [y.double(), xi.grad.double()] + [q.grad.double() for q in wrapper.parameters()]

    net = _model(ot, kind, train)
    ours = run(net, adapt(net), x.to(dtype), True)
    monkeypatch.setattr(ot.DoRAModule, "forward", _own_forward(ot))
    net = _model(ot, kind, train)
    own = run(net, adapt(net), x.to(dtype), True)
    dense = _dense_twin(ot, net).double()
    wrapper = _adapt(ot, dense, output_axis, True)
    for m in wrapper.lora_modules.values():
        for t in list(m.parameters()) + list(m.buffers()):  # the values the train-dtype adapters hold
            t.data = t.data.to(adapter_dtype).double()
    truth = run(dense, wrapper, x.to(dtype).double(), False)

    err = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    for i, (a, b, t) in enumerate(zip(ours, own, truth)):
        what = f"{'output' if i == 0 else f'gradient {i - 1} (x, then each adapter parameter)'}"
        assert_close(a, t, 2 * tol(dtype), what + " against fp64")
        assert err(a, t) <= 2 * err(b, t), (what, err(a, t), err(b, t))


def _own_forward(ot):
    """OneTrainer's DoRAModule.forward as it was before dorafp8 replaced it."""
    return getattr(ot.DoRAModule.forward, "_dorafp8_orig", ot.DoRAModule.forward)


def test_svd_quant_layer_is_left_to_onetrainer(ot, calls, monkeypatch):
    """SVDQuant (make_svd_linear(LinearFp8)): an nn.Linear with an e4m3 weight and `_scale`, whose weight also holds
    svd_up @ svd_down. The fused path does not know that term, so it must not take the layer: OneTrainer's own forward
    runs, to the bit. (Before issue 49 it took it and dropped the term: outputs off by about half their size.)"""
    from dorafp8.onetrainer import fp8_parts

    net = _model(ot, "LinearSVD")
    assert net.fc1.svd_up.shape == (40, 4)
    x = torch.randn(3, 24)
    y, grads, n = _run(net, _adapt(ot, net, p=0.0), x, calls)
    monkeypatch.setattr(ot.DoRAModule, "forward", _own_forward(ot))
    net2 = _model(ot, "LinearSVD")
    y2, grads2, _ = _run(net2, _adapt(ot, net2, p=0.0), x, calls)
    assert_close(y, y2, 0.0, "outputs against OneTrainer's own")
    for i, (a, b) in enumerate(zip(grads, grads2)):
        assert_close(a, b, 0.0, f"gradient {i} against OneTrainer's own")
    assert n == 2  # OneTrainer dequantized both layers (with their SVD terms)
    assert fp8_parts(net.fc1) is None and fp8_parts(net.fc2) is None


class Qkv(nn.Module):  # q/k/v leaves of one block, as the fusion specs of Flux, SD3, Chroma, ... name them
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Module()])
        attn = self.blocks[0].attn = nn.Module()
        attn.to_q, attn.to_k, attn.to_v = nn.Linear(24, 16), nn.Linear(24, 16, bias=False), nn.Linear(24, 8)
        self.out = nn.Linear(40, 16)

    def forward(self, x):
        attn = self.blocks[0].attn
        return self.out(torch.cat([attn.to_q(x), attn.to_k(x), attn.to_v(x)], dim=-1))


QKV_SPEC = [("blocks.{i}", ["attn.to_q", "attn.to_k", "attn.to_v"], "attn.qkv", "qkv")]


@pytest.mark.parametrize("fuse", [True, False])
def test_fused_qkv_groups_are_left_to_onetrainer(ot, calls, monkeypatch, fuse):
    """OneTrainer's fused LoRA output formats (KOHYA_LORA, ORIGINAL_LORA, COMFY_LORA: fuse=True) build one adapter
    per q/k/v group on a _FusedLinear over the fp8 leaves, whose own weight is a 0-size stand-in: the fused path must
    leave it to OneTrainer's own forward, which gives OneTrainer's result to the bit (docs/TRAINERS.md says so). Split
    (fuse=False), dorafp8 runs every layer: OneTrainer dequantizes nothing."""
    x = torch.randn(3, 24)
    runs = []
    for own in (False, True):
        if own:
            monkeypatch.setattr(ot.DoRAModule, "forward", _own_forward(ot))
        net = _model(ot, "LinearFp8", make=Qkv)
        wrapper = _adapt(ot, net, fusion_spec=QKV_SPEC, fuse=fuse)
        assert ("blocks.0.attn.qkv" in wrapper.lora_modules) == fuse
        with torch.no_grad():
            v = net.blocks[0].attn.to_v(x)
        runs.append((*_run(net, wrapper, x, calls), v))
    (y, grads, n, v), (y_own, grads_own, n_own, v_own) = runs
    assert n_own == (3 + 1 if fuse else 4)  # OneTrainer's own: the group once per leaf, then `out`
    assert n == (3 if fuse else 0)  # through dorafp8: the group stays OneTrainer's, `out` does not
    assert_close(v, v_own, 0.0 if fuse else tol(torch.float32), "to_v's output against OneTrainer's own")
    assert_close(y, y_own, tol(torch.float32), "outputs against OneTrainer's own")
    for i, (a, b) in enumerate(zip(grads, grads_own)):
        assert_close(a, b, 2 * tol(torch.float32), f"gradient {i} against OneTrainer's own")


@pytest.mark.parametrize("train", ["BFLOAT_16", "FLOAT_16"])
@pytest.mark.parametrize("kind", ["LinearFp8", "LinearW8A8"])
def test_scales_in_the_train_dtype_are_read_as_onetrainer_reads_them(ot, kind, train):
    """OneTrainer's loader turns every non-quantized buffer into the train dtype before quantizing, `scale` (and with
    it LinearFp8's `_scale`) included: the scale is then held rounded to bf16/fp16. What the fused path computes with
    is exactly what OneTrainer dequantizes to."""
    from dorafp8.onetrainer import fp8_parts

    net = _model(ot, kind, train)
    for layer in (net.fc1, net.fc2):
        assert layer.scale.dtype == torch.__dict__[{"BFLOAT_16": "bfloat16", "FLOAT_16": "float16"}[train]]
        w8, scale = fp8_parts(layer)
        assert torch.equal(w8.float() * scale, ot.quant.get_unquantized_weight(layer, torch.float32, TRAIN_DEVICE))


class _CrossDeviceCopies(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that take a CPU tensor and return one on another device (a CPU -> GPU copy on a GPU)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        if (isinstance(out, torch.Tensor) and out.device.type != "cpu"
                and any(a.device.type == "cpu" for a in ins)):
            self.n += 1
        return out


def test_a_cpu_scale_is_not_copied_to_the_weight_device_every_forward(ot):
    """LinearFp8 keeps `_scale` as a plain attribute: Module.to moves its `scale` buffer and leaves `_scale` on the
    CPU. The fused path must not copy it to the weight's device on every forward (on a GPU each such copy synchronizes
    the stream: a host sync per layer per step); it is copied again once it changes. (The meta device stands in for
    the GPU here.)"""
    from dorafp8.onetrainer import fp8_parts

    net = _model(ot, "LinearFp8")
    layer = net.fc1
    scale = layer._scale
    layer.to("meta")
    assert layer.weight.device.type == "meta" and layer._scale is scale and scale.device.type == "cpu"
    with _CrossDeviceCopies() as copies:
        for _ in range(3):
            assert fp8_parts(layer)[1].device.type == "meta"
    assert copies.n == 1
    # as OneTrainer's quantize() and load_state_dict write it; through `.data`, which bumps no version counter and
    # keeps data_ptr (the kept copy was keyed on those and went on computing with the old scale)
    for write in (lambda: scale.mul_(2), lambda: scale.data.mul_(3), lambda: setattr(scale, "data", scale * 5)):
        with torch.no_grad():
            write()
        with _CrossDeviceCopies() as copies:
            fp8_parts(layer)
            fp8_parts(layer)
        assert copies.n == 1


@pytest.mark.parametrize("train", ["BFLOAT_16", "FLOAT_32"])
def test_the_scale_read_by_the_fused_path_follows_writes_to_it(ot, train):
    """The fp32 scale the fused path keeps for a layer is the layer's current one after every kind of write."""
    from dorafp8.onetrainer import fp8_parts

    layer = _model(ot, "LinearFp8", train).fc1
    for write in (lambda s: s.mul_(3), lambda s: layer.load_state_dict(dict(layer.state_dict(), scale=s * 5)),
                  lambda s: setattr(s, "data", (s * 7).to(torch.float16)), lambda s: s.data.mul_(11)):
        fp8_parts(layer)
        with torch.no_grad():
            write(layer._scale)
        assert fp8_parts(layer)[1] == layer._scale.float()
    layer._scale = torch.tensor(0.25)  # a new tensor in its place
    assert fp8_parts(layer)[1] == 0.25


def test_a_scale_made_in_inference_mode_is_read_as_it_is_now(ot):
    """A model built or loaded under torch.inference_mode() (a sampling script) holds inference tensors, which track
    no version: the fused path read the scale's version to key its kept copy and raised 'Inference tensors do not
    track version counter' (outside and inside inference mode alike); an in-place write to one is invisible to such a
    key, so it is read as it is at every call."""
    from dorafp8.onetrainer import fp8_parts

    layer = _model(ot, "LinearFp8").fc1
    with torch.inference_mode():
        layer._scale = layer._scale.to(torch.float16)  # not fp32 on the weight's device: the copy the fused path keeps
    assert fp8_parts(layer)[1] == layer._scale.float()
    with torch.inference_mode():
        assert fp8_parts(layer)[1] == layer._scale.float()
        layer._scale.mul_(2)
        assert fp8_parts(layer)[1] == layer._scale.float()


def test_conv_layers_run_onetrainer_own_forward(ot, calls):
    """PeftBase's conv branch: DoRA on an nn.Conv2d is OneTrainer's own (dorafp8 takes fp8 linear layers only)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1))
    wrapper = _adapt(ot, net, output_axis=True)
    assert sorted(wrapper.lora_modules) == ["0", "2"]
    assert wrapper.lora_modules["0"].dora_scale.shape == (8, 1, 1, 1)
    x = torch.randn(2, 3, 6, 6)
    y = net[0](x)
    m = wrapper.lora_modules["0"]
    with torch.no_grad():
        V = net[0].weight + (m.lora_up.weight.flatten(1) @ m.lora_down.weight.flatten(1)).view(8, 3, 3, 3) * 2.0
        ref = nn.functional.conv2d(x, m.dora_scale * V / V.flatten(1).norm(dim=1).view(8, 1, 1, 1), net[0].bias,
                                   padding=1)
    assert_close(y, ref, tol(torch.float32), "conv output")
    assert calls["n"] == 0 and net(x).shape == (2, 4, 6, 6)


def test_other_layers_run_onetrainer_own_forward(ot, calls):
    """A dense layer keeps OneTrainer's forward; a copy of the model still works."""
    assert hasattr(ot.DoRAModule.forward, "_dorafp8_orig")  # the hook ran when the module was imported
    net = _model(ot, "dense")
    _adapt(ot, net)
    calls["n"] = 0
    copy.deepcopy(net)(torch.randn(2, 24))
    net(torch.randn(2, 24))
    assert calls["n"] == 4  # two layers, in the model and in its copy


def _python(code: str, cwd=None, env=None):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=cwd,
                          env={**{k: v for k, v in os.environ.items() if k != "DORAFP8_NO_PATCHES"}, **(env or {})})


@pytest.fixture
def checkout(tmp_path):
    """A folder holding OneTrainer (ONETRAINER_DIR, or the twin written there) and a script that builds DoRA on two
    LinearFp8 layers with OneTrainer's LoRAModuleWrapper and runs three steps; the folder is put on sys.path only by
    the script (argv[1]), as OneTrainer's scripts put their checkout there."""
    root = ONETRAINER_DIR or write_twin(tmp_path / "OneTrainer")
    (tmp_path / "train.py").write_text(f"""
import sys, types
sys.path.insert(0, sys.argv[1])
import torch
from modules.module.LoRAModule import DoRAModule, LoRAModuleWrapper
from modules.module.quantized.LinearFp8 import LinearFp8
from modules.util.enum.ModelType import PeftType
Layer = torch.nn.Linear if "--dense" in sys.argv else LinearFp8  # --dense: OneTrainer's weight dtype not FLOAT_8
net = torch.nn.Sequential(Layer(16, 8), torch.nn.ReLU(), Layer(8, 4))
for m in (net[0], net[2]):
    if Layer is LinearFp8:
        m.quantize()
cfg = types.SimpleNamespace(peft_type=PeftType.LORA, lora_rank=2, lora_alpha=2.0, lokr_dim=2, lora_decompose=True,
                            lora_decompose_norm_epsilon=False, lora_decompose_output_axis=False, train_device="cpu",
                            layer_filter_regex=False, debug_mode=False)
wrapper = LoRAModuleWrapper(net, "lora_unet", cfg)
wrapper.hook_to_module()
if "--import-dorafp8-now" in sys.argv:
    import dorafp8
for _ in range(3):
    net(torch.randn(2, 16)).sum().backward()
print("patched", hasattr(DoRAModule.forward, "_dorafp8_orig"))
""")
    return root


_PATCHED = ("import sys\nfrom modules.module.LoRAModule import DoRAModule\n"
            "print(hasattr(DoRAModule.forward, '_dorafp8_orig'))")


def test_import_dorafp8_from_a_onetrainer_checkout(checkout):
    """From a checkout (its `modules` a namespace package on sys.path), `import dorafp8` crashed with KeyError:
    'modules' (issue 49); it must watch OneTrainer's module and hook it when it is imported."""
    out = _python("import dorafp8\n" + _PATCHED, cwd=checkout)
    assert out.returncode == 0 and out.stdout.split()[-1:] == ["True"], out.stderr[-3000:]


def test_import_dorafp8_before_the_checkout_joins_sys_path(checkout):
    """OneTrainer's scripts put the checkout on sys.path after they start: `import dorafp8` first still hooks it."""
    out = _python(f"import sys, dorafp8\nsys.path.insert(0, {checkout!r})\n" + _PATCHED)
    assert out.returncode == 0 and out.stdout.split()[-1:] == ["True"], out.stderr[-3000:]


@pytest.mark.parametrize("hooked_first", [True, False])
def test_onetrainer_adapters_hooked_before_dorafp8_get_one_warning(checkout, tmp_path, hooked_first):
    """Adapters OneTrainer hooked to their layers before `import dorafp8` keep the forward they bound (dense): said
    once, naming the launcher. Importing OneTrainer's module first without hooking anything says nothing."""
    if hooked_first:
        out = _python(f"import sys\nsys.argv = ['train.py', {checkout!r}, '--import-dorafp8-now']\n"
                      f"exec(open({str(tmp_path / 'train.py')!r}).read())", env={"PYTHONWARNINGS": "always"})
    else:
        out = _python(f"import sys\nsys.path.insert(0, {checkout!r})\nimport modules.module.LoRAModule\n"
                      "import dorafp8\n" + _PATCHED, env={"PYTHONWARNINGS": "always"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.count("were hooked to their layers before dorafp8 was imported") == int(hooked_first), out.stderr
    if hooked_first:
        assert "dorafp8 run -- python scripts/train.py" in out.stderr


def test_launcher_exit_report_counts_onetrainer_fused_calls(checkout, tmp_path):
    """`dorafp8 run` reports the fused calls of every layer it ran, OneTrainer's included (it said nothing for them
    before issue 49): 2 layers x 3 steps."""
    out = subprocess.run([sys.executable, "-m", "dorafp8", "run", "--", "python", "train.py", checkout],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "patched True" in out.stdout, out.stderr[-3000:]
    assert "2 dorafp8 DoRA/LoRA layers ran 6 forward calls" in out.stderr, out.stderr
    assert "their own forward" not in out.stderr, out.stderr


def test_launcher_exit_report_names_layers_left_to_onetrainer(checkout, tmp_path):
    """A config whose weights are not in FLOAT_8 / FLOAT_W8A8 (here dense layers; SVDQuant's are the same) trains
    through OneTrainer's own DoRA forward: the run said nothing at exit, as if dorafp8 had trained it. The report
    counts those adapters."""
    out = subprocess.run([sys.executable, "-m", "dorafp8", "run", "--", "python", "train.py", checkout, "--dense"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "patched True" in out.stdout, out.stderr[-3000:]
    assert ("0 dorafp8 DoRA/LoRA layers ran 0 forward calls; 2 LyCORIS / OneTrainer adapter layers ran their own "
            "forward, not dorafp8's") in out.stderr, out.stderr


@pytest.mark.parametrize("offloading", [False, True])
@pytest.mark.parametrize("output_axis", [False, True])
def test_compiled_blocks_match_eager_as_onetrainer_compiles_them(ot, output_axis, offloading):
    """OneTrainer's `compile` option compiles each checkpointed block with fullgraph=True (checkpointing_util's
    create_checkpoint, non-reentrant checkpointing). The fused path must trace without a graph break and give eager's outputs and gradients: it
    read the alpha buffer with float(), a data-dependent value under torch.compile that the fused op cannot take as
    its scaling, so the first compiled step raised. With layer offloading (its OffloadCheckpointLayer) the block
    itself is compiled and called inside reentrant checkpointing: its first forward runs under no_grad, the backward
    recomputes it with grad. Two token counts, as its resolution buckets give, so the second step recompiles."""
    import torch.utils.checkpoint as ckpt

    net, wrapper = _pair(ot, "LinearFp8", output_axis, True, 0.0)[0]
    if offloading:
        reentrant = lambda m: lambda x: ckpt.checkpoint(m, x, use_reentrant=True)  # noqa: E731
        models = (reentrant(net), reentrant(torch.compile(net, fullgraph=True, backend="aot_eager")))
    else:
        block = lambda x: ckpt.checkpoint(net, x, use_reentrant=False)  # noqa: E731  (its CheckpointLayer's call)
        models = (block, torch.compile(block, fullgraph=True, backend="aot_eager"))
    for tokens in (5, 9):
        x = torch.randn(3, tokens, 24)
        runs = []
        for model in models:
            xi = x.clone().requires_grad_()
            y = model(xi)
            (y.square().mean() + y.mean()).backward()
            runs.append([y.detach(), xi.grad] + [q.grad.clone() for q in wrapper.parameters()])
            for q in wrapper.parameters():
                q.grad = None
        for i, (a, b) in enumerate(zip(*runs)):
            assert_close(a, b, tol(torch.float32), f"{'output' if i == 0 else f'gradient {i - 1}'} compiled vs eager")
