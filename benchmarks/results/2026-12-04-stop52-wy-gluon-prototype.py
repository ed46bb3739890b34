"""Prototype: the forward wy stage in Gluon, persistent, k by TMA ring, T by tensor-core product form."""
import torch
from gdngen.runtime.gluon import (fence_async_shared, gl, jit as gluon_jit, mbarrier, row_descriptor, tma,
                                  warpgroup_mma, warpgroup_mma_wait)


@gluon_jit
def _wy_stage(y, y_s, TF32: gl.constexpr):
    """y into y_s as a B operand, in y_s's 16-bit dtype."""
    y_s.store(y.to(y_s.dtype))


@gluon_jit
def _wy_mm(x, y_s, acc, USE_ACC: gl.constexpr, TF32: gl.constexpr, L: gl.constexpr, LF: gl.constexpr):
    """x @ y (+ acc) with y staged in y_s by _wy_stage, issued asynchronously, x rounded to y_s's dtype."""
    a = gl.convert_layout(x.to(y_s.dtype), gl.DotOperandLayout(operand_index=0, parent=L, k_width=2))
    return warpgroup_mma(a, y_s, acc, use_acc=USE_ACC, is_async=True)


@gluon_jit
def _wy_solve(b_A, s0, s1, s2, o_r, o_c, TF32: gl.constexpr, L: gl.constexpr, LF: gl.constexpr):
    """(I + A)^-1 of a strictly lower [BT, BT] A: D^-1 of its diagonal [16, 16] blocks by the nilpotent product,
    then with N = D^-1 L (L the blocks below them, N^4 = 0): T = (I + N^2)(I - N) D^-1."""
    same = (o_r[:, None] // 16) == (o_c[None, :] // 16)
    b_Ad = gl.where(same, b_A, 0.)
    _wy_stage(gl.where(same, 0., b_A), s2, TF32)        # L, until round 5
    b_X = gl.where(o_r[:, None] == o_c[None, :], 1., -b_Ad)
    # round 1: P2 = Ad Ad
    _wy_stage(b_Ad, s0, TF32)
    fence_async_shared()
    p = _wy_mm(b_Ad, s0, gl.zeros(b_A.shape, gl.float32, L), False, TF32, L, LF)
    p = warpgroup_mma_wait(0, deps=(p,))
    b_P = gl.convert_layout(p, L)
    # rounds 2, 3: X += X P; P = P P ; round 4: X += X P
    for r in gl.static_range(3):
        if r % 2 == 0:
            buf = s1
        else:
            buf = s0
        _wy_stage(b_P, buf, TF32)
        fence_async_shared()
        x = _wy_mm(b_X, buf, b_X, True, TF32, L, LF)
        if r < 2:
            p = _wy_mm(b_P, buf, gl.zeros(b_A.shape, gl.float32, L), False, TF32, L, LF)
            x, p = warpgroup_mma_wait(0, deps=(x, p))
            b_P = gl.convert_layout(p, L)
        else:
            x = warpgroup_mma_wait(0, deps=(x,))
        b_X = gl.convert_layout(x, L)
    b_D = b_X                                           # D^-1
    # round 5: N = D^-1 L
    n = _wy_mm(b_D, s2, gl.zeros(b_A.shape, gl.float32, L), False, TF32, L, LF)
    n = warpgroup_mma_wait(0, deps=(n,))
    b_N = gl.convert_layout(n, L)
    # round 6: N2 = N N, Z = N D^-1
    _wy_stage(b_N, s0, TF32)
    _wy_stage(b_D, s1, TF32)
    fence_async_shared()
    n2 = _wy_mm(b_N, s0, gl.zeros(b_A.shape, gl.float32, L), False, TF32, L, LF)
    z = _wy_mm(b_N, s1, gl.zeros(b_A.shape, gl.float32, L), False, TF32, L, LF)
    n2, z = warpgroup_mma_wait(0, deps=(n2, z))
    b_Y = b_D - gl.convert_layout(z, L)                  # (I - N) D^-1
    # round 7: T = Y + N2 Y
    _wy_stage(b_Y, s0, TF32)
    fence_async_shared()
    t = _wy_mm(gl.convert_layout(n2, L), s0, b_Y, True, TF32, L, LF)
    t = warpgroup_mma_wait(0, deps=(t,))
    return gl.convert_layout(t, L)


@gluon_jit
def _wy_fwd_gluon_kernel(
    k_desc,         # [B * T, H * K] view of k, blocks [BT, K]
    t_desc,         # [B * T, HV * BT] view of T (out, float16), blocks [BT, BT]
    beta,           # [B, T, HV] float32, activated
    g_cum,          # [B, T, HV] float32 chunk-local cumsum of the log-decay
    T,
    n_items,        # B * T / BT * H
    H: gl.constexpr,
    HV: gl.constexpr,
    K: gl.constexpr,
    BT: gl.constexpr,
    STAGES: gl.constexpr,
    FALLBACK: gl.constexpr,
    GROUP_ITEMS: gl.constexpr,       # True: an item is (chunk, key head) with its G value heads; False: (chunk, value head)
    num_warps: gl.constexpr,
):
    if GROUP_ITEMS:
        G: gl.constexpr = HV // H
        HI: gl.constexpr = H
    else:
        G: gl.constexpr = 1
        HI: gl.constexpr = HV
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    NTc = T // BT
    L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BT, 16])
    LF: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BT, 8])
    half: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    wide: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    k_ring = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BT, K], k_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    s0 = gl.allocate_shared_memory(gl.float16, [BT, BT], half)
    s1 = gl.allocate_shared_memory(gl.float16, [BT, BT], half)
    s2 = gl.allocate_shared_memory(gl.float16, [BT, BT], half)
    w0 = s0._reinterpret(gl.bfloat16, [BT, BT], half)
    w1 = s1._reinterpret(gl.bfloat16, [BT, BT], half)
    w2 = s2._reinterpret(gl.bfloat16, [BT, BT], half)
    t_s = gl.allocate_shared_memory(t_desc.dtype, [BT, BT], t_desc.layout)

    # the first STAGES items' key tiles
    for s in gl.static_range(STAGES):
        it = pid + s * nprog
        if it < n_items:
            i_i = it % HI
            rest = it // HI
            t0 = (rest // NTc) * T + (rest % NTc) * BT
            mbarrier.expect(bars.index(s), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [t0, (i_i * G // (HV // H)) * K], bars.index(s), k_ring.index(s))

    o_r = gl.arange(0, BT, layout=gl.SliceLayout(1, L))
    o_c = gl.arange(0, BT, layout=gl.SliceLayout(0, L))
    m_A = o_r[:, None] > o_c[None, :]
    same = (o_r[:, None] // 16) == (o_c[None, :] // 16)
    c = 0
    for it in range(pid, n_items, nprog):
        i_i = it % HI
        rest = it // HI
        t0 = (rest // NTc) * T + (rest % NTc) * BT
        slot = c % STAGES
        mbarrier.wait(bars.index(slot), (c // STAGES) & 1)
        k_s = k_ring.index(slot)
        for j in range(G):
            i_hv = i_i * G + j
            # K K^T per value head (not held across the group's heads: registers)
            gram = warpgroup_mma(k_s, k_s.permute((1, 0)), gl.zeros([BT, BT], gl.float32, L), use_acc=False, is_async=True)
            gram = warpgroup_mma_wait(0, deps=(gram,))
            if j == G - 1:
                gl.thread_barrier()
                nxt = it + STAGES * nprog
                if nxt < n_items:
                    n_i = nxt % HI
                    n_rest = nxt // HI
                    n_t0 = (n_rest // NTc) * T + (n_rest % NTc) * BT
                    mbarrier.expect(bars.index(slot), k_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(k_desc, [n_t0, (n_i * G // (HV // H)) * K], bars.index(slot), k_s)
            b_beta = gl.load(beta + (t0 + o_r).to(gl.int64) * HV + i_hv)
            b_gr = gl.load(g_cum + (t0 + o_r).to(gl.int64) * HV + i_hv)
            b_gc = gl.load(g_cum + (t0 + o_c).to(gl.int64) * HV + i_hv)
            b_A = gl.where(m_A, gram * b_beta[:, None] * gl.exp2((b_gr[:, None] - b_gc[None, :]) * 1.4426950408889634), 0.)
            amax = gl.max(gl.max(gl.where(same, gl.abs(b_A), 0.), axis=1), axis=0)
            if FALLBACK:
                if amax <= 1.0:
                    b_T = _wy_solve(b_A, s0, s1, s2, o_r, o_c, False, L, LF)
                else:
                    b_T = _wy_solve(b_A, w0, w1, w2, o_r, o_c, True, L, LF)
            else:
                b_T = _wy_solve(b_A, s0, s1, s2, o_r, o_c, False, L, LF)
            tma.store_wait(0)
            t_s.store(b_T.to(t_desc.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(t_desc, [t0, i_hv * BT], t_s)
        c += 1
    tma.store_wait(0)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


def wy_fwd_gluon(k, beta, g_cum, tmat, B, T, H, HV, K, BT, programs_per_sm=2, stages=2, fallback=True, group_items=False):
    n_items = B * (T // BT) * (H if group_items else HV)
    sms = torch.cuda.get_device_properties(k.device).multi_processor_count
    grid = (min(n_items, sms * programs_per_sm),)
    _wy_fwd_gluon_kernel[grid](row_descriptor(k, H * K, [BT, K]), row_descriptor(tmat, HV * BT, [BT, BT]), beta, g_cum,
                               T, n_items, H=H, HV=HV, K=K, BT=BT, STAGES=stages, FALLBACK=fallback, GROUP_ITEMS=group_items, num_warps=4)
