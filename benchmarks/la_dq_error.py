"""linear_attn normalize=True bf16 gradient errors on the bf16-faithful CPU interpreter (issues #4, #7).

The GPU test's check (tests/test_backward_gpu.py::_check_grads: seed 3, do/dht seed 4, autograd
through the float64 chunked reference) at a smaller shape, with gdngen.bf16_emulation's patch, for
the identity and elu+1 feature maps. Prints rel. RMSE of dq, dk, dv, dh0 (and o).

    PYTHONPATH=$PWD TRITON_INTERPRET=1 python benchmarks/la_dq_error.py --shape 1,1024,2,4 --dims 64,64
"""
import argparse
import importlib

import torch

from gdngen import reference
from gdngen.selfcheck import make_inputs, rel_rmse
from gdngen.spec import load_spec


def grad_errors(options, *, B, T, H, HV, K, V, chunk_size=64, dtype=torch.bfloat16, device="cpu", seed=3):
    """{'o', 'q', 'k', 'v', 'initial_state'}: rel. RMSE against autograd through the float64 reference."""
    spec = load_spec("specs/linear_attn.yaml")
    module = importlib.import_module("generated.linear_attn")
    inputs = make_inputs(spec, dtype=dtype, device=device, seed=seed, B=B, T=T, H=H, HV=HV, K=K, V=V)
    leaves = {n: x.detach().clone().requires_grad_(True) for n, x in inputs.items()
              if isinstance(x, torch.Tensor) and x.is_floating_point()}
    o, ht = module.chunk_linear_attn(**{**inputs, **leaves}, output_final_state=True, chunk_size=chunk_size,
                                     **options)
    gen = torch.Generator(device=device).manual_seed(4)
    do = torch.randn(o.shape, device=device, generator=gen).to(o.dtype)
    dht = torch.randn(ht.shape, device=device, generator=gen)
    got = torch.autograd.grad((o, ht), list(leaves.values()), (do, dht))
    ref_leaves = {n: x.detach().double().requires_grad_(True) for n, x in leaves.items()}
    ref_args = {**inputs, **ref_leaves}
    positional = [ref_args.pop(n, None) for n in ("q", "k", "v", "g", "beta")]
    ro, rht = reference.run(spec, *positional, form="chunked", output_final_state=True, **ref_args, **options)
    want = torch.autograd.grad((ro, rht), list(ref_leaves.values()), (do.double(), dht.double()))
    errors = {"o": rel_rmse(o, ro)}
    errors.update({n: rel_rmse(a, b) for n, a, b in zip(leaves, got, want)})
    return errors


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="1,1024,2,4", help="B,T,H,HV")
    parser.add_argument("--dims", default="64,64", help="K,V")
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--maps", default="identity,elu")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--no-patch", action="store_true", help="the plain interpreter (for float32 runs)")
    a = parser.parse_args()
    B, T, H, HV = map(int, a.shape.split(","))
    K, V = map(int, a.dims.split(","))
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    undo = None
    if not torch.cuda.is_available() and not a.no_patch:
        from gdngen.bf16_emulation import patch_bf16_interpreter
        undo = patch_bf16_interpreter()
    try:
        for fmap in a.maps.split(","):
            options = {"normalize": True}
            if fmap != "identity":
                options["feature_map"] = fmap
            e = grad_errors(options, B=B, T=T, H=H, HV=HV, K=K, V=V, chunk_size=a.chunk, dtype=dtype,
                            device="cuda" if torch.cuda.is_available() else "cpu")
            print(f"{fmap:9s} ({B},{T},{H},{HV}) K={K} V={V} chunk {a.chunk} {a.dtype}: "
                  + " ".join(f"{n}={e[n]:.3e}" for n in ("q", "k", "v", "initial_state", "o")), flush=True)
    finally:
        if undo:
            undo()


if __name__ == "__main__":
    main()
