//! PyTorch TCPStore clients, spoken to byte by byte, against the server's TCPStore
//! reactor: replies released by other connections (native and TCPStore), a flood
//! of pipelined requests, a client that stops reading, shutdown.
//! (Real torch clients are tested in tests/python/tcpstore.)

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use rallypoint::Identity;
use rallypoint_proto::tcpstore::{encode_command, Command, VALIDATE_MAGIC};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use rallypoint::server::ServerConfig;

use crate::common::{bounded, connect, start_server, start_server_configured};

/// The job TCPStore connections join unless the server is told otherwise.
const TCPSTORE_JOB: &str = "default";

fn encode(commands: &[Command]) -> BytesMut {
    let mut out = BytesMut::new();
    for command in commands {
        encode_command(command, &mut out);
    }
    out
}

fn key(k: &str) -> Bytes {
    Bytes::copy_from_slice(k.as_bytes())
}

/// Connects and does torch's handshake (VALIDATE, then PING echoed).
async fn torch_client(addr: std::net::SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.set_nodelay(true).expect("nodelay");
    let nonce = 4242;
    s.write_all(&encode(&[Command::Validate { magic: VALIDATE_MAGIC }, Command::Ping { nonce }]))
        .await
        .expect("handshake");
    assert_eq!(s.read_u32_le().await.expect("pong"), nonce);
    s
}

async fn add(s: &mut TcpStream, k: &str, delta: i64) -> i64 {
    s.write_all(&encode(&[Command::Add { key: key(k), delta }])).await.expect("send ADD");
    s.read_i64_le().await.expect("ADD reply")
}

/// Nothing arrives on `s` for a while (it would be a premature reply).
async fn assert_silent(s: &mut TcpStream, what: &str) {
    let mut byte = [0u8; 1];
    if let Ok(read) = tokio::time::timeout(Duration::from_millis(200), s.read(&mut byte)).await {
        panic!("{what}: expected no reply yet, got {read:?} {byte:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_is_released_by_a_native_client_and_by_another_tcpstore_client() {
    let server = start_server().await;
    let mut waiter = torch_client(server.local_addr()).await;
    let mut setter = torch_client(server.local_addr()).await;
    let native = connect(&server, Identity::anonymous(TCPSTORE_JOB)).await;

    waiter.write_all(&encode(&[Command::Wait { keys: vec![key("/from-native")] }])).await.expect("WAIT");
    assert_silent(&mut waiter, "WAIT before the SET").await;
    bounded("native set", native.set("/from-native", "1")).await.expect("native set");
    assert_eq!(bounded("STOP_WAITING", waiter.read_u8()).await.expect("reply"), 0);

    waiter.write_all(&encode(&[Command::Wait { keys: vec![key("/from-torch")] }])).await.expect("WAIT");
    assert_silent(&mut waiter, "WAIT before the SET").await;
    setter.write_all(&encode(&[Command::Set { key: key("/from-torch"), value: key("v") }])).await.expect("SET");
    assert_eq!(bounded("STOP_WAITING", waiter.read_u8()).await.expect("reply"), 0);

    // The connection goes on serving afterwards.
    assert_eq!(bounded("add", add(&mut waiter, "/n", 5)).await, 5);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_pipelined_requests_is_answered_in_order_and_starves_no_one() {
    const FLOOD: i64 = 100_000; // ~2 MB of requests: many turns of the reactor's read budget
    let server = start_server().await;
    let flooder = torch_client(server.local_addr()).await;
    let mut other = torch_client(server.local_addr()).await;

    let (mut rx, mut tx) = flooder.into_split();
    let writer = tokio::spawn(async move {
        let adds: Vec<Command> = (0..FLOOD).map(|_| Command::Add { key: key("/flood"), delta: 1 }).collect();
        tx.write_all(&encode(&adds)).await.expect("flood");
        tx
    });
    let reader = tokio::spawn(async move {
        for expected in 1..=FLOOD {
            let got = rx.read_i64_le().await.expect("flood reply");
            assert_eq!(got, expected, "replies in request order");
        }
    });
    for expected in 1..=100 {
        assert_eq!(bounded("the other client's add", add(&mut other, "/other", 1)).await, expected);
    }
    bounded("flood replies", reader).await.expect("reader task");
    drop(bounded("flood writer", writer).await.expect("writer task"));
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_holds_up_no_one() {
    let server = start_server().await;
    let mut stalled = torch_client(server.local_addr()).await;
    let mut other = torch_client(server.local_addr()).await;
    let value = Bytes::from(vec![7u8; 16 * 1024]);
    stalled.write_all(&encode(&[Command::Set { key: key("/big"), value }])).await.expect("SET");
    // 16 MiB of replies, far more than the socket buffers hold; never read.
    let gets: Vec<Command> = (0..1024).map(|_| Command::Get { key: key("/big") }).collect();
    stalled.write_all(&encode(&gets)).await.expect("GETs");

    for expected in 1..=100 {
        assert_eq!(bounded("the other client's add", add(&mut other, "/other", 1)).await, expected);
    }
    drop(stalled);
    assert_eq!(bounded("add after the stalled client left", add(&mut other, "/other", 1)).await, 101);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_closes_tcpstore_connections() {
    let server = start_server().await;
    let mut client = torch_client(server.local_addr()).await;
    assert_eq!(bounded("add", add(&mut client, "/n", 1)).await, 1);
    bounded("shutdown", server.shutdown()).await;
    let mut rest = Vec::new();
    let read = bounded("end of stream", client.read_to_end(&mut rest)).await;
    assert!(matches!(read, Ok(0)) || read.is_err(), "expected the connection closed, got {read:?} {rest:?}");
}

/// Reads until the server closes `s`; returns how many bytes came first.
async fn until_closed(s: &mut TcpStream, what: &str) -> usize {
    let mut sink = vec![0u8; 64 << 10];
    let mut got = 0;
    bounded(what, async {
        loop {
            match s.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got += n,
            }
        }
    })
    .await;
    got
}

/// A torch client that stops in the middle of a request is closed once the read
/// timeout passes without a byte (it held the partial request for good before);
/// one idle between requests is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tcpstore_client_stalled_mid_request_is_closed_after_the_read_timeout() {
    let mut config = ServerConfig::new("127.0.0.1:0".parse().expect("addr"), rallypoint::Config::default());
    config.read_timeout = Duration::from_millis(300);
    let server = start_server_configured(config).await;
    let mut idle = torch_client(server.local_addr()).await;
    let mut stalled = torch_client(server.local_addr()).await;
    let set = encode(&[Command::Set { key: key("k"), value: Bytes::from(vec![1u8; 1000]) }]);
    stalled.write_all(&set[..set.len() / 2]).await.expect("half a SET");
    until_closed(&mut stalled, "the stalled TCPStore client").await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(add(&mut idle, "n", 1).await, 1, "an idle client is still served");
    server.shutdown().await;
}

/// A MULTI_SET announcing 131,072 entries of 8 MiB values is refused when its keys
/// and values pass max_request_len, before the rest is buffered: the server never
/// holds more than about that much of it (it grew to gigabytes before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_set_over_the_request_cap_is_closed_before_it_is_buffered() {
    let server = start_server().await;
    let cap = rallypoint_proto::max_request_len(&rallypoint::Limits::default());
    let mut attacker = torch_client(server.local_addr()).await;
    let mut header = BytesMut::new();
    encode_command(&Command::MultiSet { entries: Vec::new() }, &mut header);
    let mut out = BytesMut::from(&header[..1]);
    out.extend_from_slice(&131_072u64.to_le_bytes());
    let value = vec![0x5au8; 8 << 20];
    let (mut sent, mut most_held) = (0usize, 0usize);
    for i in 0..64u64 {
        let k = format!("k{i}");
        out.extend_from_slice(&(k.len() as u64).to_le_bytes());
        out.extend_from_slice(k.as_bytes());
        out.extend_from_slice(&(value.len() as u64).to_le_bytes());
        out.extend_from_slice(&value);
        if attacker.write_all(&out).await.is_err() {
            break;
        }
        sent += out.len();
        out.clear();
        most_held = most_held.max(server.pending_bytes());
    }
    until_closed(&mut attacker, "the oversized MULTI_SET").await;
    assert!(sent <= 2 * cap, "{sent} bytes were taken before the close");
    assert!(most_held <= cap + (1 << 20), "the server held {most_held} bytes of it");
    assert_eq!(server.pending_bytes(), 0);
    let mut other = torch_client(server.local_addr()).await;
    assert_eq!(add(&mut other, "n", 1).await, 1);
    server.shutdown().await;
}

/// A torch client's partial request counts against the budget of unfinished
/// requests like any connection's: past it, the connection holding the most goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partial_tcpstore_requests_count_against_the_pending_budget() {
    let mut config = ServerConfig::new("127.0.0.1:0".parse().expect("addr"), rallypoint::Config::default());
    config.max_pending_bytes = 1 << 20;
    config.read_timeout = Duration::from_secs(600);
    let server = start_server_configured(config).await;
    let set = |n: usize| encode(&[Command::Set { key: key("big"), value: Bytes::from(vec![1u8; n]) }]);
    let mut big = torch_client(server.local_addr()).await;
    // Requests that fit the budget whole, sent in part.
    big.write_all(&set(1_000_000)[..800_000]).await.expect("part of a SET");
    bounded("the server to hold it", async {
        while server.pending_bytes() < 800_000 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    let mut other = torch_client(server.local_addr()).await;
    other.write_all(&set(1_000_000)[..500_000]).await.expect("part of another SET");
    until_closed(&mut big, "the largest holder").await;
    let whole = set(1_000_000);
    other.write_all(&whole[500_000..]).await.expect("the rest");
    assert_eq!(add(&mut other, "n", 1).await, 1, "the other finished its SET and is served");
    server.shutdown().await;
}
