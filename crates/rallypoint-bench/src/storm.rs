//! `rallypoint bench storm`: N clients connect and join at the same moment, as the
//! ranks of a job do when it starts. Unlike the other benchmarks, nothing paces the
//! connects: all N are started at once, so the listen backlog and the accept loop
//! take the full burst. Each client connects by itself (not through the client
//! library, which retries silently) so that every refused or reset connect is seen
//! and counted; it retries with backoff until `--timeout`.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use anyhow::Context;
use bytes::BytesMut;
use rallypoint_client::Identity;
use rallypoint_proto::native::{
    decode_server_frame, encode_client_frame, encode_preamble, ClientFrame, FrameLimits, ServerFrame,
};
use rand::Rng;
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinSet;

use crate::tcpstore::{self, StoreConn};
use crate::{connect_tcp, ensure_fds, mono_ns, on_target, print_report, Protocol, Sources, Stats, Target};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Clients connecting at once, each with its own connection and rank
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
    clients: u32,
    /// Seconds a client keeps retrying before it counts as failed
    #[arg(long, value_name = "SECS", default_value = "60", value_parser = crate::secs)]
    timeout: f64,
    /// Wire protocol: `native` (preamble + hello, admitted at the welcome) or
    /// `tcpstore` (VALIDATE + PING, admitted at the PING's echo)
    #[arg(long, value_enum, default_value_t = Protocol::Native)]
    protocol: Protocol,
    /// Loopback source addresses to bind clients to (127.0.0.2, ...); default: as many
    /// as the clients need, 0 = never bind
    #[arg(long, value_name = "K")]
    src_addrs: Option<u32>,
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
    clients: u32,
    src_addrs: u32,
    admitted: u32,
    /// Clients that gave up after `--timeout`.
    failed: u32,
    /// From the start of the storm until the last client was admitted.
    all_admitted_ms: f64,
    /// Per client, from the start of the storm until it was admitted.
    admit_median_ms: f64,
    admit_p99_ms: f64,
    /// Failed attempts by cause; every one was retried (or ended the client's tries).
    resets: u32,
    refused: u32,
    timeouts: u32,
    other_errors: u32,
    retries: u32,
    /// The first error that was not a reset, refusal or timeout, if any.
    first_other_error: Option<String>,
    /// Increase of the kernel's TCP counters over the storm (for this network
    /// namespace, so other traffic counts too): SYNs or handshakes dropped because
    /// the listen queue was full; they cost the client a retransmission (1 s, then
    /// 2 s, ...) but no error.
    listen_overflows: u64,
    listen_drops: u64,
}

/// How a failed attempt ended.
enum Failure {
    Reset,
    Refused,
    Timeout,
    Other(String),
}

fn classify(err: &anyhow::Error) -> Failure {
    let io = err.chain().find_map(|e| e.downcast_ref::<io::Error>());
    match io.map(io::Error::kind) {
        Some(io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionAborted | io::ErrorKind::BrokenPipe) => {
            Failure::Reset
        }
        // A server that closes before answering looks like a reset to its client.
        Some(io::ErrorKind::UnexpectedEof) => Failure::Reset,
        Some(io::ErrorKind::ConnectionRefused) => Failure::Refused,
        Some(io::ErrorKind::TimedOut) => Failure::Timeout,
        _ => Failure::Other(format!("{err:#}")),
    }
}

/// One client's storm: its attempts' failures, and when it was admitted.
struct Outcome {
    failures: Vec<Failure>,
    admitted_ns: Option<u64>,
    /// Held open (never read) until every client is in, so the server carries all N at once.
    _connection: Option<TcpStream>,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    ensure_fds(u64::from(args.clients) + 64)?;
    let report = on_target(args.addr.clone(), async |target| measure(&args, target).await).await?;
    print_report(&report, args.json, |r| {
        println!(
            "storm of {} clients over {:?}: {} admitted in {:.1} ms (median {:.1} ms, p99 {:.1} ms), {} failed",
            r.clients, r.protocol, r.admitted, r.all_admitted_ms, r.admit_median_ms, r.admit_p99_ms, r.failed
        );
        println!(
            "failed attempts: {} resets, {} refused, {} timeouts, {} other; {} retries; kernel: {} listen overflows, {} listen drops",
            r.resets, r.refused, r.timeouts, r.other_errors, r.retries, r.listen_overflows, r.listen_drops
        );
    })
}

async fn measure(args: &Args, target: &Target) -> anyhow::Result<Report> {
    let n = args.clients;
    let addr = tcpstore::resolve(&target.addr)?;
    let sources = Sources::plan(args.src_addrs, n);
    let job = format!("bench-storm-{}", std::process::id());
    let timeout = Duration::from_secs_f64(args.timeout);
    let counters_before = crate::net_counters("/proc/net/netstat", "TcpExt:");
    let start = mono_ns();
    let deadline = tokio::time::Instant::now() + timeout;
    let mut storm = JoinSet::new();
    for rank in 0..n {
        let identity = Identity { host: "storm".into(), pid: std::process::id(), ..Identity::ranked(&job, rank, n) };
        let (protocol, source) = (args.protocol, sources.of(rank));
        storm.spawn(client(protocol, addr, source, identity, deadline));
    }
    let mut outcomes = Vec::with_capacity(n as usize);
    while let Some(outcome) = storm.join_next().await {
        outcomes.push(outcome.context("a storm client panicked")?);
    }
    let counters_after = crate::net_counters("/proc/net/netstat", "TcpExt:");

    let mut admit: Vec<Duration> = Vec::new();
    let mut report = Report {
        protocol: args.protocol,
        clients: n,
        src_addrs: sources.addrs,
        admitted: 0,
        failed: 0,
        all_admitted_ms: 0.0,
        admit_median_ms: 0.0,
        admit_p99_ms: 0.0,
        resets: 0,
        refused: 0,
        timeouts: 0,
        other_errors: 0,
        retries: 0,
        first_other_error: None,
        listen_overflows: delta(&counters_before, &counters_after, "ListenOverflows"),
        listen_drops: delta(&counters_before, &counters_after, "ListenDrops"),
    };
    for outcome in &outcomes {
        match outcome.admitted_ns {
            Some(at) => {
                report.admitted += 1;
                admit.push(Duration::from_nanos(at.saturating_sub(start)));
                report.retries += outcome.failures.len() as u32;
            }
            None => {
                report.failed += 1;
                // The last failure ended the tries rather than leading to a retry.
                report.retries += (outcome.failures.len() as u32).saturating_sub(1);
            }
        }
        for failure in &outcome.failures {
            match failure {
                Failure::Reset => report.resets += 1,
                Failure::Refused => report.refused += 1,
                Failure::Timeout => report.timeouts += 1,
                Failure::Other(err) => {
                    report.other_errors += 1;
                    report.first_other_error.get_or_insert_with(|| err.clone());
                }
            }
        }
    }
    if let Some(stats) = Stats::of(&mut admit) {
        let ms = |us: f64| (us / 100.0).round() / 10.0;
        report.all_admitted_ms = ms(stats.times.max_us);
        report.admit_median_ms = ms(stats.times.median_us);
        report.admit_p99_ms = ms(stats.times.p99_us);
    }
    // Every client was in at once (the outcomes hold their connections); now let them go.
    drop(outcomes);
    Ok(report)
}

/// Connects and joins, retrying with exponential backoff and jitter (as the client
/// library and torch's client do) until admitted or `deadline`.
async fn client(
    protocol: Protocol,
    addr: SocketAddr,
    source: Option<IpAddr>,
    identity: Identity,
    deadline: tokio::time::Instant,
) -> Outcome {
    const BACKOFF_START: Duration = Duration::from_millis(10);
    const BACKOFF_CAP: Duration = Duration::from_secs(1);
    let mut failures = Vec::new();
    let mut backoff = BACKOFF_START;
    loop {
        let attempt = async {
            match protocol {
                Protocol::Native => join_native(addr, source, &identity).await,
                Protocol::Tcpstore => StoreConn::connect(addr, source).await.map(StoreConn::into_stream),
            }
        };
        let error = match tokio::time::timeout_at(deadline, attempt).await {
            Ok(Ok(connection)) => {
                return Outcome { failures, admitted_ns: Some(mono_ns()), _connection: Some(connection) };
            }
            Ok(Err(err)) => classify(&err),
            Err(_) => Failure::Timeout,
        };
        failures.push(error);
        let pause = backoff.mul_f64(rand::thread_rng().gen_range(0.5..=1.0));
        backoff = (backoff * 2).min(BACKOFF_CAP);
        if tokio::time::Instant::now() + pause >= deadline {
            return Outcome { failures, admitted_ns: None, _connection: None };
        }
        tokio::time::sleep(pause).await;
    }
}

/// The native handshake: preamble and hello; admitted when the welcome arrives.
async fn join_native(addr: SocketAddr, source: Option<IpAddr>, identity: &Identity) -> anyhow::Result<TcpStream> {
    let mut stream = connect_tcp(addr, source).await?;
    let mut out = BytesMut::new();
    encode_preamble(&mut out);
    encode_client_frame(&ClientFrame::Hello(identity.clone()), &mut out);
    stream.write_all(&out).await?;
    let mut buffered = BytesMut::with_capacity(256);
    loop {
        match decode_server_frame(&mut buffered, &FrameLimits::unbounded())? {
            Some(ServerFrame::Welcome(_)) => return Ok(stream),
            Some(ServerFrame::Refused(error)) => anyhow::bail!("refused: {error}"),
            Some(
                ServerFrame::Reply { .. }
                | ServerFrame::SharedReply { .. }
                | ServerFrame::BarrierChannel { .. }
                | ServerFrame::NoBarrierChannel { .. },
            ) => {
                anyhow::bail!("a reply before the welcome")
            }
            Some(ServerFrame::AuthChallenge { .. } | ServerFrame::AuthAccepted { .. }) => {
                anyhow::bail!("a token handshake this benchmark did not ask for")
            }
            None => {}
        }
        if stream.read_buf(&mut buffered).await? == 0 {
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
        }
    }
}

fn delta(before: &HashMap<String, u64>, after: &HashMap<String, u64>, key: &str) -> u64 {
    after.get(key).copied().unwrap_or(0).saturating_sub(before.get(key).copied().unwrap_or(0))
}
