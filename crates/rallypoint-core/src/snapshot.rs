//! What the coordinator knows about a job, as data: the document `rallypoint status
//! --json` prints and the live page's JSON API serves (docs/STATUS.md is its
//! schema, field by field). The engine fills a [`JobSnapshot`]
//! (`Engine::snapshot`); the launcher and the stack sampler add theirs to the
//! [`StatusDocument`] around it.
//!
//! Every list here is bounded whatever the job's size (ranks listed one by one up
//! to [`MAX_RANKS_LISTED`], rank sets as at most [`RangeSet::MAX_RANGES`] ranges
//! plus a count), so a snapshot of a huge job stays cheap to take and to send.
//!
//! The schema is versioned by [`STATUS_SCHEMA`]: fields may be added within a
//! version; one removed, renamed or given another meaning makes a new version.

use serde::{Deserialize, Serialize};

/// The version of the status document's schema (its `schema` field).
pub const STATUS_SCHEMA: u32 = 1;

/// Most ranks a snapshot lists one by one (from rank 0); the rest are counted in
/// [`RankSummary`] only.
pub const MAX_RANKS_LISTED: u32 = 16_384;

/// Most blocked key waits a snapshot lists.
pub const MAX_KEY_WAITS_LISTED: usize = 1024;

/// The whole status document: the coordinator, its jobs, one job in detail, and
/// what a launcher adds about its workers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusDocument {
    /// [`STATUS_SCHEMA`].
    pub schema: u32,
    /// The coordinator's address.
    pub coordinator: String,
    /// When the document was made (milliseconds since the Unix epoch).
    pub generated_unix_ms: u64,
    /// The coordinator's jobs, in byte order (at most `MAX_JOBS_LISTED`).
    pub jobs: Vec<String>,
    /// False when the coordinator may hold more jobs than listed.
    pub jobs_complete: bool,
    /// The job shown in detail, if it exists.
    pub job: Option<JobSnapshot>,
    /// What the launcher serving this document knows of its workers (the live page
    /// of `rallypoint launch --http`); absent elsewhere.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launcher: Option<LauncherView>,
    /// The ranks' stacks, grouped, when they were captured; absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stacks: Option<StacksView>,
}

/// One job as the coordinator sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobSnapshot {
    pub name: String,
    /// The job incarnation (16 hex digits), once a process named one or reset the job.
    pub incarnation: Option<String>,
    /// Who made the job that incarnation, and when (set with `incarnation`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incarnation_by: Option<IncarnationView>,
    /// Set once the job was aborted: every wait of it has failed with this.
    pub aborted: Option<AbortView>,
    /// The largest world size its ranks stated (`None`: none stated one, as torch's
    /// TCPStore clients do not; then the ranks listed are those known).
    pub world_size: Option<u32>,
    /// Open sessions of the job by protocol (the one asking excluded).
    pub sessions: SessionCounts,
    pub ranks_summary: RankSummary,
    /// Ranks `0..` in order, up to the world size and at most [`MAX_RANKS_LISTED`].
    pub ranks: Vec<RankView>,
    /// Every barrier, all-gather and broadcast generation somebody is blocked in.
    pub waits: Vec<CollectiveWait>,
    /// Requests blocked on keys (get, wait, TCPStore's WAIT and BARRIER), oldest first.
    pub key_waits: Vec<KeyWaitView>,
    /// All blocked key waits, those past [`MAX_KEY_WAITS_LISTED`] included.
    pub key_waits_total: usize,
    /// What is known or inferred about the job's PyTorch processes, when it has
    /// TCPStore clients or torch's keys (docs/TCPSTORE.md).
    pub torch: Option<TorchView>,
}

/// The process that named a job's incarnation first, or reset the job to it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IncarnationView {
    pub host: String,
    pub pid: u32,
    /// Milliseconds since the Unix epoch.
    pub since_unix_ms: u64,
    /// True if it reset the job to this incarnation; false if it was the first to name it.
    pub reset: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AbortView {
    pub by_rank: Option<u32>,
    pub host: String,
    pub pid: u32,
    pub reason: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionCounts {
    /// Native sessions (direct, or carried by a node agent).
    pub native: usize,
    /// PyTorch TCPStore connections.
    pub tcpstore: usize,
    /// Native sessions carried by a node agent (counted in `native` too); the
    /// engine does not know them apart, its server fills this in.
    #[serde(default)]
    pub via_agent: usize,
}

/// Ranks by state. `never_connected` counts the ranks below the world size that
/// never connected (0 while the world size is unknown).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankSummary {
    pub connected: u64,
    pub left: u64,
    pub lost: u64,
    /// Ranks whose worker exited with code 0 (not counted in `lost`).
    #[serde(default)]
    pub finished: u64,
    pub never_connected: u64,
    /// Ranks arrived in a barrier or collective that has not released.
    pub in_collective: u64,
    /// Ranks with a request blocked on keys.
    pub in_key_wait: u64,
    /// Of `connected`, ranks whose connection dropped and that wait for their process
    /// to resume within the reconnect grace (see [`RankView::reconnecting`]).
    #[serde(default)]
    pub reconnecting: u64,
}

/// Where a rank stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RankStatus {
    NeverConnected,
    Connected,
    Left,
    Lost,
    /// Its launcher saw its worker exit with code 0 (see [`RankView::finished`]).
    Finished,
}

/// One rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankView {
    pub rank: u32,
    pub state: RankStatus,
    /// Why it is lost (state `lost` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lost: Option<LossView>,
    /// How it finished (state `finished` only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished: Option<FinishedView>,
    /// Host and pid of its latest session (absent if it never connected).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// Milliseconds since the coordinator last heard from it (absent if never).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_seen_ms_ago: Option<u64>,
    /// Index in the job's `waits` of the collective it has arrived in and waits on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait: Option<usize>,
    /// Index in the job's `key_waits` of its oldest blocked key wait.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_wait: Option<usize>,
    /// Set while the rank (state `connected`) has no live connection and waits for its
    /// process to resume its session within the reconnect grace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reconnecting: Option<ReconnectingView>,
}

/// A rank whose connection dropped, held for its process to resume the session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReconnectingView {
    /// Milliseconds since its (last) connection dropped.
    pub dropped_ms_ago: u64,
    /// Milliseconds until it is counted lost unless it resumes: the end of its
    /// reconnect grace, or of its lease if that comes first.
    pub lost_in_ms: u64,
}

/// A rank whose worker exited with code 0.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FinishedView {
    /// The worker process its launcher started (the rank's own process, or a wrapper's).
    pub worker_pid: u32,
    /// The same, in words.
    pub text: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LossView {
    /// `disconnected` (its last connection dropped without a clean leave),
    /// `lease_expired` (silent for a whole lease) or `exited` (its launcher saw its
    /// process end).
    pub reason: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_ms: Option<u64>,
    /// For `exited`: the worker process its launcher started (its own pid, or a
    /// wrapper's), and the code it exited with or the signal that killed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_pid: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    /// The same, in words.
    pub text: String,
}

/// A generation of a barrier or collective that somebody is blocked in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CollectiveWait {
    /// `barrier`, `all_gather` or `broadcast`.
    pub op: String,
    pub name: String,
    pub generation: u64,
    /// Since the first member arrived.
    pub waited_ms: u64,
    /// How many members it waits for (`None`: a role's, known once every rank connected).
    pub members: Option<u64>,
    pub arrived: u64,
    /// A broadcast's root, which alone is waited for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root: Option<u32>,
    /// Members that have not arrived (for a broadcast, its root if absent).
    pub missing_count: u64,
    /// The first missing members, with what is known of each.
    pub missing: Vec<RankView>,
    /// The missing members after those named.
    pub missing_more: RangeSet,
}

/// A request blocked on keys.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyWaitView {
    pub session: u64,
    /// The session as the coordinator's logs and `status` name it ("session 3.17"):
    /// a page reading `session` as a double may round it.
    #[serde(default)]
    pub session_name: String,
    /// The rank of the session (inferred for a TCPStore client, once known).
    pub rank: Option<u32>,
    pub host: String,
    pub pid: u32,
    /// A PyTorch TCPStore connection.
    pub tcpstore: bool,
    /// `get`, `wait`, `multi_get` or `store_barrier`.
    pub op: String,
    /// The keys waited on (the first 8, as text with non-printable bytes escaped).
    pub keys: Vec<String>,
    pub keys_total: usize,
    /// Keys of those still absent (the first 8).
    pub absent: Vec<String>,
    /// A store barrier's world size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub world_size: Option<i64>,
    pub waited_ms: u64,
}

/// What the coordinator knows or infers of a PyTorch job (docs/TCPSTORE.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TorchView {
    pub tcpstore_connections: usize,
    /// Ranks inferred for TCPStore connections (from the address keys they wrote).
    pub attributed: RangeSet,
    /// The counter at `init/` (processes that connected with a world size).
    pub init_arrivals: Option<String>,
    /// The first 64, in prefix order.
    pub process_groups: Vec<ProcessGroupView>,
    /// The first 64, in key order.
    pub store_barriers: Vec<StoreBarrierView>,
    /// torchrun's c10d rendezvous states found in the store.
    pub rendezvous: Vec<RendezvousView>,
}

/// A process group's address keys (`<prefix><rank>`, written by gloo and NCCL).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessGroupView {
    pub prefix: String,
    /// Ranks that wrote their address key.
    pub written: RangeSet,
    /// Ranks others wait for whose key was never written.
    pub missing: RangeSet,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreBarrierView {
    pub key: String,
    /// The counter at the key (torch's store barriers count arrivals there).
    pub counter: String,
    /// Requests waiting there now.
    pub waiting: usize,
    pub world_size: Option<i64>,
    /// Ranks of the waiting requests, where known.
    pub arrived: RangeSet,
    /// Ranks of the world not waiting there, when every waiter's rank is known.
    pub missing: Option<RangeSet>,
}

/// One torchrun c10d rendezvous (its state at `torch.rendezvous.<run id>`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RendezvousView {
    pub key: String,
    pub run_id: String,
    /// The decoded state; `None` if the value could not be decoded (see `error`).
    pub state: Option<RendezvousState>,
    /// Why the state is `undecodable`, if it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// torch's `_RendezvousState`, as far as it was decoded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RendezvousState {
    pub round: i64,
    pub complete: bool,
    pub closed: bool,
    /// When an incomplete round closes if it waits for more nodes (ms since the epoch).
    pub deadline_unix_ms: Option<i64>,
    /// Nodes of the current round, with their node rank.
    pub participants: Vec<RendezvousNode>,
    /// Nodes waiting for the next round.
    pub wait_list: Vec<RendezvousNode>,
    /// Nodes beyond the maximum, which may join the next round.
    pub redundancy_list: Vec<RendezvousNode>,
}

/// A node of a rendezvous (torch's `_NodeDesc`) and its last heartbeat.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RendezvousNode {
    /// torch's name for it: `<addr>_<pid>_<local id>`.
    pub node: String,
    pub addr: String,
    pub pid: i64,
    pub local_id: i64,
    /// Its rank in the round (participants only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rank: Option<i64>,
    pub last_heartbeat_unix_ms: Option<i64>,
}

/// A set of ranks as ranges `[first, last]` in rank order: at most
/// [`RangeSet::MAX_RANGES`] listed, `count` counting them all.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RangeSet {
    pub ranges: Vec<(u32, u32)>,
    pub count: u64,
}

impl RangeSet {
    pub const MAX_RANGES: usize = 1024;

    /// From disjoint ranges in rank order.
    pub fn collect(ranges: impl IntoIterator<Item = (u32, u32)>) -> Self {
        let mut set = RangeSet::default();
        for (first, last) in ranges {
            if set.ranges.len() < Self::MAX_RANGES {
                set.ranges.push((first, last));
            }
            set.count += u64::from(last - first) + 1;
        }
        set
    }

    /// From ranks in rank order.
    pub fn of_ranks(ranks: impl IntoIterator<Item = u32>) -> Self {
        Self::collect(crate::ranges::runs(ranks))
    }
}

/// What a launcher knows of its workers on its node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LauncherView {
    /// The job as given to the launcher (its attempts run as `job`, `job.restart1`, ...).
    pub job: String,
    /// The coordinator job of the current attempt.
    pub attempt_job: String,
    pub node: Option<u32>,
    pub nnodes: u32,
    pub host: String,
    /// Attempts count from 1.
    pub attempt: u32,
    pub max_restarts: u32,
    /// `running`, `failing` (taking the attempt down), `succeeded`, `failed` or
    /// `restarting`.
    pub state: String,
    pub workers: Vec<WorkerView>,
    /// The failure summary, once the job failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<String>,
}

/// One worker process of a launcher.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerView {
    pub rank: u32,
    pub local_rank: u32,
    pub pid: Option<u32>,
    /// `not_started`, `running`, `exiting` (its end not yet told), or how it ended:
    /// `exited`, `signalled`.
    pub state: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    /// How it ended, in words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
}

/// The ranks' stacks, identical ones folded together, the smallest group first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StacksView {
    pub captured_unix_ms: u64,
    pub groups: Vec<StackGroup>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StackGroup {
    pub ranks: RangeSet,
    /// Ranks whose stacks were captured in all.
    pub of: u64,
    /// Innermost frame first, e.g. `sleep`, `load_batch (data.py:17)`.
    pub frames: Vec<String>,
}
