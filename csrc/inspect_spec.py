"""Every kernel the CUDA files of csrc/ instantiate, for `python -m dorafp8.kernel_report --backend cuda`
(docs/INSPECT.md); the tool fails when a file's compiled kernels and its rows below differ.

Row fields: source (the defining file; smem is evaluated in its translation unit), kernel (name in dorafp8::detail),
targs (template arguments as demangled, None if not a template), variant (the launcher path), dtype (compute dtype;
weight_norm: that of A and B), config (tile shape), smem (the launcher's dynamic shared memory, a host C++ expression
in dorafp8::detail; ptxas reports only static shared memory)."""

_16BIT = {"bf16": "__nv_bfloat16", "fp16": "__half"}
# (BM, BN, DROP, variant): launch_gemm_tiles (common/gemm.cuh, for forward and dgrad alike) picks 64 x 128 tiles
# (2 x 4 warps) for M <= 64, else 64 x 256 without dropout and 32 x 256 with it (1 x 8 warps). BN is the output-column
# width (dgrad: BK, columns of K).
_MMA_PATHS = [(64, 128, "true", "adapter+dropout, M<=64"), (64, 128, "false", "M<=64"),
              (32, 256, "true", "adapter+dropout, M>64"), (64, 256, "false", "M>64")]


def _row(source, kernel, targs, variant, dtype, config, smem):
    return dict(source=source, kernel=kernel, targs=targs, variant=variant, dtype=dtype, config=config, smem=smem)


KERNELS = [
    *[_row("weight_norm.cu", "weight_norm_kernel", t, "K split", d, "32 rows x BK 128", "kWnSmem")
      for d, t in (("fp32", "float"), ("bf16", "__nv_bfloat16"), ("fp16", "__half"))],
    _row("weight_norm.cu", "weight_norm_finalize_kernel", None, "K splits > 1", "fp32", "256 rows", "0"),
    *[_row("forward.cu", "forward_mma_kernel", f"{t}, {bm}, {bn}, {drop}", v, d, f"BM={bm},BN={bn},BK=32",
           f"FwdCfg<{bm}, {bn}, {drop}>::kSmem")
      for d, t in _16BIT.items() for bm, bn, drop, v in _MMA_PATHS],
    *[_row("dgrad.cu", "dgrad_mma_kernel", f"{t}, {bm}, {bk}, {drop}", v, d, f"BM={bm},BK={bk},BN=32",
           f"DgradCfg<{bm}, {bk}, {drop}>::kSmem")
      for d, t in _16BIT.items() for bm, bk, drop, v in _MMA_PATHS],
    *[_row(f"{k}.cu", f"{k}_simt_kernel", drop, "adapter+dropout" if drop == "true" else "no dropout", "fp32",
           "64x64 tile", f"simt_smem({2 if drop == 'true' else 1})")
      for k in ("forward", "dgrad") for drop in ("true", "false")],
]
