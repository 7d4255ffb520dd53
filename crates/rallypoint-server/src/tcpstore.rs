//! A PyTorch TCPStore connection (docs/TCPSTORE.md): torch's unframed protocol
//! in, an engine session without rank in the server's TCPStore job.
//!
//! torch sends no request ids and waits for each reply before its next request
//! (except WAIT followed by CANCEL_WAIT after a client-side timeout), so the
//! connection numbers the requests itself and writes the replies strictly in request order.
//! Requests without a reply in torch (SET, APPEND, MULTI_SET, QUEUE_PUSH) get none.
//! Where torch's server closes the connection (a handler error such as ADD on a
//! non-number, an over-limit length, an unknown type) this closes only this one.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::Waker;
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use rallypoint_core::{OpError, Reply, Request, Response, SessionId};
use rallypoint_net::budget::{Charge, OverBudget};
use rallypoint_net::conn::Buffering;
use rallypoint_net::meter::Counted;
use rallypoint_net::warn_limit::{admit_shared, WarnLimit};
use rallypoint_proto::tcpstore::{encode_answer, Answer, Command, CommandDecoder, TcpError, TcpLimits, VALIDATE_MAGIC};
use tracing::{debug, warn};

use crate::native::SessionGuard;
use crate::shared::{Outbox, Shared};

/// Requests handled between two writes of replies (see [`Conn::process`]).
const MAX_BATCH: usize = 16;

/// Warnings about TCPStore connections closed for what their peer did: shared, since
/// a client that reconnects in a loop makes a new connection each time.
static END_WARNINGS: std::sync::Mutex<WarnLimit> = std::sync::Mutex::new(WarnLimit::new());

/// How an engine reply becomes torch's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// No bytes on success (SET, APPEND, MULTI_SET, QUEUE_PUSH).
    Silent,
    Value,
    /// GET: torch's libuv server answers a missing key with an empty value.
    Get,
    Int,
    /// DELETE_KEY: whether it existed, as i64 1 or 0.
    Deleted,
    Check,
    /// WAIT and BARRIER: STOP_WAITING once released.
    Wait,
    Values,
    Keys,
    Popped,
    CancelWait,
}

/// A request awaiting its turn to be answered.
struct Pending {
    id: u64,
    kind: Kind,
    /// A CANCEL_WAIT came after it: its failure is the cancellation, not written.
    canceled: bool,
    reply: Option<Result<Option<Answer>, OpError>>,
}

/// Why the connection ends early.
#[derive(Debug, thiserror::Error)]
pub(crate) enum End {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("{0}")]
    Codec(#[from] TcpError),
    #[error("VALIDATE with the wrong magic 0x{0:08x}")]
    BadMagic(u32),
    /// torch's server closes the connection when a handler fails.
    #[error("{op} failed: {error}")]
    Failed { op: &'static str, error: Box<OpError> },
    #[error("refused: {0}")]
    Refused(Box<OpError>),
    #[error("closed to keep within the memory budget of unfinished requests: {0}")]
    OverBudget(#[from] OverBudget),
    #[error("closed to keep within the memory budget of unfinished requests: it held the most")]
    Evicted,
    #[error("stopped sending in the middle of a request ({buffered} bytes of it received, nothing for {waited:?})")]
    Stalled { buffered: usize, waited: Duration },
}

/// One TCPStore connection, owned and driven by the [`crate::reactor`] thread.
pub(crate) struct Conn {
    /// The bytes of the unfinished request this connection holds; dropped first, so
    /// given back before the peer sees the close.
    charge: Charge,
    stream: Counted<mio::net::TcpStream>,
    peer: SocketAddr,
    shared: Arc<Shared>,
    outbox: Arc<Outbox>,
    /// Resumes a request that arrives in pieces where it stopped.
    decoder: CommandDecoder,
    rbuf: BytesMut,
    /// When the last bytes of the unfinished request in `rbuf` arrived.
    progress_at: Instant,
    wbuf: BytesMut,
    session: Option<(SessionId, SessionGuard)>,
    next_id: u64,
    pending: VecDeque<Pending>,
    /// The socket may hold unread bytes (epoll is edge-triggered: read until it is drained).
    readable: bool,
    /// An event said the peer's end came: read until it shows (see [`Conn::set_readable`]).
    read_closed: bool,
    /// `rbuf` may hold whole requests not yet handled (read, or brought by the handshake).
    buffered: bool,
    /// The stream broke after these replies: close once they are written.
    broken: Option<End>,
}

/// Where a connection stands after [`Conn::service`].
pub(crate) enum Progress {
    /// Waiting for the peer (or for replies from the engine).
    Idle,
    /// Its read budget is spent with bytes still unread: service it again soon.
    More,
    /// The peer closed the connection.
    Closed,
}

impl Conn {
    /// A connection whose first byte (0x00, VALIDATE) is in `rbuf`.
    pub(crate) fn new(
        stream: Counted<mio::net::TcpStream>,
        peer: SocketAddr,
        rbuf: BytesMut,
        charge: Charge,
        shared: Arc<Shared>,
        limits: TcpLimits,
    ) -> Conn {
        Conn {
            charge,
            stream,
            peer,
            shared,
            outbox: Arc::new(Outbox::default()),
            decoder: CommandDecoder::new(limits),
            rbuf,
            progress_at: Instant::now(),
            wbuf: BytesMut::new(),
            session: None,
            next_id: 1,
            pending: VecDeque::new(),
            readable: true,
            read_closed: false,
            buffered: true,
            broken: None,
        }
    }

    pub(crate) fn stream(&mut self) -> &mut mio::net::TcpStream {
        self.stream.get_mut()
    }

    pub(crate) fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// An event said the socket has bytes (or an end, `closed`) to read. After an
    /// end, a short read no longer means the socket is drained: the end may wait
    /// behind the bytes read, and no new edge would report it.
    pub(crate) fn set_readable(&mut self, closed: bool) {
        self.readable = true;
        self.read_closed |= closed;
    }

    /// Writes what is ready, then reads and answers until the socket would block, the
    /// peer stops reading our replies, or `max_reads` reads are done. Replies the
    /// engine queued for this session (a WAIT released by another client) are
    /// written too; `waker` is woken when more are queued.
    pub(crate) fn service(&mut self, read_buf: &mut [u8], max_reads: usize, waker: &Waker) -> Result<Progress, End> {
        if self.charge.is_evicted() {
            return Err(End::Evicted);
        }
        let mut reads = 0;
        loop {
            self.write_ready()?;
            if !self.flush()? {
                return Ok(Progress::Idle); // the socket says when it takes more
            }
            if let Some(end) = self.broken.take() {
                return Err(end);
            }
            if self.buffered {
                self.broken = self.process().err();
                // Counted as soon as it is known, before any reply goes out.
                if let Err(over) = self.charge.hold(self.rbuf.len()) {
                    self.broken.get_or_insert(End::OverBudget(over));
                }
                if self.charge.notify_eviction(waker) {
                    return Err(End::Evicted);
                }
                continue;
            }
            if !self.readable {
                if self.outbox.ready.poll_wait(waker) {
                    continue;
                }
                self.shrink_idle_buffers();
                return Ok(Progress::Idle);
            }
            // A peer streaming a large request takes one read per turn: the others on
            // this thread (native ranks too) are not held up behind its bytes.
            if reads == max_reads || (reads > 0 && self.rbuf.len() > read_buf.len()) {
                return Ok(Progress::More);
            }
            reads += 1;
            match self.stream.read(read_buf) {
                Ok(0) => return Ok(Progress::Closed),
                Ok(n) => {
                    self.progress_at = Instant::now();
                    // A short read drained the socket; new bytes raise a new edge.
                    self.readable = self.read_closed || n == read_buf.len();
                    self.rbuf.extend_from_slice(&read_buf[..n]);
                    self.buffered = true;
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => self.readable = false,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) => return Err(error.into()),
            }
        }
    }

    /// Bytes read and not yet handled (of an unfinished request, between turns).
    pub(crate) fn buffered_bytes(&self) -> usize {
        self.rbuf.len()
    }

    /// Whether part of a request is buffered, waiting for the rest.
    pub(crate) fn is_mid_request(&self) -> bool {
        !self.rbuf.is_empty()
    }

    /// The end of a connection that stopped in the middle of a request for `timeout`.
    pub(crate) fn stalled(&self, now: Instant, timeout: Duration) -> Option<End> {
        let waited = now.saturating_duration_since(self.progress_at);
        (self.is_mid_request() && waited >= timeout).then(|| End::Stalled { buffered: self.rbuf.len(), waited })
    }

    /// Frees buffers grown past what [`Buffering::TORCH`] keeps: an idle connection
    /// must not keep megabytes for good (a job of 1,000 ranks that each once read an
    /// 8 MiB value), nor each of thousands a handshake's read buffer.
    fn shrink_idle_buffers(&mut self) {
        Buffering::TORCH.release_idle(&mut self.rbuf);
        Buffering::TORCH.release_idle(&mut self.wbuf);
    }

    /// Writes as much of the write buffer as the socket takes; true once it is empty.
    fn flush(&mut self) -> Result<bool, End> {
        while !self.wbuf.is_empty() {
            match self.stream.write(&self.wbuf) {
                Ok(0) => return Err(End::Io(io::ErrorKind::WriteZero.into())),
                Ok(n) => self.wbuf.advance(n),
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) => return Err(error.into()),
            }
        }
        Ok(true)
    }

    /// Logs how the connection ended.
    pub(crate) fn log_end(&self, end: Result<(), End>) {
        let (peer, session) = (self.peer, self.session.as_ref().map(|(s, _)| *s));
        match end {
            Ok(()) => debug!(%peer, ?session, "TCPStore connection closed by the peer"),
            Err(End::Io(error)) => debug!(%peer, ?session, %error, "TCPStore connection failed"),
            Err(error) => {
                if let Some(held_back) = admit_shared(&END_WARNINGS) {
                    warn!(%peer, ?session, %error, held_back, "closing the TCPStore connection");
                }
            }
        }
    }

    /// The engine panicked while serving this connection: drop its session without
    /// calling the engine again.
    pub(crate) fn abandon(&mut self) {
        if let Some((_, guard)) = self.session.take() {
            guard.forget();
        }
    }

    /// Decodes the whole requests buffered, at most [`MAX_BATCH`], and feeds them to
    /// the engine in one batch. The replies are written before the next batch, so a
    /// client that pipelines requests for large values but does not read the answers
    /// makes the server hold at most one batch of replies beyond what the socket takes.
    fn process(&mut self) -> Result<(), End> {
        self.buffered = false;
        let mut decoded = 0;
        // torch sends one request at a time: the first needs no allocation.
        let mut first = None;
        let mut rest = Vec::new();
        let mut result = Ok(());
        loop {
            if decoded == MAX_BATCH {
                self.buffered = true;
                break;
            }
            decoded += 1;
            let command = match self.decoder.decode(&mut self.rbuf) {
                Ok(Some(command)) => command,
                Ok(None) => break,
                Err(error) => {
                    result = Err(error.into());
                    break;
                }
            };
            debug!(peer = %self.peer, op = command.name(), "TCPStore request");
            match command {
                Command::Validate { magic } if magic != VALIDATE_MAGIC => {
                    result = Err(End::BadMagic(magic));
                    break;
                }
                Command::Ping { nonce } => {
                    // torch's nonce is its pid: the best name this process has until its rank is known.
                    if let Err(error) = self.open(nonce) {
                        result = Err(error);
                        break;
                    }
                    let pong = Some(Ok(Some(Answer::Pong(nonce))));
                    self.pending.push_back(Pending { id: 0, kind: Kind::Silent, canceled: false, reply: pong });
                    continue;
                }
                Command::CancelWait => {
                    for p in self.pending.iter_mut().filter(|p| p.kind == Kind::Wait) {
                        p.canceled = true;
                    }
                }
                _ => {}
            }
            let Some((request, kind)) = translate(command) else { continue };
            if let Err(error) = self.open(0) {
                result = Err(error);
                break;
            }
            let id = self.next_id;
            self.next_id += 1;
            self.pending.push_back(Pending { id, kind, canceled: false, reply: None });
            if first.is_none() {
                first = Some((id, request));
            } else {
                rest.push((id, request));
            }
        }
        if let (Some((session, _)), Some(first)) = (&self.session, first) {
            let pending = &mut self.pending;
            let requests = std::iter::once(first).chain(rest);
            self.shared.handle(*session, &self.outbox, requests, &mut |id, reply| settle(pending, id, reply));
        }
        result
    }

    /// Opens the engine session at the first request, naming the process `pid` (0: unknown).
    fn open(&mut self, pid: u32) -> Result<(), End> {
        if self.session.is_some() {
            return Ok(());
        }
        let host = self.peer.ip().to_string();
        let (welcome, job) =
            self.shared.open_tcpstore(&host, pid, Arc::clone(&self.outbox)).map_err(|e| End::Refused(Box::new(e)))?;
        self.stream.set_job(self.shared.traffic().job(&job));
        let session = welcome.session;
        debug!(peer = %self.peer, %session, pid, "TCPStore session opened");
        // TCPStore clients state no incarnation: their sessions cannot resume, so
        // their process need not be watched.
        let guard = SessionGuard::new(Arc::clone(&self.shared), session, Arc::clone(&self.outbox), None);
        self.session = Some((session, guard));
        Ok(())
    }

    /// Takes the engine's replies and encodes, in request order, every answer whose
    /// turn has come. A failure torch would answer by closing the connection ends it.
    fn write_ready(&mut self) -> Result<(), End> {
        for (id, reply) in self.outbox.take() {
            settle(&mut self.pending, id, reply);
        }
        while self.pending.front().is_some_and(|p| p.reply.is_some()) {
            let Some(Pending { kind, reply: Some(reply), .. }) = self.pending.pop_front() else { break };
            match reply {
                Ok(Some(answer)) => encode_answer(&answer, &mut self.wbuf),
                Ok(None) => {}
                Err(error) => return Err(End::Failed { op: kind_name(kind), error: Box::new(error) }),
            }
        }
        Ok(())
    }
}

/// Records an engine reply on its pending request.
fn settle(pending: &mut VecDeque<Pending>, id: u64, reply: Reply) {
    if let Some(p) = pending.iter_mut().find(|p| p.id == id && p.reply.is_none()) {
        p.reply = Some(answer(p.kind, p.canceled, reply));
    }
}

/// The engine request for a torch command, and how to answer it; None for the
/// handshake commands, which the connection answers itself.
fn translate(command: Command) -> Option<(Request, Kind)> {
    Some(match command {
        Command::Set { key, value } => (Request::Set { key, value }, Kind::Silent),
        Command::Append { key, value } => (Request::Append { key, value }, Kind::Silent),
        Command::MultiSet { entries } => (Request::MultiSet { entries }, Kind::Silent),
        Command::QueuePush { key, value } => (Request::QueuePush { key, value }, Kind::Silent),
        Command::CompareSet { key, expected, desired } => (Request::CompareSet { key, expected, desired }, Kind::Value),
        // torch's GET never blocks (its get() is WAIT then GET): a timeout of 0.
        Command::Get { key } => (Request::Get { key, timeout_ms: Some(0) }, Kind::Get),
        Command::Add { key, delta } => (Request::Add { key, delta }, Kind::Int),
        Command::Check { keys } => (Request::Check { keys }, Kind::Check),
        // torch's timeouts are the client's: it sends CANCEL_WAIT when it gives up.
        Command::Wait { keys } => (Request::Wait { keys, timeout_ms: None }, Kind::Wait),
        Command::NumKeys => (Request::NumKeys, Kind::Int),
        Command::DeleteKey { key } => (Request::Delete { key }, Kind::Deleted),
        Command::MultiGet { keys } => (Request::MultiGet { keys, timeout_ms: Some(0) }, Kind::Values),
        Command::QueuePop { key } => (Request::QueuePop { key }, Kind::Popped),
        Command::QueueLen { key } => (Request::QueueLen { key }, Kind::Int),
        Command::ListKeys => (Request::ListKeys { prefix: Bytes::new() }, Kind::Keys),
        Command::Barrier { key, world_size } => {
            (Request::StoreBarrier { key, world_size, timeout_ms: None }, Kind::Wait)
        }
        Command::CancelWait => (Request::CancelWait, Kind::CancelWait),
        Command::Validate { .. } | Command::Ping { .. } => return None,
    })
}

/// torch's answer for an engine reply: `Ok(None)` writes nothing.
fn answer(kind: Kind, canceled: bool, reply: Reply) -> Result<Option<Answer>, OpError> {
    let response = match (kind, reply) {
        (Kind::Wait, Err(_)) if canceled => return Ok(None),
        (Kind::Get, Err(OpError::KeyTimeout { .. })) => return Ok(Some(Answer::Value(Bytes::new()))),
        (_, Err(error)) => return Err(error),
        (_, Ok(response)) => response,
    };
    let unexpected = |r: Response| Err(OpError::Invalid(format!("unexpected engine reply {r:?}")));
    Ok(Some(match (kind, response) {
        (Kind::Silent, Response::Done) => return Ok(None),
        (Kind::Value | Kind::Get, Response::Value(v)) => Answer::Value(v),
        (Kind::Int, Response::Int(n)) => Answer::Int(n),
        (Kind::Deleted, Response::Bool(existed)) => Answer::Int(i64::from(existed)),
        (Kind::Check, Response::Bool(ready)) => Answer::Check { ready },
        (Kind::Wait, Response::Done) => Answer::StopWaiting,
        (Kind::CancelWait, Response::Done) => Answer::WaitCanceled,
        (Kind::Values, Response::Values(values)) => Answer::Values(values),
        (Kind::Keys, Response::Values(keys)) => Answer::Keys(keys),
        (Kind::Popped, Response::Popped { len_before, value }) => Answer::Popped { len_before, value },
        (_, other) => return unexpected(other),
    }))
}

fn kind_name(kind: Kind) -> &'static str {
    match kind {
        Kind::Silent => "SET/APPEND/MULTI_SET/QUEUE_PUSH",
        Kind::Value => "COMPARE_SET",
        Kind::Get => "GET",
        Kind::Int => "ADD/GETNUMKEYS/QUEUE_LEN",
        Kind::Deleted => "DELETE_KEY",
        Kind::Check => "CHECK",
        Kind::Wait => "WAIT/BARRIER",
        Kind::Values => "MULTI_GET",
        Kind::Keys => "LIST_KEYS",
        Kind::Popped => "QUEUE_POP",
        Kind::CancelWait => "CANCEL_WAIT",
    }
}
