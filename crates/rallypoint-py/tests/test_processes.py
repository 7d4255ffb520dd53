"""Processes as ranks: collectives, a killed rank named at once, Ctrl-C in a barrier;
the same two through a node agent, the barrier waiting in its shared-memory channel."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

import rallypoint as rp


def rank_env(coordinator, job, rank, world_size):
    return {"RALLYPOINT_ADDR": coordinator.addr, "RALLYPOINT_JOB": job, "RANK": str(rank), "WORLD_SIZE": str(world_size)}


def test_processes_as_ranks(coordinator, job, children):
    ranks = [children(rank_env(coordinator, job, r, 3), "collectives") for r in range(3)]
    for child in ranks:
        result = json.loads(child.expect("result ", timeout=20).split(" ", 1)[1])
        assert result == {"gathered": ["from 0", "from 1", "from 2"], "seed": "42"}
        assert child.popen.wait(10) == 0


def test_killed_process_makes_peers_raise_peer_lost_at_once(coordinator, job, children):
    victim = children(rank_env(coordinator, job, 2, 3), "idle")
    victim.expect("connected", timeout=20)
    waiters = [children(rank_env(coordinator, job, r, 3), "barrier") for r in range(2)]
    for w in waiters:
        w.expect("waiting", timeout=20)
    time.sleep(0.3)  # well inside the barrier
    os.kill(victim.pid, signal.SIGKILL)
    for w in waiters:
        # Within 5 s, far inside the 15 s lease and the 30 s barrier timeout; the reason
        # below shows it was the dropped connection. (No tighter bound: the machine is shared.)
        line = w.expect("peerlost ", timeout=5)
        info = json.loads(line.split(" ", 1)[1])
        assert (info["rank"], info["pid"], info["host"]) == (2, victim.pid, socket.gethostname())
        assert info["reason"] == "connection dropped without a clean leave"
        assert "rank 2 (" in info["message"] and f"pid {victim.pid}" in info["message"]


def test_a_stopped_process_is_told_that_its_own_rank_was_lost(job, children):
    """Stopped for longer than its lease while in a barrier: its peers raise PeerLost
    naming it; when it runs again, it raises ThisRankLost (not PeerLost naming itself)."""
    with rp._Coordinator(lease=1) as coordinator:
        stopped = children(rank_env(coordinator, job, 1, 3), "barrier")
        stopped.expect("waiting", timeout=20)
        peer = children(rank_env(coordinator, job, 0, 3), "barrier")
        peer.expect("waiting", timeout=20)
        time.sleep(0.3)  # both inside the barrier; rank 2 never comes
        os.kill(stopped.pid, signal.SIGSTOP)
        try:
            info = json.loads(peer.expect("peerlost ", timeout=10).split(" ", 1)[1])
            assert (info["rank"], info["pid"]) == (1, stopped.pid)
            assert info["reason"] == "no heartbeat for 1.0 s"
        finally:
            os.kill(stopped.pid, signal.SIGCONT)
        own = json.loads(stopped.expect("thisranklost ", timeout=10).split(" ", 1)[1])
        assert (own["rank"], own["pid"], own["state"], own["reason"]) == (1, stopped.pid, "lost", "no heartbeat for 1.0 s")
        assert own["message"].startswith("barrier 'b' (generation 1) failed: this process's rank 1 ("), own
        assert "was declared lost, and its peers were told so" in own["message"], own
        assert stopped.popen.wait(10) == 0


def test_ctrl_c_interrupts_a_barrier(coordinator, job, children):
    child = children(rank_env(coordinator, job, 0, 2), "barrier")
    child.expect("waiting", timeout=20)
    time.sleep(1.0)  # blocked in the barrier by then, even on a loaded machine: rank 1 never comes
    os.kill(child.pid, signal.SIGINT)
    # Within 5 s, not at the barrier's 30 s timeout (no tighter bound: the machine is shared).
    child.expect("interrupted", timeout=5)
    assert child.popen.wait(10) == 0


@pytest.fixture
def agent(coordinator, children_of, tmp_path):
    """A node agent in front of the coordinator on a Unix socket (the wheel's
    `rallypoint agent`, as `rallypoint launch` starts one per node); its address."""
    socket_path = tmp_path / "agent.sock"
    command = ["-m", "rallypoint", "agent", "--upstream", coordinator.addr, "--listen", f"unix:{socket_path}"]
    agent = children_of([*command, "--print-addr"], {"RUST_LOG": "warn"})
    return agent.expect("unix:", timeout=20)


def test_ctrl_c_interrupts_a_barrier_waiting_in_its_agents_channel(agent, job, children):
    ranks = {"RALLYPOINT_ADDR": agent, "RALLYPOINT_JOB": job, "WORLD_SIZE": "2"}
    waiter = children({**ranks, "RANK": "0"}, "seated-barrier")
    children({**ranks, "RANK": "1"}, "arrive-then-idle").expect("arrived", timeout=20)
    waiter.expect("waiting", timeout=20)
    time.sleep(1.0)  # asleep in the channel by then, even on a loaded machine: rank 1 never comes
    os.kill(waiter.pid, signal.SIGINT)
    # Within 5 s, not at the barrier's 30 s timeout (no tighter bound: the machine is shared).
    waiter.expect("interrupted", timeout=5)
    assert waiter.popen.wait(10) == 0


def test_killed_process_fails_a_barrier_waiting_in_its_agents_channel_at_once(agent, job, children):
    ranks = {"RALLYPOINT_ADDR": agent, "RALLYPOINT_JOB": job, "WORLD_SIZE": "2"}
    waiter = children({**ranks, "RANK": "0"}, "seated-barrier")
    victim = children({**ranks, "RANK": "1"}, "arrive-then-idle")
    victim.expect("arrived", timeout=20)
    waiter.expect("waiting", timeout=20)
    time.sleep(0.3)  # well inside the barrier
    os.kill(victim.pid, signal.SIGKILL)
    line = waiter.expect("peerlost ", timeout=5)
    info = json.loads(line.split(" ", 1)[1])
    assert (info["rank"], info["pid"], info["host"]) == (1, victim.pid, socket.gethostname())
    assert info["reason"] == "connection dropped without a clean leave"


def test_a_second_process_claiming_a_held_rank_raises_rank_held(coordinator, job, children):
    holder = children(rank_env(coordinator, job, 1, 2), "idle")
    holder.expect("connected", timeout=20)
    with pytest.raises(rp.RankHeld) as info:
        rp.Client(coordinator.addr, rank=1, world_size=2, job=job, timeout=5)
    e = info.value
    assert isinstance(e, rp.IncarnationRefused) and isinstance(e, rp.RallypointError)
    assert e.rank == 1
    assert (e.holder.pid, e.holder.host) == (holder.pid, socket.gethostname())
    assert e.claimant.pid == os.getpid() and e.claimant.incarnation != e.holder.incarnation
    assert isinstance(e.holder.incarnation, int) and e.since <= time.time()
    assert str(e).startswith(f"rank 1 is held by pid {holder.pid} on host ")
    # The holder is the one that counts: killed, its rank is lost, and may be taken over.
    os.kill(holder.pid, signal.SIGKILL)
    holder.popen.wait(10)
    deadline = time.monotonic() + 10
    while True:
        try:
            c = rp.Client(coordinator.addr, rank=1, world_size=2, job=job, timeout=5)
            break
        except rp.RankHeld:
            assert time.monotonic() < deadline, "the killed holder kept its rank"
            time.sleep(0.05)
    c.close()


def test_a_reset_fails_the_old_incarnation_with_job_reset(coordinator, job):
    old = rp.Client(coordinator.addr, job=job, timeout=5)
    old.set("k", "v")
    resetter = rp.Client(coordinator.addr, job=job, timeout=5)
    resetter.reset(0xBBB)
    with pytest.raises(rp.JobReset) as info:
        old.get("k", timeout=0)
    assert (info.value.job, info.value.incarnation, info.value.by.pid) == (job, 0xBBB, os.getpid())
    assert info.value.by_reset
    fresh = rp.Client(coordinator.addr, job=job, timeout=5)
    assert fresh.job_incarnation == 0xBBB
    assert not fresh.check(["k"])
    for c in (old, resetter, fresh):
        c.close()


def test_a_client_garbage_collected_without_close_is_lost_at_once(job):
    """Its process lives on, so only the client telling the coordinator, as it goes,
    makes the loss immediate, not a reconnect grace (here longer than the barrier's
    timeout, which would then expire instead) later."""
    with rp._Coordinator(lease=600, reconnect_grace=600) as coordinator:
        waiter = rp.Client(coordinator.addr, rank=0, world_size=2, job=job, timeout=5)
        dropped = rp.Client(coordinator.addr, rank=1, world_size=2, job=job, timeout=5)
        del dropped  # the last reference: the object goes now
        with pytest.raises(rp.PeerLost) as info:
            waiter.barrier("b", timeout=30)
        assert info.value.rank == 1 and info.value.reason == "connection dropped without a clean leave"
        waiter.close()



FORKING = r"""
import os, sys, time
import rallypoint as rp

co = rp._Coordinator()
c = rp.Client(co.addr, rank=0, world_size=1, job=sys.argv[1], timeout=10)
c.set("before", "fork")


def end(pid):
    for _ in range(300):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    return "hung"


pid = os.fork()
if pid == 0:
    try:
        c.get("before")
        print("child: the call ran", flush=True)
    except rp.ConnectionError as e:
        print("child:", e, flush=True)
    c.close()  # not the child's to close: nothing happens
    co.shutdown()  # nor to stop
    sys.exit(0)  # the interpreter's end drops both
print("first child:", end(pid), flush=True)
# The parent's connection and coordinator are untouched.
assert c.get("before") == b"fork"
c.barrier("after")
pid = os.fork()
if pid == 0:
    del c, co  # dropped at once, without a word
    sys.exit(0)
print("second child:", end(pid), flush=True)
assert c.get("before") == b"fork"
c.close()
co.shutdown()
print("parent: ok", flush=True)
"""


def test_a_forked_child_leaves_the_inherited_client_and_coordinator_to_its_parent(job):
    run = subprocess.run([sys.executable, "-c", FORKING, job], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert re.fullmatch(
        r"child: this client of 127\.0\.0\.1:\d+ was made in process \d+, and this process \(\d+\) was forked "
        r"from it: its connection is the parent's; make a new client here",
        lines[0],
    ), run.stdout
    assert lines[1:] == ["first child: 0", "second child: 0", "parent: ok"], run.stdout + run.stderr
    assert "panicked" not in run.stderr, run.stderr
