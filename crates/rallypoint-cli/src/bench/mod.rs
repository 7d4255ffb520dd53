//! `rallypoint bench`: barrier round times, key-value latency and throughput,
//! and the coordinator's memory per idle connection.

mod barrier;
mod kv;

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Subcommand;
use rallypoint::{Client, ConnectOptions, Identity};
use serde::Serialize;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// N clients, each with its own connection, pass one barrier R times; reports
    /// round times and the server's memory per idle connection.
    Barrier(barrier::Args),
    /// Latency of single key-value operations, and throughput of `add` from N clients.
    Kv(kv::Args),
}

pub async fn run(command: BenchCommand) -> anyhow::Result<()> {
    match command {
        BenchCommand::Barrier(args) => barrier::run(args).await,
        BenchCommand::Kv(args) => kv::run(args).await,
    }
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
        if let Some(addr) = addr {
            return Ok(Target { addr, server: None });
        }
        let exe = std::env::current_exe().context("finding the rallypoint executable")?;
        let mut command = Command::new(exe);
        command
            .args(["serve", "--listen", "127.0.0.1:0", "--print-addr"])
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
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.server.as_ref()?.pid)).ok()?;
        let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
        let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    }

    async fn stop(self) {
        if let Some(mut server) = self.server {
            // It may have died already; either way it is gone afterwards.
            let _ = server.child.kill().await;
        }
    }
}

/// Raises the soft file-descriptor limit and checks that `needed` fit under it.
fn ensure_fds(needed: u64) -> anyhow::Result<()> {
    let limit = rallypoint::raise_fd_limit();
    if needed > limit {
        bail!("this benchmark needs about {needed} file descriptors, but the limit is {limit} (see `ulimit -Hn`)");
    }
    Ok(())
}

/// Connects one client per id in `ids`, each its own connection, a bounded number
/// at a time so the listen backlog never overflows. Returns them in no set order.
async fn connect_many(
    addr: &str,
    ids: Range<u32>,
    identity: impl Fn(u32) -> Identity,
    timeout: Duration,
) -> anyhow::Result<Vec<Client>> {
    const IN_FLIGHT: usize = 256;
    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
    let mut connecting = JoinSet::new();
    let mut clients = Vec::with_capacity(ids.len());
    for i in ids {
        let slot = Arc::clone(&slots).acquire_owned().await?;
        let options = ConnectOptions { addr: addr.to_owned(), identity: identity(i), timeout };
        connecting.spawn(async move {
            let client = Client::connect_with(options).await;
            drop(slot);
            client.with_context(|| format!("connecting client {i}"))
        });
        // Collect as we go so that a failure stops the loop early.
        while let Some(connected) = connecting.try_join_next() {
            clients.push(connected??);
        }
    }
    while let Some(connected) = connecting.join_next().await {
        clients.push(connected??);
    }
    Ok(clients)
}

/// Closes every client cleanly (concurrently: one by one would take N round trips).
async fn close_all(clients: Vec<Client>) {
    let mut closing: JoinSet<_> = clients.into_iter().map(Client::close).collect();
    while closing.join_next().await.is_some() {}
}

/// Percentiles of a set of durations, in microseconds.
#[derive(Debug, Clone, Copy, Serialize)]
struct Stats {
    count: usize,
    median_us: f64,
    p99_us: f64,
    mean_us: f64,
    min_us: f64,
    max_us: f64,
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
            median_us: us(pick(0.5)),
            p99_us: us(pick(0.99)),
            mean_us: us(mean),
            min_us: us(min),
            max_us: us(max),
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
        assert_eq!((stats.median_us, stats.p99_us, stats.min_us, stats.max_us), (50.0, 99.0, 1.0, 100.0));
        assert_eq!(stats.mean_us, 50.5);
        assert!(Stats::of(&mut []).is_none());
    }

    #[test]
    fn bounded_by_count_and_time() {
        assert_eq!(Bounded::new(3, Duration::from_secs(60)).count(), 3);
        assert_eq!(Bounded::new(3, Duration::ZERO).count(), 0);
    }
}
