"""The stage plan: the intermediate form between a validated Spec and the rendered module.

A plan says which stage kernels the chunk forward runs, in which order, with which printed
expressions from the algebra, and what the public API looks like.  It is plain data, so
``gdngen show SPEC`` can print it and tests can inspect it without rendering anything.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache


from gdngen import algebra
from gdngen.algebra import feature_maps
from gdngen.spec import Spec

# Names the stage templates give their block values; the printer maps algebra symbols onto them.
_ROW_COL = {"g_row": "b_g[:, None]", "g_col": "b_g[None, :]"}
_ROW = {"g_row": "b_g"}
_TOKEN = {"g_last": "b_g"}
_COL = {"g_col": "b_g"}
_UPDATE = {"g_last": "b_g_last", "g_col": "b_g"}
_LAST = {"g_last": "b_g_last"}
L2NORM_EPS = "1e-6"
LOG_DECAY_FLOOR = "-60.0"     # exp(-60) ~ 1e-26: below float32's resolution of O(1) values


@dataclass(frozen=True)
class Stage:
    name: str          # e.g. "wy"
    template: str      # path under templates/
    kernel: str        # the @triton.jit function it defines
    purpose: str


@dataclass(frozen=True)
class Plan:
    spec: Spec
    backend: str                     # "triton": generated kernels; "reference": float64 fallback
    stages: tuple[Stage, ...]
    exprs: dict = field(default_factory=dict)     # printed Triton expressions for the templates
    info: dict = field(default_factory=dict)      # spec summary the runtime validation reads
    reason: str = ""                 # why the backend is "reference", when it is
    # backward: "triton" (generated kernels, BACKWARD_STAGES) or "reference" (float64 replay)
    backward_backend: str = "reference"
    backward_stages: tuple[Stage, ...] = ()
    backward_reason: str = ""


STAGES = {
    "l2norm": Stage("l2norm", "stages/l2norm.py.j2", "_l2norm_fwd_kernel",
                    "L2-normalise q and k rows (use_qk_l2norm_in_kernel)"),
    "random_features": Stage("random_features", "stages/random_features.py.j2", "_random_features_fwd_kernel",
                             "Performer features phi(x) = exp(W x - |x|^2/2) / sqrt(m) of q and k (K -> m), once"),
    "gates": Stage("gates", "stages/gates.py.j2", "_gates_fwd_kernel",
                   "activate the gates; chunk-local cumsum of the log-decay"),
    "wy": Stage("wy", "stages/wy.py.j2", "_wy_fwd_kernel_bt<BT>",
                "A = beta K K^T * decay, T = (I + A)^-1 (W and U too when store_wu)"),
    "state": Stage("state", "stages/state.py.j2", "_state_fwd_kernel",
                   "sequential pass over chunks: chunk-start states, final state, V_new"),
    "output": Stage("output", "stages/output.py.j2", "_output_fwd_kernel",
                    "outputs: inter-chunk (Q S) plus intra-chunk causal attention"),
    # normalize=True (linear attention): z_t = scale * phi(q_t) . sum_{s<=t} phi(k_s) by a scan of
    # its own, O(T K) per head, instead of a second pass of the chunk op with a value column of ones
    "normalizer": Stage("normalizer", "stages/normalizer.py.j2", "_normalizer_kernel",
                        "normalize: z_t = scale phi(q_t) . cumsum phi(k) per key tile; its gradients by the same scan"),
    # The token recurrence (decode, speculative verify, state pools): its own public function,
    # rendered for every spec, per-channel decay included (a [BK] decay row is just a vector).
    "recurrent": Stage("recurrent", "stages/recurrent.py.j2", "_recurrent_fwd_kernel",
                       "fused_recurrent: token-by-token forward, state in registers (decode/verify)"),
}


def _print(expr, names: dict) -> str:
    """Print an algebra expression with its symbols renamed to the template's block values."""
    if expr is None:
        return "None"
    mapping = {sym: names[sym.name] for sym in expr.free_symbols}
    # exp(x) as exp2(x * log2 e): ex2.approx.ftz, one multiply and one MUFU op, where tl.exp lowers
    # to the same multiply and a non-ftz ex2 that ptxas wraps in a denormal fix-up (FSETP + 2 FMUL;
    # Triton 3.6, sm_90). Equal results except outputs below float32's normal range (flushed to 0).
    return algebra.to_triton(expr, mapping, use_exp2=True)


def print_factor(plan: Plan, name: str, **names: str) -> str:
    """Print one of the algebra's chunk factors with its cumsum symbols named by the template."""
    alg = algebra.derive(plan.spec.transition.decay, plan.spec.transition.delta)
    return _print(getattr(alg, name), names)


@lru_cache(maxsize=None)
def build_plan(spec: Spec) -> Plan:
    alg = algebra.derive(spec.transition.decay, spec.transition.delta)
    t = spec.transition
    info = {
        "name": spec.name,
        "decay": t.decay,
        "delta": t.delta,
        "chunk_sizes": list(spec.chunk.sizes),
        "max_k": spec.heads.max_k,
        "max_v": spec.heads.max_v,
        "gva": spec.heads.gva,
        "input_dtypes": list(spec.dtypes.inputs),
        "gate_fused": "fused" in spec.gates.decay,
        "beta_sigmoid": "sigmoid" in spec.gates.beta,
        "neg_eigval": t.allow_neg_eigval,
        "qk_l2norm": spec.qk_l2norm,
        "feature_maps": list(spec.feature_maps),
    }
    exprs = {
        "score_decay": _print(alg.score_decay, _ROW_COL),
        "query_state_decay": _print(alg.query_state_decay, _ROW),
        "key_w_decay": _print(alg.key_w_decay, _COL),
        "key_update_decay": _print(alg.key_update_decay, _UPDATE),
        "state_decay": _print(alg.state_decay, _LAST),
        # One token is a chunk of length one: its decay is the chunk's state decay at g_last = g_t.
        "token_decay": _print(alg.state_decay, _TOKEN),
        "decay_activation": _print(algebra.decay_activation(),
                                   {"x": "b_g", "A_log": "b_A_log", "dt_bias": "b_dt_bias"}),
        "beta_activation": _print(algebra.beta_activation(False), {"b": "b_beta"}),
        "beta_activation_neg": _print(algebra.beta_activation(True), {"b": "b_beta"}),
        "l2norm_eps": L2NORM_EPS,
        "log_decay_floor": LOG_DECAY_FLOOR,
        "gate_fused": info["gate_fused"],
        "beta_sigmoid": info["beta_sigmoid"],
    }
    # Vector decay runs the same stages: the templates apply its factors per key channel inside
    # the contraction over K (`per_channel`), on 16-row sub-blocks so no exponent is positive.
    exprs["per_channel"] = alg.per_channel
    # Per-key-channel decay with the delta rule: the wy stage builds A's decayed key products level
    # by level (stages/_channel_chunk_scores.j2) and, with the same exponent tiles and g loads, the
    # output's scores A_qk (one more dot per level and key tile), written to a [B, T, HV, BT] buffer;
    # the output stage then loads A_qk instead of running the levels again.
    exprs["aqk_from_wy"] = alg.per_channel and t.delta
    # Per-key-channel decay, 16-bit inputs: a chunk-parallel stage that holds the float32 cumsum
    # tile also writes the state pass's decayed key tiles (stages/_channel_key_tiles.j2) in k's
    # dtype, which the state pass rounds them to anyway, so the sequential pass loads them instead
    # of building them from k and the float32 g_cum tile per chunk (float32 inputs: the state pass
    # builds them). Which tiles: K * key_update_decay always; with the delta rule also
    # K * key_w_decay (the T path's W S). Which stage: without the delta rule the gates stage
    # (key_tiles_from_gates); with it the wy stage (key_tiles_from_wy).
    exprs["state_key_tiles"] = alg.per_channel
    exprs["key_tiles_from_gates"] = alg.per_channel and not t.delta
    # Per-key-channel decay with the delta rule: the wy stage (chunk-parallel) loads the chunk's k
    # and float32 cumsum tiles per key tile anyway and writes the key tiles from them; the gates
    # stage then reads g and writes its cumsum only, and k is read once less. At (4,8192,16,16)
    # K=V=128 bf16, g float32: gates + wy bytes 1.61 -> 1.48 GB (the gates launch's 939 -> 537 MB);
    # sm_90 model (Triton 3.6, benchmarks/sass_profile.py): gates 0.102 -> 0.050 ms, wy 0.529 ->
    # 0.548 (234 registers, no spill). Forming the cumsum in the wy stage too (tl.cumsum per key
    # tile; the gates launch over g gone, 1.21 GB) modelled wy at 0.748 ms - a cross-warp scan
    # per key tile on its latency-bound path - against 0.598 here (branch kda-gates-wy, 71b7666).
    exprs["key_tiles_from_wy"] = alg.per_channel and t.delta
    exprs.update(_feature_map_exprs(spec))
    # Scalar decay: a chunk's transition has norm exp(its summed log-decay) (times
    # max(1, |1 - beta |k|^2|) per token with the delta rule), so a state's share of a later one is
    # bounded by data the state pass already reads. The pass can then run a long sequence as pieces
    # side by side, each starting from a walk back over the chunks before it
    # (gdngen.runtime.tiles.state_pieces). Per-channel decay and feature maps on k are left out.
    exprs["state_pieces"] = spec.has_decay and not alg.per_channel and not (
        exprs["feature_map_exprs"] or exprs["random_features_expr"])
    # A forward nothing differentiates runs the output in the state pass (tiles.fused_output). With the
    # delta rule the wy stage then also writes the output's causal scores A_qk = (Q K^T) * score_decay
    # (one more [BT, BK] @ [BK, BT] dot per key tile on the k tiles it loads anyway), so the sequential
    # pass loads a [BT, BT] tile instead of forming Q K^T and its exponents once per value tile on its
    # programs. H200, K=V=128 bf16: the fused forward 1.167 -> 1.098 ms at (1,32768,32,32), below the
    # unfused 1.199 at every #10 shape (benchmarks/NOTES.md, stop 27; tiles.fused_output).
    exprs["fused_scores_from_wy"] = exprs["state_pieces"] and t.delta
    # That fused pass also in Gluon (stages/state_gluon.py.j2, gdngen.runtime.gluon): one program per
    # piece and value head with the whole V = 128 as two warpgroups' accumulators, which Triton 3.6
    # spills. H200, bf16: the pass 654 -> 524 us at (1,32768,32,32), 628 -> 482 at (4,8192,16,32), bit
    # for bit the Triton pass's (benchmarks/NOTES.md, stop 34). 16-bit intermediates only (T and the
    # scores are 16-bit wgmma operands; split's pass also forms a second V_new product), and chunk states
    # in the inputs' dtype (the pass multiplies S rounded to it, and writes it so for a backward).
    exprs["gluon_state"] = (exprs["fused_scores_from_wy"] and spec.dtypes.intermediates in ("input", "float16")
                            and spec.dtypes.chunk_states == "input")
    names = (["l2norm"] if spec.qk_l2norm else [])
    names += ["random_features"] if "random_features" in spec.feature_maps else []
    names += ["gates"]
    names += ["wy"] if t.delta else []
    names += ["state", "output"]
    names += ["normalizer"] if spec.normalize else []
    names += ["recurrent"]
    stages = tuple(STAGES[n] for n in names)
    if alg.per_channel:
        # the blocked scores unroll over 16-row sub-blocks: one output kernel per chunk size
        stages = tuple(Stage(s.name, s.template, "_output_fwd_kernel_bt<BT>", s.purpose) if s.name == "output" else s
                       for s in stages)
    if exprs["aqk_from_wy"]:
        purposes = {"wy": STAGES["wy"].purpose + "; the output's decayed scores A_qk on the same exponent tiles",
                    "output": "outputs: inter-chunk (Q S) plus the wy stage's A_qk over V_new"}
        stages = tuple(Stage(s.name, s.template, s.kernel, purposes.get(s.name, s.purpose)) for s in stages)
    elif exprs["fused_scores_from_wy"]:
        purposes = {"wy": STAGES["wy"].purpose + "; in a no-grad forward also the output's scores (Q K^T) * decay",
                    "state": STAGES["state"].purpose + "; in a no-grad forward the output instead (from wy's scores)"}
        stages = tuple(Stage(s.name, s.template, s.kernel, purposes.get(s.name, s.purpose)) for s in stages)
    elif exprs["state_pieces"]:
        purposes = {"state": STAGES["state"].purpose + "; in a short no-grad forward the output instead"}
        stages = tuple(Stage(s.name, s.template, s.kernel, purposes.get(s.name, s.purpose)) for s in stages)
    backward_backend, backward_stages, backward_reason, backward_exprs = _backward_plan(spec, alg)
    exprs.update(backward_exprs)
    return Plan(spec=spec, backend="triton", stages=stages,
                exprs=exprs, info=info, backward_backend=backward_backend,
                backward_stages=backward_stages, backward_reason=backward_reason)


def _feature_map_exprs(spec: Spec) -> dict:
    """Printed feature maps (gdngen.algebra.feature_maps) for the templates.

    ``feature_map_exprs``: ``(name, FEATURE_MAP code, f(b_fx))`` of each element-wise map the
    spec declares other than identity; the kernels branch on the constexpr ``FEATURE_MAP`` and
    apply ``f`` to a q/k tile right after its load (stages/_feature_map.j2). Empty: the kernels
    take no ``FEATURE_MAP`` at all. ``random_features_expr``: Performer's feature over the
    projection ``b_p`` [rows, m], the half squared norms ``b_n`` [rows] and ``num_features``, or
    None when the spec does not declare random features.
    """
    elementwise = [(name, feature_maps.CODES[name], _print(feature_maps.elementwise(name), {"x": "b_fx"}))
                   for name in spec.feature_maps if name in feature_maps.ELEMENTWISE and name != "identity"]
    random = None
    if "random_features" in spec.feature_maps:
        random = _print(feature_maps.random_features(), {"p": "b_p", "n": "b_n[:, None]", "m": "num_features"})
    return {"feature_map_exprs": elementwise, "random_features_expr": random,
            "feature_map_codes": {name: feature_maps.CODES[name] for name in ("identity",) + tuple(
                n for n in spec.feature_maps if n != "identity")}}


# ---------------------------------------------------------------------------------------------
# Backward stages: the generated chunkwise backward. It keeps only the forward call's chunk-start
# states (the op's third output) and recomputes everything inside a chunk. The gradient
# recipe is checked against differentiation of the recurrence (algebra.backward); the gate
# derivatives are derived there with sympy.diff and printed here.
# ---------------------------------------------------------------------------------------------

BACKWARD_STAGES = {
    "wy_prep": Stage("wy_prep", "stages/backward_wy.py.j2", "_wy_bwd_prep_kernel",
                     "W = T diag(beta) (K * key_w_decay) per chunk from the forward pass's float32 T (delta rule)"),
    "state": Stage("state", "stages/backward_state.py.j2", "_state_bwd_kernel",
                   "reverse pass over chunks: dh (gradient on each chunk's end state), dh0, and the "
                   "gradient of the values (v, or V_new for the delta rule)"),
    "intra": Stage("intra", "stages/backward_intra.py.j2", "_intra_bwd_kernel",
                   "the chunk-local part of the values' gradient, scale (P * causal)^T dO, chunk-parallel "
                   "(vector decay: scores on 16-row blocks)"),
    "chunk": Stage("chunk", "stages/backward_chunk.py.j2", "_chunk_bwd_kernel",
                   "chunk-parallel dq, dk, dW and the log-decay cumsum gradient from h, dh, dO"),
    "wy": Stage("wy", "stages/backward_wy.py.j2", "_wy_bwd_kernel",
                "through T = (I + A)^-1, W and U: dk, dv, dbeta and the decay gradient (delta rule)"),
    "wy_decay": Stage("wy_decay", "stages/backward_wy.py.j2", "_wy_decay_bwd_kernel_bt<BT>",
                      "vector decay + delta: the chain through A's per-channel decayed scores "
                      "(dk, dbeta, decay gradient) level by level"),
    "gates": Stage("gates", "stages/backward_gates.py.j2", "_gates_bwd_kernel",
                   "reverse cumsum of the decay gradient per chunk, floor mask, fused gate and beta activations"),
    "l2norm": Stage("l2norm", "stages/backward_l2norm.py.j2", "_l2norm_bwd_kernel",
                    "backward of the q/k L2 normalisation (use_qk_l2norm_in_kernel)"),
}


def _backward_plan(spec: Spec, alg) -> tuple:
    """(backend, stages, reason, printed expressions) of the chunk backward for ``spec``."""
    t = spec.transition
    names = (["wy_prep"] if t.delta else []) + ["intra", "state", "chunk"]
    names += (["wy"] + (["wy_decay"] if alg.per_channel else [])) if t.delta else []
    names += ["gates"] + (["l2norm"] if spec.qk_l2norm else [])
    d = algebra.gate_derivatives()
    gate_names = {"x": "b_x", "A_log": "b_A_log", "dt_bias": "b_dt_bias"}
    exprs = {
        "decay_activation_dx": _print(d["decay_dx"], gate_names),
        "decay_activation_dA_log": _print(d["decay_dA_log"], gate_names),
        "decay_activation_raw": _print(algebra.decay_activation(), gate_names),
        "beta_activation_db": _print(d["beta_db"], {"b": "b_b"}),
        "beta_activation_neg_db": _print(d["beta_neg_db"], {"b": "b_b"}),
    }
    stages = tuple(BACKWARD_STAGES[n] for n in names)
    if alg.per_channel:
        # block-unrolled over 16-row sub-blocks: one kernel per chunk size
        stages = tuple(Stage(s.name, s.template, f"{s.kernel}_bt<BT>", s.purpose) if s.name in ("chunk", "intra") else s
                       for s in stages)
    return ("triton", stages, "", exprs)


def public_api(plan: Plan) -> dict:
    """Names, arguments and docstring facts of the generated public function."""
    spec, info = plan.spec, plan.info
    t = spec.transition
    positional = ["q", "k", "v"] + (["g"] if t.decay != "none" else []) + (["beta"] if t.delta else [])
    keywords = []
    if spec.qk_l2norm:
        keywords.append(("use_qk_l2norm_in_kernel", False))
    if info["gate_fused"]:
        keywords += [("use_gate_in_kernel", False), ("A_log", None), ("dt_bias", None)]
    if info["beta_sigmoid"]:
        keywords.append(("use_beta_sigmoid_in_kernel", False))
    if info["neg_eigval"]:
        keywords.append(("allow_neg_eigval", False))
    if spec.normalize:
        keywords.append(("normalize", True))
    mapped = spec.feature_maps != ("identity",)
    if mapped:
        keywords.append(("feature_map", None))
    if "random_features" in spec.feature_maps:
        keywords.append(("feature_projection", None))
    camel = "".join(part.capitalize() for part in spec.name.split("_"))
    rule = {"none": "", "scalar": "exp(g_t) ", "vector": "diag(exp(g_t)) "}[t.decay]
    if t.delta:
        summary = f"Chunkwise {spec.name}: S_t = {rule}(I - beta_t k_t k_t^T) S_(t-1) + beta_t k_t v_t^T, o_t = S_t^T (scale q_t)."
    else:
        summary = f"Chunkwise {spec.name}: S_t = {rule}S_(t-1) + k_t v_t^T, o_t = S_t^T (scale q_t)."
    if plan.backend == "triton":
        if plan.backward_backend == "triton":
            note = ("Forward and backward: generated Triton kernels (compiled on CUDA, interpreted on CPU "
                    "under TRITON_INTERPRET=1). The backward keeps only the forward's chunk-start states, "
                    "recomputes every intra-chunk quantity, and is deterministic (no atomics).")
        else:
            note = ("Forward: generated Triton kernels (compiled on CUDA, interpreted on CPU under "
                    f"TRITON_INTERPRET=1). Backward: the float64 reference ({plan.backward_reason}).")
    else:
        note = f"Forward and backward: the float64 reference ({plan.reason})."
    if t.delta:
        recurrent_summary = (f"Token-by-token {spec.name}: S_t = {rule}(I - beta_t k_t k_t^T) S_(t-1) + beta_t k_t v_t^T, "
                             "o_t = S_t^T (scale q_t).")
    else:
        recurrent_summary = f"Token-by-token {spec.name}: S_t = {rule}S_(t-1) + k_t v_t^T, o_t = S_t^T (scale q_t)."
    return {
        "chunk_name": spec.chunk_function,
        "recurrent_name": spec.recurrent_function,
        "recurrent_summary": recurrent_summary,
        "fwd_name": f"{spec.chunk_function}_fwd",
        "class_name": f"Chunk{camel}Function",
        "positional": positional,
        "keywords": keywords,
        "has_g": t.decay != "none",
        "has_beta": t.delta,
        "l2norm": spec.qk_l2norm,
        "gate_fused": info["gate_fused"],
        "beta_sigmoid": info["beta_sigmoid"],
        "neg_eigval": info["neg_eigval"],
        "normalize": spec.normalize,
        "feature_maps": mapped,
        "random_features": "random_features" in spec.feature_maps,
        "summary": summary,
        "backend_note": note,
    }
