//! Barriers through shared memory with this node's agent (docs/PROTOCOL.md,
//! section 15).
//!
//! On a Unix socket to its node agent, the second call of a barrier (name, members,
//! timeout) goes as a request that also asks the agent for a *channel*; with one,
//! every later call of that barrier arrives by writing the channel's shared memory
//! and waits on its futex instead of sending a request and reading a reply. (Not
//! the first call: a program that names a barrier afresh at every step would make
//! the agent map a channel for each name, used once, costing more than the message
//! it saves.) The call still has a request id: if the barrier fails, the slot says
//! so and the coordinator's typed error (the timeout naming the missing ranks, the
//! lost rank) arrives on the socket as that id's reply, exactly as without a
//! channel. Where there is no channel (TCP, the coordinator itself, an agent that
//! has none to give), the barrier goes through messages as before.
//!
//! A released round (the common case) has no reply, so the call only takes an id
//! and registers no reply slot: it touches nothing but the channel's memory. Only
//! a round that failed (or a wait stopped otherwise) looks for its reply
//! ([`Link::claim`]); the agent may have sent it before the call woke, so the
//! connection keeps a reply to an id it does not wait for if a call through a
//! channel holds that id ([`Channels::calling`]).
//!
//! Waiting: the blocking client waits on the futex in its caller's thread (the
//! one wake-up a release costs). The async client must not block a runtime
//! thread (a process may hold thousands of clients): one task listens to the
//! channel's release bell (an eventfd the agent rings after a release while anyone
//! sleeps on it) through an event loop, that of the runtime serving the client's
//! connection (which must turn for the client to work at all), and wakes the
//! process's tasks waiting on the channel, so a release wakes a runtime's thread
//! directly, as a reply on a socket would. A thread in between (sleeping on the
//! futex, then waking the tasks) would cost two more context switches a round.
//! Where the bell cannot be listened to (or the listener stopped), a watcher thread
//! per channel and process sleeps on the futex for the async waiters and wakes
//! their tasks.
//!
//! A channel belongs to one connection: when it ends, every rank of this process
//! waiting on it is woken (the agent may be gone and never wake them), and later
//! calls ask again on the next connection. A call waiting when the connection is
//! cut may have been counted: it is sent again as a request on the resumed session,
//! as any request written and not answered is (`Link::adopt_channel_calls`).
//!
//! A seat goes back to the agent (LeaveBarrierChannel) when the client stops
//! keeping track of its barrier ([`MAX_USES`]) or stops trusting it (a call through
//! it timed out or was dropped), so that the agent retires channels no rank is in;
//! the leave waits while an answer to an attach request may still come, as that
//! answer may count on the channel's files not being forgotten ([`Channels::send_leaves`]).

use std::collections::{HashMap, VecDeque};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Once, OnceLock, Weak};
use std::time::{Duration, Instant};

use rallypoint_core::{Members, Request, Response};
use rallypoint_net::shm_barrier::{Outcome, RankChannel, Until, Waited};
use rallypoint_net::sync::lock;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::{mpsc, Notify};
use tracing::{debug, warn};

use crate::connection::{AbortOnDrop, Command, Link, Reply};
use crate::error::Error;

/// Barrier calls (name, members, timeout) a client keeps track of: a program that
/// names each barrier afresh must not make the list grow without end. Past it, a
/// barrier called once makes room first, and a seat only when every other barrier
/// has one: its slot is given back to the agent ([`ClientFrame::LeaveBarrierChannel`]).
///
/// [`ClientFrame::LeaveBarrierChannel`]: rallypoint_proto::native::ClientFrame::LeaveBarrierChannel
const MAX_USES: usize = 64;

/// This client's barrier channels.
pub(crate) struct Channels {
    state: Mutex<State>,
    /// The connection task's queue, for the slots given back.
    commands: mpsc::WeakUnboundedSender<Command>,
    /// The runtime serving the connection, where the release bells are listened to
    /// for its async calls; `None`: made outside one (no connection task, no listener).
    runtime: Option<tokio::runtime::Handle>,
}

#[derive(Default)]
struct State {
    /// Counts the connections ended: a seat is valid on the connection it was given on.
    epoch: u64,
    /// Channels of the current connection by id; `None`: one that could not be mapped.
    mapped: HashMap<u64, Option<Arc<Mapped>>>,
    /// Every channel mapped on the current connection that a seat may still hold,
    /// those forgotten in `mapped` (given back) included: the connection's end
    /// must reach their waiters too.
    live: Vec<Weak<Mapped>>,
    /// The attach requests of this connection, by request id, from when they are
    /// sent until their calls take their answers (or, for a call that gave up,
    /// until the answer comes).
    answers: HashMap<u64, Answer>,
    /// Slots to give back once no answer is due ([`Channels::give_back`]).
    leaving: Vec<(u64, u32)>,
    /// How each barrier call (name, members, timeout) goes.
    uses: Vec<(Request, Use)>,
}

/// An attach request's answer, as its call finds it.
enum Answer {
    /// Not come yet.
    Awaited,
    /// Not come yet, and its call gave up: a slot it gives goes back.
    Abandoned,
    /// `(channel id, channel, slot)`, or `None` for no channel.
    Got(Option<(u64, Arc<Mapped>, u32)>),
}

impl State {
    /// Sets how the calls of the barrier `is` picks out go.
    fn set_use(&mut self, is: impl Fn(&Request) -> bool, used: Use) {
        if let Some((_, known)) = self.uses.iter_mut().find(|(r, _)| is(r)) {
            *known = used;
        }
    }

    /// Whether an answer to an attach request may still come.
    fn answer_due(&self) -> bool {
        self.answers.values().any(|answer| matches!(answer, Answer::Awaited | Answer::Abandoned))
    }
}

enum Use {
    /// Called once, through messages: the next call asks for a channel.
    Once,
    /// Through messages, for good: no channel for it (or it broke).
    Messages,
    /// A call is in flight through the channel (or attaching): others of this
    /// client meanwhile go through messages. `call`: the request id of a call
    /// through the seat, whose reply (an error) may come before it looks for it.
    Busy {
        call: Option<u64>,
    },
    Seat(Seat),
}

/// A channel as one client mapped it.
struct Mapped {
    channel: RankChannel,
    /// The connection it came with ended: nobody will finish its rounds.
    ended: AtomicBool,
    /// Its watcher, shared with every client of this process on the same channel.
    watched: Arc<Watched>,
}

/// A channel watched for the async waiters of this process, however many clients
/// of the process use it (each waiter listening on its own would cost a wake-up
/// each at every release): `moved` wakes them at each release, from a task that
/// listens to the release bell or else from the watcher thread, and when their calls
/// may have been answered on the socket or their connection ended.
struct Watched {
    channel: RankChannel,
    /// The listener in the runtime of the first connection that waited on the
    /// channel (read without a lock: a process usually has one runtime), and those
    /// of any other: a wait depends on no runtime but its own connection's, which
    /// must turn anyway (heartbeats, replies), not on one that may be busy or idle.
    first: OnceLock<Listener>,
    others: Mutex<Vec<Arc<Listener>>>,
    /// Wakes the async tasks waiting on the channel.
    moved: Notify,
    watcher: Once,
    /// Listeners fail to start, as where the bell cannot be registered.
    #[cfg(test)]
    refuse_listeners: AtomicBool,
}

/// The task listening to a channel's release bell in one runtime (stopped when
/// this drops).
struct Listener {
    runtime: tokio::runtime::Id,
    /// `None`: it could not start.
    task: Option<AbortOnDrop>,
    /// It stopped (its runtime shut down): the watcher thread wakes the waits. Set
    /// by its [`Deafened`].
    deaf: Arc<AtomicBool>,
}

impl Listener {
    /// Whether waits can count on it to wake them.
    fn hears(&self) -> bool {
        self.task.is_some() && !self.deaf.load(Ordering::Acquire)
    }
}

/// The listener in a connection's runtime, as [`Watched::listen`] finds it.
enum Ear<'a> {
    First(&'a Listener),
    Other(Arc<Listener>),
}

impl std::ops::Deref for Ear<'_> {
    type Target = Listener;

    fn deref(&self) -> &Listener {
        match self {
            Ear::First(listener) => listener,
            Ear::Other(listener) => listener,
        }
    }
}

/// A channel's memory file: (device, inode).
type FileKey = (u64, u64);

/// The channels watched in this process, by their memory file.
static WATCHED: Mutex<Vec<(FileKey, Weak<Watched>)>> = Mutex::new(Vec::new());

impl Watched {
    /// The watcher of the channel whose memory file is `file` (mapping it anew for
    /// the watcher if this process has none yet).
    fn of(file: &OwnedFd, doorbell: &OwnedFd, bell: OwnedFd) -> std::io::Result<Arc<Watched>> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::File::from(file.try_clone()?).metadata()?;
        let key = (meta.dev(), meta.ino());
        let mut watched = lock(&WATCHED);
        watched.retain(|(_, w)| w.strong_count() > 0);
        if let Some(live) = watched.iter().find(|(k, _)| *k == key).and_then(|(_, w)| w.upgrade()) {
            return Ok(live);
        }
        let channel = RankChannel::map(file.try_clone()?, doorbell.try_clone()?, Some(bell))?;
        let made = Arc::new(Watched {
            channel,
            first: OnceLock::new(),
            others: Mutex::new(Vec::new()),
            moved: Notify::new(),
            watcher: Once::new(),
            #[cfg(test)]
            refuse_listeners: AtomicBool::new(false),
        });
        watched.push((key, Arc::downgrade(&made)));
        Ok(made)
    }

    /// The task listening to the release bell in `runtime` (a connection's), started
    /// at its first call there. Where it does not hear ([`Listener::hears`]), the
    /// caller starts the watcher thread ([`Watched::watch`]).
    fn listen(self: &Arc<Self>, runtime: &tokio::runtime::Handle) -> Ear<'_> {
        let id = runtime.id();
        let first = self.first.get_or_init(|| self.start_listener(runtime));
        if first.runtime == id {
            return Ear::First(first);
        }
        let mut others = lock(&self.others);
        if let Some(known) = others.iter().find(|listener| listener.runtime == id) {
            return Ear::Other(Arc::clone(known));
        }
        // Those of runtimes gone go first: a process may start runtimes one after another.
        others.retain(|listener| listener.hears());
        let made = Arc::new(self.start_listener(runtime));
        others.push(Arc::clone(&made));
        Ear::Other(made)
    }

    fn start_listener(self: &Arc<Self>, runtime: &tokio::runtime::Handle) -> Listener {
        let bell = self.channel.bell().map(|bell| bell.try_clone_to_owned());
        #[cfg(test)]
        let bell = bell.filter(|_| !self.refuse_listeners.load(Ordering::Relaxed));
        let deaf = Arc::new(AtomicBool::new(false));
        let task = match bell {
            Some(Ok(bell)) => {
                let deafened = Deafened { watched: Arc::downgrade(self), deaf: Arc::clone(&deaf) };
                Some(AbortOnDrop(runtime.spawn(listen(bell, deafened)).abort_handle()))
            }
            Some(Err(error)) => {
                debug!(%error, "cannot listen to a barrier channel's release bell");
                None
            }
            None => None,
        };
        Listener { runtime: runtime.id(), task, deaf }
    }

    /// Starts the thread that watches the channel for async waiters, once.
    fn watch(self: &Arc<Self>) {
        self.watcher.call_once(|| {
            let watched = Arc::downgrade(self);
            // Read here, before the caller's next look at its slot: any release from
            // then on wakes it (read in the new thread, it could miss the release of
            // this very round).
            let seen = self.channel.release_word();
            let started =
                std::thread::Builder::new().name("rallypoint-barrier".to_owned()).spawn(move || watch(watched, seen));
            if let Err(error) = started {
                // Waiters still wake, at each check of their deadline.
                warn!(%error, "cannot start a barrier channel's watcher thread");
            }
        });
    }
}

/// A task listening to a channel's release bell: wakes the channel's async waiters
/// at each ring, until the channel is no longer used in this process. Should it
/// stop otherwise (its runtime shut down, even before it first ran), its
/// [`Deafened`] tells them so.
async fn listen(bell: OwnedFd, listener: Deafened) {
    // Registered here, with the runtime the task runs in. A ring before this finds
    // the bell readable at once (its count is never read back to 0): a spurious
    // wake-up at worst, never a lost one.
    // SAFETY: the descriptor is the AsyncFd's own (a duplicate), open until it drops.
    let bell = match unsafe { AsyncFd::register_with_interest(bell, Interest::READABLE) } {
        Ok(bell) => bell,
        Err(error) => {
            debug!(error = %std::io::Error::from(error), "cannot listen to a barrier channel's release bell");
            return;
        }
    };
    while let Ok(mut rang) = bell.readable().await {
        // Cleared before the waiters look: a ring after their look is a new edge.
        rang.clear_ready();
        let Some(watched) = listener.watched.upgrade() else { return };
        watched.moved.notify_waiters();
    }
}

/// The channel a listener serves and its [`Listener::deaf`]: dropped with the
/// listener, it marks it deaf ([`Listener::hears`]) and wakes the waiters to find
/// out (unless the channel is gone).
struct Deafened {
    watched: Weak<Watched>,
    deaf: Arc<AtomicBool>,
}

impl Drop for Deafened {
    fn drop(&mut self) {
        // Before the wake-up, which the waiters answer by asking whether it hears.
        self.deaf.store(true, Ordering::Release);
        if let Some(watched) = self.watched.upgrade() {
            watched.moved.notify_waiters();
        }
    }
}

/// How often a watcher thread looks whether its channel is still in use.
const WATCH_CHECK: Duration = Duration::from_secs(1);

/// A watcher thread: wakes the channel's async waiters each time the release
/// word moves (a connection's end moves it too), until no client uses the channel.
fn watch(watched: Weak<Watched>, mut seen: u32) {
    while let Some(w) = watched.upgrade() {
        w.channel.wait_release(seen, WATCH_CHECK);
        let now = w.channel.release_word();
        if now != seen {
            seen = now;
            w.moved.notify_waiters();
        }
    }
}

/// How a barrier call waits for its round's end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Waiting {
    /// Blocks the calling thread (the blocking client's caller, not a runtime's).
    Thread,
    /// Awaits, woken by the task listening to the channel's release bell in its
    /// connection's runtime (or else by the watcher thread).
    Task,
}

struct Seat {
    /// The agent's id of the channel.
    id: u64,
    channel: Arc<Mapped>,
    slot: u32,
    /// The last round arrived at.
    round: u32,
    epoch: u64,
}

impl Channels {
    fn lock(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// Channels of a connection whose task runs in the current runtime.
    pub(crate) fn new(commands: mpsc::WeakUnboundedSender<Command>) -> Self {
        Channels { state: Mutex::default(), commands, runtime: tokio::runtime::Handle::try_current().ok() }
    }

    /// Gives slot `slot` of channel `id`, of connection `epoch`, back to the agent
    /// (a slot of a connection that ended went with it), once no answer to an
    /// attach request is due: see [`Channels::send_leaves`].
    fn give_back(&self, state: &mut State, id: u64, slot: u32, epoch: u64) {
        if epoch == state.epoch {
            state.leaving.push((id, slot));
            self.send_leaves(state);
        }
    }

    /// Sends the slots to give back, unless an answer to an attach request is due.
    /// The agent sends a channel's files again with the first slot of it after a
    /// leave, so the client forgets its mapping as it leaves (a seat holding it
    /// keeps it); an answer the agent sent before it read the leave comes without
    /// them, and would find no mapping: hence no leave while one may come. Sent
    /// under the lock, so that each goes out before any later attach request.
    fn send_leaves(&self, state: &mut State) {
        if state.leaving.is_empty() || state.answer_due() {
            return;
        }
        let epoch = state.epoch;
        for (id, slot) in std::mem::take(&mut state.leaving) {
            state.mapped.remove(&id);
            // Fails only once the connection task is gone, and the slot with it.
            if let Some(commands) = self.commands.upgrade() {
                let _ = commands.send(Command::LeaveChannel { channel: id, slot, epoch });
            }
        }
    }

    /// Forgets a barrier not in a call: the oldest called once or going through
    /// messages, else the oldest with a seat, whose slot goes back to the agent.
    /// `false`: every barrier is in a call.
    fn make_room(&self, state: &mut State) -> bool {
        let cheap = state.uses.iter().position(|(_, used)| matches!(used, Use::Once | Use::Messages));
        let Some(at) = cheap.or_else(|| state.uses.iter().position(|(_, used)| matches!(used, Use::Seat(_)))) else {
            return false;
        };
        if let (_, Use::Seat(seat)) = state.uses.remove(at) {
            self.give_back(state, seat.id, seat.slot, seat.epoch);
        }
        true
    }

    /// The connection's reader got a channel for attach request `id` (its files in
    /// `files` if the channel is new to this connection). `Err`: the files are missing.
    pub(crate) fn answered(
        &self,
        id: u64,
        channel: u64,
        slot: u32,
        files: &mut VecDeque<OwnedFd>,
    ) -> Result<(), String> {
        let mut state = self.lock();
        let mapped = match state.mapped.get(&channel) {
            Some(mapped) => mapped.clone(),
            None => {
                let (Some(file), Some(doorbell), Some(bell)) =
                    (files.pop_front(), files.pop_front(), files.pop_front())
                else {
                    return Err(format!("barrier channel {channel} came without its files"));
                };
                // The bell is listened to through the process's mapping (`Watched`) alone.
                let mapped = match Watched::of(&file, &doorbell, bell)
                    .and_then(|w| Ok((w, RankChannel::map(file, doorbell, None)?)))
                {
                    Ok((watched, channel)) => {
                        let mapped = Arc::new(Mapped { channel, ended: AtomicBool::new(false), watched });
                        state.live.retain(|live| live.strong_count() > 0);
                        state.live.push(Arc::downgrade(&mapped));
                        Some(mapped)
                    }
                    Err(error) => {
                        debug!(channel, %error, "cannot map a barrier channel; its barriers go through messages");
                        None
                    }
                };
                state.mapped.insert(channel, mapped.clone());
                mapped
            }
        };
        let answer = mapped.filter(|m| slot < m.channel.slots()).map(|mapped| (channel, mapped, slot));
        let usable = answer.is_some();
        let taken = match state.answers.get_mut(&id) {
            Some(awaited @ Answer::Awaited) => {
                *awaited = Answer::Got(answer);
                usable
            }
            // Its call gave up: no answer is due any more.
            Some(Answer::Abandoned) => {
                state.answers.remove(&id);
                false
            }
            // A second answer (the agent broke the protocol: the first stands), or
            // one to no attach request of this connection.
            Some(Answer::Got(_)) | None => false,
        };
        // A slot this client cannot use, or that no call waits for, must not count
        // it in at the agent.
        if !taken {
            let epoch = state.epoch;
            self.give_back(&mut state, channel, slot, epoch);
        }
        self.send_leaves(&mut state);
        Ok(())
    }

    /// The connection's reader was told there is no channel for attach request `id`.
    pub(crate) fn refused(&self, id: u64) {
        let mut state = self.lock();
        match state.answers.get_mut(&id) {
            Some(awaited @ Answer::Awaited) => *awaited = Answer::Got(None),
            Some(Answer::Abandoned) => {
                state.answers.remove(&id);
            }
            Some(Answer::Got(_)) | None => {}
        }
        self.send_leaves(&mut state);
    }

    /// The connection ended: its channels are given up, and whoever waits on one is
    /// woken to find out.
    pub(crate) fn connection_ended(&self) {
        let live = {
            let mut state = self.lock();
            state.epoch += 1;
            state.answers.clear();
            state.leaving.clear();
            state.mapped.clear();
            std::mem::take(&mut state.live)
        };
        for mapped in live.iter().filter_map(Weak::upgrade) {
            mapped.ended.store(true, Ordering::Release);
            mapped.channel.wake_waiters();
            mapped.watched.moved.notify_waiters();
        }
    }

    fn epoch(&self) -> u64 {
        self.lock().epoch
    }

    /// A reply to a call through a channel came on the socket: the async calls
    /// waiting on this client's channels look whether it is theirs. (Every one of
    /// them wakes, those of other clients of the process on the same channels too:
    /// a reply to such a call is rare, and their waits then cost nothing more.)
    pub(crate) fn wake_async_waiters(&self) {
        let watched: Vec<Arc<Watched>> =
            self.lock().live.iter().filter_map(Weak::upgrade).map(|mapped| Arc::clone(&mapped.watched)).collect();
        for watched in watched {
            watched.moved.notify_waiters();
        }
    }

    /// A reply to request `id` came that no call took: if it was an attach request
    /// whose call gave up, its answer, which comes before the reply, is not due.
    pub(crate) fn reply_came(&self, id: u64) {
        let mut state = self.lock();
        if matches!(state.answers.get(&id), Some(Answer::Abandoned)) {
            state.answers.remove(&id);
            self.send_leaves(&mut state);
        }
    }

    /// The barrier calls in flight through a channel, `(request id, request)` each.
    pub(crate) fn in_flight(&self) -> Vec<(u64, Request)> {
        let state = self.lock();
        let calls = state.uses.iter().filter_map(|(request, used)| match used {
            Use::Busy { call: Some(id) } => Some((*id, request.clone())),
            _ => None,
        });
        calls.collect()
    }

    /// Call `id` is a barrier call in flight through a channel: a reply to it that
    /// comes before the call looks for it is kept for it.
    pub(crate) fn calling(&self, id: u64) -> bool {
        self.lock().uses.iter().any(|(_, used)| matches!(used, Use::Busy { call: Some(call) } if *call == id))
    }
}

/// What [`barrier`] needs of its client.
pub(crate) struct Caller<'a> {
    pub(crate) link: &'a Arc<Link>,
    pub(crate) commands: &'a tokio::sync::mpsc::UnboundedSender<Command>,
}

/// A barrier call through this client's channel for it: `None` if it has none (the
/// caller sends it as a request).
pub(crate) async fn barrier(
    caller: Caller<'_>,
    request: &Request,
    wait: Duration,
    waiting: Waiting,
) -> Option<Result<(), Error>> {
    let link = caller.link;
    let seat = {
        let mut state = link.channels.lock();
        let epoch = state.epoch;
        match state.uses.iter_mut().find(|(r, _)| r == request) {
            Some((_, Use::Messages | Use::Busy { .. })) => return None,
            Some((_, used @ Use::Once)) => {
                *used = Use::Busy { call: None };
                None
            }
            Some((_, used @ Use::Seat(_))) => match std::mem::replace(used, Use::Busy { call: None }) {
                Use::Seat(seat) if seat.epoch == epoch => {
                    let id = link.next_id();
                    *used = Use::Busy { call: Some(id) };
                    Some((seat, id))
                }
                _ => None,
            },
            None => {
                if state.uses.len() >= MAX_USES && !link.channels.make_room(&mut state) {
                    // Every barrier it keeps track of is in a call.
                    return None;
                }
                state.uses.push((request.clone(), Use::Once));
                return None;
            }
        }
    };
    let Some((seat, id)) = seat else {
        let mut in_call = InCall { link, request, seat: None, done: false };
        let done = attach(&caller, request, wait).await;
        in_call.done = true;
        return done;
    };
    let mut in_call = InCall { link, request, seat: Some((seat.id, seat.slot, seat.epoch)), done: false };
    let (outcome, then) = arrive_and_wait(link, seat, id, wait, waiting).await;
    in_call.done = true;
    put_back(link, |r| r == request, then);
    Some(outcome)
}

/// A barrier call in flight through a channel or asking for one, which its caller
/// may drop mid-way (a timeout of its own around it): the barrier then asks for a
/// channel again at its next call, rather than staying in a call for good (its
/// calls through messages, never making room), and a seat the call held goes back
/// to the agent, which may hold its arrival.
struct InCall<'a> {
    link: &'a Link,
    request: &'a Request,
    /// The seat's channel id, slot and connection.
    seat: Option<(u64, u32, u64)>,
    done: bool,
}

impl Drop for InCall<'_> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut state = self.link.channels.lock();
        if let Some((id, slot, epoch)) = self.seat {
            self.link.channels.give_back(&mut state, id, slot, epoch);
        }
        state.set_use(|r| r == self.request, Use::Once);
    }
}

/// What becomes of a seat once a call through it ended.
enum Then {
    /// Kept for the barrier's next call.
    Keep(Seat),
    /// No longer to be trusted (the agent may still hold an arrival from it): its
    /// slot goes back to the agent, and the barrier's next call asks for a channel.
    GiveBack(Seat),
}

/// Records how the next call of the barrier `is` picks out goes once a call through
/// its seat ended.
fn put_back(link: &Link, is: impl Fn(&Request) -> bool, then: Then) {
    let mut state = link.channels.lock();
    let next = match then {
        Then::Keep(seat) => Use::Seat(seat),
        Then::GiveBack(seat) => {
            link.channels.give_back(&mut state, seat.id, seat.slot, seat.epoch);
            Use::Once
        }
    };
    state.set_use(is, next);
}

/// A barrier call as its caller states it: found among the calls a client keeps
/// without building a request for it.
pub(crate) struct BarrierCall<'a> {
    pub(crate) name: &'a str,
    pub(crate) members: &'a Members,
    pub(crate) timeout_ms: Option<u64>,
}

impl BarrierCall<'_> {
    fn is(&self, request: &Request) -> bool {
        matches!(request, Request::Barrier { name, members, timeout_ms }
            if name == self.name && members == self.members && *timeout_ms == self.timeout_ms)
    }

    fn request(&self) -> Request {
        Request::Barrier { name: self.name.into(), members: self.members.clone(), timeout_ms: self.timeout_ms }
    }
}

/// What [`barrier_on_thread`] came to.
pub(crate) enum OnThread {
    /// The call ended here.
    Done(Result<(), Error>),
    /// The round ended and its outcome comes on the socket: await [`Concluding::finish`].
    Conclude(Concluding),
    /// This client holds no seat for the barrier (yet): make the call with [`barrier`].
    Elsewhere,
    /// The caller's [`Interrupt`] said to give up: the seat went back to the agent,
    /// as an async call's does when it is dropped mid-wait ([`InCall`]).
    Interrupted,
}

/// How a barrier waiting in its caller's thread may be given up before its timeout:
/// `check` is asked about every `every` while the round goes on, and a `true` ends
/// the wait. For bindings whose users expect Ctrl-C to end any wait (Python runs its
/// signal handlers in `check`).
pub struct Interrupt<'a> {
    pub every: Duration,
    pub check: &'a mut (dyn FnMut() -> bool + Send),
}

/// A call through a channel whose outcome, an error, comes on the socket.
pub(crate) struct Concluding {
    link: Arc<Link>,
    request: Request,
    pending: Pending,
}

impl Concluding {
    pub(crate) async fn finish(self) -> Result<(), Error> {
        let (outcome, seat) = self.pending.reply(&self.link).await;
        put_back(&self.link, |r| *r == self.request, seat);
        outcome
    }
}

/// A barrier through the seat the client holds for it, entirely in the caller's
/// thread (the blocking client's, the Python package's): a released round (the common
/// case) needs no runtime, no task and no future; only an outcome that comes on the
/// socket is awaited, by the caller. `interrupt`: see [`Interrupt`].
pub(crate) fn barrier_on_thread(
    link: &Arc<Link>,
    call: &BarrierCall<'_>,
    wait: Duration,
    interrupt: Option<Interrupt<'_>>,
) -> OnThread {
    let (seat, id) = {
        let mut state = link.channels.lock();
        let epoch = state.epoch;
        // Left as it is otherwise: [`barrier`] deals with every other case.
        let Some((_, used)) = state.uses.iter_mut().find(|(r, _)| call.is(r)) else { return OnThread::Elsewhere };
        if !matches!(&*used, Use::Seat(seat) if seat.epoch == epoch) {
            return OnThread::Elsewhere;
        }
        let id = link.next_id();
        let Use::Seat(seat) = std::mem::replace(used, Use::Busy { call: Some(id) }) else {
            unreachable!("a seat, looked at just above")
        };
        (seat, id)
    };
    let arrival = arrive(link, seat, id, wait);
    let waited = match interrupt {
        None => Some(wait_thread(link, &arrival)),
        Some(interrupt) => wait_thread_interruptibly(link, &arrival, interrupt),
    };
    let Some((waited, deadline)) = waited else {
        put_back(link, |r| call.is(r), Then::GiveBack(arrival.seat));
        return OnThread::Interrupted;
    };
    match settle(link, arrival, waited, deadline) {
        Settled::Done(outcome, seat) => {
            put_back(link, |r| call.is(r), seat);
            OnThread::Done(outcome)
        }
        Settled::Reply(pending) => {
            OnThread::Conclude(Concluding { link: Arc::clone(link), request: call.request(), pending })
        }
    }
}

/// Makes the call as a request that also asks the agent for a channel for the
/// later ones, and records the answer. `None`: the peer knows no such request (an
/// older agent), and the caller makes the call, and all later ones, as requests.
async fn attach(caller: &Caller<'_>, request: &Request, wait: Duration) -> Option<Result<(), Error>> {
    let link = caller.link;
    let (id, reply) = match link.register(wait) {
        Ok(registered) => registered,
        Err(error) => {
            set_use(link, request, Use::Once);
            return Some(Err(error));
        }
    };
    let registered = crate::client::Registered { link, id, settled: false };
    // Counted on, and asked on, this connection: queued past its end, it goes as
    // a plain request.
    let epoch = {
        let mut state = link.channels.lock();
        state.answers.insert(id, Answer::Awaited);
        state.epoch
    };
    let _awaiting = Awaiting { channels: &link.channels, id };
    if caller.commands.send(Command::AttachBarrier { id, request: request.clone(), epoch }).is_err() {
        // Not sent: no answer is due.
        link.channels.lock().answers.remove(&id);
        set_use(link, request, Use::Once);
        return Some(Err(link.disconnected()));
    }
    let result = match tokio::time::timeout(wait, reply).await {
        Ok(Ok(Ok(Response::Done))) => Ok(()),
        Ok(Ok(Ok(other))) => Err(Error::Protocol(format!("unexpected reply to barrier: {other:?}"))),
        Ok(Ok(Err(error))) => Err(error),
        Ok(Err(_)) => Err(link.disconnected()),
        Err(_) => Err(Error::Timeout(wait)),
    };
    drop(registered);
    let unread = matches!(result, Err(Error::Op(rallypoint_core::OpError::Invalid(_))));
    let answer = link.channels.take_answer(id, unread);
    let used = match answer {
        Some(Some((channel_id, channel, slot))) if link.channels.epoch() == epoch => {
            Use::Seat(Seat { id: channel_id, channel, slot, round: 0, epoch })
        }
        Some(None) => Use::Messages,
        // Refused unread: a peer that does not know the frame.
        None if unread => {
            set_use(link, request, Use::Messages);
            return None;
        }
        // No answer, or one of a connection that ended since: ask again at the next call.
        Some(Some(_)) | None => Use::Once,
    };
    set_use(link, request, used);
    Some(result)
}

/// An attach request in flight: should its call give up before taking the answer
/// (dropped by its caller), a slot the answer gave goes back to the agent, and an
/// answer that comes later finds no call ([`Channels::answered`] gives it back).
struct Awaiting<'a> {
    channels: &'a Channels,
    id: u64,
}

impl Drop for Awaiting<'_> {
    fn drop(&mut self) {
        let mut state = self.channels.lock();
        // Taken already unless the call was dropped.
        match state.answers.remove(&self.id) {
            Some(Answer::Got(Some((channel, _, slot)))) => {
                let epoch = state.epoch;
                self.channels.give_back(&mut state, channel, slot, epoch);
            }
            Some(Answer::Awaited | Answer::Abandoned) => {
                state.answers.insert(self.id, Answer::Abandoned);
            }
            // Taken, or removed unsent by `attach`: slots held back while it was
            // due may go now.
            Some(Answer::Got(None)) | None => self.channels.send_leaves(&mut state),
        }
    }
}

impl Channels {
    /// Takes the answer to attach request `id`, if it came; if not, it stays due
    /// (a slot it gives then goes back), unless `unread`: the peer refused the
    /// request unread, and no answer comes.
    fn take_answer(&self, id: u64, unread: bool) -> Option<Option<(u64, Arc<Mapped>, u32)>> {
        let mut state = self.lock();
        let taken = match state.answers.remove(&id) {
            Some(Answer::Got(answer)) => Some(answer),
            Some(Answer::Awaited | Answer::Abandoned) if !unread => {
                state.answers.insert(id, Answer::Abandoned);
                None
            }
            _ => None,
        };
        self.send_leaves(&mut state);
        taken
    }
}

/// Sets how `request`'s calls go.
fn set_use(link: &Link, request: &Request, used: Use) {
    link.channels.lock().set_use(|r| r == request, used);
}

/// One round through the channel; returns its outcome and the seat, unless the
/// seat can no longer be trusted (an arrival the agent may still hold).
async fn arrive_and_wait(
    link: &Arc<Link>,
    seat: Seat,
    id: u64,
    wait: Duration,
    waiting: Waiting,
) -> (Result<(), Error>, Then) {
    let arrival = arrive(link, seat, id, wait);
    let (waited, deadline) = match waiting {
        Waiting::Thread => wait_thread(link, &arrival),
        Waiting::Task => wait_task(link, &arrival).await,
    };
    match settle(link, arrival, waited, deadline) {
        Settled::Done(outcome, seat) => (outcome, seat),
        Settled::Reply(pending) => pending.reply(link).await,
    }
}

/// A call that arrived in its slot and waits for the round's end.
struct Arrival {
    id: u64,
    seat: Seat,
    /// How long the call waits, from its arrival (the wait reads the clock for it:
    /// a released round reads it no more than that).
    wait: Duration,
    /// [`Link::stashes`] before the call's id went out.
    stashes: u64,
}

/// Arrives in the seat's slot for the next round as call `id` (its error, if any,
/// comes on the socket under that id).
fn arrive(link: &Link, mut seat: Seat, id: u64, wait: Duration) -> Arrival {
    // Read before the id is in the slot: no reply to it can have come yet.
    let stashes = link.stashes();
    seat.round = seat.round.wrapping_add(1).max(1);
    seat.channel.channel.arrive(seat.slot, seat.round, id);
    Arrival { id, seat, wait, stashes }
}

impl Arrival {
    /// The wait ends without the round's end: the connection ended, or the call's
    /// reply came on the socket.
    fn stopped(&self, link: &Link) -> bool {
        self.seat.channel.ended.load(Ordering::Acquire) || link.replied(self.id, self.stashes)
    }
}

/// Waits in this thread for the round's end (or the connection's, or the call's
/// answer on the socket); returns how, and the deadline it kept, if it read the clock.
fn wait_thread(link: &Link, arrival: &Arrival) -> (Waited, Option<Instant>) {
    let stop = || arrival.stopped(link);
    arrival.seat.channel.channel.wait_until(arrival.seat.slot, arrival.seat.round, Until::Within(arrival.wait), stop)
}

/// [`wait_thread`] a slice of `interrupt.every` at a time, asking `interrupt.check`
/// between slices; `None`: it said to give up.
fn wait_thread_interruptibly(
    link: &Link,
    arrival: &Arrival,
    interrupt: Interrupt<'_>,
) -> Option<(Waited, Option<Instant>)> {
    let (channel, slot, round) = (&arrival.seat.channel.channel, arrival.seat.slot, arrival.seat.round);
    let stop = || arrival.stopped(link);
    // `None`: too far out to represent, as good as none.
    let deadline = Instant::now().checked_add(arrival.wait);
    loop {
        let until = match (Instant::now().checked_add(interrupt.every), deadline) {
            (Some(slice), Some(deadline)) => Until::Deadline(slice.min(deadline)),
            (Some(at), None) | (None, Some(at)) => Until::Deadline(at),
            (None, None) => Until::Within(arrival.wait),
        };
        let (waited, _) = channel.wait_until(slot, round, until, stop);
        let going = matches!(waited, Waited::TimedOut) && deadline.is_none_or(|deadline| Instant::now() < deadline);
        if !going {
            return Some((waited, deadline));
        }
        if (interrupt.check)() {
            return None;
        }
    }
}

/// How a wait in the channel ended: with the call's outcome, or with the outcome
/// still to read on the socket.
enum Settled {
    Done(Result<(), Error>, Then),
    Reply(Pending),
}

/// A call whose outcome is its reply on the socket, with the seat to keep after it.
struct Pending {
    id: u64,
    /// The reply, if it came already.
    got: Option<Reply>,
    deadline: Instant,
    wait: Duration,
    kept: Then,
    /// The call's connection was cut during the wait: its reply comes on the resumed
    /// session (see `Link::adopt_channel_calls`).
    cut: bool,
}

impl Pending {
    async fn reply(self, link: &Link) -> (Result<(), Error>, Then) {
        let Pending { id, got, deadline, wait, kept, cut } = self;
        // Registered only now (a released round has no reply); the agent may have
        // sent it before, in which case it waits in the stash.
        let outcome = match got.map_or_else(|| link.claim(id, deadline, wait), Ok) {
            Ok(reply) => reply_to(link, id, reply, deadline, wait, cut).await,
            Err(error) => Err(error),
        };
        match outcome {
            // The session was not resumed: say where the call was when it was cut.
            Err(Error::Disconnected(why)) if cut => {
                let at = link.addr();
                (
                    Err(Error::Disconnected(format!(
                        "the connection to the node agent at {at} ended during a barrier; {why}"
                    ))),
                    kept,
                )
            }
            outcome => (outcome, kept),
        }
    }
}

/// `deadline`: the wait's, if it read the clock.
fn settle(link: &Link, arrival: Arrival, waited: Waited, deadline: Option<Instant>) -> Settled {
    let Arrival { id, seat, wait, .. } = arrival;
    // Needed from here on only if the round did not simply end released.
    let deadline = || deadline.unwrap_or_else(|| Instant::now() + wait);
    match waited {
        Waited::Ended(Outcome::Released) => Settled::Done(Ok(()), Then::Keep(seat)),
        // The error is on its way on the socket (or came), as the reply to the call's id.
        Waited::Ended(Outcome::Failed) => {
            Settled::Reply(Pending { id, got: None, deadline: deadline(), wait, kept: Then::Keep(seat), cut: false })
        }
        Waited::Stopped => {
            let ended = seat.channel.ended.load(Ordering::Acquire);
            let finished = seat.channel.channel.outcome(seat.slot, seat.round).is_some();
            // A seat of an ended connection is kept only to be replaced: the next
            // call asks for a channel on the next connection.
            let kept = if ended || finished { Then::Keep(seat) } else { Then::GiveBack(seat) };
            if !ended {
                return Settled::Reply(Pending { id, got: None, deadline: deadline(), wait, kept, cut: false });
            }
            // Every reply the connection brought was routed before it counted as
            // ended: one that is not stashed now never comes on it. A call the cut
            // connection's task adopted gets its reply on the resumed session.
            match link.take_stashed(id) {
                Some(result) => {
                    let got = Some(Reply::came(result));
                    Settled::Reply(Pending { id, got, deadline: deadline(), wait, kept, cut: false })
                }
                None if link.adopted(id) => {
                    Settled::Reply(Pending { id, got: None, deadline: deadline(), wait, kept, cut: true })
                }
                None => {
                    // The connection ended without answering: whether the barrier took
                    // effect is unknown, as for a request whose connection was cut.
                    let why = format!("the connection to the node agent at {} ended during a barrier", link.addr());
                    Settled::Done(Err(Error::Disconnected(why)), kept)
                }
            }
        }
        Waited::TimedOut => Settled::Done(Err(Error::Timeout(wait)), Then::GiveBack(seat)),
    }
}

/// [`RankChannel::wait`] for an async task: a spin while it pays, then woken by
/// the channel's release bell through the connection's runtime (or by the watcher
/// thread); stops when the call's reply or the connection's end comes first.
/// Returns as [`wait_thread`].
async fn wait_task(link: &Link, arrival: &Arrival) -> (Waited, Option<Instant>) {
    let (mapped, slot, round) = (&arrival.seat.channel, arrival.seat.slot, arrival.seat.round);
    if let Some(outcome) = mapped.channel.spin(slot, round) {
        return (Waited::Ended(outcome), None);
    }
    // Counted from the end of the spin: it lasts microseconds, and a round released
    // during it reads no clock for a deadline.
    let deadline = Instant::now() + arrival.wait;
    let waited = wait_task_until(link, arrival, deadline).await;
    (waited, Some(deadline))
}

/// [`wait_task`] past its spin, until `deadline`.
async fn wait_task_until(link: &Link, arrival: &Arrival, deadline: Instant) -> Waited {
    let (mapped, slot, round) = (&arrival.seat.channel, arrival.seat.slot, arrival.seat.round);
    let watched = &mapped.watched;
    let deadline = tokio::time::Instant::from_std(deadline);
    let ear = link.channels.runtime.as_ref().map(|runtime| watched.listen(runtime));
    // Counted before its last look at the slot: every release from then on rings.
    let _asleep = ear.as_ref().filter(|ear| ear.hears()).map(|_| mapped.channel.sleep_on_bell());
    let sleep = tokio::time::sleep_until(deadline);
    tokio::pin!(sleep);
    loop {
        let moved = watched.moved.notified();
        tokio::pin!(moved);
        // Registered before looking, so that a release (or a reply: see
        // [`Channels::wake_async_waiters`]) after the look wakes it.
        moved.as_mut().enable();
        if !ear.as_ref().is_some_and(|ear| ear.hears()) {
            watched.watch();
        }
        if let Some(outcome) = mapped.channel.outcome(slot, round) {
            return Waited::Ended(outcome);
        }
        if arrival.stopped(link) {
            return Waited::Stopped;
        }
        tokio::select! {
            () = moved => {}
            () = &mut sleep => return Waited::TimedOut,
        }
    }
}

/// The reply to call `id` on the socket; `cut`: its connection was cut during the
/// wait (the reply is to come on the resumed session), else its round has ended.
async fn reply_to(
    link: &Link,
    id: u64,
    reply: Reply,
    deadline: Instant,
    wait: Duration,
    cut: bool,
) -> Result<(), Error> {
    let left = deadline.saturating_duration_since(Instant::now());
    // A round that ended: the error follows its slot's mark at once, and the deadline
    // only bounds a wait for an agent that broke the protocol. A cut call waits for
    // the round as any call does: until its deadline.
    let left = if cut { left } else { left + Duration::from_secs(5) };
    let limit = if cut { wait } else { left };
    let received = match tokio::time::timeout(left, reply).await {
        Ok(received) => received,
        Err(_) => {
            link.unregister(id);
            return Err(Error::Timeout(limit));
        }
    };
    match received {
        Ok(Ok(Response::Done)) => Ok(()),
        Ok(Ok(other)) => Err(Error::Protocol(format!("unexpected reply to barrier: {other:?}"))),
        Ok(Err(error)) => Err(error),
        Err(_) => Err(link.disconnected()),
    }
}

#[cfg(test)]
mod tests;
