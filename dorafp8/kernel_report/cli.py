"""python -m dorafp8.kernel_report: what the compilers make of dorafp8's GPU kernels, read statically, without a GPU.

Compiles every Triton kernel (in every variant its launcher can produce, under every autotune config the launcher can
pick; the variants are listed in triton_kernels/inspect_spec.py) and the CUDA C++ kernels of csrc/ (the files of
csrc/build_spec.py's CUDA_SOURCES, each compiled on its own; the kernels are listed in csrc/inspect_spec.py) for sm_90a,
sm_89, sm_100a and sm_120, and reports per kernel x variant x config x arch: registers per thread, spill bytes and
shared memory from ptxas -v, which matrix instruction the kernel uses (wgmma / tcgen05 / mma.sync / none), and whether
the fp8 weight tile feeds it from registers or from shared memory. See docs/INSPECT.md.

    python -m dorafp8.kernel_report                       # everything, as a table (--list says how many compiles)
    python -m dorafp8.kernel_report --kernel dgrad --arch sm_90a --dtype bf16 --jobs 2
    python -m dorafp8.kernel_report --backend cuda --json
    python -m dorafp8.kernel_report --list                # what it would compile, and how many; compiles nothing
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .cuda_driver import cuda_dir_missing_reason, cuda_unavailable_reason
from .pool import cuda_jobs, plan, run
from .records import ARCHS, BACKENDS, SpecError, kernel_matches
from .predict import HEADLINE, HEADLINE_VARIANTS, headline, launches_subprocess, layer_seconds, linear_seconds
from .triton_driver import SPEC_MODULE

PROG = "python -m dorafp8.kernel_report"


_COLUMNS = [("backend", "backend"), ("kernel", "kernel"), ("arch", "arch"), ("dtype", "dtype"),
            ("variant", "variant"), ("config", "config"), ("regs", "regs"), ("spill_bytes", "spill"),
            ("smem_bytes", "smem"), ("mma", "mma"), ("w_operand", "W8 from"), ("main_loop", "main loop, per step"),
            ("autotune_pick", "pick")]


def loop_str(mix: dict | None) -> str:
    """A main-loop mix (sass.MIX_FIELDS) in a table cell: "4 mma, cvt 16u+16p+0 F2F, 0 PRMT, lds 16x2B 11x4B, 214".
    cvt: F2FP unpacks + F2FP packs + F2F; lds: shared loads by width (B: bytes), LDSM as "m"; the last figure is
    every instruction of the loop."""
    if mix is None:
        return "-"
    widths = [("lds8", "1B"), ("lds16", "2B"), ("lds32", "4B"), ("lds64", "8B"), ("lds128", "16B"), ("ldsm", "m")]
    lds = " ".join(f"{mix[k]}x{w}" for k, w in widths if mix[k]) or "0"
    return (f"{mix['mma']} mma, cvt {mix['f2fp_unpack']}u+{mix['f2fp_pack']}p+{mix['f2f']} F2F, {mix['prmt']} PRMT, "
            f"lds {lds}, {mix['instrs']}")


def problems_of(rec: dict) -> list[str]:
    """What the table flags in a record: errors, spills, shared memory over the arch's limit."""
    if rec["error"]:
        return ["ERROR"]
    out = []
    if rec["spill_bytes"]:
        out.append("SPILLS")
    if rec["smem_bytes"] > rec["smem_limit"]:
        out.append("SMEM>LIMIT")
    if rec["w_operand"] and (rec["main_loop"] or {}).get("f2f"):
        out.append("F2F-IN-LOOP")  # the weight tile's conversion takes the slow pipe (triton_kernels/gemm.py w8_to)
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
        if key == "main_loop":
            return loop_str(v)
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
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1])
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
    p.add_argument("--list", action="store_true",
                   help="compile nothing: list what would be compiled (with --json: the records' naming fields) and "
                        "print how many; needs Triton and the CUDA sources, not the compilers")
    p.add_argument("--predict", action="store_true",
                   help="compile the headline variants (forward, dgrad; W8A16 and W8A8; fp32 adapters r=16; sm_90a) "
                        "and print their PREDICTED times at M=8192, N=K=4096 against a cuBLAS Linear (a model, "
                        "docs/INSPECT.md 'Predicted time'; no GPU is used)")
    p.add_argument("--spec-module", default=SPEC_MODULE,
                   help="module with the Triton kernel specs (default: %(default)s)")
    return p.parse_args(argv)


def _selector(args):
    """The job (or record) filter of --kernel, --dtype, --variant and --config: a run and --list select alike."""
    def select(job) -> bool:
        return ((not args.kernel or kernel_matches(job["kernel"], args.kernel))
                and (not args.dtype or job["dtype"] in args.dtype)
                and (not args.variant or any(v in job["variant"] for v in args.variant))
                and (not args.config or any(c in job["config"] for c in args.config))
                and (not args.predict or (job["kernel"] in ("forward", "dgrad")
                                          and job["variant"] in HEADLINE_VARIANTS.values())))
    return select


_LIST_COLUMNS = [("backend", "backend"), ("kernel", "kernel"), ("arch", "arch"), ("dtype", "dtype"),
                 ("variant", "variant"), ("config", "config"), ("autotune_pick", "pick")]


def count_line(records: list[dict], nvcc_runs: int) -> str:
    """--list's last line: how many records a run makes, and how many compiles that takes."""
    triton = sum(r["backend"] == "triton" for r in records)
    cuda = len(records) - triton
    return (f"{len(records)} kernel x variant x config x arch records: {triton} Triton compiles, {cuda} CUDA kernels "
            f"from {nvcc_runs} nvcc runs (nothing compiled)")


def _list(args, backends) -> int:
    if "cuda" not in backends and args.backend == "all" and not cuda_dir_missing_reason():
        # run() would skip the CUDA kernels for want of a compiler; listing them needs only the sources
        print(f"{PROG}: listing the CUDA kernels, which a run here would skip", file=sys.stderr)
        backends.append("cuda")
    backends = [b for b in BACKENDS if b in backends]
    archs = args.arch or ARCHS

    select = _selector(args)

    try:
        records = plan(archs=archs, backends=backends, select=select, all_configs=args.all_configs,
                       spec_module=args.spec_module)
    except SpecError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([{k: r[k] for k, _ in _LIST_COLUMNS} for r in records], indent=1))
        return 0
    nvcc_runs = len(cuda_jobs(archs, select)) if "cuda" in backends else 0
    rows = [[("yes" if r[k] else "no") if k == "autotune_pick" else str(r[k]) for k, _ in _LIST_COLUMNS]
            for r in records]
    heads = [h for _, h in _LIST_COLUMNS]
    widths = [max(len(x) for x in col) for col in zip(heads, *rows)]
    for row in [heads, ["-" * w for w in widths], *rows]:
        print("  ".join(x.ljust(w) for x, w in zip(row, widths)).rstrip())
    print()
    print(count_line(records, nvcc_runs))
    return 0


def main(argv=None) -> int:
    args = _parse_args(argv)
    backends = list(BACKENDS) if args.backend == "all" else [args.backend]
    if args.backend == "all" and (why := cuda_unavailable_reason()):
        print(f"{PROG}: skipping the CUDA kernels: {why}", file=sys.stderr)
        backends.remove("cuda")

    if args.predict:  # the headline variants only (_selector), on sm_90a
        args.arch, args.backend, backends = ["sm_90a"], "triton", ["triton"]
    if args.list:
        return _list(args, backends)

    select = _selector(args)

    try:
        records = run(archs=args.arch or ARCHS, backends=backends, select=select, jobs=args.jobs,
                      all_configs=args.all_configs, spec_module=args.spec_module,
                      progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    except SpecError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    if args.predict:
        print(format_prediction(records))
    else:
        print(json.dumps(records, indent=1) if args.json else format_table(records))
    return 1 if any(r["error"] for r in records) else 0


def format_prediction(records: list[dict]) -> str:
    """--predict's output: per mode and GEMM, the fastest predicted config; then the GEMMs against the Linear."""
    rows = headline(records)
    lin = linear_seconds(*(HEADLINE[k] for k in ("M", "N", "K")))
    lines = [f"PREDICTED, not measured (docs/INSPECT.md, 'Predicted time'): H100 SXM, M={HEADLINE['M']}, "
             f"N=K={HEADLINE['N']}, r={HEADLINE['r']}, bf16, fp32 adapters"]
    for p in rows:
        lines.append(f"  {p['mode']:5}  {p['kernel']:7}  {p['seconds'] * 1e3:.3f} ms  bound by {p['bound']:6}  "
                     f"{p['config']}")
    lines.append(f"  cuBLAS bf16 Linear forward + input gradient: {lin * 1e3:.3f} ms")
    launches = launches_subprocess()
    for mode in HEADLINE_VARIANTS:
        gemms = {p["kernel"]: p["seconds"] for p in rows if p["mode"] == mode}
        lay = layer_seconds(gemms, launches[mode])
        lines.append(f"  {mode} forward + dgrad GEMMs: {sum(gemms.values()) * 1e3:.3f} ms = "
                     f"{sum(gemms.values()) / lin:.2f}x the Linear; the layer, {lay['launches']} launches "
                     f"({lay['other_launches']} besides the GEMMs, {lay['other_s'] * 1e3:.3f} ms at their bytes, "
                     f"{lay['gaps_s'] * 1e3:.3f} ms of gaps): {lay['seconds'] * 1e3:.3f} ms = "
                     f"{lay['seconds'] / lin:.2f}x the Linear")
    return "\n".join(lines)

