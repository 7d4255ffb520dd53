//! Engine semantics PyTorch's TCPStore needs: queues, CancelWait, the store
//! barrier, compare_set waking waiters, and what is inferred about torch ranks.

mod common;

use bytes::Bytes;
use common::{b, err, ok, Harness};
use rallypoint_core::{Exit, Identity, OpError, Request, Response, SessionId};

fn anon(h: &mut Harness) -> SessionId {
    h.open(Identity::anonymous("j"))
}

fn torch(h: &mut Harness, id: u64, pid: u32) -> SessionId {
    let session = SessionId(1000 + id);
    h.engine.open_tcpstore(session, "j", "10.0.0.1", pid, h.now).expect("accepted");
    session
}

fn wait(keys: &[&str]) -> Request {
    Request::Wait { keys: keys.iter().map(|k| b(k)).collect(), timeout_ms: None }
}

fn push(key: &str, value: &str) -> Request {
    Request::QueuePush { key: b(key), value: b(value) }
}

#[test]
fn queues_are_a_namespace_apart_yet_satisfy_waits_and_checks() {
    let mut h = Harness::new();
    let s = anon(&mut h);
    assert_eq!(ok(Some(h.call(s, Request::QueuePop { key: b("q") }))), Response::Popped { len_before: 0, value: None });
    let w1 = h.send(s, wait(&["q"]));
    let w2 = h.send(s, wait(&["q"]));
    assert!(h.pending(s, w1) && h.pending(s, w2));
    ok(Some(h.call(s, push("q", "a"))));
    // One push wakes one waiter, as torch's wakeupOneWaitingClient.
    assert_eq!(ok(h.take(s, w1)), Response::Done);
    assert!(h.pending(s, w2));
    ok(Some(h.call(s, push("q", "b"))));
    assert_eq!(ok(h.take(s, w2)), Response::Done);
    assert_eq!(ok(Some(h.call(s, Request::QueueLen { key: b("q") }))), Response::Int(2));
    assert_eq!(ok(Some(h.call(s, Request::Check { keys: vec![b("q")] }))), Response::Bool(true));
    // Queues are not keys.
    assert_eq!(ok(Some(h.call(s, Request::NumKeys))), Response::Int(0));
    assert_eq!(
        ok(Some(h.call(s, Request::QueuePop { key: b("q") }))),
        Response::Popped { len_before: 2, value: Some(b("a")) }
    );
    assert_eq!(
        ok(Some(h.call(s, Request::QueuePop { key: b("q") }))),
        Response::Popped { len_before: 1, value: Some(b("b")) }
    );
    assert_eq!(ok(Some(h.call(s, Request::Check { keys: vec![b("q")] }))), Response::Bool(false));
}

#[test]
fn cancel_wait_ends_the_sessions_waits_and_always_answers() {
    let mut h = Harness::new();
    let s = anon(&mut h);
    let other = anon(&mut h);
    assert_eq!(ok(Some(h.call(s, Request::CancelWait))), Response::Done);
    let w = h.send(s, wait(&["x"]));
    let kept = h.send(other, wait(&["x"]));
    assert_eq!(ok(Some(h.call(s, Request::CancelWait))), Response::Done);
    assert!(matches!(err(h.take(s, w)), OpError::Closed(_)));
    ok(Some(h.call(s, Request::Set { key: b("x"), value: b("1") })));
    assert_eq!(ok(h.take(other, kept)), Response::Done);
    // The session stays usable.
    assert_eq!(ok(Some(h.call(s, wait(&["x"])))), Response::Done);
}

#[test]
fn cancel_wait_fails_only_the_waits_still_pending_oldest_first() {
    let mut h = Harness::new();
    let s = anon(&mut h);
    let other = anon(&mut h);
    let answered = h.send(s, wait(&["y"]));
    let first = h.send(s, wait(&["x"]));
    let last = h.send(s, wait(&["z"]));
    let others = h.send(other, wait(&["x"]));
    ok(Some(h.call(other, Request::Set { key: b("y"), value: b("1") })));
    assert_eq!(ok(h.take(s, answered)), Response::Done);
    // On the engine itself, to see the order the replies leave in.
    let cancel = 1_000;
    h.engine.handle(s, cancel, Request::CancelWait, h.now);
    let order: Vec<u64> = h.engine.drain_outgoing().map(|o| o.request_id).collect();
    assert_eq!(order, [first, last, cancel]);
    // The other session's wait on the same key stays, and is the only one answered.
    ok(Some(h.call(other, Request::Set { key: b("x"), value: b("1") })));
    assert_eq!(ok(h.take(other, others)), Response::Done);
    assert!(h.pending(s, first));
    // Waiting again after the cancel is counted afresh.
    let again = h.send(s, wait(&["w"]));
    h.kill(other);
    ok(Some(h.call(s, Request::Set { key: b("w"), value: b("1") })));
    assert_eq!(ok(h.take(s, again)), Response::Done);
}

#[test]
fn store_barrier_counts_at_its_key_and_never_resets() {
    let mut h = Harness::new();
    let (a, c) = (anon(&mut h), anon(&mut h));
    let bar = |ws| Request::StoreBarrier { key: b("/b"), world_size: ws, timeout_ms: None };
    let first = h.send(a, bar(2));
    assert!(h.pending(a, first));
    // A canceled wait keeps its increment.
    ok(Some(h.call(a, Request::CancelWait)));
    assert!(matches!(err(h.take(a, first)), OpError::Closed(_)));
    let again = h.send(a, bar(3));
    assert!(h.pending(a, again));
    let last = h.send(c, bar(3));
    assert_eq!(ok(h.take(c, last)), Response::Done);
    assert_eq!(ok(h.take(a, again)), Response::Done);
    assert_eq!(ok(Some(h.call(a, Request::Get { key: b("/b"), timeout_ms: None }))), Response::Value(b("3")));
    // 4 >= 2: released at once.
    assert_eq!(ok(Some(h.call(a, bar(2)))), Response::Done);
    let bad = Request::Set { key: b("/n"), value: b("abc") };
    ok(Some(h.call(a, bad)));
    let e = h.call(a, Request::StoreBarrier { key: b("/n"), world_size: 1, timeout_ms: None });
    assert!(matches!(e, Err(OpError::NotANumber { .. })));
}

#[test]
fn store_barrier_rounds_on_fresh_keys_answer_each_waiter_once() {
    let mut h = Harness::new();
    let s: Vec<SessionId> = (0..4).map(|_| anon(&mut h)).collect();
    for round in 0..3 {
        let key = b(&format!("/round/{round}"));
        let bar = |timeout_ms| Request::StoreBarrier { key: key.clone(), world_size: 4, timeout_ms };
        let late = h.send(s[0], bar(Some(10)));
        let waiting: Vec<u64> = s[1..3].iter().map(|&x| h.send(x, bar(None))).collect();
        h.advance(20);
        // Timed out, and answered so; its arrival stays counted.
        assert!(matches!(err(h.take(s[0], late)), OpError::KeyTimeout { .. }), "round {round}");
        assert!(s[1..3].iter().zip(&waiting).all(|(&x, &w)| h.pending(x, w)), "round {round}");
        let last = h.send(s[3], bar(None));
        assert_eq!(ok(h.take(s[3], last)), Response::Done, "round {round}");
        for (&x, &w) in s[1..3].iter().zip(&waiting) {
            assert_eq!(ok(h.take(x, w)), Response::Done, "round {round}");
        }
        // Nothing more for the one that timed out.
        assert!(h.pending(s[0], late), "round {round}");
    }
}

#[test]
fn status_lists_store_barriers_waited_at_and_the_last_used_not_every_round() {
    let mut h = Harness::new();
    let t: Vec<SessionId> = (0..2).map(|r| torch(&mut h, r, 100 + r as u32)).collect();
    let bar = |key: &str, world_size| Request::StoreBarrier { key: b(key), world_size, timeout_ms: None };
    let stuck = h.send(t[0], bar("/stuck", 2));
    let rounds = 200;
    for round in 0..rounds {
        assert_eq!(ok(Some(h.call(t[1], bar(&format!("/round/{round}"), 1)))), Response::Done);
    }
    assert!(h.pending(t[0], stuck));
    let tool = h.open(Identity::anonymous("j"));
    let Response::Value(report) = ok(Some(h.call(tool, Request::Status))) else { panic!("status is text") };
    let report = String::from_utf8_lossy(&report).into_owned();
    let listed: Vec<&str> = report.lines().filter(|l| l.starts_with("store barrier ")).collect();
    assert!(
        listed.iter().any(|l| l.starts_with("store barrier \"/stuck\": counter 1, 1 waiting for world size 2")),
        "{report}"
    );
    let last = format!("store barrier \"/round/{}\": counter 1", rounds - 1);
    assert!(listed.iter().any(|l| l.starts_with(&last)), "{report}");
    assert!(!listed.iter().any(|l| l.starts_with("store barrier \"/round/0\":")), "{report}");
    assert!(listed.len() < 50, "{} store barriers listed:\n{report}", listed.len());
}

#[test]
fn compare_set_on_a_missing_key_wakes_waiters_without_creating_it() {
    let mut h = Harness::new();
    let s = anon(&mut h);
    let w = h.send(s, wait(&["x"]));
    let reply = h.call(s, Request::CompareSet { key: b("x"), expected: b("e"), desired: b("d") });
    assert_eq!(ok(Some(reply)), Response::Value(b("e")));
    assert_eq!(ok(h.take(s, w)), Response::Done, "torch's libuv server wakes the waiter");
    assert_eq!(ok(Some(h.call(s, Request::Check { keys: vec![b("x")] }))), Response::Bool(false));
}

#[test]
fn get_with_timeout_zero_fails_at_once() {
    let mut h = Harness::new();
    let s = anon(&mut h);
    let e = h.call(s, Request::Get { key: b("nope"), timeout_ms: Some(0) });
    assert!(matches!(e, Err(OpError::KeyTimeout { .. })));
}

#[test]
fn a_missing_address_of_a_rank_that_finished_is_said_never_to_come() {
    let mut h = Harness::new();
    let prefix = "/default_pg/0//cpu//0/";
    let ranks: Vec<SessionId> = (0..2).map(|r| torch(&mut h, r, 100 + r as u32)).collect();
    for (r, s) in ranks.iter().enumerate() {
        ok(Some(h.call(*s, Request::Set { key: Bytes::from(format!("{prefix}{r}")), value: b("addr") })));
    }
    // Rank 2's worker exited 0 before init_process_group; its launcher says so.
    let launcher = h.open(Identity { world_size: Some(4), ..Identity::anonymous("j") });
    let exited = |rank| Request::RankExited { rank, host: "n".into(), pid: 100 + rank, exit: Exit::Code(0) };
    assert_eq!(h.call(launcher, exited(2)), Ok(Response::Done));
    // A wait for a rank that ends while it waits ends at once.
    let late = h.send(ranks[1], wait(&[&format!("{prefix}3")]));
    h.advance(1_000);
    assert!(h.pending(ranks[1], late));
    assert_eq!(h.call(launcher, exited(3)), Ok(Response::Done));
    assert!(matches!(err(h.take(ranks[1], late)), OpError::Closed(_)));
    let w = h.send(ranks[0], wait(&[&format!("{prefix}2")]));
    assert!(h.pending(ranks[0], w), "the rank's end is looked for at the job's stall sweep");
    h.advance(5_000);
    // The wait ends (its TCPStore connection is closed), saying why.
    let OpError::Closed(why) = err(h.take(ranks[0], w)) else { panic!("closed") };
    assert_eq!(h.engine.failed_for("j"), [2, 3], "their ends stranded their peers: a launcher names them");
    assert!(why.contains("rank 2 has finished (worker pid 102 exited with code 0), so it will never write"), "{why}");
    let notices: Vec<String> = h.engine.drain_notices().collect();
    assert!(
        notices.iter().any(|n| n.contains(
            "ranks [2] never wrote their address key (written by ranks [0, 1]); rank 2 has finished (worker pid \
             102 exited with code 0), so it never will"
        )),
        "{notices:?}"
    );
}

#[test]
fn a_ranks_end_ends_the_torch_waits_for_its_address_in_every_process_group_and_no_other() {
    // Found by key: the waits of other ranks' keys, and native ones, stay.
    let mut h = Harness::new();
    let (world, pair) = ("/default_pg/0//cpu//0/", "/1/0//cpu//0/");
    let ranks: Vec<SessionId> = (0..2).map(|r| torch(&mut h, r, 100 + r as u32)).collect();
    for (r, s) in ranks.iter().enumerate() {
        ok(Some(h.call(*s, Request::Set { key: Bytes::from(format!("{world}{r}")), value: b("addr") })));
    }
    let launcher = h.open(Identity { world_size: Some(4), ..Identity::anonymous("j") });
    let for_2 = h.send(ranks[0], wait(&[&format!("{world}2")]));
    let for_3 = h.send(ranks[0], wait(&[&format!("{world}3")]));
    let for_2_and_3 = h.send(ranks[1], wait(&[&format!("{pair}3"), &format!("{pair}2")]));
    let native = anon(&mut h);
    let native_for_2 = h.send(native, wait(&[&format!("{world}2")]));
    let exited = Request::RankExited { rank: 2, host: "n".into(), pid: 102, exit: Exit::Code(0) };
    assert_eq!(h.call(launcher, exited), Ok(Response::Done));
    let OpError::Closed(why) = err(h.take(ranks[0], for_2)) else { panic!("closed") };
    assert!(why.contains("rank 2 has finished") && why.contains(&format!("process group \"{world}\"")), "{why}");
    let OpError::Closed(why) = err(h.take(ranks[1], for_2_and_3)) else { panic!("closed") };
    assert!(why.contains(&format!("process group \"{pair}\"")), "{why}");
    assert!(h.pending(ranks[0], for_3) && h.pending(native, native_for_2));
    // The sweep leaves them too.
    h.advance(40_000);
    assert!(h.pending(ranks[0], for_3) && h.pending(native, native_for_2));
    assert_eq!(h.engine.failed_for("j"), [2]);
}

#[test]
fn a_missing_address_of_a_rank_whose_connection_dropped_is_waited_for() {
    // Its process may live on and write the key: only its launcher's word ends the wait.
    let mut h = Harness::new();
    let prefix = "/default_pg/0//cpu//0/";
    let s0 = torch(&mut h, 0, 100);
    ok(Some(h.call(s0, Request::Set { key: Bytes::from(format!("{prefix}0")), value: b("addr") })));
    let native = h.rank("j", 1, 2);
    h.kill(native);
    let w = h.send(s0, wait(&[&format!("{prefix}1")]));
    h.advance(40_000);
    assert!(h.pending(s0, w));
}

#[test]
fn torch_ranks_are_inferred_from_address_keys_and_named_when_missing() {
    let mut h = Harness::new();
    let prefix = "/default_pg/0//cpu//0/";
    let ranks: Vec<SessionId> = (0..3).map(|r| torch(&mut h, r, 100 + r as u32)).collect();
    // A second connection of rank 1's process (torch clones its store).
    let clone = torch(&mut h, 9, 101);
    for (r, s) in ranks.iter().enumerate() {
        ok(Some(h.call(*s, Request::Add { key: b("init/"), delta: 1 })));
        ok(Some(h.call(*s, Request::Set { key: Bytes::from(format!("{prefix}{r}")), value: b("addr") })));
    }
    // Rank 0 waits for rank 3, which never comes.
    let w = h.send(ranks[0], wait(&[&format!("{prefix}3")]));
    assert!(h.pending(ranks[0], w));
    h.advance(5_000);
    let notices: Vec<String> = h.engine.drain_notices().collect();
    assert_eq!(notices.len(), 1, "{notices:?}");
    assert!(notices[0].contains("rank 0") && notices[0].contains("ranks [3] never wrote"), "{}", notices[0]);
    assert!(
        notices[0].contains("written by ranks [0, 1, 2]") && notices[0].contains("3 process(es) arrived"),
        "{}",
        notices[0]
    );
    let tool = h.open(Identity::anonymous("j"));
    let Response::Value(report) = ok(Some(h.call(tool, Request::Status))) else { panic!("status is text") };
    let report = String::from_utf8_lossy(&report).into_owned();
    assert!(report.contains("MISSING (waited for, never written): ranks [3]"), "{report}");
    assert!(report.contains("attributed to ranks [0, 1, 2]") && report.contains("4 TCPStore"), "{report}");
    // Rank 1's clone was attributed too: rank 1 is lost only when both connections drop.
    h.kill(ranks[1]);
    h.kill(clone);
    let Response::Value(report) = ok(Some(h.call(tool, Request::Status))) else { panic!("status is text") };
    let report = String::from_utf8_lossy(&report).into_owned();
    assert!(report.contains("lost: rank 1 (host 10.0.0.1, pid 101, lost: connection dropped"), "{report}");
}

#[test]
fn a_torch_rank_whose_launcher_saw_it_exit_0_after_its_connection_dropped_is_finished() {
    // What a torch process does when done (destroy_process_group, then exit 0): its
    // store connection drops without a leave, then its launcher reports its end.
    let mut h = Harness::new();
    let prefix = "/default_pg/0//cpu//0/";
    let ranks: Vec<SessionId> = (0..2).map(|r| torch(&mut h, r, 100 + r as u32)).collect();
    for (r, s) in ranks.iter().enumerate() {
        ok(Some(h.call(*s, Request::Set { key: Bytes::from(format!("{prefix}{r}")), value: b("addr") })));
    }
    for (rank, s) in (0..).zip(ranks) {
        h.kill(s);
        assert_eq!(h.report_exit("j", rank, "10.0.0.1", 90 + rank, Exit::Code(0)), Ok(Response::Done));
    }
    let summary = h.snapshot("j").ranks_summary;
    assert_eq!((summary.finished, summary.lost), (2, 0), "done, not lost");
    // A rank nothing is known of, in a job whose world size nobody stated: nothing changes.
    assert_eq!(h.report_exit("j", 7, "10.0.0.1", 97, Exit::Code(1)), Ok(Response::Done));
    assert_eq!(h.snapshot("j").ranks_summary.lost, 0);
}

#[test]
fn a_lost_torch_rank_fails_native_collectives_naming_it() {
    let mut h = Harness::new();
    let t = torch(&mut h, 1, 4242);
    ok(Some(h.call(t, Request::Set { key: b("/default_pg/0//cpu//0/1"), value: b("addr") })));
    let native = h.rank("j", 0, 2);
    let id = h.send(native, common::barrier("step", None));
    assert!(h.pending(native, id));
    h.kill(t);
    match err(h.take(native, id)) {
        OpError::PeerLost { peer, .. } => assert_eq!((peer.rank, peer.pid), (1, Some(4242))),
        other => panic!("expected PeerLost, got {other:?}"),
    }
}

#[test]
fn ranks_stalled_at_one_store_barrier_give_one_notice_per_period_naming_the_missing() {
    let mut h = Harness::new();
    let prefix = "/default_pg/0//cpu//0/";
    let world: u32 = 200;
    let ranks: Vec<SessionId> = (0..world).map(|r| torch(&mut h, u64::from(r), 100 + r)).collect();
    for (r, s) in ranks.iter().enumerate() {
        ok(Some(h.call(*s, Request::Set { key: Bytes::from(format!("{prefix}{r}")), value: b("addr") })));
    }
    // Every rank but 57 reaches the barrier.
    let bar = || Request::StoreBarrier { key: b("/barrier"), world_size: i64::from(world), timeout_ms: None };
    let waits: Vec<(SessionId, u64)> =
        ranks.iter().enumerate().filter(|(r, _)| *r != 57).map(|(_, s)| (*s, h.send(*s, bar()))).collect();
    assert!(waits.iter().all(|(s, w)| h.pending(*s, *w)));
    h.advance(5_000);
    let notices: Vec<String> = h.engine.drain_notices().collect();
    assert_eq!(notices.len(), 1, "one notice for the barrier, not one per waiting rank: {notices:?}");
    assert!(notices[0].contains("ranks not waiting there: [57]"), "{}", notices[0]);
    // Still stalled a period later: one more notice.
    h.advance(30_000);
    assert_eq!(h.engine.drain_notices().count(), 1);
    ok(Some(h.call(ranks[57], bar())));
    assert!(waits.iter().all(|(s, w)| h.take(*s, *w).is_some()));
    h.advance(30_000);
    assert_eq!(h.engine.drain_notices().count(), 0);
}

#[test]
fn each_stall_is_reported_five_seconds_after_it_began_whatever_ended_before_it() {
    let mut h = Harness::new();
    let prefix = "/default_pg/0//cpu//0/";
    let (r0, r1) = (torch(&mut h, 0, 100), torch(&mut h, 1, 101));
    ok(Some(h.call(r0, Request::Set { key: Bytes::from(format!("{prefix}0")), value: b("addr") })));
    // Rank 0 waits for rank 1's address, which comes after 1 s: no stall.
    let early = h.send(r0, wait(&[&format!("{prefix}1")]));
    h.advance(1_000);
    ok(Some(h.call(r1, Request::Set { key: Bytes::from(format!("{prefix}1")), value: b("addr") })));
    assert!(h.take(r0, early).is_some());
    // From t = 3 s, both wait for ranks that never come, each on its own key.
    h.advance(2_000);
    let stuck: Vec<(SessionId, u64)> =
        [(r0, 2), (r1, 3)].into_iter().map(|(s, r)| (s, h.send(s, wait(&[&format!("{prefix}{r}")])))).collect();
    h.advance(4_000);
    assert_eq!(h.engine.drain_notices().count(), 0, "4 s into the stall is not yet 5 s");
    h.advance(1_000);
    let notices: Vec<String> = h.engine.drain_notices().collect();
    assert_eq!(notices.len(), 2, "one notice per stalled key: {notices:?}");
    assert!(notices.iter().any(|n| n.contains("rank 0") && n.contains("ranks [2] never wrote")), "{notices:?}");
    assert!(notices.iter().any(|n| n.contains("rank 1") && n.contains("ranks [3] never wrote")), "{notices:?}");
    // Rank 2 comes at t = 9 s and its key is gone again at 10 s, and rank 0 waits for
    // it again: a new stall, told 5 s into it, not held back by the old one's notice.
    h.advance(1_000);
    let r2 = torch(&mut h, 2, 102);
    ok(Some(h.call(r2, Request::Set { key: Bytes::from(format!("{prefix}2")), value: b("addr") })));
    assert!(h.take(stuck[0].0, stuck[0].1).is_some());
    h.advance(1_000);
    ok(Some(h.call(r2, Request::Delete { key: Bytes::from(format!("{prefix}2")) })));
    let again = h.send(r0, wait(&[&format!("{prefix}2")]));
    h.advance(4_999);
    assert_eq!(h.engine.drain_notices().count(), 0);
    h.advance(1);
    let notices: Vec<String> = h.engine.drain_notices().collect();
    assert_eq!(notices.len(), 1, "{notices:?}");
    assert!(notices[0].contains("rank 0") && notices[0].contains("has waited 5"), "{}", notices[0]);
    // Rank 1's stall, told at t = 8 s, is told again a period later, at 38 s.
    h.advance(38_000 - 15_000 - 1);
    assert_eq!(h.engine.drain_notices().count(), 0);
    h.advance(1);
    let notices: Vec<String> = h.engine.drain_notices().collect();
    assert_eq!(notices.len(), 1, "{notices:?}");
    assert!(notices[0].contains("rank 1") && notices[0].contains("ranks [3] never wrote"), "{}", notices[0]);
    assert!(h.pending(r0, again) && h.pending(stuck[1].0, stuck[1].1));
}

#[test]
fn store_barrier_waiters_with_different_world_sizes_are_released_as_the_counter_reaches_each() {
    let mut h = Harness::new();
    let s: Vec<SessionId> = (0..6).map(|_| anon(&mut h)).collect();
    let bar = |ws| Request::StoreBarrier { key: b("/mixed"), world_size: ws, timeout_ms: None };
    // Counter 1 and 2: waiting for 5 and 4 arrivals.
    let w5 = h.send(s[0], bar(5));
    let w4 = h.send(s[1], bar(4));
    assert!(h.pending(s[0], w5) && h.pending(s[1], w4));
    // Counter 3 waits for 3: released alone, at once.
    let w3 = h.send(s[2], bar(3));
    assert_eq!(ok(h.take(s[2], w3)), Response::Done);
    assert!(h.pending(s[0], w5) && h.pending(s[1], w4));
    // Counter 4 releases the world-size-4 waiter, not the 5 nor the new 6.
    let w6 = h.send(s[3], bar(6));
    assert_eq!(ok(h.take(s[1], w4)), Response::Done);
    assert!(h.pending(s[0], w5) && h.pending(s[3], w6));
    // A canceled waiter leaves the others in place; counter 5 releases the 5.
    ok(Some(h.call(s[3], Request::CancelWait)));
    assert!(matches!(err(h.take(s[3], w6)), OpError::Closed(_)));
    assert_eq!(ok(Some(h.call(s[4], bar(5)))), Response::Done);
    assert_eq!(ok(h.take(s[0], w5)), Response::Done);
    assert_eq!(ok(Some(h.call(s[5], bar(6)))), Response::Done);
}
