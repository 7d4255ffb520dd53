//! A PyTorch TCPStore connection (docs/TCPSTORE.md): torch's unframed protocol
//! in, an engine session without rank in the server's TCPStore job.
//!
//! torch sends no request ids and waits for each reply before its next request
//! (except WAIT followed by CANCEL_WAIT after a client-side timeout), so this task
//! numbers the requests itself and writes the replies strictly in request order.
//! Requests without a reply in torch (SET, APPEND, MULTI_SET, QUEUE_PUSH) get none.
//! Where torch's server closes the connection (a handler error such as ADD on a
//! non-number, an over-limit length, an unknown type) this closes only this one.

use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use rallypoint_core::{OpError, Reply, Request, Response, SessionId};
use rallypoint_proto::tcpstore::{decode_command, encode_answer, Answer, Command, TcpError, TcpLimits, VALIDATE_MAGIC};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tracing::{debug, warn};

use super::connection::{poll_read_some, SessionGuard};
use super::shared::{Outbox, Shared};

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
enum End {
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
}

struct Conn<'a> {
    stream: TcpStream,
    peer: SocketAddr,
    shared: &'a Arc<Shared>,
    outbox: Arc<Outbox>,
    limits: TcpLimits,
    rbuf: BytesMut,
    wbuf: BytesMut,
    session: Option<(SessionId, SessionGuard)>,
    next_id: u64,
    pending: VecDeque<Pending>,
}

/// Serves a connection whose first byte (0x00, VALIDATE) is in `rbuf`.
pub(crate) async fn serve(stream: TcpStream, peer: SocketAddr, rbuf: BytesMut, shared: Arc<Shared>, limits: TcpLimits) {
    let mut conn = Conn {
        stream,
        peer,
        shared: &shared,
        outbox: Arc::new(Outbox::default()),
        limits,
        rbuf,
        wbuf: BytesMut::new(),
        session: None,
        next_id: 1,
        pending: VecDeque::new(),
    };
    let result = conn.run().await;
    let session = conn.session.as_ref().map(|(s, _)| *s);
    match result {
        Ok(()) => debug!(%peer, ?session, "TCPStore connection closed by the peer"),
        Err(End::Io(error)) => debug!(%peer, ?session, %error, "TCPStore connection failed"),
        Err(error) => warn!(%peer, ?session, %error, "closing the TCPStore connection"),
    }
}

impl<'a> Conn<'a> {
    async fn run(&mut self) -> Result<(), End> {
        loop {
            let broken = self.process().err();
            self.write_ready()?;
            if !self.wbuf.is_empty() {
                self.stream.write_all(&self.wbuf).await?;
                self.wbuf.clear();
            }
            if let Some(end) = broken {
                return Err(end);
            }
            tokio::select! {
                biased;
                () = self.outbox.ready.notified() => {}
                read = std::future::poll_fn(|cx| poll_read_some(&mut self.stream, &mut self.rbuf, cx)) => {
                    if read? == 0 {
                        return Ok(());
                    }
                }
            }
        }
    }

    /// Decodes every whole request buffered and feeds them to the engine in one batch.
    fn process(&mut self) -> Result<(), End> {
        let mut requests = Vec::new();
        let mut result = Ok(());
        loop {
            let command = match decode_command(&mut self.rbuf, &self.limits) {
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
            requests.push((id, request));
        }
        if let (Some((session, _)), false) = (&self.session, requests.is_empty()) {
            let mut immediate = Vec::new();
            self.shared.handle(*session, requests.into_iter(), &mut immediate);
            self.settle(immediate);
        }
        result
    }

    /// Opens the engine session at the first request, naming the process `pid` (0: unknown).
    fn open(&mut self, pid: u32) -> Result<(), End> {
        if self.session.is_some() {
            return Ok(());
        }
        let host = self.peer.ip().to_string();
        let welcome = self.shared.open_tcpstore(&host, pid, Arc::clone(&self.outbox)).map_err(|e| End::Refused(Box::new(e)))?;
        let session = welcome.session;
        debug!(peer = %self.peer, %session, pid, "TCPStore session opened");
        self.session = Some((session, SessionGuard { shared: Arc::clone(self.shared), session }));
        Ok(())
    }

    /// Records the engine's replies on their pending requests.
    fn settle(&mut self, replies: impl IntoIterator<Item = (u64, Reply)>) {
        for (id, reply) in replies {
            if let Some(p) = self.pending.iter_mut().find(|p| p.id == id && p.reply.is_none()) {
                p.reply = Some(answer(p.kind, p.canceled, reply));
            }
        }
    }

    /// Takes the engine's replies and encodes, in request order, every answer whose
    /// turn has come. A failure torch would answer by closing the connection ends it.
    fn write_ready(&mut self) -> Result<(), End> {
        let later = self.outbox.take();
        self.settle(later);
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
        Command::Barrier { key, world_size } => (Request::StoreBarrier { key, world_size, timeout_ms: None }, Kind::Wait),
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
