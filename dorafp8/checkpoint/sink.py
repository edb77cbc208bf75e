"""Where a writer puts its tensors: TensorSink (a dict, for transformers' save_pretrained) or ShardWriter (safetensors
files); shard_names / shard_pattern: the names shards are given."""

from __future__ import annotations

import os
import re
import uuid

import torch

from .files import destination, names_a_file, refuse_shadowing, save_file_atomic, save_safetensors


def parse_size(size) -> int:
    """max_shard_size: a positive int (bytes) or '5GB', '500MiB', ...; anything else refused naming the argument."""
    m = None if isinstance(size, (bool, int)) else re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([KMGT]?I?B)\s*",
                                                               str(size).upper())
    if m:
        mult = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
                "GIB": 2**30, "TIB": 2**40}.get(m.group(2))
        n = int(float(m.group(1)) * mult) if mult else None
    else:
        n = size
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"max_shard_size must be a positive int (bytes) or like '5GB', got {size!r}")
    return n


class TensorSink:
    """The tensors in a dict, in order (the state dict handed to transformers' save_pretrained)."""

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
    """Writes the tensors to safetensors files of at most max_bytes each: hidden parts in the staging folder `path`
    (write.py publishes them), or at close() the one file `path` ending in .safetensors (save_file_atomic)."""

    def __init__(self, path: str, stem: str, max_bytes: int, metadata: dict):
        super().__init__()
        self.single = names_a_file(path)
        if self.single:  # before the tensors are computed (save_file_atomic checks again, under the folder's lock)
            refuse_shadowing(*os.path.split(destination(path)), path)
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
        tmp = os.path.join(self.path, f".{self.stem}.part{len(self.parts)}.safetensors")
        save_safetensors(self.cur, tmp, self.metadata)
        self.parts.append((tmp, list(self.cur)))
        self.cur, self.cur_bytes = {}, 0

    def close(self) -> list[tuple[str, list[str]]]:
        """Finishes the write: [] for one file written in place, else the parts [(file, its keys)]."""
        if self.single:
            save_file_atomic(self.cur, self.path, self.metadata)
            return []
        if self.cur or not self.parts:
            self._flush()
        return self.parts


def shard_names(stem: str, n: int, taken=frozenset()) -> list[str]:
    """Fresh shard names `{stem}-{8 hex}-0000i-of-0000n.safetensors`, none in `taken`."""
    while True:
        tag = uuid.uuid4().hex[:8]
        names = [f"{stem}-{tag}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        if not set(names) & set(taken):
            return names


def shard_pattern(stem: str) -> re.Pattern:
    """The names shard_names gives for `stem`: the only files a writer may remove (files.previous_export)."""
    return re.compile(rf"{re.escape(stem)}-[0-9a-f]{{8}}-[0-9]{{5}}-of-[0-9]{{5}}\.safetensors")
