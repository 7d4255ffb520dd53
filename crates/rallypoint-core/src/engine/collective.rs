//! Reusable named barriers, all-gathers and broadcasts of one job.
//!
//! A collective is its kind, its name and its members (the whole job, a list of
//! ranks, a role), as an MPI collective is its communicator's: groups that share a
//! name, as each role or each pipeline stage would, wait apart and count apart.
//! Generations are counted per rank: a rank's k-th call of a collective joins
//! generation k, whichever session or process it comes from. The first arrival fixes
//! the generation's world size (and a broadcast's root); a caller that disagrees
//! fails the generation for all. A generation that failed is remembered, so a late
//! arrival gets the same error.
//!
//! Two groups of one name that wait for each other (rank 1 called it over the whole
//! job, rank 0 over ranks 0 and 1, each now needing the other) are a mismatch at
//! once, not a hang until the deadline: see [`Collectives::crossed`].

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::ops::Range;

use super::HashMap;
use std::num::NonZeroU64;
use std::sync::Arc;

use bytes::Bytes;

use crate::counters::{op, OpCounters};
use crate::error::Secs;
use crate::ranges::split;
use crate::{
    CallShape, CollectiveKind, Gathered, Members, Millis, Missing, OpError, OpRef, Outgoing, Response, SessionId,
};

use super::by_rank::ByRank;
use super::members::{Arrivals, MemberSet};
use super::ranks::Ranks;
use super::timers::{CollectiveDeadline, Timer, Timers};
use super::JobId;

/// One validated call of a collective.
#[derive(Debug)]
pub(crate) struct Call {
    pub session: SessionId,
    pub request_id: u64,
    pub rank: u32,
    pub world_size: u32,
    /// Normalised: a rank list is sorted and distinct.
    pub members: Members,
    /// Barrier: empty; all-gather: the rank's bytes; broadcast: the root's bytes.
    pub value: Bytes,
    pub root: Option<u32>,
    pub timeout_ms: Option<u64>,
    /// A barrier call of a node agent's run (see `Engine::handle_calls_from`): held in
    /// the generation's record of its link, not as a waiter of its own.
    pub held: Option<Held>,
}

/// Where a node agent's calls came from (see `Engine::handle_calls_from`), opaque to
/// the engine: the I/O layer's number for the agent's connection, and its count of
/// sessions that moved off that connection when the calls came, so that it can tell
/// whether a record's routes still hold when the record is released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Link {
    pub id: u64,
    pub stamp: u64,
}

/// How a call is held in a record: its link, its route there (the I/O layer's, e.g.
/// the agent's sub-session), and room to reserve for the rest of its run.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Held {
    pub link: Link,
    pub route: u64,
    pub room: usize,
}

/// Barrier calls of one node agent that waited in one generation, held together:
/// the generation keeps one record where it would keep a waiter per call, and its
/// release is the record, answered `Done` as a whole (`Engine::take_records`)
/// rather than a reply per call. Any other end of a call (its generation failing,
/// its session's own error) is a reply to that call alone.
#[derive(Debug)]
pub struct Record {
    pub link: Link,
    /// `(route, request id)` of each call, as the I/O layer gave them.
    pub calls: Vec<(u64, u64)>,
    /// The session of each call, in the same order.
    pub sessions: Vec<SessionId>,
}

impl Record {
    /// A record with room for `room` calls, at most [`RECORD_ROOM`]: it grows from
    /// there, so that a frame whose calls each start a record of their own (one
    /// sub-session's calls, each of the next generation) reserves no room per call
    /// for all the calls after it.
    fn with_room(link: Link, room: usize) -> Record {
        let room = room.min(RECORD_ROOM);
        Record { link, calls: Vec::with_capacity(room), sessions: Vec::with_capacity(room) }
    }

    /// `(session, request id)` of each call.
    fn waiters(&self) -> impl Iterator<Item = (SessionId, u64)> + '_ {
        self.sessions.iter().zip(&self.calls).map(|(&session, &(_, id))| (session, id))
    }
}

/// Most calls a record is made with room for (see [`Record::with_room`]).
const RECORD_ROOM: usize = 16;

/// What became of a call held in a record (see [`Collectives::held_calls`]).
#[derive(Debug, Clone)]
pub(crate) enum HeldCall {
    /// Waiting in generation `generation` of the collective at `at`.
    Waiting { at: u32, generation: u64 },
    /// Its generation ended so.
    Ended(Result<(), OpError>),
}

/// Where replies and deadlines of this step go.
pub(crate) struct Ctx<'a> {
    pub job: JobId,
    pub now: Millis,
    pub out: &'a mut Vec<Outgoing>,
    pub timers: &'a mut Timers,
    /// The engine's count of requests waiting in kept replies (module `resume`).
    pub tracked: &'a mut usize,
    /// Where in `out` barriers' releases are, as `start..end`: the sessions' kept
    /// entries read them from their generations (module `resume`), so the engine does
    /// not look the sessions up for them.
    pub released: &'a mut Vec<(usize, usize)>,
    /// Every reply in `out` has been kept in its session's replies, but releases
    /// (module `resume`): a kept barrier call may be read from its generation.
    pub settled: bool,
    /// Records released (see [`Record`]).
    pub records: &'a mut Vec<Arc<Record>>,
}

impl Ctx<'_> {
    pub fn reply(&mut self, (session, request_id): (SessionId, u64), reply: Result<Response, OpError>) {
        self.out.push(Outgoing::new(session, request_id, reply));
        self.settled = false;
    }

    /// A barrier's `Done` to the calls waiting in it, which their kept entries read
    /// from the generation (module `resume`).
    fn release(&mut self, waiters: impl Iterator<Item = (SessionId, u64)>) {
        let start = self.out.len();
        self.out.extend(waiters.map(|(session, request_id)| Outgoing::new(session, request_id, Ok(Response::Done))));
        if self.out.len() > start {
            self.released.push((start, self.out.len()));
        }
    }
}

#[derive(Debug)]
struct Generation {
    shape: CallShape,
    members: MemberSet,
    arrivals: Arrivals,
    /// Sessions waiting for the release, with their request ids.
    waiters: Vec<(SessionId, u64)>,
    /// Node agents' calls waiting for the release, a record per run of one agent.
    records: Vec<Record>,
    started: Millis,
    deadline: Option<Millis>,
    /// Broadcast only: the root's value has been handed out.
    released: bool,
    /// Sum of the values gathered so far.
    bytes: usize,
}

#[derive(Debug)]
struct Collective {
    kind: CollectiveKind,
    name: String,
    /// Its members as called (normalised by `validate::members`).
    members: Members,
    /// The next collective of the same kind and name with other members, if any.
    sibling: Option<usize>,
    /// Other collectives of the same kind share its name (a flag, so that a call
    /// asks no map: see [`Collectives::crossed`]).
    shared: bool,
    calls: Calls,
    pending: BTreeMap<u64, Generation>,
    /// Failed generations, with when they failed (for a late call's error).
    failed: BTreeMap<u64, (OpError, Millis)>,
    /// [`Collectives::switches`] when a call last came to it after another's.
    last_use: u64,
    /// In [`Collectives::busy`].
    busy: bool,
}

impl Collective {
    /// Keeps what a collective no one waits in needs in little memory: its counts as
    /// one ([`Calls::settle`]), and no node of an empty map of generations (a map
    /// keeps its first node, room for a dozen generations, once emptied).
    fn settle(&mut self) {
        if self.pending.is_empty() {
            self.pending = BTreeMap::new();
            self.calls.settle();
        }
    }
}

/// Calls that came to another collective than the call before them, after which a
/// collective not called meanwhile is settled ([`Collective::settle`]): a job's
/// collectives in use keep their counts as they are.
const SETTLE_AFTER: usize = 64;

/// Calls per rank of the job that the records of ended generations may hold in all
/// (see [`EndedRecords`]), and at least this many calls for a small job.
const ENDED_CALLS_PER_RANK: usize = 4;
const ENDED_CALLS_AT_LEAST: usize = 4096;

/// The records of the job's generations that ended, oldest first, with how each
/// ended: a session resumed after a cut learns from them what became of its calls
/// held there (see `Engine::keep_held_calls`). A released call kept in a session's
/// replies is kept until the session reads it, however old; these are kept likewise,
/// as many as [`ENDED_CALLS_PER_RANK`] calls per rank of the job, so that neither
/// many names nor many rounds pile up.
#[derive(Debug, Default)]
struct EndedRecords {
    ended: VecDeque<Ended>,
    /// Calls the records in `ended` hold.
    calls: usize,
}

/// Records of a generation that ended (see [`EndedRecords`]).
#[derive(Debug)]
struct Ended {
    outcome: Result<(), OpError>,
    records: Vec<Arc<Record>>,
    calls: usize,
}

impl EndedRecords {
    /// Keeps the records of a generation that ended so.
    fn keep(&mut self, outcome: Result<(), OpError>, records: Vec<Arc<Record>>) {
        let calls = records.iter().map(|r| r.calls.len()).sum();
        self.calls += calls;
        self.ended.push_back(Ended { outcome, records, calls });
    }

    /// Drops the oldest records past the job's bound.
    fn trim(&mut self, ranks: &Ranks) {
        let limit = ENDED_CALLS_PER_RANK.saturating_mul(ranks.ever_connected()).max(ENDED_CALLS_AT_LEAST);
        while self.calls > limit {
            let Some(oldest) = self.ended.pop_front() else { break };
            self.calls -= oldest.calls;
        }
    }
}

/// How many times each rank called a collective: its next call's generation.
/// Indexed by rank while most of the vector is used, so that it costs what the
/// ranks that called hold: a name that only a few ranks (or one with a huge rank)
/// call keeps the rest in a map.
/// A count is never zero once kept, so a slot costs what a bare count would.
#[derive(Debug, Default)]
struct Calls {
    counts: ByRank<NonZeroU64>,
    /// `(ranks, count)`: every rank of `ranks` that `counts` does not hold called
    /// `count` times. What a collective no longer in use keeps ([`Calls::settle`]): a
    /// job that names each step's barrier afresh would otherwise keep a count per rank
    /// for every step it ran.
    settled: Option<(Range<u32>, NonZeroU64)>,
}

impl Calls {
    /// Counts a call of `rank`; returns its generation.
    fn next(&mut self, rank: u32) -> u64 {
        let before = self.settled_count(rank);
        let (count, made) =
            self.counts.get_or_make(rank, || before.map_or(NonZeroU64::MIN, |count| count.saturating_add(1)));
        if !made {
            *count = count.saturating_add(1);
        }
        count.get()
    }

    /// The count of a rank that called before, to take its next call's generation
    /// from and count it in one look (`None`: it never called).
    fn of_known(&mut self, rank: u32) -> Option<&mut NonZeroU64> {
        if self.settled.is_some() && !self.counts.contains(rank) {
            let count = self.settled_count(rank)?;
            return Some(self.counts.get_or_insert_with(rank, || count));
        }
        self.counts.get_mut(rank)
    }

    /// What [`Calls::settled`] says of `rank`.
    fn settled_count(&self, rank: u32) -> Option<NonZeroU64> {
        self.settled.as_ref().filter(|(ranks, _)| ranks.contains(&rank)).map(|&(_, count)| count)
    }

    /// Keeps the counts as one `(ranks, count)` if every rank of a range, and no
    /// other, called the same number of times (every member of every generation of a
    /// collective of the whole job, or of one run of ranks, has); else leaves them as
    /// they are.
    fn settle(&mut self) {
        let (settled, settled_count) = match &self.settled {
            Some((ranks, count)) => (ranks.clone(), Some(*count)),
            None => (0..0, None),
        };
        let (mut common, mut ranks, mut inside, mut outside) = (None, settled.clone(), 0u64, 0u64);
        for (rank, &count) in self.counts.iter() {
            if *common.get_or_insert(count) != count {
                return;
            }
            if settled.contains(&rank) {
                inside += 1;
            } else {
                outside += 1;
            }
            ranks = if ranks.is_empty() {
                rank..rank.saturating_add(1)
            } else {
                ranks.start.min(rank)..ranks.end.max(rank.saturating_add(1))
            };
        }
        // Ranks of the settled range that `counts` does not hold keep the settled count.
        let settled_len = u64::from(settled.end - settled.start);
        if inside < settled_len {
            match (common, settled_count) {
                (Some(count), Some(known)) if count != known => return,
                (None, known) => common = known,
                _ => {}
            }
        }
        let Some(count) = common else { return };
        if settled_len + outside == u64::from(ranks.end - ranks.start) {
            self.settled = Some((ranks, count));
            self.counts = ByRank::default();
        }
    }
}

/// A gated call of a node agent's held run of a whole-job barrier (see
/// [`Collectives::hold_world`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RunCall {
    pub session: SessionId,
    pub request_id: u64,
    pub rank: u32,
    pub world_size: u32,
    pub torch: bool,
    /// Where its reply goes on its link (see [`Held::route`]).
    pub route: u64,
}

/// Where a collective is in [`Collectives::all`]: found once for a node agent's
/// run of calls, then indexed per call.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CollectiveAt(usize);

impl CollectiveAt {
    /// As a kept barrier call names it (module `resume`): the job would need
    /// billions of collectives for an index not to fit.
    pub fn index(self) -> u32 {
        u32::try_from(self.0).unwrap_or(u32::MAX)
    }
}

#[derive(Debug, Default)]
pub(crate) struct Collectives {
    /// Per kind (see [`kind_index`]), by name, where the first collective of that
    /// name is in `all` (the others follow as its siblings): looked up by `&str`,
    /// with no key to build for each call.
    by_name: [HashMap<String, usize>; 3],
    /// Every collective the job ever called, in the order first called: none is
    /// dropped while the job lives (a rank's next call of any of them continues its
    /// count), but those not in use are settled ([`Collective::settle`]).
    all: Vec<Collective>,
    /// The collective the last call came to.
    last_called: Option<usize>,
    /// Calls so far that came to another collective than the call before them.
    switches: u64,
    /// The last [`SETTLE_AFTER`] such calls: the collective, and `switches` then.
    uses: VecDeque<(usize, u64)>,
    /// The collectives that may have generations pending, each once: what the passes
    /// over pending generations (a rank lost, a session's end, a status report) look
    /// at, rather than every collective the job ever called.
    busy: Vec<usize>,
    /// `busy`'s length when last pruned: it is pruned again once twice as long (or
    /// [`SETTLE_AFTER`] long), so that many collectives waited in at once do not make
    /// every call prune it.
    busy_pruned: usize,
    /// The list of waiters of the generation completed last, emptied: the next
    /// generation of any collective of the job takes it rather than growing one
    /// anew, as a barrier of thousands of ranks would every round (a copy of the list
    /// per doubling, into memory not in the cache). One per job: a job waits in one
    /// collective at a time, mostly, and this holds at most the largest list.
    spare_waiters: Vec<(SessionId, u64)>,
    failed_kept: usize,
    max_gather_bytes: usize,
    ended: EndedRecords,
    /// Ranks a generation failed for, lost or finished: a launcher blames a rank
    /// done early (its worker exited 0) only if its end stranded its peers.
    failed_for: BTreeSet<u32>,
    /// Per kind (see [`counted`]): what `rallypoint_*_total` and the wait histogram show.
    pub counters: [OpCounters; 3],
}

fn kind_index(kind: CollectiveKind) -> usize {
    match kind {
        CollectiveKind::Barrier => 0,
        CollectiveKind::AllGather => 1,
        CollectiveKind::Broadcast => 2,
    }
}

/// Keeps `done`, a completed generation's emptied list of waiters, as the job's spare
/// ([`Collectives::spare_waiters`]) if it is larger.
fn keep_spare(spare: &mut Vec<(SessionId, u64)>, done: Option<Vec<(SessionId, u64)>>) {
    if let Some(done) = done.filter(|done| done.is_empty() && done.capacity() > spare.capacity()) {
        *spare = done;
    }
}

/// Index of a kind in [`Collectives::counters`] (as in `counters::WAIT_OPS`).
pub(crate) fn counted(kind: CollectiveKind) -> usize {
    match kind {
        CollectiveKind::Barrier => op::BARRIER,
        CollectiveKind::AllGather => op::ALL_GATHER,
        CollectiveKind::Broadcast => op::BROADCAST,
    }
}

impl Collectives {
    pub fn new(failed_kept: usize, max_gather_bytes: usize) -> Self {
        Collectives {
            by_name: Default::default(),
            all: Vec::new(),
            last_called: None,
            switches: 0,
            uses: VecDeque::new(),
            busy: Vec::new(),
            busy_pruned: 0,
            spare_waiters: Vec::new(),
            failed_kept: failed_kept.max(1),
            max_gather_bytes,
            ended: EndedRecords::default(),
            failed_for: BTreeSet::new(),
            counters: Default::default(),
        }
    }

    /// The collective `kind` `name` over `members` (as `validate::members` normalised
    /// them), made now if it was never called; a name `status` and errors could not
    /// show (a control character) is refused then.
    pub fn find(&mut self, kind: CollectiveKind, name: &str, members: &Members) -> Result<CollectiveAt, OpError> {
        // Most calls come to the collective the call before them came to (every rank
        // of a round calls the same barrier): one comparison of the name, no hashing.
        if let Some(at) = self.last_called {
            if self.all.get(at).is_some_and(|last| last.kind == kind && last.name == name && last.members == *members) {
                return Ok(CollectiveAt(at));
            }
        }
        let first = self.by_name[kind_index(kind)].get(name).copied();
        let mut next = first;
        while let Some(at) = next {
            let Some(coll) = self.all.get(at) else { break };
            if coll.members == *members {
                return Ok(CollectiveAt(at));
            }
            next = coll.sibling;
        }
        if first.is_none() {
            super::validate::shown("collective name", name)?;
        }
        let at = self.all.len();
        let mut next = first;
        while let Some(coll) = next.and_then(|other| self.all.get_mut(other)) {
            coll.shared = true;
            next = coll.sibling;
        }
        self.all.push(Collective {
            kind,
            name: name.to_owned(),
            members: members.clone(),
            sibling: first,
            shared: first.is_some(),
            calls: Calls::default(),
            pending: BTreeMap::new(),
            failed: BTreeMap::new(),
            last_use: 0,
            busy: false,
        });
        self.by_name[kind_index(kind)].insert(name.to_owned(), at);
        Ok(CollectiveAt(at))
    }

    /// A call came to the collective at `at` after one to another: the collective
    /// not called since [`SETTLE_AFTER`] such calls ago, if any, is settled.
    fn switch_to(&mut self, at: usize) {
        if self.busy.len() > 2 * self.busy_pruned.max(SETTLE_AFTER) {
            self.busy_now();
        }
        self.last_called = Some(at);
        self.switches += 1;
        if let Some(coll) = self.all.get_mut(at) {
            coll.last_use = self.switches;
        }
        self.uses.push_back((at, self.switches));
        while self.uses.len() > SETTLE_AFTER {
            let Some((old, when)) = self.uses.pop_front() else { break };
            // Called again since, it has a later entry.
            if let Some(coll) = self.all.get_mut(old).filter(|coll| coll.last_use == when) {
                coll.settle();
            }
        }
    }

    /// [`Collectives::busy`] without the collectives no generation is pending in any
    /// more, in the order they were first called.
    fn busy_now(&mut self) {
        let all = &mut self.all;
        self.busy.retain(|&at| {
            let coll = &mut all[at];
            coll.busy = !coll.pending.is_empty();
            coll.busy
        });
        self.busy.sort_unstable();
        self.busy_pruned = self.busy.len();
    }

    /// A call of the collective at `at` (see [`Collectives::find`]). A generation is
    /// looked at for its release only when this call completed it (a broadcast: at
    /// every call), so that a run of calls costs no lookup per call beyond its own.
    /// The call's value is taken; the rest is left for a run's next call to reuse.
    pub fn arrive(
        &mut self,
        CollectiveAt(at): CollectiveAt,
        call: &mut Call,
        ranks: &Ranks,
        ctx: &mut Ctx<'_>,
    ) -> Option<u64> {
        if self.last_called != Some(at) {
            self.switch_to(at);
        }
        let failed_kept = self.failed_kept;
        let caller = (call.session, call.request_id);
        let shape = || CallShape {
            rank: call.rank,
            members: call.members.clone(),
            world_size: call.world_size,
            root: call.root,
        };
        let coll = self.all.get_mut(at)?;
        self.counters[counted(coll.kind)].arrivals += 1;
        let number = coll.calls.next(call.rank);
        if let Some((error, failed_at)) = coll.failed.get(&number) {
            let error = match error {
                OpError::CollectiveTimeout { .. } => error.came_late(ctx.now.saturating_sub(*failed_at)),
                // The rank's process declared gone then is not this one, which took
                // the rank on later: told of it as of a peer.
                OpError::PeerLost { peer, .. }
                    if peer.rank == call.rank && ranks.holder(call.rank).is_some_and(|h| h.since >= *failed_at) =>
                {
                    error.clone()
                }
                // A late call like the one that found the mismatch: told so.
                OpError::Mismatch { mine, theirs, .. } if !same_call(mine, call) && same_call(theirs, call) => {
                    error.swapped()
                }
                error => error.told_to(call.rank),
            };
            ctx.reply(caller, Err(error.seen_by(call.rank)));
            return None;
        }
        if let Some((other, generation, theirs)) = self.crossed(at, call, number, ranks) {
            let coll = &self.all[at];
            let op = OpRef { kind: coll.kind, name: coll.name.clone(), generation: number };
            let error = OpError::Mismatch { op, mine: Box::new(shape()), theirs: Box::new(theirs) };
            ctx.reply(caller, Err(error.clone()));
            // Each generation's waiters are told their own call as `mine`; the caller's
            // own generation is failed even if nobody waits in it yet, so that a later
            // call of it learns of the mismatch rather than waiting for its deadline.
            for (at, generation, error) in [(other, generation, error.swapped()), (at, number, error)] {
                if let Some(coll) = self.all.get_mut(at) {
                    coll.fail(generation, error, failed_kept, &mut self.ended, ctx);
                }
            }
            self.ended.trim(ranks);
            return None;
        }
        let coll = self.all.get_mut(at)?;
        let (kind, name) = (coll.kind, coll.name.as_str());
        let counters = &mut self.counters[counted(kind)];
        // Only a failure names the operation: most calls never build it.
        let op = || OpRef { kind, name: name.to_owned(), generation: number };
        let generation = match coll.pending.get_mut(&number) {
            Some(generation) => {
                if !same_call(&generation.shape, call) {
                    let error = OpError::Mismatch {
                        op: op(),
                        mine: Box::new(shape()),
                        theirs: Box::new(generation.shape.clone()),
                    };
                    ctx.reply(caller, Err(error.clone()));
                    coll.fail(number, error.swapped(), failed_kept, &mut self.ended, ctx);
                    return None;
                }
                generation
            }
            None => {
                let mut members = member_set(&call.members, call.world_size);
                members.resolve(ranks);
                // A member already lost dooms the generation before anyone waits.
                let needed = |r: u32| match call.root {
                    Some(root) => r == root,
                    None => members.contains(r, ranks),
                };
                if let Some(dead) = ranks.lost().find(|&r| needed(r)) {
                    counters.peer_lost += 1;
                    self.failed_for.insert(dead);
                    let error = OpError::PeerLost { op: op(), peer: ranks.info(dead, ctx.now) };
                    ctx.reply(caller, Err(error.told_to(call.rank)));
                    coll.remember_failure(number, error, failed_kept, ctx.now);
                    return None;
                }
                let arrivals = Arrivals::for_members(&members, ranks);
                if !coll.busy {
                    coll.busy = true;
                    self.busy.push(at);
                }
                coll.pending.entry(number).or_insert(Generation {
                    shape: shape(),
                    members,
                    arrivals,
                    waiters: std::mem::take(&mut self.spare_waiters),
                    records: Vec::new(),
                    started: ctx.now,
                    deadline: None,
                    released: false,
                    bytes: 0,
                })
            }
        };

        generation.bytes = generation.bytes.saturating_add(call.value.len());
        if generation.bytes > self.max_gather_bytes {
            let error = OpError::TooLarge {
                what: format!("{}: the gathered values' total size", op()),
                len: generation.bytes as u64,
                limit: self.max_gather_bytes as u64,
            };
            ctx.reply(caller, Err(error.clone()));
            coll.fail(number, error, failed_kept, &mut self.ended, ctx);
            return None;
        }
        generation.arrivals.insert(call.rank, std::mem::take(&mut call.value));
        let complete = generation.members.count() == Some(generation.arrivals.count());
        if kind == CollectiveKind::Broadcast {
            if generation.released {
                let value = generation.arrivals.get(generation.shape.root.unwrap_or(0)).cloned().unwrap_or_default();
                ctx.reply(caller, Ok(Response::Value(value)));
            } else {
                generation.waiters.push(caller);
            }
        } else {
            match call.held {
                Some(held) if kind == CollectiveKind::Barrier => generation.hold(held, caller),
                _ => generation.waiters.push(caller),
            }
        }
        if let Some(timeout) = call.timeout_ms {
            let deadline = ctx.now.saturating_add(timeout);
            if generation.deadline.is_none_or(|d| deadline < d) {
                generation.deadline = Some(deadline);
                ctx.timers.schedule(
                    deadline,
                    Timer::Collective(Box::new(CollectiveDeadline {
                        job: ctx.job,
                        kind,
                        name: name.to_owned(),
                        at,
                        generation: number,
                    })),
                );
            }
        }
        if complete || kind == CollectiveKind::Broadcast {
            let done = coll.progress(kind, number, counters, &mut self.ended, failed_kept, ctx);
            keep_spare(&mut self.spare_waiters, done);
            self.ended.trim(ranks);
        }
        (kind == CollectiveKind::Barrier).then_some(number)
    }

    /// Whether other collectives of the same kind share the name of the one at `at`.
    fn has_siblings(&self, at: usize) -> bool {
        self.all.get(at).is_some_and(|coll| coll.shared)
    }

    /// A generation of the same kind and name over other members that the call at
    /// `at` (generation `number`) and it would each wait in for the other: one where
    /// the caller is a member and has not arrived, and a rank that has arrived there
    /// is a member of this call and has not arrived in `number`. Such calls of a
    /// process that waits in one call at a time never meet: rank 1 called `x` over
    /// the whole job, rank 0 over ranks 0 and 1. That generation, as
    /// `(collective, generation, the waiting rank's call)`. Groups of one name that
    /// do not overlap (each role's, each pipeline stage's) never cross.
    fn crossed(&self, at: usize, call: &Call, number: u64, ranks: &Ranks) -> Option<(usize, u64, CallShape)> {
        if !self.has_siblings(at) {
            return None;
        }
        let coll = self.all.get(at)?;
        let first = *self.by_name[kind_index(coll.kind)].get(coll.name.as_str())?;
        let here = coll.pending.get(&number);
        let mut mine = member_set(&call.members, call.world_size);
        mine.resolve(ranks);
        let mut next = Some(first);
        while let Some(other) = next {
            let sibling = self.all.get(other)?;
            next = sibling.sibling;
            if other == at {
                continue;
            }
            for (&generation, g) in &sibling.pending {
                if !g.blocks() || !g.members.contains(call.rank, ranks) || g.arrivals.contains(call.rank) {
                    continue;
                }
                let waiting = g.arrivals.ranks().into_iter().find(|&r| {
                    r != call.rank && mine.contains(r, ranks) && !here.is_some_and(|h| h.arrivals.contains(r))
                });
                if let Some(rank) = waiting {
                    let CallShape { members, world_size, root, .. } = g.shape.clone();
                    return Some((other, generation, CallShape { rank, members, world_size, root }));
                }
            }
        }
        None
    }

    /// The calls of a node agent's held run of the whole-job barrier at `at`, from
    /// `from` on, for as long as each joins a generation that already waits with the
    /// shape the call has: each is touched, counted, and held in its link's record,
    /// as [`Collectives::arrive`] would, with nothing built or checked per call that
    /// the run shares. Stops after a call that completes its generation (released
    /// then) and before a call it does not take, whose index it returns (the caller
    /// runs that one through `arrive`); the run's length at its end.
    #[allow(clippy::too_many_arguments)]
    pub fn hold_world(
        &mut self,
        CollectiveAt(at): CollectiveAt,
        calls: &[RunCall],
        from: usize,
        (link, timeout_ms): (Link, Option<u64>),
        ranks: &mut Ranks,
        lease_ms: u64,
        ctx: &mut Ctx<'_>,
    ) -> usize {
        // A name shared with other groups: each call is looked at for crossing them.
        if self.has_siblings(at) {
            return from;
        }
        let Some(coll) = self.all.get_mut(at) else { return from };
        let counters = &mut self.counters[counted(CollectiveKind::Barrier)];
        let (mut i, mut completed, mut deadline_seen) = (from, None, None);
        let Collective { kind, calls: counts, pending, failed, name, .. } = coll;
        if *kind != CollectiveKind::Barrier {
            return from;
        }
        while let Some(c) = calls.get(i) {
            // A rank's first call makes its count: `arrive` does that.
            let Some(count) = counts.of_known(c.rank) else { break };
            let number = count.get().saturating_add(1);
            if !failed.is_empty() && failed.contains_key(&number) {
                break;
            }
            let Some(g) = pending.get_mut(&number) else { break };
            let shape = &g.shape;
            let same = matches!(shape.members, crate::Members::World)
                && shape.world_size == c.world_size
                && shape.root.is_none()
                && c.rank < c.world_size;
            if !same {
                break;
            }
            *count = count.saturating_add(1);
            let lease = if c.torch { 0 } else { lease_ms };
            if let super::ranks::Change::ArmLease(due) = ranks.touch(c.rank, ctx.now, lease) {
                ctx.timers.schedule(due, Timer::Lease { job: ctx.job, rank: c.rank });
            }
            counters.arrivals += 1;
            g.arrivals.insert_empty(c.rank);
            g.hold(Held { link, route: c.route, room: calls.len() - i }, (c.session, c.request_id));
            // The run's calls share their timeout and time: one look per generation.
            if let (Some(timeout), true) = (timeout_ms, deadline_seen != Some(number)) {
                deadline_seen = Some(number);
                let deadline = ctx.now.saturating_add(timeout);
                if g.deadline.is_none_or(|d| deadline < d) {
                    g.deadline = Some(deadline);
                    let (kind, name, generation) = (CollectiveKind::Barrier, name.clone(), number);
                    let deadline_of = CollectiveDeadline { job: ctx.job, kind, name, at, generation };
                    ctx.timers.schedule(deadline, Timer::Collective(Box::new(deadline_of)));
                }
            }
            i += 1;
            if g.members.count() == Some(g.arrivals.count()) {
                completed = Some(number);
                break;
            }
        }
        if let Some(number) = completed {
            let done = coll.progress(CollectiveKind::Barrier, number, counters, &mut self.ended, self.failed_kept, ctx);
            keep_spare(&mut self.spare_waiters, done);
            self.ended.trim(ranks);
        }
        i
    }

    /// Whether generation `generation` of the collective at `at` (see
    /// [`CollectiveAt::index`]) still waits for arrivals, with `rank`'s in it: a
    /// number released may be pending again, made by calls of other ranks (a name
    /// used by several member sets), and `rank` made its call of that number.
    pub fn is_pending(&self, at: u32, generation: u64, rank: Option<u32>) -> bool {
        let coll = usize::try_from(at).ok().and_then(|at| self.all.get(at));
        // Mostly asked of a generation older than every one pending.
        let Some(coll) = coll else { return false };
        let pending = match coll.pending.first_key_value() {
            Some((&first, _)) if generation >= first => coll.pending.get(&generation),
            _ => None,
        };
        pending.is_some_and(|g| rank.is_none_or(|rank| g.arrivals.contains(rank)))
    }

    /// A rank of the job connected: role member sets waiting on it may now be known.
    pub fn rank_connected(&mut self, ranks: &Ranks, ctx: &mut Ctx<'_>) {
        self.busy_now();
        for &at in &self.busy {
            let coll = &mut self.all[at];
            let unresolved: Vec<u64> = coll
                .pending
                .iter_mut()
                .filter(|(_, g)| g.members.count().is_none())
                .filter_map(|(gen, g)| g.members.resolve(ranks).then_some(*gen))
                .collect();
            for generation in unresolved {
                let counters = &mut self.counters[counted(coll.kind)];
                let done = coll.progress(coll.kind, generation, counters, &mut self.ended, self.failed_kept, ctx);
                keep_spare(&mut self.spare_waiters, done);
            }
        }
        self.ended.trim(ranks);
    }

    /// Ranks a generation failed for (see `failed_for`).
    pub fn failed_for(&self) -> &BTreeSet<u32> {
        &self.failed_for
    }

    /// Something else failed for `rank` (a torch wait for its address: module `torch`).
    pub fn failed_for_rank(&mut self, rank: u32) {
        self.failed_for.insert(rank);
    }

    /// `rank` was lost (or finished): fail every pending generation that still needs it.
    pub fn rank_lost(&mut self, rank: u32, ranks: &Ranks, ctx: &mut Ctx<'_>) {
        let failed_kept = self.failed_kept;
        // Sessions of the rank itself that may still wait (its process stopped, or a
        // child outlived its worker): told that it is the one gone.
        let own = ranks.holder(rank).map(|holder| &holder.sessions);
        self.busy_now();
        for &at in &self.busy {
            let coll = &mut self.all[at];
            let kind = coll.kind;
            let doomed: Vec<u64> = coll
                .pending
                .iter()
                .filter(|(_, g)| match (kind, g.shape.root) {
                    (CollectiveKind::Broadcast, Some(root)) => root == rank && !g.released,
                    _ => g.members.contains(rank, ranks),
                })
                .map(|(gen, _)| *gen)
                .collect();
            if !doomed.is_empty() {
                self.failed_for.insert(rank);
            }
            for generation in doomed {
                self.counters[counted(kind)].peer_lost += 1;
                let op = OpRef { kind, name: coll.name.clone(), generation };
                let error = OpError::PeerLost { op, peer: ranks.info(rank, ctx.now) };
                if let (Some(own), Some(g)) = (own, coll.pending.get_mut(&generation)) {
                    g.waiters.retain(|&(session, id)| {
                        let own = own.contains(&session);
                        if own {
                            ctx.reply((session, id), Err(error.told_to(rank)));
                        }
                        !own
                    });
                }
                coll.fail(generation, error, failed_kept, &mut self.ended, ctx);
            }
        }
        self.ended.trim(ranks);
    }

    /// A collective's deadline fired: if that generation still waits, fail it for every
    /// waiter, naming each missing member.
    pub fn deadline(&mut self, deadline: &CollectiveDeadline, at: Millis, ranks: &Ranks, ctx: &mut Ctx<'_>) {
        let CollectiveDeadline { kind, ref name, at: index, generation, .. } = *deadline;
        let failed_kept = self.failed_kept;
        let Some(coll) = self.all.get_mut(index).filter(|coll| coll.kind == kind && coll.name == *name) else {
            return;
        };
        let Some(g) = coll.pending.get(&generation) else { return };
        if g.deadline != Some(at) || g.released {
            return;
        }
        let members = g.members.count().unwrap_or(g.shape.world_size as usize);
        self.counters[counted(kind)].timeouts += 1;
        let error = OpError::CollectiveTimeout {
            op: OpRef { kind, name: name.to_owned(), generation },
            waited_ms: ctx.now.saturating_sub(g.started),
            members: u32::try_from(members).unwrap_or(u32::MAX),
            missing: g.missing(kind, ranks, ctx.now),
            before_call_ms: None,
        };
        coll.fail(generation, error, failed_kept, &mut self.ended, ctx);
        self.ended.trim(ranks);
    }

    /// Every generation somebody is blocked in, by name, kind and generation.
    fn waited_in(&self) -> Vec<(&str, CollectiveKind, u64, &Generation)> {
        let mut blocked: Vec<(&str, CollectiveKind, u64, &Generation)> = Vec::new();
        for coll in self.busy.iter().map(|&at| &self.all[at]) {
            // A broadcast released to the waiters stays pending until every member
            // came, but blocks nobody.
            let waiting = coll.pending.iter().filter(|(_, g)| g.blocks());
            blocked.extend(waiting.map(|(generation, g)| (coll.name.as_str(), coll.kind, *generation, g)));
        }
        blocked.sort_by_key(|&(name, kind, generation, _)| (name, kind.to_string(), generation));
        blocked
    }

    /// For `rallypoint status`: a line per generation that somebody is blocked in,
    /// saying how long, how many arrived, and who is missing (what is known of each,
    /// the first [`Missing::NAMED`] by name), ordered by name and generation.
    pub fn report(&self, ranks: &Ranks, now: Millis) -> Vec<String> {
        self.waited_in()
            .into_iter()
            .map(|(name, kind, generation, g)| {
                let op = OpRef { kind, name: name.to_owned(), generation };
                let members = g.members.count().map_or_else(
                    || "? (a role's members are known once every rank connected)".to_owned(),
                    |n| n.to_string(),
                );
                let what = match (kind, g.shape.root) {
                    (CollectiveKind::Broadcast, Some(_)) => "the root has not arrived",
                    _ => "missing",
                };
                let missing = g.missing(kind, ranks, now);
                // Groups of one name are told apart by their members.
                let over = match &g.shape.members {
                    Members::World => String::new(),
                    members => format!(" over {members}"),
                };
                format!(
                    "waiting: {op}{over} for {}: {} of {members} arrived; {what} ({}): {missing}",
                    Secs(now.saturating_sub(g.started)),
                    g.arrivals.count(),
                    missing.count(),
                )
            })
            .collect()
    }

    /// Fails the waits of `session` with `error`, leaving its arrivals counted.
    pub fn fail_session(&mut self, session: SessionId, error: &OpError, ctx: &mut Ctx<'_>) {
        self.busy_now();
        for &at in &self.busy {
            let coll = &mut self.all[at];
            for g in coll.pending.values_mut() {
                g.waiters.retain(|&(s, id)| {
                    if s != session {
                        return true;
                    }
                    ctx.reply((s, id), Err(error.clone()));
                    false
                });
                // Out of its record too, so that the record's release does not answer it again.
                for record in &mut g.records {
                    let mut i = 0;
                    while let Some(&s) = record.sessions.get(i) {
                        if s != session {
                            i += 1;
                            continue;
                        }
                        record.sessions.swap_remove(i);
                        let (_, id) = record.calls.swap_remove(i);
                        ctx.reply((s, id), Err(error.clone()));
                    }
                }
            }
        }
    }

    /// The calls of `session` held in records (see [`Record`]): those waiting, and those
    /// of the generations that ended whose records are still kept (see
    /// [`EndedRecords`]). Looked for when the session resumes, so that calls it sends
    /// again are answered as its kept replies would answer them.
    pub fn held_calls(&self, session: SessionId) -> Vec<(u64, HeldCall)> {
        let mut found = Vec::new();
        let mine =
            |record: &Record| record.waiters().filter(|&(s, _)| s == session).map(|(_, id)| id).collect::<Vec<_>>();
        // In the order the collectives were first called, as `busy_now` keeps them.
        let mut busy = self.busy.clone();
        busy.sort_unstable();
        for (at, coll) in busy.into_iter().map(|at| (at, &self.all[at])) {
            let at = u32::try_from(at).unwrap_or(u32::MAX);
            for (&generation, g) in &coll.pending {
                for record in &g.records {
                    found.extend(mine(record).into_iter().map(|id| (id, HeldCall::Waiting { at, generation })));
                }
            }
        }
        for ended in &self.ended.ended {
            for record in &ended.records {
                found.extend(mine(record).into_iter().map(|id| (id, HeldCall::Ended(ended.outcome.clone()))));
            }
        }
        found
    }

    /// The job was aborted: fail everything pending.
    pub fn fail_all(&mut self, error: &OpError, ranks: &Ranks, ctx: &mut Ctx<'_>) {
        self.busy_now();
        for &at in &self.busy {
            let coll = &mut self.all[at];
            for (_, g) in std::mem::take(&mut coll.pending) {
                for waiter in g.waiters.into_iter().chain(g.records.iter().flat_map(Record::waiters)) {
                    ctx.reply(waiter, Err(error.clone()));
                }
                if !g.records.is_empty() {
                    self.ended.keep(Err(error.clone()), g.records.into_iter().map(Arc::new).collect());
                }
            }
        }
        self.ended.trim(ranks);
    }
}

impl Generation {
    /// Holds a call in the record of its link, the latest one if it is that link's.
    fn hold(&mut self, held: Held, (session, request_id): (SessionId, u64)) {
        let record = match self.records.last_mut() {
            Some(record) if record.link == held.link => record,
            _ => {
                self.records.push(Record::with_room(held.link, held.room));
                let Some(record) = self.records.last_mut() else { return };
                record
            }
        };
        record.calls.push((held.route, request_id));
        record.sessions.push(session);
    }

    /// Whether anybody waits for its release (a record whose sessions all failed
    /// alone holds nobody).
    fn blocks(&self) -> bool {
        !self.waiters.is_empty() || self.records.iter().any(|record| !record.calls.is_empty())
    }

    /// Who the generation still waits for: a broadcast, only its root.
    fn missing(&self, kind: CollectiveKind, ranks: &Ranks, now: Millis) -> Missing {
        let ranges = match (kind, self.shape.root) {
            (CollectiveKind::Broadcast, Some(root)) => Box::new(std::iter::once((root, root))),
            _ => self.members.missing(&self.arrivals, ranks),
        };
        let (named, rest) = split(ranges, Missing::NAMED);
        Missing::new(named.into_iter().map(|r| ranks.info(r, now)).collect(), rest)
    }
}

impl Collective {
    /// Releases the generation if everyone it waits for is there (or fails it: a
    /// broadcast whose every member came without its root); once it is complete,
    /// its emptied list of waiters, for [`keep_spare`].
    fn progress(
        &mut self,
        kind: CollectiveKind,
        generation: u64,
        counters: &mut OpCounters,
        book: &mut EndedRecords,
        failed_kept: usize,
        ctx: &mut Ctx<'_>,
    ) -> Option<Vec<(SessionId, u64)>> {
        let g = self.pending.get_mut(&generation)?;
        let complete = g.members.count() == Some(g.arrivals.count());
        let waited = ctx.now.saturating_sub(g.started);
        match kind {
            CollectiveKind::Broadcast => {
                let root = g.shape.root.unwrap_or(0);
                if let (false, Some(value)) = (g.released, g.arrivals.get(root)) {
                    let value = value.clone();
                    for waiter in g.waiters.drain(..) {
                        ctx.reply(waiter, Ok(Response::Value(value.clone())));
                    }
                    g.released = true;
                    counters.releases += 1;
                    counters.wait.observe(waited);
                }
                if complete && !g.released {
                    // The root is not a member: a role's root is checked when it calls
                    // or connects, and it connected after the members called.
                    let error =
                        OpError::Invalid(format!("root rank {root} is not among its members, {}", g.shape.members));
                    self.fail(generation, error, failed_kept, book, ctx);
                    return None;
                }
            }
            CollectiveKind::Barrier if complete => {
                counters.releases += 1;
                counters.wait.observe(waited);
                ctx.release(g.waiters.drain(..));
                if !g.records.is_empty() {
                    let records: Vec<Arc<Record>> = g.records.drain(..).map(Arc::new).collect();
                    ctx.records.extend(records.iter().cloned());
                    book.keep(Ok(()), records);
                }
            }
            CollectiveKind::AllGather if complete => {
                counters.releases += 1;
                counters.wait.observe(waited);
                let values: Vec<Bytes> =
                    g.members.in_order().map(|r| g.arrivals.get(r).cloned().unwrap_or_default()).collect();
                // One result for all: each waiter's reply is an O(1) clone of it.
                let gathered = Gathered::new(values);
                for waiter in g.waiters.drain(..) {
                    ctx.reply(waiter, Ok(Response::Gathered(gathered.clone())));
                }
            }
            _ => {}
        }
        let done = complete.then(|| self.pending.remove(&generation)).flatten();
        done.map(|done| done.waiters)
    }

    fn fail(
        &mut self,
        generation: u64,
        error: OpError,
        failed_kept: usize,
        book: &mut EndedRecords,
        ctx: &mut Ctx<'_>,
    ) {
        if let Some(g) = self.pending.remove(&generation) {
            for waiter in g.waiters.into_iter().chain(g.records.iter().flat_map(Record::waiters)) {
                ctx.reply(waiter, Err(error.clone()));
            }
            if !g.records.is_empty() {
                let records = g.records.into_iter().map(Arc::new).collect();
                book.keep(Err(error.clone()), records);
            }
        }
        self.remember_failure(generation, error, failed_kept, ctx.now);
    }

    fn remember_failure(&mut self, generation: u64, error: OpError, failed_kept: usize, now: Millis) {
        self.failed.insert(generation, (error, now));
        while self.failed.len() > failed_kept {
            self.failed.pop_first();
        }
    }
}

fn member_set(members: &Members, world_size: u32) -> MemberSet {
    match members {
        Members::World => MemberSet::World(world_size),
        Members::Ranks(list) => MemberSet::Listed(list.clone()),
        Members::Role(name) => MemberSet::Role { name: name.to_string(), world_size, resolved: None },
    }
}

/// Two calls belong to the same generation only if they agree on everything but the caller.
fn same_call(a: &CallShape, b: &Call) -> bool {
    a.members == b.members && a.world_size == b.world_size && a.root == b.root
}

/// A generation somebody is blocked in, for a snapshot: what it waits for, and the
/// ranks that arrived in it.
pub(crate) struct Blocked {
    pub wait: crate::snapshot::CollectiveWait,
    pub arrived: Vec<u32>,
}

impl Collectives {
    /// Every generation somebody is blocked in, ordered as [`Collectives::report`].
    pub fn blocked(&self, ranks: &Ranks, now: Millis) -> Vec<Blocked> {
        self.waited_in()
            .into_iter()
            .map(|(name, kind, generation, g)| {
                let missing = g.missing(kind, ranks, now);
                let wait = crate::snapshot::CollectiveWait {
                    op: crate::counters::WAIT_OPS[counted(kind)].to_owned(),
                    name: name.to_owned(),
                    generation,
                    waited_ms: now.saturating_sub(g.started),
                    members: g.members.count().map(|n| n as u64),
                    arrived: g.arrivals.count() as u64,
                    root: g.shape.root.filter(|_| kind == CollectiveKind::Broadcast),
                    missing_count: missing.count(),
                    missing: missing.named().iter().map(|info| super::snapshot::rank_view(info, None)).collect(),
                    missing_more: crate::snapshot::RangeSet {
                        ranges: missing.rest().ranges.clone(),
                        count: missing.rest().count,
                    },
                };
                Blocked { wait, arrived: g.arrivals.ranks() }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU64;

    use std::sync::Arc;

    use super::{kind_index, Call, Calls, Collectives, Ctx, Outgoing, Record, SETTLE_AFTER};
    use crate::engine::ranks::Ranks;
    use crate::engine::timers::Timers;
    use crate::{CollectiveKind, Members, Response, SessionId};

    fn count(n: u64) -> NonZeroU64 {
        NonZeroU64::new(n).expect("a count")
    }

    #[test]
    fn settled_counts_go_on_as_the_counts_they_replace() {
        let mut calls = Calls::default();
        for _ in 0..3 {
            for rank in 0..4 {
                calls.next(rank);
            }
        }
        calls.settle();
        assert_eq!((calls.settled.clone(), calls.counts.len()), (Some((0..4, count(3))), 0));
        assert_eq!(calls.next(1), 4, "a rank's next call joins the generation after its last");
        assert_eq!(calls.next(4), 1, "a rank that never called starts at 1");
        assert_eq!(calls.of_known(2).map(|c| c.get()), Some(3));
        assert_eq!(calls.of_known(9), None);
        // Not all alike (ranks 1 and 4 moved on, 2 did not): left as they are.
        calls.settle();
        assert_eq!((calls.settled.clone(), calls.counts.len()), (Some((0..4, count(3))), 3));
        // Every rank of 0..5 at 4 calls: settled anew.
        for rank in [0, 2, 3, 4, 4, 4] {
            calls.next(rank);
        }
        calls.settle();
        assert_eq!((calls.settled.clone(), calls.counts.len()), (Some((0..5, count(4))), 0));
        // Ranks with a gap between them are not one range: not settled.
        let mut gap = Calls::default();
        gap.next(0);
        gap.next(2);
        gap.settle();
        assert_eq!((gap.settled.clone(), gap.counts.len()), (None, 2));
        // A run of ranks not from 0 (a subgroup's), and then one more rank after it.
        let mut group = Calls::default();
        for rank in [4, 5, 6, 7, 4, 5, 6, 7] {
            group.next(rank);
        }
        group.settle();
        assert_eq!((group.settled.clone(), group.counts.len()), (Some((4..8, count(2))), 0));
        assert_eq!((group.next(3), group.next(3), group.next(8), group.next(8)), (1, 2, 1, 2));
        group.settle();
        assert_eq!((group.settled.clone(), group.counts.len()), (Some((3..9, count(2))), 0));
        assert_eq!((group.next(3), group.next(5), group.next(2)), (3, 3, 1));
    }

    /// What [`Collectives::arrive`] writes to, kept for a test to read.
    #[derive(Default)]
    struct Sinks {
        out: Vec<Outgoing>,
        timers: Timers,
        tracked: usize,
        released: Vec<(usize, usize)>,
        records: Vec<Arc<Record>>,
    }

    impl Sinks {
        fn ctx(&mut self) -> Ctx<'_> {
            Ctx {
                job: 1,
                now: 0,
                out: &mut self.out,
                timers: &mut self.timers,
                tracked: &mut self.tracked,
                released: &mut self.released,
                settled: true,
                records: &mut self.records,
            }
        }
    }

    /// Rank `rank`'s call `request_id` of a whole-job barrier, `world_size` ranks.
    fn barrier_call(rank: u32, world_size: u32, request_id: u64) -> Call {
        Call {
            session: SessionId(u64::from(rank) + 1),
            request_id,
            rank,
            world_size,
            members: Members::World,
            value: bytes::Bytes::new(),
            root: None,
            timeout_ms: None,
            held: None,
        }
    }

    #[test]
    fn collectives_out_of_use_are_settled_and_those_in_use_are_not() {
        let mut collectives = Collectives::new(4, 1 << 20);
        let ranks = Ranks::default();
        let mut sinks = Sinks::default();
        let mut ctx = sinks.ctx();
        let mut arrive = |collectives: &mut Collectives, name: &str, rank: u32| {
            let at = collectives.find(CollectiveKind::Barrier, name, &Members::World).expect("a printable name");
            collectives.arrive(at, &mut barrier_call(rank, 2, 1), &ranks, &mut ctx);
        };
        // "step" is called between the others; each other name once, by both ranks.
        let others = 3 * SETTLE_AFTER;
        for i in 0..others {
            for rank in 0..2 {
                arrive(&mut collectives, "step", rank);
                arrive(&mut collectives, &format!("once/{i}"), rank);
            }
        }
        // One rank of a last name waits.
        arrive(&mut collectives, "waits", 0);
        let settled = |name: &str| {
            let at = collectives.by_name[0][name];
            let coll = &collectives.all[at];
            (coll.calls.settled.clone(), coll.calls.counts.len())
        };
        assert_eq!(settled("once/0"), (Some((0..2, count(1))), 0));
        assert_eq!(settled(&format!("once/{}", others - 2 * SETTLE_AFTER)), (Some((0..2, count(1))), 0));
        assert_eq!(settled(&format!("once/{}", others - 1)), (None, 2), "used within the last switches");
        assert_eq!(settled("step"), (None, 2), "in use");
        assert_eq!(settled("waits"), (None, 1));
        assert!(sinks.out.iter().all(|o| o.reply == Ok(Response::Done)));
        // The last call came to barrier "waits": found again, as by name; an
        // all-gather of the same name is another collective.
        let waits = collectives.find(CollectiveKind::Barrier, "waits", &Members::World).expect("a printable name");
        assert_eq!((Some(waits.0), collectives.by_name[0]["waits"]), (collectives.last_called, waits.0));
        let gather = collectives.find(CollectiveKind::AllGather, "waits", &Members::World).expect("a printable name");
        assert_ne!(gather.0, waits.0, "another kind, another collective");
        assert_eq!(collectives.by_name[kind_index(CollectiveKind::AllGather)]["waits"], gather.0);
        assert_eq!(
            collectives.find(CollectiveKind::Barrier, "step", &Members::World).expect("a printable name").0,
            collectives.by_name[0]["step"]
        );
    }

    #[test]
    fn a_generation_takes_the_list_of_waiters_the_last_one_released() {
        let n = 64;
        let mut collectives = Collectives::new(4, 1 << 20);
        let ranks = Ranks::default();
        let mut sinks = Sinks::default();
        let mut ctx = sinks.ctx();
        let mut lists = Vec::new();
        // Three rounds of one barrier, then one of a barrier named afresh.
        for (round, name) in [(1, "step"), (2, "step"), (3, "step"), (1, "next")] {
            let at = collectives.find(CollectiveKind::Barrier, name, &Members::World).expect("a printable name");
            for rank in 0..n {
                collectives.arrive(at, &mut barrier_call(rank, n, round), &ranks, &mut ctx);
                if let (0, Some(last)) = (rank, lists.last()) {
                    let waiting = collectives.all[at.0].pending.values().next().expect("rank 0 waits");
                    assert_eq!(waiting.waiters.as_ptr(), *last, "{name} {round} waits in the list kept");
                    assert_eq!(collectives.spare_waiters.capacity(), 0, "taken, not copied");
                }
            }
            let spare = &collectives.spare_waiters;
            assert!(spare.is_empty() && spare.capacity() >= n as usize, "{name} {round}: kept, emptied");
            lists.push(spare.as_ptr());
        }
        assert_eq!(sinks.out.len(), 4 * n as usize, "each round released every rank");
    }

    #[test]
    fn a_ranks_count_moves_into_the_vector_with_the_ranks_that_come() {
        let mut calls = Calls::default();
        // A rank far beyond the few counted is kept aside.
        assert_eq!((calls.next(1_000), calls.next(1_000)), (1, 2));
        assert!(calls.counts.dense_len() < 1_000, "one rank costs no vector of its rank's size");
        for rank in 0..600 {
            assert_eq!(calls.next(rank), 1);
        }
        // With enough ranks counted, its next call moves it into the vector.
        assert_eq!(calls.next(1_000), 3);
        assert!(calls.counts.dense_len() > 1_000 && calls.counts.sparse_len() == 0, "moved with the ranks that came");
        assert_eq!(calls.next(u32::MAX), 1);
        assert!(calls.counts.dense_len() <= 2 * 602 + 64);
    }
}
