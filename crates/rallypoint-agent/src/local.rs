//! One local rank's connection: its handshake, its requests forwarded upstream,
//! and the replies written back to it (through shared memory for large ones).

use std::collections::{HashSet, VecDeque};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use bytes::{Buf, BytesMut};
use rallypoint_core::{OpError, Request};
use rallypoint_net::budget::Charge;
use rallypoint_net::conn::{
    accept_hello, after_read, decode_requests, hold_buffered, peek_first_byte, read_some, stall, Accepts, Buffering,
    End, Gate, Hello, Inbound,
};
use rallypoint_net::shm::MAX_FDS_PER_WRITE;
use rallypoint_net::sync::lock;
use rallypoint_net::tls::TLS_FIRST_BYTE;
use rallypoint_net::warn_limit::{admit_shared, WarnLimit};
use rallypoint_net::{ReadHalf, Stream, WriteHalf};
use rallypoint_proto::native::{encode_agent_frame, encode_reply, encode_server_frame, AgentFrame, ServerFrame};
use smallvec::SmallVec;
use tokio::io::AsyncWriteExt;
use tokio::sync::Notify;
use tracing::{debug, warn};

use crate::channels::Channel;
use crate::hub::Hub;
use crate::slabs::Placed;
use crate::HANDSHAKE_TIMEOUT;

/// Warnings about local connections closed for what their peer did: shared, since a
/// client that reconnects in a loop makes a new connection each time.
static END_WARNINGS: Mutex<WarnLimit> = Mutex::new(WarnLimit::new());

/// A rank's write buffer stays allocated up to this size once empty: replies come
/// steadily, and a rank's buffer is rarely larger.
const KEEP_WRITE_CAPACITY: usize = 64 * 1024;

/// One local rank's connection, shared by its task (which reads it) and the
/// upstream reader (which writes replies to it).
pub(crate) struct Local {
    writer: WriteHalf,
    out: Mutex<LocalOut>,
    /// Wakes the local task: bytes the socket did not take at once, or the end.
    wake: Notify,
    /// The rank asked for large replies as shared memory (it is on a Unix socket).
    pub(crate) takes_shared: AtomicBool,
    /// The rank said Leave: its connection's end is a clean leave, not a death.
    left: AtomicBool,
}

#[derive(Default)]
pub(crate) struct LocalOut {
    /// Bytes for the rank not yet written.
    buf: BytesMut,
    /// Bytes written to the rank so far: where `buf` starts in the stream.
    written: u64,
    /// Files of slabs named in `buf` not yet passed, with where the first frame
    /// naming each starts in the stream. A file must go with or before that frame's
    /// first byte.
    files: VecDeque<(u64, Arc<OwnedFd>)>,
    /// Slabs whose file this rank was given (or is queued to be).
    slabs_given: HashSet<u64>,
    /// Barrier channels whose files this rank was given (or is queued to be).
    channels_given: HashSet<u64>,
    /// The local task is writing `buf`: append, do not write around it.
    writing: bool,
    /// Ids of the rank's requests forwarded and not yet answered.
    pub(crate) pending: Vec<u64>,
    /// Close the connection once `buf` is written.
    end: bool,
}

impl Local {
    /// Queues bytes for the rank and writes them at once if the socket takes them.
    pub(crate) fn send(&self, encode: impl FnOnce(&mut BytesMut)) {
        let mut out = lock(&self.out);
        encode(&mut out.buf);
        self.push(&mut out);
    }

    /// A reply to request `id`, which is no longer pending.
    pub(crate) fn reply(&self, id: u64, encode: impl FnOnce(&mut BytesMut)) {
        let mut out = lock(&self.out);
        if let Some(at) = out.pending.iter().position(|&p| p == id) {
            out.pending.swap_remove(at);
        }
        encode(&mut out.buf);
        self.push(&mut out);
    }

    /// A reply to request `id` whose body is in a slab; the slab's file goes with
    /// the first such reply to this rank.
    pub(crate) fn reply_shared(&self, id: u64, placed: &Placed) {
        let mut out = lock(&self.out);
        if let Some(at) = out.pending.iter().position(|&p| p == id) {
            out.pending.swap_remove(at);
        }
        if out.slabs_given.insert(placed.slab) {
            let at = out.written + out.buf.len() as u64;
            out.files.push_back((at, Arc::clone(&placed.file)));
        }
        let frame = ServerFrame::SharedReply { id, slab: placed.slab, len: placed.len };
        encode_server_frame(&frame, &mut out.buf);
        self.push(&mut out);
    }

    /// Request `id` was forwarded from a barrier channel: it waits for its reply
    /// as any forwarded request does (and fails with them if the agent stops).
    pub(crate) fn awaiting(&self, id: u64) {
        lock(&self.out).pending.push(id);
    }

    /// Request `id` was answered through its barrier channel's slot.
    pub(crate) fn answered(&self, id: u64) {
        let mut out = lock(&self.out);
        if let Some(at) = out.pending.iter().position(|&p| p == id) {
            out.pending.swap_remove(at);
        }
    }

    /// For attach request `id`: slot `slot` of `channel`, whose memory file,
    /// doorbell and release bell go with the first such frame to this rank.
    pub(crate) fn barrier_channel(&self, id: u64, channel: &Channel, slot: u32) {
        let mut out = lock(&self.out);
        if out.channels_given.insert(channel.id) {
            let at = out.written + out.buf.len() as u64;
            out.files.push_back((at, Arc::clone(&channel.shm.file)));
            out.files.push_back((at, Arc::clone(&channel.shm.doorbell)));
            out.files.push_back((at, Arc::clone(&channel.shm.bell)));
        }
        encode_server_frame(&ServerFrame::BarrierChannel { id, channel: channel.id, slot }, &mut out.buf);
        self.push(&mut out);
    }

    /// Writes what the socket takes now of `out.buf`, with the files due.
    fn write_some(&self, out: &mut LocalOut) -> io::Result<()> {
        let passing = out.files.len().min(MAX_FDS_PER_WRITE);
        // Files beyond one write's worth go with a later write: stop before their frames.
        let until = match out.files.get(passing) {
            Some(&(at, _)) => (at - out.written) as usize,
            None => out.buf.len(),
        };
        let files: Vec<BorrowedFd<'_>> = out.files.iter().take(passing).map(|(_, file)| file.as_fd()).collect();
        let n = self.writer.try_write_with_files(&out.buf[..until], &files)?;
        drop(files);
        out.files.drain(..passing);
        out.buf.advance(n);
        out.written += n as u64;
        Ok(())
    }

    /// Writes what the socket takes without waiting; hands the rest to the local
    /// task. Writing from here saves a task wake-up per reply.
    fn push(&self, out: &mut LocalOut) {
        if out.writing {
            return;
        }
        while !out.buf.is_empty() {
            match self.write_some(out) {
                Ok(()) => {}
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => break,
                // The task sees the same failure on its next read or write and ends.
                Err(_) => break,
            }
        }
        if !out.buf.is_empty() {
            out.writing = true;
            self.wake.notify_one();
        }
    }

    /// Close after writing what is queued.
    pub(crate) fn end(&self) {
        lock(&self.out).end = true;
        self.wake.notify_one();
    }

    /// Answers every waiting call with `Closed(message)` and ends the connection.
    pub(crate) fn fail_pending(&self, message: &str) {
        let mut out = lock(&self.out);
        let pending = std::mem::take(&mut out.pending);
        for id in pending {
            encode_reply(id, &Err(OpError::Closed(message.to_owned())), &mut out.buf);
        }
        out.end = true;
        self.push(&mut out);
        drop(out);
        self.wake.notify_one();
    }

    /// Writes everything queued (waiting for the socket as needed); true if the
    /// connection should now close.
    pub(crate) async fn drain(&self) -> io::Result<bool> {
        if self.writer.is_tls() {
            return self.drain_tls().await;
        }
        loop {
            {
                let mut out = lock(&self.out);
                while !out.buf.is_empty() {
                    match self.write_some(&mut out) {
                        Ok(()) => {}
                        Err(error) if error.kind() == io::ErrorKind::WouldBlock => break,
                        Err(error) => return Err(error),
                    }
                }
                if out.buf.is_empty() {
                    out.writing = false;
                    if out.buf.capacity() > KEEP_WRITE_CAPACITY {
                        out.buf = BytesMut::new();
                    }
                    return Ok(out.end);
                }
            }
            self.writer.writable().await?;
        }
    }
}

impl Local {
    /// [`Local::drain`] over TLS, which cannot write without waiting: only this
    /// task writes (`push` leaves everything to it), taking what is queued in turns.
    /// No files pass over TLS.
    async fn drain_tls(&self) -> io::Result<bool> {
        loop {
            let bytes = {
                let mut out = lock(&self.out);
                if out.buf.is_empty() {
                    out.writing = false;
                    if out.buf.capacity() > KEEP_WRITE_CAPACITY {
                        out.buf = BytesMut::new();
                    }
                    return Ok(out.end);
                }
                let bytes = out.buf.split();
                out.written += bytes.len() as u64;
                bytes
            };
            self.writer.write_locked(&bytes).await?;
        }
    }
}

/// Serves one local rank connection until it closes, then reports that upstream.
pub(crate) async fn serve(stream: Stream, hub: Arc<Hub>) {
    let mut rbuf = BytesMut::new();
    let mut charge = hub.budget.charge();
    let handshake = handshake(stream, &hub, &mut rbuf, &mut charge);
    let (stream, identity) = match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake).await {
        Ok(Some(admitted)) => admitted,
        Ok(None) => return,
        Err(_) => return log_refused(&End::HandshakeTimeout(HANDSHAKE_TIMEOUT)),
    };
    let (mut reader, writer) = stream.into_split();
    let local = Arc::new(Local {
        writer,
        out: Mutex::new(LocalOut::default()),
        wake: Notify::new(),
        takes_shared: AtomicBool::new(false),
        left: AtomicBool::new(false),
    });
    let sub = hub.next_sub.fetch_add(1, Ordering::Relaxed);
    // On a Unix socket the rank is on this machine whatever host name it states.
    let process = (identity.pid != 0 && (local.writer.is_unix() || identity.host == rallypoint_net::hostname()))
        .then_some(identity.pid);
    debug!(sub, job = %identity.job, rank = ?identity.rank, host = %identity.host, pid = identity.pid, "local rank connected");
    // Routed before its hello goes up: a reply can only follow the hello, and a
    // `Hub::lose` after the hello went up finds the route.
    lock(&hub.routes).insert(sub, Arc::clone(&local));
    let job = identity.job.clone();
    if !hub.send_up(sub, |up| encode_agent_frame(&AgentFrame::SubHello { sub, identity }, up)) {
        lock(&hub.routes).remove(&sub);
        let why = hub.lost_reason().unwrap_or_default();
        local.send(|out| encode_server_frame(&ServerFrame::Refused(OpError::Closed(why)), out));
        let _ = local.drain().await;
        return;
    }

    let end = serve_session(sub, &job, &mut reader, rbuf, &hub, &local, &mut charge).await;
    if end.is_peer_fault() {
        if let Some(held_back) = admit_shared(&END_WARNINGS) {
            warn!(sub, held_back, "closing a local rank's connection: {end}");
        }
    } else {
        debug!(sub, "local rank connection ended: {end}");
    }
    // Whatever it held of the slabs is free again, and its barrier channel slots.
    hub.slabs.release(None, sub);
    hub.channels.detach(sub);
    // Still routed: the rank's connection ended on its side (or failed), not ours.
    if lock(&hub.routes).remove(&sub).is_some() {
        // The agent is on the rank's host: it can tell the coordinator that the
        // process died, so that its peers learn it at once, rather than wait out the
        // reconnect grace meant for a cut connection. A killed process's socket closes
        // while it exits: it is given a moment to be gone.
        let gone = match process {
            Some(pid) if !local.left.load(Ordering::Relaxed) => rallypoint_net::process::watch(pid, EXIT_WATCH).await,
            _ => false,
        };
        hub.send_up(sub, |up| encode_agent_frame(&AgentFrame::SubClose { sub, gone }, up));
    }
}

/// How long a rank's process, whose connection ended without Leave, is watched for
/// its exit before the agent reports the end as possibly a cut connection.
const EXIT_WATCH: std::time::Duration = std::time::Duration::from_millis(200);

/// TLS (for a TCP connection, where the agent serves it and the rank starts a TLS
/// handshake), the token handshake and the hello; `None` if the connection ends
/// here (the peer was told why when it can be told).
async fn handshake(
    stream: Stream,
    hub: &Hub,
    rbuf: &mut BytesMut,
    charge: &mut Charge,
) -> Option<(Stream, rallypoint_core::Identity)> {
    let mut stream = match (stream, &hub.tls) {
        (Stream::Tcp(tcp), Some(tls)) => match peek_first_byte(&tcp).await {
            Ok(Some(TLS_FIRST_BYTE)) => match tls.accept(tcp).await {
                Ok(tls) => Stream::Tls(Box::new(tls.into())),
                Err(error) => {
                    log_refused(&End::Tls(error));
                    return None;
                }
            },
            Ok(Some(_)) => Stream::Tcp(tcp),
            Ok(None) => return None,
            Err(error) => {
                log_refused(&End::Io(error));
                return None;
            }
        },
        (stream, _) => stream,
    };
    // Plaintext TCP is refused where TLS is served; a Unix socket is this machine's,
    // guarded by its directory.
    let gate = Gate { token: hub.token.clone(), tls_required: hub.tls.is_some() && matches!(stream, Stream::Tcp(_)) };
    match accept_hello(&mut stream, rbuf, &hub.limits, Accepts::NODE_AGENT, &gate, charge).await {
        Ok(Hello::Native(identity)) => Some((stream, identity)),
        Ok(Hello::TcpStore | Hello::Agent) => unreachable!("a node agent accepts only native clients"),
        Err(end) => {
            log_refused(&end);
            if let End::Refused(error) = end {
                let mut out = BytesMut::new();
                encode_server_frame(&ServerFrame::Refused(*error), &mut out);
                if stream.write_all(&out).await.is_ok() {
                    let _ = stream.shutdown().await;
                }
            }
            None
        }
    }
}

/// Logs a connection that ended during its handshake.
fn log_refused(end: &End) {
    if end.is_peer_fault() {
        if let Some(held_back) = admit_shared(&END_WARNINGS) {
            warn!(held_back, "closing a local connection: {end}");
        }
    } else {
        debug!("local connection ended during its handshake: {end}");
    }
}

/// Forwards the rank's requests and writes what the upstream reader could not;
/// returns how the connection ended.
async fn serve_session(
    sub: u64,
    job: &str,
    reader: &mut ReadHalf,
    mut rbuf: BytesMut,
    hub: &Arc<Hub>,
    local: &Local,
    charge: &mut Charge,
) -> End {
    let mut warnings = WarnLimit::new();
    // The hello may have arrived together with the first requests.
    if let Err(end) = forward(sub, job, &mut rbuf, hub, local, &mut warnings, charge) {
        return end;
    }
    loop {
        Buffering::NODE_RANK.release_idle(&mut rbuf);
        let buffered = rbuf.len();
        tokio::select! {
            biased;
            () = local.wake.notified() => match local.drain().await {
                Ok(true) => return End::Shutdown("the node agent stopped serving".to_owned()),
                Ok(false) => {}
                Err(error) => return End::Io(error),
            },
            read = std::future::poll_fn(|cx| read_some(reader, &mut rbuf, Buffering::NODE_RANK, cx)) => match read {
                Ok(0) if rbuf.is_empty() => return End::Closed,
                Ok(0) => return End::ClosedMidFrame { buffered: rbuf.len() },
                Ok(read) => {
                    if let Err(end) = forward(sub, job, &mut rbuf, hub, local, &mut warnings, charge) {
                        return end;
                    }
                    after_read(read).await;
                }
                Err(error) => return End::Io(error),
            },
            end = stall(buffered, hub.read_timeout) => return end,
            () = charge.evicted() => return End::Evicted,
        }
    }
}

/// Sends every whole request buffered upstream as sub-session requests, in one
/// append. Malformed requests are answered here exactly as the coordinator would.
fn forward(
    sub: u64,
    job: &str,
    rbuf: &mut BytesMut,
    hub: &Arc<Hub>,
    local: &Local,
    warnings: &mut WarnLimit,
    charge: &mut Charge,
) -> Result<(), End> {
    // A rank has mostly one request in flight: kept inline, not allocated.
    let mut requests: SmallVec<[(u64, Request); 1]> = SmallVec::new();
    let result = decode_requests(rbuf, &hub.limits, |input| match input {
        Inbound::Request { id, request } => {
            if matches!(request, Request::Leave) {
                local.left.store(true, Ordering::Relaxed);
            }
            requests.push((id, request));
        }
        // Files only pass over Unix sockets; over TCP the rank gets plain replies.
        Inbound::TakeSharedReplies => local.takes_shared.store(local.writer.is_unix(), Ordering::Relaxed),
        Inbound::ReleaseShared { slab } => hub.slabs.release(Some(slab), sub),
        // Shared memory only passes over Unix sockets.
        Inbound::AttachBarrier { id, request } => {
            let attached = if local.writer.is_unix() {
                hub.channels.attach(hub, sub, job, &request)
            } else {
                Err("barrier channels are for ranks on the node agent's Unix socket".to_owned())
            };
            match attached {
                Ok((channel, slot)) => local.barrier_channel(id, &channel, slot),
                Err(reason) => {
                    local.send(|out| encode_server_frame(&ServerFrame::NoBarrierChannel { id, reason }, out))
                }
            }
            // The call itself goes up as any request; its reply follows the answer above.
            requests.push((id, request));
        }
        Inbound::LeaveBarrierChannel { channel, slot } => {
            if hub.channels.leave(sub, channel, slot) {
                // The rank forgets the channel's files as it leaves a slot of it:
                // they go again with the next slot it is given there.
                lock(&local.out).channels_given.remove(&channel);
            }
        }
        Inbound::Invalid { id, message } => {
            if let Some(held_back) = warnings.admit() {
                warn!(sub, %message, held_back, "bad request from a local rank");
            }
            if let Some(id) = id {
                local.send(|out| encode_reply(id, &Err(OpError::Invalid(message)), out));
            }
        }
    });
    if !requests.is_empty() {
        lock(&local.out).pending.extend(requests.iter().map(|(id, _)| *id));
        if !hub.send_requests(sub, requests) {
            // Lost meanwhile: `Hub::lose` may have run before these became pending.
            if let Some(why) = hub.lost_reason() {
                local.fail_pending(&why);
            }
        }
    }
    result?;
    hold_buffered(charge, rbuf)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::time::Duration;

    use bytes::Bytes;
    use rallypoint_core::Response;
    use rallypoint_net::shm::{held_body, map_slab, Slab};
    use rallypoint_proto::native::{decode_server_frame, decode_shared_reply, encode_reply_body_parts, FrameLimits};

    use super::*;

    #[tokio::test]
    async fn slab_files_pass_once_each_in_order_even_more_than_one_write_carries() {
        let (ours, theirs) = tokio::net::UnixStream::pair().expect("socket pair");
        let (_unread, writer) = Stream::unix(ours).expect("registers").into_split();
        let local = Local {
            writer,
            out: Mutex::new(LocalOut::default()),
            wake: Notify::new(),
            takes_shared: AtomicBool::new(true),
            left: AtomicBool::new(false),
        };
        // Replies from more slabs than one write passes files for, then one more
        // reply from each of the first two slabs, which must come without a file.
        let slabs = 3 * MAX_FDS_PER_WRITE + 1;
        let value = |slab: u64| Bytes::from(vec![slab as u8; 5000]);
        let placed: Vec<Placed> = (0..slabs as u64)
            .map(|slab| {
                let mut made = Slab::create(5000).expect("a slab");
                let mut head = BytesMut::new();
                let tail = encode_reply_body_parts(&Ok(Response::Value(value(slab))), &mut head);
                let len = made.write(&head, tail.as_deref().unwrap_or_default());
                Placed { slab, len, file: Arc::clone(&made.file) }
            })
            .collect();
        let replies: Vec<(u64, &Placed)> =
            placed.iter().map(|p| (p.slab, p)).chain([(100, &placed[0]), (101, &placed[1])]).collect();
        let n = replies.len();
        let reader = tokio::spawn(async move {
            let (mut reader, _writer) = Stream::unix(theirs).expect("registers").into_split();
            let (mut buf, mut files, mut maps, mut got) = (BytesMut::new(), VecDeque::new(), HashMap::new(), 0);
            loop {
                while let Some(frame) = decode_server_frame(&mut buf, &FrameLimits::unbounded()).expect("well-formed") {
                    let ServerFrame::SharedReply { id, slab, len } = frame else { panic!("{frame:?}") };
                    let map = maps.entry(slab).or_insert_with(|| {
                        let file = files.pop_front().expect("a slab's file arrives with or before its first frame");
                        map_slab(file).expect("maps")
                    });
                    let body = held_body(Arc::clone(map), len, || {}).expect("fits");
                    assert_eq!(decode_shared_reply(id, body), Ok(Ok(Response::Value(value(slab)))), "reply {id}");
                    got += 1;
                }
                if got == n {
                    break;
                }
                let read = reader.read_with_files(&mut buf, 8192, &mut files).await.expect("reads");
                assert!(read > 0, "closed after {got} replies");
            }
            assert!(files.is_empty(), "{} files too many", files.len());
        });
        // Queued while the local task "is writing", then written together: one
        // write could carry them all, but may carry at most MAX_FDS_PER_WRITE files.
        lock(&local.out).writing = true;
        for (id, placed) in replies {
            local.reply_shared(id, placed);
        }
        assert_eq!(lock(&local.out).files.len(), slabs);
        assert!(!local.drain().await.expect("writes"));
        tokio::time::timeout(Duration::from_secs(30), reader).await.expect("in time").expect("reader");
    }
}
