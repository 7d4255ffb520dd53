//! A rank whose connection dropped and whose process may still resume its session
//! (the reconnect grace): `rallypoint status` and the snapshot show it as
//! reconnecting, with how long ago its connection dropped and how long until it is
//! counted lost, rather than as plainly connected.

mod common;

use common::{barrier, ok, Harness};
use rallypoint_core::snapshot::{JobSnapshot, RankStatus, RankSummary, RankView, ReconnectingView};
use rallypoint_core::{Config, Exit, Identity, Missing, Request, Response, SessionId};

/// Rank `rank` of `world` in job "j", as process `1000 + rank` on `node<rank>`, which
/// states an incarnation and so may resume.
fn process(rank: u32, world: u32) -> Identity {
    Identity {
        host: format!("node{rank}"),
        pid: 1000 + rank,
        incarnation: Some(0x100 + u64::from(rank)),
        ..Identity::ranked("j", rank, world)
    }
}

fn status(h: &mut Harness) -> String {
    let tool = h.open(Identity::anonymous("j"));
    let Response::Value(report) = ok(Some(h.call(tool, Request::Status))) else { panic!("status is text") };
    h.leave(tool);
    String::from_utf8_lossy(&report).into_owned()
}

fn snapshot(h: &mut Harness) -> JobSnapshot {
    h.snapshot("j")
}

/// Job "j"'s ranks in their reconnect grace, as `/metrics` has them.
fn metrics_reconnecting(h: &Harness) -> u64 {
    h.engine.metrics(h.now).iter().find(|m| m.name == "j").expect("job j").ranks.reconnecting
}

fn reconnecting_lines(report: &str) -> Vec<&str> {
    report.lines().filter(|l| l.starts_with("reconnecting: ")).collect()
}

fn resume(h: &mut Harness, session: SessionId, identity: &Identity) {
    h.engine.resume(session, identity, h.now).expect("resumed");
}

#[test]
fn a_dropped_rank_shows_as_reconnecting_during_its_grace_and_not_once_resumed() {
    let mut h = Harness::new();
    let r0 = h.open(process(0, 2));
    let r1 = h.open(process(1, 2));
    h.send(r0, barrier("step", None));
    h.advance(100);
    h.kill(r1);
    h.advance(400);

    let report = status(&mut h);
    assert!(report.contains("ranks: 2 connected (1 reconnecting), 0 left cleanly, 0 lost\n"), "{report}");
    assert_eq!(
        reconnecting_lines(&report),
        ["reconnecting: rank 1 (host node1, pid 1001): connection dropped 0.4 s ago, lost in 0.6 s unless it resumes"],
        "{report}"
    );
    let snap = snapshot(&mut h);
    let held = Some(ReconnectingView { dropped_ms_ago: 400, lost_in_ms: 600 });
    assert_eq!((snap.ranks[1].state, snap.ranks[1].reconnecting), (RankStatus::Connected, held));
    assert_eq!(snap.ranks[0].reconnecting, None);
    assert_eq!((snap.ranks_summary.connected, snap.ranks_summary.reconnecting), (2, 1));
    assert_eq!(snap.waits[0].missing[0].rank, 1);
    assert_eq!(snap.waits[0].missing[0].reconnecting, held, "the barrier's missing rank says it too");
    assert_eq!(metrics_reconnecting(&h), 1, "the metrics count it");

    // Its process comes back: a rank like any other again.
    resume(&mut h, r1, &process(1, 2));
    let report = status(&mut h);
    assert!(report.contains("ranks: 2 connected, 0 left cleanly, 0 lost\n"), "{report}");
    assert!(reconnecting_lines(&report).is_empty(), "{report}");
    let snap = snapshot(&mut h);
    assert_eq!((snap.ranks[1].reconnecting, snap.ranks_summary.reconnecting), (None, 0));
    assert_eq!(snap.waits[0].missing[0].reconnecting, None);
    assert_eq!(metrics_reconnecting(&h), 0);
}

#[test]
fn a_rank_that_does_not_come_back_is_shown_lost_once_its_grace_ends() {
    let mut h = Harness::new();
    let r0 = h.open(process(0, 2));
    let r1 = h.open(process(1, 2));
    let wait = h.send(r0, barrier("step", None));
    h.kill(r1);
    h.advance(999);
    assert_eq!(snapshot(&mut h).ranks[1].reconnecting, Some(ReconnectingView { dropped_ms_ago: 999, lost_in_ms: 1 }));
    h.advance(1);

    assert!(!h.pending(r0, wait), "the barrier failed when the grace ended");
    let report = status(&mut h);
    assert!(report.contains("ranks: 1 connected, 0 left cleanly, 1 lost\n"), "{report}");
    assert!(reconnecting_lines(&report).is_empty(), "{report}");
    assert!(report.contains("lost: rank 1 (host node1, pid 1001, lost: "), "{report}");
    let snap = snapshot(&mut h);
    assert_eq!((snap.ranks[1].state, snap.ranks[1].reconnecting), (RankStatus::Lost, None));
    assert_eq!((snap.ranks_summary.lost, snap.ranks_summary.reconnecting), (1, 0));
    assert_eq!(metrics_reconnecting(&h), 0, "lost, no longer reconnecting");
}

#[test]
fn a_rank_with_another_live_session_is_not_reconnecting() {
    let mut h = Harness::new();
    let _r0 = h.open(process(0, 2));
    // One process, two sessions of its rank (a client per thread, say).
    let first = h.open(process(1, 2));
    let second = h.open(process(1, 2));
    h.kill(first);
    h.advance(300);
    let report = status(&mut h);
    assert!(reconnecting_lines(&report).is_empty(), "its other session is live: {report}");
    assert!(report.contains("ranks: 2 connected, 0 left cleanly, 0 lost\n"), "{report}");
    assert_eq!(snapshot(&mut h).ranks[1].reconnecting, None);

    // Both dropped: the rank waits for the later one, lost when its grace ends.
    h.kill(second);
    h.advance(200);
    let view = snapshot(&mut h).ranks[1].reconnecting;
    assert_eq!(view, Some(ReconnectingView { dropped_ms_ago: 200, lost_in_ms: 800 }));
    // A session without incarnation (as torch's) never resumes: it is live or gone.
    let plain = h.open(Identity { host: "node1".into(), pid: 1001, ..Identity::ranked("j", 1, 2) });
    assert_eq!(snapshot(&mut h).ranks[1].reconnecting, None, "a live session of the rank again");
    h.kill(plain);
    let view = snapshot(&mut h).ranks[1].reconnecting;
    assert_eq!(view, Some(ReconnectingView { dropped_ms_ago: 200, lost_in_ms: 800 }), "its close had no grace");
}

#[test]
fn a_rank_silent_before_its_connection_dropped_is_lost_when_its_lease_ends() {
    let config = Config { lease_ms: 2_000, reconnect_grace_ms: 1_500, ..Config::default() };
    let mut h = Harness::with_config(config);
    let r0 = h.open(process(0, 2));
    let r1 = h.open(process(1, 2));
    h.advance(1_000);
    h.call(r0, Request::Heartbeat).expect("heartbeat");
    h.kill(r1);
    h.advance(100);
    let report = status(&mut h);
    assert_eq!(
        reconnecting_lines(&report),
        ["reconnecting: rank 1 (host node1, pid 1001): connection dropped 0.1 s ago, lost in 0.9 s unless it resumes"],
        "its lease ends before its grace: {report}"
    );
    h.advance(900);
    let snap = snapshot(&mut h);
    assert_eq!((snap.ranks[1].state, snap.ranks[1].reconnecting), (RankStatus::Lost, None));
    assert_eq!(snap.ranks[1].lost.as_ref().map(|l| l.reason.as_str()), Some("lease_expired"));
    assert!(reconnecting_lines(&status(&mut h)).is_empty());
}

#[test]
fn the_reconnecting_ranks_in_a_status_report_are_bounded() {
    let mut h = Harness::new();
    let world = 100;
    let sessions: Vec<SessionId> = (0..world).map(|r| h.open(process(r, world))).collect();
    for s in &sessions[..70] {
        h.kill(*s);
    }
    let report = status(&mut h);
    let lines = reconnecting_lines(&report);
    assert_eq!(lines.len(), Missing::NAMED + 1, "{report}");
    assert!(lines[63].starts_with("reconnecting: rank 63 (host node63, pid 1063): "), "{report}");
    assert_eq!(lines[64], format!("reconnecting: and {} more: ranks 64-69", 70 - Missing::NAMED));
    assert!(report.contains("ranks: 100 connected (70 reconnecting), "), "{report}");
}

/// Documents of before the field still read, and a rank that is not reconnecting
/// does not carry it.
#[test]
fn the_reconnecting_fields_are_optional_in_the_json() {
    let rank: RankView = serde_json::from_str(r#"{"rank": 1, "state": "connected"}"#).expect("an older rank");
    assert_eq!(rank.reconnecting, None);
    let summary: RankSummary = serde_json::from_str(
        r#"{"connected": 1, "left": 0, "lost": 0, "never_connected": 0, "in_collective": 0, "in_key_wait": 0}"#,
    )
    .expect("an older summary");
    assert_eq!(summary.reconnecting, 0);
    let json = serde_json::to_value(&rank).expect("serialisable");
    assert!(json.get("reconnecting").is_none(), "{json}");
    let held = RankView { reconnecting: Some(ReconnectingView { dropped_ms_ago: 5, lost_in_ms: 7 }), ..rank };
    let json = serde_json::to_value(&held).expect("serialisable");
    assert_eq!(json["reconnecting"], serde_json::json!({"dropped_ms_ago": 5, "lost_in_ms": 7}));
}

#[test]
fn a_rank_whose_launcher_saw_it_end_is_lost_at_once_not_after_its_grace() {
    let mut h = Harness::new();
    let r0 = h.open(process(0, 2));
    let r1 = h.open(process(1, 2));
    let wait = h.send(r0, barrier("step", None));
    h.kill(r1);
    h.advance(10);
    assert!(h.pending(r0, wait), "in its grace, rank 1 may still resume");
    assert_eq!(h.report_exit("j", 1, "node1", 1001, Exit::Signal(9)), Ok(Response::Done));
    let e = h.take(r0, wait).expect("failed at once").unwrap_err();
    assert!(e.to_string().contains("lost: worker pid 1001 was killed by SIGKILL"), "{e}");
    // Its session is gone with its grace: nothing shows it as reconnecting.
    let report = status(&mut h);
    assert_eq!(reconnecting_lines(&report), Vec::<&str>::new(), "{report}");
    assert!(report.contains("ranks: 1 connected, 0 left cleanly, 1 lost\n"), "{report}");
    assert_eq!(metrics_reconnecting(&h), 0);
    assert!(h.engine.resume(r1, &process(1, 2), h.now).is_err(), "nothing left to resume");
}
