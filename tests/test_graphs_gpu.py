"""GPU tier: repeated calls of a generated op replayed as CUDA graphs (gdngen.runtime.graphs) give what eager
calls give, bit for bit, on fresh contents at the same addresses and while an earlier result is still held."""
import pytest
import torch

from gdngen.runtime import graphs

pytestmark = pytest.mark.gpu


def _inputs(seed, B=2, T=512, H=4, HV=8, K=128, V=128):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)
    return dict(q=randn(B, T, H, K).bfloat16(), k=torch.nn.functional.normalize(randn(B, T, H, K), dim=-1).bfloat16(),
                v=randn(B, T, HV, V).bfloat16(), g=torch.nn.functional.logsigmoid(randn(B, T, HV) + 2.0),
                beta=torch.sigmoid(randn(B, T, HV)), initial_state=randn(B, HV, K, V))


def _step(x, do, dht):
    """o, the final state and every gradient of one training step (clones: nothing of the op's is held)."""
    from generated.gated_delta_rule import chunk_gated_delta_rule
    for t in x.values():
        t.grad = None
    o, ht = chunk_gated_delta_rule(**x, output_final_state=True)
    torch.autograd.backward([o, ht], [do, dht])
    return [o.detach().clone(), ht.detach().clone()] + [t.grad.clone() for t in x.values()]


def _equal(got, want):
    for a, b in zip(got, want):
        assert torch.equal(a, b), (a - b).abs().max()


@pytest.fixture
def fresh_graphs():
    graphs.set_enabled(True)
    graphs.GRAPHS.clear()
    yield graphs.GRAPHS
    graphs.GRAPHS.clear()


def test_training_steps_replayed_equal_eager_steps_on_new_contents(fresh_graphs):
    x = {n: t.requires_grad_(True) for n, t in _inputs(0).items()}
    gen = torch.Generator(device="cuda").manual_seed(9)
    do = torch.randn(x["v"].shape, device="cuda", generator=gen).bfloat16()
    dht = torch.randn(x["initial_state"].shape, device="cuda", generator=gen)
    cache = fresh_graphs
    seeds = range(1, 6)

    def load(seed):                                   # new contents at the same addresses
        fresh = _inputs(seed)
        with torch.no_grad():
            for n, t in x.items():
                t.copy_(fresh[n])

    graphs.set_enabled(False)
    wants = []
    for seed in seeds:
        load(seed)
        wants.append(_step(x, do, dht))
    graphs.set_enabled(True)
    for seed, want in zip(seeds, wants):
        load(seed)
        for _ in range(3):
            _equal(_step(x, do, dht), want)
    assert cache.replays >= 20, (cache.captures, cache.replays, cache.eager)


def test_a_held_result_is_never_overwritten(fresh_graphs):
    from generated.gated_delta_rule import chunk_gated_delta_rule
    x = _inputs(0)
    with torch.no_grad():
        outs = [chunk_gated_delta_rule(**x, output_final_state=True) for _ in range(4)]
    assert fresh_graphs.captures >= 1            # (the cache's counters run over the process)
    first = [t.clone() for t in outs[0]]
    with torch.no_grad():
        x["v"].mul_(2)
        later = [chunk_gated_delta_rule(**x, output_final_state=True) for _ in range(3)]
    for held in outs:
        _equal(held, first)
    graphs.set_enabled(False)
    with torch.no_grad():
        want = chunk_gated_delta_rule(**x, output_final_state=True)
    for got in later:
        _equal(got, want)


def test_calls_over_the_work_bound_and_varlen_calls_stay_eager(fresh_graphs, monkeypatch):
    from generated.gated_delta_rule import chunk_gated_delta_rule
    before = (fresh_graphs.captures, fresh_graphs.replays)
    monkeypatch.setattr(graphs, "MAX_WORK", 1)
    monkeypatch.setattr(graphs, "MAX_WORK_NO_GRAD", 1)
    x = _inputs(0)
    with torch.no_grad():
        for _ in range(3):
            chunk_gated_delta_rule(**x)
    monkeypatch.setattr(graphs, "MAX_WORK", 1 << 33)
    monkeypatch.setattr(graphs, "MAX_WORK_NO_GRAD", 1 << 35)
    flat = {n: t.flatten(0, 1).unsqueeze(0) if t.dim() > 2 and n != "initial_state" else t for n, t in x.items()}
    flat["cu_seqlens"] = torch.tensor([0, 300, 1024], device="cuda", dtype=torch.int32)
    with torch.no_grad():
        for _ in range(3):
            chunk_gated_delta_rule(**flat)
    assert (fresh_graphs.captures, fresh_graphs.replays) == before


def test_a_no_grad_forward_over_the_training_bound_is_replayed(fresh_graphs, monkeypatch):
    """Between MAX_WORK and MAX_WORK_NO_GRAD a no-grad forward is replayed (bitwise the eager one's outputs) and a
    training step stays eager."""
    from generated.gated_delta_rule import chunk_gated_delta_rule
    x = _inputs(1)
    work = x["v"].numel() * x["q"].shape[-1]
    monkeypatch.setattr(graphs, "MAX_WORK", work - 1)
    monkeypatch.setattr(graphs, "MAX_WORK_NO_GRAD", work)
    c0, r0 = fresh_graphs.captures, fresh_graphs.replays         # (the counters run over the process)
    with torch.no_grad():
        outs = [[t.clone() for t in chunk_gated_delta_rule(**x, output_final_state=True)] for _ in range(3)]
    assert (fresh_graphs.captures - c0, fresh_graphs.replays - r0) == (1, 1)
    graphs.set_enabled(False)
    with torch.no_grad():
        want = chunk_gated_delta_rule(**x, output_final_state=True)
    for got in outs:
        _equal(got, want)
    graphs.set_enabled(True)
    leaves = {n: t.clone().requires_grad_(True) for n, t in x.items()}
    do, dht = torch.randn_like(x["v"]), torch.randn_like(x["initial_state"])
    for _ in range(3):
        _step(leaves, do, dht)
    assert (fresh_graphs.captures - c0, fresh_graphs.replays - r0) == (1, 1)
