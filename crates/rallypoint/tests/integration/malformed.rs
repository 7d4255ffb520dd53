//! Raw connections sending what broken or hostile peers send. Each must cost only
//! its own connection; the coordinator and its other clients carry on.

use bytes::{BufMut, BytesMut};
use rallypoint::server::{ServerConfig, ServerHandle};
use rallypoint::{Error, Identity, Members, OpError};
use rallypoint_core::{LossReason, RankState, Request, Response};
use rallypoint_proto::native::{
    decode_server_frame, encode_agent_frame, encode_client_frame, encode_preamble, AgentFrame, ClientFrame,
    FrameLimits, ServerFrame,
};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::{
    bounded, connect, rank, start_confirmed, start_server, start_server_configured, start_server_with,
};

async fn raw(server: &ServerHandle) -> TcpStream {
    TcpStream::connect(server.local_addr()).await.expect("raw connect")
}

/// Writes `bytes`, ignoring errors: the server may close before it read them all.
async fn send(stream: &mut TcpStream, bytes: &[u8]) {
    let _ = stream.write_all(bytes).await;
}

/// Reads until the server closes the connection; returns what it sent first.
async fn expect_closed(stream: &mut TcpStream, what: &str) -> BytesMut {
    let mut got = BytesMut::new();
    bounded(what, async {
        loop {
            got.reserve(4096);
            match stream.read_buf(&mut got).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
    })
    .await;
    got
}

fn hello(identity: Identity) -> BytesMut {
    let mut out = BytesMut::new();
    encode_preamble(&mut out);
    encode_client_frame(&ClientFrame::Hello(identity), &mut out);
    out
}

async fn read_frame(stream: &mut TcpStream, buf: &mut BytesMut) -> ServerFrame {
    bounded("a server frame", async {
        loop {
            if let Some(frame) = decode_server_frame(buf, &FrameLimits::unbounded()).expect("well-formed server frame")
            {
                return frame;
            }
            buf.reserve(4096);
            let n = stream.read_buf(buf).await.expect("read");
            assert!(n > 0, "the server closed the connection");
        }
    })
    .await
}

/// A request frame with an opcode no version of the protocol uses.
fn bad_opcode_frame(id: u64) -> BytesMut {
    let mut out = BytesMut::new();
    out.put_u32_le(1 + 8 + 1);
    out.put_u8(0x02); // request frame
    out.put_u64_le(id);
    out.put_u8(0xee); // unknown opcode
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_input_costs_only_its_own_connection() {
    let server = start_server().await;
    let good = connect(&server, Identity::anonymous("m")).await;
    good.set("x", "1").await.expect("set before");

    // Not a rallypoint client at all.
    let mut s = raw(&server).await;
    send(&mut s, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
    assert!(expect_closed(&mut s, "http garbage").await.is_empty());

    // A PyTorch TCPStore client whose VALIDATE has the wrong magic: closed.
    let mut s = raw(&server).await;
    send(&mut s, &[0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00]).await;
    assert!(expect_closed(&mut s, "tcpstore").await.is_empty());

    // Right first byte, wrong magic.
    let mut s = raw(&server).await;
    send(&mut s, b"RXYZ\x01\x00").await;
    assert!(expect_closed(&mut s, "bad magic").await.is_empty());

    // A request before the hello: refused, then closed.
    let mut s = raw(&server).await;
    let mut out = BytesMut::new();
    encode_preamble(&mut out);
    encode_client_frame(&ClientFrame::Request { id: 1, request: Request::NumKeys }, &mut out);
    send(&mut s, &out).await;
    let mut got = expect_closed(&mut s, "request before hello").await;
    match decode_server_frame(&mut got, &FrameLimits::unbounded()) {
        Ok(Some(ServerFrame::Refused(OpError::Invalid(_)))) => {}
        other => panic!("expected Refused(Invalid), got {other:?}"),
    }

    // A length prefix far beyond the limit after a good hello: fatal, closed.
    let mut s = raw(&server).await;
    let mut out = hello(Identity::anonymous("m"));
    out.put_u32_le(0xffff_fff0);
    out.put_slice(b"never mind");
    send(&mut s, &out).await;
    let mut got = expect_closed(&mut s, "oversized frame").await;
    assert!(matches!(decode_server_frame(&mut got, &FrameLimits::unbounded()), Ok(Some(ServerFrame::Welcome(_)))));
    assert!(got.is_empty(), "nothing but the welcome");

    // The same prefix on a request: its call is answered before the close, naming
    // the limit, rather than left to its timeout.
    let mut s = raw(&server).await;
    let mut out = hello(Identity::anonymous("m"));
    out.put_u32_le(0xffff_fff0);
    out.put_u8(0x02);
    out.put_u64_le(9);
    send(&mut s, &out).await;
    let mut got = expect_closed(&mut s, "oversized request").await;
    assert!(matches!(decode_server_frame(&mut got, &FrameLimits::unbounded()), Ok(Some(ServerFrame::Welcome(_)))));
    match decode_server_frame(&mut got, &FrameLimits::unbounded()) {
        Ok(Some(ServerFrame::Reply { id: 9, reply: Err(OpError::Invalid(message)) })) => {
            assert!(
                message.starts_with("a request of 4294967280 bytes is more than this coordinator reads"),
                "{message}"
            );
        }
        other => panic!("expected Invalid for request 9, got {other:?}"),
    }

    // A well-framed request with an unknown opcode: answered with Invalid, and the
    // connection stays usable.
    let mut s = raw(&server).await;
    let mut out = hello(Identity::anonymous("m"));
    out.extend_from_slice(&bad_opcode_frame(7));
    send(&mut s, &out).await;
    let mut buf = BytesMut::new();
    assert!(matches!(read_frame(&mut s, &mut buf).await, ServerFrame::Welcome(_)));
    match read_frame(&mut s, &mut buf).await {
        ServerFrame::Reply { id: 7, reply: Err(OpError::Invalid(message)) } => {
            assert!(message.contains("0xee"), "{message}");
        }
        other => panic!("expected Invalid for request 7, got {other:?}"),
    }
    // A well-framed body of garbage (no request id to answer) is skipped too.
    let mut out = BytesMut::new();
    out.put_slice(&[0x05, 0, 0, 0, 0xff, 0xfe, 0xfd, 0xfc, 0xfb]);
    encode_client_frame(&ClientFrame::Request { id: 8, request: Request::NumKeys }, &mut out);
    send(&mut s, &out).await;
    match read_frame(&mut s, &mut buf).await {
        ServerFrame::Reply { id: 8, reply: Ok(Response::Int(1)) } => {}
        other => panic!("expected 1 key for request 8, got {other:?}"),
    }

    // Everyone else is unaffected.
    assert_eq!(bounded("get after", good.get("x", None)).await.expect("get after"), "1");
    let fresh = connect(&server, Identity::anonymous("m")).await;
    assert_eq!(bounded("fresh get", fresh.get("x", None)).await.expect("fresh get"), "1");
    server.shutdown().await;
}

/// A rank whose connection stays open but says nothing (no heartbeats: a hung
/// process) is lost when its lease expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_rank_is_lost_when_its_lease_expires() {
    // Long enough that rank 0's own heartbeats, late on a loaded machine, keep it alive.
    let config = rallypoint::Config { lease_ms: 1_500, ..rallypoint::Config::default() };
    let server = start_server_with(config).await;
    let r0 = connect(&server, rank("hung", 0, 2)).await;
    let mut silent = raw(&server).await;
    send(&mut silent, &hello(rank("hung", 1, 2))).await;
    let mut buf = BytesMut::new();
    assert!(matches!(read_frame(&mut silent, &mut buf).await, ServerFrame::Welcome(w) if w.lease_ms == 1_500));

    let c = r0.clone();
    let waiter =
        start_confirmed(&r0, async move { c.barrier("b", Members::World, Some(Duration::from_secs(50))).await }).await;
    match bounded("waiter", waiter).await.expect("task") {
        Err(Error::Op(OpError::PeerLost { peer, .. })) => {
            assert_eq!(peer.rank, 1);
            assert_eq!(peer.state, RankState::Lost(LossReason::LeaseExpired { lease_ms: 1_500 }));
        }
        other => panic!("expected PeerLost by lease expiry, got {other:?}"),
    }
    server.shutdown().await;
}

/// A peer that stops in the middle of a frame, after its hello or after a node
/// agent's hello, is disconnected once the read timeout passes without a byte; the
/// others carry on. (Without the timeout it held the connection, and the partial
/// frame's memory, for good.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_stalled_mid_frame_is_disconnected_after_the_read_timeout() {
    let mut config = ServerConfig::new("127.0.0.1:0".parse().expect("addr"), rallypoint::Config::default());
    config.read_timeout = Duration::from_millis(300);
    let server = start_server_configured(config).await;
    let good = connect(&server, Identity::anonymous("stall")).await;

    // A rank: its hello, then the first 5 bytes of a 100-byte frame.
    let mut rank_conn = raw(&server).await;
    let mut out = hello(Identity::anonymous("stall"));
    out.put_u32_le(100);
    out.put_u8(0x02);
    send(&mut rank_conn, &out).await;

    // A node agent: its hello, then half a frame.
    let mut agent_conn = raw(&server).await;
    let mut out = BytesMut::new();
    encode_preamble(&mut out);
    encode_agent_frame(&AgentFrame::Hello { host: "node".into(), pid: 1 }, &mut out);
    out.put_u32_le(100);
    send(&mut agent_conn, &out).await;

    let got = expect_closed(&mut rank_conn, "the stalled rank's connection").await;
    let mut got = got;
    assert!(matches!(decode_server_frame(&mut got, &FrameLimits::unbounded()), Ok(Some(ServerFrame::Welcome(_)))));
    let got = expect_closed(&mut agent_conn, "the stalled agent's connection").await;
    assert!(!got.is_empty(), "the agent was welcomed before it stalled");

    // An idle connection between frames is not touched, however long it waits.
    tokio::time::sleep(Duration::from_millis(600)).await;
    good.set("k", "v").await.expect("an idle client is still served");
    good.close().await.expect("close");
    server.shutdown().await;
}

/// Every accepted connection has TCP keepalive on, so that a peer whose host
/// vanished (no FIN, no RST) is found: the kernel shows its keepalive timer (timer
/// kind 2 in /proc/net/tcp) on the server's side of an idle connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepted_connections_have_keepalive() {
    let server = start_server().await;
    let mut idle = raw(&server).await;
    send(&mut idle, &hello(Identity::anonymous("ka"))).await;
    let mut buf = BytesMut::new();
    assert!(matches!(read_frame(&mut idle, &mut buf).await, ServerFrame::Welcome(_)));
    let (server_port, client_port) = (server.local_addr().port(), idle.local_addr().expect("local addr").port());
    let table = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
    // Columns: sl local_address rem_address st tx_queue:rx_queue tr:tm->when ...
    let timer = table.lines().skip(1).find_map(|line| {
        let cols: Vec<&str> = line.split_whitespace().collect();
        let port = |col: &str| u16::from_str_radix(col.rsplit(':').next()?, 16).ok();
        (port(cols[1]) == Some(server_port) && port(cols[2]) == Some(client_port))
            .then(|| cols[5].split(':').next().unwrap_or("").to_owned())
    });
    assert_eq!(timer.as_deref(), Some("02"), "the server's side of the connection has no keepalive timer");
    server.shutdown().await;
}

/// Connections holding parts of large frames cannot together hold more than the
/// server's budget: past it, the one holding the most is closed (another one, or
/// the one going over), and a client of another job goes on being served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partial_frames_are_held_within_the_pending_budget() {
    const BUDGET: usize = 1 << 20;
    let mut config = ServerConfig::new("127.0.0.1:0".parse().expect("addr"), rallypoint::Config::default());
    config.max_pending_bytes = BUDGET;
    // Not the read timeout (another defence) but the budget must close them here.
    config.read_timeout = Duration::from_secs(600);
    let server = start_server_configured(config).await;
    let healthy = connect(&server, Identity::anonymous("healthy")).await;
    // A set of a `value`-byte value, whole.
    let set_frame = |value: usize| {
        let mut frame = BytesMut::new();
        let request = Request::Set { key: "big".into(), value: vec![7u8; value].into() };
        encode_client_frame(&ClientFrame::Request { id: 1, request }, &mut frame);
        frame
    };
    // A hello, then the first `sent` bytes of such a set.
    let partial = |sent: usize, value: usize| {
        let mut out = hello(Identity::anonymous("attack"));
        out.extend_from_slice(&set_frame(value)[..sent]);
        out
    };
    let held_at_least = |bytes: usize| {
        let server = &server;
        bounded("the server to hold the partial frame", async move {
            while server.pending_bytes() < bytes {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };

    let mut a = raw(&server).await;
    send(&mut a, &partial(800_000, 1 << 20)).await;
    held_at_least(800_000).await;
    // B takes the total past the budget: A holds the most and is closed; B goes on.
    let mut b = raw(&server).await;
    send(&mut b, &partial(500_000, 1 << 20)).await;
    let mut got = expect_closed(&mut a, "the largest holder").await;
    assert!(matches!(decode_server_frame(&mut got, &FrameLimits::unbounded()), Ok(Some(ServerFrame::Welcome(_)))));
    held_at_least(500_000).await;
    // C goes past it, holding more than B by then: C itself is closed.
    let mut c = raw(&server).await;
    send(&mut c, &partial(1_200_000, 2 << 20)).await;
    expect_closed(&mut c, "the connection going over with the most").await;
    assert!(server.pending_bytes() <= BUDGET, "{} bytes held", server.pending_bytes());

    // B was never closed: it finishes its request and is answered.
    send(&mut b, &set_frame(1 << 20)[500_000..]).await;
    let mut buf = BytesMut::new();
    assert!(matches!(read_frame(&mut b, &mut buf).await, ServerFrame::Welcome(_)));
    assert!(matches!(read_frame(&mut b, &mut buf).await, ServerFrame::Reply { id: 1, reply: Ok(Response::Done) }));
    assert_eq!(server.pending_bytes(), 0);
    healthy.set("still", "served").await.expect("another job is served throughout");
    healthy.close().await.expect("close");
    server.shutdown().await;
}

/// A barrier-channel request (docs/PROTOCOL.md, section 15) sent straight to the
/// coordinator, which has no channels to give: it says so before the call's reply,
/// and the call itself is answered as any barrier is, on whichever thread serves
/// the connection (a task, or the reactor with `native_on_reactor`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_coordinator_answers_a_barrier_channel_request_with_none_then_the_reply() {
    for on_reactor in [false, true] {
        let mut config = ServerConfig::new("127.0.0.1:0".parse().expect("loopback"), Default::default());
        config.native_on_reactor = on_reactor;
        answers_a_channel_request_with_none(start_server_configured(config).await).await;
    }
}

async fn answers_a_channel_request_with_none(server: ServerHandle) {
    let mut s = raw(&server).await;
    let mut out = hello(rank("chan", 0, 1));
    let request = Request::Barrier { name: "b".into(), members: Members::World, timeout_ms: Some(30_000) };
    encode_client_frame(&ClientFrame::AttachBarrier { id: 3, request }, &mut out);
    send(&mut s, &out).await;
    let mut buf = BytesMut::new();
    assert!(matches!(read_frame(&mut s, &mut buf).await, ServerFrame::Welcome(_)));
    match read_frame(&mut s, &mut buf).await {
        ServerFrame::NoBarrierChannel { id: 3, reason } => assert!(reason.contains("node agent"), "{reason}"),
        other => panic!("expected NoBarrierChannel for request 3 first, got {other:?}"),
    }
    match read_frame(&mut s, &mut buf).await {
        ServerFrame::Reply { id: 3, reply: Ok(Response::Done) } => {}
        other => panic!("expected the barrier's reply, got {other:?}"),
    }
    server.shutdown().await;
}

/// A request larger than any frame the coordinator reads (each value within its
/// limit, their sum not): the call fails at once naming the frame limit, instead of
/// the client sending it again on every reconnect until its timeout; the client
/// carries on.
#[tokio::test]
async fn a_request_beyond_the_frame_limit_fails_its_call_and_the_client_carries_on() {
    let server = start_server().await;
    let client = connect(&server, Identity::anonymous("big")).await;
    let value = vec![b'x'; 8 << 20];
    let entries: Vec<(String, &[u8])> = (0..9).map(|i| (format!("b{i}"), value.as_slice())).collect();
    let result = bounded("the oversized multi_set", client.multi_set(&entries)).await;
    match result {
        Err(Error::Op(OpError::Invalid(message))) => {
            assert!(message.contains("is more than this coordinator reads in one frame"), "{message}");
        }
        other => panic!("expected Invalid, got {other:?}"),
    }
    bounded("set", client.set("k", "v")).await.expect("the client carries on");
    assert_eq!(bounded("get", client.get("k", None)).await.expect("get"), "v");
    assert_eq!(bounded("num_keys", client.num_keys()).await.expect("num_keys"), 1);
    client.close().await.expect("close");
}
