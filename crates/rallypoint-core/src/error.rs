//! Errors of operations. Each carries the facts a user needs to act: which rank,
//! which barrier, which host, and why.

use std::fmt;

use bytes::Bytes;

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
}

impl fmt::Display for LossReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LossReason::Disconnected => write!(f, "connection dropped without a clean leave"),
            LossReason::LeaseExpired { lease_ms } => {
                write!(f, "no heartbeat for {}", Secs(*lease_ms))
            }
        }
    }
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

/// Why an operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpError {
    /// A barrier or collective reached its deadline; `missing` lists every member that had not arrived.
    #[error("{op} timed out after {}: {} of {members} ranks missing: {}", Secs(*waited_ms), missing.len(), RankList(missing))]
    CollectiveTimeout { op: OpRef, waited_ms: u64, members: u32, missing: Vec<RankInfo> },

    /// A get/wait/multi-get timed out; `missing` lists the keys that still did not exist.
    #[error("timed out after {} waiting for {} key(s): {}", Secs(*waited_ms), missing.len(), KeyList(missing))]
    KeyTimeout { waited_ms: u64, missing: Vec<Bytes> },

    /// A member the collective needs is dead.
    #[error("{op} failed: {peer} is lost")]
    PeerLost { op: OpRef, peer: RankInfo },

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
}

/// Milliseconds shown as seconds with one decimal ("2.5 s").
pub(crate) struct Secs(pub u64);

impl fmt::Display for Secs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{} s", self.0 / 1000, (self.0 % 1000) / 100)
    }
}

/// Ranks shown one after another; long lists are cut after [`RankList::SHOWN`]
/// entries with a count.
pub(crate) struct RankList<'a>(pub &'a [RankInfo]);

impl RankList<'_> {
    pub const SHOWN: usize = 64;
}

impl fmt::Display for RankList<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const SHOWN: usize = RankList::SHOWN;
        for (i, r) in self.0.iter().take(SHOWN).enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{r}")?;
        }
        if self.0.len() > SHOWN {
            write!(f, "; and {} more", self.0.len() - SHOWN)?;
        }
        Ok(())
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
