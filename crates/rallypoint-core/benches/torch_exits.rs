//! The engine's cost of a PyTorch job's end: N torch sessions have written their
//! gloo address keys and each waits for one more (a rank that never comes, as in a
//! hung job), when their launcher reports every worker's end. Each report looks for
//! the waits on the ending rank's address keys; none of these is one of them.
//!
//! `cargo bench -p rallypoint-core --bench torch_exits -- [N]` (default 4,096;
//! `cargo test` runs it small, as a check).

use std::time::Instant;

use bytes::Bytes;
use rallypoint_core::{Config, Engine, Exit, Identity, Request, SessionId};

fn main() {
    let benching = std::env::args().any(|a| a == "--bench");
    let n: u32 = std::env::args().skip(1).find_map(|a| a.parse().ok()).unwrap_or(if benching { 4_096 } else { 64 });
    let n = n.max(1);
    let mut engine = Engine::new(Config::default());
    let prefix = "/default_pg/0//cpu//0/";
    let session = |rank: u32| SessionId(u64::from(rank) + 1);
    for rank in 0..n {
        engine.open_tcpstore(session(rank), "bench", "127.0.0.1", 1_000 + rank, 0).expect("session opens");
        let key = Bytes::from(format!("{prefix}{rank}"));
        engine.handle(session(rank), 0, Request::Set { key, value: Bytes::from_static(b"addr") }, 0);
    }
    for rank in 0..n {
        let keys = vec![Bytes::from(format!("{prefix}{n}"))];
        engine.handle(session(rank), 1, Request::Wait { keys, timeout_ms: None }, 0);
    }
    let launcher = SessionId(u64::from(n) + 1);
    let identity = Identity { world_size: Some(n + 1), ..Identity::anonymous("bench") };
    engine.open(launcher, identity, 0).expect("the launcher's session opens");
    let _ = engine.drain_outgoing().count();
    let started = Instant::now();
    for rank in 0..n {
        let exited = Request::RankExited { rank, host: "node".into(), pid: 1_000 + rank, exit: Exit::Code(0) };
        engine.handle(launcher, u64::from(rank), exited, 0);
    }
    let elapsed = started.elapsed();
    let answered = engine.drain_outgoing().filter(|o| o.session == launcher).count();
    assert_eq!(answered, n as usize, "every report is answered");
    println!(
        "torch_exits: N={n}: {:.2} ms for the N reports, {:.2} µs per report",
        elapsed.as_secs_f64() * 1e3,
        elapsed.as_secs_f64() * 1e6 / f64::from(n)
    );
}
