//! The client's connection: connecting (with retries), the handshake, and the
//! background task that owns the socket. Calls register a reply slot under a fresh
//! request id and hand the request to the task; the task writes requests (and
//! heartbeats) and routes replies to the slots by id, so any number of calls
//! pipeline over one connection.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::io;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Poll;
use std::time::Duration;

use bytes::BytesMut;
use rallypoint_core::{Identity, OpError, Request, Response, Welcome};
use rallypoint_proto::native::{
    decode_server_frame, decode_shared_reply, encode_client_frame, pending_frame_len, ClientFrame, FrameLimits,
    ProtoError, ServerFrame,
};
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, oneshot};
use tokio::time::{Instant, Interval, MissedTickBehavior};
use tracing::debug;

use rallypoint_net::conn::{greet, AuthFailure, Buffering, Credentials, GreetError};
use rallypoint_net::shm;
use rallypoint_net::sync::Backoff;
use rallypoint_net::{unix_path, ReadHalf, Stream, WriteHalf};

use crate::error::Error;

/// Most bytes reserved at once for the rest of a reply whose length prefix has
/// arrived. Beyond it the buffer grows as the bytes arrive: a corrupt prefix must
/// not make the client reserve gigabytes.
const MAX_RESERVE: usize = 256 << 20;
/// Stop gathering queued requests into one write past this size.
const MAX_WRITE_BATCH: usize = 1 << 20;

pub(crate) type ReplySlot = oneshot::Sender<Result<Response, Error>>;

/// What a call sends to the connection task.
pub(crate) enum Command {
    Request {
        id: u64,
        request: Request,
    },
    /// Nothing of this shared-memory slab's current contents is held any more.
    Release {
        slab: u64,
    },
    /// Shut the socket down (after everything queued before it was written) and
    /// tell the sender when done.
    Shutdown(oneshot::Sender<()>),
}

/// State shared by every clone of a client and its connection task.
pub(crate) struct Link {
    addr: String,
    next_id: AtomicU64,
    pending: Mutex<Pending>,
    /// Replies handed to their calls since the writer last looked: each woke a
    /// caller that may be about to send its next request.
    delivered: AtomicUsize,
}

struct Pending {
    slots: HashMap<u64, ReplySlot>,
    /// Set once the connection has ended: why, as reported to every later call.
    closed: Option<String>,
}

impl Link {
    fn new(addr: String) -> Self {
        Link {
            addr,
            next_id: AtomicU64::new(1),
            pending: Mutex::new(Pending { slots: HashMap::new(), closed: None }),
            delivered: AtomicUsize::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Pending> {
        // Nothing panics while holding this lock; recover rather than cascade if it ever does.
        self.pending.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Allocates a request id and the slot its reply will arrive in.
    pub(crate) fn register(&self) -> Result<(u64, oneshot::Receiver<Result<Response, Error>>), Error> {
        let mut pending = self.lock();
        if let Some(why) = &pending.closed {
            return Err(Error::Disconnected(why.clone()));
        }
        let id = self.next_id();
        let (slot, reply) = oneshot::channel();
        pending.slots.insert(id, slot);
        Ok((id, reply))
    }

    /// Forgets a call whose caller stopped waiting (timed out or was cancelled).
    pub(crate) fn unregister(&self, id: u64) {
        self.lock().slots.remove(&id);
    }

    /// The error for a call that finds the connection gone.
    pub(crate) fn disconnected(&self) -> Error {
        let why = self.lock().closed.clone();
        Error::Disconnected(
            why.unwrap_or_else(|| format!("the connection to the coordinator at {} is closed", self.addr)),
        )
    }

    fn complete(&self, id: u64, result: Result<Response, Error>) {
        // No slot: a heartbeat, or a call that timed out on this side.
        let slot = self.lock().slots.remove(&id);
        if let Some(slot) = slot {
            self.delivered.fetch_add(1, Ordering::Relaxed);
            // The caller may have stopped waiting meanwhile; that is fine.
            let _ = slot.send(result);
        }
    }

    /// Fails every waiting call, and every later one, with `why`.
    fn close(&self, why: String) {
        let slots = {
            let mut pending = self.lock();
            pending.closed.get_or_insert_with(|| why.clone());
            std::mem::take(&mut pending.slots)
        };
        for (_, slot) in slots {
            let _ = slot.send(Err(Error::Disconnected(why.clone())));
        }
    }

    fn lost(&self, why: impl std::fmt::Display) -> String {
        format!("connection to the coordinator at {} lost: {why}", self.addr)
    }
}

/// A connected, welcomed client connection, not yet handed to its task.
pub(crate) struct Connected {
    stream: Stream,
    /// Bytes read past the welcome.
    buffered: BytesMut,
    welcome: Welcome,
}

/// Connects and says hello, retrying with [`Backoff`] until
/// `timeout`: workers often start before their coordinator listens. A refusal is
/// the coordinator's answer and is returned at once.
///
/// `shared_replies`: on a Unix socket (a node agent of this machine), take large
/// replies as shared memory (docs/PROTOCOL.md, section 13). `credentials`: the
/// token to prove (and to have the coordinator prove), and TLS.
pub(crate) async fn connect(
    addr: &str,
    identity: &Identity,
    timeout: Duration,
    shared_replies: bool,
    credentials: &Credentials,
) -> Result<Connected, Error> {
    let started = Instant::now();
    let deadline = started + timeout;
    let mut backoff = Backoff::new();
    let mut attempts = 0u32;
    // The most telling failure so far, for the final error.
    let mut last = None;
    loop {
        attempts += 1;
        match tokio::time::timeout_at(deadline, attempt(addr, identity, shared_replies, credentials)).await {
            Ok(Ok(connected)) => {
                debug!(addr, attempts, session = %connected.welcome.session, "connected to the coordinator");
                return Ok(connected);
            }
            Ok(Err(Attempt::Refused(OpError::Unauthorized(why)))) => {
                return Err(Error::Auth { addr: addr.to_owned(), failure: AuthFailure::Refused(why) })
            }
            Ok(Err(Attempt::Auth(failure))) => return Err(Error::Auth { addr: addr.to_owned(), failure }),
            Ok(Err(Attempt::Refused(error))) => return Err(Error::Op(error)),
            Ok(Err(Attempt::Protocol(message))) => {
                return Err(Error::Protocol(format!("the coordinator at {addr}: {message}")));
            }
            Ok(Err(Attempt::Io(error))) => {
                debug!(addr, attempts, %error, "cannot reach the coordinator yet; retrying");
                last = Some(error);
            }
            // The deadline passed mid-attempt: an earlier failure says more than this one.
            Err(_) => {
                if last.is_none() {
                    last = Some(io::Error::new(io::ErrorKind::TimedOut, "no answer within the connect timeout"));
                }
            }
        }
        tokio::time::sleep_until((Instant::now() + backoff.next_pause()).min(deadline)).await;
        if Instant::now() >= deadline {
            let source = last.unwrap_or_else(|| io::Error::new(io::ErrorKind::TimedOut, "connect timeout elapsed"));
            return Err(Error::Connect { addr: addr.to_owned(), waited: started.elapsed(), source });
        }
    }
}

enum Attempt {
    /// Worth retrying: nothing listening yet, connection reset, closed early, ...
    Io(io::Error),
    Refused(OpError),
    Protocol(String),
    /// The token or TLS handshake failed: final.
    Auth(AuthFailure),
}

impl From<GreetError> for Attempt {
    fn from(error: GreetError) -> Self {
        match error {
            GreetError::Io(error) => Attempt::Io(error),
            GreetError::Auth(failure) => Attempt::Auth(failure),
        }
    }
}

async fn attempt(
    addr: &str,
    identity: &Identity,
    shared_replies: bool,
    credentials: &Credentials,
) -> Result<Connected, Attempt> {
    let mut hello = BytesMut::new();
    encode_client_frame(&ClientFrame::Hello(identity.clone()), &mut hello);
    // Only a node agent of this machine, over a Unix socket, can pass shared memory.
    if shared_replies && unix_path(addr).is_some() {
        encode_client_frame(&ClientFrame::TakeSharedReplies, &mut hello);
    }
    let (stream, answer, buffered) =
        greet(addr, credentials, &hello, |buf| match decode_server_frame(buf, &FrameLimits::unbounded()) {
            Ok(None) => None,
            Ok(Some(ServerFrame::Welcome(welcome))) => Some(Ok(welcome)),
            Ok(Some(ServerFrame::Refused(error))) => Some(Err(Attempt::Refused(error))),
            Ok(Some(ServerFrame::Reply { id, .. } | ServerFrame::SharedReply { id, .. })) => {
                Some(Err(Attempt::Protocol(format!("sent a reply (request id {id}) before its welcome"))))
            }
            Ok(Some(ServerFrame::AuthChallenge { .. } | ServerFrame::AuthAccepted { .. })) => {
                Some(Err(Attempt::Protocol("sent a token handshake frame nobody asked for".to_owned())))
            }
            Err(error) => Some(Err(Attempt::Protocol(error.to_string()))),
        })
        .await?;
    answer.map(|welcome| Connected { stream, buffered, welcome })
}

/// Starts the task that owns the connection; returns the handle calls send through.
pub(crate) fn spawn(addr: String, connected: Connected) -> (Arc<Link>, mpsc::UnboundedSender<Command>, Welcome) {
    let Connected { stream, buffered, welcome } = connected;
    let link = Arc::new(Link::new(addr));
    let (commands, queue) = mpsc::unbounded_channel();
    // Heartbeat at a third of the lease so that two may be lost before it expires.
    let heartbeat = (welcome.lease_ms > 0).then(|| Duration::from_millis((welcome.lease_ms / 3).max(1)));
    // Weak: slab releases must not keep the connection open once every client is gone.
    let releases = commands.downgrade();
    tokio::spawn(run(stream, buffered, queue, releases, Arc::clone(&link), heartbeat));
    (link, commands, welcome)
}

async fn run(
    stream: Stream,
    buffered: BytesMut,
    queue: mpsc::UnboundedReceiver<Command>,
    releases: mpsc::WeakUnboundedSender<Command>,
    link: Arc<Link>,
    heartbeat: Option<Duration>,
) {
    let (reader, writer) = stream.into_split();
    // Reading and writing run concurrently, so a large write never stops replies
    // from being read (which could deadlock against a server doing the same).
    let (why, done) = tokio::select! {
        why = read_loop(reader, buffered, &releases, &link) => (why, None),
        ended = write_loop(writer, queue, &link, heartbeat) => ended,
    };
    debug!(addr = %link.addr, %why, "connection task ended");
    // Both socket halves are dropped here, before waiting calls learn of it.
    link.close(why);
    if let Some(done) = done {
        let _ = done.send(());
    }
}

/// Routes replies to their calls; returns why the connection ended.
async fn read_loop(
    mut reader: ReadHalf,
    mut buf: BytesMut,
    releases: &mpsc::WeakUnboundedSender<Command>,
    link: &Link,
) -> String {
    let limits = FrameLimits::unbounded();
    // Files of shared-memory slabs, received with (or before) the first frame naming
    // each, in order; and the slabs mapped so far, kept for the connection's life.
    let mut files = VecDeque::new();
    let mut slabs = HashMap::new();
    loop {
        loop {
            match decode_server_frame(&mut buf, &limits) {
                Ok(None) => break,
                Ok(Some(ServerFrame::Reply { id, reply })) => link.complete(id, reply.map_err(Error::Op)),
                Ok(Some(ServerFrame::SharedReply { id, slab, len })) => {
                    let map = match slabs.entry(slab) {
                        Entry::Occupied(known) => Arc::clone(known.get()),
                        Entry::Vacant(new) => {
                            let Some(file) = files.pop_front() else {
                                return link.lost(format!("shared-memory slab {slab} came without its file"));
                            };
                            match shm::map_slab(file) {
                                Ok(map) => Arc::clone(new.insert(map)),
                                // Later replies from it could not be read either.
                                Err(error) => {
                                    return link.lost(format!("cannot map shared-memory slab {slab}: {error}"))
                                }
                            }
                        }
                    };
                    let releases = releases.clone();
                    let release = move || {
                        if let Some(commands) = releases.upgrade() {
                            let _ = commands.send(Command::Release { slab });
                        }
                    };
                    let reply = match shm::held_body(map, len, release) {
                        Ok(body) => decode_shared_reply(id, body).map_err(|error| Error::Protocol(error.to_string())),
                        Err(error) => Err(Error::Protocol(error.to_string())),
                    };
                    link.complete(id, reply.and_then(|reply| reply.map_err(Error::Op)));
                }
                Ok(Some(
                    ServerFrame::Welcome(_)
                    | ServerFrame::Refused(_)
                    | ServerFrame::AuthChallenge { .. }
                    | ServerFrame::AuthAccepted { .. },
                )) => {
                    return link.lost("the coordinator sent a second handshake frame");
                }
                Err(ProtoError::BadReply { id: Some(id), message }) => link.complete(id, Err(Error::Protocol(message))),
                Err(error) if !error.is_fatal() => debug!(addr = %link.addr, %error, "skipped a malformed frame"),
                Err(error) => return link.lost(format!("malformed data: {error}")),
            }
        }
        Buffering::CLIENT.release_idle(&mut buf);
        let room = read_room(&buf);
        match reader.read_with_files(&mut buf, room, &mut files).await {
            Ok(0) => return link.lost("the coordinator closed the connection"),
            Ok(_) => {}
            Err(error) => return link.lost(error),
        }
    }
}

/// Room to make in the read buffer before the next read: the rest of the reply
/// being received when its length is known (up to [`MAX_RESERVE`]), at least a
/// client's read chunk. An all-gather reply is world size × value size: reserving a
/// little per read would regrow the buffer, copying all it holds, again and again.
fn read_room(buf: &[u8]) -> usize {
    let missing = pending_frame_len(buf).map_or(0, |len| len.saturating_sub(buf.len()));
    missing.clamp(Buffering::CLIENT.chunk, MAX_RESERVE)
}

/// Writes requests and heartbeats; returns why it stopped, and whom to tell once
/// the connection is fully closed if that was asked for.
async fn write_loop(
    mut writer: WriteHalf,
    mut queue: mpsc::UnboundedReceiver<Command>,
    link: &Link,
    heartbeat: Option<Duration>,
) -> (String, Option<oneshot::Sender<()>>) {
    let mut beat = heartbeat.map(|period| {
        let mut beat = tokio::time::interval_at(Instant::now() + period, period);
        beat.set_missed_tick_behavior(MissedTickBehavior::Delay);
        beat
    });
    let mut buf = BytesMut::new();
    loop {
        let mut shutdown = None;
        tokio::select! {
            command = queue.recv() => {
                let Some(command) = command else {
                    // Every client handle is gone without close(): drop the connection
                    // abruptly, as a killed process would.
                    return (format!("the client for the coordinator at {} was dropped", link.addr), None);
                };
                let mut gathered = 0;
                shutdown = gather(command, &mut queue, &mut buf, &mut gathered);
                // Callers woken by the last replies that have not sent their next
                // request yet: let them run first, so that their requests share this
                // write instead of costing one system call each.
                let woken = link.delivered.swap(0, Ordering::Relaxed);
                if shutdown.is_none() && woken > gathered && buf.len() < MAX_WRITE_BATCH {
                    yield_to_ready_tasks().await;
                    if let Ok(command) = queue.try_recv() {
                        shutdown = gather(command, &mut queue, &mut buf, &mut gathered);
                    }
                }
            }
            () = tick(&mut beat) => {
                let request = Request::Heartbeat;
                encode_client_frame(&ClientFrame::Request { id: link.next_id(), request }, &mut buf);
            }
        }
        if !buf.is_empty() {
            // Flushed: TLS holds what it encrypted until then.
            if let Err(error) = async {
                writer.write_all(&buf).await?;
                writer.flush().await
            }
            .await
            {
                return (link.lost(error), shutdown);
            }
            buf.clear();
            Buffering::CLIENT.release_idle(&mut buf);
        }
        if let Some(done) = shutdown {
            let _ = writer.shutdown().await;
            return (format!("the client for the coordinator at {} was closed", link.addr), Some(done));
        }
    }
}

/// Encodes `first` and whatever else is queued (up to [`MAX_WRITE_BATCH`]) into
/// `buf`, counting requests in `gathered`; stops at a shutdown and returns it.
fn gather(
    first: Command,
    queue: &mut mpsc::UnboundedReceiver<Command>,
    buf: &mut BytesMut,
    gathered: &mut usize,
) -> Option<oneshot::Sender<()>> {
    let mut next = Some(first);
    while let Some(command) = next.take() {
        match command {
            Command::Request { id, request } => {
                encode_client_frame(&ClientFrame::Request { id, request }, buf);
                *gathered += 1;
            }
            Command::Release { slab } => encode_client_frame(&ClientFrame::ReleaseShared { slab }, buf),
            Command::Shutdown(done) => return Some(done),
        }
        if buf.len() < MAX_WRITE_BATCH {
            next = queue.try_recv().ok();
        }
    }
    None
}

/// Lets the tasks already waiting to run go first, once. Unlike
/// `tokio::task::yield_now`, it does not wait for the runtime to poll for I/O:
/// a task that wakes itself is put at the back of the run queue at once.
async fn yield_to_ready_tasks() {
    let mut yielded = false;
    std::future::poll_fn(|cx| {
        if yielded {
            return Poll::Ready(());
        }
        yielded = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    })
    .await
}

async fn tick(beat: &mut Option<Interval>) {
    match beat {
        Some(beat) => {
            beat.tick().await;
        }
        None => std::future::pending().await,
    }
}
