#!/usr/bin/env python3
"""Real torch TCPStore clients against torch's own server and against `rallypoint serve`,
measured in one run, interleaved so that drift of a noisy machine hits both.

1. Latency, one client per server, one operation after another: set, get, add, check,
   compare_set, multi_get (16 keys). Per server and op: `--warmup` untimed ops, then
   `--ops` timed ones in blocks of `--block`; the servers alternate block by block
   (torch, rallypoint, rallypoint, torch, torch, ...), so drift hits both.
2. Throughput of `add` on one shared counter: `--clients` threads, each with its own
   TCPStore connection (torch's client releases the GIL in its C++ calls), each doing
   `--adds` adds per run, started together; `--rounds` runs per server, alternating
   (torch, rallypoint, rallypoint, torch, ...). The final counter must be clients x adds.

Both servers run for the whole measurement, each in its own process: torch's
`TCPStore(host, 0, None, True)` (libuv backend, torch's default) in a child Python
process, and `$RALLYPOINT_BIN serve --listen 127.0.0.1:0 --print-addr`. Both are killed
at the end. Prints a ratio table (rallypoint / torch) and one JSON line.

Run through scripts/compare-torch-kv (it enters a loopback-only network namespace:
torch clients do a reverse-DNS lookup per connect that stalls for seconds otherwise).
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import threading
import time

OPS = ["set", "get", "add", "check", "compare_set", "multi_get"]
SERVERS = ["torch", "rallypoint"]
MULTI_KEYS = 16
VALUE = "v" * 16


def serve_torch():
    """Child mode: host torch's server, print its port, live until stdin closes."""
    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60))
    print(master.port, flush=True)
    sys.stdin.read()  # returns when the parent closes the pipe (or dies)
    del master


def cpu_seconds(pid):
    """utime + stime of a process, from /proc (clock ticks -> s)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Server:
    def __init__(self, name, argv):
        self.name = name
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        line = self.proc.stdout.readline().strip()  # both print their address first
        if not line:
            self.stop()
            raise RuntimeError(f"{name} server did not start: {argv}")
        self.port = int(line.rsplit(":", 1)[-1])

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def pct(sorted_xs, q):
    return sorted_xs[min(len(sorted_xs) - 1, int(len(sorted_xs) * q))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=5000, help="timed ops per op and server [5000]")
    ap.add_argument("--warmup", type=int, default=500, help="untimed ops per op and server [500]")
    ap.add_argument("--block", type=int, default=50, help="latency ops per block; servers alternate by block [50]")
    ap.add_argument("--rounds", type=int, default=6, help="add throughput runs per server, alternating [6]")
    ap.add_argument("--clients", type=int, default=64, help="clients of the add throughput test [64]")
    ap.add_argument("--adds", type=int, default=500, help="adds per client per round [500]")
    ap.add_argument("--max-seconds", type=float, default=600, help="give up after this long [600]")
    ap.add_argument("--server-cpu", type=int, help="pin both servers to this CPU (default: the scheduler places them)")
    ap.add_argument("--client-cpu", type=int, help="pin the clients (this process) to this CPU")
    ap.add_argument("--serve-torch", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve_torch:
        return serve_torch()

    import torch
    import torch.distributed as dist

    deadline = time.monotonic() + a.max_seconds
    timeout = datetime.timedelta(seconds=30)  # every client call is bounded by it

    def check_time():
        if time.monotonic() > deadline:
            raise SystemExit(f"compare_torch_kv: gave up after --max-seconds {a.max_seconds}")

    rp_bin = os.environ.get("RALLYPOINT_BIN", "target/release/rallypoint")
    servers = {}
    try:
        # Where the scheduler puts a server relative to its client moves a round trip by
        # ~40 % here (same CPU: no cross-CPU wake-up); pinning compares like with like.
        pin = ["taskset", "-c", str(a.server_cpu)] if a.server_cpu is not None else []
        if a.client_cpu is not None:
            os.sched_setaffinity(0, {a.client_cpu})
        servers["torch"] = Server("torch", pin + [sys.executable, os.path.abspath(__file__), "--serve-torch"])
        servers["rallypoint"] = Server("rallypoint", pin + [rp_bin, "serve", "--listen", "127.0.0.1:0", "--print-addr"])

        def client(s):
            return dist.TCPStore("127.0.0.1", servers[s].port, None, False, timeout, wait_for_workers=False)

        one = {s: client(s) for s in SERVERS}
        many = {s: [client(s) for _ in range(a.clients)] for s in SERVERS}

        def make_op(c, op):
            if op == "set":
                return lambda: c.set("k_set", VALUE)
            if op == "get":
                c.set("k_get", VALUE)
                return lambda: c.get("k_get")
            if op == "add":
                return lambda: c.add("k_add", 1)
            if op == "check":
                c.set("k_check", VALUE)
                return lambda: c.check(["k_check"])
            if op == "compare_set":
                c.set("k_cas", "a")
                state = ["a", "b"]

                def cas():  # a real swap every time: a -> b -> a ...
                    got = c.compare_set("k_cas", state[0], state[1])
                    assert got == state[1].encode(), got
                    state.reverse()
                return cas
            if op == "multi_get":
                keys = [f"k_m{i}" for i in range(MULTI_KEYS)]
                c.multi_set(keys, [VALUE] * MULTI_KEYS)
                return lambda: c.multi_get(keys)
            raise ValueError(op)

        fns = {s: {op: make_op(one[s], op) for op in OPS} for s in SERVERS}
        for s in SERVERS:  # warm-up, also checks the answers once
            for op in OPS:
                for _ in range(a.warmup):
                    fns[s][op]()
            assert one[s].get("k_get") == VALUE.encode()
            assert one[s].multi_get(["k_m0", "k_m15"]) == [VALUE.encode()] * 2
            check_time()

        lat = {s: {op: [] for op in OPS} for s in SERVERS}
        set_drain = {s: [] for s in SERVERS}  # set has no reply: block time incl. a final get
        add_runs = {s: [] for s in SERVERS}
        add_cpu = {s: [] for s in SERVERS}
        pc = time.perf_counter_ns

        def add_run(s, r):
            key = f"counter_{r}"
            cs = many[s]
            go = threading.Barrier(len(cs) + 1, timeout=60)
            starts, ends, errors = [0] * len(cs), [0] * len(cs), []

            def worker(i):
                try:
                    c = cs[i]
                    go.wait()
                    starts[i] = pc()
                    for _ in range(a.adds):
                        c.add(key, 1)
                    ends[i] = pc()
                except Exception as e:  # noqa: BLE001 - reported below
                    errors.append(repr(e))

            ths = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(len(cs))]
            for t in ths:
                t.start()
            cpu0 = cpu_seconds(servers[s].proc.pid)
            go.wait()
            for t in ths:
                t.join(timeout=max(1.0, deadline - time.monotonic()))
            cpu1 = cpu_seconds(servers[s].proc.pid)
            if errors or any(t.is_alive() for t in ths):
                raise SystemExit(f"compare_torch_kv: add run on {s} failed: {errors[:3]}")
            final = one[s].add(key, 0)
            want = len(cs) * a.adds
            if final != want:
                raise SystemExit(f"compare_torch_kv: {s} counter ended at {final}, expected {want}")
            wall = (max(ends) - min(starts)) / 1e9
            add_runs[s].append(want / wall)
            add_cpu[s].append((cpu1 - cpu0) / want * 1e6)

        for op in OPS:  # latency: blocks of --block ops, the two servers alternating
            nblocks = -(-a.ops // a.block)
            for b in range(nblocks):
                n = min(a.block, a.ops - b * a.block)
                for s in (SERVERS if b % 2 == 0 else SERVERS[::-1]):
                    f, out = fns[s][op], lat[s][op]
                    t_block = pc()
                    for _ in range(n):
                        t0 = pc()
                        f()
                        out.append(pc() - t0)
                    if op == "set":
                        one[s].get("k_set")
                        set_drain[s].append(((pc() - t_block) / 1e3, n))
                check_time()
        for r in range(a.rounds):  # throughput: one run per server per round, alternating
            for s in (SERVERS if r % 2 == 0 else SERVERS[::-1]):
                add_run(s, r)
                check_time()

        res = {"torch_version": torch.__version__, "ops": a.ops, "warmup": a.warmup, "block": a.block,
               "rounds": a.rounds, "multi_get_keys": MULTI_KEYS, "clients": a.clients, "adds_per_client_per_round": a.adds,
               "server_cpu": a.server_cpu, "client_cpu": a.client_cpu,
               "latency_us": {}, "add_throughput": {}}
        for s in SERVERS:
            res["latency_us"][s] = {}
            for op in OPS:
                xs = sorted(lat[s][op])
                res["latency_us"][s][op] = {"median": round(statistics.median(xs) / 1e3, 1),
                                            "p99": round(pct(xs, 0.99) / 1e3, 1),
                                            "mean": round(statistics.fmean(xs) / 1e3, 1)}
            tot_us = sum(t for t, _ in set_drain[s])
            tot_n = sum(n for _, n in set_drain[s])
            res["latency_us"][s]["set_incl_drain_mean"] = round(tot_us / tot_n, 1)
            runs = add_runs[s]
            res["add_throughput"][s] = {"median_ops_per_s": round(statistics.median(runs)),
                                        "per_round_ops_per_s": [round(x) for x in runs],
                                        "server_cpu_us_per_add": round(statistics.median(add_cpu[s]), 2)}
        ratios = {}
        for op in OPS:
            t, rp = res["latency_us"]["torch"][op], res["latency_us"]["rallypoint"][op]
            ratios[op] = {"median": round(rp["median"] / t["median"], 2), "p99": round(rp["p99"] / t["p99"], 2)}
        ratios["add_throughput"] = round(res["add_throughput"]["rallypoint"]["median_ops_per_s"]
                                         / res["add_throughput"]["torch"]["median_ops_per_s"], 2)
        res["ratio_rallypoint_over_torch"] = ratios

        L = res["latency_us"]
        print(f"torch {torch.__version__}; {a.ops} timed ops per op and server after {a.warmup} warm-up, "
              f"servers alternating every {a.block} ops; multi_get of {MULTI_KEYS} keys")
        print("latency (µs, lower is better; ratio = rallypoint ÷ torch, < 1 means rallypoint is faster)")
        print(f"| {'op':<11} | {'torch med':>9} | {'rp med':>7} | {'ratio':>5} | {'torch p99':>9} | {'rp p99':>7} | {'ratio':>5} |")
        print(f"| {'-' * 11} | {'-' * 8}: | {'-' * 6}: | {'-' * 4}: | {'-' * 8}: | {'-' * 6}: | {'-' * 4}: |")
        for op in OPS:
            t, rp = L["torch"][op], L["rallypoint"][op]
            print(f"| {op:<11} | {t['median']:>9.1f} | {rp['median']:>7.1f} | {ratios[op]['median']:>5.2f} "
                  f"| {t['p99']:>9.1f} | {rp['p99']:>7.1f} | {ratios[op]['p99']:>5.2f} |")
        T = res["add_throughput"]
        print(f"set incl. drain (mean µs/op, a get after each block): torch {L['torch']['set_incl_drain_mean']}, "
              f"rallypoint {L['rallypoint']['set_incl_drain_mean']}")
        print(f"add throughput, {a.clients} clients, one counter (ops/s, higher is better; median of {a.rounds} runs): "
              f"torch {T['torch']['median_ops_per_s']}, rallypoint {T['rallypoint']['median_ops_per_s']}, "
              f"ratio {ratios['add_throughput']:.2f}")
        print(f"  per run: torch {T['torch']['per_round_ops_per_s']}, rallypoint {T['rallypoint']['per_round_ops_per_s']}; "
              f"server CPU per add: torch {T['torch']['server_cpu_us_per_add']} µs, "
              f"rallypoint {T['rallypoint']['server_cpu_us_per_add']} µs")
        print(json.dumps(res, separators=(",", ":"), ensure_ascii=False))
    finally:
        for s in servers.values():
            s.stop()


if __name__ == "__main__":
    main()
