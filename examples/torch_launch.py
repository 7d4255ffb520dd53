"""PyTorch under `rallypoint launch`: torch's process group and rallypoint side by side.

    cargo build --release
    target/release/rallypoint launch --nproc-per-node 2 -- python examples/torch_launch.py

The launcher gives every worker torchrun's environment, so `init_process_group`
with the default `env://` finds its store at MASTER_ADDR:MASTER_PORT (the
rallypoint coordinator, which speaks torch's TCPStore protocol), while
`rallypoint.Client.from_env()` joins the same job for barriers that name a dead
or missing rank instead of hanging.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

import rallypoint as rp


def main() -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    with rp.Client.from_env(timeout=60) as client:
        for step in range(1, 4):
            with client.scope("step"):
                grad = torch.full((4,), float(rank + step))
                dist.all_reduce(grad)  # sum over ranks
            if rank == 0:
                print(f"step {step}: all-reduced grad {grad.tolist()} over {world_size} ranks", flush=True)
        workers = [w.decode() for w in client.all_gather(f"rank {rank} on {socket.gethostname()} pid {os.getpid()}")]
        if rank == 0:
            print("workers:", "; ".join(workers), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
