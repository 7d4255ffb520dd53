"""Python barrier round time for N processes: rallypoint vs torch's TCPStore barrier.

    python crates/rallypoint-py/bench/barrier_round.py [--nprocs 8] [--rounds 2000]

rallypoint: `Client.barrier` on an embedded coordinator (`rallypoint.spawn`).
torch (if importable, same run): `torch.distributed.elastic.utils.store.barrier` on
torch's own TCPStore server, hosted by the parent; that barrier can be used once
per key prefix, so each round uses a new one. Each process times its own rounds
after a warm-up; the table shows rank 0's median, p90 and mean per round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Dict, List

import rallypoint as rp


def summary(rounds: List[float]) -> Dict[str, float]:
    rounds = sorted(rounds)
    return {
        "median_us": statistics.median(rounds) * 1e6,
        "p90_us": rounds[int(len(rounds) * 0.9)] * 1e6,
        "mean_us": statistics.fmean(rounds) * 1e6,
    }


def rallypoint_worker(rounds: int, warmup: int) -> Dict[str, float]:
    with rp.Client.from_env() as client:
        for _ in range(warmup):
            client.barrier("warmup")
        times = []
        for _ in range(rounds):
            started = time.perf_counter()
            client.barrier("round")
            times.append(time.perf_counter() - started)
    return summary(times)


def torch_worker(addr: str, port: int, rounds: int, warmup: int) -> Dict[str, float]:
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.elastic.utils.store import barrier

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(addr, port, world_size, is_master=False, timeout=timedelta(seconds=60))
    for i in range(warmup):
        barrier(store, world_size, key_prefix=f"warmup{i}", barrier_timeout=60, rank=rank)
    times = []
    for i in range(rounds):
        started = time.perf_counter()
        barrier(store, world_size, key_prefix=f"round{i}", barrier_timeout=60, rank=rank)
        times.append(time.perf_counter() - started)
    return summary(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100)
    args = parser.parse_args()

    rows = [("rallypoint Client.barrier", rp.spawn(rallypoint_worker, args.nprocs, args=(args.rounds, args.warmup))[0])]
    try:
        import torch.distributed as dist
    except ImportError:
        print("torch is not importable: rallypoint only")
    else:
        from datetime import timedelta

        server = dist.TCPStore("127.0.0.1", 0, args.nprocs, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=60))
        result = rp.spawn(torch_worker, args.nprocs, args=("127.0.0.1", server.port, args.rounds, args.warmup))[0]
        rows.append(("torch elastic store.barrier on TCPStore", result))

    print(f"{args.nprocs} processes, {args.rounds} rounds after {args.warmup} warm-up, rank 0's view, {os.cpu_count()} cores")
    print(f"| {'barrier':<42} | median µs | p90 µs | mean µs |")
    print(f"| {'-' * 42} | --------: | -----: | ------: |")
    for name, r in rows:
        print(f"| {name:<42} | {r['median_us']:9.0f} | {r['p90_us']:6.0f} | {r['mean_us']:7.0f} |")


if __name__ == "__main__":
    main()
