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

use crate::common::{bounded, connect, start_server};

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
