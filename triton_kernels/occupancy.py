"""How many programs of a compiled kernel run at once on a GPU (one wave): the SM count and the CUDA occupancy rules,
read from the compiled kernel's registers and shared memory. The launchers size their grids by it (the backward pass's
bounded partials, the low-rank kernels' splits); in a dry run (_common.planning_for_gpu) the plan's figures stand in."""

from __future__ import annotations

import torch

from ._common import dry_run

_SM_PROPS: dict = {}
_RESIDENT: dict = {}
_FALLBACK_BLOCKS = 2


def sm_props(device: torch.device) -> tuple[int, int, int, int]:
    """(SMs, registers per SM, threads per SM, shared-memory bytes per SM) of a CUDA device, read once."""
    plan = dry_run()
    if plan is not None:
        return (plan["sms"], 65536, 2048, 228 * 1024)
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = _SM_PROPS.get(index)
    if props is None:
        p = torch.cuda.get_device_properties(index)
        props = (p.multi_processor_count, getattr(p, "regs_per_multiprocessor", 65536),
                 getattr(p, "max_threads_per_multi_processor", 2048),
                 getattr(p, "shared_memory_per_multiprocessor", 228 * 1024))
        _SM_PROPS[index] = props
    return props


def resident_blocks(n_regs: int, shared: int, num_warps: int, props) -> int:
    """How many blocks of a compiled kernel one SM holds at once, by the CUDA occupancy rules (registers per warp in
    units of 256, 1 KiB of shared memory reserved per block, the SM's thread and 32-block limits)."""
    _, regs_sm, threads_sm, smem_sm = props
    by_regs = regs_sm // (max(8, -(-n_regs // 8) * 8) * 32 * num_warps)
    by_smem = smem_sm // (shared + 1024) if shared else 32
    by_threads = threads_sm // (32 * num_warps)
    return max(1, min(32, by_regs, by_smem, by_threads))


def programs_that_fit(kernel, key, args, kwargs, device: torch.device) -> int:
    """SMs x resident blocks of `kernel` compiled for these arguments (a GPU only): the most programs that run in one
    wave. Compiles the kernel (JITFunction.warmup, which the launch then reuses) once per key and device."""
    plan = dry_run()
    if plan is not None:
        return plan["blocks"] * plan["sms"]
    k = (key, device.index)
    blocks = _RESIDENT.get(k)
    if blocks is None:
        compiled = kernel.warmup(*args, grid=(1,), **kwargs)
        # The register count is known once the binary is loaded, which Triton (3.6 to 3.9) does lazily at the first
        # launch (CompiledKernel._init_handles); load it now. Should that change, 2 blocks: what kernel_report gives.
        getattr(compiled, "_init_handles", lambda: None)()
        n_regs = getattr(compiled, "n_regs", None)
        if n_regs is None:
            blocks = _FALLBACK_BLOCKS
        else:
            blocks = resident_blocks(n_regs, compiled.metadata.shared, kwargs.get("num_warps", 4), sm_props(device))
        _RESIDENT[k] = blocks
    return blocks * sm_props(device)[0]
