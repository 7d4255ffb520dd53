//! What every native-protocol connection goes through, on whichever side: the
//! coordinator serving a rank or a node agent, a node agent serving a rank of its
//! node, a client or an agent greeting its coordinator.
//!
//! - reading: [`read_some`] takes what a socket has into a [`BytesMut`] sized by a
//!   [`Buffering`], which also says when an idle buffer is given back;
//! - the handshake: [`accept_hello`] on the serving side (the preamble, the token
//!   handshake if the [`Gate`] asks for it, then a rank's hello, or a TCPStore
//!   client or node agent told apart by their first bytes), [`greet`] on the
//!   connecting side (TLS and the token handshake if its [`Credentials`] ask for
//!   them, then the hello);
//! - the frame loop: [`decode_requests`] turns the frames a rank sent into
//!   [`Inbound`] inputs, answering nothing itself;
//! - the end: [`End`], how and why a connection stopped, for the log and for
//!   the callers still waiting on it.

use std::future::Future;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::AsFd;
use std::pin::{pin, Pin};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::{BufMut, BytesMut};
use rallypoint_core::{AuthRefusal, Identity, OpError, Request};
use rallypoint_proto::native::{
    decode_client_frame, decode_preamble, decode_server_frame, encode_client_frame, encode_preamble,
    encode_server_frame, starts_with_agent_hello, ClientFrame, FrameLimits, ProtoError, ServerFrame, VERSION,
};
use rustix::net::RecvFlags;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

use crate::auth::{self, Token};
use crate::budget::Charge;
use crate::tls::{tls_failure, TlsClient, TLS_FIRST_BYTE};
use crate::Stream;

/// How a connection ended, or why it was refused.
#[derive(Debug, thiserror::Error)]
pub enum End {
    /// The peer closed the connection between frames.
    #[error("closed by the peer")]
    Closed,
    /// The peer closed the connection with part of a frame sent.
    #[error("closed by the peer in the middle of a frame ({buffered} bytes of it received)")]
    ClosedMidFrame { buffered: usize },
    #[error("{0}")]
    Io(#[from] io::Error),
    /// The peer stopped sending in the middle of a frame for longer than the read
    /// timeout (a hung or hostile peer holding a partial frame in our memory).
    #[error("stopped sending in the middle of a frame ({buffered} bytes of it received, nothing for {waited:?})")]
    Stalled { buffered: usize, waited: Duration },
    /// The connection held the most bytes of unfinished requests when all together
    /// went past the budget ([`crate::budget`]).
    #[error("closed to keep within the memory budget of unfinished requests: {0}")]
    OverBudget(#[from] crate::budget::OverBudget),
    /// Another connection went past the budget while this one held the most.
    #[error("closed to keep within the memory budget of unfinished requests: it held the most")]
    Evicted,
    /// The TLS handshake failed (a client that does not trust our certificate, or
    /// that spoke something else after a first byte of 0x16).
    #[error("TLS handshake failed: {0}")]
    Tls(io::Error),
    /// The peer connected but did not finish its handshake in time.
    #[error("no hello within {0:?}")]
    HandshakeTimeout(Duration),
    /// The first bytes are no protocol this side serves.
    #[error("not a client this side serves: {0}")]
    NotServed(&'static str),
    /// The peer's handshake was refused; the error goes back to it before the close.
    /// (Large variants are boxed: an `End` may be held in a waiting connection's state.)
    #[error("refused: {0}")]
    Refused(Box<OpError>),
    /// Bytes that cannot be framed (a bad magic, an over-long frame): nothing after
    /// them can be trusted.
    #[error("malformed input: {0}")]
    Malformed(Box<ProtoError>),
    #[error("a second hello on an open session")]
    SecondHello,
    /// A node agent opened a sub-session whose id it already uses.
    #[error("sub-session {sub} said hello twice")]
    DuplicateSubSession { sub: u64 },
    /// This side closed it: it is shutting down, or lost what the connection needed.
    #[error("closed by this side: {0}")]
    Shutdown(String),
}

impl End {
    pub fn refused(error: OpError) -> End {
        End::Refused(Box::new(error))
    }

    pub fn malformed(error: ProtoError) -> End {
        End::Malformed(Box::new(error))
    }

    /// Whether the end says something is wrong with the peer (worth a warning),
    /// rather than being how connections ordinarily end.
    pub fn is_peer_fault(&self) -> bool {
        match self {
            End::Closed | End::ClosedMidFrame { .. } | End::Io(_) | End::Shutdown(_) => false,
            End::HandshakeTimeout(_)
            | End::Tls(_)
            | End::Stalled { .. }
            | End::OverBudget(_)
            | End::Evicted
            | End::NotServed(_)
            | End::Refused(_)
            | End::Malformed(_)
            | End::SecondHello
            | End::DuplicateSubSession { .. } => true,
        }
    }
}

/// What a new connection turned out to be.
#[derive(Debug)]
pub enum Hello {
    /// A rank (or any native client) with its identity.
    Native(Identity),
    /// A PyTorch TCPStore client: its first byte (VALIDATE) is still in the read buffer.
    TcpStore,
    /// A node agent (docs/PROTOCOL.md, section 12): its agent hello is still in the read buffer.
    Agent,
}

/// Which kinds of peer the serving side takes besides native clients.
#[derive(Debug, Clone, Copy)]
pub struct Accepts {
    pub tcpstore: bool,
    pub agents: bool,
}

impl Accepts {
    /// The coordinator serves every kind.
    pub const COORDINATOR: Accepts = Accepts { tcpstore: true, agents: true };
    /// A node agent serves only its node's native clients.
    pub const NODE_AGENT: Accepts = Accepts { tcpstore: false, agents: false };
}

/// What the serving side asks of a connection before its hello counts.
#[derive(Debug, Clone, Default)]
pub struct Gate {
    /// The peer must prove this token, and is given this side's proof in return
    /// (docs/PROTOCOL.md, section 5.1).
    pub token: Option<Arc<Token>>,
    /// Native clients and node agents must come over TLS: a plaintext one is
    /// refused. (The connection being served is plaintext; over TLS this is false.)
    pub tls_required: bool,
}

/// Reads a new connection's preamble, the token handshake if `gate` asks for one,
/// and the hello (or recognises a TCPStore client or a node agent by its first
/// bytes). The bytes after the hello stay in `rbuf`. Writes only the token
/// handshake's frames.
///
/// `Err(End::Refused(error))`: the peer should be told `error` (a Refused frame)
/// before the connection closes; every other `Err` just closes it. A refused
/// connection leaves nothing behind: its state lives in this future.
///
/// What the peer sent so far counts against `charge` (see [`crate::budget`]).
pub async fn accept_hello<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    rbuf: &mut BytesMut,
    limits: &FrameLimits,
    accepts: Accepts,
    gate: &Gate,
    charge: &mut Charge,
) -> Result<Hello, End> {
    // The first byte tells the protocol apart: 'R' starts the native magic, 0x00 is
    // the first byte of every PyTorch TCPStore connection, 0x16 of every TLS one
    // (those are taken before this, where this side serves TLS: see `peek_first_byte`).
    loop {
        match rbuf.first() {
            None => {}
            Some(b'R') => match decode_preamble(rbuf) {
                Ok(None) => {}
                Ok(Some(VERSION)) => break,
                Ok(Some(version)) => {
                    let message = format!("protocol version {version} is not supported; this side speaks {VERSION}");
                    return Err(End::refused(OpError::Invalid(message)));
                }
                Err(error) => return Err(End::malformed(error)),
            },
            Some(0x00) if accepts.tcpstore => return Ok(Hello::TcpStore),
            Some(0x00) => {
                return Err(End::NotServed("a PyTorch TCPStore client (those connect to the coordinator itself)"));
            }
            Some(&TLS_FIRST_BYTE) => {
                // A fatal alert, so that the client's TLS handshake fails at once with a
                // reason instead of retrying a connection that closes without a word.
                let _ = stream.write_all(&crate::tls::HANDSHAKE_FAILURE_ALERT).await;
                return Err(End::NotServed(
                    "a TLS client, but this side has no certificate (--tls-cert and --tls-key)",
                ));
            }
            Some(_) => return Err(End::NotServed("unknown protocol (not a rallypoint client)")),
        }
        read_more(stream, rbuf, charge).await?;
    }
    if gate.tls_required {
        return Err(End::refused(OpError::Unauthorized(AuthRefusal::TlsRequired)));
    }
    let mut first = next_frame(stream, rbuf, limits, charge).await?;
    match (&gate.token, &first) {
        (Some(token), First::Client(ClientFrame::AuthStart { nonce })) => {
            prove(stream, rbuf, limits, charge, token, *nonce).await?;
            first = next_frame(stream, rbuf, limits, charge).await?;
        }
        (Some(_), First::Agent | First::Client(ClientFrame::Hello(_))) => {
            return Err(End::refused(OpError::Unauthorized(AuthRefusal::TokenRequired)));
        }
        (None, First::Client(ClientFrame::AuthStart { .. })) => {
            return Err(End::refused(OpError::Unauthorized(AuthRefusal::NoTokenHere)));
        }
        _ => {}
    }
    match first {
        First::Agent if accepts.agents => Ok(Hello::Agent),
        First::Agent => Err(End::NotServed("a node agent (agents connect to the coordinator, not to an agent)")),
        First::Client(ClientFrame::Hello(identity)) => Ok(Hello::Native(identity)),
        First::Client(ClientFrame::AuthStart { .. } | ClientFrame::AuthProof { .. }) => {
            Err(End::refused(OpError::Invalid("a token handshake frame out of place".to_owned())))
        }
        First::Client(_) => Err(End::refused(OpError::Invalid("the first frame must be a hello".to_owned()))),
    }
}

/// The first frame after the preamble or the token handshake.
enum First {
    /// A node agent's hello, left in the buffer for the agent codec.
    Agent,
    Client(ClientFrame),
}

async fn next_frame<S: AsyncRead + Unpin>(
    stream: &mut S,
    rbuf: &mut BytesMut,
    limits: &FrameLimits,
    charge: &mut Charge,
) -> Result<First, End> {
    loop {
        if starts_with_agent_hello(rbuf) == Some(true) {
            return Ok(First::Agent);
        }
        match decode_client_frame(rbuf, limits) {
            Ok(Some(frame)) => return Ok(First::Client(frame)),
            Ok(None) => read_more(stream, rbuf, charge).await?,
            Err(error) if error.is_fatal() => return Err(End::malformed(error)),
            Err(error) => return Err(End::refused(OpError::Invalid(error.to_string()))),
        }
    }
}

/// The serving side of the token handshake, after the peer's AuthStart: a
/// challenge, the peer's proof checked, this side's proof sent.
async fn prove<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    rbuf: &mut BytesMut,
    limits: &FrameLimits,
    charge: &mut Charge,
    token: &Token,
    client: auth::Nonce,
) -> Result<(), End> {
    let server = auth::nonce();
    send(stream, &ServerFrame::AuthChallenge { nonce: server }).await?;
    match next_frame(stream, rbuf, limits, charge).await? {
        First::Client(ClientFrame::AuthProof { proof }) if token.verify_client(&client, &server, &proof) => {
            send(stream, &ServerFrame::AuthAccepted { proof: token.server_proof(&client, &server) }).await
        }
        First::Client(ClientFrame::AuthProof { .. }) => {
            Err(End::refused(OpError::Unauthorized(AuthRefusal::WrongToken)))
        }
        _ => Err(End::refused(OpError::Invalid("expected the token proof after the challenge".to_owned()))),
    }
}

async fn send<S: AsyncWrite + Unpin>(stream: &mut S, frame: &ServerFrame) -> Result<(), End> {
    let mut out = BytesMut::new();
    encode_server_frame(frame, &mut out);
    stream.write_all(&out).await?;
    Ok(stream.flush().await?)
}

/// The first byte a new TCP connection sent, read without taking it from the
/// socket (`None`: closed before sending anything): where this side serves TLS,
/// a TLS client (0x16) is handed to the TLS handshake before anything is read.
pub async fn peek_first_byte(stream: &TcpStream) -> io::Result<Option<u8>> {
    let mut byte = [0u8; 1];
    match stream.peek(&mut byte).await? {
        0 => Ok(None),
        _ => Ok(Some(byte[0])),
    }
}

/// Completes once a partial frame (`buffered` bytes of it) has waited `timeout` for
/// more bytes: never while nothing is buffered, so that an idle connection holds no
/// timer. Raced against each read, and made anew after it, so the time counts from
/// the last progress.
///
/// Not an `async fn`: this sits in every idle connection's wait, where an async
/// fn's state (its arguments kept twice) would cost more than the one pointer here.
pub fn stall(buffered: usize, timeout: Duration) -> impl Future<Output = End> + Send {
    // Boxed: a timer's state is larger than all else an idle connection's wait holds,
    // and only a connection stopped mid-frame needs one.
    let mut timer = (buffered > 0).then(|| {
        Box::pin(async move {
            tokio::time::sleep(timeout).await;
            End::Stalled { buffered, waited: timeout }
        })
    });
    std::future::poll_fn(move |cx| match &mut timer {
        Some(timer) => timer.as_mut().poll(cx),
        None => Poll::Pending,
    })
}

/// Reads once during the handshake; the end of the stream there is a close.
async fn read_more<R: AsyncRead + Unpin>(reader: &mut R, rbuf: &mut BytesMut, charge: &mut Charge) -> Result<(), End> {
    let read = tokio::select! {
        read = std::future::poll_fn(|cx| read_some(reader, rbuf, Buffering::RANK, cx)) => read?,
        () = charge.evicted() => return Err(End::Evicted),
    };
    match read {
        0 if rbuf.is_empty() => Err(End::Closed),
        0 => Err(End::ClosedMidFrame { buffered: rbuf.len() }),
        _ => hold_buffered(charge, rbuf),
    }
}

/// Counts the unfinished requests `rbuf` holds against the byte budget
/// ([`Charge::hold`]): `Err` if this connection must close, as the one holding the
/// most, or because another chose it meanwhile. Looked at here, after every read,
/// and not only in the `select!` that races [`Charge::evicted`] against the read: a
/// peer whose socket is always readable wins that race every time.
pub fn hold_buffered(charge: &mut Charge, rbuf: &BytesMut) -> Result<(), End> {
    charge.hold(crate::budget::buffered(rbuf))?;
    if charge.is_evicted() {
        return Err(End::Evicted);
    }
    Ok(())
}

/// What the connecting side proves and checks.
#[derive(Debug, Clone, Default)]
pub struct Credentials {
    /// Prove this token, and insist that the server proves it too.
    pub token: Option<Arc<Token>>,
    /// Connect over TLS, trusting this CA for the server's certificate.
    pub tls: Option<TlsClient>,
}

/// Why a greeting failed.
#[derive(Debug, thiserror::Error)]
pub enum GreetError {
    /// Worth retrying: nothing listening yet, a reset, a close before the answer.
    #[error("{0}")]
    Io(#[from] io::Error),
    /// Final: credentials refused or unproven; retrying would not change it.
    #[error("{0}")]
    Auth(AuthFailure),
    /// Final: something else answers there (an SSH or HTTP server).
    #[error("{0}")]
    NotCoordinator(String),
}

/// The error a request beyond the frame limit (`len` bytes, `max` read) gets, its
/// call answered before the stream is given up or passed over; `via`: how it came
/// (", through a node agent"), or nothing.
pub fn request_too_large(len: usize, max: usize, via: &str) -> String {
    format!(
        "a request of {len} bytes is more than this coordinator reads in one frame ({max} bytes{via}, \
         set by `rallypoint serve --max-request-len`: docs/PROTOCOL.md, section 10): send less per request"
    )
}

/// What a peer is that answered `first` (the bytes it sent first) with a length no
/// frame before a welcome has: not a coordinator.
pub fn not_a_coordinator(first: &[u8]) -> String {
    let first = first.get(..first.len().min(48)).unwrap_or_default();
    format!("it is not a rallypoint coordinator: it answered \"{}\"", first.escape_ascii())
}

/// A failed authentication, either way.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthFailure {
    /// The server refused this side's credentials.
    #[error("{0}")]
    Refused(AuthRefusal),
    /// The server did not prove that it knows the token: it may not be the
    /// coordinator it claims to be.
    #[error("the server did not prove that it knows the token ({0}); it may not be the coordinator it claims to be")]
    Unproven(String),
    /// The TLS handshake failed (the server's certificate did not verify against
    /// the CA, or the server refused ours).
    #[error("TLS handshake failed: {0}")]
    Tls(String),
}

/// Largest frame read during the token handshake: its frames are tens of bytes,
/// and whoever answers has not proven anything yet.
const AUTH_FRAME_LIMIT: FrameLimits = FrameLimits { max_frame_len: 64 * 1024 };

/// Connects to `addr` (over TLS if `credentials` say so), proves the token if
/// there is one (and checks the server's proof), sends `hello` (the first frames
/// after the preamble) and reads until `answer` finds the peer's decisive reply in
/// the bytes received (a welcome or a refusal, as the caller decodes them).
/// Returns the stream, that answer, and the bytes received after it.
///
/// Nothing of `hello` is sent before the server proved the token: a listener
/// posing as the coordinator learns nothing but this side's proof.
pub async fn greet<T>(
    addr: &str,
    credentials: &Credentials,
    hello: &[u8],
    mut answer: impl FnMut(&mut BytesMut) -> Option<T>,
) -> Result<(Stream, T, BytesMut), GreetError> {
    let mut stream = Stream::connect_with(addr, credentials.tls.as_ref()).await.map_err(|error| {
        match (tls_failure(&error), &credentials.tls) {
            (Some(failure), Some(tls)) => GreetError::Auth(AuthFailure::Tls(tls.explain(failure))),
            (Some(failure), None) => GreetError::Auth(AuthFailure::Tls(failure.to_string())),
            (None, _) => GreetError::Io(error),
        }
    })?;
    let mut out = BytesMut::new();
    encode_preamble(&mut out);
    let mut buf = BytesMut::new();
    if let Some(token) = &credentials.token {
        let client = auth::nonce();
        encode_client_frame(&ClientFrame::AuthStart { nonce: client }, &mut out);
        write(&mut stream, &out).await?;
        let server = match auth_frame(&mut stream, &mut buf).await? {
            ServerFrame::AuthChallenge { nonce } => nonce,
            other => return Err(unexpected(other, "a challenge")),
        };
        out.clear();
        encode_client_frame(&ClientFrame::AuthProof { proof: token.client_proof(&client, &server) }, &mut out);
        write(&mut stream, &out).await?;
        match auth_frame(&mut stream, &mut buf).await? {
            ServerFrame::AuthAccepted { proof } if token.verify_server(&client, &server, &proof) => {}
            ServerFrame::AuthAccepted { .. } => {
                return Err(GreetError::Auth(AuthFailure::Unproven("its proof does not match the token".to_owned())))
            }
            other => return Err(unexpected(other, "its proof")),
        }
        out.clear();
    }
    out.extend_from_slice(hello);
    write(&mut stream, &out).await?;
    loop {
        if let Some(answer) = answer(&mut buf) {
            return Ok((stream, answer, buf));
        }
        read(&mut stream, &mut buf).await?;
    }
}

async fn write(stream: &mut Stream, bytes: &[u8]) -> io::Result<()> {
    stream.write_all(bytes).await?;
    // TLS holds what it encrypted until flushed.
    stream.flush().await
}

async fn read(stream: &mut Stream, buf: &mut BytesMut) -> io::Result<()> {
    buf.reserve(Buffering::RANK.chunk);
    match stream.read_buf(buf).await? {
        0 => Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the peer closed the connection before its welcome")),
        _ => Ok(()),
    }
}

/// The server's next frame during the token handshake.
async fn auth_frame(stream: &mut Stream, buf: &mut BytesMut) -> Result<ServerFrame, GreetError> {
    loop {
        match decode_server_frame(buf, &AUTH_FRAME_LIMIT) {
            Ok(Some(frame)) => return Ok(frame),
            Ok(None) => read(stream, buf).await?,
            Err(ProtoError::FrameTooLarge { .. }) => return Err(GreetError::NotCoordinator(not_a_coordinator(buf))),
            Err(error) => return Err(GreetError::Auth(AuthFailure::Unproven(format!("it sent {error}")))),
        }
    }
}

/// A frame other than the token handshake's `expected` one.
fn unexpected(frame: ServerFrame, expected: &str) -> GreetError {
    GreetError::Auth(match frame {
        ServerFrame::Refused(OpError::Unauthorized(why)) => AuthFailure::Refused(why),
        ServerFrame::Refused(error) => AuthFailure::Unproven(format!("it refused the token handshake: {error}")),
        other => AuthFailure::Unproven(format!("it answered {} instead of {expected}", frame_name(&other))),
    })
}

fn frame_name(frame: &ServerFrame) -> &'static str {
    match frame {
        ServerFrame::Welcome(_) => "a welcome",
        ServerFrame::Refused(_) => "a refusal",
        ServerFrame::Reply { .. } | ServerFrame::SharedReply { .. } => "a reply",
        ServerFrame::BarrierChannel { .. } | ServerFrame::NoBarrierChannel { .. } => "a barrier channel answer",
        ServerFrame::AuthChallenge { .. } => "a challenge",
        ServerFrame::AuthAccepted { .. } => "a proof",
    }
}

/// One input from a rank's frames, as [`decode_requests`] found it.
#[derive(Debug)]
pub enum Inbound {
    Request {
        id: u64,
        request: Request,
    },
    /// The rank takes large replies through shared memory (docs/PROTOCOL.md, section 13).
    TakeSharedReplies,
    /// The rank no longer holds anything of this shared-memory slab's contents.
    ReleaseShared {
        slab: u64,
    },
    /// The barrier call `request`, to be handled as a Request, and a request for a
    /// barrier channel for its later calls (docs/PROTOCOL.md, section 15): say
    /// whether there is one (BarrierChannel or NoBarrierChannel) before the reply.
    AttachBarrier {
        id: u64,
        request: Request,
    },
    /// The rank gives up slot `slot` of barrier channel `channel` (a slot it does
    /// not hold is no one's business: ignored).
    LeaveBarrierChannel {
        channel: u64,
        slot: u32,
    },
    /// A whole frame that does not decode (skipped): answer request `id`, if it
    /// could be read, with an `Invalid` error saying `message`.
    Invalid {
        id: Option<u64>,
        message: String,
    },
}

/// Decodes every whole frame buffered after the hello, in order, into `on`. A frame
/// that only fails to decode (its bytes were whole) becomes [`Inbound::Invalid`];
/// the stream stays usable. A
/// second hello or bytes that cannot be framed end the connection: the inputs
/// before them were given to `on` first.
pub fn decode_requests(rbuf: &mut BytesMut, limits: &FrameLimits, mut on: impl FnMut(Inbound)) -> Result<(), End> {
    loop {
        match decode_client_frame(rbuf, limits) {
            Ok(None) => return Ok(()),
            Ok(Some(ClientFrame::Request { id, request })) => on(Inbound::Request { id, request }),
            Ok(Some(ClientFrame::TakeSharedReplies)) => on(Inbound::TakeSharedReplies),
            Ok(Some(ClientFrame::ReleaseShared { slab })) => on(Inbound::ReleaseShared { slab }),
            Ok(Some(ClientFrame::AttachBarrier { id, request })) => on(Inbound::AttachBarrier { id, request }),
            Ok(Some(ClientFrame::LeaveBarrierChannel { channel, slot })) => {
                on(Inbound::LeaveBarrierChannel { channel, slot })
            }
            Ok(Some(ClientFrame::Hello(_))) => return Err(End::SecondHello),
            Ok(Some(ClientFrame::AuthStart { .. } | ClientFrame::AuthProof { .. })) => {
                on(Inbound::Invalid { id: None, message: "a token handshake frame after the hello".to_owned() })
            }
            Err(error @ ProtoError::FrameTooLarge { id: Some(id), len, max }) => {
                // Answered before the connection closes, or its client would only see
                // the cut, send it again on a new connection and wait out its timeout.
                on(Inbound::Invalid { id: Some(id), message: request_too_large(len, max, "") });
                return Err(End::malformed(error));
            }
            Err(error) if error.is_fatal() => return Err(End::malformed(error)),
            Err(ProtoError::BadRequest { id, message }) => on(Inbound::Invalid { id, message }),
            Err(error) => on(Inbound::Invalid { id: None, message: error.to_string() }),
        }
    }
}

/// Most bytes one read takes: a peer streaming a large frame as fast as it can is
/// read in slices, between which the others are served (see [`after_read`]).
pub const MAX_READ: usize = 256 * 1024;

/// Lets the other connections run after a read that filled a whole slice: a
/// connection flooding the server (a large frame, or a hostile peer) then takes one
/// slice per turn, instead of holding a thread of the runtime while it copies
/// megabytes.
pub async fn after_read(read: usize) {
    if read >= MAX_READ {
        tokio::task::yield_now().await;
    }
}

/// How a connection's read buffer is sized: how much room each read makes, and how
/// large a buffer may stay once it is empty (a larger one is given back).
#[derive(Debug, Clone, Copy)]
pub struct Buffering {
    pub chunk: usize,
    pub keep: usize,
}

impl Buffering {
    /// Serving one rank: small requests, and tens of thousands of idle connections
    /// that must hold no buffer at all.
    pub const RANK: Buffering = Buffering { chunk: 4096, keep: 0 };
    /// A node agent serving the ranks of its node: a node's ranks, not a job's, so
    /// it keeps their buffers as the coordinator's reactor does
    /// ([`Buffering::RANK_ON_REACTOR`]) rather than allocating one per request.
    pub const NODE_RANK: Buffering = Buffering::RANK_ON_REACTOR;
    /// Serving one rank on a coordinator's reactor thread, which serves for the
    /// least CPU rather than the least memory: an idle connection keeps what its
    /// last small request was read into, for its next request.
    pub const RANK_ON_REACTOR: Buffering = Buffering { chunk: 4096, keep: 256 };
    /// A node agent's link to the coordinator: the batched traffic of a whole node.
    pub const NODE_LINK: Buffering = Buffering { chunk: 256 * 1024, keep: 1 << 20 };
    /// A client's replies: one connection per process, so a buffer may stay.
    pub const CLIENT: Buffering = Buffering { chunk: 8192, keep: 64 * 1024 };
    /// PyTorch TCPStore connections: read through one buffer their thread shares
    /// (so reads may be large), while each of thousands of idle connections keeps
    /// only enough for torch's usual requests and replies.
    pub const TORCH: Buffering = Buffering { chunk: 64 * 1024, keep: 1024 };

    /// Gives back `buf`'s memory if it is empty and larger than this keeps.
    ///
    /// An empty buffer with no room left still holds the allocation its last frame
    /// was split from. That is worth keeping where a buffer may stay: the next read
    /// reuses it in place, once the frame's bytes are dropped, instead of
    /// allocating anew. It goes where nothing is kept, and where it is larger than
    /// what is kept and nothing else holds it.
    pub fn release_idle(self, buf: &mut BytesMut) {
        if !buf.is_empty() {
            return;
        }
        let too_large = match buf.capacity() {
            0 => self.keep == 0 || buf.try_reclaim(self.keep + 1),
            capacity => capacity > self.keep,
        };
        if too_large {
            *buf = BytesMut::new();
        }
    }
}

/// Reads what the socket has into `rbuf`: at most `buffering.chunk` bytes into an
/// empty buffer, else at least that much room (more for a large frame underway).
///
/// Through `poll_read`, which learns from a short read that the socket is drained;
/// `try_read` would spend a second, empty `recv` per request to learn that. Into an
/// empty buffer the bytes land on the stack first and are appended, so the buffer
/// is allocated at exactly the size received: decoded keys and values share that
/// allocation (the codecs do not copy them), so a small `set` must not pin a whole
/// read chunk. The stack chunk lives only within one poll and is not zeroed (only
/// what the read fills is looked at). The rest of a frame already started is read
/// straight into the buffer, which grows geometrically so that a large value takes
/// few reads, each of at most [`MAX_READ`] bytes.
pub fn read_some<R: AsyncRead + Unpin>(
    reader: &mut R,
    rbuf: &mut BytesMut,
    buffering: Buffering,
    cx: &mut Context<'_>,
) -> Poll<io::Result<usize>> {
    const STACK_CHUNK: usize = 4096;
    if !rbuf.is_empty() || buffering.chunk > STACK_CHUNK {
        rbuf.reserve(buffering.chunk.max(rbuf.len()));
        let mut room = BufMut::limit(&mut *rbuf, MAX_READ);
        return pin!(reader.read_buf(&mut room)).poll(cx);
    }
    let mut chunk = [MaybeUninit::<u8>::uninit(); STACK_CHUNK];
    let mut filled = ReadBuf::uninit(&mut chunk[..buffering.chunk]);
    ready!(Pin::new(reader).poll_read(cx, &mut filled))?;
    rbuf.extend_from_slice(filled.filled());
    Poll::Ready(Ok(filled.filled().len()))
}

/// What one [`read_from`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadOutcome {
    /// Bytes appended to the buffer; 0 at the end of the stream.
    pub got: usize,
    /// The read came back short of the room it had: the socket held no more then.
    /// (An edge-triggered poller reports the next bytes as a new event.)
    pub drained: bool,
}

/// [`read_some`] for a non-blocking socket served by a poller thread rather than a
/// task (the coordinator's reactor): the same sizing of `rbuf`, and the same cap of
/// [`MAX_READ`] per read, between which the poller serves other connections.
/// `WouldBlock` and the other errors are the socket's. (`recv`, not `read`: on a
/// socket it skips the file-position lock a `read` takes.)
pub fn read_from(socket: impl AsFd, rbuf: &mut BytesMut, buffering: Buffering) -> io::Result<ReadOutcome> {
    const STACK_CHUNK: usize = 4096;
    if !rbuf.is_empty() || buffering.chunk > STACK_CHUNK {
        rbuf.reserve(buffering.chunk.max(rbuf.len()));
        let spare = rbuf.spare_capacity_mut();
        let room = spare.len().min(MAX_READ);
        let ((filled, _), _) = rustix::net::recv(&socket, &mut spare[..room], RecvFlags::empty())?;
        let got = filled.len();
        // SAFETY: the read initialised the first `got` bytes of the spare capacity.
        unsafe { rbuf.set_len(rbuf.len() + got) };
        return Ok(ReadOutcome { got, drained: got < room });
    }
    // As in `read_some`: into an empty buffer through the stack, so that the buffer
    // is allocated at the size received; the stack chunk is not zeroed.
    let mut chunk = [MaybeUninit::<u8>::uninit(); STACK_CHUNK];
    let ((filled, _), _) = rustix::net::recv(&socket, &mut chunk[..buffering.chunk], RecvFlags::empty())?;
    rbuf.extend_from_slice(filled);
    Ok(ReadOutcome { got: filled.len(), drained: filled.len() < buffering.chunk })
}

#[cfg(test)]
mod tests {
    use bytes::BufMut;
    use rallypoint_proto::native::{encode_client_frame, encode_preamble};

    use super::*;

    fn hello_bytes(identity: &Identity) -> BytesMut {
        let mut out = BytesMut::new();
        encode_preamble(&mut out);
        encode_client_frame(&ClientFrame::Hello(identity.clone()), &mut out);
        out
    }

    /// A peer that sent `input` and then closed its side; what this side writes is kept.
    struct Scripted<'a> {
        input: &'a [u8],
        output: Vec<u8>,
    }

    impl AsyncRead for Scripted<'_> {
        fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
            Pin::new(&mut self.input).poll_read(cx, buf)
        }
    }

    impl AsyncWrite for Scripted<'_> {
        fn poll_write(mut self: Pin<&mut Self>, _: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
            self.output.extend_from_slice(buf);
            Poll::Ready(Ok(buf.len()))
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    async fn accept_through(bytes: &[u8], accepts: Accepts, gate: &Gate) -> (Result<Hello, End>, BytesMut, Vec<u8>) {
        let mut stream = Scripted { input: bytes, output: Vec::new() };
        let mut rbuf = BytesMut::new();
        let mut charge = crate::budget::PendingBudget::new(1 << 20).charge();
        let hello = accept_hello(&mut stream, &mut rbuf, &FrameLimits::default(), accepts, gate, &mut charge).await;
        (hello, rbuf, stream.output)
    }

    async fn accept(bytes: &[u8], accepts: Accepts) -> (Result<Hello, End>, BytesMut) {
        let (hello, rbuf, _) = accept_through(bytes, accepts, &Gate::default()).await;
        (hello, rbuf)
    }

    fn refusal(hello: &Result<Hello, End>) -> Option<&OpError> {
        match hello {
            Err(End::Refused(error)) => Some(error),
            _ => None,
        }
    }

    #[tokio::test]
    async fn a_gate_with_a_token_refuses_a_hello_without_a_proof_and_a_gate_without_one_an_offer() {
        let token = Arc::new(Token::new("the-job-token", "test").expect("token"));
        let gate = Gate { token: Some(token), tls_required: false };
        let (hello, _, written) =
            accept_through(&hello_bytes(&Identity::ranked("job", 0, 1)), Accepts::COORDINATOR, &gate).await;
        assert_eq!(refusal(&hello), Some(&OpError::Unauthorized(AuthRefusal::TokenRequired)));
        assert!(written.is_empty(), "nothing is written before the refusal");

        let mut offer = BytesMut::new();
        encode_preamble(&mut offer);
        encode_client_frame(&ClientFrame::AuthStart { nonce: auth::nonce() }, &mut offer);
        let (hello, _, _) = accept_through(&offer, Accepts::COORDINATOR, &Gate::default()).await;
        assert_eq!(refusal(&hello), Some(&OpError::Unauthorized(AuthRefusal::NoTokenHere)));

        // A proof sent without waiting for the challenge cannot match it.
        encode_client_frame(&ClientFrame::AuthProof { proof: [7; 32] }, &mut offer);
        let (hello, _, written) = accept_through(&offer, Accepts::COORDINATOR, &gate).await;
        assert_eq!(refusal(&hello), Some(&OpError::Unauthorized(AuthRefusal::WrongToken)));
        let mut written = BytesMut::from(&written[..]);
        let challenge = decode_server_frame(&mut written, &FrameLimits::default()).expect("well-formed");
        assert!(matches!(challenge, Some(ServerFrame::AuthChallenge { .. })), "{challenge:?}");
        assert!(written.is_empty(), "no proof of the server's after a wrong one");
    }

    #[tokio::test]
    async fn a_gate_requiring_tls_refuses_plaintext_and_a_tls_client_where_none_is_served_gets_an_alert() {
        let gate = Gate { token: None, tls_required: true };
        let (hello, _, _) =
            accept_through(&hello_bytes(&Identity::ranked("job", 0, 1)), Accepts::COORDINATOR, &gate).await;
        assert_eq!(refusal(&hello), Some(&OpError::Unauthorized(AuthRefusal::TlsRequired)));
        let (hello, _, written) = accept_through(&[0x16, 0x03, 0x01], Accepts::COORDINATOR, &Gate::default()).await;
        assert!(matches!(hello, Err(End::NotServed(what)) if what.contains("TLS")), "{hello:?}");
        assert_eq!(written, crate::tls::HANDSHAKE_FAILURE_ALERT);
    }

    #[tokio::test]
    async fn a_hello_is_read_and_the_bytes_after_it_stay() {
        let identity = Identity::ranked("job", 1, 4);
        let mut bytes = hello_bytes(&identity);
        let request = ClientFrame::Request { id: 7, request: Request::Heartbeat };
        encode_client_frame(&request, &mut bytes);
        let (hello, mut rest) = accept(&bytes, Accepts::NODE_AGENT).await;
        assert!(matches!(hello, Ok(Hello::Native(got)) if got == identity));
        let mut inputs = Vec::new();
        decode_requests(&mut rest, &FrameLimits::default(), |input| inputs.push(input)).expect("well-formed");
        assert!(matches!(&inputs[..], [Inbound::Request { id: 7, request: Request::Heartbeat }]), "{inputs:?}");
    }

    #[tokio::test]
    async fn tcpstore_clients_and_agents_are_told_apart_and_served_only_where_accepted() {
        let (hello, rbuf) = accept(&[0x00, 0x01, 0x02], Accepts::COORDINATOR).await;
        assert!(matches!(hello, Ok(Hello::TcpStore)));
        assert_eq!(&rbuf[..], &[0x00, 0x01, 0x02], "the TCPStore bytes stay for its codec");
        let (hello, _) = accept(&[0x00], Accepts::NODE_AGENT).await;
        assert!(matches!(hello, Err(End::NotServed(what)) if what.contains("TCPStore")));
        let (hello, _) = accept(b"GET / HTTP/1.1\r\n", Accepts::COORDINATOR).await;
        assert!(matches!(hello, Err(End::NotServed(_))));
    }

    #[tokio::test]
    async fn a_wrong_version_or_a_request_first_is_refused_with_a_reason() {
        let mut bytes = BytesMut::from(&b"RLLY"[..]);
        bytes.put_u16_le(VERSION + 1);
        let (hello, _) = accept(&bytes, Accepts::COORDINATOR).await;
        assert!(
            matches!(hello, Err(End::Refused(e)) if matches!(&*e, OpError::Invalid(m) if m.contains("not supported")))
        );
        let mut bytes = BytesMut::new();
        encode_preamble(&mut bytes);
        encode_client_frame(&ClientFrame::Request { id: 1, request: Request::Heartbeat }, &mut bytes);
        let (hello, _) = accept(&bytes, Accepts::COORDINATOR).await;
        assert!(
            matches!(hello, Err(End::Refused(e)) if matches!(&*e, OpError::Invalid(m) if m.contains("first frame")))
        );
    }

    #[tokio::test]
    async fn a_close_during_the_handshake_says_whether_a_frame_was_cut() {
        let (hello, _) = accept(b"", Accepts::COORDINATOR).await;
        assert!(matches!(hello, Err(End::Closed)));
        let bytes = hello_bytes(&Identity::ranked("job", 0, 1));
        let (hello, _) = accept(&bytes[..bytes.len() - 1], Accepts::COORDINATOR).await;
        assert!(matches!(hello, Err(End::ClosedMidFrame { .. })), "{hello:?}");
    }

    #[test]
    fn a_second_hello_ends_the_session_after_the_requests_before_it() {
        let mut bytes = BytesMut::new();
        encode_client_frame(&ClientFrame::Request { id: 1, request: Request::Heartbeat }, &mut bytes);
        encode_client_frame(&ClientFrame::Hello(Identity::ranked("job", 0, 1)), &mut bytes);
        let mut ids = Vec::new();
        let end = decode_requests(&mut bytes, &FrameLimits::default(), |input| {
            if let Inbound::Request { id, .. } = input {
                ids.push(id);
            }
        });
        assert!(matches!(end, Err(End::SecondHello)));
        assert_eq!(ids, [1]);
    }

    #[test]
    fn a_connection_chosen_to_close_learns_it_at_its_next_read() {
        let budget = crate::budget::PendingBudget::new(100);
        let (mut big, mut small) = (budget.charge(), budget.charge());
        let mut rbuf = BytesMut::new();
        rbuf.extend_from_slice(&[1; 80]);
        assert!(hold_buffered(&mut big, &rbuf).is_ok());
        small.hold(30).expect("the big one is chosen instead");
        rbuf.extend_from_slice(&[1; 10]);
        assert!(matches!(hold_buffered(&mut big, &rbuf), Err(End::Evicted)));
    }

    #[test]
    fn an_idle_buffer_is_given_back_only_past_what_is_kept() {
        let mut buf = BytesMut::with_capacity(8192);
        Buffering::CLIENT.release_idle(&mut buf);
        assert!(buf.capacity() >= 8192, "kept: within CLIENT's keep");
        Buffering::RANK.release_idle(&mut buf);
        assert_eq!(buf.capacity(), 0);
    }

    /// A node agent's rank connection reads its next small request into the
    /// buffer its last one was read into (once that request's frame is gone), not
    /// into a new allocation per request.
    #[tokio::test]
    async fn a_node_agents_rank_reads_the_next_request_where_the_last_one_was() {
        let mut buf = BytesMut::new();
        let mut first = None;
        for request in 0..3u8 {
            let mut reader: &[u8] = &[request; 40];
            let got = std::future::poll_fn(|cx| read_some(&mut reader, &mut buf, Buffering::NODE_RANK, cx)).await;
            assert_eq!(got.expect("reads"), 40);
            assert_eq!(&buf[..], &[request; 40]);
            let at = buf.as_ptr();
            assert_eq!(*first.get_or_insert(at), at, "request {request} read into another allocation");
            // Decoded and forwarded: the frame's bytes are gone before the next read.
            drop(buf.split_to(40).freeze());
            Buffering::NODE_RANK.release_idle(&mut buf);
            assert!(buf.try_reclaim(40), "the idle buffer kept its allocation");
        }
    }

    #[test]
    fn an_idle_buffer_whose_last_frame_was_split_off_its_end_goes_where_nothing_is_kept() {
        // As a read into an empty buffer leaves it: allocated at exactly the bytes read.
        let mut buf = BytesMut::new();
        buf.extend_from_slice(&[7; 100]);
        let frame = buf.split_to(100).freeze();
        drop(frame);
        assert_eq!((buf.len(), buf.capacity()), (0, 0));
        // Still part of the allocation the frame came from: only a new buffer lets it go.
        let pinned = buf.as_ptr();
        Buffering::TORCH.release_idle(&mut buf);
        assert_eq!(buf.as_ptr(), pinned, "kept where a buffer is kept: the next read reuses it");
        Buffering::RANK.release_idle(&mut buf);
        assert_ne!(buf.as_ptr(), pinned, "the empty buffer still pins its old allocation");
        assert_eq!(buf.capacity(), 0);

        // Larger than what is kept: it goes, unless the frame's bytes still hold it.
        let mut buf = BytesMut::new();
        buf.extend_from_slice(&[7; 300]);
        let frame = buf.split_to(300).freeze();
        Buffering::RANK_ON_REACTOR.release_idle(&mut buf);
        assert_eq!(buf.as_ptr(), frame.as_ptr().wrapping_add(300), "held by the frame anyway: kept");
        drop(frame);
        Buffering::RANK_ON_REACTOR.release_idle(&mut buf);
        assert_eq!(buf.capacity(), 0);
        assert!(!buf.try_reclaim(1), "a new buffer, holding no allocation");
    }
}
