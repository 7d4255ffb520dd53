//! Drives the engine's clock: fires key-wait and collective timeouts, lease
//! expiries and idle-job cleanup when they are due.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::shared::Shared;

/// Longest sleep between ticks even without a deadline: a safety net should a wake-up
/// ever be missed, cheap enough to be invisible.
const MAX_SLEEP: Duration = Duration::from_secs(1);

pub(crate) async fn run(shared: Arc<Shared>, mut stop: watch::Receiver<()>) {
    loop {
        let next = shared.tick();
        let cap = Instant::now() + MAX_SLEEP;
        let wake = next
            .and_then(|at| shared.start().checked_add(Duration::from_millis(at)))
            .map_or(cap, |at| at.min(cap));
        tokio::select! {
            _ = tokio::time::sleep_until(wake.into()) => {}
            _ = shared.ticker_woken() => {}
            _ = stop.changed() => return,
        }
    }
}
