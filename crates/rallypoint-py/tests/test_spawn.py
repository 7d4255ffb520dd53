"""rallypoint.spawn: results in rank order, the launcher's environment, failures named by rank."""

from __future__ import annotations

import time

import pytest

import rallypoint as rp
import workers


def test_spawn_returns_results_in_rank_order_with_launcher_env():
    results = rp.spawn(workers.gather_and_env, 3, args=(10,), kwargs={"offset": 1}, job="spawned")
    assert [r["rank"] for r in results] == [0, 1, 2]
    for rank, r in enumerate(results):
        assert r["values"] == [1, 11, 21]
        env = r["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (str(rank), str(rank), "3", "3")
        assert env["RALLYPOINT_ADDR"] == f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
        assert (env["RALLYPOINT_JOB"], env["TORCHELASTIC_RUN_ID"]) == ("spawned", "spawned")


def test_spawn_results_may_be_none():
    assert rp.spawn(workers.returns_none, 2) == [None, None]


@pytest.mark.parametrize("code", [None, 0])
def test_a_spawned_sys_exit_0_is_a_return_of_none(code):
    assert rp.spawn(workers.exits, 2, args=(code,)) == [0, None]


def test_a_spawned_sys_exit_with_a_failing_code_fails():
    with pytest.raises(rp.WorkerError) as info:
        rp.spawn(workers.exits, 2, args=(3,))
    assert info.value.rank == 1 and str(info.value).startswith(f"rank 1 (pid {info.value.pid}) raised SystemExit: 3")


def test_spawn_raises_a_workers_exception_with_its_rank_and_traceback():
    started = time.monotonic()
    with pytest.raises(rp.WorkerError) as info:
        rp.spawn(workers.rank_two_raises, 4)
    assert time.monotonic() - started < 20
    e = info.value
    assert e.rank == 2 and e.exitcode is None and e.pid is not None
    assert isinstance(e.exception, ValueError) and e.__cause__ is e.exception
    assert "boom from rank two" in e.traceback and "rank_two_raises" in e.traceback
    assert str(e).startswith(f"rank 2 (pid {e.pid}) raised ValueError: boom from rank two")
    assert "Traceback of rank 2:" in str(e)


def test_spawn_reports_a_worker_that_dies():
    with pytest.raises(rp.WorkerError) as info:
        rp.spawn(workers.rank_one_dies, 3)
    e = info.value
    assert (e.rank, e.exitcode, e.traceback, e.exception) == (1, 3, None, None)
    assert str(e) == f"rank 1 (pid {e.pid}) exited with code 3 before returning"


def test_spawn_rejects_zero_processes():
    with pytest.raises(rp.InvalidArgument):
        rp.spawn(workers.returns_none, 0)


def test_spawn_refuses_bad_arguments_before_starting_anything():
    with pytest.raises(TypeError, match="nprocs must be an int, not str"):
        rp.spawn(workers.returns_none, "2")
    with pytest.raises(rp.InvalidArgument, match="the job name is empty"):
        rp.spawn(workers.returns_none, 2, job="")
    with pytest.raises(rp.InvalidArgument, match=r"holds a control character \(U\+000A\)"):
        rp.spawn(workers.returns_none, 2, job="a\nb")
    with pytest.raises(TypeError, match="grace must be a number of seconds, not str"):
        rp.spawn(workers.returns_none, 2, grace="5")
    with pytest.raises(rp.InvalidArgument, match="grace=nan is not a number of seconds"):
        rp.spawn(workers.returns_none, 2, grace=float("nan"))


def test_a_spawned_rank_that_returns_early_fails_its_peers_barrier_at_once():
    started = time.monotonic()
    with pytest.raises(rp.WorkerError) as info:
        rp.spawn(workers.rank_one_returns_early, 2)
    # Far inside the barrier's 60 s: the parent told the coordinator rank 1 was done.
    assert time.monotonic() - started < 30
    e = info.value
    assert e.rank == 0 and isinstance(e.exception, rp.PeerLost), str(e)
    assert e.exception.rank == 1 and "finished" in str(e.exception), str(e)
