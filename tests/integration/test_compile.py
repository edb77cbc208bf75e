"""torch.compile(fullgraph=True) captures a converted model with no graph break: the kernels are torch custom ops
with fake (shape) implementations, and the autograd Functions are traceable."""

import pytest
import torch

pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402

import dorafp8  # noqa: E402


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_compile_fullgraph_matches_eager(dropout):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 16))
    pm = get_peft_model(net, LoraConfig(r=4, use_dora=True, target_modules=["0", "2"], lora_dropout=dropout))
    for n, p in pm.named_parameters():
        if "lora_B" in n:
            p.data.normal_()
    assert dorafp8.convert_peft_model(pm) == 2
    pm.eval()
    x = torch.randn(5, 32, requires_grad=True)
    ref = pm(x)
    ref.square().sum().backward()
    ref_grads = [p.grad.clone() for p in pm.parameters() if p.requires_grad] + [x.grad.clone()]
    pm.zero_grad()
    x.grad = None
    # aot_eager: the full dynamo + AOTAutograd capture (fake tensors through the custom ops), without a C++ build
    compiled = torch.compile(pm, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    y.square().sum().backward()
    grads = [p.grad for p in pm.parameters() if p.requires_grad] + [x.grad]
    torch.testing.assert_close(y, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


def test_compile_fullgraph_training_with_dropout():
    """Training mode with dropout also compiles into one graph (masks differ from eager's RNG stream: no parity)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 16))
    pm = get_peft_model(net, LoraConfig(r=4, use_dora=True, target_modules=["0"], lora_dropout=0.2))
    dorafp8.convert_peft_model(pm)
    pm.train()
    compiled = torch.compile(pm, fullgraph=True, backend="aot_eager")
    y = compiled(torch.randn(7, 32))
    y.sum().backward()
    assert y.shape == (7, 16) and torch.isfinite(y).all()
    assert all(p.grad is not None for p in pm.parameters() if p.requires_grad)


def test_compiled_training_step_does_not_pin_the_token_count():
    """Bucketed training (a new sequence length / image resolution per batch) must not recompile per length: the
    backward's loops live inside the custom ops, so after one recompile to a dynamic M a compiled step serves every
    token count. 10 different token counts, at most 2 compilations."""
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 16))
    pm = get_peft_model(net, LoraConfig(r=4, use_dora=True, target_modules=["0", "2"], lora_dropout=0.1))
    assert dorafp8.convert_peft_model(pm) == 2
    pm.train()
    frames = []

    def counting_backend(gm, example_inputs):
        frames.append(gm)
        from torch._dynamo.backends.common import aot_autograd
        from functorch.compile import make_boxed_func

        return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward))(gm, example_inputs)

    opt = torch.optim.SGD([p for p in pm.parameters() if p.requires_grad], lr=0.01)

    @torch.compile(backend=counting_backend, fullgraph=True)
    def step(x):
        return pm(x).square().mean()

    for tokens in (7, 9, 13, 21, 33, 40, 57, 64, 100, 129):
        loss = step(torch.randn(tokens, 32))
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert torch.isfinite(loss)
    assert 1 <= len(frames) <= 2, f"{len(frames)} compilations for 10 token counts"


@pytest.mark.parametrize("chosen, act_quant", [("triton", "rowwise"), ("cublas", None)])
def test_compile_fullgraph_backend_options(chosen, act_quant):
    """The backends' options compile into one graph with the eager values and gradients: W8A8 on the Triton backend
    (the interpreter here) takes x's quantization from the projection's custom op (project_quant, backends/base.py
    QUANT_PARAMS); the cuBLAS strategy dequantizes once (dequant, KEEP_WEIGHT_PARAMS: M here is past
    ops/_policy.py keeps_weight's threshold) and its dgrad takes the forward's W and per-row factors."""
    from dorafp8 import backends
    from dorafp8.ops._policy import keeps_weight

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    reason = backends.unavailable_reason(chosen, dev)
    if reason:
        pytest.skip(reason)
    assert backends.module("triton").QUANTS_IN_PROJECT
    torch.manual_seed(0)
    M, K, N, r = 96, 64, 48, 4
    assert keeps_weight(M, N, K)
    W = torch.randn(N, K, device=dev) * 0.05
    w8, scale = W.to(torch.float8_e4m3fn), torch.linspace(0.5, 2.0, N, device=dev)  # per row
    A = (torch.randn(r, K, device=dev) / 8).requires_grad_()
    B = (torch.randn(N, r, device=dev) / 8).requires_grad_()
    m = (W.norm(dim=1) * 1.1).requires_grad_()
    x = torch.randn(M, K, device=dev, requires_grad=True)
    leaves = (x, A, B, m)

    def f(x):
        return dorafp8.dora_fp8_linear(x, w8, scale, A, B, m, 2.0, backend=chosen, act_quant=act_quant)

    y = f(x)
    y.square().sum().backward()
    ref = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    yc = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    yc.square().sum().backward()
    torch.testing.assert_close(yc, y)
    for got, want in zip((t.grad for t in leaves), ref):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("compiled_first", [True, False])
@pytest.mark.parametrize("reentrant", [False, True])
def test_compile_fullgraph_inside_activation_checkpointing(monkeypatch, reentrant, compiled_first):
    """A DoRA layer inside torch.utils.checkpoint, compiled with fullgraph=True (OneTrainer's compiled blocks with
    gradient checkpointing; a compiled HF model with it on). torch.compile refuses a side effect inside the
    checkpointed region ("HOP: Unsafe side effect"), and the first compiled step raised on two: in a process that had
    not picked a backend yet, the pick filled the backends' caches; after an eager call (an evaluation first), the
    layer dropped the norm that call had cached. Eager's values and gradients."""
    import torch.utils.checkpoint as ckpt

    from dorafp8 import backends

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 16))
    pm = get_peft_model(net, LoraConfig(r=4, use_dora=True, target_modules=["0", "2"]))
    for n, p in pm.named_parameters():
        if "lora_B" in n:
            p.data.normal_()
    assert dorafp8.convert_peft_model(pm) == 2
    params = [p for p in pm.parameters() if p.requires_grad]

    def f(x):
        return ckpt.checkpoint(pm, x, use_reentrant=reentrant)

    monkeypatch.setattr(backends, "_loaded", {})  # a fresh process's: nothing imported or probed yet
    monkeypatch.setattr(backends, "_reasons", {})
    x = torch.randn(5, 32)
    runs = {}
    for name in ("compiled", "eager") if compiled_first else ("eager", "compiled"):
        fn = torch.compile(f, fullgraph=True, backend="aot_eager") if name == "compiled" else f
        xi = x.clone().requires_grad_()
        fn(xi).square().sum().backward()
        runs[name] = [xi.grad] + [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
    for got, want in zip(runs["compiled"], runs["eager"]):
        torch.testing.assert_close(got, want)


def test_compiled_call_follows_a_changed_dorafp8_backend(monkeypatch):
    """DORAFP8_BACKEND set between compiled calls takes effect (a recompile), as in eager: with backends.resolve
    taken as a constant whole, its read of the variable was not guarded and the first call's backend kept running."""
    from dorafp8.backends import native, reference

    ran = []
    for mod in (native, reference):
        monkeypatch.setattr(mod, "forward", lambda *a, _f=mod.forward, _n=mod.__name__, **k: (
            ran.append(_n.rsplit(".", 1)[1]), _f(*a, **k))[1])
    torch.manual_seed(0)
    N, K = 8, 16
    w8, scale = torch.randn(N, K).to(torch.float8_e4m3fn), torch.tensor(0.5)
    A, B, m = torch.randn(2, K), torch.randn(N, 2), torch.rand(N) + 0.5
    f = torch.compile(lambda x: dorafp8.dora_fp8_linear(x, w8, scale, A, B, m, 1.0), fullgraph=True, backend="eager")
    x = torch.randn(3, K)
    for name in ("native", "reference", "native"):
        monkeypatch.setenv("DORAFP8_BACKEND", name)
        ran.clear()
        f(x)
        assert ran == [name]
