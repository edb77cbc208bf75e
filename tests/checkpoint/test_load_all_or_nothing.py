"""load_fp8_checkpoint and from_transformers_fp8 are all or nothing: a failure injected in the middle (a layer swap, a
tensor written, the last shard read, the model's own initializer) or a checkpoint refused by a tensor in its last shard
leaves the model exactly as it was: the same module types, the same parameter and buffer objects in the same places
(meta ones included), the same state_dict bytes, no load report. The model then loads as if nothing had happened."""

import json
import os

import pytest
import torch
from torch import nn

import dorafp8
import dorafp8.checkpoint.load as L
from dorafp8 import FP8Conv2d, FP8Linear
from dorafp8.checkpoint import CheckpointFormatError

st = pytest.importorskip("safetensors.torch")


class Net(nn.Module):
    """Linear and conv layers, a norm and a buffer, as a UNet block has them."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(4, 8, 3, padding=1)
        self.lin1 = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8, 5)
        self.register_buffer("offset", torch.zeros(5))

    def forward(self, x):
        h = torch.nn.functional.silu(self.conv1(x))
        h = self.norm(self.lin1(h.permute(0, 2, 3, 1))).permute(0, 3, 1, 2)
        h = torch.nn.functional.silu(self.conv2(h))
        return self.head(h.mean((2, 3))) + self.offset


X = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A dorafp8 checkpoint of a quantized Net in several shards, and the model it came from."""
    torch.manual_seed(0)
    net = Net().eval()
    with torch.no_grad():
        net.offset.normal_()
    dorafp8.quantize_model(net, include_conv=True, per_row_scale=True)
    path = tmp_path_factory.mktemp("ckpt") / "net"
    dorafp8.save_fp8_checkpoint(net, path, format="dorafp8", max_shard_size=400, verbose=False)
    assert len(_shards(path)) >= 3
    return path, net


def _shards(path):
    return sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))


def _target(kind):
    """The model to load into: built on the meta device, or with real (random) weights."""
    if kind == "meta":
        with torch.device("meta"):
            return Net()
    torch.manual_seed(1)
    return Net().eval()


def _snapshot(model):
    """Module types, the tensor objects by name (meta ones included), the state_dict's bytes, the attributes."""
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    sd = {k: (v.dtype, v.shape, v.device, None if v.is_meta else v.detach().clone())
          for k, v in model.state_dict().items()}
    return {n: type(m) for n, m in model.named_modules()}, tensors, sd, set(vars(model))


def _assert_unchanged(model, snap):
    types, tensors, sd, attrs = snap
    assert {n: type(m) for n, m in model.named_modules()} == types
    now = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    assert now.keys() == tensors.keys() and all(now[k] is t for k, t in tensors.items())
    now_sd = model.state_dict()
    assert now_sd.keys() == sd.keys()
    for k, (dtype, shape, device, data) in sd.items():
        v = now_sd[k]
        assert (v.dtype, v.shape, v.device) == (dtype, shape, device), k
        if data is not None:
            assert torch.equal(v.reshape(-1).view(torch.uint8), data.reshape(-1).view(torch.uint8)), k
    assert set(vars(model)) == attrs and not hasattr(model, "dorafp8_checkpoint")


def _fail_on_call(n, exc=None, real=None):
    """A function that calls `real` and raises `exc` (OSError("injected")) on its n-th call."""
    calls = [0]

    def fn(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            raise exc or OSError("injected")
        return real(*args, **kwargs)
    return fn


def _loads_fine_afterwards(model, path, net):
    """The model the failed load left behind loads as if nothing had happened."""
    dorafp8.load_fp8_checkpoint(model, path, verbose=False)
    assert isinstance(model.lin1, FP8Linear) and type(model.conv2) is FP8Conv2d
    with torch.no_grad():
        assert torch.equal(model.eval()(X), net(X))


@pytest.mark.parametrize("kind", ["meta", "real"])
@pytest.mark.parametrize("fault", ["third_swap", "tensor_write", "last_shard_read"])
def test_a_failure_in_the_middle_of_a_load_leaves_the_model_as_it_was(sharded, monkeypatch, kind, fault):
    path, net = sharded
    model = _target(kind)
    snap = _snapshot(model)
    if fault == "third_swap":  # called per fp8 layer, after every check
        monkeypatch.setattr(L, "swap_module", _fail_on_call(3, real=L.swap_module))
    elif fault == "tensor_write":  # called per tensor read: the 6th is in the middle of the load
        monkeypatch.setattr(L, "set_tensor", _fail_on_call(6, real=L.set_tensor))
    else:  # opened once per shard for its header, then once per shard for its data: the last one's data
        import safetensors

        monkeypatch.setattr(safetensors, "safe_open", _fail_on_call(2 * len(_shards(path)),
                                                                    real=safetensors.safe_open))
    with pytest.raises(OSError, match="injected"):
        dorafp8.load_fp8_checkpoint(model, path, verbose=False)
    _assert_unchanged(model, snap)
    monkeypatch.undo()
    _loads_fine_afterwards(model, path, net)


def _with_tensor_in_last_shard(src, dst, key, tensor):
    """A copy of the sharded checkpoint `src` with `key` added to its last shard (and its index)."""
    dst.mkdir()
    for n in os.listdir(src):
        (dst / n).write_bytes((src / n).read_bytes())
    last = _shards(dst)[-1]
    tensors = st.load_file(dst / last)
    tensors[key] = tensor
    st.save_file(tensors, dst / last)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    index["weight_map"][key] = last
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


@pytest.mark.parametrize("kind", ["meta", "real"])
def test_a_bad_tensor_in_the_last_shard_is_refused_before_anything_changes(sharded, tmp_path, monkeypatch, kind):
    """A non-zero zero point (asymmetric quantization) of the last layer, in the last shard: its value refuses the
    load, and it is read and checked before the first layer is swapped or the first weight read."""
    path, _ = sharded
    bad = _with_tensor_in_last_shard(path, tmp_path / "bad", "head.weight_zero_point", torch.ones(1))
    model = _target(kind)
    snap = _snapshot(model)
    written = []
    monkeypatch.setattr(L, "set_tensor", lambda *a, **k: written.append(a[1]))
    with pytest.raises(CheckpointFormatError, match=r"head\.weight_zero_point: non-zero zero point"):
        dorafp8.load_fp8_checkpoint(model, bad, verbose=False)
    assert written == []
    _assert_unchanged(model, snap)


def test_a_tensor_nothing_can_compute_is_refused_before_any_data_is_read(sharded, monkeypatch):
    """A buffer left on the meta device that the checkpoint does not hold and no initializer computes: under strict,
    refused after reading the shards' headers only."""
    import safetensors

    path, _ = sharded
    model = _target("meta")
    model.norm.register_buffer("mask", torch.ones(8, device="meta"), persistent=False)
    snap = _snapshot(model)
    opened = []
    real_open = safetensors.safe_open
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: opened.append(a[0]) or real_open(*a, **k))
    with pytest.raises(CheckpointFormatError, match=r"left on the meta device .*: 'norm\.mask'"):
        dorafp8.load_fp8_checkpoint(model, path, verbose=False)
    assert len(opened) == len(_shards(path))  # each header once, no data
    _assert_unchanged(model, snap)


@pytest.mark.parametrize("how,fault", [("accelerate", "tensor_write"), ("meta", "init_weights")])
def test_a_failed_load_of_a_transformers_model_unties_and_leaves_it_as_it_was(tmp_path, monkeypatch, how, fault):
    """Tied embeddings (which the loader ties again first, for accelerate's untied meta models) and a rotary
    inv_freq computed by the model's own initializer (torch.device('meta') construction): a failure in the last of
    them puts back what the model had, ties included."""
    pytest.importorskip("accelerate")
    from tests.checkpoint import _ckpt_fixtures as F

    orig = F.original_model(tie_word_embeddings=True)
    dorafp8.quantize_model(orig, per_row_scale=True)
    path = tmp_path / "llama"
    dorafp8.save_fp8_checkpoint(orig, path, format="compressed-tensors", max_shard_size="40KB", verbose=False)
    cfg = F.llama_config(tie_word_embeddings=True)
    model = F.meta_model(cfg, how=how)
    snap = _snapshot(model)
    tied_before = model.lm_head.weight is model.model.embed_tokens.weight
    if fault == "tensor_write":
        monkeypatch.setattr(L, "set_tensor", _fail_on_call(20, real=L.set_tensor))
        err = (OSError, "injected")
    else:
        def init_weights(self, module):
            raise RuntimeError("initializer failed (injected)")

        monkeypatch.setattr(type(model.model), "_init_weights", init_weights)  # the rotary embedding's owner
        err = (RuntimeError, "_init_weights failed: initializer failed")
    with pytest.raises(err[0], match=err[1]):
        dorafp8.load_fp8_checkpoint(model, path, verbose=False)
    monkeypatch.undo()
    _assert_unchanged(model, snap)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied_before
    dorafp8.load_fp8_checkpoint(model, path, verbose=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids=ids).logits, orig(input_ids=ids).logits)


# ---- from_transformers_fp8 ---------------------------------------------------------------------------------------


def _transformers_fp8_model(blocks=((16, 16), (16, 16), (16, 16), (16, 16))):
    """A stack of transformers' fine-grained FP8Linear layers, filled as its quantizer would."""
    fg = pytest.importorskip("transformers.integrations.finegrained_fp8")
    g = torch.Generator().manual_seed(0)
    layers = []
    for b in blocks:
        lay = fg.FP8Linear(32, 32, block_size=b, has_bias=True)
        w8, scale = dorafp8.quantize_e4m3(torch.randn(32, 32, generator=g) * 0.05, block_size=b[0])
        lay.weight.data = w8
        lay.weight_scale_inv.data = scale if b[0] == b[1] else torch.ones(lay.weight_scale_inv.shape)
        lay.bias.data = torch.randn(32, generator=g) * 0.1
        layers.append(lay)
    return nn.Sequential(*layers).eval()


@pytest.mark.parametrize("fault", ["third_build", "third_swap", "bad_layer"])
def test_a_failure_in_the_middle_of_from_transformers_fp8_leaves_the_model_as_it_was(monkeypatch, fault):
    import dorafp8.checkpoint.from_transformers as T

    model = _transformers_fp8_model(((16, 16), (16, 16), (16, 32), (16, 16)) if fault == "bad_layer" else
                                    ((16, 16),) * 4)
    snap = _snapshot(model)
    if fault == "third_build":  # builds each layer's FP8Linear
        monkeypatch.setattr(T, "_make", _fail_on_call(3, RuntimeError("injected"), real=T._make))
        err = (RuntimeError, "injected")
    elif fault == "third_swap":
        monkeypatch.setattr(T, "swap_module", _fail_on_call(3, RuntimeError("injected"), real=T.swap_module))
        err = (RuntimeError, "injected")
    else:  # the third layer's blocks are not square
        err = (ValueError, r"^2: block size \[16, 32\] is not square")
    with pytest.raises(err[0], match=err[1]):
        dorafp8.from_transformers_fp8(model)
    _assert_unchanged(model, snap)
    if fault != "bad_layer":  # and then converts as if nothing had happened
        monkeypatch.undo()
        x = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
        want = x
        with torch.no_grad():
            for lay in model:
                w = lay.weight.float() * lay.weight_scale_inv.repeat_interleave(16, 0).repeat_interleave(16, 1)
                want = want @ w.T + lay.bias
        assert dorafp8.from_transformers_fp8(model) == 4
        assert all(type(m) is FP8Linear for m in model)
        with torch.no_grad():
            torch.testing.assert_close(model(x), want)


@pytest.mark.parametrize("kind", ["meta", "real"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0, 1e38])
def test_a_damaged_weight_scale_is_refused_and_leaves_the_model_as_it_was(sharded, tmp_path, kind, bad):
    """A NaN, infinite or negative scale would have loaded without a word and made its layer's outputs NaN (or
    flipped); so would 1e38, finite, but inf times 448 (e4m3's largest value): its row became inf. The load names
    the tensor and puts the model back."""
    path, _ = sharded
    dst = tmp_path / "damaged"
    dst.mkdir()
    for n in os.listdir(path):
        (dst / n).write_bytes((path / n).read_bytes())
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    key = next(k for k in index["weight_map"] if k.startswith("head.") and "scale" in k)
    shard = dst / index["weight_map"][key]
    tensors = st.load_file(shard)
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[-1] = bad
    st.save_file(tensors, shard)
    model = _target(kind)
    snap = _snapshot(model)
    with pytest.raises(CheckpointFormatError, match=rf"{key}: 1 of \d+ scale values are NaN, infinite or negative, "
                                                   rf"or overflow fp32 times 448"):
        dorafp8.load_fp8_checkpoint(model, dst, verbose=False)
    _assert_unchanged(model, snap)


@pytest.mark.parametrize("name", sorted(n for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                    "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, n)))
def test_all_finite_on_every_fp8_code(name):
    """dorafp8.quant.all_finite, the finiteness check of the loaders (isfinite has no float8 kernel on torch 2.14),
    against fp32's isfinite of each of the 256 codes converted to fp32, one code at a time and all together."""
    from dorafp8.quant import all_finite

    codes = torch.arange(256, dtype=torch.uint8).view(getattr(torch, name))
    want = torch.isfinite(codes.float())
    assert [all_finite(codes[i:i + 1]) for i in range(256)] == want.tolist()
    assert all_finite(codes[want]) and not all_finite(codes)
