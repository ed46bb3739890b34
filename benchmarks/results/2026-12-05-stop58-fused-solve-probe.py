"""Probe (stop 58): can the forward pass's scores partition also do the wy stage's work for each chunk?

Builds three copies of fc6e5d8's generated/gated_delta_rule.py into variant_tmp/ (a probe, never landed):
- gdr_p208.py: the pass as it is (registers 208 / 88 / 208), the probe off: the control;
- gdr_p176.py: the no-grad pass with the register split a fused solve would need (chains 176, scores 152), probe off;
- gdr_psolve.py: that split, and the scores partition forms each chunk's K K^T, A and T = (I + A)^-1 by stop 52's
  tensor-core product form (`2026-12-04-stop52-wy-gluon-prototype.py`'s _wy_solve, seven dependent wgmma rounds),
  into a shared-memory sink nothing reads. The chains still read the wy stage's T, so outputs stay bitwise.
If gdr_psolve's pass takes about gdr_p176's time, a pass that forms T itself (and the wy stage's launch, its k read
and T's round trip gone) is worth building; the difference is what the solve costs the pass.
    python benchmarks/results/2026-12-05-stop58-fused-solve-probe.py
    python benchmarks/module_ab.py --modules "variant_tmp/gdr_p208.py variant_tmp/gdr_p176.py variant_tmp/gdr_psolve.py" \
        --modes fwd --profile --profile-rounds 3 --cases "1,32768,32,32 4,8192,16,32"
"""
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the rendering the probe was written against (stop 57's head; the pass forming T came after it)
src = subprocess.run(["git", "show", "fc6e5d8:generated/gated_delta_rule.py"], cwd=ROOT, check=True,
                     capture_output=True, text=True).stdout
proto = open(os.path.join(ROOT, "benchmarks/results/2026-12-04-stop52-wy-gluon-prototype.py")).read()
helpers = proto[proto.index("@gluon_jit\ndef _wy_stage"):proto.index("@gluon_jit\ndef _wy_fwd_gluon_kernel")]


def swap(text, old, new):
    assert text.count(old) == 1, old[:80]
    return text.replace(old, new)


s = swap(src, "@gluon_jit\ndef _state_scores_partition(", helpers + "@gluon_jit\ndef _state_scores_partition(")
s = swap(s, """def _state_scores_partition(k_s, q_s, a_s, gs_s, bars, free_bars, a_bars, g_cum, i_hv, bos, NT,
                            HV: gl.constexpr, BT: gl.constexpr, STAGES: gl.constexpr, SCORE_DTYPE: gl.constexpr):""",
         """def _state_scores_partition(k_s, q_s, a_s, gs_s, bars, free_bars, a_bars, g_cum, i_hv, bos, NT,
                            HV: gl.constexpr, BT: gl.constexpr, STAGES: gl.constexpr, SCORE_DTYPE: gl.constexpr,
                            beta, p_s, PROBE: gl.constexpr):""")
s = swap(s, """        b_a = warpgroup_mma_wait(0, deps=(b_a,))
        mbarrier.arrive(free_bars.index(stage), count=1)                # q and k of this stage read
""", """        b_a = warpgroup_mma_wait(0, deps=(b_a,))
        if PROBE:
            gram = warpgroup_mma(k_s.index(stage), k_s.index(stage).permute((1, 0)),
                                 gl.zeros([BT, BT], gl.float32, L_a), use_acc=False, is_async=True)
            gram = warpgroup_mma_wait(0, deps=(gram,))
        mbarrier.arrive(free_bars.index(stage), count=1)                # q and k of this stage read
""")
s = swap(s, """        a_s.index(i_t % 2).store(b_a.to(SCORE_DTYPE))
        fence_async_shared()
        mbarrier.arrive(a_bars.index(i_t % 2), count=1)
""", """        a_s.index(i_t % 2).store(b_a.to(SCORE_DTYPE))
        fence_async_shared()
        mbarrier.arrive(a_bars.index(i_t % 2), count=1)
        if PROBE:
            b_bt = gl.load(beta + (t0 + o_ai).to(gl.int64) * HV + i_hv)
            b_kk = gl.where(o_ai[:, None] > o_aj[None, :],
                            gram * b_bt[:, None] * gl.exp2((b_gi[:, None] - b_gj[None, :]) * 1.4426950408889634), 0.)
            b_T = _wy_solve(b_kk, p_s.index(0), p_s.index(1), p_s.index(2), o_ai, o_aj, False, L_a, L_a)
            p_s.index(3).store(b_T.to(gl.float16))     # a sink: nothing reads it
""")
s = swap(s, """    gs_s = gl.allocate_shared_memory(gl.float32, [2, BT], column)
    for j in gl.static_range(STAGES):
        mbarrier.init(bars.index(j), count=1)
        mbarrier.init(free_bars.index(j), count=2)""", """    gs_s = gl.allocate_shared_memory(gl.float32, [2, BT], column)
    PROBE_ON: gl.constexpr = PROBE and not STORE_STATES
    if PROBE_ON:
        p_s = gl.allocate_shared_memory(gl.float16, [4, BT, BT], tile)
    else:
        p_s = a_s
    for j in gl.static_range(STAGES):
        mbarrier.init(bars.index(j), count=1)
        mbarrier.init(free_bars.index(j), count=2)""")
s = swap(s, """        (_state_scores_partition, (k_s, q_s, a_s, gs_s, bars, free_bars, a_bars, g_cum, i_hv, bos, NT, HV, BT,
                                   STAGES, SCORE_DTYPE)),""", """        (_state_scores_partition, (k_s, q_s, a_s, gs_s, bars, free_bars, a_bars, g_cum, i_hv, bos, NT, HV, BT,
                                   STAGES, SCORE_DTYPE, beta, p_s, PROBE_ON)),""")
s = swap(s, """    SCORES_REGS: gl.constexpr,
    num_warps: gl.constexpr,        # 4: half 0's warpgroup (the default partition)
):
    \"\"\"The Triton pass's FUSED_OUTPUT""", """    SCORES_REGS: gl.constexpr,
    PROBE: gl.constexpr,
    num_warps: gl.constexpr,        # 4: half 0's warpgroup (the default partition)
):
    \"\"\"The Triton pass's FUSED_OUTPUT""")
s = swap(s, """        STORE_STATES=h is not None, SCORE_DTYPE=gl_dtype(score_dtype), STAGES=GLUON_STATE_STAGES,
        **GLUON_STATE_REGISTERS,
    )""", """        STORE_STATES=h is not None, SCORE_DTYPE=gl_dtype(score_dtype), STAGES=GLUON_STATE_STAGES,
        PROBE=PROBE_SOLVE, **(GLUON_STATE_REGISTERS if h is not None else PROBE_REGISTERS),
    )""")
registers = "GLUON_STATE_REGISTERS = dict(CHAIN_REGS=208, SCORES_REGS=88, num_warps=4, maxnreg=168)\n"
for name, probe, regs in (("gdr_p208", False, "CHAIN_REGS=208, SCORES_REGS=88"),
                          ("gdr_p176", False, "CHAIN_REGS=176, SCORES_REGS=152"),
                          ("gdr_psolve", True, "CHAIN_REGS=176, SCORES_REGS=152")):
    text = swap(s, registers, registers + f"PROBE_SOLVE = {probe}\nPROBE_REGISTERS = dict({regs}, num_warps=4, maxnreg=168)\n")
    os.makedirs(os.path.join(ROOT, "variant_tmp"), exist_ok=True)
    with open(os.path.join(ROOT, f"variant_tmp/{name}.py"), "w") as f:
        f.write(text)
    print("wrote", f"variant_tmp/{name}.py")
