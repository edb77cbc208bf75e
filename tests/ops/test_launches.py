"""What one DoRA forward + backward launches on the Triton backend, and the bytes it moves (dorafp8/_launches.py).

MEASURED (the kernels run, in Triton's interpreter, at a small shape): every launch, Triton kernels and PyTorch ops
that would launch a kernel on a GPU alike, and every host sync. On a GPU the dropout mask is one op
(native_dropout); on CPU it is two (bernoulli_, ne), so the CPU counts here are the GPU's or one more.

MODELLED (a dry run at the headline shape of issue 26: the launchers plan for an H100, 132 SMs; the kernels are
recorded, not run): the bytes, as dorafp8/_launches.py defines them, each distinct tensor a launch is handed counted
once. The same model on a bf16 nn.Linear forward + input gradient (x, W, y; g, W, dx) is the yardstick. A model, not
a measurement: docs/ARCHITECTURE.md ("The kernel plan") lists the launches and the bytes at that shape.
"""

import math

import pytest
import torch

import dorafp8
from dorafp8._launches import LaunchRecorder, dry_run
from dorafp8.backends import available_backends, base

pytestmark = pytest.mark.skipif("triton" not in available_backends(torch.device("cpu")),
                                reason="the Triton backend cannot run here (no GPU, no TRITON_INTERPRET=1)")

HEADLINE = dict(M=8192, K=4096, N=4096, r=16)  # bf16 activations, fp32 adapters, cached norm, no bias
H100_SMS = 132
BLOCKS_PER_SM = 2  # the backward pass with fp32 adapters: 2 blocks per SM (kernel_report: 176-184 registers x 128)
# The targets: launches per forward + backward, without and with dropout, for W8A16.
MAX_LAUNCHES = {False: 8, True: 10}


def _layer(M, K, N, r, dtype=torch.bfloat16, kind="tensor", real=True):
    """x, w8, scale, A, B, m, n for a DoRA layer: real values, or uninitialized ones for a dry run."""
    if real:
        gen = torch.Generator().manual_seed(0)
        W = torch.randn(N, K, generator=gen) / K ** 0.5
        w8, scale = dorafp8.quantize_e4m3(W, per_row=kind == "row", block_size=16 if kind == "block" else None)
        A = torch.randn(r, K, generator=gen) / K ** 0.5
        B = torch.randn(N, r, generator=gen) * 0.02
        n = dorafp8.weight_norm(w8, scale, A, B, 2.0, backend="reference", block_size=16)
        x = torch.randn(M, K, generator=gen).to(dtype)
    else:
        w8 = torch.empty(N, K, dtype=torch.float8_e4m3fn)
        scale = {"tensor": torch.ones(()), "row": torch.ones(N), "block": torch.ones(-(-N // 128), -(-K // 128))}[kind]
        A, B, n = torch.empty(r, K), torch.empty(N, r), torch.ones(N)
        x = torch.empty(M, K, dtype=dtype)
    return x, w8, scale, A, B, n.clone(), n


def _leaves(layer):
    """x, A, B, m as leaves that want gradients, and the output gradient: made before a recording starts."""
    x, w8, scale, A, B, m, n = layer
    leaves = [t.clone().requires_grad_() for t in (x, A, B, m)]
    gy = torch.ones(x.shape[0], w8.shape[0], dtype=x.dtype)
    return leaves, gy


def _step(layer, leaves, gy, dropout=0.0, act_quant=None, block_size=16):
    """One forward + backward of dora_fp8_linear (Triton backend) with every gradient wanted."""
    _, w8, scale, _, _, _, n = layer
    xl, Al, Bl, ml = leaves
    y = dorafp8.dora_fp8_linear(xl, w8, scale, Al, Bl, ml, 2.0, dropout_p=dropout, training=True, backend="triton",
                                weight_norm=n, block_size=block_size, act_quant=act_quant)
    y.backward(gy)


@pytest.fixture(autouse=True)
def _no_poison(monkeypatch):
    monkeypatch.setattr(base, "POISON_OUTPUTS", False)  # the tests' NaN fill is a launch of its own


@pytest.mark.parametrize("act_quant", [None, "rowwise"])
@pytest.mark.parametrize("kind", ["tensor", "row", "block"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_launches_per_forward_backward(kind, dropout, act_quant):
    """Counted: at most 8 launches without dropout and 10 with (W8A16), no host sync, and no PyTorch op between the
    kernels (with dropout, the mask and x * mask come first). W8A8 adds, by design, one quantization per fp8 GEMM
    operand but x (xm with dropout; gl, and gb with dropout: x is quantized by the projection, which reads it anyway);
    its budget is the W8A16 one plus those and W8^T for the dgrad (transpose_w8: it was an aten clone, 92 us for
    32 MiB on the H200, issue 52)."""
    layer = _layer(48, 64, 80, 8, kind=kind)
    leaves, gy = _leaves(layer)
    with LaunchRecorder() as rec:
        _step(layer, leaves, gy, dropout, act_quant)
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves)  # it ran
    assert rec.syncs == [], rec.syncs
    quantizers = (3 if dropout else 1) if act_quant else 0
    budget = MAX_LAUNCHES[dropout > 0] + (quantizers + 1 if act_quant else 0)
    assert len(rec.launches) <= budget, f"{len(rec.launches)} launches > {budget}:\n{rec.table()}"
    assert rec.names().count("triton:rowwise_quant_kernel") == quantizers, rec.table()
    names = rec.names()
    assert names.count("triton:transpose_w8_kernel") == (1 if act_quant else 0), rec.table()
    first_kernel = min(i for i, name in enumerate(names) if name.startswith("triton:"))
    assert all(name.startswith("triton:") for name in names[first_kernel:]), rec.table()


# The launches whose partial buffers (their number: the grid's) differ between the interpreter's and a GPU's choices.
_PARTIALS = ("triton:dora_bwd_pass_kernel", "triton:dora_bwd_finish_kernel", "triton:project_grad_kernel",
             "triton:sum_splits_kernel")


def test_dry_run_launches_what_runs():
    """The dry run (kernels recorded, not run; the launchers' GPU choices) launches the same kernels on the same
    tensors as the real run in the interpreter, up to the number of partial buffers."""
    layer = _layer(160, 64, 80, 8)  # M = 160: dA's rows are split in two both ways
    leaves, gy = _leaves(layer)
    with LaunchRecorder() as real:
        _step(layer, leaves, gy, 0.1)
    leaves, gy = _leaves(layer)
    with LaunchRecorder() as dry, dry_run(dry, H100_SMS, BLOCKS_PER_SM):
        _step(layer, leaves, gy, 0.1)
    assert real.names() == dry.names(), (real.table(), dry.table())
    for a, b in zip(real.launches, dry.launches):
        if a.name not in _PARTIALS:
            assert sorted(map(str, a.shapes)) == sorted(map(str, b.shapes)), (a, b)


def _headline(dropout=0.0, kind="tensor", act_quant=None):
    h = HEADLINE
    layer = _layer(h["M"], h["K"], h["N"], h["r"], kind=kind, real=False)
    leaves, gy = _leaves(layer)
    with LaunchRecorder() as rec, dry_run(rec, H100_SMS, BLOCKS_PER_SM):
        _step(layer, leaves, gy, dropout, act_quant, block_size=128)
    return rec


def _linear_bytes(M, K, N):
    """The yardstick through the same model: a bf16 nn.Linear forward + input gradient (meta tensors)."""
    x = torch.empty(M, K, dtype=torch.bfloat16, device="meta", requires_grad=True)
    W = torch.empty(N, K, dtype=torch.bfloat16, device="meta")
    with LaunchRecorder() as rec:
        torch.nn.functional.linear(x, W).backward(torch.empty(M, N, dtype=torch.bfloat16, device="meta"))
    assert rec.names() == ["aten:mm.default", "aten:mm.default"], rec.table()
    return rec.nbytes


def test_headline_z_in_the_compute_dtype():
    """No launch of the headline forward + backward touches an fp32 tensor of the activations' size: z, saved for
    dm, is bf16 (it was fp32 with fp32 adapters: 256 MiB of the step's bytes)."""
    h = HEADLINE
    for launch in _headline().launches:
        for shape, dtype in launch.shapes:
            assert not (dtype == torch.float32 and math.prod(shape) >= h["M"] * min(h["N"], h["K"])), launch


class _ConstexprRecorder(LaunchRecorder):
    """A LaunchRecorder that also keeps each Triton launch's keyword arguments (the constexprs)."""

    def __init__(self):
        super().__init__()
        self.kwargs = []

    def _observe(self, kernel, grid, args, kwargs):
        self.kwargs.append(dict(kwargs))
        return super()._observe(kernel, grid, args, kwargs)


def test_project_runs_one_warp_per_mma_row_tile():
    """Issue 52: u = x A^T at the headline (bf16 x, fp32 A, r 16) ran 32 x 64 tiles in 4 warps on mma.sync's 16-row
    tiles, so two warps of four repeated the other two's MMAs and A's split (kernel report: warpsPerCTA [4, 1]). Now
    one warp per 16 rows, in one launch (test_inspect.py reads the SASS)."""
    from dorafp8 import triton_kernels as tk

    h = HEADLINE
    x = torch.empty(h["M"], h["K"], dtype=torch.bfloat16, device="meta")
    A = torch.empty(h["r"], h["K"], dtype=torch.float32, device="meta")
    with _ConstexprRecorder() as rec, dry_run(rec, H100_SMS, BLOCKS_PER_SM):
        tk.project(x, A, torch.float32)
    assert rec.names() == ["triton:project_kernel"], rec.table()
    (kw,) = rec.kwargs
    assert kw["SPLIT"] and kw["num_warps"] * 16 == kw["BLOCK_M"], kw


def test_headline_w8a8_has_no_copy_and_quantizes_x_in_wide_steps():
    """Issue 52, on the H200: W8A8's step ran an aten copy of W8^T (92 us for 32 MiB, 11x its floor) and its
    project_kernel, which also quantizes x, took 157 us against W8A16's 65. Now, in the dry run at the headline
    shape: no PyTorch op at all (W8^T is transpose_w8's), and the quantizing sweep takes steps of at least
    rowwise_quant_kernel's tile (the same pass, 1.9x its floor there); it took the main loop's 32 x 64, a quarter of
    that, with 4x fewer programs."""
    from dorafp8.triton_kernels.quant import QUANT_BLOCKS

    h = HEADLINE
    layer = _layer(h["M"], h["K"], h["N"], h["r"], real=False)
    leaves, gy = _leaves(layer)
    with _ConstexprRecorder() as rec, dry_run(rec, H100_SMS, BLOCKS_PER_SM):
        _step(layer, leaves, gy, 0.0, "rowwise", block_size=128)
    assert all(name.startswith("triton:") for name in rec.names()), rec.table()
    (kw,) = [k for k in rec.kwargs if k.get("QUANT")]
    assert kw["BLOCK_M"] * kw.get("QUANT_BLOCK_K", kw["BLOCK_K"]) >= QUANT_BLOCKS[0] * QUANT_BLOCKS[1], kw


def test_headline_bytes_within_the_designed_budget():
    """The step moves what its design says and no more: the Linear's bytes with the weight in fp8 (half of W's two
    reads), plus z written and read back (for dm), x read twice more (u = x A^T before the forward GEMM, dA = v^T x
    after the dgrad) and g read a second time (by the dgrad, after the pass), with 6% for the rank-r tensors and the
    backward pass's partials. The pass also writes a scaled copy of g (gl = g * c) that the dgrad reads (64 MiB here;
    docs/ARCHITECTURE.md, "The kernel plan")."""
    h = HEADLINE
    M, K, N = h["M"], h["K"], h["N"]
    bf16, fp8 = 2, 1
    budget = (_linear_bytes(M, K, N) - 2 * N * K * (bf16 - fp8)  # W read twice, in fp8
              + 2 * M * N * bf16                                 # z: written by the forward, read by the pass
              + 2 * M * K * bf16                                 # x: read by u's kernel and by dA's
              + M * N * bf16                                     # g: read by the pass and by the dgrad
              + 2 * M * N * bf16)                                # gl: written by the pass, read by the dgrad
    rec = _headline()
    assert rec.nbytes <= 1.06 * budget, rec.table()


@pytest.mark.xfail(strict=True, reason="issue 26's byte target is not met: the model gives 2.2x the Linear's bytes "
                                       "at the headline shape, and 1.5x is the floor of a step that keeps z for dm "
                                       "and reads x for dA; docs/ARCHITECTURE.md, 'The kernel plan', says why")
def test_headline_bytes_within_1_4x_the_linear():
    h = HEADLINE
    rec = _headline()
    assert rec.nbytes <= 1.4 * _linear_bytes(h["M"], h["K"], h["N"]), rec.table()


def _bias_step(bias):
    """The headline dry run with `bias` (None, or [N] bf16): the backward pass's and its finishing kernel's launches."""
    h = HEADLINE
    layer = _layer(h["M"], h["K"], h["N"], h["r"], real=False)
    (xl, Al, Bl, ml), gy = _leaves(layer)
    _, w8, scale, _, _, _, n = layer
    with LaunchRecorder() as rec, dry_run(rec, H100_SMS, BLOCKS_PER_SM):
        y = dorafp8.dora_fp8_linear(xl, w8, scale, Al, Bl, ml, 2.0, bias, training=True, backend="triton",
                                    weight_norm=n, block_size=128)
        y.backward(gy)
    return [launch for launch in rec.launches if launch.name.startswith("triton:dora_bwd_")]


def test_headline_without_a_bias_gradient_has_no_db():
    """Issue 52: the backward pass summed g's columns into a db partial [pm, N] fp32 (written by the pass, read by the
    finishing kernel, which wrote db [N]) for every layer, bias or not. Without a bias, or with one that wants no
    gradient, that partial and db are gone: 2 pm N 4 + 2 N bytes fewer (0.76 MiB at the headline), same launches."""
    N = HEADLINE["N"]
    with_db = _bias_step(torch.zeros(N, dtype=torch.bfloat16, requires_grad=True))
    for bias in (None, torch.zeros(N, dtype=torch.bfloat16)):
        without = _bias_step(bias)
        assert [launch.name for launch in without] == [launch.name for launch in with_db]
        (pm,) = {s[0] for s, d in with_db[0].shapes if tuple(s[1:]) == (N,) and d == torch.float32}
        parts = [s for s, d in without[0].shapes if tuple(s) == (pm, N)]
        assert len(parts) == 1, without[0].shapes  # dm's only
        assert ((N,), torch.bfloat16) not in without[1].shapes, without[1].shapes  # no db written
        saved = sum(launch.nbytes for launch in with_db) - sum(launch.nbytes for launch in without)
        assert saved == 2 * pm * N * 4 + 2 * N - 8, (saved, pm)  # less the finishing kernel's placeholder, rs [2]


def test_linear_yardstick_is_x_w_y_g_w_dx():
    h = HEADLINE
    M, K, N = h["M"], h["K"], h["N"]
    assert _linear_bytes(M, K, N) == 2 * (M * K + N * K + M * N) * 2  # 320 MiB at the headline shape


@pytest.mark.parametrize("r", [16, 128, 256])
def test_backward_pass_partials_are_bounded(r):
    """The backward pass's partial buffers: at most about sqrt(programs) copies of v [M, r] and of (dm, db, dB)
    [N, r + 2], programs = those that fit in one wave (SMs x resident blocks), whatever r is. (The old grid made one
    v partial per BLOCK_N columns, and BLOCK_N shrinks as r grows: 896 copies of v at r = 128 with fp32 adapters,
    3.8 GB, at this shape.)"""
    M, N, K = 8192, 14336, 4096
    layer = _layer(M, K, N, r, real=False)
    leaves, gy = _leaves(layer)
    with LaunchRecorder() as rec, dry_run(rec, H100_SMS, BLOCKS_PER_SM):
        _step(layer, leaves, gy, block_size=128)
    (bwd,) = [launch for launch in rec.launches if launch.name == "triton:dora_bwd_pass_kernel"]
    outputs = {(M, r), (N,), (N, r)}
    parts = [(s, d) for s, d in bwd.shapes if len(s) >= 2 and tuple(s[1:]) in outputs and d == torch.float32]
    assert len(parts) == 3, bwd.shapes  # v's, dm's, dB's (no bias: no db partial)
    programs = H100_SMS * BLOCKS_PER_SM
    ratio = max(M, N) / min(M, N)
    for s, _ in parts:
        assert s[0] <= math.sqrt(programs * ratio) + 2, (s, bwd.shapes)


def test_resident_blocks_follow_the_occupancy_rules():
    """The backward pass's grid is the programs that fit in one wave, from the compiled kernel's registers and shared
    memory by CUDA's occupancy rules (an H100 SM: 65536 registers, 2048 threads, 228 KiB of shared memory)."""
    from dorafp8.triton_kernels.occupancy import resident_blocks

    h100 = (132, 65536, 2048, 228 * 1024)
    assert resident_blocks(235, 16384, 4, h100) == 2  # registers: 240 x 128 per block
    assert resident_blocks(177, 21504, 4, h100) == 2  # fp32 adapters, r=16 (kernel_report): 184 x 128
    assert resident_blocks(178, 22528, 8, h100) == 1  # bf16 adapters, r=16: 184 x 256
    assert resident_blocks(128, 0, 4, h100) == 4
    assert resident_blocks(64, 1024, 8, h100) == 4  # 64 x 256 registers per block
    assert resident_blocks(32, 0, 4, h100) == 16  # the thread limit: 2048 / 128
    assert resident_blocks(32, 100_000, 4, h100) == 2  # shared memory: 228 KiB / (100000 + 1 KiB reserved)


@pytest.mark.parametrize("M,N", [(8192, 4096), (256, 4096), (8192, 14336), (37, 70)])
def test_backward_pass_grid_covers_the_tiles_with_the_programs_that_fit(M, N):
    from dorafp8.triton_kernels.backward import _grid_shape

    bm, bn, programs = 16, 64, 264
    steps, csteps, pm, pn = _grid_shape(M, N, bm, bn, programs)
    assert pm * steps * bm >= M and (pm - 1) * steps * bm < M  # every row block once, no empty row group
    assert pn * csteps * bn >= N and (pn - 1) * csteps * bn < N
    assert pm * pn <= programs + max(pm, pn)  # one wave (up to the rounding of the split)



def test_the_recorder_sees_torch_ops_syncs_and_ops_inside_custom_ops():
    """What the counts above rely on: PyTorch ops count (views and bare allocations do not), a copy behind a
    composite op (contiguous) counts, ops inside dorafp8's custom ops count, and .item() is a sync."""
    x = torch.ones(4, 3)
    with LaunchRecorder() as rec:
        y = (x * 2).t().contiguous().reshape(-1)
        torch.empty(5)
        y.sum().item()
    assert rec.names() == ["aten:mul.Tensor", "aten:clone.default", "aten:sum.default"], rec.table()
    assert rec.syncs == ["aten._local_scalar_dense.default"]
    xt, A = torch.ones(32, 8), torch.ones(2, 32)
    with LaunchRecorder() as rec:  # the kernels read rows: the op copies a column-major x inside itself
        torch.ops.dorafp8.project(xt.t(), A, torch.float32, None, 0.0, "triton")
    assert rec.names() == ["aten:clone.default", "triton:project_kernel"], rec.table()


def test_programs_that_fit_read_the_compiled_kernel(monkeypatch):
    """On a GPU the backward pass's grid comes from the compiled kernel (Triton fills n_regs when it loads the binary,
    lazily: programs_that_fit loads it), once per variant; here with a stand-in for the kernel and an H100's SMs."""
    from types import SimpleNamespace

    from dorafp8.triton_kernels import occupancy

    class Compiled:
        metadata = SimpleNamespace(shared=16384)

        def _init_handles(self):
            self.n_regs = 235

    warmups = []

    class Kernel:
        def warmup(self, *args, grid, **kwargs):
            warmups.append(kwargs)
            return Compiled()

    monkeypatch.setattr(occupancy, "sm_props", lambda device: (132, 65536, 2048, 228 * 1024))
    key, dev = ("test_programs_that_fit", id(Kernel)), torch.device("cuda", 0)
    for _ in range(2):
        assert occupancy.programs_that_fit(Kernel(), key, (), {"num_warps": 4}, dev) == 2 * 132
    assert len(warmups) == 1


@pytest.mark.parametrize("strategy", ["W8A16", "W8A8", "dequantize + cuBLAS"])
def test_predicted_bytes_are_the_recorded_tensors_sizes(strategy, monkeypatch):
    """The bytes `--predict` times each launch by (kernel_report.predict.strategy_launches, the dicts that
    layer_seconds adds up) are the sizes of the distinct tensors the recorder saw the launch handed, recomputed here
    from their shapes and dtypes: so the byte counts issue 52's targets rest on cannot drift from the tensors."""
    from dorafp8.kernel_report import predict as pr

    monkeypatch.setenv("DORAFP8_HOPPER_GEMM", "1")  # strategy_launches sets it: restored after the test
    launches = pr.strategy_launches(strategy)
    for lc in launches:
        sizes = sum(math.prod(shape) * getattr(torch, dt.replace("torch.", "")).itemsize for shape, dt in lc["shapes"])
        assert lc["nbytes"] == sizes, f"{lc['name']}: predicted {lc['nbytes']} bytes, its tensors hold {sizes}"
        if lc["name"] not in pr.GEMM_KERNELS and not lc["flops"] and lc["name"] not in pr.RANK_FLOPS:
            assert pr.launch_seconds(lc, "lo") == pytest.approx(sizes / pr.RATES["hbm"].lo), lc["name"]
    assert pr.layer_seconds({}, launches)["bytes"] == sum(lc["nbytes"] for lc in launches)


def test_the_cublas_strategy_is_above_the_dequantize_floor(monkeypatch):
    """The floor docs/INSPECT.md argues for any dequantize + cuBLAS design (kernel_report.predict.dequant_floor_*)
    holds for the strategy as built: no fewer bytes or launches. If a change goes below it, the argument is wrong and
    the docs (and issue 52's reading of its 1.25x target, which that floor is above at both ends) must be redone."""
    from dorafp8.kernel_report import predict as pr

    M, N, K = (HEADLINE[k] for k in ("M", "N", "K"))
    monkeypatch.setenv("DORAFP8_HOPPER_GEMM", "0")  # strategy_launches sets it: restored after the test
    launches = pr.strategy_launches("dequantize + cuBLAS")
    assert sum(lc["nbytes"] for lc in launches) >= pr.dequant_floor_bytes(M, N, K)
    assert len(launches) >= pr.DEQUANT_FLOOR_LAUNCHES
    for end in pr.ENDS:
        floor = pr.dequant_floor_seconds(M, N, K, end)
        assert pr.layer_seconds({}, launches, end)["seconds"] >= floor
        assert floor > 1.25 * pr.linear_seconds(M, N, K)
