"""LyCORIS (lycoris-lora) on dorafp8's fp8 layers (dorafp8/lycoris.py): create_lycoris on a quantized model builds
LyCORIS's own LoCon / DoRA modules, computed by dorafp8's fused ops, that agree with LyCORIS itself on the dequantized
dense base: the same init, outputs and gradients within the fp32 rounding LyCORIS's own fp32 run shows against an fp64
run, the same losses over optimizer steps, the same state_dict and file keys, files that load either way."""

import copy
import sys

import pytest
import torch
from torch import nn

import dorafp8
from dorafp8 import FP8Conv2d, FP8Linear
from tests._tolerance import tol, within

# dorafp8.lycoris is not imported here: importing it registers by itself, and the first test checks that `import
# dorafp8` did (the post-import hook of dorafp8/_install.py, which ran when lycoris was imported after dorafp8).
lycoris = pytest.importorskip("lycoris")

from lycoris import create_lycoris, create_lycoris_from_weights  # noqa: E402


def test_import_dorafp8_registers_with_lycoris():
    """`import dorafp8` then `import lycoris`, and nothing else: LyCORIS's network and module constructors are
    wrapped, so create_lycoris on an fp8 model builds dorafp8's modules (the other import order: docs/DIFFUSION.md)."""
    from lycoris.modules.base import LycorisBaseModule
    from lycoris.modules.locon import LoConModule
    from lycoris.wrapper import LycorisNetwork

    for cls in (LycorisNetwork, LoConModule, LycorisBaseModule):
        assert getattr(cls.__init__, "_dorafp8_orig", None) is not None, cls
    q = nn.Sequential(nn.Linear(4, 6))
    dorafp8.quantize_model(q)
    net = create_lycoris(q, 1.0, linear_dim=2, algo="locon", dora_wd=True)
    assert [type(m).__name__ for m in net.loras] == ["FP8LoConModule"]


class Tiny(nn.Module):
    """A strided 3x3 conv, a 1x1 conv and a linear (a UNet's resnet and attention layers), odd sizes, no
    normalization (so that every adapter gradient is meaningful, not rounding noise in a normalized-away direction)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(6, 10, 3, stride=2, padding=1)
        self.mix = nn.Conv2d(10, 10, 1, bias=False)
        self.proj = nn.Linear(10, 12)

    def forward(self, x):
        h = self.mix(torch.nn.functional.silu(self.conv(x)))
        return self.proj(h.permute(0, 2, 3, 1))


def _fp8_and_dense(model, **quant):
    """(the model quantized by dorafp8, the same model with every quantized weight replaced by its dequantized
    value): LyCORIS on the second is the reference."""
    q = copy.deepcopy(model)
    dorafp8.quantize_model(q, include_conv=True, **quant)
    fp8 = {n: m for n, m in q.named_modules() if isinstance(m, (FP8Linear, FP8Conv2d))}
    dense = copy.deepcopy(model)
    for n, m in dense.named_modules():
        if n in fp8:
            m.weight.data = fp8[n].dequantize(torch.float32)
    assert fp8
    return q, dense


def _networks(models, multiplier, **kw):
    """One LyCORIS network per model, each built from the same seed (create_lycoris draws the adapters' init)."""
    nets = []
    for m in models:
        torch.manual_seed(11)
        net = create_lycoris(m, multiplier, linear_dim=3, linear_alpha=2, **kw)
        net.apply_to()
        nets.append(net)
    return nets


def _perturb(*nets):
    """lora_up is zero and dora_scale the base's norm at init: give every trainable tensor other values (the same in
    each network) so that every term of the DoRA math and its gradients is exercised."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for tensors in zip(*(n.named_parameters() for n in nets)):
            name, p = tensors[0]
            scale = p.abs().mean() if "dora_scale" in name else 0.2
            v = p + scale * 0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
            for _, t in tensors:
                t.copy_(v)


VARIANTS = {
    # LyCORIS's default axis (wd_on_output=True), rank dropout in training, per-tensor scales
    "dora_out": (dict(algo="locon", dora_wd=True, rank_dropout=0.25, rank_dropout_scale=True), {}, 1.0),
    # the input axis, per-output-channel scales, a multiplier that blends the DoRA scale
    "dora_in": (dict(algo="locon", dora_wd=True, wd_on_output=False), dict(per_row_scale=True), 0.6),
    # Tucker (lora_mid) on the 3x3 conv, a trainable scalar, rsLoRA, 4 x 4 block scales
    "dora_tucker": (dict(algo="locon", dora_wd=True, use_tucker=True, use_scalar=True, rs_lora=True),
                    dict(block_size=4), 1.3),
    # plain LoRA / LoCon, with module dropout (_run's seed drops the middle one of the three modules)
    "lora": (dict(algo="lora", module_dropout=0.3), {}, 0.5),
    # bypass mode: LyCORIS's own forward (the fp8 layer, plus the low-rank path on x)
    "bypass": (dict(algo="locon", bypass_mode=True), dict(per_row_scale=True), 1.0),
}


def _run(model, net, x, target, dtype):
    torch.manual_seed(5)  # the dropout draws LyCORIS makes in the forward: the same in every run
    y = model(x.to(dtype))
    ((y - target.to(dtype)).square().mean()).backward()
    return y.detach().double(), {k: None if p.grad is None else p.grad.double() for k, p in net.named_parameters()}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_outputs_and_gradients_match_lycoris_on_the_dequantized_base(variant):
    kw, quant, multiplier = VARIANTS[variant]
    torch.manual_seed(0)
    model = Tiny()
    q, dense = _fp8_and_dense(model, **quant)
    dense64 = copy.deepcopy(dense).double()
    n_q, n_d, n_64 = _networks((q, dense, dense64), multiplier, **kw)
    assert len(n_q.loras) == len(n_d.loras) == 3
    assert all(type(m).__name__ == "FP8LoConModule" for m in n_q.loras)
    assert all(type(m).__name__ == "LoConModule" for m in n_d.loras)
    sd_q, sd_d = n_q.state_dict(), n_d.state_dict()
    assert list(sd_q) == list(sd_d)  # LyCORIS's own keys, in its order
    for k in sd_q:  # the same init from the same seed (dora_scale: the norm of the same dequantized weight)
        assert torch.equal(sd_q[k], sd_d[k]), k
    _perturb(n_q, n_d, n_64)
    n_64.double()
    for net in (n_q, n_d, n_64):
        net.train()
    g = torch.Generator().manual_seed(1)
    x, target = torch.randn(3, 6, 9, 7, generator=g), torch.randn(3, 5, 4, 12, generator=g)

    y_q, g_q = _run(q, n_q, x, target, torch.float32)
    y_d, g_d = _run(dense, n_d, x, target, torch.float32)
    y_64, g_64 = _run(dense64, n_64, x, target, torch.float64)
    # fp32 against the fp64 truth: dorafp8's error is of the size of LyCORIS's own fp32 error
    err = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert err(y_q, y_64) <= 4 * err(y_d, y_64) + 1e-7, (err(y_q, y_64), err(y_d, y_64))
    assert set(g_q) == set(g_64)
    assert sum(g is None for g in g_64.values()) == (2 if variant == "lora" else 0)  # `mix` dropped: no gradient
    for k, truth in g_64.items():
        if truth is None:
            assert g_q[k] is None and g_d[k] is None, k
            continue
        assert truth.norm() > 0, k
        e_q, e_d = err(g_q[k], truth), err(g_d[k], truth)
        assert e_q <= 4 * e_d + 1e-6, (k, e_q, e_d)

    # a few optimizer steps: the same losses
    n_q.eval(), n_d.eval()  # no dropout: the comparison is of the updates
    losses = {}
    for key, m, net in (("q", q, n_q), ("d", dense, n_d)):
        opt = torch.optim.AdamW(net.prepare_optimizer_params(1e-2))
        losses[key] = []
        for _ in range(4):
            loss = (m(x) - target).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[key].append(loss.item())
    assert losses["q"] == pytest.approx(losses["d"], rel=1e-5)
    assert losses["q"][-1] < losses["q"][0]


@pytest.mark.parametrize("wd_on_output", [True, False])
@pytest.mark.parametrize("kind", ["nvfp4", "mxfp8"])
def test_dora_on_nvfp4_and_mxfp8_linears_matches_lycoris_on_the_dequantized_base(kind, wd_on_output):
    """LyCORIS DoRA on microscaled FP8Linears (NVFP4 with its global scale, MXFP8): building the network, the output
    and every gradient (the norm's too) as LyCORIS's on the dequantized weights, against fp64. NVFP4 failed on the
    first read of the weight (a packed uint8 weight taken for e4m3), then on the missing global scale."""
    from dorafp8.quant import quantize_mxfp8, quantize_nvfp4

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.SiLU(), nn.Linear(48, 16))
    q, dense = copy.deepcopy(model), copy.deepcopy(model)
    for i in (0, 2):
        w, b = model[i].weight.data, model[i].bias.data
        if kind == "nvfp4":
            w8, scale, g = quantize_nvfp4(w)
            q[i] = FP8Linear.from_fp8(w8, scale, bias=b, global_scale=g)
        else:
            w8, scale = quantize_mxfp8(w)
            q[i] = FP8Linear.from_fp8(w8, scale, bias=b)
        dense[i].weight.data = q[i].dequantize(torch.float32)
    dense64 = copy.deepcopy(dense).double()
    nets = _networks((q, dense, dense64), 1.0, algo="locon", dora_wd=True, wd_on_output=wd_on_output)
    assert [type(m).__name__ for m in nets[0].loras] == ["FP8LoConModule"] * 2
    _perturb(*nets)
    nets[2].double()
    x, target = torch.randn(5, 32), torch.randn(5, 16)
    (y_q, g_q), (y_d, g_d), (y_64, g_64) = (_run(m, n, x, target, dt) for m, n, dt in (
        (q, nets[0], torch.float32), (dense, nets[1], torch.float32), (dense64, nets[2], torch.float64)))
    err = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert err(y_q, y_64) <= 4 * err(y_d, y_64) + 1e-7, (err(y_q, y_64), err(y_d, y_64))
    assert set(g_q) == set(g_64) and all(t is not None and t.norm() > 0 for t in g_64.values())
    for k, truth in g_64.items():
        assert err(g_q[k], truth) <= 4 * err(g_d[k], truth) + 1e-6, (k, err(g_q[k], truth), err(g_d[k], truth))


def test_unet_trains_and_saves_like_lycoris_on_the_dense_unet(tmp_path):
    """The issue's call on a diffusers UNet (SD's block types) with every Linear and Conv2d quantized:
    create_lycoris(unet, ..., algo="locon", dora_wd=True) puts a module on every layer it takes on the dense UNet;
    training gives the same losses; save_weights writes the same keys; the file loads with LyCORIS onto the dense UNet
    and onto a fresh fp8 UNet, each giving the trained model's outputs."""
    pytest.importorskip("diffusers")
    from safetensors.torch import load_file

    from tests.integration.doc_fixtures import tiny_unet, unet_batch

    q, dense = _fp8_and_dense(tiny_unet())
    n_q, n_d = _networks((q, dense), 1.0, algo="locon", dora_wd=True)
    n_layers = sum(isinstance(m, (nn.Linear, nn.Conv2d)) for m in tiny_unet().modules())
    assert len(n_q.loras) == len(n_d.loras) == n_layers == 83  # every Linear and Conv2d, as on the dense UNet
    assert all(type(m).__name__ == "FP8LoConModule" for m in n_q.loras)
    with torch.no_grad():  # lora_up = 0 at init: start from a trained-looking adapter
        g = torch.Generator().manual_seed(2)
        for (k, a), b in zip(n_q.named_parameters(), n_d.parameters()):
            if "lora_up" in k:
                a.copy_(0.05 * torch.randn(a.shape, generator=g))
                b.copy_(a)
    losses = {"q": [], "d": []}
    batches = [unet_batch(seed=i) for i in range(2)]
    for key, m, net in (("q", q, n_q), ("d", dense, n_d)):
        opt = torch.optim.AdamW(net.prepare_optimizer_params(1e-3))
        for latents, timesteps, text, noise in batches:
            loss = (m(latents, timesteps, text).sample - noise).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[key].append(loss.item())
    assert losses["q"] == pytest.approx(losses["d"], rel=1e-5)

    files = {k: tmp_path / f"{k}.safetensors" for k in ("q", "d")}
    n_q.save_weights(str(files["q"]), None, None)
    n_d.save_weights(str(files["d"]), None, None)
    saved_q, saved_d = load_file(files["q"]), load_file(files["d"])
    assert list(saved_q) == list(saved_d) and len(saved_q) == 4 * n_layers
    assert all(saved_q[k].shape == saved_d[k].shape for k in saved_q)

    latents, timesteps, text, _ = unet_batch(seed=9)
    q.eval()
    with torch.no_grad():
        want = q(latents, timesteps, text).sample
        for fresh in _fp8_and_dense(tiny_unet()):
            net, _ = create_lycoris_from_weights(1.0, str(files["q"]), fresh)
            net.apply_to()
            assert len(net.loras) == n_layers
            got = fresh.eval()(latents, timesteps, text).sample
            within(((got - want).norm() / want.norm()).item(), tol(torch.float32), "LyCORIS file reloaded")


def test_what_does_not_run_on_fp8_layers_says_so():
    """Never train nothing silently: other algorithms on fp8 layers, merging into them and a network that makes no
    module on a model with fp8 layers each say what happened and what to do."""
    torch.manual_seed(0)
    q, _ = _fp8_and_dense(Tiny())
    with pytest.raises(NotImplementedError, match=r"LohaModule on the dorafp8 fp8 layer .*only LoCon / LoRA"):
        create_lycoris(q, 1.0, linear_dim=2, algo="loha")
    assert type(q.conv) is FP8Conv2d  # the layers took their own class back
    net = create_lycoris(q, 1.0, linear_dim=2, algo="locon", dora_wd=True)
    net.apply_to()
    with pytest.raises(NotImplementedError, match="re-quantize the merged weight"):
        net.merge_to(1.0)
    second = create_lycoris(q, 1.0, linear_dim=2, algo="locon")
    with pytest.raises(NotImplementedError, match="a second LyCORIS network on the fp8 layer"):
        second.apply_to()
    with pytest.warns(RuntimeWarning, match="LyCORIS created no module, and the model holds 3 dorafp8 fp8 layers"):
        create_lycoris(copy.deepcopy(q), 1.0, linear_dim=0, conv_dim=0, algo="locon")
    grouped = nn.Sequential(nn.Conv2d(4, 8, 3, groups=2))
    dorafp8.quantize_model(grouped, include_conv=True)
    with pytest.raises(NotImplementedError, match="groups=2"):
        create_lycoris(grouped, 1.0, linear_dim=2, algo="locon")


def test_without_lycoris_the_name_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "lycoris", None)  # what an interpreter without lycoris-lora sees
    with pytest.raises(ImportError, match=r"pip install 'dorafp8\[lycoris\]' \(or pip install lycoris-lora\)"):
        dorafp8.register_with_lycoris


KOHYA_ORDER = """
import sys, torch
from torch import nn
from lycoris import create_lycoris
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
if sys.argv[1] == "fp8":
    import dorafp8
    dorafp8.quantize_model(net)
lyc = create_lycoris(net, 1.0, linear_dim=4, linear_alpha=4, algo="locon", dora_wd=True)
lyc.apply_to()
for _ in range(3):
    net(torch.randn(2, 32)).sum().backward()
"""


@pytest.mark.parametrize("base", ["dense", "fp8"])
def test_launcher_report_names_lycoris_modules_that_ran_lycoris_own_forward(tmp_path, base):
    """kohya's train_network.py builds its own UNet (no from_pretrained for --quantize to reach) and its --fp8_base
    casts it after LyCORIS built its modules: under `dorafp8 run` no module is on a dorafp8 layer, and the run said
    nothing at exit, as if dorafp8 had trained it. The report counts LyCORIS's own forwards (2 modules here); on
    dorafp8's fp8 layers, the fused ones only."""
    import subprocess

    (tmp_path / "train.py").write_text(KOHYA_ORDER)
    out = subprocess.run([sys.executable, "-m", "dorafp8", "run", "--", "python", "train.py", base], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = [line for line in out.stderr.splitlines() if line.startswith("dorafp8 run:")]
    if base == "dense":
        assert report == ["dorafp8 run: 0 layers put in fp8 on load; 0 dorafp8 DoRA/LoRA layers ran 0 forward calls; "
                          "2 LyCORIS / OneTrainer adapter layers ran their own forward, not dorafp8's (not on a "
                          "dorafp8 fp8 layer)"], out.stderr[-3000:]
    else:
        assert report == ["dorafp8 run: 0 layers put in fp8 on load; 2 dorafp8 DoRA/LoRA layers ran 6 forward "
                          "calls"], out.stderr[-3000:]
