"""load_fp8_checkpoint: an fp8 checkpoint into a model's FP8Linear / FP8ConvNd layers, bytes as stored (re-quantized
only for musubi's 1 x g scales). All or nothing: planned and checked before any data is read (load_plan.py), then
filled one tensor at a time, a failure putting the model back (docs/ARCHITECTURE.md, "dorafp8/checkpoint/load.py")."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Callable, Optional

import torch
from torch import nn

from ..nn import FP8Linear, fp8_conv_class
from ..nn.group_scales import collect_regrouped, groups_to_rows, report_regrouped
from ..nn.save_warning import warn_if_save_pretrained_loses_scales
from ..quant import E4M3, E4M3_MAX, E8M0, check_micro_scale_values, check_scale, e4m3_nan, scale_kind
from .files import identity, parse_json, some
from .layouts import E5M2, CheckpointFormatError, granularity_name
from .modules import (FP8_CONV_TYPES, FP8_LAYER_TYPES, ModelState, model_dtype, model_tensors, set_tensor,
                      swap_module, tied_groups)
from .load_plan import plan_load, resolve_format
from .plan import LayerSource, LoadPlan, SourceInfo, fp32_bits
from .reports import LoadReport
from .source import CheckpointSource, config_block_size, layer_key

logger = logging.getLogger("dorafp8")

_PROGRESS_EVERY_S = 10.0  # a progress line at least this often while loading


def load_fp8_checkpoint(model: nn.Module, path_or_state_dict, format: str = "auto", *, device="cpu",
                        dtype: Optional[torch.dtype] = None, block_size: Optional[int] = None,
                        key_map: Optional[Callable[[str], Optional[str]]] = None, strict: bool = True,
                        backend: str = "auto", act_quant: Optional[str] = None,
                        verbose: bool = True) -> LoadReport:
    """Loads an fp8 checkpoint into `model`, in place: every linear layer whose checkpoint weight is float8_e4m3fn
    becomes an FP8Linear holding those bytes and their scale (fp32, exact); everything else is loaded into the model's
    own tensors, cast to their dtype. All or nothing: an error, whenever it comes, leaves the model as it was.

    Args:
        model: an nn.Module, typically built on the meta device (`with accelerate.init_empty_weights():
            AutoModelForCausalLM.from_config(cfg)`); its tensors are materialized on `device` as they are read.
        path_or_state_dict: a .safetensors file, a directory (sharded with model.safetensors.index.json, or not), or a
            dict of tensors; read one shard and one tensor at a time.
        format: "auto" (detected from the keys, dtypes and config.json) or one of LAYOUTS.
        device: where the loaded tensors go.
        dtype: the dtype of the tensors that are not fp8 (and of the adapters PEFT will create); default: the model's.
        block_size: the square block size of block scales; default: the one the file's metadata records (dorafp8's
            writers do), else config.json's, else 128 where the scales' shape fits it.
        key_map: maps a checkpoint key to the model's name for it (or None to skip it); default: a common prefix
            (ComfyUI's 'model.diffusion_model.', ...) is found and stripped.
        strict: model tensors the checkpoint lacks, or checkpoint tensors that fit nothing, are an error. False: they
            are reported; missing ones stay as they were (on the meta device: the model's _init_weights, if any).
        backend, act_quant: given to the FP8Linear layers (see FP8Linear).
        verbose: print the report (and a line per shard); it is always logged on the "dorafp8" logger.

    Returns:
        A LoadReport, also kept as `model.dorafp8_checkpoint` (save_fp8_checkpoint writes the same layout back).

    Raises:
        CheckpointFormatError (a ValueError): a format it cannot tell or read, keys or shapes that do not fit the
            model (strict), a file or config it does not accept; the message names what it saw and what to do.
        FileNotFoundError, OSError: a path or shard that cannot be read.
    """
    t0 = time.time()
    source = CheckpointSource(path_or_state_dict)
    fmt, evidence = resolve_format(source, format)
    cfg_block = config_block_size(source, fmt)
    mdtype = dtype or model_dtype(model)
    report = LoadReport(fmt, evidence, source.name, shards=len(source.shards))
    # The record holds the model's tensors by reference: free on a meta-device model; a model with real weights holds
    # its old tensors beside the loaded ones until the load has succeeded (what a failure puts back).
    before = ModelState(model)
    try:
        # accelerate's init_empty_weights re-creates parameters and so unties them (lm_head / embeddings): tied again
        # first, since the plan needs the tied names (the one change before the checks, undone on a failure too)
        tie = getattr(model, "tie_weights", None)
        if callable(tie):
            tie()
        model_t = model_tensors(model)
        tied = tied_groups(model)
        plan = plan_load(model, source, fmt, model_t, tied, report, key_map=key_map,
                         block_hint=block_size or cfg_block, strict=strict)
        new = _build_fp8_modules(model, plan, mdtype, dtype, backend, act_quant)
        first = _read_checked_first(plan, source, device, report)
        stuck = _stuck(model, _left_on_meta(_modules_after_swaps(model, new), _written(plan, tied)))
        if stuck and strict:
            raise _stuck_error(stuck)
        # ---- checked: from here on the model changes ----
        for mod_name, layer in new.items():
            swap_module(model, mod_name, layer)
        loader = _TensorLoader(model, plan, model_t, tied, report, dtype, mdtype, first)
        with collect_regrouped(source.name):  # one QuantizationWarning for the layers re-quantized from 1 x g scales
            loader.read(source, device, _Progress(source, report, t0, verbose))
        for k in plan.keys.marker_keys:
            report.kept[k] = "the scaled_fp8 marker"
        _materialize_leftovers(model, device, report, strict)
        info, keys = source.info, plan.keys
        source_info = SourceInfo(format=fmt, strip=keys.strip, add=keys.add, block_size=cfg_block,
                                 metadata=source.metadata, dtypes=loader.src_dtypes,
                                 markers={k: info[k] for k in keys.marker_keys}, config=source.config,
                                 kv_cache_quant_algo=_kv_cache_algo(source, fmt, report),
                                 files=tuple(filter(None, (identity(s) for s in source.shards if s))))
        if keys.marker_keys:
            source_info.marker_tensors = dict(source.read(keys.marker_keys, "cpu"))
        report.seconds = time.time() - t0
        with contextlib.suppress(AttributeError, TypeError):
            model.dorafp8_checkpoint = report
            model._dorafp8_source = source_info
    except BaseException:
        before.restore()
        raise
    warn_if_save_pretrained_loses_scales(model)
    logger.info(str(report))
    if verbose:
        print(str(report), flush=True)
    return report


def _kv_cache_algo(source, fmt: str, report: LoadReport) -> Optional[str]:
    """The source's ModelOpt kv_cache_quant_algo, which the modelopt writer writes back, where every KV-cache scale
    (k_scale / v_scale) of the source was kept: one dropped (strict=False, as beside a layer left dense) would be
    missing from the export, and vLLM would run its fp8 KV cache with scale 1.0 where the source had calibrated ones;
    without the algo it runs it in bf16, as computed."""
    if fmt != "modelopt" or any(k.endswith(("k_scale", "v_scale")) for k in report.unexpected):
        return None
    return source.modelopt_kv_cache_algo()


# ---- building and filling the layers ----------------------------------------------------------------------------


def _build_fp8_modules(model: nn.Module, plan: LoadPlan, mdtype: torch.dtype, dtype: Optional[torch.dtype],
                       backend: str, act_quant: Optional[str]) -> dict[str, nn.Module]:
    """module name -> its new FP8Linear / FP8ConvNd, built aside on the meta device; the model unchanged."""
    built = {}
    for mod_name, p in plan.layers.items():
        if not p.fp8:
            continue
        mod = p.module
        bias = getattr(mod, "bias", None)
        bias_dtype = bias.dtype if bias is not None and bias.dtype not in (E4M3, E5M2) else mdtype
        orig = getattr(mod, "orig_dtype", None) if isinstance(mod, FP8_LAYER_TYPES) else mod.weight.dtype
        if orig is None or orig in (E4M3, E5M2) or dtype is not None:
            orig = mdtype
        if p.conv:
            cls = type(mod) if isinstance(mod, FP8_CONV_TYPES) else fp8_conv_class(mod)
            new = cls(mod.in_channels, mod.out_channels, mod.kernel_size, mod.stride, mod.padding, mod.dilation,
                      mod.groups, bias is not None, mod.padding_mode, device="meta", dtype=orig,
                      block_size=p.block_size or None, backend=backend)
            n_out = mod.out_channels
        else:
            new = FP8Linear(mod.in_features, mod.out_features, bias=bias is not None, device="meta", dtype=orig,
                            block_size=p.block_size or None, backend=backend, act_quant=act_quant)
            if p.kind == "nvfp4":  # filled from the checkpoint's global scale (_TensorLoader._scale)
                new.global_scale = torch.empty((), dtype=torch.float32, device="meta")
            n_out = mod.out_features
        if bias is not None:
            new.bias = nn.Parameter(torch.empty(n_out, dtype=bias_dtype, device="meta"), requires_grad=False)
        new._dorafp8_source = LayerSource(plan.fmt)
        built[mod_name] = new
        p.module = new
    return built


class _Progress:
    """The lines a load prints (one per shard, one at least every _PROGRESS_EVERY_S s); counts report.bytes_read."""

    def __init__(self, source: CheckpointSource, report: LoadReport, t0: float, verbose: bool):
        self.shards, self.report, self.t0, self.verbose = source.shards, report, t0, verbose
        self.total = 0
        self.current, self.t_shard, self.n_in_shard, self.b_in_shard = None, time.time(), 0, 0
        self.last_note, self.n_done = time.time(), 0

    def _say(self, msg: str) -> None:
        logger.info(msg)
        if self.verbose:
            print(msg, flush=True)

    def tensor(self, shard: int, nbytes: int) -> None:
        if self.current is not None and shard != self.current:
            self.shard_done()
            self.t_shard, self.n_in_shard, self.b_in_shard = time.time(), 0, 0
        self.current = shard
        self.report.bytes_read += nbytes
        self.n_in_shard += 1
        self.n_done += 1
        self.b_in_shard += nbytes
        if time.time() - self.last_note > _PROGRESS_EVERY_S:
            self.last_note = time.time()
            self._say(f"dorafp8: ... {self.n_done}/{self.total} tensors, {self.report.bytes_read / 2**30:.2f} GiB "
                      f"read, {self.last_note - self.t0:.0f} s")

    def shard_done(self) -> None:
        if self.current is not None and len(self.shards) > 1:
            self._say(f"dorafp8: shard {self.current + 1}/{len(self.shards)} "
                      f"({os.path.basename(self.shards[self.current])}): {self.n_in_shard} tensors, "
                      f"{self.b_in_shard / 2**20:.1f} MiB, {time.time() - self.t_shard:.1f} s")


def _checked_scale(t: torch.Tensor, key: str) -> torch.Tensor:
    """t as fp32, refused if NaN, infinite, negative or overflowing times e4m3's largest value."""
    f = t.float()
    bad = int((~torch.isfinite(f * E4M3_MAX) | (f < 0)).sum())
    if bad:
        raise CheckpointFormatError(f"{key}: {bad} of {f.numel()} scale values are NaN, infinite or negative, or "
                                    f"overflow fp32 times {E4M3_MAX:g} (e4m3's largest value); a weight scale must be "
                                    f">= 0 and keep scale x {E4M3_MAX:g} finite (the file is damaged or was converted "
                                    f"wrongly). Nothing was loaded")
    return f


def _check_e4m3(t: torch.Tensor, key: str) -> None:
    """Refuses float8_e4m3fn values that are NaN (bytes 0x7f, 0xff): no quantizer writes them (e4m3 saturates at
    448), and loaded they would make every output of the layer NaN, silently."""
    bits = t.view(torch.uint8)
    # one uint8 max over the masked bytes first (15x faster on a CPU than counting: 0.25 s, not 4 s, a GB); counted
    # only where there is a NaN, for the message
    if not bits.numel() or int((bits & 0x7F).amax()) != 0x7F:
        return
    bad = int(e4m3_nan(bits).sum())
    if bad:
        raise CheckpointFormatError(f"{key}: {bad} of {t.numel()} float8_e4m3fn values are NaN (bytes 0x7f / 0xff, "
                                    f"which no fp8 quantizer writes): the file is damaged or was converted wrongly. "
                                    f"Nothing was loaded")


class _TensorLoader:
    """Reads the planned tensors one at a time into the model (fp8 kept, others dequantized or cast)."""

    def __init__(self, model: nn.Module, plan: LoadPlan, model_t: dict, tied: dict, report: LoadReport,
                 dtype: Optional[torch.dtype], mdtype: torch.dtype, first: dict):
        self.model, self.plan, self.model_t, self.tied, self.report = model, plan, model_t, tied, report
        self.dtype, self.mdtype = dtype, mdtype
        self.first = first  # the tensors read while checking (_read_checked_first): not read again
        self.dequant_scales = {k: _checked_scale(t, k) for k, t in first.items() if not _is_checked_extra(k)}
        self.src_dtypes: dict[str, torch.dtype] = {}  # model name -> dtype in the file (written back on save)

    def read(self, source: CheckpointSource, device, progress: _Progress) -> None:
        plan, info = self.plan, source.info
        want = list(plan.layer_of) + [k for k in plan.scales if k not in self.first] + list(plan.plain) + \
            [e for p in plan.layers.values() for e in p.extras if e not in self.first]
        progress.total = len(want)
        for k, t in source.read(want, device):
            progress.tensor(info[k][2], t.numel() * t.element_size())
            if t.dtype == E4M3 and k not in plan.scales:  # NVFP4's e4m3 block scales: checked as scales
                _check_e4m3(t, k)
            if k in plan.layer_of:
                self._weight(k, t)
            elif k in plan.scales:
                self._scale(k, t)
            elif k in plan.plain:
                self._plain(k, t)
            else:
                self._extra(k, t)
        progress.shard_done()
        for k, t in self.first.items():
            if _is_checked_extra(k):
                self._extra(k, t)

    def _weight(self, k: str, t: torch.Tensor) -> None:
        mod_name = self.plan.layer_of[k]
        p = self.plan.layers[mod_name]
        if p.fp8 and p.group:  # 1 x g scales, read first: re-quantized to per row (group_scales.py)
            gs = self.dequant_scales[p.scale_key]
            w8, s_row, rel = groups_to_rows(t.contiguous(), gs.reshape(gs.shape[0], gs.shape[1]), p.group)
            set_tensor(self.model, f"{mod_name}.weight", w8, param=True)
            set_tensor(self.model, f"{mod_name}.scale", s_row, param=False)
            src = self.model.get_submodule(mod_name)._dorafp8_source
            # written back in the file's shape where it still fits (one block a row: [N, 1, 1]), else [N, 1]
            src.scale_dtype, src.scale_shape = self.first[p.scale_key].dtype, tuple(self.first[p.scale_key].shape)
            self.report.fp8_layers[mod_name] = f"per-row (re-quantized from 1x{p.group} blocks: {100 * rel:.2f}%)"
            report_regrouped(mod_name, p.group, rel, "the checkpoint")
            return
        if p.fp8:
            set_tensor(self.model, f"{mod_name}.weight", t.contiguous(), param=True)
            if p.scale_key is None:
                set_tensor(self.model, f"{mod_name}.scale", torch.ones((), device=t.device), param=False)
                self.report.fp8_layers[mod_name] = "scale 1"
            return
        # an fp8 tensor in a module that is not linear or conv (embedding, Conv1D): dequantized
        name = self.plan.keys.names[k]
        sk = p.scale_key
        s = self.dequant_scales[sk] if sk else torch.ones((), device=t.device)
        w = t.float() * (s if s.numel() == 1 else s.reshape(-1, *([1] * (t.dim() - 1))))
        target = self.model_t[name]
        tdt = self.mdtype if (self.dtype is not None or target.dtype in (E4M3, E5M2)) else target.dtype
        set_tensor(self.model, name, w.to(tdt), requires_grad=True)
        self.report.dequantized.append(name)
        if sk:
            self.plan.scales.pop(sk, None)

    def _scale(self, k: str, t: torch.Tensor) -> None:
        sp = self.plan.scales[k]
        if not sp.keeps_fp8:
            return
        if sp.kind is not None:
            self._micro_scale(k, t, sp)
            return
        mod = self.model.get_submodule(sp.module)
        sc = check_scale(_checked_scale(t, k), sp.N, sp.K, sp.block_size, name=k)
        set_tensor(self.model, f"{sp.module}.scale", sc, param=False)
        mod._dorafp8_source.scale_dtype, mod._dorafp8_source.scale_shape = t.dtype, tuple(t.shape)
        self.report.fp8_layers[sp.module] = granularity_name(scale_kind(sc), sp.block_size)

    def _micro_scale(self, k: str, t: torch.Tensor, sp) -> None:
        """A microscaled layer's scale as stored (MXFP8's bytes as e8m0), refused if NaN or (NVFP4) negative; and
        NVFP4's global scale as the factor W0 multiplies by (compressed-tensors stores its reciprocal)."""
        mod = self.model.get_submodule(sp.module)
        sc = t.contiguous().view(E8M0) if sp.kind == "mxfp8" else t.contiguous()
        try:
            check_micro_scale_values(sc, k)
        except ValueError as e:
            raise CheckpointFormatError(f"{e}: the file is damaged; nothing was loaded") from None
        set_tensor(self.model, f"{sp.module}.scale", sc, param=False)
        p = self.plan.layers[sp.module]
        if p.global_key is not None:
            g = self.first[p.global_key].float().reshape(())
            g = g if p.key.endswith(".weight") else 1.0 / g
            set_tensor(self.model, f"{sp.module}.global_scale", g, param=False)
            mod._dorafp8_source.global_bits = fp32_bits(g)
        mod._dorafp8_source.scale_dtype, mod._dorafp8_source.scale_shape = t.dtype, tuple(t.shape)
        self.report.fp8_layers[sp.module] = {"nvfp4": "NVFP4 (e4m3 per 16, fp32 global)",
                                             "mxfp8": "MXFP8 (e8m0 per 32)"}[sp.kind]

    def _plain(self, k: str, t: torch.Tensor) -> None:
        m = self.plan.plain[k]
        mod_name = m.rpartition(".")[0]
        target = self.model_t.get(m)
        if target is None:  # the bias of a layer swapped for an FP8Linear
            target = self.model.get_submodule(mod_name).bias
        if not t.is_floating_point():
            tdt = t.dtype
        elif self.dtype is not None or target.dtype in (E4M3, E5M2) or not target.is_floating_point():
            tdt = self.mdtype
        else:
            tdt = target.dtype
        if t.dtype in (E4M3, E5M2):
            t = t.float()
            self.report.dequantized.append(m)
        value = t.to(tdt)
        if isinstance(target, nn.Parameter) or mod_name in self.plan.layers:
            fp8 = mod_name in self.plan.layers and self.plan.layers[mod_name].fp8  # an fp8 layer's bias stays frozen
            value = nn.Parameter(value, requires_grad=not fp8 and target.requires_grad and value.is_floating_point())
        for alias in self.tied.get(m, [m]):
            set_tensor(self.model, alias, value, param=isinstance(value, nn.Parameter))
        self.src_dtypes[m] = t.dtype
        self.report.loaded.append(m)

    def _extra(self, k: str, t: torch.Tensor) -> None:
        """Extras of an fp8 layer: static activation scales, comfy_quant, zero points, KV-cache scales."""
        mod_name = self.plan.layer_of.get(f"{layer_key(k)}.weight")
        mod = self.model.get_submodule(mod_name) if mod_name else None
        if isinstance(mod, FP8_LAYER_TYPES):
            mod._dorafp8_source.extras[k.rpartition(".")[2]] = t
        kv = "ModelOpt's FP8 KV-cache scales (training quantizes no KV cache; written back on save)"
        self.report.kept[k] = {"comfy_quant": "ComfyUI layer configs (written back on save)",
                               "weight_zero_point": "zero points (all zero)", "input_zero_point": "zero points (all "
                               "zero)", "k_scale": kv, "v_scale": kv}.get(
            k.rpartition(".")[2], "static activation scales (not used: act_quant='rowwise' scales activations per row "
                                  "as it runs; written back on save)")


# ---- the checks that need more than the plan --------------------------------------------------------------------


def _is_checked_extra(k: str) -> bool:
    """Extras whose values can refuse a load: zero points (must be zero) and ComfyUI layer configs (must say e4m3)."""
    return k.endswith(("_zero_point", ".comfy_quant"))


def _read_checked_first(plan: LoadPlan, source: CheckpointSource, device, report: LoadReport) -> dict:
    """key -> tensor of the small tensors needed before the others (scales of dequantized or re-quantized fp8 tensors,
    NVFP4 global scales, zero points, ComfyUI layer configs), read once and checked before the model changes."""
    globals_ = {p.global_key for p in plan.layers.values() if p.global_key}
    keys = [p.scale_key for p in plan.layers.values() if (not p.fp8 or p.group) and p.scale_key] + \
        [e for p in plan.layers.values() for e in p.extras if _is_checked_extra(e)] + sorted(globals_)
    first = {}
    for k, t in source.read(keys, device):
        report.bytes_read += t.numel() * t.element_size()
        if k in globals_:
            g = t.float().reshape(())
            if not (bool(torch.isfinite(g)) and float(g) > 0 and bool(torch.isfinite(1.0 / g))):
                raise CheckpointFormatError(f"{k}: NVFP4 global scale {float(g)!r} is not a finite positive number "
                                            f"(with a finite reciprocal); the file is damaged. Nothing was loaded")
        if k.endswith("_zero_point") and bool((t.float() != 0).any()):
            raise CheckpointFormatError(f"{k}: non-zero zero point (asymmetric quantization) is not supported")
        if k.endswith(".comfy_quant"):
            conf = parse_json(bytes(t.to(torch.uint8).tolist()), f"{k} (in {source.where(source.info[k][2])})",
                              'ComfyUI\'s layer config, JSON like {"format": "float8_e4m3fn"}')
            if conf.get("format") != "float8_e4m3fn":
                raise CheckpointFormatError(f"{k}: ComfyUI quantization format {conf.get('format')!r}; dorafp8 "
                                            f"loads float8_e4m3fn only")
        first[k] = t
    return first


def _written(plan: LoadPlan, tied: dict) -> set[str]:
    """The model tensors (by name, after the swaps) that the load will write."""
    out = set()
    for k, mod_name in plan.layer_of.items():
        if plan.layers[mod_name].fp8:
            out |= {f"{mod_name}.weight", f"{mod_name}.scale"}  # the scale read, or 1 where the layout has none
            if plan.layers[mod_name].global_key:
                out.add(f"{mod_name}.global_scale")
        else:
            out.add(plan.keys.names[k])  # dequantized into the module's own weight
    for m in plan.plain.values():
        out |= set(tied.get(m, [m]))
    return out


def _modules_after_swaps(model: nn.Module, new: dict):
    """(name, module) of the model as it will be once the modules in `new` replace theirs."""
    inside = None
    for name, mod in model.named_modules():
        if inside is not None and name.startswith(inside):
            continue  # a submodule of a replaced module
        inside = None
        if name in new:
            mod, inside = new[name], name + "."
        yield name, mod


def _left_on_meta(modules, written: set | None = None) -> dict[str, tuple]:
    """Modules with tensors on meta: name -> (module, their names, all of its?); with `written`: those left after."""
    left = {}
    for mname, mod in modules:
        pre = f"{mname}." if mname else ""
        own = [(n, t) for n, t in list(mod._parameters.items()) + list(mod._buffers.items()) if t is not None]
        meta = [n for n, t in own if t.is_meta and (written is None or pre + n not in written)]
        if meta:
            left[mname] = (mod, meta, len(meta) == len(own))
    return left


def _initializers(model: nn.Module) -> dict[str, nn.Module]:
    """The modules that can initialize their submodules' tensors (transformers' PreTrainedModel._init_weights)."""
    return {n: m for n, m in model.named_modules()
            if callable(getattr(m, "_init_weights", None)) and hasattr(m, "config")}


def _owner(inits: dict, mname: str) -> str | None:
    """The innermost module of `inits` that contains `mname`."""
    return max((o for o in inits if o == "" or mname == o or mname.startswith(o + ".")), key=len, default=None)


def _stuck(model: nn.Module, left: dict) -> list[str]:
    """The tensors of `left` that nothing can compute (in a module with real tensors, or no initializer's)."""
    inits = _initializers(model)
    return [f"{mname}.{n}" if mname else n for mname, (_, meta, whole) in left.items()
            if not whole or _owner(inits, mname) is None for n in meta]


def _stuck_error(stuck: list) -> CheckpointFormatError:
    return CheckpointFormatError(f"tensors left on the meta device that the checkpoint does not have and nothing "
                                 f"can compute: {some(stuck)}; build the model with "
                                 f"accelerate.init_empty_weights() (which keeps buffers real), or pass strict=False "
                                 f"(they become zeros)")


def _materialize_leftovers(model: nn.Module, device, report: LoadReport, strict: bool) -> None:
    """Tensors left on the meta device, materialized by the model's _init_weights, else zeros (strict: error)."""
    left = _left_on_meta(model.named_modules())
    if not left:
        return
    inits = _initializers(model)
    for mname, (mod, meta, whole) in left.items():
        for n in meta:
            t = mod._parameters.get(n)
            if t is not None:
                mod._parameters[n] = nn.Parameter(torch.zeros_like(t, device=device), requires_grad=t.requires_grad)
            else:
                mod._buffers[n] = torch.zeros_like(mod._buffers[n], device=device)
            full = f"{mname}.{n}" if mname else n
            if n in mod._non_persistent_buffers_set:
                report.initialized.append(full)
            elif full not in report.missing:
                report.missing.append(full)
        owner = _owner(inits, mname)
        if not whole or owner is None:
            continue
        try:
            with torch.no_grad():
                inits[owner]._init_weights(mod)
        except Exception as e:  # noqa: BLE001 - a model's own initializer failed: say where
            raise RuntimeError(f"computing {mname!r} (not in the checkpoint) with {type(inits[owner]).__name__}."
                               f"_init_weights failed: {e}; build the model with accelerate.init_empty_weights() "
                               f"(which keeps buffers real) instead") from e
    stuck = _stuck(model, left)
    if stuck and strict:  # found before the model changed (load_fp8_checkpoint); checked again on what is left
        raise _stuck_error(stuck)
