"""Checkpoint files that come from strangers, read, and the user's folders written into, safely: files checked before
they are opened and measured before they are parsed; one writer per folder, files staged, fsynced and published by
one rename; only files an earlier export provably wrote are removed (docs/ARCHITECTURE.md, ".../files.py").
Long because reading and writing share one set of rules (links, FIFOs, folder locks, NFS) that must not drift apart."""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import os
import re
import shutil
import stat
import threading
import time
import uuid
import warnings
from typing import Optional

try:
    import fcntl
except ImportError:  # Windows: no flock; writers there are not kept apart
    fcntl = None

from .layouts import CheckpointFormatError

MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on a header (it refuses larger ones)
MAX_TENSORS = 300_000  # per safetensors file: a header of more is refused before it is parsed
MAX_METADATA = 10_000  # entries of a safetensors header's __metadata__ (string to string)
MAX_QUOTES = 2 * (5 * MAX_TENSORS + 2 * MAX_METADATA + 1)  # '"'s in a header of that many tensors and entries
MAX_JSON_BYTES = 64 * 2**20  # an index or config.json (an index of 100,000 tensors is about 10 MB)
# a path ending so is one safetensors file (.sft: Black Forest Labs' name for Flux's, flux1-dev.sft), read and
# written as one; any other path is a folder
FILE_SUFFIXES = (".safetensors", ".sft")


def names_a_file(path: str) -> bool:
    """Whether `path` ends in one of FILE_SUFFIXES, in any case, as ComfyUI reads them (comfy/utils.py
    load_torch_file): 'Flux.SafeTensors' was written as a folder of that name, and refused when read."""
    return path.lower().endswith(FILE_SUFFIXES)
DAMAGED = "the file is damaged or incomplete (an interrupted download?): download it again"


def some(items, first: int = 6, sep: str = ", ", names: bool = True) -> str:
    """Items for an error message: all of them if few, else the first few and how many there are. names: shown with
    repr() (names read from a file: a control character is escaped, not sent to the terminal); else as they are."""
    items = list(items)
    shown = sep.join(map(repr if names else str, items[:first]))
    return shown if len(items) <= first else f"{shown}{sep}... ({len(items)} in all)"


# ---- reading -----------------------------------------------------------------------------------------------------


def regular_file(path: str, what: str) -> str:
    """`path` if it is (or links to) a regular file, else an error naming `what` (a FIFO would block a reader)."""
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
    """folder/name for a name taken from the checkpoint itself: a relative name without '..' that resolves inside
    `roots` (allowed_roots(folder)) to a regular file; anything else is refused naming `what` (the index entry)."""
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


def parse_json(data: bytes, where: str, expected: str) -> dict:
    """`data` (the text of `where`) parsed as a JSON object; an error naming `where` and `expected`."""
    try:
        obj = json.loads(data.decode("utf-8"), object_pairs_hook=_once)
    except _Twice as e:
        raise CheckpointFormatError(f"{where}: names {e.args[0]!r} twice (which one is meant?); expected {expected}; "
                                    f"{DAMAGED}") from None
    except UnicodeDecodeError as e:
        raise CheckpointFormatError(f"{where}: not UTF-8 text (byte {e.start}); expected {expected}; "
                                    f"{DAMAGED}") from None
    except json.JSONDecodeError as e:
        raise CheckpointFormatError(f"{where}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
                                    f"expected {expected}; {DAMAGED}") from None
    except RecursionError:
        raise CheckpointFormatError(f"{where}: JSON nested too deep; expected {expected}; {DAMAGED}") from None
    if not isinstance(obj, dict):
        raise CheckpointFormatError(f"{where}: a JSON {type(obj).__name__}, expected {expected}; {DAMAGED}")
    return obj


# the JSON files beside the weights whose sha256 a dorafp8 export's index records (metadata key `sha256_key(name)`)
# and the loader checks: a reader never pairs one export's config (or ModelOpt's quant_algo) with another's weights
CHECKED_JSON = ("config.json", "hf_quant_config.json")


def sha256_key(name: str) -> str:
    return f"dorafp8_{name[:-len('.json')]}_sha256"  # "dorafp8_config_sha256", as exports before hf_quant_config


# a file read by os.open (not open(), which waits on a FIFO): without O_BINARY Windows opens it as text, whose
# reads turn CRLF into LF (a config.json written on Windows then failed its sha256 check) and stop at a Ctrl-Z
def _read_flags() -> int:
    return os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)


def read_json(path: str, expected: str, sha256_is: Optional[str] = None) -> dict:
    """The JSON object in the regular file `path` (at most MAX_JSON_BYTES); errors name the file. sha256_is: the
    digest its bytes must have (a CHECKED_JSON file, as the index of the weights beside it records it)."""
    # opened without waiting and measured open: a FIFO there (weight_files reads every index beside a model the user
    # loaded, which transformers, reading model.safetensors, never opened) blocked its reader for ever
    fd = os.open(path, _read_flags())
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # before fdopen, which refuses a folder naming the descriptor, not the file
        os.close(fd)
        raise CheckpointFormatError(f"{path}: " + ("a folder" if stat.S_ISDIR(st.st_mode) else
                                                   "not a regular file (a FIFO, a device?)") + f"; expected {expected}")
    with os.fdopen(fd, "rb") as f:
        if st.st_size > MAX_JSON_BYTES:
            raise CheckpointFormatError(f"{path}: {st.st_size} bytes, more than the {MAX_JSON_BYTES} dorafp8 reads "
                                        f"for {expected}; {DAMAGED}")
        data = f.read()
    if sha256_is is not None and hashlib.sha256(data).hexdigest() != sha256_is:
        raise CheckpointFormatError(f"{path}: not the file exported with the weights beside it (their index records "
                                    f"another sha256): an export to this folder is being published, or was killed "
                                    f"between the two (load again, or export again); or it was edited after the "
                                    f"export (to accept it, delete {sha256_key(os.path.basename(path))!r} from the "
                                    f"\"metadata\" of the index)")
    return parse_json(data, path, expected)


def index_weight_map(path: str) -> dict:
    """The "weight_map" of the safetensors index `path` ({tensor name: shard file}); {} where it has no such object."""
    weight_map = read_json(path, "a safetensors index (a JSON object)").get("weight_map")
    return weight_map if isinstance(weight_map, dict) else {}


def _check_header(path: str, where: str) -> None:
    """Refuses a safetensors header of more than MAX_HEADER_BYTES, MAX_TENSORS tensors or MAX_METADATA metadata
    entries, longer than its file, or naming a key twice. Counted before parsing, in bounded memory: each tensor entry
    is an object (a '{') of 5 strings, each metadata entry 2 strings (two '"' each), so '{'s and '"'s bound both."""
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
        objects, quotes, left = 0, 0, n
        while left:
            chunk = f.read(min(left, 2**20))
            objects += chunk.count(b"{")
            quotes += chunk.count(b'"')
            left -= len(chunk)
            if not chunk or objects > MAX_TENSORS + 2 or quotes > MAX_QUOTES:
                break
        if objects > MAX_TENSORS + 2 or quotes > MAX_QUOTES:  # + 2: the header itself and __metadata__
            raise CheckpointFormatError(f"{where}: a header of more than {MAX_TENSORS} tensors or {MAX_METADATA} "
                                        f"metadata entries, more than dorafp8 reads from one file (refused before "
                                        f"parsing it); {DAMAGED}")
        f.seek(8)
        try:
            header = json.loads(f.read(n), object_pairs_hook=_once)
        except _Twice as e:
            raise CheckpointFormatError(f"{where}: its header names {e.args[0]!r} twice (which copy is meant?); "
                                        f"{DAMAGED}") from None
        except (ValueError, RecursionError):
            return  # not JSON: safetensors says so, naming the file (open_safetensors)
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if isinstance(meta, dict) and len(meta) > MAX_METADATA:
        raise CheckpointFormatError(f"{where}: {len(meta)} metadata entries in its header, more than the "
                                    f"{MAX_METADATA} dorafp8 reads; {DAMAGED}")


class _Twice(Exception):
    """A JSON object with a key given twice (json keeps the last silently)."""


def _once(pairs: list) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set = set()
        raise _Twice(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return obj


@contextlib.contextmanager
def open_safetensors(path: str, where: str, device: str = "cpu"):
    """safetensors' safe_open of `path`, header measured first; errors name `where` and what to do."""
    from safetensors import SafetensorError, safe_open

    _check_header(regular_file(path, where), where)  # a FIFO (planted in a Hugging Face cache) blocked the open
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
        slices = {k: f.get_slice(k) for k in f.keys()}
        return f.metadata() or {}, {k: (sl.get_dtype(), tuple(sl.get_shape())) for k, sl in slices.items()}


# ---- writing -----------------------------------------------------------------------------------------------------

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # 0 on Windows: a link there is followed (making one needs developer mode)
LOCK_TIMEOUT = 600.0  # seconds a second writer to the same folder waits before it gives up, naming the folder


def identity(path: str) -> Optional[tuple]:
    """(device, inode, size, mtime, path) of the file `path` (links followed); None where it cannot be stat'ed. Size
    and mtime too: an inode is reused once its file is gone, and `cp other.safetensors it` rewrites the same inode,
    so (device, inode) alone took another file for the model's original (a link or hard link shares all four)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, path


def loaded_from(path: str, originals) -> Optional[str]:
    """The path of the one of `originals` (identity()s of the files a model was loaded from) that `path` is now (a
    link, a hard link, another spelling of it), else None: a writer never replaces a model's own weights."""
    me = identity(path)
    return next((o[-1] for o in originals if me is not None and o[:-1] == me[:-1]), None)


def weight_files(folder) -> tuple:
    """identity()s of the weight files from_pretrained may have read from a local `folder`: model.safetensors (or
    diffusers' diffusion_pytorch_model.safetensors), the legacy pytorch_model.bin (diffusion_pytorch_model.bin), their
    variants (model.fp16.safetensors, from_pretrained(variant=)), and the shards each of their indexes
    (model.safetensors.index*.json, pytorch_model.bin.index*.json) names; not every weight file there (a stray one,
    an export of something else, is no original of this model)."""
    if not isinstance(folder, (str, os.PathLike)) or not os.path.isdir(folder):  # diffusers keeps a Path as given
        return ()
    folder = os.fspath(folder)
    names = set()
    for stem, ext in (("model", "safetensors"), ("diffusion_pytorch_model", "safetensors"), ("pytorch_model", "bin"),
                      ("diffusion_pytorch_model", "bin")):
        names.update(os.path.basename(p) for p in glob.glob(os.path.join(glob.escape(folder), f"{stem}*.{ext}"))
                     if re.fullmatch(rf"{stem}(\.[^.]+)?\.{ext}", os.path.basename(p)))
        for index in glob.glob(os.path.join(glob.escape(folder), f"{stem}.{ext}.index*.json")):
            try:
                names.update(map(str, index_weight_map(index).values()))
            except (OSError, ValueError):  # unreadable now: from_pretrained read no shard it names
                pass
    return tuple(filter(None, (identity(os.path.join(folder, n)) for n in sorted(names))))


# the weight files transformers' and diffusers' from_pretrained(folder) choose among, each library in its order: a file
# of one of these names beside another of its set is read in that one's place, or never read (a variant's likewise)
_LOADED_TOGETHER = (("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                     "pytorch_model.bin.index.json"),
                    ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.safetensors.index.json",
                     "diffusion_pytorch_model.bin", "diffusion_pytorch_model.bin.index.json"))


def _with_variant(name: str, variant: Optional[str]) -> str:  # transformers' and diffusers' _add_variant
    return name if variant is None else "{0}.{2}.{1}".format(*name.rsplit(".", 1), variant)


def refuse_shadowing(folder: str, name: str, path: str) -> None:
    """Refuses to write `folder/name` where from_pretrained(folder) would choose between it and another weight file
    there (model.safetensors beside pytorch_model.bin: the export read in place of the user's legacy weights, which
    then never load, without a word); `path`: the path the user gave, named in the error."""
    for names in _LOADED_TOGETHER:
        for variant in (None, *name.split(".")):
            group = [_with_variant(n, variant) for n in names]
            if name in group:
                there = [n for n in group if n != name and os.path.lexists(os.path.join(folder, n))]
                if there:
                    raise FileExistsError(
                        f"path={path!r}: {folder} holds {some(there)}, and from_pretrained({folder!r}) (transformers, "
                        f"diffusers) reads one of those or {name!r}, never both: written there, the export would "
                        f"silently load in place of those files, or never load. Nothing was written: export to "
                        f"another folder or file name, or move {some(there)} away first")
                return


def destination(path: str) -> str:
    """`path` with its symlinks resolved; a dangling link is refused naming it."""
    if os.path.islink(path) and not os.path.exists(path):
        raise FileNotFoundError(f"path={path!r} is a symbolic link to {os.readlink(path)!r}, which does not exist; "
                                f"point it at a folder that exists, or remove the link")
    return os.path.realpath(path)


LOCK_FILE = ".dorafp8.lock"  # locked instead of a folder that cannot be (NFS); made where needed, never removed
# this process's writers, kept apart here too: NFS's flock is a POSIX lock, whose owner is the process (its threads
# all get it, and a close of any descriptor of the file releases it), and this process's live stages (_leftovers)
_IN_PROCESS: dict = {}
_LIVE: set = set()
_GUARD = threading.Lock()


@contextlib.contextmanager
def locked(folder: str, what: str):
    """Holds the OS's exclusive lock (flock) on `folder` itself or, where a folder cannot be locked, on its file
    LOCK_FILE: a second writer waits up to LOCK_TIMEOUT seconds, then is refused naming `what`. Where
    neither can be locked, a warning says so."""
    timeout = LOCK_TIMEOUT  # read at each call (a test lowers it)
    wait = dict(deadline=time.monotonic() + timeout, folder=folder, what=what, timeout=timeout)
    with _GUARD:
        mine = _IN_PROCESS.setdefault(folder, threading.Lock())
    if not mine.acquire(timeout=timeout):
        raise TimeoutError(f"{what}: another export to {folder} has held its lock for {timeout:g} s; wait for it "
                           f"to finish, or write elsewhere")
    fd = None
    try:
        if fcntl is not None:  # without (Windows) nothing locks, and a folder cannot be opened (PermissionError)
            fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        why = _wait_for_lock(fd, **wait)
        if why is not None:
            # NFS takes flock as a POSIX lock, which needs a descriptor open for writing (flock(2)), and a folder
            # cannot be opened for writing: a file in it can. Never removed: a writer that removed it could let two
            # writers hold two files of the name (one waiting on the removed file, one on a new one).
            os.close(fd)
            fd = None
            fd, why_not = _lock_file(folder)
            why_not = why_not or _wait_for_lock(fd, **wait)
            if why_not is not None:
                warnings.warn(f"{what}: {folder} cannot be locked ({why}), nor its {LOCK_FILE} ({why_not}): two "
                              f"exports to it at once would not be kept apart", stacklevel=4)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock
        mine.release()


def _wait_for_lock(fd: int, deadline: float, folder: str, what: str, timeout: float) -> Optional[str]:
    """Takes the exclusive lock on `fd`, waiting until `deadline` (then a TimeoutError naming `what`); None once
    taken (or without fcntl), else why it cannot be taken."""
    while fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return None
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{what}: another export to {folder} has held its lock for {timeout:g} s; "
                                   f"wait for it to finish, or write elsewhere") from None
            time.sleep(0.02)
        except OSError as e:
            return e.strerror or str(e)
    return None


def _lock_file(folder: str) -> tuple[Optional[int], Optional[str]]:
    """(a descriptor of `folder`/LOCK_FILE open for writing, the file made if missing, None), or (None, why not).
    Anything but a regular file under that name (a link, a FIFO, a folder) is neither followed nor opened; nothing
    is ever written to it."""
    path = os.path.join(folder, LOCK_FILE)
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None, "not a regular file"
    except FileNotFoundError:
        pass
    except OSError as e:
        return None, e.strerror
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0), 0o666)
    except OSError as e:  # a read-only folder, another user's lock file, a link planted since
        return None, e.strerror
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None, "not a regular file"
    return fd, None


def _held(path: str, flags: int) -> Optional[bool]:
    """Whether a live writer holds the lock on `path` (opened with `flags`, links not followed): True, False (its lock
    taken and let go at once; always without fcntl), or None where it cannot be opened or locked (NFS: a folder)."""
    try:
        fd = os.open(path, flags | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)  # releases a lock taken here


def _leftovers(folder: str, name: str) -> list[str]:
    """The stages named like ours in `folder` that no live writer holds. A live one locks itself and its LOCK_FILE
    (staging): where a folder cannot be locked (NFS), the file says; a stage that can be told by neither is live."""
    try:
        found = sorted(n for n in os.listdir(folder) if n.startswith(f".{name}.") and n.endswith(".partial"))
    except OSError:
        return []
    left = []
    for n in found:
        path = os.path.join(folder, n)
        if path in _LIVE:  # this process's (a close here would release its POSIX lock, on NFS)
            continue
        try:  # only a real folder is opened (a planted FIFO would block the open, a device act on it)
            real_folder = stat.S_ISDIR(os.lstat(path).st_mode)
        except OSError:
            real_folder = False
        held = _held(path, os.O_RDONLY) if real_folder else False
        if held is None:
            lock = os.path.join(path, LOCK_FILE)
            with contextlib.suppress(OSError):
                if stat.S_ISREG(os.lstat(lock).st_mode):
                    held = _held(lock, os.O_RDWR)
        if held is False:
            left.append(n)
    return left


def killed_stages(folder: str, name: str) -> list[str]:
    """The paths of the real folders (not links) among `_leftovers(folder, name)`: stages no live writer holds. A
    stage whose folder and LOCK_FILE can both not be locked (an older version's, on NFS) is not among them: a live
    one could not be told from a killed one; nor is any without fcntl (Windows), where no writer locks its stage."""
    out = []
    for n in _leftovers(folder, name) if fcntl is not None else []:
        path = os.path.join(folder, n)
        with contextlib.suppress(OSError):
            if stat.S_ISDIR(os.lstat(path).st_mode):
                out.append(path)
    return out


@contextlib.contextmanager
def staging(folder: str, name: str):
    """A new hidden folder `.<name>.<random>.partial` in `folder` (renames never cross disks), locked while in use,
    removed at the end. Stages nobody holds (killed writers', or planted) are named in a warning, never removed."""
    left = _leftovers(folder, name)
    if left:
        warnings.warn(f"{folder}: {some(left)} left by exports that were killed, or put there by someone else; "
                      f"dorafp8 removes nothing it cannot prove it wrote: delete them if no export is running",
                      stacklevel=4)
    stage = os.path.join(folder, f".{name}.{uuid.uuid4().hex}.partial")
    os.mkdir(stage)
    # Windows opens no folder (PermissionError), and locks nothing: only where fcntl is
    fds = [os.open(stage, os.O_RDONLY) if fcntl is not None else None]
    _LIVE.add(stage)
    try:
        # tell other writers' _leftovers that this stage is live: the folder locked, or, where a folder cannot be
        # (NFS), a file in it opened for writing
        fds.append(os.open(os.path.join(stage, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666))
        if fcntl is not None:
            for fd in fds:
                with contextlib.suppress(OSError):
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield stage
    finally:
        # the lock file is closed before it is removed: NFS renames a removed file still open to .nfsXXXX (its silly
        # rename), and the stage folder holding that could not be removed. Renamed first, so that the stage never
        # reads as a killed one's meanwhile (it holds no lock file then, as one that cannot be told: live)
        with contextlib.suppress(OSError):
            os.rename(os.path.join(stage, LOCK_FILE), os.path.join(stage, LOCK_FILE + ".closed"))
        for fd in fds[1:]:
            os.close(fd)
        shutil.rmtree(stage, ignore_errors=True)
        _LIVE.discard(stage)
        if fds[0] is not None:
            os.close(fds[0])


# what fsync says on a file system that has no fsync (VirtualBox's vboxsf, some FUSE ones): the data are written,
# as durable as that file system makes them, and a write there without dorafp8 works
_NO_FSYNC = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}


def fsync_file(path: str, name: Optional[str] = None) -> None:
    """`path`'s data made durable; an error (ENOSPC, EDQUOT, EIO: NFS and delayed allocation report a full disk only
    here) raised naming `name` (the file the user asked for) or `path`; none where the file system has no fsync."""
    try:
        fd = os.open(path, _sync_flags())
        try:
            _fsync(fd, name or path)
        finally:
            os.close(fd)
    except OSError as e:
        raise write_error(name or path, e) from e


def _sync_flags() -> int:
    # Windows (the one os with O_BINARY): its fsync (FlushFileBuffers) needs a file open for writing (EBADF on a
    # read-only one, so every export failed there); POSIX syncs any, and a staged file a umask made read-only (0o444)
    # opens only so
    return os.O_RDWR | os.O_BINARY if hasattr(os, "O_BINARY") else os.O_RDONLY


def _fsync(fd: int, name: str) -> None:
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _NO_FSYNC:
            raise write_error(name, e) from e


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


def replace(tmp: str, path: str, like: Optional[os.stat_result] = None) -> None:
    """Moves the complete file `tmp` to `path` durably: its data fsynced first, then the rename, then the folder.
    like: the stat of the file replaced, whose owner, group and mode (who may read it) `tmp` gets, as a write into it
    would keep them (root in a container replacing a user's 0o600 file left it unreadable to that user). Given to the
    file opened here, links not followed (fchown, fchmod), before its fsync, which makes them durable with the data:
    chown / chmod by path followed a link planted in the stage's place (the folder's owner renames our stage away and
    puts a link to /etc/shadow there), so root gave that file to them; and a hard-linked or swapped file is refused.
    Best effort: only root gives a file to another user (else the group, where the writer is in it), and vfat / NTFS
    mounts and some NFS / CIFS ones refuse chmod (EPERM)."""
    try:
        fd = os.open(tmp, _sync_flags() | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise write_error(path, e) from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:  # 0: some FUSE file systems say no count
            why = (f"has {st.st_nlink} names: another was linked to it (a backup or sync tool in that folder, "
                   f"someone else writing there?)" if stat.S_ISREG(st.st_mode) else "was replaced by another")
            raise OSError(f"writing {path}: the file staged for it ({tmp}) {why} while the export ran; nothing was "
                          f"published ({path} is as it was): export again")
        if like is not None:
            if hasattr(os, "fchown"):  # not on Windows
                try:
                    os.fchown(fd, like.st_uid, like.st_gid)
                except OSError:
                    with contextlib.suppress(OSError):
                        os.fchown(fd, -1, like.st_gid)
            # after chown; the permission bits only: a set-id bit copied where that chown failed (a uid unmapped in a
            # user namespace) made a root-owned export set-uid
            with contextlib.suppress(OSError, AttributeError):
                os.fchmod(fd, stat.S_IMODE(like.st_mode) & 0o777)
        _fsync(fd, path)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        for chunk in iter(lambda: f.read(2**22), b""):
            h.update(chunk)
    return h.hexdigest()


def save_safetensors(tensors: dict, path: str, metadata: Optional[dict], name: Optional[str] = None) -> None:
    """safetensors' save_file of `tensors` to `path` (a new file), a write error raised naming `name` or `path`. The
    file gets the mode open() gives a new file (0o666 less the umask): safetensors >= 0.8 writes a temporary file
    of mode 0o600 and renames it (safetensors issue 782), which another user (a server, a container) cannot read."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        with open(path, "wb"):  # made as open() makes files; its mode read back (os.umask would set the process's)
            pass
        mode = stat.S_IMODE(os.stat(path).st_mode)
        save_file(tensors, path, metadata=metadata)
    except (SafetensorError, OSError) as e:
        raise write_error(name or path, e) from e
    # a courtesy, not the write: vfat / NTFS mounts and some NFS / CIFS ones refuse chmod (EPERM), and the file
    # written there is whole. On the file opened without following links, and not on a hard link (a file swapped
    # into a stage the folder's owner renamed away, as in replace())
    with contextlib.suppress(OSError, AttributeError):  # no os.fchmod on Windows before Python 3.13
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_nlink <= 1:
                os.fchmod(fd, mode)
        finally:
            os.close(fd)


def save_file_atomic(tensors: dict, path: str, metadata: Optional[dict]) -> None:
    """One .safetensors file at `path`, whole or not at all: staged beside it, locked, fsynced, renamed."""
    real = destination(path)
    if os.path.islink(path) and os.path.isfile(real):
        # written through, the link's target would be replaced: a Hugging Face cache blob (which every snapshot that
        # links it then serves as the new file, under the old file's hash), another model's file
        raise FileExistsError(f"path={path!r} is a symbolic link to the file {real!r}, which writing through it "
                              f"would replace (a Hugging Face cache's blob, another model's file?); it is not "
                              f"overwritten: write to another path, or remove the link first")
    if os.path.isdir(real):  # refused before the file is written (the rename onto it would fail after)
        link = f" (a link to {real!r})" if os.path.islink(path) else ""
        raise IsADirectoryError(f"path={path!r} is a folder{link}; a path ending in .safetensors is written as one "
                                f"file: move the folder away, or give the file another name")
    folder, name = os.path.split(real)
    with locked(folder, f"path={path!r}"), staging(folder, name) as stage:
        refuse_shadowing(folder, name, path)
        save_safetensors(tensors, os.path.join(stage, name), metadata, path)
        try:  # a file replaced keeps its owner and mode (who may read it), as a write into it would; not one planted
            # by a stranger (another user's 0o666 file in a shared folder: /tmp), whose owner and mode would let them
            # rewrite the export: only a file of the writer's own or of the folder's owner's
            st = os.lstat(real)
            ours = stat.S_ISREG(st.st_mode) and st.st_uid in (getattr(os, "geteuid", lambda: 0)(),
                                                              os.stat(folder).st_uid)
        except OSError:
            ours = False
        replace(os.path.join(stage, name), real, st if ours else None)


def write_error(path: str, e: Exception) -> OSError:
    """An error while writing `path` as an OSError naming the file (SafetensorError has it as text only)."""
    m = re.search(r"os error (\d+)", str(e))
    code = getattr(e, "errno", None) or (int(m.group(1)) if m else None)
    if code is None:
        return OSError(f"writing {path}: {e}")
    todo = "; free space there, or write elsewhere" if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else ""
    return OSError(code, f"writing {path}: {os.strerror(code)}{todo}")


def export_metadata(folder: str, index_name: str) -> dict:
    """The "metadata" object of the index `folder/index_name` ({} where there is none, or it is a link, not a regular
    file, too large or malformed): what an earlier export there recorded (its files, its JSON files' sha256)."""
    try:
        fd = os.open(os.path.join(folder, index_name), _read_flags() | _NOFOLLOW)
    except OSError:
        return {}
    try:
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_JSON_BYTES:
                return {}
            meta = json.loads(f.read())["metadata"]
    except (OSError, ValueError, RecursionError, LookupError, TypeError):
        return {}
    return meta if isinstance(meta, dict) else {}


def previous_export(meta: dict, folder: str, pattern: re.Pattern) -> dict:
    """{name: {"size", "sha256"}} of the files a new export may remove (listed in the old index's `meta`, of the
    writer's own name `pattern`, unchanged)."""
    files = meta.get("dorafp8_files")
    if not isinstance(files, dict):
        return {}
    out = {}
    for name, rec in files.items():
        if not (isinstance(name, str) and pattern.fullmatch(name) and isinstance(rec, dict)):
            continue
        path = os.path.join(folder, name)
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_size == rec.get("size") and sha256(path) == rec.get("sha256"):
                out[name] = {"size": st.st_size, "sha256": rec["sha256"]}
        except OSError:
            continue
    return out
