"""Seeing a running job (issue 16): what `rallypoint status` and the live page show
of torch jobs (ranks that never wrote their address key, waits on keys, torchrun's
c10d rendezvous rounds), the page in headless Chromium, and /metrics parsed by the
Prometheus client library as a scripted job runs."""

import datetime
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import BIN, PYTHON, Rallypoint, run

# Upper bound of every wait here.
LIMIT = 90


class Served(Rallypoint):
    """`rallypoint serve` with the live page on a free port (`self.page`)."""

    def __init__(self, *args):
        super().__init__("--http", "127.0.0.1:0", *args)
        self.page = None
        deadline = time.monotonic() + 10
        while self.page is None and time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            found = re.search(r"live page at (http://[0-9.:]+/)", line)
            if found:
                self.page = found.group(1)
        if self.page is None:
            self.stop()
            raise RuntimeError("rallypoint serve did not say where its page is")
        # Keep draining stderr so that the server never blocks on it.
        threading.Thread(target=self.proc.stderr.read, daemon=True).start()

    @property
    def addr(self):
        return f"{self.host}:{self.port}"

    def get(self, path, headers=None):
        request = urllib.request.Request(self.page.rstrip("/") + path, headers=headers or {})
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.read().decode()

    def status_json(self, job):
        """The status document of `job`; None while the coordinator holds no such job."""
        result = run(BIN, "status", "--json", "--addr", self.addr, "--job", job, "--timeout", "30", timeout=60)
        if result.returncode == 2 and "holds no job" in result.stderr:
            return None
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    def status_text(self, job):
        result = run(BIN, "status", "--addr", self.addr, "--job", job, "--timeout", "30", timeout=60)
        assert result.returncode == 0, result.stderr
        return result.stdout


@pytest.fixture
def served():
    server = Served()
    yield server
    server.stop()


def until(what, check, limit=LIMIT):
    """Calls `check` until it returns something true (at most `limit` seconds)."""
    deadline = time.monotonic() + limit
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.3)
    pytest.fail(f"{what}: not within {limit} s; last: {last!r}")


GLOO_INIT = """
import torch.distributed as dist
dist.init_process_group("gloo")
print("initialised", flush=True)
"""


def test_status_names_the_rank_that_never_wrote_its_key_and_who_waits_for_it(served):
    # A 4-rank gloo job whose rank 2 never starts: ranks 0, 1 and 3 block in
    # init_process_group, each waiting on rank 2's address key (torch's own TCPStore
    # client and gloo's rendezvous, against rallypoint).
    env = dict(os.environ, WORLD_SIZE="4", MASTER_ADDR=served.host, MASTER_PORT=str(served.port),
               TORCHELASTIC_USE_AGENT_STORE="True")
    ranks = [subprocess.Popen([PYTHON, "-c", GLOO_INIT], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
             for r in (0, 1, 3)]
    try:
        def stuck():
            doc = served.status_json("default")
            if doc is None:
                return None
            torch_view = (doc["job"] or {}).get("torch") or {}
            groups = torch_view.get("process_groups", [])
            waiting = {w["rank"] for w in doc["job"]["key_waits"]} if doc["job"] else set()
            if any(g["missing"]["ranges"] == [[2, 2]] for g in groups) and {0, 1, 3} <= waiting:
                return doc
            return None

        doc = until("ranks 0, 1, 3 waiting on rank 2's address key", stuck)
        job = doc["job"]
        group = next(g for g in job["torch"]["process_groups"] if g["missing"]["count"])
        assert group["written"]["ranges"] == [[0, 1], [3, 3]], group
        for wait in job["key_waits"]:
            assert wait["tcpstore"] and wait["op"] == "wait", wait
            assert any(key.endswith("/2") for key in wait["absent"]), wait
        assert job["ranks"][2]["state"] == "never_connected", job["ranks"]
        assert all(job["ranks"][r].get("key_wait") is not None for r in (0, 1, 3)), job["ranks"]
        # The text report says the same.
        text = served.status_text("default")
        assert "MISSING (waited for, never written): ranks [2]" in text, text
        assert re.search(r"waiting: rank 0 \(host [^)]*\) for [0-9.]+ s on \"/default_pg/\S*/2\"", text), text
        # The page's API serves the same document.
        page = json.loads(served.get("/api/status?job=default"))
        assert page["schema"] == doc["schema"] == 1
        assert page["job"]["torch"]["process_groups"] == job["torch"]["process_groups"]
    finally:
        for proc in ranks:
            proc.kill()
            proc.wait()


RENDEZVOUS = """
import datetime, sys
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

endpoint, run_id, nodes = sys.argv[1], sys.argv[2], int(sys.argv[3])
params = RendezvousParameters(backend="c10d", endpoint=endpoint, run_id=run_id, min_nodes=nodes, max_nodes=nodes,
                              is_host=False, join_timeout=120, last_call_timeout=1)
backend, store = create_backend(params)
handler = create_handler(store, backend, params)
info = handler.next_rendezvous()
print("rank", info.rank, "of", info.world_size, flush=True)
sys.stdin.read()
handler.shutdown()
"""


def test_a_torchrun_c10d_rendezvous_is_decoded_round_participants_heartbeats(served):
    # torch's own elastic rendezvous (c10d backend) against rallypoint: the first node
    # waits alone in round 0; once the second joins, the round completes.
    endpoint = served.addr
    start = lambda: subprocess.Popen([PYTHON, "-c", RENDEZVOUS, endpoint, "run7", "2"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    first = start()
    second = None
    try:
        def rendezvous():
            doc = served.status_json("default") or {"job": None}
            views = ((doc["job"] or {}).get("torch") or {}).get("rendezvous", [])
            return next((v for v in views if v["run_id"] == "run7" and v["state"]), None)

        view = until("the first node's rendezvous state", lambda: (v := rendezvous()) and v["state"]["participants"] and v)
        state = view["state"]
        # torch's TCPStore client puts a "/" before every key.
        assert view["key"].endswith("torch.rendezvous.run7") and view.get("error") is None, view
        assert (state["round"], state["complete"], state["closed"]) == (0, False, False), state
        assert [p["pid"] for p in state["participants"]] == [first.pid], state
        beat = state["participants"][0]["last_heartbeat_unix_ms"]
        assert beat is not None and abs(beat / 1000 - time.time()) < 600, state

        second = start()
        view = until("the completed round", lambda: (v := rendezvous()) and v["state"]["complete"] and v)
        state = view["state"]
        assert sorted(p["pid"] for p in state["participants"]) == sorted([first.pid, second.pid]), state
        assert sorted(p["rank"] for p in state["participants"]) == [0, 1], state
        text = served.status_text("default")
        assert re.search(rf"torchrun rendezvous 'run7': round {state['round']}, complete, 2 participant\(s\)", text), text
    finally:
        for proc in (first, second):
            if proc is not None:
                proc.kill()
                proc.wait()


def chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser")


def test_the_page_in_headless_chromium_shows_the_missing_rank(tmp_path):
    browser = chromium()
    if browser is None:
        pytest.skip("Debian's chromium is not installed (scripts/test installs it): the page is not tested in a browser")
    token_file = tmp_path / "token"
    token_file.write_text("page-test-token-0123456789abcdef\n")
    token_file.chmod(0o600)
    server = Served("--token-file", str(token_file))
    env = dict(os.environ, RALLYPOINT_TOKEN_FILE=str(token_file))
    ranks = [subprocess.Popen([BIN, "barrier", "step", "--addr", server.addr, "--job", "train", "--rank", str(r),
                               "--world-size", "4", "--timeout", str(LIMIT)], env=env, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for r in (0, 1, 3)]
    try:
        headers = {"Authorization": "Bearer page-test-token-0123456789abcdef"}
        def three_in_the_barrier():
            job = json.loads(server.get("/api/status?job=train", headers))["job"]
            return job and job["waits"] and job["waits"][0]["arrived"] == 3

        until("three ranks in the barrier", three_in_the_barrier)
        url = server.page + "login?token=page-test-token-0123456789abcdef"
        profile = tempfile.mkdtemp(prefix="rallypoint-chromium-")
        flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", f"--user-data-dir={profile}",
                 "--virtual-time-budget=5000", "--window-size=1280,720"]
        try:
            dom = run(*flags, "--dump-dom", url, timeout=LIMIT).stdout
            # The login redirected to the page, which loaded the job by itself.
            assert 'data-job="train"' in dom, dom[:2000]
            cell = re.search(r'<div class="cell ([^"]*)" data-rank="2"[^>]*>', dom)
            assert cell and "missing" in cell.group(1).split() and "never" in cell.group(1).split(), dom[:4000]
            for r in (0, 1, 3):
                other = re.search(rf'<div class="cell ([^"]*)" data-rank="{r}"', dom)
                assert other and other.group(1).split()[0] == "waiting" and "missing" not in other.group(1), other
            assert "missing (1): rank 2 (never connected)" in dom, dom[:4000]
            assert "missing (others wait for them): rank 2 (1)" in dom, dom[:4000]
            # A screenshot for a person to look at.
            shots = Path(os.environ.get("RALLYPOINT_ARTIFACTS", tempfile.gettempdir()))
            shots.mkdir(parents=True, exist_ok=True)
            shot = shots / "rallypoint-live-page.png"
            run(*flags, f"--screenshot={shot}", url, timeout=LIMIT)
            assert shot.stat().st_size > 1000
            print(f"screenshot of the live page: {shot}")
        finally:
            shutil.rmtree(profile, ignore_errors=True)
    finally:
        for proc in ranks:
            proc.kill()
            proc.wait()
        server.stop()


def metrics(served):
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(served.get("/metrics")):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))), 0)


def test_metrics_parse_as_openmetrics_and_move_as_a_job_runs(served):
    pytest.importorskip("prometheus_client", reason="prometheus_client is not installed (scripts/test installs it)")
    before = metrics(served)
    job = "scripted"

    def rank(r, *verb):
        return subprocess.Popen([BIN, *verb, "--addr", served.addr, "--job", job, "--rank", str(r), "--world-size", "2",
                                 "--timeout", str(LIMIT)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    for _ in range(3):
        procs = [rank(r, "barrier", "step") for r in (0, 1)]
        for p in procs:
            assert p.wait(timeout=LIMIT) == 0, p.stderr.read()
    tool = lambda *verb: run(BIN, *verb, "--addr", served.addr, "--job", job, timeout=LIMIT)
    assert tool("set", "k", "v").returncode == 0
    assert tool("get", "k").stdout == "v\n"
    assert tool("get", "never", "--timeout", "0.2").returncode == 3

    after = until("the counters", lambda: (m := metrics(served)) and value(m, "rallypoint_kv_operations_total", rallypoint_job=job,
                                                                              op="get") == 2 and m)
    assert value(after, "rallypoint_arrivals_total", rallypoint_job=job, op="barrier") == 6
    assert value(after, "rallypoint_releases_total", rallypoint_job=job, op="barrier") == 3
    assert value(after, "rallypoint_wait_seconds_count", rallypoint_job=job, op="barrier") == 3
    assert value(after, "rallypoint_wait_seconds_bucket", rallypoint_job=job, op="barrier", le="+Inf") == 3
    assert value(after, "rallypoint_kv_operations_total", rallypoint_job=job, op="set") == 1
    assert value(after, "rallypoint_timeouts_total", rallypoint_job=job, op="get") == 1
    # Every verb above was a native connection of its own.
    opened = lambda m: value(m, "rallypoint_connections_opened_total", protocol="native")
    assert opened(after) - opened(before) >= 9
    for name in ("rallypoint_received_bytes_total", "rallypoint_sent_bytes_total"):
        assert value(after, name, protocol="native") > value(before, name, protocol="native"), name
    assert value(after, "rallypoint_job_received_bytes_total", rallypoint_job=job) > 0
    assert value(after, "rallypoint_ranks", rallypoint_job=job, state="left") == 2
    assert value(after, "process_resident_memory_bytes") > 0 and value(after, "process_open_fds") > 0
