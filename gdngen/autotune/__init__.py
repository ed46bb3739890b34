"""Autotuning of the generated kernels' launch configs: search space, per-device cache, tuner.

``space`` (candidates per stage, pruned by register / shared-memory estimates and the known-bad
list), ``cache`` (per-device JSON files, shipped tables, the lookup behind
``gdngen.runtime.tiles``), ``device`` (detection, injectable for tests), ``tuner`` (``tune``).
The tuner is imported lazily: ``gdngen.runtime`` imports this package at launch time.
"""
from gdngen.autotune.device import DeviceInfo, current_device, set_probe, use_device


def __getattr__(name):
    if name in ("tune", "ShapeCase", "TuneReport"):
        from gdngen.autotune import tuner
        return getattr(tuner, name)
    raise AttributeError(name)


__all__ = ["DeviceInfo", "current_device", "set_probe", "use_device", "tune", "ShapeCase", "TuneReport"]
