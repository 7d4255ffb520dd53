//! A job's key-value data and the requests blocked until keys exist.
//! Semantics follow PyTorch's TCPStore wherever the operation exists there.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashSet, VecDeque};

use super::HashMap;

use bytes::{Bytes, BytesMut};
use smallvec::SmallVec;

use crate::counters::{op, OpCounters};
use crate::{Millis, OpError, Outgoing, Reply, Response, SessionId};

/// Store-barrier keys a status report lists after their rounds were released: enough
/// for the few a job reuses, or the last rounds of one that takes a key per round.
pub(crate) const RECENT_BARRIER_KEYS: usize = 16;

/// What a blocked request returns once its keys exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WaitKind {
    Wait,
    Get,
    MultiGet,
    /// A TCPStore store barrier: released once the counter at its key reaches `world_size`.
    Barrier {
        world_size: i64,
    },
}

/// A request blocked on keys, identified by its session and request id.
#[derive(Debug)]
pub(crate) struct KeyWait {
    pub kind: WaitKind,
    /// Most waits are on one key (a get, a store barrier): kept inline then.
    pub keys: SmallVec<[Bytes; 1]>,
    /// Distinct keys still absent when last counted; a re-check runs when it reaches 0.
    missing: usize,
    pub started: Millis,
}

pub(crate) type WaitId = (SessionId, u64);

/// Answers wait `id`: the store's replies go straight into the engine's outgoing
/// ones (`done`), ahead of the reply to the request that completed the wait.
fn answer(done: &mut Vec<Outgoing>, (session, request_id): WaitId, reply: Reply) {
    done.push(Outgoing::new(session, request_id, reply));
}

/// The store barriers of one world size waiting at a key.
type WaitSet = HashSet<WaitId, foldhash::fast::RandomState>;

#[derive(Debug, Default)]
pub(crate) struct Store {
    data: HashMap<Bytes, Bytes>,
    waiters_by_key: HashMap<Bytes, Vec<WaitId>>,
    /// By request: every arrival of a round looks its own up, inserts it and
    /// takes it out again, which a hash map does without the comparisons an
    /// ordered map makes at each of its levels.
    waits: HashMap<WaitId, KeyWait>,
    /// The request ids of each session's waits, in no order, so that a session's
    /// waits are found without looking at anyone else's. A session's list stays
    /// (empty) until the session's waits are dropped, so that a rank waiting once
    /// per round does not allocate it every round.
    by_session: HashMap<SessionId, Vec<u64>>,
    /// TCPStore queues: a namespace apart from `data` (torch's libuv server does the same).
    queues: HashMap<Bytes, VecDeque<Bytes>>,
    /// Store barriers waiting for the counter at their key, by the world size they
    /// state (a round's usually all state one): an arrival releases the waiters it
    /// satisfies without looking at the others, and joining or leaving a round is
    /// a hash of the request, not a search through every waiter.
    barrier_waiters: HashMap<Bytes, BTreeMap<i64, WaitSet>>,
    /// The largest set a release emptied, kept for the next round's key: a round's
    /// set grows to the world size, and growing it afresh every round would rehash
    /// it each time it doubles.
    spare_waiters: WaitSet,
    /// The waiters a release answers, sorted (their sets have no order); kept for
    /// the next release.
    releasing: Vec<WaitId>,
    /// The keys last used as store-barrier counters, the latest last: with the keys
    /// that have waiters, the ones status reports list. Bounded: a job that counts
    /// each round on a key of its own would otherwise have every report list, and
    /// count the waiters of, every round it ever ran.
    recent_barrier_keys: VecDeque<Bytes>,
    /// The time of the request being handled (set by the caller before each): when a
    /// wait it completes ends.
    pub now: Millis,
    /// Store barriers, gets, waits and multi-gets (see [`WaitKind::counted`]).
    pub counters: [OpCounters; 4],
}

impl WaitKind {
    /// Index in [`Store::counters`]; `counters::WAIT_OPS` names them from `op::STORE_BARRIER` on.
    pub fn counted(self) -> usize {
        let index = match self {
            WaitKind::Barrier { .. } => op::STORE_BARRIER,
            WaitKind::Get => op::GET,
            WaitKind::Wait => op::WAIT,
            WaitKind::MultiGet => op::MULTI_GET,
        };
        index - op::STORE_BARRIER
    }
}

impl Store {
    /// Whether a wait or check on `key` is satisfied: the key exists, or (as in torch's
    /// libuv server) a queue of that name is not empty.
    pub fn exists(&self, key: &[u8]) -> bool {
        self.data.contains_key(key) || self.queues.get(key).is_some_and(|q| !q.is_empty())
    }

    /// Whether a wait on all of `keys` would be satisfied now (TCPStore's CHECK).
    pub fn all_exist(&self, keys: &[Bytes]) -> bool {
        keys.iter().all(|k| self.exists(k))
    }

    pub fn get(&self, key: &[u8]) -> Option<&Bytes> {
        self.data.get(key)
    }

    /// Whether request `id` waits for keys.
    pub fn is_waiting(&self, id: WaitId) -> bool {
        self.waits.contains_key(&id)
    }

    /// Every wait, in the order of their ids (session, then request).
    pub fn waits(&self) -> impl Iterator<Item = (&WaitId, &KeyWait)> {
        let mut waits: Vec<_> = self.waits.iter().collect();
        waits.sort_unstable_by_key(|(id, _)| **id);
        waits.into_iter()
    }

    /// The wait of request `id`, if it is blocked.
    pub fn wait(&self, id: WaitId) -> Option<&KeyWait> {
        self.waits.get(&id)
    }

    /// The gets, waits and multi-gets blocked on `key` (not store barriers: they wait
    /// for a count, not a key), without looking at any other wait.
    pub fn waiting_on<'a>(&'a self, key: &[u8]) -> impl Iterator<Item = WaitId> + 'a {
        self.waiters_by_key.get(key).into_iter().flatten().copied()
    }

    /// Every wait, in no order: for whoever only counts or gathers them into sets,
    /// and may do so once per key.
    pub fn waits_in_any_order(&self) -> impl Iterator<Item = (&WaitId, &KeyWait)> {
        self.waits.iter()
    }

    /// The store-barrier counters a status report lists, in key order: every key
    /// with waiters, and the ones last used.
    pub fn barrier_keys(&self) -> impl Iterator<Item = &Bytes> {
        let mut keys: Vec<&Bytes> = self.barrier_waiters.keys().chain(&self.recent_barrier_keys).collect();
        keys.sort_unstable();
        keys.dedup();
        keys.into_iter()
    }

    /// The store barriers waiting at `key`: the world size each states, and its id.
    pub fn barrier_waiters(&self, key: &[u8]) -> impl Iterator<Item = (i64, &WaitId)> {
        let by_size = self.barrier_waiters.get(key).into_iter().flatten();
        by_size.flat_map(|(&world_size, waiters)| waiters.iter().map(move |id| (world_size, id)))
    }

    /// Notes `key` as the store-barrier counter used last.
    fn used_for_barrier(&mut self, key: &Bytes) {
        let recent = &mut self.recent_barrier_keys;
        match recent.iter().position(|known| known == key) {
            Some(at) => {
                recent.remove(at);
            }
            None if recent.len() >= RECENT_BARRIER_KEYS => {
                recent.pop_front();
            }
            None => {}
        }
        recent.push_back(key.clone());
    }

    /// Appends to queue `key` and wakes one waiter on that name, as torch does.
    pub fn queue_push(&mut self, key: Bytes, value: Bytes, done: &mut Vec<Outgoing>) {
        let key = own(key);
        self.queues.entry(key.clone()).or_default().push_back(own(value));
        self.wake_one(&key, done);
    }

    /// Takes the oldest item; returns the queue's length before the pop and the item.
    pub fn queue_pop(&mut self, key: &[u8]) -> (i64, Option<Bytes>) {
        let Some(queue) = self.queues.get_mut(key) else { return (0, None) };
        let len = i64::try_from(queue.len()).unwrap_or(i64::MAX);
        let value = queue.pop_front();
        if queue.is_empty() {
            self.queues.remove(key);
        }
        (len, value)
    }

    pub fn queue_len(&self, key: &[u8]) -> i64 {
        self.queues.get(key).map_or(0, |q| i64::try_from(q.len()).unwrap_or(i64::MAX))
    }

    /// TCPStore's BARRIER: adds 1 to the decimal counter stored at `key` (it never
    /// resets), then answers at once if it is at least `world_size`, else blocks.
    /// Releasing answers every barrier waiter of `key` whose world size is reached.
    pub fn barrier(
        &mut self,
        id: WaitId,
        key: Bytes,
        world_size: i64,
        now: Millis,
        done: &mut Vec<Outgoing>,
    ) -> Result<Option<Reply>, OpError> {
        if self.waits.contains_key(&id) {
            return Err(OpError::Invalid(format!("request id {} is already waiting on this session", id.1)));
        }
        let (key, count) = self.increment(key, 1, Integer::Stoll)?;
        // Every rank of a round names the same key: only its first arrival notes it.
        if self.recent_barrier_keys.back() != Some(&key) {
            self.used_for_barrier(&key);
        }
        self.wake_counted(&key, Some(count), done);
        let counters = &mut self.counters[WaitKind::Barrier { world_size }.counted()];
        counters.arrivals += 1;
        if count >= world_size {
            counters.releases += 1;
            return Ok(Some(Ok(Response::Done)));
        }
        let Store { barrier_waiters, spare_waiters, .. } = self;
        let by_size = barrier_waiters.entry(key.clone()).or_default();
        by_size.entry(world_size).or_insert_with(|| std::mem::take(spare_waiters)).insert(id);
        let keys = smallvec::smallvec![key];
        self.insert_wait(id, KeyWait { kind: WaitKind::Barrier { world_size }, keys, missing: 0, started: now });
        Ok(None)
    }

    /// Fails every wait of `session` with `error`.
    pub fn fail_session(&mut self, session: SessionId, error: &OpError, done: &mut Vec<Outgoing>) {
        for id in self.session_waits(session) {
            if self.remove_wait(id).is_some() {
                answer(done, id, Err(error.clone()));
            }
        }
    }

    /// Fails wait `id` with `error`, if it still waits.
    pub fn fail_wait(&mut self, id: WaitId, error: OpError, done: &mut Vec<Outgoing>) {
        if self.remove_wait(id).is_some() {
            answer(done, id, Err(error));
        }
    }

    /// Ends every wait of `session` (torch's CANCEL_WAIT); each fails with `Closed`,
    /// so that every request still gets exactly one reply.
    pub fn cancel_session(&mut self, session: SessionId, done: &mut Vec<Outgoing>) {
        for id in self.session_waits(session) {
            if self.remove_wait(id).is_some() {
                answer(done, id, Err(OpError::Closed("the wait was canceled".into())));
            }
        }
    }

    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// Stores `value` and answers, into `done`, the waits it completed.
    pub fn set(&mut self, key: Bytes, value: Bytes, done: &mut Vec<Outgoing>) {
        self.put(key, own(value), done);
    }

    /// Stores a value that is already owned (not a view into a read buffer). An existing
    /// key keeps its stored copy, so updating a key allocates nothing for it.
    fn put(&mut self, key: Bytes, value: Bytes, done: &mut Vec<Outgoing>) {
        match self.data.get_mut(&key) {
            Some(slot) => *slot = value,
            None => {
                self.data.insert(own(key.clone()), value);
            }
        }
        self.wake(&key, done);
    }

    pub fn append(&mut self, key: Bytes, value: &[u8], done: &mut Vec<Outgoing>) {
        match self.data.get_mut(&key) {
            Some(old) => {
                let mut joined = BytesMut::with_capacity(old.len() + value.len());
                joined.extend_from_slice(old);
                joined.extend_from_slice(value);
                *old = joined.freeze();
            }
            None => {
                self.data.insert(own(key.clone()), Bytes::copy_from_slice(value));
            }
        }
        self.wake(&key, done);
    }

    /// Adds `delta` to the integer at `key` (absent counts as 0), read as `read` says.
    pub fn add(&mut self, key: Bytes, delta: i64, read: Integer, done: &mut Vec<Outgoing>) -> Result<i64, OpError> {
        let (key, new) = self.increment(key, delta, read)?;
        self.wake_counted(&key, Some(new), done);
        Ok(new)
    }

    /// Adds `delta` to the decimal counter at `key` (a missing key counts as 0) and
    /// wakes nobody; returns the key as stored, to share rather than copy, and the
    /// new count. One lookup for the read and the write: `add`, and a store barrier
    /// at every rank's arrival, are the hottest requests there are.
    fn increment(&mut self, key: Bytes, delta: i64, read: Integer) -> Result<(Bytes, i64), OpError> {
        // Decimal text, as TCPStore stores counters: one allocation of its exact size.
        let text = |count: i64| Bytes::copy_from_slice(itoa::Buffer::new().format(count).as_bytes());
        match self.data.entry(key) {
            Entry::Occupied(mut slot) => {
                let (key, value) = (slot.key(), slot.get());
                let current =
                    read.parse(value).ok_or_else(|| OpError::NotANumber { key: key.clone(), value: value.clone() })?;
                let new =
                    current.checked_add(delta).ok_or_else(|| OpError::Overflow { key: key.clone(), current, delta })?;
                slot.insert(text(new));
                Ok((slot.key().clone(), new))
            }
            // Once per key: the request's key may be a view of a large read buffer,
            // which the stored one must not keep.
            Entry::Vacant(slot) => {
                let key = own(slot.into_key());
                self.data.insert(key.clone(), text(delta));
                Ok((key, delta))
            }
        }
    }

    /// TCPStore's compare_set: swap when the current value equals `expected`; a missing key
    /// counts as matching an empty `expected`. Returns the value now stored, except that for
    /// a missing key and a non-empty `expected` it returns `expected` and stores nothing
    /// (torch does the same, and clients depend on it).
    /// On a missing key with a non-empty `expected` nothing is stored, yet waiters on
    /// the key are woken and answered as if it existed: torch's libuv server does
    /// exactly that, and a torch `wait` returns there.
    pub fn compare_set(&mut self, key: Bytes, expected: Bytes, desired: Bytes, done: &mut Vec<Outgoing>) -> Bytes {
        match self.data.get(&key) {
            Some(current) if *current == expected => {
                self.set(key, desired.clone(), done);
                desired
            }
            Some(current) => current.clone(),
            None if expected.is_empty() => {
                self.set(key, desired.clone(), done);
                desired
            }
            None => {
                self.wake_as_if_set(&key, done);
                expected
            }
        }
    }

    pub fn delete(&mut self, key: &[u8]) -> bool {
        self.data.remove(key).is_some()
    }

    /// Keys for which `pred` holds, sorted.
    pub fn keys_where(&self, pred: impl Fn(&[u8]) -> bool) -> Vec<Bytes> {
        let mut keys: Vec<Bytes> = self.data.keys().filter(|k| pred(k)).cloned().collect();
        keys.sort();
        keys
    }

    pub fn list(&self, prefix: &[u8]) -> Vec<Bytes> {
        let mut keys: Vec<Bytes> = self.data.keys().filter(|k| k.starts_with(prefix)).cloned().collect();
        keys.sort();
        keys
    }

    /// Answers at once if every key exists; otherwise blocks the request and returns None.
    pub fn wait_or_reply(
        &mut self,
        id: WaitId,
        kind: WaitKind,
        keys: Vec<Bytes>,
        now: Millis,
    ) -> Result<Option<Reply>, OpError> {
        if self.waits.contains_key(&id) {
            return Err(OpError::Invalid(format!("request id {} is already waiting on this session", id.1)));
        }
        let absent = self.absent(&keys);
        if absent.is_empty() {
            return Ok(Some(Ok(self.answer(kind, &keys))));
        }
        self.register(id, &absent);
        self.insert_wait(id, KeyWait { kind, keys: SmallVec::from_vec(keys), missing: absent.len(), started: now });
        Ok(None)
    }

    /// The wait's deadline passed: fail it naming the keys still absent.
    pub fn expire(&mut self, id: WaitId, now: Millis) -> Option<Reply> {
        let wait = self.remove_wait(id)?;
        self.counters[wait.kind.counted()].timeouts += 1;
        let missing = match wait.kind {
            // The counter exists; what is missing is its release.
            WaitKind::Barrier { .. } => wait.keys.into_vec(),
            _ => self.absent(&wait.keys),
        };
        Some(Err(OpError::KeyTimeout { waited_ms: now.saturating_sub(wait.started), missing }))
    }

    /// Drops every wait of `session` (it closed), without replying.
    pub fn drop_session(&mut self, session: SessionId) {
        for id in self.session_waits(session) {
            self.remove_wait(id);
        }
        self.by_session.remove(&session);
    }

    /// The waits of `session`, in the order of their request ids.
    fn session_waits(&self, session: SessionId) -> Vec<WaitId> {
        let requests = self.by_session.get(&session).map_or(&[][..], Vec::as_slice);
        let mut ids: Vec<WaitId> = requests.iter().map(|&request| (session, request)).collect();
        ids.sort_unstable();
        ids
    }

    fn insert_wait(&mut self, id: WaitId, wait: KeyWait) {
        self.waits.insert(id, wait);
        self.by_session.entry(id.0).or_default().push(id.1);
    }

    /// Takes wait `id` out of the maps of waits (not out of those of its keys).
    fn take_wait(&mut self, id: WaitId) -> Option<KeyWait> {
        let wait = self.waits.remove(&id)?;
        if let Some(requests) = self.by_session.get_mut(&id.0) {
            if let Some(at) = requests.iter().position(|&request| request == id.1) {
                requests.swap_remove(at);
            }
        }
        Some(wait)
    }

    /// Fails every wait with `error` (the job was aborted), in the order of their ids.
    pub fn fail_all(&mut self, error: &OpError, done: &mut Vec<Outgoing>) {
        self.waiters_by_key.clear();
        self.barrier_waiters.clear();
        self.by_session.clear();
        let mut ids: Vec<WaitId> = std::mem::take(&mut self.waits).into_keys().collect();
        ids.sort_unstable();
        done.reserve(ids.len());
        for id in ids {
            answer(done, id, Err(error.clone()));
        }
    }

    pub fn absent(&self, keys: &[Bytes]) -> Vec<Bytes> {
        let mut seen = HashSet::new();
        keys.iter().filter(|k| !self.exists(k) && seen.insert(*k)).cloned().collect()
    }

    fn register(&mut self, id: WaitId, absent: &[Bytes]) {
        for key in absent {
            self.waiters_by_key.entry(key.clone()).or_default().push(id);
        }
    }

    fn remove_wait(&mut self, id: WaitId) -> Option<KeyWait> {
        let wait = self.take_wait(id)?;
        if let WaitKind::Barrier { world_size } = wait.kind {
            for key in &wait.keys {
                let Some(by_size) = self.barrier_waiters.get_mut(key) else { continue };
                if let Some(waiters) = by_size.get_mut(&world_size) {
                    waiters.remove(&id);
                    if waiters.is_empty() {
                        by_size.remove(&world_size);
                    }
                }
                if by_size.is_empty() {
                    self.barrier_waiters.remove(key);
                }
            }
            return Some(wait);
        }
        for key in &wait.keys {
            if let Some(ids) = self.waiters_by_key.get_mut(key) {
                ids.retain(|w| *w != id);
                if ids.is_empty() {
                    self.waiters_by_key.remove(key);
                }
            }
        }
        Some(wait)
    }

    fn answer(&self, kind: WaitKind, keys: &[Bytes]) -> Response {
        let value = |k: &Bytes| self.data.get(k).cloned().unwrap_or_default();
        match kind {
            WaitKind::Wait | WaitKind::Barrier { .. } => Response::Done,
            WaitKind::Get => Response::Value(keys.first().map(value).unwrap_or_default()),
            WaitKind::MultiGet => Response::Values(keys.iter().map(value).collect()),
        }
    }

    /// `key` now exists: count it off every wait on it and answer those with nothing left.
    fn wake(&mut self, key: &Bytes, done: &mut Vec<Outgoing>) {
        self.wake_counted(key, None, done);
    }

    /// [`Store::wake`], for a write whose value, as a counter, is `count` if known.
    fn wake_counted(&mut self, key: &Bytes, count: Option<i64>, done: &mut Vec<Outgoing>) {
        // Most writes have nobody waiting: skip the lookups (and hashing) then.
        if !self.barrier_waiters.is_empty() {
            self.release_barriers(key, count, done);
        }
        if self.waiters_by_key.is_empty() {
            return;
        }
        let Some(ids) = self.waiters_by_key.remove(key) else { return };
        self.count_off(ids, None, done);
    }

    /// A queue push wakes only the oldest waiter on that name (torch: wakeupOneWaitingClient).
    fn wake_one(&mut self, key: &Bytes, done: &mut Vec<Outgoing>) {
        let Some(ids) = self.waiters_by_key.get_mut(key) else { return };
        let first = ids.remove(0);
        if ids.is_empty() {
            self.waiters_by_key.remove(key);
        }
        self.count_off(vec![first], None, done);
    }

    /// Counts `key` off its waiters as if it existed, without it existing.
    fn wake_as_if_set(&mut self, key: &Bytes, done: &mut Vec<Outgoing>) {
        let Some(ids) = self.waiters_by_key.remove(key) else { return };
        self.count_off(ids, Some(key), done);
    }

    /// Answers the barrier waiters of `key` whose world size the counter has reached
    /// (`count`: its value, if known; else read from the key).
    fn release_barriers(&mut self, key: &Bytes, count: Option<i64>, done: &mut Vec<Outgoing>) {
        let Some(by_size) = self.barrier_waiters.get_mut(key) else { return };
        let Some(count) = count.or_else(|| self.data.get(key).and_then(|v| parse_stoll(v))) else { return };
        match by_size.first_key_value() {
            None => {
                self.barrier_waiters.remove(key);
                return;
            }
            // Every arrival but a round's last reaches nobody's world size: no split then.
            Some((&world_size, _)) if world_size > count => return,
            Some(_) => {}
        }
        // The world sizes up to the count are reached.
        let still_waiting = match count.checked_add(1) {
            Some(next) => by_size.split_off(&next),
            None => BTreeMap::new(),
        };
        let reached = std::mem::replace(by_size, still_waiting);
        if by_size.is_empty() {
            self.barrier_waiters.remove(key);
        }
        let mut releasing = std::mem::take(&mut self.releasing);
        for mut waiters in reached.into_values() {
            releasing.extend(waiters.drain());
            if waiters.capacity() > self.spare_waiters.capacity() {
                self.spare_waiters = waiters;
            }
        }
        // Answered in the order of their ids, whatever order their sets keep.
        releasing.sort_unstable();
        // Once, rather than growing through a round's thousands of replies.
        done.reserve(releasing.len());
        for id in releasing.drain(..) {
            if let Some(wait) = self.take_wait(id) {
                self.released(id, &wait, Ok(Response::Done), done);
            }
        }
        self.releasing = releasing;
    }

    /// Answers wait `id`, taken out of the waits, with `reply`, and counts its release
    /// and how long it waited.
    fn released(&mut self, id: WaitId, wait: &KeyWait, reply: Reply, done: &mut Vec<Outgoing>) {
        let counters = &mut self.counters[wait.kind.counted()];
        counters.releases += 1;
        counters.wait.observe(self.now.saturating_sub(wait.started));
        answer(done, id, reply);
    }

    /// One of each wait's keys arrived: answer those with nothing left. `present` is
    /// a key to count as existing even if it does not (see `compare_set`).
    fn count_off(&mut self, ids: Vec<WaitId>, present: Option<&Bytes>, done: &mut Vec<Outgoing>) {
        // At most one reply each (see `release_barriers`).
        done.reserve(ids.len());
        for id in ids {
            let Some(wait) = self.waits.get_mut(&id) else { continue };
            wait.missing = wait.missing.saturating_sub(1);
            if wait.missing > 0 {
                continue;
            }
            // A key counted earlier may have been deleted since: count again before answering.
            let keys = std::mem::take(&mut wait.keys);
            let mut absent = self.absent(&keys);
            absent.retain(|k| Some(k) != present);
            if absent.is_empty() {
                if let Some(wait) = self.take_wait(id) {
                    let reply = Ok(self.answer(wait.kind, &keys));
                    self.released(id, &wait, reply, done);
                }
            } else {
                self.register(id, &absent);
                if let Some(wait) = self.waits.get_mut(&id) {
                    wait.missing = absent.len();
                    wait.keys = keys;
                }
            }
        }
    }
}

/// Small keys and values decoded without copying are views into a connection's read
/// buffer; kept as they are, each would pin that whole buffer for as long as it is stored.
fn own(bytes: Bytes) -> Bytes {
    const COPY_BELOW: usize = 4096;
    if bytes.len() < COPY_BELOW {
        Bytes::copy_from_slice(&bytes)
    } else {
        bytes
    }
}

/// How `add` reads the integer a key holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Integer {
    /// Decimal digits with an optional sign and nothing else: the native protocol's,
    /// where "0.001" or "12abc" is a mistake to name, not a number to round.
    Decimal,
    /// As C++ `std::stoll`: what torch's TCPStore does, and its clients may rely on.
    Stoll,
}

impl Integer {
    /// The store's reading for a session (`torch`: a TCPStore client's).
    pub fn of(torch: bool) -> Integer {
        if torch {
            Integer::Stoll
        } else {
            Integer::Decimal
        }
    }

    fn parse(self, value: &[u8]) -> Option<i64> {
        match self {
            Integer::Decimal => std::str::from_utf8(value).ok()?.parse().ok(),
            Integer::Stoll => parse_stoll(value),
        }
    }
}

/// Parses like C++ `std::stoll` as TCPStore does: optional leading whitespace and sign,
/// then digits, ignoring anything after them ("12abc" is 12). None when there are no
/// digits or the number does not fit in an i64.
fn parse_stoll(value: &[u8]) -> Option<i64> {
    let text = value.trim_ascii_start();
    let (negative, rest) = match text.first() {
        Some(b'-') => (true, &text[1..]),
        Some(b'+') => (false, &text[1..]),
        _ => (false, text),
    };
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 {
        return None;
    }
    let mut n: i64 = 0;
    for &d in &rest[..digits] {
        let d = i64::from(d - b'0');
        n = n.checked_mul(10)?;
        n = if negative { n.checked_sub(d)? } else { n.checked_add(d)? };
    }
    Some(n)
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::{parse_stoll, Store, RECENT_BARRIER_KEYS};
    use crate::{Response, SessionId};

    #[test]
    fn barrier_keys_are_those_waited_at_and_the_last_used() {
        let mut store = Store::default();
        let arrive = |store: &mut Store, id: u64, key: &str, world_size| {
            let key = Bytes::from(key.to_owned());
            store.barrier((SessionId(1), id), key, world_size, 0, &mut Vec::new()).expect("a store barrier")
        };
        // A round that never completes, then many that each count on a key of their own.
        assert_eq!(arrive(&mut store, 0, "stuck", 2), None);
        for round in 0..100 {
            assert_eq!(arrive(&mut store, round + 1, &format!("round/{round}"), 1), Some(Ok(Response::Done)));
        }
        // Used again: last used, and listed once. An older key comes back in, pushing
        // the least recently used one out.
        arrive(&mut store, 1_000, "round/90", 1);
        arrive(&mut store, 1_001, "round/5", 1);
        let oldest_kept = 100 - RECENT_BARRIER_KEYS + 1;
        let mut expected: Vec<String> = (oldest_kept..100).map(|round| format!("round/{round}")).collect();
        expected.extend(["round/5".to_owned(), "stuck".to_owned()]);
        expected.sort();
        let listed: Vec<String> = store.barrier_keys().map(|key| String::from_utf8_lossy(key).into_owned()).collect();
        assert_eq!(listed, expected);
        let waiting: Vec<_> = store.barrier_waiters(b"stuck").collect();
        assert_eq!(waiting, [(2, &(SessionId(1), 0))]);
        assert_eq!(store.barrier_waiters(b"round/99").count(), 0);
    }

    #[test]
    fn stoll_semantics() {
        assert_eq!(parse_stoll(b"12abc"), Some(12));
        assert_eq!(parse_stoll(b"  -7"), Some(-7));
        assert_eq!(parse_stoll(b"+3"), Some(3));
        assert_eq!(parse_stoll(b""), None);
        assert_eq!(parse_stoll(b"abc"), None);
        assert_eq!(parse_stoll(b"-"), None);
        assert_eq!(parse_stoll(b"9223372036854775807"), Some(i64::MAX));
        assert_eq!(parse_stoll(b"-9223372036854775808"), Some(i64::MIN));
        assert_eq!(parse_stoll(b"9223372036854775808"), None);
    }
}
