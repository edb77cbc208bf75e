"""One dorafp8 call at the headline shape, for Nsight Compute: find the slowest dorafp8 kernel, then profile it alone.

    python bench/ncu_profile.py find                 # torch.profiler over one call: dorafp8 kernels by device time
    ncu --profile-from-start off --kernel-name regex:'^NAME$' --launch-count 1 --set full -o rep \
        python bench/ncu_profile.py run              # the same call, with the profiler range around it only
    python bench/ncu_profile.py summarize rep.csv    # ncu --page raw --csv: tensor pipes, conversion pipes, stalls

Both `find` and `run` autotune and warm up first (outside the profiled range), then make one call of
--provider (dorafp8-triton: backend triton, W8A16; dorafp8-triton-w8a8: act_quant="rowwise"; dorafp8-cublas) in
--mode fwd+bwd (or fwd) at M x K x N, r, dropout p, bf16. Not in bench/first_contact.py (whose profile step
splits a forward + backward per kernel with torch.profiler): for a kernel that disagrees with its prediction.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import math
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(1, ROOT)

import torch  # noqa: E402

from _cases import DORAFP8_BACKENDS, LORA_ALPHA  # noqa: E402


def dorafp8_kernel_names() -> set[str]:
    """Names of dorafp8's own Triton kernels (the @triton.jit functions of triton_kernels/) and CUDA kernels."""
    names = set()
    for path in glob.glob(os.path.join(ROOT, "triton_kernels", "*.py")):
        src = open(path).read()
        names |= set(re.findall(r"@triton\.jit\s*\ndef\s+(\w+)\s*\(", src))
    for path in glob.glob(os.path.join(ROOT, "csrc", "*.cu")):
        names |= set(re.findall(r"__global__\s+(?:void\s+)?(?:__launch_bounds__\([^)]*\)\s+)?(?:void\s+)?(\w+)\s*\(",
                                open(path).read()))
    return names


def _base(name: str) -> str:
    """A kernel's function name without return type, template arguments or parameters (ncu's kernel-name base)."""
    name = re.sub(r"^void\s+", "", name.strip())
    return re.split(r"[<(]", name, maxsplit=1)[0].strip()


def build(args):
    import dorafp8

    backend, act_quant = DORAFP8_BACKENDS[args.provider]
    dev = torch.device("cuda")
    torch.manual_seed(0)
    M, K, N, r = args.tokens, args.in_features, args.out_features, args.rank
    w = torch.randn(N, K, device=dev, dtype=torch.bfloat16) / math.sqrt(K)
    w8, scale = dorafp8.quantize_e4m3(w)
    del w
    A = (torch.randn(r, K, device=dev) / math.sqrt(K)).requires_grad_()
    B = (torch.randn(N, r, device=dev) * 1e-3).requires_grad_()
    s = LORA_ALPHA / r
    with torch.no_grad():
        m = dorafp8.weight_norm(w8, scale, A, B, s, backend=backend).clone().requires_grad_()
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16).requires_grad_()
    dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    kw = {"act_quant": act_quant} if act_quant else {}

    def call():
        y = dorafp8.dora_fp8_linear(x, w8, scale, A, B, m, s, dropout_p=args.dropout, training=True,
                                    backend=backend, **kw)
        if args.mode == "fwd+bwd":
            y.backward(dy)
        for t in (x, A, B, m):
            t.grad = None

    return call


def cmd_find(args):
    call = build(args)
    for _ in range(3):  # autotune, compile, warm up
        call()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    ours = dorafp8_kernel_names()
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None)
        if t is None:
            t = getattr(ev, "cuda_time_total", 0)
        if t and ev.count:
            rows.append((t, ev.count, ev.key, _base(ev.key) in ours))
    rows.sort(reverse=True)
    print(f"device time of one {args.mode} call ({args.provider}, M={args.tokens}, {args.in_features}x"
          f"{args.out_features}, r={args.rank}, p={args.dropout:g}), by kernel:")
    for t, n, name, mine in rows[:25]:
        print(f"  {t:10.1f} us  x{n:<3d} {'dorafp8 ' if mine else '        '}{name[:110]}")
    slowest = next((_base(name) for t, n, name, mine in rows if mine), None)  # what ncu --kernel-name matches
    from dorafp8.triton_kernels import _common, hopper

    # main_loop: the fp8 GEMMs' (kernel_report --predict prints their times beside that loop's prediction)
    out = {"slowest": slowest, "main_loop": hopper.main_loop_for(_common.arch_of(torch.device("cuda"))),
           "kernels": [dict(us=t, count=n, name=name, dorafp8=mine) for t, n, name, mine in rows]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(f"slowest dorafp8 kernel: {slowest}")
    return 0 if slowest else 1


def cmd_run(args):
    call = build(args)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()  # ncu --profile-from-start off: only what runs between start and stop
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


# What the summary picks out of ncu's raw page (metric names differ across GPUs and ncu versions, so they are
# matched by pattern, never assumed): time and throughput, every tensor pipe, the pipes fp8 -> bf16 conversions
# can land on, and the warp stall reasons.
_SUMMARY = [
    ("time and throughput", r"^(gpu__time_duration\.sum|sm__throughput\.avg\.pct_of_peak_sustained_elapsed|"
                            r"gpu__compute_memory_throughput\.avg\.pct_of_peak_sustained_elapsed|"
                            r"dram__throughput\.avg\.pct_of_peak_sustained_elapsed|"
                            r"launch__registers_per_thread|launch__occupancy_limit_registers|"
                            r"sm__warps_active\.avg\.pct_of_peak_sustained_active|launch__grid_size|"
                            r"launch__shared_mem_per_block\w*)$"),
    ("tensor pipes (wgmma / mma)", r"^sm__(pipe|inst_executed_pipe)_tensor\w*\.(avg|sum)\.pct_of_peak\w*$"),
    ("conversion and other pipes", r"^sm__inst_executed_pipe_(alu|fma|fmaheavy|fmalite|fp16|xu|uniform|lsu|adu|cbu)"
                                   r"\w*\.avg\.pct_of_peak_sustained_active$"),
    ("warp stall reasons (cycles per issued instruction)",
     r"^smsp__average_warp_latency_issue_stalled_\w+\.ratio$|^smsp__average_warps_issue_stalled_\w+_per_issue_active"
     r"\.ratio$"),
]


def cmd_summarize(args):
    with open(args.csv) as f:
        rows = list(csv.reader(f))
    # ncu --page raw --csv: a row of metric names, a row of units (its "ID" cell empty), then one row per kernel.
    rows = [r for r in rows if r and not r[0].startswith("==")]  # drop ==PROF== / ==WARNING== lines
    has_units = len(rows) > 1 and rows[1] and rows[1][0] == ""
    first = 2 if has_units else 1
    if len(rows) <= first:
        print(f"{args.csv}: no profiled kernel")
        return 1
    names, values = rows[0], rows[first]
    units = rows[1] if has_units else [""] * len(names)
    metrics = {n: (v, u) for n, u, v in zip(names, units, values)}
    print(f"kernel: {metrics.get('Kernel Name', ('?', ''))[0]}  grid {metrics.get('Grid Size', ('?', ''))[0]}  "
          f"block {metrics.get('Block Size', ('?', ''))[0]}")
    for title, pattern in _SUMMARY:
        hits = [(n, v, u) for n, (v, u) in metrics.items() if re.match(pattern, n)]
        if title.startswith("warp stall"):
            def num(v):
                try:
                    return float(v.replace(",", ""))
                except ValueError:
                    return 0.0
            hits = sorted(hits, key=lambda h: -num(h[1]))[:10]
        print(f"{title}:")
        for n, v, u in hits or [("(none of these metrics in this report)", "", "")]:
            print(f"  {n:90s} {v} {u}")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=("find", "run", "summarize"))
    ap.add_argument("csv", nargs="?", help="summarize: the CSV of `ncu -i REP --page raw --csv`")
    ap.add_argument("--provider", default=os.environ.get("NCU_PROVIDER", "dorafp8-triton"),
                    choices=[p for p in DORAFP8_BACKENDS if p not in ("dorafp8-reference",)])
    ap.add_argument("--mode", default="fwd+bwd", choices=("fwd", "fwd+bwd"))
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--in-features", type=int, default=4096)
    ap.add_argument("--out-features", type=int, default=14336)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dropout", type=float, default=float(os.environ.get("NCU_DROPOUT", "0.05")))
    ap.add_argument("--json", help="find: write the kernel table and the slowest kernel's name here")
    args = ap.parse_args(argv)
    if args.cmd == "summarize":
        if not args.csv:
            ap.error("summarize needs the CSV path")
        return cmd_summarize(args)
    if not torch.cuda.is_available():
        sys.exit("ncu_profile.py needs a CUDA GPU")
    return cmd_find(args) if args.cmd == "find" else cmd_run(args)


if __name__ == "__main__":
    sys.exit(main())
