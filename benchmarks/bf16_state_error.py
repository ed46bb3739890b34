"""Error of a bf16 state pool against float32 and float64, decoding token by token (CPU, interpreter).

Decodes T = 1024 tokens one at a time through ``gdngen.serving.decode_step`` with the generated
``fused_recurrent_gated_delta_rule``, once with a float32 pool and once with a bf16 pool, from the
same random initial state, and compares the state and the outputs after 1, 64 and 1024 tokens with
the float64 token recurrence (``gdngen.reference``). Two gate regimes: typical decay
(g = logsigmoid(randn + 2), a memory of a few tokens) and long memory (g = logsigmoid(randn + 6),
about 400 tokens), where rounding errors live longest.

Triton's interpreter converts float32 to bf16 by truncation (round toward zero), while compiled
kernels round to nearest even, so the kernel's bf16 numbers here are an upper bound for the GPU.
The GPU's rounding is reproduced by ``emulate_bf16_pool``: the kernel's float32 arithmetic in torch,
the state rounded to bf16 by torch (nearest even) after every token.

    TRITON_INTERPRET=1 python benchmarks/bf16_state_error.py      # about 4 minutes on 2 cores

Prints a markdown table (the README's serving section quotes it); BF16_ERROR_TOKENS=64 for a quick run.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gdngen import reference  # noqa: E402
from gdngen.selfcheck import rel_rmse  # noqa: E402
from gdngen.serving import StatePool, decode_step  # noqa: E402
from gdngen.spec import load_spec  # noqa: E402
from generated.gated_delta_rule import fused_recurrent_gated_delta_rule as gdn  # noqa: E402

N, H, HV, K, V = 2, 1, 2, 128, 128
T = int(os.environ.get("BF16_ERROR_TOKENS", 1024))
CHECKPOINTS = tuple(t for t in (1, 64, 1024) if t <= T)


def inputs(shift: float, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    return {
        "q": randn(N, T, H, K),
        "k": F.normalize(randn(N, T, H, K), dim=-1),
        "v": randn(N, T, HV, V),
        "g": F.logsigmoid(randn(N, T, HV) + shift),
        "beta": torch.sigmoid(randn(N, T, HV)),
        "h0": randn(N, HV, K, V) * 0.5,
    }


def decode(x: dict, dtype: torch.dtype) -> tuple[dict, torch.Tensor]:
    pool = StatePool(N, HV, K, V, dtype=dtype)
    slots = pool.allocate_many(N, x["h0"].float())
    index = pool.indices(slots)
    states, outs = {}, []
    for t in range(T):
        step = {n: x[n][:, t:t + 1].float() for n in ("q", "k", "v", "g", "beta")}
        outs.append(decode_step(gdn, pool, index, **step))
        if t + 1 in CHECKPOINTS:
            states[t + 1] = pool.states[slots].double().clone()
    return states, torch.cat(outs, 1).double()


def emulate_bf16_pool(x: dict) -> tuple[dict, torch.Tensor]:
    """The kernel's per-token arithmetic in float32 torch, the state rounded to nearest-even bf16 after each token."""
    h = x["h0"].to(torch.bfloat16)                                  # [N, HV, K, V]
    rep = HV // H
    states, outs = {}, []
    for t in range(T):
        q = x["q"][:, t].float().repeat_interleave(rep, 1) * K ** -0.5    # [N, HV, K]
        k = x["k"][:, t].float().repeat_interleave(rep, 1)
        v, d, beta = x["v"][:, t].float(), x["g"][:, t].float().exp(), x["beta"][:, t].float()
        hf = h.float()
        qh = (hf * (q * d[..., None])[..., None]).sum(-2)           # q^T D S   [N, HV, V]
        kh = (hf * (k * d[..., None])[..., None]).sum(-2)           # k^T D S
        v_new = beta[..., None] * (v - kh)
        outs.append(qh + (q * k).sum(-1, keepdim=True) * v_new)
        h = (hf * d[..., None, None] + k[..., None] * v_new[..., None, :]).to(torch.bfloat16)
        if t + 1 in CHECKPOINTS:
            states[t + 1] = h.double()
    return states, torch.stack(outs, 1).double()


def main() -> None:
    spec = load_spec("specs/gated_delta_rule.yaml")
    rows = []
    for label, shift in (("typical decay, g = logsigmoid(randn + 2)", 2.0), ("long memory, g = logsigmoid(randn + 6)", 6.0)):
        x = inputs(shift)
        o_ref, _ = reference.run(spec, x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
                                 output_final_state=False)
        h_ref = {}
        for t in CHECKPOINTS:
            _, h_ref[t] = reference.run(spec, *(x[n][:, :t] for n in ("q", "k", "v", "g", "beta")),
                                        initial_state=x["h0"], output_final_state=True)
        results = {"fp32": decode(x, torch.float32), "bf16_interp": decode(x, torch.bfloat16),
                   "bf16_rne": emulate_bf16_pool(x)}
        for t in CHECKPOINTS:
            row = {"gates": label, "tokens": t}
            for name, (states, o) in results.items():
                row[f"{name}_state"] = rel_rmse(states[t], h_ref[t])
                row[f"{name}_o"] = rel_rmse(o[:, t - 1], o_ref[:, t - 1])
            rows.append(row)
            print(row, flush=True)
    print("\nRelative RMSE against the float64 recurrence (state after the token; that token's output):")
    print("| gates | tokens | bf16 pool, nearest-even (GPU): state / o | bf16 pool, truncating (interpreter): "
          "state / o | fp32 pool: state / o |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['gates']} | {r['tokens']} | {r['bf16_rne_state']:.2e} / {r['bf16_rne_o']:.2e} | "
              f"{r['bf16_interp_state']:.2e} / {r['bf16_interp_o']:.2e} | {r['fp32_state']:.2e} / {r['fp32_o']:.2e} |")


if __name__ == "__main__":
    main()
