"""What one key-value call costs a Python process: wall time and the process's CPU
(every thread's, the client's runtime included) per `add` and per `get`, one call
at a time, against a running coordinator or node agent.

    python crates/rallypoint-py/bench/call_cost.py --addr HOST:PORT|unix:PATH [--calls 20000]

Prints one JSON line per operation: `{"op", "calls", "wall_us", "cpu_us"}`.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid

import rallypoint as rp


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--addr", required=True)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--warmup", type=int, default=200)
    args = parser.parse_args()
    if args.calls < 1 or args.warmup < 0:
        parser.error("--calls must be at least 1, --warmup at least 0")
    job = f"call-cost-{uuid.uuid4().hex[:8]}"
    with rp.Client(args.addr, rank=0, world_size=1, job=job, timeout=60.0) as client:
        for _ in range(args.warmup):
            client.add("k", 1)
        for op in ("add", "get"):
            call = (lambda: client.add("k", 1)) if op == "add" else (lambda: client.get("k"))
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(args.calls):
                call()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            result = {"op": op, "calls": args.calls, "wall_us": wall / args.calls * 1e6, "cpu_us": cpu / args.calls * 1e6}
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
