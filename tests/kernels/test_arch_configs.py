"""Which autotune config lists a GPU gets (triton_kernels/_common.py: _arch, arch_of_capability), checked without a GPU
by faking the device's compute capability.

The lists themselves are checked against each arch's shared memory, registers and instructions by
tests/integration/test_inspect.py, which compiles every listed config for every target of the kernel report; here:
a GPU never gets a list made for more shared memory than it has, and every list the launchers can pick is one of the
report's targets (so that it is checked there).
"""

import pytest
import torch

from dorafp8.kernel_report import SMEM_LIMIT
from dorafp8.triton_kernels import _common as C
from dorafp8.triton_kernels.inspect_spec import ARCHS

# Shared memory per block with the opt-in, per compute capability (CUDA C++ Programming Guide, technical specifications
# per compute capability), typed in here independently of the package's own table.
DEVICE_SMEM = {(8, 0): 163 * 1024, (8, 6): 99 * 1024, (8, 9): 99 * 1024, (9, 0): 227 * 1024, (10, 0): 227 * 1024,
               (12, 0): 99 * 1024}
TARGET_OF = {table: target for target, (table, _) in ARCHS.items()}  # "sm120" -> "sm_120"


def test_every_list_the_launchers_pick_is_a_report_target():
    tables = set(C._GEMM_TABLE) | (set(C._WEIGHT_NORM_TABLE) - {"interp"})
    assert tables == set(TARGET_OF), "each config table needs a target in inspect_spec.ARCHS, and the other way round"
    picked = {C.arch_of_capability(major, minor) for major in range(7, 16) for minor in range(10)}
    assert picked <= set(TARGET_OF)


@pytest.mark.parametrize("cap", sorted(DEVICE_SMEM), ids=lambda c: f"sm_{c[0]}{c[1]}")
def test_a_gpu_gets_lists_that_fit_its_shared_memory(cap):
    assert SMEM_LIMIT[TARGET_OF[C.arch_of_capability(*cap)]] <= DEVICE_SMEM[cap]


def test_known_gpus_get_their_own_lists():
    # B200 and B300 (10.0, 10.3) Hopper-sized, RTX 5090 / RTX PRO 6000 and DGX Spark (12.0, 12.1) Ada-sized.
    assert [C.arch_of_capability(*c) for c in ((9, 0), (8, 9), (10, 0), (10, 3), (12, 0), (12, 1))] == [
        "sm90", "sm89", "sm100", "sm100", "sm120", "sm120"]


@pytest.mark.parametrize("cap", [(11, 0), (13, 0), (14, 2)], ids=lambda c: f"sm_{c[0]}{c[1]}")
def test_unknown_gpus_get_the_smallest_shared_memory_lists(cap):
    # A capability with no table of its own (Thor's 11.0, anything newer than this package) must not be handed a list
    # it may not have the shared memory for: it gets the lists made for the least.
    least = min(SMEM_LIMIT[t] for t in TARGET_OF.values())
    assert SMEM_LIMIT[TARGET_OF[C.arch_of_capability(*cap)]] == least


def test_the_launchers_pick_the_lists_from_the_device(monkeypatch):
    # What gemm_configs / weight_norm_configs hand the autotuner for a (faked) CUDA device: its capability's lists, not
    # the interpreter's single config, and not Hopper's on a 99 KB Blackwell (what sm_120 got before it had its own).
    # _common reads TRITON_INTERPRET once, at import (README's test command sets it): patch what it read.
    monkeypatch.setattr(C, "_INTERPRET", False)
    dev = torch.device("cuda", 0)
    for cap, table in (((12, 0), "sm120"), ((10, 0), "sm100"), ((9, 0), "sm90"), ((8, 9), "sm89")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cap=cap: cap)
        assert C.arch_of(dev) == table
        for two_acc in (False, True):
            for m in (16, 4096):
                got = C.gemm_configs(dev, "BLOCK_N", "BLOCK_K", two_acc, m, False)
                want = C.gemm_configs_for(table, "BLOCK_N", "BLOCK_K", two_acc, m, False)
                assert [str(c) for c in got] == [str(c) for c in want]
        assert [str(c) for c in C.weight_norm_configs(dev)] == [str(c) for c in C.weight_norm_configs_for(table)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (12, 0))
    assert [str(c) for c in C.gemm_configs(dev, "BLOCK_N", "BLOCK_K", True, 4096, False)] != [
        str(c) for c in C.gemm_configs_for("sm90", "BLOCK_N", "BLOCK_K", True, 4096, False)]
    monkeypatch.setattr(C, "_INTERPRET", True)
    assert C.arch_of(dev) == "interp"
    assert C.arch_of(torch.device("cpu")) == "interp"


@pytest.mark.parametrize("out,red", [("BLOCK_N", "BLOCK_K"), ("BLOCK_K", "BLOCK_N")], ids=["forward", "dgrad"])
def test_w8a8_on_hopper_may_promote_every_128(out, red):
    # W8A8 on sm_90 promotes its fp8 partial sums to fp32 once per reduction step (FP8_PROMOTE): its large-M lists
    # offer the 128-deep steps FBGEMM and DeepGEMM promote at, and never deeper (docs/DORA_MATH.md bounds the error
    # for steps of at most 128). W8A16's stay 64 deep (its converted W8 tile in registers).
    deep = lambda fp8_dot, two_acc=False: {c.kwargs[red] for c in C.gemm_configs_for(  # noqa: E731
        "sm90", out, red, two_acc, 4096, False, two_acc and fp8_dot, fp8_dot)}
    assert deep(True) == {64, 128}
    assert deep(False) == {64}
    assert max(deep(True, two_acc=True)) <= 128


def test_rank_term_is_fp32_fma_on_hopper_under_triton_3_8(monkeypatch):
    """Triton 3.8's sm_90 GEMMs whose epilogue multiplies the rank-r term on tensor cores have their wgmma serialized by
    ptxas (C7515): the dgrad (split_dot's products, PEFT's defaults) and the forward with dropout. There the term is
    exact fp32 FMAs, on Hopper only, in the cp.async loop (the warp-specialized one is not serialized), and the kernel
    report compiles what the launchers run (the same choice, in inspect_spec)."""
    import triton

    from dorafp8.triton_kernels import inspect_spec
    from dorafp8.triton_kernels.epilogue_dot import rank_fma_for

    def tensor_core_rank(kernel, table, dropout, loop="async-copy"):
        spec = next(s for s in inspect_spec.SPECS if s.name == kernel)
        return {not v.constexprs["LORA_IEEE"] for v in spec.variants(table)
                if v.constexprs["HAS_ADAPTER"] and v.constexprs["HAS_DROPOUT"] == dropout and v.dtype != "fp32"
                and v.constexprs["MAIN_LOOP"] == loop}

    monkeypatch.setattr(C, "_INTERPRET", False)  # dot_dtype as on a GPU (the interpreter takes bf16 dots in fp32)
    for version, fma in (("3.8.0", True), ("3.8.1", True), ("3.6.0", False), ("3.7.1", False), ("3.9.0", False)):
        monkeypatch.setattr(triton, "__version__", version)
        for dgrad, dropout in ((True, False), (True, True), (False, True)):
            assert rank_fma_for("sm90", dgrad, dropout) is fma, (version, dgrad, dropout)
            assert tensor_core_rank("dgrad" if dgrad else "forward", "sm90", dropout) == {not fma}, version
        assert not rank_fma_for("sm90", False, False)  # the forward without dropout is not serialized
        assert tensor_core_rank("forward", "sm90", False) == {True}, version
        # the warp-specialized Hopper loop (no dropout) keeps tensor cores under every Triton: ptxas serializes none
        # of its GEMMs (kernel_report; hopper.py)
        for kernel in ("forward", "dgrad"):
            assert tensor_core_rank(kernel, "sm90", False, "tma-ws") == {True}, (version, kernel)
        for table in ("sm89", "sm100", "sm120", "interp"):
            assert not any(rank_fma_for(table, dgrad, dropout) for dgrad in (False, True) for dropout in (False, True))
    # and the launchers ask for it from the device they run on
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert C.arch_of(torch.device("cuda", 0)) == "sm90"


def test_weight_tile_goes_through_fp32_where_triton_has_no_native_unpack(monkeypatch):
    """gemm.w8_to converts e4m3 -> bf16 through fp32 wherever Triton's own conversion goes through fp16 and F2F: Ada and
    Hopper always, Blackwell under Triton 3.6 to 3.8 (3.9 unpacks natively there). The compiled main loops are checked
    for F2F by tests/integration/test_inspect.py under each Triton of the version matrix; here the choice itself."""
    import triton

    for version, blackwell in (("3.6.0", True), ("3.7.1", True), ("3.8.0", True), ("3.9.0", False), ("3.10.0", False)):
        monkeypatch.setattr(triton, "__version__", version)
        assert {t: C.w8_via_f32_for(t) for t in ("sm90", "sm89", "sm100", "sm120", "interp")} == {
            "sm90": True, "sm89": True, "sm100": blackwell, "sm120": blackwell, "interp": False}, version


def test_two_accumulator_lists_under_triton_3_8(monkeypatch):
    """Triton 3.8 spills the two-accumulator (dropout) main loops of some mma.sync tiles (sm_89, sm_120) that 3.6, 3.7
    and 3.9 compile without: under 3.8 those two tables' large-M two-accumulator lists are other tiles, and nothing else
    changes (the lists are compiled and checked for spills under each Triton by tests/integration/test_inspect.py)."""
    import triton

    def lists(table):
        return [[str(c) for c in C.gemm_configs_for(table, o, r, two_acc, m, False)]
                for o, r in (("BLOCK_N", "BLOCK_K"), ("BLOCK_K", "BLOCK_N")) for two_acc in (False, True) for m in (16, 4096)]

    monkeypatch.setattr(triton, "__version__", "3.9.0")
    newest = {t: lists(t) for t in C._GEMM_TABLE}
    monkeypatch.setattr(triton, "__version__", "3.8.0")
    for table in C._GEMM_TABLE:
        changed = [i for i, (a, b) in enumerate(zip(newest[table], lists(table))) if a != b]
        # (forward, dgrad) x (one, two accumulators) x (small, large M): index 3 and 7 are the two-accumulator large-M
        assert changed == ([3, 7] if table in ("sm89", "sm120") else []), table


def test_pinned_configs(monkeypatch):
    """_pins.pin_configs (bench/first_contact.py): a launcher whose list holds its pin tunes over that config alone;
    a list without it, or a launcher without a pin, keeps its list; configs are named as the kernel report names
    them; pins that are not a dict of names are refused, and so is a pin no launcher has (one without its main loop,
    "forward/w8a16", which pinned both loops' launches before)."""
    from dorafp8.kernel_report.parsers import config_str
    from dorafp8.triton_kernels import _pins as Pins

    big = C.gemm_configs_for("sm90", "BLOCK_N", "BLOCK_K", False, 8192, False)
    small = C.gemm_configs_for("sm90", "BLOCK_N", "BLOCK_K", False, 64, False)
    assert [Pins.config_name(c) for c in big + small] == [config_str(c) for c in big + small]
    assert Pins.config_name(big[0]) not in {Pins.config_name(c) for c in small}
    monkeypatch.setattr(Pins, "_PINS", {})
    pin = "forward/w8a16/async-copy"
    assert Pins.pinned(pin, big) == big  # nothing pinned
    Pins.pin_configs({pin: Pins.config_name(big[0])})
    assert Pins.pinned(pin, big) == [big[0]]
    assert Pins.pinned(pin, small) == small and Pins.pinned("dgrad/w8a16/async-copy", big) == big
    assert Pins.pinned(None, big) == big
    with pytest.raises(TypeError, match="pins must be a dict"):
        Pins.pin_configs([pin])
    with pytest.raises(ValueError, match=r"\['forward/w8a16'\], which no launcher has; the pins: .*forward/w8a16/"):
        Pins.pin_configs({"forward/w8a16": Pins.config_name(big[0])})
    Pins.pin_configs({})
    assert Pins.pinned(pin, big) == big


@pytest.mark.parametrize("configs_as", ["list", "function"])
def test_a_pin_after_the_first_launch_reaches_the_next(monkeypatch, configs_as):
    """autotuned caches a launcher's tuner: a pin set after its first launch must still narrow its next launch to the
    pinned config, and pin_configs({}) after that give it its list back (the cache key held no pin, so the first
    tuner served every later launch: pinned never re-pinned, unpinned kept the pin)."""
    import triton

    from dorafp8.triton_kernels import _pins as Pins

    class Fn:  # a JITFunction as the tuners see it: its argument names and run
        arg_names = ["a", "out"]

        def __init__(self):
            self.calls, self.fn = [], lambda a, out: None

        def run(self, *args, **kwargs):
            self.calls.append(kwargs)

    big, small = triton.Config({"BLOCK_M": 64}, num_warps=4), triton.Config({"BLOCK_M": 16}, num_warps=4)
    fn, pin = Fn(), "weight_norm"
    configs = [big, small] if configs_as == "list" else (lambda: [big, small])
    monkeypatch.setattr(C, "_TUNERS", {})
    monkeypatch.setattr(Pins, "_PINS", {})

    def launched():  # the tuner this launch gets, and BLOCK_M of its run where it has one config (nothing to tune)
        tuner = C.autotuned(fn, "t", configs, ["a"], ["out"], torch.device("cpu"), pin=pin)
        if len(tuner.configs) > 1:
            return [Pins.config_name(c) for c in tuner.configs]
        tuner[(1,)](1, out=None)
        return fn.calls[-1]["BLOCK_M"]

    assert launched() == [Pins.config_name(big), Pins.config_name(small)]  # the first launch: the whole list
    Pins.pin_configs({pin: Pins.config_name(small)})
    assert launched() == 16  # pinned after the first launch
    Pins.pin_configs({pin: [Pins.config_name(big)]})
    assert launched() == 64  # re-pinned (a list of names)
    Pins.pin_configs({})
    assert launched() == [Pins.config_name(big), Pins.config_name(small)]  # unpinned: the list again


@pytest.mark.parametrize("env,sm90,interp", [(None, "async-copy", "async-copy"), ("0", "async-copy", "async-copy"),
                                             ("1", "tma-ws", "tma-ws")])
def test_the_hopper_loop_is_opt_in(monkeypatch, env, sm90, interp):
    """The first GPU run (H200, Triton 3.6: bench/results/nvidia-h200/correctness.md) found the "tma-ws" loop's y, dx
    and dm NaN where the cp.async loop passed every fp64 check: sm_90 runs "async-copy" unless DORAFP8_HOPPER_GEMM=1
    asks for the Hopper loop (it ran "tma-ws" with the variable unset before); every other GPU runs "async-copy" in
    any case, and the kernel report names its variants after the same pick."""
    from dorafp8.kernel_report import predict
    from dorafp8.triton_kernels.hopper import main_loop_for

    if env is None:
        monkeypatch.delenv("DORAFP8_HOPPER_GEMM", raising=False)
    else:
        monkeypatch.setenv("DORAFP8_HOPPER_GEMM", env)
    assert main_loop_for("sm90") == sm90 and main_loop_for("interp") == interp
    assert {main_loop_for(t) for t in ("sm89", "sm100", "sm120")} == {"async-copy"}
    assert predict._suffix(sm90) == "" and predict._suffix("tma-ws" if sm90 == "async-copy" else "async-copy") != ""


def test_the_launchers_name_their_pins(monkeypatch):
    """Each autotuned launcher passes its pin: the GEMMs by kernel, mode and main loop, the norm as weight_norm."""
    import importlib

    import dorafp8

    if dorafp8.backends.unavailable_reason("triton", torch.device("cpu")):
        pytest.skip("the Triton backend does not run here")
    monkeypatch.delenv("DORAFP8_HOPPER_GEMM", raising=False)
    seen = set()
    for name in ("forward", "dgrad", "weight_norm"):
        mod = importlib.import_module(f"dorafp8.triton_kernels.{name}")
        real = mod.autotuned

        def spy(*args, real=real, **kwargs):
            seen.add(kwargs.get("pin"))
            return real(*args, **kwargs)

        monkeypatch.setattr(mod, "autotuned", spy)
    w8, scale = dorafp8.quantize_e4m3(torch.randn(32, 32))
    for act_quant in (None, "rowwise"):
        leaves = [torch.randn(4, 32).requires_grad_(), torch.randn(32, 4).requires_grad_(),
                  (torch.rand(32) + 0.5).requires_grad_()]
        x = torch.randn(20, 32).requires_grad_()
        dorafp8.dora_fp8_linear(x, w8, scale, *leaves, 0.5, backend="triton", act_quant=act_quant).sum().backward()
    # under the interpreter the default loop: "async-copy" (test_the_hopper_loop_is_opt_in)
    assert seen == {"forward/w8a16/async-copy", "forward/w8a8/async-copy", "dgrad/w8a16/async-copy",
                    "dgrad/w8a8/async-copy", "weight_norm"}


def test_fp32_compute_is_refused_where_triton_runs_it_on_tf32(monkeypatch):
    """Triton 3.6 and 3.7 compile the GEMMs' fp32 main-loop dots to tcgen05.mma kind::tf32 on sm_100a, whatever
    input_precision says (tests/integration/test_inspect.py reads it from the compiled kernels): there the Triton
    backend refuses fp32 compute, by name with the fix, and backend="auto" passes it over; 16-bit compute, other GPUs
    and Triton 3.8 on are untouched."""
    import triton

    from dorafp8 import backends

    monkeypatch.setattr(C, "_INTERPRET", False)
    monkeypatch.setattr(backends, "unavailable_reason", lambda name, device: None)  # as if each could run here
    dev = torch.device("cuda", 0)
    for version, cap, exact in (("3.6.0", (10, 0), False), ("3.7.1", (10, 3), False), ("3.8.0", (10, 0), True),
                                ("3.9.0", (10, 0), True), ("3.6.0", (9, 0), True), ("3.7.1", (12, 0), True)):
        monkeypatch.setattr(triton, "__version__", version)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cap=cap: cap)
        assert ("fp32" in backends.supports("triton", dev)) is exact, (version, cap)
        assert backends.resolve("auto", dev, frozenset()) == "triton"
        assert (backends.resolve("auto", dev, frozenset({"fp32"})) == "triton") is exact, (version, cap)
        if not exact:
            with pytest.raises(ValueError, match=rf"fp32 compute .* on sm_100 under Triton {version} .*triton>=3\.8"):
                backends.resolve("triton", dev, frozenset({"fp32"}))


@pytest.mark.parametrize("fp8", [False, True], ids=["w8a16", "w8a8"])
@pytest.mark.parametrize("m", [32, 4096])
@pytest.mark.parametrize("block", [128, 64, 32])
def test_block_scales_keep_the_hopper_loops_tiles(fp8, m, block):
    """Block scales (DeepSeek's and Qwen3-FP8's 128 x 128) on the "tma-ws" loop: the step's reduction block divides the
    scale block, and the tile stays the loop's own (128 x 128 at large M), which its two 232-register consumer
    warpgroups hold with the partial-product twin (compiled for sm_90a without spills: test_inspect.py). The 4-warp
    budget of the other loops shrank it to 32 x 128 before."""
    from dorafp8.triton_kernels.hopper import ws_configs_for

    plain = ws_configs_for("sm90", "BLOCK_N", "BLOCK_K", m, fp8)
    fitted = C.fit_reduction_block(plain, "BLOCK_K", block, "block", "BLOCK_N", 1, "tma-ws")
    tile = lambda c, bk: (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], bk, c.num_warps, c.num_stages)  # noqa: E731
    # the fitted list: each tile with its step cut to divide the block (W8A8's 128- and 64-deep steps may then meet)
    want = list(dict.fromkeys(tile(c, min(c.kwargs["BLOCK_K"], block)) for c in plain))
    assert [tile(c, c.kwargs["BLOCK_K"]) for c in fitted] == want
    assert all(block % c.kwargs["BLOCK_K"] == 0 for c in fitted)
    assert m <= 64 or max(c.kwargs["BLOCK_M"] for c in fitted) == 128
    # the cp.async loop's tiles keep their 4- and 8-warp budget (two fp32 tiles per accumulator in ~96 registers)
    for c in C.fit_reduction_block(C.gemm_configs_for("sm90", "BLOCK_N", "BLOCK_K", False, m, False), "BLOCK_K", block,
                                   "block", "BLOCK_N", 1, "async-copy"):
        assert 2 * c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 96 * 32 * c.num_warps or c.kwargs["BLOCK_M"] == 16


def test_the_triton_backend_needs_sm_89(monkeypatch):
    """Triton compiles fp8 e4m3 (fp8e4nv, the type of every W8 the kernels read) for sm_89 and later only: on an A100,
    A10, RTX 3090 or A6000 (sm_80 / sm_86) every kernel failed to compile ("type fp8e4nv not supported in this
    architecture") while `python -m dorafp8` said the backend ran; backend="auto" then picked it wherever nothing was
    checked first (DORAFP8_RACE=0, a torch.compile trace, a CUDA graph capture), and the cuBLAS strategy, whose
    dequantize is a Triton kernel, the same. Now both say why, and "auto" passes over them."""
    import dorafp8.triton_kernels as tk
    from dorafp8 import backends

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    dev = torch.device("cuda", 0)
    for cap, runs in (((8, 0), False), ((8, 6), False), ((8, 7), False), ((8, 9), True), ((9, 0), True),
                      ((12, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cap=cap: cap)
        monkeypatch.setattr(backends, "_reasons", {})  # probed once per backend and device otherwise
        why = tk.unavailable_reason(dev)
        assert (why is None) is runs, (cap, why)
        if not runs:
            assert "sm_89 or newer" in why and f"sm_{cap[0]}{cap[1]}" in why, why
            assert "sm_89" in backends.unavailable_reason("cublas", dev)
            assert backends.resolve("auto", dev) not in ("triton", "cublas")


def test_arch_of_asks_a_device_once_and_what_changes_it_anew(monkeypatch):
    # arch_of is asked about ten times a DoRA step: the capability is read once per device index (it never changes),
    # anew for another index, another capability function (how these tests play other GPUs), an index-less device
    # (the current one, which may change), and never under the interpreter or a dry run's CPU tensors.
    monkeypatch.setattr(C, "_INTERPRET", False)
    monkeypatch.setattr(C, "_ARCHS", {})
    asked = []

    def capability(device=None):
        asked.append(device)
        return {0: (9, 0), 1: (8, 9)}.get(getattr(device, "index", None), (12, 0))

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    assert [C.arch_of(torch.device("cuda", 0)) for _ in range(3)] == ["sm90"] * 3
    assert len(asked) == 1
    assert C.arch_of(torch.device("cuda", 1)) == "sm89" and len(asked) == 2
    assert [C.arch_of(torch.device("cuda")) for _ in range(2)] == ["sm120"] * 2 and len(asked) == 4
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert C.arch_of(torch.device("cuda", 0)) == "sm100"
    monkeypatch.setattr(C, "_INTERPRET", True)
    assert C.arch_of(torch.device("cuda", 0)) == "interp"
