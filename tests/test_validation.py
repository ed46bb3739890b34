"""Bad inputs to the generated public functions fail in validate_chunk_call, before any launch,
with a TypeError/ValueError naming the offending argument."""
import re

import pytest
import torch

from generated.delta_rule import SPEC_INFO as DELTA_INFO, chunk_delta_rule
from generated.gated_delta_rule import SPEC_INFO as GDR_INFO, chunk_gated_delta_rule
from generated.linear_attn import chunk_linear_attn
from generated.simple_gla import chunk_simple_gla
from gdngen.runtime import validate_chunk_call

B, T, H, HV, K, V = 2, 8, 2, 4, 16, 8


def _inputs(b=B, t=T, h=H, hv=HV, k=K, v=V, dtype=torch.float32):
    return dict(
        q=torch.randn(b, t, h, k, dtype=dtype),
        k=torch.randn(b, t, h, k, dtype=dtype),
        v=torch.randn(b, t, hv, v, dtype=dtype),
        g=-torch.rand(b, t, hv),
        beta=torch.rand(b, t, hv),
    )


def gdr(**over):
    x = _inputs()
    args = {name: over.pop(name, x[name]) for name in ("q", "k", "v", "g", "beta")}
    return chunk_gated_delta_rule(args["q"], args["k"], args["v"], args["g"], args["beta"], **over)


def _raises(exc, name, fn, **kwargs):
    """fn(**kwargs) raises ``exc`` whose message names the argument ``name``."""
    with pytest.raises(exc) as info:
        fn(**kwargs)
    message = str(info.value)
    assert re.search(rf"(^|[\s,(']){re.escape(name)}\b", message), message
    return message


# -- q, k, v --------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(B, T, H), (B, T, H, K, 1), (T, H * K)])
def test_q_wrong_rank(shape):
    msg = _raises(ValueError, "q", gdr, q=torch.randn(*shape))
    assert "dimensions" in msg


def test_q_not_a_tensor():
    _raises(TypeError, "q", gdr, q=[[1.0]])


@pytest.mark.parametrize("shape", [(B, T, H, K + 1), (B, T, H + 1, K), (B, T + 1, H, K), (B + 1, T, H, K)])
def test_k_shape_mismatch(shape):
    msg = _raises(ValueError, "k", gdr, k=torch.randn(*shape))
    assert str(shape) in msg


@pytest.mark.parametrize("shape", [(B + 1, T, HV, V), (B, T - 1, HV, V)])
def test_v_wrong_batch_or_time(shape):
    _raises(ValueError, "v", gdr, v=torch.randn(*shape))


def test_hv_not_multiple_of_h():
    msg = _raises(ValueError, "v", gdr, v=torch.randn(B, T, 3, V), g=-torch.rand(B, T, 3), beta=torch.rand(B, T, 3))
    assert "HV=3" in msg and "H=2" in msg


def test_head_dim_k_too_large():
    x = _inputs(k=GDR_INFO["max_k"] + 4)
    msg = _raises(ValueError, "q", gdr, q=x["q"], k=x["k"])
    assert "K=260" in msg


def test_head_dim_v_too_large():
    _raises(ValueError, "v", gdr, v=torch.randn(B, T, HV, 300))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
def test_integer_q(dtype):
    _raises(TypeError, "q", gdr, q=torch.ones(B, T, H, K, dtype=dtype))


def test_dtype_outside_spec():
    x = _inputs(dtype=torch.float64)
    _raises(TypeError, "q", gdr, q=x["q"], k=x["k"], v=x["v"])


def test_mixed_dtypes():
    msg = _raises(TypeError, "k", gdr, k=torch.randn(B, T, H, K, dtype=torch.float16))
    assert "torch.float16" in msg and "torch.float32" in msg
    _raises(TypeError, "v", gdr, v=torch.randn(B, T, HV, V, dtype=torch.bfloat16))


# -- g and beta -----------------------------------------------------------------------------

def test_g_missing_for_gated_delta_rule():
    _raises(ValueError, "g", gdr, g=None)


def test_g_missing_for_simple_gla():
    x = _inputs()
    _raises(ValueError, "g", chunk_simple_gla, q=x["q"], k=x["k"], v=x["v"], g=None)


def test_g_wrong_shape():
    _raises(ValueError, "g", gdr, g=-torch.rand(B, T, H))
    _raises(ValueError, "g", gdr, g=-torch.rand(B, T, HV, K))     # per-channel g for a scalar decay


def test_g_given_for_delta_rule():
    x = _inputs()
    # The public function has no g parameter at all ...
    with pytest.raises(TypeError, match="'g'"):
        chunk_delta_rule(x["q"], x["k"], x["v"], x["beta"], g=x["g"])
    # ... and the shared validation refuses one for a spec without decay.
    _raises(ValueError, "g", validate_chunk_call, info=DELTA_INFO, q=x["q"], k=x["k"], v=x["v"],
            g=x["g"], beta=x["beta"])


def test_beta_missing_for_delta_rule():
    x = _inputs()
    _raises(ValueError, "beta", chunk_delta_rule, q=x["q"], k=x["k"], v=x["v"], beta=None)


@pytest.mark.parametrize("shape", [(B, T, H), (B, T), (B, T, HV, 1), (B, T + 1, HV)])
def test_beta_wrong_shape(shape):
    _raises(ValueError, "beta", gdr, beta=torch.rand(*shape))


def test_beta_wrong_shape_delta_rule():
    x = _inputs()
    _raises(ValueError, "beta", chunk_delta_rule, q=x["q"], k=x["k"], v=x["v"], beta=torch.rand(B, T, H))


# -- cu_seqlens -----------------------------------------------------------------------------

def _packed(**over):
    x = _inputs(b=1)
    args = {name: over.pop(name, x[name]) for name in ("q", "k", "v", "g", "beta")}
    return chunk_gated_delta_rule(args["q"], args["k"], args["v"], args["g"], args["beta"], **over)


def test_cu_seqlens_needs_batch_one():
    msg = _raises(ValueError, "cu_seqlens", gdr, cu_seqlens=torch.tensor([0, 4, T]))
    assert f"B={B}" in msg


def test_cu_seqlens_must_start_at_zero():
    _raises(ValueError, "cu_seqlens", _packed, cu_seqlens=torch.tensor([1, 4, T]))


def test_cu_seqlens_must_end_at_t():
    msg = _raises(ValueError, "cu_seqlens", _packed, cu_seqlens=torch.tensor([0, 4, T - 1]))
    assert f"T={T}" in msg


def test_cu_seqlens_decreasing():
    _raises(ValueError, "cu_seqlens", _packed, cu_seqlens=torch.tensor([0, 6, 3, T]))


def test_cu_seqlens_too_short():
    _raises(ValueError, "cu_seqlens", _packed, cu_seqlens=torch.tensor([0]))


def test_cu_seqlens_float_dtype():
    _raises(TypeError, "cu_seqlens", _packed, cu_seqlens=torch.tensor([0.0, 4.0, float(T)]))


def test_cu_seqlens_not_a_tensor():
    _raises(TypeError, "cu_seqlens", _packed, cu_seqlens=[0, 4, T])


def test_cu_seqlens_two_dimensional():
    # Reported as TypeError today (one check covers dtype and rank); a ValueError would fit the
    # "shape -> ValueError" convention better, so either is accepted here.
    _raises((TypeError, ValueError), "cu_seqlens", _packed, cu_seqlens=torch.tensor([[0, 4, T]]))


# -- initial_state --------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(B + 1, HV, K, V), (B, H, K, V), (B, HV, V, K), (HV, K, V)])
def test_initial_state_wrong_shape_dense(shape):
    msg = _raises(ValueError, "initial_state", gdr, initial_state=torch.zeros(*shape))
    assert str((B, HV, K, V)) in msg


def test_initial_state_wrong_shape_varlen():
    cu = torch.tensor([0, 3, 5, T])          # N = 3 sequences
    msg = _raises(ValueError, "initial_state", _packed, cu_seqlens=cu, initial_state=torch.zeros(1, HV, K, V))
    assert str((3, HV, K, V)) in msg


def test_initial_state_integer():
    _raises(TypeError, "initial_state", gdr, initial_state=torch.zeros(B, HV, K, V, dtype=torch.int32))


# -- options --------------------------------------------------------------------------------

@pytest.mark.parametrize("chunk_size", [48, 8, 128, 0])
def test_chunk_size_not_in_spec(chunk_size):
    msg = _raises(ValueError, "chunk_size", gdr, chunk_size=chunk_size)
    assert "[16, 32, 64]" in msg


def test_chunk_size_simple_gla():
    x = _inputs()
    _raises(ValueError, "chunk_size", chunk_simple_gla, q=x["q"], k=x["k"], v=x["v"], g=x["g"], chunk_size=48)


def test_use_gate_in_kernel_without_a_log():
    _raises(ValueError, "A_log", gdr, use_gate_in_kernel=True)


@pytest.mark.parametrize("shape", [(H,), (HV, 1), ()])
def test_a_log_wrong_shape(shape):
    _raises(ValueError, "A_log", gdr, use_gate_in_kernel=True, A_log=torch.zeros(shape))


def test_dt_bias_wrong_shape():
    _raises(ValueError, "dt_bias", gdr, use_gate_in_kernel=True, A_log=torch.zeros(HV), dt_bias=torch.zeros(H))


def test_a_log_without_use_gate_in_kernel():
    _raises(ValueError, "A_log", gdr, A_log=torch.zeros(HV))


def test_allow_neg_eigval_without_beta_sigmoid():
    _raises(ValueError, "allow_neg_eigval", gdr, allow_neg_eigval=True)
    x = _inputs()
    _raises(ValueError, "allow_neg_eigval", chunk_delta_rule, q=x["q"], k=x["k"], v=x["v"], beta=x["beta"],
            allow_neg_eigval=True)


def test_options_outside_the_spec():
    """Options the spec does not offer are refused by the shared validation."""
    x = _inputs()
    base = dict(q=x["q"], k=x["k"], v=x["v"], g=None, beta=x["beta"])
    _raises(ValueError, "use_gate_in_kernel", validate_chunk_call, info=DELTA_INFO, use_gate_in_kernel=True,
            A_log=torch.zeros(HV), **base)
    no_sigmoid = dict(GDR_INFO, beta_sigmoid=False, neg_eigval=False)
    base["g"] = x["g"]
    _raises(ValueError, "use_beta_sigmoid_in_kernel", validate_chunk_call, info=no_sigmoid,
            use_beta_sigmoid_in_kernel=True, **base)
    _raises(ValueError, "allow_neg_eigval", validate_chunk_call, info=no_sigmoid, allow_neg_eigval=True, **base)
    no_gva = dict(GDR_INFO, gva=False)
    _raises(ValueError, "v", validate_chunk_call, info=no_gva, **base)


@pytest.mark.parametrize("scale", ["0.25", [0.25], True, torch.tensor(0.25)])
def test_scale_wrong_type(scale):
    _raises(TypeError, "scale", gdr, scale=scale)


def test_linear_attn_validates():
    x = _inputs()
    _raises(ValueError, "q", chunk_linear_attn, q=x["q"][0], k=x["k"], v=x["v"])
    _raises(ValueError, "k", chunk_linear_attn, q=x["q"], k=x["k"][:, :-1], v=x["v"])
    _raises(ValueError, "initial_state", chunk_linear_attn, q=x["q"], k=x["k"], v=x["v"],
            initial_state=torch.zeros(B, HV, K, V + 1))
    _raises(TypeError, "scale", chunk_linear_attn, q=x["q"], k=x["k"], v=x["v"], scale="1")


# -- the happy path through validation --------------------------------------------------------

def test_valid_call_passes_validation():
    x = _inputs()
    p = validate_chunk_call(GDR_INFO, x["q"], x["k"], x["v"], x["g"], x["beta"], scale=0.5,
                            initial_state=torch.zeros(B, HV, K, V), chunk_size=32,
                            use_gate_in_kernel=True, A_log=torch.zeros(HV), dt_bias=torch.zeros(HV),
                            use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    assert (p.B, p.T, p.H, p.HV, p.K, p.V, p.N, p.varlen) == (B, T, H, HV, K, V, B, False)
    y = _inputs(b=1)
    p = validate_chunk_call(GDR_INFO, y["q"], y["k"], y["v"], y["g"], y["beta"],
                            cu_seqlens=torch.tensor([0, 3, 3, T], dtype=torch.int32),
                            initial_state=torch.zeros(3, HV, K, V))
    assert p.N == 3 and p.varlen


# -- CUDA grid limits: the chunk stages launch chunks and (sequence x value head) pairs on grid axes
# that CUDA caps at 65535 programs; past it a launch fails with "invalid argument" (seen on the H200)

def test_too_many_sequences_times_value_heads():
    x = _inputs(b=1, t=1, h=1, hv=65536, k=1, v=1)
    msg = _raises(ValueError, "v", chunk_simple_gla, q=x["q"], k=x["k"], v=x["v"], g=x["g"])
    assert "65536" in msg and "65535" in msg


def test_too_many_chunks_dense():
    t = 65535 * 16 + 1                      # one chunk past the limit at chunk_size=16
    x = _inputs(b=1, t=t, h=1, hv=1, k=1, v=1)
    msg = _raises(ValueError, "q", chunk_simple_gla, q=x["q"], k=x["k"], v=x["v"], g=x["g"], chunk_size=16)
    assert "65536 chunks" in msg and "chunk_size=16" in msg


def test_too_many_chunks_varlen_counts_each_sequence():
    # T = 65535 chunks of 16 when packed densely, but split in two sequences each ends in a partial
    # chunk: 32768 + 32768 = 65536 launched chunks
    t = 65535 * 16
    x = _inputs(b=1, t=t, h=1, hv=1, k=1, v=1)
    cu = torch.tensor([0, 16 * 32767 + 1, t], dtype=torch.int32)
    msg = _raises(ValueError, "q", chunk_simple_gla, q=x["q"], k=x["k"], v=x["v"], g=x["g"], cu_seqlens=cu,
                  chunk_size=16)
    assert "65536 chunks" in msg


def test_grid_limit_not_applied_below_it():
    x = _inputs(b=1, t=65535 * 16, h=1, hv=1, k=1, v=1)
    validate_chunk_call(GDR_INFO, x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=16)
