"""linear_attn normalize=True bf16 gradient errors on the bf16-faithful CPU interpreter (issues #4, #7).

The GPU test's check (tests/test_backward_gpu.py::_check_grads: seed 3, do/dht seed 4, autograd
through the float64 chunked reference) at a smaller shape, with gdngen.bf16_emulation's patch, for
the identity and elu+1 feature maps. Prints rel. RMSE of dq, dk, dv, dh0 (and o).

    PYTHONPATH=$PWD TRITON_INTERPRET=1 python benchmarks/la_dq_error.py --shape 1,1024,2,4 --dims 64,64
"""
import argparse

import torch

from gdngen.selfcheck import gradient_errors


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
            e = gradient_errors("linear_attn", options, B=B, T=T, H=H, HV=HV, K=K, V=V, chunk_size=a.chunk,
                                dtype=dtype, device="cuda" if torch.cuda.is_available() else "cpu")
            print(f"{fmap:9s} ({B},{T},{H},{HV}) K={K} V={V} chunk {a.chunk} {a.dtype}: "
                  + " ".join(f"{n}={e[n]:.3e}" for n in ("q", "k", "v", "initial_state", "o")), flush=True)
    finally:
        if undo:
            undo()


if __name__ == "__main__":
    main()
