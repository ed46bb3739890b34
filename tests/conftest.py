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
