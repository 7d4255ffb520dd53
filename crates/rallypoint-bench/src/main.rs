//! `rallypoint-bench` (run as `rallypoint bench ...`): barrier and all-gather round
//! times, key-value latency and throughput, connection storms, and the coordinator's
//! memory per idle connection; over the native protocol or PyTorch's TCPStore
//! protocol. A binary of its own, so that the `rallypoint` users install carries no
//! load generators or plotting; `rallypoint bench` runs it when it is installed next
//! to `rallypoint`. The coordinator and node agents under test are `rallypoint serve`
//! and `rallypoint agent` child processes ([`rallypoint_exe`]).

mod all_gather;
mod attack;
mod bare;
mod barrier;
mod floor;
mod handshake;
mod hierarchy;
mod kv;
mod plot;
mod raw;
mod storm;
mod tcpstore;
mod tcpstore_start;
mod wake_floor;

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::ops::Range;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use rallypoint_client::{Client, ConnectOptions, Identity};
use serde::Serialize;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::net::{TcpSocket, TcpStream};
use tokio::process::{Child, Command};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

#[derive(Parser, Debug)]
#[command(
    name = "rallypoint bench",
    version,
    about = "Benchmarks of rallypoint; each prints one JSON object with --json"
)]
struct Cli {
    #[command(subcommand)]
    command: BenchCommand,
}

#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// N clients, each with its own connection, pass one barrier R times; reports
    /// round times and the server's memory per idle connection.
    Barrier(barrier::Args),
    /// Latency of single key-value operations, and throughput of `add` from N clients.
    Kv(kv::Args),
    /// N clients, each with its own connection, all-gather a value each R times.
    AllGather(all_gather::Args),
    /// N clients connect and join at once, as at a job's start: time until all are
    /// admitted, and how many connects were refused, reset or retried.
    Storm(storm::Args),
    /// A healthy job's barrier round time with and without hostile clients of another
    /// job hammering the coordinator (issue #13's attacks), and the coordinator's memory.
    Attack(attack::Args),
    /// Draws barrier round time against N, one line per system, from JSON lines to a PNG.
    Plot(plot::Args),
    /// What the token handshake and TLS cost: connect latency, N clients connecting at
    /// once, and a barrier round, plaintext vs token vs token over TLS, in one run.
    Handshake(handshake::Args),
    /// N ranks in one barrier through K node agents (`rallypoint agent`), their
    /// connections spread over several load-generator processes.
    Hierarchy(hierarchy::Args),
    /// A job's start on a TCPStore server (torch's or rallypoint's) as torch's elastic
    /// utilities do it: N ranks connect, pass the store barrier and all-gather an
    /// address with `synchronize`; the anchor of `hierarchy --start`.
    TcpstoreStart(tcpstore_start::Args),
}

async fn run(command: BenchCommand) -> anyhow::Result<()> {
    match command {
        BenchCommand::Barrier(args) => barrier::run(args).await,
        BenchCommand::Kv(args) => kv::run(args).await,
        BenchCommand::AllGather(args) => all_gather::run(args).await,
        BenchCommand::Storm(args) => storm::run(args).await,
        BenchCommand::Plot(args) => plot::run(args).await,
        BenchCommand::Attack(args) => attack::run(args).await,
        BenchCommand::Hierarchy(args) => hierarchy::run(args).await,
        BenchCommand::Handshake(args) => handshake::run(args).await,
        BenchCommand::TcpstoreStart(args) => tcpstore_start::run(args).await,
    }
}

/// The wire protocol the load generator speaks.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Protocol {
    /// rallypoint's own protocol, through the `rallypoint` client library
    Native,
    /// PyTorch's TCPStore protocol, spoken directly (so it also runs against torch's
    /// own server, given with `--addr`)
    Tcpstore,
}

/// The coordinator under test: the one at `--addr`, or a `rallypoint serve` child
/// process. A child has its own file-descriptor budget, so N clients and N server
/// connections do not share one process's limit.
struct Target {
    addr: String,
    server: Option<ChildServer>,
}

struct ChildServer {
    child: Child,
    pid: u32,
}

impl Target {
    async fn start(addr: Option<String>) -> anyhow::Result<Target> {
        Target::start_with(addr, &[]).await
    }

    /// Like [`Target::start`], a started coordinator given `serve_args` too.
    async fn start_with(addr: Option<String>, serve_args: &[String]) -> anyhow::Result<Target> {
        if let Some(addr) = addr {
            return Ok(Target { addr, server: None });
        }
        let mut command = Command::new(rallypoint_exe()?);
        command
            .args(["serve", "--listen", "127.0.0.1:0", "--print-addr"])
            .args(serve_args)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true);
        if std::env::var_os("RUST_LOG").is_none() {
            command.env("RUST_LOG", "warn");
        }
        let mut child = command.spawn().context("starting the benchmark's coordinator")?;
        let pid = child.id().context("the benchmark's coordinator exited at once")?;
        let stdout = child.stdout.take().context("the coordinator's stdout is not piped")?;
        let mut line = String::new();
        let mut reader = BufReader::new(stdout);
        match tokio::time::timeout(Duration::from_secs(30), reader.read_line(&mut line)).await {
            Ok(Ok(n)) if n > 0 => {}
            _ => bail!("the benchmark's coordinator did not report its address"),
        }
        Ok(Target { addr: line.trim().to_owned(), server: Some(ChildServer { child, pid }) })
    }

    /// Resident memory of the child coordinator; `None` for one given by `--addr`.
    fn server_rss(&self) -> Option<u64> {
        rss_of(self.server_pid()?)
    }

    /// The child coordinator's pid; `None` for one given by `--addr`.
    fn server_pid(&self) -> Option<u32> {
        self.server.as_ref().map(|server| server.pid)
    }

    async fn stop(self) {
        if let Some(mut server) = self.server {
            // It may have died already; either way it is gone afterwards.
            let _ = server.child.kill().await;
        }
    }
}

/// Resident memory of process `pid`, from /proc.
fn rss_of(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Runs `measure` against the coordinator at `addr`, or against one started for it
/// and stopped afterwards whether the measurement succeeded or not.
async fn on_target<R>(
    addr: Option<String>,
    measure: impl AsyncFnOnce(&Target) -> anyhow::Result<R>,
) -> anyhow::Result<R> {
    let target = Target::start(addr).await?;
    let report = measure(&target).await;
    target.stop().await;
    report
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("rallypoint bench: cannot start the runtime: {error}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli.command)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("rallypoint bench: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// The `rallypoint` binary whose `serve` and `agent` are measured: `RALLYPOINT_BIN`,
/// else the one next to this binary (both are built into the same target directory).
fn rallypoint_exe() -> anyhow::Result<std::path::PathBuf> {
    if let Some(bin) = std::env::var_os("RALLYPOINT_BIN").filter(|bin| !bin.is_empty()) {
        return Ok(bin.into());
    }
    let me = std::env::current_exe().context("finding the rallypoint-bench executable")?;
    let sibling = me.with_file_name("rallypoint");
    if !sibling.is_file() {
        bail!(
            "no `rallypoint` binary next to {} to run the coordinator under test: build it \
             (cargo build --release -p rallypoint-cli) or set RALLYPOINT_BIN",
            me.display()
        );
    }
    Ok(sibling)
}

/// A load-generator child: this same benchmark binary with `args`.
fn bench_child(args: &[&str]) -> anyhow::Result<Command> {
    let mut command = Command::new(std::env::current_exe().context("finding the rallypoint-bench executable")?);
    command.args(args);
    Ok(command)
}

/// Seconds as a non-negative finite number ("30", "0.5"), for flags.
fn secs(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(secs) if secs.is_finite() && secs >= 0.0 => Ok(secs),
        _ => Err(format!("'{text}' is not a number of seconds (0 or more)")),
    }
}

/// Prints a report: one JSON object with `json`, else the lines `text` prints.
fn print_report<R: Serialize>(report: &R, json: bool, text: impl FnOnce(&R)) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(report)?);
    } else {
        text(report);
    }
    Ok(())
}

/// Connects one TCP socket to `addr` with `TCP_NODELAY`, from `source` if given.
async fn connect_tcp(addr: SocketAddr, source: Option<IpAddr>) -> io::Result<TcpStream> {
    let socket = if addr.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
    if let Some(ip) = source {
        // Port 0: the kernel picks a free port of that address.
        socket.bind(SocketAddr::new(ip, 0))?;
    }
    let stream = socket.connect(addr).await?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// Source addresses of a load generator's connections. Towards one server address,
/// one source address has only the ephemeral ports of `ip_local_port_range`; past
/// that, clients bind the loopback aliases 127.0.0.2, 127.0.0.3, ...
#[derive(Debug, Clone, Copy)]
struct Sources {
    /// 0: no binding, the kernel picks the source (127.0.0.1 on loopback).
    addrs: u32,
    /// Clients per address when binding.
    per_addr: u32,
}

impl Sources {
    /// `explicit` addresses for `clients` clients, or as many as their number needs.
    fn plan(explicit: Option<u32>, clients: u32) -> Sources {
        let addrs = explicit.unwrap_or_else(|| {
            // Leave a tenth of the range for whatever else runs on the machine.
            let usable = (ephemeral_ports() * 9 / 10).max(1);
            if clients <= usable {
                0
            } else {
                clients.div_ceil(usable)
            }
        });
        Sources { addrs, per_addr: clients.div_ceil(addrs.max(1)).max(1) }
    }

    /// The source address of the client with global index `i`.
    fn of(&self, i: u32) -> Option<IpAddr> {
        if self.addrs == 0 {
            return None;
        }
        // 127.0.0.2 upwards: 127.0.0.1 is the server's, and the default source.
        let n = 2 + (i / self.per_addr).min(self.addrs - 1);
        Some(IpAddr::V4(Ipv4Addr::from(u32::from(Ipv4Addr::new(127, 0, 0, 0)) + n)))
    }
}

/// Size of the ephemeral port range (`net.ipv4.ip_local_port_range`); Linux's
/// default if it cannot be read.
fn ephemeral_ports() -> u32 {
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap_or_default();
    let mut bounds = range.split_whitespace().filter_map(|s| s.parse::<u32>().ok());
    match (bounds.next(), bounds.next()) {
        (Some(lo), Some(hi)) if hi >= lo => hi - lo + 1,
        _ => 28_232,
    }
}

/// `CLOCK_MONOTONIC` in nanoseconds. Unlike an `Instant` it can be passed between
/// processes: load-generator children report their release times with it.
fn mono_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime only writes the struct we pass; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// CPU time (user and system, all threads) a process has spent so far, in ns: the
/// process `pid`, or this one. `None` if it cannot be read (the process is gone).
fn process_cpu_ns(pid: Option<u32>) -> Option<u64> {
    let mut clock = libc::CLOCK_PROCESS_CPUTIME_ID;
    if let Some(pid) = pid {
        // SAFETY: writes only `clock`.
        if unsafe { libc::clock_getcpuclockid(libc::pid_t::try_from(pid).ok()?, &mut clock) } != 0 {
            return None;
        }
    }
    read_clock_ns(clock)
}

/// The counters of one protocol in a `/proc/net/snmp`-style file (`Tcp:` in
/// `/proc/net/snmp`, `TcpExt:` in `/proc/net/netstat`): a line of names, then one of
/// values, both led by the prefix. Empty if the file cannot be read.
fn net_counters(path: &str, prefix: &str) -> HashMap<String, u64> {
    parse_net_counters(&std::fs::read_to_string(path).unwrap_or_default(), prefix)
}

fn parse_net_counters(text: &str, prefix: &str) -> HashMap<String, u64> {
    let lines: Vec<&str> = text.lines().filter(|l| l.starts_with(prefix)).collect();
    match lines.as_slice() {
        [names, values] => names
            .split_whitespace()
            .zip(values.split_whitespace())
            .skip(1)
            .filter_map(|(k, v)| Some((k.to_owned(), v.parse().ok()?)))
            .collect(),
        _ => HashMap::new(),
    }
}

/// TCP segments sent so far by every socket of this network namespace: over
/// loopback, each is also received once. A barrier round needs two per rank that
/// carry data (an arrival, a release); what else goes is pure ACKs, which cost
/// both ends about as much as a message. An arrival held longer than the kernel's
/// delayed-ACK timeout gets one (docs/BENCHMARKS.md, "the kernel's loopback TCP").
#[derive(Clone, Copy, Debug, Default, Serialize, serde::Deserialize, PartialEq)]
struct TcpCounts {
    segments: u64,
    data_segments: u64,
    /// ACKs sent by the delayed-ACK timer.
    delayed_acks: u64,
}

impl TcpCounts {
    /// `None` where `/proc/net` is not readable (not Linux, or no procfs).
    fn read() -> Option<TcpCounts> {
        let tcp = net_counters("/proc/net/snmp", "Tcp:");
        let ext = net_counters("/proc/net/netstat", "TcpExt:");
        Some(TcpCounts {
            segments: *tcp.get("OutSegs")?,
            data_segments: *ext.get("TCPOrigDataSent")?,
            delayed_acks: ext.get("DelayedACKs").copied().unwrap_or(0),
        })
    }

    fn since(self, before: TcpCounts) -> TcpCounts {
        TcpCounts {
            segments: self.segments.saturating_sub(before.segments),
            data_segments: self.data_segments.saturating_sub(before.data_segments),
            delayed_acks: self.delayed_acks.saturating_sub(before.delayed_acks),
        }
    }
}

/// CPU time the calling thread has spent so far, in ns.
fn thread_cpu_ns() -> u64 {
    read_clock_ns(libc::CLOCK_THREAD_CPUTIME_ID).unwrap_or(0)
}

fn read_clock_ns(clock: libc::clockid_t) -> Option<u64> {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime only writes the struct we pass.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        return None;
    }
    Some(ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64)
}

/// What one client does in round `r`. A trait, not a closure returning a boxed
/// future: each round's future lives in its client's task, as in a rank's own loop,
/// rather than costing the load generator an allocation and a copy of the future
/// per call, which the server's figures would be compared against.
trait Round<C>: Send + Sync + 'static {
    fn round<'a>(&'a self, client: &'a mut C, r: usize) -> impl Future<Output = anyhow::Result<()>> + Send + 'a;
}

/// Each round is one native barrier `name` of the whole job.
struct BarrierRound {
    name: &'static str,
    timeout: Duration,
}

impl Round<Client> for BarrierRound {
    async fn round(&self, client: &mut Client, _: usize) -> anyhow::Result<()> {
        Ok(client.barrier(self.name, rallypoint_client::Members::World, Some(self.timeout)).await?)
    }
}

/// The CPU of the measured rounds alone: this process's, and the server's if its
/// pid is known. Outside them lie costs of the benchmark, not of a round: spawning
/// the clients' tasks, the first rounds on cold caches, joining the tasks.
///
/// Both ends are read when the *first* client is released from a round: from the
/// last warm-up round's first release to the last round's. Between two releases of
/// the same rank in a lock-step barrier lie exactly so many rounds of both sides'
/// work. Reading at the last release instead would leave out the next round's
/// arrivals the other clients sent already, at the start, and find none of them at
/// the end, where no round follows: the load's sends of one round would be missing.
/// So a window needs a warm-up round before it, and rounds in step (a barrier, not
/// pings).
struct CpuWindow {
    server_pid: Option<u32>,
    /// The rounds whose first release opens and closes the window (counted from 1).
    edges: [usize; 2],
    marks: [OnceLock<CpuMark>; 2],
}

/// The CPU spent so far by this process and by the server, in ns; and the TCP
/// segments sent so far.
struct CpuMark {
    server: Option<u64>,
    client: Option<u64>,
    tcp: Option<TcpCounts>,
}

impl CpuWindow {
    /// `None` without a warm-up round to open it.
    fn new(server_pid: Option<u32>, warmup: usize, total: usize) -> Option<CpuWindow> {
        (warmup > 0).then(|| CpuWindow { server_pid, edges: [warmup, total], marks: Default::default() })
    }

    fn mark(&self) -> CpuMark {
        CpuMark {
            server: self.server_pid.and_then(|pid| process_cpu_ns(Some(pid))),
            client: process_cpu_ns(None),
            tcp: TcpCounts::read(),
        }
    }

    /// A client finished round `r` (counted from 0).
    fn finished(&self, r: usize) {
        for (edge, mark) in self.edges.iter().zip(&self.marks) {
            if r + 1 == *edge && mark.get().is_none() {
                // Two clients racing here both read the clock; the first to set wins.
                let _ = mark.set(self.mark());
            }
        }
    }

    /// The rounds measured.
    fn rounds(&self) -> usize {
        self.edges[1] - self.edges[0]
    }

    /// (server, this process) ns spent over the measured rounds; `None` where an
    /// end is missing (no round ended, or the server's pid is unknown).
    fn spent(&self) -> (Option<u64>, Option<u64>) {
        let (Some(from), Some(to)) = (self.marks[0].get(), self.marks[1].get()) else { return (None, None) };
        let between = |a: Option<u64>, b: Option<u64>| Some(b?.saturating_sub(a?));
        (between(from.server, to.server), between(from.client, to.client))
    }

    /// The TCP segments sent over the measured rounds, as [`CpuWindow::spent`].
    fn tcp_spent(&self) -> Option<TcpCounts> {
        let (Some(from), Some(to)) = (self.marks[0].get(), self.marks[1].get()) else { return None };
        Some(to.tcp?.since(from.tcp?))
    }
}

/// Runs rounds `0..total` of `op` on every client, each client looping on its own
/// like a rank of a training job. Returns the clients and, per round, when its last
/// client finished it ([`mono_ns`]); or the first failure. `window`: told as each
/// client finishes a round.
async fn run_rounds<C: Send + 'static, R: Round<C>>(
    clients: Vec<C>,
    total: usize,
    op: Arc<R>,
    window: Option<Arc<CpuWindow>>,
) -> (Vec<C>, anyhow::Result<Vec<u64>>) {
    let mut running = JoinSet::new();
    for mut client in clients {
        let (op, window) = (Arc::clone(&op), window.clone());
        running.spawn(async move {
            let mut released = Vec::with_capacity(total);
            for r in 0..total {
                if let Err(err) = op.round(&mut client, r).await {
                    return (client, Err(err.context(format!("round {r}"))));
                }
                released.push(mono_ns());
                if let Some(window) = &window {
                    window.finished(r);
                }
            }
            (client, Ok(released))
        });
    }
    let mut round_end = vec![0u64; total];
    let mut clients = Vec::new();
    let mut failure = None;
    while let Some(joined) = running.join_next().await {
        let (client, result) = match joined {
            Ok(joined) => joined,
            Err(err) => {
                failure.get_or_insert(anyhow::Error::new(err).context("a client task failed"));
                continue;
            }
        };
        clients.push(client);
        match result {
            Ok(released) => {
                for (end, at) in round_end.iter_mut().zip(released) {
                    *end = (*end).max(at);
                }
            }
            Err(err) => {
                failure.get_or_insert(err);
            }
        }
    }
    (clients, failure.map_or(Ok(round_end), Err))
}

/// Round times from when each round's last client finished: a round runs from the
/// end of the one before (or `start`) to its own end; the first `warmup` are dropped.
fn round_stats(start_ns: u64, round_end_ns: &[u64], warmup: usize) -> Option<Stats> {
    let mut rounds: Vec<Duration> = (warmup..round_end_ns.len())
        .map(|r| {
            let from = if r == 0 { start_ns } else { round_end_ns[r - 1] };
            Duration::from_nanos(round_end_ns[r].saturating_sub(from))
        })
        .collect();
    Stats::of(&mut rounds)
}

/// Raises the soft file-descriptor limit and checks that `needed` fit under it.
fn ensure_fds(needed: u64) -> anyhow::Result<()> {
    let limit = rallypoint_net::raise_fd_limit();
    if needed > limit {
        bail!("this benchmark needs about {needed} file descriptors, but the limit is {limit} (see `ulimit -Hn`)");
    }
    Ok(())
}

/// Connects one client per id in `ids`, each its own connection made with
/// `options(id)`, a bounded number at a time so the listen backlog never
/// overflows. Returns them in no set order.
async fn connect_many(ids: Range<u32>, options: impl Fn(u32) -> ConnectOptions) -> anyhow::Result<Vec<Client>> {
    connect_bounded(ids, |i| {
        let options = options(i);
        async move { Client::connect_with(options).await.with_context(|| format!("connecting client {i}")) }
    })
    .await
}

/// Connects one client per index in `ids` with `connect`, a bounded number at a
/// time so that the listen backlog never overflows; stops at the first failure.
async fn connect_bounded<T, F>(ids: Range<u32>, connect: impl Fn(u32) -> F) -> anyhow::Result<Vec<T>>
where
    T: Send + 'static,
    F: Future<Output = anyhow::Result<T>> + Send + 'static,
{
    const IN_FLIGHT: usize = 256;
    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
    let mut connecting = JoinSet::new();
    let mut conns = Vec::with_capacity(ids.len());
    for i in ids {
        let slot = Arc::clone(&slots).acquire_owned().await?;
        let connected = connect(i);
        connecting.spawn(async move {
            let connected = connected.await;
            drop(slot);
            connected
        });
        // Collect as we go so that a failure stops the loop early.
        while let Some(connected) = connecting.try_join_next() {
            conns.push(connected??);
        }
    }
    while let Some(connected) = connecting.join_next().await {
        conns.push(connected??);
    }
    Ok(conns)
}

/// `connect`, given up after `timeout`; either failure is said as `what` (e.g.
/// "connecting client 3").
async fn connect_within<T>(
    timeout: Duration,
    what: impl std::fmt::Display,
    connect: impl Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    match tokio::time::timeout(timeout, connect).await {
        Ok(conn) => conn.with_context(|| what.to_string()),
        Err(_) => bail!("{what}: no answer within {timeout:?}"),
    }
}

/// Options for a client of `addr` with `identity` and `timeout`.
fn options(addr: &str, identity: Identity, timeout: Duration) -> ConnectOptions {
    ConnectOptions::new(addr, identity).with_timeout(timeout)
}

/// Closes every client cleanly (concurrently: one by one would take N round trips).
async fn close_all(clients: Vec<Client>) {
    let mut closing: JoinSet<_> = clients.into_iter().map(Client::close).collect();
    while closing.join_next().await.is_some() {}
}

/// How many durations were measured, and their percentiles.
#[derive(Debug, Clone, Copy, Serialize)]
struct Stats {
    count: usize,
    #[serde(flatten)]
    times: Times,
}

/// Percentiles of a set of durations, in microseconds. Reports of round times
/// flatten it, so its fields appear as `median_us`, `p99_us`, ... in their JSON.
#[derive(Debug, Clone, Copy, Serialize)]
struct Times {
    median_us: f64,
    p99_us: f64,
    mean_us: f64,
    min_us: f64,
    max_us: f64,
}

impl std::fmt::Display for Times {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Times { median_us, p99_us, mean_us, min_us, max_us } = self;
        write!(f, "median {median_us:.1} µs, p99 {p99_us:.1} µs, mean {mean_us:.1} µs, min {min_us:.1} µs, max {max_us:.1} µs")
    }
}

impl Stats {
    fn of(samples: &mut [Duration]) -> Option<Stats> {
        samples.sort_unstable();
        let (&min, &max) = (samples.first()?, samples.last()?);
        let n = samples.len();
        // Nearest-rank percentiles: the value at or below which p% of samples lie.
        let pick = |p: f64| samples[((p * n as f64).ceil() as usize).clamp(1, n) - 1];
        let mean = samples.iter().sum::<Duration>() / n as u32;
        let us = |d: Duration| (d.as_secs_f64() * 1e7).round() / 10.0;
        Some(Stats {
            count: n,
            times: Times {
                median_us: us(pick(0.5)),
                p99_us: us(pick(0.99)),
                mean_us: us(mean),
                min_us: us(min),
                max_us: us(max),
            },
        })
    }
}

/// Counts iterations of a measuring loop, stopping at `count` or at the deadline,
/// whichever comes first.
struct Bounded {
    next: u32,
    count: u32,
    deadline: Instant,
}

impl Bounded {
    fn new(count: u32, max: Duration) -> Self {
        Bounded { next: 0, count, deadline: Instant::now() + max }
    }
}

impl Iterator for Bounded {
    type Item = u32;
    fn next(&mut self) -> Option<u32> {
        if self.next >= self.count || Instant::now() >= self.deadline {
            return None;
        }
        self.next += 1;
        Some(self.next - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles() {
        let mut samples: Vec<Duration> = (1..=100).rev().map(Duration::from_micros).collect();
        let stats = Stats::of(&mut samples).unwrap();
        let t = stats.times;
        assert_eq!((stats.count, t.median_us, t.p99_us, t.min_us, t.max_us), (100, 50.0, 99.0, 1.0, 100.0));
        assert_eq!(t.mean_us, 50.5);
        assert!(Stats::of(&mut []).is_none());
    }

    /// `/proc/net/snmp` and `/proc/net/netstat` name their counters on one line and
    /// give their values on the next, and hold other protocols' lines too.
    #[test]
    fn tcp_counts_are_read_by_name_from_their_protocols_lines() {
        let snmp = "Ip: Forwarding InReceives\nIp: 1 5\nTcp: RtoAlgorithm OutSegs InSegs\nTcp: 1 700 650\n";
        let ext = "TcpExt: SyncookiesSent DelayedACKs TCPOrigDataSent\nTcpExt: 0 12 400\n\
                   IpExt: InNoRoutes\nIpExt: 3\n";
        let tcp = parse_net_counters(snmp, "Tcp:");
        assert_eq!((tcp.get("OutSegs"), tcp.get("InReceives")), (Some(&700), None));
        let ext = parse_net_counters(ext, "TcpExt:");
        assert_eq!((ext.get("DelayedACKs"), ext.get("TCPOrigDataSent")), (Some(&12), Some(&400)));
        assert!(parse_net_counters("Tcp: OutSegs\n", "Tcp:").is_empty(), "names without values");
        let before = TcpCounts { segments: 700, data_segments: 400, delayed_acks: 12 };
        let after = TcpCounts { segments: 1000, data_segments: 600, delayed_acks: 20 };
        assert_eq!(after.since(before), TcpCounts { segments: 300, data_segments: 200, delayed_acks: 8 });
        // Where Linux's /proc is, the counters are found.
        if std::path::Path::new("/proc/net/snmp").exists() {
            assert!(TcpCounts::read().is_some());
        }
    }

    /// The window opens at the first release from the last warm-up round and closes
    /// at the first from the last round; without a warm-up round there is none.
    #[test]
    fn the_cpu_window_runs_from_a_first_release_to_a_first_release() {
        assert!(CpuWindow::new(None, 0, 3).is_none());
        let window = CpuWindow::new(None, 1, 3).expect("a warm-up round");
        window.finished(0);
        let opened = window.marks[0].get().map(|mark| mark.client);
        assert!(opened.is_some());
        window.finished(0);
        assert_eq!(window.marks[0].get().map(|mark| mark.client), opened, "a later release moves nothing");
        for r in [1, 1] {
            window.finished(r);
        }
        assert_eq!(window.spent(), (None, None), "no release from the last round yet");
        window.finished(2);
        let (server, client) = window.spent();
        assert_eq!((server, client.is_some(), window.rounds()), (None, true, 2));

        // With the server's pid (here this process's) both are measured.
        let window = CpuWindow::new(Some(std::process::id()), 1, 2).expect("a warm-up round");
        window.finished(0);
        window.finished(1);
        assert!(matches!(window.spent(), (Some(_), Some(_))));
    }

    #[test]
    fn bounded_by_count_and_time() {
        assert_eq!(Bounded::new(3, Duration::from_secs(60)).count(), 3);
        assert_eq!(Bounded::new(3, Duration::ZERO).count(), 0);
    }
}
