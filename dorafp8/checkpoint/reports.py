"""What a load or a write did: LoadReport (load_fp8_checkpoint) and ExportReport (save_fp8_checkpoint,
export_merged, save_pretrained). `str(report)` is the summary they print."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional


@dataclass
class LoadReport:
    """What load_fp8_checkpoint did. `str(report)` is the summary it prints."""
    format: str
    evidence: str
    source: str
    prefix: str = ""
    fp8_layers: dict = field(default_factory=dict)      # module name -> "per-tensor" / "per-row" / "per-128x128-block"
    dequantized: list = field(default_factory=list)     # fp8 tensors dequantized into modules that are not linear
    loaded: list = field(default_factory=list)          # other tensors, cast to the model's dtype
    kept: dict = field(default_factory=dict)            # checkpoint key -> why it was not loaded into the model
    missing: list = field(default_factory=list)         # model tensors the checkpoint does not have
    initialized: list = field(default_factory=list)     # model buffers computed, not loaded (rotary inv_freq, ...)
    unexpected: list = field(default_factory=list)      # checkpoint keys that fit nothing in the model
    shards: int = 0
    bytes_read: int = 0
    seconds: float = 0.0

    def __str__(self) -> str:
        kinds = Counter(self.fp8_layers.values())
        lines = [f"dorafp8: loaded {self.source} as {self.format} ({self.evidence})"
                 + (f", key prefix {self.prefix!r} stripped" if self.prefix else ""),
                 f"  fp8 layers (FP8Linear, bytes as stored): {len(self.fp8_layers)}"
                 + (f" ({', '.join(f'{n} {k}' for k, n in kinds.most_common())})" if kinds else ""),
                 f"  other tensors loaded: {len(self.loaded)}; {self.shards} shard(s), "
                 f"{self.bytes_read / 2**20:.1f} MiB in {self.seconds:.1f} s"]
        if self.dequantized:
            lines.append(f"  fp8 tensors of non-linear modules, dequantized: {len(self.dequantized)} "
                         f"(e.g. {self.dequantized[0]})")
        if self.kept:
            why = Counter(self.kept.values())
            lines.append(f"  checkpoint entries not loaded into the model: {len(self.kept)} ("
                         + "; ".join(f"{n} {w}" for w, n in why.most_common()) + ")")
        if self.initialized:
            lines.append(f"  buffers computed by the model, not in the checkpoint: {', '.join(self.initialized[:4])}"
                         + (" ..." if len(self.initialized) > 4 else ""))
        for what, names in (("missing from the checkpoint (left as they were)", self.missing),
                            ("in the checkpoint but not in the model (not loaded)", self.unexpected)):
            if names:
                lines.append(f"  {what}: {len(names)}: {', '.join(names[:4])}" + (" ..." if len(names) > 4 else ""))
        return "\n".join(lines)


@dataclass
class ExportReport:
    """What save_fp8_checkpoint / export_merged wrote. Per fp8 layer: what was done and the relative error of the
    written weight against the fp32 one the model computes with (merged: evaluated from the unmerged adapters)."""
    format: str
    path: str
    files: list = field(default_factory=list)
    layers: dict = field(default_factory=dict)   # name -> {"action", "granularity", "rel_error", "adapters"}
    tensors: int = 0
    bytes: int = 0
    notes: list = field(default_factory=list)
    seconds: float = 0.0

    def errors(self, action: Optional[str] = None) -> dict:
        return {n: d["rel_error"] for n, d in self.layers.items() if action is None or d["action"] == action}

    @property
    def worst(self) -> tuple:
        e = self.errors()
        return max(e.items(), key=lambda kv: kv[1]) if e else (None, 0.0)

    @property
    def mean_error(self) -> float:
        e = list(self.errors().values())
        return sum(e) / len(e) if e else 0.0

    def __str__(self) -> str:
        acts = Counter(d["action"] for d in self.layers.values())
        grans = Counter(d["granularity"] for d in self.layers.values())
        lines = [f"dorafp8: wrote {self.path} as {self.format}: {len(self.files)} file(s), {self.tensors} tensors, "
                 f"{self.bytes / 2**20:.1f} MiB in {self.seconds:.1f} s",
                 f"  fp8 layers: {len(self.layers)} ({', '.join(f'{n} {a}' for a, n in acts.most_common())}; "
                 f"{', '.join(f'{n} {g}' for g, n in grans.most_common())})"]
        merged = self.errors("merged")
        if merged:
            w = max(merged.items(), key=lambda kv: kv[1])
            lines.append(f"  merge error (relative, vs the unmerged fp32 evaluation): worst {w[1]:.3e} ({w[0]}), "
                         f"mean {sum(merged.values()) / len(merged):.3e} over {len(merged)} merged layers")
        req = self.errors("requantized")
        if req:
            w = max(req.items(), key=lambda kv: kv[1])
            lines.append(f"  re-quantized without merging (layout needs another scale): {len(req)}, worst error "
                         f"{w[1]:.3e} ({w[0]})")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)
