"""Every diffusers family dorafp8 names (UNet2DCondition, SD3, Flux, Wan, HunyuanVideo, LTX), as tiny models: they
run after quantize_model and after loading a ComfyUI fp8_scaled file in place (issue 53). Wan casts the timestep to
its time embedder's weight dtype: those layers (the model's `_keep_in_fp32_modules`) stay in their precision."""

import pytest
import torch
from torch import nn

pytest.importorskip("diffusers")

import dorafp8  # noqa: E402
from dorafp8 import FP8Linear  # noqa: E402
from tests.checkpoint._ckpt_fixtures import comfy_state_dict  # noqa: E402
from tests.integration import _tiny_diffusers as tiny  # noqa: E402


def _linear_weights(model):
    return {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def _close_to(out, ref):
    """fp8 weights move the output: within a few percent of its range, and finite."""
    assert torch.isfinite(out).all()
    assert (out - ref).abs().max() <= 0.15 * ref.abs().max(), (out - ref).abs().max()


@pytest.mark.parametrize("family", list(tiny.FAMILIES))
def test_runs_after_quantize_model(family):
    """Before: Wan's forward raised `TypeError: x must be float32...` (the timestep cast to e4m3)."""
    model, x = tiny.build(family)
    with torch.no_grad():
        ref = tiny.output(model, x)
        dorafp8.quantize_model(model, include_conv=True, verbose=False)
        out = tiny.output(model, x)
    _close_to(out, ref)
    kept = dorafp8.nn.convert.kept_in_precision(model)
    n_fp8 = sum(isinstance(m, FP8Linear) for m in model.modules())
    assert n_fp8 >= 6
    for name in kept:
        assert not isinstance(model.get_submodule(name), FP8Linear), name
    if family == "wan":
        assert {"condition_embedder.time_embedder.linear_1", "condition_embedder.time_embedder.linear_2"} <= kept


@pytest.mark.parametrize("family", list(tiny.FAMILIES))
def test_runs_after_loading_a_comfy_file_in_place(family):
    """Every linear weight of the file is fp8 with a scale_weight (the time embedder's too): the layers the model
    keeps in precision are dequantized into it, the others keep their bytes; the output is the dequantized model's."""
    model, x = tiny.build(family)
    sd = comfy_state_dict(model, layer_filter=_linear_weights(model).__contains__)
    deq = {k[len("model.diffusion_model."):]: (v.float() * sd[k[:-len("weight")] + "scale_weight"]
                                               if v.dtype == torch.float8_e4m3fn and v.dim() == 2 else v)
           for k, v in sd.items() if not k.endswith(("scale_weight", "scaled_fp8"))}
    ref_model, _ = tiny.build(family)
    ref_model.load_state_dict(deq)
    dorafp8.load_fp8_checkpoint(model, sd, verbose=False)
    kept = dorafp8.nn.convert.kept_in_precision(model)
    for name, m in model.named_modules():
        if f"{name}.weight" in _linear_weights(ref_model):
            assert isinstance(m, FP8Linear) != (name in kept), name
    with torch.no_grad():
        out, ref = tiny.output(model, x), tiny.output(ref_model, x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
