//! One job: its keys, its collectives, its ranks, and whether it was aborted.

use std::collections::BTreeSet;

use crate::counters::{op, JobCounters, KV_OPS};
use crate::{AbortInfo, Config, JobIncarnation, Millis, OpError, SessionId};

use super::collective::{Collectives, Ctx};
use super::ranks::{Change, Ranks};
use super::store::Store;
use super::timers::Timer;
use super::{HashMap, JobId};
use bytes::Bytes;

#[derive(Debug)]
pub(crate) struct Job {
    pub id: JobId,
    pub name: String,
    pub store: Store,
    pub ranks: Ranks,
    pub collectives: Collectives,
    pub aborted: Option<AbortInfo>,
    /// When it was aborted (engine time), if it was.
    pub aborted_at: Millis,
    /// The incarnation the job is at, once a process named one or reset it.
    pub incarnation: Option<Box<JobIncarnation>>,
    /// The job was reset to this newer incarnation (a `Job` of its own): this one only
    /// serves its remaining sessions, failing everything they ask.
    pub superseded: Option<Box<JobIncarnation>>,
    /// Open sessions of this job.
    pub sessions: usize,
    pub idle_since: Millis,
    /// When a rank of the job last connected, or a process of it last asked for
    /// something (a heartbeat, a leave or a status request is not asking): a launcher
    /// takes a job quiet this long, with no output either, for hung.
    pub last_request: Millis,
    /// When a torch stall notice last named each stalled key (first key waited on).
    pub stall_noted: HashMap<Bytes, Millis>,
    /// The prefixes (process groups) of the address keys that torch waits were last
    /// seen blocked on: where a rank's own keys are looked up when its worker ends,
    /// instead of looking at every wait of the job. Each blocked torch wait adds its
    /// own; the stall sweep sets them to those of the waits still blocked.
    pub address_prefixes: BTreeSet<Bytes>,
    /// When the job's `StallSweep` timer is due, if one is: a timer per job, not per
    /// blocked torch wait (otherwise every waiting torch rank puts one in the heap each
    /// round). A sweep timer due at another time is stale.
    pub stall_sweep_at: Option<Millis>,
    /// The largest world size a session of the job stated.
    pub world_size: Option<u32>,
    /// Key-value requests by type (`counters::KV_OPS`).
    pub kv_ops: [u64; KV_OPS.len()],
    /// The id of the job's first incarnation: the order jobs keep in the metrics,
    /// across resets.
    pub first_id: JobId,
}

impl Job {
    pub fn new(id: JobId, name: String, config: &Config, now: Millis) -> Self {
        Job {
            id,
            name,
            store: Store::default(),
            ranks: Ranks::default(),
            collectives: Collectives::new(config.failed_generations_kept, config.limits.max_gather_bytes),
            aborted: None,
            aborted_at: 0,
            incarnation: None,
            superseded: None,
            sessions: 0,
            idle_since: now,
            last_request: now,
            stall_noted: HashMap::default(),
            address_prefixes: BTreeSet::new(),
            stall_sweep_at: None,
            world_size: None,
            kv_ops: [0; KV_OPS.len()],
            first_id: id,
        }
    }

    /// Everything counted for the job (module `counters`).
    /// No key, no rank ever, no abort, no incarnation: nothing a later session of the
    /// job could find, so nothing to keep once the last one closes.
    pub fn holds_nothing(&self) -> bool {
        self.store.len() == 0
            && self.ranks.ever_connected() == 0
            && self.aborted.is_none()
            && self.incarnation.is_none()
            && self.superseded.is_none()
    }

    pub fn counters(&self) -> JobCounters {
        let mut counters = JobCounters { kv_ops: self.kv_ops, ..JobCounters::default() };
        for (i, c) in self.collectives.counters.iter().enumerate() {
            counters.ops[i] = c.clone();
        }
        for (i, c) in self.store.counters.iter().enumerate() {
            counters.ops[op::STORE_BARRIER + i] = c.clone();
        }
        (counters.ranks_lost_disconnected, counters.ranks_lost_lease, counters.ranks_lost_exited) =
            self.ranks.lost_counts;
        counters
    }

    /// A reset made this job the new incarnation of `old`: it counts on from there.
    pub fn continue_counting(&mut self, old: &Job) {
        self.kv_ops = old.kv_ops;
        self.collectives.counters = old.collectives.counters.clone();
        self.store.counters = old.store.counters.clone();
        self.ranks.lost_counts = old.ranks.lost_counts;
        self.first_id = old.first_id;
    }

    pub fn abort_error(&self) -> Option<OpError> {
        self.aborted.as_ref().map(|by| OpError::Aborted { job: self.name.clone(), by: by.clone() })
    }

    /// The error of every operation of a job that was reset.
    pub fn reset_error(&self) -> Option<OpError> {
        self.superseded.as_ref().map(|to| OpError::JobReset { job: self.name.clone(), to: to.clone() })
    }

    /// The job was reset to `to`: fails everything pending; its sessions get the same
    /// error for everything they ask from now on.
    pub fn supersede(&mut self, to: JobIncarnation, ctx: &mut Ctx<'_>) {
        self.superseded = Some(Box::new(to));
        let Some(error) = self.reset_error() else { return };
        self.store.fail_all(&error, ctx.out);
        self.collectives.fail_all(&error, &self.ranks, ctx);
    }

    /// Fails every wait of `session` with `error` (its rank was taken over). Its
    /// arrivals stay counted: they happened.
    pub fn fail_session(&mut self, session: SessionId, error: &OpError, ctx: &mut Ctx<'_>) {
        self.store.fail_session(session, error, ctx.out);
        self.collectives.fail_session(session, error, ctx);
    }

    /// Records the abort and fails everything pending in the job.
    pub fn abort(&mut self, by: AbortInfo, ctx: &mut Ctx<'_>) {
        if self.aborted.is_some() {
            return;
        }
        self.aborted = Some(by);
        self.aborted_at = ctx.now;
        let Some(error) = self.abort_error() else { return };
        self.store.fail_all(&error, ctx.out);
        self.collectives.fail_all(&error, &self.ranks, ctx);
    }

    /// Applies a liveness change of `rank`.
    pub fn apply(&mut self, rank: u32, change: Change, ctx: &mut Ctx<'_>) {
        match change {
            Change::None => {}
            Change::ArmLease(at) => ctx.timers.schedule(at, Timer::Lease { job: self.id, rank }),
            Change::Lost => self.collectives.rank_lost(rank, &self.ranks, ctx),
        }
    }
}
