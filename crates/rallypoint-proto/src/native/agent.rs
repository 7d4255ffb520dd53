//! Frames between a node agent and the coordinator (docs/PROTOCOL.md, section 12).
//!
//! A node agent accepts the ordinary native protocol from the ranks of its node and
//! holds one connection to the coordinator, over which each local rank is a
//! *sub-session* named by an agent-chosen `sub` id: the coordinator keeps one
//! engine session per rank, so every semantic stays exactly that of a direct
//! connection. The connection starts with the usual preamble; its first frame is an
//! [`AgentFrame::Hello`] instead of a client Hello.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use rallypoint_core::{Identity, OpError, Reply, Request, Welcome};

use super::error::ProtoError;
use super::frame::{
    frameable, kind, oversized, take_frame, write_frame, write_frame_shared, FrameLimits, Oversized, LEN_PREFIX,
};
use super::identity::{decode_identity, decode_welcome, encode_identity, encode_welcome};
use super::op_error::{decode_op_error, encode_op_error};
use super::reply::{decode_reply_body, encode_reply_body, encode_reply_body_shared};
use super::request::{decode_request, encode_request};
use super::wire::{DecodeError, DecodeResult, Reader, WireWrite};

/// A frame a node agent sends to the coordinator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentFrame {
    /// First frame after the preamble: this connection carries sub-sessions.
    Hello { host: String, pid: u32 },
    /// A local rank said hello; `sub` is never reused on this connection.
    SubHello { sub: u64, identity: Identity },
    /// A request of sub-session `sub`, exactly as its rank sent it.
    SubRequest { sub: u64, id: u64, request: Request },
    /// The local rank's connection ended. The coordinator decides, as for a direct
    /// connection, whether that is a clean leave (a Leave came first) or a loss.
    /// `gone`: the agent, on the rank's host, found its process gone (no reconnect
    /// grace: the rank is lost at once).
    SubClose { sub: u64, gone: bool },
    /// The same request from every listed `(sub, id)` call, as if each had sent its
    /// SubRequest here, in list order: a node's arrivals at one barrier in one frame.
    SubRequests { calls: Vec<(u64, u64)>, request: Request },
}

/// A frame the coordinator sends to a node agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RootFrame {
    /// The agent hello was accepted; `lease_ms` is the coordinator's lease.
    Welcome {
        lease_ms: u64,
    },
    /// The agent hello was refused; the coordinator closes the connection.
    Refused(OpError),
    SubWelcome {
        sub: u64,
        welcome: Welcome,
    },
    /// The sub-session's hello was refused; nothing of it remains on the coordinator.
    SubRefused {
        sub: u64,
        error: OpError,
    },
    SubReply {
        sub: u64,
        id: u64,
        reply: Reply,
    },
    /// The same reply to every listed `(sub, id)` call: a barrier's release for a node.
    SubReplies {
        calls: Vec<(u64, u64)>,
        reply: Reply,
    },
}

/// Bytes one `(sub, id)` call takes in a SubRequests or SubReplies frame.
const CALL_LEN: usize = 16;
/// Most calls rallypoint puts in one SubRequests or SubReplies frame (64 KiB of call
/// list): larger groups are split, so no frame comes near a frame limit. A receiver
/// takes any count that fits in the frame.
pub const MAX_CALLS_PER_FRAME: usize = 4096;

/// True if `src`, read right after the preamble, starts with an agent hello; `None`
/// until its frame-kind byte has arrived.
pub fn starts_with_agent_hello(src: &[u8]) -> Option<bool> {
    src.get(LEN_PREFIX).map(|&kind| kind == kind::AGENT_HELLO)
}

pub fn encode_agent_frame(frame: &AgentFrame, dst: &mut BytesMut) {
    write_frame(dst, |dst| match frame {
        AgentFrame::Hello { host, pid } => {
            dst.put_u8(kind::AGENT_HELLO);
            dst.put_str(host);
            dst.put_u32_le(*pid);
        }
        AgentFrame::SubHello { sub, identity } => {
            dst.put_u8(kind::SUB_HELLO);
            dst.put_u64_le(*sub);
            encode_identity(identity, dst);
        }
        AgentFrame::SubRequest { sub, id, request } => {
            dst.put_u8(kind::SUB_REQUEST);
            dst.put_u64_le(*sub);
            dst.put_u64_le(*id);
            encode_request(request, dst);
        }
        AgentFrame::SubClose { sub, gone } => {
            dst.put_u8(kind::SUB_CLOSE);
            dst.put_u64_le(*sub);
            dst.put_u8(u8::from(*gone));
        }
        AgentFrame::SubRequests { calls, request } => {
            dst.put_u8(kind::SUB_REQUESTS);
            put_calls(calls, dst);
            encode_request(request, dst);
        }
    });
}

pub fn encode_root_frame(frame: &RootFrame, dst: &mut BytesMut) {
    match frame {
        RootFrame::Welcome { lease_ms } => write_frame(dst, |dst| {
            dst.put_u8(kind::AGENT_WELCOME);
            dst.put_u64_le(*lease_ms);
        }),
        RootFrame::Refused(error) => write_frame(dst, |dst| {
            dst.put_u8(kind::REFUSED);
            encode_op_error(error, dst);
        }),
        RootFrame::SubWelcome { sub, welcome } => write_frame(dst, |dst| {
            dst.put_u8(kind::SUB_WELCOME);
            dst.put_u64_le(*sub);
            encode_welcome(welcome, dst);
        }),
        RootFrame::SubRefused { sub, error } => write_frame(dst, |dst| {
            dst.put_u8(kind::SUB_REFUSED);
            dst.put_u64_le(*sub);
            encode_op_error(error, dst);
        }),
        RootFrame::SubReply { sub, id, reply } => encode_sub_reply(*sub, *id, reply, dst),
        RootFrame::SubReplies { calls, reply } => {
            if let Some(tail) = encode_sub_replies_frame(calls, reply, dst) {
                dst.extend_from_slice(&tail);
            }
        }
    }
}

/// Encodes the same reply to every call in `calls`: one SubReplies frame, or a plain
/// SubReply for a single call. A reply that could not be framed with the call list in
/// front goes as one SubReply per call instead (each then framed, or turned into
/// `TooLarge`, on its own, exactly as without aggregation).
pub fn encode_sub_replies(calls: &[(u64, u64)], reply: &Reply, dst: &mut BytesMut) {
    if let Some(tail) = encode_sub_replies_shared(calls, reply, dst) {
        dst.extend_from_slice(&tail);
    }
}

/// [`encode_sub_replies`] with a large shared tail returned uncopied, as in
/// [`encode_sub_reply_shared`]: an all-gather's values go to a node once, not once
/// per rank.
pub fn encode_sub_replies_shared(calls: &[(u64, u64)], reply: &Reply, dst: &mut BytesMut) -> Option<Bytes> {
    match calls {
        [(sub, id)] => encode_sub_reply_shared(*sub, *id, reply, dst),
        _ => encode_sub_replies_frame(calls, reply, dst),
    }
}

/// Encodes `RootFrame::SubReplies` as it is (any number of calls), its shared tail
/// returned uncopied; falls back to one SubReply per call as [`encode_sub_replies`]
/// says.
fn encode_sub_replies_frame(calls: &[(u64, u64)], reply: &Reply, dst: &mut BytesMut) -> Option<Bytes> {
    let header = 4usize.saturating_add(calls.len().saturating_mul(CALL_LEN));
    match frameable(reply, header) {
        std::borrow::Cow::Borrowed(reply) => write_frame_shared(dst, |dst| {
            dst.put_u8(kind::SUB_REPLIES);
            put_calls(calls, dst);
            encode_reply_body_shared(reply, dst)
        }),
        std::borrow::Cow::Owned(_) => {
            for &(sub, id) in calls {
                encode_sub_reply(sub, id, reply, dst);
            }
            None
        }
    }
}

fn put_calls(calls: &[(u64, u64)], dst: &mut BytesMut) {
    // Callers bound a frame's calls far below u32::MAX (the frame length is a u32).
    dst.put_u32_le(u32::try_from(calls.len()).unwrap_or(u32::MAX));
    for &(sub, id) in calls {
        dst.put_u64_le(sub);
        dst.put_u64_le(id);
    }
}

fn calls(r: &mut Reader) -> DecodeResult<Vec<(u64, u64)>> {
    r.list("calls", CALL_LEN, |r| Ok((r.u64("sub-session")?, r.u64("request id")?)))
}

/// Encodes `RootFrame::SubReply` without owning the reply; a reply too long to
/// frame becomes `TooLarge`, as in [`super::encode_reply`].
pub fn encode_sub_reply(sub: u64, id: u64, reply: &Reply, dst: &mut BytesMut) {
    let reply = frameable(reply, 8);
    write_frame(dst, |dst| {
        dst.put_u8(kind::SUB_REPLY);
        dst.put_u64_le(sub);
        dst.put_u64_le(id);
        encode_reply_body(&reply, dst);
    });
}

/// [`encode_sub_reply`] with a large shared tail returned uncopied, as in
/// [`super::encode_reply_shared`]: the caller writes it right after `dst`'s bytes.
pub fn encode_sub_reply_shared(sub: u64, id: u64, reply: &Reply, dst: &mut BytesMut) -> Option<Bytes> {
    let reply = frameable(reply, 8);
    write_frame_shared(dst, |dst| {
        dst.put_u8(kind::SUB_REPLY);
        dst.put_u64_le(sub);
        dst.put_u64_le(id);
        encode_reply_body_shared(&reply, dst)
    })
}

/// Decodes the next agent frame; same contract as [`super::decode_client_frame`].
/// A bad frame yields [`ProtoError::BadSubFrame`] with the sub-session and request
/// id if they could be read, so the coordinator can answer that request.
pub fn decode_agent_frame(src: &mut BytesMut, limits: &FrameLimits) -> Result<Option<AgentFrame>, ProtoError> {
    let body = match take_frame(src, limits) {
        Ok(Some(body)) => body,
        Ok(None) => return Ok(None),
        Err(ProtoError::FrameTooLarge { len, max, .. }) => {
            // A rank's request: its sub-session and id follow its prefix and kind.
            return match oversized::<2>(src, kind::SUB_REQUEST) {
                Oversized::Wait => Ok(None),
                Oversized::Ids([sub, id]) => {
                    src.advance(LEN_PREFIX);
                    Err(ProtoError::SubRequestTooLarge { sub, id, len, max })
                }
                Oversized::Other => Err(ProtoError::FrameTooLarge { len, max, id: None }),
            };
        }
        Err(error) => return Err(error),
    };
    let mut ids = Ids::default();
    agent_body(&mut Reader::new(body), &mut ids).map(Some).map_err(|DecodeError(message)| ids.error(message))
}

/// Decodes the next coordinator frame; same contract as [`decode_agent_frame`].
pub fn decode_root_frame(src: &mut BytesMut, limits: &FrameLimits) -> Result<Option<RootFrame>, ProtoError> {
    let Some(body) = take_frame(src, limits)? else {
        return Ok(None);
    };
    let mut ids = Ids::default();
    root_body(&mut Reader::new(body), &mut ids).map(Some).map_err(|DecodeError(message)| ids.error(message))
}

/// What a bad frame let us read of whom it was for, so that they can be answered.
#[derive(Default)]
struct Ids {
    sub: Option<u64>,
    id: Option<u64>,
    /// The call list of an aggregated frame.
    calls: Option<Vec<(u64, u64)>>,
}

impl Ids {
    fn error(self, message: String) -> ProtoError {
        match self.calls {
            Some(calls) => ProtoError::BadSubCalls { calls, message },
            None => ProtoError::BadSubFrame { sub: self.sub, id: self.id, message },
        }
    }
}

fn agent_body(r: &mut Reader, ids: &mut Ids) -> DecodeResult<AgentFrame> {
    let frame = match r.u8("frame kind")? {
        kind::AGENT_HELLO => AgentFrame::Hello { host: r.string("host")?, pid: r.u32("pid")? },
        kind::SUB_HELLO => {
            let sub = sub_id(r, ids)?;
            AgentFrame::SubHello { sub, identity: decode_identity(r)? }
        }
        kind::SUB_REQUEST => {
            let sub = sub_id(r, ids)?;
            let id = r.u64("request id")?;
            ids.id = Some(id);
            AgentFrame::SubRequest { sub, id, request: decode_request(r)? }
        }
        kind::SUB_CLOSE => AgentFrame::SubClose { sub: sub_id(r, ids)?, gone: r.bool("gone")? },
        kind::SUB_REQUESTS => {
            ids.calls = Some(calls(r)?);
            let request = decode_request(r)?;
            AgentFrame::SubRequests { calls: ids.calls.take().unwrap_or_default(), request }
        }
        other => return Err(DecodeError::unknown("agent frame kind", other)),
    };
    let what = match &frame {
        AgentFrame::Hello { .. } => "agent hello",
        AgentFrame::SubHello { .. } => "sub-session hello",
        AgentFrame::SubRequest { request, .. } | AgentFrame::SubRequests { request, .. } => request.name(),
        AgentFrame::SubClose { .. } => "sub-session close",
    };
    if let Err(error) = r.finish(what) {
        // Trailing bytes after a whole request: every call is answered, as for a bad one.
        if let AgentFrame::SubRequests { calls, .. } = frame {
            ids.calls = Some(calls);
        }
        return Err(error);
    }
    Ok(frame)
}

fn root_body(r: &mut Reader, ids: &mut Ids) -> DecodeResult<RootFrame> {
    let (frame, what) = match r.u8("frame kind")? {
        kind::AGENT_WELCOME => (RootFrame::Welcome { lease_ms: r.u64("lease_ms")? }, "agent welcome"),
        kind::REFUSED => (RootFrame::Refused(decode_op_error(r)?), "refused"),
        kind::SUB_WELCOME => {
            let sub = sub_id(r, ids)?;
            (RootFrame::SubWelcome { sub, welcome: decode_welcome(r)? }, "sub-session welcome")
        }
        kind::SUB_REFUSED => {
            let sub = sub_id(r, ids)?;
            (RootFrame::SubRefused { sub, error: decode_op_error(r)? }, "sub-session refusal")
        }
        kind::SUB_REPLY => {
            let sub = sub_id(r, ids)?;
            let id = r.u64("request id")?;
            ids.id = Some(id);
            (RootFrame::SubReply { sub, id, reply: decode_reply_body(r)? }, "sub-session reply")
        }
        kind::SUB_REPLIES => {
            ids.calls = Some(calls(r)?);
            let reply = decode_reply_body(r)?;
            (RootFrame::SubReplies { calls: ids.calls.take().unwrap_or_default(), reply }, "sub-session replies")
        }
        other => return Err(DecodeError::unknown("coordinator frame kind", other)),
    };
    if let Err(error) = r.finish(what) {
        if let RootFrame::SubReplies { calls, .. } = frame {
            ids.calls = Some(calls);
        }
        return Err(error);
    }
    Ok(frame)
}

fn sub_id(r: &mut Reader, ids: &mut Ids) -> DecodeResult<u64> {
    let sub = r.u64("sub-session")?;
    ids.sub = Some(sub);
    Ok(sub)
}
