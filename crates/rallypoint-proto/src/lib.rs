//! Wire codecs of rallypoint.
//!
//! [`native`] is rallypoint's own framed binary protocol, specified in
//! `docs/PROTOCOL.md`; [`tcpstore`] is PyTorch's TCPStore protocol, which the
//! coordinator serves on the same port (`docs/TCPSTORE.md`). Codecs are sans-I/O: they encode into and decode from
//! [`bytes::BytesMut`] buffers that the caller fills from and drains to a socket.

pub mod native;
pub mod tcpstore;

use rallypoint_core::Limits;

/// The largest sum of keys and values one request may carry under `limits`:
/// [`Limits::max_request_len`], but never less than one key and two values of the
/// largest sizes (compare_set), which are always accepted.
pub fn max_request_len(limits: &Limits) -> usize {
    let single = limits.max_value_len.saturating_mul(2).saturating_add(limits.max_key_len);
    limits.max_request_len.max(single)
}
