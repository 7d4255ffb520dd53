//! TLS for native connections (opt-in), with rustls: a coordinator or node agent
//! given a certificate and key ([`TlsServer`]) serves native clients over TLS on
//! its one port; a client given the CA certificate that signed it ([`TlsClient`])
//! checks that certificate against the address it connects to. The token
//! ([`crate::auth`]) still authenticates the client: TLS keeps the traffic private
//! and proves the server's identity by its certificate.
//!
//! A TLS client's first byte is 0x16 (a handshake record), which the serving side
//! tells apart from a native client's `R` and a PyTorch TCPStore client's 0x00
//! before reading anything ([`crate::conn::peek_first_byte`]). TCPStore stays
//! plaintext: torch's clients cannot speak TLS.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio_rustls::{TlsAcceptor, TlsConnector};

/// The first byte of a TLS connection (a handshake record: the ClientHello).
pub const TLS_FIRST_BYTE: u8 = 0x16;

/// A TLS record with a fatal `handshake_failure` alert: what a side that serves no
/// TLS sends a TLS client, so that its handshake fails at once, with a reason.
pub const HANDSHAKE_FAILURE_ALERT: [u8; 7] = [0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x28];

/// The variable naming the CA certificate (PEM) clients check the server's against.
pub const TLS_CA_VAR: &str = "RALLYPOINT_TLS_CA";

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read the {what} {}: {source}", path.display())]
    Pem { what: &'static str, path: PathBuf, source: rustls::pki_types::pem::Error },
    #[error("the {what} {} holds no certificate", path.display())]
    NoCertificate { what: &'static str, path: PathBuf },
    #[error(
        "the private key file {} holds no private key (a PEM \"PRIVATE KEY\", \"RSA PRIVATE KEY\" or \"EC \
         PRIVATE KEY\" block)",
        path.display()
    )]
    NoKey { path: PathBuf },
    #[error("cannot use the certificate {} with the key {}: {source}", cert.display(), key.display())]
    BadPair { cert: PathBuf, key: PathBuf, source: rustls::Error },
    #[error("cannot use the CA certificate {}: {source}", path.display())]
    BadCa { path: PathBuf, source: rustls::Error },
    #[error(
        "the certificate {subject} in {} {} {} (it is now {}): every TLS client would refuse it; {}",
        path.display(),
        if *.expired { "expired at" } else { "is valid only from" },
        shown(*.at),
        shown(*.now),
        if *.expired { "renew it" } else { "is this machine's clock right?" }
    )]
    OutOfDate { path: PathBuf, subject: String, expired: bool, at: SystemTime, now: SystemTime },
    #[error(
        "the certificate {subject} in {} is an X.509 v{version} one (made without extensions, as `openssl x509 \
         -req` makes it without `-extfile`): TLS clients take only v3 certificates that name the coordinator's \
         host in a subjectAltName (README, \"Authentication and TLS\", has a recipe)",
        path.display()
    )]
    NotV3 { path: PathBuf, subject: String, version: u32 },
    #[error(
        "the certificate {subject} in {} names no host in a subjectAltName: every TLS client would refuse it, \
         as they check the host they connect to against those names (README, \"Authentication and TLS\", has a \
         recipe)",
        path.display()
    )]
    NoHostNames { path: PathBuf, subject: String },
}

/// `at` in RFC 3339, which stops at the year 9999 (a certificate's date may not).
fn shown(at: SystemTime) -> String {
    const YEAR_10000: u64 = 253_402_300_800;
    match at.duration_since(UNIX_EPOCH) {
        Ok(since) if since.as_secs() >= YEAR_10000 => format!("{} s after 1970", since.as_secs()),
        _ => humantime::format_rfc3339_seconds(at).to_string(),
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn certificates(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem = |source| TlsError::Pem { what, path: path.to_owned(), source };
    let certs = CertificateDer::pem_file_iter(path).map_err(pem)?.collect::<Result<Vec<_>, _>>().map_err(pem)?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate { what, path: path.to_owned() });
    }
    Ok(certs)
}

/// Refuses a chain no client would take: a certificate out of date at `now`, or a
/// server certificate that is not v3 or names no host. A server started with one
/// would fail every TLS client's handshake, each far from here. A certificate this
/// parser cannot read is left to rustls and the clients.
fn usable(path: &Path, chain: &[CertificateDer<'_>], now: SystemTime) -> Result<(), TlsError> {
    let unix =
        |t: SystemTime| t.duration_since(UNIX_EPOCH).map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
    let at_unix = |secs: i64| UNIX_EPOCH + Duration::from_secs(u64::try_from(secs).unwrap_or(0));
    for (index, der) in chain.iter().enumerate() {
        let Ok((_, parsed)) = x509_parser::parse_x509_certificate(der) else { continue };
        let subject = || format!("'{}'", parsed.subject());
        // The server's own, first: what clients check against the host they reach.
        if index == 0 {
            // X509Version counts from 0.
            let version = parsed.version().0.saturating_add(1);
            if version != 3 {
                return Err(TlsError::NotV3 { path: path.to_owned(), subject: subject(), version });
            }
            let names = parsed.subject_alternative_name();
            if names.is_ok_and(|names| names.is_none_or(|n| n.value.general_names.is_empty())) {
                return Err(TlsError::NoHostNames { path: path.to_owned(), subject: subject() });
            }
        }
        let validity = parsed.validity();
        let (from, until) = (validity.not_before.timestamp(), validity.not_after.timestamp());
        let out = if unix(now) > until {
            Some((true, until))
        } else if unix(now) < from {
            Some((false, from))
        } else {
            None
        };
        if let Some((expired, at)) = out {
            let (path, subject) = (path.to_owned(), subject());
            return Err(TlsError::OutOfDate { path, subject, expired, at: at_unix(at), now });
        }
    }
    Ok(())
}

/// The serving side's certificate chain and key.
#[derive(Clone)]
pub struct TlsServer {
    acceptor: TlsAcceptor,
    cert: PathBuf,
}

impl TlsServer {
    /// The certificate chain (PEM, the server's own first) and its private key (PEM:
    /// PKCS#8, PKCS#1 or SEC1).
    pub fn from_pem_files(cert: &Path, key: &Path) -> Result<TlsServer, TlsError> {
        let chain = certificates("certificate file", cert)?;
        usable(cert, &chain, SystemTime::now())?;
        let private = PrivateKeyDer::from_pem_file(key).map_err(|source| match source {
            // A file of certificates, say, given for the key.
            rustls::pki_types::pem::Error::NoItemsFound => TlsError::NoKey { path: key.to_owned() },
            source => TlsError::Pem { what: "private key file", path: key.to_owned(), source },
        })?;
        let bad_pair = |source| TlsError::BadPair { cert: cert.to_owned(), key: key.to_owned(), source };
        let config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(bad_pair)?
            .with_no_client_auth()
            .with_single_cert(chain, private)
            .map_err(bad_pair)?;
        Ok(TlsServer { acceptor: TlsAcceptor::from(Arc::new(config)), cert: cert.to_owned() })
    }

    /// The TLS handshake of an accepted connection whose first byte was 0x16.
    pub async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
        &self,
        stream: S,
    ) -> io::Result<tokio_rustls::server::TlsStream<S>> {
        self.acceptor.accept(stream).await
    }
}

impl fmt::Debug for TlsServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsServer").field("cert", &self.cert).finish_non_exhaustive()
    }
}

/// What a client trusts: the CA certificate(s) that signed the server's.
#[derive(Clone)]
pub struct TlsClient {
    connector: TlsConnector,
    ca: PathBuf,
}

impl TlsClient {
    /// Trusts the certificates (PEM) in `ca`, and nothing else.
    pub fn from_ca_file(ca: &Path) -> Result<TlsClient, TlsError> {
        let mut roots = rustls::RootCertStore::empty();
        for cert in certificates("CA certificate file", ca)? {
            roots.add(cert).map_err(|source| TlsError::BadCa { path: ca.to_owned(), source })?;
        }
        let config = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|source| TlsError::BadCa { path: ca.to_owned(), source })?
            .with_root_certificates(roots)
            .with_no_client_auth();
        Ok(TlsClient { connector: TlsConnector::from(Arc::new(config)), ca: ca.to_owned() })
    }

    /// The CA file this client trusts (for error messages).
    pub fn ca(&self) -> &Path {
        &self.ca
    }

    /// A handshake's `failure` in words, naming the CA file where the server's
    /// certificate failed against it: rustls's own words name neither side.
    pub fn explain(&self, failure: &rustls::Error) -> String {
        let ca = self.ca.display();
        match failure {
            // A bad signature: a CA of the same name, not this one, signed it.
            rustls::Error::InvalidCertificate(
                rustls::CertificateError::UnknownIssuer | rustls::CertificateError::BadSignature,
            ) => {
                format!("the coordinator's certificate was not issued by the CA in {ca} ({failure})")
            }
            // webpki's error, boxed without a type to match on.
            rustls::Error::InvalidCertificate(rustls::CertificateError::Other(other))
                if format!("{other:?}").contains("CaUsedAsEndEntity") =>
            {
                format!(
                    "the coordinator serves a CA certificate (a self-signed one, say), not a certificate a CA \
                     issued for it: give the coordinator one issued by the CA in {ca} ({failure})"
                )
            }
            // What a coordinator or agent serving no TLS answers a TLS client with
            // (HANDSHAKE_FAILURE_ALERT).
            rustls::Error::AlertReceived(rustls::AlertDescription::HandshakeFailure) => format!(
                "the coordinator refused the TLS handshake ({failure}): it most likely serves no TLS (started \
                 without --tls-cert); connect without a CA (--tls-ca, RALLYPOINT_TLS_CA), or serve TLS"
            ),
            // Bytes that are no TLS record: an SSH or HTTP server, say.
            rustls::Error::InvalidMessage(rustls::InvalidMessage::InvalidContentType) => format!(
                "the peer answered the TLS handshake with something that is not TLS ({failure}): it is not a \
                 coordinator serving TLS (is the address right?)"
            ),
            _ => failure.to_string(),
        }
    }

    /// The TLS handshake over `stream`, connected to `addr` (`host:port`), whose
    /// host the server's certificate must name.
    pub async fn connect(
        &self,
        addr: &str,
        stream: TcpStream,
    ) -> io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
        let name = server_name(addr)?;
        self.connector.connect(name, stream).await
    }
}

/// The same CA file (settings compare equal when they would trust the same file).
impl PartialEq for TlsClient {
    fn eq(&self, other: &TlsClient) -> bool {
        self.ca == other.ca
    }
}

impl fmt::Debug for TlsClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsClient").field("ca", &self.ca).finish_non_exhaustive()
    }
}

/// The name a server's certificate must carry: the host of `host:port` (an IP
/// address, or a DNS name), without the brackets of an IPv6 address.
fn server_name(addr: &str) -> io::Result<ServerName<'static>> {
    let host = addr.rsplit_once(':').map_or(addr, |(host, _)| host);
    let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    ServerName::try_from(host.to_owned()).map_err(|error| {
        io::Error::new(io::ErrorKind::InvalidInput, format!("'{host}' is no name a TLS certificate can carry: {error}"))
    })
}

/// The TLS failure inside `error`, if it is one (a certificate that does not
/// verify, a handshake the peer refused): retrying will not change it.
pub fn tls_failure(error: &io::Error) -> Option<&rustls::Error> {
    error.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_names_come_from_the_address() {
        assert_eq!(server_name("127.0.0.1:29500").expect("ip").to_str(), "127.0.0.1");
        assert_eq!(server_name("[::1]:29500").expect("ipv6").to_str(), "::1");
        assert_eq!(server_name("coord.example:1").expect("dns").to_str(), "coord.example");
    }

    #[test]
    fn missing_or_empty_pem_files_are_named() {
        let missing = TlsClient::from_ca_file(Path::new("/nonexistent/ca.pem")).expect_err("missing");
        assert!(missing.to_string().contains("/nonexistent/ca.pem"), "{missing}");
        let empty = std::env::temp_dir().join(format!("rallypoint-empty-ca-{}.pem", std::process::id()));
        std::fs::write(&empty, "not a certificate\n").expect("write");
        let error = TlsClient::from_ca_file(&empty).expect_err("no certificate");
        assert!(error.to_string().contains("holds no certificate"), "{error}");
        std::fs::remove_file(&empty).expect("cleanup");
    }

    #[test]
    fn a_certificate_out_of_date_is_refused_naming_when() {
        let dir = std::env::temp_dir().join(format!("rallypoint-tls-dates-{}", std::process::id()));
        let pki = crate::test_pki::TestPki::create(dir, "dates CA").expect("pki");
        let path = pki.path("cert.pem");
        let chain = certificates("certificate file", &path).expect("chain");
        assert!(usable(&path, &chain, SystemTime::now()).is_ok());
        // The throwaway certificate is valid from 1975 to 4096.
        let error = usable(&path, &chain, UNIX_EPOCH).expect_err("before it");
        assert!(matches!(error, TlsError::OutOfDate { expired: false, .. }), "{error:?}");
        let text = error.to_string();
        assert!(text.contains("is valid only from 1975-01-01T00:00:00Z (it is now 1970-01-01T00:00:00Z)"), "{text}");
        assert!(text.contains("clock"), "{text}");
        let later = UNIX_EPOCH + Duration::from_secs(3_100 * 365 * 86_400);
        let error = usable(&path, &chain, later).expect_err("after it");
        let text = error.to_string();
        assert!(text.contains(&format!("in {} expired at 4096-01-01T00:00:00Z", path.display())), "{text}");
        assert!(text.contains("renew it"), "{text}");
        assert_eq!(shown(UNIX_EPOCH + Duration::from_secs(300_000_000_000)), "300000000000 s after 1970");

        // And a server is refused one, before anything listens; or one that is not
        // v3, or names no host.
        let key = rcgen::KeyPair::generate().expect("key");
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
        params.distinguished_name.push(rcgen::DnType::CommonName, "nameless");
        let nameless = params.self_signed(&key).expect("self-signed");
        std::fs::write(pki.path("nameless.pem"), nameless.pem()).expect("write");
        std::fs::write(pki.path("nameless-key.pem"), key.serialize_pem()).expect("write");
        let error = TlsServer::from_pem_files(&pki.path("nameless.pem"), &pki.path("nameless-key.pem"))
            .expect_err("no subjectAltName");
        assert!(matches!(error, TlsError::NoHostNames { .. }), "{error}");
        assert!(error.to_string().contains("names no host in a subjectAltName"), "{error}");

        let key = rcgen::KeyPair::generate().expect("key");
        let mut params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()]).expect("params");
        params.not_before = rcgen::date_time_ymd(2020, 1, 1);
        params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        params.distinguished_name.push(rcgen::DnType::CommonName, "old server");
        let old = params.self_signed(&key).expect("self-signed");
        std::fs::write(pki.path("old.pem"), old.pem()).expect("write");
        std::fs::write(pki.path("old-key.pem"), key.serialize_pem()).expect("write");
        let error = TlsServer::from_pem_files(&pki.path("old.pem"), &pki.path("old-key.pem")).expect_err("expired");
        let text = error.to_string();
        assert!(text.contains("the certificate 'CN=old server' in"), "{text}");
        assert!(text.contains("expired at 2021-01-01T00:00:00Z"), "{text}");
    }
}
