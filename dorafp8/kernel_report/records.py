"""What every part of the kernel report shares: the targets, the record format and the error for a stale spec.

A module of its own (stdlib only) so that the parsers, both drivers, the worker pool and the CLI can import it
without importing one another.
"""

from __future__ import annotations

from typing import Iterable

ARCHS = ("sm_90a", "sm_89")
# Largest shared memory one block may use (with the opt-in launchers and Triton do): H100 227 KB, Ada 99 KB.
SMEM_LIMIT = {"sm_90a": 232448, "sm_89": 101376}
BACKENDS = ("triton", "cuda")

# Keys of every record, in the order the JSON output has them (docs/INSPECT.md says what each means).
FIELDS = (
    "backend", "kernel", "variant", "dtype", "arch", "config", "autotune_pick",
    "mma", "mma_shapes", "w_operand", "w8_dots", "w8_side", "wgmma_a_regs", "wgmma_a_smem",
    "regs", "spill_stores", "spill_loads", "spill_bytes", "stack_bytes", "smem_bytes", "smem_static", "smem_limit",
    "ptxas_notes", "main_loop", "compile_s", "error",
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
