//! The node agent: one process per node between that node's ranks and the coordinator.
//!
//! Local ranks connect to the agent exactly as to a coordinator (the unchanged
//! native protocol, over TCP or a Unix socket). The agent holds one connection to
//! the coordinator and carries every local rank over it as a *sub-session*
//! (docs/PROTOCOL.md, section 12): the coordinator keeps one engine session per
//! rank, so barriers, collectives, the store, leases, timeouts naming the missing
//! ranks and the loss of a rank behave exactly as with direct connections, while
//! the coordinator handles one socket per node instead of one per rank.
//!
//! Batching: whatever the local ranks send while the previous upstream write is in
//! flight goes up in the next single write; the coordinator's replies for many
//! ranks arrive in one read and are fanned out from the task that read them, each
//! written straight to its rank's socket when the socket takes it at once.
//!
//! Aggregation: within one such write, the local ranks' identical barrier calls go
//! up as one SubRequests frame listing them, and the coordinator's identical replies
//! (a barrier's release) come back as one SubReplies frame that is fanned out here,
//! so a node's arrival at and release from a barrier cost the coordinator one frame
//! each instead of one per rank.
//!
//! Authentication: with a token, the agent proves it to the coordinator (and checks
//! the coordinator's proof) and requires it of every local rank, over TCP or its
//! Unix socket alike. With a certificate it serves its TCP ranks over TLS (and
//! refuses plaintext ones there); with a CA it reaches a TLS coordinator.
//!
//! Failure: a local rank whose connection ends is reported upstream at once (the
//! coordinator decides, as for a direct connection, whether it left or is lost).
//! If the upstream connection ends, the coordinator counts every rank of this agent
//! as lost; the agent answers every call still waiting with a `Closed` error saying
//! so, closes the local connections and stops with [`AgentError::UpstreamLost`].

mod batch;
mod channels;
mod hub;
mod local;
mod slabs;
mod upstream;

use std::future::Future;
use std::io;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::BytesMut;
use rallypoint_core::OpError;
use rallypoint_net::auth::Token;
use rallypoint_net::budget::PendingBudget;
use rallypoint_net::conn::{AuthFailure, End};
use rallypoint_net::tls::{TlsClient, TlsServer};
use rallypoint_net::{Listener, Stream};
use rallypoint_proto::native::FrameLimits;
use tokio::sync::{oneshot, Notify};
use tokio::task::{JoinHandle, JoinSet};
use tracing::{error, info, warn};

use batch::Up;
use hub::Hub;

/// How long [`AgentConfig::new`] lets the agent try to reach its coordinator at
/// start: as long as a client's default.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(300);
/// A peer (a local rank, or the coordinator answering our hello) that does not
/// finish its handshake in this time is given up on.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// `host:port` of the coordinator.
    pub upstream: String,
    /// Where the local ranks connect: `host:port` (port 0: any free one) or `unix:PATH`.
    pub listen: String,
    /// How long to keep trying to reach the coordinator at start.
    pub connect_timeout: Duration,
    /// Host name the agent gives the coordinator (for its logs).
    pub host: String,
    /// Largest frame a local rank may send; should match the coordinator's.
    pub limits: FrameLimits,
    /// A local rank that stops sending in the middle of a frame for this long is
    /// disconnected (as the coordinator does with its direct connections).
    pub read_timeout: Duration,
    /// Bytes of unfinished requests all local ranks together may hold; past it, the
    /// connection holding the most is closed.
    pub max_pending_bytes: usize,
    /// Proven to the coordinator (which must prove it back), and required of every
    /// local rank.
    pub token: Option<Arc<Token>>,
    /// Reach the coordinator over TLS, trusting this CA for its certificate.
    pub upstream_tls: Option<TlsClient>,
    /// Serve local ranks connecting over TCP with TLS (plaintext ones are refused there).
    pub tls: Option<TlsServer>,
}

impl AgentConfig {
    pub fn new(upstream: impl Into<String>, listen: impl Into<String>) -> Self {
        AgentConfig {
            upstream: upstream.into(),
            listen: listen.into(),
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            host: rallypoint_net::hostname(),
            limits: FrameLimits::default(),
            read_timeout: Duration::from_secs(30),
            max_pending_bytes: 256 << 20,
            token: None,
            upstream_tls: None,
            tls: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("node agent: cannot listen on {addr}: {source}")]
    Listen { addr: String, source: io::Error },
    #[error("node agent: cannot reach the coordinator at {addr} (tried for {waited:.1?}): {source}")]
    Connect { addr: String, waited: Duration, source: io::Error },
    #[error("node agent: the coordinator at {addr} refused this agent: {error}")]
    Refused { addr: String, error: OpError },
    /// The coordinator refused the agent's token (or TLS), or could not prove its own.
    #[error("node agent: cannot authenticate with the coordinator at {addr}: {failure}")]
    Auth { addr: String, failure: AuthFailure },
    #[error("node agent: the coordinator at {addr} broke the protocol: {message}")]
    Protocol { addr: String, message: String },
    /// The coordinator counts every rank of this agent as lost.
    #[error("node agent: lost its connection to the coordinator at {addr} ({end}); its {ranks} local rank connection(s) were closed")]
    UpstreamLost { addr: String, end: End, ranks: usize },
    /// The agent's task failed (a bug: it panicked).
    #[error("node agent: its task failed: {0}")]
    Failed(String),
}

/// A node agent with its local listener bound and its coordinator connection
/// welcomed, not yet serving.
pub struct Agent {
    listener: Listener,
    local_addr: String,
    upstream: Stream,
    /// Bytes read past the coordinator's welcome.
    buffered: BytesMut,
    hub: Arc<Hub>,
}

impl Agent {
    /// Binds the local listener, then connects to the coordinator (retrying until
    /// `connect_timeout`) and introduces itself.
    pub async fn bind(config: AgentConfig) -> Result<Agent, AgentError> {
        let fd_limit = rallypoint_net::raise_fd_limit();
        let listener = Listener::bind(&config.listen)
            .await
            .map_err(|source| AgentError::Listen { addr: config.listen.clone(), source })?;
        let local_addr =
            listener.local_addr().map_err(|source| AgentError::Listen { addr: config.listen.clone(), source })?;
        let (upstream, buffered, lease_ms) = upstream::connect(&config).await?;
        info!(%local_addr, upstream = %config.upstream, fd_limit, lease_ms, "rallypoint node agent ready");
        let hub = Arc::new(Hub {
            addr: config.upstream,
            limits: config.limits,
            read_timeout: config.read_timeout,
            budget: PendingBudget::new(config.max_pending_bytes),
            up: Mutex::new(Up::default()),
            up_ready: Notify::new(),
            routes: Mutex::default(),
            next_sub: AtomicU64::new(1),
            slabs: Default::default(),
            channels: Default::default(),
            token: config.token,
            tls: config.tls,
        });
        Ok(Agent { listener, local_addr, upstream, buffered, hub })
    }

    /// Where local ranks connect, as `RALLYPOINT_ADDR` takes it.
    pub fn local_addr(&self) -> &str {
        &self.local_addr
    }

    /// Serves until `shutdown` completes (`Ok`) or the coordinator connection ends
    /// ([`AgentError::UpstreamLost`]). Either way every local connection is closed;
    /// on shutdown the coordinator then counts the agent's ranks as lost (as a
    /// coordinator shutting down does for direct connections).
    pub async fn run_until(self, shutdown: impl Future<Output = ()>) -> Result<(), AgentError> {
        let Agent { listener, local_addr, upstream, buffered, hub } = self;
        let (reader, writer) = upstream.into_split();
        let mut locals = JoinSet::new();
        tokio::pin!(shutdown);
        let upstream = async {
            tokio::select! {
                end = upstream::read(reader, buffered, &hub) => end,
                end = upstream::write(writer, &hub) => end,
            }
        };
        tokio::pin!(upstream);
        let outcome = loop {
            tokio::select! {
                () = &mut shutdown => {
                    let ranks = hub.lose("the node agent is shutting down".to_owned());
                    info!(%local_addr, ranks, "node agent shutting down; its ranks are lost to the coordinator");
                    break Ok(());
                }
                end = &mut upstream => {
                    let ranks = hub.lose(format!(
                        "the node agent lost its connection to the coordinator at {} ({end}); the coordinator counts this node's ranks as lost", hub.addr
                    ));
                    error!(%local_addr, %end, ranks, "node agent lost the coordinator; its ranks are lost");
                    break Err(AgentError::UpstreamLost { addr: hub.addr.clone(), end, ranks });
                }
                accepted = listener.accept() => match accepted {
                    Ok(stream) => {
                        let hub = Arc::clone(&hub);
                        locals.spawn(async move { local::serve(stream, hub).await });
                    }
                    Err(error) => {
                        warn!(%local_addr, %error, "accept failed");
                        // Out of file descriptors and the like: do not spin.
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                },
                Some(ended) = locals.join_next() => {
                    if let Err(error) = ended {
                        if error.is_panic() {
                            error!(%error, "a local connection task panicked");
                        }
                    }
                }
            }
        };
        drop(listener);
        // Replies to waiting calls (after an upstream loss) are written by the local
        // tasks as they end; a rank that does not read them must not hold us up.
        let drained = async { while locals.join_next().await.is_some() {} };
        if tokio::time::timeout(Duration::from_secs(1), drained).await.is_err() {
            locals.shutdown().await;
        }
        info!(%local_addr, "rallypoint node agent stopped");
        outcome
    }

    /// Runs the agent on the current tokio runtime. Dropping the handle stops it.
    #[must_use = "dropping the handle stops the agent"]
    pub fn spawn(self) -> AgentHandle {
        let local_addr = self.local_addr.clone();
        let hub = Arc::clone(&self.hub);
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(self.run_until(async move {
            let _ = stopped.await;
        }));
        AgentHandle { local_addr, hub, stop, task }
    }
}

/// An agent running in the background (see [`Agent::spawn`]).
pub struct AgentHandle {
    local_addr: String,
    /// Never sent: dropping it is the stop signal.
    stop: oneshot::Sender<()>,
    task: JoinHandle<Result<(), AgentError>>,
    hub: Arc<Hub>,
}

impl AgentHandle {
    pub fn local_addr(&self) -> &str {
        &self.local_addr
    }

    /// Barrier channels the agent has now: one per barrier call its ranks hold
    /// slots for (docs/PROTOCOL.md, section 15).
    pub fn barrier_channels(&self) -> usize {
        self.hub.channels.live()
    }

    /// Stops the agent (its ranks are lost to the coordinator) and returns how it ended.
    pub async fn shutdown(self) -> Result<(), AgentError> {
        let AgentHandle { stop, task, .. } = self;
        drop(stop);
        joined(task).await
    }

    /// Waits until the agent stops by itself (its coordinator connection ended).
    pub async fn wait(self) -> Result<(), AgentError> {
        let AgentHandle { stop, task, .. } = self;
        let outcome = joined(task).await;
        drop(stop);
        outcome
    }
}

async fn joined(task: JoinHandle<Result<(), AgentError>>) -> Result<(), AgentError> {
    match task.await {
        Ok(outcome) => outcome,
        Err(error) => Err(AgentError::Failed(error.to_string())),
    }
}
