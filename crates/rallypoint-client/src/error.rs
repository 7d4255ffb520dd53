//! What can go wrong for a client.

use std::fmt;
use std::io;
use std::time::Duration;

use rallypoint_core::OpError;
use rallypoint_net::conn::AuthFailure;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The coordinator's typed answer: timeouts that name the missing ranks, lost
    /// peers, aborts, mismatches, invalid arguments, refusal at connect.
    #[error(transparent)]
    Op(#[from] OpError),

    /// No connection could be made within the connect timeout.
    #[error("cannot connect to the coordinator at {addr} (tried for {}): {source}", Secs(*waited))]
    Connect { addr: String, waited: Duration, source: io::Error },

    /// The connection was lost (or closed by this client) before the reply came.
    #[error("{0}")]
    Disconnected(String),

    /// The coordinator sent something this client cannot understand.
    #[error("protocol error: {0}")]
    Protocol(String),

    /// No reply within the operation's timeout plus a safety margin: the coordinator
    /// has gone silent without closing the connection.
    #[error(
        "no reply from the coordinator within {} (the call's timeout, and a margin for the coordinator's own \
         answer): is it stopped, hung or overloaded?",
        Secs::of(.0)
    )]
    Timeout(Duration),

    /// A missing or invalid setting (environment variable or argument).
    #[error("{0}")]
    Config(String),

    /// The coordinator refused this client's credentials (no token, a wrong one,
    /// plaintext where it requires TLS), or could not prove its own (it does not
    /// know the token, or its TLS certificate does not verify). Not retried.
    #[error("cannot authenticate with the coordinator at {addr}: {failure}")]
    Auth { addr: String, failure: AuthFailure },
}

/// A duration as seconds with one decimal ("2.5 s").
pub(crate) struct Secs(pub Duration);

impl fmt::Display for Secs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:.1} s", self.0.as_secs_f64())
    }
}

impl Secs {
    fn of(d: &Duration) -> Secs {
        Secs(*d)
    }
}
