"""Symbolic layer of gdngen: the chunk-form algebra of the linear-attention family.

* :func:`derive` — decay factors of the chunk (WY/UT) form for a transition structure,
  derived from products of per-token transitions (see :mod:`gdngen.algebra.chunk`);
* :func:`transfer` — the inter-chunk affine map ``S_next = M S + N`` and :func:`compose`;
* :func:`prove` — symbolic proof, on a small chunk, that the chunk form equals the recurrence;
* :func:`decay_activation`, :func:`beta_activation` — gate parameterisations;
* :func:`to_triton` — sympy -> Triton expression printer;
* :func:`gate_derivatives`, :func:`check_chunk_backward` — backward: gate derivatives, and the
  chunk backward recipe checked against differentiation of the recurrence.
"""
from .chunk import (DECAYS, G_COL, G_LAST, G_ROW, ChunkAlgebra, Transfer, compose, derive,
                    transfer, transition_factor)
from .gates import A_LOG, B, DT_BIAS, X, beta_activation, decay_activation, sigmoid, softplus
from .printer import LOG2_E, TritonPrinter, to_triton
from .proof import ProofReport, prove
from .backward import (BackwardCheck, check_chunk_backward, chunk_backward_recipe, gate_derivatives,
                       l2norm_backward)

__all__ = [
    "DECAYS", "G_ROW", "G_COL", "G_LAST", "ChunkAlgebra", "derive", "transition_factor",
    "Transfer", "transfer", "compose", "ProofReport", "prove",
    "sigmoid", "softplus", "X", "A_LOG", "DT_BIAS", "B", "decay_activation", "beta_activation",
    "TritonPrinter", "to_triton", "LOG2_E",
    "gate_derivatives", "l2norm_backward", "chunk_backward_recipe", "check_chunk_backward", "BackwardCheck",
]
