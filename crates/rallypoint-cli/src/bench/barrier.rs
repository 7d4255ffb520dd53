//! `rallypoint bench barrier`: N clients in one barrier, R rounds; or, with
//! `--op ping`, the same rounds of plain round trips: the floor a barrier is
//! measured against.

use std::time::{Duration, Instant};

use anyhow::Context;
use rallypoint::{Identity, Members};
use serde::Serialize;
use tokio::task::JoinSet;

use super::{close_all, connect_many, ensure_fds, Stats, Target};
use crate::parse;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Clients in one process, each with its own connection, all in the one barrier
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    clients: u32,
    /// Measured rounds
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Unmeasured rounds before them
    #[arg(long, default_value_t = 5)]
    warmup: u32,
    /// Seconds one round (and connecting one client) may take before the benchmark fails
    #[arg(long, value_name = "SECS", default_value = "120", value_parser = parse::secs)]
    timeout: f64,
    /// Print one JSON object instead of text
    #[arg(long)]
    json: bool,
    /// Benchmark the coordinator at this address instead of starting one
    /// (then no server memory is reported)
    #[arg(long, value_name = "HOST:PORT")]
    addr: Option<String>,
    /// What each client does per round: `barrier`, or `ping` (one round trip each, not
    /// held in step: the cost of N requests and N replies, the floor of a barrier)
    #[arg(long, value_enum, default_value_t = Op::Barrier)]
    op: Op,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Op {
    Barrier,
    Ping,
}

#[derive(Debug, Serialize)]
struct Report {
    op: Op,
    clients: u32,
    rounds: u32,
    warmup_rounds: u32,
    median_us: f64,
    p99_us: f64,
    mean_us: f64,
    min_us: f64,
    max_us: f64,
    connect_ms: f64,
    /// The server's resident memory with one client connected.
    server_rss_one_conn_bytes: Option<u64>,
    /// ... and with all clients connected and idle.
    server_rss_idle_bytes: Option<u64>,
    /// The difference per connection after the first.
    server_rss_per_conn_bytes: Option<u64>,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    // Each client is one socket; some slack for the runtime and stdio.
    ensure_fds(u64::from(args.clients) + 64)?;
    let target = Target::start(args.addr.clone()).await?;
    let report = measure(&args, &target).await;
    target.stop().await;
    let report = report?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_text(&report);
    }
    Ok(())
}

async fn measure(args: &Args, target: &Target) -> anyhow::Result<Report> {
    let n = args.clients;
    let job = format!("bench-barrier-{}", std::process::id());
    let timeout = Duration::from_secs_f64(args.timeout);
    let identity = |rank| Identity::ranked(&job, rank, n);
    // Settles a moment, so the server has admitted everyone and is idle.
    let settle = || tokio::time::sleep(Duration::from_millis(500));

    if !args.json {
        eprintln!("connecting {n} clients to {} ...", target.addr);
    }
    // The first connection also pays one-off costs (the job's state, the runtime's
    // threads touching their stacks): weigh the server after it, not before.
    let started = Instant::now();
    let mut clients = connect_many(&target.addr, 0..1, identity, timeout).await?;
    let mut connecting = started.elapsed();
    settle().await;
    let rss_before = target.server_rss();
    let started = Instant::now();
    clients.extend(connect_many(&target.addr, 1..n, identity, timeout).await?);
    connecting += started.elapsed();
    settle().await;
    let rss_idle = target.server_rss();

    if !args.json {
        eprintln!("running {} rounds (+{} warm-up) ...", args.rounds, args.warmup);
    }
    // Every client loops through all rounds on its own, as ranks of a training job
    // do, and notes when each barrier released it.
    let total = (args.warmup + args.rounds) as usize;
    let op = args.op;
    let start = Instant::now();
    let mut running = JoinSet::new();
    for client in clients {
        running.spawn(async move {
            let mut released = Vec::with_capacity(total);
            for _ in 0..total {
                let result = match op {
                    Op::Barrier => client.barrier("bench", Members::World, Some(timeout)).await,
                    Op::Ping => client.ping().await,
                };
                if let Err(err) = result {
                    return (client, Err(err));
                }
                released.push(Instant::now());
            }
            (client, Ok(released))
        });
    }
    // A round ends when its last client is released (or, for pings, answered).
    let mut round_end = vec![start; total];
    let mut clients = Vec::with_capacity(n as usize);
    let mut failure = None;
    while let Some(joined) = running.join_next().await {
        let (client, result) = joined?;
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
    close_all(clients).await;
    if let Some(err) = failure {
        return Err(err).context("a barrier round failed");
    }

    // A round runs from the end of the one before to its own end. Pinging clients are
    // not held in step, so a ping round is the throughput-bound floor of a barrier round:
    // the same N requests and N replies, without the waiting.
    let warmup = args.warmup as usize;
    let mut rounds: Vec<Duration> =
        (warmup..total).map(|r| round_end[r] - if r == 0 { start } else { round_end[r - 1] }).collect();
    let stats = Stats::of(&mut rounds).context("no rounds measured")?;
    let per_conn = match (rss_before, rss_idle) {
        (Some(before), Some(idle)) if n > 1 => Some(idle.saturating_sub(before) / u64::from(n - 1)),
        _ => None,
    };
    Ok(Report {
        op: args.op,
        clients: n,
        rounds: args.rounds,
        warmup_rounds: args.warmup,
        median_us: stats.median_us,
        p99_us: stats.p99_us,
        mean_us: stats.mean_us,
        min_us: stats.min_us,
        max_us: stats.max_us,
        connect_ms: (connecting.as_secs_f64() * 1e4).round() / 10.0,
        server_rss_one_conn_bytes: rss_before,
        server_rss_idle_bytes: rss_idle,
        server_rss_per_conn_bytes: per_conn,
    })
}

fn print_text(r: &Report) {
    println!(
        "barrier, {} clients, {} rounds (+{} warm-up); connecting took {:.0} ms",
        r.clients, r.rounds, r.warmup_rounds, r.connect_ms
    );
    println!(
        "round time: median {:.1} µs, p99 {:.1} µs, mean {:.1} µs, min {:.1} µs, max {:.1} µs",
        r.median_us, r.p99_us, r.mean_us, r.min_us, r.max_us
    );
    if let (Some(before), Some(idle), Some(per_conn)) =
        (r.server_rss_one_conn_bytes, r.server_rss_idle_bytes, r.server_rss_per_conn_bytes)
    {
        println!(
            "server memory (RSS): {:.1} MiB with 1 connection, {:.1} MiB with {} idle connections: {} bytes per connection",
            before as f64 / 1048576.0,
            idle as f64 / 1048576.0,
            r.clients,
            per_conn
        );
    }
}
