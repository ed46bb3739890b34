"""GatedDeltaNet: a token-mixing layer on the generated gated-delta-rule kernels.

    x -> [q | k | v | z] = qkvz_proj(x),  [a | b] = ab_proj(x)
      -> q, k, v = silu(causal depthwise conv(q | k | v))                     (one Triton kernel)
      -> o = GDN(l2norm(q), l2norm(k), v, g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b))
                                                          (gate, beta and L2 norm fused in the op)
      -> o = rmsnorm(o) * norm_weight * silu(z)                                (one Triton kernel)
      -> o_proj(o)

Heads as in Qwen3-Next: ``num_heads`` query/key heads of ``head_dim``, ``num_v_heads`` value
heads (a multiple, grouped value attention) of ``head_v_dim``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from gdngen import reference
from gdngen.layers.cache import GatedDeltaNetCache, LayerState
from gdngen.layers.gated_norm import gated_rms_norm, gated_rms_norm_reference
from gdngen.layers.short_conv import short_conv, short_conv_reference

MODES = ("auto", "chunk", "fused_recurrent")
KERNELS = ("gdngen", "reference")


def _gdn():
    """The generated module, imported on first use (importing it pulls in triton)."""
    from generated import gated_delta_rule
    return gated_delta_rule


def gated_delta_rule_reference(q, k, v, g, beta, *, form="chunked", **options):
    """The float64 reference with the generated op's keywords (differentiable): (o in v's dtype, final state)."""
    options.pop("chunk_size", None)
    o, final_state = reference.run(_gdn().SPEC, q, k, v, g, beta, form=form, **options)
    return o.to(v.dtype), final_state


class _GateGrad:
    """The gradient buffer ``[B, T, value_dim + 2 HV]`` of the second projection product (z | a | b),
    allocated by the gated norm's backward, which writes dz into its first columns in place."""

    def __init__(self, shape, dtype, device, value_dim: int, heads: int) -> None:
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self.value_dim, self.heads = value_dim, heads
        self.buf: Optional[torch.Tensor] = None

    def get(self) -> torch.Tensor:
        if self.buf is None:
            self.buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        return self.buf

    def gate(self) -> torch.Tensor:
        """dz's place: ``[B, T, HV, V]``, rows strided by the buffer's width."""
        B, T, _ = self.shape
        return self.get().narrow(-1, 0, self.value_dim).view(B, T, self.heads, -1)


class _Projection(torch.autograd.Function):
    """The training projections as two products of x: ``x W_qkv^T`` (the conv input, ``[B, T, conv_dim]``)
    and ``x [W_z; W_ab]^T`` (z | a | b).  Two buffers rather than one ``[B, T, N]``: the second is dead
    once the gated norm's backward has read z, before the GDN op's backward (the layer's memory peak),
    and the conv's input gradient is a buffer of its own, so no gradient is concatenated or copied but
    a's and b's.  The backward sums the two input gradients with one accumulating product."""

    @staticmethod
    def forward(ctx, x, w_main, w_ab, conv_dim, widths, gate_grad):
        hidden = x.shape[-1]
        x2 = x.reshape(-1, hidden)
        p1 = x2 @ w_main[:conv_dim].t()
        p2 = x2 @ _rest_weight(w_main, w_ab, conv_dim).t()
        gate_grad.dtype = p2.dtype
        ctx.save_for_backward(x, w_main, w_ab)
        ctx.conv_dim, ctx.widths, ctx.gate_grad = conv_dim, widths, gate_grad
        ctx.set_materialize_grads(False)
        lead = x.shape[:-1]
        return (p1.view(*lead, conv_dim),) + tuple(p2.view(*lead, -1).split(list(widths), dim=-1))

    @staticmethod
    def in_place(g: torch.Tensor, target: torch.Tensor) -> bool:
        """Whether the gradient ``g`` already is ``target`` (written there by its kernel)."""
        return g.data_ptr() == target.data_ptr() and g.shape == target.shape and g.stride() == target.stride()

    @staticmethod
    def backward(ctx, d_conv, *d_rest):
        x, w_main, w_ab = ctx.saved_tensors
        conv_dim, hidden = ctx.conv_dim, x.shape[-1]
        x2 = x.reshape(-1, hidden)
        M = x2.shape[0]
        buf = ctx.gate_grad.get()
        ctx.gate_grad.buf = None                 # a second backward (retain_graph) starts a new buffer
        start = 0
        for width, g in zip(ctx.widths, d_rest):
            target = buf.narrow(-1, start, width)
            if g is None:
                target.zero_()
            elif not _Projection.in_place(g, target):
                target.copy_(g)
            start += width
        d2 = buf.view(M, -1)
        d1 = d_conv.reshape(M, conv_dim) if d_conv is not None else x2.new_zeros(M, conv_dim)
        w_rest = _rest_weight(w_main, w_ab, conv_dim)
        dx = dw_main = dw_ab = None
        if ctx.needs_input_grad[0]:
            dx = d1 @ w_main[:conv_dim]
            dx.addmm_(d2, w_rest)
            dx = dx.view(x.shape)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            dw = x2.new_empty(w_main.shape[0] + w_ab.shape[0], hidden)
            torch.mm(d1.t(), x2, out=dw[:conv_dim])
            torch.mm(d2.t(), x2, out=dw[conv_dim:])
            dw_main, dw_ab = dw[:w_main.shape[0]], dw[w_main.shape[0]:]
        return dx, dw_main, dw_ab, None, None, None


def _rest_weight(w_main, w_ab, conv_dim):
    """``[W_z; W_ab]``: the rows of the second product (a copy of 2 HV + value_dim rows of weights)."""
    return torch.cat([w_main[conv_dim:], w_ab], dim=0) if w_main.shape[0] > conv_dim else w_ab


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer (Qwen3-Next's linear-attention block) on gdngen kernels.

    Args:
        hidden_size: model width.
        num_heads: query/key heads ``H``.
        num_v_heads: value heads ``HV`` (a multiple of ``H``; default ``H``).
        head_dim: query/key head dim ``K``.
        expand_v: value head dim ``V = head_dim * expand_v`` (FLA's name).
        conv_size: short-convolution window ``W`` (<= 8).
        conv_bias: give the convolution a bias.
        use_gate: output gate ``z`` (gated RMSNorm); False: plain RMSNorm.
        allow_neg_eigval: ``beta = 2 sigmoid(b)``, eigenvalues of the transition in [-1, 1].
        norm_eps: epsilon of the output RMSNorm.
        mode: ``"chunk"`` (training, prefill), ``"fused_recurrent"`` (decode; forward only) or
            ``"auto"``: the recurrence when no gradient is needed and the input has at most
            ``recurrent_threshold`` tokens, the chunk op otherwise.
        chunk_size: chunk of the chunk op (16, 32 or 64).
        recurrent_threshold: longest input ``"auto"`` still runs token by token.
        layer_idx: this layer's key in a :class:`GatedDeltaNetCache` (needed with a cache).
        kernels: ``"gdngen"`` (Triton) or ``"reference"`` (plain torch + the float64 GDN reference,
            any dtype including float64, differentiable: the oracle the tests compare with).

    ``forward(hidden_states, attention_mask=None, cu_seqlens=None, cache=None)`` returns
    ``[B, T, hidden_size]``.  ``attention_mask`` ``[B, T_total]`` (1 = token, 0 = padding; its last
    ``T`` columns are used) unpads the batch into packed sequences, so padding never enters a state;
    ``cu_seqlens`` passes packed sequences directly (``B == 1``).  With a cache the layer starts from
    its stored states and stores the new ones.
    """

    def __init__(
        self,
        hidden_size: int = 2048,
        num_heads: int = 16,
        num_v_heads: Optional[int] = None,
        head_dim: int = 128,
        expand_v: float = 1.0,
        conv_size: int = 4,
        conv_bias: bool = False,
        use_gate: bool = True,
        allow_neg_eigval: bool = False,
        norm_eps: float = 1e-6,
        mode: str = "auto",
        chunk_size: int = 64,
        recurrent_threshold: int = 64,
        layer_idx: Optional[int] = None,
        kernels: str = "gdngen",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        for name, value in (("hidden_size", hidden_size), ("num_heads", num_heads), ("num_v_heads", num_v_heads),
                            ("head_dim", head_dim), ("conv_size", conv_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if num_v_heads % num_heads:
            raise ValueError(f"num_v_heads: must be a multiple of num_heads={num_heads}, got {num_v_heads}")
        head_v_dim = head_dim * expand_v
        if head_v_dim != int(head_v_dim) or head_v_dim < 1:
            raise ValueError(f"expand_v: head_dim * expand_v must be a positive integer, got {head_dim} * {expand_v}")
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {list(MODES)}, got {mode!r}")
        if kernels not in KERNELS:
            raise ValueError(f"kernels: expected one of {list(KERNELS)}, got {kernels!r}")
        factory = dict(device=device, dtype=dtype)
        self.hidden_size, self.num_heads, self.num_v_heads = hidden_size, num_heads, num_v_heads
        self.head_dim, self.head_v_dim = head_dim, int(head_v_dim)
        self.key_dim, self.value_dim = num_heads * head_dim, num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_size, self.use_gate, self.allow_neg_eigval = conv_size, use_gate, allow_neg_eigval
        self.norm_eps, self.mode, self.chunk_size = norm_eps, mode, chunk_size
        self.recurrent_threshold, self.layer_idx, self.kernels = recurrent_threshold, layer_idx, kernels

        # one matmul for q, k, v (and the output gate z); one for the decay input a and beta logits b
        self.qkvz_proj = nn.Linear(hidden_size, self.conv_dim + (self.value_dim if use_gate else 0), bias=False,
                                   **factory)
        self.ab_proj = nn.Linear(hidden_size, 2 * num_v_heads, bias=False, **factory)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, conv_size, **factory))
        self.conv_bias = nn.Parameter(torch.empty(self.conv_dim, **factory)) if conv_bias else None
        self.A_log = nn.Parameter(torch.empty(num_v_heads, **factory))
        self.dt_bias = nn.Parameter(torch.empty(num_v_heads, **factory))
        self.norm_weight = nn.Parameter(torch.empty(self.head_v_dim, **factory))
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False, **factory)
        self.A_log._no_weight_decay = True
        self.dt_bias._no_weight_decay = True
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Mamba-style gate init (A in [1, 16], dt in [1e-3, 0.1]); conv like nn.Conv1d; norm weight 1."""
        self.qkvz_proj.reset_parameters()
        self.ab_proj.reset_parameters()
        self.o_proj.reset_parameters()
        bound = 1.0 / math.sqrt(self.conv_size)
        self.conv_weight.uniform_(-bound, bound)
        if self.conv_bias is not None:
            self.conv_bias.uniform_(-bound, bound)
        self.A_log.copy_(torch.empty_like(self.A_log, dtype=torch.float32).uniform_(1, 16).log())
        dt = torch.exp(torch.rand_like(self.dt_bias, dtype=torch.float32) * (math.log(0.1) - math.log(1e-3))
                       + math.log(1e-3)).clamp(min=1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))        # softplus(dt_bias) = dt
        self.norm_weight.fill_(1.0)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_v_heads={self.num_v_heads}, "
                f"head_dim={self.head_dim}, head_v_dim={self.head_v_dim}, conv_size={self.conv_size}, "
                f"mode={self.mode!r}, kernels={self.kernels!r}, layer_idx={self.layer_idx}")

    # ---- forward -------------------------------------------------------------------------------

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        cu_seqlens: Optional[torch.Tensor] = None,
        cache: Optional[GatedDeltaNetCache] = None,
    ) -> torch.Tensor:
        x = hidden_states
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"hidden_states: expected [B, T, {self.hidden_size}], got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if cache is not None:
            if not isinstance(cache, GatedDeltaNetCache):
                raise TypeError(f"cache: expected a GatedDeltaNetCache, got {type(cache).__name__}")
            if self.layer_idx is None:
                raise ValueError("layer_idx: a layer used with a cache needs its layer_idx")
        B, T, _ = x.shape
        indices = None
        if attention_mask is not None:
            if cu_seqlens is not None:
                raise ValueError("attention_mask: pass either attention_mask (padded batch) or cu_seqlens (packed)")
            if attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] < T:
                raise ValueError(f"attention_mask: expected [B, T_total >= T] = [{B}, >= {T}], got "
                                 f"{tuple(attention_mask.shape)}")
            mask = attention_mask[:, attention_mask.shape[1] - T:].bool()
            if not bool(mask.all()):
                # unpad: the real tokens of each row become one packed sequence
                lengths = mask.sum(-1)
                cu_seqlens = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
                indices = mask.reshape(-1).nonzero().squeeze(-1)
                x = x.reshape(B * T, -1).index_select(0, indices)[None]
        state = cache.get(self.layer_idx) if cache is not None else None
        o, conv_state, recurrent_state = self._mix(x, cu_seqlens, state, output_final_state=cache is not None)
        if cache is not None:
            cache.update(self.layer_idx, conv_state, recurrent_state)
        if indices is not None:
            o = o.new_zeros(B * T, o.shape[-1]).index_put((indices,), o[0]).view(B, T, -1)
        return o

    def _use_recurrence(self, x: torch.Tensor) -> bool:
        if self.mode != "auto":
            return self.mode == "fused_recurrent"
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters()))
        # the token count of x bounds every sequence's length (packed or not)
        return not needs_grad and x.shape[1] <= self.recurrent_threshold

    def _mix(self, x, cu_seqlens, state: Optional[LayerState], output_final_state: bool):
        B, T, _ = x.shape
        H, HV, K, V = self.num_heads, self.num_v_heads, self.head_dim, self.head_v_dim
        widths = (self.conv_dim,) + ((self.value_dim,) if self.use_gate else ()) + (HV, HV)
        gate_grad = None
        if self.kernels == "gdngen" and torch.is_grad_enabled() and (
                x.requires_grad or self.qkvz_proj.weight.requires_grad or self.ab_proj.weight.requires_grad):
            # training: the conv input and z | a | b as two products (see _Projection); the
            # [hidden, 2 HV] product alone is far from the tensor cores' rate and its input gradient
            # would be one more [B, T, hidden] product plus an add
            gate_grad = _GateGrad((B, T, sum(widths[1:])), x.dtype, x.device, self.value_dim, HV)
            pieces = _Projection.apply(x, self.qkvz_proj.weight, self.ab_proj.weight, self.conv_dim, widths[1:],
                                       gate_grad)
        else:           # inference: two matmuls, no weight copy per call (decode reads each weight once)
            pieces = self.qkvz_proj(x).split(list(widths[:-2]), dim=-1) + self.ab_proj(x).split([HV, HV], dim=-1)
        conv_in, z = (pieces[0], pieces[1]) if self.use_gate else (pieces[0], None)
        a, b = pieces[-2], pieces[-1]
        conv_h0 = state.conv_state if state is not None else None
        rec_h0 = state.recurrent_state if state is not None else None
        conv_args = dict(activation="silu", cu_seqlens=cu_seqlens, initial_state=conv_h0,
                         output_final_state=output_final_state)
        gdn_args = dict(initial_state=rec_h0, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=self.A_log,
                        dt_bias=self.dt_bias, use_beta_sigmoid_in_kernel=True,
                        allow_neg_eigval=self.allow_neg_eigval)
        recurrence = self._use_recurrence(x)
        if self.kernels == "gdngen":
            (q, k, v), conv_state = short_conv(conv_in, self.conv_weight, self.conv_bias,
                                               splits=(self.key_dim, self.key_dim, self.value_dim), **conv_args)
            q, k, v = q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, HV, V)
            if recurrence:
                o, recurrent_state = _gdn().fused_recurrent_gated_delta_rule(q, k, v, a, b, **gdn_args)
            else:
                o, recurrent_state = _gdn().chunk_gated_delta_rule(q, k, v, a, b, chunk_size=self.chunk_size,
                                                                   **gdn_args)
            zv = z.view(B, T, HV, V) if z is not None else None
            # training: dz goes straight into the second projection product's gradient buffer
            o = gated_rms_norm(o, zv, self.norm_weight, self.norm_eps,
                               dgate_into=gate_grad.gate if gate_grad is not None and z is not None else None)
        else:
            qkv, conv_state = short_conv_reference(conv_in, self.conv_weight, self.conv_bias, **conv_args)
            q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
            q, k, v = q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, HV, V)
            o, recurrent_state = gated_delta_rule_reference(
                q, k, v, a, b, form="recurrent" if recurrence else "chunked", **gdn_args)
            zv = z.reshape(B, T, HV, V) if z is not None else None
            o = gated_rms_norm_reference(o, zv, self.norm_weight, self.norm_eps)
        o = self.o_proj(o.reshape(B, T, self.value_dim))
        return o, conv_state, recurrent_state
