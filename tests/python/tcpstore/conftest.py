"""Fixtures: a rallypoint coordinator, torch's own TCPStore server, and a fixture
parametrized over both so that every behaviour test runs against each."""

import datetime
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BIN = os.environ.get("RALLYPOINT_BIN", str(ROOT / "target" / "debug" / "rallypoint"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Rallypoint:
    """`rallypoint serve` on a free port, killed at the end."""

    def __init__(self, *args):
        self.proc = subprocess.Popen(
            [BIN, "serve", "--listen", "127.0.0.1:0", "--print-addr", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline().strip()
        if not line:
            self.stop()
            raise RuntimeError(f"rallypoint serve did not start: {self.proc.stderr.read()}")
        self.host, port = line.rsplit(":", 1)
        self.port = int(port)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.stderr.read() if self.proc.stderr else ""


@pytest.fixture
def rallypoint():
    server = Rallypoint()
    yield server
    server.stop()


class TorchServer:
    """torch's own TCPStore server (is_master=True), in this process."""

    def __init__(self):
        import torch.distributed as dist

        self.host = "127.0.0.1"
        self.port = free_port()
        self.master = dist.TCPStore(self.host, self.port, None, True, timeout=datetime.timedelta(seconds=30))

    def stop(self):
        del self.master
        return ""


@pytest.fixture(params=["torch", "rallypoint"])
def server(request):
    s = TorchServer() if request.param == "torch" else Rallypoint()
    yield s
    s.stop()


@pytest.fixture
def connect(server):
    """Makes torch clients of `server` (is_master=False)."""
    import torch.distributed as dist

    def make(timeout=10.0, **kwargs):
        return dist.TCPStore(
            server.host, server.port, None, False, timeout=datetime.timedelta(seconds=timeout), **kwargs
        )

    return make


def run(*args, timeout=120, **kwargs):
    """Runs a command in its own process group; on timeout the whole group (the
    launcher and its workers) is killed, so nothing outlives the test."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{args[:2]} timed out after {timeout} s\n{out}\n{err}")
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


PYTHON = sys.executable
