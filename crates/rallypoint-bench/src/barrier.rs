//! `rallypoint bench barrier`: N clients in one barrier, R rounds; or, with
//! `--op ping`, the same rounds of plain round trips through the same server; or,
//! with `--op floor`, the kernel's floor under both, with no server at all (module
//! `floor`). Over the native protocol or torch's TCPStore protocol (its BARRIER
//! request), from one process or spread over `--procs` child processes. Reports the
//! CPU the server and the load generator spent per rank and round, so that a
//! figure bound by the load generator shows as such.

use std::ops::Range;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use rallypoint_client::{blocking, Client, Identity, Members};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::task::JoinSet;

use crate::bare::BareConn;
use crate::tcpstore::{self, StoreConn};
use crate::{
    close_all, connect_bounded, connect_many, connect_within, ensure_fds, floor, mono_ns, on_target, options,
    print_report, process_cpu_ns, raw, round_stats, run_rounds, wake_floor, BarrierRound, CpuWindow, Protocol, Round,
    Sources, Target, TcpCounts, Times,
};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Clients, each with its own connection, all in the one barrier
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    clients: u32,
    /// Measured rounds
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Unmeasured rounds before them
    #[arg(long, default_value_t = 5)]
    warmup: u32,
    /// Seconds one round (and connecting one client) may take before the benchmark fails
    #[arg(long, value_name = "SECS", default_value = "120", value_parser = crate::secs)]
    timeout: f64,
    /// Print one JSON object instead of text
    #[arg(long)]
    json: bool,
    /// Benchmark the server at this address instead of starting a coordinator (then
    /// no server memory is reported); with `--protocol tcpstore` it may be torch's
    #[arg(long, value_name = "HOST:PORT")]
    addr: Option<String>,
    /// What each client does per round: `barrier`; `ping` (one round trip each, not
    /// held in step: the cost of N requests and N replies through the server); or
    /// `floor` (no server: N bare sockets, N 16-byte arrivals read through epoll, then
    /// N releases; the kernel's floor under a barrier round); or `wake-floor` (no
    /// server, no sockets: `--procs` rank processes counting themselves in one shared
    /// word and woken by one futex wake; the floor under a barrier of processes)
    #[arg(long, value_enum, default_value_t = Op::Barrier)]
    op: Op,
    /// The pid of the server at `--addr`, to report its CPU per rank and round (a
    /// server this benchmark starts is measured without it)
    #[arg(long, value_name = "PID")]
    server_pid: Option<u32>,
    /// Wire protocol: `native` (rallypoint's barrier), or `tcpstore` (torch's BARRIER
    /// request, type 18, on a new key each round; `--op ping` sends PING)
    #[arg(long, value_enum, default_value_t = Protocol::Native)]
    protocol: Protocol,
    /// Load-generator processes to spread the clients over (children of this one, each
    /// with its own file-descriptor limit; keep clients / procs below that limit, with
    /// some to spare)
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=4096))]
    procs: u32,
    /// Loopback source addresses to bind clients to (127.0.0.2, 127.0.0.3, ...), each
    /// with its own ephemeral ports; default: as many as the clients need (none while
    /// they fit in 90 % of the ephemeral port range), 0 = never bind. `--protocol tcpstore` or `--bare` only
    #[arg(long, value_name = "K")]
    src_addrs: Option<u32>,
    /// Native barrier clients without the client library: one task and its buffers
    /// per socket, no heartbeats (rounds must come within the coordinator's lease), no
    /// resume. The baseline for what the library costs per call: compare
    /// with the same run without `--bare`. Native protocol, `--op barrier`, one process
    #[arg(long)]
    bare: bool,
    /// Barrier clients that cost what the floor's do (`--op floor`): a thread per
    /// core with epoll over its share of the sockets, no runtime, no client library,
    /// no heartbeats. The round against the floor's is then what the server costs
    /// over one that only reads and writes. Native or TCPStore (against torch's server
    /// too), `--op barrier`, one process
    #[arg(long, conflicts_with = "bare")]
    raw: bool,
    /// Native clients are the blocking client, each on its own thread (as a rank
    /// process using the Python package has it), instead of async tasks; needs `--procs`
    #[arg(long)]
    blocking: bool,
    /// Before the rounds, every client passes K barriers, each named afresh and
    /// called once, as a job that names a barrier per step does (through a node
    /// agent: whether they use up its barrier channels). Native client library,
    /// `--op barrier`
    #[arg(long, value_name = "K", default_value_t = 0)]
    names_before: u32,
    /// Internal: run as child I of `--procs`, with the clients it owns
    #[arg(long, value_name = "I", hide = true)]
    shard: Option<u32>,
    /// Internal: the job (native) or key prefix (tcpstore) that the children share
    #[arg(long, hide = true)]
    job: Option<String>,
    /// Internal: run as the serving process of `--op floor`
    #[arg(long, hide = true)]
    serve_floor: bool,
    /// Internal: run as a rank process of `--op wake-floor`, on this shared file
    #[arg(long, value_name = "PATH", hide = true)]
    wake_child: Option<std::path::PathBuf>,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Op {
    Barrier,
    Ping,
    Floor,
    #[serde(rename = "wake-floor")]
    WakeFloor,
}

#[derive(Debug, Serialize)]
struct Report {
    op: Op,
    /// `None` for `--op floor`, which speaks no protocol.
    protocol: Option<Protocol>,
    clients: u32,
    procs: u32,
    /// Loopback source addresses bound (0: the kernel's choice).
    src_addrs: u32,
    rounds: u32,
    warmup_rounds: u32,
    /// Native clients were blocking clients on threads of their own.
    blocking: bool,
    /// Native clients spoke the protocol directly, without the client library.
    bare: bool,
    /// ... from the floor's client threads (`--raw`).
    raw: bool,
    /// Barriers named afresh that every client passed before the rounds (`--names-before`).
    names_before: u32,
    /// ... and their mean time each, in ms (`None` without them).
    names_before_ms_each: Option<f64>,
    #[serde(flatten)]
    round: Times,
    connect_ms: f64,
    /// The server's resident memory with one client connected (none connected with
    /// `--procs` > 1).
    server_rss_one_conn_bytes: Option<u64>,
    /// ... and with all clients connected and idle.
    server_rss_idle_bytes: Option<u64>,
    /// The difference per connection after the first.
    server_rss_per_conn_bytes: Option<u64>,
    /// CPU (user + system) the server process spent per rank and round, over all
    /// rounds (warm-up included); for `--op floor`, its serving thread's. `None` for a
    /// server given by `--addr` without `--server-pid`.
    server_cpu_us_per_rank_round: Option<f64>,
    /// ... and the load-generator processes together (for `--op floor`, the client
    /// threads together), over the same rounds.
    client_cpu_us_per_rank_round: Option<f64>,
    /// The server's CPU per rank and round over the measured rounds alone (see
    /// `CpuWindow`): what one more round costs. Barrier rounds from one load process
    /// after at least one warm-up round, or `--op floor`; else `None`.
    server_cpu_us_per_measured_rank_round: Option<f64>,
    /// ... and the load generator's.
    client_cpu_us_per_measured_rank_round: Option<f64>,
    /// TCP segments sent per rank and round over the measured rounds (as the CPU
    /// above), by every socket of the network namespace: two carry the arrival and
    /// the release, the rest are pure ACKs. Only this run's inside the loopback-only
    /// namespace of `scripts/compare-torch`; elsewhere other traffic counts too.
    /// `None` where the window or `/proc/net` is missing.
    tcp_segments_per_measured_rank_round: Option<f64>,
    /// ... of them, pure ACKs (segments without data) ...
    tcp_pure_acks_per_measured_rank_round: Option<f64>,
    /// ... and of those, sent by the delayed-ACK timer.
    tcp_delayed_acks_per_measured_rank_round: Option<f64>,
}

/// What a child load generator reports to its parent.
#[derive(Debug, Serialize, Deserialize)]
struct ShardReport {
    start_ns: u64,
    round_end_ns: Vec<u64>,
    connect_ms: f64,
    /// How long its clients took to pass the `--names-before` barriers.
    names_before_ms: f64,
    /// CPU this process spent on its rounds.
    cpu_ns: u64,
}

/// A shard's line on stdout once its clients are connected; it then waits for a
/// line on stdin before starting, so that all shards start together.
const READY: &str = "ready";

pub async fn run(args: Args) -> anyhow::Result<()> {
    if args.bare && (args.protocol != Protocol::Native || args.procs > 1 || args.op != Op::Barrier) {
        bail!("--bare is for native barrier rounds from one process (no --procs, --op barrier)");
    }
    if args.raw && (args.procs > 1 || args.op != Op::Barrier) {
        bail!("--raw is for barrier rounds from one process (no --procs, --op barrier)");
    }
    if args.op == Op::Floor {
        return run_floor(&args).await;
    }
    if args.op == Op::WakeFloor {
        return run_wake_floor(&args).await;
    }
    let sources = Sources::plan(args.src_addrs, args.clients);
    if args.protocol == Protocol::Native && !args.bare && sources.addrs > 0 {
        bail!(
            "{} clients need {} source addresses, which the native client library cannot bind; \
             use --protocol tcpstore or --bare",
            args.clients,
            sources.addrs
        );
    }
    // Each client is one socket; some slack for the runtime and stdio.
    ensure_fds(u64::from(args.clients.div_ceil(args.procs)) + 64)?;
    if args.blocking && (args.protocol != Protocol::Native || args.procs == 1) {
        bail!("--blocking is for native clients spread over --procs processes");
    }
    if args.names_before > 0 && (args.protocol != Protocol::Native || args.bare || args.op != Op::Barrier) {
        bail!("--names-before is for barrier rounds of the native client library (no --bare, --op barrier)");
    }
    if let Some(shard) = args.shard {
        return run_shard(&args, shard, sources).await;
    }
    let report = on_target(args.addr.clone(), async |target| {
        if args.raw {
            measure_raw(&args, target, sources).await
        } else if args.procs == 1 {
            measure(&args, target, sources).await
        } else {
            measure_procs(&args, target, sources).await
        }
    })
    .await?;
    print_report(&report, args.json, print_text)
}

/// The clients of one load-generator process.
enum Clients {
    Native(Vec<Client>),
    Bare(Vec<BareConn>),
    Store(Vec<StoreConn>),
}

impl Clients {
    fn extend(&mut self, more: Clients) {
        match (self, more) {
            (Clients::Native(a), Clients::Native(b)) => a.extend(b),
            (Clients::Bare(a), Clients::Bare(b)) => a.extend(b),
            (Clients::Store(a), Clients::Store(b)) => a.extend(b),
            _ => unreachable!("one process speaks one protocol"),
        }
    }

    async fn close(self) {
        match self {
            Clients::Native(clients) => close_all(clients).await,
            // A TCPStore client just disconnects: torch's never says goodbye either.
            Clients::Store(conns) => drop(conns),
            Clients::Bare(conns) => {
                // Concurrently, as the library's clients close. A failed leave only
                // leaves a rank for the coordinator to count as lost.
                let mut leaving: JoinSet<_> = conns.into_iter().map(BareConn::leave).collect();
                while leaving.join_next().await.is_some() {}
            }
        }
    }
}

/// What the clients of `args` share: the server, the job and the timeout.
struct Setup<'a> {
    args: &'a Args,
    addr: &'a str,
    job: &'a str,
    sources: Sources,
    timeout: Duration,
}

impl Setup<'_> {
    async fn connect(&self, ranks: Range<u32>) -> anyhow::Result<Clients> {
        let n = self.args.clients;
        Ok(match self.args.protocol {
            Protocol::Native if self.args.bare => {
                let addr = tcpstore::resolve(self.addr)?;
                let timeout = self.timeout;
                Clients::Bare(
                    connect_bounded(ranks, |rank| {
                        let (identity, source) = (Identity::ranked(self.job, rank, n), self.sources.of(rank));
                        let what = format!("connecting bare native client {rank}");
                        connect_within(timeout, what, BareConn::connect(addr, source, identity))
                    })
                    .await?,
                )
            }
            Protocol::Native => Clients::Native(
                connect_many(ranks, |rank| options(self.addr, Identity::ranked(self.job, rank, n), self.timeout))
                    .await?,
            ),
            Protocol::Tcpstore => Clients::Store(
                tcpstore::connect_many(tcpstore::resolve(self.addr)?, ranks, self.sources, self.timeout).await?,
            ),
        })
    }

    /// Runs warm-up and measured rounds; returns when each round's last client was released.
    async fn rounds(&self, clients: Clients, window: Option<Arc<CpuWindow>>) -> (Clients, anyhow::Result<Vec<u64>>) {
        let total = (self.args.warmup + self.args.rounds) as usize;
        let (op, n, timeout) = (self.args.op, self.args.clients, self.timeout);
        match clients {
            Clients::Native(clients) => {
                let (clients, ends) = match op {
                    Op::Barrier => {
                        run_rounds(clients, total, Arc::new(BarrierRound { name: "bench", timeout }), window).await
                    }
                    Op::Ping => run_rounds(clients, total, Arc::new(PingRound), window).await,
                    Op::Floor | Op::WakeFloor => {
                        unreachable!("the floors run without a server (run_floor, run_wake_floor)")
                    }
                };
                (Clients::Native(clients), ends)
            }
            Clients::Bare(conns) => {
                // The coordinator answers each round by the barrier's timeout. Should it
                // not, the whole run is bounded here rather than each call by a timer of
                // its own, which would cost every call a timer the library does not pay.
                let limit = (timeout + Duration::from_secs(5)) * (self.args.warmup + self.args.rounds);
                let rounds = run_rounds(conns, total, Arc::new(BareRound { name: "bench", timeout }), window);
                match tokio::time::timeout(limit, rounds).await {
                    Ok((conns, ends)) => (Clients::Bare(conns), ends),
                    Err(_) => {
                        (Clients::Bare(Vec::new()), Err(anyhow::anyhow!("the rounds did not end within {limit:?}")))
                    }
                }
            }
            Clients::Store(conns) => {
                // BARRIER's counter never resets: every round needs its own key.
                let round = StoreRound { prefix: format!("/rpbench/{}/", self.job), op, n, timeout };
                let (conns, ends) = run_rounds(conns, total, Arc::new(round), window).await;
                (Clients::Store(conns), ends)
            }
        }
    }
}

/// Each round is one native barrier `name` of the whole job, spoken directly.
struct BareRound {
    name: &'static str,
    timeout: Duration,
}

impl Round<BareConn> for BareRound {
    async fn round(&self, conn: &mut BareConn, _: usize) -> anyhow::Result<()> {
        conn.barrier(self.name, self.timeout).await
    }
}

/// Each round is one native ping.
struct PingRound;

impl Round<Client> for PingRound {
    async fn round(&self, client: &mut Client, _: usize) -> anyhow::Result<()> {
        Ok(client.ping().await?)
    }
}

/// Each round is one TCPStore BARRIER (on key `prefix` and the round) or PING.
struct StoreRound {
    prefix: String,
    op: Op,
    n: u32,
    timeout: Duration,
}

impl Round<StoreConn> for StoreRound {
    async fn round(&self, conn: &mut StoreConn, r: usize) -> anyhow::Result<()> {
        let done = async {
            match self.op {
                Op::Barrier => conn.barrier(&format!("{}{r}", self.prefix), self.n).await,
                Op::Ping => conn.ping().await,
                Op::Floor | Op::WakeFloor => {
                    unreachable!("the floors run without a server (run_floor, run_wake_floor)")
                }
            }
        };
        tokio::time::timeout(self.timeout, done).await.context("timed out")?
    }
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e4).round() / 10.0
}

async fn measure(args: &Args, target: &Target, sources: Sources) -> anyhow::Result<Report> {
    let n = args.clients;
    let job = format!("bench-barrier-{}", std::process::id());
    let setup = Setup { args, addr: &target.addr, job: &job, sources, timeout: Duration::from_secs_f64(args.timeout) };
    // Settles a moment, so the server has admitted everyone and is idle.
    let settle = || tokio::time::sleep(Duration::from_millis(500));

    if !args.json {
        eprintln!("connecting {n} clients to {} ...", target.addr);
    }
    // The first connection also pays one-off costs (the job's state, the runtime's
    // threads touching their stacks): weigh the server after it, not before.
    let started = Instant::now();
    let mut clients = setup.connect(0..1).await?;
    let mut connecting = started.elapsed();
    settle().await;
    let rss_before = target.server_rss();
    let started = Instant::now();
    clients.extend(setup.connect(1..n).await?);
    connecting += started.elapsed();
    settle().await;
    let rss_idle = target.server_rss();
    let names_before_ms = names_before(&clients, args.names_before, setup.timeout).await?;

    if !args.json {
        eprintln!("running {} rounds (+{} warm-up) ...", args.rounds, args.warmup);
    }
    let server_pid = target.server_pid().or(args.server_pid);
    let cpu = CpuMeter::start(server_pid);
    let start = mono_ns();
    // Pings do not move in step: no window (see `CpuWindow`).
    let window = CpuWindow::new(server_pid, args.warmup as usize, (args.warmup + args.rounds) as usize)
        .filter(|_| args.op == Op::Barrier)
        .map(Arc::new);
    let (clients, ends) = setup.rounds(clients, window.clone()).await;
    let (server_cpu, client_cpu) = cpu.stop();
    clients.close().await;
    let ends = ends.context("a barrier round failed")?;
    let per_conn = match (rss_before, rss_idle) {
        (Some(before), Some(idle)) if n > 1 => Some(idle.saturating_sub(before) / u64::from(n - 1)),
        _ => None,
    };
    let mut report = report(args, sources, start, &ends, ms(connecting), (rss_before, rss_idle, per_conn))?;
    report.set_cpu(server_cpu, client_cpu);
    if let Some(window) = window {
        report.set_measured_cpu(window.spent(), window.rounds());
        report.set_measured_tcp(window.tcp_spent(), window.rounds());
    }
    report.set_names_before(names_before_ms);
    Ok(report)
}

/// `--raw`: the rounds of [`measure`], from the floor's client threads (module `raw`).
async fn measure_raw(args: &Args, target: &Target, sources: Sources) -> anyhow::Result<Report> {
    let n = args.clients;
    let job = format!("bench-barrier-{}", std::process::id());
    let addr = tcpstore::resolve(&target.addr)?;
    let timeout = Duration::from_secs_f64(args.timeout);
    let server_pid = target.server_pid().or(args.server_pid);
    let (warmup, total) = (args.warmup as usize, (args.warmup + args.rounds) as usize);
    let protocol = args.protocol;
    if !args.json {
        eprintln!("connecting {n} raw {} clients to {addr} ...", protocol_name(protocol));
    }
    let (times, connecting, server_before) = tokio::task::spawn_blocking(move || {
        let started = Instant::now();
        let conns = (0..n)
            .map(|rank| {
                let (source, what) = (sources.of(rank), || format!("connecting raw client {rank}"));
                match protocol {
                    Protocol::Native => raw::connect(addr, source, Identity::ranked(&job, rank, n), timeout),
                    Protocol::Tcpstore => raw::connect_store(addr, source, timeout),
                }
                .with_context(what)
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let connecting = started.elapsed();
        // Settles a moment, so the server has admitted everyone and is idle.
        std::thread::sleep(Duration::from_millis(500));
        let sample = server_pid.map(|pid| Box::new(move || (process_cpu_ns(Some(pid)), TcpCounts::read())) as _);
        let server_before = server_pid.and_then(|pid| process_cpu_ns(Some(pid)));
        let rounds = (warmup, total);
        let times = match protocol {
            Protocol::Native => {
                floor::run_clients(conns, |share| raw::Native::new(share, "bench", timeout), rounds, timeout, sample)
            }
            // BARRIER's counter never resets: every round needs its own key.
            Protocol::Tcpstore => {
                let prefix = format!("/rpbench/{job}/raw/");
                floor::run_clients(conns, |share| raw::Store::new(share, &prefix, n), rounds, timeout, sample)
            }
        };
        times.map(|times| (times, connecting, server_before))
    })
    .await??;
    let mut report = report(args, sources, times.start_ns, &times.round_end_ns, ms(connecting), (None, None, None))?;
    let [from, to, end] = match times.sampled {
        Some(sampled) => sampled.map(Some),
        None => [None, None, None],
    };
    let server_all = server_before.zip(end.and_then(|(cpu, _)| cpu)).map(|(at, end)| end.saturating_sub(at));
    report.set_cpu(server_all, Some(times.cpu_ns));
    // As `CpuWindow`: the window needs a warm-up round before it.
    if let (Some((server_from, tcp_from)), Some((server_to, tcp_to)), true) = (from, to, args.warmup > 0) {
        let server = server_from.zip(server_to).map(|(from, to)| to.saturating_sub(from));
        report.set_measured_cpu((server, Some(times.measured_cpu_ns)), args.rounds as usize);
        report.set_measured_tcp(tcp_to.zip(tcp_from).map(|(to, from)| to.since(from)), args.rounds as usize);
    }
    Ok(report)
}

/// CPU spent by the server process (if its pid is known) and by this one, from
/// [`CpuMeter::start`] to [`CpuMeter::stop`].
struct CpuMeter {
    server: Option<(u32, u64)>,
    client: Option<u64>,
}

impl CpuMeter {
    fn start(server_pid: Option<u32>) -> CpuMeter {
        let server = server_pid.and_then(|pid| Some((pid, process_cpu_ns(Some(pid))?)));
        CpuMeter { server, client: process_cpu_ns(None) }
    }

    /// (server, this process) in ns.
    fn stop(self) -> (Option<u64>, Option<u64>) {
        let server = self.server.and_then(|(pid, at)| Some(process_cpu_ns(Some(pid))?.saturating_sub(at)));
        let client = self.client.and_then(|at| Some(process_cpu_ns(None)?.saturating_sub(at)));
        (server, client)
    }
}

impl Report {
    /// Sets the mean time of a `--names-before` barrier from their total, `ms`.
    fn set_names_before(&mut self, ms: f64) {
        self.names_before_ms_each =
            (self.names_before > 0).then(|| (ms / f64::from(self.names_before) * 1e3).round() / 1e3);
    }

    /// Sets the CPU figures from the ns spent over all rounds.
    fn set_cpu(&mut self, server_ns: Option<u64>, client_ns: Option<u64>) {
        let per = self.per_rank_round((self.rounds + self.warmup_rounds) as usize);
        self.server_cpu_us_per_rank_round = server_ns.map(per);
        self.client_cpu_us_per_rank_round = client_ns.map(per);
    }

    /// Sets the CPU figures of the measured rounds alone: (server, load) ns over `rounds`.
    fn set_measured_cpu(&mut self, (server_ns, client_ns): (Option<u64>, Option<u64>), rounds: usize) {
        let per = self.per_rank_round(rounds);
        self.server_cpu_us_per_measured_rank_round = server_ns.map(per);
        self.client_cpu_us_per_measured_rank_round = client_ns.map(per);
    }

    /// Sets the TCP figures of the measured rounds from the segments sent over `rounds`.
    fn set_measured_tcp(&mut self, tcp: Option<TcpCounts>, rounds: usize) {
        let Some(tcp) = tcp else { return };
        let rank_rounds = f64::from(self.clients) * rounds as f64;
        let per = |count: u64| Some((count as f64 / rank_rounds * 1e3).round() / 1e3);
        self.tcp_segments_per_measured_rank_round = per(tcp.segments);
        self.tcp_pure_acks_per_measured_rank_round = per(tcp.segments.saturating_sub(tcp.data_segments));
        self.tcp_delayed_acks_per_measured_rank_round = per(tcp.delayed_acks);
    }

    /// ns spent over `rounds` (at least one: `--rounds` is) to µs per rank and
    /// round, with three decimals.
    fn per_rank_round(&self, rounds: usize) -> impl Fn(u64) -> f64 + Copy {
        let rank_rounds = f64::from(self.clients) * rounds as f64;
        move |ns| (ns as f64 / rank_rounds).round() / 1e3
    }
}

fn report(
    args: &Args,
    sources: Sources,
    start_ns: u64,
    round_end_ns: &[u64],
    connect_ms: f64,
    (one, idle, per_conn): (Option<u64>, Option<u64>, Option<u64>),
) -> anyhow::Result<Report> {
    // Pinging clients are not held in step, so a ping round is the throughput-bound
    // floor of a barrier round: the same N requests and N replies, without the waiting.
    let stats = round_stats(start_ns, round_end_ns, args.warmup as usize).context("no rounds measured")?;
    Ok(Report {
        op: args.op,
        protocol: Some(args.protocol),
        clients: args.clients,
        procs: args.procs,
        src_addrs: sources.addrs,
        rounds: args.rounds,
        warmup_rounds: args.warmup,
        blocking: args.blocking,
        bare: args.bare,
        raw: args.raw,
        names_before: args.names_before,
        names_before_ms_each: None,
        round: stats.times,
        connect_ms,
        server_rss_one_conn_bytes: one,
        server_rss_idle_bytes: idle,
        server_rss_per_conn_bytes: per_conn,
        server_cpu_us_per_rank_round: None,
        client_cpu_us_per_rank_round: None,
        server_cpu_us_per_measured_rank_round: None,
        client_cpu_us_per_measured_rank_round: None,
        tcp_segments_per_measured_rank_round: None,
        tcp_pure_acks_per_measured_rank_round: None,
        tcp_delayed_acks_per_measured_rank_round: None,
    })
}

/// Ranks `[lo, hi)` owned by shard `i` of `procs`.
fn shard_ranks(n: u32, procs: u32, i: u32) -> Range<u32> {
    let per = n.div_ceil(procs);
    (i * per).min(n)..((i + 1) * per).min(n)
}

/// A child: connects its share of the clients, says it is ready, waits for the
/// parent's go, runs the rounds and prints a [`ShardReport`].
async fn run_shard(args: &Args, shard: u32, sources: Sources) -> anyhow::Result<()> {
    let addr = args.addr.as_deref().context("a shard needs --addr")?;
    let job = args.job.as_deref().context("a shard needs --job")?;
    let timeout = Duration::from_secs_f64(args.timeout);
    if args.blocking {
        return run_blocking_shard(args, shard, addr, job, timeout).await;
    }
    let setup = Setup { args, addr, job, sources, timeout };
    let started = Instant::now();
    let clients = setup.connect(shard_ranks(args.clients, args.procs, shard)).await?;
    let connect_ms = ms(started.elapsed());
    let names_before_ms = names_before(&clients, args.names_before, timeout).await?;
    ready_then_go(timeout).await?;
    let cpu = CpuMeter::start(None);
    let start_ns = mono_ns();
    let (clients, ends) = setup.rounds(clients, None).await;
    let (_, cpu_ns) = cpu.stop();
    clients.close().await;
    let round_end_ns = ends?;
    let cpu_ns = cpu_ns.unwrap_or(0);
    let report = ShardReport { start_ns, round_end_ns, connect_ms, names_before_ms, cpu_ns };
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

/// Every client passes `k` barriers named afresh (`--names-before`), all together;
/// returns how long they took, in ms (0 for clients other than the library's,
/// which the flag is refused for).
async fn names_before(clients: &Clients, k: u32, timeout: Duration) -> anyhow::Result<f64> {
    let Clients::Native(clients) = clients else { return Ok(0.0) };
    let started = Instant::now();
    for i in 0..k {
        let name = format!("once-{i}");
        let mut passing: JoinSet<_> = clients
            .iter()
            .map(|client| {
                let (client, name) = (client.clone(), name.clone());
                async move { client.barrier(&name, Members::World, Some(timeout)).await }
            })
            .collect();
        while let Some(passed) = passing.join_next().await {
            passed?.with_context(|| format!("barrier {name}"))?;
        }
    }
    Ok(started.elapsed().as_secs_f64() * 1e3)
}

/// [`names_before`] for blocking clients, each on a thread of its own.
fn names_before_blocking(clients: &[blocking::Client], k: u32, timeout: Duration) -> anyhow::Result<f64> {
    let started = Instant::now();
    let threads: Vec<_> = clients
        .iter()
        .cloned()
        .map(|client| {
            std::thread::spawn(move || {
                (0..k).try_for_each(|i| {
                    client
                        .barrier(&format!("once-{i}"), Members::World, Some(timeout))
                        .with_context(|| format!("barrier once-{i}"))
                })
            })
        })
        .collect();
    for thread in threads {
        thread.join().map_err(|_| anyhow::anyhow!("a client thread panicked"))??;
    }
    Ok(started.elapsed().as_secs_f64() * 1e3)
}

/// A child's clients are connected: tells the parent, and waits for its go (so that
/// every child's first round starts together).
async fn ready_then_go(timeout: Duration) -> anyhow::Result<()> {
    println!("{READY}");
    let mut go = String::new();
    let mut stdin = BufReader::new(tokio::io::stdin());
    tokio::time::timeout(timeout, stdin.read_line(&mut go)).await.context("no go from the parent")??;
    Ok(())
}

/// A child with `--blocking`: as [`run_shard`], each client a blocking client
/// whose rounds run on a thread of its own.
async fn run_blocking_shard(args: &Args, shard: u32, addr: &str, job: &str, timeout: Duration) -> anyhow::Result<()> {
    let (n, total, op) = (args.clients, (args.warmup + args.rounds) as usize, args.op);
    let ranks = shard_ranks(n, args.procs, shard);
    let (addr, job) = (addr.to_owned(), job.to_owned());
    let started = Instant::now();
    let clients = tokio::task::spawn_blocking(move || {
        ranks
            .map(|rank| blocking::Client::connect_with(options(&addr, Identity::ranked(&job, rank, n), timeout)))
            .collect::<Result<Vec<_>, _>>()
    })
    .await??;
    let connect_ms = ms(started.elapsed());
    let (k, clients) = (args.names_before, clients);
    let (names_before_ms, clients) = tokio::task::spawn_blocking(move || {
        let ms = names_before_blocking(&clients, k, timeout);
        (ms, clients)
    })
    .await?;
    let names_before_ms = names_before_ms?;
    ready_then_go(timeout).await?;
    let cpu = CpuMeter::start(None);
    let start_ns = mono_ns();
    let threads: Vec<_> = clients
        .into_iter()
        .map(|client| {
            std::thread::spawn(move || {
                let mut released = Vec::with_capacity(total);
                for r in 0..total {
                    match op {
                        Op::Barrier => client.barrier("bench", Members::World, Some(timeout)),
                        Op::Ping => client.ping(),
                        // Refused with --procs before any shard starts.
                        Op::Floor | Op::WakeFloor => {
                            Err(rallypoint_client::Error::Protocol("the floors have no clients".into()))
                        }
                    }
                    .with_context(|| format!("round {r}"))?;
                    released.push(mono_ns());
                }
                client.close()?;
                anyhow::Ok(released)
            })
        })
        .collect();
    let round_end_ns = tokio::task::spawn_blocking(move || {
        let mut ends = vec![0u64; total];
        for thread in threads {
            let released = thread.join().map_err(|_| anyhow::anyhow!("a client thread panicked"))??;
            for (end, at) in ends.iter_mut().zip(released) {
                *end = (*end).max(at);
            }
        }
        anyhow::Ok(ends)
    })
    .await??;
    let cpu_ns = cpu.stop().1.unwrap_or(0);
    let report = ShardReport { start_ns, round_end_ns, connect_ms, names_before_ms, cpu_ns };
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

/// The parent of `--procs` children: starts them, waits until all have connected,
/// starts them together and merges their round ends (a round ends when its last
/// client, in whichever process, is released).
async fn measure_procs(args: &Args, target: &Target, sources: Sources) -> anyhow::Result<Report> {
    let job = format!("bench-barrier-{}", std::process::id());
    let timeout = Duration::from_secs_f64(args.timeout);
    let rss_before = target.server_rss();
    let started = Instant::now();
    let mut children = Vec::new();
    for shard in 0..args.procs {
        let mut command = crate::bench_child(&["barrier", "--addr", &target.addr, "--job", &job, "--json"])?;
        command
            .args(["--clients", &args.clients.to_string(), "--procs", &args.procs.to_string()])
            .args(["--shard", &shard.to_string(), "--rounds", &args.rounds.to_string()])
            .args(["--warmup", &args.warmup.to_string(), "--timeout", &args.timeout.to_string()])
            .args(["--src-addrs", &sources.addrs.to_string()])
            .args(["--op", op_name(args.op), "--protocol", protocol_name(args.protocol)])
            .args(args.blocking.then_some("--blocking"))
            .args(["--names-before", &args.names_before.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true);
        let mut child = command.spawn().context("starting a load-generator process")?;
        let stdin = child.stdin.take().context("child stdin")?;
        let stdout = BufReader::new(child.stdout.take().context("child stdout")?);
        children.push((child, stdin, stdout));
    }
    let mut line = String::new();
    for (i, (_, _, stdout)) in children.iter_mut().enumerate() {
        line.clear();
        tokio::time::timeout(timeout, stdout.read_line(&mut line))
            .await
            .with_context(|| format!("load generator {i} did not connect its clients in time"))??;
        ensure!(line.trim() == READY, "load generator {i} failed while connecting");
    }
    let connect_ms = ms(started.elapsed());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss_idle = target.server_rss();
    let mut server_cpu = Some(CpuMeter::start(target.server_pid().or(args.server_pid)));
    for (_, stdin, _) in &mut children {
        stdin.write_all(b"go\n").await?;
    }
    let mut start_ns = u64::MAX;
    let mut round_end_ns = vec![0u64; (args.warmup + args.rounds) as usize];
    let (mut client_cpu, mut server_ns, mut names_before_ms) = (0u64, None, 0f64);
    // Generous: all rounds, each bounded by --timeout inside the children.
    let limit = timeout * (args.warmup + args.rounds + 1);
    for (i, (mut child, _, mut stdout)) in children.into_iter().enumerate() {
        line.clear();
        tokio::time::timeout(limit, stdout.read_line(&mut line))
            .await
            .with_context(|| format!("load generator {i} did not finish in time"))??;
        let shard: ShardReport = serde_json::from_str(line.trim())
            .with_context(|| format!("load generator {i} failed (its error is above)"))?;
        if i == 0 {
            // The first child ends its rounds with the others: every round waits for all.
            server_ns = server_cpu.take().and_then(|meter| meter.stop().0);
        }
        client_cpu += shard.cpu_ns;
        names_before_ms = names_before_ms.max(shard.names_before_ms);
        start_ns = start_ns.min(shard.start_ns);
        for (end, at) in round_end_ns.iter_mut().zip(shard.round_end_ns) {
            *end = (*end).max(at);
        }
        child.wait().await?;
    }
    let per_conn = match (rss_before, rss_idle) {
        (Some(before), Some(idle)) => Some(idle.saturating_sub(before) / u64::from(args.clients)),
        _ => None,
    };
    let mut report = report(args, sources, start_ns, &round_end_ns, connect_ms, (None, rss_idle, per_conn))?;
    report.set_cpu(server_ns, Some(client_cpu));
    report.set_names_before(names_before_ms);
    Ok(report)
}

/// `--op floor`: the serving child, or the measurement (its client side).
async fn run_floor(args: &Args) -> anyhow::Result<()> {
    let plan = floor_plan(args, args.clients);
    // Each side holds one socket per client.
    ensure_fds(u64::from(args.clients) + 64)?;
    if args.serve_floor {
        return floor::serve(&plan);
    }
    if args.addr.is_some() || args.procs > 1 {
        bail!("--op floor measures bare sockets without a server, from one process: --addr and --procs do not apply");
    }
    let measured = floor::measure(&plan).await?;
    let mut report = floor_report(args, Op::Floor, measured.round, ms(measured.connecting));
    report.set_cpu(Some(measured.server_cpu_ns), Some(measured.client_cpu_ns));
    // As `CpuWindow`: the window needs a warm-up round before it.
    if args.warmup > 0 {
        report.set_measured_cpu(
            (Some(measured.server_measured_cpu_ns), Some(measured.client_measured_cpu_ns)),
            args.rounds as usize,
        );
        report.set_measured_tcp(measured.measured_tcp, args.rounds as usize);
    }
    print_report(&report, args.json, print_text)
}

/// `--op wake-floor`: a rank process, or the measurement (their parent).
async fn run_wake_floor(args: &Args) -> anyhow::Result<()> {
    let plan = floor_plan(args, args.procs);
    if let Some(path) = &args.wake_child {
        return wake_floor::child(&plan, path);
    }
    if args.addr.is_some() {
        bail!("--op wake-floor measures processes and shared memory without a server: --addr does not apply");
    }
    let round = wake_floor::measure(&plan).await?;
    let report = floor_report(args, Op::WakeFloor, round, 0.0);
    print_report(&report, args.json, print_text)
}

fn floor_plan(args: &Args, ranks: u32) -> floor::Plan {
    floor::Plan { ranks, rounds: args.rounds, warmup: args.warmup, timeout: Duration::from_secs_f64(args.timeout) }
}

/// The report of a floor: no protocol, no server, one rank per connection or process.
fn floor_report(args: &Args, op: Op, round: Times, connect_ms: f64) -> Report {
    Report {
        op,
        blocking: false,
        bare: false,
        raw: false,
        names_before: 0,
        names_before_ms_each: None,
        protocol: None,
        clients: if op == Op::WakeFloor { args.procs } else { args.clients },
        procs: if op == Op::WakeFloor { args.procs } else { 1 },
        src_addrs: 0,
        rounds: args.rounds,
        warmup_rounds: args.warmup,
        round,
        connect_ms,
        server_rss_one_conn_bytes: None,
        server_rss_idle_bytes: None,
        server_rss_per_conn_bytes: None,
        server_cpu_us_per_rank_round: None,
        client_cpu_us_per_rank_round: None,
        server_cpu_us_per_measured_rank_round: None,
        client_cpu_us_per_measured_rank_round: None,
        tcp_segments_per_measured_rank_round: None,
        tcp_pure_acks_per_measured_rank_round: None,
        tcp_delayed_acks_per_measured_rank_round: None,
    }
}

fn op_name(op: Op) -> &'static str {
    match op {
        Op::Barrier => "barrier",
        Op::Ping => "ping",
        Op::Floor => "floor",
        Op::WakeFloor => "wake-floor",
    }
}

fn protocol_name(protocol: Protocol) -> &'static str {
    match protocol {
        Protocol::Native => "native",
        Protocol::Tcpstore => "tcpstore",
    }
}

fn print_text(r: &Report) {
    if r.op == Op::WakeFloor {
        println!(
            "wake-floor: {} rank processes counting in one shared word, released by one futex wake (no server, \
             no sockets), {} rounds (+{} warm-up)",
            r.procs, r.rounds, r.warmup_rounds
        );
    } else {
        let clients = match (r.raw, r.bare) {
            (true, _) => "raw clients (the floor's threads, no runtime, no library)",
            (_, true) => "bare clients (no library)",
            _ => "clients",
        };
        println!(
            "{} over {}, {} {clients} in {} process(es), {} rounds (+{} warm-up); connecting took {:.0} ms",
            op_name(r.op),
            r.protocol.map_or("bare sockets", protocol_name),
            r.clients,
            r.procs,
            r.rounds,
            r.warmup_rounds,
            r.connect_ms
        );
    }
    if let Some(each) = r.names_before_ms_each {
        println!("before them, {} barriers named afresh: {each:.3} ms each", r.names_before);
    }
    println!("round time: {}", r.round);
    if let (Some(server), Some(client)) = (r.server_cpu_us_per_rank_round, r.client_cpu_us_per_rank_round) {
        println!("CPU per rank and round: server {server:.2} µs, load generator {client:.2} µs");
    }
    if let (Some(server), Some(client)) =
        (r.server_cpu_us_per_measured_rank_round, r.client_cpu_us_per_measured_rank_round)
    {
        println!("... over the measured rounds alone: server {server:.2} µs, load generator {client:.2} µs");
    }
    if let (Some(idle), Some(per_conn)) = (r.server_rss_idle_bytes, r.server_rss_per_conn_bytes) {
        println!(
            "server memory (RSS): {:.1} MiB with {} idle connections: {} bytes per connection",
            idle as f64 / 1048576.0,
            r.clients,
            per_conn
        );
    }
}

#[cfg(test)]
mod tests {
    use super::shard_ranks;

    #[test]
    fn shards_cover_every_rank_once() {
        let ranks: Vec<u32> = (0..3).flat_map(|i| shard_ranks(10, 3, i)).collect();
        assert_eq!(ranks, (0..10).collect::<Vec<_>>());
        assert!(shard_ranks(2, 3, 2).is_empty());
    }
}
