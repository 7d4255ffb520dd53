//! A small driver around the engine for tests: sessions by rank, a manual clock,
//! and helpers to take the replies addressed to one request.
#![allow(dead_code)]

use std::collections::HashMap;

use bytes::Bytes;
use rallypoint_core::snapshot::JobSnapshot;
use rallypoint_core::{
    Config, Engine, Exit, Identity, Members, Millis, OpError, Outgoing, Reply, Request, Response, SessionId,
};

pub struct Harness {
    pub engine: Engine,
    pub now: Millis,
    next_session: u64,
    next_request: u64,
    /// Replies received so far, by (session, request id).
    pub replies: HashMap<(SessionId, u64), Reply>,
}

impl Harness {
    pub fn new() -> Self {
        Self::with_config(Config::default())
    }

    pub fn with_config(config: Config) -> Self {
        Harness { engine: Engine::new(config), now: 1_000, next_session: 1, next_request: 1, replies: HashMap::new() }
    }

    pub fn open(&mut self, identity: Identity) -> SessionId {
        let id = SessionId(self.next_session);
        self.next_session += 1;
        self.engine.open(id, identity, self.now).expect("identity accepted");
        self.collect();
        id
    }

    /// A session of `rank` in `job` with a recognisable host and pid.
    pub fn rank(&mut self, job: &str, rank: u32, world: u32) -> SessionId {
        let mut identity = Identity::ranked(job, rank, world);
        identity.host = format!("node{rank}");
        identity.pid = 1000 + rank;
        self.open(identity)
    }

    pub fn role_rank(&mut self, job: &str, rank: u32, world: u32, role: &str) -> SessionId {
        let mut identity = Identity::ranked(job, rank, world);
        identity.host = format!("node{rank}");
        identity.pid = 1000 + rank;
        identity.role = Some(role.into());
        self.open(identity)
    }

    /// Sends a request and returns its id; the reply, if any yet, is in `replies`.
    pub fn send(&mut self, session: SessionId, request: Request) -> u64 {
        let id = self.next_request;
        self.next_request += 1;
        self.engine.handle(session, id, request, self.now);
        self.collect();
        id
    }

    /// Sends a request that must be answered at once, and returns the answer.
    pub fn call(&mut self, session: SessionId, request: Request) -> Reply {
        let id = self.send(session, request.clone());
        self.take(session, id).unwrap_or_else(|| panic!("no immediate reply to {request:?}"))
    }

    pub fn take(&mut self, session: SessionId, id: u64) -> Option<Reply> {
        self.replies.remove(&(session, id))
    }

    pub fn pending(&self, session: SessionId, id: u64) -> bool {
        !self.replies.contains_key(&(session, id))
    }

    pub fn leave(&mut self, session: SessionId) {
        let _ = self.call(session, Request::Leave);
        self.engine.close(session, self.now);
        self.collect();
    }

    pub fn kill(&mut self, session: SessionId) {
        self.engine.close(session, self.now);
        self.collect();
    }

    /// Job `job` as data, as a tool's session asks for it (`rallypoint status --json`).
    pub fn snapshot(&mut self, job: &str) -> JobSnapshot {
        let tool = self.open(Identity::anonymous(job));
        let Response::Value(json) = ok(Some(self.call(tool, Request::Snapshot))) else {
            panic!("a snapshot is a value")
        };
        self.leave(tool);
        serde_json::from_slice(&json).expect("the snapshot is JSON of its schema")
    }

    /// What a launcher that saw rank `rank`'s worker (process `pid` on `host`) end
    /// says of it, from a session of its own.
    pub fn report_exit(&mut self, job: &str, rank: u32, host: &str, pid: u32, exit: Exit) -> Reply {
        let launcher = self.open(Identity::anonymous(job));
        let reply = self.call(launcher, Request::RankExited { rank, host: host.to_owned(), pid, exit });
        self.leave(launcher);
        reply
    }

    pub fn advance(&mut self, ms: Millis) {
        self.now += ms;
        self.engine.tick(self.now);
        self.collect();
    }

    fn collect(&mut self) {
        let out: Vec<Outgoing> = self.engine.drain_outgoing().collect();
        for o in out {
            let previous = self.replies.insert((o.session, o.request_id), o.reply);
            assert!(previous.is_none(), "two replies to request {} of {:?}", o.request_id, o.session);
        }
    }
}

pub fn b(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

pub fn barrier(name: &str, timeout_ms: Option<u64>) -> Request {
    Request::Barrier { name: name.into(), members: Members::World, timeout_ms }
}

pub fn barrier_of(name: &str, members: Members, timeout_ms: Option<u64>) -> Request {
    Request::Barrier { name: name.into(), members, timeout_ms }
}

pub fn ok(reply: Option<Reply>) -> Response {
    match reply {
        Some(Ok(r)) => r,
        other => panic!("expected a success, got {other:?}"),
    }
}

pub fn err(reply: Option<Reply>) -> OpError {
    match reply {
        Some(Err(e)) => e,
        other => panic!("expected an error, got {other:?}"),
    }
}
