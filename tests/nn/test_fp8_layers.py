"""Layers whose weights are already fp8 without a scale (issue 24): diffusers' enable_layerwise_casting, and plain fp8
casts of nn.Linear / nn.Conv2d (kohya, OneTrainer). PEFT's DoRA on them builds dorafp8 layers on the same bytes
(scale 1) and computes what PEFT computes on the dequantized weights; quantize_model takes them losslessly; the
adapters get the dtypes PEFT gives them on the original-precision model, in each of PEFT's and diffusers' entry
points, and biases are never fp8 (docs/DORA_MATH.md, "Dtype policy")."""

import copy

import pytest
import torch
from torch import nn

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")

from peft import LoraConfig, LoHaConfig, get_peft_model, inject_adapter_in_model  # noqa: E402
from peft.tuners.lora.layer import LoraLayer  # noqa: E402

import dorafp8  # noqa: E402
from dorafp8 import DoRAFP8Conv2d, DoRAFP8Linear, FP8Conv2d, FP8Linear  # noqa: E402
from tests._layers import n_fp8  # noqa: E402
from tests._tolerance import assert_close  # noqa: E402
from tests.integration.test_diffusion import UNET_TARGETS, _batches, small_unet  # noqa: E402

E4M3 = torch.float8_e4m3fn


def _add_dora(model, entry, cfg):
    """DoRA through one of the entry points people use; returns the model that holds the adapters."""
    if entry == "get_peft_model":
        return get_peft_model(model, cfg)
    if entry == "get_peft_model(autocast_adapter_dtype=False)":
        return get_peft_model(model, cfg, autocast_adapter_dtype=False)
    if entry == "add_adapter":  # diffusers' ModelMixin.add_adapter: inject_adapter_in_model, no dtype autocast
        model.add_adapter(cfg)
        return model
    assert entry == "inject_adapter_in_model"
    return inject_adapter_in_model(cfg, model)


ENTRIES = ["get_peft_model", "get_peft_model(autocast_adapter_dtype=False)", "add_adapter"]


def _copy_adapters(src, dst):
    """dst's adapters := src's (same module names, whatever the base layers are)."""
    missing, unexpected = dst.load_state_dict({k: v for k, v in src.state_dict().items() if "lora_" in k},
                                              strict=False)
    assert not unexpected and not [k for k in missing if "lora_" in k]


def _randomize_lora_B(model):
    """lora_B is zero at init: give it values so that every adapter gradient is exercised."""
    with torch.no_grad():
        for i, (n, p) in enumerate(sorted(model.named_parameters())):
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.02)


def _sgd_steps(model, batches, forward):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    model.train()
    losses = []
    for args, target in batches:
        loss = (forward(model, args) - target).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _adapter_dtypes(model):
    return {n.replace("base_model.model.", ""): p.dtype for n, p in model.named_parameters() if "lora_" in n}


def _base_bias_dtypes(model):
    return {n.replace("base_model.model.", ""): m.get_base_layer().bias.dtype for n, m in model.named_modules()
            if isinstance(m, LoraLayer) and m.get_base_layer().bias is not None}


# ---------------------------------------------------------------------------- diffusers' enable_layerwise_casting


def _layerwise(model, compute_dtype):
    model.enable_layerwise_casting(storage_dtype=E4M3, compute_dtype=compute_dtype)
    return model


def layerwise_compute_dtype(module):
    """The compute dtype of the layerwise-casting hook diffusers put on `module`, or None."""
    registry = getattr(module, "_diffusers_hook", None)
    hook = registry.get_hook("layerwise_casting") if registry is not None else None
    return None if hook is None else hook.compute_dtype


def _hooked(model):
    return {n: m for n, m in model.named_modules() if layerwise_compute_dtype(m) is not None}


def _unet_forward(model, kw):
    return model(**kw).sample


@pytest.mark.parametrize("entry", ["get_peft_model", "add_adapter"])
def test_layerwise_casting_unet_dora_matches_peft_on_dequantized_weights(entry):
    """DoRA straight on a layerwise-casting UNet (no quantize_model): the targeted layers become dorafp8 layers on
    the same e4m3 bytes, the others keep diffusers' hooks, and training computes what PEFT's DoRA computes on the
    model with the dequantized weights (fp32, so any difference but the order of sums would show)."""
    original = small_unet()
    lc = _layerwise(copy.deepcopy(original), torch.float32)
    hooked = _hooked(lc)
    assert len(hooked) > 100
    twin = copy.deepcopy(original)  # PEFT's twin: every fp8-stored tensor dequantized (exactly) to fp32
    for name, mod in hooked.items():
        for pname, p in twin.get_submodule(name).named_parameters(recurse=False):
            p.data = getattr(mod, pname).detach().to(torch.float32)
    w8 = {n: m.weight.detach().view(torch.uint8).clone() for n, m in hooked.items()}

    cfg = LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=UNET_TARGETS)
    ours = _add_dora(lc, entry, cfg)
    ref = _add_dora(twin, entry, copy.deepcopy(cfg))
    kinds = [type(m).__name__ for m in ours.modules()]
    assert kinds.count("DoRAFP8Linear") == 60 and kinds.count("DoRAFP8Conv2d") == 24
    for n, m in ours.named_modules():
        if isinstance(m, (DoRAFP8Linear, DoRAFP8Conv2d)):
            base, key = m.get_base_layer(), n.replace("base_model.model.", "")
            assert base.scale.item() == 1.0 and torch.equal(base.weight.view(torch.uint8), w8[key]), n
            assert layerwise_compute_dtype(base) is None  # no hook: it reads its fp8 weight itself
    # the layers DoRA does not target keep diffusers' hooks (fp8 storage, upcast around each forward)
    inner = ours.base_model.model if entry == "get_peft_model" else ours
    for name in ("conv_in", "time_embedding.linear_1", "down_blocks.0.attentions.0.proj_in"):
        assert layerwise_compute_dtype(inner.get_submodule(name)) == torch.float32, name
    # DoRA's init: the magnitude is the row norm of the same weight
    mags = {k: v for k, v in ours.state_dict().items() if "lora_magnitude_vector" in k}
    ref_sd = ref.state_dict()
    assert len(mags) == 84
    for k, v in mags.items():
        assert_close(v, ref_sd[k], 5e-7, k)

    _randomize_lora_B(ours)
    _copy_adapters(ours, ref)
    batches = _batches("unet", 1) * 2  # one batch, two steps: the loss must go down
    l_ours, l_ref = _sgd_steps(ours, batches, _unet_forward), _sgd_steps(ref, batches, _unet_forward)
    assert l_ours == pytest.approx(l_ref, rel=1e-5), (l_ours, l_ref)
    assert l_ours[-1] < l_ours[0]
    trained_ref = ref.state_dict()
    for k, v in ours.state_dict().items():
        if "lora_" in k:
            assert_close(v, trained_ref[k], 5e-6, k)
    ours.eval()
    ref.eval()
    kw, _ = _batches("unet", 1, seed=7)[0]
    with torch.no_grad():
        assert_close(_unet_forward(ours, kw), _unet_forward(ref, kw), 5e-6, "output after training")
    assert layerwise_compute_dtype(inner.conv_in) == torch.float32 and inner.conv_in.weight.dtype == E4M3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_model_takes_a_layerwise_casting_unet_losslessly(dtype):
    """quantize_model on a layerwise-casting model keeps the e4m3 bytes (scale 1) with the bias in the hook's
    compute dtype, drops the hooks of the layers it swaps, and (fp32) the model computes what it computed before."""
    lc = _layerwise(small_unet().to(dtype), dtype)
    hooked = _hooked(lc)
    kw, _ = _batches("unet", 1)[0]
    lc.eval()
    with torch.no_grad():
        before = lc(**kw).sample if dtype == torch.float32 else None
        w8 = {n: m.weight.detach().view(torch.uint8).clone() for n, m in hooked.items()}
        bias = {n: m.bias.detach().to(dtype) for n, m in hooked.items() if m.bias is not None}
    assert n_fp8(dorafp8.quantize_model(lc, include_conv=True)) == len(hooked) == 121  # the hooks are on every Linear/Conv2d
    for n in hooked:
        m = lc.get_submodule(n)
        assert m.scale.item() == 1.0 and torch.equal(m.weight.view(torch.uint8), w8[n]), n
        assert m.orig_dtype == dtype and layerwise_compute_dtype(m) is None, n
        if n in bias:
            assert m.bias.dtype == dtype and torch.equal(m.bias, bias[n]), n
    if before is not None:
        with torch.no_grad():
            assert_close(lc(**kw).sample, before, 5e-6, "output")


DTYPE_TARGETS = ["to_q", "ff.net.2", "conv1"]  # to_q has no bias; the others have one


@pytest.mark.parametrize("entry", ENTRIES)
def test_unet_adapter_and_bias_dtypes_follow_peft(entry):
    """On a bf16 UNet, PEFT makes the adapters fp32 with get_peft_model's default autocast_adapter_dtype=True and bf16
    with autocast_adapter_dtype=False or diffusers' add_adapter, and the biases stay bf16. dorafp8 gives the same,
    whether the UNet is quantized, layerwise-casting (diffusers stores weights and biases in fp8), or both."""
    original = small_unet().to(torch.bfloat16)
    cfg = LoraConfig(r=2, lora_alpha=2, use_dora=True, target_modules=DTYPE_TARGETS)
    peft_model = _add_dora(copy.deepcopy(original), entry, copy.deepcopy(cfg))
    want_adapters, want_bias = _adapter_dtypes(peft_model), _base_bias_dtypes(peft_model)
    assert set(want_bias.values()) == {torch.bfloat16} and len(want_bias) == 18
    assert set(want_adapters.values()) == {torch.float32 if entry == "get_peft_model" else torch.bfloat16}
    builds = {
        "quantize_model": lambda m: dorafp8.quantize_model(m, include_conv=True),
        "layerwise": lambda m: _layerwise(m, torch.bfloat16),
        "layerwise + quantize_model": lambda m: dorafp8.quantize_model(_layerwise(m, torch.bfloat16),
                                                                       include_conv=True),
    }
    for build, make in builds.items():
        ours = _add_dora(make(copy.deepcopy(original)), entry, copy.deepcopy(cfg))
        layers = [m for m in ours.modules() if isinstance(m, LoraLayer)]
        assert len(layers) == 30 and all(isinstance(m, (DoRAFP8Linear, DoRAFP8Conv2d)) for m in layers), build
        assert _adapter_dtypes(ours) == want_adapters, build
        assert _base_bias_dtypes(ours) == want_bias, build


# ------------------------------------------------------------------------- plain fp8 casts (kohya, OneTrainer)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.lin = nn.Linear(8, 5)

    def forward(self, x):
        return self.lin(torch.relu(self.conv(x)).mean(dim=(2, 3)))


def _net(dtype=torch.float32):
    torch.manual_seed(0)
    return Net().to(dtype)


def _cast_weights(net, bias_too=False):
    """What a plain fp8 cast does: `layer.weight.data = layer.weight.data.to(torch.float8_e4m3fn)` (and the bias)."""
    for m in (net.conv, net.lin):
        m.weight.data = (m.weight.data * 8).to(E4M3)  # * 8: values that use e4m3's range
        if bias_too:
            m.bias.data = m.bias.data.to(E4M3)
    return net


def _net_forward(model, x):
    return model(x)


X = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("entry", ["get_peft_model", "inject_adapter_in_model"])
def test_fp8_cast_linear_and_conv2d_dora_matches_peft_on_dequantized_weights(entry):
    cast = _cast_weights(_net())
    twin = copy.deepcopy(cast)
    for m in (twin.conv, twin.lin):
        m.weight.data = m.weight.data.to(torch.float32)
    w8 = {n: getattr(cast, n).weight.view(torch.uint8).clone() for n in ("conv", "lin")}
    cfg = LoraConfig(r=2, lora_alpha=4, use_dora=True, target_modules=["conv", "lin"])
    ours = _add_dora(cast, entry, cfg)
    ref = _add_dora(twin, entry, copy.deepcopy(cfg))
    inner = ours.base_model.model if entry == "get_peft_model" else ours
    assert isinstance(inner.conv, DoRAFP8Conv2d) and isinstance(inner.lin, DoRAFP8Linear)
    for n in ("conv", "lin"):
        base = getattr(inner, n).get_base_layer()
        assert base.scale.item() == 1.0 and torch.equal(base.weight.view(torch.uint8), w8[n])
        assert base.bias.dtype == torch.float32 and base.orig_dtype == torch.float32
    ref_sd = ref.state_dict()
    for k, v in ours.state_dict().items():
        if "lora_magnitude_vector" in k:
            assert_close(v, ref_sd[k], 5e-7, k)
    _randomize_lora_B(ours)
    _copy_adapters(ours, ref)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(4, 3, 6, 6, generator=g), torch.randn(4, 5, generator=g)) for _ in range(3)]
    l_ours, l_ref = _sgd_steps(ours, batches, _net_forward), _sgd_steps(ref, batches, _net_forward)
    assert l_ours == pytest.approx(l_ref, rel=1e-5), (l_ours, l_ref)
    with torch.no_grad():
        assert_close(ours(X), ref(X), 5e-6, "output after training")


@pytest.mark.parametrize("entry", ENTRIES[:2] + ["inject_adapter_in_model"])
def test_fp8_cast_adapter_and_bias_dtypes(entry):
    """A plain cast keeps no record of the original precision. With the bias left in bf16 (casting `.weight` only)
    the layer computes in bf16, and the adapters get PEFT's dtypes on the bf16 original; with the bias cast to fp8
    too, nothing tells, and dorafp8 uses float32 (the bias converted exactly; PEFT's default gives fp32 adapters
    anyway). Through get_peft_model or quantize_model first, alike."""
    cfg = LoraConfig(r=2, lora_alpha=2, use_dora=True, target_modules=["conv", "lin"])
    peft_model = _add_dora(_net(torch.bfloat16), entry, copy.deepcopy(cfg))
    want = _adapter_dtypes(peft_model)
    assert _base_bias_dtypes(peft_model) == {"conv": torch.bfloat16, "lin": torch.bfloat16}
    for quantize_first in (False, True):
        for bias_too in (False, True):
            net = _cast_weights(_net(torch.bfloat16), bias_too=bias_too)
            if quantize_first:
                assert n_fp8(dorafp8.quantize_model(net, ["conv", "lin"])) == 2
            ours = _add_dora(net, entry, copy.deepcopy(cfg))
            dtype = torch.float32 if bias_too else torch.bfloat16
            assert _base_bias_dtypes(ours) == {"conv": dtype, "lin": dtype}
            if not bias_too:
                assert _adapter_dtypes(ours) == want
            else:
                assert set(_adapter_dtypes(ours).values()) == {torch.float32}
            with torch.autocast("cpu", dtype=torch.bfloat16):
                ours(X.to(torch.bfloat16)).float().square().mean().backward()
            assert all(p.grad is not None for p in ours.parameters() if p.requires_grad)


def test_plain_lora_on_fp8_cast_layers_is_left_to_peft():
    """Only DoRA is taken over: PEFT's plain LoRA on such a layer keeps PEFT's own layer (and behaviour)."""
    pm = get_peft_model(_cast_weights(_net()), LoraConfig(r=2, target_modules=["conv", "lin"]))
    inner = pm.base_model.model
    assert type(inner.lin).__module__.startswith("peft.") and isinstance(inner.lin.get_base_layer(), nn.Linear)
    assert isinstance(inner.conv.get_base_layer(), nn.Conv2d)


def test_errors_name_the_fix():
    """Where the fp8 layer cannot be taken as it is, the error says why and names dorafp8.quantize_model."""
    e5m2 = _net()
    e5m2.lin.weight.data = e5m2.lin.weight.data.to(torch.float8_e5m2)
    msg = r"weight of '.*lin' is torch.float8_e5m2.*would move its values.*dorafp8.quantize_model"
    with pytest.raises(TypeError, match=msg):
        get_peft_model(copy.deepcopy(e5m2), LoraConfig(r=2, use_dora=True, target_modules=["lin"]))
    with pytest.raises(TypeError, match=msg):
        dorafp8.quantize_model(e5m2)
    # an fp8 layer already inside another adapter layer (PEFT's mixed adapters): swapping its base is not ours to do
    mixed = get_peft_model(_cast_weights(_net()), LoHaConfig(r=2, target_modules=["lin"]), mixed=True)
    with pytest.raises(ValueError, match=r"'.*lin' is a Linear with a torch.float8_e4m3fn weight inside the adapter "
                                         r"layer peft.tuners.loha.layer.Linear.*dorafp8.quantize_model\(model\).*"
                                         r"before adding the first adapter"):
        mixed.add_adapter("dora", LoraConfig(r=2, use_dora=True, target_modules=["lin"]))


class _TwoAttentions(nn.Module):
    """nn.MultiheadAttention (reads out_proj.weight itself) beside an attention that calls its out_proj layer."""

    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)
        self.out_proj = nn.Linear(16, 16)  # called as a layer: quantized like any other
        self.fc = nn.Linear(16, 8)

    def forward(self, x):
        return self.fc(self.out_proj(self.mha(x, x, x)[0]))


def test_quantize_model_leaves_multihead_attention_out_proj_dense():
    """quantize_model swapped nn.MultiheadAttention's out_proj (an nn.Linear subclass whose weight MHA's forward reads
    directly) and the forward failed: 'self and mat2 must have the same dtype ... Float8_e4m3fn' (issue 41, item 3)."""
    torch.manual_seed(0)
    model = _TwoAttentions()
    dense = copy.deepcopy(model)
    with pytest.warns(UserWarning, match=r"left 1 layers dense \(e.g. 'mha.out_proj'\).*out_proj of an nn.Multi"):
        dorafp8.quantize_model(model)  # said without target_modules too (it was silent before issue 49)
    assert type(model.mha.out_proj) is type(dense.mha.out_proj)  # noqa: E721 (exactly MHA's own class)
    assert isinstance(model.out_proj, FP8Linear) and isinstance(model.fc, FP8Linear)
    for name in ("out_proj", "fc"):  # the dense twin: the same layers with their fp8 weights dequantized
        getattr(dense, name).weight.data = getattr(model, name).dequantize()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        assert_close(model(x), dense(x), 1e-5, "model with MHA after quantize_model")
    pm = get_peft_model(model, LoraConfig(r=4, use_dora=True, target_modules=["out_proj", "fc"]))
    pm(x).square().mean().backward()  # the top-level out_proj and fc take dorafp8's DoRA; MHA's stays PEFT's
    assert isinstance(pm.base_model.model.fc, DoRAFP8Linear)

    with pytest.warns(UserWarning, match="out_proj of an nn.MultiheadAttention"):
        kept = _TwoAttentions()
        dorafp8.quantize_model(kept, ["mha.out_proj"])
    assert isinstance(kept.mha.out_proj.weight, nn.Parameter) and kept.mha.out_proj.weight.dtype == torch.float32
