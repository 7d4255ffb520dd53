//! The coordinator server: a TCP listener in front of the engine.
//!
//! The [`rallypoint_core::Engine`] holds all coordination state and does no I/O;
//! this module only moves bytes. Each native connection is one task that decodes
//! requests, feeds them to the engine under a lock and writes the replies the
//! engine addresses to it. PyTorch TCPStore connections are served by one reactor
//! thread with a plain event loop, as torch's own server does; a ticker thread
//! advances the engine's clock.

mod agent;
mod connection;
mod reactor;
mod shared;
mod tcpstore;
mod ticker;

use std::future::Future;
use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rallypoint_core::{Config, RankInfo, SessionId};
use rallypoint_proto::native::FrameLimits;
use rallypoint_proto::tcpstore::TcpLimits;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::oneshot;
use tokio::task::{JoinHandle, JoinSet};
use tracing::{debug, error, info, warn};

use reactor::Reactor;
use shared::Shared;
use ticker::Ticker;

pub use crate::fdlimit::raise_fd_limit;

/// Pending connections the kernel may queue: large jobs connect all at once.
const LISTEN_BACKLOG: u32 = 4096;
/// Pause after an accept failure caused by exhausted resources (file descriptors,
/// memory), so that the loop does not spin while they are short.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Address to listen on, bound exactly as given.
    pub listen: SocketAddr,
    pub engine: Config,
}

/// A bound, not yet running coordinator.
pub struct Server {
    listener: TcpListener,
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    limits: FrameLimits,
    tcp_limits: TcpLimits,
}

impl Server {
    /// Raises the open-file limit, then binds exactly `config.listen`.
    pub async fn bind(config: ServerConfig) -> io::Result<Server> {
        let fd_limit = raise_fd_limit();
        let listener = listen(config.listen)
            .map_err(|e| io::Error::new(e.kind(), format!("cannot listen on {}: {e}", config.listen)))?;
        let local_addr = listener.local_addr()?;
        info!(%local_addr, fd_limit, lease_ms = config.engine.lease_ms, "rallypoint coordinator listening");
        let limits = FrameLimits::from_limits(&config.engine.limits);
        let tcp_limits = TcpLimits::from_limits(&config.engine.limits);
        Ok(Server { listener, local_addr, shared: Arc::new(Shared::new(config.engine)), limits, tcp_limits })
    }

    /// The job PyTorch TCPStore connections join (they cannot name one); "default"
    /// unless set. Takes effect for connections opened afterwards.
    pub fn set_tcpstore_job(&self, job: &str) {
        self.shared.set_tcpstore_job(job);
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Serves until `shutdown` completes, then stops accepting, closes every
    /// connection (their ranks count as lost, not left) and returns.
    pub async fn run_until(self, shutdown: impl Future<Output = ()>) -> io::Result<()> {
        let Server { listener, local_addr, shared, limits, tcp_limits } = self;
        let ticker = Ticker::start(Arc::clone(&shared))?;
        let reactor = Arc::new(Reactor::start(Arc::clone(&shared), tcp_limits)?);
        let mut connections = JoinSet::new();
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                accepted = listener.accept() => match accepted {
                    Ok((stream, peer)) => {
                        if let Err(error) = stream.set_nodelay(true) {
                            debug!(%peer, %error, "cannot set TCP_NODELAY");
                        }
                        // Shutdown aborts these tasks (no per-task stop signal: an idle
                        // connection's memory is its task).
                        connections.spawn(connection::serve(stream, peer, Arc::clone(&shared), limits, Arc::clone(&reactor)));
                    }
                    Err(error) => accept_failed(error).await,
                },
                Some(ended) = connections.join_next() => {
                    if let Err(error) = ended {
                        if error.is_panic() {
                            error!(%error, "a connection task panicked");
                        }
                    }
                }
            }
        }
        info!(%local_addr, connections = connections.len(), "rallypoint coordinator shutting down");
        drop(listener);
        // Connection tasks are aborted, not told to stop.
        connections.shutdown().await;
        reactor.stop().await;
        ticker.stop().await;
        info!(%local_addr, "rallypoint coordinator stopped");
        Ok(())
    }

    /// Runs the server on the current tokio runtime (call it from within one, as for
    /// `tokio::spawn`). Dropping the handle shuts the server down.
    #[must_use = "dropping the handle shuts the server down"]
    pub fn spawn(self) -> ServerHandle {
        let local_addr = self.local_addr;
        let shared = Arc::clone(&self.shared);
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(self.run_until(async move {
            // Completes when the handle sends or is dropped.
            let _ = stopped.await;
        }));
        ServerHandle { local_addr, shared, stop, task }
    }
}

/// A server running in the background (see [`Server::spawn`]).
pub struct ServerHandle {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    /// Never sent: dropping it is the shutdown signal.
    stop: oneshot::Sender<()>,
    task: JoinHandle<io::Result<()>>,
}

impl ServerHandle {
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// See [`Server::set_tcpstore_job`]. The launcher points TCPStore clients at the
    /// job of each attempt.
    pub fn set_tcpstore_job(&self, job: &str) {
        self.shared.set_tcpstore_job(job);
    }

    /// The ranks of `job` this coordinator counts as lost, and how and when each was
    /// last heard from. The launcher hosting it asks when a worker fails: a rank its
    /// peers lost is the root cause, not the peer that failed because of it.
    pub fn lost_ranks(&self, job: &str) -> Vec<RankInfo> {
        self.shared.lost_ranks(job)
    }

    /// Stops accepting, closes every connection and waits until the server is done.
    pub async fn shutdown(self) {
        let ServerHandle { stop, task, .. } = self;
        drop(stop);
        match task.await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => error!(%error, "the server failed"),
            Err(error) => error!(%error, "the server task failed"),
        }
    }
}

fn listen(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = if addr.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
    // Lets a restarted coordinator bind its port while old connections linger in TIME_WAIT.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

/// Keeps the accept loop alive through every accept error: one bad connection or a
/// temporary shortage must not take the coordinator of a whole job down.
async fn accept_failed(error: io::Error) {
    let exhausted = matches!(error.raw_os_error(), Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM));
    if exhausted {
        error!(%error, "cannot accept a connection (out of file descriptors or memory); retrying shortly");
        tokio::time::sleep(ACCEPT_BACKOFF).await;
    } else if matches!(
        error.kind(),
        io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset | io::ErrorKind::Interrupted
    ) {
        debug!(%error, "a connection failed before it was accepted");
    } else {
        warn!(%error, "accept failed");
        tokio::time::sleep(ACCEPT_BACKOFF).await;
    }
}

/// Writes `head`, then `tail`, as one stream of bytes: a batch of encoded replies
/// ending with the start of a frame whose last bytes are `tail`, bytes shared with
/// other replies (an all-gather's values, encoded once for every member). Writing
/// them together (`writev`) sends them without copying `tail` into the batch.
pub(crate) async fn write_with_tail(
    stream: &mut TcpStream,
    mut head: &[u8],
    mut tail: &[u8],
    progress: &mut WriteProgress<'_>,
) -> io::Result<()> {
    while !head.is_empty() || !tail.is_empty() {
        let written = if head.is_empty() {
            stream.write(tail).await?
        } else {
            stream.write_vectored(&[IoSlice::new(head), IoSlice::new(tail)]).await?
        };
        if written == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        if written < head.len() {
            head = &head[written..];
        } else {
            tail = &tail[written - head.len()..];
            head = &[];
        }
        progress.made();
    }
    Ok(())
}

/// Tells the engine, at most once per [`ALIVE_EVERY`], that the peers of a connection
/// take in a long write: a connection does not read (so sees no heartbeat) while it
/// writes, and a rank receiving many MiB must not lose its lease meanwhile.
pub(crate) struct WriteProgress<'a> {
    shared: &'a Shared,
    sessions: &'a (dyn Fn() -> Vec<SessionId> + Sync),
    since: Instant,
}

/// How often a long write counts as a sign of life (well inside any sensible lease).
const ALIVE_EVERY: Duration = Duration::from_secs(1);

impl<'a> WriteProgress<'a> {
    pub(crate) fn new(shared: &'a Shared, sessions: &'a (dyn Fn() -> Vec<SessionId> + Sync)) -> Self {
        WriteProgress { shared, sessions, since: Instant::now() }
    }

    fn made(&mut self) {
        if self.since.elapsed() >= ALIVE_EVERY {
            self.shared.alive((self.sessions)().into_iter());
            self.since = Instant::now();
        }
    }
}
