"""Graph replay of repeated op calls (gdngen.runtime.graphs) on CPU: when a call is captured, replayed or run
eagerly, with a stand-in backend whose "graph" reruns the call into the captured outputs."""
import warnings

import pytest
import torch

from gdngen.runtime import graphs


class _StandInGraph:
    """A "graph": the call and the outputs its capture produced (the same tensor objects: no storage use). It
    holds no argument (a CUDA graph holds addresses, not tensors): a replay gets the call's."""

    def __init__(self, fn, outputs):
        self.fn, self.outputs = fn, outputs


class _StandInBackend:
    """Captures by running the call once (its outputs become the graph's); a replay reruns the call and copies
    its results into those outputs, as a CUDA graph's kernels rewrite its own tensors."""

    def __init__(self):
        self.capture_error = None

    def handles(self, x):
        return True

    def stream_key(self, device):
        return 0

    def capturing(self):
        return False

    def capture(self, fn, args, device):
        if self.capture_error is not None:
            raise self.capture_error
        outputs = fn(*args)
        return _StandInGraph(fn, outputs), outputs

    def replay(self, graph, device, args):
        for static, new in zip(graph.outputs, graph.fn(*args)):
            if static is not None:
                static.copy_(new)


class _Call:
    """An op stand-in: o = 2 x + n (a fresh tensor per eager call), counting its eager runs."""

    def __init__(self):
        self.runs = 0

    def __call__(self, x, n, flags):
        self.runs += 1
        return (x * 2 + n, None)


@pytest.fixture
def cache(monkeypatch):
    monkeypatch.setattr(graphs, "launch_context", lambda: ("context",))
    return graphs.GraphCache(_StandInBackend())


def _run(cache, call, x, n=1.0, **kw):
    return cache.call("op", call, (x, n, [True, False]), q=x, v=x, **kw)


def test_sightings_capture_and_replay(cache):
    call, x = _Call(), torch.arange(8.0)
    first = _run(cache, call, x)
    assert (cache.eager, cache.captures, cache.replays) == (1, 0, 0)
    assert torch.equal(first[0], x * 2 + 1) and first[1] is None
    del first
    second = _run(cache, call, x)
    assert (cache.captures, cache.replays) == (1, 0)
    assert torch.equal(second[0], x * 2 + 1) and type(second) is tuple
    static = next(iter(cache._replays.values())).outputs[0]
    assert second[0] is not static and second[0].data_ptr() == static.data_ptr()     # an alias, not the graph's own
    del second
    x.add_(1)                                    # new contents at the same address: a replay reads them
    third = _run(cache, call, x)
    assert cache.replays == 1
    assert torch.equal(third[0], x * 2 + 1)


def test_an_output_still_held_makes_the_call_eager_into_fresh_tensors(cache):
    call, x = _Call(), torch.arange(8.0)
    _run(cache, call, x)
    held = _run(cache, call, x)                  # captured; its output is kept
    again = _run(cache, call, x)
    assert cache.replays == 0 and cache.eager == 2
    assert again[0].data_ptr() != held[0].data_ptr()
    view = held[0][2:]                            # a view holds the storage too
    del held, again
    assert _run(cache, call, x) and cache.replays == 0
    del view
    out = _run(cache, call, x)
    assert cache.replays == 1 and torch.equal(out[0], x * 2 + 1)


def test_an_output_saved_by_autograd_is_held_until_its_backward_ran(cache):
    class Saving(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            o, _ = _run(cache, call, x)
            ctx.save_for_backward(o)
            return o

        @staticmethod
        def backward(ctx, grad):
            (o,) = ctx.saved_tensors
            return grad * 2

    call = _Call()
    leaf = torch.arange(8.0, requires_grad=True)
    x = leaf.detach()
    Saving.apply(leaf).sum().backward()          # eager
    Saving.apply(leaf).sum().backward()          # captured
    pending = Saving.apply(leaf)                 # replayed; its context holds the output
    assert cache.replays == 1
    Saving.apply(leaf).sum().backward()          # so this one runs eagerly
    assert cache.replays == 1
    pending.sum().backward()                     # the context is freed
    del pending
    Saving.apply(leaf).sum().backward()
    assert cache.replays == 2
    assert torch.equal(leaf.grad, torch.full((8,), 2.0 * 5))
    assert torch.equal(x, torch.arange(8.0))


@pytest.mark.parametrize("change", ["address", "shape", "dtype", "scalar", "list"])
def test_any_difference_in_the_arguments_is_a_new_call(cache, change):
    call, x = _Call(), torch.arange(8.0)
    _run(cache, call, x)
    _run(cache, call, x)
    assert cache.captures == 1
    other = {"address": (torch.arange(8.0), 1.0, [True, False]), "shape": (x.view(2, 4), 1.0, [True, False]),
             "dtype": (x.double(), 1.0, [True, False]), "scalar": (x, 2.0, [True, False]),
             "list": (x, 1.0, [True, True])}[change]
    out = cache.call("op", call, other, q=other[0], v=other[0])
    assert cache.captures == 1 and cache.replays == 0
    assert torch.equal(out[0], other[0] * 2 + other[1])


def test_calls_kept_eager(cache, monkeypatch):
    call, x = _Call(), torch.arange(8.0)
    for _ in range(3):
        _run(cache, call, x, graphable=False)
    monkeypatch.setattr(graphs, "MAX_WORK", 7)                    # v.numel() * q.shape[-1] = 64
    for _ in range(3):
        _run(cache, call, x)
    monkeypatch.setattr(graphs, "MAX_WORK", 1 << 33)
    monkeypatch.setattr(graphs, "launch_context", lambda: None)   # overrides, hooks, recorders
    for _ in range(3):
        _run(cache, call, x)
    graphs.set_enabled(False)
    try:
        monkeypatch.setattr(graphs, "launch_context", lambda: ("context",))
        for _ in range(3):
            _run(cache, call, x)
    finally:
        graphs.set_enabled(True)
    assert cache.captures == 0 and cache.replays == 0 and cache.eager == 12


def test_a_no_grad_call_has_the_larger_work_bound(cache, monkeypatch):
    """A forward nothing differentiates is graphed up to MAX_WORK_NO_GRAD (its kernels are short against its host
    time), a call that keeps states for a backward only up to MAX_WORK; past its bound each stays eager."""
    assert graphs.MAX_WORK_NO_GRAD > graphs.MAX_WORK
    call, x = _Call(), torch.arange(8.0)                          # work: v.numel() * q.shape[-1] = 64
    monkeypatch.setattr(graphs, "MAX_WORK", 63)
    monkeypatch.setattr(graphs, "MAX_WORK_NO_GRAD", 64)
    for _ in range(3):
        _run(cache, call, x)
    assert (cache.eager, cache.captures, cache.replays) == (3, 0, 0)
    for _ in range(3):
        out = _run(cache, call, x, no_grad=True)
        assert torch.equal(out[0], x * 2 + 1)
        del out
    assert (cache.eager, cache.captures, cache.replays) == (4, 1, 1)
    monkeypatch.setattr(graphs, "MAX_WORK_NO_GRAD", 63)
    for _ in range(2):
        _run(cache, call, x, no_grad=True)
    assert (cache.eager, cache.captures, cache.replays) == (6, 1, 1)


def test_a_failed_capture_warns_and_keeps_that_call_eager(cache):
    call, x = _Call(), torch.arange(8.0)
    cache.backend.capture_error = RuntimeError("operation not permitted when stream is capturing")
    _run(cache, call, x)
    with pytest.warns(RuntimeWarning, match="capture failed"):
        out = _run(cache, call, x)
    assert torch.equal(out[0], x * 2 + 1)
    cache.backend.capture_error = None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run(cache, call, x)
    assert cache.captures == 0 and cache.eager == 3


def test_capacity_and_the_stop_after_too_many_evictions(cache, monkeypatch):
    monkeypatch.setattr(graphs, "CAPACITY", 2)
    monkeypatch.setattr(graphs, "MAX_EVICTIONS", 3)
    call = _Call()
    xs = [torch.full((4,), float(i)) for i in range(6)]
    for x in xs[:3]:
        _run(cache, call, x)
        _run(cache, call, x)
    assert len(cache) == 2 and cache.evictions == 1
    with pytest.warns(RuntimeWarning, match="replay stopped"):
        for x in xs[3:]:
            _run(cache, call, x)
            out = _run(cache, call, x)
            assert torch.equal(out[0], x * 2 + 1)
    assert cache.stopped and len(cache) == 0
    before = cache.captures
    _run(cache, call, xs[0])
    _run(cache, call, xs[0])
    assert cache.captures == before


def test_generated_op_steps_through_the_graph_cache(cache, monkeypatch):
    """The generated op's eager forward and backward go through replay_or_run: with the stand-in backend,
    the third training step replays both, and its output and every gradient equal the eager step's."""
    import os
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the generated kernels run on CPU under TRITON_INTERPRET=1 only")
    from gdngen.selfcheck import make_inputs
    from gdngen.spec import load_spec
    from generated import gated_delta_rule as gdr
    assert graphs.launch_context is not None
    monkeypatch.setattr(graphs, "GRAPHS", cache)
    inputs = make_inputs(load_spec("specs/gated_delta_rule.yaml"), B=1, T=24, H=1, HV=2, K=16, V=16, seed=3)
    leaves = {n: x.requires_grad_(True) for n, x in inputs.items() if isinstance(x, torch.Tensor)}
    do = torch.randn(1, 24, 2, 16, generator=torch.Generator().manual_seed(4))

    dht = torch.randn(1, 2, 16, 16, generator=torch.Generator().manual_seed(5))

    def step():
        o, ht = gdr.chunk_gated_delta_rule(**inputs, output_final_state=True, chunk_size=16)
        grads = torch.autograd.grad([o, ht], list(leaves.values()), [do, dht])
        return [o.detach().clone()] + [g.clone() for g in grads]

    eager = step()
    step()
    # the backward's arguments include the forward's outputs: the same ones from the forward's capture on
    assert (cache.captures, cache.replays) == (1, 0)
    step()
    assert (cache.captures, cache.replays) == (2, 1)
    replayed = step()
    assert (cache.captures, cache.replays) == (2, 3)
    for got, want in zip(replayed, eager):
        assert torch.equal(got, want)


def test_launch_context_reads_what_the_launches_depend_on(monkeypatch):
    from gdngen.runtime import ops
    from gdngen.runtime.tiles import override, record_stages
    monkeypatch.setattr("gdngen.runtime.launch.launches_observed", lambda: False)
    plain = graphs.launch_context()
    assert plain is not None
    with ops.keeping_states(False):
        assert graphs.launch_context() != plain
    with override("gated_delta_rule", "wy", BK=32):
        assert graphs.launch_context() is None
    with record_stages():
        assert graphs.launch_context() is None
    monkeypatch.setattr("gdngen.runtime.launch.launches_observed", lambda: True)
    assert graphs.launch_context() is None
