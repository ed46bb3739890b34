"""Gluon, Triton's explicit-layout dialect, for the generated kernels that need a layout Triton's
compiler does not pick: what a generated module imports from it, and when such a kernel may run.

The first is the delta rule's fused forward state pass (stages/state_gluon.py.j2): one program per
(piece, value head) holding the whole [K, V] state as two warpgroups' wgmma accumulators, its tiles
arriving by TMA. In Triton 3.6 that layout (BV = V = 128, 8 warps) spills; written out in Gluon it does
not (benchmarks/NOTES.md, stop 34). Since stop 35 it forms the output's scores from its own q and k tiles,
and a forward for a backward runs it too, writing the chunk-start states and V_new beside the output
(:func:`gluon_training`). Since stop 41 the backward's chunk stage has a Gluon kernel as well
(stages/backward_chunk_gluon.py.j2, :func:`chunk_bwd_usable`): a tile kernel whose TMA descriptors are built
on the host (:func:`row_descriptor`), since on the device each of its many short programs paid for its own.
Since stop 42 it sums each head group of grouped value heads itself, and the backward's wy stage is such a
kernel too (stages/backward_wy_gluon.py.j2, :func:`wy_bwd_usable`). The forward (stop 48) and the reverse
(stop 49) state passes run split by warp specialisation: two chain warpgroups over half the value rows each,
a third forming what both take from the chunk's [BT, BT] tiles.

On a Triton without Gluon (or without its Hopper module) the names below are None and
:func:`state_pass_usable` answers False, so the Triton pass serves every call.
"""
from __future__ import annotations

from typing import Optional

import torch

from gdngen.runtime.tma import memoised_row_descriptor
from gdngen.runtime.tiles import _OVERRIDES

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    AVAILABLE = True
except ImportError:                 # a Triton without Gluon's Hopper module
    import triton.language as gl    # for the kernels' constexpr annotations only: nothing is compiled
    gluon = async_copy = fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = None
    TensorDescriptor = None
    AVAILABLE = False

if AVAILABLE:
    from triton._C.libtriton import ir as _ir
    from triton.experimental.gluon.language._core import builtin as _builtin

    @_builtin
    def tma_add(tensor_desc, coord, src, _semantic=None):
        """The shared tile ``src`` added into the global block at ``coord`` by TMA (cp.reduce.async.bulk.tensor,
        add; 16-bit floats round once per add in L2), retired by ``tma.store_wait`` as a store is. Triton 3.9's
        Gluon has it as ``tma.async_atomic_add``; 3.6's builder has the op but no Python name for it."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)
else:
    tma_add = None


def gl_dtype(dtype: torch.dtype):
    """The Gluon dtype of a 16-bit torch dtype, for a kernel's dtype constexpr (the fused pass's scores)."""
    if dtype == torch.float16:
        return gl.float16
    if dtype == torch.bfloat16:
        return gl.bfloat16
    raise TypeError(f"score_dtype: float16 or bfloat16, not {dtype}")


def jit(fn):
    """``gluon.jit`` where Gluon exists; else the plain function (never launched: see :func:`state_pass_usable`)."""
    return gluon.jit(fn) if AVAILABLE else fn


# The Gluon pass's shapes: K = V = 128 (two warpgroups of 64 value rows, 128-byte swizzled tiles),
# 64-token chunks, whole chunks only (its TMA tiles are not masked).
STATE_PASS_K = STATE_PASS_V = 128
STATE_PASS_BT = 64

_HOPPER: dict = {}                  # CUDA device index -> compute capability 9.x (wgmma), read once


def _is_hopper(x: torch.Tensor) -> bool:
    index = x.get_device()
    hopper = _HOPPER.get(index)
    if hopper is None:
        hopper = _HOPPER[index] = torch.cuda.get_device_capability(index)[0] == 9
    return hopper


def state_pass_unusable(spec_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, K: int, V: int,
                        BT: int, T: int) -> Optional[str]:
    """Why a fused forward state pass over these dense inputs cannot run the Gluon kernel, or None.

    It needs Gluon, a CUDA tensor on a Hopper GPU (wgmma is sm_90's; the CPU interpreter does not run
    Gluon), 16-bit inputs of one dtype, K = V = 128, 64-token chunks, T a multiple of the chunk and
    16-byte aligned rows (TMA). ``override(spec, "gluon_state", value=False)`` keeps the Triton pass
    (tests compare the two); ``value=True`` does not force it past these conditions."""
    forced = _OVERRIDES.get((spec_name, "gluon_state"))
    if forced is not None and not forced["value"]:
        return "turned off (override)"
    if not AVAILABLE:
        return "this Triton has no Gluon Hopper module"
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"inputs {q.dtype}, {k.dtype}, {v.dtype}: one 16-bit dtype only"
    if K != STATE_PASS_K or V != STATE_PASS_V:
        return f"K={K}, V={V}: {STATE_PASS_K} and {STATE_PASS_V} only"
    if BT != STATE_PASS_BT or T % BT:
        return f"chunk {BT}, T={T}: whole {STATE_PASS_BT}-token chunks only"
    if any(t.data_ptr() % 16 for t in (q, k, v)):
        return "a base pointer not 16-byte aligned (TMA)"
    return _device_unusable(q)


# The Triton versions whose Gluon API the kernels are written against: 3.6 (the H200 image's). Triton 3.9 renamed
# tma.async_copy_global_to_shared / async_copy_shared_to_global and async_copy.async_copy_global_to_shared to
# async_load / async_store and left the old names as stubs that raise when a kernel compiles.
GLUON_TRITON = frozenset({(3, 6)})


def gluon_api_unusable(version: Optional[tuple] = None) -> Optional[str]:
    """Why this Triton (or ``version``, (major, minor)) cannot compile the generated Gluon kernels, or None."""
    if version is None:
        from gdngen.runtime.launch import triton_version
        version = triton_version()
    if tuple(version) not in GLUON_TRITON:
        return (f"Triton {version[0]}.{version[1]}: the Gluon kernels are written for the Gluon API of Triton "
                + ", ".join(f"{a}.{b}" for a, b in sorted(GLUON_TRITON)))
    return None


def _device_unusable(x: torch.Tensor) -> Optional[str]:
    """Why ``x``'s device (and this Triton) cannot run the Gluon kernels, or None (gdngen.runtime.gluon_emulator's
    copy of this module answers None: its kernels run on the CPU)."""
    if not x.is_cuda:
        return f"tensors on {x.device}: a Hopper GPU only"
    if not _is_hopper(x):
        return "not a Hopper GPU (wgmma)"
    return gluon_api_unusable()


def gluon_training(spec_name: str) -> bool:
    """Whether a forward that keeps states for a backward runs the Gluon pass (where it is usable) to
    write the output beside the chunk-start states and V_new, instead of the Triton state pass and the
    output stage. ``override(spec, "gluon_training", value=False)`` keeps the Triton stages (tests compare
    the two)."""
    forced = _OVERRIDES.get((spec_name, "gluon_training"))
    return True if forced is None else bool(forced["value"])


def dense_pieces_enabled(spec_name: str) -> bool:
    """Whether the forward's Gluon pass runs dense sequences of whole chunks as one piece each (the kernel's
    IS_VARLEN build, the final state stored) where it stores states for a backward or a final state. Compiled
    dense, those calls' chain halves reload 3 + 1 values a chunk from local memory in a training forward and
    1 in a forward with its final state (offline sm_90a, Triton 3.6: benchmarks/NOTES.md, stop 62); the
    pieces build reloads none. On the H200 (stop 63) the training pass read 500.8 -> 494.4 us at
    (4,8192,16,32) and 142.5 -> 141.8 at (8,2048,16,16), every gradient bit for bit the same.
    ``override(spec, "gluon_dense_pieces", value=False)`` compiles dense sequences dense (tests compare the two)."""
    forced = _OVERRIDES.get((spec_name, "gluon_dense_pieces"))
    return True if forced is None else bool(forced["value"])


def state_pass_usable(spec_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, K: int, V: int,
                      BT: int, T: int) -> bool:
    """Whether a fused forward state pass over these dense inputs runs the Gluon kernel (see
    :func:`state_pass_unusable`)."""
    return state_pass_unusable(spec_name, q, k, v, K=K, V=V, BT=BT, T=T) is None


def state_bwd_usable(spec_name: str, q: torch.Tensor, k: torch.Tensor, do: torch.Tensor, *, K: int, V: int,
                     BT: int, T: int) -> bool:
    """Whether the backward's reverse state pass runs the Gluon kernel (stages/backward_state_gluon.py.j2)
    over these dense inputs: under :func:`state_pass_unusable`'s conditions (``do`` in the values' place).
    ``override(spec, "gluon_state_bwd", value=False)`` keeps the Triton pass (tests compare the two);
    stop 36 measured the Gluon pass at 580 us against the Triton pass's 838 at (1, 32768, 32, 32)."""
    forced = _OVERRIDES.get((spec_name, "gluon_state_bwd"))
    if forced is not None and not forced["value"]:
        return False
    return state_pass_unusable(spec_name, q, k, do, K=K, V=V, BT=BT, T=T) is None


def w_from_t_enabled(spec_name: str) -> bool:
    """Whether the Gluon reverse pass (and the Triton walk before it, in pieces) forms W = T diag(beta
    key_w_decay) K from the forward's 16-bit T itself, so the backward's wy_prep launch does not run: the
    pass reads T (8 KB per chunk and head) instead of W (16 KB) and takes dvals^T W as (dvals^T (T diag(beta
    key_w_decay))) K, one more product on its chain. On by default: stop 37 measured fwd+bwd 4.40 -> 4.28 ms
    at (4, 8192, 16, 32) and 4.76 -> 4.57 at (1, 32768, 32, 32) (the pass 425 -> 483 us, wy_prep's 183 gone).
    ``override(spec, "gluon_w_from_t", value=False)`` keeps wy_prep's W (tests compare the two)."""
    forced = _OVERRIDES.get((spec_name, "gluon_w_from_t"))
    return True if forced is None else bool(forced["value"])


def one_chain_bwd_enabled(spec_name: str) -> bool:
    """Whether the Gluon reverse pass runs with one chain warpgroup holding the whole state gradient
    (stages/backward_reverse_gluon.py.j2: the partitioning of FlashQLA's fused backward, docs/fused_backward.md
    step 2a) instead of two value halves. Where it runs: the pass's default form (the intra part and W's product
    formed in it). Off by default until the H200 measures it: ``override(spec, "gluon_one_chain_bwd",
    value=True)`` turns it on (tests compare the two)."""
    forced = _OVERRIDES.get((spec_name, "gluon_one_chain_bwd"))
    return False if forced is None else bool(forced["value"])


def reverse_wy_enabled(spec_name: str) -> bool:
    """Whether the one-chain reverse pass (:func:`one_chain_bwd_enabled`) forms the backward's wy stage products
    too, a chunk behind its chain (docs/fused_backward.md step 2b), so that dV_new never reaches memory and the wy
    stage does not run; where the Gluon wy stage could run (:func:`wy_bwd_usable`). Off by default until the H200
    measures it: ``override(spec, "gluon_reverse_wy", value=True)`` turns it on (tests compare the two)."""
    forced = _OVERRIDES.get((spec_name, "gluon_reverse_wy"))
    return False if forced is None else bool(forced["value"])


def fused_bwd_enabled(spec_name: str) -> bool:
    """Whether the backward runs as one fused Gluon kernel (stages/backward_fused_gluon.py.j2: the reverse pass,
    the wy stage and the chunk stage in FlashQLA's lockstep manner, docs/fused_backward.md section 11) where it
    can: the Gluon reverse pass's conditions with the forward's 16-bit T, h and V_new (pieces of a long sequence
    each walk first, as in the reverse pass). On by default since measured on the H200 (stop 67), in device us
    against the three kernels it replaces: 393.5 / 445.3 at (8,2048,16,16), 1644.0 / 1803.9 at (1,32768,32,32),
    and with grouped value heads, whose dq and dk it then wrote per value head for a sum kernel after, 1462.9 +
    185.8 / 1697.0 at (4,8192,16,32) (since stop 68 it adds a group's itself: :func:`fused_group_add`).
    ``override(spec, "gluon_fused_bwd", value=False)`` keeps the three kernels (tests compare the two)."""
    forced = _OVERRIDES.get((spec_name, "gluon_fused_bwd"))
    return True if forced is None else bool(forced["value"])


def fused_bwd_takes(spec_name: str, k: torch.Tensor, states, tmat, values) -> bool:
    """Whether the fused backward (:func:`fused_bwd_enabled`) takes a call whose reverse pass runs in Gluon
    (:func:`state_bwd_usable`) and whose forward kept these (None: not kept): its chunk-start ``states`` in
    k's dtype, its 16-bit T (``tmat``, W formed from it: :func:`w_from_t_enabled`) and its 16-bit V_new
    (``values``). The driver decides by it, and so does the choice of time segments (a fused backward keeps no
    state gradients or W in memory, so one long sequence needs no segments: gdngen.runtime.segments)."""
    sixteen = (torch.bfloat16, torch.float16)
    return (states is not None and tmat is not None and values is not None and states.dtype == k.dtype
            and tmat.dtype in sixteen and values.dtype in sixteen and w_from_t_enabled(spec_name)
            and fused_bwd_enabled(spec_name))


def fused_colsum_state(spec_name: str) -> bool:
    """Whether the fused backward's S consumer forms d(cumsum g)'s column sum, colsum(diag(beta) M) with
    M = G * KK^T, in its idle step 1 from N = diag(beta) M, which the A consumer leaves in two bfloat16 halves in
    its step 6, and writes it to a dg slot of its own; instead of the A consumer summing M's columns across its
    warps in the next chunk's step 1 (~1,500-1,900 cycles of that step at (1,32768,32,32), stops 69-72). Its
    first form lost on an H100 (stop 73: 1305.4 -> 1337.1 us at (1,32768,32,32)), where S's global store sat
    before its arrival's fence and A's N stores in step 5; this form, with both moved, is off until measured:
    ``override(spec, "gluon_fused_colsum_state", value=True)``."""
    forced = _OVERRIDES.get((spec_name, "gluon_fused_colsum_state"))
    return False if forced is None else bool(forced["value"])


def fused_group_add(spec_name: str, group: int) -> bool:
    """Whether the fused backward adds the dq and dk tiles of a head group's ``group`` value heads into one
    [B, T, H, K] output itself (TMA reduce-add into zeros: gdngen.runtime.gluon.tma_add), instead of writing them
    per value head for ``gdngen.runtime.head_groups.sum_head_groups`` to read back: at (4,8192,16,32) 537 MB
    written and read again, and the sum kernel (265 us on the H100), for two 134 MB memsets (83 us) and the adds'
    read-modify-writes (+19 us in the kernel; stop 68, benchmarks/NOTES.md). By default for
    groups of two only: 0 + a, then a + b, is the sum kernel's result (two 16-bit values added, rounded once) in
    either order, so deterministic; with more, the adds' order varies between runs and each rounds to 16 bits.
    ``override(spec, "gluon_fused_group_add", value=...)`` decides for every group size."""
    forced = _OVERRIDES.get((spec_name, "gluon_fused_group_add"))
    return group == 2 if forced is None else bool(forced["value"])


def fused_t_usable(spec_name: str, k_dtype: torch.dtype, t_dtype: torch.dtype) -> bool:
    """Whether the forward's Gluon pass forms each chunk's T = (I + A)^-1 itself (stages/state_gluon.py.j2,
    FUSED_T: its scores partition takes K K^T from the key tile it loads anyway and solves on tensor cores), so
    that the wy stage and its read of k go, and in a forward that keeps no states T's round trip through memory
    too (a forward for a backward sends T on for it; in pieces, their walk is a Gluon launch of the pass's walk
    alone, as the Triton walk would read T). Only where the wy stage would solve in "fp16" (T in float16:
    gdngen.runtime.launch.solve_precision); a chunk past that precision's range (an |A_ij| over 1), which the wy
    stage solves in tf32, has its operands scaled into float16's range instead. Off by default, since measured it loses
    (stop 60, H100: the pass 353 -> 802 us at (4,8192,16,32) against the wy stage's 121 it saves, because the chains'
    176 registers that the solve's partition leaves them slow the pass 1.7-2.1x on their own):
    ``override(spec, "gluon_fused_t", value=True)``."""
    forced = _OVERRIDES.get((spec_name, "gluon_fused_t"))
    if forced is None or not forced["value"]:
        return False
    from gdngen.runtime.launch import solve_precision
    return solve_precision(k_dtype, t_dtype) == "fp16"


# Compact T (a forward that keeps no states): T = (I + A)^-1 is lower triangular, so of its [BT, BT] tile the
# blocks above the diagonal are zeros that the wy stage wrote and the Gluon pass read back (3 of 8 KB a chunk and
# value head at BT = 64). Stored compact, block row i of 16 rows keeps its 16 (i + 1) columns only, in region i of
# one buffer: a contiguous [chunks * HV * 16, 16 (i + 1)] matrix, rows (chunk * HV + value head) * 16 + r. The
# pass loads each block row as a [16, BT] TMA box from its region: the columns past 16 (i + 1) lie outside the
# region's rows, and TMA fills them with zeros.
COMPACT_T_ROWS = 16


def compact_t_enabled(spec_name: str) -> bool:
    """Whether a forward whose Gluon pass keeps no states (no grad) takes the wy stage's T compact (see
    :func:`compact_t_regions`). On by default; ``override(spec, "compact_t", value=False)`` keeps the whole
    [B, T, HV, BT] tiles (tests compare the two: every output bit for bit)."""
    forced = _OVERRIDES.get((spec_name, "compact_t"))
    return True if forced is None else bool(forced["value"])


def compact_t_size(chunks: int, HV: int, BT: int) -> int:
    """Elements of a compact T buffer for ``chunks`` whole chunks of ``HV`` value heads."""
    blocks = BT // COMPACT_T_ROWS
    return chunks * HV * COMPACT_T_ROWS * COMPACT_T_ROWS * blocks * (blocks + 1) // 2


def compact_t_regions(buffer: torch.Tensor, chunks: int, HV: int, BT: int) -> list:
    """The block-row regions of a compact T buffer: region i a [chunks * HV * 16, 16 (i + 1)] view, row
    (chunk * HV + value head) * 16 + r holding row 16 i + r of that chunk's T, its columns 0 .. 16 (i + 1)."""
    unit = chunks * HV * COMPACT_T_ROWS * COMPACT_T_ROWS
    regions, offset = [], 0
    for i in range(BT // COMPACT_T_ROWS):
        width = COMPACT_T_ROWS * (i + 1)
        regions.append(buffer[offset:offset + unit * (i + 1)].view(chunks * HV * COMPACT_T_ROWS, width))
        offset += unit * (i + 1)
    return regions


def expand_compact_t(buffer: torch.Tensor, B: int, T: int, HV: int, BT: int) -> torch.Tensor:
    """The [B, T, HV, BT] tiles a compact T buffer holds (zeros above the block diagonal), for tests."""
    chunks = B * T // BT
    full = torch.zeros(chunks, BT, HV, BT, dtype=buffer.dtype, device=buffer.device)
    for i, region in enumerate(compact_t_regions(buffer, chunks, HV, BT)):
        rows = region.view(chunks, HV, COMPACT_T_ROWS, -1).permute(0, 2, 1, 3)
        full[:, COMPACT_T_ROWS * i:COMPACT_T_ROWS * (i + 1), :, :rows.shape[-1]] = rows
    return full.view(B, T, HV, BT)


def compact_t_descriptors(buffer: torch.Tensor, chunks: int, HV: int, BT: int) -> list:
    """One TMA descriptor per block-row region of a compact T buffer, in [16, BT] boxes (zero-filled past the
    region's columns)."""
    return [row_descriptor(region, region.shape[1], [COMPACT_T_ROWS, BT])
            for region in compact_t_regions(buffer, chunks, HV, BT)]


def chunk_bwd_unusable(spec_name: str, q: torch.Tensor, k: torch.Tensor, do: torch.Tensor, values: torch.Tensor,
                       h: torch.Tensor, *, K: int, V: int, BT: int, T: int) -> Optional[str]:
    """Why the backward's chunk stage over these dense inputs cannot run the Gluon kernel
    (stages/backward_chunk_gluon.py.j2), or None: :func:`state_pass_unusable`'s conditions (``do`` in the
    values' place), V_new in a 16-bit dtype and the chunk-start states in k's (its products take them as
    they are). ``override(spec, "gluon_chunk_bwd", value=False)`` keeps the Triton stage (tests compare the
    two)."""
    forced = _OVERRIDES.get((spec_name, "gluon_chunk_bwd"))
    if forced is not None and not forced["value"]:
        return "turned off (override)"
    if values.dtype not in (torch.bfloat16, torch.float16):
        return f"V_new in {values.dtype}: a 16-bit dtype only"
    if h.dtype != k.dtype:
        return f"chunk states in {h.dtype}: k's dtype ({k.dtype}) only"
    why = state_pass_unusable(spec_name, q, k, do, K=K, V=V, BT=BT, T=T)
    if why is not None:
        return why
    if values.data_ptr() % 16 or h.data_ptr() % 16:
        return "a base pointer not 16-byte aligned (TMA)"
    return None


def chunk_bwd_usable(spec_name: str, q: torch.Tensor, k: torch.Tensor, do: torch.Tensor, values: torch.Tensor,
                     h: torch.Tensor, *, K: int, V: int, BT: int, T: int) -> bool:
    """Whether the backward's chunk stage runs the Gluon kernel (see :func:`chunk_bwd_unusable`)."""
    return chunk_bwd_unusable(spec_name, q, k, do, values, h, K=K, V=V, BT=BT, T=T) is None


def wy_bwd_unusable(spec_name: str, k: torch.Tensor, v: torch.Tensor, dvals: torch.Tensor, tmat: torch.Tensor,
                    h: torch.Tensor, *, K: int, V: int, BT: int, T: int) -> Optional[str]:
    """Why the backward's wy stage over these dense inputs cannot run the Gluon kernel
    (stages/backward_wy_gluon.py.j2), or None: :func:`state_pass_unusable`'s conditions (k in q's place),
    dV_new and the chunk-start states in k's dtype and T kept in a 16-bit dtype (the forward's T: wgmma
    operands as they are). ``override(spec, "gluon_wy_bwd", value=False)`` keeps the Triton stage (tests
    compare the two)."""
    forced = _OVERRIDES.get((spec_name, "gluon_wy_bwd"))
    if forced is not None and not forced["value"]:
        return "turned off (override)"
    if dvals.dtype != k.dtype:
        return f"dV_new in {dvals.dtype}: k's dtype ({k.dtype}) only"
    if h.dtype != k.dtype:
        return f"chunk states in {h.dtype}: k's dtype ({k.dtype}) only"
    if tmat.dtype not in (torch.bfloat16, torch.float16):
        return f"T kept in {tmat.dtype}: a 16-bit dtype only"
    why = state_pass_unusable(spec_name, k, k, v, K=K, V=V, BT=BT, T=T)
    if why is not None:
        return why
    if any(t.data_ptr() % 16 for t in (dvals, tmat, h)):
        return "a base pointer not 16-byte aligned (TMA)"
    return None


def wy_bwd_usable(spec_name: str, k: torch.Tensor, v: torch.Tensor, dvals: torch.Tensor, tmat: torch.Tensor,
                  h: torch.Tensor, *, K: int, V: int, BT: int, T: int) -> bool:
    """Whether the backward's wy stage runs the Gluon kernel (see :func:`wy_bwd_unusable`)."""
    return wy_bwd_unusable(spec_name, k, v, dvals, tmat, h, K=K, V=V, BT=BT, T=T) is None


_ROW_TILE = None                    # the 128-byte swizzled 16-bit tile layout of the host-built descriptors


def _gluon_descriptor(x: torch.Tensor, columns: int, block: list):
    global _ROW_TILE
    if _ROW_TILE is None:
        _ROW_TILE = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    return TensorDescriptor(x, [x.numel() // columns, columns], [columns, 1], list(block), _ROW_TILE)


def row_descriptor(x: torch.Tensor, columns: int, block: list):
    """A host-built Gluon TMA descriptor over contiguous ``x`` seen as rows of ``columns`` elements ([numel /
    columns, columns]), in ``block`` tiles of the 128-byte swizzled 16-bit layout the Gluon kernels use;
    memoised per view shape (gdngen.runtime.tma.memoised_row_descriptor)."""
    return memoised_row_descriptor(x, columns, block, _gluon_descriptor)
