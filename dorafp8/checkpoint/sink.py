"""Where a writer puts its tensors: TensorSink keeps them in a dict (the state dict handed to transformers'
save_pretrained); ShardWriter writes them to safetensors files, sharded with an index, atomically (temporary part
files renamed at the end, removed if the write fails)."""

from __future__ import annotations

import json
import os
import re

import torch


def parse_size(size) -> int:
    """max_shard_size: an int (bytes) or '5GB', '500MiB', ..."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?I?B)\s*", str(size).upper())
    if not m:
        raise ValueError(f"max_shard_size must be an int (bytes) or like '5GB', got {size!r}")
    unit = m.group(2)
    mult = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
            "TIB": 2**40}[unit]
    return int(float(m.group(1)) * mult)


class TensorSink:
    """Where the writer puts its tensors: in a dict, in order (the state dict handed to transformers' save_pretrained,
    which shards and writes it itself). ShardWriter writes them to safetensors files instead."""

    def __init__(self):
        self.cur: dict = {}
        self.keys: set = set()
        self.total = 0
        self.count = 0

    def add(self, key: str, t: torch.Tensor) -> None:
        if key in self.keys:
            raise ValueError(f"two tensors would be written under {key!r}")
        self.keys.add(key)
        self.cur[key] = t.detach()
        self.total += t.numel() * t.element_size()
        self.count += 1


class ShardWriter(TensorSink):
    def __init__(self, path: str, stem: str, max_bytes: int, metadata: dict):
        super().__init__()
        self.single = path.endswith(".safetensors")
        self.dir = os.path.dirname(path) if self.single else path
        self.made_dir = bool(self.dir) and not os.path.isdir(self.dir)
        if self.dir:
            os.makedirs(self.dir, exist_ok=True)
        self.path, self.stem, self.max, self.metadata = path, stem, max_bytes, metadata
        self.cur_bytes = 0
        self.parts: list[tuple[str, list[str]]] = []

    def add(self, key: str, t: torch.Tensor) -> None:
        t = t.detach().to("cpu").contiguous()
        n = t.numel() * t.element_size()
        if self.cur and not self.single and self.cur_bytes + n > self.max:
            self._flush()
        super().add(key, t)
        self.cur_bytes += n

    def _flush(self) -> None:
        from safetensors.torch import save_file

        tmp = os.path.join(self.dir, f".{self.stem}.part{len(self.parts)}.safetensors")
        save_file(self.cur, tmp, metadata=self.metadata)
        self.parts.append((tmp, list(self.cur)))
        self.cur, self.cur_bytes = {}, 0

    def discard(self) -> None:
        """A write that failed half-way leaves nothing behind: its temporary shards, and the directory it made."""
        for tmp, _ in self.parts:
            if os.path.exists(tmp):
                os.remove(tmp)
        if self.made_dir and not os.listdir(self.dir):
            os.rmdir(self.dir)

    def close(self) -> list[str]:
        if self.cur or not self.parts:
            self._flush()
        files = []
        if self.single:
            os.replace(self.parts[0][0], self.path)
            return [self.path]
        n = len(self.parts)
        weight_map = {}
        for i, (tmp, keys) in enumerate(self.parts):
            name = f"{self.stem}.safetensors" if n == 1 else f"{self.stem}-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(tmp, os.path.join(self.dir, name))
            files.append(os.path.join(self.dir, name))
            weight_map.update({k: name for k in keys})
        if n > 1:
            with open(os.path.join(self.dir, f"{self.stem}.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))},
                          f, indent=2)
        return files
