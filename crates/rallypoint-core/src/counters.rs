//! What a job did, counted by the engine whatever protocol carried it: arrivals,
//! releases, timeouts and peer losses per barrier or collective kind, how long
//! waits lasted, ranks lost, key-value operations by type. The metrics endpoint
//! (docs/METRICS.md) exposes them; each part of the engine counts its own
//! (collectives, the store, rank liveness) and `Engine::metrics` gathers them.
//!
//! Counters follow the job's name through resets (a new incarnation goes on
//! counting where the old one stopped), and go with the job when it is forgotten.

use crate::Millis;

/// Upper bounds (inclusive, in milliseconds) of the wait-time histogram's buckets;
/// a last bucket takes what is longer.
pub const WAIT_BUCKETS_MS: [u64; 13] =
    [1, 5, 10, 50, 100, 500, 1_000, 5_000, 10_000, 30_000, 60_000, 300_000, 1_800_000];

/// The operations waits are counted for, in the order of [`JobCounters::ops`].
pub const WAIT_OPS: [&str; 7] = ["barrier", "all_gather", "broadcast", "store_barrier", "get", "wait", "multi_get"];

/// Key-value operations, in the order of [`JobCounters::kv_ops`].
pub const KV_OPS: [&str; 16] = [
    "set",
    "get",
    "add",
    "compare_set",
    "append",
    "delete",
    "check",
    "wait",
    "multi_get",
    "multi_set",
    "num_keys",
    "list_keys",
    "queue_push",
    "queue_pop",
    "queue_len",
    "cancel_wait",
];

/// How long waits lasted: counts per bucket of [`WAIT_BUCKETS_MS`] (not cumulative;
/// the last entry counts the longer ones), their number and their sum.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WaitHistogram {
    pub buckets: [u64; WAIT_BUCKETS_MS.len() + 1],
    pub count: u64,
    pub sum_ms: u64,
}

impl WaitHistogram {
    pub fn observe(&mut self, ms: Millis) {
        let bucket = WAIT_BUCKETS_MS.iter().position(|&bound| ms <= bound).unwrap_or(WAIT_BUCKETS_MS.len());
        self.buckets[bucket] += 1;
        self.count += 1;
        self.sum_ms = self.sum_ms.saturating_add(ms);
    }
}

/// One operation's counts. What each means depends on the operation (docs/METRICS.md):
/// for a barrier, all-gather or broadcast, `arrivals` counts calls, `releases`,
/// `timeouts` and `peer_lost` count generations, and `wait` how long each released
/// generation waited from its first arrival; for a TCPStore store barrier every one
/// counts calls; for get, wait and multi-get, `timeouts` counts requests that timed
/// out and `wait` how long the ones that had to wait did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OpCounters {
    pub arrivals: u64,
    pub releases: u64,
    pub timeouts: u64,
    pub peer_lost: u64,
    pub wait: WaitHistogram,
}

/// Everything counted for one job.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JobCounters {
    /// In the order of [`WAIT_OPS`].
    pub ops: [OpCounters; WAIT_OPS.len()],
    /// Ranks lost because their last connection dropped without a clean leave.
    pub ranks_lost_disconnected: u64,
    /// Ranks lost because they were silent for a whole lease.
    pub ranks_lost_lease: u64,
    /// Ranks lost because their launcher saw their process end.
    pub ranks_lost_exited: u64,
    /// In the order of [`KV_OPS`].
    pub kv_ops: [u64; KV_OPS.len()],
}

/// Index in [`WAIT_OPS`].
pub(crate) mod op {
    pub const BARRIER: usize = 0;
    pub const ALL_GATHER: usize = 1;
    pub const BROADCAST: usize = 2;
    pub const STORE_BARRIER: usize = 3;
    pub const GET: usize = 4;
    pub const WAIT: usize = 5;
    pub const MULTI_GET: usize = 6;
}

/// Index in [`KV_OPS`] of a request's name, if it is a key-value operation.
pub(crate) fn kv_op(name: &str) -> Option<usize> {
    KV_OPS.iter().position(|&op| op == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_histogram_puts_each_wait_in_the_first_bucket_that_holds_it() {
        let mut h = WaitHistogram::default();
        for ms in [0, 1, 2, 1_800_000, 1_800_001] {
            h.observe(ms);
        }
        assert_eq!((h.buckets[0], h.buckets[1], h.buckets[12], h.buckets[13]), (2, 1, 1, 1));
        assert_eq!((h.count, h.sum_ms), (5, 3_600_004));
    }
}
