//! Key-value semantics, matching PyTorch's TCPStore where the op exists there.

mod common;

use common::{b, err, ok, Harness};
use rallypoint_core::{Config, Identity, Limits, OpError, Request, Response, SessionId};

fn tool(h: &mut Harness, job: &str) -> rallypoint_core::SessionId {
    h.open(Identity::anonymous(job))
}

#[test]
fn set_get_delete_check_num_keys() {
    let mut h = Harness::new();
    let s = tool(&mut h, "j");
    assert_eq!(h.call(s, Request::Set { key: b("/k"), value: b("v") }), Ok(Response::Done));
    assert_eq!(h.call(s, Request::Get { key: b("/k"), timeout_ms: Some(0) }), Ok(Response::Value(b("v"))));
    assert_eq!(h.call(s, Request::Check { keys: vec![b("/k")] }), Ok(Response::Bool(true)));
    assert_eq!(h.call(s, Request::Check { keys: vec![b("/k"), b("/x")] }), Ok(Response::Bool(false)));
    assert_eq!(h.call(s, Request::NumKeys), Ok(Response::Int(1)));
    assert_eq!(h.call(s, Request::Delete { key: b("/k") }), Ok(Response::Bool(true)));
    assert_eq!(h.call(s, Request::Delete { key: b("/k") }), Ok(Response::Bool(false)));
    assert_eq!(h.call(s, Request::NumKeys), Ok(Response::Int(0)));
}

#[test]
fn add_counts_from_zero_and_stores_decimal_text() {
    let mut h = Harness::new();
    let s = tool(&mut h, "j");
    assert_eq!(h.call(s, Request::Add { key: b("c"), delta: 5 }), Ok(Response::Int(5)));
    assert_eq!(h.call(s, Request::Add { key: b("c"), delta: -2 }), Ok(Response::Int(3)));
    assert_eq!(h.call(s, Request::Get { key: b("c"), timeout_ms: None }), Ok(Response::Value(b("3"))));
}

/// A native client's `add` reads decimal digits with an optional sign and nothing
/// else: a value that is not one is named, not rounded ("0.001" would become 1).
/// A TCPStore client's reads as torch's `std::stoll` does, as its clients expect.
#[test]
fn add_reads_a_decimal_integer_natively_and_as_stoll_for_torch() {
    let mut h = Harness::new();
    let s = tool(&mut h, "j");
    let torch = SessionId(1000);
    h.engine.open_tcpstore(torch, "j", "10.0.0.1", 7, h.now).expect("accepted");
    for (value, as_stoll) in [("12abc", Some(13)), ("0.001", Some(1)), (" 7", Some(8)), ("1e3", Some(2)), ("", None)] {
        h.call(s, Request::Set { key: b("n"), value: b(value) }).unwrap();
        let e = h.call(s, Request::Add { key: b("n"), delta: 1 }).unwrap_err();
        assert!(matches!(&e, OpError::NotANumber { value: v, .. } if v == &b(value)), "{value:?}: {e:?}");
        let by_torch = h.call(torch, Request::Add { key: b("n"), delta: 1 });
        match as_stoll {
            Some(n) => assert_eq!(by_torch, Ok(Response::Int(n)), "{value:?}"),
            None => assert!(matches!(by_torch, Err(OpError::NotANumber { .. })), "{value:?}: {by_torch:?}"),
        }
    }
    for (value, added) in [("41", 42), ("+41", 42), ("-43", -42)] {
        h.call(s, Request::Set { key: b("n"), value: b(value) }).unwrap();
        assert_eq!(h.call(s, Request::Add { key: b("n"), delta: 1 }), Ok(Response::Int(added)), "{value:?}");
    }
}

#[test]
fn add_on_non_number_or_overflow_is_an_error_and_changes_nothing() {
    let mut h = Harness::new();
    let s = tool(&mut h, "j");
    h.call(s, Request::Set { key: b("t"), value: b("abc") }).unwrap();
    let e = h.call(s, Request::Add { key: b("t"), delta: 1 }).unwrap_err();
    assert!(matches!(&e, OpError::NotANumber { key, value } if key == &b("t") && value == &b("abc")), "{e:?}");
    h.call(s, Request::Set { key: b("big"), value: b(&i64::MAX.to_string()) }).unwrap();
    let e = h.call(s, Request::Add { key: b("big"), delta: 1 }).unwrap_err();
    assert!(matches!(e, OpError::Overflow { current: i64::MAX, delta: 1, .. }));
    assert_eq!(
        h.call(s, Request::Get { key: b("big"), timeout_ms: None }),
        Ok(Response::Value(b(&i64::MAX.to_string())))
    );
    assert!(e.to_string().contains("overflows"));
}

#[test]
fn compare_set_follows_tcpstore_including_the_missing_key_case() {
    let mut h = Harness::new();
    let s = tool(&mut h, "j");
    let cas = |h: &mut Harness, e: &str, d: &str| {
        h.call(s, Request::CompareSet { key: b("k"), expected: b(e), desired: b(d) })
    };
    // Missing key, non-empty expected: returns expected, creates nothing.
    assert_eq!(cas(&mut h, "x", "y"), Ok(Response::Value(b("x"))));
    assert_eq!(h.call(s, Request::Check { keys: vec![b("k")] }), Ok(Response::Bool(false)));
    // Missing key, empty expected: creates.
    assert_eq!(cas(&mut h, "", "a"), Ok(Response::Value(b("a"))));
    // Present and equal: swaps.
    assert_eq!(cas(&mut h, "a", "b"), Ok(Response::Value(b("b"))));
    // Present and different: returns current, unchanged.
    assert_eq!(cas(&mut h, "zzz", "c"), Ok(Response::Value(b("b"))));
}

#[test]
fn append_multi_set_multi_get_list_keys() {
    let mut h = Harness::new();
    let s = tool(&mut h, "j");
    h.call(s, Request::Append { key: b("a"), value: b("x") }).unwrap();
    h.call(s, Request::Append { key: b("a"), value: b("y") }).unwrap();
    h.call(s, Request::MultiSet { entries: vec![(b("p/1"), b("1")), (b("p/2"), b("2"))] }).unwrap();
    assert_eq!(
        h.call(s, Request::MultiGet { keys: vec![b("p/2"), b("a"), b("p/1")], timeout_ms: None }),
        Ok(Response::Values(vec![b("2"), b("xy"), b("1")]))
    );
    assert_eq!(h.call(s, Request::ListKeys { prefix: b("p/") }), Ok(Response::Values(vec![b("p/1"), b("p/2")])));
}

#[test]
fn get_and_wait_block_until_the_key_is_set() {
    let mut h = Harness::new();
    let a = tool(&mut h, "j");
    let w = tool(&mut h, "j");
    let get = h.send(w, Request::Get { key: b("k"), timeout_ms: Some(5_000) });
    let wait = h.send(w, Request::Wait { keys: vec![b("k"), b("k2")], timeout_ms: None });
    let mget = h.send(w, Request::MultiGet { keys: vec![b("k2"), b("k")], timeout_ms: None });
    assert!(h.pending(w, get) && h.pending(w, wait) && h.pending(w, mget));
    h.call(a, Request::Set { key: b("k"), value: b("1") }).unwrap();
    assert_eq!(ok(h.take(w, get)), Response::Value(b("1")));
    assert!(h.pending(w, wait));
    // A key deleted after being counted is waited for again.
    h.call(a, Request::Delete { key: b("k") }).unwrap();
    h.call(a, Request::Add { key: b("k2"), delta: 7 }).unwrap();
    assert!(h.pending(w, wait) && h.pending(w, mget));
    h.call(a, Request::Set { key: b("k"), value: b("2") }).unwrap();
    assert_eq!(ok(h.take(w, wait)), Response::Done);
    assert_eq!(ok(h.take(w, mget)), Response::Values(vec![b("7"), b("2")]));
    // The timer of the answered get fires later and must not reply twice.
    h.advance(10_000);
    assert!(h.replies.is_empty());
}

#[test]
fn wait_timeout_names_the_missing_keys_and_the_session_stays_usable() {
    let mut h = Harness::new();
    let s = tool(&mut h, "j");
    h.call(s, Request::Set { key: b("here"), value: b("1") }).unwrap();
    let id = h.send(s, Request::Wait { keys: vec![b("here"), b("/nokey")], timeout_ms: Some(500) });
    h.advance(499);
    assert!(h.pending(s, id));
    h.advance(1);
    let e = err(h.take(s, id));
    assert_eq!(e, OpError::KeyTimeout { waited_ms: 500, missing: vec![b("/nokey")] });
    assert!(e.to_string().contains("/nokey"), "{e}");
    assert_eq!(h.call(s, Request::Check { keys: vec![b("here")] }), Ok(Response::Bool(true)));
}

#[test]
fn closing_a_session_drops_its_waits() {
    let mut h = Harness::new();
    let s = tool(&mut h, "j");
    let other = tool(&mut h, "j");
    let id = h.send(s, Request::Get { key: b("k"), timeout_ms: Some(100) });
    h.kill(s);
    h.call(other, Request::Set { key: b("k"), value: b("v") }).unwrap();
    h.advance(1_000);
    assert!(h.take(s, id).is_none());
}

#[test]
fn jobs_do_not_share_keys() {
    let mut h = Harness::new();
    let a = tool(&mut h, "a");
    let c = tool(&mut h, "b");
    h.call(a, Request::Set { key: b("k"), value: b("from-a") }).unwrap();
    assert_eq!(h.call(c, Request::Check { keys: vec![b("k")] }), Ok(Response::Bool(false)));
    let id = h.send(c, Request::Get { key: b("k"), timeout_ms: Some(10) });
    h.advance(10);
    assert!(matches!(err(h.take(c, id)), OpError::KeyTimeout { .. }));
}

#[test]
fn limits_are_enforced_before_anything_changes() {
    let limits = Limits {
        max_key_len: 4,
        max_value_len: 8,
        max_keys_per_op: 2,
        max_world_size: 4,
        max_name_len: 16,
        max_gather_bytes: 64,
        ..Limits::default()
    };
    let mut h = Harness::with_config(Config { limits, ..Config::default() });
    let s = tool(&mut h, "j");
    let e = h.call(s, Request::Set { key: b("12345"), value: b("v") }).unwrap_err();
    assert_eq!(e, OpError::TooLarge { what: "key length".into(), len: 5, limit: 4 });
    assert_eq!(e.to_string(), "key length of 5 exceeds the limit of 4");
    let e = h.call(s, Request::MultiSet { entries: vec![(b("a"), b("1")), (b("b"), b("123456789"))] }).unwrap_err();
    assert!(matches!(e, OpError::TooLarge { len: 9, limit: 8, .. }));
    // The valid first entry of the refused multi_set was not stored.
    assert_eq!(h.call(s, Request::NumKeys), Ok(Response::Int(0)));
    let e = h.call(s, Request::Check { keys: vec![b("a"), b("b"), b("c")] }).unwrap_err();
    assert!(matches!(e, OpError::TooLarge { len: 3, limit: 2, .. }));
}

#[test]
fn a_request_id_reused_while_waiting_is_refused() {
    let mut h = Harness::new();
    let s = tool(&mut h, "j");
    h.engine.handle(s, 7, Request::Get { key: b("k"), timeout_ms: None }, h.now);
    h.engine.handle(s, 7, Request::Get { key: b("k"), timeout_ms: None }, h.now);
    let out: Vec<_> = h.engine.drain_outgoing().collect();
    assert_eq!(out.len(), 1);
    assert!(matches!(&out[0].reply, Err(OpError::Invalid(m)) if m.contains("request id 7")));
}
