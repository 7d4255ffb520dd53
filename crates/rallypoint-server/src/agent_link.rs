//! A node agent's connection: one socket carrying many ranks as sub-sessions
//! (docs/PROTOCOL.md, section 12).
//!
//! Each sub-session is an ordinary engine session, so the engine's semantics are
//! those of direct connections. What the agent sent since the last read is fed to
//! the engine under one lock, in stream order; the replies for all its ranks go
//! out in one write, identical consecutive replies (a barrier's release for this
//! node's ranks) as one SubReplies frame. A SubRequests frame (a node's ranks at
//! one barrier) is expanded into each rank's own call before the engine sees it.
//! When the connection ends, every sub-session still open
//! closes with it: the engine counts those ranks as lost (unless they left).

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::BytesMut;
use rallypoint_core::{OpError, Reply, SessionId};
use rallypoint_proto::native::{
    decode_agent_frame, encode_root_frame, encode_sub_replies, encode_sub_replies_shared, encode_sub_reply, AgentFrame,
    FrameLimits, ProtoError, RootFrame, MAX_CALLS_PER_FRAME, MAX_FRAME_LEN,
};
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tracing::{debug, info, trace, warn};

use rallypoint_net::sync::lock;

use crate::shared::{AgentInput, Ready, Shared};
use crate::{write_with_tail, WriteProgress};

/// Bytes reserved per read: a batch of many ranks' requests.
const READ_CHUNK: usize = 64 * 1024;
/// Buffers larger than this are freed once empty instead of kept.
const KEEP_CAPACITY: usize = 1 << 20;
/// Stop gathering replies into one write past this size and send what we have.
const MAX_WRITE_BATCH: usize = 4 << 20;

/// Replies the engine addressed to the sub-sessions of one agent connection.
#[derive(Default)]
pub(crate) struct AgentOutbox {
    queue: Mutex<Vec<(SessionId, u64, Reply)>>,
    pub(crate) ready: Ready,
}

impl AgentOutbox {
    pub(crate) fn push(&self, session: SessionId, request_id: u64, reply: Reply) {
        let mut queue = lock(&self.queue);
        let was_empty = queue.is_empty();
        queue.push((session, request_id, reply));
        drop(queue);
        if was_empty {
            self.ready.notify();
        }
    }

    fn take(&self) -> Vec<(SessionId, u64, Reply)> {
        std::mem::take(&mut *lock(&self.queue))
    }
}

/// The sub-sessions of one agent connection, both ways.
#[derive(Default)]
struct Subs {
    by_sub: HashMap<u64, SessionId>,
    by_session: HashMap<SessionId, u64>,
}

/// Closes every sub-session still open, however the connection task ends.
struct SubsGuard<'a> {
    shared: &'a Shared,
    subs: Subs,
}

impl Drop for SubsGuard<'_> {
    fn drop(&mut self) {
        let sessions: Vec<SessionId> = self.subs.by_session.keys().copied().collect();
        if sessions.is_empty() {
            return;
        }
        if std::thread::panicking() {
            // The engine may be what panicked; calling it again would abort the process.
            for session in sessions {
                self.shared.forget(session);
            }
        } else {
            self.shared.close_all(&sessions);
        }
    }
}

/// Serves an agent connection whose preamble was read; `rbuf` starts with its agent
/// hello. Never fails the server.
pub(crate) async fn serve(
    mut stream: TcpStream,
    peer: SocketAddr,
    mut rbuf: BytesMut,
    shared: Arc<Shared>,
    limits: FrameLimits,
) {
    // A sub-request is a client request (at most a client's frame) with a sub-session
    // id in place of its request id; a SubRequests frame has a call list in front of
    // it instead, of at most MAX_CALLS_PER_FRAME calls. A request a rank could send
    // directly must never make its agent's frame too large (that would end the agent's
    // connection, losing all its ranks), so the agent's frames may exceed a direct
    // client's limit by the largest call list.
    let slack = 4 + 16 * MAX_CALLS_PER_FRAME;
    let limits = FrameLimits { max_frame_len: limits.max_frame_len.saturating_add(slack).min(MAX_FRAME_LEN) };
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
    let outbox = Arc::new(AgentOutbox::default());
    let mut conn = AgentConn {
        peer,
        stream: &mut stream,
        limits,
        rbuf,
        wbuf,
        guard: SubsGuard { shared: &shared, subs: Subs::default() },
    };
    let ended = conn.run(&outbox).await;
    let ranks = conn.guard.subs.by_sub.len();
    match ended {
        Ok(()) => info!(%peer, %host, pid, ranks, "node agent disconnected; its open ranks are lost"),
        Err(error) => warn!(%peer, %host, pid, ranks, %error, "node agent connection failed; its open ranks are lost"),
    }
}

struct AgentConn<'a> {
    peer: SocketAddr,
    stream: &'a mut TcpStream,
    limits: FrameLimits,
    rbuf: BytesMut,
    wbuf: BytesMut,
    guard: SubsGuard<'a>,
}

impl AgentConn<'_> {
    /// Serves until the agent closes (`Ok`) or the connection fails.
    async fn run(&mut self, outbox: &Arc<AgentOutbox>) -> io::Result<()> {
        // The hello may have arrived together with the first sub-session frames.
        self.process(outbox)?;
        loop {
            self.flush(outbox).await?;
            if self.rbuf.is_empty() && self.rbuf.capacity() > KEEP_CAPACITY {
                self.rbuf = BytesMut::new();
            }
            self.rbuf.reserve(READ_CHUNK);
            tokio::select! {
                // Replies first: they free waiting ranks, and reading more only adds work.
                biased;
                () = outbox.ready.wait() => {}
                read = self.stream.read_buf(&mut self.rbuf) => match read? {
                    0 => return Ok(()),
                    _ => self.process(outbox)?,
                },
            }
        }
    }

    /// Feeds every whole frame buffered to the engine, under one lock, in order.
    fn process(&mut self, outbox: &Arc<AgentOutbox>) -> io::Result<()> {
        let shared = self.guard.shared;
        let subs = &mut self.guard.subs;
        let mut inputs = Vec::new();
        let mut broken = None;
        loop {
            match decode_agent_frame(&mut self.rbuf, &self.limits) {
                Ok(None) => break,
                Ok(Some(AgentFrame::SubHello { sub, identity })) => {
                    if subs.by_sub.contains_key(&sub) {
                        broken = Some(format!("sub-session {sub} said hello twice"));
                        break;
                    }
                    // Known before the engine admits it, so that the requests after the
                    // hello in this batch find it; a refusal undoes it.
                    let session = shared.new_session_id();
                    subs.by_sub.insert(sub, session);
                    subs.by_session.insert(session, sub);
                    inputs.push(AgentInput::Open { session, identity });
                }
                Ok(Some(AgentFrame::SubRequest { sub, id, request })) => match subs.by_sub.get(&sub) {
                    Some(&session) => inputs.push(AgentInput::Request { session, id, request }),
                    // Its hello was refused: the engine never knew it.
                    None => debug!(peer = %self.peer, sub, id, "request of an unknown sub-session ignored"),
                },
                Ok(Some(AgentFrame::SubRequests { calls, request })) => {
                    // Each rank's own call, in list order: the engine keeps one session
                    // per rank, so naming of missing or dead ranks stays exact.
                    for (sub, id) in calls {
                        match subs.by_sub.get(&sub) {
                            Some(&session) => {
                                inputs.push(AgentInput::Request { session, id, request: request.clone() })
                            }
                            None => debug!(peer = %self.peer, sub, id, "request of an unknown sub-session ignored"),
                        }
                    }
                }
                Ok(Some(AgentFrame::SubClose { sub })) => {
                    if let Some(session) = subs.by_sub.remove(&sub) {
                        subs.by_session.remove(&session);
                        inputs.push(AgentInput::Close { session });
                    }
                }
                Ok(Some(AgentFrame::Hello { .. })) => {
                    broken = Some("a second agent hello".to_owned());
                    break;
                }
                Err(error) if error.is_fatal() => {
                    broken = Some(error.to_string());
                    break;
                }
                Err(error) => {
                    warn!(peer = %self.peer, %error, "bad frame from a node agent");
                    match error {
                        ProtoError::BadSubFrame { sub: Some(sub), id: Some(id), message } => {
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
            }
        }
        if !inputs.is_empty() {
            for (session, outcome) in shared.agent_batch(inputs, outbox) {
                let Some(&sub) = subs.by_session.get(&session) else { continue };
                let frame = match outcome {
                    Ok(welcome) => RootFrame::SubWelcome { sub, welcome },
                    Err(error) => {
                        debug!(peer = %self.peer, sub, %error, "refused a rank behind a node agent");
                        subs.by_session.remove(&session);
                        subs.by_sub.remove(&sub);
                        RootFrame::SubRefused { sub, error }
                    }
                };
                encode_root_frame(&frame, &mut self.wbuf);
            }
        }
        match broken {
            None => Ok(()),
            Some(why) => Err(io::Error::new(io::ErrorKind::InvalidData, why)),
        }
    }

    /// Writes the welcomes and every reply ready, batched into as few writes as possible;
    /// a reply's large shared tail (an all-gather's values, encoded once for every
    /// member) is written from where it is, after the batch that ends with its head.
    async fn flush(&mut self, outbox: &AgentOutbox) -> io::Result<()> {
        let mut replies = outbox.take().into_iter().peekable();
        let subs = &self.guard.subs;
        let carried = || subs.by_session.keys().copied().collect();
        let mut progress = WriteProgress::new(self.guard.shared, &carried);
        let mut calls = Vec::new();
        let (mut replied, mut frames) = (0usize, 0usize);
        loop {
            let mut tail = None;
            while tail.is_none() && self.wbuf.len() < MAX_WRITE_BATCH {
                let Some((session, id, reply)) = replies.next() else { break };
                calls.clear();
                // A reply for a sub-session that closed meanwhile has nowhere to go.
                calls.extend(subs.by_session.get(&session).map(|&sub| (sub, id)));
                // The engine emits a barrier's releases (or its failure) one after the
                // other: identical neighbours go as one frame. Comparing costs less than
                // encoding the reply again (a shared all-gather result compares by pointer).
                while calls.len() < MAX_CALLS_PER_FRAME {
                    let Some((session, id, _)) = replies.next_if(|(_, _, next)| *next == reply) else { break };
                    calls.extend(subs.by_session.get(&session).map(|&sub| (sub, id)));
                }
                if !calls.is_empty() {
                    tail = encode_sub_replies_shared(&calls, &reply, &mut self.wbuf);
                    replied += calls.len();
                    frames += 1;
                }
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
        if self.wbuf.capacity() > KEEP_CAPACITY {
            self.wbuf = BytesMut::new();
        }
        Ok(())
    }
}
