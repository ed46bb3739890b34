"""The chunk backward of one long sequence in time segments (gdngen.runtime.segments, issue #4 memory).

CPU tier: the kernels run under the Triton interpreter, so segments are forced (override(spec,
"backward_segments", value=S)) at tiny T: 2 and 3 segments over 4-5 chunks, the last one partial.
Segmented gradients must equal the one-call backward's (every recomputed quantity is chunk-local and
the reverse pass carries the same float32 state gradient across a boundary; only the fused gate's
per-head sums are added in another order) and match the float64 reference. Every buffer is
NaN-poisoned, so a token no segment writes fails the check.
"""
import importlib
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gdngen import reference
from gdngen.runtime import segments as seg
from gdngen.runtime.tiles import override
from gdngen.selfcheck import make_inputs, poisoned_memory, rel_rmse
from gdngen.spec import load_spec

FP32_TOL = 1e-4                 # vs the float64 reference, as tests/test_backward_cpu.py
SUM_TOL = 1e-6                  # segmented vs one call: the per-head sums' float32 order only


def _backward_name(spec):
    return f"{spec.chunk_function}_fwd_backward"


def _grads(name, segments, *, options=None, final_grad=True, h0=True, chunk_size=64, seed=0, **shape):
    """(grads by input name, how many backward calls ran, the float32 inputs) with ``segments`` forced."""
    options = dict(options or {})
    spec = load_spec(f"specs/{name}.yaml")
    module = importlib.import_module(f"generated.{name}")
    inputs = make_inputs(spec, B=1, seed=seed, h0=h0, fused_gate=options.get("use_gate_in_kernel", False),
                         beta_logits=options.get("use_beta_sigmoid_in_kernel", False), **shape)
    leaves = {n: x.detach().clone().requires_grad_(True) for n, x in inputs.items()
              if isinstance(x, torch.Tensor) and x.is_floating_point()}
    backward = getattr(module, _backward_name(spec))
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs.get("out") is not None)
        return backward(*args, **kwargs)

    replay = mock.patch.object(module, "reference_grads", side_effect=AssertionError("fell back to the replay"))
    with poisoned_memory(), replay, override(name, "backward_segments", value=segments), \
            mock.patch.object(module, _backward_name(spec), counted):
        o, ht = getattr(module, spec.chunk_function)(**{**inputs, **leaves}, output_final_state=final_grad,
                                                      chunk_size=chunk_size, **options)
        gen = torch.Generator().manual_seed(seed + 1)
        outputs, cotangents = [o], [torch.randn(o.shape, generator=gen)]
        if final_grad:
            outputs.append(ht)
            cotangents.append(torch.randn(ht.shape, generator=gen))
        got = torch.autograd.grad(outputs, list(leaves.values()), cotangents)
    return dict(zip(leaves, got)), calls, (spec, inputs, leaves, cotangents, options)


def _reference(spec, inputs, leaves, cotangents, options):
    ref_leaves = {n: x.detach().double().requires_grad_(True) for n, x in leaves.items()}
    args = {**inputs, **ref_leaves}
    positional = [args.pop(n, None) for n in ("q", "k", "v", "g", "beta")]
    ro, rht = reference.run(spec, *positional, form="recurrent", output_final_state=True, **args, **options)
    outputs = [ro, rht][:len(cotangents)]
    want = torch.autograd.grad(outputs, list(ref_leaves.values()), [c.double() for c in cotangents])
    return dict(zip(leaves, want))


def _same(a, b):
    """Bitwise equal, or (float32 sums in another order) within SUM_TOL of the larger entries."""
    if torch.equal(a, b):
        return True
    return bool((a - b).abs().max() <= SUM_TOL * b.abs().max())


GDN_FUSED = dict(use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
CASES = {
    # delta rule, scalar decay: fused gate (A_log, dt_bias), dht and h0, query heads == value heads
    "gdn-fused-mha": ("gated_delta_rule", dict(T=200, H=2, HV=2, K=16, V=16, options=GDN_FUSED)),
    # grouped value heads and the in-kernel L2 norm (dq / dk through a temporary), no dht, no h0
    "gdn-gva-l2norm-no-dht-no-h0": ("gated_delta_rule", dict(T=200, H=1, HV=2, K=16, V=16, final_grad=False,
                                                             h0=False, options=dict(use_qk_l2norm_in_kernel=True))),
    # grouped value heads without the L2 norm: the head-group sum writes into the output buffer
    "gdn-gva-fused-bt16": ("gated_delta_rule", dict(T=70, H=1, HV=2, K=16, V=12, chunk_size=16,
                                                    options=dict(GDN_FUSED, allow_neg_eigval=True))),
    # L2 norm with query heads == value heads, dht without h0
    "gdn-l2norm-mha-no-h0": ("gated_delta_rule", dict(T=200, H=2, HV=2, K=16, V=16, h0=False,
                                                      options=dict(use_qk_l2norm_in_kernel=True))),
    # per-channel decay with the delta rule
    "kda-gva-l2norm-bt16": ("kda", dict(T=70, H=1, HV=2, K=16, V=16, chunk_size=16,
                                        options=dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True))),
    "kda-mha-no-dht-no-h0-bt32": ("kda", dict(T=100, H=2, HV=2, K=16, V=16, chunk_size=32, final_grad=False,
                                              h0=False)),
    # per-channel decay, no delta
    "gla-gva-bt32": ("gla", dict(T=100, H=1, HV=2, K=16, V=16, chunk_size=32)),
    # no delta: scalar decay, and no decay at all
    "simple_gla-gva": ("simple_gla", dict(T=200, H=1, HV=2, K=16, V=16)),
    "simple_gla-mha-no-dht": ("simple_gla", dict(T=200, H=2, HV=2, K=16, V=16, final_grad=False)),
    "linear_attn-mha": ("linear_attn", dict(T=200, H=2, HV=2, K=16, V=16, options=dict(normalize=False))),
    # normalize=True: the chunk-start sums of phi(k) (one row per chunk) are cut like the states, z by tokens
    "linear_attn-normalize-gva-elu-bt32": ("linear_attn", dict(T=200, H=1, HV=2, K=16, V=16, chunk_size=32,
                                                               options=dict(normalize=True, feature_map="elu"))),
}


@pytest.mark.parametrize("segments", [2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_segmented_backward_equals_one_call_and_reference(case, segments):
    name, kwargs = CASES[case]
    one, calls_one, _ = _grads(name, 1, **kwargs)
    got, calls, problem = _grads(name, segments, **kwargs)
    assert calls_one == [False]
    assert calls == [True] * segments, "the backward did not run in the forced segments"
    for n in one:
        assert torch.isfinite(got[n]).all(), f"{n}: a token no segment wrote (NaN-poisoned buffer)"
        assert _same(got[n], one[n]), f"{n}: segmented differs from one call by {(got[n] - one[n]).abs().max():.3e}"
    want = _reference(*problem)
    errors = {n: rel_rmse(got[n], want[n]) for n in got}
    assert all(e <= FP32_TOL for e in errors.values()), f"relative RMSE vs float64: {errors}"


def test_segments_choice():
    shape = dict(K=128, V=128, BT=64, varlen=False)
    rule = seg.backward_segments
    assert rule("gated_delta_rule", B=1, T=32768, HV=32, **shape) == 4       # 1.75 GiB over 512 MiB
    assert rule("gated_delta_rule", B=1, T=131072, HV=32, **shape) == 8
    assert rule("gated_delta_rule", B=1, T=8192, HV=32, **shape) == 1
    assert rule("gated_delta_rule", B=4, T=8192, HV=32, **shape) == 1
    assert rule("gated_delta_rule", B=1, T=32768, HV=32, **dict(shape, varlen=True)) == 1
    # every segment keeps >= 64 chunks: never more than chunks // 64 segments
    assert rule("gated_delta_rule", B=1, T=127 * 64, HV=32, **shape) == 1
    assert rule("gated_delta_rule", B=1, T=32768, HV=32, K=128, V=128, BT=16, varlen=False) == 8
    # what the forward kept (T, V_new) and dq / dk written straight into the gradients are not counted:
    # 768 MiB at 32k x 32 heads (state gradients and W), 2 segments of 384 MiB; grouped value heads
    # (per-value-head dq / dk) at 128k tokens still take the 8
    lean = dict(shape, kept_tmat=True, kept_values=True, per_head_qk=False)
    assert seg.intermediate_bytes(B=1, T=32768, HV=32, K=128, V=128, BT=64, kept_tmat=True, kept_values=True,
                                  per_head_qk=False) == 768 << 20
    assert rule("gated_delta_rule", B=1, T=32768, HV=32, **lean) == 2
    assert rule("gated_delta_rule", B=1, T=16384, HV=32, **lean) == 1
    assert rule("gated_delta_rule", B=1, T=131072, HV=32, **dict(lean, per_head_qk=True)) == 8
    assert rule("gated_delta_rule", B=1, T=32768, HV=32, **dict(lean, kept_values=False)) == 2   # +256 MiB: 1 GiB
    assert rule("gated_delta_rule", B=1, T=32768, HV=32, **dict(lean, kept_tmat=False)) == 2     # float32 T: 1 GiB
    assert rule("gated_delta_rule", B=1, T=32768, HV=32, **dict(lean, kept_tmat=False, kept_values=False)) == 4
    # the fused backward keeps no state gradients or W: nothing to cut at 32k x 32 heads, nor at 128k x 32 value
    # heads when it adds each head group's dq / dk itself; per-value-head dq / dk (2 GiB there) still count
    fused = dict(lean, fused_bwd=True)
    assert seg.intermediate_bytes(B=1, T=32768, HV=32, K=128, V=128, BT=64, kept_tmat=True, kept_values=True,
                                  per_head_qk=False, fused_bwd=True) == 0
    assert rule("gated_delta_rule", B=1, T=32768, HV=32, **fused) == 1
    assert rule("gated_delta_rule", B=1, T=131072, HV=32, **fused) == 1
    assert rule("gated_delta_rule", B=1, T=131072, HV=32, **dict(fused, per_head_qk=True)) == 4
    for T in (4096, 8192, 16384, 32768, 65536, 131072):
        for HV in (1, 4, 32, 64):
            S = rule("kda", B=1, T=T, HV=HV, **shape)
            assert S in (1, 2, 4, 8) and (S == 1 or -(-T // 64) // S >= seg.MIN_SEGMENT_CHUNKS)
    # forced: any count at tiny T, at most one segment per chunk, still 1 where segments cannot apply
    with override("gated_delta_rule", "backward_segments", value=3):
        assert rule("gated_delta_rule", B=1, T=200, HV=2, K=16, V=16, BT=64, varlen=False) == 3
        assert rule("gated_delta_rule", B=1, T=100, HV=2, K=16, V=16, BT=64, varlen=False) == 2
        assert rule("gated_delta_rule", B=2, T=200, HV=2, K=16, V=16, BT=64, varlen=False) == 1
        assert rule("gated_delta_rule", B=1, T=200, HV=2, K=16, V=16, BT=64, varlen=True) == 1
        assert rule("kda", B=1, T=200, HV=2, K=16, V=16, BT=64, varlen=False) == 1
    assert seg.segment_bounds(4, 3) == [0, 1, 2, 4]
    assert seg.segment_bounds(512, 8) == [64 * i for i in range(9)]


class _Allocations(TorchDispatchMode):
    """Every op output that aliases none of its inputs (a new buffer): (op, nbytes)."""

    def __init__(self):
        super().__init__()
        self.new = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(result)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.new.append((str(func), t.untyped_storage().nbytes()))
        return result


@pytest.mark.parametrize("case,per_segment", [("gdn-fused-mha", False), ("simple_gla-gva", False),
                                              ("kda-mha-no-dht-no-h0-bt32", True)])
def test_segments_launch_the_scalar_gates_once(case, per_segment, count_launches):
    """A scalar decay's gates stage runs once, in the forward: the op keeps its [n, B, T, HV] output,
    and the backward, in one call or in segments, cuts it by tokens instead of launching the stage
    (gradients as the one-call backward's: the test above); a per-channel decay's cumsum is the size
    of k, so there the backward forms its own, in each segment."""
    name, kwargs = CASES[case]
    module = importlib.import_module(f"generated.{name}")
    launches = {}
    for segments in (1, 3):
        counted = count_launches(module, "_gates_fwd_fast")
        _, calls, _ = _grads(name, segments, **kwargs)
        assert len(calls) == segments
        launches[segments] = counted.count
    if per_segment:                             # the forward's launches, then the backward's again per segment
        forward = launches[1] // 2
        assert launches[3] == forward * (1 + 3), launches
    else:                                       # the forward's one launch; the backward takes what it kept
        assert launches == {1: 1, 3: 1}, launches


@pytest.mark.parametrize("options,H", [({}, 2), (dict(use_qk_l2norm_in_kernel=True), 1)])
def test_segments_allocate_no_full_length_intermediate(options, H):
    """In 4 segments the backward allocates nothing of a quarter of q's size or more but the gradient
    buffers (dq, dk, dv); in one call the chunk-end state gradients, W, dV_new ... are all full length
    (T and V_new are the forward's, kept: the backward allocates neither - float16 intermediates always
    take the T path, so the forward keeps T at this small N * HV too)."""
    spec = load_spec("specs/gated_delta_rule.yaml")
    module = importlib.import_module("generated.gated_delta_rule")
    inputs = make_inputs(spec, B=1, T=256, H=H, HV=2, K=16, V=16)
    leaves = {n: inputs[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta", "initial_state")}
    found = {}
    for segments in (1, 4):
        o, ht = module.chunk_gated_delta_rule(**{**inputs, **leaves}, output_final_state=True, chunk_size=16,
                                              **options)
        do, dht = torch.randn_like(o), torch.randn_like(ht)
        with override("gated_delta_rule", "backward_segments", value=segments), _Allocations() as seen:
            torch.autograd.grad([o, ht], list(leaves.values()), [do, dht])
        found[segments] = sorted(nbytes for _, nbytes in seen.new if nbytes > inputs["v"].nbytes // 4)
    assert found[4] == sorted([inputs["q"].nbytes, inputs["k"].nbytes, inputs["v"].nbytes]), found
    assert len(found[1]) >= 5, found


def test_first_call_compile_gets_the_segmented_closure():
    """compile_first_call receives the closure the real call runs: the segmented one."""
    spec = load_spec("specs/simple_gla.yaml")
    module = importlib.import_module("generated.simple_gla")
    inputs = make_inputs(spec, B=1, T=64, H=1, HV=2, K=16, V=16, h0=False)
    leaves = {n: inputs[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g")}
    closures, calls = [], []
    backward = getattr(module, _backward_name(spec))

    def counted(*args, **kwargs):
        calls.append(kwargs.get("tile_T"))
        return backward(*args, **kwargs)

    def fake_compile(op, tensors, options, run):
        closures.append((op, run))
        return False

    with override("simple_gla", "backward_segments", value=2), \
            mock.patch.object(module, "compile_first_call", fake_compile), \
            mock.patch.object(module, _backward_name(spec), counted):
        o, _ = module.chunk_simple_gla(**{**inputs, **leaves}, chunk_size=16)
        torch.autograd.grad(o, list(leaves.values()), torch.randn_like(o))
        assert calls == [64, 64]               # two segments, tiles looked up for the whole length
        [run] = [run for op, run in closures if op.endswith("_backward")]
        run()
        assert calls == [64] * 4


def test_segments_look_tiles_up_for_the_whole_length():
    """Tuned tables are keyed by the sequence length's class: a segment (here 32 of 64 tokens) asks
    for the whole call's T, in its recomputed forward stages (wy) and in every backward stage.
    delta_rule: at N * HV = 2 its forward takes the W/U path and keeps no T, so the backward recomputes
    it (the bundled GDN spec's float16 intermediates always keep T)."""
    spec = load_spec("specs/delta_rule.yaml")
    module = importlib.import_module("generated.delta_rule")
    inputs = make_inputs(spec, B=1, T=64, H=1, HV=2, K=16, V=16)
    leaves = {n: inputs[n].clone().requires_grad_(True) for n in ("q", "k", "v", "beta")}
    o, _ = module.chunk_delta_rule(**{**inputs, **leaves}, chunk_size=16)
    asked = []

    def recording(real):
        def lookup(*args, **shape):
            asked.append((args[-1], shape["T"]))
            return real(*args, **shape)
        return lookup

    with override("delta_rule", "backward_segments", value=2), \
            mock.patch.object(module, "tiles", recording(module.tiles)), \
            mock.patch.object(module, "backward_tiles", recording(module.backward_tiles)):
        torch.autograd.grad(o, list(leaves.values()), torch.randn_like(o))
    stages = [stage for stage, _ in asked]        # wy: the recomputed forward's and the backward's
    assert stages.count("wy") == 4 and stages.count("state") == 2 and stages.count("chunk") == 2, asked
    assert {T for _, T in asked} == {64}, asked
