//! The engine: owns every job and routes sessions' requests, disconnects and clock
//! ticks to them.

mod collective;
mod job;
mod members;
mod ranks;
mod store;
mod timers;
mod torch;
mod validate;

use std::collections::BTreeSet;

use crate::{
    AbortInfo, CollectiveKind, Config, Identity, Members, Millis, OpError, Outgoing, RankInfo, Reply, Request,
    Response, SessionId, Welcome,
};

use collective::{Call, Ctx};
use job::{send_key_replies, Job};
use store::WaitKind;
use timers::{Timer, Timers};

/// Jobs are numbered so that timers never point at a newer job of the same name.
pub(crate) type JobId = u64;

/// The engine's hash maps: foldhash, randomly seeded per process. SipHash showed in
/// per-request profiles; keys come from the job's own clients, and the random seed
/// keeps crafted collisions impractical.
pub(crate) type HashMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

#[derive(Debug)]
struct Session {
    job: JobId,
    identity: Identity,
    /// Said `Leave`: its close is clean, not a loss.
    leaving: bool,
    /// A PyTorch TCPStore connection: its rank, if any, was inferred (module `torch`).
    torch: bool,
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
    /// Boxed: the table stays small (it is sized by powers of two, so often half
    /// empty), which matters at tens of thousands of idle sessions.
    sessions: HashMap<SessionId, Box<Session>>,
    /// Open torch sessions by process (job, host, pid ≠ 0): torch opens several
    /// connections per process, and a rank learned on one belongs to all of them.
    torch_processes: HashMap<(JobId, String, u32), TorchProcess>,
    timers: Timers,
    outgoing: Vec<Outgoing>,
    /// Warnings for the operator (stalled torch jobs), in the order produced.
    notices: Vec<String>,
}

impl Engine {
    pub fn new(config: Config) -> Self {
        Engine {
            config,
            jobs: HashMap::default(),
            job_ids: HashMap::default(),
            next_job: 1,
            sessions: HashMap::default(),
            torch_processes: HashMap::default(),
            timers: Timers::default(),
            outgoing: Vec::new(),
            notices: Vec::new(),
        }
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Admits a session with its identity. An invalid identity (rank ≥ world size,
    /// world size 0, names too long) is refused and leaves no trace. Reusing the id of
    /// an open session is refused too.
    pub fn open(&mut self, session: SessionId, mut identity: Identity, now: Millis) -> Result<Welcome, OpError> {
        validate::identity(&identity, &self.config.limits)?;
        if self.sessions.contains_key(&session) {
            return Err(OpError::Invalid(format!("{session} is already open")));
        }
        let job_id = match self.job_ids.get(&identity.job) {
            Some(id) => *id,
            None => {
                let id = self.next_job;
                self.next_job += 1;
                self.job_ids.insert(identity.job.clone(), id);
                self.jobs.insert(id, Job::new(id, identity.job.clone(), &self.config, now));
                id
            }
        };
        let lease_ms = self.config.lease_ms;
        if let Some(job) = self.jobs.get_mut(&job_id) {
            job.sessions += 1;
            if let Some(rank) = identity.rank {
                let mut ctx = Ctx { job: job_id, now, out: &mut self.outgoing, timers: &mut self.timers };
                let change =
                    job.ranks.connect(rank, &identity.host, identity.pid, identity.role.as_deref(), now, lease_ms);
                job.apply(rank, change, &mut ctx);
                job.collectives.rank_connected(&job.ranks, &mut ctx);
            }
        }
        // The job keeps the name; a copy per session would only cost memory.
        identity.job = String::new();
        self.sessions.insert(session, Box::new(Session { job: job_id, identity, leaving: false, torch: false }));
        Ok(Welcome { session, lease_ms })
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
        let Some(job) = self.jobs.get_mut(&job_id) else { return };
        let mut ctx = Ctx { job: job_id, now, out: &mut self.outgoing, timers: &mut self.timers };
        for id in targets {
            let Some(s) = self.sessions.get_mut(&id) else { continue };
            if !s.torch || s.identity.rank.is_some() {
                continue;
            }
            s.identity.rank = Some(rank);
            let change = job.ranks.connect(rank, &host, pid, None, now, 0);
            job.apply(rank, change, &mut ctx);
            job.collectives.rank_connected(&job.ranks, &mut ctx);
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
        let Some(sess) = self.sessions.get(&session) else { return };
        let (Some(rank), false) = (sess.identity.rank, sess.torch) else { return };
        let Some(job) = self.jobs.get_mut(&sess.job) else { return };
        let mut ctx = Ctx { job: job.id, now, out: &mut self.outgoing, timers: &mut self.timers };
        let change = job.ranks.touch(rank, now, self.config.lease_ms);
        job.apply(rank, change, &mut ctx);
    }

    /// Feeds one request. Its reply (now or later) appears in [`Engine::drain_outgoing`]
    /// tagged with `request_id`. Requests of unknown sessions are ignored.
    pub fn handle(&mut self, session: SessionId, request_id: u64, request: Request, now: Millis) {
        if let Some(rank) = self.revealed_rank(session, &request) {
            self.attribute(session, rank, now);
        }
        if matches!(request, Request::Status) {
            let report = self.report(session, now);
            self.outgoing.push(Outgoing { session, request_id, reply: Ok(Response::Value(report.into())) });
            return;
        }
        let Some(sess) = self.sessions.get_mut(&session) else { return };
        let Some(job) = self.jobs.get_mut(&sess.job) else { return };
        let mut ctx = Ctx { job: job.id, now, out: &mut self.outgoing, timers: &mut self.timers };
        if let Some(rank) = sess.identity.rank {
            let lease_ms = if sess.torch { 0 } else { self.config.lease_ms };
            let change = job.ranks.touch(rank, now, lease_ms);
            job.apply(rank, change, &mut ctx);
        }
        let reply = |ctx: &mut Ctx<'_>, reply: Reply| ctx.out.push(Outgoing { session, request_id, reply });

        match request {
            Request::Heartbeat => return reply(&mut ctx, Ok(Response::Done)),
            Request::Leave => {
                sess.leaving = true;
                return reply(&mut ctx, Ok(Response::Done));
            }
            _ => {}
        }
        if let Some(error) = job.abort_error() {
            return reply(&mut ctx, Err(error));
        }
        if let Err(error) = validate::request(&request, &self.config.limits) {
            return reply(&mut ctx, Err(error));
        }

        let mut woken = Vec::new();
        let id = (session, request_id);
        let torch = sess.torch;
        let result: Option<Reply> = match request {
            Request::Heartbeat | Request::Leave | Request::Status => None,
            Request::QueuePush { key, value } => {
                job.store.queue_push(key, value, &mut woken);
                Some(Ok(Response::Done))
            }
            Request::QueuePop { key } => {
                let (len_before, value) = job.store.queue_pop(&key);
                Some(Ok(Response::Popped { len_before, value }))
            }
            Request::QueueLen { key } => Some(Ok(Response::Int(job.store.queue_len(&key)))),
            Request::CancelWait => {
                job.store.cancel_session(session, &mut woken);
                Some(Ok(Response::Done))
            }
            Request::StoreBarrier { key, world_size, timeout_ms } => {
                match job.store.barrier(id, key, world_size, now, &mut woken) {
                    Err(error) => Some(Err(error)),
                    Ok(Some(reply)) => Some(reply),
                    Ok(None) => {
                        schedule_wait_timers(job, &mut ctx, id, timeout_ms, torch);
                        None
                    }
                }
            }
            Request::Set { key, value } => {
                job.store.set(key, value, &mut woken);
                Some(Ok(Response::Done))
            }
            Request::Append { key, value } => {
                job.store.append(key, &value, &mut woken);
                Some(Ok(Response::Done))
            }
            Request::Add { key, delta } => Some(job.store.add(key, delta, &mut woken).map(Response::Int)),
            Request::CompareSet { key, expected, desired } => {
                Some(Ok(Response::Value(job.store.compare_set(key, expected, desired, &mut woken))))
            }
            Request::Delete { key } => Some(Ok(Response::Bool(job.store.delete(&key)))),
            Request::Check { keys } => Some(Ok(Response::Bool(keys.iter().all(|k| job.store.exists(k))))),
            Request::MultiSet { entries } => {
                for (key, value) in entries {
                    job.store.set(key, value, &mut woken);
                }
                Some(Ok(Response::Done))
            }
            Request::NumKeys => Some(Ok(Response::Int(i64::try_from(job.store.len()).unwrap_or(i64::MAX)))),
            Request::ListKeys { prefix } => Some(Ok(Response::Values(job.store.list(&prefix)))),
            Request::Get { key, timeout_ms } => {
                key_wait(job, &mut ctx, id, WaitKind::Get, vec![key], timeout_ms, torch)
            }
            Request::Wait { keys, timeout_ms } => key_wait(job, &mut ctx, id, WaitKind::Wait, keys, timeout_ms, torch),
            Request::MultiGet { keys, timeout_ms } => {
                key_wait(job, &mut ctx, id, WaitKind::MultiGet, keys, timeout_ms, torch)
            }
            Request::Barrier { name, members, timeout_ms } => {
                let call = collective_call(
                    &sess.identity,
                    id,
                    &job.ranks,
                    CollectiveKind::Barrier,
                    &name,
                    members,
                    None,
                    bytes::Bytes::new(),
                    timeout_ms,
                );
                call.map(|call| job.collectives.arrive(CollectiveKind::Barrier, &name, call, &job.ranks, &mut ctx))
                    .err()
                    .map(Err)
            }
            Request::AllGather { name, members, value, timeout_ms } => {
                let call = collective_call(
                    &sess.identity,
                    id,
                    &job.ranks,
                    CollectiveKind::AllGather,
                    &name,
                    members,
                    None,
                    value,
                    timeout_ms,
                );
                call.map(|call| job.collectives.arrive(CollectiveKind::AllGather, &name, call, &job.ranks, &mut ctx))
                    .err()
                    .map(Err)
            }
            Request::Broadcast { name, members, root, value, timeout_ms } => {
                let is_root = sess.identity.rank == Some(root);
                match (is_root, value) {
                    (true, None) => Some(Err(OpError::Invalid(format!(
                        "broadcast '{name}': the root (rank {root}) must provide a value"
                    )))),
                    (_, value) => {
                        let value = if is_root { value.unwrap_or_default() } else { bytes::Bytes::new() };
                        let call = collective_call(
                            &sess.identity,
                            id,
                            &job.ranks,
                            CollectiveKind::Broadcast,
                            &name,
                            members,
                            Some(root),
                            value,
                            timeout_ms,
                        );
                        call.map(|call| {
                            job.collectives.arrive(CollectiveKind::Broadcast, &name, call, &job.ranks, &mut ctx)
                        })
                        .err()
                        .map(Err)
                    }
                }
            }
            Request::Abort { reason } => {
                let by = AbortInfo {
                    by_rank: sess.identity.rank,
                    host: sess.identity.host.clone(),
                    pid: sess.identity.pid,
                    reason,
                };
                job.abort(by, &mut ctx);
                Some(Ok(Response::Done))
            }
        };
        send_key_replies(woken, ctx.out);
        if let Some(result) = result {
            reply(&mut ctx, result);
        }
    }

    /// The session's connection is gone. Without a preceding `Leave` request and if
    /// it was its rank's last session, the rank is lost.
    pub fn close(&mut self, session: SessionId, now: Millis) {
        let Some(sess) = self.sessions.remove(&session) else { return };
        if sess.torch && sess.identity.pid != 0 {
            let process = (sess.job, sess.identity.host.clone(), sess.identity.pid);
            if let Some(entry) = self.torch_processes.get_mut(&process) {
                entry.sessions.remove(&session);
                if entry.sessions.is_empty() {
                    self.torch_processes.remove(&process);
                }
            }
        }
        let Some(job) = self.jobs.get_mut(&sess.job) else { return };
        job.store.drop_session(session);
        job.sessions = job.sessions.saturating_sub(1);
        let mut ctx = Ctx { job: job.id, now, out: &mut self.outgoing, timers: &mut self.timers };
        if let Some(rank) = sess.identity.rank {
            let change = job.ranks.disconnect(rank, sess.leaving, now);
            job.apply(rank, change, &mut ctx);
        }
        if job.sessions == 0 && self.config.job_idle_ttl_ms > 0 {
            job.idle_since = now;
            self.timers.schedule(now.saturating_add(self.config.job_idle_ttl_ms), Timer::JobIdle { job: job.id });
        }
        // Replies for the closed session have nowhere to go.
        self.outgoing.retain(|o| o.session != session);
    }

    /// The ranks of job `job` counted as lost, in rank order, with how and when they
    /// were last heard from: the fact a launcher needs to blame the rank its peers
    /// lost rather than a peer that failed because of it.
    pub fn lost_ranks(&self, job: &str, now: Millis) -> Vec<RankInfo> {
        let Some(job) = self.job_ids.get(job).and_then(|id| self.jobs.get(id)) else { return Vec::new() };
        job.ranks.lost().map(|rank| job.ranks.info(rank, now)).collect()
    }

    /// The status report of the session's job (see `Request::Status`).
    fn report(&self, session: SessionId, now: Millis) -> String {
        let Some(job_id) = self.sessions.get(&session).map(|s| s.job) else { return String::new() };
        let Some(job) = self.jobs.get(&job_id) else { return String::new() };
        let mut sessions: Vec<(SessionId, &Identity, bool)> = self
            .sessions
            .iter()
            .filter(|(id, s)| s.job == job_id && **id != session)
            .map(|(id, s)| (*id, &s.identity, s.torch))
            .collect();
        sessions.sort_by_key(|(id, _, _)| *id);
        let mut out = torch::report(job, &sessions, now);
        let (connected, left, lost) = job.ranks.tally();
        out.push_str(&format!("ranks: {connected} connected, {left} left cleanly, {lost} lost\n"));
        for line in job.collectives.report(&job.ranks, now) {
            out.push_str(&line);
            out.push('\n');
        }
        for rank in job.ranks.lost() {
            out.push_str(&format!("lost: {}\n", job.ranks.info(rank, now)));
        }
        out
    }

    /// Advances time: fires timeouts and lease expiries due at or before `now`.
    pub fn tick(&mut self, now: Millis) {
        while let Some((at, timer)) = self.timers.pop_due(now) {
            self.fire(at, timer, now);
        }
    }

    /// Earliest time at which `tick` may have something to do.
    pub fn next_deadline(&self) -> Option<Millis> {
        self.timers.next_deadline()
    }

    /// Replies produced so far, in the order they were produced.
    pub fn drain_outgoing(&mut self) -> std::vec::Drain<'_, Outgoing> {
        self.outgoing.drain(..)
    }

    fn fire(&mut self, at: Millis, timer: Timer, now: Millis) {
        let job_id = match &timer {
            Timer::KeyWait { job, .. }
            | Timer::StallSweep { job }
            | Timer::Collective { job, .. }
            | Timer::Lease { job, .. }
            | Timer::JobIdle { job } => *job,
        };
        let Some(job) = self.jobs.get_mut(&job_id) else { return };
        let mut ctx = Ctx { job: job_id, now, out: &mut self.outgoing, timers: &mut self.timers };
        match timer {
            Timer::KeyWait { session, request_id, .. } => {
                if let Some(reply) = job.store.expire((session, request_id), now) {
                    ctx.out.push(Outgoing { session, request_id, reply });
                }
            }
            Timer::StallSweep { .. } => {
                if job.stall_sweep_at != Some(at) {
                    return;
                }
                job.stall_sweep_at = torch::sweep_stalls(job, &self.sessions, now, &mut self.notices);
                if let Some(next) = job.stall_sweep_at {
                    self.timers.schedule(next, Timer::StallSweep { job: job_id });
                }
            }
            Timer::Collective { kind, name, generation, .. } => {
                job.collectives.deadline(kind, &name, generation, at, &job.ranks, &mut ctx);
            }
            Timer::Lease { rank, .. } => {
                let change = job.ranks.lease_check(rank, now, self.config.lease_ms);
                job.apply(rank, change, &mut ctx);
            }
            Timer::JobIdle { .. } => {
                let expires = job.idle_since.saturating_add(self.config.job_idle_ttl_ms);
                if job.sessions == 0 && expires <= now {
                    let name = job.name.clone();
                    self.jobs.remove(&job_id);
                    self.job_ids.remove(&name);
                }
            }
        }
    }
}

/// Answers a get/wait/multi-get now, or blocks it with a deadline. A timeout of 0
/// fails at once if the keys are missing.
fn key_wait(
    job: &mut Job,
    ctx: &mut Ctx<'_>,
    id: (SessionId, u64),
    kind: WaitKind,
    keys: Vec<bytes::Bytes>,
    timeout_ms: Option<u64>,
    torch: bool,
) -> Option<Reply> {
    match job.store.wait_or_reply(id, kind, keys, ctx.now) {
        Err(error) => Some(Err(error)),
        Ok(Some(reply)) => Some(reply),
        Ok(None) if timeout_ms == Some(0) => job.store.expire(id, ctx.now),
        Ok(None) => {
            schedule_wait_timers(job, ctx, id, timeout_ms, torch);
            None
        }
    }
}

/// A blocked wait's deadline, and for a torch session the job's stall sweep.
fn schedule_wait_timers(job: &mut Job, ctx: &mut Ctx<'_>, id: (SessionId, u64), timeout_ms: Option<u64>, torch: bool) {
    let (session, request_id) = id;
    if let Some(timeout) = timeout_ms {
        ctx.timers.schedule(ctx.now.saturating_add(timeout), Timer::KeyWait { job: job.id, session, request_id });
    }
    let report_at = ctx.now.saturating_add(torch::STALL_REPORT_MS);
    if torch && job.stall_sweep_at.is_none_or(|at| at > report_at) {
        ctx.timers.schedule(report_at, Timer::StallSweep { job: job.id });
        job.stall_sweep_at = Some(report_at);
    }
}

/// Checks that the caller may take part as it asks, and normalises its member set.
#[allow(clippy::too_many_arguments)]
fn collective_call(
    identity: &Identity,
    (session, request_id): (SessionId, u64),
    ranks: &ranks::Ranks,
    kind: CollectiveKind,
    name: &str,
    members: Members,
    root: Option<u32>,
    value: bytes::Bytes,
    timeout_ms: Option<u64>,
) -> Result<Call, OpError> {
    let (Some(rank), Some(world_size)) = (identity.rank, identity.world_size) else {
        return Err(OpError::NoRank { op: format!("{kind} '{name}'") });
    };
    let members = validate::members(kind, name, rank, world_size, &identity.role, members, root, ranks)?;
    Ok(Call { session, request_id, rank, world_size, members, value, root, timeout_ms })
}
