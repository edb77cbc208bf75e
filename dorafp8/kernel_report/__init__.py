"""The kernel report: dorafp8's GPU kernels compiled ahead of time for sm_90a, sm_89, sm_100a and sm_120 and read
statically, without a GPU: `python -m dorafp8.kernel_report --help` (docs/INSPECT.md). The names below are the API
that tests/integration/test_inspect.py and tests/kernels/test_cuda_emulated.py use."""

from .cli import format_table, main, problems_of
from .cuda_driver import (cuda_dir, cuda_sources, cuda_spec_by_source, cuda_unavailable_reason, load_cuda_spec,
                          match_cuda_kernels, nvcc_flags)
from .parsers import check_variant, classify_mma, config_str, parse_ptxas_log, ptx_functions, ttgir_dots, w8_operand
from .pool import cuda_jobs, plan, run
from .records import ARCHS, BACKENDS, FIELDS, SMEM_LIMIT, SpecError, kernel_matches, new_record
from .sass import loads_after_first_store
from .triton_driver import SPEC_MODULE, job_sass, list_jobs, triton_unavailable_reason

__all__ = [
    "ARCHS", "BACKENDS", "FIELDS", "SMEM_LIMIT", "SPEC_MODULE", "SpecError", "check_variant", "classify_mma",
    "config_str", "cuda_dir", "cuda_jobs", "cuda_sources", "cuda_spec_by_source", "cuda_unavailable_reason",
    "format_table", "job_sass", "kernel_matches", "list_jobs", "load_cuda_spec", "loads_after_first_store", "main",
    "match_cuda_kernels", "new_record", "nvcc_flags", "parse_ptxas_log", "plan", "problems_of", "ptx_functions", "run",
    "triton_unavailable_reason", "ttgir_dots", "w8_operand",
]
