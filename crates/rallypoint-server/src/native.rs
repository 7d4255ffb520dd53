//! One client connection's handshake: TLS if it starts with it, the protocol
//! preamble, the token handshake, the hello and the session's admission. Then a
//! plaintext rank connection goes to the reactor thread (module `rank`), a TLS one
//! is served here by its task until it ends (while idle it holds no read or write
//! buffer), a node agent by `agent_link`; TCPStore connections are recognised here
//! and handed to the reactor too.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::BytesMut;
use rallypoint_core::{Departure, Identity, OpError, Reply, SessionId};
use rallypoint_net::budget::Charge;
use rallypoint_net::conn::{
    accept_hello, after_read, decode_requests, hold_buffered, peek_first_byte, read_some, stall, Accepts, Buffering,
    End, Gate, Hello, Inbound,
};
use rallypoint_net::meter::{Counted, Protocol};
use rallypoint_net::tls::TLS_FIRST_BYTE;
use rallypoint_net::warn_limit::{admit_shared, WarnLimit};
use rallypoint_proto::native::{encode_reply, encode_reply_shared, encode_server_frame, ServerFrame};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::rank::RankConn;
use crate::reactor::Reactor;
use crate::shared::{Outbox, Shared};
use crate::write::{write_with_tail, WriteProgress};
use crate::ConnSettings;

/// Stop gathering replies into one write past this size and send what we have.
const MAX_WRITE_BATCH: usize = 1 << 20;
/// A peer that connects but does not finish the preamble and hello in this time is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

/// Serves one accepted connection until it closes; never fails the server.
///
/// Memory per idle connection is what this task holds while a session waits, so
/// the handshake (and a node agent's whole life) runs in a boxed future freed when
/// it ends; the task itself keeps only the open [`Session`] and its loop. A TCPStore
/// connection leaves for the [`Reactor`] thread once recognised.
pub(crate) fn serve(
    stream: TcpStream,
    peer: SocketAddr,
    shared: Arc<Shared>,
    settings: Arc<ConnSettings>,
    reactor: Arc<Reactor>,
) -> impl Future<Output = ()> + Send {
    // Every byte of the connection is counted from here (module `rallypoint_net::meter`).
    let stream = Counted::new(stream, Arc::clone(shared.traffic()));
    let opening = Box::pin(open(stream, peer, shared, settings, reactor));
    // The session is matched by reference, never moved out across an await: each
    // such move would keep one more copy of it in the task for the connection's
    // whole life.
    async move {
        let Some(mut opened) = opening.await else { return };
        match &mut opened {
            Opened::Plain(session) => run(session).await,
            Opened::Tls(session) => run(session).await,
        }
    }
}

/// Hands an admitted plaintext session to the reactor thread, which serves it from
/// now on (module `rank`). A TLS session stays in its task: rustls encrypts and
/// decrypts in the stream it wraps, which the reactor does not drive.
fn hand_over(session: Session<Tcp>, reactor: &Reactor) {
    let Session { conn, guard } = session;
    let Connection { charge, stream, peer, settings, rbuf, wbuf, warnings } = conn;
    // The reactor reads and writes the socket itself: its account goes with it.
    let (stream, account) = stream.into_parts();
    let stream = match stream.into_std() {
        Ok(stream) => stream,
        Err(error) => {
            debug!(%peer, %error, "cannot hand a connection to the reactor; closing it");
            return;
        }
    };
    let rank = RankConn::new(stream, account, peer, guard, settings.limits, rbuf, wbuf, charge, warnings);
    if let Err(error) = reactor.adopt_rank(rank) {
        debug!(%peer, %error, "cannot serve a rank's connection; closing it");
    }
}

/// Who the process of a native session is, for telling its death from a cut
/// connection when the session ends (see [`SessionGuard`]).
pub(crate) struct Process {
    pub(crate) pid: u32,
    /// It runs on this machine: its death can be seen here.
    pub(crate) local: bool,
}

impl Process {
    pub(crate) fn of(shared: &Shared, identity: &Identity) -> Process {
        Process { pid: identity.pid, local: shared.is_local(identity) }
    }
}

/// Serves an admitted session until its connection ends, then logs how.
async fn run<S: AsyncRead + AsyncWrite + Unpin>(session: &mut Session<S>) {
    let Session { conn, guard } = session;
    let end = conn.run(guard).await;
    log_end(conn.peer, Some(guard.session), &end);
}

/// A TCP connection, its bytes counted.
type Tcp = Counted<TcpStream>;

/// A TLS connection, boxed: its state is large, and most connections are plaintext.
type TlsConn = Box<tokio_rustls::server::TlsStream<Tcp>>;

/// The counted TCP stream under a connection's stream, to say what it carries.
pub(crate) trait Metered {
    fn counted(&mut self) -> &mut Tcp;
}

impl Metered for Tcp {
    fn counted(&mut self) -> &mut Tcp {
        self
    }
}

impl Metered for TlsConn {
    fn counted(&mut self) -> &mut Tcp {
        self.get_mut().0
    }
}

/// An admitted session, over whichever stream it came.
enum Opened {
    Plain(Session<Tcp>),
    Tls(Session<TlsConn>),
}

/// What became of a connection's handshake.
enum Admission<S> {
    Session(Session<S>),
    /// A PyTorch TCPStore client: its stream, the bytes read from it, and their charge.
    TcpStore(S, BytesMut, Charge),
    /// Refused, closed, or served to its end (a node agent).
    Done,
}

/// Handshake and admission: TLS if this server serves it and the client starts
/// with a TLS handshake, then the preamble, the token handshake, the hello. `None`:
/// the connection is done here (refused, closed, served to its end as a node
/// agent, or handed to the reactor thread: a TCPStore client, or a plaintext rank
/// with `native_on_reactor`).
async fn open(
    stream: Tcp,
    peer: SocketAddr,
    shared: Arc<Shared>,
    settings: Arc<ConnSettings>,
    reactor: Arc<Reactor>,
) -> Option<Opened> {
    let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
    let timed_out = || End::HandshakeTimeout(HANDSHAKE_TIMEOUT);
    let auth = Arc::clone(&settings.auth);
    if let Some(tls) = &auth.tls {
        let first = tokio::time::timeout_at(deadline, peek_first_byte(stream.get_ref())).await;
        match first {
            Ok(Ok(Some(TLS_FIRST_BYTE))) => {
                let stream = match tokio::time::timeout_at(deadline, tls.accept(stream)).await {
                    Ok(Ok(stream)) => Box::new(stream),
                    Ok(Err(error)) => {
                        log_end(peer, None, &End::Tls(error));
                        return None;
                    }
                    Err(_) => {
                        log_end(peer, None, &timed_out());
                        return None;
                    }
                };
                let gate = Gate { token: auth.token.clone(), tls_required: false };
                let accepts = Accepts { tcpstore: false, agents: true };
                return match admit(stream, peer, shared, settings, accepts, &gate, deadline).await {
                    Admission::Session(session) => Some(Opened::Tls(session)),
                    Admission::TcpStore(..) | Admission::Done => None,
                };
            }
            Ok(Ok(Some(_))) => {}
            Ok(Ok(None)) => return None,
            Ok(Err(error)) => {
                log_end(peer, None, &End::Io(error));
                return None;
            }
            Err(_) => {
                log_end(peer, None, &timed_out());
                return None;
            }
        }
    }
    let gate = Gate { token: auth.token.clone(), tls_required: auth.tls.is_some() };
    let on_reactor = settings.native_on_reactor;
    match admit(stream, peer, shared, settings, Accepts::COORDINATOR, &gate, deadline).await {
        Admission::Session(session) if on_reactor => {
            hand_over(session, &reactor);
            None
        }
        Admission::Session(session) => Some(Opened::Plain(session)),
        Admission::TcpStore(stream, rbuf, charge) => {
            if let Some(access) = &auth.tcpstore {
                if !access.admits(stream.get_ref(), peer).await {
                    return None;
                }
            }
            debug!(%peer, "PyTorch TCPStore client");
            if let Err(error) = reactor.adopt(stream, peer, rbuf, charge) {
                debug!(%peer, %error, "cannot serve a TCPStore client; closing the connection");
            }
            None
        }
        Admission::Done => None,
    }
}

/// The handshake over `stream` (plaintext or TLS) and, for a native client, its
/// admission by the engine; a node agent is served here to its end.
async fn admit<S: AsyncRead + AsyncWrite + Unpin + Send + Metered>(
    mut stream: S,
    peer: SocketAddr,
    shared: Arc<Shared>,
    settings: Arc<ConnSettings>,
    accepts: Accepts,
    gate: &Gate,
    deadline: Instant,
) -> Admission<S> {
    let mut rbuf = BytesMut::new();
    let mut charge = settings.budget.charge();
    let hello = accept_hello(&mut stream, &mut rbuf, &settings.limits, accepts, gate, &mut charge);
    let hello = tokio::time::timeout_at(deadline, hello).await.unwrap_or(Err(End::HandshakeTimeout(HANDSHAKE_TIMEOUT)));
    let mut conn =
        Connection { stream, peer, settings, rbuf, wbuf: BytesMut::new(), warnings: WarnLimit::new(), charge };
    // Past the gate, a client with a token proved it: its host's TCPStore clients
    // (a launcher's node's torch workers) are served (module `access`).
    if let (Ok(Hello::Native(_) | Hello::Agent), Some(_), Some(access)) =
        (&hello, &gate.token, &conn.settings.auth.tcpstore)
    {
        access.proved(peer.ip());
    }
    let identity = match hello {
        Ok(Hello::Native(identity)) => {
            conn.stream.counted().classify(Protocol::Native);
            identity
        }
        Ok(Hello::Agent) => {
            conn.stream.counted().classify(Protocol::Agent);
            Box::pin(crate::agent_link::serve(conn.stream, peer, conn.rbuf, shared, &conn.settings, conn.charge)).await;
            return Admission::Done;
        }
        Ok(Hello::TcpStore) => {
            conn.stream.counted().classify(Protocol::TcpStore);
            return Admission::TcpStore(conn.stream, conn.rbuf, conn.charge);
        }
        Err(end) => {
            if let End::Refused(error) = &end {
                conn.refuse(error).await;
            }
            log_end(peer, None, &end);
            return Admission::Done;
        }
    };
    let outbox = Arc::new(Outbox::default());
    let welcome = match shared.open(identity.clone(), Arc::clone(&outbox)) {
        Ok(welcome) => welcome,
        Err(error) => {
            if let Some(held_back) = admit_shared(&END_WARNINGS) {
                warn!(%peer, job = %identity.job, rank = ?identity.rank, %error, held_back, "refused a client");
            }
            conn.refuse(&error).await;
            return Admission::Done;
        }
    };
    let id = welcome.session;
    conn.stream.counted().set_job(shared.traffic().job(&identity.job));
    debug!(%peer, session = %id, job = %identity.job, rank = ?identity.rank, host = %identity.host, pid = identity.pid, "session opened");
    encode_server_frame(&ServerFrame::Welcome(welcome), &mut conn.wbuf);
    let process = Process::of(&shared, &identity);
    let guard = SessionGuard::new(shared, id, outbox, Some(process));
    Admission::Session(Session { conn, guard })
}

/// An admitted native session: its connection, and the guard that closes it in the
/// engine when the task ends (and holds its outbox).
struct Session<S> {
    conn: Connection<S>,
    guard: SessionGuard,
}

/// Warnings about how connections ended, or were refused: shared by every
/// connection, since a client connecting in a loop makes a new one each time.
static END_WARNINGS: Mutex<WarnLimit> = Mutex::new(WarnLimit::new());

/// Logs how a connection ended: a warning if the peer misbehaved (limited), else at
/// debug level.
pub(crate) fn log_end(peer: SocketAddr, session: Option<SessionId>, end: &End) {
    if end.is_peer_fault() {
        if let Some(held_back) = admit_shared(&END_WARNINGS) {
            warn!(%peer, ?session, held_back, "closing the connection: {end}");
        }
    } else {
        debug!(%peer, ?session, "connection ended: {end}");
    }
}

/// Tells the engine when the session ends, however the connection ends (error,
/// peer close, server shutdown cancelling the task), unless the session was resumed
/// on another connection meanwhile.
///
/// A session whose process ran on this machine (its hello says so) is closed as a
/// death at once if the process is gone. If it still runs, it may be exiting (the
/// kernel closes a killed process's sockets before the process is gone), or its
/// connection was cut: the session waits for a resume, and a watcher looks at the
/// process during that grace, so that a death still fails its peers at once.
pub(crate) struct SessionGuard {
    pub(crate) shared: Arc<Shared>,
    pub(crate) session: SessionId,
    pub(crate) outbox: Arc<Outbox>,
    /// The session's process, for a native session.
    process: Option<Process>,
    /// The engine panicked: do not call it again on drop.
    abandoned: bool,
}

impl SessionGuard {
    pub(crate) fn new(
        shared: Arc<Shared>,
        session: SessionId,
        outbox: Arc<Outbox>,
        process: Option<Process>,
    ) -> SessionGuard {
        SessionGuard { shared, session, outbox, process, abandoned: false }
    }

    /// Drops the session's outbox without telling the engine (see [`Shared::forget`]).
    pub(crate) fn forget(mut self) {
        self.abandoned = true;
    }

    /// As [`SessionGuard::forget`], once the guard is dropped.
    pub(crate) fn abandon(&mut self) {
        self.abandoned = true;
    }
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        if self.abandoned || std::thread::panicking() {
            // The engine may be what panicked; calling it again would abort the process.
            self.shared.forget(self.session);
            return;
        }
        let Some(Process { pid, local: true }) = self.process else {
            self.shared.close(self.session, &self.outbox, Departure::Unknown);
            return;
        };
        if rallypoint_net::process::process_gone(pid) {
            self.shared.close(self.session, &self.outbox, Departure::ProcessGone);
            return;
        }
        if !self.shared.close(self.session, &self.outbox, Departure::Unknown) {
            return; // resumed on another connection
        }
        let grace = std::time::Duration::from_millis(self.shared.grace_ms());
        // Dropped outside a runtime only at shutdown, when nobody waits for peers.
        if let (false, Ok(runtime)) = (grace.is_zero(), tokio::runtime::Handle::try_current()) {
            let (shared, session) = (Arc::clone(&self.shared), self.session);
            runtime.spawn(async move {
                if rallypoint_net::process::watch(pid, grace).await {
                    shared.process_gone(session);
                }
            });
        }
    }
}

struct Connection<S> {
    /// The bytes of unfinished requests this connection holds. Declared first, so
    /// dropped first: they are given back before the peer sees the close.
    charge: Charge,
    stream: S,
    peer: SocketAddr,
    settings: Arc<ConnSettings>,
    rbuf: BytesMut,
    wbuf: BytesMut,
    /// Warnings about this peer's bad requests.
    warnings: WarnLimit,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Connection<S> {
    /// Sends `Refused` and closes; errors are moot since we close either way.
    async fn refuse(&mut self, error: &OpError) {
        self.wbuf.clear();
        encode_server_frame(&ServerFrame::Refused(error.clone()), &mut self.wbuf);
        if self.stream.write_all(&self.wbuf).await.is_ok() {
            // A TLS shutdown flushes, then sends its close_notify.
            let _ = self.stream.shutdown().await;
        }
    }

    /// Serves the open session until the connection ends; returns how.
    async fn run(&mut self, guard: &SessionGuard) -> End {
        let (session, shared, outbox) = (guard.session, &*guard.shared, &guard.outbox);
        // Replies to this session's requests that were ready at once; moved into
        // each flush, so that an idle connection holds no allocation for them.
        let mut immediate = Vec::new();
        // The hello may have arrived together with the first requests.
        let mut broken = self.process(session, shared, outbox, &mut immediate).err();
        loop {
            // Replies to the requests before a broken frame still go out, so the peer
            // learns all it can before the connection closes.
            // Boxed: a flush's state (iterators, a shared tail, the vectored write) is
            // larger than the idle wait's, and would otherwise sit in every idle task.
            let replies = std::mem::take(&mut immediate).into_iter().chain(outbox.take());
            if let Err(error) = Box::pin(self.flush(replies, session, shared)).await {
                return End::Io(error);
            }
            if let Some(end) = broken.take() {
                return end;
            }
            // Idle connections keep no read buffer (bytes of a partial frame stay)
            // and no write buffer (flush leaves it empty).
            Buffering::RANK.release_idle(&mut self.rbuf);
            self.wbuf = BytesMut::new();
            let buffered = self.rbuf.len();
            if outbox.superseded() {
                return End::Shutdown("the session was resumed on another connection".to_owned());
            }
            tokio::select! {
                // Replies first: they free waiting peers, and reading more only adds work.
                biased;
                () = outbox.ready.wait() => {}
                read = std::future::poll_fn(|cx| read_some(&mut self.stream, &mut self.rbuf, Buffering::RANK, cx)) => {
                    match read {
                        Ok(0) if self.rbuf.is_empty() => return End::Closed,
                        Ok(0) => return End::ClosedMidFrame { buffered: self.rbuf.len() },
                        Ok(read) => {
                            broken = self.process(session, shared, outbox, &mut immediate).err();
                            after_read(read).await;
                        }
                        Err(error) => return End::Io(error),
                    }
                }
                end = stall(buffered, self.settings.read_timeout) => return end,
                () = self.charge.evicted() => return End::Evicted,
            }
        }
    }

    /// Decodes every whole frame buffered and feeds the requests to the engine under
    /// one lock; replies ready at once go to `immediate`. Bad requests get an
    /// `Invalid` reply; a broken stream ends the session (after the requests before
    /// it are handled).
    fn process(
        &mut self,
        session: SessionId,
        shared: &Shared,
        outbox: &Arc<Outbox>,
        immediate: &mut Vec<(u64, Reply)>,
    ) -> Result<(), End> {
        let mut requests = Vec::new();
        let (peer, wbuf, warnings) = (self.peer, &mut self.wbuf, &mut self.warnings);
        let result = decode_requests(&mut self.rbuf, &self.settings.limits, |input| match input {
            Inbound::Request { id, request } => requests.push((id, request)),
            // Only node agents hand out shared replies and barrier channels: they serve
            // the Unix sockets of their node, the coordinator only TCP. Replies stay plain frames.
            Inbound::TakeSharedReplies | Inbound::ReleaseShared { .. } | Inbound::LeaveBarrierChannel { .. } => {}
            // Likewise barrier channels: the call goes through messages, as all later ones.
            Inbound::AttachBarrier { id, request } => {
                let reason = "barrier channels are a node agent's, over its Unix socket".to_owned();
                encode_server_frame(&ServerFrame::NoBarrierChannel { id, reason }, wbuf);
                requests.push((id, request));
            }
            Inbound::Invalid { id, message } => {
                if let Some(held_back) = warnings.admit() {
                    warn!(%peer, %session, %message, held_back, "bad request");
                }
                if let Some(id) = id {
                    encode_reply(id, &Err(OpError::Invalid(message)), wbuf);
                }
            }
        });
        if !requests.is_empty() {
            shared.handle(session, outbox, requests.into_iter(), &mut |id, reply| immediate.push((id, reply)));
        }
        // Counted as soon as it is known, so that what a peer sees happen after this
        // (its replies) never comes before the count.
        result?;
        hold_buffered(&mut self.charge, &self.rbuf)
    }

    /// Writes what is buffered and `replies`, batched into as few writes as possible.
    /// A reply's large shared tail (an all-gather's values, encoded once for every
    /// member) is written from where it is, after the batch that ends with its head.
    async fn flush(
        &mut self,
        mut replies: impl Iterator<Item = (u64, Reply)>,
        session: SessionId,
        shared: &Shared,
    ) -> io::Result<()> {
        let this_session = || vec![session];
        let mut progress = WriteProgress::new(shared, &this_session);
        loop {
            let mut tail = None;
            while tail.is_none() && self.wbuf.len() < MAX_WRITE_BATCH {
                let Some((id, reply)) = replies.next() else { break };
                tail = encode_reply_shared(id, &reply, &mut self.wbuf);
            }
            if self.wbuf.is_empty() {
                break;
            }
            write_with_tail(&mut self.stream, &self.wbuf, tail.as_deref().unwrap_or_default(), &mut progress).await?;
            self.wbuf.clear();
        }
        Ok(())
    }
}
