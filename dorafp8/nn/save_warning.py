"""A warning where a library's own save_pretrained would write a model's fp8 layers without their scales.

With DORAFP8_NO_PATCHES=1 (or where save_hooks.py failed), their save_pretrained writes scales under keys their
from_pretrained ignores: a silently wrong reload. Neither library is imported here."""

from __future__ import annotations

import warnings

from torch import nn

# the classes whose save_pretrained dorafp8 wraps: (module, class name) -> library
_LIBRARY_MODELS = {("transformers.modeling_utils", "PreTrainedModel"): "transformers",
                   ("diffusers.models.modeling_utils", "ModelMixin"): "diffusers"}
_FIX = {"transformers": "dorafp8.save_fp8_checkpoint(model, path, format='compressed-tensors'), which "
                        "from_pretrained reads, or dorafp8.export_merged",
        "diffusers": "dorafp8.save_fp8_checkpoint(model, path) (load it back with dorafp8.load_fp8_checkpoint) or "
                     "dorafp8.export_merged(model, path, format='bf16'), which diffusers reads"}


def warn_if_save_pretrained_loses_scales(model: nn.Module) -> None:
    """Warns if `model` is a transformers / diffusers model whose save_pretrained is not dorafp8's."""
    cls = type(model)
    library = next((lib for c in cls.__mro__ for (mod, name), lib in _LIBRARY_MODELS.items()
                    if c.__module__ == mod and c.__name__ == name), None)
    if library is None or getattr(getattr(cls, "save_pretrained", None), "_dorafp8", False):
        return
    warnings.warn(f"{cls.__name__}.save_pretrained is {library}'s own, not dorafp8's (DORAFP8_NO_PATCHES=1, or its "
                  f"hook failed): of this model, whose layers are now fp8, it would write the raw e4m3 weights, "
                  f"which from_pretrained loads without their scales, silently wrong. Save it with {_FIX[library]}; "
                  f"or import dorafp8 without DORAFP8_NO_PATCHES=1", UserWarning, stacklevel=3)
