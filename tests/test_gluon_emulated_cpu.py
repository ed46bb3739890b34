"""CPU tier for the Gluon kernels (gdngen.runtime.gluon_emulator): first what the emulator itself must catch
(a tile read before its wait, a shared tile rewritten before its store left, a wrong byte count, a deadlock, a
slot handed back early, an asynchronous wgmma used or overwritten before its wait),
then the gated delta rule's four Gluon stages run emulated against its Triton stages (under the interpreter,
bf16 arithmetic as on the GPU: gdngen.bf16_emulation) and float64 - the checks tests/test_gluon_state_gpu.py
makes on the H200, at CPU sizes."""
import contextlib
import inspect

import pytest
import torch

from gdngen.runtime import gluon, gluon_emulator, override
from gdngen.runtime.gluon_emulator import GluonEmulationError, TensorDescriptor, async_copy, deadlock_after, gl, jit
from gdngen.runtime.gluon_emulator import fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from gdngen.selfcheck import (call, make_inputs, poisoned_memory, reference_gradients, reference_outputs, rel_rmse,
                              training_gradients)
from gdngen.spec import load_spec

NAME = "gated_delta_rule"
ROWS, COLS = 4, 8


def _descriptor(x):
    return TensorDescriptor(x, list(x.shape), [x.shape[1], 1], [ROWS, COLS])


# ------------------------------------------------------------------------------------------ the emulator itself

@jit
def _copy_kernel(src_desc, dst_desc, WAIT: gl.constexpr, EXTRA_BYTES: gl.constexpr):
    """One block in by TMA, out by TMA store: waiting for the load or not, expecting EXTRA_BYTES too many."""
    tile = gl.allocate_shared_memory(src_desc.dtype, src_desc.block_type.shape, src_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    bar = bars.index(0)
    mbarrier.init(bar, count=1)
    row = gl.program_id(0) * ROWS
    mbarrier.expect(bar, src_desc.block_type.nbytes + EXTRA_BYTES)
    tma.async_copy_global_to_shared(src_desc, [row, 0], bar, tile)
    if WAIT:
        mbarrier.wait(bar, 0)
    tma.async_copy_shared_to_global(dst_desc, [row, 0], tile)
    tma.store_wait(0)


def _copy(wait, extra_bytes=0):
    src = torch.randn(3 * ROWS, COLS)
    dst = torch.zeros_like(src)
    _copy_kernel[(3,)](_descriptor(src), _descriptor(dst), WAIT=wait, EXTRA_BYTES=extra_bytes)
    return src, dst


def test_a_tile_read_after_its_wait_is_the_block():
    src, dst = _copy(wait=True)
    assert torch.equal(dst, src)


def test_a_tile_read_before_its_wait_is_not():
    _, dst = _copy(wait=False)
    assert dst.isnan().all()                 # shared memory is NaN until the load lands, at the wait


def test_a_wrong_byte_count_is_an_error():
    with deadlock_after(0.2), pytest.raises(GluonEmulationError, match="deadlock"):
        _copy(wait=True, extra_bytes=2)      # the phase never completes
    with pytest.raises(GluonEmulationError, match="bytes more than expected"):
        _copy(wait=True, extra_bytes=-2)


@jit
def _store_kernel(dst_desc, WAIT_STORE: gl.constexpr):
    """Two blocks stored from one tile, rewritten between the stores after a store_wait or not."""
    tile = gl.allocate_shared_memory(dst_desc.dtype, dst_desc.block_type.shape, dst_desc.layout)
    tile.store(gl.full([ROWS, COLS], 1.0, gl.float32))
    fence_async_shared()
    tma.async_copy_shared_to_global(dst_desc, [0, 0], tile)
    if WAIT_STORE:
        tma.store_wait(0)
    tile.store(gl.full([ROWS, COLS], 2.0, gl.float32))
    fence_async_shared()
    tma.async_copy_shared_to_global(dst_desc, [ROWS, 0], tile)
    tma.store_wait(0)


@pytest.mark.parametrize("wait_store", [True, False])
def test_a_store_reads_its_tile_when_it_is_waited_for(wait_store):
    dst = torch.zeros(2 * ROWS, COLS)
    _store_kernel[(1,)](_descriptor(dst), WAIT_STORE=wait_store)
    assert torch.equal(dst[:ROWS], torch.full((ROWS, COLS), 1.0 if wait_store else 2.0))
    assert torch.equal(dst[ROWS:], torch.full((ROWS, COLS), 2.0))


@jit
def _producer(src_desc, ring, ready, free, N):
    for i in range(N):
        mbarrier.wait(free.index(i % 2), ((i // 2) & 1) ^ 1)       # the first pass through the ring is free
        mbarrier.expect(ready.index(i % 2), src_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(src_desc, [i * ROWS, 0], ready.index(i % 2), ring.index(i % 2))


@jit
def _consumer(out, ring, ready, free, N, ARRIVALS: gl.constexpr, EARLY: gl.constexpr, FIRST_UNWAITED: gl.constexpr):
    o_r = gl.arange(0, ROWS)
    o_c = gl.arange(0, COLS)
    for i in range(N):
        if FIRST_UNWAITED:
            if i == 0:                                               # (the first slot read before its wait)
                gl.store(out + o_r[:, None] * COLS + o_c[None, :], ring.index(0).load() * 2)
        mbarrier.wait(ready.index(i % 2), (i // 2) & 1)
        if EARLY:
            mbarrier.arrive(free.index(i % 2), count=ARRIVALS)     # (the slot handed back before it is read)
        gl.store(out + (i * ROWS + o_r[:, None]) * COLS + o_c[None, :], ring.index(i % 2).load() * 2)
        if not EARLY:
            mbarrier.arrive(free.index(i % 2), count=ARRIVALS)


@jit
def _ring_kernel(src_desc, out, N, ARRIVALS: gl.constexpr, EARLY: gl.constexpr = False,
                 FIRST_UNWAITED: gl.constexpr = False, MMA: gl.constexpr = False):
    """A loader partition and a consumer over a two-slot ring (ready / free barriers), as the state passes run;
    with MMA the consumer reads each slot by an asynchronous wgmma (_mma_consumer)."""
    ring = gl.allocate_shared_memory(src_desc.dtype, [2, ROWS, COLS], src_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(2):
        mbarrier.init(ready.index(j), count=1)
        mbarrier.init(free.index(j), count=1)
    consumer = ((_mma_consumer, (out, ring, ready, free, N, EARLY)) if MMA else
                (_consumer, (out, ring, ready, free, N, ARRIVALS, EARLY, FIRST_UNWAITED)))
    gl.warp_specialize([consumer, (_producer, (src_desc, ring, ready, free, N))], [1], [24])


def test_partitions_over_a_ring():
    src = torch.randn(7 * ROWS, COLS)
    out = torch.full_like(src, float("nan"))
    _ring_kernel[(1,)](_descriptor(src), out, 7, ARRIVALS=1)
    assert torch.equal(out, 2 * src)
    with pytest.raises(GluonEmulationError, match="over-arrived"):
        _ring_kernel[(1,)](_descriptor(src), out, 7, ARRIVALS=2)


def test_a_slot_handed_back_before_it_is_read_is_a_race():
    """The consumer arrives on a slot's free barrier before reading it: the loader's next load into that slot and
    the read are not ordered either way, and whichever the threads' timing puts second raises (the load's issue,
    or the read). Stop 55's check saw only the first order: one CI run in ~20 passed the kernel."""
    src = torch.randn(7 * ROWS, COLS)
    out = torch.full_like(src, float("nan"))
    with pytest.raises(GluonEmulationError, match="(write-after-read|read-after-write) race"):
        _ring_kernel[(1,)](_descriptor(src), out, 7, ARRIVALS=1, EARLY=True)


def test_a_tile_read_without_waiting_for_its_load_is_a_race():
    """The consumer reads the first slot before it waits on its ready barrier: whether the load was issued before
    the read (read-after-write) or after it (write-after-read: the loader's first pass through the ring waits on
    nothing of the consumer's), the two are not ordered, and it raises; stop 55's emulator showed only NaN in the
    results. (The wait still follows the read, so the consumer cannot run ahead of the ring and deadlock it.)"""
    src = torch.randn(4 * ROWS, COLS)
    out = torch.full_like(src, float("nan"))
    for _ in range(5):
        with pytest.raises(GluonEmulationError, match="(write-after-read|read-after-write) race"):
            _ring_kernel[(1,)](_descriptor(src), out, 4, ARRIVALS=1, FIRST_UNWAITED=True)


@jit
def _wgmma_kernel(out, MODE: gl.constexpr):
    """One asynchronous wgmma on a shared tile: waited for (0), its result used before the wait (1), its operand
    overwritten before the wait (2), never waited for (3), the tile's store not fenced before it (4)."""
    tile = gl.allocate_shared_memory(gl.bfloat16, [ROWS, COLS], gl.NVMMASharedLayout(128, 16, 2))
    tile.store(gl.full([ROWS, COLS], 1.0, gl.bfloat16))
    if MODE != 4:
        fence_async_shared()
    acc = warpgroup_mma(tile, tile.permute((1, 0)), gl.zeros([ROWS, ROWS], gl.float32), is_async=True)
    if MODE == 1:
        acc = acc * 2.0
    if MODE == 2:
        tile.store(gl.full([ROWS, COLS], 2.0, gl.bfloat16))
    if MODE != 3:
        acc = warpgroup_mma_wait(0, deps=(acc,))
        o = gl.arange(0, ROWS)
        gl.store(out + o[:, None] * ROWS + o[None, :], acc)


@pytest.mark.parametrize("mode, error", [(1, "used before warpgroup_mma_wait"), (2, "unretired asynchronous wgmma"),
                                         (3, "never retired"), (4, "no fence_async_shared")])
def test_an_asynchronous_wgmma_is_pending_until_its_wait(mode, error):
    out = torch.zeros(ROWS, ROWS)
    _wgmma_kernel[(1,)](out, MODE=0)
    assert torch.equal(out, torch.full((ROWS, ROWS), float(COLS)))
    with pytest.raises(GluonEmulationError, match=error):
        _wgmma_kernel[(1,)](out, MODE=mode)


@jit
def _handoff_writer(tile, bars, FENCE: gl.constexpr):
    tile.store(gl.full([ROWS, COLS], 1.0, gl.bfloat16))
    if FENCE == 1:
        fence_async_shared()
    mbarrier.arrive(bars.index(0), count=1)
    if FENCE == 2:
        fence_async_shared()                                  # (after the arrival: too late)


@jit
def _handoff_reader(out, tile, bars):
    mbarrier.wait(bars.index(0), 0)
    acc = warpgroup_mma(tile, tile.permute((1, 0)), gl.zeros([ROWS, ROWS], gl.float32))
    o = gl.arange(0, ROWS)
    gl.store(out + o[:, None] * ROWS + o[None, :], acc)


@jit
def _handoff_kernel(out, FENCE: gl.constexpr):
    """One partition stores a tile and arrives, another waits and reads it by wgmma; the store fenced before the
    arrival (1), not at all (0), or after it (2)."""
    tile = gl.allocate_shared_memory(gl.bfloat16, [ROWS, COLS], gl.NVMMASharedLayout(128, 16, 2))
    bars = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bars.index(0), count=1)
    gl.warp_specialize([(_handoff_reader, (out, tile, bars)), (_handoff_writer, (tile, bars, FENCE))], [1], [24])


def test_a_tile_stored_and_handed_on_needs_a_fence_before_the_arrival():
    """A generic-proxy store read by another partition's wgmma (the async proxy) must be fenced before the
    arrival that hands it on, as the hardware needs."""
    out = torch.zeros(ROWS, ROWS)
    _handoff_kernel[(1,)](out, FENCE=1)
    assert torch.equal(out, torch.full((ROWS, ROWS), float(COLS)))
    for fence in (0, 2):
        with pytest.raises(GluonEmulationError, match="no fence_async_shared before its arrival"):
            _handoff_kernel[(1,)](out, FENCE=fence)


@jit
def _mma_consumer(out, ring, ready, free, N, EARLY: gl.constexpr):
    o_r = gl.arange(0, ROWS)
    for i in range(N):
        mbarrier.wait(ready.index(i % 2), (i // 2) & 1)
        acc = warpgroup_mma(ring.index(i % 2), ring.index(i % 2).permute((1, 0)), gl.zeros([ROWS, ROWS], gl.float32),
                            is_async=True)
        if EARLY:
            mbarrier.arrive(free.index(i % 2), count=1)      # (the slot handed back while the wgmma may read it)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        if not EARLY:
            mbarrier.arrive(free.index(i % 2), count=1)
        gl.store(out + (i * ROWS + o_r[:, None]) * ROWS + o_r[None, :], acc)


def test_a_slot_handed_back_before_its_wgmma_retires_is_a_race():
    """A wgmma reads its shared operands until warpgroup_mma_wait retires it: a free arrival between the two lets
    the loader reload the slot under it, and the emulator raises whichever of reload and retirement comes first
    (stop 55's emulator took the read to happen at the issue)."""
    src = torch.randn(6 * ROWS, COLS).bfloat16()
    out = torch.full((6 * ROWS, ROWS), float("nan"))
    _ring_kernel[(1,)](_descriptor(src), out, 6, ARRIVALS=1, MMA=True)
    blocks = src.float().view(6, ROWS, COLS)
    assert torch.allclose(out.view(6, ROWS, ROWS), blocks @ blocks.transpose(1, 2))
    for _ in range(5):
        with pytest.raises(GluonEmulationError, match="(write-after-read|read-after-write) race"):
            _ring_kernel[(1,)](_descriptor(src), out, 6, ARRIVALS=1, EARLY=True, MMA=True)


def test_a_launch_past_the_register_file_is_an_error():
    """Five warps launch as two warpgroups: 8 x 32 threads at maxnreg 256 fill the 65,536 registers exactly; 264
    would not launch (setmaxnreg moves registers only after the launch)."""
    src = torch.randn(2 * ROWS, COLS)
    out = torch.full_like(src, float("nan"))
    _ring_kernel[(1,)](_descriptor(src), out, 2, ARRIVALS=1, maxnreg=256)
    assert torch.equal(out, 2 * src)
    with pytest.raises(GluonEmulationError, match="would not launch"):
        _ring_kernel[(1,)](_descriptor(src), out, 2, ARRIVALS=1, maxnreg=264)


@jit
def _cp_async_kernel(src, dst, WAIT: gl.constexpr):
    tile = gl.allocate_shared_memory(gl.float32, [COLS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    o_c = gl.arange(0, COLS)
    async_copy.async_copy_global_to_shared(tile, src + o_c)
    async_copy.commit_group()
    if WAIT:
        async_copy.wait_group(0)
    gl.store(dst + o_c, tile.load())


@pytest.mark.parametrize("wait", [True, False])
def test_a_cp_async_copy_lands_at_its_wait_group(wait):
    src, dst = torch.randn(COLS), torch.zeros(COLS)
    _cp_async_kernel[(1,)](src, dst, WAIT=wait)
    assert torch.equal(dst, src) if wait else dst.isnan().all()


def test_an_access_past_an_argument_is_an_error():
    src, dst = torch.randn(COLS - 1), torch.zeros(COLS)
    with pytest.raises(GluonEmulationError, match="past its argument"):
        _cp_async_kernel[(1,)](src, dst, WAIT=True)


# ------------------------------------------------------------------------------- the gated delta rule's stages

LAUNCHERS = ("_state_output_gluon", "_state_bwd_gluon", "_reverse_gluon", "_wy_bwd_gluon", "_chunk_bwd_gluon",
             "_fused_bwd_gluon")
SWITCHES = ("gluon_state", "gluon_training", "gluon_state_bwd", "gluon_chunk_bwd", "gluon_wy_bwd")
BARS = {"q": 8e-3, "k": 8e-3, "v": 8e-3, "initial_state": 8e-3, "g": 2e-2, "beta": 2e-2}


@pytest.fixture(scope="module")
def emulated():
    """The emulated module, the interpreter's bf16 as the GPU's, and each Gluon launcher's launches recorded
    as the sequences or pieces (N) each ran (0 for the tile stages)."""
    from gdngen.bf16_emulation import patch_bf16_interpreter
    undo = patch_bf16_interpreter("round")
    module = gluon_emulator.load_module(NAME)
    launches = {name: [] for name in LAUNCHERS}
    originals = {name: getattr(module, name) for name in LAUNCHERS}

    def recording(name):
        original = originals[name]

        def launch(*args, **kwargs):
            arguments = inspect.signature(original).bind(*args, **kwargs).arguments
            launches[name].append(arguments.get("N", 0))
            return original(*args, **kwargs)
        return launch
    for name in LAUNCHERS:
        setattr(module, name, recording(name))
    yield module, launches
    for name in LAUNCHERS:
        setattr(module, name, originals[name])
    undo()


@contextlib.contextmanager
def _switched(gluon, pieces, fused_default=False, **switches):
    """Every Gluon switch at ``gluon`` (those in ``switches`` at theirs), ``pieces`` state pieces, fresh buffers
    NaN-poisoned. The fused backward only where ``switches`` asks for it (or, ``fused_default``, where the module
    chooses it by default): the other tests check the three kernels it replaces."""
    if not fused_default:
        switches.setdefault("gluon_fused_bwd", False)
    with contextlib.ExitStack() as stack:
        for switch in SWITCHES:
            stack.enter_context(override(NAME, switch, value=switches.get(switch, gluon)))
        for switch, value in switches.items():
            if switch not in SWITCHES:
                stack.enter_context(override(NAME, switch, value=value))
        stack.enter_context(override(NAME, "state_pieces", value=pieces))
        stack.enter_context(poisoned_memory())
        yield


def test_the_one_chain_pass_launches_within_the_register_file(emulated, monkeypatch):
    """The one-chain pass's 13 warps launch as 16 (the one-warp loader takes a warpgroup's place): 128 registers a
    thread is the whole file. Its first commit asked 152 (77,824 registers), which would not have launched."""
    module, _ = emulated
    assert module.REVERSE_GLUON_REGISTERS["maxnreg"] * 32 * 16 <= gluon_emulator.REGISTER_FILE
    spec = load_spec(f"specs/{NAME}.yaml")
    inputs = make_inputs(spec, dtype=torch.bfloat16, device="cpu", seed=49, K=128, V=128, h0=True, B=1, T=128,
                         H=1, HV=1)
    monkeypatch.setitem(module.REVERSE_GLUON_REGISTERS, "maxnreg", 152)
    with _switched(True, 1, gluon_one_chain_bwd=True), pytest.raises(GluonEmulationError, match="would not launch"):
        _forward_backward(module, spec, inputs, seed=50)


def test_the_emulated_copy_leaves_the_real_ops_alone(emulated):
    """The emulated copy's torch.library ops live in a namespace of their own: torch.ops.gdngen.* stay the real
    module's (defined as gdngen::..., the copy's replaced them, and three library-op tests that count the real
    module's launches saw none)."""
    import importlib
    module, _ = emulated
    real = importlib.import_module(f"generated.{NAME}")
    assert module._chunk_gated_delta_rule_op is not real._chunk_gated_delta_rule_op
    assert str(module._chunk_gated_delta_rule_op._qualname).startswith(gluon_emulator.EMULATED_OP_NAMESPACE + "::")
    assert str(real._chunk_gated_delta_rule_op._qualname).startswith("gdngen::")
    assert hasattr(getattr(torch.ops, gluon_emulator.EMULATED_OP_NAMESPACE), "chunk_gated_delta_rule")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape, h0, pieces", [
    (dict(B=1, T=512, H=1, HV=2), True, 4),      # one sequence in pieces (their walks in the pass), h0
    (dict(B=2, T=256, H=2, HV=4), False, 1),     # dense sequences, grouped value heads
])
def test_forward_pass(emulated, dtype, shape, h0, pieces):
    """The forward Gluon pass against the Triton pass and float64. The two sum the same products (bit for bit on
    the H200); here numpy's and torch's float32 matmuls sum in different orders, so the 16-bit output may differ
    by a rounding in a few places."""
    module, launches = emulated
    spec = load_spec(f"specs/{NAME}.yaml")
    inputs = make_inputs(spec, dtype=dtype, device="cpu", seed=41, K=128, V=128, h0=h0, **shape)
    outputs = {}
    for gluon in (True, False):
        launches["_state_output_gluon"].clear()
        with _switched(gluon, pieces):
            outputs[gluon] = call(module, spec, inputs, output_final_state=True)
        assert launches["_state_output_gluon"] == ([pieces * shape["B"]] if gluon else [])
    (o, ht), (o_triton, ht_triton) = outputs[True], outputs[False]
    assert not o.isnan().any() and not ht.isnan().any()
    assert rel_rmse(o, o_triton) <= 2 ** -10 and rel_rmse(ht, ht_triton) <= 1e-5
    o_ref, ht_ref = reference_outputs(spec, inputs, output_final_state=True)
    assert rel_rmse(o, o_ref) <= 5e-3 and rel_rmse(ht, ht_ref) <= 5e-3


@pytest.mark.parametrize("shape, h0, pieces, dtype", [
    (dict(B=1, T=512, H=1, HV=2), True, 4, torch.bfloat16),     # pieces: their walks read T too
    (dict(B=2, T=256, H=2, HV=4), False, 1, torch.float16),     # dense sequences, grouped value heads
])
def test_forward_pass_with_compact_t(emulated, monkeypatch, shape, h0, pieces, dtype):
    """A forward that keeps no states takes the wy stage's T compact (gdngen.runtime.gluon.compact_t_enabled, on
    by default): the wy stage writes each block row's blocks on and left of the diagonal only, and the pass loads
    each block row as a [16, 64] TMA box zero-filled past its region's columns. The compact buffer holds the
    whole tiles' T exactly, and o and the final state are the whole tiles' bit for bit, with and without the
    final state, on NaN-poisoned buffers. A training step's forward keeps the whole tiles (the backward reads
    them)."""
    module, _ = emulated
    spec = load_spec(f"specs/{NAME}.yaml")
    inputs = make_inputs(spec, dtype=dtype, device="cpu", seed=61, K=128, V=128, h0=h0, **shape)
    given, original = [], module._state_output_gluon

    def recording(k, q, v, tmat, *args, **kwargs):
        given.append(tmat.clone() if tmat is not None else None)
        return original(k, q, v, tmat, *args, **kwargs)
    monkeypatch.setattr(module, "_state_output_gluon", recording)
    runs = {}
    for compact in (True, False):
        given.clear()
        with _switched(True, pieces, compact_t=compact):
            o, ht = call(module, spec, inputs, output_final_state=True)
            o_alone, _ = call(module, spec, inputs, output_final_state=False)
            assert [t.dim() for t in given] == [1 if compact else 4] * 2
            training_gradients(module, spec, inputs, seed=62)
            assert given[2].dim() == 4                   # the training forward's T: whole tiles
        runs[compact] = dict(o=o, ht=ht, o_alone=o_alone, t=given[0])
    B, T, HV = shape["B"], shape["T"], shape["HV"]
    whole = runs[False].pop("t")
    assert torch.equal(gluon.expand_compact_t(runs[True].pop("t"), B, T, HV, 64), whole)
    assert (whole.view(B, T // 64, 64, HV, 64).transpose(2, 3).triu(1) == 0).all()     # T's zeros, above the diagonal
    for name, tiles in runs[False].items():
        assert not tiles.isnan().any(), name
        assert torch.equal(runs[True][name], tiles), name


def test_compact_t_regions_are_the_tiles_block_rows():
    """compact_t_regions / expand_compact_t: region i holds rows 16 i .. 16 i + 15 of each chunk's T, its first
    16 (i + 1) columns, rows ordered (chunk, value head, row); the buffer is 10 / 16 of the whole tiles."""
    B, T, HV, BT = 2, 128, 3, 64
    chunks = B * T // BT
    assert gluon.compact_t_size(chunks, HV, BT) == chunks * HV * BT * BT * 10 // 16
    buffer = torch.arange(gluon.compact_t_size(chunks, HV, BT), dtype=torch.float32)
    regions = gluon.compact_t_regions(buffer, chunks, HV, BT)
    assert [tuple(r.shape) for r in regions] == [(chunks * HV * 16, 16 * (i + 1)) for i in range(4)]
    assert sum(r.numel() for r in regions) == buffer.numel() and regions[-1][-1, -1] == buffer[-1]
    full = gluon.expand_compact_t(buffer, B, T, HV, BT)
    c, hv, r, i = 3, 1, 5, 2                         # chunk 3 (sequence 1's second), value head 1, row 16 * 2 + 5
    row = full.view(chunks, BT, HV, BT)[c, 16 * i + r, hv]
    assert torch.equal(row[:16 * (i + 1)], regions[i][(c * HV + hv) * 16 + r])
    assert (row[16 * (i + 1):] == 0).all()


@pytest.mark.parametrize("h0", [False, True])
def test_dense_sequences_as_one_piece_each(emulated, monkeypatch, h0):
    """gluon_dense_pieces (on by default): where the pass stores the final state or the states for a backward,
    dense sequences of whole chunks run its pieces build (IS_VARLEN, one piece a sequence), and the output, final
    state and every gradient are the dense build's bit for bit; a forward without the final state stays dense."""
    module, _ = emulated
    spec = load_spec(f"specs/{NAME}.yaml")
    inputs = make_inputs(spec, dtype=torch.bfloat16, device="cpu", seed=45, K=128, V=128, h0=h0, B=2, T=256, H=2,
                         HV=4)
    varlen, original = [], module._state_output_gluon_fast

    class Recording:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                varlen.append(kwargs["IS_VARLEN"])
                return original[grid](*args, **kwargs)
            return launch
    monkeypatch.setattr(module, "_state_output_gluon_fast", Recording())
    runs = {}
    for as_pieces in (False, True):
        varlen.clear()
        with _switched(True, 1, gluon_dense_pieces=as_pieces):
            o, ht = call(module, spec, inputs, output_final_state=True)
            o_alone, _ = call(module, spec, inputs, output_final_state=False)
            o_step, ht_step, grads, _ = training_gradients(module, spec, inputs, seed=46)
        assert varlen == [as_pieces, False, as_pieces]
        runs[as_pieces] = dict(o=o, ht=ht, o_alone=o_alone, o_step=o_step, ht_step=ht_step,
                               **{f"d{name}": grad for name, grad in grads.items()})
    assert runs[True].keys() == runs[False].keys()
    for name, dense in runs[False].items():
        assert not dense.isnan().any(), name
        assert torch.equal(runs[True][name], dense), name


def _forward_backward(module, spec, inputs, seed):
    """Every floating input's gradient of one training call, and the cotangents (do, dht) it took."""
    _, _, grads, cotangents = training_gradients(module, spec, inputs, seed)
    return grads, cotangents


@pytest.mark.parametrize("shape, pieces, switches", [
    (dict(B=1, T=512, H=1, HV=2), 2, {}),                             # pieces: the reverse pass's walks
    (dict(B=2, T=256, H=2, HV=4), 1, {}),                             # grouped value heads (G = 2)
    (dict(B=1, T=256, H=1, HV=3), 1, {}),                             # groups of three
    (dict(B=1, T=256, H=2, HV=2), 1, {"gluon_w_from_t": False}),      # one value head per query head (the
                                                                      # chunk stage's two key tiles), W read
    (dict(B=2, T=256, H=2, HV=4), 1, {"gluon_one_chain_bwd": True}),  # the one-chain reverse pass
    (dict(B=1, T=512, H=2, HV=2), 2,                                  # ... with the wy stage in it, pieces
     {"gluon_one_chain_bwd": True, "gluon_reverse_wy": True}),
])
def test_training_step(emulated, shape, pieces, switches):
    """A training step through the four Gluon stages (the training forward pass, the reverse pass, the wy and
    chunk stages) against the Triton stages: every gradient within bf16 roundings of theirs (2^-8) and as
    close to float64 (5% slack), dh0 included, on NaN-poisoned buffers."""
    module, launches = emulated
    spec = load_spec(f"specs/{NAME}.yaml")
    inputs = make_inputs(spec, dtype=torch.bfloat16, device="cpu", seed=43, K=128, V=128, h0=True, **shape)
    grads, errors = {}, {}
    for gluon in (True, False):
        for calls in launches.values():
            calls.clear()
        with _switched(gluon, pieces, **switches):
            grads[gluon], cotangents = _forward_backward(module, spec, inputs, seed=44)
        ran = {name: list(calls) for name, calls in launches.items()}
        n = pieces * shape["B"]
        one_chain = [n] if switches.get("gluon_one_chain_bwd") else []
        wy_stage = [] if switches.get("gluon_reverse_wy") else [0]
        assert ran == ({"_state_output_gluon": [n], "_state_bwd_gluon": [n], "_reverse_gluon": one_chain,
                        "_wy_bwd_gluon": wy_stage, "_chunk_bwd_gluon": [0], "_fused_bwd_gluon": []} if gluon else
                       {name: [] for name in LAUNCHERS})
    _, _, want = reference_gradients(spec, inputs, cotangents)
    assert grads[True].keys() == grads[False].keys() == want.keys() and "initial_state" in want
    for name in want:
        assert not grads[True][name].isnan().any(), name
        assert rel_rmse(grads[True][name], grads[False][name]) <= 2 ** -8, name
        errors[name] = {gluon: rel_rmse(grads[gluon][name], want[name]) for gluon in (True, False)}
    assert all(errors[n][True] <= BARS[n] for n in BARS), errors
    assert all(errors[n][True] <= 1.05 * errors[n][False] for n in errors), errors

@pytest.mark.parametrize("shape, pieces", [
    (dict(B=1, T=512, H=1, HV=2), 4),            # pieces: each walks on over the chunks after it first
    (dict(B=2, T=256, H=2, HV=4), 1),            # dense sequences, grouped value heads
    (dict(B=1, T=256, H=3, HV=3), 1),            # one value head per query head
])
@pytest.mark.parametrize("wy", [False, True])
@pytest.mark.parametrize("at_issue", [False, True])
def test_one_chain_reverse_pass_is_the_two_half_pass(emulated, shape, pieces, wy, at_issue):
    """The reverse pass with one chain warpgroup (stages/backward_reverse_gluon.py.j2, override
    gluon_one_chain_bwd) forms every product and rounding of the two-half pass, and with the wy stage folded in
    (override gluon_reverse_wy) every one of the wy stage's: the gradients agree to float32 summation order (a
    bf16 rounding flipped here and there). ``at_issue``: loads land when issued (a slot handed back too early is
    overwritten under its reader) instead of at their wait (a read before its wait sees NaN)."""
    module, launches = emulated
    spec = load_spec(f"specs/{NAME}.yaml")
    inputs = make_inputs(spec, dtype=torch.bfloat16, device="cpu", seed=47, K=128, V=128, h0=True, **shape)
    grads = {}
    for one_chain in (True, False):
        for name in ("_reverse_gluon", "_wy_bwd_gluon"):
            launches[name].clear()
        with _switched(True, pieces, gluon_one_chain_bwd=one_chain, gluon_reverse_wy=wy and one_chain), \
                (gluon_emulator.loads_land_at_issue() if at_issue else contextlib.nullcontext()):
            grads[one_chain], _ = _forward_backward(module, spec, inputs, seed=48)
        assert launches["_reverse_gluon"] == ([pieces * shape["B"]] if one_chain else [])
        assert launches["_wy_bwd_gluon"] == ([] if wy and one_chain else [0])
    for name in grads[True]:
        assert not grads[True][name].isnan().any(), name
        assert rel_rmse(grads[True][name], grads[False][name]) <= 2e-4, name


@pytest.mark.parametrize("shape, h0, pieces, dtype", [
    (dict(B=2, T=256, H=2, HV=2), True, 1, torch.bfloat16),     # dense sequences, dh0 and the final state's
                                                                # gradient
    (dict(B=1, T=192, H=1, HV=2), False, 1, torch.bfloat16),    # grouped value heads; no initial state: no dh0
    (dict(B=1, T=512, H=1, HV=2), True, 4, torch.bfloat16),     # pieces: each walks on over the chunks after it
    (dict(B=1, T=256, H=2, HV=2), True, 1, torch.float16),      # float16 (the kept T's dtype too)
])
@pytest.mark.parametrize("at_issue", [False, True])
def test_fused_backward(emulated, shape, h0, pieces, dtype, at_issue):
    """The fused backward (stages/backward_fused_gluon.py.j2, override gluon_fused_bwd): one launch in place of
    the reverse pass, the wy stage and the chunk stage, every gradient (dh0 included) within #10's bars of float64
    and as close as the Triton stages' (5% slack; they, like it, round a head group's dq and dk per value head
    before their sum), on NaN-poisoned buffers. ``at_issue``: loads land when issued (a tile reloaded before its
    last reader's step has passed is overwritten under it)."""
    module, launches = emulated
    spec = load_spec(f"specs/{NAME}.yaml")
    inputs = make_inputs(spec, dtype=dtype, device="cpu", seed=51, K=128, V=128, h0=h0, **shape)
    grads, errors = {}, {}
    for fused in (True, False):
        for calls in launches.values():
            calls.clear()
        with _switched(fused, pieces, gluon_fused_bwd=fused), \
                (gluon_emulator.loads_land_at_issue() if at_issue else contextlib.nullcontext()):
            grads[fused], cotangents = _forward_backward(module, spec, inputs, seed=52)
        n = pieces * shape["B"]
        assert {name: list(calls) for name, calls in launches.items()} == (
            dict({name: [] for name in LAUNCHERS}, _state_output_gluon=[n], _fused_bwd_gluon=[n]) if fused
            else {name: [] for name in LAUNCHERS})
    _, _, want = reference_gradients(spec, inputs, cotangents)
    assert grads[True].keys() == want.keys() and ("initial_state" in want) == h0
    for name in want:
        assert not grads[True][name].isnan().any(), name
        errors[name] = {fused: rel_rmse(grads[fused][name], want[name]) for fused in (True, False)}
    assert all(errors[n][True] <= BARS[n] for n in want), errors
    assert all(errors[n][True] <= 1.05 * errors[n][False] for n in errors), errors


@pytest.mark.parametrize("heads, pieces", [(dict(H=1, HV=2), 1), (dict(H=2, HV=4), 2), (dict(H=1, HV=4), 1)])
def test_fused_backward_adds_head_groups_itself(emulated, monkeypatch, heads, pieces):
    """Grouped value heads: the fused kernel adds each group's dq and dk tiles into [B, T, H, K] outputs by TMA
    (gdngen.runtime.gluon.fused_group_add, by default for groups of two), where without it it writes them per value
    head for sum_head_groups. A group of two gives the sum kernel's gradients bit for bit (0 + a, then a + b,
    rounded once); a group of four, switched on, adds three times, each rounded: within #10's bars of float64."""
    from gdngen.runtime.gluon import fused_group_add
    module, launches = emulated
    group = heads["HV"] // heads["H"]
    assert fused_group_add(NAME, 2) and not fused_group_add(NAME, 4)
    sums = []
    real_sum = module.sum_head_groups
    monkeypatch.setattr(module, "sum_head_groups", lambda x, H, out=None: sums.append(x.shape) or real_sum(x, H, out))
    spec = load_spec(f"specs/{NAME}.yaml")
    inputs = make_inputs(spec, dtype=torch.bfloat16, device="cpu", seed=57, K=128, V=128, h0=True, B=1, T=128 * pieces,
                         **heads)
    grads = {}
    for add in (True, False):
        sums.clear()
        launches["_fused_bwd_gluon"].clear()
        with _switched(True, pieces, gluon_fused_bwd=True, gluon_fused_group_add=add):
            grads[add], cotangents = _forward_backward(module, spec, inputs, seed=58)
        assert launches["_fused_bwd_gluon"] == [pieces]
        assert len(sums) == (0 if add else 2)
    _, _, want = reference_gradients(spec, inputs, cotangents)
    for name in want:
        assert not grads[True][name].isnan().any(), name
        assert rel_rmse(grads[True][name], want[name]) <= BARS[name], name
        if group == 2 or name not in ("q", "k"):
            assert torch.equal(grads[True][name], grads[False][name]), name
        else:
            assert not torch.equal(grads[True][name], grads[False][name]), name    # the adds round: not the sum's


@pytest.mark.parametrize("shape, pieces", [
    (dict(B=2, T=256, H=2, HV=2), 1),            # dense sequences, dh0
    (dict(B=1, T=512, H=2, HV=2), 4),            # pieces: each walks on over the chunks after it first
    (dict(B=1, T=256, H=1, HV=2), 1),            # a head group's adds: the other load order (GROUP_ADD)
])
@pytest.mark.parametrize("at_issue", [False, True])
def test_fused_backward_column_sums_in_the_state_consumer(emulated, shape, pieces, at_issue):
    """gdngen.runtime.gluon.fused_colsum_state: d(cumsum g)'s column sum by the S consumer in the next chunk's step
    1, from N = diag(beta) M in two bfloat16 halves (a second dg slot the gates stage adds); A's other sums in its
    own step 5. Every other gradient is the A consumer's column reduction's bit for bit, g within float32 roundings
    of it and as close to float64, none NaN on NaN-poisoned buffers; a half of N read before it is there, or after
    A writes its tile again, is NaN or a race here."""
    module, launches = emulated
    spec = load_spec(f"specs/{NAME}.yaml")
    inputs = make_inputs(spec, dtype=torch.bfloat16, device="cpu", seed=53, K=128, V=128, h0=True, **shape)
    grads = {}
    for state in (True, False):
        launches["_fused_bwd_gluon"].clear()
        with _switched(True, pieces, gluon_fused_bwd=True, gluon_fused_colsum_state=state), \
                (gluon_emulator.loads_land_at_issue() if at_issue else contextlib.nullcontext()):
            grads[state], cotangents = _forward_backward(module, spec, inputs, seed=54)
        assert launches["_fused_bwd_gluon"] == [pieces * shape["B"]]
    _, _, want = reference_gradients(spec, inputs, cotangents)
    for name in want:
        assert not grads[True][name].isnan().any(), name
        if name == "g":
            assert rel_rmse(grads[True][name], grads[False][name]) <= 1e-5
            assert rel_rmse(grads[True][name], want[name]) <= 1.01 * rel_rmse(grads[False][name], want[name])
        else:
            assert torch.equal(grads[True][name], grads[False][name]), name


def test_fused_backward_needs_no_time_segments(emulated, monkeypatch):
    """One long sequence's backward is cut into time segments for what it stores per token (gdngen.runtime.segments);
    the fused backward stores no state gradients and no W, so the module asks for segments with fused_bwd=True
    where the fused kernel takes the call, and False where it is off. Two segments forced still run the fused kernel,
    each segment's end gradient the next one's dh0: every gradient (dh0 included) within 3e-4 of one segment's (the
    pieces' bounds, and so their walks and roundings, move with the segments) and within #10's bars of float64."""
    module, launches = emulated
    asked = []
    real_segments = module.backward_segments
    monkeypatch.setattr(module, "backward_segments",
                        lambda *args, **kwargs: asked.append(kwargs.get("fused_bwd")) or real_segments(*args, **kwargs))
    spec = load_spec(f"specs/{NAME}.yaml")
    inputs = make_inputs(spec, dtype=torch.bfloat16, device="cpu", seed=61, K=128, V=128, h0=True, B=1, T=256,
                         H=2, HV=2)
    grads = {}
    for segments in (None, 2):
        launches["_fused_bwd_gluon"].clear()
        with _switched(True, 2, gluon_fused_bwd=True), contextlib.ExitStack() as stack:
            if segments:
                stack.enter_context(override(NAME, "backward_segments", value=segments))
            grads[segments], cotangents = _forward_backward(module, spec, inputs, seed=62)
        assert asked[-1] is True
        assert launches["_fused_bwd_gluon"] == [2] * (segments or 1)          # two pieces a launch
    with _switched(True, 2):
        _forward_backward(module, spec, inputs, seed=62)
    assert asked[-1] is False
    _, _, want = reference_gradients(spec, inputs, cotangents)
    for name in want:
        assert not grads[2][name].isnan().any(), name
        assert rel_rmse(grads[2][name], grads[None][name]) <= 3e-4, name          # read <= 9.6e-5
        assert rel_rmse(grads[2][name], want[name]) <= BARS[name], name


def test_backward_with_slow_gates_and_the_final_state_alone(emulated):
    """A loss on the final state alone, with gates 50x slower than make_inputs' (a chunk's state decay ~0.8, not
    ~1e-5): the last token's state_decay <S, dS'> term of d(cumsum g), invisible at make_inputs' gates (dropping
    it failed no test, stop 65), is then most of it. The Triton stages within #10's bars of float64, the three
    Gluon kernels and the fused one within 5% of their errors."""
    module, _ = emulated
    spec = load_spec(f"specs/{NAME}.yaml")
    inputs = make_inputs(spec, dtype=torch.bfloat16, device="cpu", seed=81, K=128, V=128, h0=True,
                         B=1, T=256, H=2, HV=2)
    inputs["g"] = inputs["g"] * 0.02
    leaves = {n: x for n, x in inputs.items() if isinstance(x, torch.Tensor) and x.is_floating_point()}
    grads = {}
    for run in ("fused", "three", "triton"):
        with _switched(run != "triton", 1, gluon_fused_bwd=run == "fused"):
            args = {n: x.detach().clone().requires_grad_(True) for n, x in leaves.items()}
            o, ht = getattr(module, spec.chunk_function)(**{**inputs, **args}, output_final_state=True)
            cotangents = (torch.zeros_like(o), torch.randn(ht.shape, generator=torch.Generator().manual_seed(82)))
            grads[run] = dict(zip(args, torch.autograd.grad((o, ht), list(args.values()), cotangents)))
    _, _, want = reference_gradients(spec, inputs, cotangents)
    for run in ("fused", "three"):
        errors = {n: (rel_rmse(grads[run][n], want[n]), rel_rmse(grads["triton"][n], want[n]))
                  for n in want if n != "q"}          # (no output gradient: dq is zero)
        assert all(mine <= 1.05 * theirs and theirs <= BARS[n] for n, (mine, theirs) in errors.items()), (run, errors)
    assert not grads["fused"]["q"].any() and not grads["three"]["q"].any()


@pytest.mark.parametrize("shape, pieces", [
    (dict(B=1, T=256, H=2, HV=2), 2),
])
def test_fused_backward_only_where_it_can(emulated, shape, pieces):
    """The switch is on by default, so that a default backward runs the fused kernel with or without grouped value
    heads; on, a backward that reads W rather than forming it from the forward's 16-bit T (override
    gluon_w_from_t off) keeps the three kernels."""
    from gdngen.runtime.gluon import fused_bwd_enabled
    module, launches = emulated
    assert fused_bwd_enabled(NAME)
    with override(NAME, "gluon_fused_bwd", value=False):
        assert not fused_bwd_enabled(NAME)
    spec = load_spec(f"specs/{NAME}.yaml")
    inputs = make_inputs(spec, dtype=torch.bfloat16, device="cpu", seed=53, K=128, V=128, h0=True, **shape)
    for calls in launches.values():
        calls.clear()
    with _switched(True, pieces, gluon_fused_bwd=True, gluon_w_from_t=False):
        grads, _ = _forward_backward(module, spec, inputs, seed=54)
    assert launches["_fused_bwd_gluon"] == [] and launches["_chunk_bwd_gluon"] == [0]
    assert not any(g.isnan().any() for g in grads.values())
    # the module's default: the fused kernel, with one value head per query head and with a group of two
    for heads in (dict(H=1, HV=1), dict(H=1, HV=2)):
        inputs = make_inputs(spec, dtype=torch.bfloat16, device="cpu", seed=55, K=128, V=128, h0=True, B=1, T=128,
                             **heads)
        for calls in launches.values():
            calls.clear()
        with _switched(True, 1, fused_default=True):
            grads, _ = _forward_backward(module, spec, inputs, seed=56)
        assert (launches["_fused_bwd_gluon"], launches["_chunk_bwd_gluon"]) == ([1], [])
        assert not any(g.isnan().any() for g in grads.values())


@pytest.mark.parametrize("shape, h0, pieces, dtype", [
    (dict(B=1, T=512, H=1, HV=2), True, 4, torch.bfloat16),     # pieces: T formed for the walks' chunks too
    (dict(B=2, T=256, H=2, HV=4), False, 1, torch.float16),     # dense sequences, grouped value heads
    (dict(B=1, T=256, H=2, HV=2), True, 2, torch.bfloat16),     # one value head per query head
])
def test_forward_pass_forms_t_itself(emulated, wy_launches, shape, h0, pieces, dtype):
    """The no-grad forward with the Gluon pass forming each chunk's T (override gluon_fused_t; FUSED_T): no wy
    launch, o and the final state against the pass fed by the wy stage (T by another product order: a rounding
    apart, as the Gluon and Triton passes are) and float64, on NaN-poisoned buffers; the emulator's race checks
    cover the T tiles' hand-off from the scores partition to the chains."""
    module, launches = emulated
    spec = load_spec(f"specs/{NAME}.yaml")
    inputs = make_inputs(spec, dtype=dtype, device="cpu", seed=53, K=128, V=128, h0=h0, **shape)
    wy = wy_launches(module)
    outputs = {}
    for fused in (True, False):
        wy.clear()
        launches["_state_output_gluon"].clear()
        with _switched(True, pieces, gluon_fused_t=fused):
            outputs[fused] = call(module, spec, inputs, output_final_state=True)
        assert launches["_state_output_gluon"] == [pieces * shape["B"]]
        assert len(wy) == (0 if fused else 1)
    (o, ht), (o_wy, ht_wy) = outputs[True], outputs[False]
    assert not o.isnan().any() and not ht.isnan().any()
    o_ref, ht_ref = reference_outputs(spec, inputs, output_final_state=True)
    errors = {name: (rel_rmse(x, ref), rel_rmse(x_wy, ref))
              for name, x, x_wy, ref in (("o", o, o_wy, o_ref), ("ht", ht, ht_wy, ht_ref))}
    assert rel_rmse(o, o_wy) <= 2 ** -9 and rel_rmse(ht, ht_wy) <= 1e-3
    assert all(mine <= 5e-3 and mine <= 1.05 * theirs for mine, theirs in errors.values()), errors


def test_forward_pass_forms_t_only_where_asked_and_in_float16():
    from gdngen.runtime import gluon
    assert not gluon.fused_t_usable(NAME, torch.bfloat16, torch.float16)
    with override(NAME, "gluon_fused_t", value=True):
        assert gluon.fused_t_usable(NAME, torch.bfloat16, torch.float16)
        assert gluon.fused_t_usable(NAME, torch.float16, torch.float16)
        assert not gluon.fused_t_usable(NAME, torch.bfloat16, torch.bfloat16)    # a tf32 solve: the wy stage's
        assert not gluon.fused_t_usable(NAME, torch.float32, torch.float32)


def test_forward_pass_solves_a_chunk_past_float16s_range(emulated):
    """Keys of norm 1.4 around one direction and beta near 1 put |A_ij| up to ~1.6 in every chunk: there the wy
    stage solves at tf32 and the pass (FUSED_T) on range-scaled float16 operands. An ill-conditioned chunk either
    way: o and the final state
    against float64 within twice the wy stage's error (stop 58, emulated: the pass 0.22 / 0.046, the wy stage
    0.46 / 0.048)."""
    module, _ = emulated
    spec = load_spec(f"specs/{NAME}.yaml")
    inputs = make_inputs(spec, dtype=torch.bfloat16, device="cpu", seed=57, K=128, V=128, h0=True, B=1, T=256, H=1,
                         HV=2)
    k = inputs["k"].double()
    k = k[:, :1] + 0.7 * k
    inputs["k"] = (1.4 * k / k.norm(dim=-1, keepdim=True)).bfloat16()
    inputs["beta"] = torch.sigmoid(torch.logit(inputs["beta"]) + 2)
    kk, beta = inputs["k"].double()[0, :64, 0], inputs["beta"].double()[0, :64, 0]
    assert ((kk @ kk.T).tril(-1) * beta[:, None]).abs().max() > 1.4       # past float16's range
    outputs = {}
    for fused in (True, False):
        with _switched(True, 1, gluon_fused_t=fused):
            outputs[fused] = call(module, spec, inputs, output_final_state=True)
    want = reference_outputs(spec, inputs, output_final_state=True)
    for got, got_wy, ref in zip(outputs[True], outputs[False], want):
        assert not got.isnan().any()
        assert rel_rmse(got, ref) <= 2 * rel_rmse(got_wy, ref), (rel_rmse(got, ref), rel_rmse(got_wy, ref))


@jit
def _inverse_kernel(a, t, BT: gl.constexpr):
    """T = (I + A)^-1 of one [BT, BT] A through the pass's solve (_SOLVE: the emulated module's
    _t_guarded_inverse)."""
    L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
    o_r = gl.arange(0, BT, layout=gl.SliceLayout(1, L))
    o_c = gl.arange(0, BT, layout=gl.SliceLayout(0, L))
    w_s = gl.allocate_shared_memory(gl.float16, [3, BT, BT], gl.NVMMASharedLayout(128, 16, 2))
    b_t = _SOLVE(gl.load(a + o_r[:, None] * BT + o_c[None, :]), w_s, o_r, o_c, L)
    gl.store(t + o_r[:, None] * BT + o_c[None, :], b_t)


_SOLVE = None


def test_the_pass_solve_keeps_the_wy_stages_range_guard(emulated, monkeypatch):
    """FUSED_T's solve guards its range as the wy stage does: a random strictly lower A within 1 solves on float16
    operands, T within 10-bit rounding of float64's inverse; A_ij = 1.9 below the diagonal (beta near 2 over
    repeated keys) would overflow float16 in the product form's powers (~1.9^8 C(15, 8)), and solves on operands
    scaled into float16's range instead: finite, though the product form's cancellation leaves it far from the
    inverse there, as in the wy stage's tf32 path; where that inverse is well conditioned, the scaled path finds it
    as closely as the plain one."""
    module, _ = emulated
    monkeypatch.setitem(globals(), "_SOLVE", module._t_guarded_inverse)
    BT = 64
    i = torch.arange(BT)
    lower = i[:, None] > i[None, :]
    gen = torch.Generator().manual_seed(59)
    A = torch.where(lower, 2 * torch.rand(BT, BT, generator=gen) - 1, 0.).double()
    want = torch.linalg.inv(torch.eye(BT, dtype=torch.float64) + A)
    t = torch.full((BT, BT), float("nan"))
    _inverse_kernel[(1,)](A.float(), t, BT=BT)
    assert ((t.double() - want).norm() / want.norm()).item() <= 1e-2
    t = torch.full((BT, BT), float("nan"))
    _inverse_kernel[(1,)](torch.where(lower, 1.9, 0.), t, BT=BT)
    assert torch.isfinite(t).all()
    # the scaled path where the inverse is well conditioned: small entries and one of 1.5 in a diagonal block
    A = torch.where(lower, 0.3 * (2 * torch.rand(BT, BT, generator=gen) - 1), 0.).double()
    A[21, 20] = 1.5
    want = torch.linalg.inv(torch.eye(BT, dtype=torch.float64) + A)
    t = torch.full((BT, BT), float("nan"))
    _inverse_kernel[(1,)](A.float(), t, BT=BT)
    assert ((t.double() - want).norm() / want.norm()).item() <= 1e-2


@pytest.mark.parametrize("shape, pieces, h0", [
    (dict(B=2, T=256, H=2, HV=4), 1, True),      # grouped value heads: the pass forms T and sends it on
    (dict(B=1, T=256, H=2, HV=2), 1, True),      # one value head per query head
    (dict(B=1, T=512, H=1, HV=2), 2, True),      # pieces: their walk is the Gluon pass's, alone, before the pass
    (dict(B=2, T=512, H=1, HV=2), 4, False),     # ... walks from the second sequence's start and past a piece,
                                                 # no initial state
])
def test_training_step_with_the_pass_forming_t(emulated, wy_launches, count_launches, shape, pieces, h0):
    """A training step with override gluon_fused_t: the forward pass forms T and sends it to the tensor the
    backward keeps (no wy launch in the whole step; in pieces the walk to their start states is a Gluon launch of
    the pass's walk alone, not the Triton walk, which would read T); every gradient within bf16 roundings (2^-8)
    of the step fed by the wy stage and as close to float64 (5% slack), dh0 included, on NaN-poisoned buffers."""
    module, launches = emulated
    spec = load_spec(f"specs/{NAME}.yaml")
    inputs = make_inputs(spec, dtype=torch.bfloat16, device="cpu", seed=61, K=128, V=128, h0=h0, **shape)
    wy = wy_launches(module)
    triton_pass = count_launches(module, "_state_fwd_fast")
    grads = {}
    for fused in (True, False):
        wy.clear()
        launches["_state_output_gluon"].clear()
        triton_pass.count = 0
        with _switched(True, pieces, gluon_fused_t=fused):
            grads[fused], cotangents = _forward_backward(module, spec, inputs, seed=62)
        n = pieces * shape["B"]
        assert len(wy) == (0 if fused else 1)
        assert launches["_state_output_gluon"] == ([n, n] if fused and pieces > 1 else [n])
        assert triton_pass.count == (1 if pieces > 1 and not fused else 0)       # the Triton walk
    _, _, want = reference_gradients(spec, inputs, cotangents)
    assert ("initial_state" in want) == h0
    for name in want:
        assert not grads[True][name].isnan().any(), name
        assert rel_rmse(grads[True][name], grads[False][name]) <= 2 ** -8, name
        mine, theirs = rel_rmse(grads[True][name], want[name]), rel_rmse(grads[False][name], want[name])
        assert mine <= BARS.get(name, 1.0) and mine <= 1.05 * theirs, (name, mine, theirs)
