"""python -m dorafp8.kernel_report: what the compilers make of dorafp8's GPU kernels, read statically, without a GPU:
per kernel x variant x config x arch (sm_90a, sm_89, sm_100a, sm_120) registers, spills, shared memory, the matrix
instruction and where the fp8 weight tile comes from (docs/INSPECT.md).

    python -m dorafp8.kernel_report --list                # what it would compile; compiles nothing
    python -m dorafp8.kernel_report --kernel dgrad --arch sm_90a --dtype bf16 --jobs 2"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .cuda_driver import cuda_dir_missing_reason, cuda_unavailable_reason
from .pool import cuda_jobs, plan, run
from .records import ARCHS, BACKENDS, SpecError, kernel_matches
from .predict import (CPU_GLUE_S, DEQUANT_FLOOR_LAUNCHES, ENDS, HEADLINE, HEADLINE_VARIANTS, RATES, SMALL_MS,
                      dequant_floor_bytes, dequant_floor_seconds, dora_floor_bytes, headline, launches_subprocess,
                      layer_seconds, layer_table, linear_bytes, linear_seconds, measured)
from .triton_driver import SPEC_MODULE

PROG = "python -m dorafp8.kernel_report"


_COLUMNS = [("backend", "backend"), ("kernel", "kernel"), ("arch", "arch"), ("dtype", "dtype"),
            ("variant", "variant"), ("config", "config"), ("regs", "regs"), ("spill_bytes", "spill"),
            ("smem_bytes", "smem"), ("mma", "mma"), ("w_operand", "W8 from"), ("main_loop", "main loop, per step"),
            ("ws_consumers", "pipeline"), ("autotune_pick", "pick")]


def loop_str(mix: dict | None) -> str:
    """A main-loop mix (sass.MIX_FIELDS) as a table cell, "4 mma, cvt 16u+16p+0 F2F, ..." (docs/INSPECT.md)."""
    if mix is None:
        return "-"
    widths = [("lds8", "1B"), ("lds16", "2B"), ("lds32", "4B"), ("lds64", "8B"), ("lds128", "16B"), ("ldsm", "m")]
    lds = " ".join(f"{mix[k]}x{w}" for k, w in widths if mix[k]) or "0"
    sync = f"bar {mix.get('bar_cta', 0)}" + "".join(f", {name} {mix[k]}" for k, name in (("mbar_wait", "mbar"),
                                                                                        ("utmaldg", "tma"))
                                                    if mix.get(k))
    return (f"{mix['mma']} mma, cvt {mix['f2fp_unpack']}u+{mix['f2fp_pack']}p+{mix['f2f']} F2F, {mix['prmt']} PRMT, "
            f"lds {lds}, {sync}, {mix['instrs']}")


def pipeline_str(rec: dict) -> str:
    """How the main loop is fed, in a table cell: "ws 2, tma 3 (59)" (warp-specialized: consumer warpgroups, the
    producer's TMA loads a step and its instructions), "tiles" for a persistent tile loop without, "-" otherwise."""
    prod = rec.get("producer_loop")
    if rec.get("ws_consumers"):
        return f"ws {rec['ws_consumers']}" + (f", tma {prod['utmaldg']} ({prod['instrs']})" if prod else "")
    return "tiles" if rec.get("tile_loop") else "-"


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


def _table(heads: list[str], rows: list[list[str]], numeric=frozenset()) -> list[str]:
    """heads, a rule and rows in aligned columns (right-aligned under the `numeric` heads)."""
    widths = [max(len(x) for x in col) for col in zip(heads, *rows)]
    fmt = lambda row: "  ".join(x.rjust(w) if h in numeric else x.ljust(w)  # noqa: E731
                                for x, w, h in zip(row, widths, heads)).rstrip()
    return [fmt(heads), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


def format_table(records: list[dict]) -> str:
    def cell(rec, key):
        v = rec[key]
        if key == "autotune_pick":
            return "yes" if v else "no"
        if key == "main_loop":
            return loop_str(v)
        if key == "ws_consumers":
            return pipeline_str(rec)
        return "-" if v is None else str(v)

    rows = [[cell(r, k) for k, _ in _COLUMNS] + [" ".join(problems_of(r))] for r in records]
    lines = _table([h for _, h in _COLUMNS] + ["!"], rows, numeric={"regs", "spill", "smem"})
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
    p.add_argument("--results", default=os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "bench", "results"),
                   help="with --predict: the folder of GPU runs whose measurements are printed beside the predictions "
                        "(default: the checkout's bench/results)")
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
                                          and job["variant"].split(",async-copy")[0].split(",tma-ws")[0]
                                          in HEADLINE_VARIANTS.values())))
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
    print("\n".join(_table([h for _, h in _LIST_COLUMNS], rows)))
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
        print(format_prediction(records, args.results))
    else:
        print(json.dumps(records, indent=1) if args.json else format_table(records))
    return 1 if any(r["error"] for r in records) else 0


def _ms(lo: float, hi: float) -> str:
    return f"{lo * 1e3:.3f}" if abs(hi - lo) < 5e-7 else f"{lo * 1e3:.3f}-{hi * 1e3:.3f}"


def _x(lo: float, hi: float, lin: float) -> str:
    return f"{lo / lin:.2f}x" if abs(hi - lo) < 5e-7 else f"{lo / lin:.2f}-{hi / lin:.2f}x"


def format_prediction(records: list[dict], results_dir: str | None = None) -> str:
    """--predict's output: per mode, main loop and GEMM the fastest predicted config; every strategy's forward +
    backward against the Linear, beside what GPU runs measured; then the rates assumed and their sources."""
    M, N, K, r = (HEADLINE[k] for k in ("M", "N", "K", "r"))
    lin = linear_seconds(M, N, K)
    seen = measured(results_dir) if results_dir else dict(layers={}, kernels={})
    lines = [f"PREDICTED, not measured (docs/INSPECT.md, 'Predicted time'): H100 SXM, M={M}, N=K={N}, r={r}, bf16, "
             f"fp32 adapters, no dropout; each figure a range, its fast end to its slow end (the rates below)",
             "  GEMM kernels (the fastest config at the fast end; per step: cycles of one CTA's step at the fast end)"]
    kernels = {"forward": "dora_fwd_kernel", "dgrad": "dora_dgrad_kernel"}
    for p in headline(records):
        got = seen["kernels"].get((kernels[p["kernel"]], p["loop"])) if p["mode"] == "W8A16" else None
        meas = f"  measured {got[0][0] / 1e3:.3f} ms ({got[0][1]})" if got else ""
        lines.append(f"  {p['mode']:11}  {p['loop']:10}  {p['kernel']:7}  {_ms(p['lo']['seconds'], p['hi']['seconds'])}"
                     f" ms  bound by {p['lo']['bound']}/{p['hi']['bound']}, {p['lo']['step_cycles']:.0f} cycles a "
                     f"step  {p['config']}{meas}")
    cublas = "dequantize + cuBLAS"
    launches = launches_subprocess(small=[(cublas, m) for m in SMALL_MS])
    small = {k: launches.pop(k) for k in [k for k in launches if " @ " in k]}
    table = layer_table(records, launches)
    floor = dora_floor_bytes(M, N, K)
    lines.append(f"  forward + backward{'':22}launches   MiB  over floor    predicted ms    vs the Linear   "
                 "measured ms")
    rows = [dict(name="cuBLAS bf16 Linear", launches=2, bytes=linear_bytes(M, N, K), lo=lin, hi=lin)]
    for row in rows + table:
        got = seen["layers"].get(row["name"])
        meas = f"{got[0][0]:.3f} ({got[0][1]})" if got else "-"
        over = "-" if row is rows[0] else f"{(row['bytes'] - floor) / 2**20:+.0f}"
        lines.append(f"    {row['name']:36}  {row['launches']:8}  {row['bytes'] / 2**20:6.0f}  {over:>10}  "
                     f"{_ms(row['lo'], row['hi']):>14}  {_x(row['lo'], row['hi'], lin):>13}   {meas}")
    lines.append(f"  DoRA's floor (keeping z): the Linear's {linear_bytes(M, N, K) / 2**20:.0f} MiB + x again for dA, "
                 f"g again, z written and read back = {floor / 2**20:.0f} MiB ({floor / 1e6:.0f} MB); 'over floor' is "
                 f"each strategy's own overhead, MiB")
    for key, lcs in small.items():
        m = int(key.split(" @ ")[1])
        shape = dict(HEADLINE, M=m)
        t = {end: layer_seconds({}, lcs, end, shape)["seconds"] for end in ENDS}
        nbytes = sum(lc["nbytes"] for lc in lcs)
        lines.append(f"    {cublas + f' at M = {m}':36}  {len(lcs):8}  {nbytes / 2**20:6.0f}  "
                     f"{(nbytes - dora_floor_bytes(m, N, K)) / 2**20:+10.0f}  {_ms(t['lo'], t['hi']):>14}  "
                     f"{_x(t['lo'], t['hi'], linear_seconds(m, N, K)):>13}   (the Linear at M = {m}: "
                     f"{linear_seconds(m, N, K) * 1e3:.3f} ms, {linear_bytes(m, N, K) / 2**20:.0f} MiB)")
    deq = {end: dequant_floor_seconds(M, N, K, end) for end in ENDS}
    lines.append(f"  a dequantize + cuBLAS design's floor at the headline (the least we know of: docs/INSPECT.md): "
                 f"{DEQUANT_FLOOR_LAUNCHES} launches, {dequant_floor_bytes(M, N, K) / 2**20:.0f} MiB, "
                 f"{_ms(deq['lo'], deq['hi'])} ms, {_x(deq['lo'], deq['hi'], lin)} the Linear")
    lo, hi = CPU_GLUE_S
    lines.append(f"  the CPU: {lo * 1e3:.2f}-{hi * 1e3:.2f} ms of Python around the kernels per forward + backward "
                 f"(measured on this project's CPU at M = 256, bench/glue_cpu.py; Triton's own launch path not in it): "
                 f"hidden behind the GPU's time here, the floor of a step at small M without CUDA graphs")
    lines.append("  rates (per SM and clock unless stated; fast end, slow end):")
    for name, rate in RATES.items():
        lines.append(f"    {name:13} {rate.lo:g}, {rate.hi:g}: {rate.source}")
    return "\n".join(lines)
