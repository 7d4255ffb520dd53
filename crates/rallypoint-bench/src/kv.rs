//! `rallypoint bench kv`: latency of single key-value operations from one client,
//! and throughput of `add` on one shared counter from 1, 8, 64, 512 clients, with
//! `--depth` requests in flight per client. Over the native protocol or torch's
//! TCPStore protocol.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use rallypoint_client::{Client, Identity};
use serde::Serialize;
use tokio::task::JoinSet;

use crate::tcpstore::{self, StoreConn};
use crate::{
    close_all, connect_many, ensure_fds, on_target, options, print_report, Bounded, Protocol, Sources, Stats, Target,
};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Client counts of the `add` throughput runs (comma-separated), each client with
    /// its own connection
    #[arg(long, value_delimiter = ',', default_value = "1,8,64,512", value_parser = clap::value_parser!(u32).range(1..))]
    clients: Vec<u32>,
    /// Requests in flight per client in the throughput runs. Native: that many
    /// concurrent calls pipelined on the client's one connection; TCPStore (which has
    /// no request ids and answers in order): that many ADDs written back to back, then
    /// their replies read
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=4096))]
    depth: u32,
    /// Timed operations per kind for latency
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u32).range(1..))]
    ops: u32,
    /// `add`s per throughput run, shared out over its clients
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u32).range(1..))]
    adds: u32,
    /// Seconds each measurement may run; it stops early (and says how many it did) after that
    #[arg(long, value_name = "SECS", default_value = "60", value_parser = crate::secs)]
    max_secs: f64,
    /// Wire protocol: `native`, or `tcpstore` (torch's, so `--addr` may be torch's own
    /// server; `get` and `multi_get` are WAIT + GET as torch's client does them)
    #[arg(long, value_enum, default_value_t = Protocol::Native)]
    protocol: Protocol,
    /// Print one JSON object instead of text
    #[arg(long)]
    json: bool,
    /// Benchmark the server at this address instead of starting a coordinator
    #[arg(long, value_name = "HOST:PORT")]
    addr: Option<String>,
}

#[derive(Debug, Serialize)]
struct Report {
    protocol: Protocol,
    /// Per operation kind.
    latency: BTreeMap<&'static str, Stats>,
    add_throughput: Vec<Throughput>,
}

#[derive(Debug, Serialize)]
struct Throughput {
    clients: u32,
    depth: u32,
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
    let most = args.clients.iter().copied().max().unwrap_or(1);
    ensure_fds(u64::from(most) + 64)?;
    let report = on_target(args.addr.clone(), async |target| measure(&args, target).await).await?;
    print_report(&report, args.json, |report| {
        for (op, s) in OPS.iter().filter_map(|&op| Some((op, report.latency.get(op)?))) {
            println!(
                "{op:<12} median {:>8.1} µs  p99 {:>8.1} µs  mean {:>8.1} µs  ({} ops)",
                s.times.median_us, s.times.p99_us, s.times.mean_us, s.count
            );
        }
        for t in &report.add_throughput {
            println!(
                "add from {} clients, {} in flight each: {:.0} ops/s ({} ops in {:.2} s)",
                t.clients, t.depth, t.ops_per_s, t.ops, t.seconds
            );
        }
    })
}

async fn measure(args: &Args, target: &Target) -> anyhow::Result<Report> {
    // Keys of this run only, so that runs against one server do not mix.
    let tag = format!("rpbench-kv-{}", std::process::id());
    let timeout = Duration::from_secs(60);
    let max = Duration::from_secs_f64(args.max_secs);
    let mut latency = BTreeMap::new();
    let mut add_throughput = Vec::new();
    match args.protocol {
        Protocol::Native => {
            let mut one = connect_many(0..1, |_| options(&target.addr, Identity::anonymous(&tag), timeout)).await?;
            let client = one.pop().context("no client connected")?;
            let measured = native_latencies(&client, args.ops, max).await;
            close_all(vec![client]).await;
            latency = measured?;
            for &n in &args.clients {
                let clients = connect_many(0..n, |_| options(&target.addr, Identity::anonymous(&tag), timeout)).await?;
                let key = format!("bench/throughput/{n}");
                add_throughput.push(native_throughput(clients, &key, args.adds, args.depth, max).await?);
            }
        }
        Protocol::Tcpstore => {
            let addr = tcpstore::resolve(&target.addr)?;
            // At most 512 clients: never short of ports.
            let no_bind = Sources::plan(Some(0), 1);
            let mut conn = StoreConn::connect(addr, None).await?;
            for (op, samples) in store_latencies(&mut conn, &tag, args.ops, max).await? {
                latency.insert(op, samples);
            }
            for &n in &args.clients {
                let conns = tcpstore::connect_many(addr, 0..n, no_bind, timeout).await?;
                let key = format!("/{tag}/throughput/{n}");
                add_throughput.push(store_throughput(conns, &mut conn, &key, args.adds, args.depth, max).await?);
            }
        }
    }
    Ok(Report { protocol: args.protocol, latency, add_throughput })
}

/// Times one operation into `samples[$name]`, `ops` times at most and no longer than `max`.
macro_rules! time {
    ($samples:ident, $ops:expr, $max:expr, $name:literal, |$i:ident| $op:expr) => {{
        let taken = $samples.entry($name).or_default();
        for $i in Bounded::new($ops, $max) {
            let at = Instant::now();
            $op;
            taken.push(at.elapsed());
        }
    }};
}

fn summarize(samples: BTreeMap<&'static str, Vec<Duration>>) -> BTreeMap<&'static str, Stats> {
    samples.into_iter().filter_map(|(name, mut taken)| Some((name, Stats::of(&mut taken)?))).collect()
}

async fn native_latencies(client: &Client, ops: u32, max: Duration) -> anyhow::Result<BTreeMap<&'static str, Stats>> {
    let keys: Vec<String> = (0..KEYS).map(|i| format!("bench/key/{i}")).collect();
    for key in &keys {
        client.set(key, VALUE).await?;
    }
    client.set("bench/cas", "0").await?;

    let mut samples: BTreeMap<&'static str, Vec<Duration>> = BTreeMap::new();
    time!(samples, ops, max, "set", |i| client.set(&keys[i as usize % KEYS], VALUE).await?);
    time!(samples, ops, max, "get", |i| client.get(&keys[i as usize % KEYS], None).await?);
    time!(samples, ops, max, "add", |_i| client.add("bench/counter", 1).await?);
    time!(samples, ops, max, "check", |i| client.check(&keys[i as usize % KEYS..][..1]).await?);
    let mut current = 0u64;
    time!(samples, ops, max, "compare_set", |_i| {
        let next = (current + 1).to_string();
        let stored = client.compare_set("bench/cas", current.to_string(), &next).await?;
        ensure!(stored == next.as_bytes(), "compare_set did not swap: the benchmark's key changed under it");
        current += 1;
    });
    time!(samples, ops, max, "multi_get", |_i| client.multi_get(&keys, None).await?);
    Ok(summarize(samples))
}

/// The same operations over TCPStore. `set` has no reply there: its time is the send.
async fn store_latencies(
    conn: &mut StoreConn,
    tag: &str,
    ops: u32,
    max: Duration,
) -> anyhow::Result<BTreeMap<&'static str, Stats>> {
    let keys: Vec<String> = (0..KEYS).map(|i| format!("/{tag}/key/{i}")).collect();
    for key in &keys {
        conn.set(key, VALUE).await?;
    }
    let cas = format!("/{tag}/cas");
    let counter = format!("/{tag}/counter");
    conn.set(&cas, b"0").await?;

    let mut samples: BTreeMap<&'static str, Vec<Duration>> = BTreeMap::new();
    time!(samples, ops, max, "set", |i| conn.set(&keys[i as usize % KEYS], VALUE).await?);
    time!(samples, ops, max, "get", |i| {
        let value = conn.get(&keys[i as usize % KEYS]).await?;
        ensure!(value == VALUE, "get returned {} bytes, not the value set", value.len());
    });
    time!(samples, ops, max, "add", |_i| conn.add(&counter, 1).await?);
    time!(samples, ops, max, "check", |i| {
        ensure!(conn.check(&[&keys[i as usize % KEYS]]).await?, "check: a key set before is missing");
    });
    let mut current = 0u64;
    time!(samples, ops, max, "compare_set", |_i| {
        let next = (current + 1).to_string();
        let stored = conn.compare_set(&cas, current.to_string().as_bytes(), next.as_bytes()).await?;
        ensure!(stored == next.as_bytes(), "compare_set did not swap: the benchmark's key changed under it");
        current += 1;
    });
    time!(samples, ops, max, "multi_get", |_i| {
        ensure!(conn.multi_get(&keys).await?.len() == KEYS, "multi_get returned the wrong number of values");
    });
    Ok(summarize(samples))
}

fn throughput(clients: u32, depth: u32, ops: u64, started: Instant) -> Throughput {
    let seconds = started.elapsed().as_secs_f64();
    Throughput {
        clients,
        depth,
        ops,
        seconds: (seconds * 1000.0).round() / 1000.0,
        ops_per_s: (ops as f64 / seconds).round(),
    }
}

/// `adds` spread over the clients, each running `depth` calls at once on its connection.
async fn native_throughput(
    clients: Vec<Client>,
    key: &str,
    adds: u32,
    depth: u32,
    max: Duration,
) -> anyhow::Result<Throughput> {
    let n = clients.len() as u32;
    let per_task = adds.div_ceil(n * depth);
    let started = Instant::now();
    let mut running = JoinSet::new();
    for client in &clients {
        for _ in 0..depth {
            let (client, key) = (client.clone(), key.to_owned());
            running.spawn(async move {
                let mut done = 0u64;
                for _ in Bounded::new(per_task, max) {
                    client.add(&key, 1).await?;
                    done += 1;
                }
                anyhow::Ok(done)
            });
        }
    }
    let mut total = 0u64;
    let mut failure = None;
    while let Some(joined) = running.join_next().await {
        match joined.context("an add task failed").and_then(|done| done) {
            Ok(done) => total += done,
            Err(err) => {
                failure.get_or_insert(err);
            }
        }
    }
    let result = throughput(n, depth, total, started);
    // Every add must have counted exactly once.
    let counted = match clients.first() {
        Some(client) => Some(client.add(key, 0).await),
        None => None,
    };
    close_all(clients).await;
    if let Some(err) = failure {
        return Err(err.context("an add failed"));
    }
    if let Some(counted) = counted {
        let counted = counted?;
        ensure!(counted == total as i64, "{total} adds were acknowledged but the counter is {counted}");
    }
    Ok(result)
}

/// `adds` spread over the TCPStore connections, each sending `depth` ADDs at a
/// time; `check` (another connection) reads the counter afterwards.
async fn store_throughput(
    conns: Vec<StoreConn>,
    check: &mut StoreConn,
    key: &str,
    adds: u32,
    depth: u32,
    max: Duration,
) -> anyhow::Result<Throughput> {
    let n = conns.len() as u32;
    let batches = adds.div_ceil(n * depth);
    let started = Instant::now();
    let mut running = JoinSet::new();
    for mut conn in conns {
        let key = key.to_owned();
        running.spawn(async move {
            let mut done = 0u64;
            for _ in Bounded::new(batches, max) {
                conn.add_pipelined(&key, 1, depth).await?;
                done += u64::from(depth);
            }
            anyhow::Ok(done)
        });
    }
    let mut total = 0u64;
    while let Some(joined) = running.join_next().await {
        total += joined.context("an add task failed")?.context("an add failed")?;
    }
    let result = throughput(n, depth, total, started);
    let counted = check.add(key, 0).await?;
    ensure!(counted == total as i64, "{total} adds were acknowledged but the counter is {counted}");
    Ok(result)
}
