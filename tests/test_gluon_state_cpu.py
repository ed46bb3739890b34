"""The fused forward state pass in Gluon (stages/state_gluon.py.j2, gdngen.runtime.gluon): which specs
render it, when a call takes it, and how many pieces it cuts a sequence into. Gluon does not run on
the CPU interpreter; its outputs are checked on the H200 (tests/test_gluon_state_gpu.py)."""
import importlib

import pytest
import torch

from gdngen.autotune.device import DeviceInfo, use_device
from gdngen.plan import build_plan
from gdngen.runtime import override
from gdngen.runtime import gluon
from gdngen.runtime.tiles import state_pieces
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


def test_override_turns_it_off_and_names_the_chunk():
    q, k, v = _qkv()
    with override("gated_delta_rule", "gluon_state", value=False):
        assert gluon.state_pass_unusable("gated_delta_rule", q, k, v, K=128, V=128, BT=64, T=128) == "turned off (override)"
    if gluon.AVAILABLE:
        assert "chunk 32" in gluon.state_pass_unusable("gated_delta_rule", q, k, v, K=128, V=128, BT=32, T=128)


def test_one_program_per_sm_pieces():
    """The Gluon pass holds one program per SM (147 KB of shared memory) with the whole V per program."""
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


def test_score_dtype_constexpr():
    """The pass's scores dtype goes in as a Gluon dtype; anything but a 16-bit float is refused by name."""
    if not gluon.AVAILABLE:
        pytest.skip("no Gluon")
    assert gluon.gl_dtype(torch.float16) == gluon.gl.float16 and gluon.gl_dtype(torch.bfloat16) == gluon.gl.bfloat16
    with pytest.raises(TypeError, match="score_dtype"):
        gluon.gl_dtype(torch.float32)


def test_reverse_pass_in_gluon_is_off_by_default(spec_variant):
    """The backward's Gluon reverse pass is rendered for the bundled GDN spec and runs only when asked (it has
    not run on a GPU yet); asked, it still needs what the forward's pass needs (a CPU tensor never qualifies)."""
    module = importlib.import_module("generated.gated_delta_rule")
    assert callable(module._state_bwd_gluon)
    assert not hasattr(importlib.import_module("generated.delta_rule"), "_state_bwd_gluon")
    x = torch.zeros(1, 64, 2, 128, dtype=torch.bfloat16)
    assert not gluon.state_bwd_usable("gated_delta_rule", x, x, x, K=128, V=128, BT=64, T=64)
    with override("gated_delta_rule", "gluon_state_bwd", value=True):
        assert not gluon.state_bwd_usable("gated_delta_rule", x, x, x, K=128, V=128, BT=64, T=64)   # not CUDA
