"""Which GPU the tuned tile tables are for: name, compute capability, SM count, shared memory.

Detection goes through torch.cuda only when CUDA is available and the Triton interpreter is off:
on CPU tensors (``TRITON_INTERPRET=1``) there is no device and only overrides and defaults apply.
Tests inject a device with :func:`use_device` (or :func:`set_probe`) instead of needing a GPU.
"""
from __future__ import annotations

import os
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

# Max dynamic shared memory one block may opt into, per compute capability (CUDA programming
# guide, "Technical specifications per compute capability"). Unknown GPUs get the fallback: the
# 48 KiB every CUDA device guarantees without opt-in.
SMEM_PER_BLOCK = {
    (7, 0): 96 * 1024, (7, 5): 64 * 1024,
    (8, 0): 163 * 1024, (8, 6): 99 * 1024, (8, 7): 163 * 1024, (8, 9): 99 * 1024,
    (9, 0): 227 * 1024,
    (10, 0): 227 * 1024, (12, 0): 99 * 1024,
}
SMEM_FALLBACK = 48 * 1024

# Families whose shipped table (gdngen/autotune/shipped/<family>.json) applies to every SKU of
# the name (e.g. "NVIDIA H200" and "NVIDIA H200 NVL" share h200.json).
FAMILIES = ("h200", "h100", "h800", "h20", "gh200", "b200", "b100", "a100", "a800", "l40s", "l4")


@dataclass(frozen=True)
class DeviceInfo:
    name: str                               # torch.cuda.get_device_name, e.g. "NVIDIA H200"
    capability: tuple[int, int]             # e.g. (9, 0)
    sm_count: int = 132
    smem_per_block: Optional[int] = field(default=None)   # None: from the SMEM_PER_BLOCK table

    def __post_init__(self):
        object.__setattr__(self, "capability", tuple(int(c) for c in self.capability))

    @property
    def smem(self) -> int:
        if self.smem_per_block:
            return int(self.smem_per_block)
        return SMEM_PER_BLOCK.get(tuple(self.capability), SMEM_FALLBACK)

    @property
    def slug(self) -> str:
        """File-name form of the device: 'NVIDIA H200' (9, 0) -> 'nvidia-h200-sm90'."""
        return f"{sanitise(self.name)}-sm{self.capability[0]}{self.capability[1]}"

    @property
    def family(self) -> str:
        """Name of the shipped table for this device: a known family token, else the sanitised name."""
        words = sanitise(self.name).split("-")
        for fam in FAMILIES:
            if fam in words:
                return fam
        return sanitise(self.name)


def sanitise(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


_PROBE: Optional[Callable[[], Optional[DeviceInfo]]] = None
_DETECTED: dict[int, DeviceInfo] = {}
_CUDA_AVAILABLE: list = []       # torch.cuda.is_available(), asked once: every launch asks for the device


def _detect() -> Optional[DeviceInfo]:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    if not _CUDA_AVAILABLE:
        _CUDA_AVAILABLE.append(torch.cuda.is_available())
    if not _CUDA_AVAILABLE[0]:
        return None
    index = torch.cuda.current_device()
    info = _DETECTED.get(index)
    if info is None:
        props = torch.cuda.get_device_properties(index)
        info = DeviceInfo(name=torch.cuda.get_device_name(index),
                          capability=tuple(torch.cuda.get_device_capability(index)),
                          sm_count=props.multi_processor_count,
                          smem_per_block=getattr(props, "shared_memory_per_block_optin", None) or None)
        _DETECTED[index] = info
    return info


def current_device() -> Optional[DeviceInfo]:
    """The device kernels launch on now, or None (CPU / interpreter): then no cache applies."""
    return _PROBE() if _PROBE is not None else _detect()


def set_probe(probe: Optional[Callable[[], Optional[DeviceInfo]]]) -> None:
    """Replace device detection (None restores torch.cuda detection)."""
    global _PROBE
    _PROBE = probe


@contextmanager
def use_device(info: Optional[DeviceInfo]):
    """Pretend kernels run on ``info`` (None: on no GPU) inside the block; for tests and tools."""
    global _PROBE
    previous = _PROBE
    _PROBE = lambda: info  # noqa: E731
    try:
        yield info
    finally:
        _PROBE = previous
