#!/usr/bin/env python3
"""Helpers of scripts/compare-torch (run through it, not by hand):

  serve-torch                 host torch's own TCPStore server (libuv backend, torch's
                              default) on a free port of 127.0.0.1, print the port, live
                              until stdin closes
  synchronize HOST PORT N ROUNDS SIZE
                              N torch clients (threads, one TCPStore connection each) run
                              torch.distributed.elastic.utils.store.synchronize of SIZE
                              bytes each, ROUNDS times; prints one JSON line like
                              `rallypoint bench all-gather --json`
  report RESULTS              reads the raw JSON lines compare-torch wrote, prints the
                              ratio table (markdown) and appends the barrier-vs-N sweep
                              lines {"system", "n", "median_us", "mean_us"} to RESULTS
"""
import datetime
import json
import statistics
import sys
import threading
import time


def serve_torch():
    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60))
    print(master.port, flush=True)
    sys.stdin.read()  # returns when the parent closes the pipe (or dies)
    del master


def synchronize(host, port, n, rounds, size):
    import torch.distributed as dist
    from torch.distributed.elastic.utils import store as estore

    timeout = 600  # seconds; every call is bounded by it
    t0 = time.perf_counter()
    clients = [dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout), wait_for_workers=False)
               for _ in range(n)]
    connect_ms = (time.perf_counter() - t0) * 1e3
    tag = str(time.time_ns())
    start = threading.Barrier(n + 1, timeout=timeout)
    entered = [[0.0] * rounds for _ in range(n)]
    done = [[0.0] * rounds for _ in range(n)]
    errors = []

    def member(i):
        try:
            start.wait()
            for r in range(rounds):
                entered[i][r] = time.perf_counter()
                got = estore.synchronize(clients[i], bytes([(i + r) % 256]) * size, i, n,
                                         key_prefix=f"ag{tag}/{r}/", timeout=timeout)
                done[i][r] = time.perf_counter()
                peer = (i + 1) % n
                assert len(got) == n and got[peer][:1] == bytes([(peer + r) % 256]), "wrong data"
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    ths = [threading.Thread(target=member, args=(i,), daemon=True) for i in range(n)]
    for t in ths:
        t.start()
    start.wait()
    for t in ths:
        t.join(timeout=timeout * rounds)
    if errors or any(t.is_alive() for t in ths):
        raise SystemExit(f"synchronize failed: {errors[:3]}")
    # As torch_barrier.py: a round lasts from the last member's entry to the last release.
    rt = sorted(max(done[i][r] for i in range(n)) - max(entered[i][r] for i in range(n)) for r in range(rounds))
    print(json.dumps({"op": "synchronize", "clients": n, "value_bytes": size, "rounds": rounds,
                      "median_us": round(rt[len(rt) // 2] * 1e6, 1),
                      "mean_us": round(statistics.fmean(rt) * 1e6, 1),
                      "max_us": round(rt[-1] * 1e6, 1), "connect_ms": round(connect_ms, 1)}))


def report(path):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    # The raw lines; sweep lines of an earlier report are rewritten, not repeated.
    runs = [r for r in rows if "run" in r]

    def pick(run, server, n=None):
        return [r["result"] for r in runs if r["run"] == run and r["server"] == server
                and (n is None or r.get("n") == n)]

    def med(xs):
        return statistics.median(xs) if xs else None

    def fmt_us(us):
        if us is None:
            return "—"
        return f"{us / 1e3:,.2f} ms" if us >= 1000 else f"{us:,.1f} µs"

    def ratio(a, b):
        return f"{a / b:,.2f}×" if a and b else "—"

    # CPU per rank-round over the measured rounds where the run reports both sides
    # (builds from before it did: over all rounds, warm-up included); never one of
    # each kind.
    def cpu_of(x, side):
        kind = "measured_" if (x.get("server_cpu_us_per_measured_rank_round") is not None
                               and x.get("client_cpu_us_per_measured_rank_round") is not None) else ""
        return x.get(f"{side}_cpu_us_per_{kind}rank_round")

    def server_cpu(x):
        return cpu_of(x, "server")

    def load_cpu(x):
        return cpu_of(x, "client")

    out = []
    # Barrier at N (the headline): round medians of each system, and the ping floor.
    n = max((r["n"] for r in runs if r["run"] == "barrier"), default=None)
    if n is not None:
        b = {s: med([x["median_us"] for x in pick("barrier", s, n)]) for s in ("torch", "rallypoint")}
        p = {s: med([x["mean_us"] for x in pick("ping", s, n)]) for s in ("torch", "rallypoint")}
        native = med([x["median_us"] for x in pick("native-barrier", "rallypoint", n)])
        tb = {m: med([x["median_us"] for x in pick(f"torch-clients-{m}", "torch", n)]) for m in ("elastic", "op")}
        fastest_torch = min(x for x in [b["torch"], tb["elastic"], tb["op"]] if x is not None)
        out += [f"### Barrier, N = {n:,} (round median; ping = mean of a PING round, the floor)", "",
                "| what | torch's server | rallypoint | torch ÷ rallypoint |", "| --- | ---: | ---: | ---: |",
                f"| BARRIER request (type 18), Rust load | {fmt_us(b['torch'])} | {fmt_us(b['rallypoint'])} "
                f"| {ratio(b['torch'], b['rallypoint'])} |",
                f"| PING round (floor), Rust load | {fmt_us(p['torch'])} | {fmt_us(p['rallypoint'])} "
                f"| {ratio(p['torch'], p['rallypoint'])} |",
                f"| torch clients, elastic `store.barrier` | {fmt_us(tb['elastic'])} "
                f"| {fmt_us(med([x['median_us'] for x in pick('torch-clients-elastic', 'rallypoint', n)]))} | |",
                f"| torch clients, `TCPStore.barrier` (op) | {fmt_us(tb['op'])} "
                f"| {fmt_us(med([x['median_us'] for x in pick('torch-clients-op', 'rallypoint', n)]))} | |",
                f"| rallypoint native barrier | | {fmt_us(native)} | |", "",
                f"- rallypoint's BARRIER vs torch's fastest store barrier on its own server ({fmt_us(fastest_torch)}): "
                f"torch ÷ rallypoint = **{ratio(fastest_torch, b['rallypoint'])}** (target ≥ 10×); native barrier: "
                f"{ratio(fastest_torch, native)}",
                f"- rallypoint's BARRIER ÷ PING round on rallypoint: **{ratio(b['rallypoint'], p['rallypoint'])}** "
                f"(target ≤ 3×); native barrier ÷ that ping round: {ratio(native, p['rallypoint'])}", ""]
    # KV: per-op latency (lower is better) and add throughput (higher is better).
    kv = {s: pick("kv", s) for s in ("torch", "rallypoint")}
    if kv["torch"] and kv["rallypoint"]:
        out += ["### TCPStore KV, Rust load (median of the runs' medians; throughput = median of runs)", "",
                "| op | torch | rallypoint | rallypoint's speed-up |", "| --- | ---: | ---: | ---: |"]
        for op in ["set", "get", "add", "check", "compare_set", "multi_get"]:
            t = med([k["latency"][op]["median_us"] for k in kv["torch"]])
            r = med([k["latency"][op]["median_us"] for k in kv["rallypoint"]])
            out.append(f"| {op} latency | {fmt_us(t)} | {fmt_us(r)} | {ratio(t, r)} |")
        for run in ("kv", "kv-depth16"):
            kt, kr = pick(run, "torch"), pick(run, "rallypoint")
            for i, th in enumerate(kt[0]["add_throughput"] if kt and kr else []):
                t = med([k["add_throughput"][i]["ops_per_s"] for k in kt])
                r = med([k["add_throughput"][i]["ops_per_s"] for k in kr])
                out.append(f"| add, {th['clients']} clients × {th['depth']} in flight | {t:,.0f} ops/s "
                           f"| {r:,.0f} ops/s | {ratio(r, t)} |")
        out += ["", "(latency: torch ÷ rallypoint; throughput: rallypoint ÷ torch; > 1 = rallypoint faster. "
                "`set` has no reply: its figure is the client's send)", ""]
    # Direct connections: every barrier against the kernel's floor and torch, per N.
    direct_ns = sorted({r["n"] for r in runs if r["run"] == "direct-floor"})
    if direct_ns:
        out += ["### Direct connections: barrier round vs the kernel's floor (range of the runs' medians)", "",
                "| N | floor | torch BARRIER on torch | rallypoint TCPStore BARRIER | rallypoint native "
                "| native: torch ÷ native | native ÷ floor | CPU µs per rank-round, native: server / load "
                "| native, bare client | torch ÷ bare | CPU, bare: server / load |",
                "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]

        def span(xs):
            if not xs:
                return "—"
            lo, hi = min(xs), max(xs)
            return fmt_us(lo) if lo == hi else f"{fmt_us(lo)} – {fmt_us(hi)}"

        for n in direct_ns:
            fl = [x["median_us"] for x in pick("direct-floor", "none", n)]
            tb = [x["median_us"] for x in pick("direct-barrier", "torch", n)]
            rb = [x["median_us"] for x in pick("direct-barrier", "rallypoint", n)]
            nat = pick("direct-native", "rallypoint", n)
            nb = [x["median_us"] for x in nat]
            bare = pick("direct-native-bare", "rallypoint", n)
            bb = [x["median_us"] for x in bare]

            def cpu(xs):
                return " ; ".join(f"{server_cpu(x) or 0:.2f} / {load_cpu(x) or 0:.2f}" for x in xs) or "—"

            out.append(f"| {n:,} | {span(fl)} | {span(tb)} | {span(rb)} | {span(nb)} "
                       f"| {ratio(med(tb), med(nb))} | {ratio(med(nb), med(fl))} | {cpu(nat)} "
                       f"| {span(bb)} | {ratio(med(tb), med(bb)) if bb else '—'} | {cpu(bare)} |")
        # Run by run: each native run against torch's run of the same pass (the
        # script runs them back to back, in the same order, once per pass).
        by_run = []
        for n in direct_ns:
            pairs = [(t["median_us"], x["median_us"]) for t, x in
                     zip(pick("direct-barrier", "torch", n), pick("direct-native", "rallypoint", n))]
            if pairs:
                rs = [t / x for t, x in pairs]
                by_run.append(f"- N = {n:,}: torch ÷ native run by run {min(rs):.2f}–{max(rs):.2f}×, "
                              f"{sum(r >= 1.0 for r in rs)} of {len(rs)} runs at 1.0× or more")
        if by_run:
            out += [""] + by_run
        out += ["", "(ratios of the medians over runs; target: torch ÷ native ≥ 1.0×, native ÷ floor ≤ 1.1×, "
                "and the load generator's CPU below the server's. The bare client speaks the native protocol "
                "without the client library, as the TCPStore load speaks torch's: what the library costs "
                "is the difference. CPU over the measured rounds where the run reports it, else over all)", ""]
        if any(pick("direct-native-raw", "rallypoint", n) for n in direct_ns):
            out += ["### Direct connections: the servers with the floor's clients (`--raw`), "
                    "against the floor", "",
                    "| N | floor | native, raw clients | raw ÷ floor | torch's BARRIER on torch, raw clients "
                    "| ÷ floor | torch ÷ native, both raw | CPU µs per rank-round: floor's server / rallypoint "
                    "/ torch's | CPU, the floor's client / raw native / raw TCPStore |",
                    "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
            for n in direct_ns:
                floors, raws = pick("direct-floor", "none", n), pick("direct-native-raw", "rallypoint", n)
                traws = pick("direct-barrier-raw", "torch", n)
                fl, rw, tr = ([x["median_us"] for x in xs] for xs in (floors, raws, traws))
                if not rw:
                    continue

                def cpus(xs, of):
                    vals = [of(x) for x in xs if of(x)]
                    return f"{med(vals):.2f}" if vals else "—"

                out.append(f"| {n:,} | {span(fl)} | {span(rw)} | {ratio(med(rw), med(fl))} | {span(tr)} "
                           f"| {ratio(med(tr), med(fl))} | {ratio(med(tr), med(rw))} "
                           f"| {cpus(floors, server_cpu)} / {cpus(raws, server_cpu)} / {cpus(traws, server_cpu)} "
                           f"| {cpus(floors, load_cpu)} / {cpus(raws, load_cpu)} / {cpus(traws, load_cpu)} |")
            out += ["", "(the raw clients cost what the floor's do: what a raw round takes over the floor's "
                    "is its server's own, the rest of the native round's over it the load generator's)", ""]
        # The seven loads of a pass, in the columns' order of the tables below.
        kinds = (("direct-floor", "none"), ("direct-barrier", "torch"), ("direct-barrier", "rallypoint"),
                 ("direct-native", "rallypoint"), ("direct-native-bare", "rallypoint"),
                 ("direct-native-raw", "rallypoint"), ("direct-barrier-raw", "torch"))
        out += ["### Direct connections: the load generator's CPU ÷ its server's, per rank-round "
                "(median over runs, over the measured rounds where the run reports them; range in brackets)", "",
                "| N | floor (its client ÷ its server) | torch's BARRIER load ÷ torch's server "
                "| TCPStore BARRIER load ÷ rallypoint | native, client library ÷ rallypoint "
                "| native, bare client ÷ rallypoint | native, raw clients ÷ rallypoint "
                "| torch's BARRIER, raw clients ÷ torch's server |",
                "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for n in direct_ns:
            cells = []
            for run, server in kinds:
                rs = [load_cpu(x) / server_cpu(x) for x in pick(run, server, n) if load_cpu(x) and server_cpu(x)]
                cells.append(f"{med(rs):.2f} ({min(rs):.2f}–{max(rs):.2f})" if rs else "—")
            out.append(f"| {n:,} | " + " | ".join(cells) + " |")
        out += ["", "(target: the client library's load below its server's, < 1.0)", ""]
        if any(x.get("tcp_segments_per_measured_rank_round") is not None
               for run, server in kinds for n in direct_ns for x in pick(run, server, n)):
            out += ["### Direct connections: TCP segments per rank-round, of them pure ACKs "
                    "(median over runs, over the measured rounds)", "",
                    "| N | floor | torch's BARRIER on torch | TCPStore BARRIER on rallypoint "
                    "| native, client library | native, bare client | native, raw clients "
                    "| torch's BARRIER, raw clients |",
                    "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
            for n in direct_ns:
                cells = []
                for run, server in kinds:
                    xs = [x for x in pick(run, server, n) if x.get("tcp_segments_per_measured_rank_round") is not None]
                    segs = [x["tcp_segments_per_measured_rank_round"] for x in xs]
                    acks = [x["tcp_pure_acks_per_measured_rank_round"] for x in xs]
                    cells.append(f"{med(segs):.2f} ({med(acks):.2f})" if xs else "—")
                out.append(f"| {n:,} | " + " | ".join(cells) + " |")
            out += ["", "(two per rank-round carry data, the arrival and the release; each pure ACK costs both "
                    "ends about a message. An arrival held past the kernel's delayed-ACK timeout gets one, "
                    "whatever the server: see docs/BENCHMARKS.md)", ""]
    ag_t, ag_r = pick("synchronize", "torch"), pick("all-gather", "rallypoint")
    if ag_t and ag_r:
        t, r = ag_t[0], ag_r[0]
        out += [f"### All-gather of {r['value_bytes']} B per rank, N = {r['clients']:,}", "",
                "| rallypoint `all_gather` | round | torch `synchronize` on torch's server | torch ÷ rallypoint |",
                "| --- | ---: | ---: | ---: |"]
        how = {"all-gather": "ranks connected directly",
               "all-gather-agents": "through node agents, shared-memory replies",
               "all-gather-agents-copied": "through node agents, replies copied to each socket"}
        for run, what in how.items():
            for x in pick(run, "rallypoint"):
                out.append(f"| {what} ({x['agents']} agents) | {fmt_us(x['median_us'])} | {fmt_us(t['median_us'])} "
                           f"| **{ratio(t['median_us'], x['median_us'])}** |")
        out += ["", "(target ≥ 100×)", ""]
    print("\n".join(out))

    names = {("sweep-barrier", "torch"): "torch server, BARRIER request (Rust load)",
             ("sweep-barrier", "rallypoint"): "rallypoint, TCPStore BARRIER request (Rust load)",
             ("sweep-native", "rallypoint"): "rallypoint, native barrier",
             ("sweep-ping", "rallypoint"): "rallypoint, TCPStore PING round (floor)",
             ("sweep-ping", "torch"): "torch server, PING round (floor)",
             ("sweep-torch-clients", "torch"): "torch server, torch clients, TCPStore.barrier (op)"}
    with open(path, "w") as f:
        for r in runs:
            f.write(json.dumps(r) + "\n")
        for (run, server), system in names.items():
            for r in runs:
                if r["run"] == run and r["server"] == server:
                    x = r["result"]
                    mean = x.get("mean_us", x["median_us"])
                    f.write(json.dumps({"system": system, "n": r["n"], "median_us": x["median_us"],
                                        "mean_us": mean}) + "\n")


def main():
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "serve-torch":
        serve_torch()
    elif cmd == "synchronize":
        synchronize(args[0], int(args[1]), int(args[2]), int(args[3]), int(args[4]))
    elif cmd == "report":
        report(args[0])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
