"""CPU time of one DoRA layer's training step: dorafp8 (fp8 base, the default CPU backend) against PEFT's DoRA (fp32
base), in fp32 and under bf16 autocast.

    python bench/cpu_step.py                     # 4096 x 4096, r 16, 64 tokens, 5 steps each, fp32 and bf16 autocast
    python bench/cpu_step.py --steps 10 --dtypes bf16 --size 2048 --tokens 256
    python bench/cpu_step.py --threads 1         # one thread: the work itself, least disturbed by other processes

One step is what an optimizer step costs the layer inside a model: forward, backward (the input gradient too) and
AdamW's update of the adapters, so that the weight norm is recomputed every step, as in training. Both layers are
built by `get_peft_model` on the same nn.Linear (dorafp8's after `quantize_model`), take the same batch and step in
turn, dorafp8 then PEFT, so that load from other processes hits both alike; the first step of each is a warm-up and
is not counted. It prints the median step of each, wall-clock and CPU time of this process, and their ratio
(dorafp8 / PEFT: below 1 is faster). CPU timings: one machine, one run, not a claim about any other machine.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch


def _layer(base: torch.nn.Module, fp8: bool, rank: int):
    import dorafp8
    from peft import LoraConfig, get_peft_model

    model = copy.deepcopy(base)
    if fp8:
        dorafp8.quantize_model(model, ["proj"], verbose=False)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, use_dora=True, target_modules=["proj"]))
    with torch.no_grad():  # lora_B starts at zero: give the update a value, as after a few steps
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 1e-3)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return model, opt


def _step(model, opt, x, autocast: bool) -> tuple[float, float]:
    """One step: (wall seconds, CPU seconds of this process)."""
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(x).float().square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0, time.process_time() - c0


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=4096, help="in = out features (default 4096)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5, help="timed steps of each (after one warm-up step)")
    ap.add_argument("--dtypes", default="fp32,bf16", help="fp32 and/or bf16 (bf16 autocast over fp32 weights)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    import dorafp8

    torch.manual_seed(0)
    base = torch.nn.Sequential()
    base.add_module("proj", torch.nn.Linear(args.size, args.size, bias=False))
    layers = {"dorafp8": _layer(base, True, args.rank), "peft": _layer(base, False, args.rank)}
    x = torch.randn(args.tokens, args.size, requires_grad=True)  # a layer inside a model: dx is computed too
    print(f"one {args.size} x {args.size} DoRA layer, r {args.rank}, {args.tokens} tokens, forward + backward + AdamW; "
          f"torch {torch.__version__}, threads: {torch.get_num_threads()}, dorafp8 backend on cpu: "
          f"{dorafp8.backends.resolve('auto', torch.device('cpu'))}")
    ratios = {}
    for dtype in args.dtypes.split(","):
        autocast = {"fp32": False, "bf16": True}[dtype]
        times = {name: [] for name in layers}
        for i in range(args.steps + 1):
            for name, (model, opt) in layers.items():
                t = _step(model, opt, x, autocast)
                if i:
                    times[name].append(t)
        wall = {name: 1e3 * statistics.median(t[0] for t in ts) for name, ts in times.items()}
        cpu = {name: 1e3 * statistics.median(t[1] for t in ts) for name, ts in times.items()}
        ratios[dtype] = wall["dorafp8"] / wall["peft"]
        label = "fp32" if dtype == "fp32" else "bf16 autocast"
        print(f"{label:<14} dorafp8 {wall['dorafp8']:6.0f} ms   PEFT {wall['peft']:6.0f} ms   dorafp8 / PEFT "
              f"{ratios[dtype]:.2f}x   (CPU time: {cpu['dorafp8']:.0f} and {cpu['peft']:.0f} ms, "
              f"{cpu['dorafp8'] / cpu['peft']:.2f}x; medians of {args.steps} steps)", flush=True)
    return ratios


if __name__ == "__main__":
    main()
