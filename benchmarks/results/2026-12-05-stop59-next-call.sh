#!/usr/bin/env bash
# Stop 59's prepared device calls (five, each under the 600 s a call may run; every result goes to $OUT as measured;
# it supersedes stop 58's three, which never ran):
#   part 1: the fused-solve probe and the pass forming T (override gluon_fused_t) against the pass fed by the wy stage;
#   part 2: the GPU tests of the Gluon forward pass, then the forward rows beside FlashQLA with the switch on;
#   part 3: training steps with the switch on and off (the unpieced rows); part 4: the pieced row (1,32768,32,32),
#   whose walk is then the Gluon pass's own launch; part 5: the fused pass's register splits; part 6 (~1 min): the
#   training step's host time and its cProfile on the GPU's host (stop 59's CPU figure: ~1.6 ms a step at
#   (1,32768,32,32) with the launches no-op, against ~2.5 ms of kernels); part 7 (~3 min): whether the
#   (1,131072,16,32) pass's spread between windows is its value-head pairs losing their shared k and q reads;
#   part 8: the pairs paced (override gluon_pair_pace) against the pass as it is, if part 7 says they drift.
# Stop 60 ran parts 1 (without gdr_ft184, whose compile killed the device's ptxas), 7 and 8 on an H100: FUSED_T and
# pacing both lost (NOTES, stop 60). Pacing was removed at e83d5f1, so part 8 runs only at 8873a90 or before.
#   run: bash .anchors/install.sh > $OUT/install.log 2>&1; export PYTHONPATH=/tmp/anchors:$PWD PYTHONUNBUFFERED=1;
#        bash benchmarks/results/2026-12-05-stop59-next-call.sh 1      (carry: [".anchors", "variant_tmp"])
#   before part 1, here (it reads fc6e5d8 with git): python benchmarks/results/2026-12-05-stop58-fused-solve-probe.py
set -u
PART=${1:-1}
export OUT=${OUT:-out}; mkdir -p "$OUT" variant_tmp
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv > "$OUT/gpu.txt"

# variant_tmp/gdr_ft<CHAIN>.py: the generated module forming T without the override (module_ab's switch rows apply
# to the last module only), its chains at CHAIN registers and its scores partition at SCORES
fused_variant() {
    sed -e "s/^GLUON_FUSED_T_REGISTERS = dict(CHAIN_REGS=176, SCORES_REGS=152,/GLUON_FUSED_T_REGISTERS = dict(CHAIN_REGS=$1, SCORES_REGS=$2,/" \
        -e 's/and fused_t_usable(SPEC.name, k.dtype, t_dtype))/and solve_precision(k.dtype, t_dtype) == "fp16")/' \
        generated/gated_delta_rule.py > "variant_tmp/gdr_ft$1.py"
}

# ab NAME MODULE_AB_ARGUMENTS...: one module_ab call, kernel profiles of three alternating rounds, into $OUT/NAME.*
ab() {
    local name=$1; shift
    timeout 480 python benchmarks/module_ab.py --profile --profile-rounds 3 "$@" \
        --out "$OUT/$name.jsonl" > "$OUT/$name.log" 2>&1
    grep rounds "$OUT/$name.jsonl" | cut -c1-300
}

if [ "$PART" = 1 ]; then
    [ -f variant_tmp/gdr_psolve.py ] || python benchmarks/results/2026-12-05-stop58-fused-solve-probe.py \
        > "$OUT/probe-build.log" 2>&1
    fused_variant 184 144                # a second register split beside the default 176 / 152
    ab fused-t-ab --modes fwd --switches "gluon_fused_t=1" --cases "1,32768,32,32 1,131072,16,32 4,8192,16,32" \
        --modules "variant_tmp/gdr_p208.py variant_tmp/gdr_p176.py variant_tmp/gdr_psolve.py variant_tmp/gdr_ft184.py generated/gated_delta_rule.py"
elif [ "$PART" = 2 ]; then
    timeout 200 python -m pytest -q -m gpu tests/test_gluon_state_gpu.py -k "forming_t or is_the_triton_pass or paced_pairs" \
        > "$OUT/gpu-tests.log" 2>&1
    tail -3 "$OUT/gpu-tests.log"
    timeout 330 python - > "$OUT/bench.log" 2>&1 <<'PY'
import os
from gdngen.cli import main
from gdngen.runtime import override
with override("gated_delta_rule", "gluon_fused_t", value=True):
    main(["bench", "gated_delta_rule", "--cases", "1,32768,32,32 4,8192,16,32 1,131072,16,32",
          "--impls", "gdngen,flashqla", "--modes", "fwd", "--skip-check", "--time-budget", "300",
          "--out", os.path.join(os.environ["OUT"], "bench-fused-t.json")])
PY
    tail -12 "$OUT/bench.log"
elif [ "$PART" = 3 ]; then
    # a forward for a backward with the pass forming T (no wy launch in the step)
    ab fused-t-train-ab --modes fwd+bwd --switches "gluon_fused_t=1" --cases "4,8192,16,32 8,2048,16,16" \
        --modules generated/gated_delta_rule.py
elif [ "$PART" = 4 ]; then
    # the pieced training row: the pieces' walk is the Gluon pass's walk alone (WALK_ONLY), then the pass sends T on
    ab fused-t-train-pieces-ab --modes fwd+bwd --switches "gluon_fused_t=1" --cases "1,32768,32,32" \
        --modules generated/gated_delta_rule.py
elif [ "$PART" = 5 ]; then
    # the register splits (stop 59 offline, spill stores a chunk half 1 / half 0 / scores):
    # 176 / 152 (37 / 51 / 32), 184 / 144 (19 / 51 / 53), 192 / 128 (6 / 25 / 88)
    fused_variant 176 152; fused_variant 184 144; fused_variant 192 128
    ab fused-t-splits --modes fwd --cases "1,32768,32,32 4,8192,16,32" \
        --modules "variant_tmp/gdr_ft176.py variant_tmp/gdr_ft184.py variant_tmp/gdr_ft192.py"
elif [ "$PART" = 6 ]; then
    for shape in 1,32768,32,32 4,8192,16,32; do
        timeout 150 python benchmarks/host_profile.py --shape $shape --calls 20 --top 30 > "$OUT/host-profile-$shape.log" 2>&1
        grep "per call" "$OUT/host-profile-$shape.log"
    done
elif [ "$PART" = 7 ]; then
    timeout 400 python benchmarks/results/2026-12-05-stop59-pair-probe.py --windows 8 > "$OUT/pair-probe.log" 2>&1
    tail -3 "$OUT/pair-probe.log"
elif [ "$PART" = 8 ]; then
    ab pair-pace-ab --modes fwd --switches "gluon_pair_pace=2 gluon_pair_pace=6" \
        --cases "1,131072,16,32 4,8192,16,32" --modules generated/gated_delta_rule.py
fi
