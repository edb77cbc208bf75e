"""Draw results.md and the PNG plots from a results.json written by bench/run.py.

    python bench/plot.py OUT/results.json [--out DIR] [--rank 16] [--dtype bf16]

Without matplotlib the PNGs are skipped with a note (pip install matplotlib, or pip install -e .[bench]);
results.md is always written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _cases import (CACHED_MODES, DORAFP8_PROVIDERS, FLOOR_PROVIDERS, PEAKS, PEFT_PROVIDERS, PROVIDERS,  # noqa: E402
                    base_mode, floor_provider)

TIMED_MODES = ("fwd", "bwd", "fwd+bwd") + CACHED_MODES
NO_CLAIMS = "CPU run: times are perf_counter medians of tiny shapes, NO SPEED CLAIMS"


# ---------------------------------------------------------------------------------------------------------------
# Helpers



def _save(fig, name: str) -> str:
    """Writes a finished figure to `name` and frees it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(name, dpi=110)
    plt.close(fig)
    return name

def _ok(records):
    return [r for r in records if r["status"] == "ok" and r.get("ms")]


def _ms(v):
    if v is None:
        return "-"
    return f"{v:.3g}" if v < 100 else f"{v:.0f}"


def _ratio(a, b):
    return "-" if not a or not b else f"{a / b:.2f}x"


def _mib(b):
    return "-" if b is None else f"{b / 2**20:.3g}"


def _provider_order(records):
    present = {r["provider"] for r in records}
    return [p for p in PROVIDERS if p in present] + sorted(present - set(PROVIDERS))


def _shape_key(shape):
    k, n = shape.split("x")
    return int(k), int(n)


def _pick(values, prefer):
    values = sorted(set(v for v in values if v is not None))
    if not values:
        return None
    return prefer if prefer in values else values[0]


def _layer_key(r):
    return (r["shape"], r["tokens"], r["rank"], r["dtype"], r["mode"], r["dropout"])


def _floor_key(r):
    # The floors (linear-bf16, linear-fp8-rowwise) have neither rank nor dropout: one per (shape, M, dtype, mode).
    return (r["provider"], r["shape"], r["tokens"], r["dtype"], r["mode"])


def _roof_device(meta):
    """(PEAKS key, label) whose floor results.md shows beside each time: this GPU's, else the H100 SXM's."""
    dev = meta.get("roofline_device")
    if dev in PEAKS:
        return dev, PEAKS[dev]["name"]
    return "h100-sxm", PEAKS["h100-sxm"]["name"] + " (not this device)"


def _us(ms):
    return "-" if ms is None else (f"{ms * 1e3:.3g}" if ms * 1e3 < 1000 else f"{ms * 1e3:.0f}")


def _x(r):
    return "-" if r.get("x_roofline") is None else f"{r['x_roofline']:.2f}x"


def _table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# results.md


def write_md(results, path, png_note=None):
    meta, records = results["meta"], results["records"]
    ok = _ok(records)
    layer = [r for r in ok if r["mode"] != "step"]
    by_key = {}
    floors = {}
    for r in layer:
        if r["provider"] in FLOOR_PROVIDERS:
            floors[_floor_key(r)] = r
        else:
            by_key.setdefault(_layer_key(r), {})[r["provider"]] = r
    roof_dev, roof_label = _roof_device(meta)
    d8 = [p for p in DORAFP8_PROVIDERS if any(r["provider"] == p for r in layer)]
    peft = [p for p in PEFT_PROVIDERS if any(r["provider"] == p for r in layer)]

    out = ["# dorafp8 benchmark results", ""]
    if not meta.get("speed_claims"):
        out += [f"> **{NO_CLAIMS}.** These numbers check that the harness runs; they say nothing about speed.", ""]
    out += [
        f"- device: {meta['device']}",
        f"- torch {meta['torch']} (CUDA {meta.get('cuda')}), triton {meta.get('triton')}, peft {meta.get('peft')}, "
        f"transformers {meta.get('transformers')}",
        f"- commit {meta['commit']}, {meta['date']}, wall {meta.get('wall_s', '?')} s",
        f"- timing: {meta['timing']}" + ("; triton under TRITON_INTERPRET=1" if meta.get("triton_interpret") else ""),
    ]
    if meta.get("driver"):
        out.append(f"- driver {meta['driver']}, compute capability {meta.get('capability')}, {meta.get('sms')} SMs")
    if meta.get("copy_gbps"):
        out.append(f"- measured copy bandwidth (large D2D copy, read + write): {meta['copy_gbps']:.0f} GB/s")
    pk = PEAKS[roof_dev]
    out.append(f"- roofline floors on {roof_label} datasheet peaks: bf16/fp16 {pk['bf16']:g}, fp8 {pk['fp8']:g}, "
               f"fp32 (no tensor cores) {pk['fp32']:g} TFLOP/s dense, DRAM {pk['gbps']:g} GB/s (bench/README.md)")
    out += [
        "- FLOPs are the useful work of the DoRA math (the same for every DoRA provider of a case); bytes the minimum",
        "  traffic with the base weight in the provider's storage dtype. Shapes are KxN = in x out features, M tokens.",
        "",
    ]

    def case_order(k):  # M varies fastest, so a block of rows reads like a curve
        return (_shape_key(k[0]), k[2], k[3], TIMED_MODES.index(k[4]) if k[4] in TIMED_MODES else -1, k[5], k[1] or 0)

    def floor_rec(key, fprov):  # the floor provider's record for this case (its full call for *-cachednorm)
        if key[4] not in TIMED_MODES:
            return None
        return floors.get((fprov, key[0], key[1], key[3], base_mode(key[4])))

    def floor_of(key, prov):  # the floor a provider is compared with
        return floor_rec(key, floor_provider(prov))

    def peft_of(key):  # PEFT has no cached-norm forward: a cached dorafp8 call is compared with PEFT's full call
        return by_key.get(key[:4] + (base_mode(key[4]),) + key[5:], {})

    keys = sorted(by_key, key=case_order)

    # dorafp8 vs PEFT and vs the floor: one row per case and dorafp8 provider.
    rows = []
    for key in keys:
        provs = by_key[key]
        theirs = peft_of(key)
        for p in d8:
            if p not in provs:
                continue
            mine = provs[p]
            floor = floor_of(key, p)
            rows.append(
                [key[0], "-" if key[1] is None else key[1], key[2], key[3], key[4], f"{key[5]:g}", p, _ms(mine["ms"]),
                 "-" if mine["tflops"] is None else f"{mine['tflops']:.3g}"]
                + [_ratio(theirs[q]["ms"], mine["ms"]) if q in theirs else "-" for q in peft]
                + [_ratio(mine["ms"], floor["ms"]) if floor else "-",
                   _us((mine.get("roofline_ms") or {}).get(roof_dev)), _x(mine)]
            )
    out += ["## dorafp8 vs PEFT DoRA and vs the floor", "",
            "vs PEFT = PEFT ms / dorafp8 ms (above 1: dorafp8 is faster). x floor = dorafp8 ms / plain linear ms "
            "(forward + input gradient, no dropout, no rank: 1.00x would be free DoRA): linear-bf16 (cuBLAS) for "
            "the W8A16 providers, linear-fp8-rowwise (torch._scaled_mm) for dorafp8-triton-w8a8. "
            "norm = the weight norm alone. *-cachednorm = the call given the weight norm computed earlier (every "
            "gradient-accumulation micro-batch after the first), compared with PEFT's and the floor's full call. "
            f"TFLOP/s of the useful DoRA work. roofline us = the case's floor on {roof_label} (see Roofline below); "
            "x roofline = measured / that floor (on a GPU with known peaks only).", ""]
    if rows:
        out.append(_table(["shape", "M", "r", "dtype", "mode", "p", "dorafp8", "ms", "TFLOP/s"]
                          + [f"vs {q}" for q in peft] + ["x floor", "roofline us", "x roofline"], rows))
    else:
        out.append("_no dorafp8 results_")
    out.append("")

    # Every provider's median ms, one row per case.
    provs_all = [p for p in _provider_order(layer) if p not in FLOOR_PROVIDERS]
    floor_provs = [p for p in FLOOR_PROVIDERS if any(r["provider"] == p for r in layer)]
    rows = []
    for key in keys:
        rows.append([key[0], "-" if key[1] is None else key[1], key[2], key[3], key[4], f"{key[5]:g}"]
                    + [_ms(by_key[key][p]["ms"]) if p in by_key[key] else "-" for p in provs_all]
                    + [_ms(floor_rec(key, f)["ms"]) if floor_rec(key, f) else "-" for f in floor_provs])
    out += ["## All median times (ms)", "",
            "The floors: linear-bf16, a plain nn.Linear in the activation dtype, and linear-fp8-rowwise, "
            "torch._scaled_mm on per-token e4m3 activations and a per-row e4m3 weight (no rank, no dropout; their "
            "cached-norm rows repeat the full call).", ""]
    out.append(_table(["shape", "M", "r", "dtype", "mode", "p"] + provs_all + floor_provs, rows)
               if rows else "_no results_")
    out.append("")

    # Roofline: every measured layer case against its floor on each device's datasheet peaks.
    roof = [r for r in records if r["mode"] != "step" and r.get("roofline_ms")
            and any(v is not None for v in r["roofline_ms"].values())]
    if roof:
        devs = list(PEAKS)
        order = _provider_order(roof)
        roof.sort(key=lambda r: (_shape_key(r["shape"]), r["rank"], r["dtype"],
                                 TIMED_MODES.index(r["mode"]) if r["mode"] in TIMED_MODES else -1, r["dropout"],
                                 r["tokens"] or 0, order.index(r["provider"])))
        rows = [[r["shape"], "-" if r["tokens"] is None else r["tokens"], r["rank"], r["dtype"], r["mode"],
                 f"{r['dropout']:g}", r["provider"]]
                + [_us(r["roofline_ms"].get(d)) + f" ({(r.get('roofline_bound') or {}).get(d) or '-'})" for d in devs]
                + [_ms(r["ms"]) if r["status"] == "ok" else r["status"], _x(r)]
                for r in roof]
        out += ["## Roofline", "",
                "Floor = the largest of three times: the base-GEMM FLOPs at the tensor-core rate of the provider "
                "(fp8 for the W8A8 providers, else the activation dtype's; fp32 activations: the fp32 non-tensor "
                "rate) plus the norm and rank-r FLOPs at their adapters' rate (fp32 adapters: the fp32 non-tensor "
                "rate), each unit's work summed; and the minimum bytes at the DRAM bandwidth. In brackets the "
                "resource that sets it (tensor, fp32, memory). Datasheet peaks: dense, boost clock; measured "
                "matrix rates and copy bandwidth reach ~80% and ~90% of them. x roofline = measured ms / this "
                "device's floor (written on a GPU with known peaks only: on a CPU, only the floors).", "",
                _table(["shape", "M", "r", "dtype", "mode", "p", "provider"]
                       + [f"{PEAKS[d]['name']} us" for d in devs] + ["measured ms", "x roofline"], rows), ""]

    # the norm
    norms = [r for r in layer if r["mode"] == "norm"]
    if norms:
        copy = meta.get("copy_gbps")
        rows = []
        for r in sorted(norms, key=lambda r: (_shape_key(r["shape"]), r["rank"], r["dtype"],
                                              _provider_order(norms).index(r["provider"]))):
            rows.append([r["shape"], r["rank"], r["dtype"], r["provider"], r["weight_dtype"], _ms(r["ms"]),
                         "-" if r["gbps"] is None else f"{r['gbps']:.3g}",
                         "-" if not (copy and r["gbps"]) else f"{100 * r['gbps'] / copy:.0f}%"])
        out += ["## The weight norm", "",
                "GB/s = minimum bytes (weight in its storage dtype, A, B, m, n) / time; "
                "% of the measured copy bandwidth.",
                "", _table(["shape", "r", "dtype", "provider", "weight", "ms", "GB/s", "% copy BW"], rows), ""]

    # memory
    mem = [r for r in layer if r["mode"] == "fwd+bwd"]
    if mem:
        rows = [[r["shape"], r["tokens"], r["rank"], r["dtype"], f"{r['dropout']:g}", r["provider"],
                 _mib(r["weight_bytes"]), _mib(r["peak_mem_bytes"]), _mib(r["peak_extra_bytes"])]
                for r in sorted(mem, key=lambda r: (_shape_key(r["shape"]), r["tokens"], r["rank"], r["dtype"],
                                                    r["dropout"], _provider_order(mem).index(r["provider"])))]
        out += ["## Memory (fwd+bwd)", "",
                "weight = persistent layer weights (base in its storage dtype + scale + adapters); peak = "
                "torch.cuda.max_memory_allocated over one call (inputs and weights included); extra = peak minus "
                "what was allocated before the call. Peak is measured on CUDA only.", "",
                _table(["shape", "M", "r", "dtype", "p", "provider", "weight MiB", "peak MiB", "extra MiB"], rows),
                ""]

    # model step
    steps = [r for r in ok if r["mode"] == "step"]
    if steps:
        base = {(r["dtype"], r["dropout"]): r for r in steps if r["provider"] == "peft-dora"}
        rows = [[r.get("model", "-"), r["tokens"], r["rank"], r["dtype"], f"{r['dropout']:g}", r["provider"],
                 _ms(r["ms"]), _ratio(base[(r["dtype"], r["dropout"])]["ms"], r["ms"])
                 if (r["dtype"], r["dropout"]) in base else "-",
                 f"{r['tokens_per_s']:.4g}", _mib(r["weight_bytes"]), _mib(r["peak_mem_bytes"])]
                for r in sorted(steps, key=lambda r: (r["dtype"], r["dropout"],
                                                      _provider_order(steps).index(r["provider"])))]
        out += ["## One training step of a small LLaMA-style model", "",
                "forward + loss + backward + AdamW step over all adapters (q,k,v,o,gate,up,down). linear-bf16 / "
                "linear-fp8-rowwise: the frozen model's forward + input gradients only (no adapters). weight = the adapted linears' weights.", "",
                _table(["model", "tokens", "r", "dtype", "p", "provider", "ms", "vs peft-dora", "tokens/s",
                        "weight MiB", "peak MiB"], rows), ""]

    # what did not run
    notok = [r for r in records if r["status"] != "ok"]
    if notok:
        seen = {}
        for r in notok:
            seen.setdefault((r["provider"], r["status"], r["note"]), 0)
            seen[(r["provider"], r["status"], r["note"])] += 1
        rows = [[p, s, n, note.replace("|", "/")] for (p, s, note), n in sorted(seen.items())]
        out += ["## Not measured", "", _table(["provider", "status", "cases", "why"], rows), ""]
    if png_note:
        out += [f"_{png_note}_", ""]
    with open(path, "w") as f:
        f.write("\n".join(out))
    return path


# ---------------------------------------------------------------------------------------------------------------
# PNGs


def write_pngs(results, out_dir, rank=16, dtype="bf16"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta = results["meta"]
    layer = [r for r in _ok(results["records"]) if r["mode"] != "step"]
    tag = meta["device"] + ("" if meta.get("speed_claims") else f"\n{NO_CLAIMS}")
    written = []
    rank = _pick([r["rank"] for r in layer], rank)
    dtype = _pick([r["dtype"] for r in layer], dtype)
    shapes = sorted({r["shape"] for r in layer}, key=_shape_key)

    def sel(r, mode, p=None):
        # PEFT and the floor have no cached-norm call: their full call is drawn beside dorafp8's cached one.
        want = mode if r["provider"].startswith("dorafp8-") else base_mode(mode)
        if r["mode"] != want or r["dtype"] != dtype:
            return False
        if r["provider"] in FLOOR_PROVIDERS:  # the floors: no rank, no dropout
            return True
        return r["rank"] == rank and (p is None or r["dropout"] == p)

    # Time vs M per provider, one figure per (mode, dropout), one panel per shape.
    for mode in TIMED_MODES:
        for p in sorted({r["dropout"] for r in layer if r["mode"] == mode}):
            rs = [r for r in layer if sel(r, mode, p)]
            if not any(r["mode"] == mode for r in rs):
                continue
            fig, axes = plt.subplots(1, len(shapes), figsize=(max(7.0, 4.2 * len(shapes)), 4.2), squeeze=False)
            for ax, shape in zip(axes[0], shapes):
                for prov in _provider_order(rs):
                    pts = sorted((r["tokens"], r["ms"]) for r in rs if r["shape"] == shape and r["provider"] == prov)
                    if pts:
                        ax.plot(*zip(*pts), marker="o", label=prov,
                                linestyle="--" if prov in FLOOR_PROVIDERS else "-")
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.set_title(f"{shape} (KxN)", fontsize=9)
                ax.set_xlabel("tokens M")
                ax.grid(True, which="both", alpha=0.3)
            axes[0][0].set_ylabel("median ms")
            axes[0][-1].legend(fontsize=7)
            fig.suptitle(f"{mode}, lora_dropout {p:g}, r={rank}, {dtype}\n{tag}", fontsize=9)
            written.append(_save(fig, os.path.join(out_dir, f"time_vs_tokens_{mode.replace('+', '_')}_p{p:g}.png")))

    # The norm: time and GB/s per shape and provider.
    norms = [r for r in layer if r["mode"] == "norm" and r["rank"] == rank and r["dtype"] == dtype]
    if norms:
        provs = _provider_order(norms)
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.8))
        width = 0.8 / len(provs)
        for i, prov in enumerate(provs):
            xs = [j + i * width for j, s in enumerate(shapes) if any(r["shape"] == s and r["provider"] == prov
                                                                   for r in norms)]
            rs = [next(r for r in norms if r["shape"] == s and r["provider"] == prov) for s in shapes
                  if any(r["shape"] == s and r["provider"] == prov for r in norms)]
            a1.bar(xs, [r["ms"] for r in rs], width, label=prov)
            a2.bar(xs, [r["gbps"] or 0 for r in rs], width, label=prov)
        for ax in (a1, a2):
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes, fontsize=8)
        a1.set_ylabel("median ms")
        a1.set_yscale("log")
        a2.set_ylabel("GB/s (minimum bytes)")
        if meta.get("copy_gbps"):
            a2.axhline(meta["copy_gbps"], color="k", linestyle=":", label="copy bandwidth")
        a2.legend(fontsize=7)
        fig.suptitle(f"weight norm, r={rank}, {dtype}\n{tag}", fontsize=9)
        written.append(_save(fig, os.path.join(out_dir, "norm.png")))

    # Memory bars: fwd+bwd at the largest M, no dropout; and the model step.
    mem = [r for r in layer if sel(r, "fwd+bwd", 0.0)]
    steps = [r for r in _ok(results["records"]) if r["mode"] == "step" and r["dtype"] == dtype and r["dropout"] == 0]
    if mem or steps:
        panels = (["weight_bytes"] + (["peak_mem_bytes"] if any(r["peak_mem_bytes"] for r in mem) else [])
                  if mem else [])
        n_panels = len(panels) + (1 if steps else 0)
        fig, axes = plt.subplots(1, n_panels, figsize=(5.5 * n_panels, 3.8), squeeze=False)
        for ax, field in zip(axes[0], panels):
            provs = _provider_order(mem)
            width = 0.8 / len(provs)
            for i, prov in enumerate(provs):
                vals = []
                for s in shapes:
                    rs = [r for r in mem if r["shape"] == s and r["provider"] == prov]
                    big = max(rs, key=lambda r: r["tokens"]) if rs else None
                    vals.append((big[field] or 0) / 2**20 if big else 0)
                ax.bar([j + i * width for j in range(len(shapes))], vals, width, label=prov)
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes, fontsize=8)
            ax.set_ylabel("MiB")
            ax.set_title({"weight_bytes": "layer weight memory",
                          "peak_mem_bytes": "peak memory, fwd+bwd at the largest M"}[field], fontsize=9)
        if mem and len(panels) == 1:
            axes[0][0].set_title("layer weight memory (peak memory: measured on CUDA only)", fontsize=9)
        if mem:
            axes[0][0].legend(fontsize=7)
        if steps:
            ax = axes[0][-1]
            provs = _provider_order(steps)
            field = "peak_mem_bytes" if any(r["peak_mem_bytes"] for r in steps) else "weight_bytes"
            ax.bar(range(len(provs)), [(next(r for r in steps if r["provider"] == p)[field] or 0) / 2**20
                                       for p in provs], color=[f"C{i}" for i in range(len(provs))])
            ax.set_xticks(range(len(provs)), provs, rotation=30, ha="right", fontsize=7)
            ax.set_ylabel("MiB")
            ax.set_title(f"model step: {'peak' if field == 'peak_mem_bytes' else 'adapted-weight'} memory "
                         f"({steps[0].get('model', '')})", fontsize=9)
        fig.suptitle(f"memory, r={rank}, {dtype}\n{tag}", fontsize=9)
        written.append(_save(fig, os.path.join(out_dir, "memory.png")))
    return written


def render(results, out_dir, rank=16, dtype="bf16"):
    """Writes results.md and the PNGs into out_dir; returns the paths written."""
    os.makedirs(out_dir, exist_ok=True)
    written, note = [], None
    try:
        written = write_pngs(results, out_dir, rank=rank, dtype=dtype)
    except ImportError:
        note = "matplotlib is not installed: no PNGs (pip install matplotlib, or pip install -e .[bench])"
        print(f"note: {note}")
    md = write_md(results, os.path.join(out_dir, "results.md"), png_note=note)
    return [md] + written


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", help="results.json written by bench/run.py")
    ap.add_argument("--out", help="output directory (default: the json's directory)")
    ap.add_argument("--rank", type=int, default=16, help="rank drawn in the plots (default 16, else the smallest)")
    ap.add_argument("--dtype", default="bf16", help="activation dtype drawn in the plots")
    args = ap.parse_args(argv)
    with open(args.results) as f:
        results = json.load(f)
    out = args.out or os.path.dirname(os.path.abspath(args.results))
    for p in render(results, out, rank=args.rank, dtype=args.dtype):
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
