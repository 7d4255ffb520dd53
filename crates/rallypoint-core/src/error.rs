//! Errors of operations. Each carries the facts a user needs to act: which rank,
//! which barrier, which host, and why.

use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use bytes::Bytes;

use crate::identity::Incarnation;
use crate::request::Members;

/// Kind of a collective operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CollectiveKind {
    Barrier,
    AllGather,
    Broadcast,
}

impl fmt::Display for CollectiveKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CollectiveKind::Barrier => "barrier",
            CollectiveKind::AllGather => "all-gather",
            CollectiveKind::Broadcast => "broadcast",
        })
    }
}

/// One generation of one named collective of a job.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct OpRef {
    pub kind: CollectiveKind,
    pub name: String,
    /// 1 for a rank's first call of this name, 2 for its second, and so on.
    pub generation: u64,
}

impl fmt::Display for OpRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} '{}' (generation {})", self.kind, self.name, self.generation)
    }
}

/// Why a rank is considered dead.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LossReason {
    /// Its last connection dropped without a clean leave (process killed or crashed).
    Disconnected,
    /// It sent nothing for a whole lease (hung, or cut off by the network).
    LeaseExpired { lease_ms: u64 },
    /// The launcher that started its worker process (`pid`: a wrapper script's, say,
    /// where the rank's own process is another) saw it end
    /// ([`crate::Request::RankExited`]).
    Exited { pid: u32, exit: Exit },
}

impl fmt::Display for LossReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LossReason::Disconnected => write!(f, "connection dropped without a clean leave"),
            LossReason::LeaseExpired { lease_ms } => {
                write!(f, "no heartbeat for {}", Secs(*lease_ms))
            }
            LossReason::Exited { pid, exit } => write!(f, "worker pid {pid} {exit}"),
        }
    }
}

/// How a process ended, as its parent's `waitpid` told it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
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

/// A signal's name ("SIGKILL"), or "signal N" for one without a common name. The
/// numbers are Linux's (the same on x86 and ARM), which is where launchers run: the
/// engine names a signal a launcher reported, whatever the coordinator runs on.
pub fn signal_name(sig: i32) -> String {
    let name = match sig {
        1 => "SIGHUP",
        2 => "SIGINT",
        3 => "SIGQUIT",
        4 => "SIGILL",
        6 => "SIGABRT",
        7 => "SIGBUS",
        8 => "SIGFPE",
        9 => "SIGKILL",
        10 => "SIGUSR1",
        11 => "SIGSEGV",
        12 => "SIGUSR2",
        13 => "SIGPIPE",
        14 => "SIGALRM",
        15 => "SIGTERM",
        other => return format!("signal {other}"),
    };
    name.to_owned()
}

/// Where a rank that a collective waits for stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RankState {
    /// No session of this rank ever connected to this job.
    NeverConnected,
    /// Connected and alive, but has not called this generation.
    Connected,
    /// Its sessions closed cleanly; it may come back.
    Left,
    /// Dead: see the reason.
    Lost(LossReason),
    /// Its launcher saw its worker process (`pid`) exit with code 0 and it has no
    /// session left: done, and it will not arrive anywhere again. To its peers it is
    /// as gone as a lost rank (what needs it fails at once), but it is not a loss.
    Finished { pid: u32 },
}

/// A rank as the coordinator last knew it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RankInfo {
    pub rank: u32,
    /// Host and pid of its latest session; `None` if it never connected.
    pub host: Option<String>,
    pub pid: Option<u32>,
    pub state: RankState,
    /// Milliseconds since the coordinator last heard from it; `None` if never.
    pub last_seen_ms_ago: Option<u64>,
}

impl fmt::Display for RankInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {}", self.rank)?;
        if self.state == RankState::NeverConnected {
            return write!(f, " (never connected)");
        }
        write!(f, " (")?;
        if let Some(host) = &self.host {
            write!(f, "host {host}, ")?;
        }
        if let Some(pid) = self.pid {
            write!(f, "pid {pid}, ")?;
        }
        match self.state {
            RankState::NeverConnected => {}
            RankState::Connected => write!(f, "connected but not arrived")?,
            RankState::Left => write!(f, "left cleanly")?,
            RankState::Lost(reason) => write!(f, "lost: {reason}")?,
            RankState::Finished { pid } => write!(f, "finished: worker pid {pid} exited with code 0")?,
        }
        if let Some(ago) = self.last_seen_ms_ago {
            write!(f, ", last seen {} ago", Secs(ago))?;
        }
        write!(f, ")")
    }
}

/// Who made a call, as named in a mismatch error.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CallShape {
    pub rank: u32,
    pub members: Members,
    pub world_size: u32,
    /// For broadcast: the root it named.
    pub root: Option<u32>,
}

impl fmt::Display for CallShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {} called it with {} of world size {}", self.rank, self.members, self.world_size)?;
        if let Some(root) = self.root {
            write!(f, " and root {root}")?;
        }
        Ok(())
    }
}

/// Who aborted a job.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct AbortInfo {
    /// `None` when a session without rank (a tool, the launcher) aborted.
    pub by_rank: Option<u32>,
    pub host: String,
    pub pid: u32,
    pub reason: String,
}

impl fmt::Display for AbortInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Without a rank (a tool, the launcher) the process is the name; its reason
        // says what it is ("launcher: rank 3 exited with code 1").
        match (self.by_rank, self.host.is_empty()) {
            (Some(rank), false) => write!(f, "rank {rank} (host {}, pid {})", self.host, self.pid)?,
            (Some(rank), true) if self.pid == 0 => write!(f, "rank {rank}")?,
            (Some(rank), true) => write!(f, "rank {rank} (pid {})", self.pid)?,
            (None, false) => write!(f, "pid {} on host {}", self.pid, self.host)?,
            (None, true) => write!(f, "pid {}", self.pid)?,
        }
        write!(f, ": {}", self.reason)
    }
}

/// A process as the coordinator knows it from its hello: who holds or claims a rank,
/// who reset a job.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ProcessInfo {
    pub pid: u32,
    pub host: String,
    /// `None` for a session that stated none (a PyTorch TCPStore client).
    pub incarnation: Option<u64>,
}

/// "pid 311 on host a (incarnation 3f2a09c1b5d7e0a1)"
impl fmt::Display for ProcessInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pid {}", self.pid)?;
        if !self.host.is_empty() {
            write!(f, " on host {}", self.host)?;
        }
        if let Some(incarnation) = self.incarnation {
            write!(f, " (incarnation {})", Incarnation(incarnation))?;
        }
        Ok(())
    }
}

/// Which incarnation a job is at, since when, and who put it there.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct JobIncarnation {
    pub incarnation: u64,
    /// Wall-clock time, in milliseconds since the Unix epoch.
    pub since_unix_ms: u64,
    pub by: ProcessInfo,
    /// True if `by` reset the job to it; false if `by` was the first process to name it.
    pub reset: bool,
}

/// Why an operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpError {
    /// A barrier or collective reached its deadline; `missing` says which members had
    /// not arrived (the first ones in full, the rest as ranges). `before_call_ms`: for
    /// a call that came after the deadline (it was among the missing), how long
    /// before it came; `None` for a call that waited.
    #[error("{op} timed out after {}{}: {} of {members} ranks missing: {missing}",
        Secs(*waited_ms), Before(*before_call_ms), missing.count())]
    CollectiveTimeout { op: OpRef, waited_ms: u64, members: u32, missing: Missing, before_call_ms: Option<u64> },

    /// A get/wait/multi-get timed out; `missing` lists the keys that still did not exist.
    #[error("timed out after {} waiting for {} key(s): {}", Secs(*waited_ms), missing.len(), KeyList(missing))]
    KeyTimeout { waited_ms: u64, missing: Vec<Bytes> },

    /// A member the collective needs is dead, or finished (its worker exited with
    /// code 0) before the collective completed.
    #[error("{op} failed: {peer} {}", match peer.state {
        RankState::Finished { .. } => "finished before it completed",
        _ => "is lost",
    })]
    PeerLost { op: OpRef, peer: RankInfo },

    /// What the lost (or finished) rank's own process is told where its peers are
    /// told [`OpError::PeerLost`]: the coordinator declared this very rank gone while
    /// a session of it was still open (a process stopped or starved of CPU for a whole
    /// lease, or a child that outlived its worker), and its peers were told so.
    #[error("{op} failed: this process's {this} {}, and its peers were told so{}",
        match this.state {
            RankState::Finished { .. } => "was declared finished",
            _ => "was declared lost",
        },
        match this.state {
            RankState::Lost(LossReason::LeaseExpired { .. }) =>
                " (it sent nothing for a whole lease: was it stopped, starved of CPU, or its heartbeats held \
                 up, as by synchronous work on every thread of an async runtime?)",
            _ => "",
        })]
    ThisRankLost { op: OpRef, this: RankInfo },

    /// The job was aborted.
    #[error("job '{job}' was aborted by {by}")]
    Aborted { job: String, by: AbortInfo },

    /// Two ranks called the same generation of a collective differently.
    #[error("{op} mismatch: {theirs}, but {mine}")]
    Mismatch { op: OpRef, mine: Box<CallShape>, theirs: Box<CallShape> },

    /// The caller is not among the members it named, or a member is outside the world.
    #[error("{kind} '{name}': {reason}")]
    BadMembers { kind: CollectiveKind, name: String, reason: String },

    /// The operation needs a rank and world size, and the session has none.
    #[error("{op} needs a rank and a world size; this session connected without them")]
    NoRank { op: String },

    /// `add` on a value that is not a decimal integer.
    #[error("add on key {}: value {} is not an integer", Show(key), Show(value))]
    NotANumber { key: Bytes, value: Bytes },

    /// `add` would overflow a signed 64-bit integer.
    #[error("add on key {}: {current} + {delta} overflows a 64-bit integer", Show(key))]
    Overflow { key: Bytes, current: i64, delta: i64 },

    /// A key, value, name or list is longer than the server allows.
    #[error("{what} of {len} exceeds the limit of {limit}")]
    TooLarge { what: String, len: u64, limit: u64 },

    /// Any other invalid argument, with what was wrong.
    #[error("invalid argument: {0}")]
    Invalid(String),

    /// The session closed, or the server is shutting down.
    #[error("{0}")]
    Closed(String),

    /// The rank is held by another live process (a session of its incarnation is open,
    /// or its connection dropped less than the reconnect grace ago).
    #[error("rank {rank} is held by {holder} since {}; this process is {claimant}", Utc(*since_unix_ms))]
    RankHeld { rank: u32, holder: Box<ProcessInfo>, since_unix_ms: u64, claimant: Box<ProcessInfo> },

    /// This process held the rank, lost it (or left), and another process took it over.
    #[error("rank {rank} was taken over by {by} at {}; this process ({this}) no longer holds it", Utc(*at_unix_ms))]
    TakenOver { rank: u32, by: Box<ProcessInfo>, at_unix_ms: u64, this: Box<ProcessInfo> },

    /// The job was reset to a new incarnation: the operation belonged to the one before.
    #[error("job '{job}' was reset by {} at {} (to incarnation {}); this operation belonged to the incarnation before", to.by, Utc(to.since_unix_ms), Incarnation(to.incarnation))]
    JobReset { job: String, to: Box<JobIncarnation> },

    /// The process names a job incarnation that is not the job's current one.
    #[error("this process belongs to incarnation {} of job '{job}'; the job is at incarnation {} since {} ({} by {})", Incarnation(*mine), Incarnation(current.incarnation), Utc(current.since_unix_ms), if current.reset { "reset" } else { "first named" }, current.by)]
    StaleIncarnation { job: String, mine: u64, current: Box<JobIncarnation> },

    /// The connection's credentials were refused before its hello was looked at: no
    /// token, a wrong token, or plaintext where TLS is required.
    #[error("{0}")]
    Unauthorized(AuthRefusal),
}

impl OpError {
    /// True for the errors that say this process no longer speaks for its rank or job
    /// (another process holds the rank or took it over, or the job was reset).
    pub fn is_incarnation_refusal(&self) -> bool {
        matches!(
            self,
            OpError::RankHeld { .. }
                | OpError::TakenOver { .. }
                | OpError::JobReset { .. }
                | OpError::StaleIncarnation { .. }
        )
    }

    /// The error as a call of `rank` is told it: a loss that names the caller's own
    /// rank says that this rank was declared gone, rather than naming it as a peer.
    pub fn told_to(&self, rank: u32) -> OpError {
        match self {
            OpError::PeerLost { op, peer } if peer.rank == rank => {
                OpError::ThisRankLost { op: op.clone(), this: peer.clone() }
            }
            other => other.clone(),
        }
    }

    /// A timeout as a call that came `ms` after it is told it.
    pub(crate) fn came_late(&self, ms: u64) -> OpError {
        match self {
            OpError::CollectiveTimeout { op, waited_ms, members, missing, .. } => OpError::CollectiveTimeout {
                op: op.clone(),
                waited_ms: *waited_ms,
                members: *members,
                missing: missing.clone(),
                before_call_ms: Some(ms),
            },
            other => other.clone(),
        }
    }

    /// A mismatch the other way round: `theirs` as `mine`.
    pub(crate) fn swapped(&self) -> OpError {
        match self {
            OpError::Mismatch { op, mine, theirs } => {
                OpError::Mismatch { op: op.clone(), mine: theirs.clone(), theirs: mine.clone() }
            }
            other => other.clone(),
        }
    }

    /// A mismatch as the client of `rank` shows it. The coordinator tells each call
    /// of a failed generation the generation's call as `mine` (what this call was
    /// too), under the rank that made it first: it does not know every waiter's
    /// rank. The caller's client puts its own there.
    pub fn seen_by(self, rank: u32) -> OpError {
        match self {
            OpError::Mismatch { op, mut mine, theirs } if mine.rank != rank && theirs.rank != rank => {
                mine.rank = rank;
                OpError::Mismatch { op, mine, theirs }
            }
            other => other,
        }
    }
}

/// ", 0.3 s before this call came" for a call that came after its generation failed.
struct Before(Option<u64>);

impl fmt::Display for Before {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(ms) => write!(f, ", {} before this call came", Secs(ms)),
            None => Ok(()),
        }
    }
}

/// A wall-clock time in milliseconds since the Unix epoch, as UTC to the second
/// ("2026-11-21T12:00:01Z").
pub(crate) struct Utc(pub u64);

impl fmt::Display for Utc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let at = std::time::UNIX_EPOCH + std::time::Duration::from_millis(self.0);
        write!(f, "{}", humantime::format_rfc3339_seconds(at))
    }
}

/// Why a coordinator or node agent refused a connection's credentials. The
/// messages say what to set, since the fix is always on the refused side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AuthRefusal {
    /// The server has a token and the client proved none.
    TokenRequired,
    /// The client's proof does not match the server's token.
    WrongToken,
    /// The server serves native clients over TLS only.
    TlsRequired,
    /// The client offered a token proof, but the server has no token to prove its
    /// own side with (and the client insists on a server that does).
    NoTokenHere,
}

impl fmt::Display for AuthRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AuthRefusal::TokenRequired => {
                "this coordinator requires a token: set RALLYPOINT_TOKEN or RALLYPOINT_TOKEN_FILE (or --token-file)"
            }
            AuthRefusal::WrongToken => {
                "wrong token: the coordinator's token is not the one this process has \
                 (RALLYPOINT_TOKEN, RALLYPOINT_TOKEN_FILE or --token-file)"
            }
            AuthRefusal::TlsRequired => {
                "this coordinator requires TLS: set RALLYPOINT_TLS_CA (or --tls-ca) to the CA \
                 certificate that signed its certificate"
            }
            AuthRefusal::NoTokenHere => {
                "this process has a token but the coordinator has none, so it cannot prove that it \
                 knows it: give the coordinator the same token (--token-file, RALLYPOINT_TOKEN_FILE \
                 or RALLYPOINT_TOKEN), or give this process none (no --token-file, RALLYPOINT_TOKEN_FILE \
                 or RALLYPOINT_TOKEN)"
            }
        })
    }
}

/// Milliseconds shown as seconds with one decimal ("2.5 s").
pub(crate) struct Secs(pub u64);

impl fmt::Display for Secs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{} s", self.0 / 1000, (self.0 % 1000) / 100)
    }
}

/// Ranks too many to name one by one, as ranges in rank order: the first
/// [`RankRanges::SHOWN`] ranges, and how many ranks the whole set holds. Its size
/// is bounded whatever the set's.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct RankRanges {
    /// `(first, last)`, both included, in rank order, at most [`RankRanges::SHOWN`].
    pub ranges: Vec<(u32, u32)>,
    /// Ranks in the whole set, those past the last range listed included.
    pub count: u64,
}

impl RankRanges {
    /// Most ranges listed; the ranks past them are only counted.
    pub const SHOWN: usize = 64;

    /// Keeps the first [`RankRanges::SHOWN`] of `ranges` (disjoint, in rank order)
    /// and counts the ranks of all of them.
    pub fn collect(ranges: impl IntoIterator<Item = (u32, u32)>) -> Self {
        let mut set = RankRanges::default();
        for (first, last) in ranges {
            if set.ranges.len() < Self::SHOWN {
                set.ranges.push((first, last));
            }
            set.count += span((first, last));
        }
        set
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Ranks of the set past the ranges listed.
    pub fn unlisted(&self) -> u64 {
        self.count.saturating_sub(self.ranges.iter().map(|&r| span(r)).sum())
    }
}

/// Ranks in the range `(first, last)`; none if it is reversed.
fn span((first, last): (u32, u32)) -> u64 {
    (u64::from(last) + 1).saturating_sub(u64::from(first))
}

/// "5-9999", "3, 7-9, 12", or with ranks past the listed ranges "3, 7-9 and 120 more above 9".
impl fmt::Display for RankRanges {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, &(first, last)) in self.ranges.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            if first == last {
                write!(f, "{first}")?;
            } else {
                write!(f, "{first}-{last}")?;
            }
        }
        let unlisted = self.unlisted();
        match self.ranges.last() {
            Some((_, last)) if unlisted > 0 => write!(f, " and {unlisted} more above {last}"),
            None if unlisted > 0 => write!(f, "({unlisted} not listed)"),
            _ => Ok(()),
        }
    }
}

/// The members a collective still waited for: the first [`Missing::NAMED`] in rank
/// order with what the coordinator knows of each, the rest as rank ranges, so that
/// the error's size never depends on the world size. Every waiter's copy of the
/// error shares one list.
///
/// Dereferences to the members named in full; [`Missing::count`] is how many are missing.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Missing(Arc<(Vec<RankInfo>, RankRanges)>);

impl Missing {
    /// Most missing ranks named in full, in errors and status reports alike.
    pub const NAMED: usize = 64;

    /// `named` in full (in rank order), then the missing ranks after them.
    pub fn new(named: Vec<RankInfo>, rest: RankRanges) -> Self {
        Missing(Arc::new((named, rest)))
    }

    /// The missing members named in full.
    pub fn named(&self) -> &[RankInfo] {
        &self.0 .0
    }

    /// The missing members after those named.
    pub fn rest(&self) -> &RankRanges {
        &self.0 .1
    }

    /// How many members are missing.
    pub fn count(&self) -> u64 {
        self.named().len() as u64 + self.rest().count
    }
}

impl Deref for Missing {
    type Target = [RankInfo];

    fn deref(&self) -> &[RankInfo] {
        self.named()
    }
}

/// Every member named in full.
impl From<Vec<RankInfo>> for Missing {
    fn from(named: Vec<RankInfo>) -> Self {
        Missing::new(named, RankRanges::default())
    }
}

impl fmt::Display for Missing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, r) in self.named().iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{r}")?;
        }
        let rest = self.rest();
        if rest.is_empty() {
            return Ok(());
        }
        let ranks = if rest.count == 1 { "rank" } else { "ranks" };
        if self.named().is_empty() {
            write!(f, "{ranks} {rest}")
        } else {
            write!(f, "; and {} more: {ranks} {rest}", rest.count)
        }
    }
}

struct KeyList<'a>(&'a [Bytes]);

impl fmt::Display for KeyList<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, k) in self.0.iter().take(16).enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{}", Show(k))?;
        }
        if self.0.len() > 16 {
            write!(f, ", and {} more", self.0.len() - 16)?;
        }
        Ok(())
    }
}

/// Bytes shown as a quoted, escaped string, cut at 64 bytes.
pub(crate) struct Show<'a>(pub &'a Bytes);

impl fmt::Display for Show<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let cut = self.0.len() > 64;
        let shown = &self.0[..self.0.len().min(64)];
        write!(f, "\"{}\"", shown.escape_ascii())?;
        if cut {
            write!(f, "… ({} bytes)", self.0.len())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    /// Errors travel in every `Result` of the engine and the clients: keep them small.
    #[test]
    fn op_error_stays_small() {
        assert!(std::mem::size_of::<super::OpError>() <= 128, "{}", std::mem::size_of::<super::OpError>());
    }
}
