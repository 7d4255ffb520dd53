//! Reply layouts (docs/PROTOCOL.md, "Replies"). A reply is one tag byte: below
//! 0x80 a [`Response`], from 0x80 up an [`OpError`] (see `op_error.rs`).

use bytes::{BufMut, Bytes, BytesMut};
use rallypoint_core::{Gathered, Reply, Response};

use super::op_error::{decode_op_error_fields, encode_op_error, ERROR_TAG_BIT};
use super::request::{blobs, put_blobs};
use super::wire::{DecodeError, DecodeResult, Reader, WireWrite};

/// One tag per [`Response`] variant. Values are part of the protocol: never renumber.
mod tag {
    pub const DONE: u8 = 0x01;
    pub const VALUE: u8 = 0x02;
    pub const INT: u8 = 0x03;
    pub const BOOL: u8 = 0x04;
    pub const VALUES: u8 = 0x05;
    pub const GATHERED: u8 = 0x06;
    pub const POPPED: u8 = 0x07;
}

/// A shared tail shorter than this is copied into the frame after all: writing it
/// on its own would cost more than the copy, and small replies batch into one write.
const SHARED_TAIL_MIN: usize = 4096;

pub(crate) fn encode_reply_body(reply: &Reply, dst: &mut BytesMut) {
    match reply {
        Ok(response) => encode_response(response, dst),
        Err(error) => encode_op_error(error, dst),
    }
}

/// Encodes the reply body into `dst` like [`encode_reply_body`], except for its
/// trailing bytes when the reply shares them with other replies: a value (held by
/// the store, or a broadcast's root value every member gets), or an all-gather's
/// values, encoded once for every member ([`Gathered::encoding`]). Those are
/// returned, uncopied, to be written right after `dst`; the body is both together.
pub(crate) fn encode_reply_body_shared(reply: &Reply, dst: &mut BytesMut) -> Option<Bytes> {
    let tail = match reply {
        Ok(Response::Value(value)) if value.len() >= SHARED_TAIL_MIN => {
            dst.put_u8(tag::VALUE);
            dst.put_count(value.len());
            value.clone()
        }
        Ok(Response::Gathered(gathered)) => {
            dst.put_u8(tag::GATHERED);
            gathered_encoding(gathered).clone()
        }
        _ => {
            encode_reply_body(reply, dst);
            return None;
        }
    };
    if tail.len() < SHARED_TAIL_MIN {
        dst.put_slice(&tail);
        return None;
    }
    Some(tail)
}

/// Length of the fields after the tag of a Gathered reply; saturates rather than wrap.
pub(crate) fn gathered_len(gathered: &Gathered) -> usize {
    match gathered.cached_encoding() {
        Some(encoding) => encoding.len(),
        None => list_len(gathered.len(), gathered.values_len()),
    }
}

/// Length of a `list<bytes>`; saturates rather than wrap.
pub(crate) fn blobs_len(blobs: &[Bytes]) -> usize {
    list_len(blobs.len(), blobs.iter().map(Bytes::len).fold(0, usize::saturating_add))
}

/// Length of a `list<bytes>` of `count` items of `bytes` together: the count, then
/// each item with its length. Saturates rather than wrap.
fn list_len(count: usize, bytes: usize) -> usize {
    count.saturating_add(1).saturating_mul(4).saturating_add(bytes)
}

/// The `list<bytes>` of a Gathered reply, encoded by the first reply that needs it.
fn gathered_encoding(gathered: &Gathered) -> &Bytes {
    gathered.encoding(|values| {
        let mut encoding = BytesMut::with_capacity(blobs_len(values));
        put_blobs(&mut encoding, values);
        encoding.freeze()
    })
}

pub(crate) fn decode_reply_body(r: &mut Reader) -> DecodeResult<Reply> {
    let tag = r.u8("reply tag")?;
    if tag & ERROR_TAG_BIT != 0 {
        Ok(Err(decode_op_error_fields(tag, r)?))
    } else {
        Ok(Ok(decode_response_fields(tag, r)?))
    }
}

fn encode_response(response: &Response, dst: &mut BytesMut) {
    match response {
        Response::Done => dst.put_u8(tag::DONE),
        Response::Value(value) => {
            dst.put_u8(tag::VALUE);
            dst.put_blob(value);
        }
        Response::Int(n) => {
            dst.put_u8(tag::INT);
            dst.put_i64_le(*n);
        }
        Response::Bool(b) => {
            dst.put_u8(tag::BOOL);
            dst.put_bool(*b);
        }
        Response::Values(values) => {
            dst.put_u8(tag::VALUES);
            put_blobs(dst, values);
        }
        Response::Gathered(gathered) => {
            dst.put_u8(tag::GATHERED);
            // Encoding into a buffer of its own first would cost a second copy.
            match gathered.cached_encoding() {
                Some(encoding) => dst.put_slice(encoding),
                None => put_blobs(dst, gathered),
            }
        }
        Response::Popped { len_before, value } => {
            dst.put_u8(tag::POPPED);
            dst.put_i64_le(*len_before);
            dst.put_option(value.as_deref(), BytesMut::put_blob);
        }
    }
}

fn decode_response_fields(tag: u8, r: &mut Reader) -> DecodeResult<Response> {
    Ok(match tag {
        tag::DONE => Response::Done,
        tag::VALUE => Response::Value(r.bytes("value")?),
        tag::INT => Response::Int(r.i64("int")?),
        tag::BOOL => Response::Bool(r.bool("bool")?),
        tag::VALUES => Response::Values(blobs(r, "values")?),
        // Kept as the bytes read, its values sliced out on access: a node agent
        // passing the reply on to its rank writes them as they are.
        tag::GATHERED => Response::Gathered(r.split("gathered", Gathered::decode)?),
        tag::POPPED => {
            Response::Popped { len_before: r.i64("len_before")?, value: r.option("value", |r| r.bytes("value"))? }
        }
        other => return Err(DecodeError::unknown("reply tag", other)),
    })
}
