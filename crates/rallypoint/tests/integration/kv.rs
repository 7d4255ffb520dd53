use std::future::Future;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rallypoint::{Config, Error, Identity, OpError};
use tokio::task::JoinSet;

use crate::common::{bounded, connect, start_confirmed, start_server, start_server_with};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_value_operations_end_to_end() {
    let server = start_server().await;
    let c = connect(&server, Identity::anonymous("kv")).await;
    bounded("kv ops", async {
        c.set("a", "1").await.expect("set");
        assert_eq!(c.get("a", None).await.expect("get"), "1");
        assert_eq!(c.add("a", 41).await.expect("add"), 42);
        assert_eq!(c.add("counter", -3).await.expect("add to missing"), -3);
        match c.set("text", "abc").await.and(c.add("text", 1).await) {
            Err(Error::Op(OpError::NotANumber { key, value })) => {
                assert_eq!((key, value), ("text".into(), "abc".into()))
            }
            other => panic!("expected NotANumber, got {other:?}"),
        }

        // compare_set: TCPStore semantics.
        assert_eq!(c.compare_set("cas", "", "first").await.expect("cas create"), "first");
        assert_eq!(c.compare_set("cas", "wrong", "second").await.expect("cas mismatch"), "first");
        assert_eq!(c.compare_set("cas", "first", "second").await.expect("cas match"), "second");
        assert_eq!(c.compare_set("absent", "x", "y").await.expect("cas absent"), "x");

        c.append("log", "a").await.expect("append");
        c.append("log", "b").await.expect("append");
        assert_eq!(c.get("log", None).await.expect("get log"), "ab");

        assert!(c.check(&["a", "log"]).await.expect("check"));
        assert!(!c.check(&["a", "nope"]).await.expect("check missing"));
        assert!(c.delete("log").await.expect("delete"));
        assert!(!c.delete("log").await.expect("delete again"));

        c.multi_set(&[("m1", "x"), ("m2", "y")]).await.expect("multi_set");
        let values = c.multi_get(&["m2", "m1"], None).await.expect("multi_get");
        assert_eq!(values, vec![Bytes::from("y"), Bytes::from("x")]);
        c.wait(&["m1", "m2"], Some(Duration::from_secs(1))).await.expect("wait on present keys");

        let keys = c.list_keys("m").await.expect("list_keys");
        assert_eq!(keys, vec![Bytes::from("m1"), Bytes::from("m2")]);
        // a, counter, text, cas, m1, m2
        assert_eq!(c.num_keys().await.expect("num_keys"), 6);
    })
    .await;
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_timeout_names_the_missing_key() {
    let server = start_server().await;
    let c = connect(&server, Identity::anonymous("kv")).await;
    let started = Instant::now();
    match bounded("get", c.get("nope", Some(Duration::from_millis(300)))).await {
        Err(Error::Op(OpError::KeyTimeout { missing, waited_ms })) => {
            assert_eq!(missing, vec![Bytes::from("nope")]);
            assert!(waited_ms >= 300);
        }
        other => panic!("expected KeyTimeout, got {other:?}"),
    }
    assert!(started.elapsed() >= Duration::from_millis(300));
    match bounded("wait", c.wait(&["here", "gone"], Some(Duration::from_millis(100)))).await {
        Err(Error::Op(OpError::KeyTimeout { missing, .. })) => {
            assert_eq!(missing, vec![Bytes::from("here"), Bytes::from("gone")])
        }
        other => panic!("expected KeyTimeout, got {other:?}"),
    }
    server.shutdown().await;
}

/// Many blocking gets pipelined on one connection are all answered by another
/// client's sets, each with its own value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_waits_on_one_connection() {
    let server = start_server().await;
    let waiter = connect(&server, Identity::anonymous("pipe")).await;
    let setter = connect(&server, Identity::anonymous("pipe")).await;
    let mut gets = JoinSet::new();
    for i in 0..200 {
        let c = waiter.clone();
        gets.spawn(async move { (i, c.get(format!("key-{i}"), Some(Duration::from_secs(30))).await) });
    }
    // The last get on the connection is confirmed received before keys are set;
    // gets spawned earlier may still be in flight, which is fine: set-then-get works too.
    let c = waiter.clone();
    let last = start_confirmed(&waiter, async move { c.get("key-last", Some(Duration::from_secs(30))).await }).await;
    for i in 0..200 {
        setter.set(format!("key-{i}"), format!("value-{i}")).await.expect("set");
    }
    setter.set("key-last", "last").await.expect("set last");
    bounded("gets", async {
        while let Some(joined) = gets.join_next().await {
            let (i, got) = joined.expect("task");
            assert_eq!(got.expect("get"), format!("value-{i}"));
        }
        assert_eq!(last.await.expect("task").expect("last get"), "last");
    })
    .await;
    server.shutdown().await;
}

/// A shut-down coordinator fails waiting calls with `Disconnected` naming its address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_shutdown_fails_waiting_calls() {
    let server = start_server().await;
    let addr = server.local_addr().to_string();
    let c = connect(&server, Identity::anonymous("gone")).await;
    let c2 = c.clone();
    let waiting = start_confirmed(&c, async move { c2.get("never", Some(Duration::from_secs(50))).await }).await;
    server.shutdown().await;
    match bounded("waiting get", waiting).await.expect("task") {
        Err(Error::Disconnected(message)) => assert!(message.contains(&addr), "{message}"),
        other => panic!("expected Disconnected, got {other:?}"),
    }
    match bounded("later call", c.set("k", "v")).await {
        // Nothing listens there any more: said so, not "reconnecting".
        Err(Error::Disconnected(message)) => {
            assert!(message.contains(&addr) && message.contains("the coordinator is gone"), "{message}")
        }
        other => panic!("expected Disconnected, got {other:?}"),
    }
}

/// Many calls in flight on one client at once: replies that arrive together wake
/// their callers together, and the connection gathers their next requests into one
/// write. Every call must still get its own reply.
async fn concurrent_calls_on_one_client_get_their_own_replies() {
    const TASKS: i64 = 32;
    const ADDS: i64 = 200;
    let server = start_server().await;
    let c = connect(&server, Identity::anonymous("kv")).await;
    let mut tasks = JoinSet::new();
    for t in 0..TASKS {
        let c = c.clone();
        tasks.spawn(async move {
            let mut seen = Vec::with_capacity(ADDS as usize);
            for i in 0..ADDS {
                // A per-task key checks that replies are not crossed between calls.
                let own = format!("own/{t}");
                c.set(&own, i.to_string()).await.expect("set");
                assert_eq!(c.get(&own, None).await.expect("get"), i.to_string().as_bytes());
                seen.push(c.add("shared", 1).await.expect("add"));
            }
            seen
        });
    }
    assert_eq!(distinct_counts("concurrent calls", tasks).await, TASKS * ADDS);
    bounded("close", c.close()).await.expect("close");
    let other = connect(&server, Identity::anonymous("kv")).await;
    assert_eq!(other.add("shared", 0).await.expect("read counter"), TASKS * ADDS);
    server.shutdown().await;
}

/// Joins `tasks` (bounded, as `what`), each returning the counts its adds of 1 to
/// one key returned, and checks that every count from 1 to their number came
/// once: no reply was crossed between calls, lost or given twice. Their number.
async fn distinct_counts(what: &str, mut tasks: JoinSet<Vec<i64>>) -> i64 {
    let mut all = Vec::new();
    bounded(what, async {
        while let Some(counts) = tasks.join_next().await {
            all.extend(counts.expect("task"));
        }
    })
    .await;
    all.sort_unstable();
    let n = i64::try_from(all.len()).expect("count");
    assert_eq!(all, (1..=n).collect::<Vec<_>>(), "{what}");
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_calls_on_one_client_multi_thread() {
    concurrent_calls_on_one_client_get_their_own_replies().await;
}

#[tokio::test(flavor = "current_thread")]
async fn concurrent_calls_on_one_client_current_thread() {
    concurrent_calls_on_one_client_get_their_own_replies().await;
}

/// A small deterministic generator: each task's choices follow from its seed.
struct Choices(u64);

impl Choices {
    fn below(&mut self, n: u64) -> u64 {
        // xorshift64*: enough spread for picking steps and delays.
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}

/// Polls `future` once, then hands it back, still pending or not.
async fn polled_once<F: Future + Unpin>(mut future: F) -> F {
    std::future::poll_fn(|cx| {
        let _ = std::pin::Pin::new(&mut future).poll(cx);
        std::task::Poll::Ready(())
    })
    .await;
    future
}

/// Calls on one client from many tasks, dropped at random points of their wait:
/// while one reads the socket for everyone, while others wait behind it, held
/// polled once and unpolled while the same task calls again, or after their reply
/// came. Reading and the link's own cell must always pass on: every call that is
/// kept gets its own reply, nothing waits for good, and the client serves on.
/// Without a lease the connection's task has no heartbeat to run for, so a read
/// handed to nobody would leave the calls behind it waiting until the bound.
async fn calls_dropped_at_random_leave_nothing_waiting(seed: u64) {
    const TASKS: u64 = 8;
    const STEPS: u64 = 250;
    let server = start_server_with(Config { lease_ms: 0, ..Config::default() }).await;
    let c = connect(&server, Identity::anonymous("kv")).await;
    let mut tasks = JoinSet::new();
    for t in 0..TASKS {
        let c = c.clone();
        tasks.spawn(async move {
            let mut choose = Choices(seed ^ (t + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            let mut exact = Vec::new();
            for step in 0..STEPS {
                match choose.below(5) {
                    // Kept: the reply must be this call's.
                    0 => exact.push(c.add("exact", 1).await.expect("add")),
                    // Dropped after up to 0.4 ms: whatever it was doing by then.
                    1 => {
                        let within = Duration::from_micros(choose.below(400));
                        if let Ok(added) = tokio::time::timeout(within, c.add("maybe", 1)).await {
                            assert!(added.expect("add") >= 1);
                        }
                    }
                    // Never answered before it is dropped (or times out on the server).
                    2 => {
                        let within = Duration::from_micros(choose.below(2_000));
                        let never = format!("never/{t}");
                        let waited = Duration::from_millis(1 + choose.below(3));
                        if let Ok(got) = tokio::time::timeout(within, c.get(&never, Some(waited))).await {
                            match got {
                                Err(Error::Op(OpError::KeyTimeout { .. })) => {}
                                other => panic!("task {t} step {step}: expected KeyTimeout, got {other:?}"),
                            }
                        }
                    }
                    // Polled once, held while the same task calls again, then dropped.
                    3 => {
                        let held = polled_once(Box::pin(c.add("maybe", 1))).await;
                        exact.push(c.add("exact", 1).await.expect("add behind a held call"));
                        if choose.below(2) == 0 {
                            tokio::task::yield_now().await;
                        }
                        drop(held);
                    }
                    // A value of its own, read back.
                    _ => {
                        let own = format!("own/{t}");
                        c.set(&own, step.to_string()).await.expect("set");
                        assert_eq!(c.get(&own, None).await.expect("get"), step.to_string().as_bytes());
                    }
                }
            }
            exact
        });
    }
    let kept = distinct_counts("calls dropped at random", tasks).await;
    // The client still serves, every call given up having left it.
    assert_eq!(bounded("a call after them", c.add("exact", 0)).await.expect("add"), kept);
    bounded("a ping after them", c.ping()).await.expect("ping");
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_dropped_at_random_multi_thread() {
    for seed in [1, 2] {
        calls_dropped_at_random_leave_nothing_waiting(seed).await;
    }
}

#[tokio::test(flavor = "current_thread")]
async fn calls_dropped_at_random_current_thread() {
    for seed in [3, 4] {
        calls_dropped_at_random_leave_nothing_waiting(seed).await;
    }
}
