//! Sessions of ranks behind node agents surviving a cut (docs/PROTOCOL.md, sections 12
//! and 14.4): a rank whose connection to its agent drops while the agent stays up
//! resumes its session, through that agent, directly or through another, keeping its
//! rank and its waiting calls, and nothing it sends again counts twice; a rank whose
//! agent lost its link to the coordinator is lost at once, and a later hello resuming
//! its session opens a new one.

use std::mem::ManuallyDrop;
use std::net::Shutdown;
use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::BytesMut;
use rallypoint::server::ServerHandle;
use rallypoint::{Client, Config, Error, Identity, LossReason, Members, OpError, RankState};
use rallypoint_core::{Request, Response, SessionId};
use rallypoint_proto::native::{
    decode_server_frame, encode_client_frame, encode_preamble, AgentFrame, ClientFrame, FrameLimits, RootFrame,
    ServerFrame,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinHandle;

use crate::agents::{connect_via, maps_a_barrier_channel, start_agent, RawAgent, WAIT};
use crate::common::{bounded, connect, rank, start_server_with};

/// A grace long enough that a resume is never late on a loaded machine.
pub(crate) fn long_grace() -> Config {
    Config { reconnect_grace_ms: 60_000, lease_ms: 60_000, ..Config::default() }
}

/// This process's open sockets, each with its descriptor, borrowed to ask for its
/// addresses and never closed here. (Should one be closed and its number reused
/// meanwhile, the question goes to another socket, or fails.)
fn sockets() -> Vec<(RawFd, ManuallyDrop<UnixStream>)> {
    let mut sockets = Vec::new();
    for entry in std::fs::read_dir("/proc/self/fd").expect("/proc/self/fd").flatten() {
        let Some(fd) = entry.file_name().to_str().and_then(|name| name.parse::<RawFd>().ok()) else { continue };
        if !std::fs::read_link(entry.path()).is_ok_and(|target| target.to_string_lossy().starts_with("socket:")) {
            continue;
        }
        // SAFETY: a descriptor of this process, wrapped so that it is never closed.
        sockets.push((fd, ManuallyDrop::new(unsafe { UnixStream::from_raw_fd(fd) })));
    }
    sockets
}

/// A Unix socket address's path, if it has one.
fn path_of(addr: std::io::Result<std::os::unix::net::SocketAddr>) -> Option<std::path::PathBuf> {
    addr.ok().and_then(|addr| addr.as_pathname().map(Path::to_path_buf))
}

/// The client ends of this process's Unix-socket connections to `path`.
fn connections_to(path: &Path) -> Vec<RawFd> {
    let to_path =
        |(_, socket): &(RawFd, ManuallyDrop<UnixStream>)| path_of(socket.peer_addr()).as_deref() == Some(path);
    sockets().into_iter().filter(to_path).map(|(fd, _)| fd).collect()
}

/// How many connections the agent listening at `path` holds open in this process.
fn agent_ends(path: &Path) -> usize {
    // Its listener has no peer.
    let end = |(_, socket): &(RawFd, ManuallyDrop<UnixStream>)| {
        path_of(socket.local_addr()).as_deref() == Some(path) && socket.peer_addr().is_ok()
    };
    sockets().iter().filter(|s| end(s)).count()
}

/// Cuts the connection whose client end is `fd` both ways, as a broken path would:
/// the client and the agent each read its end, neither closes it first.
fn cut(fd: RawFd) {
    // SAFETY: as in `connections_to`; the client closes it once it sees the cut.
    let socket = ManuallyDrop::new(unsafe { UnixStream::from_raw_fd(fd) });
    socket.shutdown(Shutdown::Both).expect("shut the connection down");
}

fn socket_path(agent: &rallypoint::agent::AgentHandle) -> PathBuf {
    PathBuf::from(agent.local_addr().strip_prefix("unix:").expect("a Unix-socket agent"))
}

/// Polls `client`'s status until `wanted` holds of it (bounded in count).
pub(crate) async fn wait_for_status(client: &Client, what: &str, wanted: impl Fn(&str) -> bool) {
    let mut last = String::new();
    for _ in 0..1_000 {
        last = bounded("status", client.status()).await.expect("status");
        if wanted(&last) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the coordinator never showed {what}:\n{last}");
}

/// `client`'s call of barrier `name` of the whole job, in a task of its own.
pub(crate) fn barrier_of(client: &Client, name: &'static str) -> JoinHandle<Result<(), Error>> {
    let client = client.clone();
    tokio::spawn(async move { client.barrier(name, Members::World, WAIT).await })
}

/// A rank behind a Unix-socket agent (which stays up) whose connection is cut while
/// its barrier call waits, with the call gone through a message (the first call of a
/// barrier, and the second, which asks for a channel) or through the barrier channel
/// (the later ones): it reconnects through the
/// agent and resumes its session, its call completes, nobody is lost, and its arrival
/// counted once (the next generation waits for it). The agent reports the cut only
/// after watching the rank's process, so the new hello usually overtakes the close of
/// the connection it replaces (the stale sub-session `answer_hellos` drops).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_cut_from_its_agent_resumes_through_it_mid_barrier() {
    let server = start_server_with(long_grace()).await;
    // The generation whose call is cut: the first goes as a message, the second as
    // one asking for a channel, the third through that channel.
    for cut_at in [1u64, 2, 3] {
        let job = format!("cut-at-{cut_at}");
        let agent = start_agent(&server, true).await;
        let path = socket_path(&agent);
        // Ranks 0 and 1 behind the agent as this process (whose pid the agent watches,
        // and finds alive), 2 and 3 directly.
        let r0 = connect_via(&agent, Identity::ranked(&job, 0, 4)).await;
        let before = connections_to(&path);
        let r1 = connect_via(&agent, Identity::ranked(&job, 1, 4)).await;
        let mine: Vec<RawFd> = connections_to(&path).into_iter().filter(|fd| !before.contains(fd)).collect();
        let [r1_fd] = mine[..] else { panic!("rank 1's connection to the agent: {mine:?}") };
        let r2 = connect(&server, Identity::ranked(&job, 2, 4)).await;
        let r3 = connect(&server, Identity::ranked(&job, 3, 4)).await;
        let session = r1.session();

        for generation in 1..=cut_at {
            let waiting = [barrier_of(&r0, "step"), barrier_of(&r1, "step"), barrier_of(&r2, "step")];
            let shown = format!("waiting: barrier 'step' (generation {generation})");
            wait_for_status(&r3, "ranks 0-2 at the barrier", |s| {
                s.contains(&shown) && s.contains("missing (1): rank 3")
            })
            .await;
            if generation == cut_at {
                if cut_at == 3 {
                    assert!(maps_a_barrier_channel(), "rank 1's third call went through a channel");
                }
                cut(r1_fd);
            }
            bounded("rank 3's barrier", r3.barrier("step", Members::World, WAIT)).await.expect("rank 3 passes");
            for (r, waiting) in [0, 1, 2].into_iter().zip(waiting) {
                bounded("a barrier", waiting)
                    .await
                    .expect("task")
                    .unwrap_or_else(|e| panic!("cut at {cut_at}: rank {r}'s generation {generation}: {e}"));
            }
        }
        assert_eq!(r1.session(), session, "cut at {cut_at}: rank 1 resumed its session");
        // The agent closes the cut connection once it has told the coordinator of it,
        // after watching the rank's process for a moment: the resumed session's new
        // sub-session was welcomed long before. Then a request of rank 0 (after that
        // close on the agent's link) proves the coordinator saw the close.
        for _ in 0..3_000 {
            if agent_ends(&path) == 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(agent_ends(&path), 2, "cut at {cut_at}: the agent holds ranks 0 and 1's connections only");
        bounded("rank 0's ping", r0.ping()).await.expect("ping");
        assert!(server.lost_ranks(&job).is_empty(), "cut at {cut_at}: {:?}", server.lost_ranks(&job));

        // Rank 1's arrival counted once: the next generation waits for it.
        let next = cut_at + 1;
        let waiting = [barrier_of(&r0, "step"), barrier_of(&r2, "step"), barrier_of(&r3, "step")];
        let shown = format!("waiting: barrier 'step' (generation {next})");
        wait_for_status(&r0, "generation after the cut waiting for rank 1", |s| {
            s.contains(&shown) && s.contains("missing (1): rank 1")
        })
        .await;
        bounded("rank 1's next barrier", r1.barrier("step", Members::World, WAIT)).await.expect("rank 1 passes");
        for waiting in waiting {
            bounded("a barrier", waiting).await.expect("task").expect("the generation after the cut passes");
        }
        for client in [r0, r1, r2, r3] {
            bounded("close", client.close()).await.expect("clean leave");
        }
        bounded("agent shutdown", agent.shutdown()).await.expect("the agent stops cleanly");
    }
    server.shutdown().await;
}

/// Rank 0 of `job` as a raw agent states it: a made-up host and pid (the coordinator
/// cannot see that process, so a drop is a cut, not a death) and an incarnation.
pub(crate) fn raw_rank(job: &str, r: u32, world: u32) -> Identity {
    Identity { incarnation: Some(0x5eed_0000 + u64::from(r)), ..rank(job, r, world) }
}

/// `peer` calls barrier 'b' a second time; returns once the coordinator shows that
/// generation waiting for rank 0 alone.
async fn generation_2_waiting_for_rank_0(peer: &Client) -> JoinHandle<Result<(), Error>> {
    let c = peer.clone();
    let second = tokio::spawn(async move { c.barrier("b", Members::World, WAIT).await });
    wait_for_status(peer, "generation 2 waiting for rank 0", |s| {
        s.contains("waiting: barrier 'b' (generation 2)") && s.contains("missing (1): rank 0")
    })
    .await;
    second
}

fn barrier_request() -> Request {
    Request::Barrier { name: "b".into(), members: Members::World, timeout_ms: Some(50_000) }
}

/// The session a SubWelcome for `sub` names.
pub(crate) async fn welcomed(agent: &mut RawAgent, sub: u64) -> SessionId {
    match agent.next().await {
        RootFrame::SubWelcome { sub: welcomed, welcome } if welcomed == sub => welcome.session,
        other => panic!("expected a welcome for sub-session {sub}, got {other:?}"),
    }
}

/// The next frame is `sub`'s reply `Done` to request `id`, and only to it.
async fn done(agent: &mut RawAgent, sub: u64, id: u64) {
    match agent.next().await {
        RootFrame::SubReply { sub: s, id: i, reply: Ok(Response::Done) } if (s, i) == (sub, id) => {}
        RootFrame::SubReplies { calls, reply: Ok(Response::Done) } if calls == [(sub, id)] => {}
        other => panic!("expected Done for request {id} of sub-session {sub}, got {other:?}"),
    }
}

/// How the close of the sub-session a rank left and its resuming hello reach the
/// coordinator through one agent.
#[derive(Debug, Clone, Copy)]
enum Order {
    /// The close first: the session waits out its grace, then is resumed.
    CloseFirst,
    /// The hello and the close in one write (one batch of the agent's link).
    OneWrite,
    /// The hello, answered, then the close of the sub-session it replaced (stale).
    HelloFirst,
}

/// A rank resuming its session on the same agent, whatever the order in which the
/// close of its old sub-session and its new hello arrive: the close never costs it
/// its rank, its waiting barrier is answered on the new sub-session once, a copy sent
/// again is not counted, and the next generation waits for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sub_session_resumed_on_its_agent_keeps_its_rank_whatever_the_order() {
    let server = start_server_with(long_grace()).await;
    let mut agent = RawAgent::connect(&server).await;
    for (n, order) in [Order::CloseFirst, Order::OneWrite, Order::HelloFirst].into_iter().enumerate() {
        let job = format!("same-agent-{order:?}");
        let (old, new) = (10 * n as u64 + 1, 10 * n as u64 + 2);
        let identity = raw_rank(&job, 0, 2);
        agent
            .send(&[
                AgentFrame::SubHello { sub: old, identity: identity.clone() },
                AgentFrame::SubRequest { sub: old, id: 7, request: barrier_request() },
            ])
            .await;
        let session = welcomed(&mut agent, old).await;
        let peer = connect(&server, rank(&job, 1, 2)).await;
        wait_for_status(&peer, "rank 0 at the barrier", |s| s.contains("missing (1): rank 1")).await;

        let close = AgentFrame::SubClose { sub: old, gone: false };
        let hello = AgentFrame::SubHello { sub: new, identity: Identity { resume: Some(session), ..identity.clone() } };
        match order {
            Order::CloseFirst => {
                agent.send(&[close]).await;
                agent.send(&[hello]).await;
            }
            Order::OneWrite => agent.send(&[hello, close]).await,
            Order::HelloFirst => agent.send(&[hello]).await,
        }
        assert_eq!(welcomed(&mut agent, new).await, session, "{order:?}: the session was resumed");
        // The copy the rank sends again (it had no reply), as the agent aggregates it;
        // the heartbeat's reply says the coordinator has seen it (and the late close).
        agent.send(&[AgentFrame::SubRequests { calls: vec![(new, 7)], request: barrier_request() }]).await;
        if let Order::HelloFirst = order {
            agent.send(&[AgentFrame::SubClose { sub: old, gone: false }]).await;
        }
        agent.send(&[AgentFrame::SubRequest { sub: new, id: 8, request: Request::Heartbeat }]).await;
        done(&mut agent, new, 8).await;
        bounded("rank 1's barrier", peer.barrier("b", Members::World, WAIT))
            .await
            .unwrap_or_else(|e| panic!("{order:?}: rank 1's barrier: {e}"));
        done(&mut agent, new, 7).await;
        assert!(server.lost_ranks(&job).is_empty(), "{order:?}: {:?}", server.lost_ranks(&job));

        // Generation 2 waits for rank 0: its copy did not count.
        let second = generation_2_waiting_for_rank_0(&peer).await;
        agent.send(&[AgentFrame::SubRequest { sub: new, id: 9, request: barrier_request() }]).await;
        bounded("rank 1's second barrier", second).await.expect("task").expect("generation 2 passes");
        // The next frame is this release: request 7 was answered once.
        done(&mut agent, new, 9).await;
        agent.send(&[AgentFrame::SubClose { sub: new, gone: false }]).await;
        bounded("close", peer.close()).await.expect("clean leave");
    }
    server.shutdown().await;
}

/// A rank's own connection to the coordinator, speaking the protocol by hand (the
/// client library resumes only the sessions it opened itself).
pub(crate) struct RawRank {
    stream: tokio::net::TcpStream,
    rbuf: BytesMut,
}

impl RawRank {
    /// Says hello as `identity`; returns the connection and its welcome's session.
    pub(crate) async fn hello(server: &ServerHandle, identity: Identity) -> (RawRank, SessionId) {
        let stream = tokio::net::TcpStream::connect(server.local_addr()).await.expect("connect to the coordinator");
        let mut rank = RawRank { stream, rbuf: BytesMut::new() };
        let mut out = BytesMut::new();
        encode_preamble(&mut out);
        encode_client_frame(&ClientFrame::Hello(identity), &mut out);
        rank.write(&out).await;
        match rank.next().await {
            ServerFrame::Welcome(welcome) => (rank, welcome.session),
            other => panic!("expected a welcome, got {other:?}"),
        }
    }

    pub(crate) async fn request(&mut self, id: u64, request: Request) {
        let mut out = BytesMut::new();
        encode_client_frame(&ClientFrame::Request { id, request }, &mut out);
        self.write(&out).await;
    }

    async fn write(&mut self, bytes: &[u8]) {
        bounded("write", self.stream.write_all(bytes)).await.expect("write to the coordinator");
    }

    async fn next(&mut self) -> ServerFrame {
        loop {
            let decoded = decode_server_frame(&mut self.rbuf, &FrameLimits::unbounded());
            if let Some(frame) = decoded.expect("a well-formed coordinator frame") {
                return frame;
            }
            let read = bounded("read", self.stream.read_buf(&mut self.rbuf)).await.expect("read");
            assert!(read > 0, "the coordinator closed the connection");
        }
    }

    /// The next frame is the reply `Done` to request `id`.
    pub(crate) async fn done(&mut self, id: u64) {
        match self.next().await {
            ServerFrame::Reply { id: i, reply: Ok(Response::Done) } if i == id => {}
            other => panic!("expected Done for request {id}, got {other:?}"),
        }
    }
}

/// Where a rank that left its agent says hello again.
#[derive(Debug, Clone, Copy)]
enum Via {
    Direct,
    OtherAgent,
}

/// Resumes the session of `identity` at the coordinator directly (returning the
/// connection) or through `other` as sub-session 1 (returning None); the session the
/// welcome names.
async fn hello_again(
    server: &ServerHandle,
    via: Via,
    identity: &Identity,
    session: SessionId,
    other: &mut RawAgent,
) -> (SessionId, Option<RawRank>) {
    let identity = Identity { resume: Some(session), ..identity.clone() };
    match via {
        Via::Direct => {
            let (rank, session) = RawRank::hello(server, identity).await;
            (session, Some(rank))
        }
        Via::OtherAgent => {
            other.send(&[AgentFrame::SubHello { sub: 1, identity }]).await;
            (welcomed(other, 1).await, None)
        }
    }
}

/// A rank whose connection to agent A dropped (A stays up) resumes its session
/// directly or through agent B: the session moves, keeping the barrier call it made
/// through A (answered where the session is now), and neither A's late close of its
/// sub-session nor A's link going away afterwards (with or without that close)
/// costs the rank anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_moves_from_its_agent_keeps_its_session() {
    let server = start_server_with(long_grace()).await;
    for (via, a_reports) in
        [(Via::Direct, true), (Via::Direct, false), (Via::OtherAgent, true), (Via::OtherAgent, false)]
    {
        let job = format!("moves-{via:?}-{a_reports}");
        let identity = raw_rank(&job, 0, 2);
        let mut a = RawAgent::connect(&server).await;
        let mut b = RawAgent::connect(&server).await;
        // Ids above any the direct client will use: the session is one, whoever speaks for it.
        a.send(&[
            AgentFrame::SubHello { sub: 1, identity: identity.clone() },
            AgentFrame::SubRequest { sub: 1, id: 1_000, request: barrier_request() },
        ])
        .await;
        let session = welcomed(&mut a, 1).await;
        let peer = connect(&server, rank(&job, 1, 2)).await;
        wait_for_status(&peer, "rank 0 at the barrier", |s| s.contains("missing (1): rank 1")).await;

        let (resumed, mut direct) = hello_again(&server, via, &identity, session, &mut b).await;
        assert_eq!(resumed, session, "{via:?}: the session was resumed");
        // A reports the rank's connection closed (or not yet), then goes away itself.
        if a_reports {
            a.send(&[AgentFrame::SubClose { sub: 1, gone: false }]).await;
        }
        drop(a);

        bounded("rank 1's barrier", peer.barrier("b", Members::World, WAIT))
            .await
            .unwrap_or_else(|e| panic!("{via:?}: rank 1's barrier: {e}"));
        // The call made through A is answered where the session is now.
        match &mut direct {
            Some(rank) => rank.done(1_000).await,
            None => done(&mut b, 1, 1_000).await,
        }
        assert!(server.lost_ranks(&job).is_empty(), "{via:?}: {:?}", server.lost_ranks(&job));
        // Rank 0 is alive where it went: generation 2 passes with it.
        let second = generation_2_waiting_for_rank_0(&peer).await;
        match &mut direct {
            Some(rank) => {
                rank.request(1_001, barrier_request()).await;
                rank.done(1_001).await;
            }
            None => {
                b.send(&[AgentFrame::SubRequest { sub: 1, id: 1_001, request: barrier_request() }]).await;
                done(&mut b, 1, 1_001).await;
            }
        }
        bounded("rank 1's second barrier", second).await.expect("task").expect("generation 2 passes");
        bounded("close", peer.close()).await.expect("clean leave");
    }
    server.shutdown().await;
}

/// A node agent's link to the coordinator goes away: its ranks are lost at once,
/// without the reconnect grace (they reach the coordinator only through it), and
/// their peers are told by name. A rank of it saying hello again later, directly or
/// through another agent, with its session's id, gets a new session: the one it had
/// is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_whose_agent_link_died_is_lost_at_once_and_cannot_resume() {
    let server = start_server_with(long_grace()).await;
    for via in [Via::Direct, Via::OtherAgent] {
        let job = format!("agent-lost-{via:?}");
        let identity = raw_rank(&job, 0, 2);
        let mut a = RawAgent::connect(&server).await;
        let mut b = RawAgent::connect(&server).await;
        a.send(&[AgentFrame::SubHello { sub: 1, identity: identity.clone() }]).await;
        let session = welcomed(&mut a, 1).await;
        let peer = connect(&server, rank(&job, 1, 2)).await;
        let c = peer.clone();
        let waiting = tokio::spawn(async move { c.barrier("b", Members::World, WAIT).await });
        wait_for_status(&peer, "rank 1 at the barrier", |s| s.contains("missing (1): rank 0")).await;

        drop(a);
        // Within a grace far longer than this test's bounds: only the loss at once passes.
        match bounded("rank 1's barrier", waiting).await.expect("task") {
            Err(Error::Op(OpError::PeerLost { peer, .. })) => {
                assert_eq!((peer.rank, peer.host.as_deref()), (0, Some("host-0")), "{via:?}");
                assert_eq!(peer.state, RankState::Lost(LossReason::Disconnected), "{via:?}");
            }
            other => panic!("{via:?}: expected PeerLost naming rank 0, got {other:?}"),
        }

        let (again, _direct) = hello_again(&server, via, &identity, session, &mut b).await;
        assert_ne!(again, session, "{via:?}: a session closed with its agent's link is not resumed");
        bounded("close", peer.close()).await.expect("clean leave");
    }
    server.shutdown().await;
}
