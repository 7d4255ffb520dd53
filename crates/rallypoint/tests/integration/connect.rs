use std::io;
use std::time::{Duration, Instant};

use rallypoint::server::{Server, ServerConfig};
use rallypoint::{Client, Config, ConnectOptions, Error, Identity, OpError};
use tokio::net::TcpListener;

use crate::common::{bounded, init_tracing, rank, start_server};

/// A free loopback port (bound and released).
async fn free_port() -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    listener.local_addr().expect("addr")
}

/// A worker that starts before its coordinator keeps retrying and gets in once the
/// coordinator listens: first a listener that hangs up on it (twice), then nothing
/// listening at all, then the real coordinator.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_retries_until_the_coordinator_listens() {
    init_tracing();
    let impostor = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = impostor.local_addr().expect("addr");
    let options = ConnectOptions::new(addr.to_string(), rank("early", 0, 1)).with_timeout(Duration::from_secs(30));
    let connecting = tokio::spawn(Client::connect_with(options));

    for attempt in 0..2 {
        let (stream, _) = bounded("a connect attempt", impostor.accept()).await.expect("accept");
        drop(stream);
        assert!(!connecting.is_finished(), "gave up after attempt {attempt}");
    }
    drop(impostor);

    let config = ServerConfig::new(addr, Config::default());
    let server = Server::bind(config).await.expect("bind the real coordinator").spawn();
    let client = bounded("connect", connecting).await.expect("task").expect("connected after retrying");
    client.set("k", "v").await.expect("set");
    assert_eq!(client.get("k", None).await.expect("get"), "v");
    client.close().await.expect("close");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_gives_up_after_its_timeout_naming_the_address() {
    let addr = free_port().await;
    let options =
        ConnectOptions::new(addr.to_string(), Identity::anonymous("j")).with_timeout(Duration::from_millis(300));
    let started = Instant::now();
    match bounded("connect", Client::connect_with(options)).await {
        Err(Error::Connect { addr: named, waited, source }) => {
            assert_eq!(named, addr.to_string());
            assert!(waited >= Duration::from_millis(300), "waited {waited:?}");
            assert_eq!(source.kind(), io::ErrorKind::ConnectionRefused);
        }
        other => panic!("expected Connect, got {:?}", other.map(|c| c.identity().clone())),
    }
    assert!(started.elapsed() < Duration::from_secs(3));
}

/// A refusal is the coordinator's answer: returned at once, not retried.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_identity_is_not_retried() {
    let server = start_server().await;
    let bad = Identity { rank: Some(5), ..rank("j", 0, 2) };
    let options = ConnectOptions::new(server.local_addr().to_string(), bad).with_timeout(Duration::from_secs(30));
    let started = Instant::now();
    match bounded("connect", Client::connect_with(options)).await {
        Err(Error::Op(OpError::Invalid(message))) => assert!(message.contains("rank 5"), "{message}"),
        other => panic!("expected a refusal, got {:?}", other.map(|c| c.identity().clone())),
    }
    assert!(started.elapsed() < Duration::from_secs(5));
    server.shutdown().await;
}

/// A coordinator that accepts but never answers: the client's own safety timer
/// (operation timeout + 5 s) ends the call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_coordinator_hits_the_client_safety_timeout() {
    use bytes::BytesMut;
    use rallypoint_core::{SessionId, Welcome};
    use rallypoint_proto::native::{encode_server_frame, ServerFrame};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let mute = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = mute.local_addr().expect("addr");
    let server = tokio::spawn(async move {
        let (mut stream, _) = mute.accept().await.expect("accept");
        let mut welcome = BytesMut::new();
        encode_server_frame(
            &ServerFrame::Welcome(Welcome { session: SessionId(1), lease_ms: 0, job_incarnation: None }),
            &mut welcome,
        );
        stream.write_all(&welcome).await.expect("welcome");
        // Read and ignore everything.
        let mut sink = [0u8; 1024];
        while stream.read(&mut sink).await.map(|n| n > 0).unwrap_or(false) {}
    });
    let client =
        bounded("connect", Client::connect(&addr.to_string(), Identity::anonymous("j"))).await.expect("connect");
    let started = Instant::now();
    match bounded("get", client.get("k", Some(Duration::from_millis(200)))).await {
        Err(Error::Timeout(after)) => assert_eq!(after, Duration::from_millis(5200)),
        other => panic!("expected Timeout, got {other:?}"),
    }
    assert!(started.elapsed() >= Duration::from_millis(5200));
    drop(client);
    bounded("mute server", server).await.expect("mute server task");
}

/// A coordinator that welcomes a client and then goes silent (frozen, say by
/// SIGSTOP): the client's call gives up after its timeout and safety margin, and
/// its close then returns at once instead of waiting as long again for the leave
/// (found by scripts/chaos: a CLI verb took twice the bound its --timeout states).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_after_a_silent_coordinator_does_not_wait_again() {
    use bytes::BytesMut;
    use rallypoint_proto::native::{encode_server_frame, ServerFrame};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    init_tracing();
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let silent = tokio::spawn(async move {
        let (mut stream, _) = listener.accept().await.expect("accept");
        let mut welcome = BytesMut::new();
        let welcome_frame =
            rallypoint_core::Welcome { session: rallypoint_core::SessionId(1), lease_ms: 0, job_incarnation: None };
        encode_server_frame(&ServerFrame::Welcome(welcome_frame), &mut welcome);
        stream.write_all(&welcome).await.expect("welcome");
        // Reads everything and answers nothing, until the client hangs up.
        let mut sink = vec![0u8; 4096];
        while matches!(stream.read(&mut sink).await, Ok(n) if n > 0) {}
    });
    let options = ConnectOptions::new(addr.to_string(), rank("silent", 0, 2)).with_timeout(Duration::from_secs(10));
    let client = bounded("connect", Client::connect_with(options)).await.expect("connected");
    let waited =
        bounded("the barrier", client.barrier("b", rallypoint::Members::World, Some(Duration::from_millis(500)))).await;
    assert!(matches!(waited, Err(Error::Timeout(_))), "{waited:?}");
    // It already waited its timeout: a close waiting for the leave would take 5.5 s more.
    let closed = tokio::time::timeout(Duration::from_secs(3), client.close()).await;
    assert!(matches!(closed, Ok(Ok(()))), "{closed:?}");
    bounded("the silent server to see the close", silent).await.expect("server task");
}

/// An address that cannot be one (no port, a port that is not a number) is refused
/// before any attempt, by name, rather than retried for the whole connect timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_address_is_refused_at_once() {
    for (addr, named) in [("localhost", "has no port"), ("127.0.0.1:abc", "'abc'"), (":29500", "no host")] {
        // A timeout the test's bound could not wait out: a retry would show.
        let options = ConnectOptions::new(addr, Identity::anonymous("t")).with_timeout(Duration::from_secs(3600));
        match bounded("connecting to a malformed address", Client::connect_with(options)).await {
            Err(Error::Config(message)) => {
                assert!(message.contains(addr) && message.contains(named), "{addr}: {message}")
            }
            other => panic!("{addr}: expected a Config error, got {:?}", other.map(|_| "a client")),
        }
    }
}

/// A peer that is not a coordinator: one that talks (an SSH server's banner) is
/// named so at once, without retrying until the timeout; one that takes the hello
/// and says nothing (torch's TCPStore) is named as such once the timeout runs out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_is_not_a_coordinator_is_named_so() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let talker = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = talker.local_addr().expect("addr");
    let server = tokio::spawn(async move {
        while let Ok((mut stream, _)) = talker.accept().await {
            tokio::spawn(async move {
                stream.write_all(b"SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n").await.expect("banner");
                let mut sink = [0u8; 1024];
                while stream.read(&mut sink).await.map(|n| n > 0).unwrap_or(false) {}
            });
        }
    });
    let options =
        ConnectOptions::new(addr.to_string(), Identity::anonymous("j")).with_timeout(Duration::from_secs(600));
    match bounded("connect", Client::connect_with(options)).await {
        Err(error @ Error::Connect { .. }) => assert!(
            error
                .to_string()
                .ends_with(r#"it is not a rallypoint coordinator: it answered "SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n""#),
            "{error}"
        ),
        Err(other) => panic!("expected a connect error, got {other}"),
        Ok(_) => panic!("connected to an SSH server"),
    }
    // Also when the client starts with the token handshake.
    let token = rallypoint::client::Token::new("a token", "the test").expect("token");
    let options = ConnectOptions::new(addr.to_string(), Identity::anonymous("j"))
        .with_timeout(Duration::from_secs(600))
        .with_token(Some(std::sync::Arc::new(token)));
    match bounded("connect with a token", Client::connect_with(options)).await {
        Err(error @ Error::Connect { .. }) => {
            assert!(error.to_string().contains("it is not a rallypoint coordinator: it answered \"SSH-2.0-"), "{error}")
        }
        Err(other) => panic!("expected a connect error, got {other}"),
        Ok(_) => panic!("connected to an SSH server"),
    }
    server.abort();

    let mute = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = mute.local_addr().expect("addr");
    let server = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = mute.accept().await {
            held.push(stream);
        }
    });
    let options = ConnectOptions::new(addr.to_string(), Identity::anonymous("j")).with_timeout(Duration::from_secs(1));
    match bounded("connect", Client::connect_with(options)).await {
        Err(error @ Error::Connect { .. }) => {
            assert!(
                error.to_string().contains("sent no welcome within the connect timeout: is it a rallypoint"),
                "{error}"
            )
        }
        Err(other) => panic!("expected a connect error, got {other}"),
        Ok(_) => panic!("connected to a mute peer"),
    }
    server.abort();
}
