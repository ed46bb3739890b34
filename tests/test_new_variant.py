"""The card's promise: a researcher writes a spec, runs `gdngen build`, imports the module, and it is right.

The spec below is written here, outside the catalogue, and touches no template: per-key-channel
decay with the delta rule but only sigmoid-logit betas and chunk sizes 16/32.
"""
import importlib.util

import pytest

from gdngen.cli import main
from gdngen.selfcheck import make_inputs, reference_outputs, rel_rmse
from gdngen.spec import load_spec

SPEC = """\
# A user's variant: vector gates with the delta rule, beta always given as logits.
name: user_vector_delta
description: Per-channel decay with the delta rule, beta from logits inside the op.
transition:
  decay: vector
  delta: true
gates:
  beta: [sigmoid]
qk_l2norm: true
heads: {max_k: 64, max_v: 64, gva: true}
chunk: {sizes: [16, 32], default: 32}
"""


def test_a_new_variant_by_spec_alone(tmp_path, capsys):
    spec_path = tmp_path / "user_vector_delta.yaml"
    spec_path.write_text(SPEC)
    assert main(["build", str(spec_path), "--out", str(tmp_path / "mine")]) == 0
    assert "wrote" in capsys.readouterr().out
    path = tmp_path / "mine" / "user_vector_delta.py"
    module_spec = importlib.util.spec_from_file_location("user_vector_delta", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)

    spec = load_spec(spec_path)
    inputs = make_inputs(spec, B=1, T=37, H=1, HV=2, K=16, V=16, beta_logits=True)
    options = dict(use_beta_sigmoid_in_kernel=True, use_qk_l2norm_in_kernel=True)
    o_ref, ht_ref = reference_outputs(spec, inputs, output_final_state=True, **options)
    for chunk_size in (16, 32):
        o, ht = module.chunk_user_vector_delta(**inputs, output_final_state=True, chunk_size=chunk_size, **options)
        assert rel_rmse(o, o_ref) <= 1e-5 and rel_rmse(ht, ht_ref) <= 1e-5
    o, ht = module.fused_recurrent_user_vector_delta(**inputs, output_final_state=True, **options)
    assert rel_rmse(o, o_ref) <= 1e-5 and rel_rmse(ht, ht_ref) <= 1e-5

    # gradients flow (through the float64 replay until generated backward kernels land)
    q = inputs["q"].clone().requires_grad_()
    o, _ = module.chunk_user_vector_delta(**{**inputs, "q": q}, **options)
    o.square().sum().backward()
    q_ref = inputs["q"].double().clone().requires_grad_()
    o_ref, _ = reference_outputs(spec, {**inputs, "q": q_ref}, **options)
    o_ref.square().sum().backward()
    assert rel_rmse(q.grad, q_ref.grad) <= 1e-4

    # what the spec does not offer is refused by name
    with pytest.raises(ValueError, match="chunk_size"):
        module.chunk_user_vector_delta(**inputs, chunk_size=64, **options)
