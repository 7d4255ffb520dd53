//! The flags of the serving side's token and TLS (`serve`, `agent`), and the
//! token's fallback to the environment, as clients take it.

use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;
use rallypoint_client::{TlsClient, TlsError, Token, TokenError, TLS_CA_VAR};
use rallypoint_server::TlsServer;

#[derive(Args, Debug)]
#[command(next_help_heading = "Authentication and TLS")]
pub struct ServeAuth {
    /// File holding the token every native client and node agent must prove (it
    /// must not be readable by group or others); this side proves it back
    /// [default: the file $RALLYPOINT_TOKEN_FILE names, else $RALLYPOINT_TOKEN, else
    /// no token: anyone who reaches the port is served]
    #[arg(long, value_name = "PATH")]
    token_file: Option<PathBuf>,
    /// Certificate chain (PEM, this side's first) to serve native clients and node
    /// agents over TLS on the same port; plaintext ones are then refused (PyTorch
    /// TCPStore stays plaintext). Needs --tls-key
    #[arg(long, value_name = "PATH", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --tls-cert
    #[arg(long, value_name = "PATH", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
}

impl ServeAuth {
    /// The token: the flag's file, else the environment's.
    pub fn token(&self) -> Result<Option<Arc<Token>>, TokenError> {
        let token = match &self.token_file {
            Some(path) => Some(Token::from_file(path)?),
            None => Token::from_env()?,
        };
        Ok(token.map(Arc::new))
    }

    pub fn tls(&self) -> Result<Option<TlsServer>, TlsError> {
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => TlsServer::from_pem_files(cert, key).map(Some),
            _ => Ok(None),
        }
    }
}

/// The CA a connecting side trusts: the flag's file, else `RALLYPOINT_TLS_CA`'s.
pub fn tls_ca(flag: Option<&PathBuf>) -> Result<Option<TlsClient>, TlsError> {
    let env = std::env::var_os(TLS_CA_VAR).filter(|v| !v.is_empty()).map(PathBuf::from);
    flag.cloned().or(env).map(|ca| TlsClient::from_ca_file(&ca)).transpose()
}
