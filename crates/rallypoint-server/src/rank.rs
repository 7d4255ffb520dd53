//! A rank's native connection over plain TCP, served by the reactor thread once its
//! handshake has admitted its session (module `native`).
//!
//! A barrier round is one small request in and one small reply out per rank, so
//! what a coordinator adds to the kernel's cost is what happens around each. Here
//! the thread that returns from `epoll_wait` reads, feeds the engine and writes the
//! reply; the replies the engine addresses to other ranks (a barrier's release)
//! come back from the same call, routed (see `shared`), and are written by the
//! same thread at once: no task is woken, and nothing is handed between threads.
//!
//! What a connection holds while idle: its state in the reactor's slab, no write
//! buffer, and no read buffer but the allocation its last small request was read
//! into, which the next read reuses ([`Buffering::RANK_ON_REACTOR`]). Replies are
//! encoded into a buffer the reactor lends to the one connection writing; only
//! bytes the socket did not take stay with the connection, which then reads nothing
//! more until they are written (a peer that does not read its replies is not read
//! either). A large tail a reply shares with others (an
//! all-gather's values) is written from where it is, after the bytes before it.

use std::collections::VecDeque;
use std::io::{self, IoSlice, Write};
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::Waker;
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use mio::net::TcpStream;
use rallypoint_core::{OpError, Reply, Request, SessionId};
use rallypoint_net::budget::{buffered, Charge};
use rallypoint_net::conn::{decode_requests, read_from, Buffering, End, Inbound, ReadOutcome, MAX_READ};
use rallypoint_net::meter::{Account, Counted};
use rallypoint_net::warn_limit::WarnLimit;
use rallypoint_proto::native::{encode_reply_shared, encode_server_frame, FrameLimits, ServerFrame};
use tracing::warn;

use crate::native::SessionGuard;
use crate::shared::{Outbox, Routed};
use crate::write::ALIVE_EVERY;

/// Stop gathering replies into one write past this size and send what we have.
const MAX_WRITE_BATCH: usize = 1 << 20;

/// What the reactor lends the connection it serves: buffers kept for the whole loop,
/// so that serving a request allocates nothing of its own.
#[derive(Default)]
pub(crate) struct Scratch {
    /// Replies are encoded here, and written from here when the socket takes them whole.
    pub(crate) out: BytesMut,
    requests: Vec<(u64, Request)>,
    replies: Vec<(u64, Reply)>,
    /// Replies the engine routed to other connections of the reactor meanwhile.
    pub(crate) routed: Vec<Routed>,
}

/// Where a connection stands after [`RankConn::service`].
pub(crate) enum Progress {
    /// Waiting for the peer, for the socket to take more, or for replies.
    Idle,
    /// Its read budget for this turn is spent with bytes still unread.
    More,
}

pub(crate) struct RankConn {
    /// The bytes of unfinished requests this connection holds. Declared first, so
    /// dropped first: they are given back before the peer sees the close.
    charge: Charge,
    /// Its bytes counted (module `rallypoint_net::meter`).
    stream: Counted<TcpStream>,
    peer: SocketAddr,
    /// Closes the session in the engine when the connection is dropped; holds its outbox.
    guard: SessionGuard,
    limits: FrameLimits,
    rbuf: BytesMut,
    /// When the last bytes of the unfinished frame in `rbuf` arrived.
    progress_at: Instant,
    out: Output,
    /// The socket may hold unread bytes (epoll is edge-triggered: read until drained).
    readable: bool,
    /// An event said the peer's end came: read until it shows (see [`RankConn::set_readable`]).
    read_closed: bool,
    /// `rbuf` may hold whole frames not yet handled.
    buffered: bool,
    /// The stream broke after the requests before it: close once their replies are out.
    broken: Option<End>,
    /// Warnings about this peer's bad requests.
    warnings: WarnLimit,
}

/// Replies not yet written.
#[derive(Default)]
struct Output {
    /// Encoded, not written yet; without an allocation while there is nothing.
    head: BytesMut,
    /// Written right after `head`: the rest of its last frame, shared with others.
    tail: Option<Bytes>,
    /// Frames to encode once `head` and `tail` are out.
    backlog: VecDeque<Outgoing>,
    /// Since when the socket has been taking a long write: counted as a sign of life
    /// of the session, at most once per [`ALIVE_EVERY`], since a connection that
    /// writes does not read (and so sees no heartbeat).
    since: Option<Instant>,
}

/// A frame waiting in [`Output::backlog`].
enum Outgoing {
    Reply(u64, Reply),
    /// Request `id` asked for a barrier channel: there is none here (the coordinator
    /// serves TCP; channels are a node agent's). Goes before the request's reply.
    NoChannel(u64),
}

impl Output {
    fn is_empty(&self) -> bool {
        self.head.is_empty() && self.tail.is_none() && self.backlog.is_empty()
    }

    /// Encodes replies into `head` until one leaves a tail or the batch is full;
    /// the rest waits in the backlog.
    fn encode(&mut self, frames: impl Iterator<Item = Outgoing>) {
        let mut frames = frames.peekable();
        if self.backlog.is_empty() {
            while self.tail.is_none() && self.head.len() < MAX_WRITE_BATCH {
                match frames.next() {
                    Some(Outgoing::Reply(id, reply)) => self.tail = encode_reply_shared(id, &reply, &mut self.head),
                    Some(Outgoing::NoChannel(id)) => {
                        let reason = "barrier channels are a node agent's, over its Unix socket".to_owned();
                        encode_server_frame(&ServerFrame::NoBarrierChannel { id, reason }, &mut self.head);
                    }
                    None => break,
                }
            }
        }
        self.backlog.extend(frames);
    }
}

impl RankConn {
    /// An admitted session's connection: `rbuf` holds what was read after the
    /// hello, `welcome` the encoded welcome, which goes out first.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        stream: std::net::TcpStream,
        account: Account,
        peer: SocketAddr,
        guard: SessionGuard,
        limits: FrameLimits,
        rbuf: BytesMut,
        welcome: BytesMut,
        charge: Charge,
        warnings: WarnLimit,
    ) -> RankConn {
        let out = Output { head: welcome, ..Output::default() };
        RankConn {
            charge,
            stream: Counted::from_parts(TcpStream::from_std(stream), account),
            peer,
            guard,
            limits,
            rbuf,
            progress_at: Instant::now(),
            out,
            readable: true,
            read_closed: false,
            buffered: true,
            broken: None,
            warnings,
        }
    }

    pub(crate) fn stream(&mut self) -> &mut TcpStream {
        self.stream.get_mut()
    }

    pub(crate) fn session(&self) -> SessionId {
        self.guard.session
    }

    pub(crate) fn outbox(&self) -> &Arc<Outbox> {
        &self.guard.outbox
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

    /// The engine panicked while serving this connection: its session is dropped
    /// without calling the engine again.
    pub(crate) fn abandon(&mut self) {
        self.guard.abandon();
    }

    /// Writes what is pending, then reads and answers until the socket would block,
    /// the peer stops taking our replies, or the turn's reads are spent. Replies
    /// routed to other connections meanwhile are left in `scratch.routed`. `waker`
    /// is woken when the session's outbox says something (it moved to another
    /// connection) or when another connection's request needs this one closed.
    pub(crate) fn service(&mut self, scratch: &mut Scratch, max_reads: usize, waker: &Waker) -> Result<Progress, End> {
        if self.charge.is_evicted() {
            return Err(End::Evicted);
        }
        let mut reads = 0;
        loop {
            if !self.flush(&mut scratch.out)? {
                return Ok(Progress::Idle); // the socket says when it takes more
            }
            if let Some(end) = self.broken.take() {
                return Err(end);
            }
            if self.guard.outbox.superseded() {
                return Err(End::Shutdown("the session was resumed on another connection".to_owned()));
            }
            if self.buffered {
                self.process(scratch, waker);
                continue;
            }
            if !self.readable {
                if self.guard.outbox.ready.poll_wait(waker) {
                    // Replies queued before the connection came to the reactor.
                    self.send(self.guard.outbox.take().into_iter(), &mut scratch.out);
                    continue;
                }
                Buffering::RANK_ON_REACTOR.release_idle(&mut self.rbuf);
                return Ok(Progress::Idle);
            }
            if reads == max_reads {
                return Ok(Progress::More);
            }
            reads += 1;
            let read = read_from(self.stream.get_ref(), &mut self.rbuf, Buffering::RANK_ON_REACTOR);
            if let Ok(ReadOutcome { got, .. }) = read {
                self.stream.received(got);
            }
            match read {
                Ok(ReadOutcome { got: 0, .. }) if self.rbuf.is_empty() => return Err(End::Closed),
                Ok(ReadOutcome { got: 0, .. }) => return Err(End::ClosedMidFrame { buffered: self.rbuf.len() }),
                Ok(ReadOutcome { got, drained }) => {
                    self.progress_at = Instant::now();
                    self.readable = self.read_closed || !drained;
                    self.buffered = true;
                    // A peer streaming a large frame takes one slice per turn.
                    if got >= MAX_READ {
                        reads = max_reads;
                    }
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => self.readable = false,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) => return Err(End::Io(error)),
            }
        }
    }

    /// Decodes every whole frame buffered and feeds the requests to the engine under
    /// one lock. Bad requests get an `Invalid` reply; a broken stream ends the
    /// session once the replies to the requests before it are written.
    fn process(&mut self, scratch: &mut Scratch, waker: &Waker) {
        self.buffered = false;
        let Scratch { out, requests, replies, routed } = scratch;
        let (peer, session, warnings) = (self.peer, self.guard.session, &mut self.warnings);
        let mut no_channel: Vec<u64> = Vec::new();
        let decoded = decode_requests(&mut self.rbuf, &self.limits, |input| match input {
            Inbound::Request { id, request } => requests.push((id, request)),
            // Only node agents hand out shared replies and barrier channels: they serve
            // the Unix sockets of their node, the coordinator only TCP. Replies stay plain frames.
            Inbound::TakeSharedReplies | Inbound::ReleaseShared { .. } | Inbound::LeaveBarrierChannel { .. } => {}
            // Likewise barrier channels: the call goes through messages, as all later ones.
            Inbound::AttachBarrier { id, request } => {
                no_channel.push(id);
                requests.push((id, request));
            }
            Inbound::Invalid { id, message } => {
                if let Some(held_back) = warnings.admit() {
                    warn!(%peer, %session, %message, held_back, "bad request");
                }
                if let Some(id) = id {
                    replies.push((id, Err(OpError::Invalid(message))));
                }
            }
        });
        if !no_channel.is_empty() {
            self.send_frames(no_channel.into_iter().map(Outgoing::NoChannel), out);
        }
        if !requests.is_empty() {
            let shared = &self.guard.shared;
            let immediate = &mut |id, reply| replies.push((id, reply));
            shared.handle_routed(session, &self.guard.outbox, requests.drain(..), immediate, Some(routed));
        }
        self.send(replies.drain(..), out);
        // Counted as soon as it is known, before the replies go out.
        let held = decoded.and_then(|()| Ok(self.charge.hold(buffered(&self.rbuf))?));
        if let Err(end) = held {
            self.broken = Some(end);
        } else if self.charge.notify_eviction(waker) {
            self.broken = Some(End::Evicted);
        }
    }

    /// Queues `replies` for writing, encoded into the reactor's buffer when nothing
    /// else is pending (the caller flushes).
    pub(crate) fn send(&mut self, replies: impl Iterator<Item = (u64, Reply)>, scratch: &mut BytesMut) {
        self.send_frames(replies.map(|(id, reply)| Outgoing::Reply(id, reply)), scratch);
    }

    fn send_frames(&mut self, frames: impl Iterator<Item = Outgoing>, scratch: &mut BytesMut) {
        if self.out.is_empty() && self.out.head.capacity() == 0 {
            self.out.head = std::mem::take(scratch);
        }
        self.out.encode(frames);
    }

    /// Writes as much as the socket takes; true once everything is written. The
    /// reactor's buffer, lent by [`RankConn::send`], is given back then.
    pub(crate) fn flush(&mut self, scratch: &mut BytesMut) -> Result<bool, End> {
        loop {
            if self.out.head.is_empty() && self.out.tail.is_none() {
                let Some(first) = self.out.backlog.pop_front() else { break };
                let backlog = std::mem::take(&mut self.out.backlog);
                self.out.encode(std::iter::once(first).chain(backlog));
            }
            let head = &self.out.head[..];
            let written = match &self.out.tail {
                None => self.stream.write(head),
                Some(tail) => self.stream.write_vectored(&[IoSlice::new(head), IoSlice::new(tail)]),
            };
            match written {
                Ok(0) => return Err(End::Io(io::ErrorKind::WriteZero.into())),
                Ok(written) => self.advance(written),
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                    self.out.since.get_or_insert_with(Instant::now);
                    return Ok(false);
                }
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) => return Err(End::Io(error)),
            }
        }
        self.out.since = None;
        // Keep the larger of the two buffers for the loop; the connection keeps none.
        let head = std::mem::take(&mut self.out.head);
        if head.capacity() > scratch.capacity() {
            *scratch = head;
            scratch.clear();
        }
        Ok(true)
    }

    /// `written` bytes of `head` and then `tail` went out.
    fn advance(&mut self, written: usize) {
        if written < self.out.head.len() {
            self.out.head.advance(written);
        } else {
            let into_tail = written - self.out.head.len();
            self.out.head.clear();
            if let Some(tail) = &mut self.out.tail {
                tail.advance(into_tail);
                if tail.is_empty() {
                    self.out.tail = None;
                }
            }
        }
        if self.out.since.is_some_and(|since| since.elapsed() >= ALIVE_EVERY) {
            self.guard.shared.alive(std::iter::once(self.guard.session));
            self.out.since = Some(Instant::now());
        }
    }

    /// Whether the poller should say when the socket takes more: only while bytes
    /// wait for it (otherwise every acknowledgement of a reply would be an event).
    pub(crate) fn wants_writable(&self) -> bool {
        !self.out.is_empty()
    }

    /// Whether part of a frame is buffered, waiting for the rest.
    pub(crate) fn is_mid_frame(&self) -> bool {
        !self.rbuf.is_empty()
    }

    /// The end of a connection that stopped in the middle of a frame for `timeout`.
    /// Bytes read and not yet handled (of an unfinished request, between turns).
    pub(crate) fn buffered_bytes(&self) -> usize {
        self.rbuf.len()
    }

    pub(crate) fn stalled(&self, now: Instant, timeout: Duration) -> Option<End> {
        let waited = now.saturating_duration_since(self.progress_at);
        (self.is_mid_frame() && waited >= timeout).then(|| End::Stalled { buffered: self.rbuf.len(), waited })
    }
}
