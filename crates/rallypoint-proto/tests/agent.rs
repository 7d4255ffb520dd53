//! Frames between node agents and the coordinator: every variant round-trips, a
//! stream decodes the same however it is split, and bad frames name their
//! sub-session and request id without desynchronising the stream.

mod common;

use bytes::{BufMut, BytesMut};
use common::{assert_split_invariant, drain, identity, op_error, request, response, samples};
use proptest::prelude::*;
use rallypoint_core::{Identity, Members, OpError, Request, Response, SessionId, Welcome};
use rallypoint_proto::native::{
    decode_agent_frame, decode_root_frame, encode_agent_frame, encode_root_frame, encode_sub_replies,
    starts_with_agent_hello, AgentFrame, FrameLimits, ProtoError, RootFrame,
};

fn agent_frames() -> Vec<AgentFrame> {
    let mut frames = vec![
        AgentFrame::Hello { host: "node-7".into(), pid: 4242 },
        AgentFrame::SubHello { sub: 1, identity: Identity::ranked("job", 3, 8) },
    ];
    frames.extend(samples(request(), 26).into_iter().enumerate().map(|(id, request)| AgentFrame::SubRequest {
        sub: id as u64 % 3,
        id: id as u64,
        request,
    }));
    frames.push(AgentFrame::SubClose { sub: 2, gone: false });
    frames.extend(samples(request(), 6).into_iter().enumerate().map(|(n, request)| AgentFrame::SubRequests {
        calls: (0..n as u64).map(|i| (i * 7, u64::MAX - i)).collect(),
        request,
    }));
    frames
}

fn root_frames() -> Vec<RootFrame> {
    let mut frames = vec![
        RootFrame::Welcome { lease_ms: 15_000 },
        RootFrame::Refused(OpError::Invalid("no".into())),
        RootFrame::SubWelcome {
            sub: 1,
            welcome: Welcome { session: SessionId(9), lease_ms: 15_000, job_incarnation: None },
        },
    ];
    let errors = samples(op_error(), 17);
    frames.extend(errors.iter().cloned().map(|error| RootFrame::SubRefused { sub: 4, error }));
    let replies = samples(response(), 7).into_iter().map(Ok).chain(errors.into_iter().map(Err));
    let replies: Vec<_> = replies.collect();
    frames.extend(replies.iter().cloned().enumerate().map(|(id, reply)| RootFrame::SubReply {
        sub: 5,
        id: id as u64,
        reply,
    }));
    frames.extend(replies.into_iter().enumerate().map(|(n, reply)| RootFrame::SubReplies {
        calls: (0..n as u64 % 4).map(|i| (i + 1, 40 + i)).collect(),
        reply,
    }));
    frames
}

#[test]
fn agent_stream_splits_at_every_byte() {
    let frames = agent_frames();
    let mut stream = BytesMut::new();
    for frame in &frames {
        encode_agent_frame(frame, &mut stream);
    }
    let expected: Vec<_> = frames.into_iter().map(Ok).collect();
    assert_split_invariant(&stream, &expected, decode_agent_frame);
}

#[test]
fn root_stream_splits_at_every_byte() {
    let frames = root_frames();
    let mut stream = BytesMut::new();
    for frame in &frames {
        encode_root_frame(frame, &mut stream);
    }
    let expected: Vec<_> = frames.into_iter().map(Ok).collect();
    assert_split_invariant(&stream, &expected, decode_root_frame);
}

#[test]
fn an_agent_hello_is_told_apart_from_a_client_hello() {
    let mut agent = BytesMut::new();
    encode_agent_frame(&AgentFrame::Hello { host: "h".into(), pid: 1 }, &mut agent);
    assert_eq!(starts_with_agent_hello(&agent), Some(true));
    assert_eq!(starts_with_agent_hello(&agent[..4]), None);
    let mut client = BytesMut::new();
    rallypoint_proto::native::encode_client_frame(
        &rallypoint_proto::native::ClientFrame::Hello(Identity::anonymous("j")),
        &mut client,
    );
    assert_eq!(starts_with_agent_hello(&client), Some(false));
}

/// The agent hello, sub-session frames and the agent welcome, byte for byte
/// (docs/PROTOCOL.md, section 12).
#[test]
fn golden_bytes() {
    let mut out = BytesMut::new();
    encode_agent_frame(&AgentFrame::Hello { host: "n".into(), pid: 7 }, &mut out);
    encode_agent_frame(&AgentFrame::SubRequest { sub: 2, id: 1, request: Request::Heartbeat }, &mut out);
    encode_agent_frame(&AgentFrame::SubClose { sub: 2, gone: false }, &mut out);
    #[rustfmt::skip]
    let expected: &[u8] = &[
        0x0a, 0, 0, 0, 0x03, 1, 0, 0, 0, b'n', 7, 0, 0, 0,
        0x12, 0, 0, 0, 0x05, 2, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0x11,
        0x0a, 0, 0, 0, 0x06, 2, 0, 0, 0, 0, 0, 0, 0, 0x00,
    ];
    assert_eq!(&out[..], expected);
    // The agent found the rank's process gone: no reconnect grace (section 14).
    let mut out = BytesMut::new();
    encode_agent_frame(&AgentFrame::SubClose { sub: 2, gone: true }, &mut out);
    assert_eq!(&out[..], &[0x0a, 0, 0, 0, 0x06, 2, 0, 0, 0, 0, 0, 0, 0, 0x01]);
    let mut out = BytesMut::new();
    let welcome = Welcome { session: SessionId(9), lease_ms: 15_000, job_incarnation: Some(0xbbb) };
    encode_root_frame(&RootFrame::SubWelcome { sub: 1, welcome }, &mut out);
    #[rustfmt::skip]
    let expected: &[u8] = &[
        0x22, 0, 0, 0, 0x85, 1, 0, 0, 0, 0, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0, 0x98, 0x3a, 0, 0, 0, 0, 0, 0,
        0x01, 0xbb, 0x0b, 0, 0, 0, 0, 0, 0,
    ];
    assert_eq!(&out[..], expected);
    let mut out = BytesMut::new();
    encode_root_frame(&RootFrame::SubReply { sub: 2, id: 1, reply: Ok(rallypoint_core::Response::Done) }, &mut out);
    #[rustfmt::skip]
    let expected: &[u8] = &[0x12, 0, 0, 0, 0x87, 2, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0x01];
    assert_eq!(&out[..], expected);
}

#[test]
fn a_bad_sub_request_names_its_sub_session_and_id_and_the_stream_goes_on() {
    let first = AgentFrame::SubClose { sub: 1, gone: true };
    let last = AgentFrame::SubRequest { sub: 3, id: 4, request: Request::NumKeys };
    let mut stream = BytesMut::new();
    encode_agent_frame(&first, &mut stream);
    // Sub-session 2, request id 9, unknown opcode 0x7f.
    stream.put_u32_le(1 + 8 + 8 + 1);
    stream.put_u8(0x05);
    stream.put_u64_le(2);
    stream.put_u64_le(9);
    stream.put_u8(0x7f);
    // An unknown frame kind.
    stream.put_u32_le(1);
    stream.put_u8(0x7e);
    // A client Request frame is not an agent frame.
    rallypoint_proto::native::encode_client_frame(
        &rallypoint_proto::native::ClientFrame::Request { id: 1, request: Request::NumKeys },
        &mut stream,
    );
    encode_agent_frame(&last, &mut stream);
    let expected = [
        Ok(first),
        Err(ProtoError::BadSubFrame { sub: Some(2), id: Some(9), message: "unknown request opcode 0x7f".into() }),
        Err(ProtoError::BadSubFrame { sub: None, id: None, message: "unknown agent frame kind 0x7e".into() }),
        Err(ProtoError::BadSubFrame { sub: None, id: None, message: "unknown agent frame kind 0x02".into() }),
        Ok(last),
    ];
    assert_split_invariant(&stream, &expected, decode_agent_frame);
}

/// The aggregated barrier arrival and release of docs/PROTOCOL.md, section 12.
#[test]
fn golden_bytes_of_aggregated_frames() {
    let barrier = Request::Barrier { name: "b".into(), members: Members::World, timeout_ms: None };
    let mut out = BytesMut::new();
    encode_agent_frame(&AgentFrame::SubRequests { calls: vec![(2, 1), (5, 3)], request: barrier }, &mut out);
    #[rustfmt::skip]
    let expected: &[u8] = &[
        0x2d, 0, 0, 0, 0x07, 2, 0, 0, 0,
        2, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0,
        5, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0,
        0x0d, 1, 0, 0, 0, b'b', 0x00, 0x00,
    ];
    assert_eq!(&out[..], expected);
    let mut out = BytesMut::new();
    encode_sub_replies(&[(2, 1), (5, 3)], &Ok(Response::Done), &mut out);
    #[rustfmt::skip]
    let expected: &[u8] = &[
        0x26, 0, 0, 0, 0x88, 2, 0, 0, 0,
        2, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0,
        5, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0,
        0x01,
    ];
    assert_eq!(&out[..], expected);
}

/// A node's ranks share one all-gather result: the coordinator sends its values once,
/// as the uncopied tail of one SubReplies frame.
#[test]
fn sub_replies_with_a_shared_tail_decode_whole() {
    let values: Vec<bytes::Bytes> = (0..4u8).map(|i| bytes::Bytes::from(vec![i; 8192])).collect();
    let reply = Ok(Response::Gathered(rallypoint_core::Gathered::new(values)));
    let mut stream = BytesMut::new();
    let tail = rallypoint_proto::native::encode_sub_replies_shared(&[(1, 2), (3, 4)], &reply, &mut stream)
        .expect("a large all-gather result is shared, not copied");
    stream.extend_from_slice(&tail);
    let got = decode_root_frame(&mut stream, &FrameLimits::unbounded()).expect("well-formed");
    assert_eq!(got, Some(RootFrame::SubReplies { calls: vec![(1, 2), (3, 4)], reply }));
    assert!(stream.is_empty());
}

#[test]
fn one_call_of_sub_replies_is_a_plain_sub_reply() {
    let reply = Err(OpError::Invalid("x".into()));
    let mut grouped = BytesMut::new();
    encode_sub_replies(&[(3, 9)], &reply, &mut grouped);
    let mut plain = BytesMut::new();
    encode_root_frame(&RootFrame::SubReply { sub: 3, id: 9, reply }, &mut plain);
    assert_eq!(grouped, plain);
}

#[test]
fn a_bad_aggregated_frame_names_every_call_and_the_stream_goes_on() {
    let last = AgentFrame::SubClose { sub: 1, gone: true };
    let mut stream = BytesMut::new();
    // Calls (2, 9) and (4, 11), then the unknown opcode 0x7f.
    stream.put_u32_le(1 + 4 + 32 + 1);
    stream.put_u8(0x07);
    stream.put_u32_le(2);
    for (sub, id) in [(2u64, 9u64), (4, 11)] {
        stream.put_u64_le(sub);
        stream.put_u64_le(id);
    }
    stream.put_u8(0x7f);
    // A count the frame cannot hold is refused before anything is allocated.
    stream.put_u32_le(1 + 4);
    stream.put_u8(0x07);
    stream.put_u32_le(u32::MAX);
    // A whole request followed by a stray byte.
    stream.put_u32_le(1 + 4 + 16 + 1 + 1);
    stream.put_u8(0x07);
    stream.put_u32_le(1);
    stream.put_u64_le(6);
    stream.put_u64_le(7);
    stream.put_u8(0x11);
    stream.put_u8(0xee);
    encode_agent_frame(&last, &mut stream);
    let expected = [
        Err(ProtoError::BadSubCalls { calls: vec![(2, 9), (4, 11)], message: "unknown request opcode 0x7f".into() }),
        Err(ProtoError::BadSubFrame {
            sub: None,
            id: None,
            message: "field 'calls': 4294967295 items cannot fit in the 0 bytes left".into(),
        }),
        Err(ProtoError::BadSubCalls {
            calls: vec![(6, 7)],
            message: "1 unexpected trailing bytes after heartbeat".into(),
        }),
        Ok(last),
    ];
    assert_split_invariant(&stream, &expected, decode_agent_frame);

    // Likewise a SubReplies frame whose reply does not decode (unknown tag 0x7f).
    let mut stream = BytesMut::new();
    stream.put_u32_le(1 + 4 + 16 + 1);
    stream.put_u8(0x88);
    stream.put_u32_le(1);
    stream.put_u64_le(3);
    stream.put_u64_le(5);
    stream.put_u8(0x7f);
    let got = drain(&mut stream, decode_root_frame);
    assert!(matches!(&got[..], [Err(ProtoError::BadSubCalls { calls, .. })] if calls == &[(3, 5)]), "{got:?}");
}

#[test]
fn a_truncated_sub_reply_names_what_it_could_read() {
    let mut stream = BytesMut::new();
    stream.put_u32_le(1 + 8 + 4);
    stream.put_u8(0x87);
    stream.put_u64_le(6);
    stream.put_u32_le(0);
    let got = drain(&mut stream, decode_root_frame);
    assert_eq!(
        got,
        [Err(ProtoError::BadSubFrame {
            sub: Some(6),
            id: None,
            message: "truncated field 'request id': needs 8 bytes, 4 left".into()
        })]
    );
}

proptest! {
    #[test]
    fn any_agent_frame_round_trips(sub in any::<u64>(), id in any::<u64>(), identity in identity(), request in request()) {
        for frame in [
            AgentFrame::SubHello { sub, identity: identity.clone() },
            AgentFrame::SubRequest { sub, id, request: request.clone() },
            AgentFrame::SubClose { sub, gone: id % 2 == 0 },
            AgentFrame::Hello { host: identity.host.clone(), pid: identity.pid },
            AgentFrame::SubRequests { calls: vec![(sub, id), (id, sub)], request: request.clone() },
        ] {
            let mut buf = BytesMut::new();
            encode_agent_frame(&frame, &mut buf);
            prop_assert_eq!(decode_agent_frame(&mut buf, &FrameLimits::default()).unwrap(), Some(frame));
            prop_assert!(buf.is_empty());
        }
    }

    #[test]
    fn any_root_frame_round_trips(sub in any::<u64>(), id in any::<u64>(), response in response(), error in op_error()) {
        for frame in [
            RootFrame::SubReply { sub, id, reply: Ok(response.clone()) },
            RootFrame::SubReply { sub, id, reply: Err(error.clone()) },
            RootFrame::SubRefused { sub, error: error.clone() },
            RootFrame::SubReplies { calls: vec![(sub, id), (id, sub), (0, 0)], reply: Ok(response.clone()) },
            RootFrame::SubReplies { calls: vec![(sub, id), (id, sub)], reply: Err(error.clone()) },
        ] {
            let mut buf = BytesMut::new();
            encode_root_frame(&frame, &mut buf);
            prop_assert_eq!(decode_root_frame(&mut buf, &FrameLimits::default()).unwrap(), Some(frame));
            prop_assert!(buf.is_empty());
        }
    }
}
