//! The state every connection task and the ticker share: the engine, where each
//! session's replies go, and the server's clock.
//!
//! A session's replies go to its connection's [`Outbox`] (a task, or a TCPStore
//! connection of the reactor, is woken to take them), to its node agent's, or, for
//! a native connection the reactor serves, into one list of [`Routed`] replies that
//! the reactor takes whole: when a barrier releases thousands of ranks, that is a
//! push per rank under the lock already held, and one wake-up of the reactor (none
//! if the reactor made the request), instead of a queue, a lock and a wake-up per
//! rank.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Poll, Waker};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use atomic_waker::AtomicWaker;
use rallypoint_core::snapshot::JobSnapshot;
use rallypoint_core::{
    AbortInfo, Config, Departure, Engine, Identity, JobMetrics, Millis, OpError, RankInfo, Reply, Request, Response,
    SessionId, SessionTable, Welcome,
};
use rallypoint_net::meter::Traffic;
use rallypoint_net::sync::lock;
use tracing::debug;

use crate::agent_link::{AgentOutbox, AgentReplies};
use crate::ticker::Alarm;

/// The job of TCPStore connections unless the server is told otherwise.
pub(crate) const DEFAULT_TCPSTORE_JOB: &str = "default";

pub(crate) struct Shared {
    state: Mutex<State>,
    /// Time zero of the engine's clock.
    start: Instant,
    ids: SessionIds,
    /// When the ticker plans to wake next (engine ms; `u64::MAX` = no deadline).
    /// Written only under the state lock.
    ticker_plan: AtomicU64,
    /// Wakes the ticker when a deadline earlier than its plan appears.
    ticker_alarm: Alarm,
    /// The job TCPStore connections join.
    tcpstore_job: Mutex<String>,
    /// Bytes and connections, counted by each connection's stream.
    traffic: Arc<Traffic>,
    /// This machine's name: a session stating it ran here, and its process can be
    /// looked up to tell a death from a cut connection.
    host: String,
    /// Wakes the reactor when replies were routed to it by another thread.
    reactor: OnceLock<Waker>,
}

struct State {
    engine: Engine,
    /// Looked up for every request and reply, by slot (see [`SessionIds`]).
    outboxes: SessionTable<Sink>,
    /// The connected node agents, by the number the engine's records name them with.
    agents: HashMap<u64, Arc<AgentOutbox>>,
    /// Replies for the reactor's native connections, in the engine's order.
    routed: Vec<Routed>,
    /// The reactor was woken for `routed` and has not taken them yet.
    reactor_woken: bool,
}

/// A native connection served by the reactor: its slot there, and a number no
/// other connection of the reactor has had, so that a reply routed to a connection
/// that closed meanwhile never reaches the one that took its slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Route {
    pub(crate) key: usize,
    pub(crate) conn: u64,
}

/// A reply for a session the reactor serves.
pub(crate) struct Routed {
    pub(crate) route: Route,
    pub(crate) request_id: u64,
    pub(crate) reply: RoutedReply,
}

/// A routed reply, in a word: a release routes one per waiting rank, through a list
/// written once and read once per round, which a large barrier makes megabytes long
/// at a full reply's size, each of its lines a cache miss. Nearly all are `Done`;
/// the others are boxed.
pub(crate) enum RoutedReply {
    Done,
    Other(Box<Reply>),
}

impl From<Reply> for RoutedReply {
    fn from(reply: Reply) -> RoutedReply {
        match reply {
            Ok(Response::Done) => RoutedReply::Done,
            other => RoutedReply::Other(Box::new(other)),
        }
    }
}

impl From<RoutedReply> for Reply {
    fn from(reply: RoutedReply) -> Reply {
        match reply {
            RoutedReply::Done => Ok(Response::Done),
            RoutedReply::Other(reply) => *reply,
        }
    }
}

/// Session ids as [`SessionTable`]s want them: slots freed are given again, each
/// time under the next serial of that slot, so that no id is given twice. A slot is
/// free again once the session it was last given to left `State::outboxes` (a
/// session resumed after its slot went to another gives back nothing). Freed slots
/// are given oldest first, which spreads reuse over them: serials stay small.
#[derive(Debug, Default)]
struct SessionIds(Mutex<Ids>);

#[derive(Debug, Default)]
struct Ids {
    free: VecDeque<u32>,
    /// Each slot given so far: the serial it was last given with, and whether it is
    /// free (in `free`).
    slots: Vec<(u32, bool)>,
}

impl SessionIds {
    fn take(&self) -> SessionId {
        let mut ids = lock(&self.0);
        let slot = match ids.free.pop_front() {
            Some(slot) => slot,
            None => {
                ids.slots.push((0, false));
                u32::try_from(ids.slots.len() - 1).unwrap_or(u32::MAX)
            }
        };
        let serial = match ids.slots.get_mut(slot as usize) {
            Some((serial, free)) => {
                // Serial 0 is never given (no id is 0); past u32::MAX reuses of one
                // slot, ids could repeat, after years of connections a second.
                *serial = serial.checked_add(1).unwrap_or(1);
                *free = false;
                *serial
            }
            None => 1,
        };
        SessionId::at(slot, serial)
    }

    /// `session` is done with its slot: free if it was the slot's last given.
    fn give_back(&self, session: SessionId) {
        let Ok(slot) = u32::try_from(session.slot()) else { return };
        let mut ids = lock(&self.0);
        if let Some((last, free @ false)) = ids.slots.get_mut(slot as usize) {
            if *last == session.serial() {
                *free = true;
                ids.free.push_back(slot);
            }
        }
    }
}

/// Where a session's replies go: its own connection, or the node agent carrying it.
/// A session resumed on another connection changes sink; the connection it left
/// then speaks for it no more (its close and requests are ignored).
enum Sink {
    Direct(Arc<Outbox>),
    /// A native connection of the reactor. Its outbox stays its identity, and says
    /// when the session moved on (see [`Outbox::superseded`]); its replies are routed.
    Reactor(Arc<Outbox>, Route),
    /// A rank behind a node agent, as the agent's sub-session `sub`: its replies are
    /// queued under that number, so that the agent's connection need not look it up.
    Agent(Arc<AgentOutbox>, u64),
}

/// Sends `session`'s replies to `sink` from now on, and tells the engine whether a
/// node agent carries it (the job's snapshot and metrics count those); returns
/// where they went before.
fn route_to(state: &mut State, session: SessionId, sink: Sink) -> Option<Sink> {
    state.engine.set_via_agent(session, matches!(sink, Sink::Agent(..)));
    state.outboxes.insert(session, sink)
}

impl Sink {
    /// Whether this is the connection whose outbox is `outbox`.
    fn is_direct(&self, outbox: &Arc<Outbox>) -> bool {
        matches!(self, Sink::Direct(mine) | Sink::Reactor(mine, _) if Arc::ptr_eq(mine, outbox))
    }

    fn is_agent(&self, outbox: &Arc<AgentOutbox>) -> bool {
        matches!(self, Sink::Agent(mine, _) if Arc::ptr_eq(mine, outbox))
    }
}

/// One thing a node agent's connection tells the engine (see [`Shared::agent_batch`]).
pub(crate) enum AgentInput {
    /// A rank behind the agent said hello as sub-session `sub`; `session` comes from
    /// [`Shared::new_session_id`].
    Open {
        session: SessionId,
        sub: u64,
        identity: Identity,
    },
    Request {
        session: SessionId,
        id: u64,
        request: Request,
    },
    /// Ranks behind the agent making one identical call, `(session, request id)` each
    /// in order (a SubRequests frame), and the sub-session of each.
    Calls {
        calls: Vec<(SessionId, u64)>,
        routes: Vec<u64>,
        request: Request,
    },
    Close {
        session: SessionId,
        departure: Departure,
    },
}

/// Replies waiting to be written to one connection. The connection task swaps the
/// queue out and encodes outside of any lock, so a large reply (an all-gather to
/// many ranks) never holds up the engine.
#[derive(Default)]
pub(crate) struct Outbox {
    queue: Mutex<VecDeque<(u64, Reply)>>,
    /// Whether `queue` may hold replies: lets `take` skip the lock after each request
    /// when, as usual, every reply went back directly.
    queued: AtomicBool,
    pub(crate) ready: Ready,
    /// Its session was resumed on another connection: this one is to close.
    superseded: AtomicBool,
}

impl Outbox {
    /// Whether the session moved to another connection (see [`Shared::open`]).
    pub(crate) fn superseded(&self) -> bool {
        self.superseded.load(Ordering::Acquire)
    }

    fn supersede(&self) {
        self.superseded.store(true, Ordering::Release);
        self.ready.notify();
    }

    fn push(&self, request_id: u64, reply: Reply) {
        let mut queue = lock(&self.queue);
        // Room for the one reply a round usually brings, not the four a deque starts
        // with: every waiting connection holds this until its task takes it.
        if queue.capacity() == 0 {
            queue.reserve_exact(1);
        }
        queue.push_back((request_id, reply));
        self.queued.store(true, Ordering::Release);
        drop(queue);
        self.ready.notify();
    }

    /// Takes every queued reply, leaving the queue without an allocation.
    pub(crate) fn take(&self) -> VecDeque<(u64, Reply)> {
        if !self.queued.load(Ordering::Acquire) {
            return VecDeque::new();
        }
        let mut queue = lock(&self.queue);
        self.queued.store(false, Ordering::Relaxed);
        std::mem::take(&mut *queue)
    }
}

/// Tells whoever serves a connection (its task, or the TCPStore reactor) that
/// something was queued for it. A flag and an atomic waker rather than `Notify`:
/// with a single waiter, arming the wait costs an atomic operation instead of a
/// lock on `Notify`'s wait list, on every request a connection reads.
#[derive(Default)]
pub(crate) struct Ready {
    pending: AtomicBool,
    waker: AtomicWaker,
}

impl Ready {
    /// Wakes the task, or lets its next wait return at once (as `Notify::notify_one`).
    pub(crate) fn notify(&self) {
        self.pending.store(true, Ordering::Release);
        self.waker.wake();
    }

    /// Completes once `notify` was called since the last wait completed.
    /// Not an `async fn`, for the reason `rallypoint_net::conn::stall` gives.
    pub(crate) fn wait(&self) -> impl Future<Output = ()> + Send + '_ {
        std::future::poll_fn(|cx| if self.poll_wait(cx.waker()) { Poll::Ready(()) } else { Poll::Pending })
    }

    /// `wait` without a future: true if `notify` was called since the last wait
    /// completed; otherwise `waker` is woken by the next `notify`.
    pub(crate) fn poll_wait(&self, waker: &Waker) -> bool {
        if self.pending.swap(false, Ordering::Acquire) {
            return true;
        }
        self.waker.register(waker);
        // A notify between the check and the registration must not be lost.
        self.pending.swap(false, Ordering::Acquire)
    }
}

impl Shared {
    pub(crate) fn new(mut config: Config) -> Self {
        let start = Instant::now();
        // The engine's time 0 as wall-clock time, for the times its errors show.
        let since_epoch = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        config.epoch_unix_ms = u64::try_from(since_epoch.as_millis()).unwrap_or(0);
        Shared {
            state: Mutex::new(State {
                engine: Engine::new(config),
                outboxes: SessionTable::default(),
                agents: HashMap::new(),
                routed: Vec::new(),
                reactor_woken: false,
            }),
            start,
            ids: SessionIds::default(),
            ticker_plan: AtomicU64::new(u64::MAX),
            ticker_alarm: Alarm::default(),
            tcpstore_job: Mutex::new(DEFAULT_TCPSTORE_JOB.to_owned()),
            traffic: Traffic::new(),
            host: rallypoint_net::hostname(),
            reactor: OnceLock::new(),
        }
    }

    /// How the reactor is woken when another thread routed replies to it (set once,
    /// when it starts).
    pub(crate) fn set_reactor_waker(&self, waker: Waker) {
        let _ = self.reactor.set(waker);
    }

    /// From now on, the replies of the session on `outbox`'s connection are routed to
    /// the reactor at `route`; false if the session is no longer that connection's
    /// (resumed elsewhere, or closed). Replies queued in the outbox before stay there.
    pub(crate) fn move_to_reactor(&self, session: SessionId, outbox: &Arc<Outbox>, route: Route) -> bool {
        let mut state = lock(&self.state);
        match state.outboxes.get_mut(&session) {
            Some(sink @ Sink::Direct(_)) if sink.is_direct(outbox) => {
                *sink = Sink::Reactor(Arc::clone(outbox), route);
                true
            }
            _ => false,
        }
    }

    /// Takes every reply routed to the reactor (called by the reactor when woken).
    pub(crate) fn take_routed(&self, into: &mut Vec<Routed>) {
        let mut state = lock(&self.state);
        state.reactor_woken = false;
        take_all(into, &mut state.routed);
    }

    /// Whether the process that stated `identity` runs on this machine, so that its
    /// death can be seen here (module `native`).
    pub(crate) fn is_local(&self, identity: &Identity) -> bool {
        identity.pid != 0 && identity.host == self.host
    }

    /// The reconnect grace in effect (engine ms).
    pub(crate) fn grace_ms(&self) -> Millis {
        lock(&self.state).engine.config().grace_ms()
    }

    /// Read only while holding the state lock, so that the engine never sees time go back.
    fn now(&self) -> Millis {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    pub(crate) fn start(&self) -> Instant {
        self.start
    }

    /// Admits a session; on success its replies go to `outbox` until [`Shared::close`].
    /// A hello with a resume token resumes that session if the engine allows it (the
    /// welcome then names it): its replies come here from now on, and the connection
    /// that had it is told to close.
    pub(crate) fn open(&self, identity: Identity, outbox: Arc<Outbox>) -> Result<Welcome, OpError> {
        let mut state = lock(&self.state);
        let now = self.now();
        let welcome = match self.resume(&mut state, &identity, Sink::Direct(Arc::clone(&outbox)), now) {
            Some(welcome) => welcome,
            None => {
                let session = self.new_session_id();
                let welcome = state.engine.open(session, identity, now).inspect_err(|_| self.ids.give_back(session))?;
                route_to(&mut state, session, Sink::Direct(outbox));
                welcome
            }
        };
        self.after_input(&mut state);
        Ok(welcome)
    }

    /// Resumes the session `identity` names, moving it to `sink`; `None` if there is
    /// no token or the engine refuses (the hello then opens a new session).
    fn resume(&self, state: &mut State, identity: &Identity, sink: Sink, now: Millis) -> Option<Welcome> {
        let token = identity.resume?;
        match state.engine.resume(token, identity, now) {
            Ok(welcome) => {
                match route_to(state, token, sink) {
                    Some(Sink::Direct(left) | Sink::Reactor(left, _)) => left.supersede(),
                    Some(Sink::Agent(left, _)) => left.lose(),
                    None => {}
                }
                debug!(session = %token, job = %identity.job, rank = ?identity.rank, "session resumed");
                Some(welcome)
            }
            Err(why) => {
                debug!(session = %token, job = %identity.job, rank = ?identity.rank, %why, "not resumed; a new session");
                None
            }
        }
    }

    /// A node agent connected: releases of records of its calls go to `outbox`.
    pub(crate) fn agent_linked(&self, outbox: &Arc<AgentOutbox>) {
        lock(&self.state).agents.insert(outbox.id, Arc::clone(outbox));
    }

    /// A node agent's connection ended.
    pub(crate) fn agent_unlinked(&self, outbox: &AgentOutbox) {
        lock(&self.state).agents.remove(&outbox.id);
    }

    /// A fresh session id, for a rank behind a node agent.
    pub(crate) fn new_session_id(&self) -> SessionId {
        self.ids.take()
    }

    /// Gives back an id taken but never used.
    pub(crate) fn unused_session_id(&self, session: SessionId) {
        self.ids.give_back(session);
    }

    /// A snapshot of job `job` (see [`crate::Observer::snapshot`]).
    pub(crate) fn snapshot(&self, job: &str) -> Option<JobSnapshot> {
        lock(&self.state).engine.snapshot(job, self.now())
    }

    /// The jobs the engine holds, and whether that is all of them.
    pub(crate) fn jobs(&self) -> (Vec<String>, bool) {
        lock(&self.state).engine.job_list()
    }

    /// Every job's counts, with the sessions node agents carry.
    pub(crate) fn job_metrics(&self) -> Vec<JobMetrics> {
        lock(&self.state).engine.metrics(self.now())
    }

    /// The job TCPStore connections join now.
    pub(crate) fn tcpstore_job(&self) -> String {
        lock(&self.tcpstore_job).clone()
    }

    /// See [`super::ServerHandle::lost_ranks`].
    pub(crate) fn lost_ranks(&self, job: &str) -> Vec<RankInfo> {
        let state = lock(&self.state);
        let now = self.now();
        state.engine.lost_ranks(job, now)
    }

    /// See [`super::ServerHandle::finished_ranks`].
    pub(crate) fn finished_ranks(&self, job: &str) -> Vec<RankInfo> {
        let state = lock(&self.state);
        let now = self.now();
        state.engine.finished_ranks(job, now)
    }

    /// See [`super::ServerHandle::failed_for`].
    pub(crate) fn failed_for(&self, job: &str) -> Vec<u32> {
        lock(&self.state).engine.failed_for(job)
    }

    /// See [`super::ServerHandle::aborted`].
    pub(crate) fn aborted(&self, job: &str) -> Option<(AbortInfo, u64)> {
        lock(&self.state).engine.aborted(job)
    }

    /// See [`super::ServerHandle::quiet_for`].
    pub(crate) fn quiet_ms(&self, job: &str) -> Option<u64> {
        let state = lock(&self.state);
        let now = self.now();
        state.engine.quiet_ms(job, now)
    }

    pub(crate) fn lease_ms(&self) -> Millis {
        lock(&self.state).engine.config().lease_ms
    }

    /// Feeds what a node agent sent, in order, under a single lock; the replies of
    /// its sessions go to `outbox`. Returns whether each `Open` was admitted.
    pub(crate) fn agent_batch(
        &self,
        inputs: Vec<AgentInput>,
        outbox: &Arc<AgentOutbox>,
    ) -> Vec<(SessionId, Result<Welcome, OpError>)> {
        let mut opened = Vec::new();
        let mut state = lock(&self.state);
        let now = self.now();
        // Sub-sessions that resumed a session in this batch: their later inputs are the resumed one's.
        let mut resumed: Vec<(SessionId, SessionId)> = Vec::new();
        // Looked up only once a session this agent carried went elsewhere (see `AgentOutbox::left`).
        let carried = |state: &State, session: SessionId| {
            !outbox.lost_any() || state.outboxes.get(&session).is_some_and(|s| s.is_agent(outbox))
        };
        for input in inputs {
            match input {
                AgentInput::Open { session, sub, identity } => {
                    let sink = Sink::Agent(Arc::clone(outbox), sub);
                    let welcome = match self.resume(&mut state, &identity, sink, now) {
                        Some(welcome) => {
                            resumed.push((session, welcome.session));
                            Ok(welcome)
                        }
                        None => state.engine.open(session, identity, now),
                    };
                    match &welcome {
                        Ok(welcome) if welcome.session == session => {
                            route_to(&mut state, session, Sink::Agent(Arc::clone(outbox), sub));
                        }
                        _ => self.ids.give_back(session),
                    }
                    opened.push((session, welcome));
                }
                AgentInput::Request { session, id, request } => {
                    // The sub-session a session was resumed from in this batch speaks
                    // for it no more (docs/PROTOCOL.md, section 12).
                    if resumed.iter().any(|(_, target)| *target == session) {
                        continue;
                    }
                    let session = resumed.iter().find(|(sub, _)| *sub == session).map_or(session, |(_, s)| *s);
                    // A session resumed elsewhere is no longer this agent's to speak for.
                    if carried(&state, session) {
                        state.engine.handle(session, id, request, now);
                    }
                }
                AgentInput::Calls { mut calls, mut routes, request } => {
                    if !resumed.is_empty() {
                        // As for a request: the calls of the sub-session left go, and
                        // those of the one resuming are the session's.
                        retain_calls(&mut calls, &mut routes, |session| resumed.iter().all(|(_, t)| *t != session));
                        for (session, _) in &mut calls {
                            *session = resumed.iter().find(|(sub, _)| sub == session).map_or(*session, |(_, s)| *s);
                        }
                    }
                    if outbox.lost_any() {
                        retain_calls(&mut calls, &mut routes, |session| carried(&state, session));
                    }
                    state.engine.handle_calls_from(outbox.link(), &calls, &routes, &request, now);
                }
                AgentInput::Close { session, departure } => {
                    // The close of the sub-session a session was resumed from, in the same batch: stale.
                    if resumed.iter().any(|(_, target)| *target == session) {
                        continue;
                    }
                    let session = resumed.iter().find(|(sub, _)| *sub == session).map_or(session, |(_, s)| *s);
                    if carried(&state, session) {
                        self.drop_sink(&mut state, session);
                        state.engine.close_with(session, departure, now);
                    }
                }
            }
        }
        self.after_input(&mut state);
        opened
    }

    /// The peers of `sessions` are taking in a long write: their ranks' leases count
    /// that as a sign of life (see `Engine::alive`).
    pub(crate) fn alive(&self, sessions: impl Iterator<Item = SessionId>) {
        let mut state = lock(&self.state);
        let now = self.now();
        for session in sessions {
            state.engine.alive(session, now);
        }
        self.after_input(&mut state);
    }

    /// Closes many sessions at once (a node agent's connection ended): those still
    /// carried by `outbox` (not resumed elsewhere meanwhile). Their ranks cannot come
    /// back but through that agent, so they are lost at once, as before resumes existed.
    pub(crate) fn close_all(&self, sessions: &[SessionId], outbox: &Arc<AgentOutbox>) {
        let mut state = lock(&self.state);
        let now = self.now();
        for &session in sessions {
            if state.outboxes.get(&session).is_some_and(|s| s.is_agent(outbox)) {
                self.drop_sink(&mut state, session);
                state.engine.close_with(session, Departure::Unreachable, now);
            }
        }
        self.after_input(&mut state);
    }

    pub(crate) fn set_tcpstore_job(&self, job: &str) {
        job.clone_into(&mut lock(&self.tcpstore_job));
    }

    /// Admits a PyTorch TCPStore connection into the TCPStore job, which it returns.
    pub(crate) fn open_tcpstore(
        &self,
        host: &str,
        pid: u32,
        outbox: Arc<Outbox>,
    ) -> Result<(Welcome, String), OpError> {
        let job = lock(&self.tcpstore_job).clone();
        let session = self.new_session_id();
        let mut state = lock(&self.state);
        let now = self.now();
        let welcome =
            state.engine.open_tcpstore(session, &job, host, pid, now).inspect_err(|_| self.ids.give_back(session))?;
        route_to(&mut state, session, Sink::Direct(outbox));
        self.after_input(&mut state);
        Ok((welcome, job))
    }

    /// What the server's connections moved.
    pub(crate) fn traffic(&self) -> &Arc<Traffic> {
        &self.traffic
    }

    /// Feeds a batch of requests of one session under a single lock. Replies to
    /// that session's own requests that are ready at once go to `immediate` (the
    /// caller writes them without a wake-up through its outbox); later replies, and
    /// replies to other sessions, go to outboxes.
    ///
    /// Nothing if the session was resumed on another connection than `outbox`'s.
    pub(crate) fn handle(
        &self,
        session: SessionId,
        outbox: &Arc<Outbox>,
        requests: impl Iterator<Item = (u64, Request)>,
        immediate: Immediate<'_>,
    ) {
        self.handle_routed(session, outbox, requests, immediate, None);
    }

    /// [`Shared::handle`] for the reactor: the replies routed to its connections
    /// meanwhile (the ranks a barrier released) are taken into `routed` at once,
    /// without a wake-up.
    pub(crate) fn handle_routed(
        &self,
        session: SessionId,
        outbox: &Arc<Outbox>,
        requests: impl Iterator<Item = (u64, Request)>,
        immediate: Immediate<'_>,
        routed: Option<&mut Vec<Routed>>,
    ) {
        let mut state = lock(&self.state);
        if !state.outboxes.get(&session).is_some_and(|s| s.is_direct(outbox)) {
            return;
        }
        let now = self.now();
        for (id, request) in requests {
            state.engine.handle(session, id, request, now);
        }
        dispatch(&mut state, Some((session, immediate)));
        match routed {
            Some(routed) => take_all(routed, &mut state.routed),
            None => self.wake_reactor(&mut state),
        }
        self.plan_ticker(&state);
    }

    /// The session's connection (whose replies went to `outbox`) is gone; the engine
    /// decides whether that is a clean leave, a wait for a resume or a loss. Nothing
    /// if the session was resumed on another connection meanwhile.
    /// Returns whether the session was closed (it was still this connection's).
    pub(crate) fn close(&self, session: SessionId, outbox: &Arc<Outbox>, departure: Departure) -> bool {
        let mut state = lock(&self.state);
        if !state.outboxes.get(&session).is_some_and(|s| s.is_direct(outbox)) {
            return false;
        }
        let now = self.now();
        self.drop_sink(&mut state, session);
        state.engine.close_with(session, departure, now);
        self.after_input(&mut state);
        true
    }

    /// The process of a session waiting for a resume is gone: it is lost now.
    pub(crate) fn process_gone(&self, session: SessionId) {
        let mut state = lock(&self.state);
        let now = self.now();
        state.engine.process_gone(session, now);
        self.after_input(&mut state);
    }

    /// Forgets the session's outbox without telling the engine: used when the engine
    /// itself panicked, so calling it again could only panic again.
    pub(crate) fn forget(&self, session: SessionId) {
        if lock(&self.state).outboxes.remove(&session).is_some() {
            self.ids.give_back(session);
        }
    }

    /// Removes the session's sink (nothing carries it until it resumes); its slot is
    /// free again if it was given to it last.
    fn drop_sink(&self, state: &mut State, session: SessionId) {
        if state.outboxes.remove(&session).is_some() {
            state.engine.set_via_agent(session, false);
            self.ids.give_back(session);
        }
    }

    /// Fires what is due and returns the next deadline (engine ms).
    pub(crate) fn tick(&self) -> Option<Millis> {
        let mut state = lock(&self.state);
        let now = self.now();
        state.engine.tick(now);
        dispatch(&mut state, None);
        self.wake_reactor(&mut state);
        let next = state.engine.next_deadline();
        self.ticker_plan.store(next.unwrap_or(u64::MAX), Ordering::Relaxed);
        next
    }

    pub(crate) fn ticker_alarm(&self) -> &Alarm {
        &self.ticker_alarm
    }

    /// Routes the engine's replies and wakes the ticker if the engine now has a
    /// deadline earlier than the one the ticker sleeps towards.
    fn after_input(&self, state: &mut State) {
        dispatch(state, None);
        self.wake_reactor(state);
        self.plan_ticker(state);
    }

    /// Wakes the reactor if replies wait for it and it was not woken for them yet.
    fn wake_reactor(&self, state: &mut State) {
        if state.routed.is_empty() || state.reactor_woken {
            return;
        }
        if let Some(waker) = self.reactor.get() {
            state.reactor_woken = true;
            waker.wake_by_ref();
        }
    }

    fn plan_ticker(&self, state: &State) {
        if let Some(next) = state.engine.next_deadline() {
            if next < self.ticker_plan.load(Ordering::Relaxed) {
                self.ticker_plan.store(next, Ordering::Relaxed);
                self.ticker_alarm.poke();
            }
        }
    }
}

/// Moves every reply routed from `from` to `into`. A release routes a reply per rank,
/// and `into` is usually empty: the vectors then trade places instead of the
/// replies being copied.
fn take_all(into: &mut Vec<Routed>, from: &mut Vec<Routed>) {
    if into.is_empty() {
        std::mem::swap(into, from);
    } else {
        into.append(from);
    }
}

/// Where the replies to the session that made a request go at once: (request id, reply).
type Immediate<'a> = &'a mut dyn FnMut(u64, Reply);

/// Routes the engine's output: replies for `caller`'s session to its callback, the
/// rest into outboxes.
fn dispatch(state: &mut State, mut caller: Option<(SessionId, Immediate<'_>)>) {
    let State { engine, outboxes, routed, agents: links, .. } = state;
    // Replies for ranks behind agents, gathered per agent and queued with one lock
    // each; agents are woken once every reply of this input is queued (see
    // `AgentOutbox::push`).
    let mut agents: Vec<(Arc<AgentOutbox>, AgentReplies)> = Vec::new();
    for notice in engine.drain_notices() {
        tracing::warn!("{notice}");
    }
    let mut outgoing = engine.drain_outgoing();
    while let Some(out) = outgoing.next() {
        if let Some((session, immediate)) = caller.as_mut() {
            if out.session == *session {
                immediate(out.request_id, out.reply);
                continue;
            }
        }
        // A reply for a session that closed meanwhile has nowhere to go.
        match outboxes.get(&out.session) {
            Some(Sink::Direct(outbox)) => outbox.push(out.request_id, out.reply),
            Some(Sink::Reactor(_, route)) => {
                routed.push(Routed { route: *route, request_id: out.request_id, reply: out.reply.into() });
            }
            Some(Sink::Agent(outbox, sub)) => {
                let room = outgoing.len() + 1;
                replies_for(&mut agents, outbox, room).push(*sub, out.request_id, out.reply);
            }
            None => {}
        }
    }
    drop(outgoing);
    // After the replies to single calls: one of those may answer a call of a record
    // (its session failed alone), which the agent must see before the record's `Done`.
    let records = engine.take_records();
    if !records.is_empty() {
        release_records(records, links, outboxes, routed, &mut agents);
    }
    for (agent, replies) in agents {
        if agent.push_all(replies) {
            agent.notify();
        }
    }
}

/// Queues the `Done` of each released record (see [`Engine::take_records`]) for its
/// agent, with the replies `agents` gathered for it. Apart from [`dispatch`], which
/// runs after every input, where records are few.
#[inline(never)]
fn release_records(
    records: Vec<Arc<rallypoint_core::Record>>,
    links: &HashMap<u64, Arc<AgentOutbox>>,
    outboxes: &SessionTable<Sink>,
    routed: &mut Vec<Routed>,
    agents: &mut Vec<(Arc<AgentOutbox>, AgentReplies)>,
) {
    for record in records {
        match links.get(&record.link.id) {
            Some(outbox) if outbox.routes_hold(record.link) => {
                replies_for(agents, outbox, record.calls.len()).push_released(&record.calls);
            }
            // A session moved off the agent since the calls came, or the agent is
            // gone (and the sessions it carried with it).
            _ => reroute(&record, outboxes, routed, agents),
        }
    }
}

/// `Done` to each call of `record` where its session is now.
fn reroute(
    record: &rallypoint_core::Record,
    outboxes: &SessionTable<Sink>,
    routed: &mut Vec<Routed>,
    agents: &mut Vec<(Arc<AgentOutbox>, AgentReplies)>,
) {
    for (&session, &(_, id)) in record.sessions.iter().zip(&record.calls) {
        match outboxes.get(&session) {
            Some(Sink::Direct(direct)) => direct.push(id, Ok(Response::Done)),
            Some(Sink::Reactor(_, route)) => {
                routed.push(Routed { route: *route, request_id: id, reply: RoutedReply::Done });
            }
            Some(Sink::Agent(agent, sub)) => replies_for(agents, agent, 1).push(*sub, id, Ok(Response::Done)),
            None => {}
        }
    }
}

/// Keeps the calls whose session `keep` takes, with their routes (`routes[i]` is
/// the route of `calls[i]`), in order.
fn retain_calls(calls: &mut Vec<(SessionId, u64)>, routes: &mut Vec<u64>, keep: impl Fn(SessionId) -> bool) {
    let mut kept = 0;
    for at in 0..calls.len().min(routes.len()) {
        if keep(calls[at].0) {
            calls.swap(kept, at);
            routes.swap(kept, at);
            kept += 1;
        }
    }
    calls.truncate(kept);
    routes.truncate(kept);
}

/// The replies gathered for `outbox` in this dispatch, with room for `room` if there
/// were none yet. A release's replies come in runs of one agent's ranks: the last
/// agent is looked at first.
fn replies_for<'a>(
    agents: &'a mut Vec<(Arc<AgentOutbox>, AgentReplies)>,
    outbox: &Arc<AgentOutbox>,
    room: usize,
) -> &'a mut AgentReplies {
    let at = match agents.iter().rposition(|(agent, _)| Arc::ptr_eq(agent, outbox)) {
        Some(at) => at,
        None => {
            agents.push((Arc::clone(outbox), AgentReplies::with_room(room)));
            agents.len() - 1
        }
    };
    &mut agents[at].1
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A release routes `Done`s in a word each, and every other reply through its
    /// box unchanged; an entry of the routed list fits half a cache line.
    #[test]
    fn routed_replies_are_small_and_come_back_as_they_went() {
        assert!(matches!(RoutedReply::from(Ok(Response::Done)), RoutedReply::Done));
        let replies: [Reply; 3] = [
            Ok(Response::Done),
            Ok(Response::Value(bytes::Bytes::from_static(b"v"))),
            Err(OpError::KeyTimeout { waited_ms: 5, missing: vec![bytes::Bytes::from_static(b"k")] }),
        ];
        for reply in replies {
            let back = Reply::from(RoutedReply::from(reply.clone()));
            assert_eq!(back, reply);
        }
        assert!(size_of::<Routed>() <= 32, "a routed reply takes {} bytes", size_of::<Routed>());
    }

    /// A slot given back is given again, under another id; slots in use are not.
    #[test]
    fn session_ids_reuse_slots_never_ids() {
        let ids = SessionIds::default();
        let (a, b) = (ids.take(), ids.take());
        assert_eq!((a, b), (SessionId::at(0, 1), SessionId::at(1, 1)));
        ids.give_back(a);
        let c = ids.take();
        assert_eq!(c, SessionId::at(0, 2), "a slot's second session has a new id");
        assert_eq!(ids.take().slot(), 2, "no slot in use is given");
        ids.give_back(b);
        ids.give_back(c);
        ids.give_back(c);
        ids.give_back(a);
        assert_eq!((ids.take(), ids.take()), (SessionId::at(1, 2), SessionId::at(0, 3)), "oldest freed first");
        assert_eq!(ids.take().slot(), 3, "given back twice, or by a session it was not last given to: once");
    }

    /// Rank `rank` of two, with an incarnation of its own (so it can resume).
    fn hello(rank: u32) -> Identity {
        Identity { incarnation: Some(7 + u64::from(rank)), ..Identity::ranked("j", rank, 2) }
    }

    /// The session `identity` opened (or resumed) on `outbox`'s connection.
    fn open(shared: &Shared, identity: Identity, outbox: &Arc<Outbox>) -> SessionId {
        match shared.open(identity, Arc::clone(outbox)) {
            Ok(welcome) => welcome.session,
            Err(error) => panic!("open: {error}"),
        }
    }

    /// A closed session's slot is free for the next one; a resumed session that
    /// lost its slot meanwhile is still routed, and frees no slot it does not hold.
    #[test]
    fn sinks_follow_sessions_through_reused_slots() {
        let shared = Shared::new(Config::default());
        let (first, other, again) = (Arc::default(), Arc::default(), Arc::default());
        let a = open(&shared, hello(0), &first);
        assert!(shared.close(a, &first, Departure::Unknown), "waits for a resume");
        let b = open(&shared, hello(1), &other);
        assert_eq!(b.slot(), a.slot(), "the closed session's slot is given again");
        let resumed = open(&shared, Identity { resume: Some(a), ..hello(0) }, &again);
        assert_eq!(resumed, a, "resumed under its old id, its slot taken");
        let state = lock(&shared.state);
        assert!(state.outboxes.get(&a).is_some_and(|s| s.is_direct(&again)));
        assert!(state.outboxes.get(&b).is_some_and(|s| s.is_direct(&other)));
        drop(state);
        assert!(shared.close(a, &again, Departure::Unknown));
        assert_eq!(shared.new_session_id().slot(), 1, "slot 0 is still b's");
    }

    /// A session resumed into its freed slot before another took it gives nothing
    /// back when it leaves again, once the slot went to the next session.
    #[test]
    fn a_resumed_session_never_frees_a_slot_twice() {
        let shared = Shared::new(Config::default());
        let (first, again, other) = (Arc::default(), Arc::default(), Arc::default());
        let a = open(&shared, hello(0), &first);
        assert!(shared.close(a, &first, Departure::Unknown), "slot 0 is free");
        assert_eq!(open(&shared, Identity { resume: Some(a), ..hello(0) }, &again), a, "back in slot 0");
        let b = open(&shared, hello(1), &other);
        assert_eq!(b.slot(), 0, "the free slot, though a sits in it");
        assert!(shared.close(a, &again, Departure::Unknown));
        assert_eq!(shared.new_session_id().slot(), 1, "a gave nothing back: slot 0 is b's");
        assert!(shared.close(b, &other, Departure::Unknown));
        assert_eq!(shared.new_session_id().slot(), 0);
    }
}
