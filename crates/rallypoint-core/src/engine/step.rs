//! One step of one job: what a session opening or closing, a request, or a timer
//! does to it.
//!
//! The engine finds the job and lends it here with the rest of its state
//! (`Engine::step` is the one place that splits the engine into these borrows);
//! a request is then dispatched by `Step::apply`, a table with one call per request.

use bytes::Bytes;

use crate::snapshot::RankSummary;
use crate::{
    AbortInfo, CollectiveKind, Config, Exit, Identity, Incarnation, Members, Millis, Missing, OpError, ProcessInfo,
    Reply, Request, Response, SessionId,
};

use crate::counters;
use crate::error::{Secs, Utc};
use crate::ranges::{runs, split};

use super::collective::{Call, CollectiveAt, Ctx, Held, Link, RunCall};
use super::job::Job;
use super::store::{Integer, WaitId, WaitKind};
use super::timers::Timer;
use super::{resume, torch, validate, Hots, Session, Sessions};

/// A job and everything a change of it may touch, borrowed apart from the engine.
pub(crate) struct Step<'a> {
    pub job: &'a mut Job,
    /// Where the job's replies and timers go, and the time.
    pub ctx: Ctx<'a>,
    pub sessions: &'a mut Sessions,
    /// What held runs read of their sessions (see `engine::Hot`).
    pub hot: &'a mut Hots,
    pub config: &'a Config,
    pub notices: &'a mut Vec<String>,
}

/// Who sent the request being handled.
pub(crate) struct Caller {
    pub session: SessionId,
    pub request_id: u64,
    pub rank: Option<u32>,
    pub world_size: Option<u32>,
    /// A PyTorch TCPStore session (module `torch`).
    pub torch: bool,
    /// How the request is kept in the session's replies (module `resume`).
    pub keep: Keep,
    /// A barrier call of a node agent's run, held in its link's record (see
    /// `collective::Record`).
    pub held: Option<Held>,
}

/// How a caller's request is kept in its session's replies (module `resume`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Keep {
    /// Not kept: the session cannot resume, or the request changes nothing.
    No,
    /// Kept, waiting for its reply, since its gate (`Engine::gate`).
    Waiting,
    /// To be kept when it runs: a call of a run outside any resend window, whose
    /// session's replies are then touched once, not at its gate and again when it
    /// waits.
    OnArrival,
    /// A call held in a record (see `collective::Record`): kept there, not in the
    /// session's replies, unless it is answered as it arrives (then as
    /// [`Keep::OnArrival`]). The session only notes the highest such request, so
    /// that a copy of one that nothing kept any more is not run again.
    InRecord,
}

impl Caller {
    /// Request `request_id` of session `id`, which is `session`.
    pub fn of(id: SessionId, session: &Session, request_id: u64) -> Caller {
        let (rank, world_size) = (session.identity.rank, session.identity.world_size);
        Caller { session: id, request_id, rank, world_size, torch: session.torch, keep: Keep::No, held: None }
    }

    fn wait_id(&self) -> WaitId {
        (self.session, self.request_id)
    }
}

/// A collective call as the request states it, before it is checked.
struct Joining<'r> {
    kind: CollectiveKind,
    name: &'r str,
    members: &'r Members,
    root: Option<u32>,
    value: Bytes,
    timeout_ms: Option<u64>,
}

impl<'a> Step<'a> {
    pub fn new(
        job: &'a mut Job,
        ctx: Ctx<'a>,
        sessions: &'a mut Sessions,
        hot: &'a mut Hots,
        config: &'a Config,
        notices: &'a mut Vec<String>,
    ) -> Self {
        Step { job, ctx, sessions, hot, config, notices }
    }

    /// Session `id` of the job opened with `identity`.
    pub fn open(&mut self, id: SessionId, identity: &Identity) {
        self.job.sessions += 1;
        // A rank connecting is the job at work; a tool (`rallypoint status`) is not.
        if identity.rank.is_some() {
            self.job.last_request = self.ctx.now;
        }
        if let Some(world_size) = identity.world_size {
            self.job.world_size = Some(self.job.world_size.map_or(world_size, |w| w.max(world_size)));
        }
        if let Some(rank) = identity.rank {
            let lease_ms = self.config.lease_ms;
            let claim = identity.incarnation.map(|incarnation| (id, incarnation));
            self.connect(rank, &identity.host, identity.pid, identity.role.as_deref(), lease_ms, claim);
        }
    }

    /// A session of `rank` connected (or was attributed that rank); `claim`: the
    /// session and its process, if it holds the rank by incarnation.
    pub fn connect(
        &mut self,
        rank: u32,
        host: &str,
        pid: u32,
        role: Option<&str>,
        lease_ms: u64,
        claim: Option<(SessionId, u64)>,
    ) {
        let change = self.job.ranks.connect(rank, host, pid, role, self.ctx.now, lease_ms, claim);
        self.job.apply(rank, change, &mut self.ctx);
        self.job.collectives.rank_connected(&self.job.ranks, &mut self.ctx);
    }

    /// `rank` showed a sign of life.
    pub fn touch(&mut self, rank: u32, lease_ms: u64) {
        let change = self.job.ranks.touch(rank, self.ctx.now, lease_ms);
        self.job.apply(rank, change, &mut self.ctx);
    }

    /// The session `id` closed; `session` is what it was.
    pub fn close(&mut self, id: SessionId, session: &Session) {
        self.job.store.drop_session(id);
        self.job.sessions = self.job.sessions.saturating_sub(1);
        if let Some(rank) = session.identity.rank {
            let change = self.job.ranks.disconnect(rank, id, session.leaving, self.ctx.now);
            self.job.apply(rank, change, &mut self.ctx);
        }
        let ttl = self.config.job_idle_ttl_ms;
        if self.job.sessions == 0 && ttl > 0 {
            self.job.idle_since = self.ctx.now;
            // A job that holds nothing (a tool's look at a mistyped name) is forgotten
            // at once, so that it is not listed in the metrics for a whole ttl.
            let ttl = if self.job.holds_nothing() { 0 } else { ttl };
            self.ctx.timers.schedule(self.ctx.now.saturating_add(ttl), Timer::JobIdle { job: self.job.id });
        }
    }

    /// A timer of the job came due (it was set for `at`). Returns whether the job has
    /// been idle for its whole time to live, so that the engine forgets it.
    pub fn fire(&mut self, at: Millis, timer: Timer) -> bool {
        match timer {
            Timer::KeyWait { session, request_id, .. } => self.expire_wait((session, request_id)),
            Timer::StallSweep { .. } => self.sweep_stalls(at),
            Timer::Collective(deadline) => self.job.collectives.deadline(&deadline, at, &self.job.ranks, &mut self.ctx),
            Timer::Lease { rank, .. } => self.lease_check(rank),
            Timer::JobIdle { .. } => return self.idle_expired(),
            // The engine ends a session's grace itself (the session is its); never routed here.
            Timer::Grace { .. } => {}
        }
        false
    }

    fn lease_check(&mut self, rank: u32) {
        let change = self.job.ranks.lease_check(rank, self.ctx.now, self.config.lease_ms);
        self.job.apply(rank, change, &mut self.ctx);
    }

    fn idle_expired(&self) -> bool {
        let ttl = if self.job.holds_nothing() { 0 } else { self.config.job_idle_ttl_ms };
        self.job.sessions == 0 && self.job.idle_since.saturating_add(ttl) <= self.ctx.now
    }

    fn expire_wait(&mut self, id: WaitId) {
        if let Some(reply) = self.job.store.expire(id, self.ctx.now) {
            self.ctx.reply(id, reply);
        }
    }

    /// The job's stall sweep came due, if `at` is still when it is due.
    fn sweep_stalls(&mut self, at: Millis) {
        if self.job.stall_sweep_at != Some(at) {
            return;
        }
        self.job.stall_sweep_at =
            torch::sweep_stalls(self.job, self.sessions, self.ctx.now, self.notices, self.ctx.out);
        if let Some(next) = self.job.stall_sweep_at {
            self.ctx.timers.schedule(next, Timer::StallSweep { job: self.job.id });
        }
    }

    /// Handles one request; its reply, now or later, goes to the context.
    pub fn request(&mut self, caller: Caller, request: Request) {
        self.seen(&caller);
        if !matches!(
            request,
            Request::Heartbeat
                | Request::Leave
                | Request::Abandon
                | Request::Status
                | Request::Jobs
                | Request::Snapshot
        ) {
            self.job.last_request = self.ctx.now;
        }
        self.job.store.now = self.ctx.now;
        if let Some(op) = counters::kv_op(request.name()) {
            self.job.kv_ops[op] += 1;
        }
        let reply = match self.admit(&request) {
            Ok(()) => self.apply(&caller, request),
            Err(error) => Some(Err(error)),
        };
        if let Some(reply) = reply {
            self.ctx.reply(caller.wait_id(), reply);
        }
    }

    /// A request is a sign of life of the caller's rank.
    fn seen(&mut self, caller: &Caller) {
        if let Some(rank) = caller.rank {
            // Torch clients never heartbeat: their ranks live by their connections alone.
            let lease_ms = if caller.torch { 0 } else { self.config.lease_ms };
            self.touch(rank, lease_ms);
        }
    }

    /// The same collective call made by several sessions of this job, in order (a
    /// node agent's ranks at one barrier): each caller is handled as by
    /// [`Step::request`], with what does not depend on the caller checked once.
    pub fn calls(&mut self, callers: impl Iterator<Item = Caller>, request: &Request) {
        let admitted = self.admit(request);
        self.job.store.now = self.ctx.now;
        // Found at the first call that gets that far, then shared by the rest.
        let mut at = None;
        // A call of the whole job has nothing to check but the caller's rank: it is
        // built from the request once, and only the caller's part is filled in per call.
        let mut world = admitted.is_ok().then(|| WorldCall::of(request)).flatten();
        for caller in callers {
            self.seen(&caller);
            self.job.last_request = self.ctx.now;
            let reply = match (&admitted, &mut world) {
                (Ok(()), Some(world)) => self.join_world(&caller, world, &mut at),
                (Ok(()), None) => self.collective(&caller, request, &mut at),
                (Err(error), _) => Some(Err(error.clone())),
            };
            if let Some(reply) = reply {
                self.keep(&caller, None);
                self.ctx.reply(caller.wait_id(), reply);
            }
        }
    }

    /// A node agent's held run of the whole-job barrier `request`, its calls gated
    /// with nothing to check before they run (`Engine::gate_held`), each handled as
    /// [`Step::calls`] would: those that join a generation already waiting are taken
    /// in bulk ([`super::collective::Collectives::hold_world`]), any other one alone.
    /// Each call's keep is [`Keep::InRecord`] or [`Keep::No`] (`keeps[i]`).
    pub fn hold_world(&mut self, calls: &[RunCall], keeps: &[Keep], request: &Request, link: Link) {
        let world = match (self.admit(request), request) {
            (Ok(()), Request::Barrier { name, members: Members::World, timeout_ms }) => Some((name, *timeout_ms)),
            _ => None,
        };
        let caller = |i: usize, c: &RunCall| Caller {
            session: c.session,
            request_id: c.request_id,
            rank: Some(c.rank),
            world_size: Some(c.world_size),
            torch: c.torch,
            keep: keeps.get(i).copied().unwrap_or(Keep::No),
            held: Some(Held { link, route: c.route, room: calls.len() - i }),
        };
        let Some((name, timeout_ms)) = world else {
            return self.calls(calls.iter().enumerate().map(|(i, c)| caller(i, c)), request);
        };
        if calls.is_empty() {
            return;
        }
        self.job.store.now = self.ctx.now;
        self.job.last_request = self.ctx.now;
        let Ok(at) = self.job.collectives.find(CollectiveKind::Barrier, name, &Members::World) else {
            // Refused: each call is told why.
            return self.calls(calls.iter().enumerate().map(|(i, c)| caller(i, c)), request);
        };
        let lease_ms = self.config.lease_ms;
        let mut i = 0;
        while i < calls.len() {
            let job = &mut *self.job;
            let shared = (link, timeout_ms);
            i = job.collectives.hold_world(at, calls, i, shared, &mut job.ranks, lease_ms, &mut self.ctx);
            if let Some(c) = calls.get(i) {
                self.calls(std::iter::once(caller(i, c)), request);
                i += 1;
            }
        }
    }

    /// Whether the job takes the request: a reset job fails everything but the
    /// requests that end the session, an aborted job everything but the requests
    /// about the session itself, and nothing invalid gets through.
    fn admit(&self, request: &Request) -> Result<(), OpError> {
        if matches!(request, Request::Heartbeat | Request::Leave | Request::Abandon | Request::Jobs) {
            return Ok(());
        }
        if let Some(error) = self.job.reset_error() {
            return Err(error);
        }
        if matches!(request, Request::Status) {
            return Ok(());
        }
        if let Some(error) = self.job.abort_error() {
            return Err(error);
        }
        validate::request(request, &self.config.limits)
    }

    /// Runs an admitted request. Returns its reply, or None if it waits (its reply
    /// comes when it is released or times out).
    fn apply(&mut self, caller: &Caller, request: Request) -> Option<Reply> {
        // The store answers the key waits a request completes into `out`, ahead of
        // the request's own reply.
        let (store, out) = (&mut self.job.store, &mut *self.ctx.out);
        match request {
            Request::Heartbeat => DONE,
            Request::Leave => self.leave(caller),
            Request::Abandon => self.abandon(caller),
            Request::Status => value(self.status(caller).into()),
            // Answered by the engine, which sees every job and session.
            Request::Jobs | Request::Snapshot => None,
            Request::Set { key, value } => self.set(key, value),
            Request::Append { key, value } => self.append(key, value),
            Request::MultiSet { entries } => self.multi_set(entries),
            Request::Add { key, delta } => {
                Some(store.add(key, delta, Integer::of(caller.torch), out).map(Response::Int))
            }
            Request::CompareSet { key, expected, desired } => value(store.compare_set(key, expected, desired, out)),
            Request::Delete { key } => boolean(store.delete(&key)),
            Request::Check { keys } => boolean(store.all_exist(&keys)),
            Request::NumKeys => int(i64::try_from(store.len()).unwrap_or(i64::MAX)),
            Request::ListKeys { prefix } => Some(Ok(Response::Values(store.list(&prefix)))),
            Request::QueuePush { key, value } => self.queue_push(key, value),
            Request::QueuePop { key } => popped(store.queue_pop(&key)),
            Request::QueueLen { key } => int(store.queue_len(&key)),
            Request::CancelWait => self.cancel_wait(caller),
            Request::Get { key, timeout_ms } => self.key_wait(caller, WaitKind::Get, vec![key], timeout_ms),
            Request::Wait { keys, timeout_ms } => self.key_wait(caller, WaitKind::Wait, keys, timeout_ms),
            Request::MultiGet { keys, timeout_ms } => self.key_wait(caller, WaitKind::MultiGet, keys, timeout_ms),
            Request::StoreBarrier { key, world_size, timeout_ms } => {
                self.store_barrier(caller, key, world_size, timeout_ms)
            }
            Request::Barrier { .. } | Request::AllGather { .. } | Request::Broadcast { .. } => {
                self.collective(caller, &request, &mut None)
            }
            Request::Abort { reason } => self.abort(caller, reason),
            Request::RankExited { rank, host, pid, exit } => self.rank_exited(rank, &host, pid, exit),
            // The engine resets a job itself (it makes a new one); never routed here.
            Request::Reset { .. } => Some(Err(OpError::Invalid("reset is handled by the engine".into()))),
        }
    }

    /// The session is about to close cleanly: its rank will have left, not died.
    fn leave(&mut self, caller: &Caller) -> Option<Reply> {
        if let Some(session) = self.sessions.get_mut(&caller.session) {
            session.leaving = true;
        }
        DONE
    }

    /// The client gave the session up: its close will be a loss at once.
    fn abandon(&mut self, caller: &Caller) -> Option<Reply> {
        if let Some(session) = self.sessions.get_mut(&caller.session) {
            session.abandoned = true;
        }
        DONE
    }

    fn set(&mut self, key: Bytes, value: Bytes) -> Option<Reply> {
        self.job.store.set(key, value, self.ctx.out);
        DONE
    }

    fn append(&mut self, key: Bytes, value: Bytes) -> Option<Reply> {
        self.job.store.append(key, &value, self.ctx.out);
        DONE
    }

    fn multi_set(&mut self, entries: Vec<(Bytes, Bytes)>) -> Option<Reply> {
        for (key, value) in entries {
            self.job.store.set(key, value, self.ctx.out);
        }
        DONE
    }

    fn queue_push(&mut self, key: Bytes, value: Bytes) -> Option<Reply> {
        self.job.store.queue_push(key, value, self.ctx.out);
        DONE
    }

    fn cancel_wait(&mut self, caller: &Caller) -> Option<Reply> {
        self.job.store.cancel_session(caller.session, self.ctx.out);
        DONE
    }

    /// The job's status report (see `Request::Status`): its torch processes, ranks,
    /// blocked collectives and lost ranks, as seen by everyone but the caller.
    fn status(&self, caller: &Caller) -> String {
        let (job, now) = (&*self.job, self.ctx.now);
        let mut others: Vec<(SessionId, &Identity, bool)> = self
            .sessions
            .iter()
            .filter(|(id, s)| s.job == job.id && **id != caller.session)
            .map(|(id, s)| (*id, &s.identity, s.torch))
            .collect();
        others.sort_by_key(|(id, _, _)| *id);
        let mut out = torch::report(job, &others, now, self.config.epoch_unix_ms.saturating_add(now));
        // Said before its ranks and collectives: every operation of the job fails with it.
        if let Some(by) = &job.aborted {
            out.push_str(&format!("aborted by {by}\n"));
        }
        // Which attempt this is: after a reset, every report before it speaks of another.
        // The process is named without its own incarnation, which here would read as
        // another of the job's.
        if let Some(at) = &job.incarnation {
            let how = if at.reset { "reset to it" } else { "named" };
            let by = ProcessInfo { incarnation: None, ..at.by.clone() };
            out.push_str(&format!(
                "incarnation {} ({how} by {by} at {})\n",
                Incarnation(at.incarnation),
                Utc(at.since_unix_ms)
            ));
        }
        let reconnecting = resume::reconnecting(job, self.sessions, self.config.lease_ms, now);
        let RankSummary { connected, left, lost, finished, never_connected, .. } = super::snapshot::summary(job);
        let of_them = match reconnecting.len() {
            0 => String::new(),
            n => format!(" ({n} reconnecting)"),
        };
        out.push_str(&format!("ranks: {connected} connected{of_them}, {left} left cleanly, "));
        if finished > 0 {
            out.push_str(&format!("{finished} finished, "));
        }
        out.push_str(&format!("{lost} lost"));
        // Only where a world size was stated: a rank that never came is what a hang at
        // start waits for.
        if let (Some(world_size), 1..) = (job.world_size, never_connected) {
            out.push_str(&format!(", {never_connected} of {world_size} never connected"));
        }
        out.push('\n');
        for line in job.collectives.report(&job.ranks, now) {
            out.push_str(&line);
            out.push('\n');
        }
        for (&rank, r) in reconnecting.iter().take(Missing::NAMED) {
            let info = job.ranks.info(rank, now);
            let (host, pid) = (info.host.unwrap_or_default(), info.pid.unwrap_or_default());
            out.push_str(&format!(
                "reconnecting: rank {rank} (host {host}, pid {pid}): connection dropped {} ago, lost in {} unless it \
                 resumes\n",
                Secs(r.dropped_ms_ago),
                Secs(r.lost_in_ms)
            ));
        }
        let (_, rest) = split(runs(reconnecting.keys().copied()), Missing::NAMED);
        if !rest.is_empty() {
            out.push_str(&format!("reconnecting: and {} more: ranks {rest}\n", rest.count));
        }
        // Finished ranks are gone to their peers as lost ones are, but are told apart.
        let (done, gone): (Vec<u32>, Vec<u32>) = job.ranks.lost().partition(|&r| job.ranks.finished(r));
        let (named, rest) = split(runs(gone), Missing::NAMED);
        for rank in named {
            out.push_str(&format!("lost: {}\n", job.ranks.info(rank, now)));
        }
        if !rest.is_empty() {
            out.push_str(&format!("lost: and {} more: ranks {rest}\n", rest.count));
        }
        // Requests of native sessions blocked on keys, oldest first (a TCPStore
        // client's are among the torch lines above).
        let native: super::HashMap<SessionId, &Identity> =
            others.iter().filter(|(_, _, torch)| !torch).map(|(s, i, _)| (*s, *i)).collect();
        let mut waits: Vec<_> =
            job.store.waits().filter_map(|((s, _), wait)| Some((wait.started, *s, *native.get(s)?, wait))).collect();
        waits.sort_by_key(|(started, session, ..)| (*started, *session));
        for (_, session, identity, wait) in waits.iter().take(Missing::NAMED) {
            out.push_str(&torch::waiting_line(*session, identity, false, wait, now));
        }
        if let Some(more) = waits.len().checked_sub(Missing::NAMED).filter(|&n| n > 0) {
            out.push_str(&format!("waiting: and {more} more requests on keys\n"));
        }
        // Finished ranks by number only: at a job's end that is every rank.
        let (_, done) = split(runs(done), 0);
        if !done.is_empty() {
            let what = if done.count == 1 { "rank" } else { "ranks" };
            out.push_str(&format!("finished (worker exited with code 0): {what} {done}\n"));
        }
        out
    }

    fn abort(&mut self, caller: &Caller, reason: String) -> Option<Reply> {
        let identity = &self.sessions.get(&caller.session)?.identity;
        let reason = one_line(reason);
        let by = AbortInfo { by_rank: identity.rank, host: identity.host.clone(), pid: identity.pid, reason };
        self.job.abort(by, &mut self.ctx);
        DONE
    }

    fn rank_exited(&mut self, rank: u32, host: &str, pid: u32, exit: Exit) -> Option<Reply> {
        match self.job.world_size {
            Some(world_size) if rank >= world_size => {
                return Some(Err(OpError::Invalid(format!("rank {rank} is out of range for world size {world_size}"))));
            }
            Some(_) => {}
            // No rank said how many there are: none of its own connected, none waits.
            // A torch process's rank, known from its address key, still learns how
            // its process ended (finished rather than lost, once its connection drops).
            None if self.job.ranks.has_connected(rank) => {}
            None => return DONE,
        }
        let change = self.job.ranks.exited(rank, host, pid, exit, self.ctx.now);
        self.job.apply(rank, change, &mut self.ctx);
        // Torch waits for its address key end now, not at the next sweep.
        torch::fail_waits_for_rank(self.job, self.sessions, rank, self.ctx.now, self.ctx.out);
        DONE
    }

    /// Answers a get/wait/multi-get now, or blocks it with a deadline. A timeout of 0
    /// fails at once if the keys are missing.
    fn key_wait(
        &mut self,
        caller: &Caller,
        kind: WaitKind,
        keys: Vec<Bytes>,
        timeout_ms: Option<u64>,
    ) -> Option<Reply> {
        let id = caller.wait_id();
        match self.job.store.wait_or_reply(id, kind, keys, self.ctx.now) {
            Err(error) => Some(Err(error)),
            Ok(Some(reply)) => Some(reply),
            Ok(None) if timeout_ms == Some(0) => self.job.store.expire(id, self.ctx.now),
            Ok(None) => {
                if caller.torch {
                    torch::note_address_prefixes(self.job, id);
                }
                self.schedule_wait_timers(caller, timeout_ms);
                None
            }
        }
    }

    fn store_barrier(
        &mut self,
        caller: &Caller,
        key: Bytes,
        world_size: i64,
        timeout_ms: Option<u64>,
    ) -> Option<Reply> {
        match self.job.store.barrier(caller.wait_id(), key, world_size, self.ctx.now, self.ctx.out) {
            Err(error) => Some(Err(error)),
            Ok(Some(reply)) => Some(reply),
            Ok(None) => {
                self.schedule_wait_timers(caller, timeout_ms);
                None
            }
        }
    }

    /// A blocked wait's deadline, and for a torch session the job's stall sweep.
    fn schedule_wait_timers(&mut self, caller: &Caller, timeout_ms: Option<u64>) {
        let (job, now) = (self.job.id, self.ctx.now);
        if let Some(timeout) = timeout_ms {
            let (session, request_id) = caller.wait_id();
            self.ctx.timers.schedule(now.saturating_add(timeout), Timer::KeyWait { job, session, request_id });
        }
        let report_at = now.saturating_add(torch::STALL_REPORT_MS);
        if caller.torch && self.job.stall_sweep_at.is_none_or(|at| at > report_at) {
            self.ctx.timers.schedule(report_at, Timer::StallSweep { job });
            self.job.stall_sweep_at = Some(report_at);
        }
    }

    /// A collective call (barrier, all-gather, broadcast); None for any other request.
    /// `at`: where the collective is, once a call of the same request found it.
    fn collective(&mut self, caller: &Caller, request: &Request, at: &mut Option<CollectiveAt>) -> Option<Reply> {
        let joining = match request {
            Request::Barrier { name, members, timeout_ms } => {
                let kind = CollectiveKind::Barrier;
                Joining { kind, name, members, root: None, value: Bytes::new(), timeout_ms: *timeout_ms }
            }
            Request::AllGather { name, members, value, timeout_ms } => {
                let kind = CollectiveKind::AllGather;
                Joining { kind, name, members, root: None, value: value.clone(), timeout_ms: *timeout_ms }
            }
            // The root must bring the value, which the others' calls do not carry.
            Request::Broadcast { name, members, root, value, timeout_ms } => {
                let value = match (caller.rank == Some(*root), value) {
                    (true, None) => {
                        return Some(Err(OpError::Invalid(format!(
                            "broadcast '{name}': the root (rank {root}) must provide a value"
                        ))))
                    }
                    (true, Some(value)) => value.clone(),
                    (false, _) => Bytes::new(),
                };
                let kind = CollectiveKind::Broadcast;
                Joining { kind, name, members, root: Some(*root), value, timeout_ms: *timeout_ms }
            }
            _ => return None,
        };
        self.join(caller, joining, at)
    }

    /// Checks that the caller may take part as it asks, then has it arrive.
    fn join(&mut self, caller: &Caller, joining: Joining, at: &mut Option<CollectiveAt>) -> Option<Reply> {
        let Joining { kind, name, members, root, value, timeout_ms } = joining;
        let (Some(rank), Some(world_size)) = (caller.rank, caller.world_size) else {
            return no_rank(kind, name);
        };
        // Only a role's members depend on more of the caller than its rank.
        let role = match members {
            Members::Role(_) => &self.sessions.get(&caller.session)?.identity.role,
            _ => &None,
        };
        let ranks = &self.job.ranks;
        let members = match (members, root) {
            // What every barrier of a whole job asks: nothing to check or normalise.
            (Members::World, None) => Members::World,
            _ => match validate::members(kind, name, rank, world_size, role, members.clone(), root, ranks) {
                Ok(members) => members,
                Err(error) => return Some(Err(error)),
            },
        };
        let (session, request_id) = caller.wait_id();
        let held = caller.held;
        let mut call = Call { session, request_id, rank, world_size, members, value, root, timeout_ms, held };
        self.arrive(caller, at, (kind, name), &mut call)
    }

    /// Has `call` arrive in its collective (found at the first call of a run, `at`),
    /// and keeps it as the caller's keep says; the reply if the collective's name
    /// is refused.
    fn arrive(
        &mut self,
        caller: &Caller,
        at: &mut Option<CollectiveAt>,
        (kind, name): (CollectiveKind, &str),
        call: &mut Call,
    ) -> Option<Reply> {
        let at = match *at {
            Some(at) => at,
            None => match self.job.collectives.find(kind, name, &call.members) {
                Ok(found) => *at.insert(found),
                Err(error) => return Some(Err(error)),
            },
        };
        let waits = self.job.collectives.arrive(at, call, &self.job.ranks, &mut self.ctx);
        self.keep(caller, waits.map(|generation| (at, generation)));
        None
    }

    /// Keeps the caller's call in its session's replies as its [`Keep`] says: a
    /// barrier call that waits in generation `g` of the collective at `at`
    /// (`waits`: `(at, g)`) is read from there (module `resume`); one kept
    /// [`Keep::OnArrival`] that does not wait (its reply is made) is kept waiting for it.
    fn keep(&mut self, caller: &Caller, waits: Option<(CollectiveAt, u64)>) {
        if caller.keep == Keep::No || (caller.keep == Keep::Waiting && waits.is_none()) {
            return;
        }
        // Held in its record, which its gate noted (`Engine::gate_held`).
        if caller.keep == Keep::InRecord && waits.is_some() {
            return;
        }
        let Some(sess) = self.sessions.get_mut(&caller.session) else { return };
        let Some(resume) = sess.resume.as_deref_mut() else { return };
        let (collectives, settled, now, rank) = (&self.job.collectives, self.ctx.settled, self.ctx.now, caller.rank);
        let pending = |at, generation| !settled || collectives.is_pending(at, generation, rank);
        let (id, limits) = (caller.request_id, &self.config.reply_cache);
        super::track(self.ctx.tracked, &mut resume.kept, |kept| match (caller.keep, waits) {
            (Keep::OnArrival, Some((at, generation))) => {
                kept.arrived_called(id, (at.index(), generation), now, limits, &pending)
            }
            (Keep::OnArrival | Keep::InRecord, None) => kept.arrived(id, now, limits, &pending),
            (_, Some((at, generation))) => kept.called(id, at.index(), generation),
            (_, None) => {}
        });
    }

    /// [`Step::join`] for a call of the whole job in a run of calls (see [`WorldCall`]).
    fn join_world(
        &mut self,
        caller: &Caller,
        world: &mut WorldCall<'_>,
        at: &mut Option<CollectiveAt>,
    ) -> Option<Reply> {
        let WorldCall { kind, name, value, call } = world;
        let (Some(rank), Some(world_size)) = (caller.rank, caller.world_size) else {
            return no_rank(*kind, name);
        };
        (call.session, call.request_id, call.rank, call.world_size, call.held) =
            (caller.session, caller.request_id, rank, world_size, caller.held);
        call.value = value.clone();
        self.arrive(caller, at, (*kind, name), call)
    }
}

/// A barrier or all-gather of the whole job, as a run of calls makes it (a node
/// agent's ranks at one barrier): the same for every caller but for who calls.
struct WorldCall<'r> {
    kind: CollectiveKind,
    name: &'r str,
    /// Each caller's value: the request's.
    value: &'r Bytes,
    /// The call, reused from caller to caller.
    call: Call,
}

impl<'r> WorldCall<'r> {
    fn of(request: &'r Request) -> Option<Self> {
        let (kind, name, value, timeout_ms) = match request {
            Request::Barrier { name, members: Members::World, timeout_ms } => {
                (CollectiveKind::Barrier, name, &EMPTY, timeout_ms)
            }
            Request::AllGather { name, members: Members::World, value, timeout_ms } => {
                (CollectiveKind::AllGather, name, value, timeout_ms)
            }
            _ => return None,
        };
        let call = Call {
            session: SessionId(0),
            request_id: 0,
            rank: 0,
            world_size: 0,
            members: Members::World,
            value: Bytes::new(),
            root: None,
            timeout_ms: *timeout_ms,
            held: None,
        };
        Some(WorldCall { kind, name, value, call })
    }
}

/// A barrier's value.
static EMPTY: Bytes = Bytes::new();

/// The reply to a collective call of a session that has no rank.
fn no_rank(kind: CollectiveKind, name: &str) -> Option<Reply> {
    Some(Err(OpError::NoRank { op: format!("{kind} '{name}'") }))
}

/// The reply of a request that has nothing to return.
const DONE: Option<Reply> = Some(Ok(Response::Done));

fn value(value: Bytes) -> Option<Reply> {
    Some(Ok(Response::Value(value)))
}

fn int(n: i64) -> Option<Reply> {
    Some(Ok(Response::Int(n)))
}

fn boolean(b: bool) -> Option<Reply> {
    Some(Ok(Response::Bool(b)))
}

fn popped((len_before, value): (i64, Option<Bytes>)) -> Option<Reply> {
    Some(Ok(Response::Popped { len_before, value }))
}

/// An abort's reason as every rank's error and `status` show it: on one line, its
/// control characters (a traceback's newlines, a terminal's escapes) written out
/// rather than obeyed, and never empty. Not refused: an abort must happen.
fn one_line(reason: String) -> String {
    if reason.trim().is_empty() {
        return "(no reason given)".to_owned();
    }
    if !reason.chars().any(char::is_control) {
        return reason;
    }
    reason.chars().map(|c| if c.is_control() { c.escape_default().to_string() } else { c.to_string() }).collect()
}
