//! Requests a session sends, and the replies it gets.

use std::fmt;

use bytes::Bytes;

use crate::error::{Exit, OpError};
use crate::gathered::Gathered;
use crate::identity::SessionId;
use crate::ranges::{runs, RankList};

/// Milliseconds on the caller's monotonic clock. The engine never reads a clock.
pub type Millis = u64;

/// A collective's name (barrier, all-gather, broadcast), or the role its members
/// hold ([`Members::Role`]). Kept inline when no longer than a `String` itself: a
/// rank's call then allocates nothing for it, and its request, held until the reply
/// in case the connection is cut, frees nothing on a line gone cold.
pub type Name = compact_str::CompactString;

/// Which ranks take part in a barrier or collective.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Members {
    /// Every rank `0..world_size`.
    World,
    /// An explicit set of ranks (order and duplicates do not matter).
    Ranks(Vec<u32>),
    /// Every rank whose identity names this role.
    Role(Name),
}

impl fmt::Display for Members {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Members::World => write!(f, "all ranks"),
            // Bounded, as a list may hold a million ranks (see `RankList`).
            Members::Ranks(ranks) => write!(f, "ranks [{}]", RankList::new(runs(ranks.iter().copied()), ",")),
            Members::Role(role) => write!(f, "role '{role}'"),
        }
    }
}

/// One request of a session. `timeout_ms: None` waits without limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Set {
        key: Bytes,
        value: Bytes,
    },
    /// Blocks until the key exists.
    Get {
        key: Bytes,
        timeout_ms: Option<u64>,
    },
    /// Adds to a decimal integer value (missing counts as 0); replies with the new value.
    Add {
        key: Bytes,
        delta: i64,
    },
    /// TCPStore semantics; see `Store::compare_set`.
    CompareSet {
        key: Bytes,
        expected: Bytes,
        desired: Bytes,
    },
    Append {
        key: Bytes,
        value: Bytes,
    },
    Delete {
        key: Bytes,
    },
    Check {
        keys: Vec<Bytes>,
    },
    /// Blocks until every key exists.
    Wait {
        keys: Vec<Bytes>,
        timeout_ms: Option<u64>,
    },
    /// Blocks until every key exists, then replies with their values in order.
    MultiGet {
        keys: Vec<Bytes>,
        timeout_ms: Option<u64>,
    },
    MultiSet {
        entries: Vec<(Bytes, Bytes)>,
    },
    NumKeys,
    ListKeys {
        prefix: Bytes,
    },
    Barrier {
        name: Name,
        members: Members,
        timeout_ms: Option<u64>,
    },
    AllGather {
        name: Name,
        members: Members,
        value: Bytes,
        timeout_ms: Option<u64>,
    },
    /// `value` is required from the root and ignored from the others.
    Broadcast {
        name: Name,
        members: Members,
        root: u32,
        value: Option<Bytes>,
        timeout_ms: Option<u64>,
    },
    /// Fails every pending and later operation of the job with `reason`.
    Abort {
        reason: String,
    },
    /// The worker process a launcher started for `rank` (process `pid` on `host`)
    /// ended with `exit`: the rank is lost at once, named with that end, whatever its
    /// connections say, and also if it never connected (see `Ranks::exited`); with
    /// code 0 it finished, which fails what still needs it as a loss would. A
    /// launcher says so before it aborts the job, so that peers waiting for the rank
    /// are told it was lost, not that the job was aborted, whichever the coordinator
    /// would have learnt first.
    RankExited {
        rank: u32,
        host: String,
        pid: u32,
        exit: Exit,
    },
    /// Appends `value` to the queue `key`. Queues are a namespace apart from keys, but a
    /// wait or check on `key` is satisfied by a non-empty queue of that name (as in
    /// torch's libuv TCPStore); a push wakes one such waiter.
    QueuePush {
        key: Bytes,
        value: Bytes,
    },
    /// Takes the oldest item of queue `key` without blocking; replies `Popped`.
    QueuePop {
        key: Bytes,
    },
    /// Replies the length of queue `key` as `Int`.
    QueueLen {
        key: Bytes,
    },
    /// Ends every key wait of this session (each fails with `Closed`); always replies Done.
    CancelWait,
    /// TCPStore's store barrier: adds 1 to the decimal counter stored at `key` (never
    /// reset), and replies Done once it is at least `world_size`.
    StoreBarrier {
        key: Bytes,
        world_size: i64,
        timeout_ms: Option<u64>,
    },
    /// A text report of the job: what is known or inferred about its PyTorch (TCPStore)
    /// processes, its ranks' states, and every barrier, all-gather or broadcast someone
    /// waits in, with who is missing and what is known of each. Replies `Value`.
    Status,
    /// Starts job `incarnation` afresh: the keys, barrier generations, abort, lost ranks
    /// and rank holders of the job's current incarnation are gone, its pending
    /// operations fail with `JobReset`, and its sessions (this one included) are refused
    /// from then on. A no-op if the job is already at `incarnation`.
    Reset {
        incarnation: u64,
    },
    /// The names of the jobs the coordinator holds, in byte order, at most
    /// [`MAX_JOBS_LISTED`]; the caller's own job only if it holds more than the
    /// caller's session (keys, ranks, other sessions, an abort), so that asking creates
    /// no job.
    /// Replies `Values`.
    Jobs,
    /// The caller's job as data: a [`crate::snapshot::JobSnapshot`] encoded as JSON
    /// (docs/STATUS.md), as seen by everyone but the caller. Replies `Value`.
    Snapshot,
    /// Keeps the session's rank alive (any request does).
    Heartbeat,
    /// The session is about to close cleanly: its rank has left, not died.
    Leave,
    /// The client gives the session up as a crash would (it was dropped without a
    /// clean leave): its close is a loss at once, without the reconnect grace that a
    /// cut connection gets.
    Abandon,
}

impl Request {
    /// Short name for logs and errors.
    pub fn name(&self) -> &'static str {
        match self {
            Request::Set { .. } => "set",
            Request::Get { .. } => "get",
            Request::Add { .. } => "add",
            Request::CompareSet { .. } => "compare_set",
            Request::Append { .. } => "append",
            Request::Delete { .. } => "delete",
            Request::Check { .. } => "check",
            Request::Wait { .. } => "wait",
            Request::MultiGet { .. } => "multi_get",
            Request::MultiSet { .. } => "multi_set",
            Request::NumKeys => "num_keys",
            Request::ListKeys { .. } => "list_keys",
            Request::Barrier { .. } => "barrier",
            Request::AllGather { .. } => "all_gather",
            Request::Broadcast { .. } => "broadcast",
            Request::Abort { .. } => "abort",
            Request::RankExited { .. } => "rank_exited",
            Request::QueuePush { .. } => "queue_push",
            Request::QueuePop { .. } => "queue_pop",
            Request::QueueLen { .. } => "queue_len",
            Request::CancelWait => "cancel_wait",
            Request::StoreBarrier { .. } => "store_barrier",
            Request::Status => "status",
            Request::Reset { .. } => "reset",
            Request::Jobs => "jobs",
            Request::Snapshot => "snapshot",
            Request::Heartbeat => "heartbeat",
            Request::Leave => "leave",
            Request::Abandon => "abandon",
        }
    }

    /// Whether running the request a second time could differ from running it once
    /// (an arrival counted twice, an `add` added twice, a key set again over a later
    /// write): its reply is kept for a client that re-sends it after a reconnect.
    pub fn changes_state(&self) -> bool {
        match self {
            Request::Set { .. }
            | Request::Add { .. }
            | Request::CompareSet { .. }
            | Request::Append { .. }
            | Request::Delete { .. }
            | Request::MultiSet { .. }
            | Request::Barrier { .. }
            | Request::AllGather { .. }
            | Request::Broadcast { .. }
            | Request::Abort { .. }
            | Request::QueuePush { .. }
            | Request::QueuePop { .. }
            | Request::CancelWait
            | Request::StoreBarrier { .. }
            | Request::Reset { .. } => true,
            Request::Get { .. }
            | Request::Check { .. }
            | Request::Wait { .. }
            | Request::MultiGet { .. }
            | Request::NumKeys
            | Request::ListKeys { .. }
            | Request::QueueLen { .. }
            | Request::Status
            | Request::Jobs
            | Request::Snapshot
            | Request::Heartbeat
            | Request::Leave
            | Request::Abandon
            // A second report of the same end finds the rank lost already.
            | Request::RankExited { .. } => false,
        }
    }

    /// Whether the request may wait for others before its reply (a re-sent copy of a
    /// waiting request must not wait a second time).
    pub fn may_block(&self) -> bool {
        matches!(
            self,
            Request::Get { .. }
                | Request::Wait { .. }
                | Request::MultiGet { .. }
                | Request::Barrier { .. }
                | Request::AllGather { .. }
                | Request::Broadcast { .. }
                | Request::StoreBarrier { .. }
        )
    }

    /// A barrier, all-gather or broadcast: a call of a named collective.
    pub fn is_collective(&self) -> bool {
        matches!(self, Request::Barrier { .. } | Request::AllGather { .. } | Request::Broadcast { .. })
    }
}

/// Most job names one `Jobs` reply holds.
pub const MAX_JOBS_LISTED: usize = 1024;

/// A successful reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Response {
    /// set, multi_set, append, wait, barrier, store_barrier, queue_push, cancel_wait,
    /// abort, heartbeat, leave.
    Done,
    /// get, compare_set, broadcast, status.
    Value(Bytes),
    /// add, num_keys, queue_len.
    Int(i64),
    /// delete (whether the key existed), check (whether all keys exist).
    Bool(bool),
    /// multi_get (in request order), list_keys (sorted).
    Values(Vec<Bytes>),
    /// all_gather: every member's value in rank order, shared by all recipients.
    Gathered(Gathered),
    /// queue_pop: the queue's length before the pop (0: it was empty) and the item taken.
    Popped { len_before: i64, value: Option<Bytes> },
}

pub type Reply = Result<Response, OpError>;

/// A reply the engine has produced for a session's request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    pub session: SessionId,
    pub request_id: u64,
    pub reply: Reply,
}

impl Outgoing {
    pub(crate) fn new(session: SessionId, request_id: u64, reply: Reply) -> Outgoing {
        Outgoing { session, request_id, reply }
    }
}

/// What a session learns when the engine accepts its identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Welcome {
    pub session: SessionId,
    /// Lease in milliseconds (0 = no lease); clients heartbeat at a third of it.
    pub lease_ms: u64,
    /// The incarnation the session's job is at (`None`: never reset nor named).
    pub job_incarnation: Option<u64>,
}
