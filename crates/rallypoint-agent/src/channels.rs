//! Barrier channels (docs/PROTOCOL.md, section 15): the agent's side of barriers
//! its ranks synchronise through shared memory instead of messages.
//!
//! A rank on the Unix socket asks for a channel for one barrier call (its job, the
//! barrier's name, members and timeout); ranks making the same call share one
//! channel, a slot each. Each channel has a task that sleeps on the channel's
//! doorbell, takes the arrivals the slots show and forwards them upstream as the
//! ranks' own barrier requests (merged there into one frame per node, as calls
//! through messages are). When the coordinator answers, the upstream reader
//! finishes each slot (released, or failed: the error then goes to the rank on
//! its socket, exactly as without a channel) and wakes every waiting rank of the
//! channel with one futex wake.
//!
//! A rank gives its slot up when it leaves the channel (its client keeps seats
//! for only so many barriers) or its connection ends; a channel left with no rank
//! in a slot is retired, so that barriers named afresh as a job goes on do not
//! use up the agent's channels.
//!
//! Failure: a rank whose connection ends loses its slot at once, and the
//! coordinator learns of the end as for any rank (so the barrier fails on every
//! peer, each woken with its slot marked failed and the typed error naming the
//! rank on its socket). When the agent stops serving, every slot waiting is
//! failed and woken before the connections close.

use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rallypoint_core::Request;
use rallypoint_net::shm_barrier::{AgentChannel, Outcome};
use rallypoint_net::sync::lock;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::Notify;
use tracing::{debug, warn};

use crate::hub::{FastMap, Hub};

/// Channels an agent has at once: one per distinct barrier call its ranks hold
/// slots for (and one more per [`SLOTS`] ranks at the same call). Past it,
/// barriers go through messages.
const MAX_CHANNELS: usize = 256;
/// Slots per channel: as many ranks as a node runs, and more go to another channel.
const SLOTS: u32 = rallypoint_net::shm_barrier::MAX_SLOTS;
/// After a first arrival, how long the task gathers the node's arrivals before it
/// forwards those it has: a round cannot end before the node's last rank arrives
/// (whose arrival it forwards at once), so gathering costs the barrier nothing and
/// saves the coordinator a frame per rank; bounded, so that the coordinator soon
/// knows who arrived (for the timeout naming the missing ranks, and `status`).
const GATHER: Duration = Duration::from_millis(5);
/// While the channel's count says an arrival is on its way that its slot does not
/// show yet (the rank was preempted between the two), the task looks again: at
/// once a few times, then at this pace.
const LOOK_AGAIN: Duration = Duration::from_millis(1);
const LOOK_AGAIN_AT_ONCE: u32 = 16;

/// The agent's channels.
#[derive(Default)]
pub(crate) struct Channels {
    registry: Mutex<Registry>,
    /// Barrier calls forwarded from a slot and not yet answered, by `(sub, request id)`.
    calls: Mutex<FastMap<(u64, u64), Forwarded>>,
    /// The slots of each sub-session.
    seated: Mutex<FastMap<u64, Vec<Seated>>>,
}

#[derive(Default)]
struct Registry {
    /// The channels not retired.
    channels: Vec<Arc<Channel>>,
    /// Channels made so far: the next one's id (never reused: a rank that left a
    /// channel may still map its file under that id).
    made: u64,
}

/// A sub-session's slot: `(channel, slot)`.
type Seated = (Arc<Channel>, u32);

/// A call forwarded from a slot: where to write its outcome.
pub(crate) struct Forwarded {
    channel: Arc<Channel>,
    slot: u32,
    round: u32,
}

impl Forwarded {
    /// Marks the slot's round released (`ok`) or failed, and returns its channel
    /// for the caller to [`Channel::release`] once every call of the reply is marked.
    pub(crate) fn finish(self, sub: u64, ok: bool) -> Arc<Channel> {
        let Forwarded { channel, slot, round } = self;
        channel.finish(sub, slot, round, if ok { Outcome::Released } else { Outcome::Failed });
        channel
    }
}

/// One channel: the shared memory, its slots' owners, and its task's wake-up.
pub(crate) struct Channel {
    pub(crate) id: u64,
    job: String,
    request: Request,
    pub(crate) shm: AgentChannel,
    seats: Mutex<Seats>,
    /// Look at the slots now (a rank left, or the agent stops).
    poke: Notify,
}

struct Seats {
    /// Per slot used so far: the rank in it, if any.
    slots: Vec<Option<Seat>>,
    /// Slots used before and free now.
    free: Vec<u32>,
    /// Ranks in slots.
    attached: u32,
    /// Of them, how many have an arrival forwarded and not yet finished.
    held: u32,
    /// The agent stopped serving, or the channel was retired: its task ends.
    closed: bool,
}

struct Seat {
    sub: u64,
    /// The last round taken from the slot.
    seen: u32,
    /// The round forwarded and not finished yet, with its request id.
    held: Option<(u32, u64)>,
}

/// Why a rank gets no channel (it then goes through messages).
pub(crate) type NoChannel = String;

impl Channels {
    /// Seats sub-session `sub` of `job` in a channel for `request` (a barrier call),
    /// making one (and its task) if no channel for that call has a free slot.
    pub(crate) fn attach(
        &self,
        hub: &Arc<Hub>,
        sub: u64,
        job: &str,
        request: &Request,
    ) -> Result<(Arc<Channel>, u32), NoChannel> {
        let (channel, slot) = self.seat(hub, sub, job, request)?;
        lock(&self.seated).entry(sub).or_default().push((Arc::clone(&channel), slot));
        Ok((channel, slot))
    }

    fn seat(&self, hub: &Arc<Hub>, sub: u64, job: &str, request: &Request) -> Result<(Arc<Channel>, u32), NoChannel> {
        let mut registry = lock(&self.registry);
        for channel in &registry.channels {
            if channel.job == job && channel.request == *request {
                if let Some(slot) = channel.seat(sub) {
                    return Ok((Arc::clone(channel), slot));
                }
            }
        }
        if registry.channels.len() >= MAX_CHANNELS {
            return Err(format!("this node agent has made its {MAX_CHANNELS} barrier channels"));
        }
        let shm = AgentChannel::create(SLOTS).map_err(|error| {
            warn!(%error, "cannot make a barrier channel; barriers go through messages");
            format!("the node agent cannot make a barrier channel: {error}")
        })?;
        let cannot_watch =
            |error: std::io::Error| format!("the node agent cannot watch a barrier channel's doorbell: {error}");
        let watched = shm.doorbell.try_clone().map_err(cannot_watch)?;
        // SAFETY: the descriptor is the AsyncFd's own (a duplicate), open until it drops.
        let doorbell = unsafe { AsyncFd::register_with_interest(watched, Interest::READABLE) }
            .map_err(|error| cannot_watch(error.into()))?;
        let channel = Arc::new(Channel {
            id: registry.made,
            job: job.to_owned(),
            request: request.clone(),
            shm,
            seats: Mutex::new(Seats { slots: Vec::new(), free: Vec::new(), attached: 0, held: 0, closed: false }),
            poke: Notify::new(),
        });
        registry.made += 1;
        registry.channels.push(Arc::clone(&channel));
        debug!(channel = channel.id, %job, ?request, "new barrier channel");
        tokio::spawn(serve(Arc::clone(&channel), doorbell, Arc::clone(hub)));
        let slot = channel.seat(sub).ok_or_else(|| "a new barrier channel has no free slot".to_owned())?;
        Ok((channel, slot))
    }

    /// Sub-session `sub`'s connection ended: its slots are free, and its
    /// forwarded calls are no longer the channels' to finish.
    pub(crate) fn detach(&self, sub: u64) {
        let Some(seated) = lock(&self.seated).remove(&sub) else { return };
        for (channel, slot) in seated {
            self.unseat(sub, &channel, slot);
        }
    }

    /// Sub-session `sub` gives up slot `slot` of channel `id`. Returns whether it
    /// held that slot (nothing happens otherwise).
    pub(crate) fn leave(&self, sub: u64, id: u64, slot: u32) -> bool {
        let left = {
            let mut seated = lock(&self.seated);
            let Some(seats) = seated.get_mut(&sub) else { return false };
            let at = seats.iter().position(|(channel, s)| channel.id == id && *s == slot);
            at.map(|at| seats.swap_remove(at))
        };
        let Some((channel, slot)) = left else { return false };
        self.unseat(sub, &channel, slot);
        true
    }

    /// Frees `sub`'s slot `slot` of `channel` (a call it had forwarded is no longer
    /// the channel's to finish), and retires the channel if no rank is left in it.
    fn unseat(&self, sub: u64, channel: &Arc<Channel>, slot: u32) {
        if let Some(call) = channel.unseat(sub, slot) {
            lock(&self.calls).remove(&(sub, call));
        }
        {
            let mut registry = lock(&self.registry);
            let mut seats = lock(&channel.seats);
            if seats.attached == 0 && !seats.closed {
                seats.closed = true;
                registry.channels.retain(|kept| !Arc::ptr_eq(kept, channel));
                debug!(channel = channel.id, "barrier channel retired: no rank in it");
            }
        }
        channel.poke.notify_one();
    }

    /// Channels not retired.
    pub(crate) fn live(&self) -> usize {
        lock(&self.registry).channels.len()
    }

    /// The call `(sub, id)`, if it was forwarded from a slot: marks the slot's round
    /// released (`ok`) or failed, and returns its channel for the caller to
    /// [`Channel::release`] once every call of the reply is marked.
    pub(crate) fn finish(&self, sub: u64, id: u64, ok: bool) -> Option<Arc<Channel>> {
        let forwarded = lock(&self.calls).remove(&(sub, id))?;
        Some(forwarded.finish(sub, ok))
    }

    /// Of the calls `(sub, id)`, those forwarded from a slot, taken under one lock:
    /// [`Forwarded::finish`] each.
    pub(crate) fn take_forwarded(&self, calls: &[(u64, u64)]) -> Vec<Option<Forwarded>> {
        let mut forwarded = lock(&self.calls);
        if forwarded.is_empty() {
            return calls.iter().map(|_| None).collect();
        }
        calls.iter().map(|call| forwarded.remove(call)).collect()
    }

    /// The agent stops serving: every forwarded call fails (its error goes on the
    /// rank's socket with the other waiting calls'), every waiting rank is woken,
    /// and the channels' tasks end.
    pub(crate) fn fail_all(&self) {
        let calls: Vec<((u64, u64), Forwarded)> = lock(&self.calls).drain().collect();
        for ((sub, _), Forwarded { channel, slot, round }) in calls {
            channel.finish(sub, slot, round, Outcome::Failed);
        }
        let channels = lock(&self.registry).channels.clone();
        for channel in channels {
            lock(&channel.seats).closed = true;
            channel.release();
            channel.poke.notify_one();
        }
    }
}

impl Channel {
    /// A free slot for `sub`, readied; `None` if every slot is taken.
    fn seat(&self, sub: u64) -> Option<u32> {
        let mut seats = lock(&self.seats);
        if seats.closed {
            return None;
        }
        let slot = match seats.free.pop() {
            Some(slot) => slot,
            None if (seats.slots.len() as u32) < self.shm.slots() => {
                seats.slots.push(None);
                seats.slots.len() as u32 - 1
            }
            None => return None,
        };
        self.shm.reset_slot(slot);
        seats.slots[slot as usize] = Some(Seat { sub, seen: 0, held: None });
        seats.attached += 1;
        self.shm.set_attached(seats.attached);
        // Every attached rank counts towards the arrival that completes the node.
        self.shm.took(0, seats.attached - seats.held);
        Some(slot)
    }

    /// Frees `sub`'s slot `slot`; returns the request id it had forwarded, if any.
    fn unseat(&self, sub: u64, slot: u32) -> Option<u64> {
        let mut seats = lock(&self.seats);
        let at = slot as usize;
        if !matches!(seats.slots.get(at), Some(Some(seat)) if seat.sub == sub) {
            return None;
        }
        let seat = seats.slots[at].take()?;
        seats.free.push(slot);
        seats.attached -= 1;
        let call = seat.held.map(|(_, call)| call);
        if call.is_some() {
            seats.held -= 1;
        }
        self.shm.set_attached(seats.attached);
        // One rank fewer to wait for: the node may be complete now.
        self.shm.took(0, seats.attached - seats.held);
        call
    }

    fn finish(&self, sub: u64, slot: u32, round: u32, outcome: Outcome) {
        let mut seats = lock(&self.seats);
        if let Some(Some(seat)) = seats.slots.get_mut(slot as usize) {
            if seat.sub == sub && matches!(seat.held, Some((held, _)) if held == round) {
                seat.held = None;
                seats.held -= 1;
                self.shm.finish(slot, round, outcome);
            }
        }
    }

    /// Publishes the rounds finished since the last call and wakes every rank
    /// waiting on the channel (one futex wake), after readying the count for the
    /// next round.
    pub(crate) fn release(&self) {
        let seats = lock(&self.seats);
        self.shm.took(0, seats.attached - seats.held);
        self.shm.release();
    }

    /// Takes the slots' new arrivals: `(sub, request id, slot, round)` each. Returns
    /// them and whether an arrival counted is not visible yet (look again soon).
    fn take_arrivals(&self) -> (Vec<(u64, u64, u32, u32)>, bool) {
        let mut seats = lock(&self.seats);
        let mut taken = Vec::new();
        let Seats { slots, held, .. } = &mut *seats;
        for (slot, seat) in slots.iter_mut().enumerate() {
            let Some(seat) = seat else { continue };
            if seat.held.is_some() {
                continue;
            }
            if let Some((round, call)) = self.shm.arrival(slot as u32, seat.seen) {
                seat.seen = round;
                seat.held = Some((round, call));
                *held += 1;
                taken.push((seat.sub, call, slot as u32, round));
            }
        }
        let expect = seats.attached - seats.held;
        let mut left = self.shm.took(taken.len() as u32, expect);
        if expect == 0 && left != 0 {
            // Every rank in a slot has arrived and waits: no arrival can be on its
            // way, so what the count says beyond them is a rank that counted itself
            // and died before writing its slot.
            left = self.shm.took(left, 0);
        }
        (taken, left != 0)
    }
}

/// A channel's task: takes arrivals when the doorbell rings and forwards them.
async fn serve(channel: Arc<Channel>, doorbell: AsyncFd<OwnedFd>, hub: Arc<Hub>) {
    let mut look_again = 0u32;
    // Gathering arrivals until then.
    let mut gather_until: Option<tokio::time::Instant> = None;
    loop {
        if (1..=LOOK_AGAIN_AT_ONCE).contains(&look_again) {
            tokio::task::yield_now().await;
        } else {
            let wake_at = if look_again > 0 { Some(tokio::time::Instant::now() + LOOK_AGAIN) } else { gather_until };
            tokio::select! {
                ready = doorbell.readable() => match ready {
                    Ok(mut guard) => guard.clear_ready(),
                    Err(error) => {
                        warn!(channel = channel.id, %error, "a barrier channel's doorbell failed");
                        return;
                    }
                },
                () = channel.poke.notified() => {}
                () = sleep_until(wake_at) => {}
            }
        }
        if lock(&channel.seats).closed {
            return;
        }
        channel.shm.drain_doorbell();
        let due = gather_until.is_some_and(|at| tokio::time::Instant::now() >= at);
        if look_again == 0 && !due && !channel.shm.all_counted() {
            // More of the node's ranks are on their way: the last one rings.
            gather_until.get_or_insert_with(|| tokio::time::Instant::now() + GATHER);
            continue;
        }
        gather_until = None;
        let (taken, pending) = channel.take_arrivals();
        look_again = if pending { look_again + 1 } else { 0 };
        if !taken.is_empty() {
            forward(&hub, &channel, taken);
        }
    }
}

/// Sleeps until `at`; forever without one.
async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Sends the arrivals up as their ranks' barrier requests.
fn forward(hub: &Hub, channel: &Arc<Channel>, taken: Vec<(u64, u64, u32, u32)>) {
    let ids: Vec<(u64, u64)> = taken.iter().map(|&(sub, id, ..)| (sub, id)).collect();
    let locals = hub.routes(&ids);
    let mut calls = lock(&hub.channels.calls);
    let mut requests = Vec::with_capacity(taken.len());
    for ((sub, id, slot, round), local) in taken.into_iter().zip(locals) {
        let Some(local) = local else { continue };
        calls.insert((sub, id), Forwarded { channel: Arc::clone(channel), slot, round });
        local.awaiting(id);
        requests.push((sub, id));
    }
    drop(calls);
    if !hub.send_calls(&requests, &channel.request) {
        // Lost meanwhile: `Hub::lose` failed what it found; these may have come after.
        hub.channels.fail_all();
    }
}
