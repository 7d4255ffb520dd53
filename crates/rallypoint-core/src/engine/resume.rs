//! What lets a session survive a cut connection: the reconnect grace, the requests
//! still waiting for their reply, and the replies kept for requests a client re-sends.
//!
//! A client whose connection is cut reconnects, resumes its session by id and re-sends
//! every request it has no reply for, with the same ids. For each, one of three things
//! holds: it is still waiting (`inflight`): the re-sent copy is dropped and the one
//! reply comes when it is due; it was answered and the reply got lost with the
//! connection (`ReplyCache`): the same reply again; or the coordinator never got it:
//! it runs now. So an arrival, an `add` or a `set` retried after a cut takes effect
//! once. Only replies of requests that change something are kept: a read runs again.
//!
//! The cache is bounded ([`crate::ReplyCache`]: count, age, bytes of values) and
//! evicts oldest first. A re-sent request that changes something, whose reply is not
//! kept but whose id is not above the highest id evicted, may have run: it is answered
//! with an error saying so rather than run a second time. (Clients number requests
//! upwards; a resumed session must never reuse an id.)

use std::collections::VecDeque;

use crate::{Millis, OpError, Reply, ReplyCache as Limits, Response};

use super::HashMap;

/// The resume state of a session that stated an incarnation.
#[derive(Debug, Default)]
pub(crate) struct Resumable {
    /// The connection dropped: the session is kept until this time (engine ms) for a
    /// resume, then closed as a loss.
    pub detached_until: Option<Millis>,
    /// When the session was last resumed: re-sent requests are recognised from then
    /// on, for as long as a kept reply may live.
    pub resumed_at: Option<Millis>,
    /// Requests handled and not yet answered, and whether each one's reply is kept.
    pub inflight: HashMap<u64, bool>,
    pub cache: Cache,
}

impl Resumable {
    /// Whether a request arriving now may be a copy re-sent after the last resume.
    pub fn may_be_resent(&self, now: Millis, limits: &Limits) -> bool {
        self.resumed_at.is_some_and(|at| now <= at.saturating_add(limits.max_age_ms))
    }
}

/// What a re-sent request gets.
pub(crate) enum Resent {
    /// Not a copy of anything known: run it.
    Run,
    /// Still waiting: drop the copy; its one reply comes when due.
    Waiting,
    /// Answered before: this reply again.
    Replay(Reply),
}

impl Resumable {
    /// Classifies request `id` if it may be a re-sent copy.
    pub fn resent(&self, id: u64, changes_state: bool) -> Resent {
        if self.inflight.contains_key(&id) {
            return Resent::Waiting;
        }
        if let Some(reply) = self.cache.get(id) {
            return Resent::Replay(reply);
        }
        if changes_state && id <= self.cache.max_evicted {
            return Resent::Replay(Err(OpError::Closed(format!(
                "request {id} was sent again after a reconnect, but its reply is no longer kept (the coordinator keeps \
                 a session's last replies for a bounded time): it may or may not have taken effect"
            ))));
        }
        Resent::Run
    }
}

/// The replies of one session's recent state-changing requests, oldest first.
#[derive(Debug, Default)]
pub(crate) struct Cache {
    entries: VecDeque<Kept>,
    /// Bytes of values the kept replies hold.
    bytes: usize,
    /// Highest request id whose reply was evicted (0: none).
    max_evicted: u64,
}

#[derive(Debug)]
struct Kept {
    id: u64,
    at: Millis,
    reply: Compact,
    bytes: usize,
}

/// Most kept replies are a bare success: stored without the room of a full reply.
#[derive(Debug)]
enum Compact {
    Done,
    Int(i64),
    Bool(bool),
    Full(Box<Reply>),
}

impl Cache {
    pub fn insert(&mut self, id: u64, reply: &Reply, now: Millis, limits: &Limits) {
        let (compact, bytes) = match reply {
            Ok(Response::Done) => (Compact::Done, 0),
            Ok(Response::Int(n)) => (Compact::Int(*n), 0),
            Ok(Response::Bool(b)) => (Compact::Bool(*b), 0),
            other => (Compact::Full(Box::new(other.clone())), values_len(other)),
        };
        self.entries.push_back(Kept { id, at: now, reply: compact, bytes });
        self.bytes = self.bytes.saturating_add(bytes);
        while self.entries.len() > limits.max_replies || self.bytes > limits.max_bytes {
            if !self.evict_oldest() {
                break;
            }
        }
        self.expire(now, limits);
    }

    /// Drops the replies older than the age bound.
    pub fn expire(&mut self, now: Millis, limits: &Limits) {
        while self.entries.front().is_some_and(|k| k.at.saturating_add(limits.max_age_ms) < now) {
            self.evict_oldest();
        }
    }

    fn evict_oldest(&mut self) -> bool {
        let Some(kept) = self.entries.pop_front() else { return false };
        self.bytes = self.bytes.saturating_sub(kept.bytes);
        self.max_evicted = self.max_evicted.max(kept.id);
        true
    }

    /// The kept reply to request `id`. Re-sent requests are looked up only just
    /// after a resume, and the latest replies are the likely ones: searched from the end.
    pub fn get(&self, id: u64) -> Option<Reply> {
        let kept = self.entries.iter().rev().find(|k| k.id == id)?;
        Some(match &kept.reply {
            Compact::Done => Ok(Response::Done),
            Compact::Int(n) => Ok(Response::Int(*n)),
            Compact::Bool(b) => Ok(Response::Bool(*b)),
            Compact::Full(reply) => (**reply).clone(),
        })
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.len()
    }
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

    fn limits() -> Limits {
        Limits { max_replies: 3, max_age_ms: 1_000, max_bytes: 10 }
    }

    #[test]
    fn keeps_the_last_replies_within_count_bytes_and_age() {
        let mut cache = Cache::default();
        for id in 1..=4 {
            cache.insert(id, &Ok(Response::Int(id as i64)), 0, &limits());
        }
        assert_eq!(cache.len(), 3);
        assert_eq!(cache.get(1), None, "the oldest went past the count");
        assert_eq!(cache.get(4), Some(Ok(Response::Int(4))));
        assert_eq!(cache.max_evicted, 1);

        // Values count: a value of 8 bytes and another of 8 do not fit in 10.
        cache.insert(5, &Ok(Response::Value(Bytes::from_static(b"12345678"))), 0, &limits());
        cache.insert(6, &Ok(Response::Value(Bytes::from_static(b"abcdefgh"))), 0, &limits());
        assert_eq!(cache.get(5), None);
        assert_eq!(cache.get(6), Some(Ok(Response::Value(Bytes::from_static(b"abcdefgh")))));
        assert_eq!(cache.max_evicted, 5);

        // Age: past 1 s everything goes.
        cache.expire(1_001, &limits());
        assert_eq!(cache.len(), 0);
        assert_eq!(cache.max_evicted, 6);
    }

    #[test]
    fn a_resent_request_is_waiting_replayed_unknown_or_new() {
        let mut r = Resumable::default();
        r.inflight.insert(7, true);
        r.cache.insert(3, &Ok(Response::Done), 0, &limits());
        r.cache.max_evicted = 2;
        assert!(matches!(r.resent(7, true), Resent::Waiting));
        assert!(matches!(r.resent(3, true), Resent::Replay(Ok(Response::Done))));
        assert!(matches!(r.resent(2, true), Resent::Replay(Err(OpError::Closed(_)))), "evicted: unknown outcome");
        assert!(matches!(r.resent(2, false), Resent::Run), "a read runs again");
        assert!(matches!(r.resent(9, true), Resent::Run));
    }
}
