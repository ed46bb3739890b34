"""The generated chunk functions as torch.library custom ops: registration, opcheck, torch.compile.

CPU tier: the forward runs under the Triton interpreter, so shapes stay tiny.
"""
import contextlib
import importlib

import pytest
import torch
import torch.nn.functional as F

from gdngen.spec import load_spec

CATALOGUE = ["delta_rule", "gated_delta_rule", "gla", "kda", "linear_attn", "simple_gla"]
OPTIONS = dict(scale=0.25, output_final_state=True, chunk_size=16, use_qk_l2norm_in_kernel=False,
               use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False)


def _module(name):
    return importlib.import_module(f"generated.{name}")


@pytest.mark.parametrize("name", CATALOGUE)
def test_chunk_op_is_registered(name):
    spec = load_spec(f"specs/{name}.yaml")
    _module(name)
    packet = getattr(torch.ops.gdngen, spec.chunk_function)
    schema = str(packet.default._schema)
    assert schema.startswith(f"gdngen::{spec.chunk_function}(Tensor q, Tensor k, Tensor v, Tensor? g, Tensor? beta")
    # o, final state, then what the backward keeps: states, T, V_new, gates
    assert schema.endswith("-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
    assert hasattr(torch.ops.gdngen, f"{spec.chunk_function}_backward")


def _op_args(name, device, *, B=1, T=20, H=2, K=16, V=16, final_state=True, h0=True, cu_seqlens=None, grad=True):
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).requires_grad_(grad)

    q, k, v = rand(B, T, H, K), F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).requires_grad_(grad), rand(B, T, H, V)
    g = beta = None
    if name == "gated_delta_rule":
        g = F.logsigmoid(torch.randn(B, T, H, generator=gen)).requires_grad_(grad)
    if name in ("gla", "kda"):          # vector decay: one log-decay per key channel
        g = (F.logsigmoid(torch.randn(B, T, H, K, generator=gen)) / 4).requires_grad_(grad)
    if name in ("gated_delta_rule", "delta_rule", "kda"):
        beta = torch.rand(B, T, H, generator=gen).requires_grad_(grad)
    if name == "simple_gla":
        g = F.logsigmoid(torch.randn(B, T, H, generator=gen)).requires_grad_(grad)
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    h0 = rand(N, H, K, V) if h0 else None
    options = dict(OPTIONS, output_final_state=final_state)
    args = (q, k, v, g, beta, h0, cu_seqlens, None, None)
    args = tuple(x.detach().to(device).requires_grad_(x.requires_grad) if x is not None and x.is_floating_point()
                 else x.to(device) if x is not None else None for x in args)
    return (*args, *options.values())


@pytest.mark.parametrize("name", ["gated_delta_rule", "simple_gla", "kda"])
@pytest.mark.parametrize("case", ["dense", "no_final_state", "varlen"])
def test_opcheck(name, case, device):
    """schema, autograd registration, fake tensor and the AOT dispatch (fwd + bwd under aot_eager)."""
    _module(name)
    kwargs = {}
    if case == "no_final_state":
        kwargs = dict(final_state=False, h0=False)
    elif case == "varlen":
        kwargs = dict(T=24, cu_seqlens=torch.tensor([0, 5, 5, 24], dtype=torch.int32))
    op = getattr(torch.ops.gdngen, f"chunk_{name}")
    torch.library.opcheck(op, _op_args(name, device, **kwargs))


def test_backward_op_shapes_no_mutation_no_alias(device):
    """The backward op on its own (no autograd of its own: first-order gradients only)."""
    _module("gated_delta_rule")
    args = _op_args("gated_delta_rule", device, grad=False)
    q, v, h0 = args[0], args[2], args[5]
    do = torch.randn_like(v)
    dht = torch.randn_like(h0)
    needs = [True, True, True, True, False, True, False, False, False]
    # No opcheck here: its checking modes cannot read the torch.func wrappers that the float64
    # replay creates inside the kernel ("Cannot access storage of TensorWrapper"). The fake kernel
    # is exercised by the torch.compile tests below (AOTAutograd traces this op with fake tensors);
    # mutation and aliasing are checked directly.
    states = tmat = values = gates = torch.empty(0, device=q.device)      # none kept: the backward recomputes them
    args = (*args[:9], states, tmat, values, gates, *args[9:])
    before = [x.clone() if isinstance(x, torch.Tensor) else x for x in (do, dht, *args)]
    grads = torch.ops.gdngen.chunk_gated_delta_rule_backward(do, dht, needs, *args)
    for x, y in zip((do, dht, *args), before):
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), "the backward op mutated an input"
    assert all(gr.data_ptr() not in {x.data_ptr() for x in (do, dht, *args) if isinstance(x, torch.Tensor)}
               for gr in grads if gr.numel() > 0), "a gradient aliases an input"
    assert [tuple(gr.shape) for gr in grads[:4]] == [tuple(x.shape) for x in args[:4]]
    assert grads[4].numel() == 0 and grads[5].shape == h0.shape and q.dtype == grads[0].dtype


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_backward_from_kept_states_equals_recompute(varlen, device):
    """The forward op's third to fifth outputs (its chunk-start states, the chunks' T and V_new, kept
    for the backward) give the same gradients as a backward that recomputes them (its own state
    pass, wy stage and wy_prep's V_new); varlen keeps the states at the shape-only bound
    chunk_state_rows, past the packed chunk count. T is kept on the T path (many value heads here:
    store_wu is off)."""
    from gdngen.runtime import chunk_state_rows
    from gdngen.runtime.tiles import override
    _module("gated_delta_rule")
    kwargs = dict(T=40, cu_seqlens=torch.tensor([0, 7, 7, 40], dtype=torch.int32)) if varlen else dict(B=2, T=37)
    args = _op_args("gated_delta_rule", device, grad=False, **kwargs)
    inputs, options = args[:9], args[9:]
    with override("gated_delta_rule", "store_wu", value=False):
        o, ht, states, tmat, values, gates = torch.ops.gdngen.chunk_gated_delta_rule(*args)
    B, T = args[0].shape[:2]
    N = B if not varlen else 3
    assert states.shape == (chunk_state_rows(B, T, 16, N if varlen else None), 2, 16, 16)
    assert tmat.shape == (B, T, 2, 16) and tmat.dtype == args[1].dtype
    assert values.shape == args[2].shape and values.dtype == args[2].dtype
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    needs = [True, True, True, True, True, True, False, False, False]
    backward = torch.ops.gdngen.chunk_gated_delta_rule_backward
    assert gates.shape == (2, B, T, 2) and gates.dtype == torch.float32
    kept = backward(do, dht, needs, *inputs, states, tmat, values, gates, *options)
    no_values = backward(do, dht, needs, *inputs, states, tmat, values[:0], gates, *options)
    states_only = backward(do, dht, needs, *inputs, states, tmat[:0], values[:0], gates[:0], *options)
    recomputed = backward(do, dht, needs, *inputs, states[:0], tmat[:0], values[:0], gates[:0], *options)
    for other in (no_values, states_only, recomputed):
        for a, b, need in zip(kept, other, needs):
            assert a.shape == b.shape and (a.numel() > 0) == need and torch.isfinite(a).all()
            if need:
                assert (a - b).abs().max() <= 1e-5 * (1 + b.abs().max()), (a - b).abs().max()


def _kept_call(device):
    """One forward op call on the T path and the backward op's arguments around what it kept."""
    from gdngen.runtime.tiles import override
    args = _op_args("gated_delta_rule", device, grad=False, B=1, T=37)
    with override("gated_delta_rule", "store_wu", value=False):
        o, ht, states, tmat, values, gates = torch.ops.gdngen.chunk_gated_delta_rule(*args)
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    needs = [True] * 6 + [False] * 3
    backward_op = torch.ops.gdngen.chunk_gated_delta_rule_backward

    def backward(states, tmat, values, kept_gates=gates):
        return backward_op(do, dht, needs, *args[:9], states, tmat, values, kept_gates, *args[9:])
    return args, o, (states, tmat, values, gates), backward


@contextlib.contextmanager
def _launches(kernel, seen):
    """Record each launch of ``kernel`` (an interpreter-path JITFunction) into ``seen``: its keywords."""
    original = kernel.run

    def record(*a, **kw):
        seen.append(kw)
        return original(*a, **kw)
    kernel.run = record
    try:
        yield
    finally:
        kernel.run = original


def test_kept_tmat_is_used_not_recomputed(device):
    """With the forward's T passed, the backward launches no wy kernel, and a T that differs from
    the forward's changes the gradients (so it is really read)."""
    module = _module("gated_delta_rule")
    _, _, (states, tmat, values, _), backward = _kept_call(device)
    launched = []
    with _launches(module._WY_KERNELS[16], launched):
        base = backward(states, tmat, values)
        assert not launched
        backward(states, tmat[:0], values)
        assert launched
    changed = backward(states, tmat * 1.01, values)
    assert any((a - b).abs().max() > 1e-6 for a, b in zip(base[:5], changed[:5]))


def test_kept_values_are_used_not_recomputed(device):
    """With the forward's V_new passed, the backward's wy_prep forms W alone (COMPUTE_VALUES off) and
    the gradients read the kept V_new: a V_new that differs from the forward's changes them."""
    from gdngen.runtime.tiles import override
    module = _module("gated_delta_rule")
    args, o, (states, tmat, values, _), backward = _kept_call(device)
    # (on CUDA a first call's compile-ahead dry run records the same launches once more)
    kept, dropped = [], []
    with _launches(module._wy_bwd_prep_kernel, kept):
        base = backward(states, tmat, values)
    with _launches(module._wy_bwd_prep_kernel, dropped):
        backward(states, tmat, values[:0])
    assert kept and dropped
    assert [kw["COMPUTE_VALUES"] for kw in kept + dropped] == [False] * len(kept) + [True] * len(dropped)
    changed = backward(states, tmat, values * 1.01)
    assert any((a - b).abs().max() > 1e-6 for a, b in zip(base[:5], changed[:5]))
    # the switch: a forward told not to keep V_new returns an empty fifth output, fake and real alike
    with override("gated_delta_rule", "store_wu", value=False), override("gated_delta_rule", "keep_values", value=False):
        dropped = torch.ops.gdngen.chunk_gated_delta_rule(*args)
        fake = module._chunk_gated_delta_rule_fake(*args)
    assert dropped[4].numel() == 0 and fake[4].numel() == 0 and torch.equal(dropped[0], o)


def test_kept_gates_are_used_not_recomputed(device):
    """With the forward's gates passed ([2, B, T, HV] float32: g_cum, then the activated beta), the
    backward launches no gates stage of its own and gives the recomputing backward's gradients
    bitwise; gates that differ from the forward's change the gradients (so they are really read)."""
    module = _module("gated_delta_rule")
    args, _, (states, tmat, values, gates), backward = _kept_call(device)
    B, T, HV = args[2].shape[:3]
    assert gates.shape == (2, B, T, HV) and gates.dtype == torch.float32
    assert module._chunk_gated_delta_rule_fake(*args)[5].shape == gates.shape
    launched = []
    with _launches(module._gates_fwd_kernel, launched):
        base = backward(states, tmat, values)
        assert not launched
        recomputed = backward(states, tmat, values, gates[:0])
        assert launched                  # (on CUDA a first call's compile-ahead dry run records it twice)
    for a, b in zip(base, recomputed):
        assert torch.equal(a, b)
    for row in range(2):                 # g_cum, then beta_act
        changed = gates.clone()
        changed[row] *= 1.01
        moved = backward(states, tmat, values, changed)
        assert any((a - b).abs().max() > 1e-6 for a, b in zip(base[:5], moved[:5])), row


def test_backward_materialises_no_state_sized_zeros(device):
    """Nothing flows into the kept states (or into o when only the final state is used): autograd
    must not zero-fill a gradient for them (one the size of the kept states: 512 MiB at
    (1, 32768, 32, 32) bf16, measured as extra peak memory on the H200), and a loss of the final
    state alone gives the same gradients as one that also touches o with weight 0."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from generated.gated_delta_rule import chunk_gated_delta_rule

    class Fills(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if any(word in str(func) for word in ("zeros", "fill", "full")) and isinstance(out, torch.Tensor):
                self.shapes.append(tuple(out.shape))
            return out

    args = _op_args("gated_delta_rule", device, B=1, T=40)
    leaves = [x for x in args[:9] if isinstance(x, torch.Tensor) and x.requires_grad]
    q, k, v, g, beta, h0 = args[:6]
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, chunk_size=16)
    with Fills() as fills:
        torch.autograd.grad(o.sum(), leaves, retain_graph=True)
    assert not [s for s in fills.shapes if len(s) == 4 and s[1:] == (2, 16, 16)], fills.shapes
    only_state = torch.autograd.grad(ht.square().sum(), leaves, retain_graph=True)
    both = torch.autograd.grad((o * 0).sum() + ht.square().sum(), leaves)
    for a, b in zip(only_state, both):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


class _TinyGDN(torch.nn.Module):
    """Linear projections -> chunk_gated_delta_rule (with the final state) -> a scalar."""

    def __init__(self, D=24, H=2, K=16, V=16):
        super().__init__()
        self.H, self.K, self.V = H, K, V
        self.q = torch.nn.Linear(D, H * K)
        self.k = torch.nn.Linear(D, H * K)
        self.v = torch.nn.Linear(D, H * V)
        self.a = torch.nn.Linear(D, H)
        self.b = torch.nn.Linear(D, H)
        self.A_log = torch.nn.Parameter(torch.zeros(H))
        self.dt_bias = torch.nn.Parameter(torch.zeros(H))

    def forward(self, x, cu_seqlens=None):
        from generated.gated_delta_rule import chunk_gated_delta_rule
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.H, self.K)
        k = self.k(x).view(B, T, self.H, self.K)
        v = self.v(x).view(B, T, self.H, self.V)
        o, ht = chunk_gated_delta_rule(
            q, k, v, self.a(x), self.b(x), output_final_state=True, cu_seqlens=cu_seqlens, chunk_size=16,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias,
            use_beta_sigmoid_in_kernel=True,
        )
        return o.sum() + (ht * ht).sum()


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_compile_fullgraph_matches_eager(varlen, device):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _TinyGDN().to(device)
    if varlen:
        x, cu_seqlens = torch.randn(1, 40, 24), torch.tensor([0, 13, 13, 40])
    else:
        x, cu_seqlens = torch.randn(2, 24, 24), None
    x = x.to(device)
    cu_seqlens = cu_seqlens.to(device) if cu_seqlens is not None else None

    loss = model(x, cu_seqlens)
    loss.backward()
    eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss_c = compiled(x, cu_seqlens)
    loss_c.backward()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(loss_c, loss, rtol=1e-5, atol=1e-5)
    for (pname, p), gr in zip(model.named_parameters(), eager):
        torch.testing.assert_close(p.grad, gr, rtol=1e-5, atol=1e-5, msg=lambda m: f"{pname}: {m}")


def test_compiled_graph_calls_the_op(device):
    """The op shows up as one node in the captured graph (the Triton launches stay inside it)."""
    torch._dynamo.reset()
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    model = _TinyGDN().to(device)
    torch.compile(model, fullgraph=True, backend=backend)(torch.randn(1, 16, 24, device=device))
    assert sum("gdngen.chunk_gated_delta_rule" in t for t in seen) == 1


def test_no_final_state_is_none(device):
    from generated.gated_delta_rule import chunk_gated_delta_rule
    q, k, v, g, beta = _op_args("gated_delta_rule", device, grad=False)[:5]
    o, ht = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=16)
    assert ht is None and o.shape == v.shape
