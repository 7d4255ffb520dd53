"""Fixtures: an in-process coordinator, a fresh job name per test, and child
processes that are always killed at the end of the test."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from typing import Dict, List, Optional

import pytest

import rallypoint as rp

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def coordinator():
    co = rp._Coordinator()
    yield co
    co.shutdown()


@pytest.fixture
def job() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


class Child:
    """A Python child process whose output lines are collected by a thread, so a
    test can wait for a line with a deadline."""

    def __init__(self, args: List[str], env: Dict[str, str]) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=HERE,
        )
        self.lines: "queue.Queue[Optional[str]]" = queue.Queue()
        self.seen: List[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        for line in self.popen.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def expect(self, prefix: str, timeout: float = 10.0) -> str:
        """The first line starting with `prefix`; fails after `timeout` seconds or at EOF."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"no line {prefix!r} within {timeout} s; output so far: {self.seen}")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                pytest.fail(f"exited ({self.popen.wait()}) before {prefix!r}; output: {self.seen}")
            self.seen.append(line)
            if line.startswith(prefix):
                return line

    @property
    def pid(self) -> int:
        return self.popen.pid


@pytest.fixture
def children_of():
    """Starts `python ARGS` with the environment plus `env`; killed at the test's end."""
    started: List[Child] = []

    def start(args: List[str], env: Dict[str, str]) -> Child:
        full = dict(os.environ)
        full.update(env)
        child = Child(args, full)
        started.append(child)
        return child

    yield start
    for child in reversed(started):
        if child.popen.poll() is None:
            child.popen.kill()
        child.popen.wait(10)


@pytest.fixture
def children(children_of):
    def start(env: Dict[str, str], *args: str) -> Child:
        """Runs rank_worker.py ARGS with the environment plus `env`."""
        return children_of([os.path.join(HERE, "rank_worker.py"), *args], env)

    return start
