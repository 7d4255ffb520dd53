//! What lets a session survive a cut connection: the reconnect grace, and the
//! replies kept for requests a client re-sends.
//!
//! A client whose connection is cut reconnects, resumes its session by id and re-sends
//! every request it has no reply for, with the same ids. For each, one of three things
//! holds: it is still waiting (a barrier arrival, a `get`): the re-sent copy is dropped
//! and the one reply comes when it is due; it was answered and the reply got lost with
//! the connection: the same reply again, from the session's [`Kept`] replies; or the
//! coordinator never got it: it runs now. So an arrival, an `add` or a `set` retried
//! after a cut takes effect once. Only requests that change something are kept (from
//! the moment they arrive, so that a waiting one is known): a read runs again.
//!
//! A barrier call's `Done` is not written into its session's queue when the barrier
//! releases (that would touch every session of the job at every release): the call's
//! entry names the generation it joined, and reads as waiting while that generation
//! still holds the rank's arrival and as `Done` once it does not; the session's next
//! request turns it into a `Done`. Every other end of such a wait (a failure, a
//! timeout, the session's own error) is a reply that is kept as any other, replacing
//! the entry; so an entry is read from its generation only once every reply made so
//! far has been kept (the engine keeps them first), and never while replies are
//! being kept. Until read, it is kept as a waiting request is: not dropped by age.
//!
//! A node agent's barrier calls held in a record (`collective::Record`) are not kept
//! here at all: their generation keeps them, and the job keeps the records of the
//! generations that ended for as long as replies are kept. The session notes only
//! the highest such request; when it resumes, what the records still tell of its
//! calls is taken here (`Engine::keep_held_calls`), and a copy of an older barrier
//! call is answered as a request whose reply is no longer kept.
//!
//! The kept replies are bounded ([`crate::ReplyCache`]: count, age, bytes of values)
//! and dropped oldest first. A re-sent request that changes something, whose reply is
//! not kept but whose id is not above the highest id dropped, may have run: it is
//! answered with an error saying so rather than run a second time. (Clients number
//! requests upwards; a resumed session must never reuse an id.)

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use crate::snapshot::ReconnectingView;
use crate::{Millis, OpError, RankState, Reply, ReplyCache as Limits, Response};

use super::job::Job;
use super::Sessions;

/// Whether generation `generation` of the collective at `at` in the session's job
/// still waits with the session's rank in it (see [`Slot::Called`]).
pub(crate) type Pending<'a> = &'a dyn Fn(u32, u64) -> bool;

/// The resume state of a session that stated an incarnation.
#[derive(Debug, Default)]
pub(crate) struct Resumable {
    pub kept: Kept,
    /// The connection dropped: the session is kept for a resume until its grace ends,
    /// then closed as a loss.
    pub detached: Option<Detached>,
}

/// When a session's connection dropped, and when its reconnect grace ends (engine ms).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Detached {
    pub at: Millis,
    pub until: Millis,
}

/// Whether a request arriving `now` may be a copy re-sent after the session's last
/// resume, `resumed_at`.
pub(crate) fn may_be_resent(resumed_at: Option<Millis>, now: Millis, limits: &Limits) -> bool {
    resumed_at.is_some_and(|at| now <= at.saturating_add(limits.max_age_ms))
}

/// The ranks of `job` waiting for their process to resume, with how long ago the
/// connection dropped and how long until they are counted lost: what `rallypoint
/// status` and the snapshot show, so that a hang during the grace is not blamed on
/// a rank that looks connected. A rank waits when every open session carrying it is
/// detached: another live session (a rank may have several; torch's never resume)
/// keeps it plainly connected, and a rank lost by its lease meanwhile is shown lost.
/// Its lease may end before the grace: a detached session heartbeats no more.
/// `sessions`: the engine's open sessions, those of other jobs are skipped.
pub(crate) fn reconnecting(
    job: &Job,
    sessions: &Sessions,
    lease_ms: u64,
    now: Millis,
) -> BTreeMap<u32, ReconnectingView> {
    let mut live = BTreeSet::new();
    let mut detached: BTreeMap<u32, Detached> = BTreeMap::new();
    for session in sessions.values().filter(|s| s.job == job.id) {
        let Some(rank) = session.identity.rank else { continue };
        match session.resume.as_ref().and_then(|r| r.detached) {
            // The rank is lost when its last session's grace ends.
            Some(d) => {
                let latest = detached.entry(rank).or_insert(d);
                latest.at = latest.at.max(d.at);
                latest.until = latest.until.max(d.until);
            }
            None => {
                live.insert(rank);
            }
        }
    }
    detached
        .into_iter()
        .filter(|(rank, _)| !live.contains(rank))
        .filter_map(|(rank, d)| {
            let info = job.ranks.info(rank, now);
            if info.state != RankState::Connected {
                return None;
            }
            let mut lost_in_ms = d.until.saturating_sub(now);
            if let (true, Some(ago)) = (lease_ms > 0, info.last_seen_ms_ago) {
                lost_in_ms = lost_in_ms.min(lease_ms.saturating_sub(ago));
            }
            Some((rank, ReconnectingView { dropped_ms_ago: now.saturating_sub(d.at), lost_in_ms }))
        })
        .collect()
}

/// What a re-sent request gets.
#[derive(Debug)]
pub(crate) enum Resent {
    /// Not a copy of anything known: run it.
    Run,
    /// Still waiting: drop the copy; its one reply comes when due.
    Waiting,
    /// Answered before: this reply again.
    Replay(Reply),
}

/// The state-changing requests of one session, oldest first: those still waiting for
/// their reply, and the replies of those answered. One block of memory per session: a
/// request is answered where it waits, usually the latest. `Done` replies answered one
/// after another are kept as one entry (see [`Slot::Done`]): a session in a barrier
/// loop keeps one entry for dozens of its answered arrivals, not one per arrival.
/// In C order, so that what a request touches first shares a cache line, which is
/// cold at every request of a large job.
#[derive(Debug, Default)]
#[repr(C)]
pub(crate) struct Kept {
    entries: VecDeque<Entry>,
    /// Requests still waiting here for their reply or for their generation to be
    /// read (`Waiting`, `Called` and `old_waiting`): while a session has any, the
    /// replies leaving the engine are looked at.
    unsettled: u32,
    /// Bytes of values the kept replies hold.
    bytes: usize,
    /// Highest request id whose reply was dropped (0: none).
    max_evicted: u64,
    /// Until when the oldest entry is too young to drop (None: look at it), so that
    /// keeping a reply does not read the far end of the queue, a cache miss each time.
    oldest_kept_until: Option<Millis>,
    /// Waiting requests moved out of `entries` to keep it within its count (a barrier
    /// that waits while its session does hundreds of `add`s): still recognised when
    /// re-sent, and their replies kept once they come.
    old_waiting: Vec<OldWaiting>,
}

/// 32 bytes a request, most of them: a session of a job in a tight loop keeps a few
/// hundred of them.
#[derive(Debug)]
struct Entry {
    id: u64,
    /// When it was answered (unused while it waits); for a run of `Done`s, when its
    /// last one was.
    at: Millis,
    reply: Slot,
}

impl Entry {
    /// Whether this entry holds the reply of request `id`, if that changed state.
    fn covers(&self, id: u64) -> bool {
        match self.reply {
            Slot::Done { also } => match id.checked_sub(self.id) {
                Some(0) => true,
                Some(after @ 1..=64) => also & (1 << (after - 1)) != 0,
                _ => false,
            },
            _ => self.id == id,
        }
    }

    /// The highest request id it holds a reply for.
    fn last_id(&self) -> u64 {
        match self.reply {
            Slot::Done { also } => self.id.saturating_add(u64::from(u64::BITS - also.leading_zeros())),
            _ => self.id,
        }
    }
}

/// A waiting request moved out of [`Kept::entries`]: its id, and the generation it
/// waits in if it is a barrier call (see [`Slot::Called`]).
#[derive(Debug)]
struct OldWaiting {
    id: u64,
    called: Option<(u32, u64)>,
}

#[derive(Debug)]
enum Slot {
    Waiting,
    /// A barrier call that waits in generation `generation` of the collective at `at`:
    /// waiting while that generation is pending with the rank in it, `Done` once not
    /// (module doc). (A generation's number may be pending again later, made by
    /// other ranks' calls: the rank's own arrival tells them apart.)
    Called {
        at: u32,
        generation: u64,
    },
    /// `Done`, to this request and to each request whose id is `k` past it for every
    /// bit `k - 1` set in `also`. Exactly those: requests arrive out of id order (ids
    /// are taken before they are sent, and a resumed client sends the old ones first),
    /// and the ids between are reads, heartbeats or requests still to come.
    Done {
        also: u64,
    },
    Int(i64),
    Bool(bool),
    Full(Box<Reply>),
}

impl Slot {
    fn bytes(&self) -> usize {
        match self {
            Slot::Full(reply) => values_len(reply),
            _ => 0,
        }
    }
}

impl Kept {
    /// Request `id` arrived (and changes something): waiting for its reply. Every
    /// reply made so far must have been kept (module doc).
    pub fn arrived(&mut self, id: u64, now: Millis, limits: &Limits, pending: Pending<'_>) {
        self.read_released(now, pending);
        // Room first: the queue would double its memory to take one past the count.
        if self.entries.len() >= limits.max_replies {
            self.trim_to(bunch(limits.max_replies), now, limits);
        }
        // A session in a barrier loop keeps two entries (its run of `Done`s and the call
        // waiting): room for those, not the four a deque starts with.
        if self.entries.capacity() == 0 {
            self.entries.reserve_exact(2);
        }
        self.entries.push_back(Entry { id, at: 0, reply: Slot::Waiting });
        self.unsettled = self.unsettled.saturating_add(1);
    }

    /// Request `id`, a barrier call waiting here, waits in generation `generation`
    /// of the collective at `at`: its `Done` is read from there (module doc).
    pub fn called(&mut self, id: u64, at: u32, generation: u64) {
        let waiting = |e: &&mut Entry| e.id == id && matches!(e.reply, Slot::Waiting);
        if let Some(entry) = self.entries.iter_mut().rev().find(waiting) {
            entry.reply = Slot::Called { at, generation };
        } else if let Some(old) = self.old_waiting.iter_mut().find(|w| w.id == id) {
            old.called = Some((at, generation));
        }
    }

    /// [`Kept::arrived`] of request `id`, a barrier call that waits in generation
    /// `generation` of the collective at `at`, then [`Kept::called`].
    pub fn arrived_called(
        &mut self,
        id: u64,
        (at, generation): (u32, u64),
        now: Millis,
        limits: &Limits,
        pending: Pending<'_>,
    ) {
        self.arrived(id, now, limits, pending);
        if let Some(last) = self.entries.back_mut() {
            last.reply = Slot::Called { at, generation };
        }
    }

    /// Barrier calls released since (module doc) become `Done`s as of now: the latest
    /// two entries (a session calls one request after another, or has a few in
    /// flight), each joining a run of `Done`s right before it, and any moved aside,
    /// which come back as the latest entries. `pending` must say a generation is
    /// released only if every reply made so far has been kept.
    fn read_released(&mut self, now: Millis, pending: Pending<'_>) {
        for back in [2, 1] {
            let Some(i) = self.entries.len().checked_sub(back) else { continue };
            let Some(entry) = self.entries.get_mut(i) else { continue };
            let Slot::Called { at, generation } = entry.reply else { continue };
            if pending(at, generation) {
                continue;
            }
            *entry = Entry { id: entry.id, at: now, reply: Slot::Done { also: 0 } };
            self.unsettled = self.unsettled.saturating_sub(1);
            if self.join_run(i, now) {
                self.entries.remove(i);
            }
        }
        if self.old_waiting.iter().any(|w| w.called.is_some()) {
            let mut i = 0;
            while let Some(old) = self.old_waiting.get(i) {
                match old.called {
                    Some((at, generation)) if !pending(at, generation) => {
                        let id = self.old_waiting.swap_remove(i).id;
                        self.entries.push_back(Entry { id, at: now, reply: Slot::Done { also: 0 } });
                        self.unsettled = self.unsettled.saturating_sub(1);
                    }
                    _ => i += 1,
                }
            }
        }
    }

    /// Whether entry `i`, a `Done` of a request at most 64 ids past the first of the
    /// run of `Done`s right before it, joined that run (the caller then drops it).
    fn join_run(&mut self, i: usize, now: Millis) -> bool {
        let Some(id) = self.entries.get(i).map(|e| e.id) else { return false };
        let before = i.checked_sub(1).and_then(|at| self.entries.get_mut(at));
        before.is_some_and(|before| match (&mut before.reply, id.checked_sub(before.id)) {
            (Slot::Done { also }, Some(after @ 1..=64)) => {
                *also |= 1 << (after - 1);
                before.at = now;
                true
            }
            _ => false,
        })
    }

    /// Keeps the reply to request `id` if it was waiting here; returns whether it was.
    pub fn answered(&mut self, id: u64, reply: &Reply, now: Millis, limits: &Limits) -> bool {
        let slot = match reply {
            Ok(Response::Done) => Slot::Done { also: 0 },
            Ok(Response::Int(n)) => Slot::Int(*n),
            Ok(Response::Bool(b)) => Slot::Bool(*b),
            other => Slot::Full(Box::new(other.clone())),
        };
        let bytes = slot.bytes();
        let answered = Entry { id, at: now, reply: slot };
        let waiting = |e: &Entry| e.id == id && matches!(e.reply, Slot::Waiting | Slot::Called { .. });
        if let Some(from_back) = self.entries.iter().rev().position(waiting) {
            let done = matches!(answered.reply, Slot::Done { .. });
            if let Some(entry) = self.entries.iter_mut().rev().nth(from_back) {
                *entry = answered;
            }
            // The latest entry, answered `Done`, joins a run of `Done`s right before it.
            let last = self.entries.len().saturating_sub(1);
            if from_back == 0 && done && self.join_run(last, now) {
                self.entries.pop_back();
            }
        } else if let Some(i) = self.old_waiting.iter().position(|w| w.id == id) {
            self.old_waiting.swap_remove(i);
            self.entries.push_back(answered);
        } else {
            return false;
        }
        self.unsettled = self.unsettled.saturating_sub(1);
        self.bytes = self.bytes.saturating_add(bytes);
        self.trim(now, limits);
        true
    }

    /// What re-sent request `id` gets, as far as the kept requests tell, `now`.
    /// Every reply made so far must have been kept (module doc).
    pub fn resent(&self, id: u64, changes_state: bool, now: Millis, limits: &Limits, pending: Pending<'_>) -> Resent {
        if let Some(old) = self.old_waiting.iter().find(|w| w.id == id) {
            return match old.called {
                Some((at, generation)) if !pending(at, generation) => Resent::Replay(Ok(Response::Done)),
                _ => Resent::Waiting,
            };
        }
        let unknown = || Resent::Replay(Err(unknown(id)));
        // A read matches only an entry's own id, never one it holds besides (reads
        // are not kept; only a client that reused an id could send one there).
        let kept = self.entries.iter().rev().find(|e| e.covers(id)).filter(|e| changes_state || e.id == id);
        if let Some(entry) = kept {
            return match &entry.reply {
                Slot::Waiting => Resent::Waiting,
                // Released for sure, however long ago: no age to check.
                Slot::Called { at, generation } => match pending(*at, *generation) {
                    true => Resent::Waiting,
                    false => Resent::Replay(Ok(Response::Done)),
                },
                // Kept past its age only because nothing was kept since.
                _ if entry.at.saturating_add(limits.max_age_ms) < now => unknown(),
                Slot::Done { .. } => Resent::Replay(Ok(Response::Done)),
                Slot::Int(n) => Resent::Replay(Ok(Response::Int(*n))),
                Slot::Bool(b) => Resent::Replay(Ok(Response::Bool(*b))),
                Slot::Full(reply) => Resent::Replay((**reply).clone()),
            };
        }
        if changes_state && id <= self.max_evicted {
            return unknown();
        }
        Resent::Run
    }

    /// Whether request `id` is kept here, waiting or answered.
    pub fn holds(&self, id: u64) -> bool {
        self.old_waiting.iter().any(|w| w.id == id) || self.entries.iter().any(|e| e.covers(id))
    }

    /// Requests waiting here for their reply or for their generation to be read:
    /// replies leaving the engine must be looked at while a session has any.
    pub fn waiting(&self) -> usize {
        self.unsettled as usize
    }

    /// Drops the oldest replies past the bounds. A waiting request is never dropped:
    /// past the count it moves to `old_waiting`; otherwise it stays, however long it
    /// waits. (Age is also checked when a reply is looked up: a session that keeps
    /// nothing new is not looked at.)
    pub fn trim(&mut self, now: Millis, limits: &Limits) {
        let count = match self.entries.len() > limits.max_replies {
            true => bunch(limits.max_replies),
            false => limits.max_replies,
        };
        self.trim_to(count, now, limits);
    }

    /// [`Kept::trim`] to at most `count` replies. A barrier call not yet read from
    /// its generation (module doc) is kept as a waiting request.
    fn trim_to(&mut self, count: usize, now: Millis, limits: &Limits) {
        let within = |kept: &Kept, count| kept.entries.len() <= count && kept.bytes <= limits.max_bytes;
        if within(self, count) && self.oldest_kept_until.is_some_and(|until| now <= until) {
            return;
        }
        self.oldest_kept_until = None;
        while let Some(oldest) = self.entries.front() {
            let (waiting, called) = match oldest.reply {
                Slot::Waiting => (true, None),
                Slot::Called { at, generation } => (true, Some((at, generation))),
                _ => (false, None),
            };
            let until = oldest.at.saturating_add(limits.max_age_ms);
            if within(self, count) && (waiting || until >= now) {
                // A waiting one's age counts from its reply: look again then.
                self.oldest_kept_until = (!waiting).then_some(until);
                return;
            }
            let Some(entry) = self.entries.pop_front() else { return };
            if waiting {
                self.old_waiting.push(OldWaiting { id: entry.id, called });
            } else {
                self.bytes = self.bytes.saturating_sub(entry.reply.bytes());
                self.max_evicted = self.max_evicted.max(entry.last_id());
            }
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.len()
    }
}

/// The error of a request sent again whose reply is no longer kept: it may have run.
pub(crate) fn unknown(id: u64) -> OpError {
    OpError::Closed(format!(
        "request {id} was sent again after a reconnect, but its reply is no longer kept (the coordinator keeps a \
         session's last replies for a bounded time): it may or may not have taken effect"
    ))
}

/// How many replies are left when there are too many: seven eighths of the most, so
/// that a session in a tight loop drops its oldest in bunches, not one at each
/// reply (each drop reads the far end of its queue).
fn bunch(max_replies: usize) -> usize {
    max_replies - max_replies.div_ceil(8)
}

/// Bytes of the values a reply holds (a shared all-gather result counts whole).
fn values_len(reply: &Reply) -> usize {
    match reply {
        Ok(Response::Value(value)) => value.len(),
        Ok(Response::Values(values)) => values.iter().map(|v| v.len()).fold(0, usize::saturating_add),
        Ok(Response::Gathered(gathered)) => gathered.values_len(),
        Ok(Response::Popped { value, .. }) => value.as_ref().map_or(0, |v| v.len()),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    /// No generation waits: every barrier call kept is read as released.
    fn none(_: u32, _: u64) -> bool {
        false
    }

    /// When replies are looked up in the tests, unless they say otherwise.
    const NOW: Millis = 0;

    fn limits() -> Limits {
        Limits { max_replies: 3, max_age_ms: 1_000, max_bytes: 10 }
    }

    fn answer(kept: &mut Kept, id: u64, reply: Reply, now: Millis) {
        kept.arrived(id, now, &limits(), &none);
        assert!(kept.answered(id, &reply, now, &limits()));
    }

    #[test]
    fn keeps_the_last_replies_within_count_bytes_and_age() {
        let mut kept = Kept::default();
        for id in 1..=4 {
            answer(&mut kept, id, Ok(Response::Int(id as i64)), 0);
        }
        assert_eq!(kept.len(), 3);
        assert!(matches!(kept.resent(1, false, 0, &limits(), &none), Resent::Run), "the oldest went past the count");
        assert!(matches!(kept.resent(4, true, NOW, &limits(), &none), Resent::Replay(Ok(Response::Int(4)))));
        assert_eq!(kept.max_evicted, 1);

        // Values count: a value of 8 bytes and another of 8 do not fit in 10.
        answer(&mut kept, 5, Ok(Response::Value(Bytes::from_static(b"12345678"))), 0);
        answer(&mut kept, 6, Ok(Response::Value(Bytes::from_static(b"abcdefgh"))), 0);
        assert!(matches!(kept.resent(5, false, NOW, &limits(), &none), Resent::Run));
        assert!(matches!(kept.resent(6, true, NOW, &limits(), &none), Resent::Replay(Ok(Response::Value(_)))));
        assert_eq!(kept.max_evicted, 5);

        // Age: past 1 s nothing is replayed, and the next reply kept trims them.
        assert!(matches!(kept.resent(6, true, 1_001, &limits(), &none), Resent::Replay(Err(OpError::Closed(_)))));
        answer(&mut kept, 7, Ok(Response::Done), 1_001);
        assert_eq!(kept.len(), 1);
        assert_eq!(kept.max_evicted, 6);
    }

    /// Past the count, the oldest eighth goes at once; an entry too young to drop
    /// is not looked at again until it may be, and is dropped then.
    #[test]
    fn drops_in_bunches_and_by_age_when_due() {
        let limits = Limits { max_replies: 16, max_age_ms: 1_000, max_bytes: 1 << 20 };
        let mut kept = Kept::default();
        // Each reply its own (consecutive `Done`s would be kept as one).
        let int = |id: u64| Ok(Response::Int(id as i64));
        for id in 1..=16 {
            kept.arrived(id, 10, &limits, &none);
            kept.answered(id, &int(id), 10, &limits);
        }
        assert_eq!(kept.len(), 16);
        kept.arrived(17, 20, &limits, &none);
        assert_eq!(kept.len(), 15, "down to seven eighths of 16 before the 17th, so as not to grow");
        kept.answered(17, &int(17), 20, &limits);
        assert!(matches!(kept.resent(2, true, 20, &limits, &none), Resent::Replay(Err(OpError::Closed(_)))));
        assert!(matches!(kept.resent(3, true, 20, &limits, &none), Resent::Replay(Ok(Response::Int(3)))));
        // Replies of 10 ms are kept until 1,010 ms: at 1,010 nothing goes, at 1,011 they do.
        kept.arrived(18, 1_010, &limits, &none);
        kept.answered(18, &int(18), 1_010, &limits);
        assert_eq!(kept.len(), 16);
        kept.arrived(19, 1_011, &limits, &none);
        kept.answered(19, &int(19), 1_011, &limits);
        assert_eq!(kept.len(), 3, "only the replies of 20 ms and later are left");
        assert!(matches!(kept.resent(16, true, 1_011, &limits, &none), Resent::Replay(Err(OpError::Closed(_)))));
    }

    /// `Done`s answered one after another are one entry, which answers each of its
    /// requests but none of the reads between them; dropped, it counts as dropping
    /// them all.
    #[test]
    fn consecutive_dones_are_kept_as_one() {
        let limits = Limits { max_replies: 4, max_age_ms: 1_000, max_bytes: 1 << 20 };
        let mut kept = Kept::default();
        let replay = |kept: &Kept, id, changes_state| kept.resent(id, changes_state, 40, &limits, &none);
        // 1, 2 and 4 are barrier arrivals; 3 is a read, which is not kept.
        for (id, at) in [(1, 10), (2, 20), (4, 30)] {
            kept.arrived(id, at, &limits, &none);
            assert!(kept.answered(id, &Ok(Response::Done), at, &limits));
            assert_eq!(kept.len(), 1, "request {id} joined the run");
        }
        assert!(matches!(replay(&kept, 3, false), Resent::Run), "a read between them runs again");
        for id in [1, 2, 4] {
            assert!(matches!(replay(&kept, id, true), Resent::Replay(Ok(Response::Done))));
        }
        assert!(matches!(replay(&kept, 5, true), Resent::Run));
        // A reply of its own ends the run; a `Done` after it starts another.
        kept.arrived(5, 40, &limits, &none);
        kept.answered(5, &Ok(Response::Int(7)), 40, &limits);
        kept.arrived(6, 40, &limits, &none);
        kept.answered(6, &Ok(Response::Done), 40, &limits);
        assert_eq!(kept.len(), 3);
        assert!(matches!(replay(&kept, 5, true), Resent::Replay(Ok(Response::Int(7)))));
        // Answered out of order, the earlier one waits behind the later: no run.
        kept.arrived(7, 40, &limits, &none);
        kept.arrived(8, 40, &limits, &none);
        kept.answered(8, &Ok(Response::Done), 40, &limits);
        assert!(matches!(replay(&kept, 7, true), Resent::Waiting));
        kept.answered(7, &Ok(Response::Done), 40, &limits);
        assert_eq!(kept.len(), 4, "the fifth entry made room: the run of 1 to 4 went");
        for id in [2, 4] {
            assert!(matches!(replay(&kept, id, true), Resent::Replay(Err(OpError::Closed(_)))), "{id}");
        }
        assert!(matches!(replay(&kept, 5, true), Resent::Replay(Ok(Response::Int(7)))));
        for id in [6, 7, 8] {
            assert!(matches!(replay(&kept, id, true), Resent::Replay(Ok(Response::Done))), "{id}");
        }
    }

    /// An entry of `Done`s holds exactly its requests: one that arrives later with an
    /// id between them (ids are taken before they are sent), or one answered long
    /// after it waited past the count, is not taken for one of them.
    #[test]
    fn a_run_of_dones_holds_exactly_its_requests() {
        let limits = Limits { max_replies: 4, max_age_ms: 1_000, max_bytes: 1 << 20 };
        let replay = |kept: &Kept, id| kept.resent(id, true, 10, &limits, &none);
        let mut kept = Kept::default();
        for id in [5, 7] {
            kept.arrived(id, 10, &limits, &none);
            kept.answered(id, &Ok(Response::Done), 10, &limits);
        }
        assert_eq!(kept.len(), 1);
        assert!(matches!(replay(&kept, 6), Resent::Run), "6 has not arrived: it must run");
        kept.arrived(6, 10, &limits, &none);
        assert!(matches!(replay(&kept, 6), Resent::Waiting));
        kept.answered(6, &Ok(Response::Int(1)), 10, &limits);
        assert!(matches!(replay(&kept, 6), Resent::Replay(Ok(Response::Int(1)))));
        assert!(matches!(replay(&kept, 7), Resent::Replay(Ok(Response::Done))));
        // 65 past the first is one too far: a new entry.
        kept.arrived(70, 10, &limits, &none);
        kept.answered(70, &Ok(Response::Done), 10, &limits);
        kept.arrived(71, 10, &limits, &none);
        kept.answered(71, &Ok(Response::Done), 10, &limits);
        assert_eq!(kept.len(), 3);
        assert!(matches!(replay(&kept, 69), Resent::Run));

        // Barrier 1 waits while 2-5 are answered, and moves past the count; then 6
        // waits, 1 is answered (its entry goes last), and 7 is answered `Done`.
        let mut kept = Kept::default();
        kept.arrived(1, 10, &limits, &none);
        for id in 2..=5 {
            kept.arrived(id, 10, &limits, &none);
            kept.answered(id, &Ok(Response::Int(id as i64)), 10, &limits);
        }
        kept.arrived(6, 10, &limits, &none);
        assert!(kept.answered(1, &Ok(Response::Done), 10, &limits));
        kept.arrived(7, 10, &limits, &none);
        kept.answered(7, &Ok(Response::Done), 10, &limits);
        assert!(matches!(replay(&kept, 6), Resent::Waiting), "6 still waits");
        assert!(matches!(replay(&kept, 5), Resent::Replay(Ok(Response::Int(5)))));
        assert!(matches!(replay(&kept, 1), Resent::Replay(Ok(Response::Done))));
        assert!(matches!(replay(&kept, 7), Resent::Replay(Ok(Response::Done))));
    }

    /// A barrier call waits while its generation is pending and reads `Done` once it
    /// is not; the session's next request keeps it as a `Done`, joining the run.
    #[test]
    fn a_barrier_call_reads_its_release_from_its_generation() {
        let limits = Limits { max_replies: 4, max_age_ms: 1_000, max_bytes: 1 << 20 };
        let pending = std::cell::Cell::new(true);
        let generation_waits = |at: u32, generation: u64| (at, generation) == (3, 1) && pending.get();
        let resent = |kept: &Kept, id, now| kept.resent(id, true, now, &limits, &generation_waits);
        let mut kept = Kept::default();
        kept.arrived(1, 10, &limits, &generation_waits);
        kept.called(1, 3, 1);
        assert!(matches!(resent(&kept, 1, 10), Resent::Waiting));
        assert_eq!(kept.waiting(), 1);
        pending.set(false);
        assert!(matches!(resent(&kept, 1, 10), Resent::Replay(Ok(Response::Done))));
        assert!(matches!(resent(&kept, 1, 5_000), Resent::Replay(Ok(Response::Done))), "released: no age to outlive");
        // Calls 2 and 3 read the call before them as released.
        kept.arrived(2, 20, &limits, &generation_waits);
        assert_eq!((kept.len(), kept.waiting()), (2, 1), "1 read when the session next arrives");
        kept.called(2, 3, 2);
        assert_eq!((kept.len(), kept.waiting()), (2, 1));
        kept.arrived(3, 30, &limits, &generation_waits);
        kept.called(3, 3, 3);
        assert_eq!((kept.len(), kept.waiting()), (2, 1), "calls 1 and 2 are one run of `Done`s");
        for id in [1, 2] {
            assert!(matches!(resent(&kept, id, 30), Resent::Replay(Ok(Response::Done))));
        }
        assert!(matches!(resent(&kept, 3, 30), Resent::Replay(Ok(Response::Done))), "3 is not pending either");
        // Told that nothing may be read yet (a reply not kept), the entry waits its turn.
        let unread = |_: u32, _: u64| true;
        kept.arrived(4, 40, &limits, &unread);
        kept.called(4, 3, 4);
        assert_eq!((kept.len(), kept.waiting()), (3, 2));
    }

    /// A session in a barrier loop, each call kept when it arrives: a run of `Done`s
    /// per 64 calls and the call waiting, as when each release was kept.
    #[test]
    fn a_barrier_loop_keeps_a_run_per_64_calls() {
        let limits = Limits { max_replies: 256, max_age_ms: 60_000, max_bytes: 1 << 20 };
        let round = std::cell::Cell::new(0);
        let generation_waits = |_: u32, generation: u64| generation >= round.get();
        let mut kept = Kept::default();
        // Each call kept at its gate and told its generation when it waits, or both
        // at once when it arrives (a node agent's run of calls): the same entries.
        let mut at_once = Kept::default();
        for id in 1..=300u64 {
            round.set(id);
            kept.arrived(id, id, &limits, &generation_waits);
            kept.called(id, 0, id);
            at_once.arrived_called(id, (0, id), id, &limits, &generation_waits);
            assert_eq!((kept.waiting(), at_once.waiting()), (1, 1), "call {id}: only the latest waits");
        }
        assert_eq!(kept.len(), 300 / 64 + 2, "{kept:?}");
        assert_eq!(format!("{kept:?}"), format!("{at_once:?}"));
        for id in [1, 64, 65, 299] {
            assert!(matches!(
                kept.resent(id, true, 300, &limits, &generation_waits),
                Resent::Replay(Ok(Response::Done))
            ));
        }
        assert!(matches!(kept.resent(300, true, 300, &limits, &generation_waits), Resent::Waiting));
    }

    /// A barrier call that failed is answered with its error like any request, and
    /// keeps it, whatever its generation says since.
    #[test]
    fn a_failed_barrier_call_keeps_its_error() {
        let mut kept = Kept::default();
        kept.arrived(1, 0, &limits(), &none);
        kept.called(1, 0, 1);
        let failed = Err(OpError::Closed("the barrier failed".into()));
        assert!(kept.answered(1, &failed, 0, &limits()));
        assert_eq!(kept.waiting(), 0);
        assert!(matches!(kept.resent(1, true, NOW, &limits(), &none), Resent::Replay(Err(OpError::Closed(_)))));
    }

    /// A barrier call still waiting when the count moves it aside is still read from
    /// its generation, and comes back as a `Done` once released.
    #[test]
    fn a_barrier_call_moved_aside_is_read_from_its_generation() {
        let pending = std::cell::Cell::new(true);
        let generation_waits = |_: u32, _: u64| pending.get();
        let mut kept = Kept::default();
        kept.arrived(1, 0, &limits(), &generation_waits);
        kept.called(1, 0, 1);
        for id in 2..=5 {
            kept.arrived(id, 0, &limits(), &generation_waits);
            assert!(kept.answered(id, &Ok(Response::Int(id as i64)), 0, &limits()));
        }
        assert_eq!((kept.len(), kept.waiting()), (3, 1), "moved aside, still waiting");
        assert!(matches!(kept.resent(1, true, NOW, &limits(), &generation_waits), Resent::Waiting));
        pending.set(false);
        assert!(matches!(kept.resent(1, true, NOW, &limits(), &generation_waits), Resent::Replay(Ok(Response::Done))));
        kept.arrived(6, 0, &limits(), &generation_waits);
        assert!(kept.answered(6, &Ok(Response::Int(6)), 0, &limits()));
        assert_eq!(kept.waiting(), 0, "read when the session next arrived");
        assert!(matches!(kept.resent(1, true, NOW, &limits(), &none), Resent::Replay(Ok(Response::Done))));
        assert!(matches!(kept.resent(2, true, NOW, &limits(), &none), Resent::Replay(Err(OpError::Closed(_)))));
    }

    #[test]
    fn a_waiting_request_is_recognised_even_past_the_bounds() {
        let mut kept = Kept::default();
        kept.arrived(1, 0, &limits(), &none);
        for id in 2..=6 {
            answer(&mut kept, id, Ok(Response::Done), 0);
        }
        assert!(
            matches!(kept.resent(1, true, NOW, &limits(), &none), Resent::Waiting),
            "a barrier waits while the session adds"
        );
        assert_eq!(kept.waiting(), 1);
        assert!(kept.answered(1, &Ok(Response::Done), 0, &limits()));
        assert_eq!(kept.waiting(), 0);
        assert!(
            matches!(kept.resent(1, true, NOW, &limits(), &none), Resent::Replay(Ok(Response::Done))),
            "its reply is kept once it came"
        );
    }

    #[test]
    fn a_long_wait_is_not_dropped_by_age() {
        let mut kept = Kept::default();
        kept.arrived(1, 0, &limits(), &none);
        answer(&mut kept, 2, Ok(Response::Done), 0);
        assert!(matches!(kept.resent(1, true, 5_000, &limits(), &none), Resent::Waiting));
        assert!(matches!(kept.resent(2, true, 5_000, &limits(), &none), Resent::Replay(Err(_))), "an old reply goes");
        assert!(kept.answered(1, &Ok(Response::Done), 5_000, &limits()));
        assert!(matches!(kept.resent(1, true, 5_000, &limits(), &none), Resent::Replay(Ok(Response::Done))));
    }

    #[test]
    fn a_resent_request_is_waiting_replayed_unknown_or_new() {
        let mut kept = Kept::default();
        kept.arrived(7, 0, &limits(), &none);
        answer(&mut kept, 3, Ok(Response::Done), 0);
        kept.max_evicted = 2;
        assert!(matches!(kept.resent(7, true, NOW, &limits(), &none), Resent::Waiting));
        assert!(matches!(kept.resent(3, true, NOW, &limits(), &none), Resent::Replay(Ok(Response::Done))));
        assert!(
            matches!(kept.resent(2, true, NOW, &limits(), &none), Resent::Replay(Err(OpError::Closed(_)))),
            "evicted: unknown outcome"
        );
        assert!(matches!(kept.resent(2, false, NOW, &limits(), &none), Resent::Run), "a read runs again");
        assert!(matches!(kept.resent(9, true, NOW, &limits(), &none), Resent::Run));
    }
}

#[cfg(test)]
mod size {
    #[test]
    fn a_kept_request_takes_32_bytes() {
        assert_eq!(std::mem::size_of::<super::Entry>(), 32);
    }
}
