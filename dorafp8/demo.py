"""python -m dorafp8.demo: PEFT DoRA vs dorafp8 side by side on a small LLaMA-style model (CPU, under a minute).

Builds a LLaMA-style model from a config (no download), adds PEFT DoRA, makes a dorafp8 copy (fp8 base), and trains
both for a few steps on the same synthetic batches: PEFT on the fp8-dequantized base (what PEFT needs today) and
dorafp8 on the fp8 weights themselves. Prints both loss curves, the base-weight memory and the backend used.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default="auto")
    args = ap.parse_args(argv)

    import transformers
    from peft import LoraConfig, get_peft_model

    import dorafp8
    from dorafp8 import FP8Linear, backends

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                                   num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                                   max_position_embeddings=128)
    base = transformers.LlamaForCausalLM(cfg).float()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lcfg = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, use_dora=True, target_modules=targets)
    peft_model = get_peft_model(base, lcfg).to(args.device)
    ours = copy.deepcopy(peft_model)
    n = dorafp8.convert_peft_model(ours, backend=args.backend)
    # PEFT's twin trains on the same fp8 weights, dequantized to full precision (PEFT cannot use fp8 directly).
    for (_, mp), (_, mo) in zip(peft_model.named_modules(), ours.named_modules()):
        if isinstance(mo, FP8Linear):
            mp.weight.data = mo.dequantize(mp.weight.dtype)

    orig_bytes = sum(m.weight.numel() * 4 for m in ours.modules() if isinstance(m, FP8Linear))
    fp8_bytes = sum(m.weight.numel() + m.scale.numel() * 4 for m in ours.modules() if isinstance(m, FP8Linear))
    backend = backends.resolve(args.backend, torch.device(args.device))
    print(f"model: LLaMA-style, hidden {args.hidden}, {args.layers} layers; {n} DoRA layers converted to fp8")
    print(f"device: {args.device}; dorafp8 backend: {backend}")
    print(f"base weights of the DoRA layers: fp32 {orig_bytes / 2**20:.2f} MiB, bf16 {orig_bytes / 2**21:.2f} MiB, "
          f"fp8 {fp8_bytes / 2**20:.2f} MiB")

    g = torch.Generator().manual_seed(1)
    # Two synthetic batches, revisited, so the adapters have something to learn and the curves go down.
    data = [torch.randint(0, cfg.vocab_size, (4, 64), generator=g).to(args.device) for _ in range(2)]
    batches = [data[i % 2] for i in range(args.steps)]
    curves = {}
    for name, model in (("peft (dequantized base)", peft_model), ("dorafp8 (fp8 base)", ours)):
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses, t0 = [], time.perf_counter()
        for ids in batches:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        curves[name] = (losses, time.perf_counter() - t0)

    print(f"\n{'step':>4}  " + "  ".join(f"{k:>24}" for k in curves))
    for i in range(args.steps):
        print(f"{i:>4}  " + "  ".join(f"{v[0][i]:>24.5f}" for v in curves.values()))
    print("time  " + "  ".join(f"{v[1]:>23.2f}s" for v in curves.values()))
    a, b = (v[0] for v in curves.values())
    print(f"\nmax |loss difference| over {args.steps} steps: {max(abs(x - y) for x, y in zip(a, b)):.2e}")


if __name__ == "__main__":
    main()
