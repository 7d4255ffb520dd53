//! `rallypoint bench tcpstore-start`: a job's start on a TCPStore server (torch's
//! own, or rallypoint's), done the way torch's elastic utilities do it, as the
//! anchor of `bench hierarchy --start`.
//!
//! N ranks, one connection each, all started at once: each connects with torch's
//! handshake (VALIDATE, PING), passes `torch.distributed.elastic.utils.store.barrier`
//! (ADD to a counter; the last arrival SETs the last-member key; every rank WAITs
//! for it), then all-gathers its address with `synchronize` (SET its key, WAIT for
//! all N keys and MULTI_GET them, then the non-blocking "finished" barrier, which
//! rank 0 waits out). The requests are torch 2.15's, spoken directly by this
//! process, so that what is measured is the server and the wire, not Python or
//! threads: N ranks as Python threads in one process measure the interpreter.
//! Each rank checks that it got every address, its neighbour's included, then
//! drops the values as it reads them.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, ensure, Context};
use bytes::Bytes;
use serde::Serialize;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::hierarchy::start::{address, Phases};
use crate::hierarchy::CONNECTING;
use crate::tcpstore::{resolve, StoreConn};
use crate::{ensure_fds, mono_ns, print_report};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The TCPStore server (torch's, or `rallypoint serve`)
    #[arg(long, value_name = "HOST:PORT")]
    addr: String,
    /// Ranks, each with its own connection
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
    ranks: u32,
    /// Seconds the whole start may take before the benchmark fails
    #[arg(long, value_name = "SECS", default_value = "900", value_parser = crate::secs)]
    timeout: f64,
    /// Print one JSON object instead of text
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
struct Report {
    op: &'static str,
    protocol: &'static str,
    ranks: u32,
    value_bytes: usize,
    /// From the start until the last rank had connected (handshake done).
    registered_ms: f64,
    /// ... until the last rank was through the store barrier.
    barrier_ms: f64,
    /// ... until the last rank had every address: the start, end to end.
    all_gather_ms: f64,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    ensure_fds(u64::from(args.ranks) + 64)?;
    let addr = resolve(&args.addr)?;
    let limit = Duration::from_secs_f64(args.timeout);
    let n = args.ranks;
    let phases = Arc::new(Phases::new(n));
    let connecting = Arc::new(Semaphore::new(CONNECTING));
    // Keys of a fresh prefix: a server may have served an earlier start.
    let prefix = Arc::new(format!("start{}/", mono_ns()));
    let t0 = mono_ns();
    let mut ranks = JoinSet::new();
    for rank in 0..n {
        let (phases, connecting, prefix) = (Arc::clone(&phases), Arc::clone(&connecting), Arc::clone(&prefix));
        ranks.spawn(async move {
            let mut conn = {
                let _slot = connecting.acquire().await?;
                StoreConn::connect(addr, None).await.with_context(|| format!("rank {rank} connecting"))?
            };
            phases.passed(0);
            store_barrier(&mut conn, n, &format!("{prefix}barrier/"), false).await?;
            phases.passed(1);
            conn.set(&format!("{prefix}addr/{rank}"), &address(rank)).await?;
            let keys: Vec<String> = (0..n).map(|r| format!("{prefix}addr/{r}")).collect();
            let (mut got, mut wrong) = (0u32, None);
            conn.multi_get_each(&keys, |i, value| {
                got += 1;
                if value[..] != address(i as u32)[..] && wrong.is_none() {
                    wrong = Some(i);
                }
            })
            .await?;
            ensure!(got == n && wrong.is_none(), "rank {rank}: got {got} addresses, wrong: {wrong:?}");
            // `get_all`'s closing barrier, waited out by rank 0 alone.
            store_barrier(&mut conn, n, &format!("{prefix}addr//finished"), rank != 0).await?;
            phases.passed(2);
            anyhow::Ok(conn)
        });
    }
    let mut conns = Vec::with_capacity(n as usize);
    let all = async {
        while let Some(done) = ranks.join_next().await {
            conns.push(done??);
        }
        anyhow::Ok(())
    };
    match tokio::time::timeout(limit, all).await {
        Ok(done) => done?,
        Err(_) => bail!("the start did not finish within {limit:?}"),
    }
    let end_ns = phases.end_ns();
    let phase_ms = |p: usize| (end_ns[p].saturating_sub(t0) as f64 / 1e5).round() / 10.0;
    let report = Report {
        op: "start",
        protocol: "tcpstore",
        ranks: n,
        value_bytes: address(0).len(),
        registered_ms: phase_ms(0),
        barrier_ms: phase_ms(1),
        all_gather_ms: phase_ms(2),
    };
    drop(conns);
    print_report(&report, args.json, |r| {
        println!(
            "TCPStore start of {} ranks: all connected at {:.0} ms, through the store barrier at {:.0} ms, all-gathered at {:.0} ms",
            r.ranks, r.registered_ms, r.barrier_ms, r.all_gather_ms
        );
    })
}

/// torch's elastic store barrier under `prefix`: ADD to the member count, the last
/// member SETs the last-member key, and each rank WAITs for it unless `nowait`.
async fn store_barrier(conn: &mut StoreConn, n: u32, prefix: &str, nowait: bool) -> anyhow::Result<()> {
    let last = format!("{prefix}last_member");
    if conn.add(&format!("{prefix}num_members"), 1).await? == i64::from(n) {
        conn.set(&last, b"<val_ignored>").await?;
    }
    if !nowait {
        conn.wait(&[Bytes::from(last)]).await?;
    }
    Ok(())
}
