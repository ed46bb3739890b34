"""Host-side helpers shared by every generated module: validation, varlen tables, launch checks."""
from gdngen.runtime.validate import Problem, validate_chunk_call
from gdngen.runtime.varlen import chunk_state_rows, chunk_tables
from gdngen.runtime.launch import cdiv, check_backend, contiguous, dot_precision, fast, half_intermediate, next_pow2, solve_precision, tile_grid
from gdngen.runtime.tiles import override, store_wu, tiles

__all__ = ["Problem", "validate_chunk_call", "chunk_tables", "cdiv", "check_backend", "contiguous",
           "dot_precision", "fast", "half_intermediate", "next_pow2", "override", "solve_precision", "store_wu", "tile_grid", "tiles"]
