"""The launches of one DoRA forward + backward on the Triton backend and the bytes they move (a MODEL), at any shape.

    python bench/launch_plan.py [--tokens 8192] [--in-features 4096] [--out-features 4096] [--rank 16]
                                [--dropout 0.1] [--scale tensor|row|block] [--act-quant rowwise] [--sms 132]

A dry run (dorafp8._launches): the launchers plan for a GPU with --sms SMs holding --blocks blocks of a kernel, the
Triton kernels are recorded but not run (so any shape runs on a CPU in seconds), the PyTorch ops between them run on
CPU. Each launch's bytes are those of the distinct tensors it is handed, each counted once: a model of HBM traffic
that assumes perfect reuse inside a launch, not a measurement. The last line compares with a bf16 nn.Linear forward +
input gradient through the same model (x, W, y; g, W, dx). docs/ARCHITECTURE.md ("The kernel plan") shows its output
at the headline shape. bf16 activations, fp32 adapters (as PEFT makes them), the norm cached, every gradient wanted.
"""

from __future__ import annotations

import argparse
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the launchers' CPU path (nothing is run)

import torch  # noqa: E402

import dorafp8  # noqa: E402
from dorafp8._launches import LaunchRecorder, MiB, dry_run  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--in-features", type=int, default=4096)
    ap.add_argument("--out-features", type=int, default=4096)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--scale", choices=["tensor", "row", "block"], default="tensor")
    ap.add_argument("--act-quant", choices=["rowwise"], default=None)
    ap.add_argument("--sms", type=int, default=132, help="SMs of the GPU planned for (H100 SXM: 132)")
    ap.add_argument("--blocks", type=int, default=2, help="resident blocks per SM of the backward pass")
    args = ap.parse_args()
    M, K, N, r = args.tokens, args.in_features, args.out_features, args.rank
    w8 = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    scale = {"tensor": torch.ones(()), "row": torch.ones(N), "block": torch.ones(-(-N // 128), -(-K // 128))}
    x = torch.empty(M, K, dtype=torch.bfloat16, requires_grad=True)
    A, B = torch.empty(r, K, requires_grad=True), torch.empty(N, r, requires_grad=True)
    n = torch.ones(N)
    m = n.clone().requires_grad_()
    gy = torch.empty(M, N, dtype=torch.bfloat16)
    with LaunchRecorder() as rec, dry_run(rec, args.sms, args.blocks):
        y = dorafp8.dora_fp8_linear(x, w8, scale[args.scale], A, B, m, 2.0, dropout_p=args.dropout, training=True,
                                    backend="triton", weight_norm=n, act_quant=args.act_quant)
        y.backward(gy)
    print(rec.table())
    linear = 2 * 2 * (M * K + N * K + M * N)
    print(f"     host syncs: {len(rec.syncs)}; a bf16 nn.Linear forward + input gradient: {linear / MiB:.1f} MiB "
          f"(this is {rec.nbytes / linear:.2f}x)")


if __name__ == "__main__":
    main()
