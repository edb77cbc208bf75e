"""Key names of kohya / LyCORIS files: which module a key prefix like `lora_unet_down_blocks_0_..._to_q` names.

A kohya key prefix is `{prefix}_{module name with '.' -> '_'}`; `sgm_unet_names` maps a diffusers UNet's names to the
original (SGM / LDM) ones kohya's sd-scripts uses for SDXL. Which prefix and module names ComfyUI, diffusers and
LyCORIS each map, read from their source: docs/ARCHITECTURE.md, "dorafp8/checkpoint/kohya_names.py"."""

from __future__ import annotations

import re
from collections import Counter
from typing import Optional

from torch import nn

# The prefix a file gets by default, by the model's class: kohya's for UNets, OneTrainer's for SD3 / Flux
# transformers (the ones ComfyUI and diffusers map for these models' diffusers names). Other models: module names.
AUTO_PREFIX = {"UNet2DConditionModel": "lora_unet", "SD3Transformer2DModel": "lora_transformer",
               "FluxTransformer2DModel": "lora_transformer"}
# What load_kohya_dora recognizes with prefix="auto": those, and LyCORIS's own (`lycoris_`, also SimpleTuner's).
KNOWN_PREFIXES = ("lora_unet", "lora_transformer", "lycoris")
NAME_KINDS = ("auto", "diffusers", "sgm")
_RESNET = {"conv1": "in_layers.2", "time_emb_proj": "emb_layers.1", "conv2": "out_layers.3",
           "conv_shortcut": "skip_connection"}  # comfy/utils.py UNET_MAP_RESNET
_BASIC = {"conv_in": "input_blocks.0.0", "conv_out": "out.2", "time_embedding.linear_1": "time_embed.0",
          "time_embedding.linear_2": "time_embed.2", "add_embedding.linear_1": "label_emb.0.0",
          "add_embedding.linear_2": "label_emb.0.2", "class_embedding.linear_1": "label_emb.0.0",
          "class_embedding.linear_2": "label_emb.0.2"}  # comfy/utils.py UNET_MAP_BASIC


def resolve_prefix(prefix, root: nn.Module) -> Optional[str]:
    """The key prefix `prefix` ("auto", None or a prefix) stands for on the model `root`."""
    if prefix == "auto":
        return AUTO_PREFIX.get(type(root).__name__)
    if prefix is not None and not (isinstance(prefix, str) and re.fullmatch(r"[A-Za-z0-9_]*[A-Za-z0-9]", prefix)):
        raise ValueError(f"prefix must be 'auto', None or a key prefix of letters, digits and '_' (e.g. 'lora_unet'), "
                         f"got {prefix!r}")
    return prefix


def key_name(module_name: str, prefix: Optional[str]) -> str:
    """kohya's key prefix of a module: `{prefix}_{name with '.' -> '_'}`, or the name itself without a prefix."""
    return f"{prefix}_{module_name.replace('.', '_')}" if prefix else module_name


def sgm_unet_names(unet: nn.Module) -> dict[str, str]:
    """diffusers module name -> the SGM (original LDM) UNet's, for every module of a UNet2DConditionModel's ResNets,
    transformers, down- and upsamplers and embeddings (the layers a LoRA targets; norms have no LoRA key here)."""
    out = dict(_BASIC)

    def subtree(diff: str, sgm: str, module: nn.Module) -> None:
        for n, _ in module.named_modules():
            out[f"{diff}.{n}" if n else diff] = f"{sgm}.{n}" if n else sgm

    def resnet(diff: str, sgm: str) -> None:
        for a, b in _RESNET.items():
            out[f"{diff}.{a}"] = f"{sgm}.{b}"

    n = 1  # input_blocks.0 is conv_in
    for x, block in enumerate(unet.down_blocks):
        attentions = getattr(block, "attentions", None)
        for i in range(len(block.resnets)):
            resnet(f"down_blocks.{x}.resnets.{i}", f"input_blocks.{n}.0")
            if attentions is not None:
                subtree(f"down_blocks.{x}.attentions.{i}", f"input_blocks.{n}.1", attentions[i])
            n += 1
        if getattr(block, "downsamplers", None) is not None:
            out[f"down_blocks.{x}.downsamplers.0.conv"] = f"input_blocks.{n}.0.op"
            n += 1
    mid = unet.mid_block
    if mid is not None:
        for i, j in enumerate((0, 2)[: len(mid.resnets)]):
            resnet(f"mid_block.resnets.{i}", f"middle_block.{j}")
        for i, att in enumerate(getattr(mid, "attentions", None) or []):
            subtree(f"mid_block.attentions.{i}", "middle_block.1", att)
    n = 0
    for x, block in enumerate(unet.up_blocks):
        attentions = getattr(block, "attentions", None)
        for i in range(len(block.resnets)):
            resnet(f"up_blocks.{x}.resnets.{i}", f"output_blocks.{n}.0")
            if attentions is not None:
                subtree(f"up_blocks.{x}.attentions.{i}", f"output_blocks.{n}.1", attentions[i])
            if i == len(block.resnets) - 1 and getattr(block, "upsamplers", None) is not None:
                out[f"up_blocks.{x}.upsamplers.0.conv"] = f"output_blocks.{n}.{2 if attentions is not None else 1}.conv"
            n += 1
    return out


def is_sdxl_unet(root: nn.Module) -> bool:
    """An SDXL-style UNet2DConditionModel (its added "text_time" conditioning), which kohya's scripts name as SGM."""
    return type(root).__name__ == "UNet2DConditionModel" and \
        getattr(getattr(root, "config", None), "addition_embed_type", None) == "text_time"


def export_key_names(root: nn.Module, modules: list, prefix: Optional[str], names: str) -> dict[str, str]:
    """{module name: key prefix} for the modules a file will hold, checked: no two the same. names="auto" is what
    kohya's scripts write: SGM names for an SDXL UNet under `lora_unet`, the model's own names otherwise."""
    if names not in NAME_KINDS:
        raise ValueError(f"names must be one of {NAME_KINDS}, got {names!r}")
    if names == "auto":
        names = "sgm" if prefix == "lora_unet" and is_sdxl_unet(root) else "diffusers"
    rename = {}
    if names == "sgm":
        if type(root).__name__ != "UNet2DConditionModel" or not prefix:
            raise ValueError(f"names='sgm' (kohya's SDXL UNet names) is for a diffusers UNet2DConditionModel with a "
                             f"prefix ('lora_unet'); this model is a {type(root).__name__}, prefix {prefix!r}")
        rename = sgm_unet_names(root)
        missing = [m for m in modules if m not in rename]
        if missing:
            raise ValueError(f"names='sgm': no SGM UNet name for {missing}; pass names='diffusers'")
    out = {m: key_name(rename.get(m, m), prefix) for m in modules}
    dup = {k: [m for m in out if out[m] == k] for k, n in Counter(out.values()).items() if n > 1}
    if dup:
        raise ValueError(f"modules give the same key prefix: {dup}; pass prefix=None to write the module names as "
                         f"they are")
    return out


class KeyResolver:
    """The module a file's key prefix names among `targets` (module names): the name itself, or a known prefix + the
    name with '.' -> '_' (diffusers' names, and for a UNet2DConditionModel also kohya's SGM names)."""

    def __init__(self, root: nn.Module, targets, prefix):
        if prefix == "auto":
            self.prefixes = KNOWN_PREFIXES
        elif prefix is None:
            self.prefixes = ()
        else:
            self.prefixes = (resolve_prefix(prefix, root),)
        self.targets = set(targets)
        self.flat: dict[str, list] = {}
        for n in self.targets:
            self.flat.setdefault(n.replace(".", "_"), []).append(n)
        if type(root).__name__ == "UNet2DConditionModel":
            for diff, sgm in sgm_unet_names(root).items():
                if diff in self.targets:
                    self.flat.setdefault(sgm.replace(".", "_"), []).append(diff)

    def resolve(self, name: str) -> tuple[Optional[str], Optional[str]]:
        """(module name, None); (None, why) if `name` fits several modules; (None, None) if none."""
        if name in self.targets:
            return name, None
        for p in self.prefixes:
            if name.startswith(p + "_"):
                hits = sorted(set(self.flat.get(name[len(p) + 1:], [])))
                if len(hits) > 1:
                    return None, f"{name} matches several modules {hits}"
                if hits:
                    return hits[0], None
        return None, None
