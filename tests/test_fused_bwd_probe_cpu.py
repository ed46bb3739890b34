"""benchmarks/fused_bwd_schedule_probe.py on the CPU emulator: its schedule (three consumers meeting at every
step, a producer reloading each tile after its last reader's step, one staging tile for dq, dk and dv) finishes
without a deadlock, a race between partitions, a missing fence or a store's tile rewritten early, and writes
every output tile. What it times needs a Hopper GPU (NOTES, stop 65)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_fused_backward_schedule_runs_clean_on_the_emulator():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "fused_bwd_schedule_probe.py"),
                           "--emulate"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dq, dk, dv written: [True, True, True]" in done.stdout
