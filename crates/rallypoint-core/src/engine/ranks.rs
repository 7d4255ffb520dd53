//! Liveness of a job's ranks: who connected, from where, when last heard from,
//! and whether it left cleanly or was lost; and which process (incarnation) holds
//! each rank (module `incarnation` decides who may claim it).

use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;

use smallvec::SmallVec;

use super::by_rank::ByRank;

use super::HashMap;
use crate::{Exit, LossReason, Millis, ProcessInfo, RankInfo, RankState, SessionId};

/// Incarnations taken over that are remembered per rank, to refuse them by name if
/// they come back; a rank's holders are few (one per restart of its process).
const PREVIOUS_KEPT: usize = 8;

#[derive(Debug)]
struct Entry {
    host: Arc<str>,
    pid: u32,
    role: Option<Arc<str>>,
    /// Open sessions carrying this rank.
    sessions: u32,
    state: RankState,
    /// The process that holds the rank, once a session stating an incarnation claimed it.
    holder: Option<Box<Holder>>,
    /// Incarnations that held the rank and were taken over, oldest first. Boxed:
    /// few ranks are ever taken over, and every rank has an entry.
    #[allow(clippy::box_collection, reason = "a field of 8 bytes in every rank's entry, not 24")]
    previous: Option<Box<Vec<Takeover>>>,
}

/// The process (incarnation) that holds a rank, and its open sessions of it.
#[derive(Debug)]
pub(crate) struct Holder {
    pub pid: u32,
    pub host: Arc<str>,
    pub incarnation: u64,
    pub since: Millis,
    /// One per connection of the process; rarely more than two.
    pub sessions: SmallVec<[SessionId; 2]>,
}

impl Holder {
    pub fn process(&self) -> ProcessInfo {
        ProcessInfo { pid: self.pid, host: self.host.to_string(), incarnation: Some(self.incarnation) }
    }
}

/// Names many ranks share (hosts, roles), held once per job: ranks are many, the
/// hosts they run on and the roles they play few.
#[derive(Debug, Default)]
struct Names(HashSet<Arc<str>, foldhash::fast::RandomState>);

impl Names {
    fn get(&mut self, name: &str) -> Arc<str> {
        if let Some(held) = self.0.get(name) {
            return Arc::clone(held);
        }
        let name: Arc<str> = Arc::from(name);
        self.0.insert(Arc::clone(&name));
        name
    }

    /// A rank no longer uses `name`: forgotten once no rank does, so that names
    /// a client makes up do not pile up.
    fn put(&mut self, name: Arc<str>) {
        // Held here and by `name` alone.
        if Arc::strong_count(&name) == 2 {
            self.0.remove(&*name);
        }
    }
}

/// An incarnation that held a rank, and the process that took the rank over from it.
#[derive(Debug, Clone)]
pub(crate) struct Takeover {
    pub incarnation: u64,
    pub by: ProcessInfo,
    pub at: Millis,
}

/// What every request of a rank touches (see [`Ranks::touch`]), apart from its
/// [`Entry`]: 16 bytes a rank, so that a node's run of calls walks a few cache lines
/// rather than a cold entry per rank. Held for exactly the ranks with an entry.
#[derive(Debug, Clone, Copy)]
struct Seen {
    at: Millis,
    /// Whether a lease timer is pending for this rank.
    lease_armed: bool,
    /// The rank's state is `Lost(LeaseExpired)`: a request makes it connected again.
    lease_lost: bool,
}

#[derive(Debug, Default)]
pub(crate) struct Ranks {
    /// Looked up at every call of the rank: by rank, not hashed.
    entries: ByRank<Entry>,
    /// When each rank was last heard from, and its lease (see [`Seen`]).
    seen: ByRank<Seen>,
    /// Ranks currently lost or finished (gone either way: nothing that needs them
    /// can complete), so that a new generation checks only these.
    lost: BTreeSet<u32>,
    /// Ranks whose worker was reported to exit with code 0 while a session of the
    /// rank was still open (a child of the worker holds it, or its close is yet to
    /// be read): the worker's pid. The rank finishes when its last session closes.
    finishing: HashMap<u32, u32>,
    /// Ranks whose launcher reported their worker's end before they ever connected
    /// (a crash at start): lost, with what the launcher said of the process. At most
    /// one per rank below the job's world size.
    ended: HashMap<u32, Ended>,
    /// Ranks lost so far: (connection dropped, lease expired, process exited), each
    /// counted by the first reason it was lost for. A rank that finished is not lost.
    pub lost_counts: (u64, u64, u64),
    names: Names,
}

/// A worker that ended before its rank connected, as its launcher told.
#[derive(Debug)]
struct Ended {
    host: Arc<str>,
    pid: u32,
    exit: Exit,
    /// When the launcher's word came.
    at: Millis,
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
    /// A session of `rank` opened, of process `pid` on `host`; `claim`: the session
    /// and its process's incarnation, if it stated one (the process becomes the
    /// holder, or the session one more of the holder's).
    #[allow(clippy::too_many_arguments)]
    pub fn connect(
        &mut self,
        rank: u32,
        host: &str,
        pid: u32,
        role: Option<&str>,
        now: Millis,
        lease_ms: u64,
        claim: Option<(SessionId, u64)>,
    ) -> Change {
        if let Some(ended) = self.ended.remove(&rank) {
            // Reported ended, yet here: a process of the rank after all (a launcher's
            // word about a wrapper whose child lives on). What it says now stands.
            self.names.put(ended.host);
        }
        let names = &mut self.names;
        let entry = self.entries.get_or_insert_with(rank, || Entry {
            host: names.get(host),
            pid: 0,
            role: role.map(|role| names.get(role)),
            sessions: 0,
            state: RankState::Connected,
            holder: None,
            previous: None,
        });
        let seen = self.seen.get_or_insert_with(rank, || Seen { at: now, lease_armed: false, lease_lost: false });
        if *entry.host != *host {
            let old = std::mem::replace(&mut entry.host, names.get(host));
            names.put(old);
        }
        if entry.role.as_deref() != role {
            if let Some(old) = std::mem::replace(&mut entry.role, role.map(|role| names.get(role))) {
                names.put(old);
            }
        }
        if let Some((session, incarnation)) = claim {
            match &mut entry.holder {
                Some(holder) if holder.incarnation == incarnation => holder.sessions.push(session),
                holder => {
                    let new = Box::new(Holder {
                        pid,
                        host: Arc::clone(&entry.host),
                        incarnation,
                        since: now,
                        sessions: SmallVec::from_elem(session, 1),
                    });
                    if let Some(old) = holder.replace(new) {
                        names.put(old.host);
                    }
                }
            }
        }
        entry.pid = pid;
        entry.sessions += 1;
        entry.state = RankState::Connected;
        (seen.at, seen.lease_lost) = (now, false);
        self.lost.remove(&rank);
        Self::arm(seen, now, lease_ms)
    }

    /// Any request from a session of `rank`: it is alive (again, if its lease had expired).
    #[inline]
    pub fn touch(&mut self, rank: u32, now: Millis, lease_ms: u64) -> Change {
        let Some(seen) = self.seen.get_mut(rank) else { return Change::None };
        seen.at = now;
        if seen.lease_lost {
            seen.lease_lost = false;
            if let Some(entry) = self.entries.get_mut(rank) {
                entry.state = RankState::Connected;
            }
            self.lost.remove(&rank);
        }
        Self::arm(seen, now, lease_ms)
    }

    /// Session `session` of `rank` closed; `clean` if it said Leave first.
    pub fn disconnect(&mut self, rank: u32, session: SessionId, clean: bool, now: Millis) -> Change {
        let Some(entry) = self.entries.get_mut(rank) else { return Change::None };
        if let Some(holder) = &mut entry.holder {
            holder.sessions.retain(|s| *s != session);
        }
        entry.sessions = entry.sessions.saturating_sub(1);
        if entry.sessions > 0 {
            return Change::None;
        }
        if let Some(seen) = self.seen.get_mut(rank) {
            seen.at = now;
        }
        match (entry.state, self.finishing.remove(&rank)) {
            // Already lost by lease: keep the first reason, fail nothing twice.
            (RankState::Lost(_) | RankState::Finished { .. }, _) => Change::None,
            // Its worker had exited with code 0: this was the rank's last session.
            (_, Some(pid)) => {
                entry.state = RankState::Finished { pid };
                self.lost.insert(rank);
                Change::Lost
            }
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
        let (Some(entry), Some(seen)) = (self.entries.get_mut(rank), self.seen.get_mut(rank)) else {
            return Change::None;
        };
        seen.lease_armed = false;
        if entry.state != RankState::Connected || entry.sessions == 0 || lease_ms == 0 {
            return Change::None;
        }
        let expires = seen.at.saturating_add(lease_ms);
        if expires > now {
            seen.lease_armed = true;
            return Change::ArmLease(expires);
        }
        entry.state = RankState::Lost(LossReason::LeaseExpired { lease_ms });
        seen.lease_lost = true;
        self.lost.insert(rank);
        self.lost_counts.1 += 1;
        Change::Lost
    }

    /// The launcher of `rank` saw its worker process (`pid` on `host`) end with
    /// `exit`: the rank is lost whatever its sessions say, since a connection may
    /// outlive its process (held by a child) or wait out a reconnect grace until the
    /// coordinator hears of the end. A rank already lost by lease keeps that reason
    /// (it came first); one lost by its dropped connection takes this one, which says
    /// why, and fails nothing twice. A rank that never connected is lost too, named
    /// by the worker's host and pid (the process that would have connected). A rank
    /// lost now was last known alive now, as one whose connection just dropped: the
    /// time of its loss is when the coordinator learnt of it.
    ///
    /// A worker that exited with code 0 finished: its rank is gone to its peers as a
    /// lost one is (whatever still needs it fails at once, rather than waiting out its
    /// timeout for a rank that will never come), but not counted a loss. While a
    /// session of the rank is still open (a child holds it, or its clean close is yet
    /// to be read) the rank finishes at that session's close instead; a rank whose
    /// connection had dropped (torch's processes leave that way when done) is
    /// finished rather than lost.
    pub fn exited(&mut self, rank: u32, host: &str, pid: u32, exit: Exit, now: Millis) -> Change {
        let reason = LossReason::Exited { pid, exit };
        let Some(entry) = self.entries.get_mut(rank) else {
            if self.ended.contains_key(&rank) {
                return Change::None;
            }
            self.ended.insert(rank, Ended { host: self.names.get(host), pid, exit, at: now });
            self.lost.insert(rank);
            if !exit.success() {
                self.lost_counts.2 += 1;
            }
            return Change::Lost;
        };
        if exit.success() {
            return match entry.state {
                RankState::Connected if entry.sessions > 0 => {
                    self.finishing.insert(rank, pid);
                    Change::None
                }
                RankState::Lost(LossReason::Disconnected) => {
                    entry.state = RankState::Finished { pid };
                    Change::None
                }
                RankState::Lost(_) | RankState::Finished { .. } => Change::None,
                RankState::NeverConnected | RankState::Connected | RankState::Left => {
                    entry.state = RankState::Finished { pid };
                    // Done when the coordinator learnt of it, as a loss is.
                    if let Some(seen) = self.seen.get_mut(rank) {
                        seen.at = now;
                    }
                    self.lost.insert(rank);
                    Change::Lost
                }
            };
        }
        self.finishing.remove(&rank);
        match entry.state {
            RankState::Lost(LossReason::Disconnected) => {
                entry.state = RankState::Lost(reason);
                Change::None
            }
            RankState::Lost(_) => Change::None,
            RankState::NeverConnected | RankState::Connected | RankState::Left | RankState::Finished { .. } => {
                entry.state = RankState::Lost(reason);
                if let Some(seen) = self.seen.get_mut(rank) {
                    (seen.at, seen.lease_lost) = (now, false);
                }
                self.lost.insert(rank);
                self.lost_counts.2 += 1;
                Change::Lost
            }
        }
    }

    fn arm(seen: &mut Seen, now: Millis, lease_ms: u64) -> Change {
        if lease_ms == 0 || seen.lease_armed {
            return Change::None;
        }
        seen.lease_armed = true;
        Change::ArmLease(now.saturating_add(lease_ms))
    }

    /// The process holding `rank`, if one claimed it.
    pub fn holder(&self, rank: u32) -> Option<&Holder> {
        self.entries.get(rank)?.holder.as_deref()
    }

    /// The takeover that ended `incarnation`'s hold on `rank`, if one did.
    pub fn taken_from(&self, rank: u32, incarnation: u64) -> Option<&Takeover> {
        self.entries.get(rank)?.previous.as_ref()?.iter().rev().find(|t| t.incarnation == incarnation)
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
        let Holder { host, incarnation, sessions, .. } = *holder;
        self.names.put(host);
        entry.sessions = entry.sessions.saturating_sub(u32::try_from(sessions.len()).unwrap_or(u32::MAX));
        let previous = entry.previous.get_or_insert_with(Box::default);
        if previous.len() == PREVIOUS_KEPT {
            previous.remove(0);
        }
        previous.push(Takeover { incarnation, by: by.clone(), at: now });
        sessions.into_vec()
    }

    /// Ranks ever connected or reported ended, by state: (connected, left cleanly,
    /// finished, lost).
    pub fn tally(&self) -> (usize, usize, usize, usize) {
        let count = |pred: fn(&RankState) -> bool| self.entries.iter().filter(|(_, e)| pred(&e.state)).count();
        let finished = count(|s| matches!(s, RankState::Finished { .. }))
            + self.ended.values().filter(|e| e.exit.success()).count();
        let connected = count(|s| *s == RankState::Connected);
        (connected, count(|s| *s == RankState::Left), finished, self.lost.len().saturating_sub(finished))
    }

    /// Ranks gone to their peers, lost or finished, in rank order.
    pub fn lost(&self) -> impl Iterator<Item = u32> + '_ {
        self.lost.iter().copied()
    }

    /// Of [`Ranks::lost`], whether `rank` finished (its worker exited with code 0)
    /// rather than being lost.
    pub fn finished(&self, rank: u32) -> bool {
        match self.entries.get(rank) {
            Some(entry) => matches!(entry.state, RankState::Finished { .. }),
            None => self.ended.get(&rank).is_some_and(|e| e.exit.success()),
        }
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

    /// How many ranks were reported ended before they ever connected.
    pub fn ended_unconnected(&self) -> usize {
        self.ended.len()
    }

    /// Ranks that connected with a role other than `role`, or with none, in no order.
    pub fn with_other_role<'a>(&'a self, role: &'a str) -> impl Iterator<Item = u32> + 'a {
        self.entries.iter().filter(move |(_, e)| e.role.as_deref() != Some(role)).map(|(rank, _)| rank)
    }

    /// Everything known about `rank`, for an error message.
    pub fn info(&self, rank: u32, now: Millis) -> RankInfo {
        match (self.entries.get(rank), self.seen.get(rank)) {
            (Some(e), Some(seen)) => RankInfo {
                rank,
                host: Some(e.host.to_string()),
                pid: Some(e.pid),
                state: e.state,
                last_seen_ms_ago: Some(now.saturating_sub(seen.at)),
            },
            _ => match self.ended.get(&rank) {
                Some(Ended { host, pid, exit, at }) => {
                    // A finish is timed by its report, as one of a rank that connected
                    // is (a launcher judges causes by it); a crash at start names none.
                    let (state, last_seen_ms_ago) = match exit.success() {
                        true => (RankState::Finished { pid: *pid }, Some(now.saturating_sub(*at))),
                        false => (RankState::Lost(LossReason::Exited { pid: *pid, exit: *exit }), None),
                    };
                    RankInfo { rank, host: Some(host.to_string()), pid: Some(*pid), state, last_seen_ms_ago }
                }
                None => {
                    RankInfo { rank, host: None, pid: None, state: RankState::NeverConnected, last_seen_ms_ago: None }
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session(n: u64) -> SessionId {
        SessionId::at(u32::try_from(n).expect("small"), 1)
    }

    #[test]
    fn ranks_share_their_host_and_role_names_and_forget_those_no_rank_uses() {
        let mut ranks = Ranks::default();
        for rank in 0..4 {
            ranks.connect(rank, "node-a", 100 + rank, Some("trainer"), 0, 0, Some((session(u64::from(rank) + 1), 7)));
        }
        let a = &ranks.entries.get(0).expect("connected").host;
        assert!(Arc::ptr_eq(a, &ranks.entries.get(3).expect("connected").host), "one host name for all");
        let holder = ranks.holder(2).expect("claimed");
        assert!(Arc::ptr_eq(&holder.host, a), "the holder's host is the rank's");
        assert_eq!(holder.process(), ProcessInfo { pid: 102, host: "node-a".into(), incarnation: Some(7) });
        assert_eq!(ranks.names.0.len(), 2);

        // Every rank moves to another host and role (a restarted job): the old names go.
        for rank in 0..4 {
            ranks.connect(rank, "node-b", 200 + rank, None, 1, 0, Some((session(u64::from(rank) + 11), 8)));
        }
        let names: Vec<&str> = ranks.names.0.iter().map(|n| &**n).collect();
        assert_eq!(names, ["node-b"]);
        assert_eq!(ranks.info(1, 1).host.as_deref(), Some("node-b"));
        assert_eq!(ranks.role(1), None);

        // A takeover gives the holder's name back too.
        ranks.connect(0, "node-c", 300, None, 2, 0, None);
        ranks.take_over(0, &ProcessInfo { pid: 300, host: "node-c".into(), incarnation: Some(9) }, 2);
        assert!(ranks.holder(0).is_none());
        assert_eq!(ranks.taken_from(0, 8).map(|t| t.by.pid), Some(300));
        let mut names: Vec<&str> = ranks.names.0.iter().map(|n| &**n).collect();
        names.sort_unstable();
        assert_eq!(names, ["node-b", "node-c"]);
    }

    #[test]
    fn a_second_session_of_the_holding_process_joins_its_sessions() {
        let mut ranks = Ranks::default();
        ranks.connect(5, "h", 1, None, 0, 0, Some((session(1), 42)));
        ranks.connect(5, "h", 1, None, 0, 0, Some((session(2), 42)));
        assert_eq!(ranks.holder(5).expect("claimed").sessions.as_slice(), [session(1), session(2)]);
        ranks.disconnect(5, session(1), false, 1);
        assert_eq!(ranks.holder(5).expect("claimed").sessions.as_slice(), [session(2)]);
        assert_eq!(
            ranks.take_over(5, &ProcessInfo { pid: 2, host: "h".into(), incarnation: Some(43) }, 2),
            [session(2)]
        );
    }
}
