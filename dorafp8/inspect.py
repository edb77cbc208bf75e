"""python -m dorafp8.inspect: what the compilers make of dorafp8's GPU kernels, read statically, without a GPU.

Compiles every Triton kernel (in every variant its launcher can produce, under every autotune config the launcher
can pick; the variants are listed in triton_kernels/_inspect.py) and the CUDA C++ kernels of csrc/ (the files of
setup.py's CUDA_SOURCES, each compiled on its own; the kernels are listed in csrc/inspect_spec.py) for sm_90a and
sm_89, and reports per kernel x variant x config x arch: registers per thread, spill bytes and shared memory from
ptxas -v, which matrix instruction the kernel uses (wgmma / mma.sync / none), and whether the fp8 weight tile feeds
it from registers or from shared memory. See docs/INSPECT.md.

    python -m dorafp8.inspect                       # everything, as a table (long: several hundred compiles)
    python -m dorafp8.inspect --kernel dgrad --arch sm_90a --dtype bf16 --jobs 2
    python -m dorafp8.inspect --backend cuda --json

Run it as a module (-m): this file is named inspect.py, so running it as a script would put dorafp8/ first on
sys.path and shadow the standard library's inspect. Inside it every import is absolute for the same reason.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Callable, Iterable, Optional

ARCHS = ("sm_90a", "sm_89")
# Largest shared memory one block may use (with the opt-in launchers and Triton do): H100 227 KB, Ada 99 KB.
SMEM_LIMIT = {"sm_90a": 232448, "sm_89": 101376}
BACKENDS = ("triton", "cuda")

REPO = Path(__file__).resolve().parent.parent
CSRC = REPO / "csrc"
CUDA_SPEC = CSRC / "inspect_spec.py"
TRITON_SPEC_MODULE = "dorafp8.triton_kernels._inspect"

# Keys of every record, in the order the JSON output has them (docs/INSPECT.md says what each means).
FIELDS = (
    "backend", "kernel", "variant", "dtype", "arch", "config", "autotune_pick",
    "mma", "mma_shapes", "w_operand", "w8_dots", "w8_side", "wgmma_a_regs", "wgmma_a_smem",
    "regs", "spill_stores", "spill_loads", "spill_bytes", "stack_bytes", "smem_bytes", "smem_static", "smem_limit",
    "ptxas_notes", "compile_s", "error",
)


class SpecError(RuntimeError):
    """The kernels and their inspection spec disagree (a parameter or a kernel added, renamed or removed): update
    triton_kernels/_inspect.py or csrc/inspect_spec.py. Never skipped: a stale spec would inspect the wrong code."""


def _record(**kw) -> dict:
    rec = dict.fromkeys(FIELDS)
    rec.update(kw)
    return rec


# ======================================================================================================================
# ptxas -v, PTX and TTGIR readers (plain text in, plain data out)
# ======================================================================================================================

_PTXAS_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
_PTXAS_PROPS = re.compile(r"Function properties for (\S+)")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")


_PTXAS_NOTE = re.compile(r"ptxas\S*\s+(?:info|warning)\s*:\s*(\(C\d+\).*|.*[Ww]arning.*)$")
_PTXAS_NOTE_FN = re.compile(r"function '([^']+)'")


def parse_ptxas_log(log: str) -> dict[str, dict]:
    """{entry function (mangled name): regs, spill_stores, spill_loads, stack_bytes, smem_static, ptxas_notes} from
    ptxas -v.

    ptxas prints, per entry: "Compiling entry function 'X'", "Function properties for X" followed by the stack and
    spill line, then "Used N registers, ..., M bytes smem" (static shared memory only). Properties of non-inlined
    callees (.func) are printed under their own names and are not added to the entry's. Warnings and numbered
    advisories such as "(C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized ..." go to
    ptxas_notes of the function they name (of every entry if they name none)."""
    out: dict[str, dict] = {}
    notes: list[str] = []
    current = props_for = None
    for line in log.splitlines():
        if m := _PTXAS_NOTE.search(line):
            notes.append(m.group(1).strip())
        elif m := _PTXAS_ENTRY.search(line):
            current = m.group(1)
            out[current] = dict(regs=None, spill_stores=0, spill_loads=0, stack_bytes=0, smem_static=0,
                                ptxas_notes=[])
        elif m := _PTXAS_PROPS.search(line):
            props_for = m.group(1)
        elif m := _PTXAS_SPILL.search(line):
            if props_for in out:
                out[props_for].update(stack_bytes=int(m.group(1)), spill_stores=int(m.group(2)),
                                      spill_loads=int(m.group(3)))
        elif (m := _PTXAS_REGS.search(line)) and current is not None:
            out[current]["regs"] = int(m.group(1))
            if s := _PTXAS_SMEM.search(line):
                out[current]["smem_static"] = int(s.group(1))
    for note in notes:
        named = _PTXAS_NOTE_FN.search(note)
        for name, entry in out.items():
            if named is None or named.group(1) == name:
                entry["ptxas_notes"].append(note)
    return out


_PTX_FUNC = re.compile(r"^[ \t]*(?:\.visible[ \t]+|\.weak[ \t]+)*\.(?:entry|func)[ \t]+(?:\([^)]*\)[ \t]*)?([\w$]+)",
                       re.M)


def ptx_functions(ptx: str) -> dict[str, str]:
    """{function name: its text} for every .entry and .func of a PTX module."""
    heads = list(_PTX_FUNC.finditer(ptx))
    return {m.group(1): ptx[m.start():(heads[i + 1].start() if i + 1 < len(heads) else len(ptx))]
            for i, m in enumerate(heads)}


_WGMMA = re.compile(r"wgmma\.mma_async(?:\.sp)?\.sync\.aligned\.(m\d+n\d+k\d+)\.(\w+)\.(\w+)\.(\w+)")
# wgmma's A operand follows the accumulator list: a register list {..} or a 64-bit shared-memory descriptor %rd.
_WGMMA_A = re.compile(r"wgmma\.mma_async\S*\s+\{[^}]*\}\s*,\s*(\{|%)")
_MMA_SYNC = re.compile(r"\bmma\.sync\.aligned\.(m\d+n\d+k\d+)((?:\.[\w:]+)+)")
_MMA_LAYOUT = {"row", "col", "satfinite"}
_FMA = re.compile(r"\bfma\.rn(?:\.ftz)?\.f32\b")


def classify_mma(ptx: str) -> dict:
    """The matrix instructions of PTX text: mma ("wgmma bf16.bf16->f32", "mma.sync f16.f16->f32", several joined by
    " + ", "fma" when there are none but fp32 FMAs, else "none"), their shapes, and how many wgmma take A from
    registers and how many from a shared-memory descriptor."""
    kinds, shapes = set(), set()
    for shape, d, a, b in _WGMMA.findall(ptx):
        kinds.add(f"wgmma {a}.{b}->{d}")
        shapes.add(shape)
    for shape, suffix in _MMA_SYNC.findall(ptx):
        types = [t for t in suffix.strip(".").split(".") if t not in _MMA_LAYOUT and "::" not in t]
        if len(types) == 4:  # d, a, b, c
            kinds.add(f"mma.sync {types[1]}.{types[2]}->{types[0]}")
        else:
            kinds.add(f"mma.sync {'.'.join(types)}")
        shapes.add(shape)
    a_ops = _WGMMA_A.findall(ptx)
    if kinds:
        mma = " + ".join(sorted(kinds))
    else:
        mma = "fma" if _FMA.search(ptx) else "none"
    return dict(mma=mma, mma_shapes=sorted(shapes), wgmma_a_regs=a_ops.count("{"), wgmma_a_smem=a_ops.count("%"))


# --- TTGIR: which dot does the fp8 weight tile feed, and from where ----------------------------------------------------

_T_DEF = re.compile(r"^\s*(%[\w$.-]+(?::\d+)?(?:\s*,\s*%[\w$.-]+(?::\d+)?)*)\s*=\s*([\w.]+)(.*)$")
_T_RESULT = re.compile(r"%[\w$.-]+")     # the names in "%a, %b" or "%acc:3" (whose uses are %acc#0 ...)
_T_USE = re.compile(r"%[\w$.-]+")          # a use may carry a result index (%x#2): the match stops before it
_T_ATTRS = re.compile(r"\{[^{}]*\}")        # attribute dicts and encodings; region braces stay unbalanced
_T_TOKEN = re.compile(r"\btoken\s+%[\w$.-]+(?:#\d+)?")
_T_ITER_ARGS = re.compile(r"iter_args\((.*?)\)\s*->")
_T_PAIR = re.compile(r"(%[\w$.-]+)\s*=\s*(%[\w$.-]+)")
_T_LOC = re.compile(r"\s+loc\(.*\)\s*$")
_DOT_OPS = ("ttng.warp_group_dot", "tt.dot")
# Ops that write into a shared-memory buffer: (op, index of the destination among its operands).
_T_WRITES = {"ttg.async_copy_global_to_local": 1, "ttg.local_store": 1}
_T_VIEWS = ("ttg.memdesc_index", "ttg.memdesc_subslice", "ttg.memdesc_trans", "ttg.memdesc_reshape",
            "ttg.memdesc_reinterpret")


def ttgir_dots(ttgir: str, weight_arg: str) -> list[dict]:
    """Every dot of a TTGIR kernel with, per operand, where it comes from: {"op", "a", "b", "w8": which operands ("A",
    "B", "AB" or "") are computed from `weight_arg` (the fp8 weight pointer parameter, e.g. "w_ptr")}; "a"/"b": "registers"
    (a tensor: wgmma reads it from registers; mma.sync always does) or "shared" (a memdesc: wgmma reads it from shared
    memory).

    The W8 operand is found by data flow, not by names: a backward slice over the SSA def-use graph from each operand,
    through loop-carried values (scf.for iter_args: to their initial value) and shared-memory buffers (a buffer is
    computed from whatever is copied or stored into it), reaching the kernel parameter `%weight_arg`. Async tokens are
    not followed (they only order copies) and loop results are not entered."""
    edges: dict[str, set[str]] = defaultdict(set)
    dots = []
    scopes: list[tuple[int, dict[str, str]]] = []  # (brace depth outside the loop, its block args -> unique keys)
    depth = 0

    def resolve(name: str) -> str:  # block args (%argN) repeat across sibling loops: make them unique per loop
        for _, args in reversed(scopes):
            if name in args:
                return args[name]
        return name

    view_src: dict[str, str] = {}  # a view of a buffer (memdesc_index, ...) -> the memdesc it views

    def root_buffer(view: str) -> str:
        while view in view_src:
            view = view_src[view]
        return view

    for lineno, raw in enumerate(ttgir.splitlines()):
        code = _T_TOKEN.sub("", _T_ATTRS.sub("", _T_LOC.sub("", raw)))
        opens = raw.count("{") - raw.count("}")  # attribute braces pair up on their line; regions span lines
        if " scf.for " in code and "iter_args(" in code:
            pairs = _T_PAIR.findall(_T_ITER_ARGS.search(code).group(1))
            keys = {arg: f"{arg}@{lineno}" for arg, _ in pairs}
            for arg, init in pairs:
                edges[keys[arg]].add(resolve(init))
            scopes.append((depth, keys))
        elif m := _T_DEF.match(code):
            results, op, rest = m.groups()
            operands = [resolve(u) for u in _T_USE.findall(rest)]
            for result in _T_RESULT.findall(results):
                edges[result].update(operands)
                if op in _T_VIEWS and operands:
                    view_src[result] = operands[0]
            if op in _T_WRITES and len(operands) > _T_WRITES[op]:
                dst = operands[_T_WRITES[op]]
                edges[root_buffer(dst)].update(o for i, o in enumerate(operands) if i != _T_WRITES[op])
            if op in _DOT_OPS:
                star = code.index(" * ")
                a_type = code[code.rindex(" : ", 0, star) + 3:star].strip()
                b_type = code[star + 3:code.index(" -> ", star)].strip()
                dots.append(dict(op=op, operands=operands[:2],
                                 kinds=["shared" if t.startswith("!ttg.memdesc") else "registers"
                                        for t in (a_type, b_type)]))
        elif (m := re.match(r"^\s*([\w.]+)\s+(.*)$", code)) and m.group(1) in _T_WRITES:
            operands = [resolve(u) for u in _T_USE.findall(m.group(2))]
            idx = _T_WRITES[m.group(1)]
            if len(operands) > idx:
                edges[root_buffer(operands[idx])].update(o for i, o in enumerate(operands) if i != idx)
        depth += opens
        while scopes and depth <= scopes[-1][0]:
            scopes.pop()

    target = "%" + weight_arg

    def reaches_weight(value: str) -> bool:
        seen, todo = set(), [value]
        while todo:
            v = todo.pop()
            if v == target:
                return True
            if v not in seen:
                seen.add(v)
                todo.extend(edges.get(v, ()))
        return False

    return [dict(op=d["op"], a=d["kinds"][0], b=d["kinds"][1],
                 w8="".join(side for side, v in zip("AB", d["operands"]) if reaches_weight(v)))
            for d in dots]


def w8_operand(dots: list[dict]) -> dict:
    """From ttgir_dots: w_operand ("registers" | "shared" | "mixed" | None: where the dots the weight tile feeds read
    it from), w8_dots (how many dots it feeds) and w8_side ("A", "B", "AB" if both operands come from it, or None)."""
    kinds = {d[side.lower()] for d in dots for side in d["w8"]}
    sides = "".join(sorted({side for d in dots for side in d["w8"]}))
    return dict(w_operand=(kinds.pop() if len(kinds) == 1 else "mixed") if kinds else None,
                w8_dots=sum(bool(d["w8"]) for d in dots), w8_side=sides or None)


def config_str(cfg) -> str:
    """A triton.Config as "BLOCK_M=128,BLOCK_N=128,BLOCK_K=64,GROUP_M=8,w8,s4" (w: warps, s: stages)."""
    parts = [f"{k}={v}" for k, v in cfg.kwargs.items()] + [f"w{cfg.num_warps}", f"s{cfg.num_stages}"]
    if getattr(cfg, "num_ctas", 1) not in (1, None):
        parts.append(f"ctas{cfg.num_ctas}")
    if getattr(cfg, "maxnreg", None):
        parts.append(f"maxnreg{cfg.maxnreg}")
    return ",".join(parts)


# ======================================================================================================================
# Triton (runs in a worker process, see _Pool)
# ======================================================================================================================

def check_variant(kernel: str, param_names: list[str], constexpr_names: set[str], args: dict, constexprs: dict,
                  tuned: Iterable[str]) -> list[str]:
    """Problems (empty if none) between a kernel's parameters and what its spec variant passes: every parameter
    given exactly once, runtime parameters in `args`, tl.constexpr ones in `constexprs` or the autotune config."""
    tuned = set(tuned)
    given_rt, given_ce = set(args), set(constexprs) | tuned
    params = set(param_names)
    problems = []
    if missing := [p for p in param_names if p not in given_rt | given_ce]:
        problems.append(f"{kernel}: parameters not given by the spec: {missing}")
    if unknown := sorted((given_rt | given_ce) - params):
        problems.append(f"{kernel}: the spec gives arguments the kernel does not have: {unknown}")
    if wrong := sorted(given_rt & constexpr_names):
        problems.append(f"{kernel}: tl.constexpr parameters given as runtime args: {wrong}")
    if wrong := sorted((given_ce & params) - constexpr_names):
        problems.append(f"{kernel}: runtime parameters given as constexprs: {wrong}")
    if both := sorted(set(constexprs) & tuned):
        problems.append(f"{kernel}: autotuned parameters also pinned by the spec: {both}")
    return problems


def _triton_specs(spec_module: str):
    mod = importlib.import_module(spec_module)
    return mod, {s.name: s for s in mod.SPECS}


def _unlisted_kernels(specs) -> list[str]:
    """@triton.jit functions named *_kernel in the dorafp8.triton_kernels modules that no spec lists."""
    import pkgutil

    import triton

    import dorafp8.triton_kernels as pkg

    listed = {id(s.fn) for s in specs.values()}
    missing = []
    for info in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
        for name, obj in vars(mod).items():
            if (isinstance(obj, triton.runtime.jit.JITFunction) and name.endswith("_kernel")
                    and obj.fn.__module__ == mod.__name__ and id(obj) not in listed):
                missing.append(f"{mod.__name__}.{name}")
    return missing


def _variant_configs(mod, spec, arch: str, variant, all_configs: bool):
    """[(config, picked)]: the configs of this variant on `arch`, or with all_configs the union over all archs
    (picked says whether the launcher's list for `arch` has it)."""
    own = {config_str(c): c for c in variant.configs}
    if not all_configs:
        return [(c, True) for c in own.values()]
    union = dict(own)
    for table, _ in mod.ARCHS.values():
        for v in spec.variants(table):
            if (v.name, v.dtype) == (variant.name, variant.dtype):
                for c in v.configs:
                    union.setdefault(config_str(c), c)
    return [(c, key in own) for key, c in union.items()]


def _list_triton_jobs(req: dict) -> list[dict]:
    """Every (kernel, variant, config, arch) to compile; raises SpecError if any spec and kernel disagree."""
    mod, specs = _triton_specs(req["spec_module"])
    problems = []
    jobs = []
    for arch in req["archs"]:
        table, _ = mod.ARCHS[arch]
        for spec in specs.values():
            fn = spec.fn
            ce_names = {p.name for p in fn.params if p.is_constexpr}
            for v in spec.variants(table):
                for cfg, picked in _variant_configs(mod, spec, arch, v, req["all_configs"]):
                    problems += check_variant(spec.name, fn.arg_names, ce_names, v.args, v.constexprs, cfg.kwargs)
                    jobs.append(dict(op="triton", spec_module=req["spec_module"], kernel=spec.name, arch=arch,
                                     variant=v.name, dtype=v.dtype, config=config_str(cfg), autotune_pick=picked,
                                     all_configs=req["all_configs"]))
    problems += [f"{k} has no KernelSpec in {req['spec_module']}" for k in _unlisted_kernels(specs)]
    if problems:
        raise SpecError("the Triton kernels and their inspection spec disagree:\n  "
                        + "\n  ".join(dict.fromkeys(problems)))
    return jobs


def _compile_triton(job: dict) -> dict:
    """Compiles one (kernel, variant, config, arch) the way the launcher's JIT call would and reads the result."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import MockTensor, create_function_from_signature

    mod, specs = _triton_specs(job["spec_module"])
    spec = specs[job["kernel"]]
    table, cap = mod.ARCHS[job["arch"]]
    variant = next(v for v in spec.variants(table) if (v.name, v.dtype) == (job["variant"], job["dtype"]))
    cfg = next(c for c, _ in _variant_configs(mod, spec, job["arch"], variant, job["all_configs"])
               if config_str(c) == job["config"])
    rec = _record(backend="triton", kernel=job["kernel"], variant=job["variant"], dtype=job["dtype"],
                  arch=job["arch"], config=job["config"], autotune_pick=job["autotune_pick"],
                  smem_limit=SMEM_LIMIT[job["arch"]])
    t0 = time.time()
    try:
        fn = spec.fn
        target = GPUTarget("cuda", cap, 32)
        backend = make_backend(target)
        # What triton.autotune and JITFunction.run pass (Triton 3.9): the config's kwargs and options plus the
        # run-time knobs; then the JIT's own binder and _pack_args turn the example arguments into the signature,
        # constexprs (integers equal to 1 included) and divisibility attributes a real launch would compile with.
        kwargs = {**variant.constexprs, **cfg.all_kwargs()}
        kwargs["debug"] = getattr(fn, "debug", False) or knobs.runtime.debug
        kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        args = {k: MockTensor.wrap_dtype(v) for k, v in variant.args.items()}
        bound, specialization, options = binder(**args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                  options=options.__dict__)
        ptx, ttgir = compiled.asm["ptx"], compiled.asm["ttgir"]

        # ptxas -v on Triton's PTX with the ptxas and flags CUDABackend.make_cubin uses (Triton 3.9), so the numbers
        # are those of the cubin Triton built (checked against cuobjdump -res-usage of it). Triton prints its own
        # log only with knobs.nvidia.dump_ptxas_log, and only when it compiles rather than reads its cache.
        gpu = sm_arch_from_capability(cap)
        fmad = [] if compiled.metadata.enable_fp_fusion else ["--fmad=false"]
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "k.ptx"
            src.write_text(ptx)
            cmd = [get_ptxas(cap).path, "-lineinfo", *fmad, "-v", "--regAllocOptLevel=2", f"--gpu-name={gpu}",
                   str(src), "-o", str(Path(tmp) / "k.cubin")]
            proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"ptxas failed ({proc.returncode}): {proc.stderr[-2000:]}")
        usage = parse_ptxas_log(proc.stderr + proc.stdout).get(compiled.metadata.name)
        if usage is None:
            raise RuntimeError(f"no ptxas -v entry for {compiled.metadata.name}:\n{proc.stderr[-2000:]}")

        mma = classify_mma(ptx)
        # Kernels without the fp8 weight (weight_arg None: the backward pass, the rank-r GEMMs, the quantizer, the
        # epilogues) have no W8 operand to trace.
        w8 = w8_operand(ttgir_dots(ttgir, spec.weight_arg) if spec.weight_arg else [])
        if mma["mma"] in ("fma", "none") or not spec.weight_arg:
            w8["w_operand"] = None  # no tensor-core instruction: the question does not apply
        elif w8["w_operand"] == "registers" and mma["wgmma_a_smem"] and not mma["wgmma_a_regs"]:
            raise RuntimeError("TTGIR says the W8 tile feeds wgmma from registers but no wgmma in the PTX takes A "
                               "from registers: the reader is out of date with this Triton")
        rec.update(mma, **w8, **usage,
                   spill_bytes=usage["spill_stores"] + usage["spill_loads"],
                   smem_bytes=compiled.metadata.shared + usage["smem_static"])
    except Exception as e:  # one config that does not compile is data, not the end of the run
        rec["error"] = f"{type(e).__name__}: {e}".strip()[:4000]
    rec["compile_s"] = round(time.time() - t0, 2)
    return rec


# ======================================================================================================================
# CUDA C++ (csrc/*.cu: setup.py's CUDA_SOURCES)
# ======================================================================================================================

def _cuda_home() -> Optional[Path]:
    for cand in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if cand and (Path(cand) / "bin" / "nvcc").exists():
            return Path(cand)
    nvcc = shutil.which("nvcc")
    return Path(nvcc).resolve().parent.parent if nvcc else None


def _demangler() -> Optional[str]:
    home = _cuda_home()
    for cand in ([str(home / "bin" / "cu++filt")] if home else []) + ["cu++filt", "c++filt"]:
        if shutil.which(cand):
            return shutil.which(cand)
    return None


def cuda_unavailable_reason() -> Optional[str]:
    """None if the CUDA kernels can be compiled and read here, else why not."""
    home = _cuda_home()
    if home is None:
        return "nvcc not found (set CUDA_HOME)"
    if not (home / "bin" / "ptxas").exists():
        return f"ptxas not found in {home / 'bin'}"
    if not (REPO / "setup.py").exists() or not all((CSRC / f).exists() for f in setup_cuda_sources()):
        return f"the CUDA sources in {CSRC} not found (they are in the repository, not in installed wheels)"
    if _demangler() is None:
        return "neither cu++filt nor c++filt found (needed to match kernel names with csrc/inspect_spec.py)"
    return None


def triton_unavailable_reason() -> Optional[str]:
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        get_ptxas(90).path
    except Exception as e:  # triton missing, or without its NVIDIA backend / ptxas
        return f"Triton's NVIDIA backend is not usable: {type(e).__name__}: {e}"
    return None


def setup_nvcc_flags() -> list[str]:
    """The nvcc flags setup.py builds dorafp8._C with (read from setup.py, so there is one copy), minus -gencode."""
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value == "nvcc":
                    flags = value.left if isinstance(value, ast.BinOp) else value
                    return list(ast.literal_eval(flags))
    raise SpecError("setup.py has no literal 'nvcc' flag list in extra_compile_args any more: update "
                    "dorafp8/inspect.py:setup_nvcc_flags")


def setup_cuda_sources() -> list[str]:
    """The CUDA kernel files (names in csrc/) setup.py builds dorafp8._C from: its CUDA_SOURCES, the one list of them
    (read from setup.py without running it; the CPU emulator's build in tests/test_cuda_emulated.py uses it too)."""
    for node in ast.parse((REPO / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["CUDA_SOURCES"]:
            return list(ast.literal_eval(node.value))
    raise SpecError("setup.py has no literal CUDA_SOURCES list any more: update dorafp8/inspect.py:setup_cuda_sources")


def load_cuda_spec(path: Path = CUDA_SPEC) -> list[dict]:
    spec = importlib.util.spec_from_file_location("dorafp8_cuda_inspect_spec", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.KERNELS


_DEMANGLED = re.compile(r"^(?:void\s+)?dorafp8::detail::(\w+)(?:<(.*)>)?\(.*\)$")


def match_cuda_kernels(demangled: dict[str, str], rows: list[dict], source: str = "*.cu") -> dict[str, dict]:
    """{mangled name: its spec row}; raises SpecError unless the compiled kernels (of csrc/`source`) and the rows (of
    that source) are the same set."""
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
    """{each of setup.py's CUDA_SOURCES: the indices of its rows in the spec}; SpecError for a row of another file."""
    sources = setup_cuda_sources()
    if stray := sorted({r["source"] for r in rows} - set(sources)):
        raise SpecError(f"csrc/inspect_spec.py has rows of {stray}, which are not in setup.py's CUDA_SOURCES {sources}")
    return {src: [i for i, r in enumerate(rows) if r["source"] == src] for src in sources}


def _compile_cuda(job: dict) -> list[dict]:
    """Compiles one file of csrc/ (job["source"], as the extension build does: each kernel file is a translation unit
    of its own) for one arch with setup.py's flags; one record per kernel instantiation, in the spec's order.

    One nvcc run builds a small host program that #includes the file (so the device code is exactly the extension's)
    and prints the dynamic shared memory of each of its kernels from the launchers' own constants; the same run keeps
    the PTX (-keep) and prints ptxas -v."""
    arch, source = job["arch"], job["source"]
    code = arch.removeprefix("sm_")  # "90a"
    spec = load_cuda_spec(Path(job.get("cuda_spec") or CUDA_SPEC))
    rows = [spec[i] for i in cuda_spec_by_source(spec)[source]]
    home = _cuda_home()
    lines = "\n".join(f'  std::printf("{i} %lld\\n", static_cast<long long>({r["smem"]}));'
                      for i, r in enumerate(rows))
    probe = (f'#include "{source}"\n' '#include <cstdio>\nnamespace dorafp8 { namespace detail {\n'
             f"int print_smem() {{\n{lines}\n  return 0;\n}}\n}} }}\n"
             "int main() { return dorafp8::detail::print_smem(); }\n")
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "probe.cu").write_text(probe)
        cmd = [str(home / "bin" / "nvcc"), *setup_nvcc_flags(), "-gencode", f"arch=compute_{code},code=sm_{code}",
               f"-I{CSRC}", "-Xptxas", "-v", "-keep", "-keep-dir", tmp, "-o", str(Path(tmp) / "probe"),
               str(Path(tmp) / "probe.cu")]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed for {arch} ({proc.returncode}):\n{' '.join(cmd)}\n"
                               f"{(proc.stdout + proc.stderr)[-4000:]}")
        run = subprocess.run([str(Path(tmp) / "probe")], capture_output=True, text=True, check=True)
        smem = {int(i): int(v) for i, v in (ln.split() for ln in run.stdout.split("\n") if ln.strip())}
        ptx = "".join(p.read_text() for p in Path(tmp).glob("*.ptx"))
    usage = parse_ptxas_log(proc.stdout + proc.stderr)
    names = list(usage)
    filt = subprocess.run([_demangler()], input="\n".join(names) + "\n", capture_output=True, text=True, check=True)
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
        out.append(_record(
            backend="cuda", kernel=row["kernel"], variant=row["variant"], dtype=row["dtype"], arch=arch,
            config=row["config"], autotune_pick=True, **mma, w_operand=w_op, **u,
            spill_bytes=u["spill_stores"] + u["spill_loads"], smem_bytes=smem[i] + u["smem_static"],
            smem_limit=SMEM_LIMIT[arch], compile_s=elapsed))
    return out


# ======================================================================================================================
# Worker processes
# ======================================================================================================================

def _worker_main() -> None:
    """Serves one JSON request per stdin line with one JSON reply per line.

    Anything the compilers print goes to stderr: fd 1 is pointed at fd 2 and the replies use a private copy of the
    original stdout, so a chatty ptxas or Triton cannot break the protocol."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "list":
                reply = dict(ok=True, jobs=_list_triton_jobs(req))
            elif req["op"] == "triton":
                reply = dict(ok=True, records=[_compile_triton(req)])
            elif req["op"] == "cuda":
                reply = dict(ok=True, records=_compile_cuda(req))
            else:
                raise ValueError(f"unknown request {req['op']!r}")
        except SpecError as e:
            reply = dict(ok=False, spec_error=True, error=str(e))
        except Exception:
            reply = dict(ok=False, spec_error=False, error=traceback.format_exc())
        replies.write(json.dumps(reply) + "\n")
        replies.flush()


# A worker imports dorafp8.inspect and the kernel modules without running dorafp8/__init__.py, which imports peft and
# transformers (5-10 s per process, for nothing the worker uses): the package module is created from its spec but not
# executed, so that its submodules (found through its __path__, or the editable-install finder) import as usual.
_WORKER_BOOT = """
import importlib.util, sys
pkg = importlib.util.module_from_spec(importlib.util.find_spec("dorafp8"))
sys.modules["dorafp8"] = pkg
from dorafp8.inspect import _worker_main
_worker_main()
"""


class _Worker:
    """One worker process (_worker_main).

    Compiling happens in workers, never in the calling process, because TRITON_INTERPRET=1 (the tests set it when
    there is no GPU) makes @triton.jit return interpreter objects that cannot be compiled, and it takes effect when
    the kernel modules are imported: the workers start without it, whatever the caller has already imported."""

    def __init__(self):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER_BOOT], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)

    def call(self, req: dict) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.log.seek(0)
            raise RuntimeError(f"inspect worker died (exit {self.proc.wait()}); its stderr ends with:\n"
                               f"{self.log.read()[-4000:]}")
        reply = json.loads(line)
        if not reply["ok"]:
            raise (SpecError if reply["spec_error"] else RuntimeError)(reply["error"])
        return reply

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait()
        self.log.close()


# ======================================================================================================================
# Driver
# ======================================================================================================================

Select = Callable[[dict], bool]


def kernel_matches(name: str, wanted: Iterable[str]) -> bool:
    """--kernel NAME selects kernel NAME and the kernels named NAME_* ("forward": forward, forward_mma_kernel)."""
    return any(name == w or name.startswith(w + "_") for w in wanted)


def run(archs: Iterable[str] = ARCHS, backends: Iterable[str] = BACKENDS, select: Optional[Select] = None,
        jobs: int = 2, all_configs: bool = False, spec_module: str = TRITON_SPEC_MODULE,
        progress: Optional[Callable[[str], None]] = None) -> list[dict]:
    """Compiles and reads the kernels; returns one record per kernel x variant x config x arch (FIELDS).

    select(job) -> bool filters Triton jobs before compiling and CUDA records after (job: a dict with backend,
    kernel, variant, dtype, arch, config). Raises SpecError if a spec and its kernels disagree, RuntimeError if a
    backend cannot run here (see cuda_unavailable_reason / triton_unavailable_reason)."""
    archs, backends = list(archs), list(backends)
    select = select or (lambda job: True)
    if unknown := set(archs) - set(ARCHS):
        raise ValueError(f"unknown arch {sorted(unknown)}; known: {ARCHS}")
    for b, why in (("cuda", cuda_unavailable_reason()), ("triton", triton_unavailable_reason())):
        if b in backends and why:
            raise RuntimeError(f"cannot inspect the {b} kernels here: {why}")
    workers = [_Worker() for _ in range(max(1, jobs))]
    try:
        # the long ones first; one job per kernel file and arch, as the extension build compiles them
        todo = [dict(op="cuda", arch=a, source=f) for a in archs for f in setup_cuda_sources()] \
            if "cuda" in backends else []
        if "triton" in backends:
            listed = workers[0].call(dict(op="list", archs=archs, all_configs=all_configs,
                                          spec_module=spec_module))["jobs"]
            todo += [j for j in listed if select(dict(j, backend="triton"))]
        per_job = _run_jobs(workers, todo, progress)
    finally:
        for w in workers:
            w.close()
    # The CUDA records in the spec's order within each arch (as one job per arch gave them), whatever file they are in.
    by_source = cuda_spec_by_source(load_cuda_spec()) if "cuda" in backends else {}
    cuda = {(archs.index(job["arch"]), i): rec for job, recs in zip(todo, per_job) if job["op"] == "cuda"
            for i, rec in zip(by_source[job["source"]], recs)}
    records = [cuda[k] for k in sorted(cuda)] + [r for job, recs in zip(todo, per_job) if job["op"] != "cuda"
                                                  for r in recs]
    return [r for r in records if r["backend"] == "triton" or select(r)]


def _run_jobs(workers, todo, progress) -> list[list[dict]]:
    """Each job's records, in the order of todo."""
    q: queue.Queue = queue.Queue()
    for i, job in enumerate(todo):
        q.put((i, job))
    results: dict[int, list[dict]] = {}
    failures: list[BaseException] = []
    lock = threading.Lock()
    t0 = time.time()

    def serve(worker):
        while not failures:
            try:
                i, job = q.get_nowait()
            except queue.Empty:
                return
            try:
                recs = worker.call(job)["records"]
            except BaseException as e:
                failures.append(e)
                return
            with lock:
                results[i] = recs
                if progress:
                    what = (f"cuda {job['source']} {job['arch']} ({len(recs)} kernels)" if job["op"] == "cuda" else
                            f"{job['kernel']} {job['arch']} {job['dtype']} {job['variant']} {job['config']}")
                    bad = " ERROR" if any(r["error"] for r in recs) else ""
                    progress(f"[{len(results)}/{len(todo)} {time.time() - t0:.0f}s] {what}{bad}")

    threads = [threading.Thread(target=serve, args=(w,), daemon=True) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    return [results[i] for i in range(len(todo))]


# ======================================================================================================================
# Output
# ======================================================================================================================

_COLUMNS = [("backend", "backend"), ("kernel", "kernel"), ("arch", "arch"), ("dtype", "dtype"),
            ("variant", "variant"), ("config", "config"), ("regs", "regs"), ("spill_bytes", "spill"),
            ("smem_bytes", "smem"), ("mma", "mma"), ("w_operand", "W8 from"), ("autotune_pick", "pick")]


def problems_of(rec: dict) -> list[str]:
    """What the table flags in a record: errors, spills, shared memory over the arch's limit."""
    if rec["error"]:
        return ["ERROR"]
    out = []
    if rec["spill_bytes"]:
        out.append("SPILLS")
    if rec["smem_bytes"] > rec["smem_limit"]:
        out.append("SMEM>LIMIT")
    if any("C7512" in n or "serialized" in n for n in rec["ptxas_notes"]):
        out.append("WGMMA-SERIALIZED")
    elif rec["ptxas_notes"]:
        out.append("PTXAS-NOTE")
    return out


def format_table(records: list[dict]) -> str:
    def cell(rec, key):
        v = rec[key]
        if key == "autotune_pick":
            return "yes" if v else "no"
        return "-" if v is None else str(v)

    heads = [h for _, h in _COLUMNS] + ["!"]
    rows = [[cell(r, k) for k, _ in _COLUMNS] + [" ".join(problems_of(r))] for r in records]
    widths = [max(len(x) for x in col) for col in zip(heads, *rows)]
    numeric = {"regs", "spill", "smem"}
    fmt = lambda row: "  ".join(x.rjust(w) if h in numeric else x.ljust(w)
                                for x, w, h in zip(row, widths, heads)).rstrip()
    lines = [fmt(heads), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]
    errors = [r for r in records if r["error"]]
    lines.append("")
    lines.append(f"{len(records)} compiled: {sum(bool(r['spill_bytes']) for r in records if not r['error'])} with "
                 f"spills, {sum(r['smem_bytes'] > r['smem_limit'] for r in records if not r['error'])} over the "
                 f"shared-memory limit, {len(errors)} errors")
    for r in errors:
        lines.append(f"ERROR {r['backend']} {r['kernel']} {r['arch']} {r['dtype']} {r['variant']} {r['config']}: "
                     f"{r['error']}")
    return "\n".join(lines)


def _parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m dorafp8.inspect", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", action="append", choices=ARCHS, help="target (repeatable; default: all)")
    p.add_argument("--kernel", action="append",
                   help="kernel name or prefix: weight_norm, forward, dgrad, forward_mma_kernel, ... (repeatable)")
    p.add_argument("--backend", choices=("triton", "cuda", "all"), default="all")
    p.add_argument("--dtype", action="append", choices=("bf16", "fp16", "fp32"), help="compute dtype (repeatable)")
    p.add_argument("--variant", action="append",
                   help="keep variants whose name contains this text, e.g. 'adapter+dropout' or 'M<=64' (repeatable: "
                        "any of them)")
    p.add_argument("--config", action="append",
                   help="keep configs whose string contains this text, e.g. 'BLOCK_M=128,' or 'w8,s3' (repeatable)")
    p.add_argument("--all-configs", action="store_true",
                   help="also compile each variant under the configs other archs' lists have (autotune_pick=false)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: all cores)")
    p.add_argument("--json", action="store_true", help="print a JSON list of records instead of the table")
    p.add_argument("--spec-module", default=TRITON_SPEC_MODULE,
                   help="module with the Triton kernel specs (default: %(default)s)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse_args(argv)
    backends = list(BACKENDS) if args.backend == "all" else [args.backend]
    if args.backend == "all" and (why := cuda_unavailable_reason()):
        print(f"dorafp8.inspect: skipping the CUDA kernels: {why}", file=sys.stderr)
        backends.remove("cuda")

    def select(job):
        return ((not args.kernel or kernel_matches(job["kernel"], args.kernel))
                and (not args.dtype or job["dtype"] in args.dtype)
                and (not args.variant or any(v in job["variant"] for v in args.variant))
                and (not args.config or any(c in job["config"] for c in args.config)))

    try:
        records = run(archs=args.arch or ARCHS, backends=backends, select=select, jobs=args.jobs,
                      all_configs=args.all_configs, spec_module=args.spec_module,
                      progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    except SpecError as e:
        print(f"dorafp8.inspect: {e}", file=sys.stderr)
        return 2
    print(json.dumps(records, indent=1) if args.json else format_table(records))
    return 1 if any(r["error"] for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
