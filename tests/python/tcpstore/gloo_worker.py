"""A worker of the 4-rank gloo job run under `rallypoint launch` by test_launch.py.
With KILL_RANK=r, rank r kills itself (SIGKILL) after init while the others wait
in a barrier."""

import os
import signal
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
assert t.item() == world * (world + 1) / 2, t
if os.environ.get("KILL_RANK") == str(rank):
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
dist.barrier()
gathered = [None] * world
dist.all_gather_object(gathered, {"rank": rank})
assert gathered == [{"rank": r} for r in range(world)], gathered
print(f"rank {rank} ok sum={t.item()}", flush=True)
dist.destroy_process_group()
