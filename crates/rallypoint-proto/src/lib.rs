//! Wire codecs of rallypoint.
//!
//! [`native`] is rallypoint's own framed binary protocol, specified in
//! `docs/PROTOCOL.md`. Codecs are sans-I/O: they encode into and decode from
//! [`bytes::BytesMut`] buffers that the caller fills from and drains to a socket.

pub mod native;
