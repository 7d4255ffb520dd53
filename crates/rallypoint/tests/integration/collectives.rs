use std::time::{Duration, Instant};

use rallypoint::{Error, LossReason, Members, OpError, RankInfo, RankState};
use rallypoint_core::CollectiveKind;

use crate::common::{bounded, connect, rank, start_confirmed, start_server, start_server_with};

/// A barrier's future sends nothing until it is polled: one made and dropped
/// unpolled arrives nowhere, so the rank's next barrier is its first arrival.
/// One dropped while it waits leaves its arrival counted (as a rank that gave up
/// waiting), and the rank's next call of the name meets the others' next one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_barrier_arrives_when_polled_not_when_made() {
    let server = start_server().await;
    let a = connect(&server, rank("lazy", 0, 2)).await;
    let b = connect(&server, rank("lazy", 1, 2)).await;
    let wait = Some(Duration::from_secs(20));

    let unpolled = a.barrier("sync", Members::World, wait);
    // As an `async fn`'s was: it may be moved to a task, or held by reference across an await.
    fn shareable<T: Send + Sync>(_: &T) {}
    shareable(&unpolled);
    drop(unpolled);
    let (first_a, first_b) = bounded("first round", async {
        tokio::join!(a.barrier("sync", Members::World, wait), b.barrier("sync", Members::World, wait))
    })
    .await;
    first_a.expect("rank 0, round 1");
    first_b.expect("rank 1, round 1");

    // Polled once (its arrival is in), then dropped while waiting for rank 1.
    let mut given_up = Box::pin(a.barrier("sync", Members::World, wait));
    tokio::select! {
        biased;
        _ = &mut given_up => panic!("round 2 released with rank 1 absent"),
        () = std::future::ready(()) => {}
    }
    bounded("confirming request", a.num_keys()).await.expect("num_keys after the arrival");
    drop(given_up);
    bounded("rank 1, round 2", b.barrier("sync", Members::World, wait)).await.expect("rank 1 meets the arrival");
    let (third_a, third_b) = bounded("third round", async {
        tokio::join!(a.barrier("sync", Members::World, wait), b.barrier("sync", Members::World, wait))
    })
    .await;
    third_a.expect("rank 0, round 3");
    third_b.expect("rank 1, round 3");
}

/// A rank whose process dies (connection dropped without leaving) fails every other
/// waiter at once, naming the rank, its host and pid.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_client_fails_every_waiter_with_peer_lost() {
    let server = start_server().await;
    let mut clients = Vec::new();
    for r in 0..4 {
        clients.push(connect(&server, rank("lost", r, 4)).await);
    }
    let victim = clients.pop().expect("rank 3");

    let mut waiters = Vec::new();
    for client in &clients {
        let c = client.clone();
        let op = async move { c.barrier("sync", Members::World, Some(Duration::from_secs(50))).await };
        waiters.push(start_confirmed(client, op).await);
    }
    // Every waiter is now inside the barrier. Kill rank 3.
    let killed = Instant::now();
    drop(victim);

    for (r, waiter) in waiters.into_iter().enumerate() {
        let result = bounded("waiter", waiter).await.expect("waiter task");
        match result {
            Err(Error::Op(OpError::PeerLost { op, peer })) => {
                assert_eq!((op.kind, op.name.as_str(), op.generation), (CollectiveKind::Barrier, "sync", 1));
                assert_eq!(peer.rank, 3);
                assert_eq!(peer.host.as_deref(), Some("host-3"));
                assert_eq!(peer.pid, Some(1003));
                assert_eq!(peer.state, RankState::Lost(LossReason::Disconnected));
            }
            other => panic!("rank {r}: expected PeerLost, got {other:?}"),
        }
    }
    // "At once": far below the 50 s barrier timeout.
    assert!(killed.elapsed() < Duration::from_secs(5), "took {:?}", killed.elapsed());

    // A new process taking rank 3 over reaches the generation its predecessor
    // failed: told of that process's loss, not that this one was declared lost.
    // Another process: its own incarnation (these clients share this test's).
    let identity = rallypoint::Identity { pid: 5003, incarnation: Some(0x5003), ..rank("lost", 3, 4) };
    let successor = connect(&server, identity).await;
    match bounded("successor", successor.barrier("sync", Members::World, None)).await {
        Err(Error::Op(OpError::PeerLost { peer, .. })) => assert_eq!((peer.rank, peer.pid), (3, Some(1003))),
        other => panic!("expected PeerLost naming pid 1003, got {other:?}"),
    }
    server.shutdown().await;
}

/// On timeout every waiter gets the same error listing exactly the missing ranks
/// and where each stands: connected but absent, left cleanly, never connected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn barrier_timeout_lists_exactly_the_missing_ranks() {
    let server = start_server().await;
    let r0 = connect(&server, rank("late", 0, 5)).await;
    let r1 = connect(&server, rank("late", 1, 5)).await;
    let _r2 = connect(&server, rank("late", 2, 5)).await;
    let r3 = connect(&server, rank("late", 3, 5)).await;
    bounded("close", r3.close()).await.expect("rank 3 leaves cleanly");
    // Rank 4 never connects.

    let timeout = Some(Duration::from_millis(800));
    let started = Instant::now();
    let (a, b) = bounded("barrier", async {
        tokio::join!(r0.barrier("epoch", Members::World, timeout), r1.barrier("epoch", Members::World, timeout))
    })
    .await;
    assert!(started.elapsed() >= Duration::from_millis(800));

    for (r, result) in [(0, a), (1, b)] {
        let Err(Error::Op(OpError::CollectiveTimeout { op, waited_ms, members, missing, .. })) = result else {
            panic!("rank {r}: expected CollectiveTimeout, got {result:?}");
        };
        assert_eq!((op.kind, op.name.as_str(), op.generation), (CollectiveKind::Barrier, "epoch", 1));
        assert_eq!(members, 5);
        assert!(waited_ms >= 800, "waited {waited_ms} ms");
        let states: Vec<(u32, RankState)> = missing.iter().map(|m: &RankInfo| (m.rank, m.state)).collect();
        assert_eq!(
            states,
            vec![(2, RankState::Connected), (3, RankState::Left), (4, RankState::NeverConnected)],
            "rank {r}"
        );
        assert_eq!(missing[0].host.as_deref(), Some("host-2"));
        assert_eq!(missing[0].pid, Some(1002));
        assert_eq!(missing[1].host.as_deref(), Some("host-3"));
        assert_eq!(missing[2].host, None);
    }
    server.shutdown().await;
}

/// Two jobs using the same barrier and key names see nothing of each other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_with_the_same_names_do_not_interfere() {
    let server = start_server().await;
    let a0 = connect(&server, rank("job-a", 0, 2)).await;
    let a1 = connect(&server, rank("job-a", 1, 2)).await;
    let b0 = connect(&server, rank("job-b", 0, 2)).await;

    // Job b's rank 0 waits first; job a's two ranks must not complete it.
    let b = b0.clone();
    let b_wait =
        start_confirmed(&b0, async move { b.barrier("sync", Members::World, Some(Duration::from_millis(1500))).await })
            .await;
    bounded("job a barrier", async {
        let (x, y) = tokio::join!(
            a0.barrier("sync", Members::World, Some(Duration::from_secs(20))),
            a1.barrier("sync", Members::World, Some(Duration::from_secs(20)))
        );
        x.expect("a0 barrier");
        y.expect("a1 barrier");
    })
    .await;
    match bounded("job b barrier", b_wait).await.expect("task") {
        Err(Error::Op(OpError::CollectiveTimeout { missing, members: 2, .. })) => {
            let missing: Vec<_> = missing.iter().map(|m| (m.rank, m.state)).collect();
            assert_eq!(missing, vec![(1, RankState::NeverConnected)]);
        }
        other => panic!("job b: expected a timeout missing only its rank 1, got {other:?}"),
    }

    // Same key, separate stores.
    a0.set("k", "A").await.expect("set a");
    b0.set("k", "B").await.expect("set b");
    assert_eq!(a1.get("k", None).await.expect("get a"), "A");
    assert_eq!(b0.get("k", None).await.expect("get b"), "B");
    assert_eq!(a0.add("n", 5).await.expect("add a"), 5);
    assert_eq!(b0.add("n", 1).await.expect("add b"), 1);
    assert_eq!(a0.num_keys().await.expect("num a"), 2);
    assert_eq!(b0.num_keys().await.expect("num b"), 2);
    server.shutdown().await;
}

/// Heartbeats keep idle ranks alive past several leases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_keep_idle_ranks_alive() {
    // Long enough that heartbeats (every third of a lease) delayed by a loaded machine
    // do not end a lease (a sub-second lease has ended under load); short enough to
    // pass three leases in a few seconds.
    let config = rallypoint::Config { lease_ms: 2_000, ..rallypoint::Config::default() };
    let server = start_server_with(config).await;
    let r0 = connect(&server, rank("idle", 0, 2)).await;
    let r1 = connect(&server, rank("idle", 1, 2)).await;
    // Time passing is the point of this test: three leases without a user call.
    tokio::time::sleep(Duration::from_millis(6_000)).await;
    bounded("barrier after idling", async {
        let (a, b) = tokio::join!(
            r0.barrier("b", Members::World, Some(Duration::from_secs(10))),
            r1.barrier("b", Members::World, Some(Duration::from_secs(10)))
        );
        a.expect("rank 0");
        b.expect("rank 1");
    })
    .await;
    server.shutdown().await;
}

/// All-gather and broadcast carry payloads to every member.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_gather_and_broadcast() {
    let server = start_server().await;
    let mut clients = Vec::new();
    for r in 0..3 {
        clients.push(connect(&server, rank("coll", r, 3)).await);
    }
    let t = Some(Duration::from_secs(20));
    let gathered = bounded("all_gather", async {
        let (a, b, c) = tokio::join!(
            clients[0].all_gather("g", Members::World, "zero", t),
            clients[1].all_gather("g", Members::World, "one", t),
            clients[2].all_gather("g", Members::World, "two", t)
        );
        [a.expect("0"), b.expect("1"), c.expect("2")]
    })
    .await;
    for values in gathered {
        let values: Vec<&[u8]> = values.iter().collect();
        assert_eq!(values, [&b"zero"[..], b"one", b"two"]);
    }
    let got = bounded("broadcast", async {
        let (a, b, c) = tokio::join!(
            clients[0].broadcast("bc", Members::World, 1, None, t),
            clients[1].broadcast("bc", Members::World, 1, Some(b"from one"), t),
            clients[2].broadcast("bc", Members::World, 1, None, t)
        );
        [a.expect("0"), b.expect("1"), c.expect("2")]
    })
    .await;
    assert!(got.iter().all(|v| v == "from one"), "{got:?}");
    server.shutdown().await;
}

/// Large payloads: each member's reply carries the gathered values (and a `get` its
/// value) as bytes shared with other replies, written after the reply's head rather
/// than copied into the batch. Several all-gathers in flight on each connection mix
/// such replies with small ones in one batch; every byte must arrive in its place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_all_gathers_in_flight_together_arrive_whole() {
    const RANKS: u32 = 3;
    const SIZE: usize = 300 * 1024;
    let server = start_server().await;
    let mut clients = Vec::new();
    for r in 0..RANKS {
        clients.push(connect(&server, rank("large", r, RANKS)).await);
    }
    let t = Some(Duration::from_secs(20));
    let value = |r: u32, name: usize| vec![(r as usize * 7 + name) as u8; if name == 0 { 5 } else { SIZE }];
    let mut calls = tokio::task::JoinSet::new();
    for (r, client) in clients.iter().enumerate() {
        for name in 0..3 {
            let client = client.clone();
            let mine = value(r as u32, name);
            calls.spawn(async move { (name, client.all_gather(&format!("g{name}"), Members::World, mine, t).await) });
        }
    }
    bounded("all_gather", async {
        while let Some(done) = calls.join_next().await {
            let (name, gathered) = done.expect("task");
            let gathered = gathered.expect("all_gather");
            let expected: Vec<Vec<u8>> = (0..RANKS).map(|r| value(r, name)).collect();
            assert!(gathered.iter().eq(expected.iter().map(Vec::as_slice)), "g{name}");
        }
    })
    .await;
    let big = vec![9u8; 3 << 20];
    clients[0].set("big", big.clone()).await.expect("set");
    assert!(bounded("get", clients[1].get("big", t)).await.expect("get") == big);
    server.shutdown().await;
}

/// An abort fails a waiting peer with the aborting rank and reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_reaches_waiting_peers() {
    let server = start_server().await;
    let r0 = connect(&server, rank("abort", 0, 2)).await;
    let r1 = connect(&server, rank("abort", 1, 2)).await;
    let c = r0.clone();
    let waiter =
        start_confirmed(&r0, async move { c.barrier("never", Members::World, Some(Duration::from_secs(50))).await })
            .await;
    bounded("abort", r1.abort("out of memory")).await.expect("abort");
    match bounded("waiter", waiter).await.expect("task") {
        Err(Error::Op(OpError::Aborted { job, by })) => {
            assert_eq!(job, "abort");
            assert_eq!(
                (by.by_rank, by.host.as_str(), by.pid, by.reason.as_str()),
                (Some(1), "host-1", 1001, "out of memory")
            );
        }
        other => panic!("expected Aborted, got {other:?}"),
    }
    server.shutdown().await;
}

/// Groups that share a collective's name wait apart, as each role's barrier or
/// each pair's all-gather would, whichever group comes first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_that_share_a_name_wait_apart() {
    let server = start_server().await;
    let wait = Some(Duration::from_secs(20));
    let role = |r: u32| if r.is_multiple_of(2) { "even" } else { "odd" };
    let mut clients = Vec::new();
    for r in 0..4 {
        let identity = rallypoint::Identity { role: Some(role(r).to_owned()), ..rank("groups", r, 4) };
        clients.push(connect(&server, identity).await);
    }
    let ready = |r: usize| clients[r].barrier("ready", Members::Role(role(r as u32).into()), wait);
    let passed = bounded("each role's barrier", async { tokio::join!(ready(0), ready(1), ready(2), ready(3)) }).await;
    for result in [passed.0, passed.1, passed.2, passed.3] {
        result.expect("a role's barrier passes with its own members");
    }
    // Pair (2, 3) gathers first and alone; pair (0, 1) after it, under the same name.
    let pair = |r: u32| if r < 2 { vec![0, 1] } else { vec![2, 3] };
    let gather = |r: usize| clients[r].all_gather("addr", Members::Ranks(pair(r as u32)), format!("a{r}"), wait);
    let (g2, g3) = bounded("pair (2, 3)", async { tokio::join!(gather(2), gather(3)) }).await;
    assert_eq!(g2.expect("rank 2"), [b"a2", b"a3"]);
    assert_eq!(g3.expect("rank 3"), [b"a2", b"a3"]);
    let (g0, g1) = bounded("pair (0, 1)", async { tokio::join!(gather(0), gather(1)) }).await;
    assert_eq!(g0.expect("rank 0"), [b"a0", b"a1"]);
    assert_eq!(g1.expect("rank 1"), [b"a0", b"a1"]);
    for c in clients {
        c.close().await.expect("clean leave");
    }
}

/// A mismatch tells each rank its own call as `mine` and the other as `theirs`,
/// waiters of the failed generation included (the coordinator sends them the
/// generation's call; each client puts its own rank there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mismatch_tells_each_rank_its_own_call_as_mine() {
    let server = start_server().await;
    let wait = Some(Duration::from_secs(20));
    let mut clients = Vec::new();
    for r in 0..3 {
        clients.push(connect(&server, rank("mine", r, 3)).await);
    }
    let shown = format!("{:?}", clients[1]);
    assert!(shown.starts_with("Client { addr: ") && shown.contains("job: \"mine\", rank: Some(1)"), "{shown}");
    let mut waiting = Vec::new();
    for r in [0, 2] {
        let c = clients[r].clone();
        waiting.push(start_confirmed(&clients[r], async move { c.barrier("x", Members::World, wait).await }).await);
    }
    let shape = |e: Error| match e {
        Error::Op(OpError::Mismatch { mine, theirs, .. }) => ((mine.rank, mine.members), (theirs.rank, theirs.members)),
        other => panic!("{other:?}"),
    };
    let pair = Members::Ranks(vec![0, 1]);
    let e = bounded("rank 1", clients[1].barrier("x", pair.clone(), wait)).await.expect_err("crossed");
    assert_eq!(shape(e), ((1, pair.clone()), (0, Members::World)));
    for (r, task) in [0, 2].into_iter().zip(waiting) {
        let e = bounded("a waiter", task).await.expect("task").expect_err("failed with the mismatch");
        assert_eq!(shape(e), ((r, Members::World), (1, pair.clone())), "rank {r}");
    }
}
