//! The two small things every connection of rallypoint needs besides bytes: a lock
//! that survives a panic elsewhere, and a backoff for reconnecting.

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use rand::Rng;

/// Locks, carrying on past a poisoned lock: a panic while serving one connection
/// must not take every other job of a coordinator (or every rank of a node agent)
/// down with it. The panic itself was logged where it happened; this says that the
/// state it left is being used anyway.
///
/// Inlined, with the recovery out of line: the client takes several locks per
/// call, and a call through a function here cost more than the lock itself.
#[inline]
pub fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    match mutex.lock() {
        Ok(guard) => guard,
        Err(poisoned) => recover(mutex, poisoned),
    }
}

#[cold]
#[inline(never)]
fn recover<'a, T>(mutex: &'a Mutex<T>, poisoned: PoisonError<MutexGuard<'a, T>>) -> MutexGuard<'a, T> {
    tracing::error!("a thread panicked while holding a lock; carrying on with the state it left");
    mutex.clear_poison();
    poisoned.into_inner()
}

/// Pauses between attempts to reach a coordinator (or an agent) that is not there
/// yet: workers and agents often start before it listens. Exponential from
/// [`Backoff::START`] to [`Backoff::CAP`], each pause drawn between half and all of
/// the current step, so that the thousands of processes of a job started at the
/// same moment do not retry in lockstep.
#[derive(Debug, Clone)]
pub struct Backoff {
    step: Duration,
}

impl Backoff {
    pub const START: Duration = Duration::from_millis(10);
    pub const CAP: Duration = Duration::from_secs(1);

    pub fn new() -> Self {
        Backoff { step: Self::START }
    }

    /// The next pause.
    pub fn next_pause(&mut self) -> Duration {
        let pause = self.step.mul_f64(rand::thread_rng().gen_range(0.5..=1.0));
        self.step = (self.step * 2).min(Self::CAP);
        pause
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_its_cap_with_jitter() {
        let mut backoff = Backoff::new();
        let mut step = Backoff::START;
        for _ in 0..12 {
            let pause = backoff.next_pause();
            assert!(pause >= step / 2 && pause <= step, "{pause:?} outside [{:?}, {step:?}]", step / 2);
            step = (step * 2).min(Backoff::CAP);
        }
        assert_eq!(step, Backoff::CAP);
    }

    #[test]
    fn a_poisoned_lock_is_used_and_cleared() {
        let mutex = std::sync::Arc::new(Mutex::new(1));
        let poisoner = std::sync::Arc::clone(&mutex);
        let _ = std::thread::spawn(move || {
            let _guard = poisoner.lock().expect("not poisoned yet");
            panic!("poison it");
        })
        .join();
        assert!(mutex.is_poisoned());
        *lock(&mutex) += 1;
        assert!(!mutex.is_poisoned());
        assert_eq!(*lock(&mutex), 2);
    }
}
