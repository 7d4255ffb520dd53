"""Jobs under `rallypoint launch`: torch jobs, whose TCPStore is rallypoint's
coordinator (MASTER_ADDR/MASTER_PORT and TORCHELASTIC_USE_AGENT_STORE=True), and
ranks of the rallypoint package, whose failures the launcher's summary must name."""

import os
import time
from pathlib import Path

from conftest import BIN, PYTHON, run

WORKER = str(Path(__file__).with_name("gloo_worker.py"))
NATIVE_WORKER = str(Path(__file__).with_name("native_worker.py"))


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


def test_the_failed_rank_is_named_though_its_peers_dropped_first():
    """Ranks of the rallypoint package: rank 2 drops its client and exits 3 a moment
    later; its peers, told at once, drop theirs before it is reaped. The summary
    names rank 2, not a peer lost after it."""
    env = dict(os.environ, FAIL_RANK="2")
    args = ["launch", "--nproc-per-node", "4", "--job", "native", "--", PYTHON, NATIVE_WORKER]
    result = run(BIN, *args, timeout=120, env=env)
    out = result.stdout + result.stderr
    assert result.returncode == 3, out
    assert "FAILED (attempt 1 of 1): rank 2 exited with code 3" in result.stderr, out
    for rank in (0, 1, 3):
        assert f"rank {rank} told: " in result.stdout and "rank 2 (host " in result.stdout, out
        # Still in their sleep: taken down by the launcher, after rank 2.
        assert f"rank {rank}: killed by the launcher (SIGTERM) after rank 2 failed" in result.stderr, out


def test_what_a_record_decorated_rank_raised_heads_the_summary(tmp_path):
    """torch's @record writes the exception to TORCHELASTIC_ERROR_FILE, which the
    launcher sets per worker as torchrun does, and reads back into its summary."""
    script = tmp_path / "raises.py"
    script.write_text(
        "import os\n"
        "from torch.distributed.elastic.multiprocessing.errors import record\n"
        "@record\n"
        "def main():\n"
        "    if os.environ['RANK'] == '1':\n"
        "        raise ValueError('bad lr: must be positive')\n"
        "main()\n"
    )
    args = ["launch", "--nproc-per-node", "2", "--job", "record", "--", PYTHON, str(script)]
    result = run(BIN, *args, timeout=120, env=dict(os.environ))
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "FAILED (attempt 1 of 1): rank 1 exited with code 1: ValueError: bad lr: must be positive" in result.stderr, out
    assert "it raised (its error file says): ValueError: bad lr: must be positive" in result.stderr, out
