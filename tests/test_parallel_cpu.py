"""Context parallelism on CPU: gloo process groups of 2 and 4 ranks under the Triton interpreter.

CP == one process for outputs, final states and every gradient (q, k, v, g, beta, initial_state,
A_log, dt_bias), dense and varlen (sequences crossing one or several shard boundaries, an empty
sequence), for the delta family (through the widened op pass) and the additive family (closed-form
transfer, and the op pass). The intra-card split == no split. Each group of cases shares one spawn
(every process imports torch once) and writes its results to files the test compares.
"""
from __future__ import annotations

import contextlib
import importlib
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gdngen import parallel
from gdngen.parallel import choose_segments, context_parallel, shard_sizes, shard_tokens, split_sequence_forward
from gdngen.runtime.segments import intermediate_bytes
from gdngen.selfcheck import make_inputs, rel_rmse

TOL = 1e-5            # float32 inputs: CP and one process differ by float rounding only
CHUNK = 16
REPLICATED = ("initial_state", "A_log", "dt_bias")     # every rank passes these whole

# (spec, shape, options, transfer[, shard sizes]): shape is make_inputs keywords (lengths: a packed
# varlen batch; h0=False: no initial state); options go to the op (output_final_state defaults to
# True here); shards are equal unless sizes are given.
CASES_2 = [
    ("gated_delta_rule", dict(B=2, T=64, lengths=None), {}, "auto", [40, 24]),         # auto: pipeline
    ("gated_delta_rule", dict(B=2, T=64, lengths=None), {}, "op", [40, 24]),
    ("gated_delta_rule", dict(lengths=[20, 50, 7, 19]), {}, "auto", [64, 32]),
    ("gated_delta_rule", dict(lengths=[20, 50, 7, 19]), {}, "op", [64, 32]),
    ("gated_delta_rule", dict(B=1, T=48, lengths=None, fused_gate=True, beta_logits=True),
     dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
          allow_neg_eigval=True), "auto"),
    ("delta_rule", dict(lengths=[64, 32], h0=False), {}, "pipeline", [64, 32]),        # ends at the boundary
    ("simple_gla", dict(lengths=[40, 9, 31, 16]), {}, "pipeline"),
    # striped: 3 pieces per rank, 6 in all; dense with initial states, and varlen across pieces
    ("gated_delta_rule", dict(B=2, T=96, lengths=None), {}, "auto", 3),
    ("gated_delta_rule", dict(lengths=[20, 50, 7, 0, 19]), {}, "pipeline", 3),
    # each rank's piece as consecutive calls (memory): a contiguous 48-token shard as 3, 4 striped
    # pieces of 32 tokens as 2 each
    ("gated_delta_rule", dict(B=1, T=96, lengths=None), {}, "pipeline", {"pieces": 1, "split": 3}),
    ("gated_delta_rule", dict(B=1, T=128, lengths=None), {}, "pipeline", {"pieces": 2, "split": 2}),
    ("simple_gla", dict(lengths=[40, 9, 31, 16]), {}, "auto"),
    ("kda", dict(lengths=[30, 34]), {}, "auto"),
    ("gla", dict(B=1, T=64, lengths=None), {}, "auto"),
]
# 4 ranks of 12 tokens: the 35-token sequence crosses three boundaries; one sequence is empty
CASES_4 = [
    ("gated_delta_rule", dict(lengths=[3, 35, 0, 10]), {}, "auto"),
    ("gated_delta_rule", dict(lengths=[3, 35, 0, 10]), {}, "pipeline"),
    ("gated_delta_rule", dict(B=2, T=48, lengths=None), {}, "pipeline"),
    ("gated_delta_rule", dict(lengths=[3, 35, 0, 10]), {}, "pipeline", 2),
    ("simple_gla", dict(B=2, T=32, lengths=None, h0=False), dict(output_final_state=False), "auto"),
]


def _chunk_fn(name):
    return getattr(importlib.import_module(f"generated.{name}"), f"chunk_{name}")


def _case_inputs(case):
    """Full-sequence float32 inputs and the loss weights (same on every process)."""
    name, shape = case[:2]
    spec = importlib.import_module(f"generated.{name}").SPEC
    x = make_inputs(spec, H=1, HV=2, K=16, V=16, seed=7, **shape)       # HV = 2 H: grouped value heads
    N = x["q"].shape[0] if x["cu_seqlens"] is None else x["cu_seqlens"].numel() - 1
    gen = torch.Generator().manual_seed(3)
    weights = (torch.randn(x["v"].shape, generator=gen), torch.randn(N, 2, 16, 16, generator=gen))
    return x, weights


def _options(case):
    """The op's keywords for a case: its options, output_final_state (default True), chunk size."""
    return {"output_final_state": True, "chunk_size": CHUNK, **case[2]}


def _leaves(x):
    return {k: (v.clone().requires_grad_() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
            for k, v in x.items()}


def _grads(leaves):
    return {k: v.grad for k, v in leaves.items() if isinstance(v, torch.Tensor) and v.requires_grad}


def _single(case):
    """One process: (o, final_state, grads) of loss = <w_o, o> + <w_f, final_state>."""
    x, (w_o, w_f) = _case_inputs(case)
    leaves = _leaves(x)
    o, final = _chunk_fn(case[0])(**leaves, **_options(case))
    loss = (o * w_o).sum()
    if final is not None:
        loss = loss + (final * w_f).sum()
    loss.backward()
    return o.detach(), final, _grads(leaves)


def _layout(case):
    """shard_tokens keywords of a case: shard sizes (a list), pieces per rank (an int, or a dict's
    "pieces"), or equal shards."""
    shards = case[4] if len(case) > 4 else None
    if isinstance(shards, dict):
        return {"pieces": shards["pieces"]}
    return {"pieces": shards} if isinstance(shards, int) else {"sizes": shards}


@contextlib.contextmanager
def _split(case):
    """A dict case's "split": the pipeline's per-call byte budget set so that each piece runs as
    that many consecutive calls handing the state over in memory."""
    shards = case[4] if len(case) > 4 else None
    if not (isinstance(shards, dict) and shards.get("split")):
        yield
        return
    from gdngen.parallel import distributed
    x, _ = _case_inputs(case)
    B, T, H = x["q"].shape[:3]
    world, pieces = dist.get_world_size(), shards["pieces"]
    need = intermediate_bytes(B=B, T=T // (world * pieces), HV=x["v"].shape[2], K=16, V=16, BT=CHUNK,
                              itemsize=x["q"].element_size())
    saved = distributed.PIPELINE_CALL_BYTES
    distributed.PIPELINE_CALL_BYTES = -(-need // shards["split"])
    try:
        yield
    finally:
        distributed.PIPELINE_CALL_BYTES = saved


def _unshard(parts, world, pieces):
    """The full-length tensor from every rank's part (dim 1), contiguous or striped."""
    if pieces == 1:
        return torch.cat(parts, dim=1)
    cut = [part.chunk(pieces, dim=1) for part in parts]
    return torch.cat([cut[r][j] for j in range(pieces) for r in range(world)], dim=1)


def _sharded(case, rank, world):
    """This rank's part of the same loss through context_parallel (the final-state term on rank 0 only)."""
    x, (w_o, w_f) = _case_inputs(case)
    layout = _layout(case)
    x = {k: (shard_tokens(v, **layout) if k in ("q", "k", "v", "g", "beta") else v) for k, v in x.items()}
    leaves = _leaves(x)
    with _split(case):
        o, final = context_parallel(_chunk_fn(case[0]), **leaves, transfer=case[3], pieces=layout.get("pieces", 1),
                                    **_options(case))
    loss = (o * shard_tokens(w_o, **layout)).sum()
    if rank == 0 and final is not None:
        loss = loss + (final * w_f).sum()
    loss.backward()
    return o.detach(), final if final is None else final.detach(), _grads(leaves)


def _worker(rank, world, store, cases, out_dir):
    from gdngen.parallel.pipeline import JOIN_COPIES
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        for i, case in enumerate(cases):
            torch.save(_sharded(case, rank, world), os.path.join(out_dir, f"case{i}_rank{rank}.pt"))
        if any(JOIN_COPIES.values()):      # striped B=1 pieces write into the rank's tensors in place
            raise AssertionError(f"pieces joined by copies: {JOIN_COPIES}")
        if world == 2:
            _worker_checks(rank)
        torch.save("done", os.path.join(out_dir, f"checks_rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _worker_checks(rank):
    """Inference (no graph kept), bad arguments and the byte counter, inside a live 2-rank group."""
    x, _ = _case_inputs(("gated_delta_rule", dict(lengths=[20, 50, 7, 19])))
    fn = _chunk_fn("gated_delta_rule")
    shards = {k: (v.chunk(2, dim=1)[rank] if k in ("q", "k", "v", "g", "beta") else v) for k, v in x.items()}
    o_ref, final_ref = fn(**x, output_final_state=True, chunk_size=CHUNK)
    # both schemes: all_gathers of the shard lengths (int64) from each of 2 ranks, one all_reduce of
    # the final states [N, HV, K, V]; widened: an all_gather of [1, HV, K, V + K] float32 from each
    # rank; pipeline: rank 0 sends the crossing sequence's [1, HV, K, V] float32 state
    common = 2 * 8 + 4 * 2 * 16 * 16 * 4
    for transfer, expected in (("op", common + 2 * 2 * 16 * 32 * 4),
                               ("pipeline", common + (2 * 16 * 16 * 4 if rank == 0 else 0))):
        parallel.COMM_BYTES["forward"] = 0
        with torch.no_grad():
            o, final = context_parallel(fn, **shards, output_final_state=True, chunk_size=CHUNK, transfer=transfer)
        if parallel.COMM_BYTES["forward"] != expected or o.requires_grad:
            raise AssertionError(f"{transfer}: bytes {parallel.COMM_BYTES['forward']} != {expected}")
        if rel_rmse(o, o_ref.chunk(2, dim=1)[rank]) > TOL or rel_rmse(final, final_ref) > TOL:
            raise AssertionError(f"{transfer}: inference call differs from one process")
    _check_cp_kernel_path(rank)
    for kwargs in (dict(transfer="op", pieces=2), dict(pieces=0), dict(transfer="pipeline", pieces=5)):
        try:        # striped shards only through the pipeline; 48 tokens per rank do not make 5 pieces
            context_parallel(fn, **shards, chunk_size=CHUNK, **kwargs)
        except ValueError as exc:
            if "pieces" not in str(exc):
                raise
        else:
            raise AssertionError(f"{kwargs} was accepted")
    bad = dict(shards, cu_seqlens=torch.tensor([0, 20, 40], dtype=torch.int32))   # ends at 40, not 96
    try:
        context_parallel(fn, **bad)
    except ValueError as exc:
        if "cu_seqlens" not in str(exc):
            raise
    else:
        raise AssertionError("mismatched cu_seqlens was accepted")


def _check_cp_kernel_path(rank):
    """Every rank's op calls take the 1-process call's kernel path (tiles.store_wu by N * HV): 4 packed
    sequences x HV=8 take the T path, while a shard's 1 to 3 local sequences alone would take W/U
    (the paths round bf16 differently: 2.66e-3 apart at (1,32768,2,8) on the H200). Both schemes.
    delta_rule: the bundled GDN spec's float16 intermediates always take the T path."""
    import generated.delta_rule as gdn
    from gdngen.runtime.tiles import store_wu
    x = make_inputs(gdn.SPEC, H=2, HV=8, K=16, V=16, seed=4, lengths=[20, 50, 7, 19])
    shards = {k: (v.chunk(2, dim=1)[rank] if k in ("q", "k", "v", "g", "beta") else v) for k, v in x.items()}
    o_ref, final_ref = gdn.chunk_delta_rule(**x, output_final_state=True, chunk_size=CHUNK)
    expected = store_wu("delta_rule", N=4, HV=8)
    for transfer in ("op", "pipeline"):
        seen = []

        def spy(spec_name, **kwargs):
            seen.append((kwargs["N"], store_wu(spec_name, **kwargs)))
            return seen[-1][1]
        real, gdn.store_wu = gdn.store_wu, spy
        try:
            with torch.no_grad():
                o, final = context_parallel(gdn.chunk_delta_rule, **shards, output_final_state=True,
                                            chunk_size=CHUNK, transfer=transfer)
        finally:
            gdn.store_wu = real
        local_N = {N for N, _ in seen}
        if expected or not seen or any(d != expected for _, d in seen) or not local_N & {1, 2, 3}:
            raise AssertionError(f"rank {rank} {transfer}: store_wu decisions {seen}, the 1-process call's: {expected}")
        if rel_rmse(o, o_ref.chunk(2, dim=1)[rank]) > TOL or rel_rmse(final, final_ref) > TOL:
            raise AssertionError(f"{transfer}: HV=8 varlen call differs from one process")


def _run_group(tmp_path, world, cases):
    out_dir = str(tmp_path)
    workers = mp.spawn(_worker, args=(world, str(tmp_path / "store"), cases, out_dir), nprocs=world, join=False)
    expected = [_single(case) for case in cases]         # while the ranks run
    workers.join()
    for i, case in enumerate(cases):
        o_ref, final_ref, grads_ref = expected[i]
        results = [torch.load(os.path.join(out_dir, f"case{i}_rank{r}.pt")) for r in range(world)]
        label = f"{case[0]} {case[1]} {case[3]} {_layout(case)}"
        pieces = _layout(case).get("pieces") or 1
        o = _unshard([r[0] for r in results], world, pieces)
        assert rel_rmse(o, o_ref) <= TOL, (label, "o", rel_rmse(o, o_ref))
        for r, result in enumerate(results):     # the same final states on every rank
            if final_ref is None:
                assert result[1] is None, label
            else:
                assert rel_rmse(result[1], final_ref) <= TOL, (label, "final_state", r, rel_rmse(result[1], final_ref))
        assert set(results[0][2]) == set(grads_ref), (label, set(results[0][2]), set(grads_ref))
        for name, ref in grads_ref.items():
            parts = [r[2][name] for r in results]
            got = sum(parts) if name in REPLICATED else _unshard(parts, world, pieces)
            assert rel_rmse(got, ref) <= TOL, (label, "d" + name, rel_rmse(got, ref))
    for r in range(world):
        assert os.path.exists(os.path.join(out_dir, f"checks_rank{r}.pt"))


def test_context_parallel_2_ranks(tmp_path):
    """Dense with initial states, varlen across the boundary, fused gates; GDN, simple_gla, kda, gla."""
    _run_group(tmp_path, 2, CASES_2)


def test_context_parallel_4_ranks(tmp_path):
    """A sequence crossing three shard boundaries, an empty sequence (GDN); simple_gla over 4 ranks."""
    _run_group(tmp_path, 4, CASES_4)


@pytest.mark.parametrize("name, lengths, transfer", [
    ("gated_delta_rule", [20, 50, 7, 19], "auto"),
    ("gla", None, "auto"),
    ("simple_gla", [30, 0, 66], "op"),
])
def test_split_sequence_matches_unsplit(name, lengths, transfer):
    """Intra-card split into segments == the plain call: outputs, final states, every gradient."""
    x, (w_o, w_f) = _case_inputs((name, dict(B=2, T=64, lengths=lengths), {}, transfer))
    results = []
    for segments in (1, 4):          # 4 pieces of a 64-token sequence: the scan composes M
        leaves = _leaves(x)
        o, final = split_sequence_forward(_chunk_fn(name), **leaves, output_final_state=True, chunk_size=CHUNK,
                                          segments=segments, transfer=transfer)
        ((o * w_o).sum() + (final * w_f).sum()).backward()
        results.append((o.detach(), final.detach(), _grads(leaves)))
    (o_ref, final_ref, grads_ref), (o, final, grads) = results
    assert rel_rmse(o, o_ref) <= TOL and rel_rmse(final, final_ref) <= TOL
    for key, ref in grads_ref.items():
        assert rel_rmse(grads[key], ref) <= TOL, (key, rel_rmse(grads[key], ref))


def test_shard_sizes():
    assert shard_sizes(96, 4) == [24, 24, 24, 24]
    assert shard_sizes(262144, 2) == [131072, 131072]
    sizes = shard_sizes(262144, 2, first_weight=1.6)
    assert sum(sizes) == 262144 and sizes[0] % 64 == 0 and abs(sizes[0] / sizes[1] - 1.6) < 0.01
    assert sum(shard_sizes(1000, 3, first_weight=2.0)) == 1000
    with pytest.raises(ValueError, match="first_weight"):
        shard_sizes(100, 2, first_weight=0)


@pytest.mark.parametrize("lengths", [None, [300, 212]])
def test_split_takes_the_unsplit_calls_kernel_path(monkeypatch, lengths):
    """The op picks W/U-in-memory or the T path by N * HV (tiles.store_wu) and the two round bf16
    differently (2.66e-3 apart at (1,32768,2,8) on the H200). The split runs each sequence as a
    batch of pieces (N = 4 here: N * HV = 32, the T path) but must take the path of the unsplit call
    (N = 1 or 2, HV = 8: W/U), or its bf16 outputs differ from that call's by the paths' difference.
    delta_rule: the bundled GDN spec's float16 intermediates always take the T path."""
    import generated.delta_rule as gdn
    from gdngen.runtime.tiles import override, store_wu
    seen = []

    def spy(spec_name, **kwargs):
        decided = store_wu(spec_name, **kwargs)
        seen.append((kwargs["N"], decided))
        return decided
    monkeypatch.setattr(gdn, "store_wu", spy)
    x = make_inputs(gdn.SPEC, B=1, T=512, H=2, HV=8, K=16, V=16, seed=2, lengths=lengths)
    o, final = split_sequence_forward(gdn.chunk_delta_rule, **x, output_final_state=True, chunk_size=64,
                                      segments=4 if lengths is None else 2)
    unsplit_N = 1 if lengths is None else 2
    assert seen and all(decided == store_wu("delta_rule", N=unsplit_N, HV=8) for _, decided in seen), seen
    assert [N for N, _ in seen] == [4] and store_wu("delta_rule", N=4, HV=8) is False
    with override("delta_rule", "store_wu", value=False):      # an explicit choice stands
        seen.clear()
        split_sequence_forward(gdn.chunk_delta_rule, **x, segments=4, chunk_size=64)
        assert [d for _, d in seen] == [False]
    o_ref, final_ref = gdn.chunk_delta_rule(**x, output_final_state=True, chunk_size=64)
    assert rel_rmse(o, o_ref) <= TOL and rel_rmse(final, final_ref) <= TOL


def test_decide_as_for_pins_the_batch_size_only():
    from gdngen.runtime.tiles import decide_as_for, override, store_wu
    with decide_as_for("gated_delta_rule", N=1):
        assert store_wu("gated_delta_rule", N=64, HV=8) is True            # as for N = 1: N * HV = 8
        assert store_wu("delta_rule", N=64, HV=8) is False                 # other specs: their own N
    with decide_as_for("kda", N=1):
        assert store_wu("kda", N=64, HV=8, per_channel=True) is False      # per-channel decay: always T
    with override("gated_delta_rule", "store_wu", value=False), decide_as_for("gated_delta_rule", N=1):
        assert store_wu("gated_delta_rule", N=1, HV=8) is False            # an explicit choice stands
    assert store_wu("gated_delta_rule", N=64, HV=8) is False               # nothing left behind


def test_split_arguments():
    x, _ = _case_inputs(("simple_gla", dict(B=1, T=32, lengths=None), {}, "auto"))
    fn = _chunk_fn("simple_gla")
    assert choose_segments(fn, **x) == 1                      # untuned (CPU: no cache): no split
    with pytest.raises(ValueError, match="segments"):
        split_sequence_forward(fn, **x, segments=0)
    with pytest.raises(ValueError, match="transfer"):
        split_sequence_forward(fn, **x, transfer="scan")
    with pytest.raises(ValueError, match="transfer"):
        split_sequence_forward(_chunk_fn("delta_rule"), **_case_inputs(
            ("delta_rule", dict(B=1, T=32, lengths=None), {}, "auto"))[0], segments=2, transfer="closed_form")
    with pytest.raises(TypeError, match="fn"):
        split_sequence_forward(lambda q, k, v: None, **x)
    with pytest.raises(ValueError, match="group"):
        context_parallel(fn, **x)          # no process group in the test process


def test_piece_plan():
    """Striped pieces in sequence order, split into consecutive calls on chunk multiples; only a
    call's neighbours on the same rank hand over in memory."""
    from gdngen.parallel.pipeline import piece_plan
    # rank 1 of 2, 2 pieces per rank of a 256-token sequence (4 pieces of 64): pieces 1 and 3
    plan = piece_plan(1, 128, 1, 2, 2, True, None, [0, 128, 256], split=lambda n: 2, multiple=16)
    assert [(c.lo, c.hi) for c in plan] == [(0, 32), (32, 64), (64, 96), (96, 128)]
    assert [(c.prev_local, c.next_local) for c in plan] == [(False, True), (True, False)] * 2
    assert [(c.prev, c.next) for c in plan] == [(0, 0)] * 4
    assert plan[-1].owned == [(0, 0)] and plan[-1].outgoing == [] and plan[0].carried == [0]
    # rank 0 holds the sequence's first call: the initial state, nothing carried in
    first = piece_plan(2, 64, 0, 2, 1, True, None, [0, 64, 128])[0]
    assert first.carried == [] and first.layout.init_rows == [0, 1] and first.outgoing == [0, 1]
    # a split never cuts below the chunk size
    assert len(piece_plan(1, 40, 0, 2, 1, False, None, [0, 40, 80], split=lambda n: 8, multiple=16)) == 2
