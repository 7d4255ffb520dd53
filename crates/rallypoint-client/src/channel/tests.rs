//! Barrier calls through a channel against a scripted agent on a Unix socket,
//! which decides when a failed round's error comes on the socket: before the call
//! wakes to look for it, or after. A released round registers no reply slot; a
//! failed one finds its reply whenever it came.

use std::collections::VecDeque;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use rallypoint_core::{
    CollectiveKind, Identity, LossReason, Members, OpError, OpRef, RankInfo, RankState, Request, Response, SessionId,
    Welcome,
};
use rallypoint_net::shm_barrier::{AgentChannel, Outcome};
use rallypoint_net::{Listener, ReadHalf, WriteHalf};
use rallypoint_proto::native::{
    decode_client_frame, decode_preamble, encode_server_frame, ClientFrame, FrameLimits, ServerFrame,
};

use super::Watched;
use crate::{blocking, Client, ConnectOptions, Error};

/// The longest any step of these tests waits: a bound, not a timing.
const BOUND: Duration = Duration::from_secs(20);
/// The barrier's timeout: never reached when the reply is found.
const BARRIER_TIMEOUT: Duration = Duration::from_secs(3);

async fn bounded<F: std::future::Future>(future: F) -> F::Output {
    tokio::time::timeout(BOUND, future).await.expect("a step of the test took too long")
}

/// The scripted agent's end of one rank's connection, and the channel it gives.
struct Agent {
    reader: ReadHalf,
    writer: WriteHalf,
    buf: BytesMut,
    files: VecDeque<OwnedFd>,
    channel: AgentChannel,
    /// The slots the rank gave back (LeaveBarrierChannel), as `(channel, slot)`.
    left: Vec<(u64, u32)>,
}

impl Agent {
    /// Accepts a rank, says welcome, answers its first barrier call (a request),
    /// and its second, which asks for a channel, with slot 0 of one (and the call's reply).
    async fn accept(listener: &Listener) -> Agent {
        let (mut agent, id) = Agent::accept_until_attach(listener).await;
        agent.give_channel(id).await;
        agent.send(ServerFrame::Reply { id, reply: Ok(Response::Done) }).await;
        agent
    }

    /// As [`Agent::accept`], up to the call that asks for a channel, unanswered:
    /// returns its request id.
    async fn accept_until_attach(listener: &Listener) -> (Agent, u64) {
        let stream = bounded(listener.accept()).await.expect("accept");
        let (reader, writer) = stream.into_split();
        let channel = AgentChannel::create(2).expect("a channel");
        channel.set_attached(1);
        let mut agent =
            Agent { reader, writer, buf: BytesMut::new(), files: VecDeque::new(), channel, left: Vec::new() };
        while decode_preamble(&mut agent.buf).expect("preamble").is_none() {
            agent.read().await;
        }
        loop {
            match agent.frame().await {
                Some(ClientFrame::Hello(_)) | Some(ClientFrame::TakeSharedReplies) => {}
                Some(ClientFrame::Request { id, request: Request::Barrier { .. } }) => {
                    agent.send(ServerFrame::Reply { id, reply: Ok(Response::Done) }).await;
                    continue;
                }
                Some(ClientFrame::AttachBarrier { id, request: Request::Barrier { .. } }) => return (agent, id),
                other => panic!("expected a hello, then a barrier, then one asking for a channel; got {other:?}"),
            }
            if agent.buf.is_empty() {
                let welcome = Welcome { session: SessionId(1), lease_ms: 0, job_incarnation: None };
                agent.send(ServerFrame::Welcome(welcome)).await;
            }
        }
    }

    async fn read(&mut self) -> usize {
        bounded(self.reader.read_with_files(&mut self.buf, 4096, &mut self.files)).await.expect("read")
    }

    /// The next frame but slots given back (kept in `left`); `None` once the rank
    /// closed the connection.
    async fn frame(&mut self) -> Option<ClientFrame> {
        loop {
            match decode_client_frame(&mut self.buf, &FrameLimits::unbounded()).expect("a frame") {
                Some(ClientFrame::LeaveBarrierChannel { channel, slot }) => {
                    self.left.push((channel, slot));
                    continue;
                }
                Some(frame) => return Some(frame),
                None => {}
            }
            if self.read().await == 0 {
                return None;
            }
        }
    }

    async fn send(&mut self, frame: ServerFrame) {
        let mut out = BytesMut::new();
        encode_server_frame(&frame, &mut out);
        bounded(self.writer.write_locked(&out)).await.expect("write");
    }

    /// Gives slot 0 of the channel, its files with the frame.
    async fn give_channel(&mut self, id: u64) {
        let mut out = BytesMut::new();
        encode_server_frame(&ServerFrame::BarrierChannel { id, channel: 1, slot: 0 }, &mut out);
        let files = [self.channel.file.as_fd(), self.channel.doorbell.as_fd(), self.channel.bell.as_fd()];
        let mut written = 0;
        while written == 0 {
            bounded(self.writer.writable()).await.expect("writable");
            match self.writer.try_write_with_files(&out, &files) {
                Ok(n) => written = n,
                Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(error) => panic!("cannot write the channel: {error}"),
            }
        }
        bounded(self.writer.write_locked(&out[written..])).await.expect("write");
    }

    /// Waits for the rank's arrival at `round` of slot 0; returns its request id.
    async fn arrival(&self, round: u32) -> u64 {
        bounded(async {
            loop {
                match self.channel.arrival(0, round - 1) {
                    Some((arrived, call)) if arrived == round => return call,
                    _ => tokio::time::sleep(Duration::from_millis(1)).await,
                }
            }
        })
        .await
    }

    /// Ends `round` of slot 0 so and wakes the rank.
    fn finish(&self, round: u32, outcome: Outcome) {
        self.channel.finish(0, round, outcome);
        self.channel.release();
    }

    /// Answers the next request, an add, with its delta.
    async fn answer_add(&mut self) {
        match self.frame().await {
            Some(ClientFrame::Request { id, request: Request::Add { delta, .. } }) => {
                self.send(ServerFrame::Reply { id, reply: Ok(Response::Int(delta)) }).await;
            }
            other => panic!("expected an add, got {other:?}"),
        }
    }
}

/// The coordinator's error for the round: rank 1 was lost.
fn lost() -> OpError {
    let op = OpRef { kind: CollectiveKind::Barrier, name: "b".to_owned(), generation: 2 };
    let peer = RankInfo {
        rank: 1,
        host: Some("host-1".to_owned()),
        pid: Some(1001),
        state: RankState::Lost(LossReason::Disconnected),
        last_seen_ms_ago: Some(0),
    };
    OpError::PeerLost { op, peer }
}

fn assert_lost(outcome: Result<(), Error>) {
    match outcome {
        Err(Error::Op(error)) => assert_eq!(error, lost()),
        other => panic!("expected the coordinator's error naming rank 1, got {other:?}"),
    }
}

/// A directory of this test's own for the agent's socket, removed when dropped.
struct SocketDir(std::path::PathBuf);

impl Drop for SocketDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

async fn listen() -> (Listener, String, SocketDir) {
    static MADE: AtomicU32 = AtomicU32::new(0);
    let name = format!("rallypoint-channel-test-{}-{}", std::process::id(), MADE.fetch_add(1, Ordering::Relaxed));
    let dir = SocketDir(std::env::temp_dir().join(name));
    std::fs::create_dir(&dir.0).expect("a directory");
    let listener = Listener::bind(&format!("unix:{}", dir.0.join("agent.sock").display())).await.expect("bind");
    let addr = listener.local_addr().expect("address");
    (listener, addr, dir)
}

fn options(addr: &str) -> ConnectOptions {
    ConnectOptions::new(addr, Identity::ranked("job", 0, 2)).with_timeout(BOUND)
}

/// An async client with a seat in the agent's channel for barrier `b`.
async fn seated_async() -> (Client, Agent, SocketDir) {
    let (listener, addr, dir) = listen().await;
    let (client, agent) = tokio::join!(
        async {
            let client = Client::connect_with(options(&addr)).await.expect("connect");
            client.barrier("b", Members::World, Some(BARRIER_TIMEOUT)).await.expect("the first call");
            client.barrier("b", Members::World, Some(BARRIER_TIMEOUT)).await.expect("the second call");
            client
        },
        Agent::accept(&listener)
    );
    (client, agent, dir)
}

/// A blocking client with a seat in the agent's channel for barrier `b`.
async fn seated_blocking() -> (blocking::Client, Agent, SocketDir) {
    let (listener, addr, dir) = listen().await;
    let connecting = tokio::task::spawn_blocking(move || {
        let client = blocking::Client::connect_with(options(&addr)).expect("connect");
        client.barrier("b", Members::World, Some(BARRIER_TIMEOUT)).expect("the first call");
        client.barrier("b", Members::World, Some(BARRIER_TIMEOUT)).expect("the second call");
        client
    });
    let agent = Agent::accept(&listener).await;
    let client = bounded(connecting).await.expect("connecting");
    (client, agent, dir)
}

/// An async barrier call of the seated client, as a task.
fn spawn_barrier(client: &Client) -> tokio::task::JoinHandle<Result<(), Error>> {
    let client = client.clone();
    tokio::spawn(async move { client.barrier("b", Members::World, Some(BARRIER_TIMEOUT)).await })
}

/// A blocking barrier call in the channel, and its error sent on the socket
/// and read by the client while the rank still sleeps in the channel: the add
/// answered after the error on the same stream returns only once it is read.
async fn blocking_call_whose_error_was_read(
    client: &blocking::Client,
    agent: &mut Agent,
) -> tokio::task::JoinHandle<Result<(), Error>> {
    let waiting = tokio::task::spawn_blocking({
        let client = client.clone();
        move || client.barrier("b", Members::World, Some(BARRIER_TIMEOUT))
    });
    let call = agent.arrival(1).await;
    agent.send(ServerFrame::Reply { id: call, reply: Err(lost()) }).await;
    let adding = tokio::task::spawn_blocking({
        let client = client.clone();
        move || client.add("k", 7)
    });
    agent.answer_add().await;
    assert_eq!(bounded(adding).await.expect("thread").expect("add"), 7);
    waiting
}

/// A released round takes a request id and registers nothing: no reply slot waits
/// while the rank waits in the channel, nor after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_round_registers_no_reply() {
    let (client, agent, _dir) = seated_async().await;
    for round in 1..=3 {
        let waiting = spawn_barrier(&client);
        agent.arrival(round).await;
        assert!(client.link().registered().is_empty(), "a call waiting in the channel registered a reply slot");
        agent.finish(round, Outcome::Released);
        bounded(waiting).await.expect("task").expect("a released round");
    }
    assert!(client.link().registered().is_empty());
}

/// The one channel the seated client mapped, as this process watches it.
fn watched_of(client: &Client) -> Arc<Watched> {
    let state = client.link().channels.lock();
    let live: Vec<_> = state.live.iter().filter_map(std::sync::Weak::upgrade).collect();
    assert_eq!(live.len(), 1, "one channel mapped");
    Arc::clone(&live[0].watched)
}

/// Waits until a call is asleep on the release bell.
async fn asleep_on_the_bell(agent: &Agent) {
    bounded(async {
        while agent.channel.bell_sleepers() == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
}

/// An async call asleep in the channel is woken by the release bell through its
/// connection's runtime: no watcher thread starts, and the bell stops ringing once
/// the call is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_async_call_asleep_in_the_channel_wakes_by_the_release_bell() {
    let (client, agent, _dir) = seated_async().await;
    for round in 1..=3 {
        let waiting = spawn_barrier(&client);
        agent.arrival(round).await;
        asleep_on_the_bell(&agent).await;
        agent.finish(round, Outcome::Released);
        bounded(waiting).await.expect("task").expect("a released round");
        assert_eq!(agent.channel.bell_sleepers(), 0, "round {round}: the call is done, yet counted asleep");
    }
    let watched = watched_of(&client);
    assert!(watched.first.get().is_some_and(|listener| listener.hears()), "no listener, or it stopped");
    assert!(!watched.watcher.is_completed(), "a watcher thread started");
}

/// One async round of the seated client in `runtime`, asleep on the bell before
/// the agent ends it (on a thread of its own, so that the test's runtime drives
/// the agent meanwhile).
async fn round_in(runtime: Arc<tokio::runtime::Runtime>, client: &Client, agent: &Agent, round: u32) {
    let client = client.clone();
    let waiting = std::thread::spawn(move || {
        runtime.block_on(async { client.barrier("b", Members::World, Some(BARRIER_TIMEOUT)).await })
    });
    agent.arrival(round).await;
    asleep_on_the_bell(agent).await;
    agent.finish(round, Outcome::Released);
    let done = bounded(tokio::task::spawn_blocking(move || waiting.join())).await;
    done.expect("task").expect("thread").expect("a released round");
}

/// Calls awaited in other runtimes than their connection's hear the bell through
/// the listener in the connection's runtime, also while the runtime where a call
/// first waited is no longer driven.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_in_other_runtimes_hear_the_bell_through_their_connections_runtime() {
    let (client, agent, _dir) = seated_async().await;
    let runtime = || Arc::new(tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime"));
    let (first, second) = (runtime(), runtime());
    round_in(Arc::clone(&first), &client, &agent, 1).await;
    // The first runtime stays, not driven by anyone from here on.
    round_in(Arc::clone(&second), &client, &agent, 2).await;
    round_in(Arc::clone(&second), &client, &agent, 3).await;
    let watched = watched_of(&client);
    let listener = watched.first.get().expect("a listener");
    assert_eq!(listener.runtime, tokio::runtime::Handle::current().id(), "not in the connection's runtime");
    assert!(listener.hears());
    assert!(watched.others.lock().expect("lock").is_empty());
    assert!(!watched.watcher.is_completed(), "a watcher thread started");
    // Runtimes are dropped where blocking is allowed.
    bounded(tokio::task::spawn_blocking(move || drop((first, second)))).await.expect("dropped");
}

/// A listener whose runtime shuts down says so: the waits it served fall back to
/// the watcher thread, woken to find out.
#[test]
fn a_listener_whose_runtime_is_gone_stops_hearing() {
    let agent = AgentChannel::create(1).expect("a channel");
    let dup = |fd: &OwnedFd| fd.try_clone().expect("dup");
    let watched = Watched::of(&dup(&agent.file), &dup(&agent.doorbell), dup(&agent.bell)).expect("mapped");
    let runtime = || tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    let listening = runtime();
    assert!(watched.listen(listening.handle()).hears(), "a listener starts");
    runtime().block_on(async {
        let moved = watched.moved.notified();
        tokio::pin!(moved);
        moved.as_mut().enable();
        std::thread::spawn(move || drop(listening)).join().expect("dropped");
        bounded(moved).await;
    });
    assert!(!watched.first.get().expect("a listener").hears(), "its runtime is gone, and it did not say so");
}

/// Where no listener can start, an async call asleep in the channel is woken by
/// the watcher thread.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_without_a_listener_is_woken_by_the_watcher_thread() {
    let (client, agent, _dir) = seated_async().await;
    let watched = watched_of(&client);
    watched.refuse_listeners.store(true, Ordering::Relaxed);
    let waiting = spawn_barrier(&client);
    agent.arrival(1).await;
    // The call starts the watcher before it sleeps.
    bounded(async {
        while !watched.watcher.is_completed() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    assert_eq!(agent.channel.bell_sleepers(), 0, "asleep on a bell nobody listens to");
    agent.finish(1, Outcome::Released);
    bounded(waiting).await.expect("task").expect("a released round");
}

/// Barriers named afresh, each called once, go as plain requests and ask for no
/// channel; more of them than a client keeps track of do not cost the seat of the
/// barrier it calls again and again, whose next call still goes through its channel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_used_once_ask_for_no_channel_and_leave_the_seats_alone() {
    let (client, mut agent, _dir) = seated_async().await;
    for step in 0..2 * super::MAX_USES {
        let name = format!("step-{step}");
        let call = {
            let client = client.clone();
            tokio::spawn(async move { client.barrier(&name, Members::World, Some(BARRIER_TIMEOUT)).await })
        };
        match agent.frame().await {
            Some(ClientFrame::Request { id, request: Request::Barrier { .. } }) => {
                agent.send(ServerFrame::Reply { id, reply: Ok(Response::Done) }).await;
            }
            other => panic!("step {step}: expected a plain barrier request, got {other:?}"),
        }
        bounded(call).await.expect("task").unwrap_or_else(|e| panic!("step {step}: {e}"));
    }
    let waiting = spawn_barrier(&client);
    agent.arrival(1).await;
    agent.finish(1, Outcome::Released);
    bounded(waiting).await.expect("task").expect("a released round through the seat");
    assert!(agent.left.is_empty(), "no seat was given back: {:?}", agent.left);
}

/// A client whose second call of barrier `b`, asking for a channel, its caller
/// dropped unanswered (`answer_first`: after the agent gave it slot 0 of one); with
/// the agent, that call's request id, and the socket's directory.
async fn dropped_while_asking(answer_first: bool) -> (Client, Agent, u64, SocketDir) {
    let (listener, addr, dir) = listen().await;
    let calling = async {
        let client = Client::connect_with(options(&addr)).await.expect("connect");
        client.barrier("b", Members::World, Some(BARRIER_TIMEOUT)).await.expect("the first call");
        let asking = client.barrier("b", Members::World, Some(BARRIER_TIMEOUT));
        let dropped = tokio::time::timeout(Duration::from_millis(200), asking).await;
        assert!(dropped.is_err(), "no reply came: {dropped:?}");
        client
    };
    let accepting = async {
        let (mut agent, id) = Agent::accept_until_attach(&listener).await;
        if answer_first {
            agent.give_channel(id).await;
        }
        (agent, id)
    };
    let (client, (agent, id)) = tokio::join!(calling, accepting);
    (client, agent, id, dir)
}

/// A call asking for a channel that its caller drops (a timeout of its own) gives
/// the slot it was given back, whether the answer came before it was dropped or
/// after; the barrier's next call asks again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_dropped_while_asking_for_a_channel_gives_its_slot_back() {
    for answer_first in [true, false] {
        let (client, mut agent, id, _dir) = dropped_while_asking(answer_first).await;
        if !answer_first {
            agent.give_channel(id).await;
        }
        // The next call asks again.
        let next = spawn_barrier(&client);
        match agent.frame().await {
            Some(ClientFrame::AttachBarrier { id, .. }) => {
                agent.send(ServerFrame::NoBarrierChannel { id, reason: "not again".to_owned() }).await;
                agent.send(ServerFrame::Reply { id, reply: Ok(Response::Done) }).await;
            }
            other => panic!("answer first {answer_first}: expected the next call to ask, got {other:?}"),
        }
        bounded(next).await.expect("task").expect("the next call");
        drop(client);
        while agent.frame().await.is_some() {}
        assert_eq!(agent.left, [(1, 0)], "answer first {answer_first}: the slot given back");
    }
}

/// The agent answers a dropped call's request for a channel only after the
/// barrier's next call asked again, which gets another slot of the same channel
/// without its files (the agent has not read a leave yet): the client kept the
/// mapping for it, uses the new slot, and gives the first one back only then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_given_back_while_an_answer_is_due_keeps_the_files_for_it() {
    let (client, mut agent, first, _dir) = dropped_while_asking(false).await;
    let again = spawn_barrier(&client);
    let second = match agent.frame().await {
        Some(ClientFrame::AttachBarrier { id, .. }) => id,
        other => panic!("expected the next call to ask again, got {other:?}"),
    };
    // Slot 0 (with the files) for the dropped call, slot 1 (without) for this one.
    agent.give_channel(first).await;
    agent.send(ServerFrame::BarrierChannel { id: second, channel: 1, slot: 1 }).await;
    agent.send(ServerFrame::Reply { id: second, reply: Ok(Response::Done) }).await;
    bounded(again).await.expect("task").expect("the call given slot 1");
    // The next call arrives in slot 1.
    let next = spawn_barrier(&client);
    bounded(async {
        while agent.channel.arrival(1, 0).is_none() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    agent.channel.finish(1, 1, Outcome::Released);
    agent.channel.release();
    bounded(next).await.expect("task").expect("a round through slot 1");
    drop(client);
    while agent.frame().await.is_some() {}
    assert_eq!(agent.left, [(1, 0)], "the dropped call's slot given back");
}

/// A request for a channel whose call gave up, answered by its reply alone (an
/// agent that could not read it answers `Invalid`), leaves no answer due: a seat
/// given back later goes back at once, not with the connection's end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attach_answered_by_its_reply_alone_holds_no_leave_back() {
    let (client, mut agent, dropped, _dir) = dropped_while_asking(false).await;
    let invalid = OpError::Invalid("cannot read it".to_owned());
    agent.send(ServerFrame::Reply { id: dropped, reply: Err(invalid) }).await;
    // The next call asks again and is seated; a call through the seat is dropped.
    let again = spawn_barrier(&client);
    match agent.frame().await {
        Some(ClientFrame::AttachBarrier { id, .. }) => {
            agent.give_channel(id).await;
            agent.send(ServerFrame::Reply { id, reply: Ok(Response::Done) }).await;
        }
        other => panic!("expected the next call to ask again, got {other:?}"),
    }
    bounded(again).await.expect("task").expect("seated");
    let waiting = spawn_barrier(&client);
    agent.arrival(1).await;
    waiting.abort();
    let _ = waiting.await;
    bounded(async {
        while agent.left.is_empty() {
            let _ = tokio::time::timeout(Duration::from_millis(10), agent.frame()).await;
        }
    })
    .await;
    assert_eq!(agent.left, [(1, 0)], "the dropped call's seat given back");
}

/// A barrier call in the caller's thread that asks `interrupt_at`'s check (true from
/// its `n`-th question on, counted in `asked`), as a task.
fn spawn_in_thread(
    client: &Client,
    asked: &Arc<AtomicU32>,
    interrupt_at: u32,
) -> tokio::task::JoinHandle<crate::InThread> {
    let (client, asked) = (client.clone(), Arc::clone(asked));
    tokio::task::spawn_blocking(move || {
        let mut check = || asked.fetch_add(1, Ordering::Relaxed) + 1 >= interrupt_at;
        let interrupt = crate::Interrupt { every: Duration::from_millis(5), check: &mut check };
        client.barrier_in_thread("b", &Members::World, Some(BARRIER_TIMEOUT), Some(interrupt))
    })
}

/// A call waiting in its thread asks its interrupt between slices and goes on
/// while it says no: the round's release ends it as any call's does, seat kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_in_thread_asks_its_interrupt_and_waits_on() {
    let (client, mut agent, _dir) = seated_async().await;
    let asked = Arc::new(AtomicU32::new(0));
    let waiting = spawn_in_thread(&client, &asked, u32::MAX);
    agent.arrival(1).await;
    bounded(async {
        while asked.load(Ordering::Relaxed) < 3 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    agent.finish(1, Outcome::Released);
    match bounded(waiting).await.expect("thread") {
        crate::InThread::Done(outcome) => outcome.expect("a released round"),
        _ => panic!("the call did not end in its thread"),
    }
    // The seat is kept: the next call arrives in it, in round 2.
    let next = spawn_in_thread(&client, &asked, u32::MAX);
    agent.arrival(2).await;
    agent.finish(2, Outcome::Released);
    assert!(matches!(bounded(next).await.expect("thread"), crate::InThread::Done(Ok(()))));
    drop(client);
    while agent.frame().await.is_some() {}
    assert!(agent.left.is_empty(), "a seat was given back: {:?}", agent.left);
}

/// A call waiting in its thread whose interrupt says yes gives up at once (its
/// round still going on), and gives its seat back as a dropped async call does:
/// the barrier's next call asks the agent for a channel again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_in_thread_interrupted_gives_its_seat_back() {
    let (client, mut agent, _dir) = seated_async().await;
    let asked = Arc::new(AtomicU32::new(0));
    let waiting = spawn_in_thread(&client, &asked, 3);
    agent.arrival(1).await;
    assert!(matches!(bounded(waiting).await.expect("thread"), crate::InThread::Interrupted));
    assert_eq!(asked.load(Ordering::Relaxed), 3, "asked until it said yes, and no more");
    bounded(async {
        while agent.left.is_empty() {
            let _ = tokio::time::timeout(Duration::from_millis(10), agent.frame()).await;
        }
    })
    .await;
    assert_eq!(agent.left, [(1, 0)], "the interrupted call's seat given back");
    let next = spawn_in_thread(&client, &asked, u32::MAX);
    assert!(matches!(bounded(next).await.expect("thread"), crate::InThread::Elsewhere), "no seat is held now");
}

/// The agent sends a failed round's error before the rank wakes to see the
/// failure: the connection keeps the reply for the call, which finds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocking_call_finds_the_error_that_came_before_it_looked() {
    let (client, mut agent, _dir) = seated_blocking().await;
    let waiting = blocking_call_whose_error_was_read(&client, &mut agent).await;
    agent.finish(1, Outcome::Failed);
    assert_lost(bounded(waiting).await.expect("thread"));
}

/// As above, for an async call (woken by the channel's watcher thread).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_async_call_finds_the_error_that_came_before_it_looked() {
    let (client, mut agent, _dir) = seated_async().await;
    let waiting = spawn_barrier(&client);
    let call = agent.arrival(1).await;
    agent.send(ServerFrame::Reply { id: call, reply: Err(lost()) }).await;
    let adding = tokio::spawn({
        let client = client.clone();
        async move { client.add("k", 7).await }
    });
    agent.answer_add().await;
    assert_eq!(bounded(adding).await.expect("task").expect("add"), 7);
    agent.finish(1, Outcome::Failed);
    assert_lost(bounded(waiting).await.expect("task"));
}

/// The agent marks the round failed first and sends the error only once the
/// call looked for it (and found nothing): the call waits for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_waits_for_the_error_that_comes_after_it_looked() {
    let (client, mut agent, _dir) = seated_async().await;
    let waiting = spawn_barrier(&client);
    let call = agent.arrival(1).await;
    agent.finish(1, Outcome::Failed);
    let link = client.link();
    bounded(async {
        while !link.registered().contains(&call) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    agent.send(ServerFrame::Reply { id: call, reply: Err(lost()) }).await;
    assert_lost(bounded(waiting).await.expect("task"));
}

/// The connection ends while the rank waits in the channel: with the round's
/// error read before the end, that error is the outcome; without, the call is
/// told the connection ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_ending_during_a_wait_gives_what_came_before_it() {
    let (client, mut agent, _dir) = seated_blocking().await;
    let waiting = tokio::task::spawn_blocking({
        let client = client.clone();
        move || client.barrier("b", Members::World, Some(BARRIER_TIMEOUT))
    });
    let call = agent.arrival(1).await;
    agent.send(ServerFrame::Reply { id: call, reply: Err(lost()) }).await;
    drop(agent);
    assert_lost(bounded(waiting).await.expect("thread"));

    let (client, agent, _dir) = seated_blocking().await;
    let waiting = tokio::task::spawn_blocking({
        let client = client.clone();
        move || client.barrier("b", Members::World, Some(BARRIER_TIMEOUT))
    });
    agent.arrival(1).await;
    drop(agent);
    match bounded(waiting).await.expect("thread") {
        Err(Error::Disconnected(why)) => assert!(why.contains("ended during a barrier"), "{why}"),
        other => panic!("expected Disconnected, got {other:?}"),
    }
    drop(client);
}

/// A reply on the socket stops a wait in the channel even though the slot never
/// says the round ended (an agent answering the call otherwise): an async call at
/// once, a blocking one at its next wake-up (here, a release of other rounds). The
/// seat is not trusted again: its slot is given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_without_the_slots_mark_stops_the_wait() {
    let (client, mut agent, _dir) = seated_async().await;
    let waiting = spawn_barrier(&client);
    let call = agent.arrival(1).await;
    agent.send(ServerFrame::Reply { id: call, reply: Err(lost()) }).await;
    assert_lost(bounded(waiting).await.expect("task"));
    drop(client);
    while agent.frame().await.is_some() {}
    assert_eq!(agent.left, [(1, 0)], "the slot given back");

    let (client, mut agent, _dir) = seated_blocking().await;
    let waiting = blocking_call_whose_error_was_read(&client, &mut agent).await;
    agent.channel.release();
    assert_lost(bounded(waiting).await.expect("thread"));
}

/// Accepts the rank's next connection and welcomes it as `session`; returns the
/// scripted agent and the session the hello asked to resume.
async fn accept_again(listener: &Listener, session: u64) -> (Agent, Option<SessionId>) {
    let stream = bounded(listener.accept()).await.expect("accept");
    let (reader, writer) = stream.into_split();
    let channel = AgentChannel::create(2).expect("a channel");
    let mut agent = Agent { reader, writer, buf: BytesMut::new(), files: VecDeque::new(), channel, left: Vec::new() };
    while decode_preamble(&mut agent.buf).expect("preamble").is_none() {
        agent.read().await;
    }
    let resume = match agent.frame().await {
        Some(ClientFrame::Hello(identity)) => identity.resume,
        other => panic!("expected a hello, got {other:?}"),
    };
    let welcome = Welcome { session: SessionId(session), lease_ms: 0, job_incarnation: None };
    agent.send(ServerFrame::Welcome(welcome)).await;
    (agent, resume)
}

/// The connection is cut while the rank waits in the channel (the coordinator may
/// have counted its arrival): the call is sent again as a request with its id on the
/// resumed session and takes the reply that comes there, async or blocking, and the
/// barrier's next call asks for a channel again; if the session is not resumed, the
/// call fails saying its outcome is unknown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_cut_in_the_channel_is_sent_again_on_the_resumed_session() {
    for (blocking, resumed) in [(false, true), (true, true), (false, false), (true, false)] {
        let (listener, addr, _dir) = listen().await;
        let connecting = async {
            if blocking {
                let addr = addr.clone();
                let client = tokio::task::spawn_blocking(move || {
                    let client = blocking::Client::connect_with(options(&addr)).expect("connect");
                    client.barrier("b", Members::World, Some(BARRIER_TIMEOUT)).expect("the first call");
                    client.barrier("b", Members::World, Some(BARRIER_TIMEOUT)).expect("the second call");
                    client
                });
                (None, Some(bounded(client).await.expect("connecting")))
            } else {
                let client = Client::connect_with(options(&addr)).await.expect("connect");
                client.barrier("b", Members::World, Some(BARRIER_TIMEOUT)).await.expect("the first call");
                client.barrier("b", Members::World, Some(BARRIER_TIMEOUT)).await.expect("the second call");
                (Some(client), None)
            }
        };
        let ((client, blocking_client), agent) = tokio::join!(connecting, Agent::accept(&listener));
        let barrier = || match (&client, &blocking_client) {
            (Some(client), _) => spawn_barrier(client),
            (_, Some(client)) => {
                let client = client.clone();
                tokio::task::spawn_blocking(move || client.barrier("b", Members::World, Some(BARRIER_TIMEOUT)))
            }
            (None, None) => unreachable!("one client or the other"),
        };
        let waiting = barrier();
        let call = agent.arrival(1).await;
        drop(agent);
        let (mut again, resume) = accept_again(&listener, if resumed { 1 } else { 2 }).await;
        assert_eq!(resume, Some(SessionId(1)), "the hello resumes the session");
        let case = format!("blocking {blocking}, resumed {resumed}");
        if resumed {
            loop {
                match again.frame().await {
                    Some(ClientFrame::TakeSharedReplies) => {}
                    Some(ClientFrame::Request { id, request: Request::Barrier { .. } }) => {
                        assert_eq!(id, call, "{case}: the call is sent again with its id");
                        break;
                    }
                    other => panic!("{case}: expected the barrier call sent again, got {other:?}"),
                }
            }
            again.send(ServerFrame::Reply { id: call, reply: Ok(Response::Done) }).await;
            bounded(waiting).await.expect("task").unwrap_or_else(|e| panic!("{case}: {e}"));
            // The next call of the barrier asks for a channel on this connection.
            let next = barrier();
            match again.frame().await {
                Some(ClientFrame::AttachBarrier { id, request: Request::Barrier { .. } }) => {
                    let reason = "not this time".to_owned();
                    again.send(ServerFrame::NoBarrierChannel { id, reason }).await;
                    again.send(ServerFrame::Reply { id, reply: Ok(Response::Done) }).await;
                }
                other => panic!("{case}: expected the next call to ask for a channel, got {other:?}"),
            }
            bounded(next).await.expect("task").unwrap_or_else(|e| panic!("{case}: the next call: {e}"));
        } else {
            match bounded(waiting).await.expect("task") {
                Err(Error::Disconnected(why)) => {
                    assert!(why.contains("ended during a barrier") && why.contains("unknown"), "{case}: {why}")
                }
                other => panic!("{case}: expected Disconnected, got {other:?}"),
            }
        }
        drop((client, blocking_client));
    }
}
