"""Chaos suite: randomized jobs of real rallypoint processes, with faults injected.

Each run starts a coordinator (`rallypoint serve` with a short lease), optionally
1-3 node agents, and 3-12 rank processes, each either a shell loop of CLI verbs
(`rallypoint barrier`, `rallypoint all-gather`) or a Python client (one
`rallypoint.Client` for all rounds), connected directly or through an agent. Every
rank does the same sequence of barrier and all-gather rounds while a controller, at
random times, kills a rank (SIGKILL), stops it (SIGSTOP: its lease must catch it),
pauses it for under a third of its lease or delays a round by under half the
timeout (neither may fail anyone), makes it leave cleanly, or kills or freezes an
agent (SIGKILL, SIGSTOP: every rank behind it is lost). Every rank process records
each round's enter and exit (CLOCK_BOOTTIME, which every process of the machine
shares; a shell reads it from /proc/uptime, so its records have 10 ms resolution),
its exit code and error text. From those records each run checks:

  hangs           no operation of a rank that is not stopped outlives its timeout
                  plus a margin (behind a frozen agent: plus the client's 5 s reply
                  margin), nor a Python close() its leave wait (2 s) plus that margin;
                  the run's deadline kills what is left
  wrong names     every PeerLost names a rank that really died, with the right cause
                  (killed or agent killed: "connection dropped"; stopped: "no
                  heartbeat"), never a healthy rank or one that left cleanly; every
                  timeout names only failed ranks, each in a state its fault allows,
                  and every failed rank that never arrived
  wrong codes     exit codes as in the README (3 timeout, 4 peer lost, 7 connection
                  lost); the kind of error the faults call for (a killed Python
                  rank is a PeerLost, never a timeout; the ranks of a killed agent
                  get 7)
  early releases  no rank leaves round r successfully before every rank entered it
  wrong gathers   all-gather results are every rank's "v<rank>.<round>", in order

Usage: scripts/chaos --runs N [--seed S] [--max-seconds T] [--jobs J] [--faults K,...]
                     [--keep] [--mutate WHAT]
Run i uses seed S+i: `scripts/chaos --runs 1 --seed S+i` replays its plan (the
scheduling of the processes is not replayed, only the choices).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

# Extra time a rank may take beyond its operation timeout before it counts as hung
# (process start, connect and close of a verb, a loaded machine).
HANG_MARGIN = 2.0
# A healthy rank whose enter record is this long before an error naming it as
# missing had certainly arrived (a verb's start and connect take well under this).
ARRIVAL_SLACK = 0.5
# A stopped rank's lease runs out at most one lease after the stop; allow this much
# for the coordinator's timer and the replies.
LEASE_SLACK = 0.5
# All ranks must have started within this (Python imports on a loaded machine).
START_LIMIT = 15.0
BARRIER, GATHER = "step", "vals"
# How long a client waits for a reply beyond the operation's timeout before it gives
# up on a silent coordinator or agent (ReplyTimeout): the client's safety margin.
REPLY_MARGIN = 5.0
# How long close() waits for its leave to be answered (the client's LEAVE_WAIT):
# behind a frozen agent nobody answers, and close() returns after that wait.
LEAVE_WAIT = 2.0


def now() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


# ---------------------------------------------------------------------------
# The ranks


# A CLI rank: a bash loop of verbs. Times come from /proc/uptime (CLOCK_BOOTTIME,
# read without forking). Commands from the controller (delay, leave) arrive as a
# file read at each round's start. Args: dir, binary, ops ("bgb..."), work sleeps.
# CHAOS_MUTATE breaks what the rank reports, to check that the checks catch it.
CLI_RANK = r"""
set -u
dir=$1 bin=$2 ops=$3
shift 3
mutate=${CHAOS_MUTATE:-}
log=$dir/rank$RANK.log
read -r t _ < /proc/uptime; echo "start $t $$" >> "$log"
r=0
while [ $r -lt ${#ops} ]; do
    op=${ops:r:1}; r=$((r + 1)); work=$1; shift
    if [ -e "$dir/cmd.$RANK" ]; then
        read -r what secs < "$dir/cmd.$RANK"; rm -f "$dir/cmd.$RANK"
        read -r t _ < /proc/uptime
        if [ "$what" = leave ]; then echo "leave $r $t" >> "$log"; exit 0; fi
        echo "delay $r $secs $t" >> "$log"; sleep "$secs"
    fi
    sleep "$work"
    read -r t _ < /proc/uptime; echo "enter $r $t" >> "$log"
    if [ "$mutate" = early ] && [ "$RANK" = 0 ] && [ "$op" = b ]; then
        "$bin" barrier step > "$dir/$RANK.$r.out" 2> "$dir/$RANK.$r.err" &
        read -r t _ < /proc/uptime; echo "exit $r $t 0" >> "$log"
        wait $! || exit $?
        continue
    fi
    # In the background only to learn its pid, which errors naming this rank show.
    if [ "$op" = b ]; then
        "$bin" barrier step > "$dir/$RANK.$r.out" 2> "$dir/$RANK.$r.err" &
    else
        "$bin" all-gather --name vals "v$RANK.$r" > "$dir/$RANK.$r.out" 2> "$dir/$RANK.$r.err" &
    fi
    echo "verb $r $!" >> "$log"
    wait $!
    rc=$?
    case $mutate in
        codes) [ $rc != 4 ] || rc=3 ;;
        names) sed -i 's/rank [0-9]* (/rank 0 (/g' "$dir/$RANK.$r.err" ;;
        gather) tac "$dir/$RANK.$r.out" > "$dir/$RANK.$r.tac"; mv "$dir/$RANK.$r.tac" "$dir/$RANK.$r.out" ;;
    esac
    read -r t _ < /proc/uptime; echo "exit $r $t $rc" >> "$log"
    [ $rc = 0 ] || exit $rc
done
read -r t _ < /proc/uptime; echo "done $t" >> "$log"
"""


def exit_code_of(exc) -> int:
    """The README's exit code for a Python exception, as the CLI maps the same error."""
    import rallypoint as rp

    for cls, code in [
        (rp.BarrierTimeout, 3),
        (rp.ReplyTimeout, 3),
        (rp.PeerLost, 4),
        (rp.ThisRankLost, 4),
        (rp.Aborted, 5),
        (rp.MismatchError, 6),
        (rp.ConnectionError, 7),
        (rp.InvalidArgument, 2),
    ]:
        if isinstance(exc, cls):
            return code
    return 1


def facts_of(exc) -> dict:
    """The exception's attributes, to compare with what its message says."""
    facts = {"type": type(exc).__name__}
    if type(exc).__name__ == "PeerLost":
        facts.update(rank=exc.rank, pid=exc.pid, reason=exc.reason, op=exc.op, name=exc.name, generation=exc.generation)
    elif type(exc).__name__ == "BarrierTimeout":
        facts.update(
            op=exc.op,
            name=exc.name,
            generation=exc.generation,
            waited=exc.waited,
            member_count=exc.member_count,
            missing_ranks=list(exc.missing_ranks),
            states={str(m.rank): m.state for m in exc.missing},
        )
    return facts


def python_rank(cfg: dict) -> None:
    """A Python rank: one client for every round; on an error, leaves cleanly and exits
    with the code the CLI would use."""
    import rallypoint as rp

    d, rank, timeout = cfg["dir"], cfg["rank"], cfg["timeout"]
    fd = os.open(f"{d}/rank{rank}.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def record(*fields) -> None:
        os.write(fd, (" ".join(str(f) for f in fields) + "\n").encode())

    client = rp.Client(cfg["addr"], rank=rank, world_size=cfg["n"], job="chaos", timeout=timeout)
    record("start", f"{now():.6f}", os.getpid())
    cmd = f"{d}/cmd.{rank}"
    for r, (op, work) in enumerate(zip(cfg["ops"], cfg["work"]), 1):
        if os.path.exists(cmd):
            with open(cmd) as f:
                what, secs = f.read().split()
            os.unlink(cmd)
            if what == "leave":
                record("leave", r, f"{now():.6f}")
                client.close()
                return
            record("delay", r, secs, f"{now():.6f}")
            time.sleep(float(secs))
        time.sleep(work)
        record("enter", r, f"{now():.6f}")
        try:
            if op == "b":
                client.barrier(BARRIER, timeout=timeout)
                values = None
            else:
                values = client.all_gather(f"v{rank}.{r}".encode(), name=GATHER, timeout=timeout)
        except rp.RallypointError as exc:
            t = now()
            code = exit_code_of(exc)
            with open(f"{d}/{rank}.{r}.err", "w") as f:
                f.write(f"rallypoint: {exc}\n")
            with open(f"{d}/{rank}.{r}.json", "w") as f:
                json.dump(facts_of(exc), f)
            record("exit", r, f"{t:.6f}", code)
            try:
                client.close()
            except rp.RallypointError:
                pass
            record("closed", f"{now():.6f}")
            sys.exit(code)
        t = now()
        if values is not None:
            with open(f"{d}/{rank}.{r}.out", "w") as f:
                f.write("".join(v.decode(errors="replace") + "\n" for v in values))
        record("exit", r, f"{t:.6f}", 0)
    record("done", f"{now():.6f}")
    client.close()  # raises (exit 1) if the connection is lost: its agent killed, say
    record("closed", f"{now():.6f}")


# ---------------------------------------------------------------------------
# Plans


@dataclass
class Fault:
    kind: str  # kill, stop, delay, leave, agent
    target: int  # a rank, or an agent for "agent" (killed) and "agent-stop" (SIGSTOP)
    at: float  # seconds after every rank started
    secs: float = 0.0  # delay only


@dataclass
class Plan:
    seed: int
    n: int
    ops: str  # one letter per round: b = barrier, g = all-gather
    lease: float
    timeout: float
    agents: int
    via: List[Optional[int]]  # per rank: its agent, or None for a direct connection
    kinds: List[str]  # per rank: "cli" or "py"
    work: List[List[float]]  # per rank, per round: sleep before entering
    faults: List[Fault]

    def describe(self) -> str:
        via = "direct" if self.agents == 0 else f"{self.agents} agent(s)"
        kinds = "".join("c" if k == "cli" else "p" for k in self.kinds)
        faults = ", ".join(
            f"{f.kind} {'agent' if f.kind.startswith('agent') else 'rank'} {f.target} at +{f.at:.2f}s"
            + (f" for {f.secs:.2f}s" if f.kind in ("delay", "pause") else "")
            for f in self.faults
        )
        return (
            f"{self.n} ranks [{kinds}] {via}, rounds {self.ops}, lease {self.lease}s, timeout {self.timeout}s; "
            f"faults: {faults or 'none'}"
        )

    def deadline(self) -> float:
        """Longest a run may legitimately take once its ranks started: the rounds, at
        most two delays, one timeout (or a verb's connect retries), one lease."""
        frozen = REPLY_MARGIN if any(f.kind == "agent-stop" for f in self.faults) else 0.0
        return len(self.ops) * 0.5 + 2 * 0.4 * self.timeout + self.timeout + frozen + self.lease + 2 * HANG_MARGIN + 5


FAULT_KINDS = ["kill", "stop", "delay", "leave", "pause", "agent", "agent-stop"]


def make_plan(seed: int, kinds_allowed: List[str] = FAULT_KINDS) -> Plan:
    rng = random.Random(seed)
    n = rng.randint(3, 12)
    ops = "".join(rng.choice("bg") for _ in range(rng.randint(3, 8)))
    lease = rng.choice([1.0, 1.5, 2.0])
    # Longer than the lease, so a stopped rank that holds a connection is lost by
    # its lease before a timeout could name it.
    timeout = round(lease + rng.uniform(1.5, 2.5), 1)
    agents = 0 if rng.random() < 0.5 else rng.randint(1, 3)
    via = [None if agents == 0 or rng.random() < 0.15 else rng.randrange(agents) for _ in range(n)]
    p_cli = rng.random()
    kinds = ["cli" if rng.random() < p_cli else "py" for _ in range(n)]
    work = [[round(rng.uniform(0, 0.08), 3) for _ in ops] for _ in range(n)]

    est = len(ops) * 0.08  # about how long the rounds take when nothing fails
    count = rng.choices([0, 1, 2], weights=[15, 60, 25])[0]
    faults: List[Fault] = []
    used: set = set()
    loaded = sorted({a for a in via if a is not None})
    for _ in range(count):
        choices = [k for k in kinds_allowed if loaded or not k.startswith("agent")]
        if not choices:
            break
        kind = rng.choice(choices)
        # A delay or leave takes effect at the rank's next round: ask for it earlier.
        at = round(rng.uniform(0, est * (0.6 if kind in ("delay", "leave") else 1.0)), 3)
        if kind in ("agent", "agent-stop"):
            agent = rng.choice(loaded)
            loaded.remove(agent)
            used.update(r for r in range(n) if via[r] == agent)
            faults.append(Fault(kind, agent, at))
            continue
        free = [r for r in range(n) if r not in used]
        if not free:
            break
        target = rng.choice(free)
        used.add(target)
        if via[target] in loaded:
            loaded.remove(via[target])  # its agent's ranks would overlap two faults
        secs = 0.0
        if kind == "delay":
            secs = round(rng.uniform(0.1, 0.4 * timeout), 2)
        elif kind == "pause":
            # Silent for at most a third of a lease plus this: never lost.
            secs = round(rng.uniform(0.05, 0.3 * lease), 2)
        faults.append(Fault(kind, target, at, secs))
    return Plan(seed, n, ops, lease, timeout, agents, via, kinds, work, faults)


# ---------------------------------------------------------------------------
# Running one plan


class Procs:
    """Every process group started, so that whatever happens they all end."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.live: Dict[int, subprocess.Popen] = {}

    def start(self, args, **kw) -> subprocess.Popen:
        with self.lock:
            p = subprocess.Popen(args, start_new_session=True, **kw)
            self.live[p.pid] = p
        return p

    def end(self, procs) -> None:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            if p.stdout is not None:
                p.stdout.close()
            with self.lock:
                self.live.pop(p.pid, None)

    def end_all(self) -> None:
        with self.lock:
            procs = list(self.live.values())
        self.end(procs)


PROCS = Procs()


def group_gone(pgid: int, limit: float = 10.0) -> bool:
    """No process of the group is left (killed members may take a moment to be reaped:
    orphans by init, seconds later on a loaded machine)."""
    end = time.monotonic() + limit
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.01)


def read_first_line(p: subprocess.Popen, limit: float) -> Optional[str]:
    """The first stdout line of `p` (its --print-addr), or None if none came in time."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    end = time.monotonic() + limit
    buf = b""
    while b"\n" not in buf and time.monotonic() < end:
        if sel.select(timeout=max(0.0, end - time.monotonic())):
            chunk = os.read(p.stdout.fileno(), 4096)
            if not chunk:
                break
            buf += chunk
    sel.close()
    return buf.split(b"\n")[0].decode() if b"\n" in buf else None


@dataclass
class Injected:
    fault: Fault
    t: Optional[float]  # when it was injected; None if its target had already exited
    ranks: List[int] = field(default_factory=list)  # the ranks it hit (agent: its live ranks)


@dataclass
class Outcome:
    plan: Plan
    dir: str
    violations: Dict[str, List[str]] = field(default_factory=dict)
    detections: List[Tuple[str, str, float]] = field(default_factory=list)  # fault kind, error kind, secs
    overrun: float = float("-inf")  # longest (op time - timeout) of an op that failed
    effective: Dict[str, int] = field(default_factory=dict)  # faults that hit a running target, by kind
    seconds: float = 0.0

    def add(self, category: str, text: str) -> None:
        self.violations.setdefault(category, []).append(text)


CATEGORIES = ["hangs", "wrong names", "wrong codes", "early releases", "wrong gathers", "other"]


def run_plan(plan: Plan, binary: str, python: str, keep: bool) -> Outcome:
    d = tempfile.mkdtemp(prefix=f"rpchaos-{plan.seed}-")
    out = Outcome(plan, d)
    started_at = time.monotonic()
    procs: List[subprocess.Popen] = []
    try:
        execute(plan, binary, python, d, procs, out)
    except Exception as e:  # a harness failure is a failure of the run, shown with its seed
        out.add("other", f"harness: {type(e).__name__}: {e}")
    finally:
        PROCS.end(procs)
    for p in procs:
        if not group_gone(p.pid):
            out.add("other", f"process group {p.pid} ({' '.join(map(str, p.args[:2]))}) survived SIGKILL")
    out.seconds = time.monotonic() - started_at
    if not out.violations and not keep:
        shutil.rmtree(d, ignore_errors=True)
    return out


def execute(plan: Plan, binary: str, python: str, d: str, procs: list, out: Outcome) -> None:
    def logfile(name):
        return open(f"{d}/{name}", "wb")

    serve = PROCS.start(
        [binary, "serve", "--listen", "127.0.0.1:0", "--print-addr", "--lease", str(plan.lease)],
        stdout=subprocess.PIPE,
        stderr=logfile("serve.log"),
    )
    procs.append(serve)
    addr = read_first_line(serve, 10.0)
    if addr is None:
        return out.add("other", "the coordinator printed no address")
    agents: List[subprocess.Popen] = []
    for k in range(plan.agents):
        a = PROCS.start(
            [binary, "agent", "--upstream", addr, "--listen", f"unix:{d}/a{k}.sock", "--print-addr"],
            stdout=subprocess.PIPE,
            stderr=logfile(f"agent{k}.log"),
        )
        procs.append(a)
        agents.append(a)
        if read_first_line(a, 10.0) is None:
            return out.add("other", f"agent {k} printed no address")

    ranks: List[subprocess.Popen] = []
    for r in range(plan.n):
        raddr = addr if plan.via[r] is None else f"unix:{d}/a{plan.via[r]}.sock"
        env = dict(os.environ, RALLYPOINT_ADDR=raddr, RALLYPOINT_JOB="chaos", RANK=str(r))
        env.update(WORLD_SIZE=str(plan.n), RALLYPOINT_TIMEOUT=str(plan.timeout))
        env.pop("RUST_LOG", None)
        if plan.kinds[r] == "cli":
            args = ["bash", "-c", CLI_RANK, "chaos-rank", d, binary, plan.ops] + [str(w) for w in plan.work[r]]
        else:
            cfg = dict(dir=d, rank=r, n=plan.n, addr=raddr, timeout=plan.timeout, ops=plan.ops, work=plan.work[r])
            args = [python, os.path.abspath(__file__), "_rank", json.dumps(cfg)]
        p = PROCS.start(args, env=env, stdin=subprocess.DEVNULL, stdout=logfile(f"rank{r}.stdout"),
                        stderr=logfile(f"rank{r}.stderr"))
        procs.append(p)
        ranks.append(p)

    # Faults are timed from when every rank runs.
    limit = time.monotonic() + START_LIMIT
    while not all(started(d, r) for r in range(plan.n)):
        if time.monotonic() > limit or any(p.poll() is not None for p in ranks):
            if not all(started(d, r) or ranks[r].poll() is not None for r in range(plan.n)):
                return out.add("other", "not every rank started")
            break
        time.sleep(0.01)
    t0 = now()
    deadline = t0 + plan.deadline()
    pending = sorted(plan.faults, key=lambda f: f.at)
    injected: List[Injected] = []
    stopped: set = set()
    resume: List[Tuple[float, int]] = []  # (when, rank) of paused ranks
    while True:
        while pending and now() >= t0 + pending[0].at:
            i = inject(pending.pop(0), plan, d, ranks, agents, stopped)
            injected.append(i)
            if i.fault.kind == "pause" and i.t is not None:
                resume.append((i.t + i.fault.secs, i.fault.target))
        for when, r in [x for x in resume if now() >= x[0]]:
            resume.remove((when, r))
            stopped.discard(r)
            try:
                os.killpg(ranks[r].pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if not resume and all(p.poll() is not None for i, p in enumerate(ranks) if i not in stopped):
            break
        if now() > deadline:
            break
        time.sleep(0.005)
    running = [r for r, p in enumerate(ranks) if p.poll() is None and r not in stopped]
    alive = {"coordinator": serve.poll() is None}
    killed_agents = {i.fault.target for i in injected if i.fault.kind == "agent"}
    for k, a in enumerate(agents):
        if k not in killed_agents:
            alive[f"agent {k}"] = a.poll() is None
    PROCS.end(procs)
    Checker(plan, d, injected, out).run(running, [p.returncode for p in ranks], alive)


def started(d: str, r: int) -> bool:
    try:
        with open(f"{d}/rank{r}.log") as f:
            return f.readline().startswith("start ")
    except FileNotFoundError:
        return False


def inject(fault: Fault, plan: Plan, d: str, ranks, agents, stopped: set) -> Injected:
    if fault.kind in ("agent", "agent-stop"):
        hit = [r for r in range(plan.n) if plan.via[r] == fault.target and ranks[r].poll() is None]
        t = now()
        os.killpg(agents[fault.target].pid, signal.SIGKILL if fault.kind == "agent" else signal.SIGSTOP)
        return Injected(fault, t, hit)
    p = ranks[fault.target]
    if p.poll() is not None:
        return Injected(fault, None)
    t = now()
    if fault.kind in ("kill", "stop", "pause"):
        try:
            os.killpg(p.pid, signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP)
        except ProcessLookupError:
            return Injected(fault, None)
        if fault.kind != "kill":
            stopped.add(fault.target)
    else:
        # Delay and leave are the rank's own doing, at its next round: a command file.
        tmp = f"{d}/cmd.{fault.target}.tmp"
        with open(tmp, "w") as f:
            f.write(f"{fault.kind} {fault.secs}\n")
        os.rename(tmp, f"{d}/cmd.{fault.target}")
    return Injected(fault, t, [fault.target])


# ---------------------------------------------------------------------------
# Checking one run


@dataclass
class Exit:
    round: int
    t: float
    code: int


@dataclass
class RankLog:
    start: Optional[float] = None
    pid: Optional[int] = None
    enter: Dict[int, float] = field(default_factory=dict)
    exits: Dict[int, Exit] = field(default_factory=dict)
    delay: Optional[Tuple[int, float, float]] = None  # round, secs, t
    leave: Optional[Tuple[int, float]] = None  # round, t
    done: Optional[float] = None
    closed: Optional[float] = None  # Python ranks: when close() returned
    pids: set = field(default_factory=set)  # its process (Python) or its verbs' (CLI)


def read_log(path: str) -> RankLog:
    log = RankLog()
    try:
        lines = open(path).read().splitlines()
    except FileNotFoundError:
        return log
    for line in lines:
        f = line.split()
        try:
            if f[0] == "start":
                log.start, log.pid = float(f[1]), int(f[2])
            elif f[0] == "verb":
                log.pids.add(int(f[2]))
            elif f[0] == "enter":
                log.enter[int(f[1])] = float(f[2])
            elif f[0] == "exit":
                log.exits[int(f[1])] = Exit(int(f[1]), float(f[2]), int(f[3]))
            elif f[0] == "delay":
                log.delay = (int(f[1]), float(f[2]), float(f[3]))
            elif f[0] == "leave":
                log.leave = (int(f[1]), float(f[2]))
            elif f[0] == "done":
                log.done = float(f[1])
            elif f[0] == "closed":
                log.closed = float(f[1])
        except (IndexError, ValueError):
            pass  # a line cut by SIGKILL
    return log


@dataclass
class Parsed:
    kind: str  # timeout, lost, aborted, conn, other
    op: Optional[str] = None
    name: Optional[str] = None
    generation: Optional[int] = None
    rank: Optional[int] = None  # lost: who
    pid: Optional[int] = None
    reason: Optional[str] = None
    waited: Optional[float] = None
    members: Optional[int] = None
    missing: Dict[int, str] = field(default_factory=dict)  # timeout: rank -> state
    missing_pids: Dict[int, Optional[int]] = field(default_factory=dict)
    text: str = ""


LOST_RE = re.compile(r"^(barrier|all-gather) '([^']*)' \(generation (\d+)\) failed: rank (\d+) \((.*)\) is lost$")
TIMEOUT_RE = re.compile(
    r"^(barrier|all-gather) '([^']*)' \(generation (\d+)\) timed out after ([\d.]+) s: "
    r"(\d+) of (\d+) ranks missing: (.*)$"
)
RANK_RE = re.compile(r"^rank (\d+) \((.*)\)$")


def state_of(details: str) -> Tuple[str, Optional[int], Optional[str]]:
    """A RankInfo's text ("host h, pid p, left cleanly, last seen ...") as (state, pid, reason)."""
    pid = re.search(r"\bpid (\d+)", details)
    pid = int(pid.group(1)) if pid else None
    if details == "never connected":
        return "never_connected", None, None
    if "connected but not arrived" in details:
        return "connected", pid, None
    if "left cleanly" in details:
        return "left", pid, None
    m = re.search(r"lost: (.*?)(?:, last seen [\d.]+ s ago)?$", details)
    if m:
        return "lost", pid, m.group(1)
    return "unknown", pid, None


def parse_error(text: str) -> Parsed:
    lines = [ln[len("rallypoint: "):] for ln in text.splitlines() if ln.startswith("rallypoint: ")]
    if not lines:
        return Parsed("other", text=text.strip()[-300:])
    msg = lines[-1]
    m = LOST_RE.match(msg)
    if m:
        state, pid, reason = state_of(m.group(5))
        return Parsed("lost", m.group(1), m.group(2), int(m.group(3)), int(m.group(4)), pid, reason, text=msg)
    m = TIMEOUT_RE.match(msg)
    if m:
        missing, pids = {}, {}
        for item in m.group(7).split("; "):
            rm = RANK_RE.match(item)
            if rm:
                missing[int(rm.group(1))], pids[int(rm.group(1))], _ = state_of(rm.group(2))
            else:
                missing[-1] = item  # unparsable: shows up as a wrong name
        if len(missing) != int(m.group(5)):
            missing[-2] = f"count says {m.group(5)}"
        return Parsed(
            "timeout", m.group(1), m.group(2), int(m.group(3)), waited=float(m.group(4)),
            members=int(m.group(6)), missing=missing, missing_pids=pids, text=msg,
        )
    if "was aborted by" in msg:
        return Parsed("aborted", text=msg)
    if msg.startswith("no reply from the coordinator within"):
        return Parsed("silent", text=msg)
    if "coordinator" in msg or "connection" in msg:
        return Parsed("conn", text=msg)
    return Parsed("other", text=msg)


CODE_OF_KIND = {"timeout": 3, "silent": 3, "lost": 4, "aborted": 5, "conn": 7}
DROPPED = "connection dropped without a clean leave"


# Fault kinds that make a rank fail, by how the coordinator can tell.
DIES = {"kill", "agent"}  # its connection drops: lost at once, "connection dropped"
FREEZES = {"stop", "agent-stop"}  # silent: lost when its lease runs out, "no heartbeat"


class Checker:
    """Checks one run's records against what the README promises."""

    def __init__(self, plan: Plan, d: str, injected: List[Injected], out: Outcome) -> None:
        self.plan, self.d, self.out = plan, d, out
        self.logs = [read_log(f"{d}/rank{r}.log") for r in range(plan.n)]
        # Per rank: (time, kind) of each fault that hit it, so that an error may only
        # name a rank whose fault came before it.
        self.faults: Dict[int, List[Tuple[float, str]]] = {r: [] for r in range(plan.n)}
        for i in injected:
            applied = i.t is not None
            if i.fault.kind == "delay":
                applied = self.logs[i.fault.target].delay is not None
            elif i.fault.kind == "leave":
                applied = self.logs[i.fault.target].leave is not None
            if applied:
                out.effective[i.fault.kind] = out.effective.get(i.fault.kind, 0) + 1
            if i.t is not None and i.fault.kind in DIES | FREEZES:
                for r in i.ranks:
                    self.faults[r].append((i.t, i.fault.kind))
        for r, log in enumerate(self.logs):
            if log.leave:
                self.faults[r].append((log.leave[1], "leave"))

    def failed(self, r: int, t: float) -> List[Tuple[float, str]]:
        """The faults of rank `r` before time `t` (none once it had finished every round)."""
        if self.logs[r].done is not None and self.logs[r].done <= t:
            return []
        return [(ft, k) for ft, k in self.faults[r] if ft < t]

    def agent_fault(self, r: int) -> Optional[Tuple[float, str]]:
        return next(((ft, k) for ft, k in self.faults[r] if k in ("agent", "agent-stop")), None)

    def waiting_at(self, k: int, t: float) -> bool:
        """Rank `k` was certainly connected and waiting in a round at time `t`: inside
        the round long enough to have connected, and nobody had left that round yet."""
        log = self.logs[k]
        for rnd, entered in log.enter.items():
            ex = log.exits.get(rnd)
            if entered + ARRIVAL_SLACK <= t and (ex is None or ex.t > t):
                ended = [lg.exits[rnd].t for lg in self.logs if rnd in lg.exits]
                return not ended or min(ended) > t + 0.05
        return False

    def gen_of(self, rnd: int) -> int:
        return self.plan.ops[:rnd].count(self.plan.ops[rnd - 1])

    def run(self, running: List[int], returncodes, alive: Dict[str, bool]) -> None:
        plan, out = self.plan, self.out
        for name, ok in alive.items():
            if not ok:
                out.add("other", f"the {name} died (see {self.d})")
        first_error: Optional[Tuple[float, Parsed]] = None
        for r in range(plan.n):
            for rnd, ex in sorted(self.logs[r].exits.items()):
                first = self.check_exit(r, rnd, ex)
                if first and (first_error is None or first[0] < first_error[0]):
                    first_error = first
        self.check_ends(running, returncodes)
        # Detection time: from the fault to the first error of a rank it did not hit.
        if first_error is not None:
            t_err, p = first_error
            named = [p.rank] if p.kind == "lost" else [k for k in p.missing if k >= 0]
            causes = [c for k in named if 0 <= k < plan.n for c in self.failed(k, t_err)]
            if causes:
                ft, kind = min(causes)
                out.detections.append((kind, p.kind, t_err - ft))

    def check_exit(self, r: int, rnd: int, ex: Exit) -> Optional[Tuple[float, Parsed]]:
        """Checks one round's outcome at one rank; returns (time, error) of a rank that
        the faults did not hit."""
        plan, out, n, T = self.plan, self.out, self.plan.n, self.plan.timeout
        entered = self.logs[r].enter.get(rnd)
        if entered is None:
            out.add("other", f"rank {r} round {rnd}: an exit without an enter")
            return None
        # A shell's records are /proc/uptime ticks, up to 10 ms before the true time.
        tol = 0.0105 if plan.kinds[r] == "cli" else 0.0
        t = ex.t + tol  # the latest the outcome can have come
        agent = self.agent_fault(r)
        frozen = agent is not None and agent[1] == "agent-stop" and agent[0] < t
        bound = T + (REPLY_MARGIN if frozen else 0.0) + HANG_MARGIN
        took = ex.t - entered
        if took > bound:
            out.add("hangs", f"rank {r} round {rnd}: exit {ex.code} after {took:.2f}s, timeout {T}s")
        if ex.code == 0:
            late = [j for j in range(n) if self.logs[j].enter.get(rnd) is None or self.logs[j].enter[rnd] > t]
            if late:
                out.add("early releases", f"rank {r} passed round {rnd} ({plan.ops[rnd - 1]}) at {ex.t:.3f} "
                        f"before rank(s) {late} entered it")
            if plan.ops[rnd - 1] == "g":
                check_gather(plan, self.d, r, rnd, out)
            return None

        out.overrun = max(out.overrun, took - T)
        path = f"{self.d}/{r}.{rnd}.err"
        p = parse_error(open(path, errors="replace").read() if os.path.exists(path) else "")
        where = f"rank {r} ({plan.kinds[r]}) round {rnd}: exit {ex.code}: {p.text}"
        check_facts(self.d, r, rnd, p, where, out)
        if CODE_OF_KIND.get(p.kind) != ex.code:
            out.add("wrong codes", f"{where} (the README gives {CODE_OF_KIND.get(p.kind, '?')} for this error)")
        if agent is not None and agent[0] < t:
            # Its own agent under it: killed, the connection is lost (7); frozen, no
            # reply comes (3, after the client's margin) or it cannot connect (7).
            allowed = {"conn"} if agent[1] == "agent" else {"conn", "silent"}
            if p.kind not in allowed:
                out.add("wrong codes", f"{where} (its agent was {agent[1]}: expected "
                        f"{' or '.join(sorted(allowed))})")
            return None
        if p.kind not in ("lost", "timeout"):
            out.add("wrong codes", f"{where} (only a timeout or a lost peer is possible here)")
            return None
        want = ("barrier", BARRIER) if plan.ops[rnd - 1] == "b" else ("all-gather", GATHER)
        if (p.op, p.name, p.generation) != (*want, self.gen_of(rnd)):
            out.add("other", f"{where} (expected {want[0]} '{want[1]}' generation {self.gen_of(rnd)})")
        if p.kind == "lost":
            self.check_lost(p, t, where)
        else:
            self.check_timeout(p, r, rnd, t, where)
        return (t, p)

    def check_lost(self, p: Parsed, t: float, where: str) -> None:
        plan, out, k = self.plan, self.out, p.rank
        why = self.failed(k, t) if 0 <= k < plan.n else []
        kinds = {kind for _, kind in why}
        if not why:
            return out.add("wrong names", f"{where} (rank {k} had not failed)")
        if kinds <= {"leave"}:
            return out.add("wrong names", f"{where} (rank {k} left cleanly: not dead)")
        allowed = set()
        if kinds & DIES:
            allowed.add(DROPPED)
        if kinds & FREEZES:
            allowed.add(f"no heartbeat for {plan.lease:.1f} s")
        if p.reason not in allowed:
            out.add("wrong names", f"{where} (rank {k} was {'/'.join(sorted(kinds))}: expected "
                    f"{' or '.join(sorted(allowed))})")
        self.check_pid(k, p.pid, where)

    def check_pid(self, k: int, pid: Optional[int], where: str) -> None:
        """The pid an error shows for rank `k` is its process's (Python) or one of its
        verbs' (CLI; a verb killed before the shell logged its pid is let pass)."""
        log = self.logs[k]
        if self.plan.kinds[k] == "py":
            ok = log.pid is None or pid == log.pid
        else:
            unlogged = any(rnd not in log.exits for rnd in log.enter) and not any(
                pid in lg.pids for lg in self.logs
            )
            ok = pid is None or pid in log.pids or unlogged
        if not ok:
            own = log.pid if self.plan.kinds[k] == "py" else sorted(log.pids)
            self.out.add("wrong names", f"{where} (pid {pid} is not rank {k}'s: {own})")

    def check_timeout(self, p: Parsed, r: int, rnd: int, t: float, where: str) -> None:
        plan, out, T, L = self.plan, self.out, self.plan.timeout, self.plan.lease
        if p.waited is not None and p.waited < T - 0.1:
            out.add("other", f"{where} (timed out before its timeout of {T}s)")
        if p.members != plan.n:
            out.add("other", f"{where} (the collective has {plan.n} members)")
        for k, state in sorted(p.missing.items()):
            if not 0 <= k < plan.n:
                out.add("wrong names", f"{where} (cannot read '{state}')")
                continue
            why = self.failed(k, t)
            if not why:
                entered = self.logs[k].enter.get(rnd)
                if entered is None or entered > t - ARRIVAL_SLACK:
                    # Healthy but not arrived: the machine was too slow for the plan's
                    # margins, not a fault of rallypoint.
                    out.add("other", f"{where} (healthy rank {k} arrived late: harness timing)")
                else:
                    out.add("wrong names", f"{where} (rank {k} is healthy and entered {t - entered:.2f}s before)")
                continue
            allowed = set()
            for ft, kind in why:
                if kind == "leave":
                    allowed |= {"left"}
                    continue
                # Between two verbs a CLI rank holds no connection: it stays "left"
                # (or "never connected" before its first), whatever happens to it.
                if plan.kinds[k] == "cli" and not self.waiting_at(k, ft):
                    allowed |= {"left", "never_connected"}
                # Frozen with a connection: not lost before its lease runs out.
                if kind in FREEZES and t < ft + L + LEASE_SLACK:
                    allowed |= {"connected"}
            if state != "never_connected":
                self.check_pid(k, p.missing_pids.get(k), where)
            if state not in allowed:
                kinds = "/".join(sorted({kind for _, kind in why}))
                out.add("wrong codes", f"{where} (rank {k} was {kinds} ({plan.kinds[k]}): it is {state}, expected "
                        f"{' or '.join(sorted(allowed)) or 'a PeerLost'})")
        # Every failed rank that never came to this round is named.
        for k in range(plan.n):
            if k != r and self.failed(k, t) and k not in p.missing and self.logs[k].enter.get(rnd) is None:
                out.add("wrong names", f"{where} (failed rank {k} never arrived but is not named)")

    def check_ends(self, running: List[int], returncodes) -> None:
        """Each process ended as its faults say."""
        plan, out = self.plan, self.out
        for r in range(plan.n):
            log, rc = self.logs[r], returncodes[r]
            last = max(log.exits.values(), key=lambda e: e.round, default=None)
            if r in running:
                open_round = next((k for k in sorted(log.enter) if k not in log.exits), None)
                what = f"in round {open_round}" if open_round else "outside any round"
                out.add("hangs", f"rank {r} ({plan.kinds[r]}) still running {what} at the run's deadline")
                continue
            finished = log.done if log.done is not None else (last.t if last else None)
            if log.closed is not None and finished is not None and log.closed - finished > LEAVE_WAIT + HANG_MARGIN:
                out.add("hangs", f"rank {r} (py): close() took {log.closed - finished:.2f}s")
            own = [(ft, k) for ft, k in self.faults[r] if k in ("kill", "stop")]
            if own:
                ft, kind = own[0]
                # A kill after the rank's last act (its rounds done, its client closed
                # after a failure, or, for a CLI rank, whose script exits at its first
                # failed verb, that verb's end) may reach a process already exiting on
                # its own.
                ended = log.done if log.done is not None else log.closed
                if ended is None and plan.kinds[r] == "cli" and last is not None and last.code != 0:
                    ended = last.t
                if kind == "kill" and rc != -signal.SIGKILL and not (ended is not None and ended <= ft):
                    out.add("other", f"rank {r} was killed but exited with {rc}")
                continue
            if self.agent_fault(r) is not None and log.done is not None and rc != 0:
                continue  # its agent failed after its last round, while it was leaving
            if log.leave:
                if rc != 0:
                    out.add("other", f"rank {r} left cleanly but exited with {rc}")
                continue
            expected = 0 if log.done is not None else (last.code if last else None)
            if expected is None or rc != expected:
                tail = open(f"{self.d}/rank{r}.stderr", errors="replace").read()[-400:].strip()
                out.add("other", f"rank {r} ({plan.kinds[r]}) exited with {rc}, its log says {expected}: {tail}")
            elif log.done is None and last is not None and last.code == 0:
                out.add("other", f"rank {r} stopped after round {last.round} without an error")


def check_gather(plan: Plan, d: str, r: int, rnd: int, out: Outcome) -> None:
    try:
        got = open(f"{d}/{r}.{rnd}.out").read().splitlines()
    except FileNotFoundError:
        got = None
    want = [f"v{j}.{rnd}" for j in range(plan.n)]
    if got != want:
        out.add("wrong gathers", f"rank {r} round {rnd}: got {got}, expected {want}")


def check_facts(d: str, r: int, rnd: int, p: Parsed, where: str, out: Outcome) -> None:
    """A Python rank's exception attributes say what its message says."""
    path = f"{d}/{r}.{rnd}.json"
    if not os.path.exists(path):
        return
    facts = json.load(open(path))
    wrong = []
    if facts["type"] == "PeerLost":
        if p.kind != "lost" or (facts["rank"], facts["pid"], facts["reason"], facts["generation"]) != (
            p.rank, p.pid, p.reason, p.generation
        ):
            wrong.append(f"PeerLost attributes {facts}")
    elif facts["type"] == "BarrierTimeout":
        states = {int(k): v for k, v in facts["states"].items()}
        if p.kind != "timeout" or states != p.missing or facts["missing_ranks"] != sorted(p.missing):
            wrong.append(f"BarrierTimeout attributes {facts}")
    if wrong:
        out.add("other", f"{where}: {'; '.join(wrong)}")


# ---------------------------------------------------------------------------
# The suite


def percentile(values: List[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]


def main() -> int:
    ap = argparse.ArgumentParser(prog="scripts/chaos", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, required=True, help="how many runs")
    ap.add_argument("--seed", type=int, help="seed of the first run (run i: seed+i) [default: random, printed]")
    ap.add_argument("--max-seconds", type=float, help="start no run that could end after this many seconds")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once [default: 2]")
    ap.add_argument("--keep", action="store_true", help="keep every run's directory (failing runs' are always kept)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every run's plan and outcome")
    ap.add_argument("--faults", default=",".join(FAULT_KINDS),
                    help=f"fault kinds to draw from, comma-separated [default: {','.join(FAULT_KINDS)}]")
    ap.add_argument("--mutate", choices=["codes", "names", "gather", "early"],
                    help="make the CLI ranks misreport (exit 3 for 4, name rank 0, reverse all-gathers, rank 0 "
                         "leaves barriers at once): the run must then fail, which checks the checks")
    args = ap.parse_args()

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    binary = os.path.abspath(os.environ.get("RALLYPOINT_BIN", os.path.join(root, "target", "debug", "rallypoint")))
    if not os.access(binary, os.X_OK):
        print(f"chaos: no rallypoint binary at {binary} (set RALLYPOINT_BIN)", file=sys.stderr)
        return 2
    try:
        import rallypoint  # noqa: F401
    except ImportError as e:
        print(f"chaos: {sys.executable} cannot import the rallypoint package ({e}); set PYTHON", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "big")
    fault_kinds = [k for k in args.faults.split(",") if k]
    unknown = set(fault_kinds) - set(FAULT_KINDS)
    if unknown:
        ap.error(f"unknown fault kind(s): {', '.join(sorted(unknown))}")
    # What to type to run one of these runs again.
    extra = "" if fault_kinds == FAULT_KINDS else f" --faults {','.join(fault_kinds)}"
    extra += f" --mutate {args.mutate}" if args.mutate else ""
    if args.mutate:
        os.environ["CHAOS_MUTATE"] = args.mutate
    print(f"chaos: {args.runs} runs from seed {seed}, {args.jobs} at once, binary {binary}", flush=True)

    t_start = time.monotonic()
    next_run = [0]
    lock = threading.Lock()
    outcomes: List[Outcome] = []
    skipped = [0]

    def worker() -> None:
        while True:
            with lock:
                i = next_run[0]
                if i >= args.runs:
                    return
                plan = make_plan(seed + i, fault_kinds)
                bound = START_LIMIT + plan.deadline() + 15  # start, the run, teardown
                if args.max_seconds is not None and time.monotonic() - t_start + bound > args.max_seconds:
                    skipped[0] = args.runs - i
                    next_run[0] = args.runs
                    return
                next_run[0] += 1
            o = run_plan(plan, binary, sys.executable, args.keep)
            with lock:
                outcomes.append(o)
                if o.violations:
                    print(f"FAIL seed {plan.seed}: {plan.describe()}", flush=True)
                    for cat, items in o.violations.items():
                        for item in items:
                            print(f"  {cat}: {item}")
                    print(f"  records: {o.dir}")
                    print(f"  reproduce: scripts/chaos --runs 1 --seed {plan.seed}{extra}", flush=True)
                elif args.verbose:
                    print(f"ok seed {plan.seed} ({o.seconds:.1f}s): {plan.describe()}", flush=True)
                if len(outcomes) % 50 == 0:
                    bad = sum(1 for x in outcomes if x.violations)
                    print(f"chaos: {len(outcomes)} runs, {bad} failing, {time.monotonic() - t_start:.0f}s", flush=True)

    def interrupted(signum, frame):
        PROCS.end_all()
        sys.exit(130)

    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, args.jobs))]
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads):
            time.sleep(0.2)
    finally:
        PROCS.end_all()
    report(outcomes, seed, skipped[0], time.monotonic() - t_start, extra)
    return 1 if any(o.violations for o in outcomes) or not outcomes else 0


def report(outcomes: List[Outcome], seed: int, skipped: int, seconds: float, extra: str) -> None:
    failing = [o for o in outcomes if o.violations]
    print()
    print(f"| runs | {' | '.join(CATEGORIES)} |")
    print(f"|---:|{'---:|' * len(CATEGORIES)}")
    counts = [sum(1 for o in outcomes if c in o.violations) for c in CATEGORIES]
    print(f"| {len(outcomes)} | {' | '.join(str(c) for c in counts)} |")
    print("(runs with at least one violation of each kind)")
    print()
    kinds = FAULT_KINDS
    effective = {k: sum(o.effective.get(k, 0) for o in outcomes) for k in kinds}
    planned = {k: sum(1 for o in outcomes for f in o.plan.faults if f.kind == k) for k in kinds}
    control = sum(1 for o in outcomes if not o.plan.faults)
    print(f"faults that hit a running rank or agent (of planned): "
          + ", ".join(f"{k} {effective[k]} ({planned[k]})" for k in kinds) + f"; {control} runs without faults")
    print()
    print("| fault | first survivor's error | runs | p50 s | max s |")
    print("|---|---|---:|---:|---:|")
    by: Dict[Tuple[str, str], List[float]] = {}
    for o in outcomes:
        for kind, err, secs in o.detections:
            by.setdefault((kind, err), []).append(secs)
    for (kind, err), v in sorted(by.items()):
        label = {"lost": "PeerLost (4)", "timeout": "timeout (3)"}.get(err, err)
        print(f"| {kind} | {label} | {len(v)} | {percentile(v, 0.5):.2f} | {max(v):.2f} |")
    overruns = [o.overrun for o in outcomes if o.overrun != float("-inf")]
    if overruns:
        print(f"\nlongest failed operation beyond its timeout: {max(overruns):+.2f} s (hang margin {HANG_MARGIN} s)")
    print(f"\n{len(outcomes)} runs in {seconds:.0f} s (seeds {seed}..{seed + len(outcomes) + skipped - 1}), "
          f"{len(failing)} failing" + (f"; {skipped} not started (--max-seconds)" if skipped else ""))
    for o in failing:
        print(f"  failing seed {o.plan.seed}: scripts/chaos --runs 1 --seed {o.plan.seed}{extra}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "_rank":
        python_rank(json.loads(sys.argv[2]))
    else:
        sys.exit(main())
