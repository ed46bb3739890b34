"""Stop 62's second probe (CUDA only): why the no-grad forward without the final state reads slower than with it.

Stop 62 call 2 (H100, `2026-12-05-stop62-bench-method-probe.py`): the same timer read 0.591 ms with the final
state and 0.639 without at (1,32768,32,32), and 2.03-2.10 against 2.23-2.26 at (1,131072,16,32). The kernels
differ only in the final state's store (offline sm_90a: the same registers and loop), so per round and variant
this takes do_bench's median (300 ms of calls) and each kernel's device time (torch.profiler, 10 calls):
- `final` / `no_final`: output_final_state True / False, as shipped (graph replay where the work allows);
- `final_eager` / `no_final_eager`: the same with graph replay off.
Kernel times that match while do_bench differs put the gap between the kernels (launch order, graphs); a kernel
that itself runs slower puts it in that kernel.

    python benchmarks/results/2026-12-05-stop62-final-state-probe.py [--cases "1,32768,32,32 1,131072,16,32"]
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton.testing  # noqa: E402

from benchmarks.fused_probe import inputs, row_recorder  # noqa: E402
from benchmarks.tuner_timing_check import kernel_times  # noqa: E402
from gdngen.runtime.graphs import set_enabled as set_graphs  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="1,32768,32,32 1,131072,16,32")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from generated import gated_delta_rule as module
    record = row_recorder("final-state.jsonl")
    variants = {"final": (True, True), "no_final": (False, True),
                "final_eager": (True, False), "no_final_eager": (False, False)}
    for case in args.cases.split():
        B, T, H, HV = (int(n) for n in case.split(","))
        x = inputs(B, T, H, HV)
        for round_ in range(args.rounds):
            order = list(variants) if round_ % 2 == 0 else list(variants)[::-1]
            for name in order:
                final, graphs = variants[name]
                set_graphs(graphs)

                def call(final=final):
                    with torch.no_grad():
                        return module.chunk_gated_delta_rule(**x, output_final_state=final)
                for _ in range(3):
                    call()
                torch.cuda.synchronize()
                ms = triton.testing.do_bench(call, warmup=30, rep=300, return_mode="median")
                kernels = {kernel[:40]: round(us, 1) for kernel, us in kernel_times(call, reps=10).items()}
                record(case=case, round=round_, variant=name, ms=round(ms, 4),
                       kernels_sum_us=round(sum(kernels.values()), 1), kernels_us=kernels)
        set_graphs(True)
        del x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
