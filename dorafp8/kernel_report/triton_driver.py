"""Compiling the Triton kernels ahead of time for a GPU this machine does not have, and reading the result, in a
worker process (pool.py), never under TRITON_INTERPRET. Triton internals are reached only in `launch_options`, `bind`
and `ptxas_log`, written against Triton 3.6 .. 3.9 (docs/INSPECT.md, "Triton versions")."""

from __future__ import annotations

import contextlib
import importlib
import io
import pkgutil
import time

from .parsers import (check_variant, classify_mma, config_str, parse_ptxas_log, tcgen05_types, ttgir_dots,
                      w8_operand, ws_consumers)
from .records import SMEM_LIMIT, SpecError, new_record
from .sass import loads_after_first_store, main_loop_mix, pipeline

SPEC_MODULE = "dorafp8.triton_kernels.inspect_spec"
KERNEL_PACKAGE = "dorafp8.triton_kernels"

def triton_unavailable_reason() -> str | None:
    """None if the Triton kernels can be compiled and read here, else why not."""
    try:
        import triton
        from triton.backends.nvidia.compiler import get_ptxas
        get_ptxas(90).path
    except Exception as e:  # triton missing, or without its NVIDIA backend / ptxas
        return f"Triton's NVIDIA backend is not usable: {type(e).__name__}: {e}"
    from .._deps import untested_version

    return untested_version("triton", triton.__version__)  # the internals below are those of 3.6 and newer


def load_specs(spec_module: str):
    """(the spec module, {spec name: KernelSpec})."""
    mod = importlib.import_module(spec_module)
    return mod, {s.name: s for s in mod.SPECS}


def unlisted_kernels(specs) -> list[str]:
    """@triton.jit functions named *_kernel in the dorafp8.triton_kernels modules that no spec lists."""
    import triton

    pkg = importlib.import_module(KERNEL_PACKAGE)
    listed = {id(s.fn) for s in specs.values()}
    missing = []
    for info in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
        for name, obj in vars(mod).items():
            if (isinstance(obj, triton.runtime.jit.JITFunction) and name.endswith("_kernel")
                    and obj.fn.__module__ == mod.__name__ and id(obj) not in listed):
                missing.append(f"{mod.__name__}.{name}")
    return missing


def variant_configs(mod, spec, arch: str, variant, all_configs: bool):
    """[(config, picked)]: this variant's configs on `arch` (all_configs: on all archs; picked: in `arch`'s list)."""
    own = {config_str(c): c for c in variant.configs}
    if not all_configs:
        return [(c, True) for c in own.values()]
    union = dict(own)
    for table, _ in mod.ARCHS.values():
        for v in spec.variants(table):
            if (v.name, v.dtype) == (variant.name, variant.dtype):
                for c in v.configs:
                    union.setdefault(config_str(c), c)
    return [(c, key in own) for key, c in union.items()]


def list_jobs(req: dict) -> list[dict]:
    """Every (kernel, variant, config, arch) to compile; raises SpecError if any spec and kernel disagree."""
    mod, specs = load_specs(req["spec_module"])
    problems = []
    jobs = []
    for arch in req["archs"]:
        table, _ = mod.ARCHS[arch]
        for spec in specs.values():
            fn = spec.fn
            ce_names = {p.name for p in fn.params if p.is_constexpr}
            for v in spec.variants(table):
                for cfg, picked in variant_configs(mod, spec, arch, v, req["all_configs"]):
                    problems += check_variant(spec.name, fn.arg_names, ce_names, v.args, v.constexprs, cfg.kwargs)
                    jobs.append(dict(op="triton", spec_module=req["spec_module"], kernel=spec.name, arch=arch,
                                     variant=v.name, dtype=v.dtype, config=config_str(cfg), autotune_pick=picked,
                                     all_configs=req["all_configs"]))
    problems += [f"{k} has no KernelSpec in {req['spec_module']}" for k in unlisted_kernels(specs)]
    if problems:
        raise SpecError("the Triton kernels and their inspection spec disagree:\n  "
                        + "\n  ".join(dict.fromkeys(problems)))
    return jobs


# --- Triton internals, 3.6 .. 3.9 ------------------------------------------------------------------------------------

# The compile options JITFunction.run fills in from Triton's knobs (3.6 .. 3.8: instrumentation_mode; 3.9 also
# fpsan_homomorphic_casts), each passed only where the installed Triton has the knob and its CUDA options take it.
_KNOB_OPTIONS = ("instrumentation_mode", "fpsan_homomorphic_casts")


def launch_options(fn, backend) -> dict:
    """The options a real launch of `fn` adds to the kernel's arguments (JITFunction.run's first lines)."""
    from triton import knobs

    known = backend.parse_options({}).__dict__
    opts = {"debug": getattr(fn, "debug", False) or knobs.runtime.debug}
    for name in _KNOB_OPTIONS:
        if name in known and hasattr(knobs.compilation, name):
            opts[name] = getattr(knobs.compilation, name)
    return opts


def bind(fn, backend, args: dict, kwargs: dict):
    """(options, signature, constexprs, attrs) for triton.compile, made by the JIT's own binder and _pack_args from
    example arguments (torch dtypes stand for aligned tensors): the specializations a real launch compiles with."""
    from triton.runtime.jit import MockTensor, create_function_from_signature

    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(**{k: MockTensor.wrap_dtype(v) for k, v in args.items()}, **kwargs)
    return fn._pack_args(backend, kwargs, bound, specialization, options)


@contextlib.contextmanager
def ptxas_log_printed(out: io.StringIO):
    """Inside it, make_cubin prints its own ptxas -v log (its flags; 3.9 adds --regAllocOptLevel=2) into out."""
    from triton import knobs

    saved = knobs.nvidia.dump_ptxas_log
    knobs.nvidia.dump_ptxas_log = True
    try:
        with contextlib.redirect_stdout(out):
            yield
    finally:
        knobs.nvidia.dump_ptxas_log = saved


def ptxas_log(backend, ptx: str, options, capability: int) -> str:
    """ptxas -v's log by a second ptxas run (make_cubin): a kernel read from Triton's cache printed none."""
    out = io.StringIO()
    with ptxas_log_printed(out):
        backend.make_cubin(ptx, {}, options, capability)
    return out.getvalue()


def sass_text(cubin: bytes) -> str:
    """nvdisasm's text of a cubin, by the nvdisasm Triton ships (knobs.nvidia.nvdisasm, 3.6 .. 3.9)."""
    import subprocess
    import tempfile

    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        # -ndf: no dataflow analysis, which prints nothing under -c and took a fifth of nvdisasm's time
        done = subprocess.run([knobs.nvidia.nvdisasm.path, "-c", "-ndf", f.name], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"nvdisasm failed: {done.stderr[-2000:]}")
    return done.stdout


def _compile(job: dict, printed: io.StringIO):
    """(spec, compiled kernel, backend, options, capability) of one job, compiled as the launcher's JIT call would;
    ptxas's log of the compile goes to printed."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    mod, specs = load_specs(job["spec_module"])
    spec = specs[job["kernel"]]
    table, cap = mod.ARCHS[job["arch"]]
    variant = next(v for v in spec.variants(table) if (v.name, v.dtype) == (job["variant"], job["dtype"]))
    cfg = next(c for c, _ in variant_configs(mod, spec, job["arch"], variant, job["all_configs"])
               if config_str(c) == job["config"])
    fn = spec.fn
    target = GPUTarget("cuda", cap, 32)
    backend = make_backend(target)
    # What triton.autotune and JITFunction.run pass: the config's kwargs and options plus the run-time options.
    kwargs = {**variant.constexprs, **cfg.all_kwargs()}
    kwargs.update(launch_options(fn, backend))
    options, signature, constexprs, attrs = bind(fn, backend, variant.args, kwargs)
    with ptxas_log_printed(printed):
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    return spec, compiled, backend, options, cap


def job_sass(job: dict) -> str:
    """nvdisasm's text of one job's kernel (a list_jobs entry), compiled as compile_job compiles it."""
    return sass_text(_compile(job, io.StringIO())[1].asm["cubin"])


def compile_job(job: dict) -> dict:
    """Compiles one (kernel, variant, config, arch) the way the launcher's JIT call would and reads the result."""
    rec = new_record(backend="triton", kernel=job["kernel"], variant=job["variant"], dtype=job["dtype"],
                     arch=job["arch"], config=job["config"], autotune_pick=job["autotune_pick"],
                     smem_limit=SMEM_LIMIT[job["arch"]])
    t0 = time.time()
    try:
        printed = io.StringIO()
        spec, compiled, backend, options, cap = _compile(job, printed)
        ptx, ttgir = compiled.asm["ptx"], compiled.asm["ttgir"]
        # The log of the compile itself (ptxas run twice was a sixth of a cold inspection's time), or where Triton
        # read the kernel from its cache, a second ptxas run's.
        usage = parse_ptxas_log(log := printed.getvalue()).get(compiled.metadata.name)
        if usage is None:
            usage = parse_ptxas_log(log := ptxas_log(backend, ptx, options, cap)).get(compiled.metadata.name)
        if usage is None:
            raise RuntimeError(f"no ptxas -v entry for {compiled.metadata.name}:\n{log[-2000:]}")

        mma = classify_mma(ptx)
        dots = ttgir_dots(ttgir, spec.weight_arg or "")
        mma["mma"] = tcgen05_types(mma["mma"], dots)  # tcgen05's operand types are in the TTGIR only
        # Kernels without the fp8 weight (weight_arg None: the backward pass, the rank-r GEMMs, the quantizer, the
        # epilogues) have no W8 operand to trace.
        w8 = w8_operand(dots if spec.weight_arg else [])
        if mma["mma"] in ("fma", "none") or not spec.weight_arg:
            w8["w_operand"] = None  # no tensor-core instruction: the question does not apply
        elif w8["w_operand"] == "registers" and mma["wgmma_a_smem"] and not mma["wgmma_a_regs"]:
            raise RuntimeError("TTGIR says the W8 tile feeds wgmma from registers but no wgmma in the PTX takes A "
                               "from registers: the reader is out of date with this Triton")
        elif w8["w_operand"] == "tensor memory" and not mma["tcgen05_a_tmem"]:
            raise RuntimeError("TTGIR says the W8 tile feeds tcgen05.mma from tensor memory but no tcgen05.mma in the "
                               "PTX takes A from tensor memory: the reader is out of date with this Triton")
        sass = sass_text(compiled.asm["cubin"])
        loop = main_loop_mix(sass)
        rec.update(mma, **w8, **usage, main_loop=loop, ws_consumers=ws_consumers(ttgir), **pipeline(sass),
                   loads_after_store=loads_after_first_store(sass),
                   loop_loads_after_store=None if loop is None else loads_after_first_store(sass, in_main_loop=True),
                   spill_bytes=usage["spill_stores"] + usage["spill_loads"],
                   smem_bytes=compiled.metadata.shared + usage["smem_static"])
    except Exception as e:  # one config that does not compile is data, not the end of the run
        rec["error"] = f"{type(e).__name__}: {e}".strip()[:4000]
    rec["compile_s"] = round(time.time() - t0, 2)
    return rec
