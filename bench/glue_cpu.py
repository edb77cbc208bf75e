"""CPU time of the Python between the kernels of one DoRA forward + backward on the Triton backend ("the glue").

    python bench/glue_cpu.py [--tokens 256] [--features 4096] [--rank 16] [--dropout 0.1] [--calls 200]
                             [--backend triton|cublas] [--ops] [--layer]

Runs dora_fp8_linear forward + backward under Triton's interpreter on CPU tensors with every Triton kernel launch
replaced by a no-op (the interpreter's InterpretedFunction.run), so what is timed is everything around the kernels:
the checks, the dtype policy, autograd, the custom ops' dispatch, the launchers' choices and allocations, and the
PyTorch ops that run between kernels (each of those would be a kernel launch on a GPU; here it computes on CPU).
What it leaves out: Triton's own launch path on a GPU (its JIT cache lookup and argument packing, some microseconds
per launch), which depends on the Triton version, not on dorafp8. A GPU does the rest of this work on its CPU
thread too, so at small M, where the kernels are short, this time is the floor of a layer's step. It is a
MEASUREMENT of this machine's CPU (print the machine with the figure), not a GPU prediction.

--ops also lists every PyTorch op one step issues outside the launches, views and allocations included
(dorafp8._launches.LaunchRecorder's ops), by origin: each costs some microseconds of enqueue on a GPU host.
Works on any checkout of dorafp8 (it patches Triton, not dorafp8), so a before/after comparison runs the same script.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
import triton.runtime.interpreter as interp  # noqa: E402

import dorafp8  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--features", type=int, default=4096, help="N = K")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--backend", default="triton", help="triton, or cublas (the cuBLAS strategy: its matmuls run)")
    ap.add_argument("--ops", action="store_true", help="list the PyTorch ops of one step (not on old checkouts)")
    ap.add_argument("--layer", action="store_true", help="through PEFT's layer (a DoRAFP8Linear), not the function")
    args = ap.parse_args()
    torch.set_num_threads(1)
    M, N, r = args.tokens, args.features, args.rank
    w8 = torch.zeros(N, N, dtype=torch.float8_e4m3fn)
    scale = torch.ones(())
    A = torch.zeros(r, N, requires_grad=True)  # fp32 adapters, as PEFT creates them
    B = torch.zeros(N, r, requires_grad=True)
    m = torch.ones(N, requires_grad=True)
    n = torch.ones(N)  # a cached norm: no weight-norm kernel
    x = torch.zeros(M, N, dtype=torch.bfloat16, requires_grad=True)
    g = torch.zeros(M, N, dtype=torch.bfloat16)

    def step():
        y = dorafp8.dora_fp8_linear(x, w8, scale, A, B, m, 2.0, dropout_p=args.dropout, training=True,
                                    backend=args.backend, weight_norm=n)
        y.backward(g)
        x.grad = A.grad = B.grad = m.grad = None

    if args.layer:  # the same step through the layer a PEFT model holds (its forward, its cached norm)
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(torch.nn.Sequential(dorafp8.FP8Linear.from_fp8(w8, scale, backend=args.backend)),
                               LoraConfig(r=r, lora_alpha=2 * r, target_modules=["0"], use_dora=True,
                                          lora_dropout=args.dropout))
        params = [p for p in model.parameters() if p.requires_grad]

        def step():
            y = model(x)
            y.backward(g)
            x.grad = None
            for p in params:
                p.grad = None

    interp.InterpretedFunction.run = lambda self, *a, **k: None  # every Triton launch: a no-op
    for _ in range(10):
        step()
    if args.ops:
        from collections import Counter

        from dorafp8._launches import LaunchRecorder

        with LaunchRecorder() as rec:
            step()
        for (op, origin), count in sorted(Counter(rec.ops).items(), key=lambda kv: kv[0][1]):
            print(f"{count:3d}  {op:40s} {origin}")
        print(f"{len(rec.ops)} PyTorch ops per forward + backward outside the launches")
    times = []
    for _ in range(args.calls):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times) * 1e3
    print(f"glue CPU time per forward + backward: median {med:.3f} ms over {args.calls} calls "
          f"({args.backend}{', layer' if args.layer else ''}, "
          f"M={M}, N=K={N}, r={r}, dropout={args.dropout}, bf16 activations, fp32 adapters; torch "
          f"{torch.__version__}, 1 thread)")


if __name__ == "__main__":
    main()
