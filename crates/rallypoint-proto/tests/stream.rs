//! A stream of frames decodes the same however it is split across reads.

mod common;

use bytes::{BufMut, BytesMut};
use common::{assert_split_invariant, op_error, request, response, samples};
use rallypoint_core::{Identity, SessionId, Welcome};
use rallypoint_proto::native::{
    decode_client_frame, decode_server_frame, encode_client_frame, encode_server_frame, ClientFrame, ProtoError,
    ServerFrame,
};

#[test]
fn client_stream_splits_at_every_byte() {
    let mut frames = vec![ClientFrame::Hello(Identity::ranked("job", 3, 8))];
    frames.extend(
        samples(request(), 26)
            .into_iter()
            .enumerate()
            .map(|(id, request)| ClientFrame::Request { id: id as u64, request }),
    );
    let mut stream = BytesMut::new();
    for frame in &frames {
        encode_client_frame(frame, &mut stream);
    }
    let expected: Vec<_> = frames.into_iter().map(Ok).collect();
    assert_split_invariant(&stream, &expected, decode_client_frame);
}

#[test]
fn server_stream_splits_at_every_byte() {
    let mut frames =
        vec![ServerFrame::Welcome(Welcome { session: SessionId(9), lease_ms: 15_000, job_incarnation: None })];
    let replies = samples(response(), 6).into_iter().map(Ok).chain(samples(op_error(), 17).into_iter().map(Err));
    frames.extend(replies.enumerate().map(|(id, reply)| ServerFrame::Reply { id: id as u64, reply }));
    let mut stream = BytesMut::new();
    for frame in &frames {
        encode_server_frame(frame, &mut stream);
    }
    let expected: Vec<_> = frames.into_iter().map(Ok).collect();
    assert_split_invariant(&stream, &expected, decode_server_frame);
}

#[test]
fn a_bad_frame_mid_stream_does_not_desync_the_rest() {
    let first = ClientFrame::Request { id: 1, request: rallypoint_core::Request::NumKeys };
    let last = ClientFrame::Request { id: 3, request: rallypoint_core::Request::Heartbeat };
    let mut stream = BytesMut::new();
    encode_client_frame(&first, &mut stream);
    // Request id 2 with unknown opcode 0x7f and two bytes of junk after it.
    stream.put_u32_le(1 + 8 + 3);
    stream.put_u8(0x02);
    stream.put_u64_le(2);
    stream.put_slice(&[0x7f, 0xaa, 0xbb]);
    encode_client_frame(&last, &mut stream);
    let expected = [
        Ok(first),
        Err(ProtoError::BadRequest { id: Some(2), message: "unknown request opcode 0x7f".into() }),
        Ok(last),
    ];
    assert_split_invariant(&stream, &expected, decode_client_frame);
}
