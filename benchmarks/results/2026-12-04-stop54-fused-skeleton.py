"""Step 1 of docs/fused_backward.md, offline (stop 54; Triton 3.6, sm_90): does a four-partition fused backward's
register split fit? The chain holds dS^T [V, K] float32 in one warpgroup and updates it from shared-memory
operands; the key-sized partition forms dV_new = K dS' and a [BT, K] product pair; the scores-sized partition
three [BT, BT] products and one [BT, K]; a loader of LW warps (default 4) issues the TMA. Stub arithmetic, real
shapes: registers and spills only, nothing runs.

    LW=4 [ONE_ACC=1] PYTHONPATH=<a Triton 3.6 site>:$PWD python benchmarks/results/2026-12-04-stop54-fused-skeleton.py 160 160 24

ONE_ACC=1: the key-sized partition lets dV_new's accumulator go before its next product (one live at a time).
"""
import os, re, subprocess, sys, tempfile, collections
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
from gdngen.runtime.gluon import (fence_async_shared, gl, jit as gluon_jit, mbarrier, row_descriptor, tma,
                                  warpgroup_mma, warpgroup_mma_wait)


@gluon_jit
def _loader(q_desc, k_desc, do_desc, h_desc, q_s, k_s, do_s, h_s, ready, free, NT, BT: gl.constexpr):
    for i_t in range(NT):
        mbarrier.wait(free, (i_t & 1) ^ 1)
        mbarrier.expect(ready, 2 * q_desc.block_type.nbytes + do_desc.block_type.nbytes + h_desc.block_type.nbytes)
        row = (NT - 1 - i_t) * BT
        tma.async_copy_global_to_shared(q_desc, [row, 0], ready, q_s)
        tma.async_copy_global_to_shared(k_desc, [row, 0], ready, k_s)
        tma.async_copy_global_to_shared(do_desc, [row, 0], ready, do_s)
        tma.async_copy_global_to_shared(h_desc, [row * 2, 0], ready, h_s)


@gluon_jit
def _chain(q_s, k_s, do_s, dsp_s, dvn_s, ready, free, dsp_ready, dvn_ready, NT, K: gl.constexpr,
           V: gl.constexpr, BT: gl.constexpr):
    L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, K, 16])
    acc = gl.zeros([V, K], gl.float32, L)              # dS^T: 128 registers a thread
    for i_t in range(NT):
        mbarrier.wait(ready, i_t & 1)
        acc = acc * 0.99
        dsp_s.store(acc.to(gl.bfloat16))               # dS'^T for the products' partitions
        fence_async_shared()
        mbarrier.arrive(dsp_ready, count=1)
        mbarrier.wait(dvn_ready, i_t & 1)
        # dS^T += dO^T Q ; dS^T -= dV_new^T K (stubs of the update's two products, A operands from shared memory)
        acc = warpgroup_mma(do_s.permute((1, 0)), q_s, acc, is_async=True)
        acc = warpgroup_mma(dvn_s.permute((1, 0)), k_s, acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(free, count=1)


@gluon_jit
def _keys(q_s, k_s, do_s, h_s, dsp_s, dvn_s, out_s, dsp_ready, dvn_ready, NT, K: gl.constexpr, V: gl.constexpr,
          BT: gl.constexpr, ONE_ACC: gl.constexpr):
    L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, V, 16])
    Lk: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, K, 16])
    for i_t in range(NT):
        mbarrier.wait(dsp_ready, i_t & 1)
        # dV_new [BT, V] = K dS'  (dsp_s holds dS'^T [V, K])
        b_dv = warpgroup_mma(k_s, dsp_s.permute((1, 0)), gl.zeros([BT, V], gl.float32, L), use_acc=False)
        dvn_s.store(b_dv.to(gl.bfloat16))
        fence_async_shared()
        mbarrier.arrive(dvn_ready, count=1)
        # key-sized products off the chain's path, two [BT, K] accumulators at a time as FlashQLA's partition
        # holds them: dk = dV_new-ish @ S^T + dO S^T stub, then dv = T^T dV_new stub
        b_dk = warpgroup_mma(do_s, h_s.permute((1, 0)), gl.zeros([BT, K], gl.float32, Lk), use_acc=False)
        b_dk = warpgroup_mma(dvn_s, dsp_s, b_dk)
        if ONE_ACC:
            b_dk = b_dk * 0.5                          # dV_new already left: one [BT, K] accumulator live at a time
        else:
            b_dk = b_dk * gl.sum(b_dv, axis=1)[:, None]    # dV_new's accumulator still live: two at a time
        out_s.store(b_dk.to(gl.bfloat16))
        b_x = warpgroup_mma(k_s, h_s, gl.zeros([BT, V], gl.float32, L), use_acc=False)
        out_s.store(b_x.to(gl.bfloat16))


@gluon_jit
def _scores(q_s, k_s, do_s, dvn_s, p_s, q2_s, dvn_ready, NT, K: gl.constexpr, BT: gl.constexpr):
    La: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
    Lk: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, K, 16])
    for i_t in range(NT):
        mbarrier.wait(dvn_ready, i_t & 1)
        b_p = warpgroup_mma(q_s, k_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, La), use_acc=False)
        b_dp = warpgroup_mma(do_s, dvn_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, La), use_acc=False)
        b_kk = warpgroup_mma(k_s, k_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, La), use_acc=False)
        p_s.store((b_p * b_dp + b_kk).to(gl.bfloat16))
        fence_async_shared()
        # dq [BT, K] = dP K + (dO S^T) stub: one [BT, K] accumulator beside the [BT, BT] tiles
        b_dq = warpgroup_mma(p_s, k_s, gl.zeros([BT, K], gl.float32, Lk), use_acc=False)
        b_dq = b_dq * gl.convert_layout(gl.sum(b_dp, axis=1), gl.SliceLayout(1, Lk))[:, None]
        q2_s.store(b_dq.to(gl.bfloat16))


@gluon_jit
def fused_skeleton(q_desc, k_desc, do_desc, h_desc, NT, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr,
                   KEY_REGS: gl.constexpr, SCORES_REGS: gl.constexpr, LOADER_REGS: gl.constexpr, LOADER_WARPS: gl.constexpr,
                   ONE_ACC: gl.constexpr,
                   num_warps: gl.constexpr):
    tile: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_s = gl.allocate_shared_memory(gl.bfloat16, [BT, K], tile)
    k_s = gl.allocate_shared_memory(gl.bfloat16, [BT, K], tile)
    do_s = gl.allocate_shared_memory(gl.bfloat16, [BT, V], tile)
    h_s = gl.allocate_shared_memory(gl.bfloat16, [K, V], tile)
    dsp_s = gl.allocate_shared_memory(gl.bfloat16, [V, K], tile)
    dvn_s = gl.allocate_shared_memory(gl.bfloat16, [BT, V], tile)
    out_s = gl.allocate_shared_memory(gl.bfloat16, [BT, K], tile)
    p_s = gl.allocate_shared_memory(gl.bfloat16, [BT, BT], tile)
    q2_s = gl.allocate_shared_memory(gl.bfloat16, [BT, K], tile)
    bars = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(4):
        mbarrier.init(bars.index(j), count=1)
    ready, free, dsp_ready, dvn_ready = bars.index(0), bars.index(1), bars.index(2), bars.index(3)
    gl.warp_specialize([
        (_chain, (q_s, k_s, do_s, dsp_s, dvn_s, ready, free, dsp_ready, dvn_ready, NT, K, V, BT)),
        (_keys, (q_s, k_s, do_s, h_s, dsp_s, dvn_s, out_s, dsp_ready, dvn_ready, NT, K, V, BT, ONE_ACC)),
        (_scores, (q_s, k_s, do_s, dvn_s, p_s, q2_s, dvn_ready, NT, K, BT)),
        (_loader, (q_desc, k_desc, do_desc, h_desc, q_s, k_s, do_s, h_s, ready, free, NT, BT)),
    ], [4, 4, LOADER_WARPS], [KEY_REGS, SCORES_REGS, LOADER_REGS])


def main():
    K = V = 128
    BT = 64
    key_regs, scores_regs, loader_regs = (int(x) for x in (sys.argv[1:4] if len(sys.argv) > 3 else (144, 160, 24)))
    x = torch.zeros(4096, K, dtype=torch.bfloat16)
    h = torch.zeros(4096 * 2, V, dtype=torch.bfloat16)
    args = dict(q_desc=row_descriptor(x, K, [BT, K]), k_desc=row_descriptor(x, K, [BT, K]),
                do_desc=row_descriptor(x, V, [BT, V]), h_desc=row_descriptor(h, V, [K, V]), NT=64)
    sig = {name: mangle_type(a) for name, a in args.items()}
    const = dict(K=K, V=V, BT=BT, KEY_REGS=key_regs, SCORES_REGS=scores_regs, LOADER_REGS=loader_regs, LOADER_WARPS=int(os.environ.get("LW", 4)),
                 ONE_ACC=int(os.environ.get("ONE_ACC", 0)), num_warps=4)
    sig.update({n: "constexpr" for n in const})
    fn = fused_skeleton
    src = GluonASTSource(fn, sig, {(fn.arg_names.index(n),): v for n, v in const.items()}, {})
    cc = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": int(os.environ.get("MAXNREG", 128))})
    d = tempfile.mkdtemp()
    open(f"{d}/k.cubin", "wb").write(cc.asm["cubin"])
    bindir = os.path.dirname(triton.__file__) + "/backends/nvidia/bin"
    res = subprocess.run([f"{bindir}/cuobjdump", "-res-usage", f"{d}/k.cubin"], capture_output=True, text=True).stdout
    sass = subprocess.run([f"{bindir}/nvdisasm", "-c", f"{d}/k.cubin"], capture_output=True, text=True).stdout
    ops = collections.Counter(m.group(1) for line in sass.splitlines()
                              if (m := re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)))
    print("one accumulator" if const["ONE_ACC"] else "two accumulators", "regs key/scores/loader", key_regs, scores_regs, loader_regs, re.findall(r"REG:\d+ STACK:\d+", res),
          "STL", ops["STL"], "LDL", ops["LDL"], "shared", cc.metadata.shared,
          "USETMAXREG", re.findall(r"USETMAXREG\.\w+\.CTAPOOL\s+(?:UP\d+,\s*)?(0x[0-9a-f]+)", sass))
    # spill instructions by partition: the stretch of SASS after each USETMAXREG
    part, counts = "prologue", collections.Counter()
    for line in sass.splitlines():
        m = re.search(r"USETMAXREG\.(\w+)\.CTAPOOL\s+(?:UP\d+,\s*)?(0x[0-9a-f]+)", line)
        if m:
            part = f"{m.group(1)} {int(m.group(2), 16)}"
        if re.search(r"\b(STL|LDL)\b", line):
            counts[part] += 1
    print("  spill instructions by partition:", dict(counts))


if __name__ == "__main__":
    main()
