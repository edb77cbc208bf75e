"""Layers whose weights are already fp8 without a scale (issue 24): diffusers' enable_layerwise_casting stores the
weights and biases of a model's Linear and Conv layers in fp8 and upcasts them around each forward; quantize_model
takes such layers losslessly, with the bias in the hook's compute dtype (docs/DORA_MATH.md, "Dtype policy")."""

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
peft = pytest.importorskip("peft")

import dorafp8  # noqa: E402
from _ref import assert_close  # noqa: E402
from test_diffusion import _batches, small_unet  # noqa: E402

E4M3 = torch.float8_e4m3fn


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
    assert dorafp8.quantize_model(lc, include_conv=True) == len(hooked) == 121  # the hooks are on every Linear/Conv2d
    for n in hooked:
        m = lc.get_submodule(n)
        assert m.scale.item() == 1.0 and torch.equal(m.weight.view(torch.uint8), w8[n]), n
        assert m.orig_dtype == dtype and layerwise_compute_dtype(m) is None, n
        if n in bias:
            assert m.bias.dtype == dtype and torch.equal(m.bias, bias[n]), n
    if before is not None:
        with torch.no_grad():
            assert_close(lc(**kw).sample, before, 1e-5, "output")
