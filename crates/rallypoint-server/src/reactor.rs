//! The reactor: one thread with a plain `mio` event loop that serves every PyTorch
//! TCPStore connection of the server and every native rank connection over plain
//! TCP, the way torch's own server runs one libuv loop.
//!
//! Why not a tokio task per connection: a rank, or a torch client, sends one small
//! request and waits for its answer, so a round trip is mostly fixed costs. On a
//! request, a tokio task is woken through the runtime's I/O driver and scheduler
//! (readiness bookkeeping, the run queue, timing statistics); here the thread that
//! returns from `epoll_wait` reads, answers and writes directly. And when one
//! request releases many ranks (the last arrival at a barrier), their replies are
//! written by this same thread from the engine's list (module `rank`), where each
//! would otherwise be queued, its task woken on another thread and polled. These
//! fixed costs decide how close a barrier comes to what the kernel alone costs
//! (figures: docs/BENCHMARKS.md, "Native barrier and its floor").
//!
//! Connections arrive from the tokio side once their handshake is done: a TCPStore
//! client once its first byte showed what it is, a rank once its hello admitted
//! its session. Replies the engine produces later for a TCPStore connection (a WAIT
//! released by another client's SET) are signalled through the connection's
//! outbox, whose waker puts it on the reactor's to-do list; those for a rank are
//! routed to the reactor (see `shared`), which is woken if another thread (the
//! ticker, a node agent's task) produced them.

use std::collections::HashSet;
use std::io;
use std::net::SocketAddr;
use std::panic::{self, AssertUnwindSafe};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Wake, Waker};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use bytes::BytesMut;
use mio::net::TcpStream;
use mio::{Events, Interest, Poll, Token};
use rallypoint_proto::tcpstore::TcpLimits;
use slab::Slab;
use tracing::{debug, error};

use rallypoint_net::budget::Charge;
use rallypoint_net::conn::Buffering;
use rallypoint_net::meter::{Account, Counted};
use rallypoint_net::sync::lock;

use crate::native::log_end;
use crate::rank::{self, RankConn, Scratch};
use crate::shared::{Route, Routed, Shared};
use crate::tcpstore::{self, Conn, Progress};

/// The token of the reactor's own waker; connections use their slab index.
const WAKE: Token = Token(usize::MAX);
/// Reads per connection before others get their turn (a client that floods
/// pipelined requests must not starve the rest).
const MAX_READS_PER_TURN: usize = 16;
/// A connection holding more than this of an unfinished request is streaming one.
const STREAMING: usize = 256 * 1024;
/// Streaming connections served in one pass of the loop; the rest wait for the next.
const BULK_PER_PASS: usize = 2;

/// The handle the tokio side holds: hands connections over, stops the loop.
pub(crate) struct Reactor {
    mailbox: Arc<Mailbox>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// What other threads tell the loop; the loop takes it all at each wake-up.
struct Mailbox {
    inbox: Mutex<Inbox>,
    waker: mio::Waker,
}

#[derive(Default)]
struct Inbox {
    adopt: Vec<(std::net::TcpStream, Account, SocketAddr, BytesMut, Charge)>,
    ranks: Vec<RankConn>,
    /// Connections whose outbox received replies.
    dirty: Vec<usize>,
    stop: bool,
}

impl Mailbox {
    fn lock(&self) -> MutexGuard<'_, Inbox> {
        lock(&self.inbox)
    }

    fn wake(&self) {
        if let Err(error) = self.waker.wake() {
            error!(%error, "cannot wake the TCPStore reactor");
        }
    }
}

/// Wakes the loop for replies routed to its ranks (it takes them at every wake-up).
struct RoutedWaker {
    mailbox: Arc<Mailbox>,
}

impl Wake for RoutedWaker {
    fn wake(self: Arc<Self>) {
        self.mailbox.wake();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.mailbox.wake();
    }
}

/// A connection's outbox waker: puts the connection on the loop's to-do list.
struct ConnWaker {
    mailbox: Arc<Mailbox>,
    key: usize,
}

impl Wake for ConnWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let mut inbox = self.mailbox.lock();
        let first = inbox.dirty.is_empty();
        inbox.dirty.push(self.key);
        drop(inbox);
        // The loop takes the whole list per wake-up: only the first entry needs one.
        if first {
            self.mailbox.wake();
        }
    }
}

impl Reactor {
    /// Starts the loop's thread. Called on the server's runtime: the thread enters
    /// it, so that a closing rank's session can start its process watcher there.
    pub(crate) fn start(shared: Arc<Shared>, limits: TcpLimits, read_timeout: Duration) -> io::Result<Reactor> {
        let poll = Poll::new()?;
        let waker = mio::Waker::new(poll.registry(), WAKE)?;
        let mailbox = Arc::new(Mailbox { inbox: Mutex::default(), waker });
        shared.set_reactor_waker(Waker::from(Arc::new(RoutedWaker { mailbox: Arc::clone(&mailbox) })));
        let runtime = tokio::runtime::Handle::current();
        let thread = thread::Builder::new().name("rallypoint-reactor".into()).spawn({
            let mailbox = Arc::clone(&mailbox);
            move || {
                let _runtime = runtime.enter();
                let stalls = Stalls { timeout: read_timeout, mid_request: HashSet::default(), next_check: None };
                Loop {
                    poll,
                    mailbox,
                    shared,
                    limits,
                    conns: Slab::new(),
                    next_conn: 0,
                    runnable: Vec::new(),
                    dirty: Vec::new(),
                    stalls,
                    scratch: Scratch::default(),
                }
                .run()
            }
        })?;
        Ok(Reactor { mailbox, thread: Mutex::new(Some(thread)) })
    }

    /// Serves the rank connection `conn` from now on; if the server is shutting
    /// down, closes it (its session ends as any connection's does then).
    pub(crate) fn adopt_rank(&self, conn: RankConn) -> io::Result<()> {
        let mut inbox = self.mailbox.lock();
        if inbox.stop {
            drop(inbox);
            drop(conn);
            return Err(io::Error::other("the server is shutting down"));
        }
        inbox.ranks.push(conn);
        drop(inbox);
        self.mailbox.wake();
        Ok(())
    }

    /// Serves the TCPStore client on `stream` from now on; `rbuf` holds the bytes
    /// already read from it, counted in `charge`.
    pub(crate) fn adopt(
        &self,
        stream: Counted<tokio::net::TcpStream>,
        peer: SocketAddr,
        rbuf: BytesMut,
        charge: Charge,
    ) -> io::Result<()> {
        // Leaves tokio's driver; stays non-blocking (and counted).
        let (stream, account) = stream.into_parts();
        let stream = stream.into_std()?;
        let mut inbox = self.mailbox.lock();
        if inbox.stop {
            return Err(io::Error::other("the server is shutting down"));
        }
        inbox.adopt.push((stream, account, peer, rbuf, charge));
        drop(inbox);
        self.mailbox.wake();
        Ok(())
    }

    /// Closes every connection (their sessions count as lost) and ends the thread.
    pub(crate) async fn stop(&self) {
        self.signal_stop();
        let thread = lock(&self.thread).take();
        if let Some(thread) = thread {
            // Joining blocks (for at most one turn of the loop), so not on a runtime worker.
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
    }

    fn signal_stop(&self) {
        self.mailbox.lock().stop = true;
        self.mailbox.wake();
    }
}

impl Drop for Reactor {
    fn drop(&mut self) {
        self.signal_stop();
    }
}

struct Loop {
    poll: Poll,
    mailbox: Arc<Mailbox>,
    shared: Arc<Shared>,
    limits: TcpLimits,
    conns: Slab<Entry>,
    /// The number the next connection gets (see [`Route`]).
    next_conn: u64,
    /// Connections to service in this turn.
    runnable: Vec<usize>,
    /// The mailbox's dirty list, taken: it trades places with the mailbox's at
    /// each wake-up, so that neither is grown afresh every round (a round wakes
    /// every rank waiting on it, and growing a list that long reallocates it
    /// several times, each time going through the allocator's freed chunks).
    dirty: Vec<usize>,
    stalls: Stalls,
    scratch: Scratch,
}

/// Connections holding part of a request, checked for the read timeout. The loop
/// has no timer of its own while none does: it wakes for these checks only.
struct Stalls {
    timeout: Duration,
    mid_request: HashSet<usize, foldhash::fast::RandomState>,
    next_check: Option<std::time::Instant>,
}

impl Stalls {
    /// How often the connections mid-request are checked: a fraction of the timeout,
    /// so that one is closed at most that much late.
    fn interval(&self) -> Duration {
        (self.timeout / 4).clamp(Duration::from_millis(10), Duration::from_secs(1))
    }
}

struct Entry {
    conn: Served,
    waker: Waker,
    /// The connection's number (see [`Route`]).
    id: u64,
    /// A rank's socket is watched for writability only while a write waits.
    writable: bool,
}

/// The two kinds of connection the loop serves.
enum Served {
    Torch(Conn),
    Rank(RankConn),
}

/// How a connection ended, for the log.
enum Ended {
    Torch(Result<(), tcpstore::End>),
    Rank(rallypoint_net::conn::End),
    /// It panicked (logged, and its session dropped).
    Panicked,
}

impl Loop {
    fn run(mut self) {
        let mut events = Events::with_capacity(1024);
        // One read buffer for the whole loop.
        let mut read_buf = vec![0u8; Buffering::TORCH.chunk];
        // Connections whose read budget ran out: serviced again without sleeping.
        let mut again = Vec::new();
        // This turn's connections, traded with `runnable` (each keeps its capacity,
        // as `dirty` does).
        let mut serving = Vec::new();
        loop {
            let timeout = if again.is_empty() {
                self.stalls.next_check.map(|at| at.saturating_duration_since(std::time::Instant::now()))
            } else {
                Some(Duration::ZERO)
            };
            if let Err(error) = self.poll.poll(&mut events, timeout) {
                if error.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                // Without the loop no TCPStore client or plaintext rank is served: say
                // so loudly, refuse new ones, close these.
                error!(%error, "the reactor cannot poll; closing its connections");
                self.mailbox.lock().stop = true;
                return;
            }
            self.runnable.append(&mut again);
            let mut woken = false;
            for event in &events {
                if event.token() == WAKE {
                    woken = true;
                    continue;
                }
                let key = event.token().0;
                if let Some(entry) = self.conns.get_mut(key) {
                    if event.is_readable() || event.is_read_closed() || event.is_error() {
                        let closed = event.is_read_closed() || event.is_error();
                        match &mut entry.conn {
                            Served::Torch(conn) => conn.set_readable(closed),
                            Served::Rank(conn) => conn.set_readable(closed),
                        }
                    }
                    self.runnable.push(key);
                }
            }
            if woken && !self.take_mail() {
                return; // stopping: dropping `self` closes every connection
            }
            let mut bulk = 0;
            let mut deferred = Vec::new();
            std::mem::swap(&mut serving, &mut self.runnable);
            for key in serving.drain(..) {
                // Connections streaming a large request take turns, a few per pass, so
                // that one pass of the loop (what every other connection waits for)
                // stays short however many of them there are. Those deferred go first
                // next pass: each gets its turn.
                if self.is_streaming(key) {
                    if bulk == BULK_PER_PASS {
                        deferred.push(key);
                        continue;
                    }
                    bulk += 1;
                }
                if self.service(key, &mut read_buf) {
                    again.push(key);
                }
                self.deliver();
            }
            deferred.append(&mut again);
            again = deferred;
            self.close_stalled();
        }
    }

    /// Closes the connections that stopped in the middle of a request for longer
    /// than the read timeout, when a check is due.
    fn close_stalled(&mut self) {
        let now = std::time::Instant::now();
        if self.stalls.next_check.is_some_and(|at| at > now) {
            return;
        }
        let timeout = self.stalls.timeout;
        let stalled: Vec<(usize, Ended)> = self
            .stalls
            .mid_request
            .iter()
            .filter_map(|&key| {
                let ended = match &self.conns.get(key)?.conn {
                    Served::Torch(conn) => Ended::Torch(Err(conn.stalled(now, timeout)?)),
                    Served::Rank(conn) => Ended::Rank(conn.stalled(now, timeout)?),
                };
                Some((key, ended))
            })
            .collect();
        for (key, end) in stalled {
            self.close(key, end);
        }
        self.stalls.next_check = (!self.stalls.mid_request.is_empty()).then(|| now + self.stalls.interval());
        self.deliver();
    }

    /// Adopts new connections, queues the dirty ones and takes the replies routed to
    /// ranks; false once told to stop.
    fn take_mail(&mut self) -> bool {
        let (adopt, ranks, stop) = {
            let mut inbox = self.mailbox.lock();
            std::mem::swap(&mut inbox.dirty, &mut self.dirty);
            // `stop` stays set: hand-overs are refused while the connections close.
            (std::mem::take(&mut inbox.adopt), std::mem::take(&mut inbox.ranks), inbox.stop)
        };
        if stop {
            return false;
        }
        self.shared.take_routed(&mut self.scratch.routed);
        self.deliver();
        self.runnable.append(&mut self.dirty);
        for (stream, account, peer, rbuf, charge) in adopt {
            let stream = Counted::from_parts(TcpStream::from_std(stream), account);
            let conn = Conn::new(stream, peer, rbuf, charge, Arc::clone(&self.shared), self.limits);
            self.insert(Served::Torch(conn));
        }
        for conn in ranks {
            self.insert(Served::Rank(conn));
        }
        true
    }

    /// Registers a new connection and queues it for its first service.
    fn insert(&mut self, mut conn: Served) {
        let entry = self.conns.vacant_entry();
        let key = entry.key();
        let (stream, peer, interest) = match &mut conn {
            Served::Torch(conn) => {
                let peer = conn.peer();
                (conn.stream(), peer, Interest::READABLE | Interest::WRITABLE)
            }
            Served::Rank(conn) => {
                let peer = conn.peer();
                (conn.stream(), peer, Interest::READABLE)
            }
        };
        if let Err(error) = self.poll.registry().register(stream, Token(key), interest) {
            debug!(%peer, %error, "cannot watch a connection; closing it");
            return;
        }
        let id = self.next_conn;
        self.next_conn += 1;
        if let Served::Rank(conn) = &conn {
            // From now on its replies come routed. If the session moved on meanwhile,
            // its outbox says so at the first service.
            let route = Route { key, conn: id };
            self.shared.move_to_reactor(conn.session(), conn.outbox(), route);
        }
        let waker = Waker::from(Arc::new(ConnWaker { mailbox: Arc::clone(&self.mailbox), key }));
        entry.insert(Entry { conn, waker, id, writable: false });
        self.runnable.push(key);
    }

    /// Services one connection, closing it when it ends; true if it has more to read.
    /// Whether connection `key` holds a large part of an unfinished request.
    fn is_streaming(&self, key: usize) -> bool {
        self.conns.get(key).is_some_and(|entry| match &entry.conn {
            Served::Torch(conn) => conn.buffered_bytes() > STREAMING,
            Served::Rank(conn) => conn.buffered_bytes() > STREAMING,
        })
    }

    fn service(&mut self, key: usize, read_buf: &mut [u8]) -> bool {
        let Some(Entry { conn, waker, .. }) = self.conns.get_mut(key) else { return false };
        let scratch = &mut self.scratch;
        // A panic (a bug in the engine) costs only this connection, as a panicking
        // tokio task would.
        let served = panic::catch_unwind(AssertUnwindSafe(|| match conn {
            Served::Torch(conn) => match conn.service(read_buf, MAX_READS_PER_TURN, waker) {
                Ok(Progress::Idle) => Ok(false),
                Ok(Progress::More) => Ok(true),
                Ok(Progress::Closed) => Err(Ended::Torch(Ok(()))),
                Err(end) => Err(Ended::Torch(Err(end))),
            },
            Served::Rank(conn) => match conn.service(scratch, MAX_READS_PER_TURN, waker) {
                Ok(rank::Progress::Idle) => Ok(false),
                Ok(rank::Progress::More) => Ok(true),
                Err(end) => Err(Ended::Rank(end)),
            },
        }));
        let end = match served {
            Ok(Ok(more)) => {
                if let Err(end) = self.watch_writes(key) {
                    self.close(key, Ended::Rank(end));
                    return false;
                }
                let Some(Entry { conn, .. }) = self.conns.get(key) else { return false };
                let mid_request = match conn {
                    Served::Torch(conn) => conn.is_mid_request(),
                    Served::Rank(conn) => conn.is_mid_frame(),
                };
                if mid_request {
                    if self.stalls.mid_request.insert(key) && self.stalls.next_check.is_none() {
                        self.stalls.next_check = Some(std::time::Instant::now() + self.stalls.interval());
                    }
                } else {
                    self.stalls.mid_request.remove(&key);
                }
                return more;
            }
            Ok(Err(end)) => end,
            Err(_) => {
                error!("a connection panicked; closing it");
                match conn {
                    Served::Torch(conn) => conn.abandon(),
                    Served::Rank(conn) => conn.abandon(),
                }
                Ended::Panicked
            }
        };
        self.close(key, end);
        false
    }

    /// Writes the replies routed to ranks (a barrier's release) to their connections.
    fn deliver(&mut self) {
        let mut routed = std::mem::take(&mut self.scratch.routed);
        loop {
            for Routed { route, request_id, reply } in routed.drain(..) {
                let Some(Entry { conn: Served::Rank(conn), id, .. }) = self.conns.get_mut(route.key) else { continue };
                // The connection it was for closed, and another one took its slot.
                if *id != route.conn {
                    continue;
                }
                conn.send(std::iter::once((request_id, reply.into())), &mut self.scratch.out);
                if let Err(end) = conn.flush(&mut self.scratch.out).and_then(|_| self.watch_writes(route.key)) {
                    self.close(route.key, Ended::Rank(end));
                }
            }
            // Closing a connection may have routed more: its rank is lost to its peers.
            if self.scratch.routed.is_empty() {
                break;
            }
            std::mem::swap(&mut routed, &mut self.scratch.routed);
        }
        // The drained list keeps its allocation for the next turn: a release routes
        // a reply per waiting rank, and growing a list that size anew every round
        // costs a copy of it per doubling, each into memory not in the cache.
        if routed.capacity() > self.scratch.routed.capacity() {
            self.scratch.routed = routed;
        }
    }

    /// Watches rank `key`'s socket for writability while a write waits, and stops
    /// when none does.
    fn watch_writes(&mut self, key: usize) -> Result<(), rallypoint_net::conn::End> {
        let Some(Entry { conn: Served::Rank(conn), writable, .. }) = self.conns.get_mut(key) else { return Ok(()) };
        let wants = conn.wants_writable();
        if wants == *writable {
            return Ok(());
        }
        let interest = if wants { Interest::READABLE | Interest::WRITABLE } else { Interest::READABLE };
        // Re-arming reports what is ready now: no event is lost in between.
        self.poll.registry().reregister(conn.stream(), Token(key), interest)?;
        *writable = wants;
        Ok(())
    }

    /// Closes connection `key`, logging how it ended.
    fn close(&mut self, key: usize, end: Ended) {
        self.stalls.mid_request.remove(&key);
        let Some(mut entry) = self.conns.try_remove(key) else { return };
        match (&mut entry.conn, end) {
            (Served::Torch(conn), Ended::Torch(end)) => {
                conn.log_end(end);
                let _ = self.poll.registry().deregister(conn.stream());
            }
            (Served::Rank(conn), Ended::Rank(end)) => {
                log_end(conn.peer(), Some(conn.session()), &end);
                let _ = self.poll.registry().deregister(conn.stream());
            }
            (Served::Torch(conn), _) => {
                let _ = self.poll.registry().deregister(conn.stream());
            }
            (Served::Rank(conn), _) => {
                let _ = self.poll.registry().deregister(conn.stream());
            }
        }
        // Dropping the entry closes its session: a rank's loss routes replies to its
        // peers, which the caller delivers.
        drop(entry);
        self.shared.take_routed(&mut self.scratch.routed);
    }
}
