"""Tier selection: without a GPU, generated kernels run under the Triton interpreter on CPU."""
import os
import platform
import sys

# The interpreter's tl.dot is numpy's matmul, whose OpenBLAS picks its kernels by CPU: the AVX-512 ones sum in another
# order than the AVX2 ones, and the ill-conditioned chunks some tests pose (beta 1.9 over repeated keys) turn that
# into errors 3x apart (test_solve_precision_cpu, kda in float16: 6.2e-3 against 1.9e-2). One kernel family on every
# x86-64 machine keeps the CPU tier's numbers the same from machine to machine. Set before numpy loads OpenBLAS.
if platform.machine().lower() in ("x86_64", "amd64"):
    os.environ.setdefault("OPENBLAS_CORETYPE", "Haswell")

import pytest  # noqa: E402
import torch  # noqa: E402

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


@pytest.fixture
def spec_variant(tmp_path):
    """``make(base, name_suffix, **dtypes)``: a catalogue spec with some ``dtypes`` keys changed,
    built by ``gdngen build`` into tmp_path and imported; returns (Spec, module)."""
    import importlib.util

    import yaml

    from gdngen.cli import main
    from gdngen.spec import load_spec

    def make(base: str, suffix: str, **dtypes):
        with open(f"specs/{base}.yaml") as f:
            d = yaml.safe_load(f)
        d["name"] = f"{base}_{suffix}"
        d.setdefault("dtypes", {}).update(dtypes)
        path = tmp_path / f"{d['name']}.yaml"
        path.write_text(yaml.safe_dump(d))
        assert main(["build", str(path), "--out", str(tmp_path / "gen")]) == 0
        module_spec = importlib.util.spec_from_file_location(d["name"], tmp_path / "gen" / f"{d['name']}.py")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[d["name"]] = module      # as an import would: gdngen.parallel finds SPEC_INFO through it
        module_spec.loader.exec_module(module)
        return load_spec(path), module
    return make


class CountedLaunches:
    """Stands in for a generated module's cached launcher (``launcher[grid](*args, **kwargs)``): counts the
    launches, keeps their grids (``grids``) and passes them on; ``after(args, kwargs)``, where given, sees each
    launch's arguments once it has run."""

    def __init__(self, launcher, after=None):
        self.launcher, self.after, self.count, self.grids = launcher, after, 0, []

    def __getitem__(self, grid):
        self.count += 1
        self.grids.append(tuple(grid))
        launch = self.launcher[grid]
        if self.after is None:
            return launch

        def run(*args, **kwargs):
            result = launch(*args, **kwargs)
            self.after(args, kwargs)
            return result
        return run


@pytest.fixture
def count_launches(monkeypatch):
    """``count(module, name, after=None)``: ``module.name`` (a cached launcher) replaced, for the test, by a
    :class:`CountedLaunches` of the original, which it returns."""
    def count(module, name, after=None):
        original = getattr(module, name)
        if isinstance(original, CountedLaunches):
            original = original.launcher
        counter = CountedLaunches(original, after)
        monkeypatch.setattr(module, name, counter)
        return counter
    return count


@pytest.fixture
def wy_launches(monkeypatch):
    """``record(module)``: every launch of ``module``'s forward wy stage (any chunk size), for the test, appended as
    (args, kwargs) to the list it returns."""
    def record(module):
        seen = []
        launchers = {bt: CountedLaunches(launcher, lambda args, kwargs: seen.append((args, kwargs)))
                     for bt, launcher in module._WY_FAST.items()}
        monkeypatch.setattr(module, "_WY_FAST", launchers)
        return seen
    return record
