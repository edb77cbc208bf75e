"""python -m dorafp8.demo: PEFT's DoRA vs dorafp8 side by side, with what a user decides on (CPU: about a minute).

Trains a tiny LLaMA (no download) four ways (PEFT's DoRA on the original and on the dequantized fp8 base, dorafp8 on
the fp8 weights, and with fp8 activations too) and prints the loss curves beside fp32 rounding's yardstick; measures
the base weights' bytes and a step's peak memory, for the model and one 4096 x 4096 layer; on a GPU, the step's speed
(on CPU no speed claim). With matplotlib it draws the curves and the memory: --plot PATH (default dorafp8_demo.png,
and PATH with `_memory`); --no-plot to skip."""

from __future__ import annotations

import argparse
import copy
import time
import warnings
from pathlib import Path

import torch

from ._deps import missing, require
from ._memory import MiB, peak_extra_bytes, tensor_bytes

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ORIGINAL, TWIN, OURS, W8A8 = ("PEFT, original base", "PEFT, dequantized fp8 base", "dorafp8, fp8 base",
                              "dorafp8 W8A8")
DEFAULT_PLOT = "dorafp8_demo.png"


def _models(args, transformers, peft, dorafp8):
    """(PEFT on the original base, PEFT on the dequantized fp8 base, dorafp8 on the fp8 base), equal adapters."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                                   num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                                   max_position_embeddings=128)
    lcfg = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, use_dora=True, target_modules=TARGETS)
    original = peft.get_peft_model(transformers.LlamaForCausalLM(cfg).float(), lcfg).to(args.device)
    ours = copy.deepcopy(original)
    n = dorafp8.convert_peft_model(ours, backend=args.backend)
    twin = copy.deepcopy(original)
    fp8 = {name: mod for name, mod in ours.named_modules() if isinstance(mod, dorafp8.FP8Linear)}
    for name, mod in twin.named_modules():
        if name in fp8:
            mod.weight.data = fp8[name].dequantize(mod.weight.dtype)
    w8a8 = copy.deepcopy(ours)
    dorafp8.set_act_quant(w8a8, "rowwise")
    return cfg, n, {ORIGINAL: original, TWIN: twin, OURS: ours, W8A8: w8a8}


def _nudged(model, seed=2):
    """A copy of `model` whose frozen base weights each moved by one fp32 ulp at random (about the rounding of
    dequantizing them): trained like the others, it shows how far fp32 rounding alone moves the loss curve."""
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in out.named_parameters():
            if "base_layer" in name and not p.requires_grad and p.is_floating_point():
                up = (torch.rand(p.shape, generator=g) < 0.5).to(p.device)
                p.copy_(torch.nextafter(p, torch.where(up, float("inf"), float("-inf")).to(p.dtype)))
    return out


def _train(model, batches, device, measure=True):
    """(losses, median step time, peak memory of step 1 if measure else 0)."""
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    def step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    losses, times, peak = [], [], 0
    for i, ids in enumerate(batches):
        if i == 1 and measure:  # the first step creates the optimizer state: measure a steady-state step
            out = []
            peak = peak_extra_bytes(lambda out=out, ids=ids: out.append(step(ids)), device)
            losses.append(out[0])
            continue
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        losses.append(step(ids))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return losses, (sorted(times)[len(times) // 2] if times else float("nan")), peak


def _one_layer_peaks(device, backend, peft, dorafp8, tokens=8, size=4096):
    """Peak memory of one training step of a single size x size DoRA layer: PEFT on the fp32 base vs dorafp8."""
    torch.manual_seed(0)
    lcfg = peft.LoraConfig(r=16, lora_alpha=32, use_dora=True, target_modules=["0"])
    pm = peft.get_peft_model(torch.nn.Sequential(torch.nn.Linear(size, size, bias=False)), lcfg).to(device)
    ours = copy.deepcopy(pm)
    dorafp8.convert_peft_model(ours, backend=backend)
    x = torch.randn(tokens, size, device=device)
    peaks = {}
    for name, model in (("peft", pm), ("dorafp8", ours)):
        def step(model=model):
            model(x).square().mean().backward()
        step()  # warm-up: the gradients' storage is allocated once, not per step
        peaks[name] = peak_extra_bytes(step, device)
    base = {"peft": tensor_bytes(pm, lambda n, t: "base_layer" in n),
            "dorafp8": tensor_bytes(ours, lambda n, t: "base_layer" in n)}
    return peaks, base


def _progress(what: str, run):
    """run(), with a line saying what runs (printed before it starts) and how long it took."""
    print(f"  {what:<40}", end="", flush=True)
    t0 = time.perf_counter()
    out = run()
    print(f" {time.perf_counter() - t0:5.1f} s", flush=True)
    return out


def _max_rel(a, b) -> float:
    """max over the steps of |a - b| / |b|."""
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _weight_error(original, twin) -> tuple[float, float]:
    """(min, max) over the DoRA layers of ||W - dequant(quant(W))||_F / ||W||_F: what e4m3 did to the base weights."""
    dq = dict(twin.named_parameters())
    errs = [((w.detach() - dq[n].detach()).norm() / w.detach().norm()).item()
            for n, w in original.named_parameters() if "base_layer.weight" in n]
    return min(errs), max(errs)


# ---------------------------------------------------------------------------------------------------- pictures

_FLOOR = 1e-9  # where a difference of exactly 0 is drawn on the log axis (below fp32's 6e-8 relative rounding)
_COLORS = {ORIGINAL: "tab:gray", TWIN: "tab:blue", OURS: "tab:orange", W8A8: "tab:red"}
_STYLES = {ORIGINAL: {"ls": "-", "marker": "s", "ms": 4},
           TWIN: {"ls": "-", "marker": "o", "ms": 7, "mfc": "none", "lw": 2.5},  # drawn under dorafp8's: it overlaps
           OURS: {"ls": "--", "marker": "x", "ms": 6, "lw": 1.5}, W8A8: {"ls": ":", "marker": "^", "ms": 4}}


def plot_paths(path) -> tuple[Path, Path]:
    """The loss picture at `path` (.png added if it has none) and the memory one, `_memory` before the suffix."""
    path = Path(path)
    if not path.suffix:
        path = path.with_name(path.name + ".png")
    return path, path.with_name(f"{path.stem}_memory{path.suffix}")


def _plot_losses(path, title, losses, control):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 6.4), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    steps = range(len(losses[TWIN]))
    for name, curve in losses.items():
        top.plot(steps, curve, color=_COLORS[name], label=name, **_STYLES[name])
    top.set_ylabel("training loss")
    top.set_title(title, fontsize=10)
    top.legend(fontsize=9, title="same batches, same initial adapters", title_fontsize=9)
    top.grid(alpha=0.3)

    def rel(a, b):
        return [max(abs(x - y) / abs(y), _FLOOR) for x, y in zip(a, b)]

    for label, a, b, color, style in (
            ("dorafp8 vs PEFT, same (dequantized fp8) weights", losses[OURS], losses[TWIN], "tab:orange", "-o"),
            ("PEFT vs PEFT with its base moved by 1 fp32 ulp", control, losses[TWIN], "black", ":."),
            ("dorafp8 vs PEFT on the original weights (fp8 base)", losses[OURS], losses[ORIGINAL], "tab:gray", "-s"),
            ("W8A8 vs W8A16 (activations in e4m3 too)", losses[W8A8], losses[OURS], "tab:red", "-^")):
        bottom.semilogy(steps, rel(a, b), style, color=color, label=label, ms=4)
    bottom.set_ylim(_FLOOR / 3, 1)
    bottom.set_xlabel("AdamW step")
    bottom.set_ylabel("|loss difference| / loss")
    bottom.legend(fontsize=8, loc="upper left", ncol=2)
    bottom.grid(alpha=0.3, which="major")
    bottom.text(0.995, 0.03, f"exactly 0 drawn at {_FLOOR:.0e}", transform=bottom.transAxes, ha="right",
                fontsize=7, color="0.35")
    fig.savefig(path, dpi=110)


def _plot_memory(path, title, groups):
    """groups: [(panel title, [(bar group label, PEFT MiB, dorafp8 MiB), ...]), ...] - the printed numbers."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.2 * len(groups) + 0.6, 4.4), layout="constrained")
    axes = fig.subplots(1, len(groups), squeeze=False)[0]
    width = 0.38
    for ax, (panel, rows) in zip(axes, groups):
        top = max(max(p, o) for _, p, o in rows)
        for i, (label, peft_mib, ours_mib) in enumerate(rows):
            for dx, value, color, name in ((-width / 2, peft_mib, "tab:blue", "PEFT's DoRA, original fp32 base"),
                                           (width / 2, ours_mib, "tab:orange", "dorafp8, fp8 base")):
                ax.bar(i + dx, value, width, color=color, label=name if i == 0 else None)
                ax.text(i + dx, value + top * 0.01, f"{value:.1f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(rows)), [label for label, _, _ in rows], fontsize=9)
        ax.set_ylim(0, top * 1.15)
        ax.set_ylabel("MiB (measured)")
        ax.set_title(panel, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)


def _pictures(path, losses, control, memory, title, mem_title) -> None:
    if missing("matplotlib"):
        print("\nno pictures: matplotlib is not installed (pip install matplotlib)")
        return
    loss_path, mem_path = plot_paths(path)
    loss_path.parent.mkdir(parents=True, exist_ok=True)
    _plot_losses(loss_path, title, losses, control)
    _plot_memory(mem_path, mem_title, memory)
    print(f"\npictures: {loss_path} (loss curves and their differences), {mem_path} (measured memory)")


# ---------------------------------------------------------------------------------------------------- main

def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8, help="AdamW steps of each training (at least 3; default 8)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--no-layer", action="store_true", help="skip the 4096 x 4096 single-layer memory measurement")
    ap.add_argument("--plot", default=DEFAULT_PLOT, metavar="PATH",
                    help=f"write the loss curves to PATH and the measured memory next to it, PATH with _memory "
                         f"before the extension (needs matplotlib; default {DEFAULT_PLOT}; '' = none)")
    ap.add_argument("--no-plot", action="store_true", help="write no pictures")
    args = ap.parse_args(argv)
    if args.steps < 3:  # step 1 measures the memory, the others the time; raised silently to 3, it ran what no one asked
        ap.error(f"--steps must be at least 3 (step 1 measures the memory, the others the time per step), "
                 f"got {args.steps}")
    device = torch.device(args.device)

    require("transformers", "peft", what="the demo (python -m dorafp8.demo)")
    import peft
    import transformers

    import dorafp8
    from dorafp8 import backends
    from dorafp8.__main__ import report

    print(report())
    backend = backends.resolve(args.backend, device)
    with warnings.catch_warnings():
        # PEFT 0.21 calls a transformers method that transformers 5 deprecates: not the user's to act on.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        cfg, n, models = _models(args, transformers, peft, dorafp8)
    control = _nudged(models[TWIN])
    what_model = (f"LLaMA-style, hidden {args.hidden}, {args.layers} layers, built from a config; DoRA r=16 on "
                  f"{', '.join(TARGETS)} ({n} layers); device {device}; dorafp8 backend: {backend}")
    print(f"\nmodel: {what_model}")

    g = torch.Generator().manual_seed(1)
    # Two synthetic batches, revisited, so that the adapters have something to learn and the curves go down.
    data = [torch.randint(0, cfg.vocab_size, (4, 64), generator=g).to(device) for _ in range(2)]
    batches = [data[i % 2] for i in range(args.steps)]
    print(f"\nrunning: {len(models) + 1} trainings of {args.steps} AdamW steps on the same batches (the yardstick "
          f"last), then the memory of one large layer", flush=True)
    results = {name: _progress(name, lambda m=model: _train(m, batches, device)) for name, model in models.items()}
    losses = {name: r[0] for name, r in results.items()}
    nudged = _progress("yardstick: PEFT, base moved 1 ulp", lambda: _train(control, batches, device, measure=False))[0]
    layer = None
    if not args.no_layer:
        peaks, base = _progress("memory of one 4096 x 4096 layer's step",
                                lambda: _one_layer_peaks(device, args.backend, peft, dorafp8))
        layer = {"base": (base["peft"] / MiB, base["dorafp8"] / MiB), "peak": (peaks["peft"] / MiB,
                                                                                peaks["dorafp8"] / MiB)}

    names = list(results)
    print(f"\n1. Loss, {args.steps} AdamW steps (lr 1e-2) on the same batches\n" + f"{'step':>4}  "
          + "  ".join(f"{k:>26}" for k in names))
    for i in range(args.steps):
        print(f"{i:>4}  " + "  ".join(f"{losses[k][i]:>26.5f}" for k in names))
    twin, ours = losses[TWIN], losses[OURS]
    print(f"dorafp8 vs PEFT on the same (dequantized fp8) weights: max relative loss difference "
          f"{_max_rel(ours, twin):.1e} over the {args.steps} steps ({abs(ours[0] - twin[0]) / abs(twin[0]):.1e} "
          f"at step 0, before any update)")
    print(f"   expected: fp32 rounding, not a difference in the math (that would show at step 0). Both evaluate the "
          f"same formulas in fp32, rounding differently (about 1e-7 relative per result); each AdamW step carries "
          f"such differences into the adapters, and they grow over the steps by an amount that depends on the "
          f"machine's kernels. The yardstick, measured here on the same batches: PEFT against itself with its base "
          f"weights moved by one fp32 ulp differs by {_max_rel(nudged, twin):.1e}.")
    lo, hi = _weight_error(models[ORIGINAL], models[TWIN])
    print(f"what fp8 changes: e4m3 moved each base weight by {100 * lo:.2f}-{100 * hi:.2f}% (relative Frobenius "
          f"error, one scale per tensor); max relative loss difference: dorafp8 vs PEFT on the original weights "
          f"{_max_rel(ours, losses[ORIGINAL]):.1e} (the fp8 rounding of the base); W8A8 vs W8A16 "
          f"{_max_rel(losses[W8A8], ours):.1e} (activations rounded to e4m3 as well)")

    how = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "allocations tracked op by op"
    fp8_layers = lambda name, t: "base_layer" in name
    mib = {"base": (tensor_bytes(models[ORIGINAL], fp8_layers) / MiB, tensor_bytes(models[OURS], fp8_layers) / MiB),
           "peak": (results[ORIGINAL][2] / MiB, results[OURS][2] / MiB)}
    print(f"\n2. Memory, measured ({how})")
    print(f"{'':<52}{ORIGINAL:>22}{OURS:>20}")
    print(f"{'base weights of the DoRA layers':<52}{mib['base'][0]:>18.2f} MiB{mib['base'][1]:>16.2f} MiB")
    print(f"{'peak allocated by a training step (this model)':<52}{mib['peak'][0]:>18.2f} MiB"
          f"{mib['peak'][1]:>16.2f} MiB")
    memory = [(f"this model ({n} DoRA layers, hidden {args.hidden})",
               [("base weights\nof the DoRA layers", *mib["base"]), ("peak allocated by\na training step", *mib["peak"])])]
    if layer is not None:
        print(f"{'one 4096 x 4096 layer: base weight':<52}{layer['base'][0]:>18.2f} MiB{layer['base'][1]:>16.2f} MiB")
        print(f"{'one 4096 x 4096 layer: peak of a step, 8 tokens':<52}{layer['peak'][0]:>18.2f} MiB"
              f"{layer['peak'][1]:>16.2f} MiB")
        print("   (PEFT's DoRA forms B @ A and W + s * B @ A as dense [out, in] tensors every call; dorafp8 never does)")
        memory.append(("one 4096 x 4096 DoRA layer, r=16, 8 tokens",
                       [("base weight", *layer["base"]), ("peak allocated by\na training step", *layer["peak"])]))

    t_peft, t_ours = results[ORIGINAL][1], results[OURS][1]
    print("\n3. Time per step (median)")
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
        print(f"PEFT {1e3 * t_peft:.1f} ms, dorafp8 {1e3 * t_ours:.1f} ms: dorafp8 is {t_peft / t_ours:.2f}x PEFT's "
              f"speed on {where} (a small model: see bench/ for the kernels at scale)")
    else:
        where = "CPU"
        what = {"native": "plain PyTorch: the platform's matmul in the compute dtype, one block of weight rows at a "
                          "time",
                "reference": "plain PyTorch, fp32, in row blocks; the correctness twin of the GPU kernels"}
        print(f"PEFT {1e3 * t_peft:.0f} ms, dorafp8 {1e3 * t_ours:.0f} ms on CPU. These CPU timings are NOT speed "
              f"claims: on CPU dorafp8 runs its '{backend}' backend ({what.get(backend, 'see dorafp8/backends/__init__.py')}), "
              f"on a toy model. Speed is measured on a GPU with bench/.")

    if args.plot and not args.no_plot:
        _pictures(args.plot, losses, nudged, memory,
                  title=f"python -m dorafp8.demo: {args.steps} AdamW steps, LLaMA-style hidden {args.hidden}, "
                        f"{args.layers} layers, DoRA r=16\n{where}, dorafp8 backend '{backend}', fp32",
                  mem_title=f"Memory measured by python -m dorafp8.demo on {where} ({how})\npeak: the most a "
                            f"training step allocates on top of the model (activations, gradients, temporaries)")


if __name__ == "__main__":
    main()
