//! Errors of the native codec.

use bytes::Bytes;

/// What was wrong with bytes received from a peer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    /// The connection does not start with [`super::MAGIC`]. `got` holds the
    /// (up to four) bytes that differ from it or precede the difference.
    #[error("not a rallypoint native client: expected magic \"RLLY\", got \"{}\"", got.escape_ascii())]
    BadMagic { got: Bytes },

    /// A length prefix above the receiver's limit: the peer is broken or hostile,
    /// and nothing after it can be trusted. `id`: the request id, where the frame
    /// is a client's request whose id came with its prefix (a request too large for
    /// any limit: its call can still be answered before the connection closes).
    #[error("frame of {len} bytes exceeds the limit of {max} bytes")]
    FrameTooLarge { len: usize, max: usize, id: Option<u64> },

    /// A client frame arrived whole but its contents do not decode. The frame was
    /// consumed; `id` is the request id if it could be read.
    #[error("malformed request{}: {message}", id_suffix(*id))]
    BadRequest { id: Option<u64>, message: String },

    /// A server frame arrived whole but its contents do not decode. The frame was
    /// consumed; `id` is the request id of the reply if it could be read.
    #[error("malformed server frame{}: {message}", id_suffix(*id))]
    BadReply { id: Option<u64>, message: String },

    /// A frame between a node agent and the coordinator arrived whole but does not
    /// decode. The frame was consumed; `sub` and `id` are its sub-session and
    /// request id if they could be read.
    #[error("malformed agent frame{}{}: {message}", sub.map(|s| format!(" (sub-session {s})")).unwrap_or_default(), id_suffix(*id))]
    BadSubFrame { sub: Option<u64>, id: Option<u64>, message: String },

    /// A rank's request, forwarded by its node agent, longer than this receiver's
    /// frame limit (a coordinator with smaller limits than the agent's). Not fatal:
    /// its prefix was consumed, and the receiver skips the `len` bytes of its body
    /// as they come, answering the call (`sub`, `id`) with an error, so that one
    /// rank's request does not cost the agent's link and every rank of its node.
    #[error("a request of {len} bytes (sub-session {sub}, request id {id}) exceeds the limit of {max} bytes")]
    SubRequestTooLarge { sub: u64, id: u64, len: usize, max: usize },

    /// An aggregated agent frame (SubRequests or SubReplies) whose call list was read
    /// but whose request or reply does not decode. The frame was consumed; every
    /// listed (sub-session, request id) call needs an answer.
    #[error("malformed agent frame for {} call(s): {message}", calls.len())]
    BadSubCalls { calls: Vec<(u64, u64)>, message: String },
}

impl ProtoError {
    /// True if the byte stream is out of sync or untrustworthy and the connection
    /// must be closed; false if only one whole frame was bad and was skipped.
    pub fn is_fatal(&self) -> bool {
        match self {
            ProtoError::BadMagic { .. } | ProtoError::FrameTooLarge { .. } => true,
            ProtoError::BadRequest { .. }
            | ProtoError::BadReply { .. }
            | ProtoError::BadSubFrame { .. }
            | ProtoError::SubRequestTooLarge { .. }
            | ProtoError::BadSubCalls { .. } => false,
        }
    }
}

fn id_suffix(id: Option<u64>) -> String {
    id.map(|id| format!(" (request id {id})")).unwrap_or_default()
}
