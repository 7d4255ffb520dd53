//! `rallypoint bench hierarchy`: N ranks in one barrier through K node agents.
//!
//! Starts a coordinator, K `rallypoint agent` processes and G load-generator
//! processes (this command again, with `--generator`), each holding its share of
//! the N rank connections (one connection per rank, spread over the agents), so
//! that no process needs more file descriptors than the limit allows. Every rank
//! loops `barrier("bench")` as fast as it is released. A round ends when the last
//! rank of all generators is released: each generator stamps, per round, when its
//! own last rank was released (CLOCK_MONOTONIC, the same clock in every process of
//! the machine), and the parent takes the latest stamp per round.
//!
//! The generators speak the native protocol directly (a pre-encoded barrier
//! request per rank, one task per connection), not through `rallypoint::Client`:
//! at 100,000 ranks on one machine the load generator's own cost per rank would
//! otherwise dominate what is measured. The coordinator and the agents are the
//! real ones.

use std::process::Stdio;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bytes::BytesMut;
use rallypoint_client::{Identity, Members};
use rallypoint_core::{Request, Response};
use rallypoint_net::unix_conn::UnixConn;
use rallypoint_proto::native::{
    decode_server_frame, encode_client_frame, encode_preamble, ClientFrame, FrameLimits, ServerFrame,
};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::process::{Child, Command};
use tokio::task::JoinSet;

use crate::{mono_ns, print_report, Stats, Times};

mod channels;
pub(crate) mod start;
mod start_floor;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Ranks in the one barrier, each with its own connection to an agent
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..))]
    ranks: u32,
    /// Node agents the ranks are spread over (round robin)
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..))]
    agents: u32,
    /// Load-generator processes the rank connections are spread over
    /// [default: enough for 16,000 connections each]
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    generators: Option<u32>,
    /// Measured rounds
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Unmeasured rounds before them
    #[arg(long, default_value_t = 3)]
    warmup: u32,
    /// How the ranks reach their agent: `unix` (a Unix domain socket per agent) or `tcp` (loopback)
    #[arg(long, value_enum, default_value_t = Transport::Unix)]
    transport: Transport,
    /// Ranks arrive through the agents' barrier channels (shared memory, docs/PROTOCOL.md
    /// section 15) after their first call, as the client library does on a Unix socket;
    /// ranks the agent gives no channel (over TCP) go through messages
    #[arg(long)]
    channels: bool,
    /// Measure a job's start instead of barrier rounds: every rank connects and
    /// registers, passes one barrier and all-gathers an address; reports when the
    /// last rank ended each phase, from the start of the load generators
    /// (`--rounds`, `--warmup` and `--channels` do not apply)
    #[arg(long, conflicts_with = "channels")]
    start: bool,
    /// Ranks state no incarnation, as a PyTorch TCPStore client: the coordinator then
    /// keeps none of their replies for a resume. By default each rank states one, as
    /// the client library does, and the coordinator keeps every arrival's reply
    #[arg(long)]
    no_incarnation: bool,
    /// With --start: the floor under it. The same generators and ranks, but each
    /// agent is a bare epoll loop that answers the same frames, and there is no
    /// coordinator (Unix sockets only)
    #[arg(long, requires = "start")]
    floor: bool,
    /// Seconds the whole run may take before the benchmark fails
    #[arg(long, value_name = "SECS", default_value = "600", value_parser = crate::secs)]
    timeout: f64,
    /// Print one JSON object instead of text
    #[arg(long)]
    json: bool,
    /// Internal: run as one load generator for ranks FIRST..FIRST+COUNT (the parent passes the rest)
    #[arg(long, hide = true, num_args = 2, value_names = ["FIRST", "COUNT"])]
    generator: Option<Vec<u32>>,
    /// Internal: the agents' addresses, comma-separated (for `--generator`)
    #[arg(long, hide = true)]
    agent_addrs: Option<String>,
    /// Internal: run as a floor agent (`--start --floor`) for COUNT ranks on the Unix socket PATH
    #[arg(long, hide = true, num_args = 2, value_names = ["PATH", "COUNT"])]
    floor_agent: Option<Vec<String>>,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub(super) enum Transport {
    Unix,
    Tcp,
}

/// Connections one generator holds at most by default (one descriptor each: below a
/// raised open-file limit).
const PER_GENERATOR: u32 = 16_000;
/// Connection attempts in flight per load-generating process (the listen backlogs
/// are finite).
pub(crate) const CONNECTING: usize = 256;

#[derive(Debug, Serialize)]
struct Report {
    op: &'static str,
    ranks: u32,
    agents: u32,
    generators: u32,
    transport: Transport,
    /// Whether the ranks asked for barrier channels (`--channels`).
    channels: bool,
    /// Of the ranks, how many got a channel (the rest went through messages).
    ranks_through_channels: u32,
    /// Whether the ranks stated an incarnation (not `--no-incarnation`).
    incarnations: bool,
    rounds: u32,
    warmup_rounds: u32,
    #[serde(flatten)]
    round: Times,
    /// From starting the generators until every rank was welcomed.
    connect_ms: f64,
    /// CPU time (user + system) per rank per measured round (warm-up excluded) of the
    /// coordinator, of all agents and of all generators: on a shared machine a
    /// steadier figure than wall time. Their sum ÷ cores bounds the round from below.
    cpu_us_per_rank_round: CpuSplit,
}

#[derive(Debug, Serialize)]
struct CpuSplit {
    coordinator: f64,
    agents: f64,
    generators: f64,
}

/// CPU ticks (user + system) a process has used so far; 0 if it cannot be read.
fn cpu_ticks(child: &Child) -> u64 {
    let Some(pid) = child.id() else { return 0 };
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return 0 };
    // Fields after the parenthesised command name: state is field 3, utime 14, stime 15.
    let Some(rest) = stat.rsplit_once(')').map(|(_, rest)| rest) else { return 0 };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3).and_then(|f| f.parse::<u64>().ok()).unwrap_or(0);
    field(14) + field(15)
}

fn cpu_of<'a>(children: impl Iterator<Item = &'a Child>) -> u64 {
    children.map(cpu_ticks).sum()
}

/// CPU ticks so far of the coordinator (none for a floor), of all agents and of
/// the generators `gens`.
fn cpu_sample(root: Option<&Spawned>, agents: &Agents, gens: &[Spawned]) -> [u64; 3] {
    [
        root.map_or(0, |root| cpu_ticks(&root.child)),
        cpu_of(agents.children.iter().map(|a| &a.child)),
        cpu_of(gens.iter().map(|g| &g.child)),
    ]
}

/// Microseconds of CPU between two counts of ticks.
fn cpu_us_between(before: u64, after: u64) -> f64 {
    // SAFETY: sysconf has no preconditions.
    let ticks_per_s = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    after.saturating_sub(before) as f64 / ticks_per_s * 1e6
}

/// What a generator reports on its last stdout line.
#[derive(Debug, Serialize, Deserialize)]
struct GeneratorReport {
    /// Per round, when this generator's last rank was released (CLOCK_MONOTONIC ns).
    round_end_ns: Vec<u64>,
    /// When it started the first measured round (after the warm-up).
    start_ns: u64,
    /// Its ranks that arrive through barrier channels.
    through_channels: u32,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    if let Some(range) = &args.generator {
        return generator(&args, range[0], range[1]).await;
    }
    if let Some(floor) = &args.floor_agent {
        let count = floor[1].parse().context("--floor-agent COUNT")?;
        let timeout = Duration::from_secs_f64(args.timeout);
        let (path, world) = (floor[0].clone(), args.ranks);
        return tokio::task::spawn_blocking(move || start_floor::serve(&path, count, world, timeout)).await?;
    }
    let limit = Duration::from_secs_f64(args.timeout);
    if args.start {
        return match tokio::time::timeout(limit, coordinate_start(&args)).await {
            Ok(report) => print_report(&report?, args.json, |r| {
                println!(
                    "{}start of {} ranks through {} agents ({:?}): all registered at {:.0} ms, through the barrier at {:.0} ms, all-gathered at {:.0} ms ({} took it as shared memory)",
                    if r.floor { "floor under the " } else { "" },
                    r.ranks, r.agents, r.transport, r.registered_ms, r.barrier_ms, r.all_gather_ms, r.ranks_with_shared_result
                );
            }),
            Err(_) => bail!("the benchmark did not finish within {limit:?}"),
        };
    }
    match tokio::time::timeout(limit, coordinate(&args)).await {
        Ok(report) => print_report(&report?, args.json, |report| {
            println!(
                "{} ranks through {} agents ({:?}{}), {} rounds: median {:.2} ms, p99 {:.2} ms, mean {:.2} ms (connecting all: {:.0} ms)",
                report.ranks,
                report.agents,
                report.transport,
                if report.channels {
                    format!(", {} of them through barrier channels", report.ranks_through_channels)
                } else {
                    String::new()
                },
                report.rounds,
                report.round.median_us / 1000.0,
                report.round.p99_us / 1000.0,
                report.round.mean_us / 1000.0,
                report.connect_ms
            );
        }),
        Err(_) => bail!("the benchmark did not finish within {limit:?}"),
    }
}

/// A child process whose first stdout line is an address or a "ready" mark.
struct Spawned {
    child: Child,
    lines: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
}

/// Starts `program` with `args`: `rallypoint` (the coordinator, agents under test)
/// or this benchmark binary (load generators).
async fn spawn(program: &std::path::Path, args: &[String], what: &str) -> anyhow::Result<Spawned> {
    let mut command = Command::new(program);
    command.args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).kill_on_drop(true);
    if std::env::var_os("RUST_LOG").is_none() {
        command.env("RUST_LOG", "warn");
    }
    let mut child = command.spawn().with_context(|| format!("starting {what}"))?;
    let stdout = child.stdout.take().context("stdout is not piped")?;
    Ok(Spawned { child, lines: BufReader::new(stdout).lines() })
}

/// Node agents started as child processes for a benchmark, and the directory of
/// their Unix sockets, removed when this is dropped (the agents, spawned with
/// `kill_on_drop`, are killed then too).
pub(super) struct Agents {
    children: Vec<Spawned>,
    /// Where ranks connect, one per agent.
    pub(super) addrs: Vec<String>,
    dir: std::path::PathBuf,
}

impl Agents {
    /// Starts `count` agents of the coordinator at `upstream`, each listening on a
    /// Unix socket or on loopback TCP.
    pub(super) async fn start(count: u32, upstream: &str, transport: Transport) -> anyhow::Result<Agents> {
        let dir = std::env::temp_dir().join(format!("rallypoint-bench-agents-{}", std::process::id()));
        if count > 0 && transport == Transport::Unix {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let mut agents = Agents { children: Vec::new(), addrs: Vec::new(), dir };
        for i in 0..count {
            let listen = match transport {
                Transport::Unix => format!("unix:{}", agents.dir.join(format!("agent-{i}.sock")).display()),
                Transport::Tcp => "127.0.0.1:0".to_owned(),
            };
            let argv = ["agent", "--upstream", upstream, "--listen", &listen, "--print-addr"].map(String::from);
            let mut agent = spawn(&crate::rallypoint_exe()?, &argv, "a node agent").await?;
            agents.addrs.push(agent.line("a node agent").await?);
            agents.children.push(agent);
        }
        Ok(agents)
    }

    /// Starts `--start --floor`'s floor agents (this binary again) in their place:
    /// agent `i` serves the ranks `r` with `r mod K = i`, as the generators spread them.
    async fn start_floors(args: &Args) -> anyhow::Result<Agents> {
        let dir = std::env::temp_dir().join(format!("rallypoint-bench-floors-{}", std::process::id()));
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let me = std::env::current_exe().context("finding the rallypoint-bench executable")?;
        let mut agents = Agents { children: Vec::new(), addrs: Vec::new(), dir };
        for i in 0..args.agents {
            let path = agents.dir.join(format!("floor-{i}.sock")).display().to_string();
            let count = (args.ranks + args.agents - 1 - i) / args.agents;
            let argv = [
                "hierarchy".to_owned(),
                "--ranks".to_owned(),
                args.ranks.to_string(),
                "--timeout".to_owned(),
                args.timeout.to_string(),
                "--floor-agent".to_owned(),
                path,
                count.to_string(),
            ];
            let mut agent = spawn(&me, &argv, "a floor agent").await?;
            agents.addrs.push(agent.line("a floor agent").await?);
            agents.children.push(agent);
        }
        Ok(agents)
    }

    /// Kills the agents and waits for them to end.
    pub(super) async fn stop(mut self) {
        for mut agent in std::mem::take(&mut self.children) {
            let _ = agent.child.kill().await;
        }
    }
}

impl Drop for Agents {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Spawned {
    async fn line(&mut self, what: &str) -> anyhow::Result<String> {
        match self.lines.next_line().await {
            Ok(Some(line)) => Ok(line.trim().to_owned()),
            _ => bail!("{what} exited without reporting"),
        }
    }
}

/// Load generators by default: enough for [`PER_GENERATOR`] connections each.
fn generator_count(args: &Args) -> u32 {
    args.generators.unwrap_or(args.ranks.div_ceil(PER_GENERATOR)).min(args.ranks)
}

/// Starts the coordinator and the agents under test.
async fn start_servers(args: &Args) -> anyhow::Result<(Spawned, Agents)> {
    let serve = ["serve", "--listen", "127.0.0.1:0", "--print-addr"].map(String::from);
    let mut root = spawn(&crate::rallypoint_exe()?, &serve, "the coordinator").await?;
    let root_addr = root.line("the coordinator").await?;
    let agents = Agents::start(args.agents, &root_addr, args.transport).await?;
    Ok((root, agents))
}

/// Starts the load generators (this binary again), each with its share of the ranks.
async fn spawn_generators(args: &Args, generators: u32, agents: &Agents) -> anyhow::Result<Vec<Spawned>> {
    let me = std::env::current_exe().context("finding the rallypoint-bench executable")?;
    let mut gens = Vec::new();
    let per = args.ranks.div_ceil(generators);
    for g in 0..generators {
        let first = g * per;
        let count = per.min(args.ranks - first);
        let mut argv = vec![
            "hierarchy".to_owned(),
            "--ranks".to_owned(),
            args.ranks.to_string(),
            "--rounds".to_owned(),
            args.rounds.to_string(),
            "--warmup".to_owned(),
            args.warmup.to_string(),
            "--generator".to_owned(),
            first.to_string(),
            count.to_string(),
            "--agent-addrs".to_owned(),
            agents.addrs.join(","),
        ];
        if args.channels {
            argv.push("--channels".to_owned());
        }
        if args.start {
            argv.push("--start".to_owned());
        }
        if args.no_incarnation {
            argv.push("--no-incarnation".to_owned());
        }
        gens.push(spawn(&me, &argv, "a load generator").await?);
    }
    Ok(gens)
}

/// What `--start` reports.
#[derive(Debug, Serialize)]
struct StartReport {
    op: &'static str,
    ranks: u32,
    agents: u32,
    generators: u32,
    transport: Transport,
    /// The floor under a start (`--floor`): bare epoll loops for agents, no coordinator.
    floor: bool,
    /// Bytes of the address each rank contributes to the all-gather.
    value_bytes: usize,
    /// Of the ranks, how many took the all-gather's result as shared memory (the
    /// others were sent it on their sockets).
    ranks_with_shared_result: u32,
    /// From starting the load generators until the last rank was welcomed.
    registered_ms: f64,
    /// ... until the last rank was released from the first barrier.
    barrier_ms: f64,
    /// ... until the last rank held the all-gather's result: the start, end to end.
    all_gather_ms: f64,
    /// CPU time (user + system) of the coordinator, of all agents and of all
    /// generators over the whole start.
    cpu_ms: CpuSplit,
}

async fn coordinate_start(args: &Args) -> anyhow::Result<StartReport> {
    let generators = generator_count(args);
    let (mut root, agents) = if args.floor {
        if args.transport != Transport::Unix {
            bail!("the floor of a start (--floor) is measured over Unix sockets only");
        }
        (None, Agents::start_floors(args).await?)
    } else {
        let (root, agents) = start_servers(args).await?;
        (Some(root), agents)
    };
    let cpu_before = cpu_sample(root.as_ref(), &agents, &[]);
    let t0 = mono_ns();
    let mut gens = spawn_generators(args, generators, &agents).await?;
    let mut stamps = Vec::new();
    for generator in &mut gens {
        let line = generator.line("a load generator").await?;
        let report: start::Stamps =
            serde_json::from_str(&line).with_context(|| format!("a generator reported {line:?}"))?;
        stamps.push(report);
    }
    let cpu_after = cpu_sample(root.as_ref(), &agents, &gens);
    for mut generator in gens {
        let _ = generator.child.kill().await;
    }
    agents.stop().await;
    if let Some(root) = &mut root {
        let _ = root.child.kill().await;
    }

    let cpu_ms = |i: usize| cpu_us_between(cpu_before[i], cpu_after[i]) / 1e3;
    let phase_ms = |p: usize| {
        let end = stamps.iter().map(|s| s.phase_end_ns[p]).max().unwrap_or(0);
        (end.saturating_sub(t0) as f64 / 1e5).round() / 10.0
    };
    Ok(StartReport {
        op: "start",
        ranks: args.ranks,
        agents: args.agents,
        generators,
        transport: args.transport,
        floor: args.floor,
        value_bytes: start::address(0).len(),
        ranks_with_shared_result: stamps.iter().map(|s| s.shared).sum(),
        registered_ms: phase_ms(0),
        barrier_ms: phase_ms(1),
        all_gather_ms: phase_ms(2),
        cpu_ms: CpuSplit { coordinator: cpu_ms(0), agents: cpu_ms(1), generators: cpu_ms(2) },
    })
}

async fn coordinate(args: &Args) -> anyhow::Result<Report> {
    let generators = generator_count(args);
    let (mut root, agents) = start_servers(args).await?;

    let started = Instant::now();
    let mut gens = spawn_generators(args, generators, &agents).await?;
    for generator in &mut gens {
        let ready = generator.line("a load generator").await?;
        if ready != "ready" {
            bail!("a load generator said {ready:?} instead of ready");
        }
    }
    let connect_ms = started.elapsed().as_secs_f64() * 1000.0;
    let mut cpu_before = cpu_sample(Some(&root), &agents, &gens);
    // Every rank is connected: start all generators at once.
    go(&mut gens).await?;
    if args.warmup > 0 {
        // Each generator holds its ranks after the warm-up rounds (and so, the
        // barrier being one, does every other): the CPU time of the measured rounds
        // alone, without the warm-up's (with --channels, the attach calls).
        for generator in &mut gens {
            let warm = generator.line("a load generator").await?;
            if warm != "warm" {
                bail!("a load generator said {warm:?} instead of warm");
            }
        }
        cpu_before = cpu_sample(Some(&root), &agents, &gens);
        go(&mut gens).await?;
    }
    let mut reports = Vec::new();
    let mut gen_cpu_after = 0;
    for generator in &mut gens {
        let line = generator.line("a load generator").await?;
        let report: GeneratorReport =
            serde_json::from_str(&line).with_context(|| format!("a generator reported {line:?}"))?;
        gen_cpu_after += cpu_ticks(&generator.child);
        reports.push(report);
    }
    let total = (args.warmup + args.rounds) as usize;
    // When the last generator was let go into the measured rounds.
    let start_ns = reports.iter().map(|r| r.start_ns).max().unwrap_or(0);
    let ends: Vec<u64> = (0..total)
        .map(|k| reports.iter().map(|r| r.round_end_ns.get(k).copied().unwrap_or(0)).max().unwrap_or(0))
        .collect();
    let mut rounds: Vec<Duration> = Vec::new();
    for k in args.warmup as usize..total {
        let previous = if k == args.warmup as usize { start_ns } else { ends[k - 1] };
        rounds.push(Duration::from_nanos(ends[k].saturating_sub(previous)));
    }
    // Generators exit after reporting: sample them before reading their last line.
    let cpu_after = [cpu_ticks(&root.child), cpu_of(agents.children.iter().map(|a| &a.child)), gen_cpu_after];
    // To 0.01 µs: the coordinator's target is a fraction of a µs.
    let per_rank_round = |i: usize| {
        let us = cpu_us_between(cpu_before[i], cpu_after[i]);
        (us / f64::from(args.ranks) / f64::from(args.rounds) * 100.0).round() / 100.0
    };
    let cpu = CpuSplit { coordinator: per_rank_round(0), agents: per_rank_round(1), generators: per_rank_round(2) };
    for mut generator in gens {
        let _ = generator.child.kill().await;
    }
    agents.stop().await;
    let _ = root.child.kill().await;

    let stats = Stats::of(&mut rounds).context("no round was measured")?;
    Ok(Report {
        op: "barrier",
        ranks: args.ranks,
        agents: args.agents,
        generators,
        transport: args.transport,
        channels: args.channels,
        ranks_through_channels: reports.iter().map(|r| r.through_channels).sum(),
        incarnations: !args.no_incarnation,
        rounds: args.rounds,
        warmup_rounds: args.warmup,
        round: stats.times,
        connect_ms: (connect_ms * 10.0).round() / 10.0,
        cpu_us_per_rank_round: cpu,
    })
}

/// Tells every generator to go on (start, or end its pause after the warm-up).
async fn go(gens: &mut [Spawned]) -> anyhow::Result<()> {
    for generator in gens {
        let stdin = generator.child.stdin.as_mut().context("stdin is not piped")?;
        stdin.write_all(b"go\n").await?;
        stdin.flush().await?;
    }
    Ok(())
}

/// One rank's connection to its agent (a Unix one registered as the client
/// library's are: for reading only).
enum Conn {
    Unix(UnixConn),
    Tcp(TcpStream),
}

impl Conn {
    async fn open(addr: &str) -> std::io::Result<Conn> {
        match rallypoint_net::unix_path(addr) {
            Some(path) => Ok(Conn::Unix(UnixConn::connect(path)?)),
            None => {
                let stream = TcpStream::connect(addr).await?;
                stream.set_nodelay(true)?;
                Ok(Conn::Tcp(stream))
            }
        }
    }

    async fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        match self {
            Conn::Unix(s) => s.write_all(buf).await,
            Conn::Tcp(s) => s.write_all(buf).await,
        }
    }

    async fn read_buf(&mut self, buf: &mut BytesMut) -> std::io::Result<usize> {
        match self {
            Conn::Unix(s) => s.read_buf(buf).await,
            Conn::Tcp(s) => s.read_buf(buf).await,
        }
    }

    /// The next frame from the agent.
    async fn frame(&mut self, buf: &mut BytesMut) -> anyhow::Result<ServerFrame> {
        loop {
            if let Some(frame) = decode_server_frame(buf, &FrameLimits::unbounded())? {
                return Ok(frame);
            }
            buf.reserve(64);
            if self.read_buf(buf).await? == 0 {
                bail!("the agent closed the connection");
            }
        }
    }
}

/// The barrier every rank of a generator calls each round.
fn bench_barrier() -> Request {
    Request::Barrier { name: "bench".into(), members: Members::World, timeout_ms: Some(BARRIER_TIMEOUT_MS) }
}

/// The timeout of the barrier every round calls.
const BARRIER_TIMEOUT_MS: u64 = 120_000;

/// What the rank tasks of a generator share: the start signal, and per round how
/// many of them were released and when the last one was.
struct RankSetup {
    /// Ranks in the barrier (every process's).
    ranks: u32,
    /// Rounds, warm-up included.
    total: usize,
    /// Warm-up rounds: the ranks pause before the first measured round.
    warmup: usize,
    /// Ranks of this generator.
    count: u32,
    released: Vec<AtomicU32>,
    round_end: Vec<AtomicU64>,
    /// Connection attempts in flight (the listen backlogs are finite).
    connecting: tokio::sync::Semaphore,
    /// Ranks connected and welcomed.
    ready: AtomicU32,
    ready_moved: tokio::sync::Notify,
    /// The round that just ended for every rank of this generator (woken).
    round_done: tokio::sync::Notify,
    /// 1: start; 2: go on after the warm-up.
    go: tokio::sync::watch::Receiver<u8>,
    /// Ranks state an incarnation (see [`rank_identity`]).
    incarnation: bool,
}

impl RankSetup {
    fn new(args: &Args, count: u32, go: tokio::sync::watch::Receiver<u8>) -> RankSetup {
        let total = (args.warmup + args.rounds) as usize;
        RankSetup {
            ranks: args.ranks,
            total,
            warmup: args.warmup as usize,
            count,
            released: (0..total).map(|_| AtomicU32::new(0)).collect(),
            round_end: (0..total).map(|_| AtomicU64::new(0)).collect(),
            connecting: tokio::sync::Semaphore::new(CONNECTING),
            ready: AtomicU32::new(0),
            ready_moved: tokio::sync::Notify::new(),
            round_done: tokio::sync::Notify::new(),
            go,
            incarnation: !args.no_incarnation,
        }
    }

    /// Connects `rank` to the agent at `addr`, reads its welcome, says it is ready
    /// and waits for the start: the connection and its read buffer.
    async fn connected(&self, rank: u32, addr: &str) -> anyhow::Result<(Conn, BytesMut)> {
        let identity = rank_identity(rank, self.ranks, self.incarnation);
        let mut buf = BytesMut::new();
        let conn = {
            let _slot = self.connecting.acquire().await?;
            let mut conn = connect_rank(addr, &identity, false).await?;
            match conn.frame(&mut buf).await? {
                ServerFrame::Welcome(_) => {}
                other => bail!("rank {rank}: expected a welcome, got {other:?}"),
            }
            conn
        };
        self.ready.fetch_add(1, Ordering::AcqRel);
        self.ready_moved.notify_one();
        self.go.clone().wait_for(|&go| go >= 1).await?;
        Ok((conn, buf))
    }

    /// Before round `k`: after the warm-up, waits until the parent lets the
    /// measured rounds start.
    async fn before_round(&self, k: usize) -> anyhow::Result<()> {
        if k == self.warmup && k > 0 {
            self.go.clone().wait_for(|&go| go >= 2).await?;
        }
        Ok(())
    }

    /// Whether every rank of this generator is through the warm-up.
    fn warm(&self) -> bool {
        self.warmup == 0 || self.round_end[self.warmup - 1].load(Ordering::Acquire) != 0
    }

    /// `n` more ranks of this generator were released from round `k`.
    fn released(&self, k: usize, n: u32) {
        if self.released[k].fetch_add(n, Ordering::AcqRel) + n == self.count {
            self.round_end[k].store(mono_ns(), Ordering::Release);
            self.round_done.notify_waiters();
        }
    }
}

/// The generator's start, once every rank is connected.
struct Started {
    /// When the measured rounds started (the warm-up's, until they do).
    start_ns: u64,
    stdin: tokio::io::Lines<BufReader<tokio::io::Stdin>>,
    go: tokio::sync::watch::Sender<u8>,
    /// The ranks were let go on after the warm-up (or there is none).
    measuring: bool,
}

impl Started {
    /// After the warm-up, once every rank of this generator is through it: says
    /// "warm", waits for "go" (the parent reads every process's CPU time meanwhile)
    /// and lets the ranks go on. Returns whether it did so now.
    async fn measure_when_warm(&mut self, setup: &RankSetup) -> anyhow::Result<bool> {
        if self.measuring || !setup.warm() {
            return Ok(false);
        }
        println!("warm");
        expect_go(&mut self.stdin).await?;
        self.start_ns = mono_ns();
        self.measuring = true;
        self.go.send(2)?;
        Ok(true)
    }
}

async fn expect_go(stdin: &mut tokio::io::Lines<BufReader<tokio::io::Stdin>>) -> anyhow::Result<()> {
    match stdin.next_line().await? {
        Some(line) if line.trim() == "go" => Ok(()),
        other => bail!("expected go on stdin, got {other:?}"),
    }
}

/// Waits until every rank of the generator is connected (failing with the first
/// rank that could not), says "ready", waits for "go" on stdin and starts the ranks.
async fn ready_and_go(
    setup: &RankSetup,
    ranks: &mut JoinSet<anyhow::Result<Conn>>,
    go: tokio::sync::watch::Sender<u8>,
) -> anyhow::Result<Started> {
    loop {
        let moved = setup.ready_moved.notified();
        tokio::pin!(moved);
        moved.as_mut().enable();
        if setup.ready.load(Ordering::Acquire) == setup.count {
            break;
        }
        tokio::select! {
            () = moved => {}
            Some(ended) = ranks.join_next() => {
                ended??;
                bail!("a rank ended before the start");
            }
        }
    }
    println!("ready");
    let mut stdin = BufReader::new(tokio::io::stdin()).lines();
    expect_go(&mut stdin).await?;
    let start_ns = mono_ns();
    go.send(1)?;
    Ok(Started { start_ns, stdin, go, measuring: setup.warmup == 0 })
}

/// Prints the generator's report, then stays (with the connections the caller
/// holds) until the parent has read this process's CPU time and kills it.
async fn report(setup: &RankSetup, started: Started, through_channels: u32) -> anyhow::Result<()> {
    let Started { start_ns, mut stdin, .. } = started;
    let report = GeneratorReport {
        round_end_ns: setup.round_end.iter().map(|t| t.load(Ordering::Acquire)).collect(),
        start_ns,
        through_channels,
    };
    println!("{}", serde_json::to_string(&report)?);
    let _ = stdin.next_line().await;
    Ok(())
}

/// Runs ranks `first..first + count`: connects them, says "ready", waits for "go",
/// runs the rounds and prints a [`GeneratorReport`].
async fn generator(args: &Args, first: u32, count: u32) -> anyhow::Result<()> {
    rallypoint_net::raise_fd_limit();
    let addrs: Vec<String> = args.agent_addrs.as_deref().unwrap_or_default().split(',').map(str::to_owned).collect();
    if args.start {
        return start::generator(args.ranks, first, count, addrs, !args.no_incarnation).await;
    }
    let (go_tx, go_rx) = tokio::sync::watch::channel(0);
    let setup = RankSetup::new(args, count, go_rx);
    if args.channels {
        return channels::generator(setup, go_tx, addrs, first, count).await;
    }
    let setup = Arc::new(setup);
    let mut ranks = JoinSet::new();
    for rank in first..first + count {
        let addr = addrs[rank as usize % addrs.len()].clone();
        let setup = Arc::clone(&setup);
        ranks.spawn(async move {
            let (mut conn, mut buf) = setup.connected(rank, &addr).await?;
            let mut request = BytesMut::new();
            for k in 0..setup.total {
                setup.before_round(k).await?;
                // A new id per call, as the client library sends: the coordinator keeps replies by id.
                request.clear();
                encode_client_frame(&ClientFrame::Request { id: k as u64 + 1, request: bench_barrier() }, &mut request);
                conn.write_all(&request).await?;
                match conn.frame(&mut buf).await? {
                    ServerFrame::Reply { reply: Ok(Response::Done), .. } => {}
                    other => bail!("rank {rank}: barrier round {k} failed: {other:?}"),
                }
                setup.released(k, 1);
            }
            Ok(conn)
        });
    }
    let mut started = ready_and_go(&setup, &mut ranks, go_tx).await?;
    let mut conns = Vec::with_capacity(count as usize);
    while conns.len() < count as usize {
        let round_done = setup.round_done.notified();
        tokio::pin!(round_done);
        round_done.as_mut().enable();
        if started.measure_when_warm(&setup).await? {
            continue;
        }
        tokio::select! {
            () = round_done => {}
            Some(done) = ranks.join_next() => conns.push(done??),
        }
    }
    report(&setup, started, 0).await?;
    drop(conns);
    Ok(())
}

/// Connects and says hello (asking for shared replies in the same write if
/// `takes_shared`), retrying while the agent's listen backlog is full.
/// Rank `rank` of `ranks` as a load generator states it; with `incarnation`, with
/// one of its own, as each process of the client library states its own.
fn rank_identity(rank: u32, ranks: u32, incarnation: bool) -> Identity {
    let incarnation = incarnation.then(|| rallypoint_client::process_incarnation().wrapping_add(u64::from(rank)));
    Identity { host: "bench".into(), pid: std::process::id(), incarnation, ..Identity::ranked("bench", rank, ranks) }
}

async fn connect_rank(addr: &str, identity: &Identity, takes_shared: bool) -> anyhow::Result<Conn> {
    let mut hello = BytesMut::new();
    encode_preamble(&mut hello);
    encode_client_frame(&ClientFrame::Hello(identity.clone()), &mut hello);
    if takes_shared {
        encode_client_frame(&ClientFrame::TakeSharedReplies, &mut hello);
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut pause = Duration::from_millis(1);
    loop {
        match Conn::open(addr).await {
            Ok(mut conn) => {
                conn.write_all(&hello).await?;
                return Ok(conn);
            }
            Err(error) if Instant::now() < deadline => {
                tracing::debug!(%error, addr, "connect failed; retrying");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_millis(100));
            }
            Err(error) => return Err(error).with_context(|| format!("connecting to the agent at {addr}")),
        }
    }
}
