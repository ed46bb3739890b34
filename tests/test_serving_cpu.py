"""gdngen.serving under the interpreter: state pool, decode steps, verify-then-commit, bf16 pools.

Small shapes (K, V <= 32, T <= 16). bf16 pools are checked against the bound the README documents
for the interpreter (which truncates float32 to bf16; a GPU rounds to nearest, see test_serving_gpu).
"""
import importlib

import pytest
import torch

from gdngen.runtime.tiles import override
from gdngen.selfcheck import make_inputs, poisoned_memory, reference_outputs, rel_rmse
from gdngen.serving import StatePool, commit_accepted, decode_step, verify_draft
from gdngen.spec import load_spec

TOKENS = ("q", "k", "v", "g", "beta")
# README (serving section): a bf16 pool's state error (relative RMSE against float64) for up to 1
# and up to 16 tokens with typical gates, under the interpreter, which truncates float32 to bf16
# (measured 3.7e-3 and 1.45e-2); a GPU rounds to nearest and stays below 5e-3 (test_serving_gpu).
BF16_STATE_BOUND = {1: 5e-3, 16: 2e-2}


def _module(name):
    return load_spec(f"specs/{name}.yaml"), importlib.import_module(f"generated.{name}")


def _fn(name):
    spec, module = _module(name)
    return getattr(module, spec.recurrent_function)


def _options(name):
    return {"normalize": False} if name == "linear_attn" else {}


def _gates(inputs):
    return {n: inputs[n] for n in ("g", "beta") if n in inputs}


def _tokens(inputs, start, stop):
    return {n: x[:, start:stop] for n, x in inputs.items() if n in TOKENS}


def _filled_pool(P=6, HV=2, K=16, V=16, dtype=torch.float32, seed=1):
    """A pool whose every slot holds distinct random values (so an untouched slot is recognisable)."""
    pool = StatePool(P, HV, K, V, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    pool.states.copy_(torch.randn(P, HV, K, V, generator=gen) * 0.5)
    return pool


# ---- decode == prefill ---------------------------------------------------------------------

@pytest.mark.parametrize("name", ["gated_delta_rule", "kda", "linear_attn"])
def test_decode_steps_equal_chunk_prefill(name):
    """T tokens through decode_step one at a time == the chunk function over the same T tokens.

    (tests/test_recurrent_cpu.py covers every spec without a pool; here scalar and vector decay with
    the delta rule, and the additive family, through StatePool + decode_step.)
    """
    spec, module = _module(name)
    T = 6
    inputs = make_inputs(spec, B=2, T=T, H=1, HV=2, K=16, V=16, seed=3)
    chunk = getattr(module, spec.chunk_function)
    o_pre, h_pre = chunk(**inputs, output_final_state=True, chunk_size=16, **_options(name))
    pool = StatePool(5, 2, 16, 16)
    slots = pool.allocate_many(2, inputs["initial_state"])
    index = pool.indices(slots)
    outs = [decode_step(_fn(name), pool, index, **_tokens(inputs, t, t + 1), **_options(name)) for t in range(T)]
    assert rel_rmse(torch.cat(outs, 1), o_pre) <= 1e-5
    assert rel_rmse(pool.states[slots], h_pre) <= 1e-5


def test_decode_gdn_fused_gates_against_chunk_prefill():
    """The GDN serving configuration: in-kernel gate, beta sigmoid and q/k L2 norm, GVA, 16 tokens."""
    spec, module = _module("gated_delta_rule")
    T = 16
    inputs = make_inputs(spec, B=3, T=T, H=1, HV=2, K=32, V=16, fused_gate=True, beta_logits=True, seed=4)
    opts = dict(use_gate_in_kernel=True, A_log=inputs.pop("A_log"), dt_bias=inputs.pop("dt_bias"),
                use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True)
    o_pre, h_pre = module.chunk_gated_delta_rule(**inputs, output_final_state=True, **opts)
    pool = StatePool(4, 2, 32, 16)
    slots = pool.allocate_many(3, inputs["initial_state"])
    index = pool.indices(slots)
    outs = [decode_step(module.fused_recurrent_gated_delta_rule, pool, index, **_tokens(inputs, t, t + 1), **opts)
            for t in range(T)]
    assert rel_rmse(torch.cat(outs, 1), o_pre) <= 1e-5
    assert rel_rmse(pool.states[slots], h_pre) <= 1e-5


def test_several_v_tiles_per_state():
    """V split over programs (BV=8 < V=24, the last tile partly masked) gives the same answer."""
    spec, _ = _module("gated_delta_rule")
    inputs = make_inputs(spec, B=2, T=3, H=1, HV=2, K=16, V=24, seed=5)
    o_ref, h_ref = reference_outputs(spec, inputs, output_final_state=True)
    pool = StatePool(3, 2, 16, 24)
    slots = pool.allocate_many(2, inputs["initial_state"])
    with override("gated_delta_rule", "recurrent", BV=8, num_warps=1):
        o = decode_step(_fn("gated_delta_rule"), pool, pool.indices(slots), **_tokens(inputs, 0, 3))
    assert rel_rmse(o, o_ref) <= 1e-5 and rel_rmse(pool.states[slots], h_ref) <= 1e-5


# ---- pools: padding, untouched slots, reuse ----------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_padding_and_untouched_slots_bitwise(dtype):
    spec, _ = _module("gated_delta_rule")
    pool = _filled_pool(dtype=dtype)
    pool.allocate_many(6)
    pool.states.copy_(_filled_pool(dtype=dtype).states)          # allocation zeroed them: refill
    before = pool.states.clone()
    inputs = make_inputs(spec, B=4, T=1, H=1, HV=2, K=16, V=16, h0=False, seed=6)
    slots = [4, None, 1, -1]
    with poisoned_memory():
        o = decode_step(_fn("gated_delta_rule"), pool, pool.indices(slots), **_tokens(inputs, 0, 1))
    start = before[[4, 0, 1, 0]].float()
    o_ref, h_ref = reference_outputs(spec, {**inputs, "initial_state": start}, output_final_state=True)
    tol = 1e-5 if dtype == torch.float32 else BF16_STATE_BOUND[1]
    for n, s in ((0, 4), (2, 1)):
        assert rel_rmse(o[n], o_ref[n]) <= tol
        assert rel_rmse(pool.states[s], h_ref[n]) <= tol
    for s in (0, 2, 3, 5):
        assert torch.equal(pool.states[s], before[s]), f"slot {s} touched"
    assert torch.isnan(o[1]).all() and torch.isnan(o[3]).all(), "a padding row was written"


def test_slot_outside_the_pool_is_skipped_on_the_device():
    """Unchecked slots (graph replay, trusted values): an out-of-range slot is skipped, not written."""
    spec, _ = _module("simple_gla")
    pool = _filled_pool(P=3)
    before = pool.states.clone()
    inputs = make_inputs(spec, B=2, T=1, H=1, HV=2, K=16, V=16, h0=False, seed=7)
    index = torch.tensor([7, 2], dtype=torch.int32)           # 7 >= P: never checked on the host here
    with poisoned_memory():
        o = decode_step(_fn("simple_gla"), pool.states, index, **_tokens(inputs, 0, 1))
    assert torch.isnan(o[0]).all()
    assert torch.equal(pool.states[:2], before[:2]) and not torch.equal(pool.states[2], before[2])


def test_slot_reuse_after_free_never_leaks():
    spec, _ = _module("gated_delta_rule")
    pool = StatePool(3, 2, 16, 16)
    inputs = make_inputs(spec, B=1, T=4, H=1, HV=2, K=16, V=16, h0=False, seed=8)
    first = pool.allocate()
    decode_step(_fn("gated_delta_rule"), pool, [first], **_tokens(inputs, 0, 4))
    assert pool.states[first].abs().sum() > 0
    pool.free(first)
    again = pool.allocate()
    assert again == first and torch.equal(pool.states[again], torch.zeros_like(pool.states[again]))
    # a fresh request from zeros gives exactly what a never-used pool gives
    o_reused = decode_step(_fn("gated_delta_rule"), pool, [again], **_tokens(inputs, 0, 2))
    fresh = StatePool(3, 2, 16, 16)
    o_fresh = decode_step(_fn("gated_delta_rule"), fresh, [fresh.allocate()], **_tokens(inputs, 0, 2))
    assert torch.equal(o_reused, o_fresh) and torch.equal(pool.states[again], fresh.states[0])
    # admission with a given initial state (e.g. after prefill), several at once, bf16 pool
    pool.free(again)
    h0 = torch.randn(2, 2, 16, 16)
    bf16 = StatePool(4, 2, 16, 16, dtype=torch.bfloat16)
    bf16.states.fill_(3.0)
    slots = bf16.allocate_many(2, h0)
    assert slots == [0, 1] and torch.equal(bf16.states[slots], h0.to(torch.bfloat16))
    assert (bf16.states[2:] == 3.0).all()
    bf16.free(slots)
    assert bf16.allocate_many(3) == [0, 1, 2] and (bf16.states[:3] == 0).all() and (bf16.states[3] == 3.0).all()


def test_pool_bookkeeping():
    pool = StatePool(3, 1, 16, 16)
    assert pool.allocate_many(2) == [0, 1] and pool.num_free == 1
    pool.free(0)
    assert pool.allocate() == 0
    assert pool.allocate() == 2 and pool.num_free == 0
    with pytest.raises(RuntimeError, match="free"):
        pool.allocate()
    index = pool.indices([2, None, 0])
    assert index.dtype == torch.int32 and index.tolist() == [2, -1, 0]
    out = torch.full((3,), 9, dtype=torch.int32)
    assert pool.indices([1, -1, 2], out=out) is out and out.tolist() == [1, -1, 2]
    assert "StatePool(P=3" in repr(pool)


# ---- speculative verify, then commit -------------------------------------------------------------

@pytest.mark.parametrize("name", ["gated_delta_rule", "kda", "simple_gla"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_verify_then_commit_equals_recomputing_the_accepted_prefix(name, dtype):
    """Verify 4 draft tokens for 4 sequences (one padding); accept 2, 0, 4 and 6 (> T counts as T)."""
    spec, _ = _module(name)
    T, accepted = 4, [2, 0, 0, 6]
    slots = [3, 0, None, 5]
    pool = _filled_pool(dtype=dtype, seed=9)
    pool.allocate_many(6)
    pool.states.copy_(_filled_pool(dtype=dtype, seed=9).states)
    before = pool.states.clone()
    inputs = make_inputs(spec, B=4, T=T, H=1, HV=2, K=16, V=16, h0=False, seed=10)
    index = pool.indices(slots)
    with poisoned_memory():
        o, drafts = verify_draft(_fn(name), pool, index, **_tokens(inputs, 0, T), **_options(name))
    assert torch.equal(pool.states, before), "verify wrote the pool"
    assert drafts.shape == (4, T, 2, 16, 16) and drafts.dtype == dtype
    assert torch.isnan(drafts[2].float()).all(), "the padding sequence's draft states were written"
    commit_accepted(pool, index, drafts, torch.tensor(accepted, dtype=torch.int32))

    # recompute: a fresh copy of the pool advanced by exactly the accepted tokens, one call per sequence
    recomputed = before.clone()
    for n, (slot, a) in enumerate(zip(slots, accepted)):
        a = min(a, T)
        if slot is None or a == 0:
            continue
        one = {x: inputs[x][n:n + 1, :a] for x in inputs if x in TOKENS}
        decode_step(_fn(name), recomputed, torch.tensor([slot], dtype=torch.int32), **one, **_options(name))
    assert torch.equal(pool.states, recomputed), "commit != recomputing the accepted prefix"
    for s in (1, 2, 4):
        assert torch.equal(pool.states[s], before[s])
    assert torch.equal(pool.states[0], before[0]), "accepted = 0 must leave the slot as it was"
    # and both agree with the float64 reference
    n, slot = 0, 3
    _, h_ref = reference_outputs(spec, {**{x: inputs[x][n:n + 1, :2] for x in inputs if x in TOKENS},
                                        "initial_state": before[slot:slot + 1].float()}, output_final_state=True)
    assert rel_rmse(pool.states[slot], h_ref[0]) <= (1e-5 if dtype == torch.float32 else BF16_STATE_BOUND[16])
    o_ref, _ = reference_outputs(spec, {**_tokens(inputs, 0, T), "initial_state": before[[3, 0, 0, 5]].float()})
    for n in (0, 1, 3):
        assert rel_rmse(o[n], o_ref[n]) <= (1e-5 if dtype == torch.float32 else BF16_STATE_BOUND[16])


def test_verify_varlen_with_a_caller_buffer():
    """Packed drafts of different lengths (cu_seqlens) into a persistent buffer; commit the last token each."""
    spec, _ = _module("gated_delta_rule")
    lengths = [3, 1, 2]
    inputs = make_inputs(spec, lengths=lengths, H=1, HV=2, K=16, V=16, h0=False, seed=11)
    pool = _filled_pool(P=4)
    slots = pool.allocate_many(3)
    pool.states.copy_(_filled_pool(P=4).states)
    before = pool.states.clone()
    index = pool.indices(slots)
    buffer = pool.draft_buffer(3, 4)
    o, drafts = verify_draft(_fn("gated_delta_rule"), pool, index, **_tokens(inputs, 0, 6),
                             cu_seqlens=inputs["cu_seqlens"], draft_states=buffer)
    assert drafts is buffer and torch.equal(pool.states, before)
    commit_accepted(pool, index, drafts, torch.tensor(lengths))
    _, h_ref = reference_outputs(spec, {**inputs, "initial_state": before[slots]}, output_final_state=True)
    assert rel_rmse(pool.states[slots], h_ref) <= 1e-5
    assert torch.equal(pool.states[3], before[3])


def test_float32_drafts_committed_into_a_bf16_pool():
    """Draft states kept in float32 for a bf16 pool: the commit rounds them as a decode's store would."""
    spec, _ = _module("gated_delta_rule")
    pool = StatePool(3, 2, 16, 16, dtype=torch.bfloat16)
    slots = pool.allocate_many(2, torch.randn(2, 2, 16, 16))
    index = pool.indices(slots)
    before = pool.states.clone()
    inputs = make_inputs(spec, B=2, T=3, H=1, HV=2, K=16, V=16, h0=False, seed=15)
    _, drafts = verify_draft(_fn("gated_delta_rule"), pool, index, **_tokens(inputs, 0, 3),
                             draft_states=pool.draft_buffer(2, 3, dtype=torch.float32))
    assert drafts.dtype == torch.float32
    commit_accepted(pool, index, drafts, torch.tensor([3, 2]))
    recomputed = before.clone()
    decode_step(_fn("gated_delta_rule"), recomputed, index[:1], **_tokens({x: inputs[x][:1] for x in inputs if x in TOKENS}, 0, 3))
    decode_step(_fn("gated_delta_rule"), recomputed, index[1:], **_tokens({x: inputs[x][1:] for x in inputs if x in TOKENS}, 0, 2))
    assert torch.equal(pool.states, recomputed)


def test_step_helpers_read_nothing_on_the_host(monkeypatch):
    """decode_step / verify_draft / commit_accepted never read a tensor value back (graph-safe)."""
    spec, _ = _module("gated_delta_rule")
    pool = StatePool(4, 2, 16, 16)
    index = pool.indices(pool.allocate_many(3))
    inputs = make_inputs(spec, B=3, T=2, H=1, HV=2, K=16, V=16, h0=False, seed=12)
    accepted = torch.tensor([1, 2, 0], dtype=torch.int32)

    def no_reads(*args, **kwargs):
        raise AssertionError("a tensor value was read on the host")

    for method in ("tolist", "item"):
        monkeypatch.setattr(torch.Tensor, method, no_reads)
    decode_step(_fn("gated_delta_rule"), pool, index, **_tokens(inputs, 0, 1))
    _, drafts = verify_draft(_fn("gated_delta_rule"), pool, index, **_tokens(inputs, 0, 2))
    commit_accepted(pool, index, drafts, accepted)


# ---- bf16 pool -------------------------------------------------------------------------------------

def test_bf16_pool_within_documented_bound():
    """16 decode steps with a bf16 pool: the state's error against float64 stays within the README's bound."""
    spec, _ = _module("gated_delta_rule")
    T = 16
    inputs = make_inputs(spec, B=2, T=T, H=1, HV=2, K=32, V=32, seed=13)
    pool = StatePool(2, 2, 32, 32, dtype=torch.bfloat16)
    slots = pool.allocate_many(2, inputs["initial_state"])
    index = pool.indices(slots)
    fp32 = StatePool(2, 2, 32, 32)
    fp32_index = fp32.indices(fp32.allocate_many(2, inputs["initial_state"]))
    errors = {}
    for t in range(T):
        step = _tokens(inputs, t, t + 1)
        decode_step(_fn("gated_delta_rule"), pool, index, **step)
        decode_step(_fn("gated_delta_rule"), fp32, fp32_index, **step)
        if t + 1 in BF16_STATE_BOUND:
            _, h_ref = reference_outputs(spec, {**_tokens(inputs, 0, t + 1), "initial_state": inputs["initial_state"]},
                                         output_final_state=True)
            errors[t + 1] = (rel_rmse(pool.states[slots], h_ref), rel_rmse(fp32.states, h_ref))
    for t, (bf16_error, fp32_error) in errors.items():
        assert bf16_error <= BF16_STATE_BOUND[t], (t, bf16_error)
        assert fp32_error <= 1e-5, (t, fp32_error)
        assert bf16_error > 100 * fp32_error, "the bf16 pool should round (is it really bf16?)"


# ---- bad inputs ------------------------------------------------------------------------------------

def _decode_args():
    spec, _ = _module("gated_delta_rule")
    inputs = make_inputs(spec, B=2, T=1, H=1, HV=2, K=16, V=16, h0=False, seed=14)
    pool = StatePool(3, 2, 16, 16)
    return pool, pool.indices(pool.allocate_many(2)), _tokens(inputs, 0, 1)


@pytest.mark.parametrize("make,error,match", [
    (lambda: StatePool(0, 2, 16, 16), ValueError, "num_slots"),
    (lambda: StatePool(2.0, 2, 16, 16), TypeError, "num_slots"),
    (lambda: StatePool(2, 2, 16, 16, dtype=torch.float16), TypeError, "dtype"),
    (lambda: StatePool(2, 2, 16, 16, dtype="bf16"), TypeError, "dtype"),
    (lambda: StatePool(2, 2, 16, 16).allocate(torch.zeros(2, 16, 8)), ValueError, "initial_states"),
    (lambda: StatePool(2, 2, 16, 16).free(0), ValueError, "slots"),
    (lambda: StatePool(2, 2, 16, 16).indices([0]), ValueError, "slots"),
    (lambda: StatePool(2, 2, 16, 16).draft_buffer(0, 4), ValueError, "batch"),
    (lambda: StatePool(2, 2, 16, 16).draft_buffer(2, 4, dtype=torch.float16), TypeError, "dtype"),
])
def test_pool_bad_inputs(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_pool_double_free_and_shared_slots():
    pool = StatePool(3, 1, 16, 16)
    a, b = pool.allocate_many(2)
    with pytest.raises(ValueError, match="slots"):
        pool.indices([a, a])
    with pytest.raises(TypeError, match="slots"):
        pool.indices([a, "b"])
    with pytest.raises(ValueError, match="out"):
        pool.indices([a, b], out=torch.zeros(3, dtype=torch.int32))
    pool.free(a)
    with pytest.raises(ValueError, match="slots"):
        pool.free(a)


def test_step_bad_inputs():
    pool, index, step = _decode_args()
    fn = _fn("gated_delta_rule")
    with pytest.raises(TypeError, match="pool"):
        decode_step(fn, "pool", index, **step)
    with pytest.raises(TypeError, match="state_indices"):
        decode_step(fn, pool, 3, **step)
    with pytest.raises(TypeError, match="state_indices"):
        decode_step(fn, pool.states, [0, 1], **step)
    with pytest.raises(TypeError, match="options"):
        decode_step(fn, pool, index, **step, initial_state=pool.states)
    with pytest.raises(TypeError, match="recurrent_fn"):
        decode_step(None, pool, index, **step)
    with pytest.raises(ValueError, match="state_indices"):      # the generated function's own checks still run
        decode_step(fn, pool, index[:1], **step)
    with pytest.raises(TypeError, match="initial_state"):
        decode_step(fn, pool.states.double(), index, **step)


@pytest.mark.parametrize("what,error,match", [
    ("drafts_shape", ValueError, "draft_states"),
    ("drafts_dtype", ValueError, "draft_states"),
    ("accepted_list", TypeError, "num_accepted"),
    ("accepted_shape", ValueError, "num_accepted"),
    ("accepted_float", ValueError, "num_accepted"),
    ("slots_float", ValueError, "state_indices"),
    ("pool_dtype", ValueError, "pool"),
])
def test_commit_bad_inputs(what, error, match):
    pool, index, _ = _decode_args()
    drafts = pool.draft_buffer(2, 3)
    accepted = torch.tensor([1, 2], dtype=torch.int32)
    states = pool.states
    if what == "drafts_shape":
        drafts = drafts[:, :, :1]
    elif what == "drafts_dtype":
        drafts = drafts.half()
    elif what == "accepted_list":
        accepted = [1, 2]
    elif what == "accepted_shape":
        accepted = accepted[:1]
    elif what == "accepted_float":
        accepted = accepted.float()
    elif what == "slots_float":
        index = index.float()
    elif what == "pool_dtype":
        states = states.half()
    with pytest.raises(error, match=match):
        commit_accepted(states, index, drafts, accepted)
