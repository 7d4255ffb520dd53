//! What can go wrong for a client.

use std::fmt;
use std::io;
use std::time::Duration;

use rallypoint_core::OpError;
use rallypoint_net::conn::AuthFailure;

/// Its `Debug` is its message (what `main` returning it prints, with `?`); `{:#?}`
/// shows the fields.
#[derive(thiserror::Error)]
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

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !f.alternate() {
            return fmt::Display::fmt(self, f);
        }
        match self {
            Error::Op(error) => f.debug_tuple("Op").field(error).finish(),
            Error::Connect { addr, waited, source } => {
                f.debug_struct("Connect").field("addr", addr).field("waited", waited).field("source", source).finish()
            }
            Error::Disconnected(why) => f.debug_tuple("Disconnected").field(why).finish(),
            Error::Protocol(why) => f.debug_tuple("Protocol").field(why).finish(),
            Error::Timeout(limit) => f.debug_tuple("Timeout").field(limit).finish(),
            Error::Config(why) => f.debug_tuple("Config").field(why).finish(),
            Error::Auth { addr, failure } => {
                f.debug_struct("Auth").field("addr", addr).field("failure", failure).finish()
            }
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_is_the_message_and_alternate_the_fields() {
        let error = Error::Timeout(Duration::from_millis(2500));
        assert_eq!(format!("{error:?}"), error.to_string());
        assert!(format!("{error:?}").starts_with("no reply from the coordinator within 2.5 s"), "{error:?}");
        assert_eq!(format!("{error:#?}"), "Timeout(\n    2.5s,\n)");
    }
}
