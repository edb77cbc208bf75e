"""Copy what bench/gpu_session.sh measured into bench/results/<device>/, the layout that gets committed.

    python bench/save_results.py OUT                 # OUT: the session's $OUT (holding session.tar.gz), the
    python bench/save_results.py OUT/session.tar.gz  #   tarball itself, or an unpacked staging folder
    python bench/save_results.py OUT --commit SHA    # the commit the session ran, if its results.json says unknown
    git add bench/results/<device>/ && git commit

Writes bench/results/<device-slug>/ (slug from the device name in results.json, e.g. nvidia-h100-80gb-hbm3):
results.json (meta: device, driver, torch / triton / peft versions, commit, date; one record per case), results.md
and the PNGs (redrawn by plot.py when the commit was filled in), session.md (the session's step table), device.txt,
tests_summary.txt, sanitizer_*_summary.txt, build_info.json, the ncu summary and details where profiled,
inspect.json where present, logs/ (each log's last 200 KB) and a README.md listing them.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import tarfile
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _cases import device_slug  # noqa: E402

LOG_TAIL = 200 * 1024


def _session_dir(src: str, tmp: str) -> str:
    """The staging folder of a session (the one holding bench/ and summary.md), unpacking a tarball if needed."""
    if os.path.isdir(src) and os.path.isfile(os.path.join(src, "session.tar.gz")):
        src = os.path.join(src, "session.tar.gz")
    if os.path.isfile(src) and src.endswith((".tar.gz", ".tgz")):
        with tarfile.open(src) as tf:
            for m in tf.getmembers():  # a session's own tarball: plain files and folders under session/
                if m.name.startswith(("/", "..")) or ".." in m.name.split("/") or not (m.isfile() or m.isdir()):
                    raise SystemExit(f"{src}: unexpected member {m.name!r}")
            tf.extractall(tmp)
        cands = [os.path.dirname(p) for p in glob.glob(os.path.join(tmp, "*", "summary.md"))]
        if not cands:
            raise SystemExit(f"{src}: no session/summary.md inside")
        return cands[0]
    if os.path.isdir(src):
        return src
    raise SystemExit(f"{src}: neither a session folder nor a session tarball")


def _tail(src: str, dst: str) -> None:
    size = os.path.getsize(src)
    with open(src, "rb") as f:
        if size > LOG_TAIL:
            f.seek(size - LOG_TAIL)
        data = f.read()
    with open(dst, "wb") as f:
        if size > LOG_TAIL:
            f.write(f"[... first {size - LOG_TAIL} bytes cut by save_results.py ...]\n".encode())
        f.write(data)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="the session's $OUT, its session.tar.gz, or an unpacked session folder")
    ap.add_argument("--dest", default=os.path.join(HERE, "results"), help="default bench/results")
    ap.add_argument("--commit", help="the commit the session ran (fills in results.json's commit if unknown)")
    ap.add_argument("--slug", help="folder name (default: from the device name in results.json)")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        sess = _session_dir(os.path.abspath(args.src), tmp)
        bench = os.path.join(sess, "bench")
        rj = os.path.join(bench, "results.json")
        if not os.path.isfile(rj):
            rj = os.path.join(sess, "results.json")
            bench = sess
        if not os.path.isfile(rj):
            raise SystemExit(f"{sess}: no results.json (did the bench step run? see its summary.md)")
        with open(rj) as f:
            results = json.load(f)
        meta = results["meta"]
        if not meta.get("speed_claims"):
            print("warning: these results come from a CPU run (no speed claims); committing them says nothing "
                  "about speed", file=sys.stderr)
        redraw = False
        if args.commit and str(meta.get("commit", "unknown")).startswith("unknown"):
            meta["commit"] = args.commit
            for r in results["records"]:
                r["commit"] = args.commit
            redraw = True
        elif str(meta.get("commit", "unknown")).startswith("unknown"):
            print("warning: results.json does not say which commit ran (no git on the GPU machine): pass --commit "
                  "SHA, or run the session with DORAFP8_COMMIT=SHA", file=sys.stderr)

        dest = os.path.join(args.dest, args.slug or device_slug(meta["device"]))
        os.makedirs(os.path.join(dest, "logs"), exist_ok=True)
        with open(os.path.join(dest, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
        written = ["results.json"]
        if redraw:
            import plot

            written += [os.path.basename(p) for p in plot.render(results, dest)]
        else:
            for p in [os.path.join(bench, "results.md")] + sorted(glob.glob(os.path.join(bench, "*.png"))):
                if os.path.isfile(p):
                    shutil.copy(p, dest)
                    written.append(os.path.basename(p))
        copies = {
            "summary.md": "session.md", "device.txt": "device.txt", "tests_summary.txt": "tests_summary.txt",
            "sanitizer_memcheck_summary.txt": "sanitizer_memcheck_summary.txt",
            "sanitizer_racecheck_summary.txt": "sanitizer_racecheck_summary.txt",
            "build_info.json": "build_info.json", "ncu/summary.txt": "ncu_summary.txt",
            "ncu/details.txt": "ncu_details.txt", "ncu/kernels.json": "ncu_kernels.json",
            "ncu/find.log": "ncu_find.txt", "inspect.json": "inspect.json",
        }
        for src, name in copies.items():
            p = os.path.join(sess, src)
            if os.path.isfile(p) and os.path.getsize(p) > 0:
                shutil.copy(p, os.path.join(dest, name))
                written.append(name)
        for p in sorted(glob.glob(os.path.join(sess, "*.log")) + glob.glob(os.path.join(sess, "ncu", "*.log"))):
            _tail(p, os.path.join(dest, "logs", os.path.basename(p)))
            written.append("logs/" + os.path.basename(p))

        session_md = ""
        if os.path.isfile(os.path.join(dest, "session.md")):
            session_md = open(os.path.join(dest, "session.md")).read()
        with open(os.path.join(dest, "README.md"), "w") as f:
            f.write(
                f"# {meta['device']}\n\n"
                f"bench/gpu_session.sh on {meta['device']} (driver {meta.get('driver')}), torch {meta['torch']} "
                f"(CUDA {meta.get('cuda')}), triton {meta.get('triton')}, peft {meta.get('peft')}; commit "
                f"{meta.get('commit')}; {meta['date']}.\n\n"
                "- results.md: the headline benchmark (dorafp8 vs PEFT vs the floors, the roofline, memory); "
                "results.json: every record; *.png: the plots\n"
                "- session.md: each step of the session (rc, seconds, outcome); logs/: their logs (tails)\n"
                "- tests_summary.txt, sanitizer_*_summary.txt: the GPU tests and compute-sanitizer\n"
                "- ncu_*: Nsight Compute on the slowest dorafp8 kernel (if the session ran with NCU=1); "
                "inspect.json: python -m dorafp8.kernel_report (if present)\n\n"
                "## Session\n\n" + session_md + "\n")
        written.append("README.md")
    print(f"wrote {dest}/: " + ", ".join(written))
    print(f"next: git add {os.path.relpath(dest)} && git commit -m 'bench results: {meta['device']}'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
