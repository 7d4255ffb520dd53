"""Processes as ranks: collectives, a killed rank named at once, Ctrl-C in a barrier."""

from __future__ import annotations

import json
import os
import signal
import socket
import time


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


def test_ctrl_c_interrupts_a_barrier(coordinator, job, children):
    child = children(rank_env(coordinator, job, 0, 2), "barrier")
    child.expect("waiting", timeout=20)
    time.sleep(1.0)  # blocked in the barrier by then, even on a loaded machine: rank 1 never comes
    os.kill(child.pid, signal.SIGINT)
    # Within 5 s, not at the barrier's 30 s timeout (no tighter bound: the machine is shared).
    child.expect("interrupted", timeout=5)
    assert child.popen.wait(10) == 0
