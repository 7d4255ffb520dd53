"""Every Store method of torch's TCPStore client, against torch's own server and
against rallypoint (the `server` fixture runs each test on both): equal behaviour."""

import datetime
import threading
import time

import pytest
import torch.distributed as dist
from torch.distributed.elastic.utils import store as store_util


def test_set_get_add_append(connect):
    s = connect()
    s.set("k", "v")
    assert s.get("k") == b"v"
    assert s.add("cnt", 5) == 5
    assert s.add("cnt", -2) == 3
    assert s.get("cnt") == b"3"
    s.append("ap", "a")
    s.append("ap", "bc")
    assert s.get("ap") == b"abc"
    s.set("n", "12abc")
    assert s.add("n", 1) == 13


def test_compare_set(connect):
    s = connect()
    assert s.compare_set("cs", "", "first") == b"first"
    assert s.compare_set("cs", "wrong", "x") == b"first"
    assert s.compare_set("cs", "first", "second") == b"second"
    assert s.get("cs") == b"second"
    # Missing key, non-empty expected: returns expected, creates nothing.
    assert s.compare_set("missing", "exp", "des") == b"exp"
    assert not s.check(["missing"])


def test_compare_set_on_missing_key_wakes_a_waiter(connect):
    waiter, other = connect(), connect()
    done = []
    t = threading.Thread(target=lambda: (waiter.wait(["x"], datetime.timedelta(seconds=5)), done.append(True)))
    t.start()
    time.sleep(0.3)
    other.compare_set("x", "e", "d")
    t.join(timeout=10)
    assert done == [True]
    assert not other.check(["x"])


def test_check_delete_num_keys_list_keys(connect):
    s = connect()
    base = s.num_keys()
    s.set("a", "1")
    s.set("b", "2")
    assert s.check(["a", "b"])
    assert not s.check(["a", "zz"])
    assert s.num_keys() == base + 2
    assert s.delete_key("a") is True
    assert s.delete_key("a") is False
    assert s.num_keys() == base + 1
    assert "b" in s.list_keys() and "a" not in s.list_keys()


def test_multi_get_multi_set(connect):
    s = connect()
    s.multi_set(["m1", "m2", "m3"], ["1", "2", ""])
    assert s.multi_get(["m3", "m1", "m2"]) == [b"", b"1", b"2"]


def test_wait_without_and_with_timeout_then_reuse(connect):
    s, other = connect(), connect()
    other.set("ready", "1")
    s.wait(["ready"])
    s.wait(["ready"], datetime.timedelta(seconds=1))
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="wait timeout"):
        s.wait(["never"], datetime.timedelta(milliseconds=300))
    assert time.monotonic() - t0 < 5
    # The same client keeps working after CANCEL_WAIT.
    s.set("after", "x")
    assert s.get("after") == b"x"
    s.set_timeout(datetime.timedelta(milliseconds=300))
    with pytest.raises(dist.DistStoreError):
        s.get("never2")
    assert s.add("after-n", 2) == 2


def test_get_blocks_until_set(connect):
    s, other = connect(), connect()
    threading.Timer(0.3, lambda: other.set("late", "v")).start()
    assert s.get("late") == b"v"


def test_queues(connect):
    s, other = connect(), connect()
    s.queue_push("q", "a")
    s.queue_push("q", "b")
    assert s.queue_len("q") == 2
    assert s.queue_pop("q", False) == b"a"
    assert s.queue_pop("q") == b"b"
    with pytest.raises(dist.QueueEmptyError):
        s.queue_pop("q", False)
    # Queues are not keys.
    assert "q" not in s.list_keys()
    # A blocking pop is woken by a push.
    threading.Timer(0.3, lambda: other.queue_push("q2", "late")).start()
    assert s.queue_pop("q2") == b"late"


def test_store_barrier(connect):
    clients = [connect() for _ in range(3)]
    errors = []

    def arrive(c):
        try:
            c.barrier("bb", 3)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=arrive, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert errors == [] and not any(t.is_alive() for t in threads)
    assert clients[0].get("bb") == b"3"
    # The counter never resets: another round releases at once.
    clients[0].barrier("bb", 2)


def test_store_barrier_timeout_keeps_the_increment(connect):
    s = connect()
    with pytest.raises(dist.DistStoreError):
        s.barrier("lonely", 2, datetime.timedelta(milliseconds=300))
    assert s.get("lonely") == b"1"
    s.barrier("lonely", 2)


def test_many_clients(connect):
    clients = [connect() for _ in range(16)]
    threads = [threading.Thread(target=lambda c=c: [c.add("many", 1) for _ in range(10)]) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert clients[0].get("many") == b"160"


def test_elastic_barrier_and_synchronize(connect):
    n = 3
    clients = [dist.PrefixStore("el", connect()) for _ in range(n)]
    results = [None] * n

    def work(rank):
        store_util.barrier(clients[rank], n, key_prefix="bar", barrier_timeout=20)
        results[rank] = store_util.synchronize(clients[rank], f"data{rank}".encode(), rank, n, key_prefix="sync")

    threads = [threading.Thread(target=work, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    expected = [f"data{r}".encode() for r in range(n)]
    assert results == [expected] * n
