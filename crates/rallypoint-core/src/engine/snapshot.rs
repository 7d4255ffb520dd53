//! The engine's state as data: a job's snapshot (`rallypoint status --json`, the
//! live page) and every job's counters (the metrics endpoint). Taken under the
//! caller's lock, so each costs what the job holds (its ranks up to
//! [`MAX_RANKS_LISTED`], its blocked waits, its sessions), never a claimed world
//! size, and copies nothing large (values are not part of it).

use std::collections::{BTreeMap, BTreeSet};

use crate::counters::{JobCounters, WAIT_OPS};
use crate::snapshot::{
    AbortView, FinishedView, IncarnationView, JobSnapshot, KeyWaitView, LossView, RankStatus, RankSummary, RankView,
    SessionCounts, MAX_KEY_WAITS_LISTED, MAX_RANKS_LISTED,
};
use crate::{Exit, Identity, Incarnation, LossReason, Millis, RankInfo, RankState, SessionId};

use super::job::Job;
use super::store::WaitKind;
use super::{resume, torch, Engine, JobId};

/// Keys of a blocked wait shown in a snapshot; the rest are counted.
const KEYS_SHOWN: usize = 8;

/// One job's counts for the metrics endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobMetrics {
    pub name: String,
    /// Jobs created earlier come first (a reset keeps the job's place).
    pub order: u64,
    pub sessions: SessionCounts,
    pub ranks: RankSummary,
    pub counters: JobCounters,
}

/// A rank as a snapshot shows it.
pub(crate) fn rank_view(info: &RankInfo, role: Option<&str>) -> RankView {
    let mut finished = None;
    let (state, lost) = match info.state {
        RankState::NeverConnected => (RankStatus::NeverConnected, None),
        RankState::Connected => (RankStatus::Connected, None),
        RankState::Left => (RankStatus::Left, None),
        RankState::Finished { pid } => {
            let text = format!("worker pid {pid} exited with code 0");
            finished = Some(FinishedView { worker_pid: pid, text });
            (RankStatus::Finished, None)
        }
        RankState::Lost(reason) => {
            let (mut view, text) = (LossView::default(), reason.to_string());
            match reason {
                LossReason::Disconnected => view.reason = "disconnected".into(),
                LossReason::LeaseExpired { lease_ms } => {
                    (view.reason, view.lease_ms) = ("lease_expired".into(), Some(lease_ms));
                }
                LossReason::Exited { pid, exit } => {
                    (view.reason, view.worker_pid) = ("exited".into(), Some(pid));
                    match exit {
                        Exit::Code(code) => view.exit_code = Some(code),
                        Exit::Signal(sig) => view.signal = Some(sig),
                    }
                }
            }
            (RankStatus::Lost, Some(LossView { text, ..view }))
        }
    };
    RankView {
        rank: info.rank,
        state,
        lost,
        finished,
        host: info.host.clone(),
        pid: info.pid,
        role: role.map(str::to_owned),
        last_seen_ms_ago: info.last_seen_ms_ago,
        wait: None,
        key_wait: None,
        reconnecting: None,
    }
}

fn wait_op(kind: WaitKind) -> &'static str {
    WAIT_OPS[super::super::counters::op::STORE_BARRIER + kind.counted()]
}

impl Engine {
    /// A snapshot of job `job` at `now`, or None if there is no such job.
    pub fn snapshot(&self, job: &str, now: Millis) -> Option<JobSnapshot> {
        let id = *self.job_ids.get(job)?;
        self.snapshot_of(id, None, now)
    }

    /// The names of the jobs the coordinator holds (as `Request::Jobs` lists them, for
    /// nobody in particular), and whether the list is complete.
    pub fn job_list(&self) -> (Vec<String>, bool) {
        let mut names: Vec<String> = self
            .jobs
            .values()
            .filter(|job| job.sessions > 0 || job.store.len() > 0 || job.ranks.ever_connected() > 0)
            .filter(|job| job.superseded.is_none())
            .map(|job| job.name.clone())
            .collect();
        names.sort_unstable();
        let complete = names.len() <= crate::MAX_JOBS_LISTED;
        names.truncate(crate::MAX_JOBS_LISTED);
        (names, complete)
    }

    /// Every current job's counts at `now`, oldest job first.
    pub fn metrics(&self, now: Millis) -> Vec<JobMetrics> {
        let mut sessions: BTreeMap<JobId, SessionCounts> = BTreeMap::new();
        // Jobs with a session in its reconnect grace: only theirs are looked at closer.
        let mut detached: BTreeSet<JobId> = BTreeSet::new();
        for s in self.sessions.values() {
            let counts = sessions.entry(s.job).or_default();
            if s.torch {
                counts.tcpstore += 1;
            } else {
                counts.native += 1;
            }
            counts.via_agent += usize::from(s.via_agent);
            if s.detached() {
                detached.insert(s.job);
            }
        }
        let mut out: Vec<JobMetrics> = self
            .jobs
            .values()
            .filter(|job| job.superseded.is_none())
            .map(|job| {
                let mut ranks = summary(job);
                if detached.contains(&job.id) {
                    ranks.reconnecting =
                        resume::reconnecting(job, &self.sessions, self.config.lease_ms, now).len() as u64;
                }
                JobMetrics {
                    name: job.name.clone(),
                    order: job.first_id,
                    sessions: sessions.get(&job.id).cloned().unwrap_or_default(),
                    ranks,
                    counters: job.counters(),
                }
            })
            .collect();
        out.sort_by_key(|m| m.order);
        out
    }

    /// The snapshot of job `id`, as seen by everyone but `asking`.
    pub(crate) fn snapshot_of(&self, id: JobId, asking: Option<SessionId>, now: Millis) -> Option<JobSnapshot> {
        let job = self.jobs.get(&id)?;
        let mut members: Vec<(SessionId, &Identity, bool)> = self
            .sessions
            .iter()
            .filter(|(sid, s)| s.job == id && Some(**sid) != asking)
            .map(|(sid, s)| (*sid, &s.identity, s.torch))
            .collect();
        members.sort_by_key(|(sid, _, _)| *sid);
        let sessions = SessionCounts {
            native: members.iter().filter(|(_, _, t)| !t).count(),
            tcpstore: members.iter().filter(|(_, _, t)| *t).count(),
            via_agent: members.iter().filter(|(sid, _, _)| self.sessions.get(sid).is_some_and(|s| s.via_agent)).count(),
        };
        let identity_of: BTreeMap<SessionId, (&Identity, bool)> =
            members.iter().map(|(s, i, t)| (*s, (*i, *t))).collect();

        let reconnecting = resume::reconnecting(job, &self.sessions, self.config.lease_ms, now);
        let mut blocked = job.collectives.blocked(&job.ranks, now);
        for view in blocked.iter_mut().flat_map(|b| b.wait.missing.iter_mut()) {
            view.reconnecting = reconnecting.get(&view.rank).copied();
        }
        let mut wait_of: BTreeMap<u32, usize> = BTreeMap::new();
        for (index, b) in blocked.iter().enumerate() {
            for &rank in &b.arrived {
                wait_of.entry(rank).or_insert(index);
            }
        }

        let mut key_waits: Vec<(Millis, KeyWaitView)> = Vec::new();
        let mut key_waits_total = 0;
        let mut key_wait_ranks: BTreeSet<u32> = BTreeSet::new();
        for ((session, _), wait) in job.store.waits() {
            let Some(&(identity, tcpstore)) = identity_of.get(session) else { continue };
            key_waits_total += 1;
            if let Some(rank) = identity.rank {
                key_wait_ranks.insert(rank);
            }
            let world_size = match wait.kind {
                WaitKind::Barrier { world_size } => Some(world_size),
                _ => None,
            };
            let absent = match wait.kind {
                WaitKind::Barrier { .. } => Vec::new(),
                _ => job.store.absent(&wait.keys),
            };
            key_waits.push((
                wait.started,
                KeyWaitView {
                    session: session.0,
                    session_name: session.to_string(),
                    rank: identity.rank,
                    host: identity.host.clone(),
                    pid: identity.pid,
                    tcpstore,
                    op: wait_op(wait.kind).to_owned(),
                    keys: wait.keys.iter().take(KEYS_SHOWN).map(|k| torch::text(k)).collect(),
                    keys_total: wait.keys.len(),
                    absent: absent.iter().take(KEYS_SHOWN).map(|k| torch::text(k)).collect(),
                    world_size,
                    waited_ms: now.saturating_sub(wait.started),
                },
            ));
        }
        key_waits.sort_by_key(|(started, w)| (*started, w.session));
        key_waits.truncate(MAX_KEY_WAITS_LISTED);
        let key_waits: Vec<KeyWaitView> = key_waits.into_iter().map(|(_, w)| w).collect();
        let mut key_wait_of: BTreeMap<u32, usize> = BTreeMap::new();
        for (index, w) in key_waits.iter().enumerate() {
            if let Some(rank) = w.rank {
                key_wait_of.entry(rank).or_insert(index);
            }
        }

        let torch = torch::view(job, &members);
        let world = listed_world(job, torch.as_ref());
        let ranks: Vec<RankView> = (0..world.min(MAX_RANKS_LISTED))
            .map(|rank| {
                let mut view = rank_view(&job.ranks.info(rank, now), job.ranks.role(rank));
                view.wait = wait_of.get(&rank).copied();
                view.key_wait = key_wait_of.get(&rank).copied();
                view.reconnecting = reconnecting.get(&rank).copied();
                view
            })
            .collect();
        let mut ranks_summary = summary(job);
        ranks_summary.in_collective = wait_of.len() as u64;
        ranks_summary.in_key_wait = key_wait_ranks.len() as u64;
        ranks_summary.reconnecting = reconnecting.len() as u64;
        Some(JobSnapshot {
            name: job.name.clone(),
            incarnation: job.incarnation.as_ref().map(|i| Incarnation(i.incarnation).to_string()),
            incarnation_by: job.incarnation.as_ref().map(|i| IncarnationView {
                host: i.by.host.clone(),
                pid: i.by.pid,
                since_unix_ms: i.since_unix_ms,
                reset: i.reset,
            }),
            aborted: job.aborted.as_ref().map(|a| AbortView {
                by_rank: a.by_rank,
                host: a.host.clone(),
                pid: a.pid,
                reason: a.reason.clone(),
            }),
            world_size: job.world_size,
            sessions,
            ranks_summary,
            ranks,
            waits: blocked.into_iter().map(|b| b.wait).collect(),
            key_waits,
            key_waits_total,
            torch,
        })
    }
}

/// Ranks by state; `never_connected` below the stated world size.
pub(super) fn summary(job: &Job) -> RankSummary {
    let (connected, left, finished, lost) = job.ranks.tally();
    // A rank reported ended before it connected counts as lost (or finished), not as
    // never connected.
    let seen = job.ranks.ever_connected() + job.ranks.ended_unconnected();
    let never_connected = job.world_size.map_or(0, |w| u64::from(w).saturating_sub(seen as u64));
    RankSummary {
        connected: connected as u64,
        left: left as u64,
        lost: lost as u64,
        finished: finished as u64,
        never_connected,
        in_collective: 0,
        in_key_wait: 0,
        reconnecting: 0,
    }
}

/// How many ranks a snapshot lists: the stated world size, else (a torch job) one
/// past the highest rank anything names.
fn listed_world(job: &Job, torch: Option<&crate::snapshot::TorchView>) -> u32 {
    if let Some(world) = job.world_size {
        return world;
    }
    let mut highest = job.ranks.highest();
    let mut see = |rank: u32| highest = Some(highest.map_or(rank, |h: u32| h.max(rank)));
    if let Some(torch) = torch {
        for group in &torch.process_groups {
            for set in [&group.written, &group.missing] {
                if let Some(&(_, last)) = set.ranges.last() {
                    see(last);
                }
            }
        }
        for barrier in &torch.store_barriers {
            if let Some(world) = barrier.world_size.and_then(|w| u32::try_from(w).ok()).filter(|&w| w > 0) {
                see(world - 1);
            }
        }
    }
    highest.map_or(0, |h| h.saturating_add(1))
}
