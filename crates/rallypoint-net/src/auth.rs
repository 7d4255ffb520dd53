//! Token authentication (docs/PROTOCOL.md, section 5.1): a secret shared by the
//! coordinator, its node agents and the processes of a job, proven by HMAC
//! challenge–response during the handshake, both ways. The token itself never
//! crosses the wire; each side proves it over two fresh nonces (one from each
//! side), so a recorded proof is worth nothing on another connection, and the
//! client learns that it reached a holder of the token, not a listener posing as
//! the coordinator.
//!
//! A [`Token`] comes from a file (`--token-file`, `RALLYPOINT_TOKEN_FILE`: it must
//! not be readable by group or others) or from `RALLYPOINT_TOKEN`.

use std::ffi::OsString;
use std::fmt;
use std::io::Read;
use std::os::unix::ffi::OsStringExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use hmac::{Hmac, Mac};
use rallypoint_proto::native::{NONCE_LEN, PROOF_LEN};
use rand::RngCore;
use sha2::Sha256;
use zeroize::Zeroizing;

/// The variable naming a token file.
pub const TOKEN_FILE_VAR: &str = "RALLYPOINT_TOKEN_FILE";
/// The variable holding a token.
pub const TOKEN_VAR: &str = "RALLYPOINT_TOKEN";

/// Longest token file read: a token is a short secret, not a document.
const MAX_TOKEN_FILE: u64 = 64 * 1024;
/// Random bytes in a generated token (shown as twice as many hex digits).
const GENERATED_BYTES: usize = 32;
/// A token shorter than this is accepted, with a warning: a guessable token makes
/// a recorded handshake open to offline guessing.
pub const SHORT_TOKEN: usize = 16;

/// What each side's proof is bound to, besides the nonces: the two directions
/// never produce the same bytes, so a proof cannot be reflected back.
const CLIENT_LABEL: &[u8] = b"rallypoint token proof v1: client";
const SERVER_LABEL: &[u8] = b"rallypoint token proof v1: server";

pub type Nonce = [u8; NONCE_LEN];
pub type Proof = [u8; PROOF_LEN];

/// A shared secret. Its bytes are wiped from memory when dropped and never shown
/// by `Debug`.
#[derive(Clone)]
pub struct Token {
    secret: Zeroizing<Vec<u8>>,
}

#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("cannot read the token file {}: {source}", path.display())]
    Unreadable { path: PathBuf, source: std::io::Error },
    #[error(
        "the token file {} can be read by other users (mode {mode:03o}); make it private: chmod 600 {}",
        path.display(), path.display()
    )]
    Exposed { path: PathBuf, mode: u32 },
    #[error("the token file {} is not a regular file", path.display())]
    NotAFile { path: PathBuf },
    #[error("the token file {} is larger than {MAX_TOKEN_FILE} bytes; a token is one line", path.display())]
    TooLong { path: PathBuf },
    #[error("the token from {from} is empty")]
    Empty { from: String },
}

impl Token {
    /// A token from its text; leading and trailing whitespace (a file's final
    /// newline) is not part of it. `from` names where it came from, for errors.
    pub fn new(secret: impl Into<Vec<u8>>, from: &str) -> Result<Token, TokenError> {
        let secret = Zeroizing::new(secret.into());
        let trimmed = secret.trim_ascii();
        if trimmed.is_empty() {
            return Err(TokenError::Empty { from: from.to_owned() });
        }
        Ok(Token { secret: Zeroizing::new(trimmed.to_vec()) })
    }

    /// A new random token ([`GENERATED_BYTES`] bytes from the OS, as hex text).
    pub fn generate() -> Token {
        let mut raw = Zeroizing::new([0u8; GENERATED_BYTES]);
        rand::rngs::OsRng.fill_bytes(&mut raw[..]);
        let mut text = Zeroizing::new(Vec::with_capacity(2 * GENERATED_BYTES));
        for byte in raw.iter() {
            text.extend_from_slice(format!("{byte:02x}").as_bytes());
        }
        Token { secret: text }
    }

    /// Reads a token file, refusing one that group or others may read (the token
    /// would be anyone's on this machine) or that is not a regular file.
    pub fn from_file(path: &Path) -> Result<Token, TokenError> {
        let unreadable = |source| TokenError::Unreadable { path: path.to_owned(), source };
        let mut file = std::fs::File::open(path).map_err(unreadable)?;
        // The opened file's metadata, not the path's: what is read is what was checked.
        let meta = file.metadata().map_err(unreadable)?;
        if !meta.is_file() {
            return Err(TokenError::NotAFile { path: path.to_owned() });
        }
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(TokenError::Exposed { path: path.to_owned(), mode });
        }
        let mut secret = Zeroizing::new(Vec::new());
        (&mut file).take(MAX_TOKEN_FILE + 1).read_to_end(&mut secret).map_err(unreadable)?;
        if secret.len() as u64 > MAX_TOKEN_FILE {
            return Err(TokenError::TooLong { path: path.to_owned() });
        }
        Token::new(std::mem::take(&mut *secret), &format!("the token file {}", path.display()))
    }

    /// The token the environment gives: the file `RALLYPOINT_TOKEN_FILE` names,
    /// else `RALLYPOINT_TOKEN`; `None` if neither is set (or both are empty).
    pub fn from_env() -> Result<Option<Token>, TokenError> {
        Token::from_lookup(|name| std::env::var_os(name))
    }

    /// [`Token::from_env`] against any variable lookup.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<OsString>) -> Result<Option<Token>, TokenError> {
        let set = |name| lookup(name).filter(|value: &OsString| !value.is_empty());
        if let Some(path) = set(TOKEN_FILE_VAR) {
            return Token::from_file(Path::new(&path)).map(Some);
        }
        match set(TOKEN_VAR) {
            Some(value) => Token::new(value.into_vec(), TOKEN_VAR).map(Some),
            None => Ok(None),
        }
    }

    /// The token's text, to hand it to another process (the launcher's token file).
    pub fn secret(&self) -> &[u8] {
        &self.secret
    }

    /// Whether the token is short enough to be worth a warning ([`SHORT_TOKEN`]).
    pub fn is_short(&self) -> bool {
        self.secret.len() < SHORT_TOKEN
    }

    fn mac(&self, label: &[u8], first: &Nonce, second: &Nonce) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.secret).expect("HMAC takes keys of any length");
        mac.update(label);
        mac.update(first);
        mac.update(second);
        mac
    }

    /// The client's proof: over the server's nonce, then the client's.
    pub fn client_proof(&self, client: &Nonce, server: &Nonce) -> Proof {
        self.mac(CLIENT_LABEL, server, client).finalize().into_bytes().into()
    }

    /// The server's proof: over the client's nonce, then the server's.
    pub fn server_proof(&self, client: &Nonce, server: &Nonce) -> Proof {
        self.mac(SERVER_LABEL, client, server).finalize().into_bytes().into()
    }

    /// Whether `proof` is the client's proof for these nonces, compared in constant time.
    pub fn verify_client(&self, client: &Nonce, server: &Nonce, proof: &Proof) -> bool {
        self.mac(CLIENT_LABEL, server, client).verify_slice(proof).is_ok()
    }

    /// Whether `proof` is the server's proof for these nonces, compared in constant time.
    pub fn verify_server(&self, client: &Nonce, server: &Nonce, proof: &Proof) -> bool {
        self.mac(SERVER_LABEL, client, server).verify_slice(proof).is_ok()
    }
}

/// Equal tokens, compared in constant time.
impl PartialEq for Token {
    fn eq(&self, other: &Token) -> bool {
        let nonce = [0u8; NONCE_LEN];
        self.verify_client(&nonce, &nonce, &other.client_proof(&nonce, &nonce))
    }
}

impl Eq for Token {}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(<redacted>)")
    }
}

/// A fresh nonce from the OS's random source.
pub fn nonce() -> Nonce {
    let mut nonce = [0u8; NONCE_LEN];
    rand::rngs::OsRng.fill_bytes(&mut nonce);
    nonce
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;

    use super::*;

    fn token(text: &str) -> Token {
        Token::new(text, "test").expect("a token")
    }

    #[test]
    fn proofs_need_the_token_and_both_nonces_and_do_not_reflect() {
        let (a, b) = (token("s3cret-token-of-the-job"), token("another-token-of-a-job"));
        let (c, s) = (nonce(), nonce());
        let proof = a.client_proof(&c, &s);
        assert!(a.verify_client(&c, &s, &proof));
        assert!(!b.verify_client(&c, &s, &proof), "another token");
        assert!(!a.verify_client(&nonce(), &s, &proof), "another client nonce");
        assert!(!a.verify_client(&c, &nonce(), &proof), "another server nonce");
        assert!(!a.verify_server(&c, &s, &proof), "a client's proof is no server's");
        assert!(!a.verify_client(&c, &s, &a.server_proof(&c, &s)), "nor the reverse");
        assert!(a.verify_server(&c, &s, &a.server_proof(&c, &s)));
    }

    #[test]
    fn whitespace_around_a_token_is_not_part_of_it() {
        assert_eq!(token(" abc\n"), token("abc"));
        assert_ne!(token("abc"), token("abd"));
        assert!(matches!(Token::new(" \n", "RALLYPOINT_TOKEN"), Err(TokenError::Empty { .. })));
        assert_eq!(format!("{:?}", token("abc")), "Token(<redacted>)");
    }

    #[test]
    fn generated_tokens_are_long_and_differ() {
        let (a, b) = (Token::generate(), Token::generate());
        assert_eq!(a.secret().len(), 2 * GENERATED_BYTES);
        assert!(a.secret().iter().all(u8::is_ascii_hexdigit));
        assert_ne!(a, b);
        assert!(!a.is_short());
    }

    #[test]
    fn a_token_file_must_be_private() {
        let dir = std::env::temp_dir().join(format!("rallypoint-token-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("test directory");
        let write = |name: &str, mode: u32| {
            let path = dir.join(name);
            let _ = std::fs::remove_file(&path);
            let mut file =
                std::fs::OpenOptions::new().write(true).create_new(true).mode(mode).open(&path).expect("file");
            file.write_all(b"the-token\n").expect("write");
            // The process umask may have cleared bits the test asked for.
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("chmod");
            path
        };
        let private = write("private", 0o600);
        assert_eq!(Token::from_file(&private).expect("read"), token("the-token"));
        let exposed = write("exposed", 0o644);
        let error = Token::from_file(&exposed).expect_err("refused");
        assert!(error.to_string().contains("mode 644") && error.to_string().contains("chmod 600"), "{error}");
        let group = write("group", 0o640);
        assert!(matches!(Token::from_file(&group), Err(TokenError::Exposed { mode: 0o640, .. })));
        assert!(matches!(Token::from_file(&dir), Err(TokenError::NotAFile { .. } | TokenError::Exposed { .. })));
        assert!(matches!(Token::from_file(&dir.join("missing")), Err(TokenError::Unreadable { .. })));
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn the_file_variable_wins_over_the_token_variable() {
        let none = Token::from_lookup(|_| None).expect("nothing set");
        assert!(none.is_none());
        let env = Token::from_lookup(|name| (name == TOKEN_VAR).then(|| "from-env".into())).expect("env");
        assert_eq!(env, Some(token("from-env")));
        let missing = Token::from_lookup(|name| match name {
            TOKEN_FILE_VAR => Some("/nonexistent/rallypoint-token".into()),
            _ => Some("from-env".into()),
        });
        assert!(matches!(missing, Err(TokenError::Unreadable { .. })), "the file is read, not skipped");
    }
}
