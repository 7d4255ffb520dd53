//! Limits and timings of the engine. Every limit is checked before any state changes.

/// Size limits on what a client may store or send. Defaults match PyTorch's libuv
/// TCPStore server so that anything torch accepts, rallypoint accepts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Longest key, in bytes.
    pub max_key_len: usize,
    /// Longest value, in bytes (also each all-gather/broadcast payload).
    pub max_value_len: usize,
    /// Most keys in one check/wait/multi-get/multi-set.
    pub max_keys_per_op: usize,
    /// Largest world size a session may state (also a torch store barrier's), and most
    /// ranks in one member list. The engine's memory and work grow with the ranks that
    /// actually connect, never with a claimed world size; this bounds what one client
    /// may claim (`rallypoint serve --max-world-size`).
    pub max_world_size: u32,
    /// Longest job, barrier, role or host name, and abort reason, in bytes.
    pub max_name_len: usize,
    /// Largest sum of one all-gather generation's values: the reply every member gets.
    pub max_gather_bytes: usize,
    /// Largest sum of the keys and values one request carries (a multi-set's entries, a
    /// wait's keys): the limits above alone let one request announce `max_keys_per_op`
    /// values of `max_value_len` each. The codecs check it as lengths arrive, before
    /// buffering the rest. A request of one key and at most two values within the
    /// limits above is accepted whatever this says, so raising `max_value_len` alone
    /// keeps set and compare_set working. torch's server has no such limit; the
    /// default, 64 MiB (eight values of the largest size), is far above what torch
    /// and torchelastic put in one request (rank assignments, addresses, ids).
    pub max_request_len: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_key_len: 8192,
            max_value_len: 8 << 20,
            max_keys_per_op: 131_072,
            max_world_size: 1 << 20,
            max_name_len: 1024,
            max_gather_bytes: 1 << 30,
            max_request_len: 64 << 20,
        }
    }
}

/// How many replies each session remembers for requests a client re-sends after a
/// cut connection (docs/PROTOCOL.md, section 14). Only replies of requests that change
/// something (an arrival, an `add`, a `set`...) are kept: a read is answered again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplyCache {
    /// Most replies kept per session: more than a client has in flight at once (a
    /// reply lost with a connection was in flight). 32 bytes each, but for values.
    /// Past it, the oldest are dropped down to seven eighths of it.
    pub max_replies: usize,
    /// A reply older than this is dropped: a client resumes within a lease or not at all.
    pub max_age_ms: u64,
    /// Most bytes of values (a broadcast's, an all-gather's, a popped item) kept per
    /// session; a value shared by many sessions counts for each.
    pub max_bytes: usize,
}

impl Default for ReplyCache {
    fn default() -> Self {
        ReplyCache { max_replies: 256, max_age_ms: 60_000, max_bytes: 16 << 20 }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub limits: Limits,
    /// A rank whose sessions send nothing (requests or heartbeats) for this long is lost.
    /// Clients heartbeat at a third of it. 0 disables lease expiry.
    pub lease_ms: u64,
    /// A job with no session for this long is forgotten (keys, barriers, ranks).
    pub job_idle_ttl_ms: u64,
    /// Failed generations remembered per collective, so that late arrivals get the same error.
    pub failed_generations_kept: usize,
    /// When a session's connection drops without a clean leave and the coordinator
    /// cannot tell whether its process is gone, the session (and its rank) stays for
    /// this long waiting for the client to resume it; after that the rank is lost.
    /// 0: lost at once. Never longer than the lease. Only sessions that stated an
    /// incarnation can resume; the others are closed at once.
    pub reconnect_grace_ms: u64,
    /// Replies remembered per session for re-sent requests.
    pub reply_cache: ReplyCache,
    /// Wall-clock time (milliseconds since the Unix epoch) of the engine's time 0: the
    /// engine reads no clock, and errors show wall-clock times ("held since ...").
    pub epoch_unix_ms: u64,
}

impl Config {
    /// The reconnect grace in effect: at most the lease (a rank silent for a whole
    /// lease is lost anyway).
    pub fn grace_ms(&self) -> u64 {
        if self.lease_ms > 0 {
            self.reconnect_grace_ms.min(self.lease_ms)
        } else {
            self.reconnect_grace_ms
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            limits: Limits::default(),
            lease_ms: 15_000,
            job_idle_ttl_ms: 3_600_000,
            failed_generations_kept: 64,
            reconnect_grace_ms: 1_000,
            reply_cache: ReplyCache::default(),
            epoch_unix_ms: 0,
        }
    }
}
