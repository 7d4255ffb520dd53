//! A client whose connection is cut resumes its session and re-sends what it has no
//! reply for; the coordinator counts nothing twice. A proxy between a rank and the
//! coordinator cuts the rank's first connection at each point of an exchange:
//! before its request reaches the coordinator, right after, or after the reply was
//! written (the reply is lost); the coordinator either sees the cut or keeps its end
//! of the connection open (half-open). The client's later connections pass.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Buf, BytesMut};
use rallypoint::{Client, Config, ConnectOptions, Error, Identity, Members, OpError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use crate::common::{bounded, connect, rank, start_confirmed, start_server, start_server_with};

const BARRIER: u8 = 0x0d;
const ADD: u8 = 0x03;
const ALL_GATHER: u8 = 0x0e;

/// Where the first connection is cut.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cut {
    /// The request never reaches the coordinator.
    BeforeRequest,
    /// The request reached the coordinator; nothing came back yet.
    AfterRequest,
    /// The coordinator answered; the reply is lost.
    AfterReply,
}

/// Whether the coordinator sees the cut (its end closes) or not (half-open).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CoordinatorEnd {
    Closes,
    StaysOpen,
}

/// A TCP proxy to the coordinator that cuts its first connection at `cut` of the
/// first request with opcode `opcode`, and passes every later connection.
struct Proxy {
    addr: SocketAddr,
    task: JoinHandle<()>,
    /// Connections accepted so far: a second one is the client reconnecting.
    accepted: Arc<std::sync::atomic::AtomicUsize>,
    /// Later connections go through once this is true.
    gate: tokio::sync::watch::Sender<bool>,
    /// Coordinator ends kept open after a cut (half-open), until the proxy goes.
    _kept: Arc<Mutex<Vec<TcpStream>>>,
}

impl Proxy {
    async fn start(upstream: SocketAddr, cut: Cut, opcode: u8, end: CoordinatorEnd) -> Proxy {
        let proxy = Proxy::gated(upstream, cut, opcode, end).await;
        proxy.open();
        proxy
    }

    /// A proxy that holds every connection after the first until [`Proxy::open`].
    async fn gated(upstream: SocketAddr, cut: Cut, opcode: u8, end: CoordinatorEnd) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the proxy");
        let addr = listener.local_addr().expect("proxy address");
        let kept = Arc::new(Mutex::new(Vec::new()));
        let keep = Arc::clone(&kept);
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = Arc::clone(&accepted);
        let (gate, opened) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(async move {
            let mut first = true;
            loop {
                let Ok((client, _)) = listener.accept().await else { return };
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if std::mem::take(&mut first) {
                    let coordinator = TcpStream::connect(upstream).await.expect("proxy to the coordinator");
                    let keep = Arc::clone(&keep);
                    tokio::spawn(cut_one(client, coordinator, cut, opcode, end, keep));
                } else {
                    let mut opened = opened.clone();
                    tokio::spawn(async move {
                        let _ = opened.wait_for(|open| *open).await;
                        let mut coordinator = TcpStream::connect(upstream).await.expect("proxy to the coordinator");
                        let mut client = client;
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut coordinator).await;
                    });
                }
            }
        });
        Proxy { addr, task, accepted, gate, _kept: kept }
    }

    /// Lets the connections after the first through.
    fn open(&self) {
        let _ = self.gate.send(true);
    }

    fn connections(&self) -> usize {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Splits one whole frame (length prefix and body) off `buf`, if it holds one.
fn frame(buf: &mut BytesMut) -> Option<BytesMut> {
    let len = u32::from_le_bytes(buf.get(..4)?.try_into().ok()?) as usize;
    (buf.len() >= 4 + len).then(|| buf.split_to(4 + len))
}

/// The request id of a Request (kind 0x02) or Reply (0x83) frame, and its opcode or tag.
fn id_and_op(frame: &[u8]) -> Option<(u8, u64, u8)> {
    let body = frame.get(4..)?;
    let id = u64::from_le_bytes(body.get(1..9)?.try_into().ok()?);
    Some((body[0], id, *body.get(9)?))
}

async fn cut_one(
    client: TcpStream,
    coordinator: TcpStream,
    cut: Cut,
    opcode: u8,
    end: CoordinatorEnd,
    keep: Arc<Mutex<Vec<TcpStream>>>,
) {
    let (mut client, mut coordinator) = (client, coordinator);
    let (mut up, mut down) = (BytesMut::new(), BytesMut::new());
    let mut preamble = 6;
    let mut awaited = None;
    'pump: loop {
        tokio::select! {
            read = client.read_buf(&mut up) => {
                if read.unwrap_or(0) == 0 {
                    return;
                }
                if preamble > 0 && up.len() >= preamble {
                    coordinator.write_all(&up.split_to(preamble)).await.expect("forward the preamble");
                    preamble = 0;
                }
                if preamble == 0 {
                    while let Some(frame) = frame(&mut up) {
                        let target = matches!(id_and_op(&frame), Some((0x02, _, op)) if op == opcode) && awaited.is_none();
                        if target && cut == Cut::BeforeRequest {
                            break 'pump;
                        }
                        coordinator.write_all(&frame).await.expect("forward a request");
                        if target {
                            if cut == Cut::AfterRequest {
                                break 'pump;
                            }
                            awaited = id_and_op(&frame).map(|(_, id, _)| id);
                        }
                    }
                }
            }
            read = coordinator.read_buf(&mut down) => {
                if read.unwrap_or(0) == 0 {
                    return;
                }
                while let Some(frame) = frame(&mut down) {
                    if matches!(id_and_op(&frame), Some((0x83, id, _)) if Some(id) == awaited) {
                        break 'pump;
                    }
                    client.write_all(&frame).await.expect("forward a reply");
                }
            }
        }
    }
    // Whatever the coordinator still sends on this connection never reaches the client.
    down.advance(down.len());
    drop(client);
    if end == CoordinatorEnd::StaysOpen {
        keep.lock().expect("kept connections").push(coordinator);
    }
}

/// Rank `r` of `world` in `job`, connecting through `proxy`.
async fn through(proxy: &Proxy, job: &str, r: u32, world: u32) -> Client {
    let options =
        ConnectOptions::new(proxy.addr.to_string(), rank(job, r, world)).with_timeout(Duration::from_secs(20));
    bounded("connect through the proxy", Client::connect_with(options)).await.expect("connect")
}

/// Every cut of a barrier exchange, the coordinator seeing it or not: rank 1's
/// barrier call returns once, its session is the same, and its next call is the next
/// generation (rank 0's generation 2 waits for it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_barrier_retried_after_any_cut_arrives_once() {
    let server = start_server().await;
    for cut in [Cut::BeforeRequest, Cut::AfterRequest, Cut::AfterReply] {
        for end in [CoordinatorEnd::Closes, CoordinatorEnd::StaysOpen] {
            let job = format!("{cut:?}-{end:?}");
            let proxy = Proxy::start(server.local_addr(), cut, BARRIER, end).await;
            let r0 = connect(&server, rank(&job, 0, 2)).await;
            let r1 = through(&proxy, &job, 1, 2).await;
            let session = r1.session();

            let c0 = r0.clone();
            let step1 = start_confirmed(&r0, async move { c0.barrier("step", Members::World, None).await }).await;
            bounded("rank 1's step 1", r1.barrier("step", Members::World, None))
                .await
                .unwrap_or_else(|e| panic!("{cut:?}, {end:?}: rank 1's step 1 failed: {e}"));
            bounded("rank 0's step 1", step1).await.expect("task").expect("rank 0's step 1");
            assert_eq!(proxy.connections(), 2, "{cut:?}, {end:?}: the connection was not cut once");
            assert_eq!(r1.session(), session, "{cut:?}, {end:?}: the session was not resumed");

            let c0 = r0.clone();
            let step2 = start_confirmed(&r0, async move { c0.barrier("step", Members::World, None).await }).await;
            let status = r0.status().await.expect("status");
            assert!(
                status.contains("waiting: barrier 'step' (generation 2)") && status.contains("missing (1): rank 1"),
                "{cut:?}, {end:?}: rank 1 counted twice?\n{status}"
            );
            bounded("rank 1's step 2", r1.barrier("step", Members::World, None)).await.expect("rank 1's step 2");
            bounded("rank 0's step 2", step2).await.expect("task").expect("rank 0's step 2");
            r1.close().await.expect("close rank 1");
            r0.close().await.expect("close rank 0");
        }
    }
    server.shutdown().await;
}

/// An `add` whose reply was lost with the connection is sent again: it adds once and
/// returns the value the first one got.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_add_retried_after_its_reply_was_lost_adds_once() {
    let server = start_server().await;
    for end in [CoordinatorEnd::Closes, CoordinatorEnd::StaysOpen] {
        let job = format!("add-{end:?}");
        let proxy = Proxy::start(server.local_addr(), Cut::AfterReply, ADD, end).await;
        let options = ConnectOptions::new(proxy.addr.to_string(), Identity::anonymous(&job));
        let client = bounded("connect", Client::connect_with(options)).await.expect("connect");
        assert_eq!(bounded("add", client.add("n", 5)).await.expect("add"), 5, "{end:?}");
        assert_eq!(proxy.connections(), 2, "{end:?}: the connection was not cut once");
        assert_eq!(bounded("get", client.get("n", None)).await.expect("get"), "5", "{end:?}: added twice");
        assert_eq!(client.add("n", 1).await.expect("add"), 6);
        client.close().await.expect("close");
    }
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_all_gather_retried_after_a_cut_contributes_once() {
    let server = start_server().await;
    let proxy = Proxy::start(server.local_addr(), Cut::AfterRequest, ALL_GATHER, CoordinatorEnd::StaysOpen).await;
    let r0 = connect(&server, rank("gather", 0, 2)).await;
    let r1 = through(&proxy, "gather", 1, 2).await;
    let c0 = r0.clone();
    let first = start_confirmed(&r0, async move { c0.all_gather("g", Members::World, "a", None).await }).await;
    let mine = bounded("rank 1's all-gather", r1.all_gather("g", Members::World, "b", None)).await.expect("gather");
    let theirs = bounded("rank 0's all-gather", first).await.expect("task").expect("gather");
    assert_eq!(proxy.connections(), 2, "the connection was not cut once");
    let both = ["a", "b"].map(bytes::Bytes::from).to_vec();
    assert_eq!((mine.to_vec(), theirs.to_vec()), (both.clone(), both));
    let c1 = r1.clone();
    let second = start_confirmed(&r1, async move { c1.all_gather("g", Members::World, "d", None).await }).await;
    let again = bounded("rank 0's second", r0.all_gather("g", Members::World, "c", None)).await.expect("gather");
    assert_eq!(again.to_vec(), ["c", "d"].map(bytes::Bytes::from), "generation 2 holds both ranks' second values");
    bounded("rank 1's second", second).await.expect("task").expect("gather");
    server.shutdown().await;
}

/// The coordinator no longer has the session (no reconnect grace: the cut rank is
/// lost at once, failing its peers): the client goes on as a new session, and the
/// call it had sent fails saying its outcome is unknown, rather than being sent
/// blindly again. (A world of 3 whose rank 2 never comes: the barrier cannot
/// complete with rank 1's arrival.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_gone_for_good_is_not_resumed_and_its_calls_fail_clearly() {
    let server = start_server_with(Config { reconnect_grace_ms: 0, ..Config::default() }).await;
    // The reconnect is held until the coordinator has seen the cut (else it resumes
    // a session the coordinator still thinks open).
    let proxy = Proxy::gated(server.local_addr(), Cut::AfterRequest, BARRIER, CoordinatorEnd::Closes).await;
    let r0 = connect(&server, rank("gone", 0, 3)).await;
    let r1 = through(&proxy, "gone", 1, 3).await;
    let session = r1.session();
    let c0 = r0.clone();
    let waiting = start_confirmed(&r0, async move { c0.barrier("b", Members::World, None).await }).await;
    let c1 = r1.clone();
    let cut = tokio::spawn(async move { c1.barrier("b", Members::World, None).await });
    match bounded("rank 0's barrier", waiting).await.expect("task") {
        Err(Error::Op(OpError::PeerLost { peer, .. })) => assert_eq!(peer.rank, 1),
        other => panic!("expected PeerLost naming rank 1, got {other:?}"),
    }
    proxy.open();
    match bounded("rank 1's barrier", cut).await.expect("task") {
        Err(Error::Disconnected(why)) => assert!(why.contains("whether this call took effect is unknown"), "{why}"),
        other => panic!("expected Disconnected, got {other:?}"),
    }
    assert_ne!(r1.session(), session, "a new session");
    assert_eq!(proxy.connections(), 2);
    r1.set("k", "v").await.expect("the new session works");
    server.shutdown().await;
}

/// Two processes claiming one rank: the second is refused, naming both; the server
/// side of what `rallypoint barrier` shows as exit code 8.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_process_claiming_a_held_rank_is_refused() {
    let server = start_server().await;
    let holder = connect(&server, rank("held", 1, 2)).await;
    let other =
        Identity { incarnation: Some(holder.identity().incarnation.expect("stated") ^ 1), ..rank("held", 1, 2) };
    let options = ConnectOptions::new(server.local_addr().to_string(), other).with_timeout(Duration::from_secs(20));
    match bounded("claim", Client::connect_with(options)).await {
        Err(Error::Op(e @ OpError::RankHeld { .. })) => {
            assert!(e.to_string().starts_with("rank 1 is held by pid 1001 on host host-1 (incarnation "), "{e}")
        }
        other => panic!("expected RankHeld, got {:?}", other.map(|c| c.session())),
    }
    holder.close().await.expect("close");
    server.shutdown().await;
}

/// A client dropped without `close()` counts as a death at once (it says Abandon),
/// however long the reconnect grace, async or blocking (whose runtime goes with it).
/// The process (this test) lives on, so only the Abandon can tell the coordinator.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_client_is_lost_at_once_whatever_the_grace() {
    let server =
        start_server_with(Config { reconnect_grace_ms: 600_000, lease_ms: 600_000, ..Config::default() }).await;
    let addr = server.local_addr().to_string();
    for blocking in [false, true] {
        let job = format!("dropped-{blocking}");
        let r0 = connect(&server, Identity::ranked(&job, 0, 2)).await;
        let c0 = r0.clone();
        let waiting = start_confirmed(&r0, async move { c0.barrier("b", Members::World, None).await }).await;
        let options = ConnectOptions::new(addr.clone(), Identity::ranked(&job, 1, 2));
        if blocking {
            let dropped = tokio::task::spawn_blocking(move || {
                let client = rallypoint::blocking::Client::connect_with(options).expect("connect");
                drop(client);
            });
            bounded("the blocking client", dropped).await.expect("task");
        } else {
            drop(Client::connect_with(options).await.expect("connect"));
        }
        match bounded("rank 0's barrier", waiting).await.expect("task") {
            Err(Error::Op(OpError::PeerLost { peer, .. })) => assert_eq!(peer.rank, 1, "{job}"),
            other => panic!("{job}: expected PeerLost naming rank 1, got {other:?}"),
        }
    }
    server.shutdown().await;
}

/// While a cut rank waits for its process to resume (the reconnect held back here), its
/// peers' status report and snapshot show it reconnecting rather than connected; once
/// it resumes, it is a rank like any other and its re-sent barrier arrival counts once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_in_its_grace_is_shown_reconnecting_until_it_resumes() {
    let server =
        start_server_with(Config { reconnect_grace_ms: 600_000, lease_ms: 600_000, ..Config::default() }).await;
    let proxy = Proxy::gated(server.local_addr(), Cut::AfterRequest, BARRIER, CoordinatorEnd::Closes).await;
    let r0 = connect(&server, rank("grace", 0, 2)).await;
    let r1 = through(&proxy, "grace", 1, 2).await;
    let session = r1.session();
    let c1 = r1.clone();
    let cut = tokio::spawn(async move { c1.barrier("b", Members::World, None).await });

    // The coordinator notices the cut on its own time: poll, bounded.
    let line = "reconnecting: rank 1 (host host-1, pid 1001): connection dropped ";
    let mut status = String::new();
    for _ in 0..200 {
        status = r0.status().await.expect("status");
        if status.contains(line) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(status.contains(line), "{status}");
    assert!(status.contains("ranks: 2 connected (1 reconnecting), 0 left cleanly, 0 lost"), "{status}");
    let snapshot = r0.snapshot().await.expect("snapshot");
    let held = snapshot.ranks[1].reconnecting.expect("rank 1 reconnecting in the snapshot");
    assert!(held.lost_in_ms > 0 && held.lost_in_ms <= 600_000, "{held:?}");
    assert_eq!((snapshot.ranks[0].reconnecting, snapshot.ranks_summary.reconnecting), (None, 1));
    let reconnecting = |server: &rallypoint::server::ServerHandle| {
        server.observer().metrics().jobs.iter().find(|m| m.name == "grace").map(|m| m.ranks.reconnecting)
    };
    assert_eq!(reconnecting(&server), Some(1), "/metrics counts it");

    proxy.open();
    bounded("rank 0's barrier", r0.barrier("b", Members::World, None)).await.expect("rank 0's barrier");
    bounded("rank 1's barrier", cut).await.expect("task").expect("rank 1's barrier, resumed");
    assert_eq!((r1.session(), proxy.connections()), (session, 2), "resumed on a second connection");
    let status = r0.status().await.expect("status");
    assert!(!status.contains("reconnecting"), "{status}");
    assert_eq!(r0.snapshot().await.expect("snapshot").ranks[1].reconnecting, None);
    assert_eq!(reconnecting(&server), Some(0));
    r1.close().await.expect("close rank 1");
    r0.close().await.expect("close rank 0");
    server.shutdown().await;
}
