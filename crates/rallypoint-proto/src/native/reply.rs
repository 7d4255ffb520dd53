//! Reply layouts (docs/PROTOCOL.md, "Replies"). A reply is one tag byte: below
//! 0x80 a [`Response`], from 0x80 up an [`OpError`] (see `op_error.rs`).

use std::sync::Arc;

use bytes::{BufMut, BytesMut};
use rallypoint_core::{Reply, Response};

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

pub(crate) fn encode_reply_body(reply: &Reply, dst: &mut BytesMut) {
    match reply {
        Ok(response) => encode_response(response, dst),
        Err(error) => encode_op_error(error, dst),
    }
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
        Response::Gathered(values) => {
            dst.put_u8(tag::GATHERED);
            put_blobs(dst, values);
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
        tag::GATHERED => Response::Gathered(Arc::from(blobs(r, "gathered")?)),
        tag::POPPED => Response::Popped {
            len_before: r.i64("len_before")?,
            value: r.option("value", |r| r.bytes("value"))?,
        },
        other => return Err(DecodeError::unknown("reply tag", other)),
    })
}
