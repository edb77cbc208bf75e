"""What recomputing the DoRA weight norm costs next to the layer's GEMMs, and what proving a cached one current costs.

    python bench/norm_cost.py                       # N = K = 4096, r = 16, M = 8192 and 256, fp32 adapters
    python bench/norm_cost.py --n 4096 --k 14336 --r 64 --tokens 2048 --time-cpu

Prints the two numbers of each piece (FLOPs, bytes moved) from the shapes, and with --time-cpu the measured CPU time
(native backend, median of --rep runs) of the norm, the adapters' equality check the CPU cache does before reusing
a norm, and one forward+backward of the layer. The GPU lines are a prediction from the counts (H100 SXM datasheet
peaks), never a measurement: bench/run.py --modes norm,fwd+bwd measures them on a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

H100_BF16_FLOPS = 989e12   # dense bf16 tensor-core peak
H100_FP32_FLOPS = 67e12    # fp32 SIMT peak (the norm's B A products with fp32 adapters)
H100_BYTES = 3.35e12       # HBM3


def counts(M: int, N: int, K: int, r: int, adapter_bytes: int = 4, act_bytes: int = 2) -> dict:
    """FLOPs and HBM bytes of the norm, the adapters' equality check, and the layer's forward + input gradient."""
    return {
        "norm": (2 * N * K * r, N * K + (N + K) * r * adapter_bytes + 4 * N),
        "equality check": (0, 2 * (N + K) * r * adapter_bytes),
        "fwd+dgrad GEMMs": (2 * 2 * M * N * K, 2 * N * K + 2 * (M * K + M * N) * act_bytes),
    }


def _median_ms(fn, rep: int) -> float:
    fn()
    times = []
    for _ in range(rep):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_cpu(M: int, N: int, K: int, r: int, rep: int) -> dict:
    import dorafp8

    torch.manual_seed(0)
    w8, scale = dorafp8.quantize_e4m3(torch.randn(N, K) * 0.02)
    A = (torch.randn(r, K) * 0.01).requires_grad_()
    B = (torch.randn(N, r) * 0.01).requires_grad_()
    m = torch.ones(N, requires_grad=True)
    x = torch.randn(M, K, dtype=torch.bfloat16, requires_grad=True)
    A_copy, B_copy = A.detach().clone(), B.detach().clone()

    def norm():
        dorafp8.weight_norm(w8, scale, A, B, 2.0, backend="native")

    def check():
        return torch.equal(A_copy, A) and torch.equal(B_copy, B)

    def layer():
        y = dorafp8.dora_fp8_linear(x, w8, scale, A, B, m, 2.0, backend="native", training=True)
        y.backward(torch.ones_like(y))

    return {"norm": _median_ms(norm, rep), "equality check": _median_ms(check, rep),
            "layer fwd+bwd": _median_ms(layer, max(1, rep // 2))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4096, help="out features N")
    ap.add_argument("--k", type=int, default=4096, help="in features K")
    ap.add_argument("--r", type=int, default=16, help="rank")
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 256], help="M values")
    ap.add_argument("--time-cpu", action="store_true", help="also time the pieces on this CPU (native backend)")
    ap.add_argument("--rep", type=int, default=5)
    a = ap.parse_args()
    N, K, r = a.n, a.k, a.r
    print(f"N={N} K={K} r={r}, fp32 adapters, bf16 activations, fp8 weight")
    for M in a.tokens:
        c = counts(M, N, K, r)
        gemm_flops, gemm_bytes = c["fwd+dgrad GEMMs"]
        print(f"\nM={M}")
        for name, (flops, nbytes) in c.items():
            pred = max(flops / (H100_FP32_FLOPS if name == "norm" else H100_BF16_FLOPS), nbytes / H100_BYTES) * 1e6
            print(f"  {name:16s} {flops / 1e9:9.3f} GFLOP {nbytes / 2**20:9.2f} MiB"
                  f"   ({flops / gemm_flops:7.2%} of the GEMMs' FLOPs, {nbytes / gemm_bytes:7.2%} of their bytes)"
                  f"   H100 prediction {pred:8.1f} us")
        if a.time_cpu:
            t = time_cpu(M, N, K, r, a.rep)
            print("  measured on this CPU (native backend, median): " +
                  ", ".join(f"{k} {v:.2f} ms" for k, v in t.items()) +
                  f"; norm / layer = {t['norm'] / t['layer fwd+bwd']:.1%}, "
                  f"check / norm = {t['equality check'] / t['norm']:.2%}")


if __name__ == "__main__":
    main()
