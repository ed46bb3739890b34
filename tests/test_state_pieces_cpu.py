"""The forward state pass run as pieces side by side (gdngen.runtime.tiles.state_pieces), under the
Triton interpreter: every output against the float64 reference and against the unsplit pass."""
import importlib

import pytest
import torch

from gdngen.autotune.device import DeviceInfo, use_device
from gdngen.runtime import override
from gdngen.runtime.tiles import state_pieces, window_log_tolerance
from gdngen.runtime.varlen import PieceTables
from gdngen.selfcheck import call, make_inputs, poisoned_memory, reference_outputs, rel_rmse
from gdngen.spec import load_spec

H200 = DeviceInfo("NVIDIA H200", (9, 0), sm_count=132)
SPLIT_SPECS = ["gated_delta_rule", "simple_gla"]


def _run(name, inputs, pieces, chunk_size):
    spec, module = load_spec(f"specs/{name}.yaml"), importlib.import_module(f"generated.{name}")
    with override(name, "state_pieces", value=pieces), poisoned_memory():
        return call(module, spec, inputs, output_final_state=True, chunk_size=chunk_size)


def _check(name, inputs, pieces, chunk_size, tol=1e-5):
    spec = load_spec(f"specs/{name}.yaml")
    o, ht = _run(name, inputs, pieces, chunk_size)
    o_ref, ht_ref = reference_outputs(spec, inputs, output_final_state=True)
    assert rel_rmse(o, o_ref) <= tol, f"o: {rel_rmse(o, o_ref):.3e}"
    assert rel_rmse(ht, ht_ref) <= tol, f"final state: {rel_rmse(ht, ht_ref):.3e}"
    return o, ht


@pytest.mark.parametrize("name", SPLIT_SPECS)
@pytest.mark.parametrize("pieces", [2, 3, 5])
@pytest.mark.parametrize("h0", [True, False])
def test_pieces_match_the_reference_and_the_unsplit_pass(name, pieces, h0):
    # T = 200 is no multiple of the chunk: the last piece ends in a partial chunk. At fp32 the walk
    # back covers ~11 chunks of 16 tokens, so it crosses earlier pieces and, for the second piece,
    # reaches the sequence start (and its initial state).
    spec = load_spec(f"specs/{name}.yaml")
    inputs = make_inputs(spec, B=2, T=200, H=1, HV=2, K=16, V=16, seed=5, h0=h0)
    o, ht = _check(name, inputs, pieces, chunk_size=16)
    o_one, ht_one = _run(name, inputs, 1, 16)
    assert rel_rmse(o, o_one) <= 1e-6 and rel_rmse(ht, ht_one) <= 1e-6


@pytest.mark.parametrize("name", SPLIT_SPECS)
def test_without_decay_the_walk_reaches_the_sequence_start(name):
    # log-decay ~0: no chunk's transition shrinks an older state, so every walk runs back to the
    # sequence start and starts from its initial state - the pieces are then exact by construction
    spec = load_spec(f"specs/{name}.yaml")
    inputs = make_inputs(spec, B=1, T=96, H=1, HV=2, K=16, V=16, seed=6)
    inputs["g"] = torch.full_like(inputs["g"], -1e-4)
    _check(name, inputs, pieces=4, chunk_size=16)


def test_keys_longer_than_one_lengthen_the_walk():
    # beta |k|^2 > 2 gives (I - beta k k^T) norm above 1. Every key along one direction, with
    # |1 - beta |k|^2| = e^0.1 against a decay of e^-0.1 per token: the state along that direction
    # never fades, so a walk that counted the decay alone would stop after ~14 chunks and drop it;
    # counted, the growth keeps every walk going back to the sequence start.
    spec = load_spec("specs/gated_delta_rule.yaml")
    inputs = make_inputs(spec, B=1, T=512, H=1, HV=2, K=16, V=16, seed=7)
    direction = torch.nn.functional.normalize(torch.randn(16, generator=torch.Generator().manual_seed(8)), dim=0)
    beta = 0.95
    inputs["k"] = (direction * ((1 + torch.tensor(0.1).exp()) / beta) ** 0.5).expand_as(inputs["k"]).contiguous()
    inputs["beta"] = torch.full_like(inputs["beta"], beta)
    inputs["g"] = torch.full_like(inputs["g"], -0.1)
    # beta |k|^2 > 1 also leaves the chunk's (I + A) ill-conditioned (the unsplit pass is ~0.1 from
    # float64 here): the pieces must reproduce the unsplit pass, not the reference
    o, ht = _run("gated_delta_rule", inputs, 2, 16)
    o_one, ht_one = _run("gated_delta_rule", inputs, 1, 16)
    assert rel_rmse(o, o_one) <= 1e-6, f"o: {rel_rmse(o, o_one):.3e}"
    assert rel_rmse(ht, ht_one) <= 1e-6, f"final state: {rel_rmse(ht, ht_one):.3e}"


def test_piece_tables_number_chunks_as_the_unsplit_pass():
    tables = PieceTables(B=2, T=200, chunk_size=16, pieces=3, device="cpu")   # 13 chunks: pieces of 5, 5, 3
    assert tables.per_sequence == 3 and tables.count == 6
    assert tables.cu_seqlens.tolist() == [0, 80, 160, 200, 280, 360, 400]
    assert tables.chunk_offsets.tolist() == [0, 5, 10, 13, 18, 23]
    assert tables.piece_seq.tolist() == [[0, 0]] * 3 + [[200, 1]] * 3
    per_piece = torch.arange(6 * 2).view(6, 2)                   # row p: piece p's [2] values
    assert tables.first(per_piece).tolist() == [[0, 1], [6, 7]]
    assert tables.last(per_piece).tolist() == [[4, 5], [10, 11]]


def test_piece_count_fills_the_sms_only_where_programs_are_few():
    def call(N, HV, T, bv=lambda n: 64):
        return state_pieces("gated_delta_rule", N=N, HV=HV, V=128, T=T, BT=64, value_tile=bv)

    with use_device(H200):
        # (1, 32768, 32, 32), BV=64: 64 programs -> 4 pieces, two programs per SM
        assert call(1, 32, 32768) == 4
        # the tiles' BV at the pieces' sequence count counts: BV=32 below 4 sequences, 64 from there
        assert call(1, 32, 32768, bv=lambda n: 32 if n < 4 else 64) == 4
        assert call(1, 32, 32768, bv=lambda n: 32) == 2
        # (1, 32768, 2, 8): 16 pieces of 32 chunks, 256 programs
        assert call(1, 8, 32768, bv=lambda n: 32 if n < 4 else 64) == 16
        # (4, 8192, 16, 32): 256 programs already fill the SMs
        assert call(4, 32, 8192) == 1
        # short sequences: no piece shorter than 32 chunks
        assert call(1, 8, 4096) == 2
        assert call(1, 8, 2048) == 1
        # the reverse pass engages only below half the SMs
        assert state_pieces("gated_delta_rule", N=1, HV=32, V=128, T=4096, BT=64, value_tile=lambda n: 32,
                            engage_below=0.5) == 1
        assert state_pieces("gated_delta_rule", N=1, HV=8, V=128, T=32768, BT=64, value_tile=lambda n: 64,
                            engage_below=0.5) == 16
        with override("gated_delta_rule", "state_pieces", value=3):
            assert call(4, 32, 8192) == 3
    with use_device(None):
        assert call(1, 2, 4096) == 1


def test_window_tolerance_sits_below_each_dtypes_rounding():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert torch.finfo(dtype).eps / 1000 < torch.tensor(window_log_tolerance(dtype)).exp() < torch.finfo(dtype).eps / 100


def _grads(name, pieces, seed=9, **shape):
    """Output and every gradient (dh0 included) of the op, against autograd through float64."""
    from gdngen.selfcheck import gradient_errors
    with override(name, "state_pieces", value=pieces), poisoned_memory():
        return gradient_errors(name, {}, chunk_size=16, dtype=torch.float32, seed=seed, **shape)


@pytest.mark.parametrize("name", SPLIT_SPECS)
@pytest.mark.parametrize("pieces,T", [(2, 200), (3, 480)])
def test_reverse_pass_in_pieces_matches_the_reference(name, pieces, T):
    # the reverse state pass in pieces: each piece's end gradient from a walk over the chunks after it
    # (~11 chunks of 16 tokens at fp32: at T=200 every walk reaches the sequence end and its final
    # gradient, at T=480 the first piece's walk stops short of it)
    errors = _grads(name, pieces, B=2, T=T, H=1, HV=2, K=16, V=16)
    assert set(errors) >= {"o", "q", "k", "v", "g", "initial_state"}
    assert max(errors.values()) <= 1e-4, errors


@pytest.mark.parametrize("name", SPLIT_SPECS)
@pytest.mark.parametrize("pieces", [1, 3])
def test_a_forward_nothing_differentiates_writes_its_output_in_the_state_pass(name, pieces):
    """No input requires grad: the state pass computes the output itself (no output stage, no
    chunk-start states kept); with grad the op keeps them. Same outputs either way."""
    from gdngen.runtime.tiles import record_stages
    spec, module = load_spec(f"specs/{name}.yaml"), importlib.import_module(f"generated.{name}")
    inputs = make_inputs(spec, B=2, T=200, H=1, HV=2, K=16, V=16, seed=10)
    with override(name, "state_pieces", value=pieces), poisoned_memory():
        with override(name, "fused_output", value=False), record_stages() as unfused_stages:
            o_unfused, _ = call(module, spec, inputs, output_final_state=True, chunk_size=16)
        assert "output" in unfused_stages and rel_rmse(o_unfused, reference_outputs(spec, inputs)[0]) <= 1e-5
        with record_stages() as fused_stages:
            o, ht = call(module, spec, inputs, output_final_state=True, chunk_size=16)
        leaves = {n: x.clone().requires_grad_(True) if n in ("q", "k", "v") else x for n, x in inputs.items()}
        with record_stages() as kept_stages:
            o_kept, ht_kept = call(module, spec, leaves, output_final_state=True, chunk_size=16)
    assert "output" not in fused_stages and "output" in kept_stages
    # the pass that writes the output asks for its own tiles (tuned on a no-grad forward)
    assert "state_output" in fused_stages and "state" not in fused_stages and "state_output" not in kept_stages
    assert rel_rmse(o, o_kept.detach()) <= 1e-6 and torch.equal(ht, ht_kept.detach())
    o_ref, ht_ref = reference_outputs(spec, inputs, output_final_state=True)
    assert rel_rmse(o, o_ref) <= 1e-5 and rel_rmse(ht, ht_ref) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_fused_output_with_the_wy_stages_scores_matches_the_output_stage(dtype):
    """16-bit inputs: the state pass that writes the output loads the wy stage's decayed causal scores
    (rounded to the values' dtype, as the output stage rounds its own before the same dot); its
    output matches the unfused forward's to a few 16-bit roundings and the reference to the dtype's
    error, on NaN-poisoned buffers."""
    from gdngen.bf16_emulation import patch_bf16_interpreter
    name = "gated_delta_rule"
    spec, module = load_spec(f"specs/{name}.yaml"), importlib.import_module(f"generated.{name}")
    from gdngen.runtime.tiles import record_stages
    inputs = make_inputs(spec, B=1, T=96, H=1, HV=2, K=64, V=32, seed=14, dtype=dtype)
    undo = patch_bf16_interpreter()          # bf16 dots and casts as on the GPU (gdngen.bf16_emulation)
    try:
        # two key tiles in the wy stage: its Q K^T sums two products where the output stage's has one
        with override(name, "state_pieces", value=2), override(name, "wy", BK=32), poisoned_memory():
            with override(name, "fused_output", value=False):
                o_unfused, ht_unfused = call(module, spec, inputs, output_final_state=True, chunk_size=16)
            with override(name, "fused_output", value=True), record_stages() as stages:
                o, ht = call(module, spec, inputs, output_final_state=True, chunk_size=16)
    finally:
        undo()
    assert "state_output" in stages and "output" not in stages
    o_ref, ht_ref = reference_outputs(spec, inputs, output_final_state=True)
    errors = dict(fused_vs_unfused=rel_rmse(o, o_unfused), fused=rel_rmse(o, o_ref), unfused=rel_rmse(o_unfused, o_ref))
    bound = 6e-3 if dtype == torch.bfloat16 else 1e-3
    assert errors["fused_vs_unfused"] <= bound / 4, errors
    assert errors["fused"] <= bound and errors["fused"] <= errors["unfused"] * 1.1, errors
    assert torch.equal(ht, ht_unfused)                  # the same state pass


def test_the_state_pass_that_writes_the_output_is_a_tuning_stage_of_its_own():
    from gdngen.autotune import space
    from gdngen.runtime.tiles import default_tiles
    assert "state_output" in space.stages_for(load_spec("specs/gated_delta_rule.yaml"))
    assert "state_output" in space.stages_for(load_spec("specs/simple_gla.yaml"))
    for other in ("gla", "kda", "delta_rule", "linear_attn"):      # no pieces, never fused
        assert "state_output" not in space.stages_for(load_spec(f"specs/{other}.yaml"))
    sizes = dict(K=128, V=128, BT=64, N=1, HV=32, dtype=torch.bfloat16)
    # 16-bit inputs load the pass's tiles through TMA descriptors; float32 keeps pointer loads
    assert default_tiles("state_output", **sizes) == dict(default_tiles("state", **sizes), num_stages=2, TMA=True)
    assert not default_tiles("state_output", **dict(sizes, dtype=torch.float32))["TMA"]
    assert "TMA" not in default_tiles("state", **sizes)
    pruned = []
    configs = space.candidates("state_output", K=128, V=128, BT=64, dtype=torch.bfloat16,
                               default=default_tiles("state_output", **sizes), pruned=pruned)
    # the state kernel's rules hold: the whole K extent, never one pipeline stage (known bad); every
    # candidate keeps the default's TMA switch (the cache stores the tiles only: see test_autotune)
    assert configs and all(c["num_stages"] >= 2 and c["BK"] == 128 and c["TMA"] for c in configs)
    assert any("known bad" in why for config, why in pruned if config["num_stages"] == 1)


def test_the_output_is_fused_only_into_short_passes():
    from gdngen.runtime.tiles import fused_output
    assert fused_output("gated_delta_rule", B=8, T=2048, HV=16)          # host-bound: one launch fewer
    assert fused_output("gated_delta_rule", B=1, T=32768, HV=8)
    assert not fused_output("gated_delta_rule", B=1, T=32768, HV=32)     # the fused chain is slower there
    # ... unless the pass loads the wy stage's scores (the delta rule): then always
    assert fused_output("gated_delta_rule", B=1, T=32768, HV=32, scores_loaded=True)
    with override("gated_delta_rule", "fused_output", value=True):
        assert fused_output("gated_delta_rule", B=1, T=32768, HV=32)


@pytest.mark.parametrize("name", SPLIT_SPECS)
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("pieces", [1, 3])
def test_the_state_pass_through_tma_descriptors_matches_its_pointer_loads(name, fused, pieces):
    """Tile config TMA=True: the state pass loads its tiles through tensor descriptors (bounded by
    each sequence's or walk's rows, zero-filled past them, as the masks do). T = 200 ends in a
    partial chunk; every output against the pointer loads' and the reference, NaN-poisoned buffers."""
    spec, module = load_spec(f"specs/{name}.yaml"), importlib.import_module(f"generated.{name}")
    from gdngen.runtime.tiles import record_stages
    inputs = make_inputs(spec, B=2, T=200, H=1, HV=2, K=16, V=16, seed=21)
    stage = "state_output" if fused else "state"
    outputs = {}
    for tma in (False, True):
        with override(name, "state_pieces", value=pieces), override(name, "fused_output", value=fused), \
                override(name, stage, TMA=tma), poisoned_memory(), record_stages() as stages:
            outputs[tma] = call(module, spec, inputs, output_final_state=True, chunk_size=16)
        assert stage in stages
    o_ref, ht_ref = reference_outputs(spec, inputs, output_final_state=True)
    (o, ht), (o_tma, ht_tma) = outputs[False], outputs[True]
    assert torch.equal(o_tma, o) and torch.equal(ht_tma, ht)
    assert rel_rmse(o_tma, o_ref) <= 1e-5 and rel_rmse(ht_tma, ht_ref) <= 1e-5


def test_tma_is_dropped_where_descriptors_cannot_address_the_tiles(monkeypatch):
    """A config asking for TMA keeps it only for 16-byte aligned rows and bases."""
    from gdngen.runtime.tma import tma_config
    monkeypatch.setenv("TRITON_INTERPRET", "1")          # CPU tensors: the interpreter's descriptors
    x = torch.zeros(2, 64, 2, 16)
    assert tma_config({"TMA": True}, x, x, sizes=(16, 16, 16))["TMA"]
    assert not tma_config({"TMA": True}, x, x, sizes=(16, 10, 16))["TMA"]        # V = 10 floats: 40-byte rows
    assert not tma_config({"TMA": True}, x.view(-1)[1:], sizes=(16,))["TMA"]     # a base 4 bytes off
    assert tma_config({"BV": 32}, x, sizes=(10,)) == {"BV": 32}                  # no TMA asked: unchanged
