"""torch jobs under `rallypoint launch`: the workers' TCPStore is rallypoint's
coordinator (MASTER_ADDR/MASTER_PORT and TORCHELASTIC_USE_AGENT_STORE=True)."""

import os
import time
from pathlib import Path

from conftest import BIN, PYTHON, run

WORKER = str(Path(__file__).with_name("gloo_worker.py"))


def launch(env=None, timeout=180):
    full = dict(os.environ, **(env or {}))
    return run(BIN, "launch", "--nproc-per-node", "4", "--job", "gloo", "--", PYTHON, WORKER, timeout=timeout, env=full)


def test_gloo_job_of_four_ranks():
    result = launch()
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in range(4):
        assert f"rank {rank} ok sum=10.0" in result.stdout, result.stdout + result.stderr


def test_killed_rank_is_named_and_the_launcher_exits_fast():
    t0 = time.monotonic()
    result = launch({"KILL_RANK": "2"}, timeout=120)
    elapsed = time.monotonic() - t0
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "rank 2" in out, out
    assert elapsed < 60, f"took {elapsed:.1f} s\n{out}"
