//! Ranks behind node agents: one upstream connection per agent, and every
//! semantic (barriers, all-gather, the store, timeouts naming the missing ranks,
//! a dead rank named with its host) exactly as with direct connections.

use std::time::Duration;

use rallypoint::agent::{Agent, AgentConfig, AgentError, AgentHandle};
use rallypoint::server::ServerHandle;
use rallypoint::{
    Client, ConnectOptions, Error, Exit, Gathered, Identity, LossReason, Members, OpError, RankInfo, RankState,
};
use rallypoint_core::{CollectiveKind, Request, Response};
use rallypoint_proto::native::{AgentFrame, FrameLimits, RootFrame};
use tokio::task::JoinSet;

use crate::common::{bounded, connect, rank, start_confirmed, start_server};

pub(crate) const WAIT: Option<Duration> = Some(Duration::from_secs(50));

/// An agent for `server`, its ranks connecting over loopback TCP or, with `unix`,
/// over a Unix socket in a fresh temporary directory.
pub(crate) async fn start_agent(server: &ServerHandle, unix: bool) -> AgentHandle {
    let listen = if unix {
        let dir = std::env::temp_dir().join(format!("rallypoint-agent-test-{}-{}", std::process::id(), rand_suffix()));
        std::fs::create_dir_all(&dir).expect("temporary directory");
        format!("unix:{}", dir.join("agent.sock").display())
    } else {
        "127.0.0.1:0".to_owned()
    };
    let mut config = AgentConfig::new(server.local_addr().to_string(), listen);
    config.connect_timeout = Duration::from_secs(20);
    bounded("agent start", Agent::bind(config)).await.expect("agent binds and reaches the coordinator").spawn()
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

pub(crate) async fn connect_via(agent: &AgentHandle, identity: Identity) -> Client {
    let options = ConnectOptions::new(agent.local_addr().to_owned(), identity).with_timeout(Duration::from_secs(20));
    bounded("connect through an agent", Client::connect_with(options)).await.expect("connect through the agent")
}

/// Ranks 0-1 behind a TCP agent, 2-3 behind a Unix-socket agent, 4-5 direct.
async fn six_ranks(server: &ServerHandle, job: &str) -> (AgentHandle, AgentHandle, Vec<Client>) {
    let a = start_agent(server, false).await;
    let b = start_agent(server, true).await;
    let mut clients = Vec::new();
    for r in 0..6 {
        let identity = rank(job, r, 6);
        clients.push(match r {
            0 | 1 => connect_via(&a, identity).await,
            2 | 3 => connect_via(&b, identity).await,
            _ => connect(server, identity).await,
        });
    }
    (a, b, clients)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_behind_two_agents_and_direct_ranks_pass_barriers_together() {
    let server = start_server().await;
    let (a, b, clients) = six_ranks(&server, "mixed").await;
    for round in 0..5 {
        let mut waiting = JoinSet::new();
        for client in &clients {
            let client = client.clone();
            waiting.spawn(async move { client.barrier("step", Members::World, WAIT).await });
        }
        bounded("barrier round", async {
            while let Some(passed) = waiting.join_next().await {
                passed.expect("task").unwrap_or_else(|e| panic!("round {round}: {e}"));
            }
        })
        .await;
    }
    close_cleanly(clients, [a, b], server).await;
}

/// Every client leaves cleanly, then every agent and the coordinator stop cleanly.
async fn close_cleanly(clients: Vec<Client>, agents: impl IntoIterator<Item = AgentHandle>, server: ServerHandle) {
    for client in clients {
        bounded("close", client.close()).await.expect("clean leave");
    }
    for agent in agents {
        agent.shutdown().await.expect("agent stops cleanly");
    }
    server.shutdown().await;
}

/// Every client all-gathers `value(its index)` under `name` at once; the results in
/// client order.
async fn all_gather_each(clients: &[Client], name: &str, value: impl Fn(usize) -> Vec<u8>) -> Vec<Gathered> {
    let mut gathering = JoinSet::new();
    for (r, client) in clients.iter().enumerate() {
        let (client, name, value) = (client.clone(), name.to_owned(), value(r));
        gathering.spawn(async move { (r, client.all_gather(&name, Members::World, value, WAIT).await) });
    }
    let mut results = bounded("all-gather", gathering.join_all()).await;
    results.sort_by_key(|(r, _)| *r);
    results.into_iter().map(|(r, gathered)| gathered.unwrap_or_else(|e| panic!("rank {r}: {e}"))).collect()
}

/// Large gathered values reach ranks behind agents whole: the coordinator writes
/// each sub-session reply's values as bytes shared by all of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_all_gather_through_agents() {
    let server = start_server().await;
    let (_a, _b, clients) = six_ranks(&server, "large").await;
    let value = |r: usize| vec![r as u8 + 1; 100 * 1024];
    let expected: Vec<Vec<u8>> = (0..6).map(value).collect();
    for gathered in all_gather_each(&clients, "big", value).await {
        assert!(gathered.iter().eq(expected.iter().map(Vec::as_slice)));
    }
    server.shutdown().await;
}

/// Address ranges of this process's mappings of shared-memory slabs.
fn shared_reply_mappings() -> Vec<std::ops::Range<usize>> {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("/proc/self/maps");
    maps.lines()
        .filter(|line| line.contains("memfd:rallypoint-slab"))
        .filter_map(|line| {
            let (start, end) = line.split_whitespace().next()?.split_once('-')?;
            Some(usize::from_str_radix(start, 16).ok()?..usize::from_str_radix(end, 16).ok()?)
        })
        .collect()
}

/// Over a Unix socket a large all-gather result is mapped from the one file the
/// agent wrote, not copied through the socket; a rank that did not ask for that,
/// and small results, get plain replies; both see the same values.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_results_reach_unix_ranks_as_shared_memory() {
    let server = start_server().await;
    let agent = start_agent(&server, true).await;
    let mut clients = Vec::new();
    for r in 0..4 {
        let mut options =
            ConnectOptions::new(agent.local_addr(), rank("shm", r, 4)).with_timeout(WAIT.unwrap_or_default());
        options.shared_replies = r != 3;
        clients.push(bounded("connect", Client::connect_with(options)).await.expect("connects"));
    }
    for (round, size) in [(0usize, 64 * 1024), (1, 100), (2, 64 * 1024)] {
        let value = move |r: usize| vec![(r + round) as u8; size];
        let results = all_gather_each(&clients, "g", value).await;
        let mapped = shared_reply_mappings();
        for (r, gathered) in results.into_iter().enumerate() {
            let expected: Vec<Vec<u8>> = (0..4).map(value).collect();
            assert!(gathered.iter().eq(expected.iter().map(Vec::as_slice)));
            let shared = mapped.iter().any(|range| range.contains(&(gathered[0].as_ptr() as usize)));
            assert_eq!(shared, r != 3 && size > 1000, "rank {r}, round {round}: shared {shared}");
        }
    }
    close_cleanly(clients, [agent], server).await;
}

/// A slab is written again only once every rank released what it held from it:
/// results released at once come from the same slab, and so the same mapped
/// bytes, round after round; a result a rank keeps stays intact while later
/// rounds go to another slab.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slabs_are_reused_once_released_and_never_while_held() {
    let server = start_server().await;
    let agent = start_agent(&server, true).await;
    let mut clients = Vec::new();
    for r in 0..3 {
        clients.push(connect_via(&agent, rank("slabs", r, 3)).await);
    }
    let value = |r: usize, round: usize| vec![(10 * round + r) as u8; 64 * 1024];
    let gather = |round: usize| all_gather_each(&clients, "s", move |r| value(r, round));
    let expected = |round: usize| (0..3).map(|r| value(r, round)).collect::<Vec<_>>();
    let same = |gathered: &Gathered, round: usize| gathered.iter().eq(expected(round).iter().map(Vec::as_slice));

    // Released at once: a later round reuses the slab. A release travels on the
    // rank's connection, so on a loaded machine it may miss the very next round.
    let first = gather(0).await;
    let address = first[0][0].as_ptr() as usize;
    assert!(shared_reply_mappings().iter().any(|range| range.contains(&address)), "not from a slab");
    drop(first);
    let mut second = None;
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let round = gather(1).await;
        assert!(round.iter().all(|g| same(g, 1)));
        if round[0][0].as_ptr() as usize == address {
            second = Some(round);
            break;
        }
    }
    let second = second.expect("the released slab was not reused within 20 rounds");

    // Rank 0 keeps round 1: rounds 2-4 must not write over it.
    let kept = second[0].clone();
    drop(second);
    for round in 2..5 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let later = gather(round).await;
        assert!(later.iter().all(|g| same(g, round)), "round {round}");
        assert_ne!(later[0][0].as_ptr() as usize, address, "round {round} went into a slab still held");
        assert!(same(&kept, 1), "a held result changed in round {round}");
    }
    close_cleanly(clients, [agent], server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_gather_and_kv_through_agents() {
    let server = start_server().await;
    let (_a, _b, clients) = six_ranks(&server, "gather").await;
    for gathered in all_gather_each(&clients, "vals", |r| format!("v{r}").into_bytes()).await {
        let values: Vec<&[u8]> = gathered.iter().collect();
        assert_eq!(values, [b"v0", b"v1", b"v2", b"v3", b"v4", b"v5"]);
    }

    // A blocking get behind agent b waits for a key set behind agent a.
    let waiter = clients[2].clone();
    let get = start_confirmed(&clients[2], async move { waiter.get("late", WAIT).await }).await;
    clients[0].set("late", "from rank 0").await.expect("set");
    assert_eq!(bounded("get", get).await.expect("task").expect("get"), "from rank 0");
    assert_eq!(clients[1].add("n", 2).await.expect("add"), 2);
    assert_eq!(clients[3].add("n", 3).await.expect("add"), 5);
    assert_eq!(clients[4].add("n", 4).await.expect("add"), 9);
    assert!(clients[3].check(&["late", "n"]).await.expect("check"));
    assert_eq!(clients[1].compare_set("late", "from rank 0", "swapped").await.expect("cas"), "swapped");
    assert_eq!(clients[5].multi_get(&["late", "n"], WAIT).await.expect("multi_get"), ["swapped", "9"]);
    assert_eq!(clients[2].num_keys().await.expect("num_keys"), 2);
    // An error reply travels back through the agent with its facts.
    match clients[0].add("late", 1).await {
        Err(Error::Op(OpError::NotANumber { key, .. })) => assert_eq!(key, "late"),
        other => panic!("expected NotANumber, got {other:?}"),
    }
    server.shutdown().await;
}

/// A rank behind an agent dies while everyone waits for it: peers behind the same
/// agent, behind another agent and connected directly are all told at once, by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_rank_behind_an_agent_is_named_by_every_peer() {
    let server = start_server().await;
    let (_a, _b, mut clients) = six_ranks(&server, "dead").await;
    let victim = clients.remove(1);
    let mut waiters = Vec::new();
    for client in &clients {
        let c = client.clone();
        waiters.push(start_confirmed(client, async move { c.barrier("sync", Members::World, WAIT).await }).await);
    }
    drop(victim);
    for (i, waiter) in waiters.into_iter().enumerate() {
        match bounded("waiter", waiter).await.expect("task") {
            Err(Error::Op(OpError::PeerLost { op, peer })) => {
                assert_eq!((op.kind, op.name.as_str(), op.generation), (CollectiveKind::Barrier, "sync", 1));
                assert_eq!((peer.rank, peer.host.as_deref(), peer.pid), (1, Some("host-1"), Some(1001)));
                assert_eq!(peer.state, RankState::Lost(LossReason::Disconnected));
            }
            other => panic!("waiter {i}: expected PeerLost naming rank 1, got {other:?}"),
        }
    }
    server.shutdown().await;
}

/// A launcher that saw a rank's process end says so: every peer, behind agents or
/// not, is told at once that the rank is lost and how its process ended, though its
/// connection is still open (a child holds it, or the coordinator has not read its
/// close yet); the connection's close later fails nothing twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_whose_launcher_saw_it_end_is_named_with_that_end_by_every_peer() {
    let server = start_server().await;
    let (_a, _b, mut clients) = six_ranks(&server, "ended").await;
    let victim = clients.remove(1);
    let mut waiters = Vec::new();
    for client in &clients {
        let c = client.clone();
        waiters.push(start_confirmed(client, async move { c.barrier("sync", Members::World, WAIT).await }).await);
    }
    let launcher = connect(&server, Identity::anonymous("ended")).await;
    bounded("rank_exited", launcher.rank_exited(1, "host-1", 1001, Exit::Signal(9))).await.expect("reported");
    for (i, waiter) in waiters.into_iter().enumerate() {
        match bounded("waiter", waiter).await.expect("task") {
            Err(Error::Op(OpError::PeerLost { op, peer })) => {
                assert_eq!((op.name.as_str(), peer.rank, peer.pid), ("sync", 1, Some(1001)));
                assert_eq!(peer.state, RankState::Lost(LossReason::Exited { pid: 1001, exit: Exit::Signal(9) }));
                let text = OpError::PeerLost { op, peer }.to_string();
                assert!(text.contains("lost: worker pid 1001 was killed by SIGKILL"), "{text}");
            }
            other => panic!("waiter {i}: expected PeerLost naming rank 1, got {other:?}"),
        }
    }
    drop(victim);
    let e = bounded("barrier", clients[0].barrier("next", Members::World, WAIT)).await.expect_err("rank 1 is lost");
    assert!(e.to_string().contains("worker pid 1001 was killed by SIGKILL"), "{e}");
    // A rank past the job's world size is refused by name.
    let refused =
        bounded("rank_exited", launcher.rank_exited(6, "host-6", 1006, Exit::Code(1))).await.expect_err("out of range");
    assert!(refused.to_string().contains("rank 6 is out of range for world size 6"), "{refused}");
    server.shutdown().await;
}

/// The timeout error lists exactly the missing ranks, behind agents or not, with
/// what is known of each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn barrier_timeout_names_exactly_the_missing_ranks_behind_agents() {
    let server = start_server().await;
    let a = start_agent(&server, false).await;
    let b = start_agent(&server, true).await;
    let r0 = connect(&server, rank("late", 0, 5)).await;
    let r1 = connect_via(&a, rank("late", 1, 5)).await;
    let _r2 = connect_via(&b, rank("late", 2, 5)).await;
    let r3 = connect_via(&a, rank("late", 3, 5)).await;
    bounded("close", r3.close()).await.expect("rank 3 leaves cleanly");
    // Rank 4 never connects.
    let timeout = Some(Duration::from_millis(500));
    let (x, y) = bounded("barrier", async {
        tokio::join!(r0.barrier("epoch", Members::World, timeout), r1.barrier("epoch", Members::World, timeout))
    })
    .await;
    for (r, result) in [(0, x), (1, y)] {
        let Err(Error::Op(OpError::CollectiveTimeout { op, members, missing, .. })) = result else {
            panic!("rank {r}: expected CollectiveTimeout, got {result:?}");
        };
        assert_eq!((op.name.as_str(), members), ("epoch", 5));
        let states: Vec<(u32, RankState)> = missing.iter().map(|m: &RankInfo| (m.rank, m.state)).collect();
        assert_eq!(
            states,
            [(2, RankState::Connected), (3, RankState::Left), (4, RankState::NeverConnected)],
            "rank {r}"
        );
        assert_eq!((missing[0].host.as_deref(), missing[0].pid), (Some("host-2"), Some(1002)));
        assert_eq!((missing[1].host.as_deref(), missing[1].pid), (Some("host-3"), Some(1003)));
        assert_eq!(missing[2].host, None);
    }
    server.shutdown().await;
}

/// An agent that goes away takes its ranks with it: the coordinator names each of
/// them (with its host) to their peers, and the agent's own ranks are told why
/// their calls failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_agent_loses_all_its_ranks_by_name() {
    let server = start_server().await;
    let a = start_agent(&server, true).await;
    let r0 = connect_via(&a, rank("agentless", 0, 4)).await;
    let r1 = connect_via(&a, rank("agentless", 1, 4)).await;
    let r2 = connect(&server, rank("agentless", 2, 4)).await;
    let w0 = {
        let c = r0.clone();
        start_confirmed(&r0, async move { c.barrier("sync", Members::World, WAIT).await }).await
    };
    let w2 = {
        let c = r2.clone();
        start_confirmed(&r2, async move { c.barrier("sync", Members::World, WAIT).await }).await
    };

    bounded("agent shutdown", a.shutdown()).await.expect("the agent stops");

    match bounded("rank 0", w0).await.expect("task") {
        Err(Error::Op(OpError::Closed(message))) => {
            assert!(message.contains("node agent is shutting down"), "{message}");
        }
        other => panic!("rank 0: expected Closed from its agent, got {other:?}"),
    }
    match bounded("rank 2", w2).await.expect("task") {
        Err(Error::Op(OpError::PeerLost { peer, .. })) => {
            assert!(peer.rank < 2, "names a rank of the lost agent: {peer:?}");
            assert_eq!(peer.state, RankState::Lost(LossReason::Disconnected));
        }
        other => panic!("rank 2: expected PeerLost, got {other:?}"),
    }
    // Each of the agent's ranks, by name and host.
    for lost in [0u32, 1] {
        match r2.barrier(&format!("with-{lost}"), Members::Ranks(vec![lost, 2]), WAIT).await {
            Err(Error::Op(OpError::PeerLost { peer, .. })) => {
                let host = format!("host-{lost}");
                assert_eq!((peer.rank, peer.host.as_deref()), (lost, Some(host.as_str())));
                assert_eq!(peer.state, RankState::Lost(LossReason::Disconnected));
            }
            other => panic!("expected PeerLost naming rank {lost}, got {other:?}"),
        }
    }
    // The agent's clients see their connection closed.
    assert!(matches!(r1.ping().await, Err(Error::Disconnected(_))));
    server.shutdown().await;
}

/// The coordinator goes away under an agent: the agent's ranks get a clear error
/// for the calls they were waiting on, and the agent stops saying why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_the_coordinator_fails_local_calls_with_a_clear_error() {
    let server = start_server().await;
    let a = start_agent(&server, false).await;
    let r0 = connect_via(&a, rank("orphan", 0, 2)).await;
    let waiter = {
        let c = r0.clone();
        start_confirmed(&r0, async move { c.barrier("sync", Members::World, WAIT).await }).await
    };
    server.shutdown().await;
    match bounded("rank 0", waiter).await.expect("task") {
        Err(Error::Op(OpError::Closed(message))) => {
            assert!(message.contains("lost its connection to the coordinator"), "{message}");
        }
        other => panic!("expected Closed naming the lost coordinator, got {other:?}"),
    }
    match bounded("agent", a.wait()).await {
        Err(AgentError::UpstreamLost { ranks: 1, .. }) => {}
        other => panic!("expected UpstreamLost with one rank, got {other:?}"),
    }
}

/// A hello the coordinator refuses is refused to the rank, through the agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_rank_is_refused_through_the_agent() {
    let server = start_server().await;
    let a = start_agent(&server, false).await;
    let options = ConnectOptions::new(a.local_addr(), rank("bad", 5, 2)).with_timeout(Duration::from_secs(20));
    match bounded("connect", Client::connect_with(options)).await {
        Err(Error::Op(OpError::Invalid(message))) => assert!(message.contains('5'), "{message}"),
        other => panic!("expected the coordinator's refusal, got {:?}", other.map(|_| ())),
    }
    // The agent still serves.
    let ok = connect_via(&a, rank("bad", 1, 2)).await;
    ok.set("k", "v").await.expect("set");
    server.shutdown().await;
}

/// 4,096 ranks over four agents (two over TCP, two over Unix sockets) pass
/// barriers together and share one counter. (An all-gather at this size is
/// quadratic in bytes, too slow for a debug build; it is tested above with 6.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_thousand_ranks_over_four_agents() {
    const WORLD: u32 = 4096;
    // Client and agent ends of every local connection live in this process.
    rallypoint::raise_fd_limit();
    let server = start_server().await;
    let mut agents = Vec::new();
    for i in 0..4 {
        agents.push(start_agent(&server, i % 2 == 1).await);
    }
    let mut ranks = JoinSet::new();
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(256));
    for r in 0..WORLD {
        let addr = agents[(r % 4) as usize].local_addr().to_owned();
        let slots = std::sync::Arc::clone(&slots);
        ranks.spawn(async move {
            let options = ConnectOptions::new(addr, rank("scale", r, WORLD)).with_timeout(Duration::from_secs(50));
            let client = {
                let _slot = slots.acquire().await.expect("semaphore");
                Client::connect_with(options).await.expect("connect")
            };
            for _ in 0..3 {
                client.barrier("step", Members::World, WAIT).await.expect("barrier");
            }
            client.add("arrived", 1).await.expect("add");
            client.barrier("counted", Members::World, WAIT).await.expect("barrier");
            let total = client.get("arrived", WAIT).await.expect("get");
            client.close().await.expect("close");
            total
        });
    }
    bounded("4,096 ranks", async {
        let mut done = 0;
        while let Some(total) = ranks.join_next().await {
            assert_eq!(total.expect("rank task"), WORLD.to_string());
            done += 1;
        }
        assert_eq!(done, WORLD);
    })
    .await;
    for agent in agents {
        agent.shutdown().await.expect("agent stops");
    }
    server.shutdown().await;
}

/// A raw agent connection to `server`: preamble and agent hello sent, welcome read.
pub(crate) struct RawAgent {
    stream: tokio::net::TcpStream,
    rbuf: bytes::BytesMut,
}

impl RawAgent {
    pub(crate) async fn connect(server: &ServerHandle) -> RawAgent {
        use rallypoint_proto::native::{encode_agent_frame, encode_preamble, AgentFrame};
        let stream = tokio::net::TcpStream::connect(server.local_addr()).await.expect("connect to the coordinator");
        let mut out = bytes::BytesMut::new();
        encode_preamble(&mut out);
        encode_agent_frame(&AgentFrame::Hello { host: "raw-agent".into(), pid: 1 }, &mut out);
        let mut agent = RawAgent { stream, rbuf: bytes::BytesMut::new() };
        agent.write(&out).await;
        let welcome = agent.next().await;
        assert!(matches!(welcome, RootFrame::Welcome { .. }), "{welcome:?}");
        agent
    }

    pub(crate) async fn send(&mut self, frames: &[AgentFrame]) {
        let mut out = bytes::BytesMut::new();
        for frame in frames {
            rallypoint_proto::native::encode_agent_frame(frame, &mut out);
        }
        self.write(&out).await;
    }

    async fn write(&mut self, bytes: &[u8]) {
        use tokio::io::AsyncWriteExt;
        bounded("agent write", self.stream.write_all(bytes)).await.expect("write to the coordinator");
    }

    pub(crate) async fn next(&mut self) -> RootFrame {
        use tokio::io::AsyncReadExt;
        loop {
            let decoded = rallypoint_proto::native::decode_root_frame(&mut self.rbuf, &FrameLimits::unbounded());
            if let Some(frame) = decoded.expect("a well-formed coordinator frame") {
                return frame;
            }
            let read = bounded("agent read", self.stream.read_buf(&mut self.rbuf)).await.expect("read");
            assert!(read > 0, "the coordinator closed the agent connection");
        }
    }
}

/// A node's ranks arriving at a barrier in one SubRequests frame are each their own
/// call to the engine: the release comes back as one SubReplies frame, and when a
/// rank dies, the failure names exactly that rank, also in one frame.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregated_barrier_frames_keep_every_rank_its_own_session() {
    let server = start_server().await;
    let mut agent = RawAgent::connect(&server).await;
    let barrier =
        |name: &str| Request::Barrier { name: name.into(), members: Members::World, timeout_ms: Some(50_000) };
    agent
        .send(&[
            AgentFrame::SubHello { sub: 1, identity: rank("agg", 0, 3) },
            AgentFrame::SubHello { sub: 2, identity: rank("agg", 1, 3) },
            AgentFrame::SubRequests { calls: vec![(1, 10), (2, 20)], request: barrier("first") },
        ])
        .await;
    for _ in 0..2 {
        let welcome = agent.next().await;
        assert!(matches!(welcome, RootFrame::SubWelcome { .. }), "{welcome:?}");
    }
    let direct = connect(&server, rank("agg", 2, 3)).await;
    bounded("direct rank's barrier", direct.barrier("first", Members::World, WAIT)).await.expect("barrier passes");
    match agent.next().await {
        RootFrame::SubReplies { mut calls, reply } => {
            calls.sort_unstable();
            assert_eq!(calls, [(1, 10), (2, 20)]);
            assert_eq!(reply, Ok(Response::Done));
        }
        other => panic!("expected one release for both ranks, got {other:?}"),
    }

    // Ranks 0 and 1 wait at "second" (one frame in); rank 2 dies without a clean
    // leave: both are told it was rank 2, with its host (one frame out). Whether the
    // death or the arrivals reach the engine first, the failure is the same.
    agent.send(&[AgentFrame::SubRequests { calls: vec![(2, 21), (1, 11)], request: barrier("second") }]).await;
    drop(direct);
    match agent.next().await {
        RootFrame::SubReplies { mut calls, reply } => {
            calls.sort_unstable();
            assert_eq!(calls, [(1, 11), (2, 21)]);
            match reply {
                Err(OpError::PeerLost { op, peer }) => {
                    assert_eq!((op.kind, op.name.as_str()), (CollectiveKind::Barrier, "second"));
                    assert_eq!((peer.rank, peer.host.as_deref(), peer.pid), (2, Some("host-2"), Some(1002)));
                }
                other => panic!("expected PeerLost naming rank 2, got {other:?}"),
            }
        }
        other => panic!("expected one failure for both ranks, got {other:?}"),
    }
    server.shutdown().await;
}

/// Whether this process maps a barrier channel (docs/PROTOCOL.md, section 15).
pub(crate) fn maps_a_barrier_channel() -> bool {
    std::fs::read_to_string("/proc/self/maps").expect("own maps").contains("memfd:rallypoint-barrier")
}

/// Every client calls barrier `name` of the world `times` times, all at once.
async fn all_pass(clients: &[Client], name: &str, times: u32) {
    let mut calls = JoinSet::new();
    for client in clients {
        let (client, name) = (client.clone(), name.to_owned());
        calls.spawn(async move {
            for time in 0..times {
                client.barrier(&name, Members::World, WAIT).await.map_err(|e| format!("{name}, call {time}: {e}"))?;
            }
            Ok::<(), String>(())
        });
    }
    bounded("barrier calls", async {
        while let Some(outcome) = calls.join_next().await {
            outcome.expect("task").unwrap_or_else(|e| panic!("{e}"));
        }
    })
    .await
}

/// Waits until `agent` has `n` barrier channels.
async fn channels_become(agent: &AgentHandle, n: usize) {
    bounded("the agent's barrier channels", async {
        while agent.barrier_channels() != n {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
}

/// A job that names its barriers afresh as it goes, through a Unix-socket agent:
/// a name called once takes no barrier channel; names called again take one each,
/// and the agent retires those its ranks give back (a client keeps seats for so
/// many barriers) or leave with their connections. More names than the agent has
/// channels for at once never use them up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn barriers_named_afresh_do_not_use_up_the_agents_channels() {
    let server = start_server().await;
    let agent = start_agent(&server, true).await;
    let clients = [connect_via(&agent, rank("fresh", 0, 2)).await, connect_via(&agent, rank("fresh", 1, 2)).await];
    for step in 0..300 {
        all_pass(&clients, &format!("once-{step}"), 1).await;
    }
    assert_eq!(agent.barrier_channels(), 0, "a barrier called once asks for no channel");
    for step in 0..300 {
        all_pass(&clients, &format!("again-{step}"), 3).await;
    }
    let live = agent.barrier_channels();
    assert!((1..=64).contains(&live), "channels of the barriers the ranks still keep seats for: {live}");
    drop(clients);
    channels_become(&agent, 0).await;
}

/// A rank gives its seat in a barrier's channel back (it made room for barriers of
/// its own) while its peer keeps using the channel; it comes back to the barrier,
/// through messages and then through the same channel, whose files the agent sends
/// it again, and every round passes for both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_gave_its_seat_back_comes_back_to_a_channel_in_use() {
    let server = start_server().await;
    let agent = start_agent(&server, true).await;
    let ranks = [connect_via(&agent, rank("back", 0, 2)).await, connect_via(&agent, rank("back", 1, 2)).await];
    // Both seated in the channel of `step`.
    all_pass(&ranks, "step", 4).await;
    // Rank 1 alone makes barriers of its own, each called three times (so each
    // takes a seat), more than its client keeps: the oldest seat, `step`'s, goes back.
    for own in 0..80 {
        let name = format!("own-{own}");
        for _ in 0..3 {
            bounded("an own barrier", ranks[1].barrier(&name, Members::Ranks(vec![1]), WAIT))
                .await
                .unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }
    // Through messages, asking for the channel (which rank 0 kept), then through it.
    all_pass(&ranks, "step", 6).await;
}

/// A barrier call waiting in its channel that its caller drops (a timeout of the
/// caller's own) gives its seat back: the agent retires the channel it was alone
/// in, the peer's arrival still completes the round the dropped call arrived at, and
/// the rank's next calls ask for a channel again and pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_barrier_call_dropped_in_its_channel_gives_its_seat_back() {
    let server = start_server().await;
    let agent = start_agent(&server, true).await;
    let ranks = [connect_via(&agent, rank("drop", 0, 2)).await, connect(&server, rank("drop", 1, 2)).await];
    all_pass(&ranks, "step", 3).await;
    assert_eq!(agent.barrier_channels(), 1, "rank 0 is in the channel of `step`");
    let dropped =
        tokio::time::timeout(Duration::from_millis(300), ranks[0].barrier("step", Members::World, WAIT)).await;
    assert!(dropped.is_err(), "rank 1 has not arrived: {dropped:?}");
    // The channel retired.
    channels_become(&agent, 0).await;
    bounded("rank 1 completes the round", ranks[1].barrier("step", Members::World, WAIT)).await.expect("rank 1 passes");
    all_pass(&ranks, "step", 3).await;
    assert_eq!(agent.barrier_channels(), 1, "rank 0 asked for a channel again");
}

/// Ranks on a Unix-socket agent pass a barrier through shared memory from its
/// third call on (the second asks for a channel), async and blocking clients alike, round after round together
/// with peers behind a TCP agent and connected directly; when one of them drops
/// out mid-barrier, every peer (waiting in the channel or not) is told at once, by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn barriers_through_shared_memory_with_every_kind_of_peer() {
    const WORLD: u32 = 6;
    let server = start_server().await;
    let unix = start_agent(&server, true).await;
    let tcp = start_agent(&server, false).await;
    // Ranks 0 and 1 async on the Unix socket, 2 and 3 blocking there, 4 behind the
    // TCP agent, 5 direct.
    let mut clients =
        vec![connect_via(&unix, rank("shm", 0, WORLD)).await, connect_via(&unix, rank("shm", 1, WORLD)).await];
    let blocking: Vec<rallypoint::blocking::Client> = {
        let addr = unix.local_addr().to_owned();
        tokio::task::spawn_blocking(move || {
            (2..4)
                .map(|r| {
                    let options =
                        ConnectOptions::new(addr.clone(), rank("shm", r, WORLD)).with_timeout(Duration::from_secs(20));
                    rallypoint::blocking::Client::connect_with(options).expect("a blocking client")
                })
                .collect()
        })
        .await
        .expect("connecting")
    };
    clients.push(connect_via(&tcp, rank("shm", 4, WORLD)).await);
    clients.push(connect(&server, rank("shm", 5, WORLD)).await);
    let round = |clients: &[Client], blocking: &[rallypoint::blocking::Client]| {
        let mut waiting = JoinSet::new();
        for client in clients {
            let client = client.clone();
            waiting.spawn(async move { client.barrier("step", Members::World, WAIT).await });
        }
        for client in blocking {
            let client = client.clone();
            waiting.spawn_blocking(move || client.barrier("step", Members::World, WAIT));
        }
        waiting
    };
    for r in 0..30 {
        let mut waiting = round(&clients, &blocking);
        bounded("barrier round", async {
            while let Some(passed) = waiting.join_next().await {
                passed.expect("task").unwrap_or_else(|e| panic!("round {r}: {e}"));
            }
        })
        .await;
    }
    assert!(maps_a_barrier_channel(), "the Unix-socket ranks were given a barrier channel");

    // Rank 0 drops out while everyone else waits in the next round.
    let victim = clients.remove(0);
    let mut waiting = round(&clients, &blocking);
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(victim);
    bounded("every peer told", async {
        let mut told = 0;
        while let Some(ended) = waiting.join_next().await {
            match ended.expect("task") {
                Err(Error::Op(OpError::PeerLost { op, peer })) => {
                    assert_eq!((op.name.as_str(), op.generation), ("step", 31));
                    assert_eq!((peer.rank, peer.host.as_deref()), (0, Some("host-0")));
                    told += 1;
                }
                other => panic!("expected PeerLost naming rank 0, got {other:?}"),
            }
        }
        assert_eq!(told, WORLD - 1);
    })
    .await;
    server.shutdown().await;
}

/// A coordinator whose limits are smaller than its node agent's: a rank's request
/// the agent forwards but the coordinator does not read fails that call alone, as
/// it would directly; the agent's link, and its other ranks, carry on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_too_large_for_the_coordinator_fails_only_its_call_through_an_agent() {
    let mut engine = rallypoint::Config::default();
    engine.limits.max_request_len = 1_000_000;
    engine.limits.max_value_len = 1_000_000;
    let server = crate::common::start_server_with(engine).await;
    for unix in [false, true] {
        let job = format!("big{unix}");
        let agent = start_agent(&server, unix).await;
        let big = connect_via(&agent, rank(&job, 0, 2)).await;
        let peer = connect_via(&agent, rank(&job, 1, 2)).await;
        let value = vec![b'x'; 8 << 20];
        let entries: Vec<(String, &[u8])> = (0..3).map(|i| (format!("k{i}"), value.as_slice())).collect();
        match bounded("the oversized multi_set", big.multi_set(&entries)).await {
            Err(Error::Op(OpError::Invalid(message))) => {
                assert!(message.contains("is more than this coordinator reads in one frame"), "{message}");
            }
            other => panic!("expected Invalid, got {other:?}"),
        }
        assert_eq!(bounded("add", peer.add("n", 1)).await.expect("the other rank carries on"), 1);
        bounded("set", big.set("small", "v")).await.expect("the same rank carries on");
        let (a, b) = tokio::join!(big.barrier("b", Members::World, WAIT), peer.barrier("b", Members::World, WAIT));
        a.expect("barrier");
        b.expect("barrier");
        big.close().await.expect("close");
        peer.close().await.expect("close");
        agent.shutdown().await.expect("agent shutdown");
    }
}
