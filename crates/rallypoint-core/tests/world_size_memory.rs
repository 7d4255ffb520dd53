//! The memory the engine takes for a world follows the ranks that connect, never
//! the world size they claim. Measured with a counting allocator, in a test binary
//! of its own holding a single test, so that nothing else allocates meanwhile.

mod common;

use common::{b, barrier, barrier_of, Harness};
use counting::peak_growth;
use rallypoint_core::{Config, Identity, Limits, Members, Request, Response, SessionId};

#[path = "common/counting.rs"]
mod counting;

/// What the ranks of a large world do with every kind of collective, a status
/// report and a torch store barrier, when only two of them (and a torch process)
/// ever connect.
fn two_ranks_of(world: u32, config: Config) {
    let mut h = Harness::with_config(config);
    let r0 = h.role_rank("big", 0, world, "trainer");
    let r1 = h.role_rank("big", 1, world, "trainer");
    for s in [r0, r1] {
        h.send(s, barrier("all", Some(1_000)));
        h.send(s, barrier_of("trainers", Members::Role("trainer".into()), Some(1_000)));
        h.send(
            s,
            Request::AllGather { name: "g".into(), members: Members::World, value: b("v"), timeout_ms: Some(1_000) },
        );
        let root = world - 1;
        h.send(
            s,
            Request::Broadcast {
                name: "c".into(),
                members: Members::World,
                root,
                value: None,
                timeout_ms: Some(1_000),
            },
        );
    }
    let torch = SessionId(1_000);
    h.engine.open_tcpstore(torch, "big", "node", 77, h.now).expect("torch session");
    h.engine.handle(torch, 1, Request::Set { key: b("/default_pg/0//cpu//0/0"), value: b("a") }, h.now);
    let key = b("/default_pg/0//cpu//0/store_barrier");
    h.engine.handle(torch, 2, Request::StoreBarrier { key, world_size: i64::from(world), timeout_ms: None }, h.now);
    h.send(r0, barrier("later", None));

    // Status while they wait; stall notices; then every deadline.
    let tool = h.open(Identity::anonymous("big"));
    let Ok(Response::Value(report)) = h.call(tool, Request::Status) else { panic!("status") };
    assert!(report.len() < 64 << 10, "{} bytes of status", report.len());
    h.advance(1_000);
    let texts: Vec<String> = h.replies.values().filter_map(|r| r.as_ref().err().map(|e| e.to_string())).collect();
    assert_eq!(texts.len(), 8, "every collective call timed out: {texts:?}");
    assert!(texts.iter().all(|t| t.len() < 8 << 10), "{texts:?}");
    h.advance(5_000);
    let notices: Vec<String> = h.engine.drain_notices().collect();
    assert!(!notices.is_empty() && notices.iter().all(|n| n.len() < 8 << 10), "{notices:?}");
}

#[test]
fn claimed_world_sizes_cost_no_memory() {
    // A small world first (rank 2 never comes): what any world costs, whatever its size.
    let small = peak_growth(|| two_ranks_of(3, Config::default()));
    const SLACK: usize = 256 << 10;

    let million = peak_growth(|| two_ranks_of(1 << 20, Config::default()));
    assert!(million < small + SLACK, "world size 1048576: {million} bytes at peak, {small} for a world of 3");

    // With the cap lifted, the largest world a client can state costs no more.
    let limits = Limits { max_world_size: u32::MAX, ..Limits::default() };
    let largest = peak_growth(|| two_ranks_of(u32::MAX, Config { limits, ..Config::default() }));
    assert!(largest < small + SLACK, "world size 4294967295: {largest} bytes at peak, {small} for a world of 3");
}
