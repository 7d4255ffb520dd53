//! Wire codecs of rallypoint.
//!
//! [`native`] is rallypoint's own framed binary protocol, specified in
//! `docs/PROTOCOL.md`; [`tcpstore`] is PyTorch's TCPStore protocol, which the
//! coordinator serves on the same port (`docs/TCPSTORE.md`). Codecs are sans-I/O: they encode into and decode from
//! [`bytes::BytesMut`] buffers that the caller fills from and drains to a socket.

pub mod native;
pub mod tcpstore;
