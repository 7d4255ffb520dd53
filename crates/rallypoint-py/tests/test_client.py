"""Every Client method, threads as ranks, and the exceptions with their facts."""

from __future__ import annotations

import os
import pickle
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, TypeVar

import pytest

import rallypoint as rp

T = TypeVar("T")


def client(coordinator, job, rank=None, world_size=None, **kw) -> rp.Client:
    return rp.Client(coordinator.addr, rank=rank, world_size=world_size, job=job, timeout=10.0, **kw)


def as_ranks(n: int, fn: Callable[[int], T], timeout: float = 20.0) -> List[T]:
    """Runs fn(rank) for every rank in its own thread; results in rank order."""
    with ThreadPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(fn, rank) for rank in range(n)]
        return [f.result(timeout=timeout) for f in futures]


def test_properties_and_repr(coordinator, job):
    c = client(coordinator, job, rank=1, world_size=3, role="trainer")
    assert (c.rank, c.world_size, c.job, c.role, c.addr, c.timeout) == (1, 3, job, "trainer", coordinator.addr, 10.0)
    assert not c.closed
    assert repr(c) == f"Client('{coordinator.addr}', rank=1, world_size=3, job='{job}')"
    c.close()
    assert c.closed and repr(c).endswith(", closed)")
    tool = rp.Client(coordinator.addr)
    assert (tool.rank, tool.world_size, tool.job, tool.role, tool.timeout) == (None, None, "default", None, 300.0)
    tool.close()


def test_key_value_methods(coordinator, job):
    c = client(coordinator, job)
    c.set("text", "héllo")
    c.set(b"raw", b"\x00\xff")
    c.set("array", bytearray(b"ab"))
    assert c.get("text") == "héllo".encode()
    assert c.get(b"raw", timeout=1.0) == b"\x00\xff"
    assert c.get("array") == b"ab"
    assert c.add("counter", 5) == 5
    assert c.add("counter", -7) == -2
    assert c.compare_set("cas", "", "first") == b"first"  # missing + expected empty: set
    assert c.compare_set("cas", "other", "second") == b"first"  # no match: unchanged
    assert c.compare_set("cas", "first", "second") == b"second"
    c.append("log", "a")
    c.append("log", b"b")
    assert c.get("log") == b"ab"
    assert c.check(["text", "raw"]) is True
    assert c.check("text") is True  # a single key is a list of one
    assert c.check(["text", "nope"]) is False
    assert c.delete("text") is True
    assert c.delete("text") is False
    c.multi_set(["m/1", "m/2"], [b"one", "two"])
    assert c.multi_get(["m/2", "m/1"]) == [b"two", b"one"]
    assert c.list_keys("m/") == [b"m/1", b"m/2"]
    assert c.num_keys() == len(c.list_keys())
    c.wait(["m/1", "m/2"], timeout=1.0)
    with pytest.raises(rp.InvalidArgument, match="2 keys but 1 values"):
        c.multi_set(["a", "b"], ["x"])
    c.close()


def test_blocking_gets_wake_when_a_key_is_set(coordinator, job):
    c = client(coordinator, job)
    setter = threading.Timer(0.2, lambda: c.set("late", "v"))
    setter.start()
    try:
        started = time.monotonic()
        assert c.get("late", timeout=5.0) == b"v"
        assert 0.15 < time.monotonic() - started < 2.0
        c.wait(["late"])
        assert c.multi_get(["late"]) == [b"v"]
    finally:
        setter.join()
    c.close()


def test_key_timeout_names_the_missing_keys(coordinator, job):
    c = client(coordinator, job)
    c.set("here", "1")
    for call in (lambda: c.wait(["here", "absent"], timeout=0.2), lambda: c.get("absent", timeout=0.2),
                 lambda: c.multi_get(["absent", "here"], timeout=0.2)):
        with pytest.raises(rp.KeyTimeout) as info:
            call()
        assert isinstance(info.value, TimeoutError) and isinstance(info.value, rp.RallypointError)
        assert info.value.missing_keys == [b"absent"]
        assert 0.15 <= info.value.waited < 1.0
        assert '"absent"' in str(info.value)
    c.close()


def test_threads_as_ranks_collectives(coordinator, job):
    n = 4

    def rank(r: int):
        c = client(coordinator, job, rank=r, world_size=n, role="even" if r % 2 == 0 else "odd")
        c.barrier()
        c.barrier("named", timeout=5.0)
        gathered = c.all_gather(f"v{r}".encode())
        gathered_named = c.all_gather(str(r * r), name="squares")
        seed = c.broadcast(b"seed-from-2" if r == 2 else None, root=2)
        if r in (1, 3):
            c.barrier("odd-only", ranks=[1, 3])
            pair = c.all_gather(f"p{r}", name="pair", ranks=[3, 1])
        else:
            pair = None
        evens = c.broadcast(b"even" if r == 0 else None, name="evens", role="even") if r % 2 == 0 else None
        with c.scope("step"):
            inside = c.add("inside", 1)
        after = int(c.get("inside"))
        c.close()
        return gathered, gathered_named, seed, pair, evens, inside, after

    results = as_ranks(n, rank)
    for r, (gathered, named, seed, pair, evens, inside, after) in enumerate(results):
        assert gathered == [b"v0", b"v1", b"v2", b"v3"]
        assert named == [b"0", b"1", b"4", b"9"]
        assert seed == b"seed-from-2"
        assert pair == ([b"p1", b"p3"] if r in (1, 3) else None)
        assert evens == (b"even" if r % 2 == 0 else None)
        assert after == n  # every rank incremented before anyone left the scope
    assert sorted(inside for *_, inside, _ in results) == [1, 2, 3, 4]


def test_scope_skips_exit_barrier_on_error(coordinator, job):
    c = client(coordinator, job, rank=0, world_size=1)
    with pytest.raises(RuntimeError):
        with c.scope("s"):
            raise RuntimeError("inside")
    with c.scope("s") as scope:
        assert scope.name == "s"
    c.close()


def test_barrier_timeout_names_exactly_the_missing_ranks(coordinator, job):
    arrived = [client(coordinator, job, rank=r, world_size=4) for r in (0, 2)]
    idle = client(coordinator, job, rank=1, world_size=4)  # connected, never arrives; rank 3 never connects

    def wait(c: rp.Client):
        with pytest.raises(rp.BarrierTimeout) as info:
            c.barrier("sync", timeout=0.5)
        return info.value

    with ThreadPoolExecutor(2) as pool:
        errors = list(pool.map(wait, arrived))
    for e in errors:
        assert isinstance(e, TimeoutError) and isinstance(e, rp.RallypointError)
        assert e.missing_ranks == [1, 3]
        assert (e.missing_count, e.more_ranges) == (2, [])
        assert (e.op, e.name, e.generation, e.member_count) == ("barrier", "sync", 1, 4)
        assert 0.45 <= e.waited < 2.0
        one, three = e.missing
        assert (one.rank, one.state, one.host, one.pid) == (1, "connected", socket.gethostname(), os.getpid())
        assert one.last_seen is not None and one.last_seen < 5.0
        assert (three.rank, three.state, three.host, three.pid, three.last_seen) == (3, "never_connected", None, None, None)
        assert "2 of 4 ranks missing: rank 1 (" in str(e) and "rank 3 (never connected)" in str(e)
        assert e.late_by is None
    # Rank 1 comes after the generation timed out: told so, and how late.
    time.sleep(0.2)
    with pytest.raises(rp.BarrierTimeout) as info:
        idle.barrier("sync", timeout=5)
    assert info.value.late_by is not None and info.value.late_by >= 0.15, info.value
    assert "before this call came" in str(info.value)
    for c in (*arrived, idle):
        c.close()


def test_all_gather_and_broadcast_time_out_as_barrier_timeout(coordinator, job):
    c = client(coordinator, job, rank=0, world_size=2)
    with pytest.raises(rp.BarrierTimeout) as info:
        c.all_gather(b"x", name="g", timeout=0.2)
    assert (info.value.op, info.value.missing_ranks) == ("all-gather", [1])
    with pytest.raises(rp.BarrierTimeout) as info:
        c.broadcast(None, root=1, name="b", timeout=0.2)  # the root itself need not wait
    assert (info.value.op, info.value.missing_ranks) == ("broadcast", [1])
    c.close()


def test_peer_dropping_without_close_is_lost(coordinator, job):
    """A rank whose `with Client` block raises drops its connection as a crash would."""
    waiter = client(coordinator, job, rank=0, world_size=2)
    entered = threading.Event()

    def failing_rank():
        with pytest.raises(RuntimeError):
            with client(coordinator, job, rank=1, world_size=2):
                entered.set()
                time.sleep(0.3)
                raise RuntimeError("rank 1 fails")

    thread = threading.Thread(target=failing_rank)
    thread.start()
    assert entered.wait(5)
    started = time.monotonic()
    with pytest.raises(rp.PeerLost) as info:
        waiter.barrier("b", timeout=10)
    assert time.monotonic() - started < 1.0
    thread.join(5)
    e = info.value
    assert (e.rank, e.pid, e.op, e.name, e.generation) == (1, os.getpid(), "barrier", "b", 1)
    assert e.reason == "connection dropped without a clean leave"
    assert e.peer.state == "lost" and "rank 1 (" in str(e)
    waiter.close()


def assert_rank_1_left(coordinator, job):
    """Rank 1 of 2 left cleanly: a barrier times out naming it as left, not lost."""
    c = client(coordinator, job, rank=0, world_size=2)
    with pytest.raises(rp.BarrierTimeout) as info:
        c.barrier(timeout=0.3)
    assert info.value.missing[0].state == "left"
    c.close()


def test_clean_close_is_not_death(coordinator, job):
    leaver = client(coordinator, job, rank=1, world_size=2)
    with leaver:
        pass  # closes cleanly
    assert leaver.closed
    assert_rank_1_left(coordinator, job)


@pytest.mark.parametrize("code", [None, 0])
def test_sys_exit_0_in_a_with_block_closes_cleanly(coordinator, job, code):
    leaver = client(coordinator, job, rank=1, world_size=2)
    with pytest.raises(SystemExit):
        with leaver:
            sys.exit(code)
    assert leaver.closed
    assert_rank_1_left(coordinator, job)


def test_sys_exit_with_a_failing_code_in_a_with_block_is_a_crash(coordinator, job):
    waiter = client(coordinator, job, rank=0, world_size=2)
    leaver = client(coordinator, job, rank=1, world_size=2)
    with pytest.raises(SystemExit):
        with leaver:
            sys.exit(3)
    with pytest.raises(rp.PeerLost) as info:
        waiter.barrier("b", timeout=10)
    assert info.value.rank == 1
    waiter.close()


def test_close_after_the_coordinator_is_gone_warns_and_closes(job):
    co = rp._Coordinator()
    c = rp.Client(co.addr, rank=0, world_size=1, job=job, timeout=5)
    co.shutdown()
    with pytest.warns(RuntimeWarning, match="closed without telling the coordinator this rank left: "):
        c.close()
    assert c.closed
    c.close()  # nothing the second time


def test_abort_reaches_waiting_ranks(coordinator, job):
    waiter = client(coordinator, job, rank=1, world_size=2)
    aborter = client(coordinator, job, rank=0, world_size=2)
    threading.Timer(0.2, lambda: aborter.abort("disk full")).start()
    with pytest.raises(rp.Aborted) as info:
        waiter.barrier(timeout=10)
    e = info.value
    assert (e.by_rank, e.reason, e.job, e.pid) == (0, "disk full", job, os.getpid())
    assert "aborted by rank 0" in str(e)
    with pytest.raises(rp.Aborted):
        waiter.get("anything", timeout=5)
    waiter.close()
    aborter.close()


def test_mismatch_and_bad_members(coordinator, job):
    def rank(r: int):
        c = client(coordinator, job, rank=r, world_size=3)
        try:
            with pytest.raises(rp.MismatchError) as info:
                c.barrier("m", ranks=[0, 1] if r == 0 else [0, 1, 2], timeout=5)
            return info.value
        finally:
            c.close()

    errors = as_ranks(2, rank)
    assert any(e.mine["members"] != e.theirs["members"] for e in errors)
    assert all((e.op, e.name, e.generation) == ("barrier", "m", 1) for e in errors)
    c = client(coordinator, job, rank=0, world_size=3)
    with pytest.raises(rp.BadMembers) as info:
        c.barrier("x", ranks=[1, 2])
    assert isinstance(info.value, rp.MismatchError) and isinstance(info.value, ValueError)
    # What a handler of MismatchError reads is there: nothing to compare it with.
    assert (info.value.op, info.value.name, info.value.generation) == ("barrier", "x", None)
    assert (info.value.mine, info.value.theirs) == (None, None)
    c.close()


def test_invalid_arguments(coordinator, job):
    with pytest.raises(rp.InvalidArgument, match="rank 2 is not below the world size 2"):
        rp.Client(coordinator.addr, rank=2, world_size=2)
    with pytest.raises(ValueError, match="rank=-1 is not a non-negative integer"):
        rp.Client(coordinator.addr, rank=-1, world_size=2)
    with pytest.raises(ValueError, match="world_size=0 is not a positive integer"):
        rp.Client(coordinator.addr, rank=0, world_size=0)
    with pytest.raises(ValueError, match=r"world_size=1099511627776 is more ranks than a world can have \(at most"):
        rp.Client(coordinator.addr, rank=0, world_size=2**40)
    c = client(coordinator, job, rank=0, world_size=2)
    with pytest.raises(ValueError, match="timeout=-1 is not a number of seconds of 0 or more"):
        c.barrier(timeout=-1)
    with pytest.raises(ValueError, match="timeout=NaN is not a number of seconds"):
        c.barrier(timeout=float("nan"))
    c.close()
    # Waits longer than the clock can add (or infinite) are a century: forever, in practice.
    solo = rp.Client(coordinator.addr, job=job + "-solo", rank=0, world_size=1, timeout=1.8e19)
    solo.barrier(timeout=float("inf"))
    solo.set("k", "v")
    assert solo.get("k", timeout=float("inf")) == b"v"
    solo.close()
    c = client(coordinator, job, rank=0, world_size=2)
    with pytest.raises(ValueError, match="ranks or role"):
        c.barrier(ranks=[0], role="r")
    with pytest.raises(TypeError, match="key must be str, bytes, bytearray or memoryview, not int"):
        c.set(1, "x")
    # Any buffer as a memoryview: its bytes, in order.
    c.set(memoryview(b"key-in-a-view")[4:], memoryview(b"0123456789")[::2])
    assert c.get("in-a-view") == b"02468"
    c.close()
    tool = client(coordinator, job)
    with pytest.raises(rp.InvalidArgument, match="needs a rank"):
        tool.barrier()
    for value in ("abc", "0.001", "12abc"):
        tool.set("n", value)
        with pytest.raises(rp.InvalidArgument, match="not an integer"):
            tool.add("n", 1)
        assert tool.get("n") == value.encode()  # left as it was
    tool.close()


def test_closed_client_raises_connection_error(coordinator, job):
    c = client(coordinator, job)
    c.close()
    c.close()  # idempotent
    with pytest.raises(rp.ConnectionError, match="closed") as info:
        c.get("k")
    assert isinstance(info.value, ConnectionError)  # the built-in one too
    # Nor does a block start on it, as a closed file's does not.
    with pytest.raises(rp.ConnectionError, match="closed"):
        with c:
            pytest.fail("the block ran on a closed client")


def test_cannot_connect():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens once closed
    started = time.monotonic()
    with pytest.raises(rp.ConnectionError) as info:
        rp.Client(f"127.0.0.1:{port}", timeout=0.3)
    assert time.monotonic() - started < 3.0
    assert info.value.addr == f"127.0.0.1:{port}" and "cannot connect" in str(info.value)


def test_a_malformed_address_is_refused_at_once(monkeypatch):
    # An hour's timeout: a retry would show as the suite's own timeout.
    for addr, named in (("localhost", "'localhost' has no port"), ("127.0.0.1:abc", "'abc' in '127.0.0.1:abc'")):
        with pytest.raises(rp.InvalidArgument, match=named):
            rp.Client(addr, timeout=3600)
    monkeypatch.setenv("RALLYPOINT_ADDR", "localhost")
    with pytest.raises(rp.InvalidArgument, match="RALLYPOINT_ADDR: 'localhost' has no port"):
        rp.Client.from_env(timeout=3600)


def test_coordinator_shutdown_fails_waiting_calls(job):
    co = rp._Coordinator()
    c = rp.Client(co.addr, rank=0, world_size=2, job=job, timeout=10)
    threading.Timer(0.2, co.shutdown).start()
    with pytest.raises(rp.ConnectionError):
        c.barrier(timeout=10)
    co.shutdown()


def test_from_env(coordinator, job, monkeypatch):
    for name in ("RALLYPOINT_ADDR", "MASTER_ADDR", "MASTER_PORT", "RALLYPOINT_JOB", "TORCHELASTIC_RUN_ID",
                 "RANK", "WORLD_SIZE", "RALLYPOINT_ROLE", "ROLE_NAME", "RALLYPOINT_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(rp.InvalidArgument, match="RALLYPOINT_ADDR"):
        rp.Client.from_env()
    host, port = coordinator.addr.rsplit(":", 1)
    monkeypatch.setenv("MASTER_ADDR", host)
    monkeypatch.setenv("MASTER_PORT", port)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", job)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ROLE_NAME", "trainer")
    monkeypatch.setenv("RALLYPOINT_TIMEOUT", "7.5")
    c = rp.Client.from_env()
    assert (c.addr, c.job, c.rank, c.world_size, c.role, c.timeout) == (coordinator.addr, job, 1, 2, "trainer", 7.5)
    c.close()
    monkeypatch.setenv("RALLYPOINT_ADDR", coordinator.addr)
    monkeypatch.setenv("MASTER_PORT", "not-used")
    c = rp.Client.from_env(rank=0, job="explicit", timeout=1.0)
    assert (c.job, c.rank, c.world_size, c.timeout) == ("explicit", 0, 2, 1.0)
    c.close()
    monkeypatch.setenv("WORLD_SIZE", "-3")
    with pytest.raises(ValueError, match="WORLD_SIZE='-3' is not a positive integer"):
        rp.Client.from_env()


def test_from_env_under_slurm(coordinator, job, monkeypatch):
    """A task started by srun, no launcher: rank, world size, local rank and job from Slurm."""
    for name in ("MASTER_ADDR", "MASTER_PORT", "RALLYPOINT_JOB", "TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE",
                 "LOCAL_RANK", "RALLYPOINT_ROLE", "ROLE_NAME", "RALLYPOINT_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RALLYPOINT_ADDR", coordinator.addr)
    for name, value in (("SLURM_PROCID", "1"), ("SLURM_NTASKS", "2"), ("SLURM_LOCALID", "1"), ("SLURM_JOB_ID", job)):
        monkeypatch.setenv(name, value)
    c = rp.Client.from_env(timeout=10)
    assert (c.job, c.rank, c.world_size, c.local_rank) == (job, 1, 2, 1)
    # It is rank 1 of 2 on the coordinator too: a barrier with rank 0 passes.
    peer = rp.Client(coordinator.addr, rank=0, world_size=2, job=job, timeout=10)
    waiter = threading.Thread(target=peer.barrier, args=("slurm",))
    waiter.start()
    c.barrier("slurm")
    waiter.join(10)
    assert not waiter.is_alive()
    c.close()
    peer.close()
    with rp.Client(coordinator.addr, job=job) as tool:
        assert tool.local_rank is None
    # Under a launcher (RANK/WORLD_SIZE set), the inherited SLURM_* are not this process's.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with rp.Client.from_env(timeout=10) as c:
        assert (c.rank, c.world_size, c.local_rank) == (0, 1, None)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("SLURM_NTASKS", "0")
    with pytest.raises(rp.InvalidArgument, match="SLURM_NTASKS='0' is not a positive integer"):
        rp.Client.from_env()


def test_exceptions_pickle_with_their_facts(coordinator, job):
    c = client(coordinator, job, rank=0, world_size=2)
    with pytest.raises(rp.BarrierTimeout) as info:
        c.barrier(timeout=0.1)
    copy = pickle.loads(pickle.dumps(info.value))
    assert type(copy) is rp.BarrierTimeout
    assert str(copy) == str(info.value)
    assert copy.missing_ranks == [1] and copy.missing == info.value.missing
    c.close()


def test_exception_hierarchy():
    for cls in (rp.BarrierTimeout, rp.KeyTimeout, rp.ReplyTimeout):
        assert issubclass(cls, rp.RallypointError) and issubclass(cls, TimeoutError)
    for cls in (rp.PeerLost, rp.ThisRankLost, rp.Aborted, rp.MismatchError, rp.BadMembers, rp.ConnectionError,
                rp.InvalidArgument, rp.WorkerError):
        assert issubclass(cls, rp.RallypointError)
    assert issubclass(rp.ConnectionError, ConnectionError)
    assert issubclass(rp.InvalidArgument, ValueError)
    assert rp.PeerLost.__module__ == "rallypoint"


def test_every_exception_is_exported_by_name():
    # A literal __all__ (what type checkers read) that names every exception class.
    from rallypoint import _errors

    assert set(_errors.__all__) <= set(rp.__all__)
    assert all(hasattr(rp, name) for name in rp.__all__)


def test_integer_arguments_out_of_range_or_of_the_wrong_type_are_named(coordinator, job):
    c = client(coordinator, job, rank=0, world_size=1)
    with pytest.raises(rp.InvalidArgument, match=r"n=9223372036854775808 is out of range \(a signed 64-bit integer\)"):
        c.add("k", 2**63)
    with pytest.raises(rp.InvalidArgument, match=r"incarnation=-1 is out of range"):
        c.reset(-1)
    with pytest.raises(TypeError, match="ranks must be a sequence of ints, not str"):
        c.barrier(ranks="0")
    with pytest.raises(TypeError, match="ranks must be a sequence of ints, not int"):
        c.barrier(ranks=0)
    with pytest.raises(TypeError, match="ranks must be an int, not bool"):
        c.barrier(ranks=[True])
    with pytest.raises(rp.InvalidArgument, match="ranks=1099511627776 is beyond the largest rank, 4294967295"):
        c.barrier(ranks=[0, 2**40])
    with pytest.raises(TypeError, match="n must be an int, not float"):
        c.add("k", 1.5)
    assert c.add("k", 2**63 - 1) == 2**63 - 1
    c.close()
