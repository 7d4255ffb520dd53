//! The coordinator: a TCP listener in front of the engine.
//!
//! The [`rallypoint_core::Engine`] holds all coordination state and does no I/O;
//! this crate only moves bytes between sockets and it. Its parts:
//!
//! - [`Server`]: binds, accepts, and tells each new connection apart by its first
//!   bytes (the handshake of [`rallypoint_net::conn`]);
//! - `native`: a rank's connection (rallypoint's own protocol), over TCP or TLS;
//! - `access`: which PyTorch TCPStore clients a coordinator with a token serves;
//! - `agent_link`: a node agent's connection, carrying its node's ranks as
//!   sub-sessions;
//! - `tcpstore` and `reactor`: PyTorch TCPStore connections and the thread that
//!   serves them;
//! - `shared`: the one owner of the engine, and where each session's replies go;
//! - `ticker`: the engine's clock;
//! - `write`: how large replies are written (shared tails, liveness during long writes).
//!
//! # Threads, and why these
//!
//! Every input reaches the engine through [`shared`]'s one lock, so the engine needs
//! no synchronisation of its own and sees every input in one order; the lock is held
//! for a batch of requests, never across I/O. Around it, three kinds of thread, each
//! picked for the traffic it serves:
//!
//! - **tokio tasks, one per native connection or node-agent link**, on a
//!   multi-threaded runtime. Native clients pipeline many calls per connection, an
//!   agent link carries a whole node, and replies can be large (an all-gather to
//!   thousands of ranks): tasks let one connection write megabytes while the others
//!   go on, and idle connections cost only their small task.
//! - **one TCPStore reactor thread** (`mio`), for PyTorch clients, which send one
//!   small request and wait for its answer: a round trip is all fixed costs, and the
//!   thread that returns from `epoll_wait` answering directly costs less per round
//!   trip than waking a task through a scheduler. torch's own server runs one libuv
//!   loop the same way.
//! - **one ticker thread** for the clock, so that the runtime holds no timer while
//!   connections are idle (see `ticker`).
//!
//! A panic while serving one connection closes that connection only; the lock
//! survives poisoning ([`rallypoint_net::sync::lock`]).

mod access;
mod agent_link;
mod native;
mod rank;
mod reactor;
mod shared;
mod tcpstore;
mod ticker;
mod write;

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rallypoint_core::snapshot::JobSnapshot;
use rallypoint_core::{AbortInfo, Config, JobMetrics, RankInfo};
pub use rallypoint_net::meter::{Protocol, ProtocolCounts, TrafficSnapshot};
use rallypoint_proto::native::FrameLimits;
use rallypoint_proto::tcpstore::TcpLimits;
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::oneshot;
use tokio::task::{JoinHandle, JoinSet};
use tracing::{debug, error, info, warn};

use reactor::Reactor;
use shared::Shared;
use ticker::Ticker;

pub use rallypoint_net::auth::Token;
use rallypoint_net::budget::PendingBudget;
pub use rallypoint_net::raise_fd_limit;
use rallypoint_net::set_keepalive;
pub use rallypoint_net::tls::TlsServer;
pub use rallypoint_net::IpNet;

use access::TcpStoreAccess;

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
    /// A connection that stops sending in the middle of a frame (or of a TCPStore
    /// request) for this long is closed: a hung or hostile peer must not hold a
    /// partial frame, and the memory it takes, for good.
    pub read_timeout: Duration,
    /// Bytes of unfinished requests all connections together may hold; past it, the
    /// connection holding the most is closed ([`rallypoint_net::budget`]).
    pub max_pending_bytes: usize,
    /// Native clients and node agents must prove this token (and get the server's
    /// proof back); PyTorch TCPStore clients, which cannot, are then served only as
    /// the `access` module says: this user's on this machine, and `tcpstore_allow`.
    pub token: Option<Arc<Token>>,
    /// Serve native clients and node agents over TLS on the same port; plaintext
    /// native clients are then refused. TCPStore stays plaintext.
    pub tls: Option<TlsServer>,
    /// With a token: networks of other machines whose TCPStore clients are served.
    pub tcpstore_allow: Vec<IpNet>,
    /// Serve plaintext native rank connections on the reactor thread, beside the
    /// TCPStore clients, instead of as tasks: a barrier round costs the coordinator
    /// less CPU, but every connection on that thread waits for the others' turns, so
    /// a peer streaming large requests slows every rank (docs/BENCHMARKS.md, the
    /// attack bench). Off unless asked for.
    pub native_on_reactor: bool,
}

impl ServerConfig {
    pub const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(30);
    /// The least [`ServerConfig::default_max_pending_bytes`] gives.
    pub const DEFAULT_MAX_PENDING_BYTES: usize = 256 << 20;

    /// The default budget of unfinished requests: an eighth of this machine's
    /// memory, at least [`Self::DEFAULT_MAX_PENDING_BYTES`]. A job's ranks may hold
    /// large requests at once without any of them being hostile: torch's elastic
    /// `synchronize` has every rank WAIT for, then MULTI_GET, all N keys: N
    /// requests of N keys each, arriving together, which a fixed budget closed
    /// ranks of. The largest holder is still closed past it.
    pub fn default_max_pending_bytes() -> usize {
        // SAFETY: sysconf has no preconditions.
        let (pages, page) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
        let memory = usize::try_from(pages).unwrap_or(0).saturating_mul(usize::try_from(page).unwrap_or(0));
        (memory / 8).max(Self::DEFAULT_MAX_PENDING_BYTES)
    }

    /// The longest request frame the coordinator reads with these settings (from the
    /// engine's limits: docs/PROTOCOL.md, section 10).
    pub fn max_frame_len(&self) -> usize {
        FrameLimits::from_limits(&self.engine.limits).max_frame_len
    }

    /// Listens on `listen` with the engine's `engine` settings and default I/O settings.
    pub fn new(listen: SocketAddr, engine: Config) -> ServerConfig {
        ServerConfig {
            listen,
            engine,
            read_timeout: Self::DEFAULT_READ_TIMEOUT,
            max_pending_bytes: Self::default_max_pending_bytes(),
            token: None,
            tls: None,
            tcpstore_allow: Vec::new(),
            native_on_reactor: false,
        }
    }
}

/// What every connection of a server is served with.
#[derive(Debug)]
pub(crate) struct ConnSettings {
    pub(crate) limits: FrameLimits,
    pub(crate) read_timeout: Duration,
    pub(crate) budget: Arc<PendingBudget>,
    pub(crate) auth: Arc<AuthSettings>,
    /// [`ServerConfig::native_on_reactor`].
    pub(crate) native_on_reactor: bool,
}

/// What a connection must prove before its hello counts (shared: per connection it
/// costs one pointer).
#[derive(Debug)]
pub(crate) struct AuthSettings {
    pub(crate) token: Option<Arc<Token>>,
    pub(crate) tls: Option<TlsServer>,
    /// `Some` when there is a token: TCPStore clients are checked.
    pub(crate) tcpstore: Option<TcpStoreAccess>,
}

/// A bound, not yet running coordinator.
pub struct Server {
    listener: TcpListener,
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    /// Shared by every connection: per connection it costs one pointer.
    settings: Arc<ConnSettings>,
    tcp_limits: TcpLimits,
}

impl Server {
    /// Raises the open-file limit, then binds exactly `config.listen`.
    pub async fn bind(config: ServerConfig) -> io::Result<Server> {
        let fd_limit = raise_fd_limit();
        let listener = listen(config.listen)
            .map_err(|e| io::Error::new(e.kind(), format!("cannot listen on {}: {e}", config.listen)))?;
        let local_addr = listener.local_addr()?;
        info!(
            %local_addr, fd_limit, lease_ms = config.engine.lease_ms, token = config.token.is_some(), tls = config.tls.is_some(),
            "rallypoint coordinator listening"
        );
        if config.token.as_ref().is_some_and(|token| token.is_short()) {
            warn!(
                "the token is shorter than {} bytes: a guessable token can be found from one recorded handshake",
                rallypoint_net::auth::SHORT_TOKEN
            );
        }
        if config.token.is_none() && !config.tcpstore_allow.is_empty() {
            warn!("--tcpstore-allow has no effect without a token: every TCPStore client is served");
        }
        // SAFETY: geteuid has no preconditions and cannot fail.
        let uid = unsafe { libc::geteuid() };
        let tcpstore = config.token.is_some().then(|| TcpStoreAccess {
            allow: config.tcpstore_allow.clone(),
            uid,
            proven: Default::default(),
        });
        let auth = Arc::new(AuthSettings { token: config.token.clone(), tls: config.tls.clone(), tcpstore });
        let settings = Arc::new(ConnSettings {
            limits: FrameLimits::from_limits(&config.engine.limits),
            read_timeout: config.read_timeout,
            budget: PendingBudget::new(config.max_pending_bytes),
            auth,
            native_on_reactor: config.native_on_reactor,
        });
        let tcp_limits = TcpLimits::from_limits(&config.engine.limits);
        Ok(Server { listener, local_addr, shared: Arc::new(Shared::new(config.engine)), settings, tcp_limits })
    }

    /// The job PyTorch TCPStore connections join (they cannot name one); "default"
    /// unless set. Takes effect for connections opened afterwards.
    pub fn set_tcpstore_job(&self, job: &str) {
        self.shared.set_tcpstore_job(job);
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// What the live page and the metrics endpoint read of this server.
    pub fn observer(&self) -> Observer {
        Observer { shared: Arc::clone(&self.shared), local_addr: self.local_addr }
    }

    /// Serves until `shutdown` completes, then stops accepting, closes every
    /// connection (their ranks count as lost, not left) and returns.
    pub async fn run_until(self, shutdown: impl Future<Output = ()>) -> io::Result<()> {
        let Server { listener, local_addr, shared, settings, tcp_limits } = self;
        let ticker = Ticker::start(Arc::clone(&shared))?;
        let reactor = Arc::new(Reactor::start(Arc::clone(&shared), tcp_limits, settings.read_timeout)?);
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
                        if let Err(error) = set_keepalive(&stream) {
                            debug!(%peer, %error, "cannot set TCP keepalive");
                        }
                        // Shutdown aborts these tasks (no per-task stop signal: an idle
                        // connection's memory is its task).
                        connections.spawn(native::serve(stream, peer, Arc::clone(&shared), Arc::clone(&settings), Arc::clone(&reactor)));
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
        let budget = Arc::clone(&self.settings.budget);
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(self.run_until(async move {
            // Completes when the handle sends or is dropped.
            let _ = stopped.await;
        }));
        ServerHandle { local_addr, shared, budget, stop, task }
    }
}

/// A server running in the background (see [`Server::spawn`]).
pub struct ServerHandle {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    budget: Arc<PendingBudget>,
    /// Never sent: dropping it is the shutdown signal.
    stop: oneshot::Sender<()>,
    task: JoinHandle<io::Result<()>>,
}

impl ServerHandle {
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// What the live page and the metrics endpoint read of this server.
    pub fn observer(&self) -> Observer {
        Observer { shared: Arc::clone(&self.shared), local_addr: self.local_addr }
    }

    /// Bytes of unfinished requests all connections hold now (see
    /// [`ServerConfig::max_pending_bytes`]).
    pub fn pending_bytes(&self) -> usize {
        self.budget.total()
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

    /// The ranks of `job` whose workers exited with code 0, as their launchers said
    /// (see `Engine::finished_ranks`).
    pub fn finished_ranks(&self, job: &str) -> Vec<RankInfo> {
        self.shared.finished_ranks(job)
    }

    /// The ranks of `job` a barrier or collective failed for, in rank order (see
    /// `Engine::failed_for`).
    pub fn failed_for(&self, job: &str) -> Vec<u32> {
        self.shared.failed_for(job)
    }

    /// Who aborted `job` and why, and when (ms since the Unix epoch), if it was
    /// aborted. The launcher hosting it asks at a worker's failure: an abort by
    /// another node's launcher, or by a rank, came first.
    pub fn aborted(&self, job: &str) -> Option<(AbortInfo, u64)> {
        self.shared.aborted(job)
    }

    /// How long the processes of `job` have asked nothing of this coordinator (no
    /// connection, no request but heartbeats, leaves and status requests); `None` if
    /// it holds no such job. The launcher hosting it reads this to tell a hung job.
    pub fn quiet_for(&self, job: &str) -> Option<Duration> {
        self.shared.quiet_ms(job).map(Duration::from_millis)
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

/// A read-only view of a running server, for the live page and the metrics
/// endpoint (crate `rallypoint-http`): each call takes the engine's lock once,
/// for as long as copying out what it returns takes (a snapshot costs the job's
/// ranks, bounded by `snapshot::MAX_RANKS_LISTED`, and its blocked waits).
#[derive(Clone)]
pub struct Observer {
    shared: Arc<Shared>,
    local_addr: SocketAddr,
}

/// Everything `/metrics` shows of a server.
#[derive(Debug, Clone)]
pub struct ServerMetrics {
    /// Every job, oldest first.
    pub jobs: Vec<JobMetrics>,
    pub traffic: TrafficSnapshot,
}

impl Observer {
    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Job `job` as data, or None if the server holds no such job.
    pub fn snapshot(&self, job: &str) -> Option<JobSnapshot> {
        self.shared.snapshot(job)
    }

    /// The names of the jobs the server holds, sorted (at most
    /// `rallypoint_core::MAX_JOBS_LISTED`), and whether that is all of them.
    pub fn jobs(&self) -> (Vec<String>, bool) {
        self.shared.jobs()
    }

    /// The job PyTorch TCPStore clients join now.
    pub fn tcpstore_job(&self) -> String {
        self.shared.tcpstore_job()
    }

    /// Every job's counters, and the connections' traffic.
    pub fn metrics(&self) -> ServerMetrics {
        let jobs = self.shared.job_metrics();
        let traffic = self.shared.traffic();
        // The cap on per-job byte meters counts jobs that exist.
        traffic.prune_jobs(|name| jobs.iter().any(|m| m.name == name));
        ServerMetrics { jobs, traffic: traffic.snapshot() }
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
