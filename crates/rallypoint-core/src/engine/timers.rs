//! Deadlines the engine must act on. Entries are never removed early: each
//! handler re-checks its state when it fires, so a stale entry is a no-op.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

use crate::{CollectiveKind, Millis, SessionId};

use super::JobId;

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Timer {
    KeyWait {
        job: JobId,
        session: SessionId,
        request_id: u64,
    },
    /// The job's torch waits may be stalled: report those blocked long enough.
    StallSweep {
        job: JobId,
    },
    /// Boxed: a lease timer per rank shares the heap with these, which are one per
    /// collective and round, and would make every entry the size of their name.
    Collective(Box<CollectiveDeadline>),
    Lease {
        job: JobId,
        rank: u32,
    },
    JobIdle {
        job: JobId,
    },
    /// A detached session's reconnect grace ends (module `resume`).
    Grace {
        job: JobId,
        session: SessionId,
    },
}

/// A generation of a collective times out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CollectiveDeadline {
    pub job: JobId,
    pub kind: CollectiveKind,
    pub name: String,
    /// Where the collective is in the job's (`Collectives::find`): its name alone
    /// may be that of several.
    pub at: usize,
    pub generation: u64,
}

impl Timer {
    /// The job the timer belongs to.
    pub fn job(&self) -> JobId {
        match self {
            Timer::KeyWait { job, .. }
            | Timer::StallSweep { job }
            | Timer::Lease { job, .. }
            | Timer::JobIdle { job }
            | Timer::Grace { job, .. } => *job,
            Timer::Collective(deadline) => deadline.job,
        }
    }
}

#[derive(Debug)]
struct Entry {
    at: Millis,
    seq: u64,
    timer: Timer,
}

impl PartialEq for Entry {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Entry {}
impl PartialOrd for Entry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Entry {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

#[derive(Debug, Default)]
pub(crate) struct Timers {
    heap: BinaryHeap<Reverse<Entry>>,
    seq: u64,
}

impl Timers {
    pub fn schedule(&mut self, at: Millis, timer: Timer) {
        self.seq += 1;
        self.heap.push(Reverse(Entry { at, seq: self.seq, timer }));
    }

    pub fn next_deadline(&self) -> Option<Millis> {
        self.heap.peek().map(|Reverse(e)| e.at)
    }

    /// Removes and returns the earliest timer due at or before `now`, with its time.
    pub fn pop_due(&mut self, now: Millis) -> Option<(Millis, Timer)> {
        if self.heap.peek()?.0.at > now {
            return None;
        }
        self.heap.pop().map(|Reverse(e)| (e.at, e.timer))
    }
}
