//! `rallypoint launch`: hosts the coordinator (node 0), spawns the workers with
//! torchrun-compatible environments, and takes the whole job down, on every node,
//! as soon as one worker fails; then says which one, and why.

mod node_agent;
mod outcome;
mod output;
mod rendezvous;
mod supervise;
mod worker;

use std::ffi::OsString;
use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;

use rallypoint_core::Config;
use rallypoint_server::{Server, ServerConfig, ServerHandle};

pub use outcome::{Exit, Failure, FailureKind};

use node_agent::NodeAgent;
use rallypoint_client::env::JobEnv;
use rendezvous::Launchers;
use supervise::{Attempt, AttemptResult};

#[derive(Debug, Clone)]
pub struct LaunchOptions {
    pub nproc_per_node: u32,
    pub nnodes: u32,
    pub node_rank: u32,
    /// Coordinator address: node 0 binds exactly it; the other nodes connect to it.
    /// Single node without it: a free port on 127.0.0.1.
    pub master: Option<String>,
    pub job: String,
    /// Between SIGTERM and SIGKILL when the job is taken down.
    pub grace: Duration,
    /// One file per rank per stream, under `<log_dir>/attempt<K>/`.
    pub log_dir: Option<PathBuf>,
    /// With `log_dir`: also show worker output on the console.
    pub tee: bool,
    pub max_restarts: u32,
    /// How long to wait for the coordinator and the other nodes.
    pub join_timeout: Duration,
    /// Host a node agent for this node's workers (their `RALLYPOINT_ADDR`), so the
    /// coordinator holds one connection for the node instead of one per worker.
    pub node_agent: bool,
    pub command: Vec<OsString>,
}

#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("{0}")]
    Usage(String),
    #[error("cannot host the coordinator at {addr}: {source}")]
    Bind { addr: String, source: io::Error },
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("{0}")]
    Coordinator(#[from] rallypoint_client::Error),
    #[error("cannot create the node agent's socket directory in {dir}: {source}")]
    SocketDir { dir: PathBuf, source: io::Error },
    #[error("{0}")]
    /// Boxed: an agent error is large, and launch errors are rare.
    NodeAgent(Box<rallypoint_agent::AgentError>),
}

/// Runs the job to its end; returns the launcher's exit code (0, or the first failure's).
pub async fn launch(options: LaunchOptions) -> Result<i32, LaunchError> {
    validate(&options)?;
    let host = rallypoint_net::hostname();
    let server = if options.node_rank == 0 { Some(host_coordinator(&options).await?) } else { None };
    let addr = match (&server, &options.master) {
        (Some(server), _) => server.local_addr().to_string(),
        (None, Some(master)) => master.clone(),
        (None, None) => return Err(LaunchError::Usage("--master is required on nodes other than 0".into())),
    };
    let coordinator: SocketAddr = match &server {
        Some(server) => server.local_addr(),
        None => resolve(&addr).await?,
    };
    let launchers =
        Launchers::join(&addr, &options.job, options.node_rank, options.nnodes, &host, options.join_timeout).await?;
    // After the join: the coordinator is known to be up, so the agent connects at once.
    let node_agent = if options.node_agent {
        Some(NodeAgent::start(&coordinator.to_string(), &host, options.join_timeout).await?)
    } else {
        None
    };
    let signals = forward_signals()?;
    let worker_addr = node_agent.as_ref().map(|a| a.addr().to_owned());
    let result = run_attempts(&options, &launchers, server.as_ref(), coordinator, worker_addr, &host, signals).await;
    // Every worker has exited: no rank is left behind the agent.
    if let Some(node_agent) = node_agent {
        node_agent.stop().await;
    }
    launchers.close().await;
    if let Some(server) = server {
        server.shutdown().await;
    }
    result
}

async fn run_attempts(
    options: &LaunchOptions,
    launchers: &Launchers,
    server: Option<&ServerHandle>,
    coordinator: SocketAddr,
    node_agent: Option<String>,
    host: &str,
    mut signals: mpsc::UnboundedReceiver<i32>,
) -> Result<i32, LaunchError> {
    let mut attempt = 0;
    loop {
        let attempt_job = if attempt == 0 { options.job.clone() } else { format!("{}.restart{attempt}", options.job) };
        // Each attempt is a fresh job incarnation: node 0 starts it before it joins the
        // rendezvous, and the other nodes, once past the rendezvous, read it.
        let (addr, timeout) = (coordinator.to_string(), options.join_timeout);
        let started = match options.node_rank {
            0 => Some(rallypoint_client::reset_job(&addr, &attempt_job, timeout).await?),
            _ => None,
        };
        let (base_rank, world_size) =
            launchers.rendezvous(attempt, options.nproc_per_node, options.join_timeout).await?;
        let job_incarnation = match started {
            Some(incarnation) => Some(incarnation),
            None => rallypoint_client::job_incarnation(&addr, &attempt_job, timeout).await?,
        };
        let job = JobEnv {
            coordinator,
            node_agent: node_agent.clone(),
            run_id: options.job.clone(),
            attempt_job,
            restart_count: attempt,
            max_restarts: options.max_restarts,
            job_incarnation,
        };
        // torch's TCPStore clients (MASTER_ADDR/MASTER_PORT point here) cannot name a
        // job: they join the attempt's, so their keys and ranks are the workers'.
        if let Some(server) = server {
            server.set_tcpstore_job(&job.attempt_job);
        }
        let run = Attempt { options, agents: launchers, job: &job, host, base_rank, world_size, attempt };
        let result = run.run(&mut signals).await?;
        match result {
            AttemptResult::Succeeded => {
                launchers.farewell(attempt).await;
                return Ok(0);
            }
            AttemptResult::Failed { first, .. } => {
                let interrupted = matches!(first.what, FailureKind::Interrupted { .. });
                if attempt < options.max_restarts && !interrupted {
                    eprintln!(
                        "rallypoint: attempt {} of job '{}' failed ({}); restarting ({} of {} restarts)",
                        attempt + 1,
                        options.job,
                        first.headline(),
                        attempt + 1,
                        options.max_restarts
                    );
                    attempt += 1;
                    continue;
                }
                launchers.farewell(attempt).await;
                return Ok(first.exit_code());
            }
        }
    }
}

fn validate(o: &LaunchOptions) -> Result<(), LaunchError> {
    let usage = |m: String| Err(LaunchError::Usage(m));
    if o.command.is_empty() {
        return usage("no command to launch: put it after `--`".into());
    }
    if o.nproc_per_node == 0 {
        return usage("--nproc-per-node must be at least 1".into());
    }
    if o.nnodes == 0 {
        return usage("--nnodes must be at least 1".into());
    }
    if o.node_rank >= o.nnodes {
        return usage(format!(
            "--node-rank {} is out of range for --nnodes {} (0..{})",
            o.node_rank, o.nnodes, o.nnodes
        ));
    }
    if o.nnodes > 1 && o.master.is_none() {
        return usage("--master HOST:PORT is required with --nnodes > 1".into());
    }
    if o.job.is_empty() {
        return usage("--job must not be empty".into());
    }
    Ok(())
}

async fn host_coordinator(options: &LaunchOptions) -> Result<ServerHandle, LaunchError> {
    let listen = match &options.master {
        Some(master) => resolve(master).await?,
        None => SocketAddr::from(([127, 0, 0, 1], 0)),
    };
    let server = Server::bind(ServerConfig::new(listen, Config::default()))
        .await
        .map_err(|source| LaunchError::Bind { addr: listen.to_string(), source })?;
    Ok(server.spawn())
}

async fn resolve(addr: &str) -> Result<SocketAddr, LaunchError> {
    let mut found = tokio::net::lookup_host(addr)
        .await
        .map_err(|e| LaunchError::Usage(format!("bad coordinator address '{addr}': {e}")))?;
    found.next().ok_or_else(|| LaunchError::Usage(format!("coordinator address '{addr}' resolves to nothing")))
}

/// SIGINT, SIGTERM and SIGHUP to the launcher, as signal numbers to forward.
fn forward_signals() -> io::Result<mpsc::UnboundedReceiver<i32>> {
    let (tx, rx) = mpsc::unbounded_channel();
    for (kind, number) in [
        (SignalKind::interrupt(), libc::SIGINT),
        (SignalKind::terminate(), libc::SIGTERM),
        (SignalKind::hangup(), libc::SIGHUP),
    ] {
        let mut stream = signal(kind)?;
        let tx = tx.clone();
        tokio::spawn(async move {
            while stream.recv().await.is_some() {
                if tx.send(number).is_err() {
                    break;
                }
            }
        });
    }
    Ok(rx)
}
