"""What every part of the kernel report shares: the targets, the record format and the error for a stale spec
(stdlib only, so that the other parts import it without importing one another)."""

from __future__ import annotations

from typing import Iterable

# Hopper (H100, H200), Ada (RTX 4090, L40S), datacenter Blackwell (B200) and consumer / workstation Blackwell (RTX 5090,
# RTX PRO 6000).
ARCHS = ("sm_90a", "sm_89", "sm_100a", "sm_120")
# Largest shared memory one block may use (with the opt-in launchers and Triton do; CUDA C++ Programming Guide, table
# of technical specifications per compute capability): 9.0 and 10.0 227 KB, 8.9 and 12.0 99 KB.
SMEM_LIMIT = {"sm_90a": 232448, "sm_89": 101376, "sm_100a": 232448, "sm_120": 101376}
# nvcc's code for each target, as setup.py's default DORAFP8_CUDA_ARCHS builds dorafp8._C (plain sm_100: the kernels
# need nothing only sm_100a has, and it also runs on sm_103).
CUDA_CODE = {"sm_90a": "90a", "sm_89": "89", "sm_100a": "100", "sm_120": "120"}
BACKENDS = ("triton", "cuda")

# Keys of every record, in the order the JSON output has them (docs/INSPECT.md says what each means).
FIELDS = (
    "backend", "kernel", "variant", "dtype", "arch", "config", "autotune_pick",
    "mma", "mma_shapes", "w_operand", "w8_dots", "w8_side", "wgmma_a_regs", "wgmma_a_smem",
    "tcgen05_a_tmem", "tcgen05_a_smem",
    "regs", "spill_stores", "spill_loads", "spill_bytes", "stack_bytes", "smem_bytes", "smem_static", "smem_limit",
    "ptxas_notes", "main_loop", "ws_consumers", "tile_loop", "producer_loop", "kernel_instrs", "tile_instrs",
    "loads_after_store", "loop_loads_after_store", "compile_s", "error",
)


class SpecError(RuntimeError):
    """The kernels and their inspection spec disagree (a parameter or a kernel added, renamed or removed): update
    triton_kernels/inspect_spec.py or csrc/inspect_spec.py. Never skipped: a stale spec would inspect the wrong code."""


def new_record(**kw) -> dict:
    """A record with every field of FIELDS (None where not given), in their order."""
    rec = dict.fromkeys(FIELDS)
    rec.update(kw)
    return rec


def kernel_matches(name: str, wanted: Iterable[str]) -> bool:
    """--kernel NAME selects kernel NAME and the kernels named NAME_* ("forward": forward, forward_mma_kernel)."""
    return any(name == w or name.startswith(w + "_") for w in wanted)
