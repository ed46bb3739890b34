"""Stop 61's probe (CUDA only): does the no-grad forward's state pass run slower per chunk when its pieces start
exactly a power of two bytes apart?

At (1,131072,16,32) the Gluon pass runs 4 pieces of 512 chunks per value head; piece p's v and o rows start at
p * 256 MiB, its k and q rows at p * 128 MiB. Under ncu (stop 53) it took 3.2 us a chunk against 2.8 at
(4,8192,16,32), with the same bytes per chunk and program; on the H200 it also moved 1.40-1.70 ms between windows
of one process (stop 52). If the four pieces' same-time reads land on the same DRAM channels, pieces of unequal
length (their starts no longer a power of two apart) should run faster per chunk.

Variants (piece chunk counts, summing to the chunks of the sequence): ``even`` (as shipped), ``skew1`` (+-1, +-3
chunks), ``skew8`` (+-8, +-24). The module's piece tables are replaced in its cache (gdngen.runtime.varlen), graphs
off so each call launches with them. Per case and variant, rounds in alternating order: the pass's kernel time
(torch.profiler, 10 calls) and do_bench's median; o and the final state against ``even``'s.

    python benchmarks/results/2026-12-05-stop61-piece-skew-probe.py [--cases "1,131072,16,32 1,32768,32,32"]
"""
import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton.testing  # noqa: E402

from benchmarks.fused_probe import inputs, row_recorder  # noqa: E402
from benchmarks.tuner_timing_check import kernel_times  # noqa: E402
from gdngen.runtime import graphs, varlen  # noqa: E402

OFFSETS = {"even": (0, 0, 0, 0), "skew1": (-3, -1, 1, 3), "skew8": (-24, -8, 8, 24)}


class SkewedTables(varlen.PieceTables):
    """One sequence's pieces with chunk counts ``base + offsets`` (as PieceTables, B = 1)."""

    def __init__(self, T, chunk_size, offsets, device):
        NT = -(-T // chunk_size)
        base = NT // len(offsets)
        counts = [base + d for d in offsets]
        counts[-1] += NT - sum(counts)
        firsts = [sum(counts[:p]) for p in range(len(counts))]
        self.per_sequence = self.count = len(counts)
        as_int32 = dict(dtype=torch.int32, device=device)
        self.cu_seqlens = torch.tensor([c * chunk_size for c in firsts] + [T], **as_int32)
        self.chunk_offsets = torch.tensor(firsts, **as_int32)
        self.piece_seq = torch.tensor([[0, 0]] * len(counts), **as_int32)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="1,131072,16,32 1,32768,32,32")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from generated import gated_delta_rule as module
    graphs.set_enabled(False)
    record = row_recorder("piece-skew.jsonl")

    for case in args.cases.split():
        B, T, H, HV = (int(n) for n in case.split(","))
        assert B == 1, "one sequence per case"
        x = inputs(B, T, H, HV)

        def call():
            with torch.no_grad():
                return module.chunk_gated_delta_rule(**x, output_final_state=True)
        call()
        keys = [key for key in varlen._PIECE_TABLES if key[:2] == (B, T)]
        if not keys:
            record(case=case, what="no pieces at this case")
            continue
        key = keys[0]
        shipped = varlen._PIECE_TABLES[key]
        tables = {"even": shipped}
        for name, offsets in OFFSETS.items():
            if name != "even" and len(offsets) == shipped.count:
                tables[name] = SkewedTables(T, key[2], offsets, key[4])
        results, outputs = {name: [] for name in tables}, {}
        for r in range(args.rounds):
            order = list(tables) if r % 2 == 0 else list(tables)[::-1]
            for name in order:
                varlen._PIECE_TABLES[key] = tables[name]
                o, ht = call()
                torch.cuda.synchronize()
                outputs.setdefault(name, (o.float(), ht.float()))
                kernels = kernel_times(call, reps=10)
                passes = {k: us for k, us in kernels.items() if "state_output" in k}
                ms = triton.testing.do_bench(call, warmup=25, rep=150)
                results[name].append((sum(passes.values()), sum(kernels.values()), ms))
                record(case=case, variant=name, round=r, pass_us=round(sum(passes.values()), 1),
                       kernels_us=round(sum(kernels.values()), 1), do_bench_ms=round(ms, 4))
        varlen._PIECE_TABLES[key] = shipped
        o0, h0 = outputs["even"]
        for name, runs in results.items():
            o, ht = outputs[name]
            record(case=case, variant=name, what="summary",
                   pass_us_median=round(statistics.median(r[0] for r in runs), 1),
                   kernels_us_median=round(statistics.median(r[1] for r in runs), 1),
                   do_bench_ms_median=round(statistics.median(r[2] for r in runs), 4),
                   o_rel_vs_even=float((o - o0).norm() / o0.norm()), ht_rel_vs_even=float((ht - h0).norm() / h0.norm()))
        del x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
