//! What happened to each worker, and the summary a person reads at the end.

use std::fmt::Write as _;
use std::time::{Duration, SystemTime};

use rallypoint_stacks::{Grouped, Render};

use crate::error_file::Raised;
use serde::{Deserialize, Serialize};

/// The launcher's exit code for a hung job, as `timeout` (coreutils) exits when
/// its command runs out of time.
pub const HANG_EXIT: i32 = 124;

/// How a worker process ended, and a signal's name: the coordinator names the
/// same in a rank's loss ([`rallypoint_core::LossReason::Exited`]).
pub use rallypoint_core::{signal_name, Exit};

/// How a launcher's abort of a job begins its reason (see [`Failure::abort_reason`]).
pub const LAUNCHER_ABORT: &str = "launcher: ";

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
        /// What it raised, as its error file says (`TORCHELASTIC_ERROR_FILE`, written
        /// by torch's `@record`).
        /// (Boxed: a failure is a large error value as it is.)
        #[serde(default, skip_serializing_if = "Option::is_none")]
        raised: Option<Box<Raised>>,
        /// The first rank of the job that exited with code 0 before this failure,
        /// while its peers ran on.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        after: Option<Box<EarlyEnd>>,
    },
    /// The worker's program could not be started (`execve` failed: not found, not
    /// executable): it never ran.
    NotStarted {
        rank: u32,
        local_rank: u32,
        /// "python3x: No such file or directory".
        reason: String,
        /// What a shell would exit with: 127 not found, 126 not executable.
        exit_code: i32,
    },
    /// The coordinator lost a rank (it stopped heartbeating, or its connection
    /// dropped), or the rank finished while its peers still needed it, and they
    /// failed because of it: the rank is the root cause, not the peer whose exit
    /// revealed it. `Failure::node` and `host` are the rank's.
    RankLost {
        rank: u32,
        /// Its index on its node, when the node is known.
        local_rank: Option<u32>,
        pid: Option<u32>,
        loss: Loss,
        /// When the coordinator last heard from it, ms since the Unix epoch.
        last_seen_unix_ms: u64,
        /// Its process as `/proc` showed it when the failure was judged, on its own
        /// node ("alive, state T (stopped)").
        process: Option<String>,
        /// The failure that brought it to light: usually a peer that failed for it.
        revealed_by: Box<Failure>,
    },
    /// A rank (or a process of no rank: a tool, a person's command) aborted the job,
    /// and its peers failed for the abort: it is the root cause, not the first of them
    /// to exit. `Failure::node` and `host` are the aborter's (its node, where known).
    Aborted {
        by_rank: Option<u32>,
        pid: u32,
        reason: String,
        /// The failure that brought it to light: usually a peer that failed for it.
        revealed_by: Box<Failure>,
    },
    /// A node's launcher vanished or could not be reached.
    NodeLost { detail: String },
    /// The launcher was told to stop.
    Interrupted { signal: i32 },
    /// No rank of the job wrote output or asked the coordinator anything for the
    /// hang timeout (`--hang-timeout`): node 0 takes the job for hung and tells.
    Hung {
        /// How long the job had been quiet when its stacks were read.
        quiet_ms: u64,
        timeout_ms: u64,
        /// Every rank's stack then, grouped.
        stacks: Grouped,
        /// Nodes whose launchers did not send their ranks' stacks.
        unanswered: Vec<u32>,
    },
}

/// A rank whose worker exited with code 0 while its peers ran on. Under collectives
/// the coordinator does not see (torch's own), a peer left behind fails in its next
/// one with an error that names no rank ("Connection closed by peer"), so the first
/// failure is shown with it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EarlyEnd {
    pub rank: u32,
    pub pid: Option<u32>,
    /// Its node and host, where known.
    pub node: Option<u32>,
    pub host: Option<String>,
    /// When it exited (or the coordinator learnt it had), ms since the Unix epoch.
    pub at_unix_ms: u64,
}

impl EarlyEnd {
    /// "rank 3 (node 0, host vm, pid 4121)".
    fn who(&self) -> String {
        let facts: Vec<String> = [
            self.node.map(|n| format!("node {n}")),
            self.host.as_ref().map(|h| format!("host {h}")),
            self.pid.map(|p| format!("pid {p}")),
        ]
        .into_iter()
        .flatten()
        .collect();
        match facts.is_empty() {
            true => format!("rank {}", self.rank),
            false => format!("rank {} ({})", self.rank, facts.join(", ")),
        }
    }
}

/// How the coordinator lost a rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Loss {
    /// Its connection stayed open but it sent nothing for a whole lease: stopped,
    /// hung, or cut off.
    Silent { lease_ms: u64 },
    /// Its connection dropped without a clean leave.
    Disconnected,
    /// Its worker (`worker_pid`) exited with code 0 while a barrier or collective of
    /// its peers still needed it: it skipped a call they made, they made one more, or
    /// its client dropped out of one.
    Finished { worker_pid: u32 },
}

impl Failure {
    pub fn now(what: FailureKind, node: u32, host: &str) -> Self {
        Failure { what, node, host: host.to_owned(), at_unix_ms: unix_ms(SystemTime::now()) }
    }

    /// The launcher's exit code for this failure.
    pub fn exit_code(&self) -> i32 {
        match &self.what {
            FailureKind::Worker { exit, .. } => exit.shell_code(),
            FailureKind::NotStarted { exit_code, .. } => *exit_code,
            // What the peers' failure says (a peer lost, usually): the lost rank
            // itself was still running, or was killed by the launcher.
            FailureKind::RankLost { revealed_by, .. } | FailureKind::Aborted { revealed_by, .. } => {
                revealed_by.exit_code()
            }
            FailureKind::NodeLost { .. } => 1,
            FailureKind::Interrupted { signal } => 128 + signal,
            FailureKind::Hung { .. } => HANG_EXIT,
        }
    }

    /// One line naming the cause, e.g. "rank 1 exited with code 3".
    pub fn headline(&self) -> String {
        match &self.what {
            // An early end before it is context, not the cause: the summary shows it.
            FailureKind::Worker { rank, exit, raised, .. } => {
                format!("rank {rank} {exit}{}", Raised::headline(raised.as_deref()))
            }
            FailureKind::NotStarted { rank, reason, .. } => format!("rank {rank} could not start: {reason}"),
            FailureKind::RankLost { rank, loss, last_seen_unix_ms, process, .. } => {
                let at = time(*last_seen_unix_ms);
                let process = process.as_ref().map_or(String::new(), |p| format!(" (process {p})"));
                match loss {
                    Loss::Silent { .. } => format!("rank {rank} stopped heartbeating at {at}{process}"),
                    Loss::Disconnected => {
                        format!("rank {rank} dropped its connection without a clean leave at {at}{process}")
                    }
                    Loss::Finished { .. } => {
                        format!("rank {rank} exited with code 0 at {at} while its peers still needed it")
                    }
                }
            }
            FailureKind::Aborted { by_rank: Some(rank), reason, .. } => {
                format!("rank {rank} aborted the job: {reason}")
            }
            FailureKind::Aborted { by_rank: None, pid, reason, .. } => {
                format!("pid {pid} on host {} aborted the job: {reason}", self.host)
            }
            FailureKind::NodeLost { detail } => format!("node {} ({}) was lost: {detail}", self.node, self.host),
            FailureKind::Interrupted { signal } => {
                format!("the launcher on node {} received {}", self.node, signal_name(*signal))
            }
            FailureKind::Hung { quiet_ms, timeout_ms, .. } => format!(
                "the job hung: no rank wrote output or asked the coordinator anything for {:.1} s (--hang-timeout {})",
                *quiet_ms as f64 / 1000.0,
                secs(*timeout_ms)
            ),
        }
    }

    /// What a launcher's abort of the job says, which every rank still waiting gets
    /// in its error: the headline, with the worker's host and pid (a peer may be told
    /// by this abort before the coordinator has seen the worker's connection drop).
    pub fn abort_reason(&self) -> String {
        let headline = match &self.what {
            FailureKind::Worker { rank, pid, exit, raised, .. } => {
                format!("rank {rank} (pid {pid} on {}) {exit}{}", self.host, Raised::headline(raised.as_deref()))
            }
            _ => self.headline(),
        };
        format!("{LAUNCHER_ABORT}{headline}")
    }

    fn time(&self) -> String {
        time(self.at_unix_ms)
    }

    /// The rank this failure blames, if it blames one.
    pub fn rank(&self) -> Option<u32> {
        match &self.what {
            FailureKind::Worker { rank, .. }
            | FailureKind::NotStarted { rank, .. }
            | FailureKind::RankLost { rank, .. } => Some(*rank),
            FailureKind::Aborted { by_rank, .. } => *by_rank,
            FailureKind::NodeLost { .. } | FailureKind::Interrupted { .. } | FailureKind::Hung { .. } => None,
        }
    }
}

/// Seconds as given on a command line: `5`, `2.5`.
fn secs(ms: u64) -> String {
    // f64's Display writes 5.0 as "5".
    format!("{}", ms as f64 / 1000.0)
}

/// The heading of a section of stacks.
pub const STACKS_HEADING: &str = "main thread of each, innermost frame first";

/// Grouped stacks as a summary shows them (a screenful), or all of them (a file).
pub fn stacks_text(stacks: &Grouped, indent: &str, all: bool) -> String {
    let mut how = Render { indent: indent.to_owned(), ..Render::default() };
    if all {
        how.max_groups = usize::MAX;
        how.max_frames = usize::MAX;
    }
    rallypoint_stacks::render(stacks, &how)
}

fn time(unix_ms: u64) -> String {
    humantime::format_rfc3339_millis(SystemTime::UNIX_EPOCH + Duration::from_millis(unix_ms)).to_string()
}

pub fn unix_ms(at: SystemTime) -> u64 {
    at.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
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
    /// What it raised, as its error file says, if it failed and wrote one.
    pub raised: Option<Raised>,
}

/// The text printed to stderr when a job fails; `stacks`: this node's ranks still
/// running when it was taken down, if they were read.
pub fn summary(
    job: &str,
    restart: u32,
    max_restarts: u32,
    first: &Failure,
    local: &[RankOutcome],
    stacks: Option<&Grouped>,
) -> String {
    let mut s = String::new();
    let root = first.rank();
    // A root cause lost or aborting on this node may have written what it raised
    // before it ended (a worker's failure says it in its own headline).
    let own_raised = match first.what {
        FailureKind::Worker { .. } => None,
        _ => local.iter().find(|o| Some(o.rank) == root).and_then(|o| o.raised.as_ref()),
    };
    let _ = writeln!(
        s,
        "rallypoint: job '{job}' FAILED (attempt {} of {}): {}{}",
        restart + 1,
        max_restarts + 1,
        first.headline(),
        Raised::headline(own_raised)
    );
    let _ = writeln!(s, "first failure:");
    match &first.what {
        FailureKind::Worker { rank, local_rank, pid, exit, stderr_tail, raised, after } => {
            let _ = writeln!(
                s,
                "  rank {rank} (local rank {local_rank}, node {}, host {}, pid {pid}) {exit} at {}",
                first.node,
                first.host,
                first.time()
            );
            if let Some(early) = after {
                let _ = writeln!(
                    s,
                    "  {:.1} s before it, {} exited with code 0 while its peers ran on: a rank that leaves early \
                     fails its peers' next collective, whose error may not name it",
                    first.at_unix_ms.saturating_sub(early.at_unix_ms) as f64 / 1000.0,
                    early.who()
                );
            }
            write_raised(&mut s, "it", raised.as_deref());
            write_tail(&mut s, "it", "its", stderr_tail);
        }
        FailureKind::NotStarted { rank, local_rank, reason, .. } => {
            let _ = writeln!(
                s,
                "  rank {rank} (local rank {local_rank}, node {}, host {}) could not start at {}: {reason}",
                first.node,
                first.host,
                first.time()
            );
        }
        FailureKind::RankLost { rank, local_rank, pid, loss, last_seen_unix_ms, process, revealed_by } => {
            let index = local_rank.map_or(String::new(), |l| format!("local rank {l}, "));
            let pid = pid.map_or(String::new(), |p| format!(", pid {p}"));
            let who = format!("rank {rank} ({index}node {}, host {}{pid})", first.node, first.host);
            let at = time(*last_seen_unix_ms);
            match loss {
                Loss::Silent { lease_ms } => {
                    let lost_at = time(last_seen_unix_ms.saturating_add(*lease_ms));
                    let lease = *lease_ms as f64 / 1000.0;
                    let _ = writeln!(
                        s,
                        "  {who} stopped heartbeating at {at}; the coordinator counted it lost at {lost_at} (no heartbeat for {lease:.1} s)"
                    );
                }
                Loss::Disconnected => {
                    let _ =
                        writeln!(s, "  {who} dropped its connection to the coordinator without a clean leave at {at}");
                }
                Loss::Finished { worker_pid } => {
                    let _ = writeln!(
                        s,
                        "  {who} was done at {at}: its worker (pid {worker_pid}) exited with code 0 while a barrier or \
                         collective of its peers still needed it"
                    );
                }
            }
            match process {
                // It exited, as said.
                _ if matches!(loss, Loss::Finished { .. }) => {}
                Some(process) => {
                    let _ = writeln!(s, "  its process was {process} when its peers failed");
                }
                None => {
                    let _ =
                        writeln!(s, "  (its process is on node {}: that node's launcher tells its state)", first.node);
                }
            }
            if let Some(own) = local.iter().find(|o| Some(o.rank) == root && !matches!(loss, Loss::Finished { .. })) {
                let _ = writeln!(s, "  then it {}", own_end(own));
                write_raised(&mut s, "it", own.raised.as_ref());
            }
            let _ = writeln!(s, "  {} at {}, the first to fail for it", revealed_by.headline(), revealed_by.time());
            // Its headline gave the first line of what it raised, if it wrote that.
            if let FailureKind::Worker { rank, stderr_tail, .. } = &revealed_by.what {
                write_tail(&mut s, &format!("rank {rank}"), &format!("rank {rank}'s"), stderr_tail);
            }
        }
        FailureKind::Aborted { by_rank, pid, reason, revealed_by } => {
            let node = if by_rank.is_some() { format!("node {}, ", first.node) } else { String::new() };
            let who = match by_rank {
                Some(rank) => format!("rank {rank} ({node}host {}, pid {pid})", first.host),
                None => format!("pid {pid} on host {}, a process of no rank (a tool, or a command),", first.host),
            };
            let _ = writeln!(s, "  {who} aborted the job: {reason}");
            if let Some(own) = local.iter().find(|o| by_rank.is_some() && Some(o.rank) == root) {
                let _ = writeln!(s, "  then it {}", own_end(own));
                write_raised(&mut s, "it", own.raised.as_ref());
            }
            let _ = writeln!(s, "  {} at {}, the first to fail for it", revealed_by.headline(), revealed_by.time());
            // Its headline gave the first line of what it raised, if it wrote that.
            if let FailureKind::Worker { rank, stderr_tail, .. } = &revealed_by.what {
                write_tail(&mut s, &format!("rank {rank}"), &format!("rank {rank}'s"), stderr_tail);
            }
        }
        FailureKind::NodeLost { .. } | FailureKind::Interrupted { .. } => {
            let _ = writeln!(s, "  {} at {}", first.headline(), first.time());
        }
        FailureKind::Hung { stacks, unanswered, .. } => {
            let _ = writeln!(s, "  {} at {}", first.headline(), first.time());
            let _ = writeln!(s, "  where every rank was ({STACKS_HEADING}):");
            s.push_str(&stacks_text(stacks, "    ", false));
            for node in unanswered {
                let _ = writeln!(s, "    node {node} did not send its ranks' stacks");
            }
        }
    }
    if let Some(stacks) = stacks.filter(|g| g.ranks > 0 && !matches!(first.what, FailureKind::Hung { .. })) {
        let _ =
            writeln!(s, "where this node's ranks still running were when the job was taken down ({STACKS_HEADING}):");
        s.push_str(&stacks_text(stacks, "  ", false));
    }
    let cause = match &first.what {
        FailureKind::Worker { rank, .. } => format!("rank {rank} failed"),
        FailureKind::NotStarted { rank, .. } => format!("rank {rank} could not start"),
        FailureKind::RankLost { rank, loss: Loss::Finished { .. }, .. } => format!("rank {rank} finished early"),
        FailureKind::RankLost { rank, .. } => format!("rank {rank} was lost"),
        FailureKind::Aborted { by_rank: Some(rank), .. } => format!("rank {rank} aborted the job"),
        FailureKind::Aborted { by_rank: None, .. } => "the job was aborted".to_owned(),
        FailureKind::NodeLost { .. } => format!("node {} was lost", first.node),
        FailureKind::Interrupted { signal } => format!("the launcher received {}", signal_name(*signal)),
        FailureKind::Hung { .. } => "the job hung".to_owned(),
    };
    // A lost rank was lost (an abort made) before any failure it is blamed for: the
    // peer that revealed it failed after it too.
    let lost_first = matches!(first.what, FailureKind::RankLost { .. } | FailureKind::Aborted { .. });
    let others: Vec<&RankOutcome> = local.iter().filter(|o| Some(o.rank) != root).collect();
    if !others.is_empty() {
        let _ = writeln!(s, "other ranks on this node:");
        let ends = others.iter().map(|o| {
            let line = match (o.signalled_by_launcher, o.exit) {
                (_, Exit::Code(0)) => "exited with code 0".to_owned(),
                (Some(sig), Exit::Signal(got)) if sig == got => {
                    format!("killed by the launcher ({}) after {cause}", signal_name(sig))
                }
                (_, exit) if o.after_failure || lost_first => format!("{exit} after {cause}"),
                (_, exit) => format!("{exit}"),
            };
            // Its exception, where it wrote one (torchrun lists every failure's).
            let line = line + &Raised::headline(o.raised.as_ref());
            (o.rank, line)
        });
        if others.len() <= LISTED_ONE_BY_ONE {
            for (rank, line) in ends {
                let _ = writeln!(s, "  rank {rank}: {line}");
            }
        } else {
            for (line, ranks) in folded(ends) {
                let _ = writeln!(s, "  {}: {line}", ranks_text(&ranks));
            }
        }
    }
    s
}

/// Past this many other ranks on a node, those that ended alike share a line.
const LISTED_ONE_BY_ONE: usize = 16;

/// `ends` (rank, how it ended), in rank order, as each way of ending with its ranks,
/// in the order each first came.
fn folded(ends: impl Iterator<Item = (u32, String)>) -> Vec<(String, Vec<u32>)> {
    let mut groups: Vec<(String, Vec<u32>)> = Vec::new();
    for (rank, line) in ends {
        match groups.iter_mut().find(|(l, _)| *l == line) {
            Some((_, ranks)) => ranks.push(rank),
            None => groups.push((line, vec![rank])),
        }
    }
    groups
}

/// "rank 3", or "ranks 0-6,8-119 (119)" for ranks in rank order.
fn ranks_text(ranks: &[u32]) -> String {
    if let [one] = ranks {
        return format!("rank {one}");
    }
    let mut runs: Vec<(u32, u32)> = Vec::new();
    for &rank in ranks {
        match runs.last_mut() {
            Some((_, last)) if last.checked_add(1) == Some(rank) => *last = rank,
            _ => runs.push((rank, rank)),
        }
    }
    let text: Vec<String> =
        runs.iter().map(|&(a, b)| if a == b { a.to_string() } else { format!("{a}-{b}") }).collect();
    format!("ranks {} ({})", text.join(","), ranks.len())
}

/// How the root-cause rank itself ended, e.g. "was killed by the launcher (SIGKILL)".
fn own_end(o: &RankOutcome) -> String {
    match (o.signalled_by_launcher, o.exit) {
        (Some(sig), Exit::Signal(got)) if sig == got => format!("was killed by the launcher ({})", signal_name(sig)),
        (_, exit) => exit.to_string(),
    }
}

/// What `who` raised, from its error file, every line of it indented.
fn write_raised(s: &mut String, who: &str, raised: Option<&Raised>) {
    match raised {
        None => {}
        Some(Raised::Message(message)) => {
            let mut lines = message.lines();
            let _ = writeln!(s, "  {who} raised (its error file says): {}", lines.next().unwrap_or(""));
            for line in lines {
                let _ = writeln!(s, "    {line}");
            }
        }
        Some(Raised::Unreadable(why)) => {
            let _ = writeln!(s, "  ({why})");
        }
    }
}

fn write_tail(s: &mut String, who: &str, whose: &str, tail: &[String]) {
    if tail.is_empty() {
        let _ = writeln!(s, "  ({who} wrote nothing to stderr)");
    } else {
        let _ = writeln!(s, "  last {} line(s) of {whose} stderr:", tail.len());
        for line in tail {
            let _ = writeln!(s, "    | {line}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_are_named_by_this_platforms_numbers() {
        // The coordinator names the signals launchers report by Linux's numbers.
        for (sig, name) in [
            (libc::SIGHUP, "SIGHUP"),
            (libc::SIGINT, "SIGINT"),
            (libc::SIGQUIT, "SIGQUIT"),
            (libc::SIGILL, "SIGILL"),
            (libc::SIGABRT, "SIGABRT"),
            (libc::SIGBUS, "SIGBUS"),
            (libc::SIGFPE, "SIGFPE"),
            (libc::SIGKILL, "SIGKILL"),
            (libc::SIGUSR1, "SIGUSR1"),
            (libc::SIGSEGV, "SIGSEGV"),
            (libc::SIGUSR2, "SIGUSR2"),
            (libc::SIGPIPE, "SIGPIPE"),
            (libc::SIGALRM, "SIGALRM"),
            (libc::SIGTERM, "SIGTERM"),
        ] {
            assert_eq!(signal_name(sig), name);
        }
        assert_eq!(signal_name(64), "signal 64");
    }

    #[test]
    fn summary_names_the_root_cause_first_then_the_others() {
        let first = Failure {
            what: FailureKind::Worker {
                rank: 1,
                local_rank: 1,
                pid: 4242,
                exit: Exit::Code(3),
                stderr_tail: vec!["Traceback (most recent call last):".into(), "ValueError: bad batch".into()],
                raised: None,
                after: None,
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
                raised: None,
            },
            RankOutcome {
                rank: 1,
                exit: Exit::Code(3),
                signalled_by_launcher: None,
                after_failure: false,
                raised: None,
            },
            RankOutcome {
                rank: 2,
                exit: Exit::Code(5),
                signalled_by_launcher: None,
                after_failure: true,
                raised: Some(Raised::Message("RuntimeError: peer gone".into())),
            },
            RankOutcome {
                rank: 3,
                exit: Exit::Code(0),
                signalled_by_launcher: None,
                after_failure: false,
                raised: None,
            },
        ];
        let text = summary("train", 0, 0, &first, &local, None);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "rallypoint: job 'train' FAILED (attempt 1 of 1): rank 1 exited with code 3");
        assert!(lines[2].contains(
            "rank 1 (local rank 1, node 0, host gpu7, pid 4242) exited with code 3 at 1970-01-01T00:00:00.000Z"
        ));
        assert!(text.contains("    | ValueError: bad batch"));
        assert!(text.contains("  rank 0: killed by the launcher (SIGTERM) after rank 1 failed"));
        assert!(text.contains("  rank 2: exited with code 5 after rank 1 failed: RuntimeError: peer gone\n"), "{text}");
        assert!(text.contains("  rank 3: exited with code 0"));
        assert!(!text.contains("  rank 1:"));
        assert_eq!(first.exit_code(), 3);
        assert_eq!(first.abort_reason(), "launcher: rank 1 (pid 4242 on gpu7) exited with code 3");
        assert_eq!(Exit::Signal(9).shell_code(), 137);
    }

    #[test]
    fn many_other_ranks_that_ended_alike_share_a_line() {
        let first = Failure {
            what: FailureKind::Worker {
                rank: 7,
                local_rank: 7,
                pid: 4242,
                exit: Exit::Code(3),
                stderr_tail: vec![],
                raised: None,
                after: None,
            },
            node: 0,
            host: "gpu7".into(),
            at_unix_ms: 0,
        };
        let term = Some(libc::SIGTERM);
        let local: Vec<RankOutcome> = (0..120)
            .map(|rank| match rank {
                7 => RankOutcome {
                    rank,
                    exit: Exit::Code(3),
                    signalled_by_launcher: None,
                    after_failure: false,
                    raised: None,
                },
                30 | 31 => RankOutcome {
                    rank,
                    exit: Exit::Code(1),
                    signalled_by_launcher: None,
                    after_failure: true,
                    raised: None,
                },
                _ => RankOutcome {
                    rank,
                    exit: Exit::Signal(libc::SIGTERM),
                    signalled_by_launcher: term,
                    after_failure: true,
                    raised: None,
                },
            })
            .collect();
        let text = summary("train", 0, 0, &first, &local, None);
        let others: Vec<&str> = text.lines().skip_while(|l| *l != "other ranks on this node:").skip(1).collect();
        assert_eq!(
            others,
            [
                "  ranks 0-6,8-29,32-119 (117): killed by the launcher (SIGTERM) after rank 7 failed",
                "  ranks 30-31 (2): exited with code 1 after rank 7 failed",
            ]
        );
        assert_eq!(ranks_text(&[5]), "rank 5");
    }

    #[test]
    fn a_failure_after_an_early_end_shows_it_first() {
        let early = EarlyEnd { rank: 3, pid: Some(4245), node: Some(1), host: Some("gpu8".into()), at_unix_ms: 1_200 };
        let first = Failure {
            what: FailureKind::Worker {
                rank: 1,
                local_rank: 1,
                pid: 4242,
                exit: Exit::Code(1),
                stderr_tail: vec!["RuntimeError: Connection closed by peer".into()],
                raised: None,
                after: Some(Box::new(early.clone())),
            },
            node: 0,
            host: "gpu7".into(),
            at_unix_ms: 2_000,
        };
        // Context, not the cause: the headline names the failure alone.
        assert_eq!(first.headline(), "rank 1 exited with code 1");
        let text = summary("train", 0, 0, &first, &[], None);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[3].starts_with(
            "  0.8 s before it, rank 3 (node 1, host gpu8, pid 4245) exited with code 0 while its peers ran on"
        ));
        // Carried between launchers, and read from one that never sets it.
        let json = serde_json::to_string(&first).expect("json");
        assert_eq!(serde_json::from_str::<Failure>(&json).expect("back"), first);
        let without = json.replace(&format!(",\"after\":{}", serde_json::to_string(&early).expect("json")), "");
        assert!(!without.contains("after"), "{without}");
        let read: Failure = serde_json::from_str(&without).expect("without");
        assert!(matches!(read.what, FailureKind::Worker { after: None, .. }));
    }

    #[test]
    fn a_lost_rank_is_the_root_cause_and_its_peers_failed_after_it() {
        let revealed = Failure {
            what: FailureKind::Worker {
                rank: 2,
                local_rank: 2,
                pid: 4244,
                exit: Exit::Code(4),
                stderr_tail: vec!["rallypoint: barrier 'step' (generation 1) failed: rank 1 (...) is lost".into()],
                raised: None,
                after: None,
            },
            node: 0,
            host: "gpu7".into(),
            at_unix_ms: 17_500,
        };
        let lost = |process: Option<&str>| Failure {
            what: FailureKind::RankLost {
                rank: 1,
                local_rank: Some(1),
                pid: Some(4243),
                loss: Loss::Silent { lease_ms: 15_000 },
                last_seen_unix_ms: 2_000,
                process: process.map(str::to_owned),
                revealed_by: Box::new(revealed.clone()),
            },
            node: 0,
            host: "gpu7".into(),
            at_unix_ms: 17_501,
        };
        let local = vec![
            RankOutcome {
                rank: 0,
                exit: Exit::Code(4),
                signalled_by_launcher: None,
                after_failure: true,
                raised: None,
            },
            RankOutcome {
                rank: 1,
                exit: Exit::Signal(libc::SIGKILL),
                signalled_by_launcher: Some(libc::SIGKILL),
                after_failure: true,
                raised: Some(Raised::Message("ValueError: the real cause\nlr < 0".into())),
            },
            RankOutcome {
                rank: 2,
                exit: Exit::Code(4),
                signalled_by_launcher: None,
                after_failure: false,
                raised: None,
            },
        ];
        let first = lost(Some("alive, state T (stopped)"));
        let text = summary("train", 0, 0, &first, &local, None);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "rallypoint: job 'train' FAILED (attempt 1 of 1): rank 1 stopped heartbeating at \
             1970-01-01T00:00:02.000Z (process alive, state T (stopped)): ValueError: the real cause"
        );
        assert_eq!(
            lines[2],
            "  rank 1 (local rank 1, node 0, host gpu7, pid 4243) stopped heartbeating at 1970-01-01T00:00:02.000Z; \
             the coordinator counted it lost at 1970-01-01T00:00:17.000Z (no heartbeat for 15.0 s)"
        );
        // Killed in its exit, it had written what it raised: shown under its end.
        assert!(
            text.contains(
                "  then it was killed by the launcher (SIGKILL)\n  it raised (its error file says): ValueError: the real \
                 cause\n    lr < 0\n"
            ),
            "{text}"
        );
        assert!(text.contains("  rank 2 exited with code 4 at 1970-01-01T00:00:17.500Z, the first to fail for it\n"));
        assert!(text.contains("    | rallypoint: barrier 'step' (generation 1) failed: rank 1 (...) is lost"));
        assert!(text.contains("  rank 0: exited with code 4 after rank 1 was lost\n"), "{text}");
        assert!(text.contains("  rank 2: exited with code 4 after rank 1 was lost\n"), "{text}");
        assert!(!text.contains("  rank 1: "), "the root cause is not among the others: {text}");
        assert_eq!(first.exit_code(), 4, "the code its peers' failure gave");
        // Judged on another node: that node's launcher tells the process's state.
        let text = summary("train", 0, 0, &lost(None), &[], None);
        assert!(text.contains("(its process is on node 0: that node's launcher tells its state)"), "{text}");
    }
}
