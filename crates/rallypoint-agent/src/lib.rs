//! The node agent: one process per node between that node's ranks and the coordinator.
//!
//! Local ranks connect to the agent exactly as to a coordinator (the unchanged
//! native protocol, over TCP or a Unix socket). The agent holds one connection to
//! the coordinator and carries every local rank over it as a *sub-session*
//! (docs/PROTOCOL.md, section 12): the coordinator keeps one engine session per
//! rank, so barriers, collectives, the store, leases, timeouts naming the missing
//! ranks and the loss of a rank behave exactly as with direct connections, while
//! the coordinator handles one socket per node instead of one per rank.
//!
//! Batching: whatever the local ranks send while the previous upstream write is in
//! flight goes up in the next single write; the coordinator's replies for many
//! ranks arrive in one read and are fanned out from the task that read them, each
//! written straight to its rank's socket when the socket takes it at once.
//!
//! Aggregation: within one such write, the local ranks' identical barrier calls go
//! up as one SubRequests frame listing them, and the coordinator's identical replies
//! (a barrier's release) come back as one SubReplies frame that is fanned out here,
//! so a node's arrival at and release from a barrier cost the coordinator one frame
//! each instead of one per rank.
//!
//! Failure: a local rank whose connection ends is reported upstream at once (the
//! coordinator decides, as for a direct connection, whether it left or is lost).
//! If the upstream connection ends, the coordinator counts every rank of this agent
//! as lost; the agent answers every call still waiting with a `Closed` error saying
//! so, closes the local connections and stops with [`AgentError::UpstreamLost`].

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Buf, BytesMut};
use rallypoint_core::{OpError, Reply, Request};
use rallypoint_proto::native::{
    decode_client_frame, decode_preamble, decode_root_frame, encode_agent_frame, encode_preamble, encode_reply,
    encode_reply_body_parts, encode_server_frame, reply_payload_len, AgentFrame, ClientFrame, FrameLimits, ProtoError,
    RootFrame, ServerFrame, MAX_CALLS_PER_FRAME, VERSION,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, ReadBuf};
use tokio::sync::{oneshot, Notify};
use tokio::task::{JoinHandle, JoinSet};
use tracing::{debug, error, info, trace, warn};

use rallypoint_net::shm::{Slab, MAX_FDS_PER_WRITE, SHARED_REPLY_MIN};
use rallypoint_net::sync::{lock, Backoff};
use rallypoint_net::{Listener, ReadHalf, Stream, WriteHalf};

/// How long [`AgentConfig::new`] lets the agent try to reach its coordinator at
/// start: as long as a client's default.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(300);
/// Bytes taken from a socket per read.
const READ_CHUNK: usize = 4096;
/// Bytes reserved per read of the upstream connection: replies for many ranks at once.
const UPSTREAM_READ_CHUNK: usize = 256 * 1024;
/// Buffers larger than this are freed once empty instead of kept.
const KEEP_CAPACITY: usize = 64 * 1024;
/// A local peer that does not finish its preamble and hello in this time is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// Distinct barrier calls merged at once before a write; they are compared one by
/// one, and a node's ranks rarely wait at more than one or two barriers together.
const MAX_MERGED: usize = 8;
/// Shared-memory slabs an agent makes at most. Each is free again once its ranks
/// released it, so a job needs about one per large result its ranks hold at once;
/// past this, large replies go through the sockets.
const MAX_SLABS: usize = 64;

#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// `host:port` of the coordinator.
    pub upstream: String,
    /// Where the local ranks connect: `host:port` (port 0: any free one) or `unix:PATH`.
    pub listen: String,
    /// How long to keep trying to reach the coordinator at start.
    pub connect_timeout: Duration,
    /// Host name the agent gives the coordinator (for its logs).
    pub host: String,
    /// Largest frame a local rank may send; should match the coordinator's.
    pub limits: FrameLimits,
}

impl AgentConfig {
    pub fn new(upstream: impl Into<String>, listen: impl Into<String>) -> Self {
        AgentConfig {
            upstream: upstream.into(),
            listen: listen.into(),
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            host: rallypoint_net::hostname(),
            limits: FrameLimits::default(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("node agent: cannot listen on {addr}: {source}")]
    Listen { addr: String, source: io::Error },
    #[error("node agent: cannot reach the coordinator at {addr} (tried for {waited:.1?}): {source}")]
    Connect { addr: String, waited: Duration, source: io::Error },
    #[error("node agent: the coordinator at {addr} refused this agent: {error}")]
    Refused { addr: String, error: OpError },
    #[error("node agent: the coordinator at {addr} broke the protocol: {message}")]
    Protocol { addr: String, message: String },
    /// The coordinator counts every rank of this agent as lost.
    #[error("node agent: {why}; its {ranks} local rank connection(s) were closed")]
    UpstreamLost { why: String, ranks: usize },
}

/// A node agent with its local listener bound and its coordinator connection
/// welcomed, not yet serving.
pub struct Agent {
    listener: Listener,
    local_addr: String,
    upstream: Stream,
    /// Bytes read past the coordinator's welcome.
    buffered: BytesMut,
    hub: Arc<Hub>,
}

impl Agent {
    /// Binds the local listener, then connects to the coordinator (retrying until
    /// `connect_timeout`) and introduces itself.
    pub async fn bind(config: AgentConfig) -> Result<Agent, AgentError> {
        let fd_limit = rallypoint_net::raise_fd_limit();
        let listener = Listener::bind(&config.listen)
            .await
            .map_err(|source| AgentError::Listen { addr: config.listen.clone(), source })?;
        let local_addr =
            listener.local_addr().map_err(|source| AgentError::Listen { addr: config.listen.clone(), source })?;
        let (upstream, buffered, lease_ms) = connect_upstream(&config).await?;
        info!(%local_addr, upstream = %config.upstream, fd_limit, lease_ms, "rallypoint node agent ready");
        let hub = Arc::new(Hub {
            addr: config.upstream,
            limits: config.limits,
            up: Mutex::new(Up::default()),
            up_ready: Notify::new(),
            routes: Mutex::new(HashMap::new()),
            next_sub: AtomicU64::new(1),
            slabs: Mutex::new(Vec::new()),
        });
        Ok(Agent { listener, local_addr, upstream, buffered, hub })
    }

    /// Where local ranks connect, as `RALLYPOINT_ADDR` takes it.
    pub fn local_addr(&self) -> &str {
        &self.local_addr
    }

    /// Serves until `shutdown` completes (`Ok`) or the coordinator connection ends
    /// ([`AgentError::UpstreamLost`]). Either way every local connection is closed;
    /// on shutdown the coordinator then counts the agent's ranks as lost (as a
    /// coordinator shutting down does for direct connections).
    pub async fn run_until(self, shutdown: impl Future<Output = ()>) -> Result<(), AgentError> {
        let Agent { listener, local_addr, upstream, buffered, hub } = self;
        let (reader, writer) = upstream.into_split();
        let mut locals = JoinSet::new();
        tokio::pin!(shutdown);
        let upstream = async {
            tokio::select! {
                why = read_upstream(reader, buffered, &hub) => why,
                why = write_upstream(writer, &hub) => why,
            }
        };
        tokio::pin!(upstream);
        let outcome = loop {
            tokio::select! {
                () = &mut shutdown => {
                    let ranks = hub.lose("the node agent is shutting down".to_owned());
                    info!(%local_addr, ranks, "node agent shutting down; its ranks are lost to the coordinator");
                    break Ok(());
                }
                why = &mut upstream => {
                    let ranks = hub.lose(format!(
                        "the node agent lost its connection to the coordinator ({why}); the coordinator counts this node's ranks as lost"
                    ));
                    error!(%local_addr, %why, ranks, "node agent lost the coordinator; its ranks are lost");
                    break Err(AgentError::UpstreamLost { why, ranks });
                }
                accepted = listener.accept() => match accepted {
                    Ok(stream) => {
                        let hub = Arc::clone(&hub);
                        locals.spawn(async move { serve_local(stream, hub).await });
                    }
                    Err(error) => {
                        warn!(%local_addr, %error, "accept failed");
                        // Out of file descriptors and the like: do not spin.
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                },
                Some(ended) = locals.join_next() => {
                    if let Err(error) = ended {
                        if error.is_panic() {
                            error!(%error, "a local connection task panicked");
                        }
                    }
                }
            }
        };
        drop(listener);
        // Replies to waiting calls (after an upstream loss) are written by the local
        // tasks as they end; a rank that does not read them must not hold us up.
        let drained = async { while locals.join_next().await.is_some() {} };
        if tokio::time::timeout(Duration::from_secs(1), drained).await.is_err() {
            locals.shutdown().await;
        }
        info!(%local_addr, "rallypoint node agent stopped");
        outcome
    }

    /// Runs the agent on the current tokio runtime. Dropping the handle stops it.
    #[must_use = "dropping the handle stops the agent"]
    pub fn spawn(self) -> AgentHandle {
        let local_addr = self.local_addr.clone();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(self.run_until(async move {
            let _ = stopped.await;
        }));
        AgentHandle { local_addr, stop, task }
    }
}

/// An agent running in the background (see [`Agent::spawn`]).
pub struct AgentHandle {
    local_addr: String,
    /// Never sent: dropping it is the stop signal.
    stop: oneshot::Sender<()>,
    task: JoinHandle<Result<(), AgentError>>,
}

impl AgentHandle {
    pub fn local_addr(&self) -> &str {
        &self.local_addr
    }

    /// Stops the agent (its ranks are lost to the coordinator) and returns how it ended.
    pub async fn shutdown(self) -> Result<(), AgentError> {
        let AgentHandle { stop, task, .. } = self;
        drop(stop);
        joined(task).await
    }

    /// Waits until the agent stops by itself (its coordinator connection ended).
    pub async fn wait(self) -> Result<(), AgentError> {
        let AgentHandle { stop, task, .. } = self;
        let outcome = joined(task).await;
        drop(stop);
        outcome
    }
}

async fn joined(task: JoinHandle<Result<(), AgentError>>) -> Result<(), AgentError> {
    match task.await {
        Ok(outcome) => outcome,
        Err(error) => Err(AgentError::UpstreamLost { why: format!("the agent task failed: {error}"), ranks: 0 }),
    }
}

/// Connects to the coordinator and exchanges the agent hello and welcome, retrying
/// with backoff while nothing answers (agents often start before the coordinator).
async fn connect_upstream(config: &AgentConfig) -> Result<(Stream, BytesMut, u64), AgentError> {
    let addr = &config.upstream;
    let started = Instant::now();
    let mut backoff = Backoff::new();
    loop {
        let error = match tokio::time::timeout(HANDSHAKE_TIMEOUT, hello_upstream(config)).await {
            Ok(Ok(Ok(connected))) => return Ok(connected),
            Ok(Ok(Err(refused))) => return Err(refused),
            Ok(Err(error)) => error,
            Err(_) => io::Error::new(io::ErrorKind::TimedOut, "no welcome from the coordinator"),
        };
        if started.elapsed() >= config.connect_timeout {
            return Err(AgentError::Connect { addr: addr.clone(), waited: started.elapsed(), source: error });
        }
        debug!(%addr, %error, "cannot reach the coordinator yet; retrying");
        tokio::time::sleep(backoff.next_pause()).await;
    }
}

/// `Err`: worth retrying; `Ok(Err)`: the coordinator's answer, final.
async fn hello_upstream(config: &AgentConfig) -> io::Result<Result<(Stream, BytesMut, u64), AgentError>> {
    let addr = &config.upstream;
    let mut stream = Stream::connect(addr).await?;
    let mut out = BytesMut::new();
    encode_preamble(&mut out);
    encode_agent_frame(&AgentFrame::Hello { host: config.host.clone(), pid: std::process::id() }, &mut out);
    stream.write_all(&out).await?;
    let mut buf = BytesMut::new();
    loop {
        let protocol = |message: String| AgentError::Protocol { addr: addr.clone(), message };
        match decode_root_frame(&mut buf, &FrameLimits::unbounded()) {
            Ok(Some(RootFrame::Welcome { lease_ms })) => return Ok(Ok((stream, buf, lease_ms))),
            Ok(Some(RootFrame::Refused(error))) => return Ok(Err(AgentError::Refused { addr: addr.clone(), error })),
            Ok(Some(other)) => return Ok(Err(protocol(format!("sent {other:?} before its welcome")))),
            Ok(None) => {}
            Err(error) => return Ok(Err(protocol(error.to_string()))),
        }
        buf.reserve(READ_CHUNK);
        if stream.read_buf(&mut buf).await? == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the coordinator closed the connection"));
        }
    }
}

/// What the local connections and the upstream tasks share.
struct Hub {
    /// The coordinator's address, for messages.
    addr: String,
    limits: FrameLimits,
    up: Mutex<Up>,
    /// Wakes the upstream writer: `up.buf` has bytes.
    up_ready: Notify,
    /// Local connections by sub-session id.
    routes: Mutex<HashMap<u64, Arc<Local>>>,
    next_sub: AtomicU64,
    /// Shared-memory slabs (docs/PROTOCOL.md, section 13); a slab's id is its index.
    slabs: Mutex<Vec<SlabUse>>,
}

/// A slab and the ranks holding its current contents.
struct SlabUse {
    slab: Slab,
    /// Per sub-session: shared replies from this slab's contents not yet released.
    holders: HashMap<u64, u32>,
}

#[derive(Default)]
struct Up {
    /// Frames for the coordinator not yet written.
    buf: BytesMut,
    /// Barrier calls of the local ranks not yet written, merged by identical request;
    /// [`Up::seal`] appends them to `buf`.
    merged: Vec<Merged>,
    /// Sub-sessions with a call in `merged`: their next frame must not overtake it.
    in_merged: HashSet<u64>,
    /// Set once the coordinator connection has ended: why.
    lost: Option<String>,
}

/// One barrier call made by several local ranks: one SubRequests frame.
struct Merged {
    request: Request,
    /// `(sub, request id)` of each rank that made it.
    calls: Vec<(u64, u64)>,
}

impl Up {
    /// Nothing waits to be written.
    fn is_idle(&self) -> bool {
        self.buf.is_empty() && self.merged.is_empty()
    }

    /// A frame of `sub` is about to be appended: if a merged call of `sub` is still
    /// held back, everything merged goes first, so `sub`'s frames keep their order.
    /// (Holding back a call past other sub-sessions' frames is harmless: their ranks'
    /// calls were concurrent, and any interleaving of them is one they could have had.)
    fn order_before(&mut self, sub: u64) {
        if self.in_merged.contains(&sub) {
            self.seal();
        }
    }

    /// Adds a barrier call to the merged call with the same request, or starts one.
    fn merge(&mut self, sub: u64, id: u64, request: Request) {
        self.order_before(sub);
        match self.merged.iter_mut().find(|m| m.calls.len() < MAX_CALLS_PER_FRAME && m.request == request) {
            Some(merged) => merged.calls.push((sub, id)),
            None => {
                if self.merged.len() >= MAX_MERGED {
                    self.seal();
                }
                self.merged.push(Merged { request, calls: vec![(sub, id)] });
            }
        }
        self.in_merged.insert(sub);
    }

    /// Appends the merged calls to `buf`: a call made by one rank alone as the plain
    /// SubRequest it was.
    fn seal(&mut self) {
        for Merged { request, calls } in self.merged.drain(..) {
            let frame = match calls[..] {
                [(sub, id)] => AgentFrame::SubRequest { sub, id, request },
                _ => AgentFrame::SubRequests { calls, request },
            };
            encode_agent_frame(&frame, &mut self.buf);
        }
        self.in_merged.clear();
    }
}

impl Hub {
    /// Appends a frame of sub-session `sub` for the coordinator; false if it is
    /// already gone.
    fn send_up(&self, sub: u64, encode: impl FnOnce(&mut BytesMut)) -> bool {
        let mut up = lock(&self.up);
        if up.lost.is_some() {
            return false;
        }
        let was_idle = up.is_idle();
        up.order_before(sub);
        encode(&mut up.buf);
        drop(up);
        if was_idle {
            self.up_ready.notify_one();
        }
        true
    }

    /// Queues a rank's requests for the coordinator, merging its barrier calls with
    /// identical ones of other local ranks; false if the coordinator is already gone.
    fn send_requests(&self, sub: u64, requests: Vec<(u64, Request)>) -> bool {
        let mut up = lock(&self.up);
        if up.lost.is_some() {
            return false;
        }
        let was_idle = up.is_idle();
        for (id, request) in requests {
            // Only barriers: every rank's call is the same bytes (the rank is its
            // session's), while all-gather and broadcast calls carry values of their own.
            if matches!(request, Request::Barrier { .. }) {
                up.merge(sub, id, request);
            } else {
                up.order_before(sub);
                encode_agent_frame(&AgentFrame::SubRequest { sub, id, request }, &mut up.buf);
            }
        }
        drop(up);
        if was_idle {
            self.up_ready.notify_one();
        }
        true
    }

    fn lost_reason(&self) -> Option<String> {
        lock(&self.up).lost.clone()
    }

    /// The agent stops serving (`message` says why): every waiting call of every
    /// local rank gets a `Closed(message)` error, every local connection closes, and
    /// later ones are refused. Returns how many local ranks were connected.
    fn lose(&self, message: String) -> usize {
        {
            let mut up = lock(&self.up);
            up.lost = Some(message.clone());
            // Their calls are pending on their connections, and fail below.
            up.merged.clear();
            up.in_merged.clear();
        }
        let locals: Vec<Arc<Local>> = lock(&self.routes).drain().map(|(_, local)| local).collect();
        for local in &locals {
            local.fail_pending(&message);
        }
        locals.len()
    }

    fn route(&self, sub: u64) -> Option<Arc<Local>> {
        lock(&self.routes).get(&sub).cloned()
    }

    /// Writes `reply`'s body into the smallest free slab that holds it, making one
    /// if none does (up to [`MAX_SLABS`]); `None` if there is no room, or a slab
    /// cannot be made (logged), and the ranks get the reply through their sockets.
    fn place(&self, reply: &Reply) -> Option<Placed> {
        let mut head = BytesMut::new();
        let tail = encode_reply_body_parts(reply, &mut head);
        let tail = tail.as_deref().unwrap_or_default();
        let len = head.len() + tail.len();
        let mut slabs = lock(&self.slabs);
        let free = slabs
            .iter()
            .enumerate()
            .filter(|(_, s)| s.holders.is_empty() && s.slab.capacity() >= len)
            .min_by_key(|(_, s)| s.slab.capacity())
            .map(|(at, _)| at);
        let at = match free {
            Some(at) => at,
            None if slabs.len() < MAX_SLABS => match Slab::create(len) {
                Ok(slab) => {
                    slabs.push(SlabUse { slab, holders: HashMap::new() });
                    slabs.len() - 1
                }
                Err(error) => {
                    warn!(%error, "cannot make a shared-memory slab; sending large replies through the sockets");
                    return None;
                }
            },
            None => {
                debug!(
                    slabs = slabs.len(),
                    "every shared-memory slab is held; sending a large reply through the sockets"
                );
                return None;
            }
        };
        let used = &mut slabs[at];
        let len = used.slab.write(&head, tail);
        Some(Placed { slab: at as u64, len, file: Arc::clone(&used.slab.file) })
    }

    /// `sub` is given the current contents of `slab`.
    fn hold(&self, slab: u64, sub: u64) {
        if let Some(used) = lock(&self.slabs).get_mut(slab as usize) {
            *used.holders.entry(sub).or_default() += 1;
        }
    }

    /// `sub` released one shared reply from `slab`; with `None`, every one it held
    /// of every slab (its connection ended). A rank can only release its own holds.
    fn release(&self, slab: Option<u64>, sub: u64) {
        let mut slabs = lock(&self.slabs);
        let drop_one = |used: &mut SlabUse| {
            if let Some(count) = used.holders.get_mut(&sub) {
                *count -= 1;
                if *count == 0 {
                    used.holders.remove(&sub);
                }
            }
        };
        match slab {
            Some(slab) => {
                if let Some(used) = slabs.get_mut(slab as usize) {
                    drop_one(used);
                }
            }
            None => {
                for used in slabs.iter_mut() {
                    used.holders.remove(&sub);
                }
            }
        }
    }
}

/// A reply body written into a slab.
struct Placed {
    slab: u64,
    len: u64,
    file: Arc<OwnedFd>,
}

/// Reads the coordinator's frames and fans them out to the local connections;
/// returns why the connection ended.
async fn read_upstream(mut reader: ReadHalf, mut buf: BytesMut, hub: &Hub) -> String {
    let limits = FrameLimits::unbounded();
    loop {
        loop {
            match decode_root_frame(&mut buf, &limits) {
                Ok(None) => break,
                Ok(Some(RootFrame::SubReply { sub, id, reply })) => fan_out(hub, &[(sub, id)], &reply),
                Ok(Some(RootFrame::SubReplies { calls, reply })) => fan_out(hub, &calls, &reply),
                Ok(Some(RootFrame::SubWelcome { sub, welcome })) => {
                    if let Some(local) = hub.route(sub) {
                        local.send(|out| encode_server_frame(&ServerFrame::Welcome(welcome), out));
                    }
                }
                Ok(Some(RootFrame::SubRefused { sub, error })) => {
                    let local = lock(&hub.routes).remove(&sub);
                    if let Some(local) = local {
                        debug!(sub, %error, "the coordinator refused a local rank");
                        local.send(|out| encode_server_frame(&ServerFrame::Refused(error), out));
                        local.end();
                    }
                }
                Ok(Some(frame @ (RootFrame::Welcome { .. } | RootFrame::Refused(_)))) => {
                    return format!("the coordinator at {} sent {frame:?} on an open agent connection", hub.addr);
                }
                Err(ProtoError::BadSubFrame { sub: Some(sub), id: Some(id), message }) => {
                    // The call must not wait forever for a reply that will not come.
                    warn!(sub, id, %message, "malformed reply from the coordinator");
                    if let Some(local) = hub.route(sub) {
                        let error = Err(OpError::Invalid(format!("malformed reply from the coordinator: {message}")));
                        local.reply(id, |out| encode_reply(id, &error, out));
                    }
                }
                Err(ProtoError::BadSubCalls { calls, message }) => {
                    warn!(calls = calls.len(), %message, "malformed replies from the coordinator");
                    let error = Err(OpError::Invalid(format!("malformed reply from the coordinator: {message}")));
                    for (sub, id) in calls {
                        if let Some(local) = hub.route(sub) {
                            local.reply(id, |out| encode_reply(id, &error, out));
                        }
                    }
                }
                Err(error) if !error.is_fatal() => warn!(%error, "skipped a malformed frame from the coordinator"),
                Err(error) => return format!("malformed data from the coordinator at {}: {error}", hub.addr),
            }
        }
        if buf.is_empty() && buf.capacity() > KEEP_CAPACITY {
            buf = BytesMut::new();
        }
        buf.reserve(UPSTREAM_READ_CHUNK);
        match reader.read_buf(&mut buf).await {
            Ok(0) => return format!("the coordinator at {} closed the connection", hub.addr),
            Ok(_) => {}
            Err(error) => return format!("the connection to the coordinator at {} failed: {error}", hub.addr),
        }
    }
}

/// Hands one reply from the coordinator to each of the calls `(sub, id)`. A large
/// one (an all-gather result) is written once into a shared-memory slab for the
/// ranks that take shared replies (docs/PROTOCOL.md, section 13), and goes to the
/// others as bytes on their socket.
fn fan_out(hub: &Hub, calls: &[(u64, u64)], reply: &Reply) {
    let large = reply_payload_len(reply) >= SHARED_REPLY_MIN;
    let mut placed: Option<Option<Placed>> = None;
    for &(sub, id) in calls {
        let Some(local) = hub.route(sub) else { continue };
        if large && local.takes_shared.load(Ordering::Relaxed) {
            if let Some(placed) = placed.get_or_insert_with(|| hub.place(reply)) {
                hub.hold(placed.slab, sub);
                local.reply_shared(id, placed);
                continue;
            }
        }
        local.reply(id, |out| encode_reply(id, reply, out));
    }
}

/// Writes what the local ranks sent, everything gathered since the last write in
/// one write; returns why it stopped.
async fn write_upstream(mut writer: WriteHalf, hub: &Hub) -> String {
    let mut batch = BytesMut::new();
    loop {
        hub.up_ready.notified().await;
        loop {
            let (calls, merged) = {
                let mut up = lock(&hub.up);
                let calls: usize = up.merged.iter().map(|m| m.calls.len()).sum();
                let merged = up.merged.len();
                up.seal();
                std::mem::swap(&mut up.buf, &mut batch);
                (calls, merged)
            };
            if batch.is_empty() {
                break;
            }
            trace!(bytes = batch.len(), barrier_calls = calls, barrier_frames = merged, "writing to the coordinator");
            if let Err(error) = writer.write_all(&batch).await {
                return format!("writing to the coordinator at {} failed: {error}", hub.addr);
            }
            batch.clear();
            if batch.capacity() > KEEP_CAPACITY {
                batch = BytesMut::new();
            }
        }
    }
}

/// One local rank's connection, shared by its task (which reads it) and the
/// upstream reader (which writes replies to it).
struct Local {
    writer: WriteHalf,
    out: Mutex<LocalOut>,
    /// Wakes the local task: bytes the socket did not take at once, or the end.
    wake: Notify,
    /// The rank asked for large replies as shared memory (it is on a Unix socket).
    takes_shared: AtomicBool,
}

#[derive(Default)]
struct LocalOut {
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
    /// The local task is writing `buf`: append, do not write around it.
    writing: bool,
    /// Ids of the rank's requests forwarded and not yet answered.
    pending: Vec<u64>,
    /// Close the connection once `buf` is written.
    end: bool,
}

impl Local {
    /// Queues bytes for the rank and writes them at once if the socket takes them.
    fn send(&self, encode: impl FnOnce(&mut BytesMut)) {
        let mut out = lock(&self.out);
        encode(&mut out.buf);
        self.push(&mut out);
    }

    /// A reply to request `id`, which is no longer pending.
    fn reply(&self, id: u64, encode: impl FnOnce(&mut BytesMut)) {
        let mut out = lock(&self.out);
        if let Some(at) = out.pending.iter().position(|&p| p == id) {
            out.pending.swap_remove(at);
        }
        encode(&mut out.buf);
        self.push(&mut out);
    }

    /// A reply to request `id` whose body is in a slab; the slab's file goes with
    /// the first such reply to this rank.
    fn reply_shared(&self, id: u64, placed: &Placed) {
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
    fn end(&self) {
        lock(&self.out).end = true;
        self.wake.notify_one();
    }

    /// Answers every waiting call with `Closed(message)` and ends the connection.
    fn fail_pending(&self, message: &str) {
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
    async fn drain(&self) -> io::Result<bool> {
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
                    if out.buf.capacity() > KEEP_CAPACITY {
                        out.buf = BytesMut::new();
                    }
                    return Ok(out.end);
                }
            }
            self.writer.writable().await?;
        }
    }
}

/// Serves one local rank connection until it closes, then reports that upstream.
async fn serve_local(stream: Stream, hub: Arc<Hub>) {
    let (mut reader, writer) = stream.into_split();
    let local = Arc::new(Local {
        writer,
        out: Mutex::new(LocalOut::default()),
        wake: Notify::new(),
        takes_shared: AtomicBool::new(false),
    });
    let mut rbuf = BytesMut::new();
    let identity = match tokio::time::timeout(HANDSHAKE_TIMEOUT, local_hello(&mut reader, &mut rbuf, &hub)).await {
        Ok(Ok(identity)) => identity,
        Ok(Err(refusal)) => {
            if let Some(error) = refusal {
                local.send(|out| encode_server_frame(&ServerFrame::Refused(error), out));
                let _ = local.drain().await;
            }
            return;
        }
        Err(_) => {
            warn!("no hello from a local rank within {HANDSHAKE_TIMEOUT:?}; closing its connection");
            return;
        }
    };
    let sub = hub.next_sub.fetch_add(1, Ordering::Relaxed);
    debug!(sub, job = %identity.job, rank = ?identity.rank, host = %identity.host, pid = identity.pid, "local rank connected");
    // Routed before its hello goes up: a reply can only follow the hello, and a
    // `Hub::lose` after the hello went up finds the route.
    lock(&hub.routes).insert(sub, Arc::clone(&local));
    if !hub.send_up(sub, |up| encode_agent_frame(&AgentFrame::SubHello { sub, identity }, up)) {
        lock(&hub.routes).remove(&sub);
        let why = hub.lost_reason().unwrap_or_default();
        local.send(|out| encode_server_frame(&ServerFrame::Refused(OpError::Closed(why)), out));
        let _ = local.drain().await;
        return;
    }

    let ended = serve_local_session(sub, &mut reader, rbuf, &hub, &local).await;
    debug!(sub, how = %ended, "local rank connection ended");
    // Whatever it held of the slabs is free again.
    hub.release(None, sub);
    // Still routed: the rank's connection ended on its side (or failed), not ours.
    if lock(&hub.routes).remove(&sub).is_some() {
        hub.send_up(sub, |up| encode_agent_frame(&AgentFrame::SubClose { sub }, up));
    }
}

/// Reads the preamble and hello. `Err(Some(error))`: refuse with it; `Err(None)`:
/// just close (already logged).
async fn local_hello(
    reader: &mut ReadHalf,
    rbuf: &mut BytesMut,
    hub: &Hub,
) -> Result<rallypoint_core::Identity, Option<OpError>> {
    loop {
        match rbuf.first() {
            None => {}
            Some(b'R') => match decode_preamble(rbuf) {
                Ok(None) => {}
                Ok(Some(VERSION)) => break,
                Ok(Some(version)) => {
                    warn!(version, "local rank speaks an unsupported protocol version");
                    let message =
                        format!("protocol version {version} is not supported; this node agent speaks {VERSION}");
                    return Err(Some(OpError::Invalid(message)));
                }
                Err(error) => {
                    warn!(%error, "bad preamble from a local connection");
                    return Err(None);
                }
            },
            Some(&byte) => {
                // 0x00 is a PyTorch TCPStore client: those connect to the coordinator itself.
                warn!(first_byte = byte, "not a rallypoint native client (TCPStore clients must connect to the coordinator directly); closing");
                return Err(None);
            }
        }
        if !read_more(reader, rbuf).await {
            return Err(None);
        }
    }
    loop {
        match decode_client_frame(rbuf, &hub.limits) {
            Ok(Some(ClientFrame::Hello(identity))) => return Ok(identity),
            Ok(Some(
                ClientFrame::Request { .. } | ClientFrame::TakeSharedReplies | ClientFrame::ReleaseShared { .. },
            )) => {
                return Err(Some(OpError::Invalid("the first frame must be a hello".to_owned())));
            }
            Ok(None) => {
                if !read_more(reader, rbuf).await {
                    return Err(None);
                }
            }
            Err(error) if error.is_fatal() => return Err(None),
            Err(error) => return Err(Some(OpError::Invalid(error.to_string()))),
        }
    }
}

/// Reads once into `rbuf`; false at end of stream or on error.
async fn read_more(reader: &mut ReadHalf, rbuf: &mut BytesMut) -> bool {
    rbuf.reserve(READ_CHUNK);
    matches!(reader.read_buf(rbuf).await, Ok(n) if n > 0)
}

/// Forwards the rank's requests and writes what the upstream reader could not;
/// returns how the connection ended, for the log.
async fn serve_local_session(sub: u64, reader: &mut ReadHalf, mut rbuf: BytesMut, hub: &Hub, local: &Local) -> String {
    // The hello may have arrived together with the first requests.
    if let Err(end) = forward(sub, &mut rbuf, hub, local) {
        return end;
    }
    loop {
        if rbuf.is_empty() {
            rbuf = BytesMut::new();
        }
        tokio::select! {
            biased;
            () = local.wake.notified() => match local.drain().await {
                Ok(true) => return "closed by the agent".to_owned(),
                Ok(false) => {}
                Err(error) => return format!("write failed: {error}"),
            },
            read = std::future::poll_fn(|cx| poll_read_some(reader, &mut rbuf, cx)) => match read {
                Ok(0) => return "closed by the rank".to_owned(),
                Ok(_) => {
                    if let Err(end) = forward(sub, &mut rbuf, hub, local) {
                        return end;
                    }
                }
                Err(error) => return format!("read failed: {error}"),
            },
        }
    }
}

/// Reads what the socket has; see the server's connection for why through `poll_read`.
fn poll_read_some(reader: &mut ReadHalf, rbuf: &mut BytesMut, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
    if !rbuf.is_empty() {
        rbuf.reserve(READ_CHUNK.max(rbuf.len()));
        return pin!(reader.read_buf(rbuf)).poll(cx);
    }
    let mut chunk = [0u8; READ_CHUNK];
    let mut filled = ReadBuf::new(&mut chunk);
    ready!(Pin::new(reader).poll_read(cx, &mut filled))?;
    rbuf.extend_from_slice(filled.filled());
    Poll::Ready(Ok(filled.filled().len()))
}

/// Sends every whole request buffered upstream as sub-session requests, in one
/// append. Malformed requests are answered here exactly as the coordinator would.
fn forward(sub: u64, rbuf: &mut BytesMut, hub: &Hub, local: &Local) -> Result<(), String> {
    let mut requests = Vec::new();
    let mut result = Ok(());
    loop {
        match decode_client_frame(rbuf, &hub.limits) {
            Ok(None) => break,
            Ok(Some(ClientFrame::Request { id, request })) => requests.push((id, request)),
            Ok(Some(ClientFrame::TakeSharedReplies)) => {
                // Files only pass over Unix sockets; over TCP the rank gets plain replies.
                if local.writer.is_unix() {
                    local.takes_shared.store(true, Ordering::Relaxed);
                }
            }
            Ok(Some(ClientFrame::ReleaseShared { slab })) => hub.release(Some(slab), sub),
            Ok(Some(ClientFrame::Hello(_))) => {
                warn!(sub, "a second hello from a local rank; closing its connection");
                result = Err("a second hello".to_owned());
                break;
            }
            Err(error) if error.is_fatal() => {
                warn!(sub, %error, "malformed input from a local rank; closing its connection");
                result = Err(format!("malformed input: {error}"));
                break;
            }
            Err(error) => {
                warn!(sub, %error, "bad request from a local rank");
                if let ProtoError::BadRequest { id: Some(id), message } = error {
                    local.send(|out| encode_reply(id, &Err(OpError::Invalid(message)), out));
                }
            }
        }
    }
    if !requests.is_empty() {
        lock(&local.out).pending.extend(requests.iter().map(|(id, _)| *id));
        if !hub.send_requests(sub, requests) {
            // Lost meanwhile: `Hub::lose` may have run before these became pending.
            if let Some(why) = hub.lost_reason() {
                local.fail_pending(&why);
            }
        }
    }
    result
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use rallypoint_core::{Members, Response};
    use rallypoint_proto::native::{decode_agent_frame, decode_server_frame, decode_shared_reply};

    use super::*;
    use rallypoint_net::shm::{held_body, map_slab};

    fn barrier(name: &str) -> Request {
        Request::Barrier { name: name.to_owned(), members: Members::World, timeout_ms: Some(1000) }
    }

    fn sealed(up: &mut Up) -> Vec<AgentFrame> {
        up.seal();
        let mut frames = Vec::new();
        while let Some(frame) = decode_agent_frame(&mut up.buf, &FrameLimits::unbounded()).expect("well-formed") {
            frames.push(frame);
        }
        frames
    }

    #[test]
    fn identical_barrier_calls_go_up_as_one_frame_and_a_lone_call_as_it_was() {
        let mut up = Up::default();
        up.merge(1, 10, barrier("a"));
        up.merge(2, 20, barrier("a"));
        up.merge(3, 30, barrier("b"));
        up.merge(4, 40, barrier("a"));
        assert_eq!(
            sealed(&mut up),
            [
                AgentFrame::SubRequests { calls: vec![(1, 10), (2, 20), (4, 40)], request: barrier("a") },
                AgentFrame::SubRequest { sub: 3, id: 30, request: barrier("b") },
            ]
        );
        assert!(up.is_idle() && up.in_merged.is_empty());
    }

    #[test]
    fn a_later_frame_of_a_merged_rank_never_overtakes_its_call() {
        let mut up = Up::default();
        up.merge(1, 10, barrier("a"));
        up.merge(2, 20, barrier("a"));
        // Another rank's frame may pass the held-back calls...
        up.order_before(3);
        encode_agent_frame(&AgentFrame::SubClose { sub: 3 }, &mut up.buf);
        // ...but rank 1's next frame goes after its call, and so does its next barrier.
        up.order_before(1);
        encode_agent_frame(&AgentFrame::SubClose { sub: 1 }, &mut up.buf);
        up.merge(2, 21, barrier("a"));
        assert_eq!(
            sealed(&mut up),
            [
                AgentFrame::SubClose { sub: 3 },
                AgentFrame::SubRequests { calls: vec![(1, 10), (2, 20)], request: barrier("a") },
                AgentFrame::SubClose { sub: 1 },
                AgentFrame::SubRequest { sub: 2, id: 21, request: barrier("a") },
            ]
        );
    }

    #[test]
    fn merged_calls_are_bounded_per_frame_and_in_kinds() {
        let mut up = Up::default();
        let n = MAX_CALLS_PER_FRAME as u64 + 1;
        for sub in 0..n {
            up.merge(sub, 1, barrier("a"));
        }
        let frames = sealed(&mut up);
        assert!(
            matches!(&frames[..], [AgentFrame::SubRequests { calls, .. }, AgentFrame::SubRequest { sub, .. }]
                if calls.len() == MAX_CALLS_PER_FRAME && *sub == n - 1),
            "{} frames",
            frames.len()
        );
        for sub in 0..=MAX_MERGED as u64 {
            up.merge(sub, 1, barrier(&format!("b{sub}")));
        }
        // The ninth distinct call sealed the first eight.
        assert_eq!(up.merged.len(), 1);
        assert!(!up.buf.is_empty());
    }

    #[tokio::test]
    async fn slab_files_pass_once_each_in_order_even_more_than_one_write_carries() {
        let (ours, theirs) = tokio::net::UnixStream::pair().expect("socket pair");
        let (_unread, writer) = Stream::Unix(ours).into_split();
        let local = Local {
            writer,
            out: Mutex::new(LocalOut::default()),
            wake: Notify::new(),
            takes_shared: AtomicBool::new(true),
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
            let (mut reader, _writer) = Stream::Unix(theirs).into_split();
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
