//! Drives the engine's clock: fires key-wait and collective timeouts, lease
//! expiries and idle-job cleanup when they are due.
//!
//! The ticker is an OS thread, not a tokio task, so that the runtime holds no timer
//! while connections are idle between requests. A runtime with a pending timer sleeps
//! in `epoll_wait` with a timeout, and the kernel arms (and on wake-up cancels) an
//! hrtimer for every such sleep, that is once per request on a lightly loaded
//! server; on a VM each of those is a trap to the hypervisor. Without timers the
//! runtime sleeps with no timeout, as libuv-based servers such as torch's do.

use std::panic::{self, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use tracing::error;

use rallypoint_net::sync::lock;

use crate::shared::Shared;

/// Longest sleep between ticks even without a deadline: a safety net should a wake-up
/// ever be missed, cheap enough to be invisible.
const MAX_SLEEP: Duration = Duration::from_secs(1);

/// Wakes the ticker thread early: when the engine gains a deadline earlier than the
/// one the ticker sleeps towards, or when the server stops.
#[derive(Default)]
pub(crate) struct Alarm {
    state: Mutex<AlarmState>,
    changed: Condvar,
}

#[derive(Default)]
struct AlarmState {
    poked: bool,
    stop: bool,
}

impl Alarm {
    /// Cuts the current sleep short (the ticker re-reads the engine's next deadline).
    pub(crate) fn poke(&self) {
        lock(&self.state).poked = true;
        self.changed.notify_one();
    }

    fn stop(&self) {
        lock(&self.state).stop = true;
        self.changed.notify_one();
    }

    /// Sleeps until `until`, a poke or a stop; false once stopped.
    fn sleep_until(&self, until: Instant) -> bool {
        let mut state = lock(&self.state);
        loop {
            if state.stop {
                return false;
            }
            if std::mem::take(&mut state.poked) {
                return true;
            }
            let Some(left) = until.checked_duration_since(Instant::now()).filter(|d| !d.is_zero()) else {
                return true;
            };
            state = match self.changed.wait_timeout(state, left) {
                Ok((state, _)) => state,
                Err(poisoned) => poisoned.into_inner().0,
            };
        }
    }
}

/// The running ticker thread. Dropping it stops the thread without waiting for it.
pub(crate) struct Ticker {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Ticker {
    pub(crate) fn start(shared: Arc<Shared>) -> std::io::Result<Ticker> {
        let thread = thread::Builder::new().name("rallypoint-ticker".into()).spawn({
            let shared = Arc::clone(&shared);
            move || run(&shared)
        })?;
        Ok(Ticker { shared, thread: Some(thread) })
    }

    /// Stops the thread and waits until it has finished its last tick.
    pub(crate) async fn stop(mut self) {
        self.shared.ticker_alarm().stop();
        if let Some(thread) = self.thread.take() {
            // Joining blocks (for at most one tick), so not on a runtime worker.
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.shared.ticker_alarm().stop();
    }
}

fn run(shared: &Shared) {
    loop {
        // A panic in the engine must not end the clock (no timeout would ever fire
        // again); the state lock survives poisoning, so carry on.
        let next = panic::catch_unwind(AssertUnwindSafe(|| shared.tick())).unwrap_or_else(|_| {
            error!("the engine panicked during a tick; carrying on");
            None
        });
        let cap = Instant::now() + MAX_SLEEP;
        // The engine's clock counts whole milliseconds, rounded down, so a deadline
        // can lie up to 1 ms before the instant it stands for: wake 1 ms after it,
        // never before a timeout is really due.
        let wake = next
            .and_then(|at| shared.start().checked_add(Duration::from_millis(at.saturating_add(1))))
            .map_or(cap, |at| at.min(cap));
        if !shared.ticker_alarm().sleep_until(wake) {
            return;
        }
    }
}
