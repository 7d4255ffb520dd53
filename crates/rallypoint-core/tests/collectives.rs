//! Barriers, all-gather and broadcast: reuse by per-rank generation, member sets,
//! mismatches, timeouts that name the missing, and abort.

mod common;

use bytes::Bytes;
use common::{b, barrier, barrier_of, err, ok, Harness};
use rallypoint_core::{CollectiveKind, Config, Identity, Limits, Members, OpError, RankState, Request, Response};

#[test]
fn barrier_releases_exactly_when_the_last_member_arrives_and_is_reusable() {
    let mut h = Harness::new();
    let s: Vec<_> = (0..4).map(|r| h.rank("j", r, 4)).collect();
    for round in 0..3 {
        let mut ids = Vec::new();
        for (r, &sess) in s.iter().enumerate() {
            ids.push(h.send(sess, barrier("step", None)));
            let all_in = r == 3;
            for (&sess, &id) in s.iter().zip(&ids) {
                assert_eq!(h.pending(sess, id), !all_in, "round {round} after rank {r}");
            }
        }
        for (&sess, &id) in s.iter().zip(&ids) {
            assert_eq!(ok(h.take(sess, id)), Response::Done);
        }
    }
}

#[test]
fn generations_of_a_rank_that_called_before_the_world_connected_are_kept() {
    // Rank 3 is counted before the job knows any other rank, then after all have
    // connected: its calls keep joining generations 1, 2, 3 in turn.
    let mut h = Harness::new();
    let r3 = h.rank("j", 3, 4);
    let early: Vec<u64> = (0..2).map(|_| h.send(r3, barrier("step", None))).collect();
    let others: Vec<_> = (0..3).map(|r| h.rank("j", r, 4)).collect();
    let late = h.send(r3, barrier("step", None));
    for (generation, mine) in early.iter().chain([&late]).enumerate() {
        let ids: Vec<u64> = others.iter().map(|&s| h.send(s, barrier("step", None))).collect();
        assert_eq!(ok(h.take(r3, *mine)), Response::Done, "generation {}", generation + 1);
        for (&s, &id) in others.iter().zip(&ids) {
            assert_eq!(ok(h.take(s, id)), Response::Done);
        }
        if generation < 2 {
            assert!(h.pending(r3, late), "rank 3's third call released with generation {}", generation + 1);
        }
    }
}

#[test]
fn generations_are_counted_per_rank_across_sessions() {
    // A shell loop: each call of rank 0 is a new session that leaves afterwards.
    let mut h = Harness::new();
    let r1 = h.rank("j", 1, 2);
    let first = h.send(r1, barrier("step", None));
    let second = h.send(r1, barrier("step", None));
    for gen in 0..2 {
        let r0 = h.rank("j", 0, 2);
        let id = h.send(r0, barrier("step", None));
        assert_eq!(ok(h.take(r0, id)), Response::Done, "generation {gen}");
        h.leave(r0);
    }
    assert_eq!(ok(h.take(r1, first)), Response::Done);
    assert_eq!(ok(h.take(r1, second)), Response::Done);
}

#[test]
fn subgroup_barrier_waits_only_for_its_members() {
    let mut h = Harness::new();
    let s: Vec<_> = (0..6).map(|r| h.rank("j", r, 6)).collect();
    let members = Members::Ranks(vec![5, 0, 2, 2]);
    let a = h.send(s[0], barrier_of("sub", members.clone(), None));
    let c = h.send(s[2], barrier_of("sub", members.clone(), None));
    assert!(h.pending(s[0], a));
    let d = h.send(s[5], barrier_of("sub", Members::Ranks(vec![0, 2, 5]), None));
    for (sess, id) in [(s[0], a), (s[2], c), (s[5], d)] {
        assert_eq!(ok(h.take(sess, id)), Response::Done);
    }
    // A non-member calling is told so, and it does not count as an arrival.
    let e = h.call(s[1], barrier_of("sub", members, None)).unwrap_err();
    assert!(
        matches!(&e, OpError::BadMembers { reason, .. } if reason.contains("rank 1") && reason.contains("[0,2,5]")),
        "{e}"
    );
}

#[test]
fn role_barrier_resolves_once_every_rank_is_known() {
    let mut h = Harness::new();
    let w0 = h.role_rank("j", 0, 4, "workers");
    let w2 = h.role_rank("j", 2, 4, "workers");
    let a = h.send(w0, barrier_of("r", Members::Role("workers".into()), None));
    let c = h.send(w2, barrier_of("r", Members::Role("workers".into()), None));
    // Ranks 1 and 3 never connected: their roles are unknown, so the barrier waits.
    assert!(h.pending(w0, a));
    let s1 = h.role_rank("j", 1, 4, "servers");
    assert!(h.pending(w0, a));
    let report = status(&mut h, "j");
    assert!(
        report.contains(
            "waiting: barrier 'r' (generation 1) over role 'workers' for 0.0 s: 2 of ? (a role's members are known once every rank connected) \
             arrived; missing (1): rank 3 (never connected)\n"
        ),
        "rank 1 is a server, rank 3 may be a worker: {report}"
    );
    let _s3 = h.role_rank("j", 3, 4, "servers");
    assert_eq!(ok(h.take(w0, a)), Response::Done);
    assert_eq!(ok(h.take(w2, c)), Response::Done);
    let e = h.call(s1, barrier_of("r", Members::Role("workers".into()), None)).unwrap_err();
    assert!(e.to_string().contains("role 'servers'"), "{e}");
}

#[test]
fn mismatched_members_or_world_size_fail_everyone_naming_both_calls() {
    let mut h = Harness::new();
    let s0 = h.rank("j", 0, 4);
    let s1 = h.rank("j", 1, 4);
    let a = h.send(s0, barrier("x", None));
    let e = h.call(s1, barrier_of("x", Members::Ranks(vec![0, 1]), None)).unwrap_err();
    let OpError::Mismatch { op, mine, theirs } = &e else { panic!("{e:?}") };
    assert_eq!((op.generation, mine.rank, theirs.rank), (1, 1, 0));
    assert_eq!(theirs.members, Members::World);
    // Each is told its own call as `mine`.
    let OpError::Mismatch { mine: mine0, theirs: theirs0, .. } = err(h.take(s0, a)) else { panic!("a mismatch") };
    assert_eq!((mine0, theirs0), (theirs.clone(), mine.clone()));
    let text = e.to_string();
    assert!(
        text.contains("rank 0 called it with all ranks") && text.contains("rank 1 called it with ranks [0,1]"),
        "{text}"
    );

    // Crossed the other way, with a third rank: the subgroup first, then the whole
    // job, which nobody waited in yet; a later call of it learns of the mismatch.
    let u: Vec<_> = (0..3).map(|r| h.rank("u", r, 3)).collect();
    let a = h.send(u[0], barrier_of("m", Members::Ranks(vec![0, 1]), None));
    let e = h.call(u[1], barrier("m", None)).unwrap_err();
    assert!(matches!(&e, OpError::Mismatch { mine, .. } if mine.rank == 1), "{e:?}");
    assert!(matches!(err(h.take(u[0], a)), OpError::Mismatch { mine, .. } if mine.rank == 0));
    let late = h.call(u[2], barrier("m", Some(60_000))).unwrap_err();
    let OpError::Mismatch { mine, theirs, .. } = late else { panic!("a mismatch, not a wait: {late:?}") };
    assert_eq!((mine.rank, mine.members, theirs.rank), (2, Members::World, 0));

    // Different world sizes in one generation.
    let t0 = h.rank("k", 0, 4);
    let t1 = h.rank("k", 1, 3);
    let a = h.send(t0, barrier("x", None));
    let e = h.call(t1, barrier("x", None)).unwrap_err();
    assert!(e.to_string().contains("world size 3") && e.to_string().contains("world size 4"), "{e}");
    let told = |e: &OpError| match e {
        OpError::Mismatch { mine, theirs, .. } => ((mine.rank, mine.world_size), (theirs.rank, theirs.world_size)),
        other => panic!("{other:?}"),
    };
    assert_eq!(told(&e), ((1, 3), (0, 4)));
    assert_eq!(told(&err(h.take(t0, a))), ((0, 4), (1, 3)));
    // A late arrival to the failed generation gets the same error, its call as `mine`.
    let t2 = h.rank("k", 2, 3);
    assert_eq!(told(&h.call(t2, barrier("x", None)).unwrap_err()), ((2, 3), (0, 4)));
    let t3 = h.rank("k", 3, 4);
    assert_eq!(told(&h.call(t3, barrier("x", None)).unwrap_err()), ((3, 4), (1, 3)));
}

#[test]
fn groups_that_share_a_name_wait_apart_in_any_order() {
    let ranks = |list: &[u32]| Members::Ranks(list.to_vec());
    // Two pairs, one barrier name: overlapping in time, then one after the other.
    let mut h = Harness::new();
    let s: Vec<_> = (0..4).map(|r| h.rank("j", r, 4)).collect();
    let a0 = h.send(s[0], barrier_of("x", ranks(&[0, 1]), None));
    let a2 = h.send(s[2], barrier_of("x", ranks(&[2, 3]), None));
    assert!(h.pending(s[0], a0) && h.pending(s[2], a2));
    assert_eq!(h.call(s[3], barrier_of("x", ranks(&[2, 3]), None)), Ok(Response::Done));
    assert_eq!(ok(h.take(s[2], a2)), Response::Done);
    assert!(h.pending(s[0], a0), "the other pair still waits for rank 1");
    assert_eq!(h.call(s[1], barrier_of("x", ranks(&[0, 1]), None)), Ok(Response::Done));
    assert_eq!(ok(h.take(s[0], a0)), Response::Done);
    // Counted apart: each pair's second round is its generation 2.
    let a0 = h.send(s[0], barrier_of("x", ranks(&[0, 1]), None));
    assert_eq!(h.call(s[1], barrier_of("x", ranks(&[0, 1]), None)), Ok(Response::Done));
    assert_eq!(ok(h.take(s[0], a0)), Response::Done);
    let a2 = h.send(s[2], barrier_of("x", ranks(&[2, 3]), Some(1_000)));
    h.advance(1_000);
    let OpError::CollectiveTimeout { op, missing, .. } = err(h.take(s[2], a2)) else { panic!("a timeout") };
    assert_eq!((op.generation, missing.iter().map(|m| m.rank).collect::<Vec<_>>()), (2, vec![3]));
    // One pair's failed generation is not the other's.
    let a0 = h.send(s[0], barrier_of("x", ranks(&[0, 1]), None));
    assert_eq!(h.call(s[1], barrier_of("x", ranks(&[0, 1]), None)), Ok(Response::Done));
    assert_eq!(ok(h.take(s[0], a0)), Response::Done);

    // Each role its own barrier of one name, before every rank has connected.
    let mut h = Harness::new();
    let even = |r: u32| if r.is_multiple_of(2) { "even" } else { "odd" };
    let s: Vec<_> = (0..3).map(|r| h.role_rank("r", r, 4, even(r))).collect();
    let role = |r: u32| barrier_of("rb", Members::Role(even(r).into()), None);
    let a: Vec<_> = (0..3).map(|r| h.send(s[r as usize], role(r))).collect();
    assert!(h.pending(s[0], a[0]) && h.pending(s[1], a[1]), "rank 3's role is not known yet");
    let s3 = h.role_rank("r", 3, 4, "odd");
    assert_eq!(ok(h.take(s[0], a[0])), Response::Done, "rank 3 is odd: the evens are all here");
    assert_eq!(ok(h.take(s[2], a[2])), Response::Done);
    assert_eq!(h.call(s3, role(3)), Ok(Response::Done));
    assert_eq!(ok(h.take(s[1], a[1])), Response::Done);
}

#[test]
fn a_subgroup_and_the_whole_job_may_share_a_name_in_an_order_that_meets() {
    // Ranks 0 and 1 sync as a pair, then everyone; ranks 2 and 3 are at the job's
    // barrier first: nobody waits for a rank that waits for it.
    let mut h = Harness::new();
    let s: Vec<_> = (0..4).map(|r| h.rank("j", r, 4)).collect();
    let world: Vec<_> = [2, 3].iter().map(|&r| h.send(s[r], barrier("x", None))).collect();
    let a0 = h.send(s[0], barrier_of("x", Members::Ranks(vec![0, 1]), None));
    assert_eq!(h.call(s[1], barrier_of("x", Members::Ranks(vec![0, 1]), None)), Ok(Response::Done));
    assert_eq!(ok(h.take(s[0], a0)), Response::Done);
    let a0 = h.send(s[0], barrier("x", None));
    assert_eq!(h.call(s[1], barrier("x", None)), Ok(Response::Done));
    assert_eq!(ok(h.take(s[0], a0)), Response::Done);
    for (&r, id) in [2, 3].iter().zip(world) {
        assert_eq!(ok(h.take(s[r], id)), Response::Done);
    }
    // Neighbours in a chain: each rank syncs with its left neighbour, then its right
    // one. Ranks 0, 2 and 3 wait at their first pair; rank 1 comes last.
    let mut h = Harness::new();
    let s: Vec<_> = (0..4).map(|r| h.rank("halo", r, 4)).collect();
    let pair = |left: u32| barrier_of("halo", Members::Ranks(vec![left, left + 1]), None);
    let first = [(0, 0), (2, 1), (3, 2)].map(|(r, left)| (r, h.send(s[r], pair(left))));
    assert!(first.iter().all(|&(r, id)| h.pending(s[r], id)));
    assert_eq!(h.call(s[1], pair(0)), Ok(Response::Done));
    assert_eq!(ok(h.take(s[0], first[0].1)), Response::Done);
    assert_eq!(h.call(s[1], pair(1)), Ok(Response::Done));
    assert_eq!(ok(h.take(s[2], first[1].1)), Response::Done);
    assert_eq!(h.call(s[2], pair(2)), Ok(Response::Done));
    assert_eq!(ok(h.take(s[3], first[2].1)), Response::Done);

    // Every rank listed is the job's barrier itself.
    let a0 = h.send(s[0], barrier_of("y", Members::Ranks(vec![3, 2, 1, 0]), None));
    let rest: Vec<_> = (1..4).map(|r| h.send(s[r], barrier("y", None))).collect();
    assert_eq!(ok(h.take(s[0], a0)), Response::Done);
    for (r, id) in (1..4).zip(rest) {
        assert_eq!(ok(h.take(s[r], id)), Response::Done);
    }
}

#[test]
fn a_call_after_its_generation_timed_out_is_told_it_came_late() {
    let mut h = Harness::new();
    let s0 = h.rank("j", 0, 2);
    let a = h.send(s0, barrier("step", Some(1_000)));
    h.advance(1_000);
    let OpError::CollectiveTimeout { before_call_ms, .. } = err(h.take(s0, a)) else { panic!("a timeout") };
    assert_eq!(before_call_ms, None, "it waited");
    h.advance(300);
    let s1 = h.rank("j", 1, 2);
    let e = h.call(s1, barrier("step", Some(30_000))).unwrap_err();
    assert!(matches!(e, OpError::CollectiveTimeout { before_call_ms: Some(300), .. }), "{e:?}");
    assert_eq!(
        e.to_string(),
        "barrier 'step' (generation 1) timed out after 1.0 s, 0.3 s before this call came: 1 of 2 ranks \
         missing: rank 1 (never connected)"
    );
    // Both are at generation 2 now, and meet there.
    let a = h.send(s0, barrier("step", None));
    assert_eq!(h.call(s1, barrier("step", None)), Ok(Response::Done));
    assert_eq!(ok(h.take(s0, a)), Response::Done);
}

#[test]
fn timeout_tells_every_waiter_each_missing_rank_and_its_state() {
    let mut h = Harness::new();
    let s: Vec<_> = (0..3).map(|r| h.rank("j", r, 5)).collect();
    // Rank 3 connects then leaves cleanly; rank 4 never connects; rank 2 is connected but late.
    let s3 = h.rank("j", 3, 5);
    h.advance(200);
    h.leave(s3);
    let a = h.send(s[0], barrier("sync", Some(2_000)));
    h.advance(500);
    let c = h.send(s[1], barrier("sync", Some(10_000)));
    h.advance(1_499);
    assert!(h.pending(s[0], a) && h.pending(s[1], c));
    h.advance(1);
    let e = err(h.take(s[0], a));
    assert_eq!(err(h.take(s[1], c)), e, "every waiter gets the same error");
    let OpError::CollectiveTimeout { op, waited_ms, members, missing, .. } = &e else { panic!("{e:?}") };
    assert_eq!((op.kind, op.name.as_str(), op.generation), (CollectiveKind::Barrier, "sync", 1));
    assert_eq!((*waited_ms, *members), (2_000, 5));
    let states: Vec<_> = missing.iter().map(|m| (m.rank, m.state)).collect();
    assert_eq!(states, vec![(2, RankState::Connected), (3, RankState::Left), (4, RankState::NeverConnected)]);
    assert_eq!(missing[0].host.as_deref(), Some("node2"));
    assert_eq!(missing[0].pid, Some(1002));
    assert_eq!(missing[1].last_seen_ms_ago, Some(2_000));
    let text = e.to_string();
    for needle in [
        "3 of 5 ranks missing",
        "rank 2 (host node2, pid 1002, connected but not arrived",
        "rank 3 (host node3, pid 1003, left cleanly, last seen 2.0 s ago)",
        "rank 4 (never connected)",
    ] {
        assert!(text.contains(needle), "{needle:?} not in {text}");
    }
    // The latecomer learns the generation failed, and that it came after; the next
    // generation works.
    let OpError::CollectiveTimeout { before_call_ms: late, .. } = h.call(s[2], barrier("sync", None)).unwrap_err()
    else {
        panic!("a timeout")
    };
    assert_eq!(late, Some(0));
}

#[test]
fn all_gather_returns_values_in_rank_order_and_is_reusable() {
    let mut h = Harness::new();
    let s: Vec<_> = (0..3).map(|r| h.rank("j", r, 3)).collect();
    for round in 0..2 {
        let ids: Vec<_> = [2usize, 0, 1]
            .iter()
            .map(|&r| {
                let value = Bytes::from(format!("r{r}g{round}"));
                (
                    r,
                    h.send(
                        s[r],
                        Request::AllGather { name: "g".into(), members: Members::World, value, timeout_ms: None },
                    ),
                )
            })
            .collect();
        let expected: Vec<Bytes> = (0..3).map(|r| Bytes::from(format!("r{r}g{round}"))).collect();
        for (r, id) in ids {
            match ok(h.take(s[r], id)) {
                Response::Gathered(gathered) => assert_eq!(gathered.to_vec(), expected),
                other => panic!("{other:?}"),
            }
        }
    }
}

#[test]
fn broadcast_hands_out_the_roots_value_without_waiting_for_everyone() {
    let mut h = Harness::new();
    let s: Vec<_> = (0..3).map(|r| h.rank("j", r, 3)).collect();
    let bc = |value: Option<Bytes>| Request::Broadcast {
        name: "cfg".into(),
        members: Members::World,
        root: 1,
        value,
        timeout_ms: Some(1_000),
    };
    let a = h.send(s[0], bc(None));
    assert!(h.pending(s[0], a));
    let root = h.send(s[1], bc(Some(b("lr=0.1"))));
    assert_eq!(ok(h.take(s[0], a)), Response::Value(b("lr=0.1")));
    assert_eq!(ok(h.take(s[1], root)), Response::Value(b("lr=0.1")));
    let late = h.send(s[2], bc(Some(b("ignored"))));
    assert_eq!(ok(h.take(s[2], late)), Response::Value(b("lr=0.1")));
    // The root must give a value.
    let e = h.call(s[1], bc(None)).unwrap_err();
    assert!(e.to_string().contains("root (rank 1) must provide a value"), "{e}");
}

#[test]
fn broadcast_timeout_names_only_the_root() {
    let mut h = Harness::new();
    let s: Vec<_> = (0..3).map(|r| h.rank("j", r, 3)).collect();
    let a = h.send(
        s[0],
        Request::Broadcast { name: "b".into(), members: Members::World, root: 2, value: None, timeout_ms: Some(100) },
    );
    h.advance(100);
    let OpError::CollectiveTimeout { missing, .. } = err(h.take(s[0], a)) else { panic!() };
    assert_eq!(missing.iter().map(|m| m.rank).collect::<Vec<_>>(), vec![2]);
}

fn status(h: &mut Harness, job: &str) -> String {
    let tool = h.open(Identity::anonymous(job));
    let Response::Value(report) = ok(Some(h.call(tool, Request::Status))) else { panic!("status is text") };
    h.leave(tool);
    String::from_utf8_lossy(&report).into_owned()
}

#[test]
fn status_says_who_waits_in_which_collective_and_who_is_missing() {
    let mut h = Harness::new();
    let world = 4;
    let s: Vec<_> = (0..3).map(|r| h.rank("j", r, world)).collect();
    // Ranks 0 and 1 wait at barrier 'step'; 2 is connected elsewhere, 3 never came.
    let waits: Vec<u64> = s[..2].iter().map(|&sess| h.send(sess, barrier("step", None))).collect();
    // Rank 2 waits for root 3 in a broadcast; rank 0 once more in an all-gather of {0, 1}.
    h.send(
        s[2],
        Request::Broadcast { name: "cfg".into(), members: Members::World, root: 3, value: None, timeout_ms: None },
    );
    let gather = Request::AllGather {
        name: "pair".into(),
        members: Members::Ranks(vec![0, 1]),
        value: b("x"),
        timeout_ms: None,
    };
    h.send(s[0], gather);
    h.advance(1_500);
    let report = status(&mut h, "j");
    assert!(report.contains("ranks: 3 connected, 0 left cleanly, 0 lost, 1 of 4 never connected\n"), "{report}");
    let lines: Vec<&str> = report.lines().filter(|l| l.starts_with("waiting: ")).collect();
    assert_eq!(
        lines,
        vec![
            "waiting: broadcast 'cfg' (generation 1) for 1.5 s: 1 of 4 arrived; the root has not arrived (1): rank 3 (never connected)",
            "waiting: all-gather 'pair' (generation 1) over ranks [0,1] for 1.5 s: 1 of 2 arrived; missing (1): \
             rank 1 (host node1, pid 1001, connected but not arrived, last seen 1.5 s ago)",
            "waiting: barrier 'step' (generation 1) for 1.5 s: 2 of 4 arrived; missing (2): \
             rank 2 (host node2, pid 1002, connected but not arrived, last seen 1.5 s ago); rank 3 (never connected)",
        ],
        "{report}"
    );
    // Rank 1 dies: the barrier and the all-gather fail and leave the report; the loss is listed.
    h.kill(s[1]);
    assert!(matches!(err(h.take(s[0], waits[0])), OpError::PeerLost { .. }));
    let report = status(&mut h, "j");
    let waiting: Vec<&str> = report.lines().filter(|l| l.starts_with("waiting: ")).collect();
    assert_eq!(waiting.len(), 1, "only the broadcast still blocks someone: {report}");
    assert!(report.contains("ranks: 2 connected, 0 left cleanly, 1 lost, 1 of 4 never connected\n"), "{report}");
    assert!(report.contains("lost: rank 1 (host node1, pid 1001, lost: "), "{report}");
}

#[test]
fn status_says_which_ranks_wait_for_keys_oldest_first() {
    let mut h = Harness::new();
    let s: Vec<_> = (0..3).map(|r| h.rank("j", r, 3)).collect();
    h.send(s[2], Request::Get { key: b("cfg/lr"), timeout_ms: None });
    h.advance(500);
    let keys = (0..6).map(|i| b(&format!("ready/{i}"))).collect();
    h.send(s[0], Request::Wait { keys, timeout_ms: None });
    h.advance(1_500);
    let report = status(&mut h, "j");
    let lines: Vec<&str> = report.lines().filter(|l| l.starts_with("waiting: rank")).collect();
    assert_eq!(
        lines,
        [
            "waiting: rank 2 (host node2, pid 1002) for 2.0 s on \"cfg/lr\"",
            "waiting: rank 0 (host node0, pid 1000) for 1.5 s on \"ready/0\", \"ready/1\", \"ready/2\", \"ready/3\" \
             and 2 more",
        ],
        "{report}"
    );
    // Once the key is set, its wait leaves the report.
    assert_eq!(h.call(s[1], Request::Set { key: b("cfg/lr"), value: b("0.1") }), Ok(Response::Done));
    let report = status(&mut h, "j");
    assert_eq!(report.lines().filter(|l| l.starts_with("waiting: rank")).count(), 1, "{report}");
    // A session without a rank (a CLI verb's, a tool's) is named as a session.
    let tool = h.open(Identity::anonymous("j"));
    h.send(tool, Request::Get { key: b("tool/key"), timeout_ms: None });
    let report = status(&mut h, "j");
    let line = report.lines().find(|l| l.ends_with(" for 0.0 s on \"tool/key\"")).unwrap_or_default();
    assert!(line.starts_with(&format!("waiting: {tool} (host ")), "{report}");
}

#[test]
fn a_name_used_again_after_many_others_joins_each_ranks_next_generation() {
    // A job that names each step's barrier afresh: names out of use keep their
    // per-rank counts in little memory, and a rank's next call of one still joins the
    // generation after its last.
    let mut h = Harness::new();
    let s: Vec<_> = (0..3).map(|r| h.rank("j", r, 3)).collect();
    // Rank 0 also waits at a barrier the others never come to, all along.
    let long = h.send(s[0], barrier("long", None));
    let round = |h: &mut Harness, name: &str| {
        let ids: Vec<u64> = s.iter().map(|&sess| h.send(sess, barrier(name, None))).collect();
        for (&sess, id) in s.iter().zip(ids) {
            assert_eq!(ok(h.take(sess, id)), Response::Done, "{name}");
        }
    };
    round(&mut h, "step/0");
    round(&mut h, "step/0");
    for step in 1..300 {
        round(&mut h, &format!("step/{step}"));
    }
    // Rank 2 calls "step/0" a third time: alone in generation 3.
    let third = h.send(s[2], barrier("step/0", None));
    let report = status(&mut h, "j");
    let waiting: Vec<&str> = report.lines().filter(|l| l.starts_with("waiting: ")).collect();
    assert_eq!(waiting.len(), 2, "{report}");
    assert!(waiting[0].starts_with("waiting: barrier 'long' (generation 1) for 0.0 s: 1 of 3 arrived"), "{report}");
    assert!(waiting[1].starts_with("waiting: barrier 'step/0' (generation 3) for 0.0 s: 1 of 3 arrived"), "{report}");
    // The others' third calls release it.
    let others: Vec<u64> = s[..2].iter().map(|&sess| h.send(sess, barrier("step/0", None))).collect();
    assert_eq!(ok(h.take(s[2], third)), Response::Done);
    for (&sess, id) in s[..2].iter().zip(others) {
        assert_eq!(ok(h.take(sess, id)), Response::Done);
    }
    // The barrier waited at all along still fails at once when a member is lost.
    h.kill(s[1]);
    let OpError::PeerLost { op, peer } = err(h.take(s[0], long)) else { panic!("a lost peer") };
    assert_eq!((op.name.as_str(), op.generation, peer.rank), ("long", 1, 1));
}

#[test]
fn status_names_the_first_64_missing_and_counts_the_rest() {
    let mut h = Harness::new();
    let r0 = h.rank("big", 0, 1_000);
    h.send(r0, barrier("all", None));
    let report = status(&mut h, "big");
    let line = report.lines().find(|l| l.starts_with("waiting: barrier 'all'")).unwrap_or_else(|| panic!("{report}"));
    assert!(line.contains("1 of 1000 arrived; missing (999): rank 1 (never connected); rank 2 "), "{line}");
    assert!(line.contains("rank 64 (never connected); and 935 more"), "{line}");
    assert!(!line.contains("rank 65 "), "{line}");
}

#[test]
fn abort_fails_pending_and_later_operations_naming_who_aborted() {
    let mut h = Harness::new();
    let s: Vec<_> = (0..3).map(|r| h.rank("j", r, 3)).collect();
    let other_job = h.rank("other", 0, 2);
    let a = h.send(s[0], barrier("x", None));
    let g = h.send(s[1], Request::Get { key: b("k"), timeout_ms: None });
    let ob = h.send(other_job, barrier("x", None));
    assert_eq!(h.call(s[2], Request::Abort { reason: "loss is NaN".into() }), Ok(Response::Done));
    let e = err(h.take(s[0], a));
    let OpError::Aborted { job, by } = &e else { panic!("{e:?}") };
    assert_eq!((job.as_str(), by.by_rank, by.reason.as_str()), ("j", Some(2), "loss is NaN"));
    assert_eq!(e.to_string(), "job 'j' was aborted by rank 2 (host node2, pid 1002): loss is NaN");
    assert_eq!(err(h.take(s[1], g)), e);
    assert_eq!(h.call(s[0], Request::Set { key: b("k"), value: b("v") }).unwrap_err(), e);
    // The job's status says so, and by whom.
    let report = status(&mut h, "j");
    assert!(report.contains("\naborted by rank 2 (host node2, pid 1002): loss is NaN\n"), "{report}");
    // Another job is untouched.
    assert!(h.pending(other_job, ob));
    // A process without rank (the launcher) is named by its pid and host.
    let launcher = h.open(Identity { host: "node0".into(), pid: 77, ..Identity::anonymous("other") });
    h.call(launcher, Request::Abort { reason: "launcher: rank 1 exited with code 3".into() }).expect("abort");
    let e = err(h.take(other_job, ob));
    assert_eq!(e.to_string(), "job 'other' was aborted by pid 77 on host node0: launcher: rank 1 exited with code 3");
}

#[test]
fn an_abort_reason_is_shown_on_one_line_and_never_empty() {
    let cases = [
        ("line1\nline2 \u{1b}[31mRED\u{1b}[0m", "line1\\nline2 \\u{1b}[31mRED\\u{1b}[0m"),
        ("x\nranks: 8 connected, 0 lost", "x\\nranks: 8 connected, 0 lost"),
        ("", "(no reason given)"),
        (" \t", "(no reason given)"),
        ("naïve reason", "naïve reason"),
    ];
    for (i, (given, shown)) in cases.into_iter().enumerate() {
        let mut h = Harness::new();
        let job = format!("j{i}");
        let s = h.rank(&job, 0, 2);
        let w = h.send(s, barrier("x", None));
        let aborter = h.rank(&job, 1, 2);
        h.call(aborter, Request::Abort { reason: given.into() }).expect("abort");
        let e = err(h.take(s, w));
        let OpError::Aborted { by, .. } = &e else { panic!("{e:?}") };
        assert_eq!(by.reason, shown);
        assert!(!e.to_string().contains('\n') && !e.to_string().contains('\u{1b}'), "{e}");
        let report = status(&mut h, &job);
        assert!(report.contains(&format!(": {shown}\n")), "{report}");
    }
}

#[test]
fn bad_identities_are_refused() {
    let mut h = Harness::new();
    let cases = [
        (Identity::ranked("j", 4, 4), "rank 4 is out of range for world size 4"),
        (Identity::ranked("j", 0, 0), "world size 0"),
        (Identity { world_size: None, ..Identity::ranked("j", 1, 2) }, "without a world size"),
        (Identity::anonymous(""), "job name is empty"),
        (Identity { role: Some(String::new()), ..Identity::ranked("j", 0, 2) }, "role name is empty"),
        (Identity::anonymous("a\0b"), r#"the job name "a\0b" holds a control character (U+0000)"#),
        (Identity { role: Some("r\n".into()), ..Identity::ranked("j", 0, 2) }, "role name \"r\\n\" holds a control"),
    ];
    for (i, (identity, needle)) in cases.into_iter().enumerate() {
        let e = h.engine.open(rallypoint_core::SessionId(100 + i as u64), identity, 0).unwrap_err();
        assert!(e.to_string().contains(needle), "{e}");
    }
}

#[test]
fn a_collective_name_with_a_control_character_is_refused() {
    let mut h = Harness::new();
    let s = h.rank("j", 0, 2);
    let e = h.call(s, barrier("b\u{1b}[2J\nfake line", None)).unwrap_err();
    assert_eq!(
        e.to_string(),
        r#"invalid argument: the collective name "b\u{1b}[2J\nfake line" holds a control character (U+001B)"#
    );
    assert!(status(&mut h, "j").lines().all(|l| !l.starts_with("waiting")), "nothing waits");
}

#[test]
fn collectives_need_a_rank() {
    let mut h = Harness::new();
    let s = h.open(Identity::anonymous("j"));
    assert!(matches!(h.call(s, barrier("x", None)), Err(OpError::NoRank { .. })));
}

#[test]
fn an_all_gather_too_large_to_reply_fails_for_every_member() {
    let limits = Limits { max_gather_bytes: 10, ..Limits::default() };
    let mut h = Harness::with_config(Config { limits, ..Config::default() });
    let s: Vec<_> = (0..3).map(|r| h.rank("j", r, 3)).collect();
    let gather =
        |v: &str| Request::AllGather { name: "g".into(), members: Members::World, value: b(v), timeout_ms: None };
    let a = h.send(s[0], gather("12345"));
    let e = h.call(s[1], gather("123456")).unwrap_err();
    assert!(matches!(&e, OpError::TooLarge { len: 11, limit: 10, .. }), "{e:?}");
    assert_eq!(err(h.take(s[0], a)), e);
    assert_eq!(h.call(s[2], gather("1")).unwrap_err(), e, "the late member learns the generation failed");
}

#[test]
fn a_role_broadcast_whose_root_turns_out_not_to_be_a_member_fails_its_members() {
    let mut h = Harness::new();
    let w0 = h.role_rank("j", 0, 4, "workers");
    let w2 = h.role_rank("j", 2, 4, "workers");
    let bc = |root: u32| Request::Broadcast {
        name: "cfg".into(),
        members: Members::Role("workers".into()),
        root,
        value: None,
        timeout_ms: None,
    };
    // Rank 3 has not connected: whether it is a worker is not known yet.
    let a = h.send(w0, bc(3));
    let c = h.send(w2, bc(3));
    let _s1 = h.role_rank("j", 1, 4, "servers");
    assert!(h.pending(w0, a) && h.pending(w2, c));
    // Rank 3 is a server: every worker came, and none of them is the root.
    let _s3 = h.role_rank("j", 3, 4, "servers");
    for (sess, id) in [(w0, a), (w2, c)] {
        let e = err(h.take(sess, id));
        assert!(e.to_string().contains("root rank 3") && e.to_string().contains("'workers'"), "{e}");
    }
}
