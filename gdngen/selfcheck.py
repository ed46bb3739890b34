"""Random inputs for a spec, the error metric, and the self-check / small benchmark of a built module.

Tests, ``gdngen check`` and ``gdngen bench`` all draw inputs from :func:`make_inputs`, so what CI
checks is what a user's self-check runs.
"""
from __future__ import annotations

import contextlib
from typing import Optional
import statistics
import time
import warnings

import torch

from gdngen import reference
from gdngen.spec import Spec


@contextlib.contextmanager
def poisoned_memory():
    """Inside the block, fresh tensors (torch.empty, empty_like, ...) hold NaN (integers: their max).

    Any output element a kernel forgets to write then shows up as NaN instead of passing a check by
    holding a previous run's values. Uses torch's own uninitialised-memory fill.
    """
    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill
        torch.use_deterministic_algorithms(was_on, warn_only=was_warn)


def rel_rmse(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """sqrt(mean((a - e)^2)) / sqrt(mean(e^2)); NaN anywhere in ``actual`` gives inf. Two empty
    tensors of the same shape (a batch of empty sequences) agree exactly: 0."""
    if actual.numel() == 0 and expected.numel() == 0 and actual.shape == expected.shape:
        return 0.0
    if actual.shape != expected.shape:
        actual, expected = torch.broadcast_tensors(actual, expected)
    # float64 sums over slices of the flattened tensors: a gradient of a 1M-token call is 16 GiB in
    # float64 at once
    a, e = actual.reshape(-1), expected.reshape(-1)
    step = 1 << 24
    err = ref = 0.0
    for start in range(0, a.numel(), step):
        a_part, e_part = a[start:start + step].double(), e[start:start + step].double()
        if not torch.isfinite(a_part).all():
            return float("inf")
        err += (a_part - e_part).pow(2).sum().item()
        ref += e_part.pow(2).sum().item()
    n = max(a.numel(), 1)
    return (err / n) ** 0.5 / max((ref / n) ** 0.5, 1e-30)


def make_inputs(spec: Spec, B=2, T=40, H=2, HV=4, K=16, V=16, *, dtype=torch.float32, device="cpu",
                seed=0, lengths=None, h0=True, fused_gate=False, beta_logits=False) -> dict:
    """Fresh random inputs of realistic magnitude for ``spec``'s chunk function.

    With ``lengths`` the batch is packed varlen (B=1, cu_seqlens from the lengths).
    Returns the keyword arguments for the generated function.
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    cu_seqlens = None
    if lengths is not None:
        B, T = 1, sum(lengths)
        cu_seqlens = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)
    N = len(lengths) if lengths is not None else B
    q, k, v = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, HV, V)
    if spec.transition.delta and not spec.qk_l2norm:
        k = k / k.norm(dim=-1, keepdim=True)
    elif spec.transition.delta:
        k = k / k.norm(dim=-1, keepdim=True)   # l2norm in kernel is opted into per call
    if spec.normalize:
        # the op's default divides by q . sum(k), well-posed for positive features (what a feature
        # map such as elu+1 gives); signed random q, k put that sum through zero and the error of
        # any implementation against float64 without bound (the H200 tuner hit it at T=8192)
        q, k = torch.nn.functional.elu(q) + 1, torch.nn.functional.elu(k) + 1
    args = {"q": q, "k": k, "v": v}
    if spec.transition.decay == "scalar":
        args["g"] = randn(B, T, HV) if fused_gate else torch.nn.functional.logsigmoid(randn(B, T, HV) + 2.0)
    elif spec.transition.decay == "vector":
        args["g"] = torch.nn.functional.logsigmoid(randn(B, T, HV, K) + 3.0) / 4
    if spec.transition.delta:
        args["beta"] = randn(B, T, HV) if beta_logits else torch.sigmoid(randn(B, T, HV))
    out = {name: x.to(dtype) for name, x in args.items()}
    for name in ("g", "beta"):
        if name in out:
            out[name] = args[name].to(torch.float32)
    if h0:
        out["initial_state"] = (randn(N, HV, K, V) * 0.5).float()
    if fused_gate:
        out["A_log"] = (randn(HV) * 0.5).float()
        out["dt_bias"] = (randn(HV) * 0.5).float()
    out["cu_seqlens"] = cu_seqlens
    return {name: (x.to(device) if isinstance(x, torch.Tensor) else x) for name, x in out.items()}


def gradient_errors(spec_name: str, options: dict, *, chunk_size: int = 64, dtype=torch.bfloat16, device="cpu",
                    seed: int = 3, fused_gate: bool = False, beta_logits: bool = False, spec: Optional[Spec] = None,
                    module=None, **shape) -> dict:
    """Rel. RMSE of ``o`` and of every floating input's gradient (keyed by input name) of the generated
    ``chunk_<spec>`` against autograd through the float64 chunked reference: inputs from
    :func:`make_inputs` (``seed``, ``shape``), one random ``do`` / ``dht`` pair (seed ``seed + 1``).
    The GPU tier's backward check and the bf16-emulation tests and scripts all measure this.
    ``spec`` and ``module``: a spec built elsewhere (default: specs/<spec_name>.yaml, generated/)."""
    import importlib
    from gdngen.spec import load_spec
    spec = spec if spec is not None else load_spec(f"specs/{spec_name}.yaml")
    module = module if module is not None else importlib.import_module(f"generated.{spec_name}")
    inputs = make_inputs(spec, dtype=dtype, device=device, seed=seed, fused_gate=fused_gate,
                         beta_logits=beta_logits, **shape)
    o, _, got, cotangents = training_gradients(module, spec, inputs, seed + 1, chunk_size=chunk_size, **options)
    ro, _, want = reference_gradients(spec, inputs, cotangents, **options)
    return {"o": rel_rmse(o, ro), **{n: rel_rmse(got[n], want[n]) for n in got}}


def training_gradients(module, spec: Spec, inputs: dict, seed: int, **options):
    """One training call of ``module``'s chunk function over ``inputs``: ``o``, the final state, every floating
    input's gradient (a dict by input name) for one random ``(do, dht)`` pair drawn on the inputs' device from
    ``seed``, and that pair."""
    leaves = {n: x.detach().clone().requires_grad_(True) for n, x in inputs.items()
              if isinstance(x, torch.Tensor) and x.is_floating_point()}
    o, ht = getattr(module, spec.chunk_function)(**{**inputs, **leaves}, output_final_state=True, **options)
    gen = torch.Generator(device=o.device).manual_seed(seed)
    do = torch.randn(o.shape, device=o.device, generator=gen).to(o.dtype)
    dht = torch.randn(ht.shape, device=o.device, generator=gen)
    grads = torch.autograd.grad((o, ht), list(leaves.values()), (do, dht))
    return o.detach(), ht.detach(), dict(zip(leaves, grads)), (do, dht)


def reference_gradients(spec: Spec, inputs: dict, cotangents, **options):
    """The same call through the float64 chunked reference: ``o``, the final state and every floating input's
    gradient (a dict by input name) for ``cotangents`` = (do, dht)."""
    leaves = {n: x.detach().double().requires_grad_(True) for n, x in inputs.items()
              if isinstance(x, torch.Tensor) and x.is_floating_point()}
    args = {**inputs, **leaves}
    positional = [args.pop(n, None) for n in ("q", "k", "v", "g", "beta")]
    o, ht = reference.run(spec, *positional, form="chunked", output_final_state=True, **args, **options)
    do, dht = cotangents
    grads = torch.autograd.grad((o, ht), list(leaves.values()), (do.double(), dht.double()))
    return o, ht, dict(zip(leaves, grads))


def reference_outputs(spec: Spec, inputs: dict, **options):
    """float64 reference (token recurrence) for the same call (its ``normalize`` defaults to False:
    pass the op's options explicitly)."""
    args = dict(inputs)
    positional = [args.pop("q"), args.pop("k"), args.pop("v"), args.pop("g", None), args.pop("beta", None)]
    return reference.run(spec, *positional, form="recurrent", **args, **options)


def call(module, spec: Spec, inputs: dict, **options):
    return getattr(module, spec.chunk_function)(**inputs, **options)


def self_check(spec: Spec, module, device: str) -> list[dict]:
    """Compare the built module with the float64 reference on a few small cases."""
    cases = [("fp32 B=2 T=40 GVA h0", dict(B=2, T=40), {}),
             ("fp32 varlen [7, 0, 1, 33]", dict(lengths=[7, 0, 1, 33]), {})]
    if device == "cuda":
        cases.append(("bf16 B=2 T=300 K=V=128", dict(B=2, T=300, K=128, V=128, dtype=torch.bfloat16), {}))
    rows = []
    for label, shape, options in cases:
        if spec.normalize:
            options = dict(options, normalize=True)    # the op's default (the reference's is False)
        inputs = make_inputs(spec, device=device, **shape)
        o, ht = call(module, spec, inputs, output_final_state=True, **options)
        o_ref, ht_ref = reference_outputs(spec, inputs, output_final_state=True, **options)
        tol = 5e-3 if inputs["q"].dtype == torch.bfloat16 else 1e-5
        e_o, e_h = rel_rmse(o, o_ref), rel_rmse(ht, ht_ref)
        rows.append({"case": label, "o": e_o, "ht": e_h, "tol": tol, "ok": e_o <= tol and e_h <= tol})
    return rows


def bench_cases(device: str) -> list[tuple]:
    if device == "cuda":
        return [(1, 8192, 16, 32, 128, 128), (8, 2048, 16, 16, 128, 128), (1, 32768, 32, 32, 128, 128)]
    return [(1, 64, 1, 2, 16, 16)]


def time_call(spec: Spec, module, device: str, case: tuple, reps: int = 20) -> dict:
    B, T, H, HV, K, V = case
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    inputs = make_inputs(spec, B=B, T=T, H=H, HV=HV, K=K, V=V, dtype=dtype, device=device, h0=False)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    start = time.perf_counter()
    call(module, spec, inputs)
    sync()
    first = time.perf_counter() - start
    times = []
    for _ in range(reps if device == "cuda" else 2):
        start = time.perf_counter()
        call(module, spec, inputs)
        sync()
        times.append(time.perf_counter() - start)
    ms = statistics.median(times) * 1e3
    return {"case": ",".join(map(str, case)), "dtype": str(dtype).replace("torch.", ""), "first_s": first,
            "ms": ms, "tokens_per_s": B * T / (ms * 1e-3)}
