"""gdngen.runtime.precompile: a first call's kernels are recorded, not run, and compiled in parallel."""
import threading

import pytest
import torch

from gdngen.runtime import precompile


def _plain(x_ptr, BLOCK: "tl.constexpr"):   # never compiled: only its launches are recorded
    pass


@pytest.fixture(autouse=True)
def _fresh():
    precompile.forget()
    yield
    precompile.forget()


def _jit(fn):
    from triton.runtime.jit import JITFunction
    return JITFunction(fn)


def test_launches_on_this_thread_are_recorded_not_run():
    from triton.runtime.jit import JITFunction
    a, b = _jit(_plain), _jit(_plain)
    original = JITFunction.run
    with precompile.launches_recorded() as recorded:
        assert a.run(1, grid=(2,), warmup=False, BLOCK=4) is None
        a.run(2, grid=(3,), warmup=False, BLOCK=8)
        b[(5,)](3, BLOCK=16)
    assert JITFunction.run is original
    assert list(recorded) == [a, b]
    assert recorded[a] == [((1,), {"BLOCK": 4, "grid": (2,)}), ((2,), {"BLOCK": 8, "grid": (3,)})]
    assert recorded[b] == [((3,), {"BLOCK": 16, "grid": (5,)})]


def test_launches_from_other_threads_run_as_usual(monkeypatch):
    from triton.runtime.jit import JITFunction
    ran = []
    monkeypatch.setattr(JITFunction, "run", lambda self, *args, grid, warmup, **kw: ran.append(args) or "ran")
    kernel = _jit(_plain)
    with precompile.launches_recorded() as recorded:
        other = threading.Thread(target=lambda: kernel.run(7, grid=(1,), warmup=False, BLOCK=4))
        other.start()
        other.join()
    assert ran == [(7,)] and not recorded


def test_compile_recorded_one_worker_per_kernel_in_launch_order():
    a, b = _jit(_plain), _jit(_plain)
    recorded = {a: [((1,), {"grid": (1,)}), ((2,), {"grid": (1,)})], b: [((3,), {"grid": (1,)})]}
    calls = []
    lock = threading.Lock()

    def compile_kernel(kernel, launches, device):
        with lock:
            calls.append((kernel, [args for args, _ in launches], device, threading.current_thread().name))

    precompile.compile_recorded(recorded, 0, compile_kernel)
    assert sorted((id(k), args, dev) for k, args, dev, _ in calls) == sorted(
        [(id(a), [(1,), (2,)], 0), (id(b), [(3,)], 0)])
    assert all(name.startswith("gdngen-compile") for *_, name in calls)


def test_compile_ahead_once_per_key_and_errors_dropped():
    kernel = _jit(_plain)
    compiled = []
    runs = []

    def run():
        runs.append(1)
        kernel.run(1, grid=(1,), warmup=False, BLOCK=4)

    record = lambda k, launches, device: compiled.append(len(launches))  # noqa: E731
    assert precompile.compile_ahead("key", run, 0, record) is True
    assert precompile.compile_ahead("key", run, 0, record) is False
    assert runs == [1] and compiled == [1]

    def broken():
        raise RuntimeError("host code failed")
    assert precompile.compile_ahead("other", broken, 0, record) is False   # the real call raises it


def test_compile_first_call_off_on_cpu_and_bounded(monkeypatch):
    x = torch.zeros(2, 3)
    assert precompile.compile_first_call("op", (x, None), (1,), lambda: pytest.fail("ran on CPU")) is False
    monkeypatch.setattr(precompile, "enabled", lambda t: True)
    monkeypatch.setattr(precompile, "compile_ahead", lambda key, run, device: precompile._DONE.add(key) or True)
    monkeypatch.setattr(precompile, "KEYS_PER_OP", 3)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    hits = [precompile.compile_first_call("op", (torch.zeros(n), None), (1,), lambda: None) for n in (1, 2, 2, 3, 4)]
    assert hits == [True, True, False, True, False]     # a seen key, then the op's bound of 3 keys


def test_disabled_by_environment(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("GDNGEN_COMPILE_AHEAD", "0")
    x = torch.zeros(1)
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    assert precompile.enabled(x) is False
    monkeypatch.setenv("GDNGEN_COMPILE_AHEAD", "1")
    assert precompile.enabled(x) is True


def test_a_seen_shape_class_returns_before_the_environment_checks(monkeypatch):
    """Every call after a shape class's first (the steady state) ends on the key, without enabled()'s
    environment reads; a new shape class still asks."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(precompile, "compile_ahead", lambda key, run, device: precompile._DONE.add(key) or True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    asked = []
    monkeypatch.setattr(precompile, "enabled", lambda t: asked.append(1) or True)
    precompile.forget()
    try:
        x = torch.zeros(3)
        assert precompile.compile_first_call("op", (x, None), (1,), lambda: None) is True
        assert [precompile.compile_first_call("op", (x, None), (1,), lambda: None) for _ in range(3)] == [False] * 3
        assert asked == [1]
        assert precompile.compile_first_call("op", (torch.zeros(4), None), (1,), lambda: None) is True
        assert asked == [1, 1]
    finally:
        precompile.forget()
