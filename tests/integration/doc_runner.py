"""Runs the code blocks of README.md and docs/*.md (tests/integration/test_docs.py; the rules for doc writers are in
docs/WRITING_DOCS.md).

Every fenced block has a language. `python`, `bash` (`sh`, `shell`) and `console` blocks run; `text` blocks
(diagrams, formulas, sample output) do not; any other language, or none, is an error. HTML comments right before a
block (only blank lines between) say what the runner needs to know and a reader does not:

    <!-- setup: what it stands for        python run first, in the block's namespace and directory (hidden from
    code                                  readers: builds the tiny model a reader has at "path/to/model", ...)
    -->
    <!-- session: NAME -->                blocks of one doc with the same NAME run in order in one namespace and
                                          one directory (each other block gets its own)
    <!-- file: NAME -->                   a python block that is a script: written (after its setups) to NAME in the
                                          session's directory before any block of it runs; a bash or console block
                                          of the session, or its own run-as, must name it (that runs it)
    <!-- run-as: why                      a bash or console block runs these commands instead of its own: a declared,
    commands                              visible substitution (a full kernel report compiles a thousand kernels);
    -->                                   on a file block: the command that runs the script
    <!-- not-run: why -->                 not run, with the reason (the test reports it as skipped)

README.md's first bash block is not run here: it is what CI itself runs (.ci/run reads it: install, demo, the whole
suite, which includes this runner).

Run as a script to see what it finds and how each block fares:
    python tests/integration/doc_runner.py --list              every block and how it is treated
    python tests/integration/doc_runner.py docs/DIFFUSION.md   run one doc's blocks, with seconds per block
The docs' blocks run in one Python process (fresh namespace and temp directory per block or session), on CPU
(CUDA_VISIBLE_DEVICES=""), offline; `python`, `python3`, `torchrun` and `accelerate` on PATH run the interpreter this
runs under (a venv's console scripts would otherwise be whatever is first on PATH); $DOC_REPO_ROOT is the checkout,
for a run-as that must run where a reader of a checkout would.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

RUN_LANGS = {"python": "python", "bash": "bash", "sh": "bash", "shell": "bash", "console": "console"}
TEXT_LANGS = {"text"}
KEYS = ("setup", "session", "file", "run-as", "not-run")
CI_REASON = "run-by-ci: .ci/run runs README.md's first bash block itself (install, demo, the whole test suite)"
SLOWEST_BLOCK_S = 150  # the slowest block on a quiet 2-core machine: DIFFUSION.md's sdxl-walkthrough figure, ~2 min
# A block (a python block, or one command line of a bash or console block) that runs longer fails, naming the limit: 5x
# the slowest, room for a machine whose other work leaves it a fifth of its cores (that figure took 5.5 min at a load
# of 8 to 9 on 2 cores), and a bound on a hung block.
COMMAND_TIMEOUT = 5 * SLOWEST_BLOCK_S


def docs(root: Path = ROOT) -> list[str]:
    return ["README.md", *sorted(str(p.relative_to(root)) for p in (root / "docs").glob("*.md"))]


@dataclasses.dataclass
class Block:
    doc: str
    line: int
    lang: str
    code: str
    setups: list = dataclasses.field(default_factory=list)  # [(first line of the code, code)]
    session: str | None = None
    file: str | None = None
    run_as: str | None = None  # the commands
    run_as_reason: str | None = None
    not_run: str | None = None

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def kind(self) -> str:
        return RUN_LANGS.get(self.lang, "text")

    @property
    def runs(self) -> bool:
        return self.kind != "text" and self.not_run is None

    def how(self) -> str:
        """How the runner treats the block, in words."""
        if self.kind == "text":
            return "text: not code"
        if self.not_run:
            return f"not run: {self.not_run}"
        parts = [f"session {self.session}"] if self.session else []
        if self.setups:
            parts.append("after its hidden setup")
        if self.file:
            parts.append(f"written to {self.file}" + ("" if self.run_as else ", run by the command that names it"))
        if self.run_as:
            parts.append(f"run as {' ; '.join(self.run_as.split(chr(10)))!r} ({self.run_as_reason})")
        return "run" + (": " + ", ".join(parts) if parts else "")


_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^\s`]*)")
_DIRECTIVE = re.compile(r"^\s*([a-z][a-z-]*):")


def parse(doc: str, text: str) -> tuple[list[Block], list[str]]:
    """(the fenced blocks of a markdown text with their directives, errors)."""
    lines = text.split("\n")
    blocks: list[Block] = []
    errors: list[str] = []
    pending: list[tuple[int, str, str, str]] = []  # (line, key, first line, body)
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence:
            indent, mark, lang = fence.groups()
            close = re.compile(rf"^\s*{re.escape(mark[0])}{{{len(mark)},}}\s*$")
            j, body = i + 1, []
            while j < len(lines) and not close.match(lines[j]):
                body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
                j += 1
            if j == len(lines):
                errors.append(f"{doc}:{i + 1}: code block never closed")
            block = Block(doc, i + 1, lang.lower(), "\n".join(body) + "\n")
            errors += _attach(block, pending)
            blocks.append(block)
            pending = []
            i = j + 1
            continue
        stripped = lines[i].strip()
        if stripped.startswith("<!--"):
            j = i
            while "-->" not in lines[j] and j + 1 < len(lines):
                j += 1
            comment = "\n".join(lines[i:j + 1]).strip()
            inner = comment[4:comment.rfind("-->")] if "-->" in comment else comment[4:]
            m = _DIRECTIVE.match(inner)
            if m and m.group(1) in KEYS:
                rest = inner[m.end():]
                first, _, body = rest.partition("\n")
                pending.append((i + 1, m.group(1), first.strip(), body))
            elif m:
                errors.append(f"{doc}:{i + 1}: unknown directive <!-- {m.group(1)}: -->; known: {', '.join(KEYS)}")
            i = j + 1
            continue
        if stripped and pending:
            errors.append(f"{doc}:{pending[0][0]}: <!-- {pending[0][1]}: --> is not followed by a code block (only "
                          f"blank lines and other directives may come between)")
            pending = []
        i += 1
    if pending:
        errors.append(f"{doc}:{pending[0][0]}: <!-- {pending[0][1]}: --> is not followed by a code block")
    if doc == "README.md":
        first_bash = next((b for b in blocks if b.lang == "bash"), None)
        if first_bash is not None:
            first_bash.not_run = CI_REASON
    errors += _check(doc, blocks)
    return blocks, errors


def _attach(block: Block, pending) -> list[str]:
    errors = []
    seen = set()
    for line, key, first, body in pending:
        where = f"{block.doc}:{line}"
        if key != "setup" and key in seen:
            errors.append(f"{where}: a second <!-- {key}: --> for the block at line {block.line}")
        seen.add(key)
        if key in ("session", "file", "not-run") and (body.strip() or not first):
            errors.append(f"{where}: <!-- {key}: VALUE --> takes one line")
        if key in ("setup", "run-as") and not body.strip():
            errors.append(f"{where}: <!-- {key}: why, then the code on the following lines -->: no code")
        if key == "setup":
            block.setups.append((line + 1, _dedent(body)))
        elif key == "session":
            block.session = first
        elif key == "file":
            block.file = first
        elif key == "run-as":
            block.run_as, block.run_as_reason = _dedent(body).strip(), first
        elif key == "not-run":
            block.not_run = first
    return errors


def _dedent(code: str) -> str:
    import textwrap

    return textwrap.dedent(code).rstrip() + "\n"


def _check(doc: str, blocks: list[Block]) -> list[str]:
    errors = []
    for b in blocks:
        if b.lang not in RUN_LANGS and b.lang not in TEXT_LANGS:
            errors.append(f"{b.id}: code block with language {b.lang or '(none)'!r}: give it python, bash or console "
                          f"to run it, or text (diagrams, formulas, sample output)")
        elif b.kind == "text" and (b.setups or b.session or b.file or b.run_as or b.not_run):
            errors.append(f"{b.id}: a text block takes no directives")
        if b.file and b.kind != "python":
            errors.append(f"{b.id}: <!-- file: --> is for python blocks")
        if b.run_as and b.kind == "python" and not b.file:
            errors.append(f"{b.id}: <!-- run-as: --> on a python block runs the script of its <!-- file: -->, "
                          f"and it has none")
        if b.not_run and (b.setups or b.file or b.run_as):
            errors.append(f"{b.id}: a block that is not run takes no setup, file or run-as")
    for unit in units(blocks):
        commands = "\n".join((b.run_as or b.code) for b in unit if b.kind in ("bash", "console") and b.runs)
        for b in unit:
            if b.file and b.runs and not re.search(rf"(^|[\s/]){re.escape(b.file)}(\s|$)",
                                                   commands + "\n" + (b.run_as or ""), re.MULTILINE):
                errors.append(f"{b.id}: <!-- file: {b.file} --> but no bash or console block of its session runs "
                              f"it" + ("" if b.session else " (give both blocks one <!-- session: -->)"))
    return errors


def units(blocks: list[Block]) -> list[list[Block]]:
    """Blocks that run together: one per session, one per block without a session; in the doc's order."""
    out: dict = {}
    for b in blocks:
        out.setdefault(b.session or b.id, []).append(b)
    return list(out.values())


def collect(root: Path = ROOT) -> tuple[list[Block], list[str]]:
    blocks, errors = [], []
    for doc in docs(root):
        b, e = parse(doc, (root / doc).read_text())
        blocks += b
        errors += e
    return blocks, errors


# ---------------------------------------------------------------------------------------------------- running


def environment(shim_dir: Path) -> dict:
    """What every block runs under: CPU only, offline, the fixtures importable, `python` & co. this interpreter."""
    shim_dir.mkdir(parents=True, exist_ok=True)
    py = shlex.quote(sys.executable)
    for name, cmd in (("python", py), ("python3", py), ("torchrun", f"{py} -m torch.distributed.run"),
                      ("accelerate", f"{py} -m accelerate.commands.accelerate_cli")):
        path = shim_dir / name
        path.write_text(f'#!/bin/sh\nexec {cmd} "$@"\n')
        path.chmod(0o755)
    # as a user runs them: none of the test suite's switches (TRITON_INTERPRET, DORAFP8_RACE, ...)
    env = {k: v for k, v in os.environ.items()
           if k != "TRITON_INTERPRET" and not k.startswith(("DORAFP8_", "PYTEST_"))}
    # TMPDIR inside the work folder: torchrun leaves a torchelastic_* folder in the temp folder at every job
    (tmp := shim_dir.parent / "tmp").mkdir(exist_ok=True)
    env.update(PATH=f"{shim_dir}{os.pathsep}{env.get('PATH', '')}", CUDA_VISIBLE_DEVICES="", DOC_REPO_ROOT=str(ROOT),
               TMPDIR=str(tmp),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH")) if p))
    return env


def _console(script: str) -> list[tuple[str, list[str]]]:
    """[(command, expected output lines)] of a console block: `$ command` lines (a trailing backslash continues one),
    each followed by the lines its output must contain, in order."""
    out: list[tuple[str, list[str]]] = []
    cont = False
    for line in script.rstrip("\n").split("\n"):
        if cont:
            out[-1] = (out[-1][0] + "\n" + line, out[-1][1])
        elif line.startswith("$ "):
            out.append((line[2:], []))
        elif out:
            out[-1][1].append(line.rstrip())
        elif line.strip():
            raise ValueError(f"console block: output before the first `$ ` command: {line!r}")
        cont = line.endswith("\\") and (cont or line.startswith("$ "))
    return out


class CommandFailed(Exception):
    """A command of a bash or console block failed, or printed other than the doc says (the message says all)."""


def _traceback(e: BaseException) -> str:
    """The traceback from the doc's code on (this module's frames dropped)."""
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(e), e, tb))


def _sh(command: str, cwd: Path, env: dict) -> str:
    # A session of its own, so that a command that hangs goes with all it started, and what it printed so far is in
    # the failure. SIGTERM first: torchrun's workers run in sessions of their own, and torchrun stops them on SIGTERM
    # (a SIGKILL to torchrun leaves them running on the CI machine's 2 cores).
    proc = subprocess.Popen(["bash", "-c", "set -eo pipefail\n" + command], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out = "".join(proc.communicate(timeout=COMMAND_TIMEOUT))
    except BaseException as e:
        got = _stop(proc)
        if isinstance(e, subprocess.TimeoutExpired):  # both streams' ends: a stop's tracebacks fill stderr's
            ends = "\n".join(f"{name}:\n{text[-3000:]}" for name, text in zip(("stdout", "stderr"), got))
            raise CommandFailed(f"timed out after {COMMAND_TIMEOUT} s (stopped with all it started): {command}\n{ends}")
        raise
    if proc.returncode:
        raise CommandFailed(f"exit {proc.returncode}: {command}\n{out[-6000:]}")
    return out


def _stop(proc: subprocess.Popen) -> tuple[str, str]:
    """SIGTERM to the command's process group, SIGKILL 60 s later if it is still there; what it printed (nothing if
    a process of another session still holds its output 10 s after that)."""
    for sig, wait_s in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            return proc.communicate(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
    return "", ""


# A decimal number as a figure prints it: digits, a point, digits, maybe an exponent (integers are not matched: a
# count must be exact).
_DECIMAL = re.compile(r"(?<![\w.])-?\d+\.(\d+)(e[+-]?\d+)?(?![\d.])")


def same_line(want: str, got: str) -> bool:
    """`got` is the line the doc quotes as `want`: the same text, and each decimal figure with the same digits up to one
    unit in its last printed place (a value on a rounding edge, 0.5650 printed as 0.57 or 0.56, flips between library
    versions; a figure that moved by more is a changed figure). Counts and every other character must be equal."""
    if want == got:
        return True
    wm, gm = list(_DECIMAL.finditer(want)), list(_DECIMAL.finditer(got))
    if len(wm) != len(gm) or _DECIMAL.sub("#", want) != _DECIMAL.sub("#", got):
        return False
    for w, g in zip(map(_figure, wm), map(_figure, gm)):
        if w[1:] != g[1:] or abs(w[0] - g[0]) > 1:  # another precision or exponent, or more than a rounding flip
            return False
    return True


def _figure(m: re.Match) -> tuple[int, int, str]:
    """(the figure in units of its last printed place, its decimals, its exponent): "-0.57" -> (-57, 2, "")."""
    return int(m.group(0)[:m.end(1) - m.start(0)].replace(".", "")), len(m.group(1)), m.group(2) or ""


def _check_output(expected: list[str], output: str, command: str) -> None:
    got = [ln.rstrip() for ln in output.split("\n")]
    pos = 0
    for want in (w for w in expected if w.strip()):
        try:
            pos = next(i for i in range(pos, len(got)) if same_line(want, got[i])) + 1
        except StopIteration:
            raise CommandFailed(f"the doc says `{command}` prints\n  {want}\nbut it printed (last 40 lines):\n"
                                 + "\n".join(got[-40:])) from None


def _exec(code: str, first_line: int, filename: str, ns: dict) -> None:
    # leading newlines: tracebacks then name the doc's own line numbers
    exec(compile("\n" * (first_line - 1) + code, filename, "exec"), ns)  # noqa: S102 (the docs' own code)


class BlockTimeout(Exception):
    """A python block ran past COMMAND_TIMEOUT."""


@contextlib.contextmanager
def _time_limit(seconds: int):
    """Raises BlockTimeout in the doc's code after `seconds` (SIGALRM: the runner is a script, its main thread runs the
    blocks). The bash commands have subprocess's own timeout."""
    def expired(signum, frame):
        raise BlockTimeout(f"the block ran past its limit of {seconds} s (doc_runner.COMMAND_TIMEOUT)")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def run_unit(unit: list[Block], workdir: Path, env: dict) -> dict[str, dict]:
    """Runs one session (or one block) in its own directory and namespace; {block id: result}."""
    workdir.mkdir(parents=True, exist_ok=True)
    if str(HERE) not in sys.path:  # setups import doc_fixtures (a subprocess finds it through PYTHONPATH)
        sys.path.insert(0, str(HERE))
    results: dict[str, dict] = {}
    ns: dict = {"__name__": "__main__"}
    old_cwd, old_env = os.getcwd(), dict(os.environ)
    os.chdir(workdir)
    os.environ.clear()
    os.environ.update(env)
    try:
        for b in unit:
            if b.file and b.runs:
                text = "".join(code for _, code in b.setups) + b.code
                (workdir / b.file).parent.mkdir(parents=True, exist_ok=True)
                (workdir / b.file).write_text(text)
        failed = None
        for b in unit:
            if b.kind == "text":
                continue
            if not b.runs:
                results[b.id] = {"status": "not-run", "reason": b.not_run, "seconds": 0.0}
                continue
            if failed:
                results[b.id] = {"status": "failed", "seconds": 0.0, "error": f"not reached: {failed} failed before it"}
                continue
            if b.file and not b.run_as:
                results[b.id] = {"status": "passed", "seconds": 0.0, "note": f"written to {b.file}"}
                continue
            t0 = time.time()
            buf = io.StringIO()
            try:
                with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf), _time_limit(COMMAND_TIMEOUT):
                    for line, code in ([] if b.file else b.setups):  # a script's setups are in its file
                        _exec(code, line, f"{b.doc} (setup)", ns)
                    if b.kind == "python" and not b.file:
                        _exec(b.code, b.line + 1, b.doc, ns)
                if b.kind in ("bash", "python") and b.run_as:  # python: the file's own command
                    buf.write(_sh(b.run_as, workdir, env))
                elif b.kind == "bash":
                    buf.write(_sh(b.run_as or b.code, workdir, env))
                elif b.kind == "console":
                    for command, expected in _console(b.run_as or b.code):
                        out = _sh(command, workdir, env)
                        buf.write(out)
                        if not b.run_as:
                            _check_output(expected, out, command)
                results[b.id] = {"status": "passed", "seconds": round(time.time() - t0, 1)}
            except BaseException as e:  # any failure of a doc's code is the block's result
                if isinstance(e, KeyboardInterrupt):
                    raise
                failed = b.id
                results[b.id] = {"status": "failed", "seconds": round(time.time() - t0, 1),
                                 "error": str(e) if isinstance(e, CommandFailed) else _traceback(e),
                                 "output": buf.getvalue()[-6000:]}
        for b in unit:  # a script passes or fails with the command that ran it
            if b.file and not b.run_as and b.runs and failed:
                results[b.id] = {"status": "failed", "seconds": 0.0,
                                 "error": f"written to {b.file}; the session failed at {failed}"}
    finally:
        os.chdir(old_cwd)
        os.environ.clear()
        os.environ.update(old_env)
    return results


def run_doc(doc: str, workdir: Path, root: Path = ROOT, on_results=None) -> dict[str, dict]:
    """Runs every unit of `doc`; on_results(results) after each unit, with that unit's results."""
    blocks, errors = parse(doc, (root / doc).read_text())
    if errors:
        raise SystemExit("\n".join(errors))
    env = environment(workdir / "bin")
    results = {}
    for k, unit in enumerate(units(blocks)):
        if any(b.kind != "text" for b in unit):
            done = run_unit(unit, workdir / f"{k:02d}-line{unit[0].line}", env)
            results.update(done)
            if on_results:
                on_results(done)
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("docs", nargs="*", help="README.md, docs/X.md (default: all)")
    p.add_argument("--list", action="store_true", help="list every block and how it is treated; run nothing")
    p.add_argument("--json-out", help="write {block id: result} here (what test_docs.py reads)")
    p.add_argument("--workdir", help="directory for the blocks' directories (default: a temporary one)")
    args = p.parse_args(argv)
    names = args.docs or docs()
    if args.list:
        bad = False
        for doc in names:
            blocks, errors = parse(doc, (ROOT / doc).read_text())
            for b in blocks:
                print(f"{b.id:28} {b.lang or '(none)':8} {b.how()}")
            for e in errors:
                print("ERROR", e)
                bad = True
        return 1 if bad else 0
    results = {}

    def report(done: dict) -> None:
        # with --json-out the file is rewritten after every unit: if the runner dies, what ran before is kept
        results.update(done)
        if args.json_out:
            tmp_out = Path(args.json_out + ".part")
            tmp_out.write_text(json.dumps(results, indent=1))
            os.replace(tmp_out, args.json_out)
            return
        for bid, res in done.items():
            print(f"{bid:28} {res['status']:8} {res['seconds']:6.1f}s  "
                  f"{res.get('reason') or res.get('note') or ''}", flush=True)
            if res["status"] == "failed":
                print(res.get("output", ""), res["error"], sep="\n")

    report({})
    with tempfile.TemporaryDirectory(prefix="doc-run-") as tmp:
        for doc in names:
            run_doc(doc, Path(args.workdir or tmp) / doc.replace("/", "_"), on_results=report)
    return 1 if any(r["status"] == "failed" for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
