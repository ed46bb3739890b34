"""gdngen: a compiler-style code generator for linear-attention Triton kernels.

spec (YAML) -> validated Spec -> sympy chunk algebra -> stage plan -> Jinja templates ->
generated module (``generated/<name>.py``).
"""
__version__ = "0.1.0"
