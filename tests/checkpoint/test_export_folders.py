"""Writing into a user's folder (issues 39, 48): save_fp8_checkpoint / export_merged remove nothing but the files of
the export they replace, publish so that a crash at any point leaves a folder that loads as the old export or the new
one (never a mix), fsync what they publish, name the file a write error happened on, and leave what a killed one left
alone, named in a warning."""

import json
import os
import re
import resource
import shutil
import signal
import stat

import pytest
import torch

import dorafp8
import dorafp8.checkpoint.write as W
from tests.checkpoint.test_load_all_or_nothing import X, Net, _target

pytest.importorskip("safetensors")

USER_FILES = {"model-backup-2024.safetensors": b"my backup", "model-v1.safetensors": b"my v1",
              "model-00001-of-00009.safetensors": b"not in any index", "notes.txt": b"mine"}
SHARDED, SINGLE = 400, "1GB"  # max_shard_size: several shards, one file


def _net(seed):
    torch.manual_seed(seed)
    net = Net().eval()
    dorafp8.quantize_model(net, include_conv=True, per_row_scale=True)
    return net


def _export(net, dest, size=SHARDED):
    dorafp8.save_fp8_checkpoint(net, dest, format="dorafp8", max_shard_size=size, verbose=False)


def _output_of(dest):
    model = _target("meta")
    dorafp8.load_fp8_checkpoint(model, dest, verbose=False)
    with torch.no_grad():
        return model.eval()(X)


def _user_folder(tmp_path, files=USER_FILES):
    dest = tmp_path / "ckpt"
    dest.mkdir()
    for name, data in files.items():
        (dest / name).write_bytes(data)
    return dest


def _user_files_intact(dest, files=USER_FILES):
    assert {n: (dest / n).read_bytes() for n in files if (dest / n).exists()} == files


def _hidden(tmp_path):
    return sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob(".*"))


def _killed_stages(tmp_path):
    """The hidden entries under tmp_path, each checked to be in a killed writer's staging folder (which no writer
    removes: nothing proves who made it), as the list of those folders; lock files (on NFS) left out."""
    parts = [p.relative_to(tmp_path).parts for p in tmp_path.rglob(".*") if p.name != ".dorafp8.lock"]
    stages = {ps[:next(i for i, n in enumerate(ps) if n.startswith(".")) + 1] for ps in parts}
    assert all(re.fullmatch(r"\.(model|one\.safetensors)\.[0-9a-f]{32}\.partial", s[-1]) for s in stages), stages
    return sorted(stages)


def test_an_export_removes_only_the_files_of_the_export_it_replaces(tmp_path):
    """A folder holding the user's model-backup-2024.safetensors and model-v1.safetensors: the old publish step
    removed every `model-*.safetensors`, those two included. An old index naming the user's files (or one outside the
    folder) does not make them the export's."""
    a, b = _net(0), _net(1)
    dest = _user_folder(tmp_path)
    (tmp_path / "outside.safetensors").write_bytes(b"not yours")
    for net, size in ((a, SHARDED), (b, SHARDED), (a, SINGLE), (b, SHARDED)):
        _export(net, dest, size)
        _user_files_intact(dest)
        with torch.no_grad():
            assert torch.equal(_output_of(dest), net(X))
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert sorted(os.listdir(dest)) == sorted([*USER_FILES, "model.safetensors.index.json", *shards])
    index["weight_map"]["a"] = "model-backup-2024.safetensors"
    index["weight_map"]["b"] = "../outside.safetensors"
    (dest / "model.safetensors.index.json").write_text(json.dumps(index))
    _export(a, dest, SINGLE)
    _user_files_intact(dest)
    assert (tmp_path / "outside.safetensors").read_bytes() == b"not yours"
    shards = set(json.loads((dest / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(shards) == 1  # a folder export always has an index: its one commit point
    assert sorted(os.listdir(dest)) == sorted([*USER_FILES, "model.safetensors.index.json", *shards])


def _in_child(fn, *, kill_at=None):
    """Runs fn() in a forked process. kill_at=n: the process dies (os._exit: no finally, no cleanup, as under
    SIGKILL) at its n-th change to the file system (a rename or a removal). Returns (exit code, what fn raised)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read)
        try:
            torch.set_num_threads(1)
            if kill_at is not None:
                count = [0]

                def counting(real):
                    def f(*args, **kwargs):
                        count[0] += 1
                        if count[0] == kill_at:
                            os._exit(9)
                        return real(*args, **kwargs)
                    return f

                for name in ("replace", "rename", "remove", "unlink", "rmdir"):
                    setattr(os, name, counting(getattr(os, name)))
            fn()
        except BaseException as e:  # noqa: BLE001 - told to the parent
            os.write(write, f"{type(e).__name__}: {e}".encode())
            os._exit(1)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        said = f.read()
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), said


def _killed_at_every_step(pristine, export):
    """A copy of the folder `pristine` for each step n = 1, 2, ... (k<n> beside it), export(copy) run into it in a
    forked child killed at its n-th change to the file system (_in_child), until a run completes: yields (n, the copy,
    the child's exit code: 9 killed, 0 completed) after each for the caller's checks, then checks that the export had
    steps to kill it at."""
    step = 0
    while True:
        step += 1
        work = pristine.parent / f"k{step}"
        shutil.copytree(pristine, work, symlinks=True)
        code, said = _in_child(lambda: export(work), kill_at=step)
        assert code in (0, 9), f"killed at step {step}: {said}"
        yield step, work, code
        if code == 0:
            break
    assert step > 3


def _which(path, want_old, want_new, step):
    """Which export `path` loads as after the kill at `step`: "old" or "new" (a mix of the two fails here)."""
    out = _output_of(path)
    which = "old" if torch.equal(out, want_old) else "new" if torch.equal(out, want_new) else "a mix"
    assert which != "a mix", f"killed at step {step}"
    return which


@pytest.mark.parametrize("old_size,new_size", [(SHARDED, SHARDED), (SHARDED, SINGLE), (SINGLE, SHARDED)])
def test_a_kill_at_any_point_of_a_re_export_leaves_the_old_export_or_the_new(tmp_path, old_size, new_size):
    """Re-exporting over an export, killed at each rename or removal in turn: the old publish step left a folder that
    loaded silently as a mix of the two exports. Here the folder loads as exactly one of them after every kill, the
    user's file stays, and the next export works, leaving at most the killed one's staging folder. (The user's
    .safetensors files are the test above's.)"""
    mine = {"notes.txt": b"mine"}
    a, b = _net(0), _net(1)
    with torch.no_grad():
        want_a, want_b = a(X), b(X)
    pristine = tmp_path / "pristine"
    pristine.mkdir()
    _export(a, _user_folder(pristine, mine), old_size)
    outcomes = set()
    for step, work, code in _killed_at_every_step(pristine, lambda work: _export(b, work / "ckpt", new_size)):
        outcomes.add(_which(work / "ckpt", want_a, want_b, step))
        _user_files_intact(work / "ckpt", mine)
        _export(b, work / "ckpt", new_size)  # the next run
        assert torch.equal(_output_of(work / "ckpt"), want_b)
        assert len(_killed_stages(work)) <= 1, f"killed at step {step}"
        _user_files_intact(work / "ckpt", mine)
    assert outcomes == {"old", "new"}


def test_a_kill_at_any_point_of_a_single_file_re_export_leaves_the_old_file_or_the_new(tmp_path):
    """The loop above for a single .safetensors file (the path save_kohya_dora and save_single_file_dora take too:
    files.save_file_atomic): after a kill at each rename or removal in turn the file loads as exactly the old export
    or the new one, the user's file beside it stays, and at most the killed writer's stage is left."""
    a, b = _net(0), _net(1)
    with torch.no_grad():
        want_a, want_b = a(X), b(X)
    pristine = tmp_path / "pristine"
    pristine.mkdir()
    (pristine / "notes.txt").write_bytes(b"mine")
    _export(a, pristine / "one.safetensors", SINGLE)
    outcomes = set()
    for step, work, code in _killed_at_every_step(pristine, lambda work: _export(b, work / "one.safetensors", SINGLE)):
        outcomes.add(_which(work / "one.safetensors", want_a, want_b, step))
        assert (work / "notes.txt").read_bytes() == b"mine"
        assert len(_killed_stages(work)) <= 1, f"killed at step {step}"
    assert outcomes == {"old", "new"}


@pytest.mark.skipif(os.name != "posix", reason="permission bits")
def test_what_an_export_writes_can_be_read_by_whom_the_umask_says(tmp_path):
    """safetensors >= 0.8 writes through a temporary file of mode 0o600 (its issue 782): the shards and the single file
    were readable by their owner only, beside an index and a config.json readable by all (a server or a container
    running as another user could not load the export). Now they get the mode open() gives (0o666 less the umask),
    and a file replaced keeps its own."""
    net = _net(0)
    old = os.umask(0o022)
    try:
        for mask in (0o022, 0o027):
            os.umask(mask)
            folder, single = tmp_path / f"ckpt-{mask:o}", tmp_path / f"one-{mask:o}.safetensors"
            _export(net, folder, SHARDED)
            _export(net, single, SINGLE)
            written = [single, *folder.iterdir()]
            assert len(written) > 3
            assert {p.name: oct(p.stat().st_mode & 0o777) for p in written} == \
                {p.name: oct(0o666 & ~mask) for p in written}
        os.umask(0o022)
        single.chmod(0o640)  # the user's choice for the file replaced
        _export(_net(1), single, SINGLE)
        assert oct(single.stat().st_mode & 0o777) == oct(0o640)
    finally:
        os.umask(old)


def _users_file(tmp_path, mode):
    """An export in a folder of user 12345's (group 23456), theirs, of `mode`."""
    home = tmp_path / "home"
    home.mkdir()
    os.chown(home, 12345, 23456)
    single = home / "one.safetensors"
    _export(_net(0), single, SINGLE)
    os.chown(single, 12345, 23456)
    single.chmod(mode)
    return single


@pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0, reason="giving a file to another user takes root")
def test_a_file_root_replaces_stays_its_owners(tmp_path):
    """Root (a training container on a bind mount) replacing a user's 0o640 file gave the new one to root:root with
    the old mode, so the user, and the group the file was shared with, could no longer read their own checkpoint
    (a write into it would have kept both). Now it keeps its owner and group as well as its mode. Not a stranger's
    file planted in a folder of someone else's (/tmp): its mode (0o666) was kept, so its owner could rewrite the
    export; that one gets the mode and owner of a new file."""
    single = _users_file(tmp_path, 0o640)
    _export(_net(1), single, SINGLE)
    st = single.stat()
    assert (st.st_uid, st.st_gid, oct(st.st_mode & 0o777)) == (12345, 23456, oct(0o640))
    planted = tmp_path / "planted.safetensors"  # tmp_path: root's
    planted.write_bytes(b"x")
    os.chown(planted, 12345, 23456)
    planted.chmod(0o666)
    old = os.umask(0o022)
    try:
        _export(_net(1), planted, SINGLE)
    finally:
        os.umask(old)
    st = planted.stat()
    assert (st.st_uid, oct(st.st_mode & 0o777)) == (0, oct(0o644))


@pytest.mark.skipif(os.name != "posix", reason="set-id bits")
def test_a_replaced_files_set_id_bits_are_not_copied(tmp_path, monkeypatch):
    """The mode of a file replaced is kept, its permission bits only: with its owner not given back (a uid unmapped
    in a user namespace: fchown fails), a stranger's 0o6777 became a set-uid, set-gid export owned by the writer."""
    single = tmp_path / "one.safetensors"
    _export(_net(0), single, SINGLE)
    single.chmod(0o6775)
    monkeypatch.setattr(os, "fchown", lambda *a: (_ for _ in ()).throw(PermissionError(1, "unmapped uid")))
    _export(_net(1), single, SINGLE)
    assert oct(stat.S_IMODE(single.stat().st_mode)) == oct(0o775)


@pytest.mark.skipif(os.name != "posix", reason="owners and links")
@pytest.mark.parametrize("swap", ["symlink", "hardlink"])
@pytest.mark.parametrize("when", ["staged", "written"])
def test_a_file_swapped_into_the_stage_is_not_given_the_replaced_files_owner(tmp_path, monkeypatch, swap, when):
    """Root exporting over a file of the folder's owner (a user's folder) gives the export that owner and mode. The
    chown and chmod went by the staged file's path, following links: the folder's owner, who may rename root's stage
    folder away and put their own in its place, swapped the staged file for a link to root's secret file, and root
    gave that file to them, mode 0o666, and published the link as the export; swapped as soon as safetensors had
    written it (when="written"), the chmod giving a new file its umask's mode (0o644) did so to the secret. Now both
    act on the file opened without following links, and a swapped one (a link, a hard link to another file) fails
    the export, the secret untouched."""
    import safetensors.torch

    import dorafp8.checkpoint.files as files

    single = _users_file(tmp_path, 0o666)
    secret = tmp_path / "secret"
    secret.write_bytes(b"root's")
    secret.chmod(0o600)
    where, name = (files, "save_safetensors") if when == "staged" else (safetensors.torch, "save_file")
    real = getattr(where, name)

    def swapped(tensors, path, *args, **kwargs):  # what the folder's owner does once root's file is staged
        real(tensors, path, *args, **kwargs)
        os.remove(path)
        (os.symlink if swap == "symlink" else os.link)(secret, path)

    monkeypatch.setattr(where, name, swapped)
    old = os.umask(0o022)
    try:
        with pytest.raises(OSError, match="one.safetensors"):
            _export(_net(1), single, SINGLE)
    finally:
        os.umask(old)
    monkeypatch.undo()
    st = secret.stat()
    assert (st.st_uid, oct(st.st_mode & 0o777), secret.read_bytes()) == (0, oct(0o600), b"root's")
    assert not single.is_symlink() and single.stat().st_ino != st.st_ino


@pytest.mark.skipif(os.name != "posix", reason="permission bits")
@pytest.mark.parametrize("mode", [0o200, 0o000])
def test_a_file_replaced_whose_mode_denies_its_owner_reading_is_replaced(tmp_path, monkeypatch, mode):
    """The replaced file's mode (0o200, 0o000: no read bit for its owner) was given to the staged file before it
    was fsynced, which opens it for reading: for anyone but root (who reads any file; the tests run as root, so the
    kernel's check is done here as it is for other users) the export failed ('Permission denied') over a file it
    may replace. Now the mode is given after the fsync: the file is replaced and keeps its mode."""
    import builtins
    import errno
    import stat

    import dorafp8.checkpoint.files as files

    def as_its_owner(path, flags="r", *args, **kwargs):  # open() as a user who is not root checks the owner's bits
        if isinstance(path, (str, os.PathLike)) and os.path.exists(path):
            need = (stat.S_IRUSR if "r" in flags or "+" in flags else 0) | (stat.S_IWUSR if set("wa+") & set(flags)
                                                                              else 0)
            if os.stat(path).st_mode & need != need:
                raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return builtins.open(path, flags, *args, **kwargs)

    single = tmp_path / "one.safetensors"
    _export(_net(0), single, SINGLE)
    single.chmod(mode)
    monkeypatch.setattr(files, "open", as_its_owner, raising=False)
    b = _net(1)
    _export(b, single, SINGLE)
    monkeypatch.undo()
    assert oct(single.stat().st_mode & 0o777) == oct(mode)
    single.chmod(0o600)
    with torch.no_grad():
        assert torch.equal(_output_of(single), b(X))


def test_an_export_onto_a_filesystem_that_refuses_chmod_is_written(tmp_path, monkeypatch):
    """vfat / NTFS mounts and some NFS / CIFS ones refuse chmod (EPERM): the mode fix-up after safetensors' write
    failed the whole export there ('writing ...: Operation not permitted'), where it worked before the fix-up."""
    import errno

    def refuse(*args, **kwargs):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "chmod", refuse)
    net = _net(0)
    folder, single = tmp_path / "ckpt", tmp_path / "one.safetensors"
    _export(net, folder, SHARDED)
    _export(net, single, SINGLE)
    _export(_net(1), single, SINGLE)  # a replaced file too
    monkeypatch.undo()
    assert any(p.name.endswith(".safetensors") for p in folder.iterdir()) and single.stat().st_size > 0


@pytest.mark.parametrize("code", ["EINVAL", "ENOTSUP"])
def test_an_export_onto_a_filesystem_without_fsync_is_written(tmp_path, monkeypatch, code):
    """A file system without fsync (VirtualBox's shared folders, some FUSE ones: fsync says EINVAL or ENOTSUP) failed
    every export ('writing ...: Invalid argument'), where safetensors alone writes; a full disk (ENOSPC) still fails
    it, naming the file (test_publish_attacks)."""
    import errno

    real = os.fsync

    def refuse(fd):
        if os.path.isfile(os.readlink(f"/proc/self/fd/{fd}")):  # folders' fsync errors were ignored already
            raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))
        return real(fd)

    monkeypatch.setattr(os, "fsync", refuse)
    net = _net(0)
    folder, single = tmp_path / "ckpt", tmp_path / "one.safetensors"
    _export(net, folder, SHARDED)
    _export(net, single, SINGLE)
    monkeypatch.undo()
    with torch.no_grad():
        assert torch.equal(_output_of(folder), net(X)) and torch.equal(_output_of(single), net(X))


def test_what_an_export_publishes_is_fsynced(tmp_path, monkeypatch):
    """Every file of the export and the folder itself are fsynced (nothing was: a power cut after the export could
    leave empty or missing shards behind names that loaded)."""
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real(fd))
    dest = _user_folder(tmp_path)
    _export(_net(0), dest, SHARDED)
    published = [n for n in os.listdir(dest) if n not in USER_FILES]
    assert len(published) > 3
    assert {n for n in published if any(p.endswith("/" + n) for p in synced)} == set(published)
    assert str(dest.resolve()) in synced
    single = tmp_path / "one.safetensors"
    _export(_net(0), single)
    assert any(p.startswith(str(tmp_path.resolve() / ".one.safetensors.")) for p in synced)  # before its rename
    assert str(tmp_path.resolve()) in synced


def test_a_write_error_names_the_file_and_leaves_the_folder_as_it_was(tmp_path, monkeypatch):
    """A full disk said `No space left on device (os error 28)` without the path. Here the OS refuses the write
    (RLIMIT_FSIZE, in a child process: 'File too large', errno 27, the same kind of error): the message names the
    file, and the destination and its parent are as they were."""
    net = _net(0)
    dest = _user_folder(tmp_path)
    _export(_net(1), dest, SHARDED)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}

    def write_with_a_small_limit(where, limit=300):
        def run():
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
            _export(net, where, SHARDED)
        return run

    for where in (dest, tmp_path / "one.safetensors"):
        code, said = _in_child(write_with_a_small_limit(where))
        assert code == 1 and said.startswith("OSError: [Errno 27] writing ") and "File too large" in said, said
        assert str(where) in said or ".ckpt." in said, said
        assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
        assert _hidden(tmp_path) == []
    # the shards fit, config.json does not: its write error said '[Errno 27] File too large', naming no file
    def big_config(t, stage, report, out):
        with open(os.path.join(stage, "config.json"), "w") as f:
            json.dump({"pad": "x" * 100_000}, f)
    monkeypatch.setattr(W, "write_config", big_config)
    code, said = _in_child(write_with_a_small_limit(dest, 50_000))
    assert code == 1 and said.startswith(f"OSError: [Errno 27] writing {dest / 'config.json'}: File too large"), said
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert _hidden(tmp_path) == []


def test_leftovers_of_a_killed_writer_are_named_in_a_warning_and_never_block_the_next(tmp_path):
    """A killed export leaves a hidden staging folder (beside a single .safetensors, inside a folder export). Nothing
    proves who made such a folder, so the next write to the same path leaves it where it is, names it in one warning,
    and works."""
    net = _net(0)
    single = tmp_path / "one.safetensors"
    code, _ = _in_child(lambda: _export(net, single), kill_at=1)  # the rename of its temporary file
    assert code == 9 and not single.exists()
    dest = tmp_path / "ckpt"
    code, _ = _in_child(lambda: _export(net, dest, SHARDED), kill_at=2)  # while naming its shards
    assert code == 9
    left = _killed_stages(tmp_path)
    assert len(left) == 2, left
    for where, size in ((single, SINGLE), (dest, SHARDED)):
        with pytest.warns(UserWarning, match=r"left by exports that were killed"):
            _export(net, where, size)
    with torch.no_grad():
        assert torch.equal(_output_of(dest), net(X))
    assert _killed_stages(tmp_path) == left


def test_safetensors_own_temporary_file_is_left_only_in_a_staging_folder(tmp_path):
    """safetensors' save_file writes a .tmpXXXX file beside the file it is asked for and renames it when done (seen
    with safetensors 0.8): a writer killed in there left it in the user's folder (128 MB in the issue), under a name
    nothing removes. Every save now asks for a file inside a staging folder of its own. Here save_file leaves such a
    file and the process dies: the file is in that staging folder, and the next write works."""
    net = _net(0)

    def killed_inside_save_file(where, size):
        def run():
            import safetensors.torch

            def save_file(tensors, path, metadata=None):
                with open(os.path.join(os.path.dirname(path), ".tmpAbC123"), "wb") as f:
                    f.write(b"half a shard")
                os._exit(9)

            safetensors.torch.save_file = save_file
            _export(net, where, size)
        return run

    for where, size, folder in ((tmp_path / "one.safetensors", SINGLE, tmp_path),
                                (tmp_path / "ckpt", SHARDED, tmp_path / "ckpt")):
        code, _ = _in_child(killed_inside_save_file(where, size))
        assert code == 9
        left = list(tmp_path.rglob(".tmpAbC123"))
        assert len(left) == 1 and left[0].parent.name.endswith(".partial") and left[0].parent.parent == folder, left
        left[0].unlink()
        with pytest.warns(UserWarning, match=r"left by exports that were killed"):
            _export(net, where, size)


def test_a_first_export_killed_while_publishing_never_loads_as_if_complete(tmp_path):
    """A first export into a folder (no index yet), killed at each rename or removal in turn: killed while it moved
    its shards in (before the index, its commit), it left some of them and no index, and load_fp8_checkpoint read the
    folder's *.safetensors as the whole checkpoint: strict=False loaded the half export, the rest reported missing,
    and strict=True called it a checkpoint that does not fit the model. Now such a folder is refused naming the
    missing shards; every other step leaves nothing to load or the whole export."""
    net = _net(0)
    with torch.no_grad():
        want = net(X)
    step, refused = 0, 0
    while True:
        step += 1
        dest = tmp_path / f"k{step}" / "ckpt"
        dest.parent.mkdir()
        code, said = _in_child(lambda: _export(net, dest, SHARDED), kill_at=step)
        assert code in (0, 9), said
        model = _target("meta")
        try:
            report = dorafp8.load_fp8_checkpoint(model, dest, strict=False, verbose=False)
        except FileNotFoundError:
            assert not any(n.endswith(".safetensors") for n in os.listdir(dest)), f"killed at step {step}"
        except dorafp8.checkpoint.CheckpointFormatError as e:
            assert re.search(r"holds \d of the \d shards of 'model-[0-9a-f]{8}' and no index naming them; "
                             r"'model-[0-9a-f]{8}-0000\d-of-0000\d\.safetensors'.* missing: an export killed", str(e))
            refused += 1
        else:
            assert report.missing == [], f"killed at step {step}: {report.missing}"
            with torch.no_grad():
                assert torch.equal(model.eval()(X), want), f"killed at step {step}"
        if code == 0:
            break
    assert refused >= 2


def test_an_index_no_export_wrote_is_never_replaced(tmp_path):
    """A folder another writer filled (transformers' save_pretrained, sharded: its index and shards) and a model with
    no config.json to refuse on: the export replaced that index, leaving the model's own shards unindexed. Refused
    now, naming the index, with the folder as it was."""
    from safetensors.torch import save_file

    dest = tmp_path / "hf"
    dest.mkdir()
    for i in (1, 2):
        save_file({f"w{i}": torch.ones(2)}, str(dest / f"model-0000{i}-of-00002.safetensors"))
    index = {"metadata": {"total_size": 16}, "weight_map": {"w1": "model-00001-of-00002.safetensors",
                                                              "w2": "model-00002-of-00002.safetensors"}}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index))
    before = {p.name: p.read_bytes() for p in dest.iterdir()}
    with pytest.raises(FileExistsError, match=r"holds 'model.safetensors.index.json', which no dorafp8 export wrote"):
        _export(_net(0), dest)
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == before


@pytest.mark.skipif(os.name != "posix", reason="hard links")
def test_a_staged_file_hard_linked_meanwhile_is_refused_saying_so(tmp_path, monkeypatch):
    """A staged file with a second name (a backup or sync tool linking the folder's files) is not published (its
    owner and mode would go to that name too); the error said the staged file 'was replaced by another', which sent
    the user looking for a second writer. It says now that it has 2 names, and the old file is kept whole."""
    import dorafp8.checkpoint.files as files

    single = tmp_path / "one.safetensors"
    files.save_file_atomic({"a": torch.ones(2)}, str(single), None)
    before = single.read_bytes()
    real = files.save_safetensors

    def linked(tensors, path, *args):  # a backup tool's hard link to the staged file
        real(tensors, path, *args)
        os.link(path, tmp_path / "backup")

    monkeypatch.setattr(files, "save_safetensors", linked)
    with pytest.raises(OSError, match=r"one\.safetensors.* has 2 names.*nothing was published"):
        files.save_file_atomic({"a": torch.zeros(2)}, str(single), None)
    assert single.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["backup", "one.safetensors"]


@pytest.mark.skipif(os.name != "posix", reason="Windows emulated on POSIX")
@pytest.mark.parametrize("size", ["single", "sharded"])
def test_an_export_is_written_where_windows_rules_hold(tmp_path, monkeypatch, size):
    """On Windows every export failed: staging opened its folder (os.open of a folder: PermissionError there), and
    fsync_file / replace fsynced a file opened read-only (FlushFileBuffers needs one open for writing: EBADF).
    Emulated: an os.O_BINARY (Windows' alone), no fcntl, both refusals; the export is written and reads back."""
    import fcntl as posix_fcntl
    import stat
    import sys

    import dorafp8.checkpoint.files as files

    real_open, real_fsync, binary = os.open, os.fsync, 0o10000000  # a bit no open flag of Linux's uses

    def win_open(path, flags, *args, **kwargs):  # shutil.rmtree opens folders only on POSIX
        if os.path.isdir(path) and sys._getframe(1).f_globals["__name__"] != "shutil":
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, flags & ~binary, *args, **kwargs)

    def win_fsync(fd):
        if posix_fcntl.fcntl(fd, posix_fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            raise OSError(9, "Bad file descriptor")
        return real_fsync(fd)

    dest = tmp_path / ("one.safetensors" if size == "single" else "folder")
    net = _net(0)
    monkeypatch.setattr(files, "fcntl", None)
    monkeypatch.setattr(os, "open", win_open)
    monkeypatch.setattr(os, "fsync", win_fsync)
    monkeypatch.setattr(os, "O_BINARY", binary, raising=False)
    _export(net, dest, SINGLE if size == "single" else SHARDED)
    monkeypatch.undo()
    assert stat.S_ISREG(dest.stat().st_mode) == (size == "single")
    assert not [n for n in os.listdir(tmp_path if size == "single" else dest) if n.endswith(".partial")]
    assert torch.equal(_output_of(dest), net(X))


@pytest.mark.parametrize("name, there", [
    ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin"),
    ("diffusion_pytorch_model.fp16.safetensors", "diffusion_pytorch_model.safetensors.index.fp16.json"),
    ("model.fp16.safetensors", "pytorch_model.fp16.bin")])
def test_a_single_file_is_not_written_where_from_pretrained_would_choose_between_it_and_another(name, there, tmp_path):
    """diffusers' and transformers' from_pretrained(folder) (variant= too) read one of a folder's weight files and
    never the other: a single-file export beside the user's legacy .bin (or an index) silently took its place.
    Refused, the folder as it was; a file of another variant, or another name, is written."""
    dest = _user_folder(tmp_path, {there: b"the user's weights"})
    with pytest.raises(FileExistsError, match=rf"holds {there!r}, and from_pretrained"):
        _export(_net(0), dest / name, SINGLE)
    _user_files_intact(dest, {there: b"the user's weights"})
    assert sorted(os.listdir(dest)) == [there]
    other = name.replace(".fp16", "") if ".fp16" in name else "merged.safetensors"
    _export(_net(0), dest / other, SINGLE)
    assert sorted(os.listdir(dest)) == sorted([there, other])


def test_a_relative_file_path_is_written_where_it_pointed_when_the_export_began(tmp_path, monkeypatch):
    """save_fp8_checkpoint(net, "out/net.safetensors") resolved the path again when it wrote the file, after the
    tensors were computed (minutes for a model): an os.chdir meanwhile (another thread's: a UI, a notebook) put the
    export into the other folder, over a file there that none of the checks made at the start had looked at."""
    for d in ("a", "b"):
        (tmp_path / d / "out").mkdir(parents=True)
    (tmp_path / "b" / "out" / "net.safetensors").write_bytes(b"someone else's")
    monkeypatch.chdir(tmp_path / "a")
    emit = W.emit
    monkeypatch.setattr(W, "emit", lambda *a, **k: (emit(*a, **k), os.chdir(tmp_path / "b"))[0])
    report = dorafp8.save_fp8_checkpoint(_net(0), "out/net.safetensors", format="dorafp8", verbose=False)
    assert (tmp_path / "b" / "out" / "net.safetensors").read_bytes() == b"someone else's"
    assert report.files == ["out/net.safetensors"]
    with torch.no_grad():
        torch.testing.assert_close(_output_of(tmp_path / "a" / "out" / "net.safetensors"), _net(0)(X))


@pytest.mark.parametrize("name", ["Flux.SafeTensors", "flux1-dev-fp8.SFT"])
def test_a_file_suffix_in_upper_case_is_written_and_read_as_one_file(name, tmp_path):
    """ComfyUI reads '.safetensors' and '.sft' in any case (comfy/utils.py load_torch_file: ckpt.lower().endswith);
    dorafp8 wrote 'Flux.SafeTensors' as a folder of that name, and refused such a file when loading it ('not a
    .safetensors file; load it yourself (torch.load)'). Now one file, which loads back to the same outputs."""
    from safetensors.torch import load_file

    net, dest = _net(0), str(tmp_path / name)
    _export(net, dest)
    assert os.path.isfile(dest) and os.listdir(tmp_path) == [name]
    assert load_file(dest).keys() == net.state_dict().keys()
    with torch.no_grad():
        assert torch.equal(_output_of(dest), net(X))
