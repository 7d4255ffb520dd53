//! Exit codes of the `rallypoint` command, and which error gets which.

use std::fmt;
use std::io::Write;

use rallypoint_client::{Error, OpError, TlsError, TokenError};

/// Shown at the end of `rallypoint --help`; the README has the same table.
pub const HELP: &str = "\
Exit codes:
  0  ok
  1  other error
  2  usage error (bad flag or environment variable, rank outside the world, ...)
  3  timeout (the error names the missing ranks or keys)
  4  peer lost (a rank the operation needs died, or finished: its worker
     exited 0; the error names it), or this process's own rank was declared
     lost (silent for a whole lease) and its peers were told so
  5  aborted (someone called abort; the error says who and why)
  6  mismatch / bad members (ranks called the same barrier differently,
     or the caller is not among the members it named)
  7  cannot connect to the coordinator, or lost the connection to it
  8  refused incarnation: another live process holds this rank, another process
     took it over, or the job was reset (this process belongs to an older run)
  9  authentication failed: the coordinator refused this process's token (none,
     or a wrong one) or plaintext where it requires TLS, or it could not prove
     that it knows the token, or its TLS certificate did not verify

Errors go to stderr, starting with 'rallypoint: '.";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    Other = 1,
    Usage = 2,
    Timeout = 3,
    PeerLost = 4,
    Aborted = 5,
    Mismatch = 6,
    Connect = 7,
    Refused = 8,
    Auth = 9,
}

/// A bad argument that clap cannot see alone (a rank outside the world size
/// that came from the environment, a broadcast root without a value).
#[derive(Debug)]
pub struct UsageError(pub String);

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

/// The nodes of a launched job did not all come within the join timeout (exit code 3).
#[derive(Debug)]
pub struct JoinTimeout(pub String);

impl fmt::Display for JoinTimeout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for JoinTimeout {}

/// Returns `Err(UsageError)` with a formatted message.
macro_rules! usage {
    ($($arg:tt)*) => {
        return Err($crate::exit::UsageError(format!($($arg)*)).into())
    };
}
pub(crate) use usage;

/// Whether `err` is stdout's reader having gone (`rallypoint status --watch | head
/// -1`): the command did its part, and ends quietly as one killed by SIGPIPE would
/// have, without an error of its own.
pub fn reader_gone(err: &anyhow::Error) -> bool {
    err.chain()
        .any(|cause| cause.downcast_ref::<std::io::Error>().is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe))
}

/// The exit code for an error: the first cause in its chain that has a meaning wins.
pub fn code_of(err: &anyhow::Error) -> Exit {
    for cause in err.chain() {
        if cause.is::<UsageError>() {
            return Exit::Usage;
        }
        if cause.is::<JoinTimeout>() {
            return Exit::Timeout;
        }
        if let Some(e) = cause.downcast_ref::<Error>() {
            return of_client_error(e);
        }
        if let Some(e) = cause.downcast_ref::<OpError>() {
            return of_op_error(e);
        }
        // A token file or a TLS file that cannot be used: a mistake in the settings.
        if cause.is::<TokenError>() || cause.is::<TlsError>() {
            return Exit::Usage;
        }
        if let Some(rallypoint_agent::AgentError::Auth { .. }) = cause.downcast_ref() {
            return Exit::Auth;
        }
    }
    Exit::Other
}

fn of_client_error(err: &Error) -> Exit {
    match err {
        Error::Op(op) => of_op_error(op),
        Error::Connect { .. } | Error::Disconnected(_) => Exit::Connect,
        Error::Timeout(_) => Exit::Timeout,
        Error::Config(_) => Exit::Usage,
        Error::Protocol(_) => Exit::Other,
        Error::Auth { .. } => Exit::Auth,
    }
}

fn of_op_error(err: &OpError) -> Exit {
    match err {
        OpError::CollectiveTimeout { .. } | OpError::KeyTimeout { .. } => Exit::Timeout,
        OpError::PeerLost { .. } | OpError::ThisRankLost { .. } => Exit::PeerLost,
        OpError::Aborted { .. } => Exit::Aborted,
        OpError::Mismatch { .. } | OpError::BadMembers { .. } => Exit::Mismatch,
        // The caller named no rank, or sent something the server refuses: both are
        // mistakes in how the command was called.
        OpError::NoRank { .. } | OpError::TooLarge { .. } | OpError::Invalid(_) => Exit::Usage,
        // The server is shutting down or closed this session.
        OpError::Closed(_) => Exit::Connect,
        OpError::NotANumber { .. } | OpError::Overflow { .. } => Exit::Other,
        // Retrying cannot help: this process no longer speaks for its rank or job.
        OpError::RankHeld { .. }
        | OpError::TakenOver { .. }
        | OpError::JobReset { .. }
        | OpError::StaleIncarnation { .. } => Exit::Refused,
        OpError::Unauthorized(_) => Exit::Auth,
    }
}

/// The error and its causes on one line, skipping a cause whose text the line
/// already holds (a wrapper that shows its source's message would repeat it).
pub fn render(err: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in err.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

/// Writes `text` and a newline to stderr in one write: `eprintln!` writes its pieces
/// one by one, and the lines of ranks sharing a terminal interleaved mid-line.
pub fn say(text: impl fmt::Display) {
    let _ = say_to(&mut std::io::stderr().lock(), text);
}

fn say_to(out: &mut impl Write, text: impl fmt::Display) -> std::io::Result<()> {
    out.write_all(format!("{text}\n").as_bytes())
}

/// An error as every error of the command starts: `rallypoint: `, then `message`.
pub fn report(message: impl fmt::Display) {
    say(format_args!("rallypoint: {message}"));
}

#[cfg(test)]
mod tests {
    use super::say_to;

    /// Records each write it is given, as the kernel would see them.
    #[derive(Default)]
    struct Writes(Vec<Vec<u8>>);

    impl std::io::Write for Writes {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.push(buf.to_vec());
            Ok(buf.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_line_goes_out_in_one_write() {
        let mut out = Writes::default();
        let rank = 3;
        say_to(&mut out, format_args!("rallypoint: rank {rank} is lost")).expect("write");
        assert_eq!(out.0, vec![b"rallypoint: rank 3 is lost\n".to_vec()]);
    }
}
