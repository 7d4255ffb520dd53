//! `rallypoint bench all-gather`: N clients, each with its own connection and rank,
//! all-gather a value of `--size` bytes each, R rounds. The coordinator collects
//! the N values and sends every rank all of them: N requests in, N × N × size bytes
//! out per round.
//!
//! With `--agents K` the ranks reach the coordinator through K node agents (child
//! processes, as `bench hierarchy` starts them) over Unix sockets, rank r through
//! agent r mod K: the coordinator sends each agent the result once, and each agent
//! hands it to its ranks as one shared memory file (docs/PROTOCOL.md, section 13),
//! or, with `--no-shared-replies`, copies it to each rank's socket.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use rallypoint_client::{Client, Identity, Members};
use serde::Serialize;

use crate::hierarchy::{Agents, Transport};
use crate::{
    close_all, connect_many, ensure_fds, mono_ns, on_target, options, print_report, round_stats, run_rounds, Round,
    Target, Times,
};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Clients (ranks), each with its own connection, all in the one all-gather
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    clients: u32,
    /// Bytes each rank contributes
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
    size: u32,
    /// Measured rounds
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Unmeasured rounds before them
    #[arg(long, default_value_t = 3)]
    warmup: u32,
    /// Seconds one round (and connecting one client) may take before the benchmark fails
    #[arg(long, value_name = "SECS", default_value = "120", value_parser = crate::secs)]
    timeout: f64,
    /// Print one JSON object instead of text
    #[arg(long)]
    json: bool,
    /// Benchmark the coordinator at this address instead of starting one
    #[arg(long, value_name = "HOST:PORT")]
    addr: Option<String>,
    /// Reach the coordinator through this many node agents over Unix sockets
    /// (0: every rank connects to it directly)
    #[arg(long, default_value_t = 0)]
    agents: u32,
    /// With --agents: ranks take the result through their sockets, not as shared memory
    #[arg(long)]
    no_shared_replies: bool,
}

#[derive(Debug, Serialize)]
struct Report {
    op: &'static str,
    clients: u32,
    value_bytes: u32,
    rounds: u32,
    warmup_rounds: u32,
    agents: u32,
    /// Ranks behind agents took the result as shared memory.
    shared_replies: bool,
    #[serde(flatten)]
    round: Times,
    connect_ms: f64,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    ensure_fds(u64::from(args.clients) + 64)?;
    let report = on_target(args.addr.clone(), async |target| measure(&args, target).await).await?;
    print_report(&report, args.json, |r| {
        let via = match (r.agents, r.shared_replies) {
            (0, _) => "directly".to_owned(),
            (k, true) => format!("through {k} agent(s), shared replies"),
            (k, false) => format!("through {k} agent(s), replies copied to each socket"),
        };
        println!(
            "all-gather of {} B per rank, {} clients {via}, {} rounds (+{} warm-up); connecting took {:.0} ms",
            r.value_bytes, r.clients, r.rounds, r.warmup_rounds, r.connect_ms
        );
        println!("round time: {}", r.round);
    })
}

async fn measure(args: &Args, target: &Target) -> anyhow::Result<Report> {
    let agents = Agents::start(args.agents, &target.addr, Transport::Unix).await?;
    let addrs = if agents.addrs.is_empty() { std::slice::from_ref(&target.addr) } else { &agents.addrs[..] };
    let report = measure_via(args, addrs).await;
    agents.stop().await;
    report
}

/// Runs the rounds with rank r connected to `addrs[r % addrs.len()]`.
async fn measure_via(args: &Args, addrs: &[String]) -> anyhow::Result<Report> {
    let n = args.clients;
    let job = format!("bench-all-gather-{}", std::process::id());
    let timeout = Duration::from_secs_f64(args.timeout);
    let started = Instant::now();
    let clients = connect_many(0..n, |rank| {
        let addr = &addrs[rank as usize % addrs.len()];
        let mut options = options(addr, Identity::ranked(&job, rank, n), timeout);
        options.shared_replies = !args.no_shared_replies;
        options
    })
    .await?;
    let connect_ms = (started.elapsed().as_secs_f64() * 1e4).round() / 10.0;

    let round = Arc::new(AllGatherRound { size: args.size as usize, n, timeout });
    let start = mono_ns();
    let total = (args.warmup + args.rounds) as usize;
    let (clients, ends) = run_rounds(clients, total, round, None).await;
    close_all(clients).await;
    let ends = ends.context("an all-gather round failed")?;
    let stats = round_stats(start, &ends, args.warmup as usize).context("no rounds measured")?;
    Ok(Report {
        op: "all_gather",
        clients: n,
        value_bytes: args.size,
        rounds: args.rounds,
        warmup_rounds: args.warmup,
        agents: args.agents,
        shared_replies: args.agents > 0 && !args.no_shared_replies,
        round: stats.times,
        connect_ms,
    })
}

/// Each round is one all-gather of `size` bytes per rank, checked.
struct AllGatherRound {
    size: usize,
    n: u32,
    timeout: Duration,
}

impl Round<Client> for AllGatherRound {
    async fn round(&self, client: &mut Client, r: usize) -> anyhow::Result<()> {
        let (size, n) = (self.size, self.n);
        // Distinct contents per rank and round, so a stale or misplaced value shows.
        let rank = client.identity().rank.unwrap_or(0);
        let value = vec![(rank as usize + r) as u8; size];
        let gathered = client.all_gather("bench", Members::World, &value, Some(self.timeout)).await?;
        ensure!(gathered.len() == n as usize, "gathered {} values, not {n}", gathered.len());
        let peer = (rank as usize + 1) % n as usize;
        ensure!(
            gathered[peer].len() == size && gathered[peer].first() == Some(&((peer + r) as u8)),
            "rank {peer}'s value is wrong in round {r}"
        );
        Ok(())
    }
}
