"""CPU training-step time and memory of a diffusers UNet with DoRA: PEFT on the original fp32 base vs dorafp8 on the fp8
base (every Linear and Conv2d), bf16 autocast, AdamW, DoRA on attention + feed-forward + conv1/conv2.

    python bench/diffusion_cpu.py                       # the tests' small UNet (1.1 M parameters)
    python bench/diffusion_cpu.py --size medium         # block_out_channels (64, 128), 32 x 32 latents, batch 4
    python bench/diffusion_cpu.py --size large          # block_out_channels (160, 320): SD 1.x's first two halved
    python bench/diffusion_cpu.py --backend reference   # dorafp8's exact fp32 twin instead of auto (native on CPU)

The two models step in turn (interleaved), so that load from other processes hits both alike; the median of
--steps steps is reported, both wall-clock and CPU time of this process (time.process_time: the work done, which
other processes on a shared machine do not inflate; with one thread it is the better figure there).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch

SIZES = {
    "small": dict(block_out_channels=(32, 64), sample_size=16, batch=2),
    "medium": dict(block_out_channels=(64, 128), sample_size=32, batch=4),
    "large": dict(block_out_channels=(160, 320), sample_size=32, batch=2),
}
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2", "conv1", "conv2"]


def build(size):
    import diffusers

    cfg = SIZES[size]
    torch.manual_seed(0)
    return diffusers.UNet2DConditionModel(
        sample_size=cfg["sample_size"], in_channels=4, out_channels=4, block_out_channels=cfg["block_out_channels"],
        layers_per_block=2, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32, attention_head_dim=8,
        norm_num_groups=32).float()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--memory", action="store_true", help="also measure the step's peak of temporaries (slow)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    import dorafp8
    from dorafp8 import backends
    from dorafp8._memory import MiB, peak_extra_bytes, tensor_bytes
    from peft import LoraConfig, get_peft_model

    cfg = SIZES[args.size]
    base = build(args.size)
    models = {}
    for name in ("peft", "dorafp8"):
        m = copy.deepcopy(base)
        if name == "dorafp8":
            try:
                dorafp8.quantize_model(m, include_conv=True, backend=args.backend)
            except TypeError:  # a dorafp8 without fp8 convs (before the fp8 conv layers): its Linear layers, PEFT on the convs
                dorafp8.quantize_model(m, backend=args.backend)
                print("this dorafp8 has no fp8 convs: Linear layers in fp8, PEFT's DoRA on the fp32 convs")
        m = get_peft_model(m, LoraConfig(r=args.rank, lora_alpha=args.rank, use_dora=True, target_modules=TARGETS))
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
        models[name] = (m, opt)
    g = torch.Generator().manual_seed(1)
    B, S = cfg["batch"], cfg["sample_size"]
    x = torch.randn(B, 4, S, S, generator=g)
    t = torch.randint(0, 1000, (B,), generator=g)
    enc = torch.randn(B, 8, 32, generator=g)
    target = torch.randn(B, 4, S, S, generator=g)

    def loss_of(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(x, t, enc).sample
        return (out.float() - target).square().mean()

    def step(name):
        m, opt = models[name]
        w0, c0 = time.perf_counter(), time.process_time()
        loss_of(m).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - w0, time.process_time() - c0

    for name in models:  # warm-up
        step(name)
        step(name)
    wall = {k: [] for k in models}
    cpu = {k: [] for k in models}
    for _ in range(args.steps):
        for name in models:
            w, c = step(name)
            wall[name].append(w)
            cpu[name].append(c)
    params = sum(p.numel() for p in base.parameters())
    print(f"UNet2DConditionModel '{args.size}' ({params / 1e6:.2f} M parameters), batch {B} x 4 x {S} x {S}, "
          f"DoRA r={args.rank} on {', '.join(TARGETS)}; bf16 autocast, AdamW; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; dorafp8 backend: {backends.resolve(args.backend, torch.device('cpu'))}")
    print(f"{'':24s}{'wall ms/step':>14s}{'CPU ms/step':>14s}")
    for name in models:
        print(f"{name:24s}{1e3 * statistics.median(wall[name]):14.1f}{1e3 * statistics.median(cpu[name]):14.1f}")
    r_wall = statistics.median(wall["dorafp8"]) / statistics.median(wall["peft"])
    r_cpu = statistics.median(cpu["dorafp8"]) / statistics.median(cpu["peft"])
    print(f"dorafp8 / PEFT: {r_wall:.2f} (wall), {r_cpu:.2f} (CPU time)")
    wb = {k: tensor_bytes(m) for k, (m, _) in models.items()}
    print(f"weights (parameters + buffers): PEFT {wb['peft'] / MiB:.2f} MiB, dorafp8 {wb['dorafp8'] / MiB:.2f} MiB")
    if args.memory:
        peak = {}
        for name, (m, _) in models.items():
            m.zero_grad(set_to_none=True)
            peak[name] = peak_extra_bytes(lambda m=m: loss_of(m).backward(), "cpu")
        print(f"peak of temporaries in a forward + backward: PEFT {peak['peft'] / MiB:.2f} MiB, "
              f"dorafp8 {peak['dorafp8'] / MiB:.2f} MiB")


if __name__ == "__main__":
    main()
