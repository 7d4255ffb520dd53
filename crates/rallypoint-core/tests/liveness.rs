//! Lost ranks fail everything that needs them, at once, on every peer; clean
//! leaves do not; lease expiry catches silent peers; reconnects revive.

mod common;

use common::{b, barrier, barrier_of, err, ok, Harness};
use rallypoint_core::snapshot::{RankStatus, RankView};
use rallypoint_core::{
    Config, Exit, Identity, LossReason, Members, OpError, RankState, Reply, Request, Response, SessionId,
};

/// Ranks 0 and 1 of a job with a 1 s lease, rank 0 waiting at barrier "x" (its request id).
fn rank_0_waiting_under_a_1s_lease() -> (Harness, SessionId, SessionId, u64) {
    rank_0_waiting(Config { lease_ms: 1_000, ..Config::default() })
}

/// Ranks 0 and 1 of job "j", rank 0 waiting at barrier "x" (its request id).
fn rank_0_waiting(config: Config) -> (Harness, SessionId, SessionId, u64) {
    let mut h = Harness::with_config(config);
    let s0 = h.rank("j", 0, 2);
    let s1 = h.rank("j", 1, 2);
    let a = h.send(s0, barrier("x", None));
    (h, s0, s1, a)
}

/// `steps` × 400 ms pass with rank 0 (`s0`) heartbeating; `each` runs after every step.
fn steps_of_400ms(h: &mut Harness, s0: SessionId, steps: usize, mut each: impl FnMut(&mut Harness)) {
    for _ in 0..steps {
        h.advance(400);
        h.call(s0, Request::Heartbeat).unwrap();
        each(h);
    }
}

#[test]
fn a_killed_rank_fails_pending_barriers_on_every_peer_naming_it() {
    let mut h = Harness::new();
    let s: Vec<_> = (0..4).map(|r| h.rank("j", r, 4)).collect();
    let ids: Vec<_> = (0..3).map(|r| h.send(s[r], barrier("step", Some(60_000)))).collect();
    h.advance(300);
    h.kill(s[3]);
    for r in 0..3 {
        let e = err(h.take(s[r], ids[r]));
        let OpError::PeerLost { op, peer } = &e else { panic!("{e:?}") };
        assert_eq!(
            (op.name.as_str(), peer.rank, peer.host.as_deref(), peer.pid),
            ("step", 3, Some("node3"), Some(1003))
        );
        assert_eq!(peer.state, RankState::Lost(LossReason::Disconnected));
        assert!(e.to_string().contains("rank 3 (host node3, pid 1003, lost: connection dropped"), "{e}");
    }
}

#[test]
fn later_calls_needing_a_lost_rank_fail_at_once_until_it_reconnects() {
    let mut h = Harness::new();
    let s0 = h.rank("j", 0, 2);
    let s1 = h.rank("j", 1, 2);
    h.kill(s1);
    let e = h.call(s0, barrier("x", None)).unwrap_err();
    assert!(matches!(&e, OpError::PeerLost { peer, .. } if peer.rank == 1));
    // A subgroup that does not include rank 1 is unaffected.
    assert_eq!(h.call(s0, barrier_of("solo", Members::Ranks(vec![0]), None)), Ok(Response::Done));
    // Rank 1 comes back: the next generation works.
    let s1 = h.rank("j", 1, 2);
    let a = h.send(s0, barrier("x", None));
    // Rank 1's first call is generation 1, which failed for its loss: it learns that,
    // as its own rank's, then joins generation 2.
    let OpError::PeerLost { op, peer } = e else { panic!("{e:?}") };
    assert_eq!(h.call(s1, barrier("x", None)).unwrap_err(), OpError::ThisRankLost { op, this: peer });
    assert_eq!(h.call(s1, barrier("x", None)), Ok(Response::Done));
    assert_eq!(ok(h.take(s0, a)), Response::Done);
}

#[test]
fn a_clean_leave_is_not_a_loss() {
    let (mut h, s0, s1, a) = rank_0_waiting(Config::default());
    h.leave(s1);
    assert!(h.pending(s0, a), "a barrier keeps waiting for a rank that left");
    let s1 = h.rank("j", 1, 2);
    assert_eq!(h.call(s1, barrier("x", None)), Ok(Response::Done));
    assert_eq!(ok(h.take(s0, a)), Response::Done);
}

#[test]
fn a_rank_with_another_open_session_is_not_lost() {
    let mut h = Harness::new();
    let s0 = h.rank("j", 0, 2);
    let s1a = h.rank("j", 1, 2);
    let s1b = h.rank("j", 1, 2);
    let a = h.send(s0, barrier("x", None));
    h.kill(s1a);
    assert!(h.pending(s0, a));
    assert_eq!(h.call(s1b, barrier("x", None)), Ok(Response::Done));
    assert_eq!(ok(h.take(s0, a)), Response::Done);
}

#[test]
fn a_silent_rank_is_lost_when_its_lease_expires_and_revives_when_heard() {
    let (mut h, s0, s1, a) = rank_0_waiting_under_a_1s_lease();
    steps_of_400ms(&mut h, s0, 5, |_| {});
    let e = err(h.take(s0, a));
    let OpError::PeerLost { peer, .. } = &e else { panic!("{e:?}") };
    assert_eq!(peer.rank, 1);
    assert_eq!(peer.state, RankState::Lost(LossReason::LeaseExpired { lease_ms: 1_000 }));
    assert!(e.to_string().contains("no heartbeat for 1.0 s"), "{e}");
    // It speaks again: alive; rank 0 was never lost because it kept heartbeating.
    h.call(s1, Request::Heartbeat).unwrap();
    let a = h.send(s0, barrier("x", None));
    // Rank 1's generation 1 had failed, for its own loss: it is told so.
    let own = h.call(s1, barrier("x", None)).unwrap_err();
    let OpError::ThisRankLost { op, this } = &own else { panic!("{own:?}") };
    assert_eq!((op.generation, this), (1, peer));
    assert_eq!(h.call(s1, barrier("x", None)), Ok(Response::Done));
    assert_eq!(ok(h.take(s0, a)), Response::Done);
}

#[test]
fn a_rank_lost_while_it_waits_is_told_that_it_is_the_one_lost() {
    let mut h = Harness::with_config(Config { lease_ms: 1_000, ..Config::default() });
    // A process states its incarnation (every client does): the rank's sessions are known.
    let ranks: Vec<_> = (0..3)
        .map(|r| {
            let identity = Identity { host: format!("node{r}"), pid: 1000 + r, ..Identity::ranked("j", r, 3) };
            h.open(Identity { incarnation: Some(0x100 + u64::from(r)), ..identity })
        })
        .collect();
    let (s0, s1) = (ranks[0], ranks[1]);
    let [a0, a1] = [s0, s1].map(|s| h.send(s, barrier("x", Some(60_000))));
    // Rank 1 is stopped for longer than its lease; rank 2 never arrives but heartbeats.
    steps_of_400ms(&mut h, s0, 3, |h| h.call(ranks[2], Request::Heartbeat).map(|_| ()).unwrap());
    let e = err(h.take(s0, a0));
    let OpError::PeerLost { peer, .. } = &e else { panic!("{e:?}") };
    assert_eq!(peer.rank, 1);
    // Rank 1 runs again and reads its reply: itself named, as itself.
    let own = err(h.take(s1, a1));
    let OpError::ThisRankLost { op, this } = &own else { panic!("{own:?}") };
    assert_eq!((op.name.as_str(), this), ("x", peer));
    assert!(
        own.to_string().starts_with(
            "barrier 'x' (generation 1) failed: this process's rank 1 (host node1, pid 1001, lost: no heartbeat"
        ) && own
            .to_string()
            .contains("was declared lost, and its peers were told so (it sent nothing for a whole lease"),
        "{own}"
    );
    // Rank 2 comes to the failed generation later: rank 1 is its peer.
    assert_eq!(h.call(ranks[2], barrier("x", None)).unwrap_err(), e);
}

#[test]
fn a_lost_rank_fails_all_gather_but_broadcast_only_when_it_is_the_root() {
    let mut h = Harness::new();
    let s: Vec<_> = (0..3).map(|r| h.rank("j", r, 3)).collect();
    let bc = h.send(
        s[0],
        Request::Broadcast { name: "b".into(), members: Members::World, root: 1, value: None, timeout_ms: None },
    );
    let ag = h.send(
        s[0],
        Request::AllGather { name: "g".into(), members: Members::World, value: "x".into(), timeout_ms: None },
    );
    h.kill(s[2]);
    assert!(h.pending(s[0], bc), "rank 2 is not the broadcast's root");
    assert!(matches!(err(h.take(s[0], ag)), OpError::PeerLost { peer, .. } if peer.rank == 2));
    h.kill(s[1]);
    assert!(matches!(err(h.take(s[0], bc)), OpError::PeerLost { peer, .. } if peer.rank == 1));
}

#[test]
fn idle_jobs_are_forgotten_after_their_ttl() {
    let mut h = Harness::with_config(Config { job_idle_ttl_ms: 1_000, ..Config::default() });
    let s = h.rank("j", 0, 1);
    h.call(s, Request::Set { key: "k".into(), value: "v".into() }).unwrap();
    h.leave(s);
    h.advance(999);
    let s = h.rank("j", 0, 1);
    assert_eq!(h.call(s, Request::NumKeys), Ok(Response::Int(1)), "still there within the ttl");
    h.leave(s);
    h.advance(1_000);
    let s = h.rank("j", 0, 1);
    assert_eq!(h.call(s, Request::NumKeys), Ok(Response::Int(0)));
}

#[test]
fn a_job_that_holds_nothing_is_forgotten_when_its_last_session_closes() {
    let mut h = Harness::new();
    let jobs = |h: &Harness| h.engine.metrics(h.now).into_iter().map(|m| m.name).collect::<Vec<_>>();
    let keeps = h.open(Identity::anonymous("keeps"));
    h.call(keeps, Request::Set { key: "k".into(), value: "v".into() }).unwrap();
    // A tool's look at a mistyped job, which then leaves.
    let typo = h.open(Identity::anonymous("typo"));
    assert!(h.call(typo, Request::Check { keys: vec!["k".into()] }).is_ok());
    assert_eq!(jobs(&h), ["keeps", "typo"]);
    h.leave(typo);
    h.leave(keeps);
    h.advance(1);
    assert_eq!(jobs(&h), ["keeps"], "the job with a key stays for its ttl");
}

#[test]
fn a_rank_taking_in_a_long_write_keeps_its_lease() {
    let (mut h, s0, s1, a) = rank_0_waiting_under_a_1s_lease();
    // Rank 1 sends nothing for 2 s, but the server's write to it keeps making progress.
    steps_of_400ms(&mut h, s0, 5, |h| h.engine.alive(s1, h.now));
    assert!(h.pending(s0, a), "rank 1 is not lost while it takes in a write");
    // Once that stops too, the lease runs out as usual.
    steps_of_400ms(&mut h, s0, 3, |_| {});
    let OpError::PeerLost { peer, .. } = err(h.take(s0, a)) else { panic!("rank 1 lost") };
    assert_eq!(peer.state, RankState::Lost(LossReason::LeaseExpired { lease_ms: 1_000 }));
}

#[test]
fn every_request_keeps_a_lease_even_those_answered_outside_a_jobs_step() {
    // Clients skip heartbeats while their calls flow: each of these must count.
    for request in [Request::Jobs, Request::Snapshot, Request::Status, Request::NumKeys] {
        let (mut h, s0, s1, a) = rank_0_waiting_under_a_1s_lease();
        steps_of_400ms(&mut h, s0, 5, |h| {
            h.call(s1, request.clone()).unwrap();
        });
        assert!(h.pending(s0, a), "rank 1 calling {} for 2 s is not lost", request.name());
    }
}

#[test]
fn lost_ranks_lists_who_was_lost_how_and_when_last_heard_from() {
    let (mut h, s0, _s1, _) = rank_0_waiting_under_a_1s_lease();
    let other = h.rank("other", 0, 1);
    assert!(h.engine.lost_ranks("j", h.now).is_empty());
    h.kill(other);
    // Rank 1 goes silent while rank 0 heartbeats: its lease expires.
    steps_of_400ms(&mut h, s0, 3, |_| {});
    let lost = h.engine.lost_ranks("j", h.now);
    assert_eq!(lost.len(), 1, "{lost:?}");
    assert_eq!((lost[0].rank, lost[0].state), (1, RankState::Lost(LossReason::LeaseExpired { lease_ms: 1_000 })));
    assert_eq!(lost[0].last_seen_ms_ago, Some(1_200), "last heard from when it connected");
    assert_eq!((lost[0].host.as_deref(), lost[0].pid), (Some("node1"), Some(1001)));
    // Another job's loss is its own, and says how it happened.
    let other: Vec<_> = h.engine.lost_ranks("other", h.now).into_iter().map(|i| (i.rank, i.state)).collect();
    assert_eq!(other, [(0, RankState::Lost(LossReason::Disconnected))]);
    assert!(h.engine.lost_ranks("no such job", h.now).is_empty());
}

#[test]
fn a_job_is_quiet_since_its_last_request_heartbeats_and_status_requests_aside() {
    let mut h = Harness::new();
    assert_eq!(h.engine.quiet_ms("j", h.now), None, "no such job");
    let s0 = h.rank("j", 0, 2);
    assert_eq!(h.engine.quiet_ms("j", h.now), Some(0), "connecting is asking");
    h.advance(500);
    h.call(s0, Request::Set { key: b("k"), value: b("v") }).expect("set");
    h.advance(300);
    assert_eq!(h.engine.quiet_ms("j", h.now), Some(300));
    // A rank blocked in a wait asks nothing more while it waits.
    h.send(s0, Request::Get { key: b("never"), timeout_ms: None });
    h.advance(700);
    for request in [Request::Heartbeat, Request::Status] {
        h.call(s0, request).expect("answered");
        h.advance(100);
    }
    assert_eq!(h.engine.quiet_ms("j", h.now), Some(900), "heartbeats and status requests are not activity");
    // Nor is a tool connecting to look (`rallypoint status`).
    let tool = h.open(Identity::anonymous("j"));
    h.call(tool, Request::Status).expect("status");
    assert_eq!(h.engine.quiet_ms("j", h.now), Some(900));
    // Another job's requests are its own.
    let other = h.rank("other", 0, 1);
    h.call(other, Request::Set { key: b("k"), value: b("v") }).expect("set");
    assert_eq!(h.engine.quiet_ms("j", h.now), Some(900));
    assert_eq!(h.engine.quiet_ms("other", h.now), Some(0));
    h.leave(s0);
    assert_eq!(h.engine.quiet_ms("j", h.now).map(|q| q >= 900), Some(true), "leaving is not asking");
}

/// Job "j"'s ranks lost so far: (connection dropped, lease expired, process exited).
fn lost_counts(h: &Harness) -> (u64, u64, u64) {
    lost_counts_of(h).expect("job j")
}

fn lost_counts_of(h: &Harness) -> Option<(u64, u64, u64)> {
    let m = h.engine.metrics(h.now).into_iter().find(|m| m.name == "j")?;
    Some((m.counters.ranks_lost_disconnected, m.counters.ranks_lost_lease, m.counters.ranks_lost_exited))
}

/// What a launcher that saw rank `rank`'s worker end says of it: the worker is
/// process `2000 + rank` on `node<rank>` (a wrapper of the rank's process `1000 + rank`).
fn report_exit(h: &mut Harness, rank: u32, exit: Exit) -> Reply {
    h.report_exit("j", rank, &format!("node{rank}"), 2000 + rank, exit)
}

fn snapshot_rank(h: &mut Harness, rank: usize) -> RankView {
    h.snapshot("j").ranks[rank].clone()
}

#[test]
fn a_rank_its_launcher_saw_end_fails_its_peers_at_once_though_its_connection_is_open() {
    let mut h = Harness::new();
    let s: Vec<_> = (0..4).map(|r| h.rank("j", r, 4)).collect();
    let ids: Vec<_> = (0..3).map(|r| h.send(s[r], barrier("step", Some(60_000)))).collect();
    h.advance(300);
    assert_eq!(report_exit(&mut h, 3, Exit::Signal(9)), Ok(Response::Done));
    for r in 0..3 {
        let e = err(h.take(s[r], ids[r]));
        let OpError::PeerLost { op, peer } = &e else { panic!("{e:?}") };
        assert_eq!((op.name.as_str(), peer.rank, peer.pid), ("step", 3, Some(1003)));
        assert_eq!(peer.state, RankState::Lost(LossReason::Exited { pid: 2003, exit: Exit::Signal(9) }));
        // Last known alive when the coordinator learnt of its end, not at its last
        // request 300 ms before: the launcher judges causes by that time.
        assert_eq!(peer.last_seen_ms_ago, Some(0));
        assert!(
            e.to_string().contains("rank 3 (host node3, pid 1003, lost: worker pid 2003 was killed by SIGKILL"),
            "{e}"
        );
    }
    // Its connection drops later: nothing is failed twice, the reason stays.
    h.kill(s[3]);
    assert!(h.replies.is_empty(), "{:?}", h.replies);
    let view = snapshot_rank(&mut h, 3);
    let lost = view.lost.expect("lost");
    assert_eq!((lost.reason.as_str(), lost.signal, lost.exit_code), ("exited", Some(9), None));
    assert_eq!(lost_counts(&h), (0, 0, 1));
    // A later call needing it fails at once, naming the same end.
    let e = h.call(s[0], barrier("next", None)).unwrap_err();
    assert!(e.to_string().contains("worker pid 2003 was killed by SIGKILL"), "{e}");
}

#[test]
fn an_end_reported_after_the_connection_dropped_names_the_loss_without_failing_anything_twice() {
    let (mut h, s0, s1, a) = rank_0_waiting(Config::default());
    h.kill(s1);
    let e = err(h.take(s0, a));
    assert!(matches!(&e, OpError::PeerLost { peer, .. } if peer.state == RankState::Lost(LossReason::Disconnected)));
    assert_eq!(report_exit(&mut h, 1, Exit::Code(3)), Ok(Response::Done));
    assert!(h.replies.is_empty(), "{:?}", h.replies);
    let lost = snapshot_rank(&mut h, 1).lost.expect("lost");
    assert_eq!(
        (lost.reason.as_str(), lost.exit_code, lost.text.as_str()),
        ("exited", Some(3), "worker pid 2001 exited with code 3")
    );
    assert_eq!(lost_counts(&h), (1, 0, 0), "counted by how it was first lost");
    // A rank that ends twice is reported once more for nothing.
    assert_eq!(report_exit(&mut h, 1, Exit::Code(3)), Ok(Response::Done));
    assert_eq!(lost_counts(&h), (1, 0, 0));
}

#[test]
fn a_rank_lost_by_lease_keeps_that_reason_when_its_end_is_reported() {
    let (mut h, s0, _s1, a) = rank_0_waiting_under_a_1s_lease();
    steps_of_400ms(&mut h, s0, 5, |_| {});
    let e = err(h.take(s0, a));
    assert!(e.to_string().contains("no heartbeat for 1.0 s"), "{e}");
    assert_eq!(report_exit(&mut h, 1, Exit::Signal(15)), Ok(Response::Done));
    let lost = snapshot_rank(&mut h, 1).lost.expect("lost");
    assert_eq!(lost.reason, "lease_expired");
    assert_eq!(lost_counts(&h), (0, 1, 0));
}

#[test]
fn a_rank_whose_worker_exited_0_fails_what_still_needs_it_at_once_as_finished_not_lost() {
    let mut h = Harness::new();
    let s: Vec<_> = (0..4).map(|r| h.rank("j", r, 4)).collect();
    let ids: Vec<_> = (0..3).map(|r| h.send(s[r], barrier("final", Some(60_000)))).collect();
    // Rank 3 skipped the barrier: it leaves cleanly, which alone leaves its peers
    // waiting (a rank that left may come back), then its launcher sees it exit 0.
    h.leave(s[3]);
    assert!(h.pending(s[0], ids[0]), "a barrier keeps waiting for a rank that left");
    h.advance(200);
    assert_eq!(report_exit(&mut h, 3, Exit::Code(0)), Ok(Response::Done));
    for r in 0..3 {
        let e = err(h.take(s[r], ids[r]));
        let OpError::PeerLost { op, peer } = &e else { panic!("{e:?}") };
        assert_eq!((op.name.as_str(), peer.rank, peer.pid), ("final", 3, Some(1003)));
        assert_eq!(peer.state, RankState::Finished { pid: 2003 });
        assert!(
            e.to_string().ends_with(
                "rank 3 (host node3, pid 1003, finished: worker pid 2003 exited with code 0, last seen 0.0 s ago) \
                 finished before it completed"
            ),
            "{e}"
        );
    }
    // A later call needing it fails at once; one that does not is unaffected.
    let e = h.call(s[0], barrier("next", None)).unwrap_err();
    assert!(matches!(&e, OpError::PeerLost { peer, .. } if peer.state == RankState::Finished { pid: 2003 }), "{e}");
    let pair = Members::Ranks(vec![0, 1]);
    let x = h.send(s[0], barrier_of("pair", pair.clone(), None));
    assert_eq!(h.call(s[1], barrier_of("pair", pair, None)), Ok(Response::Done));
    assert_eq!(ok(h.take(s[0], x)), Response::Done);
    // Finished, not lost: no loss counted, and shown as such.
    assert_eq!(lost_counts(&h), (0, 0, 0));
    let view = snapshot_rank(&mut h, 3);
    assert_eq!((view.state, view.lost), (RankStatus::Finished, None));
    let finished = view.finished.expect("finished");
    assert_eq!((finished.worker_pid, finished.text.as_str()), (2003, "worker pid 2003 exited with code 0"));
    let summary = h.snapshot("j").ranks_summary;
    assert_eq!((summary.connected, summary.left, summary.finished, summary.lost), (3, 0, 1, 0));
    // Its early end stranded its peers: a launcher blames it.
    let lost: Vec<_> = h.engine.lost_ranks("j", h.now).into_iter().map(|i| (i.rank, i.state)).collect();
    assert_eq!(lost, [(3, RankState::Finished { pid: 2003 })]);
    // Its process is back after all (the launcher saw a wrapper end): it stands as it says.
    let s3 = h.rank("j", 3, 4);
    let ids: Vec<_> = (0..3).map(|r| h.send(s[r], barrier("again", None))).collect();
    assert_eq!(h.call(s3, barrier("again", None)), Ok(Response::Done));
    for r in 0..3 {
        assert_eq!(ok(h.take(s[r], ids[r])), Response::Done);
    }
}

#[test]
fn ranks_that_finish_after_their_peers_fail_nothing_and_are_not_blamed() {
    let mut h = Harness::new();
    let s: Vec<_> = (0..3).map(|r| h.rank("j", r, 3)).collect();
    let ids: Vec<_> = (0..2).map(|r| h.send(s[r], barrier("last", None))).collect();
    assert_eq!(h.call(s[2], barrier("last", None)), Ok(Response::Done));
    for r in 0..2 {
        assert_eq!(ok(h.take(s[r], ids[r])), Response::Done);
    }
    // Rank 2 is done first; rank 0 and 1 go on without it (key-value work), then end.
    h.leave(s[2]);
    assert_eq!(report_exit(&mut h, 2, Exit::Code(0)), Ok(Response::Done));
    assert!(h.replies.is_empty(), "{:?}", h.replies);
    assert_eq!(h.call(s[0], Request::Set { key: b("k"), value: b("v") }), Ok(Response::Done));
    assert!(h.engine.lost_ranks("j", h.now).is_empty(), "nobody waited for it");
    let Response::Value(text) = ok(Some(h.call(s[0], Request::Status))) else { panic!("status is text") };
    let text = String::from_utf8_lossy(&text).into_owned();
    assert!(text.contains("ranks: 2 connected, 0 left cleanly, 1 finished, 0 lost\n"), "{text}");
    assert!(text.contains("finished (worker exited with code 0): rank 2\n"), "{text}");
    assert!(!text.contains("lost: rank 2"), "{text}");
    for (rank, &session) in (0..).zip(&s[..2]) {
        h.leave(session);
        assert_eq!(report_exit(&mut h, rank, Exit::Code(0)), Ok(Response::Done));
    }
    let summary = h.snapshot("j").ranks_summary;
    assert_eq!((summary.connected, summary.finished, summary.lost), (0, 3, 0));
    assert_eq!(lost_counts(&h), (0, 0, 0));
}

#[test]
fn a_worker_that_exits_0_while_its_rank_holds_a_session_finishes_the_rank_at_that_sessions_close() {
    for clean in [true, false] {
        let (mut h, s0, s1, a) = rank_0_waiting(Config::default());
        // A child of the worker still holds the rank's session (or its close is yet to be read).
        assert_eq!(report_exit(&mut h, 1, Exit::Code(0)), Ok(Response::Done));
        assert!(h.pending(s0, a), "the rank's session is open: it may still arrive");
        assert_eq!(snapshot_rank(&mut h, 1).state, RankStatus::Connected);
        if clean {
            h.leave(s1);
        } else {
            h.kill(s1);
        }
        let e = err(h.take(s0, a));
        let OpError::PeerLost { peer, .. } = &e else { panic!("{e:?}") };
        assert_eq!(peer.state, RankState::Finished { pid: 2001 }, "clean close: {clean}");
        assert_eq!(lost_counts(&h), (0, 0, 0), "clean close: {clean}");
    }
}

#[test]
fn a_rank_whose_connection_dropped_then_whose_worker_exited_0_is_finished_not_lost() {
    // What a torch process does when done: it drops its connection, then exits 0.
    let (mut h, s0, s1, a) = rank_0_waiting(Config::default());
    h.kill(s1);
    assert!(
        matches!(err(h.take(s0, a)), OpError::PeerLost { peer, .. } if peer.state == RankState::Lost(LossReason::Disconnected))
    );
    assert_eq!(report_exit(&mut h, 1, Exit::Code(0)), Ok(Response::Done));
    assert!(h.replies.is_empty(), "nothing failed twice: {:?}", h.replies);
    assert_eq!(snapshot_rank(&mut h, 1).state, RankStatus::Finished);
    let summary = h.snapshot("j").ranks_summary;
    assert_eq!((summary.finished, summary.lost), (1, 0));
    // Its drop failed a barrier: a launcher still blames it, now as finished.
    let lost: Vec<_> = h.engine.lost_ranks("j", h.now).into_iter().map(|i| (i.rank, i.state)).collect();
    assert_eq!(lost, [(1, RankState::Finished { pid: 2001 })]);
    assert_eq!(h.engine.failed_for("j"), [1]);
}

#[test]
fn a_rank_whose_worker_exited_0_before_it_connected_is_finished_by_the_launchers_word() {
    let mut h = Harness::new();
    let s0 = h.rank("j", 0, 3);
    let a = h.send(s0, barrier("x", Some(5_000)));
    assert_eq!(report_exit(&mut h, 2, Exit::Code(0)), Ok(Response::Done));
    let e = err(h.take(s0, a));
    // Timed by the launcher's word, the only news of it.
    let finished = "rank 2 (host node2, pid 2002, finished: worker pid 2002 exited with code 0, last seen 0.0 s ago)";
    assert!(e.to_string().contains(finished), "{e}");
    let s = h.snapshot("j").ranks_summary;
    assert_eq!((s.connected, s.finished, s.lost, s.never_connected), (1, 1, 0, 1));
    assert_eq!(lost_counts(&h), (0, 0, 0));
}

#[test]
fn a_rank_whose_worker_ended_before_it_connected_is_lost_by_the_launchers_word() {
    let mut h = Harness::new();
    let s0 = h.rank("j", 0, 3);
    let a = h.send(s0, barrier("x", Some(5_000)));
    // A crash at start: rank 2's worker never connected.
    assert_eq!(report_exit(&mut h, 2, Exit::Code(1)), Ok(Response::Done));
    let e = err(h.take(s0, a));
    let OpError::PeerLost { peer, .. } = &e else { panic!("{e:?}") };
    assert_eq!(
        (peer.rank, peer.host.as_deref(), peer.pid, peer.last_seen_ms_ago),
        (2, Some("node2"), Some(2002), None)
    );
    assert!(e.to_string().contains("rank 2 (host node2, pid 2002, lost: worker pid 2002 exited with code 1)"), "{e}");
    assert_eq!(lost_counts(&h), (0, 0, 1));
    assert_eq!(report_exit(&mut h, 2, Exit::Code(1)), Ok(Response::Done), "said twice, counted once");
    assert_eq!(lost_counts(&h), (0, 0, 1));
    let s = h.snapshot("j").ranks_summary;
    assert_eq!((s.connected, s.lost, s.never_connected), (1, 1, 1), "rank 1 never connected; rank 2 is lost");
    // Later calls needing it fail at once; one that does not is unaffected.
    assert!(matches!(h.call(s0, barrier("y", None)), Err(OpError::PeerLost { peer, .. }) if peer.rank == 2));
    // Its process turns up after all (the launcher saw a wrapper end): it stands as it says.
    let s2 = h.rank("j", 2, 3);
    let s1 = h.rank("j", 1, 3);
    let b = h.send(s0, barrier("z", None));
    let c = h.send(s1, barrier("z", None));
    assert_eq!(h.call(s2, barrier("z", None)), Ok(Response::Done));
    assert_eq!((ok(h.take(s0, b)), ok(h.take(s1, c))), (Response::Done, Response::Done));
}

#[test]
fn an_end_reported_out_of_range_or_before_any_rank_is_refused_or_changes_nothing() {
    let mut h = Harness::new();
    // No rank said how many there are: nobody waits, nothing to lose.
    assert_eq!(report_exit(&mut h, 5, Exit::Code(1)), Ok(Response::Done));
    assert!(lost_counts_of(&h).is_none_or(|c| c == (0, 0, 0)));
    let _s0 = h.rank("j", 0, 3);
    let e = report_exit(&mut h, 3, Exit::Code(1)).unwrap_err();
    assert_eq!(e, OpError::Invalid("rank 3 is out of range for world size 3".into()));
    assert_eq!(lost_counts(&h), (0, 0, 0));
}
