//! Exact bytes of the worked example in docs/PROTOCOL.md: if this test changes,
//! the document must change with it (and the protocol version, if deployed).

use bytes::{Bytes, BytesMut};
use rallypoint_core::{Identity, OpError, Request, Response, SessionId, Welcome};
use rallypoint_proto::native::{
    decode_client_frame, decode_server_frame, encode_client_frame, encode_preamble, encode_server_frame, ClientFrame,
    FrameLimits, ServerFrame,
};

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(" ")
}

fn client(frame: ClientFrame, expected: &str) {
    let mut buf = BytesMut::new();
    encode_client_frame(&frame, &mut buf);
    assert_eq!(hex(&buf), expected);
    assert_eq!(decode_client_frame(&mut buf, &FrameLimits::default()), Ok(Some(frame)));
}

fn server(frame: ServerFrame, expected: &str) {
    let mut buf = BytesMut::new();
    encode_server_frame(&frame, &mut buf);
    assert_eq!(hex(&buf), expected);
    assert_eq!(decode_server_frame(&mut buf, &FrameLimits::default()), Ok(Some(frame)));
}

#[test]
fn worked_example() {
    let mut preamble = BytesMut::new();
    encode_preamble(&mut preamble);
    assert_eq!(hex(&preamble), "52 4c 4c 59 01 00");

    client(
        ClientFrame::Hello(Identity { host: "h".into(), pid: 7, ..Identity::ranked("j", 0, 2) }),
        "1a 00 00 00 01 01 00 00 00 6a 01 00 00 00 00 01 02 00 00 00 01 00 00 00 68 07 00 00 00 00",
    );
    server(
        ServerFrame::Welcome(Welcome { session: SessionId(1), lease_ms: 15_000 }),
        "11 00 00 00 81 01 00 00 00 00 00 00 00 98 3a 00 00 00 00 00 00",
    );
    client(
        ClientFrame::Request { id: 1, request: Request::Get { key: Bytes::from("foo"), timeout_ms: Some(5000) } },
        "1a 00 00 00 02 01 00 00 00 00 00 00 00 02 03 00 00 00 66 6f 6f 01 88 13 00 00 00 00 00 00",
    );
    server(
        ServerFrame::Reply { id: 1, reply: Ok(Response::Value(Bytes::from("bar"))) },
        "11 00 00 00 83 01 00 00 00 00 00 00 00 02 03 00 00 00 62 61 72",
    );
    server(
        ServerFrame::Reply {
            id: 1,
            reply: Err(OpError::KeyTimeout { waited_ms: 5000, missing: vec![Bytes::from("foo")] }),
        },
        "1d 00 00 00 83 01 00 00 00 00 00 00 00 82 88 13 00 00 00 00 00 00 01 00 00 00 03 00 00 00 66 6f 6f",
    );
}

#[test]
fn shared_reply_frames() {
    client(ClientFrame::TakeSharedReplies, "01 00 00 00 08");
    client(ClientFrame::ReleaseShared { slab: 2 }, "09 00 00 00 09 02 00 00 00 00 00 00 00");
    server(
        ServerFrame::SharedReply { id: 1, slab: 2, len: 4104 },
        "19 00 00 00 89 01 00 00 00 00 00 00 00 02 00 00 00 00 00 00 00 08 10 00 00 00 00 00 00",
    );
}

#[test]
fn jobs_request_and_reply() {
    client(ClientFrame::Request { id: 2, request: Request::Jobs }, "0a 00 00 00 02 02 00 00 00 00 00 00 00 1a");
    server(
        ServerFrame::Reply { id: 2, reply: Ok(Response::Values(vec![Bytes::from("a"), Bytes::from("b/launch")])) },
        "1f 00 00 00 83 02 00 00 00 00 00 00 00 05 02 00 00 00 01 00 00 00 61 08 00 00 00 62 2f 6c 61 75 6e 63 68",
    );
}
