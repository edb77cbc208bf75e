"""Compiling the CUDA C++ kernels (csrc/) with nvcc for the report's targets (records.py) and reading the result.
Sources: dorafp8/csrc/ in an installed wheel (package data), else csrc/ next to the package (cuda_dir())."""

from __future__ import annotations

import importlib.util
import os
import re
import runpy
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from .parsers import classify_mma, parse_ptxas_log, ptx_functions
from .records import CUDA_CODE, SMEM_LIMIT, SpecError, new_record
from .sass import main_loop_mix, split_functions

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # dorafp8/
# Every file a compile needs besides the kernel files build_spec.py lists (checked, so that a partial copy says so).
_NEEDED = ("build_spec.py", "inspect_spec.py", "dora_fp8.h", "common")


def cuda_dir_candidates() -> list[Path]:
    """Where the CUDA sources may be: the installed package's data, then a source checkout's csrc/."""
    return [PACKAGE_DIR / "csrc", PACKAGE_DIR.parent / "csrc"]


def cuda_dir_missing_reason() -> str | None:
    """None if cuda_dir() finds the sources, else what is missing and how to get it."""
    if any(all((c / f).exists() for f in _NEEDED) for c in cuda_dir_candidates()):
        return None
    first, second = cuda_dir_candidates()
    return (f"the CUDA sources (csrc/*.cu, csrc/*.h, csrc/common/*.cuh, csrc/build_spec.py, csrc/inspect_spec.py) are "
            f"neither in {first} (installed package data) nor in {second} (a source checkout): install dorafp8 from "
            f"a wheel or sdist of this version (pip install dorafp8, whose package data has them) or run from a git "
            f"checkout (pip install -e .)")


def cuda_dir() -> Path:
    """The directory with the CUDA sources; FileNotFoundError naming what is missing and how to get it."""
    if why := cuda_dir_missing_reason():
        raise FileNotFoundError(why)
    return next(c for c in cuda_dir_candidates() if all((c / f).exists() for f in _NEEDED))


def build_spec() -> dict:
    """csrc/build_spec.py's names (CUDA_SOURCES, NVCC_FLAGS, ...), the lists setup.py builds dorafp8._C with."""
    return runpy.run_path(str(cuda_dir() / "build_spec.py"))


def cuda_sources() -> list[str]:
    """The CUDA kernel files (names in csrc/) the extension is built from: build_spec.py's CUDA_SOURCES, the one list
    of them (setup.py, this tool and the CPU emulator's build in tests/kernels/test_cuda_emulated.py read it)."""
    return list(build_spec()["CUDA_SOURCES"])


def nvcc_flags() -> list[str]:
    """The nvcc flags the extension is built with, minus -gencode (the arch is this tool's choice)."""
    return list(build_spec()["NVCC_FLAGS"])


def cuda_home() -> Path | None:
    """The toolkit the extension's builds take (csrc/build_spec.py's cuda_home)."""
    home = build_spec()["cuda_home"]()
    return Path(home) if home else None


def demangler() -> str | None:
    home = cuda_home()
    for cand in ([str(home / "bin" / "cu++filt")] if home else []) + ["cu++filt", "c++filt"]:
        if shutil.which(cand):
            return shutil.which(cand)
    return None


def cuda_unavailable_reason() -> str | None:
    """None if the CUDA kernels can be compiled and read here, else why not."""
    if why := cuda_dir_missing_reason():  # first: cuda_home() reads build_spec.py from there
        return why
    home = cuda_home()
    if home is None:
        return "nvcc not found (set CUDA_HOME)"
    if not (home / "bin" / "ptxas").exists():
        return f"ptxas not found in {home / 'bin'}"
    if missing := [f for f in cuda_sources() if not (cuda_dir() / f).exists()]:
        return f"{cuda_dir()} lacks {missing}, which build_spec.py's CUDA_SOURCES lists"
    if demangler() is None:
        return "neither cu++filt nor c++filt found (needed to match kernel names with csrc/inspect_spec.py)"
    return None


def load_cuda_spec(path: Path | None = None) -> list[dict]:
    """csrc/inspect_spec.py's KERNELS (loaded by path: in a checkout csrc/ is not a package)."""
    spec = importlib.util.spec_from_file_location("dorafp8_cuda_inspect_spec", path or cuda_dir() / "inspect_spec.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.KERNELS


_DEMANGLED = re.compile(r"^(?:void\s+)?dorafp8::detail::(\w+)(?:<(.*)>)?\(.*\)$")


def match_cuda_kernels(demangled: dict[str, str], rows: list[dict], source: str = "*.cu") -> dict[str, dict]:
    """{mangled name: spec row}; raises SpecError unless csrc/`source`'s kernels and its rows are the same set."""
    by_key = {(r["kernel"], r["targs"]): r for r in rows}
    out, extra, found = {}, [], set()
    for mangled, name in demangled.items():
        m = _DEMANGLED.match(name)
        key = (m.group(1), m.group(2)) if m else (name, None)
        if key in by_key:
            out[mangled] = by_key[key]
            found.add(key)
        else:
            extra.append(name)
    missing = [f"{k}<{t}>" if t else k for k, t in by_key if (k, t) not in found]
    if extra or missing:
        raise SpecError(f"csrc/{source} and csrc/inspect_spec.py disagree:\n"
                        + "".join(f"  compiled, not in the spec: {n}\n" for n in extra)
                        + "".join(f"  in the spec, not compiled: {n}\n" for n in missing))
    return out


def cuda_spec_by_source(rows: list[dict]) -> dict[str, list[int]]:
    """{each of build_spec.py's CUDA_SOURCES: its rows' indices in the spec}; SpecError for a row of another file."""
    sources = cuda_sources()
    if stray := sorted({r["source"] for r in rows} - set(sources)):
        raise SpecError(f"csrc/inspect_spec.py has rows of {stray}, which are not in build_spec.py's "
                        f"CUDA_SOURCES {sources}")
    return {src: [i for i, r in enumerate(rows) if r["source"] == src] for src in sources}


def compile_job(job: dict) -> list[dict]:
    """Compiles one file of csrc/ (a translation unit, as in the extension build) for one arch with the extension's
    flags: one record per kernel instantiation, with its host program's dynamic shared memory and ptxas -v's figures."""
    arch, source = job["arch"], job["source"]
    code = CUDA_CODE[arch]  # "90a": what the extension builds for this target
    spec = load_cuda_spec(Path(job["cuda_spec"]) if job.get("cuda_spec") else None)
    rows = [spec[i] for i in cuda_spec_by_source(spec)[source]]
    home = cuda_home()
    lines = "\n".join(f'  std::printf("{i} %lld\\n", static_cast<long long>({r["smem"]}));'
                      for i, r in enumerate(rows))
    probe = (f'#include "{source}"\n' '#include <cstdio>\nnamespace dorafp8 { namespace detail {\n'
             f"int print_smem() {{\n{lines}\n  return 0;\n}}\n}} }}\n"
             "int main() { return dorafp8::detail::print_smem(); }\n")
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "probe.cu").write_text(probe)
        cmd = [str(home / "bin" / "nvcc"), *nvcc_flags(), "-gencode", f"arch=compute_{code},code=sm_{code}",
               f"-I{cuda_dir()}", "-Xptxas", "-v", "-keep", "-keep-dir", tmp, "-o", str(Path(tmp) / "probe"),
               str(Path(tmp) / "probe.cu")]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed for {arch} ({proc.returncode}):\n{' '.join(cmd)}\n"
                               f"{(proc.stdout + proc.stderr)[-4000:]}")
        run = subprocess.run([str(Path(tmp) / "probe")], capture_output=True, text=True, check=True)
        smem = {int(i): int(v) for i, v in (ln.split() for ln in run.stdout.split("\n") if ln.strip())}
        ptx = "".join(p.read_text() for p in Path(tmp).glob("*.ptx"))
        sass = _sass(Path(tmp) / "probe.cubin")
    usage = parse_ptxas_log(proc.stdout + proc.stderr)
    names = list(usage)
    filt = subprocess.run([demangler()], input="\n".join(names) + "\n", capture_output=True, text=True, check=True)
    demangled = dict(zip(names, filt.stdout.splitlines()))
    rows_of = match_cuda_kernels(demangled, rows, source)
    funcs = ptx_functions(ptx)
    elapsed = round(time.time() - t0, 2)
    mangled_of = {id(row): mangled for mangled, row in rows_of.items()}
    out = []
    for i, row in enumerate(rows):  # in the spec's order
        mangled = mangled_of[id(row)]
        u = usage[mangled]
        mma = classify_mma(funcs.get(mangled, ""))
        if mma["mma"] in ("fma", "none"):
            w_op = None
        elif not mma["wgmma_a_regs"] + mma["wgmma_a_smem"]:
            w_op = "registers"  # mma.sync reads both operands from registers
        else:  # wgmma: which operand is W8 cannot be told from PTX alone; say where all A operands come from
            w_op = "registers" if not mma["wgmma_a_smem"] else "shared" if not mma["wgmma_a_regs"] else "mixed"
        out.append(new_record(
            backend="cuda", kernel=row["kernel"], variant=row["variant"], dtype=row["dtype"], arch=arch,
            config=row["config"], autotune_pick=True, **mma, w_operand=w_op, **u,
            spill_bytes=u["spill_stores"] + u["spill_loads"], smem_bytes=smem[i] + u["smem_static"],
            smem_limit=SMEM_LIMIT[arch], main_loop=main_loop_mix(sass.get(mangled, "")), compile_s=elapsed))
    return out


def _sass(cubin: Path) -> dict[str, str]:
    """{kernel: SASS} of the cubin nvcc -keep left. The CUDA toolkit's nvdisasm if it has one, else the one Triton
    ships (knobs.nvidia.nvdisasm); {} (main_loop None in the records) if neither is there."""
    tool = cuda_home() / "bin" / "nvdisasm"
    if not tool.exists():
        try:
            from triton import knobs

            tool = Path(knobs.nvidia.nvdisasm.path)
        except Exception:
            return {}
    done = subprocess.run([str(tool), "-c", str(cubin)], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{tool} failed on {cubin.name}: {done.stderr[-2000:]}")
    return split_functions(done.stdout)


