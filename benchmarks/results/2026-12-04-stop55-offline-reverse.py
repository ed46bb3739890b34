"""Compile the one-chain reverse pass (_reverse_gluon_kernel) for sm_90 offline (Triton 3.6): registers, stack, smem."""
import collections, os, re, subprocess, sys, tempfile
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
from gdngen.runtime.gluon import row_descriptor
import importlib.util
_spec = importlib.util.spec_from_file_location("m", os.environ.get("MOD", "generated/gated_delta_rule.py")); m = importlib.util.module_from_spec(_spec); _spec.loader.exec_module(m)
B, T, H, HV, K, V, BT = 1, 4096, 32, 32, 128, 128, 64
q = torch.zeros(B * T, H * K, dtype=torch.bfloat16)
v = torch.zeros(B * T, HV * V, dtype=torch.bfloat16)
tm = torch.zeros(B * T, HV * BT, dtype=torch.float16)
f32 = torch.zeros(16, dtype=torch.float32)
fn = m._reverse_gluon_kernel
regs = dict(m.REVERSE_GLUON_REGISTERS)
for key in ("VALUES_REGS", "SCORES_REGS", "LOADER_REGS", "maxnreg"):
    if key in os.environ: regs[key] = int(os.environ[key])
maxnreg = regs.pop("maxnreg")
for dht, dh0, window, wy in [(True, True, False, False), (True, True, True, False), (True, True, False, True), (True, True, True, True)]:
    args = dict(q_desc=row_descriptor(q, H * K, [BT, K // 2]), k_desc=row_descriptor(q, H * K, [BT, K // 2]),
                t_desc=row_descriptor(tm, HV * BT, [BT, BT]), g_cum=f32, beta=f32, do_desc=row_descriptor(v, HV * V, [BT, V]),
                dv_desc=row_descriptor(v, HV * V, [BT, V]), dht=f32, dh_desc=row_descriptor(v, V, [K, V]), dh0=f32,
                h_desc=row_descriptor(v, V, [K, V]), v_desc=row_descriptor(v, HV * V, [BT, V]),
                gs_desc=row_descriptor(tm.bfloat16(), HV * BT, [BT, BT]), dbeta=f32, dg_wy=f32,
                cu_seqlens=torch.zeros(8, dtype=torch.int32) if window else None, k=q,
                piece_seq=torch.zeros(8, dtype=torch.int32) if window else None, window_log_tol=-10.8 if window else 0.,
                scale=0.088, T=T)
    sig = {name: mangle_type(a) for name, a in args.items()}
    const = dict(H=H, HV=HV, K=K, V=V, BT=BT, IS_VARLEN=window, USE_FINAL_GRAD=dht, STORE_INITIAL_GRAD=dh0, WINDOW=window, WY=wy, DOT_PRECISION="tf32",
                 STAGES=2, **regs)
    for n in ("cu_seqlens", "piece_seq"):
        if args.get(n, 0) is None:
            sig[n] = "constexpr"; const[n] = None
    sig.update({n: "constexpr" for n in const})
    attrs = {(fn.arg_names.index(n),): [['tt.divisibility', 16]] for n in ('beta', 'g_cum', 'dht', 'dh0', 'T', 'k', 'dbeta', 'dg_wy') + (('cu_seqlens', 'piece_seq') if window else ())}
    src = GluonASTSource(fn, sig, {(fn.arg_names.index(n),): val for n, val in const.items()}, attrs)
    cc = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": maxnreg})
    d = tempfile.mkdtemp()
    open(f"{d}/k.cubin", "wb").write(cc.asm["cubin"])
    open(f"/tmp/rev_{window}.ptx", "w").write(cc.asm["ptx"])
    bindir = os.path.dirname(triton.__file__) + "/backends/nvidia/bin"
    sass = subprocess.run([f"{bindir}/nvdisasm", "-c", f"{d}/k.cubin"], capture_output=True, text=True).stdout
    open(f"/tmp/rev_{window}.sass", "w").write(sass)
    res = subprocess.run([f"{bindir}/cuobjdump", "-res-usage", f"{d}/k.cubin"], capture_output=True, text=True).stdout
    ops = collections.Counter(mm.group(1) for line in sass.splitlines()
                              if (mm := re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)))
    print("window", window, "wy", wy, regs, "maxnreg", maxnreg, "smem", cc.metadata.shared, re.findall(r"REG:\d+ STACK:\d+ SHARED:\d+ LOCAL:\d+", res),
          "instr", sum(ops.values()), "STL", ops["STL"], "LDL", ops["LDL"], "threads", re.findall(r"reqntid (\d+)", cc.asm["ptx"]), "setmaxnreg", re.findall(r"setmaxnreg\.(\w+)\.sync\.aligned\.u32\s+(\d+)", cc.asm["ptx"]))
