"""Issue 48: the writers trust nothing they find. State planted beside or inside the destination (a staging folder, a
journal, an index naming other files) never makes an export touch a path outside its folder, nor a file no export
wrote, and never blocks it; two exports at once leave one whole export or a clear error; a reader during a publish,
and a folder after a kill at every step of one, pair one export's config.json with the same export's weights (or the
loader refuses the pair, naming it); destinations (a link to another disk, a dangling link, a bad max_shard_size) and
loaders (a name given twice, a header's metadata, names with control characters) are refused or handled by name."""

import errno
import json
import os
import pathlib
import random
import re
import shutil
import stat
import struct
import subprocess
import threading
import time
import uuid
import warnings

import pytest
import torch

import dorafp8
import dorafp8.checkpoint.files as files
import dorafp8.checkpoint.write as W
from dorafp8.checkpoint import CheckpointFormatError
from dorafp8.checkpoint.source import CheckpointSource
from tests.checkpoint.test_export_folders import (SHARDED, SINGLE, USER_FILES, _export, _in_child, _killed_at_every_step,
                                                   _killed_stages, _net, _output_of, _user_files_intact, _user_folder)
from tests.checkpoint.test_load_all_or_nothing import X, _target
from tests.checkpoint.test_load_all_or_nothing import sharded  # noqa: F401 - a fixture

st = pytest.importorskip("safetensors.torch")
INDEX = "model.safetensors.index.json"


def _tree(root):
    """Everything under `root` (links not followed): path -> bytes, 'dir', 'fifo' or ('link', target)."""
    out = {}
    for folder, dirs, names in os.walk(root):
        for n in dirs + names:
            p = os.path.join(folder, n)
            rel = os.path.relpath(p, root)
            out[rel] = ("link", os.readlink(p)) if os.path.islink(p) else "dir" if os.path.isdir(p) else \
                "fifo" if stat.S_ISFIFO(os.lstat(p).st_mode) else open(p, "rb").read()
    return out


# ---- planted state -----------------------------------------------------------------------------------------------

def _journals(dest, elsewhere):
    """Staging folders as earlier versions' writers named them (`.<name>.<pid>-<hex>.partial`, beside the
    destination) holding a `.publish.json`: pid field -> (journal, files in the stage). Each made an export before
    issue 48 delete or write outside the folder, delete the user's files, or raise a raw error."""
    dead = "999999999"  # no process has that id
    return {
        "absolute-undo": (dead, {"folder": str(elsewhere), "before": ["victim.txt"], "commit": "x", "after": [],
                                 "replaces": []}, {"x": b"x"}),
        "absolute-finish": (dead, {"folder": str(elsewhere), "before": [], "commit": "gone", "after": ["evil.py"],
                                   "replaces": ["victim.txt"]}, {"evil.py": b"import os"}),
        "relative-dotdot": (dead, {"folder": "../elsewhere", "before": [], "commit": "gone", "after": [],
                                   "replaces": ["victim.txt"]}, {}),
        "dot": (dead, {"folder": ".", "before": [], "commit": "gone", "after": ["evil.py"], "replaces": []},
                {"evil.py": b"import os"}),
        "names-with-dotdot": (dead, {"folder": str(dest), "before": [], "commit": "gone", "after": [],
                                     "replaces": ["../elsewhere/victim.txt"]}, {}),
        "user-files": (dead, {"folder": str(dest), "before": [], "commit": "gone", "after": [],
                              "replaces": ["notes.txt", "model-v1.safetensors"]}, {}),
        "not-json": (dead, b"{oops", {"mine.txt": b"a user's folder that only looks like a stage"}),
        "no-commit": (dead, {"folder": str(dest), "before": [], "after": [], "replaces": []}, {}),
        "before-null": (dead, {"folder": str(dest), "before": None, "commit": "x", "after": [], "replaces": []},
                        {"x": b"x"}),
        "commit-5": (dead, {"folder": str(dest), "before": [], "commit": 5, "after": [], "replaces": []}, {}),
        "replaces-a-folder": (dead, {"folder": str(elsewhere.parent), "before": [], "commit": "gone", "after": [],
                                     "replaces": ["elsewhere"]}, {}),
        "pid-overflow": ("9" * 25, {"folder": str(dest), "before": [], "commit": "gone", "after": [],
                                    "replaces": []}, {}),
        "pid-superscript": ("\u00b2", {"folder": str(dest), "before": [], "commit": "gone", "after": [],
                                       "replaces": []}, {}),
        "another-export-2024": (str(os.getpid()), {}, {"live-shard.safetensors": b"a live export's"}),
    }


@pytest.mark.parametrize("case", sorted(_journals(".", pathlib.Path("."))))
def test_planted_stages_and_journals_touch_nothing_and_block_nothing(tmp_path, monkeypatch, case):
    """A planted stage (each form above, beside the folder export `ckpt` and beside the file `one.safetensors`, and a
    new-style one inside `ckpt`) and a forged index (naming the user's files, a path outside, with made-up digests,
    or a link to another folder's index): the exports work, and every file outside the export's own is as it was:
    the user's, the planted ones, the folder elsewhere, the working directory. Before issue 48 each form deleted or
    wrote outside the folder, deleted the user's files, or raised a raw error that blocked every later export."""
    elsewhere, cwd = tmp_path / "elsewhere", tmp_path / "cwd"
    elsewhere.mkdir()
    cwd.mkdir()
    (elsewhere / "victim.txt").write_bytes(b"not yours")
    monkeypatch.chdir(cwd)
    dest = _user_folder(tmp_path)
    pid, journal, content = _journals(dest, elsewhere)[case]
    # another-export-2024: the live stage of an export to ckpt.2024-06-01, whose "2024" was read as a dead pid
    for name in ("ckpt", "one.safetensors") if case != "another-export-2024" else ("ckpt.2024-06-01",):
        stage = tmp_path / f".{name}.{pid}-0123abcd.partial"
        stage.mkdir()
        for n, data in content.items():
            (stage / n).write_bytes(data)
        if journal:
            (stage / ".publish.json").write_bytes(journal if isinstance(journal, bytes) else
                                                  json.dumps(journal).encode())
    inner = dest / f".model.{uuid.uuid4().hex}.partial"  # one as this version's writers name them
    inner.mkdir()
    (inner / ".publish.json").write_text(json.dumps({"folder": str(elsewhere), "replaces": ["victim.txt"]}))
    (dest / FORGED).write_bytes(b"mine")  # the user's file, under a name of the writer's own form
    os.mkfifo(dest / f".model.{uuid.uuid4().hex}.partial")  # opening it would block for ever
    (dest / ".model.not-a-stage.partial").symlink_to(elsewhere)
    before = {k: v for k, v in _tree(tmp_path).items() if not k.startswith("ckpt/") or k.startswith("ckpt/.")}
    a, b = _net(0), _net(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the one naming the planted stage inside ckpt
        _export(a, dest, SHARDED)
        _forge_index(dest, elsewhere)
        _export(b, dest, SHARDED)
        _export(a, tmp_path / "one.safetensors")
    with torch.no_grad():
        assert torch.equal(_output_of(dest), b(X))
    after = _tree(tmp_path)
    assert {k: after.get(k) for k in before} == before
    _user_files_intact(dest)
    assert (dest / FORGED).read_bytes() == b"mine"


FORGED = "model-0123abcd-00001-of-00001.safetensors"


def _forge_index(dest, elsewhere):
    """The index as someone may have edited it: its dorafp8_files naming the user's files, a path outside, a name of
    the writer's own form that the user's file has, with made-up digests; the real shards stay listed."""
    index = json.loads((dest / INDEX).read_text())
    forged = {"notes.txt": {"size": 4, "sha256": "0" * 64}, "../elsewhere/victim.txt": {"size": 9, "sha256": "0"},
              FORGED: {"size": 4, "sha256": "0" * 64}, "x": 5, "y": None}
    index.setdefault("metadata", {}).setdefault("dorafp8_files", {}).update(forged)
    (dest / INDEX).write_text(json.dumps(index))


def test_an_index_that_links_elsewhere_or_is_malformed_removes_nothing(tmp_path):
    """The previous index a link to another folder's index (a copy made with links, or planted), a FIFO, or not an
    object of the expected form: the writer reads no list of files to remove from it, removes nothing, and refuses to
    replace an index it cannot prove an export wrote."""
    a = _net(0)
    other = tmp_path / "other"
    _export(a, other, SHARDED)
    theirs = _tree(other)
    dest = _user_folder(tmp_path)
    for bad in ("link", "fifo", b"[1, 2]", b'{"metadata": 5}', b'{"metadata": {"dorafp8_files": [1]}}', b"\xff"):
        (dest / INDEX).unlink(missing_ok=True)
        if bad == "link":
            os.symlink(other / INDEX, dest / INDEX)
        elif bad == "fifo":
            os.mkfifo(dest / INDEX)  # opening it to read would block for ever
        else:
            (dest / INDEX).write_bytes(bad)
        with pytest.raises(FileExistsError, match="which no dorafp8 export wrote"):
            _export(a, dest, SHARDED)
        assert _tree(other) == theirs
        _user_files_intact(dest)


@pytest.mark.filterwarnings("ignore")  # the planted stage, named
@pytest.mark.parametrize("where", ["a killed stage", "the folder"])
def test_a_planted_stage_index_removes_no_more_than_a_planted_index(tmp_path, where):
    """An index planted in a hidden stage (`.model.<hex>.partial`, no live writer holding it: read as a killed
    export's) is trusted as an index planted in the folder is, no further: with the right sizes and sha256 it
    records the user's files under names not of the writer's own form, a path outside the folder, and a link of the
    writer's form to the user's file; the export removes none of them."""
    dest = _user_folder(tmp_path)
    (tmp_path / "outside.safetensors").write_bytes(b"not yours")
    os.symlink("notes.txt", dest / FORGED)
    named = {n: dest / n for n in USER_FILES} | {"../outside.safetensors": tmp_path / "outside.safetensors",
                                                   FORGED: dest / FORGED}
    meta = {"dorafp8_files": {n: {"size": p.stat().st_size, "sha256": files.sha256(str(p))} for n, p in named.items()}}
    folder = dest / f".model.{uuid.uuid4().hex}.partial" if where == "a killed stage" else dest
    folder.mkdir(exist_ok=True)
    (folder / INDEX).write_text(json.dumps({"metadata": meta, "weight_map": {}}))
    before = {k: v for k, v in _tree(tmp_path).items() if k != f"ckpt/{INDEX}"}
    net = _net(0)
    _export(net, dest, SHARDED)
    after = _tree(tmp_path)
    assert {k: after.get(k) for k in before} == before
    with torch.no_grad():
        assert torch.equal(_output_of(dest), net(X))


@pytest.mark.filterwarnings("ignore")  # the killed writers' stages, named
def test_an_export_into_a_copy_never_touches_the_original(tmp_path):
    """A folder (and what lies beside it) copied with `cp -a` after an export into it was killed, at each step in
    turn: an export into the copy acted on the original path (the journal's absolute folder) and deleted the newer
    export's shards there. Here the original stays byte for byte as it was, and the copy loads the new export."""
    a, b = _net(0), _net(1)
    pristine = tmp_path / "pristine"
    _export(a, pristine / "ckpt", SHARDED)
    for step, orig, _ in _killed_at_every_step(pristine, lambda orig: _export(b, orig / "ckpt", SHARDED)):
        copy = tmp_path / f"copy{step}"
        subprocess.run(["cp", "-a", str(orig), str(copy)], check=True)
        before = _tree(orig)
        _export(a, copy / "ckpt", SHARDED)
        assert _tree(orig) == before, f"killed at step {step}"
        with torch.no_grad():
            assert torch.equal(_output_of(copy / "ckpt"), a(X))


# ---- two writers -------------------------------------------------------------------------------------------------

def _paused(monkeypatch, rng, names=("replace", "remove", "mkdir", "rename"), most=0.005):
    """Every call of os.<names> (each step of a publish) first sleeps 0 to `most` seconds, drawn from rng: a random
    interleaving of the threads."""
    guard = threading.Lock()
    for name in names:
        real = getattr(os, name)

        def f(*args, _real=real, **kwargs):
            with guard:
                pause = rng.random() * most
            time.sleep(pause)
            return _real(*args, **kwargs)
        monkeypatch.setattr(os, name, f)


@pytest.mark.parametrize("seed", range(20))
def test_two_exports_at_once_leave_one_whole_export_or_a_clear_error(tmp_path, monkeypatch, seed):
    """Two threads export two models into one folder holding a previous export and the user's files, each step
    paused at random (20 interleavings; every fourth with no wait for the lock). Before issue 48 both returned
    success and left an index naming deleted shards. Here the folder loads as one of the two exports, whole, its
    index names only files that are there, the previous export's shards are gone and the user's files are not; a
    writer that did not get the lock says so, naming the folder."""
    rng = random.Random(seed)
    nets = {"a": _net(0), "b": _net(1)}
    with torch.no_grad():
        want = {k: n(X) for k, n in nets.items()}
    dest = _user_folder(tmp_path)
    _export(_net(2), dest, SHARDED)
    _paused(monkeypatch, rng, most=0.03)
    if seed % 4 == 3:
        monkeypatch.setattr(files, "LOCK_TIMEOUT", 0.0, raising=False)
    said, start = {}, threading.Barrier(2)

    def run(k):
        start.wait()
        try:
            _export(nets[k], dest, SHARDED)
            said[k] = None
        except Exception as e:  # noqa: BLE001 - checked below
            said[k] = e

    threads = [threading.Thread(target=run, args=(k,)) for k in nets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = {k: e for k, e in said.items() if e is not None}
    assert len(errors) < 2 and all(isinstance(e, TimeoutError) and "another export to" in str(e)
                                   and str(dest) in str(e) for e in errors.values()), errors
    monkeypatch.undo()
    out = _output_of(dest)
    which = [k for k in nets if torch.equal(out, want[k])]
    assert len(which) == 1 and which[0] not in errors
    shards = set(json.loads((dest / INDEX).read_text())["weight_map"].values())
    assert sorted(os.listdir(dest)) == sorted([*USER_FILES, INDEX, *shards])
    _user_files_intact(dest)


# ---- readers and kills: config.json and the weights of one export ------------------------------------------------

def _with_configs(monkeypatch, nets):
    """Each export writes a config.json naming the model it holds (as a transformers model's does its architecture
    and quantization_config): W.write_config replaced."""
    names = {id(n): k for k, n in nets.items()}

    def write_config(t, stage, report, out):
        with open(os.path.join(stage, "config.json"), "w") as f:
            json.dump({"export": names[id(t.base)]}, f)
    monkeypatch.setattr(W, "write_config", write_config)


def _references(tmp_path, nets):
    out = {}
    for k, net in nets.items():
        _export(net, tmp_path / f"ref-{k}", SHARDED)
        src = CheckpointSource(str(tmp_path / f"ref-{k}"))
        out[k] = dict(src.read(list(src.info), "cpu"))
    return out


def _read(dest, refs):
    """What a reader of `dest` sees: (config.json's export, the weights' export or 'a mix'), or the error it got."""
    try:
        src = CheckpointSource(str(dest))
        tensors = dict(src.read(list(src.info), "cpu"))
    except CheckpointFormatError as e:
        assert "not the file exported with the weights beside it" in str(e), str(e)
        return "refused"
    except OSError as e:  # a shard of the index it read removed under it: an error, never a mix
        return type(e).__name__
    weights = [k for k, ref in refs.items() if tensors.keys() == ref.keys()
               and all(torch.equal(tensors[n], ref[n]) for n in ref)]
    return (src.config or {}).get("export"), (weights[0] if len(weights) == 1 else "a mix")


def test_a_reader_during_publishes_sees_one_exports_config_and_weights(tmp_path, monkeypatch):
    """A reader polls a folder while another thread exports two models into it in turn, each with its own
    config.json, every step paused at random. Before issue 48 the index was renamed in before config.json: a reader
    found one export's weights with the other's config (transformers loads that mix without an error). Here every
    read is one export's config and weights, or refused naming config.json, or fails to open a shard removed under
    it; never a mix."""
    nets = {"a": _net(0), "b": _net(1)}
    refs = _references(tmp_path, nets)
    _with_configs(monkeypatch, nets)
    dest = tmp_path / "ckpt"
    _export(nets["a"], dest, SHARDED)
    _paused(monkeypatch, random.Random(0), ("replace", "remove"))
    stop, seen = threading.Event(), []

    def reader():
        while not stop.is_set():
            seen.append(_read(dest, refs))

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(12):
            _export(nets["ab"[i % 2]], dest, SHARDED if i % 3 else SINGLE)
    finally:
        stop.set()
        t.join()
    pairs = [s for s in seen if isinstance(s, tuple)]
    assert all(c == w for c, w in pairs), sorted(set(s for s in pairs if s[0] != s[1]))
    assert {w for _, w in pairs} == {"a", "b"}, seen


@pytest.mark.parametrize("whose", ["the user's", "edited"])
def test_a_config_json_no_export_wrote_is_never_replaced(tmp_path, monkeypatch, whose):
    """Each export writes a config.json (as a transformers or diffusers model's does). A folder holding the user's own
    config.json (their project's, their home's, the model's own folder's), or one edited after the export that wrote
    it: it was replaced, silently. Refused now, naming it, with nothing changed; an export's own config.json is still
    replaced by the next export."""
    nets = {"a": _net(0), "b": _net(1)}
    _with_configs(monkeypatch, nets)
    dest = _user_folder(tmp_path)
    if whose == "edited":
        _export(nets["a"], dest, SHARDED)
        _export(nets["b"], dest, SHARDED)  # replaces the config.json the first export wrote
        assert json.loads((dest / "config.json").read_text()) == {"export": "b"}
        (dest / "config.json").write_text('{"export": "b", "mine": 1}')
    else:
        (dest / "config.json").write_text('{"my": "project settings"}')
    before = _tree(tmp_path)
    with pytest.raises(FileExistsError, match=r"holds 'config.json'.*not overwritten: move it away"):
        _export(nets["a"], dest, SHARDED)
    assert _tree(tmp_path) == before


@pytest.mark.filterwarnings("ignore")  # the killed writers' stages, named
@pytest.mark.parametrize("old_size,new_size", [(SHARDED, SHARDED), (SHARDED, SINGLE), (SINGLE, SHARDED)])
def test_a_kill_at_every_step_leaves_one_exports_config_and_weights(tmp_path, monkeypatch, old_size, new_size):
    """An export whose config.json differs from the one it replaces, killed at each rename or removal in turn
    (os._exit in a forked child). Before issue 48 a kill between the index and config.json left the new weights
    with the old config, silently. Here the folder after every kill reads as one export's config and weights, or is
    refused naming config.json (the two renames cannot be one); the next export reads whole."""
    nets = {"a": _net(0), "b": _net(1)}
    refs = _references(tmp_path, nets)
    _with_configs(monkeypatch, nets)
    pristine = tmp_path / "pristine"
    _export(nets["a"], pristine, old_size)
    seen = set()
    for step, work, _ in _killed_at_every_step(pristine, lambda work: _export(nets["b"], work, new_size)):
        got = _read(work, refs)
        assert got in (("a", "a"), ("b", "b"), "refused"), f"killed at step {step}: {got}"
        seen.add(got)
        _export(nets["b"], work, new_size)
        assert _read(work, refs) == ("b", "b")
    assert ("a", "a") in seen and ("b", "b") in seen


def test_an_error_at_every_step_leaves_one_exports_config_and_weights(tmp_path, monkeypatch):
    """An OSError (a full disk, a Ctrl-C alike) raised at each rename or removal of an export in turn, in this
    process: the export fails with it (or, raised after the commit, only warns), and the folder reads as one export's
    config and weights; the failed export's shards are not left in the folder, and the next export, of either model,
    reads whole. An error after config.json was replaced left the new config.json beside the old weights: the folder
    was refused, and an export with another config.json too, until the user deleted it; the old one is put back now."""
    nets = {"a": _net(0), "b": _net(1)}
    refs = _references(tmp_path, nets)
    _with_configs(monkeypatch, nets)
    dest = _user_folder(tmp_path)
    real = {n: getattr(os, n) for n in ("replace", "rename", "remove", "unlink", "rmdir")}
    step, seen = 0, set()
    while True:
        step += 1
        _export(nets["a"], dest, SHARDED)
        previous = _shards_of(dest)
        count = [0]

        def failing(name):
            def f(*args, **kwargs):
                count[0] += 1
                if count[0] == step:
                    raise OSError(28, f"injected at step {step}")
                return real[name](*args, **kwargs)
            return f

        for name in real:
            monkeypatch.setattr(os, name, failing(name))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _export(nets["b"], dest, SHARDED)
        except OSError as e:
            assert "injected" in str(e)
        finally:
            for name, f in real.items():
                monkeypatch.setattr(os, name, f)
        got = _read(dest, refs)
        assert got in (("a", "a"), ("b", "b")), f"failed at step {step}: {got}"
        seen.add(got)
        # no shard of the failed export outside an index; a stage only where the error hit its own removal
        visible = {n for n in os.listdir(dest) if n[0] != "."}
        assert visible <= {*USER_FILES, INDEX, "config.json", *_shards_of(dest), *previous}, f"step {step}"
        assert all(re.fullmatch(r"\.model\.[0-9a-f]{32}\.partial", n) for n in os.listdir(dest) if n[0] == ".")
        _user_files_intact(dest)
        with warnings.catch_warnings():  # the other export (its config.json) after the failed one: never refused
            warnings.simplefilter("ignore")
            _export(nets["a" if got == ("b", "b") else "b"], dest, SHARDED)
        assert _read(dest, refs) == ("a", "a") if got == ("b", "b") else ("b", "b")
        if count[0] < step:  # no step left to fail
            break
    assert ("a", "a") in seen and ("b", "b") in seen and step > 3


def test_a_full_disk_at_every_fsync_or_copy_names_the_file_and_loses_nothing(tmp_path, monkeypatch):
    """ENOSPC raised by each fsync in turn (NFS, quotas and delayed allocation report a full disk only there) and by
    the copy of the replaced config.json kept to put back: the error said `[Errno 28] No space left on device` naming
    no file (fsync_file, shutil.copyfile). Now it names the file under the destination, and the folder (and the single
    file) reads as the old export."""
    nets = {"a": _net(0), "b": _net(1)}
    refs = _references(tmp_path, nets)
    _with_configs(monkeypatch, nets)
    dest, single = _user_folder(tmp_path), tmp_path / "one.safetensors"
    _export(nets["a"], dest, SHARDED)
    _export(nets["a"], single, SINGLE)
    old_single = single.read_bytes()
    real = {"fsync": os.fsync, "copyfile": shutil.copyfile}
    for what, module in (("fsync", os), ("copyfile", shutil)):
        for where in (dest, single) if what == "fsync" else (dest,):
            step, failed = 0, 0
            while True:
                step += 1
                count = [0]

                def full(*args, **kwargs):
                    count[0] += 1
                    if count[0] == step:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    return real[what](*args, **kwargs)
                monkeypatch.setattr(module, what, full)
                try:
                    _export(nets["b"], where, SHARDED if where == dest else SINGLE)
                    monkeypatch.setattr(module, what, real[what])
                    _export(nets["a"], where, SHARDED if where == dest else SINGLE)  # no error: put back
                except OSError as e:
                    failed += 1
                    assert e.errno == errno.ENOSPC and f"writing {where}" in str(e), (what, step, e)
                    assert "free space there" in str(e), e
                    assert _read(dest, refs) == ("a", "a") and single.read_bytes() == old_single, (what, step)
                    _user_files_intact(dest)
                finally:
                    monkeypatch.setattr(module, what, real[what])
                if count[0] < step:  # every call made without an error: none left to fail
                    break
            assert failed >= 1, (what, where)


def _shards_of(dest):
    return set(json.loads((dest / INDEX).read_text())["weight_map"].values())


# ---- destinations ------------------------------------------------------------------------------------------------

def test_a_folder_linked_to_another_disk_is_written_there(tmp_path):
    """`ckpt` a symlink to a folder on another file system (/dev/shm, a tmpfs): every export failed with a raw EXDEV
    after writing the whole checkpoint (it staged beside the link). Here it is staged inside the folder the link
    resolves to, and works, twice (the second replacing the first); the link stays a link."""
    shm = "/dev/shm"
    if not os.path.isdir(shm) or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another file system than the test's temporary folder")
    target = os.path.join(shm, f"dorafp8-test-{uuid.uuid4().hex}")
    os.mkdir(target)
    try:
        link = tmp_path / "ckpt"
        os.symlink(target, link)
        for net in (_net(0), _net(1)):
            _export(net, link, SHARDED)
            with torch.no_grad():
                assert torch.equal(_output_of(link), net(X))
        shards = set(json.loads((link / INDEX).read_text())["weight_map"].values())
        assert os.path.islink(link) and sorted(os.listdir(target)) == sorted([INDEX, *shards])
    finally:
        shutil.rmtree(target)


@pytest.mark.parametrize("where", ["ckpt", "one.safetensors"])
def test_a_dangling_link_is_refused_before_anything_is_written(tmp_path, where):
    """A destination that is a link to nothing: a FileExistsError after everything was written, not naming the
    link. Here an error naming the argument and the link, and nothing written."""
    os.symlink(tmp_path / "gone", tmp_path / where)
    before = _tree(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"path=.*symbolic link to .*gone.*which does not exist"):
        _export(_net(0), tmp_path / where, SHARDED)
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("size", ["abc", 0, -1, True, "1.2.3GB", 2.5, "5IB"])
def test_a_bad_max_shard_size_is_refused_before_anything_is_written(tmp_path, size):
    """A bad max_shard_size left a hidden staging folder (made before the size was parsed), or was taken (0: one
    file per tensor). Here a ValueError naming the argument, and nothing written."""
    dest = _user_folder(tmp_path)
    before = _tree(tmp_path)
    with pytest.raises(ValueError, match="max_shard_size must be a positive int"):
        _export(_net(0), dest, size)
    assert _tree(tmp_path) == before


def test_a_folder_holding_a_single_model_file_is_refused_before_anything_is_written(tmp_path):
    """`model.safetensors` in the folder is what transformers and load_fp8_checkpoint read instead of an index; the
    writer cannot prove an export wrote it, so it does not remove it, and the new export would not be what loads:
    refused, naming it, with nothing written."""
    dest = _user_folder(tmp_path, {**USER_FILES, "model.safetensors": b"someone's model"})
    before = _tree(tmp_path)
    with pytest.raises(FileExistsError, match=r"holds 'model.safetensors'.*move it away"):
        _export(_net(0), dest, SHARDED)
    assert _tree(tmp_path) == before


def test_a_folder_holding_another_kinds_checkpoint_is_refused_before_anything_is_written(tmp_path):
    """load_fp8_checkpoint reads a folder's `model.safetensors`, else its `diffusion_pytorch_model.safetensors`, else
    the first index of the two, whatever model it loads into. A model's export (stem "model") into a folder holding
    an earlier `diffusion_pytorch_model.safetensors` was published and then loaded as that old file: silently the
    wrong weights. Refused now, naming the file, with nothing written."""
    old, new = _net(0), _net(1)
    dest = _user_folder(tmp_path)
    dorafp8.save_fp8_checkpoint(old, dest / "diffusion_pytorch_model.safetensors", format="dorafp8", verbose=False)
    with torch.no_grad():
        assert not torch.equal(_output_of(dest), new(X))  # what this folder loads as
    before = _tree(tmp_path)
    with pytest.raises(FileExistsError, match=r"holds 'diffusion_pytorch_model.safetensors'.*move it away"):
        _export(new, dest, SHARDED)
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("where,folder", [("one.safetensors", "one.safetensors"), ("ckpt", "ckpt/config.json"),
                                          ("ckpt", f"ckpt/{INDEX}")])
def test_a_folder_where_a_file_goes_is_refused_before_anything_is_written(tmp_path, where, folder):
    """A folder named like the file an export writes (the single file, config.json, the index): refused naming the
    argument, with nothing written (it was a raw error after everything was written, or a half-published export)."""
    (tmp_path / folder).mkdir(parents=True)
    before = _tree(tmp_path)
    with pytest.raises(IsADirectoryError, match=r"path=.* folder"):
        _export(_net(0), tmp_path / where, SHARDED)
    assert _tree(tmp_path) == before


# ---- loaders -----------------------------------------------------------------------------------------------------

def _safetensors(path, header: str, data: bytes = b""):
    raw = header.encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_a_tensor_named_twice_in_one_header_is_refused_by_name(tmp_path):
    """Two entries for one tensor name in a header loaded silently, the last winning. Here refused, naming it."""
    entry = '{"dtype": "F32", "shape": [1], "data_offsets": [%d, %d]}'
    f = _safetensors(tmp_path / "x.safetensors", '{"w\\u0007": %s, "w\\u0007": %s}' % (entry % (0, 4), entry % (4, 8)),
                     struct.pack("<2f", 1.0, 2.0))
    with pytest.raises(CheckpointFormatError, match=r"names 'w\\x07' twice"):
        CheckpointSource(str(f))


def test_an_index_naming_a_tensor_twice_is_refused_by_name(sharded, tmp_path):  # noqa: F811
    """An index key given twice: the shard named first was never opened and a zeroed copy loaded. Refused by name."""
    path, _ = sharded
    dst = shutil.copytree(path, tmp_path / "c")
    index = json.loads((dst / INDEX).read_text())
    key, shard = next(iter(index["weight_map"].items()))
    other = next(s for s in index["weight_map"].values() if s != shard)
    text = json.dumps(index).replace('"weight_map": {', f'"weight_map": {{"{key}": "{other}", ', 1)
    (dst / INDEX).write_text(text)
    with pytest.raises(CheckpointFormatError, match=rf"names {re.escape(repr(key))} twice"):
        dorafp8.load_fp8_checkpoint(_target("meta"), dst, verbose=False)


@pytest.mark.parametrize("entries", [getattr(files, "MAX_METADATA", 10_000) + 1, 1_000_000])
def test_a_headers_metadata_is_bounded_like_its_tensor_table(tmp_path, entries):
    """An 85 MB header of 7 M metadata strings cost 35 s and 1.9 GB: the size guard counted only '{'. Here a header
    of more than MAX_METADATA metadata entries is refused naming the file, one of millions before it is parsed."""
    meta = ",".join(f'"k{i}":"v"' for i in range(entries))
    f = _safetensors(tmp_path / "m.safetensors", '{"__metadata__": {%s}, "w": {"dtype": "F32", "shape": [1], '
                     '"data_offsets": [0, 4]}}' % meta, b"\0" * 4)
    t0 = time.time()
    with pytest.raises(CheckpointFormatError, match=r"m\.safetensors.*metadata entries"):
        CheckpointSource(str(f))
    assert time.time() - t0 < 3.0


def test_names_in_messages_are_shown_with_repr(tmp_path):
    """Raw ESC/BEL characters of tensor names reached the terminal in error messages. Here they are escaped."""
    net = _net(0)
    _export(net, tmp_path / "one.safetensors")
    tensors = st.load_file(str(tmp_path / "one.safetensors"))
    tensors["junk\x1b[2J\x07"] = torch.zeros(1)
    st.save_file(tensors, str(tmp_path / "two.safetensors"))
    with pytest.raises(CheckpointFormatError) as e:
        dorafp8.load_fp8_checkpoint(_target("meta"), tmp_path / "two.safetensors", verbose=False)
    assert "\x1b" not in str(e.value) and "\x07" not in str(e.value) and "'junk\\x1b[2J\\x07'" in str(e.value)


def test_a_file_path_that_links_to_a_file_is_refused_and_the_file_kept(tmp_path):
    """`one.safetensors` a link to a file (a Hugging Face cache's snapshot entry, which links its blob): the file was
    written through it, the blob replaced, so every snapshot sharing it served the new file under the old one's
    hash. Here an error naming the link and its target, and the target as it was."""
    blob = tmp_path / "blobs" / "ab12"
    blob.parent.mkdir()
    blob.write_bytes(b"the model the cache holds")
    os.symlink(blob, tmp_path / "one.safetensors")
    before = _tree(tmp_path)
    with pytest.raises(FileExistsError, match=r"path=.*one.safetensors.*symbolic link to the file .*ab12"):
        _export(_net(0), tmp_path / "one.safetensors", SHARDED)
    assert _tree(tmp_path) == before and blob.read_bytes() == b"the model the cache holds"


# ---- NFS: no lock on a folder ------------------------------------------------------------------------------------

def _nfs(monkeypatch):
    """flock as Linux's NFS client gives it (flock(2): emulated as a POSIX lock on the whole file): an exclusive lock
    only on a descriptor open for writing, else EBADF; a folder cannot be opened for writing, so it is never locked."""
    import fcntl

    real = fcntl.flock

    def flock(fd, op):
        if op & fcntl.LOCK_EX and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        return real(fd, op)
    monkeypatch.setattr(fcntl, "flock", flock)


def _exports_at_once(tmp_path, dest, nets):
    """Each net exported to `dest` by a forked process of its own, both started together; each, once in its publish,
    waits (up to 2 s) until the other is in its publish too: two publishes overlap unless a lock keeps them apart.
    Returns each process's (exit code, what it raised or warned)."""
    meet = tmp_path / "meet"
    meet.mkdir()
    go_r, go_w = os.pipe()
    real_publish = W._publish

    def publish(*args, **kwargs):
        (meet / str(os.getpid())).touch()
        deadline = time.monotonic() + 2.0
        while len(os.listdir(meet)) < len(nets) and time.monotonic() < deadline:
            time.sleep(0.01)
        return real_publish(*args, **kwargs)

    def run(net):
        os.read(go_r, 1)
        W._publish = publish
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            _export(net, dest, SHARDED)
        if seen:
            raise UserWarning("; ".join(str(w.message) for w in seen))

    procs = []
    for net in nets:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                torch.set_num_threads(1)
                run(net)
            except BaseException as e:  # noqa: BLE001 - told to the parent
                os.write(w, f"{type(e).__name__}: {e}".encode())
                os._exit(1)
            os._exit(0)
        os.close(w)
        procs.append((pid, r))
    os.write(go_w, b"x" * len(nets))
    out = []
    for pid, r in procs:
        with os.fdopen(r) as f:
            said = f.read()
        out.append((os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), said))
    os.close(go_r)
    os.close(go_w)
    return out


def test_two_exports_at_once_on_nfs_leave_one_whole_export_and_nothing_else(tmp_path, monkeypatch):
    """Two processes (two nodes' ranks) export into one folder on NFS, where a folder cannot be locked (flock(2)):
    both warned "cannot be locked", published at once, and the loser's shards stayed in the folder, in no index, never
    removed (a whole model's size, for every extra writer). Here they are kept apart by a lock file opened for
    writing: no warning, the folder loads as one of the two, and it holds only that export's files, the lock file and
    the user's."""
    _nfs(monkeypatch)
    nets = {"a": _net(0), "b": _net(1)}
    with torch.no_grad():
        want = {k: n(X) for k, n in nets.items()}
    dest = _user_folder(tmp_path)
    _export(_net(2), dest, SHARDED)
    results = _exports_at_once(tmp_path, dest, list(nets.values()))
    assert results == [(0, ""), (0, "")], results
    out = _output_of(dest)
    assert sum(torch.equal(out, w) for w in want.values()) == 1
    shards = set(json.loads((dest / INDEX).read_text())["weight_map"].values())
    assert sorted(os.listdir(dest)) == sorted([*USER_FILES, INDEX, *shards, files.LOCK_FILE])
    _user_files_intact(dest)


def _silly_rename(monkeypatch):
    """NFS's client removes a file this process still has open by renaming it to .nfsXXXX in its folder (a "silly
    rename"; the file goes at its last close), so the folder cannot be removed while it is open. Emulated (Linux:
    the descriptors under /proc/self/fd): os.unlink / os.remove of an open file renames it so."""
    real = os.unlink

    def unlink(path, *, dir_fd=None):
        st_ = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
        held = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                f = os.fstat(int(fd))
                held.add((f.st_dev, f.st_ino))
            except OSError:
                continue
        if stat.S_ISREG(st_.st_mode) and (st_.st_dev, st_.st_ino) in held:
            return os.rename(path, f".nfs{uuid.uuid4().hex[:16]}", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return real(path, dir_fd=dir_fd)
    monkeypatch.setattr(os, "unlink", unlink)
    monkeypatch.setattr(os, "remove", unlink)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="the emulation reads /proc/self/fd (Linux)")
def test_an_export_on_nfs_leaves_no_stage_behind(tmp_path, monkeypatch):
    """On NFS (emulated as above, with its silly rename of a removed file still open), a stage was removed while its
    lock file was still open: NFS renamed that file to .nfsXXXX, the stage folder could not be removed, and every
    export (a folder or a file) left an empty hidden folder behind, unseen (holding no lock file, none is named as a
    killed export's), one more at every export. Here the lock file is closed before the stage is removed: nothing
    is left but the folder's own lock file."""
    _nfs(monkeypatch)
    _silly_rename(monkeypatch)
    dest = _user_folder(tmp_path)
    net = _net(0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            _export(net, dest, SHARDED)
            _export(net, tmp_path / "one.safetensors", SINGLE)
    assert [str(w.message) for w in seen] == []
    assert sorted(n for n in os.listdir(dest) if n.startswith(".")) == [files.LOCK_FILE]
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith(".")) == [files.LOCK_FILE]
    with torch.no_grad():
        assert torch.equal(_output_of(dest), net(X))


@pytest.mark.parametrize("planted", ["the user's file", "a link", "a dangling link", "a FIFO", "a folder",
                                     "a killed writer's"])
def test_a_planted_lock_file_is_never_followed_written_or_removed(tmp_path, monkeypatch, planted):
    """On NFS (emulated as above), whatever is found under the lock file's name: a regular file (the user's own, or
    the one a writer killed while holding it left) is locked, its bytes kept; a link (to a file elsewhere, or to
    nothing), a FIFO or a folder is neither followed, opened nor removed, and the export still works, with a warning
    naming the file; nothing outside the folder is touched or made."""
    _nfs(monkeypatch)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "victim.txt").write_bytes(b"not yours")
    dest = _user_folder(tmp_path)
    lock = dest / files.LOCK_FILE
    if planted == "the user's file":
        lock.write_bytes(b"mine")
    elif planted == "a link":
        lock.symlink_to(elsewhere / "victim.txt")
    elif planted == "a dangling link":
        lock.symlink_to(elsewhere / "made.txt")
    elif planted == "a FIFO":
        os.mkfifo(lock)  # opened for reading, it would block for ever
    elif planted == "a folder":
        lock.mkdir()
    else:
        code, said = _in_child(lambda: _export(_net(2), dest, SHARDED), kill_at=3)  # while publishing, locked
        assert code == 9 and lock.is_file(), said
    before = _tree(tmp_path)
    net = _net(0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _export(net, dest, SHARDED)
    said = [str(w.message) for w in seen if "left by exports that were killed" not in str(w.message)]
    if planted in ("the user's file", "a killed writer's"):
        assert said == []
    else:
        assert len(said) == 1 and f"nor its {files.LOCK_FILE}" in said[0] and "not be kept apart" in said[0], said
    with torch.no_grad():
        assert torch.equal(_output_of(dest), net(X))
    after = _tree(tmp_path)
    assert {k: after.get(k) for k in before if not k.startswith("ckpt/model")} == \
        {k: v for k, v in before.items() if not k.startswith("ckpt/model")}
    assert set(after) - set(before) <= {f"ckpt/{n}" for n in os.listdir(dest)}
    _user_files_intact(dest)


# ---- a killed export, then one in another format -----------------------------------------------------------------

@pytest.mark.parametrize("nfs", [False, True])
def test_an_export_killed_at_every_step_then_one_in_another_format_leaves_only_that_export(tmp_path, monkeypatch,
                                                                                          nfs):
    """An export (dorafp8 layout) over another, killed at each rename or removal in turn, then the same model
    exported in another layout (compressed-tensors), whose config.json differs. Killed between replacing config.json
    and its commit, the first left a config.json the old index does not record, and the second was refused naming
    it until the user deleted it; killed while moving its shards in, it left them in the folder under no index,
    never removed. Here the second export finds both recorded in the killed one's staging folder (the index it was
    about to commit): it replaces that config.json and removes those shards, and the folder holds the user's files,
    the new export and the killed stage only (which nothing removes). On NFS (emulated as above) too, where a
    folder cannot be locked: a stage is locked through a file in it, so a killed one is told from a live one."""
    if nfs:
        _nfs(monkeypatch)
    nets = {"a": _net(0), "b": _net(1)}

    def write_config(t, stage, report, out):
        with open(os.path.join(stage, "config.json"), "w") as f:
            json.dump({"export": "a" if t.base is nets["a"] else "b", "format": t.fmt}, f)
    monkeypatch.setattr(W, "write_config", write_config)
    pristine = tmp_path / "pristine"
    pristine.mkdir()
    _export(nets["a"], _user_folder(pristine), SHARDED)
    with torch.no_grad():
        want = nets["b"](X)
    step, refused, orphans = 0, 0, 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the killed writers' stages, named
        while True:
            step += 1
            work = tmp_path / f"k{step}"
            shutil.copytree(pristine, work)
            dest = work / "ckpt"
            code, said = _in_child(lambda: _export(nets["b"], dest, SHARDED), kill_at=step)
            assert code in (0, 9), said
            config = json.loads((dest / "config.json").read_text())
            refused += config["export"] == "b" and json.loads((dest / INDEX).read_text())["metadata"].get(
                "dorafp8_config_sha256") != files.sha256(str(dest / "config.json"))
            orphans += len({n for n in os.listdir(dest) if n[0] != "."} - {*USER_FILES, INDEX, "config.json",
                                                                          *_shards_of(dest)})
            dorafp8.save_fp8_checkpoint(nets["b"], dest, format="compressed-tensors", max_shard_size=SHARDED,
                                        verbose=False)
            with torch.no_grad():
                assert torch.equal(_output_of(dest), want), f"killed at step {step}"
            assert json.loads((dest / "config.json").read_text()) == {"export": "b", "format": "compressed-tensors"}
            visible = {n for n in os.listdir(dest) if n[0] != "."}
            assert visible == {*USER_FILES, INDEX, "config.json", *_shards_of(dest)}, f"killed at step {step}"
            _killed_stages(work)
            _user_files_intact(dest)
            if code == 0:
                break
    assert refused >= 1 and orphans >= 1 and step > 3


def test_a_config_json_written_while_the_shards_are_hashed_is_never_replaced(tmp_path, monkeypatch):
    """config.json edited by the user (or written by another program) while an export hashes its shards (minutes for
    a large model): it was checked before the hashing, then replaced, the edit lost. Here it is checked after, just
    before anything moves in: refused naming it, the edit kept, no shard of the failed export in the folder."""
    nets = {"a": _net(0), "b": _net(1)}
    _with_configs(monkeypatch, nets)
    dest = _user_folder(tmp_path)
    _export(nets["a"], dest, SHARDED)
    shards = _shards_of(dest)
    real = W.sha256

    def sha256(path):
        if ".partial" in path and path.endswith(".safetensors"):  # a staged shard, hashed by the publish
            (dest / "config.json").write_text('{"export": "a", "my": "edit"}')
        return real(path)
    monkeypatch.setattr(W, "sha256", sha256)
    with pytest.raises(FileExistsError, match=r"holds 'config.json'.*not overwritten"):
        _export(nets["b"], dest, SHARDED)
    assert (dest / "config.json").read_text() == '{"export": "a", "my": "edit"}'
    assert sorted(os.listdir(dest)) == sorted([*USER_FILES, INDEX, "config.json", *shards])


def test_a_killed_writers_stage_is_named_on_nfs_too(tmp_path, monkeypatch):
    """On NFS (emulated), a folder cannot be locked, so every stage looked live: one a killed export left (its staged
    shards, up to a whole model) was never named, and stayed unseen. Here it is named in the next export's warning,
    as on a local disk, and left where it is."""
    _nfs(monkeypatch)
    net = _net(0)
    for where, size, kill_at in ((tmp_path / "one.safetensors", SINGLE, 1), (tmp_path / "ckpt", SHARDED, 2)):
        code, _ = _in_child(lambda: _export(net, where, size), kill_at=kill_at)
        assert code == 9
        left = _killed_stages(tmp_path)
        with pytest.warns(UserWarning, match=r"left by exports that were killed"):
            _export(net, where, size)
        assert _killed_stages(tmp_path) == left


def test_two_threads_exporting_at_once_on_nfs_are_kept_apart(tmp_path, monkeypatch):
    """On NFS flock is a POSIX lock, whose owner is the process: two threads of one process both get it. Emulated
    here (a folder cannot be locked; a file open for writing always can, within the process), two threads exporting
    into one folder, their publishes meeting unless kept apart: both published at once (the loser's shards left in
    no index; the other's index could name shards the first had removed), and each named the other's live stage as
    a killed one's. Here they are kept apart in the process: one whole export, nothing else in the folder, no
    warning."""
    import fcntl

    def flock(fd, op):
        if op & fcntl.LOCK_EX and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
    monkeypatch.setattr(fcntl, "flock", flock)
    nets = {"a": _net(0), "b": _net(1)}
    with torch.no_grad():
        want = {k: n(X) for k, n in nets.items()}
    dest = _user_folder(tmp_path)
    _export(_net(2), dest, SHARDED)
    arrived, real_publish = [], W._publish

    def publish(*args, **kwargs):
        arrived.append(1)
        deadline = time.monotonic() + 2.0
        while len(arrived) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        return real_publish(*args, **kwargs)
    monkeypatch.setattr(W, "_publish", publish)
    said = {}

    def run(k):
        try:
            _export(nets[k], dest, SHARDED)
        except Exception as e:  # noqa: BLE001 - checked below
            said[k] = e

    threads = [threading.Thread(target=run, args=(k,)) for k in nets]
    with warnings.catch_warnings(record=True) as seen:  # the threads' too (one showwarning for the process)
        warnings.simplefilter("always")
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert said == {} and [str(w.message) for w in seen] == []  # no live stage named as a killed one's
    out = _output_of(dest)
    assert sum(torch.equal(out, w) for w in want.values()) == 1
    assert sorted(os.listdir(dest)) == sorted([*USER_FILES, INDEX, *_shards_of(dest), files.LOCK_FILE])
    _user_files_intact(dest)


def test_an_interrupt_after_the_commit_never_removes_what_the_new_index_names(tmp_path, monkeypatch):
    """A Ctrl-C (KeyboardInterrupt) while the folder is fsynced right after the new index was renamed in (a folder's
    fsync can take a while on NFS): the failure path removed the shards it had moved in, which the committed index
    names, so the folder loaded as neither export. Here the published export stays whole and loads."""
    a, b = _net(0), _net(1)
    dest = _user_folder(tmp_path)
    _export(a, dest, SHARDED)
    old_index = (dest / INDEX).read_bytes()
    real = files.fsync_dir

    def fsync_dir(folder):
        if (dest / INDEX).read_bytes() != old_index:
            raise KeyboardInterrupt
        return real(folder)
    monkeypatch.setattr(files, "fsync_dir", fsync_dir)
    with pytest.raises(KeyboardInterrupt):
        _export(b, dest, SHARDED)
    monkeypatch.undo()
    with torch.no_grad():
        assert torch.equal(_output_of(dest), b(X))
    _user_files_intact(dest)


def test_without_fcntl_a_live_writers_stage_is_never_taken_as_a_killed_ones(tmp_path, monkeypatch):
    """Without fcntl (Windows) no writer locks its stage, so a live one (here mid-publish: its index written in its
    stage, a shard moved into the folder) cannot be told from a killed one: its index must not be read as a killed
    export's records, or the next export would remove that writer's shard, and its commit then name a missing file."""
    monkeypatch.setattr(files, "fcntl", None)
    dest = _user_folder(tmp_path)
    _export(_net(0), dest, SHARDED)
    live = dest / f".model.{uuid.uuid4().hex}.partial"
    live.mkdir()
    shard = dest / "model-0badf00d-00001-of-00001.safetensors"
    shard.write_bytes(b"a live export's shard")
    (live / INDEX).write_text(json.dumps({"metadata": {"dorafp8_files": {shard.name: {
        "size": shard.stat().st_size, "sha256": files.sha256(str(shard))}}}, "weight_map": {}}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the stage, named as perhaps a killed one's
        _export(_net(1), dest, SHARDED)
    assert shard.read_bytes() == b"a live export's shard"


# ---- the files the model was loaded from -------------------------------------------------------------------------

def test_a_file_rewritten_in_place_since_the_load_is_no_longer_the_original(tmp_path):
    """`cp other.safetensors one.safetensors` after the load rewrites the same inode (as a new file may take a freed
    one): the file there is no longer the model's original, and exporting over it is the user's choice. (device,
    inode) alone refused it as 'the file the model was loaded from' (a false refusal); a link to the original still
    is refused (the test above)."""
    src, other = tmp_path / "one.safetensors", tmp_path / "other.safetensors"
    _export(_net(0), src, SINGLE)
    _export(_net(1), other, SINGLE)
    model = _target("meta")
    dorafp8.load_fp8_checkpoint(model, src, verbose=False)
    before = os.stat(src)
    shutil.copyfile(other, src)  # cp: truncates and rewrites the file in place
    assert os.stat(src).st_ino == before.st_ino and src.read_bytes() == other.read_bytes()
    dorafp8.save_fp8_checkpoint(model, src, format="dorafp8", verbose=False)
    with torch.no_grad():
        assert torch.equal(_output_of(src), model.eval()(X))


@pytest.mark.parametrize("how", ["the file", "a link to it", "a hard link to it", "its folder", "a link to its folder"])
@pytest.mark.parametrize("merge", [False, True])
def test_an_export_over_the_files_the_model_was_loaded_from_is_refused(tmp_path, how, merge):
    """A model loaded from a file (or an export's folder), exported back over it: the original weights were replaced
    (export_merged: the base the adapters merge into, gone for good). Refused now before anything is written, naming
    the path, the file and what to do; the same model exports to another path."""
    folder = "folder" in how
    src = tmp_path / ("ckpt" if folder else "one.safetensors")
    _export(_net(0), src, SHARDED if folder else SINGLE)
    model = _target("meta")
    dorafp8.load_fp8_checkpoint(model, src, verbose=False)
    dest = tmp_path / ("dest" if folder else "dest.safetensors")
    if how == "the file" or how == "its folder":
        dest = src
    elif how == "a hard link to it":
        os.link(src, dest)
    else:
        dest.symlink_to(src)
    before = _tree(tmp_path)
    write = dorafp8.export_merged if merge else dorafp8.save_fp8_checkpoint
    with pytest.raises(FileExistsError, match=r"is the file the model was loaded from .*write to another path"):
        write(model, dest, format="dorafp8", max_shard_size=SHARDED, verbose=False)
    assert _tree(tmp_path) == before
    write(model, tmp_path / ("other" if folder else "other.safetensors"), format="dorafp8", verbose=False)
    with torch.no_grad():
        assert torch.equal(_output_of(tmp_path / ("other" if folder else "other.safetensors")), model.eval()(X))
