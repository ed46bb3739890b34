"""Tier selection: without a GPU, generated kernels run under the Triton interpreter on CPU."""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Must be set before triton is imported by any generated module.
    os.environ["TRITON_INTERPRET"] = "1"


def pytest_collection_modifyitems(config, items):
    if os.environ.get("GDNGEN_RUN_SLOW") != "1":
        # minutes of CPU each (e.g. compiling every kernel for sm_90): opt in with GDNGEN_RUN_SLOW=1
        slow = pytest.mark.skip(reason="slow: set GDNGEN_RUN_SLOW=1 to run")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(slow)
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (gpu tier runs on the H200 through the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    """An empty user autotune cache and no shipped tables: only what a test writes is looked up."""
    from gdngen.autotune import cache
    monkeypatch.setenv("GDNGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cache, "SHIPPED_DIR", tmp_path / "shipped")
    cache.clear_memo()
    yield tmp_path
    cache.clear_memo()
