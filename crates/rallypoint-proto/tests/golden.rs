//! Exact bytes of the worked example in docs/PROTOCOL.md: if this test changes,
//! the document must change with it (and the protocol version, if deployed).

use bytes::{Bytes, BytesMut};
use rallypoint_core::{Identity, JobIncarnation, Members, OpError, ProcessInfo, Request, Response, SessionId, Welcome};
use rallypoint_proto::native::{
    decode_client_frame, decode_server_frame, encode_client_frame, encode_preamble, encode_server_frame, ClientFrame,
    FrameLimits, ServerFrame,
};

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(" ")
}

/// `expected` may break lines (a `\` continuation); spaces separate bytes.
fn spaced(expected: &str) -> String {
    expected.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn client(frame: ClientFrame, expected: &str) {
    let mut buf = BytesMut::new();
    encode_client_frame(&frame, &mut buf);
    assert_eq!(hex(&buf), spaced(expected));
    assert_eq!(decode_client_frame(&mut buf, &FrameLimits::default()), Ok(Some(frame)));
}

fn server(frame: ServerFrame, expected: &str) {
    let mut buf = BytesMut::new();
    encode_server_frame(&frame, &mut buf);
    assert_eq!(hex(&buf), spaced(expected));
    assert_eq!(decode_server_frame(&mut buf, &FrameLimits::default()), Ok(Some(frame)));
}

#[test]
fn worked_example() {
    let mut preamble = BytesMut::new();
    encode_preamble(&mut preamble);
    assert_eq!(hex(&preamble), "52 4c 4c 59 01 00");

    client(
        ClientFrame::Hello(hello()),
        "25 00 00 00 01 01 00 00 00 6a 01 00 00 00 00 01 02 00 00 00 01 00 00 00 68 07 00 00 00 00 \
         01 a1 e0 d7 b5 c1 09 2a 3f 00 00",
    );
    server(
        ServerFrame::Welcome(Welcome { session: SessionId(1), lease_ms: 15_000, job_incarnation: None }),
        "12 00 00 00 81 01 00 00 00 00 00 00 00 98 3a 00 00 00 00 00 00 00",
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

/// The worked example's hello: rank 0 of 2 in job "j", host "h", pid 7, incarnation
/// 3f2a09c1b5d7e0a1, no job incarnation, no session to resume.
fn hello() -> Identity {
    Identity { host: "h".into(), pid: 7, incarnation: Some(0x3f2a_09c1_b5d7_e0a1), ..Identity::ranked("j", 0, 2) }
}

/// Section 14's examples: a resuming hello, a reset, and the refusals of a second
/// claimant and of a process of an old job incarnation.
#[test]
fn incarnation_frames() {
    client(
        ClientFrame::Hello(Identity { job_incarnation: Some(0xbbb), resume: Some(SessionId(1)), ..hello() }),
        "35 00 00 00 01 01 00 00 00 6a 01 00 00 00 00 01 02 00 00 00 01 00 00 00 68 07 00 00 00 00 \
         01 a1 e0 d7 b5 c1 09 2a 3f 01 bb 0b 00 00 00 00 00 00 01 01 00 00 00 00 00 00 00",
    );
    server(
        ServerFrame::Welcome(Welcome { session: SessionId(1), lease_ms: 15_000, job_incarnation: Some(0xbbb) }),
        "1a 00 00 00 81 01 00 00 00 00 00 00 00 98 3a 00 00 00 00 00 00 01 bb 0b 00 00 00 00 00 00",
    );
    client(
        ClientFrame::Request { id: 1, request: Request::Reset { incarnation: 0xbbb } },
        "12 00 00 00 02 01 00 00 00 00 00 00 00 19 bb 0b 00 00 00 00 00 00",
    );
    let holder = ProcessInfo { pid: 311, host: "a".into(), incarnation: Some(0x3f2a) };
    let claimant = ProcessInfo { pid: 977, host: "b".into(), incarnation: Some(0x9c1b) };
    server(
        ServerFrame::Refused(OpError::RankHeld {
            rank: 1,
            holder: Box::new(holder.clone()),
            since_unix_ms: 1_795_262_401_000,
            claimant: Box::new(claimant),
        }),
        "32 00 00 00 82 8d 01 00 00 00 37 01 00 00 01 00 00 00 61 01 2a 3f 00 00 00 00 00 00 \
         e8 49 fa fd a1 01 00 00 d1 03 00 00 01 00 00 00 62 01 1b 9c 00 00 00 00 00 00",
    );
    server(
        ServerFrame::Refused(OpError::StaleIncarnation {
            job: "j".into(),
            mine: 0xaaa,
            current: Box::new(JobIncarnation {
                incarnation: 0xbbb,
                since_unix_ms: 1_795_262_401_000,
                by: holder,
                reset: true,
            }),
        }),
        "32 00 00 00 82 90 01 00 00 00 6a aa 0a 00 00 00 00 00 00 bb 0b 00 00 00 00 00 00 \
         e8 49 fa fd a1 01 00 00 01 37 01 00 00 01 00 00 00 61 01 2a 3f 00 00 00 00 00 00",
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

/// The barrier channel frames of docs/PROTOCOL.md, section 15, as its example gives them.
#[test]
fn barrier_channel_frames() {
    let barrier = Request::Barrier { name: "b".into(), members: Members::World, timeout_ms: None };
    client(
        ClientFrame::AttachBarrier { id: 4, request: barrier },
        "11 00 00 00 1d 04 00 00 00 00 00 00 00 0d 01 00 00 00 62 00 00",
    );
    server(
        ServerFrame::BarrierChannel { id: 4, channel: 1, slot: 3 },
        "15 00 00 00 9d 04 00 00 00 00 00 00 00 01 00 00 00 00 00 00 00 03 00 00 00",
    );
    server(
        ServerFrame::NoBarrierChannel { id: 4, reason: "tcp".into() },
        "10 00 00 00 9e 04 00 00 00 00 00 00 00 03 00 00 00 74 63 70",
    );
    client(
        ClientFrame::LeaveBarrierChannel { channel: 1, slot: 3 },
        "0d 00 00 00 1e 01 00 00 00 00 00 00 00 03 00 00 00",
    );
}

/// The token handshake of docs/PROTOCOL.md, section 5.1, with the nonces and
/// proofs of its example.
#[test]
fn auth_frames() {
    let nonce = |first: u8| std::array::from_fn::<u8, 32, _>(|i| first.wrapping_add(i as u8));
    let body = |first: u8| (0..32u8).map(|i| format!("{:02x}", first.wrapping_add(i))).collect::<Vec<_>>().join(" ");
    client(ClientFrame::AuthStart { nonce: nonce(0x00) }, &format!("21 00 00 00 0a {}", body(0x00)));
    server(ServerFrame::AuthChallenge { nonce: nonce(0x20) }, &format!("21 00 00 00 8a {}", body(0x20)));
    client(ClientFrame::AuthProof { proof: nonce(0x40) }, &format!("21 00 00 00 0b {}", body(0x40)));
    server(ServerFrame::AuthAccepted { proof: nonce(0x60) }, &format!("21 00 00 00 8b {}", body(0x60)));
    server(
        ServerFrame::Refused(OpError::Unauthorized(rallypoint_core::AuthRefusal::WrongToken)),
        "03 00 00 00 82 91 01",
    );
}

#[test]
fn jobs_request_and_reply() {
    client(ClientFrame::Request { id: 2, request: Request::Jobs }, "0a 00 00 00 02 02 00 00 00 00 00 00 00 1b");
    client(ClientFrame::Request { id: 3, request: Request::Snapshot }, "0a 00 00 00 02 03 00 00 00 00 00 00 00 1c");
    server(
        ServerFrame::Reply { id: 2, reply: Ok(Response::Values(vec![Bytes::from("a"), Bytes::from("b/launch")])) },
        "1f 00 00 00 83 02 00 00 00 00 00 00 00 05 02 00 00 00 01 00 00 00 61 08 00 00 00 62 2f 6c 61 75 6e 63 68",
    );
}
