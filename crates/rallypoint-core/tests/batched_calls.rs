//! `Engine::handle_calls` (one identical collective call of several sessions, as a
//! node agent sends its ranks' barrier) and `Engine::handle_calls_from` (the same,
//! its barrier calls held in records released whole) against `Engine::handle` of
//! each call one after another: three engines driven by the same random script of
//! batches, kills, reconnects, aborts and clock advances must produce the same
//! replies after every step.

use bytes::Bytes;
use proptest::prelude::*;
use rallypoint_core::{Config, Engine, Identity, Link, Members, Millis, Outgoing, Request, Response, SessionId};

const WORLD: u32 = 4;

#[derive(Debug, Clone)]
enum Step {
    /// Ranks making call `call`; `WORLD` stands for the other job's session, and
    /// more for a session of this job without a rank (a tool's).
    Calls {
        ranks: Vec<u32>,
        call: usize,
    },
    Kill(u32),
    Connect(u32),
    Abort(u32),
    Advance(Millis),
}

/// The calls a batch may carry: agreeing and disagreeing member sets, timeouts, every
/// kind, and requests the engine refuses.
fn call(n: usize) -> Request {
    let barrier =
        |name: &str, members: Members, timeout_ms| Request::Barrier { name: name.into(), members, timeout_ms };
    match n {
        0 => barrier("b", Members::World, None),
        1 => barrier("b", Members::World, Some(50)),
        2 => barrier("b", Members::Ranks(vec![1, 0]), None),
        3 => barrier("c", Members::Ranks(vec![0, 2, 3]), Some(200)),
        4 => barrier("", Members::World, None),
        5 => barrier("r", Members::Role("trainer".into()), None),
        6 => Request::AllGather {
            name: "g".into(),
            members: Members::World,
            value: Bytes::from_static(b"x"),
            timeout_ms: Some(100),
        },
        7 => Request::Broadcast {
            name: "cast".into(),
            members: Members::World,
            root: 0,
            value: Some(Bytes::from_static(b"v")),
            timeout_ms: None,
        },
        8 => {
            Request::Broadcast { name: "cast".into(), members: Members::World, root: 1, value: None, timeout_ms: None }
        }
        _ => Request::Add { key: "k".into(), delta: 1 },
    }
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        8 => (prop::collection::vec(0..WORLD + 2, 1..7), 0usize..10).prop_map(|(ranks, call)| Step::Calls { ranks, call }),
        1 => (0..WORLD).prop_map(Step::Kill),
        2 => (0..WORLD).prop_map(Step::Connect),
        1 => (0..WORLD).prop_map(Step::Abort),
        2 => prop_oneof![Just(10u64), Just(60), Just(250)].prop_map(Step::Advance),
    ]
}

/// One engine and the sessions of its ranks; both engines number sessions alike.
struct Side {
    engine: Engine,
    next_session: u64,
}

impl Side {
    fn open(&mut self, job: &str, rank: u32, now: Millis) -> SessionId {
        let session = SessionId(self.next_session);
        self.next_session += 1;
        let mut identity = Identity::ranked(job, rank, WORLD);
        identity.host = format!("node{rank}");
        identity.pid = 1000 + rank;
        identity.role = rank.is_multiple_of(2).then(|| "trainer".to_owned());
        self.engine.open(session, identity, now).expect("identity accepted");
        session
    }

    fn open_anonymous(&mut self, job: &str, now: Millis) -> SessionId {
        let session = SessionId(self.next_session);
        self.next_session += 1;
        self.engine.open(session, Identity::anonymous(job), now).expect("identity accepted");
        session
    }

    /// The replies of the step, by session and request: the engine fails the
    /// generations of several collectives (an abort, a kill) in its maps' order,
    /// which differs between two engines.
    fn out(&mut self) -> Vec<Outgoing> {
        let mut out: Vec<Outgoing> = self.engine.drain_outgoing().collect();
        for record in self.engine.take_records() {
            assert_eq!(record.link, LINK);
            for (&session, &(route, request_id)) in record.sessions.iter().zip(&record.calls) {
                assert_eq!(route, !session.0, "a record keeps each call's route");
                out.push(Outgoing { session, request_id, reply: Ok(Response::Done) });
            }
        }
        out.sort_by_key(|o| (o.session, o.request_id));
        out
    }
}

/// The node agent the held engine's runs come from.
const LINK: Link = Link { id: 7, stamp: 3 };

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn a_batch_of_calls_is_each_call_in_turn(steps in prop::collection::vec(step(), 1..60)) {
        let mut now: Millis = 1_000;
        let mut batched = Side { engine: Engine::new(Config::default()), next_session: 1 };
        let mut held = Side { engine: Engine::new(Config::default()), next_session: 1 };
        let mut one_by_one = Side { engine: Engine::new(Config::default()), next_session: 1 };
        let mut sessions: Vec<Option<SessionId>> = Vec::new();
        for rank in 0..WORLD {
            sessions.push(Some(batched.open("j", rank, now)));
            held.open("j", rank, now);
            one_by_one.open("j", rank, now);
        }
        // A rank of another job, whose calls may sit in the same batch.
        let other = batched.open("k", 0, now);
        held.open("k", 0, now);
        one_by_one.open("k", 0, now);
        // A session without a rank, whose collective calls fail.
        let tool = batched.open_anonymous("j", now);
        held.open_anonymous("j", now);
        one_by_one.open_anonymous("j", now);
        let mut next_id = 1u64;
        for step in steps {
            match step {
                Step::Calls { ranks, call: n } => {
                    let request = call(n);
                    let calls: Vec<(SessionId, u64)> = ranks
                        .iter()
                        .filter_map(|&r| match r {
                            r if r < WORLD => sessions[r as usize],
                            WORLD => Some(other),
                            _ => Some(tool),
                        })
                        .map(|session| {
                            next_id += 1;
                            (session, next_id)
                        })
                        .collect();
                    batched.engine.handle_calls(&calls, &request, now);
                    let routes: Vec<u64> = calls.iter().map(|(session, _)| !session.0).collect();
                    held.engine.handle_calls_from(LINK, &calls, &routes, &request, now);
                    for &(session, id) in &calls {
                        one_by_one.engine.handle(session, id, request.clone(), now);
                    }
                }
                Step::Kill(rank) => {
                    if let Some(session) = sessions[rank as usize].take() {
                        batched.engine.close(session, now);
                        held.engine.close(session, now);
                        one_by_one.engine.close(session, now);
                    }
                }
                Step::Connect(rank) => {
                    if sessions[rank as usize].is_none() {
                        sessions[rank as usize] = Some(batched.open("j", rank, now));
                        held.open("j", rank, now);
                        one_by_one.open("j", rank, now);
                    }
                }
                Step::Abort(rank) => {
                    if let Some(session) = sessions[rank as usize] {
                        next_id += 1;
                        let abort = Request::Abort { reason: "test".into() };
                        batched.engine.handle(session, next_id, abort.clone(), now);
                        held.engine.handle(session, next_id, abort.clone(), now);
                        one_by_one.engine.handle(session, next_id, abort, now);
                    }
                }
                Step::Advance(ms) => {
                    now += ms;
                    batched.engine.tick(now);
                    held.engine.tick(now);
                    one_by_one.engine.tick(now);
                }
            }
            let expected = one_by_one.out();
            prop_assert_eq!(batched.out(), expected.clone());
            prop_assert_eq!(held.out(), expected);
        }
        now += 1_000;
        batched.engine.tick(now);
        held.engine.tick(now);
        one_by_one.engine.tick(now);
        let expected = one_by_one.out();
        prop_assert_eq!(batched.out(), expected.clone());
        prop_assert_eq!(held.out(), expected);
    }
}
