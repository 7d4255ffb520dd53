use bytes::Bytes;
use rallypoint_core::{
    Config, Departure, Engine, Identity, Link, LossReason, Members, Millis, OpError, Outgoing, RankState, Reply,
    Request, Response, SessionId,
};

/// 2026-11-21T12:00:00Z, so that errors show readable times.
const EPOCH: u64 = 1_795_262_400_000;

/// A driver that keeps every reply, duplicates included (a resumed session may get
/// a reply again on purpose), and lets tests choose request ids (re-sent requests
/// keep theirs).
struct Driver {
    engine: Engine,
    now: Millis,
    next_session: u64,
    replies: Vec<Outgoing>,
    /// Request ids of status calls: apart from those the tests number themselves.
    status_ids: u64,
}

impl Driver {
    fn new() -> Self {
        Driver::with(Config { epoch_unix_ms: EPOCH, ..Config::default() })
    }

    fn with(config: Config) -> Self {
        Driver { engine: Engine::new(config), now: 1_000, next_session: 1, replies: Vec::new(), status_ids: 1 << 32 }
    }

    fn open(&mut self, identity: Identity) -> Result<SessionId, OpError> {
        let id = SessionId(self.next_session);
        self.next_session += 1;
        let opened = self.engine.open(id, identity, self.now);
        self.collect();
        opened.map(|welcome| welcome.session)
    }

    fn session(&mut self, identity: Identity) -> SessionId {
        self.open(identity).expect("admitted")
    }

    /// Sends one request; with `HELD`, a barrier goes as a node agent's run of one
    /// call (held in a record, see `Engine::handle_calls_from`).
    fn send(&mut self, session: SessionId, id: u64, request: Request) {
        if HELD && matches!(request, Request::Barrier { .. }) {
            return self.send_together(&[(session, id)], request);
        }
        self.engine.handle(session, id, request, self.now);
        self.collect();
    }

    /// The same barrier call of several sessions, as a node agent's run (held in a
    /// record with `HELD`, else one call after another).
    fn send_together(&mut self, calls: &[(SessionId, u64)], request: Request) {
        if HELD {
            let routes: Vec<u64> = calls.iter().map(|(session, _)| session.0).collect();
            self.engine.handle_calls_from(Link { id: 1, stamp: 0 }, calls, &routes, &request, self.now);
        } else {
            for &(session, id) in calls {
                self.engine.handle(session, id, request.clone(), self.now);
            }
        }
        self.collect();
    }

    fn call(&mut self, session: SessionId, id: u64, request: Request) -> Reply {
        self.send(session, id, request);
        self.last(session, id).expect("an immediate reply")
    }

    /// The job's status report, as `tool` asks for it.
    fn status(&mut self, tool: SessionId) -> String {
        self.status_ids += 1;
        let id = self.status_ids;
        let reply = self.call(tool, id, Request::Status);
        let Ok(Response::Value(report)) = reply else { panic!("status is text: {reply:?}") };
        String::from_utf8_lossy(&report).into_owned()
    }

    fn resume(&mut self, session: SessionId, identity: &Identity) -> Result<SessionId, String> {
        let resumed = self.engine.resume(session, identity, self.now);
        self.collect();
        resumed.map(|welcome| welcome.session)
    }

    fn cut(&mut self, session: SessionId) {
        self.engine.close_with(session, Departure::Unknown, self.now);
        self.collect();
    }

    fn kill(&mut self, session: SessionId) {
        self.engine.close_with(session, Departure::ProcessGone, self.now);
        self.collect();
    }

    fn leave(&mut self, session: SessionId, id: u64) {
        assert_eq!(self.call(session, id, Request::Leave), Ok(Response::Done));
        self.engine.close(session, self.now);
        self.collect();
    }

    fn advance(&mut self, ms: Millis) {
        self.now += ms;
        self.engine.tick(self.now);
        self.collect();
    }

    /// Every reply made, a record's release as a `Done` to each of its calls.
    fn collect(&mut self) {
        self.replies.extend(self.engine.drain_outgoing());
        for record in self.engine.take_records() {
            let calls = record.sessions.iter().zip(&record.calls);
            self.replies.extend(calls.map(|(&session, &(route, request_id))| {
                assert_eq!(route, session.0, "a record keeps each call's route");
                Outgoing { session, request_id, reply: Ok(Response::Done) }
            }));
        }
    }

    /// Every reply to request `id` of `session`, in order.
    fn replies_to(&self, session: SessionId, id: u64) -> Vec<&Reply> {
        self.replies.iter().filter(|o| o.session == session && o.request_id == id).map(|o| &o.reply).collect()
    }

    /// `session` is cut, resumes as `identity` and re-sends request `id`: every
    /// reply to it, the first one included.
    fn resent_after_a_cut(&mut self, session: SessionId, identity: &Identity, id: u64, request: Request) -> Vec<Reply> {
        self.cut(session);
        assert_eq!(self.resume(session, identity), Ok(session));
        self.send(session, id, request);
        self.replies_to(session, id).into_iter().cloned().collect()
    }

    fn last(&self, session: SessionId, id: u64) -> Option<Reply> {
        self.replies_to(session, id).last().map(|r| (*r).clone())
    }
}

/// Rank `rank` of a world of `world` in job `job`, as process `pid` on `host` with incarnation `incarnation`.
fn process(job: &str, rank: u32, world: u32, pid: u32, host: &str, incarnation: u64) -> Identity {
    Identity { host: host.into(), pid, incarnation: Some(incarnation), ..Identity::ranked(job, rank, world) }
}

fn tool(job: &str, pid: u32, incarnation: u64) -> Identity {
    Identity { host: "shell".into(), pid, incarnation: Some(incarnation), ..Identity::anonymous(job) }
}

fn barrier(name: &str) -> Request {
    Request::Barrier { name: name.into(), members: Members::World, timeout_ms: None }
}

fn add(n: i64) -> Request {
    Request::Add { key: b("n"), delta: n }
}

fn b(s: &str) -> Bytes {
    Bytes::copy_from_slice(s.as_bytes())
}

#[test]
fn a_second_claimant_of_a_live_rank_is_refused_naming_both_processes() {
    let mut d = Driver::new();
    d.now = 1_000; // 12:00:01
    let _holder = d.session(process("j", 1, 2, 311, "a", 0x3f2a));
    d.now = 181_000;
    let refused = d.open(process("j", 1, 2, 977, "b", 0x9c1b)).expect_err("refused");
    let OpError::RankHeld { rank, holder, since_unix_ms, claimant } = &refused else { panic!("{refused:?}") };
    assert_eq!((*rank, holder.pid, holder.host.as_str(), holder.incarnation), (1, 311, "a", Some(0x3f2a)));
    assert_eq!((claimant.pid, claimant.incarnation), (977, Some(0x9c1b)));
    assert_eq!(*since_unix_ms, EPOCH + 1_000);
    assert_eq!(
        refused.to_string(),
        "rank 1 is held by pid 311 on host a (incarnation 0000000000003f2a) since 2026-11-21T12:00:01Z; this \
         process is pid 977 on host b (incarnation 0000000000009c1b)"
    );
    assert!(refused.is_incarnation_refusal());
    // The refusal left no trace: rank 0 and the holder meet at a barrier.
    let r0 = d.session(process("j", 0, 2, 300, "a", 0x1));
    d.send(r0, 1, barrier("b"));
    assert!(d.replies_to(r0, 1).is_empty(), "released early by a refused claimant");
}

#[test]
fn several_sessions_of_one_process_share_its_rank() {
    let mut d = Driver::new();
    let first = d.session(process("j", 0, 1, 10, "a", 7));
    let second = d.session(process("j", 0, 1, 10, "a", 7));
    assert_eq!(d.call(first, 1, barrier("b")), Ok(Response::Done));
    assert_eq!(d.call(second, 1, barrier("b")), Ok(Response::Done), "generation 2, same rank");
    // A session without incarnation (a TCPStore client, an old tool) is not refused either.
    assert!(d.open(Identity { host: "a".into(), pid: 11, ..Identity::ranked("j", 0, 1) }).is_ok());
}

#[test]
fn a_rank_that_left_is_taken_over_and_the_old_process_is_refused_by_name() {
    let mut d = Driver::new();
    let old = d.session(process("j", 1, 2, 311, "a", 0xa));
    d.leave(old, 1);
    d.now = 190_000; // 12:03:10
    let new = d.session(process("j", 1, 2, 977, "b", 0xb));
    let back = d.open(process("j", 1, 2, 311, "a", 0xa)).expect_err("refused");
    assert_eq!(
        back.to_string(),
        "rank 1 was taken over by pid 977 on host b (incarnation 000000000000000b) at 2026-11-21T12:03:10Z; this \
         process (pid 311 on host a (incarnation 000000000000000a)) no longer holds it"
    );
    // The new holder works as rank 1.
    let r0 = d.session(process("j", 0, 2, 300, "a", 0x1));
    d.send(r0, 1, barrier("b"));
    assert_eq!(d.call(new, 1, barrier("b")), Ok(Response::Done));
    assert_eq!(d.last(r0, 1), Some(Ok(Response::Done)));
}

/// `for step in ...; do rallypoint barrier step; done`: each process leaves and exits,
/// and the next may arrive before the coordinator saw the connection of the last one
/// close. A rank whose sessions all said Leave is free, and their late close is not a loss.
#[test]
fn a_process_that_said_leave_does_not_hold_its_rank_while_its_connection_closes() {
    let mut d = Driver::new();
    let r0 = d.session(process("j", 0, 2, 300, "a", 0x1));
    let first = d.session(process("j", 1, 2, 400, "a", 0x2));
    d.send(r0, 1, barrier("step"));
    d.send(first, 1, barrier("step"));
    assert_eq!(d.call(first, 2, Request::Leave), Ok(Response::Done));
    // Not closed yet, and the next process is already there.
    let second = d.session(process("j", 1, 2, 401, "a", 0x3));
    d.engine.close(first, d.now);
    d.collect();
    d.send(r0, 2, barrier("step"));
    assert_eq!(d.call(second, 1, barrier("step")), Ok(Response::Done));
    assert_eq!(d.last(r0, 2), Some(Ok(Response::Done)), "rank 1 is neither lost nor doubled");
}

/// A process silent for a whole lease (hung, or cut off) loses its rank: a new process
/// takes it over even though the old connection is still open; the old process is
/// then told so, and its connection closing later costs the new holder nothing.
#[test]
fn a_hung_process_past_its_lease_is_taken_over_and_told_so() {
    let mut d = Driver::with(Config { lease_ms: 1_000, epoch_unix_ms: EPOCH, ..Config::default() });
    let r0 = d.session(process("j", 0, 2, 300, "a", 0x1));
    let hung = d.session(process("j", 1, 2, 311, "a", 0xa));
    d.send(hung, 1, Request::Get { key: b("never"), timeout_ms: None });
    let refused = d.open(process("j", 1, 2, 977, "b", 0xb)).expect_err("still live");
    assert!(matches!(refused, OpError::RankHeld { .. }), "{refused:?}");
    for _ in 0..3 {
        d.advance(400);
        d.call(r0, 100 + d.now, Request::Heartbeat).expect("heartbeat");
    }
    let new = d.session(process("j", 1, 2, 977, "b", 0xb));
    let waited = d.last(hung, 1).expect("the hung process's wait was failed");
    assert!(matches!(waited, Err(OpError::TakenOver { rank: 1, .. })), "{waited:?}");
    let later = d.call(hung, 2, Request::Set { key: b("k"), value: b("v") });
    assert!(matches!(later, Err(OpError::TakenOver { .. })), "{later:?}");
    d.kill(hung);
    d.send(r0, 1, barrier("b"));
    assert_eq!(d.call(new, 1, barrier("b")), Ok(Response::Done));
    assert_eq!(d.last(r0, 1), Some(Ok(Response::Done)), "the old connection's close lost nothing");
}

#[test]
fn a_process_that_took_a_lost_rank_on_is_told_of_its_predecessor_as_a_peer() {
    let mut d = Driver::with(Config { epoch_unix_ms: EPOCH, ..Config::default() });
    let r0 = d.session(process("j", 0, 2, 300, "a", 0x1));
    // Same host and pid (a fresh pid namespace), another process.
    let first = d.session(process("j", 1, 2, 7, "a", 0xa));
    d.send(r0, 1, barrier("b"));
    d.kill(first);
    assert!(matches!(d.last(r0, 1), Some(Err(OpError::PeerLost { .. }))));
    d.advance(100);
    let next = d.session(process("j", 1, 2, 7, "a", 0xb));
    let told = d.call(next, 1, barrier("b"));
    assert!(matches!(&told, Err(OpError::PeerLost { peer, .. }) if peer.rank == 1), "{told:?}");
    // The ranks meet at the next generation.
    d.send(r0, 2, barrier("b"));
    assert_eq!(d.call(next, 2, barrier("b")), Ok(Response::Done));
}

#[test]
fn a_cut_connection_keeps_its_rank_for_the_grace_then_the_rank_is_lost() {
    let mut d = Driver::new();
    let r0 = d.session(process("j", 0, 2, 300, "a", 0x1));
    let r1 = d.session(process("j", 1, 2, 311, "b", 0x2));
    d.send(r0, 1, barrier("b"));
    d.cut(r1);
    d.advance(999);
    assert!(d.replies_to(r0, 1).is_empty(), "lost before the grace ended");
    // Meanwhile nobody else may claim rank 1.
    assert!(matches!(d.open(process("j", 1, 2, 977, "c", 0x3)), Err(OpError::RankHeld { .. })));
    d.advance(1);
    let Some(Err(OpError::PeerLost { peer, .. })) = d.last(r0, 1) else { panic!("{:?}", d.last(r0, 1)) };
    assert_eq!((peer.rank, peer.state), (1, RankState::Lost(LossReason::Disconnected)));
    // Gone for good: a resume is refused, and a new process may take the rank.
    let refused = d.resume(r1, &process("j", 1, 2, 311, "b", 0x2)).expect_err("closed");
    assert!(refused.contains("closed"), "{refused}");
    assert!(d.open(process("j", 1, 2, 977, "c", 0x3)).is_ok());
}

#[test]
fn a_process_known_gone_is_lost_at_once_and_so_is_one_found_gone_during_its_grace() {
    let mut d = Driver::new();
    let r0 = d.session(process("j", 0, 3, 300, "a", 0x1));
    let r1 = d.session(process("j", 1, 3, 311, "a", 0x2));
    let r2 = d.session(process("j", 2, 3, 322, "a", 0x3));
    d.send(r0, 1, barrier("b"));
    d.kill(r1);
    assert!(matches!(d.last(r0, 1), Some(Err(OpError::PeerLost { ref peer, .. })) if peer.rank == 1));

    let without_1 = Request::Barrier { name: "c".into(), members: Members::Ranks(vec![0, 2]), timeout_ms: None };
    d.send(r0, 2, without_1);
    d.cut(r2);
    assert!(d.replies_to(r0, 2).is_empty());
    d.engine.process_gone(r2, d.now);
    d.collect();
    assert!(matches!(d.last(r0, 2), Some(Err(OpError::PeerLost { ref peer, .. })) if peer.rank == 2));
    assert!(d.resume(r2, &process("j", 2, 3, 322, "a", 0x3)).is_err());
}

/// A client dropped without a clean leave says so: its session gets no grace.
#[test]
fn an_abandoned_session_is_lost_at_once() {
    let mut d = Driver::new();
    let r0 = d.session(process("j", 0, 2, 300, "a", 0x1));
    let r1 = d.session(process("j", 1, 2, 311, "b", 0x2));
    d.send(r0, 1, barrier("b"));
    assert_eq!(d.call(r1, 1, Request::Abandon), Ok(Response::Done));
    assert!(d.replies_to(r0, 1).is_empty(), "abandoning is not leaving yet");
    d.cut(r1);
    assert!(matches!(d.last(r0, 1), Some(Err(OpError::PeerLost { ref peer, .. })) if peer.rank == 1));
}

#[test]
fn without_a_grace_or_an_incarnation_a_dropped_connection_is_a_loss_at_once() {
    let mut d = Driver::with(Config { reconnect_grace_ms: 0, ..Config::default() });
    let r0 = d.session(process("j", 0, 2, 300, "a", 0x1));
    let r1 = d.session(process("j", 1, 2, 311, "b", 0x2));
    d.send(r0, 1, barrier("b"));
    d.cut(r1);
    assert!(matches!(d.last(r0, 1), Some(Err(OpError::PeerLost { .. }))));

    let mut d = Driver::new();
    let r0 = d.session(process("j", 0, 2, 300, "a", 0x1));
    let legacy = d.session(Identity { host: "b".into(), pid: 311, ..Identity::ranked("j", 1, 2) });
    d.send(r0, 1, barrier("b"));
    d.cut(legacy);
    assert!(matches!(d.last(r0, 1), Some(Err(OpError::PeerLost { .. }))), "cannot resume: no grace");
}

/// Story 3 of issue 14: the connection is cut right after rank 1's barrier request,
/// the coordinator does not notice (half-open), rank 1 resumes on a new connection
/// and re-sends its request. It is one arrival, and rank 1's next call is generation 2.
#[test]
fn a_barrier_resent_on_a_resumed_half_open_session_counts_once() {
    let mut d = Driver::new();
    let id1 = process("j", 1, 2, 311, "b", 0x2);
    let r0 = d.session(process("j", 0, 2, 300, "a", 0x1));
    let r1 = d.session(id1.clone());
    d.send(r1, 1, barrier("step"));
    assert_eq!(d.resume(r1, &id1), Ok(r1));
    d.send(r1, 1, barrier("step"));
    d.send(r0, 1, barrier("step"));
    assert_eq!(d.replies_to(r1, 1), [&Ok(Response::Done)], "one arrival, one reply");
    assert_eq!(d.last(r0, 1), Some(Ok(Response::Done)));
    // Rank 0's step 2 waits for rank 1's step 2, not for a leftover of step 1.
    d.send(r0, 2, barrier("step"));
    assert!(d.replies_to(r0, 2).is_empty(), "generation 2 released by a retried step 1");
    d.send(r1, 2, barrier("step"));
    assert_eq!(d.last(r0, 2), Some(Ok(Response::Done)));
}

/// The reply was written and lost with the connection: the re-sent request gets the
/// same reply again, and does not join the next generation.
#[test]
fn a_barrier_resent_after_its_reply_was_lost_gets_the_reply_again() {
    let mut d = Driver::new();
    let id1 = process("j", 1, 2, 311, "b", 0x2);
    let r0 = d.session(process("j", 0, 2, 300, "a", 0x1));
    let r1 = d.session(id1.clone());
    d.send(r0, 1, barrier("step"));
    d.send(r1, 7, barrier("step"));
    assert_eq!(d.replies_to(r1, 7).len(), 1);
    d.cut(r1);
    d.advance(500);
    assert_eq!(d.resume(r1, &id1), Ok(r1));
    d.send(r1, 7, barrier("step"));
    assert_eq!(d.replies_to(r1, 7), [&Ok(Response::Done), &Ok(Response::Done)]);
    d.send(r0, 2, barrier("step"));
    assert!(d.replies_to(r0, 2).is_empty(), "the retry joined generation 2");
    // The grace timer of the earlier cut is spent: the session stays.
    d.advance(2_000);
    assert!(d.replies_to(r0, 2).is_empty(), "rank 1 was lost although it resumed");
}

/// A barrier's release is kept with its generation, its failure with the session:
/// a rank cut while its barrier failed gets the failure again, not a release.
#[test]
fn a_barrier_that_failed_while_its_rank_was_cut_replays_the_failure() {
    let mut d = Driver::new();
    let id0 = process("j", 0, 3, 300, "a", 0x1);
    let r0 = d.session(id0.clone());
    let r1 = d.session(process("j", 1, 3, 311, "b", 0x2));
    let r2 = d.session(process("j", 2, 3, 322, "c", 0x3));
    for r in [r0, r1, r2] {
        d.send(r, 1, barrier("step"));
    }
    d.send(r0, 2, barrier("step"));
    d.cut(r0);
    d.kill(r2);
    let lost = d.last(r0, 2);
    assert!(matches!(lost, Some(Err(OpError::PeerLost { .. }))), "{lost:?}");
    d.advance(500);
    assert_eq!(d.resume(r0, &id0), Ok(r0));
    d.send(r0, 1, barrier("step"));
    d.send(r0, 2, barrier("step"));
    assert_eq!(d.replies_to(r0, 1), [&Ok(Response::Done), &Ok(Response::Done)]);
    assert_eq!(d.replies_to(r0, 2).len(), 2);
    assert_eq!(d.last(r0, 2), lost, "the failure again");
}

/// A rank pipelining barrier calls: the failure of its first call, made in the same
/// input as its next call and not yet taken out, is what the first call keeps.
#[test]
fn a_pipelined_barrier_keeps_the_failure_made_in_the_same_input() {
    let mut d = Driver::new();
    let id0 = process("j", 0, 2, 300, "a", 0x1);
    let r0 = d.session(id0.clone());
    let r1 = d.session(process("j", 1, 2, 311, "b", 0x2));
    d.send(r0, 1, barrier("step"));
    // No replies taken out between these: the engine's input of one server batch.
    d.engine.close_with(r1, Departure::ProcessGone, d.now);
    d.engine.handle(r0, 2, barrier("step"), d.now);
    d.collect();
    let lost = d.last(r0, 1);
    assert!(matches!(lost, Some(Err(OpError::PeerLost { .. }))), "{lost:?}");
    let replies = d.resent_after_a_cut(r0, &id0, 1, barrier("step"));
    assert_eq!(replies.last().cloned(), lost, "the failure again, not a release");
}

/// A released barrier call is kept for a replay like any reply, whatever the engine's
/// clock (its entry is not dated from the clock's start).
#[test]
fn a_released_barrier_call_is_kept_past_the_engines_first_minute() {
    let mut d = Driver::with(Config { epoch_unix_ms: EPOCH, lease_ms: 0, ..Config::default() });
    d.now = 120_000; // the coordinator has been up two minutes
    let id0 = process("j", 0, 2, 300, "a", 0x1);
    let r0 = d.session(id0.clone());
    let r1 = d.session(process("j", 1, 2, 311, "b", 0x2));
    d.send(r0, 1, barrier("step"));
    d.send(r1, 1, barrier("step"));
    assert_eq!(d.last(r0, 1), Some(Ok(Response::Done)));
    // Pipelined: written before the barrier's reply was read; the reply is then lost.
    assert_eq!(d.call(r0, 2, add(1)), Ok(Response::Int(1)));
    let replies = d.resent_after_a_cut(r0, &id0, 1, barrier("step"));
    assert_eq!(replies, [Ok(Response::Done), Ok(Response::Done)]);
}

/// One input failing two barrier calls of a session: both failures are kept, the
/// second not taken for a release while the first is being kept.
#[test]
fn two_barrier_failures_in_one_input_are_both_kept() {
    let config = Config {
        epoch_unix_ms: EPOCH,
        lease_ms: 0,
        reply_cache: rallypoint_core::ReplyCache { max_replies: 2, ..Default::default() },
        ..Config::default()
    };
    let mut d = Driver::with(config);
    let id0 = process("j", 0, 3, 300, "a", 0x1);
    let r0 = d.session(id0.clone());
    let r1 = d.session(process("j", 1, 3, 311, "b", 0x2));
    let r2 = d.session(process("j", 2, 3, 322, "c", 0x3));
    d.send(r1, 1, barrier("a")); // "a" is made before "b": a loss fails it first
    d.send(r0, 1, barrier("b"));
    d.send(r0, 2, barrier("a"));
    assert_eq!(d.call(r0, 3, add(1)), Ok(Response::Int(1)));
    d.kill(r2);
    let lost = d.last(r0, 1);
    assert!(matches!(lost, Some(Err(OpError::PeerLost { .. }))), "{lost:?}");
    let replies = d.resent_after_a_cut(r0, &id0, 1, barrier("b"));
    assert_eq!(replies.last().cloned(), lost, "the failure again");
}

/// A name used by two member sets: other ranks' first calls make its generation 1
/// pending again, which a rank released from the first generation 1 is not in.
#[test]
fn a_released_call_does_not_wait_again_when_its_generation_number_is_reused() {
    let mut d = Driver::new();
    let ids: Vec<Identity> = (0..4).map(|r| process("j", r, 4, 300 + r, "a", 0x10 + u64::from(r))).collect();
    let s: Vec<SessionId> = ids.iter().map(|i| d.session(i.clone())).collect();
    let sync =
        |ranks: Vec<u32>| Request::Barrier { name: "sync".into(), members: Members::Ranks(ranks), timeout_ms: None };
    d.send(s[0], 1, sync(vec![0, 1]));
    d.send(s[1], 1, sync(vec![0, 1]));
    assert_eq!(d.last(s[0], 1), Some(Ok(Response::Done)));
    d.send(s[2], 1, sync(vec![2, 3])); // ranks 2 and 3's generation 1 of "sync"
    d.cut(s[0]);
    assert_eq!(d.resume(s[0], &ids[0]), Ok(s[0]));
    d.send(s[0], 1, sync(vec![0, 1]));
    assert_eq!(d.replies_to(s[0], 1), [&Ok(Response::Done), &Ok(Response::Done)], "the reply again, not a wait");
}

/// A barrier call that waits while its session adds past the count, then released,
/// keeps its reply.
#[test]
fn a_barrier_released_after_moving_aside_keeps_its_reply() {
    let config = Config {
        epoch_unix_ms: EPOCH,
        lease_ms: 0,
        reply_cache: rallypoint_core::ReplyCache { max_replies: 2, ..Default::default() },
        ..Config::default()
    };
    let mut d = Driver::with(config);
    let id0 = process("j", 0, 2, 300, "a", 0x1);
    let r0 = d.session(id0.clone());
    let r1 = d.session(process("j", 1, 2, 311, "b", 0x2));
    d.send(r0, 1, barrier("step"));
    assert_eq!(d.call(r0, 2, add(1)), Ok(Response::Int(1)));
    assert_eq!(d.call(r0, 3, add(1)), Ok(Response::Int(2)));
    d.send(r1, 1, barrier("step"));
    assert_eq!(d.last(r0, 1), Some(Ok(Response::Done)));
    assert_eq!(d.call(r0, 4, add(1)), Ok(Response::Int(3)));
    let replies = d.resent_after_a_cut(r0, &id0, 1, barrier("step"));
    assert_eq!(replies, [Ok(Response::Done), Ok(Response::Done)]);
}

#[test]
fn an_add_resent_after_its_reply_was_lost_adds_once() {
    let mut d = Driver::new();
    let who = tool("j", 50, 0x5);
    let s = d.session(who.clone());
    assert_eq!(d.call(s, 1, Request::Add { key: b("n"), delta: 5 }), Ok(Response::Int(5)));
    d.cut(s);
    assert_eq!(d.resume(s, &who), Ok(s));
    assert_eq!(d.call(s, 1, Request::Add { key: b("n"), delta: 5 }), Ok(Response::Int(5)));
    assert_eq!(d.call(s, 2, Request::Get { key: b("n"), timeout_ms: None }), Ok(Response::Value(b("5"))));
    // Reads are not kept: a re-sent get runs again and sees what is there now.
    assert_eq!(d.call(s, 3, Request::Add { key: b("n"), delta: 1 }), Ok(Response::Int(6)));
    assert_eq!(d.call(s, 2, Request::Get { key: b("n"), timeout_ms: None }), Ok(Response::Value(b("6"))));
}

/// A `get` still waiting when its connection was cut is not kept (a read runs again),
/// but a copy re-sent while it waits does not wait a second time.
#[test]
fn a_waiting_get_resent_after_a_cut_gets_one_reply() {
    let mut d = Driver::new();
    let who = tool("j", 50, 0x5);
    let s = d.session(who.clone());
    d.send(s, 1, Request::Get { key: b("k"), timeout_ms: None });
    d.cut(s);
    assert_eq!(d.resume(s, &who), Ok(s));
    d.send(s, 1, Request::Get { key: b("k"), timeout_ms: None });
    let setter = d.session(tool("j", 51, 0x6));
    assert_eq!(d.call(setter, 1, Request::Set { key: b("k"), value: b("v") }), Ok(Response::Done));
    assert_eq!(d.replies_to(s, 1), [&Ok(Response::Value(b("v")))]);
}

#[test]
fn all_gather_and_broadcast_resent_after_a_cut_count_once() {
    let mut d = Driver::new();
    let ids: Vec<Identity> = (0..3).map(|r| process("j", r, 3, 300 + r, "a", 0x10 + u64::from(r))).collect();
    let s: Vec<SessionId> = ids.iter().map(|i| d.session(i.clone())).collect();
    let gather =
        |v: &str| Request::AllGather { name: "g".into(), members: Members::World, value: b(v), timeout_ms: None };
    d.send(s[0], 1, gather("a"));
    d.send(s[1], 1, gather("b"));
    d.cut(s[1]);
    assert_eq!(d.resume(s[1], &ids[1]), Ok(s[1]));
    d.send(s[1], 1, gather("b"));
    d.send(s[2], 1, gather("c"));
    for session in &s {
        let Some(Ok(Response::Gathered(g))) = d.last(*session, 1) else { panic!("{:?}", d.last(*session, 1)) };
        assert_eq!(g.to_vec(), [b("a"), b("b"), b("c")]);
    }
    assert_eq!(d.replies_to(s[1], 1).len(), 1);

    let bcast = |v: Option<&str>| Request::Broadcast {
        name: "lr".into(),
        members: Members::World,
        root: 0,
        value: v.map(b),
        timeout_ms: None,
    };
    d.send(s[0], 2, bcast(Some("0.1")));
    d.send(s[1], 2, bcast(None));
    d.cut(s[1]);
    assert_eq!(d.resume(s[1], &ids[1]), Ok(s[1]));
    d.send(s[1], 2, bcast(None));
    assert_eq!(d.replies_to(s[1], 2), [&Ok(Response::Value(b("0.1"))), &Ok(Response::Value(b("0.1")))]);
    d.send(s[2], 2, bcast(None));
    // Generation 2 of the broadcast needs rank 1's second call, which has not come.
    d.send(s[0], 3, bcast(Some("0.2")));
    d.send(s[2], 3, bcast(None));
    assert_eq!(d.last(s[2], 3), Some(Ok(Response::Value(b("0.2")))));
    d.send(s[1], 3, bcast(None));
    assert_eq!(d.last(s[1], 3), Some(Ok(Response::Value(b("0.2")))), "rank 1's second call is generation 2");
}

#[test]
fn a_resume_is_refused_to_another_process_and_after_a_takeover() {
    let mut d = Driver::new();
    let mine = process("j", 1, 2, 311, "b", 0x2);
    let s = d.session(mine.clone());
    let other = process("j", 1, 2, 977, "c", 0x3);
    assert!(d.resume(s, &other).is_err(), "another incarnation");
    assert!(d.resume(s, &Identity { rank: Some(0), ..mine.clone() }).is_err(), "another rank");
    assert!(d.resume(SessionId(999), &mine).is_err(), "no such session");
    d.leave(s, 1);
    let _new = d.session(other);
    assert!(d.resume(s, &mine).is_err(), "closed and taken over");
}

/// Story 2 of issue 14: a job name re-run on a long-lived coordinator starts fresh
/// once reset; the old run's processes are refused by name.
#[test]
fn a_reset_starts_the_job_afresh_and_fails_the_old_incarnation() {
    let mut d = Driver::new();
    let old = |r: u32| Identity { job_incarnation: Some(0xaaa), ..process("j", r, 2, 300 + r, "a", u64::from(r) + 1) };
    let r0 = d.session(old(0));
    let r1 = d.session(old(1));
    assert_eq!(d.call(r0, 1, Request::Set { key: b("k"), value: b("v") }), Ok(Response::Done));
    d.send(r0, 2, barrier("b"));
    d.send(r1, 2, barrier("b"));
    d.send(r0, 3, Request::Get { key: b("never"), timeout_ms: None });
    d.kill(r1); // rank 1 lost

    d.now = 60_000;
    let launcher = d.session(tool("j", 42, 0x42));
    let report = d.status(launcher);
    assert!(
        report.contains("\nincarnation 0000000000000aaa (named by pid 300 on host a at 2026-11-21T12:00:01Z)\n"),
        "{report}"
    );
    assert_eq!(d.call(launcher, 1, Request::Reset { incarnation: 0xbbb }), Ok(Response::Done));
    let viewer = d.session(tool("j", 41, 0x41));
    let report = d.status(viewer);
    assert!(
        report.contains(
            "\nincarnation 0000000000000bbb (reset to it by pid 42 on host shell at 2026-11-21T12:01:00Z)\n\
             ranks: 0 connected, 0 left cleanly, 0 lost\n"
        ),
        "{report}"
    );
    // The document says the same.
    let snapshot = d.engine.snapshot("j", d.now).expect("the job");
    assert_eq!(snapshot.incarnation.as_deref(), Some("0000000000000bbb"));
    let by = snapshot.incarnation_by.expect("who made it");
    assert_eq!((by.host.as_str(), by.pid, by.since_unix_ms, by.reset), ("shell", 42, EPOCH + 60_000, true));
    let failed = d.last(r0, 3).expect("the old wait was failed");
    assert_eq!(
        failed.clone().unwrap_err().to_string(),
        "job 'j' was reset by pid 42 on host shell (incarnation 0000000000000042) at 2026-11-21T12:01:00Z (to \
         incarnation 0000000000000bbb); this operation belonged to the incarnation before"
    );
    assert!(matches!(d.call(r0, 6, Request::Heartbeat), Ok(Response::Done)));
    assert!(matches!(d.call(r0, 7, Request::Get { key: b("k"), timeout_ms: Some(0) }), Err(OpError::JobReset { .. })));

    // A process of the old incarnation is refused by name; one naming none joins the new one.
    let refused = d.open(old(1)).expect_err("stale");
    assert_eq!(
        refused.to_string(),
        "this process belongs to incarnation 0000000000000aaa of job 'j'; the job is at incarnation \
         0000000000000bbb since 2026-11-21T12:01:00Z (reset by pid 42 on host shell (incarnation 0000000000000042))"
    );
    let new = |r: u32| Identity { job_incarnation: Some(0xbbb), ..process("j", r, 2, 500 + r, "b", u64::from(r) + 10) };
    let n0 = d.session(new(0));
    let n1 = d.session(Identity { job_incarnation: None, ..new(1) });
    // No keys, no abort, no lost rank, generations from 1, rank 0 free for a new process.
    assert!(matches!(
        d.call(n0, 1, Request::Get { key: b("k"), timeout_ms: Some(0) }),
        Err(OpError::KeyTimeout { .. })
    ));
    d.send(n0, 2, barrier("b"));
    assert_eq!(d.call(n1, 2, barrier("b")), Ok(Response::Done));
    assert_eq!(d.last(n0, 2), Some(Ok(Response::Done)));
    // The old sessions closing now touch nothing of the new incarnation.
    d.kill(r0);
    d.send(n0, 3, barrier("b"));
    assert_eq!(d.call(n1, 3, barrier("b")), Ok(Response::Done));
    // Resetting to the current incarnation changes nothing.
    let again = d.session(tool("j", 43, 0x43));
    assert_eq!(d.call(n0, 4, Request::Set { key: b("x"), value: b("1") }), Ok(Response::Done));
    assert_eq!(d.call(again, 1, Request::Reset { incarnation: 0xbbb }), Ok(Response::Done));
    assert_eq!(d.call(n0, 5, Request::Get { key: b("x"), timeout_ms: Some(0) }), Ok(Response::Value(b("1"))));

    // An aborted job is not aborted for good: a reset clears it.
    assert_eq!(d.call(n0, 6, Request::Abort { reason: "disk full".into() }), Ok(Response::Done));
    assert!(matches!(d.call(again, 2, Request::NumKeys), Err(OpError::Aborted { .. })));
    assert_eq!(d.call(again, 3, Request::Reset { incarnation: 0xccc }), Ok(Response::Done));
    let fresh = d.session(tool("j", 44, 0x44));
    assert_eq!(d.call(fresh, 1, Request::NumKeys), Ok(Response::Int(0)));
}

#[test]
fn a_reset_leaves_other_jobs_alone_and_the_first_named_incarnation_sticks() {
    let mut d = Driver::new();
    let other = d.session(tool("other", 1, 0x1));
    assert_eq!(d.call(other, 1, Request::Set { key: b("k"), value: b("v") }), Ok(Response::Done));
    let first = d.session(Identity { job_incarnation: Some(0x77), ..tool("j", 2, 0x2) });
    let refused = d.open(Identity { job_incarnation: Some(0x78), ..tool("j", 3, 0x3) }).expect_err("stale");
    assert!(refused.to_string().contains("(first named by pid 2 on host shell"), "{refused}");
    assert_eq!(d.call(first, 1, Request::Reset { incarnation: 0x79 }), Ok(Response::Done));
    assert_eq!(d.call(other, 2, Request::Get { key: b("k"), timeout_ms: Some(0) }), Ok(Response::Value(b("v"))));
}

/// A re-sent request that changes something, whose reply is no longer kept, is not
/// run a second time: it fails saying its outcome is unknown.
#[test]
fn a_resent_request_whose_reply_was_evicted_is_not_run_twice() {
    let config = Config {
        reply_cache: rallypoint_core::ReplyCache { max_replies: 2, ..Default::default() },
        ..Config::default()
    };
    let mut d = Driver::with(config);
    let who = tool("j", 50, 0x5);
    let s = d.session(who.clone());
    for id in 1..=3 {
        assert_eq!(d.call(s, id, Request::Add { key: b("n"), delta: 1 }), Ok(Response::Int(id as i64)));
    }
    d.cut(s);
    assert_eq!(d.resume(s, &who), Ok(s));
    let unknown = d.call(s, 1, Request::Add { key: b("n"), delta: 1 });
    assert!(
        matches!(&unknown, Err(OpError::Closed(m)) if m.contains("may or may not have taken effect")),
        "{unknown:?}"
    );
    assert_eq!(d.call(s, 3, Request::Add { key: b("n"), delta: 1 }), Ok(Response::Int(3)));
    assert_eq!(d.call(s, 4, Request::Add { key: b("n"), delta: 1 }), Ok(Response::Int(4)));
}

mod schedules {
    //! Random schedules of arrivals, cuts, resumes and re-sent requests: an arrival
    //! never counts twice, no generation is released before all its members called
    //! it, and every call is released once everyone made it.

    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Step {
        /// Rank `r` makes its next barrier call, if it has the reply to its last one.
        Arrive(usize),
        /// Every rank that has the reply to its last call makes its next, in one run
        /// (as a node agent sends its ranks' calls).
        ArriveTogether,
        /// Rank `r` reads the replies that reached it.
        Read(usize),
        /// Rank `r`'s connection is cut and the coordinator notices.
        Cut(usize),
        /// Rank `r` resumes (whether or not the coordinator noticed a cut): the replies
        /// it had not read are lost, and it re-sends every call it has no reply for.
        Resume(usize),
        /// Time passes, within the grace.
        Wait(u64),
    }

    fn step(ranks: usize) -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => (0..ranks).prop_map(Step::Arrive),
            2 => Just(Step::ArriveTogether),
            3 => (0..ranks).prop_map(Step::Read),
            1 => (0..ranks).prop_map(Step::Cut),
            2 => (0..ranks).prop_map(Step::Resume),
            1 => (0u64..400).prop_map(Step::Wait),
        ]
    }

    const RANKS: usize = 3;

    /// One rank's client: its calls (call k has request id k) and what it read.
    #[derive(Default)]
    struct Client {
        calls: u64,
        answered: std::collections::BTreeSet<u64>,
        /// Index in the driver's replies up to which this client has read or lost.
        read_to: usize,
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

        #[test]
        fn arrivals_never_count_twice(steps in proptest::collection::vec(step(RANKS), 1..100)) {
            // A grace longer than any schedule: no rank is lost here.
            let mut d = Driver::with(Config { reconnect_grace_ms: 60_000, lease_ms: 0, ..Config::default() });
            let ids: Vec<Identity> =
                (0..RANKS as u32).map(|r| process("j", r, 3, 300 + r, "a", 0x10 + u64::from(r))).collect();
            let sessions: Vec<SessionId> = ids.iter().map(|i| d.session(i.clone())).collect();
            let mut clients: Vec<Client> = (0..RANKS).map(|_| Client::default()).collect();
            let rank_of = |s: SessionId| sessions.iter().position(|&x| x == s).expect("a rank's session");
            let mut checked = 0;
            for step in steps {
                match step {
                    Step::Arrive(r) => {
                        let c = &mut clients[r];
                        if c.answered.len() as u64 == c.calls {
                            c.calls += 1;
                            let id = c.calls;
                            d.send(sessions[r], id, barrier("b"));
                        }
                    }
                    Step::ArriveTogether => {
                        let mut calls = Vec::new();
                        for (r, c) in clients.iter_mut().enumerate() {
                            if c.answered.len() as u64 == c.calls {
                                c.calls += 1;
                                calls.push((sessions[r], c.calls));
                            }
                        }
                        d.send_together(&calls, barrier("b"));
                    }
                    Step::Read(r) => {
                        for out in &d.replies[clients[r].read_to..] {
                            if out.session == sessions[r] {
                                clients[r].answered.insert(out.request_id);
                            }
                        }
                        clients[r].read_to = d.replies.len();
                    }
                    Step::Cut(r) => d.cut(sessions[r]),
                    Step::Resume(r) => {
                        clients[r].read_to = d.replies.len();
                        prop_assert_eq!(d.resume(sessions[r], &ids[r]), Ok(sessions[r]));
                        for id in 1..=clients[r].calls {
                            if !clients[r].answered.contains(&id) {
                                d.send(sessions[r], id, barrier("b"));
                            }
                        }
                    }
                    Step::Wait(ms) => d.advance(ms),
                }
                // Each new reply: a success, for a generation every rank has called.
                for out in &d.replies[checked..] {
                    let r = rank_of(out.session);
                    prop_assert_eq!(&out.reply, &Ok(Response::Done), "rank {} call {}", r, out.request_id);
                    let made: Vec<u64> = clients.iter().map(|c| c.calls).collect();
                    prop_assert!(
                        made.iter().all(|&c| c >= out.request_id),
                        "rank {}'s call {} was released before every rank made it: {:?}", r, out.request_id, made
                    );
                }
                checked = d.replies.len();
            }
            // Everyone resumes, re-sends what it has no reply for, and calls up to one
            // more than anyone so far: every call is released (an arrival counted twice
            // would have moved its rank a generation ahead, leaving its last call waiting).
            let target = clients.iter().map(|c| c.calls).max().unwrap_or(0) + 1;
            for (r, c) in clients.iter_mut().enumerate() {
                c.read_to = d.replies.len();
                prop_assert_eq!(d.resume(sessions[r], &ids[r]), Ok(sessions[r]));
                for id in 1..=c.calls {
                    if !c.answered.contains(&id) {
                        d.send(sessions[r], id, barrier("b"));
                    }
                }
            }
            for (r, c) in clients.iter_mut().enumerate() {
                for id in (c.calls + 1)..=target {
                    d.send(sessions[r], id, barrier("b"));
                }
                c.calls = target;
            }
            for (r, session) in sessions.iter().enumerate() {
                for id in 1..=target {
                    let replies = d.replies_to(*session, id);
                    prop_assert!(!replies.is_empty(), "rank {}'s call {} was never released", r, id);
                    prop_assert!(replies.iter().all(|reply| **reply == Ok(Response::Done)));
                }
            }
        }
    }
}
