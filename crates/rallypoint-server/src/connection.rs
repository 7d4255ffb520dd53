//! One client connection: protocol preamble, hello, then requests in and replies
//! out. One task per native connection; while idle it holds no read or write buffer.
//! TCPStore connections are recognised here and handed to the TCPStore reactor.

use std::future::Future;
use std::io;
use std::mem::MaybeUninit;
use std::net::SocketAddr;
use std::pin::{pin, Pin};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::BytesMut;
use rallypoint_core::{Identity, OpError, Reply, SessionId};
use rallypoint_proto::native::{
    decode_client_frame, decode_preamble, encode_reply, encode_reply_shared, encode_server_frame,
    starts_with_agent_hello, ClientFrame, FrameLimits, ProtoError, ServerFrame, VERSION,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tracing::{debug, warn};

use crate::reactor::Reactor;
use crate::shared::{Outbox, Shared};
use crate::{write_with_tail, WriteProgress};

/// Most bytes taken from the socket per read; larger frames grow the buffer as they arrive.
const READ_CHUNK: usize = 4096;
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
    limits: FrameLimits,
    reactor: Arc<Reactor>,
) -> impl Future<Output = ()> + Send {
    let opening = Box::pin(open(stream, peer, shared, limits, reactor));
    async move {
        let Some(mut session) = opening.await else { return };
        let Session { conn, outbox, guard } = &mut session;
        let end = conn.run(guard.session, &guard.shared, outbox).await;
        session.log_end(end);
    }
}

/// Handshake and admission. `None`: the connection is done here (refused, closed,
/// served to its end as a node agent, or handed to the TCPStore reactor).
async fn open(
    stream: TcpStream,
    peer: SocketAddr,
    shared: Arc<Shared>,
    limits: FrameLimits,
    reactor: Arc<Reactor>,
) -> Option<Session> {
    let mut conn = Connection { stream, peer, limits, rbuf: BytesMut::new(), wbuf: BytesMut::new() };
    let identity = match tokio::time::timeout(HANDSHAKE_TIMEOUT, conn.handshake()).await {
        Ok(Ok(Some(Hello::Native(identity)))) => identity,
        Ok(Ok(Some(Hello::Agent))) => {
            Box::pin(crate::agent_link::serve(conn.stream, peer, conn.rbuf, shared, limits)).await;
            return None;
        }
        Ok(Ok(Some(Hello::TcpStore))) => {
            debug!(%peer, "PyTorch TCPStore client");
            if let Err(error) = reactor.adopt(conn.stream, peer, conn.rbuf) {
                debug!(%peer, %error, "cannot serve a TCPStore client; closing the connection");
            }
            return None;
        }
        Ok(Ok(None)) => return None,
        Ok(Err(error)) => {
            debug!(%peer, %error, "connection failed during the handshake");
            return None;
        }
        Err(_) => {
            warn!(%peer, "no hello within {HANDSHAKE_TIMEOUT:?}; closing the connection");
            return None;
        }
    };
    let outbox = Arc::new(Outbox::default());
    let welcome = match shared.open(identity.clone(), Arc::clone(&outbox)) {
        Ok(welcome) => welcome,
        Err(error) => {
            warn!(%peer, job = %identity.job, rank = ?identity.rank, %error, "refused a client");
            conn.refuse(error).await;
            return None;
        }
    };
    let id = welcome.session;
    debug!(%peer, session = %id, job = %identity.job, rank = ?identity.rank, host = %identity.host, pid = identity.pid, "session opened");
    encode_server_frame(&ServerFrame::Welcome(welcome), &mut conn.wbuf);
    Some(Session { conn, outbox, guard: SessionGuard::new(shared, id) })
}

/// An admitted native session: its connection, its outbox, and the guard that
/// closes it in the engine when the task ends.
struct Session {
    conn: Connection,
    outbox: Arc<Outbox>,
    guard: SessionGuard,
}

impl Session {
    fn log_end(&self, end: Result<(), End>) {
        let (peer, session) = (self.conn.peer, self.guard.session);
        match end {
            Ok(()) => debug!(%peer, %session, "session closed by the peer"),
            Err(End::Io(error)) => debug!(%peer, %session, %error, "session connection failed"),
            Err(End::Malformed(error)) => warn!(%peer, %session, %error, "malformed input; closing the connection"),
            Err(End::SecondHello) => {
                warn!(%peer, %session, "a second hello on an open session; closing the connection")
            }
        }
    }
}

/// What a new connection turned out to be.
enum Hello {
    Native(Identity),
    /// A PyTorch TCPStore client: its first byte (VALIDATE) is still in the read buffer.
    TcpStore,
    /// A node agent (docs/PROTOCOL.md, section 12): its agent hello is still in the read buffer.
    Agent,
}

/// Why a session's connection ended (other than the peer closing it).
enum End {
    Io(io::Error),
    Malformed(Box<ProtoError>),
    SecondHello,
}

impl From<io::Error> for End {
    fn from(error: io::Error) -> Self {
        End::Io(error)
    }
}

/// Tells the engine when the session ends, however the connection ends (error,
/// peer close, server shutdown cancelling the task).
pub(crate) struct SessionGuard {
    pub(crate) shared: Arc<Shared>,
    pub(crate) session: SessionId,
    /// The engine panicked: do not call it again on drop.
    abandoned: bool,
}

impl SessionGuard {
    pub(crate) fn new(shared: Arc<Shared>, session: SessionId) -> SessionGuard {
        SessionGuard { shared, session, abandoned: false }
    }

    /// Drops the session's outbox without telling the engine (see [`Shared::forget`]).
    pub(crate) fn forget(mut self) {
        self.abandoned = true;
    }
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        if self.abandoned || std::thread::panicking() {
            // The engine may be what panicked; calling it again would abort the process.
            self.shared.forget(self.session);
        } else {
            self.shared.close(self.session);
        }
    }
}

struct Connection {
    stream: TcpStream,
    peer: SocketAddr,
    limits: FrameLimits,
    rbuf: BytesMut,
    wbuf: BytesMut,
}

impl Connection {
    /// Reads the preamble and the hello, or recognises a TCPStore client by its first
    /// byte. `Ok(None)`: the peer is not (or no longer) a client we can serve; already
    /// logged, and the connection is done.
    async fn handshake(&mut self) -> io::Result<Option<Hello>> {
        let peer = self.peer;
        // The first byte tells the protocol apart: 'R' starts the native magic,
        // 0x00 is the first byte of every PyTorch TCPStore connection.
        loop {
            match self.rbuf.first() {
                None => {}
                Some(b'R') => match decode_preamble(&mut self.rbuf) {
                    Ok(None) => {}
                    Ok(Some(VERSION)) => break,
                    Ok(Some(version)) => {
                        warn!(%peer, version, "client speaks an unsupported protocol version; closing");
                        let message =
                            format!("protocol version {version} is not supported; this coordinator speaks {VERSION}");
                        self.refuse(OpError::Invalid(message)).await;
                        return Ok(None);
                    }
                    Err(error) => {
                        warn!(%peer, %error, "bad preamble; closing");
                        return Ok(None);
                    }
                },
                Some(0x00) => return Ok(Some(Hello::TcpStore)),
                Some(&byte) => {
                    warn!(%peer, first_byte = byte, "unknown protocol (not a rallypoint client); closing");
                    return Ok(None);
                }
            }
            if !self.read_more().await? {
                debug!(%peer, "closed before the preamble");
                return Ok(None);
            }
        }
        loop {
            if starts_with_agent_hello(&self.rbuf) == Some(true) {
                return Ok(Some(Hello::Agent));
            }
            match decode_client_frame(&mut self.rbuf, &self.limits) {
                Ok(Some(ClientFrame::Hello(identity))) => return Ok(Some(Hello::Native(identity))),
                Ok(Some(
                    frame @ (ClientFrame::Request { .. }
                    | ClientFrame::TakeSharedReplies
                    | ClientFrame::ReleaseShared { .. }),
                )) => {
                    let what = match &frame {
                        ClientFrame::Request { request, .. } => request.name(),
                        _ => "a shared-reply frame",
                    };
                    warn!(%peer, frame = what, "a frame before the hello; closing");
                    self.refuse(OpError::Invalid("the first frame must be a hello".to_owned())).await;
                    return Ok(None);
                }
                Ok(None) => {
                    if !self.read_more().await? {
                        debug!(%peer, "closed before the hello");
                        return Ok(None);
                    }
                }
                Err(error) => {
                    warn!(%peer, %error, "bad hello; closing");
                    if !error.is_fatal() {
                        self.refuse(OpError::Invalid(error.to_string())).await;
                    }
                    return Ok(None);
                }
            }
        }
    }

    /// Sends `Refused` and closes; errors are moot since we close either way.
    async fn refuse(&mut self, error: OpError) {
        self.wbuf.clear();
        encode_server_frame(&ServerFrame::Refused(error), &mut self.wbuf);
        if self.stream.write_all(&self.wbuf).await.is_ok() {
            let _ = self.stream.shutdown().await;
        }
    }

    /// Reads once into the read buffer; false at end of stream.
    async fn read_more(&mut self) -> io::Result<bool> {
        self.rbuf.reserve(READ_CHUNK);
        Ok(self.stream.read_buf(&mut self.rbuf).await? != 0)
    }

    /// Serves the open session until the peer closes (`Ok`) or something fails.
    async fn run(&mut self, session: SessionId, shared: &Shared, outbox: &Outbox) -> Result<(), End> {
        // Replies to this session's requests that were ready at once; moved into
        // each flush, so that an idle connection holds no allocation for them.
        let mut immediate = Vec::new();
        // The hello may have arrived together with the first requests.
        let mut broken = self.process(session, shared, &mut immediate).err();
        loop {
            // Replies to the requests before a broken frame still go out, so the peer
            // learns all it can before the connection closes.
            // Boxed: a flush's state (iterators, a shared tail, the vectored write) is
            // larger than the idle wait's, and would otherwise sit in every idle task.
            Box::pin(self.flush(std::mem::take(&mut immediate).into_iter().chain(outbox.take()), session, shared))
                .await?;
            if let Some(end) = broken.take() {
                return Err(end);
            }
            // Idle connections keep no read buffer (bytes of a partial frame stay)
            // and no write buffer (flush leaves it empty).
            if self.rbuf.is_empty() {
                self.rbuf = BytesMut::new();
            }
            self.wbuf = BytesMut::new();
            tokio::select! {
                // Replies first: they free waiting peers, and reading more only adds work.
                biased;
                () = outbox.ready.wait() => {}
                read = std::future::poll_fn(|cx| poll_read_some(&mut self.stream, &mut self.rbuf, cx)) => {
                    match read {
                        Ok(0) => {
                            if !self.rbuf.is_empty() {
                                debug!(peer = %self.peer, %session, buffered = self.rbuf.len(), "closed in the middle of a frame");
                            }
                            return Ok(());
                        }
                        Ok(_) => broken = self.process(session, shared, &mut immediate).err(),
                        Err(error) => return Err(error.into()),
                    }
                }
            }
        }
    }

    /// Decodes every whole frame buffered and feeds the requests to the engine under
    /// one lock; replies ready at once go to `immediate`. Bad requests get an
    /// `Invalid` reply; a broken stream ends the session (after the requests before
    /// it are handled).
    fn process(&mut self, session: SessionId, shared: &Shared, immediate: &mut Vec<(u64, Reply)>) -> Result<(), End> {
        let mut requests = Vec::new();
        let mut result = Ok(());
        loop {
            match decode_client_frame(&mut self.rbuf, &self.limits) {
                Ok(None) => break,
                Ok(Some(ClientFrame::Request { id, request })) => requests.push((id, request)),
                // Only node agents hand out shared replies: they serve the Unix sockets
                // of their node, the coordinator only TCP. Replies stay plain frames.
                Ok(Some(ClientFrame::TakeSharedReplies | ClientFrame::ReleaseShared { .. })) => {}
                Ok(Some(ClientFrame::Hello(_))) => {
                    result = Err(End::SecondHello);
                    break;
                }
                Err(error) if error.is_fatal() => {
                    result = Err(End::Malformed(Box::new(error)));
                    break;
                }
                Err(error) => {
                    warn!(peer = %self.peer, %session, %error, "bad request");
                    if let ProtoError::BadRequest { id: Some(id), message } = error {
                        encode_reply(id, &Err(OpError::Invalid(message)), &mut self.wbuf);
                    }
                }
            }
        }
        if !requests.is_empty() {
            shared.handle(session, requests.into_iter(), &mut |id, reply| immediate.push((id, reply)));
        }
        result
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

/// Reads what the socket has (up to [`READ_CHUNK`]) into `rbuf`.
///
/// Through `poll_read`, which learns from a short read that the socket is drained;
/// `try_read` would spend a second, empty `recv` per request to learn that.
/// Reads land on the stack first and are appended to the read buffer, so a
/// buffer starting empty is allocated at exactly the size received. Decoded
/// keys and values share that allocation (the codecs do not copy them): a small
/// `set` must not pin a whole read chunk, and a request must not cost a 4 KiB
/// allocation. The stack chunk lives only within one poll, so it does not enlarge
/// an idle connection's task. The rest of a frame already started is read straight
/// into the buffer, which grows geometrically so that a large value takes few reads.
fn poll_read_some(stream: &mut TcpStream, rbuf: &mut BytesMut, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
    if !rbuf.is_empty() {
        rbuf.reserve(READ_CHUNK.max(rbuf.len()));
        return pin!(stream.read_buf(rbuf)).poll(cx);
    }
    // Not zeroed: only what the read fills is looked at.
    let mut chunk = [MaybeUninit::<u8>::uninit(); READ_CHUNK];
    let mut filled = ReadBuf::uninit(&mut chunk);
    ready!(Pin::new(stream).poll_read(cx, &mut filled))?;
    rbuf.extend_from_slice(filled.filled());
    Poll::Ready(Ok(filled.filled().len()))
}
