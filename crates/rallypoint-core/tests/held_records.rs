//! `Engine::handle_calls_from` (a node agent's barrier calls held in records)
//! against `Engine::handle` of each call, for resumable sessions whose connections
//! are cut and resumed and which send again every request they have no reply for
//! (docs/PROTOCOL.md, section 14.4): random schedules, and the cases they found.
//! Both engines must give every request the same replies.

use std::collections::BTreeMap;

use bytes::Bytes;
use proptest::prelude::*;
use rallypoint_core::{
    Config, Departure, Engine, Identity, Link, Members, Millis, Outgoing, Reply, Request, Response, SessionId,
};

const WORLD: u32 = 4;
/// Sessions: ranks 0..4 of job j, a second session of rank 1's process, rank 0 of
/// job k, and a tool of job j (no rank).
const SESSIONS: u32 = 7;

#[derive(Debug, Clone)]
enum Step {
    /// Ranks making call `call` in one run (those cut lose their send).
    Calls {
        ranks: Vec<u32>,
        call: usize,
    },
    /// Rank's connection is cut (the coordinator notices).
    Cut(u32),
    /// Session's process is killed (known gone): its rank is lost.
    Kill(u32),
    /// Session says Leave, then a new process claims its rank (a takeover of the
    /// old one, whose session stays open) and becomes that slot's client.
    Replace(u32),
    /// Rank resumes and re-sends what it has no reply for.
    Resume(u32),
    /// Rank aborts the job.
    Abort(u32),
    Advance(Millis),
}

fn call(n: usize) -> Request {
    call_with(n, true)
}

fn call_with(n: usize, timeouts: bool) -> Request {
    let t = |ms: u64| timeouts.then_some(ms);
    let barrier =
        |name: &str, members: Members, timeout_ms| Request::Barrier { name: name.into(), members, timeout_ms };
    match n {
        0 => barrier("b", Members::World, None),
        1 => barrier("b", Members::World, t(50)),
        2 => barrier("s", Members::Ranks(vec![1, 0]), None),
        3 => barrier("c", Members::Ranks(vec![0, 2, 3]), t(200)),
        4 => barrier("r", Members::Role("trainer".into()), None),
        5 => Request::AllGather {
            name: "g".into(),
            members: Members::World,
            value: Bytes::from_static(b"x"),
            timeout_ms: t(100),
        },
        _ => Request::Add { key: "k".into(), delta: 1 },
    }
}

fn step(abort: bool) -> impl Strategy<Value = Step> {
    step_with(abort, false)
}

fn step_with(abort: bool, kills: bool) -> impl Strategy<Value = Step> {
    let abort_weight = 1;
    let kill_weight = if kills { 1 } else { 0 };
    let s = prop_oneof![
        8 => (prop::collection::vec(0..SESSIONS, 1..7), 0usize..7).prop_map(|(ranks, call)| Step::Calls { ranks, call }),
        2 => (0..SESSIONS).prop_map(Step::Cut),
        kill_weight => (0..SESSIONS).prop_map(Step::Kill),
        kill_weight => (0..SESSIONS).prop_map(Step::Replace),
        3 => (0..SESSIONS).prop_map(Step::Resume),
        abort_weight => (0..WORLD).prop_map(Step::Abort),
        2 => prop_oneof![4 => Just(10u64), 4 => Just(60), 4 => Just(250), 1 => Just(61_000)].prop_map(Step::Advance),
    ];
    s.prop_map(move |step| match step {
        Step::Abort(_) if !abort => Step::Advance(10),
        Step::Kill(_) | Step::Replace(_) if !kills => Step::Advance(10),
        step => step,
    })
}

/// The identity of session index `i`'s `n`th process.
fn identity_of(i: u32, n: u64) -> Identity {
    let mut identity = identity(i);
    identity.incarnation = identity.incarnation.map(|x| x + 0x1_0000 * n);
    identity.pid += n as u32 * 100;
    identity
}

/// The identity of session index `i`.
fn identity(i: u32) -> Identity {
    match i {
        4 => rank_identity(1),
        5 => Identity { job: "k".into(), incarnation: Some(0x900), ..rank_identity(0) },
        6 => Identity { host: "shell".into(), pid: 77, incarnation: Some(0x77), ..Identity::anonymous("j") },
        r => rank_identity(r),
    }
}

fn rank_identity(rank: u32) -> Identity {
    let mut identity = Identity::ranked("j", rank, WORLD);
    identity.host = format!("node{rank}");
    identity.pid = 1000 + rank;
    identity.incarnation = Some(0x100 + u64::from(rank));
    identity.role = rank.is_multiple_of(2).then(|| "trainer".to_owned());
    identity
}

const LINK: Link = Link { id: 7, stamp: 0 };

/// Every reply an engine made, a record's release as `Done` to each of its calls.
fn out(engine: &mut Engine) -> Vec<Outgoing> {
    let mut out: Vec<Outgoing> = engine.drain_outgoing().collect();
    for record in engine.take_records() {
        for (&session, &(_, request_id)) in record.sessions.iter().zip(&record.calls) {
            out.push(Outgoing { session, request_id, reply: Ok(Response::Done) });
        }
    }
    out.sort_by_key(|o| (o.session, o.request_id, format!("{:?}", o.reply)));
    out
}

/// One rank's client.
#[derive(Default, Debug)]
struct Client {
    next_id: u64,
    cut: bool,
    /// Requests it has no reply for.
    outstanding: BTreeMap<u64, Request>,
}

/// `calls` of one request into `engine`: `held`, as one run from an agent's link
/// (each call routed by its session), else one at a time, as direct connections
/// make them.
fn send(engine: &mut Engine, held: bool, calls: &[(SessionId, u64)], request: &Request, now: Millis) {
    if held {
        let routes: Vec<u64> = calls.iter().map(|(s, _)| s.0).collect();
        engine.handle_calls_from(LINK, calls, &routes, request, now);
    } else {
        for &(s, id) in calls {
            engine.handle(s, id, request.clone(), now);
        }
    }
}

struct Pair {
    held: Engine,
    one: Engine,
}

impl Pair {
    /// `calls` of one request: the held engine as one run, the other one by one.
    fn run(&mut self, calls: &[(SessionId, u64)], request: &Request, now: Millis) {
        let collective = matches!(request, Request::Barrier { .. } | Request::AllGather { .. });
        send(&mut self.held, collective, calls, request, now);
        send(&mut self.one, false, calls, request, now);
    }
}

impl Pair {
    /// A new process for slot `r` opens a session on both engines: its id if admitted.
    fn new_process(
        &mut self,
        r: u32,
        process: &mut [u64],
        next_session: &mut u64,
        now: Millis,
    ) -> Result<Option<SessionId>, TestCaseError> {
        process[r as usize] += 1;
        let fresh = SessionId(*next_session);
        *next_session += 1;
        let who = identity_of(r, process[r as usize]);
        let a = self.held.open(fresh, who.clone(), now).map(|w| w.session);
        let b = self.one.open(fresh, who, now).map(|w| w.session);
        prop_assert_eq!(&a, &b);
        Ok(a.ok())
    }
}

fn unknown(reply: &Reply) -> bool {
    matches!(reply, Err(rallypoint_core::OpError::Closed(m)) if m.contains("no longer kept"))
}

/// The one way the two may differ: past its age, a failure kept in a session's
/// replies is dropped (a copy then gets `Closed`, outcome unknown), while the records
/// of the generation it failed are kept by count, not age, and still tell it.
fn known(held: &Outgoing, one: &Outgoing) -> bool {
    (held.session, held.request_id) == (one.session, one.request_id)
        && unknown(&one.reply)
        && held.reply.is_err()
        && !unknown(&held.reply)
}

fn check(pair: &mut Pair, clients: &mut [Client], sessions: &[SessionId], what: &str) -> Result<(), TestCaseError> {
    let held = out(&mut pair.held);
    let one = out(&mut pair.one);
    let same = held.len() == one.len() && held.iter().zip(&one).all(|(h, o)| h == o || known(h, o));
    prop_assert!(same, "after {}:\n held: {:?}\n one:  {:?}", what, held, one);
    for o in one {
        let Some(r) = sessions.iter().position(|&s| s == o.session) else { continue };
        if !clients[r].cut {
            clients[r].outstanding.remove(&o.request_id);
        }
    }
    Ok(())
}

fn run_schedule(steps: Vec<Step>, timeouts: bool) -> Result<(), TestCaseError> {
    let config = Config { reconnect_grace_ms: 600_000, lease_ms: 0, ..Config::default() };
    let mut pair = Pair { held: Engine::new(config.clone()), one: Engine::new(config) };
    let mut now: Millis = 1_000;
    let mut sessions = Vec::new();
    for i in 0..SESSIONS {
        let s = SessionId(u64::from(i) + 1);
        pair.held.open(s, identity(i), now).expect("open");
        pair.one.open(s, identity(i), now).expect("open");
        sessions.push(s);
    }
    let _ = (out(&mut pair.held), out(&mut pair.one));
    let mut clients: Vec<Client> = (0..SESSIONS).map(|_| Client::default()).collect();
    // Which process each slot has now, and whether its session is open.
    let mut process: Vec<u64> = vec![0; SESSIONS as usize];
    let mut next_session = u64::from(SESSIONS) + 1;
    for (n, step) in steps.into_iter().enumerate() {
        match &step {
            Step::Calls { ranks, call: c } => {
                let request = call_with(*c, timeouts);
                let mut calls = Vec::new();
                for &r in ranks {
                    let client = &mut clients[r as usize];
                    // As many calls ahead of the replies read as the records keep.
                    if client.outstanding.len() >= 4 {
                        continue;
                    }
                    client.next_id += 1;
                    client.outstanding.insert(client.next_id, request.clone());
                    if !client.cut {
                        calls.push((sessions[r as usize], client.next_id));
                    }
                }
                pair.run(&calls, &request, now);
            }
            Step::Cut(r) => {
                let client = &mut clients[*r as usize];
                if !client.cut {
                    client.cut = true;
                    pair.held.close_with(sessions[*r as usize], Departure::Unknown, now);
                    pair.one.close_with(sessions[*r as usize], Departure::Unknown, now);
                }
            }
            Step::Resume(r) => {
                let s = sessions[*r as usize];
                let who = identity_of(*r, process[*r as usize]);
                let a = pair.held.resume(s, &who, now).map(|w| w.session);
                let b = pair.one.resume(s, &who, now).map(|w| w.session);
                prop_assert_eq!(&a, &b);
                if a.is_err() {
                    // Killed, or its rank taken over: nothing to resume.
                    check(&mut pair, &mut clients, &sessions, &format!("step {n}: {step:?}"))?;
                    continue;
                }
                prop_assert_eq!(a, Ok(s));
                let client = &mut clients[*r as usize];
                client.cut = false;
                // Copies in id order; consecutive identical requests in one run.
                let copies: Vec<(u64, Request)> = client.outstanding.iter().map(|(k, v)| (*k, v.clone())).collect();
                let mut i = 0;
                while i < copies.len() {
                    let mut j = i + 1;
                    while j < copies.len() && copies[j].1 == copies[i].1 {
                        j += 1;
                    }
                    let calls: Vec<(SessionId, u64)> = copies[i..j].iter().map(|(id, _)| (s, *id)).collect();
                    pair.run(&calls, &copies[i].1, now);
                    i = j;
                }
            }
            Step::Abort(r) => {
                let client = &mut clients[*r as usize];
                client.next_id += 1;
                let abort = Request::Abort { reason: "test".into() };
                client.outstanding.insert(client.next_id, abort.clone());
                if !client.cut {
                    pair.run(&[(sessions[*r as usize], client.next_id)], &abort, now);
                }
            }
            Step::Kill(r) => {
                let s = sessions[*r as usize];
                pair.held.close_with(s, Departure::ProcessGone, now);
                pair.one.close_with(s, Departure::ProcessGone, now);
                check(&mut pair, &mut clients, &sessions, &format!("step {n}: {step:?}"))?;
                // A new process for the slot.
                let fresh = pair.new_process(*r, &mut process, &mut next_session, now)?;
                if let Some(fresh) = fresh {
                    sessions[*r as usize] = fresh;
                    clients[*r as usize] = Client::default();
                }
            }
            Step::Replace(r) => {
                let s = sessions[*r as usize];
                let client = &mut clients[*r as usize];
                if !client.cut {
                    client.next_id += 1;
                    pair.run(&[(s, client.next_id)], &Request::Leave, now);
                }
                check(&mut pair, &mut clients, &sessions, &format!("step {n}: {step:?} (leave)"))?;
                let fresh = pair.new_process(*r, &mut process, &mut next_session, now)?;
                if let Some(fresh) = fresh {
                    // The old session stays open (taken over); its client goes on
                    // making calls no more.
                    sessions.push(s);
                    let old = std::mem::take(&mut clients[*r as usize]);
                    clients.push(old);
                    sessions[*r as usize] = fresh;
                }
            }
            Step::Advance(ms) => {
                now += ms;
                pair.held.tick(now);
                pair.one.tick(now);
            }
        }
        check(&mut pair, &mut clients, &sessions, &format!("step {n}: {step:?}"))?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Without aborts or timeouts: strict.
    #[test]
    fn held_runs_answer_as_one_by_one_across_resumes(steps in prop::collection::vec(step(false), 1..60)) {
        run_schedule(steps, false)?;
    }

    /// With aborts.
    #[test]
    fn held_runs_answer_as_one_by_one_across_resumes_and_aborts(steps in prop::collection::vec(step(true), 1..60)) {
        run_schedule(steps, false)?;
    }

    /// With timeouts, no aborts.
    #[test]
    fn held_runs_answer_as_one_by_one_across_resumes_and_timeouts(steps in prop::collection::vec(step(false), 1..60)) {
        run_schedule(steps, true)?;
    }

    /// With kills, takeovers and aborts (timeouts too).
    #[test]
    fn held_runs_answer_as_one_by_one_across_kills_and_takeovers(steps in prop::collection::vec(step_with(true, true), 1..60)) {
        run_schedule(steps, true)?;
    }
}

/// A held barrier call of a rank whose connection is cut; the job is aborted, or
/// reset, meanwhile (its generation fails with `Aborted` or `JobReset`). The rank
/// resumes and sends its call again: the copy gets the error its original got (as it
/// does when the call was made on its own), not `Closed` "may or may not have taken
/// effect".
#[test]
fn a_held_call_failed_by_an_abort_or_a_reset_replays_the_failure() {
    let ends = [Request::Abort { reason: "test".into() }, Request::Reset { incarnation: 0xbbb }];
    for (end, held) in ends.iter().flat_map(|end| [(end, false), (end, true)]) {
        let config = Config { reconnect_grace_ms: 600_000, lease_ms: 0, ..Config::default() };
        let mut engine = Engine::new(config);
        let now = 1_000;
        let (s0, s1) = (SessionId(1), SessionId(2));
        engine.open(s0, identity(0), now).expect("open");
        engine.open(s1, identity(1), now).expect("open");
        send(&mut engine, held, &[(s1, 1)], &call(0), now);
        let _ = out(&mut engine);
        engine.close_with(s1, Departure::Unknown, now);
        engine.handle(s0, 1, end.clone(), now);
        let first: Vec<Reply> = out(&mut engine).into_iter().filter(|o| o.session == s1).map(|o| o.reply).collect();
        let failed = matches!(
            first.as_slice(),
            [Err(rallypoint_core::OpError::Aborted { .. } | rallypoint_core::OpError::JobReset { .. })]
        );
        assert!(failed, "{end:?}: {first:?}");
        engine.resume(s1, &identity(1), now + 10).expect("resumed");
        send(&mut engine, held, &[(s1, 1)], &call(0), now + 10);
        let copy: Vec<Reply> = out(&mut engine).into_iter().filter(|o| o.session == s1).map(|o| o.reply).collect();
        assert_eq!(copy, first, "{end:?}, held = {held}: the copy's reply");
    }
}

/// A second session of rank 1's process (same incarnation) is held at barrier 'b'
/// (request 1) and cut before it reads the release. Rank 1's first session goes on
/// with the job: four more generations of 'b' are released. The cut session resumes
/// and sends its one unanswered call again: it gets `Done`, as a call kept in its
/// replies would, though other sessions' generations ended since.
#[test]
fn a_held_call_of_a_second_session_of_a_rank_is_remembered_past_later_generations() {
    for held in [false, true] {
        let config = Config { reconnect_grace_ms: 600_000, lease_ms: 0, ..Config::default() };
        let mut engine = Engine::new(config);
        let now = 1_000;
        let sessions: Vec<SessionId> = (1..=5).map(SessionId).collect();
        for r in 0..4 {
            engine.open(sessions[r as usize], identity(r), now).expect("open");
        }
        let second = sessions[4];
        engine.open(second, identity(1), now).expect("open a second session of rank 1");
        let b = call(0);
        send(&mut engine, held, &[(sessions[0], 1), (second, 1), (sessions[2], 1), (sessions[3], 1)], &b, now);
        engine.close_with(second, Departure::Unknown, now);
        let _ = out(&mut engine);
        for id in 1..=4 {
            let calls = [(sessions[0], id + 1), (sessions[1], id), (sessions[2], id + 1), (sessions[3], id + 1)];
            send(&mut engine, held, &calls, &b, now);
        }
        let released = out(&mut engine);
        assert_eq!(released.len(), 16, "four generations released: {released:?}");
        engine.resume(second, &identity(1), now).expect("resumed");
        send(&mut engine, held, &[(second, 1)], &b, now);
        let copy: Vec<Reply> = out(&mut engine).into_iter().filter(|o| o.session == second).map(|o| o.reply).collect();
        assert_eq!(copy, [Ok(Response::Done)], "held = {held}: the copy's reply");
    }
}

/// A session (rank 0 of 1) calls 100 barrier names in turn, four rounds (400 calls
/// through its agent, each released at once), then `add` (request 401), whose
/// reply is lost with its connection. It resumes and sends the `add` again: the add's
/// reply was kept, and is replayed. What the records tell of the 400 calls must not
/// push it out of the session's kept replies.
#[test]
fn a_resume_does_not_push_a_kept_reply_out_with_the_records_calls() {
    for held in [false, true] {
        let config = Config { reconnect_grace_ms: 600_000, lease_ms: 0, ..Config::default() };
        let mut engine = Engine::new(config);
        let now = 1_000;
        let s = SessionId(1);
        let who = Identity { incarnation: Some(5), ..Identity::ranked("solo", 0, 1) };
        engine.open(s, who.clone(), now).expect("open");
        for i in 0..400u64 {
            let request = Request::Barrier {
                name: format!("layer-{}", i % 100).into(),
                members: Members::World,
                timeout_ms: None,
            };
            send(&mut engine, held, &[(s, i + 1)], &request, now);
        }
        let add = Request::Add { key: "n".into(), delta: 1 };
        engine.handle(s, 401, add.clone(), now);
        let first: Vec<Reply> = out(&mut engine).into_iter().filter(|o| o.request_id == 401).map(|o| o.reply).collect();
        assert_eq!(first, [Ok(Response::Int(1))]);
        engine.close_with(s, Departure::Unknown, now);
        engine.resume(s, &who, now + 10).expect("resumed");
        engine.handle(s, 401, add, now + 10);
        let copy: Vec<Reply> = out(&mut engine).into_iter().filter(|o| o.request_id == 401).map(|o| o.reply).collect();
        assert_eq!(copy, first, "held = {held}: the add's copy");
    }
}

/// Rank 1 is held at barrier 'b' (rank 0 has not come), says Leave, and a new
/// process takes rank 1 over: the old session's call fails with `TakenOver`, its
/// arrival stays counted, and nobody is blocked in the generation any more. The
/// status report says what it says when the call was made on its own.
#[test]
fn a_generation_whose_held_calls_all_failed_alone_blocks_nobody() {
    let mut reports = Vec::new();
    for held in [false, true] {
        let config = Config { reconnect_grace_ms: 600_000, lease_ms: 0, ..Config::default() };
        let mut engine = Engine::new(config);
        let now = 1_000;
        let (s1, tool, s1_new) = (SessionId(1), SessionId(2), SessionId(3));
        engine.open(s1, identity(1), now).expect("open");
        engine.open(tool, identity(6), now).expect("open");
        send(&mut engine, held, &[(s1, 1)], &call(0), now);
        engine.handle(s1, 2, Request::Leave, now);
        engine.open(s1_new, identity_of(1, 1), now).expect("a new process takes rank 1 over");
        let replies = out(&mut engine);
        let taken = replies.iter().any(|o| {
            o.session == s1 && o.request_id == 1 && matches!(o.reply, Err(rallypoint_core::OpError::TakenOver { .. }))
        });
        assert!(taken, "held = {held}: {replies:?}");
        engine.handle(tool, 1, Request::Status, now);
        let report = out(&mut engine).into_iter().find(|o| o.session == tool).map(|o| o.reply);
        let Some(Ok(Response::Value(report))) = report else { panic!("held = {held}: no status report") };
        reports.push(String::from_utf8_lossy(&report).into_owned());
    }
    assert!(!reports[0].contains("waiting: barrier 'b'"), "{}", reports[0]);
    assert_eq!(reports[0], reports[1], "the status report, one at a time and held");
}
