//! Who a session is: the facts a client states when it connects.

use std::fmt;

/// Handle the I/O layer assigns to each connection. Its low 32 bits are its slot
/// in the tables kept by session (see [`crate::SessionTable`]): give the sessions
/// held distinct small slots, reusing freed ones, with other high bits on each
/// reuse so that no id is given twice. Any id works; such ids cost least.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SessionId(pub u64);

impl SessionId {
    /// The id of `slot` as given the `serial`-th time.
    pub fn at(slot: u32, serial: u32) -> SessionId {
        SessionId(u64::from(serial) << 32 | u64::from(slot))
    }

    /// Where tables kept by session look for it first.
    #[inline]
    pub fn slot(self) -> usize {
        (self.0 & u64::from(u32::MAX)) as usize
    }

    /// How many times its slot had been given, this id included (0: an id not made
    /// by [`SessionId::at`]).
    pub fn serial(self) -> u32 {
        u32::try_from(self.0 >> 32).unwrap_or(u32::MAX)
    }
}

/// As slot and serial ("session 3.17"), which say more than one large number.
impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.serial() {
            0 => write!(f, "session {}", self.0),
            serial => write!(f, "session {}.{serial}", self.slot()),
        }
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
    /// The process's incarnation: a random number drawn once per process, so that two
    /// processes claiming one rank are told apart (docs/PROTOCOL.md, section 14). `None`
    /// for a session that cannot state one (a PyTorch TCPStore client): such a session
    /// neither holds its rank against others nor is refused one, and cannot resume.
    pub incarnation: Option<u64>,
    /// The incarnation of the job this process belongs to (`RALLYPOINT_JOB_INCARNATION`,
    /// set by a launcher per attempt). `None` joins whatever incarnation is current.
    pub job_incarnation: Option<u64>,
    /// The session this hello resumes after a cut connection (the id its earlier
    /// welcome gave), if any. Only meaningful in a hello: a session keeps `None`.
    pub resume: Option<SessionId>,
}

impl Identity {
    /// An identity with no rank: may use the key-value store only.
    pub fn anonymous(job: impl Into<String>) -> Self {
        Identity {
            job: job.into(),
            rank: None,
            world_size: None,
            host: String::new(),
            pid: 0,
            role: None,
            incarnation: None,
            job_incarnation: None,
            resume: None,
        }
    }

    /// An identity of `rank` in a world of `world_size`.
    pub fn ranked(job: impl Into<String>, rank: u32, world_size: u32) -> Self {
        Identity { rank: Some(rank), world_size: Some(world_size), ..Identity::anonymous(job) }
    }
}

/// An incarnation as people and environment variables see it: 16 hex digits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Incarnation(pub u64);

impl fmt::Display for Incarnation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

impl std::str::FromStr for Incarnation {
    type Err = String;

    /// Hex digits, with or without `0x` (what [`Incarnation`]'s `Display` writes).
    fn from_str(s: &str) -> Result<Self, String> {
        let digits = s.trim();
        let digits = digits.strip_prefix("0x").unwrap_or(digits);
        if digits.is_empty() || digits.len() > 16 {
            return Err(format!("'{s}' is not an incarnation (1 to 16 hex digits)"));
        }
        u64::from_str_radix(digits, 16)
            .map(Incarnation)
            .map_err(|_| format!("'{s}' is not an incarnation (1 to 16 hex digits)"))
    }
}
