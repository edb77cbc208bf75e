"""PEFT's LoRA layer interface across the releases dorafp8's layers support, 0.18 to 0.21: how a layer gets its options
(a LoraConfig from 0.19, keywords in 0.18), picks its variant (`lora_variants` from 0.20) and finds its in/out
features and adapter dtype. Read from each release's source; tests/peft/ pass with each (docs/TESTING.md)."""

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
    """The keyword arguments for PEFT's LoRA layer constructor: `config` (peft >= 0.19), or 0.18's options."""
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
