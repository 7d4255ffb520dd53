//! The memory the engine takes for a world follows the ranks that connect, never
//! the world size they claim. Measured with a counting allocator, in a test binary
//! of its own holding a single test, so that nothing else allocates meanwhile.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use common::{b, barrier, barrier_of, Harness};
use rallypoint_core::{Config, Identity, Limits, Members, Request, Response, SessionId};

/// Bytes live now, and the most live since the last reset.
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

struct Counting;

// SAFETY: every call is passed to the system allocator unchanged; only counts are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            grew(layout.size());
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            grew(layout.size());
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
            grew(new_size);
        }
        new
    }
}

fn grew(size: usize) {
    let live = LIVE.fetch_add(size, Ordering::Relaxed) + size;
    PEAK.fetch_max(live, Ordering::Relaxed);
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The most memory `f` held at once beyond what was live when it began.
fn peak_growth(f: impl FnOnce()) -> usize {
    let base = LIVE.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    f();
    PEAK.load(Ordering::Relaxed).saturating_sub(base)
}

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
