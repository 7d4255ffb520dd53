//! A throwaway certificate authority for tests and benchmarks of TLS (feature
//! `test-pki`): a CA, and a certificate it signed for `127.0.0.1` and `localhost`,
//! written as PEM files (`ca.pem`, `cert.pem`, `key.pem`) into a directory that is
//! removed when the [`TestPki`] is dropped. Never for a deployment: the keys are
//! made on the spot and left on disk unprotected.

use std::path::{Path, PathBuf};

use crate::tls::{TlsClient, TlsError, TlsServer};

/// What making the files can fail with: key generation, signing, or the disk.
pub type PkiError = Box<dyn std::error::Error + Send + Sync>;

/// The CA and the server certificate in `dir`.
pub struct TestPki {
    dir: PathBuf,
}

impl TestPki {
    /// Makes the CA and the certificate in `dir`, which is created afresh.
    pub fn create(dir: PathBuf, ca_name: &str) -> Result<TestPki, PkiError> {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let pki = TestPki { dir };
        let ca_key = rcgen::KeyPair::generate()?;
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new())?;
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params.distinguished_name.push(rcgen::DnType::CommonName, ca_name);
        let ca = ca_params.self_signed(&ca_key)?;
        let key = rcgen::KeyPair::generate()?;
        let names = vec!["127.0.0.1".to_owned(), "localhost".to_owned()];
        let cert = rcgen::CertificateParams::new(names)?.signed_by(&key, &ca, &ca_key)?;
        std::fs::write(pki.path("ca.pem"), ca.pem())?;
        std::fs::write(pki.path("cert.pem"), cert.pem())?;
        std::fs::write(pki.path("key.pem"), key.serialize_pem())?;
        Ok(pki)
    }

    /// One of its files: `ca.pem`, `cert.pem` or `key.pem`.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A TLS server with the certificate.
    pub fn server(&self) -> Result<TlsServer, TlsError> {
        TlsServer::from_pem_files(&self.path("cert.pem"), &self.path("key.pem"))
    }

    /// A TLS client that trusts the CA.
    pub fn client(&self) -> Result<TlsClient, TlsError> {
        TlsClient::from_ca_file(&self.path("ca.pem"))
    }
}

impl Drop for TestPki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
