"""The fused forward state pass in Gluon (stages/state_gluon.py.j2, gdngen.runtime.gluon): which specs
render it, when a call takes it, and how many pieces it cuts a sequence into. Gluon does not run on
the CPU interpreter; its outputs are checked on the H200 (tests/test_gluon_state_gpu.py)."""
import importlib
import types

import pytest
import torch

from gdngen.autotune.device import DeviceInfo, use_device
from gdngen.plan import build_plan
from gdngen.runtime import override
from gdngen.runtime import gluon
from gdngen.runtime.tiles import state_pieces, window_log_tolerance
from gdngen.spec import load_spec

H200 = DeviceInfo("NVIDIA H200", (9, 0), sm_count=132)


def test_rendered_for_scalar_decay_delta_rule_only():
    assert build_plan(load_spec("specs/gated_delta_rule.yaml")).exprs["gluon_state"]
    for name in ("delta_rule", "simple_gla", "kda", "gla", "linear_attn"):
        assert not build_plan(load_spec(f"specs/{name}.yaml")).exprs["gluon_state"], name
    module = importlib.import_module("generated.gated_delta_rule")
    assert callable(module._state_output_gluon) and module.GLUON_STATE_STAGES == 2
    assert not hasattr(importlib.import_module("generated.delta_rule"), "_state_output_gluon")


def test_16_bit_intermediates_only(spec_variant):
    spec, module = spec_variant("gated_delta_rule", "split_gluon", intermediates="split")
    assert not build_plan(spec).exprs["gluon_state"] and not hasattr(module, "_state_output_gluon")
    spec, module = spec_variant("gated_delta_rule", "f32_gluon", intermediates="float32")
    assert not build_plan(spec).exprs["gluon_state"] and not hasattr(module, "_state_output_gluon")
    spec, module = spec_variant("gated_delta_rule", "input_gluon", intermediates="input")
    assert build_plan(spec).exprs["gluon_state"] and hasattr(module, "_state_output_gluon")
    # float32 chunk states: the Triton pass multiplies and keeps S in float32; the Gluon pass rounds it
    spec, module = spec_variant("gated_delta_rule", "f32_states_gluon", chunk_states="float32")
    assert not build_plan(spec).exprs["gluon_state"] and not hasattr(module, "_state_output_gluon")


def _qkv(dtype=torch.bfloat16, K=128, V=128, T=128):
    q = torch.zeros(1, T, 2, K, dtype=dtype)
    return q, q.clone(), torch.zeros(1, T, 4, V, dtype=dtype)


@pytest.mark.parametrize("change, reason", [
    (dict(), "tensors on cpu"),
    (dict(dtype=torch.float32), "one 16-bit dtype"),
    (dict(K=64), "K=64"),
    (dict(V=256), "V=256"),
    (dict(T=100), "T=100"),
])
def test_reasons_a_call_keeps_the_triton_pass(change, reason):
    shape = dict(K=change.get("K", 128), V=change.get("V", 128), T=change.get("T", 128))
    q, k, v = _qkv(change.get("dtype", torch.bfloat16), **shape)
    why = gluon.state_pass_unusable("gated_delta_rule", q, k, v, BT=64, **shape)
    if not gluon.AVAILABLE:
        assert why == "this Triton has no Gluon Hopper module"
        return
    assert why is not None and reason in why, why
    assert not gluon.state_pass_usable("gated_delta_rule", q, k, v, BT=64, **shape)


def test_a_triton_whose_gluon_api_differs_keeps_the_triton_stages(monkeypatch):
    """The Gluon kernels are written for Triton 3.6's Gluon API (3.9 renamed the TMA and cp.async copies): on a
    Hopper GPU with another Triton every Gluon stage gives way to its Triton stage instead of failing to compile."""
    assert gluon.gluon_api_unusable((3, 6)) is None
    assert "3.6" in gluon.gluon_api_unusable((3, 9)) and "Triton 3.9" in gluon.gluon_api_unusable((3, 9))
    monkeypatch.setattr(gluon, "_is_hopper", lambda x: True)
    on_hopper = types.SimpleNamespace(is_cuda=True, device="cuda:0")
    assert gluon._device_unusable(on_hopper) == gluon.gluon_api_unusable()


def test_override_turns_it_off_and_names_the_chunk():
    q, k, v = _qkv()
    with override("gated_delta_rule", "gluon_state", value=False):
        assert gluon.state_pass_unusable("gated_delta_rule", q, k, v, K=128, V=128, BT=64, T=128) == "turned off (override)"
    if gluon.AVAILABLE:
        assert "chunk 32" in gluon.state_pass_unusable("gated_delta_rule", q, k, v, K=128, V=128, BT=32, T=128)


def test_one_program_per_sm_pieces():
    """The Gluon pass holds one program per SM (176-192 KB of shared memory) with the whole V per program."""
    def call(N, HV, T):
        return state_pieces("gated_delta_rule", N=N, HV=HV, V=128, T=T, BT=64, value_tile=lambda n: 128, per_sm=1)

    with use_device(H200):
        assert call(1, 32, 32768) == 4          # 128 programs
        assert call(1, 32, 131072) == 4
        assert call(4, 32, 8192) == 1           # 128 programs already
        assert call(8, 16, 2048) == 1
        assert call(1, 8, 32768) == 16          # 16 pieces of 32 chunks
        assert call(1, 8, 4096) == 2            # no piece shorter than 32 chunks
        # two per SM (the Triton pass's default) doubles the count where the chunks allow it
        assert state_pieces("gated_delta_rule", N=1, HV=32, V=128, T=32768, BT=64, value_tile=lambda n: 128) == 8


def test_fast_launch_takes_gluon_kernels(monkeypatch):
    """The cached launch path wraps a gluon.jit kernel as it does a triton.jit one (off under the interpreter)."""
    from gdngen.runtime import launch
    if not gluon.AVAILABLE or launch.triton_version() not in launch.VERIFIED_TRITON:
        pytest.skip("no Gluon, or an unverified Triton")
    module = importlib.import_module("generated.gated_delta_rule")
    kernel = module._state_output_gluon_kernel
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert isinstance(launch.fast(kernel), launch.FastLaunch)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert launch.fast(kernel) is kernel


def _record_launches(monkeypatch, module, kernel):
    """Replace the module's cached launcher ``kernel`` by one that records each launch as (grid, args, kwargs)."""
    calls = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs))
    monkeypatch.setattr(module, kernel, Recorder())
    return calls


@pytest.mark.parametrize("kept, compact", [(False, False), (True, False), (False, True)])
def test_pass_launch(monkeypatch, kept, compact):
    """The forward pass's launch: one program per (sequence, value head), v and o in [BT, V / 2] boxes (one per
    chain warpgroup), h's [K, V / 2] and V_new's [BT, V / 2] in a forward for a backward, the registers shared
    out between three warpgroups. T in [BT, BT] boxes, or a 1-D T (compact: the driver's compact_t) as one
    descriptor per block-row region, each over [chunks * HV * 16, 16 (i + 1)] rows in [16, BT] boxes (TMA
    zero-fills the columns past the region's)."""
    if not gluon.AVAILABLE:
        pytest.skip("no Gluon")
    module = importlib.import_module("generated.gated_delta_rule")
    calls = _record_launches(monkeypatch, module, "_state_output_gluon_fast")
    B, T, H, HV, K, V, BT = 2, 128, 2, 4, 128, 128, 64
    chunks = B * T // BT
    q = k = torch.zeros(B, T, H, K, dtype=torch.bfloat16)
    v = o = torch.zeros(B, T, HV, V, dtype=torch.bfloat16)
    if compact:
        tmat = torch.zeros(gluon.compact_t_size(chunks, HV, BT), dtype=torch.float16)
    else:
        tmat = torch.zeros(B, T, HV, BT, dtype=torch.float16)
    beta_act = g_cum = torch.zeros(B, T, HV)
    h = torch.zeros(B, T // BT, HV, K, V, dtype=torch.bfloat16) if kept else None
    values = torch.zeros_like(v) if kept else None
    module._state_output_gluon(k, q, v, tmat, o, beta_act, g_cum, None, None, None, 0.1, T, B, H, HV, K, V, BT,
                               torch.bfloat16, h=h, values=values)
    [(grid, args, kwargs)] = calls
    assert grid == (B * HV,) and kwargs["num_warps"] == 4 and kwargs["maxnreg"] == 168
    assert [args[i].block_shape for i in (2, 7)] == [[BT, V // 2], [BT, V // 2]]        # v and o boxes
    assert kwargs["COMPACT_T"] == compact and not kwargs["FUSED_T"]
    if compact:                                                                         # T's regions
        regions = [args[i] for i in (3, 4, 5, 6)]
        assert [list(d.shape) for d in regions] == [[chunks * HV * 16, 16 * (i + 1)] for i in range(4)]
        assert all(list(d.block_shape) == [16, BT] for d in regions)
        assert [d.base.data_ptr() for d in regions] == [r.data_ptr()
                                                        for r in gluon.compact_t_regions(tmat, chunks, HV, BT)]
    else:                                                                               # T's whole tiles
        assert args[3].block_shape == [BT, BT] and all(args[i] is args[7] for i in (4, 5, 6))
    assert kwargs["STORE_STATES"] == kept
    if kept:                                                                            # h and V_new boxes
        assert [args[i].block_shape for i in (8, 9)] == [[K, V // 2], [BT, V // 2]]
    # three warpgroups share 3 x 168 registers a thread: half 0's chain gets what the others leave
    assert 3 * 168 - kwargs["CHAIN_REGS"] - kwargs["SCORES_REGS"] >= kwargs["CHAIN_REGS"]


@pytest.mark.parametrize("from_t", [False, True])
def test_reverse_pass_launch(monkeypatch, from_t):
    """The reverse pass's launch: one program per (sequence, value head), dO, dvals and dh in half-value boxes
    (one per chain warpgroup), W or T whole, the registers shared out between three warpgroups as the forward
    pass's."""
    if not gluon.AVAILABLE:
        pytest.skip("no Gluon")
    module = importlib.import_module("generated.gated_delta_rule")
    calls = _record_launches(monkeypatch, module, "_state_bwd_gluon_fast")
    B, T, H, HV, K, V, BT = 2, 128, 2, 4, 128, 128, 64
    q = k = w = torch.zeros(B, T, H, K, dtype=torch.bfloat16)
    do = dvals = torch.zeros(B, T, HV, V, dtype=torch.bfloat16)
    tmat = torch.zeros(B, T, HV, BT, dtype=torch.float16) if from_t else None
    g_cum = beta = torch.zeros(B, T, HV)
    dh = torch.zeros(B * T // BT, HV, K, V, dtype=torch.bfloat16)
    module._state_bwd_gluon(q, k, None if from_t else torch.zeros(B, T, HV, K, dtype=torch.bfloat16), g_cum, do,
                            dvals, None, dh, None, None, 0.1, T, B, H, HV, K, V, BT, fused_intra=True, tmat=tmat,
                            beta=beta if from_t else None)
    [(grid, args, kwargs)] = calls
    assert grid == (B * HV,) and kwargs["num_warps"] == 4 and kwargs["maxnreg"] == 168
    assert [args[i].block_shape for i in (5, 6, 8)] == [[BT, V // 2], [BT, V // 2], [K, V // 2]]   # dO, dvals, dh
    assert args[2].block_shape == ([BT, BT] if from_t else [BT, K]) and kwargs["W_FROM_T"] == from_t
    assert 3 * 168 - kwargs["CHAIN_REGS"] - kwargs["SCORES_REGS"] >= kwargs["CHAIN_REGS"]


def test_score_dtype_constexpr():
    """The pass's scores dtype goes in as a Gluon dtype; anything but a 16-bit float is refused by name."""
    if not gluon.AVAILABLE:
        pytest.skip("no Gluon")
    assert gluon.gl_dtype(torch.float16) == gluon.gl.float16 and gluon.gl_dtype(torch.bfloat16) == gluon.gl.bfloat16
    with pytest.raises(TypeError, match="score_dtype"):
        gluon.gl_dtype(torch.float32)


def test_reverse_pass_in_gluon_switch(spec_variant, monkeypatch):
    """The backward's Gluon reverse pass is rendered for the bundled GDN spec (not for a spec without the
    forward's Gluon pass); it runs by default where the forward's pass could (a CPU tensor never qualifies),
    and ``override(spec, "gluon_state_bwd", value=False)`` keeps the Triton pass."""
    module = importlib.import_module("generated.gated_delta_rule")
    assert callable(module._state_bwd_gluon)
    assert not hasattr(importlib.import_module("generated.delta_rule"), "_state_bwd_gluon")
    x = torch.zeros(1, 64, 2, 128, dtype=torch.bfloat16)
    assert not gluon.state_bwd_usable("gated_delta_rule", x, x, x, K=128, V=128, BT=64, T=64)     # not CUDA
    asked = []
    monkeypatch.setattr(gluon, "state_pass_unusable", lambda *a, **kw: asked.append(a[0]) or None)  # "a Hopper GPU"
    assert gluon.state_bwd_usable("gated_delta_rule", x, x, x, K=128, V=128, BT=64, T=64)
    with override("gated_delta_rule", "gluon_state_bwd", value=False):
        assert not gluon.state_bwd_usable("gated_delta_rule", x, x, x, K=128, V=128, BT=64, T=64)
    assert asked == ["gated_delta_rule"]


class _Stop(Exception):
    """Raised by the stand-in for the Gluon reverse pass: the walk before it is what is checked."""


def _backward_before_the_gluon_pass(monkeypatch, count_launches, *, pieces, runs, dtype=torch.float32):
    """One training call of the bundled GDN module per ``runs`` entry, (usable, w_from_t): whether the Gluon
    reverse pass is taken (its usable check patched; the pass itself a stand-in that records what it was
    given and stops the backward: Gluon does not run on the CPU) and whether W is formed from T. Returns,
    per run, the Triton walks' (INTRA, W_FROM_T, end gradients), the intra and wy_prep stages' launch counts
    and the stand-in's keywords plus its ``dht`` (None where the Triton pass ran). The fused backward, which
    would take the pass's place, is off."""
    from gdngen.selfcheck import call, make_inputs, poisoned_memory
    name = "gated_delta_rule"
    spec, module = load_spec(f"specs/{name}.yaml"), importlib.import_module(f"generated.{name}")
    monkeypatch.setenv("GDNGEN_COMPILE_AHEAD", "0")
    record = {}

    def walked(args, kwargs):
        if kwargs.get("WINDOW"):                # the walk: the pieces' end gradients
            record["walks"].append((kwargs.get("INTRA", False), kwargs.get("W_FROM_T", False), args[8].clone()))

    def stand_in(*args, **kwargs):
        record["gluon"] = dict(kwargs, dht=args[6])
        raise _Stop
    counters = {"state": count_launches(module, "_state_bwd_fast", after=walked),
                "intra": count_launches(module, "_intra_bwd_fast"),
                "wy_prep": count_launches(module, "_wy_bwd_prep_fast")}
    monkeypatch.setattr(module, "_state_bwd_gluon", stand_in)
    # T = 480 in 16-token chunks, three pieces: the first piece's walk stops short of the sequence end
    inputs = make_inputs(spec, B=2, T=480, H=1, HV=2, K=16, V=16, seed=31, h0=True, dtype=dtype)
    leaves = {n: x.detach().clone().requires_grad_(True) for n, x in inputs.items()
              if isinstance(x, torch.Tensor) and x.is_floating_point()}
    results = []
    for usable, w_from_t in runs:
        record.update(walks=[], gluon=None)
        for counter in counters.values():
            counter.count = 0
        monkeypatch.setattr(module, "state_bwd_usable", lambda *a, **kw: usable)
        with override(name, "state_pieces", value=pieces), override(name, "gluon_w_from_t", value=w_from_t), \
                override(name, "gluon_fused_bwd", value=False), \
                poisoned_memory():
            o, ht = call(module, spec, {**inputs, **leaves}, output_final_state=True, chunk_size=16)
            cotangents = (torch.ones_like(o), torch.ones_like(ht))
            try:
                torch.autograd.grad((o, ht), list(leaves.values()), cotangents)
            except _Stop:
                pass
        assert (record["gluon"] is not None) == usable
        results.append(dict(record, walks=list(record["walks"]),
                            **{label: counter.count for label, counter in counters.items()}))
    return results


@pytest.mark.parametrize("pieces", [1, 3])
def test_gluon_pass_forms_the_intra_part_and_walks_its_pieces(monkeypatch, count_launches, pieces):
    """Where the Gluon reverse pass runs it forms the intra stage's part itself, so that stage does not run.
    In pieces the Triton path walks each piece's end gradient in a launch of its own (reading the intra
    stage's part); the Gluon pass is given the walk instead (the pieces' sequences and the tolerance, with
    the activated beta for the norm bound) and the sequences' own final gradients, and no walk is launched.
    Whole sequences (one piece) have no walk. test_gradients_with_w_formed_from_t runs the walk's meaning."""
    triton, gluon = _backward_before_the_gluon_pass(monkeypatch, count_launches, pieces=pieces,
                                                    runs=[(False, False), (True, False)])
    assert triton["intra"] == 1 and gluon["intra"] == 0
    assert gluon["gluon"]["fused_intra"] and gluon["gluon"]["tmat"] is None
    assert gluon["walks"] == []
    if pieces == 1:
        assert triton["walks"] == [] and gluon["gluon"].get("walk") is None
        return
    ((intra_read, _, ends_read),) = triton["walks"]
    assert not intra_read and not ends_read.isnan().any()
    (piece_seq, tolerance), beta = gluon["gluon"]["walk"], gluon["gluon"]["beta"]
    B, T, HV, BT = 2, 480, 2, 16
    assert piece_seq.tolist() == [[b * T, b] for b in range(B) for _ in range(3)]
    assert tolerance == window_log_tolerance(torch.float32)
    assert beta.shape == (B, T, HV) and beta.dtype == torch.float32 and ((beta > 0) & (beta < 1)).all()
    assert torch.equal(gluon["gluon"]["dht"], torch.ones(B, HV, BT, BT))   # ht's cotangent, not pieces' ends


@pytest.mark.parametrize("pieces", [1, 3])
def test_w_formed_from_t_where_asked(monkeypatch, count_launches, pieces):
    """``override(spec, "gluon_w_from_t", value=True)``: the Gluon reverse pass gets the forward's 16-bit T
    and beta instead of W, wy_prep does not run, and in pieces the walk forms W from T itself (W_FROM_T) with
    wy_prep's roundings: its end gradients are those of the walk that reads wy_prep's W (float16 inputs:
    the forward keeps a 16-bit T). On by default, and never for a float32 T."""
    runs = _backward_before_the_gluon_pass(monkeypatch, count_launches, pieces=pieces,
                                           runs=[(True, False), (True, True)], dtype=torch.float16)
    read, formed = runs
    assert read["wy_prep"] == 1 and formed["wy_prep"] == 0
    assert read["gluon"]["tmat"] is None
    assert (read["gluon"]["beta"] is None) == (pieces == 1)    # reading W, beta goes only to the pieces' walk
    assert formed["gluon"]["tmat"].dtype == torch.float16 and formed["gluon"]["beta"] is not None
    assert formed["gluon"]["fused_intra"]
    assert read["walks"] == formed["walks"] == []         # the Gluon pass walks its pieces itself
    assert (formed["gluon"].get("walk") is None) == (pieces == 1)
    (float32,) = _backward_before_the_gluon_pass(monkeypatch, count_launches, pieces=pieces, runs=[(True, True)])
    assert float32["wy_prep"] == 1 and float32["gluon"]["tmat"] is None     # a float32 T: wy_prep forms W
    assert gluon.w_from_t_enabled("gated_delta_rule")
    with override("gated_delta_rule", "gluon_w_from_t", value=False):
        assert not gluon.w_from_t_enabled("gated_delta_rule")


def test_fused_backward_takes_kept_sixteen_bit_states_t_and_values():
    """gdngen.runtime.gluon.fused_bwd_takes, which both the driver and the choice of time segments ask: the
    forward's chunk-start states in k's dtype, its 16-bit T and V_new, W from T, the fused kernel on."""
    name = "gated_delta_rule"
    k = torch.zeros(1, 64, 2, 16, dtype=torch.bfloat16)
    states = torch.zeros(1, 2, 16, 16, dtype=torch.bfloat16)
    tmat = torch.zeros(1, 64, 2, 64, dtype=torch.bfloat16)
    values = torch.zeros(1, 64, 2, 16, dtype=torch.float16)       # GDN keeps V_new in float16
    assert gluon.fused_bwd_takes(name, k, states, tmat, values)
    assert not gluon.fused_bwd_takes(name, k, None, tmat, values)
    assert not gluon.fused_bwd_takes(name, k, states, None, values)
    assert not gluon.fused_bwd_takes(name, k, states, tmat, None)
    assert not gluon.fused_bwd_takes(name, k, states.float(), tmat, values)
    assert not gluon.fused_bwd_takes(name, k, states, tmat.float(), values)       # a recomputed float32 T
    assert not gluon.fused_bwd_takes(name, k, states, tmat, values.float())
    for switch in ("gluon_fused_bwd", "gluon_w_from_t"):
        with override(name, switch, value=False):
            assert not gluon.fused_bwd_takes(name, k, states, tmat, values)


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("pieces", [1, 3])
def test_gluon_forward_pass_walks_its_pieces(monkeypatch, count_launches, pieces, training):
    """In pieces the Triton forward walks each piece's start state in a launch of its own before its pass; the
    Gluon pass is given the walk instead (the pieces' sequences, the tolerance) and the sequences' own initial
    states, and no walk is launched. A forward for a backward (it keeps the states) keeps the walk launch and
    hands the pass its pieces' start states. test_gluon_pass_is_the_triton_pass (GPU) runs it against the
    Triton pass."""
    from gdngen.selfcheck import call, make_inputs
    name = "gated_delta_rule"
    spec, module = load_spec(f"specs/{name}.yaml"), importlib.import_module(f"generated.{name}")
    monkeypatch.setenv("GDNGEN_COMPILE_AHEAD", "0")
    walks = []
    count_launches(module, "_state_fwd_fast", after=lambda args, kwargs: walks.append(kwargs.get("WINDOW", False)))
    seen = {}

    def stand_in(*args, **kwargs):
        seen.update(kwargs, initial_state=args[7], final_state=args[8], cu_seqlens=args[9], N=args[12])
        raise _Stop
    monkeypatch.setattr(module, "state_pass_usable", lambda *a, **kw: True)
    monkeypatch.setattr(module, "_state_output_gluon", stand_in)
    B, T, HV, BT = 2, 480, 2, 16
    inputs = make_inputs(spec, B=B, T=T, H=1, HV=HV, K=16, V=16, seed=31, h0=True)
    if training:
        inputs = {n: x.detach().clone().requires_grad_(True) if isinstance(x, torch.Tensor) and x.is_floating_point()
                  else x for n, x in inputs.items()}
    with override(name, "state_pieces", value=pieces), pytest.raises(_Stop):
        call(module, spec, inputs, output_final_state=True, chunk_size=BT)
    if training and pieces > 1:
        assert walks == [True] and seen.get("walk") is None and seen["h"] is not None
        assert seen["initial_state"].shape == (B * pieces, HV, 16, 16)             # the walk's start states
        return
    assert walks == []
    assert torch.equal(seen["initial_state"], inputs["initial_state"])      # the sequences', not the pieces'
    if pieces == 1:
        assert seen.get("walk") is None and seen["cu_seqlens"] is None and seen["N"] == B
        return
    piece_seq, tolerance = seen["walk"]
    assert piece_seq.tolist() == [[b * T, b] for b in range(B) for _ in range(pieces)]
    assert tolerance == window_log_tolerance(inputs["k"].dtype)
    assert seen["N"] == B * pieces and seen["final_state"].shape == (B * pieces, HV, 16, 16)
    assert seen["cu_seqlens"].tolist() == [b * T + c * BT for b in range(B) for c in range(0, T // BT, 10)] + [B * T]


def _triton_in_the_gluon_pass_place(module):
    """A stand-in for ``_state_bwd_gluon`` that does its work with the Triton reverse pass (same arguments,
    same meaning: the intra part formed in the pass with ``fused_intra``, W formed from ``tmat`` and ``beta``
    where given, and with ``walk`` each piece's end gradient from the reverse pass over the chunks after it,
    the kernel's WINDOW, here the Triton walk's), so the backward after it runs on the CPU interpreter."""
    def reverse_pass(q, k, w, g_cum, do, dvals, dht, dh, dh0, cu_seqlens, scale, T, N, H, HV, K, V, BT,
                     fused_intra=False, tmat=None, beta=None, walk=None, wy=None):
        assert wy is None            # (the wy stage's products: the one-chain Gluon pass only, off here)
        chunk_offsets = None
        if cu_seqlens is not None:
            chunks = (cu_seqlens[1:] - cu_seqlens[:-1] + BT - 1) // BT
            chunk_offsets = torch.cat([chunks.new_zeros(1), chunks.cumsum(0)]).to(cu_seqlens.dtype)
        fixed = dict(H=H, HV=HV, K=K, V=V, BT=BT, BK=K, BV=V, IS_VARLEN=cu_seqlens is not None, DELTA=True,
                     DOT_PRECISION="ieee", INTRA=fused_intra, W_FROM_T=tmat is not None)
        if walk is not None:
            piece_seq, tolerance = walk
            ends = torch.empty(N, HV, K, V, dtype=torch.float32)
            module._state_bwd_fast[(1, N * HV)](
                q, k, w, g_cum, dvals, do, dht, dh, ends, dvals, cu_seqlens, chunk_offsets, beta, tmat,
                piece_seq, tolerance, scale, T, USE_FINAL_GRAD=dht is not None, STORE_INITIAL_GRAD=True, WINDOW=True,
                **fixed)
            dht = ends
        module._state_bwd_fast[(1, N * HV)](
            q, k, w, g_cum, dvals, do, dht, dh, dh0, dvals, cu_seqlens, chunk_offsets, beta, tmat, None, 0.,
            scale, T, USE_FINAL_GRAD=dht is not None, STORE_INITIAL_GRAD=dh0 is not None, **fixed)
    return reverse_pass


@pytest.mark.parametrize("pieces", [1, 3])
def test_gradients_with_w_formed_from_t(monkeypatch, pieces):
    """Every gradient of the backward that forms W from T in the reverse passes (no wy_prep, no W tensor:
    dW gets memory of its own, and the wy stage still adds its part of dg in a slot of its own) equals the
    one that reads wy_prep's W, with the Triton reverse pass in the Gluon pass's place (float16: the forward
    keeps a 16-bit T). Stop 37's first GPU run of gluon_w_from_t had dg wrong by 70%: the slot was gone. The
    fused backward, which would take the pass's place, is off."""
    from gdngen.selfcheck import call, make_inputs, poisoned_memory
    name = "gated_delta_rule"
    spec, module = load_spec(f"specs/{name}.yaml"), importlib.import_module(f"generated.{name}")
    monkeypatch.setenv("GDNGEN_COMPILE_AHEAD", "0")
    monkeypatch.setattr(module, "_state_bwd_gluon", _triton_in_the_gluon_pass_place(module))
    inputs = make_inputs(spec, B=2, T=480, H=1, HV=2, K=16, V=16, seed=37, h0=True, dtype=torch.float16)
    leaves = {n: x.detach().clone().requires_grad_(True) for n, x in inputs.items()
              if isinstance(x, torch.Tensor) and x.is_floating_point()}
    grads = {}
    for usable, w_from_t in [(False, False), (True, False), (True, True)]:
        monkeypatch.setattr(module, "state_bwd_usable", lambda *a, **kw: usable)
        with override(name, "state_pieces", value=pieces), override(name, "gluon_w_from_t", value=w_from_t), \
                override(name, "gluon_fused_bwd", value=False), \
                poisoned_memory():
            o, ht = call(module, spec, {**inputs, **leaves}, output_final_state=True, chunk_size=16)
            torch.manual_seed(5)
            cotangents = (torch.randn_like(o), torch.randn_like(ht))
            grads[usable, w_from_t] = dict(zip(leaves, torch.autograd.grad((o, ht), list(leaves.values()),
                                                                         cotangents)))
    triton, read, formed = grads[False, False], grads[True, False], grads[True, True]
    assert set(formed) >= {"q", "k", "v", "g", "beta", "initial_state"}
    for n in leaves:
        assert not formed[n].isnan().any(), n
        ref = read[n].double()
        scale = ref.norm()
        assert scale > 0, n
        # the stand-in's run (the intra part formed in the pass, not rounded to 16 bits first: ~4e-4 here)
        # against the plain Triton backward; W formed from T rounds as wy_prep does (equal here on the CPU)
        assert (triton[n].double() - ref).norm() <= 2e-3 * scale, (n, ((triton[n].double() - ref).norm() / scale))
        assert (formed[n].double() - ref).norm() <= 1e-4 * scale, (n, ((formed[n].double() - ref).norm() / scale))



def _assert_refused_by_name(stage, tensors, inputs, reasons):
    """``gluon.<stage>_bwd_unusable`` names each reason (plus the Gluon-wide ones: a 32-token chunk, CPU tensors)
    when ``inputs`` take that reason's change, ``..._usable`` answers no, and the stage's override turns it off."""
    unusable, usable = getattr(gluon, f"{stage}_bwd_unusable"), getattr(gluon, f"{stage}_bwd_usable")
    shape = dict(K=128, V=128, BT=64, T=128)
    reasons = dict(reasons)
    for reason, change in {"chunk 32": dict(BT=32), "tensors on cpu": dict()}.items():
        reasons[reason if gluon.AVAILABLE else "no Gluon Hopper module"] = change
    for reason, change in reasons.items():
        args = dict(inputs, **shape)
        args.update(change)
        why = unusable("gated_delta_rule", *tensors, **args)
        assert why is not None and reason in why, (reason, why)
        assert not usable("gated_delta_rule", *tensors, **args)
    with override("gated_delta_rule", f"gluon_{stage}_bwd", value=False):
        assert unusable("gated_delta_rule", *tensors, **inputs, **shape) == "turned off (override)"


@pytest.mark.skipif(not gluon.AVAILABLE, reason="no Gluon Hopper module in this Triton")
@pytest.mark.parametrize("H, HV, programs_per_chunk, key_tiles", [(2, 2, 1, 2), (2, 4, 2, 1), (1, 3, 2, 1)])
def test_chunk_stage_in_gluon_key_tiles_per_program(monkeypatch, H, HV, programs_per_chunk, key_tiles):
    """With one value head per query head a Gluon chunk-stage program takes every key tile (KT = K / BK: the head's
    dO, V_new, dv and Gs loaded and dP^T formed once); with a head group one key tile, the group summed in it."""
    module = importlib.import_module("generated.gated_delta_rule")
    launches = _record_launches(monkeypatch, module, "_chunk_bwd_gluon_fast")
    B, T, K, V, BT = 2, 256, 128, 128, 64
    q, k = (torch.zeros(B, T, H, K, dtype=torch.bfloat16) for _ in range(2))
    do, values, dv = (torch.zeros(B, T, HV, V, dtype=torch.bfloat16) for _ in range(3))
    h, dh = (torch.zeros(B * T // BT, HV, K, V, dtype=torch.bfloat16) for _ in range(2))
    gs = torch.zeros(B, T, HV, BT, dtype=torch.bfloat16)
    g_cum = torch.zeros(B, T, HV)
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    dg_part = torch.zeros(3, B, T, HV)
    module._chunk_bwd_gluon(q, k, values, h, dh, g_cum, do, dv, dq, dk, gs, dg_part, B * T * HV, 1.0, B, T, H, HV,
                            K, V, BT)
    (grid, _, kwargs), = launches
    assert kwargs["KT"] == key_tiles and kwargs["BK"] * programs_per_chunk * key_tiles == K
    assert grid == (programs_per_chunk, T // BT, B * H)


@pytest.mark.skipif(not gluon.AVAILABLE, reason="no Gluon Hopper module in this Triton")
def test_chunk_stage_in_gluon_outputs_by_tma(monkeypatch):
    """dQ and dK leave the Gluon chunk stage by TMA: a contiguous, aligned gradient of q's dtype is the store's
    target itself; a strided one (a segment's view, say) gets a contiguous tile the launch writes, copied into it
    after."""
    module = importlib.import_module("generated.gated_delta_rule")
    B, T, H, HV, K, V, BT = 1, 128, 2, 2, 128, 128, 64
    q, k = (torch.zeros(B, T, H, K, dtype=torch.bfloat16) for _ in range(2))
    do, values, dv = (torch.zeros(B, T, HV, V, dtype=torch.bfloat16) for _ in range(3))
    h, dh = (torch.zeros(B * T // BT, HV, K, V, dtype=torch.bfloat16) for _ in range(2))
    gs, g_cum, dg_part = torch.zeros(B, T, HV, BT, dtype=torch.bfloat16), torch.zeros(B, T, HV), torch.zeros(3, B, T, HV)
    written = []

    class Launch:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                names = module._chunk_bwd_gluon_kernel.arg_names
                for name, fill in (("dq_desc", 1.0), ("dk_desc", 2.0)):
                    desc = args[names.index(name)]
                    written.append(desc.base)
                    desc.base.fill_(fill)         # what the kernel's TMA stores would write
            return run
    monkeypatch.setattr(module, "_chunk_bwd_gluon_fast", Launch())
    dq = torch.zeros(B, T, H, K, dtype=torch.bfloat16)
    dk_full = torch.zeros(B, T, H, 2 * K, dtype=torch.bfloat16)
    dk = dk_full[..., K:]                         # strided: staged
    module._chunk_bwd_gluon(q, k, values, h, dh, g_cum, do, dv, dq, dk, gs, dg_part, B * T * HV, 1.0, B, T, H, HV,
                            K, V, BT)
    assert written[0].data_ptr() == dq.data_ptr() and written[1].data_ptr() != dk.data_ptr()
    assert written[1].is_contiguous() and written[1].dtype == q.dtype
    assert bool((dq == 1).all()) and bool((dk == 2).all()) and bool((dk_full[..., :K] == 0).all())


def test_chunk_stage_in_gluon_rendered_and_refused_by_name():
    """The backward's chunk stage in Gluon (stages/backward_chunk_gluon.py.j2) is rendered where the Gluon state
    passes are; a call it cannot take names why and keeps the Triton stage."""
    module = importlib.import_module("generated.gated_delta_rule")
    assert callable(module._chunk_bwd_gluon) and module.chunk_bwd_usable is gluon.chunk_bwd_usable
    assert not hasattr(importlib.import_module("generated.delta_rule"), "_chunk_bwd_gluon")
    q, k, do = _qkv()
    values, h = do.to(torch.float16), torch.zeros(2, 4, 128, 128, dtype=torch.bfloat16)
    _assert_refused_by_name("chunk", (q, k, do), dict(values=values, h=h), {
        "V_new in torch.float32": dict(values=values.float()),
        "chunk states in torch.float32": dict(h=h.float()),
    })


def test_wy_stage_in_gluon_rendered_and_refused_by_name():
    """The backward's wy stage in Gluon (stages/backward_wy_gluon.py.j2) is rendered where the Gluon state passes
    are; a call it cannot take names why and keeps the Triton stage."""
    module = importlib.import_module("generated.gated_delta_rule")
    assert callable(module._wy_bwd_gluon) and module.wy_bwd_usable is gluon.wy_bwd_usable
    assert not hasattr(importlib.import_module("generated.delta_rule"), "_wy_bwd_gluon")
    _, k, v = _qkv()
    tmat, h = torch.zeros(*k.shape[:3], 64, dtype=torch.float16), torch.zeros(2, 4, 128, 128, dtype=torch.bfloat16)
    _assert_refused_by_name("wy", (k, v), dict(dvals=v, tmat=tmat, h=h), {
        "dV_new in torch.float32": dict(dvals=v.float()),
        "T kept in torch.float32": dict(tmat=tmat.float()),
        "chunk states in torch.float32": dict(h=h.float()),
    })


def test_row_descriptor_views_a_tensor_as_rows():
    """The Gluon chunk stage's host-built descriptors: contiguous x seen as [numel / columns, columns] rows."""
    if not gluon.AVAILABLE:
        pytest.skip("no Gluon")
    x = torch.zeros(2, 64, 4, 32, dtype=torch.bfloat16)
    desc = gluon.row_descriptor(x, 4 * 32, [64, 64])
    assert list(desc.shape) == [128, 128] and list(desc.strides) == [128, 1] and list(desc.block_shape) == [64, 64]
    assert desc.layout.swizzle_byte_width == 128 and desc.base is x


@pytest.mark.parametrize("pieces", [False, True])
@pytest.mark.parametrize("asked", [False, True])
def test_pieces_always_store_their_final_states(monkeypatch, pieces, asked):
    """The pass over pieces is launched with a final-state tensor even where the caller asked for none: its kernel
    compiled without the store spilled in a chain half's loop and ran 12-16% slower on an H100 (NOTES, stop 62).
    Dense sequences without a final state asked are launched without one (there the store's variant spills)."""
    module = importlib.import_module("generated.gated_delta_rule")
    seen = {}

    class Launcher:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.update(kwargs, final_state=args[13], grid=grid)
            return launch
    monkeypatch.setattr(module, "_state_output_gluon_fast", Launcher())
    N, H, HV, K, V, BT, T = 3, 1, 2, 128, 128, 64, 192
    k = torch.zeros(1, T, H, K, dtype=torch.bfloat16)
    v = torch.zeros(1, T, HV, V, dtype=torch.bfloat16)
    gates = torch.zeros(1, T, HV)
    final = torch.empty(N if pieces else 1, HV, K, V) if asked else None
    cu_seqlens = torch.tensor([0, 64, 128, 192], dtype=torch.int32) if pieces else None
    walk = (torch.zeros(N, 2, dtype=torch.int32), 0.) if pieces else None
    module._state_output_gluon(k, k.clone(), v, torch.zeros(1, T, HV, BT, dtype=torch.bfloat16), torch.empty_like(v),
                               gates, gates, None, final, cu_seqlens, 1.0, T, N if pieces else 1, H, HV, K, V, BT,
                               torch.bfloat16, walk=walk)
    if asked:
        assert seen["STORE_FINAL_STATE"] and seen["final_state"] is final
    elif pieces:
        assert seen["STORE_FINAL_STATE"]
        assert seen["final_state"].shape == (N, HV, K, V) and seen["final_state"].dtype == torch.float32
    else:
        assert not seen["STORE_FINAL_STATE"] and seen["final_state"] is None
