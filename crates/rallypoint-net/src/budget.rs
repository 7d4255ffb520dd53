//! The memory a process's peers can make it hold with requests they have not
//! finished sending, bounded for all connections together.
//!
//! Each connection's limits bound one request, not how many connections hold one:
//! twenty connections each half-way through a 63 MiB frame hold over a gigabyte. A
//! [`PendingBudget`] counts the bytes every connection holds of unfinished
//! requests; a connection whose count would take the total past the limit closes
//! the connection holding the most (itself, or another, which is told through its
//! [`Charge`]), so that the peer doing the damage pays for it and the others go on.
//!
//! Only connections holding part of a request touch the shared state: a request
//! read whole in one go costs one comparison.

use std::collections::HashMap;
use std::future::{poll_fn, Future};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Poll, Waker};

use atomic_waker::AtomicWaker;

use crate::sync::lock;

/// What a read buffer holding part of a request is charged: the bytes received.
/// Its allocation grows ahead of them, by doubling, so a process holds at most
/// about twice the budget in such buffers; counting the bytes keeps the choice of
/// whom to close independent of how reads happened to fall.
pub fn buffered(buf: &bytes::BytesMut) -> usize {
    buf.len()
}

/// The budget shared by every connection of one server or agent.
#[derive(Debug)]
pub struct PendingBudget {
    limit: usize,
    next_id: AtomicU64,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    total: usize,
    /// Connections holding bytes of an unfinished request: how many, and how to tell them.
    holders: HashMap<u64, (usize, Arc<Eviction>)>,
}

/// How a connection is told that it was chosen to close.
#[derive(Debug, Default)]
struct Eviction {
    evicted: AtomicBool,
    waker: AtomicWaker,
}

/// The budget is spent and this connection holds the most: it must close.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "holds {held} bytes of unfinished requests, the most of any connection, while all of them together would hold {total}, over the budget of {limit}"
)]
pub struct OverBudget {
    pub held: usize,
    pub total: usize,
    pub limit: usize,
}

impl PendingBudget {
    pub fn new(limit: usize) -> Arc<PendingBudget> {
        Arc::new(PendingBudget { limit, next_id: AtomicU64::new(1), state: Mutex::default() })
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Bytes held now by all connections together.
    pub fn total(&self) -> usize {
        lock(&self.state).total
    }

    /// A new connection's account, holding nothing.
    pub fn charge(self: &Arc<Self>) -> Charge {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        Charge { budget: Arc::clone(self), id, held: 0, eviction: None }
    }
}

/// One connection's account with its [`PendingBudget`]; released when dropped.
#[derive(Debug)]
pub struct Charge {
    budget: Arc<PendingBudget>,
    id: u64,
    held: usize,
    /// Made when the connection holds something, dropped when it holds nothing
    /// again: a server may have a hundred thousand connections, most holding nothing.
    eviction: Option<Arc<Eviction>>,
}

impl Charge {
    /// This connection now holds `bytes` of unfinished requests (0 once every
    /// request it sent is whole). Past the budget, the connection holding the most
    /// is chosen to close: `Err` if that is this one; another one is told through
    /// [`Charge::evicted`], and this one goes on.
    pub fn hold(&mut self, bytes: usize) -> Result<(), OverBudget> {
        // Once chosen to close, a connection was counted out: nothing more is counted,
        // and it ends as soon as it looks ([`Charge::evicted`]).
        if bytes == self.held || self.is_evicted() {
            return Ok(());
        }
        let mut state = lock(&self.budget.state);
        // Chosen meanwhile, by a connection that held the lock: its bytes were taken
        // out of the total then.
        if self.is_evicted() {
            return Ok(());
        }
        state.total = state.total - self.held + bytes;
        self.held = bytes;
        if bytes == 0 {
            state.holders.remove(&self.id);
            // Nobody can choose a connection holding nothing: the handshake made every
            // connection hold its hello for a moment, and the rest of its life it
            // would keep this for nothing.
            self.eviction = None;
        } else {
            let eviction = self.eviction.get_or_insert_with(Arc::default);
            state.holders.insert(self.id, (bytes, Arc::clone(eviction)));
        }
        let (limit, total) = (self.budget.limit, state.total);
        if total <= limit {
            return Ok(());
        }
        let largest = state.holders.iter().max_by_key(|(_, (held, _))| *held).map(|(id, (held, _))| (*id, *held));
        match largest {
            Some((id, held)) if id == self.id => Err(OverBudget { held, total, limit }),
            Some((id, _)) => {
                // Counted out now: its bytes go when it closes, and the next connection
                // over the budget must choose among the others.
                if let Some((held, eviction)) = state.holders.remove(&id) {
                    state.total -= held;
                    eviction.evicted.store(true, Ordering::Release);
                    eviction.waker.wake();
                }
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// Whether another connection chose this one to close.
    pub fn is_evicted(&self) -> bool {
        self.eviction.as_ref().is_some_and(|e| e.evicted.load(Ordering::Acquire))
    }

    /// Wakes `waker` when this connection is chosen to close (for connections not
    /// served by an async task); true if it already was. Only a connection holding
    /// something can be chosen, so call it after each [`Charge::hold`].
    pub fn notify_eviction(&self, waker: &Waker) -> bool {
        if let Some(eviction) = &self.eviction {
            eviction.waker.register(waker);
        }
        self.is_evicted()
    }

    /// Completes when another connection chose this one to close. Made anew after
    /// each [`Charge::hold`] (as in a loop's `select!`): a connection that held
    /// nothing when it was made cannot be chosen.
    ///
    /// Not an `async fn`, for the reason [`crate::conn::stall`] gives.
    pub fn evicted(&self) -> impl Future<Output = ()> + Send + '_ {
        poll_fn(|cx| if self.notify_eviction(cx.waker()) { Poll::Ready(()) } else { Poll::Pending })
    }

    /// Bytes this connection holds by its own count.
    pub fn held(&self) -> usize {
        self.held
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        if self.held == 0 || self.is_evicted() {
            return;
        }
        let mut state = lock(&self.budget.state);
        // An evicted connection was counted out when it was chosen.
        if state.holders.remove(&self.id).is_some() {
            state.total -= self.held;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn within_the_budget_nobody_closes() {
        let budget = PendingBudget::new(100);
        let (mut a, mut b) = (budget.charge(), budget.charge());
        assert_eq!(a.hold(60), Ok(()));
        assert_eq!(b.hold(40), Ok(()));
        assert_eq!(budget.total(), 100);
        assert!(!a.is_evicted() && !b.is_evicted());
        assert_eq!(a.hold(0), Ok(()));
        drop(b);
        assert_eq!(budget.total(), 0);
    }

    #[test]
    fn a_connection_holding_nothing_keeps_no_eviction_state_yet_can_be_chosen_again() {
        let budget = PendingBudget::new(100);
        let (mut a, mut b) = (budget.charge(), budget.charge());
        a.hold(10).expect("within");
        assert!(a.eviction.is_some());
        a.hold(0).expect("within");
        assert!(a.eviction.is_none(), "kept for a connection that cannot be chosen");
        a.hold(80).expect("within");
        assert_eq!(b.hold(30), Ok(()));
        assert!(a.is_evicted() && !b.is_evicted());
        assert_eq!(budget.total(), 30);
    }

    #[test]
    fn past_the_budget_the_largest_holder_closes_whoever_asks() {
        let budget = PendingBudget::new(100);
        let (mut big, mut small) = (budget.charge(), budget.charge());
        big.hold(80).expect("within");
        // The small one goes over: the big one is told to close, the small one goes on.
        assert_eq!(small.hold(30), Ok(()));
        assert!(big.is_evicted() && !small.is_evicted());
        assert_eq!(budget.total(), 30, "the evicted connection's bytes are counted out");
        // Before it looks, it may read more: nothing is counted for it any more.
        big.hold(90).expect("an evicted connection is not charged");
        assert_eq!(budget.total(), 30);
        drop(big);
        assert_eq!(budget.total(), 30);
        // Now the small one is the largest: growing past the budget closes itself.
        let err = small.hold(150).expect_err("over");
        assert_eq!(err, OverBudget { held: 150, total: 150, limit: 100 });
    }

    #[tokio::test]
    async fn an_evicted_connection_is_woken() {
        let budget = PendingBudget::new(10);
        let mut victim = budget.charge();
        victim.hold(8).expect("within");
        let waiting = tokio::spawn(async move {
            victim.evicted().await;
            victim.is_evicted()
        });
        tokio::task::yield_now().await;
        let mut other = budget.charge();
        other.hold(5).expect("the victim holds more");
        assert!(tokio::time::timeout(std::time::Duration::from_secs(5), waiting).await.expect("woken").expect("task"));
    }

    #[test]
    fn connections_holding_and_evicting_each_other_at_once_keep_the_total_true() {
        // A connection chosen between its own look and taking the lock had its bytes
        // counted out twice (the total wrapped below zero). Threads racing holds
        // hit that window often; each ends by checking the total against the bytes
        // the connections still counted say they hold.
        for round in 0..100u64 {
            let budget = PendingBudget::new(1000);
            let charges: Vec<Charge> = std::thread::scope(|scope| {
                let workers: Vec<_> = (0..4u64)
                    .map(|worker| {
                        let budget = &budget;
                        scope.spawn(move || {
                            let mut charge = budget.charge();
                            let mut state = round * 31 + worker * 7 + 1;
                            for _ in 0..1000 {
                                state = state
                                    .wrapping_mul(6_364_136_223_846_793_005)
                                    .wrapping_add(1_442_695_040_888_963_407);
                                // Often nothing (a request read whole), else up to 600 bytes.
                                let bytes = if state >> 62 == 0 {
                                    0
                                } else {
                                    usize::try_from((state >> 33) % 600).expect("small")
                                };
                                if charge.hold(bytes).is_err() || charge.is_evicted() {
                                    charge = budget.charge();
                                }
                            }
                            charge
                        })
                    })
                    .collect();
                workers.into_iter().map(|worker| worker.join().expect("no overflow")).collect()
            });
            let counted: usize = charges.iter().filter(|c| !c.is_evicted()).map(Charge::held).sum();
            assert_eq!(budget.total(), counted, "round {round}");
            drop(charges);
            assert_eq!(budget.total(), 0, "round {round}");
        }
    }
}
