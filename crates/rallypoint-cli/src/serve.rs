//! `rallypoint serve`: the coordinator, until SIGINT or SIGTERM.

use std::io::Write;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use rallypoint_core::Config;
use rallypoint_http::{HttpConfig, HttpServer};
use rallypoint_server::{Server, ServerConfig};
use tokio::signal::unix::{signal, SignalKind};
use tracing::info;

use crate::parse;

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Address to listen on, exactly as given (port 0 picks a free port)
    #[arg(long, value_name = "IP:PORT", default_value = "127.0.0.1:29500", value_parser = parse::listen)]
    listen: SocketAddr,
    /// Seconds without any message (request or heartbeat) after which a rank is
    /// lost; 0 turns leases off [default: 15]
    #[arg(long, value_name = "SECS", value_parser = parse::secs)]
    lease: Option<f64>,
    /// Seconds a rank whose connection dropped without a clean leave stays held for
    /// its process to reconnect and resume, when the coordinator cannot see whether
    /// the process is gone (it runs on another host); then it is lost. At most the
    /// lease; 0 = lost at once [default: 1]
    #[arg(long, value_name = "SECS", value_parser = parse::secs)]
    reconnect_grace: Option<f64>,
    /// Longest key, in bytes [default: 8192]
    #[arg(long, value_name = "BYTES")]
    max_key_len: Option<usize>,
    /// Longest value, in bytes (also each all-gather/broadcast payload) [default: 8388608]
    #[arg(long, value_name = "BYTES")]
    max_value_len: Option<usize>,
    /// Most keys in one check/wait/multi-get/multi-set [default: 131072]
    #[arg(long, value_name = "N")]
    max_keys_per_op: Option<usize>,
    /// Largest sum of the keys and values of one request, in bytes; never less than a
    /// key and two values (a compare-set always fits) [default: 67108864]
    #[arg(long, value_name = "BYTES")]
    max_request_len: Option<usize>,
    /// Largest world size a client may claim (memory follows the ranks that connect,
    /// never the number claimed) [default: 1048576]
    #[arg(long, value_name = "N")]
    max_world_size: Option<u32>,
    /// Largest sum of one all-gather's values (the reply every member gets), in bytes
    /// [default: 1073741824]
    #[arg(long, value_name = "BYTES")]
    max_gather_bytes: Option<usize>,
    /// Seconds a connection may stop sending in the middle of a request before it is
    /// closed (a hung or hostile peer must not hold a partial request for good)
    #[arg(long, value_name = "SECS", default_value = "30", value_parser = parse::secs)]
    read_timeout: f64,
    /// Bytes of unfinished requests all connections together may hold; past it, the
    /// connection holding the most is closed [default: an eighth of the machine's
    /// memory, at least 268435456]
    #[arg(long, value_name = "BYTES")]
    max_pending_bytes: Option<usize>,
    /// Job that PyTorch TCPStore clients (which cannot name one) join
    #[arg(long, value_name = "NAME", default_value = "default")]
    tcpstore_job: String,
    /// Print the bound address as the first line on stdout (for scripts using port 0)
    #[arg(long)]
    print_addr: bool,
    /// Serve plaintext native ranks on the TCPStore clients' reactor thread: less CPU
    /// per barrier round, but a client streaming large requests then slows every rank
    /// (see docs/BENCHMARKS.md); for clusters whose clients are all trusted
    #[arg(long)]
    native_on_reactor: bool,
    #[command(flatten)]
    auth: crate::auth::ServeAuth,
    /// With a token: serve PyTorch TCPStore clients (which cannot send one) from this
    /// network of other machines too, e.g. 10.0.0.0/16; repeatable. Without it, only
    /// this user's processes on this machine, and machines a client proved the token
    /// from, are served over TCPStore [default: none]
    #[arg(long, value_name = "CIDR", help_heading = "Authentication and TLS")]
    tcpstore_allow: Vec<rallypoint_server::IpNet>,
    /// Serve the live page (the jobs, each rank's state, who waits where), its JSON API
    /// (/api/status, as `status --json`) and Prometheus metrics (/metrics) over HTTP
    /// at this address, e.g. 127.0.0.1:8080. With a token, requests must carry it
    /// (Authorization: Bearer TOKEN, or the cookie /login?token=TOKEN sets)
    #[arg(long, value_name = "IP:PORT", help_heading = "Live page and metrics", value_parser = parse::listen)]
    http: Option<SocketAddr>,
    /// Serve --http beyond loopback without a token: anyone who reaches it can read
    /// every job's state
    #[arg(long, requires = "http", help_heading = "Live page and metrics")]
    insecure: bool,
}

pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let mut engine = Config::default();
    if let Some(lease) = args.lease {
        engine.lease_ms = (lease * 1000.0).round() as u64;
    }
    if let Some(grace) = args.reconnect_grace {
        engine.reconnect_grace_ms = (grace * 1000.0).round() as u64;
    }
    if let Some(len) = args.max_key_len {
        engine.limits.max_key_len = len;
    }
    if let Some(len) = args.max_value_len {
        engine.limits.max_value_len = len;
    }
    if let Some(n) = args.max_keys_per_op {
        engine.limits.max_keys_per_op = n;
    }
    if let Some(n) = args.max_request_len {
        engine.limits.max_request_len = n;
    }
    if let Some(n) = args.max_world_size {
        engine.limits.max_world_size = n;
    }
    if let Some(n) = args.max_gather_bytes {
        engine.limits.max_gather_bytes = n;
    }
    // Installed before the address is announced: whoever reads it may signal at once.
    let stop = shutdown_signal()?;
    // Binding raises the open-file limit and logs the bound address.
    let mut config = ServerConfig::new(args.listen, engine);
    config.read_timeout = Duration::from_secs_f64(args.read_timeout);
    if let Some(bytes) = args.max_pending_bytes {
        let frame = config.max_frame_len();
        if bytes < frame {
            crate::exit::usage!(
                "--max-pending-bytes {bytes} is less than the largest request this coordinator reads ({frame} bytes, \
                 from --max-request-len and the other limits): a request that large could never arrive whole"
            );
        }
        config.max_pending_bytes = bytes;
    }
    if engine_grace_clamped(&config.engine) {
        tracing::warn!(
            reconnect_grace_ms = config.engine.reconnect_grace_ms,
            lease_ms = config.engine.lease_ms,
            "--reconnect-grace is longer than the lease: a dropped rank is held for the lease at most"
        );
    }
    config.token = args.auth.token()?;
    config.tls = args.auth.tls()?;
    config.tcpstore_allow = args.tcpstore_allow;
    config.native_on_reactor = args.native_on_reactor;
    if config.token.is_none() && !args.listen.ip().is_loopback() {
        tracing::warn!(
            listen = %args.listen,
            "no token: anyone who can reach this port can read, change and abort every job (set --token-file, RALLYPOINT_TOKEN_FILE or RALLYPOINT_TOKEN)"
        );
    }
    if let Some(listen) = args.http {
        crate::page::check_exposure(listen, config.token.is_some(), args.insecure)?;
    }
    let token = config.token.clone();
    let server = Server::bind(config).await?;
    server.set_tcpstore_job(&args.tcpstore_job);
    let page = match args.http {
        Some(listen) => {
            let mut http = HttpConfig::new(listen, token.clone());
            http.insecure = args.insecure;
            let page = HttpServer::bind(http, server.observer(), None)?;
            // The user gave the token: the link does not show it.
            crate::exit::say(crate::page::announce(&page, token.as_deref(), false));
            Some(page.spawn())
        }
        None => None,
    };
    if args.print_addr {
        print_addr(server.local_addr())?;
    }
    server.run_until(stop).await?;
    if let Some(page) = page {
        page.shutdown().await;
    }
    Ok(())
}

/// Completes at SIGINT or SIGTERM; the handlers are installed when this is called.
pub(crate) fn shutdown_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    let mut interrupt = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let mut terminate = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    Ok(async move {
        tokio::select! {
            _ = interrupt.recv() => info!("SIGINT: shutting down"),
            _ = terminate.recv() => info!("SIGTERM: shutting down"),
        }
    })
}

/// The bound address as the first line on stdout (for scripts that listen on port 0).
pub(crate) fn print_addr(addr: impl std::fmt::Display) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{addr}").and_then(|()| out.flush()).context("writing the address to stdout")
}

/// Whether the engine holds a dropped rank for less than the grace asked for: the
/// lease bounds it.
fn engine_grace_clamped(engine: &Config) -> bool {
    engine.lease_ms > 0 && engine.reconnect_grace_ms > engine.lease_ms
}
