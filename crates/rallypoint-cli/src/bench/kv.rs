//! `rallypoint bench kv`: latency of single key-value operations from one client,
//! and throughput of `add` from many.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use rallypoint::{Client, Identity};
use serde::Serialize;
use tokio::task::JoinSet;

use super::{close_all, connect_many, ensure_fds, Bounded, Stats, Target};
use crate::parse;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Concurrent clients for the `add` throughput run, each with its own connection
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..))]
    clients: u32,
    /// Operations per kind for latency, and per client for throughput
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..))]
    ops: u32,
    /// Seconds each measurement may run; it stops early (and says how many it did) after that
    #[arg(long, value_name = "SECS", default_value = "60", value_parser = parse::secs)]
    max_secs: f64,
    /// Print one JSON object instead of text
    #[arg(long)]
    json: bool,
    /// Benchmark the coordinator at this address instead of starting one
    #[arg(long, value_name = "HOST:PORT")]
    addr: Option<String>,
}

#[derive(Debug, Serialize)]
struct Report {
    /// Per operation kind.
    latency: BTreeMap<&'static str, Stats>,
    add_throughput: Throughput,
}

#[derive(Debug, Serialize)]
struct Throughput {
    clients: u32,
    ops: u64,
    seconds: f64,
    ops_per_s: f64,
}

/// The operations timed, in the order they run.
const OPS: [&str; 6] = ["set", "get", "add", "check", "compare_set", "multi_get"];
/// Keys read by get/check/multi_get, written by set.
const KEYS: usize = 16;
const VALUE: &[u8] = b"0123456789abcdef0123456789abcdef";

pub async fn run(args: Args) -> anyhow::Result<()> {
    ensure_fds(u64::from(args.clients) + 64)?;
    let target = Target::start(args.addr.clone()).await?;
    let report = measure(&args, &target).await;
    target.stop().await;
    let report = report?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        for (op, s) in OPS.iter().filter_map(|&op| Some((op, report.latency.get(op)?))) {
            println!(
                "{op:<12} median {:>8.1} µs  p99 {:>8.1} µs  mean {:>8.1} µs  ({} ops)",
                s.median_us, s.p99_us, s.mean_us, s.count
            );
        }
        let t = &report.add_throughput;
        println!("add from {} clients: {:.0} ops/s ({} ops in {:.2} s)", t.clients, t.ops_per_s, t.ops, t.seconds);
    }
    Ok(())
}

async fn measure(args: &Args, target: &Target) -> anyhow::Result<Report> {
    let job = format!("bench-kv-{}", std::process::id());
    let timeout = Duration::from_secs(60);
    let max = Duration::from_secs_f64(args.max_secs);
    let mut clients = connect_many(&target.addr, 0..1, |_| Identity::anonymous(&job), timeout).await?;
    let client = clients.pop().context("no client connected")?;
    let latency = latencies(&client, args.ops, max).await;
    close_all(vec![client]).await;
    let latency = latency?;

    let clients = connect_many(&target.addr, 0..args.clients, |_| Identity::anonymous(&job), timeout).await?;
    let add_throughput = throughput(clients, args.ops, max).await?;
    Ok(Report { latency, add_throughput })
}

async fn latencies(client: &Client, ops: u32, max: Duration) -> anyhow::Result<BTreeMap<&'static str, Stats>> {
    let keys: Vec<String> = (0..KEYS).map(|i| format!("bench/key/{i}")).collect();
    for key in &keys {
        client.set(key, VALUE).await?;
    }
    client.set("bench/cas", "0").await?;

    let mut samples: BTreeMap<&'static str, Vec<Duration>> = BTreeMap::new();
    // Times one operation into `samples[$name]`, `ops` times at most and no longer than `max`.
    macro_rules! time {
        ($name:literal, |$i:ident| $op:expr) => {{
            let taken = samples.entry($name).or_default();
            for $i in Bounded::new(ops, max) {
                let at = Instant::now();
                $op;
                taken.push(at.elapsed());
            }
        }};
    }
    time!("set", |i| client.set(&keys[i as usize % KEYS], VALUE).await?);
    time!("get", |i| client.get(&keys[i as usize % KEYS], None).await?);
    time!("add", |_i| client.add("bench/counter", 1).await?);
    time!("check", |i| client.check(&keys[i as usize % KEYS..][..1]).await?);
    let mut current = 0u64;
    time!("compare_set", |_i| {
        let next = (current + 1).to_string();
        let stored = client.compare_set("bench/cas", current.to_string(), &next).await?;
        ensure!(stored == next.as_bytes(), "compare_set did not swap: the benchmark's key changed under it");
        current += 1;
    });
    time!("multi_get", |_i| client.multi_get(&keys, None).await?);

    Ok(samples.into_iter().filter_map(|(name, mut taken)| Some((name, Stats::of(&mut taken)?))).collect())
}

async fn throughput(clients: Vec<Client>, ops: u32, max: Duration) -> anyhow::Result<Throughput> {
    const KEY: &str = "bench/throughput";
    let n = clients.len() as u32;
    let start = Instant::now();
    let mut running = JoinSet::new();
    for client in clients {
        running.spawn(async move {
            let mut done = 0u64;
            for _ in Bounded::new(ops, max) {
                if let Err(err) = client.add(KEY, 1).await {
                    return (client, done, Err(err));
                }
                done += 1;
            }
            (client, done, Ok(()))
        });
    }
    let mut clients = Vec::new();
    let mut total = 0u64;
    let mut failure = None;
    while let Some(joined) = running.join_next().await {
        let (client, done, result) = joined?;
        clients.push(client);
        total += done;
        if let Err(err) = result {
            failure.get_or_insert(err);
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    // Every add must have counted exactly once.
    let counted = match clients.first() {
        Some(client) => Some(client.add(KEY, 0).await),
        None => None,
    };
    close_all(clients).await;
    if let Some(err) = failure {
        return Err(err).context("an add failed");
    }
    if let Some(counted) = counted {
        let counted = counted?;
        ensure!(counted == total as i64, "{total} adds were acknowledged but the counter is {counted}");
    }
    Ok(Throughput {
        clients: n,
        ops: total,
        seconds: (seconds * 1000.0).round() / 1000.0,
        ops_per_s: (total as f64 / seconds).round(),
    })
}
