"""Checkpoint files that come from strangers, read, and the user's folders written into, safely.

Reading: every file a loader opens is checked first (`regular_file`, `file_in`): a regular file (a FIFO would block
the open for ever, a device never ends), and for a name taken from a checkpoint folder or its index, one inside that
folder once symlinks are resolved (or inside the `blobs/` of the Hugging Face cache repository whose snapshot the
folder is: the cache links every snapshot file there). Every safetensors header and JSON file is read through one
wrapper (`safetensors_keys`, `open_safetensors`, `read_json`, `parse_json`) whose error names the file, what was
expected and what to do; a header is measured before it is parsed (`MAX_HEADER_BYTES`, `MAX_TENSORS`), so that a
hostile one costs neither minutes nor gigabytes.

Writing: a file is written under a temporary name beside its destination (`temporary_name`, which carries the
writer's process id so that a later run can tell a dead writer's leftovers from a live one's: `remove_leftovers`),
fsynced, and renamed into place; then the folder is fsynced (`replace`). A checkpoint of several files is written
into a staging folder and moved into its destination by `publish`, so that a reader finds the old checkpoint or the
new one whenever the writer stops; a write error names the file (`write_error`).
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import re
import shutil
import stat
import uuid
from typing import Optional

from .layouts import CheckpointFormatError

MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on a header (it refuses larger ones)
MAX_TENSORS = 300_000  # per safetensors file: a header of more is refused before it is parsed
MAX_JSON_BYTES = 64 * 2**20  # an index or config.json (an index of 100,000 tensors is about 10 MB)
DAMAGED = "the file is damaged or incomplete (an interrupted download?): download it again"


def some(items, first: int = 6, sep: str = ", ") -> str:
    """Items (names, problems) for an error message: all of them if few, else the first few and how many there are
    (an error listing 100,000 keys is millions of characters nobody reads)."""
    items = list(items)
    shown = sep.join(map(str, items[:first]))
    return shown if len(items) <= first else f"{shown}{sep}... ({len(items)} in all)"


# ---- reading -----------------------------------------------------------------------------------------------------


def regular_file(path: str, what: str) -> str:
    """`path` if it is (or links to) a regular file; an error naming `what` otherwise (missing, a folder, a FIFO or
    a device, which a reader would block on or never finish)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what}: {path} does not exist") from None
    except OSError as e:  # permissions, a link loop: still an OSError, naming the file
        raise OSError(e.errno, f"{what}: {path}: {e.strerror}") from e
    if not stat.S_ISREG(st.st_mode):
        kind = "a folder" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode) else \
            "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "not a regular file"
        raise CheckpointFormatError(f"{what}: {path} is {kind}, not a file; a checkpoint is made of regular files")
    return path


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def allowed_roots(folder: str) -> list[str]:
    """Where the files of checkpoint folder `folder` may resolve to: the folder itself and, for a snapshot of the
    Hugging Face cache (`<repo>/snapshots/<revision>/...`), that repository's `blobs/`, where its symlinks point."""
    real = os.path.realpath(folder)
    roots = [real]
    parts = real.split(os.sep)
    if "snapshots" in parts[:-1]:
        i = len(parts) - 1 - parts[::-1].index("snapshots")
        blobs = os.path.join(os.sep.join(parts[:i]) or os.sep, "blobs")
        if os.path.isdir(blobs):
            roots.append(blobs)
    return roots


def file_in(folder: str, name, what: str, roots: Optional[list[str]] = None) -> str:
    """folder/name, for a file name taken from the checkpoint itself (an index's shard, a file in its folder): a
    relative name without '..', that resolves (symlinks followed) inside `roots` (allowed_roots(folder)) to a
    regular file. Anything else is refused naming `what` (the index entry)."""
    if not isinstance(name, str) or not name.strip():
        raise CheckpointFormatError(f"{what}: {name!r} is not a file name")
    parts = name.replace("\\", "/").split("/")
    if os.path.isabs(name) or name.startswith(("/", "\\")) or ".." in parts:
        raise CheckpointFormatError(f"{what}: {name!r} is not a file inside {folder} (a checkpoint names its own "
                                    f"files, relative to its folder, without '..'); the checkpoint is damaged or "
                                    f"was made to read other files")
    path = os.path.join(folder, name)
    real = os.path.realpath(path)
    roots = roots if roots is not None else allowed_roots(folder)
    if not any(_inside(real, r) for r in roots):
        raise CheckpointFormatError(f"{what}: {path} is a link to {real}, outside {folder}; a checkpoint's files must "
                                    f"be inside its folder (links within it, as the Hugging Face cache makes them, "
                                    f"are fine)")
    try:
        return regular_file(path, what)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{e}: the checkpoint is incomplete (an interrupted download?); download it "
                                f"again") from None


def parse_json(data: bytes, where: str, expected: str, todo: str = DAMAGED) -> dict:
    """`data` (the text of `where`) parsed as a JSON object; an error naming `where`, `expected` and `todo`."""
    try:
        obj = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise CheckpointFormatError(f"{where}: not UTF-8 text (byte {e.start}); expected {expected}; {todo}") from None
    except json.JSONDecodeError as e:
        raise CheckpointFormatError(f"{where}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
                                    f"expected {expected}; {todo}") from None
    except RecursionError:
        raise CheckpointFormatError(f"{where}: JSON nested too deep; expected {expected}; {todo}") from None
    if not isinstance(obj, dict):
        raise CheckpointFormatError(f"{where}: a JSON {type(obj).__name__}, expected {expected}; {todo}")
    return obj


def read_json(path: str, expected: str) -> dict:
    """The JSON object in the regular file `path` (at most MAX_JSON_BYTES); errors name the file."""
    size = os.path.getsize(path)
    if size > MAX_JSON_BYTES:
        raise CheckpointFormatError(f"{path}: {size} bytes, more than the {MAX_JSON_BYTES} dorafp8 reads for "
                                    f"{expected}; {DAMAGED}")
    with open(path, "rb") as f:
        return parse_json(f.read(), path, expected)


def _check_header(path: str, where: str) -> None:
    """Refuses a safetensors header of more than MAX_HEADER_BYTES or MAX_TENSORS entries, or longer than its file:
    measured before anything is parsed, in bounded memory (each entry of the JSON header is an object, and an
    object cannot be written without a '{', so the '{'s bound the entries from above)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointFormatError(f"{where}: {size} bytes, too short for a safetensors file (an 8-byte header "
                                        f"length, then the header); {DAMAGED}")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER_BYTES or n > size - 8:
            raise CheckpointFormatError(f"{where}: its header length says {n} bytes, " + (
                f"more than safetensors reads ({MAX_HEADER_BYTES})" if n > MAX_HEADER_BYTES else
                f"but the file has {size}") + f": not a safetensors file, or a damaged one; {DAMAGED}")
        objects, left = 0, n
        while left:
            chunk = f.read(min(left, 2**20))
            objects += chunk.count(b"{")
            left -= len(chunk)
            if not chunk or objects > MAX_TENSORS + 2:
                break
    if objects > MAX_TENSORS + 2:  # the header itself and __metadata__
        raise CheckpointFormatError(f"{where}: a header of more than {MAX_TENSORS} entries, more than dorafp8 reads "
                                    f"from one file (refused before parsing it); {DAMAGED}")


@contextlib.contextmanager
def open_safetensors(path: str, where: str, device: str = "cpu"):
    """safetensors' safe_open of `path`, its header measured first (_check_header); any error while it is open, or
    in reading a tensor from it, is raised naming `where` (a shard: which one) and what to do."""
    from safetensors import SafetensorError, safe_open

    _check_header(path, where)
    try:
        with safe_open(path, framework="pt", device=device) as f:
            yield f
    except SafetensorError as e:
        why = str(e).replace("Error while deserializing header: ", "")
        raise CheckpointFormatError(f"{where}: cannot be read as a safetensors file ({why}); {DAMAGED}") from e
    except OSError as e:  # the disk, not the file's content: still an OSError, naming the file
        raise OSError(e.errno, f"{where}: {e.strerror}") if e.errno else OSError(f"{where}: {e}") from e


def safetensors_keys(path: str, where: str) -> tuple[dict, dict]:
    """(metadata, {key: (safetensors dtype name, shape)}) of the safetensors file `path`, from its header alone."""
    with open_safetensors(path, where) as f:
        meta = f.metadata() or {}
        info = {}
        for k in f.keys():
            sl = f.get_slice(k)
            info[k] = (sl.get_dtype(), tuple(sl.get_shape()))
    return meta, info


# ---- writing -----------------------------------------------------------------------------------------------------

JOURNAL = ".publish.json"  # in a staging folder: what publish() moves and removes, for a later run to finish or undo


def temporary_name(folder: str, name: str) -> str:
    """Where a writer writes `name` (a file or a staging folder) of `folder` before it is complete: hidden, with the
    writer's process id (so that remove_leftovers of a later run knows whether its writer is still alive) and a
    random part (two writers in one process)."""
    return os.path.join(folder, f".{name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.partial")


def remove_leftovers(folder: str, name: str) -> list[str]:
    """What writers of `name` in `folder` killed before they finished left behind (temporary_name of a process that
    no longer runs): a temporary file is removed; a staging folder is removed after its publish, if one had begun, is
    finished (if it had renamed its commit, the index or the single file, into place) or undone (if not). A live
    writer's are left alone. Returns the paths removed."""
    removed = []
    for path in glob.glob(os.path.join(glob.escape(folder), f".{glob.escape(name)}.*.partial")):
        pid = path[len(os.path.join(folder, f".{name}.")):-len(".partial")].partition("-")[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            finish_or_undo(path)
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(folder: str) -> None:
    """Makes the renames and removals in `folder` durable (a no-op where folders cannot be opened, as on Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def replace(tmp: str, path: str) -> None:
    """Moves the complete file `tmp` to `path` durably: its data fsynced first, then the rename, then the folder."""
    fsync_file(tmp)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def save_safetensors(tensors: dict, path: str, metadata: Optional[dict], staged: bool = False) -> None:
    """safetensors' save_file of `tensors` to `path`, a write error raised naming `path`. staged: written whole or not
    at all, in a staging folder beside `path` (temporary_name: safetensors puts its own temporary file beside its
    target, so what a killed writer leaves is all in there, for remove_leftovers of the next write), fsynced, then
    renamed into place. Without `staged`, `path` is in a staging folder already."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    folder, name = os.path.split(os.path.abspath(path))
    stage = temporary_name(folder, name) if staged else None
    if stage:
        remove_leftovers(folder, name)
        os.mkdir(stage)
    try:
        try:
            save_file(tensors, os.path.join(stage, name) if stage else path, metadata=metadata)
        except (SafetensorError, OSError) as e:
            raise write_error(path, e) from e
        if stage:
            replace(os.path.join(stage, name), path)
    finally:
        if stage:
            shutil.rmtree(stage, ignore_errors=True)


def write_error(path: str, e: Exception) -> OSError:
    """An error while writing `path` as an OSError that names the file (safetensors' SafetensorError carries the OS's
    error only as text: 'I/O error: No space left on device (os error 28)')."""
    m = re.search(r"os error (\d+)", str(e))
    code = getattr(e, "errno", None) or (int(m.group(1)) if m else None)
    if code is None:
        return OSError(f"writing {path}: {e}")
    todo = "; free space there, or write elsewhere" if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else ""
    return OSError(code, f"writing {path}: {os.strerror(code)}{todo}")


def publish(stage: str, folder: str, before: list[str], commit: str, after: list[str], replaces: list[str]) -> None:
    """Moves the complete files of `stage` into `folder`, so that a reader of `folder`, whenever this stops (a crash,
    a kill), finds the files it replaces or the new ones, never a mix: first `before` (new shards, under names no file
    of `folder` has), then `commit` (the file a reader starts from: the index, or the only file) by one rename, then
    `after` (config.json), then `replaces` (the replaced export's files: nothing else) are removed. Every file and
    the folder are fsynced before each of those steps is taken as done. The plan is written to the stage first
    (JOURNAL), so that remove_leftovers of a later run finishes a publish that got past its commit and undoes one
    that did not."""
    os.makedirs(folder, exist_ok=True)
    fsync_dir(os.path.dirname(os.path.abspath(folder)))
    for name in before + [commit] + after:
        fsync_file(os.path.join(stage, name))
    plan = {"folder": os.path.abspath(folder), "before": before, "commit": commit, "after": after,
            "replaces": replaces}
    with open(os.path.join(stage, JOURNAL), "w") as f:
        json.dump(plan, f)
        f.flush()
        os.fsync(f.fileno())
    for name in before:
        os.replace(os.path.join(stage, name), os.path.join(folder, name))
    fsync_dir(folder)
    os.replace(os.path.join(stage, commit), os.path.join(folder, commit))
    fsync_dir(folder)
    finish_or_undo(stage)


def finish_or_undo(stage: str) -> None:
    """Takes a publish (of `stage`, per its JOURNAL) to its end if its commit was renamed into place, else back to
    where it began. Nothing to do for a stage whose publish never began."""
    try:
        with open(os.path.join(stage, JOURNAL)) as f:
            plan = json.load(f)
        folder = plan["folder"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    if os.path.exists(os.path.join(stage, plan["commit"])):  # not committed: the new shards go
        for name in plan["before"]:
            if not os.path.exists(os.path.join(stage, name)):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(folder, name))
    else:
        for name in plan["after"]:
            with contextlib.suppress(FileNotFoundError):
                os.replace(os.path.join(stage, name), os.path.join(folder, name))
        for name in plan["replaces"]:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(folder, name))
    fsync_dir(folder)
