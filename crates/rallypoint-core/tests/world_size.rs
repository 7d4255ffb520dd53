//! A world size is only a claim: it is capped.

mod common;

use common::{b, barrier_of, Harness};
use rallypoint_core::{Config, Identity, Limits, Members, OpError, Request, Response, SessionId};

const MILLION: u32 = 1 << 20;

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
