"""Where a writer puts its tensors: TensorSink keeps them in a dict (the state dict handed to transformers'
save_pretrained); ShardWriter writes them to safetensors files, sharded with an index, atomically (temporary part
files renamed at the end, removed if the write fails); shard_names / shard_pattern: the names it gives shards."""

from __future__ import annotations

import itertools
import json
import os
import re

import torch

from .files import save_safetensors


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
    """Writes the tensors to safetensors files of at most max_bytes each, every one under a temporary name until
    close(): into the folder `path` (a staging folder: close() names the shards and writes their index there, and
    the caller publishes them), or at close() to the one file `path` ending in .safetensors (files.save_safetensors:
    through a staging folder of its own)."""

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
        tmp = os.path.join(self.dir, f".{self.stem}.part{len(self.parts)}.safetensors")
        self.parts.append((tmp, list(self.cur)))  # before writing: discard() removes what a failed write began
        save_safetensors(self.cur, tmp, self.metadata)
        self.cur, self.cur_bytes = {}, 0

    def discard(self) -> None:
        """A write that failed half-way leaves nothing behind: its temporary shards, and the directory it made."""
        for tmp, _ in self.parts:
            if os.path.exists(tmp):
                os.remove(tmp)
        if self.made_dir and not os.listdir(self.dir):
            os.rmdir(self.dir)

    def close(self, taken=frozenset()) -> list[str]:
        """Finishes the write: the one file renamed into place (fsynced), or the shards named (the names of
        shard_names that `taken`, the files already in the destination, does not have) and their index written.
        Returns the files' paths."""
        if self.single:
            save_safetensors(self.cur, self.path, self.metadata, staged=True)
            return [self.path]
        if self.cur or not self.parts:
            self._flush()
        n = len(self.parts)
        names = [f"{self.stem}.safetensors"] if n == 1 else shard_names(self.stem, n, taken)
        weight_map = {}
        for (tmp, keys), name in zip(self.parts, names):
            os.replace(tmp, os.path.join(self.dir, name))
            weight_map.update({k: name for k in keys})
        if n > 1:
            with open(os.path.join(self.dir, f"{self.stem}.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))},
                          f, indent=2)
        return [os.path.join(self.dir, name) for name in names]


def shard_names(stem: str, n: int, taken=frozenset()) -> list[str]:
    """The names of n shards: `{stem}-00001-of-0000n.safetensors`, ..., or where any of those is taken (by the export
    a new one replaces, which stays readable until the new index is in place), `{stem}-2-00001-of-0000n...`, and so
    on: never a name a file of the destination has."""
    for g in itertools.count(1):
        tag = f"{stem}-" if g == 1 else f"{stem}-{g}-"
        names = [f"{tag}{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        if not set(names) & set(taken):
            return names


def shard_pattern(stem: str) -> re.Pattern:
    """The names shard_names gives for `stem`, and only those: what a writer may remove of an export it replaces."""
    return re.compile(rf"{re.escape(stem)}(-[0-9]+)?-[0-9]{{5,}}-of-[0-9]{{5,}}\.safetensors")
