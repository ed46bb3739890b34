"""Does Work.wait() of an NCCL send or receive block the host? Two ranks; rank 0 keeps its stream busy
~100 ms before the send, rank 1 waits for the receive; both print the host time of wait().

    torchrun --nproc_per_node=2 benchmarks/wait_probe.py
"""
import os
import time

import torch
import torch.distributed as dist

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl")
x = torch.ones(2 << 20, device="cuda")
for _ in range(2):                                   # warm up the pair's communicator
    (dist.isend(x, 1) if rank == 0 else dist.irecv(x, 0)).wait()
torch.cuda.synchronize()
dist.barrier()
if rank == 0:
    torch.cuda._sleep(200_000_000)                   # ~100 ms of a busy stream
    work = dist.isend(x, 1)
else:
    work = dist.irecv(x, 0)
start = time.perf_counter()
work.wait()
waited = (time.perf_counter() - start) * 1e3
torch.cuda.synchronize()
total = (time.perf_counter() - start) * 1e3
print(f"rank {rank}: wait() returned after {waited:.2f} ms of host time; the stream finished after {total:.2f} ms",
      flush=True)
dist.destroy_process_group()
