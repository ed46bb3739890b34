"""benchmarks/offline_sm90.py without a GPU or the H200's Triton: the launches it records from the emulated module
(which kernels, with which switches' constexprs and launch options), and its reading of a SASS listing (the
partitions, their local stores and loads, wgmmas waited for at once). The compile phase needs Triton 3.6 and
runs by hand (NOTES, stop 56)."""
import os

import pytest

from benchmarks.offline_sm90 import _adjusted, _partitions, record

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the emulated module's Triton kernels need TRITON_INTERPRET=1")

NOPS = "".join(f"        /*{0x10 * i:04x}*/                   NOP ;\n" for i in range(45))
LISTING = NOPS + """
        /*1000*/                   USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0x98 ;
        /*1010*/                   STL [R1+0x10], R4 ;
        /*1020*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT, gsb0 ;
        /*1030*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*1040*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24, gsb0 ;
        /*1050*/                   IADD3 R3, R3, 0x1, RZ ;
        /*1060*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*1070*/              @!P0 LDL R5, [R1+0x10] ;
""" + NOPS.replace("/*0", "/*2")


def test_partitions_are_split_at_setmaxnreg_and_count_serialised_wgmmas():
    parts = _partitions(LISTING)
    assert [p["regs"] for p in parts] == ["prologue", "try_alloc 152 regs"]
    scores = parts[1]
    assert (scores["STL"], scores["LDL"], scores["wgmma"]) == (1, 1, 2)
    assert scores["serial"] == 1            # the first wgmma is waited for at once, the second after other work


@pytest.mark.parametrize("switches, reverse, others", [
    ({}, "_fused_bwd_gluon_kernel", ()),                              # the default since stop 67
    ({"gluon_fused_bwd": False}, "_state_bwd_gluon_kernel", ("_chunk_bwd_gluon_kernel", "_wy_bwd_gluon_kernel")),
    ({"gluon_fused_bwd": False, "gluon_one_chain_bwd": True, "gluon_reverse_wy": True}, "_reverse_gluon_kernel",
     ("_chunk_bwd_gluon_kernel",)),                                   # the wy stage folded into the pass
])
def test_a_training_step_records_each_gluon_launch_with_its_constexprs(switches, reverse, others):
    launches = record("gated_delta_rule", (1, 128, 2, 4), (128, 128), "fwd+bwd", switches)
    names = [launch[0] for launch in launches]
    backward = {"_fused_bwd_gluon_kernel", "_state_bwd_gluon_kernel", "_reverse_gluon_kernel",
                "_chunk_bwd_gluon_kernel", "_wy_bwd_gluon_kernel"}
    assert names[0] == "_state_output_gluon_kernel"
    assert backward & set(names) == {reverse, *others}
    arguments, options, home = next((a, o, m) for n, a, o, m in launches if n == reverse)
    assert home == "generated.gated_delta_rule"
    assert options["maxnreg"] in (128, 168)
    assert arguments["K"] == ("value", 128) and arguments["BT"] == ("value", 64)
    if "gluon_reverse_wy" in switches:
        assert arguments["WY"] == ("value", True)
        kind, dtype, shape, block = arguments["h_desc"]
        assert (kind, dtype, block) == ("desc", "torch.bfloat16", [128, 128])


def test_ptxas_report_reads_spills_stack_and_serialised_wgmmas(monkeypatch, tmp_path):
    """compilecheck.ptxas_report (this tool's and `gdngen check --compile-sm90`'s) on ptxas -v's text: the
    register cap passed on, spills, stack and C7512's reason (stop 56's one-chain pass printed this)."""
    import subprocess
    from gdngen import compilecheck
    seen = []
    text = ("ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
            "insufficient register resources for the function '_k'\n"
            "ptxas info    : Function properties for _k\n"
            "    936 bytes stack frame, 1032 bytes spill stores, 1446 bytes spill loads\n"
            "ptxas info    : Used 128 registers, used 4 barriers, 936 bytes cumulative stack size\n")
    fake = tmp_path / "ptxas"
    fake.write_text("")
    monkeypatch.setattr(compilecheck, "ptxas_path", lambda: str(fake))
    monkeypatch.setattr(subprocess, "run", lambda command, **kw: seen.append(command) or
                        subprocess.CompletedProcess(command, 0, "", text))
    report = compilecheck.ptxas_report(".version 8.0", maxnreg=128)
    assert report == dict(regs=128, spill_stores=1032, spill_loads=1446, stack=936,
                          serialized=["insufficient register resources"])
    assert seen[0][1:3] == ["--maxrregcount", "128"]
    clean = text.split("\n", 1)[1].replace("936 bytes stack frame, 1032", "0 bytes stack frame, 0")
    monkeypatch.setattr(subprocess, "run", lambda command, **kw: subprocess.CompletedProcess(command, 0, "", clean))
    assert compilecheck.ptxas_report(".version 8.0")["serialized"] == []


def test_recording_puts_the_emulator_back():
    from gdngen.runtime.gluon_emulator.language import EmulatedKernel
    launch = EmulatedKernel.launch
    record("gated_delta_rule", (1, 64, 1, 1), (128, 128), "fwd", {})
    assert EmulatedKernel.launch is launch


def test_settings_replace_constexprs_and_options_of_the_kernels_asked():
    launches = [("_reverse_gluon_kernel", {"VALUES_REGS": ("value", 160), "q_desc": ("desc", "torch.bfloat16", [1, 1], [1, 1])},
                 {"maxnreg": 128}, "generated.gated_delta_rule"),
                ("_chunk_bwd_gluon_kernel", {"BT": ("value", 64)}, {}, "generated.gated_delta_rule")]
    adjusted = _adjusted(launches, "_reverse", {"VALUES_REGS": 152, "maxnreg": 168, "q_desc": 1})
    assert len(adjusted) == 1
    name, arguments, options, _ = adjusted[0]
    assert arguments["VALUES_REGS"] == ("value", 152) and options == {"maxnreg": 168}
    assert arguments["q_desc"][0] == "desc"                     # only constexprs and plain values are replaced
    assert _adjusted(launches, "", {}) == launches


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("pieces", [1, 4])
@pytest.mark.parametrize("final_state", [False, True])
def test_the_call_records_as_asked(mode, pieces, final_state):
    """``--final-state`` / ``--no-initial-state``: the call recorded as the benchmarks make it (no final state, no
    initial state) or not, so the variant compiled is the one they run (stop 62: the pass over pieces built without
    the final-state store spilled). Pieces store their final states either way; dense sequences of whole
    chunks run as one piece each where the pass stores states or the final state (gluon_dense_pieces)."""
    launches = record("gated_delta_rule", (1, 512, 2, 4), (128, 128), mode, {"state_pieces": pieces},
                      final_state=final_state, initial_state=False)
    passes = [arguments for name, arguments, _, _ in launches if name == "_state_output_gluon_kernel"]
    # (a training forward in pieces starts them from its walk's states: an initial state of the pass's own)
    assert passes and passes[-1]["USE_INITIAL_STATE"] == ("value", mode == "fwd+bwd" and pieces > 1)
    # dense sequences run the pieces build where the pass stores states or the final state (stop 63)
    as_pieces = pieces > 1 or final_state or mode == "fwd+bwd"
    assert passes[-1]["IS_VARLEN"] == ("value", as_pieces)
    assert passes[-1]["STORE_FINAL_STATE"] == ("value", as_pieces)
    if mode == "fwd+bwd":
        reverse = next(a for name, a, _, _ in launches if name == "_fused_bwd_gluon_kernel")
        assert reverse["USE_FINAL_GRAD"] == ("value", final_state)


def test_local_loads_in_loops_are_counted_apart():
    """A local load inside a loop (a predicated backward branch) is paid every trip, one before it once; a barrier
    wait's retry stub jumping back unconditionally from the kernel's end is no loop (stop 62's chain spill)."""
    from benchmarks.offline_sm90 import _loop_ranges
    listing = NOPS + """
        /*1000*/                   USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xd0 ;
        /*1010*/                   STL [R1+0x8], R3 ;
.L_x_35:
        /*1020*/                   LDL R0, [R1+0x8] ;
        /*1030*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT, gsb0 ;
.L_x_45:
        /*1040*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*1050*/               @P0 BRA `(.L_x_35) ;
        /*1060*/                   LDL R2, [R1+0x8] ;
.L_x_31:
        /*1070*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR13+0x2cb50], R0 ;
        /*1080*/                   BRA `(.L_x_45) ;
""" + NOPS.replace("/*0", "/*2")
    assert _loop_ranges(listing) == [(0x1020, 0x1050)]
    chain = _partitions(listing)[1]
    assert (chain["STL"], chain["LDL"], chain["loop_STL"], chain["loop_LDL"]) == (1, 2, 0, 1)
