"""benchmarks/offline_sm90.py without a GPU or the H200's Triton: the launches it records from the emulated module
(which kernels, with which switches' constexprs and launch options), and its reading of a SASS listing (the
partitions, their local stores and loads, wgmmas waited for at once). The compile phase needs Triton 3.6 and
runs by hand (NOTES, stop 56)."""
import os

import pytest

from benchmarks.offline_sm90 import _partitions, record

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


@pytest.mark.parametrize("switches, reverse", [({}, "_state_bwd_gluon_kernel"),
                                               ({"gluon_one_chain_bwd": True, "gluon_reverse_wy": True},
                                                "_reverse_gluon_kernel")])
def test_a_training_step_records_each_gluon_launch_with_its_constexprs(switches, reverse):
    launches = record("gated_delta_rule", (1, 128, 2, 4), (128, 128), "fwd+bwd", switches)
    names = [launch[0] for launch in launches]
    assert names[0] == "_state_output_gluon_kernel" and reverse in names
    assert "_chunk_bwd_gluon_kernel" in names
    assert ("_wy_bwd_gluon_kernel" in names) == (not switches)        # folded into the pass with gluon_reverse_wy
    arguments, options, home = next((a, o, m) for n, a, o, m in launches if n == reverse)
    assert home == "generated.gated_delta_rule"
    assert options["maxnreg"] in (128, 168)
    assert arguments["K"] == ("value", 128) and arguments["BT"] == ("value", 64)
    if switches:
        assert arguments["WY"] == ("value", True)
        kind, dtype, shape, block = arguments["h_desc"]
        assert (kind, dtype, block) == ("desc", "torch.bfloat16", [128, 128])
def test_triton_kernels_are_recorded_and_still_run():
    """With triton_kernels the @triton.jit launches are recorded too (with their host-built descriptors and
    launch options) and still run: the Gluon stages after them read what they wrote. Afterwards both launch
    paths are the emulator's and the interpreter's again."""
    from triton.runtime.interpreter import InterpretedFunction
    from gdngen.runtime.gluon_emulator.language import EmulatedKernel
    interpret, emulate = InterpretedFunction.run, EmulatedKernel.launch
    launches = record("gated_delta_rule", (1, 128, 2, 4), (128, 128), "fwd", {}, triton_kernels=True)
    names = [launch[0] for launch in launches]
    assert names[:2] == ["_gates_fwd_kernel", "_wy_fwd_kernel_bt64"] and names[2] == "_state_output_gluon_kernel"
    arguments, options = launches[1][1], launches[1][2]
    assert options["num_warps"] >= 1
    assert any(d[0] == "tdesc" for d in arguments.values()) == (arguments.get("TMA") == ("value", True))
    assert (InterpretedFunction.run, EmulatedKernel.launch) == (interpret, emulate)
