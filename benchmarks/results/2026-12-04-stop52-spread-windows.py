"""Stop 52: is the pieces rows' spread between windows the intermediates' placement? Capture-once graph vs
re-captured graph vs eager, windows separated by allocator disturbances; per-window kernel times."""
import json, os, random, statistics, subprocess, sys, time
from collections import defaultdict
import torch, triton
sys.path.insert(0, os.getcwd())
from benchmarks.fused_probe import inputs
import generated.gated_delta_rule as m
import gdngen.runtime.graphs as graphs

OUT = os.environ.get("OUT", ".")
out = open(os.path.join(OUT, "spread2.jsonl"), "a")
def emit(row):
    print(json.dumps(row), flush=True); out.write(json.dumps(row) + "\n"); out.flush()

smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active",
                        "--format=csv", "-lms", "200"], stdout=open(os.path.join(OUT, "clocks.csv"), "w"), stderr=subprocess.STDOUT)
flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
graphs.set_enabled(False)

def timed(fn, calls=60):
    ts = []
    for _ in range(calls):
        flush.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)

def kernels(fn, calls=10):
    k = defaultdict(float)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    for ev in prof.key_averages():
        if ev.device_time_total > 0 and ev.device_type == torch.autograd.DeviceType.CUDA and "zero" not in ev.key and "fill" not in ev.key:
            k[ev.key[:40]] += ev.device_time_total / calls
    return {n: round(v, 1) for n, v in sorted(k.items(), key=lambda kv: -kv[1])}

random.seed(0)
for case in sys.argv[1:]:
    B, T, H, HV = map(int, case.split(","))
    x = inputs(B, T, H, HV)
    def fn():
        with torch.no_grad():
            return m.chunk_gated_delta_rule(**x, output_final_state=True)
    for _ in range(3):
        fn()
    # one graph captured now and replayed in every window
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        o_g, _ = fn()
    replay = g.replay
    held = []
    for w in range(10):
        # disturb the caching allocator: a tensor of a random size kept for this window
        held = [torch.empty(random.randint(1, 600) << 20, dtype=torch.int8, device="cuda")]
        o, _ = fn()
        row = dict(case=case, window=w, disturb_mib=held[0].numel() >> 20, o_ptr_mod_2m=o.data_ptr() % (2 << 20),
                   o_ptr=o.data_ptr())
        del o
        torch.cuda.synchronize()
        h0 = time.perf_counter()
        for _ in range(50):
            fn()
        row["host_ms"] = round((time.perf_counter() - h0) / 50 * 1e3, 4)
        torch.cuda.synchronize()
        row["wall_ms"] = round((time.perf_counter() - h0) / 50 * 1e3, 4)
        row["bench_eager_ms"] = round(triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median"), 4)
        row["bench_graph_once_ms"] = round(triton.testing.do_bench(replay, warmup=25, rep=150, return_mode="median"), 4)
        graphs.set_enabled(True); graphs.MAX_WORK = 1 << 40
        row["bench_module_graph_ms"] = round(triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median"), 4)
        graphs.set_enabled(False); graphs.MAX_WORK = 1 << 33
        row["bench_eager_ms_2"] = round(triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median"), 4)
        row["eager_kernels_us"] = kernels(fn)
        row["t"] = round(time.time(), 1)
        emit(row)
smi.terminate()
