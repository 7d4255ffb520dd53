"""A training-style loop on rallypoint, without torch.

    pip install crates/rallypoint-py
    python examples/train_loop.py              # 4 processes, 5 steps
    python examples/train_loop.py --fail 2     # rank 2 crashes at step 3: everyone stops, the error names it

`rallypoint.spawn` starts an embedded coordinator and the worker processes (with
the environment `rallypoint launch` gives, so the same `train` also runs under
`rallypoint launch -- python -c ...` or torchrun). Each step: a scope (barrier on
entry and exit), a fake "loss", an all-gather of every rank's loss, and rank 0
reporting the mean.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from typing import Optional

import rallypoint as rp


def train(steps: int, fail_rank: Optional[int]) -> float:
    client = rp.Client.from_env(timeout=60)
    rank = client.rank
    random.seed(rank)
    # Rank 0 picks the learning rate; everyone gets it.
    lr = float(client.broadcast(b"0.1" if rank == 0 else None, name="lr"))
    loss = 10.0
    for step in range(1, steps + 1):
        with client.scope("step"):
            time.sleep(random.uniform(0.01, 0.05))  # "compute"
            if rank == fail_rank and step == 3:
                os._exit(13)  # a crash: no clean leave, the peers are told at once
            loss *= 1 - lr * random.uniform(0.5, 1.5)
            losses = [float(v) for v in client.all_gather(f"{loss:.6f}", name="loss")]
        if rank == 0:
            print(f"step {step}: mean loss {sum(losses) / len(losses):.4f} over {len(losses)} ranks", flush=True)
    client.close()
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nprocs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--fail", type=int, default=None, metavar="RANK", help="this rank crashes at step 3")
    args = parser.parse_args()
    try:
        final = rp.spawn(train, args.nprocs, args=(args.steps, args.fail))
    except rp.WorkerError as e:
        print(f"training failed: {e}")
        raise SystemExit(1)
    print("final losses by rank:", ", ".join(f"{loss:.4f}" for loss in final))


if __name__ == "__main__":
    main()
