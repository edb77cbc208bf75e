"""Every code block of README.md and docs/*.md runs, on CPU, on tiny models (docs/WRITING_DOCS.md).

tests/integration/doc_runner.py finds the blocks and their directives (hidden setups, sessions, scripts, declared
substitutions, reasons not to run); the blocks run in one subprocess (torch & co. imported once; a fresh namespace
and directory per block or session), and each block is one test here: passed, failed with its traceback and output, or skipped with the reason the doc gives
(README.md's first bash block: CI runs it). A block in a language the runner does not know, a directive that is not
attached to a block, or a script no command runs fails test_every_block_is_run_or_says_why.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.integration import doc_runner

BLOCKS, ERRORS = doc_runner.collect()
CODE = [b for b in BLOCKS if b.kind != "text"]


def _test_id(b: doc_runner.Block) -> str:
    tag = "run-by-ci" if b.not_run == doc_runner.CI_REASON else "not-run" if b.not_run else b.lang
    return f"{b.id}-{tag}"


@pytest.fixture(scope="module")
def doc_results(request, tmp_path_factory):
    """{block id: result} for the docs of the blocks this pytest run selected: one runner process for all of them
    (torch, transformers and peft imported once), started by the first block that asks."""
    selected = sorted({item.callspec.params["block"].doc for item in request.session.items
                       if item.originalname == "test_doc_block"}, key=doc_runner.docs().index)
    work = tmp_path_factory.mktemp("docs")
    out = work / "results.json"
    # No time limit on the whole run: each block has its own (doc_runner.COMMAND_TIMEOUT), and the runner writes the
    # results after every session, so a runner that dies (killed for memory, say) costs the blocks it had not run, each
    # failing with the cause, not an error of every block.
    proc = subprocess.run([sys.executable, str(doc_runner.HERE / "doc_runner.py"), *selected, "--json-out", str(out),
                           "--workdir", str(work)], capture_output=True, text=True, check=False, cwd=doc_runner.ROOT)
    results = json.loads(out.read_text()) if out.exists() else {}
    if proc.returncode not in (0, 1):  # 1: a block failed, which its test reports
        how = (f"killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0 else
               f"exit {proc.returncode}")
        died = f"the doc runner died ({how}) before this block had run; its output ends with:\n"
        results["_died"] = died + (proc.stdout + proc.stderr)[-4000:]
    return results


def test_every_block_is_run_or_says_why():
    assert ERRORS == [], "\n".join(ERRORS)
    assert CODE, "no code blocks found"


def test_readme_first_bash_block_is_the_one_ci_runs():
    """The one block skipped without a directive is the one .ci/run reads (test_newcomer checks what it holds)."""
    ci = (doc_runner.ROOT / ".ci" / "run").read_text()
    assert "awk '/^```bash/{f=1; next} f && /^```/{exit} f' README.md" in ci
    readme = [b for b in BLOCKS if b.doc == "README.md"]
    assert [b for b in readme if b.not_run == doc_runner.CI_REASON] == [next(b for b in readme if b.lang == "bash")]


@pytest.mark.parametrize("block", CODE, ids=[_test_id(b) for b in CODE])
def test_doc_block(block, doc_results):
    if block.not_run:
        pytest.skip(block.not_run)
    if block.id not in doc_results:
        pytest.fail(doc_results.get("_died", f"the doc runner returned no result for {block.id}"), pytrace=False)
    res = doc_results[block.id]
    if res["status"] == "failed":
        pytest.fail(f"{block.id} ({block.how()}):\n{res.get('output', '')}\n{res['error']}", pytrace=False)
    assert res["status"] == "passed", res


def test_runner_rejects_what_would_go_unrun():
    parse = doc_runner.parse
    _, errors = parse("x.md", "```\nfoo\n```\n")
    assert "language '(none)'" in errors[0]
    _, errors = parse("x.md", "<!-- setup: a model\nm = 1\n-->\nSome prose.\n```python\nm\n```\n")
    assert "not followed by a code block" in errors[0]
    _, errors = parse("x.md", "<!-- stup: typo -->\n```python\nm\n```\n")
    assert "unknown directive" in errors[0]
    _, errors = parse("x.md", "<!-- file: train.py -->\n```python\nx = 1\n```\n```bash\npython other.py\n```\n")
    assert "no bash or console block of its session runs it" in errors[0]
    blocks, errors = parse("x.md", "<!-- session: s -->\n<!-- file: t.py -->\n```python\nx = 1\n```\n"
                                   "<!-- session: s -->\n```bash\ntorchrun t.py\n```\n")
    assert errors == [] and blocks[0].file == "t.py" and blocks[1].session == "s"
    blocks, errors = parse("x.md", "  ```python\n  x = 1\n  ```\n<!-- not-run: needs a GPU -->\n```bash\nnvidia-smi\n"
                                   "```\n```text\ndiagram\n```\n")
    assert errors == [] and blocks[0].code == "x = 1\n" and not blocks[1].runs and blocks[2].kind == "text"


def test_console_blocks_check_what_the_command_prints(tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text("```console\n$ echo one; echo two\none\ntwo\n```\n\n```console\n$ echo one\nthree\n```\n")
    results = doc_runner.run_doc("d.md", tmp_path / "w", root=tmp_path)
    assert [r["status"] for r in results.values()] == ["passed", "failed"]
    assert "the doc says `echo one` prints\n  three" in results["d.md:7"]["error"]


def test_console_figures_may_differ_by_a_rounding_flip_only():
    """A decimal figure may differ by one unit in its last printed place (a value on a rounding edge flips between
    library versions: CHECKPOINTS' 0.5650% printed 0.57% and then 0.56%); a larger change, another precision, an
    integer (a count) or any other character fails."""
    same = doc_runner.same_line
    assert same("logits moved 0.57%; ratio 0.94-1.03", "logits moved 0.56%; ratio 0.95-1.02")
    assert same("worst 2.604e-02, 1.22x", "worst 2.605e-02, 1.21x")
    assert not same("logits moved 0.57%", "logits moved 0.55%")
    assert not same("logits moved 0.57%", "logits moved 0.6%")
    assert not same("worst 2.604e-02", "worst 2.604e-03")
    assert not same("over 14 layers", "over 15 layers")
    assert not same("torch 2.11.0", "torch 2.11.1")
    assert not same("merge error 0.57%", "merge errors 0.57%")


def test_a_slow_block_fails_by_its_limit_and_a_dead_runner_keeps_what_ran(tmp_path, monkeypatch):
    """A python block past doc_runner.COMMAND_TIMEOUT fails naming the limit (the blocks after it still run); a runner
    killed mid-doc leaves the results of the sessions it finished in its --json-out file."""
    monkeypatch.setattr(doc_runner, "COMMAND_TIMEOUT", 1)
    doc = tmp_path / "slow.md"
    doc.write_text("```python\nimport time\ntime.sleep(30)\n```\n\n```python\nprint('next')\n```\n")
    res = doc_runner.run_doc(str(doc), tmp_path / "work")
    first, second = (res[k] for k in sorted(res, key=lambda k: int(k.rsplit(":", 1)[1])))
    assert first["status"] == "failed" and "limit of 1 s" in first["error"] and first["seconds"] < 10, first
    assert second["status"] == "passed", second

    doc.write_text("```python\nprint('ran')\n```\n\n"
                   "```python\nimport os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n```\n")
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, str(doc_runner.HERE / "doc_runner.py"), str(doc), "--json-out", str(out)],
                          capture_output=True, text=True, check=False, cwd=doc_runner.ROOT,
                          env=dict(os.environ, TMPDIR=str(tmp_path)))  # its temp folder dies with it, not in /tmp
    assert proc.returncode == -signal.SIGKILL
    assert [r["status"] for r in json.loads(out.read_text()).values()] == ["passed"]


def test_a_command_past_its_limit_goes_with_every_process_it_started(tmp_path, monkeypatch):
    """A bash block past COMMAND_TIMEOUT fails with what it printed so far, and torchrun's workers (in sessions of
    their own) go with it: before, subprocess's timeout killed bash only, and a hung job kept the CI cores busy."""
    monkeypatch.setattr(doc_runner, "COMMAND_TIMEOUT", 45)
    doc = tmp_path / "hang.md"
    doc.write_text("<!-- session: s -->\n<!-- file: w.py -->\n```python\nimport os, time\n"
                   "open(f\"pid{os.environ['RANK']}\", 'w').write(str(os.getpid()))\n"
                   # one write(2) of a short line to a pipe is atomic: print's pieces from two ranks interleaved
                   "os.write(1, f\"worker {os.environ['RANK']} up\\n\".encode())\ntime.sleep(900)\n```\n\n"
                   "<!-- session: s -->\n```bash\ntorchrun --nproc_per_node 2 w.py\n```\n")
    res = doc_runner.run_doc(str(doc), tmp_path / "work")
    bash = res[max(res, key=lambda k: int(k.rsplit(":", 1)[1]))]
    assert bash["status"] == "failed" and "timed out after 45 s" in bash["error"], res
    assert "worker 0 up" in bash["error"] and "worker 1 up" in bash["error"], bash["error"]
    pids = [int(p.read_text()) for p in sorted((tmp_path / "work").rglob("pid[01]"))]
    assert len(pids) == 2, pids
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.5)
    assert not any(_alive(p) for p in pids), f"torchrun's workers outlived the timeout: {pids}"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False
