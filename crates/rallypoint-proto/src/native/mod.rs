//! rallypoint's native protocol: a preamble, then length-prefixed binary frames
//! in both directions. Requests carry ids so that one connection pipelines many
//! requests and waits; replies come back in any order. The full specification,
//! with every opcode and field layout, is `docs/PROTOCOL.md`.

mod agent;
mod error;
mod frame;
mod identity;
mod op_error;
mod reply;
mod request;
mod wire;

use bytes::{Buf, BufMut, Bytes, BytesMut};

pub use agent::{
    decode_agent_frame, decode_root_frame, encode_agent_frame, encode_root_frame, encode_sub_replies,
    encode_sub_replies_shared, encode_sub_reply, encode_sub_reply_shared, starts_with_agent_hello, AgentFrame,
    RootFrame, MAX_CALLS_PER_FRAME,
};
pub use error::ProtoError;
pub use frame::{
    decode_client_frame, decode_server_frame, decode_shared_reply, encode_client_frame, encode_reply,
    encode_reply_body_parts, encode_reply_shared, encode_request_frame, encode_server_frame, pending_frame_len,
    reply_payload_len, ClientFrame, FrameLimits, ServerFrame, MAX_FRAME_LEN, NONCE_LEN, PROOF_LEN,
};

/// First bytes a native client sends. A PyTorch TCPStore client's first byte is
/// 0x00, so a server sharing one port tells them apart by the first byte alone.
pub const MAGIC: [u8; 4] = *b"RLLY";
/// Protocol version this crate speaks.
pub const VERSION: u16 = 1;
/// [`MAGIC`] followed by the u16 LE version.
pub const PREAMBLE_LEN: usize = 6;

/// Appends the preamble a client sends first.
pub fn encode_preamble(dst: &mut BytesMut) {
    dst.put_slice(&MAGIC);
    dst.put_u16_le(VERSION);
}

/// `Ok(None)`: fewer than [`PREAMBLE_LEN`] bytes so far, all matching [`MAGIC`].
/// `Ok(Some(version))`: consumed the preamble; the caller decides whether it
/// speaks that version. Fails as soon as a received byte differs from [`MAGIC`].
pub fn decode_preamble(src: &mut BytesMut) -> Result<Option<u16>, ProtoError> {
    let seen = &src[..src.len().min(MAGIC.len())];
    if !MAGIC.starts_with(seen) {
        return Err(ProtoError::BadMagic { got: Bytes::copy_from_slice(seen) });
    }
    if src.len() < PREAMBLE_LEN {
        return Ok(None);
    }
    src.advance(MAGIC.len());
    Ok(Some(src.get_u16_le()))
}
