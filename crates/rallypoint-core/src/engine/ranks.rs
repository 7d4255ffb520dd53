//! Liveness of a job's ranks: who connected, from where, when last heard from,
//! and whether it left cleanly or was lost; and which process (incarnation) holds
//! each rank (module `incarnation` decides who may claim it).

use std::collections::BTreeSet;

use super::by_rank::ByRank;

use crate::{LossReason, Millis, ProcessInfo, RankInfo, RankState, SessionId};

/// Incarnations taken over that are remembered per rank, to refuse them by name if
/// they come back; a rank's holders are few (one per restart of its process).
const PREVIOUS_KEPT: usize = 8;

#[derive(Debug)]
struct Entry {
    host: String,
    pid: u32,
    role: Option<String>,
    /// Open sessions carrying this rank.
    sessions: u32,
    state: RankState,
    last_seen: Millis,
    /// Whether a lease timer is pending for this rank.
    lease_armed: bool,
    /// The process that holds the rank, once a session stating an incarnation claimed it.
    holder: Option<Box<Holder>>,
    /// Incarnations that held the rank and were taken over, oldest first.
    previous: Vec<Takeover>,
}

/// The process (incarnation) that holds a rank, and its open sessions of it.
#[derive(Debug)]
pub(crate) struct Holder {
    /// `incarnation` is always set.
    pub process: ProcessInfo,
    pub since: Millis,
    pub sessions: Vec<SessionId>,
}

/// An incarnation that held a rank, and the process that took the rank over from it.
#[derive(Debug, Clone)]
pub(crate) struct Takeover {
    pub incarnation: u64,
    pub by: ProcessInfo,
    pub at: Millis,
}

#[derive(Debug, Default)]
pub(crate) struct Ranks {
    /// Looked up at every call of the rank: by rank, not hashed.
    entries: ByRank<Entry>,
    /// Ranks currently lost, so that a new generation checks only these.
    lost: BTreeSet<u32>,
    /// Ranks lost so far: (connection dropped, lease expired).
    pub lost_counts: (u64, u64),
}

/// What the caller must do after a liveness change.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Change {
    None,
    /// The rank just became lost: fail everything that needs it.
    Lost,
    /// The rank needs a lease timer at this time.
    ArmLease(Millis),
}

impl Ranks {
    /// A session of `rank` opened; `claim`: the session and its process, if it stated
    /// an incarnation (it becomes the holder, or one more session of the holder).
    #[allow(clippy::too_many_arguments)]
    pub fn connect(
        &mut self,
        rank: u32,
        host: &str,
        pid: u32,
        role: Option<&str>,
        now: Millis,
        lease_ms: u64,
        claim: Option<(SessionId, &ProcessInfo)>,
    ) -> Change {
        let entry = self.entries.get_or_insert_with(rank, || Entry {
            host: String::new(),
            pid: 0,
            role: None,
            sessions: 0,
            state: RankState::Connected,
            last_seen: now,
            lease_armed: false,
            holder: None,
            previous: Vec::new(),
        });
        if let Some((session, process)) = claim {
            match &mut entry.holder {
                Some(holder) if holder.process.incarnation == process.incarnation => holder.sessions.push(session),
                holder => {
                    *holder = Some(Box::new(Holder { process: process.clone(), since: now, sessions: vec![session] }))
                }
            }
        }
        entry.host.clear();
        entry.host.push_str(host);
        entry.pid = pid;
        entry.role = role.map(str::to_owned);
        entry.sessions += 1;
        entry.state = RankState::Connected;
        entry.last_seen = now;
        self.lost.remove(&rank);
        Self::arm(entry, now, lease_ms)
    }

    /// Any request from a session of `rank`: it is alive (again, if its lease had expired).
    pub fn touch(&mut self, rank: u32, now: Millis, lease_ms: u64) -> Change {
        let Some(entry) = self.entries.get_mut(rank) else { return Change::None };
        entry.last_seen = now;
        if matches!(entry.state, RankState::Lost(LossReason::LeaseExpired { .. })) {
            entry.state = RankState::Connected;
            self.lost.remove(&rank);
        }
        Self::arm(entry, now, lease_ms)
    }

    /// Session `session` of `rank` closed; `clean` if it said Leave first.
    pub fn disconnect(&mut self, rank: u32, session: SessionId, clean: bool, now: Millis) -> Change {
        let Some(entry) = self.entries.get_mut(rank) else { return Change::None };
        if let Some(holder) = &mut entry.holder {
            holder.sessions.retain(|&s| s != session);
        }
        entry.sessions = entry.sessions.saturating_sub(1);
        if entry.sessions > 0 {
            return Change::None;
        }
        entry.last_seen = now;
        match entry.state {
            // Already lost by lease: keep the first reason, fail nothing twice.
            RankState::Lost(_) => Change::None,
            _ if clean => {
                entry.state = RankState::Left;
                Change::None
            }
            _ => {
                entry.state = RankState::Lost(LossReason::Disconnected);
                self.lost.insert(rank);
                self.lost_counts.0 += 1;
                Change::Lost
            }
        }
    }

    /// The lease timer of `rank` fired at `now`.
    pub fn lease_check(&mut self, rank: u32, now: Millis, lease_ms: u64) -> Change {
        let Some(entry) = self.entries.get_mut(rank) else { return Change::None };
        entry.lease_armed = false;
        if entry.state != RankState::Connected || entry.sessions == 0 || lease_ms == 0 {
            return Change::None;
        }
        let expires = entry.last_seen.saturating_add(lease_ms);
        if expires > now {
            entry.lease_armed = true;
            return Change::ArmLease(expires);
        }
        entry.state = RankState::Lost(LossReason::LeaseExpired { lease_ms });
        self.lost.insert(rank);
        self.lost_counts.1 += 1;
        Change::Lost
    }

    fn arm(entry: &mut Entry, now: Millis, lease_ms: u64) -> Change {
        if lease_ms == 0 || entry.lease_armed {
            return Change::None;
        }
        entry.lease_armed = true;
        Change::ArmLease(now.saturating_add(lease_ms))
    }

    /// The process holding `rank`, if one claimed it.
    pub fn holder(&self, rank: u32) -> Option<&Holder> {
        self.entries.get(rank)?.holder.as_deref()
    }

    /// The takeover that ended `incarnation`'s hold on `rank`, if one did.
    pub fn taken_from(&self, rank: u32, incarnation: u64) -> Option<&Takeover> {
        self.entries.get(rank)?.previous.iter().rev().find(|t| t.incarnation == incarnation)
    }

    /// Where `rank` stands (never connected if it never did).
    pub fn state(&self, rank: u32) -> RankState {
        self.entries.get(rank).map_or(RankState::NeverConnected, |e| e.state)
    }

    /// `by` takes `rank` over from its holder: the holder's sessions no longer carry
    /// the rank (returned, so that the caller tells them), and the holder is
    /// remembered as taken over. The rank's state is left to `by`'s own connect.
    pub fn take_over(&mut self, rank: u32, by: &ProcessInfo, now: Millis) -> Vec<SessionId> {
        let Some(entry) = self.entries.get_mut(rank) else { return Vec::new() };
        let Some(holder) = entry.holder.take() else { return Vec::new() };
        let sessions = holder.sessions;
        entry.sessions = entry.sessions.saturating_sub(u32::try_from(sessions.len()).unwrap_or(u32::MAX));
        if let Some(incarnation) = holder.process.incarnation {
            if entry.previous.len() == PREVIOUS_KEPT {
                entry.previous.remove(0);
            }
            entry.previous.push(Takeover { incarnation, by: by.clone(), at: now });
        }
        sessions
    }

    /// Ranks ever connected, by state: (connected, left cleanly, lost).
    pub fn tally(&self) -> (usize, usize, usize) {
        let count = |pred: fn(&RankState) -> bool| self.entries.iter().filter(|(_, e)| pred(&e.state)).count();
        (count(|s| *s == RankState::Connected), count(|s| *s == RankState::Left), self.lost.len())
    }

    pub fn lost(&self) -> impl Iterator<Item = u32> + '_ {
        self.lost.iter().copied()
    }

    pub fn role(&self, rank: u32) -> Option<&str> {
        self.entries.get(rank).and_then(|e| e.role.as_deref())
    }

    pub fn has_connected(&self, rank: u32) -> bool {
        self.entries.contains(rank)
    }

    /// The highest rank that ever connected.
    pub fn highest(&self) -> Option<u32> {
        self.entries.iter().map(|(rank, _)| rank).max()
    }

    /// How many ranks ever connected.
    pub fn ever_connected(&self) -> usize {
        self.entries.len()
    }

    /// Ranks that connected with a role other than `role`, or with none, in no order.
    pub fn with_other_role<'a>(&'a self, role: &'a str) -> impl Iterator<Item = u32> + 'a {
        self.entries.iter().filter(move |(_, e)| e.role.as_deref() != Some(role)).map(|(rank, _)| rank)
    }

    /// Everything known about `rank`, for an error message.
    pub fn info(&self, rank: u32, now: Millis) -> RankInfo {
        match self.entries.get(rank) {
            None => RankInfo { rank, host: None, pid: None, state: RankState::NeverConnected, last_seen_ms_ago: None },
            Some(e) => RankInfo {
                rank,
                host: Some(e.host.clone()),
                pid: Some(e.pid),
                state: e.state,
                last_seen_ms_ago: Some(now.saturating_sub(e.last_seen)),
            },
        }
    }
}
