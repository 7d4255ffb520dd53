//! The engine: owns all jobs and routes inputs to them.

use crate::{Config, Identity, Millis, OpError, Outgoing, Request, SessionId, Welcome};

pub struct Engine {
    config: Config,
    outgoing: Vec<Outgoing>,
}

impl Engine {
    pub fn new(config: Config) -> Self {
        Engine { config, outgoing: Vec::new() }
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Admits a session with its identity. An invalid identity (rank ≥ world size,
    /// world size 0, names too long) is refused and leaves no trace.
    pub fn open(&mut self, session: SessionId, identity: Identity, now: Millis) -> Result<Welcome, OpError> {
        let _ = (session, identity, now);
        todo!()
    }

    /// Feeds one request. Its reply (now or later) appears in [`Engine::drain_outgoing`]
    /// tagged with `request_id`. Requests of unknown sessions are ignored.
    pub fn handle(&mut self, session: SessionId, request_id: u64, request: Request, now: Millis) {
        let _ = (session, request_id, request, now);
        todo!()
    }

    /// The session's connection is gone. Without a preceding `Leave` request and if
    /// it was its rank's last session, the rank is lost.
    pub fn close(&mut self, session: SessionId, now: Millis) {
        let _ = (session, now);
        todo!()
    }

    /// Advances time: fires timeouts and lease expiries due at or before `now`.
    pub fn tick(&mut self, now: Millis) {
        let _ = now;
        todo!()
    }

    /// Earliest time at which `tick` has something to do.
    pub fn next_deadline(&self) -> Option<Millis> {
        todo!()
    }

    /// Replies produced so far, in the order they were produced.
    pub fn drain_outgoing(&mut self) -> std::vec::Drain<'_, Outgoing> {
        self.outgoing.drain(..)
    }
}
