"""How fast can a Gluon kernel run FlashQLA's fused-backward schedule (docs/fused_backward.md, section 10)?

A timing skeleton, not a kernel: the schedule's products with their real shapes, operands and hand-offs
through shared memory, its single-buffered tiles, its barrier steps and its TMA traffic (q, k, dO, v, the
inverse A and h in; dq, dk, dv out through one staging tile), on garbage data. The elementwise decay terms are
stand-ins of the same shape (a multiply per element, a row sum where the schedule has one), so the figure is a
lower bound on what the real kernel's per-chunk time would be. It answers one question before the real kernel
is written: can a Gluon kernel with this schedule run a chunk in under ~10 us at 128 programs, as the 1.2x
training row needs (section 10: FlashQLA's fused kernel 10.9 us a chunk on the H200, 11.8 on the H100)?

Per chunk (last to first), three consumers meet at every step (FlashQLA's table; steps 12-13 are one here):
  S (the default partition, dS [K, V] float32): decay; <dS', S0>; dS += K^T dVg; dOg; dS += Q^T dOg; dS' out
  K ([64, 128] products): dV' = K dS' (+ Pg^T dO); dv = Ag^T dV'; dVg; dK = V' dS'^T (+ dVg S0^T + dP^T Q
    + dA K)
  A ([64, 64] products): P = Q K^T; Pg, Ag; U = K S0; W; dAg = dV' W^T; V' = Ag W; dPg = dO V'^T; dP;
    dQ = dO S0^T (+ dP K); dAr; dA = -A^T dAr A^T
  a one-warp producer: the loads, each as soon as its tile's last reader passed, and the three stores.

    python benchmarks/fused_bwd_schedule_probe.py --offline --triton /tmp/t36x     # registers, stack, smem
    python benchmarks/fused_bwd_schedule_probe.py --out DIR                        # on a Hopper GPU: us a chunk
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if "--triton" in sys.argv:                       # the offline compile: the H200's Triton ahead of the CPU one
    sys.path.insert(0, sys.argv[sys.argv.index("--triton") + 1])
sys.path.insert(0, ROOT)

import torch  # noqa: E402

if "--emulate" in sys.argv:                      # the CPU emulator's Gluon names (deadlocks, races, fences)
    from gdngen.runtime.gluon_emulator import runtime_module
    sys.modules["gdngen.runtime.gluon"] = runtime_module()

from gdngen.runtime.gluon import (fence_async_shared, gl, jit as gluon_jit, mbarrier, row_descriptor, tma,  # noqa: E402
                                  warpgroup_mma, warpgroup_mma_wait)

NSTEP = 15          # FlashQLA's sixteen with steps 12 and 13 as one


@gluon_jit
def _meet(steps, s: gl.constexpr, phase):
    """End of step s for this consumer: every consumer's shared-memory writes of the step are visible after."""
    fence_async_shared()
    mbarrier.arrive(steps.index(s), count=1)
    mbarrier.wait(steps.index(s), phase)


@gluon_jit
def _producer(q_desc, k_desc, do_desc, v_desc, a_desc, h_desc, dq_desc, dk_desc, dv_desc, q_s, k_s, do_s, v_s, a_s,
              h_s, stg, steps, rd, fr, i_hv, bos, NT, HV: gl.constexpr, K: gl.constexpr, BT: gl.constexpr):
    """Loads each tile of chunk i + 1 once its last reader in chunk i passed; sends dv, dq and dk from the staging
    tile (and says when it is free again)."""
    # rd: 0 q, 1 k, 2 dO, 3 A, 4 v, 5 h; fr: 0 after dk, 1 after dv, 2 after dq
    row = bos + (NT - 1) * BT
    hrow = ((bos // BT + NT - 1) * HV + i_hv) * K
    col = i_hv * K
    mbarrier.expect(rd.index(0), q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row, col], rd.index(0), q_s)
    mbarrier.expect(rd.index(1), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row, col], rd.index(1), k_s)
    mbarrier.expect(rd.index(2), do_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(do_desc, [row, col], rd.index(2), do_s)
    mbarrier.expect(rd.index(3), a_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(a_desc, [row, i_hv * BT], rd.index(3), a_s)
    mbarrier.expect(rd.index(4), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [row, col], rd.index(4), v_s)
    mbarrier.expect(rd.index(5), h_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(h_desc, [hrow, 0], rd.index(5), h_s)
    for i in range(NT):
        ph = i & 1
        row = bos + (NT - 1 - i) * BT
        nrow = row - BT
        more = i + 1 < NT
        if i > 0:
            mbarrier.wait(steps.index(0), ph)                    # K put dk(i - 1) in the staging tile
            tma.async_copy_shared_to_global(dk_desc, [row + BT, col], stg)
            tma.store_wait(0)
            mbarrier.arrive(fr.index(0), count=1)
        mbarrier.wait(steps.index(5), ph)                        # dv in staging; v read for the last time
        tma.async_copy_shared_to_global(dv_desc, [row, col], stg)
        if more:
            mbarrier.expect(rd.index(4), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [nrow, col], rd.index(4), v_s)
        tma.store_wait(0)
        mbarrier.arrive(fr.index(1), count=1)
        mbarrier.wait(steps.index(10), ph)                       # h read for the last time
        if more:
            mbarrier.expect(rd.index(5), h_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(h_desc, [((bos // BT + NT - 2 - i) * HV + i_hv) * K, 0], rd.index(5), h_s)
        mbarrier.wait(steps.index(11), ph)                       # dq in staging
        tma.async_copy_shared_to_global(dq_desc, [row, col], stg)
        tma.store_wait(0)
        mbarrier.arrive(fr.index(2), count=1)
        if more:
            mbarrier.wait(steps.index(12), ph)                   # dO read for the last time
            mbarrier.expect(rd.index(2), do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(do_desc, [nrow, col], rd.index(2), do_s)
            mbarrier.wait(steps.index(12), ph)                   # A: its last product is in step 12 too
            mbarrier.expect(rd.index(3), a_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [nrow, i_hv * BT], rd.index(3), a_s)
            mbarrier.wait(steps.index(13), ph)                   # q
            mbarrier.expect(rd.index(0), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [nrow, col], rd.index(0), q_s)
            mbarrier.wait(steps.index(14), ph)                   # k
            mbarrier.expect(rd.index(1), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [nrow, col], rd.index(1), k_s)


@gluon_jit
def _consumer_s(q_s, k_s, do_s, h_s, md1, md2, dsp, steps, rd, g_ptr, dg_ptr, i_hv, bos, NT, HV: gl.constexpr,
                K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr):
    L_s: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, V, 16])
    rows: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    o_t = gl.arange(0, BT, layout=gl.SliceLayout(1, rows))
    d_s = gl.zeros([K, V], gl.float32, L_s)
    for i in range(NT):
        ph = i & 1
        t0 = bos + (NT - 1 - i) * BT
        b_g = gl.load(g_ptr + (t0 + o_t) * HV + i_hv)
        _meet(steps, 0, ph)
        d_s = d_s * 0.999                                        # 1: dS *= exp(g_last)
        _meet(steps, 1, ph)
        _meet(steps, 2, ph)
        _meet(steps, 3, ph)
        mbarrier.wait(rd.index(5), ph)                           # 4: <dS', S0>, in row slices
        b_hd = gl.zeros([BT // 2], gl.float32, gl.SliceLayout(1, rows))
        for j in gl.static_range(K // (BT // 2)):
            b_hd += gl.sum(h_s.slice(j * (BT // 2), BT // 2).load(rows).to(gl.float32)
                           * dsp.slice(j * (BT // 2), BT // 2).load(rows).to(gl.float32), axis=1)
        _meet(steps, 4, ph)
        for s in gl.static_range(5, 11):
            _meet(steps, s, ph)
        mbarrier.wait(rd.index(1), ph)                           # 11: dS += K^T dVg
        d_s = warpgroup_mma(k_s.permute((1, 0)), md1, d_s, is_async=True)
        d_s = warpgroup_mma_wait(0, deps=(d_s,))
        _meet(steps, 11, ph)
        for j in gl.static_range(2):                             # 12: dOg = scale exp(g) dO, by halves
            b_do = do_s.slice(j * (BT // 2), BT // 2).load(rows).to(gl.float32)
            b_gh = gl.load(g_ptr + (t0 + j * (BT // 2) + gl.arange(0, BT // 2, gl.SliceLayout(1, rows))) * HV + i_hv)
            md2.slice(j * (BT // 2), BT // 2).store((b_do * gl.exp2(b_gh)[:, None]).to(md2.dtype))
        _meet(steps, 12, ph)
        mbarrier.wait(rd.index(0), ph)                           # 13: dS += Q^T dOg
        d_s = warpgroup_mma(q_s.permute((1, 0)), md2, d_s, is_async=True)
        d_s = warpgroup_mma_wait(0, deps=(d_s,))
        _meet(steps, 13, ph)
        dsp.store(d_s.to(dsp.dtype))                             # 14: next chunk's dS'
        gl.store(dg_ptr + (t0 + o_t) * HV + i_hv, b_g + gl.sum(b_hd, axis=0))
        _meet(steps, 14, ph)


@gluon_jit
def _consumer_k(q_s, k_s, do_s, h_s, sm0, sm1, sm2, md0, md1, md2, dsp, stg, steps, rd, fr, dk_desc, g_ptr, dg_ptr,
                i_hv, bos, NT, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr):
    L_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, V, 16])
    o_t = gl.arange(0, BT, layout=gl.SliceLayout(1, L_o))
    b_dk = gl.zeros([BT, K], gl.float32, L_o)
    for i in range(NT):
        ph = i & 1
        t0 = bos + (NT - 1 - i) * BT
        b_g = gl.load(g_ptr + (t0 + o_t) * HV + i_hv)
        if i > 0:                                                # 0: the previous chunk's dK to staging
            mbarrier.wait(fr.index(2), ph ^ 1)
            stg.store(b_dk.to(stg.dtype))
        _meet(steps, 0, ph)
        mbarrier.wait(rd.index(1), ph)                           # 1: dV' = (K dS') decayed
        b_x = warpgroup_mma(k_s, dsp, gl.zeros([BT, V], gl.float32, L_o), use_acc=False, is_async=True)
        b_x = warpgroup_mma_wait(0, deps=(b_x,))
        b_x = b_x * gl.exp2(b_g)[:, None]
        _meet(steps, 1, ph)
        mbarrier.wait(rd.index(2), ph)                           # 2: dV' += Pg^T dO
        b_x = warpgroup_mma(sm0.permute((1, 0)), do_s, b_x, is_async=True)
        b_x = warpgroup_mma_wait(0, deps=(b_x,))
        _meet(steps, 2, ph)
        md0.store(b_x.to(md0.dtype))                             # 3
        _meet(steps, 3, ph)
        b_x = warpgroup_mma(sm1.permute((1, 0)), md0, gl.zeros([BT, V], gl.float32, L_o), use_acc=False,
                            is_async=True)                       # 4: dv = Ag^T dV', to staging
        b_x = warpgroup_mma_wait(0, deps=(b_x,))
        if i > 0:
            mbarrier.wait(fr.index(0), ph ^ 1)
        stg.store(b_x.to(stg.dtype))
        _meet(steps, 4, ph)
        b_x = -b_x * gl.exp2(b_g)[:, None]                       # 5: dVg; dg += rowsum(dVg U); dVg over U
        b_dg = gl.sum(b_x * md1.load(L_o).to(gl.float32), axis=1)
        gl.thread_barrier()
        md1.store(b_x.to(md1.dtype))
        _meet(steps, 5, ph)
        _meet(steps, 6, ph)
        b_dk = warpgroup_mma(md2, dsp.permute((1, 0)), gl.zeros([BT, K], gl.float32, L_o), use_acc=False,
                             is_async=True)                      # 7: dK = V' dS'^T
        b_dk = warpgroup_mma_wait(0, deps=(b_dk,))
        _meet(steps, 7, ph)
        b_dk = b_dk * gl.exp2(b_g)[:, None]                      # 8: decay, dg terms
        b_dg += gl.sum(b_dk * k_s.load(L_o).to(gl.float32), axis=1)
        _meet(steps, 8, ph)
        b_dk = warpgroup_mma(md1, h_s.permute((1, 0)), b_dk, is_async=True)   # 9: dK += dVg S0^T
        b_dk = warpgroup_mma_wait(0, deps=(b_dk,))
        _meet(steps, 9, ph)
        _meet(steps, 10, ph)
        _meet(steps, 11, ph)
        mbarrier.wait(rd.index(0), ph)                           # 12: dK += dP^T Q
        b_dk = warpgroup_mma(sm2.permute((1, 0)), q_s, b_dk, is_async=True)
        b_dk = warpgroup_mma_wait(0, deps=(b_dk,))
        _meet(steps, 12, ph)
        _meet(steps, 13, ph)
        b_dk = warpgroup_mma(sm0, k_s, b_dk, is_async=True)     # 14: dK += dA K
        b_dk = warpgroup_mma_wait(0, deps=(b_dk,))
        gl.store(dg_ptr + (t0 + o_t) * HV + i_hv, b_dg)
        _meet(steps, 14, ph)
    mbarrier.wait(fr.index(2), (NT - 1) & 1)                     # the last dK leaves from here
    stg.store(b_dk.to(stg.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(dk_desc, [bos, i_hv * K], stg)
    tma.store_wait(0)


@gluon_jit
def _consumer_a(q_s, k_s, do_s, v_s, a_s, h_s, sm0, sm1, sm2, md0, md1, md2, stg, steps, rd, fr, g_ptr, dg_ptr,
                i_hv, bos, NT, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr):
    L_a: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
    L_o: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, V, 16])
    o_r = gl.arange(0, BT, layout=gl.SliceLayout(1, L_a))
    o_c = gl.arange(0, BT, layout=gl.SliceLayout(0, L_a))
    o_t = gl.arange(0, BT, layout=gl.SliceLayout(1, L_o))
    for i in range(NT):
        ph = i & 1
        t0 = bos + (NT - 1 - i) * BT
        b_gr = gl.load(g_ptr + (t0 + o_r) * HV + i_hv)
        b_gc = gl.load(g_ptr + (t0 + o_c) * HV + i_hv)
        b_g = gl.load(g_ptr + (t0 + o_t) * HV + i_hv)
        mbarrier.wait(rd.index(0), ph)                           # 0: P = Q K^T
        mbarrier.wait(rd.index(1), ph)
        b_p = warpgroup_mma(q_s, k_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, L_a), use_acc=False,
                            is_async=True)
        b_p = warpgroup_mma_wait(0, deps=(b_p,))
        _meet(steps, 0, ph)
        b_gm = gl.where(o_r[:, None] >= o_c[None, :], gl.exp2(b_gr[:, None] - b_gc[None, :]), 0.)   # 1: Pg
        sm0.store((b_p * b_gm).to(sm0.dtype))
        _meet(steps, 1, ph)
        mbarrier.wait(rd.index(3), ph)                           # 2: Ag = G (A diag(beta))
        sm1.store((a_s.load(L_a).to(gl.float32) * b_gm).to(sm1.dtype))
        _meet(steps, 2, ph)
        mbarrier.wait(rd.index(5), ph)                           # 3: U = K S0
        b_u = warpgroup_mma(k_s, h_s, gl.zeros([BT, V], gl.float32, L_o), use_acc=False, is_async=True)
        b_u = warpgroup_mma_wait(0, deps=(b_u,))
        _meet(steps, 3, ph)
        md1.store(b_u.to(md1.dtype))                             # 4: U; W = V - exp(g) U
        mbarrier.wait(rd.index(4), ph)
        md2.store((v_s.load(L_o).to(gl.float32) - b_u * gl.exp2(b_g)[:, None]).to(md2.dtype))
        _meet(steps, 4, ph)
        b_dag = warpgroup_mma(md0, md2.permute((1, 0)), gl.zeros([BT, BT], gl.float32, L_a), use_acc=False,
                              is_async=True)                     # 5: dAg = dV' W^T; V' = Ag W over W
        b_vp = warpgroup_mma(sm1, md2, gl.zeros([BT, V], gl.float32, L_o), use_acc=False, is_async=True)
        b_dag, b_vp = warpgroup_mma_wait(0, deps=(b_dag, b_vp))
        gl.thread_barrier()
        md2.store(b_vp.to(md2.dtype))
        _meet(steps, 5, ph)
        b_dp = warpgroup_mma(do_s, md2.permute((1, 0)), gl.zeros([BT, BT], gl.float32, L_a), use_acc=False,
                             is_async=True)                      # 6: dPg = dO V'^T
        b_dp = warpgroup_mma_wait(0, deps=(b_dp,))
        _meet(steps, 6, ph)
        b_gm = gl.where(o_r[:, None] >= o_c[None, :], gl.exp2(b_gr[:, None] - b_gc[None, :]), 0.)   # 7: dP,
        b_dp = b_dp * b_gm                                       # dAb, dg terms (P from Pg's tile)
        b_dg = gl.sum(b_dp * sm0.load(L_a).to(gl.float32), axis=1) + gl.sum(b_dag * b_gm, axis=1)
        sm2.store(b_dp.to(sm2.dtype))
        _meet(steps, 7, ph)
        b_dq = warpgroup_mma(do_s, h_s.permute((1, 0)), gl.zeros([BT, K], gl.float32, L_o), use_acc=False,
                             is_async=True)                      # 8: dQ = dO S0^T
        b_dq = warpgroup_mma_wait(0, deps=(b_dq,))
        _meet(steps, 8, ph)
        b_dq = b_dq * gl.exp2(b_g)[:, None]                      # 9: decay; rowsum(Q dQ)
        b_dgq = gl.sum(b_dq * q_s.load(L_o).to(gl.float32), axis=1)
        _meet(steps, 9, ph)
        b_dq = warpgroup_mma(sm2, k_s, b_dq, is_async=True)     # 10: dQ += dP K, to staging
        b_dq = warpgroup_mma_wait(0, deps=(b_dq,))
        mbarrier.wait(fr.index(1), ph)
        stg.store(b_dq.to(stg.dtype))
        _meet(steps, 10, ph)
        b_dar = b_dag * a_s.load(L_a).to(gl.float32)            # 11: dAb * A, dbeta, dAr
        b_db = gl.sum(b_dar, axis=1)
        sm1.store(b_dar.to(sm1.dtype))
        _meet(steps, 11, ph)
        b_x = warpgroup_mma(a_s.permute((1, 0)), sm1, gl.zeros([BT, BT], gl.float32, L_a), use_acc=False,
                            is_async=True)                       # 12: dA = -A^T dAr A^T
        b_x = warpgroup_mma_wait(0, deps=(b_x,))
        sm0.store(b_x.to(sm0.dtype))
        fence_async_shared()
        gl.thread_barrier()
        b_x = warpgroup_mma(sm0, a_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, L_a), use_acc=False,
                            is_async=True)
        b_x = warpgroup_mma_wait(0, deps=(b_x,))
        gl.thread_barrier()
        sm0.store((-b_x).to(sm0.dtype))
        gl.store(dg_ptr + (t0 + o_r) * HV + i_hv, b_dg + b_db + gl.convert_layout(b_dgq, gl.SliceLayout(1, L_a)))
        _meet(steps, 12, ph)
        _meet(steps, 13, ph)
        _meet(steps, 14, ph)


@gluon_jit
def fused_bwd_schedule(q_desc, k_desc, do_desc, v_desc, a_desc, h_desc, dq_desc, dk_desc, dv_desc, g_ptr, dg_ptr,
                       NT, HV: gl.constexpr, K: gl.constexpr, V: gl.constexpr, BT: gl.constexpr,
                       K_REGS: gl.constexpr, A_REGS: gl.constexpr, P_REGS: gl.constexpr, num_warps: gl.constexpr):
    """One program per (piece of NT chunks, value head)."""
    i_p, i_hv = gl.program_id(0) // HV, gl.program_id(0) % HV
    bos = i_p * NT * BT
    wide: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_s = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    k_s = gl.allocate_shared_memory(k_desc.dtype, k_desc.block_type.shape, k_desc.layout)
    do_s = gl.allocate_shared_memory(do_desc.dtype, do_desc.block_type.shape, do_desc.layout)
    v_s = gl.allocate_shared_memory(v_desc.dtype, v_desc.block_type.shape, v_desc.layout)
    a_s = gl.allocate_shared_memory(a_desc.dtype, a_desc.block_type.shape, a_desc.layout)
    h_s = gl.allocate_shared_memory(h_desc.dtype, h_desc.block_type.shape, h_desc.layout)
    sm0 = gl.allocate_shared_memory(a_desc.dtype, [BT, BT], wide)
    sm1 = gl.allocate_shared_memory(a_desc.dtype, [BT, BT], wide)
    sm2 = gl.allocate_shared_memory(a_desc.dtype, [BT, BT], wide)
    md0 = gl.allocate_shared_memory(q_desc.dtype, [BT, V], wide)
    md1 = gl.allocate_shared_memory(q_desc.dtype, [BT, V], wide)
    md2 = gl.allocate_shared_memory(q_desc.dtype, [BT, V], wide)
    dsp = gl.allocate_shared_memory(h_desc.dtype, [K, V], wide)
    stg = gl.allocate_shared_memory(dq_desc.dtype, dq_desc.block_type.shape, dq_desc.layout)
    steps = gl.allocate_shared_memory(gl.int64, [15, 1], mbarrier.MBarrierLayout())
    rd = gl.allocate_shared_memory(gl.int64, [6, 1], mbarrier.MBarrierLayout())
    fr = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(15):
        mbarrier.init(steps.index(j), count=3)
    for j in gl.static_range(6):
        mbarrier.init(rd.index(j), count=1)
    for j in gl.static_range(3):
        mbarrier.init(fr.index(j), count=1)
    dsp.store(gl.zeros([K, V], gl.bfloat16, gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])))
    fence_async_shared()
    gl.warp_specialize([
        (_consumer_s, (q_s, k_s, do_s, h_s, md1, md2, dsp, steps, rd, g_ptr, dg_ptr, i_hv, bos, NT, HV, K, V, BT)),
        (_consumer_k, (q_s, k_s, do_s, h_s, sm0, sm1, sm2, md0, md1, md2, dsp, stg, steps, rd, fr, dk_desc, g_ptr,
                       dg_ptr + 1, i_hv, bos, NT, HV, K, V, BT)),
        (_consumer_a, (q_s, k_s, do_s, v_s, a_s, h_s, sm0, sm1, sm2, md0, md1, md2, stg, steps, rd, fr, g_ptr,
                       dg_ptr + 2, i_hv, bos, NT, HV, K, V, BT)),
        (_producer, (q_desc, k_desc, do_desc, v_desc, a_desc, h_desc, dq_desc, dk_desc, dv_desc, q_s, k_s, do_s,
                     v_s, a_s, h_s, stg, steps, rd, fr, i_hv, bos, NT, HV, K, BT)),
    ], [4, 4, 1], [K_REGS, A_REGS, P_REGS])


def _tensors(pieces: int, heads: int, NT: int, device: str):
    K = V = 128
    BT = 64
    T = pieces * NT * BT
    make = lambda *s: torch.randn(*s, device=device, dtype=torch.bfloat16) * 0.1   # noqa: E731
    q, k, do, v = (make(T, heads * K) for _ in range(4))
    a = make(T, heads * BT)
    h = make(T // BT * heads * K, V)
    dq, dk, dv = (torch.empty(T, heads * K, device=device, dtype=torch.bfloat16) for _ in range(3))
    g = -torch.rand(T, heads, device=device) * 0.05
    dg = torch.empty(T + 4, heads, device=device)
    descs = dict(q_desc=row_descriptor(q, heads * K, [BT, K]), k_desc=row_descriptor(k, heads * K, [BT, K]),
                 do_desc=row_descriptor(do, heads * V, [BT, V]), v_desc=row_descriptor(v, heads * V, [BT, V]),
                 a_desc=row_descriptor(a, heads * BT, [BT, BT]), h_desc=row_descriptor(h, V, [K, V]),
                 dq_desc=row_descriptor(dq, heads * K, [BT, K]), dk_desc=row_descriptor(dk, heads * K, [BT, K]),
                 dv_desc=row_descriptor(dv, heads * V, [BT, V]))
    return descs, g, dg, (q, k, do, v, a, h, dq, dk, dv)


def offline(regs):
    """Compile for sm_90a without a GPU (benchmarks/offline_sm90.py's compile): registers, stack and shared
    memory per partition."""
    from benchmarks.offline_sm90 import _partitions, compile_report
    descs, g, dg, _ = _tensors(1, 2, 4, "cpu")
    values = dict(descs, g_ptr=g, dg_ptr=dg, NT=4, HV=2, K=128, V=128, BT=64, K_REGS=regs[0], A_REGS=regs[1],
                  P_REGS=regs[2], num_warps=4)
    compiled, report, sass = compile_report(fused_bwd_schedule, values, {"maxnreg": 128})
    print("regs K/A/producer", regs, "shared", compiled.metadata.shared, report)
    for part in _partitions(sass):
        print("  ", part)


def emulate(regs, heads=2, pieces=1, NT=3):
    """The schedule on the CPU emulator (gdngen.runtime.gluon_emulator): deadlocks, races between the
    partitions, missing fences and TMA stores rewritten early raise."""
    descs, g, dg, keep = _tensors(pieces, heads, NT, "cpu")
    const = dict(HV=heads, K=128, V=128, BT=64, K_REGS=regs[0], A_REGS=regs[1], P_REGS=regs[2], num_warps=4,
                 maxnreg=128)
    fused_bwd_schedule[(pieces * heads,)](**descs, g_ptr=g, dg_ptr=dg, NT=NT, **const)
    print("emulated: every partition finished;", "dq, dk, dv written:",
          [bool(torch.isfinite(x).any()) for x in keep[6:]])


def run(regs, out_dir, heads=32, pieces=4, NT=128):
    import triton
    descs, g, dg, keep = _tensors(pieces, heads, NT, "cuda")
    const = dict(HV=heads, K=128, V=128, BT=64, K_REGS=regs[0], A_REGS=regs[1], P_REGS=regs[2], num_warps=4,
                 maxnreg=128)
    launch = lambda: fused_bwd_schedule[(pieces * heads,)](**descs, g_ptr=g, dg_ptr=dg, NT=NT, **const)  # noqa: E731
    launch()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(launch, warmup=50, rep=400)
    row = dict(regs=list(regs), heads=heads, pieces=pieces, NT=NT, ms=ms, us_per_chunk=ms * 1e3 / NT,
               device=torch.cuda.get_device_name(), finite=bool(torch.isfinite(keep[6]).all()))
    print(json.dumps(row), flush=True)
    if out_dir:
        with open(os.path.join(out_dir, "fused_bwd_schedule_probe.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--offline", action="store_true")
    p.add_argument("--emulate", action="store_true")
    p.add_argument("--triton", help="a Triton 3.6 site for --offline")
    p.add_argument("--regs", default="144,184,24", help="K,A,producer registers (S gets the rest of 512)")
    p.add_argument("--out", default=os.environ.get("OUT"))
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--pieces", type=int, default=4)
    p.add_argument("--chunks", type=int, default=128)
    a = p.parse_args()
    for regs in a.regs.split(";"):
        r = tuple(int(x) for x in regs.split(","))
        if a.offline:
            offline(r)
        elif a.emulate:
            emulate(r)
        else:
            run(r, a.out, a.heads, a.pieces, a.chunks)


if __name__ == "__main__":
    main()
