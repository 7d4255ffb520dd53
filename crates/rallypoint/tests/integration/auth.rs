//! Token authentication and TLS end to end (issue #14): a coordinator with a token
//! refuses clients without it or with a wrong one, typed and at once, and such a
//! client costs it nothing but that connection; TLS carries every kind of
//! connection (clients, node agents, large replies) and plaintext is refused on a
//! TLS port; TCPStore clients of this user are still served.

use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use rallypoint::agent::{Agent, AgentConfig, AgentError, AgentHandle};
use rallypoint::client::{AuthFailure, AuthRefusal, TlsClient, Token};
use rallypoint::server::{ServerConfig, ServerHandle, TlsServer};
use rallypoint::{Client, Config, ConnectOptions, Error, Identity, Members};
use rallypoint_net::test_pki::TestPki;
use rallypoint_proto::tcpstore::{encode_command, Command, VALIDATE_MAGIC};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::{bounded, rank, start_server_configured};

const TOKEN: &str = "the-token-of-the-test-job-0123456789";

fn token(text: &str) -> Option<Arc<Token>> {
    Some(Arc::new(Token::new(text, "test").expect("token")))
}

/// A throwaway CA for the test `name`.
fn test_ca(name: &str) -> TestPki {
    let dir = std::env::temp_dir().join(format!("rallypoint-it-pki-{name}-{}", std::process::id()));
    TestPki::create(dir, "rallypoint test CA").expect("test CA")
}

async fn server(token_text: Option<&str>, tls: Option<TlsServer>) -> ServerHandle {
    let mut config = ServerConfig::new("127.0.0.1:0".parse().expect("address"), Config::default());
    config.token = token_text.and_then(token);
    config.tls = tls;
    start_server_configured(config).await
}

/// Options with a connect timeout far beyond the test's bound: a refusal that were
/// retried would hang the test instead of passing it.
fn options(
    server: &ServerHandle,
    identity: Identity,
    token_text: Option<&str>,
    tls: Option<TlsClient>,
) -> ConnectOptions {
    ConnectOptions::new(server.local_addr().to_string(), identity)
        .with_timeout(Duration::from_secs(600))
        .with_token(token_text.and_then(token))
        .with_tls(tls)
}

async fn connect(options: ConnectOptions) -> Result<Client, Error> {
    bounded("connect", Client::connect_with(options)).await
}

fn refusal(result: Result<Client, Error>) -> AuthFailure {
    match result {
        Err(Error::Auth { failure, .. }) => failure,
        Err(other) => panic!("expected an authentication error, got {other}"),
        Ok(_) => panic!("expected an authentication error, got a connection"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_token_gets_a_clear_error_and_costs_the_server_nothing_but_that_connection() {
    let server = server(Some(TOKEN), None).await;
    let good = connect(options(&server, rank("j", 0, 2), Some(TOKEN), None)).await.expect("the right token");

    // Wrong tokens, again and again, and clients without one: each refused by name.
    for attempt in 0..50 {
        let failure = refusal(connect(options(&server, rank("j", 1, 2), Some("a-guess"), None)).await);
        assert_eq!(failure, AuthFailure::Refused(AuthRefusal::WrongToken), "attempt {attempt}");
    }
    let failure = refusal(connect(options(&server, rank("j", 1, 2), None, None)).await);
    assert_eq!(failure, AuthFailure::Refused(AuthRefusal::TokenRequired));
    assert!(failure.to_string().contains("requires a token: set RALLYPOINT_TOKEN or RALLYPOINT_TOKEN_FILE"));

    // Nothing of them is left: no session, no rank, no bytes held; the job goes on.
    let status = bounded("status", good.status()).await.expect("status");
    assert!(status.contains("connections: 0 native"), "no session but the caller's: {status}");
    assert!(status.contains("ranks: 1 connected, 0 left cleanly, 0 lost"), "{status}");
    assert_eq!(server.pending_bytes(), 0);
    let second = connect(options(&server, rank("j", 1, 2), Some(TOKEN), None)).await.expect("rank 1 with the token");
    let (a, b) = tokio::join!(good.barrier("b", Members::World, None), second.barrier("b", Members::World, None));
    a.expect("barrier");
    b.expect("barrier");
    good.close().await.expect("close");
    second.close().await.expect("close");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_with_a_token_refuses_a_coordinator_without_one() {
    let server = server(None, None).await;
    let failure = refusal(connect(options(&server, rank("j", 0, 1), Some(TOKEN), None)).await);
    assert_eq!(failure, AuthFailure::Refused(AuthRefusal::NoTokenHere));
    server.shutdown().await;
}

/// Two ranks over TLS with the token: a barrier, and an all-gather whose reply is
/// large enough to go out as a shared tail through vectored writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_carries_clients_and_large_replies_and_plaintext_is_refused() {
    let pki = test_ca("clients");
    let server = server(Some(TOKEN), Some(pki.server().expect("server TLS"))).await;
    let c0 = connect(options(&server, rank("j", 0, 2), Some(TOKEN), Some(pki.client().expect("client TLS"))))
        .await
        .expect("TLS rank 0");
    let c1 = connect(options(&server, rank("j", 1, 2), Some(TOKEN), Some(pki.client().expect("client TLS"))))
        .await
        .expect("TLS rank 1");
    let (a, b) = tokio::join!(c0.barrier("b", Members::World, None), c1.barrier("b", Members::World, None));
    a.expect("barrier");
    b.expect("barrier");
    let big = |fill: u8| vec![fill; 3 << 20];
    let (a, b) = tokio::join!(
        c0.all_gather("g", Members::World, big(1), None),
        c1.all_gather("g", Members::World, big(2), None)
    );
    let (a, b) = (a.expect("all-gather"), b.expect("all-gather"));
    assert_eq!(a, b);
    assert_eq!(a.iter().map(|v| v.to_vec()).collect::<Vec<_>>(), [big(1), big(2)]);

    let failure = refusal(connect(options(&server, rank("j", 0, 2), Some(TOKEN), None)).await);
    assert_eq!(failure, AuthFailure::Refused(AuthRefusal::TlsRequired));
    let other = test_ca("other-ca");
    let failure = refusal(
        connect(options(&server, rank("j", 0, 2), Some(TOKEN), Some(other.client().expect("client TLS")))).await,
    );
    // Named as what failed against which file, not in rustls's words alone.
    let said = format!("the coordinator's certificate was not issued by the CA in {}", other.path("ca.pem").display());
    assert!(matches!(&failure, AuthFailure::Tls(message) if message.starts_with(&said)), "{failure}");
    c0.close().await.expect("close");
    c1.close().await.expect("close");
    server.shutdown().await;

    // A TLS client of a coordinator that serves no TLS is told so.
    let plain =
        start_server_configured(ServerConfig::new("127.0.0.1:0".parse().expect("address"), Config::default())).await;
    let failure =
        refusal(connect(options(&plain, rank("j", 0, 2), None, Some(pki.client().expect("client TLS")))).await);
    let said = "the coordinator refused the TLS handshake (received fatal alert: HandshakeFailure): it most likely serves no TLS";
    assert!(matches!(&failure, AuthFailure::Tls(message) if message.starts_with(said)), "{failure}");
    plain.shutdown().await;
}

async fn agent(server: &ServerHandle, config: impl FnOnce(&mut AgentConfig)) -> Result<AgentHandle, AgentError> {
    let mut agent = AgentConfig::new(server.local_addr().to_string(), "127.0.0.1:0");
    agent.connect_timeout = Duration::from_secs(600);
    config(&mut agent);
    Ok(bounded("agent start", Agent::bind(agent)).await?.spawn())
}

/// A node agent reaches a TLS coordinator with the token and requires the token
/// (and, with a certificate, TLS) of its own ranks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_agent_proves_the_token_upstream_and_requires_it_of_its_ranks() {
    let pki = test_ca("agent");
    let server = server(Some(TOKEN), Some(pki.server().expect("server TLS"))).await;
    match agent(&server, |c| c.upstream_tls = Some(pki.client().expect("client TLS"))).await {
        Err(AgentError::Auth { failure: AuthFailure::Refused(AuthRefusal::TokenRequired), .. }) => {}
        Err(other) => panic!("expected a refused agent, got {other}"),
        Ok(_) => panic!("an agent without the token was let in"),
    }
    let agent = agent(&server, |c| {
        c.token = token(TOKEN);
        c.upstream_tls = Some(pki.client().expect("client TLS"));
        c.tls = Some(pki.server().expect("server TLS"));
    })
    .await
    .expect("agent with the token");
    let local = |identity, token_text: Option<&str>, tls| {
        ConnectOptions::new(agent.local_addr().to_owned(), identity)
            .with_timeout(Duration::from_secs(600))
            .with_token(token_text.and_then(token))
            .with_tls(tls)
    };
    let failure = refusal(connect(local(rank("j", 0, 2), None, Some(pki.client().expect("client TLS")))).await);
    assert_eq!(failure, AuthFailure::Refused(AuthRefusal::TokenRequired));
    let failure = refusal(connect(local(rank("j", 0, 2), Some(TOKEN), None)).await);
    assert_eq!(failure, AuthFailure::Refused(AuthRefusal::TlsRequired));
    let c0 = connect(local(rank("j", 0, 2), Some(TOKEN), Some(pki.client().expect("client TLS"))))
        .await
        .expect("rank 0 via the agent");
    let c1 = connect(options(&server, rank("j", 1, 2), Some(TOKEN), Some(pki.client().expect("client TLS"))))
        .await
        .expect("rank 1");
    let big = |fill: u8| vec![fill; 1 << 20];
    let (a, b) = tokio::join!(
        c0.all_gather("g", Members::World, big(7), None),
        c1.all_gather("g", Members::World, big(8), None)
    );
    assert_eq!(a.expect("all-gather via the agent").iter().map(|v| v.to_vec()).collect::<Vec<_>>(), [big(7), big(8)]);
    b.expect("all-gather");
    c0.close().await.expect("close");
    c1.close().await.expect("close");
    let _ = agent.shutdown().await;
    server.shutdown().await;
}

/// With a token, a TCPStore client of this user on this machine is still served
/// (the launcher's torch workers); keys stay the TCPStore job's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcpstore_clients_of_this_user_are_served_with_a_token() {
    let server = server(Some(TOKEN), None).await;
    let mut s = bounded("connect", TcpStream::connect(server.local_addr())).await.expect("connect");
    let mut out = BytesMut::new();
    encode_command(&Command::Validate { magic: VALIDATE_MAGIC }, &mut out);
    encode_command(&Command::Ping { nonce: 77 }, &mut out);
    encode_command(&Command::Add { key: "/n".into(), delta: 5 }, &mut out);
    s.write_all(&out).await.expect("send");
    assert_eq!(bounded("pong", s.read_u32_le()).await.expect("pong"), 77);
    assert_eq!(bounded("add", s.read_i64_le()).await.expect("add"), 5);
    let native = connect(options(&server, Identity::anonymous("default"), Some(TOKEN), None)).await.expect("native");
    assert_eq!(bounded("get", native.get("/n", None)).await.expect("get").as_ref(), b"5");
    let other_job = connect(options(&server, Identity::anonymous("other"), Some(TOKEN), None)).await.expect("native");
    assert!(!bounded("check", other_job.check(&["/n"])).await.expect("check"), "TCPStore keys are its job's only");
    native.close().await.expect("close");
    other_job.close().await.expect("close");
    server.shutdown().await;
}
