//! The engine's own cost of TCPStore store barriers, without sockets or codecs:
//! N torch sessions arrive at a barrier key each round, the last arrival releases
//! the others, and the clock moves 300 ms a round so that stall timers come due.
//!
//! `cargo bench -p rallypoint-core --bench store_barrier -- [N] [ROUNDS] [--fresh-keys]`
//! (default 16,384 and 40; `cargo test` runs it small, as a check). With
//! `--fresh-keys` each round counts on a key of its own, as the TCPStore load of
//! `rallypoint bench barrier` does. Then half the sessions arrive at one more
//! barrier and another session asks for the job's status report, timed: what
//! `rallypoint status` costs the coordinator in a long job.

use std::time::Instant;

use bytes::Bytes;
use rallypoint_core::{Config, Engine, Identity, Millis, Request, Response, SessionId};

const ROUND_MS: Millis = 300;

fn main() {
    let benching = std::env::args().any(|a| a == "--bench");
    let fresh = std::env::args().any(|a| a == "--fresh-keys");
    let numbers: Vec<u64> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let (default_n, default_rounds) = if benching { (16_384, 40) } else { (64, 8) };
    let n = numbers.first().copied().unwrap_or(default_n).max(1);
    let rounds = numbers.get(1).copied().unwrap_or(default_rounds).max(1);

    let mut engine = Engine::new(Config::default());
    let session = |i: u64| SessionId(i + 1);
    for i in 0..n {
        let pid = u32::try_from(1_000 + i).expect("N fits a pid");
        engine.open_tcpstore(session(i), "bench", "127.0.0.1", pid, 0).expect("session opens");
    }

    // torch reuses a few barrier keys; their counters never reset, so the n-th use of
    // a key waits for a count of n × N.
    const KEYS: u64 = 4;
    let mut now: Millis = 0;
    let mut answered = 0u64;
    let started = Instant::now();
    for round in 0..rounds {
        let (key, world_size) = if fresh {
            (Bytes::from(format!("/bench/store_barrier/fresh/{round}")), i64::try_from(n).expect("N fits i64"))
        } else {
            let key = Bytes::from(format!("/bench/store_barrier/{}", round % KEYS));
            (key, i64::try_from(n * (round / KEYS + 1)).expect("counter fits i64"))
        };
        for i in 0..n {
            let request = Request::StoreBarrier { key: key.clone(), world_size, timeout_ms: None };
            engine.handle(session(i), round, request, now);
            answered += engine.drain_outgoing().count() as u64;
        }
        now += ROUND_MS;
        engine.tick(now);
        answered += engine.drain_outgoing().count() as u64;
    }
    let elapsed = started.elapsed();
    assert_eq!(answered, n * rounds, "every arrival is answered exactly once");
    let per_round_ms = elapsed.as_secs_f64() * 1e3 / rounds as f64;
    println!(
        "store_barrier: N={n} rounds={rounds}: {per_round_ms:.2} ms per round, {:.2} µs per arrival",
        per_round_ms * 1e3 / n as f64
    );

    // A round in progress: half the sessions wait at a key of its own.
    let stuck = Bytes::from_static(b"/bench/store_barrier/stuck");
    for i in 0..n.div_ceil(2) {
        let world_size = i64::try_from(n).expect("N fits i64");
        let request = Request::StoreBarrier { key: stuck.clone(), world_size, timeout_ms: None };
        engine.handle(session(i), rounds, request, now);
    }
    assert_eq!(engine.drain_outgoing().count(), 0, "nobody is released");
    let tool = SessionId(n + 1);
    engine.open(tool, Identity::anonymous("bench"), now).expect("the tool's session opens");
    let started = Instant::now();
    engine.handle(tool, 0, Request::Status, now);
    let elapsed = started.elapsed();
    let reply = engine.drain_outgoing().find(|o| o.session == tool).map(|o| o.reply);
    let Some(Ok(Response::Value(report))) = reply else { panic!("status answers with its text: {reply:?}") };
    let lines = report.iter().filter(|&&c| c == b'\n').count();
    assert!(report.windows(stuck.len()).any(|w| w == stuck), "the report names the barrier in progress");
    println!(
        "status with {} waiting after {rounds} rounds: {:.2} ms, {lines} lines",
        n.div_ceil(2),
        elapsed.as_secs_f64() * 1e3
    );
}
