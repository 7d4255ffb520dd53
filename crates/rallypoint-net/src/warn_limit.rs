//! Warnings a peer can cause, limited: a client that sends malformed frames in a
//! loop (or connects in a loop with garbage) must not fill the disk with the
//! coordinator's log, nor slow it down writing that log. The first few warnings
//! of a kind are shown in full; after them, at most one per interval, saying how
//! many like it were held back.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::sync::lock;

/// Rate limit for one kind of warning (per connection, or per call site).
#[derive(Debug, Default)]
pub struct WarnLimit {
    shown: u32,
    /// Saturates: what it says is "this many, or more". 32 bits, as every rank's
    /// connection holds one.
    held: u32,
    last: Option<Instant>,
}

impl WarnLimit {
    /// Warnings shown in full before the limit applies.
    pub const FULL: u32 = 5;
    /// After those, at most one warning per interval.
    pub const INTERVAL: Duration = Duration::from_secs(10);

    pub const fn new() -> Self {
        WarnLimit { shown: 0, held: 0, last: None }
    }

    /// `Some(held)`: show this warning, and say that `held` like it were held back
    /// since the last one shown; `None`: hold it back.
    pub fn admit(&mut self) -> Option<u64> {
        self.admit_at(Instant::now())
    }

    fn admit_at(&mut self, now: Instant) -> Option<u64> {
        let due = self.shown < Self::FULL || self.last.is_none_or(|last| now.duration_since(last) >= Self::INTERVAL);
        if !due {
            self.held = self.held.saturating_add(1);
            return None;
        }
        self.shown = self.shown.saturating_add(1);
        self.last = Some(now);
        Some(u64::from(std::mem::take(&mut self.held)))
    }
}

/// [`WarnLimit::admit`] on a limit shared by every connection (for warnings about
/// connections that never get far enough to have a state of their own).
pub fn admit_shared(limit: &Mutex<WarnLimit>) -> Option<u64> {
    lock(limit).admit()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_few_are_shown_then_one_per_interval_with_the_count_held_back() {
        let mut limit = WarnLimit::new();
        let start = Instant::now();
        for _ in 0..WarnLimit::FULL {
            assert_eq!(limit.admit_at(start), Some(0));
        }
        for _ in 0..1000 {
            assert_eq!(limit.admit_at(start + Duration::from_secs(1)), None);
        }
        assert_eq!(limit.admit_at(start + WarnLimit::INTERVAL), Some(1000));
        assert_eq!(limit.admit_at(start + WarnLimit::INTERVAL), None);
        assert_eq!(limit.admit_at(start + WarnLimit::INTERVAL * 3), Some(1));
    }
}
