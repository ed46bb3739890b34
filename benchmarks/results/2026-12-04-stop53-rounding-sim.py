"""Float64 simulation of the Gluon pass's roundings: X.T form (now) against U - W S (FLA's form)."""
import torch, math, sys
torch.manual_seed(0)
B, T, H, K, V, BT = 1, 4096, 4, 128, 128, 64
d = torch.float64
def r(x, dt): return x.to(dt).to(d)
bf, hf = torch.bfloat16, torch.float16
q = r(torch.randn(T, H, K, dtype=d), bf); k = torch.randn(T, H, K, dtype=d); k = r(k / k.norm(dim=-1, keepdim=True), bf)
v = r(torch.randn(T, H, V, dtype=d), bf)
g = torch.nn.functional.logsigmoid(torch.randn(T, H, dtype=d) + 2.0).float().double()
beta = torch.sigmoid(torch.randn(T, H, dtype=d)).float().double()
scale = K ** -0.5
def run(mode):
    outs = []
    for h in range(H):
        S = torch.zeros(K, V, dtype=d)
        o = torch.empty(T, V, dtype=d)
        for c in range(T // BT):
            sl = slice(c * BT, (c + 1) * BT)
            kc, qc, vc, bc = k[sl, h], q[sl, h], v[sl, h], beta[sl, h]
            gc = torch.cumsum(g[sl, h], 0)
            A = torch.tril((bc[:, None] * (kc @ kc.T)) * torch.exp(gc[:, None] - gc[None, :]), -1)
            Tm = torch.linalg.inv(torch.eye(BT, dtype=d) + A)
            if mode == "exact":
                Sr = S; Tq = Tm
                X = bc[:, None] * vc - (bc * torch.exp(gc))[:, None] * (kc @ Sr)
                vn = Tq @ X
                vn_o = vn; vn_u = vn; Aqk = torch.tril(qc @ kc.T * torch.exp(gc[:, None] - gc[None, :]))
                Sq = S
            else:
                Tq = r(Tm, hf)
                Sr = r(S, bf)
                if mode == "xt":
                    X = r(bc[:, None] * vc - (bc * torch.exp(gc))[:, None] * (kc @ Sr), hf)
                    vn = Tq @ X
                else:
                    tdt = bf if mode in ("wu_bf", "wu_mix") else hf
                    W = r(r(Tm * (bc * torch.exp(gc))[None, :], bf) @ kc, bf)      # W = T diag(b e^g) K, bf16 operands
                    U = r(r(Tm * bc[None, :], tdt) @ vc, bf if mode == "wu_bf" else hf)
                    vn = U - W @ Sr
                vn_o = r(vn, hf); vn_u = r(vn, bf)
                Aqk = r(torch.tril(qc @ kc.T * torch.exp(gc[:, None] - gc[None, :])), hf)
                Sq = Sr
            o[sl] = ((qc @ Sq) * torch.exp(gc)[:, None] + Aqk @ vn_o) * scale
            du = torch.exp(gc[-1] - gc)
            S = S * math.exp(gc[-1]) + kc.T @ ((vn_u if mode != "exact" else vn) * du[:, None])
        outs.append(o)
    return torch.stack(outs, 1)
ref = run("exact")
for mode in ("xt", "wu_hf", "wu_mix", "wu_bf"):
    o = r(run(mode), bf)
    print(mode, f"{((o - ref).norm() / ref.norm()).item():.3e}", flush=True)
print("floor", f"{((r(ref, bf) - ref).norm() / ref.norm()).item():.3e}")
