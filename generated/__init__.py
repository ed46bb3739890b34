"""Modules rendered by gdngen from specs/ (see each file's header)."""
