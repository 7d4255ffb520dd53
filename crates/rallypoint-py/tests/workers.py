"""Functions run by rallypoint.spawn in the tests (importable by the child processes)."""

import os
import sys
import time

import rallypoint as rp

ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
       "RALLYPOINT_ADDR", "RALLYPOINT_JOB", "TORCHELASTIC_RUN_ID")


def gather_and_env(scale, offset=0):
    with rp.Client.from_env() as c:
        with c.scope("step"):
            values = c.all_gather(str(c.rank * scale + offset).encode())
    return {"rank": c.rank, "values": [int(v) for v in values], "env": {k: os.environ.get(k) for k in ENV}}


def rank_two_raises():
    c = rp.Client.from_env()
    if c.rank == 2:
        raise ValueError("boom from rank two")
    c.barrier("never-complete", timeout=60)
    return c.rank


def rank_one_dies():
    c = rp.Client.from_env()
    if c.rank == 1:
        os._exit(3)
    c.barrier("never-complete", timeout=60)
    return c.rank


def returns_none():
    time.sleep(0.01)
    return None


def exits(code=None):
    """sys.exit(code) on every rank but 0 (which returns its rank)."""
    if int(os.environ["RANK"]) != 0:
        sys.exit(code)
    return 0


def rank_one_returns_early():
    """Rank 1 returns (closing its client) while rank 0 waits for it in a barrier."""
    c = rp.Client.from_env()
    if c.rank == 1:
        c.close()
        return "done early"
    c.barrier("final", timeout=60)
    return "passed"
