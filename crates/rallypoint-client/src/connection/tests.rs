//! The reads calls make themselves ([`Link::poll_reply`]), against a scripted
//! coordinator on loopback that answers only once the test has seen who reads:
//! each reply must reach its own call whoever reads it, and a cut or a silence
//! found while a call reads must go through the resume path.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use rallypoint_core::{Identity, Request, Response, SessionId, Welcome};
use rallypoint_proto::native::{
    decode_client_frame, decode_preamble, encode_client_frame, encode_server_frame, ClientFrame, FrameLimits,
    ServerFrame,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::Link;
use crate::{Client, ConnectOptions};

/// The longest any step of these tests waits: a bound, not a timing.
const BOUND: Duration = Duration::from_secs(20);

/// One connection of the scripted coordinator.
struct Conn {
    stream: TcpStream,
    buf: BytesMut,
}

impl Conn {
    /// Accepts a connection and reads its hello.
    async fn accept(listener: &TcpListener) -> (Conn, Identity) {
        let (stream, _) = bounded(listener.accept()).await.expect("accept");
        let mut conn = Conn { stream, buf: BytesMut::new() };
        loop {
            if decode_preamble(&mut conn.buf).expect("preamble").is_some() {
                break;
            }
            conn.read().await;
        }
        match conn.frame().await {
            Some(ClientFrame::Hello(identity)) => (conn, identity),
            other => panic!("expected a hello, got {other:?}"),
        }
    }

    async fn read(&mut self) -> usize {
        bounded(self.stream.read_buf(&mut self.buf)).await.expect("read")
    }

    /// The next frame; `None` once the client closed the connection.
    async fn frame(&mut self) -> Option<ClientFrame> {
        loop {
            if let Some(frame) = decode_client_frame(&mut self.buf, &FrameLimits::unbounded()).expect("a frame") {
                return Some(frame);
            }
            if self.read().await == 0 {
                return None;
            }
        }
    }

    async fn send(&mut self, frame: ServerFrame) {
        let mut out = BytesMut::new();
        encode_server_frame(&frame, &mut out);
        bounded(self.stream.write_all(&out)).await.expect("write");
    }

    async fn welcome(&mut self, session: u64, lease_ms: u64) {
        let welcome = Welcome { session: SessionId(session), lease_ms, job_incarnation: None };
        self.send(ServerFrame::Welcome(welcome)).await;
    }

    /// The next request other than a heartbeat (those are answered).
    async fn request(&mut self) -> (u64, Request) {
        loop {
            match self.frame().await {
                Some(ClientFrame::Request { id, request: Request::Heartbeat }) => {
                    self.send(ServerFrame::Reply { id, reply: Ok(Response::Done) }).await;
                }
                Some(ClientFrame::Request { id, request }) => return (id, request),
                other => panic!("expected a request, got {other:?}"),
            }
        }
    }

    /// Answers an add with its delta times ten: each call can tell its own reply.
    async fn answer(&mut self, id: u64, request: &Request) {
        let Request::Add { delta, .. } = request else { panic!("expected an add, got {request:?}") };
        self.send(ServerFrame::Reply { id, reply: Ok(Response::Int(delta * 10)) }).await;
    }
}

async fn bounded<F: std::future::Future>(future: F) -> F::Output {
    tokio::time::timeout(BOUND, future).await.expect("a step of the test took too long")
}

/// Waits until call `id` reads the socket itself.
async fn until_reading(link: &Link, id: u64) {
    until(link, |side| side.call == std::num::NonZeroU64::new(id)).await;
}

/// Waits until the link's read side is as `ready` says.
async fn until(link: &Link, ready: impl Fn(&super::ReadSide) -> bool) {
    let waited = tokio::time::timeout(BOUND, async {
        while !ready(&link.lock_read()) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    if waited.is_err() {
        let side = link.lock_read();
        let calls: Vec<u64> = link.lock().calls.keys().copied().collect();
        panic!("the read side never got there: reading call {:?}, calls {calls:?}", side.call);
    }
}

async fn listen() -> (TcpListener, String) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("address").to_string();
    (listener, addr)
}

async fn client(addr: &str) -> Client {
    let options = ConnectOptions::new(addr, Identity::ranked("job", 0, 1)).with_timeout(BOUND);
    Client::connect_with(options).await.expect("connect")
}

/// Connects a client and says welcome with `lease_ms`; returns both ends.
async fn connected(lease_ms: u64) -> (TcpListener, Client, Conn) {
    let (listener, addr) = listen().await;
    let (client, (conn, identity)) = tokio::join!(client(&addr), async {
        let (mut conn, identity) = Conn::accept(&listener).await;
        conn.welcome(1, lease_ms).await;
        (conn, identity)
    });
    assert_eq!(identity.resume, None);
    // The task hands the read half over once it runs: a call before that is read
    // for by the task.
    until(client.link(), |side| side.reader.is_some()).await;
    (listener, client, conn)
}

fn spawn_add(client: &Client, delta: i64) -> tokio::task::JoinHandle<i64> {
    let client = client.clone();
    tokio::spawn(async move { client.add("k", delta).await.expect("add") })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_call_reads_its_own_reply() {
    let (_listener, client, mut conn) = connected(0).await;
    let link = Arc::clone(client.link());
    for delta in 1..=20 {
        let call = spawn_add(&client, delta);
        let (id, request) = conn.request().await;
        until_reading(&link, id).await;
        // A reply for no call waiting (as after a local timeout) goes nowhere.
        conn.send(ServerFrame::Reply { id: id + 1_000_000, reply: Ok(Response::Int(-1)) }).await;
        conn.answer(id, &request).await;
        assert_eq!(bounded(call).await.expect("the call"), delta * 10);
    }
    // Every reply went straight to its call, none through the task.
    assert_eq!(link.own_replies.load(Ordering::Relaxed), 20);
    drop(client);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reading_call_whose_deadline_passes_times_out_and_the_next_reads_its_own() {
    let (_listener, client, mut conn) = connected(0).await;
    let link = Arc::clone(client.link());
    // A call as the client makes one, with a short deadline of its own (a client's
    // calls wait their timeout and a margin).
    let request = Request::Add { key: "k".into(), delta: 1 };
    let (id, reply, written) = link.call(request, Duration::from_millis(300)).expect("register");
    assert!(matches!(reply, super::CallReply::Own), "a lone call waits in the link's own cell");
    assert!(matches!(written, super::DirectWrite::Written));
    let late = tokio::spawn({
        let link = Arc::clone(&link);
        async move { super::WaitReply::new(&link, id, reply).await }
    });
    let (seen, request) = conn.request().await;
    assert_eq!(seen, id);
    until_reading(&link, id).await;
    // Unanswered: the deadline passes while the call reads, with nothing to read.
    let outcome = bounded(late).await.expect("the call");
    assert!(matches!(outcome, Ok(Err(crate::Error::Timeout(_)))), "{outcome:?}");
    // The next call reads the socket itself; the late reply comes first and goes
    // nowhere, then its own. (Sent once it reads: sent before, the task may be
    // reading the late reply when the call looks, and the call then waits for the
    // task, as it should, but not as this test means to show.)
    let call = spawn_add(&client, 2);
    let (next, next_request) = conn.request().await;
    until_reading(&link, next).await;
    conn.answer(id, &request).await;
    conn.answer(next, &next_request).await;
    assert_eq!(bounded(call).await.expect("the call"), 20);
    assert_eq!(link.own_replies.load(Ordering::Relaxed), 1);
    drop(client);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_made_one_at_a_time_wait_in_the_links_own_cell() {
    let (_listener, client, mut conn) = connected(0).await;
    let link = Arc::clone(client.link());
    let own = || link.lock().own_call.map(std::num::NonZeroU64::get);
    for delta in 1..=5 {
        let call = spawn_add(&client, delta);
        let (id, request) = conn.request().await;
        assert_eq!(own(), Some(id), "the lone call waits in the link's own cell");
        conn.answer(id, &request).await;
        assert_eq!(bounded(call).await.expect("the call"), delta * 10);
        assert_eq!(own(), None, "the done call left the cell free");
    }
    // A call given up while registered: its wait, dropped, freed the cell. Its late
    // reply must reach no later call.
    let held = client.clone();
    let given_up = tokio::spawn(async move { held.add("k", 6).await });
    let (late_id, late_request) = conn.request().await;
    given_up.abort();
    assert!(bounded(given_up).await.expect_err("aborted").is_cancelled());
    assert!(link.lock().calls.is_empty(), "the given-up call is forgotten");
    assert_eq!(own(), None, "the given-up call left the cell free");
    let call = spawn_add(&client, 7);
    let (id, request) = conn.request().await;
    assert_eq!(own(), Some(id));
    conn.answer(late_id, &late_request).await;
    conn.answer(id, &request).await;
    assert_eq!(bounded(call).await.expect("the call after"), 70);
    // Calls in flight together: the first holds the cell, the others wait in cells
    // of their own, and each gets its own reply whatever the order.
    let calls: Vec<_> = (1..=3).map(|delta| spawn_add(&client, delta)).collect();
    let mut requests = Vec::new();
    for _ in 0..3 {
        requests.push(conn.request().await);
    }
    assert!(own().is_some_and(|id| requests.iter().any(|(seen, _)| *seen == id)));
    for (id, request) in requests.iter().rev() {
        conn.answer(*id, request).await;
    }
    let mut sums = Vec::new();
    for call in calls {
        sums.push(bounded(call).await.expect("a call in flight"));
    }
    assert_eq!(sums, [10, 20, 30]);
    assert_eq!(own(), None);
    // The cells of the overlapping calls are kept for the next ones that need one.
    let spare = super::lock(&link.spare).as_ref().map(Arc::as_ptr).expect("a cell kept");
    let (first, second) = (spawn_add(&client, 4), spawn_add(&client, 5));
    let (a, b) = (conn.request().await, conn.request().await);
    assert_eq!(super::lock(&link.spare).as_ref().map(Arc::as_ptr), None, "the second call took the kept cell");
    conn.answer(a.0, &a.1).await;
    conn.answer(b.0, &b.1).await;
    assert_eq!((bounded(first).await.expect("a call"), bounded(second).await.expect("a call")), (40, 50));
    assert_eq!(super::lock(&link.spare).as_ref().map(Arc::as_ptr), Some(spare), "and it is kept again");
    drop(client);
}

/// A reply body that says when it is dropped, as a shared reply's does (its drop
/// tells the agent the slab is free).
struct Watched(Arc<std::sync::atomic::AtomicBool>, Vec<u8>);

impl AsRef<[u8]> for Watched {
    fn as_ref(&self) -> &[u8] {
        &self.1
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_its_call_never_took_goes_with_its_wait() {
    let (_listener, client, _conn) = connected(0).await;
    let link = Arc::clone(client.link());
    let (id, reply) = link.open_call(BOUND).expect("register");
    let wait = super::WaitReply::new(&link, id, reply);
    // The reply reaches the call's slot, and the call is dropped (a select!, a
    // timeout around it) before it polls again.
    let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let body = bytes::Bytes::from_owner(Watched(Arc::clone(&dropped), vec![7; 1 << 20]));
    link.complete(id, Ok(Response::Value(body)), None);
    drop(wait);
    assert!(dropped.load(Ordering::SeqCst), "the reply nobody will take is still held (in the link's own cell)");
    assert!(link.lock().own_call.is_none(), "the cell is free for the next call");
    drop(client);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_pipelined_behind_a_reading_call_are_read_for_by_the_task() {
    let (_listener, client, mut conn) = connected(0).await;
    let link = Arc::clone(client.link());
    for round in 0..5i64 {
        // The first call reads; the others come while it does.
        let first = spawn_add(&client, round * 100);
        let (first_id, first_request) = conn.request().await;
        until_reading(&link, first_id).await;
        let others: Vec<_> = (1..=40).map(|i| (round * 100 + i, spawn_add(&client, round * 100 + i))).collect();
        let mut requests = Vec::new();
        for _ in 0..others.len() {
            requests.push(conn.request().await);
        }
        // Registered before they were written: reading is the task's again.
        assert_eq!(link.lock_read().call, None);
        // Answered in reverse, the first call's last.
        for (id, request) in requests.iter().rev() {
            conn.answer(*id, request).await;
        }
        conn.answer(first_id, &first_request).await;
        for (delta, call) in others {
            assert_eq!(bounded(call).await.expect("a pipelined call"), delta * 10);
        }
        assert_eq!(bounded(first).await.expect("the first call"), round * 1000);
        // Then a lone call again reads its own.
        let lone = spawn_add(&client, -1);
        let (id, request) = conn.request().await;
        until_reading(&link, id).await;
        conn.answer(id, &request).await;
        assert_eq!(bounded(lone).await.expect("a lone call"), -10);
    }
    // The lone calls' own replies.
    assert_eq!(link.own_replies.load(Ordering::Relaxed), 5);
    drop(client);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reading_call_held_unpolled_holds_up_no_other_call() {
    let (_listener, client, mut conn) = connected(0).await;
    let link = Arc::clone(client.link());
    let held = client.clone();
    let mut first = Box::pin(async move { held.add("k", 1).await });
    // Polled once: it writes its request and reads; then held, not polled.
    tokio::select! {
        biased;
        _ = &mut first => panic!("the call finished before its reply"),
        () = std::future::ready(()) => {}
    }
    let (first_id, first_request) = conn.request().await;
    until_reading(&link, first_id).await;
    // Another call of the same task: its reply must not wait for the first.
    let answer = async {
        let (id, request) = conn.request().await;
        conn.answer(id, &request).await;
    };
    let (second, ()) = bounded(async { tokio::join!(client.add("k", 2), answer) }).await;
    assert_eq!(second.expect("the second call"), 20);
    conn.answer(first_id, &first_request).await;
    assert_eq!(bounded(first).await.expect("the first call"), 10);
    drop(client);
}

/// Counts its wake-ups: a waker the test polls with by hand.
#[derive(Default)]
struct Woken(std::sync::atomic::AtomicUsize);

impl std::task::Wake for Woken {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// A reading call polled again with another waker (its future moved to another
/// task, or polled under another combinator) is woken through that one when its
/// reply comes, not through the waker it first read with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reading_call_polled_with_another_waker_is_woken_through_it() {
    use std::future::Future;
    use std::task::{Context, Poll, Waker};
    let (_listener, client, mut conn) = connected(0).await;
    let link = Arc::clone(client.link());
    let (id, reply, _) = link.call(Request::Add { key: "k".into(), delta: 3 }, BOUND).expect("a call");
    let mut wait = std::pin::pin!(super::WaitReply::new(&link, id, reply));
    let (first, second) = (Arc::new(Woken::default()), Arc::new(Woken::default()));
    let (first_waker, second_waker) = (Waker::from(Arc::clone(&first)), Waker::from(Arc::clone(&second)));
    let (seen, request) = conn.request().await;
    assert_eq!(seen, id);
    assert!(wait.as_mut().poll(&mut Context::from_waker(&first_waker)).is_pending());
    assert_eq!(link.lock_read().call, std::num::NonZeroU64::new(id), "the lone call reads");
    // Polled again before its reply, by someone else: it still reads.
    assert!(wait.as_mut().poll(&mut Context::from_waker(&second_waker)).is_pending());
    assert_eq!(link.lock_read().call, std::num::NonZeroU64::new(id));
    conn.answer(id, &request).await;
    bounded(async {
        while second.0.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    assert_eq!(first.0.load(Ordering::SeqCst), 0, "the reply woke the waker the call no longer polls with");
    match wait.as_mut().poll(&mut Context::from_waker(&second_waker)) {
        Poll::Ready(Ok(Ok(Response::Int(30)))) => {}
        other => panic!("expected the call's reply, got {other:?}"),
    }
    assert_eq!(link.own_replies.load(Ordering::Relaxed), 1, "the call read its own reply");
    drop(client);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_found_by_a_reading_call_resumes_the_session_and_resends() {
    let (listener, client, mut conn) = connected(0).await;
    let link = Arc::clone(client.link());
    let call = spawn_add(&client, 7);
    let (id, request) = conn.request().await;
    until_reading(&link, id).await;
    drop(conn);
    let (mut again, identity) = Conn::accept(&listener).await;
    assert_eq!(identity.resume, Some(SessionId(1)), "the client resumes its session");
    again.welcome(1, 0).await;
    // The same request again, under the same id.
    let (resent_id, resent) = again.request().await;
    assert_eq!((resent_id, &resent), (id, &request));
    again.answer(id, &resent).await;
    assert_eq!(bounded(call).await.expect("the call"), 70);
    assert_eq!(link.ends_found_by_calls.load(Ordering::Relaxed), 1, "the reading call found the cut");
    // The new connection serves lone calls the same way.
    let call = spawn_add(&client, 8);
    let (id, request) = again.request().await;
    until_reading(&link, id).await;
    again.answer(id, &request).await;
    assert_eq!(bounded(call).await.expect("the call"), 80);
    drop(client);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_in_flight_at_a_cut_are_resent_as_they_were_written() {
    let (listener, client, mut conn) = connected(0).await;
    let link = Arc::clone(client.link());
    // The first waits in the link's own cell, the others in cells of their own; a
    // long key makes a frame too large to keep as it is (its request is kept).
    let keys = ["k".to_owned(), "long".repeat(30), "k2".to_owned()];
    let calls: Vec<_> = keys
        .iter()
        .enumerate()
        .map(|(at, key)| {
            let (client, key) = (client.clone(), key.clone());
            let delta = i64::try_from(at).expect("small") + 1;
            tokio::spawn(async move { client.add(key, delta).await.expect("add") })
        })
        .collect();
    let mut written = Vec::new();
    for _ in &keys {
        written.push(conn.request().await);
    }
    assert!(link.lock().own_call.is_some(), "one call waits in the link's own cell");
    drop(conn);
    let (mut again, identity) = Conn::accept(&listener).await;
    assert_eq!(identity.resume, Some(SessionId(1)));
    again.welcome(1, 0).await;
    let mut resent = Vec::new();
    for _ in &keys {
        resent.push(again.request().await);
    }
    // In the order first sent, under the same ids, byte for byte the same requests.
    written.sort_by_key(|(id, _)| *id);
    assert_eq!(resent, written);
    for (id, request) in &resent {
        again.answer(*id, request).await;
    }
    let mut sums = Vec::new();
    for call in calls {
        sums.push(bounded(call).await.expect("a call in flight at the cut"));
    }
    assert_eq!(sums, [10, 20, 30]);
    assert_eq!(link.lock().own_call, None);
    drop(client);
}

/// What the task writes for the calls (over TLS, or while it is writing) is kept
/// as what a call writes itself is: a request's own frame, wherever it lies in the
/// write, or the request as it is when it went as another kind of frame.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_the_task_writes_are_kept_to_be_sent_again() {
    let (_listener, client, _conn) = connected(0).await;
    let link = Arc::clone(client.link());
    let (own, own_reply) = link.open_call(BOUND).expect("a call");
    assert!(matches!(own_reply, super::CallReply::Own));
    let (celled, _reply) = link.register(BOUND).expect("a call");
    let (attached, _attached_reply) = link.register(BOUND).expect("a call");
    let requests = [
        (own, Request::Add { key: "k".into(), delta: 1 }),
        (celled, Request::Add { key: "long".repeat(40).into(), delta: 2 }),
        (attached, Request::Add { key: "a".into(), delta: 3 }),
    ];
    let mut buf = BytesMut::new();
    encode_client_frame(&ClientFrame::Request { id: 99, request: Request::Heartbeat }, &mut buf);
    let mut written = Vec::new();
    for (id, request) in &requests[..2] {
        let start = buf.len();
        encode_client_frame(&ClientFrame::Request { id: *id, request: request.clone() }, &mut buf);
        written.push((*id, Some(start..buf.len()), request.clone()));
    }
    let (id, request) = &requests[2];
    encode_client_frame(&ClientFrame::AttachBarrier { id: *id, request: request.clone() }, &mut buf);
    written.push((*id, None, request.clone()));
    link.written(&buf, written);
    let unanswered = link.unanswered();
    assert_eq!(unanswered.iter().map(|(id, _)| *id).collect::<Vec<_>>(), [own, celled, attached]);
    for ((id, kept), (_, request)) in unanswered.iter().zip(&requests) {
        let (mut again, mut first) = (BytesMut::new(), BytesMut::new());
        kept.encode(*id, &mut again);
        encode_client_frame(&ClientFrame::Request { id: *id, request: request.clone() }, &mut first);
        assert_eq!(again, first, "call {id} is sent again as the plain request it was");
    }
    link.unregister(own);
    assert_eq!(link.lock().own_call, None, "a call given up frees the link's own cell");
    drop(own_reply);
    drop(client);
}

/// Replies are read into one buffer per thread while a connection holds no part of
/// a frame: what a read leaves of one must go to that connection's own buffer, or
/// the next connection read on the thread would take it (one thread here).
#[tokio::test(flavor = "current_thread")]
async fn part_of_a_reply_stays_with_its_connection() {
    let ((_la, a, mut conn_a), (_lb, b, mut conn_b)) = (connected(0).await, connected(0).await);
    let (link_a, link_b) = (Arc::clone(a.link()), Arc::clone(b.link()));
    let call_a = spawn_add(&a, 1);
    let (id_a, _) = conn_a.request().await;
    let mut frame = BytesMut::new();
    encode_server_frame(&ServerFrame::Reply { id: id_a, reply: Ok(Response::Int(7)) }, &mut frame);
    let (head, tail) = frame.split_at(frame.len() / 2);
    bounded(conn_a.stream.write_all(head)).await.expect("write");
    until(&link_a, |side| side.buf.len() == head.len()).await;
    // Another connection's whole reply, read on the same thread meanwhile.
    let call_b = spawn_add(&b, 2);
    let (id_b, request_b) = conn_b.request().await;
    conn_b.answer(id_b, &request_b).await;
    assert_eq!(bounded(call_b).await.expect("the other call"), 20);
    assert!(link_b.lock_read().buf.is_empty(), "nothing of a frame is left with the other connection");
    bounded(conn_a.stream.write_all(tail)).await.expect("write");
    assert_eq!(bounded(call_a).await.expect("the call whose reply came in parts"), 7);
    assert!(link_a.lock_read().buf.is_empty());
    drop((a, b));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_coordinator_is_noticed_while_a_call_reads() {
    // Heartbeats every 200 ms; four unanswered ones make a cut.
    let (listener, client, mut conn) = connected(600).await;
    let call = spawn_add(&client, 3);
    let (id, request) = conn.request().await;
    // Silent from now on: heartbeats are read and left unanswered.
    let silent = tokio::spawn(async move { while conn.frame().await.is_some() {} });
    let (mut again, identity) = Conn::accept(&listener).await;
    assert_eq!(identity.resume, Some(SessionId(1)), "the client resumes its session");
    again.welcome(1, 600).await;
    let (resent_id, resent) = again.request().await;
    assert_eq!((resent_id, &resent), (id, &request));
    again.answer(id, &resent).await;
    assert_eq!(bounded(call).await.expect("the call"), 30);
    silent.abort();
    drop(client);
}

/// The requests a scripted coordinator saw, in order: whether each was a heartbeat,
/// and when it came.
type Seen = Arc<std::sync::Mutex<Vec<(bool, tokio::time::Instant)>>>;

/// A scripted coordinator that answers every add with `reply` and every heartbeat
/// with Done.
fn answering(mut conn: Conn, reply: Result<Response, rallypoint_core::OpError>) -> (Seen, tokio::task::JoinHandle<()>) {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let task = tokio::spawn({
        let seen = Arc::clone(&seen);
        async move {
            while let Some(frame) = conn.frame().await {
                let ClientFrame::Request { id, request } = frame else { continue };
                let beat = request == Request::Heartbeat;
                seen.lock().expect("seen").push((beat, tokio::time::Instant::now()));
                let reply = if beat { Ok(Response::Done) } else { reply.clone() };
                conn.send(ServerFrame::Reply { id, reply }).await;
            }
        }
    });
    (seen, task)
}

/// Adds back to back for `periods` heartbeat periods of a second; how many were made.
async fn calls_for(client: &Client, periods: f64) -> usize {
    let started = tokio::time::Instant::now();
    let mut made = 0;
    while started.elapsed() < Duration::from_secs_f64(periods) && made < 10_000 {
        let _ = bounded(client.add("k", 1)).await;
        made += 1;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    made
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answered_calls_stand_in_for_heartbeats() {
    // Heartbeats every second, had no call gone out for that long.
    let (_listener, client, conn) = connected(3000).await;
    let (seen, coordinator) = answering(conn, Ok(Response::Int(10)));
    let made = calls_for(&client, 3.5).await;
    let beats = || seen.lock().expect("seen").iter().filter(|(beat, _)| *beat).count();
    assert_eq!(beats(), 0, "no heartbeat while {made} calls went out and were answered");
    // Without calls, heartbeats keep the lease again, the first a period after the
    // last call (half a period more leaves room for a busy machine).
    bounded(async {
        while beats() == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let seen = seen.lock().expect("seen").clone();
    let first = seen.iter().position(|(beat, _)| *beat).expect("a heartbeat");
    let gap = seen[first].1 - seen[first - 1].1;
    assert!(gap < Duration::from_millis(1500), "the first heartbeat came {gap:?} after the last call");
    coordinator.abort();
    drop(client);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_refused_as_invalid_do_not_stand_in_for_heartbeats() {
    // They never reached the lease: heartbeats go on as if no call went out.
    let (_listener, client, conn) = connected(3000).await;
    let invalid = Err(rallypoint_core::OpError::Invalid("a key too long".into()));
    let (seen, coordinator) = answering(conn, invalid);
    let made = calls_for(&client, 3.5).await;
    let beats = seen.lock().expect("seen").iter().filter(|(beat, _)| *beat).count();
    assert!(beats >= 2, "{beats} heartbeats while {made} invalid calls went out");
    coordinator.abort();
    drop(client);
}

#[test]
fn a_heartbeat_is_skipped_only_within_a_period_of_an_answered_call() {
    use super::next_beat;
    use tokio::time::Instant;
    let period = Duration::from_secs(5);
    let now = Instant::now();
    let call = now - Duration::from_secs(2);
    // Calls went out and replies came: the next heartbeat is due a period after the call.
    assert_eq!(next_beat(period, true, Some(call), now), Some(call + period));
    // Nothing came since the last tick: it goes, so that silence is found.
    assert_eq!(next_beat(period, false, Some(call), now), None);
    // The latest call is a period old or older: it goes.
    assert_eq!(next_beat(period, true, Some(now - period), now), None);
    assert_eq!(next_beat(period, true, Some(now - 2 * period), now), None);
    // No call answered yet (or only ones refused as invalid).
    assert_eq!(next_beat(period, true, None, now), None);
}

mod written {
    use bytes::BytesMut;
    use rallypoint_core::Request;
    use rallypoint_proto::native::{encode_client_frame, ClientFrame};

    use super::super::{Written, KEPT_FRAME};

    fn frame(id: u64, request: &Request) -> BytesMut {
        let mut buf = BytesMut::new();
        encode_client_frame(&ClientFrame::Request { id, request: request.clone() }, &mut buf);
        buf
    }

    /// A small frame is kept as it is and the request given back; a large one is
    /// kept as its request; either is sent again as the same bytes.
    #[test]
    fn a_written_request_is_sent_again_as_it_was_written() {
        for (key_len, as_frame) in [(1, true), (KEPT_FRAME - 30, true), (KEPT_FRAME, false), (4096, false)] {
            let request = Request::Add { key: vec![b'k'; key_len].into(), delta: -3 };
            let first = frame(77, &request);
            assert_eq!(first.len() <= KEPT_FRAME, as_frame, "key of {key_len} bytes: a frame of {}", first.len());
            let mut kept = None;
            let back = Written::keep(&mut kept, &first, request.clone());
            assert_eq!(back.as_ref(), as_frame.then_some(&request));
            let kept = kept.expect("kept");
            assert_eq!(matches!(kept, Written::Frame { .. }), as_frame);
            let mut again = BytesMut::new();
            kept.clone().encode(77, &mut again);
            assert_eq!(again, first);
        }
        // A frame kept in place of a longer one keeps only its own bytes.
        let (long, short) =
            (Request::Add { key: "long-key".into(), delta: 1 }, Request::Add { key: "k".into(), delta: 2 });
        let mut kept = None;
        Written::keep(&mut kept, &frame(1, &long), long);
        Written::keep(&mut kept, &frame(2, &short), short.clone());
        let mut again = BytesMut::new();
        kept.expect("kept").encode(2, &mut again);
        assert_eq!(again, frame(2, &short));
    }
}

mod calls {
    use std::collections::HashMap;
    use std::sync::Arc;

    use proptest::prelude::*;
    use tokio::time::Instant;

    use super::super::{Call, Calls, Held, ReplyCell, ReplySlot, Slot};

    fn call(tag: u32) -> Call {
        let cell = Arc::new(ReplyCell::new(Held::waiting()));
        // The tag rides in the limit, so that a replaced call is told from its successor.
        Call {
            slot: Slot::Cell(ReplySlot { cell, sent: true }),
            deadline: Instant::now(),
            limit: std::time::Duration::from_secs(tag.into()),
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u64, u32),
        Remove(u64),
        Take,
    }

    fn op() -> impl Strategy<Value = Op> {
        // Few ids, so that inserting a known id and removing a missing one happen.
        prop_oneof![
            6 => (0u64..6, any::<u32>()).prop_map(|(id, tag)| Op::Insert(id, tag)),
            5 => (0u64..6).prop_map(Op::Remove),
            1 => Just(Op::Take),
        ]
    }

    proptest! {
        /// The calls kept in place and in the map behave as one map would.
        #[test]
        fn calls_behave_as_a_map(ops in proptest::collection::vec(op(), 1..60)) {
            let mut calls = Calls::default();
            let mut model: HashMap<u64, u32> = HashMap::new();
            let tag = |call: &Call| call.limit.as_secs();
            for op in ops {
                match op {
                    Op::Insert(id, t) => {
                        calls.insert(id, call(t));
                        model.insert(id, t);
                    }
                    Op::Remove(id) => {
                        let removed = calls.remove(&id).map(|call| tag(&call));
                        prop_assert_eq!(removed, model.remove(&id).map(u64::from));
                    }
                    Op::Take => {
                        let mut taken: Vec<(u64, u64)> = calls.take().map(|(id, call)| (id, tag(&call))).collect();
                        let mut expected: Vec<(u64, u64)> = model.drain().map(|(id, t)| (id, t.into())).collect();
                        taken.sort_unstable();
                        expected.sort_unstable();
                        prop_assert_eq!(taken, expected);
                    }
                }
                prop_assert_eq!(calls.len(), model.len());
                prop_assert_eq!(calls.is_empty(), model.is_empty());
                let mut held: Vec<(u64, u64)> = calls.iter().map(|(id, call)| (*id, tag(call))).collect();
                let mut expected: Vec<(u64, u64)> = model.iter().map(|(id, t)| (*id, u64::from(*t))).collect();
                held.sort_unstable();
                expected.sort_unstable();
                prop_assert_eq!(held, expected);
                for id in 0..6 {
                    prop_assert_eq!(calls.contains_key(&id), model.contains_key(&id));
                }
            }
        }
    }
}

/// What a lone call touches of its link (its calls, the id counter, the read
/// wake-up, the write side's flag, the read side up to its buffer) lies within the
/// link's first [`super::HOT_LINES`] cache lines, from a line's start: a field put
/// among them, or a part grown, would spread a call over more lines.
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_lone_call_touches_of_its_link_fits_its_first_lines() {
    use std::mem::offset_of;

    use super::{ReadSide, HOT_LINES};
    let (_listener, client, _conn) = connected(0).await;
    let link: &Link = client.link();
    let base = std::ptr::from_ref(link) as usize;
    assert_eq!(base % 64, 0, "the link starts a cache line");
    let side = std::ptr::from_ref(&*link.lock_read()) as usize;
    let hot_end = side + offset_of!(ReadSide, files) - base;
    assert!(hot_end <= HOT_LINES * 64, "a lone call's part of the link ends at byte {hot_end}");
    for (field, at) in [
        ("next_id", offset_of!(Link, next_id)),
        ("reads", offset_of!(Link, reads)),
        ("read_wake", offset_of!(Link, read_wake)),
        ("read_waker", offset_of!(Link, read_waker)),
        ("direct", offset_of!(Link, direct)),
    ] {
        assert!(at < hot_end, "{field} at byte {at}, after the read side's buffer");
    }
    drop(client);
}

#[test]
fn a_heartbeat_tick_that_runs_late_does_not_count_the_coordinator_silent() {
    let period = Duration::from_secs(1);
    let start = tokio::time::Instant::now();
    let heard = start;
    let at = start + period * 2;
    // On time, nothing read: still last heard at the start (silence accrues).
    assert_eq!(super::heard_at(heard, false, at, at + Duration::from_millis(5), period), heard);
    // Something read: heard at the tick.
    assert_eq!(super::heard_at(heard, true, at, at + Duration::from_millis(5), period), at);
    // Run six periods late (this process was stopped): heard now, so no silence of
    // four periods is found for replies that wait unread in the socket.
    let now = at + period * 6;
    let late = super::heard_at(heard, false, at, now, period);
    assert_eq!(late, now);
    assert!(at.saturating_duration_since(late) < period * super::SILENT_BEATS);
}
