//! A world size is only a claim: it is capped, and what the engine says about a
//! large world (timeouts, status) names the first missing ranks in full and the
//! rest as ranges, exactly, in bounded text.

mod common;

use std::collections::BTreeSet;

use common::{b, barrier, barrier_of, err, ok, Harness};
use proptest::prelude::*;
use rallypoint_core::{
    Config, Identity, Limits, Members, Missing, OpError, RankInfo, RankRanges, RankState, Request, Response, SessionId,
};

const MILLION: u32 = 1 << 20;

fn status(h: &mut Harness, job: &str) -> String {
    let tool = h.open(Identity::anonymous(job));
    let Response::Value(report) = ok(Some(h.call(tool, Request::Status))) else { panic!("status is text") };
    h.leave(tool);
    String::from_utf8_lossy(&report).into_owned()
}

#[test]
fn a_world_size_over_the_limit_is_refused_naming_the_limit() {
    let mut h = Harness::new();
    let e = h.engine.open(SessionId(1), Identity::ranked("j", 0, u32::MAX), 0).unwrap_err();
    assert_eq!(e, OpError::TooLarge { what: "world size".into(), len: u64::from(u32::MAX), limit: 1_048_576 });
    assert_eq!(e.to_string(), "world size of 4294967295 exceeds the limit of 1048576");
    // The limit itself is a valid world size; the refused identity left no trace.
    h.engine.open(SessionId(1), Identity::ranked("j", 0, MILLION), 0).expect("world size at the limit");

    let limits = Limits { max_world_size: 8, ..Limits::default() };
    let mut h = Harness::with_config(Config { limits, ..Config::default() });
    let e = h.engine.open(SessionId(1), Identity::ranked("j", 8, 9), 0).unwrap_err();
    assert!(matches!(e, OpError::TooLarge { len: 9, limit: 8, .. }), "{e:?}");
    let s = h.rank("j", 0, 8);
    // A torch store barrier's world size, and a member list, are claims too.
    let store_barrier = Request::StoreBarrier { key: b("/b"), world_size: 1 << 40, timeout_ms: None };
    let e = h.call(s, store_barrier).unwrap_err();
    assert_eq!(e, OpError::TooLarge { what: "world size".into(), len: 1 << 40, limit: 8 });
    let long_list = Members::Ranks(vec![0; 9]);
    let e = h.call(s, barrier_of("x", long_list, None)).unwrap_err();
    assert_eq!(e, OpError::TooLarge { what: "member list length".into(), len: 9, limit: 8 });
    // Nothing was counted at the refused store barrier's key.
    assert_eq!(h.call(s, Request::Check { keys: vec![b("/b")] }), Ok(Response::Bool(false)));
}

#[test]
fn a_timeout_in_a_world_of_a_million_names_64_ranks_and_ranges_the_rest() {
    let mut h = Harness::new();
    let r3 = h.rank("big", 3, MILLION);
    let r70 = h.rank("big", 70, MILLION);
    let r2 = h.rank("big", 2, MILLION); // connected, never arrives
    let a = h.send(r3, barrier("step", Some(1_000)));
    let c = h.send(r70, barrier("step", Some(1_000)));
    h.advance(1_000);
    let e = err(h.take(r3, a));
    assert_eq!(err(h.take(r70, c)), e);
    let OpError::CollectiveTimeout { members, missing, .. } = &e else { panic!("{e:?}") };
    assert_eq!((*members, missing.count()), (MILLION, u64::from(MILLION) - 2));
    let named: Vec<u32> = missing.iter().map(|m| m.rank).collect();
    let expected: Vec<u32> = [0, 1, 2].into_iter().chain(4..=64).collect();
    assert_eq!(named, expected);
    assert_eq!(missing[2].state, RankState::Connected);
    assert_eq!(missing.rest(), &RankRanges { ranges: vec![(65, 69), (71, MILLION - 1)], count: 5 + 1_048_505 });

    let text = e.to_string();
    assert!(text.len() < 4096, "{} bytes: {text}", text.len());
    assert!(text.starts_with("barrier 'step' (generation 1) timed out after 1.0 s: 1048574 of 1048576 ranks missing: "));
    assert!(text.contains("rank 1 (never connected); rank 2 (host node2, pid 1002, connected but not arrived"));
    assert!(text.ends_with("; rank 64 (never connected); and 1048510 more: ranks 65-69, 71-1048575"), "{text}");

    // Rank 2 waits in the next generation: the status report is as bounded.
    h.send(r2, barrier("step", None));
    h.send(r2, barrier("step", None));
    let report = status(&mut h, "big");
    let line = report.lines().find(|l| l.starts_with("waiting: barrier 'step' (generation 2)")).expect(&report);
    assert!(line.len() < 4096, "{line}");
    assert!(line.contains(": 1 of 1048576 arrived; missing (1048575): rank 0 (never connected); rank 1 "), "{line}");
    assert!(line.ends_with("; rank 64 (never connected); and 1048511 more: ranks 65-1048575"), "{line}");
}

#[test]
fn a_role_barrier_in_a_large_world_excludes_the_ranks_seen_with_another_role() {
    let mut h = Harness::new();
    let trainer = h.role_rank("j", 0, MILLION, "trainer");
    let _reader = h.role_rank("j", 1, MILLION, "reader");
    let _idle_trainer = h.role_rank("j", 5, MILLION, "trainer");
    let a = h.send(trainer, barrier_of("t", Members::Role("trainer".into()), Some(100)));
    h.advance(100);
    let OpError::CollectiveTimeout { missing, .. } = err(h.take(trainer, a)) else { panic!("timeout") };
    // Rank 1 is a reader: not a member. Rank 5 is a trainer that did not arrive;
    // every rank never seen may be a trainer.
    let named: Vec<u32> = missing.iter().map(|m| m.rank).collect();
    let expected: Vec<u32> = (2..=65).collect();
    assert_eq!(named, expected);
    assert_eq!(missing.rest(), &RankRanges { ranges: vec![(66, MILLION - 1)], count: u64::from(MILLION) - 66 });
    assert_eq!(missing.count(), u64::from(MILLION) - 2);
}

#[test]
fn member_lists_in_errors_are_bounded() {
    let mut h = Harness::new();
    let r0 = h.rank("j", 0, MILLION);
    let r1 = h.rank("j", 1, MILLION);
    // All but the last rank: every rank listed would be the whole job's barrier.
    let most: Vec<u32> = (0..MILLION - 1).collect();
    h.send(r0, barrier_of("x", Members::Ranks(most), None));
    let e = h.call(r1, barrier_of("x", Members::World, None)).unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, OpError::Mismatch { .. }), "{e:?}");
    assert!(text.len() < 2048, "{} bytes: {text}", text.len());
    assert!(text.contains(",62,63 and 1048511 more: 64-1048574] of world size 1048576"), "{text}");
}

#[test]
fn a_torch_store_barrier_of_a_large_world_names_the_missing_as_ranges() {
    let mut h = Harness::new();
    for (i, rank) in [0u32, 2].into_iter().enumerate() {
        let session = SessionId(100 + i as u64);
        h.engine.open_tcpstore(session, "t", "node", 4000 + rank, h.now).expect("torch session");
        let address = Request::Set { key: b(&format!("/default_pg/0//cpu//0/{rank}")), value: b("addr") };
        h.engine.handle(session, 1, address, h.now);
        let key = b("/default_pg/0//cpu//0/store_barrier");
        h.engine.handle(
            session,
            2,
            Request::StoreBarrier { key, world_size: i64::from(MILLION), timeout_ms: None },
            h.now,
        );
    }
    h.advance(5_000);
    let notices: Vec<String> = h.engine.drain_notices().collect();
    assert_eq!(notices.len(), 1, "{notices:?}");
    assert!(notices[0].len() < 2048, "{}", notices[0]);
    assert!(
        notices[0].contains("(counter 2 of world size 1048576); ranks not waiting there: [1, 3, 4, "),
        "{notices:?}"
    );
    assert!(notices[0].ends_with(", 64, 65 and 1048510 more: 66-1048575]"), "{}", notices[0]);
    let report = status(&mut h, "t");
    let line = report.lines().find(|l| l.starts_with("store barrier ")).expect(&report);
    assert!(line.len() < 2048, "{line}");
    assert!(line.ends_with(", 64, 65 and 1048510 more: 66-1048575]"), "{line}");
}

#[test]
fn the_lost_ranks_in_a_status_report_are_bounded() {
    let mut h = Harness::new();
    let sessions: Vec<SessionId> = (0..100).map(|r| h.rank("j", r, MILLION)).collect();
    for s in sessions {
        h.kill(s);
    }
    let report = status(&mut h, "j");
    let lost: Vec<&str> = report.lines().filter(|l| l.starts_with("lost: ")).collect();
    assert_eq!(lost.len(), Missing::NAMED + 1, "{report}");
    assert!(lost[63].starts_with("lost: rank 63 (host node63, pid 1063, lost: "), "{report}");
    assert_eq!(lost[64], "lost: and 36 more: ranks 64-99");
}

/// The missing ranks as the engine must state them, worked out one rank at a time.
struct Expected {
    named: Vec<u32>,
    rest: Vec<(u32, u32)>,
    rest_count: u64,
    unlisted: u64,
}

fn expected(missing: &[u32]) -> Expected {
    let cut = missing.len().min(Missing::NAMED);
    let mut rest: Vec<(u32, u32)> = Vec::new();
    for &r in &missing[cut..] {
        match rest.last_mut() {
            Some((_, last)) if *last + 1 == r => *last = r,
            _ => rest.push((r, r)),
        }
    }
    let listed: Vec<(u32, u32)> = rest.iter().copied().take(RankRanges::SHOWN).collect();
    let listed_count: u64 = listed.iter().map(|(a, z)| u64::from(z - a) + 1).sum();
    let rest_count = (missing.len() - cut) as u64;
    Expected { named: missing[..cut].to_vec(), rest: listed, rest_count, unlisted: rest_count - listed_count }
}

#[derive(Debug, Clone)]
enum Kind {
    World,
    Listed(BTreeSet<u32>),
    Role,
}

/// A world, the ranks that arrive, those connected that do not (every other rank
/// of the world, in a quarter of the cases), and who the members are.
fn case() -> impl Strategy<Value = (u32, BTreeSet<u32>, BTreeSet<u32>, Kind)> {
    (1u32..400).prop_flat_map(|world| {
        let ranks = proptest::collection::btree_set(0..world, 1..(world as usize).min(300) + 1);
        let connected = prop_oneof![
            3 => proptest::collection::btree_set(0..world, 0..40),
            1 => Just((0..world).collect::<BTreeSet<u32>>()),
        ];
        (Just(world), ranks.clone(), connected, ranks).prop_flat_map(|(world, arrived, connected, listed)| {
            let kind = prop_oneof![
                Just(Kind::World),
                Just(Kind::Listed(listed.union(&arrived).copied().collect())),
                Just(Kind::Role),
            ];
            (Just(world), Just(arrived), Just(connected), kind)
        })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Whatever ranks arrived, a timeout names the first 64 missing members in full
    /// and the rest as the right ranges, and its text is exactly that.
    #[test]
    fn timeouts_name_and_range_exactly_the_missing_members(
        (world, arrived, connected, kind) in case()
    ) {
        let mut h = Harness::new();
        let role = |r: u32| if r % 3 == 1 { "reader" } else { "trainer" };
        let members = match &kind {
            Kind::World => Members::World,
            Kind::Listed(list) => Members::Ranks(list.iter().copied().collect()),
            Kind::Role => Members::Role("trainer".into()),
        };
        // Callers of a role barrier have the role; others keep theirs.
        let arrived: BTreeSet<u32> = match kind {
            Kind::Role => arrived.into_iter().filter(|&r| role(r) == "trainer").collect(),
            _ => arrived,
        };
        prop_assume!(!arrived.is_empty());
        // Everyone connects first: a world whose ranks all came is the dense case.
        let idle: BTreeSet<u32> = connected.difference(&arrived).copied().collect();
        for &r in &idle {
            h.role_rank("j", r, world, role(r));
        }
        let callers: Vec<SessionId> = arrived.iter().map(|&r| h.role_rank("j", r, world, role(r))).collect();
        let waits: Vec<(SessionId, u64)> =
            callers.into_iter().map(|s| (s, h.send(s, barrier_of("b", members.clone(), Some(500))))).collect();
        h.advance(500);
        let all_seen = idle.len() + arrived.len() == world as usize;
        let is_member = |r: u32| match &kind {
            Kind::World => true,
            Kind::Listed(list) => list.contains(&r),
            // Unresolved, a rank never seen may hold the role.
            Kind::Role => role(r) == "trainer" || (!all_seen && !idle.contains(&r) && !arrived.contains(&r)),
        };
        let missing: Vec<u32> = (0..world).filter(|&r| is_member(r) && !arrived.contains(&r)).collect();
        let (s, id) = waits[0];
        if missing.is_empty() {
            prop_assert_eq!(h.take(s, id), Some(Ok(Response::Done)));
            return Ok(());
        }
        let e = err(h.take(s, id));
        let OpError::CollectiveTimeout { members, missing: got, .. } = &e else { panic!("{e:?}") };
        let want = expected(&missing);
        let info = |r: u32| match idle.contains(&r) {
            true => RankInfo {
                rank: r,
                host: Some(format!("node{r}")),
                pid: Some(1000 + r),
                state: RankState::Connected,
                last_seen_ms_ago: Some(500),
            },
            false => RankInfo { rank: r, host: None, pid: None, state: RankState::NeverConnected, last_seen_ms_ago: None },
        };
        let named: Vec<RankInfo> = want.named.iter().map(|&r| info(r)).collect();
        prop_assert_eq!(got.named(), &named[..]);
        prop_assert_eq!(&got.rest().ranges, &want.rest);
        prop_assert_eq!(got.rest().count, want.rest_count);
        prop_assert_eq!(got.count(), missing.len() as u64);

        let member_count = match (&kind, all_seen) {
            (Kind::World, _) => world,
            (Kind::Listed(list), _) => list.len() as u32,
            (Kind::Role, true) => (0..world).filter(|&r| role(r) == "trainer").count() as u32,
            (Kind::Role, false) => world,
        };
        prop_assert_eq!(*members, member_count);
        let mut text = format!(
            "barrier 'b' (generation 1) timed out after 0.5 s: {} of {member_count} ranks missing: ",
            missing.len()
        );
        text.push_str(&named.iter().map(RankInfo::to_string).collect::<Vec<_>>().join("; "));
        if want.rest_count > 0 {
            let ranges: Vec<String> = want
                .rest
                .iter()
                .map(|&(a, z)| if a == z { a.to_string() } else { format!("{a}-{z}") })
                .collect();
            let word = if want.rest_count == 1 { "rank" } else { "ranks" };
            text.push_str(&format!("; and {} more: {word} {}", want.rest_count, ranges.join(", ")));
            if want.unlisted > 0 {
                text.push_str(&format!(" and {} more above {}", want.unlisted, want.rest.last().unwrap().1));
            }
        }
        prop_assert_eq!(e.to_string(), text);
    }
}
