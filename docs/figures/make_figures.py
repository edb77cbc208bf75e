"""Draws the two diagrams of the documentation: docs/img/dataflow.png and docs/img/save_load.png.

    python docs/figures/make_figures.py [--out DIR]        (default DIR: docs/img of this checkout; needs matplotlib)

dataflow.png: one DoRA layer's forward and backward on an fp8 base, as docs/DORA_MATH.md writes it: what each of the
six backend functions (dorafp8/backends/base.py's contract) reads, computes and hands on, what autograd keeps for the
backward, and the kernels that run each on the GPU backends. The function names come from the contract, and every
kernel name is checked against the source that defines it, so a rename fails here instead of leaving a stale picture.

save_load.png: every way to save a model with dorafp8 layers, the file each writes, and what loads it (docs/CHECKPOINTS.md,
"Every save path, and what reads it"). The rows and the dorafp8 and transformers columns are derived from
dorafp8/checkpoint/layouts.py (LAYOUTS, DENSE_FORMATS, TRANSFORMERS_FORMATS); the rest (vLLM, ComfyUI, PEFT, diffusers,
what transformers' save_pretrained picks) is the table below, checked against the layout names of that module.

The other two pictures, docs/img/demo.png and docs/img/demo_memory.png, are drawn by the demo itself:
python -m dorafp8.demo --plot docs/img/demo.png
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DPI = 100

# ---------------------------------------------------------------------------------------------------- dataflow

# contract function -> (Triton kernel, its file), (CUDA kernels or None, their file): checked against the sources.
# None: the cuda backend runs Triton's (else the reference's) there (dorafp8/backends/cuda.py, rank_ops).
KERNELS = {
    "weight_norm": (("dora_weight_norm_kernel", "triton_kernels/weight_norm.py"),
                    ("weight_norm_kernel", "csrc/weight_norm.cu")),
    "project": (("project_kernel", "triton_kernels/lowrank.py"), None),
    "forward": (("dora_fwd_kernel", "triton_kernels/forward.py"),
                ("forward_mma_kernel (16-bit) / forward_simt_kernel (fp32)", "csrc/forward.cu")),
    "backward_pass": (("dora_bwd_pass_kernel", "triton_kernels/backward.py"), None),
    "dgrad": (("dora_dgrad_kernel", "triton_kernels/dgrad.py"),
              ("dgrad_mma_kernel / dgrad_simt_kernel (fp32)", "csrc/dgrad.cu")),
    "project_grad": (("project_grad_kernel", "triton_kernels/lowrank.py"), None),
}

COLORS = {
    "frozen": ("#fde9d0", "#d9822b"),     # the fp8 weight: read, never written
    "param": ("#e3f2e1", "#4a9a45"),      # trainable adapters and their gradients
    "act": ("#e2edf8", "#3b78b5"),        # activations and their gradients
    "kernel": ("#f4f4f4", "#444444"),     # a backend function
    "saved": ("#efe6f6", "#8053a8"),      # kept by autograd between forward and backward
    "torch": ("#ffffff", "#888888"),      # plain PyTorch in ops/linear.py
}


def check_kernel_names() -> None:
    from dorafp8.backends.base import CONTRACT

    assert set(KERNELS) == set(CONTRACT), (sorted(KERNELS), CONTRACT)
    for pair in KERNELS.values():
        for entry in pair:
            if entry is None:
                continue
            names, path = entry
            text = (ROOT / path).read_text()
            for name in re.findall(r"\w+_kernel\b", names):
                assert re.search(rf"\b{name}\b", text), f"{name} is not in {path}: update docs/figures/make_figures.py"


def _kernel_line(fn: str) -> str:
    triton, cuda = KERNELS[fn]
    out = f"triton: {triton[0]}"
    return out + (f"   cuda: {cuda[0]}" if cuda else "   (cuda backend: Triton's where Triton runs)")


def _box(ax, x, y, w, h, kind, title, body="", foot="", title_size=10.5, body_size=9.5):
    from matplotlib.patches import FancyBboxPatch

    face, edge = COLORS[kind]
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.4,rounding_size=1.2", fc=face, ec=edge,
                                lw=1.6 if kind == "kernel" else 1.2, ls="--" if kind == "saved" else "-"))
    ax.text(x + 1.0, y + h - 0.8, title, ha="left", va="top", fontsize=title_size, weight="bold", color="#222222")
    if body:
        ax.text(x + 1.0, y + h - 1.4 - 2.1 * (title.count("\n") + 1), body, ha="left", va="top", fontsize=body_size, color="#111111",
                linespacing=1.45)
    if foot:
        ax.text(x + 1.0, y + 0.7, foot, ha="left", va="bottom", fontsize=8, color="#555555", family="monospace")


def _arrow(ax, start, end, label="", color="#555555", ls="-", rad=0.0, label_at=0.5, label_dy=0.0):
    ax.annotate("", xy=end, xytext=start,
                arrowprops={"arrowstyle": "-|>", "color": color, "lw": 1.3, "ls": ls, "mutation_scale": 13,
                            "shrinkA": 0, "shrinkB": 0, "connectionstyle": f"arc3,rad={rad}"})
    if label:
        x = start[0] + (end[0] - start[0]) * label_at
        y = start[1] + (end[1] - start[1]) * label_at + label_dy
        ax.text(x, y, label, ha="center", va="center", fontsize=8.5, color=color,
                bbox={"fc": "white", "ec": "none", "pad": 0.6, "alpha": 0.9})


def _route(ax, pts, label="", color="#555555", label_seg=0, label_at=0.5):
    """An arrow along a polyline: straight segments through pts, the head at the last point."""
    xs, ys = zip(*pts[:-1])
    ax.plot(xs, ys, color=color, lw=1.3, solid_capstyle="butt")
    _arrow(ax, pts[-2], pts[-1], color=color)
    if label:
        (x0, y0), (x1, y1) = pts[label_seg], pts[label_seg + 1]
        ax.text(x0 + (x1 - x0) * label_at, y0 + (y1 - y0) * label_at, label, ha="center", va="center",
                fontsize=8.5, color=color, bbox={"fc": "white", "ec": "none", "pad": 0.6, "alpha": 0.9})


def draw_dataflow(path: Path) -> None:
    from matplotlib.figure import Figure

    check_kernel_names()
    W, H = 140, 104
    fig = Figure(figsize=(W / 10, H / 10))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, W)
    ax.set_ylim(0, H)
    ax.axis("off")

    ax.text(2, H - 2, "One DoRA layer on an fp8 base weight: forward and backward (no dropout)", fontsize=14,
            weight="bold", va="top")
    ax.text(2, H - 6.2, "W0 = σ·W8: e4m3 weight, fp32 scale per tensor, row or 128×128 block.   s = lora_alpha / r.   "
            "Each grey box is one function of the backend contract (dorafp8/backends/base.py),\n"
            "its title lists everything it reads.   Formulas: docs/DORA_MATH.md.   The native (CPU) and reference "
            "backends run the same functions in PyTorch, one block of weight rows (≤ 16 MiB) at a time.\n"
            "In dgrad, σₜ is the per-tensor scale (1 otherwise: per-row scales are in f, block scales are applied "
            "per block of the reduction).",
            fontsize=9, va="top", color="#333333", linespacing=1.5)

    xw, ww = 2, 12           # the fp8 weight, read by three functions
    xl, wl = 17, 18          # other inputs
    xk, wk = 39, 60          # backend functions
    xr, wr = 106, 32         # results
    _box(ax, xw, 2, ww, 82, "frozen", "W8 [N, K]",
         "e4m3, and\nits scale σ\n(fp32)\n\nfrozen\n\nread three\ntimes a\nstep, N·K\nbytes each:\n"
         "weight_norm,\nforward,\ndgrad", body_size=9)

    # ---- forward
    ax.text(xl, 88.5, "FORWARD", fontsize=12, weight="bold", color="#3b78b5", va="center")
    _box(ax, xl, 63, wl, 12, "param", "A [r, K]\nB [N, r]\nm [N]", "", title_size=10)
    ax.text(xl + 1, 64.2, "trainable: lora_A,\nlora_B, magnitude", fontsize=8, color="#333333", va="bottom")
    _box(ax, xl, 47, wl, 10, "act", "x [M, K]", "activations,\ncompute dtype", body_size=9)

    _box(ax, xk, 76.5, wk, 10.5, "kernel", "weight_norm (W8, σ, A, B)",
         "n_j = ‖ σ·W8[j, :] + s·(B A)[j, :] ‖₂     fp32 [N], detached;\n"
         "blocks of rows: W8 read once, no [N, K] tensor in memory",
         _kernel_line("weight_norm"), body_size=9.5)
    _box(ax, xk, 67.5, wk, 5, "torch", "c = m / max(n, 1e-12)    fp32 [N]    (ops/linear.py; a zero row gives 0, not NaN)",
         title_size=9)
    _box(ax, xk, 55, 38, 8.5, "kernel", "project (x, A)", "u = x Aᵀ     [M, r], fp32 accumulation",
         _kernel_line("project"), body_size=9.5)
    _box(ax, xk, 35, wk, 16.5, "kernel", "forward (x, W8, σ, c, u, B, b)",
         "y = c ⊙ (x W0ᵀ + s·u Bᵀ) + b        [M, N], compute dtype\n"
         "z = x W0ᵀ + s·u Bᵀ                  [M, N], kept for ∂m\n"
         "x W0ᵀ: W8 tiles converted to the compute dtype on the fly,\n"
         "fp32 accumulation; scales in fp32 (block scales per block of K)",
         _kernel_line("forward").replace("   cuda", "\ncuda"), body_size=9.5)

    _box(ax, xr, 56, wr, 15, "saved", "saved for the backward",
         "x, u, z, c, n, W8, σ, A, B\n(+ the dropout mask)\nno dequantized weight, no\n[N, K] tensor of any kind",
         body_size=9.5)
    _box(ax, xr, 38, wr, 9, "act", "y [M, N]", "to the next layer", body_size=9.5)

    _arrow(ax, (xw + ww + 0.4, 83), (xk - 0.4, 83), "W8, σ", label_at=0.2)
    _arrow(ax, (xw + ww + 0.4, 40), (xk - 0.4, 40), "W8, σ", label_at=0.2)
    _arrow(ax, (xl + wl + 0.4, 73), (xk - 0.4, 79), "A, B", label_at=0.5)
    _arrow(ax, (xl + wl + 0.4, 69.5), (xk - 0.4, 69.5), "m", label_at=0.5)
    _arrow(ax, (xl + wl + 0.4, 65), (xk - 0.4, 60), "A", label_at=0.5)
    _arrow(ax, (xl + wl + 0.4, 55), (xk - 0.4, 57.5), "x", label_at=0.5)
    _arrow(ax, (xl + wl + 0.4, 49), (xk - 0.4, 46), "x", label_at=0.5)
    _arrow(ax, (xk + 20, 76.5 - 0.4), (xk + 20, 72.5 + 0.4), "n", label_at=0.5)
    _arrow(ax, (xk + 50, 67.5 - 0.4), (xk + 50, 51.5 + 0.4), "c", label_at=0.5)
    _arrow(ax, (xk + 19, 55 - 0.4), (xk + 19, 51.5 + 0.4), "u", label_at=0.5)
    _arrow(ax, (xk + wk + 0.4, 42.5), (xr - 0.4, 42.5), "y", label_at=0.5)
    _arrow(ax, (xk + wk + 0.4, 48), (xr - 0.4, 59), "z", label_at=0.5)
    _arrow(ax, (xk + wk + 0.4, 70), (xr - 0.4, 67), "c, n", label_at=0.5)

    # ---- backward
    ax.plot([xl, W - 2], [32.5, 32.5], color="#bbbbbb", lw=1, ls=":")
    ax.text(xl, 30, "BACKWARD", fontsize=12, weight="bold", color="#8053a8", va="center")
    _box(ax, xl, 19.5, wl, 7, "act", "g = ∂L/∂y", "[M, N]", body_size=9)
    _box(ax, xl, 10, wl, 7.5, "saved", "saved", "z, u, c, B → backward_pass\nA → dgrad,  x → project_grad",
         title_size=10, body_size=8)
    _box(ax, xl, 1, wl, 6.5, "act", "∂x [M, K]", "to the previous layer", body_size=8.5)

    _box(ax, xk, 16.5, wk, 13.5, "kernel", "backward_pass (g, z, c, σ_row, B, u): one read of g and z",
         "gl = g ⊙ f / ρ,   f = c ⊙ σ_row,  ρ = max|f|   (|gl| ≤ |g|: no fp16 overflow)\n"
         "v = (g ⊙ c) B  [M, r]     Σᵢ g ⊙ z  [N]     Σᵢ g  [N]     gᵀu  [N, r]\n"
         "column sums as per-block partials summed in a fixed order: no atomics",
         _kernel_line("backward_pass"), body_size=9)
    _box(ax, xk, 1, 37, 11.5, "kernel", "dgrad (gl, ρ, W8, σ, v, A)",
         "∂x = ρ·σₜ·(gl W8) + s·v A\n     = (g ⊙ c) W0 + s·v A", _kernel_line("dgrad").replace("   cuda", "\ncuda"),
         body_size=9.5)
    _box(ax, xk + 39.5, 1, 20.5, 11.5, "kernel", "project_grad\n(v, x)", "vᵀx   [r, K], fp32",
         "triton:\nproject_grad_kernel", body_size=9.5)

    _box(ax, xr, 1, wr, 29, "param", "gradients (ops/linear.py)",
         "from backward_pass:\n  ∂m = (Σᵢ g ⊙ z) / n\n  ∂B = s · c ⊙ (gᵀu)\n  ∂b = Σᵢ g     (if b trains)\n\n"
         "from project_grad:\n  ∂A = s · vᵀx", body_size=9.5)

    _arrow(ax, (xl + wl + 0.4, 23), (xk - 0.4, 23), "g", label_at=0.5)
    _arrow(ax, (xl + wl + 0.4, 15.5), (xk - 0.4, 19), "", label_at=0.5)
    _arrow(ax, (xw + ww + 0.4, 9.2), (xk - 0.4, 9.2))
    _arrow(ax, (xl + wl + 0.4, 11.5), (xk - 0.4, 7), "", label_at=0.55)
    _arrow(ax, (xk - 0.4, 3.5), (xl + wl + 0.4, 3.5), "∂x", label_at=0.5)
    _arrow(ax, (xk + 18, 16.5 - 0.4), (xk + 18, 12.5 + 0.4), "gl, ρ, v", label_at=0.5)
    _arrow(ax, (xk + 50, 16.5 - 0.4), (xk + 50, 12.5 + 0.4), "v", label_at=0.5)
    _arrow(ax, (xk + wk + 0.4, 24), (xr - 0.4, 24), "Σ, gᵀu", label_at=0.5)
    _arrow(ax, (xk + wk + 0.4, 7), (xr - 0.4, 7), "vᵀx", label_at=0.5)
    save_png(fig, path)


def save_png(fig, path: Path, colors: int = 96) -> None:
    """savefig, then a palette of `colors` colours: flat diagrams lose nothing visible and the file shrinks 3x."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, dpi=DPI, format="png")
    buf.seek(0)
    Image.open(buf).convert("RGB").quantize(colors=colors).save(path, optimize=True)


# ---------------------------------------------------------------------------------------------------- save / load

def save_load_table():
    """(rows, writers, loaders, cells, notes) of the save/load chart. A row is a file format: the PEFT adapter, every
    fp8 layout of dorafp8.checkpoint.LAYOUTS and the dense formats (one row); a cell (row, column) is one of
    "tested" (reloaded by the tests), "source" (from the loader's source, not run here), "refused" (the writer, or
    the loader, refuses with a message that names the fix), with an optional note."""
    from dorafp8.checkpoint.layouts import DENSE_FORMATS, LAYOUTS, TRANSFORMERS_FORMATS

    # what transformers' save_pretrained writes (checkpoint/write.py save_pretrained_state), what vLLM and ComfyUI
    # read (from their sources: docs/CHECKPOINTS.md), checked against the layout names
    hf_save = {"compressed-tensors": "default", "fine-grained": "if loaded from it"}
    vllm = ("compressed-tensors", "fine-grained")
    comfyui = ("comfyui", "comfyui-quant")
    for name in (*hf_save, *vllm, *comfyui):
        assert name in LAYOUTS, f"{name!r} is no longer a layout: update docs/figures/make_figures.py"

    dense = "/".join(DENSE_FORMATS)
    hf_fp8 = [f for f in LAYOUTS if f in TRANSFORMERS_FORMATS]
    other_fp8 = [f for f in LAYOUTS if f not in TRANSFORMERS_FORMATS]
    rows = ["PEFT adapter", dense, *hf_fp8, *other_fp8]
    info = {"PEFT adapter": "adapter_model.safetensors: A, B, m",
            dense: "dense weights: σ·W8, merged where adapters are"}
    for f, lay in LAYOUTS.items():
        scale = f"{lay.scale_key}" if lay.scale_key else "no scale (1)"
        info[f] = f"{scale}, {'/'.join(lay.write_granularities)}"

    writers = ["PEFT\nsave_pretrained", "transformers\nsave_pretrained\n(fp8 model)", "dorafp8.\nsave_fp8_\ncheckpoint",
               "dorafp8.\nexport_merged"]
    loaders = ["dorafp8.\nload_fp8_\ncheckpoint", "transformers\nfrom_pretrained", "transformers\nfrom_pretrained,\nDoRAFP8Config", "vLLM", "diffusers\nfrom_pretrained", "ComfyUI", "PeftModel.\nfrom_pretrained"]
    PEFT_W, HF_W, SAVE, EXPORT = writers
    LOAD, HF, HFQ, VLLM, DIFF, COMFY, PEFT_L = loaders
    cells = {("PEFT adapter", PEFT_W): ("tested", ""), ("PEFT adapter", PEFT_L): ("tested", "fp8 or original base")}
    for f, note in hf_save.items():
        cells[(f, HF_W)] = ("tested", note)
    for f in [dense, *LAYOUTS]:
        is_dense = f == dense
        in_hf_dir = is_dense or f in TRANSFORMERS_FORMATS
        where = "" if in_hf_dir else "file, not a\ntransformers dir"
        if f == "fp8-cast":
            cells[(f, SAVE)] = ("tested", "scale-1 layers")
            cells[(f, EXPORT)] = ("refused", "merged: scale ≠ 1")
        else:
            cells[(f, SAVE)] = ("tested", where)
            cells[(f, EXPORT)] = ("tested", where)
        if is_dense:
            cells[(f, HF)] = ("tested", "")
            cells[(f, HFQ)] = ("tested", "quantizes")
            cells[(f, DIFF)] = ("tested", "")
            continue
        cells[(f, LOAD)] = ("tested", "")
        cells[(f, HF)] = ("tested", "needs compressed-\ntensors pkg" if f == "compressed-tensors" else "") \
            if in_hf_dir else ("refused", "raises")
        cells[(f, DIFF)] = ("refused", "names load_fp8_\ncheckpoint")
        if f in vllm:
            cells[(f, VLLM)] = ("source", "")
        if f in comfyui:
            cells[(f, COMFY)] = ("source", "")
    notes = [
        (f"{', '.join(other_fp8)} from a transformers model go to a .safetensors file: dorafp8 refuses to write "
         "them into a transformers directory, where from_pretrained would load the raw e4m3 values."),
        ("Any fp8 format written into a diffusers directory is marked quant_method \"dorafp8\": diffusers' "
         "from_pretrained then raises and names load_fp8_checkpoint."),
        ("Also refused, naming the fix: transformers' save_pretrained of unmerged PEFT adapters (merge_and_unload() "
         "first, or export_merged), with state_dict=, of fp8 convs, of blocks that do not divide a layer;"),
        ("diffusers' save_pretrained of an fp8 model (always: it names save_fp8_checkpoint and export_merged).   "
         "A model transformers loaded in fp8 gets FP8Linear layers back with dorafp8.from_transformers_fp8(model)."),
    ]
    return rows, info, writers, loaders, cells, notes


def draw_save_load(path: Path) -> None:
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Rectangle

    rows, info, writers, loaders, cells, notes = save_load_table()
    col_w, fmt_w, row_h = 10.8, 31, 5.6
    x_w = [3 + col_w * (i + 0.5) for i in range(len(writers))]
    x_fmt = 3 + col_w * len(writers) + 3
    x_l = [x_fmt + fmt_w + 1 + col_w * (i + 0.5) for i in range(len(loaders))]
    W = x_l[-1] + col_w / 2 + 2
    bottom = 16
    top = bottom + row_h * len(rows)
    H = top + 21
    fig = Figure(figsize=(W / 10, H / 10))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, W)
    ax.set_ylim(0, H)
    ax.axis("off")
    ax.text(2, top + 16.5, "Saving and loading: which writer makes which file, and what reads it", fontsize=14,
            weight="bold", va="bottom")
    ax.text(2, top + 13.5, "Rows: dorafp8.checkpoint.LAYOUTS and DENSE_FORMATS (transformers reads "
            "TRANSFORMERS_FORMATS).   Details: docs/CHECKPOINTS.md.   Tests: tests/checkpoint/test_save_paths.py, "
            "tests/checkpoint/test_checkpoint.py.", fontsize=9, va="bottom", color="#333333")
    for x, text, color in (((x_w[0] + x_w[-1]) / 2, "written by", "#2d6b29"),
                           (x_fmt + fmt_w / 2, "file format", "#222222"),
                           ((x_l[0] + x_l[-1]) / 2, "read by", "#2b5d8f")):
        ax.text(x, top + 9.5, text, ha="center", va="bottom", fontsize=11.5, weight="bold", color=color)
    for x, name in [*zip(x_w, writers), *zip(x_l, loaders)]:
        ax.text(x, top + 1, name, ha="center", va="bottom", fontsize=8.5, linespacing=1.2)
    style = {"tested": {"marker": "o", "ms": 11, "mfc": "#4a9a45", "mec": "#2d6b29"},
             "source": {"marker": "o", "ms": 11, "mfc": "white", "mec": "#4a9a45", "mew": 2},
             "refused": {"marker": "X", "ms": 10, "mfc": "#c94040", "mec": "#c94040"}}
    noted = set()
    for i, row in enumerate(rows):
        y = top - row_h * (i + 0.5)
        if i % 2 == 0:
            ax.add_patch(Rectangle((2, y - row_h / 2), W - 4, row_h, fc="#f3f3f3", ec="none", zorder=0))
        ax.text(x_fmt + 1, y + 0.9, row, fontsize=10.5, weight="bold", va="center")
        ax.text(x_fmt + 1, y - 1.4, info[row], fontsize=8, va="center", color="#555555", family="monospace")
        xs_w = [x for x, c in zip(x_w, writers) if (row, c) in cells]
        xs_l = [x for x, c in zip(x_l, loaders) if (row, c) in cells]
        if xs_w:  # written: into the format
            ax.annotate("", xy=(x_fmt - 0.3, y + 0.5), xytext=(min(xs_w), y + 0.5),
                        arrowprops={"arrowstyle": "-|>", "color": "#9a9a9a", "lw": 1.2, "mutation_scale": 11})
        if xs_l:  # read: a guide line along the row
            ax.plot([x_fmt + fmt_w - 1, max(xs_l)], [y + 0.5, y + 0.5], color="#c8c8c8", lw=1.0, zorder=1)
        for x, col in [*zip(x_w, writers), *zip(x_l, loaders)]:
            cell = cells.get((row, col))
            if cell is None:
                continue
            kind, note = cell
            ax.plot([x], [y + 0.5], ls="none", zorder=3, **style[kind])
            if note and (col, note) not in noted:  # a note once per column, where it first applies
                noted.add((col, note))
                ax.text(x, y - 1.3, note, ha="center", va="top", fontsize=7, color="#333333", linespacing=1.0,
                        zorder=3)
    handles = [Line2D([], [], ls="none", **style["tested"], label="works: reloaded by the tests"),
               Line2D([], [], ls="none", **style["source"], label="works: from the loader's source, not run here"),
               Line2D([], [], ls="none", **style["refused"], label="refused: an error, never a wrong load")]
    ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.5 / W, (bottom - 3.2) / H), ncol=3, fontsize=9.5,
              frameon=False, borderaxespad=0, handletextpad=0.3, columnspacing=2.5)
    ax.text(2, 0.8, "\n".join(notes), fontsize=8.5, color="#333333", va="bottom", linespacing=1.4)
    save_png(fig, path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="directory for the PNGs")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, draw in (("dataflow.png", draw_dataflow), ("save_load.png", draw_save_load)):
        draw(args.out / name)
        print(args.out / name)


if __name__ == "__main__":
    main()
