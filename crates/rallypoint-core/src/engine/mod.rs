//! The engine: owns every job and routes sessions' requests, disconnects and clock
//! ticks to them.

mod collective;
mod job;
mod members;
mod ranks;
mod step;
mod store;
mod timers;
mod torch;
mod validate;

use std::collections::BTreeSet;

use crate::{Config, Identity, Millis, OpError, Outgoing, RankInfo, Request, Response, SessionId, Welcome};

use collective::Ctx;
use job::Job;
use step::{Caller, Step};
use timers::Timers;

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
        let job_id = self.job_named(&identity.job, now);
        if let Some(mut step) = self.step(job_id, now) {
            step.open(&identity);
        }
        // The job keeps the name; a copy per session would only cost memory.
        identity.job = String::new();
        self.sessions.insert(session, Box::new(Session { job: job_id, identity, leaving: false, torch: false }));
        Ok(Welcome { session, lease_ms: self.config.lease_ms })
    }

    /// The id of the job called `name`, made now if there is none.
    fn job_named(&mut self, name: &str, now: Millis) -> JobId {
        if let Some(id) = self.job_ids.get(name) {
            return *id;
        }
        let id = self.next_job;
        self.next_job += 1;
        self.job_ids.insert(name.to_owned(), id);
        self.jobs.insert(id, Job::new(id, name.to_owned(), &self.config, now));
        id
    }

    /// Lends job `id` with the rest of the engine's state to one step of it: the one
    /// place where the engine is split into those borrows.
    fn step(&mut self, id: JobId, now: Millis) -> Option<Step<'_>> {
        let job = self.jobs.get_mut(&id)?;
        let ctx = Ctx { job: id, now, out: &mut self.outgoing, timers: &mut self.timers };
        Some(Step::new(job, ctx, &mut self.sessions, &self.config, &mut self.notices))
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
            step.connect(rank, &host, pid, None, 0);
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
        let lease_ms = self.config.lease_ms;
        if let Some(mut step) = self.step(sess.job, now) {
            step.touch(rank, lease_ms);
        }
    }

    /// Feeds one request. Its reply (now or later) appears in [`Engine::drain_outgoing`]
    /// tagged with `request_id`. Requests of unknown sessions are ignored.
    pub fn handle(&mut self, session: SessionId, request_id: u64, request: Request, now: Millis) {
        if let Some(rank) = self.revealed_rank(session, &request) {
            self.attribute(session, rank, now);
        }
        let Some(sess) = self.sessions.get(&session) else { return };
        if let Request::Jobs = request {
            let names = self.job_names(sess.job);
            self.outgoing.push(Outgoing { session, request_id, reply: Ok(Response::Values(names)) });
            return;
        }
        let caller = Caller { session, request_id, rank: sess.identity.rank, torch: sess.torch };
        if let Some(mut step) = self.step(sess.job, now) {
            step.request(caller, request);
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
                others > 0 || job.store.len() > 0 || job.ranks.ever_connected() > 0
            })
            .map(|job| job.name.as_str())
            .collect();
        names.sort_unstable();
        names.truncate(crate::MAX_JOBS_LISTED);
        names.into_iter().map(|name| bytes::Bytes::copy_from_slice(name.as_bytes())).collect()
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
        if let Some(mut step) = self.step(sess.job, now) {
            step.close(session, &sess);
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

    /// Advances time: fires timeouts and lease expiries due at or before `now`.
    pub fn tick(&mut self, now: Millis) {
        while let Some((at, timer)) = self.timers.pop_due(now) {
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

    /// Replies produced so far, in the order they were produced.
    pub fn drain_outgoing(&mut self) -> std::vec::Drain<'_, Outgoing> {
        self.outgoing.drain(..)
    }

    /// Drops an idle job: its keys, barriers and ranks.
    fn forget(&mut self, id: JobId) {
        if let Some(job) = self.jobs.remove(&id) {
            self.job_ids.remove(&job.name);
        }
    }
}
