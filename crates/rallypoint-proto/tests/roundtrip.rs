//! Every frame, request, response and error decodes to exactly what was encoded.

mod common;

use bytes::{Bytes, BytesMut};
use common::{client_frame, op_error, request, response, samples, server_frame};
use proptest::collection::vec;
use proptest::prelude::*;
use rallypoint_core::{Gathered, Members, Name, OpError, Request, Response};
use rallypoint_proto::native::{
    decode_client_frame, decode_server_frame, encode_client_frame, encode_reply, encode_server_frame, ClientFrame,
    FrameLimits, ServerFrame,
};

fn client_round_trip(frame: &ClientFrame) -> ClientFrame {
    let mut buf = BytesMut::new();
    encode_client_frame(frame, &mut buf);
    let decoded = decode_client_frame(&mut buf, &FrameLimits::default()).unwrap().unwrap();
    assert!(buf.is_empty(), "frame not fully consumed");
    decoded
}

fn server_round_trip(frame: &ServerFrame) -> ServerFrame {
    let mut buf = BytesMut::new();
    encode_server_frame(frame, &mut buf);
    let decoded = decode_server_frame(&mut buf, &FrameLimits::default()).unwrap().unwrap();
    assert!(buf.is_empty(), "frame not fully consumed");
    decoded
}

#[test]
fn every_request_variant_round_trips() {
    let all: Vec<Request> = samples(request(), 26);
    for (id, request) in all.into_iter().enumerate() {
        let frame = ClientFrame::Request { id: id as u64, request };
        assert_eq!(client_round_trip(&frame), frame);
    }
}

/// A decoded name lives inline while it fits (a rank's barrier then allocates nothing
/// for it), on the heap past that, and reads back the same either way.
#[test]
fn names_either_side_of_inline_round_trip() {
    let inline = std::mem::size_of::<String>();
    for len in [0, 1, inline - 1, inline, inline + 1, 200] {
        let name = Name::from("n".repeat(len));
        let frame = ClientFrame::Request {
            id: 1,
            request: Request::Barrier { name: name.clone(), members: Members::World, timeout_ms: None },
        };
        let ClientFrame::Request { request: Request::Barrier { name: decoded, .. }, .. } = client_round_trip(&frame)
        else {
            panic!("a barrier request decodes as one");
        };
        assert_eq!(decoded, name);
        assert_eq!(decoded.is_heap_allocated(), len > inline, "a name of {len} bytes");
    }
}

#[test]
fn every_response_and_error_variant_round_trips() {
    let responses: Vec<Response> = samples(response(), 6);
    let errors: Vec<OpError> = samples(op_error(), 17);
    let replies = responses.into_iter().map(Ok).chain(errors.iter().cloned().map(Err));
    for (id, reply) in replies.enumerate() {
        let frame = ServerFrame::Reply { id: id as u64, reply };
        assert_eq!(server_round_trip(&frame), frame);
    }
    for error in errors {
        let frame = ServerFrame::Refused(error);
        assert_eq!(server_round_trip(&frame), frame);
    }
}

/// The all-gather result a client decodes from the reply carrying `values`.
fn decoded_gathered(values: &[Bytes]) -> Gathered {
    let frame = ServerFrame::Reply { id: 1, reply: Ok(Response::Gathered(Gathered::new(values.to_vec()))) };
    match server_round_trip(&frame) {
        ServerFrame::Reply { id: 1, reply: Ok(Response::Gathered(gathered)) } => gathered,
        other => panic!("expected a Gathered reply, got {other:?}"),
    }
}

/// A decoded result holds exactly the values sent, in order, read through every accessor.
fn assert_holds(gathered: &Gathered, values: &[Bytes]) {
    assert_eq!(gathered, &Gathered::new(values.to_vec()));
    assert_eq!(gathered.len(), values.len());
    assert_eq!(gathered.is_empty(), values.is_empty());
    assert_eq!(gathered.values_len(), values.iter().map(Bytes::len).sum::<usize>());
    assert!(gathered.iter().eq(values.iter().map(|v| &v[..])));
    assert_eq!(gathered.to_vec(), values);
    for (i, value) in values.iter().enumerate() {
        assert_eq!(&gathered[i], &value[..]);
        assert_eq!(gathered.value(i).as_ref(), Some(value));
    }
    assert_eq!(gathered.get(values.len()), None);
}

#[test]
fn empty_and_wide_all_gathers_round_trip() {
    assert_holds(&decoded_gathered(&[]), &[]);
    let empties = vec![Bytes::new(); 3];
    assert_holds(&decoded_gathered(&empties), &empties);
    let wide: Vec<Bytes> = (0..1024u32).map(|r| Bytes::from(r.to_string())).collect();
    assert_holds(&decoded_gathered(&wide), &wide);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn decoded_all_gathers_hold_the_values_sent(values in vec(vec(any::<u8>(), 0..40), 0..40)) {
        let values: Vec<Bytes> = values.into_iter().map(Bytes::from).collect();
        let gathered = decoded_gathered(&values);
        assert_holds(&gathered, &values);
        // Not equal to a result one value shorter, or with one byte changed.
        if let Some((last, rest)) = values.split_last() {
            prop_assert_ne!(&gathered, &Gathered::new(rest.to_vec()));
            let mut last = last.to_vec();
            match last.last_mut() {
                Some(byte) => *byte = byte.wrapping_add(1),
                None => last.push(0),
            }
            let changed = [rest, &[Bytes::from(last)]].concat();
            prop_assert_ne!(&gathered, &Gathered::new(changed));
        }
    }

    #[test]
    fn client_frames_round_trip(frame in client_frame()) {
        prop_assert_eq!(client_round_trip(&frame), frame);
    }

    #[test]
    fn server_frames_round_trip(frame in server_frame()) {
        prop_assert_eq!(server_round_trip(&frame), frame);
    }

    #[test]
    fn encode_reply_matches_server_frame(id in any::<u64>(), response in response(), error in op_error()) {
        for reply in [Ok(response), Err(error)] {
            let mut direct = BytesMut::new();
            encode_reply(id, &reply, &mut direct);
            let mut framed = BytesMut::new();
            encode_server_frame(&ServerFrame::Reply { id, reply }, &mut framed);
            prop_assert_eq!(direct, framed);
        }
    }
}
