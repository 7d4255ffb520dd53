//! The engine's own cost of native barriers, without sockets or codecs: N ranked
//! sessions arrive at barrier "step" each round; the last arrival releases them all.
//! With `--incarnation` the sessions state incarnations, as rallypoint's clients do:
//! they hold their ranks, and their barrier replies are kept for re-sent requests
//! (what that costs is the difference between the two runs).
//!
//! `cargo bench -p rallypoint-core --bench native_barrier -- [N] [ROUNDS] [--incarnation]`
//! (default 16,384 and 40; `cargo test` runs it small, as a check).

use std::time::Instant;

use rallypoint_core::{Config, Engine, Identity, Members, Millis, Request, SessionId};

fn main() {
    let benching = std::env::args().any(|a| a == "--bench");
    let incarnations = std::env::args().any(|a| a == "--incarnation");
    let numbers: Vec<u64> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let (default_n, default_rounds) = if benching { (16_384, 40) } else { (64, 8) };
    let n = u32::try_from(numbers.first().copied().unwrap_or(default_n).max(1)).expect("N fits a rank");
    let rounds = numbers.get(1).copied().unwrap_or(default_rounds).max(1);

    let mut engine = Engine::new(Config::default());
    let session = |rank: u32| SessionId(u64::from(rank) + 1);
    for rank in 0..n {
        let mut identity = Identity::ranked("bench", rank, n);
        identity.pid = 1_000 + rank;
        identity.incarnation = incarnations.then_some(u64::from(rank) + 1);
        engine.open(session(rank), identity, 0).expect("session opens");
    }
    let mut answered = 0u64;
    let started = Instant::now();
    for round in 0..rounds {
        // A millisecond a round: every kept reply stays within its age.
        let now: Millis = round;
        for rank in 0..n {
            let request = Request::Barrier { name: "step".into(), members: Members::World, timeout_ms: None };
            engine.handle(session(rank), round + 1, request, now);
            answered += engine.drain_outgoing().count() as u64;
        }
    }
    let elapsed = started.elapsed();
    assert_eq!(answered, u64::from(n) * rounds, "every arrival is answered exactly once");
    let per_round_ms = elapsed.as_secs_f64() * 1e3 / rounds as f64;
    println!(
        "native_barrier (incarnations: {incarnations}): N={n} rounds={rounds}: {per_round_ms:.2} ms per round, \
         {:.3} µs per arrival",
        per_round_ms * 1e3 / f64::from(n)
    );
}
