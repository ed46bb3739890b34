"""Host time of a forward+backward step, split into its layers (CUDA only; stop 40).

    python benchmarks/host_split.py [--shape 8,2048,16,16] [--calls 100] [--out rows.jsonl]

At (8,2048,16,16) the step is host-bound (host ~1.5-2.0 ms against ~0.9 ms of kernels), so its time
is the Python and the launches. Each layer below is timed alone, ``--calls`` calls back to back
(host time: before the final synchronize; the GPU keeps up), so the differences between layers say
where the time goes: the autograd engine, the op wrappers, the backward's Python, the launches.
Then a cProfile of the backward impl by cumulative time.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from benchmarks.fused_probe import row_writer  # noqa: E402
from gdngen import bench  # noqa: E402
from gdngen.runtime.launch import fast  # noqa: E402
from gdngen.spec import load_spec  # noqa: E402


@triton.jit
def _noop_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


class _Identity5(torch.autograd.Function):
    """Five inputs, one output, nothing computed: the autograd engine's floor for a 5-leaf op."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta):
        return v.view_as(v)

    @staticmethod
    def backward(ctx, do):
        return None, None, do, None, None


def host_ms(step, calls: int) -> tuple[float, float]:
    """(host ms, host + GPU ms) per call of ``step``, ``calls`` calls back to back after three warm-ups."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    host = (time.perf_counter() - start) / calls * 1e3
    torch.cuda.synchronize()
    return host, (time.perf_counter() - start) / calls * 1e3


def print_profile(step, calls: int, sort: str, top: int) -> None:
    """cProfile of ``calls`` calls of ``step``, the ``top`` functions by ``sort`` (tottime, cumulative)."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        step()
    profile.disable()
    torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats(sort).print_stats(top)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8,2048,16,16")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--out", default=None)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--trace", default=None, help="a folder for chrome traces of five steps (torch.profiler)")
    args = parser.parse_args()
    record = row_writer(args.out)
    import generated.gated_delta_rule as m
    spec = load_spec("specs/gated_delta_rule.yaml")
    B, T, H, HV = (int(x) for x in args.shape.split(","))
    case = bench.Case(name=args.shape, B=B, T=T, H=H, HV=HV, K=128, V=128)
    x = bench.make_inputs(spec, case, torch.bfloat16, "cuda", requires_grad=True)
    leaves = list(x.values())
    do = torch.randn(B, T, HV, 128, device="cuda", dtype=torch.bfloat16)
    scale = 128 ** -0.5
    args_fwd = (x["q"], x["k"], x["v"], x["g"], x["beta"], None, None, None, None,
                scale, False, 64, False, False, False, False)
    options = args_fwd[9:]

    def clear():
        for t in leaves:
            t.grad = None

    def step():
        clear()
        m.chunk_gated_delta_rule(**x)[0].backward(do)

    def forward_graph():
        return m.chunk_gated_delta_rule(**x)[0]

    def forward_nograd():
        with torch.no_grad():
            return m.chunk_gated_delta_rule(**x)[0]

    def validate():
        m.validate_chunk_call(m.SPEC_INFO, x["q"], x["k"], x["v"], x["g"], x["beta"], scale=None, initial_state=None,
                              cu_seqlens=None, chunk_size=64, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                              use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False)

    def forward_impl():
        with torch.no_grad():
            return m._chunk_gated_delta_rule_forward_impl(*args_fwd)

    with torch.no_grad():
        o, _, states, tmat, values, *gates = m._chunk_gated_delta_rule_forward_impl(*args_fwd)
    # what the op keeps for the backward (gates: from stop 40 on)
    saved = (x["q"], x["k"], x["v"], x["g"], x["beta"], None, None, None, None, states, tmat, values, *gates)
    kept_gates = dict(kept_gates=m.kept_gate_pair(gates[0], x["g"], x["beta"])) if gates else {}
    needs = [True] * 5 + [False] * 4

    def backward_impl():
        with torch.no_grad():
            return m._chunk_gated_delta_rule_backward_impl(do, None, needs, *saved, *options)

    def fwd_backward():
        with torch.no_grad():
            return m.chunk_gated_delta_rule_fwd_backward(
                do, None, x["q"], x["k"], x["v"], x["g"], x["beta"], scale=scale, initial_state=None,
                cu_seqlens=None, chunk_size=64, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None,
                dt_bias=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, states=states,
                kept_tmat=tmat, kept_values=values, **kept_gates)

    def fwd_states_gates():
        with torch.no_grad():
            return m.chunk_gated_delta_rule_fwd_states(
                x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=None, output_final_state=False,
                cu_seqlens=None, chunk_size=64, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None,
                dt_bias=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, states=states, gates_only=True)

    def identity_step():
        clear()
        _Identity5.apply(*leaves).backward(do)

    buf = torch.zeros(1024, device="cuda")
    noop = fast(_noop_kernel)

    def launch_fast():
        noop[(1,)](buf, 1024, BLOCK=1024)

    def launch_triton():
        _noop_kernel[(1,)](buf, 1024, BLOCK=1024)

    def empties():
        for _ in range(10):
            torch.empty(B, T, HV, 128, device="cuda", dtype=torch.bfloat16)

    def step_single_thread():
        clear()
        with torch.autograd.set_multithreading_enabled(False):
            m.chunk_gated_delta_rule(**x)[0].backward(do)

    def step_grad():
        o = m.chunk_gated_delta_rule(**x)[0]
        torch.autograd.grad(o, leaves, do)

    layers = [("step fwd+bwd (bench)", step), ("step, autograd multithreading off", step_single_thread),
              ("step via autograd.grad", step_grad), ("forward, graph built", forward_graph),
              ("forward, no grad", forward_nograd), ("validate_chunk_call", validate),
              ("forward impl (states kept)", forward_impl), ("backward impl", backward_impl),
              ("fwd_backward (no segments wrapper)", fwd_backward), ("fwd_states gates_only", fwd_states_gates),
              ("autograd floor: 5-leaf identity step", identity_step), ("fast launch, noop kernel", launch_fast),
              ("triton launch, noop kernel", launch_triton), ("10 x torch.empty", empties)]
    for _ in range(2):
        for name, fn in layers:
            host, total = host_ms(fn, args.calls)
            record(dict(shape=args.shape, layer=name, host_ms=round(host, 4), host_gpu_ms=round(total, 4)))
    if args.trace:
        from torch.profiler import ProfilerActivity, profile as torch_profile
        for name, fn in (("step", step), ("step_single_thread", step_single_thread)):
            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
            prof.export_chrome_trace(os.path.join(args.trace, f"{name}.json"))
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print_profile(backward_impl, args.calls, "cumulative", args.top)


if __name__ == "__main__":
    main()
