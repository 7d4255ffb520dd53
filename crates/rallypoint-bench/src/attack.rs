//! `rallypoint bench attack`: a healthy job's barrier round time with and without
//! hostile clients of another job hammering the same coordinator, in one run, and
//! the coordinator's memory meanwhile. The attacks are those of issue #13:
//!
//! - `world`: clients claiming a world of 2^32 - 1 ranks, and of a million ranks
//!   whose barriers time out;
//! - `frames`: native connections each sending half of a 63 MiB frame and stopping;
//! - `multiset`: a TCPStore MULTI_SET announcing 131,072 entries of 8 MiB values;
//! - `stall`: connections stopping in the middle of a frame, idle;
//! - `trickle`: TCPStore connections trickling the last bytes of a 131,072-entry
//!   MULTI_SET at 2 KB/s.
//!
//! Each attacker reconnects whenever the coordinator closes it, so the pressure
//! lasts the whole measurement. The attackers run in a child process of their own
//! at the lowest CPU priority (`nice 19`): on a real cluster their traffic comes
//! over the network and costs the coordinator's machine only what the coordinator
//! does with it, which is what is measured; on one machine they would otherwise
//! also take the healthy job's CPU.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use bytes::{BufMut, BytesMut};
use rallypoint_client::{Client, Identity, Members};
use rallypoint_proto::native::{encode_client_frame, encode_preamble, ClientFrame};
use rallypoint_proto::tcpstore::{encode_command, Command, VALIDATE_MAGIC};
use serde::Serialize;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinSet;

use crate::{
    close_all, connect_many, on_target, options, print_report, round_stats, run_rounds, BarrierRound, Target, Times,
};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Clients of the healthy job, all in one barrier
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..))]
    clients: u32,
    /// Measured rounds, before the attack and during it
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// Attacks to run together (default: all)
    #[arg(long, value_enum, value_delimiter = ',')]
    attack: Vec<Attack>,
    /// Seconds the attacks build up before the measured rounds start
    #[arg(long, value_name = "SECS", default_value = "3", value_parser = crate::secs)]
    build_up: f64,
    /// Print one JSON object instead of text
    #[arg(long)]
    json: bool,
    /// The coordinator to attack instead of starting one (then no memory is reported)
    #[arg(long, value_name = "HOST:PORT")]
    addr: Option<String>,
    /// Internal: run only the attackers, against `--addr`, until killed
    #[arg(long, hide = true)]
    attacker: bool,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
enum Attack {
    World,
    Frames,
    Multiset,
    Stall,
    Trickle,
}

const ALL: [Attack; 5] = [Attack::World, Attack::Frames, Attack::Multiset, Attack::Stall, Attack::Trickle];

#[derive(Debug, Serialize)]
struct Report {
    clients: u32,
    rounds: u32,
    attacks: Vec<Attack>,
    /// The healthy job's rounds with no attack.
    baseline: Times,
    /// The same rounds while every attack runs.
    under_attack: Times,
    /// Under attack ÷ baseline.
    median_ratio: f64,
    p99_ratio: f64,
    /// The coordinator's resident memory before the attacks, and the most seen during them.
    server_rss_baseline_bytes: Option<u64>,
    server_rss_peak_bytes: Option<u64>,
    /// Times the coordinator closed (or refused) an attacking connection.
    attacker_connections_closed: u64,
}

pub async fn run(mut args: Args) -> anyhow::Result<()> {
    if args.attack.is_empty() {
        args.attack = ALL.to_vec();
    }
    if args.attacker {
        let addr = args.addr.context("--attacker needs --addr")?;
        let closed = Arc::new(AtomicU64::new(0));
        let mut attackers = JoinSet::new();
        for &attack in &args.attack {
            start(attack, &addr, &closed, &mut attackers);
        }
        let mut report = tokio::time::interval(Duration::from_millis(200));
        loop {
            report.tick().await;
            println!("{}", closed.load(Ordering::Relaxed));
        }
    }
    let report = on_target(args.addr.clone(), async |target| measure(&args, target).await).await?;
    print_report(&report, args.json, |r| {
        println!("healthy barrier of {} clients, {} rounds each:", r.clients, r.rounds);
        println!("  no attack:    {}", r.baseline);
        println!("  under attack: {}  ({:?})", r.under_attack, r.attacks);
        println!("  median {:.2}x, p99 {:.2}x", r.median_ratio, r.p99_ratio);
        if let (Some(base), Some(peak)) = (r.server_rss_baseline_bytes, r.server_rss_peak_bytes) {
            println!("  coordinator RSS {:.1} MiB before, {:.1} MiB at most during", mib(base), mib(peak));
        }
        println!("  attacking connections closed by the coordinator: {}", r.attacker_connections_closed);
    })
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

async fn measure(args: &Args, target: &Target) -> anyhow::Result<Report> {
    let timeout = Duration::from_secs(120);
    let job = format!("bench-healthy-{}", std::process::id());
    let n = args.clients;
    let mut clients =
        connect_many(0..n, |rank| options(&target.addr, Identity::ranked(job.as_str(), rank, n), timeout)).await?;
    let warmup = 20usize;
    let baseline;
    (clients, baseline) = healthy_rounds(clients, warmup, args.rounds as usize, timeout).await?;
    let rss_baseline = target.server_rss();

    let attacks: Vec<String> = args.attack.iter().map(|a| format!("{a:?}").to_lowercase()).collect::<Vec<_>>();
    let mut attacker =
        crate::bench_child(&["attack", "--attacker", "--addr", &target.addr, "--attack", &attacks.join(",")])?;
    let mut attacker = attacker
        .stdout(std::process::Stdio::piped())
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .context("starting the attackers")?;
    if let Some(pid) = attacker.id() {
        // SAFETY: setpriority on a child's pid only changes its scheduling priority.
        unsafe { libc::setpriority(libc::PRIO_PROCESS, pid, 19) };
    }
    let mut closed_counts = tokio::io::BufReader::new(attacker.stdout.take().context("attacker stdout")?).lines();
    let peak = Arc::new(AtomicU64::new(rss_baseline.unwrap_or(0)));
    let sampler = {
        let (peak, pid) = (Arc::clone(&peak), target.server_pid());
        tokio::spawn(async move {
            loop {
                if let Some(rss) = pid.and_then(crate::rss_of) {
                    peak.fetch_max(rss, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    tokio::time::sleep(Duration::from_secs_f64(args.build_up)).await;
    let attacked;
    (clients, attacked) = healthy_rounds(clients, warmup, args.rounds as usize, timeout).await?;
    let _ = attacker.kill().await;
    // Its last line says how many of its connections the coordinator closed.
    let mut closed = 0;
    while let Ok(Some(line)) = closed_counts.next_line().await {
        closed = line.trim().parse().unwrap_or(closed);
    }
    sampler.abort();
    close_all(clients).await;

    let ratio = |a: f64, b: f64| (a / b * 100.0).round() / 100.0;
    Ok(Report {
        clients: n,
        rounds: args.rounds,
        attacks: args.attack.clone(),
        median_ratio: ratio(attacked.median_us, baseline.median_us),
        p99_ratio: ratio(attacked.p99_us, baseline.p99_us),
        baseline,
        under_attack: attacked,
        server_rss_baseline_bytes: rss_baseline,
        server_rss_peak_bytes: rss_baseline.map(|_| peak.load(Ordering::Relaxed)),
        attacker_connections_closed: closed,
    })
}

/// Warm-up and measured barrier rounds of the healthy job.
async fn healthy_rounds(
    clients: Vec<Client>,
    warmup: usize,
    rounds: usize,
    timeout: Duration,
) -> anyhow::Result<(Vec<Client>, Times)> {
    let round = Arc::new(BarrierRound { name: "healthy", timeout });
    let start = crate::mono_ns();
    let (clients, ends) = run_rounds(clients, warmup + rounds, round, None).await;
    let stats = round_stats(start, &ends?, warmup).context("no rounds measured")?;
    Ok((clients, stats.times))
}

/// Starts `attack`'s tasks; each counts the connections the coordinator closes in `closed`.
fn start(attack: Attack, addr: &str, closed: &Arc<AtomicU64>, tasks: &mut JoinSet<()>) {
    let (many, each): (usize, fn(String) -> ConnFuture) = match attack {
        Attack::World => (2, world),
        Attack::Frames => (20, half_frame),
        Attack::Multiset => (1, huge_multiset),
        Attack::Stall => (100, stalled),
        Attack::Trickle => (4, trickle),
    };
    for _ in 0..many {
        let (addr, closed) = (addr.to_owned(), Arc::clone(closed));
        tasks.spawn(async move {
            loop {
                // Each attempt ends when the coordinator closes it (or it finishes).
                if each(addr.clone()).await.is_ok() {
                    closed.fetch_add(1, Ordering::Relaxed);
                } else {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        });
    }
}

type ConnFuture = std::pin::Pin<Box<dyn std::future::Future<Output = anyhow::Result<()>> + Send>>;

/// Claims a world of 2^32 - 1 (refused), then waits in a barrier of a million
/// ranks for a second (a timeout naming the missing).
fn world(addr: String) -> ConnFuture {
    Box::pin(async move {
        let options = |world| options(&addr, Identity::ranked("attack-world", 0, world), Duration::from_secs(5));
        let refused = Client::connect_with(options(u32::MAX)).await;
        anyhow::ensure!(refused.is_err(), "a world of 2^32 - 1 ranks was admitted");
        let client = Client::connect_with(options(1_000_000)).await?;
        let _ = client.barrier("huge", Members::World, Some(Duration::from_secs(1))).await;
        let _ = client.close().await;
        Ok(())
    })
}

/// A native hello, then half of a 63 MiB frame, then silence until closed.
fn half_frame(addr: String) -> ConnFuture {
    Box::pin(async move {
        let mut stream = TcpStream::connect(&addr).await?;
        let mut out = BytesMut::new();
        encode_preamble(&mut out);
        encode_client_frame(&ClientFrame::Hello(Identity::anonymous("attack-frames")), &mut out);
        out.put_u32_le(63 << 20);
        out.resize(out.len() + (32 << 20), 0x5a);
        send_then_wait_closed(&mut stream, &out).await
    })
}

/// torch's handshake, then a MULTI_SET announcing 131,072 entries of 8 MiB values.
fn huge_multiset(addr: String) -> ConnFuture {
    Box::pin(async move {
        let mut stream = TcpStream::connect(&addr).await?;
        let mut out = torch_handshake();
        out.put_u8(multiset_type());
        out.put_u64_le(131_072);
        for i in 0..131_072u64 {
            if out.len() > (8 << 20) {
                if stream.write_all(&out).await.is_err() {
                    return Ok(());
                }
                out.clear();
            }
            let key = format!("k{i}");
            out.put_u64_le(key.len() as u64);
            out.put_slice(key.as_bytes());
            out.put_u64_le(8 << 20);
            out.resize(out.len() + (8 << 20), 0x5a);
        }
        send_then_wait_closed(&mut stream, &out).await
    })
}

/// A native hello and the first bytes of a frame, then nothing.
fn stalled(addr: String) -> ConnFuture {
    Box::pin(async move {
        let mut stream = TcpStream::connect(&addr).await?;
        let mut out = BytesMut::new();
        encode_preamble(&mut out);
        encode_client_frame(&ClientFrame::Hello(Identity::anonymous("attack-stall")), &mut out);
        out.put_u32_le(4096);
        out.put_u8(0x02);
        send_then_wait_closed(&mut stream, &out).await
    })
}

/// A 131,072-entry MULTI_SET sent at once but for its last 64 KiB, which follow at 2 KB/s.
fn trickle(addr: String) -> ConnFuture {
    Box::pin(async move {
        let mut stream = TcpStream::connect(&addr).await?;
        let mut out = torch_handshake();
        out.put_u8(multiset_type());
        out.put_u64_le(131_072);
        for i in 0..131_072u64 {
            let key = format!("trickle/{i:08}");
            for blob in [key.as_bytes(), b"12345678".as_slice()] {
                out.put_u64_le(blob.len() as u64);
                out.put_slice(blob);
            }
        }
        let tail = out.split_off(out.len() - (64 << 10));
        stream.write_all(&out).await?;
        for chunk in tail.chunks(200) {
            tokio::time::sleep(Duration::from_millis(100)).await;
            if stream.write_all(chunk).await.is_err() {
                return Ok(());
            }
        }
        Ok(())
    })
}

fn torch_handshake() -> BytesMut {
    let mut out = BytesMut::new();
    encode_command(&Command::Validate { magic: VALIDATE_MAGIC }, &mut out);
    encode_command(&Command::Ping { nonce: std::process::id() }, &mut out);
    out
}

/// MULTI_SET's query type, as the codec writes it.
fn multiset_type() -> u8 {
    let mut one = BytesMut::new();
    encode_command(&Command::MultiSet { entries: Vec::new() }, &mut one);
    one[0]
}

/// Sends `out` (as much as the coordinator takes) and waits until it closes the connection.
async fn send_then_wait_closed(stream: &mut TcpStream, out: &[u8]) -> anyhow::Result<()> {
    let (mut reader, mut writer) = stream.split();
    let mut sink = vec![0u8; 64 << 10];
    let until_closed = async { while matches!(reader.read(&mut sink).await, Ok(n) if n > 0) {} };
    let write = async {
        let _ = writer.write_all(out).await;
        std::future::pending::<()>().await
    };
    tokio::select! {
        () = until_closed => {}
        () = write => {}
    }
    Ok(())
}
