//! Truncated, oversized and garbage input gives errors, never panics, and
//! non-fatal errors leave the stream in sync.

mod common;

use bytes::{BufMut, Bytes, BytesMut};
use common::{client_frame, server_frame};
use proptest::prelude::*;
use rallypoint_core::{Gathered, Limits, OpError, Request, Response};
use rallypoint_proto::native::{
    decode_client_frame, decode_preamble, decode_server_frame, encode_client_frame, encode_preamble, encode_reply,
    encode_server_frame, ClientFrame, FrameLimits, ProtoError, ServerFrame, MAX_FRAME_LEN,
};

/// A whole frame holding `body`.
fn frame(body: &[u8]) -> BytesMut {
    let mut buf = BytesMut::new();
    buf.put_u32_le(body.len() as u32);
    buf.put_slice(body);
    buf
}

/// A request body with id 7: frame kind, id, then `rest` (opcode and fields).
fn request_body(rest: &[u8]) -> Vec<u8> {
    let mut body = vec![0x02];
    body.extend_from_slice(&7u64.to_le_bytes());
    body.extend_from_slice(rest);
    body
}

/// Decodes one client frame that must be malformed; checks it was consumed whole.
fn bad_request(body: &[u8]) -> (Option<u64>, String) {
    let mut src = frame(body);
    match decode_client_frame(&mut src, &FrameLimits::default()) {
        Err(ProtoError::BadRequest { id, message }) => {
            assert!(src.is_empty(), "malformed frame not consumed");
            (id, message)
        }
        other => panic!("expected BadRequest, got {other:?}"),
    }
}

#[test]
fn unknown_opcode_names_it() {
    assert_eq!(bad_request(&request_body(&[0x7f])), (Some(7), "unknown request opcode 0x7f".into()));
}

#[test]
fn unknown_frame_kind_and_empty_body() {
    assert_eq!(bad_request(&[0x83]), (None, "unknown client frame kind 0x83".into()));
    let (id, message) = bad_request(&[]);
    assert_eq!(id, None);
    assert!(message.contains("frame kind"), "{message}");
}

#[test]
fn truncated_field_is_named() {
    // get: key claims 10 bytes, only 2 follow.
    let (id, message) = bad_request(&request_body(&[0x02, 10, 0, 0, 0, b'a', b'b']));
    assert_eq!(id, Some(7));
    assert_eq!(message, "truncated field 'key': needs 10 bytes, 2 left");
    // A request id cut short: no id to report.
    assert_eq!(bad_request(&[0x02, 1, 2, 3]).0, None);
}

#[test]
fn trailing_bytes_are_rejected() {
    let (_, message) = bad_request(&request_body(&[0x11, 0xee]));
    assert_eq!(message, "1 unexpected trailing bytes after heartbeat");
}

/// A u32-length-prefixed field of `bytes`.
fn field(bytes: &[u8]) -> Vec<u8> {
    let mut out = u32::try_from(bytes.len()).expect("a short field").to_le_bytes().to_vec();
    out.extend_from_slice(bytes);
    out
}

#[test]
fn invalid_utf8_names_the_field() {
    // barrier with name = [0xff]
    let (_, message) = bad_request(&request_body(&[0x0d, 1, 0, 0, 0, 0xff, 0, 0]));
    assert_eq!(message, "field 'name' is not valid UTF-8");
    // The same past what a name keeps inline.
    let mut long = vec![b'a'; 40];
    long.push(0xff);
    let (_, message) = bad_request(&request_body(&[&[0x0d][..], &field(&long), &[0, 0]].concat()));
    assert_eq!(message, "field 'name' is not valid UTF-8");
    // abort with reason = [0xc3] (a character cut short): a string field, not a name.
    let (_, message) = bad_request(&request_body(&[&[0x10][..], &field(&[b'x', 0xc3])].concat()));
    assert_eq!(message, "field 'reason' is not valid UTF-8");
}

#[test]
fn invalid_flags_and_tags() {
    let (_, message) = bad_request(&request_body(&[0x02, 0, 0, 0, 0, 7]));
    assert_eq!(message, "field 'timeout_ms': invalid option flag 0x07");
    let (_, message) = bad_request(&request_body(&[0x0d, 0, 0, 0, 0, 9]));
    assert_eq!(message, "unknown members tag 0x09");
}

#[test]
fn huge_list_count_fails_without_allocating() {
    let (_, message) = bad_request(&request_body(&[0x07, 0xff, 0xff, 0xff, 0xff, 0, 0]));
    assert_eq!(message, "field 'keys': 4294967295 items cannot fit in the 2 bytes left");
    let (_, message) = bad_request(&request_body(&[0x0d, 0, 0, 0, 0, 1, 0xff, 0xff, 0xff, 0x3f]));
    assert!(message.contains("cannot fit"), "{message}");
}

#[test]
fn oversized_frames_are_fatal() {
    let limits = FrameLimits { max_frame_len: 16 };
    let mut src = BytesMut::new();
    src.put_u32_le(17);
    // Not before its id has come, where it may be a request.
    assert_eq!(decode_client_frame(&mut src, &limits), Ok(None));
    src.put_u8(0x02);
    src.put_u64_le(42);
    let err = decode_client_frame(&mut src, &limits).unwrap_err();
    assert_eq!(err, ProtoError::FrameTooLarge { len: 17, max: 16, id: Some(42) });
    assert!(err.is_fatal());
    // Another kind of frame is refused at once, with no id.
    let mut src = BytesMut::new();
    src.put_u32_le(17);
    src.put_u8(0x01);
    let err = decode_client_frame(&mut src, &limits).unwrap_err();
    assert_eq!(err, ProtoError::FrameTooLarge { len: 17, max: 16, id: None });
    // u32::MAX is reserved: rejected even without a limit.
    let mut src = BytesMut::from(&[0xff, 0xff, 0xff, 0xff][..]);
    let err = decode_server_frame(&mut src, &FrameLimits::unbounded()).unwrap_err();
    assert!(matches!(err, ProtoError::FrameTooLarge { .. }) && err.is_fatal());
}

#[test]
fn partial_frames_wait_for_more() {
    let mut whole = BytesMut::new();
    encode_client_frame(&ClientFrame::Request { id: 1, request: Request::NumKeys }, &mut whole);
    for cut in 0..whole.len() {
        let mut src = BytesMut::from(&whole[..cut]);
        assert_eq!(decode_client_frame(&mut src, &FrameLimits::default()), Ok(None));
        assert_eq!(src.len(), cut, "partial frame must not be consumed");
    }
}

#[test]
fn malformed_server_frames() {
    // Refused carrying a response tag instead of an error tag.
    let mut src = frame(&[0x82, 0x01]);
    assert_eq!(
        decode_server_frame(&mut src, &FrameLimits::default()),
        Err(ProtoError::BadReply { id: None, message: "unknown error tag 0x01".into() })
    );
    // Reply with a bool of 2.
    let mut body = vec![0x83];
    body.extend_from_slice(&5u64.to_le_bytes());
    body.extend_from_slice(&[0x04, 0x02]);
    let err = decode_server_frame(&mut frame(&body), &FrameLimits::default()).unwrap_err();
    assert_eq!(err, ProtoError::BadReply { id: Some(5), message: "field 'bool': invalid bool 0x02".into() });
    assert!(!err.is_fatal());
    assert_eq!(err.to_string(), "malformed server frame (request id 5): field 'bool': invalid bool 0x02");
}

/// The message of a Reply frame for request 5 holding a Gathered reply of `fields`,
/// which must be malformed; checks the frame was consumed whole.
fn bad_gathered_reply(fields: &[u8]) -> String {
    let body = [&[0x83][..], &5u64.to_le_bytes(), &[0x06], fields].concat();
    let mut src = frame(&body);
    match decode_server_frame(&mut src, &FrameLimits::default()) {
        Err(error @ ProtoError::BadReply { id: Some(5), .. }) => {
            assert!(src.is_empty(), "malformed frame not consumed");
            assert!(!error.is_fatal());
            let ProtoError::BadReply { message, .. } = error else { unreachable!() };
            message
        }
        other => panic!("expected BadReply, got {other:?}"),
    }
}

#[test]
fn malformed_gathered_replies_name_what_is_wrong() {
    assert_eq!(bad_gathered_reply(&[]), "field 'gathered': the value count needs 4 bytes, 0 left");
    assert_eq!(bad_gathered_reply(&[1, 0]), "field 'gathered': the value count needs 4 bytes, 2 left");
    // Three values take at least 12 bytes: refused before anything is read.
    assert_eq!(
        bad_gathered_reply(&[3, 0, 0, 0, 0, 0, 0, 0]),
        "field 'gathered': 3 values cannot fit in the 4 bytes left"
    );
    assert_eq!(
        bad_gathered_reply(&[0xff, 0xff, 0xff, 0xff, 0, 0]),
        "field 'gathered': 4294967295 values cannot fit in the 2 bytes left"
    );
    // The second value's length field is cut short.
    let cut = [&[2, 0, 0, 0][..], &field(b"abcdefgh"), &[1, 0]].concat();
    assert_eq!(bad_gathered_reply(&cut), "field 'gathered': value 1: its length needs 4 bytes, 2 left");
    // The first value claims 10 bytes; 3 follow.
    let long = [&[1, 0, 0, 0][..], &10u32.to_le_bytes(), b"abc"].concat();
    assert_eq!(bad_gathered_reply(&long), "field 'gathered': value 0: 10 bytes cannot fit in the 3 bytes left");
    let trailing = [&[1, 0, 0, 0][..], &field(b"a"), &[0xee]].concat();
    assert_eq!(bad_gathered_reply(&trailing), "1 unexpected trailing bytes after reply");
}

#[test]
fn preamble() {
    let mut src = BytesMut::new();
    encode_preamble(&mut src);
    assert_eq!(&src[..], b"RLLY\x01\x00");
    src.put_u8(0x42);
    assert_eq!(decode_preamble(&mut src), Ok(Some(1)));
    assert_eq!(&src[..], [0x42], "only the preamble is consumed");

    let mut partial = BytesMut::from(&b"RLL"[..]);
    assert_eq!(decode_preamble(&mut partial), Ok(None));
    let mut future = BytesMut::from(&b"RLLY\x02\x00"[..]);
    assert_eq!(decode_preamble(&mut future), Ok(Some(2)));

    // A TCPStore client is told apart by its first byte alone.
    let mut tcpstore = BytesMut::from(&[0x00][..]);
    let err = decode_preamble(&mut tcpstore).unwrap_err();
    assert_eq!(err, ProtoError::BadMagic { got: Bytes::from_static(&[0x00]) });
    assert!(err.is_fatal());
    assert!(decode_preamble(&mut BytesMut::from(&b"RLX"[..])).is_err());
}

#[test]
fn frame_limits() {
    // 64 MiB of keys and values, 8 bytes of lengths for each of 131,072 entries, 1 MiB of headers.
    assert_eq!(FrameLimits::default().max_frame_len, 66 << 20);
    assert_eq!(FrameLimits::from_limits(&Limits::default()), FrameLimits::default());
    // One key and two values always fit, above max_request_len...
    let big = Limits { max_value_len: 100 << 20, ..Limits::default() };
    assert_eq!(FrameLimits::from_limits(&big).max_frame_len, (200 << 20) + 8192 + (2 << 20));
    // ...and a lower max_request_len lowers the frame limit to them.
    let small = Limits { max_request_len: 1 << 20, ..Limits::default() };
    assert_eq!(FrameLimits::from_limits(&small).max_frame_len, (16 << 20) + 8192 + (2 << 20));
    let absurd = Limits { max_value_len: usize::MAX, ..Limits::default() };
    assert_eq!(FrameLimits::from_limits(&absurd).max_frame_len, MAX_FRAME_LEN);
}

/// The largest multi-set `max_request_len` allows, with the most entries, is one frame.
#[test]
fn a_multi_set_of_max_request_len_fits_in_a_frame() {
    let limits = Limits::default();
    let n = limits.max_keys_per_op;
    let value = Bytes::from(vec![7u8; limits.max_request_len / n - 8]);
    let entries: Vec<(Bytes, Bytes)> = (0..n).map(|i| (Bytes::from(format!("{i:08}")), value.clone())).collect();
    assert_eq!(entries.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>(), limits.max_request_len);
    let frame = ClientFrame::Request { id: u64::MAX, request: Request::MultiSet { entries } };
    let mut src = BytesMut::new();
    encode_client_frame(&frame, &mut src);
    assert_eq!(decode_client_frame(&mut src, &FrameLimits::from_limits(&limits)), Ok(Some(frame)));
}

#[test]
fn unframeable_reply_becomes_too_large() {
    // 65 × 64 MiB exceeds what a u32 length can frame. The buffer is shared and
    // never touched, so this costs no real memory.
    let chunk = Bytes::from(vec![0u8; 64 << 20]);
    let gathered = Gathered::new(vec![chunk; 65]);
    let mut dst = BytesMut::new();
    encode_reply(4, &Ok(Response::Gathered(gathered)), &mut dst);
    match decode_server_frame(&mut dst, &FrameLimits::default()) {
        Ok(Some(ServerFrame::Reply { id: 4, reply: Err(OpError::TooLarge { what, len, limit }) })) => {
            assert_eq!(what, "reply");
            assert_eq!(len, 1 + 8 + 1 + 4 + 65 * (4 + (64 << 20)));
            assert_eq!(limit, MAX_FRAME_LEN as u64);
        }
        other => panic!("expected a TooLarge reply, got {other:?}"),
    }
}

/// Decodes until the input is exhausted or a fatal error; every non-fatal error
/// must have made progress.
fn decode_all<T>(mut src: BytesMut, decode: fn(&mut BytesMut, &FrameLimits) -> Result<Option<T>, ProtoError>) {
    let limits = FrameLimits { max_frame_len: 1 << 16 };
    loop {
        let before = src.len();
        match decode(&mut src, &limits) {
            Ok(None) => return,
            Err(e) if e.is_fatal() => return,
            Ok(Some(_)) | Err(_) => assert!(src.len() < before, "no progress"),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        decode_all(BytesMut::from(&bytes[..]), decode_client_frame);
        decode_all(BytesMut::from(&bytes[..]), decode_server_frame);
        let _ = decode_preamble(&mut BytesMut::from(&bytes[..]));
    }

    /// Random bodies in a valid frame reach deep into the field decoders.
    #[test]
    fn random_bodies_never_panic(kind in prop_oneof![Just(0x01u8), Just(0x02), Just(0x81), Just(0x82), Just(0x83)],
                                 rest in proptest::collection::vec(any::<u8>(), 0..128)) {
        let mut body = vec![kind];
        body.extend_from_slice(&rest);
        decode_all(frame(&body), decode_client_frame);
        decode_all(frame(&body), decode_server_frame);
    }

    /// Valid frames with one byte corrupted: errors or other frames, never a panic.
    #[test]
    fn corrupted_frames_never_panic(client in client_frame(), server in server_frame(),
                                    at in any::<prop::sample::Index>(), xor in 1u8..) {
        let mut buf = BytesMut::new();
        encode_client_frame(&client, &mut buf);
        let i = at.index(buf.len());
        buf[i] ^= xor;
        decode_all(buf, decode_client_frame);

        let mut buf = BytesMut::new();
        encode_server_frame(&server, &mut buf);
        let i = at.index(buf.len());
        buf[i] ^= xor;
        decode_all(buf, decode_server_frame);
    }

    /// Cutting a valid body short is a non-fatal error carrying what was wrong.
    #[test]
    fn truncated_bodies_are_bad_requests(client in client_frame(), cut in any::<prop::sample::Index>()) {
        let mut whole = BytesMut::new();
        encode_client_frame(&client, &mut whole);
        let body = &whole[4..];
        let cut = cut.index(body.len());
        let mut src = frame(&body[..cut]);
        let result = decode_client_frame(&mut src, &FrameLimits::default());
        prop_assert!(matches!(result, Err(ProtoError::BadRequest { .. })), "{:?}", result);
        prop_assert!(src.is_empty());
    }
}
