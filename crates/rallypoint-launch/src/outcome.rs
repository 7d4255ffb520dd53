//! What happened to each worker, and the summary a person reads at the end.

use std::fmt::{self, Write as _};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

/// How a worker process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Exit {
    Code(i32),
    Signal(i32),
}

impl Exit {
    /// The exit code a shell would report: the code, or 128 + the signal number.
    pub fn shell_code(self) -> i32 {
        match self {
            Exit::Code(code) => code,
            Exit::Signal(sig) => 128 + sig,
        }
    }

    pub fn success(self) -> bool {
        self == Exit::Code(0)
    }
}

impl fmt::Display for Exit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Exit::Code(code) => write!(f, "exited with code {code}"),
            Exit::Signal(sig) => write!(f, "was killed by {}", signal_name(*sig)),
        }
    }
}

/// The failure that brought the job down: the root cause a user looks for first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    pub what: FailureKind,
    /// Node index and host of the launcher that saw it.
    pub node: u32,
    pub host: String,
    /// Wall-clock time, milliseconds since the Unix epoch.
    pub at_unix_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum FailureKind {
    Worker {
        rank: u32,
        local_rank: u32,
        pid: u32,
        exit: Exit,
        stderr_tail: Vec<String>,
    },
    /// A node's launcher vanished or could not be reached.
    NodeLost {
        detail: String,
    },
    /// The launcher was told to stop.
    Interrupted {
        signal: i32,
    },
}

impl Failure {
    pub fn now(what: FailureKind, node: u32, host: &str) -> Self {
        let at_unix_ms = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        Failure { what, node, host: host.to_owned(), at_unix_ms }
    }

    /// The launcher's exit code for this failure.
    pub fn exit_code(&self) -> i32 {
        match &self.what {
            FailureKind::Worker { exit, .. } => exit.shell_code(),
            FailureKind::NodeLost { .. } => 1,
            FailureKind::Interrupted { signal } => 128 + signal,
        }
    }

    /// One line naming the cause, e.g. "rank 1 exited with code 3".
    pub fn headline(&self) -> String {
        match &self.what {
            FailureKind::Worker { rank, exit, .. } => format!("rank {rank} {exit}"),
            FailureKind::NodeLost { detail } => format!("node {} ({}) was lost: {detail}", self.node, self.host),
            FailureKind::Interrupted { signal } => {
                format!("the launcher on node {} received {}", self.node, signal_name(*signal))
            }
        }
    }

    fn time(&self) -> String {
        humantime::format_rfc3339_millis(SystemTime::UNIX_EPOCH + Duration::from_millis(self.at_unix_ms)).to_string()
    }
}

/// How one local rank ended, relative to the first failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankOutcome {
    pub rank: u32,
    pub exit: Exit,
    /// The launcher signalled it while tearing the job down.
    pub signalled_by_launcher: Option<i32>,
    /// It ended after the job's first failure (by itself, or signalled).
    pub after_failure: bool,
}

/// The text printed to stderr when a job fails.
pub fn summary(job: &str, restart: u32, max_restarts: u32, first: &Failure, local: &[RankOutcome]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "rallypoint: job '{job}' FAILED (attempt {} of {}): {}",
        restart + 1,
        max_restarts + 1,
        first.headline()
    );
    let _ = writeln!(s, "first failure:");
    match &first.what {
        FailureKind::Worker { rank, local_rank, pid, exit, stderr_tail } => {
            let _ = writeln!(
                s,
                "  rank {rank} (local rank {local_rank}, node {}, host {}, pid {pid}) {exit} at {}",
                first.node,
                first.host,
                first.time()
            );
            if stderr_tail.is_empty() {
                let _ = writeln!(s, "  (it wrote nothing to stderr)");
            } else {
                let _ = writeln!(s, "  last {} line(s) of its stderr:", stderr_tail.len());
                for line in stderr_tail {
                    let _ = writeln!(s, "    | {line}");
                }
            }
        }
        FailureKind::NodeLost { .. } | FailureKind::Interrupted { .. } => {
            let _ = writeln!(s, "  {} at {}", first.headline(), first.time());
        }
    }
    let cause = match &first.what {
        FailureKind::Worker { rank, .. } => format!("rank {rank} failed"),
        FailureKind::NodeLost { .. } => format!("node {} was lost", first.node),
        FailureKind::Interrupted { signal } => format!("the launcher received {}", signal_name(*signal)),
    };
    let first_rank = match &first.what {
        FailureKind::Worker { rank, .. } => Some(*rank),
        _ => None,
    };
    let others: Vec<&RankOutcome> = local.iter().filter(|o| Some(o.rank) != first_rank).collect();
    if !others.is_empty() {
        let _ = writeln!(s, "other ranks on this node:");
        for o in others {
            let line = match (o.signalled_by_launcher, o.exit) {
                (_, Exit::Code(0)) => "exited with code 0".to_owned(),
                (Some(sig), Exit::Signal(got)) if sig == got => {
                    format!("killed by the launcher ({}) after {cause}", signal_name(sig))
                }
                (_, exit) if o.after_failure => format!("{exit} after {cause}"),
                (_, exit) => format!("{exit}"),
            };
            let _ = writeln!(s, "  rank {}: {line}", o.rank);
        }
    }
    s
}

pub fn signal_name(sig: i32) -> String {
    match sig {
        libc::SIGHUP => "SIGHUP".into(),
        libc::SIGINT => "SIGINT".into(),
        libc::SIGQUIT => "SIGQUIT".into(),
        libc::SIGILL => "SIGILL".into(),
        libc::SIGABRT => "SIGABRT".into(),
        libc::SIGBUS => "SIGBUS".into(),
        libc::SIGFPE => "SIGFPE".into(),
        libc::SIGKILL => "SIGKILL".into(),
        libc::SIGSEGV => "SIGSEGV".into(),
        libc::SIGPIPE => "SIGPIPE".into(),
        libc::SIGTERM => "SIGTERM".into(),
        libc::SIGUSR1 => "SIGUSR1".into(),
        libc::SIGUSR2 => "SIGUSR2".into(),
        other => format!("signal {other}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_names_the_root_cause_first_then_the_others() {
        let first = Failure {
            what: FailureKind::Worker {
                rank: 1,
                local_rank: 1,
                pid: 4242,
                exit: Exit::Code(3),
                stderr_tail: vec!["Traceback (most recent call last):".into(), "ValueError: bad batch".into()],
            },
            node: 0,
            host: "gpu7".into(),
            at_unix_ms: 0,
        };
        let local = vec![
            RankOutcome {
                rank: 0,
                exit: Exit::Signal(libc::SIGTERM),
                signalled_by_launcher: Some(libc::SIGTERM),
                after_failure: true,
            },
            RankOutcome { rank: 1, exit: Exit::Code(3), signalled_by_launcher: None, after_failure: false },
            RankOutcome { rank: 2, exit: Exit::Code(5), signalled_by_launcher: None, after_failure: true },
            RankOutcome { rank: 3, exit: Exit::Code(0), signalled_by_launcher: None, after_failure: false },
        ];
        let text = summary("train", 0, 0, &first, &local);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "rallypoint: job 'train' FAILED (attempt 1 of 1): rank 1 exited with code 3");
        assert!(lines[2].contains(
            "rank 1 (local rank 1, node 0, host gpu7, pid 4242) exited with code 3 at 1970-01-01T00:00:00.000Z"
        ));
        assert!(text.contains("    | ValueError: bad batch"));
        assert!(text.contains("  rank 0: killed by the launcher (SIGTERM) after rank 1 failed"));
        assert!(text.contains("  rank 2: exited with code 5 after rank 1 failed"));
        assert!(text.contains("  rank 3: exited with code 0"));
        assert!(!text.contains("  rank 1:"));
        assert_eq!(first.exit_code(), 3);
        assert_eq!(Exit::Signal(9).shell_code(), 137);
    }
}
