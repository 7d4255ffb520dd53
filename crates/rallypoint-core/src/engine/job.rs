//! One job: its keys, its collectives, its ranks, and whether it was aborted.

use crate::{AbortInfo, Config, Millis, OpError, Outgoing};

use super::collective::{Collectives, Ctx};
use super::ranks::{Change, Ranks};
use super::store::{Store, WaitId};
use super::timers::Timer;
use super::{HashMap, JobId};
use crate::Reply;
use bytes::Bytes;

#[derive(Debug)]
pub(crate) struct Job {
    pub id: JobId,
    pub name: String,
    pub store: Store,
    pub ranks: Ranks,
    pub collectives: Collectives,
    pub aborted: Option<AbortInfo>,
    /// Open sessions of this job.
    pub sessions: usize,
    pub idle_since: Millis,
    /// When a torch stall notice last named each stalled key (first key waited on).
    pub stall_noted: HashMap<Bytes, Millis>,
    /// When the job's `StallSweep` timer is due, if one is: a timer per job, not per
    /// blocked torch wait (otherwise every waiting torch rank puts one in the heap each
    /// round). A sweep timer due at another time is stale.
    pub stall_sweep_at: Option<Millis>,
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
            sessions: 0,
            idle_since: now,
            stall_noted: HashMap::default(),
            stall_sweep_at: None,
        }
    }

    pub fn abort_error(&self) -> Option<OpError> {
        self.aborted.as_ref().map(|by| OpError::Aborted { job: self.name.clone(), by: by.clone() })
    }

    /// Records the abort and fails everything pending in the job.
    pub fn abort(&mut self, by: AbortInfo, ctx: &mut Ctx<'_>) {
        if self.aborted.is_some() {
            return;
        }
        self.aborted = Some(by);
        let Some(error) = self.abort_error() else { return };
        let mut done = Vec::new();
        self.store.fail_all(&error, &mut done);
        send_key_replies(done, ctx.out);
        self.collectives.fail_all(&error, ctx);
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

pub(crate) fn send_key_replies(done: Vec<(WaitId, Reply)>, out: &mut Vec<Outgoing>) {
    out.extend(done.into_iter().map(|((session, request_id), reply)| Outgoing { session, request_id, reply }));
}
