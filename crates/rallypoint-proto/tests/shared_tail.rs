//! Replies written as a head plus a shared tail: the bytes on the wire are exactly
//! those of the plain encoding, and an all-gather's values are encoded once for
//! every member that gets them.

mod common;

use bytes::{Bytes, BytesMut};
use common::{op_error, response};
use proptest::collection::vec;
use proptest::prelude::*;
use rallypoint_core::{Gathered, Reply, Response};
use rallypoint_proto::native::{
    decode_root_frame, decode_server_frame, decode_shared_reply, encode_reply, encode_reply_body_parts,
    encode_reply_shared, encode_sub_reply, encode_sub_reply_shared, pending_frame_len, FrameLimits, ProtoError,
    RootFrame, ServerFrame,
};

/// Responses with payloads on both sides of the size from which tails are shared.
fn sized_response() -> impl Strategy<Value = Response> {
    let blob = || vec(any::<u8>(), 0..6000).prop_map(Bytes::from);
    prop_oneof![
        response(),
        blob().prop_map(Response::Value),
        vec(blob(), 0..5).prop_map(|values| Response::Gathered(Gathered::new(values))),
    ]
}

/// What `encode_*_shared` put in the buffer followed by the tail it returned.
fn joined(head: BytesMut, tail: Option<Bytes>) -> BytesMut {
    let mut all = head;
    all.extend_from_slice(tail.as_deref().unwrap_or_default());
    all
}

fn gathered_reply(values: Vec<Bytes>) -> Reply {
    Ok(Response::Gathered(Gathered::new(values)))
}

proptest! {
    #[test]
    fn a_reply_with_its_tail_is_the_plain_encoding(
        sub in any::<u64>(), id in any::<u64>(), response in sized_response(), error in op_error(),
    ) {
        for reply in [Ok(response), Err(error)] {
            let mut plain = BytesMut::new();
            encode_reply(id, &reply, &mut plain);
            let mut head = BytesMut::new();
            let tail = encode_reply_shared(id, &reply, &mut head);
            prop_assert_eq!(&joined(head, tail), &plain);
            prop_assert_eq!(pending_frame_len(&plain), Some(plain.len()));

            let mut plain = BytesMut::new();
            encode_sub_reply(sub, id, &reply, &mut plain);
            let mut head = BytesMut::new();
            let tail = encode_sub_reply_shared(sub, id, &reply, &mut head);
            prop_assert_eq!(&joined(head, tail), &plain);
        }
    }
}

#[test]
fn every_member_shares_one_encoding_of_the_gathered_values() {
    let reply = gathered_reply(vec![Bytes::from(vec![1u8; 3000]), Bytes::from(vec![2u8; 3000])]);
    let copy = reply.clone();
    let (mut first, mut second) = (BytesMut::new(), BytesMut::new());
    let first_tail = encode_reply_shared(1, &reply, &mut first).expect("a tail");
    let second_tail = encode_reply_shared(2, &copy, &mut second).expect("a tail");
    assert_eq!(first_tail.as_ptr(), second_tail.as_ptr(), "encoded twice");
    // Only the frame head is in the buffer: prefix, kind, id, tag.
    assert_eq!(first.len(), 4 + 1 + 8 + 1);
    assert_eq!(first_tail.len(), 4 + 2 * (4 + 3000));
    let frame = joined(first, Some(first_tail));
    assert_eq!(pending_frame_len(&frame[..4]), Some(frame.len()));
    assert_eq!(pending_frame_len(&frame[..3]), None);
}

#[test]
fn small_tails_are_copied_into_the_batch() {
    let mut head = BytesMut::new();
    let tail = encode_reply_shared(1, &gathered_reply(vec![Bytes::from_static(b"small")]), &mut head);
    assert!(tail.is_none());
    let tail = encode_reply_shared(2, &Ok(Response::Value(Bytes::from_static(b"small"))), &mut head);
    assert!(tail.is_none());
}

#[test]
fn a_decoded_gathered_reply_passes_on_the_bytes_it_was_read_from() {
    // A node agent decodes a sub-session reply and passes it on to its rank.
    let values = vec![Bytes::from(vec![7u8; 5000]), Bytes::from_static(b"x")];
    let mut stream = BytesMut::new();
    encode_sub_reply(3, 9, &gathered_reply(values.clone()), &mut stream);
    let received = stream.as_ptr_range();
    let Ok(Some(RootFrame::SubReply { reply, .. })) = decode_root_frame(&mut stream, &FrameLimits::unbounded()) else {
        panic!("expected a sub-session reply");
    };
    assert_eq!(reply, gathered_reply(values));
    let mut head = BytesMut::new();
    let tail = encode_reply_shared(9, &reply, &mut head).expect("a tail");
    assert!(received.contains(&tail.as_ptr()), "the tail was copied, not sliced from the received frame");
    let mut frame = joined(head, Some(tail));
    match decode_server_frame(&mut frame, &FrameLimits::unbounded()) {
        Ok(Some(ServerFrame::Reply { id: 9, reply: decoded })) => assert_eq!(decoded, reply),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_reply_body_written_to_a_shared_file_decodes_to_the_reply_without_copying() {
    let values = vec![Bytes::from(vec![7u8; 5000]), Bytes::from_static(b"x")];
    for reply in [
        gathered_reply(values),
        Ok(Response::Value(Bytes::from(vec![3u8; 8192]))),
        Ok(Response::Int(5)),
        Err(rallypoint_core::OpError::Closed("gone".into())),
    ] {
        let mut body = BytesMut::new();
        let tail = encode_reply_body_parts(&reply, &mut body);
        body.extend_from_slice(tail.as_deref().unwrap_or_default());
        let body = body.freeze();
        let span = body.as_ptr_range();
        let decoded = decode_shared_reply(4, body).expect("decodes");
        assert_eq!(decoded, reply);
        if let Ok(Response::Gathered(gathered)) = &decoded {
            assert_eq!(gathered.len(), 2);
            let kept = gathered.value(0).expect("a first value");
            for value in gathered.iter().chain([&kept[..]]) {
                assert!(span.contains(&value.as_ptr()), "a value was copied");
            }
        }
    }
    let truncated = decode_shared_reply(4, Bytes::from_static(&[0x06, 2, 0, 0, 0]));
    assert!(matches!(truncated, Err(ProtoError::BadReply { id: Some(4), .. })), "{truncated:?}");
}
