"""Kernels compile for sm_90 within Hopper's shared memory (gdngen.compilecheck), without a GPU.

Runs the installed Triton's NVIDIA backend (compiles for GPUTarget("cuda", 90, 32) on the CPU).
The unmarked test covers the state passes (the kernels whose shared memory grows with K and the
element size: kda fp32 K=128 needed 237 KiB with three pipeline stages); the slow one compiles
every forward and backward kernel of gated_delta_rule and kda at the brief's shapes.
"""
import pytest

from gdngen import compilecheck

REASON = compilecheck.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no sm_90 compilation here: {REASON}")


def _shapes(pairs):
    return [compilecheck.Shape(K, V, 64, dtype, 1, 1, 2) for dtype, (K, V) in pairs]


def _assert_within_limit(rows, expected_kernels):
    assert rows, "the capture recorded no launches"
    seen = {r["kernel"] for r in rows}
    for name in expected_kernels:
        assert any(name in k for k in seen), f"{name} was not compiled (compiled: {sorted(seen)})"
    bad = [(r["spec"], r["K"], r["V"], r["dtype"], r["kernel"], r["config"], r["shared"], r["error"])
           for r in rows if r["status"] == "fail"]
    assert not bad, f"kernels that do not compile for sm_90 (shared limit {compilecheck.SHARED_LIMIT} B): {bad}"
    for r in rows:
        assert 0 <= r["shared"] <= compilecheck.SHARED_LIMIT


def test_state_passes_fit_hopper_shared_memory():
    """Forward and reverse state passes of gated_delta_rule and kda at the rows that overflowed before."""
    shapes = _shapes([("fp32", (128, 128)), ("bf16", (256, 256))])
    rows = compilecheck.check(["gated_delta_rule", "kda"], shapes, kernels=["_state_"])
    _assert_within_limit(rows, ["_state_fwd_kernel", "_state_bwd_kernel"])
    assert {r["spec"] for r in rows} == {"gated_delta_rule", "kda"}


@pytest.mark.slow
def test_all_kernels_fit_hopper_shared_memory():
    """Every forward + backward kernel of gated_delta_rule and kda, bf16/fp32, K=V=128/256, BT=64."""
    shapes = _shapes([(dt, kv) for dt in ("bf16", "fp32") for kv in ((128, 128), (256, 256))])
    rows = compilecheck.check(["gated_delta_rule", "kda"], shapes)
    _assert_within_limit(rows, ["_wy_fwd_kernel", "_state_fwd_kernel", "_output_fwd_kernel", "_chunk_bwd_kernel",
                                "_wy_bwd_kernel", "_state_bwd_kernel", "_intra_bwd_kernel", "_recurrent_fwd_kernel"])


def test_capture_uses_runtime_tiles():
    """The recorded launch parameters are the runtime's defaults (no compile: fast)."""
    import importlib
    import os
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("capture needs compiled-mode @triton.jit kernels; covered through the subprocess above")
    from gdngen.runtime.tiles import default_tiles
    from gdngen.spec import catalogue, load_spec
    import torch
    spec = next(load_spec(p) for p in catalogue() if load_spec(p).name == "gated_delta_rule")
    module = importlib.import_module("generated.gated_delta_rule")
    shape = compilecheck.Shape(128, 128, 64, "bf16", 1, 1, 2)
    launches = compilecheck.capture(spec, module, shape)
    state = [launch for phase, launch in launches if phase == "fwd" and launch.fn.__name__ == "_state_fwd_kernel"][0]
    want = default_tiles("state", K=128, V=128, BT=64, N=1, HV=2, dtype=torch.bfloat16)
    assert (state.args["BV"], state.num_stages) == (want["BV"], want["num_stages"])



_SAME_NAME_PROBE = """
import importlib, json
from gdngen import compilecheck
from gdngen.spec import catalogue, load_spec
shape = compilecheck.Shape(64, 64, 64, "bf16", 1, 1, 2)
found = {}
for name in ("gated_delta_rule", "simple_gla"):
    spec = next(load_spec(p) for p in catalogue() if load_spec(p).name == name)
    module = importlib.import_module("generated." + name)
    found[name] = next(launch for phase, launch in compilecheck.capture(spec, module, shape)
                       if phase == "fwd" and launch.fn.__name__ == "_output_fwd_kernel")
gdn, sgla = found["gated_delta_rule"], found["simple_gla"]
print(json.dumps({"bodies_differ": gdn.fn.cache_key != sgla.fn.cache_key,
                  "keys_differ": compilecheck._key(gdn) != compilecheck._key(sgla)}))
"""


def test_same_named_kernels_of_two_specs_compile_apart():
    """A kernel name and signature shared by two specs (simple_gla's and gated_delta_rule's output
    stage) must not share one compile result: check() once reported one spec's registers for another.
    Runs in a fresh process without the interpreter (capture needs compiled-mode @triton.jit kernels)."""
    import json
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _SAME_NAME_PROBE], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["bodies_differ"], "the two output stages should differ in source"
    assert result["keys_differ"], "compilecheck would compile one spec's kernel and report it for both"


def test_a_constexpr_left_to_its_default_takes_it():
    """A launch that leaves a defaulted constexpr out (the wy stage's TMA and G_SHARE have defaults) is
    specialised on the default, as Triton's own launch would be; a missing parameter without one still fails."""
    import torch
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    def body(x, n, FLAG: tl.constexpr, OPTION: tl.constexpr = 3):
        tl.store(x + tl.arange(0, 16), tl.zeros([16], tl.float32) + n + FLAG + OPTION)

    probe = JITFunction(body)                # compiled-mode parameters, with or without the interpreter
    x = torch.empty(16)
    _, constexprs, _ = compilecheck._signature(compilecheck.Launch(probe, dict(x=x, n=1, FLAG=2), 4, 1))
    assert constexprs["FLAG"] == 2 and constexprs["OPTION"] == 3
    with pytest.raises(KeyError):
        compilecheck._signature(compilecheck.Launch(probe, dict(x=x, n=1), 4, 1))
