//! The handshake both ways over real sockets: the token proven by each side, TLS
//! with a CA made for the test, and what each side does when the other cannot
//! prove what it claims.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use rallypoint_core::{AuthRefusal, Identity, OpError, SessionId, Welcome};
use rallypoint_net::auth::Token;
use rallypoint_net::budget::PendingBudget;
use rallypoint_net::conn::{
    accept_hello, greet, peek_first_byte, Accepts, AuthFailure, Credentials, End, Gate, GreetError, Hello,
};
use rallypoint_net::test_pki::TestPki;
use rallypoint_net::tls::{TlsServer, TLS_FIRST_BYTE};
use rallypoint_proto::native::{
    decode_client_frame, decode_server_frame, encode_client_frame, encode_server_frame, ClientFrame, FrameLimits,
    ServerFrame,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const WAIT: Duration = Duration::from_secs(30);

fn token(text: &str) -> Arc<Token> {
    Arc::new(Token::new(text, "test").expect("token"))
}

/// A throwaway CA for the test `name`.
fn test_ca(name: &str) -> TestPki {
    let dir = std::env::temp_dir().join(format!("rallypoint-pki-{name}-{}", std::process::id()));
    TestPki::create(dir, "rallypoint test CA").expect("test CA")
}

/// Serves one connection as a coordinator would up to its welcome: TLS if the
/// first byte says so and `tls` is given, the gate, then a welcome (or the
/// refusal). Returns how the handshake ended.
async fn serve_one(listener: TcpListener, gate: Gate, tls: Option<TlsServer>) -> Result<Hello, End> {
    let (stream, _) = listener.accept().await.expect("accept");
    let first = peek_first_byte(&stream).await?;
    match (first, tls) {
        (Some(TLS_FIRST_BYTE), Some(tls)) => {
            let stream = tls.accept(stream).await?;
            let gate = Gate { tls_required: false, ..gate };
            handshake(stream, &gate).await
        }
        (_, tls) => handshake(stream, &Gate { tls_required: tls.is_some(), ..gate }).await,
    }
}

async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(mut stream: S, gate: &Gate) -> Result<Hello, End> {
    let mut rbuf = BytesMut::new();
    let mut charge = PendingBudget::new(1 << 20).charge();
    let limits = FrameLimits::default();
    let hello = accept_hello(&mut stream, &mut rbuf, &limits, Accepts::COORDINATOR, gate, &mut charge);
    let hello = tokio::time::timeout(WAIT, hello).await.expect("handshake in time");
    let mut out = BytesMut::new();
    match &hello {
        Ok(_) => encode_server_frame(
            &ServerFrame::Welcome(Welcome { session: SessionId(1), lease_ms: 0, job_incarnation: None }),
            &mut out,
        ),
        Err(End::Refused(error)) => encode_server_frame(&ServerFrame::Refused((**error).clone()), &mut out),
        Err(_) => {}
    }
    let _ = stream.write_all(&out).await;
    let _ = stream.flush().await;
    let _ = stream.shutdown().await;
    hello
}

/// Greets `addr` as a client would; the welcome's session, or the refusal.
async fn client(addr: &str, credentials: &Credentials) -> Result<Result<u64, OpError>, GreetError> {
    let mut hello = BytesMut::new();
    encode_client_frame(&ClientFrame::Hello(Identity::ranked("job", 0, 1)), &mut hello);
    let greeting = greet(addr, credentials, &hello, |buf| match decode_server_frame(buf, &FrameLimits::default()) {
        Ok(None) => None,
        Ok(Some(ServerFrame::Welcome(welcome))) => Some(Ok(welcome.session.0)),
        Ok(Some(ServerFrame::Refused(error))) => Some(Err(error)),
        other => panic!("unexpected answer {other:?}"),
    });
    let (_, answer, _) = tokio::time::timeout(WAIT, greeting).await.expect("greeting in time")?;
    Ok(answer)
}

async fn listener() -> (TcpListener, String) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address").to_string();
    (listener, addr)
}

async fn exchange(
    gate: Gate,
    tls: Option<TlsServer>,
    credentials: Credentials,
) -> (Result<Hello, End>, Result<Result<u64, OpError>, GreetError>) {
    let (listener, addr) = listener().await;
    let server = tokio::spawn(serve_one(listener, gate, tls));
    let client = client(&addr, &credentials).await;
    (server.await.expect("server task"), client)
}

#[tokio::test]
async fn the_same_token_on_both_sides_is_welcomed() {
    let gate = Gate { token: Some(token("job-token-1234567890")), tls_required: false };
    let credentials = Credentials { token: Some(token("job-token-1234567890")), tls: None };
    let (server, client) = exchange(gate, None, credentials).await;
    assert!(matches!(&server, Ok(Hello::Native(identity)) if identity.job == "job"), "{server:?}");
    assert_eq!(client.expect("greeted"), Ok(1));
}

#[tokio::test]
async fn a_wrong_token_or_none_is_refused_by_name() {
    let gate = || Gate { token: Some(token("job-token-1234567890")), tls_required: false };
    let wrong = Credentials { token: Some(token("not-the-job-token")), tls: None };
    let (server, client) = exchange(gate(), None, wrong).await;
    assert!(matches!(server, Err(End::Refused(_))), "{server:?}");
    match client {
        Err(GreetError::Auth(AuthFailure::Refused(AuthRefusal::WrongToken))) => {}
        other => panic!("expected a wrong-token refusal, got {other:?}"),
    }
    let (_, client) = exchange(gate(), None, Credentials::default()).await;
    let refusal = client.expect("an answer").expect_err("refused");
    assert_eq!(refusal, OpError::Unauthorized(AuthRefusal::TokenRequired));
    assert!(refusal.to_string().contains("set RALLYPOINT_TOKEN or RALLYPOINT_TOKEN_FILE"), "{refusal}");
}

#[tokio::test]
async fn a_client_with_a_token_refuses_a_server_without_one() {
    let credentials = Credentials { token: Some(token("job-token-1234567890")), tls: None };
    let (_, client) = exchange(Gate::default(), None, credentials).await;
    assert!(matches!(client, Err(GreetError::Auth(AuthFailure::Refused(AuthRefusal::NoTokenHere)))), "{client:?}");
}

/// A listener posing as the coordinator: it answers the token handshake without
/// knowing the token (with a made-up proof, or a welcome at once). The client
/// must refuse it before sending its hello.
#[tokio::test]
async fn a_client_refuses_a_server_that_cannot_prove_the_token() {
    for rogue in ["made-up proof", "welcome at once"] {
        let (listener, addr) = listener().await;
        let server = tokio::spawn(async move {
            let (mut stream, _) = listener.accept().await.expect("accept");
            let mut buf = BytesMut::new();
            while buf.len() < 6 {
                assert!(stream.read_buf(&mut buf).await.expect("read") > 0, "closed before the preamble");
            }
            let _preamble = buf.split_to(6);
            let start = next_frame(&mut stream, &mut buf).await;
            assert!(matches!(start, Some(ClientFrame::AuthStart { .. })), "{start:?}");
            let mut out = BytesMut::new();
            if rogue == "made-up proof" {
                encode_server_frame(&ServerFrame::AuthChallenge { nonce: [1; 32] }, &mut out);
                stream.write_all(&out).await.expect("write");
                let proof = next_frame(&mut stream, &mut buf).await;
                assert!(matches!(proof, Some(ClientFrame::AuthProof { .. })), "{proof:?}");
                out.clear();
                encode_server_frame(&ServerFrame::AuthAccepted { proof: [2; 32] }, &mut out);
            } else {
                encode_server_frame(
                    &ServerFrame::Welcome(Welcome { session: SessionId(9), lease_ms: 0, job_incarnation: None }),
                    &mut out,
                );
            }
            stream.write_all(&out).await.expect("write");
            // Whatever the client sends now: it must not be its hello.
            let mut rest = Vec::new();
            let _ = tokio::time::timeout(WAIT, stream.read_to_end(&mut rest)).await;
            rest
        });
        let credentials = Credentials { token: Some(token("job-token-1234567890")), tls: None };
        let client = client(&addr, &credentials).await;
        match client {
            Err(GreetError::Auth(failure @ AuthFailure::Unproven(_))) => {
                assert!(failure.to_string().contains("did not prove"), "{failure}")
            }
            other => panic!("{rogue}: expected the server to be unproven, got {other:?}"),
        }
        let after = server.await.expect("rogue task");
        assert!(!after.windows(3).any(|w| w == b"job"), "{rogue}: the hello reached the rogue server");
    }
}

async fn next_frame(stream: &mut TcpStream, buf: &mut BytesMut) -> Option<ClientFrame> {
    loop {
        if let Some(frame) = decode_client_frame(buf, &FrameLimits::default()).expect("well-formed") {
            return Some(frame);
        }
        if stream.read_buf(buf).await.expect("read") == 0 {
            return None;
        }
    }
}

#[tokio::test]
async fn tls_round_trip_with_a_token_and_plaintext_refused_on_a_tls_port() {
    let pki = test_ca("round-trip");
    let gate = || Gate { token: Some(token("job-token-1234567890")), tls_required: false };
    let credentials =
        Credentials { token: Some(token("job-token-1234567890")), tls: Some(pki.client().expect("client TLS")) };
    let (server, client) = exchange(gate(), Some(pki.server().expect("server TLS")), credentials).await;
    assert!(matches!(server, Ok(Hello::Native(_))), "{server:?}");
    assert_eq!(client.expect("greeted"), Ok(1));

    // Plaintext on the TLS port: refused with a reason, with or without a token.
    let plain = Credentials { token: Some(token("job-token-1234567890")), tls: None };
    let (_, client) = exchange(gate(), Some(pki.server().expect("server TLS")), plain).await;
    assert!(matches!(client, Err(GreetError::Auth(AuthFailure::Refused(AuthRefusal::TlsRequired)))), "{client:?}");
    let (_, client) = exchange(Gate::default(), Some(pki.server().expect("server TLS")), Credentials::default()).await;
    let refusal = client.expect("an answer").expect_err("refused");
    assert_eq!(refusal, OpError::Unauthorized(AuthRefusal::TlsRequired));
    assert!(refusal.to_string().contains("requires TLS"), "{refusal}");
}

#[tokio::test]
async fn a_certificate_from_another_ca_or_no_tls_at_all_fails_the_tls_handshake_at_once() {
    let (pki, other) = (test_ca("real"), test_ca("other"));
    let wrong_ca = Credentials { token: None, tls: Some(other.client().expect("client TLS")) };
    let (server, client) = exchange(Gate::default(), Some(pki.server().expect("server TLS")), wrong_ca).await;
    assert!(server.is_err(), "{server:?}");
    match client {
        Err(GreetError::Auth(AuthFailure::Tls(message))) => assert!(message.contains("certificate"), "{message}"),
        other => panic!("expected a TLS failure, got {other:?}"),
    }
    let tls_to_plain = Credentials { token: None, tls: Some(pki.client().expect("client TLS")) };
    let (_, client) = exchange(Gate::default(), None, tls_to_plain).await;
    assert!(matches!(client, Err(GreetError::Auth(AuthFailure::Tls(_)))), "{client:?}");
}

#[test]
fn pem_paths_are_checked() {
    let pki = test_ca("paths");
    let error =
        TlsServer::from_pem_files(&pki.path("cert.pem"), Path::new("/nonexistent/key.pem")).expect_err("no key");
    assert!(error.to_string().contains("/nonexistent/key.pem"), "{error}");
    // A key that is not the certificate's.
    let other = test_ca("paths-other");
    let error = TlsServer::from_pem_files(&pki.path("cert.pem"), &other.path("key.pem")).expect_err("mismatch");
    assert!(error.to_string().contains("cannot use the certificate"), "{error}");
    // The certificate given for the key.
    let error = TlsServer::from_pem_files(&pki.path("cert.pem"), &pki.path("cert.pem")).expect_err("no key");
    let said = format!("the private key file {} holds no private key", pki.path("cert.pem").display());
    assert!(error.to_string().starts_with(&said), "{error}");
}
