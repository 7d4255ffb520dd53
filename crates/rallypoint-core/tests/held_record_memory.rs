//! The memory a node agent's SubRequests frame makes the engine hold, measured with
//! a counting allocator (one test in this binary): a frame whose calls each start a
//! record of their own (one sub-session's 4,096 calls, the most a frame may carry,
//! each of the next generation) holds about what the same calls made one by one
//! hold, not room for every later call of the frame in each record.

use std::sync::atomic::Ordering;

use counting::LIVE;
use rallypoint_core::{Config, Engine, Identity, Link, Members, Request, SessionId};

#[path = "common/counting.rs"]
mod counting;

/// Bytes the engine holds after one run of `n` barrier calls of one session (rank 0
/// of 2, whose peer never comes): held, or one by one.
fn held_after(n: u64, held: bool) -> usize {
    let mut engine = Engine::new(Config { lease_ms: 0, ..Config::default() });
    let session = SessionId(1);
    engine.open(session, Identity { incarnation: Some(1), ..Identity::ranked("j", 0, 2) }, 0).expect("open");
    let request = Request::Barrier { name: "b".into(), members: Members::World, timeout_ms: None };
    let calls: Vec<(SessionId, u64)> = (1..=n).map(|id| (session, id)).collect();
    let routes: Vec<u64> = vec![1; calls.len()];
    let before = LIVE.load(Ordering::Relaxed);
    if held {
        engine.handle_calls_from(Link { id: 1, stamp: 0 }, &calls, &routes, &request, 0);
    } else {
        for &(s, id) in &calls {
            engine.handle(s, id, request.clone(), 0);
        }
    }
    let _ = engine.drain_outgoing().count();
    let _ = engine.take_records();
    let grown = LIVE.load(Ordering::Relaxed).saturating_sub(before);
    drop(engine);
    grown
}

#[test]
fn one_frame_of_calls_holds_memory_in_proportion_to_its_calls() {
    let one = held_after(4096, false);
    let held = held_after(4096, true);
    eprintln!("4096 calls of one sub-session: one by one {} KiB, held {} KiB", one / 1024, held / 1024);
    assert!(held < 4 * one + (1 << 20), "held {held} bytes vs one by one {one} bytes");
}
