"""PEFT's LoRA layer interface across the releases dorafp8's layers support, 0.18 to 0.21 (LLaMA-Factory 0.9.5 pins
peft 0.18.x in its wheel and accepts up to 0.20 in its version check). Where they differ for what dorafp8 touches:

- how a layer gets its options: peft >= 0.19 passes the LoraConfig (`config=`) to the constructor and to
  `update_layer`; 0.18 passes each option separately (`lora_dropout=`, `use_dora=`, ...).
- how a layer picks its variant: peft >= 0.20 looks the requested options up in the layer's `lora_variants`; 0.18 and
  0.19 call each layer class's own `resolve_lora_variant`, which returns PEFT's DoRA variant (DoRAFP8Layer swaps it
  for its own).
- in/out features and the adapters' device and dtype: peft >= 0.19 asks the layer (`_get_in_out_features`,
  `_get_base_layer_device_and_dtype`); 0.18 reads them with functions that do not know the fp8 layers (it would cast
  new adapters to the base weight's dtype, e4m3).

Read from each release's own source (0.18.0 and 0.18.1 differ in none of these). tests/peft/test_peft.py and
test_conv.py pass with 0.18.1, 0.19.1, 0.20.0 and 0.21.2; CI runs them with 0.21 (README's venv) and test_peft.py with
the 0.18.1 LLaMA-Factory installs (.ci/llamafactory.sh, with LLaMA-Factory's own CLI; docs/TESTING.md).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings

from peft.tuners.lora import layer as lora_layer

# peft >= 0.19: options travel as the LoraConfig
CONFIG_API = "config" in inspect.signature(lora_layer.LoraLayer.update_layer).parameters
# peft >= 0.19: the layer says its in/out features and its adapters' device and dtype
LAYER_SAYS_DTYPE = hasattr(lora_layer.LoraLayer, "_get_base_layer_device_and_dtype")


def layer_kwargs(config, kwargs: dict) -> dict:
    """The keyword arguments for PEFT's LoRA layer constructor: `config` as it is (peft >= 0.19), or on peft 0.18 the
    options its LoraModel passes, taken from `config` where `kwargs` lacks them."""
    if CONFIG_API:
        return dict(kwargs, config=config)
    kwargs = dict(kwargs)
    if config is not None:
        for name in ("lora_dropout", "init_lora_weights", "use_rslora", "use_dora", "lora_bias", "arrow_config"):
            kwargs.setdefault(name, getattr(config, name, None))
    return kwargs


@contextlib.contextmanager
def quiet_layer_init():
    """peft 0.18's LoraLayer.__init__ warns "Unsupported layer type" for a layer its function does not list, the fp8
    ones included, whose features dorafp8's layers give themselves (DoRAFP8Layer.update_layer): that one is left out."""
    with warnings.catch_warnings():
        if not LAYER_SAYS_DTYPE:
            warnings.filterwarnings("ignore", message="Unsupported layer type", category=UserWarning)
        yield
