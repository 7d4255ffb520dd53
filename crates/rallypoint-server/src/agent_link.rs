//! A node agent's connection: one socket carrying many ranks as sub-sessions
//! (docs/PROTOCOL.md, section 12).
//!
//! Each sub-session is an ordinary engine session, so the engine's semantics are
//! those of direct connections. What the agent sent since the last read is fed to
//! the engine under one lock, in stream order; the replies for all its ranks go
//! out in one write, identical consecutive replies (a barrier's release for this
//! node's ranks) as one SubReplies frame. A SubRequests frame (a node's ranks at
//! one barrier) goes to the engine as one input, in which each rank's call is its
//! own (so the engine names missing or dead ranks exactly) while what all share is
//! checked once.
//! When the connection ends, every sub-session still open
//! closes with it: the engine counts those ranks as lost (unless they left).

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Buf, BytesMut};
use rallypoint_core::{Departure, Link, OpError, Reply, Request, Response, SessionId, SlotTable, Welcome};
use rallypoint_net::budget::Charge;
use rallypoint_net::conn::{after_read, hold_buffered, read_some, request_too_large, stall, Buffering, End};
use rallypoint_net::sync::lock;
use rallypoint_net::warn_limit::WarnLimit;
use rallypoint_proto::native::{
    decode_agent_frame, encode_root_frame, encode_sub_replies, encode_sub_replies_shared, encode_sub_reply, AgentFrame,
    FrameLimits, ProtoError, RootFrame, MAX_CALLS_PER_FRAME, MAX_FRAME_LEN,
};
use tokio::io::{AsyncRead, AsyncWrite};
use tracing::{debug, info, trace, warn};

use crate::shared::{AgentInput, Ready, Shared};
use crate::write::{write_with_tail, WriteProgress};
use crate::ConnSettings;

/// Stop gathering replies into one write past this size and send what we have.
const MAX_WRITE_BATCH: usize = 4 << 20;

/// Replies for ranks behind an agent, in the order the engine made them. The
/// engine makes a barrier's releases (or its failure) one after the other, so
/// identical neighbours are kept as one reply for several calls: a release of
/// thousands of ranks is one reply and a list of `(sub-session, request id)`,
/// which go out as SubReplies frames as they are.
#[derive(Default)]
pub(crate) struct AgentReplies {
    /// Every call answered, in order.
    calls: Vec<(u64, u64)>,
    /// Each reply, with where its calls start in `calls`.
    runs: Vec<(Reply, usize)>,
}

impl AgentReplies {
    /// Room for `calls` calls: a release's, so that it does not grow step by step.
    pub(crate) fn with_room(calls: usize) -> Self {
        AgentReplies { calls: Vec::with_capacity(calls), runs: Vec::new() }
    }

    /// `Done` to each of `calls`, `(sub-session, request id)`: a barrier's release of
    /// a record of this agent's calls, taken whole.
    pub(crate) fn push_released(&mut self, calls: &[(u64, u64)]) {
        if calls.is_empty() {
            return;
        }
        if !matches!(self.runs.last(), Some((Ok(Response::Done), _))) {
            self.runs.push((Ok(Response::Done), self.calls.len()));
        }
        self.calls.extend_from_slice(calls);
    }

    /// Adds the reply to sub-session `sub`'s request `id`. Comparing costs less than
    /// encoding the reply again (a shared all-gather result compares by pointer).
    pub(crate) fn push(&mut self, sub: u64, id: u64, reply: Reply) {
        self.calls.push((sub, id));
        match self.runs.last() {
            // A barrier's release: nothing to compare, nothing to drop.
            Some((Ok(Response::Done), _)) if matches!(reply, Ok(Response::Done)) => std::mem::forget(reply),
            Some((last, _)) if *last == reply => {}
            _ => self.runs.push((reply, self.calls.len() - 1)),
        }
    }

    fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }

    fn append(&mut self, mut later: AgentReplies) {
        let offset = self.calls.len();
        self.calls.append(&mut later.calls);
        self.runs.extend(later.runs.into_iter().map(|(reply, start)| (reply, start + offset)));
    }

    /// Each reply with its calls, at most a frame's worth of calls at a time.
    fn frames(&self) -> impl Iterator<Item = (&Reply, &[(u64, u64)])> {
        let ends = self.runs.iter().skip(1).map(|(_, start)| *start).chain([self.calls.len()]);
        self.runs.iter().zip(ends).flat_map(move |((reply, start), end)| {
            self.calls.get(*start..end).unwrap_or_default().chunks(MAX_CALLS_PER_FRAME).map(move |calls| (reply, calls))
        })
    }
}

/// Replies the engine addressed to the sub-sessions of one agent connection.
pub(crate) struct AgentOutbox {
    /// The connection's number, as the engine's records name it (`Link::id`).
    pub(crate) id: u64,
    queue: Mutex<AgentReplies>,
    pub(crate) ready: Ready,
    /// How many sessions this agent carried were resumed on another connection (or
    /// on this one again, as another sub-session). While none was, every call of a
    /// sub-session the agent has open is its to make, and none is looked up; after,
    /// a sub-session not closed yet may send for a session that is no longer the
    /// agent's, so every call is checked. A record made since the last move still
    /// routes each call where its session is (`Link::stamp`).
    moves: AtomicU64,
}

impl AgentOutbox {
    pub(crate) fn new() -> AgentOutbox {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        AgentOutbox {
            id: NEXT.fetch_add(1, Ordering::Relaxed),
            queue: Mutex::default(),
            ready: Ready::default(),
            moves: AtomicU64::new(0),
        }
    }

    /// Where calls sent by this agent now come from, for the engine's records.
    pub(crate) fn link(&self) -> Link {
        Link { id: self.id, stamp: self.moves.load(Ordering::Relaxed) }
    }

    /// Whether a record made when calls came from `link` still routes every call
    /// where its session is: no session moved off this agent since.
    pub(crate) fn routes_hold(&self, link: Link) -> bool {
        self.moves.load(Ordering::Relaxed) == link.stamp
    }
}

impl AgentOutbox {
    /// Queues replies without waking the agent's task; true if the queue was empty,
    /// and the caller must [`AgentOutbox::notify`] once it has queued the replies
    /// that go with them: woken between two of one round's replies (from another
    /// thread than the task's), the task would send them as two frames.
    #[must_use]
    pub(crate) fn push_all(&self, replies: AgentReplies) -> bool {
        let mut queue = lock(&self.queue);
        let was_empty = queue.is_empty();
        if was_empty {
            *queue = replies;
        } else {
            queue.append(replies);
        }
        was_empty
    }

    pub(crate) fn notify(&self) {
        self.ready.notify();
    }

    /// A session it carried was resumed elsewhere (see [`AgentOutbox::moves`]).
    pub(crate) fn lose(&self) {
        self.moves.fetch_add(1, Ordering::Relaxed);
    }

    /// Whether a session it carried was ever resumed elsewhere.
    pub(crate) fn lost_any(&self) -> bool {
        self.moves.load(Ordering::Relaxed) > 0
    }

    fn take(&self) -> AgentReplies {
        std::mem::take(&mut *lock(&self.queue))
    }
}

/// The sub-sessions of one agent connection, both ways. `by_sub` is looked up for
/// every call of the node's ranks: by slot, as an agent numbers its sub-sessions
/// from 1 up; `by_session` for hellos and closes, with a fast hash (the keys are the
/// coordinator's own numbers).
#[derive(Default)]
struct Subs {
    by_sub: SlotTable<u64, SessionId>,
    by_session: HashMap<SessionId, u64, foldhash::fast::RandomState>,
}

impl Subs {
    /// Records a new sub-session as `session`. Known before the engine admits it, so
    /// that the requests after the hello in the same batch find it; a refusal undoes it.
    fn open(&mut self, sub: u64, session: SessionId) -> Result<(), End> {
        if self.by_sub.contains_key(&sub) {
            return Err(End::DuplicateSubSession { sub });
        }
        self.by_sub.insert(sub, session);
        self.by_session.insert(session, sub);
        Ok(())
    }

    /// Sub-session `sub`'s request, if the engine knows it (its hello may have been refused).
    fn request(&self, peer: SocketAddr, sub: u64, id: u64, request: Request) -> Option<AgentInput> {
        Some(AgentInput::Request { session: self.session(peer, sub, id)?, id, request })
    }

    /// The session of sub-session `sub`, whose request `id` came, if the engine knows it.
    fn session(&self, peer: SocketAddr, sub: u64, id: u64) -> Option<SessionId> {
        let session = self.by_sub.get(&sub).copied();
        if session.is_none() {
            debug!(%peer, sub, id, "request of an unknown sub-session ignored");
        }
        session
    }

    fn remove(&mut self, sub: u64) -> Option<SessionId> {
        let session = self.by_sub.remove(&sub)?;
        self.by_session.remove(&session);
        Some(session)
    }
}

/// Closes every sub-session still open, however the connection task ends.
struct SubsGuard<'a> {
    shared: &'a Shared,
    subs: Subs,
    outbox: Arc<AgentOutbox>,
}

impl Drop for SubsGuard<'_> {
    fn drop(&mut self) {
        let sessions: Vec<SessionId> = self.subs.by_session.keys().copied().collect();
        if sessions.is_empty() {
            self.shared.agent_unlinked(&self.outbox);
            return;
        }
        if std::thread::panicking() {
            // The engine may be what panicked; calling it again would abort the process.
            for session in sessions {
                self.shared.forget(session);
            }
        } else {
            self.shared.close_all(&sessions, &self.outbox);
        }
        self.shared.agent_unlinked(&self.outbox);
    }
}

/// Serves an agent connection whose preamble was read; `rbuf` starts with its agent
/// hello. Never fails the server.
pub(crate) async fn serve<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    peer: SocketAddr,
    mut rbuf: BytesMut,
    shared: Arc<Shared>,
    settings: &ConnSettings,
    charge: Charge,
) {
    // A sub-request is a client request (at most a client's frame) with a sub-session
    // id in place of its request id; a SubRequests frame has a call list in front of
    // it instead, of at most MAX_CALLS_PER_FRAME calls. A request a rank could send
    // directly must never make its agent's frame too large (that would end the agent's
    // connection, losing all its ranks), so the agent's frames may exceed a direct
    // client's limit by the largest call list.
    let slack = 4 + 16 * MAX_CALLS_PER_FRAME;
    let limits = FrameLimits { max_frame_len: settings.limits.max_frame_len.saturating_add(slack).min(MAX_FRAME_LEN) };
    let (host, pid) = match decode_agent_frame(&mut rbuf, &limits) {
        Ok(Some(AgentFrame::Hello { host, pid })) => (host, pid),
        other => {
            warn!(%peer, frame = ?other, "expected an agent hello; closing");
            return;
        }
    };
    let mut wbuf = BytesMut::new();
    encode_root_frame(&RootFrame::Welcome { lease_ms: shared.lease_ms() }, &mut wbuf);
    info!(%peer, %host, pid, "node agent connected");
    let outbox = Arc::new(AgentOutbox::new());
    shared.agent_linked(&outbox);
    let mut conn = AgentConn {
        peer,
        stream: &mut stream,
        limits,
        read_timeout: settings.read_timeout,
        rbuf,
        wbuf,
        guard: SubsGuard { shared: &shared, subs: Subs::default(), outbox: Arc::clone(&outbox) },
        warnings: WarnLimit::new(),
        charge,
        skip: 0,
    };
    let end = conn.run(&outbox).await;
    let ranks = conn.guard.subs.by_sub.len();
    if end.is_peer_fault() {
        warn!(%peer, %host, pid, ranks, "closing a node agent's connection ({end}); its open ranks are lost");
    } else {
        info!(%peer, %host, pid, ranks, "node agent disconnected ({end}); its open ranks are lost");
    }
}

struct AgentConn<'a, S> {
    peer: SocketAddr,
    stream: &'a mut S,
    limits: FrameLimits,
    read_timeout: Duration,
    rbuf: BytesMut,
    wbuf: BytesMut,
    guard: SubsGuard<'a>,
    /// Warnings about this agent's bad frames.
    warnings: WarnLimit,
    /// The bytes of unfinished frames this connection holds.
    charge: Charge,
    /// Bytes still to pass over of a rank's request too large for this coordinator
    /// (its call was answered: [`ProtoError::SubRequestTooLarge`]).
    skip: usize,
}

impl<S: AsyncRead + AsyncWrite + Unpin> AgentConn<'_, S> {
    /// Serves until the connection ends; returns how.
    async fn run(&mut self, outbox: &Arc<AgentOutbox>) -> End {
        // The hello may have arrived together with the first sub-session frames.
        let mut broken = self.process(outbox).err();
        loop {
            if let Err(error) = self.flush(outbox).await {
                return End::Io(error);
            }
            if let Some(end) = broken.take() {
                return end;
            }
            Buffering::NODE_LINK.release_idle(&mut self.rbuf);
            // Mid-frame while skipping one too: the read timeout holds.
            let buffered = self.rbuf.len().saturating_add(self.skip);
            tokio::select! {
                // Replies first: they free waiting ranks, and reading more only adds work.
                biased;
                () = outbox.ready.wait() => {}
                read = std::future::poll_fn(|cx| read_some(self.stream, &mut self.rbuf, Buffering::NODE_LINK, cx)) => match read {
                    Ok(0) if self.rbuf.is_empty() => return End::Closed,
                    Ok(0) => return End::ClosedMidFrame { buffered: self.rbuf.len() },
                    Ok(read) => {
                        broken = self.process(outbox).err();
                        after_read(read).await;
                    }
                    Err(error) => return End::Io(error),
                },
                end = stall(buffered, self.read_timeout) => return end,
                () = self.charge.evicted() => return End::Evicted,
            }
        }
    }

    /// Feeds every whole frame buffered to the engine, under one lock, in order, and
    /// answers each sub-session's hello. The frames before a broken one count.
    fn process(&mut self, outbox: &Arc<AgentOutbox>) -> Result<(), End> {
        let mut inputs = Vec::new();
        let result = loop {
            if self.skip > 0 {
                let passed = self.skip.min(self.rbuf.len());
                self.rbuf.advance(passed);
                self.skip -= passed;
                if self.skip > 0 {
                    break Ok(());
                }
            }
            match decode_agent_frame(&mut self.rbuf, &self.limits) {
                Ok(None) => break Ok(()),
                Ok(Some(frame)) => {
                    if let Err(end) = self.take(frame, &mut inputs) {
                        break Err(end);
                    }
                }
                Err(error) if error.is_fatal() => break Err(End::malformed(error)),
                Err(error) => self.answer_bad_frame(error),
            }
        };
        if !inputs.is_empty() {
            let opened = self.guard.shared.agent_batch(inputs, outbox);
            self.answer_hellos(opened);
        }
        result?;
        hold_buffered(&mut self.charge, &self.rbuf)
    }

    /// One frame of the agent as inputs for the engine, in order: a SubRequests
    /// frame as its ranks' calls, each with the rank's own session (so the engine
    /// names missing or dead ranks exactly).
    fn take(&mut self, frame: AgentFrame, inputs: &mut Vec<AgentInput>) -> Result<(), End> {
        let (peer, subs) = (self.peer, &mut self.guard.subs);
        let request = |subs: &Subs, sub, id, request| subs.request(peer, sub, id, request);
        match frame {
            AgentFrame::SubHello { sub, identity } => {
                let session = self.guard.shared.new_session_id();
                subs.open(sub, session).inspect_err(|_| self.guard.shared.unused_session_id(session))?;
                inputs.push(AgentInput::Open { session, sub, identity });
            }
            AgentFrame::SubRequest { sub, id, request: r } => inputs.extend(request(subs, sub, id, r)),
            AgentFrame::SubRequests { calls, request: r } => {
                let mut sessions = Vec::with_capacity(calls.len());
                let mut routes = Vec::with_capacity(calls.len());
                for (sub, id) in calls {
                    if let Some(session) = subs.session(peer, sub, id) {
                        sessions.push((session, id));
                        routes.push(sub);
                    }
                }
                inputs.push(AgentInput::Calls { calls: sessions, routes, request: r });
            }
            AgentFrame::SubClose { sub, gone } => {
                let departure = if gone { Departure::ProcessGone } else { Departure::Unknown };
                inputs.extend(subs.remove(sub).map(|session| AgentInput::Close { session, departure }))
            }
            AgentFrame::Hello { .. } => return Err(End::SecondHello),
        }
        Ok(())
    }

    /// A whole frame that did not decode: the calls it names get an `Invalid` reply,
    /// so that no rank waits forever for an answer.
    fn answer_bad_frame(&mut self, error: ProtoError) {
        if let Some(held_back) = self.warnings.admit() {
            warn!(peer = %self.peer, %error, held_back, "bad frame from a node agent");
        }
        match error {
            ProtoError::BadSubFrame { sub: Some(sub), id: Some(id), message } => {
                encode_sub_reply(sub, id, &Err(OpError::Invalid(message)), &mut self.wbuf);
            }
            ProtoError::SubRequestTooLarge { sub, id, len, max } => {
                self.skip = len;
                let message = request_too_large(len, max, ", through a node agent");
                encode_sub_reply(sub, id, &Err(OpError::Invalid(message)), &mut self.wbuf);
            }
            ProtoError::BadSubCalls { calls, message } => {
                for calls in calls.chunks(MAX_CALLS_PER_FRAME) {
                    encode_sub_replies(calls, &Err(OpError::Invalid(message.clone())), &mut self.wbuf);
                }
            }
            _ => {}
        }
    }

    /// Welcomes each sub-session the engine admitted and refuses the others. A
    /// sub-session that resumed an earlier session is that session from now on.
    fn answer_hellos(&mut self, opened: Vec<(SessionId, Result<Welcome, OpError>)>) {
        let subs = &mut self.guard.subs;
        for (session, outcome) in opened {
            let Some(&sub) = subs.by_session.get(&session) else { continue };
            let frame = match outcome {
                Ok(welcome) => {
                    if welcome.session != session {
                        subs.remove(sub);
                        // The session may still be mapped from the sub it left (on this
                        // agent, whose close of it has not come yet): that sub is stale.
                        if let Some(stale) = subs.by_session.remove(&welcome.session) {
                            subs.by_sub.remove(&stale);
                        }
                        subs.by_sub.insert(sub, welcome.session);
                        subs.by_session.insert(welcome.session, sub);
                    }
                    RootFrame::SubWelcome { sub, welcome }
                }
                Err(error) => {
                    debug!(peer = %self.peer, sub, %error, "refused a rank behind a node agent");
                    subs.remove(sub);
                    RootFrame::SubRefused { sub, error }
                }
            };
            encode_root_frame(&frame, &mut self.wbuf);
        }
    }

    /// Writes the welcomes and every reply ready, batched into as few writes as possible;
    /// a reply's large shared tail (an all-gather's values, encoded once for every
    /// member) is written from where it is, after the batch that ends with its head.
    async fn flush(&mut self, outbox: &AgentOutbox) -> io::Result<()> {
        let replies = outbox.take();
        let mut frames_left = replies.frames();
        let subs = &self.guard.subs;
        let carried = || subs.by_session.keys().copied().collect();
        let mut progress = WriteProgress::new(self.guard.shared, &carried);
        let (mut replied, mut frames) = (0usize, 0usize);
        loop {
            let mut tail = None;
            while tail.is_none() && self.wbuf.len() < MAX_WRITE_BATCH {
                // Sent as queued: a reply for a sub-session the agent closed meanwhile is
                // one it drops (sub-sessions are never reused), and the session's own
                // reply, if it resumed, comes again for its request sent again.
                let Some((reply, calls)) = frames_left.next() else { break };
                tail = encode_sub_replies_shared(calls, reply, &mut self.wbuf);
                replied += calls.len();
                frames += 1;
            }
            if self.wbuf.is_empty() {
                break;
            }
            write_with_tail(self.stream, &self.wbuf, tail.as_deref().unwrap_or_default(), &mut progress).await?;
            self.wbuf.clear();
        }
        if replied > 0 {
            trace!(peer = %self.peer, replies = replied, frames, "replied to a node agent");
        }
        if self.wbuf.capacity() > Buffering::NODE_LINK.keep {
            self.wbuf = BytesMut::new();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(replies: &AgentReplies) -> Vec<(Reply, Vec<u64>)> {
        replies.frames().map(|(reply, calls)| (reply.clone(), calls.iter().map(|(_, id)| *id).collect())).collect()
    }

    /// Identical neighbours share a frame, in order, at most a frame's worth of
    /// calls each; a queue appended keeps its calls with their replies.
    #[test]
    fn replies_go_as_runs_of_frames() {
        let (done, one) = (Ok(Response::Done), Ok(Response::Int(1)));
        let mut replies = AgentReplies::with_room(4);
        assert_eq!(frames(&replies), vec![]);
        for (id, reply) in [(1, &done), (2, &done), (3, &one), (4, &done)] {
            replies.push(id, id, reply.clone());
        }
        let mut later = AgentReplies::default();
        later.push(5, 5, done.clone());
        later.push(6, 6, one.clone());
        replies.append(later);
        let expected = vec![
            (done.clone(), vec![1, 2]),
            (one.clone(), vec![3]),
            (done.clone(), vec![4]),
            (done.clone(), vec![5]),
            (one, vec![6]),
        ];
        assert_eq!(frames(&replies), expected);

        let mut release = AgentReplies::default();
        let n = MAX_CALLS_PER_FRAME as u64 + 1;
        for id in 0..n {
            release.push(id, id, done.clone());
        }
        let sizes: Vec<usize> = frames(&release).iter().map(|(_, calls)| calls.len()).collect();
        assert_eq!(sizes, vec![MAX_CALLS_PER_FRAME, 1]);
    }
}
