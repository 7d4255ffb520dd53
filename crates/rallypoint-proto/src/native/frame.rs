//! Length-prefixed framing and the frame kinds of both directions
//! (docs/PROTOCOL.md, "Framing" and "Frames").

use bytes::{Buf, BufMut, Bytes, BytesMut};
use rallypoint_core::{Identity, Limits, OpError, Reply, Request, Response, Welcome};

use super::error::ProtoError;
use super::identity::{decode_identity, decode_welcome, encode_identity, encode_welcome};
use super::op_error::{decode_op_error, encode_op_error};
use super::reply::{blobs_len, decode_reply_body, encode_reply_body, encode_reply_body_shared, gathered_len};
use super::request::{decode_request, encode_request};
use super::wire::{DecodeError, DecodeResult, Reader, WireWrite};

/// Longest body any frame may have. The length prefix is a u32 and its largest
/// value, `u32::MAX`, is reserved: encoders saturate to it when a body does not
/// fit, so such a frame is always rejected rather than misread.
pub const MAX_FRAME_LEN: usize = u32::MAX as usize - 1;

/// Bytes of the length prefix in front of every frame body.
pub(crate) const LEN_PREFIX: usize = 4;

/// First byte of every frame body. Values are part of the protocol: never renumber.
pub(crate) mod kind {
    pub const HELLO: u8 = 0x01;
    pub const REQUEST: u8 = 0x02;
    pub const WELCOME: u8 = 0x81;
    pub const REFUSED: u8 = 0x82;
    pub const REPLY: u8 = 0x83;
    // Shared-memory replies over Unix sockets (docs/PROTOCOL.md, section 13).
    pub const TAKE_SHARED_REPLIES: u8 = 0x08;
    pub const RELEASE_SHARED: u8 = 0x09;
    pub const SHARED_REPLY: u8 = 0x89;
    // Barriers through shared memory (docs/PROTOCOL.md, section 15); numbered past
    // the request opcodes so that neither is ever mistaken for the other in a dump.
    pub const ATTACH_BARRIER: u8 = 0x1d;
    pub const LEAVE_BARRIER_CHANNEL: u8 = 0x1e;
    pub const BARRIER_CHANNEL: u8 = 0x9d;
    pub const NO_BARRIER_CHANNEL: u8 = 0x9e;
    // Node agents (docs/PROTOCOL.md, section 12).
    pub const AGENT_HELLO: u8 = 0x03;
    pub const SUB_HELLO: u8 = 0x04;
    pub const SUB_REQUEST: u8 = 0x05;
    pub const SUB_CLOSE: u8 = 0x06;
    pub const SUB_REQUESTS: u8 = 0x07;
    pub const AGENT_WELCOME: u8 = 0x84;
    pub const SUB_WELCOME: u8 = 0x85;
    pub const SUB_REFUSED: u8 = 0x86;
    pub const SUB_REPLY: u8 = 0x87;
    pub const SUB_REPLIES: u8 = 0x88;
    // Token authentication (docs/PROTOCOL.md, section 5.1).
    pub const AUTH_START: u8 = 0x0a;
    pub const AUTH_PROOF: u8 = 0x0b;
    pub const AUTH_CHALLENGE: u8 = 0x8a;
    pub const AUTH_ACCEPTED: u8 = 0x8b;
}

/// Bytes of a nonce of the token handshake.
pub const NONCE_LEN: usize = 32;
/// Bytes of a proof of the token handshake (an HMAC-SHA256).
pub const PROOF_LEN: usize = 32;

/// A frame a client sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientFrame {
    /// First frame after the preamble: who the client is.
    Hello(Identity),
    /// An operation; its reply carries the same `id`.
    Request { id: u64, request: Request },
    /// The client takes large replies as [`ServerFrame::SharedReply`]: it is on a
    /// Unix socket and can receive the file each one comes with.
    TakeSharedReplies,
    /// The client holds nothing any more of what `slab` held for it: the sender
    /// may write the slab's next contents.
    ReleaseShared { slab: u64 },
    /// The barrier call `request` (name, members, timeout), made as a Request makes
    /// it, asking this node's agent too for a barrier channel through which to make
    /// the barrier's later calls in shared memory. [`ServerFrame::BarrierChannel`] or
    /// [`ServerFrame::NoBarrierChannel`] says whether there is one, before the
    /// call's Reply.
    AttachBarrier { id: u64, request: Request },
    /// The client gives up slot `slot` of barrier channel `channel`, which it is not
    /// in a call through: its later calls of that barrier go as requests, or ask for
    /// a channel again.
    LeaveBarrierChannel { channel: u64, slot: u32 },
    /// First frame after the preamble of a client (or node agent) with a token:
    /// its fresh nonce, to which the server's proof will be bound.
    AuthStart { nonce: [u8; NONCE_LEN] },
    /// The client's proof of the token, bound to both nonces; its hello follows.
    AuthProof { proof: [u8; PROOF_LEN] },
}

/// A frame a server sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerFrame {
    /// The Hello was accepted.
    Welcome(Welcome),
    /// The Hello was refused; the server closes the connection after this frame.
    Refused(OpError),
    /// The outcome of the request with this `id`.
    Reply { id: u64, reply: Reply },
    /// The outcome of the request with this `id`, whose reply body (tag and fields,
    /// as in a Reply) is the first `len` bytes of shared-memory slab `slab`; the
    /// slab's file comes over the Unix socket with the first frame that names it
    /// (decode the body with [`decode_shared_reply`]).
    SharedReply { id: u64, slab: u64, len: u64 },
    /// For [`ClientFrame::AttachBarrier`] `id` (whose reply still follows): slot
    /// `slot` of barrier channel `channel` is the client's for that barrier's later calls. The channel's memory file, doorbell
    /// and release bell come over the Unix socket with the first frame that names the channel.
    BarrierChannel { id: u64, channel: u64, slot: u32 },
    /// For [`ClientFrame::AttachBarrier`] `id` (whose reply still follows): no
    /// channel (the barrier's calls go through messages); `reason` says why.
    NoBarrierChannel { id: u64, reason: String },
    /// The answer to [`ClientFrame::AuthStart`]: the server's fresh nonce.
    AuthChallenge { nonce: [u8; NONCE_LEN] },
    /// The client's proof was right; this is the server's, so that the client knows
    /// it reached a holder of the token. Sent before the welcome (or refusal) of the
    /// hello that follows.
    AuthAccepted { proof: [u8; PROOF_LEN] },
}

/// How long a frame a decoder accepts before declaring the stream broken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameLimits {
    /// Longest accepted body (the value of the length prefix), capped at [`MAX_FRAME_LEN`].
    pub max_frame_len: usize,
}

impl FrameLimits {
    /// [`FrameLimits::from_limits`] of the default limits, and the default.
    pub const DEFAULT_MAX_FRAME_LEN: usize = 66 << 20;

    /// Room for the largest request the engine accepts: keys and values up to
    /// [`crate::max_request_len`] (which always fits one key and two values), plus
    /// the lengths of as many entries as one request may carry and 1 MiB for names,
    /// member lists and headers. The frame length is what bounds a native request
    /// before it is buffered, so it follows the request limit, down as well as up.
    pub fn from_limits(limits: &Limits) -> Self {
        let lengths = limits.max_keys_per_op.saturating_mul(2 * super::request::MIN_BLOB_LEN);
        let largest = crate::max_request_len(limits).saturating_add(lengths).saturating_add(1 << 20);
        FrameLimits { max_frame_len: largest.min(MAX_FRAME_LEN) }
    }

    /// Accepts every frame the format can express; for a client reading replies
    /// from a trusted server (an all-gather reply grows with the world size).
    pub fn unbounded() -> Self {
        FrameLimits { max_frame_len: MAX_FRAME_LEN }
    }
}

impl Default for FrameLimits {
    fn default() -> Self {
        FrameLimits { max_frame_len: Self::DEFAULT_MAX_FRAME_LEN }
    }
}

/// Appends the frame of request `id` (as [`ClientFrame::Request`] would be encoded)
/// to `dst`: for a client that keeps its request rather than building a frame of it.
pub fn encode_request_frame(id: u64, request: &Request, dst: &mut BytesMut) {
    write_frame(dst, |dst| encode_request_body(id, request, dst));
}

fn encode_request_body(id: u64, request: &Request, dst: &mut BytesMut) {
    dst.put_u8(kind::REQUEST);
    dst.put_u64_le(id);
    encode_request(request, dst);
}

/// Appends one whole frame (length prefix and body) to `dst`.
pub fn encode_client_frame(frame: &ClientFrame, dst: &mut BytesMut) {
    write_frame(dst, |dst| match frame {
        ClientFrame::Hello(identity) => {
            dst.put_u8(kind::HELLO);
            encode_identity(identity, dst);
        }
        ClientFrame::Request { id, request } => encode_request_body(*id, request, dst),
        ClientFrame::TakeSharedReplies => dst.put_u8(kind::TAKE_SHARED_REPLIES),
        ClientFrame::ReleaseShared { slab } => {
            dst.put_u8(kind::RELEASE_SHARED);
            dst.put_u64_le(*slab);
        }
        ClientFrame::AttachBarrier { id, request } => {
            dst.put_u8(kind::ATTACH_BARRIER);
            dst.put_u64_le(*id);
            encode_request(request, dst);
        }
        ClientFrame::LeaveBarrierChannel { channel, slot } => {
            dst.put_u8(kind::LEAVE_BARRIER_CHANNEL);
            dst.put_u64_le(*channel);
            dst.put_u32_le(*slot);
        }
        ClientFrame::AuthStart { nonce } => {
            dst.put_u8(kind::AUTH_START);
            dst.put_slice(nonce);
        }
        ClientFrame::AuthProof { proof } => {
            dst.put_u8(kind::AUTH_PROOF);
            dst.put_slice(proof);
        }
    });
}

/// Appends one whole frame (length prefix and body) to `dst`.
pub fn encode_server_frame(frame: &ServerFrame, dst: &mut BytesMut) {
    match frame {
        ServerFrame::Welcome(welcome) => {
            write_frame(dst, |dst| {
                dst.put_u8(kind::WELCOME);
                encode_welcome(welcome, dst);
            });
        }
        ServerFrame::Refused(error) => {
            write_frame(dst, |dst| {
                dst.put_u8(kind::REFUSED);
                encode_op_error(error, dst);
            });
        }
        ServerFrame::Reply { id, reply } => encode_reply(*id, reply, dst),
        ServerFrame::SharedReply { id, slab, len } => {
            write_frame(dst, |dst| {
                dst.put_u8(kind::SHARED_REPLY);
                dst.put_u64_le(*id);
                dst.put_u64_le(*slab);
                dst.put_u64_le(*len);
            });
        }
        ServerFrame::BarrierChannel { id, channel, slot } => {
            write_frame(dst, |dst| {
                dst.put_u8(kind::BARRIER_CHANNEL);
                dst.put_u64_le(*id);
                dst.put_u64_le(*channel);
                dst.put_u32_le(*slot);
            });
        }
        ServerFrame::NoBarrierChannel { id, reason } => {
            write_frame(dst, |dst| {
                dst.put_u8(kind::NO_BARRIER_CHANNEL);
                dst.put_u64_le(*id);
                dst.put_str(reason);
            });
        }
        ServerFrame::AuthChallenge { nonce } => {
            write_frame(dst, |dst| {
                dst.put_u8(kind::AUTH_CHALLENGE);
                dst.put_slice(nonce);
            });
        }
        ServerFrame::AuthAccepted { proof } => {
            write_frame(dst, |dst| {
                dst.put_u8(kind::AUTH_ACCEPTED);
                dst.put_slice(proof);
            });
        }
    }
}

/// Encodes the body of a reply (tag and fields, as a Reply frame carries them after
/// the request id) for a shared-memory file: the bytes appended to `dst`, then the
/// returned tail, if any (an all-gather's values or a large value, not copied).
pub fn encode_reply_body_parts(reply: &Reply, dst: &mut BytesMut) -> Option<Bytes> {
    let reply = frameable(reply, 0);
    encode_reply_body_shared(&reply, dst)
}

/// Decodes the reply body of a [`ServerFrame::SharedReply`] for request `id`: the
/// values are sliced out of `body`, not copied.
pub fn decode_shared_reply(id: u64, body: Bytes) -> Result<Reply, ProtoError> {
    let mut r = Reader::new(body);
    decode_reply_body(&mut r)
        .and_then(|reply| r.finish("shared reply").map(|()| reply))
        .map_err(|DecodeError(message)| ProtoError::BadReply { id: Some(id), message })
}

/// Encodes `ServerFrame::Reply { id, reply }` without owning the reply.
///
/// A response too long to frame (an all-gather of many large values) is replaced
/// by `OpError::TooLarge`, so the caller still gets a typed answer.
pub fn encode_reply(id: u64, reply: &Reply, dst: &mut BytesMut) {
    let reply = frameable(reply, 0);
    write_frame(dst, |dst| {
        dst.put_u8(kind::REPLY);
        dst.put_u64_le(id);
        encode_reply_body(&reply, dst);
    });
}

/// Like [`encode_reply`], but a large tail of bytes the reply shares with other
/// replies (an all-gather's values, encoded once for all members; a large value)
/// is returned instead of copied into `dst`. The frame is complete once the
/// caller has written the tail right after the bytes appended to `dst`.
pub fn encode_reply_shared(id: u64, reply: &Reply, dst: &mut BytesMut) -> Option<Bytes> {
    let reply = frameable(reply, 0);
    write_frame_shared(dst, |dst| {
        dst.put_u8(kind::REPLY);
        dst.put_u64_le(id);
        encode_reply_body_shared(&reply, dst)
    })
}

/// Frame kind, request id and reply tag.
const REPLY_HEADER_LEN: usize = 1 + 8 + 1;

/// `reply`, or a `TooLarge` error in its place if its encoding could not be framed
/// even with `extra` more header bytes.
pub(crate) fn frameable(reply: &Reply, extra: usize) -> std::borrow::Cow<'_, Reply> {
    // Checked before encoding so that nothing that large is ever copied. Only
    // value-carrying responses need it: their size is world size × value size,
    // which no single engine limit bounds; errors stay within the engine's limits.
    let body_len = reply_payload_len(reply).saturating_add(REPLY_HEADER_LEN + extra);
    if body_len > MAX_FRAME_LEN {
        std::borrow::Cow::Owned(Err(OpError::TooLarge {
            what: "reply".to_owned(),
            len: body_len as u64,
            limit: MAX_FRAME_LEN as u64,
        }))
    } else {
        std::borrow::Cow::Borrowed(reply)
    }
}

/// Bytes of the values a reply carries (a value, a list of them, an all-gather's),
/// with their length fields; 0 for replies without values. Costs no encoding.
pub fn reply_payload_len(reply: &Reply) -> usize {
    match reply {
        Ok(Response::Value(value)) => value.len().saturating_add(4),
        Ok(Response::Values(values)) => blobs_len(values),
        // O(1) once the first member's reply has encoded it.
        Ok(Response::Gathered(gathered)) => gathered_len(gathered),
        _ => 0,
    }
}

/// Writes a length prefix and the body `body` produces.
pub(crate) fn write_frame(dst: &mut BytesMut, body: impl FnOnce(&mut BytesMut)) {
    write_frame_shared(dst, |dst| {
        body(dst);
        None
    });
}

/// Writes a length prefix and the start of the body `head` produces; the body ends
/// with the tail `head` returns, which the caller writes (the prefix counts it).
pub(crate) fn write_frame_shared(
    dst: &mut BytesMut,
    head: impl FnOnce(&mut BytesMut) -> Option<Bytes>,
) -> Option<Bytes> {
    let start = dst.len();
    dst.put_u32_le(0);
    let tail = head(dst);
    let len = (dst.len() - start - LEN_PREFIX).saturating_add(tail.as_ref().map_or(0, Bytes::len));
    let prefix = u32::try_from(len).unwrap_or(u32::MAX).to_le_bytes();
    dst[start..start + LEN_PREFIX].copy_from_slice(&prefix);
    tail
}

/// Total length (prefix included) of the frame at the start of `src`, once its
/// length prefix has arrived: a reader that trusts its peer (a client reading its
/// coordinator) can make room for a large reply at once instead of growing its
/// buffer, and copying what it holds, step by step as the bytes arrive.
pub fn pending_frame_len(src: &[u8]) -> Option<usize> {
    let prefix = src.get(..LEN_PREFIX)?;
    let len = u32::from_le_bytes(prefix.try_into().ok()?);
    Some((len as usize).saturating_add(LEN_PREFIX))
}

/// A frame whose length prefix is beyond the limit, as far as its first bytes tell.
pub(crate) enum Oversized<const N: usize> {
    /// Of the kind asked about, and its ids have not all come yet.
    Wait,
    /// Of that kind: the `N` u64 ids after its kind byte.
    Ids([u64; N]),
    /// Of another kind.
    Other,
}

/// What the oversized frame at the start of `src` is: of kind `of` (a request,
/// whose ids follow its kind, so that its call can still be answered), or not.
pub(crate) fn oversized<const N: usize>(src: &[u8], of: u8) -> Oversized<N> {
    if src.get(LEN_PREFIX).is_some_and(|&k| k != of) {
        return Oversized::Other;
    }
    let Some(bytes) = src.get(LEN_PREFIX + 1..LEN_PREFIX + 1 + 8 * N) else { return Oversized::Wait };
    let mut ids = [0u64; N];
    for (id, word) in ids.iter_mut().zip(bytes.chunks_exact(8)) {
        *id = word.try_into().map(u64::from_le_bytes).unwrap_or_default();
    }
    Oversized::Ids(ids)
}

/// Decodes the next client frame from `src`.
///
/// `Ok(None)`: `src` does not hold a whole frame yet; read more and call again.
/// A non-fatal error consumed its frame, so decoding can continue after it.
pub fn decode_client_frame(src: &mut BytesMut, limits: &FrameLimits) -> Result<Option<ClientFrame>, ProtoError> {
    let body = match take_frame(src, limits) {
        Ok(Some(body)) => body,
        Ok(None) => return Ok(None),
        Err(ProtoError::FrameTooLarge { len, max, .. }) => {
            return match oversized::<1>(src, kind::REQUEST) {
                Oversized::Wait => Ok(None),
                Oversized::Ids([id]) => Err(ProtoError::FrameTooLarge { len, max, id: Some(id) }),
                Oversized::Other => Err(ProtoError::FrameTooLarge { len, max, id: None }),
            };
        }
        Err(error) => return Err(error),
    };
    let mut r = Reader::new(body);
    let mut id = None;
    client_body(&mut r, &mut id).map(Some).map_err(|DecodeError(message)| ProtoError::BadRequest { id, message })
}

/// Decodes the next server frame from `src`; same contract as [`decode_client_frame`].
pub fn decode_server_frame(src: &mut BytesMut, limits: &FrameLimits) -> Result<Option<ServerFrame>, ProtoError> {
    let Some(body) = take_frame(src, limits)? else {
        return Ok(None);
    };
    let mut r = Reader::new(body);
    let mut id = None;
    server_body(&mut r, &mut id).map(Some).map_err(|DecodeError(message)| ProtoError::BadReply { id, message })
}

/// Splits one whole frame body off `src`, or returns `Ok(None)` if it has not all arrived.
pub(crate) fn take_frame(src: &mut BytesMut, limits: &FrameLimits) -> Result<Option<Bytes>, ProtoError> {
    let mut peek: &[u8] = src;
    if peek.len() < LEN_PREFIX {
        return Ok(None);
    }
    let len = peek.get_u32_le() as usize;
    let max = limits.max_frame_len.min(MAX_FRAME_LEN);
    if len > max {
        return Err(ProtoError::FrameTooLarge { len, max, id: None });
    }
    // No reserve() for the announced length: a peer that sends only a large
    // prefix must not make us allocate it. The read loop grows `src` as bytes arrive.
    if peek.len() < len {
        return Ok(None);
    }
    src.advance(LEN_PREFIX);
    Ok(Some(src.split_to(len).freeze()))
}

/// `id` is set as soon as a request id has been read, for the error of a later field.
fn client_body(r: &mut Reader, id: &mut Option<u64>) -> DecodeResult<ClientFrame> {
    let frame = match r.u8("frame kind")? {
        kind::HELLO => ClientFrame::Hello(decode_identity(r)?),
        kind::REQUEST => {
            let request_id = r.u64("request id")?;
            *id = Some(request_id);
            ClientFrame::Request { id: request_id, request: decode_request(r)? }
        }
        kind::TAKE_SHARED_REPLIES => ClientFrame::TakeSharedReplies,
        kind::RELEASE_SHARED => ClientFrame::ReleaseShared { slab: r.u64("slab")? },
        kind::ATTACH_BARRIER => {
            let request_id = r.u64("request id")?;
            *id = Some(request_id);
            match decode_request(r)? {
                request @ Request::Barrier { .. } => ClientFrame::AttachBarrier { id: request_id, request },
                other => return Err(DecodeError(format!("attach-barrier names a {}, not a barrier", other.name()))),
            }
        }
        kind::LEAVE_BARRIER_CHANNEL => {
            ClientFrame::LeaveBarrierChannel { channel: r.u64("channel")?, slot: r.u32("slot")? }
        }
        kind::AUTH_START => ClientFrame::AuthStart { nonce: r.array("nonce")? },
        kind::AUTH_PROOF => ClientFrame::AuthProof { proof: r.array("proof")? },
        other => return Err(DecodeError::unknown("client frame kind", other)),
    };
    r.finish(match &frame {
        ClientFrame::Hello(_) => "hello",
        ClientFrame::Request { request, .. } => request.name(),
        ClientFrame::TakeSharedReplies => "take-shared-replies",
        ClientFrame::ReleaseShared { .. } => "release-shared",
        ClientFrame::AttachBarrier { .. } => "attach-barrier",
        ClientFrame::LeaveBarrierChannel { .. } => "leave-barrier-channel",
        ClientFrame::AuthStart { .. } => "auth-start",
        ClientFrame::AuthProof { .. } => "auth-proof",
    })?;
    Ok(frame)
}

fn server_body(r: &mut Reader, id: &mut Option<u64>) -> DecodeResult<ServerFrame> {
    let (frame, what) = match r.u8("frame kind")? {
        kind::WELCOME => (ServerFrame::Welcome(decode_welcome(r)?), "welcome"),
        kind::REFUSED => (ServerFrame::Refused(decode_op_error(r)?), "refused"),
        kind::REPLY => {
            let request_id = r.u64("request id")?;
            *id = Some(request_id);
            (ServerFrame::Reply { id: request_id, reply: decode_reply_body(r)? }, "reply")
        }
        kind::SHARED_REPLY => {
            let request_id = r.u64("request id")?;
            *id = Some(request_id);
            let slab = r.u64("slab")?;
            let len = r.u64("shared reply length")?;
            (ServerFrame::SharedReply { id: request_id, slab, len }, "shared reply")
        }
        kind::BARRIER_CHANNEL => {
            let request_id = r.u64("request id")?;
            *id = Some(request_id);
            let channel = r.u64("channel")?;
            let slot = r.u32("slot")?;
            (ServerFrame::BarrierChannel { id: request_id, channel, slot }, "barrier channel")
        }
        kind::NO_BARRIER_CHANNEL => {
            let request_id = r.u64("request id")?;
            *id = Some(request_id);
            (ServerFrame::NoBarrierChannel { id: request_id, reason: r.string("reason")? }, "no barrier channel")
        }
        kind::AUTH_CHALLENGE => (ServerFrame::AuthChallenge { nonce: r.array("nonce")? }, "auth challenge"),
        kind::AUTH_ACCEPTED => (ServerFrame::AuthAccepted { proof: r.array("proof")? }, "auth accepted"),
        other => return Err(DecodeError::unknown("server frame kind", other)),
    };
    r.finish(what)?;
    Ok(frame)
}
