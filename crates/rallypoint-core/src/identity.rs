//! Who a session is: the facts a client states when it connects.

use std::fmt;

/// Opaque handle the I/O layer assigns to each connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId(pub u64);

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "session {}", self.0)
    }
}

/// What a session says about itself on connect.
///
/// `rank` and `world_size` are optional so that tools (a `rallypoint get` from a
/// shell, a TCPStore connection) can use the key-value store; barriers and
/// collectives need both.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub job: String,
    pub rank: Option<u32>,
    pub world_size: Option<u32>,
    pub host: String,
    pub pid: u32,
    pub role: Option<String>,
}

impl Identity {
    /// An identity with no rank: may use the key-value store only.
    pub fn anonymous(job: impl Into<String>) -> Self {
        Identity { job: job.into(), rank: None, world_size: None, host: String::new(), pid: 0, role: None }
    }

    /// An identity of `rank` in a world of `world_size`.
    pub fn ranked(job: impl Into<String>, rank: u32, world_size: u32) -> Self {
        Identity { rank: Some(rank), world_size: Some(world_size), ..Identity::anonymous(job) }
    }
}
