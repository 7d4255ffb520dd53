//! The job as data (`Request::Snapshot`, `Engine::snapshot`) and the counters the
//! metrics endpoint shows (`Engine::metrics`).

mod common;

use bytes::Bytes;
use common::{b, barrier, err, ok, Harness};
use rallypoint_core::counters::{KV_OPS, WAIT_OPS};
use rallypoint_core::snapshot::{JobSnapshot, RankStatus};
use rallypoint_core::{Identity, Request, Response, SessionId};

fn snapshot_of(h: &mut Harness, job: &str) -> JobSnapshot {
    let tool = h.open(Identity::anonymous(job));
    let Response::Value(json) = ok(Some(h.call(tool, Request::Snapshot))) else { panic!("a snapshot is a value") };
    let parsed: JobSnapshot = serde_json::from_slice(&json).expect("the snapshot is JSON of its schema");
    assert_eq!(
        Some(&parsed),
        h.engine
            .snapshot(job, h.now)
            .map(|mut s| {
                // The engine's own view counts the asking tool's session; the reply does not.
                s.sessions.native -= 1;
                s
            })
            .as_ref()
    );
    h.leave(tool);
    parsed
}

#[test]
fn a_barrier_with_a_rank_that_never_came_shows_who_waits_and_who_is_missing() {
    let mut h = Harness::new();
    let sessions: Vec<SessionId> = [0, 1, 3].iter().map(|&r| h.rank("j", r, 4)).collect();
    for s in &sessions {
        h.send(*s, barrier("step", None));
    }
    h.advance(2_500);
    let snap = snapshot_of(&mut h, "j");
    assert_eq!((snap.name.as_str(), snap.world_size, snap.sessions.native), ("j", Some(4), 3));
    assert_eq!(snap.ranks.len(), 4);
    assert_eq!(snap.ranks[2].state, RankStatus::NeverConnected);
    assert_eq!((snap.ranks[2].host.as_deref(), snap.ranks[2].wait), (None, None));
    for r in [0, 1, 3] {
        let rank = &snap.ranks[r];
        assert_eq!(rank.state, RankStatus::Connected);
        assert_eq!(
            (rank.host.clone(), rank.pid, rank.wait),
            (Some(format!("node{r}")), Some(1000 + r as u32), Some(0))
        );
    }
    let wait = &snap.waits[0];
    assert_eq!((wait.op.as_str(), wait.name.as_str(), wait.generation), ("barrier", "step", 1));
    assert_eq!((wait.members, wait.arrived, wait.missing_count, wait.waited_ms), (Some(4), 3, 1, 2_500));
    assert_eq!(wait.missing[0].rank, 2);
    assert_eq!(wait.missing[0].state, RankStatus::NeverConnected);
    let s = &snap.ranks_summary;
    assert_eq!((s.connected, s.never_connected, s.lost, s.in_collective), (3, 1, 0, 3));
    assert!(snap.torch.is_none());

    // Rank 3 dies: it shows as lost, and the barrier fails for the others.
    h.kill(sessions[2]);
    let snap = snapshot_of(&mut h, "j");
    assert_eq!(snap.ranks[3].state, RankStatus::Lost);
    assert_eq!(snap.ranks[3].lost.as_ref().map(|l| l.reason.as_str()), Some("disconnected"));
    assert!(snap.waits.is_empty(), "the barrier failed: {:?}", snap.waits);
    assert_eq!(snap.ranks_summary.lost, 1);
}

#[test]
fn torch_processes_show_missing_address_keys_key_waits_and_their_ranks() {
    let mut h = Harness::new();
    let prefix = "/default_pg/0//cpu//0/";
    let torch = |h: &mut Harness, r: u64| {
        let session = SessionId(100 + r);
        h.engine.open_tcpstore(session, "t", "10.0.0.1", 200 + r as u32, h.now).expect("accepted");
        session
    };
    let s: Vec<SessionId> = (0..3).map(|r| torch(&mut h, r)).collect();
    for (r, session) in s.iter().enumerate() {
        ok(Some(h.call(*session, Request::Add { key: b("init/"), delta: 1 })));
        ok(Some(h.call(*session, Request::Set { key: Bytes::from(format!("{prefix}{r}")), value: b("addr") })));
    }
    // Rank 1 waits for rank 3's key, which is never written.
    let keys = vec![Bytes::from(format!("{prefix}3"))];
    h.send(s[1], Request::Wait { keys, timeout_ms: None });
    h.advance(1_000);
    let snap = snapshot_of(&mut h, "t");
    let torch = snap.torch.as_ref().expect("a torch job");
    assert_eq!(torch.tcpstore_connections, 3);
    assert_eq!(torch.init_arrivals.as_deref(), Some("3"));
    let group = &torch.process_groups[0];
    assert_eq!(group.prefix, prefix);
    assert_eq!((group.written.ranges.clone(), group.missing.ranges.clone()), (vec![(0, 2)], vec![(3, 3)]));
    assert_eq!(snap.key_waits.len(), 1);
    let w = &snap.key_waits[0];
    assert_eq!((w.rank, w.op.as_str(), w.tcpstore, w.waited_ms), (Some(1), "wait", true, 1_000));
    assert_eq!(w.absent, [format!("{prefix}3")]);
    // Ranks listed up to the highest named (3, the missing one); rank 1 points at its wait.
    assert_eq!(snap.ranks.len(), 4);
    assert_eq!(snap.ranks[1].key_wait, Some(0));
    assert_eq!(snap.ranks[3].state, RankStatus::NeverConnected);
}

#[test]
fn counters_move_with_arrivals_releases_timeouts_losses_and_key_operations() {
    let mut h = Harness::new();
    let op = |name: &str| WAIT_OPS.iter().position(|&o| o == name).expect("an op");
    let kv = |name: &str| KV_OPS.iter().position(|&o| o == name).expect("a kv op");
    let a = h.rank("m", 0, 2);
    let c = h.rank("m", 1, 2);
    let first = h.send(a, barrier("b", None));
    h.advance(40);
    h.send(c, barrier("b", None));
    assert!(matches!(h.take(a, first), Some(Ok(Response::Done))));
    ok(Some(h.call(a, Request::Set { key: b("k"), value: b("v") })));
    ok(Some(h.call(a, Request::Add { key: b("n"), delta: 1 })));
    let timed_out = h.send(a, Request::Get { key: b("never"), timeout_ms: Some(10) });
    h.advance(20);
    err(h.take(a, timed_out));
    // A barrier that times out, then a rank lost in another that fails.
    h.send(a, barrier("late", Some(5)));
    h.advance(10);
    h.send(a, barrier("doomed", None));
    h.kill(c);

    let metrics = h.engine.metrics(h.now);
    let m = metrics.iter().find(|m| m.name == "m").expect("job m");
    let barrier = &m.counters.ops[op("barrier")];
    assert_eq!((barrier.arrivals, barrier.releases, barrier.timeouts, barrier.peer_lost), (4, 1, 1, 1));
    assert_eq!((barrier.wait.count, barrier.wait.sum_ms), (1, 40));
    assert_eq!(m.counters.ops[op("get")].timeouts, 1);
    assert_eq!((m.counters.kv_ops[kv("set")], m.counters.kv_ops[kv("add")], m.counters.kv_ops[kv("get")]), (1, 1, 1));
    assert_eq!((m.counters.ranks_lost_disconnected, m.counters.ranks_lost_lease), (1, 0));
    assert_eq!((m.ranks.connected, m.ranks.lost, m.sessions.native), (1, 1, 1));

    // A reset keeps counting where the job was.
    let tool = h.open(Identity::anonymous("m"));
    ok(Some(h.call(tool, Request::Reset { incarnation: 7 })));
    let metrics = h.engine.metrics(h.now);
    let m = metrics.iter().find(|m| m.name == "m").expect("job m");
    assert_eq!(m.counters.ops[op("barrier")].arrivals, 4);
}

#[test]
fn a_torchrun_rendezvous_state_is_decoded_in_the_snapshot_and_the_report() {
    let mut h = Harness::new();
    let session = SessionId(300);
    h.engine.open_tcpstore(session, "r", "10.0.0.1", 99, h.now).expect("accepted");
    // Written by torch's own code (see the test data's test in the crate).
    let state = include_str!("../src/rendezvous/testdata/state-round3.b64").trim();
    // torch's TCPStore client puts a "/" before every key.
    ok(Some(h.call(session, Request::Set { key: b("/torch.rendezvous.run7"), value: b(state) })));
    ok(Some(h.call(
        session,
        Request::Set { key: b("torch.rendezvous.broken"), value: b("gASVDgAAAAAAAAB9lIwFcm91bmSUSwFzLg==") },
    )));
    let snap = snapshot_of(&mut h, "r");
    let rdzv = &snap.torch.as_ref().expect("torch").rendezvous;
    // In key order: "/torch.rendezvous.run7" first.
    assert_eq!(rdzv.len(), 2);
    assert_eq!((rdzv[1].run_id.as_str(), rdzv[1].state.is_none()), ("broken", true));
    assert!(rdzv[1].error.as_deref().is_some_and(|e| e.contains("not a pickled object")), "{:?}", rdzv[1]);
    let state = rdzv[0].state.as_ref().expect("decoded");
    assert_eq!((rdzv[0].run_id.as_str(), state.round, state.participants.len()), ("run7", 3, 2));

    let tool = h.open(Identity::anonymous("r"));
    let Response::Value(report) = ok(Some(h.call(tool, Request::Status))) else { panic!("status is text") };
    let report = String::from_utf8_lossy(&report).into_owned();
    assert!(
        report.contains(
            "torchrun rendezvous 'run7': round 3, complete, 2 participant(s): node-a_123_0 (rank 0, last heartbeat"
        ),
        "{report}"
    );
    assert!(report.contains("torchrun rendezvous 'broken': undecodable (not a pickled object"), "{report}");
    assert!(report.contains("waiting for the next round: node-c_789_0"), "{report}");
}
