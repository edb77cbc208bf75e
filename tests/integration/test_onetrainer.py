"""OneTrainer's DoRA on its fp8 layers through dorafp8 (dorafp8/onetrainer.py), issue 41.

OneTrainer is not on PyPI and its code is not copied here: its semantics are re-implemented below, read from
github.com/Nerogar/OneTrainer at commit 23df3832e8f213d64c337e39f9365ba46e99fed0 (2026-08-19):
modules/module/LoRAModule.py (PeftBase, LoRAModule, DoRAModule: create_layer, initialize_weights, forward, state_dict
with the module's prefix), modules/module/quantized/LinearFp8.py (quantize: scale = max(amax, 1e-12) / 448 in `_scale`,
the tensor registered as the `scale` buffer; its forward dequantizes in the compute dtype),
modules/module/quantized/LinearW8A8.py with dtype float8_e4m3fn and modules/util/quantization_util.py
(quantize_fp8_tensorwise: scale = max(amax / 448, 1e-30), clamp to +-448; get_unquantized_weight). The
re-implementation is written as a package `modules.module.LoRAModule`, the name OneTrainer imports it by, so that
dorafp8's import hook finds it as it would find OneTrainer's.

The reference is that same DoRAModule's own forward on an nn.Linear holding the dequantized fp8 weight (w8 * scale in
fp32), which is what OneTrainer computes on its fp8 layer. dorafp8's forward must give the same outputs and
gradients, train to the same losses and leave the same state_dict (the keys OneTrainer saves), without ever forming
the dense weight (OneTrainer's get_unquantized_weight is not called in the forward).
"""

import copy
import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import dorafp8  # noqa: F401  (installs the hook before the re-implemented OneTrainer is imported)
from tests._tolerance import assert_close, tol

ONETRAINER = '''
import math
import torch
import torch.nn.functional as F
from torch import nn

CALLS = {"get_unquantized_weight": 0}


def quantize_fp8_tensorwise(x):  # modules/util/quantization_util.py
    scale = (x.abs().max().float() / 448.0).clamp(min=1e-30)
    return x.float().mul(1.0 / scale).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn), scale


class LinearFp8(nn.Linear):  # modules/module/quantized/LinearFp8.py
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._scale = torch.tensor(1.0, dtype=torch.float)
        self.register_buffer("scale", self._scale)
        self.compute_dtype = None

    def unquantized_weight(self, dtype, device):
        return self.weight.detach().to(dtype) * self._scale.to(dtype=dtype, device=self.weight.device)

    def quantize(self):
        weight = self.weight.data
        self._scale.copy_(torch.clamp(weight.abs().max(), min=1e-12) / torch.finfo(torch.float8_e4m3fn).max)
        self.weight.data = weight.div_(self._scale).to(dtype=torch.float8_e4m3fn)

    def forward(self, x):
        weight = self.weight.detach().to(dtype=self.compute_dtype or x.dtype).mul_(self._scale)
        return F.linear(x, weight, self.bias)


class LinearW8A8(nn.Linear):  # modules/module/quantized/LinearW8A8.py, dtype=torch.float8_e4m3fn
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("scale", torch.tensor(1.0, dtype=torch.float32))

    def unquantized_weight(self, dtype, device):
        return (self.weight.detach().float() * self.scale.to(device=self.weight.device)).to(dtype)

    @torch.no_grad()
    def quantize(self):
        weight, scale = quantize_fp8_tensorwise(self.weight.detach())
        self.requires_grad_(False)
        self.weight.data = weight
        self.scale.copy_(scale)


def get_unquantized_weight(module, dtype, device):  # modules/util/quantization_util.py
    CALLS["get_unquantized_weight"] += 1
    if hasattr(module, "unquantized_weight"):
        return module.unquantized_weight(dtype, device)
    return module.weight.detach().to(dtype=dtype)


class PeftBase(nn.Module):  # modules/module/LoRAModule.py: the linear case
    def __init__(self, prefix, orig_module):
        super().__init__()
        self.prefix = prefix + "."
        self._orig_module = [orig_module]
        self.is_applied = False
        self._initialized = False
        self.op = F.linear
        self.shape = torch.Size((orig_module.out_features, orig_module.in_features))

    @property
    def orig_module(self):
        return self._orig_module[0]

    def hook_to_module(self):
        self.orig_forward = self.orig_module.forward
        self.orig_module.forward = self.forward
        self.is_applied = True

    def make_weight(self, A, B):
        return (B.view(B.size(0), -1) @ A.view(A.size(0), -1)).view(self.shape)

    def check_initialized(self):
        if not self._initialized:
            raise RuntimeError(f"Module {self.prefix} is not initialized.")

    def create_layer(self):
        device = self.orig_module.weight.device
        return (nn.Linear(self.orig_module.in_features, self.rank, bias=False, device=device),
                nn.Linear(self.rank, self.orig_module.out_features, bias=False, device=device))


class LoRAModule(PeftBase):
    def __init__(self, prefix, orig_module, rank, alpha):
        super().__init__(prefix, orig_module)
        self.rank = rank
        self.dropout = nn.Dropout(0)
        self.register_buffer("alpha", torch.tensor(alpha))
        self.initialize_weights()
        self.alpha.requires_grad_(False)

    def initialize_weights(self):
        self._initialized = True
        self.lora_down, self.lora_up = self.create_layer()
        nn.init.kaiming_uniform_(self.lora_down.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_up.weight)


class DoRAModule(LoRAModule):
    def __init__(self, *args, **kwargs):
        self.dora_scale = None
        self.norm_epsilon = kwargs.pop("norm_epsilon", False)
        self.decompose_output_axis = kwargs.pop("decompose_output_axis", False)
        self.train_device = kwargs.pop("train_device")
        super().__init__(*args, **kwargs)

    def initialize_weights(self):
        super().initialize_weights()
        orig_weight = get_unquantized_weight(self.orig_module, torch.float, self.train_device)
        self.dora_num_dims = orig_weight.dim() - 1
        if self.decompose_output_axis:
            self.dora_scale = nn.Parameter(torch.norm(orig_weight.reshape(orig_weight.shape[0], -1), dim=1,
                                                      keepdim=True).reshape(orig_weight.shape[0], 1))
        else:
            self.dora_scale = nn.Parameter(torch.norm(orig_weight.transpose(1, 0).reshape(orig_weight.shape[1], -1),
                                                      dim=1, keepdim=True).reshape(orig_weight.shape[1], 1)
                                           .transpose(1, 0))

    def forward(self, x, *args, **kwargs):
        self.check_initialized()
        A = self.lora_down.weight
        B = self.lora_up.weight
        orig_weight = get_unquantized_weight(self.orig_module, torch.float, self.train_device)
        WP = orig_weight + (self.make_weight(A, B) * (self.alpha / self.rank))
        eps = torch.finfo(WP.dtype).eps if self.norm_epsilon else 0.0
        if self.decompose_output_axis:
            norm = WP.detach().reshape(WP.shape[0], -1).norm(dim=1).reshape(WP.shape[0], 1) + eps
        else:
            norm = WP.detach().transpose(0, 1).reshape(WP.shape[1], -1).norm(dim=1, keepdim=True) \\
                .reshape(WP.shape[1], 1).transpose(0, 1) + eps
        WP = self.dora_scale * (WP / norm)
        return self.op(self.dropout(x), WP, self.orig_module.bias)
'''


@pytest.fixture(scope="module")
def ot(tmp_path_factory):
    """The re-implemented OneTrainer, imported as modules.module.LoRAModule after dorafp8 (as OneTrainer is)."""
    root = tmp_path_factory.mktemp("onetrainer")
    (root / "modules" / "module").mkdir(parents=True)
    (root / "modules" / "__init__.py").write_text("")
    (root / "modules" / "module" / "__init__.py").write_text("")
    (root / "modules" / "module" / "LoRAModule.py").write_text(textwrap.dedent(ONETRAINER))
    from dorafp8 import _install

    _install.wait_for(_install.ONETRAINER_MODULE)  # what dorafp8 run does before the trainer's checkout is on sys.path
    sys.path.insert(0, str(root))
    try:
        yield importlib.import_module("modules.module.LoRAModule")
    finally:
        sys.path.remove(str(root))
        for name in [n for n in sys.modules if n == "modules" or n.startswith("modules.")]:
            del sys.modules[name]


class Net(nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.fc1, self.fc2 = linear(24, 40), linear(40, 16, bias=False)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _pair(ot, kind, output_axis, norm_epsilon, p):
    """(OneTrainer's DoRA on its fp8 model, the same on an nn.Linear twin holding the dequantized weights): same
    initial adapters (one seed), as OneTrainer builds them (LoRAModuleWrapper: a DoRAModule per layer, hooked)."""
    torch.manual_seed(0)
    fp8 = Net(getattr(ot, kind))
    for m in (fp8.fc1, fp8.fc2):
        m.quantize()
    dense = Net(nn.Linear)
    with torch.no_grad():
        for name in ("fc1", "fc2"):
            q, d = getattr(fp8, name), getattr(dense, name)
            d.weight.copy_(q.unquantized_weight(torch.float32, "cpu"))
            if q.bias is not None:
                d.bias.copy_(q.bias)
    nets = []
    for net in (fp8, dense):
        torch.manual_seed(1)
        mods = {n: ot.DoRAModule(f"lora_unet.{n}", getattr(net, n), 4, 8.0, norm_epsilon=norm_epsilon,
                                 decompose_output_axis=output_axis, train_device=torch.device("cpu"))
                for n in ("fc1", "fc2")}
        g = torch.Generator().manual_seed(2)
        for m in mods.values():
            m.dropout.p = p
            m.hook_to_module()
            with torch.no_grad():  # OneTrainer's lora_up starts at 0: give it (and dora_scale) other values
                m.lora_up.weight.copy_(torch.randn(m.lora_up.weight.shape, generator=g) * 0.3)
                m.dora_scale.mul_(1 + 0.2 * torch.randn(m.dora_scale.shape, generator=g))
        nets.append((net, mods))
    return nets


def _params(mods):
    return [p for m in mods.values() for p in (m.lora_down.weight, m.lora_up.weight, m.dora_scale)]


@pytest.mark.parametrize("kind", ["LinearFp8", "LinearW8A8"])
@pytest.mark.parametrize("output_axis", [False, True])
@pytest.mark.parametrize("norm_epsilon", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_dora_module_on_fp8_matches_onetrainer_on_dequantized_weights(ot, kind, output_axis, norm_epsilon, p):
    (fp8, fmods), (dense, dmods) = _pair(ot, kind, output_axis, norm_epsilon, p)
    for m in (fp8, dense):
        m.train()
    x = torch.randn(3, 5, 24)
    outs, grads = [], []
    for net, mods in ((fp8, fmods), (dense, dmods)):
        xi = x.clone().requires_grad_()
        torch.manual_seed(3)  # the same dropout masks: both draw them from x's dropout, in the same order
        ot.CALLS["get_unquantized_weight"] = 0
        y = net(xi)
        (y.square().mean() + y.mean()).backward()
        outs.append(y)
        grads.append([xi.grad] + [q.grad for q in _params(mods)])
        if net is fp8:  # the dense fp32 weight is never formed: OneTrainer's dequantization is not called
            assert ot.CALLS["get_unquantized_weight"] == 0
    assert_close(outs[0], outs[1], tol(torch.float32), "outputs")
    for i, (a, b) in enumerate(zip(*grads)):
        assert_close(a, b, 2 * tol(torch.float32), f"gradient {i} (x, then lora_down, lora_up, dora_scale per layer)")


@pytest.mark.parametrize("output_axis", [False, True])
def test_training_and_saved_state_match_onetrainer(ot, output_axis):
    (fp8, fmods), (dense, dmods) = _pair(ot, "LinearFp8", output_axis, True, 0.1)
    losses = []
    for net, mods in ((fp8, fmods), (dense, dmods)):
        opt = torch.optim.AdamW(_params(mods), lr=1e-2)
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
    # what OneTrainer saves: LoRAModuleWrapper.state_dict() = each module's state_dict(prefix=module.prefix)
    saved = [{k: v for m in mods.values() for k, v in m.state_dict(prefix=m.prefix).items()}
             for mods in (fmods, dmods)]
    assert saved[0].keys() == saved[1].keys() == {
        f"lora_unet.{n}.{k}" for n in ("fc1", "fc2") for k in ("alpha", "dora_scale", "lora_down.weight",
                                                              "lora_up.weight")}
    for k in saved[0]:
        assert saved[0][k].dtype == saved[1][k].dtype and saved[0][k].shape == saved[1][k].shape
        assert_close(saved[0][k], saved[1][k], 2 * tol(torch.float32), k)


def test_other_layers_run_onetrainer_own_forward(ot):
    """A dense layer (or one not yet quantized) keeps OneTrainer's forward; a copy of the model still works."""
    assert hasattr(ot.DoRAModule.forward, "_dorafp8_orig")  # the hook ran when the module was imported
    torch.manual_seed(0)
    net = Net(ot.LinearFp8)  # not quantized: bf16/fp32 weights
    mods = {n: ot.DoRAModule(n, getattr(net, n), 4, 4.0, train_device=torch.device("cpu")) for n in ("fc1", "fc2")}
    for m in mods.values():
        m.hook_to_module()
    ot.CALLS["get_unquantized_weight"] = 0
    copy.deepcopy(net)(torch.randn(2, 24))
    net(torch.randn(2, 24))
    assert ot.CALLS["get_unquantized_weight"] == 4  # two layers, in the model and in its copy


def test_dorafp8_run_waits_for_onetrainer_before_its_checkout_is_on_sys_path():
    """`import dorafp8` watches OneTrainer's module only where it can be found; OneTrainer's scripts put their checkout
    on sys.path after they start, so the launcher (dorafp8 run, OneTrainer's route) waits for it regardless."""
    code = ("import sys\nfrom dorafp8 import _install, launcher\n"
            "print(_install.ONETRAINER_MODULE in _install._pending)\n"
            "launcher.install({})\n"
            "print(_install.ONETRAINER_MODULE in _install._pending, _install._HOOK in sys.meta_path)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if k != "DORAFP8_NO_PATCHES"})
    assert out.stdout.split("\n")[:2] == ["False", "True True"], out.stdout + out.stderr[-2000:]
