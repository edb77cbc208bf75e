"""python -m dorafp8.demo: PEFT's DoRA vs dorafp8 side by side, with what a user decides on (CPU: about a minute).

1. Trains a LLaMA-style model built from a config (no download) for a few AdamW steps on the same synthetic batches,
   four ways: PEFT's DoRA on the original-precision base, PEFT's DoRA on the fp8 base dequantized to full precision
   (the exact twin of dorafp8's math), dorafp8 on the fp8 weights themselves, and dorafp8 with the activations in fp8
   too (W8A8, act_quant="rowwise"). Prints the loss curves.
2. Measures memory: the bytes the base weights of the DoRA layers occupy, and the peak memory a training step
   allocates on top of the model, for the model and for one 4096 x 4096 layer (a 7B-class projection).
   On CPU the allocations are tracked op by op (dorafp8._memory); on a GPU by torch.cuda.max_memory_allocated.
3. Timing: on a GPU, the speed ratio of the step; on CPU no speed claim (see the note it prints).
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings

import torch

from ._deps import require
from ._memory import MiB, peak_extra_bytes, tensor_bytes

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


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
    return cfg, n, {"PEFT, original base": original, "PEFT, dequantized fp8 base": twin, "dorafp8, fp8 base": ours,
                    "dorafp8 W8A8": w8a8}


def _train(model, batches, device):
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
        if i == 1:  # the first step creates the optimizer state: measure a steady-state step
            out = []
            peak = peak_extra_bytes(lambda: out.append(step(ids)), device)
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
        def step():
            model(x).square().mean().backward()
        step()  # warm-up: the gradients' storage is allocated once, not per step
        peaks[name] = peak_extra_bytes(step, device)
    base = {"peft": tensor_bytes(pm, lambda n, t: "base_layer" in n),
            "dorafp8": tensor_bytes(ours, lambda n, t: "base_layer" in n)}
    return peaks, base


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--no-layer", action="store_true", help="skip the 4096 x 4096 single-layer memory measurement")
    args = ap.parse_args(argv)
    args.steps = max(args.steps, 3)
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
    print(f"\nmodel: LLaMA-style, hidden {args.hidden}, {args.layers} layers, built from a config; DoRA r=16 on "
          f"{', '.join(TARGETS)} ({n} layers); device {device}; dorafp8 backend: {backend}")

    g = torch.Generator().manual_seed(1)
    # Two synthetic batches, revisited, so that the adapters have something to learn and the curves go down.
    data = [torch.randint(0, cfg.vocab_size, (4, 64), generator=g).to(device) for _ in range(2)]
    batches = [data[i % 2] for i in range(args.steps)]
    results = {name: _train(model, batches, device) for name, model in models.items()}

    names = list(results)
    print(f"\n1. Loss, {args.steps} AdamW steps on the same batches\n" + f"{'step':>4}  "
          + "  ".join(f"{k:>26}" for k in names))
    for i in range(args.steps):
        print(f"{i:>4}  " + "  ".join(f"{results[k][0][i]:>26.5f}" for k in names))
    twin, ours = results["PEFT, dequantized fp8 base"][0], results["dorafp8, fp8 base"][0]
    orig = results["PEFT, original base"][0]
    w8a8 = results["dorafp8 W8A8"][0]
    print(f"max |loss difference|: dorafp8 vs PEFT on the same (dequantized fp8) weights "
          f"{max(abs(a - b) for a, b in zip(ours, twin)):.1e} (the same math); dorafp8 vs PEFT on the original "
          f"weights {max(abs(a - b) for a, b in zip(ours, orig)):.1e} (the fp8 rounding of the base); W8A8 vs "
          f"W8A16 {max(abs(a - b) for a, b in zip(w8a8, ours)):.1e} (activations rounded to e4m3 as well)")

    how = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "allocations tracked op by op"
    fp8_layers = lambda name, t: "base_layer" in name  # noqa: E731
    print(f"\n2. Memory, measured ({how})")
    print(f"{'':<52}{'PEFT, original base':>22}{'dorafp8, fp8 base':>20}")
    print(f"{'base weights of the DoRA layers':<52}"
          f"{tensor_bytes(models['PEFT, original base'], fp8_layers) / MiB:>18.2f} MiB"
          f"{tensor_bytes(models['dorafp8, fp8 base'], fp8_layers) / MiB:>16.2f} MiB")
    print(f"{'peak allocated by a training step (this model)':<52}"
          f"{results['PEFT, original base'][2] / MiB:>18.2f} MiB{results['dorafp8, fp8 base'][2] / MiB:>16.2f} MiB")
    if not args.no_layer:
        peaks, base = _one_layer_peaks(device, args.backend, peft, dorafp8)
        print(f"{'one 4096 x 4096 layer: base weight':<52}{base['peft'] / MiB:>18.2f} MiB"
              f"{base['dorafp8'] / MiB:>16.2f} MiB")
        print(f"{'one 4096 x 4096 layer: peak of a step, 8 tokens':<52}{peaks['peft'] / MiB:>18.2f} MiB"
              f"{peaks['dorafp8'] / MiB:>16.2f} MiB")
        print("   (PEFT's DoRA forms B @ A and W + s * B @ A as dense [out, in] tensors every call; dorafp8 never does)")

    t_peft, t_ours = results["PEFT, original base"][1], results["dorafp8, fp8 base"][1]
    print("\n3. Time per step (median)")
    if device.type == "cuda":
        print(f"PEFT {1e3 * t_peft:.1f} ms, dorafp8 {1e3 * t_ours:.1f} ms: dorafp8 is {t_peft / t_ours:.2f}x PEFT's "
              f"speed on {torch.cuda.get_device_name(device)} (a small model: see bench/ for the kernels at scale)")
    else:
        what = {"native": "plain PyTorch: the platform's matmul in the compute dtype, one block of weight rows at a "
                          "time",
                "reference": "plain PyTorch, fp32, in row blocks; the correctness twin of the GPU kernels"}
        print(f"PEFT {1e3 * t_peft:.0f} ms, dorafp8 {1e3 * t_ours:.0f} ms on CPU. These CPU timings are NOT speed "
              f"claims: on CPU dorafp8 runs its '{backend}' backend ({what.get(backend, 'see dorafp8/backends/__init__.py')}), "
              f"on a toy model. Speed is measured on a GPU with bench/.")


if __name__ == "__main__":
    main()
