"""PEFT paths that used to end in a raw error once dorafp8 was imported: loading an adapter onto an fp8 base with
`low_cpu_mem_usage=True` (the adapters are made on the meta device), and PEFT's own exception for merging a plain
conv with groups > 1 (issue 41, items 4 and 6)."""

import pytest
import torch
from torch import nn

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

import dorafp8  # noqa: E402
from dorafp8 import DoRAFP8Conv2d, DoRAFP8Linear  # noqa: E402
from tests._tolerance import assert_close, tol  # noqa: E402


class Net(nn.Module):
    def __init__(self, groups=1):
        super().__init__()
        self.conv = nn.Conv2d(4, 8, 3, padding=1, groups=groups)
        self.fc = nn.Linear(8, 6)

    def forward(self, x):
        return self.fc(self.conv(x).mean((2, 3)))


def _fp8_net(seed=0):
    torch.manual_seed(seed)
    net = Net()
    dorafp8.quantize_model(net, include_conv=True)
    return net


@pytest.mark.parametrize("low_cpu_mem_usage", [False, True])
def test_adapter_loads_onto_an_fp8_base(tmp_path, low_cpu_mem_usage):
    """PeftModel.from_pretrained(..., low_cpu_mem_usage=True), the path 84 of PEFT's own DoRA tests take, failed with
    'lora_A is on meta but x is on cpu': the DoRA init computed the magnitude from meta adapters."""
    pm = get_peft_model(_fp8_net(), LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules=["conv", "fc"]))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    pm.save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(_fp8_net(), tmp_path, low_cpu_mem_usage=low_cpu_mem_usage)
    assert isinstance(loaded.base_model.model.fc, DoRAFP8Linear)
    assert isinstance(loaded.base_model.model.conv, DoRAFP8Conv2d)
    assert not any(p.is_meta for p in loaded.parameters())
    x = torch.randn(2, 4, 6, 6)
    with torch.no_grad():
        assert_close(loaded(x), pm(x), tol(torch.float32), "outputs of the loaded adapter")


def test_load_adapter_with_low_cpu_mem_usage_adds_a_second_adapter(tmp_path):
    pm = get_peft_model(_fp8_net(), LoraConfig(r=4, use_dora=True, target_modules=["fc"]))
    pm.save_pretrained(tmp_path)
    pm.load_adapter(tmp_path, adapter_name="other", low_cpu_mem_usage=True)
    pm.set_adapter("other")
    x = torch.randn(2, 4, 6, 6)
    with torch.no_grad():
        out = pm(x)
        pm.set_adapter("default")
        assert_close(out, pm(x), tol(torch.float32), "the same adapter loaded a second time")


@pytest.mark.filterwarnings("ignore:LoRA adapter added to ConvNd layer with groups > 1")
@pytest.mark.parametrize("op", ["merge_and_unload", "merge_adapter"])
def test_plain_peft_grouped_conv_keeps_peft_exception(op):
    """After `import dorafp8` a plain PEFT conv (no fp8) with groups > 1 must refuse to merge as PEFT does, with its
    NotImplementedError (code catches it); it raised dorafp8's ValueError. Nothing is merged."""
    torch.manual_seed(0)
    pm = get_peft_model(Net(groups=2), LoraConfig(r=4, target_modules=["conv", "fc"]))
    before = {k: v.clone() for k, v in pm.state_dict().items()}
    with pytest.raises(NotImplementedError, match="groups > 1"):
        getattr(pm, op)()
    assert not pm.base_model.model.fc.merged
    assert all(torch.equal(v, before[k]) for k, v in pm.state_dict().items())
