//! HTTP clients that misbehave cost only themselves: a missing or wrong token is
//! refused before the coordinator is looked at; a client that stalls, sends half a
//! request or never reads its answers neither stops the others' updates nor keeps
//! its connection slot for long.
//!
//! The requests are written by hand on purpose: these clients must do what no
//! well-behaved library would (stop in the middle of a request, never read).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use rallypoint_client::{Client, ConnectOptions, Identity, Members};
use rallypoint_core::Config;
use rallypoint_http::{HttpConfig, HttpHandle, HttpServer};
use rallypoint_server::{Server, ServerConfig, ServerHandle, Token};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::{timeout, Instant};

const TOKEN: &str = "0123456789abcdef0123456789abcdef";
/// Upper bound of any wait in these tests.
const LIMIT: Duration = Duration::from_secs(30);

struct Setup {
    server: ServerHandle,
    page: HttpHandle,
    token: Arc<Token>,
}

async fn setup(configure: impl FnOnce(&mut HttpConfig)) -> Setup {
    let token = Arc::new(Token::new(TOKEN, "test").expect("token"));
    let mut config = ServerConfig::new("127.0.0.1:0".parse().unwrap(), Config::default());
    config.token = Some(Arc::clone(&token));
    let server = Server::bind(config).await.expect("bind the coordinator");
    let mut http = HttpConfig::new("127.0.0.1:0".parse().unwrap(), Some(Arc::clone(&token)));
    configure(&mut http);
    let page = HttpServer::bind(http, server.observer(), None).expect("bind the page").spawn();
    Setup { server: server.spawn(), page, token }
}

/// An answer: status, headers (lower-case names), body.
struct Answer {
    status: u16,
    head: String,
    body: String,
}

/// GET `path` with `headers` on a connection of its own, read to its close.
async fn get(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> Answer {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    let mut request = format!("GET {path} HTTP/1.1\r\nConnection: close\r\n");
    if !headers.iter().any(|(name, _)| name.eq_ignore_ascii_case("host")) {
        request.push_str(&format!("Host: {addr}\r\n"));
    }
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    stream.write_all(request.as_bytes()).await.expect("send");
    let mut raw = Vec::new();
    timeout(LIMIT, stream.read_to_end(&mut raw)).await.expect("an answer in time").expect("read");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    Answer { status, head: head.to_ascii_lowercase(), body: body.to_owned() }
}

fn bearer() -> String {
    format!("Bearer {TOKEN}")
}

async fn rank(server: &ServerHandle, token: &Arc<Token>, job: &str, rank: u32, world: u32) -> Client {
    let options = ConnectOptions::new(server.local_addr().to_string(), Identity::ranked(job, rank, world))
        .with_token(Some(Arc::clone(token)));
    Client::connect_with(options).await.expect("a rank connects")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_or_wrong_token_is_refused_before_the_coordinator_is_looked_at() {
    let s = setup(|_| {}).await;
    let addr = s.page.local_addr();
    let wrong_cookie = "rallypoint_session=0000000000000000000000000000000000000000000000000000000000000000";
    for (path, headers) in [
        ("/", vec![]),
        ("/api/status", vec![]),
        ("/metrics", vec![]),
        ("/api/status", vec![("Authorization", "Bearer wrong")]),
        ("/metrics", vec![("Authorization", "Bearer 0123456789abcdef0123456789abcdeX")]),
        ("/api/status", vec![("Cookie", wrong_cookie)]),
        ("/login?token=wrong", vec![]),
    ] {
        let answer = get(addr, path, &headers).await;
        assert_eq!(answer.status, 401, "{path} {headers:?}: {}", answer.head);
        assert!(answer.head.contains("www-authenticate: bearer"), "{}", answer.head);
        if path != "/" && !path.starts_with("/login") {
            // A wrong token is not told it is missing.
            assert!(answer.body.contains("no token, or a wrong one"), "{path}: {}", answer.body);
        }
    }
    assert_eq!(s.page.lookups(), 0, "no refused request made the page look at the coordinator");

    // The token, as a bearer header or through the login cookie.
    let answer = get(addr, "/api/status", &[("Authorization", &bearer())]).await;
    assert_eq!(answer.status, 200, "{}", answer.head);
    let doc: serde_json::Value = serde_json::from_str(&answer.body).expect("JSON");
    assert_eq!(doc["schema"], 1);
    assert_eq!(s.page.lookups(), 1);
    let login = get(addr, &format!("/login?token={TOKEN}"), &[]).await;
    assert_eq!(login.status, 303, "{}", login.head);
    assert!(login.head.contains("location: /"), "{}", login.head);
    let cookie = login
        .head
        .lines()
        .find_map(|l| l.strip_prefix("set-cookie: "))
        .and_then(|c| c.split(';').next())
        .expect("a session cookie")
        .to_owned();
    assert!(!cookie.contains(TOKEN), "the cookie is not the token: {cookie}");
    assert!(login.head.contains("httponly") && login.head.contains("samesite=strict"), "{}", login.head);
    let page = get(addr, "/", &[("Cookie", &cookie)]).await;
    assert_eq!(page.status, 200);
    assert!(page.body.contains("<title>rallypoint</title>") && page.body.contains("/api/status"));
    assert!(!page.body.contains("/*PAGE_JS*/"), "the script is in the page");
    // A loopback page answers only requests that name it by address or localhost.
    let rebound = get(addr, "/api/status", &[("Authorization", &bearer()), ("Host", "evil.example")]).await;
    assert_eq!(rebound.status, 421, "{}", rebound.head);
    drop(s.token);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_half_sent_and_unread_clients_cost_only_themselves() {
    let s = setup(|c| {
        c.max_connections = 4;
        c.header_timeout = Duration::from_millis(800);
        c.stall_timeout = Duration::from_millis(800);
    })
    .await;
    let addr = s.page.local_addr();

    // A client that never finishes its request headers is closed.
    let mut slow = TcpStream::connect(addr).await.expect("connect");
    slow.write_all(b"GET /api/status HTTP/1.1\r\nHost: 127.0.0.1\r\n").await.expect("half a request");
    let mut buf = [0u8; 1024];
    let read = timeout(LIMIT, slow.read(&mut buf)).await.expect("closed in time");
    assert!(matches!(read, Ok(0) | Err(_)) || String::from_utf8_lossy(&buf).contains("408"), "{read:?}");

    // A client that asks again and again and never reads its answers.
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("a small receive buffer");
    let mut hog = socket.connect(addr).await.expect("connect");
    let request = format!("GET /api/status HTTP/1.1\r\nHost: {addr}\r\nAuthorization: {}\r\n\r\n", bearer());
    // More requests (and answers) than the sockets' buffers hold: the server must
    // wait on the hog, and stops reading its requests.
    let flood: String = std::iter::repeat_n(request.as_str(), 200_000).collect();
    let writer = tokio::spawn(async move {
        // Blocks once both socket buffers are full: the hog takes nothing.
        timeout(LIMIT, hog.write_all(flood.as_bytes())).await
    });

    // Meanwhile another client sees the job change.
    let job = "watched";
    let r0 = rank(&s.server, &s.token, job, 0, 2).await;
    let waiting = tokio::spawn(async move { r0.barrier("b", Members::World, None).await.map(|()| r0) });
    let arrived = |doc: &serde_json::Value| doc["job"]["waits"][0]["arrived"].as_u64();
    let deadline = Instant::now() + LIMIT;
    loop {
        let answer = get(addr, &format!("/api/status?job={job}"), &[("Authorization", &bearer())]).await;
        assert_eq!(answer.status, 200, "{}", answer.head);
        let doc: serde_json::Value = serde_json::from_str(&answer.body).expect("JSON");
        if arrived(&doc) == Some(1) {
            break;
        }
        assert!(Instant::now() < deadline, "the barrier never showed: {doc:#}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let r1 = rank(&s.server, &s.token, job, 1, 2).await;
    r1.barrier("b", Members::World, None).await.expect("the barrier releases");
    waiting.await.expect("joined").expect("released");
    loop {
        let answer = get(addr, &format!("/api/status?job={job}"), &[("Authorization", &bearer())]).await;
        let doc: serde_json::Value = serde_json::from_str(&answer.body).expect("JSON");
        if doc["job"]["waits"].as_array().is_some_and(Vec::is_empty) {
            break;
        }
        assert!(Instant::now() < deadline, "the release never showed: {doc:#}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The hog's connection is closed for not taking what it asked for.
    let hog = timeout(LIMIT, writer).await.expect("the hog's write ends").expect("joined");
    assert!(matches!(hog, Ok(Err(_))), "the server closed the hog's connection: {hog:?}");

    // Connections past the limit are closed at once; the ones holding the slots go
    // when they stop moving, and then new ones are served again.
    let mut idle = Vec::new();
    for _ in 0..4 {
        idle.push(TcpStream::connect(addr).await.expect("connect"));
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut extra = TcpStream::connect(addr).await.expect("connect");
    let _ = extra.write_all(request.as_bytes()).await;
    let read = timeout(LIMIT, extra.read(&mut buf)).await.expect("closed in time");
    assert!(matches!(read, Ok(0) | Err(_)), "a connection past the limit is closed: {read:?}");
    for mut conn in idle {
        let read = timeout(LIMIT, conn.read(&mut buf)).await.expect("an idle connection is closed in time");
        assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    }
    let answer = get(addr, "/api/status", &[("Authorization", &bearer())]).await;
    assert_eq!(answer.status, 200, "{}", answer.head);
}
