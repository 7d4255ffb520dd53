"""A barrier of N Python rank processes through one coordinator address (a node
agent's Unix socket, as under `rallypoint launch`), timed as `rallypoint bench
barrier --procs` times its own: a round ends when its last rank is released.

    python crates/rallypoint-py/bench/barrier_procs.py --addr unix:/path/agent.sock \
        [--procs 256] [--rounds 30] [--warmup 3] [--job NAME] [--limit SECS]

Each rank process connects as `rallypoint.Client(addr, rank, world_size)`, passes
the warm-up rounds, then notes the monotonic clock (shared by every process of the
machine) after the last warm-up round and after each measured round, and sends
the list back. A round lasts from the last release of the round before it to its
own last release. Prints one JSON line
(`median_us`, `p99_us`, `mean_us`, `min_us`, `max_us`, `connect_ms`, and the rank
processes' CPU per rank and measured round), as `rallypoint bench barrier --json`
names them: scripts/compare-torch-procs reads them.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
import uuid
from typing import List


def rank_main(addr: str, job: str, rank: int, n: int, rounds: int, warmup: int, out) -> None:
    import rallypoint as rp

    try:
        with rp.Client(addr, rank=rank, world_size=n, job=job, timeout=120.0) as client:
            out.send(("connected", time.monotonic_ns()))
            for _ in range(warmup):
                client.barrier("bench")
            # The last warm-up round's release: where the first measured round starts.
            ends = [time.monotonic_ns()]
            cpu = time.process_time_ns()
            for _ in range(rounds):
                client.barrier("bench")
                ends.append(time.monotonic_ns())
            out.send(("ends", (ends, time.process_time_ns() - cpu)))
    except BaseException as error:  # reported to the driver, which fails the run
        out.send(("error", f"rank {rank}: {type(error).__name__}: {error}"))
    finally:
        out.close()


def percentile(sorted_values: List[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--addr", required=True)
    parser.add_argument("--procs", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--job", default=f"pybench-{uuid.uuid4().hex[:8]}")
    parser.add_argument("--limit", type=float, default=900.0, help="seconds the whole run may take")
    args = parser.parse_args()
    if args.procs < 1 or args.rounds < 1 or args.warmup < 0:
        parser.error("--procs and --rounds must be at least 1, --warmup at least 0")

    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["rallypoint"])
    started = time.monotonic_ns()
    pipes, procs = [], []
    for rank in range(args.procs):
        ours, theirs = context.Pipe(duplex=False)
        proc = context.Process(
            target=rank_main,
            args=(args.addr, args.job, rank, args.procs, args.rounds, args.warmup, theirs),
            daemon=True,
        )
        proc.start()
        theirs.close()
        pipes.append(ours)
        procs.append(proc)

    deadline = time.monotonic() + args.limit
    connected, ends, errors = [], [], []
    for rank, pipe in enumerate(pipes):
        try:
            while True:
                if not pipe.poll(max(0.0, deadline - time.monotonic())):
                    errors.append(f"rank {rank}: no results within --limit {args.limit} s")
                    break
                what, value = pipe.recv()
                if what == "connected":
                    connected.append(value)
                elif what == "ends":
                    ends.append(value)
                    break
                else:
                    errors.append(value)
                    break
        except EOFError:
            errors.append("a rank process ended without its results")
    for proc in procs:
        proc.join(timeout=max(1.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
    if errors:
        print(f"barrier_procs: {len(errors)} rank(s) failed; first: {errors[0]}", file=sys.stderr)
        return 1

    cpu_ns = sum(cpu for _, cpu in ends)
    last = [max(rank_ends[r] for rank_ends, _ in ends) for r in range(args.rounds + 1)]
    rounds_us = sorted((b - a) / 1e3 for a, b in zip(last, last[1:]))
    result = {
        "procs": args.procs,
        "rounds": len(rounds_us),
        "median_us": round(statistics.median(rounds_us), 1),
        "p99_us": round(percentile(rounds_us, 0.99), 1),
        "mean_us": round(statistics.fmean(rounds_us), 1),
        "min_us": round(rounds_us[0], 1),
        "max_us": round(rounds_us[-1], 1),
        "connect_ms": round((max(connected) - started) / 1e6, 1),
        "client_cpu_us_per_measured_rank_round": round(cpu_ns / 1e3 / (args.procs * args.rounds), 3),
    }
    print(json.dumps(result, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
