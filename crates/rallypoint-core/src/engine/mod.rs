//! The engine: owns every job and routes sessions' requests, disconnects and clock
//! ticks to them.

mod by_rank;
mod collective;
mod incarnation;
mod job;
mod members;
mod ranks;
mod resume;
mod snapshot;
mod step;
mod store;
mod timers;
mod torch;
mod validate;

use std::collections::BTreeSet;

use crate::{
    AbortInfo, Config, Identity, JobIncarnation, Members, Millis, OpError, Outgoing, ProcessInfo, RankInfo, Reply,
    Request, Response, SessionId, Welcome,
};

pub use collective::{Link, Record};
pub use snapshot::JobMetrics;

use collective::{Ctx, Held, HeldCall, RunCall};
use job::Job;
use resume::{Detached, Kept, Resent, Resumable};
use step::{Caller, Keep, Step};
use timers::{Timer, Timers};

/// Jobs are numbered so that timers never point at a newer job of the same name.
pub(crate) type JobId = u64;

/// The engine's hash maps: foldhash, randomly seeded per process. SipHash showed in
/// per-request profiles; keys come from the job's own clients, and the random seed
/// keeps crafted collisions impractical.
pub(crate) type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// The open sessions (and those waiting for a resume), looked up at every request
/// and every reply kept. Boxed: a slot costs two words, which matters at tens of
/// thousands of idle sessions.
pub(crate) type Sessions = crate::SessionTable<Box<Session>>;

/// What a node agent's run of barrier calls reads of each of its sessions (see
/// [`Engine::gate_held`]), kept by slot beside the sessions: at every round of a
/// large job each session's box is cold, and a call that touches none costs a cache
/// miss less. Made at a session's first held call (sessions of direct connections
/// have none), and changed wherever the session changes what it copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hot {
    job: JobId,
    resumed_at: Option<Millis>,
    /// The highest request id of its calls held in records (`Keep::InRecord`), which
    /// its kept replies do not hold: on a resume, what the records still tell of them
    /// is kept, and a copy of an older one is not run again.
    record_high: u64,
    rank: Option<u32>,
    world_size: Option<u32>,
    torch: bool,
    resumable: bool,
    taken_over: bool,
}

impl Hot {
    fn of(session: &Session, record_high: u64) -> Hot {
        Hot {
            job: session.job,
            resumed_at: session.resumed_at,
            record_high,
            rank: session.identity.rank,
            world_size: session.identity.world_size,
            torch: session.torch,
            resumable: session.resume.is_some(),
            taken_over: session.taken_over.is_some(),
        }
    }
}

pub(crate) type Hots = crate::SessionTable<Hot>;

/// A session's call held in a record whose generation ended: its request id, and
/// how the generation ended (see [`Engine::keep_held_calls`]).
type EndedCall = (u64, Result<(), OpError>);

#[derive(Debug)]
pub(crate) struct Session {
    job: JobId,
    identity: Identity,
    /// Said `Leave`: its close is clean, not a loss.
    leaving: bool,
    /// Said `Abandon`: its close is a loss at once, without the reconnect grace.
    abandoned: bool,
    /// A PyTorch TCPStore connection: its rank, if any, was inferred (module `torch`).
    torch: bool,
    /// A node agent carries it now (the server says so: [`Engine::set_via_agent`]);
    /// counted in the job's snapshot and metrics.
    via_agent: bool,
    /// A session that stated an incarnation can resume after a cut (module `resume`).
    resume: Option<Box<Resumable>>,
    /// When it was last resumed: re-sent requests are recognised from then on, for as
    /// long as a kept reply may live. Here, not in `resume`: a request of a session
    /// never resumed need not read that.
    resumed_at: Option<Millis>,
    /// Its rank was taken over by another process: the session no longer carries it
    /// (its identity's rank is cleared) and everything it asks fails with this.
    taken_over: Option<Box<OpError>>,
}

impl Session {
    /// Its connection dropped and it waits for a resume.
    fn detached(&self) -> bool {
        self.resume.as_ref().is_some_and(|r| r.detached.is_some())
    }
}

/// How a session's connection ended, as far as the I/O layer can tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Departure {
    /// The connection is gone; the process may be alive (a cut connection) and may
    /// resume the session within the reconnect grace.
    Unknown,
    /// The process is known to be gone (it ran on the coordinator's host, or behind a
    /// node agent on its own host, and no longer exists): no grace.
    ProcessGone,
    /// The session cannot come back: the node agent that carried it lost its link to
    /// the coordinator, and its ranks cannot reach the coordinator but through it. No
    /// grace: waiting would only delay telling their peers.
    Unreachable,
}

/// The open TCPStore connections of one torch process, and its rank once known.
#[derive(Debug, Default)]
struct TorchProcess {
    rank: Option<u32>,
    sessions: BTreeSet<SessionId>,
}

/// The coordination state machine. See the crate documentation.
#[derive(Debug)]
pub struct Engine {
    config: Config,
    jobs: HashMap<JobId, Job>,
    job_ids: HashMap<String, JobId>,
    next_job: JobId,
    sessions: Sessions,
    /// What held runs read of their sessions (see [`Hot`]).
    hot: Hots,
    /// Of each session that resumed with calls held in records whose generation
    /// ended, those calls and how they ended (see [`Engine::keep_held_calls`]):
    /// copies of them are answered so. Apart from the sessions, which rarely have any.
    held_ended: HashMap<SessionId, Vec<EndedCall>>,
    /// Open torch sessions by process (job, host, pid ≠ 0): torch opens several
    /// connections per process, and a rank learned on one belongs to all of them.
    torch_processes: HashMap<(JobId, String, u32), TorchProcess>,
    timers: Timers,
    outgoing: Vec<Outgoing>,
    /// Warnings for the operator (stalled torch jobs), in the order produced.
    notices: Vec<String>,
    /// The time of the latest input: when replies leaving the engine are kept.
    now: Millis,
    /// State-changing requests of resumable sessions waiting for their reply (module
    /// `resume`): while there are none, replies leave without being looked at.
    tracked: usize,
    /// How many of `outgoing` have been kept in their sessions' replies (module
    /// `resume`): a kept barrier call is read from its generation only once all are.
    settled: usize,
    /// Where in `outgoing`, past `settled`, barriers' releases are (see `Ctx::released`).
    released: Vec<(usize, usize)>,
    /// Records of node agents' calls released (see [`Engine::take_records`]).
    records: Vec<std::sync::Arc<Record>>,
}

/// What a call of [`Engine::gate`] is part of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Run {
    /// A request on its own.
    Alone,
    /// A run of collective calls (see [`Engine::handle_calls`]).
    Calls,
    /// A node agent's run of barrier calls, held in records (see
    /// [`Engine::handle_calls_from`]).
    Held,
}

impl Engine {
    pub fn new(config: Config) -> Self {
        Engine {
            config,
            jobs: HashMap::default(),
            job_ids: HashMap::default(),
            next_job: 1,
            sessions: Sessions::default(),
            hot: Hots::default(),
            held_ended: HashMap::default(),
            torch_processes: HashMap::default(),
            timers: Timers::default(),
            outgoing: Vec::new(),
            notices: Vec::new(),
            now: 0,
            tracked: 0,
            settled: 0,
            released: Vec::new(),
            records: Vec::new(),
        }
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Admits a session with its identity. An invalid identity (rank ≥ world size,
    /// world size 0, names too long) is refused and leaves no trace; so is a claim of a
    /// rank another live process holds, a process whose rank was taken over, and a
    /// process of another incarnation of the job (module `incarnation`). Reusing the
    /// id of an open session is refused too. A resume token in `identity` is ignored
    /// here (see [`Engine::resume`]).
    pub fn open(&mut self, session: SessionId, mut identity: Identity, now: Millis) -> Result<Welcome, OpError> {
        self.now = now;
        validate::identity(&identity, &self.config.limits)?;
        if self.sessions.contains_key(&session) {
            return Err(OpError::Invalid(format!("{session} is already open")));
        }
        identity.resume = None;
        let (job_id, created) = self.job_named(&identity.job, now);
        if let Err(error) = self.admit(job_id, &identity, now) {
            if created {
                self.forget(job_id);
            }
            return Err(error);
        }
        if let Some(mut step) = self.step(job_id, now) {
            step.open(session, &identity);
        }
        // The job keeps the name; a copy per session would only cost memory.
        identity.job = String::new();
        let resume = identity.incarnation.map(|_| Box::default());
        let sess = Session {
            job: job_id,
            identity,
            leaving: false,
            abandoned: false,
            torch: false,
            via_agent: false,
            resume,
            resumed_at: None,
            taken_over: None,
        };
        self.sessions.insert(session, Box::new(sess));
        Ok(self.welcome(session, job_id))
    }

    fn welcome(&self, session: SessionId, job: JobId) -> Welcome {
        let job_incarnation = self.jobs.get(&job).and_then(|j| j.incarnation.as_ref()).map(|i| i.incarnation);
        Welcome { session, lease_ms: self.config.lease_ms, job_incarnation }
    }

    /// Engine time as wall-clock time (milliseconds since the Unix epoch).
    fn unix_ms(&self, at: Millis) -> u64 {
        self.config.epoch_unix_ms.saturating_add(at)
    }

    /// Whether `identity` may join job `id` (its job incarnation, its rank's holder);
    /// on success the job takes the incarnation it names if it had none, and a rank
    /// taken over leaves its former holder's sessions.
    fn admit(&mut self, id: JobId, identity: &Identity, now: Millis) -> Result<(), OpError> {
        let epoch = self.config.epoch_unix_ms;
        let Some(job) = self.jobs.get(&id) else { return Ok(()) };
        incarnation::check_job(job, identity.job_incarnation)?;
        let takeover = incarnation::claim(job, &self.sessions, identity, |at| epoch.saturating_add(at))?;
        if let Some(job) = self.jobs.get_mut(&id) {
            incarnation::adopt(job, identity, epoch.saturating_add(now));
        }
        if let Some(rank) = takeover {
            self.take_over(id, rank, incarnation::process(identity), now);
        }
        Ok(())
    }

    /// `by` takes `rank` over: the sessions of its former holder stop carrying it, and
    /// whatever they wait for fails, naming `by`.
    fn take_over(&mut self, id: JobId, rank: u32, by: ProcessInfo, now: Millis) {
        let at_unix_ms = self.unix_ms(now);
        let Some(mut step) = self.step(id, now) else { return };
        for session in step.job.ranks.take_over(rank, &by, now) {
            let Some(sess) = step.sessions.get_mut(&session) else { continue };
            let this = Box::new(incarnation::process(&sess.identity));
            let error = OpError::TakenOver { rank, by: Box::new(by.clone()), at_unix_ms, this };
            sess.identity.rank = None;
            sess.taken_over = Some(Box::new(error.clone()));
            if let Some(hot) = step.hot.get_mut(&session) {
                (hot.rank, hot.taken_over) = (None, true);
            }
            step.job.fail_session(session, &error, &mut step.ctx);
        }
    }

    /// The id of the job called `name`, made now if there is none (then `true`).
    fn job_named(&mut self, name: &str, now: Millis) -> (JobId, bool) {
        if let Some(id) = self.job_ids.get(name) {
            return (*id, false);
        }
        (self.new_job(name, now), true)
    }

    /// A new job called `name`, from now on the one sessions of that name join.
    fn new_job(&mut self, name: &str, now: Millis) -> JobId {
        let id = self.next_job;
        self.next_job += 1;
        self.job_ids.insert(name.to_owned(), id);
        self.jobs.insert(id, Job::new(id, name.to_owned(), &self.config, now));
        id
    }

    /// Resumes `session` on a new connection: the client of `identity` lost its
    /// connection (or believes so) and says hello again with the session's id. Allowed
    /// for the same process (same incarnation and identity) while the session is open
    /// or within its reconnect grace, and its rank was not taken over. The session
    /// keeps everything: its waiting requests are answered on the new connection, and
    /// requests re-sent with the same ids are not run twice. `Err`: why not (the
    /// caller opens a new session instead).
    pub fn resume(&mut self, session: SessionId, identity: &Identity, now: Millis) -> Result<Welcome, String> {
        self.now = now;
        let Some(sess) = self.sessions.get_mut(&session) else {
            return Err(format!("{session} is closed"));
        };
        let Some(resume) = sess.resume.as_deref_mut() else {
            return Err(format!("{session} cannot resume (it stated no incarnation)"));
        };
        let job_name = self.jobs.get(&sess.job).map_or("", |j| j.name.as_str());
        let mine = &sess.identity;
        let same = identity.incarnation == mine.incarnation
            && identity.job == job_name
            && identity.world_size == mine.world_size
            && identity.host == mine.host
            && identity.pid == mine.pid
            && identity.role == mine.role
            && identity.job_incarnation == mine.job_incarnation;
        if !same {
            return Err(format!("{session} belongs to another process or identity"));
        }
        if sess.taken_over.is_some() {
            return Err(format!("the rank of {session} was taken over"));
        }
        if identity.rank != mine.rank {
            return Err(format!("{session} carries another rank"));
        }
        resume.detached = None;
        sess.resumed_at = Some(now);
        let job = sess.job;
        if let Some(hot) = self.hot.get_mut(&session) {
            hot.resumed_at = Some(now);
            if hot.record_high > 0 {
                self.keep_held_calls(session, now);
            }
        }
        self.alive(session, now);
        Ok(self.welcome(session, job))
    }

    /// Keeps for `session`, which resumes, what the records tell of its calls held
    /// there, so that a copy of one the client sends again is answered as a copy of a
    /// kept request would be: a call still waiting is kept in its replies as a barrier
    /// call of its own is (read from its generation, or replaced by its failure), and
    /// how a call whose generation ended is noted apart (`Engine::held_ended`), so
    /// that these calls push none of its kept replies out.
    fn keep_held_calls(&mut self, session: SessionId, now: Millis) {
        self.settle_made();
        let Engine { sessions, jobs, config, tracked, held_ended, .. } = self;
        held_ended.remove(&session);
        let Some(sess) = sessions.get_mut(&session) else { return };
        let (job, rank) = (sess.job, sess.identity.rank);
        let Some(resume) = sess.resume.as_deref_mut() else { return };
        let Some(collectives) = jobs.get(&job).map(|j| &j.collectives) else { return };
        let pending = |at, generation| collectives.is_pending(at, generation, rank);
        let limits = &config.reply_cache;
        let mut ended = Vec::new();
        for (id, call) in collectives.held_calls(session) {
            match call {
                // Kept already if the session resumed before while it waited.
                HeldCall::Waiting { .. } if resume.kept.holds(id) => {}
                HeldCall::Waiting { at, generation } => track(tracked, &mut resume.kept, |kept| {
                    kept.arrived_called(id, (at, generation), now, limits, &pending)
                }),
                HeldCall::Ended(outcome) => ended.push((id, outcome)),
            }
        }
        if !ended.is_empty() {
            held_ended.insert(session, ended);
        }
    }

    /// Lends job `id` with the rest of the engine's state to one step of it: the one
    /// place where the engine is split into those borrows.
    fn step(&mut self, id: JobId, now: Millis) -> Option<Step<'_>> {
        let job = self.jobs.get_mut(&id)?;
        let settled = self.settled == self.outgoing.len();
        let (out, timers, tracked) = (&mut self.outgoing, &mut self.timers, &mut self.tracked);
        let (released, records) = (&mut self.released, &mut self.records);
        let ctx = Ctx { job: id, now, out, timers, tracked, released, settled, records };
        Some(Step::new(job, ctx, &mut self.sessions, &mut self.hot, &self.config, &mut self.notices))
    }

    /// Whether a node agent carries `session` (its replies go through one): the
    /// server's to say, as sessions move between connections when they resume.
    pub fn set_via_agent(&mut self, session: SessionId, via_agent: bool) {
        if let Some(sess) = self.sessions.get_mut(&session) {
            sess.via_agent = via_agent;
        }
    }

    /// Admits a PyTorch TCPStore connection of process `pid` on `host`: a session
    /// without rank in `job`. Its rank is inferred later from the address key it
    /// writes; a new connection of a process already attributed gets that rank at once
    /// (torch opens several connections per process).
    pub fn open_tcpstore(
        &mut self,
        session: SessionId,
        job: &str,
        host: &str,
        pid: u32,
        now: Millis,
    ) -> Result<Welcome, OpError> {
        let mut identity = Identity::anonymous(job);
        identity.host = host.to_owned();
        identity.pid = pid;
        let welcome = self.open(session, identity, now)?;
        let Some(sess) = self.sessions.get_mut(&session) else { return Ok(welcome) };
        sess.torch = true;
        if pid == 0 {
            return Ok(welcome);
        }
        let process = self.torch_processes.entry((sess.job, sess.identity.host.clone(), pid)).or_default();
        process.sessions.insert(session);
        if let Some(rank) = process.rank {
            self.attribute(session, rank, now);
        }
        Ok(welcome)
    }

    /// Gives `rank` to the unattributed torch session and to the other unattributed
    /// torch sessions of the same process. Torch clients never heartbeat, so these
    /// sessions keep their rank alive without a lease; their unclean close loses it.
    fn attribute(&mut self, session: SessionId, rank: u32, now: Millis) {
        let Some(sess) = self.sessions.get(&session) else { return };
        let (job_id, host, pid) = (sess.job, sess.identity.host.clone(), sess.identity.pid);
        let same_process = if pid == 0 { None } else { self.torch_processes.get_mut(&(job_id, host.clone(), pid)) };
        let targets: Vec<SessionId> = match same_process {
            Some(process) => {
                process.rank = Some(rank);
                process.sessions.iter().copied().collect()
            }
            None => vec![session],
        };
        let Some(mut step) = self.step(job_id, now) else { return };
        for id in targets {
            let Some(s) = step.sessions.get_mut(&id) else { continue };
            if !s.torch || s.identity.rank.is_some() {
                continue;
            }
            s.identity.rank = Some(rank);
            if let Some(hot) = step.hot.get_mut(&id) {
                hot.rank = Some(rank);
            }
            step.connect(rank, &host, pid, None, 0, None);
        }
    }

    /// The rank an unattributed torch session reveals by writing its address key.
    fn revealed_rank(&self, session: SessionId, request: &Request) -> Option<u32> {
        // The request first: it is cheap to rule out, and this runs for every request.
        let Request::Set { key, .. } = request else { return None };
        let (_, rank) = torch::address_key(key)?;
        self.sessions.get(&session).filter(|s| s.torch && s.identity.rank.is_none())?;
        Some(rank)
    }

    /// Warnings produced so far (a torch job stalled at init, naming the ranks it
    /// waits for), for the caller to log.
    pub fn drain_notices(&mut self) -> std::vec::Drain<'_, String> {
        self.notices.drain(..)
    }

    /// The session's peer is taking in what the server sends (a long write to it made
    /// progress): as good as a heartbeat for its rank's lease. A connection does not
    /// read while it writes, so a rank receiving a reply of many MiB on a busy machine
    /// would otherwise look silent for the whole write.
    pub fn alive(&mut self, session: SessionId, now: Millis) {
        self.now = now;
        let Some(sess) = self.sessions.get(&session) else { return };
        let (Some(rank), false) = (sess.identity.rank, sess.torch) else { return };
        let lease_ms = self.config.lease_ms;
        if let Some(mut step) = self.step(sess.job, now) {
            step.touch(rank, lease_ms);
        }
    }

    /// Feeds one request. Its reply (now or later) appears in [`Engine::drain_outgoing`]
    /// tagged with `request_id`. Requests of unknown sessions are ignored.
    pub fn handle(&mut self, session: SessionId, request_id: u64, request: Request, now: Millis) {
        self.now = now;
        if let Some(rank) = self.revealed_rank(session, &request) {
            self.attribute(session, rank, now);
        }
        let Some((caller, _)) = self.gate(session, request_id, &request, now, Run::Alone) else { return };
        if matches!(request, Request::Reset { .. } | Request::Jobs | Request::Snapshot) {
            // Answered here rather than by a step of the job, but a sign of life all the
            // same: a client skips heartbeats while its calls flow (docs/PROTOCOL.md, 9).
            self.alive(session, now);
        }
        if let Request::Reset { incarnation } = request {
            let reply = self.reset(session, incarnation, now);
            return self.outgoing.push(Outgoing::new(session, request_id, reply));
        }
        let Some(sess) = self.sessions.get(&session) else { return };
        if let Request::Jobs = request {
            let names = self.job_names(sess.job);
            self.outgoing.push(Outgoing::new(session, request_id, Ok(Response::Values(names))));
            return;
        }
        if let Request::Snapshot = request {
            let reply = self.snapshot_reply(session, now);
            self.outgoing.push(Outgoing::new(session, request_id, reply));
            return;
        }
        let (job, exited) =
            (sess.job, if let Request::RankExited { rank, .. } = &request { Some(*rank) } else { None });
        if let Some(mut step) = self.step(job, now) {
            step.request(caller, request);
        }
        if let Some(rank) = exited {
            self.end_graces(job, rank, now);
        }
    }

    /// The process of `rank` ended (`Request::RankExited`): its sessions waiting in
    /// their reconnect grace will never be resumed, and close now (only a session that
    /// stated an incarnation has a grace, and each such session is its holder's).
    fn end_graces(&mut self, job: JobId, rank: u32, now: Millis) {
        let Some(holder) = self.jobs.get(&job).and_then(|j| j.ranks.holder(rank)) else { return };
        for session in holder.sessions.clone() {
            self.process_gone(session, now);
        }
    }

    /// What a request of `session` meets before it runs: a resent request is answered
    /// from what was kept (or waits on as before), and a session taken over gets its
    /// error. The caller and its job if the request runs; None if it was answered
    /// here, or its session is unknown.
    /// `run`: what the call is part of; a call of a run may be kept when it arrives
    /// rather than here, and one held in a record is kept there.
    fn gate(
        &mut self,
        session: SessionId,
        request_id: u64,
        request: &Request,
        now: Millis,
        run: Run,
    ) -> Option<(Caller, JobId)> {
        self.settle_made();
        if run == Run::Held {
            if let Some(gated) = self.gate_held(session, request_id, request, now) {
                return Some(gated);
            }
        }
        let Engine { sessions, jobs, config, outgoing, tracked, hot, held_ended, .. } = self;
        let sess = sessions.get_mut(&session)?;
        if run == Run::Held && hot.get(&session).is_none() {
            hot.insert(session, Hot::of(sess, 0));
        }
        let (job, rank) = (sess.job, sess.identity.rank);
        let mut keep = Keep::No;
        let limits = &config.reply_cache;
        let may_be_resent = resume::may_be_resent(sess.resumed_at, now, limits);
        if let Some(resume) = sess.resume.as_deref_mut() {
            let pending =
                |at, generation| jobs.get(&job).is_some_and(|j| j.collectives.is_pending(at, generation, rank));
            let changes_state = request.changes_state();
            if may_be_resent {
                let held_high = hot.get(&session).map_or(0, |h| h.record_high);
                let ended = held_ended.get(&session).and_then(|calls| calls.iter().find(|(id, _)| *id == request_id));
                let ended = ended.filter(|_| changes_state);
                let resent = match ended {
                    // A call held in a record whose generation ended (`keep_held_calls`).
                    Some((_, outcome)) => Resent::Replay(outcome.clone().map(|()| Response::Done)),
                    None => match resume.kept.resent(request_id, changes_state, now, limits, &pending) {
                        // A read that waits (a `get`) is not kept: the store knows it.
                        Resent::Run if request.may_block() => {
                            let waiting = jobs.get(&job).is_some_and(|j| j.store.is_waiting((session, request_id)));
                            if waiting {
                                Resent::Waiting
                            } else {
                                Resent::Run
                            }
                        }
                        // A barrier call no older than the latest held in a record may
                        // have been held in one no longer kept: not to be run again.
                        Resent::Run if request_id <= held_high && matches!(request, Request::Barrier { .. }) => {
                            Resent::Replay(Err(resume::unknown(request_id)))
                        }
                        resent => resent,
                    },
                };
                match resent {
                    Resent::Run => {}
                    Resent::Waiting => return None,
                    Resent::Replay(reply) => {
                        outgoing.push(Outgoing::new(session, request_id, reply));
                        return None;
                    }
                }
            }
            if let Some(error) = &sess.taken_over {
                if !matches!(request, Request::Leave | Request::Heartbeat) {
                    let reply = Err((**error).clone());
                    outgoing.push(Outgoing::new(session, request_id, reply));
                    return None;
                }
            }
            // Outside a resend window nothing asks for the request before it runs.
            keep = match (changes_state, run == Run::Calls && !may_be_resent) {
                (false, _) => Keep::No,
                _ if run == Run::Held => {
                    if let Some(hot) = hot.get_mut(&session) {
                        hot.record_high = hot.record_high.max(request_id);
                    }
                    Keep::InRecord
                }
                (true, true) => Keep::OnArrival,
                (true, false) => {
                    track(tracked, &mut resume.kept, |kept| kept.arrived(request_id, now, limits, &pending));
                    Keep::Waiting
                }
            };
        }
        let mut caller = Caller::of(session, sess, request_id);
        caller.keep = keep;
        Some((caller, job))
    }

    /// [`Engine::gate`] of a call of a held run from what [`Hot`] holds of its session,
    /// touching nothing else of it: when nothing waits to be checked before the call
    /// runs (its session is not in a resend window, nor taken over), the caller.
    /// `None`: the full gate decides.
    #[inline]
    fn gate_held(
        &mut self,
        session: SessionId,
        request_id: u64,
        request: &Request,
        now: Millis,
    ) -> Option<(Caller, JobId)> {
        let hot = self.hot.get_mut(&session)?;
        #[cfg(debug_assertions)]
        if let Some(sess) = self.sessions.get(&session) {
            assert_eq!(*hot, Hot::of(sess, hot.record_high), "a hot copy of {session} out of step");
        }
        if hot.taken_over || (hot.resumable && resume::may_be_resent(hot.resumed_at, now, &self.config.reply_cache)) {
            return None;
        }
        let keep = match hot.resumable && request.changes_state() {
            true => {
                // Noted before it runs: a call answered as it arrives is kept in the
                // session's replies anyway, where a copy of it finds its reply first.
                hot.record_high = hot.record_high.max(request_id);
                Keep::InRecord
            }
            false => Keep::No,
        };
        let (rank, world_size, torch) = (hot.rank, hot.world_size, hot.torch);
        Some((Caller { session, request_id, rank, world_size, torch, keep, held: None }, hot.job))
    }

    /// The same collective call (a barrier, all-gather or broadcast request) made by
    /// several sessions, `calls` as `(session, request id)` in order: a node agent's
    /// ranks at one barrier, which it sends as one frame. Each call is its own, as if
    /// handled by [`Engine::handle`] one after another: what a call meets before it
    /// runs (its gate) no collective call changes, so all are gated
    /// first; what does not depend on the caller (the request's checks, the job) is
    /// done once per run of calls of one job. Any other request is handled one call
    /// at a time.
    pub fn handle_calls(&mut self, calls: &[(SessionId, u64)], request: &Request, now: Millis) {
        self.run_of_calls(calls, None, request, now);
    }

    /// [`Engine::handle_calls`] for a node agent's run of calls, which came from
    /// `link`, `routes[i]` being where the reply to `calls[i]` goes there. The calls
    /// of a barrier that wait are held in a record of the link (see [`Record`])
    /// instead of each as a waiter of its own: its release is that record, in
    /// [`Engine::take_records`], not a reply per call in [`Engine::drain_outgoing`].
    /// Every other reply (a call's failure, a session's own error) is one per call,
    /// as for [`Engine::handle_calls`].
    pub fn handle_calls_from(
        &mut self,
        link: Link,
        calls: &[(SessionId, u64)],
        routes: &[u64],
        request: &Request,
        now: Millis,
    ) {
        let held = matches!(request, Request::Barrier { .. }) && routes.len() == calls.len();
        self.run_of_calls(calls, held.then_some((link, routes)), request, now);
    }

    fn run_of_calls(
        &mut self,
        calls: &[(SessionId, u64)],
        from: Option<(Link, &[u64])>,
        request: &Request,
        now: Millis,
    ) {
        if !request.is_collective() {
            for &(session, request_id) in calls {
                self.handle(session, request_id, request.clone(), now);
            }
            return;
        }
        self.now = now;
        if let (Some((link, routes)), Request::Barrier { members: Members::World, .. }) = (from, request) {
            return self.held_run(calls, link, routes, request, now);
        }
        let run = if from.is_some() { Run::Held } else { Run::Calls };
        let mut callers = Vec::with_capacity(calls.len());
        let mut job = None;
        for (i, &(session, request_id)) in calls.iter().enumerate() {
            let Some((mut caller, of)) = self.gate(session, request_id, request, now, run) else { continue };
            if let Some((link, routes)) = from {
                let route = routes.get(i).copied().unwrap_or_default();
                caller.held = Some(Held { link, route, room: calls.len() - i });
            }
            if job != Some(of) {
                if let Some(job) = job {
                    self.run_calls(job, &mut callers, request, now);
                }
                job = Some(of);
            }
            callers.push(caller);
        }
        if let Some(job) = job {
            self.run_calls(job, &mut callers, request, now);
        }
    }

    /// [`Engine::run_of_calls`] of a node agent's run of a whole-job barrier: the
    /// calls that need nothing checked before they run (see [`Engine::gate_held`])
    /// go to their job together, a stretch at a time ([`Step::hold_world`]); any
    /// other goes alone, in its place, through the full gate.
    fn held_run(&mut self, calls: &[(SessionId, u64)], link: Link, routes: &[u64], request: &Request, now: Millis) {
        let mut stretch: Vec<RunCall> = Vec::with_capacity(calls.len());
        let mut keeps: Vec<Keep> = Vec::with_capacity(calls.len());
        let mut job = None;
        for (i, &(session, request_id)) in calls.iter().enumerate() {
            let route = routes.get(i).copied().unwrap_or_default();
            // It reads no kept reply: nothing to settle first (`gate` and
            // `hold_stretch` do, for what they read).
            let gated = self.gate_held(session, request_id, request, now);
            if let Some((Caller { rank: Some(rank), world_size: Some(world_size), torch, keep, .. }, of)) = gated {
                if job.is_some_and(|job| job != of) {
                    self.hold_stretch(job, &mut stretch, &mut keeps, request, link, now);
                }
                job = Some(of);
                stretch.push(RunCall { session, request_id, rank, world_size, torch, route });
                keeps.push(keep);
                continue;
            }
            self.hold_stretch(job, &mut stretch, &mut keeps, request, link, now);
            let gated = match gated {
                Some(gated) => Some(gated),
                None => self.gate(session, request_id, request, now, Run::Held),
            };
            if let Some((mut caller, of)) = gated {
                caller.held = Some(Held { link, route, room: calls.len() - i });
                self.run_calls(of, &mut vec![caller], request, now);
            }
        }
        self.hold_stretch(job, &mut stretch, &mut keeps, request, link, now);
    }

    /// Runs a stretch of gated calls of `job` (see [`Engine::held_run`]) and empties it.
    fn hold_stretch(
        &mut self,
        job: Option<JobId>,
        stretch: &mut Vec<RunCall>,
        keeps: &mut Vec<Keep>,
        request: &Request,
        link: Link,
        now: Millis,
    ) {
        if let (Some(job), false) = (job, stretch.is_empty()) {
            self.settle_made();
            if let Some(mut step) = self.step(job, now) {
                step.hold_world(stretch, keeps, request, link);
            }
        }
        stretch.clear();
        keeps.clear();
    }

    fn run_calls(&mut self, job: JobId, callers: &mut Vec<Caller>, request: &Request, now: Millis) {
        // The gates' replays kept, so that the calls may read kept barrier calls.
        self.settle_made();
        match self.step(job, now) {
            Some(mut step) => step.calls(callers.drain(..), request),
            None => callers.clear(),
        }
    }

    /// Starts a new incarnation of the job of `session` (see `Request::Reset`).
    fn reset(&mut self, session: SessionId, incarnation: u64, now: Millis) -> Reply {
        let Some(sess) = self.sessions.get(&session) else { return Ok(Response::Done) };
        let (old, by) = (sess.job, incarnation::process(&sess.identity));
        let Some(job) = self.jobs.get(&old) else { return Ok(Response::Done) };
        if let Some(error) = job.reset_error() {
            return Err(error);
        }
        if job.incarnation.as_ref().is_some_and(|i| i.incarnation == incarnation) {
            return Ok(Response::Done);
        }
        let name = job.name.clone();
        let to = JobIncarnation { incarnation, since_unix_ms: self.unix_ms(now), by, reset: true };
        let new = self.new_job(&name, now);
        if let Some(mut job) = self.jobs.remove(&new) {
            job.incarnation = Some(Box::new(to.clone()));
            if let Some(old) = self.jobs.get(&old) {
                job.continue_counting(old);
            }
            self.jobs.insert(new, job);
        }
        if let Some(mut step) = self.step(old, now) {
            step.job.supersede(to, &mut step.ctx);
        }
        Ok(Response::Done)
    }

    /// The job of `session` as JSON (see `Request::Snapshot`).
    fn snapshot_reply(&self, session: SessionId, now: Millis) -> Reply {
        let Some(sess) = self.sessions.get(&session) else { return Ok(Response::Done) };
        let Some(job) = self.jobs.get(&sess.job) else { return Ok(Response::Done) };
        if let Some(error) = job.reset_error() {
            return Err(error);
        }
        let snapshot = self.snapshot_of(sess.job, Some(session), now);
        match serde_json::to_vec(&snapshot) {
            Ok(json) => Ok(Response::Value(json.into())),
            Err(error) => Err(OpError::Invalid(format!("cannot encode the snapshot: {error}"))),
        }
    }

    /// The jobs a `Jobs` request lists, in byte order, capped: those holding anything
    /// besides the asking session (another session, a key, a rank). A job only ever
    /// asked about, or kept after its last session left with nothing, is none.
    fn job_names(&self, asking: JobId) -> Vec<bytes::Bytes> {
        let mut names: Vec<&str> = self
            .jobs
            .values()
            .filter(|job| {
                let others = job.sessions.saturating_sub(usize::from(job.id == asking));
                // An abort is the job's state too: every later call fails for it. (An
                // incarnation alone is not: a launcher names one before any worker runs,
                // and `status` tells such a job by its absence here.)
                let aborted = job.superseded.is_none() && job.aborted.is_some();
                others > 0 || job.store.len() > 0 || job.ranks.ever_connected() > 0 || aborted
            })
            .map(|job| job.name.as_str())
            .collect();
        names.sort_unstable();
        names.truncate(crate::MAX_JOBS_LISTED);
        names.into_iter().map(|name| bytes::Bytes::copy_from_slice(name.as_bytes())).collect()
    }

    /// The name of the job of `session`, if it is open.
    pub fn session_job(&self, session: SessionId) -> Option<&str> {
        let sess = self.sessions.get(&session)?;
        self.jobs.get(&sess.job).map(|job| job.name.as_str())
    }

    /// The session's connection is gone, and whether its process is alive is not known:
    pub fn close(&mut self, session: SessionId, now: Millis) {
        self.close_with(session, Departure::Unknown, now);
    }

    /// The session's connection is gone. After a `Leave` request, the session closes
    /// cleanly: its rank has left. Otherwise a session that can resume (it stated an
    /// incarnation) waits for its client for the reconnect grace, keeping its rank,
    /// unless its process is known to be gone; then (or at once, for a session that
    /// cannot resume) it closes, and if it was its rank's last session, the rank is lost.
    pub fn close_with(&mut self, session: SessionId, departure: Departure, now: Millis) {
        self.now = now;
        let grace = self.config.grace_ms();
        let Some(sess) = self.sessions.get_mut(&session) else { return };
        let waits = departure == Departure::Unknown
            && grace > 0
            && !sess.leaving
            && !sess.abandoned
            && sess.taken_over.is_none();
        if let (true, Some(resume)) = (waits, sess.resume.as_deref_mut()) {
            if resume.detached.is_none() {
                let until = now.saturating_add(grace);
                resume.detached = Some(Detached { at: now, until });
                self.timers.schedule(until, Timer::Grace { job: sess.job, session });
            }
            return;
        }
        self.finish(session, now);
    }

    /// The process of a session waiting for a resume is known to be gone (the I/O
    /// layer watches processes of its own host): its grace ends now.
    pub fn process_gone(&mut self, session: SessionId, now: Millis) {
        self.now = now;
        if self.sessions.get(&session).is_some_and(|s| s.detached()) {
            self.finish(session, now);
        }
    }

    /// Closes the session for good.
    fn finish(&mut self, session: SessionId, now: Millis) {
        self.settle_made();
        let Some(sess) = self.sessions.remove(&session) else { return };
        self.hot.remove(&session);
        self.held_ended.remove(&session);
        if let Some(resume) = &sess.resume {
            self.tracked = self.tracked.saturating_sub(resume.kept.waiting());
        }
        if sess.torch && sess.identity.pid != 0 {
            let process = (sess.job, sess.identity.host.clone(), sess.identity.pid);
            if let Some(entry) = self.torch_processes.get_mut(&process) {
                entry.sessions.remove(&session);
                if entry.sessions.is_empty() {
                    self.torch_processes.remove(&process);
                }
            }
        }
        if let Some(mut step) = self.step(sess.job, now) {
            step.close(session, &sess);
        }
        // A reset job lives on only for its sessions.
        if self.jobs.get(&sess.job).is_some_and(|j| j.superseded.is_some() && j.sessions == 0) {
            self.forget(sess.job);
        }
        // Replies for the closed session have nowhere to go. Those the close made (its
        // rank's loss failing its peers' barriers) are yet to be kept, any release
        // among them like other replies: their places move.
        self.released.clear();
        let (settled, mut at) = (self.settled, 0);
        self.outgoing.retain(|o| {
            at += 1;
            if o.session == session {
                self.settled -= usize::from(at <= settled);
                return false;
            }
            true
        });
    }

    /// Job `name`, if the engine holds it.
    fn held_job(&self, name: &str) -> Option<&Job> {
        self.job_ids.get(name).and_then(|id| self.jobs.get(id))
    }

    /// The ranks of job `job` counted as lost, in rank order, with how and when they
    /// were last heard from: the fact a launcher needs to blame the rank its peers
    /// lost rather than a peer that failed because of it. A finished rank is among
    /// them only if something failed for it: a rank done before its peers stranded
    /// them, one done after them did not.
    pub fn lost_ranks(&self, job: &str, now: Millis) -> Vec<RankInfo> {
        let Some(job) = self.held_job(job) else { return Vec::new() };
        let failed_for = job.collectives.failed_for();
        let counted = |rank: &u32| !job.ranks.finished(*rank) || failed_for.contains(rank);
        job.ranks.lost().filter(counted).map(|rank| job.ranks.info(rank, now)).collect()
    }

    /// The ranks of job `job` whose workers exited with code 0 (their launchers said
    /// so), each as last seen: done, whether or not a peer still needed them.
    pub fn finished_ranks(&self, job: &str, now: Millis) -> Vec<RankInfo> {
        let Some(job) = self.held_job(job) else { return Vec::new() };
        job.ranks.lost().filter(|rank| job.ranks.finished(*rank)).map(|rank| job.ranks.info(rank, now)).collect()
    }

    /// The ranks of job `job` a barrier or collective failed for (lost or finished
    /// then), in rank order: a launcher tells a rank done early that stranded its
    /// peers from one that was merely done.
    pub fn failed_for(&self, job: &str) -> Vec<u32> {
        let Some(job) = self.held_job(job) else { return Vec::new() };
        job.collectives.failed_for().iter().copied().collect()
    }

    /// Who aborted `job` and why, and when (ms since the Unix epoch: a launcher tells
    /// an abort its peers failed for from one made after a rank was lost), if it was
    /// aborted.
    pub fn aborted(&self, job: &str) -> Option<(AbortInfo, u64)> {
        let job = self.held_job(job)?;
        job.aborted.clone().map(|by| (by, self.unix_ms(job.aborted_at)))
    }

    /// How long ago (ms) a process of `job` last asked for something (connected, or
    /// made a request other than a heartbeat, a leave or a status request); `None`
    /// for a job the engine does not hold.
    pub fn quiet_ms(&self, job: &str, now: Millis) -> Option<u64> {
        let job = self.held_job(job)?;
        Some(now.saturating_sub(job.last_request))
    }

    /// Advances time: fires timeouts and lease expiries due at or before `now`.
    pub fn tick(&mut self, now: Millis) {
        self.now = now;
        while let Some((at, timer)) = self.timers.pop_due(now) {
            if let Timer::Grace { session, .. } = timer {
                let due = self.sessions.get(&session).and_then(|s| Some(s.resume.as_ref()?.detached?.until));
                if due == Some(at) {
                    self.finish(session, now);
                }
                continue;
            }
            let job = timer.job();
            let expired = self.step(job, now).is_some_and(|mut step| step.fire(at, timer));
            if expired {
                self.forget(job);
            }
        }
    }

    /// Earliest time at which `tick` may have something to do.
    pub fn next_deadline(&self) -> Option<Millis> {
        self.timers.next_deadline()
    }

    /// Records of node agents' calls released so far (see
    /// [`Engine::handle_calls_from`]): `Done` to every call of each. Drained after
    /// [`Engine::drain_outgoing`], whose replies to calls of a record (made when one
    /// of its sessions failed alone) come first.
    /// Taken whole: asked after every input, and empty after most.
    pub fn take_records(&mut self) -> Vec<std::sync::Arc<Record>> {
        std::mem::take(&mut self.records)
    }

    /// Replies produced so far, in the order they were produced.
    pub fn drain_outgoing(&mut self) -> std::vec::Drain<'_, Outgoing> {
        self.settle_made();
        self.settled = 0;
        self.released.clear();
        self.outgoing.drain(..)
    }

    /// Keeps every reply made since the last call in its session's replies, where
    /// it answers a state-changing request of a resumable session (module `resume`).
    #[inline]
    fn settle_made(&mut self) {
        if self.settled < self.outgoing.len() {
            self.settle_from();
        }
    }

    fn settle_from(&mut self) {
        let Engine { sessions, config, outgoing, tracked, settled, released, now, .. } = self;
        let (mut at, to) = (*settled, outgoing.len());
        *settled = to;
        if *tracked == 0 {
            released.clear();
            return;
        }
        let limits = &config.reply_cache;
        let mut skip = released.iter().copied().peekable();
        while at < to {
            // A release's replies are read from the generation by their sessions.
            if let Some(&(start, end)) = skip.peek() {
                if start <= at {
                    at = at.max(end);
                    skip.next();
                    continue;
                }
            }
            let Some(out) = outgoing.get(at) else { break };
            at += 1;
            let Some(resume) = sessions.get_mut(&out.session).and_then(|s| s.resume.as_deref_mut()) else { continue };
            track(tracked, &mut resume.kept, |kept| kept.answered(out.request_id, &out.reply, *now, limits));
        }
        released.clear();
    }

    /// Drops an idle (or reset) job: its keys, barriers and ranks.
    fn forget(&mut self, id: JobId) {
        if let Some(job) = self.jobs.remove(&id) {
            if self.job_ids.get(&job.name) == Some(&id) {
                self.job_ids.remove(&job.name);
            }
        }
    }
}

/// Runs `change` on a session's kept replies and counts what it left waiting in the
/// engine's `tracked`.
pub(crate) fn track<R>(tracked: &mut usize, kept: &mut Kept, change: impl FnOnce(&mut Kept) -> R) -> R {
    let before = kept.waiting();
    let result = change(kept);
    *tracked = tracked.saturating_add(kept.waiting()).saturating_sub(before);
    result
}
