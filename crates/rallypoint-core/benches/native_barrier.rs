//! The engine's own cost of native barriers, without sockets or codecs: N ranked
//! sessions arrive at barrier "step" each round; the last arrival releases them all.
//! With `--incarnation` the sessions state incarnations, as rallypoint's clients do:
//! they hold their ranks, and their barrier replies are kept for re-sent requests
//! (what that costs is the difference between the two runs). With `--fresh-names`
//! each round's barrier has a name of its own ("step/0", "step/1", ...), as a job
//! that names its barriers by step has: the run also prints the process's resident
//! memory after the rounds, and times the end of one rank's session, which looks at
//! the collectives that still have someone waiting.
//!
//! `cargo bench -p rallypoint-core --bench native_barrier -- [N] [ROUNDS] [--incarnation] [--fresh-names]`
//! (default 16,384 and 40; `cargo test` runs it small, as a check).

use std::time::Instant;

use rallypoint_core::{Config, Engine, Identity, Members, Millis, Name, Request, SessionId};

fn main() {
    let benching = std::env::args().any(|a| a == "--bench");
    let incarnations = std::env::args().any(|a| a == "--incarnation");
    let fresh = std::env::args().any(|a| a == "--fresh-names");
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
            let name: Name = if fresh { compact_str::format_compact!("step/{round}") } else { "step".into() };
            let request = Request::Barrier { name, members: Members::World, timeout_ms: None };
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
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let resident = status.lines().find_map(|l| l.strip_prefix("VmRSS:")).map_or("?", str::trim);
    let started = Instant::now();
    engine.close(session(0), rounds);
    println!(
        "resident after the rounds: {resident}; one session's end: {:.3} ms",
        started.elapsed().as_secs_f64() * 1e3
    );
}
